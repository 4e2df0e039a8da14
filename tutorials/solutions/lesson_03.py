"""Worked solutions to lesson 3's exercises; try first.

Each solution follows the lesson's derivation: causal GMA reads prefix sums
$S_t = \\sum_{j\\le t}\\gamma^K_j v_j^\\top$, $z_t = \\sum_{j\\le t}\\gamma^K_j$;
the anti-causal form reads the same sums taken from the other end; a sliding
window reads a sum over $w$ keys, which must not be computed as the
difference of two sums over $t$ keys.
"""

from __future__ import annotations

import numpy as np

from . import off_by  # near misses: small but real errors

# ---------------------------------------------------------------------------
# 3.1 Generation, one token at a time
# ---------------------------------------------------------------------------


def generate_step(state, gq_t, gk_t, v_t, eps=1e-6):
    """One token of causal GMA: write token t into the state, then read it with query t.

    ``state = (S, z)`` with ``S`` (K, d_v) and ``z`` (K,) the sums over the
    earlier tokens; returns ``((S_t, z_t), o_t)`` with ``o_t`` (d_v,).  The
    cost is O(K d_v) whatever ``t``: the point of the recurrence.
    """
    S, z = state
    # write first: token t is among the keys j <= t that it reads
    S = S + np.outer(gk_t, v_t)
    z = z + gk_t
    o_t = (gq_t @ S) / (gq_t @ z + eps)
    return (S, z), o_t


def _step_read_before_write(state, gq_t, gk_t, v_t, eps=1e-6):
    """Near miss: reads S_{t-1}, so token t does not see itself (keys j < t)."""
    S, z = state
    o_t = (gq_t @ S) / (gq_t @ z + eps)
    return (S + np.outer(gk_t, v_t), z + gk_t), o_t


def _step_without_guard(state, gq_t, gk_t, v_t, eps=1e-6):
    """Near miss: drops eps from the denominator (a relative change of about 1e-6)."""
    S, z = state
    S, z = S + np.outer(gk_t, v_t), z + gk_t
    return (S, z), (gq_t @ S) / (gq_t @ z)


def _step_mass_not_updated(state, gq_t, gk_t, v_t, eps=1e-6):
    """Near miss: forgets to carry the mass z."""
    S, z = state
    S = S + np.outer(gk_t, v_t)
    return (S, z), (gq_t @ S) / (gq_t @ (z + gk_t) + eps)


# ---------------------------------------------------------------------------
# 3.2 Anti-causal GMA by suffix sums
# ---------------------------------------------------------------------------


def anticausal_gma(gamma_q, gamma_k, v, eps=1e-6, chunk=64):
    """Token t reads keys j >= t: the chunked scan of lesson 3, run from the end.

    The suffix sums $\\bar S_t = \\sum_{j\\ge t}\\gamma^K_j v_j^\\top$ and
    $\\bar z_t = \\sum_{j\\ge t}\\gamma^K_j$ obey
    $\\bar S_t = \\bar S_{t+1} + \\gamma^K_t v_t^\\top$: a recurrence that runs
    backwards.  Chunked, each chunk reads the state of the chunks after it
    plus the upper triangle (with the diagonal) of its own $C\\times C$ block.
    Equivalently: flip the sequence, run the causal scan, flip the output
    (``attention.feature_attention(gq[::-1], gk[::-1], v[::-1], causal=True)[::-1]``).
    Memory O(K d_v + C^2) besides the output.
    """
    n, K = gamma_k.shape
    out = np.empty((n, v.shape[1]))
    s, z = np.zeros((K, v.shape[1])), np.zeros(K)  # the sums over the later chunks
    for a in reversed(range(0, n, chunk)):
        b = min(a + chunk, n)
        pq, pk, vc = gamma_q[a:b], gamma_k[a:b], v[a:b]
        block = np.triu(pq @ pk.T)  # A_tj for t <= j within the chunk
        out[a:b] = (pq @ s + block @ vc) / (pq @ z + block.sum(axis=1) + eps)[:, None]
        s += pk.T @ vc  # carry the state to the chunk before
        z += pk.sum(axis=0)
    return out


