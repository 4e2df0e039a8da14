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
# # Lesson 2: Gaussian Mixture Attention, a rank-K affinity in linear time
#
# **You will learn to**
#
# - derive GMA's write-then-read form from the normalised quadratic form
#   $D^{-1}A\mathbf V$ by associativity, and implement it without the
#   $N\times N$ matrix;
# - explain the implicit affinity $A = \Gamma_Q\Gamma_K^\top$: its entries
#   are probabilities, its rank is at most $K$, and it is positive
#   semidefinite when queries are keys;
# - check that every output is a mixture of $K$ slot means, and explain how
#   the guard $\epsilon$ pulls a query with little key mass towards the origin;
# - measure peak memory and time of GMA against the explicit form as $N$ grows;
# - derive the collapse of an isotropic router to a linear softmax, and what
#   per-component diagonal variances add.
#
# **Before this lesson**: lesson 1 (responsibilities, computed stably). You
# need linear algebra (matrix products and their cost, rank, singular values,
# positive semidefinite matrices), elementary probability (independent draws)
# and floating-point rounding (machine epsilon).
#
# Softmax attention compares every query with every key: an $N \times N$
# matrix, $O(N^2)$ time and memory. Gaussian Mixture Attention (GMA) compares
# each token with $K$ learned Gaussian components instead. A shared diagonal
# GMM maps every routing query $x^Q_i$ and every routing key $x^K_j$ to its
# posterior over the components (lesson 1), the rows of two $N \times K$
# matrices $\Gamma_Q$ and $\Gamma_K$, and the output is
#
# $$
# \tilde V = \Gamma_K^\top \mathbf V, \qquad Z = \Gamma_K^\top \mathbf 1, \qquad
# O = \frac{\Gamma_Q \tilde V}{\Gamma_Q Z + \epsilon} \quad\text{(row by row)} .
# $$
#
# **Notation** follows `docs/glossary.md`: $\mathbf V$ is the value matrix
# ($N\times d_v$, rows $v_j$), $\Gamma_Q$, $\Gamma_K$ the responsibilities
# ($N\times K$). $\epsilon$ is the guard that keeps the denominators positive
# (the `eps=1e-6` argument of `refimpl`); it is part of the definition of
# GMA. Machine epsilon $u = 2^{-52} \approx 2.2\times10^{-16}$
# (`np.finfo(np.float64).eps`) is the size of a relative rounding error in
# float64; it appears only in the tolerances of the checks. The two have
# nothing to do with each other, and $10^{-6}$ is ten orders of magnitude
# above $u$.
#
# **The claims of this lesson.**
#
# 1. This is the normalised quadratic form $O = D^{-1} A \mathbf V$ with the
#    *implicit affinity* $A = \Gamma_Q \Gamma_K^\top$ and
#    $D = \operatorname{diag}(A\mathbf 1 + \epsilon)$; associativity of the
#    matrix product computes it without ever forming $A$, in
#    $O(NK(d_r + d_v))$ time and memory that grows like $NK$, not $N^2$.
# 2. $A$ is a very particular $N\times N$ matrix: nonnegative, entries in
#    $[0, 1]$, $A_{ij}$ is the probability that query $i$ and key $j$ land
#    in the same component, and its rank is at most $K$.
# 3. Every output row is a nonnegative combination of $K$ *slot means*
#    $\tilde V_k / Z_k$ whose weights sum to
#    $1 - \epsilon/(\gamma^Q_i\cdot Z + \epsilon)$: a *convex* combination
#    only for $\epsilon = 0$. With $\epsilon > 0$ the weights sum to less than
#    one, and the outputs lie in the convex hull of the values *and the
#    origin*; a query whose components received almost no key mass is pulled
#    to $0$.
# 4. With one shared isotropic variance the router collapses to a softmax of a
#    linear function of $x$; per-component diagonal variances are what make it
#    quadratic.
#
# Each claim is derived, then checked with `assert`s on measured errors,
# against `refimpl.gma` and `refimpl.theory`. `TUTORIAL_SMALL=1` (set by CI)
# runs on small arrays; the default is full size.

# %%
import os
import time
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Ellipse
from scipy.spatial import ConvexHull

from refimpl import gma, gmm, theory

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16 (not the guard eps = 1e-6)
print(f"small sizes: {SMALL}")

# %% [markdown]
# ## 1. A toy sequence and its routing
#
# Routing vectors in the plane ($d_r = 2$) so that we can draw them. The
# sequence has four segments, each drawn around its own centre (think of four
# topics in a document); queries and keys are two noisy views of the same
# tokens, as two projections of one token would be. The GMM has $K = 6$
# components with diagonal variances that differ per component and per axis,
# and unequal weights.

# %%
rng = np.random.default_rng(0)
N_toy = 120 if SMALL else 320
segment_centres = np.array([[-2.5, 1.5], [2.0, 2.0], [0.0, -2.0], [-2.5, 1.5]])  # the first topic returns at the end
segment = np.repeat(np.arange(4), -(-N_toy // 4))[:N_toy]
tokens = segment_centres[segment] + 0.6 * rng.normal(size=(N_toy, 2))
x_q = tokens + 0.2 * rng.normal(size=(N_toy, 2))
x_k = tokens + 0.2 * rng.normal(size=(N_toy, 2))
v_toy = rng.normal(size=(N_toy, 3))

means = np.array([[-2.5, 1.0], [-2.0, 2.5], [2.0, 2.0], [0.5, -1.5], [-0.8, -2.5], [3.0, -2.5]])
variances = np.array([[0.5, 0.3], [0.4, 0.2], [0.8, 0.8], [0.3, 0.6], [0.4, 0.2], [0.5, 0.5]])
weights = np.array([0.2, 0.15, 0.25, 0.15, 0.15, 0.1])
K = len(weights)

gamma_q = gmm.responsibilities(x_q, means, variances, weights)
gamma_k = gmm.responsibilities(x_k, means, variances, weights)
print(f"Gamma_Q, Gamma_K: {gamma_q.shape}; rows sum to 1 within {np.max(np.abs(gamma_q.sum(1) - 1)):.1e}")

colors = plt.cm.tab10(np.arange(K))
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1, 1.6]})
segment_starts = np.flatnonzero(np.diff(segment, prepend=-1))  # first token of each segment
segment_style = [("0.7", "o"), ("0.5", "s"), ("0.25", "^"), ("0.0", "x")]  # grey shade and marker per segment
for s_idx, (shade, marker) in enumerate(segment_style):
    sel = segment == s_idx
    first, last = np.flatnonzero(sel)[[0, -1]]
    ax0.scatter(*x_q[sel].T, color=shade, marker=marker, s=12, lw=0.8, label=f"queries of segment {s_idx + 1} (tokens {first}-{last})")
