"""Verifications of attention as regression (``docs/derivations/ovq_gmr.md``).

Errors are relative to the largest value entry, so they read as fractions of
the output's scale.
"""

from __future__ import annotations

import numpy as np

from .. import gmr, ovq
from ..attention import softmax_attention
from ..verify import register


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@register(
    "gmr.softmax_attention_equals_kernel_regression",
    "softmax(beta q^ k^T) v == Gaussian Nadaraya-Watson exp(-beta/2 ||q^-k^||^2) on unit vectors, beta in {1, 8, 30}",
    tol=1e-13,
)
def _softmax_is_kernel_regression():
    rng = np.random.default_rng(40)
    worst = 0.0
    for beta in (1.0, 8.0, 30.0):
        q, k = _unit(rng.normal(size=(70, 6))), _unit(rng.normal(size=(90, 6)))
        v = rng.normal(size=(90, 5))
        sm = softmax_attention(q, k, v, scale=beta)
        nw = gmr.kernel_regression(q, k, v, beta=beta)
        worst = max(worst, float(np.max(np.abs(sm - nw)) / np.max(np.abs(v))))
    return worst


def _ovq_state_and_chunk(rng, unit_centroids):
    """An OVQ state after 240 tokens, optionally with its key rows rescaled to unit norm, and a next chunk."""
    d, d_v, N, C, beta = 6, 4, 24, 16, 4.0
    q, k, v = rng.normal(size=(256, d)), rng.normal(size=(256, d)), rng.normal(size=(256, d_v))
    _, state = ovq.ovq_attention(q[:240], k[:240], v[:240], max_size=N, chunk_size=C, beta=beta, return_state=True)
    if unit_centroids:
        keys = state.keys.copy()
        keys[: state.size] = _unit(keys[: state.size])
        state = ovq.OVQState(keys, state.values, state.counts, state.size, state.tokens_seen)
    return state, q[240:], k[240:], v[240:], C, beta


def _gmr_of_chunk(state, q, k, v, beta, log_weight_shift=None):
    """GMR prediction, position by position, over the components [centroids; chunk keys b <= a]."""
    n = state.size
    D_k, D_v, c = state.keys[:n], state.values[:n], state.counts[:n].astype(np.float64)
    qh, kh = ovq.unit_rows(q), ovq.unit_rows(k)
    out = np.empty_like(v)
    for a in range(len(q)):
        means_k = np.concatenate([D_k, kh[: a + 1]])
        means_v = np.concatenate([D_v, v[: a + 1]])
        w = np.concatenate([c, np.ones(a + 1)])  # a raw key is a centroid of count 1
        if log_weight_shift is not None:
            w = w * np.exp(log_weight_shift(means_k))
        out[a] = gmr.gmr_predict(qh[a : a + 1], means_k, means_v, w / w.sum(), beta=beta)[0]
    return out


@register(
    "gmr.ovq_readout_equals_gmr_unit_norm",
    "OVQ chunk output == exact GMR conditional mean over [centroids; chunk keys], weights ~ counts, when every centroid has norm 1",
    tol=1e-12,
)
def _readout_is_gmr():
    rng = np.random.default_rng(41)
    state, q, k, v, C, beta = _ovq_state_and_chunk(rng, unit_centroids=True)
    out = ovq.ovq_attention(q, k, v, max_size=state.max_size, chunk_size=C, beta=beta, state=state)
    ref = _gmr_of_chunk(state, q, k, v, beta)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(v)))


@register(
    "gmr.ovq_gap_is_the_dropped_norm_term",
    "centroids = means of unit keys (norm < 1): OVQ output == GMR with weights ~ c exp(+beta/2 ||mu||^2), i.e. the gap is that term alone",
    tol=1e-12,
)
def _gap_is_norm_term():
    rng = np.random.default_rng(42)
    state, q, k, v, C, beta = _ovq_state_and_chunk(rng, unit_centroids=False)
    out = ovq.ovq_attention(q, k, v, max_size=state.max_size, chunk_size=C, beta=beta, state=state)
    ref = _gmr_of_chunk(state, q, k, v, beta, log_weight_shift=lambda m: 0.5 * beta * np.sum(m * m, axis=1))
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(v)))


@register(
    "gmr.ovq_gap_within_tanh_bound",
    "centroids = means of unit keys: |OVQ read-out - exact GMR| / (tanh(r/4) * range of value means), r = beta/2 range ||mu||^2 (<= 1)",
    tol=1.0,
)
def _gap_bound():
    rng = np.random.default_rng(43)
    state, q, _, _, _, beta = _ovq_state_and_chunk(rng, unit_centroids=False)
    n = state.size
    D_k, D_v, c = state.keys[:n], state.values[:n], state.counts[:n]
    qh = ovq.unit_rows(q)
    gap = np.abs(gmr.readout_gap(qh, D_k, D_v, c, beta=beta))
    bound = gmr.readout_gap_bound(D_k, D_v, beta=beta)
    if not np.any(gap > 1e-6):  # the gap must be real for the ratio to mean something
        return float("inf")
    return float(np.max(gap / bound))
