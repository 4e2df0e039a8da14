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
   the half-precisions ``1 / (2 sigma2)`` and the means, both transposed to
   ``(H, d, K)`` so that a tile of components is read along contiguous addresses.
2. :func:`_posterior_tiles`, register-tiled like a matrix product: a block of
   ``TY x TX`` threads owns ``TILE_ROWS`` rows of one sequence
   and sweeps its ``K`` components ``TILE_COMPS`` at a time; each thread
   accumulates a ``ROWS_PER_THREAD x COMPS_PER_THREAD`` register tile of half
   quadratic forms from the differences, the coordinates staged ``D_CHUNK`` at
   a time in shared memory (the rows' ``x``, the components' means and
   half-precisions).  The row softmax is fused into the epilogue: each thread
   writes ``l`` and keeps, per row, an online ``(max, sum of exp(l - max))``
   pair across the component tiles and the smallest half quadratic form; the
   pairs of a row are combined by an ordered tree in shared memory, then each
   thread rereads its own entries and normalises them (a second pass over
   its ``N x K`` entries, no other).

The geometry of both launches is a pure function of the shapes,
:func:`launch_geometry`, inside every hardware limit for any ``B``, ``N`` and
``H``: sequences and row tiles are folded onto grid x (at most
:data:`MAX_GRID_X` blocks; a block loops over tiles when there are more).
The tile sizes are module constants (:data:`GPU_GEOMETRY` on a GPU,
:data:`SIMULATOR_GEOMETRY` in the simulator); :func:`geometry` runs the GPU's
tiles in the simulator, for tests.

Host copies
-----------
A public call with a device ``x`` copies one small device array to the host,
its result-check flag: the per-block counts of non-finite entries of ``x``
and of ``min_quad``, gathered into one buffer by
:class:`~gpu.numba_cuda._device.Checks`.  Only when a count is not zero is
more copied, to word the reference's error.  Device parameters (``means``,
``variances``, ``weights``: ``K x d`` numbers) are checked by the reference's
checker on the host, so they cost one more copy, all of them together
(:func:`parameters_to_host`).

:func:`posterior_device` is the device-level entry point (no validation) used
by :mod:`gpu.numba_cuda.gma`; the public functions validate with
:mod:`refimpl.validation` and call it with one sequence and one mixture.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numba import boolean, cuda, int64, uint32

from refimpl import validation
from refimpl.gmm import LOG_2PI

from ._device import SIMULATOR, Checks, _as_numba, any_device, blocks, host_view, is_device_array, kernel, raise_bad_inputs, result, to_device, to_host

__all__ = ["log_responsibilities", "responsibilities", "launch_geometry", "geometry", "parameters_to_host", "GPU_GEOMETRY", "SIMULATOR_GEOMETRY"]

#: The tile geometry of :func:`_posterior_tiles`: a block of ``TY x TX`` threads (``Geometry.threads_y x threads_x``), each owning a
#: ``ROWS_PER_THREAD x COMPS_PER_THREAD`` register tile, so a block tile of ``TILE_ROWS x TILE_COMPS``; the
#: coordinates are staged in shared memory ``D_CHUNK`` at a time.
class Geometry(NamedTuple):
    """Tile sizes of the responsibilities kernel (module constants; :func:`geometry` switches them in the simulator)."""

    rows_per_thread: int
    comps_per_thread: int
    threads_x: int  # threads along the components (a power of two)
    threads_y: int  # threads along the rows
    d_chunk: int  # coordinates per shared-memory stage


#: On a GPU: 16 x 16 threads of 4 x 4 register tiles, 64 x 64 block tiles, 8 coordinates per stage
#: (shared memory: 3 x 64 x 8 tile entries + 3 x 64 x 16 reduction entries = 18 KiB in float32, 36 KiB in float64).
GPU_GEOMETRY = Geometry(4, 4, 16, 16, 8)
#: In the simulator (every thread a Python thread): 2 x 4 threads of 2 x 4 register tiles, 4 x 16 block tiles,
#: 2 coordinates a stage.
SIMULATOR_GEOMETRY = Geometry(2, 4, 4, 2, 2)

#: Largest grid x of a launch (sequences and row tiles are folded onto it; blocks loop when there are more tiles).
MAX_GRID_X = 2**31 - 1


