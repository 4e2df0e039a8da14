"""Worked solutions to lesson 9's exercises; try first.

The kernels are written for the CUDA simulator and for a GPU alike: every
shared array has a shape fixed when the module is loaded (``THREADS``,
``TILE``, ``D_MAX``), one ``cuda.shared.array`` per source line, and no
thread leaves a kernel before a barrier that the others still wait at.
"""

from __future__ import annotations

import math

import gpu

gpu.use_simulator_without_device()  # before numba is imported

import numpy as np  # noqa: E402
from numba import cuda, float64  # noqa: E402

import gpu.numba_cuda  # noqa: E402,F401  (installs the simulator's shared-array fix)

from . import off_by  # near misses: small but real errors

THREADS = 8  # threads per block of the row kernels: a power of two
TILE = 4  # query rows per block, and keys per tile, of the attention kernel
D_MAX = 8  # the largest d and d_v the attention kernel accepts (its shared tiles are TILE x D_MAX)


# ---------------------------------------------------------------------------
# 9.1 Combine two log-sum-exp pairs
# ---------------------------------------------------------------------------


def lse_combine(m1, s1, m2, s2):
    """The pair of the union: ``(M, s1 e^(m1 - M) + s2 e^(m2 - M))`` with ``M = max(m1, m2)``.

    When both pairs are empty, ``M = -inf`` and ``m - M = -inf - (-inf)`` is
    nan; the union of two empty sets is empty, so return ``(-inf, 0)``.
    """
    M = max(m1, m2)
    if M == -math.inf:
        return M, 0.0
    return M, s1 * math.exp(m1 - M) + s2 * math.exp(m2 - M)


# ---------------------------------------------------------------------------
# 9.2 A row-softmax kernel
# ---------------------------------------------------------------------------


@cuda.jit
def row_softmax_kernel(a, out):
    # out[i, k] = exp(a[i, k] - M_i) / S_i: block i owns row i, thread t the entries k = t, t + T, ...
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = a.shape[1]
    red = cuda.shared.array(THREADS, dtype=float64)  # [T] the tree's workspace, used twice
    # 1. the row maximum M: each thread's own over its entries, then a tree
    m = -math.inf
    for k in range(t, n, THREADS):
        m = max(m, a[i, k])
    red[t] = m
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            red[t] = max(red[t], red[t + h])
        cuda.syncthreads()
        h //= 2
    M = red[0]  # finite: a row is never all -inf
    cuda.syncthreads()  # every thread has read M before red is overwritten
    # 2. the sum S of exp(a - M): every exponent <= 0, and exp(-inf - M) = 0 for a weight-0 entry
    s = 0.0
    for k in range(t, n, THREADS):
        s += math.exp(a[i, k] - M)
    red[t] = s
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            red[t] += red[t + h]
        cuda.syncthreads()
        h //= 2
    S = red[0]  # >= 1: the largest entry contributes exp(0)
    # 3. each thread normalises its own entries
    for k in range(t, n, THREADS):
        out[i, k] = math.exp(a[i, k] - M) / S


