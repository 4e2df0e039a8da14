"""Token-by-token loop oracles for OVQ and VQ attention, written straight from the contract.

The contract is ``docs/derivations/ovq_gmr.md`` (notation: ``docs/glossary.md``:
the sequence has ``N`` tokens and the dictionary at most ``n_max = max_size``
rows, ``n`` of them in use).  Plain Python loops over tokens, centroids and
chunk keys; NumPy only for the arithmetic on one row at
a time.  No matrix products, no sorting by ``argsort``, no ``np.add.at``: each
step is the sentence of the contract it implements, so that
:mod:`refimpl.ovq` (vectorised within a chunk) can be checked against it.
Nothing here comes from :mod:`refimpl.ovq` or :mod:`refimpl.gmm`: the
oracle has its own softmax, its own state and its own few lines of argument
checking (with the shared :mod:`refimpl.validation` messages).

The state arithmetic follows the conventions that make the two agree bit for
bit in float64 (listed in :mod:`refimpl.ovq`): unit rows as
``x / max(sqrt(sum(x * x)), 1e-12)``, per-centroid sums accumulated in token
order and combined as ``(c * D + sum) / c'``, constant-rate steps
``D + eta * (x - D)`` in token order, the random draw from
``np.random.default_rng([seed, t])``.  The outputs agree to rounding only (a
dot product here is summed in another order than in a matrix product).

Slow by design: use small sizes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import validation

__all__ = ["LoopState", "ovq_attention_loop", "vq_attention_loop"]


class LoopState(NamedTuple):
    """The oracle's state after the last chunk: ``D_k``, ``D_v``, ``c``, ``n``, ``t``."""

    keys: np.ndarray
    values: np.ndarray
    counts: np.ndarray
    size: int
    tokens_seen: int


def _softmax(logits):
    # softmax(l) = exp(l - max l) / sum exp(l - max l): the largest term is exp(0) = 1
    e = np.exp(logits - np.max(logits))
    return e / np.sum(e)


def _check_qkv(q, k, v):
    q = validation.as_float_array(q, "q", ndim=2)
    k = validation.as_float_array(k, "k", ndim=2)
    v = validation.as_float_array(v, "v", ndim=2)
    validation.check_shape(k, "k", q.shape, ("N", "d"))
    validation.check_shape(v, "v", (q.shape[0], None), ("N", "d_v"))
    dtype = np.result_type(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), dtype


def _check_options(max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, d):
    validation.check_int(max_size, "max_size", minimum=1)
    validation.check_int(chunk_size, "chunk_size", minimum=1)
    validation.check_option(growth, "growth", ("plateau", "linear"))
    validation.check_option(init, "init", ("spread", "random"))
    validation.check_bool(count_bias, "count_bias")
    validation.check_int(seed, "seed", minimum=0)
    if learning_rate is not None and not 0 < validation.check_positive_float(learning_rate, "learning_rate") <= 1:
        raise ValueError(f"learning_rate: expected a constant step in (0, 1], got {learning_rate!r}")
    return math.sqrt(d) if beta is None else validation.check_positive_float(beta, "beta")


def _unit(x):
    # q^ = q / max(||q||, 1e-12)
    return x / max(np.sqrt(np.sum(x * x)), 1e-12)


