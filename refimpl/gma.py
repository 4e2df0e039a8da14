r"""Gaussian Mixture Attention (GMA): routing through a shared GMM, in linear time.

Shapes: routing queries ``x_q`` are ``(N_q, d_r)``, routing keys ``x_k`` are
``(N_k, d_r)``, values ``v`` are ``(N_k, d_v)``; one GMM with ``K`` diagonal
components (``means`` and ``variances`` ``(K, d_r)``, ``weights`` ``(K,)``)
is shared by queries and keys.  Leading (batch) dimensions are accepted:
``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``, ``v (..., N_k, d_v)`` with
one leading shape, and either one GMM shared by every sequence (the shapes
above) or one per head (``means``, ``variances`` ``(H, K, d_r)``,
``weights`` ``(H, K)``, ``H`` the last leading dimension); each sequence is
then computed as on its own.  The derivations are in
``docs/derivations/gma.md``; this docstring states the results.

Forward
-------
(``gma.md#bidirectional-mixing``, ``gma.md#causal-mixing``.)
:math:`\Gamma_Q = \gamma(X_Q)` and :math:`\Gamma_K = \gamma(X_K)` are the
GMM responsibilities (``N x K``, :func:`refimpl.gmm.posterior`).  Write,
then read:

.. math::

    \tilde V = \Gamma_K^\top\mathbf V,\qquad Z = \Gamma_K^\top\mathbf 1,\qquad
    O = \frac{\Gamma_Q\tilde V}{\Gamma_Q Z + \epsilon}\ \text{(row-wise)},

which by associativity equals :math:`D^{-1}A\mathbf V` with the implicit affinity
:math:`A = \Gamma_Q\Gamma_K^\top` (:func:`gma_dense`, the oracle).  Causal GMA
uses the lower triangle of :math:`A`: it is causal linear attention with the
feature maps :math:`\gamma`, so both variants run the scan of
:mod:`refimpl.scan` (time :math:`O(NK(d_r+d_v) + NC(K+d_v))`, extra memory
:math:`O(NK + K d_v + C^2)`).

Backward
--------
(``gma.md#backward-through-the-responsibilities``,
``gma.md#parameter-gradients-as-matrix-products``.)  The scan's backward gives :math:`g = \partial L/\partial\gamma(x)` for every
query and key token; with :math:`c_m = \gamma_m(g_m - \bar g)`,
:math:`\bar g = \sum_m \gamma_m g_m`,

.. math::

    \frac{\partial L}{\partial x} = \sum_m c_m\frac{\mu_m - x}{\sigma_m^2},\quad
    \frac{\partial L}{\partial\mu_m} = c_m\frac{x-\mu_m}{\sigma_m^2},\quad
    \frac{\partial L}{\partial\sigma^2_{mj}} = c_m\frac{(x_j-\mu_{mj})^2-\sigma^2_{mj}}{2\sigma^4_{mj}},\quad
    \frac{\partial L}{\partial a_m} = c_m,

and :math:`\partial L/\partial s = \partial L/\partial\sigma^2\cdot\operatorname{sigmoid}(s)`,
summed over the tokens of both :math:`X_Q` and :math:`X_K` as matrix products
on :math:`X` and :math:`\mu` centred on the mean of the means (no
``N x K x d_r`` tensor).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.special import expit

from . import numerics, validation
from .gmm import posterior
from .scan import DEFAULT_CHUNK_SIZE, FeatureAttentionCache, scan_backward, scan_forward

__all__ = [
    "gma",
    "gma_dense",
    "gma_forward",
    "gma_backward",
    "GMAGrads",
    "GMACache",
    "GMABatchCache",
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


def _leading_labels(leading):
    """Dimension labels for the leading (batch) axes in shape messages: ``("...",)`` when there are any."""
    return ("...",) if leading else ()


def _check_tokens(x_q, x_k, v, causal):
    x_q = validation.as_float_array(x_q, "x_q")
    x_k = validation.as_float_array(x_k, "x_k")
    v = validation.as_float_array(v, "v")
    for a, name, labels in ((x_q, "x_q", "N_q, d_r"), (x_k, "x_k", "N_k, d_r"), (v, "v", "N_k, d_v")):
        if a.ndim < 2:
            raise ValueError(
                f"{name}: expected a 2-D array ({labels}) or one with leading batch dimensions (..., {labels}), "
                f"got shape {a.shape} ({a.ndim}-D)"
            )
    leading = x_q.shape[:-2]
    for a, name in ((x_k, "x_k"), (v, "v")):
        if a.shape[:-2] != leading:
            raise ValueError(
                f"x_q, {name}: expected arrays with the same leading (batch) dimensions, got a {x_q.ndim}-D array "
                f"of shape {x_q.shape} and a {a.ndim}-D array of shape {a.shape}"
            )
    lead = _leading_labels(leading)
    validation.check_shape(x_k, "x_k", leading + (None, x_q.shape[-1]), lead + ("N_k", "d_r"))
    validation.check_shape(v, "v", leading + (x_k.shape[-2], None), lead + ("N_k", "d_v"))
    if 0 in leading:
        raise ValueError(f"x_q, x_k: expected at least one sequence, got leading (batch) dimensions {leading}")
    if x_q.shape[-2] < 1 or x_k.shape[-2] < 1:
        raise ValueError(f"x_q, x_k: expected at least one token each, got shapes {x_q.shape} and {x_k.shape}")
    validation.check_causal_lengths(x_q.shape[-2], x_k.shape[-2], causal, names=("x_q", "x_k"))
    return x_q, x_k, v


def _check_components(means, second, second_name, leading, d_r):
    """``means`` and ``variances`` (or ``raw_variances``): ``(K, d_r)`` shared, or ``(H, K, d_r)`` one GMM per head."""
    means = validation.as_float_array(means, "means")
    per_head = means.ndim == 3 and len(leading) > 0
    if means.ndim != 2 and not per_head:
        head = (
            f", or a 3-D array (H, K, d_r) with H = {leading[-1]} (the last leading dimension of x_q), one GMM per head"
            if leading
            else "; a 3-D array (H, K, d_r), one GMM per head, needs x_q with a head axis (..., H, N_q, d_r)"
        )
        raise ValueError(f"means: expected a 2-D array (K, d_r) shared by every sequence{head}, got shape {means.shape} ({means.ndim}-D)")
    if per_head and means.shape[0] != leading[-1]:
        raise ValueError(
            f"means: a 3-D array (H, K, d_r) holds one GMM per head, so H must be the last leading dimension of x_q, "
            f"{leading[-1]}; got a 3-D array of shape {means.shape} (pass a 2-D array (K, d_r) to share one GMM)"
        )
    labels = ("H", "K", "d_r") if per_head else ("K", "d_r")
    validation.check_shape(means, "means", ((leading[-1],) if per_head else ()) + (None, d_r), labels)
    validation.check_nonempty(means[0] if per_head else means, "means")
    second = validation.as_float_array(second, second_name)
    if second.ndim != means.ndim:
        raise ValueError(
            f"{second_name}: expected a {means.ndim}-D array ({', '.join(labels)}) like means, "
            f"got shape {second.shape} ({second.ndim}-D)"
        )
    validation.check_shape(second, second_name, means.shape, labels)
    return means, second


def _check_mixture_vector(a, name, means):
    """``weights`` or ``logits``: ``(K,)`` for a shared GMM, ``(H, K)`` for one GMM per head; checked for ndim and shape."""
    a = validation.as_float_array(a, name)
    labels = ("H", "K") if means.ndim == 3 else ("K",)
    if a.ndim != means.ndim - 1:
        raise ValueError(
            f"{name}: expected a {means.ndim - 1}-D array ({', '.join(labels)}{',' if len(labels) == 1 else ''}) like means, "
            f"got shape {a.shape} ({a.ndim}-D)"
        )
    validation.check_shape(a, name, means.shape[:-1], labels)
    return a


def _cast(*arrays):
    dtype = validation.common_float_dtype(*arrays)
    return tuple(a.astype(dtype, copy=False) for a in arrays)


def check_gma_arguments(x_q, x_k, v, means, variances, weights, causal, eps, chunk_size):
    """The checks of :func:`gma`, returning its arguments cast to one dtype; the GPU backends share them."""
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    x_q, x_k, v = _check_tokens(x_q, x_k, v, causal)
    means, variances = _check_components(means, variances, "variances", x_q.shape[:-2], x_q.shape[-1])
    validation.check_positive(variances, "variances")
    if means.ndim == 2:
        weights = validation.check_weights(weights, means.shape[0])
    else:
        weights = _check_mixture_vector(weights, "weights", means)
        for h in range(weights.shape[0]):
            validation.check_probability_vector(weights[h], f"weights[{h}]")
    return _cast(x_q, x_k, v, means, variances, weights) + (causal, eps, chunk_size)


def check_gma_forward_arguments(x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size):
    """The checks of :func:`gma_forward`, returning its arguments cast to one dtype; the GPU backends share them."""
    causal, eps, chunk_size = validation.check_scan_options(causal, eps, chunk_size)
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    x_q, x_k, v = _check_tokens(x_q, x_k, v, causal)
    means, raw_variances = _check_components(means, raw_variances, "raw_variances", x_q.shape[:-2], x_q.shape[-1])
    logits = _check_mixture_vector(logits, "logits", means)
    return _cast(x_q, x_k, v, means, raw_variances, logits) + (causal, eps, min_variance, chunk_size)


def check_gma_results(min_quad_q, min_quad_k, den, eps):
    """The checks of the computed per-row quantities (rows of all sequences, flattened in order); the GPU backends share them."""
    validation.check_scaled_distances(min_quad_q, "x_q")
    validation.check_scaled_distances(min_quad_k, "x_k")
    validation.check_denominators(den, eps, ("x_q", "x_k"))


def check_gma_grad_out(grad_out, out_shape, dtype):
    """The upstream gradient of :func:`gma_backward` for an output of ``out_shape``; the GPU backends share it."""
    labels = _leading_labels(out_shape[:-2]) + ("N_q", "d_v")
    return validation.check_grad_out(grad_out, tuple(out_shape), labels, dtype)


def _check_gma_dense(gamma_q, gamma_k, v, causal, eps):
    gamma_q = validation.as_float_array(gamma_q, "gamma_q", ndim=2)
    gamma_k = validation.as_float_array(gamma_k, "gamma_k", ndim=2)
    v = validation.as_float_array(v, "v", ndim=2)
    validation.check_shape(gamma_k, "gamma_k", (None, gamma_q.shape[1]), ("N_k", "K"))
    validation.check_shape(v, "v", (gamma_k.shape[0], None), ("N_k", "d_v"))
    validation.check_nonnegative(gamma_q, "gamma_q", "responsibilities")
    validation.check_nonnegative(gamma_k, "gamma_k", "responsibilities")
    causal = validation.check_bool(causal, "causal")
    eps = validation.check_positive_float(eps, "eps", allow_zero=True)
    validation.check_causal_lengths(gamma_q.shape[0], gamma_k.shape[0], causal, names=("gamma_q", "gamma_k"))
    return _cast(gamma_q, gamma_k, v) + (causal, eps)


# ---------------------------------------------------------------------------
# Forward: responsibilities, then the shared linear-time scan
# ---------------------------------------------------------------------------


def _gma(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size):
    """Core: ``(out, gamma_q, gamma_k, mixing, min_quad_q, min_quad_k)``; the caller checks the last three."""
    gamma_q, min_quad_q = posterior(x_q, means, variances, log_weights)
    gamma_k, min_quad_k = posterior(x_k, means, variances, log_weights)
    # O = (Gamma_Q Gamma_K^T V) / (Gamma_Q Gamma_K^T 1 + eps), by the scan
    out, mixing = scan_forward(gamma_q, gamma_k, v, causal, eps, chunk_size)
    return out, gamma_q, gamma_k, mixing, min_quad_q, min_quad_k


def _gmm_of(idx, means, second, third):
    """The GMM of the sequence at leading index ``idx``: head ``idx[-1]`` of per-head parameters, else the shared one."""
    if means.ndim == 2:
        return means, second, third
    return means[idx[-1]], second[idx[-1]], third[idx[-1]]


def gma(x_q, x_k, v, means, variances, weights, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
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

    Returns
    -------
    ndarray, shape (..., N_q, d_v)
        Per sequence, ``(Gamma_Q Gamma_K^T V) / (Gamma_Q Gamma_K^T 1 + eps)`` (lower
        triangle of the affinity when causal), computed in ``O(N K (d_r + d_v))``
        time (plus ``O(N C (K + d_v))`` for the within-chunk blocks when
        causal) without an ``N x N`` matrix.  Dtype of the inputs.
    """
    x_q, x_k, v, means, variances, weights, causal, eps, chunk_size = check_gma_arguments(
        x_q, x_k, v, means, variances, weights, causal, eps, chunk_size
    )
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    if x_q.ndim == 2:
        out, _, _, mixing, min_quad_q, min_quad_k = _gma(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size)
        check_gma_results(min_quad_q, min_quad_k, mixing.den, eps)
        return out
    # one sequence at a time, each with its head's GMM (or the shared one)
    out = np.empty(x_q.shape[:-1] + v.shape[-1:], dtype=x_q.dtype)
    mq, mk, den = [], [], []
    for idx in np.ndindex(x_q.shape[:-2]):
        gmm = _gmm_of(idx, means, variances, log_weights)
        out[idx], _, _, mixing, min_quad_q, min_quad_k = _gma(x_q[idx], x_k[idx], v[idx], *gmm, causal, eps, chunk_size)
        mq.append(min_quad_q), mk.append(min_quad_k), den.append(mixing.den)
    check_gma_results(np.concatenate(mq), np.concatenate(mk), np.concatenate(den), eps)
    return out


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
    gamma_q, gamma_k, v, causal, eps = _check_gma_dense(gamma_q, gamma_k, v, causal, eps)
    # A_ij = gamma_q_i . gamma_k_j = P(z_i = z_j)
    affinity = gamma_q @ gamma_k.T
    if causal:
        affinity = np.tril(affinity)
    den = affinity.sum(axis=1) + affinity.dtype.type(eps)
    validation.check_denominators(den, eps, ("gamma_q", "gamma_k"))
    return (affinity @ v) / den[:, None]


