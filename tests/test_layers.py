"""app.layers: the multi-head GMA layer against a per-head composition, finite differences and causality."""

import numpy as np
import pytest

from refimpl import gma, gmm
from app import layers
from refimpl.gradcheck import numerical_gradient
from refimpl.testing import TOL, assert_close_f32

FIELDS = ("x", "W_q", "W_k", "W_v", "W_o", "means", "raw_variances", "logits")


def setup(seed=0, B=2, N=5, d_model=4, H=2, d_r=2, d_v=3, K=3, dtype=np.float64):
    rng = np.random.default_rng(seed)
    params = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=seed + 1)
    # move away from the symmetric start (equal variances, uniform weights)
    params = layers.MultiheadGMAParams(*(p + 0.3 * rng.normal(size=p.shape) for p in params))
    x = rng.normal(size=(B, N, d_model))
    return x.astype(dtype), layers.MultiheadGMAParams(*(p.astype(dtype) for p in params))


def per_head_reference(x, p, causal, chunk_size=64, min_variance=1e-6):
    """Slice the projections head by head and call the public gma() on each."""
    H, K, d_r = p.means.shape
    d_v = p.W_v.shape[1] // H
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        heads = []
        for h in range(H):
            xq = x[b] @ p.W_q[:, h * d_r : (h + 1) * d_r]
            xk = x[b] @ p.W_k[:, h * d_r : (h + 1) * d_r]
            v = x[b] @ p.W_v[:, h * d_v : (h + 1) * d_v]
            variances = gmm.variances_from_raw(p.raw_variances[h], min_variance)
            heads.append(gma.gma(xq, xk, v, p.means[h], variances, gmm.softmax(p.logits[h]), causal=causal, chunk_size=chunk_size))
        out[b] = np.concatenate(heads, axis=1) @ p.W_o
    return out


def test_init_shapes_dtype_and_starting_gmm():
    p = layers.init_multihead_gma(8, 3, 4, 5, 6, seed=1, init_variance=2.0, min_variance=1e-3, dtype=np.float32)
    shapes = dict(W_q=(8, 12), W_k=(8, 12), W_v=(8, 15), W_o=(15, 8), means=(3, 6, 4), raw_variances=(3, 6, 4), logits=(3, 6))
    for name, shape in shapes.items():
        assert getattr(p, name).shape == shape and getattr(p, name).dtype == np.float32, name
    np.testing.assert_allclose(gmm.variances_from_raw(p.raw_variances.astype(np.float64), 1e-3), 2.0, rtol=1e-6)
    np.testing.assert_array_equal(p.logits, 0.0)
    # the same seed gives the same parameters
    q = layers.init_multihead_gma(8, 3, 4, 5, 6, seed=1, init_variance=2.0, min_variance=1e-3, dtype=np.float32)
    for a, b in zip(p, q):
        np.testing.assert_array_equal(a, b)