for k in range(K):
    for n_sd in (1, 2):
        ax0.add_patch(Ellipse(means[k], 2 * n_sd * np.sqrt(variances[k, 0]), 2 * n_sd * np.sqrt(variances[k, 1]),
                              fill=False, color=colors[k], lw=1.5 if n_sd == 1 else 0.6))
    ax0.annotate(str(k), means[k], color=colors[k], fontsize=13, weight="bold", ha="center", va="center")
ax0.set(title="routing queries and the K = 6 components (1 and 2 sd)", xlabel="$x_1$", ylabel="$x_2$")
ax0.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
im = ax1.imshow(gamma_q.T, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
for s_idx, start in enumerate(segment_starts):
    if s_idx > 0:
        ax1.axvline(start - 0.5, color="white", ls="--", lw=1)
    ax1.text(start + 2, -0.6, f"segment {s_idx + 1}", fontsize=8, va="bottom")
ax1.set(xlabel="token $i$ (dashed lines: segment boundaries)", ylabel="component $k$")
ax1.set_title(r"$\Gamma_Q^\top$: responsibility of component $k$ for query $i$", pad=20)
fig.colorbar(im, ax=ax1, label="$\\gamma^Q_{ik}$")
plt.tight_layout()
plt.show()

# %% [markdown]
# Each column of the right panel is a probability vector: the token is
# *routed*, softly, to the components that explain it. The segments are
# visible: the first and last segment use components 0 and 1, the second
# component 2, the third components 3 and 4. Component 5 has low weight and
# lies away from the data, and it is barely used.
#
# ## 2. Write, then read: associativity removes the $N \times N$ matrix
#
# Row $i$ of the quadratic form is
#
# $$
# o_i = \frac{\sum_j A_{ij} v_j}{\sum_j A_{ij} + \epsilon},
# \qquad A_{ij} = \gamma^Q_i \cdot \gamma^K_j = \sum_{k=1}^K \gamma^Q_{ik}\gamma^K_{jk} .
# $$
#
# Exchange the two sums, in the numerator and in the denominator:
#
# $$
# \sum_j \sum_k \gamma^Q_{ik}\gamma^K_{jk} v_j = \sum_k \gamma^Q_{ik} \underbrace{\sum_j \gamma^K_{jk} v_j}_{\tilde V_k},
# \qquad
# \sum_j \sum_k \gamma^Q_{ik}\gamma^K_{jk} = \sum_k \gamma^Q_{ik} \underbrace{\sum_j \gamma^K_{jk}}_{Z_k} .
# $$
#
# In matrix form, $(\Gamma_Q\Gamma_K^\top)\mathbf V = \Gamma_Q(\Gamma_K^\top \mathbf V)$ and
# $(\Gamma_Q\Gamma_K^\top)\mathbf 1 = \Gamma_Q(\Gamma_K^\top \mathbf 1)$.
# The left sides cost $O(N^2(K + d_v))$ time and an $N\times N$ array; the
# right sides cost $O(NK d_v)$ time and a $K \times d_v$ array. The
# responsibilities themselves cost $O(NKd_r)$ in both, so GMA takes
# $O(NK(d_r + d_v))$ time in all. The keys *write* into
# $K$ memory slots $\tilde V_k$ with masses $Z_k$, and the queries *read* from
# them. Here is the mechanism in three lines, against the explicit form and
# against `refimpl.gma`.

# %%
def gma_write_read(gamma_q, gamma_k, v, eps=1e-6):
    """GMA from the responsibilities: write K slots, then read them."""
    v_tilde = gamma_k.T @ v  # (K, d_v): what each slot holds
    z = gamma_k.sum(axis=0)  # (K,): how much mass each slot holds
    return (gamma_q @ v_tilde) / (gamma_q @ z + eps)[:, None]


def gma_explicit(gamma_q, gamma_k, v, eps=1e-6):
    """The quadratic form D^-1 A V, with the N x N affinity formed."""
    a = gamma_q @ gamma_k.T
    return (a @ v) / (a.sum(axis=1) + eps)[:, None]


out_write_read = gma_write_read(gamma_q, gamma_k, v_toy)
out_explicit = gma_explicit(gamma_q, gamma_k, v_toy)
out_refimpl = gma.gma(x_q, x_k, v_toy, means, variances, weights)
out_oracle = gma.gma_dense(gamma_q, gamma_k, v_toy)

# rounding model (see the text below): |difference| <= 4 (N + K + 1) u max|v|, u = machine epsilon
tol_assoc = 4 * (N_toy + K + 1) * U * np.max(np.abs(v_toy))
errs = {
    "write/read vs explicit D^-1 A V": np.max(np.abs(out_write_read - out_explicit)),
    "refimpl gma vs explicit": np.max(np.abs(out_refimpl - out_explicit)),
    "refimpl gma_dense vs explicit": np.max(np.abs(out_oracle - out_explicit)),
}
for name, e in errs.items():
    print(f"{name:34s} {e:.1e}   ({e / tol_assoc:.3f} of the bound {tol_assoc:.1e})")
assert max(errs.values()) <= tol_assoc

# %% [markdown]
# **Why this tolerance.** The two orders of summation round differently, so
# they agree only to rounding: each computed $o_i$ is within about
# $2(N+K+1)\,u\max|v|$ of the exact one, and two computations within twice
# that; the measured errors sit far below this worst case. Why this
# tolerance: `docs/floating_point.md`, section Lesson 2.
#
# Both refimpl functions also agree with the three-line version: `gma.gma`
# computes the responsibilities itself from $(X_Q, X_K)$ and the GMM, and
# `gma.gma_dense` is the project's oracle, the explicit form.
#
# ## 3. The implicit affinity
#
# $A$ is never formed by GMA, but it is what GMA *does*: row $i$ of $D^{-1}A$
# is the attention distribution of query $i$ over the keys (its entries sum
# to $\sum_j A_{ij}/(\sum_j A_{ij} + \epsilon)$, just below one; section 4
# says where the rest goes). Picture it for the toy sequence next to the
# responsibilities it is made of.

# %%
A = theory.affinity(gamma_q, gamma_k)
fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [0.35, 1, 1]})
axes[0].imshow(gamma_k, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
axes[0].set(title=r"$\Gamma_K$", xlabel="component", ylabel="key token $j$")
im = axes[1].imshow(A, cmap="magma", vmin=0, vmax=1, interpolation="nearest")
axes[1].set(title=r"$A = \Gamma_Q\Gamma_K^\top$", xlabel="key $j$", ylabel="query $i$")
fig.colorbar(im, ax=axes[1])
attn = A / (A.sum(axis=1, keepdims=True) + 1e-6)
im = axes[2].imshow(attn, cmap="magma", interpolation="nearest")
axes[2].set(title=r"attention weights $D^{-1}A$ (rows sum to just below 1)", xlabel="key $j$", ylabel="query $i$")
fig.colorbar(im, ax=axes[2])
plt.tight_layout()
plt.show()

# %% [markdown]
# The blocks are the segments: a query attends to the keys that were routed
# to the same components, wherever they are in the sequence (the first and
# the last segment attend to each other). Four properties follow from the
# form $A = \Gamma_Q\Gamma_K^\top$ alone.
#
# **Entries in $[0, 1]$, and what they mean.** Draw a component for query $i$,
# $z_i \sim \gamma^Q_i$, and independently one for key $j$,
# $z_j \sim \gamma^K_j$. Then
#
# $$
# P(z_i = z_j) = \sum_k P(z_i = k)\,P(z_j = k) = \sum_k \gamma^Q_{ik}\gamma^K_{jk} = A_{ij}.
# $$
#
# A probability is in $[0, 1]$; $A_{ij} = 1$ exactly when both tokens are
# certain of the same component. We check the identity two ways: by summing
# the diagonal of the $K \times K$ joint law of $(z_i, z_j)$
# (`theory.affinity_by_enumeration`, which never uses the dot product), and by
# Monte Carlo (`theory.affinity_by_sampling`): the frequency of $z_i = z_j$ in
# $n_{\mathrm{mc}}$ draws has standard error $\sqrt{A_{ij}(1-A_{ij})/n_{\mathrm{mc}}} \le 0.5/\sqrt{n_{\mathrm{mc}}}$; we
# allow six of those.

# %%
n_mc = 20000 if SMALL else 200000
sub_q, sub_k = gamma_q[::N_toy // 6][:6], gamma_k[::N_toy // 5][:5]
err_enum = np.max(np.abs(theory.affinity(sub_q, sub_k) - theory.affinity_by_enumeration(sub_q, sub_k)))
err_mc = np.max(np.abs(theory.affinity(sub_q, sub_k) - theory.affinity_by_sampling(sub_q, sub_k, n_mc, seed=1)))
print(f"entries of A in [{A.min():.2e}, {A.max():.4f}]")
print(f"A vs enumeration of the joint law: {err_enum:.1e}")
print(f"A vs Monte Carlo, {n_mc} draws:    {err_mc:.1e}   (6 standard errors: {6 * 0.5 / np.sqrt(n_mc):.1e})")
assert A.min() >= 0 and A.max() <= 1 + 4 * K * U  # rows of Gamma sum to 1 within a few u
assert err_enum <= 4 * K * U  # two sums of K products of numbers in [0, 1], added in different orders
assert err_mc <= 6 * 0.5 / np.sqrt(n_mc)

# %% [markdown]
# **Rank at most $K$.** $A$ is an $N \times K$ matrix times a $K \times N$
# matrix, so its column space lies in that of $\Gamma_Q$: $\operatorname{rank}A \le K$
# however long the sequence. Both factors are nonnegative, so this is also a
# *nonnegative* factorisation: the nonnegative rank is at most $K$ as well,
# which a generic low-rank approximation (an SVD truncation, a random
# projection) does not give. The singular values show it: $K$ of them are
# well above rounding level (the smallest of them is $10^{-2}$ to $10^{-4}$ of
# the largest here), the remaining $N - K$ are rounding noise near
# $10^{-16}$, below the threshold $\sigma_{\max} N u$ that
# `numpy.linalg.matrix_rank` uses.
#
# **Positive semidefinite when queries are keys.** With $X_Q = X_K$,
# $A = \Gamma\Gamma^\top$ is a Gram matrix: $y^\top A y = \|\Gamma^\top y\|^2 \ge 0$ for every $y$.
# Its eigenvalues are $\ge 0$ up to rounding of order $N u\,\lambda_{\max}$.
#
# We check both on larger random problems ($K = 8$ and $K = 20$, $d_r = 3$).

# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
for K_r, seed in ((8, 2), (20, 3)):
    r = np.random.default_rng(seed)
    N_r = 150 if SMALL else 600
    m_r, v_r, w_r = r.normal(size=(K_r, 3)) * 1.5, r.uniform(0.3, 1.5, size=(K_r, 3)), r.dirichlet(np.ones(K_r))
    gq_r = gmm.responsibilities(2 * r.normal(size=(N_r, 3)), m_r, v_r, w_r)
    gk_r = gmm.responsibilities(2 * r.normal(size=(N_r, 3)), m_r, v_r, w_r)
    A_r = theory.affinity(gq_r, gk_r)
    sv = np.linalg.svd(A_r, compute_uv=False)
    rank = np.linalg.matrix_rank(A_r)
    eig = np.linalg.eigvalsh(theory.affinity(gq_r, gq_r))  # X_Q = X_K
    ax.semilogy(np.arange(1, N_r + 1), sv / sv[0], ".", label=f"K = {K_r}: numerical rank {rank}")
    print(f"K = {K_r}, N = {N_r}: rank {rank}; sigma_K / sigma_1 = {sv[K_r - 1] / sv[0]:.1e}, "
          f"sigma_(K+1) / sigma_1 = {sv[K_r] / sv[0]:.1e}; min eigenvalue of Gamma Gamma^T / max = {eig[0] / eig[-1]:.1e}")
    assert rank <= K_r
    assert rank == K_r  # and not lower: the threshold does not hide real singular values
    assert sv[K_r] / sv[0] < N_r * U  # everything beyond K is below matrix_rank's threshold
    assert eig[0] >= -N_r * U * eig[-1]
ax.axhline(N_r * U, color="gray", ls=":", label=r"threshold $N u$ ($u$ = machine epsilon)")
ax.set(xscale="log", xlabel="index", ylabel=r"$\sigma_i / \sigma_1$", title="singular values of $A$: at most K are not rounding noise")
ax.legend()
plt.show()

# %% [markdown]
# The rank is at most $K$, and for these random mixtures exactly $K$ (asserted
# too, so that the threshold cannot hide a real singular value): all $K$
# columns of $\Gamma$ are linearly independent. A component that no token uses
# would lower it.
#
# ## 4. Outputs are mixtures of slot means, convex only for $\epsilon = 0$
#
# Divide each slot by its mass: $m_k = \tilde V_k / Z_k = \sum_j
# \frac{\gamma^K_{jk}}{Z_k} v_j$, a weighted average of the values, the
# *slot mean*. Then $\Gamma_Q \tilde V = \Gamma_Q \operatorname{diag}(Z) M$
# and
#
# $$
# o_i = \sum_k w_{ik}\, m_k, \qquad
# w_{ik} = \frac{\gamma^Q_{ik} Z_k}{\gamma^Q_i\cdot Z + \epsilon} \ge 0, \qquad
# \sum_k w_{ik} = 1 - \frac{\epsilon}{\gamma^Q_i\cdot Z + \epsilon} .
# $$
#
# With $\epsilon = 0$ the weights sum to one: every output is a convex
# combination of the $K$ slot means, which are convex combinations of the
# values, so **with $\epsilon = 0$ every output lies in the convex hull of the
# values**. With the guard $\epsilon > 0$ the weights sum to *less* than one:
# $o_i = \sum_k w_{ik} m_k + (1 - \sum_k w_{ik})\cdot 0$ is a convex
# combination of the slot means *and the origin*, so the outputs lie in the
# hull of the values and $0$, and not in general in the hull of the values.
# The missing weight $\epsilon/(\gamma^Q_i\cdot Z + \epsilon)$ is tiny when the
# query's components hold a lot of key mass, and close to one when they hold
# almost none.
#
# Below, $d_v = 2$ so that we can draw it, and the values depend on the
# segment (each segment has its own centre in value space, with noise);
# `theory.slot_means` and `theory.mixing_weights` give $M$ and $W$. Then a
# case where the guard shows: keys from the first segment only (as early in a
# causal sequence, lesson 3), read by the queries of the third segment, which
# are routed to components 3 and 4, where the first segment's keys put almost
# no mass.

# %%
value_centres = np.array([[-2.0, 2.0], [2.0, 2.0], [0.0, -2.0], [-2.0, -1.0]])  # one per segment
v2 = value_centres[segment] + 0.7 * rng.normal(size=(N_toy, 2))
out0 = gma.gma(x_q, x_k, v2, means, variances, weights, eps=0.0)
slots = theory.slot_means(gamma_k, v2)
w_mix = theory.mixing_weights(gamma_q, gamma_k, eps=0.0)
w_mix_eps = theory.mixing_weights(gamma_q, gamma_k, eps=1e-6)
den = gamma_q @ gamma_k.sum(axis=0)


def signed_distance(points, hull):
    """Largest n . y + c over the facets (n, c) of a scipy ConvexHull: <= 0 inside, > 0 outside."""
    return np.max(points @ hull.equations[:, :2].T + hull.equations[:, 2], axis=1)


hull = ConvexHull(v2)
outside = np.max(signed_distance(out0, hull))
tol_hull = 4 * (N_toy + K + 1) * U * np.max(np.abs(v2))  # the rounding model of section 2
err_slots = np.max(np.abs(w_mix @ slots - out0))
deficit = 1 - w_mix_eps.sum(axis=1)  # the weight that goes to the origin when eps = 1e-6
err_sum = np.max(np.abs(deficit - 1e-6 / (den + 1e-6)))
print(f"W M vs gma output:                   {err_slots:.1e}")
print(f"eps = 1e-6: 1 - row sums of W from {deficit.min():.1e} to {deficit.max():.1e}; "
      f"vs eps / (den + eps): {err_sum:.1e}")
print(f"eps = 0: largest signed distance of an output outside the hull: {outside:.1e} "
      f"(negative = inside; tolerance {tol_hull:.1e})")
assert np.all(w_mix >= 0)
assert err_slots <= tol_hull and err_sum <= 4 * U
assert np.all(deficit > 4 * U)  # with eps > 0 every row of W sums to less than one, beyond rounding
assert outside <= tol_hull

# keys of the first segment only, queries of the third: components 3 and 4 hold almost no key mass
first, third = segment == 0, segment == 2
hull_first = ConvexHull(v2[first])
hull_first_and_0 = ConvexHull(np.vstack([v2[first], np.zeros((1, 2))]))
out_far0 = gma.gma(x_q[third], x_k[first], v2[first], means, variances, weights, eps=0.0)
out_far = gma.gma(x_q[third], x_k[first], v2[first], means, variances, weights, eps=1e-6)
den_far = gamma_q[third] @ gamma_k[first].sum(axis=0)
tol_far = 4 * (int(first.sum()) + K + 1) * U * np.max(np.abs(v2[first]))
dist_far0 = signed_distance(out_far0, hull_first)  # eps = 0: inside the hull of the values
dist_far = signed_distance(out_far, hull_first)  # eps > 0: ...
dist_far_with_0 = signed_distance(out_far, hull_first_and_0)  # ... inside the hull of the values and the origin
err_shrink = np.max(np.abs(out_far - (den_far / (den_far + 1e-6))[:, None] * out_far0))
print(f"third-segment queries on first-segment keys: gamma_q . Z from {den_far.min():.1e} to {den_far.max():.1e}")
print(f"  eps = 0:    largest distance outside the hull of the values {dist_far0.max():+.1e}")
print(f"  eps = 1e-6: largest distance outside the hull of the values {dist_far.max():+.2f}; "
      f"outside the hull of the values and 0 {dist_far_with_0.max():+.1e}  (tolerance {tol_far:.1e})")
print(f"  eps = 1e-6 output vs (den / (den + eps)) x eps = 0 output: {err_shrink:.1e}")
assert dist_far0.max() <= tol_far
assert dist_far.max() > 0.1 * np.max(np.ptp(v2[first], axis=0))  # clearly outside: not a convex combination
assert dist_far_with_0.max() <= tol_far and err_shrink <= tol_far

fig, (ax, ax_far) = plt.subplots(1, 2, figsize=(13, 5))
ax.scatter(*v2.T, s=8, color="lightgray", label="values $v_j$")
for simplex in hull.simplices:
    ax.plot(*v2[simplex].T, color="gray", lw=0.8)
ax.scatter(*slots.T, s=300, marker="*", c=colors, edgecolors="black", label=r"slot means $\tilde V_k / Z_k$")
ax.scatter(*out0.T, s=12, c="black", marker="x", lw=0.8, label="outputs $o_i$ ($\\epsilon = 0$)")
ax.set(title="outputs are mixtures of K slot means", xlabel="value coordinate 1", ylabel="value coordinate 2")
ax.legend(fontsize=8)
ax_far.scatter(*v2[first].T, s=8, color="lightgray", label="values of the first segment")
for simplex in hull_first.simplices:
    ax_far.plot(*v2[first][simplex].T, color="gray", lw=0.8)
ax_far.plot(*np.stack([out_far0, out_far]).transpose(2, 0, 1), color="tab:blue", lw=0.4, alpha=0.5)
ax_far.scatter(*out_far0.T, s=14, c="black", marker="x", lw=0.8, label="outputs, $\\epsilon = 0$")
sc = ax_far.scatter(*out_far.T, s=14, c=np.log10(den_far), cmap="viridis", label="outputs, $\\epsilon = 10^{-6}$")
ax_far.scatter(0, 0, s=60, marker="+", color="red", label="origin")
fig.colorbar(sc, ax=ax_far, label=r"$\log_{10}\,\gamma^Q_i\cdot Z$")
ax_far.set(title="third-segment queries, first-segment keys", xlabel="value coordinate 1", ylabel="value coordinate 2")
ax_far.legend(fontsize=8, loc="upper right")
plt.show()

# %% [markdown]
# Left: the outputs (crosses) sit on or between the few slot means that
# their query mixes, most of them hidden under the stars, well inside the hull
# of the values; on the whole sequence every denominator is large and the
# guard changes the outputs by a factor within $10^{-7}$ of one (printed
# above). Right: the third segment's queries reading the first segment's
# keys, with $\epsilon = 0$ (crosses) and with $\epsilon = 10^{-6}$ (dots,
# joined to their crosses). Where the denominator $\gamma^Q_i\cdot Z$ is
# comparable to $\epsilon$ or below it, the output is its $\epsilon = 0$
# version times $\gamma^Q_i\cdot Z/(\gamma^Q_i\cdot Z + \epsilon)$: it slides along
# the segment towards the origin, out of the hull of the values.
#
# Back to the left panel. The first and the last segment had different
# values but were routed to the same components (0 and 1): those two slot
# means average the two segments' values, and the outputs of both segments
# land there. GMA
# averages over everything routed to the same components, wherever it sits in
# the sequence. That is its inductive bias (smooth, low-rank mixing) and its
# limit: it cannot copy one particular value the way a sharp softmax row can,
# unless that value has a component to itself.
#
# ## 5. $O(NK)$ against $O(N^2)$, measured
#
# Now the cost. We time and measure peak memory for GMA (`gma.gma`) and for
# the explicit form (the same responsibilities, then `gma.gma_dense`) as $N$
# grows, at $K = 32$, $d_r = 8$, $d_v = 32$. Memory is the peak that Python's
# `tracemalloc` sees during one call (NumPy reports its array buffers to it);
# the inputs exist before tracing starts and are not counted.
#
# Prediction: GMA holds a few $N \times K$ arrays (responsibilities, the
# scan's work) and an $N \times d_v$ output, so its peak is $\approx bN + c$;
# the explicit form holds the $N \times N$ affinity, one float64 (8 bytes) per
# entry, so its peak is $\approx 8N^2 + b'N + c'$. On log-log axes their
# slopes are 1 and 2 once the leading term dominates.
#
# GMA's constant $c$ is not small. `refimpl.gmm` computes the
# responsibilities from the differences $x - \mu$, as they are defined, a block
# of rows at a time: the $B \times K \times d_r$ differences of one block take
# at most 2 MiB (`refimpl.numerics.BLOCK_BYTES`; less when all $N$ rows fit
# in one block). At the peak GMA holds about four arrays of $N \times 32$
# numbers: the queries' responsibilities, and the keys' logits while their
# softmax is formed (the shifted logits, their exponentials and the result);
# the output ($d_v = 32$) comes later, from the scan, when the logits are
# gone. Below $N \approx 4000$ the 2 MiB of the block
# outweigh them, and near there GMA's local log-log slope falls well below 1.
# GMA is cheap, so its series runs a few doublings beyond the explicit form's
# (whose $N \times N$ matrix limits it), far enough for the linear term to
# dominate; the two methods are compared at the sizes they share.

# %%
def traced_peak(f):
    """Peak bytes allocated (as tracemalloc sees them) while f() runs."""
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def best_time(f, repeats):
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


K_c, d_r_c, d_v_c = 32, 8, 32
r = np.random.default_rng(5)
m_c, v_c, w_c = r.normal(size=(K_c, d_r_c)), r.uniform(0.5, 1.5, size=(K_c, d_r_c)), r.dirichlet(np.ones(K_c))
Ns = 2 ** np.arange(9, 13) if SMALL else 2 ** np.arange(8, 14)  # explicit: 512 ... 4096 (small) or 256 ... 8192 (full)
Ns_gma = 2 ** np.arange(9, 16) if SMALL else 2 ** np.arange(8, 17)  # GMA: 512 ... 32768 (small) or 256 ... 65536 (full)
inputs_gma = [(r.normal(size=(n, d_r_c)), r.normal(size=(n, d_r_c)), r.normal(size=(n, d_v_c))) for n in Ns_gma]
inputs = inputs_gma[: len(Ns)]  # the explicit form's sizes are GMA's first ones, with the same inputs
assert np.array_equal(Ns_gma[: len(Ns)], Ns)


def run_gma(xq_c, xk_c, val_c):
    return gma.gma(xq_c, xk_c, val_c, m_c, v_c, w_c)


def run_dense(xq_c, xk_c, val_c):
    gq_c = gmm.responsibilities(xq_c, m_c, v_c, w_c)
    gk_c = gmm.responsibilities(xk_c, m_c, v_c, w_c)
    return gma.gma_dense(gq_c, gk_c, val_c)


# one method at a time, so that the large dense calls do not disturb the timing of the small ones
peak_gma = [traced_peak(lambda: run_gma(*args)) for args in inputs_gma]
time_gma = [best_time(lambda: run_gma(*args), 5) for args in inputs_gma]
peak_dense = [traced_peak(lambda: run_dense(*args)) for args in inputs]
time_dense = [best_time(lambda: run_dense(*args), 3 if n <= 2048 else 1) for n, args in zip(Ns, inputs)]
for n, args in zip(Ns, inputs):
    assert np.max(np.abs(run_gma(*args) - run_dense(*args))) <= 4 * (n + K_c + 1) * U * np.max(np.abs(args[2]))
peak_gma, peak_dense = np.array(peak_gma, float), np.array(peak_dense, float)
time_gma, time_dense = np.array(time_gma), np.array(time_dense)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
ax0.loglog(Ns, peak_dense / 2**20, "o-", label=r"explicit $D^{-1}A\mathbf{V}$")
ax0.loglog(Ns_gma, peak_gma / 2**20, "s-", label="GMA (write, read)")
ax0.loglog(Ns, 8.0 * Ns**2 / 2**20, "k:", label=r"one $N\times N$ float64 array")
ax0.set(xlabel="sequence length $N$", ylabel="peak memory (MiB)", title="memory")
ax0.legend()
ax1.loglog(Ns, time_dense, "o-", label=r"explicit $D^{-1}A\mathbf{V}$")
ax1.loglog(Ns_gma, time_gma, "s-", label="GMA (write, read)")
ax1.set(xlabel="sequence length $N$", ylabel="seconds (best of several)", title="time")
ax1.legend()
for a in (ax0, ax1):  # one labelled tick per measured N, no minor-tick labels to collide with them
    a.set_xticks(Ns_gma, [str(n) for n in Ns_gma], rotation=45)
    a.xaxis.set_minor_locator(plt.NullLocator())
fig.tight_layout()
plt.show()

print("     N   GMA peak (MiB)  explicit peak (MiB)   GMA time (s)  explicit time (s)")
for i, n in enumerate(Ns_gma):  # the explicit form's columns stop at its largest N
    explicit = (peak_dense[i] / 2**20, time_dense[i]) if i < len(Ns) else (np.nan, np.nan)
    print("{:6d} {:14.2f} {:20.2f} {:14.4f} {:18.4f}".format(n, peak_gma[i] / 2**20, explicit[0], time_gma[i], explicit[1])
          .replace("nan", "  -"))

# %% [markdown]
# Two checks make the picture quantitative.
#
# * **Local slopes** of $\log(\text{peak})$ against $\log N$ between the two
#   largest sizes of each series. They approach 1 and 2 from below: the
#   lower-order terms still hold part of the peak. For GMA that is the
#   constant of 2 MiB, the differences of one block of rows in
#   `refimpl.gmm`; it holds most of the peak below
#   $N \approx 4000$, which is why GMA's series runs to larger $N$ before its
#   slope is measured. For the explicit form it is the linear terms. At the
#   largest sizes of each series that pulls the slope down by less than 0.1,
#   which is the tolerance we allow below; a slope above the exponent would
#   mean a growing term we did not predict, so the upper tolerance is tight.
# * **A quadratic fit** $\text{peak} \approx aN^2 + bN + c$ (least squares in
#   relative error), each over its own series. For the explicit form, $a$
#   should be 8 bytes: exactly one float64 $N\times N$ matrix is alive at the
#   peak. For GMA the fit runs over its sizes from $N = 4096$ on, where its
#   four $N \times K$ arrays hold the peak: below that the block of
#   differences does, and no single smooth curve follows the switch
#   from one to the other. There $b$ should be about four $N \times K$
#   arrays per token, $c$ small, and the quadratic term should explain (almost)
#   nothing of the peak at GMA's largest $N$.

# %%
slope_gma = np.log(peak_gma[-1] / peak_gma[-2]) / np.log(Ns_gma[-1] / Ns_gma[-2])
slope_dense = np.log(peak_dense[-1] / peak_dense[-2]) / np.log(Ns[-1] / Ns[-2])
tail = Ns_gma >= 4096  # the N x K arrays outweigh the block of differences from here on
a_g, b_g, c_g = np.polyfit(Ns_gma[tail], peak_gma[tail], 2, w=1 / peak_gma[tail])
a_d, b_d, c_d = np.polyfit(Ns, peak_dense, 2, w=1 / peak_dense)
time_slope_gma = np.polyfit(np.log(Ns_gma[-3:]), np.log(time_gma[-3:]), 1)[0]
time_slope_dense = np.polyfit(np.log(Ns[-3:]), np.log(time_dense[-3:]), 1)[0]
i_c = len(Ns) - 1  # the largest N both methods were measured at
print(f"memory slope, largest two N: GMA {slope_gma:.3f} ({Ns_gma[-2]} to {Ns_gma[-1]}), "
      f"explicit {slope_dense:.3f} ({Ns[-2]} to {Ns[-1]})")
print(f"explicit fit: a = {a_d:.4f} bytes/N^2, b = {b_d:.0f} bytes/N")
print(f"GMA fit, N = {Ns_gma[tail][0]} to {Ns_gma[-1]}: b = {b_g:.0f} bytes per token = {b_g / (8 * K_c):.2f} "
      f"N x K float64 arrays, c = {c_g / 2**10:.0f} kB; "
      f"the quadratic term is {a_g * Ns_gma[-1]**2 / peak_gma[-1]:+.1%} of the peak at N = {Ns_gma[-1]}")
print(f"at N = {Ns[i_c]}: explicit / GMA memory = {peak_dense[i_c] / peak_gma[i_c]:.0f}x, "
      f"time = {time_dense[i_c] / time_gma[i_c]:.0f}x")
print(f"time slopes over the largest three N of each (not asserted): GMA {time_slope_gma:.2f}, explicit {time_slope_dense:.2f}")
assert 0.9 <= slope_gma <= 1.02
assert 1.9 <= slope_dense <= 2.02
assert abs(a_d - 8.0) <= 0.08  # one N x N float64 matrix, within 1%
assert abs(a_g) * Ns_gma[-1] ** 2 <= 0.02 * peak_gma[-1]
assert 3.5 <= b_g / (8 * K_c) <= 4.5  # about four N x K float64 arrays per token
assert peak_dense[-1] >= 8.0 * Ns[-1] ** 2 > 10 * peak_gma[i_c]

# %% [markdown]
# What this does and does not show. Memory is deterministic and the asserted
# numbers are the same on every machine with the same NumPy: GMA's peak grows
# linearly (about four $N\times K$ arrays per token), the explicit form's
# quadratically, with exactly one $N \times N$ matrix at its peak. **Times are
# printed, not asserted**: they depend on the machine, on the BLAS and its
# threads, and on whatever else runs; on a shared machine a single slow call
# can move a point by a factor of several. They are measured as the best of a
# few calls for that reason. At small $N$ both are dominated by fixed
# per-call costs and the time curves are flat; the $N^2$ slope of the explicit
# form only shows at the largest sizes. `docs/performance_gma.md` reports
# a controlled benchmark at $N = 16384$.
#
# ## 6. The isotropic collapse: what the diagonal variances buy
#
# Write out the log-joint of component $k$ (lesson 1):
#
# $$
# \ell_k(x) = \log\pi_k - \tfrac12\sum_j\log(2\pi\sigma^2_{kj})
#   - \tfrac12\sum_j \frac{x_j^2}{\sigma^2_{kj}} + \sum_j\frac{x_j\mu_{kj}}{\sigma^2_{kj}}
#   - \tfrac12\sum_j\frac{\mu^2_{kj}}{\sigma^2_{kj}} .
# $$
#
# If every component has the **same isotropic** variance
# $\sigma^2_{kj} = \sigma^2$, the quadratic term $-\|x\|^2/(2\sigma^2)$ and the
# log-determinant are the same for all $k$, and the softmax over $k$ cancels
# them:
#
# $$
# \gamma(x) = \operatorname{softmax}\Big(\frac{x\mu^\top}{\sigma^2} + b\Big),
# \qquad b_k = \log\pi_k - \frac{\|\mu_k\|^2}{2\sigma^2} .
# $$
#
# That is a linear router, the softmax of a dot product with $K$ learned
# "key" vectors $\mu_k/\sigma^2$; the regions where each component wins are
# separated by straight lines. With per-component diagonal variances the term
# $-\tfrac12\sum_j x_j^2/\sigma^2_{kj}$ differs between components and the
# log-odds $\ell_k - \ell_m$ are **quadratic** in $x$: along a line
# $x(t) = x_0 + t\,y$,
#
# $$
# \frac{d^2}{dt^2}\big(\ell_k - \ell_m\big) = -\sum_j y_j^2\Big(\frac{1}{\sigma^2_{kj}} - \frac{1}{\sigma^2_{mj}}\Big),
# $$
#
# a constant, zero in the isotropic case. A quadratic has an exact second
# difference: $f(t+h) - 2f(t) + f(t-h) = h^2 f''$, so we can measure the
# curvature from three evaluations of `gmm.log_responsibilities`
# ($\log\gamma_k - \log\gamma_m = \ell_k - \ell_m$). The only error is the
# rounding of the log-responsibilities, a few $u$ times their size
# each; we allow $16\,u\max|\ell|$.

# %%
def log_odds_curvature(x0, y, means, variances, weights, k, m, h=1.0):
    """Second difference of log gamma_k - log gamma_m along x0 + t y, step h; and the size of the log-responsibilities."""
    pts = np.stack([x0 - h * y, x0, x0 + h * y])
    lr = gmm.log_responsibilities(pts, means, variances, weights)
    f = lr[:, k] - lr[:, m]
    return (f[0] - 2 * f[1] + f[2]) / h**2, np.max(np.abs(lr))


iso_var = np.full_like(variances, 0.5)
r6 = np.random.default_rng(6)
worst_diag, worst_iso, worst_softmax = 0.0, 0.0, 0.0
for _ in range(20):
    x0, y = r6.normal(size=2), r6.normal(size=2)
    k, m = r6.choice(K, size=2, replace=False)
    curv, size = log_odds_curvature(x0, y, means, variances, weights, k, m)
    predicted = -np.sum(y**2 * (1 / variances[k] - 1 / variances[m]))
    worst_diag = max(worst_diag, abs(curv - predicted) / (16 * U * size))
    curv_iso, size_iso = log_odds_curvature(x0, y, means, iso_var, weights, k, m)
    worst_iso = max(worst_iso, abs(curv_iso) / (16 * U * size_iso))
# the linear router against the GMM posterior, on a grid
grid = np.stack(np.meshgrid(np.linspace(-5, 5, 60), np.linspace(-5, 5, 60)), -1).reshape(-1, 2)
logits_iso = theory.isotropic_router_logits(grid, means, 0.5, weights)
err_router = np.max(np.abs(gmm.softmax(logits_iso, axis=1) - gmm.responsibilities(grid, means, iso_var, weights)))
tol_router = 16 * U * np.max(np.abs(logits_iso))
print(f"diagonal: curvature of the log-odds vs formula, worst / tolerance = {worst_diag:.3f}")
print(f"isotropic: curvature of the log-odds, worst / tolerance          = {worst_iso:.3f}")
print(f"softmax(x mu^T / s^2 + b) vs GMM posterior: {err_router:.1e} (tolerance {tol_router:.1e})")
assert worst_diag <= 1 and worst_iso <= 1 and err_router <= tol_router

# %% [markdown]
# The same components, first with one shared variance, then with their own
# diagonal variances: colour = the winning component, fading to white where
# its responsibility drops. Straight boundaries (a power diagram) against
# conics. In general a narrow component can even be enclosed by a wide one, an
# island that no linear router can express.

# %%
n_grid = 120 if SMALL else 300
gx, gy = np.meshgrid(np.linspace(-5, 5, n_grid), np.linspace(-4.5, 4.5, n_grid))
pts = np.column_stack([gx.ravel(), gy.ravel()])
fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
for ax, var, title in ((axes[0], iso_var, r"shared isotropic $\sigma^2 = 0.5$: linear router"),
                       (axes[1], variances, "per-component diagonal variances: quadratic router")):
    g = gmm.responsibilities(pts, means, var, weights)
    rgb = colors[g.argmax(1), :3] * g.max(1, keepdims=True) + (1 - g.max(1, keepdims=True))
    ax.imshow(rgb.reshape(n_grid, n_grid, 3), origin="lower", extent=(-5, 5, -4.5, 4.5), aspect="auto")
    ax.scatter(*means.T, c="white", edgecolors="black", s=50)
    ax.set(title=title, xlabel="$x_1$", ylabel="$x_2$")
plt.show()

# %% [markdown]
# ## Summary
#
# | claim | measured | allowed |
# |---|---|---|
# | write/read $=$ explicit $D^{-1}A\mathbf V$ (and `gma.gma`, `gma.gma_dense`) | $\sim 10^{-16}$ | $4(N+K+1)\,u\max\lvert v\rvert$ |
# | $A_{ij} = P(z_i = z_j)$: enumeration, Monte Carlo | $\sim 10^{-17}$; within 6 s.e. | $4K u$; $3/\sqrt{n_{\mathrm{mc}}}$ |
# | $0 \le A_{ij} \le 1$, $\operatorname{rank} A \le K$, PSD if $X_Q = X_K$ | exact rank $K$; $\sigma_{K+1}/\sigma_1 \sim 10^{-17}$ | $N u$ |
# | outputs $=$ $W M$, inside the hull of the values ($\epsilon = 0$) | $\sim 10^{-16}$ | rounding model |
# | with $\epsilon = 10^{-6}$: rows of $W$ sum to $1 - \epsilon/(\gamma^Q_i\cdot Z + \epsilon) < 1$; outputs in the hull of the values and $0$, not of the values alone | $\sim 10^{-16}$; outside the values' hull by up to $0.8$ ($2$ at small sizes) | $4u$; rounding model; $> 0.1\,\mathrm{range}(v)$ |
# | memory: slope GMA, slope explicit; $a$ of the explicit form | $0.98$–$0.99$; $1.96$–$1.98$; $8.000$ bytes | $[0.9, 1.02]$; $[1.9, 2.02]$; $\pm 1\%$ |
# | isotropic router $=$ linear softmax; diagonal log-odds curvature | $\sim 10^{-16}$; formula to rounding | $16\,u\max\lvert\ell\rvert$ |
#
# What is *not* shown here: the time ratio between the two forms (printed,
# machine-dependent), and causality. Lesson 3 makes GMA causal with prefix
# sums and shows that it is then exactly causal linear attention with the
# responsibilities as feature map.

# %% [markdown]
# ## Exercises
#
# Four exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell after it; until you answer, the check
# prints that the exercise is not done yet, and a wrong answer raises an
# `AssertionError` that says what is wrong. Each exercise runs on its own
# after the first code cell of the lesson (the imports). Worked solutions are
# in `tutorials/solutions/lesson_02.py`: try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises come after the lesson)

# %% [markdown]
# ### Exercise 2.1 ★ One row of the attention, without the N x N matrix
#
# Write `attention_row(gamma_q, gamma_k, i, eps)`: row $i$ of $D^{-1}A$, the
# weights with which query $i$ reads the keys, as an array of shape `(N_k,)`,
# for `gamma_q` of shape `(N_q, K)` and `gamma_k` of shape `(N_k, K)`. It must
# cost $O(N_k K)$: the check runs it at $N = 4000$ and measures its peak
# memory, where an $N \times N$ matrix would take 122 MiB. Hints: section 2
# (exchange the sums) and section 3 (what row $i$ of $D^{-1}A$ is).

# %%
def attention_row(gamma_q, gamma_k, i, eps=1e-6):
    """Row i of D^-1 A, A = gamma_q gamma_k^T, D = diag(A 1 + eps): shape (N_k,)."""
    raise NotImplementedError("exercise 2.1")


# %%
check("2.1", attention_row)

# %% [markdown]
# ### Exercise 2.2 ★★ Slot means and mixing weights
#
# Write `slots_and_weights(gamma_q, gamma_k, v, eps)`, returning the pair
# `(W, M)`: the slot means $M$ (`(K, d_v)`, row $k$ the weighted average
# $m_k = \tilde V_k / Z_k$ of the values) and the mixing weights $W$
# (`(N_q, K)`) with $O = W M$. The check compares $M$ with the weighted
# averages written out, $W M$ with the explicit $D^{-1}A\mathbf V$, and the
# row sums of $W$ with $1 - \epsilon/(\gamma^Q_i\cdot Z + \epsilon)$, for
# $\epsilon = 10^{-6}$ and for $\epsilon = 0.5$. Section 4 has the
# derivation. Why is "$W M$ equals the output" alone not enough to pin down
# $W$ and $M$?

# %%
def slots_and_weights(gamma_q, gamma_k, v, eps=1e-6):
    """(W, M): mixing weights (N_q, K) and slot means (K, d_v) with W @ M = GMA's output."""
    raise NotImplementedError("exercise 2.2")


# %%
check("2.2", slots_and_weights)

# %% [markdown]
# ### Exercise 2.3 ★★ The isotropic router is linear
#
# When every component has the same variance $\sigma^2$ in every coordinate,
# section 6 shows that the posterior is the softmax of a linear function of
# $x$. Write `isotropic_router(means, variance, weights)`, returning `(R, b)`
# with `R` of shape `(d, K)` and `b` of shape `(K,)`, such that
# `softmax(x @ R + b)` is the posterior of the mixture with `variances`
# equal to `variance` everywhere. Derive it before you code it: which terms
# of $\ell_k(x)$ are common to all $k$ and cancel in the softmax?

# %%
def isotropic_router(means, variance, weights):
    """(R, b): R (d, K) and b (K,) with softmax(x @ R + b) = the isotropic GMM's posterior."""
    raise NotImplementedError("exercise 2.3")


# %%
check("2.3", isotropic_router)

# %% [markdown]
# ### Exercise 2.4 ★★★ The size of A without forming it
#
# The Frobenius norm $\|A\|_F = (\sum_{ij}A_{ij}^2)^{1/2}$ of the implicit
# affinity measures how much the queries and keys share components. Write
# `affinity_norm(gamma_q, gamma_k)`, returning it as one float, in
# $O(NK^2)$ time and without any $N \times N$ (or $N_q \times N_k$) array: the
# check compares with the dense sum at small sizes and measures your peak
# memory at $N = 4000$. Hint: write $\|A\|_F^2 = \operatorname{tr}(A^\top A)$,
# substitute $A = \Gamma_Q\Gamma_K^\top$, and use the cyclic property of the
# trace to put the brackets where section 2 puts them. Can you also say why
# the result is at most $\|\Gamma_Q\|_F\,\|\Gamma_K\|_F$?

# %%
def affinity_norm(gamma_q, gamma_k):
    """||gamma_q gamma_k^T||_F, without forming the N_q x N_k matrix: a float."""
    raise NotImplementedError("exercise 2.4")


# %%
check("2.4", affinity_norm)
