r"""Baseline attention mechanisms, each a forward/backward pair with hand-derived gradients.

The derivations are in ``docs/derivations/softmax_attention.md`` and
``docs/derivations/scan.md``; this docstring states the results.

Softmax attention
-----------------
(``softmax_attention.md#backward``.)  Scores :math:`\ell = \beta\,\mathbf Q\mathbf K^\top` (the scale :math:`\beta` is
``scale``, :math:`1/\sqrt d` by default),
:math:`P = \operatorname{softmax}_{\text{row}}(\ell)` (entries :math:`j > i` set
to :math:`-\infty` first when causal), :math:`O = P\mathbf V`.  Backward, with
:math:`G = \partial L/\partial O`:

.. math::

    d\mathbf V = P^\top G,\qquad dP = G\mathbf V^\top,\qquad
    d\ell_{ij} = P_{ij}\big(dP_{ij} - \textstyle\sum_l P_{il}\, dP_{il}\big),\qquad
    d\mathbf Q = \beta\, d\ell\, \mathbf K,\qquad d\mathbf K = \beta\, d\ell^\top \mathbf Q.

The forward materialises the ``N x N`` matrix: time and memory are
:math:`O(N^2)`, the point of comparison for the linear-time mechanisms.
Every function here also takes leading batch (and head) dimensions,
``(..., N, d)``, the same for ``q``, ``k`` and ``v``: each sequence is
computed as on its own.  Softmax attention writes its products on the last
two dimensions (``@`` acts sequence by sequence), so each sequence's result
is the 2-D computation's, bit for bit; linear attention loops over the
sequences.

Linear attention
----------------
(``scan.md#linear-attention``.)  Normalised feature-map attention (:mod:`refimpl.scan`) with
:math:`\phi(x) = \operatorname{elu}(x) + 1` (Katharopoulos et al. 2020), which
is :math:`x + 1` for :math:`x > 0` and :math:`e^x` otherwise; its derivative
is 1 for :math:`x > 0` and :math:`e^x` otherwise, so
:math:`d\mathbf Q = d\Phi_Q \odot \phi'(\mathbf Q)` and :math:`d\mathbf K = d\Phi_K\odot\phi'(\mathbf K)`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import numerics, validation, varlen
from .scan import DEFAULT_CHUNK_SIZE, FeatureAttentionCache, FeatureAttentionGrads, scan_backward, scan_forward

__all__ = [
    "softmax_attention",
    "softmax_attention_forward",
    "softmax_attention_backward",
    "SoftmaxAttentionGrads",
    "SoftmaxAttentionCache",
    "elu_feature_map",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "LinearAttentionGrads",
    "LinearAttentionCache",
    "LinearAttentionBatchCache",
    "linear_forward_with",
    "linear_backward_with",
    "feature_attention",
    "feature_attention_forward",
    "feature_attention_backward",
]


class SoftmaxAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of softmax attention."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


class SoftmaxAttentionCache(NamedTuple):
    """What :func:`softmax_attention_backward` needs: the inputs, the attention matrices ``P`` and the scale.

    ``q, k, v`` as the forward checked them (``(..., N, d)``), ``p`` the
    ``N_q x N_k`` matrix of every sequence: memory ``O(N_q N_k)`` a sequence.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    p: np.ndarray  # (..., N_q, N_k) attention matrices
    scale: float


def _softmax_scores(q, k, scale, causal):
    """``scale q k^T`` of every sequence, ``(..., N_q, N_k)``; ``-inf`` above the diagonal when causal."""
    scores = q @ np.swapaxes(k, -1, -2)
    scores *= q.dtype.type(scale)
    if causal:
        # entries j > i get -inf, so exp gives exactly 0 (the diagonal keeps every row non-empty)
        scores[..., np.triu(np.ones(scores.shape[-2:], dtype=bool), k=1)] = -np.inf
    return scores


