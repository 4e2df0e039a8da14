"""Checks of lesson 9's exercises (GPU kernels without a framework).

Each check builds its own seeded inputs, calls the answer and compares with
an independent result: SciPy's and ``refimpl``'s log-sum-exp and softmax,
the dense prefix sums of the chunked scan, ``refimpl.gma.gma`` and
``refimpl.attention.softmax_attention``.  The kernel exercises are answered
by a host function that launches the student's kernel; without a GPU the
kernel runs in the CUDA simulator (every thread a Python thread), so the
sizes are tiny and each check takes well under two seconds.

In the simulator, ``math.exp`` of a large number and a division by zero
raise Python errors where a GPU would quietly give ``inf`` or ``nan`` (and
an invalid operation on a NumPy number warns, an error where warnings are
errors); the checks report these as a wrong answer.
"""

from __future__ import annotations

import math
import re
import sys

import gpu

gpu.use_simulator_without_device()  # before numba is imported (the lesson's first cell did it already)

import numpy as np  # noqa: E402
from scipy.special import logsumexp  # noqa: E402

import gpu.numba_cuda  # noqa: E402,F401  (installs the simulator's shared-array fix)
import _hints  # noqa: E402
from _course import exercise  # noqa: E402
from refimpl import attention, gma, gmm, numerics  # noqa: E402


def _call(answer, *args, **kwargs):
    """``answer(*args)``; an arithmetic error (the simulator's overflow or division by zero) is a wrong answer."""
    try:
        return answer(*args, **kwargs)
    except NotImplementedError:
        raise
    except (ArithmeticError, RuntimeWarning) as err:  # a RuntimeWarning is raised where warnings are errors
        raise AssertionError(_raised(err)) from err


# an overflow in a kernel: no row maximum, or a maximum read from shared memory before every thread wrote it
OVERFLOW = ("an overflow: exp of a number above about 709; subtract the row maximum before exp, and if you do, a "
            "maximum read from shared memory before every thread wrote it (a missing cuda.syncthreads()) does this too")


def _raised(err):
    """The message for an arithmetic error the simulator raised, with what it suggests."""
    text = str(err)
    warned = isinstance(err, RuntimeWarning)
    division = isinstance(err, ZeroDivisionError) or (warned and "divide" in text)
    return _hints.explain(
        f"your function raised {type(err).__name__}: {err}. In the simulator, math.exp of a number above "
        "about 709 and a division by zero raise errors, and -inf - (-inf) on a NumPy number warns; "
        "on a GPU they would give inf or nan.",
        hints=[OVERFLOW if isinstance(err, OverflowError) or (warned and "overflow" in text and not division) else None,
               "a division by 0, inf or nan: the sum it divides by is at least 1 once the row maximum is subtracted, "
               "unless that sum or maximum was read from shared memory before every thread wrote it (a missing "
               "cuda.syncthreads())" if division else None,
               "no guard for -inf - (-inf): an invalid operation, where a running maximum still at -inf meets an entry "
               "-inf; skip the rescaling while the maximum is -inf" if warned and "invalid" in text and not division
               else None])


def _error_text(err):
    """An error's type and message without the simulator's thread and block indices (which thread fails first varies)."""
    return type(err).__name__, re.sub(r"tid=\[[^]]*\] ctaid=\[[^]]*\]: ", "", str(err))


def _outcome(answer, *args):
    """``answer(*args)`` run once: (result, None), or (None, the arithmetic error it raised)."""
    try:
        return np.asarray(answer(*args)), None
    except NotImplementedError:
        raise
    except (ArithmeticError, RuntimeWarning) as err:
        return None, err


