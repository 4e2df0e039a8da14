"""CPU speed against the floor of each operation's own matrix products, in one run.

Usage::

    python benchmarks/bench_cpu.py            # the sizes of docs/performance_gma.md (about a minute)
    python benchmarks/bench_cpu.py --quick    # small sizes, a few seconds

What is measured (wall clock over ``--repeats`` rounds, one call of every
variant of a section per round, so that the load of a shared machine falls
on all alike; a time is the best of the rounds, a ratio is of best times,
except the price of the exactness screen, a few percent of one call, which is
the median over the rounds of the ratio of two calls made back to back):

* the responsibilities at N = 200000, K = 64, d = 32: ``tuned.responsibilities``
  (the fast path: the expansion of the square, screened), its GEMM floor (the
  two products ``xc**2 @ p.T`` and ``xc @ (mc * p).T`` on whole arrays,
  operands prepared beforehand), the ratio, scikit-learn's
  ``GaussianMixture(covariance_type="diag").predict_proba`` with the same
  parameters, ``gmm.responsibilities`` (the plain reference: the definition,
  from the differences), the price of the exactness screen (the core with and
  without the refinement), float32 against float64, and the peak memory
  against the unblocked formula;
* GMA at N = 16384, K = 64, d_r = d_v = 64: ``tuned.gma`` bidirectional and
  causal, ``tuned.gma_backward`` after ``tuned.gma_forward``, each against the
  floor of its matrix products (forward: the four of the two
  responsibilities and the two of the mixing, ``Gamma_K^T V`` and
  ``Gamma_Q S``; backward: the four of the mixing's backward and four per
  responsibility matrix), the plain reference ``gma`` against it, float32
  against float64, peak memory;
* where the rest of the time goes: the rate of one element-wise pass and of
  ``exp`` over ``N x K`` entries in cache-sized blocks, against the GEMM rate;
* with numba installed, the Numba CPU backend (:mod:`cpu`) in every section:
  its time against the GEMM floor, scikit-learn, the plain reference and the
  tuned path, its float32/float64 ratio, and the threads it used;
* softmax attention at N = 16384: numba's online softmax against NumPy's
  dense form (time, and peak memory: no N x N matrix);
* OVQ at T = 16384 and 65536 (n_max = 1024, C = 256, d = 64): numba against
  the NumPy reference;
* one training step of every mixer on ListOps at the defaults, on both
  backends (:mod:`app.backend`);
* accuracy on the spread-means example (two means near +1e4, one at -1e4,
  variances 1e-8) against the definition in extended precision.

Peak memory is what ``tracemalloc`` reports during one call (NumPy reports its
array buffers to it), inputs excluded.  Nothing here is asserted; the ratios
are the point, because the machines are shared and absolute times drift.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gma import make_inputs, peak_bytes as traced_peak  # noqa: E402  (this directory is sys.path[0])
from refimpl import gma, gmm, numerics, tuned  # noqa: E402

try:  # the Numba CPU backend (cpu/): its columns are printed when numba is installed
    import numba
    from cpu import gma as cpu_gma, gmm as cpu_gmm
except ImportError:
    numba = None
from refimpl.testing import exact_responsibilities, row_relative_error, sklearn_gmm, spread_means_example  # noqa: E402


def interleaved(fns, repeats):
    """Wall-clock times of each function over ``repeats`` rounds, one call of each per round.

    Returns ``{name: array of times}``; the interleaving makes the load of a
    shared machine fall on every function alike.
    """
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: first-touch page faults and BLAS thread start-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: np.array(t) for name, t in times.items()}


def timed_rounds(fns, repeats):
    """:func:`interleaved`, then each function's best time printed."""
    t = interleaved(fns, repeats)
    for name, value in t.items():
        print(f"    {name:36s} {ms(value.min())}")
    return t


def ratio(times, a, b):
    """``best time of a / best time of b``: the best of many calls is the least disturbed estimate of each."""
    return float(times[a].min() / times[b].min())


