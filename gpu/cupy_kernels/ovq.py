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

Launch plan
-----------
Once per call: ``q^, k^`` of every row (``ovq.cu``, ``ovq_unit_rows_*``),
and every chunk's sizes (``n``, ``t``, ``n'``) and, for ``init="random"``,
every chunk's seeds drawn on the host and uploaded together.  Then per chunk
``[s, e)``, ``L = e - s`` keys, three launches and nothing else (no cuBLAS
call, no CuPy routine, no sync):

1. ``ovq_chunk_*``: the read-out (one warp per query row: the logits
   against ``D_k[:n]`` and the chunk's keys ``b <= a``, ``beta`` and
   ``log c``, an online softmax, the row maximum for the overflow check,
   ``o_a`` from ``[D_v[:n]; v]``) and, in other blocks of the same launch,
   the assignment (one warp per key: the nearest centroid, np.argmax's
   first maximum, and its similarity);
2. ``ovq_seed_*`` (when the dictionary grows): one thread per key, its
   stable rank among the scores, or its place among the drawn seeds;
3. ``ovq_update_*``: both dictionaries at once, one thread per entry walking
   the chunk in token order (the seeds, then the running mean or the
   constant-rate steps), the new counts into a second buffer.  The products
   are rounded as in refimpl (no fused multiply-add): refimpl's arithmetic.

After the last chunk the overflowed rows are counted into the call's checks,
which are copied to the host once.

VQ attention: per chunk the same kernel assigns the keys to the codebook
(launch 1), then reads out over the codes (bias ``log L_m``) and the chunk
through its codes (launch 2), and the update kernel keeps the running means
of the values (launch 3).

