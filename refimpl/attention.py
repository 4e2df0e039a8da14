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

Normalised feature-map attention
--------------------------------
Given nonnegative feature maps :math:`\Phi_Q` (``N_q x F``) and
:math:`\Phi_K` (``N_k x F``), the normalised linear form is

.. math::

    O = D^{-1} A V,\qquad A = \Phi_Q \Phi_K^\top\ (\text{lower triangle when causal}),
    \qquad D = \operatorname{diag}(A\mathbf 1 + \epsilon).

Associativity, :math:`(\Phi_Q\Phi_K^\top)V = \Phi_Q(\Phi_K^\top V)`, removes
the ``N x N`` matrix.  Bidirectional: :math:`S = \Phi_K^\top V` (``F x d_v``),
:math:`z = \Phi_K^\top \mathbf 1` and :math:`o_i = \phi^Q_i{}^\top S / (\phi^Q_i\cdot z + \epsilon)`.
Causal: the same with prefix sums :math:`S_t = \sum_{j\le t}\phi^K_j v_j^\top`,
:math:`z_t = \sum_{j\le t}\phi^K_j`.  Linear attention (Katharopoulos et al.
2020) uses :math:`\phi(x) = \operatorname{elu}(x) + 1`; Gaussian-mixture
attention uses the GMM responsibilities (:mod:`refimpl.gma`).  Both call the
one implementation here.

**Chunked causal scan.**  ``cumsum(phi_k[:, :, None] * v[:, None, :])`` would
hold ``N x F x d_v`` numbers.  Instead the sequence is cut into chunks of
``C`` tokens.  For a chunk :math:`c` with carried state
:math:`(S_{\text{prev}}, z_{\text{prev}})` from the chunks before it,

.. math::

    O_c = \frac{\Phi^Q_c S_{\text{prev}} + \operatorname{tril}(\Phi^Q_c \Phi^{K\top}_c) V_c}
               {\Phi^Q_c z_{\text{prev}} + \operatorname{tril}(\Phi^Q_c \Phi^{K\top}_c)\mathbf 1 + \epsilon},
    \qquad S \mathrel{+}= \Phi^{K\top}_c V_c,\quad z \mathrel{+}= \Phi^{K\top}_c \mathbf 1 .

Every step is a matrix product; extra memory is :math:`O(F d_v + C^2 + C F)`
beyond the inputs and the output, time :math:`O(N F d_v + N C (F + d_v))`.

**Backward.**  With :math:`G = \partial L/\partial O`, ``den`` the
denominators, :math:`\tilde G = G/\text{den}` (row-wise) and
:math:`\delta_i = -(G_i\cdot O_i)/\text{den}_i` (the derivative through the
denominator), the bidirectional gradients are

.. math::

    d\Phi_Q = \tilde G S^\top + \delta z^\top,\quad
    dS = \Phi_Q^\top \tilde G,\quad dz = \Phi_Q^\top\delta,\quad
    d\Phi_K = V dS^\top + \mathbf 1 dz^\top,\quad dV = \Phi_K dS .

Causal: :math:`d\phi^Q_t = S_t\tilde g_t + z_t\delta_t` with the forward
prefix sums, and with the reverse prefix sums
:math:`R_t = \sum_{j\ge t}\phi^Q_j\tilde g_j^\top`,
:math:`r_t = \sum_{j\ge t}\phi^Q_j\delta_j`,

.. math::

    d\phi^K_t = R_t v_t + r_t,\qquad dv_t = R_t^\top\phi^K_t .

Both sums are chunked like the forward: a forward sweep over the chunks
recomputes :math:`(S, z)` for :math:`d\Phi_Q`, a backward sweep carries
:math:`(R, r)` for :math:`d\Phi_K` and :math:`dV`; inside a chunk the masked
``C x C`` matrices :math:`M = \operatorname{tril}(\tilde G_c V_c^\top + \delta_c\mathbf 1^\top)`
and :math:`\operatorname{tril}(\Phi^Q_c\Phi^{K\top}_c)` give the
within-chunk terms (:math:`M\Phi^K_c` for :math:`d\Phi_Q`,
:math:`M^\top\Phi^Q_c` for :math:`d\Phi_K`, :math:`\operatorname{tril}(\cdot)^\top\tilde G_c`
for :math:`dV`).

