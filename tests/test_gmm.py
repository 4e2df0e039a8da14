"""refimpl.gmm against scikit-learn, scipy and direct evaluation; adversarial inputs; dtypes; awkward shapes."""

import warnings

import numpy as np
import pytest
from scipy import special
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

from refimpl import gmm
from refimpl.testing import TOL, direct_log_joint, random_gmm, sklearn_gmm


# --- independent implementations -------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_responsibilities_match_sklearn_predict_proba(seed):
    x, means, variances, weights = random_gmm(seed, N=80, K=5, d=4)
    ref = sklearn_gmm(means, variances, weights).predict_proba(x)
    np.testing.assert_allclose(gmm.responsibilities(x, means, variances, weights), ref, rtol=1e-12, atol=1e-14)


def test_log_likelihood_matches_sklearn_score_samples():
    x, means, variances, weights = random_gmm(11, N=60, K=3, d=2)
    ref = sklearn_gmm(means, variances, weights).score_samples(x)
    np.testing.assert_allclose(gmm.log_likelihood(x, means, variances, weights), ref, rtol=1e-12)


def test_log_gaussian_diag_matches_scipy():
    x, means, variances, _ = random_gmm(3, N=40, K=6, d=5)
    ref = direct_log_joint(x, means, variances, np.ones(6))
    np.testing.assert_allclose(gmm.log_gaussian_diag(x, means, variances), ref, rtol=1e-12)


