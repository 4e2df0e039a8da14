r"""The tuned NumPy path: the reference's GMM and GMA functions, computed the fast way.

Why this module exists
----------------------
:mod:`refimpl.gmm` and :mod:`refimpl.gma` are written to be read against the
derivations: the responsibilities come from the differences :math:`x - \mu`,
an ``N x K x d`` computation in row blocks, and every step is one plain NumPy
line.  That is the definition, exact by construction, and about
:math:`d` times the work of a matrix product.  Training and the experiments
need the same numbers faster, so this module computes them the way NumPy is
fast, with the same arguments, the same errors and results equal to
rounding:

* **the expansion of the square**: the quadratic form
  :math:`q_{ik} = \sum_j (x_{ij} - \mu_{kj})^2 / \sigma^2_{kj}` of all
  ``N x K`` pairs from two matrix products, on :math:`x` and :math:`\mu`
  centred on the mean of the means,
  :math:`q = (\tilde x^2) p^\top - 2\tilde x(\tilde\mu p)^\top + \zeta`;
* **the cancellation screen and its refinement**: the expansion carries an
  error of about :math:`(4+\sqrt d)\,u\,M_{ik}/2` per logit, with
  :math:`M_{ik}` the size of its terms; an ``O(N d)`` screen clears the rows
  where that cannot matter, and every logit that cancellation may have spoiled
  and that may lie near its row maximum is recomputed from the differences
  (``gmm_posteriors.md#exact-responsibilities-for-every-input``), so the
  result is as accurate as the definition for every input;
* **cache-sized blocks**: rows in blocks of about :data:`refimpl.numerics.BLOCK_BYTES`
  of work arrays, reused from block to block (``out=``), each block's softmax
  taken while it is in cache, with one ``exp`` per entry;
* **reduction tricks**: the row maximum as an argmax and a gather (NumPy's
  argmax along contiguous rows is vectorised, its max reduction is not: 4x
  at K = 64), row sums as a matrix-vector product (3x), the softmax in place;
* **the backward through the responsibilities as matrix products** on
  centred data, accumulated block by block.

What it is measured against: ``benchmarks/bench_cpu.py`` times it beside the
floor of its own two matrix products, scikit-learn's ``predict_proba`` and
the plain reference (``docs/performance_gmm.md``, ``docs/performance_gma.md``).
:mod:`gpu.cupy_kernels` computes the responsibilities by the same expansion
and uses the screen written here (its functions take the array module
``xp``); lesson 1 shows what the screen repairs.

Public functions: :func:`log_responsibilities`, :func:`responsibilities`,
:func:`log_likelihood`, :func:`em_step`, :func:`gma`, :func:`gma_forward`,
:func:`gma_backward`, each the function of the same name in
:mod:`refimpl.gmm` or :mod:`refimpl.gma`; :func:`streamed_em_step`, the
same EM step a block of rows at a time (memory ``O(block K)``, no ``N x K``
matrix), with its variances screened for cancellation and refined from the
differences; :func:`log_joint` with ``refine=False`` is the bare expansion,
for lessons and benchmarks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import boundary, gmm, numerics, validation

__all__ = [
    "EXACT_LOGIT_TOL",
    "CANCELLATION_RATIO",
    "row_max",
    "row_sums",
    "softmax_rows",
    "log_softmax_rows",
    "logit_error_scale",
    "posterior_window",
    "row_size_bound",
    "suspect_rows",
    "spoiled_logits",
    "exact_quadratic_form",
    "log_joint",
    "posterior",
    "log_responsibilities",
    "responsibilities",
    "log_likelihood",
    "em_step",
    "STREAM_BLOCK_BYTES",
    "STREAM_KEPT_PER_ROW",
    "streamed_em_step",
    "gma",
    "gma_forward",
    "gma_backward",
]

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
# Row reductions, tuned
# ---------------------------------------------------------------------------


def row_max(a):
    """Core: :func:`refimpl.numerics.row_max` of the rows of a 2-D array (``(N, 1)``), by argmax and gather.

    NumPy's argmax along contiguous rows is vectorised and its max reduction
    is not (4x faster at K = 64); both take the first NaN, so the value is the
    same.
    """
    m = a[np.arange(a.shape[0]), np.argmax(a, axis=1)][:, None]
    return np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)


def row_sums(a):
    """Core: ``a.sum(axis=1)`` of a 2-D array as ``(N, 1)``, by a matrix-vector product.

    ``a @ 1`` runs in BLAS at memory speed, where NumPy's reduction along
    short rows loops row by row (3x slower at K = 64).  The two differ only in
    the order of the additions.
    """
    return (a @ np.ones(a.shape[1], dtype=a.dtype))[:, None]


def softmax_rows(a):
    """Core: the softmax of every row of the 2-D array ``a``, in place (``a`` is returned).

    One exponential per entry and no temporary of the size of ``a``; a row of
    all ``-inf`` gives NaN, as :func:`refimpl.numerics.softmax` does.
    """
    # softmax(a) = softmax(a - m): the largest term is exp(0) = 1, the sum is in [1, K]
    with np.errstate(over="ignore"):
        np.subtract(a, row_max(a), out=a)
    np.exp(a, out=a)
    # one division per row, then a multiplication per entry (a / s costs twice a * (1/s) per entry)
    # a row of zeros (all -inf: refused by the callers) gives 0 * inf = NaN, as 0 / 0 would
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = 1 / row_sums(a)
        a *= scale
    return a


def log_softmax_rows(a):
    """Core: the log-softmax of every row of the 2-D array ``a``, in place (``a`` is returned)."""
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0; a row of all -inf (refused by the
    # callers) gives -inf - (-inf) = NaN
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        np.subtract(a, row_max(a), out=a)
        a -= np.log(row_sums(np.exp(a)))
    return a


# ---------------------------------------------------------------------------
# The screen, written for an array module xp (NumPy here, CuPy in gpu.cupy_kernels)
# ---------------------------------------------------------------------------


def logit_error_scale(n_terms: int, dtype):
    """``kappa = (4 + sqrt(n_terms)) u / 2``: a logit's rounding error per unit of the size of its terms.

    A matrix product that adds ``n_terms`` terms of total size ``M`` is off by
    at most about ``(4 + sqrt(n_terms)) u M``, and a logit is ``-q / 2``.
    The two products of :func:`log_joint` add ``d`` terms each; the single
    product ``[x^2, x] @ W`` of :mod:`gpu.cupy_kernels` adds ``2 d``.
    """
    return np.dtype(dtype).type(0.5 * (4.0 + np.sqrt(n_terms)) * np.finfo(dtype).eps)


def posterior_window(K: int, dtype) -> float:
    """Logits more than ``log(K / (EXACT_LOGIT_TOL u))`` below the row maximum carry total weight < ``EXACT_LOGIT_TOL u``."""
    return float(np.log(K / (EXACT_LOGIT_TOL * np.finfo(dtype).eps)))


def row_size_bound(xp, xc2, max_precision, root_max_sq_mu):
    """Core: ``s_i = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k zeta_k))^2 >= M_ik`` for every ``k``, in ``O(N d)``.

    ``xc2`` (N, d) holds the squares of the centred points, ``max_precision``
    (d,) the largest precision of each coordinate.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        # M_ik = (sqrt(xi_ik) + sqrt(zeta_k))^2 with xi_ik = sum_j xc_ij^2 p_kj <= sum_j xc_ij^2 max_k p_kj
        s = xp.sqrt(xc2 @ max_precision)
        s += root_max_sq_mu
        s *= s
    return s


