r"""Online vector-quantized (OVQ) attention and the static-dictionary VQ baseline.

One head, one sequence of :math:`N` tokens: ``q, k`` are ``(N, d)``, ``v`` is
``(N, d_v)`` (:func:`ovq_attention_forward` and its backward also take a batch
of independent sequences, ``(..., N, d)``, each from its own empty state).  The state is a key dictionary :math:`D_k` ``(n_max, d)``, a
value dictionary :math:`D_v` ``(n_max, d_v)``, integer counts :math:`c`
``(n_max,)``, the number :math:`n \le n_{\max}` of active rows and the number
of tokens seen :math:`t`; only rows below :math:`n` are read.  The capacity
:math:`n_{\max}` is the argument ``max_size`` (notation: ``docs/glossary.md``).
The contract and its derivations are in ``docs/derivations/ovq_gmr.md``; this
docstring states the results and the conventions that make the reference
reproducible bit for bit.

Predict, then update, chunk by chunk
------------------------------------
(``ovq_gmr.md#read-out``, ``#growth``, ``#assignment``, ``#update``.)  Queries and keys are unit-normalised, :math:`\hat q = q/\max(\|q\|, 10^{-12})`;
values are not.  Chunks are rows :math:`[s, e)`, :math:`e = \min(s+C, N)`.
Before the chunk touches the state, position :math:`a` attends, in one
softmax, to the :math:`n` centroids and to the chunk's own keys :math:`b \le a`:

.. math::

    \ell_{a,m} = \beta\,\hat q_a\cdot D_k[m] + \log c_m \;(m < n),\qquad
    \ell_{a,b} = \beta\,\hat q_a\cdot\hat k_b \;(b \le a),\qquad
    o_a = \operatorname{softmax}(\ell_a)\,[D_v[{:}n];\, v_0..v_a],

the conditional mean of a Gaussian mixture with key covariance
:math:`I/\beta` once the term :math:`-\tfrac\beta2\|D_k[m]\|^2` is dropped
(:mod:`refimpl.gmr` measures the gap).  Then the dictionary grows to
:math:`n' = \max(n, g(t + L))`, :math:`g(t) = \max(1, \lfloor t\,n_{\max}/(t+n_{\max})\rfloor)`
(plateau, at most :math:`n_{\max} - 1`) or :math:`\min(t, n_{\max})` (linear); :math:`n' - n`
keys seed new centroids (the least similar to the dictionary with
``init="spread"``, drawn at random with ``init="random"``) and every other key
joins the centroid of largest dot product (ties to the lowest index).  That is
the Euclidean nearest centroid only when the centroids have equal norms, which
means of unit keys do not (``ovq_gmr.md#dot-product-and-nearest-centroid``).
Each centroid :math:`m` with members
:math:`S_m` (in token order) is updated by

* the exact running mean (adaptive rate :math:`1/c`):
  :math:`c'_m = c_m + |S_m|`, :math:`D[m] \leftarrow (c_m D[m] + \sum_{i\in S_m} x_i)/c'_m`,
  the Newton step on the isotropic NLL of all data seen with the assignments
  fixed;
* or, with a constant learning rate :math:`\eta \in (0, 1]`, the classic
  constant-step online k-means, token by token in token order:
  :math:`D[m] \leftarrow D[m] + \eta(x_i - D[m])` for each :math:`i \in S_m`,
  i.e. :math:`D[m] \leftarrow (1-\eta)^{|S_m|}D[m] + \eta\sum_j (1-\eta)^{|S_m|-j}x_{(j)}`,
  an exponential moving average (stable for every :math:`\eta \in (0, 1]`;
  ``ovq_gmr.md#the-constant-learning-rate``); the counts still accumulate.

Conventions this module fixes (bit-for-bit reproducible):

* ``init="random"`` draws the new seeds with
  ``np.random.default_rng([seed, t]).choice(L, n' - n, replace=False)``, ``t``
  the tokens seen before the chunk; the draw order is the centroid order.  So
  a stream fed in pieces draws what one call draws.
* The first chunk of a stream (:math:`n = 0`) seeds centroid 0 with
  :math:`\hat k_0` and further centroids with the keys least similar to it,
  for both ``init`` values; the other keys join centroid 0 and are merged by
  the chosen rule, like the members of any existing centroid.
* Within a chunk the sums :math:`\sum_{S_m} x_i` of the running mean are
  accumulated in token order (:func:`refimpl.gmm.fold_running_means`), and
  the constant-rate steps are applied in token order;
  :mod:`refimpl.ovq_oracle` does the same arithmetic in loops.

Streaming: the chunk grid starts at each call.  A stream fed in pieces equals
one call bit for bit when every piece but the last has a length that is a
multiple of ``chunk_size``; a shorter piece closes its chunk, exactly as the
last chunk of one call does.

Cost: time :math:`O(N(n_{\max} + C)(d + d_v))`, state :math:`O(n_{\max}(d + d_v))` whatever
:math:`N` is, working memory :math:`O(C(n_{\max} + C) + n_{\max}(d + d_v))` besides the
``(N, d_v)`` output.

Backward with the assignments held fixed
----------------------------------------
(``ovq_gmr.md#backward-with-the-assignments-held-fixed``.)  The discrete choices (who seeds, who joins whom, the counts) are held at
their forward values.  Chunks are visited last to first, each in three named
phases: the update in reverse (:func:`_update_backward`: for the running mean
:math:`\bar x_i \mathrel{+}= \bar D'[m]/c'_m`, :math:`\bar D[m] = (c_m/c'_m)\bar D'[m]`;
for constant :math:`\eta`, :math:`\bar x_{(j)} \mathrel{+}= \eta(1-\eta)^{|S_m|-j}\bar D'[m]`,
:math:`\bar D[m] = (1-\eta)^{|S_m|}\bar D'[m]`; a seeded row passes its
gradient to its seed), the read-out softmax (:func:`_readout_backward`, through
:func:`refimpl.numerics.softmax_backward`), and the unit normalisation
(:func:`_unit_rows_backward`,
:math:`\bar x = (\bar{\hat x} - \hat x(\hat x\cdot\bar{\hat x}))/\|x\|`).

VQ attention
------------
(``ovq_gmr.md#vq-attention-the-baseline``.)  A fixed codebook :math:`D_k` replaces every key by its nearest code
:math:`z_j = \arg\max_m \hat k_j\cdot D_k[m]`; earlier chunks are summarised per
code by the count :math:`L_m` and the running mean of values, read with
:math:`\beta\hat q\cdot D_k[m] + \log L_m`; the current chunk is read causally
through its codes, :math:`\beta\hat q_a\cdot D_k[z_b]`, :math:`b\le a`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import gmm, numerics, statefile, validation, varlen

__all__ = [
    "NORM_EPS",
    "GROWTHS",
    "INITS",
    "dictionary_size",
    "unit_rows",
    "OVQState",
    "ovq_attention",
    "ovq_attention_forward",
    "ovq_attention_backward",
    "OVQCache",
    "OVQGrads",
    "check_ovq_forward_arguments",
    "vq_attention",
]

#: Floor of the norm in ``x / max(||x||, NORM_EPS)``.
NORM_EPS = 1e-12
#: Accepted values of ``growth``.
GROWTHS = ("plateau", "linear")
#: Accepted values of ``init``.
INITS = ("spread", "random")

_FORMAT = "refimpl.ovq.OVQState"
_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------
# Growth and normalisation
# ---------------------------------------------------------------------------


def _growth(t, n_max, growth):
    # plateau: max(1, floor(t n_max / (t + n_max))) <= n_max - 1, in exact integer arithmetic;
    # linear: min(t, n_max); 0 before any token
    if isinstance(t, int):
        if t == 0:
            return 0
        return min(t, n_max) if growth == "linear" else max(1, (t * n_max) // (t + n_max))
    size = np.minimum(t, n_max) if growth == "linear" else np.maximum(1, (t * n_max) // (t + n_max))
    return np.where(t == 0, 0, size)


def dictionary_size(t, max_size, growth: str = "plateau"):
    """Number of centroids after ``t`` tokens: ``growth(t, n_max)``.

    Parameters
    ----------
    t : int or array_like of int
        Tokens seen (>= 0).
    max_size : int
        ``n_max`` (>= 1), the capacity.
    growth : {"plateau", "linear"}, default "plateau"
        ``plateau``: ``max(1, floor(t n_max / (t + n_max)))``, which rises like
        ``t`` and approaches ``n_max`` from below without reaching it (at most
        ``n_max - 1``: the last row of the state is never used); its slope is
        ``(n_max / (n_max + t))**2``.  ``linear``: ``min(t, n_max)``.

    Returns
    -------
    int or ndarray of int64
        0 for ``t = 0`` (an empty stream), otherwise at least 1.  Computed in
        integers, so the floor is exact.
    """
    t, n_max, growth = validation.check_dictionary_size(t, max_size, growth, GROWTHS)
    return _growth(t, n_max, growth)


def _unit_rows(x):
    norms = np.sqrt(np.sum(x * x, axis=1))
    # x^ = x / max(||x||, 1e-12): unit rows, and no division by zero
    return x / np.maximum(norms, NORM_EPS)[:, None], norms


def _unit_rows_backward(g, xhat, norms):
    # d(x/||x||)/dx = (I - x^ x^T) / ||x||; below the floor x^ = x / 1e-12 is linear
    out = g / np.maximum(norms, NORM_EPS)[:, None]
    big = norms > NORM_EPS
    proj = np.sum(xhat * g, axis=1)
    out[big] -= xhat[big] * (proj[big] / norms[big])[:, None]
    return out


def unit_rows(x):
    """Rows scaled to unit norm: ``x / max(||x||, 1e-12)``.

    Parameters
    ----------
    x : array_like, shape (N, d)

    Returns
    -------
    ndarray, shape (N, d)
        Same dtype as ``x``; a zero row stays zero.
    """
    x = validation.as_float_array(x, "x", ndim=2)
    return _unit_rows(x)[0]


# ---------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------


def _readonly(a):
    a.flags.writeable = False
    return a


class OVQState:
    """Dictionaries and counts that summarise every token seen so far; immutable.

    Parameters
    ----------
    keys : array_like, shape (n_max, d)
        ``D_k``; rows ``>= size`` are never read.
    values : array_like, shape (n_max, d_v)
        ``D_v``, same float dtype as ``keys``.
    counts : array_like of int, shape (n_max,)
        ``c``: at least 1 on the active rows, 0 on the others, stored as int64.
    size : int
        Active rows ``n``, ``0 <= n <= n_max``.
    tokens_seen : int
        ``t``; must equal ``sum(counts)``.

    Raises
    ------
    TypeError, ValueError
        If an argument breaks one of these invariants (the message names it).

    Notes
    -----
    The constructor copies its arrays and marks the copies read-only, so a
    state handed to :func:`ovq_attention` is never changed: every call returns
    a new state.  Memory is ``n_max (d + d_v)`` floats and ``n_max`` integers,
    whatever ``tokens_seen`` is (:attr:`nbytes`).
    """

    __slots__ = ("_keys", "_values", "_counts", "_size", "_tokens_seen")

    def __init__(self, keys, values, counts, size, tokens_seen):
        # the invariants of the class docstring, each refused with its own message
        keys, values, counts, size, tokens_seen = validation.check_ovq_state(keys, values, counts, size, tokens_seen)
        self._keys = _readonly(np.array(keys, copy=True))
        self._values = _readonly(np.array(values, copy=True))
        self._counts = _readonly(counts.astype(np.int64, copy=True))
        self._size = size
        self._tokens_seen = tokens_seen

    keys = property(lambda self: self._keys, doc="``D_k``, shape (n_max, d), read-only.")
    values = property(lambda self: self._values, doc="``D_v``, shape (n_max, d_v), read-only.")
    counts = property(lambda self: self._counts, doc="``c``, int64, shape (n_max,), read-only.")
    size = property(lambda self: self._size, doc="Active rows ``n``.")
    tokens_seen = property(lambda self: self._tokens_seen, doc="Tokens ``t`` folded into the state.")
    max_size = property(lambda self: self._keys.shape[0], doc="``n_max``, the rows allocated.")
    d = property(lambda self: self._keys.shape[1], doc="Key dimension.")
    d_v = property(lambda self: self._values.shape[1], doc="Value dimension.")
    dtype = property(lambda self: self._keys.dtype, doc="Float dtype of the dictionaries.")

    @property
    def nbytes(self) -> int:
        """Bytes held by the three arrays: ``n_max (d + d_v)`` floats plus ``n_max`` int64."""
        return int(self._keys.nbytes + self._values.nbytes + self._counts.nbytes)

    @classmethod
    def empty(cls, max_size, d, d_v, dtype=np.float64) -> "OVQState":
        """The state before any token: zeros, ``size = tokens_seen = 0``."""
        n_max, d, d_v = (validation.check_int(x, name, minimum=1) for x, name in ((max_size, "max_size"), (d, "d"), (d_v, "d_v")))
        dtype = validation.check_float_dtype(dtype, "dtype")
        return cls(np.zeros((n_max, d), dtype), np.zeros((n_max, d_v), dtype), np.zeros(n_max, np.int64), 0, 0)

    def __repr__(self) -> str:
        return (
            f"OVQState(max_size={self.max_size}, d={self.d}, d_v={self.d_v}, size={self.size}, "
            f"tokens_seen={self.tokens_seen}, dtype={self.dtype})"
        )

    def save(self, path) -> None:
        """Write the state to ``path`` as an uncompressed ``.npz`` (no pickles), exactly at that path (:mod:`refimpl.statefile`)."""
        statefile.save(path, _FORMAT, _FORMAT_VERSION, keys=self._keys, values=self._values, counts=self._counts,
                       size=self._size, tokens_seen=self._tokens_seen)

    @classmethod
    def load(cls, path) -> "OVQState":
        """Read a state written by :meth:`save`, refusing a truncated or inconsistent file.

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the file is not a complete ``.npz``, lacks a field, is of
            another format or version (:func:`refimpl.statefile.load`), or
            holds arrays that break an invariant (shapes, dtypes, negative
            counts, ``sum(counts) != tokens_seen``, ``size`` above the rows,
            ...).  The message names the file and the problem.
        """
        f = statefile.load(path, _FORMAT, _FORMAT_VERSION, "OVQState", ("keys", "values", "counts"), ("size", "tokens_seen"))
        return validation.check_loaded_state(path, "OVQState", cls, f["keys"], f["values"], f["counts"], f["size"], f["tokens_seen"])


# ---------------------------------------------------------------------------
# The arguments of a call
# ---------------------------------------------------------------------------


class OVQParams(NamedTuple):
    """The checked options of :func:`ovq_attention` (``eta`` is ``learning_rate``)."""

    max_size: int
    chunk_size: int
    beta: float
    growth: str
    init: str
    count_bias: bool
    eta: float | None
    seed: int


class OVQArguments(NamedTuple):
    """What :func:`check_ovq_arguments` returns: the arrays cast to ``dtype``, the options, the incoming state."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    params: OVQParams
    state: OVQState | None
    dtype: np.dtype