@pytest.mark.parametrize("reg_covar", [0.0, 1e-3])
def test_em_step_matches_one_sklearn_iteration(reg_covar):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=(40, 3)) + 3, rng.normal(size=(50, 3)) - 2])
    _, means, variances, weights = random_gmm(6, K=3, d=3)
    g = GaussianMixture(
        n_components=3,
        covariance_type="diag",
        max_iter=1,
        reg_covar=reg_covar,
        weights_init=weights,
        means_init=means,
        precisions_init=1.0 / variances,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        g.fit(x)
    m, v, w = gmm.em_step(x, means, variances, weights, reg_covar=reg_covar)
    np.testing.assert_allclose(m, g.means_, rtol=1e-11)
    np.testing.assert_allclose(v, g.covariances_, rtol=1e-10)
    np.testing.assert_allclose(w, g.weights_, rtol=1e-12)


def test_logsumexp_matches_scipy_including_all_minus_inf_rows():
    a = np.array([[0.0, -np.inf, 3.0], [-np.inf, -np.inf, -np.inf], [1e308, 1e308, -1e308], [-1e308, -1e308, -1e308]])
    with np.errstate(over="ignore"):  # scipy's own -1e308 - 1e308 overflows harmlessly to -inf
        ref_lse, ref_sm = special.logsumexp(a, axis=1), special.softmax(a[[0, 2, 3]], axis=1)
    np.testing.assert_array_equal(gmm.logsumexp(a, axis=1), ref_lse)
    np.testing.assert_allclose(gmm.softmax(a[[0, 2, 3]], axis=1), ref_sm, rtol=1e-15)


def test_softplus_and_inverse_round_trip():
    s = np.array([-50.0, -5.0, -1e-3, 0.0, 1e-3, 2.0, 40.0, 800.0])
    y = gmm.softplus(s)
    np.testing.assert_allclose(y[s < 30], np.log1p(np.exp(s[s < 30])), rtol=1e-14)
    np.testing.assert_allclose(y[s >= 30], s[s >= 30], rtol=1e-14)  # log(1 + e^s) = s + log(1 + e^-s)
    assert np.all(np.isfinite(y)) and np.all(y > 0)
    np.testing.assert_allclose(gmm.softplus_inverse(y), s, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="positive"):
        gmm.softplus_inverse(np.array([0.0]))


def test_softplus_derivative_is_sigmoid():
    s = np.linspace(-8, 8, 33)
    h = 1e-6
    fd = (gmm.softplus(s + h) - gmm.softplus(s - h)) / (2 * h)
    np.testing.assert_allclose(gmm.sigmoid(s), fd, rtol=1e-8)


def test_reparameterisation():
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(3, 4)) * 5
    v = gmm.variances_from_raw(raw, min_variance=1e-3)
    assert np.all(v >= 1e-3)
    np.testing.assert_allclose(gmm.raw_from_variances(v, min_variance=1e-3), raw, rtol=1e-10, atol=1e-10)
    w = gmm.weights_from_logits(np.array([1000.0, 0.0, -1000.0]))
    np.testing.assert_allclose(w, [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="min_variance"):
        gmm.raw_from_variances(np.array([1e-4]), min_variance=1e-3)


# --- adversarial inputs ----------------------------------------------------------


def test_stability_far_from_origin_with_tiny_variances():
    """|x| ~ 1e4 and variances ~ 1e-8: the naive expansion x^2/s loses every digit."""
    rng = np.random.default_rng(0)
    centre = np.array([1e4, -1e4])
    means = centre + 1e-4 * rng.normal(size=(3, 2))
    variances = np.full((3, 2), 1e-8)
    x = centre + 1e-4 * rng.normal(size=(20, 2))
    weights = np.full(3, 1 / 3)
    resp = gmm.responsibilities(x, means, variances, weights)
    direct = special.softmax(
        np.stack([-0.5 * np.sum((x - means[k]) ** 2 / variances[k], axis=1) for k in range(3)], axis=1), axis=1
    )
    assert np.all(np.isfinite(resp))
    np.testing.assert_allclose(resp, direct, atol=1e-12)


def test_point_far_from_every_component_keeps_a_valid_posterior():
    x = np.array([[1e6, -1e6]])
    means = np.array([[0.0, 0.0], [1.0, 1.0], [-1.0, 0.5]])
    variances = np.full((3, 2), 1e-6)
    weights = np.full(3, 1 / 3)
    log_r = gmm.log_responsibilities(x, means, variances, weights)
    resp = np.exp(log_r)
    assert np.all(np.isfinite(log_r))
    np.testing.assert_allclose(resp.sum(1), 1.0, rtol=1e-15)
    # the nearest component along the dominating direction (x = +1e6, y = -1e6) wins
    assert np.argmax(resp) == np.argmax(direct_log_joint(x, means, variances, weights))


def test_zero_weight_component_gets_zero_responsibility():
    x, means, variances, _ = random_gmm(2, K=3)
    resp = gmm.responsibilities(x, means, variances, np.array([0.5, 0.5, 0.0]))
    assert np.all(resp[:, 2] == 0)
    np.testing.assert_allclose(resp.sum(1), 1.0, rtol=1e-15)


def test_em_step_with_an_empty_component_stays_finite():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 2))
    means = np.array([[0.0, 0.0], [1e3, 1e3]])  # second component owns no point
    m, v, w = gmm.em_step(x, means, np.ones((2, 2)), np.array([0.5, 0.5]), reg_covar=1e-6)
    assert np.all(np.isfinite(m)) and np.all(np.isfinite(v)) and np.all(np.isfinite(w))
    np.testing.assert_allclose(w.sum(), 1.0, rtol=0, atol=2 * np.finfo(float).eps)
    # every point belongs to the first component (the second is 1e3 away: responsibility exactly 0),
    # so the first becomes the sample mean and variance, the second sits at 0 / (10 eps) = 0 with
    # variance reg_covar, and its weight is the guard 10 eps / (N + 20 eps)
    eps = np.finfo(float).eps
    np.testing.assert_allclose(m[0], x.mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(v[0], x.var(0) + 1e-6, rtol=1e-12)
    np.testing.assert_array_equal(m[1], 0.0)
    np.testing.assert_array_equal(v[1], 1e-6)
    np.testing.assert_allclose(w, [1 - 10 * eps / 30, 10 * eps / 30], rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 5), (2000, 8), (500, 1)])
def test_em_step_weights_sum_to_one_within_a_few_ulps(dtype, N, K):
    """sum_k pi_k = 1 up to the rounding of the normalising sum and of the K divisions, below K eps.

    Without the renormalisation the 10 eps guard on N_k alone leaves 10 K eps / N
    (80 eps at N = 1, K = 8).
    """
    rng = np.random.default_rng(N + K)
    x = rng.normal(size=(N, 3)) * 3
    means, variances, weights = rng.normal(size=(K, 3)) * 3, rng.uniform(0.1, 2.0, (K, 3)), rng.dirichlet(np.ones(K))
    _, _, w = gmm.em_step(*(a.astype(dtype) for a in (x, means, variances, weights)))
    assert w.dtype == dtype and np.all(w > 0)
    # the float32 weights are summed in float64, where the sum of K <= 8 of them is exact to 1e-16
    assert abs(np.sum(w, dtype=np.float64) - 1.0) <= K * np.finfo(dtype).eps


def test_em_variances_accurate_for_tight_cluster_far_from_origin():
    """The E[x^2] - mu^2 shortcut would cancel to noise here; the centred form does not."""
    rng = np.random.default_rng(3)
    x = 1e6 + 1e-3 * rng.normal(size=(500, 1))
    m, v, _ = gmm.em_step(x, np.array([[1e6]]), np.array([[1e-6]]), np.array([1.0]))
    np.testing.assert_allclose(v[0, 0], np.var(x), rtol=1e-9)


