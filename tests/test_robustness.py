"""Extreme but legal inputs: outputs stay finite, responsibilities normalised, GMA outputs in the hull of the values.

"Extreme" is the range the project promises: coordinates up to 1e6 in magnitude,
variances at the floor ``min_variance``, K up to 4096 components (with few
tokens), one token, one step.  float32 runs are compared with float64 runs
*on the same float32-rounded inputs*, so the comparison measures the float32
arithmetic of the algorithm, not the rounding of the inputs; they are made
only where the problem is well conditioned (a common scale ``s`` on
coordinates, ``s^2`` on variances, which leaves the posterior unchanged).

The last section holds one regression test per overflow that used to turn
into NaN silently; each is named after what it guards.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import attention, gma, gmm, gmr, ovq
from app import layers
from refimpl.testing import assert_close_f32

EPS64 = np.finfo(np.float64).eps
def assert_euler(dv, v, g, out, rtol):
    """out is linear in v, so <dL/dv, v> = <g, out> exactly: a check of the gradient's values, not only finiteness."""
    lhs, rhs = float(np.sum(dv.astype(np.float64) * v)), float(np.sum(g.astype(np.float64) * out))
    scale = float(np.sum(np.abs(dv.astype(np.float64) * v))) + float(np.sum(np.abs(g.astype(np.float64) * out)))
    assert abs(lhs - rhs) <= rtol * scale, (lhs, rhs, scale)


def assert_in_hull(out, v, n_terms, with_origin=False):
    """Every coordinate of every output row between the min and max of that coordinate of v.

    Each output is a ratio of two sums of ``n_terms`` nonnegative products, so its
    rounding error is at most about ``2 n_terms eps max|v|``; ``with_origin`` widens
    the box to include 0 (``eps > 0`` shrinks every output towards the origin).
    """
    tol = 4 * n_terms * np.finfo(out.dtype).eps * float(np.max(np.abs(v)))
    lo, hi = v.min(axis=0), v.max(axis=0)
    if with_origin:
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    assert np.all(out >= lo - tol) and np.all(out <= hi + tol), (out.min(axis=0), lo, out.max(axis=0), hi, tol)


# ---------------------------------------------------------------------------
# GMA: both variants, forward and backward
# ---------------------------------------------------------------------------

# (id, N, K, d_r, d_v, scale of the coordinates, variances at the floor)
GMA_EXTREMES = [
    ("N=1", 1, 3, 2, 2, 1.0, False),
    ("N=1, K=1, |x|=1e6", 1, 1, 1, 1, 1e6, True),
    ("N=1, K=4096", 1, 4096, 2, 2, 1.0, True),
    ("K=4096, N=3, |x|=1e6", 3, 4096, 2, 3, 1e6, True),
    ("|x|=1e6, variances at the floor", 9, 5, 3, 2, 1e6, True),
    ("|x|=1e6 over several chunks", 70, 8, 2, 3, 1e6, True),
]
MIN_VARIANCE = 1e-6


