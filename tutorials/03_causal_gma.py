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
# # Lesson 3: Causal GMA, prefix sums and a chunked scan
#
# An autoregressive model may let token $t$ read only tokens $j \le t$. For
# Gaussian Mixture Attention (lesson 2) that means the lower triangle of the
# implicit affinity $A = \Gamma_Q\Gamma_K^\top$:
#
# $$
# o_t = \frac{\sum_{j \le t} A_{tj}\, v_j}{\sum_{j\le t} A_{tj} + \epsilon},
# \qquad A_{tj} = \gamma^Q_t\cdot\gamma^K_j .
# $$
#
# Notation follows `docs/glossary.md`.
#
# **You will learn to**
#
# - derive the prefix sums $S_t$, $z_t$ that turn causal GMA into a recurrence
#   with a state of constant size;
# - implement the token recurrence and the chunked scan, and check both
#   against the explicit $\operatorname{tril}(A)$ form to rounding;
# - measure the peak memory of three implementations and explain why the
#   `cumsum` vectorisation loses to the quadratic form;
# - count the multiply-adds of the chunked scan exactly, for any chunk size;
# - explain why causal GMA is causal linear attention with the
#   responsibilities as feature map.
#
# **Before this lesson**: lesson 2 (GMA, the exchange of sums, the guard
# $\epsilon$). From outside: matrix products and their cost, prefix sums,
# floating-point rounding (the model of `docs/floating_point.md`).
#
# **The claims of this lesson.**
#
# 1. The same exchange of sums as in lesson 2 turns this into *prefix sums*
#    $S_t = \sum_{j\le t}\gamma^K_j v_j^\top$ ($K\times d_v$) and
#    $z_t = \sum_{j\le t}\gamma^K_j$ ($K$): a recurrence with a state of
#    constant size, one token at a time.
# 2. Vectorising that recurrence with `cumsum` is correct but stores all $N$
#    states, $N \times K \times d_v$ numbers: more than the $N^2$ of the
#    explicit form whenever $K d_v > N$.
# 3. A **chunked scan** (a $C\times C$ masked block inside each chunk, the
#    state $(S, z)$ carried across chunks) computes the same outputs for any
#    chunk size $C$, including sequences whose length is not a multiple of
#    $C$, in $O(NK(d_r + d_v) + NC(K + d_v))$ time (responsibilities, state,
#    and the $C\times C$ blocks). Given the responsibilities, the scan itself
#    allocates only $8(d_v + 1)$ bytes per token (its output and its
#    denominators) plus a working set independent of $N$. Its inputs
#    $\Gamma_Q$, $\Gamma_K$, $\mathbf V$ are not part of that count; with them, and
#    with the responsibilities computed from the routing vectors, the memory
#    of causal GMA grows like $N(K + d_v)$: $8(2K + d_v + 1)$ bytes per token
#    allocated by the computation, plus the inputs.
# 4. Causal GMA *is* causal linear attention (Katharopoulos et al., 2020)
#    with the responsibilities as feature map: the two share one
#    implementation in `refimpl.attention.feature_attention`, and linear
#    attention with $\phi = \operatorname{elu} + 1$ is the same scan with
#    another feature map.
#
# Every equality is asserted to rounding. As in lesson 2, $\epsilon$ is the
# guard of the denominators (`eps=1e-6`), and machine epsilon
# $u = 2.2\times10^{-16}$ (float64, `U` in the code) sets the tolerances; the
# two are unrelated. `TUTORIAL_SMALL=1` (set by CI) runs on small arrays; the default
# is full size.

# %%
import os
import time
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from refimpl import attention, gma, gmm

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16 (not the guard eps = 1e-6)
print(f"small sizes: {SMALL}")

# %% [markdown]
# A random problem: $K = 8$ components in $d_r = 4$, values of dimension
# $d_v = 5$, and a sequence length that is *not* a multiple of the default
# chunk size 64, nor of any power of two. Every equality below is checked to
# $4(N + K + 1)\,u\max|v|$, the rounding model of lesson 2: two orders of
# summation of terms that are nonnegative weights times values. Why this
# tolerance: `docs/floating_point.md`, section Lesson 3.

# %%
rng = np.random.default_rng(0)
N, K, d_r, d_v = (201 if SMALL else 1003), 8, 4, 5
x_q, x_k, v = rng.normal(size=(N, d_r)), rng.normal(size=(N, d_r)), rng.normal(size=(N, d_v))
means = 1.2 * rng.normal(size=(K, d_r))
variances = rng.uniform(0.4, 1.5, size=(K, d_r))
weights = rng.dirichlet(np.ones(K))
gamma_q = gmm.responsibilities(x_q, means, variances, weights)
gamma_k = gmm.responsibilities(x_k, means, variances, weights)

