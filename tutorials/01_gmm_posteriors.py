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
# **You will learn to**
#
# - derive the posterior of a diagonal Gaussian mixture as a softmax of
#   log-joints, and compute it with the per-row log-sum-exp so that it is
#   finite for every input;
# - explain why the quadratic form expanded into matrix products cancels,
#   and measure its error against the model $(4+\sqrt d)\,u\,s_{ik}$;
# - build the case where centring on the means is not enough (means spread
#   far apart) and fix it by recomputing the few entries near the row maximum;
# - implement the softplus-with-floor and softmax parameterisations and check
#   them and their derivatives by central differences;
# - check a library (scikit-learn) against an independent evaluation, and say
#   where it is not a reference.
#
# **Before this lesson**: no earlier lesson. You need floating-point
# arithmetic (machine epsilon, overflow and underflow, rounding to nearest),
# Gaussian densities and Bayes' rule, and matrix products in NumPy.
#
# Everything in Gaussian Mixture Attention starts from one computation: the
# posterior probability $\gamma_k(x) = p(z = k \mid x)$ that a point $x$ was
# drawn by component $k$ of a Gaussian mixture with diagonal covariances.
#
# **The claim of this lesson.** The posterior can be computed in float64 as
# accurately as its definition allows (a few rounding errors of the
# log-densities) *for every input*, including inputs where every density
# underflows to 0 or overflows to $\infty$ and means spread $10^8$ standard
# deviations apart, provided we
#
# 1. work with log-densities and subtract the **per-row** maximum before
#    exponentiating (log-sum-exp),
# 2. expand the quadratic form into matrix products only **after centring**
#    on the means, and, because centring alone does not remove the
#    cancellation when the means are far apart, **recompute from the
#    differences** $x - \mu$ the entries where the expansion may have
#    cancelled and that lie near their row maximum;
#
# and the parameters stay valid under gradient descent if we
#
# 3. map unconstrained parameters to valid ones by softplus (variances, with a
#    floor) and softmax (weights).
#
# `refimpl.gmm` does all three. We derive each step, show a textbook
# implementation failing where the step is skipped (the centred expansion
# alone included, and scikit-learn's `GaussianMixture` with it), and check
# `refimpl.gmm` against independent evaluations with `assert`s on the
# measured errors.
#
# Notation follows `docs/glossary.md`. In particular $u$ is the **machine
# epsilon** of the float type, `np.finfo(dtype).eps`, the spacing of the
# numbers near 1: $2^{-52}\approx 2.2\times10^{-16}$ in float64. Rounding to
# nearest changes a result by at most $u/2$ relative.
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

from refimpl import gmm, tuned

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
U = np.finfo(np.float64).eps  # machine epsilon u = 2^-52 = 2.2e-16, the spacing of float64 numbers near 1
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
# log-joint agree to a few units of $u = 2.2\times10^{-16}$.

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
# each entry is a ratio of a few rounded terms of order one: a few u each
assert err_naive < 16 * U and err_direct < 16 * U and err_rows < 8 * U

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
# * tiny variances give huge densities: for $\sigma^2 = 10^{-8}$ and $d = 100$,
#   $(2\pi\sigma^2)^{-d/2} = 10^{-50\log_{10}(6.28\times10^{-8})} = 10^{-50\times(-7.20)}
#   \approx 10^{360}$, far above the largest float64, $1.8\times10^{308}$:
#   every density is $\infty$, and $\infty/\infty = $ `nan`.
#
# Both, in numbers: two components in one dimension with unit variance and a
# point 40 from each, then two components with $\sigma^2 = 10^{-8}$ in
# $d = 100$ and a point between them.

# %%
log10_density = -50 * np.log10(2 * np.pi * 1e-8)  # log10 of (2 pi sigma^2)^(-d/2), sigma^2 = 1e-8, d = 100
print(f"(2 pi 1e-8)^(-50) = 10^{log10_density:.2f}; the largest float64 is 10^{np.log10(np.finfo(np.float64).max):.2f}")
assert round(log10_density) == 360 and log10_density > np.log10(np.finfo(np.float64).max)

far = (np.array([[40.0]]), np.array([[0.0], [80.0]]), np.ones((2, 1)), np.array([0.5, 0.5]))
rng = np.random.default_rng(0)
mu_tiny = 1e-4 * rng.normal(size=(2, 100))
tiny = (mu_tiny.mean(axis=0, keepdims=True), mu_tiny, np.full((2, 100), 1e-8), np.array([0.5, 0.5]))
for name, case in (("40 sd from both", far), ("sigma^2 = 1e-8, d = 100", tiny)):
    with np.errstate(all="ignore"):
        naive = naive_responsibilities(*case)
    print(f"{name:24s} naive: {naive[0]}  refimpl: {gmm.responsibilities(*case)[0]}")
    assert np.all(np.isnan(naive)) and np.all(np.isfinite(gmm.responsibilities(*case)))