def gma_problem(N, K, d_r, d_v, scale, at_floor, seed=0):
    """Tokens near some means (within 1e-3), some far from all; values of the same scale."""
    rng = np.random.default_rng(seed)
    means = scale * rng.normal(size=(K, d_r))
    near = means[rng.integers(0, K, size=N)] + 1e-3 * rng.normal(size=(N, d_r))
    far = scale * rng.normal(size=(N, d_r))
    x = np.where(rng.random((N, 1)) < 0.5, near, far)
    v = scale * rng.normal(size=(N, d_v))
    raw = np.full((K, d_r), -60.0) if at_floor else rng.normal(size=(K, d_r))  # softplus(-60) ~ 1e-26: the floor
    logits = rng.normal(size=K)
    return x, v, means, raw, logits


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GMA_EXTREMES, ids=[c[0] for c in GMA_EXTREMES])
def test_gma_stays_finite_normalised_and_in_the_hull(case, causal):
    _, N, K, d_r, d_v, scale, at_floor = case
    x, v, means, raw, logits = gma_problem(N, K, d_r, d_v, scale, at_floor)
    out, cache = gma.gma_forward(x, x, v, means, raw, logits, causal=causal, chunk_size=16, min_variance=MIN_VARIANCE)
    assert np.all(np.isfinite(out))
    for gamma in (cache.gamma_q, cache.gamma_k):
        assert np.all(gamma >= 0)
        np.testing.assert_allclose(gamma.sum(axis=1), 1.0, rtol=0, atol=4 * K * EPS64)
    if at_floor:
        assert np.all(cache.variances >= MIN_VARIANCE) and np.all(cache.variances < MIN_VARIANCE * (1 + 1e-9))
    assert_in_hull(out, v, N + K, with_origin=True)
    # with eps = 0 and queries that are the keys, every denominator holds gamma_i . gamma_i > 0
    variances = cache.variances
    weights = gmm.weights_from_logits(logits)
    exact = gma.gma(x, x, v, means, variances, weights, causal=causal, chunk_size=16, eps=0.0)
    assert np.all(np.isfinite(exact))
    assert_in_hull(exact, v, N + K)
    g = np.random.default_rng(1).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    assert all(np.all(np.isfinite(a)) for a in grads)
    # the values: out is linear in v; the prior is a softmax (shift-invariant logits); a common shift of
    # tokens and means changes nothing, so the gradients of x_q, x_k and the means cancel
    assert_euler(grads.v, v, g, out, rtol=1e-12)
    # sum_m c_m = sum_m gamma_m (g_m - gbar) = 0 up to the rounding of the terms gamma_m g_m
    dgamma = attention.feature_attention_backward(g, cache.mixing)
    terms = np.sum(cache.gamma_q * np.abs(dgamma.phi_q)) + np.sum(cache.gamma_k * np.abs(dgamma.phi_k))
    assert abs(grads.logits.sum()) <= 4 * K * EPS64 * terms + 1e-300
    shift = grads.x_q.sum(axis=0) + grads.x_k.sum(axis=0) + grads.means.sum(axis=0)
    size = np.abs(grads.x_q).sum(axis=0) + np.abs(grads.x_k).sum(axis=0) + np.abs(grads.means).sum(axis=0)
    assert np.all(np.abs(shift) <= 1e-9 * size + 1e-300)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GMA_EXTREMES, ids=[c[0] for c in GMA_EXTREMES])
def test_gma_float32_stays_float32_finite_and_normalised(case, causal):
    """Even where float32 cannot match float64 (|x| = 1e6 against variances of 1e-6), nothing overflows."""
    _, N, K, d_r, d_v, scale, at_floor = case
    args = [a.astype(np.float32) for a in gma_problem(N, K, d_r, d_v, scale, at_floor)]
    x, v, means, raw, logits = args
    out, cache = gma.gma_forward(x, x, v, means, raw, logits, causal=causal, chunk_size=16, min_variance=MIN_VARIANCE)
    assert out.dtype == np.float32 and cache.gamma_q.dtype == np.float32
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(cache.gamma_q.sum(axis=1), 1.0, rtol=0, atol=4 * K * np.finfo(np.float32).eps)
    assert_in_hull(out, v, N + K, with_origin=True)
    grads = gma.gma_backward(np.ones_like(out), cache)
    assert all(g.dtype == np.float32 and np.all(np.isfinite(g)) for g in grads)
    assert_euler(grads.v, v, np.ones_like(out), out, rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1e3, 1e6])
