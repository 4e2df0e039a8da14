r"""Online vector-quantized (OVQ) attention and the VQ baseline on the CPU with Numba (:mod:`refimpl.ovq`).

The contract is :mod:`refimpl.ovq`'s, word for word: unit rows, predict then
update chunk by chunk, growth, spread or random seeding, argmax assignment
with ties to the lowest index, the running-mean or constant-rate update in
token order, streaming through :class:`refimpl.ovq.OVQState`, the backward
with the assignments held fixed, and the same checks and messages (the
checkers are :mod:`refimpl.ovq`'s own).  :func:`dictionary_size`,
:func:`unit_rows`, :class:`OVQState`, :class:`OVQCache` and
:class:`OVQGrads` are :mod:`refimpl.ovq`'s.

Leading dimensions
------------------
:func:`ovq_attention_forward` and :func:`ovq_attention_backward` take
``(..., N, d)`` arrays as the reference's do: every sequence is independent
and starts from an empty dictionary; here one kernel runs them all.

Packed sequences
----------------
A packed call (``cu_seqlens``, :mod:`refimpl.varlen`) of
:func:`ovq_attention` or :func:`ovq_attention_forward` runs every (head,
sequence) pair in one call of one ``prange`` kernel, one thread per pair
running its whole chunk loop, the arithmetic of the unpacked call on that
sequence, so the result is the loop over the sequences bit for bit.  Each
pair has its own chunk plan (its length and its incoming state's size and
tokens decide it), the plans concatenated with a table of where each pair's
part lies; its own dictionary, empty or the state given for its sequence;
and its rows of the packed arrays as they are, no padding.
:func:`ovq_attention` returns one state per sequence; the cache of
:func:`ovq_attention_forward` is an :class:`OVQPackedCache` (which holds
the same states, without heads), whose backward is one call over every pair.
The boundary's loop, one unpacked call per sequence, runs instead where that
is not the same arithmetic or the loop refuses the call on the way: a
sequence of one head (or none) long enough for the BLAS path below, a state
of a wider dtype than the tokens, a state refused for its own sequence's
first chunk, a row that overflows (the loop names it).

How the work maps onto loops and threads
----------------------------------------
Every size of the chunk plan is known before the data is read: the number
of centroids read by chunk ``j`` is ``n_j`` (growth depends on the token
count only), so the host computes the plan (``starts``, ``n_j``, the number
of seeds, and the draws of ``init="random"`` with refimpl's generator) and
one ``@njit(parallel=True)`` kernel runs the whole chunk loop.

* Many sequences, or short ones (``B`` the product of the leading
  dimensions): ``prange`` over the ``B`` sequences, one parallel region per
  call; each thread runs a sequence's whole chunk loop (unit rows, read-out
  with the online softmax, assignment, seeding, update), the products by
  loop nests.
* One long sequence (``C n_max max(d, d_v) >= BLAS_WORK``): the chunks in
  order, and within a chunk ``prange`` over blocks of ``ROWS`` query rows,
  each block one single-threaded BLAS ``gemm`` for its logits, its softmax
  rows (scale, log-count bias, causal mask, maximum, ``exp``, sum) and one
  ``gemm`` for its output rows; then ``prange`` over blocks of key rows for
  the assignment (``gemm`` and argmax); seeding (a stable sort of the
  chunk's ``L`` scores) and the sparse k-means update of the touched rows in
  token order on one thread.  BLAS is held at one thread while this kernel
  runs, so that its threads and Numba's do not compete for the cores.  The
  backward of one long sequence runs on one thread and lets BLAS thread its
  six products per chunk.

Each reduction (a dot product, a row sum, a per-centroid sum) is computed
by one thread in a fixed order, and the row blocks have a fixed size, so the
bits do not depend on the number of threads.  VQ attention (2-D only) runs
its chunk loop in one kernel, ``prange`` over the chunk's rows.

Float32 stays float32 (every scalar of the arithmetic has the inputs' dtype);
float64 by default.  Results agree with :mod:`refimpl.ovq` to rounding (the
dot products and sums run in another order than NumPy's); the discrete
choices are the same unless two scores differ only in their last bits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import threadpoolctl
from numba import njit, prange

from refimpl import boundary, validation, varlen
from refimpl import ovq as _ovq
from refimpl.ovq import (
    GROWTHS,
    INITS,
    NORM_EPS,
    OVQCache,
    OVQGrads,
    OVQState,
    check_overflow,
    dictionary_size,
    unit_rows,
)

from ._lanes import sum8
from ._record import backend
from .vexp import exp

# the names this module defines; it also holds refimpl.ovq's OVQState, OVQCache, OVQGrads, NORM_EPS, GROWTHS, INITS,
# dictionary_size and unit_rows, which its functions take and return (documented there)
__all__ = [
    "ChunkRecords",
    "OVQPackedCache",
    "ovq_attention",
    "ovq_attention_forward",
    "ovq_attention_backward",
    "vq_attention",
]

#: Work per sequence and chunk (``C n_max d``) from which a single sequence's products go to BLAS.
BLAS_WORK = 1 << 16
#: Query rows per block of the single-sequence path (fixed, so the bits do not depend on the thread count).
ROWS = 32


# ---------------------------------------------------------------------------
# Row helpers (one thread each)
# ---------------------------------------------------------------------------


@njit(cache=True)
def _unit_row(x, out, eps):
    """``out = x / max(||x||, eps)``; returns ``||x||``."""
    acc = x[0] * x[0]
    for c in range(1, x.shape[0]):
        acc += x[c] * x[c]
    norm = math.sqrt(acc)
    # x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
    den = norm if norm > eps else eps
    for c in range(x.shape[0]):
        out[c] = x[c] / den
    return norm


@njit(cache=True)
def _unit_row_backward(g, xhat, norm, eps, out):
    # d(x/||x||)/dx = (I - x^ x^T) / ||x||; below the floor x^ = x / 1e-12 is linear
    den = norm if norm > eps else eps
    for c in range(g.shape[0]):
        out[c] = g[c] / den
    if norm > eps:
        proj = xhat[0] * g[0]
        for c in range(1, g.shape[0]):
            proj += xhat[c] * g[c]
        f = proj / norm
        for c in range(g.shape[0]):
            out[c] -= xhat[c] * f


@njit(cache=True)
def _mm_nt(A, B, out):
    """``out = A @ B.T`` by loops, each entry summed in feature order."""
    for i in range(A.shape[0]):
        for j in range(B.shape[0]):
            acc = A[i, 0] * B[j, 0]
            for p in range(1, A.shape[1]):
                acc += A[i, p] * B[j, p]
            out[i, j] = acc


@njit(cache=True)
def _mm_nn(A, B, out):
    """``out = A @ B`` by loops (rows of ``B`` added in order)."""
    for i in range(A.shape[0]):
        for j in range(B.shape[1]):
            out[i, j] = A[i, 0] * B[0, j]
        for p in range(1, A.shape[1]):
            a = A[i, p]
            for j in range(B.shape[1]):
                out[i, j] += a * B[p, j]


@njit(cache=True)
def _mm_tn(A, B, out):
    """``out = A.T @ B`` by loops (rows of ``A`` and ``B`` added in order)."""
    for i in range(A.shape[1]):
        for j in range(B.shape[1]):
            out[i, j] = A[0, i] * B[0, j]
    for p in range(1, A.shape[0]):
        for i in range(A.shape[1]):
            a = A[p, i]
            for j in range(B.shape[1]):
                out[i, j] += a * B[p, j]


@njit(cache=True)
def _chunk_logits_row(row, n, a, beta, log_c, count_bias):
    """Row ``a`` of the chunk's logits in place, from the dot products; returns the visible width ``n + a + 1``."""
    # l_{a,m} = beta q^_a . D_k[m] + log c_m (m < n): a centroid of count c stands for c tokens, weight pi ~ c
    for u in range(n):
        x = row[u] * beta
        if count_bias:
            x = x + log_c[u]
        row[u] = x
    # l_{a,b} = beta q^_a . k^_b: causal inside the chunk, position a sees the chunk keys b <= a only
    for u in range(n, n + a + 1):
        row[u] = row[u] * beta
    return n + a + 1


