r"""Softmax attention on the GPU, the dense baseline: :func:`refimpl.attention.softmax_attention`.

What it computes
----------------
``out = softmax(scale q k^T) v`` row by row (keys ``j > i`` masked when
causal), for one sequence ``(N, d)`` or a batch ``(..., N, d)``, without ever
forming the ``N_q x N_k`` score matrix: a tiled online softmax in the manner
of FlashAttention (Dao et al. 2022).

Why the running rescaling gives the exact softmax
-------------------------------------------------
Fix a query row with scores :math:`s_j` and split its keys into tiles
:math:`T_1, T_2, \dots`.  After the tiles :math:`T_1..T_t` (keys :math:`S_t`)
the block holds

.. math::

    m_t = \max_{j\in S_t} s_j,\qquad
    \ell_t = \sum_{j\in S_t} e^{s_j - m_t},\qquad
    a_t = \sum_{j\in S_t} e^{s_j - m_t}\, v_j .

The next tile gives :math:`m_{t+1} = \max(m_t, \max_{j\in T_{t+1}} s_j)` and,
because :math:`e^{s_j - m_t}\,e^{m_t - m_{t+1}} = e^{s_j - m_{t+1}}`,

.. math::

    \ell_{t+1} = e^{m_t - m_{t+1}}\,\ell_t + \sum_{j\in T_{t+1}} e^{s_j - m_{t+1}},\qquad
    a_{t+1} = e^{m_t - m_{t+1}}\,a_t + \sum_{j\in T_{t+1}} e^{s_j - m_{t+1}}\, v_j ,

which are the same three quantities for :math:`S_{t+1}` (by induction, from
:math:`m_0 = -\infty`, :math:`\ell_0 = 0`, :math:`a_0 = 0`).  After the last
tile, :math:`m` is the row maximum and

.. math::

    \frac{a}{\ell} = \frac{\sum_j e^{s_j - m} v_j}{\sum_j e^{s_j - m}}
                   = \sum_j \frac{e^{s_j}}{\sum_l e^{s_l}}\, v_j ,

the softmax-weighted sum exactly (the common factor :math:`e^{-m}`
cancels).  Every exponent is :math:`\le 0`, so nothing overflows, and the
row's largest term is :math:`e^0 = 1`, so :math:`\ell \ge 1`: the same
safeguards as the per-row maximum subtracted in :mod:`refimpl.numerics`.
Only rounding differs from the reference: the order of the sums and the
factors :math:`e^{m_t - m_{t+1}}`.

Launch plan
-----------
One kernel, :func:`_flash_forward`.  Grid ``(BH, ceil(N_q / TILE), ceil(d_v / COLS))``:
a block per (sequence, tile of :data:`TILE` query rows, group of
:data:`COLS` value columns), all sequences (batch and head dimensions
flattened) in one launch; blocks of ``TILE x TILE`` threads, thread
``(ty, tx)`` = (query row of the tile, key of the tile / value column).  For
each key tile, ``q`` and ``k`` are staged in shared memory
``DTILE`` coordinates at a time (any ``d``); thread ``(ty, tx)`` forms score
``(ty, tx)``; the row's maximum and sum are updated as above (every thread
of a row computes them, in the same order, from the shared scores); the
value tile ``[TILE, COLS]`` is staged in shared memory and each thread
updates its ``COLS / TILE`` accumulators.  Causal: key tiles above the
diagonal are skipped, the diagonal tile is masked (``j > i`` gets
``-inf``).  The kernel also writes every row's maximum score, which the host
checks for overflow as the reference does.  ``d_v`` of any size is covered by
the grid's third axis.
"""

from __future__ import annotations

import math

import numpy as np
from numba import boolean, cuda

from refimpl.validation import check_batched_softmax_attention, check_score_maxima

from ._device import Checks, any_device, host_view, is_device_array, kernel, raise_bad_inputs, result, to_device

__all__ = ["softmax_attention"]

#: Query rows per block, and keys per key tile (the same: thread (ty, tx) stages row ty of both tiles).
TILE = 8
#: Coordinates of ``q`` and ``k`` staged per step of the score loop (= TILE: thread tx stages coordinate tx).
DTILE = TILE
#: Value columns per block (a multiple of TILE): each thread accumulates COLS / TILE of them.
COLS = 32
_GROUPS = COLS // TILE