With ``xp = numpy`` (the ``*_xp`` functions) each kernel is replaced by its
NumPy twin, which is refimpl's arithmetic: the results equal
:mod:`refimpl.ovq` bit for bit.
"""

from __future__ import annotations

import numpy as np

from refimpl import boundary, gmm, numerics, validation
from refimpl import ovq as ref_ovq

from ._backend import Checks, RawModuleSource, as_module_array, backend, is_device_array, launch, result, to_host

__all__ = ["ovq_attention", "vq_attention"]

_CU = RawModuleSource("ovq.cu", headers=("rows.cuh",))

#: Rows per block of the chunk kernel: one warp (32 threads) per query or key row.
ROWS_PER_BLOCK = 8
#: Threads per block of the one-dimensional kernels (unit rows, seeding, update).
FLAT = 256


def _suffix(dtype) -> str:
    return "f32" if np.dtype(dtype) == np.float32 else "f64"


# ---------------------------------------------------------------------------
# Kernels and their NumPy twins
# ---------------------------------------------------------------------------


def readout_rows(xp, t, bias, beta, n, row_max):
    """NumPy twin of the read-out, in place: ``t (L, n + L)`` (raw dot products) becomes the softmax of the chunk's logits.

    ``l = beta t``, plus ``bias (n,)`` on the first ``n`` columns when
    ``bias`` is not None, ``-inf`` on the chunk's columns ``n + b`` with
    ``b > a`` (row ``a``); ``row_max (L,)`` receives each row's largest
    logit (NaN when one is NaN).  The device computes the same in
    ``ovq_chunk_*``.
    """
    L = t.shape[0]
    f = t.dtype.type
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


def _constant_rate_twin(D, x, assign, eta):
    # D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order
    eta = D.dtype.type(eta)
    for i in np.flatnonzero(assign >= 0):
        m = assign[i]
        D[m] = D[m] + eta * (x[i] - D[m])


def update_rows(xp, D, x, assign, counts, eta):
    """NumPy twin of the update, in place: fold the rows of ``x (L, W)`` into the rows ``assign`` of ``D (n_rows, W)``, in token order.

    ``assign (L,)`` int64, ``-1`` for a row that is not merged (a seed);
    ``counts (n_rows,)`` int64, the counts before the merge (not changed).
    ``eta`` None: the running mean ``(c D + sum_S x) / (c + |S|)``; a
    number: the steps ``D += eta (x_i - D)``.  Returns the counts after the
    merge, ``c + |S|`` (a new array).  The device computes the same in
    ``ovq_update_*``.
    """
    n_rows = D.shape[0]
    keep = assign >= 0
    if eta is None:
        # exact running mean: (c D + sum_S x) / (c + |S|), sums in token order
        D[...], new_counts = gmm.running_mean_update(D, counts, x[keep], assign[keep])
        return new_counts
    _constant_rate_twin(D, x, assign, eta)
    return counts + np.bincount(assign[keep], minlength=n_rows)


def unit_rows_xp(xp, x):
    """``x / max(||x||, 1e-12)`` row by row (:func:`refimpl.ovq.unit_rows`), with ``xp``."""
    norms = xp.sqrt(xp.sum(x * x, axis=1))
    # x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
    return x / xp.maximum(norms, norms.dtype.type(ref_ovq.NORM_EPS))[:, None]


def unit_rows(xp, q, k):
    """Fused: ``(q^, k^)``, the unit rows of ``q`` and ``k`` (N, d) in one launch."""
    N, d = q.shape
    qhat, khat = xp.empty_like(q), xp.empty_like(k)

    def twin():
        qhat[...], khat[...] = unit_rows_xp(np, q), unit_rows_xp(np, k)

    launch(_CU, f"ovq_unit_rows_{_suffix(q.dtype)}", (max(1, min(1024, -(-2 * N // FLAT))),), (FLAT,),
           (q, k, qhat, khat, np.int64(N), np.int32(d), q.dtype.type(ref_ovq.NORM_EPS)), twin)
    return qhat, khat


# ---------------------------------------------------------------------------
# Cores
# ---------------------------------------------------------------------------


def _tokens(xp, arrays, checked, names, dtype, checks):
    """The token arrays on ``xp``: device arrays counted into ``checks`` when not finite, host arrays as the checker returned them."""
    out = []
    for a, h, name in zip(arrays, checked, names):
        if is_device_array(a):
            a = as_module_array(xp, a, dtype)
            checks.count_bad(a, name)
            out.append(a)
        else:
            out.append(as_module_array(xp, h, dtype))
    return out


def _raise_bad_tokens(checks, arrays, names):
    """After the one copy: refimpl's error for the first token array with non-finite entries (a copy to word it)."""
    for a, name in zip(arrays, names):
        if checks.failed(name):
            validation.check_finite(to_host(a), name)


class _Chunk:
    """One chunk of the host plan: its first token ``s``, its length ``L``, the sizes ``n, n'`` and ``t`` before it."""

    __slots__ = ("s", "L", "n", "n_next", "t", "draw")

    def __init__(self, s, L, n, n_next, t, draw):
        self.s, self.L, self.n, self.n_next, self.t, self.draw = s, L, n, n_next, t, draw


def _plan(N, p, n, t):
    """Every chunk's sizes, known on the host before the first launch, and the seeds ``init="random"`` draws."""
    chunks, draws, offset = [], [], 0
    for s in range(0, N, p.chunk_size):
        L = min(s + p.chunk_size, N) - s
        # grow: n' = max(n, growth(t + L, n_max))
        n_next = max(n, ref_ovq.dictionary_size(t + L, p.max_size, p.growth))
        draw = -1
        if n and n_next > n and p.init == "random":
            # refimpl's generator on the host: the same draw for the same (seed, t)
            rng = np.random.default_rng([p.seed, t])
            draws.append(rng.choice(L, size=n_next - n, replace=False).astype(np.int64))
            draw, offset = offset, offset + n_next - n
        chunks.append(_Chunk(s, L, n, n_next, t, draw))
        n, t = n_next, t + L
    return chunks, (np.concatenate(draws) if draws else np.zeros(1, np.int64))


