r"""Diagonal-covariance Gaussian mixtures: posteriors, likelihood, EM, and EM = Newton.

Everything Gaussian-mixture attention needs from a GMM, written as plain
functions on arrays.  Shapes: ``x`` is ``(N, d)``, ``means`` and ``variances``
are ``(K, d)``, ``weights`` is ``(K,)``.  The derivations are in
``docs/derivations/gmm_posteriors.md``; this docstring states the results.

Responsibilities
----------------
Components are indexed by :math:`n` as on the derivation page (the code's
comments write ``k``, the column index of an ``N x K`` array).  With
:math:`\ell_n(x) = \log\pi_n + \log\mathcal N(x\mid\mu_n,\operatorname{diag}\sigma_n^2)`,
:math:`\gamma_n(x) = \exp(\ell_n - \operatorname{logsumexp}_m\ell_m)`, evaluated
with the per-row maximum subtracted (:mod:`refimpl.numerics`).  The quadratic
form :math:`\Delta_{in} = \sum_j (x_{ij}-\mu_{nj})^2/\sigma_{nj}^2` (``q`` in
the code) of all ``N x K`` pairs comes from two matrix products (the
expansion of the square, on ``x`` and ``mu`` centred on the mean of the
means).  Its rounding error is at most about :math:`(4+\sqrt d)\,u\,M_{in}`
with :math:`u` the machine epsilon and
:math:`M_{in} = (\sqrt{\xi_{in}} + \sqrt{\zeta_n})^2` the size of its terms,
:math:`\xi_{in} = \sum_j \tilde x_{ij}^2/\sigma_{nj}^2`,
:math:`\zeta_n = \sum_j\tilde\mu_{nj}^2/\sigma_{nj}^2` (centred), where the
definition evaluated directly has :math:`(4+\sqrt d)\,u\,\Delta_{in}`.  When
the means are spread far apart, :math:`M \gg \Delta` for the components near
a point: cancellation.  :func:`log_joint` recomputes from the differences every entry
that cancellation may have spoiled (:data:`CANCELLATION_RATIO`,
:data:`EXACT_LOGIT_TOL`) and that could lie near its row maximum, where the
posterior is decided.  So the responsibilities are as accurate as the
definition itself for every input, however far apart the means are, and
ordinary inputs pay only an ``O(N d)`` screen
(``gmm_posteriors.md#exact-responsibilities-for-every-input``).

Speed.  Read as one line, the responsibilities are ``softmax(log_norm - (xc**2
@ p.T - 2 xc @ (mc p).T + zeta) / 2)``; every step of that line makes an
``N x K`` array.  :func:`log_joint` evaluates it a block of rows at a time,
so that a block's ``N_b x K`` intermediates stay in cache and are reused
(``out=``), and :func:`posterior` takes the softmax of each block while its
logits are still there, with one ``exp`` per entry.  Float32 inputs are
computed in float32.  What this costs against the floor of the two matrix
products is measured in ``docs/performance_gma.md``.

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

from typing import NamedTuple

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
    "log_joint",
    "log_posterior",
    "posterior",
    "merge_running_means",
    "EXACT_LOGIT_TOL",
    "CANCELLATION_RATIO",
]

LOG_2PI = float(np.log(2.0 * np.pi))

#: Largest error, in units of the machine epsilon ``u``, that :func:`log_joint`
#: lets a logit near the row maximum keep: ``2048 u`` is ``4.5e-13`` in float64
#: and ``2.4e-4`` in float32.  A logit error ``delta`` moves a responsibility by
#: at most ``2 delta`` relative to the largest one.
EXACT_LOGIT_TOL = 2048

#: :func:`log_joint` recomputes a logit from the differences ``x - mu`` where the
#: terms of the expanded quadratic form exceed the form itself this many times
#: (more than 4 bits lost to cancellation) and its error could exceed
#: ``EXACT_LOGIT_TOL u``: elsewhere the expansion is within 16 times the
#: rounding error of the definition evaluated directly.
CANCELLATION_RATIO = 16

# Pairs recomputed exactly per block: at most this many rows of d floats at a time.
_EXACT_BLOCK = 1 << 14


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
    a = validation.check_log_values(a, "a")
    return numerics.logsumexp(a, validation.check_int(axis, "axis"), validation.check_bool(keepdims, "keepdims"))


def log_softmax(a, axis: int = -1):
    """``a - logsumexp(a, axis)``, accurate even where ``|a|`` is huge.

    Subtracting the per-row maximum first makes the largest entry exactly 0;
    only then is ``log sum exp`` (a number in ``[0, log K]``) subtracted.
    Forming ``logsumexp(a)`` first would add ``log K`` to a number like
    ``-1e16`` and lose it to rounding, so rows would stop normalising.
    ``a`` is checked as in :func:`logsumexp`.
    """
    return numerics.log_softmax(validation.check_log_values(a, "a"), validation.check_int(axis, "axis"))


def softmax(a, axis: int = -1):
    """``exp(a) / sum(exp(a), axis)`` with the per-row maximum subtracted.

    ``a`` is checked as in :func:`logsumexp` (``-inf`` gives a weight of 0).
    """
    return numerics.softmax(validation.check_log_values(a, "a"), validation.check_int(axis, "axis"))


def softplus(s):
    """``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; ``s`` finite floats, any shape."""
    return numerics.softplus(validation.as_float_array(s, "s"))


def softplus_inverse(y):
    """The ``s`` with ``softplus(s) = y`` for ``y > 0``: ``y + log(-expm1(-y))``.

    From ``exp(s) = exp(y) - 1 = exp(y) (1 - exp(-y))``; ``expm1`` keeps the
    accuracy for small ``y`` and the form never overflows for large ``y``.
    """
    y = _check_softplus_values(y)
    return y + np.log(-np.expm1(-y))


def sigmoid(s):
    """``1 / (1 + exp(-s))``, the derivative of :func:`softplus` (``scipy.special.expit``); ``s`` finite floats."""
    return expit(validation.as_float_array(s, "s"))


def variances_from_raw(raw_variances, min_variance: float = 1e-6):
    """``softplus(raw_variances) + min_variance``: always >= ``min_variance`` (> 0)."""
    raw_variances = validation.as_float_array(raw_variances, "raw_variances")
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    # sigma^2 = softplus(s) + sigma2_min
    return numerics.softplus(raw_variances) + np.asarray(min_variance, dtype=raw_variances.dtype)


def raw_from_variances(variances, min_variance: float = 1e-6):
    """Inverse of :func:`variances_from_raw`; needs ``variances > min_variance > 0``."""
    variances, min_variance = _check_raw_from_variances(variances, min_variance)
    return softplus_inverse(variances - np.asarray(min_variance, dtype=variances.dtype))


def weights_from_logits(logits):
    """Mixture weights ``softmax(logits)`` over the last axis (``-inf`` gives a weight of 0)."""
    return numerics.softmax(validation.check_log_values(logits, "logits"), axis=-1)


def _check_softplus_values(y):
    y = validation.as_float_array(y, "y")
    if np.any(y <= 0):
        raise ValueError(f"y: softplus takes only positive values, got minimum {np.min(y)}")
    return y


def _check_raw_from_variances(variances, min_variance):
    variances = validation.as_float_array(variances, "variances")
    min_variance = validation.check_positive_float(min_variance, "min_variance")
    if np.any(variances <= min_variance):
        raise ValueError(
            f"variances: expected values > min_variance = {min_variance}, got minimum {np.min(variances)}"
        )
    return variances, min_variance


# ---------------------------------------------------------------------------
# Cores: the log-joint, exact to rounding where the posterior is decided
# ---------------------------------------------------------------------------


class _Expansion(NamedTuple):
    """What every block of rows needs from the mixture, computed once per call."""

    means: np.ndarray  # (K, d)
    precisions: np.ndarray  # (K, d): p = 1 / sigma^2
    centre: np.ndarray  # (d,): the mean of the means
    neg_half_precisions: np.ndarray  # (d, K): -p^T / 2
    cross: np.ndarray  # (d, K): (mc p)^T
    sq_mu: np.ndarray  # (K,): zeta_k = sum_j mc_kj^2 p_kj
    log_norm: np.ndarray  # (K,): log pi_k - (d/2) log 2 pi - (1/2) sum_j log sigma_kj^2
    max_precision: np.ndarray  # (d,): max_k p_kj, for the screen
    root_max_sq_mu: np.floating  # sqrt(max_k zeta_k), for the screen
    kappa: np.floating  # (4 + sqrt(d)) u / 2: a logit's error per unit of M (or of q, evaluated directly)
    tol: np.floating  # EXACT_LOGIT_TOL u
    screen_limit: np.floating  # tol / kappa: the largest M whose error bound is within the tolerance


def _expansion(means, variances, log_weights):
    """The per-call constants of :func:`log_joint` (:class:`_Expansion`)."""
    d = means.shape[1]
    precisions = 1.0 / variances
    # (x - mu)^2 is invariant under a common shift c: centre on the mean of the means
    centre = means.mean(axis=0)
    mc = means - centre
    with np.errstate(over="ignore", invalid="ignore"):
        sq_mu = np.sum(mc * mc * precisions, axis=1)
        cross = np.ascontiguousarray((mc * precisions).T)
    # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
    log_norm = log_weights - 0.5 * (d * LOG_2PI + np.sum(np.log(variances), axis=1))
    dtype = means.dtype
    u = float(np.finfo(dtype).eps)
    # the expanded q_ik carries an error <= (4 + sqrt(d)) u M_ik with M_ik = (sqrt(xi_ik) + sqrt(zeta_k))^2
    # (the size of its terms), the definition one <= (4 + sqrt(d)) u q_ik; a logit carries half of either
    kappa = 0.5 * (4.0 + np.sqrt(d)) * u
    tol = EXACT_LOGIT_TOL * u
    return _Expansion(
        means, precisions, centre, np.ascontiguousarray(-0.5 * precisions.T), cross, sq_mu, log_norm,
        precisions.max(axis=0), np.sqrt(sq_mu.max()), dtype.type(kappa), dtype.type(tol), dtype.type(tol / kappa),
    )


def _block_rows(K: int, d: int, dtype) -> int:
    """Rows per block of :func:`log_joint`: its work arrays hold ``4K + 2d`` numbers a row."""
    return numerics.block_rows((4 * K + 2 * d) * np.dtype(dtype).itemsize)


def _expanded_half_quadratic_form(xb, ex, xc, xc2, half, work, half_sq_mu):
    """``-q_ik / 2`` of one block of rows, ``q_ik = sum_j (x_ij - mu_kj)^2 p_kj``, by two matrix products.

    Written into ``half`` (B, K); ``xc``, ``xc2`` (B, d) and ``work`` (B, K)
    are work arrays (``xc2`` keeps the squares, which the error bound needs),
    ``half_sq_mu`` is ``-zeta / 2`` on every row.  The result is ``-1/2`` times the
    expansion ``(xc^2) p^T - 2 xc (mc p)^T + zeta``, evaluated in that order, bit
    for bit (scaling by a power of two changes no rounding); rounding can
    leave ``q`` slightly below 0, within the error bound of the module
    docstring.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        np.subtract(xb, ex.centre, out=xc)
        np.multiply(xc, xc, out=xc2)
        # -q/2 = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj - zeta_k / 2
        np.matmul(xc2, ex.neg_half_precisions, out=half)
        half += np.matmul(xc, ex.cross, out=work)
        half += half_sq_mu


