# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 7: EM is a Newton method (on the right function)
#
# Online Vector-Quantized attention updates its dictionary of key centroids
# with the online $k$-means rule
# $\mu_n \leftarrow \mu_n + \frac{1}{c_n + |S_n|}\sum_{i \in S_n}(x_i - \mu_n)$.
# This lesson shows where that rule comes from and in what sense it is a
# second-order method.
#
# Notation follows `docs/glossary.md`; as in the EM literature, this lesson
# indexes components by $n$ and data points by $i$.
#
# **You will learn to**
#
# - derive the gradient of the negative log-likelihood from the log-sum-exp,
#   and check it by central differences at a predicted best step;
# - derive the EM surrogate, check that it majorises the NLL, and identify
#   $\beta N_n I$ as its Hessian (not the NLL's);
# - show that the EM M-step is exactly one Newton step on the surrogate, and
#   that Newton with the true Hessian can go uphill;
# - explain $k$-means as the $\beta\to\infty$ limit of EM and the online
#   running mean as the same update on summarised data;
# - check that EM never increases the NLL, step by step.
#
# **Before this lesson**: lesson 1 (Gaussian mixtures, responsibilities as
# the softmax of the log-joints, the log-sum-exp). From outside:
# multivariable calculus (gradients, Hessians, Taylor's theorem), Newton's
# method, Jensen's inequality and the KL divergence, and floating-point
# rounding (`docs/floating_point.md`). No earlier exposure to EM is assumed:
# this lesson derives it.
#
# **The claim.** Take an isotropic Gaussian mixture with fixed covariance
# $I/\beta$ and fixed weights $\pi_n$, and its negative log-likelihood
#
# $$
# \mathrm{NLL}(\mu) = -\sum_{i=1}^N \log \sum_{n=1}^K \pi_n\,\mathcal N(x_i;\ \mu_n,\ I/\beta).
# $$
#
# 1. The EM update of the means is *exactly* one Newton step on the EM
#    surrogate $U$ (the responsibilities held fixed): $\mu - H^{-1}\nabla$
#    with $\nabla$ the gradient of the NLL (equal to that of $U$ at the
#    current point) and $H_n = \beta N_n I$, $N_n = \sum_i r_{in}$, the
#    Hessian of the surrogate.
# 2. That Hessian is **not** the Hessian of the NLL. The two differ by a term
#    that vanishes as the responsibilities become hard; the true Hessian can be
#    indefinite, the surrogate one never is. "EM = Newton" means Newton on the
#    surrogate, equivalently gradient descent preconditioned by
#    $1/(\beta N_n)$ (Xu and Jordan, 1996).
# 3. As $\beta \to \infty$ the EM step becomes the batch $k$-means step, and
#    summarising past data by a mean and a count turns it into the exact
#    running mean.
# 4. EM never increases the NLL.
#
# Each claim is derived, then checked with `assert`s on measured errors.
# `TUTORIAL_SMALL=1` (set by CI) runs on small arrays; the default is full size.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from refimpl import gmm

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16 (not the surrogate U of section 2)
print(f"small sizes: {SMALL}")

# %% [markdown]
# The data: three clusters in the plane; the model: $K = 3$ components with
# $\beta = 1$ and fixed weights, started from three data points.

# %%
rng = np.random.default_rng(7)
N = 300 if SMALL else 3000
centres = np.array([[-4.0, 0.0], [3.0, 3.0], [2.0, -3.0]])
labels = rng.integers(0, 3, size=N)
x = centres[labels] + rng.normal(size=(N, 2))
beta = 1.0
weights = np.array([0.4, 0.35, 0.25])
means0 = x[rng.choice(N, size=3, replace=False)]
K, d = means0.shape


def resp_isotropic(x, means, beta, weights):
    """r_in: responsibilities of the isotropic mixture (variances 1 / beta)."""
    return gmm.responsibilities(x, means, np.full(means.shape, 1.0 / beta), weights)


