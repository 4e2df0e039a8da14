r"""Gaussian Mixture Attention (GMA): routing through a shared GMM, in linear time.

Shapes: routing queries ``x_q`` are ``(N_q, d_r)``, routing keys ``x_k`` are
``(N_k, d_r)``, values ``v`` are ``(N_k, d_v)``; one GMM with ``K`` diagonal
components (``means`` and ``variances`` ``(K, d_r)``, ``weights`` ``(K,)``)
is shared by queries and keys.  The derivations are in
``docs/derivations/gma.md``; this docstring states the results.

Forward: route, write, read
---------------------------
(``gma.md#responsibilities``, ``gma.md#bidirectional-mixing``,
``gma.md#causal-mixing``.)  Route every token through the mixture,
:math:`\Gamma_Q = \gamma(X_Q)` and :math:`\Gamma_K = \gamma(X_K)`
(``N x K`` responsibilities, :mod:`refimpl.gmm`); write the values into the
``K`` slots, then read them back:

.. math::

    \tilde V = \Gamma_K^\top\mathbf V,\qquad Z = \Gamma_K^\top\mathbf 1,\qquad
    O = \frac{\Gamma_Q\tilde V}{\Gamma_Q Z + \epsilon}\ \text{(row-wise)},

which by associativity equals :math:`D^{-1}A\mathbf V` with the implicit affinity
:math:`A = \Gamma_Q\Gamma_K^\top` (:func:`gma_dense`, the oracle).  Causal GMA
uses the lower triangle of :math:`A`: query :math:`t` reads the slots written
by the keys :math:`j \le t`.  Both are the scan of :mod:`refimpl.scan` with the
feature maps :math:`\gamma`, causal in chunks of ``C`` tokens.
:class:`GMAState` and :func:`gma_step` carry the causal slots
:math:`(\tilde V, Z)` of one head from one piece of a stream to the next,
``O(K d_v)`` memory whatever the length: the decode form.

Backward
--------
The scan's backward gives :math:`g = \partial L/\partial\gamma(x)` for every
query and key token; the gradients through the responsibilities are derived in
``gma.md#backward-through-the-responsibilities``, and computed here from the
differences :math:`x - \mu`, in row blocks; :func:`refimpl.tuned.gma_backward`
computes the same sums as matrix products.

Batches and heads
-----------------
Leading (batch) dimensions are accepted: ``x_q (..., N_q, d_r)``,
``x_k (..., N_k, d_r)``, ``v (..., N_k, d_v)`` with one leading shape, and
either one GMM shared by every sequence (the shapes above) or one per head
(``means``, ``variances`` ``(H, K, d_r)``, ``weights`` ``(H, K)``, ``H`` the
last leading dimension).  Each sequence is computed as on its own
(:func:`forward_with`, :func:`backward_with`: the batch rule, written once).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.special import expit

from . import gmm, numerics, statefile, validation, varlen
from .scan import DEFAULT_CHUNK_SIZE, FeatureAttentionCache, causal_recurrence, scan_backward, scan_forward

__all__ = [
    "gma",
    "gma_dense",
    "gma_forward",
    "gma_backward",
    "gma_step",
    "GMAState",
    "GMAGrads",
    "GMACache",
    "GMABatchCache",
    "GMAArguments",
    "GMAForwardArguments",
    "check_gma_arguments",
    "check_gma_forward_arguments",
    "check_gma_results",
    "check_gma_grad_out",
    "mixture_from_raw",
    "forward_with",
    "backward_with",
]


class GMAGrads(NamedTuple):
    """Gradients of the loss with respect to every input of :func:`gma_forward`."""

    x_q: np.ndarray
    x_k: np.ndarray
    v: np.ndarray
    means: np.ndarray
    raw_variances: np.ndarray
    logits: np.ndarray


class GMACache(NamedTuple):
    """What :func:`gma_backward` needs from :func:`gma_forward` on one sequence (2-D inputs)."""

    x_q: np.ndarray
    x_k: np.ndarray
    means: np.ndarray
    raw_variances: np.ndarray
    variances: np.ndarray
    gamma_q: np.ndarray
    gamma_k: np.ndarray
    mixing: FeatureAttentionCache


class GMABatchCache(NamedTuple):
    """What :func:`gma_backward` needs from :func:`gma_forward` on inputs with leading (batch) dimensions."""

    leading: tuple  # the leading (batch) shape of x_q, x_k and v
    per_head: bool  # True when the GMM has a head axis (one GMM per index of the last leading dimension)
    caches: tuple  # the GMACache of each sequence, leading indices in C order


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


class GMAArguments(NamedTuple):
    """The arguments of :func:`gma`, checked and cast to one float dtype."""

    x_q: np.ndarray
    x_k: np.ndarray
    v: np.ndarray
    means: np.ndarray
    variances: np.ndarray
    weights: np.ndarray
    causal: bool
    eps: float
    chunk_size: int


class GMAForwardArguments(NamedTuple):
    """The arguments of :func:`gma_forward`, checked and cast to one float dtype."""

    x_q: np.ndarray
    x_k: np.ndarray
    v: np.ndarray
    means: np.ndarray
    raw_variances: np.ndarray
    logits: np.ndarray
    causal: bool
    eps: float
    min_variance: float
    chunk_size: int


def check_gma_arguments(x_q, x_k, v, means, variances, weights, causal, eps, chunk_size) -> GMAArguments:
    """The checks of :func:`gma`: a :class:`GMAArguments` in one dtype; the GPU backends share them."""
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    x_q, x_k, v = validation.check_gma_tokens(x_q, x_k, v, causal)
    means, variances = validation.check_gma_mixture(x_q, means, variances, "variances")
    validation.check_positive(variances, "variances")
    weights = validation.check_gma_weights(weights, means)
    return GMAArguments(*validation.common_dtype_arrays(x_q, x_k, v, means, variances, weights), causal, eps, chunk_size)


def check_gma_forward_arguments(x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size) -> GMAForwardArguments:
    """The checks of :func:`gma_forward`: a :class:`GMAForwardArguments` in one dtype; the GPU backends share them."""
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    x_q, x_k, v = validation.check_gma_tokens(x_q, x_k, v, causal)
    means, raw_variances = validation.check_gma_mixture(x_q, means, raw_variances, "raw_variances")
    logits = validation.check_like_means(logits, "logits", means, means.ndim - 1)
    arrays = validation.common_dtype_arrays(x_q, x_k, v, means, raw_variances, logits)
    return GMAForwardArguments(*arrays, causal, eps, min_variance, chunk_size)


def check_gma_results(min_quad_q, min_quad_k, den, eps):
    """The checks of the computed per-row quantities (rows of all sequences, flattened in order); the GPU backends share them."""
    validation.check_scaled_distances(min_quad_q, "x_q")
    validation.check_scaled_distances(min_quad_k, "x_k")
    validation.check_denominators(den, eps, ("x_q", "x_k"))


def check_gma_grad_out(grad_out, out_shape, dtype):
    """The upstream gradient of :func:`gma_backward` for an output of ``out_shape``; the GPU backends share it."""
    labels = ("...",) * (len(out_shape) > 2) + ("N_q", "d_v")
    return validation.check_grad_out(grad_out, tuple(out_shape), labels, dtype)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def _responsibilities(x, means, variances, log_weights):
    """``(gamma (N, K), min_quad (N,))``: the softmax over the components of the log joint (:mod:`refimpl.gmm`)."""
    logits, min_quad = gmm.log_joint(x, means, variances, log_weights)
    return numerics.softmax(logits, axis=1), min_quad


def mixture_from_raw(raw_variances, logits, min_variance):
    """Core: ``(variances, log_weights)`` of the learnable parameterisation, any leading (head) axes."""
    # sigma^2 = softplus(s) + sigma2_min
    variances = numerics.softplus(raw_variances) + raw_variances.dtype.type(min_variance)
    # log pi = log_softmax(a), never log(softmax(a)): a weight of 1e-320 keeps its log
    return variances, numerics.log_softmax(logits, axis=-1)


def _laid(whole, idx, part):
    """Sequence ``idx``'s ``part`` laid in its rows of ``whole``, a batch's array; a 2-D call's ``part`` itself
    (``whole`` None: no copy)."""
    if whole is None:
        return part
    whole[idx] = part
    return whole


def forward_with(
    responsibilities, x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size, raw_variances=None, keep=True, scan=scan_forward
):
    """GMA's forward on checked arguments, sequence by sequence, routed by ``responsibilities``: ``(out, cache)``.

    The batch rule, written once for this module and :mod:`refimpl.tuned`:
    the sequence at leading index ``idx`` uses head ``idx[-1]``'s GMM when
    the GMM is given per head (``means`` 3-D), else the shared one, and is
    computed as on its own.  ``responsibilities(x, means, variances,
    log_weights)`` returns ``(gamma, min_quad)``, and ``scan`` mixes the values
    (:func:`refimpl.scan.scan_forward` unless a backend gives its own); the results of every
    sequence are checked once, at the end (:func:`check_gma_results`).
    ``cache`` is a :class:`GMACache` for 2-D inputs, a
    :class:`GMABatchCache` otherwise, ``None`` when ``keep`` is false.
    """
    leading = x_q.shape[:-2]
    # a batch's sequences laid in one array; a 2-D call with no cache returns the scan's own output (no second copy;
    # a cache keeps the scan's output for the backward, so the caller gets a copy to write into)
    out = np.empty(x_q.shape[:-1] + v.shape[-1:], dtype=x_q.dtype) if leading or keep else None
    caches, checks = [], []
    for idx in np.ndindex(leading):
        h = idx[-1:] if means.ndim == 3 else ()  # the head's GMM, or the shared one
        gamma_q, min_quad_q = responsibilities(x_q[idx], means[h], variances[h], log_weights[h])
        gamma_k, min_quad_k = responsibilities(x_k[idx], means[h], variances[h], log_weights[h])
        # write V~ = Gamma_K^T V and Z = Gamma_K^T 1, read O = Gamma_Q V~ / (Gamma_Q Z + eps); causal: prefix sums
        seq_out, mixing = scan(gamma_q, gamma_k, v[idx], causal, eps, chunk_size)
        out = _laid(out, idx, seq_out)
        checks.append((min_quad_q, min_quad_k, mixing.den))
        if keep:
            raw = None if raw_variances is None else raw_variances[h]
            caches.append(GMACache(x_q[idx], x_k[idx], means[h], raw, variances[h], gamma_q, gamma_k, mixing))
    check_gma_results(*(np.concatenate(c) for c in zip(*checks)), eps)
    if not keep:
        return out, None
    return out, (caches[0] if not leading else GMABatchCache(leading, means.ndim == 3, tuple(caches)))


def gma(x_q, x_k, v, means, variances, weights, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
        cu_seqlens=None):
    """Gaussian Mixture Attention with a GMM given by its variances and weights.

    Parameters
    ----------
    x_q : array_like, shape (..., N_q, d_r)
        Routing queries; any leading (batch) dimensions, the last of them the
        head axis when the GMM is given per head.
    x_k : array_like, shape (..., N_k, d_r)
        Routing keys, the leading dimensions of ``x_q``.
    v : array_like, shape (..., N_k, d_v)
        Values, the leading dimensions of ``x_q``.
    means : array_like, shape (K, d_r) or (H, K, d_r)
        One GMM shared by every sequence, or one per head (``H`` the last
        leading dimension of ``x_q``).
    variances : array_like, shape of ``means``
        Diagonal variances, all > 0.
    weights : array_like, shape (K,) or (H, K)
        Mixture weights: nonnegative, summing to one (per head).
    causal : bool, default False
        Query ``t`` reads keys ``j <= t`` only (needs ``N_q == N_k``); computed
        by a chunked scan.
    eps : float, default 1e-6
        Added to every denominator ``gamma_q . Z`` (>= 0).  With 0, a query
        whose responsibilities meet no key's (they underflow far from every
        component) is refused: its output is 0/0.
    chunk_size : int, default 64
        Tokens per chunk of the causal scan (>= 1).
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences (:mod:`refimpl.varlen`): ``x_q``, ``x_k`` and ``v``
        are ``(T, d)`` or ``(T, H, d)``, sequence ``s`` their rows
        ``cu_seqlens[s]:cu_seqlens[s + 1]``, computed on its own: causal
        prefix sums start at zero and the slots are written afresh at each
        sequence.  The output is ``(T, d_v)`` or ``(T, H, d_v)``.

    Returns
    -------
    ndarray, shape (..., N_q, d_v)
        Per sequence, ``(Gamma_Q Gamma_K^T V) / (Gamma_Q Gamma_K^T 1 + eps)`` (lower
        triangle of the affinity when causal), computed in ``O(N K (d_r + d_v))``
        time (plus ``O(N C (K + d_v))`` for the within-chunk blocks when
        causal) without an ``N x N`` matrix.  Dtype of the inputs.
    """
    if cu_seqlens is not None:
        # each sequence on its own: gma of rows cu_seqlens[s]:cu_seqlens[s+1]
        options = dict(causal=causal, eps=eps, chunk_size=chunk_size)
        return varlen.packed(lambda s, q, k, v1: gma(q, k, v1, means, variances, weights, **options), (x_q, x_k, v), cu_seqlens,
                             ("x_q", "x_k", "v"), lambda q, k, v1: check_gma_arguments(q, k, v1, means, variances, weights, causal, eps, chunk_size))[0]
    a = check_gma_arguments(x_q, x_k, v, means, variances, weights, causal, eps, chunk_size)
    args = (a.x_q, a.x_k, a.v, a.means, a.variances, numerics.log_weights(a.weights), a.causal, a.eps, a.chunk_size)
    return forward_with(_responsibilities, *args, keep=False)[0]


def gma_dense(gamma_q, gamma_k, v, *, causal: bool = False, eps: float = 1e-6):
    """The explicit quadratic form ``D^{-1} A V``: the oracle for :func:`gma`.

    Forms the ``N_q x N_k`` affinity ``A = gamma_q gamma_k^T`` (its lower
    triangle when causal) and divides each row of ``A V`` by ``A 1 + eps``.
    Time and memory ``O(N^2)``: for tests and tutorials only.

    Parameters
    ----------
    gamma_q : array_like, shape (N_q, K)
        Query responsibilities (any nonnegative features are accepted).
    gamma_k : array_like, shape (N_k, K)
        Key responsibilities (nonnegative).
    v : array_like, shape (N_k, d_v)
    causal : bool, default False
        Keep ``A_ij`` for ``j <= i`` only (needs ``N_q == N_k``).
    eps : float, default 1e-6
        Added to every row sum (>= 0); with 0, a row that sums to 0 is refused.

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    gamma_q, gamma_k, v, causal, eps = validation.check_gma_dense(gamma_q, gamma_k, v, causal, eps)
    # A_ij = gamma_q_i . gamma_k_j = P(z_i = z_j)
    affinity = gamma_q @ gamma_k.T
    if causal:
        affinity = np.tril(affinity)
    den = affinity.sum(axis=1) + affinity.dtype.type(eps)
    validation.check_denominators(den, eps, ("gamma_q", "gamma_k"))
    return (affinity @ v) / den[:, None]


