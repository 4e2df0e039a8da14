r"""The normalised feature-map scan of :mod:`refimpl.scan` on the GPU, for ``B`` sequences in one launch.

What it computes
----------------
For nonnegative features :math:`\Phi_Q` (``N_q x F``), :math:`\Phi_K`
(``N_k x F``) and values :math:`V` (``N_k x d_v``) of each sequence, with the
ones column appended, :math:`V_1 = [V, \mathbf 1]` (``E = d_v + 1`` columns):

* bidirectional: :math:`[S, z] = \Phi_K^\top V_1`, then
  :math:`\text{num} = \Phi_Q [S, z]`, :math:`o_i = \text{num}_{i,:d_v} / (\text{num}_{i,d_v} + \epsilon)`;
* causal, chunks of ``C`` tokens: the state of chunk ``c`` is the exclusive
  prefix :math:`[S, z]_c = \sum_{c' < c}\Phi_{K,c'}^\top V_{1,c'}`, and
  :math:`\text{num}_c = \Phi_{Q,c}[S, z]_c + \operatorname{tril}(\Phi_{Q,c}\Phi_{K,c}^\top) V_{1,c}`;
* backward, with :math:`G_1 = [G/\text{den}, \delta]`: :math:`d\Phi_Q = G_1 [S, z]^\top`
  (+ the masked within-chunk term), :math:`[R, r] = \Phi_Q^\top G_1` (reverse exclusive
  prefix over the chunks when causal), :math:`d\Phi_K = V_1 [R, r]^\top`,
  :math:`dV = \Phi_K R` (each + its masked within-chunk term).

Nothing of size ``N x F x d_v`` or ``N x N`` is formed: the states are
``n_chunks x F x E`` per sequence (bidirectional: one per segment of
:data:`SEGMENT` tokens before their ordered sum).

Launch plan
-----------
The two product kernels, :func:`_chunk_states` (the write) and
:func:`_chunk_rows` (the read and the masked within-chunk term), are
register-tiled like a matrix product: a block of ``TX x TY`` threads owns a
``TILE_ROWS x TILE_COLS`` tile of outputs, each thread a ``RM x RN``
register tile of it (rows ``ty + a TY``, columns ``tx + k TX``), and the
operands are staged in shared memory ``DC`` reduction entries at a time,
loaded by the whole block along contiguous addresses.  Per reduction entry a
thread reads ``RM + RN`` shared entries for ``RM RN`` fused multiply-adds
(8 for 16 on a GPU in float32, 6 for 8 in float64, against 2 for 1 with one
output a thread).  The kernels
take flat views of their arrays: each computes the flat offsets of its tile
once, advances them by a stage at each stage, and adds to them the fixed
offsets of the entries its thread loads.  Shared and register offsets are
unsigned 32-bit, bounded by the geometry (below
``TILE_ROWS (TILE_KEYS + 1)``: 2,112 on a GPU); the global offsets stay
64-bit, since an array's ``B N F`` entries can pass ``2^32`` (one sequence
of ``N = 2^24`` tokens by ``F = 256`` does).  The tile sizes are
compile-time constants of each build, one geometry per float type on a GPU
(:data:`GPU_GEOMETRIES`: 4 x 4 register tiles in float32, 2 x 4 in float64,
so that ``_chunk_rows`` fits in 64 registers, 50% occupancy, in both),
:data:`SIMULATOR_GEOMETRY` in the simulator; :func:`geometry` runs the GPU's
tiles in the simulator, for tests.  On a GPU each kernel is built once per
float type (``_chunk_rows[float64]``), :func:`_chunk_rows` with launch
bounds (:data:`MIN_BLOCKS`).  Every grid comes from
:func:`launch_geometry`, a pure function of the shapes and the float type
(the tiles): its ``x`` axis runs
over the work of one sequence, ``y`` and ``z`` over the sequences
(:func:`~gpu.numba_cuda._primitives.sequence_axes`), all within the
hardware's limits for any ``N`` and ``B``.

1. :func:`_ones_column`: ``V_1 = [V, 1]``, one thread per entry.
2. :func:`_chunk_states`: per chunk (causal) or segment (bidirectional), the
   ``F x E`` partial :math:`\Phi_{K,c}^\top V_{1,c}`, one block per chunk and
   ``TILE_ROWS x TILE_COLS`` tile of ``(f, e)``, over the chunk's tokens
   ``DC`` at a time.
3. The scan over the ``n = N / C`` chunk states, for every state entry
   ``(b, f, e)`` at once (forward, or reversed for the backward's sweep over
   the later chunks): :func:`_scan_spans` cuts the chunks into spans of
   :data:`SPAN`, and each block (:data:`LANES` entries by :data:`SPAN`
   chunks) replaces its span by its exclusive prefix sums with the
   work-efficient tree of Blelloch (1990)
   (:func:`~gpu.numba_cuda._primitives.exclusive_scan_columns`) and writes
   the span's total; the totals (``n / SPAN`` of them) are scanned the same
   way, and :func:`_add_offsets` adds each span's scanned total back.  Depth:
   ``L = ceil(log_SPAN n)`` levels (``L`` launches of :func:`_scan_spans`,
   ``L - 1`` of :func:`_add_offsets`), each ``2 log2(SPAN)`` steps of the
   tree: :math:`O(\log n)` steps in all, against ``n`` for a loop over the
   chunks.  Work: :math:`O(n)` additions per state entry (``2 n`` in the
   trees, ``n`` for the offsets, and ``n / SPAN`` at the next level).
4. :func:`_chunk_rows`: one block per ``TILE_ROWS`` rows of one chunk and
   ``TILE_COLS`` output columns: the rows times their chunk's state, then,
   when causal, the masked ``TILE_ROWS x TILE_KEYS`` score tiles of the
   chunk (a second, ``RM x RS`` register tile, kept in shared memory once
   masked) times the values' tiles.  The scores (``C n_pair``
   multiply-adds a row at most) are computed again by each of the
   ``ceil(n_out / TILE_COLS)`` column tiles of the same rows, and
   ``E = d_v + 1`` columns make one column tile more than ``d_v`` does
   (``d_v = 64``: a second tile of one column): the price of an output tile
   held in registers.
5. :func:`_normalise` and :func:`_scaled_grads`: one thread per entry.

A packed forward (``cu_seqlens``, :func:`scan_forward_device`), and the
backward of its cache (:func:`scan_backward_device`), make the same
launches as an unpacked call: the product kernels take every nonempty (head, sequence)
pair as a sequence of their batch, from a table of each one's first flat
row and length built once per call (:func:`packed_sequences`), so its chunks
start at its first token and its keys are its own; every sequence gets the
longest one's count of chunks (those past its end hold zeros, which add
exact zeros to the prefix sums), so a packed sequence computes the same sums
in the same order as its own call.

Launches: the forward makes ``4 + (2 L - 1)`` (causal) or ``3 + L_seg``
(bidirectional, over segments of :data:`SEGMENT` tokens); the backward
``5 + (2 L - 1)`` or ``5 + L_seg``.  Every sum runs in an order fixed by the
shapes and the geometry (the tokens, the entries ``h`` and the key tiles in
ascending order; the tree's pairs), so two runs give the same bits; there
are no atomics anywhere.

No fusion with the responsibilities
-----------------------------------
In GMA, :math:`\Phi = \Gamma`, the responsibilities
(:mod:`gpu.numba_cuda.gmm`).  Fusing the write or the read into them would
save one pass over ``N x K`` only, and neither way pays.  At ``N = 2^20``,
``K = 256``, ``d = 64``, ``d_v = 64`` in float32 on an H200 (4.8 TB/s,
67 TFLOP/s): one pass over :math:`\Gamma` is ``4 N K = 1.07 GB``, 0.22 ms.
Recomputing the logits inside these kernels (4 flops per ``(i, k, j)``:
difference, square, scale, sum) costs ``4 N K d = 6.9e10`` flops, 1.03 ms,
4.6 times the pass it saves.  Writing the products from the responsibilities
kernel's epilogue recomputes nothing, but the row softmax needs the whole row
(all ``K`` components) before any :math:`\gamma_{ik}` is final, so the
product could only start after that kernel's second pass over its entries,
and :math:`\Gamma` must be written anyway (the backward reads it); what is
left to save is the one read of :math:`\Gamma_K` (or :math:`\Gamma_Q`), 0.22 ms,
while the chunk states themselves (``N / C x K x E`` at ``C = 64``:
1.09 GB) are as large as :math:`\Gamma`.  So the scan reads
:math:`\Gamma` as the responsibilities kernel wrote it.

:func:`scan_forward_device` and :func:`scan_backward_device` are the
device-level cores (no validation, no raise, no copy to the host; the caller
checks the denominators), used by :mod:`gpu.numba_cuda.gma`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from numba import boolean, config, cuda, float32, float64, int64, uint32, uint64
from numba.core.types import UniTuple

from ._device import blocks, kernel, swapped_geometry
from ._primitives import MAX_GRID_X, exclusive_scan_columns, sequence_axes

__all__ = [
    "Geometry",
    "GPU_GEOMETRY",
    "GPU_GEOMETRY_F64",
    "GPU_GEOMETRIES",
    "SIMULATOR_GEOMETRY",
    "GEOMETRIES",
    "MIN_BLOCKS",
    "geometry",
    "SEGMENT",
    "THREADS",
    "SPAN",
    "LANES",
    "ScanDeviceCache",
    "launch_geometry",
    "scan_forward_device",
    "scan_backward_device",
]

#: True when kernels run in the CUDA simulator (every thread a Python thread): the blocks are then kept small.
SIMULATOR = bool(config.ENABLE_CUDASIM)


class Geometry(NamedTuple):
    """Tile sizes of :func:`_chunk_states` and :func:`_chunk_rows` (compile-time constants of each build).

    :func:`geometry` sets others in the simulator.
    """

    rows_per_thread: int  # RM: output rows of a thread's register tile
    cols_per_thread: int  # RN: output columns of a thread's register tile
    threads_x: int  # TX: threads along the columns
    threads_y: int  # TY: threads along the rows
    depth: int  # DC: reduction entries (tokens, h, pair dimensions, keys) per shared-memory stage


#: On a GPU, in float32: 16 x 16 threads of 4 x 4 register tiles, 64 x 64 block tiles, 8 reduction entries a
#: stage; the scores of _chunk_rows in 4 x 2 register tiles, 64 x 32 score tiles (its shared memory: 2 x 64 x 8
#: staged entries + 64 x 33 scores = 12.25 KiB).
GPU_GEOMETRY = Geometry(4, 4, 16, 16, 8)
#: On a GPU, in float64: 16 x 16 threads of 2 x 4 register tiles, 32 x 64 block tiles, 8 entries a stage; scores in
#: 2 x 2 register tiles, 32 x 32 score tiles (32 x 8 + 8 x 64 staged doubles + 32 x 33 scores = 14.25 KiB): eight
#: doubles a thread in the output tile in place of sixteen floats, so that _chunk_rows fits in the 64 registers of
#: its launch bounds without spilling (:data:`MIN_BLOCKS`).
GPU_GEOMETRY_F64 = Geometry(2, 4, 16, 16, 8)
#: The GPU's tiles by dtype.
GPU_GEOMETRIES = {np.dtype(np.float32): GPU_GEOMETRY, np.dtype(np.float64): GPU_GEOMETRY_F64}
#: In the simulator (every thread a Python thread): 2 x 2 threads of 2 x 2 register tiles, 4 x 4 block tiles,
#: 2 entries a stage; scores in 2 x 1 register tiles, 4 x 2 score tiles; in both types.
SIMULATOR_GEOMETRY = Geometry(2, 2, 2, 2, 2)
#: The tiles the launches use, by dtype (:func:`geometry` switches them in the simulator).
GEOMETRIES = {dt: SIMULATOR_GEOMETRY for dt in GPU_GEOMETRIES} if SIMULATOR else dict(GPU_GEOMETRIES)


def tile_constants(g: Geometry) -> dict:
    """The constants :func:`_chunk_states` and :func:`_chunk_rows` are compiled with for the geometry ``g``.

    ``RM, RN, TX, TY, DC`` (the fields of ``g``), ``TILE_ROWS = TY RM``,
    ``TILE_COLS = TX RN``, ``NT = TX TY`` threads, the shared array sizes
    ``SH_A`` and ``SH_B``, the scores' register tile ``RM x RS`` (``RS =
    max(1, RN / 2)``), ``TILE_KEYS = TX RS`` keys a score tile, ``S_STRIDE``
    and ``SH_S`` (its padded rows), ``LOADS_A``, ``LOADS_B``, ``LOADS_Y``
    (the entries of each staged tile a thread loads) and ``UNROLL`` (the
    reduction loops' inner trip count).
    """
    rm, rn, tx, ty, dc = g
    nt = tx * ty
    if min(g) < 1 or (ty * rm * dc) % nt or (dc * tx * rn) % nt or (dc * tx * max(1, rn // 2)) % nt:
        raise ValueError("Geometry: the shared tiles must be a multiple of the block's threads")
    tile_rows, tile_cols = ty * rm, tx * rn
    rs = max(1, rn // 2)  # keys of a thread's register tile of scores (RM x RS)
    tile_keys = tx * rs  # keys of a score tile
    return dict(
        RM=rm, RN=rn, TX=tx, TY=ty, DC=dc, TILE_ROWS=tile_rows, TILE_COLS=tile_cols, NT=nt,
        SH_A=tile_rows * dc,  # [TILE_ROWS rows, DC] (_chunk_rows) or [DC tokens, TILE_ROWS features] (_chunk_states)
        SH_B=dc * tile_cols,  # [DC, TILE_COLS columns or keys]
        RS=rs, TILE_KEYS=tile_keys,
        S_STRIDE=tile_keys + 1,  # a row of the score tile, padded by one entry
        SH_S=tile_rows * (tile_keys + 1),  # [TILE_ROWS rows, TILE_KEYS + 1]
        LOADS_A=tile_rows * dc // nt,  # entries of the SH_A tile each thread loads
        LOADS_B=dc * tile_cols // nt,  # entries of the SH_B tile each thread loads
        LOADS_Y=dc * tile_keys // nt,  # entries of a [DC, TILE_KEYS] tile of keys each thread loads
        UNROLL=4 if dc % 4 == 0 else 1,  # the reduction loops' inner trip count (unrolled by the compiler)
    )


def constants(dtype) -> dict:
    """:func:`tile_constants` of the geometry the launches use for ``dtype`` (:data:`GEOMETRIES`)."""
    return tile_constants(GEOMETRIES[np.dtype(dtype)])


#: The unsigned 32-bit conversion of the kernels' shared and register offsets (``numba.uint32``); in the simulator a
#: plain ``int``, the same value, since calling a Numba type from Python costs microseconds per offset there.
u32 = int if SIMULATOR else uint32
#: The same for the flat global offsets (``numba.uint64``, computed in 64-bit, nonnegative): unsigned, they skip the
#: wraparound too.
u64 = int if SIMULATOR else uint64


@contextmanager
def geometry(g):
    """Run the scan with the tile geometry ``g`` (a :class:`Geometry`, or a dict by dtype): the simulator only."""
    with swapped_geometry(GEOMETRIES, g, tile_constants, "gpu.numba_cuda.scan.geometry"):
        yield


#: Resident blocks per multiprocessor that ptxas must allow for :func:`_chunk_rows` on a GPU (its launch bounds, with
#: TX x TY = 256 threads per block), by dtype: 4, at most 64 registers (32 of the 64 warps of an sm_90, 50%
#: occupancy), without spills (ptxas -v, sm_90: 64 registers in both types).  Unbounded, ptxas takes 72 registers in
#: both (two register tiles live at once, the output's and the scores'): 3 blocks.  With scores of 4 x 4 too, the
#: float32 build spills 12 B within 64 registers; float64 in the float32 tiles (4 x 4 and 4 x 2 doubles) took 128
#: registers bounded to 2 blocks (25%), 132 unbounded.  :func:`_chunk_states` has no bounds: unbounded, it takes 40
#: registers in float32 (75% occupancy) and 48 in float64 (62.5%), and bounds of 4 blocks raise float32's to 56.
MIN_BLOCKS = {"float32": 4, "float64": 4}


def _rows_options(f):
    """The compile options of :func:`_chunk_rows`'s GPU build for the Numba float type ``f``: its launch bounds
    (``None`` in the simulator, ``f`` None: no launch bounds there)."""
    if f is None:
        return None
    return {"launch_bounds": (tile_constants(GPU_GEOMETRIES[np.dtype(str(f))])["NT"], MIN_BLOCKS[str(f)])}


#: Tokens per segment of the bidirectional reductions over tokens (one partial state per segment, then an ordered sum).
SEGMENT = 256
#: Threads per block of the one-thread-per-entry kernels.
THREADS = 32 if SIMULATOR else 128
#: Chunks per block of the scan over chunk states (a power of two): the tree of one block covers SPAN chunks.
SPAN = 4 if SIMULATOR else 16
#: State entries per block of the scan (consecutive entries on consecutive threads: coalesced).
LANES = 2 if SIMULATOR else 32


class ScanDeviceCache(NamedTuple):
    """What :func:`scan_backward_device` needs from :func:`scan_forward_device` (device arrays)."""

    phi_q: object  # (B, N_q, F)
    phi_k: object  # (B, N_k, F)
    v1: object  # (B, N_k, d_v + 1): [V, 1]
    out: object  # (B, N_q, d_v)
    den: object  # (B, N_q)
    states: object  # (B, n_chunks, F, d_v + 1): [S, z] before each chunk (causal), or the total (bidirectional, 1 chunk)
    causal: bool
    eps: float
    chunk: int  # tokens per chunk (causal: min(chunk_size, N)); bidirectional: unused
    packed: object = None  # PackedSequences of a packed call (B the heads, N = T), else None


# buf[:, -1] = 1 and vc[:, :-1] = v[a:b] (refimpl.scan._ones_column_buffer): [v_c, 1].
# One thread per entry (j, e) of one sequence's V_1 [N, E] on grid x (consecutive threads on consecutive e), the
# sequence b on grid y, z.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1]), threads=THREADS, tags=("gma",))
def _ones_column(v, v1):
    B, N, E = v1.shape
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= B or i >= N * E:
        return
    e = i % E
    j = i // E
    if e < E - 1:
        v1[b, j, e] = v[b, j, e]
    else:
        v1[b, j, e] = v1.dtype.type(1.0)


def _unpack(g):
    c = tile_constants(g)
    return tuple(c[k] for k in ("RM", "RN", "TX", "TY", "DC", "TILE_ROWS", "TILE_COLS", "NT", "SH_A", "SH_B", "RS",
                                "TILE_KEYS", "S_STRIDE", "SH_S", "LOADS_A", "LOADS_B", "LOADS_Y", "UNROLL"))


@cuda.jit(device=True)
def _sequence(b, N, first, length):
    """``(first flat row, tokens)`` of sequence ``b``: ``(b N, N)``, or a packed sequence's from the tables ``first``,
    ``length`` (:func:`packed_sequences`) when they are not empty."""
    if first.shape[0] > 0:
        return first[b], length[b]
    return b * N, N


# s1 += pk.T @ vc (refimpl.scan._causal_forward), and s = phi_k.T @ v, z = phi_k.sum(axis=0) per segment
# (refimpl.scan._bidirectional_forward); the backward's r1 += pq.T @ gc and ds, dz = phi_q.T @ [gn, delta] likewise:
#     partial[b, c, f, e] = sum_{j in chunk c} y[b, j, f] z[b, j, e]   (Y_c^T Z_c),
# the tokens j in ascending order, DC at a time.
# Grid (n_chunks * F-tiles * E-tiles, sequences on y, z): block x = (c, tile of TILE_ROWS features, tile of
# TILE_COLS columns). Block TX x TY threads: thread (ty, tx) owns the RM x RN register tile of features
# f0 + ty + a TY and columns e0 + tx + k TX (a < RM, k < RN): neighbouring tx write neighbouring e.
# Shared memory, per stage of DC tokens: y [DC tokens, TILE_ROWS features] and z [DC tokens, TILE_COLS columns]
# (zeros past the chunk, F and E), each loaded by the whole block, LOADS_A and LOADS_B entries a thread, consecutive
# threads on consecutive addresses of a token's row (coalesced), at flat offsets from the tile's first token; per token
# a thread reads RM + RN shared entries for RM RN fused multiply-adds (the token loop unrolled UNROLL at a time).
# Arguments: the flat views of y (B, N, F), z (B, N, E) and partial (B, n_chunks, F, E); dims = (B, N, F, E, chunk,
# n_chunks).
def _build_chunk_states(g: Geometry, f=None):
    """:func:`_chunk_states` compiled for the tiles ``g`` (:func:`tile_constants`: compile-time constants).

    On a GPU (``f`` the Numba float type the tiles are for) it is registered
    for ``f`` alone (``scan._chunk_states[float32]``, ``[float64]``); in the
    simulator (``f`` None) for both types.
    """
    (RM, RN, TX, TY, DC, TILE_ROWS, TILE_COLS, NT, SH_A, SH_B, RS, TILE_KEYS, S_STRIDE, SH_S, LOADS_A, LOADS_B, LOADS_Y,
     UNROLL) = _unpack(g)
    dtypes = None if f is None else (f,)

    @kernel(lambda f: (f[::1], f[::1], UniTuple(int64, 6), f[::1], int64[::1], int64[::1]), threads=NT, tags=("gma",),
            dtypes=dtypes)
    def _chunk_states(y, z, dims, partial, first, length):
        sh_y = cuda.shared.array(SH_A, dtype=y.dtype)  # [DC tokens, TILE_ROWS features]
        sh_z = cuda.shared.array(SH_B, dtype=y.dtype)  # [DC tokens, TILE_COLS columns]
        acc = cuda.local.array((RM, RN), dtype=y.dtype)  # the register tile of partial[b, c]
        yr = cuda.local.array(RM, dtype=y.dtype)
        zr = cuda.local.array(RN, dtype=y.dtype)
        zero = y.dtype.type(0.0)
        B, N, F, E, chunk, n_chunks = dims
        b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
        if b >= B:
            return
        base, n_b = _sequence(b, N, first, length)
        # shared and register offsets are unsigned 32-bit: below DC * TILE_ROWS and DC * TILE_COLS, bounded by the
        # geometry (a few hundred), and unsigned indices skip Numba's negative-index wraparound
        tx = u32(cuda.threadIdx.x)
        ty = u32(cuda.threadIdx.y)
        tid = ty * u32(TX) + tx
        f_tiles = (F + TILE_ROWS - 1) // TILE_ROWS
        e_tiles = (E + TILE_COLS - 1) // TILE_COLS
        c = cuda.blockIdx.x // (f_tiles * e_tiles)
        rest = cuda.blockIdx.x - c * (f_tiles * e_tiles)
        f0 = (rest // e_tiles) * TILE_ROWS
        e0 = (rest - (rest // e_tiles) * e_tiles) * TILE_COLS
        j_start = c * chunk
        j_end = min(j_start + chunk, n_b)
        # flat offsets of the tile's first token, 64-bit (one sequence's N x F entries can pass 2^32), advanced by a
        # stage's DC rows at each stage; the thread's entries of a stage are at fixed offsets from them
        y_at = (base + j_start) * F + f0
        z_at = (base + j_start) * E + e0
        for a in range(RM):
            for k in range(RN):
                acc[a, k] = zero
        for j0 in range(j_start, j_end, DC):
            for u in range(LOADS_A):
                e = tid + u32(u * NT)
                jj = e // u32(TILE_ROWS)
                ff = e - jj * u32(TILE_ROWS)
                sh_y[e] = y[u64(y_at + jj * F + ff)] if j0 + jj < j_end and f0 + ff < F else zero
            for u in range(LOADS_B):
                e = tid + u32(u * NT)
                jj = e // u32(TILE_COLS)
                ee = e - jj * u32(TILE_COLS)
                sh_z[e] = z[u64(z_at + jj * E + ee)] if j0 + jj < j_end and e0 + ee < E else zero
            y_at += DC * F
            z_at += DC * E
            cuda.syncthreads()
            for j2 in range(0, DC, UNROLL):
                for j1 in range(UNROLL):
                    jj = j2 + j1
                    for a in range(RM):
                        yr[a] = sh_y[u32(jj * TILE_ROWS) + ty + u32(a * TY)]
                    for k in range(RN):
                        zr[k] = sh_z[u32(jj * TILE_COLS) + tx + u32(k * TX)]
                    for a in range(RM):
                        for k in range(RN):
                            acc[a, k] += yr[a] * zr[k]
            cuda.syncthreads()
        for a in range(RM):
            f = f0 + (ty + u32(a * TY))
            out_at = ((b * n_chunks + c) * F + f) * E + e0
            for k in range(RN):
                ee = tx + u32(k * TX)
                if f < F and e0 + ee < E:
                    partial[u64(out_at + ee)] = acc[a, k]

    return _chunk_states


# s1 += pk.T @ vc across the chunks (refimpl.scan._causal_forward: the state before chunk c is the sum over the chunks
# before it), r1 += pq.T @ gc over the later chunks (refimpl.scan._causal_backward), or the sum over the segments:
#     x[b, c, m] <- sum_{c' before c} x[b, c', m]   (when `exclusive`; "before" in scan order, reversed with `reverse`),
#     sums[b, s, m] = sum_{c in span s} x[b, c, m],
# for span s = the chunks at scan positions s SPAN .. s SPAN + SPAN - 1 (position p is chunk p, or n - 1 - p reversed).
# Grid (spans * tiles of LANES entries, sequences on y, z; a block steps over several tiles when spans * ceil(M / LANES)
# exceeds the grid's limit); block (LANES, SPAN): thread (tx, ty) holds entry m = m0 + tx of
# the chunk at position s SPAN + ty in shared buf [SPAN, LANES] (coalesced along m), and the block runs the tree of
# exclusive_scan_columns down each column: 2 log2(SPAN) steps.
@kernel(lambda f: (f[:, :, ::1], boolean, boolean, f[:, :, ::1]), threads=SPAN * LANES, tags=("gma",))
def _scan_spans(x, exclusive, reverse, sums):
    buf = cuda.shared.array((SPAN, LANES), dtype=x.dtype)  # [SPAN chunks, LANES entries]
    B, n, M = x.shape
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    if b >= B:
        return
    m_tiles = (M + LANES - 1) // LANES
    per_span = cuda.gridDim.x // ((n + SPAN - 1) // SPAN)  # blocks per span: m_tiles, fewer past the grid's limit
    span = cuda.blockIdx.x // per_span
    p = span * SPAN + ty
    c = n - 1 - p if reverse else p
    for mt in range(cuda.blockIdx.x - span * per_span, m_tiles, per_span):
        m = mt * LANES + tx
        inside = p < n and m < M
        buf[ty, tx] = x[b, c, m] if inside else x.dtype.type(0.0)
        cuda.syncthreads()
        total = exclusive_scan_columns(buf, SPAN, ty, tx)
        if exclusive and inside:
            x[b, c, m] = buf[ty, tx]
        if ty == 0 and m < M:
            sums[b, span, m] = total


# The offsets of the spans: x[b, c, m] += offsets[b, p // SPAN, m] for the chunk c at scan position p, offsets being
# the exclusive prefix of the span totals (scanned by _scan_spans one level up).
# One thread per entry (p, m) of one sequence's x [n, M] on grid x (consecutive threads on consecutive m), the
# sequence b on grid y, z.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], boolean), threads=THREADS, tags=("gma",))
def _add_offsets(x, offsets, reverse):
    B, n, M = x.shape
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= B or i >= n * M:
        return
    m = i % M
    p = i // M
    c = n - 1 - p if reverse else p
    x[b, c, m] += offsets[b, p // SPAN, m]


# num = pq @ s1 + block @ vc with block = tril(pq @ pk.T) (refimpl.scan._causal_forward), and its backward lines
# dphi_q = gc @ s1.T + m @ pk, dphi_k = vc @ r1.T + m.T @ pq, dv = pk @ r1[:, :-1] + block.T @ gc[:, :-1]
# (refimpl.scan._causal_backward); bidirectional (one chunk, no within-chunk term): phi_q @ s, gn @ s.T + delta z,
# v @ ds.T + dz, phi_k @ ds.  In general, for row r of chunk c:
#     out[r, o] = sum_h p[r, h] state_c[h, o]  (state_c transposed when `transposed`)
#               + sum_{j in chunk c, j <= r (lower) or j >= r} (x_r . y_j) z[j, o]       when `within`,
# h in ascending order DC at a time, then the key tiles in ascending order.
# Grid (n_chunks * row tiles per chunk * column tiles, sequences on y, z): block x = (c, TILE_ROWS rows of chunk c,
# TILE_COLS columns o). Block TX x TY threads: thread (ty, tx) owns the RM x RN register tile of rows
# row0 + ty + a TY and columns o0 + tx + k TX (a < RM, k < RN).
# The state product: per stage of DC entries h, shared p [TILE_ROWS rows, DC] and state [DC, TILE_COLS] (loaded
# along h when transposed, along o otherwise: coalesced either way).  The within-chunk term, per tile of TILE_KEYS
# keys: the score tile x y^T [TILE_ROWS rows, TILE_KEYS keys] as a second register tile (RM x RS: rows ty + a TY,
# keys tx + k TX), from shared x [TILE_ROWS, DC] and y [DC, TILE_KEYS keys] per stage of DC pair dimensions; masked
# (an exact 0, not a product) into shared scores [TILE_ROWS, TILE_KEYS + 1] (one entry of padding a row: the rows a
# warp reads fall in different banks); then scores times z, per stage of DC keys, shared z [DC keys, TILE_COLS
# columns], into the register tile of out.  The arrays come flat: offsets from the tile's first row (p, x, out), its
# chunk's state, the key tile's first key (y) and the stage's first key (z).
# Arguments: the flat views of p (B, N, n_in), states (B, n_st, st_rows, st_cols), x and y (B, N, n_pair), z (B, N, n_z)
# and out (B, N, n_out); dims = (B, N, chunk, n_in, n_pair, n_z, n_out, n_st, st_rows, st_cols).
def _build_chunk_rows(g: Geometry, f=None):
    """:func:`_chunk_rows` compiled for the tiles ``g``, registered as :func:`_build_chunk_states` registers its kernel.

    On a GPU with the launch bounds of :data:`MIN_BLOCKS` (the registry holds
    them, so the PTX and resource checks compile what runs).
    """
    (RM, RN, TX, TY, DC, TILE_ROWS, TILE_COLS, NT, SH_A, SH_B, RS, TILE_KEYS, S_STRIDE, SH_S, LOADS_A, LOADS_B, LOADS_Y,
     UNROLL) = _unpack(g)
    dtypes = None if f is None else (f,)

    @kernel(
        lambda f: (f[::1], f[::1], f[::1], f[::1], f[::1], f[::1], UniTuple(int64, 10), boolean, boolean, boolean, int64[::1],
                   int64[::1]),
        threads=NT,
        tags=("gma",),
        options=_rows_options(f),
        dtypes=dtypes,
    )
    def _chunk_rows(p, states, x, y, z, out, dims, transposed, within, lower, first, length):
        sh_a = cuda.shared.array(SH_A, dtype=p.dtype)  # [TILE_ROWS rows, DC]: p or x of the rows
        sh_b = cuda.shared.array(SH_B, dtype=p.dtype)  # [DC, TILE_COLS]: state, y (keys on the columns) or z
        sh_s = cuda.shared.array(SH_S, dtype=p.dtype)  # [TILE_ROWS rows, TILE_KEYS + 1]: the masked scores
        acc = cuda.local.array((RM, RN), dtype=p.dtype)  # the register tile of out
        sc = cuda.local.array((RM, RS), dtype=p.dtype)  # the register tile of the scores
        ar = cuda.local.array(RM, dtype=p.dtype)
        br = cuda.local.array(RN, dtype=p.dtype)
        zero = p.dtype.type(0.0)
        B, N, chunk, n_in, n_pair, n_z, n_out, n_st, st_rows, st_cols = dims
        b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
        if b >= B:
            return
        base, n_b = _sequence(b, N, first, length)
        # shared and register offsets are unsigned 32-bit: below TILE_ROWS * (TILE_COLS + 1), bounded by the geometry
        # (a few thousand), and unsigned indices skip Numba's negative-index wraparound
        tx = u32(cuda.threadIdx.x)
        ty = u32(cuda.threadIdx.y)
        tid = ty * u32(TX) + tx
        row_tiles = (chunk + TILE_ROWS - 1) // TILE_ROWS
        col_tiles = (n_out + TILE_COLS - 1) // TILE_COLS
        c = cuda.blockIdx.x // (row_tiles * col_tiles)
        rest = cuda.blockIdx.x - c * (row_tiles * col_tiles)
        rt = rest // col_tiles
        row0 = c * chunk + rt * TILE_ROWS
        o0 = (rest - rt * col_tiles) * TILE_COLS
        chunk_end = min((c + 1) * chunk, n_b)
        row_end = min(row0 + TILE_ROWS, chunk_end)
        if row0 >= row_end:
            return
        # flat offsets, 64-bit (one sequence's N x F entries can pass 2^32): the tile's first row of p and x, its
        # chunk's state; the thread's entries of a stage are at fixed offsets from them
        p_at = (base + row0) * n_in
        x_at = (base + row0) * n_pair
        s_at = (b * n_st + c) * st_rows * st_cols
        for a in range(RM):
            for k in range(RN):
                acc[a, k] = zero
        # the carried state: p_r . state_c
        for h0 in range(0, n_in, DC):
            for u in range(LOADS_A):
                e = tid + u32(u * NT)
                rr = e // u32(DC)
                hh = e - rr * u32(DC)
                sh_a[e] = p[u64(p_at + rr * n_in + (h0 + hh))] if row0 + rr < row_end and h0 + hh < n_in else zero
            for u in range(LOADS_B):
                e = tid + u32(u * NT)
                if transposed:  # state_c[h, o] = states[b, c, o, h]: consecutive threads on consecutive h
                    oo = e // u32(DC)
                    hh = e - oo * u32(DC)
                    at = s_at + (o0 + oo) * st_cols + (h0 + hh)
                else:  # state_c[h, o] = states[b, c, h, o]: consecutive threads on consecutive o
                    hh = e // u32(TILE_COLS)
                    oo = e - hh * u32(TILE_COLS)
                    at = s_at + (h0 + hh) * st_cols + (o0 + oo)
                sh_b[hh * u32(TILE_COLS) + oo] = states[u64(at)] if h0 + hh < n_in and o0 + oo < n_out else zero
            cuda.syncthreads()
            for h2 in range(0, DC, UNROLL):
                for h1 in range(UNROLL):
                    hh = h2 + h1
                    for a in range(RM):
                        ar[a] = sh_a[(ty + u32(a * TY)) * u32(DC) + u32(hh)]
                    for k in range(RN):
                        br[k] = sh_b[u32(hh * TILE_COLS) + tx + u32(k * TX)]
                    for a in range(RM):
                        for k in range(RN):
                            acc[a, k] += ar[a] * br[k]
            cuda.syncthreads()
        if within:
            # within the chunk: the masked score tiles times the z tiles
            if lower:
                j_start = c * chunk
                j_end = row_end
            else:
                j_start = row0
                j_end = chunk_end
            for j0 in range(j_start, j_end, TILE_KEYS):
                y_at = (base + j0) * n_pair
                for a in range(RM):
                    for k in range(RS):
                        sc[a, k] = zero
                for d0 in range(0, n_pair, DC):
                    for u in range(LOADS_A):
                        e = tid + u32(u * NT)
                        rr = e // u32(DC)
                        dd = e - rr * u32(DC)
                        inside = row0 + rr < row_end and d0 + dd < n_pair
                        sh_a[e] = x[u64(x_at + rr * n_pair + (d0 + dd))] if inside else zero
                    for u in range(LOADS_Y):
                        e = tid + u32(u * NT)
                        kk = e // u32(DC)  # consecutive threads on consecutive pair dimensions of one key
                        dd = e - kk * u32(DC)
                        inside = j0 + kk < j_end and d0 + dd < n_pair
                        sh_b[dd * u32(TILE_KEYS) + kk] = y[u64(y_at + kk * n_pair + (d0 + dd))] if inside else zero
                    cuda.syncthreads()
                    for d2 in range(0, DC, UNROLL):
                        for d1 in range(UNROLL):
                            dd = d2 + d1
                            for a in range(RM):
                                ar[a] = sh_a[(ty + u32(a * TY)) * u32(DC) + u32(dd)]
                            for k in range(RS):
                                br[k] = sh_b[u32(dd * TILE_KEYS) + tx + u32(k * TX)]
                            for a in range(RM):
                                for k in range(RS):
                                    sc[a, k] += ar[a] * br[k]
                    cuda.syncthreads()
                # the mask in 32-bit tile coordinates (row rr = r - row0, key kk = j - j0): the keys of the tile,
                # kk < n_keys, and j <= r (lower: kk + TILE_ROWS <= rr + shift) or j >= r (upper: rr <= kk + shift),
                # the shifts clamped where the whole tile is on one side; rows past row_end are never written
                n_keys = u32(min(j_end - j0, TILE_KEYS))
                if lower:
                    shift = u32(min(row0 - j0 + TILE_ROWS, TILE_ROWS + TILE_KEYS))
                else:
                    shift = u32(min(j0 - row0, TILE_ROWS))
                for a in range(RM):
                    rr = ty + u32(a * TY)
                    for k in range(RS):
                        kk = tx + u32(k * TX)
                        keep = kk < n_keys and ((kk + u32(TILE_ROWS) <= rr + shift) if lower else (rr <= kk + shift))
                        # masked entries are set to 0, not multiplied (inf * 0 is NaN)
                        sh_s[rr * u32(S_STRIDE) + kk] = sc[a, k] if keep else zero
                for k0 in range(0, min(TILE_KEYS, j_end - j0), DC):
                    z_at = (base + j0 + k0) * n_z + o0
                    for u in range(LOADS_B):
                        e = tid + u32(u * NT)
                        kk = e // u32(TILE_COLS)
                        oo = e - kk * u32(TILE_COLS)
                        inside = j0 + k0 + kk < j_end and o0 + oo < n_out
                        sh_b[e] = z[u64(z_at + kk * n_z + oo)] if inside else zero
                    cuda.syncthreads()  # also orders the score tile's writes before its reads
                    for k2 in range(0, DC, UNROLL):
                        for k1 in range(UNROLL):
                            kk = k2 + k1
                            for a in range(RM):
                                ar[a] = sh_s[(ty + u32(a * TY)) * u32(S_STRIDE) + u32(k0 + kk)]
                            for k in range(RN):
                                br[k] = sh_b[u32(kk * TILE_COLS) + tx + u32(k * TX)]
                            for a in range(RM):
                                for k in range(RN):
                                    acc[a, k] += ar[a] * br[k]
                    cuda.syncthreads()
        for a in range(RM):
            r = row0 + (ty + u32(a * TY))
            out_at = (base + r) * n_out + o0
            for k in range(RN):
                oo = tx + u32(k * TX)
                if r < row_end and o0 + oo < n_out:
                    out[u64(out_at + oo)] = acc[a, k]

    return _chunk_rows


#: The builds of the two products, ``{name: {key: kernel}}``: by dtype on a GPU, by geometry in the simulator.
_BUILDERS = {"_chunk_states": _build_chunk_states, "_chunk_rows": _build_chunk_rows}
if SIMULATOR:
    _BUILDS = {name: {SIMULATOR_GEOMETRY: build(SIMULATOR_GEOMETRY)} for name, build in _BUILDERS.items()}
else:
    _BUILDS = {name: {np.dtype(str(f)): build(GPU_GEOMETRIES[np.dtype(str(f))], f) for f in (float32, float64)}
               for name, build in _BUILDERS.items()}


def _built(name, dtype):
    """Kernel ``name`` for ``dtype``: on a GPU its build (its tiles, its launch bounds); in the simulator the build
    for the geometry of :data:`GEOMETRIES` (made at the first launch with it)."""
    dtype = np.dtype(dtype)
    if not SIMULATOR:
        return _BUILDS[name][dtype]
    g = GEOMETRIES[dtype]
    if g not in _BUILDS[name]:
        _BUILDS[name][g] = _BUILDERS[name](g)
    return _BUILDS[name][g]


def _states_kernel(dtype):
    """:func:`_chunk_states` for ``dtype`` (:func:`_built`)."""
    return _built("_chunk_states", dtype)


def _rows_kernel(dtype):
    """:func:`_chunk_rows` for ``dtype`` (:func:`_built`)."""
    return _built("_chunk_rows", dtype)


# d = num[:, -1] + eps; out[a:b] = num[:, :-1] / d[:, None]; den[a:b] = d (refimpl.scan._causal_forward), and
# den = phi_q @ z + eps, (phi_q @ s) / den[:, None] (refimpl.scan._bidirectional_forward).
# One thread per entry (i, e) of one sequence's num [N, E] on grid x, the sequence b on grid y, z; the thread of the
# last column writes den.
@kernel(lambda f: (f[:, :, ::1], f, f[:, :, ::1], f[:, ::1]), threads=THREADS, tags=("gma",))
def _normalise(num, eps, out, den):
    B, N, E = num.shape
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= B or i >= N * E:
        return
    e = i % E
    t = i // E
    d = num[b, t, E - 1] + eps
    if e < E - 1:
        # d = 0 only with eps = 0, which the caller refuses; NaN is written without forming 0 / 0
        out[b, t, e] = num[b, t, e] / d if d != 0 else num.dtype.type(math.nan)
    else:
        den[b, t] = d


# np.divide(g, c.den[:, None], out=g1[:, :-1]); g1[:, -1] = -np.sum(g * c.out, axis=1) / c.den
# (refimpl.scan._scaled_grads): [G / den, delta].  One thread per entry (i, e) of one sequence's g1 [N, E] on grid x,
# the sequence b on grid y, z; the thread of the last column sums g_i . out_i over the d_v columns.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, ::1], f[:, :, ::1]), threads=THREADS, tags=("gma",))
def _scaled_grads(g, out, den, g1):
    B, N, E = g1.shape
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= B or i >= N * E:
        return
    e = i % E
    t = i // E
    if e < E - 1:
        g1[b, t, e] = g[b, t, e] / den[b, t]
    else:
        s = g1.dtype.type(0.0)
        for k in range(E - 1):
            s += g[b, t, k] * out[b, t, k]
        g1[b, t, e] = -s / den[b, t]


def launch_geometry(B: int, N: int, F: int, E: int, chunk: int, dtype=np.float64) -> dict:
    """``{launch: (grid, block)}`` of every kernel of the scan over ``B`` sequences of ``N`` tokens, a pure function.

    ``F`` features, ``E`` columns (``d_v + 1``), chunks of ``chunk`` tokens
    (:data:`SEGMENT` for the bidirectional sums).  Keys: ``"entries"`` (the
    one-thread-per-entry kernels over ``N x E``, and ``N x F`` as
    ``"entries F"``), ``"states"`` (:func:`_chunk_states`), ``"rows"``,
    ``"rows F"`` and ``"rows V"`` (:func:`_chunk_rows` writing ``E``, ``F``
    and ``E - 1`` columns: the read, ``dphi_q`` and ``dphi_k``, ``dv``),
    ``"scan"`` (a list: :func:`_scan_spans` at each
    level of the tree over the ``ceil(N / chunk)`` chunks) and ``"offsets"``
    (:func:`_add_offsets` at each level but the last).  Grid ``x`` stays within
    ``2^31 - 1`` and ``y``, ``z`` within 65,535 (the sequences, by
    :func:`~gpu.numba_cuda._primitives.sequence_axes`); blocks have at most
    1,024 threads.  The product kernels' tiles are those of ``dtype``
    (:data:`GEOMETRIES`).
    """
    chunk = max(1, int(chunk))
    n_chunks = blocks(N, chunk)
    c = constants(dtype)
    plan = {
        "entries": _entries_geometry(B, N * E),
        "entries F": _entries_geometry(B, N * F),
        "states": _tiles_geometry(B, n_chunks * blocks(F, c["TILE_ROWS"]) * blocks(E, c["TILE_COLS"]), c),
        "rows": _rows_geometry(B, N, chunk, E, dtype),
        "rows F": _rows_geometry(B, N, chunk, F, dtype),
        "rows V": _rows_geometry(B, N, chunk, E - 1, dtype),
        "scan": [],
        "offsets": [],
    }
    n, M = n_chunks, F * E
    while True:
        spans = blocks(n, SPAN)
        per_span = min(blocks(M, LANES), max(1, MAX_GRID_X // spans))
        plan["scan"].append((_grid(B, spans * per_span), (LANES, SPAN)))
        if spans == 1:
            break
        plan["offsets"].append(_entries_geometry(B, n * M))
        n = spans
    return plan


def _grid(B: int, x: int) -> tuple:
    """The grid of ``x`` blocks for each of ``B`` sequences (on ``y`` and ``z``); refuses more than the grid's ``x`` limit."""
    y, z = sequence_axes(B)
    if x > MAX_GRID_X:
        raise ValueError(f"scan: {x} blocks of one sequence exceed the grid's limit of {MAX_GRID_X}")
    return (max(1, int(x)), y, z)


def _tiles_geometry(B: int, x: int, c: dict) -> tuple:
    """``(grid, block)`` of a register-tiled kernel with ``x`` blocks of ``TX x TY`` threads (of ``c``) per sequence."""
    return _grid(B, x), (c["TX"], c["TY"])


def _rows_geometry(B: int, N: int, chunk: int, n_out: int, dtype) -> tuple:
    """``(grid, block)`` of :func:`_chunk_rows` writing ``n_out`` columns of ``N`` rows in chunks of ``chunk``."""
    chunk = max(1, int(chunk))
    c = constants(dtype)
    return _tiles_geometry(B, blocks(N, chunk) * blocks(chunk, c["TILE_ROWS"]) * blocks(max(1, n_out), c["TILE_COLS"]), c)


def _entries_geometry(B: int, n: int) -> tuple:
    """``(grid, block)`` of a one-thread-per-entry kernel over ``n`` entries of each of ``B`` sequences."""
    y, z = sequence_axes(B)
    x = blocks(n, THREADS)
    if x > MAX_GRID_X:
        raise ValueError(f"scan: {x} blocks of one sequence exceed the grid's limit of {MAX_GRID_X}")
    return (x, y, z), (THREADS,)


def _flat(a):
    """The 1-D view of a C-contiguous device array (no copy): the product kernels index it by flat offsets."""
    return a.reshape(a.size)


def _per_entry(kern, B, n, *args):
    """Launch a one-thread-per-entry kernel over ``n`` entries of each of ``B`` sequences."""
    grid, block = _entries_geometry(B, n)
    kern[grid, block](*args)


def _prefix(x, exclusive, reverse, total, levels, offsets):
    """The scan of :func:`_scan_spans` over axis 1 of ``x (B, n, M)``: the total into ``total (B, 1, M)``.

    With ``exclusive``, ``x`` is replaced by its exclusive prefix sums (in
    reversed order with ``reverse``).  One level of spans, then the same on
    the span totals, then their offsets added back: ``ceil(log_SPAN n)``
    levels, launched with the grids ``levels`` and ``offsets`` of
    :func:`launch_geometry`.
    """
    B, n, M = x.shape
    spans = blocks(n, SPAN)
    sums = total if spans == 1 else cuda.device_array((B, spans, M), dtype=x.dtype)
    grid, block = levels[0]
    _scan_spans[grid, block](x, exclusive, reverse, sums)
    if spans > 1:
        _prefix(sums, exclusive, False, total, levels[1:], offsets[1:])
        if exclusive:
            grid, block = offsets[0]
            _add_offsets[grid, block](x, sums, reverse)


class PackedSequences(NamedTuple):
    """The sequences of a packed call as the product kernels' batch: ``length[b]`` tokens from flat row ``first[b]``."""

    count: int  # B: the nonempty (head, sequence) pairs
    longest: int  # N: the most tokens of one
    first: object  # device int64 (B,): the flat row of its first token in the (H, T, ...) arrays, h T + cu_seqlens[s]
    length: object  # device int64 (B,): its tokens


def packed_sequences(cu_seqlens, heads: int) -> PackedSequences:
    """The nonempty sequences of ``heads`` heads of ``T = cu_seqlens[-1]`` packed tokens, head by head, built once per call."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    starts, lengths = cu[:-1], np.diff(cu)
    keep = lengths > 0
    first = (np.arange(heads, dtype=np.int64)[:, None] * cu[-1] + starts[keep]).ravel()
    length = np.tile(lengths[keep], heads)
    return PackedSequences(len(first), int(lengths.max(initial=0)), cuda.to_device(first), cuda.to_device(length))


def _batch(B, N, packed):
    """``(B, N, first, length)`` of the product kernels: ``B`` sequences of ``N`` tokens, or the packed ones."""
    if packed is None:
        none = cuda.device_array(0, dtype=np.int64)
        return B, N, none, none
    return packed.count, packed.longest, packed.first, packed.length


def _states(y, z, chunk, exclusive, reverse, packed=None):
    """``Y_c^T Z_c`` per chunk of ``chunk`` tokens: ``(prefixes, total)``, exclusive prefixes in place when asked.

    ``packed`` (:class:`PackedSequences`): the chunks of each packed sequence,
    from its first token (the longest one's count for every sequence: those
    past a sequence's end hold zeros).
    """
    B, N, first, length = _batch(*y.shape[:2], packed)
    F, E = y.shape[2], z.shape[2]
    n_chunks = blocks(N, chunk)
    plan = launch_geometry(B, N, F, E, chunk, y.dtype)
    partial = cuda.device_array((B, n_chunks, F, E), dtype=y.dtype)
    total = cuda.device_array((B, 1, F, E), dtype=y.dtype)
    grid, block = plan["states"]
    _states_kernel(y.dtype)[grid, block](_flat(y), _flat(z), (B, N, F, E, chunk, n_chunks), _flat(partial), first, length)
    _prefix(partial.reshape(B, n_chunks, F * E), exclusive, reverse, total.reshape(B, 1, F * E), plan["scan"], plan["offsets"])
    return partial, total


def _rows(p, states, transposed, x, y, z, chunk, within, lower, n_out, packed=None):
    """Launch :func:`_chunk_rows` over the rows of ``p``: a new ``(B, N, n_out)`` array (over each packed sequence's rows)."""
    out = cuda.device_array(p.shape[:2] + (n_out,), dtype=p.dtype)
    B, N, first, length = _batch(*p.shape[:2], packed)
    grid, block = _rows_geometry(B, N, chunk, n_out, p.dtype)
    dims = (B, N, chunk, p.shape[2], x.shape[2], z.shape[2], n_out) + tuple(states.shape[1:])
    flat = (_flat(a) for a in (p, states, x, y, z, out))
    _rows_kernel(p.dtype)[grid, block](*flat, dims, transposed, within, lower, first, length)
    return out


def scan_forward_device(phi_q, phi_k, v, causal, eps, chunk_size, cu_seqlens=None):
    """Core: the forward of :func:`refimpl.scan.scan_forward` for ``B`` sequences; no validation, no raise.

    Parameters
    ----------
    phi_q : device array, shape (B, N_q, F)
    phi_k : device array, shape (B, N_k, F)
    v : device array, shape (B, N_k, d_v)
        C-contiguous, of one float dtype.
    causal : bool
        Needs ``N_q == N_k``.
    eps : float
    chunk_size : int
    cu_seqlens : ndarray, shape (S + 1,), optional
        int64 offsets (on the host) of ``S`` sequences packed along ``N_q ==
        N_k``: each computed as on its own, its chunks from its first token,
        every (head, sequence) pair in the same launches (``B`` the heads).

    Returns
    -------
    out : device array, shape (B, N_q, d_v)
    cache : ScanDeviceCache
        Holds ``den`` (B, N_q), which the caller checks
        (:func:`refimpl.validation.check_denominators`).
    """
    B, n_q, F = phi_q.shape
    n_k, d_v = v.shape[1], v.shape[2]
    dtype = phi_q.dtype
    v1 = cuda.device_array((B, n_k, d_v + 1), dtype=dtype)
    _per_entry(_ones_column, B, n_k * (d_v + 1), v, v1)
    packed = None if cu_seqlens is None else packed_sequences(cu_seqlens, B)
    longest = n_k if packed is None else packed.longest
    if causal:
        chunk = min(int(chunk_size), longest)
        states, _ = _states(phi_k, v1, chunk, True, False, packed)
        num = _rows(phi_q, states, False, phi_q, phi_k, v1, chunk, True, True, d_v + 1, packed)
    else:
        chunk = longest
        _, states = _states(phi_k, v1, SEGMENT, False, False, packed)
        num = _rows(phi_q, states, False, phi_q, phi_k, v1, chunk, False, True, d_v + 1, packed)
    out = cuda.device_array((B, n_q, d_v), dtype=dtype)
    den = cuda.device_array((B, n_q), dtype=dtype)
    _per_entry(_normalise, B, n_q * (d_v + 1), num, dtype.type(eps), out, den)
    return out, ScanDeviceCache(phi_q, phi_k, v1, out, den, states, bool(causal), float(eps), chunk, packed)


def scan_backward_device(g, cache):
    """Core: the backward of :func:`refimpl.scan.scan_backward` for ``B`` sequences; no validation, no raise.

    Parameters
    ----------
    g : device array, shape (B, N_q, d_v)
        ``dL/d out``, of the cache's dtype, C-contiguous.
    cache : ScanDeviceCache

    Returns
    -------
    tuple of device arrays
        ``dphi_q`` (B, N_q, F), ``dphi_k`` (B, N_k, F), ``dv`` (B, N_k, d_v).
    """
    phi_q, phi_k, v1 = cache.phi_q, cache.phi_k, cache.v1
    B, n_q, F = phi_q.shape
    n_k, E = v1.shape[1], v1.shape[2]
    g1 = cuda.device_array((B, n_q, E), dtype=g.dtype)
    _per_entry(_scaled_grads, B, n_q * E, g, cache.out, cache.den, g1)
    packed = cache.packed  # a packed call's sequences, each its own chunks and states, as in the forward
    if cache.causal:
        chunk = cache.chunk
        # forward sweep with [S, z] before each chunk; backward sweep with [R, r] over the later chunks
        r_states, _ = _states(phi_q, g1, chunk, True, True, packed)
        dphi_q = _rows(g1, cache.states, True, g1, v1, phi_k, chunk, True, True, F, packed)
        dphi_k = _rows(v1, r_states, True, v1, g1, phi_q, chunk, True, False, F, packed)
        dv = _rows(phi_k, r_states, False, phi_k, phi_q, g1, chunk, True, False, E - 1, packed)
    else:
        # ds, dz = phi_q^T [gn, delta]
        _, r_states = _states(phi_q, g1, SEGMENT, False, False, packed)
        if packed is not None:
            n_q = n_k = packed.longest  # one chunk: a whole sequence, the longest's rows
        dphi_q = _rows(g1, cache.states, True, g1, v1, phi_k, n_q, False, True, F, packed)
        dphi_k = _rows(v1, r_states, True, v1, g1, phi_q, n_k, False, False, F, packed)
        dv = _rows(phi_k, r_states, False, phi_k, phi_q, g1, n_k, False, False, E - 1, packed)
    return dphi_q, dphi_k, dv