def row_softmax(a):
    """The softmax of every row of ``a`` (N, K), by :func:`row_softmax_kernel`: one block of THREADS per row."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    out = np.empty_like(a)
    row_softmax_kernel[a.shape[0], THREADS](a, out)
    return out


# ---------------------------------------------------------------------------
# 9.3 The chunk states of the causal scan
# ---------------------------------------------------------------------------


@cuda.jit
def chunk_state_kernel(g_k, v, C, P):
    # P[c, k, e] = sum over the tokens j of chunk c of g_k[j, k] [v_j, 1][e]:
    # block c owns chunk c, thread (k, e) one entry of its K x (d_v + 1) state, summed in token order
    c = cuda.blockIdx.x
    k = cuda.threadIdx.x
    e = cuda.threadIdx.y
    d_v = v.shape[1]
    acc = 0.0
    for j in range(c * C, min((c + 1) * C, g_k.shape[0])):
        acc += g_k[j, k] * (v[j, e] if e < d_v else 1.0)  # column d_v of [V, 1] is the ones: the mass z
    P[c, k, e] = acc


@cuda.jit
def exclusive_prefix_kernel(P, S):
    # S[c] = P[0] + ... + P[c - 1]: one thread per entry (k, e) walks the chunks in order
    k = cuda.threadIdx.x
    e = cuda.threadIdx.y
    run = 0.0
    for c in range(P.shape[0]):
        S[c, k, e] = run  # store first: chunk c's own state is not in S[c]
        run += P[c, k, e]


def chunk_states(gamma_k, v, C):
    """Steps 1 and 2 of the GPU scan: every chunk's state at once, then their exclusive prefix, (chunks, K, d_v + 1)."""
    gamma_k = np.ascontiguousarray(gamma_k, dtype=np.float64)
    v = np.ascontiguousarray(v, dtype=np.float64)
    N, K = gamma_k.shape
    n_chunks = -(-N // C)
    P = np.empty((n_chunks, K, v.shape[1] + 1))
    chunk_state_kernel[n_chunks, (K, v.shape[1] + 1)](gamma_k, v, C, P)
    S = np.empty_like(P)
    exclusive_prefix_kernel[1, (K, v.shape[1] + 1)](P, S)
    return S


# ---------------------------------------------------------------------------
# 9.4 A tiled online-softmax attention kernel
# ---------------------------------------------------------------------------


@cuda.jit
def online_attention_kernel(q, k, v, scale, causal, out):
    # out[i] = softmax_j(scale q_i . k_j) v_j: block b owns the query rows b TILE .. b TILE + TILE - 1, thread t one row;
    # the keys and values come in tiles of TILE rows that the block's threads load together into shared memory
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * TILE + t
    N, d, d_v = q.shape[0], q.shape[1], v.shape[1]
    k_tile = cuda.shared.array((TILE, D_MAX), dtype=float64)  # [TILE, d] this tile's keys
    v_tile = cuda.shared.array((TILE, D_MAX), dtype=float64)  # [TILE, d_v] and values
    acc = cuda.local.array(D_MAX, dtype=float64)  # [d_v] the running y of row i
    for e in range(d_v):
        acc[e] = 0.0
    m = -math.inf  # the running maximum of row i's scores
    ell = 0.0  # and sum of exp(score - m)
    for j0 in range(0, k.shape[0], TILE):
        # every thread, rows past N included, loads one key and one value and reaches both barriers
        j = j0 + t
        if j < k.shape[0]:
            for e in range(d):
                k_tile[t, e] = k[j, e]
            for e in range(d_v):
                v_tile[t, e] = v[j, e]
        cuda.syncthreads()  # the tile is complete
        if i < N:
            for jj in range(TILE):
                j = j0 + jj
                if j < k.shape[0] and (not causal or j <= i):
                    s = 0.0
                    for e in range(d):
                        s += q[i, e] * k_tile[jj, e]
                    s *= scale
                    if s > m:
                        # the maximum grows to s: rescale l and y by e^(m - s) (0 before the first key)
                        r = math.exp(m - s)
                        ell = ell * r + 1.0
                        for e in range(d_v):
                            acc[e] = acc[e] * r + v_tile[jj, e]
                        m = s
                    else:
                        p = math.exp(s - m)
                        ell += p
                        for e in range(d_v):
                            acc[e] += p * v_tile[jj, e]
        cuda.syncthreads()  # everyone is done with the tile before it is overwritten
    if i < N:
        for e in range(d_v):
            out[i, e] = acc[e] / ell  # ell >= 1: the key at the maximum contributes exp(0)


def online_attention(q, k, v, causal):
    """Softmax attention of one sequence (scale ``1 / sqrt(d)``) by :func:`online_attention_kernel`, (N, d_v)."""
    q, k, v = (np.ascontiguousarray(a, dtype=np.float64) for a in (q, k, v))
    assert q.shape[1] <= D_MAX and v.shape[1] <= D_MAX, f"d and d_v up to D_MAX = {D_MAX}"
    out = np.empty((q.shape[0], v.shape[1]))
    online_attention_kernel[-(-q.shape[0] // TILE), TILE](q, k, v, 1.0 / math.sqrt(q.shape[1]), causal, out)
    return out


SOLUTIONS = {"9.1": lse_combine, "9.2": row_softmax, "9.3": chunk_states, "9.4": online_attention}


# ---------------------------------------------------------------------------
# Near misses: plausible wrong answers that the checks must catch
# ---------------------------------------------------------------------------


def _lse_sum_slightly_off(m1, s1, m2, s2):
    """The sum of two non-empty pairs off by a relative 1e-10 (M exact): small, but above the check's tolerance."""
    M, S = lse_combine(m1, s1, m2, s2)
    return M, S * (1 + 1e-10) if s1 > 0 and s2 > 0 else S


def _lse_no_guard(m1, s1, m2, s2):
    M = max(m1, m2)  # two empty pairs: -inf - (-inf) = nan
    return M, s1 * math.exp(m1 - M) + s2 * math.exp(m2 - M)


def _lse_second_not_rescaled(m1, s1, m2, s2):
    M = max(m1, m2)
    if M == -math.inf:
        return M, 0.0
    return M, s1 * math.exp(m1 - M) + s2


def _lse_min(m1, s1, m2, s2):
    M = min(m1, m2)
    if M == -math.inf:
        return M, 0.0
    return M, s1 * math.exp(m1 - M) + s2 * math.exp(m2 - M)


@cuda.jit
def _pairs_without_guard_kernel(a, out):
    # section 1's single pass over (m, s) pairs: a thread whose first entry is -inf computes exp(-inf - (-inf))
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    m_sh = cuda.shared.array(THREADS, dtype=float64)
    s_sh = cuda.shared.array(THREADS, dtype=float64)
    m = -math.inf
    s = 0.0
    for k in range(t, a.shape[1], THREADS):
        if a[i, k] > m:
            s = s * math.exp(m - a[i, k]) + 1.0
            m = a[i, k]
        else:
            s += math.exp(a[i, k] - m)
    m_sh[t] = m
    s_sh[t] = s
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            big = max(m_sh[t], m_sh[t + h])
            if big > -math.inf:
                s_sh[t] = s_sh[t] * math.exp(m_sh[t] - big) + s_sh[t + h] * math.exp(m_sh[t + h] - big)
            m_sh[t] = big
        cuda.syncthreads()
        h //= 2
    for k in range(t, a.shape[1], THREADS):
        out[i, k] = math.exp(a[i, k] - m_sh[0]) / s_sh[0]


@cuda.jit
def _no_shift_kernel(a, out):
    # exp(a) / sum exp(a) without the maximum: exp(900) overflows
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    red = cuda.shared.array(THREADS, dtype=float64)
    s = 0.0
    for k in range(t, a.shape[1], THREADS):
        s += math.exp(a[i, k])
    red[t] = s
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            red[t] += red[t + h]
        cuda.syncthreads()
        h //= 2
    for k in range(t, a.shape[1], THREADS):
        out[i, k] = math.exp(a[i, k]) / red[0]


@cuda.jit
def _no_barrier_kernel(a, out):
    # row_softmax_kernel without the barrier after each step of its trees: a thread reads red[t + h] before
    # the thread that owns it has written this step's value (a race)
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = a.shape[1]
    red = cuda.shared.array(THREADS, dtype=float64)
    m = -math.inf
    for k in range(t, n, THREADS):
        m = max(m, a[i, k])
    red[t] = m
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            red[t] = max(red[t], red[t + h])
        h //= 2
    M = red[0]
    cuda.syncthreads()
    s = 0.0
    for k in range(t, n, THREADS):
        s += math.exp(a[i, k] - M)
    red[t] = s
    cuda.syncthreads()
    h = THREADS // 2
    while h > 0:
        if t < h:
            red[t] += red[t + h]
        h //= 2
    S = red[0]
    for k in range(t, n, THREADS):
        out[i, k] = math.exp(a[i, k] - M) / S


def _softmax_with(kernel):
    def run(a):
        a = np.ascontiguousarray(a, dtype=np.float64)
        out = np.empty_like(a)
        kernel[a.shape[0], THREADS](a, out)
        return out

    return run


@cuda.jit
def _inclusive_prefix_kernel(P, S):
    k = cuda.threadIdx.x
    e = cuda.threadIdx.y
    run = 0.0
    for c in range(P.shape[0]):
        run += P[c, k, e]  # added before the store: S[c] includes chunk c itself
        S[c, k, e] = run


def _chunk_states_inclusive(gamma_k, v, C):
    gamma_k, v = np.ascontiguousarray(gamma_k, dtype=np.float64), np.ascontiguousarray(v, dtype=np.float64)
    n_chunks, K = -(-gamma_k.shape[0] // C), gamma_k.shape[1]
    P = np.empty((n_chunks, K, v.shape[1] + 1))
    chunk_state_kernel[n_chunks, (K, v.shape[1] + 1)](gamma_k, v, C, P)
    S = np.empty_like(P)
    _inclusive_prefix_kernel[1, (K, v.shape[1] + 1)](P, S)
    return S


def _chunk_states_overlapping(gamma_k, v, C):
    # chunks of C + 1 tokens: chunk c ends one token too late, counting the first token of chunk c + 1 twice
    gamma_k, v = np.ascontiguousarray(gamma_k, dtype=np.float64), np.ascontiguousarray(v, dtype=np.float64)
    n_chunks, K = -(-gamma_k.shape[0] // C), gamma_k.shape[1]
    P = np.empty((n_chunks, K, v.shape[1] + 1))
    for c in range(n_chunks):
        stop = min((c + 1) * C + 1, gamma_k.shape[0])
        P[c] = gamma_k[c * C : stop].T @ np.hstack([v[c * C : stop], np.ones((stop - c * C, 1))])
    S = np.empty_like(P)
    exclusive_prefix_kernel[1, (K, v.shape[1] + 1)](P, S)
    return S


@cuda.jit
def _acc_not_rescaled_kernel(q, k, v, scale, causal, out):
    # the running sum l is rescaled when the maximum grows, the accumulator a is not
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * TILE + t
    N, d, d_v = q.shape[0], q.shape[1], v.shape[1]
    k_tile = cuda.shared.array((TILE, D_MAX), dtype=float64)
    v_tile = cuda.shared.array((TILE, D_MAX), dtype=float64)
    acc = cuda.local.array(D_MAX, dtype=float64)
    for e in range(d_v):
        acc[e] = 0.0
    m = -math.inf
    ell = 0.0
    for j0 in range(0, k.shape[0], TILE):
        j = j0 + t
        if j < k.shape[0]:
            for e in range(d):
                k_tile[t, e] = k[j, e]
            for e in range(d_v):
                v_tile[t, e] = v[j, e]
        cuda.syncthreads()
        if i < N:
            for jj in range(TILE):
                j = j0 + jj
                if j < k.shape[0] and (not causal or j <= i):
                    s = 0.0
                    for e in range(d):
                        s += q[i, e] * k_tile[jj, e]
                    s *= scale
                    m_new = max(m, s)
                    ell = ell * math.exp(m - m_new) + math.exp(s - m_new)
                    for e in range(d_v):
                        acc[e] += math.exp(s - m_new) * v_tile[jj, e]
                    m = m_new
        cuda.syncthreads()
    if i < N:
        for e in range(d_v):
            out[i, e] = acc[e] / ell


def _attention_with(kernel, scale=None):
    def run(q, k, v, causal):
        q, k, v = (np.ascontiguousarray(a, dtype=np.float64) for a in (q, k, v))
        out = np.empty((q.shape[0], v.shape[1]))
        s = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
        kernel[-(-q.shape[0] // TILE), TILE](q, k, v, s, causal, out)
        return out

    return run


NEAR_MISSES = {
    "9.1": {
        "no guard for two empty pairs": _lse_no_guard,
        "the second sum not rescaled": _lse_second_not_rescaled,
        "the minimum, not the maximum": _lse_min,
        "the sum scaled by 1 + 1e-10": _lse_sum_slightly_off,
    },
    "9.2": {
        "no guard for -inf - (-inf)": _softmax_with(_pairs_without_guard_kernel),
        "no row maximum subtracted: exp overflows": _softmax_with(_no_shift_kernel),
        "a missing cuda.syncthreads() in the tree": _softmax_with(_no_barrier_kernel),
        "every value scaled by 1 + 1e-9": off_by(row_softmax, 1e-9),
    },
    "9.3": {
        "the inclusive prefix: S[c] counts chunk c": _chunk_states_inclusive,
        "chunks one token too long: boundary tokens counted twice": _chunk_states_overlapping,
        "every value scaled by 1 + 1e-10": off_by(chunk_states, 1e-10),
    },
    "9.4": {
        "the accumulator not rescaled when the maximum grows": _attention_with(_acc_not_rescaled_kernel),
        "the scores not scaled by 1 / sqrt(d)": _attention_with(online_attention_kernel, scale=1.0),
        "every value scaled by 1 + 1e-10": off_by(online_attention, 1e-10),
    },
}
