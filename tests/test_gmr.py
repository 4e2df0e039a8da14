"""Kernel regression and Gaussian mixture regression against softmax attention, scipy and direct formulas."""

import numpy as np
import pytest
from scipy import stats

from refimpl import gmr
from refimpl.attention import softmax_attention
from refimpl.testing import TOL



def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def data(seed, n_q=9, n_k=13, d=4, d_v=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n_q, d)), rng.normal(size=(n_k, d)), rng.normal(size=(n_k, d_v))


# --- kernel regression -------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.5, 2.0, 16.0, 60.0])
def test_kernel_regression_on_unit_vectors_is_softmax_attention(beta):
    q, k, v = data(0)
    q, k = unit(q), unit(k)
    np.testing.assert_allclose(gmr.kernel_regression(q, k, v, beta=beta), softmax_attention(q, k, v, scale=beta), **TOL[np.float64])


def test_kernel_regression_matches_the_direct_formula_off_the_sphere():
    q, k, v = data(1)
    q, k = 3.0 * q, 0.5 * k
    beta = 0.7
    ref = np.empty((len(q), v.shape[1]))
    for i in range(len(q)):
        w = np.array([np.exp(-0.5 * beta * np.sum((q[i] - kj) ** 2)) for kj in k])
        ref[i] = w @ v / w.sum()
    np.testing.assert_allclose(gmr.kernel_regression(q, k, v, beta=beta), ref, **TOL[np.float64])
    # off the unit sphere the ||k||^2 term does not cancel: no longer softmax attention
    assert not np.allclose(gmr.kernel_regression(q, k, v, beta=beta), softmax_attention(q, k, v, scale=beta))


def test_kernel_regression_far_apart_points_does_not_underflow():
    """Every kernel value is exp(-huge); the per-row max keeps the weights well defined."""
    q = np.array([[1e3, 0.0]])
    k = np.array([[0.0, 0.0], [1.0, 0.0]])
    v = np.array([[0.0], [1.0]])
    np.testing.assert_allclose(gmr.kernel_regression(q, k, v, beta=1.0), [[1.0]])


def test_kernel_regression_row_blocks_give_the_same_result(monkeypatch):
    q, k, v = data(2, n_q=30)
    full = gmr.kernel_regression(q, k, v, beta=1.3)
    monkeypatch.setattr(gmr, "_BLOCK_ELEMENTS", 7)  # one query row per block
    np.testing.assert_array_equal(gmr.kernel_regression(q, k, v, beta=1.3), full)


def test_kernel_regression_float32():
    q, k, v = (a.astype(np.float32) for a in data(3))
    out = gmr.kernel_regression(q, k, v, beta=2.0)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, gmr.kernel_regression(*(a.astype(np.float64) for a in (q, k, v)), beta=2.0), **TOL[np.float32])


# --- GMR -----------------------------------------------------------------------------------


def direct_gmr(q, mk, mv, w, beta):
    cov = np.eye(mk.shape[1]) / beta
    dens = np.stack([w[n] * stats.multivariate_normal(mk[n], cov).pdf(q) for n in range(len(w))], axis=1)
    return (dens / dens.sum(axis=1, keepdims=True)) @ mv


def test_gmr_predict_matches_scipy_densities():
    rng = np.random.default_rng(4)
    q, mk, mv = rng.normal(size=(20, 3)), rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    w = rng.dirichlet(np.ones(5))
    np.testing.assert_allclose(gmr.gmr_predict(q, mk, mv, w, beta=1.5), direct_gmr(q, mk, mv, w, 1.5), **TOL[np.float64])


def test_ovq_readout_is_gmr_when_centroids_have_equal_norms():
    rng = np.random.default_rng(5)
    q, mk, mv = unit(rng.normal(size=(15, 4))), 0.8 * unit(rng.normal(size=(6, 4))), rng.normal(size=(6, 3))
    counts = np.array([1, 4, 9, 2, 30, 5])
    ovq_out = gmr.ovq_readout(q, mk, mv, counts, beta=3.0)
    np.testing.assert_allclose(ovq_out, gmr.gmr_predict(q, mk, mv, counts / counts.sum(), beta=3.0), **TOL[np.float64])
    np.testing.assert_allclose(gmr.readout_gap(q, mk, mv, counts, beta=3.0), 0.0, atol=1e-13)


