r"""Baseline attention mechanisms, each a forward/backward pair with hand-derived gradients.

Softmax attention
-----------------
With scores :math:`S = s\,QK^\top` (scale :math:`s = 1/\sqrt d` by default),
:math:`P = \operatorname{softmax}_{\text{row}}(S)` (entries :math:`j > i` set
to :math:`-\infty` first when causal) and :math:`O = PV`.  Backward, with
:math:`G = \partial L/\partial O`:

.. math::

    dV = P^\top G,\qquad dP = G V^\top,\qquad
    dS_{ij} = P_{ij}\big(dP_{ij} - \textstyle\sum_l P_{il}\, dP_{il}\big),\qquad
    dQ = s\, dS\, K,\qquad dK = s\, dS^\top Q.

The row-softmax Jacobian :math:`\operatorname{diag}(p) - pp^\top` gives the
:math:`dS` line; masked entries have :math:`P_{ij} = 0` and so receive no
gradient.  The forward materialises the ``N x N`` matrix: time and memory are
:math:`O(N^2)`, which is the point of comparison for the linear-time mechanisms.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _validation as V
from .gmm import softmax

__all__ = [
    "softmax_attention",
    "softmax_attention_forward",
    "softmax_attention_backward",
    "SoftmaxAttentionGrads",
]


class SoftmaxAttentionGrads(NamedTuple):
    """Gradients of the loss with respect to the inputs of softmax attention."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def _check_qkv(q, k, v, causal):
    q = V.as_float_array(q, "q", ndim=2)
    k = V.as_float_array(k, "k", ndim=2)
    v = V.as_float_array(v, "v", ndim=2)
    V.check_shape(k, "k", (None, q.shape[1]), ("N_k", "d"))
    V.check_shape(v, "v", (k.shape[0], None), ("N_k", "d_v"))
    causal = V.check_bool(causal, "causal")
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"causal=True needs as many queries as keys (position i attends to j <= i), "
            f"got q with {q.shape[0]} rows and k with {k.shape[0]}"
        )
    if q.shape[0] < 1 or k.shape[0] < 1:
        raise ValueError(f"q, k: expected at least one row each, got shapes {q.shape} and {k.shape}")
    dtype = V.common_float_dtype(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), causal


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
    cache : tuple
        ``(q, k, v, P, scale)`` with ``P`` the ``N_q x N_k`` attention matrix.
    """
    q, k, v, causal = _check_qkv(q, k, v, causal)
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else V.check_positive_float(scale, "scale")
    scores = q @ k.T
    scores *= q.dtype.type(scale)
    if causal:
        # entries j > i get -inf, so exp gives exactly 0 (the diagonal keeps every row non-empty)
        scores[np.triu_indices(scores.shape[0], k=1)] = -np.inf
    p = softmax(scores, axis=1)
    return p @ v, (q, k, v, p, scale)


def softmax_attention_backward(grad_out, cache) -> SoftmaxAttentionGrads:
    """Gradients of softmax attention; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (N_q, d_v)
        ``dL/d out``.
    cache : tuple
        From :func:`softmax_attention_forward`.

    Returns
    -------
    SoftmaxAttentionGrads
        Fields ``q`` (N_q, d), ``k`` (N_k, d), ``v`` (N_k, d_v).
    """
    q, k, v, p, scale = cache
    g = V.as_float_array(grad_out, "grad_out", ndim=2)
    V.check_shape(g, "grad_out", (q.shape[0], v.shape[1]), ("N_q", "d_v"))
    g = g.astype(p.dtype, copy=False)
    dv = p.T @ g
    dp = g @ v.T
    # softmax Jacobian row by row: dS = P * (dP - rowsum(P * dP))
    ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
    ds *= p.dtype.type(scale)
    return SoftmaxAttentionGrads(q=ds @ k, k=ds.T @ q, v=dv)


def softmax_attention(q, k, v, *, scale=None, causal: bool = False):
    """Softmax attention ``softmax(scale q k^T) v``.

    Parameters and shapes are those of :func:`softmax_attention_forward`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    return softmax_attention_forward(q, k, v, scale=scale, causal=causal)[0]
