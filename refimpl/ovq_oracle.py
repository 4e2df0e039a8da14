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

        # Predict: one softmax over the n centroids and the chunk keys b <= a
        for a in range(L):
            logits, rows = [], []
            for m in range(n):
                logit = beta * np.dot(qh[a], Dk[m])
                if count_bias:
                    logit += np.log(dtype.type(c[m]))
                logits.append(logit)
                rows.append(Dv[m])
            for b in range(a + 1):
                logits.append(beta * np.dot(qh[a], kh[b]))  # a raw key: count 1, log 1 = 0
                rows.append(vc[b])
            p = _softmax(np.array(logits, dtype=dtype))
            o = np.zeros(d_v, dtype=dtype)
            for j in range(len(rows)):
                o += p[j] * rows[j]
            out[s + a] = o

        # Grow
        t_next = t + L
        n_next = max(n, _growth(t_next, n_max, growth))
        n_new = n_next - n

        # Assign
        assigned = [None] * L  # centroid each non-seeding key joins
        seeds = []  # keys seeding centroids n, n+1, ... in this order
        if n == 0:
            seeds.append(0)
            score = {i: np.dot(kh[i], kh[0]) for i in range(1, L)}
            by_score = sorted(range(1, L), key=lambda i: (score[i], i))
            seeds += by_score[: n_new - 1]
            for i in range(1, L):
                if i not in seeds:
                    assigned[i] = 0
        else:
            score = []
            for i in range(L):
                best, best_m = None, None
                for m in range(n):
                    sim = np.dot(kh[i], Dk[m])
                    if best is None or sim > best:  # strict: ties keep the lowest index
                        best, best_m = sim, m
                assigned[i] = best_m
                score.append(best)
            if n_new > 0:
                if init == "spread":
                    seeds = sorted(range(L), key=lambda i: (score[i], i))[:n_new]
                else:
                    rng = np.random.default_rng([seed, t])
                    seeds = [int(i) for i in rng.choice(L, size=n_new, replace=False)]
            for i in seeds:
                assigned[i] = None

        # Update: seeded centroids first (D = key, value; c = 1) ...
        for j, i in enumerate(seeds):
            m = n + j
            Dk[m] = kh[i]
            Dv[m] = vc[i]
            c[m] = 1
        # ... then every centroid folds in the keys assigned to it, sums in token order
        for m in range(n_next):
            members = [i for i in range(L) if assigned[i] == m]
            if not members:
                continue
            if learning_rate is None:
                sum_k = np.zeros(d, dtype=dtype)
                sum_v = np.zeros(d_v, dtype=dtype)
                for i in members:
                    sum_k += kh[i]
                    sum_v += vc[i]
                c_old, c_new = c[m], c[m] + len(members)
                Dk[m] = (dtype.type(c_old) * Dk[m] + sum_k) / dtype.type(c_new)
                Dv[m] = (dtype.type(c_old) * Dv[m] + sum_v) / dtype.type(c_new)
            else:
                # constant step, token by token in token order: D <- D + eta (x_i - D)
                eta = dtype.type(learning_rate)
                for i in members:
                    Dk[m] = Dk[m] + eta * (kh[i] - Dk[m])
                    Dv[m] = Dv[m] + eta * (vc[i] - Dv[m])
                c_new = c[m] + len(members)
            c[m] = c_new
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
