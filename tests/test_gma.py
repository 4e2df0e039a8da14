"""refimpl.gma against the dense oracle, scikit-learn responsibilities, closed forms and finite differences."""

import tracemalloc

import numpy as np
import pytest

from refimpl import attention, gma, gmm
from refimpl.testing import GMA_FIELDS, TOL, assert_close_f32, fd_gradients, gma_problem, sklearn_gmm


def constrained(args, min_variance=1e-6):
    """(x_q, x_k, v, means, variances, weights) for gma()."""
    x_q, x_k, v, means, raw, logits = args
    return [x_q, x_k, v, means, gmm.variances_from_raw(raw, min_variance), gmm.softmax(logits)]


def gammas(x_q, x_k, v, means, variances, weights):
    return gmm.responsibilities(x_q, means, variances, weights), gmm.responsibilities(x_k, means, variances, weights)


# --- forward against the dense oracle ----------------------------------------------


@pytest.mark.parametrize(
    "n_q,n_k,K,chunk",
    [(37, 37, 5, 8), (64, 64, 4, 64), (65, 65, 4, 64), (1, 1, 1, 8), (1, 1, 4, 8), (20, 20, 1, 3), (11, 11, 3, 1), (11, 11, 3, 100)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_gma_matches_dense_form(n_q, n_k, K, chunk, causal):
    args = constrained(gma_problem(n_q * 100 + K, n_q, n_k, K, d_r=3, d_v=4))
    out = gma.gma(*args, causal=causal, chunk_size=chunk)
    assert out.shape == (n_q, 4)
    np.testing.assert_allclose(out, gma.gma_dense(*gammas(*args), args[2], causal=causal), **TOL[np.float64])


@pytest.mark.parametrize("causal", [False, True])
def test_dense_oracle_is_the_masked_normalised_sum(causal):
    """out_i = sum_{j in S_i} A_ij v_j / (sum_{j in S_i} A_ij + eps), S_i = all j, or j <= i when causal."""
    args = constrained(gma_problem(27, 8, 8, K=3))
    gq, gk = gammas(*args)
    v = args[2]
    ref = np.empty_like(v)
    for i in range(len(gq)):
        keys = range(i + 1) if causal else range(len(gk))
        a = np.array([gq[i] @ gk[j] for j in keys])
        ref[i] = a @ v[: len(a)] / (a.sum() + 1e-6)
    np.testing.assert_allclose(gma.gma_dense(gq, gk, v, causal=causal), ref, **TOL[np.float64])
    np.testing.assert_allclose(gma.gma(*args, causal=causal, chunk_size=3), ref, **TOL[np.float64])
    if causal:  # the first token reads only itself: out_0 = A_00 v_0 / (A_00 + eps)
        a00 = gq[0] @ gk[0]
        np.testing.assert_allclose(gma.gma(*args, causal=True)[0], a00 * v[0] / (a00 + 1e-6), rtol=1e-14)


def test_cross_attention_with_different_lengths():
    args = constrained(gma_problem(1, n_q=5, n_k=13, K=4))
    np.testing.assert_allclose(gma.gma(*args), gma.gma_dense(*gammas(*args), args[2]), **TOL[np.float64])


def test_gma_dense_with_scikit_learn_responsibilities():
    """An independent route: sklearn's predict_proba as responsibilities, then the explicit N x N form."""
    x_q, x_k, v, means, variances, weights = constrained(gma_problem(2, n_q=30, n_k=30, K=4, d_r=3))
    g = sklearn_gmm(means, variances, weights)
    for causal in (False, True):
        ref = gma.gma_dense(g.predict_proba(x_q), g.predict_proba(x_k), v, causal=causal)
        np.testing.assert_allclose(gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, chunk_size=7), ref, rtol=1e-11, atol=1e-12)


def test_one_component_is_the_running_mean_of_the_values():
    """K = 1: every responsibility is 1, so out_t = sum_{j<=t} v_j / (t + 1 + eps)."""
    rng = np.random.default_rng(3)
    x, v = rng.normal(size=(10, 2)), rng.normal(size=(10, 3))
    args = (x, x, v, np.zeros((1, 2)), np.ones((1, 2)), np.ones(1))
    counts = np.arange(1, 11)[:, None]
    np.testing.assert_allclose(gma.gma(*args, causal=True, chunk_size=4), np.cumsum(v, 0) / (counts + 1e-6), rtol=1e-13)
    np.testing.assert_allclose(gma.gma(*args), np.broadcast_to(v.sum(0) / (10 + 1e-6), (10, 3)), rtol=1e-13)


def test_causal_output_depends_only_on_the_past():
    args = constrained(gma_problem(4, 12, 12, K=3))
    out = gma.gma(*args, causal=True, chunk_size=5)
    changed = [a.copy() for a in args]
    for i in (0, 1, 2):
        changed[i][7:] = np.random.default_rng(5).normal(size=changed[i][7:].shape)
    out2 = gma.gma(*changed, causal=True, chunk_size=5)
    np.testing.assert_array_equal(out[:7], out2[:7])
    assert not np.allclose(out[7:], out2[7:])


def test_gma_forward_is_gma_with_the_reparameterised_gmm():
    args = gma_problem(6, K=4)
    for causal in (False, True):
        out, cache = gma.gma_forward(*args, causal=causal, min_variance=1e-3, chunk_size=4)
        np.testing.assert_allclose(out, gma.gma(*constrained(args, 1e-3), causal=causal, chunk_size=4), **TOL[np.float64])
        assert np.all(cache.variances >= 1e-3)


def test_zero_weight_component_is_never_used():
    x_q, x_k, v, means, variances, _ = constrained(gma_problem(7, K=3))
    weights = np.array([0.5, 0.5, 0.0])
    out = gma.gma(x_q, x_k, v, means, variances, weights)
    ref = gma.gma(x_q, x_k, v, means[:2], variances[:2], weights[:2])
    np.testing.assert_allclose(out, ref, **TOL[np.float64])


# --- adversarial inputs --------------------------------------------------------------


def test_far_tokens_and_tiny_variances_stay_finite_and_match_the_oracle():
    """|x| ~ 1e4 with variances ~ 1e-8: raw log-densities are ~ -1e16; the max-subtracted form survives."""
    rng = np.random.default_rng(8)
    centre = np.array([1e4, -1e4])
    means = centre + 1e-4 * rng.normal(size=(4, 2))
    variances = np.full((4, 2), 1e-8)
    x_q, x_k = centre + 1e-4 * rng.normal(size=(15, 2)), centre + 1e-4 * rng.normal(size=(15, 2))
    v = rng.normal(size=(15, 2))
    for causal in (False, True):
        out = gma.gma(x_q, x_k, v, means, variances, np.full(4, 0.25), causal=causal, chunk_size=4)
        assert np.all(np.isfinite(out))
        ref = gma.gma_dense(*gammas(x_q, x_k, v, means, variances, np.full(4, 0.25)), v, causal=causal)
        np.testing.assert_allclose(out, ref, **TOL[np.float64])


def test_saturated_responsibilities_give_finite_gradients():
    """|x| ~ 1e3 with variances ~ 1e-6: every responsibility is exactly 0 or 1.

    Then c_m = gamma_m (g_m - gbar) vanishes for every token, so the routing
    inputs and the GMM get no gradient at all, and GMA is a hard bucket average:
    A is the 0/1 matrix of "same component" (lower triangle when causal).
    """
    rng = np.random.default_rng(9)
    x = rng.normal(size=(8, 2)) * 1e3
    args = [x, x[::-1].copy(), rng.normal(size=(8, 2)), rng.normal(size=(3, 2)), np.full((3, 2), -20.0), np.array([50.0, 0.0, -50.0])]
    for causal in (False, True):
        out, cache = gma.gma_forward(*args, causal=causal, chunk_size=3)
        g = rng.normal(size=out.shape)
        grads = gma.gma_backward(g, cache)
        assert all(np.all(np.isfinite(a)) for a in (out, *grads))
        for gamma in (cache.gamma_q, cache.gamma_k):
            assert set(np.unique(gamma)) == {0.0, 1.0}
        same = (np.argmax(cache.gamma_q, 1)[:, None] == np.argmax(cache.gamma_k, 1)[None, :]).astype(float)
        if causal:
            same = np.tril(same)
        den = same.sum(1) + 1e-6
        np.testing.assert_allclose(out, same @ args[2] / den[:, None], rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(grads.v, same.T @ (g / den[:, None]), rtol=1e-13, atol=1e-15)
        # exact zeros up to rounding: a wrong softmax Jacobian would give terms of order |g| / sigma^2 ~ 1e6 |g|
        for name in ("x_q", "x_k", "means", "raw_variances", "logits"):
            np.testing.assert_allclose(getattr(grads, name), 0.0, atol=1e-12, err_msg=name)


# --- accuracy away from the origin -----------------------------------------------------


def _on_grid(a, step=2.0**-12):
    """Round to multiples of 2^-12, so that a + 1e6 (float64) and a + 1e3 (float32) are exact."""
    return np.round(a / step) * step


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shift,dtype", [(1e6, np.float64), (1e3, np.float32)])
def test_backward_is_invariant_under_a_common_shift_of_tokens_and_means(shift, dtype, causal):
    """Gradients depend on x - mu only: shifting tokens and means by c must not change them.

    Tight components (sigma^2 ~ 0.01 to 0.04, tokens within a few sigma of a mean)
    make the responsibilities sensitive.  Tokens and means lie on a grid of
    2^-12, so the shifted inputs are exact and every difference from the
    unshifted float64 gradients is arithmetic.  Expanded about the centre of the
    means the backward handles numbers of order one, so float64 agrees to
    rounding (1e-12 of the largest entry allows for reordering of sums);
    expanded about the origin, C^T X^2 - 2 mu C^T X + mu^2 C^T 1 cancels terms
    of order c^2 = 1e12 (1e6 in float32) down to the variance gradient, an error
    of about eps c^2 / sigma^4, far above either tolerance.
    """
    rng = np.random.default_rng(40)
    n, K, d = 12, 4, 2
    means = _on_grid(0.3 * rng.normal(size=(K, d)))
    x_q = _on_grid(means[rng.integers(0, K, n)] + 0.15 * rng.normal(size=(n, d)))
    x_k = _on_grid(means[rng.integers(0, K, n)] + 0.15 * rng.normal(size=(n, d)))
    v, g = rng.normal(size=(n, 3)), rng.normal(size=(n, 3))
    raw = gmm.raw_from_variances(rng.uniform(0.01, 0.04, size=(K, d)))
    logits = rng.normal(size=K)
    out, cache = gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, chunk_size=5)
    assert np.max(cache.gamma_q * (1 - cache.gamma_q)) > 0.1  # the routing is not saturated
    ref = gma.gma_backward(g, cache)

    shifted = [a.astype(dtype) for a in (x_q + shift, x_k + shift, v, means + shift, raw, logits)]
    for a, b in ((shifted[0], x_q), (shifted[1], x_k), (shifted[3], means)):
        np.testing.assert_array_equal(a.astype(np.float64) - shift, b)  # the shift itself is exact
    out_c, cache_c = gma.gma_forward(*shifted, causal=causal, chunk_size=5)
    grads = gma.gma_backward(g.astype(dtype), cache_c)
    tol = TOL[dtype]
    for name, a, b in zip(GMA_FIELDS, grads, ref):
        assert a.dtype == dtype, name
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=name)
    np.testing.assert_allclose(out_c, out, **tol)


