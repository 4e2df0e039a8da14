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

:func:`scan_forward` and :func:`scan_backward` are the cores (no validation,
no raise; the caller checks the returned denominators);
:func:`feature_attention_forward` and :func:`feature_attention_backward`
are the checked public functions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import validation

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FeatureAttentionCache",
    "FeatureAttentionGrads",
    "feature_attention",
    "feature_attention_forward",
    "feature_attention_backward",
    "scan_forward",
    "scan_backward",
]

DEFAULT_CHUNK_SIZE = 64
"""Tokens per chunk of the causal scan: the ``C x C`` masked blocks stay small
while the per-chunk matrix products are large enough to run at BLAS speed."""


class FeatureAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of :func:`feature_attention_forward`."""

    phi_q: np.ndarray
    phi_k: np.ndarray
    v: np.ndarray


class FeatureAttentionCache(NamedTuple):
    """What :func:`feature_attention_backward` needs from the forward pass."""

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


def _ones_column_buffer(rows, d_v, dtype):
    """A ``(rows, d_v + 1)`` work array whose last column holds ones: ``[v_c, 1]`` once ``v_c`` is copied in."""
    buf = np.empty((rows, d_v + 1), dtype=dtype)
    buf[:, -1] = 1
    return buf


def _bidirectional_forward(phi_q, phi_k, v, eps):
    # (Phi_Q Phi_K^T) V = Phi_Q (Phi_K^T V): an F x d_v memory instead of an N x N matrix
    s = phi_k.T @ v
    z = phi_k.sum(axis=0)
    den = phi_q @ z + phi_q.dtype.type(eps)
    with np.errstate(divide="ignore", invalid="ignore"):  # den = 0 only with eps = 0: the caller refuses it
        return (phi_q @ s) / den[:, None], den


def _causal_forward(phi_q, phi_k, v, eps, chunk_size):
    n, f = phi_k.shape
    dtype = phi_q.dtype
    out = np.empty((n, v.shape[1]), dtype=dtype)
    den = np.empty(n, dtype=dtype)
    v1 = _ones_column_buffer(chunk_size, v.shape[1], dtype)  # [v_c, 1]: the last column of every product below is the normaliser's
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
    """Core of :func:`feature_attention_forward` (checked inputs of one dtype; no raise).

    Returns ``(out, cache)``; the caller checks ``cache.den``
    (:func:`refimpl.validation.check_denominators`).
    """
    if causal:
        out, den = _causal_forward(phi_q, phi_k, v, eps, chunk_size)
    else:
        out, den = _bidirectional_forward(phi_q, phi_k, v, eps)
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, causal, eps, chunk_size)


def _scaled_grads(g, c):
    """``[G / den, delta]`` with ``delta_i = -(g_i . out_i) / den_i``, ``(N_q, d_v + 1)``."""
    g1 = np.empty((g.shape[0], g.shape[1] + 1), dtype=g.dtype)
    np.divide(g, c.den[:, None], out=g1[:, :-1])
    # out_i = num_i / den_i: d den_i = -(g_i . num_i) / den_i^2 = -(g_i . out_i) / den_i
    g1[:, -1] = -np.sum(g * c.out, axis=1) / c.den
    return g1


def _bidirectional_backward(g, c):
    phi_q, phi_k, v, out, den = c.phi_q, c.phi_k, c.v, c.out, c.den
    gn = g / den[:, None]
    # out_i = num_i / den_i: d den_i = -(g_i . num_i) / den_i^2 = -(g_i . out_i) / den_i
    delta = -np.sum(g * out, axis=1) / den
    s = phi_k.T @ v
    z = phi_k.sum(axis=0)
    ds = phi_q.T @ gn
    dz = phi_q.T @ delta
    dphi_q = gn @ s.T + delta[:, None] * z[None, :]
    dphi_k = v @ ds.T + dz[None, :]
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=phi_k @ ds)


def _causal_backward(g, c):
    phi_q, phi_k, chunk_size = c.phi_q, c.phi_k, c.chunk_size
    n, f = phi_k.shape
    dtype = phi_q.dtype
    v = c.v
    v1 = _ones_column_buffer(chunk_size, v.shape[1], dtype)  # [v_c, 1]
    g1 = _scaled_grads(g, c)  # [gn, delta]: gn_t . v_j + delta_t = g1_t . [v_j, 1]
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


def scan_backward(g, cache):
    """Core of :func:`feature_attention_backward` (``g`` checked, of the cache's dtype; no raise)."""
    return _causal_backward(g, cache) if cache.causal else _bidirectional_backward(g, cache)


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _check_features(phi_q, phi_k, v, causal, eps, chunk_size):
    phi_q = validation.as_float_array(phi_q, "phi_q", ndim=2)
    phi_k = validation.as_float_array(phi_k, "phi_k", ndim=2)
    v = validation.as_float_array(v, "v", ndim=2)
    validation.check_shape(phi_k, "phi_k", (None, phi_q.shape[1]), ("N_k", "F"))
    validation.check_shape(v, "v", (phi_k.shape[0], None), ("N_k", "d_v"))
    validation.check_nonnegative(phi_q, "phi_q")
    validation.check_nonnegative(phi_k, "phi_k")
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    validation.check_causal_lengths(phi_q.shape[0], phi_k.shape[0], causal)
    dtype = validation.common_float_dtype(phi_q, phi_k, v)
    return phi_q.astype(dtype, copy=False), phi_k.astype(dtype, copy=False), v.astype(dtype, copy=False), causal, eps, chunk_size


def feature_attention_forward(phi_q, phi_k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised attention with given nonnegative feature maps, in linear time.

    ``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)`` with ``a_ij = phi_q_i . phi_k_j``
    (``j <= i`` only when causal), computed without the ``N x N`` matrix
    (the chunked causal scan of the module docstring).

    Parameters
    ----------
    phi_q : array_like, shape (N_q, F)
        Query features, all >= 0.
    phi_k : array_like, shape (N_k, F)
        Key features, all >= 0.
    v : array_like, shape (N_k, d_v)
        Values.
    causal : bool, default False
        Query ``t`` sees keys ``j <= t`` only (needs ``N_q == N_k``).
    eps : float, default 1e-6
        Added to every denominator (>= 0).  With 0, a query whose denominator
        is 0 (no overlap with the keys it reads) is refused: its output is 0/0.
    chunk_size : int, default 64
        Tokens per chunk of the causal scan (>= 1); ignored when not causal.

    Returns
    -------
    out : ndarray, shape (N_q, d_v)
        Dtype of the inputs (float32 only if all are float32).
    cache : FeatureAttentionCache
        The inputs, the output and the denominators ``den`` (N_q,).
    """
    phi_q, phi_k, v, causal, eps, chunk_size = _check_features(phi_q, phi_k, v, causal, eps, chunk_size)
    out, cache = scan_forward(phi_q, phi_k, v, causal, eps, chunk_size)
    validation.check_denominators(cache.den, eps)
    return out, cache


def feature_attention_backward(grad_out, cache) -> FeatureAttentionGrads:
    """Gradients of :func:`feature_attention_forward`; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (N_q, d_v)
        ``dL/d out``.
    cache : FeatureAttentionCache
        From :func:`feature_attention_forward`.

    Returns
    -------
    FeatureAttentionGrads
        Fields ``phi_q`` (N_q, F), ``phi_k`` (N_k, F), ``v`` (N_k, d_v).
        The causal backward uses memory ``O(F d_v + C^2)`` beyond its inputs,
        its outputs and ``[G / den, delta]`` (``N x (d_v + 1)``), like the
        forward.
    """
    validation.check_instance(cache, "cache", FeatureAttentionCache, "the FeatureAttentionCache from feature_attention_forward")
    g = validation.check_grad_out(grad_out, cache.out.shape, ("N_q", "d_v"), cache.out.dtype)
    return scan_backward(g, cache)


def feature_attention(phi_q, phi_k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised feature-map attention; see :func:`feature_attention_forward`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    return feature_attention_forward(phi_q, phi_k, v, causal=causal, eps=eps, chunk_size=chunk_size)[0]