def _set_geometry(g: Geometry) -> None:
    # the kernel reads these module globals; on a GPU they are compile-time constants (the shared and local array
    # shapes, the unrolled loops' bounds), so they are set once, at import
    global RM, RK, TX, TY, DC, TILE_ROWS, TILE_COMPS, NT, SH_X, SH_C, SH_RED, LOADS_X, LOADS_C, GEOMETRY
    rm, rk, tx, ty, dc = g
    if tx & (tx - 1) or tx < 1:
        raise ValueError("Geometry: threads_x must be a power of two")
    nt = tx * ty
    if (ty * rm * dc) % nt or (dc * tx * rk) % nt:
        raise ValueError("Geometry: the shared tiles must be a multiple of the block's threads")
    GEOMETRY = g
    RM, RK, TX, TY, DC = rm, rk, tx, ty, dc
    TILE_ROWS, TILE_COMPS, NT = ty * rm, tx * rk, nt
    SH_X = TILE_ROWS * DC  # [TILE_ROWS rows, DC coordinates]
    SH_C = DC * TILE_COMPS  # [DC coordinates, TILE_COMPS components]
    SH_RED = TILE_ROWS * TX  # [TILE_ROWS rows, TX lanes]
    LOADS_X = SH_X // NT  # entries of the x tile each thread loads
    LOADS_C = SH_C // NT  # entries of each component tile each thread loads


_set_geometry(SIMULATOR_GEOMETRY if SIMULATOR else GPU_GEOMETRY)

#: The unsigned 32-bit conversion of the kernels' shared and register offsets (``numba.uint32``); in the simulator a
#: plain ``int``, the same value, since calling a Numba type from Python costs microseconds per offset there.
u32 = int if SIMULATOR else uint32


@contextmanager
def geometry(g: Geometry):
    """Run :func:`posterior_device` with the tile geometry ``g`` (the CUDA simulator only).

    The simulator reads the module's constants at every launch, so a test can
    run the GPU's own tiles (:data:`GPU_GEOMETRY`) there; a GPU compiles them
    into the kernel once, so this refuses to run on one.
    """
    if not SIMULATOR:
        raise RuntimeError("gpu.numba_cuda.gmm.geometry: the tile geometry is fixed on a GPU (compile-time constants)")
    old = GEOMETRY
    _set_geometry(g)
    try:
        yield
    finally:
        _set_geometry(old)

#: Threads per block of :func:`_component_constants`.
THREADS = 32 if SIMULATOR else 128


# log_norm = log_weights - 0.5 * (d * LOG_2PI + np.sum(np.log(variances), axis=1)) and precisions = 1.0 / variances
# (refimpl.gmm._expansion), here with the precisions halved: half_prec = 1 / (2 sigma^2), exactly half of 1 / sigma^2.
# One thread per component (h, m) over a 1-D grid (striding by the grid when H K exceeds it); it loops over the d coordinates and writes the means
# and half-precisions transposed, [H, d, K], so that a tile of components (neighbouring m) is read along contiguous addresses.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, ::1], f[:, :, ::1], f[:, :, ::1], f[:, ::1]), threads=lambda f: THREADS)
def _component_constants(means, variances, log_weights, means_t, half_prec_t, log_norm):
    f = means.dtype.type
    H, K, d = means.shape
    half = f(0.5)
    for c in range(cuda.grid(1), H * K, cuda.gridsize(1)):
        h = c // K
        m = c - h * K
        log_det = f(0.0)
        for j in range(d):
            s2 = variances[h, m, j]
            log_det += math.log(s2)
            means_t[h, j, m] = means[h, m, j]
            half_prec_t[h, j, m] = half / s2
        log_norm[h, m] = log_weights[h, m] - half * (f(d * LOG_2PI) + log_det)


#: Resident blocks per multiprocessor that ptxas must allow for :func:`_posterior_tiles` on a GPU (its launch bounds,
#: with TX x TY threads per block): 4 in float32 (at most 64 registers: 32 of the 64 warps of an sm_90,
#: 50% occupancy), 2 in float64 (at most 128 registers, 25%: a 4 x 4 register tile of doubles needs about 120 without
#: spills).  Unbounded, ptxas takes about 106 and 118 registers: 2 and 1 blocks.  Held to 64 registers (4 blocks), the
#: float64 build spills with every register tile tried, 1 x 1 included (ptxas -v, sm_90: 8 B stored with 1 x 1 and
#: 16 coordinates a stage, 24 B with 2 x 2 and 8): the bound is outside the register tile (what remains there is the
#: epilogue's exp and log in double, the per-row pairs and the addresses).
MIN_BLOCKS = {np.dtype(np.float32): 4, np.dtype(np.float64): 2}
_BOUNDED = {}


