"""Every backend held to the reference: the same numbers, the same refusals, the same dtypes, inputs untouched.

For each backend of :data:`conformance_backends.BACKENDS` and each function it
offers under a :mod:`refimpl` name, against :mod:`refimpl.gmm`,
:mod:`refimpl.gma`, :mod:`refimpl.attention` and :mod:`refimpl.ovq`:

* outputs and every gradient in float64 and in float32 (computed in float32:
  the dtype out is the dtype in), with leading batch dimensions and per-head
  GMMs where the function takes them, and awkward sizes (one token, one
  component, odd widths, sizes that cross the CPU row blocks and the chunks);
  a backend that runs in the CUDA simulator gets the tiny cases only;
* the same refusals word for word (exception type and message), bad caches
  and bad ``grad_out`` included;
* inputs left as they were;
* the same bits with one thread or two where the backend promises it;
* OVQ: the output and the state (``return_state``), streaming through a
  state, ties, and VQ with a fixed codebook.

A backend added to the registry gets every test of each function it offers.

Tolerances
----------
Every comparison reads :data:`TOLERANCES`, keyed ``(function, dtype)``.
For the functions in :data:`SCALED` (gradients: sums of terms of either
sign, which cancel) the ``atol`` is relative to the largest entry of the
reference's result (``max(1, max |grad|)`` for GMA's, as the per-backend
tests had it); elsewhere it is absolute.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager

import numpy as np
import pytest

from conformance_backends import BACKENDS, CASES, _bad_gma, _bad_gmm, _problem, mixture
from refimpl import attention as ref_attention
from refimpl import gma as ref_gma
from refimpl import gmm as ref_gmm
from refimpl import ovq as ref_ovq
from refimpl.testing import TOL

F64, F32 = np.float64, np.float32

TOLERANCES = {
    ("responsibilities", F64): (TOL[F64]["rtol"], 1e-14,
                                "probabilities <= 1 from logit differences reordered: TOL's rtol, test_gpu_gmm.py's atol "
                                "(tighter than TOL's 1e-13)"),
    ("responsibilities", F32): (1e-5, 1e-6,
                                "~80 u32 for the reordered float32 sums: test_gpu_gmm.py's, tighter than TOL[float32] "
                                "(the expansion of cupy_host uses 0.98 of it at N301-K16-d33)"),
    ("log_responsibilities", F64): (TOL[F64]["rtol"], TOL[F64]["atol"],
                                    "refimpl.testing.TOL: d terms per logit and K in the logsumexp reordered "
                                    "(tighter than test_gpu_gmm.py's atol 1e-12)"),
    ("log_responsibilities", F32): (1e-5, 1e-5, "float32 sums reordered, logs of order 10: test_gpu_gmm.py's, tighter than TOL[float32]"),
    ("log_likelihood", F64): (TOL[F64]["rtol"], TOL[F64]["atol"], "refimpl.testing.TOL: the sum of N log-normalisers reordered"),
    ("log_likelihood", F32): (TOL[F32]["rtol"], TOL[F32]["atol"], "refimpl.testing.TOL[float32], as test_tuned.py had it"),
    ("em_step", F64): (TOL[F64]["rtol"], TOL[F64]["atol"], "refimpl.testing.TOL: the M-step sums over N rows reordered"),
    ("em_step", F32): (TOL[F32]["rtol"], TOL[F32]["atol"], "refimpl.testing.TOL[float32], as test_tuned.py had it"),
    ("gma", F64): (TOL[F64]["rtol"], TOL[F64]["atol"],
                   "refimpl.testing.TOL: the chunk sums and N K responsibilities reordered (tighter than test_gpu_gma.py's 1e-10)"),
    ("gma", F32): (2e-5, 2e-6, "float32 responsibilities and chunk sums reordered: test_gpu_gma.py's F32 (tighter than "
                              "TOL[float32] and, in atol, than test_cupy_host.py's 1e-5)"),
    ("gma_forward", F64): (TOL[F64]["rtol"], TOL[F64]["atol"], "as gma: refimpl.testing.TOL"),
    ("gma_forward", F32): (2e-5, 2e-6, "as gma: test_gpu_gma.py's F32"),
    ("gma_backward", F64): (TOL[F64]["rtol"], TOL[F64]["atol"],
                            "refimpl.testing.TOL, atol of max(1, max|grad|): the parameter gradients sum N c_im terms of either sign"),
    ("gma_backward", F32): (2e-5, 2e-6, "test_gpu_gma.py's F32, atol of max(1, max|grad|) (tighter than TOL[float32] and "
                                        "test_cupy_host.py's 1e-5, 1e-4)"),
    ("softmax_attention", F64): (1e-13, 1e-13, "an online softmax reorders the N_k terms of each row: test_cpu_attention.py's rtol "
                                               "(tighter than test_gpu_attention.py's 1e-12), test_gpu_attention.py's absolute atol"),
    ("softmax_attention", F32): (1e-5, 1e-6, "the same float32 sums reordered: test_gpu_attention.py's (an absolute atol, tighter than "
                                             "test_cpu_attention.py's 1e-5 of max|out|)"),
    ("softmax_attention_backward", F64): (1e-13, 1e-13, "test_cpu_attention.py's, atol of max|grad|: dS = P (dP - rowsum(P dP)) cancels"),
    ("softmax_attention_backward", F32): (1e-5, 1e-5, "test_cpu_attention.py's float32 gradient tolerance, atol of max|grad|"),
    ("linear_attention", F64): (TOL[F64]["rtol"], TOL[F64]["atol"],
                                "refimpl.testing.TOL: as gma, the same scan on the elu + 1 features, its chunk sums reordered"),
    ("linear_attention", F32): (2e-5, 2e-6, "as gma: the float32 chunk sums reordered"),
    ("linear_attention_backward", F64): (TOL[F64]["rtol"], TOL[F64]["atol"],
                                         "as gma_backward, atol of max(1, max|grad|): the scan's two sweeps reordered"),
    ("linear_attention_backward", F32): (2e-5, 2e-6, "as gma_backward's float32, atol of max(1, max|grad|)"),
    ("ovq_attention", F64): (1e-12, 1e-13, "test_cpu_ovq.py's TOL64 (tighter than test_gpu_ovq.py's 1e-10): the same read-out "
                                           "and running means, sums reordered"),
    ("ovq_attention", F32): (1e-5, 1e-6, "test_cpu_ovq.py's and test_gpu_ovq.py's TOL32, on inputs whose assignments have clear margins"),
    ("ovq_attention_backward", F64): (1e-12, 1e-13, "test_cpu_ovq.py's TOL64 with the assignments of the forward held"),
    ("ovq_attention_backward", F32): (1e-5, 1e-6, "test_cpu_ovq.py's TOL32"),
    ("vq_attention", F64): (1e-12, 1e-13, "test_cpu_ovq.py's TOL64 (tighter than test_gpu_ovq.py's 1e-10): one softmax over S codes a row"),
    ("vq_attention", F32): (1e-5, 1e-6, "test_cpu_ovq.py's and test_gpu_ovq.py's TOL32"),
}

#: Functions whose ``atol`` is relative: ``atol * max(floor, max |reference|)`` with the floor given here.
SCALED = {"gma_backward": 1.0, "linear_attention_backward": 1.0, "softmax_attention_backward": 0.0}


def close(function, got, want, err_msg=""):
    """``got`` against the reference's ``want``: the same shape and dtype, within ``TOLERANCES[(function, dtype)]``."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (function, got.shape, want.shape, err_msg)
    assert got.dtype == want.dtype, (function, got.dtype, want.dtype, err_msg)
    rtol, atol, _ = TOLERANCES[(function, want.dtype.type)]
    if function in SCALED and want.size:
        atol *= max(SCALED[function], float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{function} {err_msg}")


@contextmanager
def quiet():
    """Inputs that overflow on purpose: the reference's NumPy (and the simulator's threads) warn before refusing."""
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def refused_alike(call, ref_call, message=True):
    """``call`` raises what ``ref_call`` raises: the same type and (``message``) the same words."""
    with quiet(), pytest.raises((TypeError, ValueError)) as ref:
        ref_call()
    with quiet(), pytest.raises(ref.type) as got:
        call()
    if message:
        assert str(got.value) == str(ref.value)
    return got.value, ref.value


def cases(function, table):
    """``pytest.param(backend, *case)`` for each backend offering ``function``: ``table`` rows ``(id, tiny, *values)``,
    the tiny rows only for a backend in the simulator."""
    out = []
    for name, b in BACKENDS.items():
        if not hasattr(b, function):
            continue
        for case_id, tiny, *values in table:
            if tiny or not b.simulator:
                out.append(pytest.param(name, *values, id=f"{name}-{case_id}"))
    return out


def backends_with(*functions):
    return [name for name, b in BACKENDS.items() if all(hasattr(b, f) for f in functions)]


def snapshot(obj):
    return copy.deepcopy(obj)


def assert_unchanged(before, after):
    if isinstance(before, np.ndarray):
        assert after.dtype == before.dtype and after.shape == before.shape
        np.testing.assert_array_equal(after, before)
    elif isinstance(before, ref_ovq.OVQState):
        for f in ("keys", "values", "counts", "size", "tokens_seen"):
            np.testing.assert_array_equal(getattr(after, f), getattr(before, f), err_msg=f)
    elif isinstance(before, (list, tuple)):
        for a, b in zip(before, after, strict=True):
            assert_unchanged(a, b)
    elif isinstance(before, dict):
        assert before.keys() == after.keys()
        for key in before:
            assert_unchanged(before[key], after[key])
    else:
        assert after == before


def refuses_bad_grads_and_caches_alike(backward, ref_backward, cache, ref_cache, shape):
    """A ``grad_out`` of another shape, 1-D, with a NaN, of integers: the reference's words.  A cache that is none:
    ``TypeError``, with the reference's words where the backend's cache is the reference's type (else naming its own)."""
    nan = np.ones(shape)
    nan[..., 1, 0] = np.nan
    other_rows, other_width = shape[:-2] + (shape[-2] + 1, shape[-1]), shape[:-1] + (shape[-1] + 1,)
    for grad in (np.ones(other_rows), np.ones(other_width), np.ones(shape[-1:]), nan, np.ones(shape, dtype=np.int64)):
        refused_alike(lambda: backward(grad, cache), lambda: ref_backward(grad, ref_cache))
    same_type = type(cache) is type(ref_cache)
    for bad in (None, "cache", ref_cache._asdict()) + (() if same_type else (ref_cache,)):
        got, _ = refused_alike(lambda: backward(np.ones(shape), bad),
                               lambda: ref_backward(np.ones(shape), None if bad is ref_cache else bad), message=same_type)
        assert str(got).startswith("cache: expected ") and str(got).endswith(f", got {type(bad).__name__}"), str(got)


# ---------------------------------------------------------------------------
# Responsibilities
# ---------------------------------------------------------------------------

GMM_FUNCTIONS = ["responsibilities", "log_responsibilities", "log_likelihood", "em_step"]
# (id, tiny, N, K, d): one of each, odd sizes, N across the CPU's groups of 4 rows, K past the simulator's 32 threads,
# (5, 17, 3) across the simulator's tiles of 4 rows, 16 components and 2 coordinates
GMM_SIZES = [
    ("N1-K1-d1", True, 1, 1, 1), ("N3-K2-d1", True, 3, 2, 1), ("N4-K4-d3", True, 4, 4, 3), ("N1-K3-d2", True, 1, 3, 2),
    ("N3-K1-d5", True, 3, 1, 5), ("N2-K38-d2", True, 2, 38, 2), ("N5-K17-d3", True, 5, 17, 3), ("N6-K4-d3", True, 6, 4, 3),
    ("N7-K3-d2", False, 7, 3, 2), ("N33-K5-d4", False, 33, 5, 4), ("N65-K9-d5", False, 65, 9, 5),
    ("N301-K16-d33", False, 301, 16, 33),
]


def gmm_problem(N, K, d, dtype):
    means, variances, weights = mixture(K, d, seed=N, dtype=dtype)
    x = np.random.default_rng(N + 1).normal(size=(N, d)).astype(dtype)
    return x, means, variances, weights


def with_functions(functions, params):
    """``pytest.param(function, backend, ...)`` for each of ``functions`` the backend of each of ``params`` offers."""
    return [pytest.param(f, *p.values, id=f"{f}-{p.id}") for f in functions for p in params if hasattr(BACKENDS[p.values[0]], f)]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("function, backend, N, K, d", with_functions(GMM_FUNCTIONS, cases("responsibilities", GMM_SIZES)))
def test_the_responsibilities_match_the_reference(function, backend, N, K, d, dtype):
    b = BACKENDS[backend]
    args = gmm_problem(N, K, d, dtype)
    want = getattr(ref_gmm, function)(*args)
    got = getattr(b, function)(*args)
    if function == "em_step":
        for name, g, w in zip(("means", "variances", "weights"), got, want, strict=True):
            assert np.asarray(g).dtype == dtype
            close(function, g, w, name)
    else:
        assert np.asarray(got).dtype == dtype
        close(function, got, want)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("function, backend", with_functions(["responsibilities", "log_responsibilities"],
                                                             [pytest.param(n, id=n) for n in backends_with("responsibilities")]))
def test_a_zero_weight_is_a_component_that_never_wins(function, backend, dtype):
    """Components of weight 0 get responsibility 0 and log-responsibility -inf, the others the reference's."""
    x, means, variances, _ = gmm_problem(4, 4, 2, dtype)
    weights = np.array([0.0, 0.6, 0.0, 0.4], dtype)
    got = getattr(BACKENDS[backend], function)(x, means, variances, weights)
    want = getattr(ref_gmm, function)(x, means, variances, weights)
    assert np.all(np.asarray(got)[:, [0, 2]] == (-np.inf if function == "log_responsibilities" else 0.0))
    close(function, got, want)


BAD_GMM = _bad_gmm() + [
    # every distance overflows for row 0 (the reference's message names it); one row far from a huge-variance-free GMM
    dict(x=np.array([[1e6, 0.5], [0.0, 0.0]], F32), means=np.array([[0.0, 1.0], [0.0, -1.0]], F32),
         variances=np.full((2, 2), 1e-30, F32), weights=np.array([0.5, 0.5], F32)),
    dict(x=np.array([[1e6, 0.5], [0.0, 0.0]]), means=np.array([[0.0, 1.0], [0.0, -1.0]]), variances=np.full((2, 2), 1e-300),
         weights=np.array([0.5, 0.5])),
    dict(x=np.full((1, 2), 1e300), means=mixture(3, 2)[0], variances=mixture(3, 2)[1], weights=mixture(3, 2)[2]),
    dict(x=np.zeros((4, 3)), means=np.zeros((3, 3)), variances=np.where(np.arange(9).reshape(3, 3) == 4, 0.0, 1.0),
         weights=np.full(3, 1 / 3)),
    dict(x=np.zeros((4, 3)), means=np.zeros((3, 3)), variances=np.ones((3, 3)), weights=np.array([1.0, np.inf, 0.0])),
    dict(x=np.zeros((4, 3)), means=np.zeros((3, 3)), variances=np.ones((3, 3)), weights=np.array([1.5, -0.5, 0.0])),
]


@pytest.mark.parametrize("case", range(len(BAD_GMM)))
@pytest.mark.parametrize("function, backend", with_functions(GMM_FUNCTIONS, [pytest.param(n, id=n) for n in backends_with("responsibilities")]))
def test_the_responsibilities_refuse_what_the_reference_refuses(function, backend, case):
    b = BACKENDS[backend]
    kwargs = BAD_GMM[case]
    refused_alike(lambda: getattr(b, function)(**kwargs), lambda: getattr(ref_gmm, function)(**kwargs))


# ---------------------------------------------------------------------------
# GMA
# ---------------------------------------------------------------------------

# (id, tiny, leading, per_head, causal, N, K, d_r, d_v, chunk_size): the CASES of the per-backend files; N = 65 crosses
# chunks of 4 and the CPU's row blocks; chunks of 1, of 4 and longer than N
GMA_CASES = [
    (f"{'x'.join(map(str, lead)) or '2d'}{'-heads' if ph else ''}{'-causal' if c else ''}-N{N}-K{K}-dr{dr}-dv{dv}-C4",
     N < 10, lead, ph, c, N, K, dr, dv, 4)
    for lead, ph, c, N, K, dr, dv in CASES
] + [
    ("2d-N6-K3-C64", True, (), False, False, 6, 3, 2, 3, 64),
    ("2d-causal-N7-K3-C4", True, (), False, True, 7, 3, 2, 3, 4),
    ("2d-causal-N4-K2-C1", True, (), False, True, 4, 2, 2, 3, 1),
    ("2d-causal-N5-K3-C100", True, (), False, True, 5, 3, 2, 3, 100),
    ("2d-causal-N1-K1-C2", True, (), False, True, 1, 1, 2, 3, 2),
    ("2d-N5-K1-C64", True, (), False, False, 5, 1, 2, 3, 64),
    ("2x3-shared-N2-K2", True, (2, 3), False, False, 2, 2, 2, 3, 64),
]


def gma_reference(args, causal, chunk, g):
    out, cache = ref_gma.gma_forward(*args, causal=causal, chunk_size=chunk)
    return out, cache, ref_gma.gma_backward(g, cache)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, leading, per_head, causal, N, K, d_r, d_v, chunk", cases("gma_forward", GMA_CASES))
def test_gma_forward_and_every_gradient_match_the_reference(backend, leading, per_head, causal, N, K, d_r, d_v, chunk, dtype):
    b = BACKENDS[backend]
    args = _problem(leading, per_head, N, K, d_r, d_v, dtype, seed=N + K)
    out, cache = b.gma_forward(*args, causal=causal, chunk_size=chunk)
    g = np.random.default_rng(1).normal(size=np.shape(out)).astype(dtype)
    ref_out, ref_cache, ref_grads = gma_reference(args, causal, chunk, g)
    assert np.asarray(out).dtype == dtype
    close("gma_forward", out, ref_out)
    grads = b.gma_backward(g, cache)
    assert isinstance(grads, ref_gma.GMAGrads)
    for name in ref_gma.GMAGrads._fields:
        assert np.asarray(getattr(grads, name)).dtype == dtype, name
        close("gma_backward", getattr(grads, name), getattr(ref_grads, name), name)
    if type(cache) is type(ref_cache):
        # the same cache type: each backward reads the other's cache
        for name, w in zip(ref_gma.GMAGrads._fields, ref_grads):
            close("gma_backward", getattr(b.gma_backward(g, ref_cache), name), w, f"{name}, the reference's cache")
            close("gma_backward", getattr(ref_gma.gma_backward(g, cache), name), w, f"{name}, the reference's backward")


def constrained(args, min_variance=1e-6):
    """gma's arguments from gma_forward's: ``variances = softplus(raw) + min_variance``, ``weights = softmax(logits)``."""
    x_q, x_k, v, means, raw, logits = args
    variances, log_weights = ref_gma.mixture_from_raw(raw, logits, min_variance)
    return x_q, x_k, v, means, variances, np.exp(log_weights)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, leading, per_head, causal, N, K, d_r, d_v, chunk", cases("gma", GMA_CASES))
def test_gma_with_variances_and_weights_matches_the_reference(backend, leading, per_head, causal, N, K, d_r, d_v, chunk, dtype):
    args = constrained(_problem(leading, per_head, N, K, d_r, d_v, dtype, seed=N + K + 1))
    got = BACKENDS[backend].gma(*args, causal=causal, chunk_size=chunk)
    assert np.asarray(got).dtype == dtype
    close("gma", got, ref_gma.gma(*args, causal=causal, chunk_size=chunk))


def _bad_gma_more():
    """gma_forward refusals on a (2,) batch with per-head GMMs (test_gpu_gma.py's), and a denominator of 0 (eps = 0)."""
    x_q, x_k, v, means, raw, logits = (np.random.default_rng(7).normal(size=s) for s in
                                       ((2, 5, 2), (2, 5, 2), (2, 5, 3), (2, 3, 2), (2, 3, 2), (2, 3)))
    ok = dict(x_q=x_q, x_k=x_k, v=v, means=means, raw_variances=raw, logits=logits)
    far_means = np.array([[-50.0, 0.0], [50.0, 0.0]])
    far_k = np.tile(far_means[0], (2, 3, 1))
    far_q = far_k.copy()
    far_q[1, 2] = far_means[1]
    bad_v = v.copy()
    bad_v[1, 3, 0] = np.inf
    return [
        {**ok, "x_k": np.ones((2, 5, 3))},
        {**ok, "v": np.ones((5, 3))},
        {**ok, "means": np.ones((3, 3, 2))},
        {**ok, "logits": np.ones((2, 4))},
        {**ok, "raw_variances": np.ones((3, 2))},
        {**ok, "causal": "yes"},
        {**ok, "x_q": np.full((2, 5, 2), np.nan)},
        {**ok, "v": bad_v},
        {**ok, "raw_variances": np.full((2, 3, 2), np.inf)},
        dict(x_q=far_q, x_k=far_k, v=np.ones((2, 3, 1)), means=far_means, raw_variances=np.zeros((2, 2)),
             logits=np.zeros(2), eps=0.0),
    ]


BAD_GMA = _bad_gma() + _bad_gma_more()


def _as_gma_arguments(kwargs):
    """gma's keyword arguments for a gma_forward call: variances and weights from the raw parameters where they exist."""
    raw, logits = kwargs["raw_variances"], kwargs["logits"]
    if not np.all(np.isfinite(raw)):
        return None
    variances = ref_gmm.variances_from_raw(raw) if np.ndim(raw) else raw
    weights = ref_gmm.weights_from_logits(logits) if np.size(logits) else logits
    plain = {k: w for k, w in kwargs.items() if k not in ("raw_variances", "logits", "min_variance")}
    return {**plain, "variances": variances, "weights": weights}


@pytest.mark.parametrize("case", range(len(BAD_GMA)))
@pytest.mark.parametrize("backend", backends_with("gma_forward"))
def test_gma_forward_and_gma_refuse_what_the_reference_refuses(backend, case):
    b = BACKENDS[backend]
    kwargs = BAD_GMA[case]
    refused_alike(lambda: b.gma_forward(**kwargs), lambda: ref_gma.gma_forward(**kwargs))
    plain = _as_gma_arguments(kwargs)
    if "min_variance" not in kwargs and plain is not None and hasattr(b, "gma"):
        refused_alike(lambda: b.gma(**plain), lambda: ref_gma.gma(**plain))


@pytest.mark.parametrize("backend", backends_with("gma_forward", "gma_backward"))
def test_a_bad_grad_out_or_cache_is_refused_alike(backend):
    b = BACKENDS[backend]
    for leading in ((), (2,)):
        args = _problem(leading, False, 6, 3, 2, 2, F64)
        out, cache = b.gma_forward(*args, causal=True, chunk_size=4)
        _, ref_cache = ref_gma.gma_forward(*args, causal=True, chunk_size=4)
        refuses_bad_grads_and_caches_alike(b.gma_backward, ref_gma.gma_backward, cache, ref_cache, np.shape(out))


# ---------------------------------------------------------------------------
# Softmax attention
# ---------------------------------------------------------------------------

# (id, tiny, batch, N_q, N_k, d, d_v, causal, scale): one row, a block of the CPU's 32 rows plus one, its tiles of 64
# keys plus two, odd widths, the simulator's tiles (4 rows, 2 keys, 4 coordinates, 4 value columns) crossed
ATTENTION_CASES = [
    ("2d-Nq1-Nk1-d1-dv1-causal", True, (), 1, 1, 1, 1, True, None),
    ("2d-Nq1-Nk7-d3-dv2", True, (), 1, 7, 3, 2, False, None),
    ("2d-Nq1-Nk1-d2-dv1-causal", True, (), 1, 1, 2, 1, True, None),
    ("2d-Nq1-Nk3-d2-dv1", True, (), 1, 3, 2, 1, False, None),
    ("2d-Nq5-Nk5-d3-dv2", True, (), 5, 5, 3, 2, False, None),
    ("2d-Nq7-Nk7-d3-dv2-causal-scale0.7", True, (), 7, 7, 3, 2, True, 0.7),
    ("2d-Nq7-Nk7-d3-dv4-causal", True, (), 7, 7, 3, 4, True, None),
    ("2d-Nq3-Nk9-d6-dv7", True, (), 3, 9, 6, 7, False, None),
    ("2-Nq5-Nk5-d3-dv2-causal-scale1.7", True, (2,), 5, 5, 3, 2, True, 1.7),
    ("2-Nq13-Nk13-d9-dv9-causal", True, (2,), 13, 13, 9, 9, True, None),
    ("2x3-Nq4-Nk4-d3-dv2-causal", True, (2, 3), 4, 4, 3, 2, True, None),
    ("2d-Nq33-Nk130-d17-dv5", False, (), 33, 130, 17, 5, False, None),
    ("2d-Nq130-Nk130-d1-dv3-causal", False, (), 130, 130, 1, 3, True, 0.7),
    ("2d-Nq66-Nk130-d64-dv64", False, (), 66, 130, 64, 64, False, None),
    ("2d-Nq33-Nk33-d4-dv9-causal", False, (), 33, 33, 4, 9, True, None),
    ("2-Nq130-Nk130-d17-dv3-causal", False, (2,), 130, 130, 17, 3, True, None),
    ("2x3-Nq33-Nk7-d3-dv17-scale0.7", False, (2, 3), 33, 7, 3, 17, False, 0.7),
    ("0x2-Nq3-Nk3-d2-dv4-causal", False, (0, 2), 3, 3, 2, 4, True, None),
]


def qkv(batch, N_q, N_k, d, d_v, seed=0, dtype=F64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, batch, N_q, N_k, d, d_v, causal, scale", cases("softmax_attention", ATTENTION_CASES))
def test_softmax_attention_matches_the_reference(backend, batch, N_q, N_k, d, d_v, causal, scale, dtype):
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=N_q + d, dtype=dtype)
    got = BACKENDS[backend].softmax_attention(q, k, v, scale=scale, causal=causal)
    assert np.asarray(got).dtype == dtype
    close("softmax_attention", got, ref_attention.softmax_attention(q, k, v, scale=scale, causal=causal))


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, batch, N_q, N_k, d, d_v, causal, scale", cases("softmax_attention_backward", ATTENTION_CASES))
def test_softmax_attention_gradients_match_the_reference(backend, batch, N_q, N_k, d, d_v, causal, scale, dtype):
    b = BACKENDS[backend]
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=N_q + d + 1, dtype=dtype)
    g = np.random.default_rng(1).normal(size=batch + (N_q, d_v)).astype(dtype)
    out, cache = b.softmax_attention_forward(q, k, v, scale=scale, causal=causal)
    ref_out, ref_cache = ref_attention.softmax_attention_forward(q, k, v, scale=scale, causal=causal)
    ref_grads = ref_attention.softmax_attention_backward(g, ref_cache)
    close("softmax_attention", out, ref_out)
    np.testing.assert_array_equal(out, b.softmax_attention(q, k, v, scale=scale, causal=causal))
    grads = b.softmax_attention_backward(g, cache)
    assert isinstance(grads, ref_attention.SoftmaxAttentionGrads)
    for name, got, want in zip(grads._fields, grads, ref_grads):
        close("softmax_attention_backward", got, want, name)


