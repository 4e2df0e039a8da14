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
# # Lesson 1: GMM posteriors, computed to the last digit
#
# Everything in Gaussian Mixture Attention starts from one computation: the
# posterior probability $\gamma_k(x) = p(z = k \mid x)$ that a point $x$ was
# drawn by component $k$ of a Gaussian mixture with diagonal covariances.
#
# **The claim of this lesson.** The posterior can be computed in float64 to
# within a few rounding errors of the log-densities *for every input*,
# including inputs where every density underflows to 0 or overflows to
# $\infty$, provided we
#
# 1. work with log-densities and subtract the **per-row** maximum before
#    exponentiating (log-sum-exp),
# 2. expand the quadratic form into matrix products only **after centring**
#    on the means;
#
# and the parameters stay valid under gradient descent if we
#
# 3. map unconstrained parameters to valid ones by softplus (variances, with a
#    floor) and softmax (weights).
#
# `refimpl.gmm` does all three. We derive each step, show a textbook
# implementation failing where the step is skipped, and check `refimpl.gmm`
# against independent evaluations, including scikit-learn's `GaussianMixture`,
# with `assert`s on the measured errors.
#
# Sizes: set the environment variable `TUTORIAL_SMALL=1` (CI does) to run on
# small arrays in a few seconds; by default the lesson runs at full size.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
import sklearn
from scipy import special
from sklearn.mixture import GaussianMixture

from refimpl import gmm

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
EPS = np.finfo(np.float64).eps  # 2.2e-16, the spacing of float64 numbers near 1
print(f"small sizes: {SMALL}")

# %% [markdown]
# ## 1. Bayes' rule for a diagonal mixture
#
# A mixture of $K$ Gaussians in $\mathbb R^d$ has weights $\pi_k$
# ($\pi_k \ge 0$, $\sum_k \pi_k = 1$), means $\mu_k$ and diagonal variances
# $\sigma_{k1}^2, \dots, \sigma_{kd}^2$. Draw $z = k$ with probability $\pi_k$,
# then $x \sim \mathcal N(\mu_k, \operatorname{diag}\sigma_k^2)$. Bayes' rule
# gives the posterior of the hidden label:
#
# $$
# \gamma_k(x) = p(z = k \mid x)
#   = \frac{\pi_k\, \mathcal N(x \mid \mu_k, \sigma_k^2)}
#          {\sum_{m=1}^K \pi_m\, \mathcal N(x \mid \mu_m, \sigma_m^2)} .
# $$
#
# Every $\gamma_k(x)$ is in $[0, 1]$ and each row sums to one. With the
# log-joint
#
# $$
# \ell_k(x) = \log \pi_k - \tfrac d2 \log 2\pi - \tfrac12 \sum_j \log \sigma_{kj}^2
#             - \tfrac12 \sum_j \frac{(x_j - \mu_{kj})^2}{\sigma_{kj}^2},
# $$
#
# the posterior is a softmax over components:
# $\gamma_k(x) = e^{\ell_k(x)} / \sum_m e^{\ell_m(x)}$.
#
# Here is the formula exactly as written, the way a first implementation
# looks: densities first, then Bayes' rule.

# %%
def naive_responsibilities(x, means, variances, weights):
    """Bayes' rule as written: product of 1-D densities, times weights, normalised."""
    diff = x[:, None, :] - means[None, :, :]  # (N, K, d)
    dens_1d = np.exp(-0.5 * diff**2 / variances) / np.sqrt(2 * np.pi * variances)
    joint = weights * np.prod(dens_1d, axis=2)  # pi_k N(x | mu_k, sigma_k^2), shape (N, K)
    return joint / joint.sum(axis=1, keepdims=True)


def direct_log_joint(x, means, variances, weights):
    """l_k(x) term by term: (x - mu) is formed first, nothing large is ever built."""
    diff = x[:, None, :] - means[None, :, :]
    return np.log(weights) - 0.5 * np.sum(np.log(2 * np.pi * variances) + diff**2 / variances, axis=2)


# %% [markdown]
# A three-component mixture in the plane, well scaled: on it the naive
# formula, `refimpl.gmm.responsibilities` and the softmax of the direct
# log-joint agree to a few units of $\varepsilon = 2.2\times10^{-16}$.