@njit(cache=True)
def _row_max(row, width):
    """``(max, finite)`` of ``row[:width]``; NaN makes it not finite, like ``np.max``."""
    m = row[0]
    nan = m != m
    for u in range(1, width):
        x = row[u]
        if x != x:
            nan = True
        elif x > m:
            m = x
    return m, (not nan) and (not math.isinf(m))


@njit(cache=True)
def _argmax_row(row):
    """``(first index of the maximum, maximum)``: ties to the lowest index, like ``np.argmax``."""
    best = row[0]
    arg = 0
    for m in range(1, row.shape[0]):
        if row[m] > best:
            best = row[m]
            arg = m
    return arg, best


@njit(cache=True)
def _softmax_row(row, n, a, beta, log_c, count_bias):
    """Row ``a`` of the chunk: dot products -> ``exp(l - max l)`` in place (0 where masked); ``(sum, finite max)``."""
    width = _chunk_logits_row(row, n, a, beta, log_c, count_bias)
    m, ok = _row_max(row, width)
    # softmax(l) = softmax(l - max): the largest term is exp(0) = 1
    for u in range(width):
        row[u] = exp(row[u] - m)
    tot = sum8(row, width)
    for u in range(width, row.shape[0]):
        row[u] = 0
    return tot, ok


# ---------------------------------------------------------------------------
# The forward kernel
# ---------------------------------------------------------------------------


@njit(cache=True)
def _plan_and_update(b, j, s, L, n, n_add, khat, v, sc, drawn, use_drawn, seed_off, Dk, Dv, counts, rows, seeded,
                     seeds, counts_mid, added, record, eta, constant_rate, sums, sums_v, cnt, cf):
    """Seed, then update the dictionary of sequence ``b`` with chunk ``j`` (rows ``[s, s + L)``)."""
    if n == 0:
        # first chunk: key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed centroids 1.. in
        # ascending order of score (stable sort: ties -> lowest index); the other keys join centroid 0
        for i in range(L):
            rows[b, s + i] = 0
        for i in range(1, L):
            acc = khat[b, s + i, 0] * khat[b, s, 0]
            for c in range(1, khat.shape[2]):
                acc += khat[b, s + i, c] * khat[b, s, c]
            sc[b, i - 1] = acc
        order = np.argsort(sc[b, : L - 1], kind="mergesort")
        seeds[b, seed_off[j]] = 0
        for r in range(1, n_add):
            seeds[b, seed_off[j] + r] = 1 + order[r - 1]
    elif n_add > 0:
        if use_drawn:
            # init="random": refimpl's draw, made on the host, in centroid order
            for r in range(n_add):
                seeds[b, seed_off[j] + r] = drawn[seed_off[j] + r]
        else:
            # spread: the keys least similar to their nearest centroid (stable sort: ties -> lowest index)
            order = np.argsort(sc[b, :L], kind="mergesort")
            for r in range(n_add):
                seeds[b, seed_off[j] + r] = order[r]
    for i in range(L):
        seeded[b, s + i] = False
    # rows[seeds] = n + arange(n_add): a seeded centroid starts at its key and value with count 1
    for r in range(n_add):
        i = seeds[b, seed_off[j] + r]
        rows[b, s + i] = n + r
        seeded[b, s + i] = True
        for c in range(Dk.shape[2]):
            Dk[b, n + r, c] = khat[b, s + i, c]
        for c in range(Dv.shape[2]):
            Dv[b, n + r, c] = v[b, s + i, c]
        counts[b, n + r] = 1
    n_next = n + n_add
    if record:
        for m in range(counts.shape[1]):
            counts_mid[b, j, m] = counts[b, m]
    for m in range(n_next):
        cnt[b, m] = 0
    if constant_rate:
        # D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order
        for i in range(L):
            if seeded[b, s + i]:
                continue
            m = rows[b, s + i]
            cnt[b, m] += 1
            for c in range(Dk.shape[2]):
                Dk[b, m, c] = Dk[b, m, c] + eta * (khat[b, s + i, c] - Dk[b, m, c])
            for c in range(Dv.shape[2]):
                Dv[b, m, c] = Dv[b, m, c] + eta * (v[b, s + i, c] - Dv[b, m, c])
    else:
        # sum_{i in S_m} x_i, accumulated in token order (from 0, like np.add.at)
        for i in range(L):
            if seeded[b, s + i]:
                continue
            m = rows[b, s + i]
            if cnt[b, m] == 0:
                for c in range(Dk.shape[2]):
                    sums[b, m, c] = khat[b, s + i, c]
                for c in range(Dv.shape[2]):
                    sums_v[b, m, c] = v[b, s + i, c]
            else:
                for c in range(Dk.shape[2]):
                    sums[b, m, c] += khat[b, s + i, c]
                for c in range(Dv.shape[2]):
                    sums_v[b, m, c] += v[b, s + i, c]
            cnt[b, m] += 1
        # exact running mean: D' = (c D + sum_S x) / (c + |S|), c and c + |S| in the float dtype
        for m in range(n_next):
            if cnt[b, m] > 0:
                cf[b, 0] = counts[b, m]
                cf[b, 1] = counts[b, m] + cnt[b, m]
                for c in range(Dk.shape[2]):
                    Dk[b, m, c] = (cf[b, 0] * Dk[b, m, c] + sums[b, m, c]) / cf[b, 1]
                for c in range(Dv.shape[2]):
                    Dv[b, m, c] = (cf[b, 0] * Dv[b, m, c] + sums_v[b, m, c]) / cf[b, 1]
    for m in range(n_next):
        counts[b, m] += cnt[b, m]
    if record:
        for m in range(counts.shape[1]):
            added[b, j, m] = cnt[b, m] if m < n_next else 0


@njit(cache=True)
def _stage(b, j, s, L, n, khat, v, Dk, Dv, counts, log_c, record, snap_off, snapK, snapV):
    """The keys and values chunk ``j`` reads, ``[D_k[:n]; k^_s, ...]`` and ``[D_v[:n]; v_s, ...]``, and ``log c``."""
    for i in range(L):
        for c in range(Dk.shape[2]):
            Dk[b, n + i, c] = khat[b, s + i, c]
        for c in range(Dv.shape[2]):
            Dv[b, n + i, c] = v[b, s + i, c]
    for m in range(n):
        log_c[b, m] = counts[b, m]
        log_c[b, m] = math.log(log_c[b, m])
    if record:
        for m in range(n):
            for c in range(Dk.shape[2]):
                snapK[b, snap_off[j] + m, c] = Dk[b, m, c]
            for c in range(Dv.shape[2]):
                snapV[b, snap_off[j] + m, c] = Dv[b, m, c]


@njit(cache=True)
def _forward_sequence(b, q, k, v, qhat, khat, starts, lengths, ns, nadd, seed_off, drawn, use_drawn, snap_off, beta,
                      eps, eta, count_bias, constant_rate, record, Dk, Dv, counts, out, bad, rows, seeded, seeds,
                      counts_mid, added, snapK, snapV, sc, log_c, sums, sums_v, cnt, cf):
    """The whole chunk loop of sequence ``b`` on one thread, the products by loops."""
    N = q.shape[1]
    dv = v.shape[2]
    n_max = counts.shape[1]
    Cm = Dk.shape[1] - n_max
    dt = q.dtype
    for i in range(N):
        _unit_row(q[b, i], qhat[b, i], eps)
        _unit_row(k[b, i], khat[b, i], eps)
    Pf = np.empty(Cm * (n_max + Cm), dt)
    Sf = np.empty(Cm * n_max, dt)
    O = np.empty((Cm, dv), dt)
    rowsum = np.empty(Cm, dt)
    for j in range(starts.shape[0]):
        s = starts[j]
        L = lengths[j]
        n = ns[j]
        K = n + L
        _stage(b, j, s, L, n, khat, v, Dk, Dv, counts, log_c, record, snap_off, snapK, snapV)
        # predict, before the chunk touches the state
        P = Pf[: L * K].reshape((L, K))
        _mm_nt(qhat[b, s : s + L], Dk[b, :K], P)
        for a in range(L):
            tot, ok = _softmax_row(P[a], n, a, beta, log_c[b], count_bias)
            bad[b, s + a] = not ok
            rowsum[a] = tot
        # o_a = softmax(l_a) [D_v[:n]; v_0..v_a] = (sum_u e_u values_u) / sum_u e_u
        _mm_nn(P, Dv[b, :K], O[:L])
        for a in range(L):
            for c in range(dv):
                out[b, s + a, c] = O[a, c] / rowsum[a]
        if n > 0:
            # assign: nearest centroid by dot product, the first maximum on ties (np.argmax)
            S = Sf[: L * n].reshape((L, n))
            _mm_nt(khat[b, s : s + L], Dk[b, :n], S)
            for a in range(L):
                rows[b, s + a], sc[b, a] = _argmax_row(S[a])
        # grow (seed n_add new centroids), then update
        _plan_and_update(b, j, s, L, n, nadd[j], khat, v, sc, drawn, use_drawn, seed_off, Dk, Dv, counts, rows,
                         seeded, seeds, counts_mid, added, record, eta, constant_rate, sums, sums_v, cnt, cf)


