r"""The causal scan as Numba kernels: :func:`refimpl.scan.scan_forward` and :func:`~refimpl.scan.scan_backward` on the CPU.

Every sum of the causal form and of its backward (``docs/derivations/scan.md``)
is one contraction with a running state:

.. math::

    \mathrm{out}_t[i] = \sum_m \Big(\sum_{j \le t} b_j[i]\, a_j[m]\Big)\, w_t[m]
    \qquad (\text{or } j \ge t \text{ for the reverse sweep}),

with ``v1 = [v, 1]`` and ``g1 = [g / den, -(g . out) / den]``:

* forward numerators: ``b = v1``, ``a = phi_k``, ``w = phi_q`` (the last
  column is the denominator);
* ``dphi_q``: ``b = phi_k``, ``a = v1``, ``w = g1``;
* ``dphi_k``: ``b = phi_q``, ``a = g1``, ``w = v1``, reverse;
* ``dv``: ``b = g1[:, :d_v]`` (``g / den``), ``a = phi_q``, ``w = phi_k``,
  reverse.

Two ways to compute it, chosen by size (both exact to rounding, each in an
order fixed by the data):

* **Long sequences: chunks of** :data:`CHUNK` **tokens and matrix products**
  (``scan.md#the-chunked-causal-scan``).  Each chunk's state
  ``A_c^T B_c`` is one product, the states before (or after) each chunk are
  their running sum in chunk order, and each chunk's output is two products,
  the carried state and the masked ``C x C`` block,
  ``W_c (sum_{c' < c} A_c'^T B_c') + tril(W_c A_c^T) B_c``.  The products
  are BLAS calls made from a kernel that runs ``prange`` over the chunks
  (BLAS held at one thread meanwhile): the fused loop of the token-by-token
  form is bound by loads and stores, where a product runs at the machine's
  floating-point rate, so only the masking and the running sums are loops.
* **Short sequences** (:data:`CHUNK_WORK` multiply-adds and fewer, what
  training has): :func:`prefix_contract`, token by token, keeping the state
  ``sum_j a_j b_j^T`` (``M x I``) in a thread's block of :data:`COLS` output
  columns; one kernel call with no BLAS call, run in the calling thread.

The bidirectional form is two matrix products, write then read,
``Phi_Q (Phi_K^T [V, 1])``: the forward by blocks of :data:`BLOCK_ROWS`
rows (:func:`blocked_forward`), each block's share of the state a
single-threaded product in a ``prange``, added in block order, then each
block of queries read, for the reason the chunked form has (BLAS's
own threads and Numba's would share the cores); its backward likewise
(:func:`blocked_backward`).

The long forms allocate their results and no other array of ``N`` rows:
``[V_c, 1]``, a block's numerators before they are normalised, and the
backward's ``g / den`` are made a block at a time in work blocks of the
thread's own (:func:`_thread_buffers`), and the chunks' states are
allocated by the driver.  An array of ``N`` rows made at every call came
back as fresh pages, each faulted in and zeroed by the operating system
(``docs/performance_gma.md``: a quarter of the bidirectional forward's time).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import get_thread_id, njit, prange

from refimpl import varlen
from refimpl.scan import FeatureAttentionCache, FeatureAttentionGrads

from ._jit import call_with_one_blas_thread, pick, threaded_and_serial

__all__ = ["prefix_contract", "blocked_forward", "blocked_backward", "chunked_forward", "chunked_backward", "scan_forward", "scan_backward", "packed_forward",
           "packed_backward", "head_offsets", "packed_layout", "packed_grad_out"]

COLS = 8
"""Output columns per thread's block: two AVX2 vectors of float64."""


PREFIX, SUFFIX, WHOLE = 0, 1, 2
"""The sums of :func:`prefix_contract`'s state: over ``j <= t``, ``j >= t``, or the whole sequence (bidirectional)."""


