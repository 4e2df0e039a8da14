"""Verifications of Gaussian Mixture Attention (``docs/derivations/gma.md``).

Every check measures the largest relative error between two independent
computations: the linear-time mechanism against the explicit ``N x N`` form
or a token-by-token recurrence, and the hand-derived gradients against
central finite differences in float64 with a random upstream gradient.
"""

from __future__ import annotations

import numpy as np

from .. import gma, gmm
from ..gradcheck import numerical_gradient, relative_error
from ..testing import GMA_FIELDS, gma_problem
from ..verify import register


def _named_problem(seed, n_q, n_k, K, d_r, d_v):
    return dict(zip(GMA_FIELDS, gma_problem(seed, n_q, n_k, K, d_r, d_v)))


def _gammas(p):
    variances = gmm.variances_from_raw(p["raw_variances"])
    weights = gmm.softmax(p["logits"])
    gq = gmm.responsibilities(p["x_q"], p["means"], variances, weights)
    gk = gmm.responsibilities(p["x_k"], p["means"], variances, weights)
    return gq, gk, variances, weights


@register("gma.bidirectional_vs_dense", "gma (write K slots, read) == D^-1 A V with the explicit N x N affinity", tol=1e-13)
def _bidirectional():
    worst = 0.0
    for seed, (n_q, n_k, K) in enumerate([(37, 41, 5), (1, 9, 3), (12, 12, 1)]):
        p = _named_problem(seed, n_q, n_k, K, 3, 4)
        gq, gk, variances, weights = _gammas(p)
        out = gma.gma(p["x_q"], p["x_k"], p["v"], p["means"], variances, weights)
        worst = max(worst, relative_error(out, gma.gma_dense(gq, gk, p["v"])))
    return worst


@register("gma.causal_scan_vs_tril_dense", "chunked causal scan == tril(A) dense form, N = 37 with chunks 1, 8, 64", tol=1e-13)
def _causal():
    p = _named_problem(10, 37, 37, 6, 3, 4)
    gq, gk, variances, weights = _gammas(p)
    ref = gma.gma_dense(gq, gk, p["v"], causal=True)
    worst = 0.0
    for chunk in (1, 8, 64):
        out = gma.gma(p["x_q"], p["x_k"], p["v"], p["means"], variances, weights, causal=True, chunk_size=chunk)
        worst = max(worst, relative_error(out, ref))
    return worst


@register("gma.causal_scan_vs_token_recurrence", "chunked causal scan == the literal recurrence S_t, z_t token by token", tol=1e-13)
def _recurrence():
    p = _named_problem(11, 29, 29, 4, 2, 3)
    gq, gk, variances, weights = _gammas(p)
    s, z = np.zeros((4, 3)), np.zeros(4)
    ref = np.empty((29, 3))
    for t in range(29):
        s += np.outer(gk[t], p["v"][t])
        z += gk[t]
        ref[t] = gq[t] @ s / (gq[t] @ z + 1e-6)
    out = gma.gma(p["x_q"], p["x_k"], p["v"], p["means"], variances, weights, causal=True, chunk_size=5)
    return relative_error(out, ref)


def _fd_error(p, causal, chunk_size):
    out, cache = gma.gma_forward(*p.values(), causal=causal, chunk_size=chunk_size)
    g = np.random.default_rng(99).normal(size=out.shape)
    grads = gma.gma_backward(g, cache)
    worst = 0.0
    for name in p:

        def loss(a, name=name):
            # L = sum(g * out) has gradient gma_backward(g) with respect to every input
            return np.sum(g * gma.gma_forward(*{**p, name: a}.values(), causal=causal, chunk_size=chunk_size)[0])

        worst = max(worst, relative_error(getattr(grads, name), numerical_gradient(loss, p[name])))
    return worst


@register(
    "gma.backward_vs_fd_bidirectional",
    "gma_backward (x_q, x_k, v, means, raw_variances, logits) == central differences, N_q=7, N_k=9, K=3",
    tol=1e-7,
)
def _fd_bidirectional():
    return _fd_error(_named_problem(20, 7, 9, 3, 2, 3), causal=False, chunk_size=4)


@register(
    "gma.backward_vs_fd_causal",
    "causal gma_backward (reverse prefix sums, chunk 4, N = 10) == central differences",
    tol=1e-7,
)
def _fd_causal():
    return _fd_error(_named_problem(21, 10, 10, 3, 2, 3), causal=True, chunk_size=4)


@register("gma.float32_vs_float64", "float32 gma (both variants) relative to the float64 result", tol=1e-5)
def _float32():
    p = _named_problem(40, 50, 50, 8, 4, 4)
    _, _, variances, weights = _gammas(p)
    args64 = [p["x_q"], p["x_k"], p["v"], p["means"], variances, weights]
    args32 = [a.astype(np.float32) for a in args64]
    worst = 0.0
    for causal in (False, True):
        out32 = gma.gma(*args32, causal=causal, chunk_size=16)
        if out32.dtype != np.float32:
            return float("inf")
        worst = max(worst, relative_error(out32.astype(np.float64), gma.gma(*args64, causal=causal, chunk_size=16)))
    return worst