def paired_ratio(times, a, b):
    """Median over the rounds of ``time of a / time of b``, for two variants called back to back in every round.

    For a small difference between two long calls (a few percent of each)
    this is steadier than a ratio of best times: both calls of a round see
    the same load.
    """
    return float(np.median(times[a] / times[b]))


def ms(t):
    return f"{t * 1e3:9.1f} ms"


def mib(b):
    return f"{b / 2**20:8.1f} MiB"


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


def bench_responsibilities(n, K, d, repeats):
    print(f"\n== responsibilities, N = {n}, K = {K}, d = {d} (best of {repeats} interleaved rounds)")
    fns, same = {}, {}
    for dtype in (np.float64, np.float32):
        x, means, variances, weights = gmm_inputs(n, K, d, dtype)
        log_w = np.log(weights)
        name = np.dtype(dtype).name
        fns[f"{name} tuned"] = lambda x=x, m=means, v=variances, w=weights: tuned.responsibilities(x, m, v, w)
        fns[f"{name} GEMM floor"] = responsibility_floor(x, means, variances)
        fns[f"{name} core, refined"] = lambda x=x, m=means, v=variances, lw=log_w: tuned.posterior(x, m, v, lw)
        fns[f"{name} core, expansion alone"] = lambda x=x, m=means, v=variances, lw=log_w: tuned.posterior(x, m, v, lw, refine=False)
        fns[f"{name} plain reference"] = lambda x=x, m=means, v=variances, w=weights: gmm.responsibilities(x, m, v, w)
        if numba is not None:
            fns[f"{name} numba"] = lambda x=x, m=means, v=variances, w=weights: cpu_gmm.responsibilities(x, m, v, w)
        if dtype == np.float64:
            model = sklearn_gmm(means, variances, weights)
            fns["float64 scikit-learn predict_proba"] = lambda x=x: model.predict_proba(x)
        same[name] = np.array_equal(tuned.posterior(x, means, variances, log_w)[0], tuned.posterior(x, means, variances, log_w, refine=False)[0])
    t = timed_rounds(fns, repeats)
    for name in ("float64", "float32"):
        print(f"  {name}:")
        print(f"    tuned / GEMM floor:            {ratio(t, name + ' tuned', name + ' GEMM floor'):9.2f}x   (target <= 1.5)")
        if name == "float64":
            print(f"    scikit-learn / tuned:          {ratio(t, 'float64 scikit-learn predict_proba', 'float64 tuned'):9.2f}x   (target >= 3)")
            print(f"    scikit-learn / plain:          {ratio(t, 'float64 scikit-learn predict_proba', 'float64 plain reference'):9.2f}x")
        print(f"    plain reference / tuned:       {ratio(t, name + ' plain reference', name + ' tuned'):9.2f}x   (the price of reading like the definition)")
        screen = paired_ratio(t, name + " core, refined", name + " core, expansion alone") - 1
        print(f"    cost of the exactness screen:  {screen:+9.1%}   (target <= 10%; median over the rounds)")
        print(f"    refined == expansion bit for bit:  {same[name]} (no entry needed recomputing)")
    if numba is not None:
        print(f"  numba ({numba.get_num_threads()} threads):")
        for name in ("float64", "float32"):
            print(f"    {name} numba / GEMM floor:    {ratio(t, name + ' numba', name + ' GEMM floor'):9.2f}x   (target <= 1.0)")
            print(f"    {name} plain reference / numba:{ratio(t, name + ' plain reference', name + ' numba'):8.2f}x")
            print(f"    {name} tuned / numba:         {ratio(t, name + ' tuned', name + ' numba'):9.2f}x")
        print(f"    scikit-learn / numba:          {ratio(t, 'float64 scikit-learn predict_proba', 'float64 numba'):9.2f}x   (target >= 10)")
        print(f"    float64 / float32 time, numba: {ratio(t, 'float64 numba', 'float32 numba'):9.2f}x   (target >= 1.7)")
    print(f"  float64 / float32 time, tuned:   {ratio(t, 'float64 tuned', 'float32 tuned'):9.2f}x   (target >= 1.7)")
    print(f"  float64 / float32 time, plain:   {ratio(t, 'float64 plain reference', 'float32 plain reference'):9.2f}x")
    x, means, variances, weights = gmm_inputs(n, K, d, np.float64)
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


