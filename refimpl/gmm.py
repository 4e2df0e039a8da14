r"""Diagonal-covariance Gaussian mixtures: posteriors, likelihood, EM, and EM = Newton.

Everything Gaussian-mixture attention needs from a GMM, written as plain
functions on arrays.  Shapes: ``x`` is ``(N, d)``, ``means`` and ``variances``
are ``(K, d)``, ``weights`` is ``(K,)``.

Log-density by matrix products
------------------------------
For a diagonal Gaussian with mean :math:`\mu_k` and variances
:math:`\sigma_k^2`,

.. math::

    \log \mathcal N(x \mid \mu_k, \operatorname{diag}\sigma_k^2)
      = -\tfrac{d}{2}\log 2\pi - \tfrac12 \sum_j \log\sigma_{kj}^2
        - \tfrac12 \sum_j \frac{(x_j-\mu_{kj})^2}{\sigma_{kj}^2}.

Expanding the square turns the quadratic term for all ``N x K`` pairs into two
matrix products and a row vector, so no ``N x K x d`` tensor is formed:

.. math::

    Q = (X \odot X)\,(1/\sigma^2)^\top - 2 X (\mu/\sigma^2)^\top
        + \mathbf 1_N \big[\textstyle\sum_j \mu_{kj}^2/\sigma_{kj}^2\big]^\top .

The expansion subtracts large numbers when :math:`|x|/\sigma` is large: its
absolute error is about :math:`\epsilon\,\|x\|^2/\sigma^2`.  Because
:math:`(x-\mu)^2` is invariant under a common shift of ``x`` and ``mu``, we
first subtract the centre of the means, which makes both small exactly where
the responsibilities are sensitive (points near the components).

Responsibilities by log-sum-exp
-------------------------------
With :math:`\ell_k(x) = \log\pi_k + \log\mathcal N(x\mid\mu_k,\sigma_k^2)`,
Bayes' rule gives :math:`\gamma_k(x) = e^{\ell_k}/\sum_m e^{\ell_m}`.  Log-densities
of -1e16 are ordinary (``|x| ~ 1e4``, ``sigma^2 ~ 1e-8``), so we never
exponentiate them: subtracting the per-row maximum :math:`\ell^\star` leaves
the ratio unchanged, puts the largest term at :math:`e^0 = 1` and bounds the
sum in :math:`[1, K]`:

.. math::

    \log\sum_m e^{\ell_m} = \ell^\star + \log\sum_m e^{\ell_m-\ell^\star}.

A component whose scaled distance :math:`\sum_j (x_j-\mu_{kj})^2/\sigma_{kj}^2`
overflows the float type gets responsibility 0, which is right to rounding.  A
row where it overflows for *every* component has no representable posterior
(it would come out as NaN); it is refused with an error that says to rescale or
use float64.

EM
--
E-step: :math:`r_{ik} = \gamma_k(x_i)`.  M-step with :math:`N_k = \sum_i r_{ik}`:
:math:`\pi_k = N_k/N`, :math:`\mu_k = \sum_i r_{ik}x_i/N_k`,
:math:`\sigma_k^2 = \sum_i r_{ik}(x_i-\mu_k)^2/N_k + \text{reg}`.  Each
iteration does not increase the negative log-likelihood (Dempster, Laird and
Rubin 1977).

EM = Newton (isotropic, fixed covariance :math:`I/\beta`, fixed weights)
-------------------------------------------------------------------------
:math:`\mathrm{NLL}(\mu) = -\sum_i \log\sum_n \pi_n \mathcal N(x_i;\mu_n, I/\beta)`.
Its gradient is (differentiate the log-sum-exp; the softmax that appears is
the responsibility):

.. math::

    \nabla_{\mu_n}\mathrm{NLL} = -\beta \sum_i r_{in}(x_i-\mu_n).

Holding the responsibilities fixed (the EM surrogate
:math:`\sum_i\sum_n r_{in}\,\tfrac\beta2\|x_i-\mu_n\|^2 + \text{const}`) the
Hessian is block diagonal, :math:`H_n = \beta N_n I`, and the Newton step is

.. math::

    \mu_n - H_n^{-1}\nabla_{\mu_n} = \mu_n + \frac{\sum_i r_{in}(x_i-\mu_n)}{N_n}
    = \frac{\sum_i r_{in} x_i}{N_n},

the EM M-step.  With hard assignments (:math:`\beta\to\infty`) it is the batch
k-means update, and carrying :math:`(\mu_n, c_n)` from batch to batch gives the
exact running mean :math:`\mu_n \leftarrow \mu_n + \frac{1}{c_n+|S_n|}\sum_{i\in S_n}(x_i-\mu_n)`.

Reparameterisation for learning
-------------------------------
Unconstrained parameters map to valid ones by
:math:`\sigma^2 = \operatorname{softplus}(s) + \sigma^2_{\min}` and
:math:`\pi = \operatorname{softmax}(a)`.

All functions accept float32 or float64 and return the dtype that NumPy's
promotion rules give for their inputs (float32 in, float32 out).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from . import _validation as V

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
]

LOG_2PI = float(np.log(2.0 * np.pi))


# ---------------------------------------------------------------------------
# Primitives: log-sum-exp, softmax, softplus
# ---------------------------------------------------------------------------


def _check_log_values(a, name: str):
    """A float array in the log domain: ``-inf`` (the log of a zero weight) is allowed, NaN and ``+inf`` are not."""
    a = V.as_float_array(a, name, finite=False)
    bad = np.isnan(a) | np.isposinf(a)
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}: expected finite values or -inf (the log of a zero weight), "
            f"got {int(np.sum(bad))} NaN or +inf entries (first at index {first}: {a[first]})"
        )
    return a


def _logsumexp(a, axis, keepdims):
    m = np.max(a, axis=axis, keepdims=True)
    # a slice of all -inf has max -inf; shift it by 0 so that exp gives 0, not nan
    m = np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)
    # log sum exp(a) = m + log sum exp(a - m): the largest term becomes exp(0) = 1.
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0.
    with np.errstate(divide="ignore", over="ignore"):
        out = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _log_softmax(a, axis=-1):
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0
    with np.errstate(over="ignore", divide="ignore"):
        shifted = a - m
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _softmax(a, axis=-1):
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)
    # softmax(a) = softmax(a - m): the largest term is exp(0) = 1, the sum is in [1, K]
    with np.errstate(over="ignore"):
        e = np.exp(a - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _check_logits(logits, names: str, fix: str):
    """Refuse rows of a 2-D ``logits`` whose softmax is undefined because a product overflowed.

    ``+inf`` (or NaN) in a row, or a row that is all ``-inf``, cannot come
    from finite inputs except through overflow; :func:`_softmax` would turn
    it into a row of NaN.  These are exactly the rows whose maximum is not
    finite, so one reduction finds them.  ``names`` are the arguments to
    blame, ``fix`` says what to change.
    """
    bad = ~np.isfinite(np.max(logits, axis=1))
    if np.any(bad):
        raise ValueError(
            f"{names}: the logits of {int(np.sum(bad))} row(s) (first: row {int(np.argmax(bad))}) overflow "
            f"{logits.dtype}, so their softmax is undefined; {fix}"
        )


def _softplus(s):
    return np.logaddexp(np.zeros((), dtype=np.result_type(s, np.float32)), s)


def _variances_from_raw(raw_variances, min_variance):
    return _softplus(raw_variances) + np.asarray(min_variance, dtype=raw_variances.dtype)


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
    a = _check_log_values(a, "a")
    return _logsumexp(a, V.check_int(axis, "axis"), V.check_bool(keepdims, "keepdims"))


def log_softmax(a, axis: int = -1):
    """``a - logsumexp(a, axis)``, accurate even where ``|a|`` is huge.

    Subtracting the per-row maximum first makes the largest entry exactly 0;
    only then is ``log sum exp`` (a number in ``[0, log K]``) subtracted.
    Forming ``logsumexp(a)`` first would add ``log K`` to a number like
    ``-1e16`` and lose it to rounding, so rows would stop normalising.
    ``a`` is checked as in :func:`logsumexp`.
    """
    return _log_softmax(_check_log_values(a, "a"), V.check_int(axis, "axis"))


def softmax(a, axis: int = -1):
    """``exp(a) / sum(exp(a), axis)`` with the per-row maximum subtracted.

    ``a`` is checked as in :func:`logsumexp` (``-inf`` gives a weight of 0).
    """
    return _softmax(_check_log_values(a, "a"), V.check_int(axis, "axis"))


def softplus(s):
    """``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; ``s`` finite floats, any shape."""
    return _softplus(V.as_float_array(s, "s"))


def softplus_inverse(y):
    """The ``s`` with ``softplus(s) = y`` for ``y > 0``: ``y + log(-expm1(-y))``.

    From ``exp(s) = exp(y) - 1 = exp(y) (1 - exp(-y))``; ``expm1`` keeps the
    accuracy for small ``y`` and the form never overflows for large ``y``.
    """
    y = V.as_float_array(y, "y")
    if np.any(y <= 0):
        raise ValueError(f"y: softplus takes only positive values, got minimum {np.min(y)}")
    return y + np.log(-np.expm1(-y))


def sigmoid(s):
    """``1 / (1 + exp(-s))``, the derivative of :func:`softplus` (``scipy.special.expit``); ``s`` finite floats."""
    return expit(V.as_float_array(s, "s"))


def variances_from_raw(raw_variances, min_variance: float = 1e-6):
    """``softplus(raw_variances) + min_variance``: always >= ``min_variance`` (> 0)."""
    raw_variances = V.as_float_array(raw_variances, "raw_variances")
    return _variances_from_raw(raw_variances, V.check_positive_float(min_variance, "min_variance"))


def raw_from_variances(variances, min_variance: float = 1e-6):
    """Inverse of :func:`variances_from_raw`; needs ``variances > min_variance > 0``."""
    variances = V.as_float_array(variances, "variances")
    min_variance = V.check_positive_float(min_variance, "min_variance")
    if np.any(variances <= min_variance):
        raise ValueError(
            f"variances: expected values > min_variance = {min_variance}, got minimum {np.min(variances)}"
        )
    return softplus_inverse(variances - np.asarray(min_variance, dtype=variances.dtype))


def weights_from_logits(logits):
    """Mixture weights ``softmax(logits)`` over the last axis (``-inf`` gives a weight of 0)."""
    return _softmax(_check_log_values(logits, "logits"), axis=-1)


# ---------------------------------------------------------------------------
# Validation of a GMM call
# ---------------------------------------------------------------------------


def _check_points_and_components(x, means, variances):
    x = V.as_float_array(x, "x", ndim=2)
    means = V.as_float_array(means, "means", ndim=2)
    variances = V.as_float_array(variances, "variances", ndim=2)
    d = x.shape[1]
    V.check_shape(means, "means", (None, d), ("K", "d"))
    K = means.shape[0]
    if K < 1:
        raise ValueError("means: expected at least one component (K >= 1), got K = 0")
    V.check_shape(variances, "variances", (K, d), ("K", "d"))
    V.check_positive(variances, "variances")
    return x, means, variances


def _check_weights(weights, K: int):
    weights = V.as_float_array(weights, "weights", ndim=1)
    V.check_shape(weights, "weights", (K,), ("K",))
    V.check_probability_vector(weights, "weights")
    return weights


def _check_gmm(x, means, variances, weights):
    x, means, variances = _check_points_and_components(x, means, variances)
    weights = _check_weights(weights, means.shape[0])
    dtype = V.common_float_dtype(x, means, variances, weights)
    return x.astype(dtype, copy=False), means.astype(dtype, copy=False), variances.astype(dtype, copy=False), weights.astype(dtype, copy=False)


# ---------------------------------------------------------------------------
# Log-densities, responsibilities, likelihood (unchecked cores + public API)
# ---------------------------------------------------------------------------


def _check_overflow(quad, name):
    """Refuse rows of the quadratic form whose minimum is not finite.

    A component at an infinite distance simply gets responsibility 0.  A row
    whose every distance overflows (minimum ``+inf``) has no representable
    posterior; NaN (``inf - inf``) or ``-inf`` in a row means the expansion
    itself overflowed.  Either would give a NaN or a wrong row downstream, so
    it is refused here, with the fix.
    """
    bad = ~np.isfinite(np.min(quad, axis=1))
    if np.any(bad):
        hint = ", or compute in float64" if quad.dtype == np.float32 else ""
        raise ValueError(
            f"{name}: the scaled squared distance sum_j (x_j - mu_kj)^2 / sigma_kj^2 overflows {quad.dtype} "
            f"in {int(np.sum(bad))} row(s) (first: row {int(np.argmax(bad))}), for every component or inside its "
            f"expansion, so no posterior can be formed; rescale {name}, the means and the variances{hint}"
        )


def _log_gaussian_diag(x, means, variances, name="x"):
    d = x.shape[1]
    # (x - mu)^2 is invariant under a common shift c; centring on the means
    # keeps the expanded terms below small where the posterior is sensitive.
    centre = means.mean(axis=0)
    xc = x - centre
    mc = means - centre
    precisions = 1.0 / variances
    # sum_j (x_j - mu_kj)^2 / s_kj = (x*x) @ (1/s)^T - 2 x @ (mu/s)^T + sum_j mu_kj^2 / s_kj
    quad = (xc * xc) @ precisions.T - 2.0 * (xc @ (mc * precisions).T) + np.sum(mc * mc * precisions, axis=1)
    _check_overflow(quad, name)
    # the exact value is >= 0; rounding in the expansion can dip below
    quad = np.maximum(quad, 0)
    log_det = np.sum(np.log(variances), axis=1)
    return -0.5 * (d * LOG_2PI + log_det + quad)


def _log_joint(x, means, variances, weights):
    with np.errstate(divide="ignore"):
        log_w = np.log(weights)
    return _log_gaussian_diag(x, means, variances) + log_w


def _log_responsibilities(x, means, variances, weights):
    # log gamma_k = l_k - logsumexp_m l_m, with the max of each row subtracted first
    return _log_softmax(_log_joint(x, means, variances, weights), axis=1)


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
        constant, computed with matrix products (no ``N x K x d`` tensor).
    """
    x, means, variances = _check_points_and_components(x, means, variances)
    dtype = V.common_float_dtype(x, means, variances)
    return _log_gaussian_diag(x.astype(dtype, copy=False), means.astype(dtype, copy=False), variances.astype(dtype, copy=False))


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
        every row's log-sum-exp is 0.
    """
    return _log_responsibilities(*_check_gmm(x, means, variances, weights))


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N, K)
        Nonnegative rows that sum to one.
    """
    return np.exp(log_responsibilities(x, means, variances, weights))