# %% [markdown]
# ## 1. The gradient of the NLL
#
# Write $\ell_n(x) = \log\pi_n - \frac\beta2\|x - \mu_n\|^2 + \text{const}$, so
# that $\mathrm{NLL} = -\sum_i \log\sum_n e^{\ell_n(x_i)}$. The derivative of a
# log-sum-exp is the softmax of its arguments, and the softmax of the
# log-joints *is* the responsibility $r_{in} = \gamma_n(x_i)$. With
# $\partial \ell_n / \partial \mu_n = \beta(x - \mu_n)$:
#
# $$
# \nabla_{\mu_n} \mathrm{NLL} = -\sum_i r_{in}\,\beta(x_i - \mu_n)
#   = -\beta\Big(\sum_i r_{in} x_i - N_n \mu_n\Big).
# $$
#
# `gmm.isotropic_nll_gradient` implements the right-hand side. We check it by
# central differences of `gmm.isotropic_nll`, one coordinate of the means at
# a time, for a range of steps $h$. Along a coordinate direction $e$, with
# $f(t) = \mathrm{NLL}(\mu + t e)$, Taylor's theorem gives
#
# $$
# \frac{f(h) - f(-h)}{2h} = f'(0) + \frac{h^2}{6} f'''(0) + O(h^4),
# $$
#
# and each evaluation of $f$ is rounded to about $u|f|$, with machine epsilon
# $u$ ($2.2\times10^{-16}$ in float64), an error the difference divides
# by $2h$: up to $u|f|/h$. The total error $E(h) = h^2|f'''|/6 + u|f|/h$ is a V
# on log-log axes whose bottom is where $E'(h) = h|f'''|/3 - u|f|/h^2$ vanishes:
#
# $$
# h^\star = \Big(\frac{3u|f|}{|f'''|}\Big)^{1/3}, \qquad E(h^\star) = \frac32\,\frac{u|f|}{h^\star} .
# $$
#
# The third derivative sets where truncation takes over, and it is not of
# order one here. We estimate it along each probed coordinate with a wide
# stencil, $f'''(0) \approx [f(2H) - 2f(H) + 2f(-H) - f(-2H)]/(2H^3)$, whose
# truncation error is $O(H^2)$ and rounding error $3u|f|/H^3$; at
# $H = 10^{-2}$ and $5\times10^{-3}$ both are small, and the two estimates
# must agree to $1\%$. The plotted error is the maximum over the coordinates,
# so at large $h$ the coordinate with the largest $|f'''|$ dominates it, and
# the prediction uses that one.
#
# Two checks. (i) At $h = 10^{-2}$, where rounding is negligible, the
# measured error must equal $h^2\max|f'''|/6$ to within $5\%$. (ii) The best
# measured step must be within a factor $10$ of $h^\star$, and its error
# below $3E(h^\star)$. Why these tolerances: `docs/floating_point.md`,
# section Lesson 7.

# %%
def nll_along(idx, t):
    """f(t) = NLL(mu_0 + t e_idx): the NLL along one coordinate of the means."""
    e = np.zeros_like(means0)
    e[idx] = t
    return gmm.isotropic_nll(x, means0 + e, beta, weights)


def third_derivative(idx, H):
    """f'''(0) along coordinate idx, from the wide stencil at +-H, +-2H."""
    return (nll_along(idx, 2 * H) - 2 * nll_along(idx, H) + 2 * nll_along(idx, -H) - nll_along(idx, -2 * H)) / (2 * H**3)


grad = gmm.isotropic_nll_gradient(x, means0, beta, weights)
nll0 = gmm.isotropic_nll(x, means0, beta, weights)
g_max = np.max(np.abs(grad))
steps = 10.0 ** np.arange(-1, -10.5, -0.5)
fd_errors = []
for h in steps:
    fd = np.empty_like(means0)
    for idx in np.ndindex(means0.shape):
        fd[idx] = (nll_along(idx, h) - nll_along(idx, -h)) / (2 * h)
    fd_errors.append(np.max(np.abs(fd - grad)) / g_max)
fd_errors = np.array(fd_errors)

f3 = np.array([third_derivative(idx, 1e-2) for idx in np.ndindex(means0.shape)])
f3_half = np.array([third_derivative(idx, 5e-3) for idx in np.ndindex(means0.shape)])
f3_max = np.max(np.abs(f3))
h_star = (3 * U * abs(nll0) / f3_max) ** (1 / 3)
err_star = 1.5 * U * abs(nll0) / h_star / g_max  # E(h*), relative to max |grad|
h_best, best = steps[fd_errors.argmin()], fd_errors.min()
model = (steps**2 * f3_max / 6 + U * abs(nll0) / steps) / g_max
at_1e2 = np.isclose(steps, 1e-2)
truncation_ratio = fd_errors[at_1e2][0] / model[at_1e2][0]
small_steps = steps <= 1e-8
kappa = fd_errors[small_steps] * g_max * steps[small_steps] / (U * abs(nll0))

fig, ax = plt.subplots(figsize=(6.5, 4.2))
ax.loglog(steps, fd_errors, "o-", label="central differences vs formula")
ax.loglog(steps, model, "k--", lw=0.8, label=r"model $(h^2\max|f'''|/6 + u|f|/h)\,/\max|\nabla|$")
ax.axvline(h_star, color="tab:red", ls=":", label=r"$h^\star = (3u|f|/\max|f'''|)^{1/3}$")
ax.set(xlabel="step $h$", ylabel="max relative error", title="gradient check: truncation vs rounding")
ax.invert_xaxis()
ax.legend(fontsize=8)
plt.show()

print(f"NLL = {nll0:.1f}; f''' along the coordinates: {np.round(f3, 1)}")
print(f"  H = 1e-2 vs 5e-3: the f''' estimates agree to {np.max(np.abs(f3 - f3_half) / np.abs(f3_half)):.1e} relative")
print(f"predicted best step h* = {h_star:.1e} (error {err_star:.1e}); measured best h = {h_best:.0e} "
      f"(error {best:.1e}): a factor {max(h_best / h_star, h_star / h_best):.1f} apart")
