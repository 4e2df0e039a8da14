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
# - count the reads from global memory of a matrix product, explain why
#   shared-memory tiling divides them by the tile width, and why a register
#   tile of $r\times c$ quadratic forms needs only $(r+c)/(rc)$ shared-memory
#   loads per multiply-add;
# - prove that the online softmax is exact, entirely masked tiles included,
#   and implement it as a tiled (flash) kernel;
# - turn the chunked causal scan into parallel steps, the prefix over the
#   chunks a log-depth scan, and check them against the sequential scan;
# - explain why float atomics make results change from run to run, what an
#   ordered reduction fixes and what it does not, and choose a launch
#   geometry within the hardware's limits.
#
# **Before this lesson**: lessons 1, 2, 3 and 4 (the responsibilities and
# the cancellation of their expanded quadratic form, GMA, its chunked causal
# scan, and its gradients, which section 5 computes on the GPU). From
# outside the course: floating-point arithmetic (rounding, why addition is
# not associative) and matrix products. No experience of GPUs is needed.
#
# Notation follows `docs/glossary.md`.
#
# Lessons 1 to 8 computed everything with NumPy. This lesson writes the same
# mathematics as CUDA kernels in Python with Numba, the way `gpu.numba_cuda`
# does: no deep-learning framework, one thread at a time. Each kernel of
# `gpu.numba_cuda` mirrors one loop body of a `refimpl` core, and its tests
# compare the two. Where a design needs sizes that the simulator cannot run
# (tiles of $64\times 64$, thousands of blocks), the lesson shows it in
# NumPy, with the same loops.
#
# **The claims of this lesson.**
#
# 1. The responsibilities kernel combines partial log-sum-exps by a tree in
#    shared memory, and agrees with `refimpl`, extreme inputs included.
# 2. Shared-memory tiling cuts the reads from global memory of a matrix
#    product by the tile width, without changing a single addition; a
#    register tile of $r\times c$ quadratic forms needs $(r+c)\,d$ loads for
#    $r c\,d$ multiply-adds. At three instructions a term (the quadratic
#    form) a $4\times 4$ tile lets the arithmetic, not shared memory, set the
#    speed; a plain product (one FMA a term) with 4-byte shared loads stays
#    bound by shared memory at about half the FMA peak until $8\times 8$.
# 3. The online softmax (a running maximum, sum and accumulator, rescaled at
#    each tile) gives the exact softmax, provided an entirely masked tile is
#    guarded: we prove it, then check it, and build flash attention from it.
# 4. Causal GMA's chunked scan becomes parallel steps on a GPU: all chunk
#    states at once, a prefix over the $n$ chunks, the masked product inside
#    each chunk. The prefix walked chunk by chunk takes $n - 1$ dependent
#    steps; Blelloch's scan takes $2\lceil\log_2 n\rceil$ steps and $O(n)$ work, in a
#    combination order fixed by $n$ alone. It never holds an
#    $N\times K\times d_v$ array.
# 5. Float atomics would make results depend on the order in which threads
#    are scheduled, because floating-point addition is not associative; an
#    ordered reduction makes every run with the same launch configuration,
#    device, compiler and library versions give the same bits, and no more.
# 6. The same GMA through cuBLAS plus a few fused kernels (`gpu.cupy_kernels`):
#    the matrix products are most of the arithmetic, but they are skinny:
#    float32 without TF32 runs them on the CUDA cores, and their arithmetic
#    intensity lies near or below the H200's ridge point, so memory
#    bandwidth or the CUDA cores' rate bounds them, never a tensor-core rate.
# 7. The launch geometry is one pure function of the shapes, within the
#    hardware's limits: sequences on grid y break from $B\cdot H = 65{,}536$.
# 8. Speed, measured when a GPU is present; without one, the kernels run in
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
# *blocks* (up to 1024 threads) that share fast on-chip memory and wait for
# each other (`cuda.syncthreads()`). `cuda.threadIdx.x` and `cuda.blockIdx.x`
# say which thread is running. Blocks are scheduled independently, in no
# order a program can rely on, so a kernel that asks no more of them is right
# on any GPU; every kernel of this lesson is written so. It is not all a GPU
# allows: on compute capability 9.0 (H100, H200) the blocks of a
# *thread-block cluster* (up to 8, or 16 where a kernel opts in) read and
# write each other's shared memory (*distributed shared memory*) and wait at
# a cluster barrier (CUDA C++ Programming Guide, "Thread Block Clusters" and
# "Distributed Shared Memory"); and the blocks of one grid can signal each
# other through global memory, with a fence and an atomic, as
# `gpu.numba_cuda.ovq` does for VQ: the last block of a head to finish its
# share of a chunk takes a ticket and merges the partial results of all of
# them. A *cooperative* launch goes further: the GPU holds all its blocks at
# once, so they may wait for each other at a grid-wide barrier
# (`cuda.cg.this_grid().sync()`), and OVQ's whole chunk loop is one such
# launch, a barrier after each step of each chunk (the second cell below
# finds both in the source).
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
# every run with the same block size gives the same bits (section 5). The empty pair is
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

# %%
import inspect  # noqa: E402

# blocks of one grid that signal each other: a fence, then an atomic ticket (the last block merges)
ovq_source = inspect.getsource(importlib.import_module("gpu.numba_cuda.ovq"))
assert "cuda.threadfence()" in ovq_source and "cuda.atomic.add(ticket" in ovq_source
print(next(line.strip() for line in ovq_source.splitlines() if "cuda.atomic.add(ticket" in line))
# and the blocks of a cooperative launch, which wait for each other at a grid-wide barrier
assert "cuda.cg.this_grid().sync()" in ovq_source
print(next(line.strip() for line in ovq_source.splitlines() if line.strip().startswith("cuda.cg.this_grid().sync()")))

# %% [markdown]
# ### The plain kernel first
#
# Before the tuned kernel, the plainest one: `gpu.numba_cuda.plain` gives
# every output element a thread of its own, in the style of Numba-CUDA's
# documentation examples (`cuda.grid`, a bounds test, a loop). Thread
# $(i, k)$ of `log_joint` computes the logit
# $l_{ik} = \log\pi_k - \tfrac12\sum_j \log 2\pi\sigma^2_{kj} - \tfrac12\sum_j (x_{ij}-\mu_{kj})^2/\sigma^2_{kj}$
# from the differences themselves (every term $\ge 0$: lesson 1's
# cancellation never happens); thread $(i, k)$ of `row_softmax` then reads
# its whole row of logits for the maximum and the sum. Nothing is shared
# between threads, so nothing can go wrong between them; when a tuned kernel
# fails on a GPU, `python -m gpu check` asks these for a second opinion.
# Here they are, checked against `refimpl`:

# %%
from gpu.numba_cuda import plain  # noqa: E402

for kern in (plain.log_joint, plain.row_softmax):
    print(inspect.getsource(getattr(kern, "py_func", None) or kern.fn).split("\n", 1)[1])