def _prefix_contract(b, a, w, mode, offsets, out):
    # b and out have a multiple of COLS columns: every inner loop has COLS trips, known when compiling
    I = b.shape[1]
    M = a.shape[1]
    blocks = I // COLS
    # one task per (sequence, block of columns): sequence s is rows offsets[s]:offsets[s + 1], its own state
    for task in prange((offsets.shape[0] - 1) * blocks):
        s, i0 = task // blocks, (task % blocks) * COLS
        start, n = offsets[s], offsets[s + 1] - offsets[s]
        state = np.zeros((M, COLS), b.dtype)
        if mode == WHOLE:
            for t in range(start, start + n):
                for m in range(M):
                    am = a[t, m]
                    for i in range(COLS):
                        # the whole sequence's state: sum_j a_j b_j^T
                        state[m, i] += am * b[t, i0 + i]
            for t in range(start, start + n):
                acc = np.zeros(COLS, b.dtype)
                for m in range(M):
                    wm = w[t, m]
                    for i in range(COLS):
                        acc[i] += wm * state[m, i]
                for i in range(COLS):
                    out[t, i0 + i] = acc[i]
        else:
            for step in range(n):
                t = start + (n - 1 - step if mode == SUFFIX else step)
                acc = np.zeros(COLS, b.dtype)
                for m in range(M):
                    am, wm = a[t, m], w[t, m]
                    for i in range(COLS):
                        # the state after token t: sum_{j <= t} a_j b_j^T (j >= t in reverse), then its product with w_t
                        s_mi = state[m, i] + am * b[t, i0 + i]
                        state[m, i] = s_mi
                        acc[i] += wm * s_mi
                for i in range(COLS):
                    out[t, i0 + i] = acc[i]


_PREFIX_CONTRACT = threaded_and_serial(_prefix_contract)


