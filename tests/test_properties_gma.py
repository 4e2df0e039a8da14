"""Property-based tests (hypothesis) of Gaussian Mixture Attention, bidirectional and causal, over shapes and values.

For every drawn problem (N including 1 and lengths that are not multiples of
the chunk size, K including 1, any d_r, d_v and chunk size; coordinates over
several scales):

* the linear-time ``gma`` equals the explicit quadratic form ``gma_dense``
  on the same responsibilities, to a tolerance relative to the size of the values;
* causal output at position t does not change, bit for bit, when tokens after t change;
* every output lies in the coordinate box of the values (of the values and 0
  when ``eps > 0``, which shrinks outputs towards the origin);
* everything is finite, and float32 in gives float32 out.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refimpl import gma, gmm

EPS64 = np.finfo(np.float64).eps


@st.composite
def gma_problems(draw, max_N=40, max_K=6):
    """(x_q, x_k, v, means, variances, weights, chunk_size) with x_q and x_k of the same length."""
    N = draw(st.integers(1, max_N))
    K = draw(st.integers(1, max_K))
    d_r = draw(st.integers(1, 3))
    d_v = draw(st.integers(1, 3))
    chunk = draw(st.integers(1, 9))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))  # coordinates scale with s, variances with s^2

    def arr(shape, lo, hi):
        return draw(hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, allow_nan=False, allow_infinity=False)))

    x_q = scale * arr((N, d_r), -5, 5)
    x_k = scale * arr((N, d_r), -5, 5)
    means = scale * arr((K, d_r), -5, 5)
    variances = scale**2 * arr((K, d_r), 0.01, 10)
    raw_w = arr((K,), 1e-3, 1.0)
    weights = raw_w / raw_w.sum()
    v = arr((N, d_v), -1e3, 1e3)
    return x_q, x_k, v, means, variances, weights, chunk


def _gammas(x_q, x_k, means, variances, weights):
    return gmm.responsibilities(x_q, means, variances, weights), gmm.responsibilities(x_k, means, variances, weights)


def _value_scale(v):
    return max(1.0, float(np.max(np.abs(v))))


@given(gma_problems(), st.booleans(), st.sampled_from([0.0, 1e-6, 1e-2]))
def test_gma_equals_the_dense_form(problem, causal, eps):
    x_q, x_k, v, means, variances, weights, chunk = problem
    if eps == 0.0:
        x_k = x_q  # self-attention: every denominator holds gamma_i . gamma_i > 0
    out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, eps=eps, chunk_size=chunk)
    ref = gma.gma_dense(*_gammas(x_q, x_k, means, variances, weights), v, causal=causal, eps=eps)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12 * _value_scale(v))


@given(gma_problems(), st.integers(0, 2**32 - 1))
def test_causal_output_depends_only_on_the_past(problem, seed):
    """Replace every token after t (routing queries, keys and values): rows <= t keep their bits."""
    x_q, x_k, v, means, variances, weights, chunk = problem
    N = x_q.shape[0]
    rng = np.random.default_rng(seed)
    t = int(rng.integers(0, N))
    out = gma.gma(x_q, x_k, v, means, variances, weights, causal=True, chunk_size=chunk)
    changed = [a.copy() for a in (x_q, x_k, v)]
    for a in changed:
        a[t + 1 :] = 1e3 * rng.normal(size=a[t + 1 :].shape)
    out2 = gma.gma(*changed, means, variances, weights, causal=True, chunk_size=chunk)
    np.testing.assert_array_equal(out[: t + 1], out2[: t + 1])
    # the reparameterised entry point too
    raw, logits = gmm.raw_from_variances(variances + 1e-3, 1e-3), np.log(weights)
    fwd = gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=True, chunk_size=chunk, min_variance=1e-3)[0]
    fwd2 = gma.gma_forward(*changed, means, raw, logits, causal=True, chunk_size=chunk, min_variance=1e-3)[0]
    np.testing.assert_array_equal(fwd[: t + 1], fwd2[: t + 1])


def _box_tolerance(v, n_terms, dtype=np.float64):
    # a ratio of sums of n_terms nonnegative products: rounding of about 2 n_terms eps max|v|
    return 4 * n_terms * np.finfo(dtype).eps * _value_scale(v)


@given(gma_problems(), st.booleans())
def test_outputs_lie_in_the_box_of_the_values(problem, causal):
    x_q, x_k, v, means, variances, weights, chunk = problem
    N, K = x_q.shape[0], means.shape[0]
    tol = _box_tolerance(v, N + K)
    # eps = 0, queries are the keys: a convex combination of the values it reads
    exact = gma.gma(x_q, x_q, v, means, variances, weights, causal=causal, eps=0.0, chunk_size=chunk)
    for t in range(N):
        seen = v[: t + 1] if causal else v
        assert np.all(exact[t] >= seen.min(axis=0) - tol) and np.all(exact[t] <= seen.max(axis=0) + tol)
    # eps > 0, any keys: a convex combination shrunk towards 0
    out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, chunk_size=chunk)
    lo, hi = np.minimum(v.min(axis=0), 0), np.maximum(v.max(axis=0), 0)
    assert np.all(out >= lo - tol) and np.all(out <= hi + tol)


@given(gma_problems(max_N=20), st.booleans())
def test_reparameterised_forward_and_backward_are_finite_and_match_gma(problem, causal):
    x_q, x_k, v, means, variances, weights, chunk = problem
    raw = gmm.raw_from_variances(variances + 1e-6, 1e-6)
    logits = np.log(weights)
    out, cache = gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, chunk_size=chunk)
    ref = gma.gma(x_q, x_k, v, means, cache.variances, gmm.weights_from_logits(logits), causal=causal, chunk_size=chunk)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12 * _value_scale(v))
    for gamma in (cache.gamma_q, cache.gamma_k):
        np.testing.assert_allclose(gamma.sum(axis=1), 1.0, rtol=0, atol=1e-13)
    grads = gma.gma_backward(np.ones_like(out), cache)
    assert all(np.all(np.isfinite(g)) and g.shape == a.shape for g, a in zip(grads, (x_q, x_k, v, means, raw, logits)))


@given(gma_problems(max_N=20), st.booleans())
def test_float32_in_float32_out_finite_and_in_the_box(problem, causal):
    args = [a.astype(np.float32) for a in problem[:6]]
    x_q, x_k, v, means, variances, weights = args
    weights = (weights / weights.sum(dtype=np.float32)).astype(np.float32)
    out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, chunk_size=problem[6])
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    tol = _box_tolerance(v, x_q.shape[0] + means.shape[0], np.float32)
    assert np.all(out >= np.minimum(v.min(axis=0), 0) - tol) and np.all(out <= np.maximum(v.max(axis=0), 0) + tol)