def gma_forward(
    x_q,
    x_k,
    v,
    means,
    raw_variances,
    logits,
    *,
    causal: bool = False,
    eps: float = 1e-6,
    min_variance: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens=None,
):
    """GMA with unconstrained GMM parameters, keeping what :func:`gma_backward` needs.

    The GMM is ``variances = softplus(raw_variances) + min_variance`` and
    ``weights = softmax(logits)``; otherwise this is :func:`gma`.

    Parameters
    ----------
    x_q : array_like, shape (..., N_q, d_r)
    x_k : array_like, shape (..., N_k, d_r)
    v : array_like, shape (..., N_k, d_v)
        One leading (batch) shape for the three, as in :func:`gma`.
    means : array_like, shape (K, d_r) or (H, K, d_r)
        Shared, or one GMM per head (``H`` the last leading dimension).
    raw_variances : array_like, shape of ``means``
        Any real values.
    logits : array_like, shape (K,) or (H, K)
        Prior logits, any real values.
    causal : bool, default False
    eps : float, default 1e-6
    min_variance : float, default 1e-6
        The variance floor ``sigma2_min`` (> 0).
    chunk_size : int, default 64
    cu_seqlens : sequence of int, shape (S + 1,), optional
        Packed sequences, as in :func:`gma`.

    Returns
    -------
    out : ndarray, shape (..., N_q, d_v)
    cache : GMACache or GMABatchCache
        For 2-D inputs, a GMACache: inputs, variances, both responsibility
        matrices (``N x K``) and the mixing cache; with leading dimensions, a
        GMABatchCache holding the leading shape, whether the GMM is per head,
        and one GMACache per sequence.  Packed, a
        :class:`refimpl.varlen.PackedCache` of the sequences' caches.
    """
    if cu_seqlens is not None:
        options = dict(causal=causal, eps=eps, min_variance=min_variance, chunk_size=chunk_size)
        check = lambda q, k, v1: check_gma_forward_arguments(q, k, v1, means, raw_variances, logits, causal, eps, min_variance, chunk_size)  # noqa: E731
        return varlen.packed(lambda s, q, k, v1: gma_forward(q, k, v1, means, raw_variances, logits, **options),
                             (x_q, x_k, v), cu_seqlens, ("x_q", "x_k", "v"), check, forward=True)
    a = check_gma_forward_arguments(x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size)
    variances, log_weights = mixture_from_raw(a.raw_variances, a.logits, a.min_variance)
    args = (a.x_q, a.x_k, a.v, a.means, variances, log_weights, a.causal, a.eps, a.chunk_size)
    return forward_with(_responsibilities, *args, raw_variances=a.raw_variances)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def _responsibility_backward(x, gamma, grad_gamma, means, variances):
    """Push ``dL/dgamma`` (N, K) through ``gamma = softmax(l(x))``: ``(dx, dmeans, dvariances, dlogits)``.

    From the differences ``x_i - mu_m`` (``gma.md#backward-through-the-responsibilities``),
    a block of rows at a time to bound the memory of the ``N x K x d_r``
    differences; the sums over the tokens accumulate block by block.
    """
    # c_im = dL/dl_im = gamma_im (g_im - sum_m gamma_im g_im): the softmax backward
    c = numerics.softmax_backward(gamma, grad_gamma, axis=1)
    n, d = x.shape
    prec = 1.0 / variances
    dx = np.empty_like(x)
    dmeans = np.zeros_like(means)
    sq = np.zeros_like(means)  # sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj)
    # a block's differences x_i - mu_m take K d_r numbers a row
    rows = numerics.block_rows(means.size * x.dtype.itemsize)
    for a in range(0, n, rows):
        cb = c[a : a + rows]
        diff = x[a : a + rows, None, :] - means[None, :, :]  # (B, K, d_r): x_i - mu_m
        u = diff * prec  # (x_i - mu_m) / sigma_m^2
        # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2
        dx[a : a + rows] = -np.einsum("bm,bmj->bj", cb, u)
        # dL/dmu_m = sum_i c_im (x_i - mu_m) / sigma_m^2
        dmeans += np.einsum("bm,bmj->mj", cb, u)
        sq += np.einsum("bm,bmj->mj", cb, diff * diff - variances)
    # dL/dsigma2_mj = sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj) / (2 sigma2_mj^2)
    dvariances = 0.5 * sq * prec * prec
    # dL/da_m = sum_i c_im: the -pi_m sum_k c_ik term of the log-softmax Jacobian vanishes (rows of c sum to 0)
    return dx, dmeans, dvariances, c.sum(axis=0)