# scores = q @ k.T; scores *= scale; scores[triu(k=1)] = -inf when causal; p = softmax(scores, axis=1); out = p @ v
# (refimpl.attention.softmax_attention_forward), by the online softmax of the module docstring.
# Block (b, query tile qt, column group cg) of TILE x TILE threads; thread (ty, tx): query row i = qt TILE + ty.
# Shared: q_s [TILE, DTILE] and k_s [TILE, DTILE] (one step of the d loop), p_s [TILE, TILE] (scores, then weights),
# v_s [TILE, COLS] (the value tile).  Registers: the row's (m, l) and acc[COLS / TILE] for columns c0 + tx + TILE g.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f, boolean, f[:, :, ::1], f[:, ::1]))
def _flash_forward(q, k, v, scale, causal, out, row_max):
    f = q.dtype.type
    q_s = cuda.shared.array((TILE, DTILE), dtype=q.dtype)  # [TILE, DTILE]
    k_s = cuda.shared.array((TILE, DTILE), dtype=q.dtype)  # [TILE, DTILE]
    p_s = cuda.shared.array((TILE, TILE), dtype=q.dtype)  # [TILE, TILE]
    v_s = cuda.shared.array((TILE, COLS), dtype=q.dtype)  # [TILE, COLS]
    acc = cuda.local.array(_GROUPS, dtype=q.dtype)  # [COLS / TILE]
    N_q = q.shape[1]
    N_k = k.shape[1]
    d = q.shape[2]
    d_v = v.shape[2]
    b = cuda.blockIdx.x
    q0 = cuda.blockIdx.y * TILE
    c0 = cuda.blockIdx.z * COLS
    ty = cuda.threadIdx.y
    tx = cuda.threadIdx.x
    i = q0 + ty
    zero = f(0.0)
    neg_inf = f(-math.inf)
    m_run = neg_inf
    l_run = zero
    nan_seen = False
    for g in range(_GROUPS):
        acc[g] = zero
    # causal: query rows < q0 + TILE see keys < q0 + TILE only (N_q == N_k)
    k_end = min(N_k, q0 + TILE) if causal else N_k
    for k0 in range(0, k_end, TILE):
        # s_ij = scale * sum_j q_i . k_j, DTILE coordinates at a time (coalesced along d)
        s = zero
        for d0 in range(0, d, DTILE):
            if i < N_q and d0 + tx < d:
                q_s[ty, tx] = q[b, i, d0 + tx]
            else:
                q_s[ty, tx] = zero
            if k0 + ty < N_k and d0 + tx < d:
                k_s[ty, tx] = k[b, k0 + ty, d0 + tx]
            else:
                k_s[ty, tx] = zero
            cuda.syncthreads()
            for jj in range(DTILE):
                s += q_s[ty, jj] * k_s[tx, jj]
            cuda.syncthreads()
        s *= scale
        j = k0 + tx
        if j >= N_k or (causal and j > i) or i >= N_q:
            s = neg_inf
        p_s[ty, tx] = s
        # the value tile [TILE, COLS], coalesced along the columns
        for g in range(_GROUPS):
            c = c0 + tx + TILE * g
            if k0 + ty < N_k and c < d_v:
                v_s[ty, tx + TILE * g] = v[b, k0 + ty, c]
            else:
                v_s[ty, tx + TILE * g] = zero
        cuda.syncthreads()
        # m_new = max(m_old, max_j s_ij), the same on every thread of the row (same reads, same order)
        m_new = m_run
        for jj in range(TILE):
            sj = p_s[ty, jj]
            if sj > m_new:
                m_new = sj
            elif sj != sj:
                nan_seen = True
        finite = m_new > neg_inf and m_new < -neg_inf
        cuda.syncthreads()
        if finite:
            # the weight exp(s_ij - m_new) of this thread's key (exp(-inf) = 0 for a masked one)
            p_s[ty, tx] = math.exp(s - m_new)
        cuda.syncthreads()
        if finite:
            # l = exp(m_old - m_new) l + sum_j p_ij; acc = exp(m_old - m_new) acc + sum_j p_ij v_j
            factor = math.exp(m_run - m_new)
            l_tile = zero
            for jj in range(TILE):
                l_tile += p_s[ty, jj]
            l_run = l_run * factor + l_tile
            for g in range(_GROUPS):
                a = zero
                for jj in range(TILE):
                    a += p_s[ty, jj] * v_s[jj, tx + TILE * g]
                acc[g] = acc[g] * factor + a
        m_run = m_new
        cuda.syncthreads()
    if i < N_q:
        for g in range(_GROUPS):
            c = c0 + tx + TILE * g
            if c < d_v:
                out[b, i, c] = acc[g] / l_run
        if tx == 0 and cuda.blockIdx.z == 0:
            # the row maximum of the scores, NaN when one score is NaN (as np.max gives)
            if nan_seen:
                row_max[b, i] = f(math.nan)
            else:
                row_max[b, i] = m_run


