r"""Online vector-quantized (OVQ) attention and the static-dictionary VQ baseline on the GPU (:mod:`refimpl.ovq`).

One head, one sequence: ``q, k`` are ``(N, d)``, ``v`` is ``(N, d_v)``.  The
contract is :mod:`refimpl.ovq`'s, word for word: unit rows, predict then
update chunk by chunk, growth, spread or random seeding, argmax assignment
with ties to the lowest index, the running-mean or constant-rate update in
token order, streaming through :class:`refimpl.ovq.OVQState`, and the same
checks and messages (the checkers are :mod:`refimpl.ovq`'s own).

Launch plan
-----------
The host walks the chunks ``[s, e)`` in order; the state (``D_k``, ``D_v``,
the counts) lives on the device from the first chunk to the last and is
copied back only for ``return_state``.  Every size the plan needs (``n``,
``t``, ``n' = max(n, growth(t + L))``) is known on the host without reading
the device, so chunks follow each other without a synchronisation.

* once per call, :func:`_unit_rows_kernel`: ``q^`` and ``k^`` of every row
  (grid ``(N / TILE, 2)``, blocks of ``TILE`` rows by ``TILE`` lanes), the
  unit normalisation each chunk reads;
* per chunk:

  1. :func:`_readout_kernel`: blocks of ``TILE`` query rows by ``TILE`` keys
     (``THREADS`` threads); one online softmax per query row over the ``n``
     centroids and the chunk's keys ``b <= a``, key and value tiles staged in
     shared memory; the output rows accumulate in ``out`` (each entry owned by
     one thread); the row maxima go to ``rowmax`` for the overflow check;
  2. :func:`_assign_kernel`: blocks of ``TILE`` keys by ``TILE`` centroids, the
     nearest centroid and its similarity (against ``k^_0`` in the first chunk);
  3. :func:`_seed_kernel` (when the dictionary grows): one thread per key, its
     stable rank among the chunk's scores, or its place among the seeds that
     the host drew for ``init="random"`` (refimpl's generator, on the host);
  4. :func:`_update_kernel`: one thread per (active row, column) of ``D_k`` and
     ``D_v``, walking the chunk's keys in token order: the running mean or the
     constant-rate steps, deterministic without atomics; the counts go to a
     second buffer (swapped by the host), so no thread reads a count another
     one writes.

The read-out and the assignment cost ``O(L (n + L) d)`` per chunk, the
update ``O(n' (d + d_v) L)`` (every row thread scans the chunk's ``L``
assignments; ``n' <= n_max``, ``L <= C``); no ``L x n`` or ``N x N`` array is
formed.  One-dimensional launches use blocks of ``FLAT`` threads, or fewer
when there is less work.

VQ attention launches, per chunk, the assignment to the codebook, the
read-out over the codes and the chunk through its codes, and the running
mean of the value means.

Float32 and float64 alike: every shared and local array has the inputs'
dtype.  Results agree with :mod:`refimpl.ovq` to rounding (float64 ~1e-12);
the discrete choices (assignments, seeds, counts) are the same unless two
scores differ only in their last bits (the dot products are summed in
another order here), where a choice can differ.
"""

from __future__ import annotations

import math

import numpy as np
from numba import boolean, cuda, int64

from refimpl import ovq, validation

from ._device import Checks, any_device, blocks, host_view, kernel, raise_bad_inputs, result, to_device, to_host

__all__ = ["ovq_attention", "vq_attention"]

#: Side of the tiles: rows per block, keys per tile, features (or value columns) per slab.
TILE = 8
#: Threads of a tiled block: ``TILE x TILE``.
THREADS = TILE * TILE
#: Threads of a one-dimensional block (seeding, update).
FLAT = 64


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


