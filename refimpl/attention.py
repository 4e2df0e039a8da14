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
:func:`softmax_attention` also takes leading batch (and head) dimensions,
``(..., N, d)``, the same for ``q``, ``k`` and ``v``: a loop over the
sequences, each the 2-D computation bit for bit.

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

from . import numerics, validation
from .scan import DEFAULT_CHUNK_SIZE, FeatureAttentionCache, scan_backward, scan_forward

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
]


class SoftmaxAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of softmax attention."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


class SoftmaxAttentionCache(NamedTuple):
    """What :func:`softmax_attention_backward` needs: a tuple ``(q, k, v, p, scale)``."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    p: np.ndarray  # (N_q, N_k) attention matrix
    scale: float


# who is blamed, and the fix, when the scores of a row overflow
_SCORE_NAMES = "scale, q, k"
_SCORE_FIX = "lower scale or rescale q and k"


def _check_attention(q, k, v, causal):
    q, k, v = validation.check_qkv(q, k, v)
    causal = validation.check_bool(causal, "causal")
    validation.check_causal_lengths(q.shape[0], k.shape[0], causal, names=("q", "k"))
    return q, k, v, causal


def check_softmax_attention(q, k, v, scale, causal):
    """The checks of :func:`softmax_attention_forward` (2-D ``q, k, v``); the GPU backends share it."""
    q, k, v, causal = _check_attention(q, k, v, causal)
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else validation.check_positive_float(scale, "scale")
    return q, k, v, scale, causal


def check_batched_qkv(q, k, v) -> tuple:
    """``q (..., N_q, d)``, ``k (..., N_k, d)``, ``v (..., N_k, d_v)`` with one leading shape; the GPU backends share it.

    Returns ``(q, k, v, batch_shape)``, the arrays cast to their common float
    dtype.  2-D arrays are checked by :func:`refimpl.validation.check_qkv`
    (``batch_shape = ()``); with leading dimensions, every ``(..., N, d)``
    slice must pass the same check, so the messages about the last two
    dimensions are the 2-D ones.
    """
    if all(np.ndim(a) == 2 for a in (q, k, v)):
        return validation.check_qkv(q, k, v) + ((),)
    q, k, v = (validation.as_float_array(a, name, finite=False) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    if min(q.ndim, k.ndim, v.ndim) < 2 or not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k, v: expected arrays with the same leading (batch) dimensions, each at least a 2-D array "
            f"(..., N_q, d), (..., N_k, d), (..., N_k, d_v); got shapes {q.shape}, {k.shape} and {v.shape}"
        )
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        validation.check_finite(a, name)
    # the 2-D checks of one (N, d) slice: zero-stride stand-ins of the last two dimensions (there may be no slice)
    validation.check_qkv(*(np.broadcast_to(np.zeros((), a.dtype), a.shape[-2:]) for a in (q, k, v)))
    dtype = validation.common_float_dtype(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), q.shape[:-2]


def check_batched_softmax_attention(q, k, v, scale, causal):
    """The checks of :func:`softmax_attention` (leading batch dimensions allowed); the GPU backends share it.

    Returns ``(q, k, v, scale, causal, batch_shape)``.
    """
    q, k, v, batch_shape = check_batched_qkv(q, k, v)
    causal = validation.check_bool(causal, "causal")
    validation.check_causal_lengths(q.shape[-2], k.shape[-2], causal, names=("q", "k"))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else validation.check_positive_float(scale, "scale")
    return q, k, v, scale, causal, batch_shape


def check_score_maxima(row_max) -> None:
    """Refuse score rows whose maximum is not finite (overflow), as the forward's check of its logits; the GPU backends share it.

    ``row_max`` holds the maximum score of every row, the rows of all
    sequences counted in C order (row ``b N_q + i`` for query ``i`` of
    sequence ``b``); the message is that of
    :func:`refimpl.validation.check_softmax_logits` on those rows.
    """
    row_max = np.asarray(row_max)
    bad = ~np.isfinite(row_max.ravel())
    validation.check_overflowed_rows(int(np.sum(bad)), int(np.argmax(bad)) if bad.size else 0, row_max.dtype, _SCORE_NAMES, _SCORE_FIX)


def _softmax_scores(q, k, scale, causal):
    scores = q @ k.T
    scores *= q.dtype.type(scale)
    if causal:
        # entries j > i get -inf, so exp gives exactly 0 (the diagonal keeps every row non-empty)
        scores[np.triu_indices(scores.shape[0], k=1)] = -np.inf
    return scores


def softmax_attention_forward(q, k, v, *, scale=None, causal: bool = False):
    """Softmax attention ``softmax(scale q k^T) v``, keeping what the backward needs.

    Parameters
    ----------
    q : array_like, shape (N_q, d)
    k : array_like, shape (N_k, d)
    v : array_like, shape (N_k, d_v)
    scale : float, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i`` only (needs ``N_q == N_k``).

    Returns
    -------
    out : ndarray, shape (N_q, d_v)
    cache : SoftmaxAttentionCache
        The tuple ``(q, k, v, P, scale)`` with ``P`` the ``N_q x N_k`` attention matrix.
    """
    q, k, v, scale, causal = check_softmax_attention(q, k, v, scale, causal)
    scores = _softmax_scores(q, k, scale, causal)
    validation.check_softmax_logits(scores, _SCORE_NAMES, _SCORE_FIX)
    p = numerics.softmax(scores, axis=1)
    return p @ v, SoftmaxAttentionCache(q, k, v, p, scale)


def softmax_attention_backward(grad_out, cache) -> SoftmaxAttentionGrads:
    """Gradients of softmax attention; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (N_q, d_v)
        ``dL/d out``.
    cache : SoftmaxAttentionCache
        From :func:`softmax_attention_forward`.

    Returns
    -------
    SoftmaxAttentionGrads
        Fields ``q`` (N_q, d), ``k`` (N_k, d), ``v`` (N_k, d_v).
    """
    validation.check_instance(cache, "cache", SoftmaxAttentionCache, "the SoftmaxAttentionCache from softmax_attention_forward")
    q, k, v, p, scale = cache
    g = validation.check_grad_out(grad_out, (q.shape[0], v.shape[1]), ("N_q", "d_v"), p.dtype)
    dv = p.T @ g
    dp = g @ v.T
    # softmax Jacobian row by row: dS = P * (dP - rowsum(P * dP))
    ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
    ds *= p.dtype.type(scale)
    return SoftmaxAttentionGrads(q=ds @ k, k=ds.T @ q, v=dv)


def _batched_softmax_attention(q, k, v, scale, causal, batch_shape):
    """Core: the forward of every ``(N, d)`` slice, and the maximum score of every row (no raise).

    Returns ``out (..., N_q, d_v)`` and ``row_max (..., N_q)``; a slice with a
    row whose maximum is not finite is left unnormalised (its output is
    refused by the caller).
    """
    out = np.zeros(batch_shape + (q.shape[-2], v.shape[-1]), dtype=q.dtype)
    row_max = np.empty(batch_shape + (q.shape[-2],), dtype=q.dtype)
    for idx in np.ndindex(*batch_shape):
        scores = _softmax_scores(q[idx], k[idx], scale, causal)
        row_max[idx] = np.max(scores, axis=1)
        if np.all(np.isfinite(row_max[idx])):
            out[idx] = numerics.softmax(scores, axis=1) @ v[idx]
    return out, row_max


def softmax_attention(q, k, v, *, scale=None, causal: bool = False):
    """Softmax attention ``softmax(scale q k^T) v``, for one sequence or a batch of them.

    Parameters
    ----------
    q : array_like, shape (..., N_q, d)
    k : array_like, shape (..., N_k, d)
    v : array_like, shape (..., N_k, d_v)
        The leading (batch, head) dimensions ``...`` are the same for all
        three; each ``(N, d)`` slice is one sequence, attended separately.
    scale, causal
        As in :func:`softmax_attention_forward`.

    Returns
    -------
    ndarray, shape (..., N_q, d_v)
        For 2-D inputs, exactly ``softmax_attention_forward(q, k, v)[0]``.
        A row whose scores overflow is refused; with leading dimensions the
        error counts rows over all sequences in C order (row ``b N_q + i``).
    """
    if all(np.ndim(a) == 2 for a in (q, k, v)):
        return softmax_attention_forward(q, k, v, scale=scale, causal=causal)[0]
    q, k, v, scale, causal, batch_shape = check_batched_softmax_attention(q, k, v, scale, causal)
    out, row_max = _batched_softmax_attention(q, k, v, scale, causal, batch_shape)
    check_score_maxima(row_max)
    return out


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
    return _elu_feature_map(validation.as_float_array(x, "x"))


def _elu_feature_map(x):
    # exp of min(x, 0) never overflows; the x > 0 branch does not use it
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _elu_feature_map_derivative(x):
    # d/dx (x + 1) = 1 for x > 0, d/dx exp(x) = exp(x) otherwise
    return np.where(x > 0, x.dtype.type(1), np.exp(np.minimum(x, 0)))


def _check_linear_attention(q, k, v, causal, eps, chunk_size):
    q, k, v, causal = _check_attention(q, k, v, causal)
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    return q, k, v, causal, eps, chunk_size


def linear_attention_forward(q, k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Linear attention with the ``elu + 1`` feature map (Katharopoulos et al. 2020).

    ``out_i = phi(q_i)^T S / (phi(q_i) . z + eps)`` with ``S = sum_j phi(k_j) v_j^T``
    and ``z = sum_j phi(k_j)`` (sums over ``j <= i`` when causal), in time
    ``O(N d d_v)``; computed by the scan of :mod:`refimpl.scan`.

    Parameters
    ----------
    q : array_like, shape (N_q, d)
    k : array_like, shape (N_k, d)
    v : array_like, shape (N_k, d_v)
    causal : bool, default False
        Query ``t`` sees keys ``j <= t`` only (needs ``N_q == N_k``).
    eps : float, default 1e-6
        Added to every denominator (>= 0).  With 0, a query whose denominator
        is 0 (no overlap with the keys it reads) is refused: its output is 0/0.
    chunk_size : int, default 64
        Tokens per chunk of the causal scan (>= 1).

    Returns
    -------
    out : ndarray, shape (N_q, d_v)
    cache : LinearAttentionCache
    """
    q, k, v, causal, eps, chunk_size = _check_linear_attention(q, k, v, causal, eps, chunk_size)
    out, features = scan_forward(_elu_feature_map(q), _elu_feature_map(k), v, causal, eps, chunk_size)
    validation.check_denominators(features.den, eps, ("q", "k"))
    return out, LinearAttentionCache(q, k, features)


def linear_attention_backward(grad_out, cache) -> LinearAttentionGrads:
    """Gradients of linear attention; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (N_q, d_v)
        ``dL/d out``.
    cache : LinearAttentionCache
        From :func:`linear_attention_forward`.

    Returns
    -------
    LinearAttentionGrads
        Fields ``q`` (N_q, d), ``k`` (N_k, d), ``v`` (N_k, d_v).
    """
    validation.check_instance(cache, "cache", LinearAttentionCache, "the LinearAttentionCache from linear_attention_forward")
    g = validation.check_grad_out(grad_out, cache.features.out.shape, ("N_q", "d_v"), cache.features.out.dtype)
    d = scan_backward(g, cache.features)
    # chain rule through the elementwise feature map
    return LinearAttentionGrads(
        q=d.phi_q * _elu_feature_map_derivative(cache.q),
        k=d.phi_k * _elu_feature_map_derivative(cache.k),
        v=d.v,
    )


def linear_attention(q, k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Linear attention with the ``elu + 1`` feature map; see :func:`linear_attention_forward`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    return linear_attention_forward(q, k, v, causal=causal, eps=eps, chunk_size=chunk_size)[0]