def _assert_standard_normal(a, std, name):
    """Entries i.i.d. N(0, std^2): sample mean and variance within 5 standard errors.

    For n normal draws the sample mean has standard error std / sqrt(n), the
    sample variance std^2 sqrt(2 / n) and the sample kurtosis (3 for a normal law,
    1.8 for a uniform one) about sqrt(24 / n); an entry beyond 6 std has probability 2e-9.
    """
    a = np.asarray(a, dtype=np.float64).ravel()
    n = a.size
    assert abs(a.mean()) <= 5 * std / np.sqrt(n), name
    assert abs(a.var() / std**2 - 1) <= 5 * np.sqrt(2 / n), name
    assert abs(np.mean((a - a.mean()) ** 4) / a.var() ** 2 - 3) <= 5 * np.sqrt(24 / n), name
    assert np.max(np.abs(a)) <= 6 * std, name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_init_scales_every_projection_by_its_fan_in(dtype):
    """W_q, W_k, W_v: variance 1 / d_model; W_o: variance 1 / (H d_v); means standard normal."""
    d_model, H, d_r, d_v, K = 96, 4, 16, 8, 48  # fan-ins 96 and 32 differ, so a swapped one is visible
    p = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=3, init_variance=0.7, min_variance=1e-2, dtype=dtype)
    for name in ("W_q", "W_k", "W_v"):
        _assert_standard_normal(getattr(p, name), 1 / np.sqrt(d_model), name)
    _assert_standard_normal(p.W_o, 1 / np.sqrt(H * d_v), "W_o")
    _assert_standard_normal(p.means, 1.0, "means")
    # independent draws: W_q and W_k are uncorrelated (sample correlation within 5 standard errors)
    corr = np.corrcoef(p.W_q.ravel().astype(np.float64), p.W_k.ravel().astype(np.float64))[0, 1]
    assert abs(corr) <= 5 / np.sqrt(p.W_q.size)
    # every variance starts at init_variance through the layer's reparameterisation, weights uniform
    tol = dict(rtol=1e-6) if dtype == np.float32 else dict(rtol=1e-14)  # raw rounded to the dtype
    np.testing.assert_allclose(gmm.variances_from_raw(p.raw_variances.astype(np.float64), 1e-2), 0.7, **tol)
    np.testing.assert_array_equal(p.logits, 0.0)
    np.testing.assert_allclose(gmm.softmax(p.logits.astype(np.float64), axis=1), 1 / K, rtol=1e-15)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [dict(), dict(B=1, N=1, H=1, K=1), dict(B=3, N=13, H=3, K=4, d_model=6)])
def test_forward_matches_per_head_composition(causal, shape):
    x, p = setup(1, **shape)
    out = layers.multihead_gma(x, p, causal=causal, chunk_size=4)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, per_head_reference(x, p, causal, chunk_size=4), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_finite_differences(causal):
    x, p = setup(2)  # N = 5 with chunk 2: not a multiple
    out, cache = layers.multihead_gma_forward(x, p, causal=causal, chunk_size=2)
    g = np.random.default_rng(3).normal(size=out.shape)
    grads = layers.multihead_gma_backward(g, cache)
    assert grads._fields == FIELDS
    args = [x, *p]

    def loss(a):
        return np.sum(g * layers.multihead_gma(a[0], layers.MultiheadGMAParams(*a[1:]), causal=causal, chunk_size=2))

    for i, (name, arr) in enumerate(zip(FIELDS, args)):
        fd = numerical_gradient(lambda a: loss([*args[:i], a, *args[i + 1 :]]), arr)
        assert grads[i].shape == arr.shape, name
        np.testing.assert_allclose(grads[i], fd, rtol=1e-6, atol=1e-8 * max(1.0, np.max(np.abs(fd))), err_msg=name)


def test_backward_with_one_token_one_head_one_component():
    x, p = setup(4, B=1, N=1, H=1, K=1)
    out, cache = layers.multihead_gma_forward(x, p, causal=True)
    g = np.random.default_rng(5).normal(size=out.shape)
    grads = layers.multihead_gma_backward(g, cache)
    # K = 1: every responsibility is 1, so the GMM gets no gradient and out = (x W_v) W_o (1 / (1 + eps))
    for name in ("means", "raw_variances", "logits", "W_q", "W_k"):
        np.testing.assert_array_equal(getattr(grads, name), 0.0)
    np.testing.assert_allclose(out[0], (x[0] @ p.W_v @ p.W_o) / (1 + 1e-6), rtol=1e-13)
    np.testing.assert_allclose(grads.W_o, (x[0] @ p.W_v).T @ g[0] / (1 + 1e-6), rtol=1e-12)


def test_causal_layer_sees_only_the_past():
    x, p = setup(6, B=2, N=11)
    out = layers.multihead_gma(x, p, causal=True, chunk_size=4)
    later = x.copy()
    later[:, 6:] = np.random.default_rng(7).normal(size=later[:, 6:].shape)
    out2 = layers.multihead_gma(later, p, causal=True, chunk_size=4)
    np.testing.assert_array_equal(out[:, :6], out2[:, :6])
    # and the gradient of an early output with respect to later tokens is zero
    g = np.zeros_like(out)
    g[:, 5] = 1.0
    grads = layers.multihead_gma_backward(g, layers.multihead_gma_forward(x, p, causal=True, chunk_size=4)[1])
    np.testing.assert_array_equal(grads.x[:, 6:], 0.0)
    assert np.all(np.abs(grads.x[:, :6]).sum(axis=2) > 0)