@pytest.mark.parametrize("backend", backends_with("softmax_attention"))
def test_mixed_dtypes_compute_in_float64_like_the_reference(backend):
    q, k, v = qkv((), 5, 6, 3, 2, seed=5)
    got = BACKENDS[backend].softmax_attention(q.astype(F32), k, v)
    close("softmax_attention", got, ref_attention.softmax_attention(q.astype(F32), k, v))


def _bad_attention_shapes(q, k, v):
    """The shape and type refusals of the attention functions, from valid ``(N, d)`` arrays ``q, k, v`` (N >= 4)."""
    return [
        ("q 1-D", (q[0], k, v), {}),
        ("k of another width", (q, k[:, :2].copy(), v), {}),
        ("v of another length", (q, k, v[:3].copy()), {}),
        ("integer q", (q.astype(np.int64), k, v), {}),
        ("causal lengths", (q[:3].copy(), k, v), {"causal": True}),
        ("batched causal lengths", (q[None, :3].copy(), k[None], v[None]), {"causal": True}),
        ("leading sizes differ", (q[None], np.stack([k, k]), np.stack([v, v])), {}),
        ("q batched, k and v not", (q[None], k, v), {}),
    ]


def _bad_attention():
    q, k, v = qkv((), 4, 4, 3, 2, seed=11)
    nan_k = k.copy()
    nan_k[1, 2] = np.nan
    row = qkv((), 6, 6, 2, 3, seed=12)[0]
    row_q, row_k = row.copy(), row.copy()
    row_q[:, 0], row_k[:, 0] = 0.0, -1e200
    row_q[3, 0] = 1e200  # row 3 scores -inf against every key, the others finite scores
    ones = lambda a: np.ones(np.shape(a)[:-1] + (1,))  # noqa: E731
    overflow = [
        ("scale 1e308", np.array([[2.0, 0.0], [0.0, 2.0]]), np.array([[2.0, 0.0], [0.0, 2.0]]), {"scale": 1e308}),
        ("causal, q k = 4e400", np.array([[2e200, 0.0], [0.0, 2e200]]), np.array([[2e200, 0.0], [0.0, 2e200]]), {"causal": True}),
        ("batched, second sequence's first row", np.stack([np.eye(2), np.array([[0.0, 1e300], [1.0, 0.0]])]),
         np.stack([np.eye(2), np.full((2, 2), 1e300)]), {}),
        ("inf - inf = NaN beside a finite score", np.array([[0.5, 0.5], [1e300, 1e300]]), np.array([[0.0, 0.0], [1e300, -1e300]]), {}),
        ("every score -inf", np.array([[1.0, 0.0], [-1e300, 0.0]]), np.array([[1e300, 0.0], [1e300, 0.0]]), {}),
    ]
    return _bad_attention_shapes(q, k, v) + [
        ("k with a NaN", (q, nan_k, v), {}),
        ("batched k with a NaN", (q[None], nan_k[None], v[None]), {}),
        ("no rows", (q[:0], k, v), {}),
        ("scale <= 0", (q, k, v), {"scale": -1.0}),
        ("scale a string", (q, k, v), {"scale": "1"}),
        ("causal not bool", (q, k, v), {"causal": "yes"}),
        ("a row of -inf among finite rows", (row_q, row_k, np.ones((6, 3))), {"scale": 1.0}),
    ] + [(name, (a, b_, ones(a)), kw) for name, a, b_, kw in overflow]