def suspect_rows(xp, s_row, min_quad, screen_limit):
    """Core: the rows the screen cannot clear: neither ``s_i <= screen_limit`` nor ``s_i <= 16 min_k q_ik``.

    ``screen_limit = EXACT_LOGIT_TOL u / kappa`` is the largest size whose
    error bound is within the tolerance; where ``s_i <= 16 min_k q_ik`` the
    expansion is within 16 times the definition's own error.  NaN is suspect.
    """
    with np.errstate(invalid="ignore"):
        fine = s_row <= xp.maximum(screen_limit, s_row.dtype.type(CANCELLATION_RATIO) * min_quad)
    return ~fine


def spoiled_logits(xp, logits, half, sq_x, sq_mu, kappa, window):
    """Core: the entries of suspect rows to recompute from the differences, as a boolean mask (S, K).

    ``logits`` and ``half = -q / 2`` (S, K) as the expansion computed them,
    ``sq_x`` (S, K) the ``xi_ik = sum_j xc_ij^2 p_kj`` of these rows and
    ``sq_mu`` (K,) the ``zeta_k``.  An entry is recomputed when its error bound
    ``kappa M_ik`` exceeds the tolerance, its terms exceed the form 16 times,
    and it may lie within ``window`` of its row maximum; or when the bound
    cannot vouch for it (not finite).
    """
    dtype = logits.dtype
    tol = dtype.type(EXACT_LOGIT_TOL * np.finfo(dtype).eps)
    with np.errstate(over="ignore", invalid="ignore"):
        size = (xp.sqrt(sq_x) + xp.sqrt(sq_mu)) ** 2
        err = kappa * size
        known = xp.isfinite(logits) & xp.isfinite(err)
        # the row maximum is at least max_j (l_ij - err_ij) over the entries the bound vouches for
        floor = xp.max(xp.where(known, logits - err, -xp.inf), axis=1, keepdims=True)
        # an entry below floor - window stays below it, exactly and as computed: its weight is < e^-window
        near = logits + err >= floor - window
        spoiled = (err > tol) & (size > dtype.type(CANCELLATION_RATIO) * (-2 * half))
    return ~known | (spoiled & near)


