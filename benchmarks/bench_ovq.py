"""OVQ attention against causal softmax attention: time and state memory, ratios from one run.

Usage::

    python benchmarks/bench_ovq.py            # full sizes: T = 65536, N = 1024, C = 256, d = d_v = 64
    python benchmarks/bench_ovq.py --quick    # small sizes, a few seconds
    python benchmarks/bench_ovq.py --blocked-softmax   # also time causal softmax at the target T in row blocks

What is measured and what is extrapolated
-----------------------------------------
* OVQ (``refimpl.ovq.ovq_attention``) is timed directly at every size,
  including the target ``T``.
* Causal ``refimpl.attention.softmax_attention`` forms the dense ``T x T``
  matrix (plus its ``triu_indices`` mask); at ``T = 65536`` that is 32 GiB of
  scores alone, more than the machine has.  It is timed at sizes that fit and
  its time at the target ``T`` is extrapolated as ``a T^2``, with ``a`` fitted
  to the two largest measured sizes (printed as *extrapolated*, with the cost
  per score entry at every measured size).
* With ``--blocked-softmax`` causal softmax attention is also *measured* at
  the target ``T`` in blocks of query rows, each block reading only the keys
  at or before its last row (the same output up to rounding, checked here at
  a small size).  Skipping the masked upper triangle halves the work, so that
  ratio is a conservative one.
* State memory: ``OVQState.nbytes`` after the run, and the peak of memory
  allocated during ``ovq_attention`` (``tracemalloc``; NumPy reports its
  buffers to it), at two values of ``T``.  The peak includes the ``(T, d_v)``
  output, which is also shown subtracted.

Timing (:mod:`isolated`, as ``bench_cpu.py``): every timed variant (OVQ at
one ``T``, softmax at one ``T``, the blocked softmax) runs in its own fresh
Python process, which builds the inputs, makes one untimed call and times
``--repeats`` calls (one for softmax above ``T = 4096`` and for the blocked
softmax); each variant gets ``--processes`` processes, started in turns
with the others of its group (the order reversed every other round).  A
time is the best call over all its processes.  ``--quick`` runs every
variant in this process instead: a smoke test, not a measurement.  Memory
is measured in this process (no timing).  Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from isolated import child_main, machine, run_variants  # noqa: E402  (this directory is on sys.path)
from refimpl import ovq  # noqa: E402  (after the path set-up above)
from refimpl.attention import softmax_attention  # noqa: E402
from refimpl.gmm import softmax  # noqa: E402


def blocked_causal_softmax(q, k, v, scale, rows=1024):
    """Causal softmax attention, ``rows`` query rows at a time, keys ``j <= i`` only."""
    T = q.shape[0]
    out = np.empty((T, v.shape[1]), dtype=q.dtype)
    for r0 in range(0, T, rows):
        r1 = min(r0 + rows, T)
        scores = q[r0:r1] @ k[:r1].T
        scores *= scale
        # entries j > i get -inf: rows r0..r1-1 against keys 0..r1-1
        i = np.arange(r0, r1)[:, None]
        scores[np.arange(r1)[None, :] > i] = -np.inf
        out[r0:r1] = softmax(scores, axis=1) @ v[:r1]
    return out


def peak_memory(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    result = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, result


def mib(x):
    return f"{x / 2**20:9.2f} MiB"


def sizes(quick):
    """``(T_target, N, C, d, ovq_sizes, softmax_sizes, memory_sizes)``."""
    if quick:
        return 8192, 256, 64, 32, [1024, 2048, 8192], [512, 1024, 2048], [1024, 8192]
    return 65536, 1024, 256, 64, [8192, 16384, 65536], [2048, 4096, 8192, 16384], [8192, 65536]


def inputs(T_target, d):
    """The one set of inputs every size reads the first rows of: ``q, k, v, beta, q / |q|, k / |k|``."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(T_target, n)) for n in (d, d, d))
    return q, k, v, float(np.sqrt(d)), ovq.unit_rows(q), ovq.unit_rows(k)


def variants(quick):
    """name -> factory of the zero-argument call to time (the inputs built by the factory, in the child)."""
    T_target, N, C, d, ovq_sizes, softmax_sizes, _ = sizes(quick)

    def ovq_at(T):
        def build():
            q, k, v, _, _, _ = inputs(T_target, d)
            return lambda: ovq.ovq_attention(q[:T], k[:T], v[:T], max_size=N, chunk_size=C)

        return build

    def softmax_at(T):
        def build():
            _, _, v, beta, qn, kn = inputs(T_target, d)
            # the inputs OVQ sees: unit queries and keys, scale beta
            return lambda: softmax_attention(qn[:T], kn[:T], v[:T], scale=beta, causal=True)

        return build

    def blocked():
        _, _, v, beta, qn, kn = inputs(T_target, d)
        return lambda: blocked_causal_softmax(qn, kn, v, beta)

    found = {f"ovq T={T}": ovq_at(T) for T in ovq_sizes}
    found.update({f"softmax T={T}": softmax_at(T) for T in softmax_sizes})
    found[f"blocked softmax T={T_target}"] = blocked
    return found


