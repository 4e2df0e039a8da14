"""refimpl.theory: the responsibility Jacobian, Lipschitz and gradient bounds, the affinity's structure.

Bounds are checked on random parameters (hypothesis) and on adversarial ones:
variances at the floor, means on the sphere of the input ball, near-ties,
saturated and unused components, and points found by maximising ||J||_2.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog, minimize

from refimpl import attention, gma, gmm, theory

SQRT2 = np.sqrt(2.0)
# The bound holds for the exact values; the computed ones carry rounding of a few ulps.
ROUNDING = 1 + 1e-12


def random_mixture(seed, K, d, var_lo=0.1, mean_scale=1.0):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(K, d)) * mean_scale
    variances = rng.uniform(var_lo, 1.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    return means, variances, weights


def adversarial_mixtures():
    """(name, means, variances, weights, bound_x)."""
    K = 24
    angles = np.linspace(0, 2 * np.pi, K, endpoint=False)
    ring = np.stack([np.cos(angles), np.sin(angles)], 1)
    return [
        ("pair at the floor", np.array([[1.0, 0.0], [-1.0, 0.0]]), np.full((2, 2), 1e-3), np.array([0.5, 0.5]), 0.01),
        ("pair, wide ball", np.array([[1.0, 0.0], [-1.0, 0.0]]), np.full((2, 2), 1e-2), np.array([0.5, 0.5]), 2.0),
        ("ring on the sphere", ring, np.full((K, 2), 5e-3), np.full(K, 1 / K), 1.0),
        ("one axis tight each", np.eye(3) * 0.5, np.where(np.eye(3) > 0, 1e-2, 1.0), np.array([0.98, 0.019, 0.001]), 3.0),
        ("near-duplicate means", np.array([[0.0, 0.0], [1e-3, 0.0], [0.0, 1e-3]]), np.full((3, 2), 1e-4), np.full(3, 1 / 3), 1e-2),
    ]


def max_jacobian_norm_by_optimisation(means, variances, weights, bound_x, starts=8, seed=0):
    """Maximise ||J(x)||_2 over the ball with x = bound_x * tanh(|y|) y / |y| (unconstrained y)."""
    rng = np.random.default_rng(seed)
    d = means.shape[1]

    def to_ball(y):
        r = np.linalg.norm(y)
        return np.zeros(d) if r == 0 else bound_x * np.tanh(r) * y / r

    def objective(y):
        return -theory.jacobian_spectral_norms(to_ball(y)[None, :], means, variances, weights)[0]

    best = 0.0
    candidates = [rng.normal(size=d) for _ in range(starts)] + [np.zeros(d) + 1e-9]
    for y0 in candidates:
        res = minimize(objective, y0, method="Nelder-Mead", options=dict(maxiter=400, xatol=1e-10, fatol=1e-12))
        best = max(best, -res.fun)
    return best


# --- the Jacobian -------------------------------------------------------------------


@pytest.mark.parametrize("K,d", [(1, 2), (2, 1), (5, 3), (12, 4)])
def test_jacobian_matches_finite_differences(K, d):
    means, variances, weights = random_mixture(K * 10 + d, K, d)
    x = np.random.default_rng(0).normal(size=(7, d))
    jac = theory.responsibility_jacobian(x, means, variances, weights)
    assert jac.shape == (7, K, d)
    h = 1e-6
    for j in range(d):
        e = np.zeros(d)
        e[j] = h
        fd = (gmm.responsibilities(x + e, means, variances, weights) - gmm.responsibilities(x - e, means, variances, weights)) / (2 * h)
        np.testing.assert_allclose(jac[:, :, j], fd, rtol=1e-6, atol=1e-9)
    # responsibilities sum to one, so the columns of J sum to zero
    np.testing.assert_allclose(jac.sum(axis=1), 0.0, atol=1e-12 * max(1.0, np.abs(jac).max()))


def test_spectral_norms_match_singular_values():
    means, variances, weights = random_mixture(1, 6, 3)
    x = np.random.default_rng(1).normal(size=(5, 3))
    jac = theory.responsibility_jacobian(x, means, variances, weights)
    expected = [np.linalg.svd(j, compute_uv=False)[0] for j in jac]
    np.testing.assert_allclose(theory.jacobian_spectral_norms(x, means, variances, weights), expected, rtol=1e-13)


def test_bound_formulas():
    means = np.array([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])  # B_mu = 5
    variances = np.full((4, 2), 0.5)
    b = theory.lipschitz_bounds(means, variances, 2.0)
    assert b.radius == pytest.approx((2.0 + 5.0) / 0.5)
    assert b.crude == pytest.approx(0.5 * 2.0 * b.radius)  # sqrt(K) / 2 = 1 at K = 4
    assert b.k_free == b.radius
    assert theory.bound_radius(means, variances, 2.0, min_variance=0.25) == pytest.approx(28.0)
    with pytest.raises(ValueError, match="min_variance: expected a floor <= the smallest variance"):
        theory.bound_radius(means, variances, 2.0, min_variance=1.0)


# --- Lipschitz bounds never violated ----------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    K=st.integers(1, 20),
    d=st.integers(1, 5),
    var_lo=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]),
    mean_scale=st.sampled_from([0.1, 1.0, 5.0]),
    bound_x=st.sampled_from([0.0, 0.1, 1.0, 4.0]),
)
def test_lipschitz_bounds_hold_on_random_mixtures(seed, K, d, var_lo, mean_scale, bound_x):
    means, variances, weights = random_mixture(seed, K, d, var_lo, mean_scale)
    b = theory.lipschitz_bounds(means, variances, bound_x)
    emp = theory.empirical_lipschitz(means, variances, weights, bound_x, n_points=200, n_pairs=200, seed=seed)
    worst = max(emp.jacobian_norm, emp.difference_quotient)
    assert worst <= min(b.crude, b.k_free / SQRT2) * ROUNDING


@pytest.mark.parametrize("case", adversarial_mixtures(), ids=lambda c: c[0])
def test_lipschitz_bounds_hold_on_adversarial_mixtures(case):
    _, means, variances, weights, bound_x = case
    b = theory.lipschitz_bounds(means, variances, bound_x)
    emp = theory.empirical_lipschitz(means, variances, weights, bound_x, n_points=1500, n_pairs=1500)
    optimised = max_jacobian_norm_by_optimisation(means, variances, weights, bound_x)
    worst = max(emp.jacobian_norm, emp.difference_quotient, optimised)
    assert worst <= b.crude * ROUNDING
    assert worst <= b.k_free / SQRT2 * ROUNDING  # the sharpened K-free constant


def test_sharpened_k_free_constant_is_attained_by_a_symmetric_pair():
    """Two components at +-B e_1 with variance s and a ball of radius -> 0: ||J(0)||_2 = R / sqrt(2)."""
    means, variances, weights = np.array([[2.0, 0.0], [-2.0, 0.0]]), np.full((2, 2), 0.1), np.array([0.5, 0.5])
    b = theory.lipschitz_bounds(means, variances, 0.0)
    at_zero = theory.jacobian_spectral_norms(np.zeros((1, 2)), means, variances, weights)[0]
    np.testing.assert_allclose(at_zero, b.k_free / SQRT2, rtol=1e-13)
    # at K = 2 the crude bound sqrt(K) R / 2 is the same number: it is attained too
    np.testing.assert_allclose(at_zero, b.crude, rtol=1e-13)
    # the estimator finds it too
    emp = theory.empirical_lipschitz(means, variances, weights, 1e-6, n_points=50, n_pairs=50)
    assert emp.jacobian_norm > 0.99 * b.k_free / SQRT2
    assert emp.difference_quotient > 0.99 * b.k_free / SQRT2


def test_crude_bound_is_the_tighter_one_for_small_k():
    means, variances, _ = random_mixture(3, 2, 2)
    b = theory.lipschitz_bounds(means, variances, 1.0)
    assert b.crude < b.k_free  # sqrt(2) / 2 < 1
    # at K = 2 it equals the sharpened K-free constant R / sqrt(2), which a symmetric pair attains
    assert b.crude == pytest.approx(b.k_free / SQRT2, rel=1e-15)
    assert b.k_free == pytest.approx(theory.bound_radius(means, variances, 1.0), rel=1e-15)
    means, variances, _ = random_mixture(3, 4, 2)
    b = theory.lipschitz_bounds(means, variances, 1.0)
    assert b.crude == pytest.approx(b.k_free, rel=1e-15)  # sqrt(4) / 2 = 1: the two bounds cross at K = 4
    means, variances, _ = random_mixture(3, 9, 2)
    b = theory.lipschitz_bounds(means, variances, 1.0)
    assert b.crude == pytest.approx(1.5 * b.k_free)


# --- sampling the ball ----------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 5])
def test_sample_ball_is_uniform_in_the_ball(d):
    """Uniform in the ball: P(||x|| <= t r) = t^d, and the direction is uniform (mean 0, covariance I/d of it)."""
    n, radius = 20000, 2.5
    x = theory.sample_ball(n, d, radius, np.random.default_rng(d))
    assert x.shape == (n, d)
    norms = np.linalg.norm(x, axis=1)
    assert np.all(norms <= radius * (1 + 1e-15))
    for t in (0.5, 0.9):
        p = t**d
        # a binomial frequency: within 5 standard errors sqrt(p (1 - p) / n)
        assert abs(np.mean(norms <= t * radius) - p) <= 5 * np.sqrt(p * (1 - p) / n), t
    # E||x||^2 = d r^2 / (d + 2); E x = 0 and E x x^T = r^2 / (d + 2) I by symmetry.  Per coordinate,
    # Var(x_j) = r^2 / (d + 2) and Var(x_j^2) <= r^4 / (d + 2), so 5 standard errors of the means below
    second = radius**2 / (d + 2)
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=5 * np.sqrt(second / n))
    np.testing.assert_allclose(np.mean(x**2, axis=0), second, atol=5 * radius**2 / np.sqrt((d + 2) * n))
    if d == 2:  # the angle is uniform: half of the points lie within pi/8 of a diagonal
        angle = np.mod(np.arctan2(x[:, 1], x[:, 0]), np.pi / 2)
        assert abs(np.mean(np.abs(angle - np.pi / 4) < np.pi / 8) - 0.5) <= 5 * 0.5 / np.sqrt(n)
    assert theory.sample_ball(0, d, radius, np.random.default_rng(0)).shape == (0, d)
    np.testing.assert_array_equal(theory.sample_ball(5, d, 0.0, np.random.default_rng(0)), 0.0)


# --- gradient bounds ---------------------------------------------------------------------


def _upstream(rng, n, K):
    g = rng.normal(size=(n, K)) * 10.0 ** rng.uniform(-3, 3, size=(n, 1))
    g[::4] = 0.0
    g[::4, -1] = 1.0  # one-hot upstream gradients
    return g


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 12), d=st.integers(1, 4), var_lo=st.sampled_from([1e-3, 0.05, 0.5]))
def test_gradient_bounds_hold_per_token_on_random_mixtures(seed, K, d, var_lo):
    means, variances, weights = random_mixture(seed, K, d, var_lo, mean_scale=2.0)
    rng = np.random.default_rng(seed)
    x = theory.sample_ball(30, d, 3.0, rng)
    g = _upstream(rng, 30, K)
    _assert_gradient_bounds(x, means, variances, weights, g, bound_x=3.0)


@pytest.mark.parametrize("case", adversarial_mixtures(), ids=lambda c: c[0])
def test_gradient_bounds_hold_per_token_on_adversarial_mixtures(case):
    _, means, variances, weights, bound_x = case
    rng = np.random.default_rng(7)
    x = np.concatenate([theory.sample_ball(40, means.shape[1], bound_x, rng), np.zeros((1, means.shape[1]))])
    _assert_gradient_bounds(x, means, variances, weights, _upstream(rng, len(x), means.shape[0]), bound_x)


def _assert_gradient_bounds(x, means, variances, weights, g, bound_x):
    grads = theory.per_token_gradients(x, means, variances, weights, g)
    gamma = gmm.responsibilities(x, means, variances, weights)
    b = theory.gradient_bounds(gamma, g, theory.bound_radius(means, variances, bound_x))
    spread = np.ptp(g, axis=1)
    # each inequality up to the rounding of the computed gradient, a few ulps of |g| R
    slack = 1e-13 * np.max(np.abs(g), axis=1) * theory.bound_radius(means, variances, bound_x)
    assert np.all(np.linalg.norm(grads.x, axis=1) <= b.x * ROUNDING + slack)
    assert np.all(grads.means_norm.max(axis=1) <= b.means * ROUNDING + slack)
    assert np.all(np.abs(grads.logits).max(axis=1) <= b.logits * ROUNDING + 1e-13 * np.max(np.abs(g), axis=1))
    assert np.all(np.abs(grads.logits) <= b.logits_modulated * ROUNDING + 1e-13 * np.max(np.abs(g), axis=1)[:, None])
    # the modulated bound is the sharper one: gamma (1 - gamma) <= 1/4
    assert np.all(b.logits_modulated <= 0.25 * spread[:, None] * ROUNDING)


def test_gradient_bound_formulas_on_a_hand_computed_example():
    gamma = np.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    g = np.array([[1.0, -2.0, 4.0], [3.0, 3.0, 3.0]])  # ranges 6 and 0
    b = theory.gradient_bounds(gamma, g, 3.0)
    # range(g) R / 2, range(g) R / 4, range(g) / 4, gamma (1 - gamma) range(g); products of exact binary
    # fractions except 0.2 and 0.3, so equality to an ulp
    np.testing.assert_allclose(b.x, [9.0, 0.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(b.means, [4.5, 0.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(b.logits, [1.5, 0.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(b.logits_modulated, [[0.96, 1.26, 1.5], [0.0, 0.0, 0.0]], rtol=1e-15, atol=0)


@pytest.mark.parametrize("B,s", [(2.0, 0.1), (0.5, 1.0)])
@pytest.mark.parametrize("g", [[1.0, -3.0], [0.0, 2.5], [-7.0, 1.0]])
def test_gradient_bounds_are_attained_by_a_symmetric_pair_at_the_origin(B, s, g):
    """mu = +-B e_1, equal variances s and weights, x = 0, bound_x = 0 (R = B / s).

    gamma = (1/2, 1/2) and u_m = (mu_m - x) / s = +-R e_1, so c = +-(g_1 - g_2) / 4:
    |c_m| = range(g) / 4 = gamma_m (1 - gamma_m) range(g), ||dL/dmu_m|| = |c_m| R = range(g) R / 4
    and dL/dx = c_1 u_1 + c_2 u_2 = (g_1 - g_2) R / 2 e_1: all four bounds hold with equality.
    """
    means, variances, weights = np.array([[B, 0.0], [-B, 0.0]]), np.full((2, 2), s), np.array([0.5, 0.5])
    x, g = np.zeros((1, 2)), np.array([g])
    radius = theory.bound_radius(means, variances, 0.0)
    assert radius == pytest.approx(B / s, rel=1e-15)
    grads = theory.per_token_gradients(x, means, variances, weights, g)
    gamma = gmm.responsibilities(x, means, variances, weights)
    np.testing.assert_allclose(gamma, 0.5, rtol=1e-15)
    b = theory.gradient_bounds(gamma, g, radius)
    # equalities to rounding (a few ulps of each side)
    np.testing.assert_allclose(np.linalg.norm(grads.x, axis=1), b.x, rtol=1e-14)
    np.testing.assert_allclose(grads.x[:, 1], 0.0, atol=1e-15 * b.x[0])
    np.testing.assert_allclose(grads.means_norm, b.means[:, None] * np.ones((1, 2)), rtol=1e-14)
    np.testing.assert_allclose(np.abs(grads.logits), b.logits[:, None] * np.ones((1, 2)), rtol=1e-14)
    np.testing.assert_allclose(np.abs(grads.logits), b.logits_modulated, rtol=1e-14)
    np.testing.assert_allclose(grads.logits[0], [(g[0, 0] - g[0, 1]) / 4, (g[0, 1] - g[0, 0]) / 4], rtol=1e-14)


def test_saturated_and_unused_components_get_almost_no_gradient():
    means = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    variances = np.full((3, 2), 0.5)
    weights = np.array([0.6, 0.4 - 1e-12, 1e-12])
    x = np.random.default_rng(8).normal(size=(20, 2)) * 0.3  # every token deep inside component 0
    g = np.random.default_rng(9).normal(size=(20, 3))
    c = theory.per_token_gradients(x, means, variances, weights, g).logits
    gamma = gmm.responsibilities(x, means, variances, weights)
    assert np.all(gamma[:, 1:] < 1e-20)  # component 0 is saturated, 1 and 2 are unused
    assert np.max(np.abs(c)) < 1e-15 * np.max(np.abs(g))  # the saturated one and the unused ones
    # a token on the boundary between components 0 and 1 does get gradient
    c_mid = theory.per_token_gradients(np.array([[5.0, 0.0]]), means, variances, np.array([0.5, 0.5 - 1e-12, 1e-12]), g[:1]).logits
    assert np.abs(c_mid[0, 0]) > 1e-3 * np.ptp(g[0])


@pytest.mark.parametrize("causal", [False, True])
def test_per_token_gradients_sum_to_gma_backward(causal):
    rng = np.random.default_rng(10)
    n, K, d = 12, 4, 3
    x_q, x_k, v = rng.normal(size=(n, d)), rng.normal(size=(n, d)), rng.normal(size=(n, 2))
    means, raw, logits = rng.normal(size=(K, d)), rng.normal(size=(K, d)), rng.normal(size=K)
    out, cache = gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, chunk_size=5)
    g = rng.normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    dgamma = attention.feature_attention_backward(g, cache.mixing)
    weights = gmm.softmax(logits)
    pq = theory.per_token_gradients(x_q, means, cache.variances, weights, dgamma.phi_q)
    pk = theory.per_token_gradients(x_k, means, cache.variances, weights, dgamma.phi_k)
    np.testing.assert_allclose(pq.x, grads.x_q, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pk.x, grads.x_k, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pq.logits.sum(0) + pk.logits.sum(0), grads.logits, rtol=1e-10, atol=1e-12)
    # the summed mean gradient is bounded by the summed per-token norms (triangle inequality)
    assert np.all(np.linalg.norm(grads.means, axis=1) <= (pq.means_norm.sum(0) + pk.means_norm.sum(0)) * ROUNDING)
    # the per-token terms themselves: c_im (x_i - mu_m) / sigma_m^2, whose norms are means_norm and whose sum is dL/dmu
    terms = [
        p.logits[:, :, None] * (x[:, None, :] - means[None]) / cache.variances[None]
        for p, x in ((pq, x_q), (pk, x_k))
    ]
    for p, t in zip((pq, pk), terms):
        np.testing.assert_allclose(p.means_norm, np.linalg.norm(t, axis=2), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(terms[0].sum(0) + terms[1].sum(0), grads.means, rtol=1e-10, atol=1e-12)


# --- the affinity ---------------------------------------------------------------------


def _gammas(seed, n_q, n_k, K, d=3, saturate=False):
    means, variances, weights = random_mixture(seed, K, d, var_lo=0.01 if saturate else 0.3, mean_scale=5.0 if saturate else 1.0)
    rng = np.random.default_rng(seed + 1)
    return (
        gmm.responsibilities(rng.normal(size=(n_q, d)), means, variances, weights),
        gmm.responsibilities(rng.normal(size=(n_k, d)), means, variances, weights),
    )


@pytest.mark.parametrize("K", [1, 2, 5, 9])
@pytest.mark.parametrize("saturate", [False, True])
def test_affinity_rank_and_entries(K, saturate):
    gq, gk = _gammas(K, 30, 30, K, saturate=saturate)
    for causal in (False, True):
        a = theory.affinity(gq, gk, causal=causal)
        assert np.min(a) >= 0 and np.max(a) <= 1
    assert np.linalg.matrix_rank(theory.affinity(gq, gk)) <= K


@pytest.mark.parametrize("n_q,n_k", [(7, 7), (1, 1)])
def test_affinity_is_the_product_of_responsibilities_and_causal_keeps_its_lower_triangle(n_q, n_k):
    gq, gk = _gammas(13, n_q, n_k, 4)
    full = theory.affinity(gq, gk)
    # A_ij = sum_k gamma_q_ik gamma_k_jk, entry by entry (no matrix product), to rounding
    explicit = np.array([[np.sum(gq[i] * gk[j]) for j in range(n_k)] for i in range(n_q)])
    np.testing.assert_allclose(full, explicit, rtol=1e-14, atol=0)
    causal = theory.affinity(gq, gk, causal=True)
    # the mask keeps j <= i (the diagonal included) and zeroes j > i exactly
    i, j = np.indices(causal.shape)
    np.testing.assert_array_equal(causal[j <= i], full[j <= i])
    np.testing.assert_array_equal(causal[j > i], 0.0)
    assert np.all(np.diag(causal) > 0)  # a mask shifted below the diagonal would zero these
    np.testing.assert_array_equal(causal, np.tril(gq @ gk.T))


def test_affinity_bounds_zero_and_one_are_attained_by_one_hot_rows():
    """Identical one-hot rows agree surely (A = 1), disjoint ones never (A = 0)."""
    gq = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3]])
    gk = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    a = theory.affinity(gq, gk)
    np.testing.assert_array_equal(a[:2], [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(a[2], 1 / 3, rtol=1e-15)  # a uniform row agrees with anything with probability 1/K


def test_affinity_rank_reaches_k_for_generic_inputs():
    gq, gk = _gammas(11, 40, 40, 6)
    assert np.linalg.matrix_rank(theory.affinity(gq, gk)) == 6


def test_affinity_is_the_probability_that_two_draws_agree():
    gq, gk = _gammas(12, 5, 4, 3)
    a = theory.affinity(gq, gk)
    np.testing.assert_allclose(theory.affinity_by_enumeration(gq, gk), a, rtol=1e-14, atol=1e-16)
    n = 40000
    freq = theory.affinity_by_sampling(gq, gk, n, seed=13)
    # each frequency has standard error sqrt(a (1 - a) / n) <= 0.5 / sqrt(n); allow 6 of them
    np.testing.assert_allclose(freq, a, atol=6 * 0.5 / np.sqrt(n))


def test_affinity_sampling_handles_one_hot_rows():
    gq = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    gk = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(theory.affinity_by_sampling(gq, gk, 500), [[0.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize("K", [1, 3, 10])
def test_affinity_is_psd_when_queries_are_keys(K):
    gq, _ = _gammas(20 + K, 25, 1, K)
    eig = np.linalg.eigvalsh(theory.affinity(gq, gq))
    assert eig[0] >= -1e-13 * eig[-1]


@pytest.mark.parametrize("causal", [False, True])
def test_outputs_lie_in_the_convex_hull_of_the_values(causal):
    rng = np.random.default_rng(30)
    n = 10
    x_q, x_k, v = rng.normal(size=(n, 2)), rng.normal(size=(n, 2)), rng.normal(size=(n, 2))
    means, variances, weights = random_mixture(31, 4, 2)
    out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, eps=0.0)
    for i in range(n):
        vals = v[: i + 1] if causal else v
        res = linprog(
            np.zeros(len(vals)),
            A_eq=np.vstack([vals.T, np.ones((1, len(vals)))]),
            b_eq=np.concatenate([out[i], [1.0]]),
            bounds=[(0, None)] * len(vals),
            method="highs",
        )
        assert res.status == 0, f"row {i} is outside the hull"
    # a point outside the hull is reported infeasible: the test can fail
    res = linprog(np.zeros(n), A_eq=np.vstack([v.T, np.ones((1, n))]), b_eq=np.array([100.0, 0.0, 1.0]), bounds=[(0, None)] * n, method="highs")
    assert res.status == 2


def test_outputs_are_mixtures_of_slot_means():
    gq, gk = _gammas(40, 15, 20, 5)
    v = np.random.default_rng(41).normal(size=(20, 3))
    w, m = theory.mixing_weights(gq, gk, eps=1e-6), theory.slot_means(gk, v)
    np.testing.assert_allclose(w @ m, gma.gma_dense(gq, gk, v), rtol=1e-12, atol=1e-14)
    assert np.all(w >= 0) and np.all(w.sum(1) <= 1)
    # the deficit is exactly the share of eps in the denominator: 1 - sum_k w_ik = eps / (gamma_q_i . Z + eps);
    # it is ~1e-7 and 1 - sum cancels to an absolute error of a few 1e-16, hence rtol 1e-6
    np.testing.assert_allclose(1 - w.sum(1), 1e-6 / (gq @ gk.sum(0) + 1e-6), rtol=1e-6)
    w0 = theory.mixing_weights(gq, gk, eps=0.0)
    np.testing.assert_allclose(w0.sum(1), 1.0, rtol=1e-14)
    assert np.all(m.min(0) >= v.min(0)) and np.all(m.max(0) <= v.max(0))


def test_isotropic_router_is_a_linear_softmax():
    means, _, weights = random_mixture(50, 6, 3)
    x = np.random.default_rng(51).normal(size=(20, 3)) * 3
    resp = gmm.responsibilities(x, means, np.full((6, 3), 0.4), weights)
    np.testing.assert_allclose(gmm.softmax(theory.isotropic_router_logits(x, means, 0.4, weights)), resp, rtol=1e-12, atol=1e-14)
    # with per-component variances the linear form no longer holds
    var = np.random.default_rng(52).uniform(0.2, 1.0, size=(6, 3))
    resp2 = gmm.responsibilities(x, means, var, weights)
    assert not np.allclose(gmm.softmax(theory.isotropic_router_logits(x, means, 0.4, weights)), resp2, atol=1e-3)


# --- errors ---------------------------------------------------------------------------


def test_bad_input_gets_clear_errors():
    means, variances, weights = random_mixture(60, 3, 2)
    with pytest.raises(ValueError, match="gamma_q: expected rows that sum to 1"):
        theory.affinity(np.full((2, 3), 0.5), np.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="gamma_k: expected nonnegative responsibilities"):
        theory.affinity(np.full((2, 3), 1 / 3), np.array([[1.5, -0.5, 0.0]]))
    with pytest.raises(ValueError, match=r"gamma_k: expected shape \(N, K\)"):
        theory.affinity(np.full((2, 3), 1 / 3), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="bound_x: expected a finite number >= 0"):
        theory.lipschitz_bounds(means, variances, -1.0)
    with pytest.raises(ValueError, match="variances: expected strictly positive"):
        theory.responsibility_jacobian(np.zeros((1, 2)), means, -variances, weights)
    with pytest.raises(ValueError, match=r"grad_resp: expected shape \(N, K\)"):
        theory.per_token_gradients(np.zeros((4, 2)), means, variances, weights, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="n_samples: expected an integer >= 1"):
        theory.affinity_by_sampling(np.full((1, 3), 1 / 3), np.full((1, 3), 1 / 3), 0)
    with pytest.raises(TypeError, match="rng: expected a numpy.random.Generator"):
        theory.sample_ball(3, 2, 1.0, 0)


def test_difference_quotient_ignores_pairs_an_ulp_apart():
    """Regression: two points projected onto the sphere 2e-16 apart gave a quotient of 1.54
    (rounding noise over the gap) where the true supremum of ||J|| is 0.98769."""
    rng = np.random.default_rng(100)
    means = theory.sample_ball(8, 1, 1.0, rng)
    variances = rng.uniform(0.1, 0.4, (8, 1))
    variances[0, 0] = 0.1
    weights = rng.dirichlet(np.ones(8))
    est = theory.empirical_lipschitz(means, variances, weights, 2.0, n_points=4000, n_pairs=4000, seed=200)
    # the supremum over the ball [-2, 2], found on a grid of 400001 points
    grid = np.linspace(-2.0, 2.0, 400_001)[:, None]
    sup = float(np.max(theory.jacobian_spectral_norms(grid, means, variances, weights)))
    assert est.difference_quotient <= sup * (1 + 1e-6)
    assert est.jacobian_norm <= sup * (1 + 1e-12)
    # and both estimates come close to it from below (measured: within 2e-7 and 1.2e-5)
    assert est.jacobian_norm >= sup * (1 - 1e-5)
    assert est.difference_quotient >= sup * (1 - 1e-3)
