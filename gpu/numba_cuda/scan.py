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
``TILE x TILE`` shared-memory tiles; the grid's second axis is the sequence.

1. :func:`_ones_column`: ``V_1 = [V, 1]``, one thread per entry.
2. :func:`_chunk_states`: per chunk (causal) or segment (bidirectional), the
   ``F x E`` partial :math:`\Phi_{K,c}^\top V_{1,c}`, one block per chunk and
   ``TILE x TILE`` output tile, looping over the chunk's tokens in tiles.
3. :func:`_scan_chunks`: one thread per state entry ``(b, f, e)``, looping
   over the chunks in order: the exclusive prefix (forward or reverse) in
   place, and the total.  Ordered, so deterministic; no atomics anywhere.
4. :func:`_chunk_rows`: one block per ``TILE`` rows of one chunk: the rows
   times their chunk's state, then, when causal, the masked
   ``TILE x TILE`` score tiles of the chunk times the values' tiles.
5. :func:`_normalise` and :func:`_scaled_grads`: one thread per entry.

:func:`scan_forward_device` and :func:`scan_backward_device` are the
device-level cores (no validation, no raise; the caller checks the
denominators), used by :mod:`gpu.numba_cuda.gma`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from numba import boolean, config, cuda, int64

from ._device import blocks, kernel

__all__ = ["TILE", "SEGMENT", "THREADS", "ScanDeviceCache", "scan_forward_device", "scan_backward_device"]

#: True when kernels run in the CUDA simulator (every thread a Python thread): the blocks are then kept small.
SIMULATOR = bool(config.ENABLE_CUDASIM)
#: Side of the square thread blocks and shared-memory tiles: 16 (256 threads) on a GPU, 4 (16 threads) in the simulator.
TILE = 4 if SIMULATOR else 16
TILE2 = (TILE, TILE)
#: Tokens per segment of the bidirectional reductions over tokens (one partial state per segment, then an ordered sum).
SEGMENT = 256
#: Threads per block of the one-thread-per-entry kernels.
THREADS = 32 if SIMULATOR else 128


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
# One thread per entry (b, j, e) of V_1 [B, N, E] over a 1-D grid, consecutive threads on consecutive e.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1]))
def _ones_column(v, v1):
    B, N, E = v1.shape
    i = cuda.grid(1)
    if i >= B * N * E:
        return
    e = i % E
    row = i // E
    j = row % N
    b = row // N
    if e < E - 1:
        v1[b, j, e] = v[b, j, e]
    else:
        v1[b, j, e] = v1.dtype.type(1.0)