# the explicit causal form: tril(A), then D^-1 A V (the oracle; O(N^2))
out_tril = gma.gma_dense(gamma_q, gamma_k, v, causal=True)
# rounding model of lesson 2: two orders of summation of at most N + K nonnegative-weighted terms
tol = 4 * (N + K + 1) * U * np.max(np.abs(v))
print(f"N = {N}, tolerance for equalities: {tol:.1e} = {tol / np.max(np.abs(v)):.1e} max|v|")

# %% [markdown]
# ## 1. Prefix sums and the recurrence
#
# Exchange the sums over $j$ and $k$ as in lesson 2, but keep the range
# $j \le t$:
#
# $$
# \sum_{j\le t} A_{tj} v_j = \sum_k \gamma^Q_{tk}\underbrace{\sum_{j\le t}\gamma^K_{jk} v_j}_{(S_t)_k},
# \qquad
# \sum_{j\le t} A_{tj} = \sum_k \gamma^Q_{tk}\underbrace{\sum_{j\le t}\gamma^K_{jk}}_{(z_t)_k},
# \qquad\text{so}\qquad
# o_t = \frac{(\gamma^Q_t)^\top S_t}{\gamma^Q_t\cdot z_t + \epsilon} .
# $$
#
# The prefix sums obey $S_t = S_{t-1} + \gamma^K_t v_t^\top$ and
# $z_t = z_{t-1} + \gamma^K_t$ with $S_0 = 0$, $z_0 = 0$. So causal GMA is a
# recurrent network whose state is the pair $(S_t, z_t)$, $K(d_v + 1)$ numbers
# whatever $t$: at generation time each new token costs $O(K d_v)$ work,
# where softmax attention must revisit all $t$ earlier keys. Written out
# literally:

# %%
def causal_gma_recurrence(phi_q, phi_k, v, eps=1e-6):
    """o_t = phi_q_t^T S_t / (phi_q_t . z_t + eps), one token at a time."""
    n, f = phi_k.shape
    s = np.zeros((f, v.shape[1]))  # S_t: f x d_v
    z = np.zeros(f)  # z_t: f
    out = np.empty((n, v.shape[1]))
    for t in range(n):
        s += np.outer(phi_k[t], v[t])  # write token t
        z += phi_k[t]
        out[t] = phi_q[t] @ s / (phi_q[t] @ z + eps)  # read with query t
    return out


out_rec = causal_gma_recurrence(gamma_q, gamma_k, v)
out_ref = gma.gma(x_q, x_k, v, means, variances, weights, causal=True)
err_rec = np.max(np.abs(out_rec - out_tril))
err_ref = np.max(np.abs(out_ref - out_tril))
print(f"recurrence vs tril(A) form:       {err_rec:.1e}")
print(f"refimpl causal gma vs tril(A) form: {err_ref:.1e}")
assert err_rec <= tol and err_ref <= tol

# %% [markdown]
# Causality is a property we can test directly: changing the *last* key and
# value must leave every earlier output unchanged, bit for bit (the earlier
# outputs never read them), while a bidirectional GMA changes everywhere.

# %%
v_changed, x_k_changed = v.copy(), x_k.copy()
v_changed[-1] += 10.0
x_k_changed[-1] -= 3.0
out_changed = gma.gma(x_q, x_k_changed, v_changed, means, variances, weights, causal=True)
bidir = gma.gma(x_q, x_k, v, means, variances, weights)
bidir_changed = gma.gma(x_q, x_k_changed, v_changed, means, variances, weights)
print(f"causal: outputs 0..N-2 changed by {np.max(np.abs(out_changed[:-1] - out_ref[:-1]))}, "
      f"output N-1 by {np.max(np.abs(out_changed[-1] - out_ref[-1])):.2f}")
print(f"bidirectional: smallest change of an output row {np.min(np.max(np.abs(bidir_changed - bidir), axis=1)):.1e}")
assert np.array_equal(out_changed[:-1], out_ref[:-1])
assert np.min(np.max(np.abs(bidir_changed - bidir), axis=1)) > 0

# %% [markdown]
# ## 2. The naive vectorisation stores every state
#
# The loop above runs $N$ Python iterations. The obvious NumPy translation
# replaces it by cumulative sums:
#
# ```python
# S_all = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)   # N x K x d_v
# z_all = np.cumsum(gamma_k, axis=0)                               # N x K
# out = einsum("tk,tkd->td", gamma_q, S_all) / (einsum("tk,tk->t", gamma_q, z_all) + eps)
# ```
#
# It is correct, and it keeps **all** $N$ states $S_1,\dots,S_N$ alive at once
# (and the broadcast product they are summed from): $2NKd_v$ float64 numbers.
# The explicit causal form holds $N\times N$ matrices. For $K d_v > N$ the
# "linear-time" vectorisation uses *more* memory than the quadratic form it
# was meant to replace.