def test_gmr_keeps_the_norm_term_and_the_gap_respects_its_bound():
    rng = np.random.default_rng(6)
    q = unit(rng.normal(size=(200, 4)))
    mk = unit(rng.normal(size=(8, 4))) * rng.uniform(0.2, 1.0, size=(8, 1))  # means of unit vectors: norm < 1
    mv = rng.normal(size=(8, 3))
    counts = rng.integers(1, 20, size=8)
    for beta in (1.0, 4.0, 16.0):
        gap = gmr.readout_gap(q, mk, mv, counts, beta=beta)
        bound = gmr.readout_gap_bound(mk, mv, beta=beta)
        assert np.max(np.abs(gap)) > 1e-3  # the dropped term matters
        assert np.all(np.abs(gap) <= bound)
        # restoring the term in the weights makes GMR equal the read-out again
        w = counts * np.exp(0.5 * beta * np.sum(mk * mk, axis=1))
        np.testing.assert_allclose(gmr.ovq_readout(q, mk, mv, counts, beta=beta), gmr.gmr_predict(q, mk, mv, w / w.sum(), beta=beta), **TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gap_bound_is_attained(dtype):
    """mu^k = [[1, 0], [0, 0]], beta = 2, c = [e^(1/2), 1], q = 0, mu^v = [[1], [0]].

    The dropped term is delta = -(beta/2)||mu^k||^2 = [-1, 0], so r = 1.  At q = 0 the
    OVQ logits are log c = [1/2, 0] and the GMR logits log c + delta = [-1/2, 0]: the
    weights of component 0 are sigmoid(1/2) and sigmoid(-1/2), and the gap
    sigmoid(1/2) - sigmoid(-1/2) = tanh(1/4) = tanh(r / 4) times the value range 1.
    """
    key_means, value_means = np.array([[1.0, 0.0], [0.0, 0.0]], dtype), np.array([[1.0], [0.0]], dtype)
    counts, q = np.array([np.exp(0.5), 1.0], dtype), np.zeros((1, 2), dtype)
    bound = gmr.readout_gap_bound(key_means, value_means, beta=2.0)
    gap = gmr.readout_gap(q, key_means, value_means, counts, beta=2.0)
    rtol = 1e-14 if dtype == np.float64 else 1e-6  # a few ulps of sigmoid(1/2) differenced to 0.245
    np.testing.assert_allclose(bound, [np.tanh(0.25)], rtol=rtol)
    np.testing.assert_allclose(gap[0], bound, rtol=rtol)
    np.testing.assert_allclose(gap[0], [1 / (1 + np.exp(-0.5)) - 1 / (1 + np.exp(0.5))], rtol=rtol)
    # the bound scales with the value range and is attained coordinate by coordinate
    wide = np.array([[3.0, -2.0], [1.0, 5.0]], dtype)
    gap_wide = gmr.readout_gap(q, key_means, wide, counts, beta=2.0)[0]
    np.testing.assert_allclose(np.abs(gap_wide), gmr.readout_gap_bound(key_means, wide, beta=2.0), rtol=rtol)


def test_count_bias_switch_of_the_readout():
    rng = np.random.default_rng(7)
    q, mk, mv = unit(rng.normal(size=(5, 3))), unit(rng.normal(size=(4, 3))), rng.normal(size=(4, 2))
    no_bias = gmr.ovq_readout(q, mk, mv, np.array([1, 2, 3, 40]), beta=2.0, count_bias=False)
    np.testing.assert_allclose(no_bias, gmr.ovq_readout(q, mk, mv, np.ones(4), beta=2.0), **TOL[np.float64])


def test_gmr_float32_and_zero_weight_component():
    rng = np.random.default_rng(8)
    q, mk, mv = rng.normal(size=(6, 3)), rng.normal(size=(3, 3)), rng.normal(size=(3, 2))
    w = np.array([0.5, 0.5, 0.0])
    out = gmr.gmr_predict(q, mk, mv, w, beta=2.0)
    np.testing.assert_allclose(out, gmr.gmr_predict(q, mk[:2], mv[:2], w[:2], beta=2.0), **TOL[np.float64])
    out32 = gmr.gmr_predict(*(a.astype(np.float32) for a in (q, mk, mv, w)), beta=2.0)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, out, **TOL[np.float32])