def exact_quadratic_form(xp, x, means, precisions, rows, cols, block=_EXACT_BLOCK):
    """Core: ``q_ik = sum_j (x_ij - mu_kj)^2 p_kj`` for the listed pairs ``(rows[s], cols[s])``, from the differences."""
    out = xp.empty(rows.size, dtype=x.dtype)
    for s in range(0, rows.size, block):
        r, c = rows[s : s + block], cols[s : s + block]
        # no cancellation: every term is a rounded square of a rounded difference, all >= 0
        with np.errstate(over="ignore", invalid="ignore"):
            diff = x[r] - means[c]
            out[s : s + block] = xp.sum(diff * diff * precisions[c], axis=1)
    return out


# ---------------------------------------------------------------------------
# The log joint by the expansion, in cache-sized blocks
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
    kappa: np.floating  # (4 + sqrt(d)) u / 2
    screen_limit: np.floating  # EXACT_LOGIT_TOL u / kappa


def _expansion(means, variances, log_weights):
    d = means.shape[1]
    dtype = means.dtype
    precisions = 1.0 / variances
    # (x - mu)^2 is invariant under a common shift c: centre on the mean of the means
    centre = means.mean(axis=0)
    mc = means - centre
    with np.errstate(over="ignore", invalid="ignore"):
        sq_mu = np.sum(mc * mc * precisions, axis=1)
        cross = np.ascontiguousarray((mc * precisions).T)
    # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
    log_norm = log_weights - 0.5 * (d * gmm.LOG_2PI + np.sum(np.log(variances), axis=1))
    kappa = logit_error_scale(d, dtype)
    return _Expansion(
        means, precisions, centre, np.ascontiguousarray(-0.5 * precisions.T), cross, sq_mu, log_norm,
        precisions.max(axis=0), np.sqrt(sq_mu.max()), kappa,
        dtype.type(EXACT_LOGIT_TOL * np.finfo(dtype).eps / kappa),
    )


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


def _block_log_joint(xb, ex, window, refine, work, logits):
    """The logits of one block of rows into ``logits`` (B, K); returns the block's ``min_quad``.

    ``-q / 2`` is ``-1/2`` times the expansion ``(xc^2) p^T - 2 xc (mc p)^T +
    zeta``, evaluated in that order, bit for bit (scaling by a power of two
    changes no rounding); rounding can leave ``q`` slightly below 0, within
    the error bound of the module docstring.
    """
    n = xb.shape[0]
    xc, xc2, half, tmp = work.xc[:n], work.xc2[:n], work.half[:n], work.tmp[:n]
    with np.errstate(over="ignore", invalid="ignore"):
        np.subtract(xb, ex.centre, out=xc)
        np.multiply(xc, xc, out=xc2)
        # -q/2 = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj - zeta_k / 2
        np.matmul(xc2, ex.neg_half_precisions, out=half)
        half += np.matmul(xc, ex.cross, out=tmp)
        half += work.half_sq_mu[:n]
    # min_k q_ik = -2 max_k (-q_ik / 2)
    min_quad = -2 * half[np.arange(n), np.argmax(half, axis=1)]
    # l_ik = log_norm_k - q_ik / 2
    np.add(half, work.norm[:n], out=logits)
    if not refine:
        return min_quad
    s_row = row_size_bound(np, xc2, ex.max_precision, ex.root_max_sq_mu)
    if s_row.max() <= ex.screen_limit:  # the common case, decided in one comparison (NaN fails it)
        return min_quad
    suspect = np.flatnonzero(suspect_rows(np, s_row, min_quad, ex.screen_limit))
    if suspect.size == 0:
        return min_quad
    with np.errstate(over="ignore", invalid="ignore"):
        sq_x = xc2[suspect] @ ex.precisions.T  # xi_ik = sum_j xc_ij^2 p_kj
    r, c = np.nonzero(spoiled_logits(np, logits[suspect], half[suspect], sq_x, ex.sq_mu, ex.kappa, window))
    rows = suspect[r]
    if rows.size:
        exact = exact_quadratic_form(np, xb, ex.means, ex.precisions, rows, c)
        half[rows, c] = -0.5 * exact
        logits[rows, c] = ex.log_norm[c] - 0.5 * exact
        redone = np.unique(rows)
        min_quad[redone] = -2 * np.max(half[redone], axis=1)
    return min_quad


