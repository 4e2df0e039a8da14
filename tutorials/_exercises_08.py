"""Checks of lesson 8's exercises (OVQ attention: growth, assignment, the backward).

Each check builds its own seeded data at small sizes, calls the answer (or
reads the value) and compares with an independent result: ``refimpl.ovq``
(the growth curve, the assignment plans a forward records), a direct
computation of Euclidean distances, or central differences of a dense
read-out written here.  Machine epsilon is ``U`` (the glossary's $u$);
every tolerance says where it comes from.
"""

from __future__ import annotations

import numpy as np

import _hints
from _course import exercise
from refimpl import ovq

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16
# every implementation of OVQ in the project (public and private functions alike); unit_rows, a normalisation, is allowed
OVQ = ("refimpl.ovq", "refimpl.ovq_oracle", "cpu.ovq", "gpu.numba_cuda.ovq", "gpu.cupy_kernels.ovq")


def _call(answer, *args):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args)


# ---------------------------------------------------------------------------
# 8.1 the plateau
# ---------------------------------------------------------------------------


def _plateau_hint(got, expected, t, n_max):
    """What a wrong plateau size suggests: a float division, the floor of one, or linear growth."""
    if t >= 1 and got == min(t, n_max) != expected:
        return "linear growth: your size is min(t, n_max), which fills the dictionary, not the plateau"
    if t >= 1 and got == 0 and expected == 1:
        return "the floor of one forgotten: max(1, .) keeps one centroid from the first token on"
    if t >= 1 and got == expected + 1 and int(t * n_max / (t + n_max)) == got:  # the float quotient, rounded up
        return ("a float division: t n_max / (t + n_max) lies closer below an integer than the float64 spacing, and "
                "rounds up to it; integer division // does not")
    return None


@exercise("8.1", "The plateau growth curve, in exact integers", 1, points=2, partial=True,
          refuse=OVQ, allow=("refimpl.ovq.unit_rows",))
def check_plateau_size(plateau_size):
    """``plateau_size(t, n_max) -> int``: ``max(1, floor(t n_max / (t + n_max)))`` for ``t >= 1``, 0 for ``t = 0``.

    ``t`` and ``n_max`` are Python integers (``n_max >= 1``).  Compared with
    ``refimpl.ovq.dictionary_size`` for small ``t`` and ``n_max``, for
    ``t = 10**15``, and for ``t = n_max (n_max - 1) - 1``, where the quotient
    is ``n_max - 1 - 1 / (n_max**2 - 1)``: with ``n_max = 10**6`` it lies
    ``1e-12`` below an integer, closer than the float64 spacing there, and a
    floating-point division rounds it up.
    """
    cases = [(t, n_max) for n_max in range(1, 25) for t in range(0, n_max * (n_max + 1) + 3)]
    cases += [(10**15, n_max) for n_max in (2, 7, 64, 1000)]
    cases += [(n_max * (n_max - 1) - 1, n_max) for n_max in (30, 500, 10**6)]
    for t, n_max in cases:
        got = _call(plateau_size, t, n_max)
        assert np.ndim(got) == 0, f"plateau_size({t}, {n_max}) should be one integer, got shape {np.shape(got)}"
        expected = int(ovq.dictionary_size(t, n_max))
        # exact integers: no tolerance
        assert got == expected, _hints.explain(
            f"plateau_size({t}, {n_max}) = {got}, expected {expected} "
            "(max(1, floor(t n_max / (t + n_max))) for t >= 1, 0 for t = 0; use integer division //)",
            hints=[_plateau_hint(got, expected, t, n_max)])


# ---------------------------------------------------------------------------
# 8.2 the assignment step
# ---------------------------------------------------------------------------


