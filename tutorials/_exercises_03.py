"""Checks of lesson 3's exercises (causal GMA: prefix sums, suffix sums, a sliding window).

Each check builds its own seeded responsibilities and values at small sizes,
calls the answer and compares it with an independent result: the explicit
masked form ``D^{-1} A V`` with an ``N x N`` (or banded) mask built here, the
sums ``Gamma_K^T V`` and ``Gamma_K^T 1`` for a final state, and a
``tracemalloc`` peak for "without the ``N x N`` matrix".  Machine epsilon is
``U`` (the glossary's $u$); every tolerance says where it comes from, and
most are the rounding model of lessons 2 and 3: two orders of summation of
at most ``n`` terms that are nonnegative weights times values agree to
``4 (n + K + 1) u max|v|`` (``docs/floating_point.md``, section Lesson 3).
"""

from __future__ import annotations

import tracemalloc

import numpy as np

import _hints
from _course import exercise

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16
# every implementation of the causal mixing in the project: the reference's modules, tuned, the CPU and GPU versions
MIXING = ("refimpl.scan", "refimpl.attention", "refimpl.gma", "refimpl.tuned", "cpu", "gpu")
U32 = np.finfo(np.float32).eps  # machine epsilon of float32, 1.2e-7


def _call(answer, *args, **kwargs):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args, **kwargs)


def _problem(n, K, d_v, seed, dtype=np.float64, offset=0.0):
    """Seeded responsibilities (rows on the simplex) for queries and keys, and values."""
    rng = np.random.default_rng(seed)
    gamma_q = rng.dirichlet(np.ones(K), size=n)
    gamma_k = rng.dirichlet(np.ones(K), size=n)
    v = offset + rng.normal(size=(n, d_v))
    return gamma_q.astype(dtype), gamma_k.astype(dtype), v.astype(dtype)


def _masked(gamma_q, gamma_k, v, mask, eps):
    """The explicit form: (M * A) V / ((M * A) 1 + eps) with A = Gamma_Q Gamma_K^T, in float64."""
    gamma_q, gamma_k, v = (np.asarray(a, dtype=np.float64) for a in (gamma_q, gamma_k, v))
    a = (gamma_q @ gamma_k.T) * mask
    return (a @ v) / (a.sum(axis=1) + eps)[:, None]


def _as_output(out, n, d_v, what):
    out = np.asarray(out)
    assert out.shape == (n, d_v), _hints.explain(
        f"{what}: expected an output of shape (N, d_v) = {(n, d_v)}, got {out.shape}", hints=[_hints.shape(out.shape, (n, d_v))])
    assert np.all(np.isfinite(out)), _hints.explain(
        f"{what}: the output has non-finite entries (rows {np.unique(np.nonzero(~np.isfinite(out))[0])[:5]})",
        hints=["an overflow or 0 / 0: a denominator that is 0 (is eps added to it?) or a sum that overflowed"])
    return out


def _worst(out, expected):
    err = np.abs(out - expected)
    row = int(np.unravel_index(np.argmax(err), err.shape)[0])
    return float(err.max()), row


