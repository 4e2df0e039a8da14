"""gpu.cupy_kernels on a GPU: the kernels against their NumPy twins, the public functions against refimpl.

Skipped, with the reason printed, only where the machine has no GPU
(decided without CuPy: :func:`gpu.cupy_kernels._backend.gpu_present`); on a
machine with a GPU where CuPy cannot allocate, every test here fails with
CuPy's reason (:func:`gpu.cupy_kernels._backend.device_test_decision`).
"""

import importlib

import numpy as np
import pytest

from gpu.cupy_kernels import _backend

DECISION, WHY = _backend.device_test_decision()
if DECISION == "skip":
    pytest.skip(WHY, allow_module_level=True)


@pytest.fixture(autouse=True)
def _cupy_must_run_on_a_gpu():
    if DECISION == "fail":
        pytest.fail(WHY)


import cupy  # noqa: E402

import gpu.cupy_kernels as ck  # noqa: E402
from gpu.cupy_kernels import attention, gmm, scan  # noqa: E402
from refimpl import attention as ref_attention  # noqa: E402
from refimpl import gma as ref_gma  # noqa: E402
from refimpl import gmm as ref_gmm  # noqa: E402

gma = importlib.import_module("gpu.cupy_kernels.gma")
RTOL = {np.float64: 1e-10, np.float32: 1e-5}
DTYPES = [np.float64, np.float32]


def _close(ours, ref, dtype, atol=None):
    ours = cupy.asnumpy(ours) if isinstance(ours, cupy.ndarray) else ours
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_allclose(ours, ref, rtol=RTOL[dtype], atol=RTOL[dtype] if atol is None else atol)


def _gma_inputs(rng, leading, per_head, N=70, d=3, K=5, dv=4, dtype=np.float64):
    heads = (leading[-1],) if per_head else ()
    return (
        rng.normal(size=leading + (N, d)).astype(dtype), rng.normal(size=leading + (N, d)).astype(dtype),
        rng.normal(size=leading + (N, dv)).astype(dtype), rng.normal(size=heads + (K, d)).astype(dtype),
        rng.normal(size=heads + (K, d)).astype(dtype), rng.normal(size=heads + (K,)).astype(dtype),
    )


