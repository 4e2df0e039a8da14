"""Worked solutions to lesson 2's exercises; try first.

Every solution is one use of the associativity of section 2: put the
brackets so that only ``N x K`` and ``K x K`` arrays are ever formed.
"""

from __future__ import annotations

import numpy as np

from . import off_by  # near misses: small but real errors

# ---------------------------------------------------------------------------
# 2.1 One row of the attention, without the N x N matrix
# ---------------------------------------------------------------------------


def attention_row(gamma_q, gamma_k, i, eps=1e-6):
    """Row i of D^-1 A: A_ij = gamma^Q_i . gamma^K_j, so the row is Gamma_K gamma^Q_i over gamma^Q_i . Z + eps."""
    g = gamma_q[i]  # (K,)
    z = gamma_k.sum(axis=0)  # (K,): the slot masses
    return (gamma_k @ g) / (g @ z + eps)  # (N_k,): O(N K), no N x N matrix


# ---------------------------------------------------------------------------
# 2.2 Slot means and mixing weights
# ---------------------------------------------------------------------------


def slots_and_weights(gamma_q, gamma_k, v, eps=1e-6):
    """(W, M): m_k = V~_k / Z_k, w_ik = gamma^Q_ik Z_k / (gamma^Q_i . Z + eps); then W M = GMA's output."""
    z = gamma_k.sum(axis=0)  # (K,)
    M = (gamma_k.T @ v) / z[:, None]  # (K, d_v): each slot's weighted average of the values
    weighted = gamma_q * z  # (N_q, K)
    W = weighted / (weighted.sum(axis=1, keepdims=True) + eps)
    return W, M


# ---------------------------------------------------------------------------
# 2.3 The isotropic router is linear
# ---------------------------------------------------------------------------


def isotropic_router(means, variance, weights):
    """l_k(x) = x . mu_k / s^2 + log pi_k - ||mu_k||^2 / (2 s^2) + (terms common to all k): R = mu^T / s^2."""
    R = means.T / variance  # (d, K)
    b = np.log(weights) - np.sum(means * means, axis=1) / (2 * variance)  # (K,)
    return R, b


# ---------------------------------------------------------------------------
# 2.4 The size of A without forming it
# ---------------------------------------------------------------------------


def affinity_norm(gamma_q, gamma_k):
    """||A||_F^2 = tr(Gamma_K Gamma_Q^T Gamma_Q Gamma_K^T) = tr((Gamma_Q^T Gamma_Q)(Gamma_K^T Gamma_K)).

    Both Gram matrices are K x K and symmetric, so the trace of their product
    is the sum of their elementwise product: O(N K^2) time, O(K^2) memory.
    """
    gram_q = gamma_q.T @ gamma_q  # (K, K)
    gram_k = gamma_k.T @ gamma_k  # (K, K)
    return float(np.sqrt(np.sum(gram_q * gram_k)))


SOLUTIONS = {
    "2.1": attention_row,
    "2.2": slots_and_weights,
    "2.3": isotropic_router,
    "2.4": affinity_norm,
}


# ---------------------------------------------------------------------------
# Near misses: plausible wrong answers that the checks must catch
# ---------------------------------------------------------------------------


def _row_without_guard(gamma_q, gamma_k, i, eps=1e-6):
    g = gamma_q[i]
    return (gamma_k @ g) / (g @ gamma_k.sum(axis=0))


def _row_from_dense(gamma_q, gamma_k, i, eps=1e-6):
    a = gamma_q @ gamma_k.T  # right values, but the N x N matrix it was meant to avoid
    return a[i] / (a[i].sum() + eps)


def _row_normalised_by_query_mass(gamma_q, gamma_k, i, eps=1e-6):
    g = gamma_q[i]
    return (gamma_k @ g) / (g.sum() + eps)  # Z forgotten: divides by sum_k gamma_ik = 1


def _slots_not_divided(gamma_q, gamma_k, v, eps=1e-6):
    a = gamma_q / (gamma_q @ gamma_k.sum(axis=0) + eps)[:, None]
    return a, gamma_k.T @ v  # W M is still the output, but M are the slot sums, not their means


def _weights_without_guard(gamma_q, gamma_k, v, eps=1e-6):
    z = gamma_k.sum(axis=0)
    weighted = gamma_q * z
    return weighted / weighted.sum(axis=1, keepdims=True), (gamma_k.T @ v) / z[:, None]


def _slot_masses_from_queries(gamma_q, gamma_k, v, eps=1e-6):
    z = gamma_q.sum(axis=0)  # the queries' masses where the keys' belong
    weighted = gamma_q * z
    return weighted / (weighted.sum(axis=1, keepdims=True) + eps), (gamma_k.T @ v) / z[:, None]


def _router_without_prior(means, variance, weights):
    return means.T / variance, -np.sum(means * means, axis=1) / (2 * variance)


def _router_half_dropped(means, variance, weights):
    return means.T / variance, np.log(weights) - np.sum(means * means, axis=1) / variance


def _router_without_precision(means, variance, weights):
    return means.T, np.log(weights) - np.sum(means * means, axis=1) / (2 * variance)


def _norm_sum_not_trace(gamma_q, gamma_k):
    return float(np.sqrt(np.sum((gamma_q.T @ gamma_q) @ (gamma_k.T @ gamma_k))))  # all entries summed, not the trace


def _norm_bound(gamma_q, gamma_k):
    return float(np.linalg.norm(gamma_q) * np.linalg.norm(gamma_k))  # ||G_Q||_F ||G_K||_F: a bound, not the norm


def _norm_squared(gamma_q, gamma_k):
    return float(np.sum((gamma_q.T @ gamma_q) * (gamma_k.T @ gamma_k)))  # the square root forgotten


def _norm_from_dense(gamma_q, gamma_k):
    return float(np.linalg.norm(gamma_q @ gamma_k.T))  # right value, N x N memory


NEAR_MISSES = {
    "2.1": {
        "the guard eps missing": _row_without_guard,
        "the dense N x N matrix formed": _row_from_dense,
        "normalised by the query's own mass, not gamma_i . Z": _row_normalised_by_query_mass,
        "every value scaled by 1 + 1e-10": off_by(attention_row, 1e-10),
    },
    "2.2": {
        "slot sums, not divided by the slot masses": _slots_not_divided,
        "the guard eps missing": _weights_without_guard,
        "slot masses from the queries": _slot_masses_from_queries,
        "every value scaled by 1 + 1e-11": off_by(slots_and_weights, 1e-11),
    },
    "2.3": {
        "the prior log pi_k missing": _router_without_prior,
        "the norm term's half dropped": _router_half_dropped,
        "R without the precision 1 / s^2": _router_without_precision,
        "R and b scaled by 1 + 1e-10": off_by(isotropic_router, 1e-10),
    },
    "2.4": {
        "all entries summed, not the trace": _norm_sum_not_trace,
        "the bound ||Gamma_Q||_F ||Gamma_K||_F": _norm_bound,
        "the square root forgotten": _norm_squared,
        "the dense N x N matrix formed": _norm_from_dense,
        "every value scaled by 1 + 1e-10": off_by(affinity_norm, 1e-10),
    },
}