@exercise("3.1", "Generation, one token at a time", 1, points=2, partial=True, refuse=MIXING)
def check_generate_step(generate_step):
    """``generate_step(state, gq_t, gk_t, v_t, eps=1e-6) -> (new_state, o_t)``.

    ``state = (S, z)`` holds the prefix sums over the tokens before ``t``:
    ``S`` (K, d_v), ``z`` (K,).  ``gq_t``, ``gk_t`` (K,) are token ``t``'s
    responsibilities, ``v_t`` (d_v,) its value.  ``new_state`` is
    ``(S + gk_t v_t^T, z + gk_t)`` and ``o_t = gq_t^T S_new / (gq_t . z_new + eps)``,
    shape (d_v,): token ``t`` reads itself.  Run over a sequence from the zero
    state, the outputs must be causal GMA and the last state
    ``(Gamma_K^T V, Gamma_K^T 1)``.
    """
    eps = 1e-6
    for n, K, d_v, seed in ((9, 4, 3, 31), (23, 6, 2, 32)):
        gamma_q, gamma_k, v = _problem(n, K, d_v, seed)
        S, z = np.zeros((K, d_v)), np.zeros(K)
        out = np.empty((n, d_v))
        first = None  # token 0's new state: one write into the zero state, exact but for one rounding
        for t in range(n):
            result = _call(generate_step, (S.copy(), z.copy()), gamma_q[t].copy(), gamma_k[t].copy(), v[t].copy(), eps)
            assert isinstance(result, tuple) and len(result) == 2, (
                f"token {t}: expected a pair (new_state, o_t), got {type(result).__name__}")
            new_state, o_t = result
            assert len(new_state) == 2, f"token {t}: the state is a pair (S, z), got {len(new_state)} items"
            S, z = np.asarray(new_state[0], dtype=float), np.asarray(new_state[1], dtype=float)
            assert S.shape == (K, d_v), _hints.explain(f"token {t}: expected S of shape (K, d_v) = {(K, d_v)}, got {S.shape}",
                                                       hints=[_hints.shape(S.shape, (K, d_v))])
            assert z.shape == (K,), _hints.explain(f"token {t}: expected z of shape (K,) = {(K,)}, got {z.shape}",
                                                   hints=[_hints.shape(z.shape, (K,))])
            o_t = np.asarray(o_t, dtype=float)
            assert o_t.shape == (d_v,), _hints.explain(f"token {t}: expected o_t of shape (d_v,) = {(d_v,)}, got {o_t.shape}",
                                                       hints=[_hints.shape(o_t.shape, (d_v,))])
            out[t] = o_t
            first = (S.copy(), z.copy()) if t == 0 else first
        # the rounding model of lesson 3: two orders of summation of at most n + K weighted terms
        tol = 4 * (n + K + 1) * U * np.max(np.abs(v))
        # the same n terms summed in two orders: each off by at most (n - 1) u times the sum of their sizes
        tol_state = 4 * n * U * np.max(gamma_k.T @ np.abs(v))
        tol_z = 4 * n * U * np.max(gamma_k.sum(axis=0))
        first_hints = [f"token 0's new state S: {h}" for h in _hints.diagnose(first[0], np.outer(gamma_k[0], v[0]))]
        assert np.max(np.abs(S - gamma_k.T @ v)) <= tol_state and np.max(np.abs(z - gamma_k.sum(axis=0))) <= tol_z, _hints.explain(
            f"N = {n}: the state after the last token is not (Gamma_K^T V, Gamma_K^T 1): "
            f"errors {np.max(np.abs(S - gamma_k.T @ v)):.1e} in S, {np.max(np.abs(z - gamma_k.sum(axis=0))):.1e} in z",
            hints=["the mass z not carried from token to token: it is still zero after the last token"
                   if not np.any(z) else None, *first_hints])
        expected = _masked(gamma_q, gamma_k, v, np.tri(n), eps)
        err, row = _worst(out, expected)
        assert err <= tol, _hints.explain(
            f"N = {n}, K = {K}: the outputs differ from causal GMA by {err:.1e} (allowed {tol:.1e}), worst at token {row}. "
            "Does token t read the state *after* adding itself, and is eps added to the denominator?",
            out, expected, axes={0: "token"}, known={
                "token t reads the state before writing itself (keys j < t)": _masked(gamma_q, gamma_k, v, np.tri(n, k=-1), eps),
                "the guard eps missing from the denominator": _masked(gamma_q, gamma_k, v, np.tri(n), 0.0),
            })


@exercise("3.2", "Anti-causal GMA by suffix sums", 2, points=4, partial=True,
          refuse=MIXING)
def check_anticausal(anticausal_gma):
    """``anticausal_gma(gamma_q, gamma_k, v, eps=1e-6) -> out`` (N, d_v).

    Token ``t`` reads the keys ``j >= t`` (itself and every later one):
    ``o_t = sum_{j>=t} A_tj v_j / (sum_{j>=t} A_tj + eps)`` with
    ``A = Gamma_Q Gamma_K^T``, computed from suffix sums, without an ``N x N``
    matrix: at ``N = 2048`` its peak memory must stay below a tenth of one
    ``N x N`` float64 array.
    """
    eps = 1e-6
    for n, K, d_v, seed in ((1, 3, 2, 41), (37, 5, 3, 42), (64, 8, 4, 43)):
        gamma_q, gamma_k, v = _problem(n, K, d_v, seed)
        out = _as_output(_call(anticausal_gma, gamma_q.copy(), gamma_k.copy(), v.copy(), eps), n, d_v, f"N = {n}")
        expected = _masked(gamma_q, gamma_k, v, np.tri(n).T, eps)  # j >= t: the upper triangle with the diagonal
        # the rounding model of lesson 3, as for the causal form
        tol = 4 * (n + K + 1) * U * np.max(np.abs(v))
        err, row = _worst(out, expected)
        known = {
            "the causal mask: keys j <= t, not j >= t": _masked(gamma_q, gamma_k, v, np.tri(n), eps),
            "the diagonal left out: keys j > t, so token t does not read itself": _masked(gamma_q, gamma_k, v, np.tri(n, k=-1).T, eps),
        }
        same_chunk = np.arange(n)[:, None] // np.arange(1, n + 1)[:, None, None]  # [C - 1, t]: the chunk of t in chunks of C
        for C in range(2, n):
            # a chunked scan run from the start: within a chunk keys j >= t, and every key of the chunks before it
            ct, cj = same_chunk[C - 1][:, 0][:, None], same_chunk[C - 1][:, 0][None, :]
            mask = ((ct == cj) & (np.arange(n)[None, :] >= np.arange(n)[:, None])) | (cj < ct)
            known[f"the chunks visited from the start (chunks of {C}): each reads the chunks before it, not after"] = (
                _masked(gamma_q, gamma_k, v, mask.astype(float), eps))
        assert err <= tol, _hints.explain(
            f"N = {n}, K = {K}: the outputs differ from the explicit form with keys j >= t by {err:.1e} "
            f"(allowed {tol:.1e}), worst at token {row} (row 0 reads every key, row N-1 only itself)",
            out, expected, axes={0: "token"}, known=known)
    n, K, d_v = 2048, 4, 3
    gamma_q, gamma_k, v = _problem(n, K, d_v, 44)
    tracemalloc.start()
    try:
        big = _call(anticausal_gma, gamma_q, gamma_k, v, eps)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _as_output(big, n, d_v, f"N = {n}")
    # an N x N float64 array is 8 N^2 bytes; suffix sums need O(N K d_v), here 40x less than that
    limit = 8 * n * n / 10
    assert peak <= limit, _hints.explain(
        f"N = {n}: the call allocated {peak / 2**20:.1f} MiB at its peak, more than a tenth of one N x N array "
        f"({limit / 2**20:.1f} MiB): compute the suffix sums instead of forming A",
        hints=[f"the dense N x N matrix formed: your peak is {peak / (8 * n * n):.2f} times one" if peak >= 8 * n * n / 2 else None])


