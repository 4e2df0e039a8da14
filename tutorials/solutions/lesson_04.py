"""Worked solutions to lesson 4's exercises; try first.

The causal backward (4.2, 4.3) follows the lesson's derivation literally:
the quotient rule gives $\\tilde G_t = G_t/\\mathrm{den}_t$ and
$\\delta_t = -G_t\\cdot o_t/\\mathrm{den}_t$; the queries read the prefix sums
$S_t$, $z_t$; the keys and values collect the reverse prefix sums $R_j$,
$r_j$ over $t \\ge j$; the responsibilities step is that of section 3.  The
prefix sums are written with ``cumsum`` for clarity (an ``N x K x d_v``
array: fine here, where ``refimpl`` runs them chunk by chunk).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from . import off_by  # near misses: small but real errors

# ---------------------------------------------------------------------------
# 4.1 The gradient of the guard
# ---------------------------------------------------------------------------


def guard_gradient(G, gamma_q, gamma_k, v, eps):
    """dL/deps = sum_i dL/dden_i = sum_i delta_i, with delta_i = -(G_i . o_i) / den_i.

    ``eps`` enters only through ``den_i = gamma_q_i . Z + eps``, with
    ``d den_i / d eps = 1``: the gradient is the sum of the denominators'
    gradients, which section 1 calls ``delta``.  It is negative when the
    outputs point along ``G``: a larger guard shrinks every output towards 0.
    """
    z = gamma_k.sum(axis=0)
    den = gamma_q @ z + eps
    out = (gamma_q @ (gamma_k.T @ v)) / den[:, None]
    delta = -np.sum(G * out, axis=1) / den
    return float(delta.sum())


def _guard_sign_flipped(G, gamma_q, gamma_k, v, eps):
    """Near miss: +(G_i . o_i) / den_i."""
    return -guard_gradient(G, gamma_q, gamma_k, v, eps)


def _guard_numerator_for_output(G, gamma_q, gamma_k, v, eps):
    """Near miss: -(G_i . n_i) / den_i, the numerator n_i in place of o_i (a factor den_i too many)."""
    z = gamma_k.sum(axis=0)
    den = gamma_q @ z + eps
    n = gamma_q @ (gamma_k.T @ v)
    return float(-np.sum(np.sum(G * n, axis=1) / den))


def _guard_per_query(G, gamma_q, gamma_k, v, eps):
    """Near miss: the per-query delta_i, not their sum."""
    z = gamma_k.sum(axis=0)
    den = gamma_q @ z + eps
    out = (gamma_q @ (gamma_k.T @ v)) / den[:, None]
    return -np.sum(G * out, axis=1) / den


# ---------------------------------------------------------------------------
# 4.2 The causal mixing backward
# ---------------------------------------------------------------------------


def _reverse_cumsum(a):
    """sum over t >= j along axis 0: the reverse prefix sums."""
    return np.cumsum(a[::-1], axis=0)[::-1]


def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):
    """Gradients of L = sum(G * O) through causal mixing: (d_gamma_q, d_gamma_k, d_v).

    Forward: ``S_t = sum_{j<=t} gamma_k_j v_j^T``, ``z_t = sum_{j<=t} gamma_k_j``,
    ``o_t = S_t^T gamma_q_t / (gamma_q_t . z_t + eps)``.
    """
    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)  # S_t, (N, K, d_v)
    z = np.cumsum(gamma_k, axis=0)  # z_t, (N, K)
    den = np.einsum("tk,tk->t", gamma_q, z) + eps
    out = np.einsum("tk,tkd->td", gamma_q, S) / den[:, None]
    # the quotient rule (section 1)
    G_n = G / den[:, None]  # dL/dn_t
    delta = -np.sum(G * out, axis=1) / den  # dL/dden_t
    # queries: token t reads the state after j <= t
    d_gq = np.einsum("tkd,td->tk", S, G_n) + delta[:, None] * z
    # keys and values: key j is in every state S_t, z_t with t >= j
    R = _reverse_cumsum(gamma_q[:, :, None] * G_n[:, None, :])  # R_j = sum_{t>=j} gamma_q_t G~_t^T, (N, K, d_v)
    r = _reverse_cumsum(gamma_q * delta[:, None])  # r_j = sum_{t>=j} gamma_q_t delta_t, (N, K)
    d_gk = np.einsum("jkd,jd->jk", R, v) + r
    d_v = np.einsum("jkd,jk->jd", R, gamma_k)
    return d_gq, d_gk, d_v


def _mixing_bidirectional(G, gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: the bidirectional backward (section 2) applied to a causal forward."""
    v_tilde, z = gamma_k.T @ v, gamma_k.sum(axis=0)
    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)
    zc = np.cumsum(gamma_k, axis=0)
    den = np.einsum("tk,tk->t", gamma_q, zc) + eps
    out = np.einsum("tk,tkd->td", gamma_q, S) / den[:, None]
    G_n, delta = G / den[:, None], -np.sum(G * out, axis=1) / den
    d_vt, d_z = gamma_q.T @ G_n, gamma_q.T @ delta
    return G_n @ v_tilde.T + delta[:, None] * z, v @ d_vt.T + d_z, gamma_k @ d_vt