def check_ovq_arguments(q, k, v, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state):
    """Check the arguments of :func:`ovq_attention` and :func:`ovq_attention_forward`; the GPU backends share it.

    Returns
    -------
    OVQArguments
        ``q, k, v`` cast to ``dtype``, the common dtype of the arrays and of
        ``state.keys``; ``params``, the checked options; ``state`` as given.
    """
    q, k, v = validation.check_ovq_qkv(q, k, v)
    max_size = validation.check_int(max_size, "max_size", minimum=1)
    chunk_size = validation.check_int(chunk_size, "chunk_size", minimum=1)
    beta = float(np.sqrt(q.shape[1])) if beta is None else validation.check_positive_float(beta, "beta")
    growth = validation.check_option(growth, "growth", GROWTHS)
    init = validation.check_option(init, "init", INITS)
    count_bias = validation.check_bool(count_bias, "count_bias")
    eta = validation.check_learning_rate(learning_rate)
    params = OVQParams(max_size, chunk_size, beta, growth, init, count_bias, eta, validation.check_int(seed, "seed", minimum=0))
    if state is not None:
        validation.check_ovq_stream_state(state, OVQState, params, q.shape[0], q.shape[1], v.shape[1], _growth)
    dtype = validation.common_float_dtype(q, k, v, *([] if state is None else [state.keys]))
    tokens = q.shape[0] + (0 if state is None else state.tokens_seen)
    validation.check_value_sums(v, tokens, dtype, None if state is None else state.values)
    return OVQArguments(q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), params, state, dtype)