def _anticausal_is_causal(gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: the causal mask (keys j <= t) instead of j >= t."""
    s, z = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0), np.cumsum(gamma_k, axis=0)
    return np.einsum("tk,tkd->td", gamma_q, s) / (np.einsum("tk,tk->t", gamma_q, z) + eps)[:, None]


def _anticausal_strict(gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: keys j > t (the diagonal left out), from exclusive suffix sums."""
    s = np.cumsum((gamma_k[:, :, None] * v[:, None, :])[::-1], axis=0)[::-1]
    z = np.cumsum(gamma_k[::-1], axis=0)[::-1]
    s = np.concatenate([s[1:], np.zeros_like(s[:1])])
    z = np.concatenate([z[1:], np.zeros_like(z[:1])])
    return np.einsum("tk,tkd->td", gamma_q, s) / (np.einsum("tk,tk->t", gamma_q, z) + eps)[:, None]


def _anticausal_dense(gamma_q, gamma_k, v, eps=1e-6):
    """Near miss: right values, but through the N x N matrix the exercise forbids."""
    a = np.triu(gamma_q @ gamma_k.T)
    return (a @ v) / (a.sum(axis=1) + eps)[:, None]


def _anticausal_chunks_forward(gamma_q, gamma_k, v, eps=1e-6, chunk=16):
    """Near miss: the chunks visited from the start, so each reads the earlier chunks' state."""
    n, K = gamma_k.shape
    out = np.empty((n, v.shape[1]))
    s, z = np.zeros((K, v.shape[1])), np.zeros(K)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        pq, pk, vc = gamma_q[a:b], gamma_k[a:b], v[a:b]
        block = np.triu(pq @ pk.T)
        out[a:b] = (pq @ s + block @ vc) / (pq @ z + block.sum(axis=1) + eps)[:, None]
        s += pk.T @ vc
        z += pk.sum(axis=0)
    return out


# ---------------------------------------------------------------------------
# 3.3 A sliding window that stays accurate
# ---------------------------------------------------------------------------


def window_gma(gamma_q, gamma_k, v, w, eps=1e-6):
    """Token t reads keys t - w < j <= t, summed over the window itself.

    In exact arithmetic the window sum is $S_t - S_{t-w}$, a difference of
    prefix sums.  In floating point $S_t$ carries a rounding error of order
    $t\\,u$ times its size, which grows like $t$ when the values share an
    offset; the difference of two nearby large sums keeps that absolute error
    while its own size is that of $w$ terms (cancellation).  At
    $N = 32768$ in float32 the error is 35 times the rounding of one window.

    The fix sums the window directly, one offset $s = t - j$ at a time: every
    output is then a sum of at most $w$ nonnegative-weighted terms, whatever
    $t$, in time O(N w (K + d_v)).  (For a long window, restart the prefix sums
    every $w$ tokens instead: a window then spans two blocks, each summed over
    at most $w$ terms, in time O(N K d_v).)
    """
    n = v.shape[0]
    w = min(w, n)
    num = np.zeros_like(v)
    den = np.zeros(n, dtype=v.dtype)
    for s in range(w):  # key j = t - s, for every t >= s at once
        a = np.einsum("tk,tk->t", gamma_q[s:], gamma_k[: n - s])  # A_{t, t-s}
        num[s:] += a[:, None] * v[: n - s]
        den[s:] += a
    return num / (den + v.dtype.type(eps))[:, None]


def _window_prefix_difference(gamma_q, gamma_k, v, w, eps=1e-6):
    """Near miss: S_t - S_{t-w}; right in float64 on short sequences, cancellation in float32 on long ones."""
    s = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)
    z = np.cumsum(gamma_k, axis=0)
    if w < len(v):
        s[w:] = s[w:] - s[:-w].copy()
        z[w:] = z[w:] - z[:-w].copy()
    return np.einsum("tk,tkd->td", gamma_q, s) / (np.einsum("tk,tk->t", gamma_q, z) + v.dtype.type(eps))[:, None]


def _window_one_too_many(gamma_q, gamma_k, v, w, eps=1e-6):
    """Near miss: keys t - w <= j <= t, w + 1 of them."""
    return window_gma(gamma_q, gamma_k, v, w + 1, eps)


def _window_one_too_few(gamma_q, gamma_k, v, w, eps=1e-6):
    """Near miss: range(1, w), so token t never reads itself."""
    n = v.shape[0]
    num, den = np.zeros_like(v), np.zeros(n, dtype=v.dtype)
    for s in range(1, min(w, n)):
        a = np.einsum("tk,tk->t", gamma_q[s:], gamma_k[: n - s])
        num[s:] += a[:, None] * v[: n - s]
        den[s:] += a
    return num / (den + v.dtype.type(eps))[:, None]


SOLUTIONS = {
    "3.1": generate_step,
    "3.2": anticausal_gma,
    "3.3": window_gma,
}

NEAR_MISSES = {
    "3.1": {
        "reads the state before writing itself": _step_read_before_write,
        "the guard eps missing": _step_without_guard,
        "the mass z not carried": _step_mass_not_updated,
        "every value scaled by 1 + 1e-11": off_by(generate_step, 1e-11),
    },
    "3.2": {
        "the causal mask (keys j <= t)": _anticausal_is_causal,
        "the diagonal left out (keys j > t)": _anticausal_strict,
        "the dense N x N matrix formed": _anticausal_dense,
        "the chunks visited from the start": _anticausal_chunks_forward,
        "every value scaled by 1 + 1e-11": off_by(anticausal_gma, 1e-11),
    },
    "3.3": {
        "prefix sums subtracted, S_t - S_(t-w): cancellation": _window_prefix_difference,
        "one key too many": _window_one_too_many,
        "token t never reads itself": _window_one_too_few,
        "every value scaled by 1 + 1e-7": off_by(window_gma, 1e-7),
    },
}