def _chunk_launch(xp, st, c, read, assign, first, dict_keys, n_dict, z=None):
    """Launch 1 of chunk ``c``: the read-out of its query rows (``read``) and the assignment of its keys (``assign``)."""
    L, n, s = c.L, c.n, c.s
    f = st.dtype.type
    indirect = z is not None
    use_bias = bool(st.count_bias and n > 0)

    def twin():
        qa, ka = st.qhat[s : s + L], st.khat[s : s + L]
        if read:
            log_c = None
            if use_bias:
                with np.errstate(divide="ignore"):
                    # log c (VQ: log L_m, -inf for codes no earlier chunk used)
                    log_c = np.log(st.counts[:n].astype(st.dtype))
            with np.errstate(over="ignore", invalid="ignore"):
                if indirect:
                    # past: q^ . D_k[m] (+ log L_m); current: q^_a . D_k[z_b], b <= a
                    raw = np.concatenate([qa @ st.Dk[:n].T, qa @ st.Dk[z[:L]].T], axis=1)
                    P = readout_rows(np, raw, log_c, st.beta, n, st.row_max[s : s + L])
                    st.out[s : s + L] = P[:, :n] @ st.Dv[:n] + P[:, n:] @ st.v[s : s + L]
                else:
                    keys = np.concatenate([st.Dk[:n], ka]) if n else ka
                    P = readout_rows(np, qa @ keys.T, log_c, st.beta, n, st.row_max[s : s + L])
                    values = np.concatenate([st.Dv[:n], st.v[s : s + L]]) if n else st.v[s : s + L]
                    st.out[s : s + L] = P @ values
        if assign:
            st.seeded[:L] = 0
            if first:
                # first chunk: every key joins centroid 0; scores against k^_0 (for the seeds)
                st.rows[:L] = 0
                st.scores[1:L] = ka[1:] @ ka[0]
                st.scores[0] = 0
            else:
                sims = ka @ dict_keys[:n_dict].T  # (L, n)
                # nearest centroid by dot product; argmax returns the first maximum (lowest index)
                st.rows[:L] = np.argmax(sims, axis=1)
                st.scores[:L] = sims[np.arange(L), st.rows[:L]]

    read_blocks = -(-L // ROWS_PER_BLOCK) if read else 0
    assign_blocks = -(-L // ROWS_PER_BLOCK) if assign else 0
    launch(_CU, f"ovq_chunk_{_suffix(st.dtype)}", (read_blocks + assign_blocks,), (32, ROWS_PER_BLOCK), (
        st.qhat, st.khat, st.v, st.Dk, st.Dv, st.counts, st.rows if z is None else z, np.int32(indirect), np.int64(s),
        np.int32(L), np.int32(n), np.int32(st.qhat.shape[1]), np.int32(st.v.shape[1]), f(st.beta), np.int32(use_bias),
        st.P, np.int64(st.P.shape[1]), st.out, st.row_max, np.int32(read_blocks),
        dict_keys, np.int32(n_dict), np.int32(first), st.rows, st.scores, st.seeded,
    ), twin)


def _seed_launch(xp, st, c, init, drawn):
    """Launch 2 of chunk ``c`` (when the dictionary grows): which keys seed rows ``n, n + 1, ...``."""
    L, n, n_add = c.L, c.n, c.n_next - c.n
    first = n == 0
    use_drawn = c.draw >= 0
    draw_at = max(c.draw, 0)

    def twin():
        if first:
            # key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed centroids 1.. in ascending order of
            # score (stable sort: ties -> lowest index)
            seeds = np.concatenate([[0], 1 + np.argsort(st.scores[1:L], kind="stable")[: n_add - 1]]).astype(np.int64)
        elif use_drawn:
            seeds = drawn[draw_at : draw_at + n_add]
        else:
            seeds = np.argsort(st.scores[:L], kind="stable")[:n_add]
        st.rows[seeds] = n + np.arange(seeds.size)
        st.seeded[seeds] = 1

    launch(_CU, f"ovq_seed_{_suffix(st.dtype)}", (-(-L // FLAT),), (FLAT,), (
        st.scores, np.int32(L), np.int32(n), np.int32(n_add), drawn[draw_at:], np.int32(use_drawn), np.int32(first),
        st.rows, st.seeded,
    ), twin)


def _update_launch(xp, st, c, eta, with_keys):
    """Launch 3 of chunk ``c``: the seeds and members of its keys folded into ``D_k`` (``with_keys``) and ``D_v``; new counts."""
    L, s = c.L, c.s
    n_rows = c.n_next
    d, dv = st.Dk.shape[1], st.Dv.shape[1]

    def twin():
        seeded = st.seeded[:L].astype(bool)
        rows = st.rows[:L]
        vc = st.v[s : s + L]
        counts = st.counts[:n_rows].copy()
        # a seeded centroid starts at its key and value with count 1; it is not merged
        if with_keys:
            st.Dk[rows[seeded]] = st.khat[s : s + L][seeded]
        st.Dv[rows[seeded]] = vc[seeded]
        counts[rows[seeded]] = 1
        assign = np.where(seeded, -1, rows)
        m = max(c.n, 1) if with_keys else n_rows  # the rows that take members (centroid 0 in the first chunk)
        with np.errstate(over="ignore", invalid="ignore"):
            if with_keys:
                update_rows(np, st.Dk[:m], st.khat[s : s + L], assign, counts[:m], eta)
            new = update_rows(np, st.Dv[:m], vc, assign, counts[:m], eta)
        st.counts_next[:n_rows] = counts
        st.counts_next[:m] = new

    work = n_rows * ((d if with_keys else 0) + dv)
    launch(_CU, f"ovq_update_{_suffix(st.dtype)}", (max(1, min(4096, -(-work // FLAT))),), (FLAT,), (
        st.khat, st.v, np.int64(s), np.int32(L), st.rows, st.seeded, st.Dk, st.Dv, np.int32(d), np.int32(dv),
        st.counts, st.counts_next, np.int32(n_rows), st.dtype.type(0 if eta is None else eta), np.int32(eta is not None),
        np.int32(with_keys),
    ), twin)
    st.counts, st.counts_next = st.counts_next, st.counts


class _State:
    """The device arrays of one run: the unit rows, the dictionary, the two count buffers, the chunk's work arrays."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _ovq_run_xp(xp, q, k, v, p, state, dtype):
    """Core: ``(out, (D_k, D_v, c, n, t), row maxima (N,))`` on ``xp``; no raise, no sync."""
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
    chunks, drawn = _plan(N, p, n, t)
    Cm = min(C, N)
    qhat, khat = unit_rows(xp, q, k)
    st = _State(
        dtype=np.dtype(dtype), beta=p.beta, count_bias=p.count_bias, qhat=qhat, khat=khat, v=v, Dk=Dk, Dv=Dv,
        counts=counts, counts_next=counts.copy(), out=xp.empty((N, d_v), dtype=dtype), row_max=xp.empty(N, dtype=dtype),
        P=xp.empty((Cm, n_max + Cm), dtype=dtype), rows=xp.zeros(Cm, np.int64), scores=xp.zeros(Cm, dtype),
        seeded=xp.zeros(Cm, np.int64),
    )
    drawn = as_module_array(xp, drawn, np.int64)
    for c in chunks:
        first = c.n == 0
        # 1. predict, before the chunk touches the state; assign (the first chunk against k^_0)
        dict_keys = khat[c.s : c.s + 1] if first else Dk
        _chunk_launch(xp, st, c, True, True, first, dict_keys, 1 if first else c.n)
        # 2. seed the new rows
        if c.n_next > c.n:
            _seed_launch(xp, st, c, p.init, drawn)
        # 3. update
        _update_launch(xp, st, c, p.eta, True)
    n, t = (chunks[-1].n_next, chunks[-1].t + chunks[-1].L) if chunks else (n, t)
    return st.out, (Dk, Dv, st.counts, n, t), st.row_max


def _vq_run_xp(xp, q, k, v, codebook, C, beta):
    """Core of :func:`vq_attention`: ``(out, row maxima (N,))`` on ``xp``; no raise, no sync."""
    N, S, dtype = q.shape[0], codebook.shape[0], q.dtype
    Cm = min(C, N)
    qhat, khat = unit_rows(xp, q, k)
    counts = xp.zeros(S, dtype=np.int64)
    st = _State(
        dtype=np.dtype(dtype), beta=beta, count_bias=True, qhat=qhat, khat=khat, v=v, Dk=codebook,
        Dv=xp.zeros((S, v.shape[1]), dtype=dtype), counts=counts, counts_next=counts.copy(),
        out=xp.empty((N, v.shape[1]), dtype=dtype), row_max=xp.empty(N, dtype=dtype), P=xp.empty((Cm, S + Cm), dtype=dtype),
        rows=xp.zeros(Cm, np.int64), scores=xp.zeros(Cm, dtype), seeded=xp.zeros(Cm, np.int64),
    )
    for s in range(0, N, C):
        c = _Chunk(s, min(s + C, N) - s, S, S, 0, -1)
        # 1. nearest code by dot product; argmax takes the lowest index on ties
        _chunk_launch(xp, st, c, False, True, False, codebook, S)
        # 2. past codes (log L_m) and the current chunk through its codes
        _chunk_launch(xp, st, c, True, False, False, codebook, S, z=st.rows)
        # 3. U_m / L_m: running mean of the values each code summarises
        _update_launch(xp, st, c, None, False)
    return st.out, st.row_max


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _ovq_attention_kernel(xp, a, given, return_state):
    """:func:`refimpl.ovq.ovq_attention` on refimpl's checked arguments, computed with ``xp``: the checks, the core, the checks of the results."""
    q, k, v = given
    on_device = any(is_device_array(x) for x in given)
    checks = Checks(xp, ["q", "k", "v", "overflow"])
    inputs = (q, k, v)
    q, k, v = _tokens(xp, inputs, (a.q, a.k, a.v), ("q", "k", "v"), a.dtype, checks)
    out, (Dk, Dv, counts, n, t), row_max = _ovq_run_xp(xp, q, k, v, a.params, a.state, a.dtype)
    checks.count_bad(row_max, "overflow")
    # the one copy of the call: every check at once
    checks.fetch()
    _raise_bad_tokens(checks, inputs, ("q", "k", "v"))
    ref_ovq.check_overflow((checks.failed("overflow"), checks.first("overflow")), a.state, a.dtype)
    out = result(out, on_device)
    if not return_state:
        return out
    # the state a caller asked for: results, copied after the checks
    return out, ref_ovq.OVQState(*(result(a, False) for a in (Dk, Dv, counts)), n, t)


def _vq_attention_kernel(xp, a, given):
    """:func:`refimpl.ovq.vq_attention` on refimpl's checked arguments, computed with ``xp``."""
    q, k, v, codebook = given
    on_device = any(is_device_array(x) for x in given)
    dtype = a.codebook.dtype
    checks = Checks(xp, ["q", "k", "v", "overflow"])
    inputs = (q, k, v)
    q, k, v = _tokens(xp, inputs, (a.q, a.k, a.v), ("q", "k", "v"), dtype, checks)
    out, row_max = _vq_run_xp(xp, q, k, v, as_module_array(xp, a.codebook, dtype), a.chunk_size, a.beta)
    checks.count_bad(row_max, "overflow")
    # the one copy of the call: every check at once
    checks.fetch()
    _raise_bad_tokens(checks, inputs, ("q", "k", "v"))
    validation.check_overflowed_rows(checks.failed("overflow"), checks.first("overflow"), dtype, "beta, codebook",
                                     "lower beta or rescale the codebook")
    return result(out, on_device)


#: The public functions bound to refimpl's boundary, which writes their signatures, docstrings and checks once.
KERNELS = {"ovq_attention": _ovq_attention_kernel, "vq_attention": _vq_attention_kernel}
_public = boundary.bind(backend(KERNELS), module=__name__)
ovq_attention = _public.ovq_attention
vq_attention = _public.vq_attention