Linear attention backward
-------------------------
:math:`\phi(x) = \operatorname{elu}(x)+1` is :math:`x + 1` for :math:`x > 0`
and :math:`e^x` otherwise, so :math:`\phi'(x) = 1` for :math:`x > 0` and
:math:`e^x` otherwise; :math:`dQ = d\Phi_Q \odot \phi'(Q)`,
:math:`dK = d\Phi_K\odot\phi'(K)`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _validation as V
from .gmm import _check_logits, _softmax

__all__ = [
    "softmax_attention",
    "softmax_attention_forward",
    "softmax_attention_backward",
    "SoftmaxAttentionGrads",
    "DEFAULT_CHUNK_SIZE",
    "feature_attention",
    "feature_attention_forward",
    "feature_attention_backward",
    "FeatureAttentionGrads",
    "elu_feature_map",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "LinearAttentionGrads",
]

DEFAULT_CHUNK_SIZE = 64
"""Tokens per chunk of the causal scan: the ``C x C`` masked blocks stay small
while the per-chunk matrix products are large enough to run at BLAS speed."""


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
    cache : SoftmaxAttentionCache
        The tuple ``(q, k, v, P, scale)`` with ``P`` the ``N_q x N_k`` attention matrix.
    """
    q, k, v, causal = _check_qkv(q, k, v, causal)
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else V.check_positive_float(scale, "scale")
    scores = q @ k.T
    scores *= q.dtype.type(scale)
    if causal:
        # entries j > i get -inf, so exp gives exactly 0 (the diagonal keeps every row non-empty)
        scores[np.triu_indices(scores.shape[0], k=1)] = -np.inf
    _check_logits(scores, "scale, q, k", "lower scale or rescale q and k")
    p = _softmax(scores, axis=1)
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
    V.check_instance(cache, "cache", SoftmaxAttentionCache, "the SoftmaxAttentionCache from softmax_attention_forward")
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


# ---------------------------------------------------------------------------
# Normalised feature-map attention: the one implementation of the O(N) mixing
# shared by linear attention and Gaussian-mixture attention
# ---------------------------------------------------------------------------


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


def _check_options(causal, eps, chunk_size):
    causal = V.check_bool(causal, "causal")
    eps = V.check_positive_float(eps, "eps", allow_zero=True)
    chunk_size = V.check_int(chunk_size, "chunk_size", minimum=1)
    return causal, eps, chunk_size


def _check_nonnegative(arr, name):
    if arr.size and np.min(arr) < 0:
        first = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise ValueError(
            f"{name}: expected nonnegative features (the denominators must stay positive), "
            f"got {arr[first]} at index {first}"
        )


def _check_causal_lengths(n_q, n_k, causal, names=("phi_q", "phi_k")):
    if causal and n_q != n_k:
        raise ValueError(
            f"causal=True needs as many queries as keys (position i attends to j <= i), "
            f"got {names[0]} with {n_q} rows and {names[1]} with {n_k}"
        )


def _check_grad_out(grad_out, n_q, d_v, dtype):
    g = V.as_float_array(grad_out, "grad_out", ndim=2)
    V.check_shape(g, "grad_out", (n_q, d_v), ("N_q", "d_v"))
    return g.astype(dtype, copy=False)


def _check_denominators(den, eps, names, offset=0):
    """With ``eps = 0`` a query whose features meet no key's has the output 0/0: refuse it."""
    if eps == 0 and den.size and not np.all(den > 0):
        i = offset + int(np.argmin(den > 0))
        raise ValueError(
            f"eps: with eps = 0 the denominator of query row {i} is {den[i - offset]} ({names[0]} row {i} has no overlap "
            f"with any row of {names[1]} it reads, or it underflowed), so its output would be 0/0; pass eps > 0"
        )