BAD_ATTENTION = _bad_attention()


@pytest.mark.parametrize("case", range(len(BAD_ATTENTION)), ids=[c[0] for c in BAD_ATTENTION])
@pytest.mark.parametrize("backend", backends_with("softmax_attention"))
def test_softmax_attention_refuses_what_the_reference_refuses(backend, case):
    b = BACKENDS[backend]
    _, args, kw = BAD_ATTENTION[case]
    refused_alike(lambda: b.softmax_attention(*args, **kw), lambda: ref_attention.softmax_attention(*args, **kw))
    if hasattr(b, "softmax_attention_forward"):
        refused_alike(lambda: b.softmax_attention_forward(*args, **kw), lambda: ref_attention.softmax_attention(*args, **kw))


@pytest.mark.parametrize("backend", backends_with("softmax_attention_forward", "softmax_attention_backward"))
def test_softmax_attention_backward_refuses_a_bad_grad_out_or_cache(backend):
    b = BACKENDS[backend]
    for batch in ((), (2,)):
        q, k, v = qkv(batch, 4, 4, 3, 2, seed=12)
        _, cache = b.softmax_attention_forward(q, k, v)
        _, ref_cache = ref_attention.softmax_attention_forward(q, k, v)
        refuses_bad_grads_and_caches_alike(b.softmax_attention_backward, ref_attention.softmax_attention_backward, cache,
                                           ref_cache, batch + (4, 2))