# %% [markdown]
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
print(f"max relative error vs scipy: {err_lse:.1e}  ({err_lse / U:.1f} u)")
assert err_lse <= 4 * U

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
# the log-joint reaches |l| ~ q_max; rounding a number that large costs ~ u q_max,
# and a responsibility moves by at most that much when every l_k does
q_max = np.max(np.abs(log_joint_ref))
tol_adv = 16 * U * q_max
print(f"log-joint values up to {q_max:.1e}")
print(f"naive: {frac_nan:.0%} of the rows are nan or inf")
print(f"refimpl vs direct: max |error| {err_ours:.1e}  (tolerance 16 u q_max = {tol_adv:.1e})")
print(f"refimpl |row sum - 1|: {np.max(np.abs(resp_ours.sum(axis=1) - 1)):.1e}")
assert frac_nan > 0.3  # the naive formula fails on (at least) the far half of the points
assert np.all(np.isfinite(resp_ours))
assert err_ours <= tol_adv
assert np.max(np.abs(resp_ours.sum(axis=1) - 1)) <= 8 * U

# %% [markdown]
# ## 3. The quadratic form by matrix products: centring, and where it is not enough
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
# Mahalanobis distance. Each term is rounded (by up to $u/2$ relative per
# operation), so the sum carries an absolute error of about
#
# $$
# u\, \|x\|^2 / \sigma^2 ,
# $$
#
# which for $|x_j| = 10^4$, $\sigma^2 = 10^{-8}$, $d = 3$ is $\approx 7$: every
# digit of a distance of order one is lost, and with it the posterior.
#
# A first remedy costs nothing: $(x - \mu)^2$ does not change if $x$ and $\mu$
# are shifted by the same vector $c$. Take $c$ = the mean of the component
# means, as `refimpl.tuned` does (the fast path of the reference, which keeps
# the two matrix products). When the components sit close together, after
# the shift both $x - c$ and $\mu - c$ are small for the points near them,
# where the posterior is sensitive, and the cancellation is gone.
#
# We measure the error of both expansions against the direct difference as
# such a mixture (four components $10^{-4}$ apart) and its data move away
# from the origin, with $\sigma^2 = 10^{-8}$ fixed.

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
predicted = U * d_q * offsets**2 / 1e-8  # u ||x||^2 / sigma^2

fig, ax = plt.subplots(figsize=(6, 4))
ax.loglog(offsets, err_uncentred, "o-", label="expanded, uncentred")
ax.loglog(offsets, err_centred, "s-", label="expanded after centring on the means")
ax.loglog(offsets, predicted, "k--", label=r"prediction $u\|x\|^2/\sigma^2$")
ax.set(xlabel="$|x_j|$ (distance of the data from the origin)", ylabel="max abs error of the quadratic form",
       title=r"cancellation in the expansion ($\sigma^2 = 10^{-8}$)")
ax.legend(loc="lower right", bbox_to_anchor=(1.0, 0.12))
plt.show()

ratio = err_uncentred[offsets >= 10] / predicted[offsets >= 10]
print("uncentred error / prediction:", np.round(ratio, 2))
print(f"uncentred error at |x| = 1e4: {err_uncentred[offsets == 1e4][0]:.1f}")
print(f"centred error, worst offset:  {err_centred.max():.1e}")
assert np.all((ratio > 0.1) & (ratio < 10))  # the error model u ||x||^2 / sigma^2 holds
assert err_uncentred[offsets == 1e4][0] > 1.0  # an O(1) distance has no correct digit left
assert err_centred.max() < 1e-12  # centring removes the growth when the means sit close together

# %% [markdown]
# ### Centring is not enough: means far apart
#
# The shift is one vector for all components. When the means are spread
# out, their mean is far from most of them, and a point next to a component
# is as far from the centre as that component is. The smallest example:
# $d = 3$, $\sigma^2 = 10^{-8}$ ($\sigma = 10^{-4}$), two means near
# $10^4\cdot\mathbf 1$, $10^{-3}$ (ten standard deviations) apart, and a third
# at $-10^4\cdot\mathbf 1$. The centre is near $\tfrac{10^4}{3}\mathbf 1$, so a
# point next to the close pair is $\|x - c\|\approx 1.2\times10^4$ from it: the
# terms of the centred expansion are about $10^{16}$ and their rounding errors
# several units, while the distances that decide between the two close
# components are $q \approx 25$ (at the midpoint of the pair).
#
# The points lie along the segment from one close mean to the other (and a
# little beyond), plus noise of one standard deviation. The reference is the
# definition with the differences formed in `np.longdouble` (80-bit extended
# precision on x86-64, machine epsilon $1.1\times10^{-19}$) and the softmax
# taken in it too. (Where `np.longdouble` is plain float64 the reference stays
# accurate: the differences to the close pair are exact by Sterbenz's lemma,
# and the third component has no weight.) We measure the relative error of
# each row, $\max_k|\hat\gamma_{ik} - \gamma_{ik}|\,/\max_k\gamma_{ik}$, for
# three computations:
#
# - the centred expansion alone: `tuned.log_joint(..., refine=False)` returns
#   its logits, then a softmax;
# - scikit-learn's `GaussianMixture(covariance_type="diag")`, not fitted but
#   with its parameters set by hand (`means_`, `covariances_`, `weights_`, and
#   `precisions_cholesky_` $= 1/\sigma$ elementwise, the Cholesky factor of a
#   diagonal precision matrix), `predict_proba`;
# - `gmm.responsibilities`, the definition evaluated from the differences
#   $x - \mu$ (no expansion, so nothing cancels);
# - `tuned.responsibilities`, the centred expansion with the repair this
#   section derives.