# %%
means3 = np.array([[-2.0, 0.0], [1.5, 1.5], [1.0, -1.5]])
variances3 = np.array([[1.0, 0.4], [0.5, 1.2], [0.3, 0.3]])
weights3 = np.array([0.5, 0.3, 0.2])
x3 = np.random.default_rng(1).normal(size=(200 if SMALL else 5000, 2)) * 2.0

resp3 = gmm.responsibilities(x3, means3, variances3, weights3)
err_naive = np.max(np.abs(naive_responsibilities(x3, means3, variances3, weights3) - resp3))
err_direct = np.max(np.abs(special.softmax(direct_log_joint(x3, means3, variances3, weights3), axis=1) - resp3))
err_rows = np.max(np.abs(resp3.sum(axis=1) - 1.0))
print(f"naive vs refimpl:  {err_naive:.1e}")
print(f"direct vs refimpl: {err_direct:.1e}")
print(f"|row sum - 1|:     {err_rows:.1e}")
# each entry is a ratio of a few rounded terms of order one: a few eps each
assert err_naive < 16 * EPS and err_direct < 16 * EPS and err_rows < 8 * EPS

# %% [markdown]
# ### A picture of $\gamma$
#
# Colour each point of the plane by its three responsibilities
# (red, green, blue $= \gamma_1, \gamma_2, \gamma_3$). Pure colours are points
# that one component owns; the blends are the boundaries. The boundaries are
# curved because the variances differ per component and per axis: the log-joint
# is quadratic in $x$. The right panel follows the line $y = 0$.

# %%
n_grid = 80 if SMALL else 300
gx, gy = np.meshgrid(np.linspace(-5, 5, n_grid), np.linspace(-4, 4, n_grid))
grid = np.column_stack([gx.ravel(), gy.ravel()])
rgb = gmm.responsibilities(grid, means3, variances3, weights3).reshape(n_grid, n_grid, 3)

line = np.column_stack([np.linspace(-5, 5, 400), np.zeros(400)])
resp_line = gmm.responsibilities(line, means3, variances3, weights3)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
ax0.imshow(rgb, origin="lower", extent=(-5, 5, -4, 4), aspect="auto")
ax0.scatter(*means3.T, c="white", edgecolors="black", s=60, label="means")
ax0.axhline(0, color="white", lw=0.8, ls="--")
ax0.set(title=r"responsibilities as colour ($\gamma_1,\gamma_2,\gamma_3$ = R, G, B)", xlabel="$x_1$", ylabel="$x_2$")
ax0.legend(loc="upper left")
for k, c in enumerate(["tab:red", "tab:green", "tab:blue"]):
    ax1.plot(line[:, 0], resp_line[:, k], color=c, label=rf"$\gamma_{k + 1}$")
ax1.plot(line[:, 0], resp_line.sum(axis=1), color="black", ls=":", label="sum")
ax1.set(title="along the line $x_2 = 0$", xlabel="$x_1$", ylim=(-0.05, 1.05))
ax1.legend()
plt.show()

# %% [markdown]
# ## 2. Why the formula as written fails
#
# The naive code exponentiates first. A float64 `exp` overflows above
# $\ell \approx 709.8$ and underflows to exactly 0 below $\ell \approx -745$.
# Both are easy to reach:
#
# * a point $x$ that lies $40$ standard deviations from every component has
#   $\ell_k \approx -800$ for all $k$: every density is 0 and Bayes' rule
#   returns $0/0 = $ `nan`, although the posterior is perfectly well defined
#   (some component is still far *less* unlikely than the others);
# * tiny variances give huge densities: $(2\pi\sigma^2)^{-d/2}$ is $10^{370}$
#   for $\sigma^2 = 10^{-8}$, $d = 100$, and $\infty/\infty = $ `nan`.
#
# ### Log-sum-exp with the per-row maximum
#
# The cure is to never exponentiate a raw log-density. For any constant $c$,
#
# $$
# \log \sum_m e^{\ell_m} = c + \log \sum_m e^{\ell_m - c},
# \qquad
# \gamma_k = \frac{e^{\ell_k - c}}{\sum_m e^{\ell_m - c}} .
# $$
#
# Choose $c = \ell^\star = \max_m \ell_m$, **the maximum of that row**. Then
# the largest term is $e^0 = 1$ exactly, nothing overflows, and the sum lies in
# $[1, K]$, so its logarithm is in $[0, \log K]$: nothing underflows to
# $\log 0$ either. Terms that do underflow are smaller than $10^{-308}$
# relative to the largest and cannot change the sum.
#
# Subtracting one maximum for the *whole array* is not enough: a row whose own
# maximum lies far below the global one still underflows entirely.