def _check_plan(assign_chunk, khat, dict_keys, n_add, rows_expected, seeds_expected, where):
    L = khat.shape[0]
    out = _call(assign_chunk, khat.copy(), dict_keys.copy(), n_add)
    assert isinstance(out, tuple) and len(out) == 2, f"{where}: return the pair (rows, seeds), got {type(out).__name__}"
    rows, seeds = (np.asarray(a) for a in out)
    assert rows.shape == (L,), _hints.explain(f"{where}: rows should have shape (L,) = {(L,)}, got {rows.shape}",
                                              hints=[_hints.shape(rows.shape, (L,))])
    assert seeds.shape == (n_add,), _hints.explain(f"{where}: seeds should have shape (n_add,) = {(n_add,)}, got {seeds.shape}",
                                                   hints=[_hints.shape(seeds.shape, (n_add,))])
    assert np.issubdtype(rows.dtype, np.integer) and (seeds.size == 0 or np.issubdtype(seeds.dtype, np.integer)), (
        f"{where}: rows and seeds are integer indices, got dtypes {rows.dtype}, {seeds.dtype}"
    )
    # integer decisions: they must be equal, no tolerance
    n = dict_keys.shape[0]
    sims = khat @ dict_keys.T if n else khat[1:] @ khat[0]
    scores = sims.max(axis=1) if n else sims
    assert np.array_equal(seeds, seeds_expected), _hints.explain(
        f"{where}: seeds (chunk positions, in centroid order) {seeds.tolist()}, expected {seeds_expected.tolist()}",
        hints=[_seed_hint(seeds, seeds_expected, scores, n)])
    bad = np.flatnonzero(rows != rows_expected)
    assert bad.size == 0, _hints.explain(
        f"{where}: key {bad[0]} goes to row {rows[bad[0]]}, expected {rows_expected[bad[0]]} "
        f"(rows {rows.tolist()}, expected {rows_expected.tolist()})",
        hints=[_row_hint(rows, rows_expected, bad, khat, dict_keys, seeds)])


def _seed_hint(seeds, expected, scores, n):
    """What wrong seeds suggest: the right ones in another order, the best-represented keys, the most similar ones."""
    if sorted(seeds.tolist()) == sorted(expected.tolist()):
        return "the right seeds numbered in the wrong order: in token order, not in ascending order of score"
    k = expected.size - (0 if n else 1)
    order = np.argsort(-scores, kind="stable")[:k] + (0 if n else 1)
    if k > 0 and sorted(seeds.tolist()[(0 if n else 1):]) == sorted(order.tolist()):
        return ("seeds with the largest scores: the keys the dictionary represents best, where the worst (smallest) belong"
                if n else "the keys most similar to key 0 seeded, where the least similar spread the initialisation")
    return None


def _row_hint(rows, expected, bad, khat, dict_keys, seeds):
    """What a wrong row suggests: a seed that joins its candidate, or the Euclidean nearest centroid."""
    n = dict_keys.shape[0]
    if n == 0:
        return None
    key = int(bad[0])
    if key in seeds.tolist() and rows[key] == int(np.argmax(khat[key] @ dict_keys.T)):
        return "a seed still joins its candidate row: seed j updates the new row n + j"
    if rows[key] == int(np.argmin(np.sum((dict_keys - khat[key]) ** 2, axis=1))):
        return "the Euclidean nearest centroid: key goes to the closest row, OVQ's rule is the largest dot product"
    return None


@exercise("8.2", "Write the OVQ assignment step", 2, points=4, partial=True, refuse=OVQ, allow=("refimpl.ovq.unit_rows",))
def check_assign_chunk(assign_chunk):
    """``assign_chunk(khat, dict_keys, n_add) -> (rows, seeds)``: OVQ's assignment with spread initialisation.

    ``khat`` (L, d): the chunk's unit keys; ``dict_keys`` (n, d): the active
    rows of ``D_k`` before the chunk (``n = 0`` for the first chunk of a
    stream); ``n_add = n' - n`` new centroids.  ``seeds`` (n_add,): the chunk
    positions of the seeding keys in centroid order (row ``n + j`` is seeded
    by ``seeds[j]``); ``rows`` (L,): the row each key updates, ``n + j`` for
    seed ``j`` and the joined centroid for the others.  Ties go to the lowest
    index.  Compared with the plans ``refimpl.ovq.ovq_attention_forward``
    records, on a small tie case and on every chunk of two streams.
    """
    # ties, by hand: rows 0 and 2 of the dictionary are equal, keys 1 and 3 have equal scores
    s = np.sqrt(0.5)
    dict_keys = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    khat = np.array([[1.0, 0.0], [s, -s], [0.0, 1.0], [s, -s], [-s, s]])
    # scores (best dot product): 1, s (row 0), 1 (row 1), s (row 0), s (row 1); the two smallest, ties to the lowest index
    _check_plan(assign_chunk, khat, dict_keys, 2, np.array([0, 3, 1, 4, 1]), np.array([1, 3]), "tie case")
    # no new centroid: every key joins
    _check_plan(assign_chunk, khat, dict_keys, 0, np.array([0, 0, 1, 0, 1]), np.array([], dtype=np.int64), "n_add = 0")
    # every chunk of two streams, the first chunk (n = 0) included
    rng = np.random.default_rng(82)
    for N, d, n_max, C in ((40, 3, 12, 5), (64, 4, 24, 8)):
        k = rng.normal(size=(N, d))
        _, cache = ovq.ovq_attention_forward(k, k, rng.normal(size=(N, 2)), max_size=n_max, chunk_size=C)
        khat_all = ovq.unit_rows(k)
        for j, rec in enumerate(cache.records):
            _check_plan(assign_chunk, khat_all[rec.start:rec.stop], rec.dict_keys, rec.seeds.size, rec.rows, rec.seeds,
                        f"stream N = {N}, n_max = {n_max}, C = {C}, chunk {j} (n = {rec.n})")