def _blocked_log_joint(x, means, variances, log_weights, window, refine, finish, block_rows):
    """The logits of ``block_rows`` rows at a time, each block then passed to ``finish`` in place.

    The ``N x K`` result is the only array of that size: the block's work
    arrays are reused, so they stay in cache, and ``finish`` (a row-wise
    softmax, say) reads the logits while they are still there.
    """
    n, d = x.shape
    K = means.shape[0]
    ex = _expansion(means, variances, log_weights)
    # the work arrays hold 4K + 2d numbers a row
    rows = max(1, min(n, block_rows or numerics.block_rows((4 * K + 2 * d) * x.dtype.itemsize)))
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
    """Core: :func:`refimpl.gmm.log_joint` by the expansion of the square, exact to rounding where it matters.

    No validation and no raise: the caller checks the returned ``min_quad``.

    Parameters
    ----------
    x, means, variances, log_weights : ndarray
        Those of :func:`refimpl.gmm.log_joint`: ``(N, d)``, ``(K, d)``,
        ``(K, d)`` and ``(K,)``, checked, of one float dtype.
    window : float, default inf
        A logit that cancellation may have spoiled is recomputed from the
        differences ``x - mu`` if it may lie within ``window`` of its row
        maximum.  ``inf`` makes every logit accurate (log-densities); a
        posterior needs only those whose weight can exceed ``e^-window``
        (:func:`posterior_window`).
    refine : bool, default True
        ``False`` returns the plain centred expansion, unchecked: for lessons
        and benchmarks that show what the refinement repairs and what it costs.
    block_rows : int, optional
        Rows per block (>= 1); by default as many as keep the block's work
        arrays near 2 MiB, within a core's L2 cache.  The blocking can change
        only the order in which BLAS adds the terms of a product.

    Returns
    -------
    logits : ndarray, shape (N, K)
    min_quad : ndarray, shape (N,)
        ``min_k sum_j (x_ij - mu_kj)^2 / sigma_kj^2``: not finite for a row
        without a representable posterior.
    """
    return _blocked_log_joint(x, means, variances, log_weights, window, refine, None, block_rows)


def posterior(x, means, variances, log_weights, *, log=False, refine=True, block_rows=None):
    """Core: ``(gamma, min_quad)`` (``log gamma`` with ``log``) of checked arrays; no raise, the caller checks ``min_quad``.

    :func:`log_joint` with the window of a posterior (every logit that can
    carry a weight above ``EXACT_LOGIT_TOL u`` exact to rounding), each block
    of rows normalised while it is in cache, one ``exp`` per entry.
    ``refine`` and ``block_rows`` are those of :func:`log_joint`.
    """
    window = posterior_window(means.shape[0], x.dtype)
    return _blocked_log_joint(x, means, variances, log_weights, window, refine, log_softmax_rows if log else softmax_rows, block_rows)


def log_likelihood(x, means, variances, weights):
    """:func:`refimpl.gmm.log_likelihood`, by the expansion: ``log sum_k pi_k N(x_i | mu_k, sigma_k^2)``, shape (N,)."""
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    logits, min_quad = log_joint(x, means, variances, numerics.log_weights(weights), window=posterior_window(means.shape[0], x.dtype))
    validation.check_scaled_distances(min_quad, "x")
    return numerics.logsumexp(logits, axis=1)


def em_step(x, means, variances, weights, *, reg_covar: float = 0.0):
    """:func:`refimpl.gmm.em_step` with the E-step by the expansion: ``(means, variances, weights)``."""
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    reg_covar = validation.check_positive_float(reg_covar, "reg_covar", allow_zero=True)
    # E-step: r_ik = gamma_k(x_i)
    resp, min_quad = posterior(x, means, variances, numerics.log_weights(weights))
    validation.check_scaled_distances(min_quad, "x")
    return gmm.m_step(x, resp, reg_covar)


# ---------------------------------------------------------------------------
# GMA with the tuned responsibilities and their blocked backward
# ---------------------------------------------------------------------------


def _responsibility_backward(x, gamma, grad_gamma, means, variances):
    """Push ``dL/dgamma`` (N, K) through ``gamma = softmax(l(x))``: ``(dx, dmeans, dvariances, dlogits)``.

    The sums of ``gma.md#backward-through-the-responsibilities`` as the matrix
    products of ``gma.md#parameter-gradients-as-matrix-products``, on ``x``
    and the means centred on the mean of the means, a block of rows at a time:
    the ``N x K`` and ``N x d_r`` intermediates of a block stay in cache, and
    the sums over the rows are accumulated block by block.
    """
    n, d = x.shape
    dtype = x.dtype
    # x - mu is invariant under the common shift by the centre of the means
    centre = means.mean(axis=0)
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
        gbar = row_sums(gam * grad)
        c = grad - gbar
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


#: This module as a backend: the tuned posterior and its blocked backward, the reference's scan and batch rule.
BACKEND = boundary.Backend(
    "refimpl.tuned",
    "Computed the fast way: the square expanded with its cancellation screen, cache-sized blocks, reductions as "
    "matrix products.",
    boundary.host_kernels(posterior, _responsibility_backward),
)

_public = boundary.bind(BACKEND, module=__name__)
responsibilities = _public.responsibilities
log_responsibilities = _public.log_responsibilities
gma = _public.gma
gma_forward = _public.gma_forward
gma_backward = _public.gma_backward


# ---------------------------------------------------------------------------
# EM streamed a block of rows at a time
# ---------------------------------------------------------------------------

#: Default size of the block of responsibilities :func:`streamed_em_step` holds at a time, in bytes (32 MiB).
STREAM_BLOCK_BYTES = 1 << 25