# x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
# Block: TILE rows x TILE lanes, grid (rows / TILE, 2): blockIdx.y = 0 normalises q, 1 normalises k.  Lane j of row i
# adds the squares of the whole row in column order (the row is read by all TILE lanes at once: one broadcast load)
# and writes the columns j, j + TILE, ...; no shared memory, no barrier.
@kernel(lambda f: (f[:, ::1], f[:, ::1], f[:, ::1], f[:, ::1], f))
def _unit_rows_kernel(q, k, qhat, khat, eps):
    row = cuda.blockIdx.x * TILE + cuda.threadIdx.x // TILE
    j = cuda.threadIdx.x % TILE
    x, xhat = q, qhat
    if cuda.blockIdx.y == 1:
        x, xhat = k, khat
    d = x.shape[1]
    if row < x.shape[0]:
        acc = x[row, 0] * x[row, 0]
        for c in range(1, d):
            acc += x[row, c] * x[row, c]
        norm = math.sqrt(acc)
        if norm < eps:
            norm = eps
        for c in range(j, d, TILE):
            xhat[row, c] = x[row, c] / norm


# predict, before the chunk touches the state: position a (row s + a) attends, in one softmax, to
#   l_{a,m} = beta q^_a . D_k[m] + log c_m (m < n)      a centroid of count c stands for c tokens: weight pi ~ c, logit + log c
#   l_{a,b} = beta q^_a . k^_b (b <= a)                 causal inside the chunk: position a sees the chunk keys b <= a only
#   o_a = softmax(l_a) [D_v[:n]; v_0..v_a]
# VQ: past = b * (qhat @ codebook.T) + log_counts (log L_m: -inf for codes no earlier chunk used),
#     current = b * (qhat @ codebook[z].T): the chunk key b is codebook[z[b]] (indirect=True).
# Block: TILE query rows (i) x TILE keys (j), THREADS threads.  The keys u < n + min(L, a0 + TILE) that the block's
# rows can see are visited in tiles of TILE: feature slabs of q^ [TILE, TILE] and of the keys [TILE, TILE] in shared
# memory, thread (i, j) accumulates the logit l[i, j] over the slabs and writes it to the tile's logits [TILE, TILE]
# in shared memory, next to a slab of the tile's values [TILE keys, TILE columns].  Every thread of row i then runs
# the same online-softmax step of its row over the tile (running max and sum in registers, identical in the TILE
# threads of the row: no reduction, no barrier) and updates out[s + a, c] for its columns c = j, j + TILE, ...
# (out is the accumulator; each entry has one owner: no atomics).  Barriers per tile: one per feature slab, one for
# the logits, two per further value slab.  rowmax[s + a] receives the row's largest logit (NaN if a logit was NaN)
# for the overflow check on the host.
@kernel(
    lambda f: (
        f[:, ::1], int64, int64, f[:, ::1], f[:, ::1], int64[::1], int64, f[:, ::1], int64[::1], boolean,
        f[:, ::1], f, boolean, f[:, ::1], f[::1],
    )
)
def _readout_kernel(qhat, s, L, dict_k, dict_v, counts, n, chunk_k, z, indirect, v, beta, count_bias, out, rowmax):
    sq = cuda.shared.array(THREADS, dtype=qhat.dtype)  # [TILE rows, TILE features] slab of q^
    sk = cuda.shared.array(THREADS, dtype=qhat.dtype)  # [TILE keys, TILE features] slab of the keys
    sp = cuda.shared.array(THREADS, dtype=qhat.dtype)  # [TILE rows, TILE keys] logits of the tile
    sv = cuda.shared.array(THREADS, dtype=qhat.dtype)  # [TILE keys, TILE columns] slab of the values
    bias = cuda.shared.array(TILE, dtype=qhat.dtype)  # [TILE keys] log c of the tile's centroids
    p = cuda.local.array(TILE, dtype=qhat.dtype)  # [TILE] exp(l - max) of the row over the tile
    st = cuda.local.array(4, dtype=qhat.dtype)  # running max, running sum, NaN seen, rescale of this tile
    tid = cuda.threadIdx.x
    i = tid // TILE
    j = tid % TILE
    a0 = cuda.blockIdx.x * TILE
    a = a0 + i
    d = qhat.shape[1]
    dv = v.shape[1]
    zero = beta - beta
    U = n + min(L, a0 + TILE)  # the centroids, then the chunk keys b <= a0 + TILE - 1
    st[0] = -math.inf
    st[1] = 0
    st[2] = 0
    if a < L:
        for c in range(j, dv, TILE):
            out[s + a, c] = 0
    for u0 in range(0, U, TILE):
        if i == 0:
            bias[j] = 0
            if count_bias and u0 + j < n:
                cnt = counts[u0 + j]
                bias[j] = math.log(cnt) if cnt > 0 else -math.inf
        acc = zero
        for d0 in range(0, d, TILE):
            if d0 > 0:
                cuda.syncthreads()  # the previous slab is read
            x = zero
            if a < L and d0 + j < d:
                x = qhat[s + a, d0 + j]
            sq[tid] = x
            u = u0 + i
            y = zero
            if u < U and d0 + j < d:
                if u < n:
                    y = dict_k[u, d0 + j]
                else:
                    r = z[u - n] if indirect else s + u - n
                    y = chunk_k[r, d0 + j]
            sk[tid] = y
            cuda.syncthreads()
            for t in range(TILE):
                acc += sq[i * TILE + t] * sk[j * TILE + t]
        u = u0 + j
        if u < n:
            sp[tid] = acc * beta + bias[j]
        elif u < U and u - n <= a:
            sp[tid] = acc * beta
        else:
            sp[tid] = -math.inf
        u = u0 + i
        y = zero
        if u < U and j < dv:
            y = dict_v[u, j] if u < n else v[s + u - n, j]
        sv[tid] = y
        cuda.syncthreads()
        # online softmax of row i over the tile (the same arithmetic in the TILE threads of the row)
        m_old = st[0]
        m_new = m_old
        for t in range(TILE):
            lt = sp[i * TILE + t]
            if math.isnan(lt):
                st[2] = 1
            elif lt > m_new:
                m_new = lt
        if math.isinf(m_new):
            # nothing visible yet (-inf) or an overflowed row (+inf, refused on the host): no weight
            st[3] = 1
            for t in range(TILE):
                p[t] = 0
        else:
            st[3] = math.exp(m_old - m_new)
            tot = st[1] * st[3]
            for t in range(TILE):
                p[t] = math.exp(sp[i * TILE + t] - m_new)
                tot += p[t]
            st[1] = tot
        st[0] = m_new
        for c0 in range(0, dv, TILE):
            c = c0 + j
            if c0 > 0:
                cuda.syncthreads()  # the previous value slab is read
                y = zero
                if u < U and c < dv:
                    y = dict_v[u, c] if u < n else v[s + u - n, c]
                sv[tid] = y
                cuda.syncthreads()
            if a < L and c < dv:
                o = out[s + a, c] * st[3]
                for t in range(TILE):
                    o += p[t] * sv[t * TILE + j]
                out[s + a, c] = o
    if a < L:
        if j == 0:
            rowmax[s + a] = math.nan if st[2] != 0 else st[0]
        if st[2] == 0 and not math.isinf(st[0]):
            for c in range(j, dv, TILE):
                out[s + a, c] = out[s + a, c] / st[1]


