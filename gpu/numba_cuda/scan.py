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
Every product-shaped kernel runs blocks of ``TILE x TILE`` threads with
``TILE x TILE`` shared-memory tiles.  Every grid comes from
:func:`launch_geometry`, a pure function of the shapes: its ``x`` axis runs
over the work of one sequence, ``y`` and ``z`` over the sequences
(:func:`~gpu.numba_cuda._primitives.sequence_axes`), all within the
hardware's limits for any ``N`` and ``B``.

1. :func:`_ones_column`: ``V_1 = [V, 1]``, one thread per entry.
2. :func:`_chunk_states`: per chunk (causal) or segment (bidirectional), the
   ``F x E`` partial :math:`\Phi_{K,c}^\top V_{1,c}`, one block per chunk and
   ``TILE x TILE`` output tile, looping over the chunk's tokens in tiles.
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
   trees, ``n`` for the offsets, and ``n / SPAN`` at the next level).  The
   pairs combined depend on the launch configuration only, so two runs give
   the same bits; there are no atomics anywhere.
4. :func:`_chunk_rows`: one block per ``TILE`` rows of one chunk: the rows
   times their chunk's state, then, when causal, the masked
   ``TILE x TILE`` score tiles of the chunk times the values' tiles.
5. :func:`_normalise` and :func:`_scaled_grads`: one thread per entry.

Launches: the forward makes ``4 + (2 L - 1)`` (causal) or ``3 + L_seg``
(bidirectional, over segments of :data:`SEGMENT` tokens); the backward
``5 + (2 L - 1)`` or ``5 + L_seg``.

:func:`scan_forward_device` and :func:`scan_backward_device` are the
device-level cores (no validation, no raise, no copy to the host; the caller
checks the denominators), used by :mod:`gpu.numba_cuda.gma`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from numba import boolean, config, cuda, int64

from ._device import blocks, kernel
from ._primitives import MAX_GRID_X, exclusive_scan_columns, sequence_axes