#: :func:`streamed_em_step` keeps at most this many responsibilities per row (on average) for its refinement.
STREAM_KEPT_PER_ROW = 16

_tuned_posterior = posterior  # the default E-step of streamed_em_step, whose argument of that name shadows it


def _second_pass(x, means, variances, log_w, lse, rows, cols, R, low, tol, centres, first, second):
    """Core: the exact centred sums of the components ``cols`` from a second pass over the rows, into ``first``, ``second``.

    Only the logits of those components are computed (:func:`log_joint`),
    their responsibilities as ``exp(l_ik - L_i)`` with the first pass's
    log-normalisers ``lse``; those below ``theta_k`` are left out, with
    ``theta_k R_kj N <= tol low_kj / 2``.
    """
    n = x.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.where(R > 0, tol * low / (2 * n * R), np.inf).min(axis=1)
    thresholds = theta.astype(x.dtype)  # rounded down or up: the bound keeps a factor 2 of margin
    window = posterior_window(means.shape[0], x.dtype)
    for a in range(0, n, rows):
        xb = x[a : a + rows]
        # r_ik = exp(l_ik - L_i) for these components only
        logits, _ = log_joint(xb, means[cols], variances[cols], log_w[cols], window=window)
        sub = np.exp(logits - lse[a : a + rows, None])
        # the entries at or above their threshold, sorted by component (nonzero of the transpose)
        c, r = np.nonzero(((sub > 0) & (sub >= thresholds)).T)
        _pair_sums(xb, r, cols[c], sub[r, c], centres, first, second)


def _pair_sums(x, rows, comps, gamma, centres, first, second, block=_EXACT_BLOCK):
    """Core: ``first[k] += sum gamma (x_i - c_k)``, ``second[k] += sum gamma (x_i - c_k)^2`` over the pairs ``(rows, comps)``.

    The pairs are sorted by component, ``gamma`` holds their
    responsibilities, ``centres`` (K, d) the ``c_k``; ``first`` and
    ``second`` (K, d) are float64.  From the differences: nothing cancels.
    """
    for s in range(0, rows.size, block):
        rs, cs = rows[s : s + block], comps[s : s + block]
        # every term is a weight times the rounded square of a rounded difference
        diff = x[rs].astype(np.float64) - centres[cs]
        weighted = diff * gamma[s : s + block, None]
        starts = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])  # each component's pairs are one contiguous run
        first[cs[starts]] += np.add.reduceat(weighted, starts, axis=0)
        weighted *= diff
        second[cs[starts]] += np.add.reduceat(weighted, starts, axis=0)


class _FirstPass(NamedTuple):
    """What the first pass over the blocks leaves: the M-step's sums about the data mean, and what a refinement needs."""

    centre: np.ndarray  # (d,): c, the mean of the data
    g: np.ndarray  # (K,): g_k = sum_i r_ik, float64
    s: np.ndarray  # (K, d): s_k = sum_i r_ik xc_i, float64
    t: np.ndarray  # (K, d): t_k = sum_i r_ik xc_i^2, float64
    min_quad: np.ndarray  # (N,): the E-step's min_k q_ik, for the caller's check
    lse: np.ndarray  # (N,): L_i = log sum_k pi_k N(x_i | mu_k, sigma_k^2), float64
    kept: tuple | None  # (rows, comps, r_ik) lists of the pairs with r_ik >= floor; None if they were too many
    dropped: np.ndarray  # (K,): D_k, the sum of the responsibilities below floor, float64


def _first_pass(x, means, variances, log_w, rows, posterior):
    """Core: the first pass, a block of ``rows`` rows at a time: each block's E-step reduced to its sums and dropped.

    Every block adds its ``g_k``, ``s_k``, ``t_k`` (:func:`_add_block_sums`),
    its log-normalisers ``L_i`` (:func:`_block_log_normaliser`) and, while
    they number at most :data:`STREAM_KEPT_PER_ROW` ``N``, its pairs with
    ``r_ik >= EXACT_LOGIT_TOL u / N``; the others are summed into ``D_k``.
    No raise: the caller checks ``min_quad``.
    """
    n, d = x.shape
    K = means.shape[0]
    dtype, f64 = x.dtype, np.float64
    # (x - mu)^2 is invariant under a common shift: the statistics are taken about the mean of the data
    centre = x.mean(axis=0)
    g, s, t = np.zeros(K, f64), np.zeros((K, d), f64), np.zeros((K, d), f64)
    min_quad, lse = np.empty(n, dtype), np.empty(n, f64)
    # the pairs (i, k) with r_ik >= floor are kept while they number at most STREAM_KEPT_PER_ROW N, and the rest summed
    floor, kept, n_kept, dropped = dtype.type(EXACT_LOGIT_TOL * np.finfo(dtype).eps / n), ([], [], []), 0, np.zeros(K, f64)
    # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
    log_norm = log_w - 0.5 * (d * gmm.LOG_2PI + np.sum(np.log(variances), axis=1))
    for a in range(0, n, rows):
        xb = x[a : a + rows]
        # E-step of the block: r_ik = gamma_k(x_i)
        resp, min_quad[a : a + rows] = posterior(xb, means, variances, log_w)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a bad row is refused by the caller
            lse[a : a + rows] = _block_log_normaliser(xb, resp, means, variances, log_norm)
            if kept is not None:
                big = resp >= floor
                r, c = np.nonzero(big)
                n_kept += r.size
                if n_kept > STREAM_KEPT_PER_ROW * n:
                    kept = None  # too many: the components to refine get a second pass instead
                else:
                    kept[0].append(r + a), kept[1].append(c), kept[2].append(resp[r, c].astype(f64))
                    dropped += np.ones(xb.shape[0], dtype) @ np.where(big, 0, resp)
            _add_block_sums(xb - centre, resp, g, s, t)
    return _FirstPass(centre, g, s, t, min_quad, lse, kept, dropped)