# %%
def reference_log_joint(x, means, variances, weights):
    """The definition in np.longdouble, differences first: (log-joint, quadratic form q)."""
    xl, ml, vl = (np.asarray(a, dtype=np.longdouble) for a in (x, means, variances))
    diff = xl[:, None, :] - ml[None, :, :]
    q = np.sum(diff * diff / vl, axis=2)
    log_joint = np.log(np.asarray(weights, dtype=np.longdouble)) - 0.5 * np.sum(np.log(2 * np.pi * vl), axis=1) - 0.5 * q
    return log_joint, q


def reference_responsibilities(x, means, variances, weights):
    """Softmax of the reference log-joint, in np.longdouble, rounded to float64 at the end; and q."""
    log_joint, q = reference_log_joint(x, means, variances, weights)
    e = np.exp(log_joint - log_joint.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float64), q


def row_error(resp, ref):
    """Relative error of each row: max_k |resp_ik - ref_ik| / max_k ref_ik."""
    return np.max(np.abs(resp - ref), axis=1) / np.max(ref, axis=1)


def centred_expansion_responsibilities(x, means, variances, weights):
    logits, _ = tuned.log_joint(x, means, variances, np.log(weights), refine=False)
    return gmm.softmax(logits, axis=1)


def sklearn_mixture(means, variances, weights):
    g = GaussianMixture(n_components=len(weights), covariance_type="diag")
    g.means_, g.covariances_, g.weights_ = means, variances, weights
    g.precisions_cholesky_ = 1.0 / np.sqrt(variances)
    return g


def three_ways(x, means, variances, weights):
    """Row errors of the centred expansion, scikit-learn, refimpl.gmm and refimpl.tuned against the reference."""
    ref, q = reference_responsibilities(x, means, variances, weights)
    return {
        "centred expansion": row_error(centred_expansion_responsibilities(x, means, variances, weights), ref),
        "scikit-learn": row_error(sklearn_mixture(means, variances, weights).predict_proba(x), ref),
        "refimpl.gmm": row_error(gmm.responsibilities(x, means, variances, weights), ref),
        "refimpl.tuned": row_error(tuned.responsibilities(x, means, variances, weights), ref),
    }


one = np.ones(3)
means_cx = np.array([1e4 * one, 1e4 * one + 1e-3 * np.array([1.0, -1.0, 0.0]) / np.sqrt(2), -1e4 * one])
vars_cx = np.full((3, 3), 1e-8)
weights_cx = np.full(3, 1 / 3)
rng = np.random.default_rng(6)
n_cx = 200 if SMALL else 5000
tau = rng.uniform(-0.25, 1.25, size=(n_cx, 1))  # position along the segment between the close pair
x_cx = means_cx[0] + tau * (means_cx[1] - means_cx[0]) + 1e-4 * rng.normal(size=(n_cx, 3))
gamma_cx, q_cx = reference_responsibilities(x_cx, means_cx, vars_cx, weights_cx)
err_cx = three_ways(x_cx, means_cx, vars_cx, weights_cx)

i = np.argmin(np.abs(tau[:, 0] - 0.5))  # a point near the midpoint of the pair
q_exp_i = expanded_quadratic(x_cx[i : i + 1], means_cx, vars_cx, centre=means_cx.mean(axis=0))[0]
print(f"a point near the midpoint of the pair: q to the pair, reference {np.round(q_cx[i, :2].astype(float), 3)}, "
      f"centred expansion {np.round(q_exp_i[:2], 3)}")
print(f"  responsibilities: reference {np.round(gamma_cx[i], 4)}, centred expansion "
      f"{np.round(centred_expansion_responsibilities(x_cx[i : i + 1], means_cx, vars_cx, weights_cx)[0], 4)}")
print(f"relative error per row over {n_cx} points (scikit-learn {sklearn.__version__}):")
for name, e in err_cx.items():
    print(f"  {name:18s} max {e.max():.1e}, rows above 1e-12: {np.mean(e > 1e-12):4.0%}")
assert err_cx["centred expansion"].max() > 0.1  # centring alone: the close pair's posterior is wrong by O(0.1-1)
assert err_cx["scikit-learn"].max() > 0.1, (
    f"scikit-learn {sklearn.__version__} is accurate on this counterexample (row error "
    f"{err_cx['scikit-learn'].max():.1e}): its diagonal GaussianMixture no longer evaluates the uncentred "
    "expansion sum(means**2 * precisions) - 2 X @ (means * precisions).T + X**2 @ precisions.T on its own; "
    "the text of this section and of section 5, which say it fails here, must be updated"
)