# --- dtypes and shapes -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_follows_input_and_meets_its_tolerance(dtype):
    x, means, variances, weights = random_gmm(4, dtype=dtype)
    ref = random_gmm(4, dtype=np.float64)
    for fn in (gmm.responsibilities, gmm.log_responsibilities, gmm.log_likelihood):
        out = fn(x, means, variances, weights)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, fn(*ref), **TOL[dtype])
    assert gmm.log_gaussian_diag(x, means, variances).dtype == dtype
    for out in gmm.em_step(x, means, variances, weights):
        assert out.dtype == dtype


def test_mixed_dtypes_promote_to_float64():
    x, means, variances, weights = random_gmm(4)
    assert gmm.responsibilities(x.astype(np.float32), means, variances, weights).dtype == np.float64


@pytest.mark.parametrize("N,K,d", [(1, 1, 1), (1, 5, 3), (7, 1, 2), (6, 3, 1), (1, 1, 8)])
def test_awkward_shapes(N, K, d):
    x, means, variances, weights = random_gmm(N * 100 + K * 10 + d, N=N, K=K, d=d)
    resp = gmm.responsibilities(x, means, variances, weights)
    assert resp.shape == (N, K)
    np.testing.assert_allclose(resp, special.softmax(direct_log_joint(x, means, variances, weights), axis=1), atol=1e-13)
    assert gmm.log_likelihood(x, means, variances, weights).shape == (N,)
    m, v, w = gmm.em_step(x, means, variances, weights, reg_covar=1e-6)
    assert m.shape == (K, d) and v.shape == (K, d) and w.shape == (K,)
    if K == 1:
        np.testing.assert_allclose(resp, 1.0)
        np.testing.assert_allclose(m[0], x.mean(0), rtol=1e-12)


def test_inputs_are_not_mutated():
    args = random_gmm(9)
    copies = [a.copy() for a in args]
    gmm.responsibilities(*args)
    gmm.em_step(*args, reg_covar=1e-3)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


# --- isotropic EM = Newton, k-means, running mean ---------------------------------


def test_newton_step_equals_m_step_and_kmeans_is_the_hard_limit():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(200, 2)) + rng.choice([-4.0, 4.0], size=(200, 1))
    means = np.array([[-3.0, -3.0], [3.0, 3.0], [0.0, 5.0]])
    np.testing.assert_allclose(gmm.newton_step(x, means, 2.0), gmm.isotropic_m_step(x, means, 2.0), rtol=1e-13)
    # beta -> infinity: soft responsibilities harden into nearest-centroid assignments
    np.testing.assert_allclose(gmm.isotropic_m_step(x, means, 1e6), gmm.kmeans_step(x, means), rtol=1e-12)


def test_surrogate_hessian_matches_finite_differences_of_surrogate_gradient():
    rng = np.random.default_rng(9)
    x, means, beta = rng.normal(size=(40, 3)), rng.normal(size=(3, 3)), 1.3
    resp = gmm.responsibilities(x, means, np.full((3, 3), 1 / beta), np.full(3, 1 / 3))

    def surrogate_grad(mu):  # gradient of sum_i sum_n r_in beta/2 ||x_i - mu_n||^2, r fixed
        return -beta * (resp.T @ x - resp.sum(0)[:, None] * mu)

    h = 1e-5
    hess = gmm.isotropic_surrogate_hessian(x, means, beta)
    for n in range(3):
        for j in range(3):
            e = np.zeros_like(means)
            e[n, j] = h
            col = (surrogate_grad(means + e) - surrogate_grad(means - e)) / (2 * h)
            expected = np.zeros_like(means)
            expected[n, j] = hess[n]
            np.testing.assert_allclose(col, expected, atol=1e-8)