def _launch_bounds(f):
    """The compile options of :func:`_posterior_tiles` for the float type ``f``: its launch bounds."""
    return {"launch_bounds": (NT, MIN_BLOCKS[np.dtype(str(f))])}


def _tiles_kernel(dtype):
    """:func:`_posterior_tiles` for ``dtype``: on a GPU compiled with its launch bounds (:func:`_launch_bounds`).

    The registry (:func:`~gpu.numba_cuda._device.kernel`) holds the same
    options, so the PTX and resource checks compile what runs.
    """
    if SIMULATOR:  # the simulator has no launch bounds
        return _posterior_tiles
    dtype = np.dtype(dtype)
    if dtype not in _BOUNDED:
        _BOUNDED[dtype] = cuda.jit(_posterior_tiles.py_func, **_launch_bounds(str(dtype)))
    return _BOUNDED[dtype]


# l_ik = log_norm_k - q_ik / 2 with q_ik = sum_j (x_ij - mu_kj)^2 p_kj from the differences (refimpl.gmm._exact_quadratic_form),
# then softmax(a) = softmax(a - m) per row (refimpl.numerics.softmax / log_softmax), min_quad = min_k q_ik.
# Work: the rows of sequence b (mixture h = b % H) in tiles of TILE_ROWS, the tiles of every sequence folded onto
# grid x (block x loops over tiles x, x + gridDim.x, ...); a block of TY x TX threads sweeps the K components in tiles
# of TILE_COMPS. Thread (ty, tx) owns the RM x RK register tile of rows ty + a TY and components tx + c TX (a < RM,
# c < RK): neighbouring tx write neighbouring k.
# Shared memory, per stage of DC coordinates: x [TILE_ROWS rows, DC], the means and the half-precisions
# [DC, TILE_COMPS] (zeros past N, K and d: a zero difference times a zero half-precision adds nothing); per step j
# a thread reads RM + 2 RK shared entries for RM RK (sub, mul, fma): the register tile of a product, from differences.
# Epilogue of each component tile: l = log_norm - q/2 written to gamma, and per row the online pair (m, s) with
# s = sum exp(l - m) rescaled by exp(m_old - m_new), and min q/2 (NaN, once met, stays, in both).
# Then the TX lanes of each row combine their pairs by an ordered tree in shared memory [TILE_ROWS rows, TX lanes]
# (three arrays: m, s, min q/2), and every thread rereads its own entries: exp(l - M) * (1 / S), or (l - M) - log S.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, ::1], boolean, f[:, :, ::1], f[:, ::1]),
        threads=lambda f: NT, tags=("responsibilities",), options=lambda f: _launch_bounds(f))