print(f"truncation branch at h = 1e-2: measured / (h^2 max|f'''| / 6) = {truncation_ratio:.4f}")
print(f"rounding constant kappa at the steps <= 1e-8: {np.round(kappa, 2)}")
assert np.max(np.abs(f3 - f3_half) / np.abs(f3_half)) < 0.01  # the stencil has converged
assert abs(truncation_ratio - 1) < 0.05  # the truncation branch is h^2 max|f'''| / 6
assert 0.1 <= h_best / h_star <= 10  # the bottom of the V is where h* puts it
# the grid has a step within 10^(1/4) of h*, where E <= 1.45 E(h*); a factor 2 more allows kappa up to 2
assert best < 3 * err_star, (best, err_star)

# %% [markdown]
# ## 2. The EM surrogate and its Hessian
#
# Fix the responsibilities $r_{in}$ at the current means $\mu^{\text{old}}$.
# For any distribution $r_i$ over components, Jensen's inequality (or the
# identity $\log p(x) = \sum_n r_n \log\frac{p(x, n)}{r_n} + \mathrm{KL}(r \,\|\, p(\cdot\mid x))$)
# gives
#
# $$
# \mathrm{NLL}(\mu) \;\le\; U(\mu) := -\sum_i\sum_n r_{in}\log\frac{\pi_n\,\mathcal N(x_i;\mu_n, I/\beta)}{r_{in}}
#   = \sum_i\sum_n r_{in}\,\frac\beta2\|x_i - \mu_n\|^2 + \text{const},
# $$
#
# with equality at $\mu = \mu^{\text{old}}$, where the KL term is zero. So $U$
# lies above the NLL everywhere and touches it at the current point: it is a
# *majoriser*. Touching from above means the two functions have the same
# gradient there. $U$ is a quadratic in $\mu$, and its Hessian is block
# diagonal:
#
# $$
# \nabla_{\mu_n} U = -\beta\sum_i r_{in}(x_i - \mu_n), \qquad
# \nabla^2_{\mu_n} U = \beta N_n I .
# $$
#
# The picture: both functions along a random line through $\mu^{\text{old}}$.

# %%
def surrogate(x, means, beta, weights, r):
    """U(mu) = -sum_i sum_n r_in log(pi_n N(x_i; mu_n, I/beta) / r_in), r held fixed."""
    log_joint = np.log(weights) + gmm.log_gaussian_diag(x, means, np.full(means.shape, 1.0 / beta))
    with np.errstate(divide="ignore", invalid="ignore"):
        r_log_r = np.where(r > 0, r * np.log(r), 0.0)  # 0 log 0 = 0
    return float(-np.sum(r * log_joint) + np.sum(r_log_r))


r0 = resp_isotropic(x, means0, beta, weights)
direction = np.random.default_rng(70).normal(size=means0.shape)
ts = np.linspace(-2, 2, 41 if SMALL else 201)
mid = len(ts) // 2
ts[mid] = 0.0  # the current point itself
nll_line = np.array([gmm.isotropic_nll(x, means0 + t * direction, beta, weights) for t in ts])
sur_line = np.array([surrogate(x, means0 + t * direction, beta, weights, r0) for t in ts])

fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(ts, nll_line, label="NLL")
ax.plot(ts, sur_line, "--", label=r"surrogate $U$ (responsibilities fixed at $t = 0$)")
ax.set(xlabel=r"$t$ in $\mu^{\mathrm{old}} + t\,v$", ylabel="value", title="the surrogate majorises the NLL and touches it")
ax.legend()
plt.show()

scale = np.max(np.abs(nll_line))
gap_at_0 = abs(sur_line[mid] - nll_line[mid]) / scale
worst_violation = np.max(nll_line - sur_line) / scale  # must be <= 0 up to rounding
print(f"|U - NLL| / |NLL| at t = 0: {gap_at_0:.1e};  max (NLL - U) / |NLL| on the line: {worst_violation:.1e}")
# both are sums of N terms of size |NLL| / N: a few u relative
assert gap_at_0 < 1e-13 and worst_violation < 1e-13

# %% [markdown]
# The gradient of $U$, written out from the formula above, matches the NLL
# gradient at $\mu^{\text{old}}$, and the surrogate Hessian from
# `gmm.isotropic_surrogate_hessian` is $\beta N_n$ (we also check it by central
# differences of $U$ itself, which is exact for a quadratic up to rounding).
# The same second differences taken on the NLL do **not** give $\beta N_n$:
# the two functions share their value and gradient at $\mu^{\text{old}}$, not
# their curvature. $H_n = \beta N_n I$ is the Hessian of the EM surrogate, not
# of the NLL (section 4 derives the difference). For the NLL the second
# difference has a truncation error $h^2|f''''|/12$ and a rounding error
# about $4u|f|/h^2$; both are far below the gap we assert, $1\%$ of $\beta N_n$.