# %%
def naive_logsumexp(a):
    return np.log(np.sum(np.exp(a), axis=1))


def global_max_logsumexp(a):
    m = np.max(a)  # one maximum for the whole array: the anti-pattern
    return m + np.log(np.sum(np.exp(a - m), axis=1))


a = np.array(
    [
        [1000.0, 999.0, 998.0],  # overflows without a shift
        [-1000.0, -1001.0, -1002.0],  # underflows without a shift
        [0.5, -0.5, 0.0],  # harmless
    ]
)
with np.errstate(all="ignore"):  # the failures are the point; silence numpy's warnings about them
    print("naive:      ", naive_logsumexp(a))
    print("global max: ", global_max_logsumexp(a))
print("per-row max:", gmm.logsumexp(a, axis=1))
print("scipy:      ", special.logsumexp(a, axis=1))

# %% [markdown]
# Against SciPy's independent `logsumexp`, over rows whose scales range from
# $10^{-3}$ to $10^{300}$: after the shift, the sum has at most $K$ terms in
# $[0, 1]$, so the result carries a few rounding errors relative to its size.

# %%
n_rows = 200 if SMALL else 20000
rng = np.random.default_rng(2)
scales = 10.0 ** rng.uniform(-3, 300, size=(n_rows, 1))
a_wide = rng.normal(size=(n_rows, 8)) * scales
ref = special.logsumexp(a_wide, axis=1)
err_lse = np.max(np.abs(gmm.logsumexp(a_wide, axis=1) - ref) / np.maximum(1.0, np.abs(ref)))
print(f"max relative error vs scipy: {err_lse:.1e}  ({err_lse / EPS:.1f} eps)")
assert err_lse <= 4 * EPS

# %% [markdown]
# ### The adversarial mixture: $|x| \sim 10^4$, $\sigma^2 \sim 10^{-8}$
#
# Four components centred near $(10^4, -10^4, 10^4)$, $10^{-4}$ apart, with
# standard deviations $\sim 10^{-4}$. Half of the points are close to the
# components, half are $\sim 10^{-2}$ away (about 100 standard deviations).
# The reference is the direct log-joint followed by SciPy's softmax: there
# $x - \mu$ is formed first, and it is *exact* in float64 (Sterbenz: the
# difference of two floats within a factor 2 of each other is representable),
# so the only rounding is in small terms.