def bench_gma(n, K, d, repeats):
    print(f"\n== GMA, N = {n}, K = {K}, d_r = d_v = {d} (best of {repeats} interleaved rounds)")
    fns = {}
    for dtype in (np.float64, np.float32):
        inp = gma_inputs(n, K, d, d, dtype)
        variances = (np.logaddexp(0, inp["raw_variances"]) + 1e-6).astype(dtype)
        weights = np.exp(inp["logits"] - inp["logits"].max())
        weights = (weights / weights.sum()).astype(dtype)
        out_b, cache_b = tuned.gma_forward(**inp)
        out_c, cache_c = tuned.gma_forward(**inp, causal=True)
        floor_f, floor_b = gma_floors(n, K, d, d, dtype)
        args = (inp["x_q"], inp["x_k"], inp["v"], inp["means"], variances, weights)
        name = np.dtype(dtype).name
        fns[f"{name} bidirectional forward"] = lambda a=args: tuned.gma(*a)
        fns[f"{name} causal forward"] = lambda a=args: tuned.gma(*a, causal=True)
        fns[f"{name} forward GEMM floor"] = floor_f
        fns[f"{name} bidirectional backward"] = lambda o=out_b, c=cache_b: tuned.gma_backward(o, c)
        fns[f"{name} causal backward"] = lambda o=out_c, c=cache_c: tuned.gma_backward(o, c)
        fns[f"{name} backward GEMM floor"] = floor_b
        fns[f"{name} plain bidirectional forward"] = lambda a=args: gma.gma(*a)
        fns[f"{name} plain causal forward"] = lambda a=args: gma.gma(*a, causal=True)
        fns[f"{name} plain bidirectional backward"] = lambda o=out_b, c=cache_b: gma.gma_backward(o, c)
        if numba is not None:
            nb_out_b, nb_cache_b = cpu_gma.gma_forward(**inp)
            nb_out_c, nb_cache_c = cpu_gma.gma_forward(**inp, causal=True)
            fns[f"{name} numba bidirectional forward"] = lambda a=args: cpu_gma.gma(*a)
            fns[f"{name} numba causal forward"] = lambda a=args: cpu_gma.gma(*a, causal=True)
            fns[f"{name} numba bidirectional backward"] = lambda o=nb_out_b, c=nb_cache_b: cpu_gma.gma_backward(o, c)
            fns[f"{name} numba causal backward"] = lambda o=nb_out_c, c=nb_cache_c: cpu_gma.gma_backward(o, c)
    t = timed_rounds(fns, repeats)
    for name in ("float64", "float32"):
        print(f"  {name}:")
        print(f"    bidirectional / floor:         {ratio(t, name + ' bidirectional forward', name + ' forward GEMM floor'):9.2f}x   (target <= 2)")
        print(f"    causal / floor:                {ratio(t, name + ' causal forward', name + ' forward GEMM floor'):9.2f}x   (target <= 3)")
        print(f"    backward / floor:              {ratio(t, name + ' bidirectional backward', name + ' backward GEMM floor'):9.2f}x   (target <= 3)")
        print(f"    causal backward / floor:       {ratio(t, name + ' causal backward', name + ' backward GEMM floor'):9.2f}x")
        for op in ("bidirectional forward", "causal forward", "bidirectional backward"):
            print(f"    plain / tuned, {op + ':':23s}{ratio(t, name + ' plain ' + op, name + ' ' + op):7.2f}x")
    for op in ("bidirectional forward", "causal forward", "bidirectional backward", "causal backward"):
        print(f"  float64 / float32, {op + ':':24s} {ratio(t, 'float64 ' + op, 'float32 ' + op):6.2f}x   (target >= 1.7)")
    if numba is not None:
        print(f"  numba ({numba.get_num_threads()} threads):")
        targets = {"bidirectional forward": ("forward", 1.5), "causal forward": ("forward", 2.0),
                   "bidirectional backward": ("backward", 2.0), "causal backward": ("backward", 2.0)}
        for name in ("float64", "float32"):
            for op, (floor, target) in targets.items():
                r = ratio(t, f"{name} numba {op}", f"{name} {floor} GEMM floor")
                print(f"    {name} {op + ' / floor:':32s}{r:6.2f}x   (target <= {target})   tuned / numba {ratio(t, f'{name} {op}', f'{name} numba {op}'):5.2f}x")
        for op in targets:
            print(f"    float64 / float32, {op + ':':24s} {ratio(t, 'float64 numba ' + op, 'float32 numba ' + op):6.2f}x")
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


