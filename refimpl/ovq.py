r"""Online vector-quantized (OVQ) attention and the static-dictionary VQ baseline.

The contract is ``spec/ovq.md``; section numbers below refer to it.  One head,
one sequence: ``q, k`` are ``(T, d)``, ``v`` is ``(T, d_v)``.  The state is a
key dictionary :math:`D_k` ``(N, d)``, a value dictionary :math:`D_v`
``(N, d_v)``, integer counts :math:`c` ``(N,)``, the active size :math:`n` and
the number of tokens seen :math:`t`; only rows below :math:`n` are read.

Read-out (section 4, Predict)
-----------------------------
Queries and keys are unit-normalised, :math:`\hat q = q/\max(\|q\|, 10^{-12})`;
values are not.  Chunks are rows :math:`[s, e)`, :math:`e = \min(s+C, T)`,
:math:`L = e - s`.  Before the chunk touches the state, position :math:`a` of
the chunk attends, in one softmax, to the :math:`n` centroids and to the
chunk's own keys :math:`b \le a`:

.. math::

    \ell_{a,m} = \beta\,\hat q_a\cdot D_k[m] + \log c_m \;(m < n),\qquad
    \ell_{a,b} = \beta\,\hat q_a\cdot\hat k_b \;(b \le a),\qquad
    o_a = \operatorname{softmax}(\ell_a)\,[D_v[{:}n];\, v_0..v_a].

A raw key is a centroid of count one (:math:`\log 1 = 0`).  This is the exact
conditional mean of a Gaussian mixture with key covariance :math:`I/\beta` and
weights :math:`\propto c` *once the term* :math:`-\tfrac\beta2\|D_k[m]\|^2`
*is dropped* (:mod:`refimpl.gmr` measures the gap): every component of unit
norm makes it exact.

Grow, assign, update (section 4)
--------------------------------
After the chunk, :math:`t' = t + L` and :math:`n' = \max(n, g(t'))` with
:math:`g(t) = \max(1, \lfloor tN/(t+N)\rfloor)` (plateau) or
:math:`\min(t, N)` (linear); :math:`n' - n` keys of the chunk seed new
centroids, the others join their nearest centroid by dot product (ties to the
lowest index).  The new centroids are the keys least similar to the
dictionary, in ascending order of similarity (``init="spread"``), or keys drawn
without replacement (``init="random"``).  Each existing centroid :math:`m` with
assigned set :math:`S_m` takes the exact running mean

.. math::

    c'_m = c_m + |S_m|,\qquad D[m] \leftarrow \frac{c_m D[m] + \sum_{i\in S_m} x_i}{c'_m},

which is the Newton step :math:`\mu - H^{-1}\nabla` on the isotropic NLL of all
data seen with the assignments fixed (section 3; :math:`H_m = \beta c'_m I`).
With a constant learning rate :math:`\eta`,
:math:`D[m] \leftarrow D[m] + \eta\sum_{i\in S_m}(x_i - D[m])`.

Conventions this module fixes beyond the spec text (bit-for-bit reproducible):

* ``init="random"`` draws the new seeds with
  ``np.random.default_rng([seed, t]).choice(L, n' - n, replace=False)``, ``t``
  the tokens seen before the chunk; the draw order is the centroid order.  So
  a stream fed in pieces draws what one call draws.
* The first chunk of a stream (:math:`n = 0`) follows the spec's :math:`n = 0`
  rule, which has no ``init`` branch: seeds are the keys least similar to key 0
  for both ``init`` values.
* With a constant learning rate, the keys that join centroid 0 in the first
  chunk are merged by the constant-rate rule too: centroid 0 is seeded with
  :math:`\hat k_0`, count 1, then updated like any existing centroid.
* Within a chunk the sums :math:`\sum_{S_m} x_i` are accumulated in token order
  (:func:`refimpl.gmm.running_mean_update`, ``np.add.at``), then combined as
  written above; :mod:`refimpl.ovq_oracle` does the same arithmetic in loops.

Streaming: the chunk grid starts at each call.  A stream fed in pieces equals
one call bit for bit when every piece but the last has a length that is a
multiple of ``chunk_size`` (the spec's "chunk by chunk"); a shorter piece
closes its chunk, exactly as the last chunk of one call does.

Cost: time :math:`O(T(N + C)d)`, state :math:`O(N(d + d_v))` whatever
:math:`T` is, working memory :math:`O(C(N + C) + N(d + d_v))` besides the
``(T, d_v)`` output.

Backward with the assignments held fixed
----------------------------------------
The discrete choices (who seeds, who joins whom, the counts) are held at
their forward values; the output is then a smooth function of
:math:`\hat q, \hat k, v`, and the gradient runs back through three pieces.

*Read-out*, per chunk, with :math:`G = \partial L/\partial O` and
:math:`P = \operatorname{softmax}(\ell)` over keys :math:`K = [D_k; \hat k]`
and values :math:`W = [D_v; v]`:

.. math::

    dW = P^\top G,\quad dP = G W^\top,\quad
    d\ell = P\odot(dP - \operatorname{rowsum}(P\odot dP)),\quad
    d\hat q = \beta\, d\ell\, K,\quad dK = \beta\, d\ell^\top \hat q .

Masked entries have :math:`P = 0` and get nothing; :math:`\log c` is a
constant.  The rows of :math:`dK, dW` that belong to :math:`D_k, D_v` add to
the gradient of the state *before* the chunk.

*Update*, read in reverse from the state after the chunk
(:math:`\bar D'`) to the state before it and the chunk's keys and values:

.. math::

    \text{adaptive:}\quad \bar x_i \mathrel{+}= \bar D'[m]/c'_m\ (i\in S_m),\qquad
    \bar D[m] = \tfrac{c_m}{c'_m}\,\bar D'[m];

    \text{constant } \eta:\quad \bar x_i \mathrel{+}= \eta\,\bar D'[m],\qquad
    \bar D[m] = (1-\eta|S_m|)\,\bar D'[m].

A seeded row was set to its seed's key (or value) just before the merge, so
the seed receives that row's gradient and the row gets none from earlier
chunks (it was unused).  Chunks are visited last to first, and the
gradient of the final state is zero (the loss sees only the outputs).

*Normalisation*: :math:`\partial(x/\|x\|)/\partial x = (I - \hat x\hat x^\top)/\|x\|`,
so :math:`\bar x = (\bar{\hat x} - \hat x(\hat x\cdot\bar{\hat x}))/\|x\|`; below
the :math:`10^{-12}` floor the map is :math:`x/10^{-12}`, linear.

The forward keeps, per chunk, the dictionary it read (views of arrays that
are never written afterwards) and the assignment plan, so the backward costs
:math:`O((T/C)\,N(d+d_v))` memory; the read-out softmax is recomputed.
Gradients are returned as new arrays; nothing accumulates.

VQ attention (section 5)
------------------------
A fixed codebook :math:`D_k` replaces every key by its nearest code
:math:`z_j = \arg\max_m \hat k_j\cdot D_k[m]`; earlier chunks are summarised per
code by the count :math:`L_m` and the running mean of values, read with
:math:`\beta\hat q\cdot D_k[m] + \log L_m`; the current chunk is read causally
through its codes, :math:`\beta\hat q_a\cdot D_k[z_b]`, :math:`b\le a`.
"""