# --- gradients ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "causal,n_q,n_k,K,chunk",
    [
        (False, 7, 9, 3, 4),  # cross attention
        (True, 10, 10, 3, 4),  # N not a multiple of the chunk size
        (True, 8, 8, 2, 8),  # one full chunk
        (True, 1, 1, 3, 4),
        (False, 1, 1, 3, 4),
        (True, 6, 6, 1, 4),
        (False, 5, 5, 1, 4),
    ],
)
def test_backward_matches_finite_differences(causal, n_q, n_k, K, chunk):
    args = gma_problem(10 + n_q + K, n_q, n_k, K)
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=chunk)
    g = np.random.default_rng(11).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    assert grads._fields == GMA_FIELDS
    fd = fd_gradients(lambda *a: gma.gma_forward(*a, causal=causal, chunk_size=chunk)[0], args, g)
    for name, a, b, arg in zip(GMA_FIELDS, grads, fd, args):
        assert a.shape == arg.shape and a.dtype == arg.dtype, name
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8 * scale, err_msg=name)


def test_backward_with_a_larger_variance_floor():
    args = gma_problem(12, 6, 6, 3)
    args[4] = args[4] - 3.0  # softplus(raw) small: the floor matters
    out, cache = gma.gma_forward(*args, causal=True, min_variance=0.05, chunk_size=4)
    g = np.random.default_rng(13).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    fd = fd_gradients(lambda *a: gma.gma_forward(*a, causal=True, min_variance=0.05, chunk_size=4)[0], args, g)
    for a, b in zip(grads, fd):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8 * max(1.0, float(np.max(np.abs(b)))))