@njit(cache=True)
def _forward_work(q, B, Cm, n_max, dv):
    """The work arrays of ``B`` chunk loops, one row each (``q``'s dtype): ``(sc, log_c, sums, sums_v, cnt, cf)``."""
    dt = q.dtype
    d = q.shape[-1]
    return (np.empty((B, Cm), dt), np.zeros((B, n_max), dt), np.empty((B, n_max, d), dt), np.empty((B, n_max, dv), dt),
            np.zeros((B, n_max), np.int64), np.empty((B, 2), dt))


@njit(parallel=True, cache=True)
def _forward_kernel(q, k, v, starts, lengths, ns, nadd, seed_off, drawn, use_drawn, snap_off, beta, eps, eta,
                    count_bias, constant_rate, record, blas, Dk, Dv, counts, out, bad, rows, seeded, seeds,
                    counts_mid, added, snapK, snapV):
    """The chunk loop of ``B`` sequences: ``q, k (B, N, d)``, ``v (B, N, d_v)``; state ``Dk, Dv`` of ``n_max + C`` rows."""
    B, N, d = q.shape
    dv = v.shape[2]
    n_max = counts.shape[1]
    Cm = Dk.shape[1] - n_max
    dt = q.dtype
    qhat = np.empty_like(q)
    khat = np.empty_like(k)
    rowsum = np.empty((B, Cm), dt)
    sc, log_c, sums, sums_v, cnt, cf = _forward_work(q, B, Cm, n_max, dv)
    if not blas:
        # many sequences (or short ones): one thread per sequence runs its whole chunk loop, one parallel region
        for b in prange(B):
            # np.int64: the prange index is unsigned in the parallel region and signed in its typing (one compile)
            _forward_sequence(np.int64(b), q, k, v, qhat, khat, starts, lengths, ns, nadd, seed_off, drawn, use_drawn, snap_off,
                              beta, eps, eta, count_bias, constant_rate, record, Dk, Dv, counts, out, bad, rows, seeded,
                              seeds, counts_mid, added, snapK, snapV, sc, log_c, sums, sums_v, cnt, cf)
        return
    for r in prange(B * N):
        b = r // N
        i = r % N
        _unit_row(q[b, i], qhat[b, i], eps)
        _unit_row(k[b, i], khat[b, i], eps)
    b0 = np.int64(0)  # sequence 0, typed as the other calls' index (a literal 0 would be another compile)
    for j in range(starts.shape[0]):
        s = starts[j]
        L = lengths[j]
        n = ns[j]
        K = n + L
        _stage(b0, j, s, L, n, khat, v, Dk, Dv, counts, log_c, record, snap_off, snapK, snapV)
        # predict, before the chunk touches the state: dot products of the queries with every key they may read;
        # one long sequence: blocks of ROWS query rows, each block's products one single-threaded gemm
        nblk = (L + ROWS - 1) // ROWS
        for blk in prange(nblk):
            a0 = blk * ROWS
            a1 = min(L, a0 + ROWS)
            Pb = np.dot(qhat[0, s + a0 : s + a1], Dk[0, :K].T)
            for a in range(a0, a1):
                tot, ok = _softmax_row(Pb[a - a0], n, a, beta, log_c[0], count_bias)
                bad[0, s + a] = not ok
                rowsum[0, a] = tot
            # o_a = softmax(l_a) [D_v[:n]; v_0..v_a] = (sum_u e_u values_u) / sum_u e_u
            Ob = np.dot(Pb, Dv[0, :K])
            for a in range(a0, a1):
                for c in range(dv):
                    out[0, s + a, c] = Ob[a - a0, c] / rowsum[0, a]
        if n > 0:
            # assign: nearest centroid by dot product, the first maximum on ties (np.argmax)
            for blk in prange(nblk):
                a0 = blk * ROWS
                a1 = min(L, a0 + ROWS)
                Sb = np.dot(khat[0, s + a0 : s + a1], Dk[0, :n].T)
                for a in range(a0, a1):
                    rows[0, s + a], sc[0, a] = _argmax_row(Sb[a - a0])
        # grow (seed n_add new centroids), then update
        _plan_and_update(b0, j, s, L, n, nadd[j], khat, v, sc, drawn, use_drawn, seed_off, Dk, Dv, counts, rows,
                         seeded, seeds, counts_mid, added, record, eta, constant_rate, sums, sums_v, cnt, cf)


# ---------------------------------------------------------------------------
# The backward kernel
# ---------------------------------------------------------------------------


@njit(cache=True)
def _update_backward(b, j, s, L, n, n_add, rows, seeded, seeds, seed_off, counts_mid, added, gDk, gDv, g_khat, g_vc,
                     eta, constant_rate, ranks, cf):
    """The update of chunk ``j`` of sequence ``b`` in reverse: adjoint of the state after -> before, plus the chunk's."""
    d = gDk.shape[2]
    dv = gDv.shape[2]
    n_max = gDk.shape[1]
    one = eta / eta
    for i in range(L):
        for c in range(d):
            g_khat[b, i, c] = 0
        for c in range(dv):
            g_vc[b, i, c] = 0
    if constant_rate:
        # D'[m] = (1-eta)^|S_m| D[m] + eta sum_j (1-eta)^(|S_m|-j) x_(j): the j-th member's weight
        for m in range(n_max):
            ranks[b, m] = 0
        for i in range(L):
            if seeded[b, s + i]:
                continue
            m = rows[b, s + i]
            cf[b, 0] = added[b, j, m] - 1 - ranks[b, m]
            ranks[b, m] += 1
            w = eta * (one - eta) ** cf[b, 0]
            for c in range(d):
                g_khat[b, i, c] = w * gDk[b, m, c]
            for c in range(dv):
                g_vc[b, i, c] = w * gDv[b, m, c]
        for m in range(n_max):
            if added[b, j, m] > 0:
                # the state's rows scale by (1-eta)^|S_m| (a power taken in float64, as NumPy does for integer exponents)
                cf[b, 1] = np.float64(one - eta) ** np.float64(added[b, j, m])
                for c in range(d):
                    gDk[b, m, c] = gDk[b, m, c] * cf[b, 1]
                for c in range(dv):
                    gDv[b, m, c] = gDv[b, m, c] * cf[b, 1]
    else:
        # D'[m] = (c_m D[m] + sum_S x_i) / c'_m: dD'/dx_i = 1/c'_m, dD'/dD[m] = c_m/c'_m
        for i in range(L):
            if seeded[b, s + i]:
                continue
            m = rows[b, s + i]
            cf[b, 1] = counts_mid[b, j, m] + added[b, j, m]
            cf[b, 1] = one / cf[b, 1]
            for c in range(d):
                g_khat[b, i, c] = gDk[b, m, c] * cf[b, 1]
            for c in range(dv):
                g_vc[b, i, c] = gDv[b, m, c] * cf[b, 1]
        for m in range(n_max):
            if added[b, j, m] > 0:
                cf[b, 0] = counts_mid[b, j, m]
                cf[b, 1] = counts_mid[b, j, m] + added[b, j, m]
                cf[b, 0] = cf[b, 0] / cf[b, 1]
                for c in range(d):
                    gDk[b, m, c] = gDk[b, m, c] * cf[b, 0]
                for c in range(dv):
                    gDv[b, m, c] = gDv[b, m, c] * cf[b, 0]
    # a seeded row was set to its seed's key/value just before the merge: the seed takes its gradient
    for r in range(n_add):
        i = seeds[b, seed_off[j] + r]
        for c in range(d):
            g_khat[b, i, c] += gDk[b, n + r, c]
            gDk[b, n + r, c] = 0
        for c in range(dv):
            g_vc[b, i, c] += gDv[b, n + r, c]
            gDv[b, n + r, c] = 0