def _mixing_reverse_exclusive(G, gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: reverse sums over t > j, so key j misses its own query's gradient."""
    d_gq, _, _ = causal_mixing_backward(G, gamma_q, gamma_k, v, eps)
    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)
    z = np.cumsum(gamma_k, axis=0)
    den = np.einsum("tk,tk->t", gamma_q, z) + eps
    out = np.einsum("tk,tkd->td", gamma_q, S) / den[:, None]
    G_n, delta = G / den[:, None], -np.sum(G * out, axis=1) / den
    R = _reverse_cumsum(gamma_q[:, :, None] * G_n[:, None, :]) - gamma_q[:, :, None] * G_n[:, None, :]
    r = _reverse_cumsum(gamma_q * delta[:, None]) - gamma_q * delta[:, None]
    return d_gq, np.einsum("jkd,jd->jk", R, v) + r, np.einsum("jkd,jk->jd", R, gamma_k)


def _mixing_without_denominator_term(G, gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: forgets that den_t depends on gamma too (delta = 0)."""
    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)
    z = np.cumsum(gamma_k, axis=0)
    den = np.einsum("tk,tk->t", gamma_q, z) + eps
    G_n = G / den[:, None]
    R = _reverse_cumsum(gamma_q[:, :, None] * G_n[:, None, :])
    return np.einsum("tkd,td->tk", S, G_n), np.einsum("jkd,jd->jk", R, v), np.einsum("jkd,jk->jd", R, gamma_k)


# ---------------------------------------------------------------------------
# 4.3 The causal GMA backward
# ---------------------------------------------------------------------------


def _responsibility_backward(x, gamma, g, means, variances):
    """Section 3: per-token gradients through gamma(x) = softmax(l(x)), summed over the tokens for the parameters."""
    c = gamma * (g - np.sum(gamma * g, axis=1, keepdims=True))  # dL/dl_m = gamma_m (g_m - gbar)
    diff = x[:, None, :] - means[None, :, :]  # x - mu_m, (N, K, d_r)
    dx = np.einsum("nk,nkd->nd", c, -diff / variances)  # sum_m c_m (mu_m - x) / sigma_m^2
    dmeans = np.einsum("nk,nkd->kd", c, diff / variances)  # sum_n c_m (x - mu_m) / sigma_m^2
    dvar = np.einsum("nk,nkd->kd", c, (diff**2 - variances) / (2 * variances**2))
    return dx, dmeans, dvar, c.sum(axis=0)  # dL/da_m = c_m: the log-softmax term cancels


def causal_gma_backward(G, cache):
    """The six gradients of causal GMA from its GMACache: the causal mixing step, then the responsibilities.

    Returns ``(x_q, x_k, v, means, raw_variances, logits)``, the order of
    ``gma.GMAGrads``.
    """
    d_gq, d_gk, d_v = causal_mixing_backward(G, cache.gamma_q, cache.gamma_k, cache.mixing.v, cache.mixing.eps)
    dx_q, dmu_q, dvar_q, da_q = _responsibility_backward(cache.x_q, cache.gamma_q, d_gq, cache.means, cache.variances)
    dx_k, dmu_k, dvar_k, da_k = _responsibility_backward(cache.x_k, cache.gamma_k, d_gk, cache.means, cache.variances)
    # the parameters are shared by queries and keys: their gradients add up; sigma^2 = softplus(s) + sigma2_min
    d_raw = (dvar_q + dvar_k) * expit(cache.raw_variances)
    return dx_q, dx_k, d_v, dmu_q + dmu_k, d_raw, da_q + da_k


def _gma_backward_bidirectional_mixing(G, cache):
    """Near miss: the bidirectional mixing backward inside an otherwise right assembly."""
    d_gq, d_gk, d_v = _mixing_bidirectional(G, cache.gamma_q, cache.gamma_k, cache.mixing.v, cache.mixing.eps)
    dx_q, dmu_q, dvar_q, da_q = _responsibility_backward(cache.x_q, cache.gamma_q, d_gq, cache.means, cache.variances)
    dx_k, dmu_k, dvar_k, da_k = _responsibility_backward(cache.x_k, cache.gamma_k, d_gk, cache.means, cache.variances)
    return dx_q, dx_k, d_v, dmu_q + dmu_k, (dvar_q + dvar_k) * expit(cache.raw_variances), da_q + da_k


def _gma_backward_no_sigmoid(G, cache):
    """Near miss: returns dL/dsigma^2 for the raw variances (the chain rule through softplus dropped)."""
    grads = list(causal_gma_backward(G, cache))
    grads[4] = grads[4] / expit(cache.raw_variances)
    return tuple(grads)


def _gma_backward_queries_only(G, cache):
    """Near miss: the parameter gradients from the queries only (the keys' share forgotten)."""
    d_gq, d_gk, d_v = causal_mixing_backward(G, cache.gamma_q, cache.gamma_k, cache.mixing.v, cache.mixing.eps)
    dx_q, dmu_q, dvar_q, da_q = _responsibility_backward(cache.x_q, cache.gamma_q, d_gq, cache.means, cache.variances)
    dx_k, _, _, _ = _responsibility_backward(cache.x_k, cache.gamma_k, d_gk, cache.means, cache.variances)
    return dx_q, dx_k, d_v, dmu_q, dvar_q * expit(cache.raw_variances), da_q


def _gma_backward_unweighted_mean(G, cache):
    """Near miss: gbar as the plain mean of g, not the gamma-weighted one."""
    d_gq, d_gk, d_v = causal_mixing_backward(G, cache.gamma_q, cache.gamma_k, cache.mixing.v, cache.mixing.eps)
    out = []
    for x, gam, g in ((cache.x_q, cache.gamma_q, d_gq), (cache.x_k, cache.gamma_k, d_gk)):
        c = gam * (g - g.mean(axis=1, keepdims=True))
        diff = x[:, None, :] - cache.means[None]
        out.append((np.einsum("nk,nkd->nd", c, -diff / cache.variances),
                    np.einsum("nk,nkd->kd", c, diff / cache.variances),
                    np.einsum("nk,nkd->kd", c, (diff**2 - cache.variances) / (2 * cache.variances**2)),
                    c.sum(axis=0)))
    (dx_q, mq, vq, aq), (dx_k, mk, vk, ak) = out
    return dx_q, dx_k, d_v, mq + mk, (vq + vk) * expit(cache.raw_variances), aq + ak


# ---------------------------------------------------------------------------
# 4.4 The input bound is attained
# ---------------------------------------------------------------------------
#
# Section 5 bounds ||dL/dx|| = ||sum_m c_m u_m||, u_m = (mu_m - x) / sigma_m^2,
# by a chain of inequalities; the bound is attained when every link is an
# equality:
#  * the triangle inequality: the vectors c_m u_m all point the same way.
#    With sum_m c_m = 0 the c_m have both signs, so the u_m of the positive
#    and of the negative c_m must point in opposite directions;
#  * ||u_m|| = R: ||mu_m - x|| = ||x|| + ||mu_m|| (mu_m on the far side of
#    the origin from x, at the largest norm) and the variance at the floor.
#    If x != 0 every such u_m points along -x, all the same way, which the
#    first point forbids: so x = 0, and mu_m = +-B e for the two signs;
#  * Cauchy-Schwarz and Popoviciu: |g_m - gbar| the same for every m, and the
#    mass split 1/2, 1/2 between the largest and the smallest g_m:
#    gamma = (1/2, 1/2), which equal weights and equal variances give at x = 0.
# Then c = (1/4, -1/4) range(g), u_1 = -u_2 of norm B / sigma^2 = R, and
# ||dL/dx|| = (1/2) range(g) R exactly.

B, SIGMA2 = 1.5, 0.3
TIGHT_CASE = (
    np.zeros(2),  # x = 0
    np.array([[B, 0.0], [-B, 0.0]]),  # mu_1 = -mu_2, both of norm B
    np.full((2, 2), SIGMA2),  # every variance at the floor
    np.array([0.5, 0.5]),  # equal weights: gamma(x) = (1/2, 1/2)
    np.array([1.0, -1.0]),  # any g with g_1 != g_2
)

NEAR_TIGHT = [
    # x moved off the origin: gamma is no longer (1/2, 1/2) and B_x > 0
    (np.array([0.1, 0.0]),) + TIGHT_CASE[1:],
    # unequal weights: gamma = (0.6, 0.4), c_m smaller than range(g) / 4
    TIGHT_CASE[:3] + (np.array([0.6, 0.4]), TIGHT_CASE[4]),
    # the means at right angles: u_1 and u_2 are not opposite
    (TIGHT_CASE[0], np.array([[B, 0.0], [0.0, B]])) + TIGHT_CASE[2:],
    # one variance above the floor: ||u_m|| < R for that component
    TIGHT_CASE[:2] + (np.array([[SIGMA2, SIGMA2], [2 * SIGMA2, SIGMA2]]),) + TIGHT_CASE[3:],
]


SOLUTIONS = {
    "4.1": guard_gradient,
    "4.2": causal_mixing_backward,
    "4.3": causal_gma_backward,
    "4.4": TIGHT_CASE,
}

NEAR_MISSES = {
    "4.1": {
        "a flipped sign": _guard_sign_flipped,
        "the numerator n_i in place of o_i": _guard_numerator_for_output,
        "the per-query deltas, not summed": _guard_per_query,
        "every value scaled by 1 + 1e-6": off_by(guard_gradient, 1e-6),
    },
    "4.2": {
        "the bidirectional backward": _mixing_bidirectional,
        "reverse sums exclusive of t = j": _mixing_reverse_exclusive,
        "the denominator's term delta dropped": _mixing_without_denominator_term,
        "every value scaled by 1 + 1e-10": off_by(causal_mixing_backward, 1e-10),
    },
    "4.3": {
        "the bidirectional mixing backward": _gma_backward_bidirectional_mixing,
        "no sigmoid: the chain rule through softplus dropped": _gma_backward_no_sigmoid,
        "the keys' share of the parameter gradients forgotten": _gma_backward_queries_only,
        "gbar as the plain mean, not the gamma-weighted one": _gma_backward_unweighted_mean,
        "every value scaled by 1 + 1e-10": off_by(causal_gma_backward, 1e-10),
    },
    "4.4": {
        "x off the origin": NEAR_TIGHT[0],
        "unequal weights: an uneven split of gamma": NEAR_TIGHT[1],
        "the means at right angles: u_m not opposite": NEAR_TIGHT[2],
        "a variance above the floor": NEAR_TIGHT[3],
    },
}
