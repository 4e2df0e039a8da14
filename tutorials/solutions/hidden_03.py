"""Hidden cases of lesson 3's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: other sizes and edge cases (one component, a length that is not a
multiple of a chunk, a window of one key), with the public check's tolerance
models.  ``ORACLE_CALLS``: answers that call the function the check compares
with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_03 as public

U = np.finfo(np.float64).eps

SEEDS = {"3.1": (1, 2), "3.2": (1,), "3.3": (1,)}


def anticausal_odd_lengths(anticausal_gma):
    """one component (K = 1), and lengths 65 and 130 that are not multiples of a chunk of 64"""
    eps = 1e-6
    for n, K, d_v, seed in ((65, 1, 2, 3201), (130, 3, 2, 3202)):
        gamma_q, gamma_k, v = public._problem(n, K, d_v, seed)
        out = public._as_output(public._call(anticausal_gma, gamma_q.copy(), gamma_k.copy(), v.copy(), eps), n, d_v,
                                f"N = {n}, K = {K}")
        expected = public._masked(gamma_q, gamma_k, v, np.tri(n).T, eps)  # keys j >= t
        tol = 4 * (n + K + 1) * U * np.max(np.abs(v))  # the public check's model
        err, row = public._worst(out, expected)
        assert err <= tol, f"N = {n}, K = {K}: error {err:.1e} at token {row} against keys j >= t (allowed {tol:.1e})"


def window_one_token_and_long(window_gma):
    """one token (N = 1) with w = 1 and w = 5, and N = 130 with w = 64 and w = 129, in float64"""
    eps = 1e-6
    for n, w, seed in ((1, 1, 3301), (1, 5, 3302), (130, 64, 3303), (130, 129, 3304)):
        gamma_q, gamma_k, v = public._problem(n, 3, 2, seed)
        out = public._as_output(public._call(window_gma, gamma_q.copy(), gamma_k.copy(), v.copy(), w, eps), n, 2,
                                f"N = {n}, w = {w}")
        t, j = np.arange(n)[:, None], np.arange(n)[None, :]
        expected = public._masked(gamma_q, gamma_k, v, ((j <= t) & (j > t - w)).astype(float), eps)
        tol = 1e-9 * np.max(np.abs(v))  # the public check's float64 bound: one key too many or too few is far above it
        err, row = public._worst(out, expected)
        assert err <= tol, f"N = {n}, w = {w}: error {err:.1e} at token {row} against keys t - w < j <= t"


CASES = {"3.2": [anticausal_odd_lengths], "3.3": [window_one_token_and_long]}

ORACLE_CALLS = {
    "3.1": "from refimpl import scan\n\n"
           "def generate_step(state, gq_t, gk_t, v_t, eps=1e-6):\n"
           "    out, _, new_state = scan.causal_recurrence(gq_t[None], gk_t[None], v_t[None], eps, state)\n"
           "    return new_state, out[0]\n",
    "3.2": "def anticausal_gma(gamma_q, gamma_k, v, eps=1e-6):\n"
           "    return attention.feature_attention(gamma_q[::-1], gamma_k[::-1], v[::-1], causal=True, eps=eps)[::-1]\n",
}