def _posterior_tiles(x, means_t, half_prec_t, log_norm, log, gamma, min_quad):
    f = x.dtype.type
    sh_x = cuda.shared.array(SH_X, dtype=x.dtype)  # [TILE_ROWS rows, DC coordinates]
    sh_mu = cuda.shared.array(SH_C, dtype=x.dtype)  # [DC coordinates, TILE_COMPS components]
    sh_hp = cuda.shared.array(SH_C, dtype=x.dtype)  # [DC coordinates, TILE_COMPS components]
    red_m = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
    red_s = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
    red_q = cuda.shared.array(SH_RED, dtype=x.dtype)  # [TILE_ROWS rows, TX lanes]
    q = cuda.local.array((RM, RK), dtype=x.dtype)  # the register tile: q/2, then l
    xr = cuda.local.array(RM, dtype=x.dtype)
    mr = cuda.local.array(RK, dtype=x.dtype)
    hr = cuda.local.array(RK, dtype=x.dtype)
    B, N, d = x.shape
    H = means_t.shape[0]
    K = means_t.shape[2]
    # shared and register offsets are unsigned 32-bit: < TILE_ROWS * TX and DC * TILE_COMPS, bounded by the geometry
    # (a few thousand), and unsigned indices skip Numba's negative-index wraparound
    tx = u32(cuda.threadIdx.x)
    ty = u32(cuda.threadIdx.y)
    tid = ty * u32(TX) + tx
    neg_inf = f(-math.inf)
    zero = f(0.0)
    one = f(1.0)
    tiles_n = (N + TILE_ROWS - 1) // TILE_ROWS
    k_tiles = (K + TILE_COMPS - 1) // TILE_COMPS
    d_chunks = max(1, (d + DC - 1) // DC)
    k_first = int64(tx)  # at least one stage (d = 0): its barriers order the tiles' shared memory
    for tile in range(cuda.blockIdx.x, B * tiles_n, cuda.gridDim.x):
        b = tile // tiles_n
        i0 = (tile - b * tiles_n) * TILE_ROWS
        h = b % H
        # the thread's running (max of l, sum of exp(l - max), min of q/2) per row, in its own slot of the row's lanes
        for a in range(RM):
            r = (ty + u32(a * TY)) * u32(TX) + tx
            red_m[r] = neg_inf
            red_s[r] = zero
            red_q[r] = f(math.inf)
        for kt in range(k_tiles):
            k0 = kt * TILE_COMPS
            for a in range(RM):
                for c in range(RK):
                    q[a, c] = zero
            for dc in range(d_chunks):
                j0 = dc * DC
                for u in range(LOADS_X):
                    e = tid + u32(u * NT)
                    row = e // u32(DC)
                    jj = e - row * u32(DC)
                    i = i0 + row
                    j = j0 + jj
                    sh_x[e] = x[b, i, j] if i < N and j < d else zero
                for u in range(LOADS_C):
                    e = tid + u32(u * NT)
                    jj = e // u32(TILE_COMPS)
                    k = k0 + (e - jj * u32(TILE_COMPS))
                    j = j0 + jj
                    inside = k < K and j < d
                    sh_mu[e] = means_t[h, j, k] if inside else zero
                    sh_hp[e] = half_prec_t[h, j, k] if inside else zero
                cuda.syncthreads()
                for jj in range(u32(DC)):
                    for a in range(RM):
                        xr[a] = sh_x[(ty + u32(a * TY)) * u32(DC) + jj]
                    for c in range(RK):
                        mr[c] = sh_mu[jj * u32(TILE_COMPS) + tx + u32(c * TX)]
                        hr[c] = sh_hp[jj * u32(TILE_COMPS) + tx + u32(c * TX)]
                    for a in range(RM):
                        for c in range(RK):
                            diff = xr[a] - mr[c]
                            q[a, c] += diff * diff * hr[c]
                cuda.syncthreads()
            for a in range(RM):
                r = (ty + u32(a * TY)) * u32(TX) + tx
                i = i0 + (ty + u32(a * TY))
                tile_m = red_m[r]
                min_q = red_q[r]
                for c in range(RK):
                    k = k0 + (tx + u32(c * TX))
                    if k < K:
                        hq = q[a, c]
                        if hq < min_q or hq != hq:
                            min_q = hq
                        lk = log_norm[h, k] - hq
                        q[a, c] = lk
                        if lk > tile_m or lk != lk:  # NaN, once met, stays (and makes the row's sum NaN)
                            tile_m = lk
                        if i < N:
                            gamma[b, i, k] = lk
                red_q[r] = min_q
                if tile_m != neg_inf:  # all -inf so far: nothing to add (and no -inf - (-inf))
                    s = red_s[r] * math.exp(red_m[r] - tile_m)
                    for c in range(RK):
                        if k0 + (tx + u32(c * TX)) < K:
                            s += math.exp(q[a, c] - tile_m)
                    red_s[r] = s
                    red_m[r] = tile_m
        cuda.syncthreads()
        stride = u32(TX // 2)
        while stride > 0:
            if tx < stride:
                for a in range(RM):
                    r = (ty + u32(a * TY)) * u32(TX) + tx
                    m_a = red_m[r]
                    m_b = red_m[r + stride]
                    if m_b > m_a:
                        red_s[r] = red_s[r] * math.exp(m_a - m_b) + red_s[r + stride]
                        red_m[r] = m_b
                    elif m_b != neg_inf:
                        red_s[r] = red_s[r] + red_s[r + stride] * math.exp(m_b - m_a)
                    q_b = red_q[r + stride]
                    if q_b < red_q[r] or q_b != q_b:
                        red_q[r] = q_b
            cuda.syncthreads()
            stride //= u32(2)
        for a in range(RM):
            r = (ty + u32(a * TY)) * u32(TX)
            i = i0 + (ty + u32(a * TY))
            if i < N:
                big_m = red_m[r]
                big_s = red_s[r]
                if tx == 0:
                    min_quad[b, i] = f(2.0) * red_q[r]
                if log:
                    log_s = neg_inf  # log 0 = -inf (a row of -inf logits), as on the device; math.log(0) would raise in the simulator
                    if big_s != zero:
                        log_s = math.log(big_s)
                    for k in range(k_first, K, TX):
                        gamma[b, i, k] = (gamma[b, i, k] - big_m) - log_s
                else:
                    inv_s = one / big_s
                    for k in range(k_first, K, TX):
                        gamma[b, i, k] = math.exp(gamma[b, i, k] - big_m) * inv_s
        cuda.syncthreads()  # every thread has read the row's (M, S) before the next tile resets its lanes


def launch_geometry(B, N, K, d, H=1):
    """The launches of :func:`posterior_device`: ``{kernel name: (grid, block)}``, a pure function of the shapes.

    Every grid is 1-D and at most :data:`MAX_GRID_X` blocks (the kernels loop
    over their tiles or entries when there are more); the blocks have
    ``TX x TY`` (or :data:`THREADS`) threads.

    Parameters
    ----------
    B, N, K, d, H : int
        Sequences, points per sequence, components, coordinates, mixtures.
    """
    tiles = int(B) * blocks(N, TILE_ROWS)
    return {
        "_component_constants": (min(blocks(int(H) * int(K), THREADS), MAX_GRID_X), THREADS),
        "_posterior_tiles": (max(1, min(tiles, MAX_GRID_X)), (TX, TY)),
    }


def posterior_device(x, means, variances, log_weights, *, log=False):
    """Core: the responsibilities of ``B`` sequences under ``H`` mixtures, on the device; no validation, no raise.

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
    means_t = cuda.device_array((H, d, K), dtype=dtype)
    half_prec_t = cuda.device_array((H, d, K), dtype=dtype)
    log_norm = cuda.device_array((H, K), dtype=dtype)
    launches = launch_geometry(B, N, K, d, H)
    grid, block = launches["_component_constants"]
    _component_constants[grid, block](means, variances, log_weights, means_t, half_prec_t, log_norm)
    grid, block = launches["_posterior_tiles"]
    _tiles_kernel(dtype)[grid, block](x, means_t, half_prec_t, log_norm, bool(log), gamma, min_quad)
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


def _checked_posterior(x, means, variances, weights, log):
    """Validate as :mod:`refimpl.gmm` does, run :func:`posterior_device` with ``B = H = 1``, check ``min_quad``.

    The checks (a device ``x``'s finiteness, ``min_quad``) are counted on the
    device and copied to the host once (:class:`~gpu.numba_cuda._device.Checks`);
    device parameters are copied once more, together (:func:`parameters_to_host`).
    """
    on_device = any_device(x, means, variances, weights)
    _, means, variances, weights = validation.check_gmm(host_view(x), *parameters_to_host(means, variances, weights))
    dtype = means.dtype
    x_in = x
    x = to_device(x, dtype)
    checks = Checks(dtype)
    if is_device_array(x_in):
        checks.finite(x, "x")
    N, d = x.shape
    K = means.shape[0]
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    gamma, min_quad = posterior_device(
        x.reshape(1, N, d), to_device(means[None], dtype), to_device(variances[None], dtype),
        to_device(log_weights[None], dtype), log=log,
    )
    checks.finite(min_quad, "min_quad")
    raise_bad_inputs(checks.fetch(), ((x_in, "x"),))
    if checks.failed("min_quad"):
        validation.check_scaled_distances(min_quad.copy_to_host()[0], "x")
    return result(gamma.reshape(N, K), on_device)


def log_responsibilities(x, means, variances, weights):
    """Log posterior ``log p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.log_responsibilities`).

    Parameters
    ----------
    x : array_like or device array, shape (N, d)
    means : array_like or device array, shape (K, d)
    variances : array_like or device array, shape (K, d)
        All > 0.
    weights : array_like or device array, shape (K,)
        Nonnegative, summing to one.

    Returns
    -------
    ndarray or device array, shape (N, K)
        ``l_k(x_i) - logsumexp_m l_m(x_i)``; a device array when any input is one.
    """
    return _checked_posterior(x, means, variances, weights, True)


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.responsibilities`).

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray or device array, shape (N, K)
        Nonnegative rows that sum to one; a device array when any input is one.
    """
    return _checked_posterior(x, means, variances, weights, False)