def _exact_quadratic_form(xb, ex, rows, cols):
    """``q_ik = sum_j (x_ij - mu_kj)^2 p_kj`` for the listed pairs, from the differences themselves."""
    out = np.empty(rows.size, dtype=xb.dtype)
    for s in range(0, rows.size, _EXACT_BLOCK):
        r, c = rows[s : s + _EXACT_BLOCK], cols[s : s + _EXACT_BLOCK]
        # no cancellation: every term is a rounded square of a rounded difference, all >= 0
        with np.errstate(over="ignore", invalid="ignore"):
            diff = xb[r] - ex.means[c]
            out[s : s + _EXACT_BLOCK] = np.sum(diff * diff * ex.precisions[c], axis=1)
    return out


def _entries_to_recompute(logits, half, min_quad, xc2, ex, window):
    """``(rows, cols)`` of the logits that cancellation may have spoiled and that may lie near their row maximum."""
    kappa, tol, ratio = ex.kappa, ex.tol, logits.dtype.type(CANCELLATION_RATIO)
    with np.errstate(over="ignore", invalid="ignore"):
        # screen in O(N d): M_ik <= s_row = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k zeta_k))^2 for every k,
        # and a row is fine where kappa s_row <= tol or s_row <= 16 min_k q_ik
        s_row = np.sqrt(xc2 @ ex.max_precision)
        s_row += ex.root_max_sq_mu
        s_row *= s_row
        if s_row.max() <= ex.screen_limit:  # the common case, decided in one comparison (NaN fails it)
            return np.empty(0, dtype=np.intp), np.empty(0, dtype=np.intp)
        fine = s_row <= np.maximum(ex.screen_limit, ratio * min_quad)
    suspect = np.flatnonzero(~fine)  # NaN counts as suspect
    if suspect.size == 0:
        return suspect, suspect
    lg = logits[suspect]
    with np.errstate(over="ignore", invalid="ignore"):
        sq_x = xc2[suspect] @ ex.precisions.T  # xi_ik = sum_j xc_ij^2 p_kj
        size = (np.sqrt(sq_x) + np.sqrt(ex.sq_mu)) ** 2
        err = kappa * size
        known = np.isfinite(lg) & np.isfinite(err)
        # the row maximum is at least max_j (l_ij - err_ij) over the entries the bound vouches for
        floor = np.max(np.where(known, lg - err, -np.inf), axis=1, keepdims=True)
        # an entry below floor - window stays below it, exactly and as computed: its weight is < e^-window
        near = lg + err >= floor - window
        spoiled = (err > tol) & (size > ratio * (-2 * half[suspect]))
    redo = ~known | (spoiled & near)
    r, c = np.nonzero(redo)
    return suspect[r], c