def test_sequences_of_a_batch_are_independent_and_gmm_gradients_add():
    x, p = setup(8, B=3, N=6)
    out, cache = layers.multihead_gma_forward(x, p)
    g = np.random.default_rng(9).normal(size=out.shape)
    grads = layers.multihead_gma_backward(g, cache)
    total = {f: 0.0 for f in FIELDS[1:]}
    for b in range(3):
        out_b, cache_b = layers.multihead_gma_forward(x[b : b + 1], p)
        np.testing.assert_allclose(out_b[0], out[b], rtol=1e-13, atol=1e-15)
        gb = layers.multihead_gma_backward(g[b : b + 1], cache_b)
        np.testing.assert_allclose(gb.x[0], grads.x[b], rtol=1e-12, atol=1e-14)
        for f in FIELDS[1:]:
            total[f] = total[f] + getattr(gb, f)
    for f in FIELDS[1:]:
        np.testing.assert_allclose(getattr(grads, f), total[f], rtol=1e-11, atol=1e-13, err_msg=f)


@pytest.mark.parametrize("causal", [False, True])
def test_float32(causal):
    x64, p64 = setup(10, B=2, N=20, d_model=6, H=2, d_r=3, d_v=3, K=4)
    x32, p32 = x64.astype(np.float32), layers.MultiheadGMAParams(*(a.astype(np.float32) for a in p64))
    out32, c32 = layers.multihead_gma_forward(x32, p32, causal=causal, chunk_size=8)
    out64, c64 = layers.multihead_gma_forward(x64, p64, causal=causal, chunk_size=8)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, **TOL[np.float32])
    g = np.random.default_rng(11).normal(size=out64.shape)
    for name, a, b in zip(FIELDS, layers.multihead_gma_backward(g.astype(np.float32), c32), layers.multihead_gma_backward(g, c64)):
        assert_close_f32(a, b, err_msg=name)


def test_params_as_a_mapping_and_inputs_not_mutated():
    x, p = setup(12)
    copies = [x.copy(), *(a.copy() for a in p)]
    out = layers.multihead_gma(x, p._asdict())
    np.testing.assert_array_equal(out, layers.multihead_gma(x, p))
    out, cache = layers.multihead_gma_forward(x, p, causal=True)
    layers.multihead_gma_backward(np.ones_like(out), cache)
    for a, c in zip([x, *p], copies):
        np.testing.assert_array_equal(a, c)


def test_bad_input_gets_clear_errors():
    x, p = setup(13)
    with pytest.raises(ValueError, match="x: expected a 3-D array"):
        layers.multihead_gma(x[0], p)
    with pytest.raises(ValueError, match=r"params.W_q: expected shape \(d_model, H \* d_r\)"):
        layers.multihead_gma(x, p._replace(W_q=p.W_q[:, :-1]))
    with pytest.raises(ValueError, match=r"params.W_o: expected shape \(H \* d_v, d_model\)"):
        layers.multihead_gma(x, p._replace(W_o=p.W_o[:-1]))
    with pytest.raises(ValueError, match=r"params.logits: expected shape \(H, K\)"):
        layers.multihead_gma(x, p._replace(logits=p.logits[:, :-1]))
    with pytest.raises(ValueError, match="params: missing entries"):
        layers.multihead_gma(x, {"W_q": p.W_q})
    with pytest.raises(TypeError, match="params: expected a MultiheadGMAParams"):
        layers.multihead_gma(x, list(p))
    with pytest.raises(ValueError, match="chunk_size: expected an integer >= 1"):
        layers.multihead_gma(x, p, chunk_size=0)
    with pytest.raises(ValueError, match="init_variance: expected a value > min_variance"):
        layers.init_multihead_gma(4, 1, 2, 2, 3, init_variance=1e-7)
    with pytest.raises(ValueError, match="n_heads: expected an integer >= 1"):
        layers.init_multihead_gma(4, 0, 2, 2, 3)
    out, cache = layers.multihead_gma_forward(x, p)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(B, N, d_model\)"):
        layers.multihead_gma_backward(out[:, :-1], cache)
