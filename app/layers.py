r"""A multi-head Gaussian Mixture Attention layer with its hand-derived backward.

Shapes: the input ``x`` is ``(B, N, d_model)``; there are ``H`` heads, each
with routing dimension ``d_r``, value dimension ``d_v`` and its own GMM of
``K`` diagonal components.  The derivation is in ``docs/derivations/layers.md``
(``#forward``, ``#backward``, ``#cost``); this docstring states the results.

Forward
-------
For every sequence ``b`` (rows :math:`X = x_b`, ``N x d_model``) and head ``h``,

.. math::

    X_Q^{(h)} = X W_Q^{(h)},\quad X_K^{(h)} = X W_K^{(h)},\quad \mathbf V^{(h)} = X W_V^{(h)},\quad
    O^{(h)} = \operatorname{GMA}(X_Q^{(h)}, X_K^{(h)}, \mathbf V^{(h)};\ \mu^{(h)}, s^{(h)}, a^{(h)}),

and the heads are concatenated and projected back:
:math:`Y = [O^{(1)}\,\cdots\,O^{(H)}]\,W_O`.  The projections are stored as
matrices, ``W_q`` ``(d_model, H d_r)``, ``W_k`` ``(d_model, H d_r)``,
``W_v`` ``(d_model, H d_v)``, ``W_o`` ``(H d_v, d_model)``; head ``h`` uses
the ``h``-th block of columns (of rows for ``W_o``).  The GMM parameters are
``means`` and ``raw_variances`` ``(H, K, d_r)`` and ``logits`` ``(H, K)``,
with variances ``softplus(raw) + min_variance`` and weights ``softmax(logits)``
(:func:`refimpl.gma.gma_forward`).  There are no biases.

Backward
--------
With :math:`G = \partial L/\partial Y` and :math:`O` the concatenated heads,

.. math::

    dW_O = \sum_b O_b^\top G_b,\qquad dO = G W_O^\top,

:func:`refimpl.gma.gma_backward` turns each head's block of :math:`dO` into
:math:`dX_Q^{(h)}, dX_K^{(h)}, d\mathbf V^{(h)}` and the GMM gradients, and the
projections give

.. math::

    dW_Q = \sum_b X_b^\top dX_{Q,b},\quad dW_K = \sum_b X_b^\top dX_{K,b},\quad
    dW_V = \sum_b X_b^\top d\mathbf V_b,\quad
    dX = dX_Q W_Q^\top + dX_K W_K^\top + d\mathbf V W_V^\top .

GMM gradients are summed over the batch.  Time is linear in ``N``:
:math:`O(B H N K (d_r + d_v) + B N d_{\text{model}} H (d_r + d_v))`, plus
:math:`O(B H N C (K + d_v))` for the within-chunk blocks when causal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from refimpl import gmm, validation
from refimpl.gma import GMABatchCache
from . import backend
from refimpl.scan import DEFAULT_CHUNK_SIZE

__all__ = [
    "MultiheadGMAParams",
    "MultiheadGMAGrads",
    "MultiheadGMACache",
    "init_multihead_gma",
    "multihead_gma_forward",
    "multihead_gma_backward",
    "multihead_gma",
]


class MultiheadGMAParams(NamedTuple):
    """Parameters of a multi-head GMA layer (shapes in the module docstring)."""

    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    means: np.ndarray
    raw_variances: np.ndarray
    logits: np.ndarray


class MultiheadGMAGrads(NamedTuple):
    """Gradients of the loss with respect to the input ``x`` and every parameter."""

    x: np.ndarray
    W_q: np.ndarray
    W_k: np.ndarray
    W_v: np.ndarray
    W_o: np.ndarray
    means: np.ndarray
    raw_variances: np.ndarray
    logits: np.ndarray


class MultiheadGMACache(NamedTuple):
    """What :func:`multihead_gma_backward` needs from the forward pass."""

    x: np.ndarray
    params: MultiheadGMAParams
    heads: np.ndarray  # (B, N, H d_v) concatenated head outputs
    gma: tuple  # gma[b][h] is the refimpl.gma.GMACache of sequence b, head h; packed, the cache of gma_forward's packed call
    packed: bool = False  # a packed batch (cu_seqlens): gma is the packed call's cache


def init_multihead_gma(
    d_model: int,
    n_heads: int,
    d_route: int,
    d_value: int,
    n_components: int,
    *,
    seed=0,
    init_variance: float = 1.0,
    min_variance: float = 1e-6,
    dtype=np.float64,
) -> MultiheadGMAParams:
    """Random parameters for a multi-head GMA layer.

    Projections are Gaussian with variance ``1 / fan_in`` (so a token with
    unit-variance features gives routing coordinates of variance about one),
    means are standard normal, every variance starts at ``init_variance`` and
    the mixture weights start uniform (``logits = 0``).

    Parameters
    ----------
    d_model, n_heads, d_route, d_value, n_components : int
        ``d_model``, ``H``, ``d_r``, ``d_v`` and ``K``; all >= 1.
    seed : int or numpy.random.Generator, default 0
        An integer >= 0 seeds ``numpy.random.default_rng``; a generator is used
        (and advanced) as given.
    init_variance : float, default 1.0
        Initial variance of every component; must exceed ``min_variance``.
    min_variance : float, default 1e-6
        The floor used by :func:`multihead_gma_forward` (the raw variances are
        set so that ``softplus(raw) + min_variance = init_variance``).
    dtype : float32 or float64, default float64

    Returns
    -------
    MultiheadGMAParams
    """
    d_model, H, d_r, d_v, K, init_variance, min_variance, dtype, seed = _check_init(
        d_model, n_heads, d_route, d_value, n_components, seed, init_variance, min_variance, dtype
    )
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    raw = float(gmm.raw_from_variances(np.array(init_variance), min_variance))
    params = MultiheadGMAParams(
        W_q=rng.normal(size=(d_model, H * d_r)) / np.sqrt(d_model),
        W_k=rng.normal(size=(d_model, H * d_r)) / np.sqrt(d_model),
        W_v=rng.normal(size=(d_model, H * d_v)) / np.sqrt(d_model),
        W_o=rng.normal(size=(H * d_v, d_model)) / np.sqrt(H * d_v),
        means=rng.normal(size=(H, K, d_r)),
        raw_variances=np.full((H, K, d_r), raw),
        logits=np.zeros((H, K)),
    )
    return MultiheadGMAParams(*(p.astype(dtype) for p in params))


def _check_init(d_model, n_heads, d_route, d_value, n_components, seed, init_variance, min_variance, dtype):
    sizes = [
        validation.check_int(value, name, minimum=1)
        for value, name in zip((d_model, n_heads, d_route, d_value, n_components), ("d_model", "n_heads", "d_route", "d_value", "n_components"))
    ]
    init_variance = validation.check_positive_float(init_variance, "init_variance")
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    if init_variance <= min_variance:
        raise ValueError(f"init_variance: expected a value > min_variance = {min_variance}, got {init_variance}")
    dtype = validation.check_float_dtype(dtype, "dtype")
    seed = validation.check_seed(seed, "seed")
    return (*sizes, init_variance, min_variance, dtype, seed)


def _check_params(params, d_model):
    if isinstance(params, Mapping):
        missing = set(MultiheadGMAParams._fields) - set(params)
        if missing:
            raise ValueError(f"params: missing entries {sorted(missing)}; expected {list(MultiheadGMAParams._fields)}")
        params = MultiheadGMAParams(**{f: params[f] for f in MultiheadGMAParams._fields})
    elif not isinstance(params, MultiheadGMAParams):
        raise TypeError(f"params: expected a MultiheadGMAParams or a mapping with its fields, got {type(params).__name__}")
    ndims = dict(W_q=2, W_k=2, W_v=2, W_o=2, means=3, raw_variances=3, logits=2)
    p = {f: validation.as_float_array(getattr(params, f), f"params.{f}", ndim=ndims[f]) for f in MultiheadGMAParams._fields}
    H, K, d_r = p["means"].shape
    if H < 1 or K < 1 or d_r < 1:
        raise ValueError(f"params.means: expected shape (H, K, d_r) with every size >= 1, got {p['means'].shape}")
    validation.check_shape(p["raw_variances"], "params.raw_variances", (H, K, d_r), ("H", "K", "d_r"))
    validation.check_shape(p["logits"], "params.logits", (H, K), ("H", "K"))
    validation.check_shape(p["W_q"], "params.W_q", (d_model, H * d_r), ("d_model", "H * d_r"))
    validation.check_shape(p["W_k"], "params.W_k", (d_model, H * d_r), ("d_model", "H * d_r"))
    validation.check_ndim(p["W_v"], "params.W_v", 2)
    if p["W_v"].shape[0] != d_model or p["W_v"].shape[1] % H or p["W_v"].shape[1] == 0:
        raise ValueError(
            f"params.W_v: expected shape (d_model, H * d_v) with d_model = {d_model}, H = {H}, got {p['W_v'].shape}"
        )
    d_v = p["W_v"].shape[1] // H
    validation.check_shape(p["W_o"], "params.W_o", (H * d_v, d_model), ("H * d_v", "d_model"))
    return MultiheadGMAParams(**p), H, d_r, d_v


def _check_forward(x, params, causal, eps, min_variance, chunk_size):
    x = validation.as_float_array(x, "x", ndim=3)
    if min(x.shape) < 1:
        raise ValueError(f"x: expected shape (B, N, d_model) with every size >= 1, got {x.shape}")
    params, H, d_r, d_v = _check_params(params, x.shape[2])
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    dtype = validation.common_float_dtype(x, *params)
    params = MultiheadGMAParams(*(p.astype(dtype, copy=False) for p in params))
    return x.astype(dtype, copy=False), params, H, d_r, d_v, causal, eps, min_variance, chunk_size


def multihead_gma_forward(
    x,
    params,
    *,
    causal: bool = False,
    eps: float = 1e-6,
    min_variance: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens=None,
):
    """Multi-head GMA self-attention over a batch of sequences.

    Parameters
    ----------
    x : array_like, shape (B, N, d_model)
    params : MultiheadGMAParams or mapping with the same fields
        From :func:`init_multihead_gma`.
    causal : bool, default False
        Token ``t`` reads tokens ``j <= t`` only (chunked scan).
    eps : float, default 1e-6
        Normaliser guard of every head.
    min_variance : float, default 1e-6
        Variance floor of every GMM.
    chunk_size : int, default 64
        Tokens per chunk of the causal scan.
    cu_seqlens : sequence of int, shape (S + 1,), optional
        A packed batch (:mod:`refimpl.varlen`): ``x`` is ``(1, T, d_model)``,
        the ``S`` sequences one after another, sequence ``s`` its tokens
        ``cu_seqlens[s]:cu_seqlens[s + 1]``, each mixed on its own.

    Returns
    -------
    out : ndarray, shape (B, N, d_model)
        Dtype of ``x`` and the parameters (float32 only if all are float32).
    cache : MultiheadGMACache
    """
    x, params, H, d_r, d_v, causal, eps, min_variance, chunk_size = _check_forward(x, params, causal, eps, min_variance, chunk_size)
    B, N, _ = x.shape

    # the projections of all B N tokens at once: (B, N, d_model) @ (d_model, H d)
    xq = (x @ params.W_q).reshape(B, N, H, d_r)
    xk = (x @ params.W_k).reshape(B, N, H, d_r)
    vv = (x @ params.W_v).reshape(B, N, H, d_v)
    gma_forward = backend.kernels().gma_forward  # refimpl.tuned or cpu.gma (app.backend)
    mixture = (params.means, params.raw_variances, params.logits)
    options = dict(causal=causal, eps=eps, min_variance=min_variance, chunk_size=chunk_size)
    if cu_seqlens is not None:
        # packed: the T tokens (T, H, d), each sequence on its own (refimpl.varlen)
        out, packed_cache = gma_forward(xq[0], xk[0], vv[0], *mixture, **options, cu_seqlens=cu_seqlens)
        heads = out.reshape(B, N, H * d_v)
        return heads @ params.W_o, MultiheadGMACache(x, params, heads, packed_cache, packed=True)
    # every (sequence, head) in one call, (B, H, N, d), head h with its own GMM: the batch rule of refimpl.gma
    out, batch = gma_forward(*(np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (xq, xk, vv)), *mixture, **options)
    heads = out.transpose(0, 2, 1, 3)
    caches = [batch.caches[b * H : (b + 1) * H] for b in range(B)]
    heads = heads.reshape(B, N, H * d_v)
    return heads @ params.W_o, MultiheadGMACache(x, params, heads, tuple(caches))


def multihead_gma_backward(grad_out, cache) -> MultiheadGMAGrads:
    """Hand-derived gradients of :func:`multihead_gma_forward`; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (B, N, d_model)
        ``dL/d out``.
    cache : MultiheadGMACache
        From :func:`multihead_gma_forward`.

    Returns
    -------
    MultiheadGMAGrads
        ``x`` (B, N, d_model) and one field per parameter, of that
        parameter's shape; GMM and projection gradients are summed over the
        batch.
    """
    validation.check_instance(cache, "cache", MultiheadGMACache, "the MultiheadGMACache from multihead_gma_forward")
    x, p, heads = cache.x, cache.params, cache.heads
    B, N, d_model = x.shape
    H, K, d_r = p.means.shape
    d_v = p.W_v.shape[1] // H
    g = validation.check_grad_out(grad_out, (B, N, d_model), ("B", "N", "d_model"), x.dtype)

    # Y = O W_o: dW_o = sum_b O_b^T G_b, dO = G W_o^T
    dW_o = heads.reshape(B * N, H * d_v).T @ g.reshape(B * N, d_model)
    dheads = (g @ p.W_o.T).reshape(B, N, H, d_v)
    gma_backward = backend.kernels().gma_backward
    if cache.packed:
        # packed: the gradients (T, H, d) of every sequence, from the backend's cache of the packed call
        gr = gma_backward(dheads[0], cache.gma)
        dxq, dxk, dvv = (a[None] for a in (gr.x_q, gr.x_k, gr.v))
    else:
        # one call for every (sequence, head); the GMM gradients of head h are summed over the sequences in order
        batch = GMABatchCache((B, H), True, tuple(c for row in cache.gma for c in row))
        gr = gma_backward(np.ascontiguousarray(dheads.transpose(0, 2, 1, 3)), batch)
        dxq, dxk, dvv = (a.transpose(0, 2, 1, 3) for a in (gr.x_q, gr.x_k, gr.v))
    dmeans, draw, dlogits = gr.means, gr.raw_variances, gr.logits
    dxq, dxk, dvv = (a.reshape(B * N, -1) for a in (dxq, dxk, dvv))
    xf = x.reshape(B * N, d_model)
    # X_Q = X W_q: dW_q = X^T dX_Q and dX = dX_Q W_q^T (likewise for k and v)
    dx = dxq @ p.W_q.T + dxk @ p.W_k.T + dvv @ p.W_v.T
    return MultiheadGMAGrads(
        x=dx.reshape(B, N, d_model),
        W_q=xf.T @ dxq,
        W_k=xf.T @ dxk,
        W_v=xf.T @ dvv,
        W_o=dW_o,
        means=dmeans,
        raw_variances=draw,
        logits=dlogits,
    )


def multihead_gma(x, params, *, causal: bool = False, eps: float = 1e-6, min_variance: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Multi-head GMA self-attention; see :func:`multihead_gma_forward`.

    Returns
    -------
    ndarray, shape (B, N, d_model)
    """
    return multihead_gma_forward(x, params, causal=causal, eps=eps, min_variance=min_variance, chunk_size=chunk_size)[0]