def _block_log_joint(xb, ex, window, refine, work, logits):
    """The logits of one block of rows into ``logits`` (B, K); returns the block's ``min_quad``.

    ``work`` holds the block's work arrays (:func:`_work_arrays`); its
    ``norm`` is ``log_norm`` on every row, so that adding it is one flat loop
    over the block instead of one loop per row.
    """
    n = xb.shape[0]
    xc, xc2, half, tmp = work.xc[:n], work.xc2[:n], work.half[:n], work.tmp[:n]
    _expanded_half_quadratic_form(xb, ex, xc, xc2, half, tmp, work.half_sq_mu[:n])
    # min_k q_ik = -2 max_k (-q_ik / 2), the maximum by argmax (vectorised along rows; max is not)
    min_quad = -2 * half[np.arange(n), np.argmax(half, axis=1)]
    # l_ik = log_norm_k - q_ik / 2
    np.add(half, work.norm[:n], out=logits)
    if refine:
        rows, cols = _entries_to_recompute(logits, half, min_quad, xc2, ex, window)
        if rows.size:
            exact = _exact_quadratic_form(xb, ex, rows, cols)
            half[rows, cols] = -0.5 * exact
            logits[rows, cols] = ex.log_norm[cols] - 0.5 * exact
            redone = np.unique(rows)
            min_quad[redone] = -2 * np.max(half[redone], axis=1)
    return min_quad