def _block_log_normaliser(xb, resp, means, variances, log_norm):
    """Core: ``L_i = l_ik* - log r_ik*`` of a block at its largest responsibility ``r_ik* >= 1/K``, in float64.

    The logit ``l_ik* = log_norm_k* - q_ik* / 2`` comes from the differences
    ``x_i - mu_k*``; ``log_norm`` (K,) holds
    ``log pi_k - (d/2) log 2 pi - (1/2) sum_j log sigma_kj^2``.
    """
    top = np.argmax(resp, axis=1)
    diff = xb.astype(np.float64) - means[top]
    # log r_ik = l_ik - L_i, so L_i = l_ik - log r_ik at any k: at k*, where log r_ik* is the most accurate
    return log_norm[top] - 0.5 * np.sum(diff * diff / variances[top], axis=1) - np.log(resp[np.arange(xb.shape[0]), top])


def _add_block_sums(xc, resp, g, s, t):
    """Core: ``g_k += sum_i r_ik``, ``s_k += sum_i r_ik xc_i``, ``t_k += sum_i r_ik xc_i^2`` over a block, as matrix products.

    ``xc`` (B, d) holds the block's centred rows and is overwritten.
    """
    g += np.ones(xc.shape[0], xc.dtype) @ resp
    s += resp.T @ xc
    xc *= xc
    t += resp.T @ xc


def _expanded_m_step(fp):
    """Core: ``(N_k, mu'_k, m_k, S_k, T_k)``: the M-step from the first pass's sums, by the expansion of the square.

    ``N_k = g_k + 10 u`` (the guard of :func:`refimpl.gmm.m_step`), the new
    means ``mu'_k``, ``m_k = mu'_k - c``, the sums
    ``S_k = sum_i r_ik (x_i - mu'_k)^2`` as the expansion computes them and
    the size ``T_k`` of its terms, for the screen; all float64.
    """
    g, s, t = fp.g, fp.s, fp.t
    nk = g + 10 * np.finfo(fp.centre.dtype).eps
    shift = s / nk[:, None]  # m_k = mu_k - c, up to the guard's share of c
    # mu_k = sum_i r_ik x_i / N_k = (s_k + g_k c) / N_k
    new_means = shift + (g / nk)[:, None] * fp.centre.astype(np.float64)
    m = new_means - fp.centre
    # sum_i r_ik (x_i - mu_k)^2 = t_k - 2 m_k s_k + g_k m_k^2, and the size of its terms
    ms = m * s
    sq = t - 2 * ms + g[:, None] * m * m
    terms = t + 2 * np.abs(ms) + g[:, None] * m * m
    return nk, new_means, m, sq, terms


def _cancellation_screen(sq, terms, g, rows, n_blocks, dtype):
    """Core: ``(refined, err)``: the components whose expanded sums cancellation may have spoiled, and the error bounds.

    A sum is suspect where its terms exceed it :data:`CANCELLATION_RATIO`
    times and its bound ``err = ((4 + sqrt(B)) / 2 u + n_blocks u_64)`` times
    the terms exceeds ``EXACT_LOGIT_TOL u`` of it, or where it is not
    positive; a component without responsibility (``g_k = 0``) is left as it is.
    """
    u = np.finfo(dtype).eps
    # a block's sum of B terms in the dtype is off by (4 + sqrt(B)) / 2 u of their size, each addition of a block by u_64
    kappa = (4 + np.sqrt(rows)) / 2 * u + n_blocks * np.finfo(np.float64).eps
    err = kappa * terms
    suspect = (terms > CANCELLATION_RATIO * sq) & (err > EXACT_LOGIT_TOL * u * sq)
    return np.flatnonzero(np.any(suspect | ~(sq > 0), axis=1) & (g > 0)), err