def timed(names, args, calls):
    """Best times (s) of ``names``: each in its own processes, or in this one with ``--quick`` (not a measurement)."""
    same = variants(args.quick) if args.quick else None

    def argv(name, calls):
        return [sys.executable, str(Path(__file__).resolve()), "--child", name, "--repeats", str(calls)]

    t = run_variants(names, argv, processes=args.processes, calls=calls, same_process=same)
    return {name: t.time(name) for name in names}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--blocked-softmax", action="store_true", help="also measure causal softmax at the target T in row blocks")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process for OVQ and the small softmax sizes")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per variant (1 with --quick)")
    parser.add_argument("--child", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(variants(False), args.child, args.repeats)
    if args.quick:
        args.processes = 1

    T_target, N, C, d, ovq_sizes, softmax_sizes, memory_sizes = sizes(args.quick)
    d_v = d

    print("OVQ attention vs causal softmax attention (refimpl, NumPy, float64)")
    print(f"machine: {machine()}")
    print(time.strftime("date: %Y-%m-%d %H:%M"))
    how = ("every variant in this one process (a smoke test, not a measurement)" if args.quick else
           f"every variant in its own process: {args.processes} processes, the best call of all")
    print(f"how: {how}")
    print(f"sizes: T_target = {T_target}, N = {N}, C = {C}, d = d_v = {d}, growth = plateau, init = spread")
    print()

    q, k, v, beta, qn, kn = inputs(T_target, d)

    def run_softmax(T):
        # the inputs OVQ sees: unit queries and keys, scale beta
        return softmax_attention(qn[:T], kn[:T], v[:T], scale=beta, causal=True)

    print(f"time (best of {args.processes} processes x {args.repeats} calls; softmax above T = 4096 and blocked: x 1)")
    found = timed([f"ovq T={T}" for T in ovq_sizes], args, args.repeats)
    ovq_times = {T: found[f"ovq T={T}"] for T in ovq_sizes}
    for T in ovq_sizes:
        print(f"  OVQ                 T = {T:6d}   {ovq_times[T]:9.3f} s   measured   ({ovq_times[T] / T * 1e6:.2f} us/token)")
    small, large = [T for T in softmax_sizes if T <= 4096], [T for T in softmax_sizes if T > 4096]
    found = {**timed([f"softmax T={T}" for T in small], args, args.repeats), **timed([f"softmax T={T}" for T in large], args, 1)}
    sm_times = {T: found[f"softmax T={T}"] for T in softmax_sizes}
    for T in softmax_sizes:
        print(f"  softmax (causal)    T = {T:6d}   {sm_times[T]:9.3f} s   measured")

    # time = a T^2 fitted (relative least squares) on the two largest sizes, where the T x T
    # matrices are far beyond every cache; smaller sizes run faster per entry (printed), so a
    # fit through them would extrapolate lower
    for T in softmax_sizes:
        print(f"  softmax cost per score entry at T = {T:6d}: {sm_times[T] / T**2 * 1e9:6.2f} ns")
    fit_sizes = softmax_sizes[-2:]
    ratios = np.array([T**2 / sm_times[T] for T in fit_sizes], dtype=float)
    a = float(np.sum(ratios) / np.sum(ratios**2))
    residual = max(abs(a * T**2 / sm_times[T] - 1) for T in fit_sizes)
    print(f"  softmax fit on T in {fit_sizes}: time = {a:.3e} T^2, max relative residual {residual:.1%}")
    sm_target = a * T_target**2
    print(f"  softmax (causal)    T = {T_target:6d}   {sm_target:9.3f} s   extrapolated from the fit")

    sm_blocked = None
    if args.blocked_softmax:
        small = 2048
        ref = run_softmax(small)
        got = blocked_causal_softmax(qn[:small], kn[:small], v[:small], beta, rows=300)
        err = float(np.max(np.abs(got - ref)))
        print(f"  blocked causal softmax == softmax_attention at T = {small}: max abs difference {err:.1e}")
        sm_blocked = timed([f"blocked softmax T={T_target}"], args, 1)[f"blocked softmax T={T_target}"]
        print(f"  softmax (causal, row blocks of 1024, keys j <= i only)  T = {T_target:6d}   {sm_blocked:9.3f} s   measured")
    print()

    print("speed-up of OVQ over causal softmax attention")
    for T in ovq_sizes:
        if T in sm_times:
            print(f"  T = {T:6d}: {sm_times[T] / ovq_times[T]:8.1f}x   (both measured)")
    ratio = sm_target / ovq_times[T_target]
    print(f"  T = {T_target:6d}: {ratio:8.1f}x   (OVQ measured, softmax extrapolated)")
    if sm_blocked is not None:
        print(f"  T = {T_target:6d}: {sm_blocked / ovq_times[T_target]:8.1f}x   (both measured; softmax in row blocks, half the work)")
    if not args.quick:
        print(f"  target >= 10x at T = {T_target}: {'met' if ratio >= 10 else 'NOT met'}")
    print()

    print("memory")
    rows = []
    for T in memory_sizes:
        peak, (out, state) = peak_memory(lambda: ovq.ovq_attention(q[:T], k[:T], v[:T], max_size=N, chunk_size=C, return_state=True))
        rows.append((T, state.nbytes, peak, out.nbytes))
        print(
            f"  T = {T:6d}: state {mib(state.nbytes)} (N (d + d_v) float64 + N int64), "
            f"peak during ovq_attention {mib(peak)}, of which output {mib(out.nbytes)}, rest {mib(peak - out.nbytes)}"
        )
    (T0, s0, p0, o0), (T1, s1, p1, o1) = rows
    print(f"  state bytes ratio T = {T1} / T = {T0}: {s1 / s0:.3f} (constant in T)")
    print(f"  peak minus output ratio: {(p1 - o1) / (p0 - o0):.3f}")
    dense = T_target * T_target * 8
    print(f"  for comparison, causal softmax's T x T float64 scores at T = {T_target}: {mib(dense)}; its KV cache: {mib(T_target * (d + d_v) * 8)}")
    print(f"machine at end: {machine()}")


if __name__ == "__main__":
    sys.exit(main())