def backward_with(responsibility_backward, grad_out, cache, scan=scan_backward) -> GMAGrads:
    """GMA's backward, sequence by sequence, through ``responsibility_backward``: :class:`GMAGrads`.

    The batch rule of :func:`gma_backward`, written once for this module and
    :mod:`refimpl.tuned`.  ``responsibility_backward(x, gamma, dgamma, means,
    variances)`` returns ``(dx, dmeans, dvariances, dlogits)`` and ``scan`` is the
    mixing's backward (:func:`refimpl.scan.scan_backward` by default); the parameter
    gradients of each sequence go to its head's GMM (every sequence's to the
    shared one), added in the order of the sequences.
    """
    validation.check_instance(cache, "cache", (GMACache, GMABatchCache), "the GMACache or GMABatchCache from gma_forward")
    batched = isinstance(cache, GMABatchCache)
    leading, caches = (cache.leading, cache.caches) if batched else ((), (cache,))
    per_head, first = batched and cache.per_head, caches[0]
    g = check_gma_grad_out(grad_out, leading + first.mixing.out.shape, first.gamma_q.dtype)
    # a batch's sequences laid in one array each; a 2-D call returns its sequence's own arrays (no second copy)
    dx_q, dx_k, dv = ((np.empty(leading + shape, dtype=g.dtype) if batched else None)
                      for shape in (first.x_q.shape, first.x_k.shape, first.mixing.v.shape))
    heads = leading[-1:] if per_head else ()
    dmeans = np.zeros(heads + first.means.shape, dtype=g.dtype)
    draw = np.zeros(heads + first.means.shape, dtype=g.dtype)
    dlogits = np.zeros(heads + first.means.shape[:1], dtype=g.dtype)
    for idx, c in zip(np.ndindex(leading), caches):
        # through the mixing: dL/dGamma_Q, dL/dGamma_K and dL/dV (the scan's backward)
        dgamma = scan(g[idx], c.mixing)
        seq_dx_q, dmu_q, dvar_q, da_q = responsibility_backward(c.x_q, c.gamma_q, dgamma.phi_q, c.means, c.variances)
        seq_dx_k, dmu_k, dvar_k, da_k = responsibility_backward(c.x_k, c.gamma_k, dgamma.phi_k, c.means, c.variances)
        dx_q, dx_k, dv = _laid(dx_q, idx, seq_dx_q), _laid(dx_k, idx, seq_dx_k), _laid(dv, idx, dgamma.v)
        h = idx[-1:] if per_head else ()  # the GMM this sequence used
        dmeans[h] += dmu_q + dmu_k
        # sigma2 = softplus(s) + sigma2_min: dsigma2/ds = sigmoid(s)
        draw[h] += (dvar_q + dvar_k) * expit(c.raw_variances)
        dlogits[h] += da_q + da_k
    return GMAGrads(x_q=dx_q, x_k=dx_k, v=dv, means=dmeans, raw_variances=draw, logits=dlogits)