def check_ovq_forward_arguments(q, k, v, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state):
    """Check the arguments of :func:`ovq_attention_forward`: a 2-D call's, or each sequence's of a batch in order.

    Returns
    -------
    OVQArguments
        As :func:`check_ovq_arguments`; with leading dimensions ``q, k, v``
        keep them (cast to the common dtype) and ``state`` is ``None``.
    """
    options = (max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed)
    if np.ndim(q) <= 2:
        return check_ovq_arguments(q, k, v, *options, state)
    q, k, v, lead = validation.check_ovq_batch(q, k, v, state)
    # each sequence passes the checks of a 2-D call, the first that fails raising its message
    first, *_ = [check_ovq_arguments(q[i], k[i], v[i], *options, None) for i in np.ndindex(lead)]
    return OVQArguments(*(x.astype(first.dtype, copy=False) for x in (q, k, v)), first.params, None, first.dtype)


def check_overflow(overflow, state, dtype):
    """Refuse the rows ``overflow = (rows, first row)`` whose logits overflowed; the GPU backends share it."""
    # who can make beta q.D_k overflow: beta itself, or a passed-in state with huge keys
    names, fix = ("beta", "lower beta") if state is None else ("beta, state", "lower beta or pass a state whose keys have norms about 1")
    validation.check_overflowed_rows(*overflow, dtype, names, fix)