def _bidirectional_forward(phi_q, phi_k, v, eps, names):
    # (Phi_Q Phi_K^T) V = Phi_Q (Phi_K^T V): an F x d_v memory instead of an N x N matrix
    s = phi_k.T @ v
    z = phi_k.sum(axis=0)
    den = phi_q @ z + phi_q.dtype.type(eps)
    _check_denominators(den, eps, names)
    return (phi_q @ s) / den[:, None], den


def _causal_forward(phi_q, phi_k, v, eps, chunk_size, names):
    n, f = phi_k.shape
    dtype = phi_q.dtype
    out = np.empty((n, v.shape[1]), dtype=dtype)
    den = np.empty(n, dtype=dtype)
    s = np.zeros((f, v.shape[1]), dtype=dtype)  # S = sum over earlier chunks of phi_k_j v_j^T
    z = np.zeros(f, dtype=dtype)  # z = sum over earlier chunks of phi_k_j
    for a in range(0, n, chunk_size):
        b = min(a + chunk_size, n)
        pq, pk, vc = phi_q[a:b], phi_k[a:b], v[a:b]
        # S_t = S_prev + sum_{a <= j <= t} phi_k_j v_j^T, so phi_q_t^T S_t splits into
        # the carried state and the masked C x C block tril(Phi_Q,c Phi_K,c^T)
        block = np.tril(pq @ pk.T)
        d = pq @ z + block.sum(axis=1) + dtype.type(eps)
        _check_denominators(d, eps, names, offset=a)
        out[a:b] = (pq @ s + block @ vc) / d[:, None]
        den[a:b] = d
        s += pk.T @ vc
        z += pk.sum(axis=0)
    return out, den


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
    phi_q, phi_k, v, out, den, chunk_size = c.phi_q, c.phi_k, c.v, c.out, c.den, c.chunk_size
    n, f = phi_k.shape
    dtype = phi_q.dtype
    gn = g / den[:, None]
    delta = -np.sum(g * out, axis=1) / den
    dphi_q = np.empty_like(phi_q)
    dphi_k = np.empty_like(phi_k)
    dv = np.empty_like(v)
    starts = range(0, n, chunk_size)

    # forward sweep: dphi_q_t = S_t gn_t + z_t delta_t with the inclusive prefix sums
    s = np.zeros((f, v.shape[1]), dtype=dtype)
    z = np.zeros(f, dtype=dtype)
    for a in starts:
        b = min(a + chunk_size, n)
        pk, vc, gc, dc = phi_k[a:b], v[a:b], gn[a:b], delta[a:b]
        # within the chunk, M_tj = gn_t . v_j + delta_t for j <= t, and sum_j M_tj phi_k_j
        m = np.tril(gc @ vc.T + dc[:, None])
        dphi_q[a:b] = gc @ s.T + dc[:, None] * z[None, :] + m @ pk
        s += pk.T @ vc
        z += pk.sum(axis=0)

    # backward sweep with the reverse prefix sums R_t = sum_{j >= t} phi_q_j gn_j^T and
    # r_t = sum_{j >= t} phi_q_j delta_j: dphi_k_t = R_t v_t + r_t, dv_t = R_t^T phi_k_t
    r_mat = np.zeros((f, v.shape[1]), dtype=dtype)  # R over the later chunks
    r_vec = np.zeros(f, dtype=dtype)
    for a in reversed(starts):
        b = min(a + chunk_size, n)
        pq, pk, vc, gc, dc = phi_q[a:b], phi_k[a:b], v[a:b], gn[a:b], delta[a:b]
        m = np.tril(gc @ vc.T + dc[:, None])
        block = np.tril(pq @ pk.T)
        # within the chunk the sums over j >= t are the transposed lower triangles
        dphi_k[a:b] = vc @ r_mat.T + r_vec[None, :] + m.T @ pq
        dv[a:b] = pk @ r_mat + block.T @ gc
        r_mat += pq.T @ gc
        r_vec += pq.T @ dc
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)