def softmax_attention_forward(q, k, v, *, scale=None, causal: bool = False, cu_seqlens=None):
    """Softmax attention ``softmax(scale q k^T) v``, keeping what the backward needs.

    Parameters
    ----------
    q : array_like, shape (N_q, d) or (..., N_q, d)
    k : array_like, shape (N_k, d) or (..., N_k, d)
    v : array_like, shape (N_k, d_v) or (..., N_k, d_v)
        The leading (batch, head) dimensions ``...`` are the same for all
        three; each ``(N, d)`` slice is one sequence, attended separately.
    scale : float, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i`` only (needs ``N_q == N_k``).
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences (:mod:`refimpl.varlen`): ``q``, ``k`` and ``v`` are
        ``(T, d)`` or ``(T, H, d)``, sequence ``s`` their rows
        ``cu_seqlens[s]:cu_seqlens[s + 1]``, attended on its own (its queries
        read its keys only).  The output is ``(T, d_v)`` or ``(T, H, d_v)``.

    Returns
    -------
    out : ndarray, shape (..., N_q, d_v)
        Dtype of the inputs (float32 only if all are float32).
    cache : SoftmaxAttentionCache
        What :func:`softmax_attention_backward` needs (packed, a
        :class:`refimpl.varlen.PackedCache` of the sequences' caches).

    Raises
    ------
    TypeError, ValueError
        For inputs of the wrong type, shape or values, and for rows whose
        scores overflow; with leading dimensions the message counts rows over
        all sequences in C order (row ``b N_q + i``).
    """
    if cu_seqlens is not None:
        check = lambda q1, k1, v1: validation.check_softmax_attention_any(q1, k1, v1, scale, causal)  # noqa: E731
        return varlen.packed(lambda s, q1, k1, v1: softmax_attention_forward(q1, k1, v1, scale=scale, causal=causal),
                             (q, k, v), cu_seqlens, ("q", "k", "v"), check, forward=True)
    q, k, v, scale, causal, _ = validation.check_softmax_attention_any(q, k, v, scale, causal)
    scores = _softmax_scores(q, k, scale, causal)
    validation.check_score_maxima(np.max(scores, axis=-1))
    # P = softmax_row(S), O = P V: sequence by sequence (the products act on the last two dimensions)
    p = numerics.softmax(scores, axis=-1)
    return p @ v, SoftmaxAttentionCache(q, k, v, p, scale)


def softmax_attention_backward(grad_out, cache) -> SoftmaxAttentionGrads:
    """Gradients of softmax attention; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (..., N_q, d_v)
        ``dL/d out``, of the output's shape.
    cache : SoftmaxAttentionCache
        The one :func:`softmax_attention_forward` returned with that output
        (or its :class:`refimpl.varlen.PackedCache`).

    Returns
    -------
    SoftmaxAttentionGrads
        The gradients ``q``, ``k`` and ``v``, in the shapes of the forward's
        inputs.
    """
    if isinstance(cache, varlen.PackedCache):
        return varlen.packed_backward(softmax_attention_backward, grad_out, cache)
    validation.check_instance(cache, "cache", SoftmaxAttentionCache, "the SoftmaxAttentionCache from softmax_attention_forward")
    q, k, v, p, scale = cache
    labels = ("...",) * (p.ndim > 2) + ("N_q", "d_v")
    g = validation.check_grad_out(grad_out, p.shape[:-1] + v.shape[-1:], labels, p.dtype)
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ np.swapaxes(v, -1, -2)
    # through the row softmax, then the scale: dS = scale P * (dP - rowsum(P * dP))
    ds = numerics.softmax_backward(p, dp, axis=-1)
    ds *= p.dtype.type(scale)
    return SoftmaxAttentionGrads(q=ds @ k, k=np.swapaxes(ds, -1, -2) @ q, v=dv)


def softmax_attention(q, k, v, *, scale=None, causal: bool = False, cu_seqlens=None):
    """Softmax attention ``softmax(scale q k^T) v``, for one sequence or a batch of them.

    Parameters
    ----------
    q : array_like, shape (..., N_q, d)
    k : array_like, shape (..., N_k, d)
    v : array_like, shape (..., N_k, d_v)
        The leading (batch, head) dimensions ``...`` are the same for all
        three; each ``(N, d)`` slice is one sequence, attended separately.
    scale, causal, cu_seqlens
        As in :func:`softmax_attention_forward`.

    Returns
    -------
    ndarray, shape (..., N_q, d_v)
        ``softmax_attention_forward(q, k, v)[0]``.  A row whose scores
        overflow is refused; with leading dimensions the error counts rows
        over all sequences in C order (row ``b N_q + i``).
    """
    return softmax_attention_forward(q, k, v, scale=scale, causal=causal, cu_seqlens=cu_seqlens)[0]


