r"""Device functions shared by the Numba-CUDA kernels: the online softmax's running pair, block tree reductions.

Every function here is a ``@cuda.jit(device=True)`` function, called from
inside kernels (never launched), with the identity it computes written
above its definition.  Each kernel that needs one of these operations calls
it, so that the guard it carries is written once.

The running (max, sum) pair
---------------------------
A row of scores :math:`s_j` seen so far (keys :math:`S`) is summarised by

.. math::

    m = \max_{j\in S} s_j,\qquad \ell = \sum_{j\in S} e^{s_j - m},

starting from the empty pair :math:`(m, \ell) = (-\infty, 0)`.  Absorbing a
score, or combining two pairs, rescales by :math:`e^{m_{old} - m_{new}}`.
While every score seen is :math:`-\infty` (an entirely masked tile, a row
all :math:`-\infty`), :math:`m_{new} = -\infty` and that factor would be
:math:`e^{-\infty - (-\infty)}`, NaN: :func:`exp_shifted` returns 0 there
instead, so the empty pair stays :math:`(-\infty, 0)` and nothing is
added.  A NaN score is kept in :math:`m` (it compares false both ways), as
``np.max`` keeps it, so that the caller's check of the row maxima sees it.

Block reductions
----------------
:func:`block_sum` reduces ``buf[0:n]`` of a shared array by a tree: step
``h`` adds entry ``t`` and entry ``t + w / 2^h`` (``w`` the power of two at
or above ``n``), always in that order, so the result has the same bits on
every run (no atomics).  Every thread of the block must call it (it
synchronises the block); :func:`row_max` and :func:`row_sum` reduce a row
of a shared array in one thread, in index order.

Scans, straight-line steps and launch limits
--------------------------------------------
:func:`exclusive_scan_columns` is the work-efficient scan of Blelloch
(1990) over the rows of a shared array, one column per thread lane.
:func:`unrolled` (host side) builds a register-tiled product's stage as
straight-line code from its one step, :func:`inliner` the decorator that
makes each piece a device function inlined into the kernel.
:func:`sequence_axes` (host side) spreads a number of sequences over the
grid's ``y`` and ``z`` axes within the hardware's limits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

__all__ = [
    "exp_shifted",
    "softmax_absorb",
    "softmax_combine",
    "max_keep_nan",
    "block_sum",
    "row_max",
    "row_sum",
    "exclusive_scan_columns",
    "inliner",
    "unrolled",
    "sequence_axes",
]



# max(a, b), NaN when either is NaN (as np.max gives).
@cuda.jit(device=True)
def max_keep_nan(a, b):
    return b if (b > a or b != b) else a


# e^{x - m}, and 0 when m = -inf (then x = -inf too: e^{-inf - (-inf)} would be NaN).
@cuda.jit(device=True)
def exp_shifted(x, m):
    if m == -math.inf:
        return math.exp(m)  # e^{-inf} = 0, in the type of m
    return math.exp(x - m)


# (m, l) after one more score s: m' = max(m, s), l' = e^{m - m'} l + e^{s - m'}; NaN is kept in m'.
@cuda.jit(device=True)
def softmax_absorb(m, l, s):
    m_new = max_keep_nan(m, s)
    return m_new, exp_shifted(m, m_new) * l + exp_shifted(s, m_new)


# (m, l) of the union of two sets of scores: m = max(m_a, m_b), l = e^{m_a - m} l_a + e^{m_b - m} l_b.
@cuda.jit(device=True)
def softmax_combine(m_a, l_a, m_b, l_b):
    m = max_keep_nan(m_a, m_b)
    return m, exp_shifted(m_a, m) * l_a + exp_shifted(m_b, m) * l_b


# buf[0] = sum_{t < n} buf[t] by a tree (pairs t, t + w/2, then t, t + w/4, ...); every thread of the block calls it
# with its linear index t; returns the sum to every thread.  buf[0:n] is overwritten.
@cuda.jit(device=True)
def block_sum(buf, n, t):
    w = 1
    while w < n:
        w *= 2
    stride = w // 2
    while stride > 0:
        if t < stride and t + stride < n:
            buf[t] += buf[t + stride]
        cuda.syncthreads()
        stride //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


# max_{t < n} buf[r, t], in the order t = 0, 1, ..., n - 1 (NaN kept): every thread reading row r gets the same bits.
@cuda.jit(device=True)
def row_max(buf, r, n):
    x = buf[r, 0]
    for t in range(1, n):
        x = max_keep_nan(x, buf[r, t])
    return x


# sum_{t < n} buf[r, t], in the order t = 0, 1, ..., n - 1: every thread reading row r gets the same bits.
@cuda.jit(device=True)
def row_sum(buf, r, n):
    x = buf[r, 0]
    for t in range(1, n):
        x += buf[r, t]
    return x


# Exclusive prefix sums down the columns of buf[0:n, :] (n a power of two), column `col` by the n threads lane = 0..n-1
# of the block (Blelloch 1990): the up-sweep leaves in buf[i, col] (i = 2^h (l + 1) - 1) the sum of its 2^h entries,
# the down-sweep replaces each entry by the sum of the entries before it,
#     buf[i, col] <- sum_{i' < i} buf[i', col],
# 2 log2(n) steps of the same pairs on every run; returns the column's total.  Every thread of the block calls it.
@cuda.jit(device=True)
def exclusive_scan_columns(buf, n, lane, col):
    offset = 1
    while offset < n:
        i = (lane + 1) * 2 * offset - 1
        if i < n:
            buf[i, col] += buf[i - offset, col]
        cuda.syncthreads()
        offset *= 2
    total = buf[n - 1, col]
    cuda.syncthreads()
    if lane == n - 1:
        buf[n - 1, col] = 0.0
    cuda.syncthreads()
    offset = n // 2
    while offset > 0:
        i = (lane + 1) * 2 * offset - 1
        if i < n:
            left = buf[i - offset, col]
            buf[i - offset, col] = buf[i, col]
            buf[i, col] += left
        cuda.syncthreads()
        offset //= 2
    return total


# ---------------------------------------------------------------------------
# Straight-line steps (host side: builds device functions)
# ---------------------------------------------------------------------------


def inliner(simulator):
    """The decorator that makes a kernel's piece a device function inlined into its caller.

    On a GPU (``simulator`` false) ``cuda.jit(device=True, forceinline=True)``
    (NVVM's alwaysinline); in the CUDA simulator the Python function itself
    (a simulated device function swaps the ``cuda`` module into its globals
    at every call).
    """

    def inline(fn):
        return fn if simulator else cuda.jit(device=True, forceinline=True)(fn)

    return inline


def unrolled(step, n, da, db, inline):
    """``step`` ``n`` times in straight-line code: a function ``f(regs, sh_a, sh_b, oa, ob)`` that calls
    ``step(regs, sh_a, sh_b, oa + k da, ob + k db)`` for ``k = 0, 1, ..., n - 1``, in that order.

    ``n`` is a power of two; each doubling is a function of its own, made a
    device function by ``inline`` (:func:`inliner`: on a GPU NVVM inlines
    every level, since the compiler does not unroll a loop of many such
    steps itself).  ``regs`` is a tuple of the caller's register arrays, ``sh_a``
    and ``sh_b`` two shared arrays, ``oa`` and ``ob`` the offsets of the
    first step in them (64-bit, so that the constant ``k da``, ``k db``
    fold into the loads' addresses).  A step is one unit of a register-tiled
    product: one coordinate, component or token of the staged tiles.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"unrolled: n must be a power of two, got {n}")
    width = 1
    while width < n:
        step = _doubled(step, width * da, width * db, inline)
        width *= 2
    return step


def _doubled(step, da, db, inline):
    # step at (oa, ob), then at (oa + da, ob + db); the strides unsigned 64-bit constants, as the offsets (an int64
    # added to a uint64 would be a float64 in Numba)
    da, db = np.uint64(da), np.uint64(db)

    def twice(regs, sh_a, sh_b, oa, ob):
        step(regs, sh_a, sh_b, oa, ob)
        step(regs, sh_a, sh_b, oa + da, ob + db)

    return inline(twice)


# ---------------------------------------------------------------------------
# Launch limits (host side)
# ---------------------------------------------------------------------------

#: The hardware's largest grid: x up to 2^31 - 1 blocks, y and z up to 65,535; at most 1,024 threads per block.
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_THREADS = 1024


def sequence_axes(n: int) -> tuple:
    """Grid sizes ``(y, z)`` that cover ``n`` sequences within the limits: ``y z >= n`` when ``n <= 65,535^2``.

    A kernel takes sequence ``b = blockIdx.y + gridDim.y blockIdx.z`` and
    steps by ``gridDim.y gridDim.z`` (a loop that runs once unless ``n``
    exceeds ``65,535^2``).
    """
    n = max(1, int(n))
    z = min(-(-n // MAX_GRID_YZ), MAX_GRID_YZ)
    y = min(-(-n // z), MAX_GRID_YZ)
    return y, z