class _WorkArrays(NamedTuple):
    """The work arrays of one block of rows, allocated once per call and reused by every block."""

    xc: np.ndarray  # (B, d)
    xc2: np.ndarray  # (B, d)
    half: np.ndarray  # (B, K)
    tmp: np.ndarray  # (B, K)
    half_sq_mu: np.ndarray  # (B, K): -zeta / 2 on every row
    norm: np.ndarray  # (B, K): log_norm on every row


def _work_arrays(ex, rows, dtype):
    d, K = ex.cross.shape
    return _WorkArrays(
        np.empty((rows, d), dtype), np.empty((rows, d), dtype), np.empty((rows, K), dtype), np.empty((rows, K), dtype),
        np.tile(-0.5 * ex.sq_mu, (rows, 1)), np.tile(ex.log_norm, (rows, 1)),
    )


def _blocked_log_joint(x, means, variances, log_weights, window, refine, finish, block_rows):
    """Core loop: the logits of ``block_rows`` rows at a time, each block then passed to ``finish`` in place.

    The ``N x K`` result is the only array of that size: the block's work
    arrays are reused, so they stay in cache, and ``finish`` (a row-wise
    softmax, say) reads the logits while they are still there.
    """
    n, d = x.shape
    K = means.shape[0]
    ex = _expansion(means, variances, log_weights)
    rows = max(1, min(n, block_rows or _block_rows(K, d, x.dtype)))
    work = _work_arrays(ex, rows, x.dtype)
    out = np.empty((n, K), dtype=x.dtype)
    min_quad = np.empty(n, dtype=x.dtype)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        min_quad[a:b] = _block_log_joint(x[a:b], ex, window, refine, work, out[a:b])
        if finish is not None:
            finish(out[a:b])
    return out, min_quad