rng_p = np.random.default_rng(90)  # a generator of its own: the draws of the cells below stay as they were
x_p = rng_p.standard_normal((7, 3))
mu_p, var_p, w_p = rng_p.standard_normal((4, 3)), 0.5 + rng_p.random((4, 3)), np.full(4, 0.25)
err = np.max(np.abs(plain.responsibilities(x_p, mu_p, var_p, w_p) - gmm.responsibilities(x_p, mu_p, var_p, w_p)))
print(f"plain kernels, a thread per (row, component): max abs difference to refimpl {err:.1e}")
assert err < 1e-14

# %% [markdown]
# ### What the tuned kernel changes
#
# `gpu.numba_cuda.responsibilities` computes the same logits from the same
# differences, but no thread rereads a row: it writes the logits to the
# output, combines the pairs $(m, s)$ of each row by the tree above, then
# rescales the row's entries: one pass, no $N\times K\times d$ array. Section
# 2 shows its mapping (a block per tile of rows and components, a register
# tile per thread, the coordinates staged in shared memory). The differences
# cost three instructions a term (a subtraction, a product, a fused
# multiply-add) where lesson 1's expanded form costs one FMA, and on a GPU
# that is not free: the tuned kernel is *issue-bound*, its instructions take
# several times its memory time (the end of section 2 counts it), a price it
# pays for exactness. It must agree with `refimpl` where lesson 1 showed the
# naive formula failing: $|x| \sim 10^4$ and variances near $10^{-8}$.
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
# each thread whole rows, in groups of eight that share every load of
# $\mu_{kj}$ and $1/\sigma^2_{kj}$, and runs the components in the innermost
# loop, contiguous in memory, where the compiler turns four (float64) or
# eight (float32) of them into one vector instruction. The formula is the
# same: a sum of squares of differences, which never cancels. Where the GPU
# kernel needs a tree of pairs to combine its threads' maxima, the CPU
# thread owns its row and keeps eight running maxima, one per vector lane,
# combined pairwise at the end (`cpu._lanes`; the exponentials are
# `cpu.vexp.exp`, written so that the loop vectorises too): one fixed order
# either way, so each gives the same bits on every run of the same build
# (section 5 says what may change them).

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
# GMA's write $\Gamma_K^\top[\mathbf V, \mathbf 1]$ and read
# $\Gamma_Q[S, z]$ are such products, tiled this way, with one more level
# below the shared-memory tile: registers.
#
# ### Register tiles: a tile of quadratic forms per thread
#
# Shared memory is fast, not free. Per clock, one streaming multiprocessor
# (SM) of an H200 performs 128 float32 multiply-adds (FMAs) but reads only 32
# four-byte words from shared memory (32 banks of one word each; NVIDIA's
# Hopper figures). The tiled product above loads two words per FMA: shared
# memory then feeds 16 FMAs a clock, an eighth of what the SM can do. The
# cure is to make each number loaded into a register serve several FMAs.
#
# The responsibilities kernel is built that way. A block owns a tile of
# rows $\times$ components of $\Gamma$ (say $64\times 64$ on a GPU). It stages
# the tile's rows of $x$, its means $\mu_{kj}$ and its half-precisions
# $h_{kj} = 1/(2\sigma^2_{kj})$ in shared memory, and each thread owns an
# $r\times c$ **register tile** of half quadratic forms
# $\tfrac12 q_{ik} = \sum_j (x_{ij}-\mu_{kj})^2 h_{kj}$, from the
# differences, as in section 1. At coordinate $j$ the thread loads its $r$
# numbers $x_{ij}$ and its $c$ pairs $(\mu_{kj}, h_{kj})$ (one 8-byte load
# each) into registers, $r + c$ loads, and updates its $rc$ accumulators:
# $rc$ terms, each a subtraction, a multiplication and one FMA. Over the $d$
# coordinates:
#
# $$(r + c)\,d \text{ loads for } r c\,d \text{ FMAs}:\qquad \text{arithmetic intensity } \frac{rc}{r+c} \text{ FMAs per load},$$
#
# or $(r + 2c)\,d$ words in float32. A $1\times 1$ tile (one quadratic form
# per thread) does half an FMA per load; a $4\times 4$ tile, two; an
# $8\times 8$ tile, four, holding $64$ accumulators and $r + 2c = 24$
# operands in registers (of the 255 a thread may have).
#
# **The row softmax, fused online in the epilogue.** When the block's tile
# of logits $l_{ik} = \log\pi_k - \tfrac12\sum_j\log 2\pi\sigma^2_{kj} - \tfrac12 q_{ik}$
# is complete, each row's pair $(m, s)$ of section 1 absorbs it, one tile of
# components after the other (the online log-sum-exp, with the guard of
# section 3 for a tile of $-\infty$); the logits go to the output, and a
# last sweep over the row writes $\gamma_{ik} = e^{l_{ik} - m}/s$. Neither
# the $N\times K\times d$ differences nor a second read of $x$ is needed.
#
# Below: this design in NumPy, one register tile at a time, counting its
# loads and FMAs, at the extreme inputs of section 1; then the numbers for
# an H200.

# %%
def register_tile(x_rows, mu_cols, h_cols):
    """One thread's r x c half quadratic forms sum_j (x_ij - mu_kj)^2 h_kj, with its loads and FMAs counted."""
    acc = np.zeros((x_rows.shape[0], mu_cols.shape[0]))  # [r, c] accumulators, in registers
    loads = fmas = 0
    for j in range(x_rows.shape[1]):
        xr, mr, hr = x_rows[:, j], mu_cols[:, j], h_cols[:, j]  # r numbers and c pairs (mu, h): r + c loads
        loads += xr.size + mr.size
        diff = xr[:, None] - mr[None, :]
        acc += diff * diff * hr[None, :]  # r c terms: a subtraction, a multiplication, one FMA each
        fmas += diff.size
    return acc, loads, fmas


def tiled_responsibilities(x, means, variances, weights, r, c, block_rows, block_comps):
    """gamma (N, K) by blocks of block_rows x block_comps and r x c register tiles; the row softmax online, tile by tile."""
    N, d = x.shape
    K = means.shape[0]
    half_prec = 0.5 / variances  # h = 1 / (2 sigma^2), in shared memory with the means
    const = np.log(weights) - 0.5 * (d * np.log(2 * np.pi) + np.log(variances).sum(axis=1))
    out = np.empty((N, K))
    loads = fmas = 0
    for i0 in range(0, N, block_rows):
        rows = slice(i0, min(i0 + block_rows, N))
        m = np.full(rows.stop - i0, -np.inf)  # each row's pair (m, s), across the tiles of components
        s = np.zeros(rows.stop - i0)
        for k0 in range(0, K, block_comps):
            comps = slice(k0, min(k0 + block_comps, K))
            for a in range(i0, rows.stop, r):  # the block's threads, one register tile each
                for b in range(k0, comps.stop, c):
                    ra, cb = slice(a, min(a + r, rows.stop)), slice(b, min(b + c, comps.stop))
                    half, n_loads, n_fmas = register_tile(x[ra], means[cb], half_prec[cb])
                    loads, fmas = loads + n_loads, fmas + n_fmas
                    out[ra, cb] = const[cb] - half  # l = log pi - (1/2) sum log 2 pi sigma^2 - q / 2
            # epilogue: (m, s) absorbs the tile of logits, rescaled when the maximum grows (guarded: -inf stays empty)
            tile = out[rows, comps]
            m_new = np.maximum(m, tile.max(axis=1))
            ref_m = np.where(m_new > -np.inf, m_new, 0.0)
            s = s * np.exp(m - ref_m) + np.exp(tile - ref_m[:, None]).sum(axis=1)
            m = m_new
        out[rows] = np.exp(out[rows] - m[:, None]) / s[:, None]  # the last sweep: gamma = e^(l - m) / s
    return out, loads, fmas