def log_likelihood(x, means, variances, weights):
    """Per-point log-likelihood ``log sum_k pi_k N(x_i | mu_k, sigma_k^2)``.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N,)
    """
    return _logsumexp(_log_joint(*_check_gmm(x, means, variances, weights)), 1, False)


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
    ``N_k = sum_i r_ik + 10 eps`` (an empty component keeps finite means) and
    the new weights are renormalised to sum to one.  The variances are
    computed from the centred data ``x - mu_k`` one component at a time
    (memory ``O(N d)``), not by the expansion ``E[x^2] - mu^2``, which
    cancels catastrophically for tight components far from the origin.
    """
    x, means, variances, weights = _check_gmm(x, means, variances, weights)
    reg_covar = V.check_positive_float(reg_covar, "reg_covar", allow_zero=True)
    dtype = x.dtype
    # E-step: r_ik = gamma_k(x_i)
    resp = np.exp(_log_responsibilities(x, means, variances, weights))
    nk = resp.sum(axis=0) + 10 * np.finfo(dtype).eps
    # M-step: mu_k = sum_i r_ik x_i / N_k
    new_means = (resp.T @ x) / nk[:, None]
    # sigma_k^2 = sum_i r_ik (x_i - mu_k)^2 / N_k
    new_variances = np.empty_like(new_means)
    for k in range(means.shape[0]):
        diff = x - new_means[k]
        new_variances[k] = (resp[:, k] @ (diff * diff)) / nk[k]
    new_variances += dtype.type(reg_covar)
    # pi_k = N_k / N, renormalised after the 10 eps guard
    new_weights = nk / x.shape[0]
    new_weights /= new_weights.sum()
    return new_means, new_variances, new_weights


# ---------------------------------------------------------------------------
# Isotropic mixtures: EM = Newton, k-means, online running mean
# ---------------------------------------------------------------------------


def _check_isotropic(x, means, beta, weights):
    x = V.as_float_array(x, "x", ndim=2)
    means = V.as_float_array(means, "means", ndim=2)
    V.check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    K = means.shape[0]
    if K < 1:
        raise ValueError("means: expected at least one component (K >= 1), got K = 0")
    beta = V.check_positive_float(beta, "beta")
    dtype = V.common_float_dtype(x, means)
    if weights is None:
        weights = np.full(K, 1.0 / K, dtype=dtype)
    else:
        weights = _check_weights(weights, K)
        dtype = V.common_float_dtype(x, means, weights)
    variances = np.full(means.shape, 1.0 / beta, dtype=dtype)
    return x.astype(dtype, copy=False), means.astype(dtype, copy=False), variances, weights.astype(dtype, copy=False)


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
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    return float(-np.sum(_logsumexp(_log_joint(x, means, variances, weights), 1, False)))


def _isotropic_resp(x, means, variances, weights):
    return np.exp(_log_responsibilities(x, means, variances, weights))


def isotropic_nll_gradient(x, means, beta, weights=None):
    """Gradient of :func:`isotropic_nll` with respect to the means.

    Returns
    -------
    ndarray, shape (K, d)
        ``-beta * sum_i r_in (x_i - mu_n)``, with ``r`` the responsibilities
        at ``means`` (exact: the derivative of the log-sum-exp is the softmax).
    """
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _isotropic_resp(x, means, variances, weights)
    # sum_i r_in (x_i - mu_n) = (R^T X)_n - N_n mu_n
    return -(1.0 / variances[0, 0]) * (resp.T @ x - resp.sum(axis=0)[:, None] * means)


def isotropic_surrogate_hessian(x, means, beta, weights=None):
    """Diagonal of the Hessian of the EM surrogate, one scalar per component.

    With the responsibilities ``r`` held at their current values, the
    surrogate ``sum_i sum_n r_in (beta / 2) ||x_i - mu_n||^2`` has the
    block-diagonal Hessian ``H_n = beta N_n I`` with ``N_n = sum_i r_in``.

    Returns
    -------
    ndarray, shape (K,)
        ``beta * N_n``.
    """
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _isotropic_resp(x, means, variances, weights)
    return (1.0 / variances[0, 0]) * resp.sum(axis=0)


def newton_step(x, means, beta, weights=None):
    """One Newton step on the isotropic NLL with the surrogate Hessian.

    Returns
    -------
    ndarray, shape (K, d)
        ``mu_n - H_n^{-1} grad_n``; equal to :func:`isotropic_m_step` (the
        module docstring derives it).  Components with ``N_n = 0`` give
        non-finite rows (the Hessian is singular there).
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
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _isotropic_resp(x, means, variances, weights)
    return (resp.T @ x) / resp.sum(axis=0)[:, None]


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
    x = V.as_float_array(x, "x", ndim=2)
    means = V.as_float_array(means, "means", ndim=2)
    V.check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    if means.shape[0] < 1:
        raise ValueError("means: expected at least one component (K >= 1), got K = 0")
    # argmin_n ||x - mu_n||^2 = argmin_n (||mu_n||^2 - 2 x . mu_n); ||x||^2 is common to the row
    scores = np.sum(means * means, axis=1) - 2.0 * (x @ means.T)
    return np.argmin(scores, axis=1).astype(np.int64)


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
    assign = hard_assignments(x, means)
    x = np.asarray(x)
    dtype = V.common_float_dtype(x, np.asarray(means))
    zeros = np.zeros(np.asarray(means).shape[0], dtype=dtype)
    new_means, _ = running_mean_update(np.asarray(means, dtype=dtype), zeros, x.astype(dtype, copy=False), assign)
    return new_means


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
        Newton/EM step of the module docstring with hard assignments.
    counts : ndarray, shape (K,)
        ``c_n + |S_n|``, same dtype as ``counts``.

    Notes
    -----
    Sparse: only the rows in ``assignments`` are touched.  The batch sums are
    accumulated by ``np.add.at`` in the order of ``x``, so the result is
    reproducible bit for bit.
    """
    means = V.as_float_array(means, "means", ndim=2)
    x = V.as_float_array(x, "x", ndim=2)
    V.check_shape(x, "x", (None, means.shape[1]), ("B", "d"))
    counts = np.asarray(counts)
    V.check_shape(counts, "counts", (means.shape[0],), ("K",))
    if not (np.issubdtype(counts.dtype, np.integer) or np.issubdtype(counts.dtype, np.floating)):
        raise TypeError(f"counts: expected an integer or float array, got dtype {counts.dtype}")
    if np.issubdtype(counts.dtype, np.floating):
        V.check_finite(counts, "counts")
    if np.any(counts < 0):
        raise ValueError(f"counts: expected nonnegative counts, got minimum {np.min(counts)}")
    assignments = np.asarray(assignments)
    if not np.issubdtype(assignments.dtype, np.integer):
        raise TypeError(f"assignments: expected integers, got dtype {assignments.dtype}")
    V.check_shape(assignments, "assignments", (x.shape[0],), ("B",))
    if assignments.size and (assignments.min() < 0 or assignments.max() >= means.shape[0]):
        raise ValueError(
            f"assignments: expected indices in [0, {means.shape[0]}), got range "
            f"[{assignments.min()}, {assignments.max()}]"
        )
    dtype = V.common_float_dtype(means, x)
    sums = np.zeros(means.shape, dtype=dtype)
    np.add.at(sums, assignments, x)
    added = np.bincount(assignments, minlength=means.shape[0]).astype(counts.dtype)
    new_counts = counts + added
    touched = added > 0
    new_means = means.astype(dtype, copy=True)
    # mu' = (c mu + sum_S x) / (c + |S|): the exact running mean
    c_old = counts[touched].astype(dtype)[:, None]
    c_new = new_counts[touched].astype(dtype)[:, None]
    new_means[touched] = (c_old * means[touched] + sums[touched]) / c_new
    return new_means, new_counts
