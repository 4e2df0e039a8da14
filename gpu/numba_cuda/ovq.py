r"""Online vector-quantized (OVQ) attention and the static-dictionary VQ baseline on the GPU (:mod:`refimpl.ovq`).

One head, one sequence: ``q, k`` are ``(N, d)``, ``v`` is ``(N, d_v)``.  The
contract is :mod:`refimpl.ovq`'s, word for word: unit rows, predict then
update chunk by chunk, growth, spread or random seeding, argmax assignment
with ties to the lowest index, the running-mean or constant-rate update in
token order, streaming through :class:`refimpl.ovq.OVQState`, and the same
checks and messages (the checkers are :mod:`refimpl.ovq`'s own).

Launch plan: two launches per chunk
-----------------------------------
The kernels take ``H`` independent sequences (heads) of the same length at
once, arrays ``(H, N, d)``; the public functions pass ``H = 1``.  The host
walks the chunks ``[s, e)``, ``L = e - s``, in order; the state (``D_k``,
``D_v``, the counts) lives on the device from the first chunk to the last.
Every size the plan needs (``n``, ``t``, ``n' = max(n, growth(t + L))``) and,
for ``init="random"``, every chunk's seeds (refimpl's generator) are known on
the host before the first launch: they are computed once and the seeds
uploaded together, so chunks follow each other without a synchronisation.

* once per call: :func:`_unit_rows_kernel` (``q^``, ``k^``); for VQ
  :func:`_codes_kernel` (every key's code: the codebook is fixed);
* per chunk, exactly two launches:

  1. :func:`_predict_kernel`, flash-decoding style.  The key axis of the
     chunk, ``u < n + L`` (the centroids, then the chunk's keys), is cut into
     ``splits`` tiles of ``KEYS`` keys and the chunk's positions into
     ``row_tiles`` tiles of ``ROWS``; one block per (row tile, key tile)
     writes, for each of its query rows, the partial softmax of the tile
     (its maximum, its sum of ``exp(l - max)`` and the numerator over the
     values), and for each of its keys the best centroid of the tile (the
     assignment, against the same centroid slab in shared memory).  The last
     block of a head to finish (an integer ticket: which block it is does not
     change any result) makes the chunk's plan: the nearest centroids
     (tiles combined in centroid order), the seeds, the keys sorted stably by
     their row (bucketed by centroid) and the new counts;
  2. :func:`_merge_kernel`: the partial softmaxes combined in key-tile order
     into ``o_a`` (one thread per output entry) and, in other threads of the
     same launch, the update of the touched centroids: one thread per
     (centroid, column) walking only that centroid's members, in token order.

  Launch 2 reads no array launch 1 of the same chunk still writes, and the
  next chunk's launch 1 reads the state launch 2 wrote: the stream's order
  is the only synchronisation.  No float atomics: every sum has one owner
  and a fixed order, so two runs with the same geometry give the same bits.

The geometry of every launch is :func:`launch_geometry`, a pure function of
the shapes (each chunk's predict and merge grids are cut to the tiles it has,
:meth:`Geometry.predict_for`, :meth:`Geometry.merge_for`, pure functions of
``n`` and ``L``); block sizes are the module constants :data:`ROWS`, :data:`KEYS`,
:data:`SLAB`, :data:`FLAT` (smaller in the simulator, where every thread is
a Python thread; :func:`block_sizes` switches the simulator to the GPU's,
:data:`GPU_GEOMETRY`).
Grids stay within the hardware's limits for any ``N`` and ``H``: the heads
go to ``(gridDim.y, gridDim.z)``, the work to ``gridDim.x``, with grid-stride
loops when it is larger.

Cost per chunk: the read-out and the assignment ``O(L (n + L) (d + d_v))``
spread over ``ceil(L / ROWS) ceil((n + L) / KEYS)`` blocks; the plan
``O(L^2)`` integer and score comparisons in one block per head (the stable
ranks of the seeding scores and of the rows: each of its threads reads the
chunk's ``L`` rows, which stay in the caches); the update ``O(L (d + d_v))``,
each member read once per column, by the thread of its centroid only.  Working
memory: the partials, ``splits x C x (d_v + 3)`` floats and ``splits x C``
integers per head.

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
from numba import cuda, int32, int64

from refimpl import ovq, validation

from ._device import SIMULATOR, Checks, any_device, blocks, host_view, kernel, raise_bad_inputs, to_device
from ._primitives import exp_shifted

__all__ = ["ovq_attention", "vq_attention", "launch_geometry", "Geometry", "block_sizes", "GPU_GEOMETRY", "SIMULATOR_GEOMETRY"]

#: The block sizes on a GPU: ``ROWS`` query rows by ``KEYS`` keys per block of the predict kernel (one warp per row),
#: feature slabs of ``SLAB``, ``FLAT`` threads per one-dimensional block.
GPU_GEOMETRY = {"ROWS": 8, "KEYS": 32, "SLAB": 32, "FLAT": 256}
#: The block sizes in the CUDA simulator (every thread a Python thread).
SIMULATOR_GEOMETRY = {"ROWS": 2, "KEYS": 4, "SLAB": 4, "FLAT": 16}
_G = SIMULATOR_GEOMETRY if SIMULATOR else GPU_GEOMETRY
#: Query rows (chunk positions) per predict block.
ROWS = _G["ROWS"]
#: Keys (centroids or chunk keys) per key tile: the split of the read-out, the tile of the assignment.
KEYS = _G["KEYS"]
#: Features per shared-memory slab of the dot products.
SLAB = _G["SLAB"]
#: Threads of a one-dimensional block (merge, unit rows, codes).
FLAT = _G["FLAT"]

#: Shared-array sizes of the predict kernel, from the block sizes (compile-time constants).
ROW_SLAB = ROWS * SLAB
KEY_SLAB = KEYS * (SLAB + 1)
ROW_KEYS = ROWS * KEYS
KEY_KEYS = KEYS * KEYS


def _derive(sizes):
    """The module's block sizes and shared-array sizes for ``sizes`` (a dict like :data:`GPU_GEOMETRY`)."""
    r, k, s, f = sizes["ROWS"], sizes["KEYS"], sizes["SLAB"], sizes["FLAT"]
    return {"ROWS": r, "KEYS": k, "SLAB": s, "FLAT": f, "ROW_SLAB": r * s, "KEY_SLAB": k * (s + 1), "ROW_KEYS": r * k,
            "KEY_KEYS": k * k}