# ---------------------------------------------------------------------------
# Linear attention
# ---------------------------------------------------------------------------

# (id, tiny, batch, N_q, N_k, d, d_v, causal, chunk_size): one token, chunks of 1, a chunk edge at the last row and
# inside a chunk, chunks longer than N, odd widths, batches and heads
LINEAR_CASES = [
    ("2d-N1-d1-dv1-causal-C4", True, (), 1, 1, 1, 1, True, 4),
    ("2d-Nq3-Nk5-d2-dv3", True, (), 3, 5, 2, 3, False, 4),
    ("2d-N8-d3-dv2-causal-C4", True, (), 8, 8, 3, 2, True, 4),
    ("2d-N7-d3-dv2-causal-C1", True, (), 7, 7, 3, 2, True, 1),
    ("2-N6-d2-dv3-causal-C100", True, (2,), 6, 6, 2, 3, True, 100),
    ("2x3-N5-d3-dv2-causal-C2", True, (2, 3), 5, 5, 3, 2, True, 2),
    ("2d-N65-d5-dv7-causal-C16", False, (), 65, 65, 5, 7, True, 16),
    ("2d-Nq33-Nk130-d17-dv5", False, (), 33, 130, 17, 5, False, 64),
    ("3-N130-d9-dv4-causal-C64", False, (3,), 130, 130, 9, 4, True, 64),
]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, batch, N_q, N_k, d, d_v, causal, chunk", cases("linear_attention_forward", LINEAR_CASES))
def test_linear_attention_and_its_gradients_match_the_reference(backend, batch, N_q, N_k, d, d_v, causal, chunk, dtype):
    b = BACKENDS[backend]
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=N_q + d + 2, dtype=dtype)
    g = np.random.default_rng(3).normal(size=batch + (N_q, d_v)).astype(dtype)
    out, cache = b.linear_attention_forward(q, k, v, causal=causal, chunk_size=chunk)
    ref_out, ref_cache = ref_attention.linear_attention_forward(q, k, v, causal=causal, chunk_size=chunk)
    assert np.asarray(out).dtype == dtype
    close("linear_attention", out, ref_out)
    np.testing.assert_array_equal(out, b.linear_attention(q, k, v, causal=causal, chunk_size=chunk))
    grads = b.linear_attention_backward(g, cache)
    assert isinstance(grads, ref_attention.LinearAttentionGrads)
    for name, got, want in zip(grads._fields, grads, ref_attention.linear_attention_backward(g, ref_cache)):
        assert np.asarray(got).dtype == dtype, name
        close("linear_attention_backward", got, want, name)


def _bad_linear():
    q, k, v = qkv((), 4, 4, 3, 2, seed=13)
    nan_v = v.copy()
    nan_v[2, 1] = np.nan
    # features of -1000 underflow to exp(-1000) = 0: with eps = 0 the denominator of every row of sequence 1 is 0
    far = np.stack([q, np.full_like(q, -1000.0)])
    return _bad_attention_shapes(q, k, v) + [
        ("v with a NaN", (q, k, nan_v), {}),
        ("batched v with a NaN", (np.stack([q, q]), np.stack([k, k]), np.stack([v, nan_v])), {}),
        ("no rows", (q[:0], k, v), {}),
        ("no sequence", (q[None, :0].reshape(0, 4, 3), k[None, :0].reshape(0, 4, 3), v[None, :0].reshape(0, 4, 2)), {}),
        ("eps < 0", (q, k, v), {"eps": -1.0}),
        ("chunk_size 0", (q, k, v), {"causal": True, "chunk_size": 0}),
        ("causal not bool", (q, k, v), {"causal": "yes"}),
        ("eps 0, every denominator of sequence 1 is 0", (far, far, np.ones((2, 4, 2))), {"eps": 0.0}),
        ("eps 0, causal", (far[1], far[1], np.ones((4, 2))), {"eps": 0.0, "causal": True, "chunk_size": 2}),
    ]


BAD_LINEAR = _bad_linear()


@pytest.mark.parametrize("case", range(len(BAD_LINEAR)), ids=[c[0] for c in BAD_LINEAR])
@pytest.mark.parametrize("backend", backends_with("linear_attention_forward"))
def test_linear_attention_refuses_what_the_reference_refuses(backend, case):
    b = BACKENDS[backend]
    _, args, kw = BAD_LINEAR[case]
    refused_alike(lambda: b.linear_attention_forward(*args, **kw), lambda: ref_attention.linear_attention_forward(*args, **kw))
    refused_alike(lambda: b.linear_attention(*args, **kw), lambda: ref_attention.linear_attention(*args, **kw))


@pytest.mark.parametrize("backend", backends_with("linear_attention_forward", "linear_attention_backward"))
def test_linear_attention_backward_refuses_a_bad_grad_out_or_cache(backend):
    b = BACKENDS[backend]
    for batch in ((), (2,)):
        q, k, v = qkv(batch, 4, 4, 3, 2, seed=14)
        _, cache = b.linear_attention_forward(q, k, v, causal=True, chunk_size=3)
        _, ref_cache = ref_attention.linear_attention_forward(q, k, v, causal=True, chunk_size=3)
        refuses_bad_grads_and_caches_alike(b.linear_attention_backward, ref_attention.linear_attention_backward, cache,
                                           ref_cache, batch + (4, 2))


# ---------------------------------------------------------------------------
# OVQ and VQ attention
# ---------------------------------------------------------------------------

# (id, tiny, N, chunk_size, max_size, d, options): N not a multiple of C, N < C, N = 1, n_max = 1, n_max reached and not
OVQ_CASES = [
    ("N9-C3-n5", True, 9, 3, 5, 3, {}),
    ("N5-C1-n4-linear", True, 5, 1, 4, 2, {"growth": "linear"}),
    ("N11-C5-n6-random", True, 11, 5, 6, 4, {"init": "random", "seed": 0}),
    ("N8-C3-n6-random-linear", True, 8, 3, 6, 3, {"init": "random", "seed": 7, "growth": "linear"}),
    ("N7-C9-n4-no-count-bias", True, 7, 9, 4, 3, {"count_bias": False}),
    ("N7-C3-n5-lr0.3", True, 7, 3, 5, 2, {"learning_rate": 0.3}),
    ("N9-C5-n5-lr1-random-linear", True, 9, 5, 5, 3, {"learning_rate": 1.0, "init": "random", "seed": 3, "growth": "linear"}),
    ("N1-C3-n3", True, 1, 3, 3, 3, {}),
    ("N7-C3-n1-beta4.5", True, 7, 3, 1, 3, {"beta": 4.5}),
    ("N23-C4-n6-random-linear", False, 23, 4, 6, 3, {"init": "random", "seed": 7, "growth": "linear"}),
    ("N17-C3-n5-lr0.3", False, 17, 3, 5, 2, {"learning_rate": 0.3}),
    ("N19-C5-n5-lr1-random-linear", False, 19, 5, 5, 3, {"learning_rate": 1.0, "init": "random", "seed": 3, "growth": "linear"}),
    ("N13-C3-n1-beta4.5", False, 13, 3, 1, 3, {"beta": 4.5}),
    ("N70-C16-n8-beta2-linear", False, 70, 16, 8, 5, {"beta": 2.0, "growth": "linear"}),
]


def ovq_qkv(seed, N, d=3, d_v=2, dtype=F64, lead=()):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=lead + (N, n)).astype(dtype) for n in (d, d, d_v)]


def margins_qkv(seed, N, d=4, d_v=3, dtype=F32, lead=()):
    """Keys around ``d`` orthogonal directions: every assignment and seed wins by a wide margin, in float32 too."""
    rng = np.random.default_rng(seed)
    k = np.eye(d)[rng.integers(0, d, lead + (N,))] + 0.05 * rng.normal(size=lead + (N, d))
    return [rng.normal(size=lead + (N, d)).astype(dtype), k.astype(dtype), rng.normal(size=lead + (N, d_v)).astype(dtype)]


def mixer_qkv(B=3, H=2, N=33, dh=16):
    """The model's OVQ mixer in float32: heads of width 16, keys around 6 orthonormal directions (clear margins)."""
    rng = np.random.default_rng(0)
    centres = np.linalg.qr(rng.normal(size=(dh, dh)))[0][:6]
    k = (centres[rng.integers(0, 6, (B, H, N))] + 0.02 * rng.normal(size=(B, H, N, dh))).astype(F32)
    q = rng.normal(size=(B, H, N, dh)).astype(F32)
    v = rng.normal(size=(B, H, N, dh)).astype(F32)
    return [q, k, v], rng


def assert_state_close(state, ref, dtype):
    assert isinstance(state, ref_ovq.OVQState)
    assert (state.size, state.tokens_seen) == (ref.size, ref.tokens_seen)
    assert np.asarray(state.counts).dtype == np.int64
    np.testing.assert_array_equal(state.counts, ref.counts)
    close("ovq_attention", state.keys, ref.keys, "state.keys")
    close("ovq_attention", state.values, ref.values, "state.values")
    assert np.asarray(state.keys).dtype == dtype


@pytest.mark.parametrize("backend, N, C, n_max, d, kw", cases("ovq_attention", OVQ_CASES))
def test_ovq_attention_and_its_state_match_the_reference(backend, N, C, n_max, d, kw):
    b = BACKENDS[backend]
    q, k, v = ovq_qkv(N * 7 + C, N, d=d)
    out, state = b.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    close("ovq_attention", out, ref_out)
    assert_state_close(state, ref_state, F64)
    close("ovq_attention", b.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, **kw), ref_out, "without the state")


@pytest.mark.parametrize("kw", [{}, {"learning_rate": 0.5}, {"count_bias": False, "growth": "linear"}],
                         ids=["default", "lr0.5", "no-count-bias-linear"])
