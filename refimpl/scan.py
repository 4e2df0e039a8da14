r"""Normalised feature-map attention in linear time: the scan that linear attention and GMA share.

Given nonnegative feature maps :math:`\Phi_Q` (``N_q x F``) and :math:`\Phi_K`
(``N_k x F``) and values :math:`\mathbf V` (``N_k x d_v``),

.. math::

    O = D^{-1} A\mathbf V,\qquad A = \Phi_Q\Phi_K^\top\ (\text{its lower triangle when causal}),
    \qquad D = \operatorname{diag}(A\mathbf 1 + \epsilon),

computed without the ``N x N`` matrix.  Linear attention
(:mod:`refimpl.attention`) uses :math:`\phi(x) = \operatorname{elu}(x) + 1`;
Gaussian-mixture attention (:mod:`refimpl.gma`) uses the responsibilities.
The derivations are in ``docs/derivations/scan.md``; the results:

* Bidirectional (``scan.md#bidirectional-form``): :math:`S = \Phi_K^\top\mathbf V`, :math:`z = \Phi_K^\top\mathbf 1`,
  :math:`o_i = \phi^Q_i{}^\top S / (\phi^Q_i\cdot z + \epsilon)`.
* Causal (``scan.md#the-chunked-causal-scan``), chunks of ``C`` tokens carrying :math:`(S, z)` from the chunks
  before: :math:`O_c = (\Phi^Q_c S + \operatorname{tril}(\Phi^Q_c\Phi^{K\top}_c)\mathbf V_c) /
  (\Phi^Q_c z + \operatorname{tril}(\Phi^Q_c\Phi^{K\top}_c)\mathbf 1 + \epsilon)`,
  then :math:`S \mathrel{+}= \Phi^{K\top}_c\mathbf V_c`, :math:`z \mathrel{+}= \Phi^{K\top}_c\mathbf 1`.
  Time :math:`O(N F d_v + N C (F + d_v))`, extra memory :math:`O(F d_v + C^2 + C F)`.
  With a column of ones appended to each chunk's values, :math:`[\mathbf V_c, \mathbf 1]`,
  the products above carry :math:`[S, z]` and the denominators as one more
  value column, which halves the number of small products per chunk.
* Backward (``scan.md#backward-bidirectional``, ``scan.md#the-chunked-backward``),
  with :math:`\tilde G = G/\text{den}` and
  :math:`\delta_i = -(G_i\cdot O_i)/\text{den}_i`:
  :math:`d\Phi_Q = \tilde G S^\top + \delta z^\top`, :math:`dS = \Phi_Q^\top\tilde G`,
  :math:`dz = \Phi_Q^\top\delta`, :math:`d\Phi_K = \mathbf V dS^\top + \mathbf 1 dz^\top`,
  :math:`d\mathbf V = \Phi_K dS`; causal: the same with forward prefix sums for
  :math:`d\Phi_Q` and reverse prefix sums
  :math:`R_t = \sum_{j\ge t}\phi^Q_j\tilde g_j^\top`, :math:`r_t = \sum_{j\ge t}\phi^Q_j\delta_j`
  for :math:`d\phi^K_t = R_t v_t + r_t` and :math:`dv_t = R_t^\top\phi^K_t`,
  chunked like the forward (and, like it, with :math:`[\tilde G, \delta]` against
  :math:`[\mathbf V, \mathbf 1]`, so that :math:`[R, r]` is one running sum).

:func:`causal_recurrence` and :func:`causal_recurrence_backward` state the
causal form token by token, one loop each, the way the recurrence is written
(``scan.md#causal-form``); the chunked scan computes the same numbers in
blocks of ``C`` tokens, and the tests check that the two agree.

Everything here is a core (no validation, no raise; the caller checks the
returned denominators): linear attention and GMA call these functions, and
:func:`refimpl.attention.feature_attention_forward` and
:func:`refimpl.attention.feature_attention_backward` are the checked public
functions for given feature maps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FeatureAttentionCache",
    "FeatureAttentionGrads",
    "write",
    "read",
    "causal_recurrence",
    "causal_recurrence_backward",
    "scan_forward",
    "scan_backward",
]

DEFAULT_CHUNK_SIZE = 64
"""Tokens per chunk of the causal scan: the ``C x C`` masked blocks stay small
while the per-chunk matrix products are large enough to run at BLAS speed."""


class FeatureAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the feature maps and the values of :func:`scan_forward`."""

    phi_q: np.ndarray
    phi_k: np.ndarray
    v: np.ndarray