@njit(cache=True)
def _backward_sequence(b, q, k, v, G, starts, lengths, ns, nadd, seed_off, snap_off, beta, eps, eta, count_bias,
                       constant_rate, blas, rows, seeded, seeds, counts_mid, added, snapK, snapV, gq, gk, gv,
                       qhat, khat, qn, kn, gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf):
    """The backward of sequence ``b`` on one thread, the chunks last to first; products by BLAS or by loops."""
    N, d = q.shape[1], q.shape[2]
    dv = v.shape[2]
    dt = q.dtype
    for i in range(N):
        qn[b, i] = _unit_row(q[b, i], qhat[b, i], eps)
        kn[b, i] = _unit_row(k[b, i], khat[b, i], eps)
    for jj in range(starts.shape[0]):
        j = starts.shape[0] - 1 - jj
        s = starts[j]
        L = lengths[j]
        n = ns[j]
        K = n + L
        # (1) the update, in reverse; the keys, values and log-counts the chunk's read-out saw
        _update_backward(b, j, s, L, n, nadd[j], rows, seeded, seeds, seed_off, counts_mid, added, gDk, gDv,
                         g_khat, g_vc, eta, constant_rate, ranks, cf)
        for m in range(n):
            for c in range(d):
                Kb[b, m, c] = snapK[b, snap_off[j] + m, c]
            for c in range(dv):
                Vb[b, m, c] = snapV[b, snap_off[j] + m, c]
            log_c[b, m] = counts_mid[b, j, m]
            log_c[b, m] = math.log(log_c[b, m])
        for i in range(L):
            for c in range(d):
                Kb[b, n + i, c] = khat[b, s + i, c]
            for c in range(dv):
                Vb[b, n + i, c] = v[b, s + i, c]
        # (2) the read-out against the dictionary the chunk saw: P = softmax(l), dP = G values^T
        if blas:
            P = np.dot(qhat[b, s : s + L], Kb[b, :K].T)
            dP = np.dot(G[b, s : s + L], Vb[b, :K].T)
        else:
            P = np.empty((L, K), dt)
            dP = np.empty((L, K), dt)
            _mm_nt(qhat[b, s : s + L], Kb[b, :K], P)
            _mm_nt(G[b, s : s + L], Vb[b, :K], dP)
        for a in range(L):
            row = P[a]
            drow = dP[a]
            tot, ok = _softmax_row(row, n, a, beta, log_c[b], count_bias)
            for u in range(K):
                row[u] = row[u] / tot
            # the softmax backward: dl_u = p_u (dp_u - sum_w p_w dp_w), masked entries have p = 0
            acc = row[0] * drow[0]
            for u in range(1, K):
                acc += row[u] * drow[u]
            for u in range(K):
                drow[u] = row[u] * (drow[u] - acc)
                # l = beta q^ keys^T: the chain rule through the scale
                drow[u] = drow[u] * beta
        # l = beta q^ keys^T: dq^ = beta dl keys, dkeys = beta dl^T q^; out = P values: dvalues = P^T G
        if blas:
            gqh = np.dot(dP, Kb[b, :K])
            gkeys = np.dot(dP.T, qhat[b, s : s + L])
            gvals = np.dot(P.T, G[b, s : s + L])
        else:
            gqh = np.empty((L, d), dt)
            gkeys = np.empty((K, d), dt)
            gvals = np.empty((K, dv), dt)
            _mm_nn(dP, Kb[b, :K], gqh)
            _mm_tn(dP, qhat[b, s : s + L], gkeys)
            _mm_tn(P, G[b, s : s + L], gvals)
        for m in range(n):
            for c in range(d):
                gDk[b, m, c] += gkeys[m, c]
            for c in range(dv):
                gDv[b, m, c] += gvals[m, c]
        for i in range(L):
            for c in range(d):
                g_khat[b, i, c] += gkeys[n + i, c]
            for c in range(dv):
                g_vc[b, i, c] += gvals[n + i, c]
        # (3) the unit normalisation
        for i in range(L):
            _unit_row_backward(gqh[i], qhat[b, s + i], qn[b, s + i], eps, gq[b, s + i])
            _unit_row_backward(g_khat[b, i], khat[b, s + i], kn[b, s + i], eps, gk[b, s + i])
            for c in range(dv):
                gv[b, s + i, c] = g_vc[b, i, c]


@njit(cache=True)
def _backward_work(q, B, lengths, n_max, dv):
    """The work arrays of ``B`` backwards of chunk loops whose chunks have ``lengths``, one row each (``q``'s dtype):
    ``(gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf)``."""
    dt = q.dtype
    d = q.shape[-1]
    Cm = 0
    for j in range(lengths.shape[0]):
        Cm = max(Cm, lengths[j])
    # adjoint of the state after the chunk being visited; the loss does not read the final state
    gDk = np.zeros((B, n_max, d), dt)
    gDv = np.zeros((B, n_max, dv), dt)
    return (gDk, gDv, np.empty((B, Cm, d), dt), np.empty((B, Cm, dv), dt), np.empty((B, n_max + Cm, d), dt),
            np.empty((B, n_max + Cm, dv), dt), np.zeros((B, n_max), dt), np.empty((B, n_max), np.int64), np.empty((B, 2), dt))


@njit(parallel=True, cache=True)
def _backward_kernel(q, k, v, G, starts, lengths, ns, nadd, seed_off, snap_off, beta, eps, eta, count_bias,
                     constant_rate, blas, rows, seeded, seeds, counts_mid, added, snapK, snapV, gq, gk, gv):
    """Gradients of ``B`` sequences; ``G (B, N, d_v)`` is ``dL/d out``.  One long sequence: BLAS threads the products;
    otherwise one thread per sequence."""
    B, N, d = q.shape
    dv = v.shape[2]
    n_max = counts_mid.shape[2]
    dt = q.dtype
    qhat = np.empty_like(q)
    khat = np.empty_like(k)
    qn = np.empty((B, N), dt)
    kn = np.empty((B, N), dt)
    gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf = _backward_work(q, B, lengths, n_max, dv)
    # one compile of the sequence's backward: its index typed alike in both calls, ``blas`` a value, not a literal
    if blas:
        _backward_sequence(np.int64(0), q, k, v, G, starts, lengths, ns, nadd, seed_off, snap_off, beta, eps, eta,
                           count_bias, constant_rate, blas, rows, seeded, seeds, counts_mid, added, snapK, snapV, gq,
                           gk, gv, qhat, khat, qn, kn, gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf)
        return
    for b in prange(B):
        _backward_sequence(np.int64(b), q, k, v, G, starts, lengths, ns, nadd, seed_off, snap_off, beta, eps, eta,
                           count_bias, constant_rate, blas, rows, seeded, seeds, counts_mid, added, snapK, snapV, gq,
                           gk, gv, qhat, khat, qn, kn, gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf)