# ---------------------------------------------------------------------------
# Linear attention (elu + 1 feature map)
# ---------------------------------------------------------------------------


class LinearAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of linear attention."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


class LinearAttentionCache(NamedTuple):
    """What :func:`linear_attention_backward` needs from the forward pass."""

    q: np.ndarray
    k: np.ndarray
    features: FeatureAttentionCache


class LinearAttentionBatchCache(NamedTuple):
    """What :func:`linear_attention_backward` needs from a forward on ``(..., N, d)`` inputs."""

    leading: tuple  # the leading (batch, head) shape
    caches: tuple  # the LinearAttentionCache of each sequence, leading indices in C order


def elu_feature_map(x):
    """``elu(x) + 1``: ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise.

    Positive, except that ``exp(x)`` underflows to 0 for ``x`` below about
    -745 (float64) or -104 (float32); the denominators stay positive through ``eps``.

    Parameters
    ----------
    x : array_like
        Any shape; finite float32 or float64.

    Returns
    -------
    ndarray
        Same shape and dtype.
    """
    x = validation.as_float_array(x, "x")
    return _elu_feature_map(x)


def _elu_feature_map(x):
    # exp of min(x, 0) never overflows; the x > 0 branch does not use it
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _elu_feature_map_derivative(x):
    # d/dx (x + 1) = 1 for x > 0, d/dx exp(x) = exp(x) otherwise
    return np.where(x > 0, x.dtype.type(1), np.exp(np.minimum(x, 0)))


def linear_forward_with(scan, q, k, v, causal, eps, chunk_size, leading):
    """Linear attention's forward on checked arguments, sequence by sequence, mixed by ``scan``: ``(out, cache)``.

    The batch rule, written once for this module and the backends:
    each sequence at leading index ``idx`` is computed as on its own by
    ``scan`` (:func:`refimpl.scan.scan_forward` here) on the features
    ``phi(q)``, ``phi(k)``; the denominators of every sequence are checked
    once, at the end, their rows counted over the sequences in C order.
    ``cache`` is a :class:`LinearAttentionCache` for 2-D inputs, a
    :class:`LinearAttentionBatchCache` otherwise.
    """
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    caches = []
    for idx in np.ndindex(leading):
        # the scan of phi(q), phi(k), v: each sequence on its own
        out[idx], features = scan(_elu_feature_map(q[idx]), _elu_feature_map(k[idx]), v[idx], causal, eps, chunk_size)
        caches.append(LinearAttentionCache(q[idx], k[idx], features))
    validation.check_denominators(np.concatenate([c.features.den for c in caches]), eps, ("q", "k"))
    return out, (LinearAttentionBatchCache(leading, tuple(caches)) if leading else caches[0])


def linear_backward_with(scan, grad_out, cache) -> LinearAttentionGrads:
    """Linear attention's backward, sequence by sequence, through ``scan`` (the mixing's backward): the batch rule."""
    validation.check_instance(
        cache, "cache", (LinearAttentionCache, LinearAttentionBatchCache), "the LinearAttentionCache from linear_attention_forward"
    )
    leading, caches = (cache.leading, cache.caches) if isinstance(cache, LinearAttentionBatchCache) else ((), (cache,))
    first = caches[0]
    labels = ("...",) * bool(leading) + ("N_q", "d_v")
    g = validation.check_grad_out(grad_out, leading + first.features.out.shape, labels, first.features.out.dtype)
    grads = LinearAttentionGrads(*(np.empty(leading + a.shape, dtype=g.dtype) for a in (first.q, first.k, first.features.v)))
    for idx, c in zip(np.ndindex(leading), caches):
        d = scan(g[idx], c.features)
        # chain rule through the elementwise feature map
        grads.q[idx] = d.phi_q * _elu_feature_map_derivative(c.q)
        grads.k[idx] = d.phi_k * _elu_feature_map_derivative(c.k)
        grads.v[idx] = d.v
    return grads


