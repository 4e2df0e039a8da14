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
# # Lesson 9: GPU kernels without a framework
#
# **You will learn to**
#
# - implement a block reduction (log-sum-exp, softmax) as a tree in shared
#   memory, and check it against `refimpl`, extreme inputs included;
# - count the reads from global memory of a matrix product, and explain why
#   shared-memory tiling divides them by the tile width;
# - prove that the online softmax is exact, and implement it as a tiled kernel;
# - turn the chunked causal scan into three parallel steps, and check them
#   against the sequential scan;
# - explain why float atomics make results change from run to run, and
#   measure it.
#
# **Before this lesson**: lessons 1, 2 and 3 (the responsibilities, GMA and
# its chunked causal scan). From outside the course: floating-point
# arithmetic (rounding, why addition is not associative) and matrix
# products. No experience of GPUs is needed.
#
# Notation follows `docs/glossary.md`.
#
# Lessons 1 to 8 computed everything with NumPy. This lesson writes the same
# mathematics as CUDA kernels in Python with Numba, the way `gpu.numba_cuda`
# does: no deep-learning framework, one thread at a time. Each kernel of
# `gpu.numba_cuda` mirrors one loop body of a `refimpl` core, and its tests
# compare the two.
#
# **The claims of this lesson.**
#
# 1. The responsibilities kernel gives each row a block of threads and each
#    thread a set of components; the block combines its threads' partial
#    log-sum-exps by a tree in shared memory. It agrees with `refimpl`,
#    extreme inputs included.
# 2. Shared-memory tiling cuts the reads from global memory of a matrix
#    product by the tile width, without changing a single addition.
# 3. The online softmax (a running maximum, sum and accumulator, rescaled at
#    each tile) gives the exact softmax: we prove it, then check it.
# 4. Causal GMA's chunked scan becomes three parallel steps on a GPU: all
#    chunk states at once, a prefix over the chunks, the masked product
#    inside each chunk. It never holds an $N\times K\times d_v$ array.
# 5. Float atomics would make results depend on the order in which threads
#    are scheduled, because floating-point addition is not associative; an
#    ordered reduction makes every run give the same bits.
# 6. The same GMA through cuBLAS plus a few fused kernels (`gpu.cupy_kernels`):
#    the matrix products are most of the work, and the rest is fused.
# 7. Speed, measured when a GPU is present; without one, the kernels run in
#    the CUDA simulator, which checks correctness and measures no speed.
#
# The simulator runs every GPU thread as a Python thread, so without a GPU
# all sizes here are tiny. `TUTORIAL_SMALL=1` (set by CI) changes nothing
# more.

# %% [markdown]
# ## 0. Where the kernels run
#
# Numba reads `NUMBA_ENABLE_CUDASIM` once, when it is first imported. So the
# very first thing is to choose: a GPU if the CUDA driver reports one, the
# simulator otherwise.

# %%
import importlib
import math
import os
import sys
import time

import gpu

TARGET = gpu.use_simulator_without_device()  # before anything imports numba

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from scipy.special import logsumexp  # noqa: E402

import gpu.numba_cuda as nc  # noqa: E402
from refimpl import attention, gma, gmm  # noqa: E402

ON_GPU = TARGET == "device"
if not ON_GPU:
    sys.setswitchinterval(1e-4)  # every simulated GPU thread is a Python thread: switching often makes barriers cheap
SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
rng = np.random.default_rng(9)
print(f"kernels run on: {TARGET}")
for backend, (usable, why) in gpu.backend_status().items():
    print(f"  {backend:10s} usable={usable}: {why}")

# %% [markdown]
# ## 1. Threads, blocks and the responsibilities kernel
#
# A kernel is a function that every thread of a *grid* runs. Threads come in
# *blocks* (up to 1024 threads) that can share fast on-chip memory and wait
# for each other (`cuda.syncthreads()`); blocks cannot. `cuda.threadIdx.x`
# and `cuda.blockIdx.x` say which thread is running.
#
# The responsibilities $\gamma_{ik} = \exp(l_{ik} - \operatorname{lse}_m l_{im})$
# need, per row $i$, a reduction over the $K$ components. The natural mapping:
# **one block per row, threads strided over components**. Thread $t$ of a
# block of $T$ threads handles components $t, t+T, t+2T, \dots$ and keeps a
# running pair $(m_t, s_t)$: the maximum of its logits and
# $\sum e^{l - m_t}$. Two pairs combine exactly:
#
# $$(m, s) \oplus (m', s') = \bigl(M,\; s\,e^{m - M} + s'\,e^{m' - M}\bigr),\quad M = \max(m, m'),$$
#
# and the block combines its $T$ pairs by a tree in shared memory: at each
# step, thread $t < h$ combines its pair with thread $t+h$'s, $h = T/2, T/4,
# \dots, 1$. The order of the combinations is fixed by the thread indices, so
# every run gives the same bits (section 5). The empty pair is
# $(-\infty, 0)$: combining two of them must give it back, not
# $e^{-\infty+\infty} = $ nan (exercise 9.1).
#
# Here is that reduction on its own, as a kernel written in this notebook.