# ---------------------------------------------------------------------------
# One chunk: a read-out, a plan (grow + assign), an update
# ---------------------------------------------------------------------------


def _chunk_logits(qhat, khat, dict_keys, log_c, beta, mask):
    n = dict_keys.shape[0]
    keys = np.concatenate([dict_keys, khat]) if n else khat
    logits = qhat @ keys.T
    logits *= qhat.dtype.type(beta)
    if log_c is not None and n:
        # a centroid of count c stands for c tokens: weight pi ~ c, logit + log c
        logits[:, :n] += log_c
    # causal inside the chunk: position a sees the chunk keys b <= a only
    chunk = logits[:, n:]
    chunk[mask] = -np.inf
    return logits, keys


def _plan_chunk(khat, dict_keys, n, n_add, init, seed, t):
    """Rows each chunk key goes to, which keys seed, and the seeds in centroid order."""
    L = khat.shape[0]
    rows = np.empty(L, dtype=np.int64)
    if n == 0:
        # first chunk: key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed
        # centroids 1.. in ascending order of score (stable sort: ties -> lowest index)
        scores = khat[1:] @ khat[0]
        seeds = np.concatenate([[0], 1 + np.argsort(scores, kind="stable")[: n_add - 1]]).astype(np.int64)
        rows[:] = 0
    else:
        sims = khat @ dict_keys[:n].T
        # nearest centroid by dot product; np.argmax returns the first maximum (lowest index)
        rows[:] = np.argmax(sims, axis=1)
        if n_add == 0:
            seeds = np.empty(0, dtype=np.int64)
        elif init == "spread":
            scores = sims[np.arange(L), rows]
            seeds = np.argsort(scores, kind="stable")[:n_add].astype(np.int64)
        else:
            rng = np.random.default_rng([seed, t])
            seeds = rng.choice(L, size=n_add, replace=False).astype(np.int64)
    rows[seeds] = n + np.arange(seeds.size)
    seeded = np.zeros(L, dtype=bool)
    seeded[seeds] = True
    return rows, seeded, seeds


def _member_ranks(rows):
    """Position of each key among the keys of its centroid, in token order (0 for the first)."""
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    ranks = np.empty(rows.size, dtype=np.int64)
    ranks[order] = np.arange(rows.size) - np.searchsorted(sorted_rows, sorted_rows, side="left")
    return ranks


def _constant_rate_update(D, x, rows, ranks, eta):
    # D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order; ranks = _member_ranks(rows):
    # round r applies the r-th member of every centroid at once (one key per centroid per round)
    D = D.copy()
    eta = D.dtype.type(eta)
    for r in range(int(ranks.max()) + 1 if ranks.size else 0):
        sel = ranks == r
        m = rows[sel]
        D[m] = D[m] + eta * (x[sel] - D[m])
    return D


def _update_chunk(Dk, Dv, counts, khat, vc, rows, seeded, seeds, n, eta):
    """State after the chunk, plus the counts after seeding and the per-row additions (for the backward)."""
    Dk, Dv, counts = Dk.copy(), Dv.copy(), counts.copy()
    new_rows = n + np.arange(seeds.size)
    # a seeded centroid starts at its key and value with count 1
    Dk[new_rows] = khat[seeds]
    Dv[new_rows] = vc[seeds]
    counts[new_rows] = 1
    keep = ~seeded
    a = rows[keep]
    added = np.bincount(a, minlength=counts.shape[0]).astype(np.int64)
    if eta is None:
        # exact running mean: (c D + sum_S x) / (c + |S|), sums in token order
        new_k, new_counts = gmm.fold_running_means(Dk, counts, khat[keep], a)
        new_v, _ = gmm.fold_running_means(Dv, counts, vc[keep], a)
    else:
        # constant step: an exponential moving average of the members, in token order
        ranks = _member_ranks(a)
        new_k = _constant_rate_update(Dk, khat[keep], a, ranks, eta)
        new_v = _constant_rate_update(Dv, vc[keep], a, ranks, eta)
        new_counts = counts + added
    return new_k, new_v, new_counts, counts, added


class _ChunkRecord(NamedTuple):
    start: int
    stop: int
    n: int  # active centroids read by the chunk
    dict_keys: np.ndarray  # (n, d) D_k before the chunk (never written afterwards)
    dict_values: np.ndarray  # (n, d_v)
    log_c: np.ndarray | None  # (n,) or None without count bias
    rows: np.ndarray  # (L,) row each key went to
    seeded: np.ndarray  # (L,) bool
    seeds: np.ndarray  # seeding keys in centroid order (rows n, n+1, ...)
    counts_mid: np.ndarray  # (n_max,) counts after seeding, before the merge
    added: np.ndarray  # (n_max,) |S_m|