N, K, d = 8, 12, 3
x_t = rng.standard_normal((N, d)) * 1e4
mu_t = x_t[rng.integers(0, N, K)] + rng.standard_normal((K, d)) * 1e-4  # components right at some points
var_t, w_t = np.full((K, d), 1e-8), np.full(K, 1.0 / K)
gamma_ref = gmm.responsibilities(x_t, mu_t, var_t, w_t)
for r, c in ((1, 1), (2, 2), (4, 4)):
    gamma_t, loads, fmas = tiled_responsibilities(x_t, mu_t, var_t, w_t, r, c, block_rows=4, block_comps=8)
    err = np.max(np.abs(gamma_t - gamma_ref))
    print(f"{r} x {c} register tiles: {loads:4d} loads for {fmas} FMAs ({fmas / loads:.2f} per load), "
          f"max abs difference to refimpl {err:.1e}")
    assert err < 1e-12
    assert fmas == N * K * d and loads == N * K * d * (r + c) // (r * c)  # (r + c) d loads per r c d FMAs

# %%
# one H200 SM per clock (NVIDIA's Hopper figures, not measured here): 128 float32 FMA lanes, 32 words of shared memory
FP32_LANES, SHARED_WORDS = 128, 32
INSTRUCTIONS_PER_TERM = 3  # x - mu, times h, then one FMA into the accumulator


def shared_memory_ceiling(r, c, words_per_term=None, instructions_per_term=INSTRUCTIONS_PER_TERM):
    """The fraction of the SM's float32 instruction rate that shared memory can feed, for r x c register tiles.

    By default the quadratic form's (float32): r numbers x_ij and c pairs (mu_kj, h_kj) per r c terms of 3
    instructions; a plain product passes words_per_term = (r + c) / (r c) and 1 instruction a term (one FMA).
    """
    words = (r + 2 * c) / (r * c) if words_per_term is None else words_per_term
    return min(1.0, SHARED_WORDS / words * instructions_per_term / FP32_LANES)


def product_ceiling(r, c):
    """The same for a plain product's r x c tile: r + c four-byte loads for r c FMAs, one instruction a term."""
    return shared_memory_ceiling(r, c, words_per_term=(r + c) / (r * c), instructions_per_term=1)


print("tile   FMAs/load  quadratic form (3 instr./term)  plain product (1 FMA/term)")
for r, c in ((1, 1), (2, 2), (4, 4), (8, 4), (8, 8)):
    print(f"{r} x {c}  {r * c / (r + c):9.2f}  {shared_memory_ceiling(r, c):30.0%}  {product_ceiling(r, c):25.0%}")
assert shared_memory_ceiling(1, 1) == 0.25  # one quadratic form per thread: shared memory caps it at a quarter
assert shared_memory_ceiling(4, 4) == 1.0  # from 4 x 4 on, the quadratic form's arithmetic sets the speed
assert product_ceiling(4, 4) == 0.5  # a plain product at 4 x 4: shared memory holds it to half the FMA peak
assert product_ceiling(8, 8) == 1.0  # 8 x 8 tiles (or fewer, wider loads per term) lift it

# %% [markdown]
# So "from $4\times 4$ on, the arithmetic sets the speed" holds for the
# quadratic form only because each term costs three instructions. A product
# whose terms are single FMAs (GMA's write and read, the scores of
# attention) needs twice the operands per instruction: with 4-byte shared
# loads and $4\times 4$ tiles it is bound by shared memory at about half the
# FMA peak, and needs $8\times 8$ tiles, or fewer loads per term, to leave it.
#
# And the quadratic form's three instructions a term are what the tuned
# responsibilities kernel spends its time on. At $N = 2^{20}$, $K = 256$,
# $d = 64$ (the size `benchmarks/bench_gpu.py` measures) its $4NKd$ useful
# FLOPs take 1.03 ms at the H200's float32 peak, its $4N(d + K)$ bytes 0.28
# ms at its peak bandwidth; its work loop issues about 0.85 instructions per
# useful FLOP (`tests/test_gpu_resources.py` reads it from the compiled
# code), and a multiprocessor issues at most four warp instructions a cycle.
# The kernel is issue-bound, far from memory-bound:

# %%
N_b, K_b, d_b = 1 << 20, 256, 64
flops_b, bytes_b = 4 * N_b * K_b * d_b, 4 * N_b * (d_b + K_b)
issue_s = flops_b * 0.85 / 32 / (132 * 4 * 1.7e9)  # warp instructions over 132 SMs x 4 schedulers at 1.7 GHz
memory_s = bytes_b / 4.8e12
print(f"issue time {issue_s * 1e3:.2f} ms, memory time {memory_s * 1e3:.2f} ms: {issue_s / memory_s:.1f}x "
      f"(FLOPs at the float32 peak alone: {flops_b / 67e12 * 1e3:.2f} ms)")
assert issue_s > 5 * memory_s and flops_b / 67e12 > 3 * memory_s  # no arithmetic to spare: it sets the time

# %% [markdown]
# ## 3. The online softmax
#
# Dense attention $O = \operatorname{softmax}(\beta\,\mathbf Q\mathbf K^\top)\mathbf V$
# (scale $\beta = 1/\sqrt d$) forms an $N\times N$ matrix. A tiled kernel (flash attention) instead visits the keys
# tile by tile and keeps, for each query row, three running quantities after
# the tiles seen so far, $\mathcal S$. A score may be $-\infty$: a masked key
# (the causal mask, a padding mask, a log-weight $\log 0$), whose softmax
# weight is 0. With $\mathcal S^*$ the keys of $\mathcal S$ whose score is
# finite,
#
# $$m = \max_{j\in\mathcal S} s_j,\qquad \ell = \sum_{j\in\mathcal S^*} e^{s_j - m},\qquad y = \sum_{j\in\mathcal S^*} e^{s_j - m}\,v_j ,$$
#
# and $m = -\infty$, $\ell = 0$, $y = 0$ while $\mathcal S^*$ is empty.
# A new tile $\mathcal T$ with maximum $\tilde m$ updates them by
#
# $$m' = \max(m, \tilde m),\qquad \ell' = e^{m - m'}\ell + \sum_{j\in\mathcal T} e^{s_j - m'},\qquad
#   y' = e^{m - m'}y + \sum_{j\in\mathcal T} e^{s_j - m'}v_j ,$$
#
# **guarded**: when $m' = -\infty$ (the tile is entirely masked, and so was
# everything before it), the tile is skipped and the state stays
# $(-\infty, 0, 0)$.
#
# **Claim: after the last tile, if at least one score is finite, $y/\ell$ is
# exactly the softmax read-out.**
# *Proof.* By induction on the tiles. Before the first tile the invariants
# hold ($\mathcal S^*$ is empty). Suppose they hold for $\mathcal S$.
# *Case $m' = -\infty$*: every score of $\mathcal S\cup\mathcal T$ is
# $-\infty$, $(\mathcal S\cup\mathcal T)^*$ is empty, and the skipped tile
# leaves the state of an empty set: the invariants hold. (Without the guard,
# $e^{m - m'} = e^{-\infty-(-\infty)}$ is nan in IEEE arithmetic, and the nan
# stays in $\ell$ and $y$ for good.)
# *Case $m' > -\infty$*: $m'$ is finite, so every exponent is defined; a
# masked key adds $e^{-\infty} = 0$, and if $m = -\infty$ then
# $e^{m - m'} = 0$ multiplies $\ell = 0$, $y = 0$. For every
# $j\in\mathcal S^*$, $e^{m - m'}e^{s_j - m} = e^{s_j - m'}$, so
# $e^{m-m'}\ell = \sum_{j\in\mathcal S^*}e^{s_j-m'}$ and
# $\ell' = \sum_{j\in(\mathcal S\cup\mathcal T)^*} e^{s_j - m'}$; the same for
# $y'$; and $m'$ is the maximum over $\mathcal S\cup\mathcal T$. At the end,
# $\mathcal S$ is every key, $m$ is finite by assumption, and
# $y/\ell = \sum_j e^{s_j-m}v_j / \sum_j e^{s_j-m} = \sum_j \operatorname{softmax}(s)_j v_j$,
# since the common factor $e^{-m}$ cancels. $\square$
#
# Every exponent is $\le 0$, so nothing overflows, and $\ell \ge 1$ once a
# finite score has been seen (the maximum contributes $e^0$); if every
# score is $-\infty$, the softmax is undefined and $\ell = 0$ says so. The
# only difference from the two-pass softmax is rounding: the rescaling
# factors $e^{m-m'}$ are extra multiplications.