def log_joint(x, means, variances, log_weights, *, window=np.inf, refine=True, block_rows=None):
    """Core: ``l_ik = log pi_k + log N(x_i | mu_k, diag sigma_k^2)``, exact to rounding where it matters.

    No validation (the caller checked the arrays, one float dtype) and no
    raise: the caller checks the returned ``min_quad``
    (:func:`refimpl.validation.check_scaled_distances`).  Computed
    ``block_rows`` rows at a time, so that the ``N x K`` work arrays stay in
    cache; the blocking can change only the order in which BLAS adds the
    terms of a matrix product, hence the rounding, within the error model of
    the module docstring.

    Parameters
    ----------
    x : ndarray, shape (N, d)
    means, variances : ndarray, shape (K, d)
    log_weights : ndarray, shape (K,)
        ``log pi``; ``-inf`` for a component of weight 0.
    window : float, default inf
        A logit that cancellation may have spoiled (its error bound above
        ``EXACT_LOGIT_TOL * u`` and the expansion's terms more than
        ``CANCELLATION_RATIO`` times the result) is recomputed from the
        differences ``x - mu`` if it may lie within ``window`` of its row
        maximum.  ``inf`` makes every logit accurate (log-densities); a
        posterior needs only those whose weight can exceed ``e^-window``
        (:func:`log_posterior`).
    refine : bool, default True
        ``False`` returns the plain centred expansion, unchecked: for lessons
        and benchmarks that show what the refinement repairs and what it costs.
    block_rows : int, optional
        Rows per block (>= 1); by default as many as keep the block's work
        arrays near 2 MiB, within a core's L2 cache.

    Returns
    -------
    logits : ndarray, shape (N, K)
    min_quad : ndarray, shape (N,)
        ``min_k sum_j (x_ij - mu_kj)^2 / sigma_kj^2``: not finite for a row
        without a representable posterior.
    """
    return _blocked_log_joint(x, means, variances, log_weights, window, refine, None, block_rows)