@exercise("3.3", "A sliding window that stays accurate", 3, points=6, partial=True)
def check_window(window_gma):
    """``window_gma(gamma_q, gamma_k, v, w, eps=1e-6) -> out`` (N, d_v), in the dtype of the inputs.

    Token ``t`` reads the ``w`` most recent keys, ``t - w < j <= t``:
    ``o_t = sum_j A_tj v_j / (sum_j A_tj + eps)`` over that window.  In
    float64 on short sequences the window must be right for every ``w``
    (including ``w >= N``); in float32 at ``N = 32768``, ``w = 8``, the error
    must stay within the rounding of a sum over one window,
    ``4 (w + K + 1) u max|v|``, which the difference of prefix sums
    ``S_t - S_{t-w}`` does not achieve.
    """
    eps = 1e-6
    n, K, d_v = 50, 4, 3
    gamma_q, gamma_k, v = _problem(n, K, d_v, 51)
    t, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for w in (1, 2, 7, 49, 50, 80):
        out = _as_output(_call(window_gma, gamma_q.copy(), gamma_k.copy(), v.copy(), w, eps), n, d_v, f"w = {w}")
        expected = _masked(gamma_q, gamma_k, v, ((j <= t) & (j > t - w)).astype(float), eps)
        # which keys a query reads: one key too many or too few moves an output by O(max|v| / w),
        # while the rounding of any correct method at N = 50 in float64 is below 1e-12 max|v|
        tol = 1e-9 * np.max(np.abs(v))
        err, row = _worst(out, expected)
        assert err <= tol, _hints.explain(
            f"float64, N = {n}, w = {w}: the outputs differ from the banded form (keys t - w < j <= t) by {err:.1e} "
            f"(allowed {tol:.1e}), worst at token {row}",
            out, expected, axes={0: "token"}, known={
                "one key too many: keys t - w <= j <= t": _masked(gamma_q, gamma_k, v, ((j <= t) & (j >= t - w)).astype(float), eps),
                "token t never reads itself: keys t - w < j < t": _masked(gamma_q, gamma_k, v, ((j < t) & (j > t - w)).astype(float), eps),
                "one key too few: keys t - w + 1 < j <= t": _masked(gamma_q, gamma_k, v, ((j <= t) & (j > t - w + 1)).astype(float), eps),
            })
    n, K, d_v, w = 32768, 8, 4, 8
    # values with a common offset, as real values have: the prefix sums grow like t
    gamma_q, gamma_k, v = _problem(n, K, d_v, 52, dtype=np.float32, offset=2.0)
    out = np.asarray(_call(window_gma, gamma_q, gamma_k, v, w, eps))
    assert out.dtype == np.float32, f"float32 inputs: expected a float32 output, got {out.dtype}"
    out = _as_output(out, n, d_v, f"float32, N = {n}")
    # the reference in float64, from the same float32 inputs (exact in float64), one offset of the window at a time
    g_q, g_k, vv = (a.astype(np.float64) for a in (gamma_q, gamma_k, v))
    num, den = np.zeros((n, d_v)), np.zeros(n)
    for s in range(w):
        a = np.sum(g_q[s:] * g_k[: n - s], axis=1)  # A_{t, t-s}
        num[s:] += a[:, None] * vv[: n - s]
        den[s:] += a
    expected = num / (den + eps)[:, None]
    # the rounding model of lesson 3 with the window in place of the sequence: at most w + K terms per sum
    tol = 4 * (w + K + 1) * U32 * np.max(np.abs(v))
    err, row = _worst(out, expected)
    assert err <= tol, _hints.explain(
        f"float32, N = {n}, w = {w}: error {err:.1e} at token {row}, allowed {tol:.1e} (the rounding of one window). "
        "An error that grows with t is cancellation: S_t - S_(t-w) subtracts two sums of t terms to get a sum of w",
        out, expected, size=np.arange(n)[:, None], size_name="the position t (the size of the prefix sums)")
