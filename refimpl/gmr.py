r"""Gaussian kernel regression and Gaussian mixture regression (GMR): attention as regression.

Shapes: queries ``q`` are ``(N_q, d)``, keys ``k`` are ``(N_k, d)``, values
``v`` are ``(N_k, d_v)``; a mixture has ``M`` components with key means
``(M, d)``, value means ``(M, d_v)`` and weights ``(M,)``.  The derivations
are in ``docs/derivations/ovq_gmr.md``; this docstring states the results.

* Self-attention is Gaussian kernel regression
  (``ovq_gmr.md#self-attention-is-gaussian-kernel-regression``): on unit
  vectors the Nadaraya-Watson estimator with kernel
  :math:`\exp(-\tfrac\beta2\|q-k_j\|^2)` is
  :math:`\operatorname{softmax}(\beta\,q\mathbf K^\top)\mathbf V` (:func:`kernel_regression`).
* VQ/OVQ attention is GMR
  (``ovq_gmr.md#vq-and-ovq-attention-are-gaussian-mixture-regression``): with key
  covariance :math:`I/\beta` and no key-value cross-covariance,
  :math:`E[v\mid q] = \sum_m h_m(q)\mu^v_m`,
  :math:`h(q) = \operatorname{softmax}_m(\beta\,q\cdot\mu^k_m - \tfrac\beta2\|\mu^k_m\|^2 + \log\pi_m)`
  (:func:`gmr_predict`); dropping the norm term and taking
  :math:`\pi \propto c` gives the OVQ read-out
  :math:`\operatorname{softmax}(\beta\,qD_k^\top + \log c)D_v` (:func:`ovq_readout`).
* The cost of the dropped term (``ovq_gmr.md#the-cost-of-the-dropped-norm-term``):
  the two weight vectors differ by the tilt :math:`e^{\tau_m}`,
  :math:`\tau_m = -\tfrac\beta2\|\mu^k_m\|^2`, so OVQ gives more weight to
  long centroids than GMR does; with :math:`r = \max\tau - \min\tau`
  every output coordinate moves by at most :math:`\tanh(r/4)` times the range
  of the value means in that coordinate (:func:`readout_gap_bound`, attained).
* Fitting the joint GMM (``ovq_gmr.md#fitting-the-joint-mixture``):
  :func:`fit_joint_gmm` runs EM on the rows :math:`[k, v]` with diagonal
  covariances, whose conditional mean is the weighted sum of value means with
  responsibilities from the key marginals (:func:`joint_gmm_predict`).

All functions accept float32 or float64; the result has the dtype NumPy's
promotion gives for the floating inputs (float32 in, float32 out).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import numerics, validation
from .gmm import em_step, log_joint, log_likelihood

__all__ = [
    "kernel_regression",
    "gmr_predict",
    "ovq_readout",
    "readout_gap",
    "readout_gap_bound",
    "JointGMM",
    "fit_joint_gmm",
    "joint_gmm_predict",
]

# Elements of the (rows x N_k x d) difference tensor formed at a time by kernel_regression.
_BLOCK_ELEMENTS = 1 << 22


def kernel_regression(q, k, v, *, beta):
    r"""Nadaraya-Watson regression with the Gaussian kernel ``exp(-(beta/2)||q - k_j||^2)``.

    Parameters
    ----------
    q : array_like, shape (N_q, d)
        Query points.
    k : array_like, shape (N_k, d)
        Sample inputs (the keys).
    v : array_like, shape (N_k, d_v)
        Sample outputs (the values).
    beta : float
        Kernel precision (> 0); the kernel variance is ``1 / beta``.

    Returns
    -------
    ndarray, shape (N_q, d_v)
        ``sum_j w_ij v_j`` with ``w_ij = softmax_j(-(beta/2)||q_i - k_j||^2)``.

    Notes
    -----
    The squared distances are formed from the differences ``q_i - k_j``
    (blocks of rows, never an expanded dot product), so this is an evaluation
    independent of :func:`refimpl.attention.softmax_attention`.  On unit
    vectors the two agree: ``softmax_attention(q, k, v, scale=beta)``.
    """
    q, k, v, beta = validation.check_kernel_regression(q, k, v, beta)
    n_q, n_k = q.shape[0], k.shape[0]
    half_beta = q.dtype.type(0.5 * beta)
    logits = np.empty((n_q, n_k), dtype=q.dtype)
    rows = max(1, _BLOCK_ELEMENTS // max(1, n_k * q.shape[1]))
    for r in range(0, n_q, rows):
        diff = q[r : r + rows, None, :] - k[None, :, :]
        # log kernel: -(beta/2) ||q_i - k_j||^2
        logits[r : r + rows] = -half_beta * np.sum(diff * diff, axis=2)
    validation.check_softmax_logits(logits, "beta, q, k", "lower beta or rescale q and k")
    # w_ij = exp(l_ij) / sum_j exp(l_ij), per-row max subtracted inside softmax
    return numerics.softmax(logits, axis=1) @ v


def _checked_conditional_mean(q, key_means, key_variances, weights, value_means):
    """``E[v | q] = sum_m h_m(q) mu^v_m`` of checked arrays, with the boundary's check of the posterior."""
    log_w = numerics.log_weights(weights)
    # h_m(q) = softmax_m(log pi_m + log N(q; mu^k_m, diag key_variances_m))
    logits, min_quad = log_joint(q, key_means, key_variances, log_w)
    validation.check_scaled_distances(min_quad, "q")
    return numerics.softmax(logits, axis=1) @ value_means