@pytest.mark.parametrize("N, K", [(1, 4096), (1, 1), (40, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_gma_float32_meets_its_tolerance_when_well_conditioned(scale, N, K, causal):
    """Coordinates scaled by s and variances by s^2: the same posterior at every s, float32 within 1e-4."""
    rng = np.random.default_rng(2)
    d_r, d_v = 2, 3
    means = scale * rng.normal(size=(K, d_r))
    variances = scale**2 * rng.uniform(0.5, 2.0, size=(K, d_r))
    weights = rng.dirichlet(np.ones(K))
    x_q, x_k = scale * rng.normal(size=(N, d_r)), scale * rng.normal(size=(N, d_r))
    v = scale * rng.normal(size=(N, d_v))
    args32 = [a.astype(np.float32) for a in (x_q, x_k, v, means, variances, weights / weights.sum())]
    args64 = [a.astype(np.float64) for a in args32]
    args64[5] = args64[5] / args64[5].sum()
    out32 = gma.gma(*args32, causal=causal, chunk_size=16)
    out64 = gma.gma(*args64, causal=causal, chunk_size=16)
    assert_close_f32(out32, out64)


def test_a_large_common_offset_is_removed_exactly_by_the_centring():
    """Tokens and means all near 1e6 (spacing 0.06 in float32) with unit variances: float32 still agrees."""
    rng = np.random.default_rng(3)
    offset = np.float32(1e6)
    means = (offset + 4 * rng.normal(size=(5, 2))).astype(np.float32)
    x = (offset + 4 * rng.normal(size=(12, 2))).astype(np.float32)
    variances = rng.uniform(0.5, 2.0, size=(5, 2)).astype(np.float32)
    weights = np.full(5, 0.2, dtype=np.float32)
    resp32 = gmm.responsibilities(x, means, variances, weights)
    resp64 = gmm.responsibilities(*(a.astype(np.float64) for a in (x, means, variances, weights)))
    assert_close_f32(resp32, resp64)


# ---------------------------------------------------------------------------
# Multi-head layer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1, 3, 1, 1), (2, 7, 4, 2, 4096), (1, 9, 4, 2, 3)], ids=["B=N=H=K=1", "K=4096", "small"])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_layer_at_extremes(shape, causal):
    """Inputs of magnitude 1e6 and every variance at the floor: outputs and gradients finite, float32 stays float32."""
    B, N, d_model, H, K = shape
    params = layers.init_multihead_gma(d_model, H, 2, 2, K, seed=4)
    params = params._replace(raw_variances=np.full_like(params.raw_variances, -60.0))
    x = 1e6 * np.random.default_rng(5).normal(size=(B, N, d_model))
    for dtype in (np.float64, np.float32):
        p = layers.MultiheadGMAParams(*(a.astype(dtype) for a in params))
        out, cache = layers.multihead_gma_forward(x.astype(dtype), p, causal=causal, chunk_size=4)
        assert out.dtype == dtype and np.all(np.isfinite(out))
        for row in cache.gma:
            for c in row:
                np.testing.assert_allclose(c.gamma_q.sum(axis=1), 1.0, rtol=0, atol=4 * K * np.finfo(dtype).eps)
        grads = layers.multihead_gma_backward(np.ones_like(out), cache)
        assert all(g.dtype == dtype and np.all(np.isfinite(g)) for g in grads)
        # out = heads @ W_o is linear in W_o: <dW_o, W_o> = <g, out>
        assert_euler(grads.W_o, p.W_o, np.ones_like(out), out, rtol=1e-12 if dtype == np.float64 else 1e-5)


def test_multihead_layer_float32_meets_its_tolerance_at_scale():
    """A layer whose routing is scale-free (variances s^2 for inputs of scale s): float32 within 1e-4 of float64."""
    s = 1e3
    params = layers.init_multihead_gma(4, 2, 2, 3, 5, seed=6, init_variance=s**2)
    params = params._replace(means=s * params.means)
    x = s * np.random.default_rng(7).normal(size=(2, 11, 4))
    p32 = layers.MultiheadGMAParams(*(a.astype(np.float32) for a in params))
    p64 = layers.MultiheadGMAParams(*(a.astype(np.float64) for a in p32))
    x32 = x.astype(np.float32)
    for causal in (False, True):
        out32 = layers.multihead_gma(x32, p32, causal=causal, chunk_size=4)
        out64 = layers.multihead_gma(x32.astype(np.float64), p64, causal=causal, chunk_size=4)
        assert_close_f32(out32, out64)


# ---------------------------------------------------------------------------
# Softmax and linear attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 13])
@pytest.mark.parametrize("scale", [1.0, 1e6])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_and_linear_attention_at_extremes(N, scale, causal, dtype):
    rng = np.random.default_rng(8)
    q, k, v = ((scale * rng.normal(size=(N, n))).astype(dtype) for n in (3, 3, 2))
    out, cache = attention.softmax_attention_forward(q, k, v, causal=causal)
    assert out.dtype == dtype and np.all(np.isfinite(out))
    np.testing.assert_allclose(cache.p.sum(axis=1), 1.0, rtol=0, atol=4 * N * np.finfo(dtype).eps)
    assert_in_hull(out, v, N)
    grads = attention.softmax_attention_backward(np.ones_like(out), cache)
    assert all(np.all(np.isfinite(g)) for g in grads)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    assert_euler(grads.v, v, np.ones_like(out), out, rtol)
    # a common shift of the keys adds the same q . c to a whole row of scores: sum_j dk_j = 0
    assert np.all(np.abs(grads.k.sum(axis=0)) <= 8 * N * np.finfo(dtype).eps * np.abs(grads.k).sum(axis=0) + 1e-300)
    out, cache = attention.linear_attention_forward(q, k, v, causal=causal, chunk_size=4)
    assert out.dtype == dtype and np.all(np.isfinite(out))
    # elu + 1 features are >= 0, so outputs are shrunk convex combinations: in the hull of v and 0
    assert_in_hull(out, v, N + 3, with_origin=True)
    grads = attention.linear_attention_backward(np.ones_like(out), cache)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert_euler(grads.v, v, np.ones_like(out), out, rtol)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_and_linear_attention_float32_meet_their_tolerance(causal):
    rng = np.random.default_rng(9)
    q32, k32, v32 = (rng.normal(size=(37, n)).astype(np.float32) for n in (4, 4, 3))
    q, k, v = (a.astype(np.float64) for a in (q32, k32, v32))
    assert_close_f32(attention.softmax_attention(q32, k32, v32, causal=causal), attention.softmax_attention(q, k, v, causal=causal))
    assert_close_f32(
        attention.linear_attention(q32, k32, v32, causal=causal, chunk_size=8),
        attention.linear_attention(q, k, v, causal=causal, chunk_size=8),
    )


# ---------------------------------------------------------------------------
# Kernel regression, GMR, the OVQ read-out
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 1e6])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_regressions_at_extremes(scale, dtype):
    rng = np.random.default_rng(10)
    M = 4096
    q = (scale * rng.normal(size=(3, 2))).astype(dtype)
    k, v = (scale * rng.normal(size=(1, 2))).astype(dtype), (scale * rng.normal(size=(1, 3))).astype(dtype)
    out = gmr.kernel_regression(q, k, v, beta=1.0)  # N = 1 key: every prediction is that value
    assert out.dtype == dtype
    np.testing.assert_allclose(out, np.broadcast_to(v, out.shape), rtol=4 * np.finfo(dtype).eps)
    key_means = (scale * rng.normal(size=(M, 2))).astype(dtype)
    value_means = (scale * rng.normal(size=(M, 3))).astype(dtype)
    weights = np.full(M, 1.0 / M, dtype=dtype)
    for beta in (1e-6, 1.0, 1e6):
        pred = gmr.gmr_predict(q, key_means, value_means, weights, beta=beta)
        assert pred.dtype == dtype and np.all(np.isfinite(pred))
        assert_in_hull(pred, value_means, M)
    counts = rng.integers(1, 10**6, size=M)
    read = gmr.ovq_readout(ovq.unit_rows(q), ovq.unit_rows(key_means), value_means, counts, beta=30.0)
    assert read.dtype == dtype and np.all(np.isfinite(read))
    assert_in_hull(read, value_means, M)


def test_gmr_float32_meets_its_tolerance_when_well_conditioned():
    rng = np.random.default_rng(11)
    s = 1e6
    q, key_means = (s * rng.normal(size=(9, 3))).astype(np.float32), (s * rng.normal(size=(6, 3))).astype(np.float32)
    value_means = (s * rng.normal(size=(6, 2))).astype(np.float32)
    weights = np.full(6, 1 / 6, dtype=np.float32)
    beta = 1.0 / s**2  # kernel width of the scale of the data
    out32 = gmr.gmr_predict(q, key_means, value_means, weights, beta=beta)
    out64 = gmr.gmr_predict(*(a.astype(np.float64) for a in (q, key_means, value_means, weights)), beta=beta)
    assert_close_f32(out32, out64)


# ---------------------------------------------------------------------------
# OVQ
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("T, C, N", [(1, 1, 1), (1, 4, 3), (9, 1, 1), (30, 4, 4096), (25, 7, 3)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ovq_at_extremes(T, C, N, dtype):
    """|q|, |k| from 1e-300 (below the norm floor) to 1e6, |v| up to 1e6: finite, in the hull of the values seen."""
    rng = np.random.default_rng(12)
    mags = 10.0 ** rng.uniform(-30 if dtype == np.float32 else -300, 6, size=(T, 1))
    q, k = (mags * rng.normal(size=(T, 3))).astype(dtype), (mags[::-1] * rng.normal(size=(T, 3))).astype(dtype)
    v = (1e6 * rng.normal(size=(T, 2))).astype(dtype)
    out, st = ovq.ovq_attention(q, k, v, max_size=N, chunk_size=C, return_state=True)
    assert out.dtype == dtype and st.dtype == dtype
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(st.keys)) and np.all(np.isfinite(st.values))
    for t in range(T):
        assert_in_hull(out[t : t + 1], v[: t + 1], t + 1 + N)
    assert st.tokens_seen == T and int(st.counts.sum()) == T and st.size == ovq.dictionary_size(T, N)
    grads = ovq.ovq_attention_backward(np.ones_like(out), ovq.ovq_attention_forward(q, k, v, max_size=N, chunk_size=C)[1])
    assert all(g.dtype == dtype and np.all(np.isfinite(g)) for g in grads)
    # out is linear in v (the assignments depend on the keys only), and of degree 0 in every query row
    # above the norm floor: <dL/dv, v> = <g, out> and q_i . dL/dq_i = 0
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    assert_euler(grads.v, v, np.ones_like(out), out, rtol)
    big = np.linalg.norm(q.astype(np.float64), axis=1) > 1e-6
    radial = np.abs(np.sum(q[big].astype(np.float64) * grads.q[big], axis=1))
    assert np.all(radial <= 1e3 * np.finfo(dtype).eps * np.linalg.norm(q[big], axis=1) * np.linalg.norm(grads.q[big].astype(np.float64), axis=1) + 1e-300)


def test_ovq_float32_meets_its_tolerance_with_large_values():
    rng = np.random.default_rng(13)
    q, k = (rng.normal(size=(60, 4)).astype(np.float32) for _ in range(2))
    v = (1e6 * rng.normal(size=(60, 3))).astype(np.float32)
    out32, c32 = ovq.ovq_attention_forward(q, k, v, max_size=8, chunk_size=6)
    out64, c64 = ovq.ovq_attention_forward(*(a.astype(np.float64) for a in (q, k, v)), max_size=8, chunk_size=6)
    rows = lambda c: np.concatenate([r.rows for r in c.records])  # noqa: E731
    assert np.array_equal(rows(c32), rows(c64))  # the same assignments: a like-for-like comparison
    assert_close_f32(out32, out64)
    assert_close_f32(c32.state.values, c64.state.values)


# ---------------------------------------------------------------------------
# Regression tests: overflow that used to give NaN silently
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, variance", [(np.float32, 1e-30), (np.float64, 1e-300)])
def test_responsibilities_refuse_rows_whose_every_distance_overflows(dtype, variance):
    """(x - mu)^2 / sigma^2 = inf for every component: no representable posterior, a clear error instead of NaN."""
    x = np.array([[1e6, 0.5], [0.0, 0.0]], dtype=dtype)
    means = np.array([[0.0, 1.0], [0.0, -1.0]], dtype=dtype)
    variances = np.full((2, 2), variance, dtype=dtype)
    weights = np.array([0.5, 0.5], dtype=dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        with pytest.raises(ValueError, match=r"x: the scaled squared distance .* overflows .* row\(s\) \(first: row 0\)"):
            gmm.responsibilities(x, means, variances, weights)
        with pytest.raises(ValueError, match="x_q: the scaled squared distance"):
            gma.gma(x, x[::-1].copy(), np.ones((2, 1), dtype), means, variances, weights)
        with pytest.raises(ValueError, match="q: the scaled squared distance"):
            gmr.gmr_predict(x, means, np.ones((2, 1), dtype), weights, beta=1.0 / variance)


def test_a_row_with_some_overflowing_distances_still_has_a_posterior():
    """Only the components at an infinite distance drop out: the posterior of the row stays valid."""
    x = np.array([[1e10]])
    means = np.zeros((2, 1))
    variances = np.array([[1.0], [1e-300]])  # x^2 / sigma^2 = 1e20 and inf
    with np.errstate(over="ignore"):
        resp = gmm.responsibilities(x, means, variances, np.array([0.5, 0.5]))
    np.testing.assert_array_equal(resp, [[1.0, 0.0]])


def test_gma_with_eps_zero_refuses_a_query_that_reads_nothing_instead_of_nan():
    """eps = 0 and a query whose responsibilities meet no key's (underflow): 0/0 is refused, eps > 0 gives 0."""
    means, variances, weights = np.array([[0.0], [10.0]]), np.full((2, 1), 1e-3), np.array([0.5, 0.5])
    x_q, x_k, v = np.array([[0.0], [10.0]]), np.array([[10.0], [10.0]]), np.array([[1.0], [2.0]])
    for causal in (False, True):
        with pytest.raises(ValueError, match="eps: with eps = 0 the denominator of query row 0"):
            gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, eps=0.0)
        out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal)
        assert out[0, 0] == 0.0 and np.all(np.isfinite(out))


def test_linear_attention_with_eps_zero_refuses_underflowed_features_instead_of_nan():
    """elu(x) + 1 = exp(x) underflows to 0 for x < -745: with eps = 0 the denominators are 0."""
    x = np.full((2, 1), -1e6)
    with pytest.raises(ValueError, match="eps: with eps = 0 the denominator of query row 0 is 0.0 \\(q row 0"):
        attention.linear_attention(x, x, np.ones((2, 1)), eps=0.0)
    assert np.array_equal(attention.linear_attention(x, x, np.ones((2, 1))), np.zeros((2, 1)))


def test_softmax_attention_refuses_scores_that_overflow_instead_of_nan():
    q = np.array([[2.0, 0.0], [0.0, 2.0]])
    with np.errstate(over="ignore"):
        with pytest.raises(ValueError, match="scale, q, k: the logits of 2 row"):
            attention.softmax_attention(q, q, np.ones((2, 1)), scale=1e308)
        with pytest.raises(ValueError, match="scale, q, k: the logits"):
            attention.softmax_attention((1e200 * q), q * 1e200, np.ones((2, 1)), causal=True)


def test_kernel_regression_refuses_kernels_that_underflow_for_every_key_instead_of_nan():
    """-(beta/2)||q - k||^2 = -inf for every key of a row: which key is nearest is lost."""
    q, k = np.array([[0.0, 0.0]]), np.array([[1e200, 0.0], [-2e200, 0.0]])
    with np.errstate(over="ignore"):
        with pytest.raises(ValueError, match="beta, q, k: the logits of 1 row"):
            gmr.kernel_regression(q, k, np.ones((2, 1)), beta=1.0)


def test_ovq_readout_refuses_logits_that_overflow_instead_of_nan():
    with np.errstate(over="ignore"):
        with pytest.raises(ValueError, match="beta, q, key_means: the logits"):
            gmr.ovq_readout(np.ones((1, 2)), np.array([[1e300, 0.0], [0.0, 1e300]]), np.ones((2, 1)), np.array([1, 1]), beta=1e10)


def test_ovq_and_vq_refuse_dictionaries_whose_logits_overflow_instead_of_nan():
    """A state built by hand with huge keys, or a huge codebook, and a large beta."""
    q = np.ones((3, 2))
    state = ovq.OVQState(np.array([[1e300, 0.0], [0.0, 0.0]]), np.ones((2, 1)), np.array([1, 0]), 1, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        with pytest.raises(ValueError, match="beta, state: the logits"):
            ovq.ovq_attention(q, q, np.ones((3, 1)), max_size=2, chunk_size=3, beta=1e10, state=state)
        with pytest.raises(ValueError, match="beta, codebook: the logits"):
            ovq.vq_attention(q, q, np.ones((3, 1)), np.array([[1e300, 1e300]]), chunk_size=1, beta=1e10)


def test_a_state_that_cannot_follow_its_growth_is_refused_not_an_assertion():
    """Switching from plateau to linear growth mid-stream used to stop on a bare AssertionError."""
    rng = np.random.default_rng(14)
    q, k, v = rng.normal(size=(30, 3)), rng.normal(size=(30, 3)), rng.normal(size=(30, 2))
    _, st = ovq.ovq_attention(q[:10], k[:10], v[:10], max_size=100, chunk_size=5, return_state=True)
    assert (st.size, st.tokens_seen) == (9, 10)
    # linear growth needs size = tokens_seen + L after the first chunk: one more centroid than its L keys can seed
    for C in (1, 4, 20):
        with pytest.raises(ValueError, match="state: size = 9 after tokens_seen = 10 is too small for growth='linear'"):
            ovq.ovq_attention(q[10:], k[10:], v[10:], max_size=100, chunk_size=C, growth="linear", state=st)
    # linear then plateau: the size already exceeds what plateau asks for, and stays
    _, lin = ovq.ovq_attention(q[:10], k[:10], v[:10], max_size=100, chunk_size=5, growth="linear", return_state=True)
    _, st3 = ovq.ovq_attention(q[10:], k[10:], v[10:], max_size=100, chunk_size=5, state=lin, return_state=True)
    assert st3.size == max(lin.size, ovq.dictionary_size(30, 100)) and int(st3.counts.sum()) == 30


def test_softplus_of_a_python_float_is_float64():
    """A Python float used to come back as float32 (NumPy's promotion with the float32 zero)."""
    out = gmm.softplus(1.0)
    assert out.dtype == np.float64
    assert out == np.log1p(np.exp(1.0))