# %%
def online_softmax_readout(s, v, tile, guard=True):
    """The three running quantities of one query row, updated tile by tile; a score -inf is a masked key."""
    m, ell, acc = -np.inf, 0.0, np.zeros(v.shape[1])
    for a0 in range(0, s.size, tile):
        st, vt = s[a0 : a0 + tile], v[a0 : a0 + tile]
        m_new = max(m, st.max())
        if guard and m_new == -np.inf:
            continue  # every score so far is masked: the state stays (-inf, 0, 0), never -inf - (-inf) = nan
        scale = np.exp(m - m_new)  # e^(m - m'), 0 before the first unmasked tile
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

# an entirely masked leading tile: scores [-inf, -inf, 1, 2] in tiles of 2
s_masked, v_masked = np.array([-np.inf, -np.inf, 1.0, 2.0]), rng.standard_normal((4, 3))
p = np.exp(s_masked - 2.0)
exact = (p / p.sum()) @ v_masked  # the masked keys get weight exactly 0
with np.errstate(invalid="ignore"):  # -inf - (-inf): numpy's "invalid value" warning, the nan itself is the point
    unguarded = online_softmax_readout(s_masked, v_masked, 2, guard=False)
guarded = online_softmax_readout(s_masked, v_masked, 2)
print(f"masked leading tile: without the guard {unguarded}, with it max abs difference "
      f"{np.max(np.abs(guarded - exact)):.1e}")
assert np.isnan(unguarded).all() and np.max(np.abs(guarded - exact)) < 1e-14

# %% [markdown]
# ### Flash attention: a resident query tile, streamed key tiles, guarded masks
#
# A flash-attention kernel gives each block a tile of $B_q$ query rows,
# loads it once, and keeps it resident (in shared memory and registers)
# while it streams the keys and values a tile of $B_k$ rows at a time:
# the $B_q\times B_k$ scores $\beta\,Q_tK_t^\top$ (a tiled product, as in
# section 2), the online update of each row's $(m, \ell, y)$, the next tile.
# No $N\times N$ array exists anywhere; the keys and values are read from
# global memory once per query tile, $\lceil N/B_q\rceil$ times in all,
# which is why a GPU wants big tiles: at least $64\times 64$ (4,096 scores
# a block, in registers), where the simulator runs tiles of 8. When causal,
# the key tiles entirely above the diagonal are skipped (with $T$ tiles of
# equal size, $T(T+1)/2$ of the $T^2$ are visited) and the diagonal tile is
# masked.
#
# The guard works row by row: in a tile where a row has seen only $-\infty$,
# the kernel subtracts 0 instead of $m' = -\infty$, so that
# $e^{s_j - 0} = e^{-\infty} = 0$ and $e^{m - 0} = 0$: the row stays
# $(-\infty, 0, 0)$. The causal mask alone never triggers it when the keys
# are visited in order (key 0 is in every row's first tile), but a padding
# mask, a window, or a log-weight $\log 0$ added to the scores does. Below,
# the design in NumPy: against `refimpl`, and with the first tile of keys
# masked for every row.

# %%
def flash_attention(q, k, v, causal=False, bias=None, Bq=4, Bk=4, guard=True):
    """o_i = sum_j softmax_j(beta q_i.k_j + bias_j) v_j, a resident query tile at a time; (out (N, d_v), key tiles visited)."""
    beta = 1.0 / math.sqrt(q.shape[1])
    out = np.empty((q.shape[0], v.shape[1]))
    visited = 0
    for i0 in range(0, q.shape[0], Bq):
        rows = np.arange(i0, min(i0 + Bq, q.shape[0]))
        q_tile = q[rows]  # loaded once, resident for the whole loop over key tiles
        m, ell, y = np.full(rows.size, -np.inf), np.zeros(rows.size), np.zeros((rows.size, v.shape[1]))
        for j0 in range(0, k.shape[0], Bk):
            if causal and j0 > rows[-1]:
                break  # this tile and all later ones lie above the diagonal
            cols = np.arange(j0, min(j0 + Bk, k.shape[0]))
            visited += 1
            s = beta * (q_tile @ k[cols].T)  # [Bq, Bk] scores
            if bias is not None:
                s = s + bias[cols]
            if causal:
                s = np.where(cols[None, :] <= rows[:, None], s, -np.inf)  # the diagonal tile's mask
            m_new = np.maximum(m, s.max(axis=1))
            # the guard: rows that have seen only -inf subtract 0, not -inf, and stay (-inf, 0, 0)
            ref_m = np.where(m_new > -np.inf, m_new, 0.0) if guard else m_new
            scale = np.exp(m - ref_m)
            p = np.exp(s - ref_m[:, None])
            ell = scale * ell + p.sum(axis=1)
            y = scale[:, None] * y + p @ v[cols]
            m = m_new
        out[rows] = y / ell[:, None]
    return out, visited