def _posterior_window(K: int, dtype) -> float:
    """Logits more than ``log(K / (EXACT_LOGIT_TOL u))`` below the row maximum carry total weight < ``EXACT_LOGIT_TOL u``."""
    return float(np.log(K / (EXACT_LOGIT_TOL * np.finfo(dtype).eps)))


def log_posterior(x, means, variances, log_weights, *, refine=True, block_rows=None):
    """Core: ``log gamma_ik = l_ik - logsumexp_m l_im`` (per-row maximum subtracted), and ``min_quad``.

    :func:`log_joint` with the window of a posterior: every logit that can
    carry a weight above ``EXACT_LOGIT_TOL u`` is exact to rounding.  Each
    block of rows is normalised while it is in cache.  No validation, no
    raise: the caller checks ``min_quad``.  ``refine`` and ``block_rows``
    are those of :func:`log_joint`.

    Returns
    -------
    log_gamma : ndarray, shape (N, K)
    min_quad : ndarray, shape (N,)
    """
    window = _posterior_window(means.shape[0], x.dtype)
    return _blocked_log_joint(x, means, variances, log_weights, window, refine, _log_softmax_rows, block_rows)


def posterior(x, means, variances, log_weights, *, refine=True, block_rows=None):
    """Core: ``gamma_ik = exp(l_ik - logsumexp_m l_im)``, one exponential per entry, and ``min_quad``.

    The same logits as :func:`log_posterior`, normalised by a softmax (per-row
    maximum subtracted) instead of a log-softmax: ``exp`` runs once per entry,
    where ``exp(log_posterior(...))`` would run it twice.  No validation, no
    raise: the caller checks ``min_quad``.  ``refine`` and ``block_rows``
    are those of :func:`log_joint`.

    Returns
    -------
    gamma : ndarray, shape (N, K)
        Rows that sum to one.
    min_quad : ndarray, shape (N,)
    """
    window = _posterior_window(means.shape[0], x.dtype)
    return _blocked_log_joint(x, means, variances, log_weights, window, refine, _softmax_rows, block_rows)


def _log_softmax_rows(block):
    numerics.log_softmax(block, axis=1, out=block)


def _softmax_rows(block):
    numerics.softmax(block, axis=1, out=block)


def _log_weights(weights):
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        return np.log(weights)