def gma_backward(grad_out, cache) -> GMAGrads:
    """Hand-derived gradients of :func:`gma_forward`; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (..., N_q, d_v)
        ``dL/d out``, the shape of the forward's output.
    cache : GMACache or GMABatchCache
        From :func:`gma_forward` (a :class:`refimpl.varlen.PackedCache` from a
        packed call: the gradients of each sequence from its own cache).

    Returns
    -------
    GMAGrads
        Fields ``x_q`` (..., N_q, d_r), ``x_k`` (..., N_k, d_r),
        ``v`` (..., N_k, d_v), and ``means``, ``raw_variances`` and
        ``logits`` of the parameters' shapes ((K, d_r) and (K,) shared:
        sums over every sequence; (H, K, d_r) and (H, K) per head: sums over
        the sequences of each head).  When the same array is passed as
        ``x_q`` and ``x_k`` its gradient is ``x_q + x_k``.
    """
    if isinstance(cache, varlen.PackedCache):
        return varlen.packed_backward(gma_backward, grad_out, cache)
    return backward_with(_responsibility_backward, grad_out, cache)


# ---------------------------------------------------------------------------
# Streaming: the causal state of one head, and the decode step
# ---------------------------------------------------------------------------

_FORMAT = "refimpl.gma.GMAState"
_FORMAT_VERSION = 1