# s1 += pk.T @ vc (refimpl.scan._causal_forward), and s = phi_k.T @ v, z = phi_k.sum(axis=0) per segment
# (refimpl.scan._bidirectional_forward); the backward's r1 += pq.T @ gc and ds, dz = phi_q.T @ [gn, delta] likewise:
# partial[b, c] = Y_c^T Z_c over the tokens j of chunk c.
# Grid (n_chunks * F-tiles * E-tiles, B); block TILE x TILE, thread (ty, tx) owns entry (f0 + ty, e0 + tx) [F, E];
# the chunk's tokens are read TILE at a time into shared tiles, tokens x features [T, T] and tokens x columns [T, T].
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], int64, f[:, :, :, ::1]))
def _chunk_states(y, z, chunk, partial):
    sh_y = cuda.shared.array(TILE2, dtype=y.dtype)  # [T tokens, T features]
    sh_z = cuda.shared.array(TILE2, dtype=y.dtype)  # [T tokens, T columns]
    zero = y.dtype.type(0.0)
    N = y.shape[1]
    F = y.shape[2]
    E = z.shape[2]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y
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
# before it), r1 += pq.T @ gc over the later chunks (refimpl.scan._causal_backward), or the sum over the segments.
# One thread per state entry (b, f, e) over a 1-D grid, consecutive threads on consecutive entries; each loops over
# the chunks in order (reversed with `reverse`), writing the exclusive prefix in place when `exclusive`, then the total.
@kernel(lambda f: (f[:, :, :, ::1], boolean, boolean, f[:, :, :, ::1]))
def _scan_chunks(partial, exclusive, reverse, total):
    B, C, F, E = partial.shape
    i = cuda.grid(1)
    if i >= B * F * E:
        return
    e = i % E
    k = (i // E) % F
    b = i // (E * F)
    run = partial.dtype.type(0.0)
    for s in range(C):
        c = C - 1 - s if reverse else s
        val = partial[b, c, k, e]
        if exclusive:
            partial[b, c, k, e] = run
        run += val
    total[b, 0, k, e] = run


# num = pq @ s1 + block @ vc with block = tril(pq @ pk.T) (refimpl.scan._causal_forward), and its backward lines
# dphi_q = gc @ s1.T + m @ pk, dphi_k = vc @ r1.T + m.T @ pq, dv = pk @ r1[:, :-1] + block.T @ gc[:, :-1]
# (refimpl.scan._causal_backward); bidirectional (one chunk, no within-chunk term): phi_q @ s, gn @ s.T + delta z,
# v @ ds.T + dz, phi_k @ ds.  In general, for row r of chunk c:
#     out[r, o] = sum_h p[r, h] state_c[h, o]  (state_c transposed when `transposed`)
#               + sum_{j in chunk c, j <= r (lower) or j >= r} (x_r . y_j) z[j, o]       when `within`.
# Grid (n_chunks * tiles per chunk, B); block TILE x TILE: thread (ty, tx) owns row r = row0 + ty and the columns
# o = o0 + tx of every column tile.  The state product runs over shared tiles p [T rows, T h] and state [T h, T o];
# each TILE-key score tile x y^T [T rows, T keys] is built from shared tiles of x and y, masked, kept in shared
# memory and multiplied by the z tiles [T keys, T o], accumulated into out by the thread that owns the entry.
@kernel(lambda f: (f[:, :, ::1], f[:, :, :, ::1], boolean, f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64, boolean, boolean, f[:, :, ::1]))
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
    b = cuda.blockIdx.y
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
# One thread per entry (b, i, e) of num [B, N, E] over a 1-D grid; the thread of the last column writes den.
@kernel(lambda f: (f[:, :, ::1], f, f[:, :, ::1], f[:, ::1]))
def _normalise(num, eps, out, den):
    B, N, E = num.shape
    i = cuda.grid(1)
    if i >= B * N * E:
        return
    e = i % E
    row = i // E
    t = row % N
    b = row // N
    d = num[b, t, E - 1] + eps
    if e < E - 1:
        # d = 0 only with eps = 0, which the caller refuses; NaN is written without forming 0 / 0
        out[b, t, e] = num[b, t, e] / d if d != 0 else num.dtype.type(math.nan)
    else:
        den[b, t] = d


# np.divide(g, c.den[:, None], out=g1[:, :-1]); g1[:, -1] = -np.sum(g * c.out, axis=1) / c.den
# (refimpl.scan._scaled_grads): [G / den, delta].  One thread per entry (b, i, e) of g1 [B, N, E] over a 1-D grid;
# the thread of the last column sums g_i . out_i over the d_v columns.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, ::1], f[:, :, ::1]))
def _scaled_grads(g, out, den, g1):
    B, N, E = g1.shape
    i = cuda.grid(1)
    if i >= B * N * E:
        return
    e = i % E
    row = i // E
    t = row % N
    b = row // N
    if e < E - 1:
        g1[b, t, e] = g[b, t, e] / den[b, t]
    else:
        s = g1.dtype.type(0.0)
        for k in range(E - 1):
            s += g[b, t, k] * out[b, t, k]
        g1[b, t, e] = -s / den[b, t]


def _per_entry(kern, n, *args):
    kern[blocks(n, THREADS), THREADS](*args)


def _states(y, z, chunk, exclusive, reverse):
    """``Y_c^T Z_c`` per chunk of ``chunk`` tokens: ``(prefixes, total)``, exclusive prefixes in place when asked."""
    B, N, F = y.shape
    E = z.shape[2]
    n_chunks = blocks(N, chunk)
    partial = cuda.device_array((B, n_chunks, F, E), dtype=y.dtype)
    total = cuda.device_array((B, 1, F, E), dtype=y.dtype)
    grid = (n_chunks * blocks(F, TILE) * blocks(E, TILE), B)
    _chunk_states[grid, (TILE, TILE)](y, z, chunk, partial)
    _per_entry(_scan_chunks, B * F * E, partial, exclusive, reverse, total)
    return partial, total


def _rows(p, states, transposed, x, y, z, chunk, within, lower, n_out):
    """Launch :func:`_chunk_rows` over the rows of ``p``: a new ``(B, N, n_out)`` array."""
    B, N, _ = p.shape
    out = cuda.device_array((B, N, n_out), dtype=p.dtype)
    grid = (blocks(N, chunk) * blocks(chunk, TILE), B)
    _chunk_rows[grid, (TILE, TILE)](p, states, transposed, x, y, z, chunk, within, lower, out)
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
    _per_entry(_ones_column, v1.size, v, v1)
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
    _per_entry(_normalise, num.size, num, dtype.type(eps), out, den)
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
    _per_entry(_scaled_grads, g1.size, g, cache.out, cache.den, g1)
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
