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
The leading (batch, head) dimensions are flattened to ``BH`` sequences.

* Forward, and ``dQ``: ``prange`` over (sequence, block of :data:`ROWS`
  query rows); each thread owns its rows, and takes the keys in tiles of
  :data:`TILE`.  ``dK`` and ``dV`` sum over query rows: a second ``prange``
  over (sequence, block of :data:`ROWS` key rows), each thread owning its
  key rows and taking all query rows in tiles.  No two threads write one
  entry and every sum has a fixed order: the results are the same bits
  whatever the number of threads.
* A tile of scores is formed with the coordinates outside and the keys
  inside, from the keys stored transposed tile by tile (a ``d x TILE``
  block contiguous per tile): the inner loop runs
  over contiguous memory with independent lanes and vectorises without
  reordering any sum.  Every score is summed over the coordinates in
  ascending order in all three passes, so the backward recomputes the
  forward's scores bit for bit.
* Causal: a row takes the keys ``j <= i`` only; the tiles past the diagonal
  are not visited.  The blocks are interleaved (light, heavy, light, ...)
  so that the threads' contiguous shares of the ``prange`` carry equal work.
* float32 inputs are computed in float32 (every constant is cast to the
  input's dtype).

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


@njit(cache=True, fastmath=False, error_model="numpy")
def _dots(x, yt, b, ia, ib, j0, n, row_a, row_b):
    """Two rows of a tile of dot products, ``row_a[jj] = sum_c x[b, ia, c] y[b, j0 + jj, c]`` and ``row_b`` for ``ib``.

    ``yt`` is ``y`` transposed tile by tile (:func:`_tiles_transposed`),
    and ``j0 .. j0 + n - 1`` lie in one tile.  For ``jj < n``, each sum over
    ``c`` in ascending order.  ``ia == ib``
    is allowed (``row_b`` is then a copy).  The rows share every load of
    ``yt``, and four coordinates are added per pass over the rows (the same
    additions in the same order as one at a time); the inner loop runs over
    contiguous ``jj`` with independent lanes, so it vectorises exactly.
    """
    d = x.shape[2]
    t = j0 // TILE
    o = j0 - t * TILE
    for jj in range(n):
        row_a[jj] = 0
        row_b[jj] = 0
    c = 0
    while c + 4 <= d:
        a0, a1, a2, a3 = x[b, ia, c], x[b, ia, c + 1], x[b, ia, c + 2], x[b, ia, c + 3]
        b0, b1, b2, b3 = x[b, ib, c], x[b, ib, c + 1], x[b, ib, c + 2], x[b, ib, c + 3]
        y0, y1, y2, y3 = yt[b, t, c, o : o + n], yt[b, t, c + 1, o : o + n], yt[b, t, c + 2, o : o + n], yt[b, t, c + 3, o : o + n]
        for jj in range(n):
            u0, u1, u2, u3 = y0[jj], y1[jj], y2[jj], y3[jj]
            row_a[jj] = (((row_a[jj] + a0 * u0) + a1 * u1) + a2 * u2) + a3 * u3
            row_b[jj] = (((row_b[jj] + b0 * u0) + b1 * u1) + b2 * u2) + b3 * u3
        c += 4
    while c < d:
        ac, bc = x[b, ia, c], x[b, ib, c]
        y = yt[b, t, c, o : o + n]
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
def _block(t, n_blocks):
    """Sequence and block of ``prange`` item ``t``: blocks interleaved 0, n-1, 1, n-2, ... (equal work per share when causal)."""
    b = t // n_blocks
    r = t % n_blocks
    blk = r // 2 if r % 2 == 0 else n_blocks - 1 - r // 2
    return b, blk


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
def _forward_kernel(q, kt, v, scale, causal, out, row_max, row_sum):
    """Core: the online-softmax forward of ``BH`` sequences; never raises.

    Parameters
    ----------
    q : ndarray, shape (BH, N_q, d)
    kt : ndarray, shape (BH, ceil(N_k / TILE), d, TILE)
        The keys, transposed tile by tile (:func:`_tiles_transposed`).
    v : ndarray, shape (BH, N_k, d_v)
    scale : scalar of the inputs' dtype
    causal : bool
        Row ``i`` takes the keys ``j <= i`` (``N_q == N_k``).
    out : ndarray, shape (BH, N_q, d_v)
        Written: ``softmax(scale q k^T) v``.
    row_max, row_sum : ndarray, shape (BH, N_q)
        Written: the maximum score ``m_i`` of every row (NaN when a score
        is NaN, as :func:`numpy.max` gives) and ``s_i = sum_j exp(l_ij - m_i)``.
        A row whose maximum is not finite has a meaningless output: the
        caller refuses it.
    """
    BH, N_q, d = q.shape
    N_k = v.shape[1]
    d_v = v.shape[2]
    n_blocks = (N_q + ROWS - 1) // ROWS
    for t in prange(BH * n_blocks):
        b, blk = _block(t, n_blocks)
        i0 = blk * ROWS
        rows = min(ROWS, N_q - i0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        acc = np.zeros((ROWS, d_v), dtype=q.dtype)
        m = np.full(ROWS, -np.inf, dtype=q.dtype)
        l = np.zeros(ROWS, dtype=q.dtype)
        nan_seen = np.zeros(ROWS, dtype=np.bool_)
        k_end = i0 + rows if causal else N_k
        for j0 in range(0, k_end, TILE):
            # rows in pairs (ia, ib), sharing the loads of the key tile; the last of an odd count alone (ib = ia)
            for r in range(0, rows, 2):
                ia = i0 + r
                ib = min(ia + 1, i0 + rows - 1)
                n = min(TILE, k_end - j0, ib + 1 - j0) if causal else min(TILE, k_end - j0)
                if n <= 0:
                    continue
                _dots(q, kt, b, ia, ib, j0, n, s_a, s_b)
                n_a = min(n, ia + 1 - j0) if causal else n
                if n_a > 0:
                    _online_step(s_a, n_a, scale, v, b, j0, r, m, l, nan_seen, acc)
                if ib > ia:
                    _online_step(s_b, n, scale, v, b, j0, r + 1, m, l, nan_seen, acc)
        for r in range(rows):
            i = i0 + r
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
def _backward_kernel(q, k, v, g, qt, kt, vt, gt, delta, row_max, row_sum, scale, causal, dq, dk, dv):
    """Core: the gradients of the online-softmax forward, the probabilities recomputed tile by tile; never raises.

    Parameters
    ----------
    q, qt : ndarray, shape (BH, N_q, d) and transposed tile by tile (:func:`_tiles_transposed`)
    k, kt : ndarray, shape (BH, N_k, d) and transposed tile by tile
    v, vt : ndarray, shape (BH, N_k, d_v) and transposed tile by tile
    g, gt : ndarray, shape (BH, N_q, d_v) and transposed tile by tile
        ``dL/d out``.
    delta : ndarray, shape (BH, N_q)
        ``D_i = sum_c G_ic O_ic``.
    row_max, row_sum : ndarray, shape (BH, N_q)
        From the forward.
    scale : scalar of the inputs' dtype
    causal : bool
    dq, dk, dv : ndarray, shapes of q, k, v
        Written (zeros on entry).
    """
    BH, N_q, d = q.shape
    N_k = k.shape[1]
    # dQ: a thread per block of query rows, the keys in tiles, the rows in pairs (as the forward)
    n_blocks = (N_q + ROWS - 1) // ROWS
    for t in prange(BH * n_blocks):
        b, blk = _block(t, n_blocks)
        i0 = blk * ROWS
        rows = min(ROWS, N_q - i0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        dp_a = np.empty(TILE, dtype=q.dtype)
        dp_b = np.empty(TILE, dtype=q.dtype)
        k_end = i0 + rows if causal else N_k
        for j0 in range(0, k_end, TILE):
            for r in range(0, rows, 2):
                ia = i0 + r
                ib = min(ia + 1, i0 + rows - 1)
                n = min(TILE, k_end - j0, ib + 1 - j0) if causal else min(TILE, k_end - j0)
                if n <= 0:
                    continue
                _dots(q, kt, b, ia, ib, j0, n, s_a, s_b)  # the forward's dot products, bit for bit
                _dots(g, vt, b, ia, ib, j0, n, dp_a, dp_b)  # dP_ij = G_i . v_j
                n_a = min(n, ia + 1 - j0) if causal else n
                if n_a > 0:
                    _dq_step(s_a, dp_a, n_a, scale, row_max[b, ia], row_sum[b, ia], delta[b, ia], k, b, j0, dq[b, ia])
                if ib > ia:
                    _dq_step(s_b, dp_b, n, scale, row_max[b, ib], row_sum[b, ib], delta[b, ib], k, b, j0, dq[b, ib])
    # dK, dV: a thread per block of key rows, the query rows in tiles, the key rows in pairs
    n_blocks = (N_k + ROWS - 1) // ROWS
    for t in prange(BH * n_blocks):
        b, blk = _block(t, n_blocks)
        j0 = blk * ROWS
        rows = min(ROWS, N_k - j0)
        s_a = np.empty(TILE, dtype=q.dtype)
        s_b = np.empty(TILE, dtype=q.dtype)
        dp_a = np.empty(TILE, dtype=q.dtype)
        dp_b = np.empty(TILE, dtype=q.dtype)
        # causal: key j is seen by the query rows i >= j
        for i0 in range((j0 // TILE) * TILE if causal else 0, N_q, TILE):
            i_end = min(i0 + TILE, N_q)
            for r in range(0, rows, 2):
                ja = j0 + r
                jb = min(ja + 1, j0 + rows - 1)
                lo = max(i0, ja) if causal else i0
                n = i_end - lo
                if n <= 0:
                    continue
                # the scores of rows ja and jb for the query rows lo..i_end (the same products, the same order)
                _dots(k, qt, b, ja, jb, lo, n, s_a, s_b)
                _dots(v, gt, b, ja, jb, lo, n, dp_a, dp_b)  # dP_ij = G_i . v_j
                _dkdv_step(s_a, dp_a, n, scale, lo, row_max, row_sum, delta, g, q, b, dv[b, ja], dk[b, ja])
                if jb > ja:
                    # causal: row jb sees the query rows from max(i0, jb), one fewer when lo = ja
                    off = max(i0, jb) - lo if causal else 0
                    if n > off:
                        _dkdv_step(s_b[off:], dp_b[off:], n - off, scale, lo + off, row_max, row_sum, delta, g, q, b, dv[b, jb], dk[b, jb])


def _sequences(a):
    """``(..., N, d)`` as a C-contiguous ``(BH, N, d)`` array (no copy when it already is one)."""
    return np.ascontiguousarray(a.reshape((-1,) + a.shape[-2:]))


def _tiles_transposed(a):
    """``(BH, N, d)`` as ``(BH, ceil(N / TILE), d, TILE)``: each tile of rows transposed, zero-padded, and contiguous.

    A tile's ``d x TILE`` block is one stretch of memory, whatever ``N`` is
    (a plain ``(d, N)`` transpose puts each of its ``d`` rows ``N`` entries apart).
    """
    BH, N, d = a.shape
    n_tiles = -(-N // TILE)
    padded = np.zeros((BH, n_tiles * TILE, d), dtype=a.dtype)
    padded[:, :N] = a
    return np.ascontiguousarray(padded.reshape(BH, n_tiles, TILE, d).transpose(0, 1, 3, 2))


def _forward(q, k, v, scale, causal):
    """Core: ``(out, row_max, row_sum)`` of checked ``(BH, N, d)`` arrays; never raises."""
    BH, N_q, _ = q.shape
    dtype = q.dtype
    out = np.empty((BH, N_q, v.shape[2]), dtype=dtype)
    row_max = np.empty((BH, N_q), dtype=dtype)
    row_sum = np.empty((BH, N_q), dtype=dtype)
    if BH:
        _forward_kernel(q, _tiles_transposed(k), v, dtype.type(scale), causal, out, row_max, row_sum)
    return out, row_max, row_sum


def _softmax_attention_forward_kernel(xp, checked, given):
    """Core of :func:`softmax_attention_forward` on the reference's checked arguments: the online softmax, overflowed rows
    refused."""
    q, k, v, scale, causal, batch_shape = checked
    q, k, v = _sequences(q), _sequences(k), _sequences(v)
    out, row_max, row_sum = _forward(q, k, v, scale, causal)
    validation.check_score_maxima(row_max)
    cache = OnlineSoftmaxCache(q, k, v, out, row_max, row_sum, scale, causal, batch_shape)
    return out.reshape(batch_shape + out.shape[1:]), cache


def _softmax_attention_backward_kernel(xp, grad_out, cache) -> SoftmaxAttentionGrads:
    """Core of :func:`softmax_attention_backward`: the probabilities recomputed tile by tile; new arrays."""
    validation.check_instance(cache, "cache", OnlineSoftmaxCache, "the OnlineSoftmaxCache from cpu.attention.softmax_attention_forward")
    q, k, v, out, row_max, row_sum, scale, causal, batch_shape = cache
    labels = ("...", "N_q", "d_v") if batch_shape else ("N_q", "d_v")
    g = validation.check_grad_out(grad_out, batch_shape + out.shape[1:], labels, out.dtype)
    g = _sequences(g)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    if q.shape[0]:
        # D_i = sum_c G_ic O_ic (= sum_j P_ij dP_ij)
        delta = np.einsum("bic,bic->bi", g, out)
        _backward_kernel(q, k, v, g, *(_tiles_transposed(a) for a in (q, k, v, g)), delta, row_max, row_sum, q.dtype.type(scale), causal, dq, dk, dv)
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


def _packed_linear_attention_kernel(xp, checked, given, offsets):
    result = _packed_linear_forward_kernel(xp, checked, given, offsets)
    return result if result is NotImplemented else result[0]


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
    "numbers per row: memory ``O(N (d + d_v))`` per sequence."
)
_LINEAR_NOTES = "The reference's computation, with the causal scan and its two sweeps of :mod:`cpu.scan`."

#: The public functions that refimpl's boundary writes once, bound to this module's kernels.
_public = boundary.bind(
    backend(
        {
            "softmax_attention": lambda xp, checked, given: _softmax_attention_forward_kernel(xp, checked, given)[0],
            "softmax_attention_forward": _softmax_attention_forward_kernel,
            "softmax_attention_backward": _softmax_attention_backward_kernel,
            **boundary.linear_attention_kernels(cpu_scan.scan_forward, cpu_scan.scan_backward),
            "linear_attention_backward": _linear_attention_backward_kernel,
            "packed linear_attention": _packed_linear_attention_kernel,
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