def test_running_mean_update_is_sparse_and_exact():
    means = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    counts = np.array([2, 0, 5])
    x = np.array([[0.0, 0.0], [2.0, 2.0], [9.0, 9.0]])
    new, c = gmm.running_mean_update(means, counts, x, np.array([0, 0, 1]))
    np.testing.assert_array_equal(c, [4, 1, 5])
    np.testing.assert_allclose(new[0], (2 * means[0] + x[0] + x[1]) / 4)
    np.testing.assert_array_equal(new[1], x[2])  # a row with count 0 becomes the mean of its points
    np.testing.assert_array_equal(new[2], means[2])  # untouched
    np.testing.assert_array_equal(means, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def test_running_mean_update_float32_stays_float32():
    means = np.zeros((2, 3), np.float32)
    new, c = gmm.running_mean_update(means, np.zeros(2, np.int64), np.ones((4, 3), np.float32), np.array([0, 1, 1, 1]))
    assert new.dtype == np.float32
    np.testing.assert_array_equal(new, 1.0)


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.__setitem__(1, a[1][:, :2]), ValueError, r"means: expected shape \(K, d\)"),
        (lambda a: a.__setitem__(2, -a[2]), ValueError, "variances: expected strictly positive"),
        (lambda a: a.__setitem__(3, a[3] * 2), ValueError, "weights: expected weights that sum to 1"),
        (lambda a: a.__setitem__(3, a[3][:-1] / a[3][:-1].sum()), ValueError, r"weights: expected shape \(K,\)"),
        (lambda a: a.__setitem__(0, np.where(a[0] > 0, np.nan, a[0])), ValueError, "x: expected finite values"),
        (lambda a: a.__setitem__(0, a[0].astype(int)), TypeError, "x: expected a real floating-point array"),
        (lambda a: a.__setitem__(1, a[1] + 0j), TypeError, r"means: expected a real floating-point array \(float32 or float64\), got complex"),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "x: expected a 2-D array"),
    ],
)
def test_bad_input_gets_a_clear_error(mutate, exc, match):
    x, means, variances, weights = random_gmm(0)
    args = [x, means, variances, weights]
    mutate(args)
    with pytest.raises(exc, match=match):
        gmm.responsibilities(*args)


def test_bad_scalar_arguments():
    x, means, variances, weights = random_gmm(0)
    with pytest.raises(ValueError, match="reg_covar"):
        gmm.em_step(x, means, variances, weights, reg_covar=-1.0)
    with pytest.raises(ValueError, match="beta"):
        gmm.newton_step(x, means, 0.0)
    with pytest.raises(ValueError, match="assignments: expected indices"):
        gmm.running_mean_update(means, np.zeros(4), x, np.full(len(x), 7))


@pytest.mark.parametrize(
    "call",
    [
        lambda x, m: gmm.isotropic_nll(x, m, 2.0),
        lambda x, m: gmm.isotropic_nll_gradient(x, m, 2.0),
        lambda x, m: gmm.isotropic_surrogate_hessian(x, m, 2.0),
        lambda x, m: gmm.isotropic_m_step(x, m, 2.0),
        lambda x, m: gmm.newton_step(x, m, 2.0),
        lambda x, m: gmm.isotropic_nll(x, m, 2.0, np.zeros(0)),
        lambda x, m: gmm.newton_step(x, m, 2.0, np.zeros(0)),
        lambda x, m: gmm.hard_assignments(x, m),
        lambda x, m: gmm.kmeans_step(x, m),
        lambda x, m: gmm.responsibilities(x, m, np.ones((0, 3)), np.zeros(0)),
        lambda x, m: gmm.log_likelihood(x, m, np.ones((0, 3)), np.zeros(0)),
        lambda x, m: gmm.em_step(x, m, np.ones((0, 3)), np.zeros(0)),
    ],
    ids=["nll", "nll_gradient", "surrogate_hessian", "m_step", "newton_step", "nll_weights", "newton_weights",
         "hard_assignments", "kmeans_step", "responsibilities", "log_likelihood", "em_step"],
)
def test_no_components_is_refused_naming_the_means(call):
    """K = 0 is a ValueError about ``means``, never a ZeroDivisionError or an empty-argmin error."""
    x = np.random.default_rng(0).normal(size=(5, 3))
    with pytest.raises(ValueError, match=r"^means: expected at least one component"):
        call(x, np.zeros((0, 3)))


def test_rows_normalise_when_log_densities_are_huge():
    """Log-joints of order -1e24 with near-ties: lse(l) = max + log K would lose log K to rounding."""
    x = np.array([[1e6, -1e6], [3e5, 2e5]])
    means = np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 1e-3]])
    variances = np.full((3, 2), 1e-6)
    resp = gmm.responsibilities(x, means, variances, np.full(3, 1 / 3))
    np.testing.assert_allclose(resp.sum(1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(resp[:, 0], resp[:, 1], rtol=1e-14)  # identical components tie exactly
    np.testing.assert_allclose(np.exp(gmm.log_softmax(np.array([[-1e16, -1e16, -1e16]]))), 1 / 3, rtol=1e-15)
