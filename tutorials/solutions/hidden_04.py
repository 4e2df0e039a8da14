"""Hidden cases of lesson 4's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: other sizes and edge cases (one token, one component, long
sequences), with the public check's tolerance models.  ``ORACLE_CALLS``:
answers that call the function the check compares with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_04 as public
from refimpl import attention, gma

U = np.finfo(np.float64).eps

SEEDS = {"4.1": (1, 2), "4.2": (1, 2), "4.3": (1, 2), "4.4": (1,)}


def guard_closed_form(guard_gradient):
    """one component (K = 1) and a large guard: dL/deps = -sum_i (G_i . o_i) / den_i exactly"""
    rng = np.random.default_rng(4101)
    for n_q, n_k, K, d_v, eps in ((1, 3, 1, 2, 10.0), (12, 30, 6, 4, 1e-3)):
        gq, gk = rng.dirichlet(np.ones(K), size=n_q), rng.dirichlet(np.ones(K), size=n_k)
        v, G = rng.normal(size=(n_k, d_v)), rng.normal(size=(n_q, d_v))
        got = public._call(guard_gradient, G.copy(), gq.copy(), gk.copy(), v.copy(), eps)
        assert np.ndim(got) == 0, f"N_q = {n_q}: expected one number, got shape {np.shape(got)}"
        a = gq @ gk.T
        den = a.sum(axis=1) + eps
        out = (a @ v) / den[:, None]
        ref = -np.sum(np.sum(G * out, axis=1) / den)
        scale = np.sum(np.abs(G * out) / den[:, None])
        # the same few products and sums in another order: (N_k + K + d_v) u of the sum of |terms|, 4x
        tol = 4 * (n_k + K + d_v + 2) * U * scale
        assert abs(float(got) - ref) <= tol, (
            f"N_q = {n_q}, K = {K}, eps = {eps}: got {float(got)!r}, the closed form gives {ref!r} (allowed {tol:.1e})")


def mixing_long_and_short(causal_mixing_backward):
    """one token, one component, and a sequence of 40 tokens, against refimpl"""
    rng = np.random.default_rng(4201)
    eps = 1e-6
    for n, K, d_v in ((1, 1, 1), (2, 1, 3), (40, 5, 2)):
        gq, gk = rng.dirichlet(np.ones(K), size=n), rng.dirichlet(np.ones(K), size=n)
        v, G = rng.normal(size=(n, d_v)), rng.normal(size=(n, d_v))
        out, cache = attention.feature_attention_forward(gq, gk, v, causal=True, eps=eps, chunk_size=7)
        ref = attention.feature_attention_backward(G, cache)
        got = public._call(causal_mixing_backward, G.copy(), gq.copy(), gk.copy(), v.copy(), eps)
        assert isinstance(got, tuple) and len(got) == 3, "expected a tuple (d_gamma_q, d_gamma_k, d_v)"
        scales = public._abs_mixing_terms(G, gq, gk, v, cache.den, out)
        for name, mine, theirs, scale, shape in zip(("d_gamma_q", "d_gamma_k", "d_v"), got, ref, scales,
                                                    ((n, K), (n, K), (n, d_v))):
            mine = public._array(mine, shape, f"N = {n}, {name}")
            tol = 4 * (n + K + d_v + 2) * U * scale  # the public check's model
            assert np.all(np.abs(mine - theirs) <= tol), (
                f"N = {n}, K = {K}, d_v = {d_v}: {name} differs from refimpl's by {np.max(np.abs(mine - theirs)):.1e}")


def gma_backward_other_sizes(causal_gma_backward):
    """a long sequence (N = 30, K = 6) and one component, against refimpl"""
    rng = np.random.default_rng(4301)
    for n, K, d_r, d_v in ((30, 6, 3, 2), (5, 1, 2, 2)):
        inputs = dict(x_q=rng.normal(size=(n, d_r)), x_k=rng.normal(size=(n, d_r)), v=rng.normal(size=(n, d_v)),
                      means=rng.normal(size=(K, d_r)), raw_variances=rng.normal(size=(K, d_r)), logits=rng.normal(size=K))
        out, cache = gma.gma_forward(*inputs.values(), causal=True, chunk_size=8)
        G = rng.normal(size=out.shape)
        ref = gma.gma_backward(G, cache)
        got = public._call(causal_gma_backward, G.copy(), cache)
        assert len(got) == 6, f"expected six gradients {public.FIELDS}, got {len(got)}"
        scales = public._per_token_scales(cache, G)
        for name, mine in zip(public.FIELDS, got):
            theirs = getattr(ref, name)
            mine = public._array(mine, theirs.shape, f"N = {n}, gradient of {name}")
            tol = 64 * 2 * n * U * np.max(scales[name])  # the public check's bound
            err = np.max(np.abs(mine - theirs))
            assert err <= tol, f"N = {n}, K = {K}: the gradient of {name} differs from refimpl's by {err:.1e} (allowed {tol:.1e})"


CASES = {"4.1": [guard_closed_form], "4.2": [mixing_long_and_short], "4.3": [gma_backward_other_sizes]}

ORACLE_CALLS = {
    "4.2": "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
           "    _, cache = attention.feature_attention_forward(gamma_q, gamma_k, v, causal=True, eps=eps)\n"
           "    return tuple(attention.feature_attention_backward(G, cache))\n",
    "4.3": "def causal_gma_backward(G, cache):\n    return tuple(gma.gma_backward(G, cache))\n",
}