def test_gradients_of_shared_queries_and_keys_add_up():
    """x_q is x_k: the gradient with respect to the one array is x_q + x_k."""
    args = gma_problem(14, 6, 6, 3)
    x = args[0]
    out, cache = gma.gma_forward(x, x, *args[2:], causal=True, chunk_size=4)
    g = np.random.default_rng(15).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    (fd,) = fd_gradients(lambda y: gma.gma_forward(y, y, *args[2:], causal=True, chunk_size=4)[0], [x], g)
    np.testing.assert_allclose(grads.x_q + grads.x_k, fd, rtol=1e-6, atol=1e-8)


def test_backward_does_not_accumulate_and_inputs_are_not_mutated():
    args = gma_problem(16, 8, 8, 3)
    copies = [a.copy() for a in args]
    out, cache = gma.gma_forward(*args, causal=True, chunk_size=3)
    g = np.ones_like(out)
    first, second = gma.gma_backward(g, cache), gma.gma_backward(g, cache)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
        assert not np.shares_memory(a, b)
    gma.gma(*constrained(args), causal=True)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("causal", [False, True])
def test_writing_into_the_forwards_output_leaves_its_backward_as_it_was(causal):
    """The cache keeps the scan's output for the backward; the caller's output is another array."""
    args = gma_problem(22, 9, 9, 3)
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=4)
    g = np.random.default_rng(23).normal(size=out.shape)
    before = gma.gma_backward(g, cache)
    out *= 3.0
    for name, a, b in zip(GMA_FIELDS, before, gma.gma_backward(g, cache)):
        np.testing.assert_array_equal(a, b, err_msg=name)