class FeatureAttentionCache(NamedTuple):
    """What :func:`scan_backward` needs from :func:`scan_forward`."""

    phi_q: np.ndarray
    phi_k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    den: np.ndarray
    causal: bool
    eps: float
    chunk_size: int


# ---------------------------------------------------------------------------
# Cores
# ---------------------------------------------------------------------------


def write(phi_k, v):
    """Core: the state of the bidirectional form, ``S = Phi_K^T V`` (F, d_v) and ``z = Phi_K^T 1`` (F,).

    (Phi_Q Phi_K^T) V = Phi_Q (Phi_K^T V): an ``F x d_v`` memory instead of an ``N x N`` matrix.
    """
    return phi_k.T @ v, phi_k.sum(axis=0)


def read(phi_q, s, z, eps):
    """Core: ``out_i = phi_q_i^T S / (phi_q_i . z + eps)`` (N_q, d_v), and the denominators ``den`` (N_q,)."""
    den = phi_q @ z + phi_q.dtype.type(eps)
    with np.errstate(divide="ignore", invalid="ignore"):  # den = 0 only with eps = 0: the caller refuses it
        return (phi_q @ s) / den[:, None], den


def causal_recurrence(phi_q, phi_k, v, eps, state=None):
    """Core: the causal form token by token, ``S_t = S_{t-1} + phi_k_t v_t^T``, ``z_t = z_{t-1} + phi_k_t``.

    ``out_t = phi_q_t^T S_t / (phi_q_t . z_t + eps)``: query ``t`` reads the
    keys ``j <= t``.  One loop over the tokens, ``O(F d_v)`` per token.

    Parameters
    ----------
    phi_q, phi_k : ndarray, shape (N, F)
    v : ndarray, shape (N, d_v)
    eps : float
    state : tuple (S, z), optional
        ``S`` (F, d_v) and ``z`` (F,) of the tokens before these; zeros by
        default (not modified).

    Returns
    -------
    out : ndarray, shape (N, d_v)
    den : ndarray, shape (N,)
    state : tuple (S, z)
        After the last token.
    """
    n, f = phi_k.shape
    dtype = phi_q.dtype
    s = np.zeros((f, v.shape[1]), dtype) if state is None else np.array(state[0], dtype=dtype)
    z = np.zeros(f, dtype) if state is None else np.array(state[1], dtype=dtype)
    out = np.empty((n, v.shape[1]), dtype)
    den = np.empty(n, dtype)
    for t in range(n):
        # the state after token t: S_t = S_{t-1} + phi_k_t v_t^T, z_t = z_{t-1} + phi_k_t
        s += np.outer(phi_k[t], v[t])
        z += phi_k[t]
        den[t] = phi_q[t] @ z + dtype.type(eps)
        with np.errstate(divide="ignore", invalid="ignore"):  # den = 0 only with eps = 0: the caller refuses it
            out[t] = (phi_q[t] @ s) / den[t]
    return out, den, (s, z)