# %%
grad_U = -beta * (r0.T @ x - r0.sum(axis=0)[:, None] * means0)
err_tangent = np.max(np.abs(grad_U - grad)) / np.max(np.abs(grad))
hess_sur = gmm.isotropic_surrogate_hessian(x, means0, beta, weights)  # (K,): beta N_n
h = 1e-3
second_diff = np.empty(K)
for n in range(K):
    e = np.zeros_like(means0)
    e[n, 0] = h
    second_diff[n] = (surrogate(x, means0 + e, beta, weights, r0) - 2 * surrogate(x, means0, beta, weights, r0)
                      + surrogate(x, means0 - e, beta, weights, r0)) / h**2
err_hess = np.max(np.abs(second_diff - hess_sur) / hess_sur)
second_diff_nll = np.array([(nll_along((n, 0), h) - 2 * nll0 + nll_along((n, 0), -h)) / h**2 for n in range(K)])
gap_nll = np.abs(second_diff_nll - hess_sur) / hess_sur
print(f"grad U vs grad NLL at mu_old: {err_tangent:.1e}")
print(f"beta N_n = {np.round(hess_sur, 3)};  second differences of U agree to {err_hess:.1e}")
print(f"second differences of the NLL: {np.round(second_diff_nll, 3)}, off from beta N_n by {np.round(gap_nll, 3)} relative")
assert err_tangent < 1e-13
# second difference of a quadratic: no truncation; rounding ~ u |U| / h^2
assert err_hess < 10 * U * abs(nll0) / h**2 / hess_sur.min()
assert np.max(gap_nll) > 0.01  # beta N_n is the surrogate's curvature, not the NLL's

# %% [markdown]
# ## 3. One Newton step on the surrogate is the M-step
#
# Because $U$ is quadratic, one Newton step minimises it exactly:
#
# $$
# \mu_n^{\text{new}} = \mu_n - H_n^{-1}\nabla_{\mu_n}
#   = \mu_n + \frac{\beta\sum_i r_{in}(x_i - \mu_n)}{\beta N_n}
#   = \mu_n + \frac{\sum_i r_{in}x_i}{N_n} - \mu_n
#   = \frac{\sum_i r_{in}\, x_i}{\sum_i r_{in}},
# $$
#
# the responsibility-weighted mean: the EM M-step. Both routes are in
# `refimpl.gmm` (`newton_step` builds $\mu - H^{-1}\nabla$ from the NLL
# gradient and the surrogate Hessian; `isotropic_m_step` forms the weighted
# mean) and they must agree to rounding for any $\beta$.

# %%
worst_em_newton = 0.0
for b in (0.05, 0.3, 1.0, 8.0, 50.0):
    em = gmm.isotropic_m_step(x, means0, b, weights)
    newton = gmm.newton_step(x, means0, b, weights)
    err = np.max(np.abs(em - newton)) / np.max(np.abs(em))
    worst_em_newton = max(worst_em_newton, err)
    print(f"beta = {b:5}: max |EM - Newton| / max |EM| = {err:.1e}")
assert worst_em_newton < 1e-12

# %% [markdown]
# ## 4. The surrogate Hessian is not the NLL Hessian
#
# Differentiate the gradient once more, now letting the responsibilities move
# ($\partial r_{in}/\partial\mu_m = \beta\, r_{in}(\delta_{nm} - r_{im})(x_i - \mu_m)^\top$):
#
# $$
# \frac{\partial^2 \mathrm{NLL}}{\partial\mu_n\,\partial\mu_m}
# = \underbrace{\beta N_n \delta_{nm} I}_{\text{surrogate}}
#  \;-\; \beta^2\sum_i r_{in}(\delta_{nm} - r_{im})\,(x_i - \mu_n)(x_i - \mu_m)^\top .
# $$
#
# The second term is, summed over the points, the posterior covariance of the
# complete-data score (the gradient of $\log p(x_i, z)$ with respect to the
# means, $\beta(x_i - \mu_z)$ in block $z$, with $z \sim r_i$): the *missing
# information* of Louis (1982). A covariance is positive semi-definite, so the
# term only *lowers* the curvature. It vanishes when every $r_i$ is one-hot,
# i.e. in the hard-assignment limit. We implement the formula, check it by central differences of the
# gradient, and measure the relative gap $\|H_{\text{true}} -
# H_{\text{sur}}\|_2 / \|H_{\text{sur}}\|_2$ as $\beta$ grows.

# %%
def nll_hessian(x, means, beta, weights):
    """Full (K d) x (K d) Hessian of the isotropic NLL with respect to the means."""
    K, d = means.shape
    r = resp_isotropic(x, means, beta, weights)
    H = np.zeros((K * d, K * d))
    for n in range(K):
        H[n * d:(n + 1) * d, n * d:(n + 1) * d] += beta * r[:, n].sum() * np.eye(d)
        for m in range(K):
            coef = r[:, n] * ((n == m) - r[:, m])
            H[n * d:(n + 1) * d, m * d:(m + 1) * d] -= beta**2 * ((coef[:, None] * (x - means[n])).T @ (x - means[m]))
    return H