# %% [markdown]
# The centred expansion gets the distances to the pair wrong by units, and
# with them the split of the posterior between the two: rows that should be
# balanced come out lopsided. scikit-learn's diagonal `GaussianMixture`
# (version 1.9 at the time of writing) evaluates the same expansion without
# even the shift,
# `sum(means**2 * precisions) - 2 X @ (means * precisions).T + X**2 @ precisions.T`,
# and fails the same way. `refimpl.gmm` is right to the last digits: it
# evaluates the definition, whose terms are all $\ge 0$. It pays for that with
# $N \times K \times d$ differences, $d$ times the work of a matrix product.
# The rest of this section says how large the expansion's error is, and how
# `refimpl.tuned` repairs it without giving up the matrix products.
#
# ### How large the error is: a rounding model
#
# Write the centred quantities as $\tilde x = x - c$, $\tilde\mu = \mu - c$ and
#
# $$
# a_{ik} = \sum_j\frac{\tilde x_{ij}^2}{\sigma_{kj}^2},\qquad
# b_{ik} = \sum_j\frac{\tilde x_{ij}\tilde\mu_{kj}}{\sigma_{kj}^2},\qquad
# c_k = \sum_j\frac{\tilde\mu_{kj}^2}{\sigma_{kj}^2},\qquad
# q_{ik} = a_{ik} - 2b_{ik} + c_k .
# $$
#
# By Cauchy–Schwarz $|b_{ik}|\le\sqrt{a_{ik}c_k}$, so the three terms together
# have the size
#
# $$
# s_{ik} = \big(\sqrt{a_{ik}} + \sqrt{c_k}\big)^2 \;\ge\; a_{ik} + 2|b_{ik}| + c_k .
# $$
#
# Counting the roundings of every operation bounds the error of the
# expansion, to first order, by
#
# $$
# |\hat q_{ik} - q_{ik}| \le \frac{d+6}{2}\,u\,s_{ik} ,
# $$
#
# and that of the definition, evaluated from the differences, by
# $\frac{d+3}{2}\,u\,q_{ik}$. `refimpl.tuned` uses the model
# $(4 + \sqrt d)\,u\,s_{ik}$ (and $(4+\sqrt d)\,u\,q_{ik}$ for the
# definition), which contains the worst case up to $d = 7$, so for $d = 3$
# here. Why these bounds: `docs/floating_point.md`, section Lesson 1. The
# expansion and the definition differ in what their error is relative to: the
# definition's error is
# relative to $q$ itself, the expansion's to $s$, and $s/q$ is the
# cancellation factor, about $10^{15}$ at the midpoint of the close pair.
# (Where the components sit close together and the data near them, as in the
# offset experiment above, $\tilde x$ and $\tilde\mu$ are small, $s$ is
# comparable to $q$ and the expansion is as good as the definition.)
#
# We check both bounds entry by entry, on the counterexample and on random
# mixtures whose means are spread up to $10^8$ standard deviations apart:
# three pairs of components, each pair about three standard deviations
# apart, the pairs $S$ standard deviations apart ($S$ from 1 to $10^8$),
# variances between $0.5$ and $2$ per coordinate, and points around the
# pairs, where the posterior splits between the two members of a pair.