def _causal_forward(phi_q, phi_k, v, eps, chunk_size):
    n, f = phi_k.shape
    dtype = phi_q.dtype
    out = np.empty((n, v.shape[1]), dtype=dtype)
    den = np.empty(n, dtype=dtype)
    # [v_c, 1] (the values of a chunk are copied in): the last column of every product below is the normaliser's
    v1 = np.ones((chunk_size, v.shape[1] + 1), dtype=dtype)
    s1 = np.zeros((f, v1.shape[1]), dtype=dtype)  # [S, z] = sum over earlier chunks of phi_k_j [v_j, 1]^T
    upper = ~np.tri(chunk_size, dtype=bool)  # j > t within a chunk: set to 0 (not multiplied: inf * 0 is NaN)
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        pq, pk, vc = phi_q[a:b], phi_k[a:b], v1[: b - a]
        vc[:, :-1] = v[a:b]
        # S_t = S_prev + sum_{a <= j <= t} phi_k_j v_j^T, so phi_q_t^T S_t splits into
        # the carried state and the masked C x C block tril(Phi_Q,c Phi_K,c^T)
        block = pq @ pk.T
        np.copyto(block, 0, where=upper[: b - a, : b - a])
        num = pq @ s1 + block @ vc
        d = num[:, -1] + dtype.type(eps)
        with np.errstate(divide="ignore", invalid="ignore"):  # d = 0 only with eps = 0: the caller refuses it
            out[a:b] = num[:, :-1] / d[:, None]
        den[a:b] = d
        s1 += pk.T @ vc
    return out, den


def scan_forward(phi_q, phi_k, v, causal, eps, chunk_size):
    """Core: normalised feature-map attention, bidirectional (write, then read) or causal (the chunked scan).

    Inputs checked, of one dtype (``phi_q (N_q, F)``, ``phi_k (N_k, F)``,
    ``v (N_k, d_v)``); no raise.  Returns ``(out, cache)``; the caller checks
    ``cache.den`` (:func:`refimpl.validation.check_denominators`).
    """
    # a chunk longer than the sequence is the sequence: C x C work arrays never exceed N x N
    chunk_size = max(1, min(chunk_size, phi_q.shape[0]))
    if causal:
        out, den = _causal_forward(phi_q, phi_k, v, eps, chunk_size)
    else:
        # write the keys into the state, then read it with the queries
        out, den = read(phi_q, *write(phi_k, v), eps)
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, causal, eps, chunk_size)


def _through_the_normaliser(g, c):
    """``(gn, delta)``: ``gn = G / den`` and ``delta_i = -(g_i . out_i) / den_i``, the upstream gradient of num and den."""
    # out_i = num_i / den_i: d den_i = -(g_i . num_i) / den_i^2 = -(g_i . out_i) / den_i
    return g / c.den[:, None], -np.sum(g * c.out, axis=1) / c.den


def _bidirectional_backward(gn, delta, c):
    phi_q, phi_k, v = c.phi_q, c.phi_k, c.v
    # the state the forward wrote: S = Phi_K^T V, z = Phi_K^T 1
    s, z = phi_k.T @ v, phi_k.sum(axis=0)
    ds = phi_q.T @ gn
    dz = phi_q.T @ delta
    dphi_q = gn @ s.T + delta[:, None] * z[None, :]
    dphi_k = v @ ds.T + dz[None, :]
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=phi_k @ ds)