# ---------------------------------------------------------------------------
# Packed sequences (cu_seqlens): every (head, sequence) pair in one kernel call
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _packed_forward_kernel(q, k, v, tokens, chunks, seeds_at, snaps_at, starts, lengths, ns, nadd, seed_off, snap_off, drawn,
                           use_drawn, beta, eps, eta, count_bias, constant_rate, record, Dk, Dv, counts, out, bad, rows,
                           seeded, seeds, counts_mid, added, snapK, snapV):
    """The chunk loop of every (head, sequence) pair ``p`` of a packed call, one thread per pair, each its own batch
    of one sequence for :func:`_forward_sequence`: its rows ``tokens[p]:tokens[p + 1]`` of ``q, k (H T, d)`` and
    ``v (H T, d_v)`` (heads first), its plan and records where the tables of :class:`_PackedPlan` say, its state
    ``Dk[p], Dv[p], counts[p]``."""
    P = counts.shape[0]
    d = q.shape[1]
    dv = v.shape[1]
    n_max = counts.shape[1]
    Cm = Dk.shape[1] - n_max
    qhat = np.empty_like(q)
    khat = np.empty_like(k)
    sc, log_c, sums, sums_v, cnt, cf = _forward_work(q, P, Cm, n_max, dv)
    for i in prange(P):
        p = np.int64(i)  # signed, so that the offsets below stay integers
        a, e = tokens[p], tokens[p + 1]
        if e == a:
            continue  # an empty sequence: no chunk, its state as it came
        N, j0, J, r0, r1 = e - a, chunks[p], chunks[p + 1] - chunks[p], seeds_at[p], seeds_at[p + 1]
        # the views have the types of _forward_kernel's arrays (C-contiguous slices reshaped): one compile of the sequence
        if record:
            mid, add = counts_mid[j0 : j0 + J].reshape((1, J, n_max)), added[j0 : j0 + J].reshape((1, J, n_max))
        else:
            mid, add = counts_mid[0:1].reshape((1, 1, n_max)), added[0:1].reshape((1, 1, n_max))
        m0, m1 = snaps_at[p], snaps_at[p + 1]
        _forward_sequence(np.int64(0), q[a:e].reshape((1, N, d)), k[a:e].reshape((1, N, d)), v[a:e].reshape((1, N, dv)),
                          qhat[a:e].reshape((1, N, d)), khat[a:e].reshape((1, N, d)), starts[j0 : j0 + J],
                          lengths[j0 : j0 + J], ns[j0 : j0 + J], nadd[j0 : j0 + J], seed_off[j0 + p : j0 + p + J + 1],
                          drawn[r0:r1], use_drawn, snap_off[j0 + p : j0 + p + J + 1], beta, eps, eta, count_bias,
                          constant_rate, record, Dk[p : p + 1], Dv[p : p + 1], counts[p : p + 1],
                          out[a:e].reshape((1, N, dv)), bad[a:e].reshape((1, N)), rows[a:e].reshape((1, N)),
                          seeded[a:e].reshape((1, N)), seeds[r0:r1].reshape((1, r1 - r0)), mid, add,
                          snapK[m0:m1].reshape((1, m1 - m0, d)), snapV[m0:m1].reshape((1, m1 - m0, dv)), sc[p : p + 1],
                          log_c[p : p + 1], sums[p : p + 1], sums_v[p : p + 1], cnt[p : p + 1], cf[p : p + 1])


@njit(parallel=True, cache=True)
def _packed_backward_kernel(q, k, v, G, tokens, chunks, seeds_at, snaps_at, starts, lengths, ns, nadd, seed_off, snap_off,
                            beta, eps, eta, count_bias, constant_rate, blas, rows, seeded, seeds, counts_mid, added, snapK,
                            snapV, gq, gk, gv):
    """Gradients of every (head, sequence) pair of a packed call, one thread per pair (:func:`_backward_sequence` by
    loops, ``blas`` false); the arrays and tables of :func:`_packed_forward_kernel`, ``G (H T, d_v)`` is ``dL/d out``."""
    P = tokens.shape[0] - 1
    d = q.shape[1]
    dv = v.shape[1]
    n_max = counts_mid.shape[1]
    dt = q.dtype
    qhat = np.empty_like(q)
    khat = np.empty_like(k)
    qn = np.empty(q.shape[0], dt)
    kn = np.empty(q.shape[0], dt)
    gDk, gDv, g_khat, g_vc, Kb, Vb, log_c, ranks, cf = _backward_work(q, P, lengths, n_max, dv)
    for i in prange(P):
        p = np.int64(i)  # signed, so that the offsets below stay integers
        a, e = tokens[p], tokens[p + 1]
        if e == a:
            continue
        N, j0, J, r0, r1, m0, m1 = e - a, chunks[p], chunks[p + 1] - chunks[p], seeds_at[p], seeds_at[p + 1], snaps_at[p], snaps_at[p + 1]
        _backward_sequence(np.int64(0), q[a:e].reshape((1, N, d)), k[a:e].reshape((1, N, d)), v[a:e].reshape((1, N, dv)),
                           G[a:e].reshape((1, N, dv)), starts[j0 : j0 + J], lengths[j0 : j0 + J], ns[j0 : j0 + J],
                           nadd[j0 : j0 + J], seed_off[j0 + p : j0 + p + J + 1], snap_off[j0 + p : j0 + p + J + 1], beta,
                           eps, eta, count_bias, constant_rate, blas, rows[a:e].reshape((1, N)),
                           seeded[a:e].reshape((1, N)), seeds[r0:r1].reshape((1, r1 - r0)),
                           counts_mid[j0 : j0 + J].reshape((1, J, n_max)), added[j0 : j0 + J].reshape((1, J, n_max)),
                           snapK[m0:m1].reshape((1, m1 - m0, d)), snapV[m0:m1].reshape((1, m1 - m0, dv)),
                           gq[a:e].reshape((1, N, d)), gk[a:e].reshape((1, N, d)), gv[a:e].reshape((1, N, dv)),
                           qhat[a:e].reshape((1, N, d)), khat[a:e].reshape((1, N, d)), qn[a:e].reshape((1, N)),
                           kn[a:e].reshape((1, N)), gDk[p : p + 1], gDv[p : p + 1], g_khat[p : p + 1], g_vc[p : p + 1],
                           Kb[p : p + 1], Vb[p : p + 1], log_c[p : p + 1], ranks[p : p + 1], cf[p : p + 1])


# ---------------------------------------------------------------------------
# VQ attention
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _vq_kernel(q, k, v, codebook, C, beta, eps, out, bad):
    N, d = q.shape
    dv = v.shape[1]
    S = codebook.shape[0]
    dt = q.dtype
    qhat = np.empty_like(q)
    khat = np.empty_like(k)
    for i in prange(N):
        _unit_row(q[i], qhat[i], eps)
        _unit_row(k[i], khat[i], eps)
    means = np.zeros((S, dv), dt)
    counts = np.zeros(S, np.int64)
    log_counts = np.empty(S, dt)
    z = np.empty(C, np.int64)
    sums = np.empty((S, dv), dt)
    cnt = np.zeros(S, np.int64)
    cf = np.empty(2, dt)
    P = np.empty((C, S + C), dt)
    for s in range(0, N, C):
        L = min(C, N - s)
        # nearest code by dot product; argmax takes the lowest index on ties
        for i in prange(L):
            best = khat[s + i, 0] * codebook[0, 0]
            for c in range(1, d):
                best += khat[s + i, c] * codebook[0, c]
            arg = 0
            for m in range(1, S):
                acc = khat[s + i, 0] * codebook[m, 0]
                for c in range(1, d):
                    acc += khat[s + i, c] * codebook[m, c]
                if acc > best:
                    best = acc
                    arg = m
            z[i] = arg
        for m in range(S):
            # log L_m: -inf for codes no earlier chunk used
            log_counts[m] = counts[m]
            log_counts[m] = math.log(log_counts[m]) if counts[m] > 0 else -math.inf
        for a in prange(L):
            row = P[a]
            # past: beta q^ . D_k[m] + log L_m; current: beta q^_a . D_k[z_b], b <= a
            for m in range(S):
                acc = qhat[s + a, 0] * codebook[m, 0]
                for c in range(1, d):
                    acc += qhat[s + a, c] * codebook[m, c]
                row[m] = acc * beta + log_counts[m]
            for i in range(a + 1):
                acc = qhat[s + a, 0] * codebook[z[i], 0]
                for c in range(1, d):
                    acc += qhat[s + a, c] * codebook[z[i], c]
                row[S + i] = acc * beta
            width = S + a + 1
            m, ok = _row_max(row, width)
            bad[s + a] = not ok
            for u in range(width):
                row[u] = exp(row[u] - m)
            tot = sum8(row, width)
            for c in range(dv):
                out[s + a, c] = 0
            for u in range(S):
                e = row[u]
                for c in range(dv):
                    out[s + a, c] += e * means[u, c]
            for i in range(a + 1):
                e = row[S + i]
                for c in range(dv):
                    out[s + a, c] += e * v[s + i, c]
            for c in range(dv):
                out[s + a, c] = out[s + a, c] / tot
        # U_m / L_m: running mean of the values each code summarises (sums in token order)
        for i in range(L):
            m = z[i]
            if cnt[m] == 0:
                for c in range(dv):
                    sums[m, c] = v[s + i, c]
            else:
                for c in range(dv):
                    sums[m, c] += v[s + i, c]
            cnt[m] += 1
        for m in range(S):
            if cnt[m] > 0:
                cf[0] = counts[m]
                cf[1] = counts[m] + cnt[m]
                for c in range(dv):
                    means[m, c] = (cf[0] * means[m, c] + sums[m, c]) / cf[1]
                counts[m] += cnt[m]
                cnt[m] = 0