def gmr_predict(q, key_means, value_means, weights, *, beta):
    r"""Exact conditional mean ``E[v | q]`` of a GMM with key covariance ``I / beta``.

    Parameters
    ----------
    q : array_like, shape (N_q, d)
        Queries (not normalised here).
    key_means : array_like, shape (M, d)
    value_means : array_like, shape (M, d_v)
    weights : array_like, shape (M,)
        Mixture weights: nonnegative, summing to one.
    beta : float
        Key precision (> 0).

    Returns
    -------
    ndarray, shape (N_q, d_v)
        ``sum_m h_m(q) mu^v_m`` with ``h_m`` the posterior of component ``m``
        given the key: it keeps the ``-(beta/2)||mu^k_m||^2`` term.

    Notes
    -----
    The responsibilities come from the full isotropic log-density
    (:func:`refimpl.gmm.log_gaussian_diag` with variances ``1/beta``) plus
    ``log pi``, normalised by a per-row log-sum-exp; no cross-covariance.
    """
    q, key_means, value_means, weights, beta = validation.check_gmr_predict(q, key_means, value_means, weights, beta)
    variances = np.full(key_means.shape, 1.0 / beta, dtype=q.dtype)
    return _checked_conditional_mean(q, key_means, variances, weights, value_means)


def ovq_readout(q, key_means, value_means, counts, *, beta, count_bias: bool = True):
    r"""The OVQ read-out ``softmax(beta q D_k^T + log c) D_v`` (no norm term).

    Parameters
    ----------
    q : array_like, shape (N_q, d)
        Queries; OVQ feeds unit vectors (they are not normalised here).
    key_means : array_like, shape (M, d)
        ``D_k``.
    value_means : array_like, shape (M, d_v)
        ``D_v``.
    counts : array_like, shape (M,)
        Positive counts ``c`` (integers or floats).
    beta : float
        Scale (> 0).
    count_bias : bool, default True
        Add ``log c`` to the logits (the ablation switch of OVQ).

    Returns
    -------
    ndarray, shape (N_q, d_v)
    """
    q, key_means, value_means, counts, beta, count_bias = validation.check_ovq_readout(q, key_means, value_means, counts, beta, count_bias)
    dtype = q.dtype
    logits = q @ key_means.T
    logits *= dtype.type(beta)
    if count_bias:
        # pi_m = c_m / sum c; the -log sum c is common to the row and cancels
        logits += np.log(counts.astype(dtype))
    validation.check_softmax_logits(logits, "beta, q, key_means", "lower beta or rescale q and key_means")
    return numerics.softmax(logits, axis=1) @ value_means


def readout_gap(q, key_means, value_means, counts, *, beta):
    """``ovq_readout - gmr_predict`` with ``pi = c / sum(c)``: the cost of dropping ``-(beta/2)||mu||^2``.

    Parameters are those of :func:`ovq_readout`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
        Zero up to rounding when all ``||key_means[m]||`` are equal.
    """
    q, key_means, value_means, counts = validation.check_key_value_counts(q, key_means, value_means, counts)
    beta = validation.check_positive_float(beta, "beta")
    ovq = ovq_readout(q, key_means, value_means, counts, beta=beta)
    # gmr_predict with pi = c / sum(c) and the isotropic key covariance I / beta
    weights = (counts.astype(np.float64) / np.sum(counts, dtype=np.float64)).astype(ovq.dtype)
    q, key_means, value_means = validation.common_dtype_arrays(q, key_means, value_means)
    exact = _checked_conditional_mean(q, key_means, np.full(key_means.shape, 1.0 / beta, dtype=q.dtype), weights, value_means)
    return ovq - exact


