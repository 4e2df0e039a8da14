"""The EM step streamed a block of rows at a time (:func:`refimpl.tuned.streamed_em_step`) against the reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

from refimpl import gmm, tuned
from refimpl.testing import assert_close, exact_log_joint


def _clusters(n=203, K=7, d=5, dtype=np.float64, seed=1):
    """Two clusters of points and a mixture of ``K`` components started at ``K`` of them."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=(n // 2, d)) + 3, rng.normal(size=(n - n // 2, d)) - 2])
    means = x[rng.choice(n, K, replace=False)]
    variances, weights = rng.uniform(0.5, 2.0, (K, d)), rng.dirichlet(np.ones(K))
    return tuple(a.astype(dtype) for a in (x, means, variances, weights))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("K", [1, 7])
@pytest.mark.parametrize("block_rows", [None, 16, 1, 500])  # one block, 16 not dividing 203, one row, more than N
def test_equals_the_reference_em_step(dtype, K, block_rows):
    x, means, variances, weights = _clusters(K=K, dtype=dtype)
    expected = gmm.em_step(x, means, variances, weights, reg_covar=1e-3)
    got = tuned.streamed_em_step(x, means, variances, weights, reg_covar=1e-3, block_rows=block_rows)
    for name, a, b in zip(("means", "variances", "weights"), got, expected):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert_close(a, b, dtype, err_msg=name)


def test_the_numba_kernel_as_e_step_gives_the_same_step():
    cpu_gmm = pytest.importorskip("cpu.gmm")
    x, means, variances, weights = _clusters(K=9)
    expected = gmm.em_step(x, means, variances, weights)
    got = tuned.streamed_em_step(x, means, variances, weights, block_rows=37, posterior=cpu_gmm.posterior)
    for a, b in zip(got, expected):
        assert_close(a, b)


def test_holds_one_block_of_responsibilities_at_a_time():
    """The E-step sees at most ``block_rows`` rows per call: no N x K matrix is formed."""
    x, means, variances, weights = _clusters(n=203, K=4)
    seen = []

    def spy(xb, *rest):
        seen.append(xb.shape[0])
        return tuned.posterior(xb, *rest)

    tuned.streamed_em_step(x, means, variances, weights, block_rows=50, posterior=spy)
    assert max(seen) == 50 and sum(seen) % 203 == 0 and seen[:5] == [50, 50, 50, 50, 3]


@pytest.mark.parametrize("reg_covar", [0.0, 1e-3])
def test_matches_one_sklearn_iteration(reg_covar):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=(40, 3)) + 3, rng.normal(size=(50, 3)) - 2])
    means, variances, weights = x[[0, 45, 80]], rng.uniform(0.5, 2.0, (3, 3)), np.array([0.2, 0.5, 0.3])
    g = GaussianMixture(n_components=3, covariance_type="diag", max_iter=1, reg_covar=reg_covar, weights_init=weights,
                        means_init=means, precisions_init=1.0 / variances)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        g.fit(x)
    m, v, w = tuned.streamed_em_step(x, means, variances, weights, reg_covar=reg_covar, block_rows=32)
    np.testing.assert_allclose(m, g.means_, rtol=1e-11)
    np.testing.assert_allclose(v, g.covariances_, rtol=1e-10)
    np.testing.assert_allclose(w, g.weights_, rtol=1e-12)


def _exact_sums(x, resp, dtype):
    """:func:`refimpl.gmm.m_step`'s definition in long double: ``g_k``, ``N_k = g_k + 10 u``, ``mu_k`` and ``S_k``.

    ``S_k = sum_i r_ik (x_i - mu_k)^2``, so the exact variances are ``S_k / N_k``.
    """
    X, R = np.asarray(x, np.longdouble), np.asarray(resp, np.longdouble)
    g = R.sum(axis=0)
    nk = g + 10 * np.longdouble(np.finfo(dtype).eps)
    mu = (R.T @ X) / nk[:, None]
    return g, nk, mu, np.stack([R[:, k] @ (X - mu[k]) ** 2 for k in range(R.shape[1])])


def _logit_error(calls):
    """The largest error of the float32 or float64 logits in ``calls`` (args and result of ``tuned.log_joint``)
    against long double, over the entries within 40 of their row's maximum (the rest weigh < e^-40 relative)."""
    worst = 0.0
    for (xb, means, variances, log_w), logits in calls:
        exact, _ = exact_log_joint(xb, means, variances, np.exp(log_w.astype(np.float64)))
        near = exact >= exact.max(axis=1, keepdims=True) - 40
        worst = max(worst, float(np.max(np.abs(logits - exact)[near])))
    return worst