def attention_device(q, k, v, scale, causal):
    """Core: softmax attention of ``BH`` sequences on the device; no validation, no raise.

    Parameters
    ----------
    q : device array, shape (BH, N_q, d)
    k : device array, shape (BH, N_k, d)
    v : device array, shape (BH, N_k, d_v)
        C-contiguous, one float dtype.
    scale : float
        Multiplies the scores.
    causal : bool
        Query ``i`` attends to keys ``j <= i`` (``N_q == N_k``).

    Returns
    -------
    out : device array, shape (BH, N_q, d_v)
    row_max : device array, shape (BH, N_q)
        The maximum score of every row (over the keys it attends to); not
        finite for a row whose scores overflowed: the caller checks it
        (:func:`refimpl.validation.check_score_maxima`).
    """
    BH, N_q, _ = q.shape
    d_v = v.shape[2]
    dtype = q.dtype
    out = cuda.device_array((BH, N_q, d_v), dtype=dtype)
    row_max = cuda.device_array((BH, N_q), dtype=dtype)
    if BH * N_q == 0:
        return out, row_max
    grid = (BH, -(-N_q // TILE), max(1, -(-d_v // COLS)))
    _flash_forward[grid, (TILE, TILE)](q, k, v, dtype.type(scale), bool(causal), out, row_max)
    return out, row_max


def softmax_attention(q, k, v, *, scale=None, causal: bool = False):
    """Softmax attention ``softmax(scale q k^T) v`` (:func:`refimpl.attention.softmax_attention`), tiled, on the GPU.

    Parameters
    ----------
    q : array_like or device array, shape (..., N_q, d)
    k : array_like or device array, shape (..., N_k, d)
    v : array_like or device array, shape (..., N_k, d_v)
        The same leading (batch, head) dimensions for all three.
    scale : float, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i`` only (needs ``N_q == N_k``).

    Returns
    -------
    ndarray or device array, shape (..., N_q, d_v)
        A device array when any input is one.  Rows whose scores overflow are
        refused with the reference's error.
    """
    on_device = any_device(q, k, v)
    qh, kh, vh, scale, causal, batch_shape = check_batched_softmax_attention(host_view(q), host_view(k), host_view(v), scale, causal)
    dtype = qh.dtype
    (N_q, d), (N_k, d_v) = qh.shape[-2:], vh.shape[-2:]
    BH = int(np.prod(batch_shape, dtype=np.int64))
    inputs = ((q, "q"), (k, "k"), (v, "v"))
    checks = Checks(dtype)
    q, k, v = (to_device(a, dtype) for a in (q, k, v))
    for (a, name), dev in zip(inputs, (q, k, v)):
        if is_device_array(a):
            checks.finite(dev, name)
    out, row_max = attention_device(q.reshape(BH, N_q, d), k.reshape(BH, N_k, d), v.reshape(BH, N_k, d_v), scale, causal)
    checks.finite(row_max, "row_max")
    # the one copy of the call: every check at once
    raise_bad_inputs(checks.fetch(), inputs)
    if checks.failed("row_max"):
        check_score_maxima(row_max.copy_to_host())
    return result(out.reshape(batch_shape + (N_q, d_v)), on_device)