@pytest.mark.parametrize("backend", backends_with("ovq_attention"))
def test_ovq_attention_float32_is_computed_in_float32(backend, kw):
    b = BACKENDS[backend]
    q, k, v = margins_qkv(5, 12 if b.simulator else 45)
    out, state = b.ovq_attention(q, k, v, max_size=6, chunk_size=4 if b.simulator else 8, return_state=True, **kw)
    ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, max_size=6, chunk_size=4 if b.simulator else 8, return_state=True, **kw)
    assert np.asarray(out).dtype == F32
    close("ovq_attention", out, ref_out)
    assert_state_close(state, ref_state, F32)


def assert_records_equal(records, ref_records):
    assert len(records) == len(ref_records)
    for rec, ref in zip(records, ref_records):
        assert (rec.start, rec.stop, rec.n) == (ref.start, ref.stop, ref.n)
        for f in ("rows", "seeded", "seeds", "counts_mid", "added"):
            np.testing.assert_array_equal(getattr(rec, f), getattr(ref, f), err_msg=f)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, N, C, n_max, d, kw", cases("ovq_attention_backward", OVQ_CASES))
def test_ovq_forward_and_gradients_match_the_reference(backend, N, C, n_max, d, kw, dtype):
    b = BACKENDS[backend]
    q, k, v = ovq_qkv(N * 7 + C, N, d=d) if dtype == F64 else margins_qkv(N * 7 + C, N, d=d, d_v=2)
    out, cache = b.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
    ref_out, ref_cache = ref_ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
    close("ovq_attention", out, ref_out)
    assert_state_close(cache.state, ref_cache.state, dtype)
    g = np.random.default_rng(N).normal(size=np.shape(out)).astype(dtype)
    grads = b.ovq_attention_backward(g, cache)
    ref_grads = ref_ovq.ovq_attention_backward(g, ref_cache)
    assert isinstance(grads, ref_ovq.OVQGrads)
    for name, got, want in zip(grads._fields, grads, ref_grads):
        close("ovq_attention_backward", got, want, name)
    if type(cache) is type(ref_cache):
        assert_records_equal(cache.records, ref_cache.records)
        for name, got, want in zip(grads._fields, ref_ovq.ovq_attention_backward(g, cache), ref_grads):
            close("ovq_attention_backward", got, want, f"{name}, the reference's backward on the backend's cache")


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 1, "learning_rate": 0.2}, {"count_bias": False}],
                         ids=["default", "random-lr0.2", "no-count-bias"])
@pytest.mark.parametrize("backend", backends_with("ovq_attention_forward", "ovq_attention_backward"))
def test_an_ovq_batch_is_the_reference_per_sequence(backend, kw):
    b = BACKENDS[backend]
    for dtype, (lead, N, C, n_max, d_v) in ((F64, ((2, 3), 37, 8, 6, 3)), (F32, ((3, 2), 33, 16, 16, 16))):
        (q, k, v), rng = (ovq_qkv(9, N, d=4, d_v=d_v, lead=lead), np.random.default_rng(1)) if dtype == F64 else mixer_qkv()
        out, cache = b.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
        assert np.shape(out) == lead + (N, d_v) and cache.state is None and np.asarray(out).dtype == dtype
        g = rng.normal(size=np.shape(out)).astype(dtype)
        grads = b.ovq_attention_backward(g, cache)
        ref_out, ref_cache = ref_ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
        close("ovq_attention", out, ref_out)
        for name, got, want in zip(grads._fields, grads, ref_ovq.ovq_attention_backward(g, ref_cache)):
            close("ovq_attention_backward", got, want, name)
        # the backend's backward on the reference's cache
        for name, got, want in zip(grads._fields, b.ovq_attention_backward(g, ref_cache), grads):
            close("ovq_attention_backward", got, want, f"{name}, the reference's cache")


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 2}, {"growth": "linear", "learning_rate": 0.4}],
                         ids=["default", "random", "linear-lr0.4"])
@pytest.mark.parametrize("backend", backends_with("ovq_attention"))
def test_ovq_streams_through_a_state_like_the_reference(backend, kw):
    """Pieces of 12 and the rest, from the backend's own state and from the reference's; the state passed in is kept."""
    b = BACKENDS[backend]
    N, cut = (9, 6) if b.simulator else (31, 12)
    q, k, v = ovq_qkv(11, N, d=3)
    opts = dict(max_size=7, chunk_size=3 if b.simulator else 4, **kw)
    ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    out1, s1 = b.ovq_attention(q[:cut], k[:cut], v[:cut], return_state=True, **opts)
    kept = snapshot(s1)
    out2, s2 = b.ovq_attention(q[cut:], k[cut:], v[cut:], state=s1, return_state=True, **opts)
    assert_unchanged(kept, s1)
    close("ovq_attention", np.concatenate([out1, out2]), ref_out)
    assert_state_close(s2, ref_state, F64)
    _, r1 = ref_ovq.ovq_attention(q[:cut], k[:cut], v[:cut], return_state=True, **opts)
    ref2, ref_end = ref_ovq.ovq_attention(q[cut:], k[cut:], v[cut:], state=r1, return_state=True, **opts)
    out, end = b.ovq_attention(q[cut:], k[cut:], v[cut:], state=r1, return_state=True, **opts)
    close("ovq_attention", out, ref2, "from the reference's state")
    assert_state_close(end, ref_end, F64)
    if hasattr(b, "ovq_attention_forward"):
        out, cache = b.ovq_attention_forward(q[cut:], k[cut:], v[cut:], state=r1, **opts)
        ref2, ref_cache = ref_ovq.ovq_attention_forward(q[cut:], k[cut:], v[cut:], state=r1, **opts)
        close("ovq_attention", out, ref2, "forward from the reference's state")
        assert_state_close(cache.state, ref_cache.state, F64)
        g = np.ones_like(out)
        for name, got, want in zip(ref_ovq.OVQGrads._fields, b.ovq_attention_backward(g, cache), ref_ovq.ovq_attention_backward(g, ref_cache)):
            close("ovq_attention_backward", got, want, name)


@pytest.mark.parametrize("backend", backends_with("ovq_attention"))
def test_a_float64_state_makes_float32_inputs_float64(backend):
    """A state of the reference's after 10 tokens, and one written by hand."""
    b = BACKENDS[backend]
    for state, (q, k, v), opts in (
        (ref_ovq.ovq_attention(*ovq_qkv(3, 10), max_size=5, chunk_size=5, return_state=True)[1],
         ovq_qkv(4, 7, dtype=F32), dict(max_size=5, chunk_size=5)),
        (ref_ovq.OVQState(np.eye(3), np.ones((3, 2)), np.array([2, 1, 0]), 2, 3), ovq_qkv(6, 4, dtype=F32), dict(max_size=3, chunk_size=4)),
    ):
        out, st = b.ovq_attention(q, k, v, state=state, return_state=True, **opts)
        ref, ref_st = ref_ovq.ovq_attention(q, k, v, state=state, return_state=True, **opts)
        assert np.asarray(out).dtype == F64
        close("ovq_attention", out, ref)
        assert_state_close(st, ref_st, F64)


def _tie_cases():
    """Exact ties (duplicated centroids, identical keys): the lowest index wins, in the reference's stable order."""
    u, w = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])
    state = ref_ovq.OVQState(np.array([u, u, w, 0 * u, 0 * u]), np.ones((5, 2)), np.array([1, 2, 1, 0, 0]), 3, 4)
    k1 = np.array([[0.9, 0.1, 0.2], [0.8, -0.3, 0.1], [0.7, 0.2, -0.4]])
    b_ = np.array([-1.0, 0.2, 0.0])
    k2 = np.array([u, b_, b_, b_, [0.1, 1.0, 0.0]])
    rng = np.random.default_rng(11)
    k3 = np.eye(4)[rng.integers(0, 3, size=24)]
    q3, v3 = rng.normal(size=(24, 4)), rng.normal(size=(24, 3))
    rng = np.random.default_rng(4)
    k4 = rng.normal(size=(3, 4))[rng.integers(0, 3, 40)]
    q4, v4 = rng.normal(size=(40, 4)), rng.normal(size=(40, 2))
    return [
        ("two identical centroids", True, (k1, k1, np.arange(6.0).reshape(3, 2)), dict(max_size=5, chunk_size=3, state=state)),
        ("identical keys seed in index order", True, (k2, k2, np.arange(10.0).reshape(5, 2)), dict(max_size=100, chunk_size=5)),
        ("keys along three axes", False, (q3, k3, v3), dict(max_size=7, chunk_size=4)),
        ("three directions repeated", False, (q4, k4, v4), dict(max_size=9, chunk_size=6, growth="linear")),
    ]


TIES = _tie_cases()


@pytest.mark.parametrize("backend, args, kw", cases("ovq_attention", [(c[0], c[1], c[2], c[3]) for c in TIES]))
def test_ties_go_to_the_lowest_index_like_the_reference(backend, args, kw):
    out, state = BACKENDS[backend].ovq_attention(*args, return_state=True, **kw)
    ref_out, ref_state = ref_ovq.ovq_attention(*args, return_state=True, **kw)
    assert_state_close(state, ref_state, F64)
    close("ovq_attention", out, ref_out)


# (id, tiny, N, C, S): one code, one token, chunks of 1 and longer than N, two tiles of the simulator's codes
VQ_CASES = [("N5-C1-S4", True, 5, 1, 4), ("N10-C3-S10", True, 10, 3, 10), ("N7-C9-S1", True, 7, 9, 1), ("N1-C1-S5", True, 1, 1, 5),
            ("N17-C4-S5", False, 17, 4, 5), ("N5-C9-S5", False, 5, 9, 5)]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend, N, C, S", cases("vq_attention", VQ_CASES))
def test_vq_attention_matches_the_reference(backend, N, C, S, dtype):
    b = BACKENDS[backend]
    q, k, v = ovq_qkv(N + C, N, d=3, dtype=dtype)
    codebook = np.random.default_rng(C).normal(size=(S, 3)).astype(dtype)
    for beta in (None, 0.7):
        got = b.vq_attention(q, k, v, codebook, chunk_size=C, beta=beta)
        assert np.asarray(got).dtype == dtype
        close("vq_attention", got, ref_ovq.vq_attention(q, k, v, codebook, chunk_size=C, beta=beta), f"beta={beta}")