Nf, df = 11, 4  # 3 tiles of 4: not a multiple
q, k, v = (rng.standard_normal((Nf, df)) * 3.0 for _ in range(3))
for causal in (False, True):
    got, visited = flash_attention(q, k, v, causal)
    err = np.max(np.abs(got - attention.softmax_attention(q, k, v, causal=causal)))
    print(f"flash tiles of 4 x 4, causal={causal}: {visited} key tiles visited, max abs difference to refimpl {err:.1e}")
    assert err < 1e-13
    assert visited == (3 * 4 // 2 if causal else 3 * 3)  # T (T + 1) / 2 of the T^2 tiles when causal

bias = np.zeros(Nf)
bias[:4] = -np.inf  # the first tile of keys masked for every row
scores = q @ k.T / math.sqrt(df) + bias
p = np.exp(scores - scores.max(axis=1, keepdims=True))
dense = (p / p.sum(axis=1, keepdims=True)) @ v
got, _ = flash_attention(q, k, v, bias=bias)
with np.errstate(invalid="ignore"):
    unguarded, _ = flash_attention(q, k, v, bias=bias, guard=False)
err = np.max(np.abs(got - dense))
print(f"first key tile masked: guarded max abs difference to the dense softmax {err:.1e}; "
      f"unguarded rows that are nan: {np.isnan(unguarded).any(axis=1).sum()} of {Nf}")
assert err < 1e-13 and np.isnan(unguarded).all()

# %% [markdown]
# The plain kernel first: `gpu.numba_cuda.plain.attention` gives output
# entry $(i, e)$ a thread that walks the row's keys three times (the
# maximum, then the two sums), recomputing every score, with nothing shared.
# What the tuned `gpu.numba_cuda.softmax_attention` changes is this design:
# a block owns a tile of query rows, stages each tile of keys and values in
# shared memory once for all its threads, and keeps $(m, \ell, y)$ per row,
# one pass over the keys. When causal, it skips the key tiles that lie
# entirely above the diagonal and masks the diagonal tile.

# %%
Nq, dh = (12, 5)
q, k, v = (rng.standard_normal((2, Nq, dh)) for _ in range(3))  # a batch of two sequences
for causal in (False, True):
    ref = attention.softmax_attention(q, k, v, causal=causal)
    err_plain = np.max(np.abs(plain.softmax_attention(q, k, v, causal=causal) - ref))
    got = nc.softmax_attention(q, k, v, causal=causal)
    err = np.max(np.abs(got - ref))
    print(f"causal={causal}: plain kernel {err_plain:.1e}, online-softmax kernel {err:.1e} (max abs difference to refimpl)")
    assert err_plain < 1e-12
    assert err < 1e-12

# %% [markdown]
# ## 4. The chunked scan as a GPU algorithm
#
# Lesson 3 computed causal GMA by a scan over chunks of $C$ tokens, carrying
# $[S, z] = \sum_{j<\text{chunk}}\gamma^K_j[v_j^\top, 1]$ from chunk to chunk. On a
# GPU, a loop over chunks would leave almost every thread idle. The scan
# becomes three steps, over $n = \lceil N/C\rceil$ chunks:
#
# 1. **chunk states**, all chunks at once: $P_c = \Gamma_{K,c}^\top [\mathbf V_c, \mathbf 1]$
#    ($K\times(d_v+1)$ per chunk), a tiled product per chunk;
# 2. **an exclusive prefix over the chunks**, $S_c = \sum_{c' < c} P_{c'}$;
# 3. **within each chunk**, in parallel:
#    $O_c = \Gamma_{Q,c}S_c + \operatorname{tril}(\Gamma_{Q,c}\Gamma_{K,c}^\top)[\mathbf V_c, \mathbf 1]$,
#    the last column being the denominator.
#
# Steps 1 and 3 are parallel over the chunks. Step 2 is not, if written the
# obvious way: one thread per entry of the $K\times(d_v+1)$ state walking
# the chunks in order (exercise 9.3) makes $n - 1$ additions, each waiting
# for the one before: a chain of depth $n - 1$, with only $K(d_v+1)$ threads
# at work. What bounds it is not the additions (about 4 cycles each) but
# memory: every step reads its chunk's state from global memory, several
# hundred cycles away (Luo et al., "Benchmarking and Dissecting the Nvidia
# Hopper GPU Architecture", 2024, measure global-memory latencies of that
# order), and $K(d_v+1)$ threads keep far too few loads in flight to hide
# that latency or to use the bandwidth (the last cell of the log-depth scan
# below estimates both). It becomes a log-depth parallel scan, below.
#
# The states take $n\cdot K\cdot(d_v+1)$ numbers, against the
# $N\times K\times d_v$ prefix sums of lesson 3: when $C$ divides $N$, a ratio of
#
# $$\frac{N K d_v}{(N/C)\,K\,(d_v + 1)} = \frac{C\,d_v}{d_v + 1},$$
#
# not $C$: each state carries the denominator's column as well. Here are the
# three steps in NumPy, step 2 as the walk over the chunks, checked against
# `refimpl`.

# %%
from fractions import Fraction

N, K, d_r, d_v, C = 13, 3, 3, 2, 4
x_q, x_k = rng.standard_normal((N, d_r)), rng.standard_normal((N, d_r))
vals = rng.standard_normal((N, d_v))
mu, var, w = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
g_q, g_k = gmm.responsibilities(x_q, mu, var, w), gmm.responsibilities(x_k, mu, var, w)
v1 = np.hstack([vals, np.ones((N, 1))])  # [V, 1]
starts = range(0, N, C)
# step 1: every chunk's state at once
P = np.stack([g_k[a : a + C].T @ v1[a : a + C] for a in starts])  # [chunks, K, d_v + 1]


def sequential_scan(P):
    """The exclusive prefix S_c = sum_{c' < c} P_c', one chunk after the other: n - 1 dependent additions."""
    S = np.zeros_like(P)
    for c in range(1, P.shape[0]):
        S[c] = S[c - 1] + P[c - 1]
    return S


def chunk_outputs(S):
    """Step 3, every chunk at once: Gamma_Q,c S_c plus the masked within-chunk product, then the division."""
    num = np.vstack([g_q[a : a + C] @ S[c] + np.tril(g_q[a : a + C] @ g_k[a : a + C].T) @ v1[a : a + C]
                     for c, a in enumerate(starts)])
    return num[:, :-1] / (num[:, -1:] + 1e-6)


# step 2: exclusive prefix over the chunks; step 3
three_steps = chunk_outputs(sequential_scan(P))
ref = gma.gma(x_q, x_k, vals, mu, var, w, causal=True, chunk_size=C)
err = np.max(np.abs(three_steps - ref))
print(f"the three steps against refimpl's sequential scan: max abs difference {err:.1e}")
assert err < 1e-13


def state_ratio(N, K, d_v, C):
    """The N x K x d_v prefix sums over the ceil(N / C) x K x (d_v + 1) chunk states, as an exact fraction."""
    return Fraction(N * K * d_v, -(-N // C) * K * (d_v + 1))


assert P.size == -(-N // C) * K * (d_v + 1)
print(f"memory of the states: {P.size} numbers, against {N * K * d_v} for N x K x d_v prefix sums "
      f"({float(state_ratio(N, K, d_v, C)):.2f}x fewer; C = {C})")
for shape in ((16, K, d_v, C), (65536, 64, 64, 64)):
    ratio = state_ratio(*shape)
    print(f"N, K, d_v, C = {shape}: {float(ratio):.2f}x fewer numbers")
    assert ratio == Fraction(shape[3] * shape[2], shape[2] + 1)  # C d_v / (d_v + 1), not C

# %% [markdown]
# ### Step 2 as a log-depth scan
#
# Blelloch's scan computes the exclusive prefix of $n$ states (padded with
# zeros to $n' = 2^{\lceil\log_2 n\rceil}$) in two sweeps over a balanced
# binary tree:
#
# - **up-sweep**, $\log_2 n'$ steps: at step $l$, every pair
#   $(i - 2^l, i)$ with $i + 1$ a multiple of $2^{l+1}$ does
#   $a_i \leftarrow a_{i-2^l} + a_i$, so that $a_i$ holds the sum of its
#   subtree;
# - **down-sweep**, $\log_2 n'$ steps: set the root $a_{n'-1} = 0$; then, from
#   the top, every pair does $(a_{i-2^l}, a_i) \leftarrow (a_i,\ a_{i-2^l} + a_i)$:
#   the left child receives the prefix before its subtree, the right child
#   that prefix plus the left subtree.
#
# The pairs of one step are disjoint, so they run in parallel (one thread
# per pair and state entry); only the steps wait for each other. **Depth**
# $2\log_2 n' = 2\lceil\log_2 n\rceil$ steps instead of $n - 1$; **work** $2(n' - 1)$ state
# additions instead of $n - 1$, still $O(n)$. And the tree is fixed by $n$
# alone: which partial sums are added to which does not depend on the data
# or on how the threads are scheduled, so the bits are those of one fixed
# association (a different one from the sequential walk's: the two agree to
# rounding, not bit for bit).
#
# The single-pass alternative, a **decoupled look-back** scan, has each
# block publish its chunk's aggregate and then look back at its
# predecessors until it finds one that has published its inclusive prefix.
# It reads the states once, but the sum it forms depends on how far back it
# had to look, that is, on timing: for floats it keeps the same bits only if
# it is made to combine in a fixed order.

# %%
def blelloch_schedule(n):
    """(n', up, down): Blelloch's steps over n states padded to n' = 2^ceil(log2 n), each a list of pairs (left, right)."""
    size = 1 << max(0, (n - 1).bit_length())
    up, down, h = [], [], 1
    while h < size:
        up.append([(i - h, i) for i in range(2 * h - 1, size, 2 * h)])
        h *= 2
    h = size // 2
    while h >= 1:
        down.append([(i - h, i) for i in range(2 * h - 1, size, 2 * h)])
        h //= 2
    return size, up, down


def blelloch_scan(P, thread_order=None):
    """The exclusive prefix of P[0..n-1] by Blelloch's scan; (S, steps, additions).

    thread_order, optional, a Generator: the pairs of every step run in a random order, as threads may.
    """
    n = P.shape[0]
    size, up, down = blelloch_schedule(n)
    a = np.zeros((size,) + P.shape[1:], dtype=P.dtype)
    a[:n] = P
    additions = 0

    def shuffled(pairs):
        return pairs if thread_order is None else [pairs[i] for i in thread_order.permutation(len(pairs))]

    for pairs in up:
        for left, right in shuffled(pairs):  # a_right = sum of its subtree
            a[right] = a[left] + a[right]
            additions += 1
    a[size - 1] = 0
    for pairs in down:
        for left, right in shuffled(pairs):  # (left, right) <- (prefix before the subtree, prefix + left subtree)
            a[left], a[right] = a[right].copy(), a[left] + a[right]
            additions += 1
    return a[:n], len(up) + len(down), additions


S_tree, steps, additions = blelloch_scan(P)
err = np.max(np.abs(S_tree - sequential_scan(P)))
err_out = np.max(np.abs(chunk_outputs(S_tree) - ref))
print(f"Blelloch over {P.shape[0]} chunk states: {steps} steps, {additions} additions; "
      f"max abs difference to the walk {err:.1e}, of the output to refimpl {err_out:.1e}")
assert err < 1e-13 and err_out < 1e-13

# 37 float32 states (padded to 64): depth, work, and one combination order whatever the thread schedule
P32 = (rng.standard_normal((37, K, d_v + 1)) * 100.0).astype(np.float32)
S32, steps, additions = blelloch_scan(P32)
assert steps == 2 * math.ceil(math.log2(37)) == 12 and additions == 2 * (64 - 1)  # 2 ceil(log2 n) steps, 2 (n' - 1) additions
schedules = [blelloch_scan(P32, thread_order=np.random.default_rng(seed))[0] for seed in range(5)]
same_bits = all(np.array_equal(S, S32) for S in schedules)
walk = sequential_scan(P32)
n = P32.shape[0]
print(f"{n} float32 states: {steps} steps and {additions} additions (the walk: {n - 1} and {n - 1}); five random "
      f"thread orders give the same bits: {same_bits}; entries that differ from the walk's bits: {np.mean(S32 != walk):.0%}, "
      f"by at most {np.max(np.abs(S32 - walk) / np.maximum(np.abs(walk), 1)):.1e} relative")
assert same_bits

for n in (37, 1024, 16384):  # 37 chunks, then N = 65,536 and 1,048,576 tokens in chunks of 64
    size, up, down = blelloch_schedule(n)
    print(f"{n:5d} chunks: the walk {n - 1:5d} dependent steps; Blelloch {len(up) + len(down)} steps, "
          f"{2 * (size - 1)} additions")
    assert len(up) + len(down) == 2 * math.ceil(math.log2(n))  # 2 ceil(log2 n): 12 for 37 states, not 2 log2 37 = 10.4

# What bounds the walk on an H200 (an estimate, not a measurement): K (d_v + 1) = 64 x 65 threads, each adding one
# state entry per step. The adds take about 4 cycles each; the state of every step comes from global memory.
CLOCK, ADD_CYCLES, LATENCY_CYCLES = 1.7e9, 4, 500  # global-memory latency: the order microbenchmarks measure
walk_threads = 64 * 65
for n in (1024, 16384):
    add_chain = (n - 1) * ADD_CYCLES / CLOCK
    waiting = (n - 1) * LATENCY_CYCLES / CLOCK  # each step's load waited for in turn
    # loads issued ahead instead: HBM needs bandwidth x latency bytes in flight, one 4-byte load a thread gives far fewer
    in_flight = min(1.0, walk_threads * 4 / (4.8e12 * LATENCY_CYCLES / CLOCK))
    streaming = n * walk_threads * 4 / (4.8e12 * in_flight)
    print(f"{n:5d} chunks: additions alone {add_chain * 1e6:7.1f} us; each load waited for {waiting * 1e6:7.1f} us; "
          f"loads in flight cover {in_flight:.1%} of the bandwidth: {streaming * 1e6:7.1f} us")
    assert min(waiting, streaming) > 50 * add_chain  # memory latency and too little parallelism, not the add chain

# %% [markdown]
# The plain kernel, `gpu.numba_cuda.plain.causal_scan`, has none of the
# three steps: thread $(t, e)$ walks the keys $j \le t$ and sums
# $(\gamma^Q_t\cdot\gamma^K_j)\,[v_j, 1]_e$, the token recurrence read at every
# $t$ at once ($O(N^2 K)$ work, no chunk). `gpu.numba_cuda.gma` runs the three
# steps as kernels on the device. Both must agree with the same reference:

# %%
err_plain = np.max(np.abs(plain.gma(x_q, x_k, vals, mu, var, w, causal=True, chunk_size=C) - ref))
print(f"gpu.numba_cuda.plain.gma (causal) against refimpl: max abs difference {err_plain:.1e}")
assert err_plain < 1e-12
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
# the data and the launch configuration, never on the scheduling. Every
# reduction in `gpu.numba_cuda` is done this way, so two runs give the same
# bits:

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
# **What "the same bits" promises, and what it does not.** The tree's shape
# is fixed by the block size, the number of blocks and the tiles: the
# *launch configuration*. Change it and the association changes, and with
# it the bits (by rounding only). So the promise holds for one launch
# configuration, on one device, built by one compiler (which may contract a
# multiplication and an addition into an FMA, or not) with the same library
# versions (cuBLAS chooses its GEMM algorithm per GPU and version). The
# simulator's block sizes are smaller than a GPU's (`gpu.numba_cuda`'s are
# module constants, smaller in the simulator; section 7), so the simulator
# and a GPU agree to rounding, not bit for bit. The same float32 terms as
# above, summed by the tree of section 1 (threads strided over the terms,
# then the pairs of a shared-memory tree) with three block sizes:

# %%
def block_tree_sum(terms, threads):
    """One block's ordered sum: thread t adds terms t, t + T, ... in order, then a tree over the T partial sums."""
    partial = np.zeros(threads, dtype=terms.dtype)
    for t in range(threads):
        for value in terms[t::threads]:
            partial[t] = partial[t] + value
    h = threads // 2
    while h > 0:
        partial[:h] = partial[:h] + partial[h : 2 * h]  # thread t < h adds thread t + h's partial sum
        h //= 2
    return partial[0]


sums = {T: block_tree_sum(terms, T) for T in (8, 32, 256)}
print("block size -> float32 sum: " + ", ".join(f"{T}: {float(s):.9g}" for T, s in sums.items()))
assert all(block_tree_sum(terms, T) == s for T, s in sums.items())  # each configuration: the same bits every run
assert len(set(sums.values())) > 1  # another block size: another association, other bits

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
# | quadratic form of $\Gamma_Q$ and $\Gamma_K$ | one GEMM each, $[x_c^2, x_c]\,[-p/2;\ \mu_c p]$, on $x$ and $\mu$ centred on the mean of the means | $2\cdot 2N\cdot 2d_r\cdot K$ flops |
# | log-sum-exp, normalise, screen | one fused row kernel (`gmm.cu`), which also evaluates the $O(d)$ cancellation screen of `refimpl.tuned` on each row | reads and writes $N\times K$ twice |
# | refine | only for the rows the screen cannot clear: their spoiled logits near the row maximum recomputed from the differences, then the scan again | rare; none for most inputs |
# | write $\Gamma_K^\top[\mathbf V, \mathbf 1]$ | GEMM | $2NK(d_v+1)$ flops |
# | read $\Gamma_Q[S, z]$, divide | GEMM, element-wise | $2NK(d_v+1)$ flops |
#
# The screen and the refinement are there because the $[x_c^2, x_c]$ GEMM is
# the expanded quadratic form of lesson 1, which cancels: where a point lies
# far from the means on the scale of $\sigma$ (the inputs of section 1),
# the product loses the logit's digits, and a GEMM alone would return wrong
# responsibilities. The screen finds the rows where that can matter, in
# $O(Nd)$, and only those are recomputed.
#
# **How fast can the GEMMs go?** Not at a tensor-core rate. In float32 with
# TF32 off (`gpu.cupy_kernels.tf32(False)`, the default) cuBLAS runs them on
# the CUDA cores, whose peak on an H200 is about 67 TFLOP/s. And they are
# skinny: one side is $N$, the others $K$, $2d_r$, $d_v + 1$, a few dozen.
# A product of $(m\times k)$ by $(k\times n)$ does $2mkn$ flops and moves at
# least $4(mk + kn + mn)$ bytes in float32; its arithmetic intensity, flops
# per byte, is to be compared with the H200's ridge point, 67 TFLOP/s over
# 4.8 TB/s, about 14 flops per byte (the vendor's figures, the ones
# `benchmarks/bench_gpu.py` uses). Below the ridge, memory bandwidth bounds
# the time; above it, the arithmetic. The fused kernels move $N\times K$
# numbers for a few flops each: memory-bound, at an intensity near 1.

# %%
PEAK_FP32, PEAK_TF32, PEAK_BANDWIDTH = 67e12, 495e12, 4.8e12  # H200 SXM, vendor figures (TF32: dense tensor cores)
RIDGE_FP32, RIDGE_TF32 = PEAK_FP32 / PEAK_BANDWIDTH, PEAK_TF32 / PEAK_BANDWIDTH


def gemm_intensity(m, k, n, itemsize=4):
    """Flops per byte of an (m x k) (k x n) product that reads each input and writes the output once."""
    return 2 * m * k * n / (itemsize * (m * k + k * n + m * n))


print(f"H200 ridge points: {RIDGE_FP32:.1f} flops/byte on the CUDA cores (float32), {RIDGE_TF32:.0f} with TF32 tensor cores")
for N_, K_, d_, dv_ in ((1 << 16, 64, 32, 32), (1 << 16, 64, 64, 64)):
    gemms = {
        "[x_c^2, x_c] W": gemm_intensity(N_, 2 * d_, K_),
        "Gamma_K^T [V, 1]": gemm_intensity(K_, N_, dv_ + 1),
        "Gamma_Q [S, z]": gemm_intensity(N_, K_, dv_ + 1),
    }
    for name, intensity in gemms.items():
        bound = "memory-bound" if intensity < RIDGE_FP32 else "at most the float32 peak"
        print(f"N = {N_}, K = {K_}, d_r = {d_}, d_v = {dv_}: {name:17s} {intensity:5.1f} flops/byte, {bound}; "
              f"ceiling {min(PEAK_FP32, intensity * PEAK_BANDWIDTH) / 1e12:4.1f} TFLOP/s")
        assert intensity < RIDGE_TF32 / 4  # even with TF32, bandwidth would hold them far below a tensor-core rate
    if d_ == 32:
        assert gemms["Gamma_K^T [V, 1]"] < RIDGE_FP32 and gemms["Gamma_Q [S, z]"] < RIDGE_FP32  # the write and read

# %% [markdown]
# At $K = d_r = d_v = 64$ the GEMMs sit just above the float32 ridge (16 to
# 21 flops per byte); at $d_v = 32$ the write and the read fall below it,
# memory-bound. Either way their ceiling is the CUDA cores' rate or less, a
# seventh of the TF32 tensor cores' peak, which they could not approach even
# with TF32 on: bandwidth would cap them at 52 to 102 TFLOP/s.
#
# The host code is written once for an array module `xp`, NumPy or CuPy, so
# its logic runs here with NumPy (`gpu.cupy_kernels.on_host`: each fused
# kernel by its NumPy twin), and must equal the reference:

# %%
cupy_gma = importlib.import_module("gpu.cupy_kernels.gma")  # the module (the package's attribute gma is the function)
on_host = importlib.import_module("gpu.cupy_kernels").on_host
N, K, d_r, d_v = 40, 4, 3, 2
xq6, xk6, v6 = rng.standard_normal((N, d_r)), rng.standard_normal((N, d_r)), rng.standard_normal((N, d_v))
mu6, var6, w6 = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
for causal in (False, True):
    host = on_host.gma(xq6, xk6, v6, mu6, var6, w6, causal=causal, eps=1e-6, chunk_size=8)
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
# ## 7. Launch geometry, within the hardware's limits
#
# A launch `kernel[grid, block](...)` names a grid of blocks and a block of
# threads, each up to three-dimensional, and the hardware bounds both:
#
# | | limit (compute capability 9.0, H200) |
# | --- | --- |
# | grid x | $2^{31} - 1$ blocks |
# | grid y, grid z | 65,535 blocks each |
# | threads per block | 1,024 (x and y at most 1,024, z at most 64) |
#
# The driver refuses a launch outside them (an invalid configuration), so a
# geometry that works at the sizes of the tests can fail at a caller's. The kernels
# of `gpu.numba_cuda` take their geometry from **one pure function of the
# shapes**: it reads nothing but its arguments (no device query, no state),
# so the same shapes always give the same grid and block, hence the same
# trees and the same bits (section 5), and it can be checked without a
# GPU for every shape a caller may pass. The block sizes are constants of
# the module (of the simulator, when it runs).
#
# A natural choice for attention over $B\cdot H$ sequences puts the query
# tiles on grid x and the sequences on grid y. It is right for every
# $N$, and wrong from $B\cdot H = 65{,}536$ sequences on (for instance
# $B = 2048$ sequences of $H = 32$ heads). Two ways out: spread the
# sequences over grid y and z, with a loop in the kernel for what they still
# cannot hold, or fold the (sequence, tile) pairs into grid x, with grid y
# for what grid x cannot hold, the kernel recovering its pair from the block
# index and returning when it is past the end. Below: the natural choice and
# the fold, as pure functions, checked against the limits, the fold checked
# to visit every pair exactly once.

# %%
MAX_GRID_X, MAX_GRID_YZ, MAX_THREADS = 2**31 - 1, 65_535, 1024


def within_limits(grid, block):
    """Whether a launch's grid (x, y, z) and block (x, y, z) fit compute capability 9.0's limits."""
    return (1 <= grid[0] <= MAX_GRID_X and all(1 <= g <= MAX_GRID_YZ for g in grid[1:])
            and block[0] <= 1024 and block[1] <= 1024 and block[2] <= 64 and math.prod(block) <= MAX_THREADS)


def sequences_on_y(B, H, N, tile_rows, threads):
    """(grid, block): query tiles on grid x, the B H sequences on grid y."""
    return (-(-N // tile_rows), B * H, 1), (threads, 1, 1)


def launch_geometry(B, H, N, tile_rows, threads, max_x=MAX_GRID_X):
    """(grid, block): the B H ceil(N / tile_rows) (sequence, tile) pairs folded into grid x, then y; a pure function."""
    pairs = B * H * -(-N // tile_rows)
    grid_x = min(pairs, max_x)
    return (grid_x, -(-pairs // grid_x), 1), (threads, 1, 1)


def block_pair(block_x, block_y, grid_x, N, tile_rows):
    """What the kernel does first: its (sequence, tile) from the block index (past the end when sequence >= B H)."""
    flat = block_y * grid_x + block_x
    tiles = -(-N // tile_rows)
    return divmod(flat, tiles)  # (sequence b h, tile); the caller checks b h < B H


for B, H in ((8, 32), (2048, 32)):
    naive, folded = sequences_on_y(B, H, 4096, 64, 256), launch_geometry(B, H, 4096, 64, 256)
    print(f"B H = {B * H:6d}: sequences on grid y {naive[0]} fits: {within_limits(*naive)}; "
          f"folded {folded[0]} fits: {within_limits(*folded)}")
    assert within_limits(*folded) and within_limits(*naive) == (B * H <= 65_535)  # grid y holds 65,535 blocks
assert within_limits((1, 1, 1), (32, 32, 1)) and not within_limits((1, 1, 1), (32, 32, 2))  # 1,024 threads a block
assert launch_geometry(2048, 32, 4096, 64, 256) == launch_geometry(2048, 32, 4096, 64, 256)  # shapes in, geometry out

# the fold, with a grid x limited to 7 blocks so that grid y is used: every (sequence, tile) exactly once
B, H, N_seq, tile_rows = 3, 2, 10, 4
(grid_x, grid_y, _), _ = launch_geometry(B, H, N_seq, tile_rows, 32, max_x=7)
seen = [block_pair(bx, by, grid_x, N_seq, tile_rows) for by in range(grid_y) for bx in range(grid_x)]
seen = [pair for pair in seen if pair[0] < B * H]  # the blocks past the end return at once
print(f"grid ({grid_x}, {grid_y}) for {B * H} sequences of {-(-N_seq // tile_rows)} tiles: {len(seen)} pairs")
assert sorted(seen) == [(b, t) for b in range(B * H) for t in range(-(-N_seq // tile_rows))]

# %% [markdown]
# ## 8. Speed
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
#   once per thread; a register tile of $r\times c$ results makes each
#   load from shared memory serve $rc/(r+c)$ FMAs on average: from
#   $4\times 4$ on enough for a quadratic form's three instructions a term,
#   but a plain product (one FMA a term) stays bound by shared memory at about
#   half the FMA peak until $8\times 8$.
# * A GPU has no arithmetic to spare: computing the quadratic form from the
#   differences makes the responsibilities kernel issue-bound, several times
#   its memory time; exactness has that price.
# * Blocks are independent unless a kernel asks for more: thread-block
#   clusters share memory on sm_90, and blocks of one grid can signal
#   through global memory (a fence and an atomic).
# * Read the plain kernel (one thread per output element) first: it is the
#   second opinion when a tuned one fails.
# * The online softmax is exact up to rounding: the rescaling by
#   $e^{m-m'}$ keeps every partial sum relative to the current maximum, and
#   a tile entirely masked so far must be skipped, not rescaled by
#   $e^{-\infty+\infty}$. Flash attention keeps a query tile resident and
#   streams the key tiles through that update.
# * A sequential scan becomes chunk states, a prefix over chunks, and a
#   masked product per chunk; the prefix is a log-depth scan (Blelloch:
#   $2\lceil\log_2 n\rceil$ steps, $O(n)$ work) in a combination order fixed
#   by $n$. Walked chunk by chunk, the prefix is bound by memory latency and
#   the few threads that walk it, not by its additions.
#   The states are $C\,d_v/(d_v+1)$ times smaller than the prefix sums.
# * Fix the order of every floating-point reduction, and a GPU gives the
#   same bits on every run with the same launch configuration, device,
#   compiler and library versions; the simulator, with other block sizes,
#   agrees to rounding.
# * Take the launch geometry from one pure function of the shapes, and keep
#   it within the limits: grid y and z hold 65,535 blocks, not $B\cdot H$.
# * For speed, give the matrix products to cuBLAS and fuse only the rest
#   (the screen of the expanded quadratic form included, with its rare
#   refinement); skinny float32 GEMMs without TF32 run on the CUDA cores,
#   near or below the ridge point. Host code written once for NumPy and
#   CuPy is tested without a GPU.

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
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

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