# %%
def causal_gma_cumsum(phi_q, phi_k, v, eps=1e-6):
    s_all = np.cumsum(phi_k[:, :, None] * v[:, None, :], axis=0)  # every S_t at once
    z_all = np.cumsum(phi_k, axis=0)
    return np.einsum("tk,tkd->td", phi_q, s_all) / (np.einsum("tk,tk->t", phi_q, z_all) + eps)[:, None]


err_cumsum = np.max(np.abs(causal_gma_cumsum(gamma_q, gamma_k, v) - out_tril))
print(f"cumsum form vs tril(A) form: {err_cumsum:.1e}")
assert err_cumsum <= tol

# %% [markdown]
# We measure the peak memory of the three ways at $K = 32$, $d_v = 64$
# ($K d_v = 2048$) for growing $N$: the cumsum form, the explicit `tril`
# form, and the chunked scan of `refimpl` (next section), all from the same
# responsibilities. What is counted: the peak of what one call allocates, as
# `tracemalloc` sees it (NumPy reports its array buffers to it). What is not:
# the inputs $\Gamma_Q$, $\Gamma_K$ ($2NK$ numbers) and $\mathbf V$ ($N d_v$), which
# exist before tracing starts. A fourth curve counts them in the way a model
# would meet them: the whole causal GMA from routing vectors ($d_r = 8$), the
# responsibilities computed inside the traced call (`gmm.responsibilities`
# for queries and keys, then the scan: the steps of `gma.gma`); only the
# routing vectors and $\mathbf V$ are then outside the count.

# %%
def traced_peak(f):
    """Peak bytes allocated (as tracemalloc sees them) while f() runs."""
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


K_m, d_v_m, d_r_m = 32, 64, 8
r = np.random.default_rng(1)
means_m, variances_m = r.normal(size=(K_m, d_r_m)), r.uniform(0.5, 1.5, size=(K_m, d_r_m))
weights_m = r.dirichlet(np.ones(K_m))


def problem(n):
    return r.dirichlet(np.ones(K_m), size=n), r.dirichlet(np.ones(K_m), size=n), r.normal(size=(n, d_v_m))


Ns = 2 ** np.arange(8, 12 if SMALL else 13)  # 256 ... 2048 (small) or 4096 (full)
Ns_scan = 2 ** np.arange(8, 15 if SMALL else 17)  # the scan is cheap: go further, up to 16384 or 65536
peaks = {"cumsum": [], "tril(A)": []}
for n in Ns:
    gq_m, gk_m, v_m = problem(n)
    peaks["cumsum"].append(traced_peak(lambda: causal_gma_cumsum(gq_m, gk_m, v_m)))
    peaks["tril(A)"].append(traced_peak(lambda: gma.gma_dense(gq_m, gk_m, v_m, causal=True)))


def causal_gma_from_routing(x_q, x_k, v):
    """Responsibilities, then the chunked scan: causal GMA as gma.gma computes it."""
    gq = gmm.responsibilities(x_q, means_m, variances_m, weights_m)
    gk = gmm.responsibilities(x_k, means_m, variances_m, weights_m)
    return attention.feature_attention(gq, gk, v, causal=True)


peak_scan, peak_full = [], []
for n in Ns_scan:
    gq_m, gk_m, v_m = problem(n)
    peak_scan.append(traced_peak(lambda: attention.feature_attention(gq_m, gk_m, v_m, causal=True)))
    xq_m, xk_m = r.normal(size=(n, d_r_m)), r.normal(size=(n, d_r_m))
    peak_full.append(traced_peak(lambda: causal_gma_from_routing(xq_m, xk_m, v_m)))
peaks = {name: np.array(p, float) for name, p in peaks.items()}
peak_scan, peak_full = np.array(peak_scan, float), np.array(peak_full, float)

fig, ax = plt.subplots(figsize=(7, 4.5))
ax.loglog(Ns, peaks["cumsum"] / 2**20, "o-", label="cumsum")
ax.loglog(Ns, peaks["tril(A)"] / 2**20, "^-", label="tril(A)")
ax.loglog(Ns_scan, peak_scan / 2**20, "s-", label="chunked scan (C = 64), given $\\Gamma_Q, \\Gamma_K$")
ax.loglog(Ns_scan, peak_full / 2**20, "d-", label="responsibilities + chunked scan")
ax.loglog(Ns_scan, 8.0 * Ns_scan * K_m * d_v_m / 2**20, "k:", label=r"one $N\times K\times d_v$ array")
ax.loglog(Ns_scan, 8.0 * Ns_scan**2 / 2**20, "k--", lw=0.8, label=r"one $N\times N$ array")
ax.set(xlabel="sequence length $N$", ylabel="peak memory (MiB)", title=f"causal GMA, K = {K_m}, d_v = {d_v_m}",
       ylim=(0.1, 3e4))
ax.legend()
plt.show()

