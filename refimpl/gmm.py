r"""Diagonal-covariance Gaussian mixtures: posteriors, likelihood, EM, and EM = Newton.

Everything Gaussian-mixture attention needs from a GMM, written as plain
functions on arrays.  Shapes: ``x`` is ``(N, d)``, ``means`` and ``variances``
are ``(K, d)``, ``weights`` is ``(K,)``.  The derivations are in
``docs/derivations/gmm_posteriors.md``; this docstring states the results.

Responsibilities
----------------
(``gmm_posteriors.md#bayes-rule-in-the-log-domain``.)  Components are indexed
by :math:`n` as on the derivation page (the code's comments write ``k``, the
column index of an ``N x K`` array).  The log joint of point :math:`x` and
component :math:`n` is

.. math::

    \ell_n(x) = \log\pi_n - \frac d2\log 2\pi - \frac12\sum_j\log\sigma_{nj}^2
    - \frac12\Delta_n(x),\qquad \Delta_n(x) = \sum_j \frac{(x_j-\mu_{nj})^2}{\sigma_{nj}^2},

and the responsibility is its softmax over the components,
:math:`\gamma_n(x) = \exp(\ell_n - \operatorname{logsumexp}_m\ell_m)`, with the
per-row maximum subtracted (:mod:`refimpl.numerics`).  :func:`log_joint`
computes :math:`\Delta` from the differences :math:`x - \mu`, as it is
defined: every term is the rounded square of a rounded difference, all
:math:`\ge 0`, so nothing cancels and the result is exact to rounding for
every input, however far apart the means are.  Rows are taken in blocks only
to bound the memory of the ``N x K x d`` differences.  The same numbers by
two matrix products (the expansion of the square, with a screen for its
cancellation) are in :mod:`refimpl.tuned`.

EM and EM = Newton
------------------
:func:`em_step` is one EM iteration (scikit-learn's conventions).  For an
isotropic mixture with covariance :math:`I/\beta` and fixed weights, the
Newton step on the EM surrogate (Hessian :math:`H_n = \beta N_n I`, the
responsibilities held fixed; not the Hessian of the NLL) is the M-step
:math:`\mu_n = \sum_i r_{in}x_i / N_n` (:func:`newton_step`,
:func:`isotropic_m_step`); hard assignments give k-means
(:func:`kmeans_step`) and the exact running mean (:func:`running_mean_update`)
(``gmm_posteriors.md#em-as-a-newton-step``).

Parameterisation for learning: :math:`\sigma^2 = \operatorname{softplus}(s) +
\sigma^2_{\min}`, :math:`\pi = \operatorname{softmax}(a)`.

All functions accept float32 or float64 and return the dtype that NumPy's
promotion rules give for their inputs (float32 in, float32 out).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from . import numerics, validation

__all__ = [
    "logsumexp",
    "log_softmax",
    "softmax",
    "softplus",
    "softplus_inverse",
    "sigmoid",
    "variances_from_raw",
    "raw_from_variances",
    "weights_from_logits",
    "log_gaussian_diag",
    "log_responsibilities",
    "responsibilities",
    "log_likelihood",
    "em_step",
    "isotropic_nll",
    "isotropic_nll_gradient",
    "isotropic_surrogate_hessian",
    "isotropic_m_step",
    "newton_step",
    "hard_assignments",
    "kmeans_step",
    "running_mean_update",
    "fold_running_means",
    "log_joint",
    "m_step",
]

LOG_2PI = float(np.log(2.0 * np.pi))

# ---------------------------------------------------------------------------
# Primitives: checked versions of refimpl.numerics
# ---------------------------------------------------------------------------


def logsumexp(a, axis: int = -1, keepdims: bool = False):
    """``log(sum(exp(a), axis))`` with the maximum along ``axis`` subtracted.

    Parameters
    ----------
    a : array_like of float
        Values in the log domain, any shape; ``-inf`` entries are allowed,
        NaN and ``+inf`` are not.
    axis : int, default -1
        Axis to reduce (per row for a 2-D array and ``axis=-1``).
    keepdims : bool, default False
        Keep the reduced axis with length one.

    Returns
    -------
    ndarray
        Same dtype as ``a``.  A slice that is all ``-inf`` gives ``-inf``.
    """
    a, axis, keepdims = validation.check_log_values(a, "a"), validation.check_int(axis, "axis"), validation.check_bool(keepdims, "keepdims")
    return numerics.logsumexp(a, axis, keepdims)


def log_softmax(a, axis: int = -1):
    """``a - logsumexp(a, axis)``, accurate even where ``|a|`` is huge.

    Subtracting the per-row maximum first makes the largest entry exactly 0;
    only then is ``log sum exp`` (a number in ``[0, log K]``) subtracted.
    Forming ``logsumexp(a)`` first would add ``log K`` to a number like
    ``-1e16`` and lose it to rounding, so rows would stop normalising.
    ``a`` is checked as in :func:`logsumexp`.
    """
    a, axis = validation.check_log_values(a, "a"), validation.check_int(axis, "axis")
    return numerics.log_softmax(a, axis)


def softmax(a, axis: int = -1):
    """``exp(a) / sum(exp(a), axis)`` with the per-row maximum subtracted.

    ``a`` is checked as in :func:`logsumexp` (``-inf`` gives a weight of 0).
    """
    a, axis = validation.check_log_values(a, "a"), validation.check_int(axis, "axis")
    return numerics.softmax(a, axis)


def softplus(s):
    """``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; ``s`` finite floats, any shape."""
    s = validation.as_float_array(s, "s")
    return numerics.softplus(s)


def softplus_inverse(y):
    """The ``s`` with ``softplus(s) = y`` for ``y > 0``: ``y + log(-expm1(-y))``.

    From ``exp(s) = exp(y) - 1 = exp(y) (1 - exp(-y))``; ``expm1`` keeps the
    accuracy for small ``y`` and the form never overflows for large ``y``.
    """
    y = validation.check_softplus_values(y)
    return y + np.log(-np.expm1(-y))


def sigmoid(s):
    """``1 / (1 + exp(-s))``, the derivative of :func:`softplus` (``scipy.special.expit``); ``s`` finite floats."""
    s = validation.as_float_array(s, "s")
    return expit(s)


def variances_from_raw(raw_variances, min_variance: float = 1e-6):
    """``softplus(raw_variances) + min_variance``: always >= ``min_variance`` (> 0)."""
    raw_variances, min_variance = validation.as_float_array(raw_variances, "raw_variances"), validation.check_positive_float(min_variance, "min_variance")
    # sigma^2 = softplus(s) + sigma2_min
    return numerics.softplus(raw_variances) + np.asarray(min_variance, dtype=raw_variances.dtype)


def raw_from_variances(variances, min_variance: float = 1e-6):
    """Inverse of :func:`variances_from_raw`; needs ``variances > min_variance > 0``."""
    variances, min_variance = validation.check_raw_from_variances(variances, min_variance)
    return softplus_inverse(variances - np.asarray(min_variance, dtype=variances.dtype))


def weights_from_logits(logits):
    """Mixture weights ``softmax(logits)`` over the last axis (``-inf`` gives a weight of 0)."""
    logits = validation.check_log_values(logits, "logits")
    return numerics.softmax(logits, axis=-1)


# ---------------------------------------------------------------------------
# The log joint, from the differences
# ---------------------------------------------------------------------------


def log_joint(x, means, variances, log_weights):
    """Core: ``l_ik = log pi_k + log N(x_i | mu_k, diag sigma_k^2)`` from the differences ``x - mu``, and ``min_quad``.

    No validation (the caller checked the arrays, one float dtype) and no
    raise: the caller checks the returned ``min_quad``
    (:func:`refimpl.validation.check_scaled_distances`).

    Parameters
    ----------
    x : ndarray, shape (N, d)
    means, variances : ndarray, shape (K, d)
    log_weights : ndarray, shape (K,)
        ``log pi``; ``-inf`` for a component of weight 0.

    Returns
    -------
    logits : ndarray, shape (N, K)
    min_quad : ndarray, shape (N,)
        ``min_k sum_j (x_ij - mu_kj)^2 / sigma_kj^2``: not finite for a row
        without a representable posterior (every distance overflows).
    """
    n, d = x.shape
    K = means.shape[0]
    # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
    log_norm = log_weights - 0.5 * (d * LOG_2PI + np.sum(np.log(variances), axis=1))
    precisions = 1.0 / variances
    q = np.empty((n, K), dtype=x.dtype)
    # a block's differences x_i - mu_k take K d numbers a row
    rows = numerics.block_rows(K * d * x.dtype.itemsize)
    for a in range(0, n, rows):
        with np.errstate(over="ignore", invalid="ignore"):
            diff = x[a : a + rows, None, :] - means[None, :, :]  # (B, K, d): x_i - mu_k
            # q_ik = sum_j (x_ij - mu_kj)^2 / sigma_kj^2: every term >= 0, nothing cancels
            q[a : a + rows] = np.einsum("bkj,bkj,kj->bk", diff, diff, precisions)
    return log_norm - 0.5 * q, np.min(q, axis=1, initial=np.inf)


# ---------------------------------------------------------------------------
# Log-densities, responsibilities, likelihood
# ---------------------------------------------------------------------------


def log_gaussian_diag(x, means, variances):
    """Log-density of every point under every diagonal Gaussian.

    Parameters
    ----------
    x : array_like, shape (N, d)
        Points.
    means : array_like, shape (K, d)
        Component means.
    variances : array_like, shape (K, d)
        Diagonal variances, all > 0.

    Returns
    -------
    ndarray, shape (N, K)
        ``log N(x_i | mu_k, diag variances_k)`` with the full normalising
        constant, from the differences ``x - mu``.
    """
    x, means, variances, _ = validation.check_gmm(x, means, variances)
    # log N(x | mu_k, sigma_k^2) is the log joint with log pi_k = 0
    logits, min_quad = log_joint(x, means, variances, np.zeros(means.shape[0], dtype=x.dtype))
    validation.check_scaled_distances(min_quad, "x")
    return logits


def log_responsibilities(x, means, variances, weights):
    """Log posterior ``log p(z = k | x_i)`` under a diagonal GMM.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means : array_like, shape (K, d)
    variances : array_like, shape (K, d)
        All > 0.
    weights : array_like, shape (K,)
        Nonnegative, summing to one.

    Returns
    -------
    ndarray, shape (N, K)
        ``l_k(x_i) - logsumexp_m l_m(x_i)`` with ``l_k = log pi_k + log N``;
        every row's log-sum-exp is 0.  Right to rounding for every input
        (module docstring), not only for points near the origin.
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    # log gamma_k = l_k - logsumexp_m l_m
    return numerics.log_softmax(logits, axis=1)


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N, K)
        Nonnegative rows that sum to one.
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    # gamma_k = exp(l_k) / sum_m exp(l_m)
    return numerics.softmax(logits, axis=1)