def _causal_backward(gn, delta, c):
    phi_q, phi_k, chunk_size = c.phi_q, c.phi_k, c.chunk_size
    n, f = phi_k.shape
    dtype = phi_q.dtype
    v = c.v
    v1 = np.ones((chunk_size, v.shape[1] + 1), dtype=dtype)  # [v_c, 1]
    g1 = np.concatenate([gn, delta[:, None]], axis=1)  # [gn, delta]: gn_t . v_j + delta_t = g1_t . [v_j, 1]
    dphi_q = np.empty_like(phi_q)
    dphi_k = np.empty_like(phi_k)
    dv = np.empty_like(v)
    upper = ~np.tri(chunk_size, dtype=bool)  # j > t within a chunk
    starts = range(0, n, chunk_size)

    # forward sweep: dphi_q_t = S_t gn_t + z_t delta_t = [S, z]_t g1_t with the inclusive prefix sums
    s1 = np.zeros((f, v1.shape[1]), dtype=dtype)
    for a in starts:
        b = min(a + chunk_size, n)
        pk, vc, gc = phi_k[a:b], v1[: b - a], g1[a:b]
        vc[:, :-1] = v[a:b]
        # within the chunk, M_tj = gn_t . v_j + delta_t for j <= t, and sum_j M_tj phi_k_j
        m = gc @ vc.T
        np.copyto(m, 0, where=upper[: b - a, : b - a])
        dphi_q[a:b] = gc @ s1.T + m @ pk
        s1 += pk.T @ vc

    # backward sweep with the reverse prefix sums [R, r]_t = sum_{j >= t} phi_q_j [gn_j, delta_j]^T:
    # dphi_k_t = R_t v_t + r_t = [R, r]_t [v_t, 1], dv_t = R_t^T phi_k_t
    r1 = np.zeros((f, v1.shape[1]), dtype=dtype)  # [R, r] over the later chunks
    for a in reversed(starts):
        b = min(a + chunk_size, n)
        mask = upper[: b - a, : b - a]
        pq, pk, vc, gc = phi_q[a:b], phi_k[a:b], v1[: b - a], g1[a:b]
        vc[:, :-1] = v[a:b]
        m = gc @ vc.T
        np.copyto(m, 0, where=mask)
        block = pq @ pk.T
        np.copyto(block, 0, where=mask)
        # within the chunk the sums over j >= t are the transposed lower triangles
        dphi_k[a:b] = vc @ r1.T + m.T @ pq
        dv[a:b] = pk @ r1[:, :-1] + block.T @ gc[:, :-1]
        r1 += pq.T @ gc
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)


def causal_recurrence_backward(g, cache):
    """Core: the backward of :func:`causal_recurrence`, token by token (``g`` (N, d_v) checked, of the cache's dtype).

    With ``gn_t = g_t / den_t`` and ``delta_t = -(g_t . out_t) / den_t``
    (``scan.md#backward-causal``): a forward sweep gives
    ``dphi_q_t = S_t gn_t + z_t delta_t`` from the prefix sums, a reverse sweep
    the suffix sums ``R_t = sum_{j >= t} phi_q_j gn_j^T``,
    ``r_t = sum_{j >= t} phi_q_j delta_j``, and ``dphi_k_t = R_t v_t + r_t``,
    ``dv_t = R_t^T phi_k_t``.  ``cache`` is a :class:`FeatureAttentionCache`
    of a causal forward.
    """
    phi_q, phi_k, v = cache.phi_q, cache.phi_k, cache.v
    n, f = phi_k.shape
    dtype = phi_q.dtype
    gn, delta = _through_the_normaliser(g, cache)
    dphi_q, dphi_k, dv = np.empty_like(phi_q), np.empty_like(phi_k), np.empty_like(v)
    s, z = np.zeros((f, v.shape[1]), dtype), np.zeros(f, dtype)
    for t in range(n):
        s += np.outer(phi_k[t], v[t])
        z += phi_k[t]
        dphi_q[t] = s @ gn[t] + z * delta[t]
    r_mat, r = np.zeros((f, v.shape[1]), dtype), np.zeros(f, dtype)
    for t in reversed(range(n)):
        r_mat += np.outer(phi_q[t], gn[t])
        r += phi_q[t] * delta[t]
        dphi_k[t] = r_mat @ v[t] + r
        dv[t] = r_mat.T @ phi_k[t]
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)


def scan_backward(g, cache):
    """Core: the gradients of :func:`scan_forward` (``g`` checked, of the cache's dtype; no raise)."""
    gn, delta = _through_the_normaliser(g, cache)
    return _causal_backward(gn, delta, cache) if cache.causal else _bidirectional_backward(gn, delta, cache)