per_cumsum = peaks["cumsum"] / (8.0 * Ns * K_m * d_v_m)
per_tril = peaks["tril(A)"] / (8.0 * Ns**2)
a_s, b_s, c_s = np.polyfit(Ns_scan, peak_scan, 2, w=1 / peak_scan)
a_f, b_f, c_f = np.polyfit(Ns_scan, peak_full, 2, w=1 / peak_full)
slope_scan = np.log(peak_scan[-1] / peak_scan[-2]) / np.log(2)
scan_at_Ns = peak_scan[np.isin(Ns_scan, Ns)]
print("peak / (8 N K d_v) for cumsum: ", np.round(per_cumsum, 4))
print("peak / (8 N^2) for tril(A):    ", np.round(per_tril, 4))
print(f"scan fit: {b_s:.1f} bytes per token = {b_s / (8 * (d_v_m + 1)):.3f} x 8 (d_v + 1), constant {c_s / 1024:.0f} KiB, "
      f"quadratic term {a_s * Ns_scan[-1]**2 / peak_scan[-1]:+.2%} of the peak at N = {Ns_scan[-1]}")
print(f"scan: memory slope between the two largest N = {slope_scan:.3f}; "
      f"cumsum / scan at N = {Ns[-1]}: {peaks['cumsum'][-1] / scan_at_Ns[-1]:.0f}x")
print(f"responsibilities + scan: {b_f:.1f} bytes per token = {b_f / (8 * (2 * K_m + d_v_m + 1)):.3f} x 8 (2K + d_v + 1), "
      f"constant {c_f / 1024:.0f} KiB; with the inputs (routing vectors, V): "
      f"{b_f + 8 * (2 * d_r_m + d_v_m):.0f} bytes per token")
assert np.all(per_cumsum >= 2.0)  # two N x K x d_v arrays are alive at its peak
below = Ns < K_m * d_v_m
assert np.all(peaks["cumsum"][below] > peaks["tril(A)"][below])  # worse than N^2 while K d_v > N
assert 0.95 <= slope_scan <= 1.02
# given the responsibilities, only the output (d_v floats) and the denominators (1 float) grow with N
assert abs(b_s - 8 * (d_v_m + 1)) <= 0.01 * 8 * (d_v_m + 1)
# from routing vectors: Gamma_Q, Gamma_K (2K floats), output and denominators are alive together during the scan
assert b_f >= 0.99 * 8 * (2 * K_m + d_v_m + 1)
assert abs(a_s) * Ns_scan[-1] ** 2 <= 0.02 * peak_scan[-1]
assert np.all(scan_at_Ns < peaks["cumsum"] / 10)