class GMAState:
    """The causal GMA state of one head after ``tokens_seen`` tokens: the slot sums and normalisers; immutable.

    Parameters
    ----------
    slots : array_like, shape (K, d_v)
        ``V~ = sum_j gamma(x_k_j) v_j^T`` over the tokens seen.
    norms : array_like, shape (K,)
        ``Z = sum_j gamma(x_k_j)``, all >= 0; same float dtype as ``slots``.
    tokens_seen : int
        How many tokens the sums hold (>= 0).

    Notes
    -----
    The constructor copies its arrays and marks the copies read-only: every
    :func:`gma_step` returns a new state.  Memory is ``K (d_v + 1)`` floats
    whatever ``tokens_seen`` is (:attr:`nbytes`).
    """

    __slots__ = ("_slots", "_norms", "_tokens_seen")

    def __init__(self, slots, norms, tokens_seen):
        slots, norms, self._tokens_seen = validation.check_gma_state(slots, norms, tokens_seen)
        self._slots, self._norms = np.array(slots, copy=True), np.array(norms, copy=True)
        self._slots.flags.writeable = self._norms.flags.writeable = False

    slots = property(lambda self: self._slots, doc="``V~``, shape (K, d_v), read-only.")
    norms = property(lambda self: self._norms, doc="``Z``, shape (K,), read-only.")
    tokens_seen = property(lambda self: self._tokens_seen, doc="Tokens folded into the state.")
    K = property(lambda self: self._slots.shape[0], doc="Components (slots).")
    d_v = property(lambda self: self._slots.shape[1], doc="Value dimension.")
    dtype = property(lambda self: self._slots.dtype, doc="Float dtype of the sums.")
    nbytes = property(lambda self: int(self._slots.nbytes + self._norms.nbytes), doc="Bytes held: ``K (d_v + 1)`` floats.")

    @classmethod
    def empty(cls, K, d_v, dtype=np.float64) -> "GMAState":
        """The state before any token: zeros, ``tokens_seen = 0``."""
        K = validation.check_int(K, "K", minimum=1)
        d_v = validation.check_int(d_v, "d_v", minimum=1)
        dtype = validation.check_float_dtype(dtype, "dtype")
        return cls(np.zeros((K, d_v), dtype), np.zeros(K, dtype), 0)

    def __repr__(self) -> str:
        return f"GMAState(K={self.K}, d_v={self.d_v}, tokens_seen={self.tokens_seen}, dtype={self.dtype})"

    def save(self, path) -> None:
        """Write the state to ``path`` as an uncompressed ``.npz`` (no pickles), exactly at that path."""
        statefile.save(path, _FORMAT, _FORMAT_VERSION, slots=self._slots, norms=self._norms, tokens_seen=self._tokens_seen)

    @classmethod
    def load(cls, path) -> "GMAState":
        """Read a state written by :meth:`save`, refusing a truncated, foreign or inconsistent file.

        Raises ``FileNotFoundError`` if ``path`` does not exist and
        ``ValueError`` naming the file and the problem otherwise, as
        :meth:`refimpl.ovq.OVQState.load` does (:mod:`refimpl.statefile`).
        """
        f = statefile.load(path, _FORMAT, _FORMAT_VERSION, "GMAState", ("slots", "norms"), ("tokens_seen",))
        return validation.check_loaded_state(path, "GMAState", cls, f["slots"], f["norms"], f["tokens_seen"])


