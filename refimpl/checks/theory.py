"""Verifications of the theory of Gaussian Mixture Attention (``docs/derivations/gma.md``).

Derivations are checked against finite differences or an independent
computation (their error is reported); bounds are checked on random and
adversarial parameters, and the number reported is the largest ratio
*measured / bound* (a bound holds when it is at most 1; the number also says
how tight the bound is).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog

from .. import attention, gma, gmm, theory
from ..verify import register


def _configs():
    """(means, variances, weights, bound_x): random ones and adversarial ones."""
    rng = np.random.default_rng(100)
    out = []
    for K, d, scale, var_lo in [(4, 2, 1.0, 0.3), (16, 3, 2.0, 0.05), (64, 4, 1.0, 0.5)]:
        out.append((rng.normal(size=(K, d)) * scale, rng.uniform(var_lo, 1.0, size=(K, d)), rng.dirichlet(np.ones(K)), 2.0))
    # adversarial: two components +-B on one axis at the variance floor, inputs on the segment between them
    out.append((np.array([[1.0, 0.0], [-1.0, 0.0]]), np.full((2, 2), 0.05), np.array([0.5, 0.5]), 1.0))
    # adversarial: the same pair with a tiny input ball, where ||J||_2 -> R / sqrt(2) (module docstring of theory)
    out.append((np.array([[1.0, 0.0], [-1.0, 0.0]]), np.full((2, 2), 0.05), np.array([0.5, 0.5]), 0.01))
    # adversarial: many components packed closely, tiny variances, means on the sphere of the ball
    K, d = 32, 2
    angles = np.linspace(0, 2 * np.pi, K, endpoint=False)
    out.append((np.stack([np.cos(angles), np.sin(angles)], 1), np.full((K, d), 0.01), np.full(K, 1 / K), 1.0))
    # adversarial: one dominant weight and one nearly unused component, unequal variances per axis
    out.append((np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 3.0, 0.0]]), np.array([[0.02, 1.0, 1.0], [1.0, 0.02, 1.0], [1.0, 1.0, 0.02]]), np.array([0.98, 0.019, 0.001]), 3.0))
    return out


@register("theory.responsibility_jacobian_vs_fd", "J = (diag g - g g^T) U == central differences of gamma(x)", tol=1e-8)
def _jacobian():
    worst = 0.0
    rng = np.random.default_rng(101)
    for means, variances, weights, bx in _configs()[:4]:
        x = theory.sample_ball(6, means.shape[1], bx, rng)
        jac = theory.responsibility_jacobian(x, means, variances, weights)
        h = 1e-6
        fd = np.empty_like(jac)
        for j in range(means.shape[1]):
            e = np.zeros(means.shape[1])
            e[j] = h
            plus = gmm.responsibilities(x + e, means, variances, weights)
            minus = gmm.responsibilities(x - e, means, variances, weights)
            fd[:, :, j] = (plus - minus) / (2 * h)
        worst = max(worst, float(np.max(np.abs(jac - fd)) / max(np.max(np.abs(fd)), 1e-12)))
    return worst


def _lipschitz_ratio(which):
    worst = 0.0
    for seed, (means, variances, weights, bx) in enumerate(_configs()):
        bounds = theory.lipschitz_bounds(means, variances, bx)
        emp = theory.empirical_lipschitz(means, variances, weights, bx, n_points=600, n_pairs=600, seed=seed)
        worst = max(worst, max(emp.jacobian_norm, emp.difference_quotient) / getattr(bounds, which))
    return worst


@register(
    "theory.lipschitz_k_free_bound",
    "max ||J||_2 and max ||g(x)-g(x')||/||x-x'|| over sampled points/pairs, divided by R (K-free bound)",
    tol=1.0,
)
def _k_free():
    return _lipschitz_ratio("k_free")


@register(
    "theory.lipschitz_crude_bound",
    "max ||J||_2 and difference quotient over samples, divided by sqrt(K) R / 2 (crude bound)",
    tol=1.0,
)
def _crude():
    return _lipschitz_ratio("crude")


@register(
    "theory.gradient_bounds_per_token",
    "per token: ||dx|| / (range(g) R/2), ||dmu_m|| / (range(g) R/4), |da_m| / (range(g)/4), max ratio",
    tol=1.0,
)
def _gradient_bounds():
    rng = np.random.default_rng(102)
    worst = 0.0
    for means, variances, weights, bx in _configs():
        x = theory.sample_ball(40, means.shape[1], bx, rng)
        # upstream gradients of mixed scales, including one-hot spikes
        g = rng.normal(size=(40, means.shape[0])) * 10.0 ** rng.uniform(-2, 2, size=(40, 1))
        g[::5] = 0.0
        g[::5, 0] = 1.0
        grads = theory.per_token_gradients(x, means, variances, weights, g)
        gamma = gmm.responsibilities(x, means, variances, weights)
        r = theory.bound_radius(means, variances, bx)
        b = theory.gradient_bounds(gamma, g, r)
        worst = max(
            worst,
            _ratio(np.linalg.norm(grads.x, axis=1), b.x),
            _ratio(grads.means_norm.max(axis=1), b.means),
            _ratio(np.abs(grads.logits).max(axis=1), b.logits),
        )
    return worst


@register(
    "theory.gradient_modulation",
    "max (|dL/da_m| - gamma_m (1 - gamma_m) range(g)) / range(g) per token: unused and saturated slots get ~no gradient",
    tol=1e-13,
)
def _modulation():
    # The bound is attained for K = 2, so a ratio would sit at 1 +- rounding; and for a
    # saturated slot the computed c_m = gamma_m (g_m - gbar) carries a rounding error of
    # order K eps max|g| (from gbar) while the exact value underflows.  Report the
    # violation in units of range(g): with K <= 64 and max|g| / range(g) <= ~3 here,
    # rounding accounts for at most 64 * 2.2e-16 * 3 ~ 4e-14.
    rng = np.random.default_rng(103)
    worst = 0.0
    for means, variances, weights, bx in _configs():
        x = theory.sample_ball(40, means.shape[1], bx, rng)
        g = rng.normal(size=(40, means.shape[0]))
        c = theory.per_token_gradients(x, means, variances, weights, g).logits
        gamma = gmm.responsibilities(x, means, variances, weights)
        bound = theory.gradient_bounds(gamma, g, 1.0).logits_modulated
        worst = max(worst, float(np.max((np.abs(c) - bound) / np.ptp(g, axis=1)[:, None])))
    return max(worst, 0.0)


def _ratio(value, bound):
    """value / bound, with 0 / 0 = 0 (a zero bound demands a zero value) and x / 0 = inf."""
    value, bound = np.asarray(value, dtype=float), np.asarray(bound, dtype=float)
    safe = np.where(bound > 0, bound, 1.0)
    return float(np.max(np.where(bound > 0, value / safe, np.where(value == 0, 0.0, np.inf))))


@register(
    "theory.gradient_bounds_gma_backward",
    "gma_backward's summed means/logits/input gradients divided by the sum of per-token bounds over query and key tokens",
    tol=1.0,
)
def _gma_backward_bounds():
    rng = np.random.default_rng(104)
    worst = 0.0
    for K, d_r, causal in [(3, 2, False), (8, 3, True), (1, 2, False)]:
        n = 24
        x_q, x_k = rng.normal(size=(n, d_r)), rng.normal(size=(n, d_r))
        v = rng.normal(size=(n, 3))
        means, raw = rng.normal(size=(K, d_r)), rng.normal(size=(K, d_r))
        logits = rng.normal(size=K)
        out, cache = gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, chunk_size=5)
        g_up = rng.normal(size=out.shape)
        grads = gma.gma_backward(g_up, cache)
        # the same upstream gradient through the mixing backward gives dL/dgamma per token
        dgamma = attention.feature_attention_backward(g_up, cache.mixing)
        bx = float(max(np.max(np.linalg.norm(x_q, axis=1)), np.max(np.linalg.norm(x_k, axis=1))))
        r = theory.bound_radius(means, cache.variances, bx)
        bq = theory.gradient_bounds(cache.gamma_q, dgamma.phi_q, r)
        bk = theory.gradient_bounds(cache.gamma_k, dgamma.phi_k, r)
        mu_bound = bq.means.sum() + bk.means.sum()
        a_bound = bq.logits.sum() + bk.logits.sum()
        ratios = [
            _ratio(np.max(np.linalg.norm(grads.means, axis=1)), mu_bound),
            _ratio(np.max(np.abs(grads.logits)), a_bound),
            _ratio(np.linalg.norm(grads.x_q, axis=1), bq.x),
            _ratio(np.linalg.norm(grads.x_k, axis=1), bk.x),
        ]
        worst = max(worst, max(ratios))
    return worst


def _responsibility_pair(seed, n_q, n_k, K, d, saturate=False):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(K, d)) * (5.0 if saturate else 1.0)
    variances = rng.uniform(0.05 if saturate else 0.5, 1.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    gq = gmm.responsibilities(rng.normal(size=(n_q, d)) * 2, means, variances, weights)
    gk = gmm.responsibilities(rng.normal(size=(n_k, d)) * 2, means, variances, weights)
    return gq, gk


@register("theory.affinity_rank_at_most_K", "numerical rank of A = Gamma_Q Gamma_K^T minus K (<= 0), N = 40 > K", tol=0.0)
def _rank():
    worst = -np.inf
    for seed, K in enumerate((1, 3, 7)):
        gq, gk = _responsibility_pair(200 + seed, 40, 35, K, 3)
        worst = max(worst, np.linalg.matrix_rank(theory.affinity(gq, gk)) - K)
    return float(max(worst, 0))


@register("theory.affinity_entries_in_unit_interval", "how far entries of A (bidirectional, causal, saturated) leave [0, 1]", tol=0.0)
def _unit_interval():
    worst = 0.0
    for seed, saturate in enumerate((False, True)):
        gq, gk = _responsibility_pair(210 + seed, 30, 30, 6, 2, saturate=saturate)
        for causal in (False, True):
            a = theory.affinity(gq, gk, causal=causal)
            worst = max(worst, float(-np.min(a)), float(np.max(a) - 1.0))
    return max(worst, 0.0)


@register("theory.affinity_is_same_slot_probability", "A_ij == P(z_i = z_j) summed over the diagonal of the joint K x K law", tol=1e-15)
def _enumeration():
    gq, gk = _responsibility_pair(220, 7, 6, 5, 2)
    return float(np.max(np.abs(theory.affinity(gq, gk) - theory.affinity_by_enumeration(gq, gk))))


@register(
    "theory.affinity_monte_carlo",
    "A_ij vs frequency of z_i = z_j in 40000 independent draws (tol = 6 standard errors)",
    tol=6 * 0.5 / np.sqrt(40000),
)
def _monte_carlo():
    gq, gk = _responsibility_pair(230, 5, 4, 4, 2)
    return float(np.max(np.abs(theory.affinity(gq, gk) - theory.affinity_by_sampling(gq, gk, 40000, seed=231))))


@register("theory.affinity_psd_when_queries_equal_keys", "-min eigenvalue / max eigenvalue of A when X_Q = X_K", tol=1e-13)
def _psd():
    worst = 0.0
    for seed, K in enumerate((2, 6, 12)):
        gq, _ = _responsibility_pair(240 + seed, 30, 1, K, 3)
        eig = np.linalg.eigvalsh(theory.affinity(gq, gq))
        worst = max(worst, float(-eig[0] / eig[-1]))
    return max(worst, 0.0)


@register(
    "theory.outputs_are_mixtures_of_slot_means",
    "gma output == mixing_weights @ slot_means (weights >= 0, rows sum <= 1, slot means convex in V)",
    tol=1e-13,
)
def _slot_mixture():
    rng = np.random.default_rng(250)
    gq, gk = _responsibility_pair(251, 20, 25, 5, 3)
    v = rng.normal(size=(25, 4))
    w, m = theory.mixing_weights(gq, gk), theory.slot_means(gk, v)
    out = gma.gma_dense(gq, gk, v)
    err = float(np.max(np.abs(w @ m - out)) / np.max(np.abs(out)))
    err = max(err, float(-np.min(w)), float(np.max(w.sum(1)) - 1.0))
    # the slot means' own weights gamma_jk / Z_k are a convex combination of the values
    coef = gk / gk.sum(0)
    err = max(err, float(np.max(np.abs(coef.T @ v - m))), float(np.max(np.abs(coef.sum(0) - 1))))
    return err


@register(
    "theory.outputs_in_convex_hull",
    "eps = 0: LP feasibility residual of o_i in conv(v_j) (causal: conv(v_j, j <= i)), solved by scipy HiGHS",
    tol=1e-7,
)
def _convex_hull():
    rng = np.random.default_rng(260)
    worst = 0.0
    n, K, d_r, d_v = 12, 4, 2, 2
    x_q, x_k = rng.normal(size=(n, d_r)), rng.normal(size=(n, d_r))
    v = rng.normal(size=(n, d_v))
    means, variances = rng.normal(size=(K, d_r)), rng.uniform(0.5, 1.5, size=(K, d_r))
    weights = rng.dirichlet(np.ones(K))
    for causal in (False, True):
        out = gma.gma(x_q, x_k, v, means, variances, weights, causal=causal, eps=0.0)
        for i in range(n):
            vals = v[: i + 1] if causal else v
            m = len(vals)
            # find lambda >= 0 with sum lambda = 1 and vals^T lambda = o_i
            res = linprog(
                np.zeros(m),
                A_eq=np.vstack([vals.T, np.ones((1, m))]),
                b_eq=np.concatenate([out[i], [1.0]]),
                bounds=[(0, None)] * m,
                method="highs",
            )
            if res.status != 0:
                return float("inf")
            lam = res.x
            worst = max(worst, float(np.max(np.abs(vals.T @ lam - out[i]))), float(-min(np.min(lam), 0.0)))
    return worst


@register(
    "theory.isotropic_router_is_linear_softmax",
    "shared isotropic variance: gamma(x) == softmax(x mu^T / s2 + log pi - ||mu||^2 / (2 s2))",
    tol=1e-13,
)
def _isotropic():
    rng = np.random.default_rng(270)
    x, means = rng.normal(size=(30, 3)) * 2, rng.normal(size=(6, 3))
    weights = rng.dirichlet(np.ones(6))
    resp = gmm.responsibilities(x, means, np.full((6, 3), 0.7), weights)
    return float(np.max(np.abs(gmm.softmax(theory.isotropic_router_logits(x, means, 0.7, weights)) - resp)))