# %% [markdown]
# The cumsum form sits exactly on twice the $N\times K\times d_v$ line (the
# broadcast product and its cumulative sum), above the explicit $N\times N$
# form until $N$ reaches $K d_v = 2048$. The scan's peak is a straight line:
# $8(d_v + 1)$ bytes per token (its output and its denominators, nothing
# else that grows with $N$) plus a constant of about a hundred KiB (the state
# $K\times d_v$, the $C\times C$ blocks, the chunk's temporaries). At small
# $N$ the constant dominates and the curve is flat, which is why we fit the
# line and take the slope only at the largest sizes, where the constant is a
# fraction of a percent. The fitted slope is asserted to within 1% of
# $8(d_v + 1)$: the fit is weighted by relative error and the constant is
# fitted too, so nothing but a term that grows with $N$ can move it.
#
# That $8(d_v + 1)$ does not contain $K$, because the scan is *given* the
# $2NK$ responsibilities. The whole causal GMA from routing vectors
# (diamonds) allocates $8(2K + d_v + 1)$ bytes per token: $\Gamma_Q$ and
# $\Gamma_K$ are alive together with the output and the denominators while
# the scan runs (the temporaries of the log-densities are freed before),
# which is the printed fit. Adding the inputs the model already holds (the
# routing vectors, $2d_r$ numbers per token, and $\mathbf V$, $d_v$), the memory of
# causal GMA is $8N(2K + 2d_v + 2d_r + 1)$ bytes plus a constant: it grows
# like $N(K + d_v)$, and never like $NKd_v$ or $N^2$.
#
# ## 3. The chunked scan, derived
#
# Cut the sequence into chunks of $C$ tokens; the last chunk may be shorter.
# Let chunk $c$ cover tokens $a \le t < b$, and let $(S_{\text{prev}}, z_{\text{prev}})
# = (S_{a-1}, z_{a-1})$ be the state after all earlier chunks. For a token $t$
# inside the chunk, split the prefix sum at $a$:
#
# $$
# (\gamma^Q_t)^\top S_t
#   = (\gamma^Q_t)^\top S_{\text{prev}} + \sum_{a\le j\le t} (\gamma^Q_t\cdot\gamma^K_j)\, v_j^\top .
# $$
#
# Stack the chunk's rows into $\Gamma^Q_c$, $\Gamma^K_c$ ($C\times K$) and
# $\mathbf V_c$ ($C\times d_v$). The first term is the matrix product
# $\Gamma^Q_c S_{\text{prev}}$; the second is the lower triangle of the
# $C\times C$ block $\Gamma^Q_c \Gamma^{K\top}_c$ (entries with $j \le t$)
# times $\mathbf V_c$. The same split for the denominator, then the update of the
# state, give the whole algorithm:
#
# $$
# O_c = \frac{\Gamma^Q_c S_{\text{prev}} + \operatorname{tril}(\Gamma^Q_c\Gamma^{K\top}_c)\,\mathbf V_c}
#            {\Gamma^Q_c z_{\text{prev}} + \operatorname{tril}(\Gamma^Q_c\Gamma^{K\top}_c)\,\mathbf 1 + \epsilon},
# \qquad S \mathrel{+}= \Gamma^{K\top}_c \mathbf V_c, \qquad z \mathrel{+}= \Gamma^{K\top}_c\mathbf 1 .
# $$
#
# Every step is a matrix product. **Time.** Count the multiply-adds of a
# chunk of $c$ tokens: reading the state, $\Gamma^Q_c S_{\text{prev}}$ and
# $\Gamma^Q_c z_{\text{prev}}$, costs $cK(d_v + 1)$; the block
# $\Gamma^Q_c\Gamma^{K\top}_c$ costs $c^2K$ and applying it to $\mathbf V_c$ costs
# $c^2 d_v$; writing the state, $\Gamma^{K\top}_c \mathbf V_c$, costs $cKd_v$. Summed
# over the chunks ($\sum c = N$, $\sum c^2 \le NC$):
#
# $$
# NK(2d_v + 1) + (K + d_v)\sum_{\text{chunks}} c^2 \;\le\; NK(2d_v + 1) + NC(K + d_v) .
# $$
#
# The responsibilities that feed the scan cost $O(NKd_r)$ (lesson 2), so
# causal GMA takes $O(NK(d_r + d_v) + NC(K + d_v))$ time. The second term is
# the within-chunk blocks, and it is not small: at the default $C = 64$ with
# $K = 32$, $d_v = 64$ it is $6144N$ against $4128N$ for the state, and at
# $C \ge N$ it is the $N^2(K + d_v)$ of the explicit form. **Extra memory:**
# $O(K d_v + C^2 + C(K + d_v))$ besides the output and the denominators,
# independent of $N$. The extremes: $C = 1$ is the recurrence of section 1
# ($N$ Python iterations), $C \ge N$ is the explicit $\operatorname{tril}$
# form (one block of size $N\times N$). Here it is in ten lines; its products
# go through `mm`, so that a counting product can check the count above
# exactly, for every chunk size:

# %%
def causal_gma_chunked(phi_q, phi_k, v, chunk, eps=1e-6, mm=np.matmul):
    n, f = phi_k.shape
    out = np.empty((n, v.shape[1]))
    s, z = np.zeros((f, v.shape[1])), np.zeros(f)  # state after the earlier chunks
    for a in range(0, n, chunk):
        b = min(a + chunk, n)  # the last chunk may be short
        pq, pk, vc = phi_q[a:b], phi_k[a:b], v[a:b]
        block = np.tril(mm(pq, pk.T))  # (gamma_q_t . gamma_k_j) for a <= j <= t < b
        out[a:b] = (mm(pq, s) + mm(block, vc)) / (mm(pq, z) + block.sum(axis=1) + eps)[:, None]
        s += mm(pk.T, vc)  # carry the state to the next chunk
        z += pk.sum(axis=0)
    return out


class CountingMatmul:
    """a @ b that adds up its multiply-adds: rows x inner dimension x columns."""

    def __init__(self):
        self.total = 0

    def __call__(self, a, b):
        self.total += a.shape[0] * a.shape[1] * (b.shape[1] if b.ndim == 2 else 1)
        return a @ b


chunks = [1, 7, 64, 100, N - 1, N, 2 * N]
print(f"N = {N} (N mod 64 = {N % 64}, N mod 7 = {N % 7})")
print("  chunk   error: this scan / refimpl   multiply-adds: counted, NK(2d_v+1) + (K+d_v) sum c^2, NK(2d_v+1) + NC(K+d_v)")
worst = 0.0
for c in chunks:
    count = CountingMatmul()
    e_mine = np.max(np.abs(causal_gma_chunked(gamma_q, gamma_k, v, c, mm=count) - out_tril))
    e_ref = np.max(np.abs(gma.gma(x_q, x_k, v, means, variances, weights, causal=True, chunk_size=c) - out_tril))
    worst = max(worst, e_mine, e_ref)
    sizes = np.diff(np.r_[np.arange(0, N, c), N])  # the chunk lengths, the last one possibly short
    predicted = N * K * (2 * d_v + 1) + (K + d_v) * int(np.sum(sizes**2))
    bound = N * K * (2 * d_v + 1) + N * c * (K + d_v)
    print(f"  {c:5d}   {e_mine:.1e} / {e_ref:.1e}   {count.total:22d} {predicted:30d} {bound:24d}")
    assert count.total == predicted <= bound  # exact integer count, and the time bound with its block term