def readout_gap_bound(key_means, value_means, *, beta):
    r"""Per-coordinate bound on ``|readout_gap|``: ``tanh(r / 4) * (max_m mu^v_m - min_m mu^v_m)``.

    Parameters
    ----------
    key_means : array_like, shape (M, d)
    value_means : array_like, shape (M, d_v)
    beta : float

    Returns
    -------
    ndarray, shape (d_v,)
        ``r = (beta/2) (max_m ||mu^k_m||^2 - min_m ||mu^k_m||^2)`` is the range
        of the dropped term; the module docstring derives the bound.  It holds
        for every query and every set of counts in exact arithmetic; a
        computed :func:`readout_gap` can exceed it by rounding (about
        ``1e-15`` times the range of the value means, e.g. when the bound is 0
        for centroids of equal norm).
    """
    key_means, value_means, beta = validation.check_readout_gap_bound(key_means, value_means, beta)
    sq = np.sum(key_means * key_means, axis=1)
    r = 0.5 * beta * (np.max(sq) - np.min(sq))
    # TV(p, p') <= tanh(r/4) when log(p'/p) has range r; sum_m (p_m - p'_m) = 0
    return np.tanh(r / 4.0) * (np.max(value_means, axis=0) - np.min(value_means, axis=0))


class JointGMM(NamedTuple):
    """A diagonal GMM fitted to the joint rows ``[k, v]``, split into its key and value parts."""

    key_means: np.ndarray  #: (M, d)
    value_means: np.ndarray  #: (M, d_v)
    key_variances: np.ndarray  #: (M, d)
    value_variances: np.ndarray  #: (M, d_v)
    weights: np.ndarray  #: (M,)
    log_likelihood: np.ndarray  #: (n_iter + 1,) mean log-likelihood before each step and after the last


def fit_joint_gmm(k, v, n_components, *, n_iter: int = 50, reg_covar: float = 1e-6, seed: int = 0) -> JointGMM:
    """Fit a diagonal GMM to the joint data ``(k, v)`` with EM (:func:`refimpl.gmm.em_step`).

    Parameters
    ----------
    k : array_like, shape (N, d)
    v : array_like, shape (N, d_v)
    n_components : int
        ``M``, between 1 and ``N`` (the rows of ``k``).
    n_iter : int, default 50
        EM iterations (>= 0).
    reg_covar : float, default 1e-6
        Added to every variance at each M-step.
    seed : int, default 0
        The initial means are ``M`` distinct rows drawn by
        ``np.random.default_rng(seed)``; initial variances are the per-column
        variances of the data (plus ``reg_covar``), weights uniform.

    Returns
    -------
    JointGMM
        Means, variances and weights split at column ``d``, and the mean
        log-likelihood trace (non-decreasing: EM never increases the NLL).
    """
    k, v, M, n_iter, reg_covar, seed = validation.check_fit_joint_gmm(k, v, n_components, n_iter, reg_covar, seed)
    T, d = k.shape
    dtype = k.dtype
    x = np.concatenate([k, v], axis=1)
    rng = np.random.default_rng(seed)
    means = x[rng.choice(T, size=M, replace=False)].copy()
    variances = np.tile(np.var(x, axis=0) + reg_covar, (M, 1)).astype(dtype)
    variances = np.maximum(variances, np.finfo(dtype).tiny)
    weights = np.full(M, 1.0 / M, dtype=dtype)
    trace = [float(np.mean(log_likelihood(x, means, variances, weights)))]
    for it in range(n_iter):
        means, variances, weights = em_step(x, means, variances, weights, reg_covar=reg_covar)
        if not np.all(variances > 0):
            m, j = (int(i) for i in np.argwhere(~(variances > 0))[0])
            raise ValueError(
                f"reg_covar: after EM iteration {it + 1}, component {m} has variance 0 in column {j} (its points do "
                f"not spread there); pass reg_covar > 0 (the default is 1e-6)"
            )
        trace.append(float(np.mean(log_likelihood(x, means, variances, weights))))
    return JointGMM(
        key_means=means[:, :d],
        value_means=means[:, d:],
        key_variances=variances[:, :d],
        value_variances=variances[:, d:],
        weights=weights,
        log_likelihood=np.asarray(trace, dtype=dtype),
    )


def joint_gmm_predict(q, fit: JointGMM):
    """Exact conditional mean ``E[v | q]`` of a fitted diagonal joint GMM.

    Parameters
    ----------
    q : array_like, shape (N_q, d)
    fit : JointGMM
        From :func:`fit_joint_gmm`.

    Returns
    -------
    ndarray, shape (N_q, d_v)
        ``sum_m h_m(q) mu^v_m`` with ``h_m`` the posterior under the key
        marginals ``N(q; mu^k_m, diag key_variances_m)``: a diagonal joint
        covariance has no cross-covariance, so nothing else enters.
    """
    q, key_means, value_means, key_variances, weights = validation.check_joint_gmm_predict(q, fit, JointGMM)
    return _checked_conditional_mean(q, key_means, key_variances, weights, value_means)