def _checked_log_posterior(x, means, variances, weights):
    """:func:`log_posterior` of checked arrays, and the boundary's check of the ``min_quad`` it returns."""
    log_gamma, min_quad = log_posterior(x, means, variances, _log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    return log_gamma


def _checked_posterior(x, means, variances, weights):
    """:func:`posterior` of checked arrays, and the boundary's check of the ``min_quad`` it returns."""
    gamma, min_quad = posterior(x, means, variances, _log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    return gamma


def _checked_log_likelihood(x, means, variances, weights):
    """``log sum_k pi_k N(x_i | mu_k, sigma_k^2)`` of checked arrays, with the boundary's check."""
    logits, min_quad = log_joint(x, means, variances, _log_weights(weights), window=_posterior_window(means.shape[0], x.dtype))
    validation.check_scaled_distances(min_quad, "x")
    return numerics.logsumexp(logits, axis=1)


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
        constant, computed with matrix products (no ``N x K x d`` tensor) and
        recomputed from the differences where the expansion could be off.
    """
    x, means, variances, _ = validation.check_gmm(x, means, variances)
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
    return _checked_log_posterior(*validation.check_gmm(x, means, variances, weights))


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N, K)
        Nonnegative rows that sum to one.
    """
    return _checked_posterior(*validation.check_gmm(x, means, variances, weights))


def log_likelihood(x, means, variances, weights):
    """Per-point log-likelihood ``log sum_k pi_k N(x_i | mu_k, sigma_k^2)``.

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray, shape (N,)
    """
    return _checked_log_likelihood(*validation.check_gmm(x, means, variances, weights))


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
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    reg_covar = validation.check_positive_float(reg_covar, "reg_covar", allow_zero=True)
    # E-step: r_ik = gamma_k(x_i)
    return _m_step(x, _checked_posterior(x, means, variances, weights), reg_covar)


def _m_step(x, resp, reg_covar):
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


def _check_isotropic(x, means, beta, weights):
    x = validation.as_float_array(x, "x", ndim=2)
    means = validation.as_float_array(means, "means", ndim=2)
    validation.check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    validation.check_nonempty(means, "means")
    beta = validation.check_positive_float(beta, "beta")
    K = means.shape[0]
    if weights is None:
        dtype = validation.common_float_dtype(x, means)
        weights = np.full(K, 1.0 / K, dtype=dtype)
    else:
        weights = validation.check_weights(weights, K)
        dtype = validation.common_float_dtype(x, means, weights)
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
    return float(-np.sum(_checked_log_likelihood(*_check_isotropic(x, means, beta, weights))))


def isotropic_nll_gradient(x, means, beta, weights=None):
    """Gradient of :func:`isotropic_nll` with respect to the means.

    Returns
    -------
    ndarray, shape (K, d)
        ``-beta * sum_i r_in (x_i - mu_n)``, with ``r`` the responsibilities
        at ``means`` (exact: the derivative of the log-sum-exp is the softmax).
    """
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _checked_posterior(x, means, variances, weights)  # r_in at the current means
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
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _checked_posterior(x, means, variances, weights)  # r_in at the current means
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
    x, means, variances, weights = _check_isotropic(x, means, beta, weights)
    resp = _checked_posterior(x, means, variances, weights)  # r_in at the current means
    return (resp.T @ x) / resp.sum(axis=0)[:, None]


def _check_points_and_means(x, means):
    x = validation.as_float_array(x, "x", ndim=2)
    means = validation.as_float_array(means, "means", ndim=2)
    validation.check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    validation.check_nonempty(means, "means")
    dtype = validation.common_float_dtype(x, means)
    return x.astype(dtype, copy=False), means.astype(dtype, copy=False)


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
    return _nearest_means(*_check_points_and_means(x, means))


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
    x, means = _check_points_and_means(x, means)
    zeros = np.zeros(means.shape[0], dtype=x.dtype)
    return merge_running_means(means, zeros, x, _nearest_means(x, means))[0]


def _check_running_mean(means, counts, x, assignments):
    means = validation.as_float_array(means, "means", ndim=2)
    x = validation.as_float_array(x, "x", ndim=2)
    validation.check_shape(x, "x", (None, means.shape[1]), ("B", "d"))
    counts = validation.check_counts(counts, "counts", (means.shape[0],), ("K",))
    assignments = np.asarray(assignments)
    if not np.issubdtype(assignments.dtype, np.integer):
        raise TypeError(f"assignments: expected integers, got dtype {assignments.dtype}")
    validation.check_shape(assignments, "assignments", (x.shape[0],), ("B",))
    if assignments.size and (assignments.min() < 0 or assignments.max() >= means.shape[0]):
        raise ValueError(
            f"assignments: expected indices in [0, {means.shape[0]}), got range "
            f"[{assignments.min()}, {assignments.max()}]"
        )
    dtype = validation.common_float_dtype(means, x)
    return means.astype(dtype, copy=False), counts, x.astype(dtype, copy=False), assignments


def merge_running_means(means, counts, x, assignments):
    """Core of :func:`running_mean_update`: no validation, no raise (``means`` and ``x`` of one dtype)."""
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
    reproducible bit for bit.
    """
    return merge_running_means(*_check_running_mean(means, counts, x, assignments))