def linear_attention_forward(q, k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                             cu_seqlens=None):
    """Linear attention with the ``elu + 1`` feature map (Katharopoulos et al. 2020).

    ``out_i = phi(q_i)^T S / (phi(q_i) . z + eps)`` with ``S = sum_j phi(k_j) v_j^T``
    and ``z = sum_j phi(k_j)`` (sums over ``j <= i`` when causal), in time
    ``O(N d d_v)``; computed by the scan of :mod:`refimpl.scan`.

    Parameters
    ----------
    q, k, v : array_like
        Queries ``(..., N_q, d)``, keys ``(..., N_k, d)`` and values
        ``(..., N_k, d_v)``: one leading (batch, head) shape ``...`` for the
        three, or none; each ``(N, d)`` slice is one sequence (at least one),
        attended separately.
    causal, eps, chunk_size : bool, float, int
        As in :func:`refimpl.attention.feature_attention_forward` (default
        ``False``, ``1e-6`` and 64): causal needs ``N_q == N_k``, and with
        ``eps = 0`` a zero denominator is refused.
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences (:mod:`refimpl.varlen`), as in
        :func:`softmax_attention_forward`: the sums ``S`` and ``z`` start at
        zero at each sequence.

    Returns
    -------
    out : ndarray, shape (..., N_q, d_v)
        Dtype of the inputs (float32 only if all are float32).
    cache : LinearAttentionCache or LinearAttentionBatchCache
        What :func:`linear_attention_backward` needs: for 2-D inputs a
        LinearAttentionCache, with leading dimensions a
        LinearAttentionBatchCache holding one per sequence (packed, a
        :class:`refimpl.varlen.PackedCache`).

    Raises
    ------
    TypeError, ValueError
        For inputs of the wrong type, shape or values, and (``eps = 0``) for
        a denominator of 0; with leading dimensions the message counts rows
        over all sequences in C order (row ``b N_q + i``).
    """
    if cu_seqlens is not None:
        check = lambda q1, k1, v1: validation.check_linear_attention_any(q1, k1, v1, causal, eps, chunk_size)  # noqa: E731
        return varlen.packed(lambda s, q1, k1, v1: linear_attention_forward(q1, k1, v1, causal=causal, eps=eps, chunk_size=chunk_size),
                             (q, k, v), cu_seqlens, ("q", "k", "v"), check, forward=True)
    return linear_forward_with(scan_forward, *validation.check_linear_attention_any(q, k, v, causal, eps, chunk_size))


def linear_attention_backward(grad_out, cache) -> LinearAttentionGrads:
    """Gradients of linear attention; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (..., N_q, d_v)
        ``dL/d out``.
    cache : LinearAttentionCache or LinearAttentionBatchCache
        What :func:`linear_attention_forward` returned (or its
        :class:`refimpl.varlen.PackedCache`).

    Returns
    -------
    LinearAttentionGrads
        ``q``, ``k`` and ``v``: the gradients, each of its input's shape.
    """
    if isinstance(cache, varlen.PackedCache):
        return varlen.packed_backward(linear_attention_backward, grad_out, cache)
    return linear_backward_with(scan_backward, grad_out, cache)


def linear_attention(q, k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     cu_seqlens=None):
    """Linear attention with the ``elu + 1`` feature map; see :func:`linear_attention_forward`.

    Parameters are those of :func:`linear_attention_forward`.

    Returns
    -------
    ndarray, shape (..., N_q, d_v)
    """
    return linear_attention_forward(q, k, v, causal=causal, eps=eps, chunk_size=chunk_size, cu_seqlens=cu_seqlens)[0]


# ---------------------------------------------------------------------------
# Normalised attention with given feature maps
# ---------------------------------------------------------------------------


def feature_attention_forward(phi_q, phi_k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised attention with given nonnegative feature maps, in linear time.

    ``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)`` with ``a_ij = phi_q_i . phi_k_j``
    (``j <= i`` only when causal), computed without the ``N x N`` matrix
    (the chunked causal scan of :mod:`refimpl.scan`).

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
    phi_q, phi_k, v, causal, eps, chunk_size = validation.check_feature_attention(phi_q, phi_k, v, causal, eps, chunk_size)
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
