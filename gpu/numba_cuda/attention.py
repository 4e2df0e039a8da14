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
One launch of one kernel, :func:`_flash_forward`, for every sequence (batch
and head dimensions flattened to ``BH``), with the geometry of
:func:`launch_geometry`, a pure function of the shapes:

* a block of ``TY x TX`` threads (256) owns a tile of
  ``TILE_Q = TY RQ`` query rows and a group of up to ``COLS`` value columns
  (all of ``d_v`` when ``d_v <= COLS``: one group), and runs over the key
  tiles of ``TILE_K = TX RK`` keys (``TILE_Q x TILE_K`` = 64 x 64 in
  float32, 32 x 32 in float64, whose shared memory is twice as large);
* thread ``(ty, tx)`` owns the ``RQ`` query rows ``ty RQ + i`` of the tile:
  the ``RQ x RK`` scores of those rows against keys ``tx RK + j``, their
  running maxima and partial sums, and the accumulators of its value columns
  (``V_CHUNK / TX`` consecutive ones in each staged chunk of ``V_CHUNK``);
* the query tile stays in shared memory (transposed) for the whole key loop
  when ``d <= D_CHUNK`` (64); a larger ``d`` is covered ``D_CHUNK``
  coordinates at a time, the query tile then staged again per key tile;
* a ``d_v`` larger than ``COLS`` (64) is split over the grid (the scores are
  then computed once per group of ``COLS`` columns);
* grid ``x`` runs over (query tile, column group), the heaviest causal tiles
  first, and ``y``, ``z`` over the sequences (:func:`~gpu.numba_cuda._primitives.sequence_axes`);
  every axis within the hardware's limits (x up to ``2^31 - 1`` tiles, that
  is ``N`` up to about ``2^37``; ``y z`` up to ``65,535^2`` sequences).

A packed call (``cu_seqlens``) is the same single launch: grid ``x`` runs
over the query tiles of all its sequences (:func:`packed_tiles`, built once
per call from the offsets), ``y``, ``z`` over the heads; a block finds its
sequence by bisection over the tiles' ends and reads the rows and keys of
that sequence only, so nothing crosses a boundary and each sequence is
computed as on its own (``docs/derivations/varlen.md``).

Per key tile a block passes two barriers per ``D_CHUNK`` of ``d``, one
after the row maxima and two per ``V_CHUNK`` of value columns: 7 per 64
keys for ``d, d_v <= 64`` in float32 (against about 160 for 8 x 8 tiles).  Causal: key tiles past the
query tile's last row are skipped, ``j > i`` gets ``-inf``; an entirely
masked tile, or a row whose scores are all ``-inf`` so far, leaves the
running pair at ``(-inf, 0)`` through the guard of
:func:`~gpu.numba_cuda._primitives.exp_shifted`.

Host copies
-----------
The kernel also writes every row's maximum score (NaN when a score is NaN).
:class:`~gpu.numba_cuda._device.Checks` counts the non-finite row maxima, and
the non-finite entries of device inputs, on the device; their counts come to
the host in one ``copy_to_host`` per call, the one result check.  Only when a
count is not zero is more copied, to word the reference's error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import boolean, config, cuda, int64, uint32, uint64
from numba.np.numpy_support import from_dtype as numba_type

from refimpl import boundary
from refimpl.validation import check_score_maxima

from ._device import Checks, any_device, backend, blocks, is_device_array, kernel, raise_bad_inputs, result, to_device
from . import _primitives
from ._primitives import MAX_GRID_X, MAX_GRID_YZ, MAX_THREADS, exp_shifted, max_keep_nan, row_max, row_sum, sequence_axes

__all__ = ["softmax_attention", "Geometry", "GPU_GEOMETRY", "SIMULATOR_GEOMETRY", "GEOMETRY", "launch_geometry"]

#: True when kernels run in the CUDA simulator (every thread a Python thread): the blocks are then kept small.
SIMULATOR = bool(config.ENABLE_CUDASIM)


