r"""Diagonal-GMM responsibilities on the GPU: :func:`refimpl.gmm.log_responsibilities` and :func:`refimpl.gmm.responsibilities`.

What it computes
----------------
For every point ``x_i`` and component ``m`` the log joint

.. math::

    \ell_{im} = \log\pi_m - \tfrac12\sum_j \log(2\pi\sigma^2_{mj})
               - \tfrac12\sum_j (x_{ij}-\mu_{mj})^2/\sigma^2_{mj},

then the responsibilities :math:`\gamma_{im} = \exp(\ell_{im} - \operatorname{logsumexp}_m \ell_{im})`
(or their logarithms), with the row maximum subtracted.  The quadratic form is
evaluated from the differences ``x - mu`` themselves (every term a rounded
square, all >= 0: no cancellation), which is what :mod:`refimpl.gmm`
recomputes wherever its expanded form could be off; so the two agree to
rounding on every input, however far apart the means are.  Nothing of size
``N x K x d`` is formed.

Launch plan
-----------
Two launches per call, whatever ``B``, ``N``, ``K`` and ``d``:

1. :func:`_component_constants`, one thread per component ``(h, m)``: the
   per-component constant ``log pi_m - (1/2)(d log 2 pi + sum_j log sigma2_mj)``,
   and the (mean, half-precision ``1 / (2 sigma2)``) pairs transposed to
   ``(H, d_pad, K_pad, 2)`` so that a tile of components is read along
   contiguous addresses, padded with zeros to whole tiles (:func:`padded`).
2. :func:`_posterior_tiles`, register-tiled like a matrix product: a block of
   ``TY x TX`` threads owns ``TILE_ROWS`` rows of one sequence
   and sweeps its ``K`` components ``TILE_COMPS`` at a time; each thread
   accumulates a ``ROWS_PER_THREAD x COMPS_PER_THREAD`` register tile of half
   quadratic forms from the differences, the coordinates staged ``D_CHUNK`` at
   a time in shared memory (the rows' ``x`` coordinate-major, the components'
   means and half-precisions), laid out so that a thread reads its rows, its
   components' means and their half-precisions by 128-bit loads, the stage's
   coordinates unrolled into straight-line code.  The row softmax is fused into the epilogue: each thread
   writes ``l`` and keeps, per row, an online ``(max, sum of exp(l - max))``
   pair across the component tiles and the smallest half quadratic form; the
   pairs of a row are combined by an ordered tree in shared memory, then each
   thread rereads its own entries and normalises them (a second pass over
   its ``N x K`` entries, no other).  The arrays come flat: row offsets are
   formed once per row, counters are 32-bit.  The epilogue's parts are
   device functions inlined into the kernel (``absorb``, ``combine``,
   ``normalise``, ``log_normalise``; the last, partial stage's product is
   ``stage_tail``, the loop's ``stage`` under another name), so that
   ``benchmarks/gpu_model.py`` counts each as often as it runs
   (:data:`gpu.work.KERNELS`).

The geometry of both launches is a pure function of the shapes and dtype,
:func:`launch_geometry`, inside every hardware limit for any ``B``, ``N`` and
``H``: sequences and row tiles are folded onto grid x (at most
:data:`MAX_GRID_X` blocks; a block loops over tiles when there are more).
The tile sizes are compile-time constants, one build per float type on a GPU
(:data:`GPU_GEOMETRIES`: 4 x 4 register tiles in float32, 2 x 2 in float64,
so that both fit in 64 registers, 50% occupancy), :data:`SIMULATOR_GEOMETRY`
in the simulator; :func:`geometry` runs the GPU's tiles in the simulator, for
tests.

Host copies
-----------
A public call with a device ``x`` or device parameters copies one small
device array to the host, its result-check flag: the per-block counts of
non-finite entries of ``x`` and of ``min_quad``, and for device parameters
the value checks of the reference's checker (means finite, variances finite
and > 0, weights a probability vector: :func:`queue_parameter_checks`),
gathered into one buffer by :class:`~gpu.numba_cuda._device.Checks`.  The
reference's checker reads stand-ins of the device parameters' shapes and
dtypes (:func:`stand_in`), and ``log pi`` is computed on the device.  Only
when a count is not zero is more copied (:func:`parameters_to_host` for the
parameters), so that the reference's own checker words the error.

:func:`posterior_device` is the device-level entry point (no validation) used
by :mod:`gpu.numba_cuda.gma`; the public functions validate with
:mod:`refimpl.validation` and call it with one sequence and one mixture.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numba import boolean, cuda, float32, float64, int64, uint32, uint64

from refimpl import boundary, validation
from refimpl.gmm import LOG_2PI

from ._device import (
    SIMULATOR, Checks, _as_numba, any_device, backend, blocks, host_view, is_device_array, kernel, raise_bad_inputs, result,
    swapped_geometry, to_device, to_host,
)
from . import _primitives
from ._primitives import block_sum

__all__ = ["log_responsibilities", "responsibilities", "launch_geometry", "geometry", "constants", "tile_constants", "padded",
           "parameters_to_host",
           "GPU_GEOMETRY", "GPU_GEOMETRY_F64", "GPU_GEOMETRIES", "SIMULATOR_GEOMETRY", "GEOMETRIES"]

#: The tile geometry of :func:`_posterior_tiles`: a block of ``TY x TX`` threads (``Geometry.threads_y x threads_x``), each owning a
#: ``ROWS_PER_THREAD x COMPS_PER_THREAD`` register tile, so a block tile of ``TILE_ROWS x TILE_COMPS``; the
#: coordinates are staged in shared memory ``D_CHUNK`` at a time.
class Geometry(NamedTuple):
    """Tile sizes of the responsibilities kernel (compile-time constants, by dtype: :data:`GEOMETRIES`)."""

    rows_per_thread: int
    comps_per_thread: int
    threads_x: int  # threads along the components (a power of two)
    threads_y: int  # threads along the rows
    d_chunk: int  # coordinates per shared-memory stage


#: On a GPU, in float32: 16 x 16 threads of 4 x 4 register tiles, 64 x 64 block tiles, 8 coordinates per stage
#: (shared memory: 8 x 68 x-tile entries + 8 x 64 x 2 component entries + 3 x 64 x 16 reduction entries =
#: 18,560 bytes).
GPU_GEOMETRY = Geometry(4, 4, 16, 16, 8)
#: On a GPU, in float64: 16 x 16 threads of 2 x 2 register tiles, 32 x 32 block tiles, 8 coordinates per stage
#: (8 x 34 + 8 x 32 x 2 + 3 x 32 x 16 doubles = 18,560 bytes): four doubles a thread in place of sixteen floats, so
#: that both types fit in 64 registers (:data:`MIN_BLOCKS`).
GPU_GEOMETRY_F64 = Geometry(2, 2, 16, 16, 8)
#: The GPU's tiles by dtype.
GPU_GEOMETRIES = {np.dtype(np.float32): GPU_GEOMETRY, np.dtype(np.float64): GPU_GEOMETRY_F64}
#: In the simulator (every thread a Python thread): 2 x 4 threads of 2 x 4 register tiles, 4 x 16 block tiles,
#: 2 coordinates a stage, in both types.
SIMULATOR_GEOMETRY = Geometry(2, 4, 4, 2, 2)
#: The tiles the launches use, by dtype (:func:`geometry` switches them in the simulator).
GEOMETRIES = {dt: SIMULATOR_GEOMETRY for dt in GPU_GEOMETRIES} if SIMULATOR else dict(GPU_GEOMETRIES)

#: Largest grid x of a launch (sequences and row tiles are folded onto it; blocks loop when there are more tiles).
MAX_GRID_X = 2**31 - 1


def tile_constants(g: Geometry) -> dict:
    """The constants :func:`_posterior_tiles` is compiled with for the geometry ``g``: ``{"RM": ..., "TILE_ROWS": ...}``.

    ``RM, RK, TX, TY, DC`` (the fields of ``g``), ``TILE_ROWS = TY RM``,
    ``TILE_COMPS = TX RK``, ``NT = TX TY`` threads, ``XS = TILE_ROWS + RM``
    (the padded row of the staged x tile), the shared array sizes ``SH_X``
    ``[DC, XS]``, ``SH_C`` ``[DC, 2, TILE_COMPS]``, ``SH_RED``
    ``[TILE_ROWS, TX]``, ``LOADS_X``, ``LOADS_C``, the entries of x and the
    components of each staged tile a thread loads, and ``UNROLL``, the
    coordinates of a stage per step of its unrolled loop.
    """
    rm, rk, tx, ty, dc = g
    if tx & (tx - 1) or tx < 1:
        raise ValueError("Geometry: threads_x must be a power of two")
    nt = tx * ty
    if (ty * rm * dc) % nt or (dc * tx * rk) % nt:
        raise ValueError("Geometry: the shared tiles must be a multiple of the block's threads")
    tile_rows, tile_comps = ty * rm, tx * rk
    loads_x, loads_c = tile_rows * dc // nt, dc * tile_comps // nt
    if dc % loads_x or tx % loads_c:
        raise ValueError("Geometry: a thread's staged entries must lie in one row of x and one run of threads_x "
                         "components")
    return dict(RM=rm, RK=rk, TX=tx, TY=ty, DC=dc, TILE_ROWS=tile_rows, TILE_COMPS=tile_comps, NT=nt, XS=tile_rows + rm,
                SH_X=dc * (tile_rows + rm), SH_C=2 * dc * tile_comps, SH_RED=tile_rows * tx, LOADS_X=loads_x,
                LOADS_C=loads_c, UNROLL=math.gcd(dc, 8))


def constants(dtype) -> dict:
    """:func:`tile_constants` of the geometry the launches use for ``dtype`` (:data:`GEOMETRIES`)."""
    return tile_constants(GEOMETRIES[np.dtype(dtype)])


def padded(K, d, dtype) -> tuple:
    """``(d_pad, K_pad)``: ``d`` and ``K`` rounded up to whole stages and component tiles of ``dtype``'s geometry.

    The shape, past ``H``, of the (mean, half-precision) pairs
    :func:`_component_constants` writes for :func:`_posterior_tiles`
    (``[H, d_pad, K_pad, 2]``, zeros in the padding); at least one stage
    when ``d = 0``.
    """
    c = constants(dtype)
    return blocks(d, c["DC"]) * c["DC"], blocks(K, c["TILE_COMPS"]) * c["TILE_COMPS"]  # blocks: at least 1


#: The unsigned 32-bit conversion of the kernels' shared and register offsets (``numba.uint32``); in the simulator a
#: plain ``int``, the same value, since calling a Numba type from Python costs microseconds per offset there.
u32 = int if SIMULATOR else uint32
#: The unsigned 64-bit conversion of the kernels' offsets into the arrays (``numba.uint64``; a plain ``int`` in the simulator).
u64 = int if SIMULATOR else uint64


def device_function(fn):
    """The device function ``fn`` of :mod:`~gpu.numba_cuda._primitives` as a kernel calls it in an inner loop.

    On a GPU ``fn`` itself; in the simulator its Python function (for a
    function that does not use ``cuda``), since a simulated device function
    swaps the ``cuda`` module into its globals at every call (about 10 us,
    paid per entry in an inner loop).
    """
    return fn.py_func if SIMULATOR else fn


exp_shifted, max_keep_nan, softmax_combine = (device_function(getattr(_primitives, n)) for n in ("exp_shifted", "max_keep_nan", "softmax_combine"))


@contextmanager
def geometry(g):
    """Run :func:`posterior_device` with the tile geometry ``g`` (a :class:`Geometry`, or a dict by dtype): the simulator only."""
    with swapped_geometry(GEOMETRIES, g, tile_constants, "gpu.numba_cuda.gmm.geometry"):
        yield

#: Threads per block of :func:`_component_constants`.
THREADS = 32 if SIMULATOR else 128


# log_norm = log_weights - 0.5 * (d * LOG_2PI + np.sum(np.log(variances), axis=1)) and precisions = 1.0 / variances
# (refimpl.gmm._expansion), here with the precisions halved: half_prec = 1 / (2 sigma^2), exactly half of 1 / sigma^2.
# One thread per component (h, m) of the padded K_pad over a 1-D grid (striding by the grid when H K_pad exceeds it);
# it loops over the d_pad coordinates and writes (mean, half-precision) pairs transposed, [H, d_pad, K_pad, 2], so that
# a tile of components (neighbouring m) is read along contiguous addresses, a pair in neighbouring entries; zeros past
# K and d (whole tiles of _posterior_tiles: a zero difference times a zero half-precision adds nothing, and it tests
# nothing).
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, ::1], f[:, :, :, ::1], f[:, ::1]), threads=lambda f: THREADS)
def _component_constants(means, variances, log_weights, comps_t, log_norm):
    f = means.dtype.type
    H, K, d = means.shape
    d_pad, k_pad = comps_t.shape[1], comps_t.shape[2]
    half = f(0.5)
    zero = f(0.0)
    for c in range(cuda.grid(1), H * k_pad, cuda.gridsize(1)):
        h = c // k_pad
        m = c - h * k_pad
        if m < K:
            log_det = f(0.0)
            for j in range(d):
                s2 = variances[h, m, j]
                # log of a variance <= 0 (refused by the call's checks, read after the launches): -inf or NaN, as on a
                # GPU (the simulator's math.log would raise)
                log_det += math.log(s2) if s2 > 0 else (f(-math.inf) if s2 == 0 else f(math.nan))
                comps_t[h, j, m, 0] = means[h, m, j]
                comps_t[h, j, m, 1] = half / s2
            log_norm[h, m] = log_weights[h, m] - half * (f(d * LOG_2PI) + log_det)
            for j in range(d, d_pad):
                comps_t[h, j, m, 0] = zero
                comps_t[h, j, m, 1] = zero
        else:
            for j in range(d_pad):
                comps_t[h, j, m, 0] = zero
                comps_t[h, j, m, 1] = zero


#: Resident blocks per multiprocessor that ptxas must allow for :func:`_posterior_tiles` on a GPU (its launch bounds,
#: with TX x TY threads per block): 4 in both types, at most 64 registers (32 of the 64 warps of an sm_90, 50%
#: occupancy).  ptxas -v (sm_90, CUDA 13): 64 registers and no spills in float32 (4 x 4 tiles) and in float64 (2 x 2
#: tiles); with one block, 106 and 118.  A 4 x 4 tile of doubles held to 64 registers spills.
MIN_BLOCKS = {np.dtype(np.float32): 4, np.dtype(np.float64): 4}


# l_ik = log_norm_k - q_ik / 2 with q_ik = sum_j (x_ij - mu_kj)^2 p_kj from the differences (refimpl.gmm._exact_quadratic_form),
# then softmax(a) = softmax(a - m) per row (refimpl.numerics.softmax / log_softmax), min_quad = min_k q_ik.
# The arrays come flat (C order) with their shapes, as in a GEMM: the offset of a row of gamma is formed once per row,
# the shared offsets of the inner loop are one register plus constants; offsets within a row and counters are unsigned
# 32-bit (K, d < 2^31, checked by posterior_device), offsets into the arrays unsigned 64-bit (no negative-index wraparound).
# Work: the rows of sequence b (mixture h = b % H) in tiles of TILE_ROWS, the tiles of every sequence folded onto
# grid x (block x loops over tiles x, x + gridDim.x, ...); a block of TY x TX threads sweeps the K components in tiles
# of TILE_COMPS. Thread (ty, tx) owns the RM x RK register tile of rows ty RM + a (contiguous) and components tx + c TX
# (a < RM, c < RK): neighbouring tx write neighbouring k of gamma, each store of a warp two runs of TX entries (a
# thread's RK components contiguous in gamma, tx RK + c, would spread each store over RK times the sectors; the
# permuted slots of sh_c below make them contiguous in shared memory instead).
# Shared memory, per stage of DC coordinates (16-byte aligned arrays):
# - x coordinate-major, [DC, XS] with XS = TILE_ROWS + RM (zeros past d): a thread's RM rows are RM contiguous entries,
#   one 128-bit load (RM = 4 floats, 2 doubles); the padding keeps rows 16-byte aligned and spreads a warp's stores
#   (consecutive threads on consecutive coordinates of a row, coalesced in x) over 32 banks in float32. A staged row
#   past the sequence repeats its last row (its entries are never written).
# - the components' means and half-precisions, [DC, 2, TILE_COMPS slots] (a plane of means, then one of half-
#   precisions, per coordinate), component kk in slot (kk % TX) RK + kk // TX: thread tx's RK components are RK
#   contiguous slots, one 128-bit load a plane (RK = 4 floats, 2 doubles), and the 8 threads of a quarter warp read
#   8 consecutive 16-byte chunks (no bank conflict; the two ty of a warp read the same ones: a broadcast). Staged from
#   the padded pairs [H, d_pad, K_pad, 2] (zeros past K and d: a zero difference times a zero half-precision adds
#   nothing, so no test), consecutive threads on consecutive pairs (coalesced); the permuted slots cost a 2-way bank
#   conflict on those stores, LOADS_C pairs a thread a stage, against the 3 DC conflict-free loads of the product.
# Per step j a thread reads RM + 2 RK shared entries in (RM + 2 RK) / V 128-bit loads (V = 4 floats, 2 doubles) for
# RM RK (sub, mul, fma): the register tile of a product, from the differences; the DC steps of a stage are
# straight-line code (the steps are device functions inlined UNROLL at a time, UNROLL = gcd(DC, 8)), their shared
# offsets constants.  The stages below d run in a loop whose x loads have no bound test (floor(d / DC) of them), then the
# last, partial stage (if d is not a multiple of DC) in code of its own that tests each coordinate against d: the loop
# sm_90 runs floor(d / DC) times is 6 global loads, 6 shared stores, 2 barriers and 13 other instructions besides the
# product's 384 fp and 24 LDS.128 (float32; 435 instructions for 512 FLOPs).
# Epilogue of each component tile: l = log_norm - q/2 written to gamma, and per row the running pair (m, s) of
# _primitives, s = sum exp(l - m), rescaled by exp_shifted(m_old, m_new) (0 while the row is all -inf), and min q/2
# (NaN, once met, stays, in both).
# Then the TX lanes of each row combine their pairs by an ordered tree in shared memory [TILE_ROWS rows, TX lanes]
# (softmax_combine; three arrays: m, s, min q/2), and every thread rereads its own entries: exp(l - M) * (1 / S), or
# (l - M) - log S.
def _tiles_signature(f):
    # x, comps_t, log_norm flat (C order), log, gamma, min_quad flat; then B, N, K, d, H
    return (f[::1], f[::1], f[::1], boolean, f[::1], f[::1], int64, int64, int64, int64, int64)


def _build_posterior_tiles(g: Geometry, f=None):
    """:func:`_posterior_tiles` compiled for the tiles ``g`` (:func:`tile_constants`: compile-time constants).

    On a GPU (``f`` the Numba float type the tiles are for) it is registered
    for ``f`` alone (``gmm._posterior_tiles[float32]``, ``[float64]``), with
    the launch bounds of :data:`MIN_BLOCKS`, so that the PTX and resource
    checks compile what runs; in the simulator (``f`` None) for both types,
    without bounds.
    """
    c = tile_constants(g)
    RM, RK, TX, TY, DC = c["RM"], c["RK"], c["TX"], c["TY"], c["DC"]
    TILE_ROWS, TILE_COMPS, NT, XS = c["TILE_ROWS"], c["TILE_COMPS"], c["NT"], c["XS"]
    SH_X, SH_C, SH_RED, LOADS_X, LOADS_C = c["SH_X"], c["SH_C"], c["SH_RED"], c["LOADS_X"], c["LOADS_C"]
    UNROLL = c["UNROLL"]
    X_LANES = DC // LOADS_X  # threads per row of the staged x tile
    C_LANES = TILE_COMPS // LOADS_C  # threads per coordinate of the staged component tile
    # 16-byte shared arrays, so that a thread's RM rows, RK means and RK half-precisions are read by 128-bit loads in
    # the PTX (ld.shared.v4.f32, v2.f64; ptxas 13 also merges the scalar loads of unaligned arrays); the simulator
    # refuses an alignment
    ALIGN = None if f is None else 16
    options = None if f is None else {"launch_bounds": (NT, MIN_BLOCKS[np.dtype(str(f))])}
    dtypes = None if f is None else (f,)

    device = _primitives.inliner(f is None)  # the kernel's pieces, inlined into it on a GPU

    # one coordinate of a stage: q[a, c] += (x_a - mu_c)^2 hp_c, the thread's entries at xa in sh_x and ca in sh_c
    def step(regs, sh_x, sh_c, xa, ca):
        q, xr, mr, hr = regs
        for a in range(RM):
            xr[a] = sh_x[xa + u64(a)]
        for c in range(RK):
            mr[c] = sh_c[ca + u64(c)]
            hr[c] = sh_c[ca + u64(TILE_COMPS + c)]
        for a in range(RM):
            for c in range(RK):
                diff = xr[a] - mr[c]
                q[a, c] += diff * diff * hr[c]

    # UNROLL consecutive coordinates, written out (the compiler does not unroll a loop of eight such steps)
    steps = _primitives.unrolled(device(step), UNROLL, XS, 2 * TILE_COMPS, device)

    # the DC coordinates of a stage, UNROLL at a time (one call when DC = UNROLL: straight-line code)
    def stage(q, xr, mr, hr, sh_x, sh_c, x_at, c_at):
        xa = x_at
        ca = c_at
        for _ in range(DC // UNROLL):
            steps((q, xr, mr, hr), sh_x, sh_c, xa, ca)
            xa += u64(UNROLL * XS)
            ca += u64(UNROLL * 2 * TILE_COMPS)

    stage = device(stage)

    # this thread's entries of a stage into shared memory: x[x_src + u] (u < LOADS_X; in the last stage, TAIL, zero
    # from coordinate d_in of the stage on, past d) and the component pairs at c_src (padded with zeros to whole tiles:
    # no test)
    def loads(tail):
        def load(x, comps_t, sh_x, sh_c, x_src, c_src, x_slot, c_slot, x_col, d_in, zero):
            for u in range(LOADS_X):
                v = zero
                if not tail or u32(x_col + u32(u)) < d_in:
                    v = x[x_src + u64(u)]
                sh_x[u32(x_slot + u32(u * XS))] = v
            for u in range(LOADS_C):
                sh_c[u32(c_slot + u32(u * RK))] = comps_t[c_src + u64(2 * u)]
                sh_c[u32(c_slot + u32(u * RK + TILE_COMPS))] = comps_t[c_src + u64(2 * u + 1)]

        return device(load)

    load_full, load_tail = loads(False), loads(True)
    # the last, partial stage's product under a name of its own: the same function, a call the model counts apart
    # (benchmarks/gpu_model.py: it runs only where d is not a multiple of DC)
    stage_tail = stage

    # the epilogue of a component tile for the thread's RM rows: l = log_norm - q/2 written to gamma, min q/2, and the
    # running pair (m, s) absorbing the tile's entries
    # Components past K (the padding of the last tile) take l = -inf, which moves neither the maximum nor the sum
    # (e^-inf = 0 is added, exactly), and are neither written nor compared: no branch per entry, and the entries
    # inside K see the same arithmetic in the same order.  log_norm is read once per component, for the RM rows.
    def absorb(q, red_m, red_s, red_q, log_norm, gamma, xo, tx, k0, K32, ln_at, g_row, K64, rows_in):
        f = q.dtype.type
        lnr = cuda.local.array(RK, dtype=q.dtype)
        for c in range(RK):
            kk = u32(tx + u32(c * TX))
            lnr[c] = f(-math.inf)
            if u32(k0 + kk) < K32:
                lnr[c] = log_norm[ln_at + kk]
        for a in range(RM):
            r = u32(xo + u32(a))
            slot = u32(r * u32(TX) + tx)
            go = g_row + (u64(a) * K64 + k0)  # gamma entry (row r, component k0)
            row_in = r < rows_in
            m_old = red_m[slot]
            tile_m = m_old
            min_q = red_q[slot]
            for c in range(RK):
                kk = u32(tx + u32(c * TX))
                inside = u32(k0 + kk) < K32
                hq = q[a, c]
                if inside and (hq < min_q or hq != hq):
                    min_q = hq
                lk = lnr[c] - hq if inside else lnr[c]
                q[a, c] = lk
                tile_m = max_keep_nan(tile_m, lk)  # NaN, once met, stays (and makes the row's sum NaN)
                if row_in and inside:
                    gamma[go + kk] = lk
            red_q[slot] = min_q
            # (m, s) absorbs the tile's entries: s' = e^{m - m'} s + sum_c e^{l_c - m'}
            s = exp_shifted(m_old, tile_m) * red_s[slot]
            for c in range(RK):
                s += exp_shifted(q[a, c], tile_m)
            red_s[slot] = s
            red_m[slot] = tile_m

    absorb = device(absorb)

    # one step of the ordered tree: lane tx of each of the thread's rows takes in lane tx + stride
    def combine(red_m, red_s, red_q, xo, tx, stride):
        for a in range(RM):
            r = u32(u32(xo + u32(a)) * u32(TX) + tx)
            m_new, s_new = softmax_combine(red_m[r], red_s[r], red_m[r + stride], red_s[r + stride])
            red_m[r] = m_new
            red_s[r] = s_new
            q_b = red_q[r + stride]
            if q_b < red_q[r] or q_b != q_b:
                red_q[r] = q_b

    combine = device(combine)

    # one entry of a row of gamma normalised: exp(l - M) * (1 / S), or (l - M) - log S
    def normalise(gamma, at, big_m, inv_s):
        gamma[at] = math.exp(gamma[at] - big_m) * inv_s

    def log_normalise(gamma, at, big_m, log_s):
        gamma[at] = (gamma[at] - big_m) - log_s

    normalise, log_normalise = device(normalise), device(log_normalise)

    @kernel(_tiles_signature, threads=NT, tags=("responsibilities",), options=options, dtypes=dtypes)
    def _posterior_tiles(x, comps_t, log_norm, log, gamma, min_quad, B, N, K, d, H):
        f = x.dtype.type
        sh_x = cuda.shared.array(SH_X, dtype=x.dtype, alignment=ALIGN)  # [DC coordinates, XS]: TILE_ROWS rows, padded
        sh_c = cuda.shared.array(SH_C, dtype=x.dtype, alignment=ALIGN)  # [DC coordinates, 2, TILE_COMPS slots]
        red_m = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
        red_s = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
        red_q = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
        q = cuda.local.array((RM, RK), dtype=x.dtype)  # the register tile: q/2, then l
        xr = cuda.local.array(RM, dtype=x.dtype)
        mr = cuda.local.array(RK, dtype=x.dtype)
        hr = cuda.local.array(RK, dtype=x.dtype)
        K32 = u32(K)
        d32 = u32(d)
        K64 = u64(K)
        d64 = u64(d)
        # the padded component arrays [H, d_pad, K_pad, 2] (posterior_device)
        k_tiles = (K + TILE_COMPS - 1) // TILE_COMPS
        k_pad = u64(k_tiles * TILE_COMPS)
        d_pad = u64(max(1, (d + DC - 1) // DC) * DC)
        # shared and register offsets are unsigned 32-bit: below the shared arrays' sizes (a few thousand), and unsigned
        # indices skip Numba's negative-index wraparound
        tx = u32(cuda.threadIdx.x)
        ty = u32(cuda.threadIdx.y)
        tid = u32(ty * u32(TX) + tx)
        xo = u32(ty * u32(RM))  # the thread's rows: xo, ..., xo + RM - 1
        # the thread's first entries in a coordinate of sh_x and sh_c (64-bit: the unrolled steps' offsets fold into the
        # loads as constants, one register each)
        x_at = u64(xo)
        c_at = u64(u32(tx * u32(RK)))
        # the entries this thread stages: the LOADS_X coordinates x_col, x_col + 1, ... of row x_row of x; the LOADS_C
        # components c_comp, c_comp + 1, ... of coordinate c_coord of the component pairs (consecutive threads on
        # consecutive addresses)
        x_row = u32(tid // u32(X_LANES))
        x_col = u32(u32(tid - x_row * u32(X_LANES)) * u32(LOADS_X))
        c_coord = u32(tid // u32(C_LANES))
        c_comp = u32(u32(tid - c_coord * u32(C_LANES)) * u32(LOADS_C))
        x_slot = u32(x_col * u32(XS) + x_row)  # in sh_x of its first x entry
        # in sh_c of its first component's mean (its half-precision TILE_COMPS on): component kk of the tile goes to slot
        # (kk % TX) RK + kk // TX, so that thread tx's components tx + c TX (c < RK) are contiguous; its next ones follow
        # RK slots apart (TX a multiple of LOADS_C)
        c_slot = u32(c_coord * u32(2 * TILE_COMPS) + u32(c_comp % u32(TX)) * u32(RK) + c_comp // u32(TX))
        neg_inf = f(-math.inf)
        zero = f(0.0)
        one = f(1.0)
        tiles_n = (N + TILE_ROWS - 1) // TILE_ROWS
        for tile in range(cuda.blockIdx.x, B * tiles_n, cuda.gridDim.x):
            b = tile // tiles_n
            i0 = (tile - b * tiles_n) * TILE_ROWS
            h = b % H
            row0 = b * N + i0  # the tile's first row among the B N rows
            rows_in = u32(min(N - i0, TILE_ROWS))  # rows of the tile inside the sequence (>= 1)
            # a staged row past the sequence reads its last row instead (its entries are never written)
            x_src = u64(row0 + min(x_row, u32(rows_in - u32(1)))) * d64 + x_col
            g_row = u64(row0 + xo) * K64  # offset in gamma of the thread's first row
            # the thread's running (max of l, sum of exp(l - max), min of q/2) per row, in its own slot of the row's lanes
            for a in range(RM):
                r = u32(u32(xo + u32(a)) * u32(TX) + tx)
                red_m[r] = neg_inf
                red_s[r] = zero
                red_q[r] = f(math.inf)
            for kt in range(k_tiles):
                k0 = u32(kt * TILE_COMPS)
                for a in range(RM):
                    for c in range(RK):
                        q[a, c] = zero
                # (h, c_coord, k0 + c_comp, 0) in comps_t
                c_src = u64(2) * ((u64(h) * d_pad + c_coord) * k_pad + u32(k0 + c_comp))
                # the full stages j0 = 0, DC, ... while j0 + DC <= d (no test), then the partial one, if any (none when
                # d = 0: q stays 0, and the epilogue below touches only the thread's own lanes until its barrier)
                j0 = u32(0)
                while u32(j0 + u32(DC)) <= d32:
                    load_full(x, comps_t, sh_x, sh_c, x_src, c_src, x_slot, c_slot, x_col, d32, zero)
                    cuda.syncthreads()
                    stage(q, xr, mr, hr, sh_x, sh_c, x_at, c_at)
                    cuda.syncthreads()
                    x_src += u64(DC)
                    c_src += u64(2 * DC) * k_pad
                    j0 = u32(j0 + u32(DC))
                if j0 < d32:
                    load_tail(x, comps_t, sh_x, sh_c, x_src, c_src, x_slot, c_slot, x_col, u32(d32 - j0), zero)
                    cuda.syncthreads()
                    stage_tail(q, xr, mr, hr, sh_x, sh_c, x_at, c_at)
                    cuda.syncthreads()
                x_src -= u64(j0)  # back to coordinate 0 for the next component tile
                ln_at = u64(h) * K64 + k0  # log_norm of the tile's first component
                absorb(q, red_m, red_s, red_q, log_norm, gamma, xo, tx, k0, K32, ln_at, g_row, K64, rows_in)
            cuda.syncthreads()
            stride = u32(TX // 2)
            while stride > 0:
                if tx < stride:
                    combine(red_m, red_s, red_q, xo, tx, stride)
                cuda.syncthreads()
                stride = u32(stride // u32(2))
            for a in range(RM):
                r = u32(xo + u32(a))
                if i0 + r < N:
                    lane0 = u32(r * u32(TX))
                    big_m = red_m[lane0]
                    big_s = red_s[lane0]
                    go = u64(row0 + r) * K64
                    if tx == 0:
                        min_quad[u64(row0 + r)] = f(2.0) * red_q[lane0]
                    k = tx
                    if log:
                        log_s = neg_inf  # log 0 = -inf (a row of -inf logits), as on the device; math.log(0) would raise in the simulator
                        if big_s != zero:
                            log_s = math.log(big_s)
                        while k < K32:
                            log_normalise(gamma, go + k, big_m, log_s)
                            k = u32(k + u32(TX))
                    else:
                        inv_s = one / big_s
                        while k < K32:
                            normalise(gamma, go + k, big_m, inv_s)
                            k = u32(k + u32(TX))
            cuda.syncthreads()  # every thread has read the row's (M, S) before the next tile resets its lanes

    return _posterior_tiles


#: The builds of :func:`_posterior_tiles`: by dtype on a GPU, by geometry in the simulator.
if SIMULATOR:
    _TILES = {SIMULATOR_GEOMETRY: _build_posterior_tiles(SIMULATOR_GEOMETRY)}
else:
    _TILES = {np.dtype(str(f)): _build_posterior_tiles(GPU_GEOMETRIES[np.dtype(str(f))], f) for f in (float32, float64)}


def _tiles_kernel(dtype):
    """:func:`_posterior_tiles` for ``dtype``: on a GPU its build (its tiles, its launch bounds); in the simulator the
    build for the geometry of :data:`GEOMETRIES` (made at the first launch with it)."""
    dtype = np.dtype(dtype)
    if not SIMULATOR:
        return _TILES[dtype]
    g = GEOMETRIES[dtype]
    if g not in _TILES:
        _TILES[g] = _build_posterior_tiles(g)
    return _TILES[g]


def launch_geometry(B, N, K, d, H=1, dtype=np.float64):
    """The launches of :func:`posterior_device`: ``{kernel name: (grid, block)}``, a pure function of the shapes and dtype.

    Every grid is 1-D and at most :data:`MAX_GRID_X` blocks (the kernels loop
    over their tiles or entries when there are more); the blocks have
    ``TX x TY`` (or :data:`THREADS`) threads, with the tiles of ``dtype``
    (:data:`GEOMETRIES`).

    Parameters
    ----------
    B, N, K, d, H : int
        Sequences, points per sequence, components, coordinates, mixtures.
    dtype : dtype, default float64
        The float type of the call.
    """
    c = constants(dtype)
    tiles = int(B) * blocks(N, c["TILE_ROWS"])
    return {
        "_component_constants": (min(blocks(int(H) * padded(K, d, dtype)[1], THREADS), MAX_GRID_X), THREADS),
        "_posterior_tiles": (max(1, min(tiles, MAX_GRID_X)), (c["TX"], c["TY"])),
    }


def posterior_device(x, means, variances, log_weights, *, log=False):
    """Core: the responsibilities of ``B`` sequences under ``H`` mixtures, on the device; no validation of the values.

    Parameters
    ----------
    x : device array, shape (B, N, d)
        ``B`` sequences of ``N`` points.
    means, variances : device arrays, shape (H, K, d)
        ``H`` diagonal mixtures (variances > 0); sequence ``b`` uses mixture ``b % H``
        (``H`` divides ``B``; ``H = 1``: one shared mixture).
    log_weights : device array, shape (H, K)
        ``log pi``; ``-inf`` for a component of weight 0.
    log : bool, default False
        Return ``log gamma`` instead of ``gamma``.

    All arrays C-contiguous, of one float dtype.

    Returns
    -------
    gamma : device array, shape (B, N, K)
        Rows that sum to one (log responsibilities with ``log=True``).
    min_quad : device array, shape (B, N)
        ``min_k sum_j (x_ij - mu_kj)^2 / sigma_kj^2``: not finite for a row
        without a representable posterior; the caller checks it
        (:func:`refimpl.validation.check_scaled_distances`).
    """
    B, N, d = x.shape
    H, K, _ = means.shape
    dtype = x.dtype
    gamma = cuda.device_array((B, N, K), dtype=dtype)
    min_quad = cuda.device_array((B, N), dtype=dtype)
    if B * N == 0 or K == 0:
        return gamma, min_quad
    if max(K, d) >= 2**31:  # the 32-bit counters of _posterior_tiles
        raise ValueError(f"posterior_device: K and d must be below 2^31, got K = {K}, d = {d}")
    comps_t = cuda.device_array((H,) + padded(K, d, dtype) + (2,), dtype=dtype)
    log_norm = cuda.device_array((H, K), dtype=dtype)
    launches = launch_geometry(B, N, K, d, H, dtype)
    grid, block = launches["_component_constants"]
    _component_constants[grid, block](means, variances, log_weights, comps_t, log_norm)
    grid, block = launches["_posterior_tiles"]
    flat = [a.reshape(a.size) for a in (x, comps_t, log_norm)]
    _tiles_kernel(dtype)[grid, block](*flat, bool(log), gamma.reshape(gamma.size), min_quad.reshape(min_quad.size), B, N, K, d, H)
    return gamma, min_quad


def parameters_to_host(*arrays):
    """Host copies of small arrays (the GMM's parameters, for the reference's checks): the device ones in one copy.

    The device arrays among ``arrays`` are gathered into one device buffer
    (device to device) and that buffer is copied to the host once; host
    arrays are returned unchanged.  Device arrays of different dtypes, or not
    C-contiguous, are copied one by one.
    """
    out = list(arrays)
    dev = [n for n, a in enumerate(arrays) if is_device_array(a)]
    if not dev:
        return out
    parts = [_as_numba(arrays[n]) for n in dev]
    if len({p.dtype for p in parts}) != 1 or not all(p.is_c_contiguous() for p in parts):
        return [to_host(a) for a in arrays]
    total = sum(p.size for p in parts)
    host = np.empty(0, dtype=parts[0].dtype)
    if total:
        buf = cuda.device_array(total, dtype=parts[0].dtype)
        o = 0
        for part in parts:
            if part.size:
                buf[o : o + part.size].copy_to_device(part.reshape(part.size))
            o += part.size
        host = buf.copy_to_host()
    o = 0
    for n, part in zip(dev, parts):
        out[n] = host[o : o + part.size].reshape(part.shape).copy()
        o += part.size
    return out


# ---------------------------------------------------------------------------
# Device GMM parameters: refimpl's value checks on the device, in the call's one result-check flag
# ---------------------------------------------------------------------------


# counts[block] = number of entries of x[block T : (block + 1) T] that are not finite or not > 0 (the finiteness of
# refimpl.validation.as_float_array and check_positive); thread t owns one entry, the block adds its flags by a tree
# (block_sum: the same order on every run, no atomics).
@kernel(lambda f: (f[::1], f[::1]), threads=lambda f: THREADS)
def _count_not_positive(x, counts):
    flags = cuda.shared.array(THREADS, dtype=x.dtype)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    flags[t] = x.dtype.type(0.0)
    if i < x.shape[0]:
        v = x[i]
        if not (v > 0 and v < math.inf):  # NaN fails both comparisons, +inf the second
            flags[t] = x.dtype.type(1.0)
    cuda.syncthreads()
    total = block_sum(flags, cuda.blockDim.x, t)
    if t == 0:
        counts[cuda.blockIdx.x] = total


# flags[h] = 1 when row h of w is not a probability vector (refimpl.validation.check_probability_vector, with the
# finiteness of as_float_array): an entry not finite or < 0, or |sum_m w_hm - 1| > atol / 2, the sum in float64.  Half
# the tolerance: the device only screens, and a row near the bound is checked again by refimpl on the host, which decides.
# One thread per row.
@kernel(lambda f: (f[:, ::1], float64, f[::1]), threads=lambda f: THREADS)
def _probability_flags(w, atol, flags):
    H, K = w.shape
    for h in range(cuda.grid(1), H, cuda.gridsize(1)):
        bad = False
        total = float64(0.0)
        for m in range(K):
            v = w[h, m]
            if not (v >= 0 and v < math.inf):
                bad = True
            total += float64(v)
        if abs(total - float64(1.0)) > float64(0.5) * atol:
            bad = True
        flags[h] = w.dtype.type(1.0) if bad else w.dtype.type(0.0)


# log pi = log(w) (refimpl.gmm: a zero weight is a component that never wins, log 0 = -inf), elementwise; NaN for a
# negative weight (refused by the checks of the same call).
@kernel(lambda f: (f[::1], f[::1]), threads=lambda f: THREADS)
def _log_weights(w, out):
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        v = w[i]
        if v > 0:
            out[i] = math.log(v)
        elif v == 0:
            out[i] = w.dtype.type(-math.inf)
        else:
            out[i] = w.dtype.type(math.nan)


def queue_parameter_checks(checks, finite=(), positive=(), probability=()):
    """Queue in ``checks`` the value checks refimpl's checkers make of the device arrays among the parameters.

    ``finite``, ``positive`` and ``probability`` are ``(array, name)`` pairs:
    entries finite (:func:`refimpl.validation.as_float_array`), finite and
    > 0 (:func:`~refimpl.validation.check_positive`), rows of a probability
    vector (:func:`~refimpl.validation.check_probability_vector`, the last
    axis).  Host arrays are skipped (refimpl's checker has read them).  The
    counts join the call's other checks, copied to the host once
    (:meth:`~gpu.numba_cuda._device.Checks.fetch`).

    Returns
    -------
    list of str
        The names of the checks queued: when one fails
        (:meth:`~gpu.numba_cuda._device.Checks.failed`), the caller copies
        the parameters to the host and calls refimpl's checker, which words
        the error.
    """
    names = []
    for a, name in finite:
        if is_device_array(a) and _as_numba(a).size:
            checks.finite(to_device(a, checks.dtype), name)
            names.append(name)
    for a, name in positive:
        if is_device_array(a) and _as_numba(a).size:
            flat = to_device(a, checks.dtype).reshape(_as_numba(a).size)
            n_blocks = blocks(flat.size, THREADS)
            counts = cuda.device_array(n_blocks, dtype=checks.dtype)
            _count_not_positive[n_blocks, THREADS](flat, counts)
            checks.rows(counts, name)
            names.append(name)
    for a, name in probability:
        if is_device_array(a) and _as_numba(a).size:
            w = _as_numba(a)
            K = tuple(w.shape)[-1]
            # the tolerance of check_probability_vector for a row of w's own dtype
            atol = float(np.sqrt(np.finfo(w.dtype).eps)) * max(1, K)
            rows = to_device(w, checks.dtype).reshape(w.size // K, K)
            flags = cuda.device_array(rows.shape[0], dtype=checks.dtype)
            _probability_flags[min(blocks(rows.shape[0], THREADS), MAX_GRID_X), THREADS](rows, atol, flags)
            checks.rows(flags, name)
            names.append(name)
    return names


def log_weights_device(weights, dtype):
    """``log(weights)`` of a device array on the device (:func:`_log_weights`), of its shape."""
    w = to_device(weights, dtype)
    out = cuda.device_array(w.shape, dtype=dtype)
    if w.size:
        _log_weights[min(blocks(w.size, THREADS), MAX_GRID_X), THREADS](w.reshape(w.size), out.reshape(w.size))
    return out


def _posterior_kernel(xp, checked, given, log):
    """The responsibilities (or their logs) of refimpl's checked arguments: :func:`posterior_device` with ``B = H = 1``.

    Every value check of a device array (``x``'s finiteness, the
    parameters', ``min_quad``) is counted on the device and copied to the
    host once (:class:`~gpu.numba_cuda._device.Checks`); only a failing one
    copies more, to word refimpl's error.
    """
    _, hm, hv, hw = checked
    x, means, variances, weights = given
    on_device = any_device(x, means, variances, weights)
    dtype = hm.dtype
    x_in = x
    x = to_device(x, dtype)
    checks = Checks(dtype)
    if is_device_array(x_in):
        checks.finite(x, "x")
    params = queue_parameter_checks(checks, finite=((means, "means"),), positive=((variances, "variances"),),
                                    probability=((weights, "weights"),))
    N, d = x.shape
    K = hm.shape[0]
    m, var = (to_device(a if is_device_array(a) else h, dtype) for a, h in ((means, hm), (variances, hv)))
    if is_device_array(weights):
        lw = log_weights_device(weights, dtype)
    else:
        # a zero weight is a component that never wins: log 0 = -inf
        with np.errstate(divide="ignore"):
            lw = to_device(np.log(hw), dtype)
    gamma, min_quad = posterior_device(x.reshape(1, N, d), m.reshape(1, K, d), var.reshape(1, K, d), lw.reshape(1, K), log=log)
    checks.finite(min_quad, "min_quad")
    raise_bad_inputs(checks.fetch(), ((x_in, "x"),))
    if any(checks.failed(name) for name in params):
        validation.check_gmm(host_view(x_in), *parameters_to_host(means, variances, weights))
    if checks.failed("min_quad"):
        validation.check_scaled_distances(min_quad.copy_to_host()[0], "x")
    return result(gamma.reshape(N, K), on_device)


#: The responsibilities bound to refimpl's boundary, which writes their signature, docstring and checks once.
_public = boundary.bind(backend({"posterior": _posterior_kernel}), module=__name__)
log_responsibilities = _public.log_responsibilities
responsibilities = _public.responsibilities