def _count_overflow(overflow, logits, start):
    # (rows so far whose logits have no finite maximum, the first of them): O(1) memory, checked by the caller
    bad = ~np.isfinite(np.max(logits, axis=1))
    n_bad, first = overflow
    if np.any(bad) and n_bad == 0:
        first = start + int(np.argmax(bad))
    return n_bad + int(np.sum(bad)), first


# ---------------------------------------------------------------------------
# The forward: predict, then update, chunk by chunk
# ---------------------------------------------------------------------------


def _ovq_chunks(q, k, v, p, state, record, predict=None):
    """Core: ``(out, (D_k, D_v, c, n, t), records, overflow)``; the caller checks ``overflow = (rows, first row)``.

    ``predict(qhat, khat, dict_keys, dict_values, v_chunk, log_c, beta, mask)``, when given, computes each chunk's
    read-out in place of the lines below (``gpu.numba_cuda.plain`` passes a kernel's): the rows of the output, and
    the logits or any array whose rows have the logits' maxima.
    """
    N, d = q.shape
    d_v, dtype = v.shape[1], q.dtype
    n_max, C = p.max_size, p.chunk_size
    if state is None:
        Dk, Dv, counts = np.zeros((n_max, d), dtype), np.zeros((n_max, d_v), dtype), np.zeros(n_max, np.int64)
        n, t = 0, 0
    else:
        Dk, Dv, counts = state.keys.astype(dtype), state.values.astype(dtype), state.counts.copy()
        n, t = state.size, state.tokens_seen
    out = np.empty((N, d_v), dtype=dtype)
    overflow = (0, -1)
    records = [] if record else None
    masks = {}
    for s in range(0, N, C):
        e = min(s + C, N)
        L = e - s
        if L not in masks:
            masks[L] = np.triu(np.ones((L, L), dtype=bool), k=1)
        qhat, _ = _unit_rows(q[s:e])
        khat, _ = _unit_rows(k[s:e])
        vc = v[s:e]
        log_c = np.log(counts[:n].astype(dtype)) if p.count_bias else None
        # predict, before the chunk touches the state
        if predict is None:
            logits, _ = _chunk_logits(qhat, khat, Dk[:n], log_c, p.beta, masks[L])
            values = np.concatenate([Dv[:n], vc]) if n else vc
            with np.errstate(invalid="ignore"):  # an overflowed row (refused by the caller) gives NaN, not a warning
                out[s:e] = numerics.softmax(logits, axis=1) @ values
        else:
            out[s:e], logits = predict(qhat, khat, Dk[:n], Dv[:n], vc, log_c, p.beta, masks[L])
        overflow = _count_overflow(overflow, logits, s)
        # grow: n' = max(n, growth(t + L, n_max))
        t_next = t + L
        n_next = max(n, _growth(t_next, n_max, p.growth))
        # assign and update
        rows, seeded, seeds = _plan_chunk(khat, Dk, n, n_next - n, p.init, p.seed, t)
        new_k, new_v, new_counts, counts_mid, added = _update_chunk(Dk, Dv, counts, khat, vc, rows, seeded, seeds, n, p.eta)
        if record:
            records.append(_ChunkRecord(s, e, n, Dk[:n], Dv[:n], log_c, rows, seeded, seeds, counts_mid, added))
        Dk, Dv, counts, n, t = new_k, new_v, new_counts, n_next, t_next
    return out, (Dk, Dv, counts, n, t), records, overflow


def ovq_attention(q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread", count_bias=True,
                  learning_rate=None, seed=0, state=None, cu_seqlens=None, return_state=False):
    """Online vector-quantized attention, causal, chunk by chunk.

    Parameters
    ----------
    q, k : array_like, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like, shape (N, d_v)
        Values (not normalised).
    max_size : int
        ``n_max``, the most centroids (>= 1).
    chunk_size : int
        ``C`` (>= 1); the last chunk may be shorter.
    beta : float, optional
        Scale of the dot products, ``sqrt(d)`` by default.
    growth : {"plateau", "linear"}, default "plateau"
        The growth function of :func:`dictionary_size`.
    init : {"spread", "random"}, default "spread"
        Which keys seed new centroids once a dictionary exists: the least
        similar to it, or uniformly drawn (module docstring: the generator).
    count_bias : bool, default True
        Add ``log c`` to the centroid logits.
    learning_rate : float, optional
        ``None``: the adaptive ``1/c`` running mean; a number ``eta`` in
        ``(0, 1]``: the classic constant-step online k-means
        ``D += eta (x - D)``, token by token in token order (an exponential
        moving average; the counts still add up).
    seed : int, default 0
        Seed of ``init="random"`` (>= 0); ignored by ``init="spread"``.
    state : OVQState, optional
        Continue a stream from this state (it is not modified).  Its size must
        let the first chunk seed what ``growth`` asks for, as every state that
        this function returned with the same ``growth`` does; a state built
        by hand that lags behind is refused.
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences (:mod:`refimpl.varlen`): ``q``, ``k`` and ``v`` are
        ``(T, d)``, sequence ``s`` their rows ``cu_seqlens[s]:cu_seqlens[s + 1]``,
        each from its own dictionary: empty, or ``state[s]`` when ``state`` is
        a list of ``S`` states (or ``None``); the state returned is then one
        per sequence (an empty sequence's unchanged, or empty).
    return_state : bool, default False
        Also return the state after the last chunk.

    Returns
    -------
    out : ndarray, shape (N, d_v)
        Dtype of the inputs (float32 in, float32 out); a float64 ``state``
        makes the computation float64.
    state : OVQState
        Only with ``return_state=True``; a new object (packed, a tuple of one
        per sequence).

    Notes
    -----
    Vectorised within a chunk, a Python loop over chunks.  Feeding a stream in
    pieces whose lengths (but the last) are multiples of ``chunk_size``
    equals one call bit for bit; :mod:`refimpl.ovq_oracle` is the
    token-by-token version of the same contract.
    """
    if cu_seqlens is not None:
        options = dict(max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init, count_bias=count_bias,
                       learning_rate=learning_rate, seed=seed)
        states, check = packed_states(state, cu_seqlens, options, check_ovq_arguments)
        return_state = validation.check_bool(return_state, "return_state")
        out, extras = varlen.packed(lambda s, q1, k1, v1: ovq_attention(q1, k1, v1, **options, state=states[s], return_state=return_state),
                                       (q, k, v), cu_seqlens, ("q", "k", "v"), check)
        return (out, sequence_states(extras, states, max_size, q, v, out.dtype)) if return_state else out
    a = check_ovq_arguments(q, k, v, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state)
    return_state = validation.check_bool(return_state, "return_state")
    out, new_state, _, overflow = _ovq_chunks(a.q, a.k, a.v, a.params, a.state, record=False)
    check_overflow(overflow, a.state, a.dtype)
    return (out, OVQState(*new_state)) if return_state else out


