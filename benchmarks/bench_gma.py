"""Speed and peak memory of Gaussian Mixture Attention against dense softmax attention.

Prints the wall-clock times and the peak memory measured in this one run, and
the ratios between them; nothing is asserted.  Full size (the numbers quoted
in ``docs/performance_gma.md``)::

    python benchmarks/bench_gma.py                # N = 16384, K = 64, d_r = d_v = 64, float64
    python benchmarks/bench_gma.py --backward     # also time forward + backward
    python benchmarks/bench_gma.py --quick        # small sizes, one process: a smoke test, not a measurement

Timing (:mod:`isolated`, as ``bench_cpu.py``): every variant (a mechanism,
causal or not, forward or forward + backward) runs in its own fresh Python
process, which builds its inputs, makes one untimed call and times
``--repeats`` calls (``--softmax-repeats`` for the dense baseline, which
takes seconds per call); each variant gets ``--processes`` processes,
started in turns with the others (the order reversed every other round).  A
time is the best call over all its processes; a ratio is of best times.
Memory: the peak that ``tracemalloc`` reports during one call (NumPy reports
its array buffers to it), inputs excluded because they are created before
tracing starts; measured in this process (no timing).  GMA runs on
:mod:`refimpl.tuned`, the fast path that training and the experiments use
(``bench_cpu.py`` times the plain reference beside it).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from isolated import child_main, machine, run_variants  # noqa: E402  (this directory is on sys.path)
from refimpl import attention, scan  # noqa: E402
from refimpl import tuned as gma  # noqa: E402  (the fast path; refimpl.gma is the plain reference)


def make_inputs(n, K, d_r, d_v, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        x_q=rng.normal(size=(n, d_r)),
        x_k=rng.normal(size=(n, d_r)),
        v=rng.normal(size=(n, d_v)),
        means=rng.normal(size=(K, d_r)),
        raw_variances=rng.normal(size=(K, d_r)) + 2.0,
        logits=rng.normal(size=K),
    )


def gma_call(inp, causal, backward, chunk_size):
    if backward:
        out, cache = gma.gma_forward(**inp, causal=causal, chunk_size=chunk_size)
        gma.gma_backward(out, cache)
        return
    variances = np.logaddexp(0.0, inp["raw_variances"]) + 1e-6
    weights = np.exp(inp["logits"] - inp["logits"].max())
    weights /= weights.sum()
    gma.gma(inp["x_q"], inp["x_k"], inp["v"], inp["means"], variances, weights, causal=causal, chunk_size=chunk_size)


def softmax_call(inp, causal, backward):
    if backward:
        out, cache = attention.softmax_attention_forward(inp["x_q"], inp["x_k"], inp["v"], causal=causal)
        attention.softmax_attention_backward(out, cache)
        return
    attention.softmax_attention(inp["x_q"], inp["x_k"], inp["v"], causal=causal)


def linear_call(inp, causal, backward, chunk_size):
    if backward:
        out, cache = attention.linear_attention_forward(inp["x_q"], inp["x_k"], inp["v"], causal=causal, chunk_size=chunk_size)
        attention.linear_attention_backward(out, cache)
        return
    attention.linear_attention(inp["x_q"], inp["x_k"], inp["v"], causal=causal, chunk_size=chunk_size)


def peak_bytes(fn):
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def fmt_bytes(b):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b} B"
        b /= 1024


MECHANISMS = ("softmax", "gma", "linear")


def variant(mechanism, causal, backward):
    """The name of one timed variant, e.g. ``"gma causal forward + backward"``."""
    return f"{mechanism} {'causal' if causal else 'bidirectional'} {'forward + backward' if backward else 'forward'}"


def variants(n, K, d, chunk_size):
    """name -> factory of the zero-argument call to time (its inputs built by the factory, in the child)."""

    def factory(mechanism, causal, backward):
        def build():
            inp = make_inputs(n, K, d, d)
            if mechanism == "softmax":
                return lambda: softmax_call(inp, causal, backward)
            call = gma_call if mechanism == "gma" else linear_call
            return lambda: call(inp, causal, backward, chunk_size)

        return build

    return {variant(m, c, b): factory(m, c, b) for m in MECHANISMS for c in (False, True) for b in (False, True)}


def timed(names, args, calls):
    """Best times of ``names``: each in its own processes, or in this one with ``--quick`` (not a measurement)."""
    same = variants(args.n, args.k, args.d, args.chunk_size) if args.quick else None

    def argv(name, calls):
        return [sys.executable, str(Path(__file__).resolve()), "--child", name, "--n", str(args.n), "--k", str(args.k),
                "--d", str(args.d), "--chunk-size", str(args.chunk_size), "--repeats", str(calls)]

    t = run_variants(names, argv, processes=args.processes, calls=calls, same_process=same)
    return {name: t.time(name) for name in names}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (N = 2048, memory at 512 and 4096)")
    p.add_argument("--n", type=int, default=16384, help="sequence length for the timing and the memory comparison")
    p.add_argument("--k", type=int, default=64, help="number of Gaussian components K")
    p.add_argument("--d", type=int, default=64, help="d_r = d_v")
    p.add_argument("--chunk-size", type=int, default=scan.DEFAULT_CHUNK_SIZE)
    p.add_argument("--repeats", type=int, default=5, help="calls per linear-time timing (best is kept)")
    p.add_argument("--softmax-repeats", type=int, default=1, help="calls per dense softmax timing")
    p.add_argument("--mem-small", type=int, default=8192, help="short N of the linear-memory ratio")
    p.add_argument("--mem-large", type=int, default=65536, help="long N of the linear-memory ratio")
    p.add_argument("--backward", action="store_true", help="also time and measure forward + backward")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per variant (1 with --quick)")
    p.add_argument("--child", metavar="VARIANT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(variants(args.n, args.k, args.d, args.chunk_size), args.child, args.repeats)
    if args.quick:
        args.n, args.mem_small, args.mem_large, args.repeats, args.processes = 2048, 512, 4096, 2, 1

    n, K, d, C = args.n, args.k, args.d, args.chunk_size
    print(f"# GMA benchmark: N = {n}, K = {K}, d_r = d_v = {d}, float64, chunk size {C}")
    print(f"machine: {machine()}")
    print(time.strftime("date: %Y-%m-%d %H:%M"))
    how = ("every variant in this one process (a smoke test, not a measurement)" if args.quick else
           f"every variant in its own process: {args.processes} processes, the best call of all")
    print(f"how: {how}")
    inp = make_inputs(n, K, d, d)
    passes = [("forward", False)] + ([("forward + backward", True)] if args.backward else [])

    for label, bwd in passes:
        print(f"\n## time, {label} (best of {args.processes} x {args.repeats} calls; softmax {args.processes} x "
              f"{args.softmax_repeats})\n")
        linear_time = timed([variant(m, c, bwd) for c in (False, True) for m in ("gma", "linear")], args, args.repeats)
        dense = timed([variant("softmax", c, bwd) for c in (False, True)], args, args.softmax_repeats)
        t = {}
        for causal in (False, True):
            name = "causal" if causal else "bidirectional"
            t["softmax", causal] = dense[variant("softmax", causal, bwd)]
            t["gma", causal] = linear_time[variant("gma", causal, bwd)]
            t["linear", causal] = linear_time[variant("linear", causal, bwd)]
            print(f"{name:14s} softmax {t['softmax', causal]:9.3f} s   gma {t['gma', causal]:8.4f} s   linear {t['linear', causal]:8.4f} s")
        print()
        print(f"speed-up, bidirectional GMA vs softmax attention:      {t['softmax', False] / t['gma', False]:8.1f}x  (target >= 20x)")
        print(f"speed-up, causal GMA vs causal softmax attention:      {t['softmax', True] / t['gma', True]:8.1f}x  (target >= 10x)")
        print(f"speed-up, causal GMA vs bidirectional softmax:         {t['softmax', False] / t['gma', True]:8.1f}x")

    for label, bwd in passes:
        print(f"\n## peak memory (tracemalloc), {label}\n")
        mem = {}
        for causal in (False, True):
            name = "causal" if causal else "bidirectional"
            for m in (args.mem_small, n, args.mem_large):
                if ("gma", causal, m) not in mem:
                    big = make_inputs(m, K, d, d)
                    mem["gma", causal, m] = peak_bytes(lambda: gma_call(big, causal, bwd, C))
                    del big
            mem["softmax", causal] = peak_bytes(lambda: softmax_call(inp, causal, bwd))
            sizes = "   ".join(f"N={m}: {fmt_bytes(mem['gma', causal, m])}" for m in sorted({args.mem_small, n, args.mem_large}))
            print(f"{name:14s} gma  {sizes}")
            print(f"{name:14s} softmax N={n}: {fmt_bytes(mem['softmax', causal])}")
        print()
        for causal in (False, True):
            name = "causal" if causal else "bidirectional"
            growth = mem["gma", causal, args.mem_large] / mem["gma", causal, args.mem_small]
            share = mem["gma", causal, n] / mem["softmax", causal]
            print(
                f"peak memory, {name} GMA: N={args.mem_large} / N={args.mem_small} = {growth:5.2f} "
                f"(tokens x{args.mem_large / args.mem_small:g}; target <= 10)"
            )
            print(f"peak memory, {name} GMA / softmax at N={n}: 1/{1 / share:.0f}  (target <= 1/20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