# --- float32 --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_float32_in_float32_out(causal):
    args64 = gma_problem(17, 40, 40, 6, d_r=4, d_v=3)
    args32 = [a.astype(np.float32) for a in args64]
    out32, cache32 = gma.gma_forward(*args32, causal=causal, chunk_size=16)
    out64, cache64 = gma.gma_forward(*args64, causal=causal, chunk_size=16)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, **TOL[np.float32])
    g = np.random.default_rng(18).normal(size=out64.shape)
    for name, a, b in zip(GMA_FIELDS, gma.gma_backward(g.astype(np.float32), cache32), gma.gma_backward(g, cache64)):
        assert_close_f32(a, b, err_msg=name)
    c32 = constrained(args32)
    assert gma.gma(*c32, causal=causal).dtype == np.float32
    assert gma.gma_dense(*gammas(*c32), c32[2], causal=causal).dtype == np.float32


def test_mixed_dtypes_promote_to_float64():
    args = constrained(gma_problem(19))
    args[0] = args[0].astype(np.float32)
    assert gma.gma(*args).dtype == np.float64


# --- memory: what the algorithm never forms -------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_peak_memory_is_linear_and_has_no_quadratic_or_nkd_tensor(causal):
    def peak(n):
        args = gma_problem(20, n, n, K=32, d_r=4, d_v=32)
        tracemalloc.start()
        try:
            out, cache = gma.gma_forward(*args, causal=causal)
            gma.gma_backward(out, cache)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(1024), peak(8192)
    assert large < 10 * small  # 8x the tokens: linear growth (an N^2 term would give ~64x)
    # the N x K and N x d_v arrays of the forward and backward are 2 MiB each; one
    # N x K x d_v tensor would be 64 MiB and one N x N matrix 512 MiB
    assert large < 8192 * 32 * 32 * 8 / 2
    assert large < 8192 * 8192 * 8 / 16


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index,value,exc,match",
    [
        (1, np.ones((9, 3)), ValueError, r"x_k: expected shape \(N_k, d_r\)"),
        (2, np.ones((8, 3)), ValueError, r"v: expected shape \(N_k, d_v\)"),
        (3, np.ones((3, 3)), ValueError, r"means: expected shape \(K, d_r\)"),
        (4, -np.ones((3, 2)), ValueError, "variances: expected strictly positive"),
        (5, np.array([0.5, 0.5, 0.5]), ValueError, "weights: expected weights that sum to 1"),
        (5, np.array([0.5, 0.5]), ValueError, r"weights: expected shape \(K,\)"),
        (0, np.ones((9, 2), dtype=int), TypeError, "x_q: expected a real floating-point array"),
        (2, np.full((9, 3), np.nan), ValueError, "v: expected finite values"),
    ],
)
def test_gma_bad_arrays_get_clear_errors(index, value, exc, match):
    args = constrained(gma_problem(21))
    args[index] = value
    with pytest.raises(exc, match=match):
        gma.gma(*args)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
        (dict(chunk_size=2.5), TypeError, "chunk_size: expected an integer"),
        (dict(eps=-1e-6), ValueError, "eps: expected a finite number >= 0"),
        (dict(causal=1), TypeError, "causal: expected True or False"),
        (dict(min_variance=0.0), ValueError, "min_variance: expected a finite number > 0"),
    ],
)
def test_gma_forward_bad_options_get_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        gma.gma_forward(*gma_problem(22), **kwargs)