def packed_states(state, cu_seqlens, options, checker):
    """``(states, check)`` of a packed OVQ call: one incoming state per sequence, and the checks of every argument.

    ``check(q, k, v)`` is ``checker`` (the function's own) on the whole packed
    arrays, once without a state and once with each state given; it returns
    what the call without a state returned.
    """
    states = validation.check_packed_states(state, validation.check_cu_seqlens(cu_seqlens), "OVQState")

    def check(q, k, v):
        return [checker(q, k, v, *options.values(), st) for st in (None,) + tuple(s for s in states if s is not None)][0]

    return states, check


def states_left_to_the_loop(q, v, dtype, params, lengths, states) -> bool:
    """Whether a backend's packed kernel must leave a packed call to the loop over its sequences because of a state.

    The loop computes a sequence whose state has a wider dtype in that dtype,
    and checks each sequence's state again on the sequence's own length
    (:func:`refimpl.validation.check_ovq_stream_state`), refusing it with its
    words: a packed kernel that computes every sequence in ``dtype`` at once
    can do neither.  ``q, v`` are the whole packed arrays (2-D), ``lengths``
    the sequences' lengths, ``states`` one incoming state (or ``None``) each.
    """
    d, d_v = np.shape(q)[-1], np.shape(v)[-1]
    if any(st is not None and validation.common_float_dtype(q, st.keys) != dtype for st in states):
        return True
    try:
        for n, st in zip(np.asarray(lengths).tolist(), states):
            if n and st is not None:
                validation.check_ovq_stream_state(st, OVQState, params, n, d, d_v, _growth)
    except ValueError:
        return True
    return False


def sequence_states(new, given, max_size, q, v, dtype):
    """The state after each sequence of a packed call: ``new[s]``, or for an empty sequence the state it was given (or empty)."""
    d, d_v = np.shape(q)[-1], np.shape(v)[-1]
    return tuple(n if n is not None else (g if g is not None else OVQState.empty(max_size, d, d_v, dtype)) for n, g in zip(new, given))