print(f"worst {worst:.1e} = {worst / np.max(np.abs(v)):.1e} max|v| (tolerance {tol:.1e})")
assert worst <= tol

# %% [markdown]
# **The chunk size is a time trade-off, not an accuracy one.** Small chunks
# mean many Python iterations of small matrix products (interpreter overhead
# per chunk), large chunks mean $C^2$ work per chunk on the masked block, of
# which half is thrown away by `tril`. In between the time is flat over a
# range of chunk sizes; `refimpl` uses $C = 64$. The times below are
# printed and drawn, not asserted: they depend on the machine.
#
# **How they are measured, and what went wrong before.** Each matrix
# product of the scan calls BLAS (OpenBLAS under NumPy), which starts as
# many threads as the machine has cores once a product is large enough. An
# earlier version of this figure showed a cliff of two orders of magnitude
# at one chunk size and was read as a property of the algorithm; it was
# not: when several lessons ran at once (as a test suite runs them), every
# process's BLAS threads competed for the same cores, and a product just
# above BLAS's threading threshold waited for its threads instead of
# computing. On a 2-core machine shared with other processes, $C = 256$ at
# $N = 8192$ took 0.40 s with OpenBLAS's 2 threads and 0.022 s with one
# (median of 7 runs each, measured with `threadpoolctl` as below). So the
# cell pins BLAS to one thread with `threadpoolctl` (what the scan's cost
# model counts: multiply-adds, not threads) and reports the **median** of
# several runs, which one slow run cannot move, rather than the best or a
# single run.

# %%
n_t = 2048 if SMALL else 8192
r = np.random.default_rng(2)
gq_t, gk_t, v_t = r.dirichlet(np.ones(K_m), size=n_t), r.dirichlet(np.ones(K_m), size=n_t), r.normal(size=(n_t, d_v_m))
chunk_sizes = 2 ** np.arange(0, 12 if SMALL else 14)
times, repeats = [], 5
with threadpool_limits(limits=1, user_api="blas"):  # one BLAS thread: no oversubscription when processes share cores
    blas = [pool for pool in threadpool_info() if pool["user_api"] == "blas"]
    assert blas and all(pool["num_threads"] == 1 for pool in blas), blas  # pinned, in every BLAS library loaded
    for c in chunk_sizes:
        runs = []
        for _ in range(repeats if c >= 8 else 3):  # C < 8: thousands of Python iterations, fewer repeats
            t0 = time.perf_counter()
            attention.feature_attention(gq_t, gk_t, v_t, causal=True, chunk_size=int(c))
            runs.append(time.perf_counter() - t0)
        assert len(runs) >= 3
        times.append(np.median(runs))
times = np.array(times)

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.loglog(chunk_sizes, times, "o-")
ax.axvline(64, color="gray", ls=":", label="default C = 64")
ax.set(xlabel="chunk size $C$", ylabel=f"seconds (median of {repeats}, one BLAS thread)", title=f"chunked causal scan, N = {n_t}, K = {K_m}, d_v = {d_v_m}")
ax.legend()
plt.show()
print(f"fastest chunk size here: {chunk_sizes[times.argmin()]}; C = 1 is {times[0] / times.min():.0f}x slower, "
      f"C = N is {times[-1] / times.min():.1f}x slower")

# %% [markdown]
# ## 4. Causal GMA is causal linear attention with $\phi = \gamma$
#
# Nothing in sections 1–3 used that the rows of $\Gamma$ are posteriors: the
# scan only needs nonnegative *features* $\phi_Q(x^Q_t)$, $\phi_K(x^K_j)$, so
# that the denominators stay positive. That is the definition of (causal)
# linear attention, Katharopoulos et al. (2020):
#
# $$
# o_t = \frac{\phi(q_t)^\top \sum_{j\le t}\phi(k_j) v_j^\top}{\phi(q_t)\cdot\sum_{j\le t}\phi(k_j) + \epsilon},
# $$
#
# with the feature map $\phi(x) = \operatorname{elu}(x) + 1$ of dimension $d$.
# Causal GMA is exactly this with $\phi_Q = \gamma(X_Q)$, $\phi_K = \gamma(X_K)$
# of dimension $K$. `refimpl` has one implementation of the scan,
# `attention.feature_attention`, and both mechanisms call it. We check the
# identities from both sides, against the independent forms of this notebook
# (the token loop and the explicit `tril` form):