def surrogate_hessian_matrix(x, means, beta, weights):
    return np.kron(np.diag(gmm.isotropic_surrogate_hessian(x, means, beta, weights)), np.eye(means.shape[1]))


H_true = nll_hessian(x, means0, beta, weights)
h = 1e-5
H_fd = np.empty_like(H_true)
for j in range(K * d):
    e = np.zeros(K * d)
    e[j] = h
    H_fd[:, j] = (gmm.isotropic_nll_gradient(x, means0 + e.reshape(K, d), beta, weights)
                  - gmm.isotropic_nll_gradient(x, means0 - e.reshape(K, d), beta, weights)).ravel() / (2 * h)
err_H = np.max(np.abs(H_fd - H_true)) / np.max(np.abs(H_true))
gap_beta1 = np.linalg.norm(H_true - surrogate_hessian_matrix(x, means0, beta, weights), 2) / np.linalg.norm(H_true, 2)
print(f"NLL Hessian formula vs central differences of the gradient: {err_H:.1e}")
print(f"relative gap between the true and the surrogate Hessian at beta = {beta}: {gap_beta1:.2f}")
assert err_H < 1e-8  # truncation ~h^2, rounding ~u |grad| / h: both < 1e-9 relative here
assert gap_beta1 > 0.01  # at this beta they are different matrices

# %% [markdown]
# Where components overlap, the true Hessian can even be indefinite. One
# round cluster with standard deviation 2, modelled by two components of
# standard deviation 1 placed almost on top of each other: the symmetric
# configuration is a saddle of the NLL (splitting the cluster in two fits it
# better). Newton with the *true* Hessian jumps towards that saddle and the NLL
# goes **up**; the EM step (Newton on the surrogate, whose Hessian is always
# positive definite when every $N_n > 0$) goes down.

# %%
rng_s = np.random.default_rng(71)
x_one = rng_s.normal(size=(500 if SMALL else 2000, 2)) * 2.0
x_one -= x_one.mean(axis=0)
w_two = np.array([0.5, 0.5])
mu_start = np.array([[0.05, 0.1], [-0.05, -0.1]])
H_one = nll_hessian(x_one, mu_start, 1.0, w_two)
g_one = gmm.isotropic_nll_gradient(x_one, mu_start, 1.0, w_two)
mu_true_newton = mu_start - np.linalg.solve(H_one, g_one.ravel()).reshape(mu_start.shape)
mu_em = gmm.isotropic_m_step(x_one, mu_start, 1.0, w_two)
nll_start, nll_tn, nll_em = (gmm.isotropic_nll(x_one, m, 1.0, w_two) for m in (mu_start, mu_true_newton, mu_em))
eig_true = np.linalg.eigvalsh(H_one)
eig_sur = np.linalg.eigvalsh(surrogate_hessian_matrix(x_one, mu_start, 1.0, w_two))
print(f"eigenvalues, true Hessian:      {np.round(eig_true, 1)}")
print(f"eigenvalues, surrogate Hessian: {np.round(eig_sur, 1)}")
print(f"NLL: start {nll_start:.2f}, after a true Newton step {nll_tn:.2f}, after an EM step {nll_em:.2f}")
assert eig_true.min() < 0 < eig_sur.min()
assert nll_tn > nll_start > nll_em

# %% [markdown]
# ## 5. $k$-means is the $\beta \to \infty$ limit
#
# With fixed weights, $r_{in} \propto \pi_n e^{-\frac\beta2\|x_i-\mu_n\|^2}$.
# For a point whose nearest mean is $n^\star$, every other responsibility is at
# most $\frac{\pi_m}{\pi_{n^\star}}\, e^{-\beta\Delta_{im}/2}$, where
# $\Delta_{im} = \|x_i - \mu_m\|^2 - \|x_i - \mu_{n^\star}\|^2 > 0$ is the
# point's margin. So the responsibilities become one-hot exponentially fast
# in $\beta$ (the weights stop mattering: $\log\pi_n$ is negligible next to
# $\beta\Delta$), and the M-step becomes the mean of the points nearest to each
# centroid: one batch $k$-means (Lloyd) step, `gmm.kmeans_step`.
#
# *How* fast is set by the point closest to a boundary, the smallest margin
# $\Delta_{\min}$: the gap decays like $e^{-\beta\Delta_{\min}/2}$, and only
# once $\beta \gg 2/\Delta_{\min}$. With thousands of points some lie very close
# to a boundary, so the limit is reached late; we sweep $\beta$ up to
# $100/\Delta_{\min}$, where $e^{-\beta\Delta_{\min}/2} = e^{-50}$.
#
# The same sweep for the Hessian gap of section 4 (right panel) shows it is
# not monotone: near-boundary points keep $r(1-r) \approx 1/4$ while the
# $\beta^2$ factor grows, so the gap first *widens*, then collapses once
# $\beta\Delta_{\min} \gg 1$. The surrogate Hessian is the true one only in the
# hard limit.