def _bad_ovq():
    q, k, v = ovq_qkv(0, 6)
    bad_q = q.copy()
    bad_q[2, 1] = np.nan
    good = dict(max_size=4, chunk_size=3)
    _, state = ref_ovq.ovq_attention(q, k, v, return_state=True, **good)
    huge = ref_ovq.OVQState(np.full((4, 3), 1e308), np.zeros((4, 2)), [1, 1, 1, 0], 3, 3)
    empty = ref_ovq.OVQState(np.zeros((3, 3)), np.zeros((3, 2)), np.zeros(3, np.int64), 0, 0)
    lagging = ref_ovq.OVQState(np.eye(6, 3), np.ones((6, 2)), np.array([4, 0, 0, 0, 0, 0]), 1, 4)
    lagging4 = ref_ovq.OVQState(np.ones((4, 3)), np.ones((4, 2)), [100, 0, 0, 0], 1, 100)
    big = ref_ovq.OVQState(np.array([[1e300, 0.0, 0.0], [0.0, 0.0, 0.0]]), np.ones((2, 2)), np.array([1, 0]), 1, 1)
    return [
        ("NaN q", (bad_q, k, v), good),
        ("k shorter", (q, k[:5], v), good),
        ("v of width 0", (q, k, v[:, :0]), good),
        ("no tokens", (q[:0], k[:0], v[:0]), good),
        ("integer q", (q.astype(int), k, v), good),
        ("q with leading dimensions", (q[None], k[None], v[None]), dict(good, return_state=True)),
        ("max_size 0", (q, k, v), dict(good, max_size=0)),
        ("chunk_size 1.5", (q, k, v), dict(good, chunk_size=1.5)),
        ("chunk_size 0", (q, k, v), dict(good, chunk_size=0)),
        ("growth log", (q, k, v), dict(good, growth="log")),
        ("init kmeans++", (q, k, v), dict(good, init="kmeans++")),
        ("learning_rate 2", (q, k, v), dict(good, learning_rate=2.0)),
        ("learning_rate 0", (q, k, v), dict(good, learning_rate=0.0)),
        ("beta -1", (q, k, v), dict(good, beta=-1.0)),
        ("seed -3", (q, k, v), dict(good, seed=-3)),
        ("count_bias yes", (q, k, v), dict(good, count_bias="yes")),
        ("return_state yes", (q, k, v), dict(good, return_state="yes")),
        ("missing max_size", (q, k, v), dict(chunk_size=3)),
        ("unknown keyword", (q, k, v), dict(good, chunksize=2)),
        ("positional option", (q, k, v, 3), dict(chunk_size=3)),
        ("state of another max_size", (q, k, v), dict(good, max_size=5, state=state)),
        ("state of another d", (q[:, :2], k[:, :2], v), dict(good, state=state)),
        ("state of another d_v", (q, k, v[:, :1]), dict(good, state=state)),
        ("state a tuple", (q, k, v), dict(good, state=(1, 2))),
        ("state a string", (q, k, v), dict(good, state="not a state")),
        ("empty state of another max_size", (q, k, v), dict(good, state=empty)),
        ("state lags its growth", (q, k, v), dict(max_size=6, chunk_size=4, growth="linear", state=lagging)),
        ("state lags its linear growth", (q, k, v), dict(max_size=4, chunk_size=2, growth="linear", state=lagging4)),
        ("v overflows the read-out", (q, k, v / np.max(np.abs(v)) * 1e308), good),
        ("beta q.D_k overflows", (q, k, v), dict(good, beta=10.0, state=huge)),
        ("beta 1e10 on keys of 1e300", (q[:3, :3], q[:3, :3], np.ones((3, 2))), dict(max_size=2, chunk_size=3, beta=1e10, state=big)),
    ]


BAD_OVQ = _bad_ovq()


@pytest.mark.parametrize("case", range(len(BAD_OVQ)), ids=[c[0] for c in BAD_OVQ])
@pytest.mark.parametrize("backend", backends_with("ovq_attention"))
def test_ovq_attention_refuses_what_the_reference_refuses(backend, case):
    b = BACKENDS[backend]
    _, args, kw = BAD_OVQ[case]
    refused_alike(lambda: b.ovq_attention(*args, **kw), lambda: ref_ovq.ovq_attention(*args, **kw))
    if hasattr(b, "ovq_attention_forward") and "return_state" not in kw and np.ndim(args[0]) == 2:
        refused_alike(lambda: b.ovq_attention_forward(*args, **kw), lambda: ref_ovq.ovq_attention_forward(*args, **kw))


def _bad_ovq_batch():
    qb, kb, vb = ovq_qkv(1, 6, lead=(2,))
    inf_q = qb.copy()
    inf_q[1, 4, 0] = np.inf
    big_v = vb.copy()
    big_v[0, 3] = 1e308
    _, state = ref_ovq.ovq_attention(qb[0], kb[0], vb[0], max_size=4, chunk_size=3, return_state=True)
    return [
        ("an infinite q in sequence 1", (inf_q, kb, vb), {}),
        ("sequence 0's read-out overflows", (kb, kb, big_v), {}),
        ("a state", (qb, kb, vb), {"state": state}),
        ("k of another leading shape", (qb, kb[:1], vb), {}),
        ("v without the leading dimensions", (qb, kb, vb[0]), {}),
        ("no sequence", (qb[:0], kb[:0], vb[:0]), {}),
        ("integer k", (qb, kb.astype(int), vb), {}),
        ("max_size 0", (qb, kb, vb), {"max_size": 0}),
    ]


BAD_OVQ_BATCH = _bad_ovq_batch()


@pytest.mark.parametrize("case", range(len(BAD_OVQ_BATCH)), ids=[c[0] for c in BAD_OVQ_BATCH])
@pytest.mark.parametrize("backend", backends_with("ovq_attention_forward"))
def test_an_ovq_batch_is_refused_like_the_reference(backend, case):
    """A batch's own refusals, and what the first of its sequences to fail raises on its own."""
    _, args, kw = BAD_OVQ_BATCH[case]
    kw = {"max_size": 4, "chunk_size": 3, **kw}
    refused_alike(lambda: BACKENDS[backend].ovq_attention_forward(*args, **kw), lambda: ref_ovq.ovq_attention_forward(*args, **kw))


@pytest.mark.parametrize("backend", backends_with("ovq_attention_forward", "ovq_attention_backward"))
def test_ovq_backward_refuses_a_bad_grad_out_or_cache(backend):
    b = BACKENDS[backend]
    good = dict(max_size=4, chunk_size=3)
    for lead in ((), (2,)):
        q, k, v = ovq_qkv(0, 6, lead=lead)
        _, cache = b.ovq_attention_forward(q, k, v, **good)
        _, ref_cache = ref_ovq.ovq_attention_forward(q, k, v, **good)
        refuses_bad_grads_and_caches_alike(b.ovq_attention_backward, ref_ovq.ovq_attention_backward, cache, ref_cache,
                                           lead + (6, 2))


def _bad_vq():
    q, k, v = ovq_qkv(0, 4)
    nan_q = q.copy()
    nan_q[2, 1] = np.nan
    cb = np.random.default_rng(7).normal(size=(3, 3))
    return [
        ("codebook d", (q, k, v, cb[:, :2]), dict(chunk_size=2)),
        ("empty codebook", (q, k, v, cb[:0]), dict(chunk_size=2)),
        ("chunk_size 0", (q, k, v, cb), dict(chunk_size=0)),
        ("beta 0", (q, k, v, cb), dict(chunk_size=2, beta=0.0)),
        ("beta -1", (q, k, v, cb), dict(chunk_size=2, beta=-1.0)),
        ("k shorter", (q, k[:3], v, cb), dict(chunk_size=2)),
        ("NaN q", (nan_q, k, v, cb), dict(chunk_size=2)),
        ("NaN codebook", (q, k, v, np.array([[1.0, np.nan, 0.0]])), dict(chunk_size=2)),
        ("inf codebook", (q, k, v, np.where(cb == cb[1, 1], np.inf, cb)), dict(chunk_size=2)),
        ("integer codebook", (q, k, v, cb.astype(int)), dict(chunk_size=2)),
        ("missing chunk_size", (q, k, v, cb), {}),
        ("codebook logits overflow", (q, k, v, cb * 1e308), dict(chunk_size=2, beta=10.0)),
        ("beta 1e10 on a code of 1e300", (q[:3, :2], q[:3, :2], np.ones((3, 1)), np.array([[1e300, 1e300]])), dict(chunk_size=3, beta=1e10)),
    ]


BAD_VQ = _bad_vq()


@pytest.mark.parametrize("case", range(len(BAD_VQ)), ids=[c[0] for c in BAD_VQ])
@pytest.mark.parametrize("backend", backends_with("vq_attention"))
def test_vq_attention_refuses_what_the_reference_refuses(backend, case):
    b = BACKENDS[backend]
    _, args, kw = BAD_VQ[case]
    refused_alike(lambda: b.vq_attention(*args, **kw), lambda: ref_ovq.vq_attention(*args, **kw))


# ---------------------------------------------------------------------------
# Inputs left as they were
# ---------------------------------------------------------------------------


def _calls(b):
    """``(function, call, inputs)``: one representative call of each function the backend offers."""
    small = not b.simulator
    x, means, variances, weights = gmm_problem(9 if small else 3, 4, 3, F64)
    gma_args = _problem((2,), True, 9 if small else 3, 3, 2, 3, F64, seed=2)
    q, k, v = qkv((2,), 6, 6, 3, 2, seed=3)
    oq, ok, ov = ovq_qkv(4, 10)
    _, state = ref_ovq.ovq_attention(oq, ok, ov, max_size=5, chunk_size=3, return_state=True)
    codebook = np.random.default_rng(5).normal(size=(4, 3))
    calls = []
    for fn in GMM_FUNCTIONS:
        calls.append((fn, lambda fn=fn: getattr(b, fn)(x, means, variances, weights), [x, means, variances, weights]))
    calls.append(("gma_forward", lambda: b.gma_forward(*gma_args, causal=True, chunk_size=2), list(gma_args)))
    plain = constrained(gma_args)
    calls.append(("gma", lambda: b.gma(*plain, causal=True, chunk_size=2), list(plain)))
    if hasattr(b, "gma_forward"):
        g = np.random.default_rng(6).normal(size=gma_args[0].shape[:-1] + (3,))
        calls.append(("gma_backward", lambda: b.gma_backward(g, b.gma_forward(*gma_args, causal=True, chunk_size=2)[1]), [g]))
    calls.append(("softmax_attention", lambda: b.softmax_attention(q, k, v, causal=True), [q, k, v]))
    calls.append(("softmax_attention_forward", lambda: b.softmax_attention_forward(q, k, v), [q, k, v]))
    if hasattr(b, "softmax_attention_forward"):
        ga = np.ones((2, 6, 2))
        calls.append(("softmax_attention_backward", lambda: b.softmax_attention_backward(ga, b.softmax_attention_forward(q, k, v)[1]), [ga]))
    calls.append(("ovq_attention", lambda: b.ovq_attention(oq, ok, ov, max_size=5, chunk_size=3, state=state, return_state=True),
                  [oq, ok, ov, state]))
    calls.append(("ovq_attention_forward", lambda: b.ovq_attention_forward(oq, ok, ov, max_size=5, chunk_size=3, state=state),
                  [oq, ok, ov, state]))
    if hasattr(b, "ovq_attention_forward"):
        go = np.ones((10, 2))
        calls.append(("ovq_attention_backward",
                      lambda: b.ovq_attention_backward(go, b.ovq_attention_forward(oq, ok, ov, max_size=5, chunk_size=3)[1]), [go]))
    calls.append(("vq_attention", lambda: b.vq_attention(oq, ok, ov, codebook, chunk_size=3), [oq, ok, ov, codebook]))
    return [c for c in calls if hasattr(b, c[0])]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_inputs_are_left_as_they_were(backend):
    b = BACKENDS[backend]
    calls = _calls(b)
    if not calls:
        pytest.skip(f"{backend} offers none of the functions")
    for name, call, inputs in calls:
        before = snapshot(inputs)
        call()
        assert_unchanged(before, inputs)