# %%
THREADS = 8  # threads per block: a power of two; small, for the simulator


@cuda.jit
def row_logsumexp(a, out):
    # out[i] = log sum_k exp(a[i, k]): block i owns row i, thread t the entries k = t, t + T, ...
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    m_shared = cuda.shared.array(THREADS, dtype=a.dtype)  # [T] each thread's running maximum
    s_shared = cuda.shared.array(THREADS, dtype=a.dtype)  # [T] and its sum of exp(a - maximum)
    m = -math.inf
    s = 0.0
    for k in range(t, a.shape[1], THREADS):
        # the pair (m, s) absorbs a[i, k]: rescale the sum when the maximum grows
        if a[i, k] > m:
            s = s * math.exp(m - a[i, k]) + 1.0
            m = a[i, k]
        else:
            s += math.exp(a[i, k] - m)
    m_shared[t] = m
    s_shared[t] = s
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            # (m, s) + (m', s') = (M, s e^(m - M) + s' e^(m' - M)), M = max(m, m')
            m1, s1 = m_shared[t], s_shared[t]
            m2, s2 = m_shared[t + h], s_shared[t + h]
            big = max(m1, m2)
            if big > -math.inf:
                s_shared[t] = s1 * math.exp(m1 - big) + s2 * math.exp(m2 - big)
            m_shared[t] = big
        cuda.syncthreads()
        h //= 2
    if t == 0:
        out[i] = m_shared[0] + math.log(s_shared[0])


a = rng.standard_normal((5, 13)) * 30.0  # 13 components: not a multiple of the 8 threads
out = np.empty(5)
row_logsumexp[a.shape[0], THREADS](a, out)  # grid of 5 blocks, 8 threads each
err = np.max(np.abs(out - logsumexp(a, axis=1)))
print(f"block-per-row log-sum-exp against scipy: max abs error {err:.1e}")
assert err < 1e-12

# %% [markdown]
# `gpu.numba_cuda.responsibilities` is this kernel grown up: each thread
# first computes its components' logits
# $l_k = \log\pi_k - \tfrac12\sum_j (x_j-\mu_{kj})^2/\sigma^2_{kj} - \tfrac12\sum_j\log 2\pi\sigma^2_{kj}$
# from the differences themselves (a GPU has arithmetic to spare; lesson 1's
# cancellation never happens), writes them to the output, combines the
# pairs, then rescales its own entries: one pass over the row, no
# $N\times K\times d$ array. It must agree with `refimpl` where lesson 1
# showed the naive formula failing: $|x| \sim 10^4$ and variances near $10^{-8}$.
#
# Every check in this lesson compares two computations of one quantity that
# add in different orders, and allows a small multiple of the rounding that
# this causes. Why these tolerances: `docs/floating_point.md`, section
# Lesson 9.

# %%
N, K, d = 6, 5, 3
x = rng.standard_normal((N, d)) * 1e4
means = x[:K] + rng.standard_normal((K, d)) * 1e-4  # components right at some points
variances = np.full((K, d), 1e-8)
weights = np.full(K, 1.0 / K)
gamma_gpu = nc.responsibilities(x, means, variances, weights)
gamma_ref = gmm.responsibilities(x, means, variances, weights)
err = np.max(np.abs(gamma_gpu - gamma_ref))
print(f"responsibilities at |x| ~ 1e4, sigma^2 = 1e-8: max abs difference to refimpl {err:.1e}")
assert err < 1e-12
log_gpu = nc.log_responsibilities(x, means, variances, weights)
log_ref = gmm.log_responsibilities(x, means, variances, weights)
# entries near -1e16 (points 1e4 away at sigma^2 = 1e-8) carry a rounding unit of about 1: compare relatively
log_err = np.max(np.abs(log_gpu - log_ref) / np.maximum(1.0, np.abs(log_ref)))
print(f"log-responsibilities (down to {log_ref.min():.1e}): max relative difference {log_err:.1e}")
assert log_err < 1e-13