def _feature_attention_forward(phi_q, phi_k, v, causal, eps, chunk_size, names=("phi_q", "phi_k")):
    """Unchecked core of :func:`feature_attention_forward` (inputs of one dtype)."""
    if causal:
        out, den = _causal_forward(phi_q, phi_k, v, eps, chunk_size, names)
    else:
        out, den = _bidirectional_forward(phi_q, phi_k, v, eps, names)
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, causal, eps, chunk_size)


def _feature_attention_backward(g, cache):
    """Unchecked core of :func:`feature_attention_backward` (``g`` of the cache's dtype)."""
    return _causal_backward(g, cache) if cache.causal else _bidirectional_backward(g, cache)


def feature_attention_forward(phi_q, phi_k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised attention with given nonnegative feature maps, in linear time.

    ``out_i = sum_j a_ij v_j / (sum_j a_ij + eps)`` with ``a_ij = phi_q_i . phi_k_j``
    (``j <= i`` only when causal), computed without the ``N x N`` matrix; the
    module docstring derives the chunked causal scan and its backward.

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
    phi_q = V.as_float_array(phi_q, "phi_q", ndim=2)
    phi_k = V.as_float_array(phi_k, "phi_k", ndim=2)
    v = V.as_float_array(v, "v", ndim=2)
    V.check_shape(phi_k, "phi_k", (None, phi_q.shape[1]), ("N_k", "F"))
    V.check_shape(v, "v", (phi_k.shape[0], None), ("N_k", "d_v"))
    _check_nonnegative(phi_q, "phi_q")
    _check_nonnegative(phi_k, "phi_k")
    causal, eps, chunk_size = _check_options(causal, eps, chunk_size)
    _check_causal_lengths(phi_q.shape[0], phi_k.shape[0], causal)
    dtype = V.common_float_dtype(phi_q, phi_k, v)
    return _feature_attention_forward(
        phi_q.astype(dtype, copy=False), phi_k.astype(dtype, copy=False), v.astype(dtype, copy=False), causal, eps, chunk_size
    )


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
        The causal backward uses memory ``O(F d_v + C^2)`` beyond its inputs
        and outputs, like the forward.
    """
    V.check_instance(cache, "cache", FeatureAttentionCache, "the FeatureAttentionCache from feature_attention_forward")
    g = _check_grad_out(grad_out, cache.phi_q.shape[0], cache.v.shape[1], cache.out.dtype)
    return _feature_attention_backward(g, cache)


def feature_attention(phi_q, phi_k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Normalised feature-map attention; see :func:`feature_attention_forward`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    return feature_attention_forward(phi_q, phi_k, v, causal=causal, eps=eps, chunk_size=chunk_size)[0]


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
    return _elu_feature_map(V.as_float_array(x, "x"))


def _elu_feature_map(x):
    # exp of min(x, 0) never overflows; the x > 0 branch does not use it
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _elu_feature_map_derivative(x):
    # d/dx (x + 1) = 1 for x > 0, d/dx exp(x) = exp(x) otherwise
    return np.where(x > 0, x.dtype.type(1), np.exp(np.minimum(x, 0)))


def linear_attention_forward(q, k, v, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Linear attention with the ``elu + 1`` feature map (Katharopoulos et al. 2020).

    ``out_i = phi(q_i)^T S / (phi(q_i) . z + eps)`` with ``S = sum_j phi(k_j) v_j^T``
    and ``z = sum_j phi(k_j)`` (sums over ``j <= i`` when causal), in time
    ``O(N d d_v)``; computed by :func:`feature_attention_forward`.

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
    q, k, v, causal = _check_qkv(q, k, v, causal)
    causal, eps, chunk_size = _check_options(causal, eps, chunk_size)
    out, features = _feature_attention_forward(_elu_feature_map(q), _elu_feature_map(k), v, causal, eps, chunk_size, ("q", "k"))
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
    V.check_instance(cache, "cache", LinearAttentionCache, "the LinearAttentionCache from linear_attention_forward")
    fc = cache.features
    g = _check_grad_out(grad_out, fc.phi_q.shape[0], fc.v.shape[1], fc.out.dtype)
    d = _feature_attention_backward(g, fc)
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