# %%
out_feat = attention.feature_attention(gamma_q, gamma_k, v, causal=True)
q_lin, k_lin = rng.normal(size=(N, d_r)), rng.normal(size=(N, d_r))
phi_q_lin, phi_k_lin = attention.elu_feature_map(q_lin), attention.elu_feature_map(k_lin)
out_lin = attention.linear_attention(q_lin, k_lin, v, causal=True)
out_lin_tril = gma.gma_dense(phi_q_lin, phi_k_lin, v, causal=True)  # tril(phi_Q phi_K^T), any nonnegative features
errors = {
    "causal gma  vs feature_attention(gamma_Q, gamma_K)": np.max(np.abs(out_ref - out_feat)),
    "feature_attention(gamma) vs tril(A) form": np.max(np.abs(out_feat - out_tril)),
    "linear_attention vs feature_attention(elu + 1)": np.max(np.abs(out_lin - attention.feature_attention(phi_q_lin, phi_k_lin, v, causal=True))),
    "linear_attention vs token loop with phi = elu + 1": np.max(np.abs(out_lin - causal_gma_recurrence(phi_q_lin, phi_k_lin, v))),
    "linear_attention vs tril(phi_Q phi_K^T) form": np.max(np.abs(out_lin - out_lin_tril)),
    "linear_attention vs this notebook's chunked scan": np.max(np.abs(out_lin - causal_gma_chunked(phi_q_lin, phi_k_lin, v, 13))),
}
for name, e in errors.items():
    print(f"{name:52s} {e:.1e}")
print(f"causal gma and feature_attention(gamma) bit for bit identical: {np.array_equal(out_ref, out_feat)}")
assert max(errors.values()) <= tol

# %% [markdown]
# (The rounding model of the tolerance holds for any nonnegative features: it
# only used that every term is a nonnegative weight times a value.)
#
# What differs is only the feature map, and it matters:
#
# | | linear attention | causal GMA |
# |---|---|---|
# | feature $\phi(x)$ | $\operatorname{elu}(x) + 1$, fixed | $\gamma(x)$, posterior of a learned GMM |
# | feature dimension | $d$ (tied to the head size) | $K$ (chosen freely) |
# | $\phi_Q\cdot\phi_K$ | any positive number | $P(z_Q = z_K) \in [0, 1]$ |
# | state per head | $d\times d_v$ and $d$ | $K \times d_v$ and $K$ |
#
# Because GMA's features are probability vectors, the denominator
# $\gamma^Q_t\cdot z_t = \sum_{j\le t} A_{tj}$ counts, in expectation, how many
# earlier keys share the query's component: it is at most $t$, and it is small
# only when the query's components have received little mass so far. Then the
# $\epsilon$ matters: a row with $\gamma^Q_t\cdot z_t \ll \epsilon$ is pulled
# towards 0 (lesson 2, section 4). We show how often that happens here.

# %%
den = np.einsum("tk,tk->t", gamma_q, np.cumsum(gamma_k, axis=0))
print(f"denominators gamma_q_t . z_t: min {den.min():.2e} (at t = {den.argmin()}), median {np.median(den):.1f}, "
      f"max {den.max():.1f} <= N = {N}")
shrink = 1e-6 / (den + 1e-6)  # o_t = (num_t / den_t) * den_t / (den_t + eps): eps shrinks row t by this fraction
print(f"eps = 1e-6 shrinks output rows by at most {shrink.max():.1e} (row {shrink.argmax()}); "
      f"{np.sum(den < 1)} rows have a denominator below 1")
assert np.all(den <= np.arange(1, N + 1) * (1 + 4 * N * U))  # sum of t probabilities, rounded

# %% [markdown]
# ## Summary
#
# | claim | measured | allowed |
# |---|---|---|
# | token recurrence, cumsum form, refimpl $=$ explicit $\operatorname{tril}(A)$ form | $\sim 10^{-16}$ | $4(N+K+1)\,u\max\lvert v\rvert$ |
# | causal: earlier outputs ignore later tokens | bit for bit | exact |
# | cumsum form holds $2NKd_v$ floats, more than $N^2$ for $N < K d_v$ | $2.000\,NKd_v$ | $\ge 2$ |
# | chunked scan, given $\Gamma_Q, \Gamma_K$: memory linear, $8(d_v+1)$ bytes per token, $\ll$ cumsum | slope $0.975$ (small sizes), $0.994$ (full); $520.0$ bytes; quadratic term $< 0.1\%$ | $[0.95, 1.02]$; $\pm 1\%$; $2\%$; $< 1/10$ |
# | causal GMA from routing vectors: $8(2K + d_v + 1)$ bytes per token, plus the inputs | $1031$–$1032$ bytes ($0.999$–$1.000\times$) | $\ge 0.99\times$ |
# | chunked scan $=$ $\operatorname{tril}$ form, $N = 201$ / $1003$, $C \in \{1, 7, 64, 100, N-1, N, 2N\}$ | $\sim 10^{-16}$ | as above |
# | time: $NK(2d_v+1) + (K+d_v)\sum c^2 \le NK(2d_v+1) + NC(K+d_v)$ multiply-adds, $+\,O(NKd_r)$ for $\Gamma$ | counted product by product, every $C$ above | exact |
# | causal GMA $=$ feature attention with $\phi = \gamma$; linear attention $=$ same scan with $\operatorname{elu}+1$ | $\sim 10^{-16}$, GMA bit for bit | as above |
#
# Not shown: gradients. The backward pass of the scan runs the same chunks
# forwards and backwards (reverse prefix sums); lesson 4 derives the GMA
# gradients and checks them by finite differences, causal included.