# %% [markdown]
# ### The same loop as a CPU kernel
#
# On a CPU the work divides the other way round. A core has few threads but
# wide vector registers, so `cpu.gmm` (Numba's `@njit` with `prange`) gives
# each thread whole rows, in groups of four that share every load of
# $\mu_{kj}$ and $1/\sigma^2_{kj}$, and runs the components in the innermost
# loop, contiguous in memory, where the compiler turns four (float64) or
# eight (float32) of them into one vector instruction. The formula is the
# same: a sum of squares of differences, which never cancels. Where the GPU
# kernel needs a tree of pairs to combine its threads' maxima, the CPU
# thread owns its row and keeps one running maximum: one fixed order either
# way, so both give the same bits on every run.

# %%
import inspect

from cpu import gmm as cpu_gmm

print(inspect.getsource(cpu_gmm.quadratic_forms.py_func).split('"""')[-1].strip())
gamma_cpu = cpu_gmm.responsibilities(x, means, variances, weights)
err_cpu = np.max(np.abs(gamma_cpu - gamma_ref))
print(f"the CPU kernel at |x| ~ 1e4, sigma^2 = 1e-8: max abs difference to refimpl {err_cpu:.1e}")
assert err_cpu < 1e-12 and np.max(np.abs(gamma_cpu - gamma_gpu)) < 1e-12

# %% [markdown]
# ## 2. Shared-memory tiling
#
# GMA's write $\Gamma_K^\top\mathbf V$ and read $\Gamma_Q\tilde V$ are matrix
# products. In the naive kernel, the thread for entry $(i, j)$ of $Y = EF$
# ($E$ of shape $M\times n$, $F$ of shape $n\times P$)
# reads row $i$ of $E$ and column $j$ of $F$ from global memory: $2n$ reads
# for $n$ multiply-adds, and the $M\times P$ threads read $2MPn$ numbers in
# all. With tiles, a block of $W\times W$ threads first copies a $W\times W$
# tile of $E$ and one of $F$ into shared memory (one number per thread),
# waits, and then every thread reads the $W$ pairs it needs from there. Each
# global number is now read once per tile instead of once per thread: $2MPn/W$
# reads. The additions happen in the same order, so the result is identical.

# %%
W = 4  # tile width (16 threads per block); 16 or 32 on a real GPU


@cuda.jit
def tiled_matmul(e, f, y):
    # y[i, j] = sum_k e[i, k] f[k, j]: block (bi, bj) owns a W x W tile of y, thread (ty, tx) one entry
    e_tile = cuda.shared.array((W, W), dtype=e.dtype)  # [W, W] rows of e, columns k0..k0+W
    f_tile = cuda.shared.array((W, W), dtype=e.dtype)  # [W, W] rows k0..k0+W of f
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    i = cuda.blockIdx.y * W + ty
    j = cuda.blockIdx.x * W + tx
    acc = 0.0
    for k0 in range(0, e.shape[1], W):
        # each thread loads one entry of each tile (zero outside the matrices)
        e_tile[ty, tx] = e[i, k0 + tx] if i < e.shape[0] and k0 + tx < e.shape[1] else 0.0
        f_tile[ty, tx] = f[k0 + ty, j] if k0 + ty < f.shape[0] and j < f.shape[1] else 0.0
        cuda.syncthreads()  # the tiles are complete
        for kk in range(W):
            acc += e_tile[ty, kk] * f_tile[kk, tx]
        cuda.syncthreads()  # everyone is done with the tiles before they are overwritten
    if i < y.shape[0] and j < y.shape[1]:
        y[i, j] = acc


