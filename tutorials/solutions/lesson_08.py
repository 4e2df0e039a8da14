"""Worked solutions to lesson 8's exercises; try first.

Each solution is written to be read: the formula of the lesson, then the
code.  ``NEAR_MISSES`` lists plausible wrong answers, each of which the
check must reject.
"""

from __future__ import annotations

import numpy as np

from . import off_by  # near misses: small but real errors

# ---------------------------------------------------------------------------
# 8.1 The plateau growth curve, in exact integers
# ---------------------------------------------------------------------------


def plateau_size(t, n_max):
    """max(1, floor(t n_max / (t + n_max))) for t >= 1, and 0 before any token.

    Integer division keeps it exact: at t = n_max (n_max - 1) - 1 the quotient is
    n_max - 1 - 1 / (n_max^2 - 1), which for n_max = 10^6 lies 1e-12 below an integer,
    closer than the float64 spacing there: a float quotient rounds it up.
    """
    if t == 0:
        return 0
    return max(1, (t * n_max) // (t + n_max))


def _plateau_float(t, n_max):
    # wrong: the float quotient rounds n_max - 1 - 1e-12 up to n_max - 1 (n_max = 10^6)
    return 0 if t == 0 else max(1, int(t * n_max / (t + n_max)))


def _plateau_no_floor_of_one(t, n_max):
    # wrong: forgets max(1, .): with n_max = 1, floor(t / (t + 1)) = 0 for every t
    return (t * n_max) // (t + n_max)


def _plateau_linear(t, n_max):
    # wrong: the linear growth min(t, n_max), which fills the dictionary
    return min(t, n_max)


# ---------------------------------------------------------------------------
# 8.2 Write the OVQ assignment step
# ---------------------------------------------------------------------------


def assign_chunk(khat, dict_keys, n_add):
    """(rows, seeds) of one chunk, spread initialisation, ties to the lowest index.

    First chunk (n = 0): key 0 seeds centroid 0, the n_add - 1 keys least
    similar to it seed centroids 1.., and every other key joins centroid 0.
    Later chunks: each key's candidate is its largest dot product with the
    dictionary; the n_add keys with the smallest such scores seed rows
    n, n+1, ... in ascending order of score, and the others join their candidate.
    """
    L, n = khat.shape[0], dict_keys.shape[0]
    rows = np.zeros(L, dtype=np.int64)
    if n == 0:
        scores = khat[1:] @ khat[0]
        # a stable sort keeps equal scores in token order: ties go to the lowest index
        seeds = np.concatenate([[0], 1 + np.argsort(scores, kind="stable")[: n_add - 1]]).astype(np.int64)
    else:
        sims = khat @ dict_keys.T  # (L, n)
        rows[:] = np.argmax(sims, axis=1)  # argmax returns the first maximum: the lowest index
        scores = sims[np.arange(L), rows]
        seeds = np.argsort(scores, kind="stable")[:n_add].astype(np.int64)
    rows[seeds] = n + np.arange(seeds.size)
    return rows, seeds


def _assign_euclidean(khat, dict_keys, n_add):
    # wrong: the nearest centroid by distance, the k-means E-step, not OVQ's rule
    n = dict_keys.shape[0]
    if n == 0:
        return assign_chunk(khat, dict_keys, n_add)
    dist2 = np.sum((khat[:, None, :] - dict_keys[None, :, :]) ** 2, axis=2)
    rows = np.argmin(dist2, axis=1).astype(np.int64)
    scores = np.max(khat @ dict_keys.T, axis=1)
    seeds = np.argsort(scores, kind="stable")[:n_add].astype(np.int64)
    rows[seeds] = n + np.arange(seeds.size)
    return rows, seeds


def _assign_best_seed(khat, dict_keys, n_add):
    # wrong: seeds the keys the dictionary already represents best (largest scores)
    n = dict_keys.shape[0]
    if n == 0:
        return assign_chunk(khat, dict_keys, n_add)
    sims = khat @ dict_keys.T
    rows = np.argmax(sims, axis=1).astype(np.int64)
    seeds = np.argsort(-sims.max(axis=1), kind="stable")[:n_add].astype(np.int64)
    rows[seeds] = n + np.arange(seeds.size)
    return rows, seeds


def _assign_seeds_keep_rows(khat, dict_keys, n_add):
    # wrong: the seeds are chosen but still recorded as joining their candidate
    rows, seeds = assign_chunk(khat, dict_keys, n_add)
    if dict_keys.shape[0] > 0:
        rows[seeds] = np.argmax(khat[seeds] @ dict_keys.T, axis=1)
    return rows, seeds


def _assign_seeds_in_token_order(khat, dict_keys, n_add):
    # wrong: the right seeds, but numbered in token order rather than ascending score
    rows, seeds = assign_chunk(khat, dict_keys, n_add)
    n = dict_keys.shape[0]
    seeds = np.sort(seeds) if n > 0 else seeds
    rows[seeds] = n + np.arange(seeds.size)
    return rows, seeds


def _assign_first_chunk_most_similar(khat, dict_keys, n_add):
    # wrong: in the first chunk, seeds the keys most similar to key 0
    if dict_keys.shape[0] > 0:
        return assign_chunk(khat, dict_keys, n_add)
    rows = np.zeros(khat.shape[0], dtype=np.int64)
    seeds = np.concatenate([[0], 1 + np.argsort(-(khat[1:] @ khat[0]), kind="stable")[: n_add - 1]]).astype(np.int64)
    rows[seeds] = np.arange(seeds.size)
    return rows, seeds


# ---------------------------------------------------------------------------
# 8.3 A key whose largest dot product is not its nearest centroid
# ---------------------------------------------------------------------------

# The key points at 0 degrees.  Centroid 0 is short (norm 0.3, the mean of two
# unit keys 145 degrees apart) and points exactly at the key; centroid 1 is
# long (norm 1) and 60 degrees off.  Dot products: 0.3 and 0.5, so OVQ picks
# centroid 1; squared distances: (1 - 0.3)^2 = 0.49 and 2 - 2 * 0.5 = 1, so the
# nearest is centroid 0.  The dot product favours the longer centroid.
disagreement = (
    np.array([1.0, 0.0]),
    np.array([[0.3, 0.0], [np.cos(np.pi / 3), np.sin(np.pi / 3)]]),
)

# wrong: centroids of equal norm, where the two rules always agree
_equal_norms = (np.array([1.0, 0.0]), np.array([[np.cos(0.2), np.sin(0.2)], [np.cos(1.2), np.sin(1.2)]]))
# wrong: a "centroid" longer than one, which no mean of unit keys can be
_too_long = (np.array([1.0, 0.0]), np.array([[0.9, 0.0], [2.0, 1.5]]))
# wrong: a key that is not a unit vector
_not_unit = (np.array([2.0, 0.0]), disagreement[1])


# ---------------------------------------------------------------------------
# 8.4 The read-out backward of one chunk
# ---------------------------------------------------------------------------


def _readout_probabilities(qhat, keys, log_c, beta):
    """P = softmax(l) of one chunk: centroid logits plus log c, causal chunk logits."""
    L, n = qhat.shape[0], log_c.shape[0]
    logits = beta * (qhat @ keys.T)  # (L, n + L)
    logits[:, :n] += log_c
    future = np.triu(np.ones((L, L), dtype=bool), k=1)  # chunk key b > a: not visible
    logits[:, n:][future] = -np.inf
    logits -= logits.max(axis=1, keepdims=True)
    P = np.exp(logits)
    return P / P.sum(axis=1, keepdims=True)


def readout_backward(qhat, keys, values, log_c, beta, G):
    """Gradients of sum(G * O), O = softmax(l) values, l = beta qhat keys^T (+ log c, causal mask).

    dvalues = P^T G;  dP = G values^T;  dl = P * (dP - rowsum(P * dP));
    dqhat = beta dl keys;  dkeys = beta dl^T qhat.  Masked entries have P = 0
    and get nothing; log c is a constant.
    """
    P = _readout_probabilities(qhat, keys, log_c, beta)
    dP = G @ values.T
    dl = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    return beta * dl @ keys, beta * dl.T @ qhat, P.T @ G


def _readout_backward_no_rowsum(qhat, keys, values, log_c, beta, G):
    # wrong: drops the softmax's normalisation term, dl = P * dP
    P = _readout_probabilities(qhat, keys, log_c, beta)
    dl = P * (G @ values.T)
    return beta * dl @ keys, beta * dl.T @ qhat, P.T @ G


def _readout_backward_no_beta(qhat, keys, values, log_c, beta, G):
    # wrong: forgets the scale beta of the logits
    P = _readout_probabilities(qhat, keys, log_c, beta)
    dP = G @ values.T
    dl = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    return dl @ keys, dl.T @ qhat, P.T @ G


def _readout_backward_no_mask(qhat, keys, values, log_c, beta, G):
    # wrong: recomputes P without the causal mask, as if every chunk key were visible
    n = log_c.shape[0]
    logits = beta * (qhat @ keys.T)
    logits[:, :n] += log_c
    P = np.exp(logits - logits.max(axis=1, keepdims=True))
    P /= P.sum(axis=1, keepdims=True)
    dP = G @ values.T
    dl = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    return beta * dl @ keys, beta * dl.T @ qhat, P.T @ G


def _readout_backward_transposed(qhat, keys, values, log_c, beta, G):
    # wrong: dkeys with the product the other way round, qhat^T dl (shape (d, n + L))
    P = _readout_probabilities(qhat, keys, log_c, beta)
    dP = G @ values.T
    dl = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    return beta * dl @ keys, beta * qhat.T @ dl, P.T @ G


SOLUTIONS = {
    "8.1": plateau_size,
    "8.2": assign_chunk,
    "8.3": disagreement,
    "8.4": readout_backward,
}

NEAR_MISSES = {
    "8.1": {
        "a float division, which rounds up": _plateau_float,
        "the floor of one forgotten": _plateau_no_floor_of_one,
        "linear growth min(t, n_max)": _plateau_linear,
    },
    "8.2": {
        "the Euclidean nearest centroid": _assign_euclidean,
        "seeds with the largest scores": _assign_best_seed,
        "seeds still join their candidate rows": _assign_seeds_keep_rows,
        "seeds numbered in token order": _assign_seeds_in_token_order,
        "the keys most similar to key 0 seeded": _assign_first_chunk_most_similar,
    },
    "8.3": {
        "centroids of equal norms": _equal_norms,
        "a centroid longer than one": _too_long,
        "a key that is not a unit vector": _not_unit,
    },
    "8.4": {
        "the softmax normalisation term dropped": _readout_backward_no_rowsum,
        "beta forgotten": _readout_backward_no_beta,
        "the causal mask missing": _readout_backward_no_mask,
        "d_keys transposed": _readout_backward_transposed,
        "every value scaled by 1 + 1e-6": off_by(readout_backward, 1e-6),
    },
}
