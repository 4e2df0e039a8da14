"""refimpl.gma with leading batch and head dimensions: each sequence as its own 2-D call, bit for bit.

Batched inputs ``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``, ``v (..., N_k, d_v)``
with a shared GMM (``(K, d_r)``, ``(K,)``) or one per head (``(H, K, d_r)``,
``(H, K)``, ``H`` the last leading dimension).  The oracle is the loop of 2-D
calls; the gradients are also checked by central differences.
"""

import numpy as np
import pytest

from refimpl import gma, gmm
from refimpl.testing import assert_close_f32, assert_grads_close, fd_gradients


def problem(seed, leading, per_head, n_q=6, n_k=6, K=3, d_r=2, d_v=3, dtype=np.float64):
    """Unconstrained inputs of gma_forward: tokens with ``leading`` dimensions, a shared or per-head GMM."""
    rng = np.random.default_rng(seed)
    heads = leading[-1:] if per_head else ()
    shapes = [leading + (n_q, d_r), leading + (n_k, d_r), leading + (n_k, d_v), heads + (K, d_r), heads + (K, d_r), heads + (K,)]
    return [rng.normal(size=s).astype(dtype) for s in shapes]


def gmm_of(idx, params, per_head):
    """The GMM parameters of sequence ``idx``."""
    return [p[idx[-1]] for p in params] if per_head else list(params)


def constrained(args):
    x_q, x_k, v, means, raw, logits = args
    return [x_q, x_k, v, means, gmm.variances_from_raw(raw), gmm.softmax(logits, axis=-1)]


LAYOUTS = [((2,), False), ((3,), True), ((2, 3), False), ((2, 3), True), ((1,), False)]


@pytest.mark.parametrize("leading,per_head", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_batched_forward_and_backward_are_the_loop_of_2d_calls(leading, per_head, causal):
    args = problem(1, leading, per_head)
    x_q, x_k, v, *params = args
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=4)
    assert isinstance(cache, gma.GMABatchCache) and cache.leading == leading and cache.per_head == per_head
    assert out.shape == leading + (6, 3)
    g = np.random.default_rng(2).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    d_params = [np.zeros_like(p) for p in params]
    for idx in np.ndindex(leading):
        gp = gmm_of(idx, params, per_head)
        o, c = gma.gma_forward(x_q[idx], x_k[idx], v[idx], *gp, causal=causal, chunk_size=4)
        np.testing.assert_array_equal(out[idx], o)
        gr = gma.gma_backward(g[idx], c)
        for name in ("x_q", "x_k", "v"):
            np.testing.assert_array_equal(getattr(grads, name)[idx], getattr(gr, name), err_msg=name)
        h = idx[-1:] if per_head else ()
        for d, p in zip(d_params, (gr.means, gr.raw_variances, gr.logits)):
            d[h] += p
    for name, d in zip(("means", "raw_variances", "logits"), d_params):
        assert getattr(grads, name).shape == d.shape
        np.testing.assert_array_equal(getattr(grads, name), d, err_msg=name)


@pytest.mark.parametrize("leading,per_head", LAYOUTS)
def test_batched_gma_is_the_loop_of_2d_calls(leading, per_head):
    x_q, x_k, v, means, variances, weights = constrained(problem(3, leading, per_head, n_q=5, n_k=7))
    out = gma.gma(x_q, x_k, v, means, variances, weights)
    for idx in np.ndindex(leading):
        gp = gmm_of(idx, (means, variances, weights), per_head)
        np.testing.assert_array_equal(out[idx], gma.gma(x_q[idx], x_k[idx], v[idx], *gp))


def test_per_head_gmm_differs_from_sharing_head_0():
    """Guards the head index: head h reads GMM h, not GMM 0."""
    x_q, x_k, v, means, variances, weights = constrained(problem(4, (2, 3), True))
    out = gma.gma(x_q, x_k, v, means, variances, weights)
    shared = gma.gma(x_q, x_k, v, means[0], variances[0], weights[0])
    np.testing.assert_array_equal(out[:, 0], shared[:, 0])
    assert not np.allclose(out[:, 1:], shared[:, 1:])


@pytest.mark.parametrize("leading,per_head", [((2,), False), ((2, 2), True)])
@pytest.mark.parametrize("causal", [False, True])
def test_batched_gradients_against_finite_differences(leading, per_head, causal):
    args = problem(5, leading, per_head, n_q=4, n_k=4, K=2)
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=3)
    g = np.random.default_rng(6).normal(size=out.shape)
    numerical = fd_gradients(lambda *a: gma.gma_forward(*a, causal=causal, chunk_size=3)[0], args, g)
    assert_grads_close(gma.gma_backward(g, cache), numerical, names=gma.GMAGrads._fields)


def test_batched_float32():
    args = problem(7, (2, 3), True)
    out64, cache64 = gma.gma_forward(*args, causal=True, chunk_size=4)
    out32, cache32 = gma.gma_forward(*[a.astype(np.float32) for a in args], causal=True, chunk_size=4)
    assert_close_f32(out32, out64)
    g = np.random.default_rng(8).normal(size=out64.shape)
    for a, b in zip(gma.gma_backward(g.astype(np.float32), cache32), gma.gma_backward(g, cache64)):
        assert_close_f32(a, b)


def test_computed_quantities_are_checked_with_rows_counted_over_the_batch():
    """eps = 0 with a query of sequence 1, row 2, that meets no key: refused as query row N_q + 2."""
    means = np.array([[-50.0, 0.0], [50.0, 0.0]])
    variances = np.ones((2, 2))
    weights = np.array([0.5, 0.5])
    x_k = np.tile(means[0], (2, 4, 1))
    x_q = x_k.copy()
    x_q[1, 2] = means[1]
    v = np.ones((2, 4, 1))
    with pytest.raises(ValueError, match=r"the denominator of query row 6 is 0\.0"):
        gma.gma(x_q, x_k, v, means, variances, weights, eps=0.0)
    out = gma.gma(x_q[:1], x_k[:1], v[:1], means, variances, weights, eps=0.0)
    np.testing.assert_allclose(out, 1.0, rtol=1e-15)
    # an overflowing distance in sequence 1, row 3 (its row of responsibilities is NaN before the check refuses it)
    x_far = x_k.copy()
    x_far[1, 3] = 1e200
    with pytest.raises(ValueError, match=r"x_k: the scaled squared distance .* 1 row\(s\) \(first: row 7\)"), np.errstate(invalid="ignore"):
        gma.gma(x_q, x_far, v, means, variances, weights)


def test_backward_refuses_a_grad_out_of_the_2d_shape_for_a_batched_cache():
    out, cache = gma.gma_forward(*problem(9, (2,), False))
    with pytest.raises(ValueError, match=r"grad_out: expected a 3-D array"):
        gma.gma_backward(np.ones(out.shape[1:]), cache)
    with pytest.raises(TypeError, match="cache: expected the GMACache or GMABatchCache from gma_forward"):
        gma.gma_backward(np.ones(out.shape), cache.caches)