class OVQCache(NamedTuple):
    """What :func:`ovq_attention_backward` needs from the forward."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    params: OVQParams
    records: list
    state: OVQState  #: the state after the call


class OVQGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of OVQ attention (assignments held fixed)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def ovq_attention_forward(q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread", count_bias=True,
                          learning_rate=None, seed=0, state=None, cu_seqlens=None):
    """:func:`ovq_attention`, keeping what the backward needs; also for a batch of sequences.

    Parameters
    ----------
    q, k : array_like, shape (N, d) or (..., N, d)
        Queries and keys; leading dimensions make a batch of independent
        sequences (at least one), each with its own empty dictionary.
    v : array_like, shape (N, d_v) or (..., N, d_v)
        Values, with the leading dimensions of ``q``.
    max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed
        As in :func:`ovq_attention`.
    state : OVQState, optional
        As in :func:`ovq_attention`; refused with leading dimensions.
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences, as in :func:`ovq_attention`; ``q``, ``k`` and ``v``
        may also be ``(T, H, d)`` (no state then).

    Returns
    -------
    out : ndarray, shape (N, d_v) or (..., N, d_v)
    cache : OVQCache
        Inputs (cast to the common dtype), parameters, per-chunk
        dictionaries read and assignment plans, and ``cache.state``, the
        state after a 2-D call (``None`` with leading dimensions).  For a 2-D
        call ``cache.records[j].rows`` is the row each key of chunk ``j``
        went to (the assignments that the backward holds fixed) and
        ``cache.records[j].dict_keys`` the dictionary it was assigned
        against; with leading dimensions ``cache.records`` holds such a list
        per sequence, leading indices in C order.  Packed, a
        :class:`refimpl.varlen.PackedCache` of the sequences' caches.

    Raises
    ------
    TypeError, ValueError
        As :func:`ovq_attention`; a batch raises what the first of its
        sequences to fail would raise on its own.
    """
    if cu_seqlens is not None:
        options = dict(max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init, count_bias=count_bias,
                       learning_rate=learning_rate, seed=seed)
        states, check = packed_states(state, cu_seqlens, options, check_ovq_forward_arguments)
        return varlen.packed(lambda s, q1, k1, v1: ovq_attention_forward(q1, k1, v1, **options, state=states[s]),
                             (q, k, v), cu_seqlens, ("q", "k", "v"), check, forward=True)
    a = check_ovq_forward_arguments(q, k, v, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state)
    lead = a.q.shape[:-2]
    out = np.empty(a.q.shape[:-1] + a.v.shape[-1:], dtype=a.dtype)
    records = []
    for idx in np.ndindex(lead):
        # each sequence from its own empty dictionary (or, for a 2-D call, from the state given)
        out[idx], new_state, rec, overflow = _ovq_chunks(a.q[idx], a.k[idx], a.v[idx], a.params, a.state, record=True)
        check_overflow(overflow, a.state, a.dtype)
        records.append(rec)
    if lead:
        return out, OVQCache(a.q, a.k, a.v, a.params, tuple(records), None)
    return out, OVQCache(a.q, a.k, a.v, a.params, records[0], OVQState(*new_state))


# ---------------------------------------------------------------------------
# The backward, with the assignments held fixed
# ---------------------------------------------------------------------------


def _update_backward(rec, gDk, gDv, khat, eta, L, d_v):
    """The update of one chunk in reverse: state after -> (state before, chunk keys, chunk values)."""
    dtype = gDk.dtype
    g_khat = np.zeros_like(khat)
    g_vc = np.zeros((L, d_v), dtype=dtype)
    keep = np.flatnonzero(~rec.seeded)
    a = rec.rows[keep]
    if eta is None:
        c_mid = rec.counts_mid.astype(dtype)
        c_new = c_mid + rec.added.astype(dtype)
        # D'[m] = (c_m D[m] + sum_S x_i) / c'_m: dD'/dx_i = 1/c'_m, dD'/dD[m] = c_m/c'_m
        inv = (1.0 / c_new[a])[:, None]
        g_khat[keep] = gDk[a] * inv
        g_vc[keep] = gDv[a] * inv
        through = np.ones(gDk.shape[0], dtype=dtype)
        touched = rec.added > 0
        through[touched] = c_mid[touched] / c_new[touched]
    else:
        # D'[m] = (1-eta)^|S_m| D[m] + eta sum_j (1-eta)^(|S_m|-j) x_(j): the j-th member's weight
        eta = dtype.type(eta)
        weight = (eta * (1 - eta) ** (rec.added[a] - 1 - _member_ranks(a)).astype(dtype))[:, None]
        g_khat[keep] = weight * gDk[a]
        g_vc[keep] = weight * gDv[a]
        through = ((1 - eta) ** rec.added).astype(dtype)
    gDk = gDk * through[:, None]
    gDv = gDv * through[:, None]
    # a seeded row was set to its seed's key/value just before the merge: the seed takes its gradient
    new_rows = rec.n + np.arange(rec.seeds.size)
    g_khat[rec.seeds] += gDk[new_rows]
    g_vc[rec.seeds] += gDv[new_rows]
    gDk[new_rows] = 0
    gDv[new_rows] = 0
    return gDk, gDv, g_khat, g_vc


def _readout_backward(rec, G, qhat, khat, vc, beta):
    """The read-out of one chunk in reverse: ``(g_qhat, g_keys, g_values)`` over ``[D_k; k^]`` and ``[D_v; v]``."""
    L = qhat.shape[0]
    mask = np.triu(np.ones((L, L), dtype=bool), k=1)
    logits, keys = _chunk_logits(qhat, khat, rec.dict_keys, rec.log_c, beta, mask)
    P = numerics.softmax(logits, axis=1)
    values = np.concatenate([rec.dict_values, vc]) if rec.n else vc
    # out = P values: dP = G values^T; the softmax backward gives dl (masked entries have P = 0)
    dl = numerics.softmax_backward(P, G @ values.T, axis=1)
    dl *= qhat.dtype.type(beta)
    # l = beta q^ keys^T: dq^ = beta dl keys, dkeys = beta dl^T q^; out = P values: dvalues = P^T G
    return dl @ keys, dl.T @ qhat, P.T @ G


def ovq_attention_backward(grad_out, cache: OVQCache) -> OVQGrads:
    """Gradients of OVQ attention with the assignments held at their forward values.

    Parameters
    ----------
    grad_out : array_like, shape (N, d_v) or (..., N, d_v)
        ``dL/d out``, the shape of the forward's output.
    cache : OVQCache
        From :func:`ovq_attention_forward` (or its
        :class:`refimpl.varlen.PackedCache`).

    Returns
    -------
    OVQGrads
        Fields ``q`` (..., N, d), ``k`` (..., N, d), ``v`` (..., N, d_v), new
        arrays in the dtype of the forward.  The module docstring states each
        phase; the incoming ``state``, if any, is a constant.
    """
    if isinstance(cache, varlen.PackedCache):
        return varlen.packed_backward(ovq_attention_backward, grad_out, cache)
    validation.check_instance(cache, "cache", OVQCache, "the OVQCache from ovq_attention_forward")
    q, k, v, p = cache.q, cache.k, cache.v, cache.params
    lead = q.shape[:-2]
    labels = tuple(f"dim {i}" for i in range(len(lead))) + ("N", "d_v")
    g_out = validation.check_grad_out(grad_out, v.shape, labels, q.dtype)
    grads = OVQGrads(np.empty_like(q), np.empty_like(k), np.empty_like(v))
    for idx, records in zip(np.ndindex(lead), cache.records if lead else (cache.records,)):
        # one sequence: its inputs and (views written in place) its gradients
        q1, k1, v1, g1 = q[idx], k[idx], v[idx], g_out[idx]
        gq, gk, gv = grads.q[idx], grads.k[idx], grads.v[idx]
        # adjoint of the state after the chunk being visited; the loss does not read the final state
        gDk = np.zeros((p.max_size, q1.shape[1]), dtype=q.dtype)
        gDv = np.zeros((p.max_size, v1.shape[1]), dtype=q.dtype)
        for rec in reversed(records):
            s, e, n = rec.start, rec.stop, rec.n
            qhat, q_norms = _unit_rows(q1[s:e])
            khat, k_norms = _unit_rows(k1[s:e])
            # (1) the update, in reverse
            gDk, gDv, g_khat, g_vc = _update_backward(rec, gDk, gDv, khat, p.eta, e - s, v1.shape[1])
            # (2) the read-out against the dictionary the chunk saw
            g_qhat, g_keys, g_values = _readout_backward(rec, g1[s:e], qhat, khat, v1[s:e], p.beta)
            gDk[:n] += g_keys[:n]
            gDv[:n] += g_values[:n]
            g_khat += g_keys[n:]
            g_vc += g_values[n:]
            # (3) the unit normalisation
            gq[s:e] = _unit_rows_backward(g_qhat, qhat, q_norms)
            gk[s:e] = _unit_rows_backward(g_khat, khat, k_norms)
            gv[s:e] = g_vc
    return grads


# ---------------------------------------------------------------------------
# VQ attention
# ---------------------------------------------------------------------------


class VQArguments(NamedTuple):
    """What :func:`check_vq_arguments` returns: the arrays in one dtype, ``C`` and ``beta``."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    codebook: np.ndarray
    chunk_size: int
    beta: float