# ---------------------------------------------------------------------------
# 8.3 dot product vs nearest centroid
# ---------------------------------------------------------------------------


@exercise("8.3", "A key whose largest dot product is not its nearest centroid", 2, points=4, partial=False)
def check_disagreement(disagreement):
    """``disagreement = (khat, dict_keys)``: a unit key (d,) and centroids (m, d), m >= 2, d >= 2, of norm <= 1.

    The centroids can be means of unit keys (every vector of norm at most
    one in ``d >= 2`` is the mean of two unit vectors).  OVQ's choice,
    ``argmax_m khat . D_k[m]``, must differ from the Euclidean nearest
    centroid, ``argmin_m ||khat - D_k[m]||``, and both choices must win by a
    margin of at least ``1e-6`` (no tie that rounding could decide).
    """
    assert isinstance(disagreement, tuple) and len(disagreement) == 2, "give the pair (khat, dict_keys)"
    khat, dict_keys = (np.asarray(a, dtype=np.float64) for a in disagreement)
    assert khat.ndim == 1 and khat.size >= 2, f"khat should be one key of shape (d,), d >= 2, got shape {khat.shape}"
    d = khat.size
    assert dict_keys.ndim == 2 and dict_keys.shape[0] >= 2 and dict_keys.shape[1] == d, (
        f"dict_keys should have shape (m, d) = (m, {d}) with m >= 2, got {dict_keys.shape}"
    )
    # a norm computed from d squares is off by a few u: allow 4 d u
    assert abs(np.linalg.norm(khat) - 1) <= 4 * d * U, _hints.explain(
        f"khat must be a unit key, its norm is {float(np.linalg.norm(khat)):.17g}",
        hints=["a key that is not a unit vector: OVQ normalises every key, khat = k / ||k||"])
    norms = np.linalg.norm(dict_keys, axis=1)
    assert np.all(norms <= 1 + 4 * d * U), _hints.explain(
        f"centroid {int(np.argmax(norms))} has norm {norms.max():.6f} > 1: a mean of unit keys is never longer than one",
        hints=["a centroid longer than one: no mean of unit keys can be"])
    dots = dict_keys @ khat
    dist2 = np.sum((dict_keys - khat) ** 2, axis=1)
    by_dot, by_dist = int(np.argmax(dots)), int(np.argmin(dist2))
    assert by_dot != by_dist, _hints.explain(
        f"both rules pick centroid {by_dot} (dot products {np.round(dots, 4).tolist()}, squared distances "
        f"{np.round(dist2, 4).tolist()}): they differ only when the centroids have different norms",
        hints=[f"centroids of equal norms ({np.round(norms, 4).tolist()}): then ||khat - D||^2 = 2 - 2 khat . D and the "
               "two rules always agree" if np.ptp(norms) <= 1e-12 else None])
    margin_dot = dots[by_dot] - np.max(np.delete(dots, by_dot))
    margin_dist = np.min(np.delete(dist2, by_dist)) - dist2[by_dist]
    # margins far above rounding (a few u on quantities of size at most 4)
    assert min(margin_dot, margin_dist) >= 1e-6, (
        f"a near tie: the dot-product choice wins by {margin_dot:.1e}, the nearest by {margin_dist:.1e} (need >= 1e-6)"
    )


# ---------------------------------------------------------------------------
# 8.4 the read-out backward
# ---------------------------------------------------------------------------


def _readout_loss(qhat, keys, values, log_c, beta, G, causal=True):
    """Dense forward of one chunk's read-out, loss ``sum(G * O)``, written directly from the lesson's formula.

    With ``causal=False`` every chunk key is visible to every position (what a missing mask computes).
    """
    L, n = qhat.shape[0], keys.shape[0] - qhat.shape[0]
    loss = 0.0
    for a in range(L):
        cols = list(range(n)) + [n + b for b in range(a + 1 if causal else L)]  # the centroids and the chunk keys b <= a
        logits = np.array([beta * qhat[a] @ keys[m] + (log_c[m] if m < n else 0.0) for m in cols])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        loss += G[a] @ (w @ values[cols])
    return loss


def _fd(loss, x, h):
    g = np.zeros_like(x)
    for e in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[e] += h
        xm[e] -= h
        g[e] = (loss(xp) - loss(xm)) / (2 * h)
    return g