# ---------------------------------------------------------------------------
# The same bits with one thread or two
# ---------------------------------------------------------------------------


def _threaded_results(b):
    """Every function on sizes that cross many row blocks, chunks and tiles: a list of arrays."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(1001, 8))
    results = [b.responsibilities(x, *mixture(5, 8, seed=8)), b.log_responsibilities(x, *mixture(5, 8, seed=8))]
    args = _problem((2,), True, 600, 5, 3, 4, F64, seed=9)
    for causal in (False, True):
        out, cache = b.gma_forward(*args, causal=causal)
        results += [out, *b.gma_backward(np.ones_like(out), cache), b.gma(*constrained(args), causal=causal)]
    if hasattr(b, "softmax_attention_forward"):
        for dtype in (F64, F32):
            for (q, k, v), causal in ((qkv((2,), 101, 101, 17, 6, seed=15), True), (qkv((), 65, 163, 8, 3, seed=17), False)):
                q, k, v = (a.astype(dtype) for a in (q, k, v))
                out, cache = b.softmax_attention_forward(q, k, v, causal=causal)
                g = np.random.default_rng(16).normal(size=out.shape).astype(dtype)
                results += [out, *b.softmax_attention_backward(g, cache), b.softmax_attention(q, k, v, causal=causal)]
            # packed: sequences of several blocks and tiles, empty and of length 1, two heads
            offsets = [0, 0, 70, 71, 71, 200]
            x = packed_problem(offsets, True, dtype, d=5, d_v=3, seed=18)
            out, cache = b.softmax_attention_forward(*x, causal=True, cu_seqlens=offsets)
            results += [out, *b.softmax_attention_backward(np.ones_like(out), cache)]
    if hasattr(b, "ovq_attention_forward"):
        for lead in ((), (3,)):
            q, k, v = ovq_qkv(21, 150, d=6, d_v=4, lead=lead)
            out, cache = b.ovq_attention_forward(q, k, v, max_size=20, chunk_size=40)
            results += [out, *b.ovq_attention_backward(np.random.default_rng(2).normal(size=v.shape), cache)]
        q, k, v = ovq_qkv(22, 150, d=6, d_v=4)
        results.append(b.vq_attention(q, k, v, q[:9], chunk_size=40))
    return results


@pytest.mark.parametrize("backend", [name for name, b in BACKENDS.items() if b.bits_threads])
def test_the_same_bits_with_one_thread_or_two(backend):
    """The threaded kernels (forced for every size) on one thread and on two, and the serial builds: the same bits."""
    b = BACKENDS[backend]
    runs = []
    for n in (1, 2, None):
        with b.threads(n):
            runs.append(_threaded_results(b))
    for one, two, serial in zip(*runs, strict=True):
        assert one.dtype == two.dtype == serial.dtype
        assert np.array_equal(one, two) and np.array_equal(one, serial)


# ---------------------------------------------------------------------------
# Packed variable-length batches (cu_seqlens): the loop over the sequences
# ---------------------------------------------------------------------------

#: ``(id, tiny, offsets, chunk_size)``: empty sequences first, between and last, one of length 1, boundaries inside a
#: chunk (5, 6) and on a chunk edge (8, 16) of chunk 4.
PACKED = [
    ("empty-1-inside-edge-C4", False, [0, 0, 5, 6, 6, 8, 16, 16], 4),
    ("tiny-C2", True, [0, 0, 3, 4, 4], 2),
]


def heads_first(x):
    return np.moveaxis(x, 0, 1) if x.ndim == 3 else x


def per_sequence(function, tokens, offsets, *args, **kwargs):
    """The contract's loop: ``function`` on each non-empty sequence alone (heads first), ``None`` for an empty one."""
    return [function(*(heads_first(x[a:b]) for x in tokens), *args, **kwargs) if b > a else None
            for a, b in zip(offsets[:-1], offsets[1:])]


def in_rows(parts, like):
    """The parts of the sequences (heads first) laid back in their rows: an array of ``like``'s shape."""
    out = np.zeros_like(like)
    rows = np.cumsum([0] + [0 if p is None else np.shape(p)[-2] for p in parts])
    for p, a, b in zip(parts, rows[:-1], rows[1:]):
        if p is not None:
            out[a:b] = heads_first(np.asarray(p)) if like.ndim == 3 else p
    return out


def summed(parts):
    """The parameter gradients of the sequences, summed in order."""
    total = None
    for p in parts:
        total = p if total is None else (total if p is None else total + p)
    return total


def packed_problem(offsets, heads, dtype, d=2, d_v=3, seed=0):
    """Packed ``q, k, v`` of ``offsets[-1]`` tokens, ``(T, d)`` or with two heads ``(T, 2, d)``."""
    rng = np.random.default_rng(seed)
    lead = (offsets[-1],) + ((2,) if heads else ())
    return [rng.normal(size=lead + (n,)).astype(dtype) for n in (d, d, d_v)]


def packed_cases(function, heads=(False, True)):
    """``(backend, offsets, chunk, heads, dtype)`` for each backend offering ``function``; in the simulator, one tiny
    case in float64 without heads (the packed call is the same loop there: its few kernels are slow to simulate)."""
    return [pytest.param(*p.values, h, dtype, id=f"{p.id}-{'heads' if h else '2d'}-{dtype.__name__}")
            for p in cases(function, PACKED) for h in heads for dtype in (F64, F32)
            if not BACKENDS[p.values[0]].simulator or (not h and dtype is F64)]


@pytest.mark.parametrize("backend, offsets, chunk, heads, dtype", packed_cases("gma_forward"))
def test_packed_gma_and_every_gradient_are_the_loop_over_the_sequences(backend, offsets, chunk, heads, dtype):
    b = BACKENDS[backend]
    x_q, x_k, v = packed_problem(offsets, heads, dtype)
    params = _problem((2,) if heads else (), heads, 1, 3, 2, 3, dtype, seed=5)[3:]
    for causal in (True,) if b.simulator else (True, False):
        out, cache = b.gma_forward(x_q, x_k, v, *params, causal=causal, chunk_size=chunk, cu_seqlens=offsets)
        g = np.random.default_rng(2).normal(size=np.shape(out)).astype(dtype)
        loop = per_sequence(lambda q, k, v1: ref_gma.gma_forward(q, k, v1, *params, causal=causal, chunk_size=chunk), (x_q, x_k, v), offsets)
        assert np.asarray(out).dtype == dtype and np.shape(out) == np.shape(v)
        close("gma_forward", out, in_rows([r and r[0] for r in loop], v))
        grads = b.gma_backward(g, cache)
        ref = [ref_gma.gma_backward(heads_first(g[a:e]), r[1]) if r else None for a, e, r in zip(offsets[:-1], offsets[1:], loop)]
        for i, (name, like) in enumerate(zip(ref_gma.GMAGrads._fields, (x_q, x_k, v) + params)):
            parts = [r and r[i] for r in ref]
            want = in_rows(parts, like) if i < 3 else summed(parts)
            assert np.asarray(getattr(grads, name)).dtype == dtype, name
            close("gma_backward", getattr(grads, name), want, name)
        w = ref_gma.mixture_from_raw(params[1], params[2], 1e-6)
        gma_args = (params[0], w[0], np.exp(w[1]))
        close("gma", b.gma(x_q, x_k, v, *gma_args, causal=causal, chunk_size=chunk, cu_seqlens=offsets),
              in_rows(per_sequence(lambda q, k, v1: ref_gma.gma(q, k, v1, *gma_args, causal=causal, chunk_size=chunk),
                                   (x_q, x_k, v), offsets), v), "gma")


def packed_attention(b, function, tokens, offsets, dtype, **options):
    """``function`` of ``b`` and the reference, packed against the loop: the output and (with a backward) every gradient."""
    ref = getattr(ref_attention, function)
    loop = per_sequence(lambda q, k, v: ref(q, k, v, **options), tokens, offsets)
    if not hasattr(b, f"{function}_forward"):
        close(function, getattr(b, function)(*tokens, **options, cu_seqlens=offsets), in_rows(loop, tokens[2]))
        return
    out, cache = getattr(b, f"{function}_forward")(*tokens, **options, cu_seqlens=offsets)
    close(function, out, in_rows(loop, tokens[2]))
    close(function, getattr(b, function)(*tokens, **options, cu_seqlens=offsets), in_rows(loop, tokens[2]), "without the cache")
    g = np.random.default_rng(3).normal(size=out.shape).astype(dtype)
    ref_forward, ref_backward = getattr(ref_attention, f"{function}_forward"), getattr(ref_attention, f"{function}_backward")
    grads = getattr(b, f"{function}_backward")(g, cache)
    want = [ref_backward(heads_first(g[a:e]), ref_forward(*(heads_first(x[a:e]) for x in tokens), **options)[1]) if e > a else None
            for a, e in zip(offsets[:-1], offsets[1:])]
    for i, name in enumerate(("q", "k", "v")):
        assert np.asarray(getattr(grads, name)).dtype == dtype
        close(f"{function}_backward", getattr(grads, name), in_rows([w and w[i] for w in want], tokens[i]), name)


@pytest.mark.parametrize("backend, offsets, chunk, heads, dtype", packed_cases("softmax_attention"))
def test_packed_softmax_attention_and_its_gradients_are_the_loop_over_the_sequences(backend, offsets, chunk, heads, dtype):
    tokens = packed_problem(offsets, heads, dtype, seed=1)
    for causal in (True, False):
        packed_attention(BACKENDS[backend], "softmax_attention", tokens, offsets, dtype, causal=causal)