@contextlib.contextmanager
def block_sizes(sizes):
    """Within the block, launch with the block sizes ``sizes`` (e.g. :data:`GPU_GEOMETRY`); the simulator only.

    On a GPU the kernels are compiled with the sizes the module was imported
    with (they are compile-time constants), so only the simulator can switch.
    """
    if not SIMULATOR:
        raise RuntimeError("block_sizes: the block sizes are compile-time constants on a GPU; switch them in the simulator")
    module = globals()
    saved = {name: module[name] for name in _derive(sizes)}
    module.update(_derive(sizes))
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
    d_v: int  #: value columns (the read-out's items per key)
    width: int  #: columns the update writes per key, ``d + d_v`` (VQ: ``d_v``)

    def predict_for(self, n, L):
        """``(grid, threads, key tiles)`` of the predict launch of a chunk of ``L`` keys read against ``n`` centroids.

        The :attr:`predict` grid cut to the tiles the chunk has:
        ``ceil(L / ROWS) ceil((n + L) / KEYS)`` blocks (capped at 2^31 - 1).
        """
        tiles = -(-(n + L) // KEYS)
        (_, y, z), threads = self.predict
        return (min(-(-L // ROWS) * tiles, MAX_GRID_X), y, z), threads, tiles

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
    width = (d + d_v) if with_keys else d_v

    def x(items):
        return min(max(1, int(items)), MAX_GRID_X)

    return Geometry(
        unit=((x(blocks(N, FLAT // KEYS)), y2, z2), FLAT),
        codes=((x(blocks(N, FLAT)), y, z), FLAT),
        predict=((x(row_tiles * splits), y, z), ROWS * KEYS),
        merge=((x(blocks(Cm * (d_v + width), FLAT)), y, z), FLAT),
        pack=((x(blocks(n_max, FLAT)), y, z), FLAT),
        chunk=Cm,
        splits=splits,
        row_tiles=row_tiles,
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


# The chunk's plan, by the last block of launch 1 (all the tiles' assignments are written), for head h:
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
# The block's threads stride over the keys; each phase ends with a barrier (global writes of a block are visible to
# its threads after it).
@cuda.jit(device=True)
def _plan_chunk(h, khat, s, L, n, n_add, vq, z, abest, aarg, rows, seeded, order, srow, cbase, scores, counts,
                draws, draw_off, use_draws):
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    d = khat.shape[2]
    tiles = (n + KEYS - 1) // KEYS
    for b in range(tid, L, nth):
        if vq:
            rows[h, b] = z[h, s + b]
        elif n == 0:
            rows[h, b] = 0
            acc = khat[h, s + b, 0] * khat[h, s, 0]
            for c in range(1, d):
                acc += khat[h, s + b, c] * khat[h, s, c]
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
    if n_add > 0:
        if use_draws:
            for r in range(tid, n_add, nth):
                b = draws[draw_off + r]
                rows[h, b] = n + r
                seeded[h, b] = 1
        else:
            start = 1 if n == 0 else 0
            for b in range(tid, L, nth):
                rank = 0
                if b >= start:
                    rank = start
                    x = scores[h, b]
                    for o in range(start, L):
                        y = scores[h, o]
                        if y < x or (y == x and o < b):
                            rank += 1
                if rank < n_add:
                    rows[h, b] = n + rank
                    seeded[h, b] = 1
    cuda.syncthreads()
    for b in range(tid, L, nth):
        rb = rows[h, b]
        pos = 0
        for o in range(L):
            ro = rows[h, o]
            if ro < rb or (ro == rb and o < b):
                pos += 1
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


# Launch 1 of a chunk, predict before the chunk touches the state: position a (row s + a) attends, in one softmax, to
#   l_{a,u} = beta q^_a . D_k[u] + log c_u (u < n)       a centroid of count c stands for c tokens: weight pi ~ c, logit + log c
#   l_{a,u} = beta q^_a . k^_b, b = u - n <= a           causal inside the chunk: position a sees the chunk keys b <= a only
#   o_a = softmax(l_a) [D_v[:n]; v_0..v_a]
# VQ: D_k is the codebook and the chunk key b is D_k[z[s + b]] (past = b q^ . D_k[m] + log L_m, -inf for codes no earlier
# chunk used; current = b q^_a . D_k[z_b]).
# The key axis u < n + L is cut into tiles of KEYS and the positions into tiles of ROWS; work item w = (row tile
# w // splits, key tile w % splits), visited grid-stride.  For its rows a and keys u the block writes the partial pair
# of the tile (m = max_u l_{a,u}, NaN kept; l = sum_u e^{l_{a,u} - m}) to pmax, psum and the partial numerator
# sum_u e^{l_{a,u} - m} values[u] to pnum (only rows that see a key of the tile: u0 <= n + a), and, for the tile's
# centroids (u < n), each chunk key's best centroid of the tile (the first maximum) to abest, aarg.
# Block: ROWS x KEYS threads, thread (i, j) owns the logit (row a0 + i, key u0 + j) and its similarity k^_{a0+i} . D_k[u0+j];
# shared memory: feature slabs of q^ and k^ [ROWS, SLAB], of the tile's keys [KEYS, SLAB + 1] (padded: lanes j read
# column t), the tile's logits, then weights, [ROWS, KEYS], the similarities [ROWS, KEYS], value slabs [KEYS, KEYS].
# Each thread of row i finds the row's maximum by reading the row of logits (broadcast loads, no reduction).
# At the end each block takes a ticket (integer atomic, after a fence); the last block of the head makes the plan
# (_plan_chunk) and resets the ticket.
@kernel(
    lambda f: (
        f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64[:, ::1], int64, int64, f[:, :, ::1], f[:, :, ::1], int64[:, ::1],
        int64, f, f, int32, int64, f[:, :, ::1], f[:, :, ::1], f[:, :, :, ::1], f[:, :, ::1], int64[:, :, ::1],
        int32[::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], f[:, ::1], int64,
        int64[::1], int64, int32, int64,
    ),
    threads=GPU_GEOMETRY["ROWS"] * GPU_GEOMETRY["KEYS"],
)
def _predict_kernel(qhat, khat, v, z, s, L, Dk, Dv, counts, n, beta, ninf, flags, splits, pmax, psum, pnum, abest,
                    aarg, ticket, rows, seeded, order, srow, cbase, scores, n_add, draws, draw_off, use_draws, H):
    sq = cuda.shared.array(ROW_SLAB, dtype=qhat.dtype)  # [ROWS, SLAB] q^ of the tile's rows
    sk = cuda.shared.array(ROW_SLAB, dtype=qhat.dtype)  # [ROWS, SLAB] k^ of the same positions (the assignment)
    sd = cuda.shared.array(KEY_SLAB, dtype=qhat.dtype)  # [KEYS, SLAB + 1] the tile's keys
    sl = cuda.shared.array(ROW_KEYS, dtype=qhat.dtype)  # [ROWS, KEYS] logits, then e^{l - m}
    sa = cuda.shared.array(ROW_KEYS, dtype=qhat.dtype)  # [ROWS, KEYS] similarities k^ . D_k
    sv = cuda.shared.array(KEY_KEYS, dtype=qhat.dtype)  # [KEYS keys, KEYS columns] a value slab
    last = cuda.shared.array(1, dtype=int32)
    cf = cuda.local.array(1, dtype=qhat.dtype)  # a count in the float dtype
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    count_bias = (flags & 1) != 0
    vq = (flags & 2) != 0
    tid = cuda.threadIdx.x
    nth = ROWS * KEYS
    i = tid // KEYS
    j = tid % KEYS
    d = qhat.shape[2]
    dv = v.shape[2]
    zero = beta - beta
    U = n + L
    for w in range(cuda.blockIdx.x, ((L + ROWS - 1) // ROWS) * splits, cuda.gridDim.x):
        a0 = (w // splits) * ROWS
        u0 = (w % splits) * KEYS
        if u0 > n + min(L, a0 + ROWS) - 1:
            continue  # no row of the tile sees a key of it (block-uniform)
        a = a0 + i
        u = u0 + j
        acc_r = zero
        acc_a = zero
        for d0 in range(0, d, SLAB):
            for e in range(tid, ROWS * SLAB, nth):
                r = a0 + e // SLAB
                c = d0 + e % SLAB
                x = zero
                y = zero
                if r < L and c < d:
                    x = qhat[h, s + r, c]
                    y = khat[h, s + r, c]
                sq[e] = x
                sk[e] = y
            for e in range(tid, KEYS * SLAB, nth):
                r = u0 + e // SLAB
                c = d0 + e % SLAB
                y = zero
                if r < U and c < d:
                    if r < n:
                        y = Dk[h, r, c]
                    elif vq:
                        y = Dk[h, z[h, s + r - n], c]
                    else:
                        y = khat[h, s + r - n, c]
                sd[(e // SLAB) * (SLAB + 1) + e % SLAB] = y
            cuda.syncthreads()
            for t in range(SLAB):
                y = sd[j * (SLAB + 1) + t]
                acc_r += sq[i * SLAB + t] * y
                acc_a += sk[i * SLAB + t] * y
            cuda.syncthreads()
        lg = ninf
        if a < L:
            if u < n:
                lg = acc_r * beta
                if count_bias:
                    cnt = counts[h, u]
                    if cnt > 0:
                        cf[0] = cnt
                        lg += math.log(cf[0])
                    else:
                        lg = ninf
            elif u < U and u - n <= a:
                lg = acc_r * beta
        sl[tid] = lg
        sa[tid] = acc_a if u < n else ninf
        cuda.syncthreads()
        # the tile's maximum of row i, NaN kept (as np.max keeps it)
        m = ninf
        for t in range(KEYS):
            x = sl[i * KEYS + t]
            if x > m or x != x:
                m = x
        p = exp_shifted(lg, m)
        cuda.syncthreads()  # every thread has read the logits
        sl[tid] = p
        cuda.syncthreads()
        sees = a < L and u0 <= n + a
        if sees and j == 0:
            tot = zero
            for t in range(KEYS):
                tot += sl[i * KEYS + t]
            pmax[h, w % splits, a] = m
            psum[h, w % splits, a] = tot
        for c0 in range(0, dv, KEYS):
            for e in range(tid, KEYS * KEYS, nth):
                r = u0 + e // KEYS
                c = c0 + e % KEYS
                y = zero
                if r < U and c < dv:
                    if r < n:
                        y = Dv[h, r, c]
                    else:
                        y = v[h, s + r - n, c]
                sv[e] = y
            cuda.syncthreads()
            c = c0 + j
            if sees and c < dv:
                o = zero
                for t in range(KEYS):
                    o += sl[i * KEYS + t] * sv[t * KEYS + j]
                pnum[h, w % splits, a, c] = o
            cuda.syncthreads()
        # nearest centroid of the tile by dot product, the first maximum (lowest index) on ties
        if not vq and u0 < n and a < L and j == 0:
            best = sa[i * KEYS]
            arg = u0
            for t in range(1, min(KEYS, n - u0)):
                x = sa[i * KEYS + t]
                if x > best:
                    best = x
                    arg = u0 + t
            abest[h, w % splits, a] = best
            aarg[h, w % splits, a] = arg
        cuda.syncthreads()  # the similarities are read before the next item writes them
    # the last block of the head to finish makes the plan
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        last[0] = 1 if cuda.atomic.add(ticket, h, 1) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return
    cuda.threadfence()
    _plan_chunk(h, khat, s, L, n, n_add, vq, z, abest, aarg, rows, seeded, order, srow, cbase, scores, counts,
                draws, draw_off, use_draws)
    if tid == 0:
        ticket[h] = 0


# Launch 2 of a chunk.  Work items w < L d_v: the read-out of position a = w // d_v, column c = w % d_v, the partial
# pairs of the key tiles that row a sees (tile < (n + a) // KEYS + 1) combined in tile order:
#   M = max_tile m_tile (NaN kept),  o_a[c] = sum_tile e^{m_tile - M} num_tile[c] / sum_tile e^{m_tile - M} l_tile,
# rowmax[s + a] = M (non-finite: the row overflowed, refused on the host).
# Work items w >= L d_v: (sorted position p, column col) of [D_k | D_v] (VQ: D_v only); the thread at the first
# position of a run of srow (one centroid m, its members in token order) updates column col of row m:
#   a seeded row starts at its key and value (count 1: cbase); then, for the other members i of S_m, in token order,
#   exact running mean: (c D + sum_S x) / (c + |S|), sums in token order;
#   or D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order.
# VQ: U_m / L_m: running mean of the values each code summarises (gmm.running_mean_update).  Each entry has one
# owner: no atomics, no barrier, no shared memory.  Blocks of FLAT threads, grid-stride; heads on y, z.
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
    cf = cuda.local.array(2, dtype=Dv.dtype)  # the counts c and c' in the float dtype
    h = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
    if h >= H:
        return
    with_keys = (flags & 1) != 0
    constant_rate = (flags & 2) != 0
    dv = Dv.shape[2]
    wk = Dk.shape[2] if with_keys else 0
    width = wk + dv
    zero = eta - eta
    reads = L * dv
    for w in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, reads + L * width, cuda.gridDim.x * cuda.blockDim.x):
        if w < reads:
            a = w // dv
            c = w % dv
            if a >= L:
                continue
            tiles = (n + a) // KEYS + 1
            M = ninf
            for tile in range(tiles):
                x = pmax[h, tile, a]
                if x > M or x != x:
                    M = x
            if c == 0:
                rowmax[h, s + a] = M
            if math.isfinite(M):
                den = zero
                num = zero
                for tile in range(tiles):
                    e = exp_shifted(pmax[h, tile, a], M)
                    den += e * psum[h, tile, a]
                    num += e * pnum[h, tile, a, c]
                out[h, s + a, c] = num / den
            else:
                out[h, s + a, c] = M
            continue
        p = (w - reads) // width
        if p >= L:
            continue
        m = srow[h, p]
        if p > 0 and srow[h, p - 1] == m:
            continue  # not the first member of its centroid
        col = (w - reads) % width
        key = col < wk
        c = col if key else col - wk
        D = Dk[h, m, c] if key else Dv[h, m, c]
        acc = zero
        cnt = 0
        r = p
        while r < L and srow[h, r] == m:
            b = order[h, r]
            x = khat[h, s + b, c] if key else v[h, s + b, c]
            if seeded[h, b] != 0:
                D = x
            else:
                cnt += 1
                if constant_rate:
                    D = D + eta * (x - D)
                else:
                    acc += x
            r += 1
        if cnt > 0 and not constant_rate:
            cf[0] = cbase[h, p]
            cf[1] = cbase[h, p] + cnt
            D = (cf[0] * D + acc) / cf[1]
        if key:
            Dk[h, m, c] = D
        else:
            Dv[h, m, c] = D


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
    """Per chunk ``(s, L, n, n_add, draw offset, uses draws)``, and every drawn seed of ``init="random"`` in one array."""
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
    return plans, (np.concatenate(draws) if draws else np.zeros(1, np.int64)), n, t


def _normalise(q, k, g):
    qhat = cuda.device_array(q.shape, dtype=q.dtype)
    khat = cuda.device_array(k.shape, dtype=k.dtype)
    _unit_rows_kernel[g.unit[0], g.unit[1]](q, k, qhat, khat, q.dtype.type(ovq.NORM_EPS), q.shape[0])
    return qhat, khat


def _ovq_run(q, k, v, p, Dk, Dv, counts, n, t):
    """Core: ``(out, n, t, rowmax)`` from device arrays ``q, k (H, N, d)``, ``v (H, N, d_v)``; ``Dk, Dv, counts`` updated in place."""
    H, N, d = q.shape
    d_v = v.shape[2]
    f = q.dtype.type
    g = launch_geometry(N, H, d, d_v, p.max_size, p.chunk_size)
    plans, draws, n_end, t_end = _chunk_plans(N, p, n, t)
    draws = cuda.to_device(draws)  # every chunk's seeds, one copy to the device
    qhat, khat = _normalise(q, k, g)
    w = _scratch(g, H, d_v, q.dtype)
    no_codes = cuda.device_array((1, 1), np.int64)
    out = cuda.device_array((H, N, d_v), dtype=q.dtype)
    rowmax = cuda.device_array((H, N), dtype=q.dtype)
    beta, ninf = f(p.beta), f(-np.inf)
    eta = f(0 if p.eta is None else p.eta)
    read_flags = np.int32(1 if p.count_bias else 0)
    merge_flags = np.int32(1 | (2 if p.eta is not None else 0))
    for s, L, n, n_add, offset, use in plans:
        grid, threads, tiles = g.predict_for(n, L)
        _predict_kernel[grid, threads](
            qhat, khat, v, no_codes, s, L, Dk, Dv, counts, n, beta, ninf, read_flags, tiles, w.pmax, w.psum, w.pnum,
            w.abest, w.aarg, w.ticket, w.rows, w.seeded, w.order, w.srow, w.cbase, w.scores, n_add, draws, offset,
            np.int32(use), H,
        )
        _merge_kernel[g.merge_for(L)](
            khat, v, s, L, w.pmax, w.psum, w.pnum, n, out, rowmax, Dk, Dv, w.order, w.srow, w.seeded, w.cbase,
            eta, merge_flags, ninf, H,
        )
    return out, n_end, t_end, rowmax, g


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
    for s in range(0, N, C):
        L = min(s + C, N) - s
        # past codes (log L_m) and the current chunk through its codes; the plan buckets the chunk's keys by code
        grid, threads, tiles = g.predict_for(S, L)
        _predict_kernel[grid, threads](
            qhat, khat, v, z, s, L, codebook, value_means, counts, S, b, ninf, np.int32(3), tiles, w.pmax, w.psum,
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


def ovq_attention(q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread", count_bias=True,
                  learning_rate=None, seed=0, state=None, return_state=False):
    """Online vector-quantized attention, causal, chunk by chunk, on the GPU: :func:`refimpl.ovq.ovq_attention`.

    Parameters
    ----------
    q, k : array_like or device array, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like or device array, shape (N, d_v)
        Values (not normalised).
    max_size : int
        ``n_max``, the most centroids (>= 1).
    chunk_size : int
        ``C`` (>= 1); the last chunk may be shorter.
    beta : float, optional
        Scale of the dot products, ``sqrt(d)`` by default.
    growth : {"plateau", "linear"}, default "plateau"
        The growth function of :func:`refimpl.ovq.dictionary_size`.
    init : {"spread", "random"}, default "spread"
        Which keys seed new centroids once a dictionary exists: the least
        similar to it, or drawn on the host with refimpl's generator.
    count_bias : bool, default True
        Add ``log c`` to the centroid logits.
    learning_rate : float, optional
        ``None``: the adaptive ``1/c`` running mean; ``eta`` in ``(0, 1]``:
        ``D += eta (x - D)`` token by token in token order.
    seed : int, default 0
        Seed of ``init="random"`` (>= 0).
    state : OVQState, optional
        Continue a stream from this (host) state; it is copied to the device
        once and not modified.
    return_state : bool, default False
        Also return the state after the last chunk.

    Returns
    -------
    out : ndarray or device array, shape (N, d_v)
        A device array when any of ``q, k, v`` is one, else an ndarray; the
        dtype of the inputs (a float64 ``state`` makes it float64).
    state : refimpl.ovq.OVQState
        Only with ``return_state=True``: host arrays, a new object.

    Notes
    -----
    Two launches per chunk (module docstring) and one copy to the host per
    call: the result checks, with the state and a host caller's output.
    """
    on_device = any_device(q, k, v)
    a = ovq.check_ovq_arguments(
        host_view(q), host_view(k), host_view(v), max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state
    )
    return_state = validation.check_bool(return_state, "return_state")
    inputs = ((q, "q"), (k, "k"), (v, "v"))
    if not on_device:
        q, k, v = a.q, a.k, a.v
    q, k, v = (to_device(x, a.dtype) for x in (q, k, v))
    checks = Checks(a.dtype)
    if on_device:
        for x, (_, name) in zip((q, k, v), inputs):
            checks.finite(x, name)
    N, d, d_v, n_max = q.shape[0], q.shape[1], v.shape[1], a.params.max_size
    if a.state is None:
        Dk = cuda.to_device(np.zeros((1, n_max, d), a.dtype))
        Dv = cuda.to_device(np.zeros((1, n_max, d_v), a.dtype))
        counts = cuda.to_device(np.zeros((1, n_max), np.int64))
        n, t = 0, 0
    else:
        Dk = cuda.to_device(np.array(a.state.keys, dtype=a.dtype).reshape(1, n_max, d))
        Dv = cuda.to_device(np.array(a.state.values, dtype=a.dtype).reshape(1, n_max, d_v))
        counts = cuda.to_device(np.array(a.state.counts, dtype=np.int64).reshape(1, n_max))
        n, t = a.state.size, a.state.tokens_seen
    out, n, t, rowmax, g = _ovq_run(_heads(q), _heads(k), _heads(v), a.params, Dk, Dv, counts, n, t)
    checks.finite(rowmax, "rowmax")
    if not on_device:
        checks.rows(out, "out")
    if return_state:
        packed = cuda.device_array((1, n_max, 3), a.dtype)
        _pack_counts_kernel[g.pack[0], g.pack[1]](counts, packed, 1)
        for x, name in ((Dk, "keys"), (Dv, "values"), (packed, "counts")):
            checks.rows(x, name)
    # the one copy of the call: every check, the state and a host caller's output at once
    raise_bad_inputs(checks.fetch(), inputs)
    ovq.check_overflow(_overflow(checks, rowmax), a.state, a.dtype)
    out = out.reshape(N, d_v) if on_device else checks.part("out").reshape(N, d_v).copy()
    if not return_state:
        return out
    keys, values = checks.part("keys").reshape(n_max, d), checks.part("values").reshape(n_max, d_v)
    return out, ovq.OVQState(keys, values, _unpack_counts(checks.part("counts")), n, t)


def vq_attention(q, k, v, codebook, *, chunk_size, beta=None):
    """VQ attention with a fixed key codebook, on the GPU: :func:`refimpl.ovq.vq_attention`.

    Parameters
    ----------
    q, k : array_like or device array, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like or device array, shape (N, d_v)
    codebook : array_like or device array, shape (S, d)
        The fixed key dictionary ``D_k`` (used as given, not normalised).
    chunk_size : int
        ``C`` (>= 1).
    beta : float, optional
        ``sqrt(d)`` by default.

    Returns
    -------
    ndarray or device array, shape (N, d_v)
        A device array when any input is one.

    Notes
    -----
    Two launches per chunk, after one that finds every key's code; one copy
    to the host per call.
    """
    on_device = any_device(q, k, v, codebook)
    a = ovq.check_vq_arguments(host_view(q), host_view(k), host_view(v), host_view(codebook), chunk_size, beta)
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