def bench_rates(n, K, d, repeats):
    """The rate of the three kinds of work in the responsibilities, measured on the same machine now."""
    rows = numerics.block_rows((4 * K + 2 * d) * 8)  # the blocks of refimpl.tuned: 4K + 2d numbers a row
    print(f"\n== where the time goes: N x K = {n} x {K} entries, float64, blocks of {rows} rows")
    rng = np.random.default_rng(0)
    a = rng.normal(size=(rows, K))
    b = np.empty_like(a)
    x = rng.normal(size=(rows, d))
    w = rng.normal(size=(d, K))
    blocks = -(-n // rows)

    def passes(op):
        def run():
            for _ in range(blocks):
                op()
        return run

    t = interleaved(
        {
            "one element-wise pass (add)": passes(lambda: np.add(a, a, out=b)),
            "exp": passes(lambda: np.exp(a, out=b)),
            "the two GEMMs": passes(lambda: (np.matmul(x, w, out=b), np.matmul(x, w, out=b))),
        },
        repeats,
    )
    flops = 2 * 2 * n * d * K
    entries = n * K
    for name, value in t.items():
        print(f"    {name:30s} {ms(value.min())}   {value.min() / entries * 1e9:6.2f} ns per entry")
    print(f"    GEMM rate: {flops / t['the two GEMMs'].min() / 1e9:.0f} GFLOP/s on {os.cpu_count()} cores; "
          f"NumPy's element-wise loops run on one core")
    print(f"    exp / the two GEMMs:           {ratio(t, 'exp', 'the two GEMMs'):9.2f}")
    print(f"    one pass / the two GEMMs:      {ratio(t, 'one element-wise pass (add)', 'the two GEMMs'):9.2f}")
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
            errors["cpu.gmm.responsibilities (numba)"] = row_relative_error(cpu_gmm.responsibilities(xs, ms_, vs, ws), exact)
    print("\n== spread means (two near +1e4, one at -1e4, variances 1e-8): largest relative error per row")
    for name, e in errors.items():
        print(f"    {name:34s} {e:9.2e}")


def bench_attention(n, d, repeats):
    """Softmax attention: numba's online softmax (no N x N matrix) against NumPy's dense form, time and peak memory."""
    from refimpl import attention

    print(f"\n== softmax attention, N = {n}, d = d_v = {d} (best of {repeats} interleaved rounds)")
    if numba is None:
        print("    numba is not installed: nothing to compare")
        return None
    from cpu import attention as cpu_attention

    fns = {}
    for dtype in (np.float64, np.float32):
        q, k, v = np.random.default_rng(3).normal(size=(3, n, d)).astype(dtype)
        name = np.dtype(dtype).name
        for causal in (False, True):
            label = f"{name} {'causal' if causal else 'bidirectional'}"
            fns[f"{label} dense numpy"] = lambda q=q, k=k, v=v, c=causal: attention.softmax_attention(q, k, v, causal=c)
            fns[f"{label} numba online"] = lambda q=q, k=k, v=v, c=causal: cpu_attention.softmax_attention(q, k, v, causal=c)
    t = timed_rounds(fns, repeats)
    for label in [k[: -len(" dense numpy")] for k in fns if k.endswith("dense numpy")]:
        print(f"    {label + ' numba / dense:':36s}{ratio(t, label + ' numba online', label + ' dense numpy'):6.2f}x   (target <= 1.5)")
    q, k, v = np.random.default_rng(3).normal(size=(3, n, d))
    online = traced_peak(lambda: cpu_attention.softmax_attention(q, k, v))
    dense = traced_peak(lambda: attention.softmax_attention(q, k, v))
    print(f"  peak memory, float64: numba online {mib(online)} ({online / (n * d * 8):.2f} N x d arrays), dense {mib(dense)} "
          f"({dense / (n * n * 8):.2f} N x N arrays)")
    return t


def bench_ovq(sizes, repeats):
    """OVQ attention (n_max = 1024, C = 256, d = 64): numba's kernels against the NumPy reference."""
    from refimpl import ovq

    print(f"\n== OVQ attention, n_max = 1024, C = 256, d = 64, float64 (best of {repeats} interleaved rounds)")
    if numba is None:
        print("    numba is not installed: nothing to compare")
        return None
    from cpu import ovq as cpu_ovq

    fns = {}
    for T in sizes:
        q, k, v = np.random.default_rng(4).normal(size=(3, T, 64))
        fns[f"T = {T} numpy"] = lambda q=q, k=k, v=v: ovq.ovq_attention(q, k, v, max_size=1024, chunk_size=256)
        fns[f"T = {T} numba"] = lambda q=q, k=k, v=v: cpu_ovq.ovq_attention(q, k, v, max_size=1024, chunk_size=256)
    t = timed_rounds(fns, repeats)
    # the targets: half the time of an eager PyTorch implementation that took 0.62x (T = 16384) and 0.80x (T = 65536)
    # of the NumPy reference's time on this machine
    for T, target in zip(sizes, (0.31, 0.40)):
        print(f"    T = {T}: numba / numpy {ratio(t, f'T = {T} numba', f'T = {T} numpy'):6.2f}x   (target <= {target})")
    return t


def bench_training(repeats, quick):
    """One training step (forward, backward) of every mixer on ListOps at the defaults, on both backends."""
    from app import backend, model, train

    config = train.quick_config() if quick else train.TrainConfig(n_train=256, n_val=16, n_test=16)
    splits = train.load_data(config)
    tokens, targets = (a[: config.batch_size] for a in splits["train"])
    print(f"\n== one training step on ListOps, batch {config.batch_size}, length {tokens.shape[1]}, d_model {config.d_model}, "
          f"{config.heads} heads (best of {repeats} interleaved rounds)")
    fns = {}
    for mixer in model.MIXERS:
        mcfg = train.model_config(config._replace(mixer=mixer))
        params = model.init_params(mcfg, 0)
        for name in backend.BACKENDS if numba is not None else ("numpy",):
            def step(p=params, m=mcfg, name=name):
                backend.use(name)
                model.loss_and_grads(p, tokens, targets, m)
            fns[f"{mixer} {name}"] = step
    t = timed_rounds(fns, repeats)
    backend.use(None)
    if numba is not None:
        for mixer, target in zip(model.MIXERS, (2.0, None, None, 3.0)):
            shown = f"   (target >= {target})" if target else ""
            print(f"    {mixer:8s} numpy / numba:   {ratio(t, mixer + ' numpy', mixer + ' numba'):6.2f}x{shown}")
    return t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (the best is kept)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 15)
    gmm_size = (20_000, 16, 16) if args.quick else (200_000, 64, 32)
    gma_size = (2_048, 16, 16) if args.quick else (16_384, 64, 64)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, NumPy {np.__version__}")
    print(time.strftime("date: %Y-%m-%d %H:%M"))
    bench_responsibilities(*gmm_size, repeats)
    bench_gma(*gma_size, repeats)
    bench_rates(*gmm_size, repeats)
    bench_attention(1_024 if args.quick else 16_384, 64, repeats)
    bench_ovq((2_048,) if args.quick else (16_384, 65_536), min(repeats, 5))
    bench_training(repeats, args.quick)
    accuracy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