def check_vq_arguments(q, k, v, codebook, chunk_size, beta):
    """Check the arguments of :func:`vq_attention`, cast to one dtype; the GPU backends share it."""
    q, k, v = validation.check_ovq_tokens(q, k, v)
    codebook = validation.as_float_array(codebook, "codebook", ndim=2)
    validation.check_shape(codebook, "codebook", (None, q.shape[1]), ("S", "d"))
    validation.check_nonempty(codebook, "codebook", what="code", symbol="S")
    chunk_size = validation.check_int(chunk_size, "chunk_size", minimum=1)
    beta = float(np.sqrt(q.shape[1])) if beta is None else validation.check_positive_float(beta, "beta")
    dtype = validation.common_float_dtype(q, k, v, codebook)
    validation.check_value_sums(v, q.shape[0], dtype)
    return VQArguments(*(x.astype(dtype, copy=False) for x in (q, k, v, codebook)), chunk_size, beta)


def vq_attention(q, k, v, codebook, *, chunk_size, beta=None, cu_seqlens=None):
    """VQ attention with a fixed key codebook (Lingle 2023, simplified).

    Parameters
    ----------
    q, k : array_like, shape (N, d)
        Queries and keys (unit-normalised inside).
    v : array_like, shape (N, d_v)
    codebook : array_like, shape (S, d)
        The fixed key dictionary ``D_k`` (used as given, not normalised).
    chunk_size : int
        ``C`` (>= 1).
    beta : float, optional
        ``sqrt(d)`` by default.
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences (:mod:`refimpl.varlen`): ``q``, ``k`` and ``v`` are
        ``(T, d)``, sequence ``s`` their rows ``cu_seqlens[s]:cu_seqlens[s + 1]``,
        each summarised from no earlier chunk.

    Returns
    -------
    ndarray, shape (N, d_v)

    Notes
    -----
    Key ``j`` is replaced by code ``z_j = argmax_m k^_j . D_k[m]`` (ties to the
    lowest index).  Earlier chunks are summarised per code by the count
    ``L_m`` and the running mean of their values, read with logits
    ``beta q^ . D_k[m] + log L_m`` (codes with ``L_m = 0`` get ``-inf``); the
    current chunk is read causally with ``beta q^_a . D_k[z_b]``, ``b <= a``.
    """
    if cu_seqlens is not None:
        return varlen.packed(lambda s, q1, k1, v1: vq_attention(q1, k1, v1, codebook, chunk_size=chunk_size, beta=beta), (q, k, v),
                             cu_seqlens, ("q", "k", "v"), lambda q1, k1, v1: check_vq_arguments(q1, k1, v1, codebook, chunk_size, beta))[0]
    q, k, v, codebook, C, beta = check_vq_arguments(q, k, v, codebook, chunk_size, beta)
    N, S, dtype = q.shape[0], codebook.shape[0], q.dtype
    b = dtype.type(beta)
    value_means = np.zeros((S, v.shape[1]), dtype=dtype)
    counts = np.zeros(S, dtype=np.int64)
    out = np.empty((N, v.shape[1]), dtype=dtype)
    overflow = (0, -1)
    for s in range(0, N, C):
        e = min(s + C, N)
        L = e - s
        qhat, _ = _unit_rows(q[s:e])
        khat, _ = _unit_rows(k[s:e])
        # nearest code by dot product; argmax takes the lowest index on ties
        z = np.argmax(khat @ codebook.T, axis=1)
        with np.errstate(divide="ignore"):
            # log L_m: -inf for codes no earlier chunk used
            log_counts = np.log(counts.astype(dtype))
        past = b * (qhat @ codebook.T) + log_counts
        current = b * (qhat @ codebook[z].T)
        current[np.triu_indices(L, k=1)] = -np.inf
        logits = np.concatenate([past, current], axis=1)
        overflow = _count_overflow(overflow, logits, s)
        with np.errstate(invalid="ignore"):  # an overflowed row (refused below) gives NaN, not a warning
            P = numerics.softmax(logits, axis=1)
        out[s:e] = P[:, :S] @ value_means + P[:, S:] @ v[s:e]
        # U_m / L_m: running mean of the values each code summarises
        value_means, counts = gmm.fold_running_means(value_means, counts, v[s:e], z)
    validation.check_overflowed_rows(*overflow, dtype, "beta, codebook", "lower beta or rescale the codebook")
    return out