# nearest centroid by dot product; np.argmax returns the first maximum (lowest index):
#   rows[b] = argmax_m k^_b . D_k[m] over m < n, scores[b] = sims[b, rows[b]] (the winner's similarity, for spread);
# VQ: nearest code by dot product; argmax takes the lowest index on ties.  First chunk: D_k = k^_0 (n = 1), so
# scores = khat[1:] @ khat[0] and every key joins centroid 0.
# Block: TILE keys (i) x TILE centroids (j); centroid tiles staged like the read-out ([TILE, TILE] feature slabs of
# the keys and of the centroids in shared memory), similarities [TILE, TILE] in shared memory; thread j = 0 of key i
# scans its row in centroid order with a strict '>' (the first maximum wins) and keeps the best so far.
@kernel(lambda f: (f[:, ::1], int64, int64, f[:, ::1], int64, int64[::1], f[::1], int64[::1]))
def _assign_kernel(khat, s, L, dict_k, n, rows, scores, seeded):
    sk = cuda.shared.array(THREADS, dtype=khat.dtype)  # [TILE keys, TILE features]
    sd = cuda.shared.array(THREADS, dtype=khat.dtype)  # [TILE centroids, TILE features]
    ss = cuda.shared.array(THREADS, dtype=khat.dtype)  # [TILE keys, TILE centroids] similarities
    acc = cuda.local.array(1, dtype=khat.dtype)  # k^_b . D_k[m] of this thread
    best = cuda.local.array(1, dtype=khat.dtype)  # the best similarity so far (thread j = 0)
    tid = cuda.threadIdx.x
    i = tid // TILE
    j = tid % TILE
    b = cuda.blockIdx.x * TILE + i
    d = khat.shape[1]
    arg = -1
    for m0 in range(0, n, TILE):
        acc[0] = 0
        for d0 in range(0, d, TILE):
            if d0 > 0:
                cuda.syncthreads()  # the previous slab is read
            sk[tid] = 0
            if b < L and d0 + j < d:
                sk[tid] = khat[s + b, d0 + j]
            sd[tid] = 0
            if m0 + i < n and d0 + j < d:
                sd[tid] = dict_k[m0 + i, d0 + j]
            cuda.syncthreads()
            for t in range(TILE):
                acc[0] += sk[i * TILE + t] * sd[j * TILE + t]
        ss[tid] = acc[0]
        cuda.syncthreads()
        if j == 0 and b < L:
            for t in range(min(TILE, n - m0)):
                x = ss[i * TILE + t]
                if arg < 0 or x > best[0]:
                    best[0] = x
                    arg = m0 + t
    if j == 0 and b < L:
        rows[b] = arg
        scores[b] = best[0]
        seeded[b] = 0