@pytest.mark.parametrize("backend, offsets, chunk, heads, dtype", packed_cases("linear_attention"))
def test_packed_linear_attention_and_its_gradients_are_the_loop_over_the_sequences(backend, offsets, chunk, heads, dtype):
    tokens = packed_problem(offsets, heads, dtype, seed=2)
    for causal in (True, False):
        packed_attention(BACKENDS[backend], "linear_attention", tokens, offsets, dtype, causal=causal, chunk_size=chunk)


@pytest.mark.parametrize("backend, offsets, chunk, heads, dtype", packed_cases("ovq_attention", heads=(False,)))
def test_packed_ovq_and_vq_attention_are_the_loop_over_the_sequences_each_from_its_own_state(backend, offsets, chunk, heads, dtype):
    b = BACKENDS[backend]
    q, k, v = margins_qkv(4, offsets[-1], d=3, d_v=2, dtype=dtype)
    options = dict(max_size=4, chunk_size=chunk)
    # sequence 1 continues a stream of its own; an empty sequence given a state gives it back
    first = ref_ovq.ovq_attention(*margins_qkv(5, 3, d=3, d_v=2, dtype=dtype), **options, return_state=True)[1]
    states = [None] * (len(offsets) - 1)
    states[1], states[0] = first, first
    out, got = b.ovq_attention(q, k, v, **options, state=states, return_state=True, cu_seqlens=offsets)
    loop = [ref_ovq.ovq_attention(q[a:e], k[a:e], v[a:e], **options, state=st, return_state=True) if e > a else None
            for a, e, st in zip(offsets[:-1], offsets[1:], states)]
    close("ovq_attention", out, in_rows([r and r[0] for r in loop], v))
    assert len(got) == len(states)
    for st, r, given in zip(got, loop, states):
        assert_state_close(st, r[1] if r else (given or ref_ovq.OVQState.empty(4, 3, 2, dtype)), dtype)
    if hasattr(b, "vq_attention"):
        close("vq_attention", b.vq_attention(q, k, v, k[:3], chunk_size=chunk, cu_seqlens=offsets), in_rows(
            per_sequence(lambda q1, k1, v1: ref_ovq.vq_attention(q1, k1, v1, k[:3], chunk_size=chunk), (q, k, v), offsets), v))
    if hasattr(b, "ovq_attention_forward"):
        out, cache = b.ovq_attention_forward(q, k, v, **options, cu_seqlens=offsets)
        g = np.random.default_rng(4).normal(size=out.shape).astype(dtype)
        grads = b.ovq_attention_backward(g, cache)
        want = [ref_ovq.ovq_attention_backward(g[a:e], ref_ovq.ovq_attention_forward(q[a:e], k[a:e], v[a:e], **options)[1])
                if e > a else None for a, e in zip(offsets[:-1], offsets[1:])]
        for i, x in enumerate((q, k, v)):
            close("ovq_attention_backward", grads[i], in_rows([w and w[i] for w in want], x), "qkv"[i])


def packed_calls(b, x, offsets, state=None):
    """Each function of ``b`` that takes ``cu_seqlens``, called on the packed tokens ``x`` (three arrays)."""
    means, variances, weights = mixture(3, np.shape(x[1])[-1])
    calls = {
        "gma": lambda: b.gma(*x, means, variances, weights, causal=True, chunk_size=2, cu_seqlens=offsets),
        "gma_forward": lambda: b.gma_forward(*x, means, variances, np.zeros(3), chunk_size=2, cu_seqlens=offsets),
        "softmax_attention": lambda: b.softmax_attention(*x, causal=True, cu_seqlens=offsets),
        "softmax_attention_forward": lambda: b.softmax_attention_forward(*x, cu_seqlens=offsets),
        "linear_attention": lambda: b.linear_attention(*x, causal=True, chunk_size=2, cu_seqlens=offsets),
        "linear_attention_forward": lambda: b.linear_attention_forward(*x, cu_seqlens=offsets),
        "ovq_attention": lambda: b.ovq_attention(*x, max_size=3, chunk_size=2, state=state, return_state=True, cu_seqlens=offsets),
        "ovq_attention_forward": lambda: b.ovq_attention_forward(*x, max_size=3, chunk_size=2, state=state, cu_seqlens=offsets),
        "vq_attention": lambda: b.vq_attention(*x, means, chunk_size=2, cu_seqlens=offsets),
    }
    return {name: call for name, call in calls.items() if hasattr(b, name)}


def _bad_packed():
    """``(id, offsets, tokens, state, words)`` of packed calls the reference refuses; the last sequence, or the last offset,
    is what is wrong where it can be (a loop that computed as it went would have computed the sequences before)."""
    x = packed_problem([6], False, F64, d=2, d_v=2, seed=9)
    nan = [a.copy() for a in x]
    nan[0][5, 1] = np.nan
    state = ref_ovq.OVQState.empty(3, 2, 2)
    return [
        ("floats", [0.0, 3.0, 6.0], x, None, "cu_seqlens: "),
        ("booleans", [False, True], x, None, "cu_seqlens: "),
        ("2-D", [[0, 3, 6]], x, None, "cu_seqlens: "),
        ("no-offset", [], x, None, "cu_seqlens: "),
        ("not-from-0", [1, 3, 6], x, None, "cu_seqlens: "),
        ("decreasing", [0, 2, 4, 3, 6], x, None, "cu_seqlens: "),
        ("short-of-T", [0, 3, 5], x, None, "cu_seqlens: "),
        ("past-T", [0, 3, 7], x, None, "cu_seqlens: "),
        ("batch-dimension", [0, 3, 6], [a[None, :, None] for a in x], None, "cu_seqlens: "),
        ("nan-in-the-last-sequence", [0, 3, 4, 6], nan, None, "(first at index (5, 1): nan)"),
        ("one-state-for-two-sequences", [0, 3, 6], x, state, "state: "),
        ("three-states-for-two-sequences", [0, 3, 6], x, [state] * 3, "state: "),
    ]


BAD_PACKED = _bad_packed()


@pytest.mark.parametrize("case", range(len(BAD_PACKED)), ids=[c[0] for c in BAD_PACKED])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bad_offsets_are_refused_alike_and_before_anything_is_computed(backend, case, monkeypatch):
    _, offsets, x, state, words = BAD_PACKED[case]
    b = BACKENDS[backend]
    ran = []
    for name, call in packed_calls(b, x, offsets, state).items():
        if state is not None and not name.startswith("ovq"):
            continue
        fn = getattr(b, name)
        for key in getattr(fn, "backend", None) and fn.backend.kernels or ():
            monkeypatch.setitem(fn.backend.kernels, key, lambda *a, _k=key, **kw: ran.append(_k))
        got, _ = refused_alike(call, packed_calls(ref_namespace(), x, offsets, state)[name])
        assert words in str(got), str(got)
    assert not ran, f"computed before refusing: {ran}"


def ref_namespace():
    """The reference's functions under their names."""
    import types

    return types.SimpleNamespace(gma=ref_gma.gma, gma_forward=ref_gma.gma_forward, softmax_attention=ref_attention.softmax_attention,
                                 softmax_attention_forward=ref_attention.softmax_attention_forward,
                                 linear_attention=ref_attention.linear_attention,
                                 linear_attention_forward=ref_attention.linear_attention_forward,
                                 ovq_attention=ref_ovq.ovq_attention, ovq_attention_forward=ref_ovq.ovq_attention_forward,
                                 vq_attention=ref_ovq.vq_attention)


@pytest.mark.parametrize("heads", [False, True], ids=["2d", "heads"])
@pytest.mark.parametrize("dtype", [F64, F32], ids=["float64", "float32"])
def test_the_references_packed_call_is_its_loop_bit_for_bit(dtype, heads):
    """The definition: the reference's packed outputs and gradients are the loop over the sequences, to the last bit."""
    _, _, offsets, chunk = PACKED[0]
    x = packed_problem(offsets, heads, dtype, seed=6)
    params = _problem((2,) if heads else (), heads, 1, 3, 2, 3, dtype, seed=7)[3:]
    g = np.random.default_rng(8).normal(size=x[2].shape).astype(dtype)
    forwards = {
        "gma": (lambda *t, **kw: ref_gma.gma_forward(*t, *params, causal=True, chunk_size=chunk, **kw), ref_gma.gma_backward),
        "softmax": (lambda *t, **kw: ref_attention.softmax_attention_forward(*t, causal=True, **kw), ref_attention.softmax_attention_backward),
        "linear": (lambda *t, **kw: ref_attention.linear_attention_forward(*t, chunk_size=chunk, **kw), ref_attention.linear_attention_backward),
    }
    if not heads:
        forwards["ovq"] = (lambda *t, **kw: ref_ovq.ovq_attention_forward(*t, max_size=3, chunk_size=chunk, **kw), ref_ovq.ovq_attention_backward)
    for name, (forward, backward) in forwards.items():
        out, cache = forward(*x, cu_seqlens=offsets)
        grads = backward(g, cache)
        loop = [(r[0], backward(heads_first(g[a:e]), r[1])) if r else None
                for r, a, e in zip(per_sequence(forward, x, offsets), offsets[:-1], offsets[1:])]
        assert np.array_equal(out, in_rows([r and r[0] for r in loop], x[2])), name
        for i, got in enumerate(grads):
            parts = [r and r[1][i] for r in loop]
            want = in_rows(parts, x[i]) if i < 3 else summed(parts)
            assert got.dtype == dtype and np.array_equal(got, want), (name, i)


@pytest.mark.parametrize("backend", [n for n in ("numba_cuda", "cupy") if n in BACKENDS])
def test_packed_sequences_on_a_device_are_refused_naming_cu_seqlens(backend, monkeypatch):
    """A packed call takes host arrays: a device array is refused before anything is computed, forward and backward."""
    b = BACKENDS[backend]
    x = packed_problem([6], False, F64, d=2, d_v=2, seed=9)
    if backend == "numba_cuda":
        to_device = pytest.importorskip("numba.cuda").to_device
    else:
        to_device = pytest.importorskip("cupy").asarray
    ran = []
    for key in b.gma.backend.kernels:
        monkeypatch.setitem(b.gma.backend.kernels, key, lambda *a, _k=key, **kw: ran.append(_k))
    for name, call in packed_calls(b, [to_device(x[0]), x[1], x[2]], [0, 3, 6]).items():
        with pytest.raises(TypeError, match=r"^cu_seqlens: packed sequences are taken as host arrays \(NumPy\), got (x_)?q of type "):
            call()
    assert not ran