# %%
sq = np.sum((x[:, None, :] - means0[None]) ** 2, axis=2)
sq_sorted = np.sort(sq, axis=1)
delta_min = np.min(sq_sorted[:, 1] - sq_sorted[:, 0])
betas_k = 10.0 ** np.linspace(-1, np.log10(100 / delta_min), 17 if SMALL else 41)

km = gmm.kmeans_step(x, means0)
km_gap = np.array([np.max(np.abs(gmm.isotropic_m_step(x, means0, b, weights) - km)) for b in betas_k])
hess_gap = np.array(
    [
        np.linalg.norm(nll_hessian(x, means0, b, weights) - surrogate_hessian_matrix(x, means0, b, weights), 2)
        / np.linalg.norm(surrogate_hessian_matrix(x, means0, b, weights), 2)
        for b in betas_k
    ]
)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
ax0.loglog(betas_k, np.maximum(km_gap, 1e-300), "o-", label=r"$\max|\mathrm{EM}_\beta - k\mathrm{means}|$")
ax0.loglog(betas_k, np.exp(-betas_k * delta_min / 2), "k--", label=r"$e^{-\beta\Delta_{\min}/2}$")
ax0.axvline(2 / delta_min, color="gray", ls=":", label=r"$\beta = 2/\Delta_{\min}$")
ax0.set(xlabel=r"$\beta$", ylabel="gap", title="EM step vs $k$-means step", ylim=(1e-20, 10))
ax0.legend()
ax1.loglog(betas_k, np.maximum(hess_gap, 1e-300), "o-", color="tab:orange")
ax1.axvline(2 / delta_min, color="gray", ls=":")
ax1.set(xlabel=r"$\beta$", ylabel=r"$\|H_{\mathrm{true}} - H_{\mathrm{sur}}\|_2 / \|H_{\mathrm{sur}}\|_2$",
        title="true vs surrogate Hessian", ylim=(1e-20, None))
plt.show()

print(f"smallest margin Delta_min = {delta_min:.2e}")
print(f"k-means gap:   beta = {betas_k[0]:g}: {km_gap[0]:.2e};  beta = {betas_k[-1]:.3g}: {km_gap[-1]:.1e}")
print(f"Hessian gap:   beta = {betas_k[0]:g}: {hess_gap[0]:.2e};  largest {hess_gap.max():.2e};  "
      f"beta = {betas_k[-1]:.3g}: {hess_gap[-1]:.1e}")
assert km_gap[0] > 0.1  # soft assignments: a different update
assert km_gap[-1] <= 1e-12 * np.max(np.abs(km))  # hard assignments: the same update, to rounding
assert hess_gap[-1] < 1e-12 and hess_gap.max() > 0.1

# %% [markdown]
# ## 6. The online running mean is the batch mean
#
# Suppose a centroid $\mu_n$ already summarises $c_n$ past points: it is their
# mean, so their sum is $c_n\mu_n$. A new batch assigns the set $S_n$ to it
# (hard assignments). The M-step over *all* points seen so far, old and new,
# needs only $(\mu_n, c_n)$:
#
# $$
# \mu_n' = \frac{c_n\mu_n + \sum_{i\in S_n} x_i}{c_n + |S_n|}
#        = \mu_n + \frac{1}{c_n + |S_n|}\sum_{i\in S_n}(x_i - \mu_n),
# \qquad c_n' = c_n + |S_n| .
# $$
#
# The second form is the Newton step of section 3 on all the points seen: the
# past points contribute nothing to the gradient (their deviations from their
# own mean $\mu_n$ sum to zero), the new ones $-\beta\sum_{S_n}(x_i - \mu_n)$,
# and the surrogate Hessian is $\beta(c_n + |S_n|)$. The learning rate
# $1/(c_n + |S_n|)$ *is* the inverse Hessian. Folding a stream in batches of any sizes therefore reproduces the
# batch mean of each cluster, provided the assignments are the same. (Online
# $k$-means that assigns each batch with the centroids of the moment is a
# different algorithm, with different assignments; this identity is about the
# update, not about the assignment.)

# %%
assign = gmm.hard_assignments(x, km)  # any fixed assignment works; use the k-means one
cuts = np.sort(np.random.default_rng(72).choice(np.arange(1, N), size=12 if SMALL else 60, replace=False))
mu_run, counts = np.zeros((K, d)), np.zeros(K, dtype=np.int64)
for chunk in np.split(np.arange(N), cuts):
    mu_run, counts = gmm.running_mean_update(mu_run, counts, x[chunk], assign[chunk])