M, n, P = 7, 10, 6  # none a multiple of W
E, F = rng.standard_normal((M, n)), rng.standard_normal((n, P))
Y = np.zeros((M, P))
tiled_matmul[((P + W - 1) // W, (M + W - 1) // W), (W, W)](E, F, Y)
err = np.max(np.abs(Y - E @ F))
print(f"tiled product against NumPy: max abs error {err:.1e}")
assert err < 1e-13


def global_reads(M, n, P, W=None):
    """Numbers read from global memory: one row and one column per entry, or two W x W tiles per block and step."""
    if W is None:
        return 2 * M * P * n
    blocks, steps = -(-M // W) * -(-P // W), -(-n // W)
    return blocks * steps * 2 * W * W


for shape in ((M, n, P), (64, 64, 64)):
    ratio = global_reads(*shape) / global_reads(*shape, W=W)
    print(f"M, n, P = {shape}: {ratio:.2f}x fewer reads from global memory with {W} x {W} tiles")
assert global_reads(64, 64, 64) == W * global_reads(64, 64, 64, W=W)  # exactly W when the tiles fit

# %% [markdown]
# ## 3. The online softmax
#
# Dense attention $O = \operatorname{softmax}(\beta\,\mathbf Q\mathbf K^\top)\mathbf V$
# (scale $\beta = 1/\sqrt d$) forms an $N\times N$ matrix. A tiled kernel (flash attention) instead visits the keys
# tile by tile and keeps, for each query row, three running quantities after
# the tiles seen so far, $\mathcal S$:
#
# $$m = \max_{j\in\mathcal S} s_j,\qquad \ell = \sum_{j\in\mathcal S} e^{s_j - m},\qquad y = \sum_{j\in\mathcal S} e^{s_j - m}\,v_j .$$
#
# A new tile $\mathcal T$ with maximum $\tilde m$ updates them by
#
# $$m' = \max(m, \tilde m),\qquad \ell' = e^{m - m'}\ell + \sum_{j\in\mathcal T} e^{s_j - m'},\qquad
#   y' = e^{m - m'}y + \sum_{j\in\mathcal T} e^{s_j - m'}v_j .$$
#
# **Claim: after the last tile, $y/\ell$ is exactly the softmax read-out.**
# *Proof.* By induction on the tiles: if the three invariants hold for
# $\mathcal S$, then $e^{m - m'}e^{s_j - m} = e^{s_j - m'}$ for every
# $j\in\mathcal S$, so $e^{m-m'}\ell = \sum_{j\in\mathcal S}e^{s_j-m'}$ and
# $\ell' = \sum_{j\in\mathcal S\cup\mathcal T} e^{s_j - m'}$; the same for
# $y'$; and $m'$ is the maximum over $\mathcal S\cup\mathcal T$. (Before the
# first tile $m = -\infty$, $\ell = 0$, $y = 0$, and $e^{-\infty} = 0$.) At
# the end, $\mathcal S$ is every key and
# $y/\ell = \sum_j e^{s_j-m}v_j / \sum_j e^{s_j-m} = \sum_j \operatorname{softmax}(s)_j v_j$,
# since the common factor $e^{-m}$ cancels. $\square$
#
# Every exponent is $\le 0$, so nothing overflows, and $\ell \ge 1$. The only
# difference from the two-pass softmax is rounding: the rescaling factors
# $e^{m-m'}$ are extra multiplications.

# %%
def online_softmax_readout(s, v, tile):
    """The three running quantities of one query row, updated tile by tile."""
    m, ell, acc = -np.inf, 0.0, np.zeros(v.shape[1])
    for a0 in range(0, s.size, tile):
        st, vt = s[a0 : a0 + tile], v[a0 : a0 + tile]
        m_new = max(m, st.max())
        scale = np.exp(m - m_new)  # e^(m - m'), 0 before the first tile
        p = np.exp(st - m_new)
        ell = scale * ell + p.sum()
        acc = scale * acc + p @ vt
        m = m_new
    return acc / ell


s = rng.standard_normal(50) * 40.0  # large scores: the running maximum changes often
v = rng.standard_normal((50, 3))
p = np.exp(s - s.max())
exact = (p / p.sum()) @ v
for tile in (1, 7, 50):
    err = np.max(np.abs(online_softmax_readout(s, v, tile) - exact))
    print(f"tile of {tile:2d} keys: max abs difference to the two-pass softmax {err:.1e}")
    assert err < 1e-14

# %% [markdown]
# `gpu.numba_cuda.softmax_attention` runs this per query row: a block owns a
# tile of query rows, stages each tile of keys and values in shared memory,
# and keeps $(m, \ell, y)$ per row. When causal, it skips the key tiles that
# lie entirely above the diagonal and masks the diagonal tile.

# %%
Nq, dh = (12, 5)
q, k, v = (rng.standard_normal((2, Nq, dh)) for _ in range(3))  # a batch of two sequences
for causal in (False, True):
    got = nc.softmax_attention(q, k, v, causal=causal)
    ref = attention.softmax_attention(q, k, v, causal=causal)
    err = np.max(np.abs(got - ref))
    print(f"online-softmax kernel, causal={causal}: max abs difference to refimpl {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# ## 4. The chunked scan as a GPU algorithm
#
# Lesson 3 computed causal GMA by a scan over chunks of $C$ tokens, carrying
# $[S, z] = \sum_{j<\text{chunk}}\gamma^K_j[v_j^\top, 1]$ from chunk to chunk. On a
# GPU, a loop over chunks would leave almost every thread idle. The scan
# becomes three parallel steps:
#
# 1. **chunk states**, all chunks at once: $P_c = \Gamma_{K,c}^\top [\mathbf V_c, \mathbf 1]$
#    ($K\times(d_v+1)$ per chunk);
# 2. **an exclusive prefix over the chunks**, $S_c = \sum_{c' < c} P_{c'}$: one
#    thread per entry of the $K\times(d_v+1)$ state walks the chunks in order;
# 3. **within each chunk**, in parallel:
#    $O_c = \Gamma_{Q,c}S_c + \operatorname{tril}(\Gamma_{Q,c}\Gamma_{K,c}^\top)[\mathbf V_c, \mathbf 1]$,
#    the last column being the denominator.
#
# The states take $\lceil N/C\rceil\cdot K\cdot(d_v+1)$ numbers, $C$ times
# fewer than the $N\times K\times d_v$ prefix sums of lesson 3. Here are the
# three steps in NumPy, checked against `refimpl`, then the kernels.

# %%
N, K, d_r, d_v, C = 13, 3, 3, 2, 4
x_q, x_k = rng.standard_normal((N, d_r)), rng.standard_normal((N, d_r))
vals = rng.standard_normal((N, d_v))
mu, var, w = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
g_q, g_k = gmm.responsibilities(x_q, mu, var, w), gmm.responsibilities(x_k, mu, var, w)
v1 = np.hstack([vals, np.ones((N, 1))])  # [V, 1]
starts = range(0, N, C)
# step 1: every chunk's state at once
P = np.stack([g_k[a : a + C].T @ v1[a : a + C] for a in starts])  # [chunks, K, d_v + 1]
# step 2: exclusive prefix over the chunks
S = np.cumsum(P, axis=0) - P
# step 3: every chunk at once
num = np.vstack([g_q[a : a + C] @ S[c] + np.tril(g_q[a : a + C] @ g_k[a : a + C].T) @ v1[a : a + C] for c, a in enumerate(starts)])
three_steps = num[:, :-1] / (num[:, -1:] + 1e-6)
ref = gma.gma(x_q, x_k, vals, mu, var, w, causal=True, chunk_size=C)
err = np.max(np.abs(three_steps - ref))
print(f"three parallel steps against refimpl's sequential scan: max abs difference {err:.1e}")
assert err < 1e-13
print(f"memory of the states: {P.size} numbers, against {N * K * d_v} for N x K x d_v prefix sums")

got = nc.gma(x_q, x_k, vals, mu, var, w, causal=True, chunk_size=C)
err_gpu = np.max(np.abs(got - ref))
print(f"gpu.numba_cuda.gma (causal) against refimpl: max abs difference {err_gpu:.1e}")
assert err_gpu < 1e-12

# %% [markdown]
# ## 5. Why no float atomics
#
# The backward of GMA sums over all tokens ($\partial L/\partial\mu$ is a sum of
# $N$ terms). The quick way on a GPU is for every thread to add its term into
# one memory cell with `cuda.atomic.add`. The additions then happen in
# whatever order the hardware schedules the threads, and that order changes
# from run to run. Floating-point addition is not associative, so the bits of
# the sum change too:

# %%
terms = (rng.standard_normal(512) * np.exp(rng.uniform(-8, 8, 512))).astype(np.float32)
sequential = set()
for _ in range(50):
    acc = np.float32(0)
    for t in terms[rng.permutation(terms.size)]:
        acc = np.float32(acc + t)  # one addition at a time, as atomics would do, in a random order
    sequential.add(acc)
print(f"512 float32 terms added one by one in 50 random orders: {len(sequential)} different sums")
assert len(sequential) > 1

# %% [markdown]
# An **ordered reduction** fixes the order instead: each block sums its own
# segment of tokens by a tree whose shape depends only on the thread indices
# (as in section 1), writes one partial result per block, and a second step
# adds the partial results in block order. The result then depends only on
# the data, never on the scheduling. Every reduction in `gpu.numba_cuda` is
# done this way, so two runs give the same bits:

# %%
raw = rng.standard_normal((K, d_r))
logits = rng.standard_normal(K)
g_out = rng.standard_normal((N, d_v))
runs = []
for _ in range(2):
    out, cache = nc.gma_forward(x_q, x_k, vals, mu, raw, logits, causal=True, chunk_size=C)
    runs.append(nc.gma_backward(g_out, cache))
identical = all(np.array_equal(a, b) for a, b in zip(*runs))
print(f"two runs of the GMA backward give identical bits: {identical}")
assert identical
ref_grads = gma.gma_backward(g_out, gma.gma_forward(x_q, x_k, vals, mu, raw, logits, causal=True, chunk_size=C)[1])
worst = max(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300) for a, b in zip(runs[0], ref_grads))
print(f"and agree with refimpl's hand-derived gradients: max relative difference {worst:.1e}")
assert worst < 1e-10

# %% [markdown]
# ## 6. The same GMA through cuBLAS and fused kernels
#
# `gpu.numba_cuda` writes every step as a kernel, to be read. `gpu.cupy_kernels`
# is the fast path: everything shaped like a matrix product goes to cuBLAS
# (`cupy.matmul`), and only what cuBLAS cannot do is a custom kernel. For the
# bidirectional GMA forward of one sequence:
#
# | step | how | work |
# | --- | --- | --- |
# | quadratic form of $\Gamma_Q$ and $\Gamma_K$ | one GEMM each, $[x_c^2, x_c]\,[-p/2;\ \mu_c p]$ | $2\cdot 2N\cdot 2d_r\cdot K$ flops |
# | log-sum-exp and normalise | one fused row kernel (`gmm.cu`) | reads and writes $N\times K$ twice |
# | write $\Gamma_K^\top[\mathbf V, \mathbf 1]$ | GEMM | $2NK(d_v+1)$ flops |
# | read $\Gamma_Q[S, z]$, divide | GEMM, element-wise | $2NK(d_v+1)$ flops |
#
# The GEMMs run at the tensor cores' rate; the fused kernels move $N\times K$
# numbers at memory speed. The host code is written once for an array module
# `xp`, NumPy or CuPy, so its logic runs here with NumPy, and must equal the
# reference:

# %%
cupy_gma = importlib.import_module("gpu.cupy_kernels.gma")  # the module (the package's attribute gma is the function)
N, K, d_r, d_v = 40, 4, 3, 2
xq6, xk6, v6 = rng.standard_normal((N, d_r)), rng.standard_normal((N, d_r)), rng.standard_normal((N, d_v))
mu6, var6, w6 = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
for causal in (False, True):
    host = cupy_gma.gma_xp(np, xq6, xk6, v6, mu6, var6, w6, causal, 1e-6, 8)  # xp = numpy
    err = np.max(np.abs(host - gma.gma(xq6, xk6, v6, mu6, var6, w6, causal=causal, chunk_size=8)))
    print(f"gpu.cupy_kernels' host code with xp = numpy, causal={causal}: max abs difference to refimpl {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# On a GPU, the cell below times where the forward's time goes: the GEMMs
# alone against the whole `gma_forward` (the rest is the fused kernels and
# the launches).

# %%
cupy_ok, cupy_why = gpu.backend_status()["cupy"]
if cupy_ok:
    import cupy

    N, K, d_r, d_v = 1 << 16, 64, 64, 64
    cq = cupy.asarray(rng.standard_normal((N, d_r)), dtype=cupy.float32)
    ck = cupy.asarray(rng.standard_normal((N, d_r)), dtype=cupy.float32)
    cv = cupy.asarray(rng.standard_normal((N, d_v)), dtype=cupy.float32)
    cmu = cupy.asarray(rng.standard_normal((K, d_r)), dtype=cupy.float32)
    craw, clog = cupy.zeros((K, d_r), cupy.float32), cupy.zeros(K, cupy.float32)
    w_cat = cupy.asarray(rng.standard_normal((2 * d_r, K)), dtype=cupy.float32)
    g_any = cupy.asarray(rng.random((N, K)), dtype=cupy.float32)
    s_any = cupy.zeros((K, d_v + 1), cupy.float32)
    v1 = cupy.concatenate([cv, cupy.ones((N, 1), cupy.float32)], axis=1)
    x_cat = cupy.concatenate([cq, cq], axis=1)

    def cupy_time(fn, reps=10):
        fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / reps

    t_gemm = cupy_time(lambda: (x_cat @ w_cat, x_cat @ w_cat, g_any.T @ v1, g_any @ s_any))
    t_full = cupy_time(lambda: cupy_gma.gma_forward(cq, ck, cv, cmu, craw, clog))
    print(f"N = {N}, K = {K}, float32: GEMMs alone {t_gemm:.3f} ms, gma_forward {t_full:.3f} ms, ratio {t_full / t_gemm:.2f}")
else:
    print(f"No GPU for CuPy here ({cupy_why}).\nOn a GPU this cell times the GEMMs of the forward alone against the "
          "whole gpu.cupy_kernels.gma_forward; benchmarks/bench_gpu.py does it at full size.")

# %% [markdown]
# ## 7. Speed
#
# On a GPU, the cell below times GMA (bidirectional and causal) against the
# NumPy reference at a size where a GPU has work to do;
# `benchmarks/bench_gpu.py` measures the full-size targets (bandwidth, GEMM
# ratios, OVQ against dense attention). The simulator runs every thread as a
# Python thread, so its timings say nothing about a GPU, and none are shown.

# %%
if ON_GPU:
    Ns = [1 << 12, 1 << 14, 1 << 16]
    K, d_r, d_v = 64, 32, 32
    mu, var, w = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
    rows = []
    for N in Ns:
        xs = [rng.standard_normal((N, d)).astype(np.float32) for d in (d_r, d_r, d_v)]
        dev = [cuda.to_device(a) for a in xs]
        params = [cuda.to_device(a.astype(np.float32)) for a in (mu, var, w)]
        for causal in (False, True):
            nc.gma(*dev, *params, causal=causal)  # compile and warm up
            cuda.synchronize()
            t0 = time.perf_counter()
            nc.gma(*dev, *params, causal=causal)
            cuda.synchronize()
            t_gpu = time.perf_counter() - t0
            t0 = time.perf_counter()
            gma.gma(*xs, mu.astype(np.float32), var.astype(np.float32), w.astype(np.float32), causal=causal)
            t_cpu = time.perf_counter() - t0
            rows.append((N, causal, t_gpu, t_cpu))
            print(f"N = {N:6d}, causal={causal!s:5}: GPU {t_gpu * 1e3:8.2f} ms, NumPy {t_cpu * 1e3:8.2f} ms, {t_cpu / t_gpu:6.1f}x")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for causal in (False, True):
        sel = [r for r in rows if r[1] == causal]
        ax.loglog([r[0] for r in sel], [r[3] / r[2] for r in sel], "o-", label=f"causal={causal}")
    ax.set_xlabel("N")
    ax.set_ylabel("NumPy time / GPU time")
    ax.legend()
    plt.show()
else:
    print(
        "No CUDA GPU here: every kernel above ran in the CUDA simulator, which checks that they are right\n"
        "but measures nothing about GPU speed. On a machine with a GPU, this cell times them, and\n"
        "benchmarks/bench_gpu.py measures bandwidth, GEMM ratios and OVQ against dense attention."
    )

# %% [markdown]
# ## What to remember
#
# * A kernel is the body of a loop, run by one thread per iteration; blocks
#   of threads cooperate through shared memory and `syncthreads`.
# * Reductions inside a block go through a tree in shared memory;
#   log-sum-exp pairs $(m, s)$ combine exactly.
# * Tiling reads each number from global memory once per tile instead of
#   once per thread.
# * The online softmax is exact up to rounding: the rescaling by
#   $e^{m-m'}$ keeps every partial sum relative to the current maximum.
# * A sequential scan becomes chunk states, a prefix over chunks, and a
#   masked product per chunk.
# * Fix the order of every floating-point reduction, and a GPU gives the
#   same bits on every run.
# * For speed, give the matrix products to cuBLAS and fuse only the rest;
#   host code written once for NumPy and CuPy is tested without a GPU.

# %% [markdown]
# ## Exercises
#
# Four exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell below it; until you answer, the check
# prints that the exercise is not done yet, and a wrong answer stops with a
# message that says what is wrong. The kernel exercises are answered by a
# host function that launches your kernel: write the kernel in the same
# cell, above the function. Without a GPU they run in the CUDA simulator, so
# the checks use tiny sizes; its rules are a GPU's, plus two of its own: one
# `cuda.shared.array` per source line, and no warp shuffles. Worked
# solutions are in `tutorials/solutions/lesson_09.py`; try first.

# %%
from _course import check  # noqa: E402  (the exercises need it only here)

# %% [markdown]
# ### Exercise 9.1 ★ Combine two log-sum-exp pairs
#
# Write `lse_combine(m1, s1, m2, s2)`, returning the pair $(M, S)$ of the
# union of two sets of numbers from their pairs $(m, s)$ of section 1
# ($m$ the maximum, $s = \sum e^{x - m}$). The empty set has the pair
# $(-\infty, 0)$, and the union of two empty sets must be $(-\infty, 0)$
# again: the formula of section 1 alone gives nan there. The check splits
# vectors of size up to 40 into pieces (some empty), folds your function
# over the pieces left to right and as a tree, and compares
# $M + \log S$ with SciPy's `logsumexp`.

# %%
def lse_combine(m1, s1, m2, s2):
    """The pair (M, S) of the union: M = max(m1, m2), S = s1 exp(m1 - M) + s2 exp(m2 - M); floats."""
    raise NotImplementedError("exercise 9.1")


# %%
check("9.1", lse_combine)

# %% [markdown]
# ### Exercise 9.2 ★★ A row-softmax kernel
#
# Write `row_softmax(a)`: the softmax of every row of a float64 array `a` of
# shape $(N, K)$ (logits to responsibilities), as an array of the same shape,
# computed by a kernel that
# you write above it and launch as `kernel[N, THREADS](a, out)`: one block
# per row, thread $t$ owning the entries $t, t + T, \dots$ as in section 1.
# The block needs the row's maximum $M$ and then $S = \sum_k e^{a_{ik} - M}$:
# two tree reductions in shared memory (one array can serve both, if every
# thread has read the first result before the second tree overwrites it).
# The check uses entries up to about $10^3$, where `exp` alone
# overflows, rows longer and shorter than `THREADS`, and one entry
# $-\infty$ (a component of weight 0), whose probability must be exactly 0.
# Watch out: section 1's one-pass kernel computes $e^{-\infty - (-\infty)}$
# for a thread whose first entry is $-\infty$.

# %%
def row_softmax(a):
    """The softmax of each row of a (N, K), computed by a kernel with one block per row; shape (N, K)."""
    raise NotImplementedError("exercise 9.2")


# %%
check("9.2", row_softmax)

# %% [markdown]
# ### Exercise 9.3 ★★ The chunk states of the causal scan
#
# Write `chunk_states(gamma_k, v, C)` for steps 1 and 2 of section 4:
# `gamma_k` is $\Gamma_K$ ($N\times K$), `v` is $\mathbf V$ ($N\times d_v$),
# and the result is $S$ of shape $(\lceil N/C\rceil, K, d_v + 1)$ with
# $S_c = \sum_{j < cC}\gamma^K_j[v_j^\top, 1]$, the state *before* chunk $c$.
# Use two kernels: one block per chunk with one thread per entry $(k, e)$
# of its state (a block of shape `(K, d_v + 1)`, `cuda.threadIdx.x` and
# `.y`) summing its chunk's tokens in order, then one thread per entry
# walking the chunks for the exclusive prefix. The check compares each
# $S_c$ with the sum over the tokens before chunk $c$, and the output of
# step 3 built from your states with `refimpl.gma.gma(causal=True)`.

# %%
def chunk_states(gamma_k, v, C):
    """The exclusive prefix of the chunk states, S[c] = sum_{j < c C} gamma_k[j]^T [v_j, 1]; shape (ceil(N/C), K, d_v + 1)."""
    raise NotImplementedError("exercise 9.3")


# %%
check("9.3", chunk_states)

# %% [markdown]
# ### Exercise 9.4 ★★★ A tiled online-softmax attention kernel
#
# Write `online_attention(q, k, v, causal)`: softmax attention of one
# sequence, $o_i = \sum_j \operatorname{softmax}_j(\beta\,q_i\cdot k_j)\,v_j$
# with $\beta = 1/\sqrt d$ (and $j \le i$ when `causal`), shape
# $(N, d_v)$, by a kernel in which a block of `TILE` threads owns `TILE`
# query rows, one thread each. The block loads the keys and values a tile of
# `TILE` rows at a time into shared memory (each thread loads one row), and
# each thread updates its running $(m, \ell, y)$ of section 3 with the
# tile's keys. Hints: shared and local arrays need shapes fixed before the
# kernel is compiled (choose a bound such as `D_MAX = 8` for $d$ and $d_v$);
# a thread whose query row is past $N$ must still load its key and reach
# every `cuda.syncthreads()`; $\ell$ is at least 1 at the end. The check
# uses $N = 10$, not a multiple of a tile of 4, scores large enough that the
# maximum changes from tile to tile, and compares with
# `refimpl.attention.softmax_attention`.

# %%
def online_attention(q, k, v, causal):
    """Softmax attention of one sequence, scale 1/sqrt(d), by a tiled online-softmax kernel; shape (N, d_v)."""
    raise NotImplementedError("exercise 9.4")


# %%
check("9.4", online_attention)