def gma_step(x_q, x_k, v, means, variances, weights, *, state=None, eps: float = 1e-6):
    """Causal GMA on the next tokens of a stream, from the state of the tokens before them: the decode step.

    Token ``t`` of this piece writes its key into the slots, then its query
    reads them: ``out_t = gamma(x_q_t) V~_t / (gamma(x_q_t) . Z_t + eps)`` with
    ``V~_t``, ``Z_t`` the sums over every token of the stream up to ``t``
    (:func:`refimpl.scan.causal_recurrence`).  Feeding a stream in pieces,
    one token or many at a time, gives what ``gma(..., causal=True)`` gives
    on the whole stream, to rounding.

    Parameters
    ----------
    x_q, x_k : array_like, shape (N, d_r)
        Routing queries and keys of the new tokens.
    v : array_like, shape (N, d_v)
    means, variances : array_like, shape (K, d_r)
    weights : array_like, shape (K,)
        One head's GMM, as in :func:`gma`.
    state : GMAState, optional
        The sums of the tokens before these (not modified); an empty stream
        by default.
    eps : float, default 1e-6

    Returns
    -------
    out : ndarray, shape (N, d_v)
    state : GMAState
        After the last of these tokens; ``O(K d_v)`` whatever the length.
    """
    a = check_gma_arguments(x_q, x_k, v, means, variances, weights, True, eps, DEFAULT_CHUNK_SIZE)
    a, state = validation.check_gma_step(a, state, GMAState)
    log_weights = numerics.log_weights(a.weights)
    gamma_q, min_quad_q = _responsibilities(a.x_q, a.means, a.variances, log_weights)
    gamma_k, min_quad_k = _responsibilities(a.x_k, a.means, a.variances, log_weights)
    # V~_t = V~_{t-1} + gamma_k_t v_t^T, Z_t = Z_{t-1} + gamma_k_t; out_t = gamma_q_t V~_t / (gamma_q_t . Z_t + eps)
    out, den, (slots, norms) = causal_recurrence(gamma_q, gamma_k, a.v, a.eps, (state.slots, state.norms))
    check_gma_results(min_quad_q, min_quad_k, den, a.eps)
    return out, GMAState(slots, norms, state.tokens_seen + a.x_q.shape[0])