def _growth(t, n_max, growth):
    if growth == "linear":
        return min(t, n_max)
    return max(1, (t * n_max) // (t + n_max))


def _read_out(qa, kh, vc, Dk, Dv, c, beta, count_bias):
    """``o_a``: one softmax over the centroids ``m < n`` and the chunk's raw keys ``b <= a``, read out of their rows.

    ``Dk``, ``Dv`` and ``c`` hold the ``n`` centroids of the state before the
    chunk, ``kh`` and ``vc`` the unit keys and values ``b <= a``.
    """
    dtype = Dk.dtype
    logits, rows = [], []
    for m in range(len(c)):
        # l_am = beta q^_a . D_k[m] + log c_m
        logit = beta * np.dot(qa, Dk[m])
        if count_bias:
            logit += np.log(dtype.type(c[m]))
        logits.append(logit)
        rows.append(Dv[m])
    for b in range(len(kh)):
        logits.append(beta * np.dot(qa, kh[b]))  # a raw key: count 1, log 1 = 0
        rows.append(vc[b])
    p = _softmax(np.array(logits, dtype=dtype))
    o = np.zeros(Dv.shape[1], dtype=dtype)
    for j in range(len(rows)):
        o += p[j] * rows[j]
    return o


def _assign_first_chunk(kh, n_new):
    """``(assigned, seeds)`` of the first chunk: k^_0 seeds centroid 0, the ``n' - 1`` keys least like it the next ones.

    The seeds come in ascending order of score ``k^_i . k^_0`` (ties to the
    lowest index); every other key joins centroid 0 (``assigned[i] = 0``,
    ``None`` for a seed).
    """
    L = len(kh)
    assigned = [None] * L
    seeds = [0]
    score = {i: np.dot(kh[i], kh[0]) for i in range(1, L)}
    by_score = sorted(range(1, L), key=lambda i: (score[i], i))
    seeds += by_score[: n_new - 1]
    for i in range(1, L):
        if i not in seeds:
            assigned[i] = 0
    return assigned, seeds


def _nearest(x, Dk):
    """``(score, a)``: the largest ``x . D_k[m]`` over the rows ``m`` of ``Dk`` and its ``m``; ties keep the lowest index."""
    best, best_m = None, None
    for m in range(len(Dk)):
        sim = np.dot(x, Dk[m])
        if best is None or sim > best:  # strict: ties keep the lowest index
            best, best_m = sim, m
    return best, best_m


def _assign_later_chunk(kh, Dk, n_new, init, seed, t):
    """``(assigned, seeds)`` of a chunk after the first: each key's candidate ``a_i``, and the ``n' - n`` keys that seed.

    ``Dk`` holds the ``n`` centroids before the chunk.  With ``spread`` the
    keys of the smallest scores seed, in ascending order of score; with
    ``random`` those drawn by ``default_rng([seed, t])``, in draw order.
    Every other key joins its candidate (``None`` for a seed).
    """
    assigned, score = [], []
    for x in kh:
        best, best_m = _nearest(x, Dk)
        assigned.append(best_m)
        score.append(best)
    seeds = []
    if n_new > 0:
        if init == "spread":
            seeds = sorted(range(len(kh)), key=lambda i: (score[i], i))[:n_new]
        else:
            rng = np.random.default_rng([seed, t])
            seeds = [int(i) for i in rng.choice(len(kh), size=n_new, replace=False)]
    for i in seeds:
        assigned[i] = None
    return assigned, seeds


def _merge_running_mean(D, m, count, rows):
    """The adaptive rule into row ``m`` of ``D``: ``(c_m D[m] + sum_{i in S_m} x_i) / c'_m``, the sum in token order.

    ``count`` is ``c_m``, ``rows`` the members ``x_(1), x_(2), ...`` of ``S_m`` in token order.
    """
    dtype = D.dtype
    total = np.zeros(D.shape[1], dtype=dtype)
    for x in rows:
        total += x
    D[m] = (dtype.type(count) * D[m] + total) / dtype.type(count + len(rows))


def _merge_constant_rate(D, m, rows, eta):
    """The constant rule into row ``m`` of ``D``, token by token in token order: ``D[m] <- D[m] + eta (x_i - D[m])``."""
    for x in rows:
        D[m] = D[m] + eta * (x - D[m])


def _update(Dk, Dv, c, n, n_next, seeds, assigned, kh, vc, learning_rate):
    """The update of the state, in place: seeded centroids first (D = key, value; c = 1), then every merge.

    Each centroid ``m < n'`` folds in the keys that joined it, ``S_m`` in
    token order, by the adaptive rule or with the constant ``learning_rate``;
    its count becomes ``c'_m = c_m + |S_m|``.
    """
    for j, i in enumerate(seeds):
        m = n + j
        Dk[m] = kh[i]
        Dv[m] = vc[i]
        c[m] = 1
    for m in range(n_next):
        members = [i for i in range(len(kh)) if assigned[i] == m]
        if not members:
            continue
        if learning_rate is None:
            _merge_running_mean(Dk, m, c[m], [kh[i] for i in members])
            _merge_running_mean(Dv, m, c[m], [vc[i] for i in members])
        else:
            eta = Dk.dtype.type(learning_rate)
            _merge_constant_rate(Dk, m, [kh[i] for i in members], eta)
            _merge_constant_rate(Dv, m, [vc[i] for i in members], eta)
        c[m] = c[m] + len(members)


def ovq_attention_loop(q, k, v, *, max_size, chunk_size, beta=None, growth="plateau", init="spread",
                       count_bias=True, learning_rate=None, seed=0):
    """OVQ attention, one token at a time.

    Parameters are those of :func:`refimpl.ovq.ovq_attention` (no ``state``).

    Returns
    -------
    out : ndarray, shape (N, d_v)
        For ``q, k`` of shape ``(N, d)`` and ``v`` of shape ``(N, d_v)``.
    state : LoopState
        ``D_k`` ``(n_max, d)``, ``D_v`` ``(n_max, d_v)``, ``c`` ``(n_max,)``,
        ``n``, ``t`` after the last chunk; ``n_max`` is ``max_size``.
    """
    q, k, v, dtype = _check_qkv(q, k, v)
    beta = _check_options(max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, q.shape[1])
    N, d = q.shape
    d_v = v.shape[1]
    n_max, C = max_size, chunk_size
    # the state: D_k, D_v, the counts c, n active rows, t tokens seen, all zero
    Dk = np.zeros((n_max, d), dtype=dtype)
    Dv = np.zeros((n_max, d_v), dtype=dtype)
    c = [0] * n_max
    n, t = 0, 0
    out = np.zeros((N, d_v), dtype=dtype)

    for s in range(0, N, C):
        e = min(s + C, N)
        L = e - s
        qh = [_unit(q[s + a]) for a in range(L)]
        kh = [_unit(k[s + a]) for a in range(L)]
        vc = [v[s + a] for a in range(L)]

        # Read-out, with the state before the chunk: position a attends to the n centroids and the keys b <= a
        for a in range(L):
            out[s + a] = _read_out(qh[a], kh[: a + 1], vc[: a + 1], Dk[:n], Dv[:n], c[:n], beta, count_bias)

        # Growth: t' = t + C', n' = max(n, growth(t', n_max))
        t_next = t + L
        n_next = max(n, _growth(t_next, n_max, growth))

        # Assignment: the keys that seed centroids n..n'-1, and the centroid each other key joins
        if n == 0:
            assigned, seeds = _assign_first_chunk(kh, n_next - n)
        else:
            assigned, seeds = _assign_later_chunk(kh, Dk[:n], n_next - n, init, seed, t)

        # Update: seeded centroids first, then every centroid merges the keys that joined it
        _update(Dk, Dv, c, n, n_next, seeds, assigned, kh, vc, learning_rate)
        n, t = n_next, t_next

    return out, LoopState(Dk, Dv, np.array(c, dtype=np.int64), n, t)


def vq_attention_loop(q, k, v, codebook, *, chunk_size, beta=None):
    """VQ attention, one token at a time.

    Parameters are those of :func:`refimpl.ovq.vq_attention`.

    Returns
    -------
    ndarray, shape (N, d_v)
    """
    q, k, v, dtype = _check_qkv(q, k, v)
    codebook = validation.as_float_array(codebook, "codebook", ndim=2)
    validation.check_shape(codebook, "codebook", (None, q.shape[1]), ("S", "d"))
    validation.check_int(chunk_size, "chunk_size", minimum=1)
    beta = math.sqrt(q.shape[1]) if beta is None else validation.check_positive_float(beta, "beta")
    dtype = np.result_type(dtype, codebook)
    q, k, v, codebook = (a.astype(dtype, copy=False) for a in (q, k, v, codebook))
    N, d = q.shape
    d_v = v.shape[1]
    S = codebook.shape[0]
    L_count = [0] * S
    U = [np.zeros(d_v, dtype=dtype) for _ in range(S)]  # sum of values per code
    out = np.zeros((N, d_v), dtype=dtype)

    def code(x):
        best, best_m = None, None
        for m in range(S):
            sim = np.dot(x, codebook[m])
            if best is None or sim > best:
                best, best_m = sim, m
        return best_m

    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        z = [code(_unit(k[i])) for i in range(s, e)]
        for a in range(e - s):
            qa = _unit(q[s + a])
            logits, rows = [], []
            for m in range(S):
                if L_count[m] > 0:
                    logits.append(beta * np.dot(qa, codebook[m]) + math.log(L_count[m]))
                    rows.append(U[m] / L_count[m])
            for b in range(a + 1):
                logits.append(beta * np.dot(qa, codebook[z[b]]))
                rows.append(v[s + b])
            p = _softmax(np.array(logits, dtype=dtype))
            out[s + a] = sum(p[j] * rows[j] for j in range(len(rows)))
        for b, i in enumerate(range(s, e)):
            L_count[z[b]] += 1
            U[z[b]] = U[z[b]] + v[i]
    return out