def _refinement_bounds(x, centre, m, sq, err):
    """Core: ``(R, low)`` of the components to refine: ``R_kj >= (x_ij - mu_kj)^2`` for every row, and ``low <= S_k``.

    ``m`` (C, d) holds their ``mu'_k - c``, ``sq`` and ``err`` (C, d) their
    expanded sums and its error bounds.
    """
    # R_kj >= (x_ij - mu_kj)^2 for every row i
    reach = np.abs(x - centre).max(axis=0).astype(np.float64)
    R = (reach + np.abs(m)) ** 2
    low = np.maximum(sq - err, 0)  # a lower bound on the exact sum
    return R, low


def _kept_pair_sums(x, fp, refined, R, low, tol, centres, first, second):
    """Core: the centred sums of the components the kept pairs suffice for, into ``first``, ``second``; returns which.

    The kept pairs suffice for a component where the responsibilities below
    the floor, ``D_k`` in all, change its sum by at most ``tol / 2`` of it:
    ``D_k R_kj <= tol low_kj / 2``.  ``refined`` lists the components,
    ``R`` and ``low`` (C, d) are their bounds (:func:`_refinement_bounds`).
    """
    # the kept pairs suffice where the responsibilities below floor change the sum by < tol / 2 of it
    enough = np.all(fp.dropped[refined, None] * R <= tol * low / 2, axis=1)
    chosen = np.zeros(fp.g.shape[0], dtype=bool)
    chosen[refined[enough]] = True
    r, c, gam = (np.concatenate(part) for part in fp.kept)
    sel = chosen[c]
    order = np.argsort(c[sel], kind="stable")
    _pair_sums(x, r[sel][order], c[sel][order], gam[sel][order], centres, first, second)
    return enough


def _corrected_two_pass(e, second, g, nk, mean):
    """Core: the corrected two-pass mean and sum ``(mu_k, sum_i r_ik (x_i - mu_k)^2)`` of the components refined.

    ``mean`` (C, d) holds their means ``mu'_k`` computed by the expansion,
    ``e`` and ``second`` (C, d) the sums ``sum_i r_ik (x_i - mu'_k)`` and
    ``sum_i r_ik (x_i - mu'_k)^2`` from the differences; ``g`` and ``nk``
    (C,) their ``g_k`` and ``N_k`` (Chan, Golub and LeVeque, 1983).
    """
    # mu_k = sum_i r_ik x_i / N_k = mu'_k + delta_k, delta_k = (e_k - 10 u mu'_k) / N_k (the guard N_k - g_k = 10 u)
    delta = (e - (nk - g)[:, None] * mean) / nk[:, None]
    # sum_i r_ik (x_i - mu_k)^2 = sum_i r_ik (x_i - mu'_k)^2 - 2 delta_k e_k + g_k delta_k^2
    return mean + delta, np.maximum(second - 2 * delta * e + g[:, None] * delta * delta, 0)