def _same(first, second):
    """Whether two outcomes of :func:`_outcome` agree: the same error type, or equal arrays (nan equal to nan)."""
    (a, ea), (b, eb) = first, second
    if ea is not None or eb is not None:
        return ea is not None and eb is not None and _error_text(ea) == _error_text(eb)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _runs(answer, *args, more=0):
    """Outcomes of ``answer(*args)`` run twice, the second time with the simulator's threads switching five times
    as often (another interleaving of the threads between barriers), and ``more`` runs after those."""
    interval = sys.getswitchinterval()
    outcomes = [_outcome(answer, *args)]
    try:
        sys.setswitchinterval(interval / 5)
        outcomes.append(_outcome(answer, *args))
    finally:
        sys.setswitchinterval(interval)
    outcomes += [_outcome(answer, *args) for _ in range(more)]
    return outcomes


def _race(outcomes):
    """A hint when the outcomes of one input differ from run to run: a race."""
    for other in outcomes[1:]:
        if not _same(outcomes[0], other):
            (a, ea), (b, eb) = outcomes[0], other
            if ea is None and eb is None:
                return _hints.nondeterministic(a, b)
            what = [f"raised {type(e).__name__}" if e is not None else "returned" for e in (ea, eb)]
            return (f"a race: on the same input one run of your kernel {what[0]} and another {what[1]}: "
                    "a missing cuda.syncthreads() between writing shared memory and reading it")
    return None


def _shape(a, expected, what):
    a = np.asarray(a)
    assert a.shape == expected, _hints.explain(f"{what}: expected shape {expected}, got {a.shape}",
                                               hints=[_hints.shape(a.shape, expected)])
    return a


def _probe_lse(lse_combine):
    """Hints from two small combinations whose results are known: (0, 1) with (-1, 1), in both orders."""
    exact = 1 + math.exp(-1.0)  # S of either order; M = 0
    hints = []
    for first, second, which in (((0.0, 1.0), (-1.0, 1.0), "second"), ((-1.0, 1.0), (0.0, 1.0), "first")):
        try:
            M, S = (float(g) for g in lse_combine(*first, *second))
        except (ArithmeticError, RuntimeWarning, TypeError, ValueError):
            continue
        if M == -1.0:
            hints.append(f"the minimum, not the maximum: combining {first} and {second} gives M = -1")
        elif S == 2.0:
            hints.append(f"the {which} sum not rescaled: combining {first} and {second} gives S = 2, not 1 + e^-1 "
                         f"(s of the pair with the smaller m is multiplied by e^(m - M))")
        elif M == 0.0 and S != exact:
            line = _hints.constant_factor(S, exact)
            hints.append(line and f"combining {first} and {second}: your S = {S!r}, exactly {exact!r}: {line}")
    return list(dict.fromkeys(h for h in hints if h))


