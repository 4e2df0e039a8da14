"""Hidden cases of lesson 9's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: other sizes and edge cases (a row shorter than a block, a single
chunk, a single query), tiny since the kernels run in the CUDA simulator.
``ORACLE_CALLS``: answers that hand the work to what the check compares with
(``refimpl``, or NumPy on the host for a kernel exercise); they must be refused.
"""

from __future__ import annotations

import math

import numpy as np

import _exercises_09 as public
from refimpl import attention, numerics

SEEDS = {"9.1": (1, 2), "9.2": (1,), "9.3": (1, 2), "9.4": (1,)}


def softmax_short_and_flat_rows(row_softmax):
    """a row of one entry, a constant row, and a row longer than two blocks of threads"""
    rng = np.random.default_rng(9201)
    for a in (np.array([[5.0], [-700.0]]), np.full((2, 5), 3.0), rng.standard_normal((2, 19)) * 200.0):
        p = public._shape(public._call(row_softmax, a.copy()), a.shape, f"row_softmax of a {a.shape[0]} x {a.shape[1]} array")
        expected = numerics.softmax(a, axis=1)
        err = float(np.max(np.abs(p - expected)))
        assert np.all(np.isfinite(p)) and err <= 1e-11, (  # the public check's tolerance
            f"{a.shape[0]} x {a.shape[1]}: max error {err:.1e} against refimpl's softmax (allowed 1e-11)")


def chunk_states_one_and_many_chunks(chunk_states):
    """chunks of one token, and one chunk holding the whole sequence"""
    rng = np.random.default_rng(9301)
    for N, K, d_v, C in ((5, 2, 1, 1), (6, 3, 2, 8)):
        g_k = rng.dirichlet(np.ones(K), size=N)
        vals = rng.standard_normal((N, d_v))
        n_chunks = -(-N // C)
        S = public._shape(public._call(chunk_states, g_k.copy(), vals.copy(), C), (n_chunks, K, d_v + 1),
                          f"chunk_states with N = {N}, K = {K}, d_v = {d_v}, C = {C}")
        v1 = np.hstack([vals, np.ones((N, 1))])
        for c in range(n_chunks):
            err = float(np.max(np.abs(S[c] - g_k[: c * C].T @ v1[: c * C])))
            assert err <= 1e-12, f"N = {N}, C = {C}: S[{c}] is off the sum of the tokens before chunk {c} by {err:.1e}"


def attention_one_query_and_full_tiles(online_attention):
    """a single query and key, and a sequence of exactly two tiles, d = 1"""
    rng = np.random.default_rng(9401)
    for N, d, d_v in ((1, 2, 2), (8, 1, 3)):
        q, k, v = rng.standard_normal((N, d)) * 10.0, rng.standard_normal((N, d)), rng.standard_normal((N, d_v))
        for causal in (False, True):
            out = public._shape(public._call(online_attention, q.copy(), k.copy(), v.copy(), causal), (N, d_v),
                                f"online_attention with N = {N}, d = {d}, causal={causal}")
            err = float(np.max(np.abs(out - attention.softmax_attention(q, k, v, causal=causal))))
            assert np.all(np.isfinite(out)) and err <= 1e-12, (
                f"N = {N}, d = {d}, causal={causal}: max error {err:.1e} against refimpl (allowed 1e-12)")


def lse_equal_maxima(lse_combine):
    """two pairs with the same maximum, and a pair with s = 0 beside a finite one"""
    M, S = (float(g) for g in public._call(lse_combine, 4.0, 2.0, 4.0, 3.0))
    assert (M, S) == (4.0, 5.0), f"(4, 2) (+) (4, 3): expected (4, 5) exactly, got ({M}, {S})"
    M, S = (float(g) for g in public._call(lse_combine, -math.inf, 0.0, -1e300, 1.0))
    assert (M, S) == (-1e300, 1.0), f"empty (+) (-1e300, 1): expected (-1e300, 1) exactly, got ({M}, {S})"


CASES = {"9.1": [lse_equal_maxima], "9.2": [softmax_short_and_flat_rows], "9.3": [chunk_states_one_and_many_chunks],
         "9.4": [attention_one_query_and_full_tiles]}

ORACLE_CALLS = {
    "9.2": "def row_softmax(a):\n    return gmm.softmax(a, axis=1)\n",
    "9.3": "def chunk_states(gamma_k, v, C):\n"
           "    # NumPy on the host: right, but no kernel\n"
           "    v1 = np.hstack([v, np.ones((len(v), 1))])\n"
           "    n = -(-len(v) // C)\n"
           "    return np.stack([gamma_k[: c * C].T @ v1[: c * C] for c in range(n)])\n",
    "9.4": "def online_attention(q, k, v, causal):\n    return attention.softmax_attention(q, k, v, causal=causal)\n",
}