@exercise("8.4", "The read-out backward of one chunk", 3, points=6, partial=True, refuse=OVQ, allow=("refimpl.ovq.unit_rows",))
def check_readout_backward(readout_backward):
    """``readout_backward(qhat, keys, values, log_c, beta, G) -> (d_qhat, d_keys, d_values)``.

    One chunk of ``L`` positions reading ``n`` centroids: ``qhat`` (L, d),
    ``keys = [D_k[:n]; khat]`` (n + L, d), ``values = [D_v[:n]; v]``
    (n + L, d_v), ``log_c`` (n,), ``G = dL/dO`` (L, d_v).  Logits
    ``beta qhat_a . keys[m] + log_c[m]`` for the centroids, ``beta qhat_a .
    keys[n + b]`` for ``b <= a`` and none for ``b > a``; ``O = softmax(l)
    values``.  Returns the gradients of ``L = sum(G * O)`` with respect to
    ``qhat``, ``keys`` and ``values`` (treated as independent arrays), in
    their shapes.  Compared with central differences of a dense forward.
    """
    rng = np.random.default_rng(84)
    for n, L, d, d_v, beta in ((3, 4, 3, 2, 1.7), (0, 3, 2, 2, 2.0), (5, 2, 4, 3, 0.8)):
        qhat = ovq.unit_rows(rng.normal(size=(L, d)))
        keys = np.concatenate([0.7 * ovq.unit_rows(rng.normal(size=(n, d))), ovq.unit_rows(rng.normal(size=(L, d)))])
        values = rng.normal(size=(n + L, d_v))
        log_c = np.log(rng.integers(1, 6, size=n).astype(float))
        G = rng.normal(size=(L, d_v))
        out = _call(readout_backward, qhat.copy(), keys.copy(), values.copy(), log_c.copy(), beta, G.copy())
        assert isinstance(out, tuple) and len(out) == 3, "return the triple (d_qhat, d_keys, d_values)"
        got = [np.asarray(a) for a in out]
        where = f"n = {n}, L = {L}, d = {d}, d_v = {d_v}, beta = {beta}"
        args = {"qhat": qhat, "keys": keys, "values": values}
        losses = {
            "qhat": lambda x: _readout_loss(x, keys, values, log_c, beta, G),
            "keys": lambda x: _readout_loss(qhat, x, values, log_c, beta, G),
            "values": lambda x: _readout_loss(qhat, keys, x, log_c, beta, G),
        }
        h = 1e-6
        # rounding of the difference quotient: (n + L + d + L d_v) additions of terms at most max|v| sum|G|, divided by h;
        # truncation h^2/6 |L'''| with |L'''| <~ beta^3 2 max|v| sum|G| (inputs of norm <= 1); docs/floating_point.md, Lesson 8
        scale = np.max(np.abs(values)) * np.sum(np.abs(G))
        tol = (n + L + d + L * d_v) * U * scale / h + h**2 / 6 * max(beta, 1.0) ** 3 * 2 * scale
        unmasked = {
            "qhat": lambda x: _readout_loss(x, keys, values, log_c, beta, G, causal=False),
            "keys": lambda x: _readout_loss(qhat, x, values, log_c, beta, G, causal=False),
            "values": lambda x: _readout_loss(qhat, keys, x, log_c, beta, G, causal=False),
        }
        # the softmax backward's rows sum to zero, so do the key gradients summed over the keys
        d_keys = got[1] if got[1].shape == keys.shape else None
        key_sum = None if d_keys is None else np.abs(np.sum(d_keys, axis=0)).max()
        rowsum_hint = (f"the softmax normalisation term dropped: your key gradients sum to {key_sum:.3g} over the keys, "
                       "not 0; dl = P * (dP - sum(P * dP)) subtracts each row's sum"
                       if key_sum is not None and key_sum > (n + L) * tol else None)
        for (name, x), g in zip(args.items(), got):
            assert g.shape == x.shape, _hints.explain(
                f"{where}: d_{name} should have the shape of {name}, {x.shape}, got {g.shape}",
                hints=[_hints.shape(g.shape, x.shape)])
            fd = _fd(losses[name], x, h)
            err = np.abs(g - fd)
            worst = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
            ok = np.all(np.isfinite(g)) and err[worst] <= tol
            assert ok, _hints.explain(
                f"{where}: d_{name}{list(worst)} = {g[worst]:.6g}, central differences give {fd[worst]:.6g} "
                f"(error {err[worst]:.1e}, allowed {tol:.1e})",
                g, fd, factors={"beta": beta}, hints=[rowsum_hint],
                known=None if ok else {"the causal mask missing: the gradient of a read-out where every chunk key is visible":
                                       _fd(unmasked[name], x, h)})