batch_mean = np.stack([x[assign == n].mean(axis=0) for n in range(K)])
n_chunks = len(cuts) + 1
err_running = np.max(np.abs(mu_run - batch_mean)) / np.max(np.abs(batch_mean))
print(f"{n_chunks} batches of sizes {np.min(np.diff(np.r_[0, cuts, N]))} to {np.max(np.diff(np.r_[0, cuts, N]))}")
print(f"counts {counts} == cluster sizes {np.bincount(assign, minlength=K)}")
print(f"running mean vs batch mean: {err_running:.1e}")
assert np.array_equal(counts, np.bincount(assign, minlength=K))
# each fold rounds a few times, relative u each: errors add up over the batches
assert err_running <= 4 * n_chunks * U

# %% [markdown]
# ## 7. EM never increases the NLL
#
# Chain the two facts of section 2: $U$ lies above the NLL and touches it at
# $\mu^{\text{old}}$, and the M-step minimises $U$. Hence
#
# $$
# \mathrm{NLL}(\mu^{\text{new}}) \le U(\mu^{\text{new}}) \le U(\mu^{\text{old}}) = \mathrm{NLL}(\mu^{\text{old}}).
# $$
#
# We run EM from several starts: the isotropic mean updates of this lesson
# (`isotropic_m_step`), and full diagonal EM that also updates the variances
# and weights (`em_step`, the same argument with a surrogate in all
# parameters). Every step is checked; rounding of a sum of $N$ terms allows
# increases of at most a few $u$ (machine epsilon) relative, and we allow $10^{-12}$.
#
# Monotone does not mean global or fast. Different starts end at different
# values (stationary points that are not the global minimum), and the right
# panel, the decrease of the NLL per iteration on a log scale, shows EM's
# linear convergence: straight lines, steep for some runs and nearly flat for
# others. The rate is set by the fraction of information that is missing, the
# same overlap term that separates the true Hessian from the surrogate one in
# section 4.

# %%
n_iter = 25 if SMALL else 100
rng_em = np.random.default_rng(73)
traces = {"isotropic": [], "diagonal": []}
worst_chain = 0.0
for start in range(4):
    mu = x[rng_em.choice(N, size=K, replace=False)]
    trace = [gmm.isotropic_nll(x, mu, beta, weights)]
    for _ in range(n_iter):
        r = resp_isotropic(x, mu, beta, weights)
        mu_new = gmm.isotropic_m_step(x, mu, beta, weights)
        # the sandwich NLL(new) <= U(new) <= U(old) = NLL(old), every step
        u_new, u_old = surrogate(x, mu_new, beta, weights, r), surrogate(x, mu, beta, weights, r)
        nll_new = gmm.isotropic_nll(x, mu_new, beta, weights)
        worst_chain = max(worst_chain, (nll_new - u_new) / abs(u_old), (u_new - u_old) / abs(u_old))
        mu = mu_new
        trace.append(nll_new)
    traces["isotropic"].append(np.array(trace))

    means_d = x[rng_em.choice(N, size=K, replace=False)]
    variances_d, weights_d = np.ones((K, d)), np.full(K, 1.0 / K)
    trace = [-gmm.log_likelihood(x, means_d, variances_d, weights_d).sum()]
    for _ in range(n_iter):
        means_d, variances_d, weights_d = gmm.em_step(x, means_d, variances_d, weights_d, reg_covar=1e-6)
        trace.append(-gmm.log_likelihood(x, means_d, variances_d, weights_d).sum())
    traces["diagonal"].append(np.array(trace))

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
for model, style in (("isotropic", "-"), ("diagonal", "--")):
    for start, trace in enumerate(traces[model]):
        color = f"C{start}"
        ax0.plot(trace[:16] / N, style, color=color, label=f"{model}, start {start}")
        decrease = -np.diff(trace) / N
        decrease[decrease <= 0] = np.nan  # converged to rounding: nothing left to draw on a log scale
        ax1.semilogy(np.arange(1, len(trace)), decrease, style, color=color)
ax0.set(xlabel="EM iteration", ylabel="NLL / N", title="the first iterations")
ax0.legend(fontsize=8, ncol=2)
ax1.set(xlabel="EM iteration", ylabel="(NLL before - NLL after) / N", title="decrease per iteration")
plt.show()

worst_rise = max(np.max(np.diff(t) / np.abs(t[:-1])) for ts_ in traces.values() for t in ts_)
for model, ts_ in traces.items():
    print(f"{model:9s}: final NLL / N per start: {np.round([t[-1] / N for t in ts_], 4)}")
# once EM has converged the NLL stops changing, and rounding alone moves it by ~u either way
print(f"largest relative NLL increase over all steps: {worst_rise:.1e}  (rounding level: monotone)")
print(f"largest violation of the sandwich inequalities: {worst_chain:.1e}")
assert worst_rise <= 1e-12
assert worst_chain <= 1e-12