def prefix_contract(b, a, w, *, reverse=False, offsets=None, whole=False):
    """Core: ``out_t = (sum_{j <= t} b_j a_j^T) w_t`` for every token ``t`` (``j >= t`` when ``reverse``).

    Parameters
    ----------
    b : ndarray, shape (N, I)
    a, w : ndarray, shape (N, M)
        One float dtype for the three.
    reverse : bool
        Suffix sums instead of prefix sums.
    offsets : ndarray of int64, shape (S + 1,), optional
        Sequences one after another (``cu_seqlens``): ``j`` runs over the
        rows of ``t``'s sequence only; one sequence of ``N`` rows by default.
    whole : bool
        ``j`` over the whole sequence (the bidirectional form).

    Returns
    -------
    ndarray, shape (N, I)
    """
    a, w = np.ascontiguousarray(a), np.ascontiguousarray(w)
    n, I = b.shape
    offsets = np.array([0, n], dtype=np.int64) if offsets is None else offsets
    padded = np.zeros((n, -(-I // COLS) * COLS), dtype=b.dtype)  # zero columns up to a multiple of COLS
    padded[:, :I] = b
    out = np.empty_like(padded)
    mode = WHOLE if whole else SUFFIX if reverse else PREFIX
    pick(_PREFIX_CONTRACT, n * padded.shape[1] * a.shape[1])(padded, a, w, mode, offsets, out)
    return out[:, :I]


CHUNK = 64
"""Tokens per chunk of the chunked form: ``64 x 64`` blocks, products that BLAS runs near its peak."""

CHUNK_WORK = 1 << 20
"""Multiply-adds (``N F (d_v + 1)``) up to which the causal scan runs token by token (:func:`prefix_contract`)."""

BLOCK_ROWS = 1024
"""Rows per block of the bidirectional write and read (:func:`blocked_forward`): a fixed number, so the order of the
state's sum is fixed."""

FAST = {"fastmath": {"contract"}, "error_model": "numpy"}


@njit(inline="always")
def _lower(block):
    """Zero the entries above the diagonal of a square block: key ``j > t`` is after query ``t``."""
    C = block.shape[0]
    for t in range(C):
        for j in range(t + 1, C):
            block[t, j] = 0


@njit(inline="always")
def _running_sums(states, reverse):
    """Replace ``states[c]`` by the sum of the states before it (after it when ``reverse``), added in chunk order.

    Written as loops: in a ``parallel=True`` kernel an array expression outside ``prange`` becomes a parallel
    region of its own, one per chunk here.
    """
    m, F, w = states.shape
    run = np.zeros((F, w), states.dtype)
    for step in range(m):
        c = m - 1 - step if reverse else step
        for i in range(F):
            for j in range(w):
                here = states[c, i, j]
                states[c, i, j] = run[i, j]
                run[i, j] += here


@njit(inline="always")
def _sum_into(out, a, b):
    """``out = a + b`` by loops (no array expression: see :func:`_running_sums`)."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = a[i, j] + b[i, j]


@njit(inline="always")
def _block(buffers, which, rows, cols):
    """A ``rows x cols`` block of the calling thread's buffer ``which`` (``buffers`` from :func:`_thread_buffers`)."""
    return buffers[get_thread_id(), which, : rows * cols].reshape((rows, cols))


@njit(inline="always")
def _ones_block(buffers, V, a, b):
    """``[V_c, 1]`` of rows ``a:b``, in the calling thread's first buffer."""
    W = V.shape[1] + 1
    v1 = _block(buffers, 0, b - a, W)
    for i in range(b - a):
        for j in range(W - 1):
            v1[i, j] = V[a + i, j]
        v1[i, W - 1] = 1
    return v1


@njit(inline="always")
def _num_block(buffers, rows, W):
    """A ``rows x W`` block of the calling thread's second buffer: a block's ``[num, den - eps]`` before it is normalised."""
    return _block(buffers, 1, rows, W)


@njit(inline="always")
def _columns_block(buffers, G1, a, b):
    """``G1[a:b, :-1]`` (``g / den``) copied to the calling thread's second buffer: a contiguous operand."""
    cols = G1.shape[1] - 1
    gn = _block(buffers, 1, b - a, cols)
    for i in range(b - a):
        for j in range(cols):
            gn[i, j] = G1[a + i, j]
    return gn


@njit(inline="always", error_model="numpy")
def _normalise_rows(num, eps, out, den):
    """``den = num[:, -1] + eps`` and ``out = num[:, :-1] / den`` for a block's rows (or all of them: :func:`_normalised`).

    The division is unchecked (``den = 0`` only with ``eps = 0``: the caller refuses it), so the loop vectorises."""
    W = num.shape[1]
    for i in range(num.shape[0]):
        den[i] = num[i, W - 1] + eps
        for j in range(W - 1):
            out[i, j] = num[i, j] / den[i]


def _thread_buffers(rows, v):
    """Two ``rows x (d_v + 1)`` work blocks per thread of the pool: ``[V_c, 1]``, and a block's numerators (the
    forward) or ``g / den`` (the causal backward), so that a call allocates its outputs and no array of ``N`` rows besides (a fresh one would be fresh pages, zeroed by the
    kernel, at every call: ``docs/performance_gma.md``)."""
    return np.empty((numba.get_num_threads(), 2, rows * (v.shape[1] + 1)), dtype=v.dtype)


def _chunk_states(count, phi_k, v):
    """``count`` arrays of the states of every chunk, ``(N / CHUNK, F, d_v + 1)``, allocated here rather than in the
    kernel: arrays this size allocated in a Numba kernel came back as fresh pages at every call, NumPy's did not
    (``docs/performance_gma.md``)."""
    return np.empty((count, -(-v.shape[0] // CHUNK), phi_k.shape[1], v.shape[1] + 1), dtype=v.dtype)


def _chunked_forward(Q, K, V, eps, out, den, buffers, S):
    n = Q.shape[0]
    m = (n + CHUNK - 1) // CHUNK
    for c in prange(m):
        a, b = c * CHUNK, min(n, (c + 1) * CHUNK)
        v1 = _ones_block(buffers, V, a, b)
        # the chunk's state: Phi_K,c^T [V_c, 1]
        S[c] = np.dot(K[a:b].T, v1)
    _running_sums(S, False)
    for c in prange(m):
        a, b = c * CHUNK, min(n, (c + 1) * CHUNK)
        v1, num = _ones_block(buffers, V, a, b), _num_block(buffers, b - a, V.shape[1] + 1)
        # [num, den - eps]_c = Phi_Q,c [S, z]_before + tril(Phi_Q,c Phi_K,c^T) [V_c, 1]
        block = np.dot(Q[a:b], K[a:b].T)
        _lower(block)
        _sum_into(num, np.dot(Q[a:b], S[c]), np.dot(block, v1))
        _normalise_rows(num, eps, out[a:b], den[a:b])


def _chunked_backward(Q, K, V, G1, dq, dk, dv, buffers, before, after):
    # before: [S, z] of the chunks before c; after: [R, r] of the chunks after c
    n = Q.shape[0]
    m = (n + CHUNK - 1) // CHUNK
    w = G1.shape[1]
    for c in prange(m):
        a, b = c * CHUNK, min(n, (c + 1) * CHUNK)
        before[c] = np.dot(K[a:b].T, _ones_block(buffers, V, a, b))
        after[c] = np.dot(Q[a:b].T, G1[a:b])
    _running_sums(before, False)
    _running_sums(after, True)
    for c in prange(m):
        a, b = c * CHUNK, min(n, (c + 1) * CHUNK)
        v1, gn = _ones_block(buffers, V, a, b), _columns_block(buffers, G1, a, b)
        # M_tj = g1_t . [v_j, 1] and B_tj = phi_q_t . phi_k_j for j <= t
        M = np.dot(G1[a:b], v1.T)
        _lower(M)
        B = np.dot(Q[a:b], K[a:b].T)
        _lower(B)
        R = np.ascontiguousarray(after[c][:, : w - 1])
        # dphi_q_t = [S, z]_t g1_t (prefix sums), dphi_k_t = [R, r]_t [v_t, 1], dv_t = R_t^T phi_k_t (suffix sums)
        _sum_into(dq[a:b], np.dot(G1[a:b], before[c].T), np.dot(M, K[a:b]))
        _sum_into(dk[a:b], np.dot(v1, after[c].T), np.dot(M.T, Q[a:b]))
        _sum_into(dv[a:b], np.dot(K[a:b], R), np.dot(B.T, gn))


@njit(inline="always")
def _blocks_sum(parts, first, count):
    """``parts[first] + ... + parts[first + count - 1]``, added in block order by loops (see :func:`_running_sums`)."""
    total = np.zeros(parts.shape[1:], parts.dtype)
    for c in range(first, first + count):
        _sum_into(total, total, parts[c])
    return total


def _blocked_forward(Q, K, V, eps, out, den, buffers):
    n_k, n_q = K.shape[0], Q.shape[0]
    m = (n_k + BLOCK_ROWS - 1) // BLOCK_ROWS
    parts = np.empty((m, K.shape[1], V.shape[1] + 1), Q.dtype)
    for c in prange(m):
        a, b = c * BLOCK_ROWS, min(n_k, (c + 1) * BLOCK_ROWS)
        v1 = _ones_block(buffers, V, a, b)
        # the block's share of the state: Phi_K,c^T [V_c, 1]
        parts[c] = np.dot(K[a:b].T, v1)
    # [S, z] = Phi_K^T [V, 1], the blocks' shares added in block order
    total = _blocks_sum(parts, 0, m)
    for c in prange((n_q + BLOCK_ROWS - 1) // BLOCK_ROWS):
        a, b = c * BLOCK_ROWS, min(n_q, (c + 1) * BLOCK_ROWS)
        num = _num_block(buffers, b - a, V.shape[1] + 1)
        # [num, den - eps] = Phi_Q [S, z], into the thread's block, then normalised into out and den
        np.dot(Q[a:b], total, num)
        _normalise_rows(num, eps, out[a:b], den[a:b])


def _blocked_backward(Q, K, V, G1, dq, dk, dv, buffers):
    n_k, n_q = K.shape[0], Q.shape[0]
    F, w = K.shape[1], G1.shape[1]
    m_k, m_q = (n_k + BLOCK_ROWS - 1) // BLOCK_ROWS, (n_q + BLOCK_ROWS - 1) // BLOCK_ROWS
    parts = np.empty((m_k + m_q, F, w), Q.dtype)
    for c in prange(m_k + m_q):
        if c < m_k:
            a, b = c * BLOCK_ROWS, min(n_k, (c + 1) * BLOCK_ROWS)
            # the block's share of [S, z] = Phi_K^T [V, 1], the forward's state again
            parts[c] = np.dot(K[a:b].T, _ones_block(buffers, V, a, b))
        else:
            a, b = (c - m_k) * BLOCK_ROWS, min(n_q, (c - m_k + 1) * BLOCK_ROWS)
            # the block's share of [dS, dz] = Phi_Q^T [gn, delta]
            parts[c] = np.dot(Q[a:b].T, G1[a:b])
    state, dstate = _blocks_sum(parts, 0, m_k), _blocks_sum(parts, m_k, m_q)
    state_t, dstate_t = np.ascontiguousarray(state.T), np.ascontiguousarray(dstate.T)
    ds = np.ascontiguousarray(dstate[:, : w - 1])
    for c in prange(m_q):
        a, b = c * BLOCK_ROWS, min(n_q, (c + 1) * BLOCK_ROWS)
        # dphi_q = gn S^T + delta z^T = [gn, delta] [S, z]^T
        np.dot(G1[a:b], state_t, dq[a:b])
    for c in prange(m_k):
        a, b = c * BLOCK_ROWS, min(n_k, (c + 1) * BLOCK_ROWS)
        # dphi_k = v dS^T + 1 dz^T = [v, 1] [dS, dz]^T, dv = phi_k dS
        np.dot(_ones_block(buffers, V, a, b), dstate_t, dk[a:b])
        np.dot(K[a:b], ds, dv[a:b])


_BLOCKED_FORWARD = threaded_and_serial(_blocked_forward, **FAST)
_BLOCKED_BACKWARD = threaded_and_serial(_blocked_backward, **FAST)
_CHUNKED_FORWARD = threaded_and_serial(_chunked_forward, **FAST)
_CHUNKED_BACKWARD = threaded_and_serial(_chunked_backward, **FAST)


def chunked_forward(phi_q, phi_k, v, eps):
    """Core: ``(out, den)`` of the causal form, by chunks and matrix products.

    ``[num, den - eps]_t = (sum_{j <= t} [v_j, 1] phi_k_j^T) phi_q_t`` and
    ``out_t = num_t / den_t``.  Each chunk's numerators are normalised in a thread's work block and written
    to ``out`` and ``den``: the call allocates its two results and no other
    array of ``N`` rows (:func:`_thread_buffers`).

    Parameters
    ----------
    phi_q, phi_k : ndarray, shape (N, F)
    v : ndarray, shape (N, d_v)
        One float dtype for the three.
    eps : float
        Added to every denominator.

    Returns
    -------
    out : ndarray, shape (N, d_v)
    den : ndarray, shape (N,)
        Unchecked (0 only with ``eps = 0``: the caller refuses it).
    """
    phi_q, phi_k, v = (np.ascontiguousarray(a) for a in (phi_q, phi_k, v))
    out, den = np.empty_like(v), np.empty(v.shape[0], dtype=v.dtype)
    call_with_one_blas_thread(_CHUNKED_FORWARD, phi_q.size * (v.shape[1] + 1), phi_q, phi_k, v, v.dtype.type(eps), out,
                              den, _thread_buffers(CHUNK, v), _chunk_states(1, phi_k, v)[0])
    return out, den


def blocked_forward(phi_q, phi_k, v, eps):
    """Core: ``(out, den)`` of the bidirectional form, the write and the read by blocks of :data:`BLOCK_ROWS` rows.

    ``[num, den - eps] = Phi_Q (Phi_K^T [V, 1])`` and ``out = num / den``.
    The products are single-threaded BLAS calls made from a kernel that runs
    ``prange`` over the blocks, as the chunked form's are: BLAS's own thread
    pool, left spinning between calls, would hold the cores that the next
    Numba kernel (the responsibilities) wants.  ``[V_c, 1]`` and each block's
    numerators live in a thread's work blocks: the call allocates its two
    results and no other array of ``N`` rows (:func:`_thread_buffers`).

    Parameters
    ----------
    phi_q : ndarray, shape (N_q, F)
    phi_k : ndarray, shape (N_k, F)
    v : ndarray, shape (N_k, d_v)
        One float dtype for the three.
    eps : float
        Added to every denominator.

    Returns
    -------
    out : ndarray, shape (N_q, d_v)
    den : ndarray, shape (N_q,)
        Unchecked (0 only with ``eps = 0``: the caller refuses it).
    """
    phi_q, phi_k, v = (np.ascontiguousarray(a) for a in (phi_q, phi_k, v))
    out = np.empty((phi_q.shape[0], v.shape[1]), dtype=v.dtype)
    den = np.empty(phi_q.shape[0], dtype=v.dtype)
    work = (phi_q.shape[0] + phi_k.shape[0]) * phi_k.shape[1] * (v.shape[1] + 1)
    call_with_one_blas_thread(_BLOCKED_FORWARD, work, phi_q, phi_k, v, v.dtype.type(eps), out, den,
                              _thread_buffers(BLOCK_ROWS, v))
    return out, den


def blocked_backward(phi_q, phi_k, v, g1):
    """Core: ``(dphi_q, dphi_k, dv)`` of :func:`blocked_forward`'s attention, ``g1 = [g / den, -(g . out) / den]``, by blocks.

    The forward's state ``[S, z]`` again and ``[dS, dz] = Phi_Q^T g1``, each
    the blocks' shares added in block order, then each block of rows'
    products in place, as :func:`blocked_forward` computes (``[V_c, 1]`` in
    the thread's work block).
    """
    phi_q, phi_k, v, g1 = (np.ascontiguousarray(a) for a in (phi_q, phi_k, v, g1))
    dq, dk, dv = np.empty_like(phi_q), np.empty_like(phi_k), np.empty_like(v)
    work = (phi_q.shape[0] + phi_k.shape[0]) * phi_k.shape[1] * g1.shape[1]
    call_with_one_blas_thread(_BLOCKED_BACKWARD, work, phi_q, phi_k, v, g1, dq, dk, dv, _thread_buffers(BLOCK_ROWS, v))
    return dq, dk, dv


def chunked_backward(phi_q, phi_k, v, g1):
    """Core: ``(dphi_q, dphi_k, dv)`` of the causal scan by chunks, ``g1 = [g / den, -(g . out) / den]`` (N, d_v + 1)."""
    phi_q, phi_k, v = (np.ascontiguousarray(a) for a in (phi_q, phi_k, v))
    dq, dk, dv = np.empty_like(phi_q), np.empty_like(phi_k), np.empty_like(v)
    before, after = _chunk_states(2, phi_k, v)
    call_with_one_blas_thread(_CHUNKED_BACKWARD, phi_q.size * g1.shape[1], phi_q, phi_k, v, g1, dq, dk, dv,
                              _thread_buffers(CHUNK, v), before, after)
    return dq, dk, dv


def _ones_column(v):
    """``[v, 1]`` (N, d_v + 1): the last column carries the normaliser through every contraction."""
    v1 = np.ones((v.shape[0], v.shape[1] + 1), dtype=v.dtype)
    v1[:, :-1] = v
    return v1


def _normalised(num, eps):
    """``(out, den)`` from ``[num, den - eps]`` (N, d_v + 1); no raise (den = 0 only with eps = 0: the caller refuses it)."""
    out, den = np.empty((num.shape[0], num.shape[1] - 1), dtype=num.dtype), np.empty(num.shape[0], dtype=num.dtype)
    _normalise_rows(num, num.dtype.type(eps), out, den)
    return out, den


def _grad_columns(g, out, den):
    """``g1 = [g / den, -(g . out) / den]`` (N, d_v + 1), the gradient of ``[num, den]``.

    ``out_t = num_t / den_t``: ``dnum_t = g_t / den_t``, ``dden_t = -(g_t . out_t) / den_t``.
    """
    g1 = np.empty((g.shape[0], g.shape[1] + 1), dtype=g.dtype)
    g1[:, :-1] = g / den[:, None]
    g1[:, -1] = -np.sum(g * out, axis=1) / den
    return g1


def _contracted_backward(g1, phi_q, phi_k, v, offsets=None, whole=False):
    """The three contractions of the backward, token by token (:func:`prefix_contract`)."""
    v1 = _ones_column(v)
    # dphi_q_t = [S, z]_t g1_t, the prefix sums of phi_k_j [v_j, 1]^T
    dphi_q = prefix_contract(phi_k, v1, g1, offsets=offsets, whole=whole)
    # dphi_k_t = [R, r]_t [v_t, 1], the suffix sums of phi_q_j g1_j^T
    dphi_k = prefix_contract(phi_q, g1, v1, reverse=True, offsets=offsets, whole=whole)
    # dv_t = R_t^T phi_k_t, R the suffix sums of phi_q_j (g_j / den_j)^T
    dv = prefix_contract(g1[:, :-1], phi_q, phi_k, reverse=True, offsets=offsets, whole=whole)
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)


def head_offsets(offsets, heads, T):
    """The offsets of every (head, sequence) when ``heads`` heads' ``T`` packed rows are laid one head after another."""
    starts = (offsets[None, :-1] + T * np.arange(heads, dtype=np.int64)[:, None]).reshape(-1)
    return np.append(starts, heads * T)


#: Heads-first rows back in the packed layout (one definition, beside the loop's).
packed_layout = varlen.packed_layout


def packed_grad_out(grad_out, out_shape, dtype):
    """The checked ``grad_out`` of a packed output of ``out_shape``, heads first as rows ``(H T, d_v)``.

    The checks and messages of :func:`refimpl.varlen.packed_backward`: no batch dimension, then the shape and dtype.
    """
    g = varlen.checked_grad_out(grad_out, out_shape, dtype)
    g = g if g.ndim == 2 else g.transpose(1, 0, 2)
    return np.ascontiguousarray(g).reshape(-1, g.shape[-1])


def packed_forward(phi_q, phi_k, v, causal, eps, offsets):
    """Core: ``(out, den)`` of every sequence of packed rows (``offsets``, int64 ``(S + 1,)``) in one kernel call.

    Causal: each sequence's prefix sums start at zero; bidirectional: each
    sequence writes and reads its own state (sums over its rows only).  Token
    by token (:func:`prefix_contract`), in an order fixed by the data; no raise.
    """
    return _normalised(prefix_contract(_ones_column(v), phi_k, phi_q, offsets=offsets, whole=not causal), eps)


def packed_backward(g, phi_q, phi_k, v, out, den, causal, offsets):
    """Core: ``(dphi_q, dphi_k, dv)`` of :func:`packed_forward` (``g`` checked, ``(T, d_v)``; no raise)."""
    return _contracted_backward(_grad_columns(g, out, den), phi_q, phi_k, v, offsets, not causal)


def scan_forward(phi_q, phi_k, v, causal, eps, chunk_size):
    """Core: :func:`refimpl.scan.scan_forward` with the causal form as one kernel; ``(out, cache)``, no raise.

    The caller checks ``cache.den`` (:func:`refimpl.validation.check_denominators`).
    """
    chunk = max(1, min(chunk_size, phi_q.shape[0]))
    if not causal:
        # write the keys into the state, then read it with the queries: [num, den - eps] = Phi_Q (Phi_K^T [V, 1])
        out, den = blocked_forward(phi_q, phi_k, v, eps)
        return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, False, eps, chunk)
    # [num, den - eps]_t = (sum_{j <= t} [v_j, 1] phi_k_j^T) phi_q_t
    if phi_q.shape[0] * phi_q.shape[1] * (v.shape[1] + 1) > CHUNK_WORK:
        out, den = chunked_forward(phi_q, phi_k, v, eps)
    else:
        out, den = _normalised(prefix_contract(_ones_column(v), phi_k, phi_q), eps)
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, True, eps, chunk)


def scan_backward(g, cache):
    """Core: :func:`refimpl.scan.scan_backward` with the causal sweeps as kernels (``g`` checked; no raise)."""
    g1 = _grad_columns(g, cache.out, cache.den)
    if not cache.causal:
        dphi_q, dphi_k, dv = blocked_backward(cache.phi_q, cache.phi_k, cache.v, g1)
        return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)
    if g.shape[0] * cache.phi_q.shape[1] * g1.shape[1] > CHUNK_WORK:
        dphi_q, dphi_k, dv = chunked_backward(cache.phi_q, cache.phi_k, cache.v, g1)
        return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)
    return _contracted_backward(g1, cache.phi_q, cache.phi_k, cache.v)