# the n_add new centroids: rows n, n + 1, ... (rows[seeds] = n + np.arange(seeds.size))
#   spread: seeds = np.argsort(scores, kind="stable")[:n_add]: key b seeds row n + rank(b), rank(b) = the keys with a
#           smaller score, or an equal score and a smaller index (stable sort: ties -> lowest index);
#   first chunk: key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed centroids 1.. in ascending order
#           of score (rank(b) = 1 + the same count among the keys b' >= 1);
#   random: seeds drawn on the host with refimpl's generator, in centroid order (drawn[r] seeds row n + r).
# One thread per key b of the chunk (blocks of FLAT); O(L) work per thread.
@kernel(lambda f: (f[::1], int64, int64, int64, int64[::1], boolean, boolean, int64[::1], int64[::1]))
def _seed_kernel(scores, L, n, n_add, drawn, use_drawn, first, rows, seeded):
    b = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= L:
        return
    if use_drawn:
        for r in range(n_add):
            if drawn[r] == b:
                rows[b] = n + r
                seeded[b] = 1
        return
    rank = 0
    if first and b == 0:
        rank = 0
    else:
        start = 1 if first else 0
        rank = start
        x = scores[b]
        for o in range(start, L):
            y = scores[o]
            if y < x or (y == x and o < b):
                rank += 1
    if rank < n_add:
        rows[b] = n + rank
        seeded[b] = 1


# a seeded centroid starts at its key and value with count 1; then, for the other keys of row m (S_m, token order):
#   exact running mean: (c D + sum_S x) / (c + |S|), sums in token order;
#   or D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order;
#   c'_m = c_m + |S_m| either way (counts_out; the host swaps the two count buffers).
# VQ (with_keys=False): U_m / L_m: running mean of the values each code summarises (gmm.running_mean_update).
# One thread per (row m < n', column) of [D_k | D_v] (blocks of FLAT, flat index m * (d + d_v) + column, so a warp
# reads consecutive columns); every thread walks the chunk's assignments in token order (the same entry for all the
# threads at once: a broadcast load), so each entry is written by one thread: deterministic, no atomics, no barrier.
# A new row's members (first chunk only: row 0) follow its seed, key 0, so one pass sees the seed first.
@kernel(
    lambda f: (
        f[:, ::1], f[:, ::1], int64, int64, int64[::1], int64[::1], f[:, ::1], f[:, ::1], int64[::1], int64[::1],
        int64, int64, f, boolean, boolean,
    )
)
def _update_kernel(khat, v, s, L, rows, seeded, Dk, Dv, counts, counts_out, n, n_next, eta, constant_rate, with_keys):
    cf = cuda.local.array(2, dtype=Dk.dtype)  # the counts c and c' in the float dtype
    idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    wk = Dk.shape[1] if with_keys else 0
    width = wk + Dv.shape[1]
    m = idx // width
    if m >= n_next:
        return
    col = idx % width
    key = col < wk
    c = col if key else col - wk
    D = Dk[m, c] if key else Dv[m, c]
    c_old = counts[m]
    acc = eta - eta
    cnt = 0
    for b in range(L):
        if rows[b] == m:
            x = khat[s + b, c] if key else v[s + b, c]
            if seeded[b] != 0:
                D = x
                c_old = 1
            else:
                cnt += 1
                if constant_rate:
                    D = D + eta * (x - D)
                else:
                    acc += x
    if cnt > 0 and not constant_rate:
        cf[0] = c_old
        cf[1] = c_old + cnt
        D = (cf[0] * D + acc) / cf[1]
    if key:
        Dk[m, c] = D
    else:
        Dv[m, c] = D
    if col == 0:
        counts_out[m] = c_old + cnt