from __future__ import annotations

import zipfile
from typing import NamedTuple

import numpy as np

from . import _validation as V
from .gmm import _check_logits, _softmax, running_mean_update

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


def dictionary_size(t, max_size, growth: str = "plateau"):
    """Number of centroids after ``t`` tokens: ``growth(t, N)`` of spec section 4.

    Parameters
    ----------
    t : int or array_like of int
        Tokens seen (>= 0).
    max_size : int
        ``N`` (>= 1).
    growth : {"plateau", "linear"}, default "plateau"
        ``plateau``: ``max(1, floor(t N / (t + N)))``, which rises like ``t``
        and saturates below ``N`` (its slope is ``(N / (N + t))**2``);
        ``linear``: ``min(t, N)``.

    Returns
    -------
    int or ndarray of int64
        0 for ``t = 0`` (an empty stream), otherwise at least 1.  Computed in
        integers, so the floor is exact.
    """
    N = V.check_int(max_size, "max_size", minimum=1)
    growth = V.check_option(growth, "growth", GROWTHS)
    if not isinstance(t, (np.ndarray, list, tuple)):
        t = V.check_int(t, "t", minimum=0)
        if t == 0:
            return 0
        if growth == "linear":
            return min(t, N)
        # floor(t N / (t + N)) in exact integer arithmetic
        return max(1, (t * N) // (t + N))
    t = np.asarray(t)
    if not np.issubdtype(t.dtype, np.integer) or t.dtype == bool:
        raise TypeError(f"t: expected integers, got dtype {t.dtype}")
    if t.size and np.min(t) < 0:
        raise ValueError(f"t: expected token counts >= 0, got minimum {np.min(t)}")
    t = t.astype(np.int64)
    if t.size and np.max(t) > (np.iinfo(np.int64).max - N) // N:
        raise ValueError(f"t: t * max_size overflows int64 (max t = {np.max(t)}, max_size = {N})")
    if growth == "linear":
        size = np.minimum(t, N)
    else:
        size = np.maximum(1, (t * N) // (t + N))
    return np.where(t == 0, 0, size)


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
    """Rows scaled to unit norm: ``x / max(||x||, 1e-12)`` (spec section 4).

    Parameters
    ----------
    x : array_like, shape (T, d)

    Returns
    -------
    ndarray, shape (T, d)
        Same dtype as ``x``; a zero row stays zero.
    """
    x = V.as_float_array(x, "x", ndim=2)
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
    keys : array_like, shape (N, d)
        ``D_k``; rows ``>= size`` are never read.
    values : array_like, shape (N, d_v)
        ``D_v``, same float dtype as ``keys``.
    counts : array_like of int, shape (N,)
        ``c``: at least 1 on the active rows, 0 on the others, stored as int64.
    size : int
        Active rows ``n``, ``0 <= n <= N``.
    tokens_seen : int
        ``t``; must equal ``sum(counts)``.

    Notes
    -----
    The constructor copies its arrays and marks the copies read-only, so a
    state handed to :func:`ovq_attention` is never changed: every call returns
    a new state.  Memory is ``N (d + d_v)`` floats and ``N`` integers,
    whatever ``tokens_seen`` is (:attr:`nbytes`).
    """

    __slots__ = ("_keys", "_values", "_counts", "_size", "_tokens_seen")

    def __init__(self, keys, values, counts, size, tokens_seen):
        keys = V.as_float_array(keys, "keys", ndim=2)
        values = V.as_float_array(values, "values", ndim=2)
        N = keys.shape[0]
        if N < 1 or keys.shape[1] < 1:
            raise ValueError(f"keys: expected shape (N, d) with N >= 1 and d >= 1, got {keys.shape}")
        V.check_shape(values, "values", (N, None), ("N", "d_v"))
        if keys.dtype != values.dtype:
            raise TypeError(f"values: expected the dtype of keys ({keys.dtype}), got {values.dtype}")
        counts = np.asarray(counts)
        if counts.dtype == bool or not np.issubdtype(counts.dtype, np.integer):
            raise TypeError(f"counts: expected integers (int64), got dtype {counts.dtype}")
        V.check_shape(counts, "counts", (N,), ("N",))
        size = V.check_int(size, "size", minimum=0)
        if size > N:
            raise ValueError(f"size: expected at most N = {N} (the rows of keys), got {size}")
        tokens_seen = V.check_int(tokens_seen, "tokens_seen", minimum=0)
        if np.any(counts < 0):
            raise ValueError(f"counts: expected nonnegative counts, got minimum {np.min(counts)}")
        if np.any(counts[:size] < 1):
            raise ValueError(f"counts: every active row (< size = {size}) needs a count >= 1, got minimum {np.min(counts[:size])}")
        if np.any(counts[size:] != 0):
            raise ValueError(f"counts: rows >= size = {size} are unused and must have count 0, got {int(np.sum(counts[size:] != 0))} nonzero")
        total = int(np.sum(counts, dtype=np.int64))
        if total != tokens_seen:
            raise ValueError(f"counts: expected sum(counts) == tokens_seen = {tokens_seen}, got {total}")
        self._keys = _readonly(np.array(keys, copy=True))
        self._values = _readonly(np.array(values, copy=True))
        self._counts = _readonly(counts.astype(np.int64, copy=True))
        self._size = size
        self._tokens_seen = tokens_seen

    keys = property(lambda self: self._keys, doc="``D_k``, shape (N, d), read-only.")
    values = property(lambda self: self._values, doc="``D_v``, shape (N, d_v), read-only.")
    counts = property(lambda self: self._counts, doc="``c``, int64, shape (N,), read-only.")
    size = property(lambda self: self._size, doc="Active rows ``n``.")
    tokens_seen = property(lambda self: self._tokens_seen, doc="Tokens ``t`` folded into the state.")
    max_size = property(lambda self: self._keys.shape[0], doc="``N``, the rows allocated.")
    d = property(lambda self: self._keys.shape[1], doc="Key dimension.")
    d_v = property(lambda self: self._values.shape[1], doc="Value dimension.")
    dtype = property(lambda self: self._keys.dtype, doc="Float dtype of the dictionaries.")

    @property
    def nbytes(self) -> int:
        """Bytes held by the three arrays: ``N (d + d_v)`` floats plus ``N`` int64."""
        return int(self._keys.nbytes + self._values.nbytes + self._counts.nbytes)

    @classmethod
    def empty(cls, max_size, d, d_v, dtype=np.float64) -> "OVQState":
        """The state before any token: zeros, ``size = tokens_seen = 0``."""
        N = V.check_int(max_size, "max_size", minimum=1)
        d = V.check_int(d, "d", minimum=1)
        d_v = V.check_int(d_v, "d_v", minimum=1)
        dtype = V.check_float_dtype(dtype, "dtype")
        return cls(np.zeros((N, d), dtype), np.zeros((N, d_v), dtype), np.zeros(N, np.int64), 0, 0)

    def __repr__(self) -> str:
        return (
            f"OVQState(max_size={self.max_size}, d={self.d}, d_v={self.d_v}, size={self.size}, "
            f"tokens_seen={self.tokens_seen}, dtype={self.dtype})"
        )

    def save(self, path) -> None:
        """Write the state to ``path`` as an uncompressed ``.npz`` (no pickles), exactly at that path."""
        with open(path, "wb") as f:
            np.savez(
                f,
                format=np.array(_FORMAT),
                version=np.array(_FORMAT_VERSION, dtype=np.int64),
                keys=self._keys,
                values=self._values,
                counts=self._counts,
                size=np.array(self._size, dtype=np.int64),
                tokens_seen=np.array(self._tokens_seen, dtype=np.int64),
            )

    @classmethod
    def load(cls, path) -> "OVQState":
        """Read a state written by :meth:`save`, refusing a truncated or inconsistent file.

        Raises
        ------
        FileNotFoundError
            If ``path`` does not exist.
        ValueError
            If the file is not a complete ``.npz``, lacks a field, is of
            another format or version, or holds arrays that break an
            invariant (shapes, dtypes, negative counts, ``sum(counts) !=
            tokens_seen``, ``size`` above the rows, ...).  The message names
            the file and the problem.
        """
        fields = ("format", "version", "keys", "values", "counts", "size", "tokens_seen")
        try:
            data = np.load(path, allow_pickle=False)
            if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy file holds one bare array
                raise ValueError(f"expected an .npz archive of named fields, got a single {type(data).__name__}")
            with data:
                missing = [f for f in fields if f not in data.files]
                if missing:
                    raise ValueError(f"missing field(s) {missing}")
                arrays = {f: data[f] for f in fields}
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a complete OVQState file ({type(e).__name__}: {e})") from e
        if arrays["format"].shape != () or str(arrays["format"]) != _FORMAT:
            raise ValueError(f"{path}: expected format {_FORMAT!r}, got {arrays['format']!r}")
        for f in ("version", "size", "tokens_seen"):
            a = arrays[f]
            if a.shape != () or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"{path}: field {f!r} must be one integer, got dtype {a.dtype} shape {a.shape}")
        if int(arrays["version"]) != _FORMAT_VERSION:
            raise ValueError(f"{path}: expected version {_FORMAT_VERSION}, got {int(arrays['version'])}")
        try:
            return cls(arrays["keys"], arrays["values"], arrays["counts"], int(arrays["size"]), int(arrays["tokens_seen"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: invalid OVQState: {e}") from e


# ---------------------------------------------------------------------------
# Validation of a call
# ---------------------------------------------------------------------------


class _Params(NamedTuple):
    max_size: int
    chunk_size: int
    beta: float
    growth: str
    init: str
    count_bias: bool
    eta: float | None
    seed: int


def _check_call(q, k, v, *, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state):
    q = V.as_float_array(q, "q", ndim=2)
    k = V.as_float_array(k, "k", ndim=2)
    v = V.as_float_array(v, "v", ndim=2)
    T, d = q.shape
    if T < 1 or d < 1:
        raise ValueError(f"q: expected shape (T, d) with T >= 1 and d >= 1, got {q.shape}")
    V.check_shape(k, "k", (T, d), ("T", "d"))
    V.check_shape(v, "v", (T, None), ("T", "d_v"))
    if v.shape[1] < 1:
        raise ValueError(f"v: expected shape (T, d_v) with d_v >= 1, got {v.shape}")
    N = V.check_int(max_size, "max_size", minimum=1)
    C = V.check_int(chunk_size, "chunk_size", minimum=1)
    beta = float(np.sqrt(d)) if beta is None else V.check_positive_float(beta, "beta")
    growth = V.check_option(growth, "growth", GROWTHS)
    init = V.check_option(init, "init", INITS)
    count_bias = V.check_bool(count_bias, "count_bias")
    eta = None if learning_rate is None else V.check_positive_float(learning_rate, "learning_rate")
    seed = V.check_int(seed, "seed", minimum=0)
    arrays = [q, k, v]
    if state is not None:
        if not isinstance(state, OVQState):
            raise TypeError(f"state: expected an OVQState (or None), got {type(state).__name__}")
        if state.max_size != N:
            raise ValueError(f"state: has N = {state.max_size} rows but max_size = {N}; pass max_size={state.max_size}")
        if state.d != d:
            raise ValueError(f"state: holds keys of dimension d = {state.d}, but q and k have d = {d}")
        if state.d_v != v.shape[1]:
            raise ValueError(f"state: holds values of dimension d_v = {state.d_v}, but v has d_v = {v.shape[1]}")
        # the spec's n_new = n' - n <= L: the first chunk must be able to seed the rows growth asks for
        # (after it, n >= growth(t) and growth rises by at most one per token)
        L = min(C, T)
        needed = dictionary_size(state.tokens_seen + L, N, growth)
        if needed - state.size > L:
            raise ValueError(
                f"state: size = {state.size} after tokens_seen = {state.tokens_seen} is too small for growth={growth!r}: "
                f"the first chunk of {L} tokens would need {needed - state.size} new centroids; a state that "
                f"ovq_attention returned with this growth has size >= dictionary_size(tokens_seen, max_size, growth) "
                f"= {dictionary_size(state.tokens_seen, N, growth)}"
            )
        arrays.append(state.keys)
    dtype = V.common_float_dtype(*arrays)
    q, k, v = (a.astype(dtype, copy=False) for a in (q, k, v))
    return q, k, v, _Params(N, C, beta, growth, init, count_bias, eta, seed), dtype


# ---------------------------------------------------------------------------
# One chunk: read-out, plan (grow + assign), update
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


def _constant_rate_update(D, x, rows, eta):
    # D[m] <- D[m] + eta sum_{i in S_m} (x_i - D[m]); the sum accumulated in token order
    delta = np.zeros_like(D)
    np.add.at(delta, rows, x - D[rows])
    touched = np.bincount(rows, minlength=D.shape[0]) > 0
    out = D.copy()
    out[touched] = D[touched] + D.dtype.type(eta) * delta[touched]
    return out


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
        new_k, new_counts = running_mean_update(Dk, counts, khat[keep], a)
        new_v, _ = running_mean_update(Dv, counts, vc[keep], a)
    else:
        # D' - x* = (1 - eta |S|)(D - x*) for a fixed set S: the rule diverges when eta |S| > 2
        with np.errstate(over="ignore", invalid="ignore"):
            new_k = _constant_rate_update(Dk, khat[keep], a, eta)
            new_v = _constant_rate_update(Dv, vc[keep], a, eta)
        if not (np.all(np.isfinite(new_k)) and np.all(np.isfinite(new_v))):
            worst = int(added.max()) if added.size else 0
            raise ValueError(
                f"learning_rate: the constant-rate update diverged (eta = {eta}, up to {worst} keys "
                f"joined one centroid in a chunk; the rule is stable only while eta * |S_m| < 2); "
                f"use a smaller learning_rate or learning_rate=None (the adaptive 1/c running mean)"
            )
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
    counts_mid: np.ndarray  # (N,) counts after seeding, before the merge
    added: np.ndarray  # (N,) |S_m|


def _logit_blame(state, eta):
    # who can make beta q.D_k overflow: beta itself, a passed-in state, or a constant-rate dictionary
    names, fixes = ["beta"], ["lower beta"]
    if state is not None:
        names.append("state")
        fixes.append("pass a state whose keys have norms about 1")
    if eta is not None:
        names.append("learning_rate")
        fixes.append("use a smaller learning_rate")
    return ", ".join(names), " or ".join(fixes)


def _initial_state(state, N, d, d_v, dtype):
    if state is None:
        return np.zeros((N, d), dtype), np.zeros((N, d_v), dtype), np.zeros(N, np.int64), 0, 0
    return state.keys.astype(dtype), state.values.astype(dtype), state.counts.copy(), state.size, state.tokens_seen


def _run(q, k, v, p: _Params, state, dtype, record: bool):
    T, d = q.shape
    d_v = v.shape[1]
    N, C = p.max_size, p.chunk_size
    Dk, Dv, counts, n, t = _initial_state(state, N, d, d_v, dtype)
    out = np.empty((T, d_v), dtype=dtype)
    records = [] if record else None
    masks = {}
    for s in range(0, T, C):
        e = min(s + C, T)
        L = e - s
        if L not in masks:
            masks[L] = np.triu(np.ones((L, L), dtype=bool), k=1)
        qhat, _ = _unit_rows(q[s:e])
        khat, _ = _unit_rows(k[s:e])
        vc = v[s:e]
        log_c = np.log(counts[:n].astype(dtype)) if p.count_bias else None
        # predict, before the chunk touches the state
        logits, _ = _chunk_logits(qhat, khat, Dk[:n], log_c, p.beta, masks[L])
        _check_logits(logits, *_logit_blame(state, p.eta))
        values = np.concatenate([Dv[:n], vc]) if n else vc
        out[s:e] = _softmax(logits, axis=1) @ values
        # grow: n' = max(n, growth(t + L, N))
        t_next = t + L
        n_next = max(n, dictionary_size(t_next, N, p.growth))
        n_add = n_next - n
        assert 0 <= n_add <= L
        # assign and update
        rows, seeded, seeds = _plan_chunk(khat, Dk, n, n_add, p.init, p.seed, t)
        new_k, new_v, new_counts, counts_mid, added = _update_chunk(Dk, Dv, counts, khat, vc, rows, seeded, seeds, n, p.eta)
        if record:
            records.append(_ChunkRecord(s, e, n, Dk[:n], Dv[:n], log_c, rows, seeded, seeds, counts_mid, added))
        Dk, Dv, counts, n, t = new_k, new_v, new_counts, n_next, t_next
    return out, OVQState(Dk, Dv, counts, n, t), records


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def ovq_attention(
    q,
    k,
    v,
    *,
    max_size,
    chunk_size,
    beta=None,
    growth: str = "plateau",
    init: str = "spread",
    count_bias: bool = True,
    learning_rate=None,
    seed: int = 0,
    state: OVQState | None = None,
    return_state: bool = False,
):
    """Online vector-quantized attention, causal, chunk by chunk (spec section 4).

    Parameters
    ----------
    q, k : array_like, shape (T, d)
        Queries and keys (unit-normalised inside).
    v : array_like, shape (T, d_v)
        Values (not normalised).
    max_size : int
        ``N``, the most centroids (>= 1).
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
        ``None``: the adaptive ``1/c`` running mean; a number ``eta > 0``: the
        constant-rate rule ``D += eta sum_S (x - D)`` (counts still add up).
        For a fixed set ``S`` the error to its mean is multiplied by
        ``1 - eta |S|`` each chunk, so the rule is stable only while
        ``eta |S_m| < 2``; the first chunk already sends most of its keys to
        centroid 0.  A dictionary that overflows is refused with an error.
    seed : int, default 0
        Seed of ``init="random"`` (>= 0); ignored by ``init="spread"``.
    state : OVQState, optional
        Continue a stream from this state (it is not modified).  Its size must
        let the first chunk seed what ``growth`` asks for, as every state that
        this function returned with the same ``growth`` does; a state built
        by hand that lags behind is refused.
    return_state : bool, default False
        Also return the state after the last chunk.

    Returns
    -------
    out : ndarray, shape (T, d_v)
        Dtype of the inputs (float32 in, float32 out); a float64 ``state``
        makes the computation float64.
    state : OVQState
        Only with ``return_state=True``; a new object.

    Notes
    -----
    Vectorised within a chunk, a Python loop over chunks.  Feeding a stream in
    pieces whose lengths (but the last) are multiples of ``chunk_size``
    equals one call bit for bit; :mod:`refimpl.ovq_oracle` is the
    token-by-token version of the same contract.
    """
    q, k, v, p, dtype = _check_call(
        q, k, v, max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init,
        count_bias=count_bias, learning_rate=learning_rate, seed=seed, state=state,
    )
    return_state = V.check_bool(return_state, "return_state")
    out, new_state, _ = _run(q, k, v, p, state, dtype, record=False)
    return (out, new_state) if return_state else out


class OVQCache(NamedTuple):
    """What :func:`ovq_attention_backward` needs from the forward."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    params: _Params
    records: list
    state: OVQState  #: the state after the call


class OVQGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of OVQ attention (assignments held fixed)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def ovq_attention_forward(
    q,
    k,
    v,
    *,
    max_size,
    chunk_size,
    beta=None,
    growth: str = "plateau",
    init: str = "spread",
    count_bias: bool = True,
    learning_rate=None,
    seed: int = 0,
    state: OVQState | None = None,
):
    """:func:`ovq_attention`, keeping what the backward needs.

    Parameters are those of :func:`ovq_attention`.

    Returns
    -------
    out : ndarray, shape (T, d_v)
    cache : OVQCache
        Inputs, parameters, per-chunk dictionaries read and assignment plans,
        and ``cache.state``, the state after the call.  ``cache.records[j].rows``
        is the row each key of chunk ``j`` went to (the assignments that the
        backward holds fixed).
    """
    q, k, v, p, dtype = _check_call(
        q, k, v, max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init,
        count_bias=count_bias, learning_rate=learning_rate, seed=seed, state=state,
    )
    out, new_state, records = _run(q, k, v, p, state, dtype, record=True)
    return out, OVQCache(q, k, v, p, records, new_state)


def ovq_attention_backward(grad_out, cache: OVQCache) -> OVQGrads:
    """Gradients of OVQ attention with the assignments held at their forward values.

    Parameters
    ----------
    grad_out : array_like, shape (T, d_v)
        ``dL/d out``.
    cache : OVQCache
        From :func:`ovq_attention_forward`.

    Returns
    -------
    OVQGrads
        Fields ``q`` (T, d), ``k`` (T, d), ``v`` (T, d_v), new arrays in the
        dtype of the forward.  The module docstring derives each line; the
        incoming ``state``, if any, is a constant.
    """
    if not isinstance(cache, OVQCache):
        raise TypeError(f"cache: expected the OVQCache from ovq_attention_forward, got {type(cache).__name__}")
    q, k, v, p = cache.q, cache.k, cache.v, cache.params
    dtype = q.dtype
    g_out = V.as_float_array(grad_out, "grad_out", ndim=2)
    V.check_shape(g_out, "grad_out", v.shape, ("T", "d_v"))
    g_out = g_out.astype(dtype, copy=False)
    N, beta = p.max_size, dtype.type(p.beta)
    gq, gk, gv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    # adjoint of the state after the chunk being visited; the loss does not read the final state
    gDk = np.zeros((N, q.shape[1]), dtype=dtype)
    gDv = np.zeros((N, v.shape[1]), dtype=dtype)
    for rec in reversed(cache.records):
        s, e, n = rec.start, rec.stop, rec.n
        L = e - s
        qhat, q_norms = _unit_rows(q[s:e])
        khat, k_norms = _unit_rows(k[s:e])
        g_khat = np.zeros_like(khat)
        g_vc = np.zeros((L, v.shape[1]), dtype=dtype)

        # (1) update, in reverse: state after -> state before (after seeding) + chunk keys/values
        keep = np.flatnonzero(~rec.seeded)
        a = rec.rows[keep]
        if p.eta is None:
            c_mid = rec.counts_mid.astype(dtype)
            c_new = c_mid + rec.added.astype(dtype)
            # D'[m] = (c_m D[m] + sum_S x_i) / c'_m: dD'/dx_i = 1/c'_m, dD'/dD[m] = c_m/c'_m
            inv = (1.0 / c_new[a])[:, None]
            g_khat[keep] = gDk[a] * inv
            g_vc[keep] = gDv[a] * inv
            through = np.ones(N, dtype=dtype)
            touched = rec.added > 0
            through[touched] = c_mid[touched] / c_new[touched]
        else:
            # D'[m] = (1 - eta |S_m|) D[m] + eta sum_S x_i
            eta = dtype.type(p.eta)
            g_khat[keep] = eta * gDk[a]
            g_vc[keep] = eta * gDv[a]
            through = (1 - eta * rec.added.astype(dtype)).astype(dtype)
        gDk = gDk * through[:, None]
        gDv = gDv * through[:, None]
        # a seeded row was set to its seed's key/value just before the merge
        new_rows = n + np.arange(rec.seeds.size)
        g_khat[rec.seeds] += gDk[new_rows]
        g_vc[rec.seeds] += gDv[new_rows]
        gDk[new_rows] = 0
        gDv[new_rows] = 0

        # (2) read-out of the chunk against the dictionary it saw
        mask = np.triu(np.ones((L, L), dtype=bool), k=1)
        logits, keys = _chunk_logits(qhat, khat, rec.dict_keys, rec.log_c, p.beta, mask)
        P = _softmax(logits, axis=1)
        values = np.concatenate([rec.dict_values, v[s:e]]) if n else v[s:e]
        G = g_out[s:e]
        dP = G @ values.T
        # softmax Jacobian row by row: dl = P * (dP - rowsum(P * dP)); masked entries have P = 0
        dl = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
        dl *= beta
        g_qhat = dl @ keys
        g_keys = dl.T @ qhat
        g_values = P.T @ G
        gDk[:n] += g_keys[:n]
        gDv[:n] += g_values[:n]
        g_khat += g_keys[n:]
        g_vc += g_values[n:]

        # (3) unit normalisation
        gq[s:e] = _unit_rows_backward(g_qhat, qhat, q_norms)
        gk[s:e] = _unit_rows_backward(g_khat, khat, k_norms)
        gv[s:e] = g_vc
    return OVQGrads(q=gq, k=gk, v=gv)


def _check_vq_call(q, k, v, codebook, chunk_size, beta):
    q = V.as_float_array(q, "q", ndim=2)
    k = V.as_float_array(k, "k", ndim=2)
    v = V.as_float_array(v, "v", ndim=2)
    codebook = V.as_float_array(codebook, "codebook", ndim=2)
    T, d = q.shape
    if T < 1 or d < 1:
        raise ValueError(f"q: expected shape (T, d) with T >= 1 and d >= 1, got {q.shape}")
    V.check_shape(k, "k", (T, d), ("T", "d"))
    V.check_shape(v, "v", (T, None), ("T", "d_v"))
    V.check_shape(codebook, "codebook", (None, d), ("S", "d"))
    if codebook.shape[0] < 1:
        raise ValueError("codebook: expected at least one code (S >= 1), got S = 0")
    C = V.check_int(chunk_size, "chunk_size", minimum=1)
    beta = float(np.sqrt(d)) if beta is None else V.check_positive_float(beta, "beta")
    dtype = V.common_float_dtype(q, k, v, codebook)
    q, k, v, codebook = (a.astype(dtype, copy=False) for a in (q, k, v, codebook))
    return q, k, v, codebook, C, beta


def vq_attention(q, k, v, codebook, *, chunk_size, beta=None):
    """VQ attention with a fixed key codebook (Lingle 2023, simplified; spec section 5).

    Parameters
    ----------
    q, k : array_like, shape (T, d)
        Queries and keys (unit-normalised inside).
    v : array_like, shape (T, d_v)
    codebook : array_like, shape (S, d)
        The fixed key dictionary ``D_k`` (used as given, not normalised).
    chunk_size : int
        ``C`` (>= 1).
    beta : float, optional
        ``sqrt(d)`` by default.

    Returns
    -------
    ndarray, shape (T, d_v)

    Notes
    -----
    Key ``j`` is replaced by code ``z_j = argmax_m k^_j . D_k[m]`` (ties to the
    lowest index).  Earlier chunks are summarised per code by the count
    ``L_m`` and the running mean of their values, read with logits
    ``beta q^ . D_k[m] + log L_m`` (codes with ``L_m = 0`` get ``-inf``); the
    current chunk is read causally with ``beta q^_a . D_k[z_b]``, ``b <= a``.
    """
    q, k, v, codebook, C, beta = _check_vq_call(q, k, v, codebook, chunk_size, beta)
    T, S, dtype = q.shape[0], codebook.shape[0], q.dtype
    b = dtype.type(beta)
    value_means = np.zeros((S, v.shape[1]), dtype=dtype)
    counts = np.zeros(S, dtype=np.int64)
    out = np.empty((T, v.shape[1]), dtype=dtype)
    for s in range(0, T, C):
        e = min(s + C, T)
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
        _check_logits(logits, "beta, codebook", "lower beta or rescale the codebook")
        P = _softmax(logits, axis=1)
        out[s:e] = P[:, :S] @ value_means + P[:, S:] @ v[s:e]
        # U_m / L_m: running mean of the values each code summarises
        value_means, counts = running_mean_update(value_means, counts, v[s:e], z)
    return out