def _gma_forward(x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size):
    """Core of :func:`gma_forward`: ``(out, cache, min_quad_q, min_quad_k)``; the caller checks the last two and ``den``."""
    # sigma^2 = softplus(s) + sigma2_min
    variances = numerics.softplus(raw_variances) + raw_variances.dtype.type(min_variance)
    # log pi = log_softmax(a), never log(softmax(a)): a weight of 1e-320 keeps its log
    log_weights = numerics.log_softmax(logits)
    out, gamma_q, gamma_k, mixing, min_quad_q, min_quad_k = _gma(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size)
    return out, GMACache(x_q, x_k, means, raw_variances, variances, gamma_q, gamma_k, mixing), min_quad_q, min_quad_k


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

    Returns
    -------
    out : ndarray, shape (..., N_q, d_v)
    cache : GMACache or GMABatchCache
        For 2-D inputs, a GMACache: inputs, variances, both responsibility
        matrices (``N x K``) and the mixing cache; with leading dimensions, a
        GMABatchCache holding the leading shape, whether the GMM is per head,
        and one GMACache per sequence.
    """
    args = check_gma_forward_arguments(x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size)
    x_q, x_k, v, means, raw_variances, logits, causal, eps, min_variance, chunk_size = args
    if x_q.ndim == 2:
        out, cache, min_quad_q, min_quad_k = _gma_forward(*args)
        check_gma_results(min_quad_q, min_quad_k, cache.mixing.den, cache.mixing.eps)
        return out, cache
    # one sequence at a time, each with its head's GMM (or the shared one), each keeping its own GMACache
    out = np.empty(x_q.shape[:-1] + v.shape[-1:], dtype=x_q.dtype)
    caches, mq, mk = [], [], []
    for idx in np.ndindex(x_q.shape[:-2]):
        gmm = _gmm_of(idx, means, raw_variances, logits)
        out[idx], cache, min_quad_q, min_quad_k = _gma_forward(
            x_q[idx], x_k[idx], v[idx], *gmm, causal, eps, min_variance, chunk_size
        )
        caches.append(cache), mq.append(min_quad_q), mk.append(min_quad_k)
    den = np.concatenate([c.mixing.den for c in caches])
    check_gma_results(np.concatenate(mq), np.concatenate(mk), den, eps)
    return out, GMABatchCache(x_q.shape[:-2], means.ndim == 3, tuple(caches))


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def _responsibility_backward(x, gamma, grad_gamma, means, variances, centre):
    """Push ``dL/dgamma`` (N, K) through ``gamma = softmax(l(x))``: ``(dx, dmeans, dvariances, dlogits)``.

    Read as whole-array lines, with ``c = gamma * (grad_gamma - sum_m gamma_m grad_gamma_m)``
    and ``xc = x - centre``::

        dx = c @ (mc p) - xc * (c @ p)
        dmeans = (c.T @ xc - c.sum(0)[:, None] mc) p
        dvariances = (c.T @ xc**2 - 2 mc (c.T @ xc) + (mc**2 - sigma^2) c.sum(0)[:, None]) p^2 / 2

    Evaluated a block of rows at a time (:func:`refimpl.numerics.block_rows`):
    the ``N x K`` and ``N x d_r`` intermediates of a block stay in cache, and
    the three sums over the rows (``c.sum(0)``, ``c.T @ xc``, ``c.T @ xc**2``)
    are accumulated block by block.
    """
    n, d = x.shape
    dtype = x.dtype
    # x - mu is invariant under the common shift by the centre of the means
    mc = means - centre
    prec = 1.0 / variances
    mc_prec = mc * prec
    dx = np.empty_like(x)
    csum = np.zeros(means.shape[0], dtype=dtype)  # sum_i c_im
    ctx = np.zeros(means.shape, dtype=dtype)  # sum_i c_im xc_i
    ctx2 = np.zeros(means.shape, dtype=dtype)  # sum_i c_im xc_i^2
    rows = numerics.block_rows((2 * means.shape[0] + 3 * d) * dtype.itemsize)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        gam, grad = gamma[a:b], grad_gamma[a:b]
        # dL/dl_m = gamma_m (g_m - gbar) with gbar = sum_m gamma_m g_m (softmax Jacobian)
        gbar = (gam * grad) @ np.ones(gam.shape[1], dtype=dtype)
        c = grad - gbar[:, None]
        c *= gam
        xc = x[a:b] - centre
        csum += np.ones(b - a, dtype=dtype) @ c
        ctx += c.T @ xc
        # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2
        np.matmul(c, mc_prec, out=dx[a:b])
        dx[a:b] -= xc * (c @ prec)
        xc *= xc
        ctx2 += c.T @ xc
    # dL/dmu_m = sum_i c_im (x_i - mu_m) / sigma_m^2
    dmeans = (ctx - csum[:, None] * mc) * prec
    # dL/dsigma2_mj = sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj) / (2 sigma2_mj^2), (x - mu)^2 expanded
    sq = ctx2 - 2.0 * mc * ctx + (mc * mc - variances) * csum[:, None]
    dvariances = 0.5 * sq * prec * prec
    # dL/da_k = c_k: the -pi_k sum_m c_m term of the log-softmax Jacobian vanishes
    return dx, dmeans, dvariances, csum


def _gma_backward(g, cache):
    """Core of :func:`gma_backward` (``g`` of the cache's dtype)."""
    dgamma = scan_backward(g, cache.mixing)
    means, variances = cache.means, cache.variances
    centre = means.mean(axis=0)
    dx_q, dmu_q, dvar_q, da_q = _responsibility_backward(cache.x_q, cache.gamma_q, dgamma.phi_q, means, variances, centre)
    dx_k, dmu_k, dvar_k, da_k = _responsibility_backward(cache.x_k, cache.gamma_k, dgamma.phi_k, means, variances, centre)
    # sigma2 = softplus(s) + sigma2_min: dsigma2/ds = sigmoid(s)
    draw = (dvar_q + dvar_k) * expit(cache.raw_variances)
    return GMAGrads(x_q=dx_q, x_k=dx_k, v=dgamma.v, means=dmu_q + dmu_k, raw_variances=draw, logits=da_q + da_k)


def _gma_batch_backward(g, cache):
    """Core of :func:`gma_backward` for a :class:`GMABatchCache`: the 2-D core per sequence, parameter gradients summed in order."""
    first = cache.caches[0]
    heads = (cache.leading[-1],) if cache.per_head else ()
    dtype = first.gamma_q.dtype
    dx_q = np.empty(cache.leading + first.x_q.shape, dtype=dtype)
    dx_k = np.empty(cache.leading + first.x_k.shape, dtype=dtype)
    dv = np.empty(cache.leading + first.mixing.v.shape, dtype=dtype)
    dmeans = np.zeros(heads + first.means.shape, dtype=dtype)
    draw = np.zeros(heads + first.raw_variances.shape, dtype=dtype)
    dlogits = np.zeros(heads + first.means.shape[:1], dtype=dtype)
    for idx, c in zip(np.ndindex(cache.leading), cache.caches):
        grads = _gma_backward(g[idx], c)
        dx_q[idx], dx_k[idx], dv[idx] = grads.x_q, grads.x_k, grads.v
        # per head: the sum over the sequences of that head; shared: over every sequence
        h = idx[-1:] if cache.per_head else ()
        dmeans[h] += grads.means
        draw[h] += grads.raw_variances
        dlogits[h] += grads.logits
    return GMAGrads(x_q=dx_q, x_k=dx_k, v=dv, means=dmeans, raw_variances=draw, logits=dlogits)


def gma_backward(grad_out, cache) -> GMAGrads:
    """Hand-derived gradients of :func:`gma_forward`; returns new arrays (nothing accumulates).

    Parameters
    ----------
    grad_out : array_like, shape (..., N_q, d_v)
        ``dL/d out``, the shape of the forward's output.
    cache : GMACache or GMABatchCache
        From :func:`gma_forward`.

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
    validation.check_instance(cache, "cache", (GMACache, GMABatchCache), "the GMACache or GMABatchCache from gma_forward")
    if isinstance(cache, GMACache):
        g = check_gma_grad_out(grad_out, cache.mixing.out.shape, cache.gamma_q.dtype)
        return _gma_backward(g, cache)
    first = cache.caches[0]
    g = check_gma_grad_out(grad_out, cache.leading + first.mixing.out.shape, first.gamma_q.dtype)
    return _gma_batch_backward(g, cache)