def log_likelihood(x, means, variances, weights):
    """Per-point log-likelihood ``log sum_k pi_k N(x_i | mu_k, sigma_k^2)``.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N,)
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    # log p(x) = log sum_k pi_k N(x | mu_k, sigma_k^2) = logsumexp_k l_k
    return numerics.logsumexp(logits, axis=1)


def em_step(x, means, variances, weights, *, reg_covar: float = 0.0):
    """One EM iteration for a diagonal GMM.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means, variances : array_like, shape (K, d)
    weights : array_like, shape (K,)
    reg_covar : float, default 0.0
        Added to every new variance (keeps a component that owns one point,
        or none, from collapsing to variance 0).

    Returns
    -------
    means : ndarray, shape (K, d)
    variances : ndarray, shape (K, d)
    weights : ndarray, shape (K,)

    Notes
    -----
    Follows scikit-learn's conventions so the two agree to rounding:
    ``N_k = sum_i r_ik + 10 u`` (an empty component keeps finite means) and
    the new weights are renormalised to sum to one.  The variances are
    computed from the centred data ``x - mu_k`` one component at a time
    (memory ``O(N d)``), not by the expansion ``E[x^2] - mu^2``, which
    cancels catastrophically for tight components far from the origin.
    """
    x, means, variances, weights, reg_covar = validation.check_em_step(x, means, variances, weights, reg_covar)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    # E-step: r_ik = gamma_k(x_i)
    return m_step(x, numerics.softmax(logits, axis=1), reg_covar)


def m_step(x, resp, reg_covar):
    """Core: the M-step of :func:`em_step` from checked points ``x (N, d)`` and responsibilities ``resp (N, K)``.

    Returns ``(means, variances, weights)``; see :func:`em_step` for the conventions.
    """
    dtype = x.dtype
    nk = resp.sum(axis=0) + 10 * np.finfo(dtype).eps
    # mu_k = sum_i r_ik x_i / N_k
    new_means = (resp.T @ x) / nk[:, None]
    # sigma_k^2 = sum_i r_ik (x_i - mu_k)^2 / N_k, from the centred data
    new_variances = np.empty_like(new_means)
    for k in range(new_means.shape[0]):
        diff = x - new_means[k]
        new_variances[k] = (resp[:, k] @ (diff * diff)) / nk[k]
    new_variances += dtype.type(reg_covar)
    # pi_k = N_k / N, renormalised after the 10 u guard
    new_weights = nk / x.shape[0]
    new_weights /= new_weights.sum()
    return new_means, new_variances, new_weights


# ---------------------------------------------------------------------------
# Isotropic mixtures: EM = Newton, k-means, online running mean
# ---------------------------------------------------------------------------


def isotropic_nll(x, means, beta, weights=None) -> float:
    """Negative log-likelihood of an isotropic GMM with covariance ``I / beta``.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means : array_like, shape (K, d)
    beta : float
        Precision (> 0) shared by all components.
    weights : array_like, shape (K,), optional
        Mixture weights; uniform by default.

    Returns
    -------
    float
        ``-sum_i log sum_n pi_n N(x_i; mu_n, I / beta)``.
    """
    x, means, variances, weights = validation.check_isotropic_gmm(x, means, beta, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    # -sum_i log p(x_i) = -sum_i logsumexp_n l_in
    return float(-np.sum(numerics.logsumexp(logits, axis=1)))


def isotropic_nll_gradient(x, means, beta, weights=None):
    """Gradient of :func:`isotropic_nll` with respect to the means.

    Returns
    -------
    ndarray, shape (K, d)
        ``-beta * sum_i r_in (x_i - mu_n)``, with ``r`` the responsibilities
        at ``means`` (exact: the derivative of the log-sum-exp is the softmax).
    """
    x, means, variances, weights = validation.check_isotropic_gmm(x, means, beta, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    resp = numerics.softmax(logits, axis=1)  # r_in at the current means
    # sum_i r_in (x_i - mu_n) = (R^T X)_n - N_n mu_n
    return -(1.0 / variances[0, 0]) * (resp.T @ x - resp.sum(axis=0)[:, None] * means)


def isotropic_surrogate_hessian(x, means, beta, weights=None):
    """Diagonal of the Hessian of the EM surrogate, one scalar per component.

    With the responsibilities ``r`` held at their current values, the
    surrogate ``sum_i sum_n r_in (beta / 2) ||x_i - mu_n||^2`` has the
    block-diagonal Hessian ``H_n = beta N_n I`` with ``N_n = sum_i r_in``.
    It is not the Hessian of the NLL, which has extra terms from the
    dependence of ``r`` on the means and can be indefinite.

    Returns
    -------
    ndarray, shape (K,)
        ``beta * N_n``.
    """
    x, means, variances, weights = validation.check_isotropic_gmm(x, means, beta, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    resp = numerics.softmax(logits, axis=1)  # r_in at the current means
    return (1.0 / variances[0, 0]) * resp.sum(axis=0)


def newton_step(x, means, beta, weights=None):
    """One Newton step on the isotropic NLL with the surrogate Hessian.

    Returns
    -------
    ndarray, shape (K, d)
        ``mu_n - H_n^{-1} grad_n``; equal to :func:`isotropic_m_step`
        (``docs/derivations/gmm_posteriors.md``).  Components with ``N_n = 0``
        give non-finite rows (the Hessian is singular there).
    """
    grad = isotropic_nll_gradient(x, means, beta, weights)
    hess = isotropic_surrogate_hessian(x, means, beta, weights)
    means = np.asarray(means, dtype=grad.dtype)
    return means - grad / hess[:, None]


def isotropic_m_step(x, means, beta, weights=None):
    """EM M-step for the means of an isotropic GMM (weights and beta fixed).

    Returns
    -------
    ndarray, shape (K, d)
        ``sum_i r_in x_i / sum_i r_in``, responsibilities at ``means``.
    """
    x, means, variances, weights = validation.check_isotropic_gmm(x, means, beta, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    resp = numerics.softmax(logits, axis=1)  # r_in at the current means
    return (resp.T @ x) / resp.sum(axis=0)[:, None]


def _nearest_means(x, means):
    # argmin_n ||x - mu_n||^2 = argmin_n (||mu_n||^2 - 2 x . mu_n); ||x||^2 is common to the row
    scores = np.sum(means * means, axis=1) - 2.0 * (x @ means.T)
    return np.argmin(scores, axis=1).astype(np.int64)


def hard_assignments(x, means):
    """Index of the nearest mean (Euclidean) for every point; ties go to the lowest index.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means : array_like, shape (K, d)

    Returns
    -------
    ndarray of int64, shape (N,)
    """
    return _nearest_means(*validation.check_points_and_means(x, means))


def kmeans_step(x, means):
    """One batch k-means (Lloyd) update: the ``beta -> infinity`` limit of EM.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means : array_like, shape (K, d)

    Returns
    -------
    ndarray, shape (K, d)
        The mean of the points nearest to each centroid; a centroid that wins
        no point is kept where it was.
    """
    x, means = validation.check_points_and_means(x, means)
    zeros = np.zeros(means.shape[0], dtype=x.dtype)
    # the mean of the points nearest to each centroid: the running mean from a count of 0
    return fold_running_means(means, zeros, x, _nearest_means(x, means))[0]


def running_mean_update(means, counts, x, assignments):
    """Fold a batch into per-row running means: the online k-means rule.

    Parameters
    ----------
    means : array_like, shape (K, d)
        Current means (rows with count 0 are ignored and replaced).
    counts : array_like, shape (K,)
        How many points each mean already summarises (>= 0).
    x : array_like, shape (B, d)
        New points.
    assignments : array_like of int, shape (B,)
        Row of ``means`` each point joins, in ``[0, K)``.

    Returns
    -------
    means : ndarray, shape (K, d)
        ``(c_n mu_n + sum_{i in S_n} x_i) / (c_n + |S_n|)`` for rows that
        received points, the old row otherwise.  This equals
        ``mu_n + (1 / (c_n + |S_n|)) sum_{i in S_n} (x_i - mu_n)``, the
        Newton/EM step with hard assignments.
    counts : ndarray, shape (K,)
        ``c_n + |S_n|``, same dtype as ``counts``.

    Notes
    -----
    Sparse: only the rows in ``assignments`` are touched.  The batch sums are
    accumulated by ``np.add.at`` in the order of ``x``, so the result is
    reproducible bit for bit (:func:`fold_running_means`).
    """
    return fold_running_means(*validation.check_running_mean(means, counts, x, assignments))


def fold_running_means(means, counts, x, assignments):
    """Core: :func:`running_mean_update` of checked arguments, for the loops that fold a batch per chunk.

    ``means (K, d)`` and ``x (B, d)`` of one float dtype, ``counts (K,)``
    nonnegative, ``assignments (B,)`` integers in ``[0, K)``; returns ``(means,
    counts)`` as :func:`running_mean_update` does.
    """
    sums = np.zeros(means.shape, dtype=means.dtype)
    np.add.at(sums, assignments, x)  # sum_{i in S_n} x_i, accumulated in the order of x
    added = np.bincount(assignments, minlength=means.shape[0]).astype(counts.dtype)
    new_counts = counts + added
    touched = added > 0
    new_means = means.copy()
    # mu' = (c mu + sum_S x) / (c + |S|): the exact running mean
    c_old = counts[touched].astype(means.dtype)[:, None]
    c_new = new_counts[touched].astype(means.dtype)[:, None]
    new_means[touched] = (c_old * means[touched] + sums[touched]) / c_new
    return new_means, new_counts
