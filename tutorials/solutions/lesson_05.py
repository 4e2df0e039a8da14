"""Worked solutions to lesson 5's exercises; try first.

Each solution follows the lesson's derivation; the comments say which step.
``NEAR_MISSES`` lists plausible wrong answers, each of which the checks in
``tutorials/_exercises_05.py`` must reject.
"""

from __future__ import annotations

import numpy as np

from refimpl import gmm

from . import off_by  # near misses: small but real errors


# ---------------------------------------------------------------------------
# 5.1 The sharpened Lipschitz bound from the parameters
# ---------------------------------------------------------------------------


def sharp_lipschitz_bound(means, variances, bound_x):
    """R / sqrt(2) with R = (B_x + B_mu) / sigma2_min (section 2)."""
    b_mu = np.max(np.linalg.norm(means, axis=1))  # the farthest mean from the origin
    radius = (bound_x + b_mu) / np.min(variances)  # every ||u_m|| <= R on the ball
    return radius / np.sqrt(2)  # Jv sums to zero: ||Jv||_2 <= ||Jv||_1 / sqrt 2


def _bound_without_sqrt2(means, variances, bound_x):
    return (bound_x + np.max(np.linalg.norm(means, axis=1))) / np.min(variances)  # R itself: valid, not sharp


def _bound_largest_variance(means, variances, bound_x):
    return (bound_x + np.max(np.linalg.norm(means, axis=1))) / np.max(variances) / np.sqrt(2)  # the floor is the min


def _bound_without_bx(means, variances, bound_x):
    return np.max(np.linalg.norm(means, axis=1)) / np.min(variances) / np.sqrt(2)  # forgets how far x can go


# ---------------------------------------------------------------------------
# 5.2 The Jacobian of the responsibilities
# ---------------------------------------------------------------------------


def responsibility_jacobian(x, means, variances, weights):
    """J = (diag gamma - gamma gamma^T) U at one point x (d_r,): shape (K, d_r)."""
    gamma = gmm.responsibilities(x[None, :], means, variances, weights)[0]  # (K,)
    u = (means - x) / variances  # rows u_m = d l_m / dx
    u_bar = gamma @ u  # the gamma-average of the rows
    return gamma[:, None] * (u - u_bar)  # row m: gamma_m (u_m - u_bar)


def _jacobian_without_centering(x, means, variances, weights):
    gamma = gmm.responsibilities(x[None, :], means, variances, weights)[0]
    return gamma[:, None] * ((means - x) / variances)  # diag(gamma) U: forgets the - gamma gamma^T part


def _jacobian_flipped_sign(x, means, variances, weights):
    return -responsibility_jacobian(x, means, variances, weights)  # u_m = (x - mu_m) / sigma^2: wrong sign


def _jacobian_standard_deviations(x, means, variances, weights):
    gamma = gmm.responsibilities(x[None, :], means, variances, weights)[0]
    u = (means - x) / np.sqrt(variances)  # divides by sigma, not sigma^2
    return gamma[:, None] * (u - gamma @ u)


# ---------------------------------------------------------------------------
# 5.3 The crude bound never beats the sharpened one
# ---------------------------------------------------------------------------


def crude_over_sharp(K):
    """(sqrt(K) R / 2) / (R / sqrt 2) = sqrt(K / 2): >= 1 exactly when K >= 2, equal at K = 2."""
    return np.sqrt(np.asarray(K, dtype=float) / 2)


def _crude_over_k_free(K):
    return np.sqrt(np.asarray(K, dtype=float)) / 2  # compares with R, not with the sharpened R / sqrt 2


def _crude_without_sqrt(K):
    return np.asarray(K, dtype=float) / 2  # drops the square root of ||U||_F <= sqrt(K) R


def _sharp_over_crude(K):
    return np.sqrt(2 / np.asarray(K, dtype=float))  # the ratio upside down


# ---------------------------------------------------------------------------
# 5.4 The height of the ridge between two components
# ---------------------------------------------------------------------------


def ridge_jacobian_norm(t, B, var, w1):
    """||J(t e_1)||_2 = sqrt(2) gamma_1 gamma_2 (2B / var) for the two-component mixture at +-B e_1.

    The log odds of component 1 are log(w1 / w2) + 2 B t / var, so gamma_1 is
    their sigmoid.  Row 1 of J is gamma_1 (u_1 - u_bar) = gamma_1 gamma_2 (u_1 - u_2),
    row 2 its negative, and u_1 - u_2 = (mu_1 - mu_2) / var = (2B / var) e_1:
    a rank-one J with two rows of equal length, whose spectral norm is sqrt(2)
    times one row's length.  The maximum, at gamma_1 = gamma_2 = 1/2, is
    B / (sqrt(2) var) whatever the weights: the sharpened bound at B_x = 0.
    """
    t = np.asarray(t, dtype=float)
    log_odds = np.log(w1 / (1 - w1)) + 2 * B * t / var
    g1 = 1 / (1 + np.exp(-log_odds))
    return np.sqrt(2) * g1 * (1 - g1) * 2 * B / var


def _ridge_without_sqrt2(t, B, var, w1):
    return ridge_jacobian_norm(t, B, var, w1) / np.sqrt(2)  # one row's length, not the spectral norm


def _ridge_ignoring_weights(t, B, var, w1):
    return ridge_jacobian_norm(t, B, var, 0.5)  # the weights shift the ridge: log(w1 / w2) in the odds


def _ridge_half_distance(t, B, var, w1):
    t = np.asarray(t, dtype=float)
    g1 = 1 / (1 + np.exp(-(np.log(w1 / (1 - w1)) + B * t / var)))  # B t, not 2 B t, in the log odds
    return np.sqrt(2) * g1 * (1 - g1) * 2 * B / var


SOLUTIONS = {
    "5.1": sharp_lipschitz_bound,
    "5.2": responsibility_jacobian,
    "5.3": crude_over_sharp,
    "5.4": ridge_jacobian_norm,
}

NEAR_MISSES = {
    "5.1": {
        "R itself, without the 1 / sqrt 2": _bound_without_sqrt2,
        "the largest variance, not the floor": _bound_largest_variance,
        "the radius B_x of the ball left out": _bound_without_bx,
        "every value scaled by 1 + 1e-11": off_by(sharp_lipschitz_bound, 1e-11),
    },
    "5.2": {
        "without centring: ubar dropped": _jacobian_without_centering,
        "a flipped sign": _jacobian_flipped_sign,
        "divided by sigma, not sigma^2": _jacobian_standard_deviations,
        "every value scaled by 1 + 1e-8": off_by(responsibility_jacobian, 1e-8),
    },
    "5.3": {
        "compared with R, not R / sqrt 2": _crude_over_k_free,
        "the square root dropped: the ratio squared": _crude_without_sqrt,
        "the ratio upside down (inverted)": _sharp_over_crude,
        "every value scaled by 1 + 1e-11": off_by(crude_over_sharp, 1e-11),
    },
    "5.4": {
        "one row's length, without sqrt 2": _ridge_without_sqrt2,
        "the weights ignored": _ridge_ignoring_weights,
        "half the distance in the log odds": _ridge_half_distance,
        "every value scaled by 1 + 1e-10": off_by(ridge_jacobian_norm, 1e-10),
    },
}