class Geometry(NamedTuple):
    """The tiles of :func:`_flash_forward`; every field a power of two.

    A block has ``TY x TX`` threads; thread ``(ty, tx)`` owns ``RQ`` query
    rows and ``RK`` keys of each key tile, so the tiles are
    ``TILE_Q = TY RQ`` query rows by ``TILE_K = TX RK`` keys.
    """

    TX: int  # threads along the keys of a tile (and the value columns)
    TY: int  # threads along the query rows
    RQ: int  # query rows per thread
    RK: int  # keys per thread per key tile
    D_CHUNK: int  # coordinates of q and k held at once: the query tile is resident when d <= D_CHUNK
    COLS: int  # value columns per block (a multiple of V_CHUNK)
    V_CHUNK: int  # value columns staged at a time (a multiple of TX)

    @property
    def tile_q(self) -> int:
        return self.TY * self.RQ

    @property
    def tile_k(self) -> int:
        return self.TX * self.RK

    @property
    def threads(self) -> int:
        return self.TX * self.TY

    def shared_bytes(self, itemsize: int) -> int:
        """Static shared memory of a GPU block: q^T, k^T or P (rows padded by 16 bytes), V [TILE_K, V_CHUNK], maxima
        [TILE_Q, TX] and the running maxima [2, TILE_Q]."""
        pad = max(1, 16 // itemsize)
        kp = max(self.D_CHUNK, self.tile_q) * (self.tile_k + pad)
        return itemsize * (self.D_CHUNK * (self.tile_q + pad) + kp + self.tile_k * self.V_CHUNK + self.tile_q * self.TX
                           + 2 * self.tile_q)


#: The GPU's tiles, by dtype: 64 x 64 in float32 (256 threads of 4 x 4 register tiles, 46.5 KiB of shared memory),
#: 32 x 32 in float64 (256 threads of 2 x 2, 45.5 KiB).
GPU_GEOMETRY = {
    np.dtype(np.float32): Geometry(TX=16, TY=16, RQ=4, RK=4, D_CHUNK=64, COLS=64, V_CHUNK=32),
    np.dtype(np.float64): Geometry(TX=16, TY=16, RQ=2, RK=2, D_CHUNK=64, COLS=64, V_CHUNK=32),
}
#: Resident blocks per multiprocessor the GPU builds are bounded for (``launch_bounds``): 4 blocks of 256 threads,
#: 32 of the 64 warps of an sm_90 multiprocessor (50% occupancy, 64 registers a thread at most; ptxas -v: 64 and 64
#: registers, no spills; float32's 4 x 4 tile spilled 12 bytes while the rows' running maxima were registers, none
#: since they are in shared memory).
MIN_BLOCKS = {"float32": 4, "float64": 4}
#: The unsigned 32-bit conversion of the kernel's shared offsets (``numba.uint32``); in the simulator a plain ``int``,
#: the same value, since calling a Numba type from Python costs microseconds per offset there.
u32 = int if SIMULATOR else uint32
#: The same for the running shared offsets of the products' loads (``numba.uint64``; a plain ``int`` in the simulator).
u64 = int if SIMULATOR else uint64
#: The simulator's tiles (4 threads a block, tiles of 4 rows by 2 keys: a key tile can be entirely masked).
SIMULATOR_GEOMETRY = {dt: Geometry(TX=2, TY=2, RQ=2, RK=1, D_CHUNK=4, COLS=4, V_CHUNK=2) for dt in GPU_GEOMETRY}
#: The tiles the launches use (a test may switch the simulator to :data:`GPU_GEOMETRY`).
GEOMETRY = SIMULATOR_GEOMETRY if SIMULATOR else GPU_GEOMETRY


def _flash_signature(f):
    # q, k, v, out flattened (C order), row_max [BH N_q]; then BH, N_q, N_k, d, d_v; then the packed sequences' offsets
    # cu [S + 1] and their query tiles' ends [S] (S = 0: BH sequences of N_q rows)
    return (f[::1], f[::1], f[::1], f, boolean, f[::1], f[::1], int64, int64, int64, int64, int64, int64[::1], int64[::1], int64)


def _build_flash_forward(g: Geometry, f=None):
    """:func:`_flash_forward` compiled for the tiles ``g`` (its sizes are compile-time constants).

    On a GPU (``f`` the Numba float type the tiles are for) it is registered
    for ``f`` alone, with launch bounds of :data:`MIN_BLOCKS` resident blocks
    (so ptxas keeps the registers within what that occupancy allows); in the
    simulator (``f`` None) for both types, without bounds.
    """
    options = None if f is None else {"launch_bounds": (g.threads, MIN_BLOCKS[str(f)])}
    dtypes = None if f is None else (f,)
    TX, TY, RQ, RK, D_CHUNK, COLS, V_CHUNK = g
    TILE_Q, TILE_K, THREADS = g.tile_q, g.tile_k, g.threads
    KP = max(D_CHUNK, TILE_Q)
    # rows padded by 16 bytes on a GPU (a thread's RQ rows and RK keys stay 16-byte aligned: 128-bit loads), by one
    # entry in the simulator
    PAD = 1 if f is None else 16 // np.dtype(str(f)).itemsize
    ALIGN = None if f is None else 16
    QW, KW = TILE_Q + PAD, TILE_K + PAD  # padded rows
    SH_Q, SH_KP, SH_V = D_CHUNK * QW, KP * KW, TILE_K * V_CHUNK  # the flat shared arrays' sizes
    M2 = 2 * TILE_Q
    STEP_D, STEP_K = min(4, D_CHUNK), min(4, TILE_K)  # coordinates, keys per unrolled step of the two products
    G = COLS // TX  # accumulated columns per row and thread
    GC = V_CHUNK // TX  # of them in one staged value chunk
    N_CHUNKS = COLS // V_CHUNK
    D_SHIFT, V_SHIFT, TX_SHIFT = D_CHUNK.bit_length() - 1, V_CHUNK.bit_length() - 1, TX.bit_length() - 1

    # scores = q @ k.T; scores *= scale; scores[triu(k=1)] = -inf when causal; p = softmax(scores, axis=1); out = p @ v
    # (refimpl.attention.softmax_attention_forward), by the online softmax of the module docstring:
    #     m' = max(m, max_j s_ij),  l' = e^{m - m'} l + sum_j e^{s_ij - m'},  acc' = e^{m - m'} acc + sum_j e^{s_ij - m'} v_j.
    # Block (work item w = (query tile, column group) on grid x, sequence b on grid y, z) of TY x TX threads,
    # t = ty TX + tx; thread (ty, tx) owns the rows r = ty RQ + i (i < RQ) of the tile, the keys tx RK + j (j < RK) of
    # each key tile, the columns c0 + V_CHUNK h + tx GC + g (h < N_CHUNKS, g < GC).  Registers: s [RQ, RK],
    # acc [RQ, G], l [RQ] (partial: over this thread's keys only, summed over the TX threads of the row at the end).
    # Shared: qT [D_CHUNK, TILE_Q + PAD] (q^T, resident for d <= D_CHUNK), kp [max(D_CHUNK, TILE_Q), TILE_K + PAD]
    # (k^T of the key tile, then the scores S and the weights P), vs [TILE_K, V_CHUNK] (a value chunk),
    # red [TILE_Q, TX] (per-thread row maxima, then partial sums), mrow [2, TILE_Q] (the rows' running maxima m).
    # The rows of qT and kp are padded by 16 bytes on a GPU, so that a thread's RQ rows of q^T and RK keys of k^T are
    # one 128-bit load each (4 floats, 2 doubles; the transposing stores, consecutive threads on consecutive
    # coordinates, then meet 4-way bank conflicts in float32, against the loads' 64 coordinates a tile).  The arrays
    # come flat (C order): a flat index holds fewer registers than a 3-D one.
    # The kernel's code that runs once a block, not once a key tile, is in device functions of its own, inlined (the
    # loops of the two products compile to the same code as written in line), so that benchmarks/gpu_model.py counts
    # each as often as it runs (gpu.work.KERNELS): the block's place, the packed call's search for its sequence, the
    # start of its rows, q's staging and the rows' results.
    device = _primitives.inliner(f is None)

    # the block's query tile, column group and sequence's first rows (the thread's offsets, which the compiler may
    # recompute inside the key tiles' loop, are the kernel's own)
    def place(b, w, N_q, N_k, d_v):
        n_cg = max(1, (d_v + COLS - 1) // COLS)
        tile = w // n_cg
        c0 = (w % n_cg) * COLS
        q_row = b * N_q  # the sequence's first query row, and its first key row (of k and v alike)
        k_row = b * N_k
        return tile, c0, q_row, k_row

    # packed: b is a head of N_q = T rows; the block's sequence s is the first whose query tiles end past its tile
    # (bisection over tile_end, empty sequences own no tile), its rows cu[s]:cu[s + 1], its keys the same
    def locate(tile, q_row, cu, tile_end, S):
        lo = 0
        hi = S - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if tile_end[mid] > tile:
                hi = mid
            else:
                lo = mid + 1
        if lo > 0:
            tile -= tile_end[lo - 1]
        return tile, q_row + cu[lo], cu[lo + 1] - cu[lo]

    # the rows' running maxima (-inf), sums and accumulators (0); returns the tile's first row and its keys' end
    def start(mrow, l_run, acc, tx, oq, tile, N_q, N_k, causal):
        n_qt = (N_q + TILE_Q - 1) // TILE_Q
        q0 = (n_qt - 1 - tile) * TILE_Q  # the last query tiles (the most keys when causal) first
        if tx == 0:
            for i in range(RQ):
                mrow[oq + u32(i)] = mrow.dtype.type(-math.inf)
        for i in range(RQ):
            l_run[i] = l_run.dtype.type(0.0)
            for gg in range(G):
                acc[i, gg] = acc.dtype.type(0.0)
        # causal: the rows < q0 + TILE_Q see the keys < q0 + TILE_Q only (N_q == N_k)
        return q0, (min(N_k, q0 + TILE_Q) if causal else N_k)

    # qT[c, r] = q[q0 + r, d0 + c], read along c (coalesced)
    def stage_q(q, qT, t, q0, q_row, N_q, d, d0, dn):
        for e in range(t, TILE_Q * D_CHUNK, THREADS):
            r = u32(e >> u32(D_SHIFT))
            c = u32(e & u32(D_CHUNK - 1))
            ok_q = q0 + r < N_q and c < dn
            qT[u32(c * u32(QW) + r)] = q[(q_row + q0 + r) * d + d0 + c] if ok_q else qT.dtype.type(0.0)

    # out = acc / l, l the row's TX partial sums in order; the row maximum (NaN kept) for the check
    def finish(out, row_max_out, red, mrow, acc, q0, oq, q_row, N_q, c0, ov, d_v, mb, tx):
        for i in range(RQ):
            row = q0 + oq + i
            if row < N_q:
                l = row_sum(red, oq + u32(i), TX)
                for h in range(N_CHUNKS):
                    for gg in range(GC):
                        col = c0 + h * V_CHUNK + ov + gg
                        if col < d_v:
                            out[(q_row + row) * d_v + col] = acc[i, h * GC + gg] / l
                if tx == 0 and c0 == 0:
                    row_max_out[q_row + row] = mrow[mb + oq + u32(i)]

    place, locate, start, stage_q, finish = (device(fn) for fn in (place, locate, start, stage_q, finish))

    @kernel(_flash_signature, threads=g.threads, tags=("attention",), options=options, dtypes=dtypes)
    def _flash_forward(q, k, v, scale, causal, out, row_max_out, BH, N_q, N_k, d, d_v, cu, tile_end, S):
        dt = q.dtype
        qT = cuda.shared.array(SH_Q, dtype=dt, alignment=ALIGN)  # [D_CHUNK, QW], flat
        kp = cuda.shared.array(SH_KP, dtype=dt, alignment=ALIGN)  # [KP, KW], flat
        vs = cuda.shared.array(SH_V, dtype=dt, alignment=ALIGN)  # [TILE_K, V_CHUNK], flat
        red = cuda.shared.array((TILE_Q, TX), dtype=dt)
        mrow = cuda.shared.array(M2, dtype=dt)  # [2, TILE_Q]: the rows' running maxima, before and after a key tile
        s = cuda.local.array((RQ, RK), dtype=dt)
        acc = cuda.local.array((RQ, G), dtype=dt)
        l_run = cuda.local.array(RQ, dtype=dt)
        qv = cuda.local.array(RQ, dtype=dt)
        kv = cuda.local.array(RK, dtype=dt)
        pv = cuda.local.array(RQ, dtype=dt)
        zero = dt.type(0.0)
        neg_inf = dt.type(-math.inf)
        b = cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z
        if b >= BH:
            return
        # shared offsets are unsigned 32-bit: below KP KW (a few thousand), bounded by the geometry, and unsigned
        # indices skip Numba's negative-index wraparound (the signed 64-bit index arithmetic of 2-D shared arrays)
        t = u32(cuda.threadIdx.x)
        tx = u32(t & u32(TX - 1))
        ty = u32(t >> u32(TX_SHIFT))
        oq = u32(ty * u32(RQ))  # the thread's first row in a row of qT, and its rows' first entries in S and P
        ok = u32(tx * u32(RK))  # its first key in a row of k^T (kp), S and P
        op = u32(oq * u32(KW))
        ov = u32(tx * u32(GC))  # its first value column in a row of vs
        tile, c0, q_row, k_row = place(b, cuda.blockIdx.x, N_q, N_k, d_v)
        if S > 0:
            tile, q_row, N_q = locate(tile, q_row, cu, tile_end, S)
            k_row = q_row
            N_k = N_q
        resident = d <= D_CHUNK
        # the running maxima live in shared memory (the same on the TX threads of a row), in two halves: a key tile
        # reads the half at mb and its lane tx = 0 writes the other, which the next tile reads (barriers between)
        mb = u32(0)
        q0, k_end = start(mrow, l_run, acc, tx, oq, tile, N_q, N_k, causal)
        for k0 in range(0, k_end, TILE_K):
            # s_ij = sum_c q_ic k_jc, D_CHUNK coordinates at a time (q^T stays when d <= D_CHUNK)
            for i in range(RQ):
                for j in range(RK):
                    s[i, j] = zero
            for d0 in range(0, d, D_CHUNK):
                dn = u32(min(D_CHUNK, d - d0))
                if k0 == 0 or not resident:
                    stage_q(q, qT, t, q0, q_row, N_q, d, d0, dn)
                # kp[c, j] = k[k0 + j, d0 + c]
                for e in range(t, TILE_K * D_CHUNK, THREADS):
                    j = u32(e >> u32(D_SHIFT))
                    c = u32(e & u32(D_CHUNK - 1))
                    ok_k = k0 + j < N_k and c < dn
                    kp[u32(c * u32(KW) + j)] = k[(k_row + k0 + j) * d + d0 + c] if ok_k else zero
                cuda.syncthreads()
                # per coordinate RQ + RK shared loads at constant offsets from two registers (64-bit, so that the
                # unrolled steps' offsets fold into the loads), STEP_D coordinates a step: the coordinates from dn to
                # the next multiple of STEP_D are staged as zeros and add exact zeros
                aq = u64(oq)
                ak = u64(ok)
                for _ in range((dn + u32(STEP_D - 1)) // u32(STEP_D)):
                    for c in range(STEP_D):
                        for i in range(RQ):
                            qv[i] = qT[aq + u64(c * QW + i)]
                        for j in range(RK):
                            kv[j] = kp[ak + u64(c * KW + j)]
                        for i in range(RQ):
                            for j in range(RK):
                                s[i, j] += qv[i] * kv[j]
                    aq += u64(STEP_D * QW)
                    ak += u64(STEP_D * KW)
                cuda.syncthreads()
            # scale, mask (j > i when causal, and past the ends) into S[r, j] (kp, free after the barrier above), and
            # this thread's maximum of each row
            for i in range(RQ):
                r = u32(oq + u32(i))
                mx = neg_inf
                for j in range(RK):
                    col = k0 + ok + j
                    x = s[i, j] * scale
                    if col >= N_k or q0 + r >= N_q or (causal and col > q0 + r):
                        x = neg_inf
                    kp[u32(u32(op + u32(i * KW + j)) + ok)] = x
                    mx = max_keep_nan(mx, x)
                red[r, tx] = mx
            cuda.syncthreads()
            # m' = max(m, the row's TX partial maxima, in order): the same bits on the TX threads of the row;
            # p_ij = e^{s_ij - m'} over S[r, j] in place (the entries this thread wrote): P; l and acc rescaled by
            # e^{m - m'} (0, not NaN, while the row is all -inf: exp_shifted)
            for i in range(RQ):
                r = u32(oq + u32(i))
                m_old = mrow[mb + r]
                m_new = max_keep_nan(m_old, row_max(red, r, TX))
                factor = exp_shifted(m_old, m_new)
                if tx == 0:
                    mrow[u32(TILE_Q) - mb + r] = m_new
                part = zero
                for j in range(RK):
                    at = u32(u32(op + u32(i * KW + j)) + ok)
                    p = exp_shifted(kp[at], m_new)
                    part += p
                    kp[at] = p
                l_run[i] = l_run[i] * factor + part
                for gg in range(G):
                    acc[i, gg] *= factor
            # acc += P V, V_CHUNK columns at a time
            kn = u32(min(TILE_K, N_k - k0))
            for h in range(N_CHUNKS):
                v0 = c0 + h * V_CHUNK
                if h == 0 or v0 < d_v:  # the first chunk always (its barriers order P's writes and reads)
                    for e in range(t, TILE_K * V_CHUNK, THREADS):
                        j = u32(e >> u32(V_SHIFT))
                        c = u32(e & u32(V_CHUNK - 1))
                        ok_v = k0 + j < N_k and v0 + c < d_v
                        vs[u32(j * u32(V_CHUNK) + c)] = v[(k_row + k0 + j) * d_v + v0 + c] if ok_v else zero
                    cuda.syncthreads()
                    # per key RQ + GC shared loads at constant offsets from two registers, STEP_K keys a step: the
                    # keys from kn to the next multiple of STEP_K have zero weights and zero values
                    ap = u64(op)
                    av = u64(ov)
                    for _ in range((kn + u32(STEP_K - 1)) // u32(STEP_K)):
                        for j in range(STEP_K):
                            for i in range(RQ):
                                pv[i] = kp[ap + u64(i * KW + j)]
                            for gg in range(GC):
                                vj = vs[av + u64(j * V_CHUNK + gg)]
                                for i in range(RQ):
                                    acc[i, h * GC + gg] += pv[i] * vj
                        ap += u64(STEP_K)
                        av += u64(STEP_K * V_CHUNK)
                    cuda.syncthreads()
            mb = u32(u32(TILE_Q) - mb)  # the half this tile wrote
        # l = the row's TX partial sums, in order; out = acc / l; the row maximum (NaN kept) for the check
        for i in range(RQ):
            red[oq + u32(i), tx] = l_run[i]
        cuda.syncthreads()
        finish(out, row_max_out, red, mrow, acc, q0, oq, q_row, N_q, c0, ov, d_v, mb, tx)

    return _flash_forward


def _check_geometry(g: Geometry, itemsize: int) -> None:
    for value in g:
        assert value > 0 and value & (value - 1) == 0, g
    assert g.COLS % g.V_CHUNK == 0 and g.V_CHUNK % g.TX == 0 and g.threads <= MAX_THREADS, g
    assert g.shared_bytes(itemsize) <= 48 * 1024, (g, g.shared_bytes(itemsize))


_FLASH = {}


def _flash_kernel(dtype):
    """The kernel for the tiles ``GEOMETRY[dtype]``, built once per geometry (and float type, on a GPU)."""
    dtype = np.dtype(dtype)
    g = GEOMETRY[dtype]
    key = g if SIMULATOR else (g, dtype)
    if key not in _FLASH:
        _check_geometry(g, dtype.itemsize)
        _FLASH[key] = _build_flash_forward(g, None if SIMULATOR else numba_type(dtype))
    return _FLASH[key]


def launch_geometry(BH: int, N_q: int, d_v: int, dtype, tiles: int | None = None) -> tuple:
    """``(grid, block)`` of :func:`_flash_forward` for ``BH`` sequences of ``N_q`` queries and ``d_v`` value columns.

    A pure function of the shapes: grid ``x`` counts (query tile, column
    group) pairs up to ``2^31 - 1``, ``y`` and ``z`` the sequences up to
    65,535 each (:func:`~gpu.numba_cuda._primitives.sequence_axes`; blocks
    past the last sequence return at once); a shape beyond them (``N_q``
    over about ``2^37``) is refused.  ``block`` is ``(TX TY,)`` threads, at
    most 1,024.  A packed call gives ``tiles``, the query tiles of all its
    sequences together (:func:`packed_tiles`): grid ``x`` counts those by
    column group, ``y`` and ``z`` the ``BH`` heads.
    """
    g = GEOMETRY[np.dtype(dtype)]
    work = (blocks(N_q, g.tile_q) if tiles is None else max(1, tiles)) * blocks(d_v, g.COLS)
    y, z = sequence_axes(BH)
    if work > MAX_GRID_X or y * z < BH:
        raise ValueError(f"softmax_attention: {BH} sequences of {N_q} queries exceed the grid's limits")
    return (work, y, z), (g.threads,)


# The GPU's kernels, built (and registered for the PTX check) when the module is imported for a GPU.
if not SIMULATOR:
    for _dt in (np.float64, np.float32):
        _flash_kernel(_dt)


def packed_tiles(cu_seqlens, dtype) -> np.ndarray:
    """The end of each packed sequence's query tiles, int64 ``(S,)``: the running sum of ``ceil(n_s / TILE_Q)``.

    Tile ``w`` of a packed launch belongs to the first sequence ``s`` with
    ``ends[s] > w`` (an empty sequence owns none), the ``w - ends[s - 1]``-th
    of its own.
    """
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    return np.cumsum(-(-lengths // GEOMETRY[np.dtype(dtype)].tile_q), dtype=np.int64)


def attention_device(q, k, v, scale, causal, cu_seqlens=None):
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
    cu_seqlens : ndarray, shape (S + 1,), optional
        int64 offsets of ``S`` packed sequences along ``N_q == N_k`` (on the
        host): rows ``cu_seqlens[s]:cu_seqlens[s + 1]`` of every head are
        sequence ``s``, computed as on its own (its queries see its keys
        only), all in the same launch.

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
    if cu_seqlens is None:
        cu = ends = cuda.device_array(0, dtype=np.int64)  # no packed sequences (S = 0): empty, never read
        S, tiles = 0, None
    else:
        ends = packed_tiles(cu_seqlens, dtype)
        S, tiles = len(ends), int(ends[-1])
        cu, ends = cuda.to_device(np.asarray(cu_seqlens, dtype=np.int64)), cuda.to_device(ends)
    grid, block = launch_geometry(BH, N_q, d_v, dtype, tiles)
    N_k, d = k.shape[1], q.shape[2]
    fq, fk, fv, fo, fm = (a.reshape(a.size) for a in (q, k, v, out, row_max))
    _flash_kernel(dtype)[grid, block](fq, fk, fv, dtype.type(scale), bool(causal), fo, fm, BH, N_q, N_k, d, d_v, cu, ends, S)
    return out, row_max


def _softmax_attention_kernel(xp, checked, given):
    """:func:`refimpl.attention.softmax_attention` on refimpl's checked arguments: the tiled online softmax on the device."""
    q, k, v = given
    on_device = any_device(q, k, v)
    qh, kh, vh, scale, causal, batch_shape = checked
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


def _packed_softmax_attention_kernel(xp, checked, given, offsets):
    """A packed call (``cu_seqlens``) in one launch: refimpl's checked arguments (heads first) and the checked offsets.

    Every (head, sequence) pair runs in the launch of :func:`attention_device`,
    each as on its own; the result is laid back in the packed rows.  A score
    overflow, or a batch with no token, is left to the per-sequence loop
    (``NotImplemented``), which words the reference's error for the
    sequence's own rows.
    """
    qh, kh, vh, scale, causal, batch_shape = checked
    (T, d), d_v = qh.shape[-2:], vh.shape[-1]
    H = int(np.prod(batch_shape, dtype=np.int64))
    if T == 0:
        return NotImplemented
    dtype = qh.dtype
    q, k, v = (to_device(a, dtype).reshape(H, T, a.shape[-1]) for a in (qh, kh, vh))
    out, row_max = attention_device(q, k, v, scale, causal, cu_seqlens=offsets)
    checks = Checks(dtype)
    checks.finite(row_max, "row_max")
    if checks.fetch().failed("row_max"):
        return NotImplemented
    out = out.copy_to_host()
    # (H, T, d_v) back to the packed rows (T, H, d_v), or (T, d_v)
    return np.ascontiguousarray(out.transpose(1, 0, 2)) if batch_shape else out.reshape(T, d_v)


#: softmax_attention bound to refimpl's boundary, which writes its signature, docstring and checks once.
_KERNELS = {"softmax_attention": _softmax_attention_kernel, "packed softmax_attention": _packed_softmax_attention_kernel}
softmax_attention = boundary.bind(backend(_KERNELS), module=__name__).softmax_attention
