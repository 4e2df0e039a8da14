"""Worked solutions to lesson 7's exercises; try first.

Each solution follows the lesson's derivation; the comments say which step.
``NEAR_MISSES`` lists plausible wrong answers, each of which the checks in
``tutorials/_exercises_07.py`` must reject.
"""

from __future__ import annotations

import numpy as np

from refimpl import gmm

from . import off_by  # near misses: small but real errors


def _responsibilities(x, means, beta, weights):
    """r_in of the isotropic mixture with covariance I / beta."""
    return gmm.responsibilities(x, means, np.full(means.shape, 1.0 / beta), weights)


# ---------------------------------------------------------------------------
# 7.1 The gradient of the NLL with respect to the means
# ---------------------------------------------------------------------------


def nll_gradient(x, means, beta, weights):
    """-beta (sum_i r_in x_i - N_n mu_n), shape (K, d) (section 1: d logsumexp = softmax = r)."""
    r = _responsibilities(x, means, beta, weights)  # (N, K)
    return -beta * (r.T @ x - r.sum(axis=0)[:, None] * means)


def _gradient_flipped(x, means, beta, weights):
    return -nll_gradient(x, means, beta, weights)  # the gradient of the log-likelihood, not of the NLL


def _gradient_without_beta(x, means, beta, weights):
    return nll_gradient(x, means, beta, weights) / beta  # d l_n / d mu_n = beta (x - mu_n): beta dropped


def _gradient_uniform_prior(x, means, beta, weights):
    return nll_gradient(x, means, beta, np.full(len(weights), 1 / len(weights)))  # responsibilities without pi


# ---------------------------------------------------------------------------
# 7.2 The true Hessian of the NLL
# ---------------------------------------------------------------------------


def nll_hessian(x, means, beta, weights):
    """beta N_n delta_nm I - beta^2 sum_i r_in (delta_nm - r_im)(x_i - mu_n)(x_i - mu_m)^T, (K d, K d) (section 4)."""
    K, d = means.shape
    r = _responsibilities(x, means, beta, weights)
    H = np.zeros((K * d, K * d))
    for n in range(K):
        block_n = slice(n * d, (n + 1) * d)
        H[block_n, block_n] += beta * r[:, n].sum() * np.eye(d)  # the surrogate part
        for m in range(K):
            coef = r[:, n] * ((n == m) - r[:, m])  # d r_in / d mu_m, without its beta (x_i - mu_m)
            H[block_n, m * d:(m + 1) * d] -= beta**2 * (coef[:, None] * (x - means[n])).T @ (x - means[m])
    return H


def _hessian_surrogate_only(x, means, beta, weights):
    r = _responsibilities(x, means, beta, weights)
    return np.kron(np.diag(beta * r.sum(axis=0)), np.eye(means.shape[1]))  # beta N_n I: EM's curvature


def _hessian_plus_missing_information(x, means, beta, weights):
    surrogate = _hessian_surrogate_only(x, means, beta, weights)
    return 2 * surrogate - nll_hessian(x, means, beta, weights)  # adds the missing information instead


def _hessian_beta_not_squared(x, means, beta, weights):
    surrogate = _hessian_surrogate_only(x, means, beta, weights)
    return surrogate + (nll_hessian(x, means, beta, weights) - surrogate) / beta  # beta, not beta^2


def _hessian_coordinate_major(x, means, beta, weights):
    K, d = means.shape
    H = nll_hessian(x, means, beta, weights)
    order = np.arange(K * d).reshape(K, d).T.ravel()  # rows ordered by coordinate, then component
    return H[np.ix_(order, order)]


# ---------------------------------------------------------------------------
# 7.3 The running-mean update
# ---------------------------------------------------------------------------


def running_mean_update(means, counts, x, assign):
    """mu_n' = mu_n + (sum_{S_n} (x_i - mu_n)) / (c_n + |S_n|), c_n' = c_n + |S_n| (section 6).

    The step 1 / (c_n + |S_n|) is the inverse of the surrogate Hessian
    beta (c_n + |S_n|) times beta; rows that receive no point keep their mean.
    """
    K = means.shape[0]
    added = np.bincount(assign, minlength=K)
    new_counts = counts + added
    new_means = means.astype(float).copy()
    for n in np.flatnonzero(added):
        new_means[n] = means[n] + np.sum(x[assign == n] - means[n], axis=0) / new_counts[n]
    return new_means, new_counts


