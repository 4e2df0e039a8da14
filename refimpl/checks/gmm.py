"""Verifications of the GMM primitives (``docs/derivations/gmm_posteriors.md``)."""

from __future__ import annotations

import numpy as np
from scipy import special

from .. import gmm
from ..gradcheck import numerical_gradient, relative_error
from ..testing import direct_log_joint, random_gmm
from ..verify import register


@register(
    "gmm.logsumexp_vs_scipy",
    "log-sum-exp with the row max subtracted == scipy.special.logsumexp at |a| ~ 1e300",
    tol=1e-15,
)
def _logsumexp():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 7)) * 10.0 ** rng.integers(-3, 300, size=(50, 1))
    ours, ref = gmm.logsumexp(a, axis=1), special.logsumexp(a, axis=1)
    return float(np.max(np.abs(ours - ref) / np.maximum(1.0, np.abs(ref))))


@register(
    "gmm.log_density_vs_scipy",
    "log N(x|mu, diag s) by matrix products == scipy.stats.norm.logpdf summed per component",
    tol=1e-12,
)
def _log_density():
    rng = np.random.default_rng(1)
    x, means, variances, weights = random_gmm(rng, 200, 9, 5, var_range=(0.2, 2.0))
    ours = gmm.log_gaussian_diag(x, means, variances)
    ref = direct_log_joint(x, means, variances, np.ones(9))
    return float(np.max(np.abs(ours - ref) / np.maximum(1.0, np.abs(ref))))


@register(
    "gmm.responsibilities_rows_and_direct",
    "responsibility rows sum to 1 and equal softmax of the per-component scipy evaluation",
    tol=1e-13,
)
def _responsibilities():
    rng = np.random.default_rng(2)
    x, means, variances, weights = random_gmm(rng, 300, 12, 4, var_range=(0.2, 2.0))
    resp = gmm.responsibilities(x, means, variances, weights)
    ref = special.softmax(direct_log_joint(x, means, variances, weights), axis=1)
    return float(max(np.max(np.abs(resp.sum(axis=1) - 1.0)), np.max(np.abs(resp - ref))))


@register(
    "gmm.stability_1e4_1e-8",
    "responsibilities at |x| ~ 1e4, variances ~ 1e-8: finite, rows sum to 1, == direct evaluation",
    tol=1e-12,
)
def _stability():
    rng = np.random.default_rng(3)
    K, d, N = 6, 3, 400
    centre = 1e4 * rng.choice([-1.0, 1.0], size=d)
    # components 1e-4 apart with standard deviations 1e-4: the posteriors are
    # neither 0 nor 1, and log-densities are of order -d log(1e-8) ~ +55, while
    # the naive expansion x^2/s is ~1e16 (all digits cancelled)
    means = centre + 1e-4 * rng.normal(size=(K, d))
    variances = 1e-8 * rng.uniform(0.5, 2.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    x = centre + 1e-4 * rng.normal(size=(N, d))
    resp = gmm.responsibilities(x, means, variances, weights)
    if not np.all(np.isfinite(resp)):
        return float("inf")
    # direct, term by term: (x - mu) is exact here, nothing large is formed
    direct = np.stack(
        [
            np.log(weights[k]) - 0.5 * np.sum(np.log(2 * np.pi * variances[k]) + (x - means[k]) ** 2 / variances[k], axis=1)
            for k in range(K)
        ],
        axis=1,
    )
    ref = special.softmax(direct, axis=1)
    return float(max(np.max(np.abs(resp.sum(axis=1) - 1.0)), np.max(np.abs(resp - ref))))


@register(
    "gmm.nll_gradient_vs_fd",
    "isotropic NLL gradient -beta sum_i r_in (x_i - mu_n) == central finite differences",
    tol=1e-7,
)
def _nll_gradient():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(60, 3))
    means = rng.normal(size=(4, 3))
    beta, weights = 1.7, rng.dirichlet(np.ones(4))
    grad = gmm.isotropic_nll_gradient(x, means, beta, weights)
    fd = numerical_gradient(lambda mu: gmm.isotropic_nll(x, mu, beta, weights), means)
    return relative_error(grad, fd)


@register(
    "gmm.em_step_equals_newton_step",
    "isotropic EM M-step sum_i r x / sum_i r == Newton step mu - H^-1 grad on the NLL",
    tol=1e-12,
)
def _em_newton():
    rng = np.random.default_rng(5)
    worst = 0.0
    for beta in (0.3, 1.0, 8.0):
        x = rng.normal(size=(500, 4)) + rng.choice([-3.0, 3.0], size=(500, 1))
        means = rng.normal(size=(5, 4))
        weights = rng.dirichlet(np.ones(5))
        em = gmm.isotropic_m_step(x, means, beta, weights)
        newton = gmm.newton_step(x, means, beta, weights)
        worst = max(worst, relative_error(newton, em))
    return worst


@register(
    "gmm.online_mean_equals_batch_mean",
    "running mean folded over 7 uneven batches == batch mean with the same assignments",
    tol=1e-13,
)
def _online_mean():
    rng = np.random.default_rng(6)
    K, d, N = 5, 4, 997
    x = rng.normal(size=(N, d)) * 3.0 + 1.0
    assign = rng.integers(0, K, size=N)
    means, counts = np.zeros((K, d)), np.zeros(K, dtype=np.int64)
    for chunk in np.array_split(np.arange(N), [10, 11, 200, 450, 451, 800]):
        means, counts = gmm.running_mean_update(means, counts, x[chunk], assign[chunk])
    batch = np.stack([x[assign == k].mean(axis=0) for k in range(K)])
    if not np.array_equal(counts, np.bincount(assign, minlength=K)):
        return float("inf")
    return relative_error(means, batch)


@register(
    "gmm.em_never_increases_nll",
    "diagonal EM, 60 iterations from 5 random starts: largest per-point NLL increase (0 = monotone)",
    tol=1e-12,
)
def _em_monotone():
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(3, 2)) * 4
    x = np.concatenate([c + rng.normal(size=(150, 2)) * rng.uniform(0.3, 1.5, size=2) for c in centres])
    worst = 0.0
    for _ in range(5):
        means = x[rng.choice(len(x), 4, replace=False)]
        variances, weights = np.ones((4, 2)), np.full(4, 0.25)
        nll = -gmm.log_likelihood(x, means, variances, weights).mean()
        for _ in range(60):
            means, variances, weights = gmm.em_step(x, means, variances, weights, reg_covar=1e-6)
            new = -gmm.log_likelihood(x, means, variances, weights).mean()
            worst = max(worst, new - nll)
            nll = new
    return float(worst)