# %% [markdown]
# ## Exercises
#
# Three exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell after it; until you answer, the check
# prints that the exercise is not done yet and the lesson runs on, and a wrong
# answer stops with a message that says what is wrong. Worked solutions are in
# `tutorials/solutions/lesson_03.py`: try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises come after the lesson)

# %% [markdown]
# ### Exercise 3.1 ★ Generation, one token at a time
#
# At generation time a model produces one token at a time and must not
# revisit the earlier ones. Write the step of the recurrence of section 1 as
# a function of the state: `generate_step(state, gq_t, gk_t, v_t, eps=1e-6)`
# with `state = (S, z)`, the prefix sums over the tokens before $t$
# (`S` of shape `(K, d_v)`, `z` of shape `(K,)`), token $t$'s
# responsibilities `gq_t`, `gk_t` (shape `(K,)`) and value `v_t` (shape
# `(d_v,)`). Return `((S_t, z_t), o_t)`: the new state and the output of
# token $t$ (shape `(d_v,)`). The check runs your step over sequences from
# the zero state and compares with the explicit $\operatorname{tril}(A)$
# form. **Question 3.1.** Which comes first, the write or the read?

# %%
def generate_step(state, gq_t, gk_t, v_t, eps=1e-6):
    """((S_t, z_t), o_t): the state after token t, (K, d_v) and (K,), and token t's output, (d_v,)."""
    raise NotImplementedError("exercise 3.1")


# %%
check("3.1", generate_step)

# %% [markdown]
# ### Exercise 3.2 ★★ Anti-causal GMA by suffix sums
#
# A bidirectional encoder is sometimes split into a left-to-right and a
# right-to-left half. Write the right-to-left one: token $t$ reads the keys
# $j \ge t$,
#
# $$
# o_t = \frac{\sum_{j\ge t} A_{tj}\,v_j}{\sum_{j\ge t} A_{tj} + \epsilon} .
# $$
#
# Derive the *suffix* sums that replace $S_t$ and $z_t$ (section 1), and the
# recurrence they obey, then write `anticausal_gma(gamma_q, gamma_k, v,
# eps=1e-6)` returning the `(N, d_v)` outputs without any $N\times N$ array:
# the check measures your peak memory at $N = 2048$ (a tenth of one
# $N\times N$ float64 array is allowed). Section 3's chunked scan, or a
# well-chosen use of the causal one, will do. Lesson 4 meets these suffix
# sums again, in the gradients of causal GMA.

# %%
def anticausal_gma(gamma_q, gamma_k, v, eps=1e-6):
    """o_t from the keys j >= t, shape (N, d_v), without an N x N array."""
    raise NotImplementedError("exercise 3.2")


# %%
check("3.2", anticausal_gma)

# %% [markdown]
# ### Exercise 3.3 ★★★ A sliding window that stays accurate
#
# Local attention lets token $t$ read only the $w$ most recent keys,
# $t - w < j \le t$. With the prefix sums of section 1 this looks free: the
# window's sums are $S_t - S_{t-w}$ and $z_t - z_{t-w}$. Write that first,
# check it against an explicit banded mask in float64 on a short sequence,
# then run it in float32 on $N = 32768$ tokens with $w = 8$ and values with a
# common offset (`2 + normal`), against a float64 reference. **Question 3.3.**
# Find the failure and explain it (how large is $S_t$, how large is the
# difference?). Then fix it: write `window_gma(gamma_q, gamma_k, v, w, eps=1e-6)`, output `(N, d_v)`
# in the dtype of the inputs, whose error stays within the rounding of one
# window, $4(w + K + 1)\,u\max|v|$, however long the sequence (computing in
# float64 only moves the failure to longer sequences: keep float32). It must
# also be right for $w = 1$ and for $w \ge N$.

# %%
def window_gma(gamma_q, gamma_k, v, w, eps=1e-6):
    """o_t from the keys t - w < j <= t, shape (N, d_v), dtype of the inputs, accurate for any N."""
    raise NotImplementedError("exercise 3.3")


# %%
check("3.3", window_gma)
