"""Worked solutions to lesson 6's exercises; try first.

Each solution follows the lesson's derivation; the comments say which step.
``NEAR_MISSES`` lists plausible wrong answers, each of which the checks in
``tutorials/_exercises_06.py`` must reject.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from . import off_by  # near misses: small but real errors


# ---------------------------------------------------------------------------
# 6.1 Nadaraya-Watson regression that does not overflow
# ---------------------------------------------------------------------------


def _softmax_rows(logits):
    """Row softmax with the row maximum subtracted: exp never overflows, and the largest term is exp(0) = 1."""
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def nadaraya_watson(q, k, v, beta):
    """sum_j softmax_j(-(beta/2)||q - k_j||^2) v_j, shape (N_q, d_v) (section 1)."""
    sq_dist = np.sum((q[:, None, :] - k[None, :, :]) ** 2, axis=2)  # (N_q, N_k), from differences
    return _softmax_rows(-0.5 * beta * sq_dist) @ v


def _nw_unstabilised(q, k, v, beta):
    w = np.exp(-0.5 * beta * np.sum((q[:, None, :] - k[None, :, :]) ** 2, axis=2))
    return (w / w.sum(axis=1, keepdims=True)) @ v  # every kernel value underflows: 0 / 0


def _nw_without_half(q, k, v, beta):
    return _softmax_rows(-beta * np.sum((q[:, None, :] - k[None, :, :]) ** 2, axis=2)) @ v  # variance 1/(2 beta)


def _nw_dot_product_only(q, k, v, beta):
    return _softmax_rows(beta * q @ k.T) @ v  # softmax attention: right only for unit keys


def _nw_wrong_axis(q, k, v, beta):
    logits = -0.5 * beta * np.sum((q[:, None, :] - k[None, :, :]) ** 2, axis=2)
    return _softmax_rows(logits.T).T @ v  # normalises over the queries instead of the keys


# ---------------------------------------------------------------------------
# 6.2 The exact GMR posterior of isotropic components
# ---------------------------------------------------------------------------


def gmr_weights(q, key_means, weights, beta):
    """h(q) = softmax_m(beta q.mu_m - (beta/2)||mu_m||^2 + log pi_m), shape (N_q, K) (section 3).

    The terms -(d/2) log(2 pi / beta) and -(beta/2)||q||^2 are the same for
    every component and cancel in the normalisation; the norm term does not.
    """
    logits = beta * q @ key_means.T - 0.5 * beta * np.sum(key_means**2, axis=1) + np.log(weights)
    return _softmax_rows(logits)


def _gmr_weights_ovq(q, key_means, weights, beta):
    return _softmax_rows(beta * q @ key_means.T + np.log(weights))  # OVQ's logits: the norm term dropped


def _gmr_weights_norm_sign(q, key_means, weights, beta):
    return _softmax_rows(beta * q @ key_means.T + 0.5 * beta * np.sum(key_means**2, axis=1) + np.log(weights))


def _gmr_weights_no_prior(q, key_means, weights, beta):
    return _softmax_rows(beta * q @ key_means.T - 0.5 * beta * np.sum(key_means**2, axis=1))  # forgets log pi


# ---------------------------------------------------------------------------
# 6.3 The bound on what dropping the norm term costs
# ---------------------------------------------------------------------------


def readout_gap_bound(key_means, value_means, beta):
    """tanh(r/4) (max_m mu^v_m - min_m mu^v_m), r = (beta/2)(max ||mu^k||^2 - min ||mu^k||^2) (section 4)."""
    sq_norms = np.sum(key_means**2, axis=1)
    r = 0.5 * beta * (sq_norms.max() - sq_norms.min())  # the range of the dropped logit term
    return np.tanh(r / 4) * np.ptp(value_means, axis=0)  # TV <= tanh(r/4), times the range


def _gap_bound_half(key_means, value_means, beta):
    sq = np.sum(key_means**2, axis=1)
    return np.tanh(0.5 * beta * np.ptp(sq) / 2) * np.ptp(value_means, axis=0)  # tanh(r/2): maximiser P misplaced


def _gap_bound_linear(key_means, value_means, beta):
    sq = np.sum(key_means**2, axis=1)
    return 0.5 * beta * np.ptp(sq) / 4 * np.ptp(value_means, axis=0)  # r/4: valid, but not the tanh bound


def _gap_bound_unsquared(key_means, value_means, beta):
    norms = np.linalg.norm(key_means, axis=1)
    return np.tanh(0.5 * beta * np.ptp(norms) / 4) * np.ptp(value_means, axis=0)  # range of norms, not squares


def _gap_bound_half_range(key_means, value_means, beta):
    return readout_gap_bound(key_means, value_means, beta) / 2  # half the range: the midpoint trick counted twice


# ---------------------------------------------------------------------------
# 6.4 GMR with a key-value cross-covariance
# ---------------------------------------------------------------------------


def _key_posterior(q, weights, means, covariances):
    """h_m(q) from the key marginals N(q; mu^k_m, s_kk,m), stably."""
    s_kk = covariances[:, 0, 0]
    log_h = np.log(weights) - 0.5 * np.log(2 * np.pi * s_kk) - 0.5 * (q[:, None] - means[:, 0]) ** 2 / s_kk
    return special.softmax(log_h, axis=1)


def gmr_full_predict(q, weights, means, covariances):
    """sum_m h_m(q) (mu^v_m + s_vk,m / s_kk,m (q - mu^k_m)), shape (N_q,) (section 5)."""
    h = _key_posterior(q, weights, means, covariances)
    slope = covariances[:, 1, 0] / covariances[:, 0, 0]  # Sigma^vk (Sigma^kk)^{-1}, scalars here
    local_lines = means[:, 1] + slope * (q[:, None] - means[:, 0])  # (N_q, K): one line per component
    return np.sum(h * local_lines, axis=1)


def _full_without_cross_term(q, weights, means, covariances):
    return _key_posterior(q, weights, means, covariances) @ means[:, 1]  # blended constants, as OVQ


def _full_wrong_variance(q, weights, means, covariances):
    h = _key_posterior(q, weights, means, covariances)
    slope = covariances[:, 1, 0] / covariances[:, 1, 1]  # divides by s_vv: the regression of k on v
    return np.sum(h * (means[:, 1] + slope * (q[:, None] - means[:, 0])), axis=1)


def _full_flipped_offset(q, weights, means, covariances):
    h = _key_posterior(q, weights, means, covariances)
    slope = covariances[:, 1, 0] / covariances[:, 0, 0]
    return np.sum(h * (means[:, 1] + slope * (means[:, 0] - q[:, None])), axis=1)  # mu^k - q: sign flipped


SOLUTIONS = {
    "6.1": nadaraya_watson,
    "6.2": gmr_weights,
    "6.3": readout_gap_bound,
    "6.4": gmr_full_predict,
}

NEAR_MISSES = {
    "6.1": {
        "no row maximum subtracted: 0 / 0": _nw_unstabilised,
        "the half dropped in the exponent": _nw_without_half,
        "dot products only: the norm term dropped": _nw_dot_product_only,
        "normalised along the wrong axis (the queries)": _nw_wrong_axis,
        "every value scaled by 1 + 1e-10": off_by(nadaraya_watson, 1e-10),
    },
    "6.2": {
        "the norm term dropped (OVQ's logits)": _gmr_weights_ovq,
        "the norm term with a flipped sign": _gmr_weights_norm_sign,
        "the prior log pi missing": _gmr_weights_no_prior,
        "every value scaled by 1 + 1e-10": off_by(gmr_weights, 1e-10),
    },
    "6.3": {
        "tanh(r/2), not tanh(r/4)": _gap_bound_half,
        "r/4 without the tanh": _gap_bound_linear,
        "the range of the norms, not of their squares": _gap_bound_unsquared,
        "half the range: a missing factor 2": _gap_bound_half_range,
        "every value scaled by 1 + 1e-11": off_by(readout_gap_bound, 1e-11),
    },
    "6.4": {
        "the cross-covariance term dropped": _full_without_cross_term,
        "a wrong slope: divided by s_vv": _full_wrong_variance,
        "the slope's sign flipped (mu^k - q)": _full_flipped_offset,
        "every value scaled by 1 + 1e-8": off_by(gmr_full_predict, 1e-8),
    },
}