# %%
def spread_mixture(rng, spread, n_points, n_pairs=3, d=3):
    """Pairs of components ~3 sd apart, pair centres ~`spread` sd apart, points around the pairs."""
    centres = spread * rng.normal(size=(n_pairs, d))
    direction = rng.normal(size=(n_pairs, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    means = np.concatenate([centres - 1.5 * direction, centres + 1.5 * direction])
    variances = rng.uniform(0.5, 2.0, size=(2 * n_pairs, d))
    weights = rng.dirichlet(np.ones(2 * n_pairs))
    x = centres[rng.integers(0, n_pairs, n_points)] + rng.normal(size=(n_points, d))
    return x, means, variances, weights


def direct_quadratic(x, means, variances):
    """q_ik from the differences, in float64 (the definition evaluated directly)."""
    diff = x[:, None, :] - means[None, :, :]
    return np.sum(diff**2 / variances, axis=2)


def term_size(x, means, variances):
    """s_ik = (sqrt(a_ik) + sqrt(c_k))^2, the size of the terms of the centred expansion."""
    centre = means.mean(axis=0)
    p = 1.0 / variances
    a = ((x - centre) ** 2) @ p.T
    c = np.sum((means - centre) ** 2 * p, axis=1)
    return (np.sqrt(a) + np.sqrt(c)) ** 2


spreads = 10.0 ** np.arange(0, 8.25, 0.5)
n_trials, n_sp = (2, 100) if SMALL else (10, 1000)
rng = np.random.default_rng(7)
spread_cases = [(S, spread_mixture(rng, S, n_sp)) for S in spreads for _ in range(n_trials)]

kappa = (4 + np.sqrt(3)) * U  # the model's factor for d = 3
bound_exp, err_exp, bound_def, err_def, case_spread = [], [], [], [], []
for S, (x_, m_, v_, _) in [(np.nan, (x_cx, means_cx, vars_cx, weights_cx))] + spread_cases:
    q_ref = reference_log_joint(x_, m_, v_, np.ones(len(m_)))[1]
    err_exp.append(np.abs(expanded_quadratic(x_, m_, v_, centre=m_.mean(axis=0)) - q_ref).astype(float).ravel())
    bound_exp.append(kappa * term_size(x_, m_, v_).ravel())
    err_def.append(np.abs(direct_quadratic(x_, m_, v_) - q_ref).astype(float).ravel())
    bound_def.append(kappa * q_ref.astype(float).ravel())
    case_spread.append(np.full(err_exp[-1].size, S))
err_exp, bound_exp, err_def, bound_def, case_spread = map(np.concatenate, (err_exp, bound_exp, err_def, bound_def, case_spread))
print(f"{err_exp.size} entries: expansion error / (4 + sqrt d) u s at most {np.max(err_exp / bound_exp):.2f}; "
      f"definition error / (4 + sqrt d) u q at most {np.max(err_def / bound_def):.2f}")
print(f"cancellation factor s / q at the midpoint of the close pair: {term_size(x_cx, means_cx, vars_cx)[i, 0] / float(q_cx[i, 0]):.1e}")
assert np.all(err_exp <= bound_exp)  # the expansion's error model, entry by entry
assert np.all(err_def <= bound_def)  # the definition's, entry by entry

fig, ax = plt.subplots(figsize=(6.5, 4.5))
shown = err_exp > 0  # exact results have no place on a log axis
sc = ax.scatter(bound_exp[shown], err_exp[shown], c=np.log10(np.nan_to_num(case_spread[shown], nan=1e9)), s=2,
                cmap="viridis", rasterized=True)
lim = np.array([1e-17, 1e5])
ax.loglog(lim, lim, "k--", lw=1, label=r"error $=$ model $(4+\sqrt{d})\,u\,s_{ik}$")
ax.set(xlabel=r"model $(4+\sqrt{d})\,u\,s_{ik}$", ylabel=r"measured $|\hat q_{ik} - q_{ik}|$, centred expansion",
       xlim=lim, ylim=(1e-19, 1e5), title="error of the centred expansion, entry by entry")
fig.colorbar(sc, ax=ax, label=r"$\log_{10}$ spread $S$ (9: the counterexample)")
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# Every point lies below the diagonal: the model bounds the measured error of
# every entry, from the mixtures whose pairs overlap ($S = 1$, lower left,
# errors of a few $u$) to the counterexample and $S = 10^8$ (upper right),
# where the error reaches units. The cloud runs parallel to the diagonal: the
# error follows the size of the terms, $s$, over some 18 orders of magnitude,
# not the distance $q$ that the posterior needs. Each entry's error is 0 or
# a fraction of the model (the largest fraction is printed above).
#
# ### The fix: recompute the entries near the row maximum
#
# The model tells, for every entry, how wrong the expansion can be, and a
# logit $\ell_{ik}$ carries $-q_{ik}/2$, hence at most
# $e_{ik} = \tfrac12(4 + \sqrt d)\,u\,s_{ik}$ of error. `tuned.log_joint`
# recomputes an entry from its differences $x_i - \mu_k$ (the definition,
# $O(d)$ work) when two things hold:
#
# 1. **cancellation may have spoiled it**: $e_{ik}$ exceeds
#    `tuned.EXACT_LOGIT_TOL` $\cdot\,u = 2048u\approx4.5\times10^{-13}$, and
#    $s_{ik} >$ `tuned.CANCELLATION_RATIO` $\cdot\,q_{ik} = 16\,q_{ik}$ (more than
#    four bits lost to cancellation; below that ratio the expansion is within
#    16 times the definition's own error);
# 2. **it may lie near its row maximum**: within `window` of
#    $\max_j(\ell_{ij} - e_{ij})$, a lower bound on the row's maximum that
#    only uses entries the model vouches for. For a posterior the window is
#    $\log(K/(2048u))$: an entry further below carries less than $2048u/K$ of
#    the largest weight, whatever its error. With `window=np.inf` (the
#    default of `tuned.log_joint`, used for log-densities) every spoiled entry
#    is recomputed.
#
# A screen in $O(Nd)$ clears the rows where no entry can be spoiled, so
# ordinary inputs pay nothing. In the counterexample both members of the
# close pair are spoiled (their error bounds are tens of units) and may lie
# near the row maximum: at most two recomputations of $d = 3$ terms per
# point. The far component is not spoiled
# ($s\approx q$: its terms are no larger than its distance, about
# $10^{17}$) and is left as it is. `refine=False` switches the recomputation
# off: that is the centred expansion measured above.
#
# **The tolerance.** The logits that share a posterior are exact to
# $2048u$, or recomputed with the definition's own error, small while their
# distances $q$ stay below 100 (checked below), so every row is within
# $2\times2048u\approx9.1\times10^{-13}$ of the reference: we assert
# $10^{-12}$ for `refimpl.gmm` and `refimpl.tuned`, on the counterexample and
# at every spread, and
# that the centred expansion misses it once the spread exceeds $10^3$
# standard deviations. Why this tolerance: `docs/floating_point.md`, section
# Lesson 1.

# %%
def q_sharing(x, means, variances, weights):
    """q_ik of the entries whose logit lies within log(K / (2048 u)) of the row maximum (else nan), and their count."""
    log_joint, q = reference_log_joint(x, means, variances, weights)
    window = np.log(len(weights) / (tuned.EXACT_LOGIT_TOL * U))
    near = log_joint >= log_joint.max(axis=1, keepdims=True) - window
    return np.where(near, q, np.nan).astype(float), near.sum(axis=1)


q_share_cx, n_near_cx = q_sharing(x_cx, means_cx, vars_cx, weights_cx)
q_share = max([np.nanmax(q_share_cx)] + [np.nanmax(q_sharing(*c_)[0]) for _, c_ in spread_cases])
s_far = term_size(x_cx, means_cx, vars_cx)[:, 2] / q_cx[:, 2].astype(float)
print(f"counterexample: entries near the row maximum per row {np.unique(n_near_cx)}; far component s / q in "
      f"[{s_far.min():.2f}, {s_far.max():.2f}]")
print(f"largest q near a row maximum, all inputs: {q_share:.0f}; the definition's logit error there "
      f"(4 + sqrt d) u q / 2 = {kappa * q_share / 2:.1e}")
assert kappa * q_share / 2 < 1e-13  # the premise of the 1e-12 tolerance

by_spread = {name: np.zeros(len(spreads)) for name in ("centred expansion", "scikit-learn", "refimpl.gmm", "refimpl.tuned")}
for j, (S, case) in enumerate(spread_cases):
    for name, e in three_ways(*case).items():
        by_spread[name][j // n_trials] = max(by_spread[name][j // n_trials], e.max())
print("spread S | worst row error: centred expansion | scikit-learn | refimpl.gmm | refimpl.tuned")
for j in range(0, len(spreads), 2):
    print(f"  {spreads[j]:6.0e} | {by_spread['centred expansion'][j]:33.1e} | {by_spread['scikit-learn'][j]:12.1e} | "
          f"{by_spread['refimpl.gmm'][j]:11.1e} | {by_spread['refimpl.tuned'][j]:.1e}")

fig, ax = plt.subplots(figsize=(7, 4))
for name, style in (("centred expansion", "o-"), ("scikit-learn", "s--"), ("refimpl.gmm", "^-"), ("refimpl.tuned", "v:")):
    ax.loglog(spreads, np.maximum(by_spread[name], 1e-17), style, label=name)
ax.axhline(1e-12, color="0.5", ls=":", label="$10^{-12}$, the tolerance")
ax.set(xlabel="spread of the pairs of components $S$ (standard deviations)",
       ylabel="worst relative error of a row", title="responsibilities of mixtures spread far apart", ylim=(1e-17, 10))
ax.legend(loc="upper left")
plt.show()

for name in ("refimpl.gmm", "refimpl.tuned"):
    assert err_cx[name].max() < 1e-12  # the counterexample, right to rounding
    assert np.all(by_spread[name] < 1e-12)  # every spread, up to 1e8 sd
assert np.all(by_spread["centred expansion"][spreads >= 1e3] > 1e-12)  # centring alone does not reach it
assert by_spread["centred expansion"][-1] > 0.1  # and at 1e8 sd it has no correct digit

# %% [markdown]
# The centred expansion's error grows like the size of its terms, $u S^2$,
# and reaches order one at $S\approx10^8$; scikit-learn's follows it (its
# terms are larger still, as it does not centre). `refimpl.gmm` (the
# definition) and `refimpl.tuned` (the repaired expansion) stay at the
# rounding level of the definition at every spread. What the check does not
# show: float32 (there $u = 1.2\times10^{-7}$ and the same screen applies with
# its own $u$), and $d$ well above 7, where the $\sqrt d$ model is the typical
# rather than the worst case.

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
#   $s \le -20$, $\operatorname{softplus}(s)/e^s = 1$ to within
#   $e^{s}/2 \le e^{-20}/2 = 1.03\times10^{-9}$;
# * the right tail: for $s \ge 40$, $\operatorname{softplus}(s) = s$ in float64.

# %%
s_naive = np.array([-50.0, -38.0, 0.0, 38.0, 800.0])
with np.errstate(over="ignore"):
    print("naive log(1 + e^s):", np.log(1 + np.exp(s_naive)))
print("refimpl softplus:  ", gmm.softplus(s_naive))

s_mid = np.linspace(-30, 30, 1001)
err_identity = np.max(np.abs(gmm.softplus(s_mid) - gmm.softplus(-s_mid) - s_mid) / np.maximum(1, np.abs(s_mid)))
s_left = np.linspace(-700, -20, 1001)
assert 1.0e-9 < np.exp(s_left).max() / 2 < 1.1e-9  # the size of the left tail's correction term, e^-20 / 2
err_left = np.max(np.abs(gmm.softplus(s_left) / np.exp(s_left) - 1) - np.exp(s_left) / 2)
s_right = np.concatenate([np.linspace(40, 1e3, 100), [1e10, 1e300]])
print(f"identity error {err_identity:.1e}, left tail {err_left:.1e}, right tail exact: "
      f"{np.array_equal(gmm.softplus(s_right), s_right)}")
assert err_identity <= 4 * U and err_left <= 4 * U
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
# $u |f| / h$, below $10^{-9}$ with $h = 10^{-5}$ and $|s| \le 30$.

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
# central differences: truncation h^2 |f'''| / 6 <= h^2, rounding ~ u |log pi| / h
tol_jac = h**2 + 4 * U * np.max(np.abs(np.log(pi))) / h
print(f"sum of weights - 1: {abs(pi.sum() - 1):.1e}; shift by 1e3 changes them by {err_shift:.1e}")
print(f"logits (1e300, 0, -1e300) give {huge}")
print(f"Jacobian of log softmax vs central differences: {err_jac:.1e}  (tolerance {tol_jac:.1e})")
assert abs(pi.sum() - 1) <= 4 * U
assert err_shift < 1e-13  # a + 1e3 is rounded to ~1e-13 absolute; softmax sees only that
assert np.array_equal(huge, [1.0, 0.0, 0.0])
assert err_jac <= tol_jac

# %% [markdown]
# ## 5. Agreement with scikit-learn
#
# scikit-learn's `GaussianMixture(covariance_type="diag")` is an independent
# implementation of the same posterior. As in section 3 we do not fit it; we
# set its parameters by hand (`sklearn_mixture` above) and compare
# `predict_proba` with `gmm.responsibilities` and `score_samples` with
# `gmm.log_likelihood`.
#
# On well-scaled data every log-joint is a sum of a few terms of size $O(10)$,
# so both implementations are within a few tens of $u$ of the truth
# and of each other: we allow $10^{-13}$.

# %%
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
# Away from well-scaled data, scikit-learn is *not* a reference. Its diagonal
# code (version 1.9 at the time of writing) evaluates the uncentred expansion
# of section 3,
# `sum(means**2 * precisions) - 2 X @ (means * precisions).T + X**2 @ precisions.T`,
# so it loses every digit on the adversarial mixture of section 2 (all means
# near $10^4$, where centring alone would have been enough), as the error
# model $u\|x\|^2/\sigma^2$ predicts, and, as section 3 measured, on means
# spread far apart. The assertions below record that behaviour of another
# library so that this text notices if it changes; the reference remains the
# direct evaluation, and `refimpl.gmm` stays within the tolerances derived
# above.

# %%
err_sklearn_adv = np.max(np.abs(sklearn_mixture(ma, va, wa).predict_proba(xa) - resp_ref))
print(f"scikit-learn {sklearn.__version__} on the adversarial mixture: max |error| {err_sklearn_adv:.2g}")
print(f"refimpl on the adversarial mixture: max |error| {err_ours:.1e}")
print(f"counterexample of section 3, worst row error: scikit-learn {err_cx['scikit-learn'].max():.2g}, "
      f"refimpl {err_cx['refimpl.gmm'].max():.1e}")
assert err_ours <= tol_adv
assert err_sklearn_adv > 0.1, (
    f"scikit-learn {sklearn.__version__} is accurate on the adversarial mixture (max error {err_sklearn_adv:.1e}): "
    "its diagonal GaussianMixture no longer evaluates the uncentred expansion; update the text of this section"
)

# %% [markdown]
# ## Summary
#
# | what | measured | allowed |
# |---|---|---|
# | refimpl vs naive and direct, well scaled | a few $u$ | $16u$ |
# | log-sum-exp vs SciPy, scales $10^{-3}$ to $10^{300}$ | $\le 4u$ relative | $4u$ |
# | posterior at $\lvert x\rvert\sim10^4$, $\sigma^2\sim10^{-8}$ | naive: `nan`; refimpl: $\ll 16u\,\max\lvert\ell\rvert$ | $16u\,\max\lvert\ell\rvert$ |
# | quadratic form, uncentred vs centred, means close together | $\approx u\lVert x\rVert^2/\sigma^2$ vs $< 10^{-12}$ | model within $10\times$ |
# | centred expansion, entry by entry, means spread up to $10^8\sigma$ | below a third of the model | $(4+\sqrt d)\,u\,s_{ik}$ |
# | posterior, close pair far from a third mean: centred expansion, scikit-learn, refimpl | $O(0.1$–$1)$, $O(0.1$–$1)$, $\sim10^{-15}$ per row | refimpl: $10^{-12}$ |
# | posterior, means spread up to $10^8\sigma$: centred expansion vs refimpl | up to $1$ vs $\sim10^{-15}$ per row | refimpl: $10^{-12}$ |
# | softplus tails and identity, $d\sigma^2/ds$ by differences | $\le 4u$, $< 10^{-9}$ | |
# | scikit-learn `predict_proba`, `score_samples`, well scaled | $\sim 10^{-15}$ | $10^{-13}$ |
# | scikit-learn, adversarial mixture and counterexample | $O(1)$: uncentred expansion | (recorded, not a tolerance) |
#
# Next: GMA uses these posteriors as the rows of $\Gamma_Q$ and $\Gamma_K$
# (lesson 2), and lesson 7 returns to the mixture itself: fitting it by EM,
# which is a Newton method.

# %% [markdown]
# ## Exercises
#
# Four exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell after it; until you answer, the check
# prints that the exercise is not done yet, and a wrong answer raises an
# `AssertionError` that says what is wrong. Each exercise runs on its own
# after the first code cell of the lesson (the imports). Worked solutions are
# in `tutorials/solutions/lesson_01.py`: try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises come after the lesson)

# %% [markdown]
# ### Exercise 1.1 ★ Log-sum-exp with the per-row maximum
#
# Write `logsumexp_rows(a)`: for an array `a` of shape `(N, K)`, return the
# `(N,)` array of $\log\sum_k e^{a_{ik}}$. The check feeds rows of size up to
# $10^{300}$, rows of very different scales in one array, and entries
# $-\infty$ (a component of weight 0); it compares with SciPy's `logsumexp`
# to $8u$ relative. Section 2, "Log-sum-exp with the per-row maximum", has
# the argument; do not call `special.logsumexp` or `gmm.logsumexp`.

# %%
def logsumexp_rows(a):
    """log sum_k exp(a[i, k]) for each row i of a (N, K); returns shape (N,)."""
    raise NotImplementedError("exercise 1.1")


# %%
check("1.1", logsumexp_rows)

# %% [markdown]
# ### Exercise 1.2 ★★ Responsibilities that never overflow
#
# Write `stable_responsibilities(x, means, variances, weights)`: the
# posterior $\gamma_k(x_i)$ as an `(N, K)` array, for `x` of shape `(N, d)`,
# `means` and `variances` `(K, d)`, `weights` `(K,)`. It must stay finite and
# accurate where `naive_responsibilities` of section 1 returns `nan`: points
# 40 standard deviations from every component, and $\sigma^2 = 10^{-8}$ in
# $d = 100$, mixed with ordinary points in one array. Work with the log-joint
# $\ell_k$ of section 1 (all of its terms) and normalise each row with the
# per-row maximum; form the differences $x - \mu$ first (the arrays are
# small). Without `gmm.responsibilities`, of course.

# %%
def stable_responsibilities(x, means, variances, weights):
    """The posterior gamma (N, K) of the diagonal mixture, finite for every input."""
    raise NotImplementedError("exercise 1.2")


# %%
check("1.2", stable_responsibilities)

# %% [markdown]
# ### Exercise 1.3 ★★ Build the spread-means failure case
#
# Construct a mixture and points on which centring on the mean of the means
# is not enough: set `spread_failure_case = (x, means, variances, weights)`
# with shapes `(N, d)`, `(K, d)`, `(K, d)`, `(K,)`, $N \le 2000$,
# $2 \le K \le 20$, $d \le 10$. The check requires that the problem is well
# posed (the definition in float64 and `gmm.responsibilities` agree with an
# extended-precision reference to $10^{-12}$ per row) and that the centred
# expansion (`tuned.log_joint(..., refine=False)`, then a softmax) is wrong by
# more than $0.1$ of the largest entry in some row. Hints: section 3, "Centring
# is not enough: means far apart". Make the terms $s_{ik}$ huge while the
# distances $q_{ik}$ that decide a posterior stay small, so that $s/q$ is
# about $10^{15}$. Why does the adversarial mixture of section 2, with every
# mean near $10^4$, not qualify?

# %%
spread_failure_case = ...

# %%
check("1.3", spread_failure_case)

# %% [markdown]
# ### Exercise 1.4 ★★★ Fix it: choose the entries to recompute
#
# Write `entries_to_recompute(x, means, variances, weights)`, returning an
# `(N, K)` boolean mask of the logits to recompute from the differences
# $x_i - \mu_k$. The check evaluates the centred expansion, replaces the
# flagged logits by the definition and takes the softmax. It must be
# **accurate**: every row within $10^{-12}$ of the reference, on the lesson's
# counterexample, on pairs of components spread up to $10^8$ standard
# deviations apart, and on the counterexample crowded with four more
# components about 100 standard deviations from the close pair. It must be
# **frugal**: nothing flagged on a well-scaled mixture, and no flagged entry
# more than 50 below its row maximum.
#
# Follow "The fix" in section 3: compute $a_{ik}$, $c_k$ and the expansion's
# $\hat q_{ik}$ and logits $\hat\ell_{ik}$ yourself, the error bound
# $e_{ik} = \tfrac12(4 + \sqrt d)\,u\,s_{ik}$, and flag an entry when it may
# be spoiled ($e_{ik} > 2048u$ and $s_{ik} > 16\,\hat q_{ik}$) and may lie
# near its row maximum (within $\log(K/(2048u))$ of
# $\max_m(\hat\ell_{im} - e_{im})$, allowing for its own error $e_{ik}$).
# Which of the two conditions does the crowded counterexample test?

# %%
def entries_to_recompute(x, means, variances, weights):
    """Boolean mask (N, K): the logits that cancellation may have spoiled and that may lie near their row maximum."""
    raise NotImplementedError("exercise 1.4")


# %%
check("1.4", entries_to_recompute)