# %%
def adversarial_mixture(rng, n_points, K=4, d=3):
    centre = 1e4 * np.array([1.0, -1.0, 1.0])[:d]
    means = centre + 3e-4 * rng.normal(size=(K, d))
    variances = 1e-8 * rng.uniform(0.5, 2.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    x = centre + 3e-4 * rng.normal(size=(n_points, d))
    x[::2] += 1e-2 * rng.normal(size=(len(x[::2]), d))  # every other point: ~100 sd away
    return x, means, variances, weights


xa, ma, va, wa = adversarial_mixture(np.random.default_rng(3), 400 if SMALL else 20000)
with np.errstate(all="ignore"):
    resp_naive = naive_responsibilities(xa, ma, va, wa)
log_joint_ref = direct_log_joint(xa, ma, va, wa)
resp_ref = special.softmax(log_joint_ref, axis=1)
resp_ours = gmm.responsibilities(xa, ma, va, wa)

frac_nan = np.mean(np.any(~np.isfinite(resp_naive), axis=1))
err_ours = np.max(np.abs(resp_ours - resp_ref))
# the log-joint reaches |l| ~ q_max; rounding a number that large costs ~ eps q_max,
# and a responsibility moves by at most that much when every l_k does
q_max = np.max(np.abs(log_joint_ref))
tol_adv = 16 * EPS * q_max
print(f"log-joint values up to {q_max:.1e}")
print(f"naive: {frac_nan:.0%} of the rows are nan or inf")
print(f"refimpl vs direct: max |error| {err_ours:.1e}  (tolerance 16 eps q_max = {tol_adv:.1e})")
print(f"refimpl |row sum - 1|: {np.max(np.abs(resp_ours.sum(axis=1) - 1)):.1e}")
assert frac_nan > 0.3  # the naive formula fails on (at least) the far half of the points
assert np.all(np.isfinite(resp_ours))
assert err_ours <= tol_adv
assert np.max(np.abs(resp_ours.sum(axis=1) - 1)) <= 8 * EPS

# %% [markdown]
# ## 3. The quadratic form by matrix products, and why we centre first
#
# The direct log-joint builds an $N \times K \times d$ array of differences.
# For attention, $N$ is the sequence length and that array is too big. Expand
# the square instead:
#
# $$
# \sum_j \frac{(x_{ij} - \mu_{kj})^2}{\sigma_{kj}^2}
#   = \underbrace{\sum_j \frac{x_{ij}^2}{\sigma_{kj}^2}}_{(X\odot X)(1/\sigma^2)^\top}
#   \;-\; 2\underbrace{\sum_j \frac{x_{ij}\mu_{kj}}{\sigma_{kj}^2}}_{X(\mu/\sigma^2)^\top}
#   \;+\; \underbrace{\sum_j \frac{\mu_{kj}^2}{\sigma_{kj}^2}}_{\text{one row vector}} .
# $$
#
# Two matrix products, $O(NKd)$ time and only $N \times K$ memory. But the
# three terms are each of size $\|x\|^2/\sigma^2$, while their sum is the small
# Mahalanobis distance. Each term is rounded to a relative $\varepsilon$, so the
# sum carries an absolute error of about
#
# $$
# \varepsilon\, \|x\|^2 / \sigma^2 ,
# $$
#
# which for $|x_j| = 10^4$, $\sigma^2 = 10^{-8}$, $d = 3$ is $\approx 7$: every
# digit of a distance of order one is lost, and with it the posterior.
#
# The fix is free: $(x - \mu)^2$ does not change if $x$ and $\mu$ are shifted by
# the same vector $c$. Take $c$ = the mean of the component means. After the
# shift both $x - c$ and $\mu - c$ are small exactly where the posterior is
# sensitive (near the components); far from them, the distance itself is large
# and its relative error stays small. This is what `refimpl.gmm` does.
#
# We measure the error of both expansions against the direct difference as
# the data move away from the origin with $\sigma^2 = 10^{-8}$ fixed.

# %%
def expanded_quadratic(x, means, variances, centre=None):
    """sum_j (x_j - mu_kj)^2 / s_kj by two matrix products; optionally shift by `centre` first."""
    if centre is not None:
        x, means = x - centre, means - centre
    p = 1.0 / variances
    return (x * x) @ p.T - 2.0 * (x @ (means * p).T) + np.sum(means * means * p, axis=1)


d_q, K_q = 3, 4
rng = np.random.default_rng(4)
offsets = 10.0 ** np.arange(0, 5.5, 0.5)
err_uncentred, err_centred = [], []
for off in offsets:
    c = off * np.ones(d_q)
    m = c + 1e-4 * rng.normal(size=(K_q, d_q))
    xx = c + 1e-4 * rng.normal(size=(100 if SMALL else 2000, d_q))
    v = np.full((K_q, d_q), 1e-8)
    exact = np.sum((xx[:, None, :] - m[None]) ** 2 / v, axis=2)  # differences are exact here (Sterbenz)
    err_uncentred.append(np.max(np.abs(expanded_quadratic(xx, m, v) - exact)))
    err_centred.append(np.max(np.abs(expanded_quadratic(xx, m, v, centre=m.mean(axis=0)) - exact)))
err_uncentred, err_centred = np.array(err_uncentred), np.array(err_centred)
predicted = EPS * d_q * offsets**2 / 1e-8  # eps ||x||^2 / sigma^2

fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(offsets, err_uncentred, "o-", label="expanded, uncentred")
ax.loglog(offsets, err_centred, "s-", label="expanded after centring on the means")
ax.loglog(offsets, predicted, "k--", label=r"prediction $\varepsilon\|x\|^2/\sigma^2$")
ax.set(xlabel="$|x_j|$ (distance of the data from the origin)", ylabel="max abs error of the quadratic form",
       title=r"cancellation in the expansion ($\sigma^2 = 10^{-8}$)")
ax.legend(loc="lower right", bbox_to_anchor=(1.0, 0.12))
plt.show()

ratio = err_uncentred[offsets >= 10] / predicted[offsets >= 10]
print("uncentred error / prediction:", np.round(ratio, 2))
print(f"uncentred error at |x| = 1e4: {err_uncentred[offsets == 1e4][0]:.1f}")
print(f"centred error, worst offset:  {err_centred.max():.1e}")
assert np.all((ratio > 0.1) & (ratio < 10))  # the error model eps ||x||^2 / sigma^2 holds
assert err_uncentred[offsets == 1e4][0] > 1.0  # an O(1) distance has no correct digit left
assert err_centred.max() < 1e-12  # centring removes the growth entirely

# %% [markdown]
# ## 4. Reparameterisation: softplus with a floor, softmax of logits
#
# Gradient descent moves parameters anywhere in $\mathbb R$. Variances must
# stay positive (and, for the stability theory of later lessons, bounded below)
# and weights must stay on the simplex. So GMA learns raw parameters $s$ and
# $a$ and maps them:
#
# $$
# \sigma^2 = \operatorname{softplus}(s) + \sigma^2_{\min},
# \qquad \operatorname{softplus}(s) = \log(1 + e^s),
# \qquad \pi = \operatorname{softmax}(a).
# $$
#
# **Softplus, stably.** $\log(1 + e^s)$ as written overflows for $s > 709$ and
# returns exactly 0 for $s < -37$ (because $1 + e^{s}$ rounds to 1), although
# the answer there is $\approx e^s > 0$. Writing
# $\operatorname{softplus}(s) = \max(s, 0) + \log(1 + e^{-|s|})$ (NumPy's
# `logaddexp(0, s)`, which `refimpl.gmm.softplus` uses) exponentiates only
# non-positive numbers. Three independent checks:
#
# * the identity $\operatorname{softplus}(s) - \operatorname{softplus}(-s) = s$;
# * the left tail: $\operatorname{softplus}(s) = e^s - e^{2s}/2 + \dots$, so for
#   $s \le -20$, $\operatorname{softplus}(s)/e^s = 1$ to within $e^{s}/2 < 10^{-9}$;
# * the right tail: for $s \ge 40$, $\operatorname{softplus}(s) = s$ in float64.

# %%
s_naive = np.array([-50.0, -38.0, 0.0, 38.0, 800.0])
with np.errstate(over="ignore"):
    print("naive log(1 + e^s):", np.log(1 + np.exp(s_naive)))
print("refimpl softplus:  ", gmm.softplus(s_naive))

s_mid = np.linspace(-30, 30, 1001)
err_identity = np.max(np.abs(gmm.softplus(s_mid) - gmm.softplus(-s_mid) - s_mid) / np.maximum(1, np.abs(s_mid)))
s_left = np.linspace(-700, -20, 1001)
err_left = np.max(np.abs(gmm.softplus(s_left) / np.exp(s_left) - 1) - np.exp(s_left) / 2)
s_right = np.concatenate([np.linspace(40, 1e3, 100), [1e10, 1e300]])
print(f"identity error {err_identity:.1e}, left tail {err_left:.1e}, right tail exact: "
      f"{np.array_equal(gmm.softplus(s_right), s_right)}")
assert err_identity <= 4 * EPS and err_left <= 4 * EPS
assert np.array_equal(gmm.softplus(s_right), s_right)

# %% [markdown]
# **The floor.** $\sigma^2 \ge \sigma^2_{\min}$ for every raw value, with
# equality once $e^s$ underflows, and the inverse map recovers $s$ where it is
# well conditioned. (Where $\operatorname{softplus}(s) \ll \sigma^2_{\min}$ the
# floor swamps it and the inverse is ill conditioned: adding $10^{-6}$ to
# $10^{-20}$ keeps nothing of the $10^{-20}$. That is the price of the floor,
# and it is harmless: the map is then flat and so is the loss.)
#
# **The derivative** of the map is $\frac{d\sigma^2}{ds} = \frac{e^s}{1 + e^s}
# = \operatorname{sigmoid}(s)$; we check it by central differences. Their error
# is the truncation $h^2 f'''/6 \le h^2/60$ plus the rounding
# $\varepsilon |f| / h$, below $10^{-9}$ with $h = 10^{-5}$ and $|s| \le 30$.

# %%
floor = 1e-6
s_all = np.concatenate([[-1e300, -1e3, -800.0], np.linspace(-40, 40, 801)])
var = gmm.variances_from_raw(s_all, min_variance=floor)
assert np.all(var >= floor) and var[0] == floor and var[1] == floor

s_ok = np.linspace(-10, 30, 801)
err_round_trip = np.max(np.abs(gmm.raw_from_variances(gmm.variances_from_raw(s_ok, floor), floor) - s_ok) / np.maximum(1, np.abs(s_ok)))

s_fd = np.linspace(-30, 30, 601)
h = 1e-5
fd = (gmm.variances_from_raw(s_fd + h, floor) - gmm.variances_from_raw(s_fd - h, floor)) / (2 * h)
err_fd = np.max(np.abs(fd - gmm.sigmoid(s_fd)))
print(f"round trip s -> sigma^2 -> s on [-10, 30]: {err_round_trip:.1e}")
print(f"d sigma^2 / ds = sigmoid(s), central differences: {err_fd:.1e}")
assert err_round_trip < 1e-12
assert err_fd < 1e-9

# %% [markdown]
# **Weights.** $\pi = \operatorname{softmax}(a)$ is positive and sums to one for
# every $a$, is unchanged by adding a constant to all logits (one of the $K$
# logits is redundant), and, computed with the maximum subtracted, copes with
# logits of any size. Its log has the Jacobian
# $\partial \log\pi_k / \partial a_m = \delta_{km} - \pi_m$, which we check by
# central differences as well; this Jacobian is why, in the GMA backward pass,
# the gradient with respect to a logit is just the responsibility-weighted
# term $c_m$, with no extra prior term.

# %%
logits = np.array([2.0, -1.0, 0.5, 3.0, -4.0, 0.0])
pi = gmm.weights_from_logits(logits)
err_shift = np.max(np.abs(gmm.weights_from_logits(logits + 1e3) - pi))
huge = gmm.weights_from_logits(np.array([1e300, 0.0, -1e300]))

jac = np.eye(6) - pi[None, :]  # row k, column m: delta_km - pi_m
h = 1e-5
jac_fd = np.empty((6, 6))
for m in range(6):
    e = np.zeros(6)
    e[m] = h
    jac_fd[:, m] = (np.log(gmm.weights_from_logits(logits + e)) - np.log(gmm.weights_from_logits(logits - e))) / (2 * h)
err_jac = np.max(np.abs(jac - jac_fd))
# central differences: truncation h^2 |f'''| / 6 <= h^2, rounding ~ eps |log pi| / h
tol_jac = h**2 + 4 * EPS * np.max(np.abs(np.log(pi))) / h
print(f"sum of weights - 1: {abs(pi.sum() - 1):.1e}; shift by 1e3 changes them by {err_shift:.1e}")
print(f"logits (1e300, 0, -1e300) give {huge}")
print(f"Jacobian of log softmax vs central differences: {err_jac:.1e}  (tolerance {tol_jac:.1e})")
assert abs(pi.sum() - 1) <= 4 * EPS
assert err_shift < 1e-13  # a + 1e3 is rounded to ~1e-13 absolute; softmax sees only that
assert np.array_equal(huge, [1.0, 0.0, 0.0])
assert err_jac <= tol_jac

# %% [markdown]
# ## 5. Agreement with scikit-learn
#
# scikit-learn's `GaussianMixture(covariance_type="diag")` is an independent
# implementation of the same posterior. We do not fit it; we set its
# parameters by hand (`means_`, `covariances_`, `weights_`, and the Cholesky
# factor of the precisions, which for a diagonal covariance is
# $1/\sigma$ elementwise) and compare `predict_proba` with
# `gmm.responsibilities` and `score_samples` with `gmm.log_likelihood`.
#
# On well-scaled data every log-joint is a sum of a few terms of size $O(10)$,
# so both implementations are within a few tens of $\varepsilon$ of the truth
# and of each other: we allow $10^{-13}$.

# %%
def sklearn_mixture(means, variances, weights):
    g = GaussianMixture(n_components=len(weights), covariance_type="diag")
    g.means_, g.covariances_, g.weights_ = means, variances, weights
    g.precisions_cholesky_ = 1.0 / np.sqrt(variances)
    return g


K5, d5 = 5, 4
rng = np.random.default_rng(5)
m5 = rng.normal(size=(K5, d5)) * 1.5
v5 = rng.uniform(0.3, 2.0, size=(K5, d5))
w5 = rng.dirichlet(np.ones(K5))
x5 = rng.normal(size=(300 if SMALL else 20000, d5)) * 1.5
sk = sklearn_mixture(m5, v5, w5)
err_proba = np.max(np.abs(sk.predict_proba(x5) - gmm.responsibilities(x5, m5, v5, w5)))
ll_sk = sk.score_samples(x5)
err_score = np.max(np.abs(ll_sk - gmm.log_likelihood(x5, m5, v5, w5)) / np.maximum(1, np.abs(ll_sk)))
print(f"predict_proba vs responsibilities: {err_proba:.1e}")
print(f"score_samples vs log_likelihood (relative): {err_score:.1e}")
assert err_proba < 1e-13 and err_score < 1e-13

# %% [markdown]
# On the adversarial mixture of section 2, scikit-learn is *not* a reference.
# Its diagonal code (version 1.9 at the time of writing) evaluates the
# uncentred expansion of section 3,
# `sum(means**2 * precisions) - 2 X @ (means * precisions).T + X**2 @ precisions.T`,
# so there it loses every digit, as the error model predicts. We print its
# error rather than assert it: that is a property of another library's
# version, not of the derivation. The direct evaluation remains the reference,
# and `refimpl.gmm` stays within the tolerance derived above.

# %%
err_sklearn_adv = np.max(np.abs(sklearn_mixture(ma, va, wa).predict_proba(xa) - resp_ref))
print(f"scikit-learn {sklearn.__version__} on the adversarial mixture: max |error| {err_sklearn_adv:.2g}")
print(f"refimpl on the adversarial mixture: max |error| {err_ours:.1e}")
assert err_ours <= tol_adv

# %% [markdown]
# ## Summary
#
# | what | measured | allowed |
# |---|---|---|
# | refimpl vs naive and direct, well scaled | a few $\varepsilon$ | $16\varepsilon$ |
# | log-sum-exp vs SciPy, scales $10^{-3}$ to $10^{300}$ | $\le 4\varepsilon$ relative | $4\varepsilon$ |
# | posterior at $\lvert x\rvert\sim10^4$, $\sigma^2\sim10^{-8}$ | naive: `nan`; refimpl: $\ll 16\varepsilon\,\max\lvert\ell\rvert$ | $16\varepsilon\,\max\lvert\ell\rvert$ |
# | quadratic form, uncentred vs centred | $\approx \varepsilon\lVert x\rVert^2/\sigma^2$ vs $< 10^{-12}$ | model within $10\times$ |
# | softplus tails and identity, $d\sigma^2/ds$ by differences | $\le 4\varepsilon$, $< 10^{-9}$ | |
# | scikit-learn `predict_proba`, `score_samples`, well scaled | $\sim 10^{-15}$ | $10^{-13}$ |
#
# Next: GMA uses these posteriors as the rows of $\Gamma_Q$ and $\Gamma_K$
# (lesson 2), and lesson 7 returns to the mixture itself: fitting it by EM,
# which is a Newton method.
