"""Property-based tests (hypothesis) of the GMM posteriors over shapes and values."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import special, stats

from refimpl import gmm


@st.composite
def gmm_problems(draw, max_abs=1e6, min_var=1e-6, max_var=1e4, dtype=np.float64, max_K=8):
    N = draw(st.integers(1, 12))
    K = draw(st.integers(1, max_K))
    d = draw(st.integers(1, 4))
    finite = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)
    # bounds representable in the target width (1e-6 is not a float32)
    max_abs, min_var, max_var = (float(dtype(v)) for v in (max_abs, min_var, max_var))
    x = draw(hnp.arrays(dtype, (N, d), elements=st.floats(-max_abs, max_abs, width=np.finfo(dtype).bits, **finite)))
    means = draw(hnp.arrays(dtype, (K, d), elements=st.floats(-max_abs, max_abs, width=np.finfo(dtype).bits, **finite)))
    variances = draw(hnp.arrays(dtype, (K, d), elements=st.floats(min_var, max_var, width=np.finfo(dtype).bits, **finite)))
    raw_w = draw(hnp.arrays(np.float64, (K,), elements=st.floats(1e-3, 1.0)))
    weights = (raw_w / raw_w.sum()).astype(dtype)
    return x, means, variances, weights


@given(gmm_problems())
def test_extreme_inputs_give_finite_normalised_posteriors_float64(problem):
    resp = gmm.responsibilities(*problem)
    assert resp.dtype == np.float64
    assert np.all(np.isfinite(resp)) and np.all(resp >= 0) and np.all(resp <= 1)
    np.testing.assert_allclose(resp.sum(axis=1), 1.0, rtol=0, atol=1e-13)
    assert np.all(np.isfinite(gmm.log_likelihood(*problem)))


@given(gmm_problems(dtype=np.float32))
def test_extreme_inputs_give_finite_normalised_posteriors_float32(problem):
    resp = gmm.responsibilities(*problem)
    assert resp.dtype == np.float32
    assert np.all(np.isfinite(resp)) and np.all(resp >= 0)
    np.testing.assert_allclose(resp.sum(axis=1), 1.0, rtol=0, atol=1e-5)


@given(gmm_problems(max_abs=10.0, min_var=0.05, max_var=20.0))
def test_moderate_inputs_match_direct_scipy_evaluation(problem):
    x, means, variances, weights = problem
    direct = np.stack(
        [stats.norm.logpdf(x, means[k], np.sqrt(variances[k])).sum(1) for k in range(len(weights))], axis=1
    ) + np.log(weights)
    np.testing.assert_allclose(gmm.responsibilities(*problem), special.softmax(direct, axis=1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(gmm.log_likelihood(*problem), special.logsumexp(direct, axis=1), rtol=1e-12, atol=1e-12)


@given(gmm_problems(max_abs=10.0, min_var=0.05, max_var=20.0), st.randoms(use_true_random=False))
def test_relabelling_components_permutes_the_posterior(problem, rnd):
    x, means, variances, weights = problem
    perm = np.array(rnd.sample(range(len(weights)), len(weights)))
    resp = gmm.responsibilities(x, means, variances, weights)
    np.testing.assert_allclose(gmm.responsibilities(x, means[perm], variances[perm], weights[perm]), resp[:, perm], atol=1e-13)


def test_many_components_and_a_single_point():
    """K = 4096 components, N = 1 point, variances at the floor: still one valid posterior row."""
    rng = np.random.default_rng(0)
    K, d = 4096, 3
    means = rng.normal(size=(K, d)) * 1e3
    variances = np.full((K, d), 1e-6)
    weights = np.full(K, 1.0 / K)
    x = means[1234:1235] + 1e-4
    resp = gmm.responsibilities(x, means, variances, weights)
    assert resp.shape == (1, K) and np.all(np.isfinite(resp))
    np.testing.assert_allclose(resp.sum(), 1.0, atol=1e-13)
    assert np.argmax(resp) == 1234


@given(gmm_problems())
def test_log_responsibilities_rows_have_log_sum_exp_zero(problem):
    """Rows of log gamma normalise in the log domain too, at |x| up to 1e6 and variances down to 1e-6."""
    log_resp = gmm.log_responsibilities(*problem)
    assert np.all(log_resp <= 0) and np.all(np.isfinite(np.max(log_resp, axis=1)))
    np.testing.assert_allclose(special.logsumexp(log_resp, axis=1), 0.0, rtol=0, atol=1e-13)


@given(gmm_problems(max_abs=10.0, min_var=0.05, max_var=20.0), st.floats(-1e3, 1e3))
def test_a_common_shift_of_points_and_means_leaves_the_posterior_unchanged(problem, shift):
    """(x - mu)^2 does not see a common shift; the centred expansion keeps it so to rounding."""
    x, means, variances, weights = problem
    resp = gmm.responsibilities(x, means, variances, weights)
    shifted = gmm.responsibilities(x + shift, means + shift, variances, weights)
    # Rounding x + shift and mu + shift moves each x_j - mu_kj by at most delta = eps (|shift| + D), D = max|x| + max|mu|,
    # so each log-density moves by at most d D delta / min sigma^2 and each responsibility by at most twice that
    # (|d gamma_k| <= gamma_k (|dl_k| + sum_m gamma_m |dl_m|)); 1e-13 covers the arithmetic, as against scipy above.
    D = np.abs(x).max() + np.abs(means).max()
    delta = np.finfo(float).eps * (abs(shift) + D)
    moved = 2 * x.shape[1] * D * delta / variances.min()
    np.testing.assert_allclose(shifted, resp, rtol=0, atol=1e-13 + moved)
