r"""Gaussian Mixture Attention on the GPU: :func:`refimpl.gma.gma`, :func:`~refimpl.gma.gma_forward`, :func:`~refimpl.gma.gma_backward`.

What it computes
----------------
For every sequence of ``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``,
``v (..., N_k, d_v)``, with one GMM shared by every sequence or one per head
(the last leading dimension): the responsibilities :math:`\Gamma_Q`,
:math:`\Gamma_K` (:func:`gpu.numba_cuda.gmm.posterior_device`), then the
scan of :mod:`gpu.numba_cuda.scan`,
:math:`O = \Gamma_Q\Gamma_K^\top V / (\Gamma_Q\Gamma_K^\top\mathbf 1 + \epsilon)`
(its lower triangle when causal).  The backward runs the scan's backward
for :math:`g = \partial L/\partial\gamma`, then the gradients through the
responsibilities of ``docs/derivations/gma.md#backward-through-the-responsibilities``:
per token the softmax backward and ``dL/dx``, and the parameter gradients as
ordered sums over the tokens, per head (or over every sequence for a shared
GMM).  The differences ``x - mu`` are formed per token: no expansion, no
cancellation.

Launch plan
-----------
The leading dimensions are flattened to ``B`` sequences (C order, so that
sequence ``b`` has head ``b % H``); every kernel folds the sequences onto
grid x with its tiles, so each step is one launch for the whole batch, and
the geometry of every launch is a pure function of the shapes
(:func:`launch_geometry`: :func:`forward_geometry`, the scan's,
:func:`backward_geometry`), inside the hardware's
limits for any ``B``, ``N`` and ``H`` (1-D grids of at most
:data:`~gpu.numba_cuda.gmm.MAX_GRID_X` blocks, which loop over their tiles
when there are more).

1. Responsibilities of the queries and of the keys: two calls of
   :func:`gpu.numba_cuda.gmm.posterior_device` (two launches each: the
   per-component constants, the register-tiled log joint fused with the
   row softmax); the small GMM arrays (``H x K x d_r``: softplus,
   log-softmax, sigmoid, the precisions) are computed on the host by
   :mod:`refimpl.numerics`, exactly as :mod:`refimpl.gma` does, or, when a
   parameter is a device array, on the device (:func:`_mixture_from_raw`,
   :func:`gpu.numba_cuda.gmm.log_weights_device`: one launch).
2. The scan forward (:func:`gpu.numba_cuda.scan.scan_forward_device`, its
   own launches): the write :math:`[S, z] = \Gamma_K^\top[V, 1]` and the read
   :math:`\Gamma_Q[S, z]` with the division.
3. Backward: the scan backward, then, for the queries and for the keys,
   :func:`_responsibility_rows` (``c`` and ``dx``: a block per tile of
   ``ROW_TILE`` rows, ``dx`` a register-tiled product over the components,
   from the differences, its arrays flat with offsets formed once per tile,
   so that its hot loop is the product's), :func:`_parameter_partials` (per segment of
   :data:`~gpu.numba_cuda.scan.SEGMENT` tokens, a block per ``PTILE x PTILE``
   tile of ``(m, j)``, each thread a register tile), then one :func:`_parameter_sums` (one thread per
   mean, raw variance and logit entry, adding the partials over segments
   and sequences in a fixed order): 5 launches besides the scan's.  No
   atomics: the results are deterministic for a given launch geometry.

A packed call of :func:`gma` or :func:`gma_forward` (``cu_seqlens``)
makes the launches of one call: the responsibilities of every packed row at
once (they are row by row), then the packed scan of
:func:`gpu.numba_cuda.scan.scan_forward_device`, each sequence's chunks and
keys its own.  The backward of its cache makes the launches of one
backward: the packed scan backward, then the responsibility and parameter
kernels over every packed row (the parameters' partial sums run over
segments of the packed rows, so they add the sequences' terms in another
order than the loop: equal to rounding).

The tile sizes are module constants (:data:`GPU_GEOMETRY` on a GPU,
:data:`SIMULATOR_GEOMETRY` in the simulator); :func:`geometry` runs the
GPU's tiles in the simulator, for tests.

Host copies
-----------
One small device array per public call: the result-check flag, gathered by
:class:`~gpu.numba_cuda._device.Checks` (the non-finite counts of the device
inputs and of both ``min_quad``, and the denominators when ``eps = 0``) and
copied once; the backward copies only ``grad_out``'s count, before its
kernels.  Device GMM parameters add their value checks to the same flag
(:func:`gpu.numba_cuda.gmm.queue_parameter_checks`; refimpl's checkers read
stand-ins of their shapes and dtypes, :func:`gpu.numba_cuda._device.stand_in`).
Only a failing check copies more (the parameters together,
:func:`gpu.numba_cuda.gmm.parameters_to_host`), so that refimpl's own checker
words the error, in refimpl's order.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numba import boolean, cuda, int64, uint32, uint64
from scipy.special import expit

from refimpl import boundary, numerics, validation, varlen
from refimpl.gma import (
    GMAGrads,
    check_gma_arguments,
    check_gma_forward_arguments,
    check_gma_grad_out,
    check_gma_results,
)
from refimpl.scan import DEFAULT_CHUNK_SIZE

from . import gmm as device_gmm
from ._device import SIMULATOR, Checks, any_device, backend, blocks, host_view, is_device_array, kernel, raise_bad_inputs, result, to_device, to_host
from . import _primitives
from .gmm import MAX_GRID_X, device_function, exp_shifted, max_keep_nan, parameters_to_host, posterior_device, u32, u64
from . import scan as device_scan
from .scan import ScanDeviceCache, scan_backward_device, scan_forward_device

__all__ = ["gma", "gma_forward", "gma_backward", "GMADeviceCache", "launch_geometry", "forward_geometry", "backward_geometry", "geometry"]


class Geometry(NamedTuple):
    """Tile sizes of the backward kernels (module constants; :func:`geometry` switches them in the simulator)."""

    rows_per_thread: int  # RM: rows of a thread's register tile in _responsibility_rows
    coords_per_thread: int  # RJ: coordinates of that register tile
    threads_x: int  # TX: threads along the components / coordinates (a power of two)
    threads_y: int  # TY: threads along the rows
    m_chunk: int  # MC: components per shared-memory stage of dL/dx
    tile: int  # TILE: threads along each side of a _parameter_partials block, and its tokens per stage
    threads: int  # THREADS: threads per block of _parameter_sums
    params_per_thread: int  # PP: components and coordinates of a thread's register tile in _parameter_partials


#: On a GPU, in float32 and float64 alike: dL/dx in 32 x 32 block tiles (rows x coordinates) of 16 x 16 threads with
#: 2 x 2 register tiles, 16 components a stage (shared memory 32 x 16 + 16 x 36 + 16 x 32 x 2 entries: 8,448 bytes in
#: float32, 16,896 in float64); the parameter partials in 32 x 32 tiles (components x coordinates) of 16 x 16 threads
#: with 2 x 2 register tiles, 16 tokens a stage; 128 threads per block for the sums.
GPU_GEOMETRY = Geometry(2, 2, 16, 16, 16, 16, 128, 2)
#: In the simulator (every thread a Python thread): 2 x 2 register tiles of 2 x 2 threads, 2 components a stage,
#: 4 x 4 parameter tiles of 2 x 2 threads (2 tokens a stage), 32 threads for the sums.
SIMULATOR_GEOMETRY = Geometry(2, 2, 2, 2, 2, 2, 32, 2)


_inline = _primitives.inliner(SIMULATOR)  # the kernels' pieces, inlined into them on a GPU


# one component of a stage of dL/dx: acc[a, e] += c_a (mu_e - x_ae) p_e, the thread's RM entries of c at oc in sh_c,
# its RJ means at om in sh_mp and its RJ precisions RJ further (the stage's steps: _primitives.unrolled)
@_inline
def _rows_step(regs, sh_c, sh_mp, oc, om):
    acc, xr, cr, mr, pr = regs
    for a in range(RM):
        cr[a] = sh_c[oc + u64(a)]
    for e in range(RJ):
        mr[e] = sh_mp[om + u64(e)]
        pr[e] = sh_mp[om + u64(RJ + e)]
    for a in range(RM):
        for e in range(RJ):
            acc[a, e] += cr[a] * (mr[e] - xr[a, e]) * pr[e]


# one token of a stage of the parameter partials: per entry (a, e) of the thread's register tile, with diff = x_e - mu_ae,
# acc_mu += c_a diff, acc_var += c_a (diff^2 - sigma2_ae), and acc_c[a] += c_a; the thread's PP entries of c at oc in
# sh_c, of x at ox in sh_x
@_inline
def _partials_step(regs, sh_c, sh_x, oc, ox):
    acc_mu, acc_var, acc_c, mu, s2, cr, xr = regs
    for a in range(PP):
        cr[a] = sh_c[oc + u64(a)]
    for e in range(PP):
        xr[e] = sh_x[ox + u64(e)]
    for a in range(PP):
        cm = cr[a]
        for e in range(PP):
            diff = xr[e] - mu[a, e]
            acc_mu[a, e] += cm * diff
            acc_var[a, e] += cm * (diff * diff - s2[a, e])
        acc_c[a] += cm


# the MC components of a stage, UNROLL at a time (one call when MC = UNROLL: straight-line code), the thread's entries of
# the first at oc in sh_c and om in sh_mp
@_inline
def _rows_stage(acc, xr, cr, mr, pr, sh_c, sh_mp, oc, om):
    for _ in range(MC // UNROLL):
        STEPS((acc, xr, cr, mr, pr), sh_c, sh_mp, oc, om)
        oc += u64(UNROLL * CS)
        om += u64(UNROLL * 2 * COORD_TILE)


# this thread's entries of the stage from component m0 into shared memory, its offsets c_src, mj_src advanced to the
# next stage: c at component c_col of the stage and rows c_row + u C_STEP of the tile (zero at and past row rows_in), the
# means and precisions at components mj_row + u MJ_STEP (zero past d_r: mj_in false); in the last stage (tail) also zero
# at and past component K
def _rows_loads(tail):
    def loads(c, means, precisions, sh_c, sh_mp, c_src, mj_src, c_col, c_row, mj_row, mj_slot, rows_in, mj_in, m0, K32,
              mj_step, zero):
        c_in = (not tail) or u32(m0 + c_col) < K32
        for u in range(LOADS_CR):
            v = zero
            if c_in and u32(c_row + u32(u * C_STEP)) < rows_in:
                v = c[c_src[u]]
            sh_c[u32(c_col * u32(CS) + c_row + u32(u * C_STEP))] = v
            c_src[u] += u64(MC)
        for u in range(LOADS_MJ):
            mu = zero
            pj = zero
            if mj_in and ((not tail) or u32(m0 + mj_row + u32(u * MJ_STEP)) < K32):
                mu = means[mj_src[u]]
                pj = precisions[mj_src[u]]
            sh_mp[u32(mj_slot + u32(u * MJ_STEP * 2 * COORD_TILE))] = mu
            sh_mp[u32(mj_slot + u32(u * MJ_STEP * 2 * COORD_TILE + RJ))] = pj
            mj_src[u] += mj_step

    return _inline(loads)


_rows_loads_full, _rows_loads_tail = _rows_loads(False), _rows_loads(True)


def _set_geometry(g: Geometry) -> None:
    # the kernels read these module globals; on a GPU they are compile-time constants (shared and local array shapes,
    # unrolled loop bounds, the step function of a stage), set once at import
    global GEOMETRY, RM, RJ, TX, TY, MC, TILE, THREADS, NT, ROW_TILE, COORD_TILE, SH_RED, RED2, SH_CR, SH_MJ
    global LOADS_CR, LOADS_MJ, CS, SH_MP, C_STEP, MJ_STEP, UNROLL, STEPS, P_STEPS, PP, PTILE, SH_P, TT_STEP
    rm, rj, tx, ty, mc, tile, threads, pp = g
    if tx & (tx - 1) or tile & (tile - 1) or threads & (threads - 1):
        raise ValueError("Geometry: threads_x, tile and threads must be powers of two")
    nt = tx * ty
    if (ty * rm * mc) % nt or (mc * tx * rj) % nt or nt % mc or nt % (tx * rj) or tile % pp:
        raise ValueError("Geometry: the shared tiles must be a multiple of the block's threads")
    GEOMETRY = g
    RM, RJ, TX, TY, MC, TILE, THREADS = rm, rj, tx, ty, mc, tile, threads
    PP = pp
    PTILE = tile * pp  # side of a _parameter_partials tile (components x coordinates)
    SH_P = tile * PTILE  # its staged tokens: [TILE tokens, PTILE components or coordinates]
    TT_STEP = tile * tile // PTILE  # tokens between a thread's staged entries there
    NT = nt
    ROW_TILE, COORD_TILE = ty * rm, tx * rj
    SH_RED = ROW_TILE * TX  # [ROW_TILE rows, TX lanes]
    RED2 = (ROW_TILE, TX)
    CS = ROW_TILE + 4  # a component's row of the staged c tile, padded (16-byte aligned, fewer bank conflicts)
    SH_CR = MC * CS  # [MC components, CS]
    SH_MJ = MC * COORD_TILE  # [MC components, COORD_TILE coordinates]
    SH_MP = 2 * SH_MJ  # the means and the precisions: [MC components, TX, (mean, precision), RJ]
    LOADS_CR = ROW_TILE * MC // NT
    LOADS_MJ = SH_MJ // NT
    C_STEP = NT // MC  # rows between a thread's staged entries of c
    MJ_STEP = NT // COORD_TILE  # components between its staged means
    UNROLL = math.gcd(MC, 16)  # components of a stage per step of its unrolled loop
    STEPS = _primitives.unrolled(_rows_step, UNROLL, CS, 2 * COORD_TILE, _inline)  # UNROLL components of dL/dx
    P_STEPS = _primitives.unrolled(_partials_step, tile, PTILE, PTILE, _inline)  # the TILE tokens of a partials stage


_set_geometry(SIMULATOR_GEOMETRY if SIMULATOR else GPU_GEOMETRY)

#: The alignment of the shared tiles of :func:`_responsibility_rows` (16 bytes on a GPU, so that a thread's contiguous
#: entries are read by 64- and 128-bit loads; the simulator refuses an alignment).
ALIGN = None if SIMULATOR else 16

row_sum = device_function(_primitives.row_sum)


@contextmanager
def geometry(g: Geometry = GPU_GEOMETRY, gmm=device_gmm.GPU_GEOMETRIES):
    """Run the GMA kernels with the tile geometries ``g`` and ``gmm`` (the responsibilities'), in the CUDA simulator only.

    The simulator reads the modules' constants at every launch, so a test can
    run the GPU's own tiles there; a GPU compiles them into the kernels once,
    so this refuses to run on one.  The scan (:mod:`gpu.numba_cuda.scan`)
    keeps its own sizes.
    """
    if not SIMULATOR:
        raise RuntimeError("gpu.numba_cuda.gma.geometry: the tile geometry is fixed on a GPU (compile-time constants)")
    old = GEOMETRY
    _set_geometry(g)
    try:
        with device_gmm.geometry(gmm):
            yield
    finally:
        _set_geometry(old)


class GMADeviceCache(NamedTuple):
    """What :func:`gma_backward` needs from :func:`gma_forward`: shapes, and device arrays of ``B`` flattened sequences."""

    leading: tuple  # the leading (batch) shape of x_q, x_k, v
    per_head: bool  # the GMM has a head axis
    on_device: bool  # the forward's inputs included a device array: the gradients stay on the device
    x_q: object  # (B, N_q, d_r)
    x_k: object  # (B, N_k, d_r)
    means: object  # (H, K, d_r); H = 1 for a shared GMM
    variances: object  # (H, K, d_r)
    precisions: object  # (H, K, d_r): 1 / variances
    sigmoid_raw: object  # (H, K, d_r): dsigma2/ds = sigmoid(s)
    scan: ScanDeviceCache  # gamma_q, gamma_k, [V, 1], out, den, the chunk states
    packed: tuple | None = None  # a packed call's output shape, (T, d_v) or (T, H, d_v) (the arrays heads first), else None


#: Resident blocks per multiprocessor that ptxas must allow for :func:`_responsibility_rows` on a GPU (its launch
#: bounds, TX x TY threads per block): 4 in both types (at most 64 registers: 32 of the 64 warps of an sm_90, 50%
#: occupancy). ptxas -v (sm_90, CUDA 13): 64 registers, no spills, in float32 and float64 with the 2 x 2 register tile
#: (the staged entries' offsets in two small arrays, the stages without a test of the components in code of their own;
#: with every offset and test formed again at each stage, float64 spills).
MIN_BLOCKS = {np.dtype(np.float32): 4, np.dtype(np.float64): 4}
_BOUNDED = {}


def _launch_bounds(f):
    """The compile options of :func:`_responsibility_rows` for the float type ``f``: its launch bounds."""
    return {"launch_bounds": (NT, MIN_BLOCKS[np.dtype(str(f))])}


def _bounded(kern, options, dtype):
    """``kern`` for ``dtype``: on a GPU compiled with ``options(dtype)`` (its launch bounds), once per kernel and dtype.

    The registry holds the same options, so the PTX and resource checks compile what runs.
    """
    if SIMULATOR:  # the simulator has no launch bounds
        return kern
    key = (kern.py_func.__name__, np.dtype(dtype))
    if key not in _BOUNDED:
        _BOUNDED[key] = cuda.jit(kern.py_func, **options(str(np.dtype(dtype))))
    return _BOUNDED[key]


def _rows_kernel(dtype):
    """:func:`_responsibility_rows` for ``dtype``, compiled with its launch bounds (:func:`_launch_bounds`) on a GPU."""
    return _bounded(_responsibility_rows, _launch_bounds, dtype)


#: Resident blocks per multiprocessor that ptxas must allow for :func:`_parameter_partials` on a GPU (TILE x TILE = 256
#: threads a block): 4 in float32 (at most 64 registers, 50% occupancy), 2 in float64 (25%: its 2 x 2 register tiles
#: hold 22 doubles, and spill when held to 64 or 80 registers; four entries a thread keep as many independent sums in
#: flight as 100% occupancy of one entry a thread).  ptxas -v (sm_90, CUDA 13): 62 registers in float32, 126 in float64,
#: no spills.
PARTIALS_MIN_BLOCKS = {np.dtype(np.float32): 4, np.dtype(np.float64): 2}


def _partials_bounds(f):
    """The compile options of :func:`_parameter_partials` for the float type ``f``: its launch bounds
    (:data:`PARTIALS_MIN_BLOCKS`)."""
    return {"launch_bounds": (TILE * TILE, PARTIALS_MIN_BLOCKS[np.dtype(str(f))])}


def _partials_kernel(dtype):
    """:func:`_parameter_partials` for ``dtype``, compiled with its launch bounds (:func:`_partials_bounds`) on a GPU."""
    return _bounded(_parameter_partials, _partials_bounds, dtype)


# c = grad - gbar[:, None]; c *= gam with gbar = (gam * grad) @ ones (dL/dl_m = gamma_m (g_m - gbar)), then
# dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2 (refimpl.gma._responsibility_backward), from the differences, as the
# register-tiled product dx = sum_m c_im (mu_mj - x_ij) p_mj with p = 1 / sigma^2 (the forward's precisions).
# The arrays come flat (C order) with their shapes, as in a GEMM: the offset of a row, (b N + i) K or (b N + i) d_r, is
# formed once per row, and the offset of each entry a thread stages once per tile, then advanced by a constant per
# stage; offsets within a row and counters are unsigned 32-bit (K, d_r < 2^31, checked by the caller), offsets into
# the arrays unsigned 64-bit (no negative-index wraparound).
# Work: the rows of sequence b (mixture h = b % H) in tiles of ROW_TILE, the tiles of every sequence folded onto grid x
# (block x loops over tiles x, x + gridDim.x, ...); a block of TY x TX threads (on a GPU 16 x 16 threads with
# RM x RJ = 2 x 2: 32 rows by 32 coordinates, in both float types).
# Phase 1: thread (ty, tx) sums gamma * grad over the components tx, tx + TX, ... of rows ty + a TY (a < RM) into its
# lane of shared memory [ROW_TILE rows, TX lanes]; every thread of a row adds the row's lanes in order (row_sum: the
# same bits in each), then writes its entries of c.
# Phase 2, per tile of COORD_TILE coordinates: thread (ty, tx) owns the RM x RJ register tile of rows ty RM + a and
# coordinates tx RJ + e (contiguous; x in registers); the components are staged MC at a time in 16-byte aligned shared
# memory (zeros past N, K and d_r), consecutive threads loading consecutive addresses:
# - c component-major, [MC, CS] with CS = ROW_TILE + 4: a thread's RM rows are RM contiguous entries (one 64-bit load
#   in float32, 128-bit in float64); the padding keeps them aligned and spreads the transposing stores over the banks;
# - the means and precisions [MC, TX, 2, RJ]: a thread's RJ means then its RJ precisions, contiguous (one 128-bit load
#   in float32, two in float64).
# Per component a thread reads RM + 2 RJ shared entries for RM RJ (sub, mul, fma); the MC components of a stage are
# straight-line code (the steps are device functions inlined UNROLL at a time, UNROLL = gcd(MC, 16)), their shared
# offsets constants.  The stages whose MC components are all below K run in a loop without a test of the components,
# then the last, partial stage (if K is not a multiple of MC) in code of its own that tests them: the loop sm_90 runs
# floor(K / MC) times is 289 instructions for 256 FLOPs in float32 (192 fp, 32 shared loads), 306 in float64.
@kernel(lambda f: (f[::1], f[::1], f[::1], f[::1], f[::1], f[::1], f[::1], int64, int64, int64, int64, int64),
        threads=lambda f: NT, tags=("gma",), options=lambda f: _launch_bounds(f))
def _responsibility_rows(x, gamma, grad, means, precisions, c, dx, B, N, K, d, H):
    f = x.dtype.type
    red = cuda.shared.array(RED2, dtype=x.dtype)  # [ROW_TILE rows, TX lanes]
    sh_c = cuda.shared.array(SH_CR, dtype=x.dtype, alignment=ALIGN)  # [MC components, CS: ROW_TILE rows, padded]
    sh_mp = cuda.shared.array(SH_MP, dtype=x.dtype, alignment=ALIGN)  # [MC components, TX, (mean, precision), RJ]
    acc = cuda.local.array((RM, RJ), dtype=x.dtype)
    c_src = cuda.local.array(LOADS_CR, dtype=uint64)  # offset in c of this thread's staged entries (stage m0)
    mj_src = cuda.local.array(LOADS_MJ, dtype=uint64)  # offset in the means and precisions of its staged entries
    xr = cuda.local.array((RM, RJ), dtype=x.dtype)
    cr = cuda.local.array(RM, dtype=x.dtype)
    mr = cuda.local.array(RJ, dtype=x.dtype)
    pr = cuda.local.array(RJ, dtype=x.dtype)
    zero = f(0.0)
    K32 = u32(K)
    d32 = u32(d)
    K64 = u64(K)
    d64 = u64(d)
    tx = u32(cuda.threadIdx.x)
    ty = u32(cuda.threadIdx.y)
    tid = u32(ty * u32(TX) + tx)
    tiles_n = (N + ROW_TILE - 1) // ROW_TILE
    j_tiles = (d + COORD_TILE - 1) // COORD_TILE
    for tile in range(cuda.blockIdx.x, B * tiles_n, cuda.gridDim.x):
        b = tile // tiles_n
        i0 = (tile - b * tiles_n) * ROW_TILE
        h = b % H
        row0 = b * N + i0  # the tile's first row among the B N rows
        for a in range(RM):
            r = u32(ty + u32(a * TY))
            part = zero
            if i0 + r < N:
                o = u64(row0 + r) * K64
                m = tx
                while m < K32:
                    part += gamma[o + m] * grad[o + m]
                    m = u32(m + u32(TX))
            red[r, tx] = part
        cuda.syncthreads()
        for a in range(RM):
            r = u32(ty + u32(a * TY))
            if i0 + r < N:
                gbar = row_sum(red, r, TX)
                o = u64(row0 + r) * K64
                m = tx
                while m < K32:
                    c[o + m] = (grad[o + m] - gbar) * gamma[o + m]
                    m = u32(m + u32(TX))
        cuda.syncthreads()  # c of the tile's rows written (and visible to the block), the row sums read
        # the entries this thread stages (consecutive threads on consecutive addresses): c at component c_col of the
        # stage and rows c_row + u C_STEP of the tile (u < LOADS_CR), its slot in sh_c c_col CS + c_row, then C_STEP
        # further for each u; the means and precisions at coordinate mj_col of the coordinate tile and components
        # mj_row + u MJ_STEP of the stage (u < LOADS_MJ), their slots 2 COORD_TILE MJ_STEP apart for each u
        c_col = u32(tid % u32(MC))
        c_row = u32(tid // u32(MC))
        mj_col = u32(tid % u32(COORD_TILE))
        mj_row = u32(tid // u32(COORD_TILE))
        mj_blk = u32(mj_col // u32(RJ))
        mj_slot = u32(mj_row * u32(2 * COORD_TILE) + mj_blk * u32(2 * RJ) + u32(mj_col - mj_blk * u32(RJ)))
        rows_in = u32(min(N - i0, ROW_TILE))  # rows of the tile inside the sequence (>= 1)
        xo = u32(ty * u32(RM))  # the thread's rows in the tile: xo, ..., xo + RM - 1
        jo = u32(tx * u32(RJ))  # its coordinates in the coordinate tile: jo, ..., jo + RJ - 1
        om = u64(u32(tx * u32(2 * RJ)))  # its RJ means, then RJ precisions, of a component in sh_mp
        for jt in range(j_tiles):
            j0 = u32(jt * COORD_TILE)
            for a in range(RM):
                r = u32(xo + u32(a))
                for e in range(RJ):
                    j = u32(j0 + jo + u32(e))
                    acc[a, e] = zero
                    xr[a, e] = x[u64(row0 + r) * d64 + j] if r < rows_in and j < d32 else zero
            for u in range(LOADS_CR):
                c_src[u] = u64(row0 + c_row + u * C_STEP) * K64 + c_col
            mj_in = u32(j0 + mj_col) < d32
            for u in range(LOADS_MJ):
                mj_src[u] = u64(h * K + mj_row + u * MJ_STEP) * d64 + u32(j0 + mj_col)
            # the full stages m0 = 0, MC, ... while m0 + MC <= K (no test of the components), then the partial one, if any
            # (none when K = 0: the tile's dx is 0)
            m0 = u32(0)
            while u32(m0 + u32(MC)) <= K32:
                _rows_loads_full(c, means, precisions, sh_c, sh_mp, c_src, mj_src, c_col, c_row, mj_row, mj_slot, rows_in,
                                 mj_in, m0, K32, MC * d64, zero)
                cuda.syncthreads()
                _rows_stage(acc, xr, cr, mr, pr, sh_c, sh_mp, u64(xo), om)
                cuda.syncthreads()
                m0 = u32(m0 + u32(MC))
            if m0 < K32:
                _rows_loads_tail(c, means, precisions, sh_c, sh_mp, c_src, mj_src, c_col, c_row, mj_row, mj_slot, rows_in,
                                 mj_in, m0, K32, MC * d64, zero)
                cuda.syncthreads()
                _rows_stage(acc, xr, cr, mr, pr, sh_c, sh_mp, u64(xo), om)
                cuda.syncthreads()
            for a in range(RM):
                r = u32(xo + u32(a))
                if i0 + r < N:
                    o = u64(row0 + r) * d64
                    for e in range(RJ):
                        j = u32(j0 + jo + u32(e))
                        if j < d32:
                            dx[o + j] = acc[a, e]


# ctx += c.T @ xc, ctx2 += c.T @ xc**2, csum += ones @ c over the blocks of rows (refimpl.gma._responsibility_backward),
# here from the differences x - mu per token: sum_i c_im (x_ij - mu_mj) and sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj),
# and sum_i c_im, over the tokens of segment s, each entry's sums in token order.
# Work: the (sequence b, segment s, m-tile, j-tile) tiles of PTILE x PTILE entries folded onto grid x, in that order
# (block x loops over tiles x, x + gridDim.x, ...); block TILE x TILE, thread (ty, tx) owns the PP x PP register tile of
# entries (m0 + ty PP + a, j0 + tx PP + e) of [K, d_r] (contiguous); the segment's tokens are staged TILE at a time in
# shared tiles c [TILE tokens, PTILE components] and x [TILE tokens, PTILE coordinates] (consecutive threads on
# consecutive addresses, zeros past the segment, K and d_r): per token a thread reads its PP components' c and its PP
# coordinates' x, contiguous (a 64-bit load each in float32 on a GPU, PP = 2), for PP^2 (sub, fma, fma, fma).
# The threads tx = 0 of the blocks with j0 = 0 also write the sums of c over the tokens for dlogits.
@kernel(lambda f: (f[::1], f[::1], f[:, :, ::1], f[:, :, ::1], int64, f[:, :, :, ::1], f[:, :, :, ::1], f[:, :, ::1],
                   int64, int64, int64, int64), threads=lambda f: TILE * TILE, options=lambda f: _partials_bounds(f))
def _parameter_partials(x, c, means, variances, segment, part_mu, part_var, part_c, B, N, K, d):
    sh_c = cuda.shared.array(SH_P, dtype=x.dtype, alignment=ALIGN)  # [TILE tokens, PTILE components], flat
    sh_x = cuda.shared.array(SH_P, dtype=x.dtype, alignment=ALIGN)  # [TILE tokens, PTILE coordinates], flat
    mu = cuda.local.array((PP, PP), dtype=x.dtype)
    s2 = cuda.local.array((PP, PP), dtype=x.dtype)
    acc_mu = cuda.local.array((PP, PP), dtype=x.dtype)
    acc_var = cuda.local.array((PP, PP), dtype=x.dtype)
    acc_c = cuda.local.array(PP, dtype=x.dtype)
    cr = cuda.local.array(PP, dtype=x.dtype)
    xr = cuda.local.array(PP, dtype=x.dtype)
    zero = x.dtype.type(0.0)
    H = means.shape[0]
    n_seg = part_c.shape[1]
    K64 = u64(K)
    d64 = u64(d)
    tx = u32(cuda.threadIdx.x)
    ty = u32(cuda.threadIdx.y)
    tid = u32(ty * u32(TILE) + tx)
    mo = u32(ty * u32(PP))  # the thread's components in the tile: mo, ..., mo + PP - 1
    jo = u32(tx * u32(PP))  # its coordinates
    # the entries this thread stages: column col of the staged tiles (a component of c, a coordinate of x) at tokens
    # tt + u TT_STEP of the stage (u < PP: TILE PTILE entries over TILE^2 threads), consecutive threads on consecutive
    # columns
    col = u32(tid % u32(PTILE))
    tt = u32(tid // u32(PTILE))
    m_tiles = (K + PTILE - 1) // PTILE
    j_tiles = max(1, (d + PTILE - 1) // PTILE)
    per_seq = n_seg * m_tiles * j_tiles
    for blk in range(cuda.blockIdx.x, B * per_seq, cuda.gridDim.x):
        b = blk // per_seq
        h = b % H
        s = (blk - b * per_seq) // (m_tiles * j_tiles)
        rest = blk - b * per_seq - s * m_tiles * j_tiles
        m0 = (rest // j_tiles) * PTILE
        j0 = (rest % j_tiles) * PTILE
        for a in range(PP):
            m = m0 + mo + a
            for e in range(PP):
                j = j0 + jo + e
                entry = m < K and j < d
                mu[a, e] = means[h, m, j] if entry else zero
                s2[a, e] = variances[h, m, j] if entry else zero
                acc_mu[a, e] = zero
                acc_var[a, e] = zero
            acc_c[a] = zero
        i_start = s * segment
        i_end = min(i_start + segment, N)
        c_in = m0 + col < K
        x_in = j0 + col < d
        # offsets of this thread's first staged entries (token i_start + tt), then TILE rows further each stage
        c_src = u64(b * N + i_start + tt) * K64 + u64(m0 + col)
        x_src = u64(b * N + i_start + tt) * d64 + u64(j0 + col)
        for i0 in range(i_start, i_end, TILE):
            for u in range(PP):
                inside = i0 + tt + u * TT_STEP < i_end
                sh_c[u32(tid + u32(u * TILE * TILE))] = c[c_src + u64(u * TT_STEP) * K64] if inside and c_in else zero
                sh_x[u32(tid + u32(u * TILE * TILE))] = x[x_src + u64(u * TT_STEP) * d64] if inside and x_in else zero
            c_src += u64(TILE) * K64
            x_src += u64(TILE) * d64
            cuda.syncthreads()
            # the stage's TILE tokens, straight-line code (its tokens past the segment are zeros: they add nothing)
            P_STEPS((acc_mu, acc_var, acc_c, mu, s2, cr, xr), sh_c, sh_x, u64(mo), u64(jo))
            cuda.syncthreads()
        for a in range(PP):
            m = m0 + mo + a
            if m < K:
                for e in range(PP):
                    j = j0 + jo + e
                    if j < d:
                        part_mu[b, s, m, j] = acc_mu[a, e]
                        part_var[b, s, m, j] = acc_var[a, e]
                if j0 == 0 and tx == 0:
                    part_c[b, s, m] = acc_c[a]


# sum_s a[(b n + s) stride + entry] over the n segments of sequence b, in segment order: one entry's partials
@_inline
def _segment_sum(a, b, n, stride, entry, zero):
    total = zero
    o = u64(b) * u64(n) * stride + entry
    end = o + u64(n) * stride
    while o < end:
        total += a[o]
        o += stride
    return total


# dmeans = (ctx - csum mc) * prec, dvariances = 0.5 * sq * prec * prec, draw = (dvar_q + dvar_k) * expit(raw),
# logits = da_q + da_k (refimpl.gma._gma_backward), summed over the sequences of head h (every sequence when shared).
# One thread per entry (h, m, j) of the (H, K, 2 d_r + 1) sums, over a 1-D grid (striding by the grid when there are
# more entries): j < d_r a mean's, d_r <= j < 2 d_r a raw variance's (coordinate j - d_r), j = 2 d_r the logit's, so
# that each thread walks one pair of partial arrays (its query and key tokens'); it adds the partials of the query
# and the key tokens over the segments, sequence by sequence in order: deterministic.  The partials come flat: the
# thread's entry is at offset ((b n_seg + s) K + m) d + j (K + m for the logits), advanced by a constant per segment.
@kernel(lambda f: (f[::1], f[::1], f[::1], f[::1], f[::1], f[::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1],
                   f[:, :, ::1], f[:, ::1], int64, int64, int64), threads=lambda f: THREADS)
def _parameter_sums(mu_q, var_q, c_q, mu_k, var_k, c_k, variances, sigmoid_raw, dmeans, draw, dlogits, B, n_q, n_k):
    f = variances.dtype.type
    zero = f(0.0)
    half = f(0.5)
    H, K, d = variances.shape
    width = 2 * d + 1
    for idx in range(cuda.grid(1), H * K * width, cuda.gridsize(1)):
        j = idx % width
        m = (idx // width) % K
        h = idx // (width * K)
        logit = j == 2 * d
        variance = not logit and j >= d
        jj = j - d if variance else j
        a_q = c_q if logit else (var_q if variance else mu_q)
        a_k = c_k if logit else (var_k if variance else mu_k)
        stride = u64(K) if logit else u64(K) * u64(d)  # from one segment's partials to the next
        entry = u64(m) if logit else u64(m) * u64(d) + u64(jj)
        acc = zero
        for b in range(h, B, H):
            acc += _segment_sum(a_q, b, n_q, stride, entry, zero) + _segment_sum(a_k, b, n_k, stride, entry, zero)
        if logit:
            dlogits[h, m] = acc
        elif variance:
            prec = f(1.0) / variances[h, m, jj]
            draw[h, m, jj] = half * acc * prec * prec * sigmoid_raw[h, m, jj]
        else:
            dmeans[h, m, jj] = acc * (f(1.0) / variances[h, m, jj])


def forward_geometry(B, N_q, N_k, K, d_r, H=1, dtype=np.float64):
    """The launches of the responsibilities in :func:`gma` and :func:`gma_forward`, a pure function of the shapes and dtype.

    ``{name: (grid, block)}``: :func:`gpu.numba_cuda.gmm.launch_geometry` for
    the queries (names ending in `` q``) and the keys (`` k``), with the
    tiles of ``dtype``; the scan's launches are :mod:`gpu.numba_cuda.scan`'s.
    """
    out = {}
    for side, n in (("q", N_q), ("k", N_k)):
        for name, launch in device_gmm.launch_geometry(B, n, K, d_r, H, dtype).items():
            out[f"{name} {side}"] = launch
    return out


def backward_geometry(B, N_q, N_k, K, d_r, H=1, segment=None):
    """The launches of this module's kernels in :func:`gma_backward`, a pure function of the shapes.

    ``{name: (grid, block)}`` for ``B`` sequences of ``N_q`` queries and
    ``N_k`` keys, ``K`` components in ``d_r`` coordinates, ``H`` mixtures,
    segments of ``segment`` tokens (default :data:`gpu.numba_cuda.scan.SEGMENT`).
    Every grid is 1-D (sequences folded onto x) and at most :data:`MAX_GRID_X`
    blocks: the kernels loop over their tiles when there are more.
    """
    segment = device_scan.SEGMENT if segment is None else int(segment)
    B, K, d_r, H = int(B), int(K), int(d_r), int(H)
    out = {}
    for side, n in (("q", int(N_q)), ("k", int(N_k))):
        rows = B * blocks(n, ROW_TILE)
        out[f"_responsibility_rows {side}"] = (max(1, min(rows, MAX_GRID_X)), (TX, TY))
        partials = B * blocks(n, segment) * blocks(K, PTILE) * blocks(d_r, PTILE)
        out[f"_parameter_partials {side}"] = (max(1, min(partials, MAX_GRID_X)), (TILE, TILE))
    out["_parameter_sums"] = (min(blocks(H * K * (2 * d_r + 1), THREADS), MAX_GRID_X), THREADS)
    return out


def launch_geometry(B, N_q, N_k, K, d_r, d_v, H=1, causal=False, chunk_size=DEFAULT_CHUNK_SIZE, dtype=np.float64):
    """Every launch of :func:`gma_forward` and :func:`gma_backward` (and so of :func:`gma`), a pure function of the shapes.

    ``{"forward": forward_geometry(...), "scan": the scan's
    launch_geometry (gpu.numba_cuda.scan), "backward": backward_geometry(...)}``
    for ``B`` sequences of ``N_q`` queries and ``N_k`` keys, ``K``
    components in ``d_r`` coordinates, ``d_v`` value columns, ``H`` mixtures,
    in the float type ``dtype`` (the responsibilities' tiles depend on it).
    """
    chunk = min(int(chunk_size), max(1, int(N_k))) if causal else device_scan.SEGMENT
    scan = {side: device_scan.launch_geometry(B=int(B), N=int(n), F=int(K), E=int(d_v) + 1, chunk=chunk, dtype=dtype)
            for side, n in (("q", N_q), ("k", N_k))}
    return {
        "forward": forward_geometry(B, N_q, N_k, K, d_r, H, dtype),
        "scan": scan,
        "backward": backward_geometry(B, N_q, N_k, K, d_r, H),
    }


def _flat(a, dtype, leading):
    """``a`` on the device as ``(B, N, d)`` with ``B`` the product of the leading dimensions."""
    a = to_device(a, dtype)
    B = int(np.prod(leading, dtype=np.int64))
    shape = tuple(a.shape)
    return a.reshape(B, shape[-2], shape[-1])


def _heads(a, per_head, dtype):
    """A GMM array on the device with its head axis: a shared one, ``(K, d_r)`` or ``(K,)``, as one head; a per-head one unchanged."""
    a = to_device(a, dtype)
    return a if per_head else a.reshape((1,) + tuple(a.shape))


# sigma^2 = softplus(s) + sigma2_min with softplus(s) = max(s, 0) + log1p(e^{-|s|}) (refimpl.numerics.softplus, the
# form of np.logaddexp(0, s)), p = 1 / sigma^2 and sigmoid(s) = 1 / (1 + e^{-s}) (e^s / (1 + e^s) for s < 0: no
# overflow), per entry (refimpl.gma.mixture_from_raw); log pi = (a - m) - log sum_m e^{a_m - m} per head
# (refimpl.numerics.log_softmax).  Entries over a 1-D grid (striding by the grid), one thread per head for the weights.
@kernel(lambda f: (f[:, :, ::1], f[:, ::1], f, f[:, :, ::1], f[:, ::1], f[:, :, ::1], f[:, :, ::1]), threads=lambda f: THREADS)
def _mixture_from_raw(raw, logits, min_variance, variances, log_weights, sigmoid, precisions):
    f = raw.dtype.type
    zero = f(0.0)
    one = f(1.0)
    H, K, d = raw.shape
    for idx in range(cuda.grid(1), H * K * d, cuda.gridsize(1)):
        h = idx // (K * d)
        rest = idx - h * K * d
        m = rest // d
        j = rest - m * d
        s = raw[h, m, j]
        e = math.exp(-abs(s))  # <= 1
        s2 = (max(s, zero) + math.log1p(e)) + min_variance
        variances[h, m, j] = s2
        precisions[h, m, j] = one / s2
        sigmoid[h, m, j] = one / (one + e) if s >= zero else e / (one + e)
    for h in range(cuda.grid(1), H, cuda.gridsize(1)):
        top = f(-math.inf)
        for m in range(K):
            top = max_keep_nan(top, logits[h, m])
        total = zero
        for m in range(K):
            total += exp_shifted(logits[h, m], top)
        log_total = math.log(total) if total > zero else f(-math.inf)  # a row of -inf: log 0 (refused by the checks)
        for m in range(K):
            log_weights[h, m] = (logits[h, m] - top) - log_total


def _forward(x_q, x_k, v, m, var, lw, causal, eps, chunk_size, leading, checks, params, recheck, cu_seqlens=None):
    """Responsibilities and scan on the device; checks the inputs, the parameters, min_quad and the denominators as refimpl does.

    ``m``, ``var``, ``lw``: the mixture on the device, ``(H, K, d_r)`` and
    ``(H, K)``; ``checks`` holds the parameters' checks (``params``, their
    names; :func:`gpu.numba_cuda.gmm.queue_parameter_checks`), and
    ``recheck()`` calls refimpl's checker on host copies of the parameters.
    Every check is gathered on the device and copied to the host once
    (:class:`~gpu.numba_cuda._device.Checks`); only a failing one copies more,
    to word refimpl's error, in refimpl's order (the tokens, the parameters,
    then the computed quantities).  With ``cu_seqlens`` (a packed call: the
    sequences along ``N``, :func:`gpu.numba_cuda.scan.scan_forward_device`)
    a failing computed quantity returns None instead, for the per-sequence
    loop to word its error for the sequence's own rows.
    """
    dtype = checks.dtype
    inputs = ((x_q, "x_q"), (x_k, "x_k"), (v, "v"))
    xq, xk, vd = (_flat(a, dtype, leading) for a, _ in inputs)
    # host arrays were fully checked by refimpl's checker; device arrays are checked on the device
    for (a, name), dev in zip(inputs, (xq, xk, vd)):
        if is_device_array(a):
            checks.finite(dev, name)
    gamma_q, min_quad_q = posterior_device(xq, m, var, lw)
    gamma_k, min_quad_k = posterior_device(xk, m, var, lw)
    out, scan = scan_forward_device(gamma_q, gamma_k, vd, causal, eps, chunk_size, cu_seqlens)
    checks.finite(min_quad_q, "min_quad_q")
    checks.finite(min_quad_k, "min_quad_k")
    if eps == 0:
        checks.rows(scan.den, "den")
    raise_bad_inputs(checks.fetch(), inputs)
    if any(checks.failed(name) for name in params):
        recheck()
    den_bad = eps == 0 and not np.all(checks.part("den") > 0) if "den" in checks.host else False
    if (checks.failed("min_quad_q") or checks.failed("min_quad_k") or den_bad) and cu_seqlens is not None:
        return None
    if checks.failed("min_quad_q") or checks.failed("min_quad_k") or den_bad:
        check_gma_results(to_host(min_quad_q).ravel(), to_host(min_quad_k).ravel(), to_host(scan.den).ravel(), eps)
    return xq, xk, out, scan


def _gma_kernel(xp, checked, given, cu_seqlens=None):
    """:func:`refimpl.gma.gma` on refimpl's checked arguments: the responsibilities and the scan on the device.

    With ``cu_seqlens`` (the checked offsets of a packed call, whose checked
    token arrays are ``(T, d)`` or heads first ``(H, T, d)``), every sequence
    in the same launches, the result laid back in the packed rows; a
    failing result check, a batch with no token, or GMM parameters on the
    device (which ``checked`` holds as zero-stride stand-ins) returns
    ``NotImplemented`` (the per-sequence loop words the error, or computes).
    """
    if cu_seqlens is not None:
        given = _packed_call(checked, given, 3)
        if given is None:
            return NotImplemented
    x_q, x_k, v, means, variances, weights = given
    on_device = any_device(*given)
    hq, _, _, hm, hv, hw, causal, eps, chunk_size = checked
    leading = hq.shape[:-2]
    dtype = hm.dtype
    per_head = hm.ndim == 3
    checks = Checks(dtype)
    params = device_gmm.queue_parameter_checks(
        checks, finite=((means, "means"),), positive=((variances, "variances"),), probability=((weights, "weights"),)
    )
    if is_device_array(weights):
        log_weights = device_gmm.log_weights_device(weights, dtype)
    else:
        # a zero weight is a component that never wins: log 0 = -inf
        with np.errstate(divide="ignore"):
            log_weights = np.log(hw)
    m, var = (_heads(a if is_device_array(a) else h, per_head, dtype) for a, h in ((means, hm), (variances, hv)))
    lw = _heads(log_weights, per_head, dtype)

    def recheck():
        check_gma_arguments(host_view(x_q), host_view(x_k), host_view(v), *parameters_to_host(means, variances, weights),
                            causal, eps, chunk_size)

    if cu_seqlens is None:
        out = _forward(x_q, x_k, v, m, var, lw, causal, eps, chunk_size, leading, checks, params, recheck)[2]
        return result(out.reshape(leading + tuple(out.shape)[1:]), on_device)
    # the checked (heads-first) host arrays; packed calls take host token arrays
    done = _forward(x_q, x_k, v, m, var, lw, causal, eps, chunk_size, leading, checks, params, recheck, cu_seqlens)
    return NotImplemented if done is None else _packed_layout(done[2], leading)


def _packed_call(checked, given, n_params):
    """The token arrays of a packed call (refimpl's checked ones, heads first) and its GMM parameters (on the host), or
    None where the call goes to the per-sequence loop: no token, or GMM parameters on the device (which ``checked``
    holds as zero-stride stand-ins)."""
    params = checked[3:3 + n_params]
    if checked[0].shape[-2] == 0 or any(a.size > 1 and not any(a.strides) for a in params):
        return None
    return tuple(checked[:3]) + tuple(params)


def _packed_layout(out, leading):
    """A packed call's ``(H, T, w)`` device result on the host, in the packed rows: ``(T, H, w)``, or ``(T, w)``."""
    return np.ascontiguousarray(varlen.packed_layout(out.copy_to_host(), leading))


def _gma_forward_kernel(xp, checked, given, cu_seqlens=None):
    """:func:`refimpl.gma.gma_forward` on refimpl's checked arguments: ``(out, GMADeviceCache)``.

    With ``cu_seqlens``, every sequence in the launches of one call, as in
    :func:`_gma_kernel`; the cache holds the packed output's shape.
    """
    if cu_seqlens is not None:
        given = _packed_call(checked, given, 3)
        if given is None:
            return NotImplemented
    x_q, x_k, v, means, raw_variances, logits = given
    on_device = any_device(*given)
    hq, _, _, hm, hraw, hlogits, causal, eps, min_variance, chunk_size = checked
    leading = hq.shape[:-2]
    dtype = hm.dtype
    per_head = hm.ndim == 3
    checks = Checks(dtype)
    params = device_gmm.queue_parameter_checks(
        checks, finite=((means, "means"), (raw_variances, "raw_variances"), (logits, "logits"))
    )
    m = _heads(means if is_device_array(means) else hm, per_head, dtype)
    if any_device(raw_variances, logits):
        # the small GMM arrays on the device (_mixture_from_raw): nothing copied to the host
        raw = _heads(raw_variances if is_device_array(raw_variances) else hraw, per_head, dtype)
        lg = _heads(logits if is_device_array(logits) else hlogits, per_head, dtype)
        var, sig, prec = (cuda.device_array(raw.shape, dtype=dtype) for _ in range(3))
        lw = cuda.device_array(lg.shape, dtype=dtype)
        n = max(int(raw.size), int(lg.shape[0]))
        _mixture_from_raw[min(blocks(n, THREADS), MAX_GRID_X), THREADS](raw, lg, dtype.type(min_variance), var, lw, sig, prec)
    else:
        # sigma^2 = softplus(s) + sigma2_min; log pi = log_softmax(a), per head, as refimpl.gma._gma_forward
        hraw, hlogits = (a if per_head else a[None] for a in (hraw, hlogits))
        variances = numerics.softplus(hraw) + hraw.dtype.type(min_variance)
        log_weights = np.stack([numerics.log_softmax(row) for row in hlogits])
        var, lw = to_device(variances, dtype), to_device(log_weights, dtype)
        sig = to_device(np.ascontiguousarray(expit(hraw)), dtype)
        # p = 1 / sigma^2, for dL/dx (refimpl.gma._responsibility_backward)
        prec = to_device(variances.dtype.type(1.0) / variances, dtype)

    def recheck():
        check_gma_forward_arguments(host_view(x_q), host_view(x_k), host_view(v),
                                    *parameters_to_host(means, raw_variances, logits), causal, eps, min_variance, chunk_size)

    done = _forward(x_q, x_k, v, m, var, lw, causal, eps, chunk_size, leading, checks, params, recheck, cu_seqlens)
    if done is None:
        return NotImplemented
    xq, xk, out, scan = done
    if cu_seqlens is None:
        cache = GMADeviceCache(leading, per_head, on_device, xq, xk, m, var, prec, sig, scan)
        return result(out.reshape(leading + tuple(out.shape)[1:]), on_device), cache
    packed = _packed_layout(out, leading)
    return packed, GMADeviceCache(leading, per_head, False, xq, xk, m, var, prec, sig, scan, packed.shape)


def _gma_backward_kernel(xp, grad_out, cache) -> GMAGrads:
    """:func:`refimpl.gma.gma_backward` on the device, from a :class:`GMADeviceCache`; returns new arrays."""
    validation.check_instance(cache, "cache", GMADeviceCache, "the GMADeviceCache from gpu.numba_cuda.gma.gma_forward")
    scan = cache.scan
    dtype = scan.out.dtype
    if cache.packed is None:
        out_shape = cache.leading + tuple(scan.out.shape)[1:]
        check_gma_grad_out(host_view(grad_out), out_shape, dtype)
    else:
        # a packed forward's grad_out (T, H, d_v) or (T, d_v), checked as the loop checks it, heads first on the device
        grad_out = varlen.checked_grad_out(grad_out, cache.packed, dtype)
        grad_out = grad_out.transpose(1, 0, 2) if grad_out.ndim == 3 else grad_out
    on_device = cache.on_device or is_device_array(grad_out)
    g = _flat(grad_out, dtype, cache.leading)
    checks = Checks(dtype)
    if is_device_array(grad_out):
        checks.finite(g, "grad_out")
    # the one copy of the call: grad_out's check (a backward has no other), before the kernels read it
    raise_bad_inputs(checks.fetch(), ((grad_out, "grad_out"),))
    dphi_q, dphi_k, dv = scan_backward_device(g, scan)
    means, variances = cache.means, cache.variances
    H, K, d = means.shape
    parts = []
    dxs = []
    segment = device_scan.SEGMENT  # read at call time
    launches = backward_geometry(cache.x_q.shape[0], cache.x_q.shape[1], cache.x_k.shape[1], K, d, H, segment)
    if max(K, d) >= 2**31:  # the 32-bit counters of _responsibility_rows
        raise ValueError(f"gma_backward: K and d_r must be below 2^31, got K = {K}, d_r = {d}")
    for side, x, gamma, dgamma in (("q", cache.x_q, scan.phi_q, dphi_q), ("k", cache.x_k, scan.phi_k, dphi_k)):
        B, N, _ = x.shape
        c = cuda.device_array(gamma.shape, dtype=dtype)
        dx = cuda.device_array(x.shape, dtype=dtype)
        grid, block = launches[f"_responsibility_rows {side}"]
        flat = (a.reshape(a.size) for a in (x, gamma, dgamma, means, cache.precisions, c, dx))
        _rows_kernel(dtype)[grid, block](*flat, B, N, K, d, H)
        n_seg = blocks(N, segment)
        part_mu = cuda.device_array((B, n_seg, K, d), dtype=dtype)
        part_var = cuda.device_array((B, n_seg, K, d), dtype=dtype)
        part_c = cuda.device_array((B, n_seg, K), dtype=dtype)
        grid, block = launches[f"_parameter_partials {side}"]
        _partials_kernel(dtype)[grid, block](x.reshape(x.size), c.reshape(c.size), means, variances, segment, part_mu,
                                             part_var, part_c, B, N, K, d)
        parts.append((part_mu, part_var, part_c))
        dxs.append(dx)
    dmeans = cuda.device_array((H, K, d), dtype=dtype)
    draw = cuda.device_array((H, K, d), dtype=dtype)
    dlogits = cuda.device_array((H, K), dtype=dtype)
    grid, block = launches["_parameter_sums"]
    flat = [a.reshape(a.size) for a in (*parts[0], *parts[1])]
    n_q, n_k = (p[2].shape[1] for p in parts)  # segments of the queries and of the keys
    _parameter_sums[grid, block](*flat, variances, cache.sigmoid_raw, dmeans, draw, dlogits, cache.x_q.shape[0], n_q, n_k)
    lead = cache.leading
    if not cache.per_head:
        dmeans, draw, dlogits = dmeans.reshape(K, d), draw.reshape(K, d), dlogits.reshape(K)
    if cache.packed is None:
        tokens = (result(x.reshape(lead + tuple(x.shape)[1:]), on_device) for x in (dxs[0], dxs[1], dv))
    else:
        tokens = (_packed_layout(x, lead) for x in (dxs[0], dxs[1], dv))
    return GMAGrads(
        *tokens,
        means=result(dmeans, on_device),
        raw_variances=result(draw, on_device),
        logits=result(dlogits, on_device),
    )


#: GMA bound to refimpl's boundary, which writes the signatures, docstrings and checks once.
_KERNELS = {"gma": _gma_kernel, "packed gma": _gma_kernel, "gma_forward": _gma_forward_kernel,
            "packed gma_forward": _gma_forward_kernel, "gma_backward": _gma_backward_kernel}
_public = boundary.bind(backend(_KERNELS), module=__name__)
gma = _public.gma
gma_forward = _public.gma_forward
gma_backward = _public.gma_backward