# ---------------------------------------------------------------------------
# Host side: the plan, the records, the public functions
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _single_threaded_blas(blas):
    """One BLAS thread while a kernel that calls BLAS runs (its own threads share the cores; none when ``blas`` is off)."""
    if not blas:
        yield
        return
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        yield


class _Plan:
    """The data-independent chunk plan of one call (the same for every sequence of a batch)."""

    def __init__(self, N, p, n0, t0):
        C, n_max = p.chunk_size, p.max_size
        self.starts = np.arange(0, N, C, dtype=np.int64)
        self.lengths = np.minimum(self.starts + C, N) - self.starts
        J = self.starts.size
        self.ns = np.empty(J, np.int64)
        self.nadd = np.empty(J, np.int64)
        ts = np.empty(J, np.int64)
        n, t = n0, t0
        for j in range(J):
            L = int(self.lengths[j])
            # grow: n' = max(n, growth(t + L, n_max))
            n_next = max(n, _ovq._growth(t + L, n_max, p.growth))
            self.ns[j], self.nadd[j], ts[j] = n, n_next - n, t
            n, t = n_next, t + L
        self.n_final, self.t_final = n, t
        self.seed_off = np.concatenate([[0], np.cumsum(self.nadd)]).astype(np.int64)
        self.snap_off = np.concatenate([[0], np.cumsum(self.ns)]).astype(np.int64)
        self.drawn = np.zeros(max(int(self.seed_off[-1]), 1), np.int64)
        self.use_drawn = p.init == "random"
        if self.use_drawn:
            for j in range(J):
                if self.ns[j] and self.nadd[j]:
                    rng = np.random.default_rng([p.seed, int(ts[j])])
                    self.drawn[self.seed_off[j] : self.seed_off[j + 1]] = rng.choice(int(self.lengths[j]), size=int(self.nadd[j]), replace=False)
        self.C = int(self.lengths.max())


class ChunkRecords(Sequence):
    """What the backward needs from the forward, packed for ``B`` sequences; a sequence of refimpl's chunk records.

    Attributes
    ----------
    plan : the chunk plan (``starts``, ``lengths``, ``ns``, ``nadd``, ``seed_off``, ``snap_off``)
    rows : ndarray of int64, shape (B, N)
        The row each key went to (the assignments the backward holds fixed).
    seeded : ndarray of bool, shape (B, N)
    seeds : ndarray of int64, shape (B, sum of seeds)
        The seeding keys of chunk ``j`` (chunk positions, centroid order) at ``seed_off[j]:seed_off[j + 1]``.
    counts_mid, added : ndarray of int64, shape (B, J, n_max)
        Counts after seeding and ``|S_m|`` of every chunk.
    dict_keys, dict_values : ndarray, shape (B, sum n_j, d) and (B, sum n_j, d_v)
        The dictionary chunk ``j`` read at ``snap_off[j]:snap_off[j + 1]``.

    Notes
    -----
    With ``B = 1`` (a 2-D call), ``records[j]`` is chunk ``j``'s record in
    :mod:`refimpl.ovq`'s form (views into these arrays), so that
    :func:`refimpl.ovq.ovq_attention_backward` accepts the cache too.
    """

    def __init__(self, plan, rows, seeded, seeds, counts_mid, added, dict_keys, dict_values, count_bias):
        self.plan, self.rows, self.seeded, self.seeds = plan, rows, seeded, seeds
        self.counts_mid, self.added, self.dict_keys, self.dict_values = counts_mid, added, dict_keys, dict_values
        self.count_bias = count_bias

    def __len__(self):
        return int(self.plan.starts.size)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if self.rows.shape[0] != 1:
            raise TypeError("ChunkRecords: refimpl's per-chunk records exist for one sequence only (leading dimensions given)")
        j = range(len(self))[j]
        p = self.plan
        s, e, n = int(p.starts[j]), int(p.starts[j] + p.lengths[j]), int(p.ns[j])
        o = int(p.snap_off[j])
        dict_keys, dict_values = self.dict_keys[0, o : o + n], self.dict_values[0, o : o + n]
        log_c = np.log(self.counts_mid[0, j, :n].astype(dict_keys.dtype)) if self.count_bias else None
        return _ovq._ChunkRecord(s, e, n, dict_keys, dict_values, log_c, self.rows[0, s:e], self.seeded[0, s:e],
                                 self.seeds[0, p.seed_off[j] : p.seed_off[j + 1]], self.counts_mid[0, j], self.added[0, j])


def _new_state(Dk, Dv, counts, state, plan):
    """The state after a 2-D call from ``state`` (``None``: a new stream): the first ``n_max`` rows of ``Dk, Dv``."""
    n_max = counts.shape[0]
    keys, values = Dk[:n_max].copy(), Dv[:n_max].copy()
    # rows the stream never reached keep what the incoming state held there (zeros for a new stream)
    if state is None:
        keys[plan.n_final :], values[plan.n_final :] = 0, 0
    else:
        keys[plan.n_final :], values[plan.n_final :] = state.keys[plan.n_final :], state.values[plan.n_final :]
    return OVQState(keys, values, counts, plan.n_final, plan.t_final)


def _run(a, q3, k3, v3, lead, batched, record):
    """The forward of checked arguments ``a`` on ``(B, N, .)`` arrays: ``(out, new_state or None, records or None, inputs, params)``."""
    state = a.state
    dtype, p = a.dtype, a.params
    B, N, d = q3.shape
    d_v = v3.shape[2]
    n_max = p.max_size
    n0, t0 = (0, 0) if state is None else (state.size, state.tokens_seen)
    plan = _Plan(N, p, n0, t0)
    C = plan.C
    Dk = np.zeros((B, n_max + C, d), dtype)
    Dv = np.zeros((B, n_max + C, d_v), dtype)
    counts = np.zeros((B, n_max), np.int64)
    if state is not None:
        Dk[0, :n_max], Dv[0, :n_max], counts[0] = state.keys, state.values, state.counts
    J = plan.starts.size
    out = np.empty((B, N, d_v), dtype)
    bad = np.zeros((B, N), np.bool_)
    rows = np.zeros((B, N), np.int64)
    seeded = np.zeros((B, N), np.bool_)
    seeds = np.zeros((B, max(int(plan.seed_off[-1]), 1)), np.int64)
    shape_rec = (B, J, n_max) if record else (B, 1, n_max)
    counts_mid, added = np.zeros(shape_rec, np.int64), np.zeros(shape_rec, np.int64)
    n_snap = int(plan.snap_off[-1]) if record else 0
    snapK, snapV = np.zeros((B, n_snap, d), dtype), np.zeros((B, n_snap, d_v), dtype)
    f = np.dtype(dtype).type
    blas = B == 1 and C * n_max * max(d, d_v) >= BLAS_WORK
    with _single_threaded_blas(blas):
        _forward_kernel(q3, k3, v3, plan.starts, plan.lengths, plan.ns, plan.nadd, plan.seed_off, plan.drawn,
                        plan.use_drawn, plan.snap_off, f(p.beta), f(NORM_EPS), f(1 if p.eta is None else p.eta), p.count_bias,
                        p.eta is not None, record, blas, Dk, Dv, counts, out, bad, rows, seeded, seeds, counts_mid, added,
                        snapK, snapV)
    for b in range(B):
        # refimpl's loop over the sequences stops at the first that overflows
        n_bad = int(np.count_nonzero(bad[b]))
        if n_bad:
            check_overflow((n_bad, int(np.argmax(bad[b]))), state, dtype)
    new_state = None if batched else _new_state(Dk[0], Dv[0], counts[0], state, plan)
    records = ChunkRecords(plan, rows, seeded, seeds, counts_mid, added, snapK, snapV, p.count_bias) if record else None
    out = out.reshape(lead + (N, d_v)) if batched else out[0]
    inputs = (q3.reshape(lead + (N, d)), k3.reshape(lead + (N, d)), v3.reshape(lead + (N, d_v))) if batched else (a.q, a.k, a.v)
    return out, new_state, records, inputs, p