def streamed_em_step(x, means, variances, weights, *, reg_covar: float = 0.0, block_rows=None, posterior=None):
    r""":func:`refimpl.gmm.em_step` a block of rows at a time: memory ``O(block_rows K)``, the same result to rounding.

    Exact EM, streamed: each block's responsibilities are computed, reduced
    to the M-step's sufficient statistics and dropped, so the ``N x K``
    matrix of :func:`em_step` never exists.

    Parameters
    ----------
    x, means, variances, weights, reg_covar
        Those of :func:`refimpl.gmm.em_step`: ``(N, d)``, ``(K, d)``,
        ``(K, d)``, ``(K,)`` and the floor added to every new variance.
    block_rows : int, optional
        Rows per block (>= 1); by default as many as keep a block's
        responsibilities near :data:`STREAM_BLOCK_BYTES`.
    posterior : callable, optional
        ``posterior(x, means, variances, log_weights) -> (gamma, min_quad)``
        on checked arrays, as :func:`posterior` (the default) or
        :func:`cpu.gmm.posterior`, the Numba kernel.

    Returns
    -------
    means : ndarray, shape (K, d)
    variances : ndarray, shape (K, d)
    weights : ndarray, shape (K,)
        In the dtype of the inputs.

    Notes
    -----
    With ``c`` the mean of the data, ``xc = x - c`` and ``r`` a block's
    responsibilities, the blocks add up, in float64,

    .. math::

        g_k = \sum_i r_{ik},\quad s_k = \sum_i r_{ik}\,xc_i,\quad
        t_k = \sum_i r_{ik}\,xc_i^2,

    each as a matrix product.  With :math:`N_k = g_k + 10u` (the guard of
    :func:`refimpl.gmm.m_step`) the new mean is :math:`(s_k + g_k c)/N_k`
    and, with :math:`m_k = \mu_k - c`,
    :math:`\sum_i r_{ik}(x_i - \mu_k)^2 = t_k - 2 m_k s_k + g_k m_k^2`.
    That expansion cancels where its terms are much larger than the result
    (a tight component far from the mean of the data), so it is screened
    as :func:`log_joint` screens the logits: a variance whose terms exceed
    it :data:`CANCELLATION_RATIO` times and whose error bound,
    ``((4 + sqrt(B)) / 2 u + n_blocks u_64)`` times the terms, exceeds
    ``EXACT_LOGIT_TOL u`` of it, is recomputed from the differences
    :math:`x_i - \mu_k`, with the correction of the corrected two-pass
    algorithm (Chan, Golub and LeVeque, 1983): with :math:`\mu'_k` the mean
    computed above and :math:`e_k = \sum_i r_{ik}(x_i - \mu'_k)`, which
    rounding leaves small but not zero, the mean becomes
    :math:`\mu'_k + \delta_k`, :math:`\delta_k = (e_k - 10u\,\mu'_k)/N_k`,
    and the sum :math:`\sum_i r_{ik}(x_i-\mu'_k)^2 - 2\delta_k e_k +
    g_k\delta_k^2`.

    The differences need the responsibilities again.  The first pass keeps
    every pair with :math:`r_{ik} \ge` ``EXACT_LOGIT_TOL u / N`` (at most
    :data:`STREAM_KEPT_PER_ROW` ``N`` of them) and sums the others per
    component, :math:`D_k`.  Where :math:`D_k R_{kj}` is at most half the
    tolerance, ``EXACT_LOGIT_TOL u`` times the screen's lower bound on the
    sum (:math:`R_{kj}` bounds every :math:`(x_{ij} - \mu_{kj})^2`), the
    kept pairs give the sum and no second pass is run: the rule for a
    fitted mixture, whose responsibilities are mostly far below that floor.
    The other components get a second pass that computes their logits only
    (:func:`log_joint`, ``O(N C d)`` for ``C`` of them) and their
    responsibilities as :math:`\exp(l_{ik} - L_i)`, with the log-normaliser
    :math:`L_i = \log\sum_k \pi_k \mathcal N(x_i\,|\,\mu_k, \sigma_k^2)`
    kept from the first pass as :math:`l_{ik^*} - \log r_{ik^*}` at the
    row's largest responsibility :math:`r_{ik^*} \ge 1/K` (its logit from
    the differences, in float64), and leaves out those below
    :math:`\theta_k`, with :math:`\theta_k R_{kj} N` at most half the
    tolerance: ``C / K`` of an E-step.
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    reg_covar = validation.check_positive_float(reg_covar, "reg_covar", allow_zero=True)
    if block_rows is not None:
        block_rows = validation.check_int(block_rows, "block_rows", minimum=1)
    if posterior is None:
        posterior = _tuned_posterior
    elif not callable(posterior):
        raise TypeError(f"posterior: expected a callable (x, means, variances, log_weights) -> (gamma, min_quad), got {type(posterior).__name__}")
    n, d = x.shape
    K = means.shape[0]
    dtype = x.dtype
    rows = max(1, min(n, block_rows or STREAM_BLOCK_BYTES // (K * dtype.itemsize)))
    log_w = numerics.log_weights(weights)
    tol = EXACT_LOGIT_TOL * np.finfo(dtype).eps
    # the first pass: g_k, s_k, t_k about the data mean c, L_i and the kept pairs, a block at a time
    fp = _first_pass(x, means, variances, log_w, rows, posterior)
    validation.check_scaled_distances(fp.min_quad, "x")
    # mu'_k = (s_k + g_k c) / N_k and sum_i r_ik (x_i - mu'_k)^2 = t_k - 2 m_k s_k + g_k m_k^2, screened for cancellation
    nk, new_means, m, sq, terms = _expanded_m_step(fp)
    refined, err = _cancellation_screen(sq, terms, fp.g, rows, -(-n // rows), dtype)
    if refined.size:
        # the refinement's sums about mu'_k from the differences: the kept pairs where they suffice, else a second pass
        R, low = _refinement_bounds(x, fp.centre, m[refined], sq[refined], err[refined])
        first, second = np.zeros((K, d), np.float64), np.zeros((K, d), np.float64)
        cols = refined
        if fp.kept is not None:
            enough = _kept_pair_sums(x, fp, refined, R, low, tol, new_means, first, second)
            cols, R, low = refined[~enough], R[~enough], low[~enough]
        if cols.size:
            _second_pass(x, means, variances, log_w, fp.lse, rows, cols, R, low, tol, new_means, first, second)
        # the corrected two-pass sums about mu'_k, e_k = sum_i r_ik (x_i - mu'_k): mu_k = mu'_k + delta_k
        new_means[refined], sq[refined] = _corrected_two_pass(first[refined], second[refined], fp.g[refined], nk[refined],
                                                              new_means[refined])
    # sigma_k^2 = sum_i r_ik (x_i - mu_k)^2 / N_k + reg
    new_variances = sq / nk[:, None] + reg_covar
    # pi_k = N_k / N, renormalised after the 10 u guard
    new_weights = nk / n
    new_weights /= new_weights.sum()
    return new_means.astype(dtype), new_variances.astype(dtype), new_weights.astype(dtype)
