r"""Attention on the CPU as fused Numba kernels, mirroring :mod:`refimpl.attention`.

Softmax attention
-----------------
:func:`softmax_attention`, :func:`softmax_attention_forward` and
:func:`softmax_attention_backward` compute what their namesakes in
:mod:`refimpl.attention` compute, bound to the reference's signatures,
checks and errors (:mod:`refimpl.boundary`), but never form the
``N_q x N_k`` matrix: an online softmax in the manner of FlashAttention
(Dao et al. 2022), in memory :math:`O(N)` per sequence.

*Why the running rescaling gives the exact softmax.*  Fix a query row with
scores :math:`\ell_j = \beta\, q\cdot k_j` and take its keys tile by tile.
After the keys :math:`S` seen so far the row holds
:math:`m = \max_{j\in S}\ell_j`, :math:`s = \sum_{j\in S} e^{\ell_j - m}`
and :math:`a = \sum_{j\in S} e^{\ell_j - m} v_j`.  A new tile :math:`T` gives

.. math::

    m' = \max\big(m, \max_{j\in T}\ell_j\big),\qquad
    s' = s\,e^{m - m'} + \sum_{j\in T} e^{\ell_j - m'},\qquad
    a' = a\,e^{m - m'} + \sum_{j\in T} e^{\ell_j - m'}\,v_j ,

the same three quantities for :math:`S\cup T`, because
:math:`e^{\ell_j - m}e^{m - m'} = e^{\ell_j - m'}`.  After the last tile
:math:`a/s = \sum_j \operatorname{softmax}(\ell)_j\, v_j`.  Every exponent
is :math:`\le 0` and the largest term is :math:`e^0 = 1`, so nothing
overflows and :math:`s \ge 1`: the safeguards of the per-row maximum of
:mod:`refimpl.numerics`.  Only rounding differs from the reference.

*The backward recomputes the probabilities.*  The forward keeps, per row,
the maximum :math:`m_i` and the sum :math:`s_i` (together the log-sum-exp
:math:`m_i + \log s_i`), so that :math:`P_{ij} = e^{\ell_{ij} - m_i}/s_i`
can be formed again tile by tile.  With :math:`G = \partial L/\partial O`
(``docs/derivations/softmax_attention.md#backward``), and
:math:`\sum_j P_{ij}\,dP_{ij} = \sum_j P_{ij}\, G_i\cdot v_j = G_i\cdot O_i`:

.. math::

    D_i = \sum_c G_{ic} O_{ic},\qquad
    d\ell_{ij} = P_{ij}\big(G_i\cdot v_j - D_i\big),\qquad
    d\mathbf Q = \beta\, d\ell\,\mathbf K,\qquad
    d\mathbf K = \beta\, d\ell^\top\mathbf Q,\qquad
    d\mathbf V = P^\top G .

How the work maps onto the loops
--------------------------------
The kernels take ``H`` heads of rows, each holding sequences one after
another at offsets: the leading (batch, head) dimensions of an unpacked
call flattened to ``H = BH`` heads of one sequence each, or a packed call's
heads of ``S`` sequences (``cu_seqlens``), left packed.

* Forward, and ``dQ``: ``prange`` over a flat list of work items (head,
  sequence, block of :data:`ROWS` query rows); each thread owns its rows,
  and takes its sequence's keys in tiles of :data:`TILE`.  ``dK`` and ``dV``
  sum over query rows: a second kernel, its ``prange`` over (head, sequence,
  block of :data:`ROWS` key rows), each thread owning its key rows and
  taking all its sequence's query rows in tiles.  No two threads write one
  entry and every sum has a fixed order: the results are the same bits
  whatever the number of threads.
* A tile of scores is formed with the coordinates outside and the keys
  inside, from the keys stored transposed tile by tile (each tile's
  ``d x n`` block contiguous where its rows were, the tiles counted from
  each sequence's first row, nothing padded): the inner loop runs
  over contiguous memory with independent lanes and vectorises without
  reordering any sum.  Every score is summed over the coordinates in
  ascending order in all three passes, so the backward recomputes the
  forward's scores bit for bit.
* Causal: a row takes the keys ``j <= i`` only; the tiles past the diagonal
  are not visited.  A sequence's blocks are interleaved (light, heavy,
  light, ...) so that the threads' contiguous shares of the ``prange``
  carry equal work.
* float32 inputs are computed in float32 (every constant is cast to the
  input's dtype).

Packed sequences
----------------
A packed call (``cu_seqlens``) computes every (head, sequence) in one call
of the forward kernel, and of each backward kernel: many short sequences
make as many work items, shared by the threads, with no Python call per
sequence and no row padded to the longest sequence (memory linear in the
``T`` packed tokens).  Each row is computed with the same sums in the same
order as by the unpacked call of its sequence, so the packed call gives the
loop's results (:mod:`refimpl.varlen`) bit for bit.  Where a score overflows
the loop computes the call, and refuses it naming the row in its sequence.

Linear attention
----------------
:func:`linear_attention`, :func:`linear_attention_forward` and
:func:`linear_attention_backward` are :mod:`refimpl.attention`'s, batch rule
included (:func:`refimpl.attention.linear_forward_with`), with the causal
scan and its sweeps of :mod:`cpu.scan`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from refimpl import attention as ref_attention
from refimpl import boundary, validation
from refimpl.attention import LinearAttentionBatchCache, LinearAttentionCache, LinearAttentionGrads, SoftmaxAttentionGrads

from . import scan as cpu_scan
from ._lanes import sum8
from ._record import backend
from .vexp import exp

# the names this module defines; it also holds refimpl.attention's SoftmaxAttentionGrads, LinearAttentionGrads,
# LinearAttentionCache and LinearAttentionBatchCache, which its functions return (documented there)
__all__ = [
    "softmax_attention",
    "softmax_attention_forward",
    "softmax_attention_backward",
    "OnlineSoftmaxCache",
    "SoftmaxPackedCache",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
]

# ---------------------------------------------------------------------------
# Softmax attention (online softmax)
# ---------------------------------------------------------------------------

ROWS = 32
"""Rows of a block: the unit of work of one ``prange`` iteration (query rows, or key rows in the backward)."""

TILE = 64
"""Keys (query rows, in the backward's second pass) per tile: one tile's scores of a row are formed together."""


class OnlineSoftmaxCache(NamedTuple):
    """What :func:`softmax_attention_backward` needs: ``O(N)`` per sequence, no attention matrix.

    The arrays are flattened to ``BH`` sequences and C-contiguous; ``out``
    shares its memory with the output the forward returned (as the
    reference's cache shares the inputs): write into neither before the
    backward.
    """

    q: np.ndarray  # (BH, N_q, d)
    k: np.ndarray  # (BH, N_k, d)
    v: np.ndarray  # (BH, N_k, d_v)
    out: np.ndarray  # (BH, N_q, d_v)
    row_max: np.ndarray  # (BH, N_q) the maximum score m_i of every row
    row_sum: np.ndarray  # (BH, N_q) s_i = sum_j exp(l_ij - m_i); the log-sum-exp is m_i + log s_i
    scale: float
    causal: bool
    batch_shape: tuple  # the leading dimensions, () for 2-D inputs


class SoftmaxPackedCache(NamedTuple):
    """What :func:`softmax_attention_backward` needs of a packed forward computed in one call (every (head, sequence)).

    The tokens stay packed, the heads' rows one after another with no
    padding: ``O(T (d + d_v))`` per head.  ``out`` is the output the forward
    returned: write into neither before the backward.
    """

    offsets: np.ndarray  # cu_seqlens, int64 (S + 1,)
    q: np.ndarray  # (H, T, d): heads first and C-contiguous (H = 1 without heads)
    k: np.ndarray  # (H, T, d)
    v: np.ndarray  # (H, T, d_v)
    out: np.ndarray  # (T, d_v) or (T, H, d_v): the packed output, the shape of grad_out
    row_max: np.ndarray  # (H, T) the maximum score m_i of every row
    row_sum: np.ndarray  # (H, T) s_i = sum_j exp(l_ij - m_i)
    scale: float
    causal: bool
    leading: tuple  # () without heads, (H,) with


@njit(cache=True, fastmath=False, error_model="numpy")
def _tile(yt, b, j0, w):
    """The ``w`` rows from row ``j0`` of head ``b`` of ``yt`` (:func:`_tiles_transposed`), one tile: their ``d x w`` block, a view."""
    d = yt.shape[2]
    return yt[b].reshape((yt.shape[1] * d,))[j0 * d : (j0 + w) * d].reshape((d, w))


@njit(cache=True, fastmath=False, error_model="numpy")
def _dots(x, tile, b, ia, ib, o, n, row_a, row_b):
    """Two rows of a tile of dot products, ``row_a[jj] = sum_c x[b, ia, c] y_{o + jj, c}`` and ``row_b`` for ``ib``.

    ``tile`` is a tile of rows ``y`` transposed, ``d x w`` (:func:`_tile`),
    and ``o + n <= w``.  For ``jj < n``, each sum over ``c`` in ascending
    order.  ``ia == ib``
    is allowed (``row_b`` is then a copy).  The rows share every load of
    ``tile``, and four coordinates are added per pass over the rows (the same
    additions in the same order as one at a time); the inner loop runs over
    contiguous ``jj`` with independent lanes, so it vectorises exactly.
    """
    d = x.shape[2]
    for jj in range(n):
        row_a[jj] = 0
        row_b[jj] = 0
    c = 0
    while c + 4 <= d:
        a0, a1, a2, a3 = x[b, ia, c], x[b, ia, c + 1], x[b, ia, c + 2], x[b, ia, c + 3]
        b0, b1, b2, b3 = x[b, ib, c], x[b, ib, c + 1], x[b, ib, c + 2], x[b, ib, c + 3]
        y0, y1, y2, y3 = tile[c, o : o + n], tile[c + 1, o : o + n], tile[c + 2, o : o + n], tile[c + 3, o : o + n]
        for jj in range(n):
            u0, u1, u2, u3 = y0[jj], y1[jj], y2[jj], y3[jj]
            row_a[jj] = (((row_a[jj] + a0 * u0) + a1 * u1) + a2 * u2) + a3 * u3
            row_b[jj] = (((row_b[jj] + b0 * u0) + b1 * u1) + b2 * u2) + b3 * u3
        c += 4
    while c < d:
        ac, bc = x[b, ia, c], x[b, ib, c]
        y = tile[c, o : o + n]
        for jj in range(n):
            row_a[jj] += ac * y[jj]
            row_b[jj] += bc * y[jj]
        c += 1


@njit(cache=True, fastmath=False, error_model="numpy")
def _add_rows(w, n, y, b, j0, out):
    """``out += sum_jj w[jj] y[b, j0 + jj]`` for ``jj < n``, the terms added in ascending ``jj``.

    Four rows of ``y`` per pass over ``out`` (the same additions in the same
    order as one at a time); the inner loop over contiguous columns vectorises.
    """
    m = out.shape[0]
    jj = 0
    while jj + 4 <= n:
        w0, w1, w2, w3 = w[jj], w[jj + 1], w[jj + 2], w[jj + 3]
        j = j0 + jj
        y0, y1, y2, y3 = y[b, j], y[b, j + 1], y[b, j + 2], y[b, j + 3]
        for c in range(m):
            out[c] = (((out[c] + w0 * y0[c]) + w1 * y1[c]) + w2 * y2[c]) + w3 * y3[c]
        jj += 4
    while jj < n:
        wj = w[jj]
        yj = y[b, j0 + jj]
        for c in range(m):
            out[c] += wj * yj[c]
        jj += 1


@njit(cache=True, fastmath=False, error_model="numpy")
def _online_step(s, n, scale, v, b, j0, r, m, l, nan_seen, acc):
    """Take the ``n`` keys from ``j0`` into row ``r`` of a block: ``s`` holds their dot products (overwritten).

    Updates the running maximum ``m[r]``, sum ``l[r]`` and accumulator
    ``acc[r]``; flags ``nan_seen[r]`` for a NaN score.
    """
    neg_inf = m.dtype.type(-np.inf)
    m_tile = neg_inf
    for jj in range(n):
        x = s[jj] * scale  # l_ij = scale (q_i . k_j): the sum first, then the scale, as refimpl
        s[jj] = x
        if x > m_tile:
            m_tile = x
        elif x != x:
            nan_seen[r] = True
    m_old = m[r]
    m_new = max(m_old, m_tile)
    if m_new == neg_inf:
        return  # every score so far is -inf (overflowed): no weight yet, and the row is refused
    # online softmax: m' = max(m, max_j l_j), s' = s e^(m - m') + sum_j e^(l_j - m'), acc' = acc e^(m - m') + sum_j e^(l_j - m') v_j
    alpha = exp(m_old - m_new)
    for jj in range(n):
        s[jj] = exp(s[jj] - m_new)
    tile_sum = sum8(s, n)
    l[r] = l[r] * alpha + tile_sum
    row = acc[r]
    if alpha != 1:
        for c in range(row.shape[0]):
            row[c] *= alpha
    _add_rows(s, n, v, b, j0, row)
    m[r] = m_new


@njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _forward_kernel(q, kt, v, q_offsets, k_offsets, work, scale, causal, out, row_max, row_sum):
    """Core: the online-softmax forward of every (head, sequence), one block of query rows per item of ``work``; never raises.

    Parameters
    ----------
    q : ndarray, shape (H, T_q, d)
        Every head's query rows, sequence ``s`` at rows
        ``q_offsets[s] .. q_offsets[s + 1] - 1`` (an unpacked batch: ``H``
        sequences, ``q_offsets = [0, N_q]``).
    kt : ndarray, shape (H, T_k, d)
        The keys, transposed tile by tile (:func:`_tiles_transposed` at ``k_offsets``).
    v : ndarray, shape (H, T_k, d_v)
    q_offsets, k_offsets : ndarray of int64, shape (S + 1,)
        Where the query and the key rows of each sequence start.
    work : ndarray of int64, shape (n_work, 3)
        ``(head, sequence, block of ROWS query rows)``, one per ``prange`` iteration (:func:`_work`).
    scale : scalar of the inputs' dtype
    causal : bool
        Row ``i`` of a sequence takes its keys ``j <= i`` (``N_q == N_k``).
    out : ndarray, shape (H, T_q, d_v), any strides
        Written: ``softmax(scale q k^T) v`` of each sequence in its rows.
    row_max, row_sum : ndarray, shape (H, T_q)
        Written: the maximum score ``m_i`` of every row (NaN when a score
        is NaN, as :func:`numpy.max` gives) and ``s_i = sum_j exp(l_ij - m_i)``.
        A row whose maximum is not finite has a meaningless output: the
        caller refuses it.
    """
    d_v = v.shape[2]
    for t in prange(work.shape[0]):
        b, s, blk = work[t, 0], work[t, 1], work[t, 2]
        # rows counted from the sequence's first: query i is row cq + i of q, key j row ck + j of k and v
        cq, ck = q_offsets[s], k_offsets[s]
        N_k = k_offsets[s + 1] - ck
        i0 = blk * ROWS
        rows = min(ROWS, q_offsets[s + 1] - cq - i0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        acc = np.zeros((ROWS, d_v), dtype=q.dtype)
        m = np.full(ROWS, -np.inf, dtype=q.dtype)
        l = np.zeros(ROWS, dtype=q.dtype)
        nan_seen = np.zeros(ROWS, dtype=np.bool_)
        k_end = i0 + rows if causal else N_k
        for j0 in range(0, k_end, TILE):
            tile = _tile(kt, b, ck + j0, min(TILE, N_k - j0))
            # rows in pairs (ia, ib), sharing the loads of the key tile; the last of an odd count alone (ib = ia)
            for r in range(0, rows, 2):
                ia = i0 + r
                ib = min(ia + 1, i0 + rows - 1)
                n = min(TILE, k_end - j0, ib + 1 - j0) if causal else min(TILE, k_end - j0)
                if n <= 0:
                    continue
                _dots(q, tile, b, cq + ia, cq + ib, 0, n, s_a, s_b)
                n_a = min(n, ia + 1 - j0) if causal else n
                if n_a > 0:
                    _online_step(s_a, n_a, scale, v, b, ck + j0, r, m, l, nan_seen, acc)
                if ib > ia:
                    _online_step(s_b, n, scale, v, b, ck + j0, r + 1, m, l, nan_seen, acc)
        for r in range(rows):
            i = cq + i0 + r
            for c in range(d_v):
                out[b, i, c] = acc[r, c] / l[r]
            row_max[b, i] = np.nan if nan_seen[r] else m[r]
            row_sum[b, i] = l[r]


@njit(cache=True, fastmath=False, error_model="numpy")
def _dq_step(s, dp, n, scale, m_i, s_i, d_i, k, b, j0, out):
    """``out += scale sum_jj dl_jj k[b, j0 + jj]`` for one query row, from its scores' dot products ``s`` and ``dp`` (overwritten)."""
    for jj in range(n):
        p = exp(s[jj] * scale - m_i) / s_i  # P_ij = exp(l_ij - m_i) / s_i, the forward's scores bit for bit
        # dl_ij = scale P_ij (dP_ij - D_i)
        s[jj] = p * (dp[jj] - d_i) * scale
    _add_rows(s, n, k, b, j0, out)


@njit(cache=True, fastmath=False, error_model="numpy")
def _dkdv_step(s, dp, n, scale, lo, row_max, row_sum, delta, g, q, b, dv_row, dk_row):
    """``dv_row += sum_ii P_i g_i`` and ``dk_row += scale sum_ii dl_i q_i`` over query rows ``i = lo + ii`` for one key row."""
    for ii in range(n):
        i = lo + ii
        p = exp(s[ii] * scale - row_max[b, i]) / row_sum[b, i]
        s[ii] = p
        dp[ii] = p * (dp[ii] - delta[b, i]) * scale
    # dV = P^T G, dK = scale dl^T Q
    _add_rows(s, n, g, b, lo, dv_row)
    _add_rows(dp, n, q, b, lo, dk_row)


@njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _dq_kernel(q, k, g, kt, vt, delta, row_max, row_sum, q_offsets, k_offsets, work, scale, causal, dq):
    """Core: ``dQ`` of the online-softmax forward, the probabilities recomputed tile by tile; never raises.

    A thread per item of ``work`` (a block of query rows, as the forward),
    the keys in tiles, the rows in pairs.

    Parameters
    ----------
    q, k, g : ndarray, shapes (H, T_q, d), (H, T_k, d), (H, T_q, d_v)
        ``g`` is ``dL/d out``.
    kt, vt : ndarray, shapes of k and v
        The keys and values transposed tile by tile (:func:`_tiles_transposed` at ``k_offsets``).
    delta : ndarray, shape (H, T_q)
        ``D_i = sum_c G_ic O_ic``.
    row_max, row_sum : ndarray, shape (H, T_q)
        From the forward.
    q_offsets, k_offsets, work, scale, causal
        As the forward's (:func:`_forward_kernel`).
    dq : ndarray, shape of q
        Written (zeros on entry).
    """
    for t in prange(work.shape[0]):
        b, s, blk = work[t, 0], work[t, 1], work[t, 2]
        cq, ck = q_offsets[s], k_offsets[s]
        N_k = k_offsets[s + 1] - ck
        i0 = blk * ROWS
        rows = min(ROWS, q_offsets[s + 1] - cq - i0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        dp_a = np.empty(TILE, dtype=q.dtype)
        dp_b = np.empty(TILE, dtype=q.dtype)
        k_end = i0 + rows if causal else N_k
        for j0 in range(0, k_end, TILE):
            w = min(TILE, N_k - j0)
            k_tile, v_tile = _tile(kt, b, ck + j0, w), _tile(vt, b, ck + j0, w)
            for r in range(0, rows, 2):
                ia = i0 + r
                ib = min(ia + 1, i0 + rows - 1)
                n = min(TILE, k_end - j0, ib + 1 - j0) if causal else min(TILE, k_end - j0)
                if n <= 0:
                    continue
                qa, qb = cq + ia, cq + ib
                _dots(q, k_tile, b, qa, qb, 0, n, s_a, s_b)  # the forward's dot products, bit for bit
                _dots(g, v_tile, b, qa, qb, 0, n, dp_a, dp_b)  # dP_ij = G_i . v_j
                n_a = min(n, ia + 1 - j0) if causal else n
                if n_a > 0:
                    _dq_step(s_a, dp_a, n_a, scale, row_max[b, qa], row_sum[b, qa], delta[b, qa], k, b, ck + j0, dq[b, qa])
                if ib > ia:
                    _dq_step(s_b, dp_b, n, scale, row_max[b, qb], row_sum[b, qb], delta[b, qb], k, b, ck + j0, dq[b, qb])


@njit(parallel=True, cache=True, fastmath=False, error_model="numpy")
def _dkdv_kernel(q, k, v, g, qt, gt, delta, row_max, row_sum, q_offsets, k_offsets, work, scale, causal, dk, dv):
    """Core: ``dK`` and ``dV`` of the online-softmax forward; never raises.

    A thread per item of ``work`` (a block of key rows), the query rows in
    tiles, the key rows in pairs.  ``qt``, ``gt``: ``q`` and ``g`` transposed
    tile by tile (:func:`_tiles_transposed` at ``q_offsets``); ``dk``, ``dv``
    written (zeros on entry); the rest as :func:`_dq_kernel`'s.
    """
    for t in prange(work.shape[0]):
        b, s, blk = work[t, 0], work[t, 1], work[t, 2]
        cq, ck = q_offsets[s], k_offsets[s]
        N_q = q_offsets[s + 1] - cq
        j0 = blk * ROWS
        rows = min(ROWS, k_offsets[s + 1] - ck - j0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        dp_a = np.empty(TILE, dtype=q.dtype)
        dp_b = np.empty(TILE, dtype=q.dtype)
        # causal: key j is seen by the query rows i >= j
        for i0 in range((j0 // TILE) * TILE if causal else 0, N_q, TILE):
            i_end = min(i0 + TILE, N_q)
            q_tile, g_tile = _tile(qt, b, cq + i0, i_end - i0), _tile(gt, b, cq + i0, i_end - i0)
            for r in range(0, rows, 2):
                ja = j0 + r
                jb = min(ja + 1, j0 + rows - 1)
                lo = max(i0, ja) if causal else i0
                n = i_end - lo
                if n <= 0:
                    continue
                # the scores of rows ja and jb for the query rows lo..i_end (the same products, the same order)
                _dots(k, q_tile, b, ck + ja, ck + jb, lo - i0, n, s_a, s_b)
                _dots(v, g_tile, b, ck + ja, ck + jb, lo - i0, n, dp_a, dp_b)  # dP_ij = G_i . v_j
                _dkdv_step(s_a, dp_a, n, scale, cq + lo, row_max, row_sum, delta, g, q, b, dv[b, ck + ja], dk[b, ck + ja])
                if jb > ja:
                    # causal: row jb sees the query rows from max(i0, jb), one fewer when lo = ja
                    off = max(i0, jb) - lo if causal else 0
                    if n > off:
                        _dkdv_step(s_b[off:], dp_b[off:], n - off, scale, cq + lo + off, row_max, row_sum, delta, g, q, b,
                                   dv[b, ck + jb], dk[b, ck + jb])


@njit(cache=True, fastmath=False, error_model="numpy")
def _transpose_tiles(a, offsets, out):
    """``out``: the rows of ``a`` ``(H, T, w)``, each sequence's tiles of TILE rows (the last shorter) transposed, each
    where its rows were.

    One thread: a pass over memory, too short to gain from waking the others.
    """
    S = offsets.size - 1
    for p in range(a.shape[0] * S):
        b, s = p // S, p % S
        end = offsets[s + 1]
        for j0 in range(offsets[s], end, TILE):
            tile = _tile(out, b, j0, min(TILE, end - j0))
            for c in range(tile.shape[0]):
                for o in range(tile.shape[1]):
                    tile[c, o] = a[b, j0 + o, c]


def _tiles_transposed(a, offsets):
    """``(H, T, w)`` rows, the sequences at ``offsets``, with each sequence's tiles transposed: the same size, no padding.

    The tile of rows ``j0 .. j0 + n - 1`` (``n <= TILE``, tiles counted from
    each sequence's first row) is stored as its ``w x n`` transpose, one
    stretch of memory where the rows were (:func:`_tile` reads it back): a
    tile's scores are formed over contiguous memory, whatever the lengths.
    """
    out = np.empty(a.shape, dtype=a.dtype)
    _transpose_tiles(a, offsets, out)
    return out


@njit(cache=True, fastmath=False, error_model="numpy")
def _work(offsets, heads):
    """The items of the kernels' ``prange``: ``(head, sequence, block)`` for every block of :data:`ROWS` rows of every
    (head, sequence), int64 ``(n_work, 3)``; a sequence's blocks interleaved 0, n-1, 1, n-2, ... (equal work per share
    when causal), an empty sequence none."""
    S = offsets.size - 1
    total = 0
    for s in range(S):
        total += (offsets[s + 1] - offsets[s] + ROWS - 1) // ROWS
    work = np.empty((heads * total, 3), dtype=np.int64)
    t = 0
    for b in range(heads):
        for s in range(S):
            n = (offsets[s + 1] - offsets[s] + ROWS - 1) // ROWS
            for r in range(n):
                work[t, 0], work[t, 1], work[t, 2] = b, s, (r // 2 if r % 2 == 0 else n - 1 - r // 2)
                t += 1
    return work


def _whole(a):
    """The offsets ``[0, N]`` of an unpacked batch ``(BH, N, d)``: one sequence per head."""
    return np.array([0, a.shape[1]], dtype=np.int64)


def _sequences(a):
    """``(..., N, d)`` as a C-contiguous ``(BH, N, d)`` array (no copy when it already is one)."""
    return np.ascontiguousarray(a.reshape((-1,) + a.shape[-2:]))


def _forward(q, k, v, scale, causal, q_offsets, k_offsets, out):
    """Core: ``out`` ``(H, T_q, d_v)`` written, ``(row_max, row_sum)`` returned, of checked heads-first rows; never raises."""
    row_max = np.empty(q.shape[:2], dtype=q.dtype)
    row_sum = np.empty(q.shape[:2], dtype=q.dtype)
    work = _work(q_offsets, q.shape[0])
    if work.size:
        _forward_kernel(q, _tiles_transposed(k, k_offsets), v, q_offsets, k_offsets, work, q.dtype.type(scale), causal, out, row_max, row_sum)
    return row_max, row_sum


def _backward(g, out, q, k, v, row_max, row_sum, scale, causal, q_offsets, k_offsets):
    """Core: ``(dq, dk, dv)`` of checked heads-first rows (``out`` any strides); the two passes each with the tiles
    it reads, two arrays at a time; never raises."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    H, scale = q.shape[0], q.dtype.type(scale)
    # D_i = sum_c G_ic O_ic (= sum_j P_ij dP_ij)
    delta = np.einsum("bic,bic->bi", g, out)
    work = _work(q_offsets, H)
    if work.size:
        kt, vt = _tiles_transposed(k, k_offsets), _tiles_transposed(v, k_offsets)
        _dq_kernel(q, k, g, kt, vt, delta, row_max, row_sum, q_offsets, k_offsets, work, scale, causal, dq)
        del kt, vt
        work = _work(k_offsets, H)
        qt, gt = _tiles_transposed(q, q_offsets), _tiles_transposed(g, q_offsets)
        _dkdv_kernel(q, k, v, g, qt, gt, delta, row_max, row_sum, q_offsets, k_offsets, work, scale, causal, dk, dv)
    return dq, dk, dv


def _softmax_attention_forward_kernel(xp, checked, given):
    """Core of :func:`softmax_attention_forward` on the reference's checked arguments: the online softmax, overflowed rows
    refused."""
    q, k, v, scale, causal, batch_shape = checked
    q, k, v = _sequences(q), _sequences(k), _sequences(v)
    out = np.empty(q.shape[:2] + v.shape[2:], dtype=q.dtype)
    row_max, row_sum = _forward(q, k, v, scale, causal, _whole(q), _whole(k), out)
    validation.check_score_maxima(row_max)
    cache = OnlineSoftmaxCache(q, k, v, out, row_max, row_sum, scale, causal, batch_shape)
    return out.reshape(batch_shape + out.shape[1:]), cache


def _packed_softmax_forward_kernel(xp, checked, given, offsets):
    """Softmax attention of packed sequences (checked, heads first): every (head, sequence) in one call of the forward
    kernel, the rows left packed; ``NotImplemented`` (the loop) where a score overflows."""
    q, k, v, scale, causal, leading = checked
    H, (T, d_v) = int(np.prod(leading)), v.shape[-2:]
    q, k, v = (np.ascontiguousarray(x).reshape(H, T, x.shape[-1]) for x in (q, k, v))
    out = np.empty((T,) + tuple(leading) + (d_v,), dtype=q.dtype)
    row_max, row_sum = _forward(q, k, v, scale, causal, offsets, offsets, out.reshape(T, H, d_v).transpose(1, 0, 2))
    try:
        validation.check_score_maxima(row_max)
    except ValueError:
        return NotImplemented  # the loop refuses it, naming the sequence's row as it always has
    return out, SoftmaxPackedCache(offsets, q, k, v, out, row_max, row_sum, scale, causal, tuple(leading))


def _packed_softmax_backward(grad_out, cache):
    """The backward of :func:`_packed_softmax_forward_kernel`: every (head, sequence) in one call of each pass."""
    H, T, _ = cache.q.shape
    g = cpu_scan.packed_grad_out(grad_out, cache.out.shape, cache.out.dtype).reshape(H, T, -1)
    out = cache.out.reshape(T, H, -1).transpose(1, 0, 2)
    c = cache
    grads = _backward(g, out, c.q, c.k, c.v, c.row_max, c.row_sum, c.scale, c.causal, c.offsets, c.offsets)
    return SoftmaxAttentionGrads(*(cpu_scan.packed_layout(x, cache.leading) for x in grads))


def _softmax_attention_backward_kernel(xp, grad_out, cache) -> SoftmaxAttentionGrads:
    """Core of :func:`softmax_attention_backward`: the probabilities recomputed tile by tile; new arrays."""
    if isinstance(cache, SoftmaxPackedCache):
        return _packed_softmax_backward(grad_out, cache)
    validation.check_instance(cache, "cache", OnlineSoftmaxCache, "the OnlineSoftmaxCache from cpu.attention.softmax_attention_forward")
    q, k, v, out, row_max, row_sum, scale, causal, batch_shape = cache
    labels = ("...", "N_q", "d_v") if batch_shape else ("N_q", "d_v")
    g = validation.check_grad_out(grad_out, batch_shape + out.shape[1:], labels, out.dtype)
    dq, dk, dv = _backward(_sequences(g), out, q, k, v, row_max, row_sum, scale, causal, _whole(q), _whole(k))
    return SoftmaxAttentionGrads(
        q=dq.reshape(batch_shape + dq.shape[1:]),
        k=dk.reshape(batch_shape + dk.shape[1:]),
        v=dv.reshape(batch_shape + dv.shape[1:]),
    )


class LinearPackedCache(NamedTuple):
    """What :func:`linear_attention_backward` needs of a packed forward computed in one call (every sequence's rows)."""

    offsets: np.ndarray  # cu_seqlens, int64 (S + 1,)
    q: np.ndarray  # (H T, d): the heads' rows one after another (H = 1 without heads)
    k: np.ndarray
    v: np.ndarray  # (H T, d_v)
    phi_q: np.ndarray  # (H T, d): the features elu + 1
    phi_k: np.ndarray
    out: np.ndarray  # (H T, d_v)
    den: np.ndarray  # (H T,)
    causal: bool
    leading: tuple  # () without heads, (H,) with
    out_shape: tuple  # (T, d_v) or (T, H, d_v): the shape of grad_out


def _packed_linear_forward_kernel(xp, checked, given, offsets):
    """Linear attention of packed sequences (checked, heads first): one :func:`cpu.scan.packed_forward` call over every
    (head, sequence); ``NotImplemented`` (the loop) where the longest sequence is long enough for chunks and products."""
    q, k, v, causal, eps, chunk_size, leading = checked
    (T, d), dv = q.shape[-2:], v.shape[-1]
    if np.diff(offsets).max(initial=0) * d * (dv + 1) > cpu_scan.CHUNK_WORK:
        return NotImplemented
    H = int(np.prod(leading))
    rows = lambda x: np.ascontiguousarray(x).reshape(H * T, x.shape[-1])  # noqa: E731
    q, k, v = rows(q), rows(k), rows(v)
    phi_q, phi_k = ref_attention._elu_feature_map(q), ref_attention._elu_feature_map(k)
    out, den = cpu_scan.packed_forward(phi_q, phi_k, v, causal, eps, cpu_scan.head_offsets(offsets, H, T))
    try:
        validation.check_denominators(den, eps, ("q", "k"))
    except ValueError:
        return NotImplemented  # the loop refuses it, naming the sequence's row as it always has
    packed = cpu_scan.packed_layout(out, leading)
    return packed, LinearPackedCache(offsets, q, k, v, phi_q, phi_k, out, den, causal, leading, packed.shape)


def _output_of(packed_forward):
    """The packed kernel of the function without a cache: ``packed_forward``'s output, or its ``NotImplemented``."""

    def kernel(xp, checked, given, offsets):
        result = packed_forward(xp, checked, given, offsets)
        return result if result is NotImplemented else result[0]

    return kernel


def _linear_attention_backward_kernel(xp, grad_out, cache):
    """Core of :func:`linear_attention_backward`: a packed cache's in one :func:`cpu.scan.packed_backward` call, any
    other by the reference's batch rule around :mod:`cpu.scan`."""
    if not isinstance(cache, LinearPackedCache):
        return ref_attention.linear_backward_with(cpu_scan.scan_backward, grad_out, cache)
    g = cpu_scan.packed_grad_out(grad_out, cache.out_shape, cache.out.dtype)
    offsets = cpu_scan.head_offsets(cache.offsets, int(np.prod(cache.leading)), cache.out_shape[0])
    d = cpu_scan.packed_backward(g, cache.phi_q, cache.phi_k, cache.v, cache.out, cache.den, cache.causal, offsets)
    # chain rule through the elementwise feature map
    dq = d.phi_q * ref_attention._elu_feature_map_derivative(cache.q)
    dk = d.phi_k * ref_attention._elu_feature_map_derivative(cache.k)
    return LinearAttentionGrads(*(cpu_scan.packed_layout(x, cache.leading) for x in (dq, dk, d.v)))


_SOFTMAX_NOTES = (
    "An online softmax (module docstring): the keys are taken tile by tile with a running maximum and sum, so no "
    "``N_q x N_k`` matrix is formed, in the forward or in the backward, which recomputes the probabilities from the "
    "per-row maximum and sum.  The cache, an :class:`OnlineSoftmaxCache`, holds the inputs, the output and those two "
    "numbers per row: memory ``O(N (d + d_v))`` per sequence.  A packed call (``cu_seqlens``) computes every (head, "
    "sequence) in one call of each kernel, the tokens left packed (its cache a :class:`SoftmaxPackedCache`)."
)
_LINEAR_NOTES = "The reference's computation, with the causal scan and its two sweeps of :mod:`cpu.scan`."

#: The public functions that refimpl's boundary writes once, bound to this module's kernels.
_public = boundary.bind(
    backend(
        {
            "softmax_attention": lambda xp, checked, given: _softmax_attention_forward_kernel(xp, checked, given)[0],
            "softmax_attention_forward": _softmax_attention_forward_kernel,
            "softmax_attention_backward": _softmax_attention_backward_kernel,
            "packed softmax_attention": _output_of(_packed_softmax_forward_kernel),
            "packed softmax_attention_forward": _packed_softmax_forward_kernel,
            **boundary.linear_attention_kernels(cpu_scan.scan_forward, cpu_scan.scan_backward),
            "linear_attention_backward": _linear_attention_backward_kernel,
            "packed linear_attention": _output_of(_packed_linear_forward_kernel),
            "packed linear_attention_forward": _packed_linear_forward_kernel,
        },
        replace={"SoftmaxAttentionCache": "OnlineSoftmaxCache"},
        notes={
            "softmax_attention": _SOFTMAX_NOTES,
            "softmax_attention_forward": _SOFTMAX_NOTES,
            "softmax_attention_backward": _SOFTMAX_NOTES,
            "linear_attention": _LINEAR_NOTES,
            "linear_attention_forward": _LINEAR_NOTES,
            "linear_attention_backward": _LINEAR_NOTES,
        },
    ),
    module=__name__,
)
softmax_attention = _public.softmax_attention
softmax_attention_forward = _public.softmax_attention_forward
softmax_attention_backward = _public.softmax_attention_backward
linear_attention = _public.linear_attention
linear_attention_forward = _public.linear_attention_forward
linear_attention_backward = _public.linear_attention_backward
