"""Worked solutions to lesson 1's exercises; try first.

Each solution is the lesson's argument written as code: the per-row maximum
of section 2, the log-joint with the differences formed first, the
counterexample and the error model of section 3.
"""

from __future__ import annotations

import numpy as np

from refimpl import gmm, tuned

from . import off_by  # near misses: small but real errors

U = np.finfo(np.float64).eps  # machine epsilon u


# ---------------------------------------------------------------------------
# 1.1 Log-sum-exp with the per-row maximum
# ---------------------------------------------------------------------------


def logsumexp_rows(a):
    """``log sum_k exp(a_ik)`` for each row: shift by the row's own maximum, so the largest term is exp(0) = 1."""
    m = np.max(a, axis=1, keepdims=True)
    return m[:, 0] + np.log(np.sum(np.exp(a - m), axis=1))


# ---------------------------------------------------------------------------
# 1.2 Responsibilities that never overflow
# ---------------------------------------------------------------------------


def stable_responsibilities(x, means, variances, weights):
    """The posterior from the log-joint l_ik, normalised by the per-row log-sum-exp; never a raw density."""
    diff = x[:, None, :] - means[None, :, :]  # (N, K, d): the differences first, no cancellation
    log_joint = np.log(weights) - 0.5 * np.sum(np.log(2 * np.pi * variances) + diff**2 / variances, axis=2)
    return np.exp(log_joint - logsumexp_rows(log_joint)[:, None])


# ---------------------------------------------------------------------------
# 1.3 Build the spread-means failure case
# ---------------------------------------------------------------------------


def _spread_failure_case():
    """A close pair far from the mean of the means: its points are ~1e4 from the centre, their distances q ~ 25.

    The centre sits between the pair (near 1e4 * 1) and the third mean
    (at -1e4 * 1), so the terms of the centred expansion are
    ||x - c||^2 / sigma^2 ~ 1e16 and carry rounding errors of units, while
    the posterior between the two members of the pair is decided by q of
    order 25.
    """
    one = np.ones(3)
    means = np.array([1e4 * one, 1e4 * one + 1e-3 * np.array([1.0, -1.0, 0.0]) / np.sqrt(2), -1e4 * one])
    variances = np.full((3, 3), 1e-8)
    weights = np.full(3, 1 / 3)
    rng = np.random.default_rng(0)
    tau = rng.uniform(-0.25, 1.25, size=(300, 1))  # along the segment between the close pair
    x = means[0] + tau * (means[1] - means[0]) + 1e-4 * rng.normal(size=(300, 3))
    return x, means, variances, weights


spread_failure_case = _spread_failure_case()


# ---------------------------------------------------------------------------
# 1.4 Fix it: choose the entries to recompute
# ---------------------------------------------------------------------------


def entries_to_recompute(x, means, variances, weights):
    """The logits that cancellation may have spoiled (error bound above 2048 u, terms > 16 q) near the row maximum."""
    K, d = means.shape
    p = 1.0 / variances
    centre = means.mean(axis=0)
    xc, mc = x - centre, means - centre
    a = (xc * xc) @ p.T  # (N, K)
    c = np.sum(mc * mc * p, axis=1)  # (K,)
    q_hat = a - 2.0 * (xc @ (mc * p).T) + c  # the centred expansion
    s = (np.sqrt(a) + np.sqrt(c)) ** 2  # the size of its terms
    err = 0.5 * (4 + np.sqrt(d)) * U * s  # a logit carries -q/2: half of the model (4 + sqrt d) u s
    logits = np.log(weights) - 0.5 * np.sum(np.log(2 * np.pi * variances), axis=1) - 0.5 * q_hat
    spoiled = (err > tuned.EXACT_LOGIT_TOL * U) & (s > tuned.CANCELLATION_RATIO * q_hat)
    floor = np.max(logits - err, axis=1, keepdims=True)  # a lower bound on the row's true maximum
    window = np.log(K / (tuned.EXACT_LOGIT_TOL * U))  # entries further below carry < 2048 u / K of the weight
    near = logits + err >= floor - window
    return spoiled & near


SOLUTIONS = {
    "1.1": logsumexp_rows,
    "1.2": stable_responsibilities,
    "1.3": spread_failure_case,
    "1.4": entries_to_recompute,
}


# ---------------------------------------------------------------------------
# Near misses: plausible wrong answers that the checks must catch
# ---------------------------------------------------------------------------


def _lse_global_max(a):
    m = np.max(a)  # one maximum for the whole array: rows far below it underflow to log 0
    return m + np.log(np.sum(np.exp(a - m), axis=1))


def _lse_no_shift(a):
    return np.log(np.sum(np.exp(a), axis=1))


def _lse_shift_not_added_back(a):
    m = np.max(a, axis=1, keepdims=True)
    return np.log(np.sum(np.exp(a - m), axis=1))


def _naive_responsibilities(x, means, variances, weights):
    diff = x[:, None, :] - means[None, :, :]
    dens = np.prod(np.exp(-0.5 * diff**2 / variances) / np.sqrt(2 * np.pi * variances), axis=2)
    joint = weights * dens
    return joint / joint.sum(axis=1, keepdims=True)


