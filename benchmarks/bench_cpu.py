"""CPU speed against the floor of each operation's own matrix products, every variant in its own process.

Usage::

    python benchmarks/bench_cpu.py            # the sizes of docs/performance_gma.md (about 15 minutes)
    python benchmarks/bench_cpu.py --quick    # small sizes, all in one process: a smoke test, not a measurement
    python benchmarks/bench_cpu.py --sections responsibilities gma
    python benchmarks/bench_cpu.py --sections ovq --ovq-peer DIR --peer-python PY   # with the PyTorch peer

How it measures (:mod:`isolated`): every variant (a backend's function at
one dtype, a GEMM floor, a peer) runs in its own fresh Python process, which
makes one untimed call and then times ``--calls`` calls; each variant gets
``--processes`` processes, started in turns with the other variants of its
section (the order reversed every other round).  A time is the best call
over all its processes, printed with the range of the processes' bests; a
ratio is of best times; nothing is asserted.  ``--same-process`` runs a section
the old way, every variant in this process, one call of each per round, to
show what sharing a process does (``docs/performance_gmm.md``).

What is measured:

* the responsibilities at N = 200000, K = 64, d = 32: ``tuned.responsibilities``
  (the expansion of the square, screened), its GEMM floor (the two products
  ``xc**2 @ p.T`` and ``xc @ (mc * p).T`` on whole arrays, operands prepared
  beforehand), the core with and without the exactness screen,
  ``gmm.responsibilities`` (the plain reference), the Numba kernel
  ``cpu.gmm.responsibilities`` and scikit-learn's
  ``GaussianMixture(covariance_type="diag").predict_proba`` with the same
  parameters; float32 against float64; peak memory against the unblocked
  formula (measured here, not timed);
* GMA at N = 16384, K = 64, d_r = d_v = 64: ``tuned.gma`` bidirectional and
  causal, ``tuned.gma_backward`` after ``tuned.gma_forward``, the plain
  reference, and ``cpu.gma``'s, each against the floor of its matrix products
  (forward: the four of the two responsibilities and the two of the mixing,
  ``Gamma_K^T V`` and ``Gamma_Q S``; backward: the four of the mixing's
  backward and four per responsibility matrix);
* where the time goes: one element-wise pass and ``exp`` over ``N x K``
  entries in cache-sized blocks, against the GEMM rate;
* softmax attention at N = 16384: numba's online softmax against NumPy's
  dense form;
* OVQ at T = 16384 and 65536 (n_max = 1024, C = 256, d = 64), float64 and
  float32: ``cpu.ovq`` against the NumPy reference and, with ``--ovq-peer``,
  against the OVQ mixer of the KVM paper's public PyTorch code
  (``model/ovq_mixer.py`` of a clone you give; see ``ovq_peer.py``), run by
  ``--peer-python`` (an interpreter with torch);
* one training step of every mixer on ListOps at the defaults, on both
  backends (:mod:`app.backend`);
* packed against padded: a batch of 64 sequences with the lengths of 64
  ListOps expressions (up to 128 tokens), two heads of width 32, causal
  GMA (K = 16), softmax and linear attention, forward and backward, on the
  packed tokens with ``cu_seqlens`` against the batch padded to its longest
  sequence, and against the same packed call run as the loop over the
  sequences (the backend's packed kernel set aside); the speed-ups, and the
  memory saved (inputs and the traced peak); causal OVQ (n_max = 16,
  C = 16) packed against the loop only (over a padded batch OVQ would learn
  its dictionaries from the padding: another function);
* accuracy on the spread-means example (two means near +1e4, one at -1e4,
  variances 1e-8) against the definition in extended precision.

Peak memory is what ``tracemalloc`` reports during one call (NumPy reports its
array buffers to it), inputs excluded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gma import make_inputs, peak_bytes as traced_peak  # noqa: E402  (this directory is on sys.path)
from isolated import Command, machine, run_variants, child_main  # noqa: E402
from refimpl import gma, gmm, numerics, tuned  # noqa: E402

try:  # the Numba CPU backend (cpu/): its variants exist when numba is installed
    import numba
except ImportError:
    numba = None
from refimpl.testing import exact_responsibilities, row_relative_error, sklearn_gmm, spread_means_example  # noqa: E402

SCRIPT = Path(__file__).resolve()


def ms(t):
    return f"{t * 1e3:9.1f} ms"


def mib(b):
    return f"{b / 2**20:8.1f} MiB"


class Section:
    """The variants of one section (name -> factory) and how to run them: in their own processes, or here."""

    def __init__(self, key, variants, args, calls=None):
        self.key, self.variants, self.args = key, variants, args
        self.calls = calls or args.calls

    def run(self, peers=None):
        peers = peers or {}
        names = list(self.variants) + list(peers)
        a = self.args

        def argv(name, calls):
            if name in peers:
                return peers[name]
            return [sys.executable, str(SCRIPT), "--child", self.key, name, "--calls", str(calls)] + (["--quick"] if a.quick else [])

        same = self.variants if a.same_process else None
        t = run_variants(names, argv, processes=a.processes, calls=self.calls, same_process=same)
        for n in names:
            lo, hi = t.spread(n)
            spread = f"  ({lo * 1e3:.1f}-{hi * 1e3:.1f})" if len(t.best[n]) > 1 else ""
            print(f"    {n:44s} {ms(t.time(n))}{spread}   system {t.system_share(n):4.0%}")
        return t


def ratio_line(label, value, note=""):
    print(f"    {label:44s}{value:8.2f}x{('   ' + note) if note else ''}")


# ---------------------------------------------------------------------------
# Responsibilities
# ---------------------------------------------------------------------------


def gmm_inputs(n, K, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(dtype)
    means = rng.normal(size=(K, d)).astype(dtype)
    variances = rng.uniform(0.5, 2.0, size=(K, d)).astype(dtype)
    weights = np.full(K, 1.0 / K, dtype=dtype)
    return x, means, variances, weights


def responsibility_floor(x, means, variances):
    """The two products of the expansion, on whole arrays, with their operands prepared: a function to time."""
    p = 1 / variances
    centre = means.mean(axis=0)
    xc = x - centre
    xc2 = xc * xc
    p_t, cross_t = np.ascontiguousarray(p.T), np.ascontiguousarray(((means - centre) * p).T)
    return lambda: (xc2 @ p_t, xc @ cross_t)


def unblocked_responsibilities(x, means, variances, weights):
    """The one-line formula on whole arrays (every step an N x K array): the memory baseline."""
    d = x.shape[1]
    p = 1 / variances
    centre = means.mean(axis=0)
    xc, mc = x - centre, means - centre
    q = (xc * xc) @ p.T - 2 * (xc @ (mc * p).T) + np.sum(mc * mc * p, axis=1)
    logits = np.log(weights) - 0.5 * (d * np.log(2 * np.pi) + np.sum(np.log(variances), axis=1)) - 0.5 * q
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def gmm_size(quick):
    return (20_000, 16, 16) if quick else (200_000, 64, 32)


def responsibility_variants(quick):
    n, K, d = gmm_size(quick)
    out = {}
    for dtype in (np.float64, np.float32):
        name = np.dtype(dtype).name

        def inputs(dtype=dtype):
            return gmm_inputs(n, K, d, dtype)

        def tuned_r(inputs=inputs):
            x, m, v, w = inputs()
            return lambda: tuned.responsibilities(x, m, v, w)

        def floor(inputs=inputs):
            x, m, v, _ = inputs()
            return responsibility_floor(x, m, v)

        def core(refine, inputs=inputs):
            x, m, v, w = inputs()
            lw = np.log(w)
            return lambda: tuned.posterior(x, m, v, lw, refine=refine)

        def plain(inputs=inputs):
            x, m, v, w = inputs()
            return lambda: gmm.responsibilities(x, m, v, w)

        def numba_r(inputs=inputs):
            from cpu import gmm as cpu_gmm

            x, m, v, w = inputs()
            return lambda: cpu_gmm.responsibilities(x, m, v, w)

        out[f"{name} tuned"] = tuned_r
        out[f"{name} GEMM floor"] = floor
        out[f"{name} core, refined"] = lambda core=core: core(True)
        out[f"{name} core, expansion alone"] = lambda core=core: core(False)
        out[f"{name} plain reference"] = plain
        if numba is not None:
            out[f"{name} numba"] = numba_r
        if dtype == np.float64:
            def sklearn(inputs=inputs):
                x, m, v, w = inputs()
                model = sklearn_gmm(m, v, w)
                return lambda: model.predict_proba(x)

            out["float64 scikit-learn predict_proba"] = sklearn
    return out


def bench_responsibilities(args):
    n, K, d = gmm_size(args.quick)
    print(f"\n== responsibilities, N = {n}, K = {K}, d = {d}")
    t = Section("responsibilities", responsibility_variants(args.quick), args).run()
    for name in ("float64", "float32"):
        print(f"  {name}:")
        ratio_line("tuned / GEMM floor:", t.ratio(name + " tuned", name + " GEMM floor"), "(target <= 1.5)")
        if name == "float64":
            ratio_line("scikit-learn / tuned:", t.ratio("float64 scikit-learn predict_proba", "float64 tuned"), "(target >= 3)")
            ratio_line("scikit-learn / plain:", t.ratio("float64 scikit-learn predict_proba", "float64 plain reference"))
        ratio_line("plain reference / tuned:", t.ratio(name + " plain reference", name + " tuned"), "(the price of reading like the definition)")
        screen = t.ratio(name + " core, refined", name + " core, expansion alone") - 1
        print(f"    {'cost of the exactness screen:':44s}{screen:+8.1%}    (target <= 10%; a few ms: at the edge of what processes resolve)")
    x, means, variances, weights = gmm_inputs(n, K, d, np.float64)
    for dtype in (np.float64, np.float32):
        xs, ms_, vs, ws = (a.astype(dtype) for a in (x, means, variances, weights))
        lw = np.log(ws)
        same = np.array_equal(tuned.posterior(xs, ms_, vs, lw)[0], tuned.posterior(xs, ms_, vs, lw, refine=False)[0])
        print(f"    {np.dtype(dtype).name} refined == expansion bit for bit:  {same} (no entry needed recomputing)")
    if numba is not None:
        print(f"  numba ({numba.get_num_threads()} threads):")
        for name in ("float64", "float32"):
            ratio_line(f"{name} numba / GEMM floor:", t.ratio(name + " numba", name + " GEMM floor"), "(target <= 1.0 in float64)")
            ratio_line(f"{name} plain reference / numba:", t.ratio(name + " plain reference", name + " numba"))
            ratio_line(f"{name} tuned / numba:", t.ratio(name + " tuned", name + " numba"))
        ratio_line("scikit-learn / numba:", t.ratio("float64 scikit-learn predict_proba", "float64 numba"))
        ratio_line("float64 / float32 time, numba:", t.ratio("float64 numba", "float32 numba"), "(target >= 1.8)")
    ratio_line("float64 / float32 time, tuned:", t.ratio("float64 tuned", "float32 tuned"), "(target >= 1.7)")
    ratio_line("float64 / float32 time, plain:", t.ratio("float64 plain reference", "float32 plain reference"))
    blocked = traced_peak(lambda: tuned.responsibilities(x, means, variances, weights))
    definition = traced_peak(lambda: gmm.responsibilities(x, means, variances, weights))
    plain = traced_peak(lambda: unblocked_responsibilities(x, means, variances, weights))
    nk = n * K * 8
    print(f"  peak memory, float64: tuned (row-blocked) {mib(blocked)} ({blocked / nk:.2f} N x K arrays), "
          f"plain reference {mib(definition)} ({definition / nk:.2f}), unblocked expansion {mib(plain)} ({plain / nk:.2f})")
    return t


# ---------------------------------------------------------------------------
# GMA
# ---------------------------------------------------------------------------


def gma_inputs(n, K, d_r, d_v, dtype):
    """The inputs of ``bench_gma.py`` (``gma.gma_forward``'s keywords), in ``dtype``."""
    return {k: a.astype(dtype) for k, a in make_inputs(n, K, d_r, d_v).items()}


def gma_floors(n, K, d_r, d_v, dtype, seed=1):
    """The matrix products of GMA's forward and backward on whole arrays of the right shapes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_r)).astype(dtype)  # a centred x or its square
    w = rng.normal(size=(d_r, K)).astype(dtype)  # -p^T / 2 or (mc p)^T
    gamma = rng.uniform(size=(n, K)).astype(dtype)
    v = rng.normal(size=(n, d_v)).astype(dtype)
    s = rng.normal(size=(K, d_v)).astype(dtype)
    wt = np.ascontiguousarray(w.T)

    def forward():
        for _ in range(4):  # two products per responsibility matrix, two matrices
            x @ w
        gamma.T @ v  # S = Gamma_K^T V
        gamma @ s  # Gamma_Q S

    def backward():
        gamma.T @ v  # dS = Phi_Q^T G~
        v @ s.T  # dPhi_Q = G~ S^T
        v @ s.T  # dPhi_K = V dS^T
        gamma @ s  # dV = Phi_K dS
        for _ in range(2):  # per responsibility matrix: c^T xc, c^T xc^2, c (mc p), c p
            gamma.T @ x
            gamma.T @ x
            gamma @ wt
            gamma @ wt

    return forward, backward


def gma_size(quick):
    return (2_048, 16, 16) if quick else (16_384, 64, 64)


GMA_OPS = ("bidirectional forward", "causal forward", "bidirectional backward", "causal backward")


def gma_variants(quick):
    n, K, d = gma_size(quick)
    out = {}
    for dtype in (np.float64, np.float32):
        name = np.dtype(dtype).name

        def module(which):
            if which == "tuned":
                return tuned
            if which == "plain":
                return gma
            from cpu import gma as cpu_gma

            return cpu_gma

        def forward(which, causal, dtype=dtype):
            mod = module(which)
            inp = gma_inputs(n, K, d, d, dtype)
            variances = (np.logaddexp(0, inp["raw_variances"]) + 1e-6).astype(dtype)
            weights = np.exp(inp["logits"] - inp["logits"].max())
            weights = (weights / weights.sum()).astype(dtype)
            args = (inp["x_q"], inp["x_k"], inp["v"], inp["means"], variances, weights)
            return lambda: mod.gma(*args, causal=causal)

        def backward(which, causal, dtype=dtype):
            mod = module(which)
            out_, cache = mod.gma_forward(**gma_inputs(n, K, d, d, dtype), causal=causal)
            return lambda: mod.gma_backward(out_, cache)

        def floor(which, dtype=dtype):
            f, b = gma_floors(n, K, d, d, dtype)
            return f if which == "forward" else b

        whiches = ["tuned", "plain"] + (["numba"] if numba is not None else [])
        for which in whiches:
            label = "" if which == "tuned" else which + " "
            out[f"{name} {label}bidirectional forward"] = lambda w=which, f=forward: f(w, False)
            out[f"{name} {label}causal forward"] = lambda w=which, f=forward: f(w, True)
            out[f"{name} {label}bidirectional backward"] = lambda w=which, b=backward: b(w, False)
            if which != "plain":
                out[f"{name} {label}causal backward"] = lambda w=which, b=backward: b(w, True)
        out[f"{name} forward GEMM floor"] = lambda fl=floor: fl("forward")
        out[f"{name} backward GEMM floor"] = lambda fl=floor: fl("backward")
    return out


def bench_gma(args):
    n, K, d = gma_size(args.quick)
    print(f"\n== GMA, N = {n}, K = {K}, d_r = d_v = {d}")
    t = Section("gma", gma_variants(args.quick), args).run()
    floors = {"bidirectional forward": "forward", "causal forward": "forward", "bidirectional backward": "backward",
              "causal backward": "backward"}
    for name in ("float64", "float32"):
        print(f"  {name}:")
        ratio_line("bidirectional / floor:", t.ratio(name + " bidirectional forward", name + " forward GEMM floor"), "(target <= 2)")
        ratio_line("causal / floor:", t.ratio(name + " causal forward", name + " forward GEMM floor"), "(target <= 3)")
        ratio_line("backward / floor:", t.ratio(name + " bidirectional backward", name + " backward GEMM floor"), "(target <= 3)")
        ratio_line("causal backward / floor:", t.ratio(name + " causal backward", name + " backward GEMM floor"))
        for op in ("bidirectional forward", "causal forward", "bidirectional backward"):
            ratio_line(f"plain / tuned, {op}:", t.ratio(f"{name} plain {op}", f"{name} {op}"))
    for op in GMA_OPS:
        ratio_line(f"float64 / float32, {op}:", t.ratio("float64 " + op, "float32 " + op), "(target >= 1.7)")
    if numba is not None:
        print(f"  numba ({numba.get_num_threads()} threads):")
        targets = {"bidirectional forward": 1.5, "causal forward": 2.0, "bidirectional backward": 2.0, "causal backward": 2.0}
        for name in ("float64", "float32"):
            for op, target in targets.items():
                r = t.ratio(f"{name} numba {op}", f"{name} {floors[op]} GEMM floor")
                faster = t.ratio(f"{name} {op}", f"{name} numba {op}")
                print(f"    {name} {op + ' / floor:':32s}{r:6.2f}x   (target <= {target})   tuned / numba {faster:5.2f}x   (target >= 1)")
        for op in GMA_OPS:
            ratio_line(f"float64 / float32, numba {op}:", t.ratio("float64 numba " + op, "float32 numba " + op), "(target >= 1.8)")
    inp = gma_inputs(n, K, d, d, np.float64)
    nk = n * K * 8
    for causal in (False, True):
        fwd = traced_peak(lambda: tuned.gma_forward(**inp, causal=causal))
        out, cache = tuned.gma_forward(**inp, causal=causal)
        bwd = traced_peak(lambda: tuned.gma_backward(out, cache))
        label = "causal" if causal else "bidirectional"
        print(f"  peak memory, float64, {label:13s}: forward {mib(fwd)} ({fwd / nk:.2f} N x K arrays), "
              f"backward {mib(bwd)} ({bwd / nk:.2f})")
    return t


# ---------------------------------------------------------------------------
# Where the time goes
# ---------------------------------------------------------------------------


def rate_variants(quick):
    n, K, d = gmm_size(quick)
    rows = numerics.block_rows((4 * K + 2 * d) * 8)  # the blocks of refimpl.tuned: 4K + 2d numbers a row
    blocks = -(-n // rows)

    def passes(op_of):
        def make():
            rng = np.random.default_rng(0)
            a = rng.normal(size=(rows, K))
            b = np.empty_like(a)
            x = rng.normal(size=(rows, d))
            w = rng.normal(size=(d, K))
            op = op_of(a, b, x, w)

            def run():
                for _ in range(blocks):
                    op()
            return run
        return make

    return {
        "one element-wise pass (add)": passes(lambda a, b, x, w: lambda: np.add(a, a, out=b)),
        "exp": passes(lambda a, b, x, w: lambda: np.exp(a, out=b)),
        "the two GEMMs": passes(lambda a, b, x, w: lambda: (np.matmul(x, w, out=b), np.matmul(x, w, out=b))),
    }


def bench_rates(args):
    """The rate of the three kinds of work in the responsibilities, measured on the same machine now."""
    n, K, d = gmm_size(args.quick)
    rows = numerics.block_rows((4 * K + 2 * d) * 8)
    print(f"\n== where the time goes: N x K = {n} x {K} entries, float64, blocks of {rows} rows")
    t = Section("rates", rate_variants(args.quick), args).run()
    flops = 2 * 2 * n * d * K
    entries = n * K
    for name in t.best:
        print(f"    {name:30s} {t.time(name) / entries * 1e9:6.2f} ns per entry")
    print(f"    GEMM rate: {flops / t.time('the two GEMMs') / 1e9:.0f} GFLOP/s on {os.cpu_count()} cores; "
          f"NumPy's element-wise loops run on one core")
    ratio_line("exp / the two GEMMs:", t.ratio("exp", "the two GEMMs"))
    ratio_line("one pass / the two GEMMs:", t.ratio("one element-wise pass (add)", "the two GEMMs"))
    return t


# ---------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------


def accuracy():
    xs, ms_, vs, ws = spread_means_example(n=200)
    exact = exact_responsibilities(xs, ms_, vs, ws)
    with np.errstate(all="ignore"):
        errors = {
            "gmm.responsibilities (definition)": row_relative_error(gmm.responsibilities(xs, ms_, vs, ws), exact),
            "tuned.responsibilities (screened)": row_relative_error(tuned.responsibilities(xs, ms_, vs, ws), exact),
            "expansion alone (no refinement)": row_relative_error(tuned.posterior(xs, ms_, vs, np.log(ws), refine=False)[0], exact),
            "scikit-learn predict_proba": row_relative_error(sklearn_gmm(ms_, vs, ws).predict_proba(xs), exact),
        }
        if numba is not None:
            from cpu import gmm as cpu_gmm

            errors["cpu.gmm.responsibilities (numba)"] = row_relative_error(cpu_gmm.responsibilities(xs, ms_, vs, ws), exact)
    print("\n== spread means (two near +1e4, one at -1e4, variances 1e-8): largest relative error per row")
    for name, e in errors.items():
        print(f"    {name:34s} {e:9.2e}")


# ---------------------------------------------------------------------------
# Softmax attention, OVQ, training
# ---------------------------------------------------------------------------


def attention_variants(quick):
    from refimpl import attention

    n, d = (1_024 if quick else 16_384), 64
    out = {}
    for dtype in (np.float64, np.float32):
        name = np.dtype(dtype).name
        for causal in (False, True):
            label = f"{name} {'causal' if causal else 'bidirectional'}"

            def dense(dtype=dtype, causal=causal):
                q, k, v = np.random.default_rng(3).normal(size=(3, n, d)).astype(dtype)
                return lambda: attention.softmax_attention(q, k, v, causal=causal)

            def online(dtype=dtype, causal=causal):
                from cpu import attention as cpu_attention

                q, k, v = np.random.default_rng(3).normal(size=(3, n, d)).astype(dtype)
                return lambda: cpu_attention.softmax_attention(q, k, v, causal=causal)

            out[f"{label} dense numpy"] = dense
            out[f"{label} numba online"] = online
    return out


def bench_attention(args):
    """Softmax attention: numba's online softmax (no N x N matrix) against NumPy's dense form, time and peak memory."""
    from refimpl import attention

    n, d = (1_024 if args.quick else 16_384), 64
    print(f"\n== softmax attention, N = {n}, d = d_v = {d}")
    if numba is None:
        print("    numba is not installed: nothing to compare")
        return None
    from cpu import attention as cpu_attention

    variants = attention_variants(args.quick)
    t = Section("attention", variants, args, calls=min(args.calls, 3)).run()
    for label in [k[: -len(" dense numpy")] for k in variants if k.endswith("dense numpy")]:
        ratio_line(f"{label} numba / dense:", t.ratio(label + " numba online", label + " dense numpy"), "(target <= 1.5)")
    q, k, v = np.random.default_rng(3).normal(size=(3, n, d))
    online = traced_peak(lambda: cpu_attention.softmax_attention(q, k, v))
    dense = traced_peak(lambda: attention.softmax_attention(q, k, v))
    print(f"  peak memory, float64: numba online {mib(online)} ({online / (n * d * 8):.2f} N x d arrays), dense {mib(dense)} "
          f"({dense / (n * n * 8):.2f} N x N arrays)")
    return t


def ovq_sizes(quick):
    return (2_048,) if quick else (16_384, 65_536)


def ovq_inputs(T, dtype):
    return tuple(np.random.default_rng(4).normal(size=(3, T, 64)).astype(dtype))


def ovq_variants(quick):
    from refimpl import ovq

    out = {}
    for dtype in (np.float64, np.float32):
        name = np.dtype(dtype).name
        for T in ovq_sizes(quick):
            def reference(T=T, dtype=dtype):
                q, k, v = ovq_inputs(T, dtype)
                return lambda: ovq.ovq_attention(q, k, v, max_size=1024, chunk_size=256)

            def kernels(T=T, dtype=dtype):
                from cpu import ovq as cpu_ovq

                q, k, v = ovq_inputs(T, dtype)
                return lambda: cpu_ovq.ovq_attention(q, k, v, max_size=1024, chunk_size=256)

            if dtype == np.float64:
                out[f"T = {T} {name} numpy"] = reference
            if numba is not None:
                out[f"T = {T} {name} numba"] = kernels
    return out


def bench_ovq(args):
    """OVQ attention (n_max = 1024, C = 256, d = 64): numba's kernels against the NumPy reference and the PyTorch peer."""
    print("\n== OVQ attention, n_max = 1024, C = 256, d = 64")
    if numba is None:
        print("    numba is not installed: nothing to compare")
        return None
    peers = {}
    if args.ovq_peer:
        for dtype in ("float64", "float32"):
            for T in ovq_sizes(args.quick):
                peers[f"T = {T} {dtype} torch peer"] = lambda calls, T=T, dtype=dtype: Command(
                    [args.peer_python, str(SCRIPT.parent / "ovq_peer.py"), args.ovq_peer, "--T", str(T), "--dtype", dtype,
                     "--calls", str(calls)])
    calls = min(args.calls, 3)
    t = Section("ovq", ovq_variants(args.quick), args, calls=calls).run({n: f(calls) for n, f in peers.items()})
    for T in ovq_sizes(args.quick):
        ratio_line(f"T = {T}: numpy / numba, float64:", t.ratio(f"T = {T} float64 numpy", f"T = {T} float64 numba"))
        for dtype in ("float64", "float32"):
            key = f"T = {T} {dtype} torch peer"
            if key in t.best:
                ratio_line(f"T = {T}: torch peer / numba, {dtype}:", t.ratio(key, f"T = {T} {dtype} numba"), "(target >= 2)")
    if not peers:
        print("    the PyTorch peer was not run: pass --ovq-peer DIR (a clone of the KVM paper's code) and --peer-python PY")
    return t


def varlen_problem(quick, dtype=np.float64):
    """A batch of 64 sequences (8 with ``--quick``) with ListOps lengths: ``(lengths, packed (T, H, d) q, k, v, GMM)``."""
    from app import tasks

    S, H, d, K = (8 if quick else 64), 2, 32, 16
    x, _ = tasks.listops_splits(S, 1, 1, seed=0)["train"]
    lengths = np.sum(x != tasks.PAD_ID, axis=1)
    rng = np.random.default_rng(4)
    q, k, v = (0.5 * rng.normal(size=(3, int(lengths.sum()), H, d))).astype(dtype)
    mixture = (rng.normal(size=(H, K, d)).astype(dtype), rng.normal(size=(H, K, d)).astype(dtype),
               rng.normal(size=(H, K)).astype(dtype))
    return lengths, (q, k, v), mixture


def padded(packed, lengths):
    """The packed ``(T, H, d)`` tokens padded with zeros to the longest sequence: ``(S, H, N, d)``."""
    out = np.zeros((len(lengths), packed.shape[1], int(lengths.max()), packed.shape[2]), dtype=packed.dtype)
    for s, (a, n) in enumerate(zip(np.concatenate([[0], np.cumsum(lengths)]), lengths)):
        out[s, :, :n] = packed[a : a + n].transpose(1, 0, 2)
    return out


#: The varlen section's OVQ (the ListOps model's options), timed packed and as the loop only.
OVQ_VARLEN = "causal OVQ (n_max = 16, C = 16)"


def varlen_calls(quick):
    """``{mechanism: (padded step, packed step, packed step by the loop)}``: one forward and backward of each, on the CPU
    kernels (tuned and the reference without numba); the last runs the packed call as the loop over the sequences, the
    backend's packed kernel set aside."""
    if numba is not None:
        from cpu import attention as attn
        from cpu import gma as gma_kernels
        from cpu import ovq as ovq_kernels
    else:
        from refimpl import attention as attn
        from refimpl import ovq as ovq_kernels

        gma_kernels = tuned
    lengths, tokens, mixture = varlen_problem(quick)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    batch = tuple(padded(a, lengths) for a in tokens)
    steps = {
        "causal GMA": (lambda *t, **kw: gma_kernels.gma_forward(*t, *mixture, causal=True, **kw), gma_kernels.gma_backward),
        "causal softmax attention": (lambda *t, **kw: attn.softmax_attention_forward(*t, causal=True, **kw),
                                     attn.softmax_attention_backward),
        "causal linear attention": (lambda *t, **kw: attn.linear_attention_forward(*t, causal=True, **kw), attn.linear_attention_backward),
    }
    # OVQ over a padded batch learns its dictionaries from the padding tokens too: another function, so packed only
    unpadded = {OVQ_VARLEN: (lambda *t, **kw: ovq_kernels.ovq_attention_forward(*t, max_size=16, chunk_size=16, **kw),
                             ovq_kernels.ovq_attention_backward)}
    records = {"causal GMA": gma_kernels.gma_forward, "causal softmax attention": attn.softmax_attention_forward,
               "causal linear attention": attn.linear_attention_forward, OVQ_VARLEN: ovq_kernels.ovq_attention_forward}

    def step(forward, backward, arrays, **kw):
        def call():
            out, cache = forward(*arrays, **kw)
            return backward(np.ones_like(out), cache)
        return call

    def loop(public, call):
        """``call`` with the packed kernels of ``public``'s backend set aside: the per-sequence loop of the boundary."""
        def run():
            kernels = getattr(public, "backend", None) and public.backend.kernels or {}
            aside = {key: kernels.pop(key) for key in list(kernels) if key.startswith("packed ")}
            try:
                return call()
            finally:
                kernels.update(aside)
        return run

    return {name: (step(f, b, batch) if name in steps else None, step(f, b, tokens, cu_seqlens=cu_seqlens),
                   loop(records[name], step(f, b, tokens, cu_seqlens=cu_seqlens))) for name, (f, b) in {**steps, **unpadded}.items()}


def varlen_variants(quick):
    out = {}
    for name in varlen_calls(quick):
        for i, form in enumerate(("padded", "packed", "packed loop")):
            if not (form == "padded" and name == OVQ_VARLEN):
                out[f"{name} {form}"] = lambda name=name, i=i: varlen_calls(quick)[name][i]
    return out


def bench_varlen(args):
    """Packed against padded: the speed-up of a packed batch of ListOps lengths, and the memory it saves."""
    lengths, tokens, _ = varlen_problem(args.quick)
    S, T, N = len(lengths), int(lengths.sum()), int(lengths.max())
    print(f"\n== packed against padded: {S} sequences of ListOps lengths ({lengths.min()} to {N} tokens), "
          f"T = {T} tokens packed, {S} x {N} = {S * N} padded ({1 - T / (S * N):.0%} padding), 2 heads of 32, float64")
    t = Section("varlen", varlen_variants(args.quick), args).run()
    calls = varlen_calls(args.quick)
    for name in calls:
        if calls[name][0] is not None:
            ratio_line(f"{name} padded / packed:", t.ratio(name + " padded", name + " packed"), "(the speed-up of packing)")
    for name in calls:
        ratio_line(f"{name} loop / packed:", t.ratio(name + " packed loop", name + " packed"),
                   "(one kernel call against one call per sequence)")
    inputs = sum(a.nbytes for a in tokens)
    print(f"  inputs q, k, v: packed {mib(inputs)}, padded {mib(inputs * S * N / T)}")
    for name, (pad_call, pack_call, _) in calls.items():
        # each call made once untraced first: loading or compiling its kernels allocates too, and is not the call's memory
        pack_call()
        pack_peak = traced_peak(pack_call)
        if pad_call is None:
            print(f"  peak memory, {name:26s}: packed {mib(pack_peak)} (padded OVQ is another function: not compared)")
            continue
        pad_call()
        pad_peak = traced_peak(pad_call)
        print(f"  peak memory, {name:26s}: padded {mib(pad_peak)}, packed {mib(pack_peak)}, saved {1 - pack_peak / pad_peak:.0%}")
    return t


def training_variants(quick):
    """Per mixer: NumPy, the ``numba`` backend (per function the faster, :data:`app.backend.FASTEST`), and, where that
    takes NumPy's functions, cpu's kernels all the same (the measurement behind the choice)."""
    from app import backend, model, train

    out = {}
    for mixer in model.MIXERS:
        names = [("numpy", "numpy", None)]
        if numba is not None:
            names.append(("numba", "numba", None))
            if backend.FASTEST[mixer] != "cpu":
                names.append(("numba, cpu kernels", "numba", "cpu"))
        for label, name, force in names:
            def make(mixer=mixer, name=name, force=force):
                config = train.quick_config() if quick else train.TrainConfig(n_train=256, n_val=16, n_test=16)
                splits = train.load_data(config)
                tokens, targets = (a[: config.batch_size] for a in splits["train"])
                mcfg = train.model_config(config._replace(mixer=mixer))
                params = model.init_params(mcfg, 0)
                fastest = dict(backend.FASTEST, **({mixer: force} if force else {}))

                def step():
                    backend.use(name)
                    saved = dict(backend.FASTEST)
                    backend.FASTEST.update(fastest)
                    try:
                        model.loss_and_grads(params, tokens, targets, mcfg)
                    finally:
                        backend.FASTEST.update(saved)
                return step

            out[f"{mixer} {label}"] = make
    return out


def bench_training(args):
    """One training step (forward, backward) of every mixer on ListOps at the defaults, on both backends."""
    from app import model, train

    config = train.quick_config() if args.quick else train.TrainConfig(n_train=256, n_val=16, n_test=16)
    print(f"\n== one training step on ListOps, batch {config.batch_size}, d_model {config.d_model}, {config.heads} heads")
    t = Section("training", training_variants(args.quick), args, calls=max(args.calls, 10)).run()
    if numba is not None:
        for mixer, target in zip(model.MIXERS, (2.0, None, None, 3.0)):
            shown = f"(target >= {target})" if target else ""
            ratio_line(f"{mixer} numpy / numba:", t.ratio(mixer + " numpy", mixer + " numba"), shown)
            if f"{mixer} numba, cpu kernels" in t.best:
                ratio_line(f"{mixer} numpy / cpu kernels:", t.ratio(mixer + " numpy", mixer + " numba, cpu kernels"),
                           "(below 1: the numba backend takes NumPy's)")
    return t


SECTIONS = {
    "responsibilities": (responsibility_variants, bench_responsibilities),
    "gma": (gma_variants, bench_gma),
    "rates": (rate_variants, bench_rates),
    "attention": (attention_variants, bench_attention),
    "ovq": (ovq_variants, bench_ovq),
    "training": (training_variants, bench_training),
    "varlen": (varlen_variants, bench_varlen),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, every variant in this process: a smoke test")
    parser.add_argument("--processes", type=int, default=None, help="fresh processes per variant (default 3; 1 with --quick)")
    parser.add_argument("--calls", type=int, default=None, help="timed calls per process (default 5; 1 with --quick)")
    parser.add_argument("--same-process", action="store_true", help="every variant in this process, the old way")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--ovq-peer", metavar="DIR", help="a clone of the KVM paper's code: time its model/ovq_mixer.py")
    parser.add_argument("--peer-python", metavar="PY", default=sys.executable, help="the interpreter (with torch) for the peer")
    parser.add_argument("--child", nargs=2, metavar=("SECTION", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.processes = args.processes or (1 if args.quick else 3)
    args.calls = args.calls or (1 if args.quick else 5)
    if args.child:
        section, name = args.child
        return child_main(SECTIONS[section][0](args.quick), name, args.calls)
    args.same_process = args.same_process or args.quick
    how = ("every variant in this one process, one call of each per round (not a measurement)" if args.same_process else
           f"every variant in its own process: {args.processes} processes x {args.calls} timed calls, the best of all")
    print(f"machine: {machine()}")
    print(time.strftime("date: %Y-%m-%d %H:%M"))
    print(f"how: {how}")
    if numba is not None:
        print(f"numba {numba.__version__}, {numba.get_num_threads()} threads, threading layer {numba.config.THREADING_LAYER}")
    for key in args.sections:
        SECTIONS[key][1](args)
    if "responsibilities" in args.sections:
        accuracy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