@exercise("9.1", "Combine two log-sum-exp pairs", 1, points=2, partial=True)
def check_lse_combine(lse_combine):
    """``lse_combine(m1, s1, m2, s2) -> (M, S)``: the exact combination of two log-sum-exp pairs.

    A pair ``(m, s)`` stands for ``m + log s`` with ``m`` the maximum of its
    numbers and ``s = sum exp(x - m)``; the empty pair is ``(-inf, 0)``.  The
    result must be ``M = max(m1, m2)``, ``S = s1 e^(m1 - M) + s2 e^(m2 - M)``,
    and the empty pair combined with itself must stay ``(-inf, 0)`` (no nan).
    """
    rng = np.random.default_rng(91)

    def pair(x):
        if x.size == 0:
            return -math.inf, 0.0
        m = float(x.max())
        return m, float(np.sum(np.exp(x - m)))

    # the empty pair is the identity, and combines with itself without a nan
    got = _call(lse_combine, -math.inf, 0.0, -math.inf, 0.0)
    assert len(got) == 2, f"expected a pair (M, S), got {got!r}"
    M, S = (float(g) for g in got)
    assert M == -math.inf and S == 0.0, _hints.explain(
        f"empty (+) empty: expected (-inf, 0), got ({M}, {S})",
        hints=["no guard for two empty pairs: -inf - (-inf) = nan; return (-inf, 0) when M = -inf" if math.isnan(S) else None])
    M, S = (float(g) for g in _call(lse_combine, -math.inf, 0.0, 2.5, 3.0))
    assert (M, S) == (2.5, 3.0), _hints.explain(f"empty (+) (2.5, 3.0): expected (2.5, 3.0) exactly, got ({M}, {S})",
                                                hints=_probe_lse(lse_combine))
    M, S = (float(g) for g in _call(lse_combine, 2.5, 3.0, -math.inf, 0.0))
    assert (M, S) == (2.5, 3.0), _hints.explain(f"(2.5, 3.0) (+) empty: expected (2.5, 3.0) exactly, got ({M}, {S})",
                                                hints=_probe_lse(lse_combine))

    for trial in range(20):
        x = rng.standard_normal(int(rng.integers(1, 40))) * 300.0  # exp(x) alone would overflow
        cuts = np.sort(rng.integers(0, x.size + 1, size=5))  # five cuts: some pieces may be empty
        pieces = [pair(p) for p in np.split(x, cuts)]
        # a left fold, then a tree: both orders must give the same log-sum-exp
        m, s = pieces[0]
        for m2, s2 in pieces[1:]:
            m, s = (float(g) for g in _call(lse_combine, m, s, m2, s2))
        level = pieces
        while len(level) > 1:
            nxt = [tuple(float(g) for g in _call(lse_combine, *level[i], *level[i + 1])) for i in range(0, len(level) - 1, 2)]
            level = nxt + ([level[-1]] if len(level) % 2 else [])
        expected = float(logsumexp(x))
        for order, (mm, ss) in (("left fold", (m, s)), ("tree", level[0])):
            assert mm == float(x.max()), _hints.explain(f"trial {trial}, {order}: M = {mm}, expected the maximum {x.max()}",
                                                        hints=_probe_lse(lse_combine))
            got = mm + math.log(ss) if ss > 0 else -math.inf
            # M is exact; S is a sum of at most 40 terms in (0, 1] with a few roundings each: relative 1e-13 is ~20x that
            assert abs(got - expected) <= 1e-13 * max(1.0, abs(expected)), _hints.explain(
                f"trial {trial}, {order} over {x.size} numbers in {len(pieces)} pieces: M + log S = {got!r}, "
                f"scipy's logsumexp = {expected!r}", hints=_probe_lse(lse_combine))


@exercise("9.2", "A row-softmax kernel", 2, points=4, partial=True, kernel=True,
          refuse=("refimpl.numerics.softmax", "refimpl.gmm.softmax", "scipy.special.softmax"))
