r"""Online vector-quantized (OVQ) attention and the VQ baseline with CuPy: :func:`refimpl.ovq.ovq_attention`, :func:`refimpl.ovq.vq_attention`.

What it computes
----------------
What :mod:`refimpl.ovq` computes, with its conventions (its module docstring
fixes them): one head, one sequence, ``q, k (N, d)``, ``v (N, d_v)``;
chunk by chunk, the read-out of the chunk against the dictionary and the
chunk's own earlier keys, then growth, seeding (``init="random"`` draws on
the host with refimpl's generator, so the seeds are the same), assignment
and the update of the dictionary (running mean or constant rate, in token
order).  The state (``D_k``, ``D_v``, the counts) stays on the device from
the first chunk to the last; every size the plan needs (``n``, ``t``,
``n' = max(n, growth(t + L))``) is known on the host, so chunks follow each
other without a synchronisation.  ``return_state`` gives a
:class:`refimpl.ovq.OVQState` of host arrays, and a state passed in continues
the stream.

Launch plan (per chunk ``[s, e)``, ``L = e - s`` keys)
------------------------------------------------------
1. ``q^, k^``: unit rows (array code: a row reduction and a division).
2. The read-out: one GEMM (``cupy.matmul``) ``q^ [D_k[:n]; k^]^T`` (L, n + L);
   one row kernel (``ovq.cu``, ``ovq_readout_rows_*``, one warp per row)
   scales by ``beta``, adds ``log c``, applies the causal step inside the
   chunk (keys ``b <= a``), keeps the row maximum for the overflow check and
   turns the row into its softmax in place; one GEMM with ``[D_v[:n]; v]``.
3. The plan: the similarities ``k^ D_k[:n]^T`` (one GEMM; ``k^ . k^_0`` in
   the first chunk), their argmax, and the seeds (a stable ``argsort`` of the
   scores, or refimpl's draw uploaded).
4. The update: the seeds' rows are set by array code; one kernel
   (``ovq_update_*``) per dictionary (keys, values) folds the chunk's rows
   into the rows they joined, each entry owned by one thread looping over
   the chunk in token order (the running mean, or the constant-rate steps);
   the kernel also writes the new counts.  The products are rounded as in refimpl (no
   fused multiply-add), so the update is refimpl's arithmetic bit for bit.

VQ attention: per chunk, the GEMMs ``k^ codebook^T`` (argmax: the codes),
``q^ codebook^T`` and ``q^ codebook[z]^T``, the same row kernel (bias
``log L_m``), two GEMMs for the read-out, and the update kernel for the
running means of the values.

With ``xp = numpy`` (the ``*_xp`` functions) each kernel is replaced by its
NumPy twin, which is refimpl's arithmetic: the results equal
:mod:`refimpl.ovq` bit for bit.
"""

from __future__ import annotations

import numpy as np

from refimpl import gmm, numerics, validation
from refimpl import ovq as ref_ovq

from ._backend import RawModuleSource, all_true, as_module_array, check_finite, device_module, host_view, is_device_array, result, to_host

__all__ = ["ovq_attention", "vq_attention"]

_CU = RawModuleSource("ovq.cu", headers=("rows.cuh",))

#: Rows per block of the read-out kernel: one warp (32 threads) per row.
ROWS_PER_BLOCK = 8
#: Block of the update kernel: 32 columns by 8 dictionary rows (``blockDim (32, 8)`` in ``ovq.cu``).
UPDATE_BLOCK = (32, 8)


def _suffix(dtype) -> str:
    return "f32" if np.dtype(dtype) == np.float32 else "f64"


# ---------------------------------------------------------------------------
# Kernels and their NumPy twins
# ---------------------------------------------------------------------------