def _ovq_attention_kernel(xp, a, given, return_state):
    """Core of :func:`ovq_attention` on refimpl's checked arguments: one sequence through the chunk loop kernel."""
    q3, k3, v3 = (np.ascontiguousarray(x)[None] for x in (a.q, a.k, a.v))
    out, new_state, _, _, _ = _run(a, q3, k3, v3, (), False, record=False)
    return (out, new_state) if return_state else out


def _ovq_attention_forward_kernel(xp, a, given):
    """Core of :func:`ovq_attention_forward` on refimpl's checked arguments: every sequence of a batch in one kernel."""
    lead = a.q.shape[:-2]
    q3, k3, v3 = (np.ascontiguousarray(x.reshape((-1,) + x.shape[-2:])) for x in (a.q, a.k, a.v))
    out, new_state, records, (qc, kc, vc), p = _run(a, q3, k3, v3, lead, bool(lead), record=True)
    return out, OVQCache(qc, kc, vc, p, records, new_state)


def _ovq_attention_backward_kernel(xp, grad_out, cache: OVQCache) -> OVQGrads:
    """Core of :func:`ovq_attention_backward`: every sequence of a batch in one kernel (a reference cache to refimpl's)."""
    if isinstance(cache, OVQPackedCache):
        return _packed_backward(grad_out, cache)
    validation.check_instance(cache, "cache", OVQCache, "the OVQCache from ovq_attention_forward")
    if not isinstance(cache.records, ChunkRecords):
        return _ovq.ovq_attention_backward(grad_out, cache)
    q, k, v, p, rec = cache.q, cache.k, cache.v, cache.params, cache.records
    lead, d, d_v = q.shape[:-2], q.shape[-1], v.shape[-1]
    labels = tuple(f"dim {i}" for i in range(len(lead))) + ("N", "d_v")
    g = validation.check_grad_out(grad_out, v.shape, labels, q.dtype)
    q3, k3, v3 = (x.reshape((-1,) + x.shape[-2:]) for x in (q, k, v))
    g3 = np.ascontiguousarray(g.reshape(v3.shape))
    B = q3.shape[0]
    gq, gk, gv = np.empty_like(q3), np.empty_like(k3), np.empty_like(v3)
    plan = rec.plan
    f = np.dtype(q.dtype).type
    blas = B == 1 and plan.C * p.max_size * max(d, d_v) >= BLAS_WORK
    # no parallel region runs beside the BLAS calls here: BLAS keeps its threads
    _backward_kernel(np.ascontiguousarray(q3), np.ascontiguousarray(k3), np.ascontiguousarray(v3), g3, plan.starts,
                     plan.lengths, plan.ns, plan.nadd, plan.seed_off, plan.snap_off, f(p.beta), f(NORM_EPS),
                     f(1 if p.eta is None else p.eta), p.count_bias, p.eta is not None, blas, rec.rows, rec.seeded,
                     rec.seeds, rec.counts_mid, rec.added, rec.dict_keys, rec.dict_values, gq, gk, gv)
    return OVQGrads(q=gq.reshape(q.shape), k=gk.reshape(k.shape), v=gv.reshape(v.shape))


class _PackedPlan:
    """The chunk plans of a packed call's ``P = H S`` (head, sequence) pairs, concatenated in pair order.

    Pair ``p = h S + s`` is sequence ``s`` of head ``h`` (its plan that of the sequence, from its own state): its
    token rows ``tokens[p]:tokens[p + 1]`` of the heads-first rows ``(H T, .)``; its chunks
    ``chunks[p]:chunks[p + 1]`` of ``starts, lengths, ns, nadd`` and its ``J + 1`` entries of ``seed_off, snap_off``
    from ``chunks[p] + p`` (each pair's own, from 0); its seeds ``seeds_at[p]:seeds_at[p + 1]`` of ``drawn`` and of
    the recorded seeds; its dictionaries read ``snaps_at[p]:snaps_at[p + 1]`` (none unless recorded).  ``sequences``
    holds each sequence's :class:`_Plan` (``None`` for an empty one).
    """

    def __init__(self, offsets, H, p, states, record):
        made, self.sequences = {}, []
        for n, st in zip(np.diff(offsets).tolist(), states):
            # a plan depends on the length and the incoming state's size and tokens only: made once for each
            key = (n,) + ((0, 0) if st is None else (st.size, st.tokens_seen))
            if n and key not in made:
                made[key] = _Plan(n, p, *key[1:])
            self.sequences.append(made[key] if n else None)
        pairs = self.sequences * H
        none = np.zeros(0, np.int64)

        def joined(part):
            return np.concatenate([none] + [part(x) for x in pairs]).astype(np.int64)

        self.starts, self.lengths = joined(lambda x: x.starts if x else none), joined(lambda x: x.lengths if x else none)
        self.ns, self.nadd = joined(lambda x: x.ns if x else none), joined(lambda x: x.nadd if x else none)
        self.seed_off, self.snap_off = joined(lambda x: x.seed_off if x else [0]), joined(lambda x: x.snap_off if x else [0])
        self.drawn = joined(lambda x: x.drawn[: x.seed_off[-1]] if x else none)
        T = int(offsets[-1])
        self.tokens = np.concatenate([h * T + offsets[:-1] for h in range(H)] + [[H * T]]).astype(np.int64)

        def at(size):
            return np.concatenate([[0], np.cumsum([size(x) if x else 0 for x in pairs])]).astype(np.int64)

        self.chunks, self.seeds_at = at(lambda x: x.starts.size), at(lambda x: x.seed_off[-1])
        self.snaps_at = at(lambda x: x.snap_off[-1] if record else 0)
        self.use_drawn = p.init == "random"
        self.C = max(x.C for x in made.values())


class OVQPackedCache(NamedTuple):
    """What :func:`ovq_attention_backward` needs of a packed forward computed in one call (every (head, sequence) pair).

    The inputs (cast to the common dtype) and the records of
    :class:`ChunkRecords` are rows heads first (``H = 1`` without heads),
    every pair's part one after another where ``plan`` says; ``states`` is
    the state after each sequence, as a packed :func:`ovq_attention`
    returns them (``None`` with heads, where each sequence is a batch of its
    heads).  Read by this module's backward only; where the loop over the
    sequences ran instead, the cache is a :class:`refimpl.varlen.PackedCache`.
    """

    offsets: np.ndarray  # cu_seqlens, int64 (S + 1,)
    q: np.ndarray  # (H T, d), heads first
    k: np.ndarray
    v: np.ndarray  # (H T, d_v)
    params: _ovq.OVQParams
    plan: _PackedPlan
    rows: np.ndarray  # (H T,) the row each key went to (held fixed by the backward)
    seeded: np.ndarray  # (H T,)
    seeds: np.ndarray  # (seeds_at[-1],)
    counts_mid: np.ndarray  # (chunks[-1], n_max)
    added: np.ndarray
    dict_keys: np.ndarray  # (snaps_at[-1], d)
    dict_values: np.ndarray  # (snaps_at[-1], d_v)
    states: tuple  # the state after each sequence (what ovq_attention returns), without heads; None with heads
    leading: tuple  # () without heads, (H,) with
    out_shape: tuple  # (T, d_v) or (T, H, d_v): the shape of grad_out