@pytest.mark.parametrize("kept_per_row", [tuned.STREAM_KEPT_PER_ROW, 0])  # refined from the kept pairs; by a second pass
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_tight_components_far_from_the_mean_of_the_data_keep_their_variances(dtype, kept_per_row, monkeypatch):
    r"""sum r x^2 - mu sum r x cancels to noise here (terms 1e8 to 1e14 times the result); the refined variances do not.

    The bound, against the definition of :func:`refimpl.gmm.m_step` in long double (its ``10 u`` guard included),
    with ``u`` the unit roundoff of the dtype and ``n = 500`` rows:

    * the clusters are 1e5 of their standard deviations apart, so every responsibility of the first pass is
      exactly 0, 1/2 or 1 (asserted);
    * the refined sums are float64 sums of ``n`` nonnegative terms, each a weight times the rounded square of a
      rounded difference: relative error at most ``(n + 3) u_64``;
    * the second pass (``kept_per_row = 0``) weighs the pairs by ``exp(l - L)``, ``l`` the logits of
      ``tuned.log_joint`` in the dtype: an error ``delta`` of those logits (measured against long double) moves
      every weight, hence the sum of nonnegative terms, by at most ``e^delta - 1`` relative;
    * the result is rounded to the dtype once: ``u``.

    So ``|v - v_exact| <= (u + (n + 3) u_64 + e^delta - 1) v_exact``, whatever order BLAS sums in.
    """
    monkeypatch.setattr(tuned, "STREAM_KEPT_PER_ROW", kept_per_row)
    calls = []
    log_joint = tuned.log_joint

    def spy(*args, **kwargs):  # the second pass's logits, to measure their error
        out = log_joint(*args, **kwargs)
        calls.append((args, out[0]))
        return out

    monkeypatch.setattr(tuned, "log_joint", spy)
    rng = np.random.default_rng(3)
    spread = 1e-4 if dtype == np.float64 else 1e-2
    centres = np.array([[1e3, 1e3], [-1e3, 5e2]])
    x = np.concatenate([centres[0] + spread * rng.normal(size=(300, 2)), centres[1] + spread * rng.normal(size=(200, 2))])
    x = x.astype(dtype)
    n, u, u64 = x.shape[0], np.finfo(dtype).eps / 2, np.finfo(np.float64).eps / 2
    start = (centres.astype(dtype), np.full((2, 2), spread**2, dtype), np.array([0.5, 0.5], dtype))
    # two equal components sharing the first cluster: every responsibility there is 1/2, and none may be left out
    shared = (np.concatenate([start[0][:1], start[0]]), np.full((3, 2), spread**2, dtype), np.full(3, 1 / 3, dtype))
    for params in (start, shared):
        resp = gmm.responsibilities(x, *params)
        assert set(np.unique(resp)) <= {0.0, 0.5, 1.0}
        g, nk, mu, S = _exact_sums(x, resp, dtype)
        calls.clear()
        means, variances, weights = tuned.streamed_em_step(x, *params, block_rows=64)
        assert bool(calls) == (kept_per_row == 0)  # the kept pairs suffice; without them, a second pass
        bound = u + (n + 3) * u64 + np.expm1(_logit_error(calls))
        np.testing.assert_allclose(variances, S / nk[:, None], rtol=bound, atol=0)
        np.testing.assert_allclose(means, mu, rtol=u + n * u64, atol=0)
        # the weights N_k / sum N_k: an addition, two divisions and a sum of K terms in float64, then the dtype's rounding
        np.testing.assert_allclose(weights, nk / nk.sum(), rtol=u + (len(nk) + 3) * u64, atol=0)

        # The reference's float32 variances carry the error of its float32 mean mu' = resp^T x / N_k, whose
        # rounding depends on the order in which BLAS sums.  With delta = mu' - mu, exactly,
        #   sum_i r_i (x_i - mu')^2 = S - 2 delta (N_k - g) mu + g delta^2      (sum_i r_i (x_i - mu) = (N_k - g) mu);
        # its own rounding (difference, square, a dot of n nonnegative terms, the division) is within gamma_{n+3}.
        ref_means, ref_variances, _ = gmm.em_step(x, *params)
        delta = ref_means.astype(np.longdouble) - mu
        predicted = (S - 2 * delta * (nk - g)[:, None] * mu + g[:, None] * delta**2) / nk[:, None]
        gamma = (n + 3) * u / (1 - (n + 3) * u)
        np.testing.assert_allclose(ref_variances, predicted, rtol=gamma, atol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_component_made_only_of_responsibilities_too_small_to_keep_is_refined_by_a_second_pass(dtype):
    """A broad component of tiny weight over a tight cluster far from the data mean: every responsibility of it is
    below the floor of the kept pairs, so their dropped mass is its whole mass and the second pass must refine it."""
    rng = np.random.default_rng(4)
    spread = 1e-4 if dtype == np.float64 else 1e-2
    x = np.concatenate([1e3 + spread * rng.normal(size=(300, 2)), -1e3 + spread * rng.normal(size=(200, 2))]).astype(dtype)
    means = np.array([[1e3, 1e3], [-1e3, -1e3], [1e3, 1e3]], dtype)
    # the first component 10 times broader than its cluster, so that the third one's responsibilities are all alike
    variances = np.array([[100 * spread**2] * 2, [spread**2] * 2, [1.0, 1.0]], dtype)
    tiny = 2e-10 if dtype == np.float64 else 1.2e-5
    weights = np.array([0.5, 0.5 - tiny, tiny], dtype)
    third = tuned.responsibilities(x, means, variances, weights)[:300, 2]
    floor = tuned.EXACT_LOGIT_TOL * np.finfo(dtype).eps / 500
    assert third.max() < floor and third.sum() > 100 * np.finfo(dtype).eps  # all dropped, 10 times the 10 u guard
    # Against the M-step of these responsibilities in long double, not gmm.em_step's float32 variances, which carry the
    # error of its float32 means (an order of summation of BLAS's).  The third's variance is dominated by the shift of
    # its mean by the guard, 10 u mu / N_3 with N_3 ~ 100 u, which magnifies the error of the second pass's weights by
    # about 2 (10 u) |mu| sqrt(g / S) / N_3: that bound is not derived here.  Without the second pass the third's
    # variances are 3.6% off in either dtype; the tolerances hold them to 1e-9 and 1e-5.
    rows = 64
    g, nk, mu, S = _exact_sums(x, tuned.responsibilities(x, means, variances, weights), dtype)
    got = tuned.streamed_em_step(x, means, variances, weights, block_rows=rows)
    np.testing.assert_allclose(got[1], S / nk[:, None], rtol=1e-9 if dtype == np.float64 else 1e-5, atol=0)
    # the weights N_k / sum N_k: g_k summed in the dtype a block of rows at a time (gamma_{rows-1} in each N_k, so twice
    # in their ratio), the blocks and the rest in float64, then rounded to the dtype
    u, u64 = np.finfo(dtype).eps / 2, np.finfo(np.float64).eps / 2
    np.testing.assert_allclose(got[2], nk / nk.sum(), rtol=u + 2 * (rows - 1) * u + (len(nk) + 3) * u64, atol=0)


def test_a_component_with_no_responsibility_stays_finite_as_in_the_reference():
    x, means, variances, weights = _clusters(K=3)
    weights = np.array([0.5, 0.5, 0.0])
    expected = gmm.em_step(x, means, variances, weights, reg_covar=1e-6)
    got = tuned.streamed_em_step(x, means, variances, weights, reg_covar=1e-6, block_rows=40)
    for a, b in zip(got, expected):
        assert np.all(np.isfinite(a))
        assert_close(a, b)


def test_log_likelihood_never_decreases_without_a_regulariser():
    x, means, variances, weights = _clusters(n=400, K=5, d=3, seed=7)
    previous = -np.inf
    for _ in range(8):
        means, variances, weights = tuned.streamed_em_step(x, means, variances, weights, block_rows=64)
        ll = float(np.sum(gmm.log_likelihood(x, means, variances, weights)))
        assert ll >= previous - 1e-9 * abs(ll)
        previous = ll


def test_inputs_are_not_mutated():
    args = _clusters(K=4)
    copies = [a.copy() for a in args]
    tuned.streamed_em_step(*args, block_rows=30)
    for a, b in zip(args, copies):
        np.testing.assert_array_equal(a, b)


def test_errors_are_those_of_the_reference():
    x, means, variances, weights = _clusters(K=3)
    bad = x.copy()
    bad[4, 1] = np.nan
    for args in [(bad, means, variances, weights), (x, means, -variances, weights), (x[:, :2], means, variances, weights),
                 (1e200 * x, 1e-200 * means, 1e-300 * variances, weights)]:
        with pytest.raises(ValueError) as reference:
            gmm.em_step(*args)
        with pytest.raises(ValueError) as streamed:
            tuned.streamed_em_step(*args, block_rows=16)
        assert str(streamed.value) == str(reference.value)
    with pytest.raises(ValueError, match="reg_covar"):
        tuned.streamed_em_step(x, means, variances, weights, reg_covar=-1.0)
    with pytest.raises(ValueError, match="block_rows"):
        tuned.streamed_em_step(x, means, variances, weights, block_rows=0)
    with pytest.raises(TypeError, match="posterior"):
        tuned.streamed_em_step(x, means, variances, weights, posterior="numba")