def _running_mean_forgets_past(means, counts, x, assign):
    K = means.shape[0]
    added = np.bincount(assign, minlength=K)
    new_means = means.astype(float).copy()
    for n in np.flatnonzero(added):
        new_means[n] = x[assign == n].mean(axis=0)  # step 1 / |S_n|: the last batch's mean only
    return new_means, counts + added


def _running_mean_old_count(means, counts, x, assign):
    K = means.shape[0]
    added = np.bincount(assign, minlength=K)
    new_means = means.astype(float).copy()
    for n in np.flatnonzero(added):
        new_means[n] = means[n] + np.sum(x[assign == n] - means[n], axis=0) / counts[n]  # 1 / c_n: 1/0 at first
    return new_means, counts + added


def _running_mean_counts_frozen(means, counts, x, assign):
    return running_mean_update(means, counts, x, assign)[0], counts  # forgets to add |S_n|


def _running_mean_all_rows(means, counts, x, assign):
    K = means.shape[0]
    added = np.bincount(assign, minlength=K)
    sums = np.zeros(means.shape)
    np.add.at(sums, assign, x)
    new_counts = counts + added
    return (counts[:, None] * means + sums) / new_counts[:, None], new_counts  # 0 / 0 for untouched empty rows


# ---------------------------------------------------------------------------
# 7.4 A start where true Newton climbs and EM descends
# ---------------------------------------------------------------------------
#
# One broad cluster (standard deviation 2) modelled by two components of
# variance 1 almost on top of each other: the symmetric configuration is a
# saddle of the NLL (two components split the cluster better), so the true
# Hessian has a negative eigenvalue and Newton jumps towards the saddle,
# uphill; EM's surrogate Hessian beta N_n is positive and its step goes down.

_rng = np.random.default_rng(74)
_x_broad = 2.0 * _rng.normal(size=(400, 1))
_x_broad -= _x_broad.mean(axis=0)
saddle_case = (_x_broad, np.array([[0.1], [-0.1]]), np.array([0.5, 0.5]))

_x_two = np.concatenate([_rng.normal(-4, 1, size=(200, 1)), _rng.normal(4, 1, size=(200, 1))])
_separated = (_x_two, np.array([[-3.5], [3.5]]), np.array([0.5, 0.5]))  # near the optimum: H is positive
_exact_saddle = (_x_broad, np.array([[0.0], [0.0]]), np.array([0.5, 0.5]))  # gradient 0: nothing moves
_too_few = (_x_broad[:10], np.array([[0.1], [-0.1]]), np.array([0.5, 0.5]))  # N < 20

SOLUTIONS = {
    "7.1": nll_gradient,
    "7.2": nll_hessian,
    "7.3": running_mean_update,
    "7.4": saddle_case,
}


def _running_mean_step_slightly_off(means, counts, x, assign):
    """Each step (sum (x_i - mu_n)) / (c_n + |S_n|) off by a relative 1e-11: small, but above the check's tolerance."""
    new_means, new_counts = running_mean_update(means, counts, x, assign)
    return means + (new_means - means) * (1 + 1e-11), new_counts


NEAR_MISSES = {
    "7.1": {
        "a flipped sign": _gradient_flipped,
        "beta dropped": _gradient_without_beta,
        "the weights ignored (a uniform prior)": _gradient_uniform_prior,
        "every value scaled by 1 + 1e-10": off_by(nll_gradient, 1e-10),
    },
    "7.2": {
        "EM's surrogate Hessian only": _hessian_surrogate_only,
        "the second term's sign flipped": _hessian_plus_missing_information,
        "beta, not beta^2, in the second term": _hessian_beta_not_squared,
        "coordinate-major order": _hessian_coordinate_major,
        "every value scaled by 1 + 1e-7": off_by(nll_hessian, 1e-7),
    },
    "7.3": {
        "the past forgotten: the last batch's mean": _running_mean_forgets_past,
        "divided by the old count c_n": _running_mean_old_count,
        "the counts frozen": _running_mean_counts_frozen,
        "every row updated, the empty ones too": _running_mean_all_rows,
        "each step scaled by 1 + 1e-11": _running_mean_step_slightly_off,
    },
    "7.4": {
        "means near a separated optimum: the Hessian is positive": _separated,
        "an exact saddle: the gradient is zero": _exact_saddle,
        "too few points (N < 20)": _too_few,
    },
}