def _responsibilities_without_log_det(x, means, variances, weights):
    diff = x[:, None, :] - means[None, :, :]
    log_joint = np.log(weights) - 0.5 * np.sum(diff**2 / variances, axis=2)  # -1/2 sum log(2 pi sigma^2) dropped
    return np.exp(log_joint - logsumexp_rows(log_joint)[:, None])


def _responsibilities_without_weights(x, means, variances, weights):
    diff = x[:, None, :] - means[None, :, :]
    log_joint = -0.5 * np.sum(np.log(2 * np.pi * variances) + diff**2 / variances, axis=2)
    return np.exp(log_joint - logsumexp_rows(log_joint)[:, None])


def _responsibilities_global_max(x, means, variances, weights):
    diff = x[:, None, :] - means[None, :, :]
    log_joint = np.log(weights) - 0.5 * np.sum(np.log(2 * np.pi * variances) + diff**2 / variances, axis=2)
    e = np.exp(log_joint - log_joint.max())
    return e / e.sum(axis=1, keepdims=True)


def _means_close_together():
    """The lesson's adversarial mixture: all means near 1e4, 1e-4 apart. Uncentred fails; centring fixes it."""
    rng = np.random.default_rng(3)
    centre = 1e4 * np.array([1.0, -1.0, 1.0])
    means = centre + 3e-4 * rng.normal(size=(4, 3))
    variances = 1e-8 * rng.uniform(0.5, 2.0, size=(4, 3))
    weights = rng.dirichlet(np.ones(4))
    x = centre + 3e-4 * rng.normal(size=(200, 3))
    return x, means, variances, weights


def _means_spread_a_little():
    """Pairs only 10 sd apart: spread, but not far enough for the expansion to lose the posterior."""
    rng = np.random.default_rng(1)
    centres = 10.0 * rng.normal(size=(3, 3))
    direction = rng.normal(size=(3, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    means = np.concatenate([centres - 1.5 * direction, centres + 1.5 * direction])
    x = centres[rng.integers(0, 3, 300)] + rng.normal(size=(300, 3))
    return x, means, rng.uniform(0.5, 2.0, size=(6, 3)), np.full(6, 1 / 6)


def _points_far_from_everything():
    """Points 1e8 from every mean: the expansion's errors are huge but so are the gaps; the posterior is one-hot."""
    means = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0]])
    x = np.array([[1e8, 1.0], [1e8, -2.0], [-5.0, 1e8]])
    return x, means, np.ones((3, 2)), np.full(3, 1 / 3)


def _recompute_nothing(x, means, variances, weights):
    return np.zeros((len(x), len(weights)), dtype=bool)


def _recompute_everything(x, means, variances, weights):
    return np.ones((len(x), len(weights)), dtype=bool)


def _recompute_without_window(x, means, variances, weights):
    K, d = means.shape
    p = 1.0 / variances
    centre = means.mean(axis=0)
    xc, mc = x - centre, means - centre
    a = (xc * xc) @ p.T
    c = np.sum(mc * mc * p, axis=1)
    q_hat = a - 2.0 * (xc @ (mc * p).T) + c
    s = (np.sqrt(a) + np.sqrt(c)) ** 2
    err = 0.5 * (4 + np.sqrt(d)) * U * s
    return (err > tuned.EXACT_LOGIT_TOL * U) & (s > tuned.CANCELLATION_RATIO * q_hat)  # every spoiled entry, near or not


def _recompute_by_q(x, means, variances, weights):
    """The error bound taken relative to q, the result, instead of s, the size of the terms: nothing is ever flagged."""
    K, d = means.shape
    p = 1.0 / variances
    centre = means.mean(axis=0)
    xc, mc = x - centre, means - centre
    q_hat = (xc * xc) @ p.T - 2.0 * (xc @ (mc * p).T) + np.sum(mc * mc * p, axis=1)
    err = 0.5 * (4 + np.sqrt(d)) * U * np.abs(q_hat)
    return err > tuned.EXACT_LOGIT_TOL * U


NEAR_MISSES = {
    "1.1": {
        "one maximum for the whole array": _lse_global_max,
        "no shift at all, so exp overflows": _lse_no_shift,
        "the shift not added back": _lse_shift_not_added_back,
        "every value scaled by 1 + 1e-11": off_by(logsumexp_rows, 1e-11),
    },
    "1.2": {
        "raw densities that overflow or underflow": _naive_responsibilities,
        "the log-determinant term dropped": _responsibilities_without_log_det,
        "the weights log pi_k dropped": _responsibilities_without_weights,
        "one maximum for the whole array": _responsibilities_global_max,
        "every value scaled by 1 + 1e-10": off_by(stable_responsibilities, 1e-10),
    },
    "1.3": {
        "means close together (centring works)": _means_close_together(),
        "pairs spread only a little": _means_spread_a_little(),
        "points far from every component (a one-hot posterior)": _points_far_from_everything(),
    },
    "1.4": {
        "nothing recomputed": _recompute_nothing,
        "everything recomputed": _recompute_everything,
        "no window around the row maximum": _recompute_without_window,
        "the bound relative to q, not s: the entries near the maximum not flagged": _recompute_by_q,
    },
}