# --- joint GMM fit -------------------------------------------------------------------------


def clustered(seed, T=600):
    rng = np.random.default_rng(seed)
    centres_k = np.array([[4.0, 0.0], [-4.0, 0.0], [0.0, 5.0]])
    centres_v = np.array([[1.0], [-2.0], [3.0]])
    z = rng.integers(0, 3, size=T)
    return centres_k[z] + 0.3 * rng.normal(size=(T, 2)), centres_v[z] + 0.1 * rng.normal(size=(T, 1)), centres_k, centres_v


def test_fit_joint_gmm_increases_the_likelihood_and_finds_the_clusters():
    k, v, ck, cv = clustered(9)
    fit = gmr.fit_joint_gmm(k, v, 3, n_iter=40, seed=1)
    assert np.all(np.diff(fit.log_likelihood) >= -1e-12)
    order = [int(np.argmin(np.linalg.norm(fit.key_means - c, axis=1))) for c in ck]
    assert sorted(order) == [0, 1, 2]
    np.testing.assert_allclose(fit.key_means[order], ck, atol=0.1)
    np.testing.assert_allclose(fit.value_means[order], cv, atol=0.05)
    np.testing.assert_allclose(fit.weights.sum(), 1.0, rtol=1e-14)
    # regression: the conditional mean at each key centre is that cluster's value
    np.testing.assert_allclose(gmr.joint_gmm_predict(ck, fit), cv, atol=0.05)


def test_joint_gmm_predict_matches_scipy_diagonal_densities():
    k, v, _, _ = clustered(10, T=200)
    fit = gmr.fit_joint_gmm(k, v, 3, n_iter=5)
    q = np.random.default_rng(0).normal(size=(10, 2)) * 3
    dens = np.stack(
        [fit.weights[n] * stats.multivariate_normal(fit.key_means[n], np.diag(fit.key_variances[n])).pdf(q) for n in range(3)], axis=1
    )
    ref = (dens / dens.sum(axis=1, keepdims=True)) @ fit.value_means
    np.testing.assert_allclose(gmr.joint_gmm_predict(q, fit), ref, rtol=1e-10)


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda q, k, v: gmr.kernel_regression(q, k, v, beta=0.0), ValueError, "beta"),
        (lambda q, k, v: gmr.kernel_regression(q, k[:, :2], v, beta=1.0), ValueError, r"k: expected shape \(N_k, d\)"),
        (lambda q, k, v: gmr.kernel_regression(q, k, v[:3], beta=1.0), ValueError, r"v: expected shape \(N_k, d_v\)"),
        (lambda q, k, v: gmr.kernel_regression(q.astype(int), k, v, beta=1.0), TypeError, "q: expected a real floating-point"),
        (lambda q, k, v: gmr.gmr_predict(q, k, v, np.ones(13), beta=1.0), ValueError, "weights: expected weights that sum to 1"),
        (lambda q, k, v: gmr.gmr_predict(q, k, v[:4], np.ones(13) / 13, beta=1.0), ValueError, r"value_means: expected shape \(M, d_v\)"),
        (lambda q, k, v: gmr.ovq_readout(q, k, v, np.zeros(13), beta=1.0), ValueError, "counts: expected strictly positive"),
        (lambda q, k, v: gmr.ovq_readout(q, k, v, np.ones(12), beta=1.0), ValueError, r"counts: expected shape \(M,\)"),
        (lambda q, k, v: gmr.ovq_readout(q, k, v, np.ones(13), beta=1.0, count_bias=None), TypeError, "count_bias"),
        (lambda q, k, v: gmr.fit_joint_gmm(k, v, 14), ValueError, "n_components: expected at most T = 13"),
        (lambda q, k, v: gmr.fit_joint_gmm(k, v, 0), ValueError, "n_components"),
        (lambda q, k, v: gmr.joint_gmm_predict(q, (1, 2)), TypeError, "fit: expected a JointGMM"),
    ],
)
def test_invalid_inputs_are_refused(call, exc, match):
    q, k, v = data(11)
    with pytest.raises(exc, match=match):
        call(q, k, v)