def check_row_softmax(row_softmax):
    """``row_softmax(a) -> p``: the softmax of each row of ``a`` (N, K), computed by a kernel, shape (N, K).

    One block per row, threads strided over the entries, the block's maximum
    and sum by trees in shared memory.  Entries reach 1e3 in size (``exp``
    alone overflows) and a row may hold ``-inf`` (a component of weight 0),
    whose probability must be exactly 0.
    """
    rng = np.random.default_rng(92)
    for R, n in ((3, 13), (2, 3)):  # 13 entries: more than the threads; 3: fewer
        a = rng.standard_normal((R, n)) * 300.0
        a[R - 1, n // 2] = -math.inf
        expected = numerics.softmax(a, axis=1)
        # the kernel twice on the same input: a race shows as two different results (or one error)
        outcomes = _runs(row_softmax, a.copy())
        race = _race(outcomes)
        p, error = outcomes[0]
        # a - max carries an absolute rounding of about |a| u ~ 1e3 * 2.2e-16, which exp turns into a relative error;
        # the sum of n <= 13 terms adds n u: 1e-11 is ~30x that
        if race is None and (error is not None or p.shape != (R, n) or not np.allclose(p, expected, rtol=0, atol=1e-11)):
            race = _race(outcomes + _runs(row_softmax, a.copy(), more=2))  # wrong: a few more runs look for a race
        assert race is None, _hints.explain(f"{R} x {n}: two runs of your kernel on one input disagree", hints=[race])
        if error is not None:
            raise AssertionError(_raised(error)) from error
        p = _shape(p, (R, n), f"row_softmax of a {R} x {n} array")
        nan_at_inf = bool(np.isnan(p[R - 1]).any())
        assert np.all(np.isfinite(p)), _hints.explain(
            f"{R} x {n}: non-finite entries at {np.argwhere(~np.isfinite(p)).tolist()} "
            "(large entries, or -inf - (-inf) = nan when a thread's first entry is -inf?)",
            p, expected, hints=["no guard for -inf - (-inf): NaN in the row that holds -inf, where a running maximum "
                                "still at -inf meets an entry -inf; skip the rescaling while the maximum is -inf"
                                if nan_at_inf else None])
        assert p[R - 1, n // 2] == 0.0, _hints.explain(
            f"{R} x {n}: the entry -inf must have probability 0, got {p[R - 1, n // 2]}",
            hints=["exp(-inf - M) is exactly 0: is the entry -inf replaced, or skipped by a thread?"])
        err = np.abs(p - expected)
        worst = np.unravel_index(np.argmax(err), err.shape)
        assert err.max() <= 1e-11, _hints.explain(
            f"{R} x {n}: entry {tuple(int(i) for i in worst)} is {float(p[worst])!r}, refimpl's softmax gives "
            f"{float(expected[worst])!r} (error {err.max():.1e}, allowed 1e-11)",
            p, expected, rows=1, normalised=(1, 1.0))


@exercise("9.3", "The chunk states of the causal scan", 2, points=4, partial=True, kernel=True)
def check_chunk_states(chunk_states):
    """``chunk_states(gamma_k, v, C) -> S``, shape (ceil(N / C), K, d_v + 1), computed by kernels.

    ``S[c] = sum over the tokens j < c C of gamma_k[j]^T [v_j, 1]``: the
    exclusive prefix of the chunk states (steps 1 and 2 of section 4).
    """
    rng = np.random.default_rng(93)
    N, K, d_r, d_v, C = 13, 3, 2, 2, 4  # the last chunk is short
    x_q, x_k = rng.standard_normal((N, d_r)), rng.standard_normal((N, d_r))
    vals = rng.standard_normal((N, d_v))
    mu, var, w = rng.standard_normal((K, d_r)), 0.5 + rng.random((K, d_r)), np.full(K, 1 / K)
    g_q, g_k = gmm.responsibilities(x_q, mu, var, w), gmm.responsibilities(x_k, mu, var, w)
    n_chunks = -(-N // C)
    S = _shape(_call(chunk_states, g_k.copy(), vals.copy(), C), (n_chunks, K, d_v + 1),
               f"chunk_states with N = {N}, K = {K}, d_v = {d_v}, C = {C}")
    v1 = np.hstack([vals, np.ones((N, 1))])
    # sums of at most 13 terms of size <= 3: rounding below 13 u * 39 ~ 1e-13; allowed 1e-12
    for c in range(n_chunks):
        dense = g_k[: c * C].T @ v1[: c * C]  # every token before chunk c, directly
        err = np.max(np.abs(S[c] - dense))
        before = f"the tokens 0..{c * C - 1}" if c else "no token (it is zero)"
        hint = ""
        if np.max(np.abs(S[c][:, :-1] - dense[:, :-1])) <= 1e-12:
            hint = " (only the last column is wrong: it is the mass z, the sum of gamma_k alone)"
        edges = [b for b in range(C, min(c * C, N - 1) + 1, C)]  # the first token of each later chunk before chunk c
        assert err <= 1e-12, _hints.explain(
            f"S[{c}] should sum {before}: every token before chunk {c}, none of its own; "
            f"max difference to that sum {err:.1e}, allowed 1e-12{hint}",
            S[c], dense, known={
                f"the inclusive prefix: S[{c}] counts chunk {c}'s own tokens too": g_k[: (c + 1) * C].T @ v1[: (c + 1) * C],
                "chunks one token too long: the first token of each chunk after the first counted twice, at the chunk "
                "boundaries": dense + sum((np.outer(g_k[b], v1[b]) for b in edges), np.zeros_like(dense)),
            })
    # and with step 3 in NumPy, the states give refimpl's causal GMA
    num = np.vstack([g_q[a : a + C] @ S[c] + np.tril(g_q[a : a + C] @ g_k[a : a + C].T) @ v1[a : a + C]
                     for c, a in enumerate(range(0, N, C))])
    out = num[:, :-1] / (num[:, -1:] + 1e-6)
    causal = gma.gma(x_q, x_k, vals, mu, var, w, causal=True, chunk_size=C)
    err = np.max(np.abs(out - causal))
    assert err <= 1e-12, _hints.explain(
        f"the three steps with your states differ from refimpl's causal GMA by {err:.1e} (allowed 1e-12)",
        out, causal, axes={0: "token"}, block=(C, 0, "chunk"), tol=1e-12)


def _probe_rescaling(online_attention):
    """A hint from 40 keys where only the last has a large score: the output must follow that key's value."""
    n = 40
    q, k = np.ones((n, 1)), np.zeros((n, 1))
    k[-1] = 20.0  # score 20 for the last key, 0 for the others: its weight is 1 - 39 e^-20
    v = np.ones((n, 1))
    v[-1] = 0.0
    out, error = _outcome(online_attention, q, k, v, False)
    if error is None and out.shape == (n, 1) and np.all(out > 0.5):
        return ("the accumulator not rescaled when the maximum grows: 39 keys of score 0 and value 1, then one of score 20 "
                f"and value 0, give you {float(out[0, 0]):.3g} where softmax gives {39 * math.exp(-20):.1e}: the earlier keys "
                "keep their weight; multiply y by exp(m_old - m_new) as you do l")
    return None


@exercise("9.4", "A tiled online-softmax attention kernel", 3, points=6, partial=True, kernel=True,
          refuse=("refimpl.attention.softmax_attention", "refimpl.attention.softmax_attention_forward"))
def check_online_attention(online_attention):
    """``online_attention(q, k, v, causal) -> O``: softmax attention of one sequence by a tiled kernel, (N, d_v).

    Scores ``q_i . k_j / sqrt(d)``; when ``causal``, query ``i`` reads the
    keys ``j <= i``.  One thread per query row keeps the running ``(m, l, y)``
    of section 3 while the block stages tiles of keys and values in shared
    memory.
    """
    rng = np.random.default_rng(94)
    N, d, d_v = 10, 3, 2  # N is not a multiple of a tile of 4
    q = rng.standard_normal((N, d)) * 15.0  # large scores: the running maximum changes from tile to tile
    k, v = rng.standard_normal((N, d)), rng.standard_normal((N, d_v))
    for causal in (False, True):
        expected = attention.softmax_attention(q, k, v, causal=causal)
        outcomes = _runs(online_attention, q.copy(), k.copy(), v.copy(), causal)
        race = _race(outcomes)
        assert race is None, _hints.explain(f"causal={causal}: two runs of your kernel on one input disagree", hints=[race])
        out, error = outcomes[0]
        if error is not None:
            raise AssertionError(_raised(error)) from error
        out = _shape(out, (N, d_v), f"online_attention with N = {N}, d = {d}, d_v = {d_v}, causal={causal}")
        # outputs are convex combinations of |v| <= 3; the rescalings add a few roundings per tile: 1e-12 is ~100 u |v|
        err = np.abs(out - expected)
        row = int(np.argmax(err.max(axis=1)))
        ok = bool(np.all(np.isfinite(out)) and err.max() <= 1e-12)
        assert ok, _hints.explain(
            f"causal={causal}: row {row} is {out[row]}, refimpl's softmax attention gives {expected[row]} "
            f"(max error {np.nanmax(err):.1e}, allowed 1e-12)",
            out, expected, hints=[] if ok else [_probe_rescaling(online_attention)], known={
                "the scores not scaled by 1 / sqrt(d)": attention.softmax_attention(q * np.sqrt(d), k, v, causal=causal),
            })