# ---------------------------------------------------------------------------
# Host loops
# ---------------------------------------------------------------------------


def _normalise(q, k):
    qhat = cuda.device_array(q.shape, dtype=q.dtype)
    khat = cuda.device_array(k.shape, dtype=k.dtype)
    _unit_rows_kernel[(blocks(q.shape[0], TILE), 2), THREADS](q, k, qhat, khat, q.dtype.type(ovq.NORM_EPS))
    return qhat, khat


def _overflow(checks, rowmax):
    """``(rows whose logits have no finite maximum, the first of them)``, from the checks; a copy only when some overflowed."""
    if not checks.failed("rowmax"):
        return 0, -1
    bad = ~np.isfinite(rowmax.copy_to_host())
    return int(np.sum(bad)), int(np.argmax(bad))


def _ovq_run(q, k, v, p, state, dtype):
    """Core: ``(out, (D_k, D_v, c, n, t), overflow)`` from device arrays ``q, k, v`` of ``dtype``."""
    N, d = q.shape
    d_v = v.shape[1]
    n_max, C = p.max_size, p.chunk_size
    f = np.dtype(dtype).type
    qhat, khat = _normalise(q, k)
    if state is None:
        Dk = cuda.to_device(np.zeros((n_max, d), dtype))
        Dv = cuda.to_device(np.zeros((n_max, d_v), dtype))
        counts = cuda.to_device(np.zeros(n_max, np.int64))
        n, t = 0, 0
    else:
        Dk = cuda.to_device(np.array(state.keys, dtype=dtype, copy=True))
        Dv = cuda.to_device(np.array(state.values, dtype=dtype, copy=True))
        counts = cuda.to_device(np.array(state.counts, dtype=np.int64, copy=True))
        n, t = state.size, state.tokens_seen
    counts_next = cuda.device_array_like(counts)
    counts_next.copy_to_device(counts)  # device to device
    Cm = min(C, N)
    rows = cuda.device_array(Cm, dtype=np.int64)
    seeded = cuda.device_array(Cm, dtype=np.int64)
    scores = cuda.device_array(Cm, dtype=dtype)
    no_draw = cuda.to_device(np.zeros(1, np.int64))
    out = cuda.device_array((N, d_v), dtype=dtype)
    rowmax = cuda.device_array(N, dtype=dtype)
    beta = f(p.beta)
    eta = f(0 if p.eta is None else p.eta)
    for s in range(0, N, C):
        L = min(s + C, N) - s
        # predict, before the chunk touches the state
        _readout_kernel[blocks(L, TILE), THREADS](
            qhat, s, L, Dk, Dv, counts, n, khat, rows, False, v, beta, p.count_bias, out, rowmax
        )
        # grow: n' = max(n, growth(t + L, n_max))
        t_next = t + L
        n_next = max(n, ovq.dictionary_size(t_next, n_max, p.growth))
        n_add = n_next - n
        # assign (the first chunk against k^_0) and seed
        if n == 0:
            _assign_kernel[blocks(L, TILE), THREADS](khat, s, L, khat[s : s + 1], 1, rows, scores, seeded)
        else:
            _assign_kernel[blocks(L, TILE), THREADS](khat, s, L, Dk, n, rows, scores, seeded)
        if n_add:
            drawn, use_drawn = no_draw, False
            if n and p.init == "random":
                rng = np.random.default_rng([p.seed, t])
                drawn, use_drawn = cuda.to_device(rng.choice(L, size=n_add, replace=False).astype(np.int64)), True
            _seed_kernel[blocks(L, FLAT), min(L, FLAT)](scores, L, n, n_add, drawn, use_drawn, n == 0, rows, seeded)
        # update
        work = n_next * (d + d_v)
        _update_kernel[blocks(work, FLAT), min(work, FLAT)](
            khat, v, s, L, rows, seeded, Dk, Dv, counts, counts_next, n, n_next, eta, p.eta is not None, True
        )
        counts, counts_next = counts_next, counts
        n, t = n_next, t_next
    return out, (Dk, Dv, counts, n, t), rowmax