def _packed_run(a, offsets, states, record):
    """The forward of a packed call (``a`` checked on the whole arrays, heads first; ``offsets`` checked; ``states``
    one per sequence or ``None``) in one kernel call: ``(out (T, d_v) or (T, H, d_v), OVQPackedCache)``, the cache's
    records empty unless ``record``.  ``NotImplemented`` where the loop over the sequences is not this arithmetic or
    refuses the call: a state that raises the dtype, a sequence long enough for the BLAS path, a state refused for its
    own sequence's first chunk, an overflowed row."""
    p, dtype, leading = a.params, a.dtype, a.q.shape[:-2]
    (T, d), d_v, H, n_max = a.q.shape[-2:], a.v.shape[-1], int(np.prod(leading)), p.max_size
    lengths = np.diff(offsets)
    if _ovq.states_left_to_the_loop(a.q, a.v, dtype, p, lengths, states):
        return NotImplemented  # a state in a wider dtype, or one the loop refuses for its own sequence
    if H == 1 and int(np.minimum(lengths, p.chunk_size).max()) * n_max * max(d, d_v) >= BLAS_WORK:
        return NotImplemented  # the loop's call on one long sequence takes the BLAS path
    plan = _PackedPlan(offsets, H, p, states, record)
    q, k, v = (np.ascontiguousarray(x.reshape(-1, x.shape[-1])) for x in (a.q, a.k, a.v))
    P, rows_total = H * (offsets.size - 1), H * T
    Dk, Dv = np.zeros((P, n_max + plan.C, d), dtype), np.zeros((P, n_max + plan.C, d_v), dtype)
    counts = np.zeros((P, n_max), np.int64)
    for s, st in enumerate(states):
        if st is not None:
            Dk[s, :n_max], Dv[s, :n_max], counts[s] = st.keys, st.values, st.counts
    out = np.empty((rows_total, d_v), dtype)
    bad, seeded = np.zeros(rows_total, np.bool_), np.zeros(rows_total, np.bool_)
    rows, seeds = np.zeros(rows_total, np.int64), np.zeros(int(plan.seeds_at[-1]), np.int64)
    n_rec = int(plan.chunks[-1]) if record else 1
    counts_mid, added = np.zeros((n_rec, n_max), np.int64), np.zeros((n_rec, n_max), np.int64)
    snapK, snapV = np.zeros((int(plan.snaps_at[-1]), d), dtype), np.zeros((int(plan.snaps_at[-1]), d_v), dtype)
    f = np.dtype(dtype).type
    _packed_forward_kernel(q, k, v, plan.tokens, plan.chunks, plan.seeds_at, plan.snaps_at, plan.starts, plan.lengths,
                           plan.ns, plan.nadd, plan.seed_off, plan.snap_off, plan.drawn, plan.use_drawn, f(p.beta),
                           f(NORM_EPS), f(1 if p.eta is None else p.eta), p.count_bias, p.eta is not None, record, Dk, Dv,
                           counts, out, bad, rows, seeded, seeds, counts_mid, added, snapK, snapV)
    if bad.any():
        return NotImplemented  # the loop refuses it, naming the sequence's row as it always has
    new = None
    if not leading:
        new = _ovq.sequence_states([_new_state(Dk[s], Dv[s], counts[s], st, x) if x else None
                                    for s, (st, x) in enumerate(zip(states, plan.sequences))], states, n_max, a.q, a.v, dtype)
    packed = varlen.packed_layout(out, leading)
    return packed, OVQPackedCache(offsets, q, k, v, p, plan, rows, seeded, seeds, counts_mid, added, snapK, snapV, new,
                                  leading, packed.shape)


def _packed_ovq_attention_kernel(xp, a, given, offsets, states, return_state):
    """Core of a packed :func:`ovq_attention`: every sequence in one kernel call (:func:`_packed_run`)."""
    result = _packed_run(a, offsets, states, record=False)
    if result is NotImplemented:
        return result
    out, cache = result
    return (out, cache.states) if return_state else out


def _packed_ovq_attention_forward_kernel(xp, a, given, offsets, states):
    """Core of a packed :func:`ovq_attention_forward`: every (head, sequence) in one kernel call, an
    :class:`OVQPackedCache`."""
    return _packed_run(a, offsets, states, record=True)


def _packed_backward(grad_out, cache):
    """The backward of :func:`_packed_run`: every (head, sequence) pair in one kernel call."""
    g = varlen.checked_grad_out(grad_out, cache.out_shape, cache.q.dtype)
    g = np.ascontiguousarray(g if g.ndim == 2 else g.transpose(1, 0, 2)).reshape(-1, g.shape[-1])
    p, plan = cache.params, cache.plan
    gq, gk, gv = np.empty_like(cache.q), np.empty_like(cache.k), np.empty_like(cache.v)
    f = np.dtype(cache.q.dtype).type
    _packed_backward_kernel(cache.q, cache.k, cache.v, g, plan.tokens, plan.chunks, plan.seeds_at, plan.snaps_at,
                            plan.starts, plan.lengths, plan.ns, plan.nadd, plan.seed_off, plan.snap_off, f(p.beta),
                            f(NORM_EPS), f(1 if p.eta is None else p.eta), p.count_bias, p.eta is not None, False,
                            cache.rows, cache.seeded, cache.seeds, cache.counts_mid, cache.added, cache.dict_keys,
                            cache.dict_values, gq, gk, gv)
    return OVQGrads(*(varlen.packed_layout(x, cache.leading) for x in (gq, gk, gv)))


def _vq_attention_kernel(xp, a, given):
    """Core of :func:`vq_attention` on refimpl's checked arguments: one kernel, overflowed rows refused."""
    q, k, v, codebook, C, beta = a
    dtype = q.dtype
    out = np.empty((q.shape[0], v.shape[1]), dtype)
    bad = np.zeros(q.shape[0], np.bool_)
    f = dtype.type
    _vq_kernel(*(np.ascontiguousarray(x) for x in (q, k, v, codebook)), min(C, q.shape[0]), f(beta), f(NORM_EPS), out, bad)
    n_bad = int(np.count_nonzero(bad))
    validation.check_overflowed_rows(n_bad, int(np.argmax(bad)) if n_bad else -1, dtype, "beta, codebook",
                                     "lower beta or rescale the codebook")
    return out


_NOTES = (
    "The chunk loop of every sequence runs in one kernel (module docstring), a batch's sequences in parallel; the "
    "records the backward needs are kept in arrays (a :class:`ChunkRecords`).  A cache of "
    ":func:`refimpl.ovq.ovq_attention_forward` is handed to :func:`refimpl.ovq.ovq_attention_backward`.  A packed "
    "call runs every (head, sequence) pair in one kernel call, its cache an :class:`OVQPackedCache` (module docstring)."
)

#: The public functions that refimpl's boundary writes once, bound to this module's kernels.
_public = boundary.bind(
    backend(
        {
            "ovq_attention": _ovq_attention_kernel,
            "ovq_attention_forward": _ovq_attention_forward_kernel,
            "ovq_attention_backward": _ovq_attention_backward_kernel,
            "vq_attention": _vq_attention_kernel,
            "packed ovq_attention": _packed_ovq_attention_kernel,
            "packed ovq_attention_forward": _packed_ovq_attention_forward_kernel,
        },
        notes={"ovq_attention_forward": _NOTES, "ovq_attention_backward": _NOTES},
    ),
    module=__name__,
)
ovq_attention = _public.ovq_attention
ovq_attention_forward = _public.ovq_attention_forward
ovq_attention_backward = _public.ovq_attention_backward
vq_attention = _public.vq_attention