# ---------------------------------------------------------------------------
# Kernels against their NumPy twins
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("K", [1, 5, 33, 100])
def test_row_kernel_matches_twin(K, log, dtype):
    rng = np.random.default_rng(K)
    H, N = 3, 7
    t = rng.normal(size=(2 * H * N, K)).astype(dtype) * 10
    shift, log_norm = rng.normal(size=(H, K)).astype(dtype), rng.normal(size=(H, K)).astype(dtype)
    log_norm[1, 0] = -np.inf  # a zero weight
    ours = cupy.asarray(t)
    mq = gmm.normalise_rows(cupy, ours, cupy.asarray(shift), cupy.asarray(log_norm), N, log)
    ref = t.copy()
    ref_mq = gmm.normalise_rows(np, ref, shift, log_norm, N, log)
    _close(ours, ref, dtype)
    _close(mq, ref_mq, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("N, chunk, F, W", [(6, 3, 2, 3), (70, 35, 5, 4), (128, 64, 40, 33), (9, 9, 1, 1)])
def test_chunk_kernel_matches_twin(N, chunk, F, W, upper, dtype):
    rng = np.random.default_rng(N + F)
    S = 3
    A, B = rng.random((S, N, F)).astype(dtype), rng.random((S, N, F)).astype(dtype)
    c_full = rng.normal(size=(S, N, W + 1)).astype(dtype)  # C is a column slice: row stride W + 1
    base = rng.normal(size=(S, N, W)).astype(dtype)
    ours = scan.chunk_tri(cupy, cupy.asarray(A), cupy.asarray(B), cupy.asarray(c_full)[..., :W], cupy.asarray(base), chunk, upper)
    _close(ours, scan.chunk_tri(np, A, B, c_full[..., :W], base.copy(), chunk, upper), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_row_kernel_matches_twin(causal, dtype):
    rng = np.random.default_rng(9)
    t = rng.normal(size=(2 * 40, 40)).astype(dtype)
    ours = cupy.asarray(t)
    row_max = attention.softmax_rows(cupy, ours, 0.3, 40, causal)
    ref = t.copy()
    ref_max = attention.softmax_rows(np, ref, 0.3, 40, causal)
    _close(ours, ref, dtype)
    _close(row_max, ref_max, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_and_reduction_kernels_match_twins(dtype):
    rng = np.random.default_rng(10)
    s = np.concatenate([rng.normal(size=50) * 30, [0.0, -80.0, 80.0]]).astype(dtype)
    g = rng.normal(size=s.shape).astype(dtype)
    m = np.asarray(1e-6, dtype=dtype)
    _close(gma.softplus_floor(cupy.asarray(s), cupy.asarray(m)), gma.softplus_floor(s, m), dtype)
    _close(gma.sigmoid_chain(cupy.asarray(g), cupy.asarray(s)), gma.sigmoid_chain(g, s), dtype)
    a, b = rng.normal(size=(6, 9)).astype(dtype), rng.normal(size=(6, 9)).astype(dtype)
    _close(scan.row_dot(cupy.asarray(a), cupy.asarray(b)), scan.row_dot(a, b), dtype)
    c = rng.normal(size=(6, 1)).astype(dtype)
    _close(gma.softmax_jacobian(*map(cupy.asarray, (a, b, c))), gma.softmax_jacobian(a, b, c), dtype)
    _close(gma.dx_terms(*map(cupy.asarray, (a, b, a))), gma.dx_terms(a, b, a), dtype)


# ---------------------------------------------------------------------------
# Public functions against refimpl
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_responsibilities_match_refimpl(dtype):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, 6)).astype(dtype)
    means = rng.normal(size=(70, 6)).astype(dtype)
    variances = rng.uniform(0.3, 2, size=(70, 6)).astype(dtype)
    weights = rng.dirichlet(np.ones(70)).astype(dtype)
    ours = ck.responsibilities(x, means, variances, weights)
    assert isinstance(ours, np.ndarray)
    _close(ours, ref_gmm.responsibilities(x, means, variances, weights), dtype)
    dev = ck.log_responsibilities(cupy.asarray(x), means, variances, weights)
    assert isinstance(dev, cupy.ndarray)
    _close(dev, ref_gmm.log_responsibilities(x, means, variances, weights), dtype)


def test_responsibilities_far_apart_means():
    rng = np.random.default_rng(12)
    means = np.array([[1e7, 0.0], [1e7 + 0.01, 0.0], [-1e7, 3.0]])
    variances = np.full((3, 2), 1e-4)
    weights = np.array([0.3, 0.3, 0.4])
    x = means[[0, 1, 0, 2] * 10] + rng.normal(scale=0.005, size=(40, 2))
    _close(ck.responsibilities(x, means, variances, weights), ref_gmm.responsibilities(x, means, variances, weights), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("leading, per_head", [((), False), ((2, 3), False), ((2, 3), True)])
def test_gma_matches_refimpl(leading, per_head, causal, dtype):
    rng = np.random.default_rng(13)
    x_q, x_k, v, means, raw, logits = _gma_inputs(rng, leading, per_head, dtype=dtype)
    kw = dict(causal=causal, chunk_size=32)
    dev = [cupy.asarray(a) for a in (x_q, x_k, v, means, raw, logits)]
    out, cache = ck.gma_forward(*dev, **kw)
    assert isinstance(out, cupy.ndarray)
    ref_out, ref_cache = ref_gma.gma_forward(x_q, x_k, v, means, raw, logits, **kw)
    _close(out, ref_out, dtype)
    g = rng.normal(size=ref_out.shape).astype(dtype)
    grads = ck.gma_backward(cupy.asarray(g), cache)
    for name, ours, ref in zip(grads._fields, grads, ref_gma.gma_backward(g, ref_cache)):
        assert isinstance(ours, cupy.ndarray), name
        np.testing.assert_allclose(cupy.asnumpy(ours), ref, rtol=RTOL[dtype], atol=10 * RTOL[dtype], err_msg=name)
    # NumPy in, NumPy out; the same numbers
    out_np, cache_np = ck.gma_forward(x_q, x_k, v, means, raw, logits, **kw)
    assert isinstance(out_np, np.ndarray)
    assert isinstance(ck.gma_backward(g, cache_np).means, np.ndarray)
    variances = np.exp(raw)
    weights = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    _close(ck.gma(x_q, x_k, v, means, variances, weights, **kw), ref_gma.gma(x_q, x_k, v, means, variances, weights, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_matches_refimpl(causal, dtype):
    rng = np.random.default_rng(14)
    q, k = rng.normal(size=(2, 3, 45, 8)).astype(dtype), rng.normal(size=(2, 3, 45, 8)).astype(dtype)
    v = rng.normal(size=(2, 3, 45, 5)).astype(dtype)
    ours = ck.softmax_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal)
    assert isinstance(ours, cupy.ndarray)
    _close(ours, ref_attention.softmax_attention(q, k, v, causal=causal), dtype)
    _close(ck.softmax_attention(q[0, 0], k[0, 0], v[0, 0], causal=causal), ref_attention.softmax_attention(q[0, 0], k[0, 0], v[0, 0], causal=causal), dtype)


def _same_error(f, g, exc=ValueError):
    with pytest.raises(exc) as ours:
        f()
    with pytest.raises(exc) as theirs:
        g()
    assert str(ours.value) == str(theirs.value)


def test_errors_on_device_arrays_match_refimpl():
    rng = np.random.default_rng(15)
    x = rng.normal(size=(5, 2))
    means, variances, weights = rng.normal(size=(3, 2)), np.ones((3, 2)), np.full(3, 1 / 3)
    bad = x.copy()
    bad[3, 1] = np.nan
    _same_error(lambda: ck.responsibilities(cupy.asarray(bad), means, variances, weights), lambda: ref_gmm.responsibilities(bad, means, variances, weights))
    _same_error(lambda: ck.responsibilities(cupy.asarray(x[:, :1]), means, variances, weights), lambda: ref_gmm.responsibilities(x[:, :1], means, variances, weights))
    q = cupy.asarray(x * 1e200)
    with np.errstate(over="ignore", invalid="ignore"):
        _same_error(lambda: ck.softmax_attention(q, q, q), lambda: ref_attention.softmax_attention(x * 1e200, x * 1e200, x * 1e200))
    _same_error(lambda: ck.gma(cupy.asarray(x), cupy.asarray(x[:4]), cupy.asarray(x[:4]), means, variances, weights, causal=True),
                lambda: ref_gma.gma(x, x[:4], x[:4], means, variances, weights, causal=True))


def test_deterministic():
    rng = np.random.default_rng(16)
    args = [cupy.asarray(a) for a in _gma_inputs(rng, (2, 3), True, N=200)]
    out1, c1 = ck.gma_forward(*args, causal=True)
    out2, c2 = ck.gma_forward(*args, causal=True)
    assert bool((out1 == out2).all())
    g = cupy.asarray(rng.normal(size=out1.shape))
    for a, b in zip(ck.gma_backward(g, c1), ck.gma_backward(g, c2)):
        assert bool((a == b).all())


def test_agrees_with_numba_backend():
    nc = pytest.importorskip("gpu.numba_cuda")
    rng = np.random.default_rng(17)
    x = rng.normal(size=(50, 3))
    means, variances, weights = rng.normal(size=(4, 3)), rng.uniform(0.5, 2, size=(4, 3)), np.full(4, 0.25)
    checked = 0
    for name in ("responsibilities", "log_responsibilities"):
        mod = importlib.import_module("gpu.numba_cuda.gmm")
        np.testing.assert_allclose(getattr(ck, name)(x, means, variances, weights), getattr(mod, name)(x, means, variances, weights), rtol=1e-10, atol=1e-10)
        checked += 1
    try:
        numba_gma = importlib.import_module("gpu.numba_cuda.gma")
    except ImportError:
        numba_gma = None
    if numba_gma is not None and hasattr(numba_gma, "gma"):
        xs = [rng.normal(size=(2, 30, 3)), rng.normal(size=(2, 30, 3)), rng.normal(size=(2, 30, 2))]
        for causal in (False, True):
            np.testing.assert_allclose(ck.gma(*xs, means, variances, weights, causal=causal), numba_gma.gma(*xs, means, variances, weights, causal=causal), rtol=1e-10, atol=1e-10)
        checked += 1
    try:
        numba_attention = importlib.import_module("gpu.numba_cuda.attention")
    except ImportError:
        numba_attention = None
    if numba_attention is not None and hasattr(numba_attention, "softmax_attention"):
        np.testing.assert_allclose(ck.softmax_attention(x, x, x), numba_attention.softmax_attention(x, x, x), rtol=1e-10, atol=1e-10)
        checked += 1
    assert checked >= 2, nc