def _vq_run(q, k, v, codebook, C, beta):
    """Core of :func:`vq_attention`: ``(out, overflow)`` from device arrays of one dtype."""
    N, S, dtype = q.shape[0], codebook.shape[0], q.dtype
    d_v = v.shape[1]
    qhat, khat = _normalise(q, k)
    value_means = cuda.to_device(np.zeros((S, d_v), dtype))
    counts = cuda.to_device(np.zeros(S, np.int64))
    counts_next = cuda.to_device(np.zeros(S, np.int64))
    Cm = min(C, N)
    z = cuda.device_array(Cm, dtype=np.int64)
    seeded = cuda.device_array(Cm, dtype=np.int64)
    scores = cuda.device_array(Cm, dtype=dtype)
    out = cuda.device_array((N, d_v), dtype=dtype)
    rowmax = cuda.device_array(N, dtype=dtype)
    b = dtype.type(beta)
    for s in range(0, N, C):
        L = min(s + C, N) - s
        # nearest code by dot product; argmax takes the lowest index on ties
        _assign_kernel[blocks(L, TILE), THREADS](khat, s, L, codebook, S, z, scores, seeded)
        # past codes (log L_m) and the current chunk through its codes
        _readout_kernel[blocks(L, TILE), THREADS](
            qhat, s, L, codebook, value_means, counts, S, codebook, z, True, v, b, True, out, rowmax
        )
        # U_m / L_m: running mean of the values each code summarises
        _update_kernel[blocks(S * d_v, FLAT), min(S * d_v, FLAT)](
            khat, v, s, L, z, seeded, codebook, value_means, counts, counts_next, S, S, b - b, False, False
        )
        counts, counts_next = counts_next, counts
    return out, rowmax


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
    out, (Dk, Dv, counts, n, t), rowmax = _ovq_run(q, k, v, a.params, a.state, a.dtype)
    checks.finite(rowmax, "rowmax")
    # the one copy of the call: every check at once
    raise_bad_inputs(checks.fetch(), inputs)
    ovq.check_overflow(_overflow(checks, rowmax), a.state, a.dtype)
    out = result(out, on_device)
    if not return_state:
        return out
    return out, ovq.OVQState(Dk.copy_to_host(), Dv.copy_to_host(), counts.copy_to_host(), n, t)


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
    """
    on_device = any_device(q, k, v, codebook)
    a = ovq.check_vq_arguments(host_view(q), host_view(k), host_view(v), to_host(codebook), chunk_size, beta)
    dtype = a.q.dtype
    inputs = ((q, "q"), (k, "k"), (v, "v"))
    if not on_device:
        q, k, v = a.q, a.k, a.v
    q, k, v, codebook = (to_device(x, dtype) for x in (q, k, v, a.codebook))
    checks = Checks(dtype)
    if on_device:
        for x, (_, name) in zip((q, k, v), inputs):
            checks.finite(x, name)
    out, rowmax = _vq_run(q, k, v, codebook, a.chunk_size, a.beta)
    checks.finite(rowmax, "rowmax")
    # the one copy of the call: every check at once
    raise_bad_inputs(checks.fetch(), inputs)
    validation.check_overflowed_rows(*_overflow(checks, rowmax), dtype, "beta, codebook", "lower beta or rescale the codebook")
    return result(out, on_device)