# %% [markdown]
# ## Summary
#
# | claim | check | measured |
# |---|---|---|
# | $\nabla\mathrm{NLL} = -\beta\sum_i r_{in}(x_i - \mu_n)$ | central differences, best $h$ | $2$–$6\times10^{-11}$ relative ($< 3E(h^\star)$) |
# | best step $h^\star = (3u\lvert f\rvert/\lvert f'''\rvert)^{1/3}$, truncation $h^2\lvert f'''\rvert/6$ | $f'''$ by a wide stencil; steps $10^{-1}$ to $10^{-10}$ | measured best within $1.6\times$ of $h^\star$ (limit $10\times$); truncation to $0.1\%$ (limit $5\%$) |
# | $U \ge \mathrm{NLL}$, equal with equal gradients at $\mu^{\text{old}}$ | along a line; gradient formula | $< 10^{-13}$ |
# | $H_n = \beta N_n I$ is the Hessian of the surrogate $U$, not of the NLL | second differences of $U$ and of the NLL | $U$: rounding; NLL: off by $9$–$127\%$ |
# | M-step $=$ Newton step on $U$ (NLL gradient, $H_n = \beta N_n I$) | five values of $\beta$ | $< 10^{-12}$ |
# | true Hessian $\ne$ surrogate; can be indefinite | formula vs differences; eigenvalues; NLL after one step | gap $\to 0$ as $\beta\to\infty$ |
# | $\beta \to \infty$: EM step $\to$ $k$-means step | gap vs $\beta$ | $\le 10^{-12}$ at $\beta = 100/\Delta_{\min}$ |
# | running mean $=$ batch mean (same assignments) | uneven batches | a few $u$ |
# | EM never increases the NLL | every step, 4 starts, two models | no increase beyond rounding |
#
# In OVQ attention (lesson 8) the centroids are updated with exactly the
# running-mean rule of section 6, one sparse row per assigned key.

# %% [markdown]
# ## Exercises
#
# Four exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell after it; until you answer, the check
# prints that the exercise is not done yet, and a wrong answer stops with a
# message that says what is off. Worked solutions are in
# `tutorials/solutions/lesson_07.py`: try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises come after the lesson)

# %% [markdown]
# ### Exercise 7.1 ★ The gradient of the NLL with respect to the means
#
# Write `nll_gradient(x, means, beta, weights)`: the gradient of the
# isotropic NLL (covariance $I/\beta$, fixed weights) with respect to the
# means, for points $(N, d)$, means $(K, d)$ and weights $(K,)$; return
# $(K, d)$. Use section 1's derivation; you may call `gmm.responsibilities`
# (with variances $1/\beta$) but not `gmm.isotropic_nll_gradient`.

# %%
def nll_gradient(x, means, beta, weights):
    """d NLL / d mu_n for every component, for x (N, d), means (K, d): shape (K, d)."""
    raise NotImplementedError("exercise 7.1")


# %%
check("7.1", nll_gradient)

# %% [markdown]
# ### Exercise 7.2 ★★ The true Hessian of the NLL
#
# Write `nll_hessian(x, means, beta, weights)`: the full Hessian of the NLL
# with respect to the means, shape $(Kd, Kd)$, with rows and columns in the
# order of `means.ravel()` (component $n$, coordinate $j$ at index
# $nd + j$). Derive it from section 4: differentiate the gradient once more
# and let the responsibilities move. The check compares with central
# differences of the gradient; it rejects the surrogate Hessian
# $\beta N_n I$ alone.

# %%
def nll_hessian(x, means, beta, weights):
    """Hessian of the isotropic NLL in the means, for means (K, d): shape (K d, K d)."""
    raise NotImplementedError("exercise 7.2")


# %%
check("7.2", nll_hessian)

# %% [markdown]
# ### Exercise 7.3 ★★ The running-mean update
#
# Write `running_mean_update(means, counts, x, assign)`: fold a batch `x`
# $(B, d)$ with hard assignments `assign` $(B,)$ (integers in $[0, K)$) into
# running means $(K, d)$ with counts $(K,)$, as in section 6; return the
# pair `(new_means, new_counts)`. Rows that receive no point keep their mean
# (even if their count is $0$), and a batch may be empty. The check folds a
# stream in uneven batches and compares with the batch mean of each cluster.

# %%
def running_mean_update(means, counts, x, assign):
    """(means', counts') after folding x (B, d) with assignments (B,) into means (K, d), counts (K,)."""
    raise NotImplementedError("exercise 7.3")


# %%
check("7.3", running_mean_update)

# %% [markdown]
# ### Exercise 7.4 ★★★ A start where true Newton climbs and EM descends
#
# Build a failure case of Newton's method in one dimension. Set
# `saddle_case = (x, means, weights)` with data `x` of shape $(N, 1)$,
# $N \ge 20$, two components (`means` of shape $(2, 1)$, positive `weights`
# summing to one) and $\beta = 1$, such that at this start the true Hessian
# of the NLL is indefinite, a Newton step with it *raises* the NLL, and the
# EM step lowers it. Section 4 has a two-dimensional example; think about
# why it works (which configuration is a saddle, and where Newton jumps)
# before you adapt it.

# %%
saddle_case = ...

# %%
check("7.4", saddle_case)