def test_more_errors():
    args = gma_problem(23, n_q=4, n_k=6)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        gma.gma_forward(*args, causal=True)
    args[5] = args[5][:2]
    with pytest.raises(ValueError, match=r"logits: expected shape \(K,\)"):
        gma.gma_forward(*args)
    args = gma_problem(24)
    args[4] = args[4][:, :1]
    with pytest.raises(ValueError, match=r"raw_variances: expected shape \(K, d_r\)"):
        gma.gma_forward(*args)
    out, cache = gma.gma_forward(*gma_problem(25))
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(N_q, d_v\)"):
        gma.gma_backward(out[:, :1], cache)
    with pytest.raises(ValueError, match="gamma_k: expected nonnegative responsibilities"):
        gma.gma_dense(np.ones((3, 2)) / 2, -np.ones((3, 2)), np.ones((3, 1)))


def test_gma_uses_the_shared_scan():
    """Causal GMA is causal linear attention with gamma as the feature map (docs/derivations/gma.md)."""
    args = constrained(gma_problem(26, 13, 13, 4))
    gq, gk = gammas(*args)
    np.testing.assert_array_equal(
        gma.gma(*args, causal=True, chunk_size=5), attention.feature_attention(gq, gk, args[2], causal=True, chunk_size=5)
    )