__all__ = [
    "TILE",
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
#: Side of the square thread blocks and shared-memory tiles: 16 (256 threads) on a GPU, 4 (16 threads) in the simulator.
TILE = 4 if SIMULATOR else 16
TILE2 = (TILE, TILE)
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


# s1 += pk.T @ vc (refimpl.scan._causal_forward), and s = phi_k.T @ v, z = phi_k.sum(axis=0) per segment
# (refimpl.scan._bidirectional_forward); the backward's r1 += pq.T @ gc and ds, dz = phi_q.T @ [gn, delta] likewise:
# partial[b, c] = Y_c^T Z_c over the tokens j of chunk c.
# Grid (n_chunks * F-tiles * E-tiles, sequences on y, z); block TILE x TILE, thread (ty, tx) owns entry
# (f0 + ty, e0 + tx) [F, E]; the chunk's tokens are read TILE at a time into shared tiles, tokens x features [T, T]
# and tokens x columns [T, T].
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], int64, f[:, :, :, ::1]), threads=TILE * TILE, tags=("gma",))
def _chunk_states(y, z, chunk, partial):
    sh_y = cuda.shared.array(TILE2, dtype=y.dtype)  # [T tokens, T features]
    sh_z = cuda.shared.array(TILE2, dtype=y.dtype)  # [T tokens, T columns]
    zero = y.dtype.type(0.0)
    N = y.shape[1]
    F = y.shape[2]
    E = z.shape[2]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    if b >= y.shape[0]:
        return
    f_tiles = (F + TILE - 1) // TILE
    e_tiles = (E + TILE - 1) // TILE
    c = cuda.blockIdx.x // (f_tiles * e_tiles)
    rest = cuda.blockIdx.x - c * f_tiles * e_tiles
    f0 = (rest // e_tiles) * TILE
    e0 = (rest % e_tiles) * TILE
    j_start = c * chunk
    j_end = min(j_start + chunk, N)
    acc = zero
    for j0 in range(j_start, j_end, TILE):
        j = j0 + ty
        sh_y[ty, tx] = y[b, j, f0 + tx] if j < j_end and f0 + tx < F else zero
        sh_z[ty, tx] = z[b, j, e0 + tx] if j < j_end and e0 + tx < E else zero
        cuda.syncthreads()
        for jj in range(TILE):
            acc += sh_y[jj, ty] * sh_z[jj, tx]
        cuda.syncthreads()
    if f0 + ty < F and e0 + tx < E:
        partial[b, c, f0 + ty, e0 + tx] = acc


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
#               + sum_{j in chunk c, j <= r (lower) or j >= r} (x_r . y_j) z[j, o]       when `within`.
# Grid (n_chunks * tiles per chunk, sequences on y, z); block TILE x TILE: thread (ty, tx) owns row r = row0 + ty and the columns
# o = o0 + tx of every column tile.  The state product runs over shared tiles p [T rows, T h] and state [T h, T o];
# each TILE-key score tile x y^T [T rows, T keys] is built from shared tiles of x and y, masked, kept in shared
# memory and multiplied by the z tiles [T keys, T o], accumulated into out by the thread that owns the entry.
@kernel(
    lambda f: (f[:, :, ::1], f[:, :, :, ::1], boolean, f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64, boolean, boolean, f[:, :, ::1]),
    threads=TILE * TILE,
    tags=("gma",),
)
def _chunk_rows(p, states, transposed, x, y, z, chunk, within, lower, out):
    sh_a = cuda.shared.array(TILE2, dtype=p.dtype)  # [T rows, T h] or [T rows, T pair dims]
    sh_b = cuda.shared.array(TILE2, dtype=p.dtype)  # [T h, T o], [T keys, T pair dims] or [T keys, T o]
    sh_s = cuda.shared.array(TILE2, dtype=p.dtype)  # [T rows, T keys]: the masked scores
    zero = p.dtype.type(0.0)
    N = p.shape[1]
    n_in = p.shape[2]
    n_out = out.shape[2]
    n_pair = x.shape[2]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
    if b >= p.shape[0]:
        return
    tiles = (chunk + TILE - 1) // TILE
    c = cuda.blockIdx.x // tiles
    row0 = c * chunk + (cuda.blockIdx.x - c * tiles) * TILE
    chunk_end = min((c + 1) * chunk, N)
    row_end = min(row0 + TILE, chunk_end)
    if row0 >= row_end:
        return
    r = row0 + ty
    row_ok = r < row_end
    # the carried state: p_r . state_c
    for o0 in range(0, n_out, TILE):
        o = o0 + tx
        acc = zero
        for h0 in range(0, n_in, TILE):
            sh_a[ty, tx] = p[b, r, h0 + tx] if row_ok and h0 + tx < n_in else zero
            h = h0 + ty
            if h < n_in and o < n_out:
                sh_b[ty, tx] = states[b, c, o, h] if transposed else states[b, c, h, o]
            else:
                sh_b[ty, tx] = zero
            cuda.syncthreads()
            for hh in range(TILE):
                acc += sh_a[ty, hh] * sh_b[hh, tx]
            cuda.syncthreads()
        if row_ok and o < n_out:
            out[b, r, o] = acc
    if not within:
        return
    # within the chunk: the masked score tiles times the z tiles
    if lower:
        j_start = c * chunk
        j_end = row_end
    else:
        j_start = row0
        j_end = chunk_end
    for j0 in range(j_start, j_end, TILE):
        score = zero
        for d0 in range(0, n_pair, TILE):
            sh_a[ty, tx] = x[b, r, d0 + tx] if row_ok and d0 + tx < n_pair else zero
            sh_b[ty, tx] = y[b, j0 + ty, d0 + tx] if j0 + ty < j_end and d0 + tx < n_pair else zero
            cuda.syncthreads()
            for dd in range(TILE):
                score += sh_a[ty, dd] * sh_b[tx, dd]
            cuda.syncthreads()
        j = j0 + tx
        keep = row_ok and j < j_end and ((j <= r) if lower else (j >= r))
        # masked entries are set to 0, not multiplied (inf * 0 is NaN)
        sh_s[ty, tx] = score if keep else zero
        for o0 in range(0, n_out, TILE):
            o = o0 + tx
            sh_b[ty, tx] = z[b, j0 + ty, o] if j0 + ty < j_end and o < n_out else zero
            cuda.syncthreads()
            part = zero
            for jj in range(TILE):
                part += sh_s[ty, jj] * sh_b[jj, tx]
            if row_ok and o < n_out:
                out[b, r, o] += part
            cuda.syncthreads()


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


def launch_geometry(B: int, N: int, F: int, E: int, chunk: int) -> dict:
    """``{launch: (grid, block)}`` of every kernel of the scan over ``B`` sequences of ``N`` tokens, a pure function.

    ``F`` features, ``E`` columns (``d_v + 1``), chunks of ``chunk`` tokens
    (:data:`SEGMENT` for the bidirectional sums).  Keys: ``"entries"`` (the
    one-thread-per-entry kernels over ``N x E``, and ``N x F`` as
    ``"entries F"``), ``"states"`` (:func:`_chunk_states`), ``"rows"``
    (:func:`_chunk_rows`), ``"scan"`` (a list: :func:`_scan_spans` at each
    level of the tree over the ``ceil(N / chunk)`` chunks) and ``"offsets"``
    (:func:`_add_offsets` at each level but the last).  Grid ``x`` stays within
    ``2^31 - 1`` and ``y``, ``z`` within 65,535 (the sequences, by
    :func:`~gpu.numba_cuda._primitives.sequence_axes`); blocks have at most
    1,024 threads.
    """
    y, z = sequence_axes(B)
    chunk = max(1, int(chunk))
    n_chunks = blocks(N, chunk)

    def grid(x):
        if x > MAX_GRID_X:
            raise ValueError(f"scan: {x} blocks of one sequence exceed the grid's limit of {MAX_GRID_X}")
        return (max(1, int(x)), y, z)

    plan = {
        "entries": _entries_geometry(B, N * E),
        "entries F": _entries_geometry(B, N * F),
        "states": (grid(n_chunks * blocks(F, TILE) * blocks(E, TILE)), (TILE, TILE)),
        "rows": (grid(n_chunks * blocks(chunk, TILE)), (TILE, TILE)),
        "scan": [],
        "offsets": [],
    }
    n, M = n_chunks, F * E
    while True:
        spans = blocks(n, SPAN)
        per_span = min(blocks(M, LANES), max(1, MAX_GRID_X // spans))
        plan["scan"].append((grid(spans * per_span), (LANES, SPAN)))
        if spans == 1:
            break
        plan["offsets"].append(_entries_geometry(B, n * M))
        n = spans
    return plan


def _entries_geometry(B: int, n: int) -> tuple:
    """``(grid, block)`` of a one-thread-per-entry kernel over ``n`` entries of each of ``B`` sequences."""
    y, z = sequence_axes(B)
    x = blocks(n, THREADS)
    if x > MAX_GRID_X:
        raise ValueError(f"scan: {x} blocks of one sequence exceed the grid's limit of {MAX_GRID_X}")
    return (x, y, z), (THREADS,)


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


def _states(y, z, chunk, exclusive, reverse):
    """``Y_c^T Z_c`` per chunk of ``chunk`` tokens: ``(prefixes, total)``, exclusive prefixes in place when asked."""
    B, N, F = y.shape
    E = z.shape[2]
    n_chunks = blocks(N, chunk)
    plan = launch_geometry(B, N, F, E, chunk)
    partial = cuda.device_array((B, n_chunks, F, E), dtype=y.dtype)
    total = cuda.device_array((B, 1, F, E), dtype=y.dtype)
    grid, block = plan["states"]
    _chunk_states[grid, block](y, z, chunk, partial)
    _prefix(partial.reshape(B, n_chunks, F * E), exclusive, reverse, total.reshape(B, 1, F * E), plan["scan"], plan["offsets"])
    return partial, total


def _rows(p, states, transposed, x, y, z, chunk, within, lower, n_out):
    """Launch :func:`_chunk_rows` over the rows of ``p``: a new ``(B, N, n_out)`` array."""
    B, N, _ = p.shape
    out = cuda.device_array((B, N, n_out), dtype=p.dtype)
    grid, block = launch_geometry(B, N, 1, 1, chunk)["rows"]
    _chunk_rows[grid, block](p, states, transposed, x, y, z, chunk, within, lower, out)
    return out


def scan_forward_device(phi_q, phi_k, v, causal, eps, chunk_size):
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
    if causal:
        chunk = min(int(chunk_size), n_k)
        states, _ = _states(phi_k, v1, chunk, True, False)
        num = _rows(phi_q, states, False, phi_q, phi_k, v1, chunk, True, True, d_v + 1)
    else:
        chunk = n_q
        _, states = _states(phi_k, v1, SEGMENT, False, False)
        num = _rows(phi_q, states, False, phi_q, phi_k, v1, n_q, False, True, d_v + 1)
    out = cuda.device_array((B, n_q, d_v), dtype=dtype)
    den = cuda.device_array((B, n_q), dtype=dtype)
    _per_entry(_normalise, B, n_q * (d_v + 1), num, dtype.type(eps), out, den)
    return out, ScanDeviceCache(phi_q, phi_k, v1, out, den, states, bool(causal), float(eps), chunk)


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
    if cache.causal:
        chunk = cache.chunk
        # forward sweep with [S, z] before each chunk; backward sweep with [R, r] over the later chunks
        r_states, _ = _states(phi_q, g1, chunk, True, True)
        dphi_q = _rows(g1, cache.states, True, g1, v1, phi_k, chunk, True, True, F)
        dphi_k = _rows(v1, r_states, True, v1, g1, phi_q, chunk, True, False, F)
        dv = _rows(phi_k, r_states, False, phi_k, phi_q, g1, chunk, True, False, E - 1)
    else:
        # ds, dz = phi_q^T [gn, delta]
        _, r_states = _states(phi_q, g1, SEGMENT, False, False)
        dphi_q = _rows(g1, cache.states, True, g1, v1, phi_k, n_q, False, True, F)
        dphi_k = _rows(v1, r_states, True, v1, g1, phi_q, n_k, False, False, F)
        dv = _rows(phi_k, r_states, False, phi_k, phi_q, g1, n_k, False, False, E - 1)
    return dphi_q, dphi_k, dv