def readout_rows(xp, t, bias, beta, n, row_max):
    """Fused, in place: ``t (L, n + L)`` (raw dot products) becomes the softmax of the chunk's logits.

    ``l = beta t``, plus ``bias (n,)`` on the first ``n`` columns when
    ``bias`` is not None, ``-inf`` on the chunk's columns ``n + b`` with
    ``b > a`` (row ``a``); ``row_max (L,)`` receives each row's largest
    logit (NaN when one is NaN).
    """
    L = t.shape[0]
    f = t.dtype.type
    if xp is np:
        # refimpl.ovq._chunk_logits, then numerics.softmax: logits *= beta; logits[:, :n] += log_c; mask; softmax
        with np.errstate(over="ignore", invalid="ignore"):
            t *= f(beta)
            if bias is not None and n:
                t[:, :n] += bias
        # causal inside the chunk: position a sees the chunk keys b <= a only
        t[:, n:][np.triu(np.ones((L, L), dtype=bool), k=1)] = -np.inf
        row_max[...] = np.max(t, axis=1)
        with np.errstate(invalid="ignore"):  # an overflowed row (refused by the caller) gives NaN, not a warning
            t[...] = numerics.softmax(t, axis=1)
        return t
    use_bias = bias is not None and n > 0
    bias = bias if use_bias else row_max  # not read without the bias
    fn = _CU.function(f"ovq_readout_rows_{_suffix(t.dtype)}")
    fn((-(-L // ROWS_PER_BLOCK),), (32, ROWS_PER_BLOCK), (t, bias, row_max, np.int32(L), np.int32(n), f(beta), np.int32(use_bias)))
    return t


def _constant_rate_twin(D, x, assign, eta):
    # D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order
    eta = D.dtype.type(eta)
    for i in np.flatnonzero(assign >= 0):
        m = assign[i]
        D[m] = D[m] + eta * (x[i] - D[m])


def update_rows(xp, D, x, assign, counts, eta):
    """Fused, in place: fold the rows of ``x (L, W)`` into the rows ``assign`` of ``D (n_rows, W)``, in token order.

    ``assign (L,)`` int64, ``-1`` for a row that is not merged (a seed);
    ``counts (n_rows,)`` int64, the counts before the merge (not changed).
    ``eta`` None: the running mean ``(c D + sum_S x) / (c + |S|)``; a
    number: the steps ``D += eta (x_i - D)``.  Returns the counts after the
    merge, ``c + |S|`` (a new array).
    """
    n_rows, W = D.shape
    L = x.shape[0]
    if xp is np:
        keep = assign >= 0
        if eta is None:
            # exact running mean: (c D + sum_S x) / (c + |S|), sums in token order
            D[...], new_counts = gmm.running_mean_update(D, counts, x[keep], assign[keep])
            return new_counts
        _constant_rate_twin(D, x, assign, eta)
        return counts + np.bincount(assign[keep], minlength=n_rows)
    new_counts = counts.copy()
    if L == 0 or n_rows == 0 or W == 0:
        return new_counts
    item = D.dtype.itemsize
    if D.strides[1] != item or x.strides[1] != item or not (assign.flags.c_contiguous and counts.flags.c_contiguous):
        raise ValueError("update_rows: D and x need contiguous rows, assign and counts contiguous entries")
    fn = _CU.function(f"ovq_update_{_suffix(D.dtype)}")
    bx, by = UPDATE_BLOCK
    grid = (-(-W // bx), -(-n_rows // by))
    f = D.dtype.type
    fn(grid, UPDATE_BLOCK, (
        D, np.int64(D.strides[0] // item), x, np.int64(x.strides[0] // item), assign, counts, new_counts,
        np.int32(L), np.int32(n_rows), np.int32(W), f(0 if eta is None else eta), np.int32(eta is not None),
    ))
    return new_counts


def unit_rows_xp(xp, x):
    """``x / max(||x||, 1e-12)`` row by row (:func:`refimpl.ovq.unit_rows`), with ``xp``."""
    norms = xp.sqrt(xp.sum(x * x, axis=1))
    # x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
    return x / xp.maximum(norms, norms.dtype.type(ref_ovq.NORM_EPS))[:, None]


# ---------------------------------------------------------------------------
# Cores
# ---------------------------------------------------------------------------


def _tokens(xp, arrays, checked, names, dtype):
    """The token arrays on ``xp``: device arrays checked for finite values, host arrays as the checker returned them."""
    out = []
    for a, h, name in zip(arrays, checked, names):
        if is_device_array(a):
            check_finite(a, name)
            out.append(as_module_array(xp, a, dtype))
        else:
            out.append(as_module_array(xp, h, dtype))
    return out


def _overflow(xp, row_max):
    """``(rows whose logits have no finite maximum, the first of them)``, one transfer when all are finite."""
    bad = ~xp.isfinite(row_max)
    if all_true(xp, ~bad):
        return 0, -1
    return int(bad.sum()), int(xp.argmax(bad))


def _plan(xp, khat, Dk, n, n_add, p, t):
    """Row each key of the chunk joins (``-1`` for the seeds) and the seeds in centroid order (refimpl.ovq._plan_chunk)."""
    L = khat.shape[0]
    if n == 0:
        # first chunk: key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed
        # centroids 1.. in ascending order of score (stable sort: ties -> lowest index)
        scores = xp.matmul(khat[1:], khat[0])
        seeds = xp.concatenate([xp.zeros(1, dtype=np.int64), 1 + xp.argsort(scores, kind="stable")[: n_add - 1]]).astype(np.int64)
        rows = xp.zeros(L, dtype=np.int64)
    else:
        sims = xp.matmul(khat, Dk[:n].T)  # (L, n)
        # nearest centroid by dot product; argmax returns the first maximum (lowest index)
        rows = xp.argmax(sims, axis=1).astype(np.int64)
        if n_add == 0:
            seeds = xp.empty(0, dtype=np.int64)
        elif p.init == "spread":
            scores = xp.take_along_axis(sims, rows[:, None], axis=1)[:, 0]
            seeds = xp.argsort(scores, kind="stable")[:n_add].astype(np.int64)
        else:
            # refimpl's generator on the host: the same draw for the same (seed, t)
            rng = np.random.default_rng([p.seed, t])
            seeds = xp.asarray(rng.choice(L, size=n_add, replace=False).astype(np.int64))
    rows[seeds] = -1  # a seeded centroid starts at its key and value with count 1; it is not merged
    return rows, seeds


def _ovq_run_xp(xp, q, k, v, p, state, dtype):
    """Core: ``(out, (D_k, D_v, c, n, t), row maxima (N,))`` on ``xp``; no raise."""
    N, d = q.shape
    d_v = v.shape[1]
    n_max, C = p.max_size, p.chunk_size
    if state is None:
        Dk, Dv, counts = xp.zeros((n_max, d), dtype), xp.zeros((n_max, d_v), dtype), xp.zeros(n_max, np.int64)
        n, t = 0, 0
    else:
        Dk, Dv = (as_module_array(xp, a, dtype).copy() for a in (state.keys, state.values))
        counts = as_module_array(xp, state.counts, np.int64).copy()
        n, t = state.size, state.tokens_seen
    out = xp.empty((N, d_v), dtype=dtype)
    row_max = xp.empty(N, dtype=dtype)
    for s in range(0, N, C):
        e = min(s + C, N)
        L = e - s
        qhat, khat = unit_rows_xp(xp, q[s:e]), unit_rows_xp(xp, k[s:e])
        vc = v[s:e]
        log_c = xp.log(counts[:n].astype(dtype)) if p.count_bias else None
        # predict, before the chunk touches the state
        keys = xp.concatenate([Dk[:n], khat]) if n else khat
        with np.errstate(over="ignore", invalid="ignore"):
            P = readout_rows(xp, xp.matmul(qhat, keys.T), log_c, p.beta, n, row_max[s:e])
            values = xp.concatenate([Dv[:n], vc]) if n else vc
            out[s:e] = xp.matmul(P, values)
        # grow: n' = max(n, growth(t + L, n_max))
        t_next = t + L
        n_next = max(n, ref_ovq.dictionary_size(t_next, n_max, p.growth))
        # assign and update
        rows, seeds = _plan(xp, khat, Dk, n, n_next - n, p, t)
        Dk[n:n_next] = khat[seeds]
        Dv[n:n_next] = vc[seeds]
        counts[n:n_next] = 1
        m = max(n, 1)  # the rows that take members: the dictionary (centroid 0 in the first chunk)
        with np.errstate(over="ignore", invalid="ignore"):
            update_rows(xp, Dk[:m], khat, rows, counts[:m], p.eta)
            counts[:m] = update_rows(xp, Dv[:m], vc, rows, counts[:m], p.eta)
        n, t = n_next, t_next
    return out, (Dk, Dv, counts, n, t), row_max


def _vq_run_xp(xp, q, k, v, codebook, C, beta):
    """Core of :func:`vq_attention`: ``(out, row maxima (N,))`` on ``xp``; no raise."""
    N, S, dtype = q.shape[0], codebook.shape[0], q.dtype
    value_means = xp.zeros((S, v.shape[1]), dtype=dtype)
    counts = xp.zeros(S, dtype=np.int64)
    out = xp.empty((N, v.shape[1]), dtype=dtype)
    row_max = xp.empty(N, dtype=dtype)
    for s in range(0, N, C):
        e = min(s + C, N)
        qhat, khat = unit_rows_xp(xp, q[s:e]), unit_rows_xp(xp, k[s:e])
        # nearest code by dot product; argmax takes the lowest index on ties
        z = xp.argmax(xp.matmul(khat, codebook.T), axis=1).astype(np.int64)
        with np.errstate(divide="ignore"):
            # log L_m: -inf for codes no earlier chunk used
            log_counts = xp.log(counts.astype(dtype))
        with np.errstate(over="ignore", invalid="ignore"):
            # past: q^ . D_k[m] (+ log L_m); current: q^_a . D_k[z_b], b <= a
            raw = xp.concatenate([xp.matmul(qhat, codebook.T), xp.matmul(qhat, codebook[z].T)], axis=1)
            P = readout_rows(xp, raw, log_counts, beta, S, row_max[s:e])
            out[s:e] = xp.matmul(P[:, :S], value_means) + xp.matmul(P[:, S:], v[s:e])
        # U_m / L_m: running mean of the values each code summarises
        with np.errstate(over="ignore", invalid="ignore"):
            counts = update_rows(xp, value_means, v[s:e], z, counts, None)
    return out, row_max


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def ovq_attention_xp(xp, q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread", count_bias=True,
                     learning_rate=None, seed=0, state=None, return_state=False):
    """:func:`ovq_attention` computed with the array module ``xp`` (NumPy or CuPy): the checks, the core, the checks of the results."""
    on_device = any(is_device_array(x) for x in (q, k, v))
    a = ref_ovq.check_ovq_arguments(
        host_view(q), host_view(k), host_view(v), max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state
    )
    return_state = validation.check_bool(return_state, "return_state")
    q, k, v = _tokens(xp, (q, k, v), (a.q, a.k, a.v), ("q", "k", "v"), a.dtype)
    out, (Dk, Dv, counts, n, t), row_max = _ovq_run_xp(xp, q, k, v, a.params, a.state, a.dtype)
    ref_ovq.check_overflow(_overflow(xp, row_max), a.state, a.dtype)
    out = result(out, on_device)
    if not return_state:
        return out
    return out, ref_ovq.OVQState(to_host(Dk), to_host(Dv), to_host(counts), n, t)


def vq_attention_xp(xp, q, k, v, codebook, *, chunk_size, beta=None):
    """:func:`vq_attention` computed with the array module ``xp``."""
    on_device = any(is_device_array(x) for x in (q, k, v, codebook))
    a = ref_ovq.check_vq_arguments(host_view(q), host_view(k), host_view(v), to_host(codebook), chunk_size, beta)
    dtype = a.codebook.dtype
    q, k, v = _tokens(xp, (q, k, v), (a.q, a.k, a.v), ("q", "k", "v"), dtype)
    out, row_max = _vq_run_xp(xp, q, k, v, as_module_array(xp, a.codebook, dtype), a.chunk_size, a.beta)
    validation.check_overflowed_rows(*_overflow(xp, row_max), dtype, "beta, codebook", "lower beta or rescale the codebook")
    return result(out, on_device)


def ovq_attention(q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread", count_bias=True,
                  learning_rate=None, seed=0, state=None, return_state=False):
    """Online vector-quantized attention, causal, chunk by chunk (:func:`refimpl.ovq.ovq_attention`).

    Parameters
    ----------
    q, k : array_like or cupy.ndarray, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like or cupy.ndarray, shape (N, d_v)
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
        similar to it, or drawn on the host with refimpl's generator
        ``np.random.default_rng([seed, t])``.
    count_bias : bool, default True
        Add ``log c`` to the centroid logits.
    learning_rate : float, optional
        ``None``: the adaptive ``1/c`` running mean; ``eta`` in ``(0, 1]``:
        the constant-step online k-means, token by token in token order.
    seed : int, default 0
        Seed of ``init="random"`` (>= 0).
    state : refimpl.ovq.OVQState, optional
        Continue a stream from this state (not modified).
    return_state : bool, default False
        Also return the state after the last chunk.

    Returns
    -------
    out : numpy.ndarray or cupy.ndarray, shape (N, d_v)
        A CuPy array when any of ``q, k, v`` is a device array, else NumPy;
        the dtype of the inputs (a float64 ``state`` makes it float64).
    state : refimpl.ovq.OVQState
        Only with ``return_state=True``: host arrays, a new object.

    Raises
    ------
    RuntimeError
        When CuPy has no usable device and the inputs are NumPy arrays.
    """
    xp = device_module(q, k, v)
    return ovq_attention_xp(
        xp, q, k, v, max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init, count_bias=count_bias,
        learning_rate=learning_rate, seed=seed, state=state, return_state=return_state,
    )


def vq_attention(q, k, v, codebook, *, chunk_size, beta=None):
    """VQ attention with a fixed key codebook (:func:`refimpl.ovq.vq_attention`).

    Parameters
    ----------
    q, k : array_like or cupy.ndarray, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like or cupy.ndarray, shape (N, d_v)
    codebook : array_like or cupy.ndarray, shape (S, d)
        The fixed key dictionary ``D_k`` (used as given, not normalised).
    chunk_size : int
        ``C`` (>= 1).
    beta : float, optional
        ``sqrt(d)`` by default.

    Returns
    -------
    numpy.ndarray or cupy.ndarray, shape (N, d_v)
        A CuPy array when any input is a device array, else NumPy.

    Raises
    ------
    RuntimeError
        When CuPy has no usable device and the inputs are NumPy arrays.
    """
    xp = device_module(q, k, v, codebook)
    return vq_attention_xp(xp, q, k, v, codebook, chunk_size=chunk_size, beta=beta)
