r"""Online vector-quantized (OVQ) attention and the static-dictionary VQ baseline on the GPU (:mod:`refimpl.ovq`).

One head, one sequence: ``q, k`` are ``(N, d)``, ``v`` is ``(N, d_v)``.  The
contract is :mod:`refimpl.ovq`'s, word for word: unit rows, predict then
update chunk by chunk, growth, spread or random seeding, argmax assignment
with ties to the lowest index, the running-mean or constant-rate update in
token order, streaming through :class:`refimpl.ovq.OVQState`, and the same
checks and messages (the checkers are :mod:`refimpl.ovq`'s own).

Launch plan: OVQ's chunk loop in one launch
-------------------------------------------
The kernels take ``H`` independent sequences at once.  Every size the plan
needs (``n``, ``t``, ``n' = max(n, growth(t + L))``) and, for
``init="random"``, every chunk's seeds (refimpl's generator) are known on
the host before the first launch: they are computed once per call, for every
sequence, and uploaded together (:func:`loop_plans`), so that nothing waits
for the host between chunks.

* once per call: :func:`_unit_rows_kernel` (``q^``, ``k^``); for VQ
  :func:`_codes_kernel` (every key's code: the codebook is fixed);
* OVQ: the whole chunk loop of every sequence in **one cooperative launch**,
  :func:`_chunk_loop_kernel`: a 2-D call's one sequence, or a packed call's
  sequences (``cu_seqlens``: each its own chunk plan, dictionary and state),
  with as many blocks as the GPU holds at once.  Round ``r`` is every
  sequence's ``r``-th chunk, in the three steps below, each ended by a
  grid-wide barrier (``cuda.cg.this_grid().sync()``: Numba-CUDA launches the
  kernel cooperatively and links the device runtime); the simulator runs a
  cooperative grid of one block, whose barrier is a block barrier;
* VQ: per chunk, the same steps as two launches, :func:`_predict_kernel`
  (predict, then the plan by the last block of a head to finish) and
  :func:`_merge_kernel`.

The steps of a chunk:

  1. *predict*, flash-decoding style, every product register
     tiled.  The key axis of the chunk, ``u < n + L`` (the centroids, then
     the chunk's keys), is cut into ``splits`` tiles of ``KEYS`` keys and the
     chunk's positions into ``row_tiles`` tiles of ``ROWS``.  A block of
     ``TY x TX`` threads takes one work item at a time (:func:`_predict_item`):
     a *read-out* item
     (row tile, key tile) computes the tile's logits as a product of the
     positions' ``q^`` against the tile's keys, each thread an ``RQ x RK``
     register tile, and writes for each of its positions the tile's
     partial softmax (its maximum, its sum of ``exp(l - max)``, and the
     numerator over the values, a second register-tiled product of the
     weights against the tile's values); an *assignment* item (row tile,
     centroid tile; OVQ only) computes the chunk keys' similarities to the
     tile's centroids the same way, and the argmax epilogue writes each key's
     best centroid of the tile;
  2. the chunk's *plan*, by one block per sequence (:func:`_plan_chunk`): the
     nearest centroids (tiles combined in centroid order), the seeds, the
     keys sorted stably by their row (bucketed by centroid) and the new
     counts;
  3. *merge* (:func:`_merge_item`): the partial softmaxes combined in key-tile
     order into ``o_a`` (one thread per output entry) and, in other threads,
     the update of the touched centroids: one thread per (centroid, column)
     walking only that centroid's members, in token order.

Each step reads no array the step before it still writes, and the next
chunk's predict reads the state the merge wrote: the barriers (VQ: the
stream's order) are the only synchronisation.  No float atomics: every sum
has one owner and a fixed order, whichever block computes it, so the one
launch and the launches per chunk give the same bits, and so do two runs.

The geometry of every launch is :func:`launch_geometry`, a pure function of
the shapes (each chunk's predict and merge grids are cut to the tiles it has,
:meth:`Geometry.predict_for`, :meth:`Geometry.merge_for`, pure functions of
``n`` and ``L``); block sizes are the module constants of
:func:`tile_sizes` (:data:`GPU_GEOMETRY` on a GPU: 8 x 16 threads of 4 x 4
register tiles, tiles of 32 positions by 64 keys, 8 coordinates and 32
value columns per stage; smaller in the simulator, where every thread is a
Python thread: :func:`block_sizes` switches the simulator to the GPU's).
Grids stay within the hardware's limits for any ``N`` and ``H``: the heads
go to ``(gridDim.y, gridDim.z)``, the work to ``gridDim.x``, with grid-stride
loops when it is larger.  The loop kernel's grid is one-dimensional: the
blocks one cooperative launch can hold resident (``max_cooperative_grid_blocks``
at its launch bounds, :data:`LOOP_MIN_BLOCKS` per multiprocessor), at most
the most predict items of a round; each step deals its items to them in turn
(:func:`loop_items` counts them per round and sequence).

Cost per chunk: the read-out and the assignment ``O(L (n + L) (d + d_v))``
spread over ``ceil(L / ROWS) (ceil((n + L) / KEYS) + ceil(n / KEYS))``
blocks (at ``L = 256``, ``n = 1024``: 288 blocks for one head, more than
the H200's 132 multiprocessors); in each product a thread makes
``RQ + RK`` shared loads (two 128-bit ones) for ``RQ RK`` multiply-adds.
The plan, the one step of a chunk that no other block shares, runs in one
block per head: the stable ranks of the seeding scores and of the rows are
positions in a bitonic sort of ``(key, index)`` pairs in shared memory
(:func:`_sort_pairs`; 36 steps of one compare-exchange a thread, each
followed by a barrier, at ``L = 256``) when ``L <= PLAN_SORT`` (512 on a
GPU), else counts over every pair (``L^2 / 128`` comparisons a thread); the update
``O(L (d + d_v))``, each member read once per column, by the thread of its
centroid only.  Working memory: the partials, ``splits x C x (d_v + 3)``
floats and ``splits x C`` integers per head.

One copy to the host
--------------------
Every result check (the finiteness of device inputs, the row maxima of the
logits for the overflow check) and, when asked, the state and a host
caller's output are gathered into one device buffer and copied to the host
once per call (:class:`gpu.numba_cuda._device.Checks`; the counts travel in
24-bit pieces, exact in float32).  Only when a check fails is more copied,
to word refimpl's error.

Float32 and float64 alike.  Results agree with :mod:`refimpl.ovq` to rounding
(float64 ~1e-12); the discrete choices (assignments, seeds, counts) are the
same unless two scores differ only in their last bits (the dot products are
summed in another order here), where a choice can differ.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, int32, int64, uint32, uint64

from refimpl import boundary, ovq, validation

from ._device import SIMULATOR, Checks, any_device, backend, blocks, kernel, raise_bad_inputs, to_device
from ._primitives import exp_shifted, max_keep_nan, softmax_combine

__all__ = ["ovq_attention", "vq_attention", "launch_geometry", "Geometry", "block_sizes", "GPU_GEOMETRY", "SIMULATOR_GEOMETRY"]

#: The block sizes on a GPU.  The predict kernel's block is ``TY x TX`` threads (a one-dimensional block of
#: ``TY TX``); thread ``(ty, tx)`` owns an ``RQ x RK`` register tile of (positions, keys), so a block tile is
#: ``ROWS = TY RQ`` positions by ``KEYS = TX RK`` keys; the coordinates are staged ``DC`` at a time, the values
#: ``VC = TX RV`` columns at a time.  ``FLAT`` threads per one-dimensional block of the other kernels.
GPU_GEOMETRY = {"TY": 8, "TX": 16, "RQ": 4, "RK": 4, "DC": 8, "RV": 2, "FLAT": 256}
#: The block sizes in the CUDA simulator (every thread a Python thread).
SIMULATOR_GEOMETRY = {"TY": 2, "TX": 2, "RQ": 2, "RK": 2, "DC": 2, "RV": 2, "FLAT": 16}


def tile_sizes(sizes):
    """The predict kernel's tiles and shared-array sizes for the block sizes ``sizes`` (a dict like :data:`GPU_GEOMETRY`).

    ``ROWS`` positions by ``KEYS`` keys per block tile, ``SLAB`` (= ``DC``)
    coordinates per stage, ``VC`` value columns per stage, ``NT`` threads,
    and the shared arrays: ``SH_ROWS`` ``[DC, ROWS]``, ``SH_KEYS`` ``[DC, KEYS]``,
    ``SH_P`` ``[ROWS, KEYS]``, ``SH_V`` ``[KEYS, VC]``, ``SH_LANES`` ``[ROWS, TX]``.
    """
    ty, tx, rq, rk, dc, rv = (int(sizes[k]) for k in ("TY", "TX", "RQ", "RK", "DC", "RV"))
    step = min(4, dc)
    if rk < 2 or tx & (tx - 1) or dc % step or (tx * rk) % step:
        raise ValueError("tile_sizes: RK >= 2 (the lanes' pairs live in the weights' tile), TX a power of two, and DC "
                         "and KEYS multiples of min(4, DC)")
    rows, keys, vc = ty * rq, tx * rk, tx * rv
    nt = ty * tx
    return {"TY": ty, "TX": tx, "RQ": rq, "RK": rk, "DC": dc, "RV": rv, "FLAT": int(sizes["FLAT"]), "ROWS": rows,
            "KEYS": keys, "SLAB": dc, "VC": vc, "NT": nt, "SH_ROWS": dc * rows, "SH_KEYS": dc * keys,
            "SH_P": rows * keys, "SH_V": keys * vc, "SH_LANES": rows * tx, "LOADS_ROWS": -(-dc * rows // nt),
            "LOADS_KEYS": -(-dc * keys // nt), "LOADS_V": -(-keys * vc // nt), "STEP": step,
            "TILE_PLAN": rows * tx, "PLAN_SORT": 1 << ((rows * tx).bit_length() - 1)}


_T = tile_sizes(SIMULATOR_GEOMETRY if SIMULATOR else GPU_GEOMETRY)
#: Threads of the predict block along the positions and along the keys; register tile per thread.
TY, TX, RQ, RK = _T["TY"], _T["TX"], _T["RQ"], _T["RK"]
#: Positions (query rows, chunk keys) and keys (centroids, then chunk keys) per block tile of the predict kernel.
ROWS, KEYS = _T["ROWS"], _T["KEYS"]
#: Coordinates per shared-memory stage of the products; value columns per stage of the read-out.
DC = SLAB = _T["DC"]
RV, VC = _T["RV"], _T["VC"]
#: Threads of a predict block; of a one-dimensional block (merge, unit rows, codes).
NT, FLAT = _T["NT"], _T["FLAT"]
#: Shared-array sizes of the predict kernel (compile-time constants), and the staged entries per thread.
SH_ROWS, SH_KEYS, SH_P, SH_V, SH_LANES = _T["SH_ROWS"], _T["SH_KEYS"], _T["SH_P"], _T["SH_V"], _T["SH_LANES"]
LOADS_ROWS, LOADS_KEYS, LOADS_V = _T["LOADS_ROWS"], _T["LOADS_KEYS"], _T["LOADS_V"]
#: Coordinates (and keys of the read-out) per unrolled step of the products' inner loops.
STEP = _T["STEP"]
#: Entries of the chunk's scores or rows staged at a time in the plan's comparisons (in the lanes' int32 array and in
#: the weights' array, free once the block's products are done).
TILE_PLAN = _T["TILE_PLAN"]
#: The longest chunk whose plan sorts its keys (a bitonic network in shared memory, the largest power of two in the
#: lanes' array); a longer one ranks them by comparing every pair, :data:`TILE_PLAN` at a time.
PLAN_SORT = _T["PLAN_SORT"]
#: Resident blocks per multiprocessor that ptxas must allow for the predict kernel on a GPU (its launch bounds, by float
#: type): float32 5 blocks of 128 threads (at most 102 registers, 31.25% occupancy: 5 warps a scheduler), float64 2
#: (255 registers, 12.5%).  ptxas -v (sm_90): no spills at these bounds (float32 95 registers, float64 214, most of
#: them for the epilogue's inlined double-precision exponentials); float32 at 6 blocks (80 registers) spills 8 bytes,
#: at 8 (64) 116; float64 at 3 blocks 60.
MIN_BLOCKS = {np.dtype(np.float32): 5, np.dtype(np.float64): 2}
#: The same for :func:`_chunk_loop_kernel`: float32 4 blocks (at most 128 registers, 25% occupancy: 4 warps a
#: scheduler), float64 2.  Its grid barrier is a call into the device runtime, and what stays live across a call follows
#: the calling convention: ptxas -v (sm_90, ptxas 13.0 and 13.5 on the PTX of NVVM 13.0 and 13.5) gives float32 123 to
#: 127 registers and no spill at 4 blocks (76 bytes of spill stores at 5), float64 no spill at 2.  With the grid's
#: handle asked once and kept across the loop, float32 spilled 20 to 24 bytes at 4 blocks (the handle and the round).
LOOP_MIN_BLOCKS = {np.dtype(np.float32): 4, np.dtype(np.float64): 2}
_BOUNDED = {}


def _launch_bounds(f):
    """The compile options of :func:`_predict_kernel` for the float type ``f``: its launch bounds."""
    return {"launch_bounds": (tile_sizes(GPU_GEOMETRY)["NT"], MIN_BLOCKS[np.dtype(str(f))])}


def _loop_bounds(f):
    """The compile options of :func:`_chunk_loop_kernel` for the float type ``f``: its launch bounds."""
    return {"launch_bounds": (tile_sizes(GPU_GEOMETRY)["NT"], LOOP_MIN_BLOCKS[np.dtype(str(f))])}


def _bounded(fn, bounds, dtype):
    """Kernel ``fn`` for ``dtype``: on a GPU compiled with its launch bounds ``bounds(dtype)``, once per dtype (the
    registry holds the same options, so the PTX and resource checks compile what runs); the simulator has none."""
    if SIMULATOR:
        return fn
    key = (fn.py_func.__name__, np.dtype(dtype))
    if key not in _BOUNDED:
        _BOUNDED[key] = cuda.jit(fn.py_func, **bounds(np.dtype(dtype)))
    return _BOUNDED[key]


def _predict(dtype):
    """:func:`_predict_kernel` for ``dtype``, with its launch bounds on a GPU."""
    return _bounded(_predict_kernel, _launch_bounds, dtype)


def _loop(dtype):
    """:func:`_chunk_loop_kernel` for ``dtype``, with its launch bounds on a GPU."""
    return _bounded(_chunk_loop_kernel, _loop_bounds, dtype)

#: The alignment of the loop kernel's shared arrays on a GPU (128-bit loads); the simulator takes none.
SHARED_ALIGN = None if SIMULATOR else 16

# Unsigned offsets skip Numba's negative-index wraparound (and 32-bit ones are single instructions); plain ints in
# the simulator.
u32 = int if SIMULATOR else uint32
u64 = int if SIMULATOR else uint64


@contextlib.contextmanager
def block_sizes(sizes):
    """Within the block, launch with the block sizes ``sizes`` (e.g. :data:`GPU_GEOMETRY`); the simulator only.

    On a GPU the kernels are compiled with the sizes the module was imported
    with (they are compile-time constants), so only the simulator can switch.
    """
    if not SIMULATOR:
        raise RuntimeError("block_sizes: the block sizes are compile-time constants on a GPU; switch them in the simulator")
    module = globals()
    saved = {name: module[name] for name in tile_sizes(sizes)}
    module.update(tile_sizes(sizes))
    try:
        yield
    finally:
        module.update(saved)


#: Hardware limits of a launch (every compute capability since 3.0).
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_THREADS = 1024

_PIECE = 1 << 24  # counts travel to the host in 24-bit pieces: integers below 2^24 are exact in float32


# ---------------------------------------------------------------------------
# Launch geometry
# ---------------------------------------------------------------------------


class Geometry(NamedTuple):
    """Grids ``(x, y, z)`` and threads per block of every launch of one call (:func:`launch_geometry`)."""

    unit: tuple  #: (grid, threads) of :func:`_unit_rows_kernel`
    codes: tuple  #: (grid, threads) of :func:`_codes_kernel` (VQ)
    predict: tuple  #: (grid, threads) of :func:`_predict_kernel`
    merge: tuple  #: (grid, threads) of :func:`_merge_kernel`
    pack: tuple  #: (grid, threads) of :func:`_pack_counts_kernel`
    chunk: int  #: ``min(C, N)``, the longest chunk
    splits: int  #: key tiles of ``KEYS`` over ``n_max + chunk``
    row_tiles: int  #: position tiles of ``ROWS`` over ``chunk``
    centroid_tiles: int  #: assignment tiles of ``KEYS`` centroids over ``n_max`` (VQ: 0, the codes are known)
    d_v: int  #: value columns (the read-out's items per key)
    width: int  #: columns the update writes per key, ``d + d_v`` (VQ: ``d_v``)

    def predict_for(self, n, L):
        """``(grid, threads, key tiles, centroid tiles)`` of the predict launch of a chunk of ``L`` keys and ``n`` centroids.

        The :attr:`predict` grid cut to the tiles the chunk has:
        ``ceil(L / ROWS) (ceil((n + L) / KEYS) + ceil(n / KEYS))`` blocks (the
        read-out's tiles, then the assignment's; VQ has none of the latter),
        capped at 2^31 - 1.
        """
        tiles = -(-(n + L) // KEYS)
        ctiles = -(-n // KEYS) if self.centroid_tiles else 0
        (_, y, z), threads = self.predict
        return (min(-(-L // ROWS) * (tiles + ctiles), MAX_GRID_X), y, z), threads, tiles, ctiles

    def merge_for(self, L):
        """``(grid, threads)`` of the merge launch of a chunk of ``L`` keys: ``L (d_v + width)`` items."""
        (_, y, z), threads = self.merge
        return (min(blocks(L * (self.d_v + self.width), threads), MAX_GRID_X), y, z), threads


def _fold(count):
    """``(y, z)`` with ``y z >= count``, both at most 65,535: the heads on the grid's second and third axes."""
    y = min(count, MAX_GRID_YZ)
    z = -(-count // y)
    if z > MAX_GRID_YZ:
        raise ValueError(f"heads: at most {MAX_GRID_YZ ** 2 // 2} sequences per launch, got {count}")
    return y, z


def launch_geometry(N, heads, d, d_v, n_max, chunk_size, with_keys=True):
    """The launch geometry of one call, from its shapes alone (no device is asked).

    Parameters
    ----------
    N : int
        Tokens per sequence.
    heads : int
        Sequences launched together (``B H``; the public functions use 1).
    d, d_v : int
        Key and value dimensions.
    n_max : int
        Rows of the dictionary (``max_size``, or the codebook's ``S``).
    chunk_size : int
        ``C``.
    with_keys : bool, default True
        OVQ (both dictionaries updated) or VQ (the value means only).

    Returns
    -------
    Geometry
        Every grid within ``x <= 2^31 - 1``, ``y, z <= 65,535`` and every block
        within 1,024 threads, whatever ``N`` and ``heads`` are; the kernels
        loop over what a capped ``x`` leaves (grid-stride).
    """
    N, heads, d, d_v, n_max, C = (int(x) for x in (N, heads, d, d_v, n_max, chunk_size))
    Cm = min(C, N)
    y, z = _fold(heads)
    y2, z2 = _fold(2 * heads)
    splits = -(-(n_max + Cm) // KEYS)
    row_tiles = -(-Cm // ROWS)
    ctiles = -(-n_max // KEYS) if with_keys else 0
    width = (d + d_v) if with_keys else d_v

    def x(items):
        return min(max(1, int(items)), MAX_GRID_X)

    return Geometry(
        unit=((x(blocks(N, FLAT // KEYS)), y2, z2), FLAT),
        codes=((x(blocks(N, FLAT)), y, z), FLAT),
        predict=((x(row_tiles * (splits + ctiles)), y, z), NT),
        merge=((x(blocks(Cm * (d_v + width), FLAT)), y, z), FLAT),
        pack=((x(blocks(n_max, FLAT)), y, z), FLAT),
        chunk=Cm,
        splits=splits,
        row_tiles=row_tiles,
        centroid_tiles=ctiles,
        d_v=d_v,
        width=width,
    )


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


# x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
# Block: FLAT / KEYS rows x KEYS lanes; grid (row blocks, heads folded x 2): the folded index g = 2 h + (0 for q, 1 for
# k).  Lane j of a row adds the squares of the whole row in column order (the row is read by all lanes at once: one
# broadcast load) and writes the columns j, j + KEYS, ...; rows beyond the grid are visited grid-stride.  No shared
# memory, no barrier.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f, int64), threads=GPU_GEOMETRY["FLAT"])
def _unit_rows_kernel(q, k, qhat, khat, eps, H):
    g = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if g >= 2 * H:
        return
    h = g // 2
    x, xhat = q, qhat
    if g % 2 == 1:
        x, xhat = k, khat
    per_block = FLAT // KEYS
    j = cuda.threadIdx.x % KEYS
    d = x.shape[2]
    for row in range(cuda.blockIdx.x * per_block + cuda.threadIdx.x // KEYS, x.shape[1], cuda.gridDim.x * per_block):
        acc = x[h, row, 0] * x[h, row, 0]
        for c in range(1, d):
            acc += x[h, row, c] * x[h, row, c]
        norm = math.sqrt(acc)
        if norm < eps:
            norm = eps
        for c in range(j, d, KEYS):
            xhat[h, row, c] = x[h, row, c] / norm


# VQ: nearest code by dot product; argmax takes the lowest index on ties:  z_r = argmax_m k^_r . D_k[m]
# One thread per key r (blocks of FLAT, grid-stride over N; heads on y, z), codes in index order with a strict '>'.
# The codebook is fixed, so every chunk's codes are known before the first read-out.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], int64[:, ::1], int64), threads=GPU_GEOMETRY["FLAT"])
def _codes_kernel(khat, codebook, z, H):
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    d = khat.shape[2]
    for r in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, khat.shape[1], cuda.gridDim.x * cuda.blockDim.x):
        arg = 0
        best = khat[h, r, 0] * codebook[h, 0, 0]
        for c in range(1, d):
            best += khat[h, r, c] * codebook[h, 0, c]
        for m in range(1, codebook.shape[1]):
            acc = khat[h, r, 0] * codebook[h, m, 0]
            for c in range(1, d):
                acc += khat[h, r, c] * codebook[h, m, c]
            if acc > best:
                best = acc
                arg = m
        z[h, r] = arg


_INT32_MAX = 2**31 - 1  # the sort's padding key after every row


# Sorts the pairs (key[i], idx[i]), i < P (P a power of two), ascending by key and then by idx, in place: Batcher's
# bitonic network, log2(P) (log2(P) + 1) / 2 steps of P / 2 compare-exchanges with a barrier after each.  The indices
# are distinct, so the order is total: the same result on every run, and a stable sort of the keys.  Every thread of
# the block calls it (tid, nth: its index and the block's size).
@cuda.jit(device=True)
def _sort_pairs(key, idx, P, tid, nth):
    k = 2
    while k <= P:
        j = k // 2
        while j > 0:
            for i in range(tid, P, nth):
                partner = i ^ j
                if partner > i:
                    greater = key[i] > key[partner] or (key[i] == key[partner] and idx[i] > idx[partner])
                    if greater == ((i & k) == 0):  # out of order for this block's direction: exchange
                        t = key[i]
                        key[i] = key[partner]
                        key[partner] = t
                        u = idx[i]
                        idx[i] = idx[partner]
                        idx[partner] = u
            cuda.syncthreads()
            j //= 2
        k *= 2


# The chunk's plan, by one block once every tile's assignment is written (OVQ: after the loop's barrier; VQ: the last
# block of its predict launch), for the sequence whose tokens are head ht and whose state and work arrays are head h:
#   rows[b] = argmax_m k^_b . D_k[m] (m < n): the tiles' winners combined in centroid order with a strict '>' (np.argmax's
#             first maximum); scores[b] its similarity.  First chunk (n = 0): rows = 0, scores[b] = k^_b . k^_0.  VQ:
#             rows[b] = z[s + b].
#   seeds, rows n, n + 1, ... (rows[seeds] = n + np.arange(seeds.size)):
#     spread: seeds = np.argsort(scores, kind="stable")[:n_add]: key b seeds row n + rank(b), rank(b) = the keys with a
#             smaller score, or an equal one and a smaller index; first chunk: key 0 seeds row 0, the others rank 1 + the
#             same count among the keys >= 1;
#     random: drawn[r] seeds row n + r (refimpl's generator, on the host).
#   order: the keys sorted stably by row, pos(b) = #{o : rows[o] < rows[b]} + #{o < b : rows[o] == rows[b]}; srow[p] =
#          rows[order[p]], so a run of srow is one centroid's members in token order (a seed first: the first chunk's
#          key 0, or a new row's only member).
#   counts: at the first position p of a run, cbase[p] = c_m (1 for a seeded row) and counts[m] = c_m + |S_m|.
# Both ranks are positions in a sort by (key, index): a chunk of L <= PLAN_SORT keys is sorted in shared memory by
# _sort_pairs (scores, the first chunk's key 0 as -inf; rows), O(L log^2 L / threads) a thread; a longer chunk compares
# every pair, O(L^2 / threads), its scores and rows staged TILE_PLAN at a time.  The shared arrays (stage_f, stage_i,
# key_i) are the predict kernel's weights, lanes and sort-key arrays, free by then.  The block's threads stride over
# the keys; each phase ends with a barrier (global writes of a block are visible to its threads after it).
@cuda.jit(device=True)
def _plan_chunk(ht, h, khat, s, L, n, n_add, vq, z, abest, aarg, rows, seeded, order, srow, cbase, scores, counts,
                draws, draw_off, use_draws, stage_f, stage_i, key_i):
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    sort = L <= PLAN_SORT
    P = 1  # the sorting network's size: the power of two at or above L
    while P < L:
        P *= 2
    d = khat.shape[2]
    tiles = (n + KEYS - 1) // KEYS
    for b in range(tid, L, nth):
        if vq:
            rows[h, b] = z[ht, s + b]
        elif n == 0:
            rows[h, b] = 0
            acc = khat[ht, s + b, 0] * khat[ht, s, 0]
            for c in range(1, d):
                acc += khat[ht, s + b, c] * khat[ht, s, c]
            scores[h, b] = acc
        else:
            best = abest[h, 0, b]
            arg = aarg[h, 0, b]
            for tile in range(1, tiles):
                x = abest[h, tile, b]
                if x > best:
                    best = x
                    arg = aarg[h, tile, b]
            rows[h, b] = arg
            scores[h, b] = best
        seeded[h, b] = 0
    cuda.syncthreads()
    start = 1 if n == 0 else 0
    if n_add > 0 and use_draws:
        for r in range(tid, n_add, nth):
            b = draws[draw_off + r]
            rows[h, b] = n + r
            seeded[h, b] = 1
    elif n_add > 0 and sort:
        # the keys sorted by (score, index), the first chunk's key 0 first (-inf): a key's position is its rank
        for i in range(tid, P, nth):
            stage_f[i] = (scores[h, i] if i >= start else -math.inf) if i < L else math.inf
            stage_i[i] = i
        cuda.syncthreads()
        _sort_pairs(stage_f, stage_i, P, tid, nth)
        for p in range(tid, min(L, n_add), nth):
            b = stage_i[p]
            rows[h, b] = n + p
            seeded[h, b] = 1
    elif n_add > 0:
        # each key's rank among the keys >= start, the scores staged a tile of TILE_PLAN at a time (uniform loops:
        # every thread passes every barrier)
        for b0 in range(0, L, nth):
            b = b0 + tid
            x = scores[h, b] if b < L else scores[h, 0]
            rank = u32(start)
            for o0 in range(0, L, TILE_PLAN):
                cuda.syncthreads()  # the previous tile is read
                for e in range(tid, min(TILE_PLAN, L - o0), nth):
                    stage_f[e] = scores[h, o0 + e]
                cuda.syncthreads()
                # the tile's keys o = o0 + e >= start, and those before b (e < before): unsigned offsets
                top = u32(min(TILE_PLAN, L - o0))
                before = u32(min(top, max(0, b - o0)))
                for e in range(u32(max(0, start - o0)), top):
                    y = stage_f[e]
                    if y < x or (y == x and e < before):
                        rank = u32(rank + u32(1))
            if b < L and b >= start and rank < n_add:
                rows[h, b] = n + rank
                seeded[h, b] = 1
            elif b < L and b < start:
                rows[h, b] = n  # the first chunk's key 0 seeds row 0 (rank 0 < n_add)
                seeded[h, b] = 1
    cuda.syncthreads()
    if sort:
        # the stable order by row: the keys sorted by (row, index)
        for i in range(tid, P, nth):
            key_i[i] = rows[h, i] if i < L else _INT32_MAX
            stage_i[i] = i
        cuda.syncthreads()
        _sort_pairs(key_i, stage_i, P, tid, nth)
        for p in range(tid, L, nth):
            order[h, p] = stage_i[p]
            srow[h, p] = key_i[p]
    else:
        # the stable order by row, comparing every pair, the rows staged a tile at a time
        for b0 in range(0, L, nth):
            b = b0 + tid
            rb = int32(rows[h, b] if b < L else 0)
            pos = u32(0)
            for o0 in range(0, L, TILE_PLAN):
                cuda.syncthreads()  # the previous tile is read
                for e in range(tid, min(TILE_PLAN, L - o0), nth):
                    stage_i[e] = rows[h, o0 + e]
                cuda.syncthreads()
                top = u32(min(TILE_PLAN, L - o0))
                before = u32(min(top, max(0, b - o0)))
                for e in range(u32(0), top):
                    ro = stage_i[e]
                    if ro < rb or (ro == rb and e < before):
                        pos = u32(pos + u32(1))
            if b < L:
                order[h, pos] = b
                srow[h, pos] = rb
    cuda.syncthreads()
    for p in range(tid, L, nth):
        m = srow[h, p]
        if p == 0 or srow[h, p - 1] != m:
            c = counts[h, m]
            added = 0
            r = p
            while r < L and srow[h, r] == m:
                if seeded[h, order[h, r]] != 0:
                    c = 1
                else:
                    added += 1
                r += 1
            cbase[h, p] = c
            counts[h, m] = c + added


# The predict step of a chunk, before the chunk touches the state: position a (row s + a) attends, in one softmax, to
#   l_{a,u} = beta q^_a . D_k[u] + log c_u (u < n)       a centroid of count c stands for c tokens: weight pi ~ c, logit + log c
#   l_{a,u} = beta q^_a . k^_b, b = u - n <= a           causal inside the chunk: position a sees the chunk keys b <= a only
#   o_a = softmax(l_a) [D_v[:n]; v_0..v_a]
# and each chunk key b finds its nearest centroid, z_b = argmax_{m < n} k^_b . D_k[m] (the first maximum).
# VQ: D_k is the codebook and the chunk key b is D_k[z[s + b]] (past = b q^ . D_k[m] + log L_m, -inf for codes no earlier
# chunk used; current = b q^_a . D_k[z_b]); no assignment (the codes are known).
# The key axis u < n + L is cut into tiles of KEYS and the positions into tiles of ROWS.  Work items, visited
# grid-stride: w < row_tiles splits a read-out item (row tile w // splits, key tile w % splits), then (OVQ) the
# assignment items (row tile, centroid tile kt < ctiles).  Each is a register-tiled product over the coordinates, the
# tile's keys [DC, KEYS] and the positions [DC, ROWS] staged DC coordinates at a time (coordinate-major):
#   assignment: A = K^_pos D_k[tile]^T, then per position the tile's first maximum over its centroids (u < n): each
#            thread over its RK keys in index order, then the TX lanes by an ordered tree ((best, index) pairs, the
#            larger similarity or, equal, the lower index) -> abest, aarg;
#   read-out: S = Q^_pos [D_k; k^][tile]^T, the logits l = beta S (+ log c, -inf where masked); per position the tile's
#            pair (m = max_u l, NaN kept; s = sum_u e^{l - m}) from each thread's RK keys, combined over the lanes by an
#            ordered tree (softmax_combine) -> pmax, psum; then the weights e^{l - m} to shared memory and the partial
#            numerator sum_u e^{l_{a,u} - m} values[u] as a second product, VC value columns at a time -> pnum.
# Only positions that see a key of the tile (u0 <= n + a) write partials.
# Thread (ty, tx) owns the adjacent positions ty RQ + i (i < RQ), keys tx RK + c (c < RK) and value columns tx RV + c
# (c < RV) of each stage, so that its RQ (RK, RV) operands of a coordinate are adjacent in shared memory: one 128-bit
# load each on a GPU (ld.shared.v4), the lanes of a warp reading adjacent 16-byte words.  The weights are stored
# key-major [KEYS, ROWS] for the same reason.  The lanes' pairs of the two trees live in the weights' array
# (2 ROWS TX <= ROWS KEYS: RK >= 2), the indices in [ROWS, TX] int32.  Shared offsets are below KEYS ROWS and KEYS VC
# (a few thousand: 32-bit), global ones 64-bit; all unsigned (no negative-index wraparound).
# _predict_item is one work item w: the sequence's tokens are head ``ht`` of ``qhat, khat, v, z`` (rows from ``s``), its
# dictionary and partials head ``hs`` of the state and work arrays.  Every thread of the block calls it (it has
# barriers); the shared arrays are the caller's.
@cuda.jit(device=True)
def _predict_item(w, ht, hs, qhat, khat, v, z, s, L, Dk, Dv, counts, n, beta, ninf, count_bias, vq, splits, ctiles,
                  pmax, psum, pnum, abest, aarg, sa, sb, sp, sv, sarg):
    acc = cuda.local.array((RQ, RK), dtype=qhat.dtype)  # the register tile: similarities, then logits
    num = cuda.local.array((RQ, RV), dtype=qhat.dtype)  # the register tile of the numerator
    ra = cuda.local.array(RQ, dtype=qhat.dtype)
    rb = cuda.local.array(RK, dtype=qhat.dtype)
    rv = cuda.local.array(RV, dtype=qhat.dtype)
    rm = cuda.local.array(RQ, dtype=qhat.dtype)  # the positions' tile maxima
    cf = cuda.local.array(1, dtype=qhat.dtype)  # a count in the float dtype
    th = u64(ht)
    hh = u64(hs)
    tid = u32(cuda.threadIdx.x)
    ty = u32(tid // u32(TX))
    tx = u32(tid - ty * u32(TX))
    orow = u32(ty * u32(RQ))  # the thread's first position in a tile, its first key, its first value column
    okey = u32(tx * u32(RK))
    ocol = u32(tx * u32(RV))
    d = qhat.shape[2]
    dv = v.shape[2]
    zero = beta - beta
    U = n + L
    lanes = u32(ROWS * TX)  # the pairs' second array starts here in sp
    row_tiles = (L + ROWS - 1) // ROWS
    reads = row_tiles * splits
    assign = w >= reads  # an assignment item: the tile's centroids against the chunk's keys
    item = w - reads if assign else w
    per = ctiles if assign else splits
    a0 = (item // per) * ROWS
    kt = item % per
    u0 = kt * KEYS
    if not assign and u0 > n + min(L, a0 + ROWS) - 1:
        return  # no position of the tile sees a key of it (block-uniform)
    ukeys = n if assign else U  # the keys of the product: centroids only for the assignment
    x_rows = khat if assign else qhat
    for i in range(RQ):
        for c in range(RK):
            acc[i, c] = zero
    for d0 in range(0, d, DC):
        # stage the positions and the keys: entry e is (row e // DC, coordinate e % DC), read along the
        # coordinates, stored coordinate-major
        e = tid
        while e < u32(ROWS * DC):
            r = u32(e // u32(DC))
            t = u32(e - r * u32(DC))
            x = zero
            if a0 + r < L and d0 + t < d:
                x = x_rows[th, u64(s + a0 + r), u64(d0 + t)]
            sa[u32(t * u32(ROWS) + r)] = x
            e = u32(e + u32(NT))
        e = tid
        while e < u32(KEYS * DC):
            r = u32(e // u32(DC))
            t = u32(e - r * u32(DC))
            u = u0 + r
            y = zero
            if u < ukeys and d0 + t < d:
                if u < n:
                    y = Dk[hh, u64(u), u64(d0 + t)]
                elif vq:
                    y = Dk[hh, u64(z[th, u64(s + u - n)]), u64(d0 + t)]
                else:
                    y = khat[th, u64(s + u - n), u64(d0 + t)]
            sb[u32(t * u32(KEYS) + r)] = y
            e = u32(e + u32(NT))
        cuda.syncthreads()
        # the register tile of the product: RQ + RK shared loads (two 128-bit ones on a GPU) for RQ RK
        # multiply-adds per coordinate, STEP coordinates per unrolled step, offsets advanced by constants
        oa = orow
        ob = okey
        for t0 in range(DC // STEP):
            for t in range(STEP):
                for i in range(RQ):
                    ra[i] = sa[oa + u32(t * ROWS + i)]
                for c in range(RK):
                    rb[c] = sb[ob + u32(t * KEYS + c)]
                for i in range(RQ):
                    for c in range(RK):
                        acc[i, c] += ra[i] * rb[c]
            oa = u32(oa + u32(STEP * ROWS))
            ob = u32(ob + u32(STEP * KEYS))
        cuda.syncthreads()
    if assign:
        # the first maximum over the tile's centroids: per thread in index order, then the lanes by a tree
        for i in range(RQ):
            best = ninf
            arg = -1
            for c in range(RK):
                u = u0 + okey + c
                if u < n and (arg < 0 or acc[i, c] > best):
                    best = acc[i, c]
                    arg = u
            slot = u32((orow + u32(i)) * u32(TX) + tx)
            sp[slot] = best
            sarg[slot] = arg
        cuda.syncthreads()
        stride = u32(TX // 2)
        while stride > 0:
            if tx < stride:
                for i in range(RQ):
                    slot = u32((orow + u32(i)) * u32(TX) + tx)
                    other = sarg[slot + stride]
                    mine = sarg[slot]
                    y = sp[slot + stride]
                    x = sp[slot]
                    if other >= 0 and (mine < 0 or y > x or (y == x and other < mine)):
                        sp[slot] = y
                        sarg[slot] = other
            cuda.syncthreads()
            stride = u32(stride // u32(2))
        if tx == 0:
            for i in range(RQ):
                r = u32(orow + u32(i))
                a = a0 + r
                if a < L:
                    abest[hh, u64(kt), u64(a)] = sp[u32(r * u32(TX))]
                    aarg[hh, u64(kt), u64(a)] = sarg[u32(r * u32(TX))]
        cuda.syncthreads()  # the pairs are read before the next item writes its own
        return
    # the logits, masked, and each thread's pair (m, s) per position
    for i in range(RQ):
        a = a0 + orow + i
        m = ninf
        for c in range(RK):
            u = u0 + okey + c
            lg = ninf
            if a < L:
                if u < n:
                    lg = acc[i, c] * beta
                    if count_bias:
                        cnt = counts[hh, u64(u)]
                        if cnt > 0:
                            cf[0] = cnt
                            lg += math.log(cf[0])
                        else:
                            lg = ninf
                elif u < U and u - n <= a:
                    lg = acc[i, c] * beta
            acc[i, c] = lg
            m = max_keep_nan(m, lg)  # NaN, once met, stays (as np.max keeps it)
        tot = zero
        for c in range(RK):
            tot += exp_shifted(acc[i, c], m)
        slot = u32((orow + u32(i)) * u32(TX) + tx)
        sp[slot] = m
        sp[lanes + slot] = tot
    cuda.syncthreads()
    # (m, s) of the lanes combined by an ordered tree: lane t absorbs lane t + stride
    stride = u32(TX // 2)
    while stride > 0:
        if tx < stride:
            for i in range(RQ):
                slot = u32((orow + u32(i)) * u32(TX) + tx)
                m_new, s_new = softmax_combine(sp[slot], sp[lanes + slot], sp[slot + stride], sp[lanes + slot + stride])
                sp[slot] = m_new
                sp[lanes + slot] = s_new
        cuda.syncthreads()
        stride = u32(stride // u32(2))
    for i in range(RQ):
        r = u32(orow + u32(i))
        a = a0 + r
        rm[i] = sp[u32(r * u32(TX))]
        if tx == 0 and a < L and u0 <= n + a:
            pmax[hh, u64(kt), u64(a)] = rm[i]
            psum[hh, u64(kt), u64(a)] = sp[lanes + u32(r * u32(TX))]
    cuda.syncthreads()  # every thread has its maxima before the weights overwrite the pairs
    # the weights, key-major [KEYS, ROWS]: the thread's RQ positions of a key are adjacent
    for c in range(RK):
        for i in range(RQ):
            sp[u32((okey + u32(c)) * u32(ROWS)) + orow + u32(i)] = exp_shifted(acc[i, c], rm[i])
    # the partial numerator: weights [KEYS, ROWS]^T times the tile's values [KEYS, VC], a stage at a time
    for c0 in range(0, dv, VC):
        e = tid
        while e < u32(KEYS * VC):
            r = u32(e // u32(VC))
            col = c0 + (e - r * u32(VC))
            u = u0 + r
            y = zero
            if u < U and col < dv:
                y = Dv[hh, u64(u), u64(col)] if u < n else v[th, u64(s + u - n), u64(col)]
            sv[e] = y
            e = u32(e + u32(NT))
        cuda.syncthreads()
        for i in range(RQ):
            for c in range(RV):
                num[i, c] = zero
        op = orow
        ov = ocol
        for t0 in range(KEYS // STEP):
            for t in range(STEP):
                for i in range(RQ):
                    ra[i] = sp[op + u32(t * ROWS + i)]
                for c in range(RV):
                    rv[c] = sv[ov + u32(t * VC + c)]
                for i in range(RQ):
                    for c in range(RV):
                        num[i, c] += ra[i] * rv[c]
            op = u32(op + u32(STEP * ROWS))
            ov = u32(ov + u32(STEP * VC))
        for i in range(RQ):
            a = a0 + orow + i
            if a < L and u0 <= n + a:
                for c in range(RV):
                    col = c0 + ocol + c
                    if col < dv:
                        pnum[hh, u64(kt), u64(a), u64(col)] = num[i, c]
        cuda.syncthreads()  # the stage is read before the next one is written



# VQ's predict launch of a chunk: its items grid-stride over the blocks (heads on y, z); at the end each block takes a
# ticket (integer atomic, after a fence), and the last block of the head makes the plan (_plan_chunk) and resets the
# ticket.
@kernel(
    lambda f: (
        f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64[:, ::1], int64, int64, f[:, :, ::1], f[:, :, ::1], int64[:, ::1],
        int64, f, f, int32, int64, int64, f[:, :, ::1], f[:, :, ::1], f[:, :, :, ::1], f[:, :, ::1], int64[:, :, ::1],
        int32[::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], f[:, ::1], int64,
        int64[::1], int64, int32, int64,
    ),
    threads=tile_sizes(GPU_GEOMETRY)["NT"],
    options=_launch_bounds,
)
def _predict_kernel(qhat, khat, v, z, s, L, Dk, Dv, counts, n, beta, ninf, flags, splits, ctiles, pmax, psum, pnum, abest,
                    aarg, ticket, rows, seeded, order, srow, cbase, scores, n_add, draws, draw_off, use_draws, H):
    sa = cuda.shared.array(SH_ROWS, dtype=qhat.dtype)  # [DC, ROWS] k^ (assignment) or q^ (read-out) of the positions
    sb = cuda.shared.array(SH_KEYS, dtype=qhat.dtype)  # [DC, KEYS] the tile's keys
    sp = cuda.shared.array(SH_P, dtype=qhat.dtype)  # [ROWS, KEYS] the weights e^{l - m}; before them, the lanes' pairs
    sv = cuda.shared.array(SH_V, dtype=qhat.dtype)  # [KEYS, VC] a stage of the values
    sarg = cuda.shared.array(SH_LANES, dtype=int32)  # [ROWS, TX] the lanes' best centroid
    skey = cuda.shared.array(SH_LANES, dtype=int32)  # the plan's sort keys (rows)
    last = cuda.shared.array(1, dtype=int32)
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    tid = u32(cuda.threadIdx.x)
    for w in range(cuda.blockIdx.x, (L + ROWS - 1) // ROWS * (splits + ctiles), cuda.gridDim.x):
        _predict_item(w, h, h, qhat, khat, v, z, s, L, Dk, Dv, counts, n, beta, ninf, (flags & 1) != 0, (flags & 2) != 0,
                      splits, ctiles, pmax, psum, pnum, abest, aarg, sa, sb, sp, sv, sarg)
    # the last block of the head to finish makes the plan
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        last[0] = 1 if cuda.atomic.add(ticket, h, 1) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return
    cuda.threadfence()
    _plan_chunk(h, h, khat, s, L, n, n_add, (flags & 2) != 0, z, abest, aarg, rows, seeded, order, srow, cbase, scores,
                counts, draws, draw_off, use_draws, sp, sarg, skey)  # the products' shared arrays stage the plan's comparisons
    if tid == 0:
        ticket[h] = 0


# The merge step of a chunk.  Work items w < L d_v: the read-out of position a = w // d_v, column c = w % d_v, the partial
# pairs of the key tiles that row a sees (tile < (n + a) // KEYS + 1) combined in tile order:
#   M = max_tile m_tile (NaN kept),  o_a[c] = sum_tile e^{m_tile - M} num_tile[c] / sum_tile e^{m_tile - M} l_tile,
# rowmax[s + a] = M (non-finite: the row overflowed, refused on the host).
# Work items w >= L d_v: (sorted position p, column col) of [D_k | D_v] (VQ: D_v only); the thread at the first
# position of a run of srow (one centroid m, its members in token order) updates column col of row m:
#   a seeded row starts at its key and value (count 1: cbase); then, for the other members i of S_m, in token order,
#   exact running mean: (c D + sum_S x) / (c + |S|), sums in token order;
#   or D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order.
# VQ: U_m / L_m: running mean of the values each code summarises (gmm.running_mean_update).  Each entry has one
# owner: no atomics, no barrier, no shared memory.  One item: the sequence's tokens are head ``ht`` of ``khat, v, out,
# rowmax`` (rows from ``s``), its partials and dictionary head ``hs`` of the work and state arrays.
@cuda.jit(device=True)
def _merge_item(w, ht, hs, khat, v, s, L, pmax, psum, pnum, n, out, rowmax, Dk, Dv, order, srow, seeded, cbase, eta,
                with_keys, constant_rate, ninf):
    cf = cuda.local.array(2, dtype=Dv.dtype)  # the counts c and c' in the float dtype
    dv = Dv.shape[2]
    wk = Dk.shape[2] if with_keys else 0
    width = wk + dv
    zero = eta - eta
    reads = L * dv
    if w < reads:
        a = w // dv
        c = w % dv
        if a >= L:
            return
        tiles = (n + a) // KEYS + 1
        M = ninf
        for tile in range(tiles):
            x = pmax[hs, tile, a]
            if x > M or x != x:
                M = x
        if c == 0:
            rowmax[ht, s + a] = M
        if math.isfinite(M):
            den = zero
            num = zero
            for tile in range(tiles):
                e = exp_shifted(pmax[hs, tile, a], M)
                den += e * psum[hs, tile, a]
                num += e * pnum[hs, tile, a, c]
            out[ht, s + a, c] = num / den
        else:
            out[ht, s + a, c] = M
        return
    p = (w - reads) // width
    if p >= L:
        return
    m = srow[hs, p]
    if p > 0 and srow[hs, p - 1] == m:
        return  # not the first member of its centroid
    col = (w - reads) % width
    key = col < wk
    c = col if key else col - wk
    D = Dk[hs, m, c] if key else Dv[hs, m, c]
    acc = zero
    cnt = 0
    r = p
    while r < L and srow[hs, r] == m:
        b = order[hs, r]
        x = khat[ht, s + b, c] if key else v[ht, s + b, c]
        if seeded[hs, b] != 0:
            D = x
        else:
            cnt += 1
            if constant_rate:
                D = D + eta * (x - D)
            else:
                acc += x
        r += 1
    if cnt > 0 and not constant_rate:
        cf[0] = cbase[hs, p]
        cf[1] = cbase[hs, p] + cnt
        D = (cf[0] * D + acc) / cf[1]
    if key:
        Dk[hs, m, c] = D
    else:
        Dv[hs, m, c] = D


# VQ's merge launch of a chunk: its items grid-stride (blocks of FLAT threads), heads on y, z.
@kernel(
    lambda f: (
        f[:, :, ::1], f[:, :, ::1], int64, int64, f[:, :, ::1], f[:, :, ::1], f[:, :, :, ::1], int64,
        f[:, :, ::1], f[:, ::1], f[:, :, ::1], f[:, :, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1],
        int64[:, ::1], f, int32, f, int64,
    ),
    threads=GPU_GEOMETRY["FLAT"],
)
def _merge_kernel(khat, v, s, L, pmax, psum, pnum, n, out, rowmax, Dk, Dv, order, srow, seeded, cbase, eta,
                  flags, ninf, H):
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    with_keys = (flags & 1) != 0
    total = L * (Dv.shape[2] + (Dk.shape[2] if with_keys else 0) + Dv.shape[2])
    for w in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, total, cuda.gridDim.x * cuda.blockDim.x):
        _merge_item(w, h, h, khat, v, s, L, pmax, psum, pnum, n, out, rowmax, Dk, Dv, order, srow, seeded, cbase, eta,
                    with_keys, (flags & 2) != 0, ninf)


# OVQ's whole chunk loop in one cooperative launch, for J sequences at once (one call's sequence, or a packed call's).
# Sequence j's tokens are rows of head 0 of qhat, khat, v, out, rowmax; its dictionary, counts and work arrays are head j
# of theirs.  plans[j, r] = (s, L, n, n_add, draw offset, uses draws) of its r-th chunk (s the chunk's first token row,
# L = 0 past its last chunk).  Round r is every sequence's r-th chunk, in three steps, each ended by a grid-wide barrier
# (this_grid().sync(): launched cooperatively, every block resident):
#   1. predict: the work items of every sequence (those of _predict_kernel's launch, sequence after sequence) dealt to the
#      blocks in turn (item g of the round to block g mod G; reads[r, j] counts the items of sequences <= j);
#   2. plan: sequence j's by block j mod G (_plan_chunk: its tiles' assignments are all written, the barrier says so);
#   3. merge: the items of every sequence (those of _merge_kernel's launch; merges[r, j] counts them) dealt to the G NT
#      threads in turn.
# Every item and every plan computes what it computes in the two launches of the chunk, whichever block takes it, and
# reads only what an earlier step wrote: the bits are those of the launches.
@kernel(
    lambda f: (
        f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64[:, ::1], int64[:, :, ::1], int64[:, ::1], int64[:, ::1],
        f[:, :, ::1], f[:, :, ::1], int64[:, ::1], f, f, int32, f, int32, f[:, :, ::1], f[:, :, ::1], f[:, :, :, ::1], f[:, :, ::1],
        int64[:, :, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], f[:, ::1],
        int64[::1], f[:, :, ::1], f[:, ::1],
    ),
    threads=tile_sizes(GPU_GEOMETRY)["NT"],
    options=_loop_bounds,
)
def _chunk_loop_kernel(qhat, khat, v, z, plans, reads, merges, Dk, Dv, counts, beta, ninf, read_flags, eta, merge_flags,
                       pmax, psum, pnum, abest, aarg, rows, seeded, order, srow, cbase, scores, draws, out, rowmax):
    # the predict kernel's shared arrays, 16-byte aligned: relocatable code leaves their placement to the linker, so
    # ptxas reads them 128 bits at a time only where the declaration promises the alignment
    sa = cuda.shared.array(SH_ROWS, dtype=qhat.dtype, alignment=SHARED_ALIGN)
    sb = cuda.shared.array(SH_KEYS, dtype=qhat.dtype, alignment=SHARED_ALIGN)
    sp = cuda.shared.array(SH_P, dtype=qhat.dtype, alignment=SHARED_ALIGN)
    sv = cuda.shared.array(SH_V, dtype=qhat.dtype, alignment=SHARED_ALIGN)
    sarg = cuda.shared.array(SH_LANES, dtype=int32)
    skey = cuda.shared.array(SH_LANES, dtype=int32)
    J = plans.shape[0]
    for r in range(plans.shape[1]):
        # predict: item g of the round is item g - reads[r, j - 1] of the sequence j that holds it
        for g in range(cuda.blockIdx.x, reads[r, J - 1], cuda.gridDim.x):
            j = _holder(reads, r, g)
            L = plans[j, r, 1]
            n = plans[j, r, 2]
            _predict_item(g - (reads[r, j - 1] if j > 0 else 0), 0, j, qhat, khat, v, z, plans[j, r, 0], L, Dk, Dv, counts,
                          n, beta, ninf, (read_flags & 1) != 0, False, (n + L + KEYS - 1) // KEYS, (n + KEYS - 1) // KEYS,
                          pmax, psum, pnum, abest, aarg, sa, sb, sp, sv, sarg)
        cuda.cg.this_grid().sync()  # the grid's handle asked at each barrier: none is kept live across the loop
        for j in range(cuda.blockIdx.x, J, cuda.gridDim.x):
            if plans[j, r, 1] > 0:
                _plan_chunk(0, j, khat, plans[j, r, 0], plans[j, r, 1], plans[j, r, 2], plans[j, r, 3], False, z, abest,
                            aarg, rows, seeded, order, srow, cbase, scores, counts, draws, plans[j, r, 4], plans[j, r, 5],
                            sp, sarg, skey)
        cuda.cg.this_grid().sync()
        for g in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, merges[r, J - 1],
                       cuda.gridDim.x * cuda.blockDim.x):
            j = _holder(merges, r, g)
            _merge_item(g - (merges[r, j - 1] if j > 0 else 0), 0, j, khat, v, plans[j, r, 0], plans[j, r, 1], pmax, psum,
                        pnum, plans[j, r, 2], out, rowmax, Dk, Dv, order, srow, seeded, cbase, eta, True,
                        (merge_flags & 2) != 0, ninf)
        cuda.cg.this_grid().sync()


# The sequence holding item g of round r: the first j with ends[r, j] > g (ends the running sums of the sequences' items
# in the round), by bisection.
@cuda.jit(device=True)
def _holder(ends, r, g):
    lo = 0
    hi = ends.shape[1] - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[r, mid] > g:
            hi = mid
        else:
            lo = mid + 1
    return lo


# counts[m] = p0 + 2^24 p1 + 2^48 p2 with 0 <= p_i < 2^24: each piece exact in float32, so the counts share the
# call's one copy to the host.  One thread per row (blocks of FLAT, grid-stride; heads on y, z).
@kernel(lambda f: (int64[:, ::1], f[:, :, ::1], int64), threads=GPU_GEOMETRY["FLAT"])
def _pack_counts_kernel(counts, packed, H):
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    for m in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, counts.shape[1], cuda.gridDim.x * cuda.blockDim.x):
        c = counts[h, m]
        packed[h, m, 0] = c % _PIECE
        packed[h, m, 1] = (c // _PIECE) % _PIECE
        packed[h, m, 2] = c // (_PIECE * _PIECE)


# ---------------------------------------------------------------------------
# Host loops
# ---------------------------------------------------------------------------


class _Work(NamedTuple):
    """Scratch of the chunk kernels (device arrays), allocated once per call."""

    pmax: object
    psum: object
    pnum: object
    abest: object
    aarg: object
    ticket: object
    rows: object
    seeded: object
    order: object
    srow: object
    cbase: object
    scores: object


def _scratch(g, H, d_v, dtype):
    S, Cm = g.splits, g.chunk
    return _Work(
        cuda.device_array((H, S, Cm), dtype), cuda.device_array((H, S, Cm), dtype), cuda.device_array((H, S, Cm, d_v), dtype),
        cuda.device_array((H, S, Cm), dtype), cuda.device_array((H, S, Cm), np.int64), cuda.to_device(np.zeros(H, np.int32)),
        *(cuda.device_array((H, Cm), np.int64) for _ in range(5)), cuda.device_array((H, Cm), dtype),
    )


def _chunk_plans(N, p, n, t):
    """Per chunk ``(s, L, n, n_add, draw offset, uses draws)``, the drawn seeds of ``init="random"`` (a list of arrays,
    chunk after chunk), and ``(n, t)`` after the last chunk."""
    plans, draws = [], []
    offset = 0
    for s in range(0, N, p.chunk_size):
        L = min(s + p.chunk_size, N) - s
        # grow: n' = max(n, growth(t + L, n_max))
        n_next = max(n, ovq.dictionary_size(t + L, p.max_size, p.growth))
        n_add = n_next - n
        use = bool(n and n_add and p.init == "random")
        if use:
            # refimpl's generator, in centroid order: drawn[r] seeds row n + r
            draws.append(np.random.default_rng([p.seed, t]).choice(L, size=n_add, replace=False).astype(np.int64))
        plans.append((s, L, n, n_add, offset, use))
        offset += n_add if use else 0
        n, t = n_next, t + L
    return plans, draws, n, t


def loop_plans(sequences, p):
    """The chunk table of :func:`_chunk_loop_kernel` for ``sequences``, ``[(first token row, length >= 1, n, t)]``.

    Returns
    -------
    plans : ndarray of int64, shape (J, R, 6)
        ``plans[j, r] = (s, L, n, n_add, draw offset, uses draws)`` of the
        ``r``-th chunk of sequence ``j`` (``s`` its first token row), ``R``
        the most chunks of a sequence; zeros (``L = 0``) past a sequence's
        last chunk.
    draws : ndarray of int64
        Every drawn seed of every sequence, in one array (one zero if none).
    ends : list of tuple
        ``(n, t)`` of each sequence after its last chunk.
    """
    per, draws, ends = [], [], []
    offset = 0
    for start, N, n, t in sequences:
        plans, drawn, n_end, t_end = _chunk_plans(N, p, n, t)
        per.append([(start + s, L, n0, n_add, offset + off, use) for s, L, n0, n_add, off, use in plans])
        draws += drawn
        offset += sum(x.size for x in drawn)
        ends.append((n_end, t_end))
    table = np.zeros((len(per), max(len(x) for x in per), 6), np.int64)
    for j, chunks in enumerate(per):
        table[j, : len(chunks)] = chunks
    return table, (np.concatenate(draws) if draws else np.zeros(1, np.int64)), ends


def loop_items(plans, per_key):
    """``(reads, merges)``, int64 ``(R, J)``: the running sums over the sequences of each round's predict items (read-out
    and assignment tiles, as :meth:`Geometry.predict_for` counts them) and merge items (``per_key`` a key)."""
    L, n = plans[:, :, 1].T, plans[:, :, 2].T
    reads = -(-L // ROWS) * (-(-(n + L) // KEYS) + -(-n // KEYS))
    return np.ascontiguousarray(np.cumsum(reads, axis=1)), np.ascontiguousarray(np.cumsum(L * per_key, axis=1))


def _normalise(q, k, g):
    qhat = cuda.device_array(q.shape, dtype=q.dtype)
    khat = cuda.device_array(k.shape, dtype=k.dtype)
    _unit_rows_kernel[g.unit[0], g.unit[1]](q, k, qhat, khat, q.dtype.type(ovq.NORM_EPS), q.shape[0])
    return qhat, khat


def _loop_blocks(loop, args, items):
    """The blocks of a cooperative launch of ``loop`` on ``args``: as many as can be resident at once, at most ``items``.

    The simulator runs a cooperative grid of one block only (its grid barrier is a block barrier)."""
    if SIMULATOR:
        return 1
    compiled = loop.compile(tuple(loop.typeof_pyval(x) for x in args))
    return max(1, min(compiled.max_cooperative_grid_blocks(NT), items))


def _ovq_loop(q, k, v, p, Dk, Dv, counts, sequences):
    """Core: ``(out, rowmax, ends)`` of the sequences ``[(first row, length, n, t)]`` of device arrays ``q, k (1, T, d)``,
    ``v (1, T, d_v)``, sequence ``j``'s state in ``Dk[j], Dv[j], counts[j]`` (updated in place); ``ends`` its ``(n, t)``
    after the call.  The chunk loop of every sequence is one launch of :func:`_chunk_loop_kernel`."""
    T, d, d_v = q.shape[1], q.shape[2], v.shape[2]
    f = q.dtype.type
    plans, draws, ends = loop_plans(sequences, p)
    qhat, khat = _normalise(q, k, launch_geometry(T, 1, d, d_v, p.max_size, p.chunk_size))
    g = launch_geometry(max(N for _, N, _, _ in sequences), len(sequences), d, d_v, p.max_size, p.chunk_size)
    w = _scratch(g, len(sequences), d_v, q.dtype)
    out = cuda.device_array((1, T, d_v), dtype=q.dtype)
    rowmax = cuda.device_array((1, T), dtype=q.dtype)
    reads, merges = loop_items(plans, d + 2 * d_v)
    args = (qhat, khat, v, cuda.device_array((1, 1), np.int64), cuda.to_device(plans), cuda.to_device(reads),
            cuda.to_device(merges), Dk, Dv, counts, f(p.beta), f(-np.inf),
            np.int32(1 if p.count_bias else 0), f(0 if p.eta is None else p.eta), np.int32(1 | (2 if p.eta is not None else 0)),
            w.pmax, w.psum, w.pnum, w.abest, w.aarg, w.rows, w.seeded, w.order, w.srow, w.cbase, w.scores,
            cuda.to_device(draws), out, rowmax)
    loop = _loop(q.dtype)
    loop[_loop_blocks(loop, args, int(reads[:, -1].max())), NT](*args)
    return out, rowmax, ends


def _vq_run(q, k, v, codebook, C, beta):
    """Core of :func:`vq_attention`: ``(out, rowmax)`` from device arrays ``(H, N, .)`` and a codebook ``(H, S, d)``."""
    H, N, d = q.shape
    S, d_v, dtype = codebook.shape[1], v.shape[2], q.dtype
    g = launch_geometry(N, H, d, d_v, S, C, with_keys=False)
    qhat, khat = _normalise(q, k, g)
    z = cuda.device_array((H, N), np.int64)
    _codes_kernel[g.codes[0], g.codes[1]](khat, codebook, z, H)
    value_means = cuda.to_device(np.zeros((H, S, d_v), dtype))
    counts = cuda.to_device(np.zeros((H, S), np.int64))
    w = _scratch(g, H, d_v, dtype)
    no_draw = cuda.to_device(np.zeros(1, np.int64))
    out = cuda.device_array((H, N, d_v), dtype=dtype)
    rowmax = cuda.device_array((H, N), dtype=dtype)
    b, ninf = dtype.type(beta), dtype.type(-np.inf)
    predict = _predict(dtype)
    for s in range(0, N, C):
        L = min(s + C, N) - s
        # past codes (log L_m) and the current chunk through its codes; the plan buckets the chunk's keys by code
        grid, threads, tiles, _ = g.predict_for(S, L)
        predict[grid, threads](
            qhat, khat, v, z, s, L, codebook, value_means, counts, S, b, ninf, np.int32(3), tiles, 0, w.pmax, w.psum,
            w.pnum, w.abest, w.aarg, w.ticket, w.rows, w.seeded, w.order, w.srow, w.cbase, w.scores, 0, no_draw, 0,
            np.int32(0), H,
        )
        # U_m / L_m: running mean of the values each code summarises
        _merge_kernel[g.merge_for(L)](
            khat, v, s, L, w.pmax, w.psum, w.pnum, S, out, rowmax, codebook, value_means, w.order, w.srow,
            w.seeded, w.cbase, b - b, np.int32(0), ninf, H,
        )
    return out, rowmax


def _overflow(checks, rowmax):
    """``(rows whose logits have no finite maximum, the first of them)``, from the checks; a copy only when some overflowed."""
    if not checks.failed("rowmax"):
        return 0, -1
    bad = ~np.isfinite(rowmax.copy_to_host().ravel())
    return int(np.sum(bad)), int(np.argmax(bad))


def _heads(x):
    """A device array ``(N, m)`` as ``(1, N, m)``, the kernels' layout (a view)."""
    return x.reshape(1, *x.shape)


def _unpack_counts(packed):
    pieces = np.rint(packed.reshape(-1, 3)).astype(np.int64)
    return pieces[:, 0] + _PIECE * pieces[:, 1] + _PIECE * _PIECE * pieces[:, 2]


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _state_arrays(states, n_max, d, d_v, dtype):
    """``(Dk, Dv, counts)`` on the device, sequence ``j``'s dictionary from ``states[j]`` (an :class:`OVQState`, or
    ``None``: empty), and the ``(n, t)`` each starts from."""
    Dk, Dv = np.zeros((len(states), n_max, d), dtype), np.zeros((len(states), n_max, d_v), dtype)
    counts = np.zeros((len(states), n_max), np.int64)
    for j, st in enumerate(states):
        if st is not None:
            Dk[j], Dv[j], counts[j] = st.keys, st.values, st.counts
    starts = [(0, 0) if st is None else (st.size, st.tokens_seen) for st in states]
    return cuda.to_device(Dk), cuda.to_device(Dv), cuda.to_device(counts), starts


def _queue_states(checks, Dk, Dv, counts, chunk_size):
    """The dictionaries and counts as parts of the call's one copy (:meth:`Checks.rows`); the counts in 24-bit pieces."""
    J, n_max, d = Dk.shape
    packed = cuda.device_array((J, n_max, 3), Dk.dtype)
    g = launch_geometry(1, J, d, Dv.shape[2], n_max, chunk_size)
    _pack_counts_kernel[g.pack[0], g.pack[1]](counts, packed, J)
    for x, name in ((Dk, "keys"), (Dv, "values"), (packed, "counts")):
        checks.rows(x, name)


def _fetched_states(checks, ends, n_max, d, d_v):
    """The :class:`OVQState` of each sequence from the call's copy (:func:`_queue_states`), ``ends`` their ``(n, t)``."""
    J = len(ends)
    keys, values = checks.part("keys").reshape(J, n_max, d), checks.part("values").reshape(J, n_max, d_v)
    counts = _unpack_counts(checks.part("counts")).reshape(J, n_max)
    return [ovq.OVQState(keys[j].copy(), values[j].copy(), counts[j].copy(), *ends[j]) for j in range(J)]


def _ovq_attention_kernel(xp, a, given, return_state):
    """:func:`refimpl.ovq.ovq_attention` on refimpl's checked arguments: the chunk loop on the device, the state kept there."""
    q, k, v = given
    on_device = any_device(q, k, v)
    inputs = ((q, "q"), (k, "k"), (v, "v"))
    if not on_device:
        q, k, v = a.q, a.k, a.v
    q, k, v = (to_device(x, a.dtype) for x in (q, k, v))
    checks = Checks(a.dtype)
    if on_device:
        for x, (_, name) in zip((q, k, v), inputs):
            checks.finite(x, name)
    N, d, d_v, n_max = q.shape[0], q.shape[1], v.shape[1], a.params.max_size
    Dk, Dv, counts, ((n, t),) = _state_arrays([a.state], n_max, d, d_v, a.dtype)
    out, rowmax, ends = _ovq_loop(_heads(q), _heads(k), _heads(v), a.params, Dk, Dv, counts, [(0, N, n, t)])
    checks.finite(rowmax, "rowmax")
    if not on_device:
        checks.rows(out, "out")
    if return_state:
        _queue_states(checks, Dk, Dv, counts, a.params.chunk_size)
    # the one copy of the call: every check, the state and a host caller's output at once
    raise_bad_inputs(checks.fetch(), inputs)
    ovq.check_overflow(_overflow(checks, rowmax), a.state, a.dtype)
    out = out.reshape(N, d_v) if on_device else checks.part("out").reshape(N, d_v).copy()
    if not return_state:
        return out
    return out, _fetched_states(checks, ends, n_max, d, d_v)[0]


def _packed_ovq_attention_kernel(xp, a, given, offsets, states, return_state):
    """A packed :func:`refimpl.ovq.ovq_attention` (``cu_seqlens``): every sequence's chunk loop in one launch.

    ``a`` is refimpl's check of the whole packed arrays, ``offsets`` the
    checked ``cu_seqlens``, ``states`` one incoming state (or ``None``) per
    sequence.  Each sequence is computed as its own call computes it, with its
    own dictionary; one state per sequence comes back.  Left to the
    per-sequence loop (``NotImplemented``), which words the reference's
    refusals for the sequence's own rows: a state that would raise the dtype,
    a state refused for its own sequence, an overflowed row.
    """
    p, dtype = a.params, a.dtype
    (T, d), d_v, n_max = a.q.shape, a.v.shape[1], p.max_size
    lengths = np.diff(offsets)
    if ovq.states_left_to_the_loop(a.q, a.v, dtype, p, lengths, states):
        return NotImplemented
    live = [i for i, n in enumerate(lengths.tolist()) if n]
    Dk, Dv, counts, starts = _state_arrays([states[i] for i in live], n_max, d, d_v, dtype)
    sequences = [(int(offsets[i]), int(lengths[i]), n, t) for i, (n, t) in zip(live, starts)]
    q, k, v = (to_device(x, dtype).reshape(1, T, x.shape[1]) for x in (a.q, a.k, a.v))
    out, rowmax, ends = _ovq_loop(q, k, v, p, Dk, Dv, counts, sequences)
    checks = Checks(dtype)
    checks.finite(rowmax, "rowmax")
    checks.rows(out, "out")
    if return_state:
        _queue_states(checks, Dk, Dv, counts, p.chunk_size)
    # the one copy of the call: the overflow check, the output and the states at once
    if checks.fetch().failed("rowmax"):
        return NotImplemented  # the loop refuses it, naming the sequence's row
    out = checks.part("out").reshape(T, d_v).copy()
    if not return_state:
        return out
    new = [None] * len(states)
    for i, st in zip(live, _fetched_states(checks, ends, n_max, d, d_v)):
        new[i] = st
    return out, ovq.sequence_states(new, states, n_max, a.q, a.v, dtype)


def _vq_attention_kernel(xp, a, given):
    """:func:`refimpl.ovq.vq_attention` on refimpl's checked arguments, on the device."""
    q, k, v, codebook = given
    on_device = any_device(q, k, v, codebook)
    dtype = a.q.dtype
    inputs = ((q, "q"), (k, "k"), (v, "v"), (codebook, "codebook"))
    if not any_device(q, k, v):
        q, k, v = a.q, a.k, a.v
    if not any_device(codebook):
        codebook = a.codebook
    q, k, v, codebook = (to_device(x, dtype) for x in (q, k, v, codebook))
    checks = Checks(dtype)
    for x, (orig, name) in zip((q, k, v, codebook), inputs):
        if any_device(orig):
            checks.finite(x, name)
    N, d_v = q.shape[0], v.shape[1]
    out, rowmax = _vq_run(_heads(q), _heads(k), _heads(v), _heads(codebook), a.chunk_size, a.beta)
    checks.finite(rowmax, "rowmax")
    if not on_device:
        checks.rows(out, "out")
    # the one copy of the call: every check and a host caller's output at once
    raise_bad_inputs(checks.fetch(), inputs)
    validation.check_overflowed_rows(*_overflow(checks, rowmax), dtype, "beta, codebook", "lower beta or rescale the codebook")
    return out.reshape(N, d_v) if on_device else checks.part("out").reshape(N, d_v).copy()


#: The public functions, bound to refimpl's boundary (signatures, docstrings and checks written once there).
_NOTES = {
    "ovq_attention": "The chunk loop in one cooperative launch, a packed call's sequences together (module docstring), "
                     "and one copy to the host per call: the result checks, with "
                     "the state and a host caller's output.",
    "vq_attention": "Two launches per chunk, after one that finds every key's code; one copy to the host per call.",
}
_public = boundary.bind(backend({"ovq_attention": _ovq_attention_kernel, "vq_attention": _vq_attention_kernel,
                                 "packed ovq_attention": _packed_ovq_attention_kernel}, _NOTES),
                        module=__name__)
ovq_attention = _public.ovq_attention
vq_attention = _public.vq_attention
