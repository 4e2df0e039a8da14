r"""Diagonal-GMM responsibilities with CuPy: :func:`refimpl.gmm.log_responsibilities` and :func:`refimpl.gmm.responsibilities`.

What it computes
----------------
The logits :math:`\ell_{ik} = \log\pi_k + \log\mathcal N(x_i\mid\mu_k,\operatorname{diag}\sigma_k^2)`
and their softmax over the components, as :mod:`refimpl.gmm` does: the
quadratic form of all ``N x K`` pairs from the expansion of the square on
``x`` and ``mu`` centred on the mean of the means, then a screen and an exact
recomputation, from the differences ``x - mu``, of every logit that
cancellation may have spoiled and that could lie near its row maximum.  So
the responsibilities are right to rounding for every input, however far
apart the means are.

Launch plan
-----------
1. One GEMM (``cupy.matmul``, cuBLAS): ``t = [xc^2, xc] @ [-p^T / 2; (mc p)^T]``,
   ``(N, 2d) @ (2d, K)``; the two products of the reference's expansion in
   one, per mixture (a batched GEMM over heads).
2. One fused row kernel (``gmm.cu``, ``posterior_rows_*``): one warp per
   row adds the constants, takes ``min_k q_ik``, the row maximum and the sum
   of exponentials (a warp butterfly) and overwrites ``t`` with the
   responsibilities (or their logarithms).
3. The screen of :mod:`refimpl.tuned` (its functions take the array module):
   one GEMV ``xc^2 @ max_k p`` and one comparison on the host; in the common
   case that is all.  Otherwise the spoiled logits of the rows the screen
   cannot clear are recomputed from the differences, and those rows go
   through the row kernel once more.

Every step is written for an array module ``xp``: the ``*_xp`` functions run
with NumPy (the row kernel's NumPy twin is :func:`refimpl.tuned.softmax_rows`)
on a machine without a GPU, and with CuPy on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refimpl import tuned, validation
from refimpl.gmm import LOG_2PI

from ._backend import RawModuleSource, all_true, as_module_array, check_finite, device_module, host_view, is_device_array, result, to_host

__all__ = ["log_responsibilities", "responsibilities"]

_CU = RawModuleSource("gmm.cu", headers=("rows.cuh",))

#: Rows per block of the row kernel: one warp (32 threads) per row.
ROWS_PER_BLOCK = 8

# Pairs recomputed exactly at a time in the rare path: at most this many rows of d numbers.
_EXACT_BLOCK = 1 << 16


def _suffix(dtype) -> str:
    return "f32" if np.dtype(dtype) == np.float32 else "f64"


def normalise_rows(xp, t, shift, log_norm, n_rows_per_seq, log):
    """Fused: ``t`` (R, K) becomes the (log) softmax of ``t + shift_h + log_norm_h`` per row, in place.

    Row ``r`` uses mixture ``h = (r // n_rows_per_seq) % H`` of ``shift`` and
    ``log_norm`` (H, K).  Returns ``min_quad`` (R,): ``-2 max_k (t + shift)``.
    With NumPy the same math runs through :func:`refimpl.tuned.softmax_rows`.
    """
    R, K = t.shape
    H = shift.shape[0]
    if xp is np:
        t4 = t.reshape(-1, H, n_rows_per_seq, K)
        with np.errstate(over="ignore", invalid="ignore"):
            # half_ik = t_ik + shift_hk (-q/2), min_k q_ik = -2 max_k half_ik, l_ik = half_ik + log_norm_hk
            half = t4 + shift[:, None, :]
            min_quad = -2 * np.max(half, axis=-1)
            np.add(half, log_norm[:, None, :], out=t4)
        (tuned.log_softmax_rows if log else tuned.softmax_rows)(t)
        return min_quad.reshape(R)
    min_quad = xp.empty(R, dtype=t.dtype)
    if R:
        fn = _CU.function(f"posterior_rows_{_suffix(t.dtype)}")
        grid = (-(-R // ROWS_PER_BLOCK),)
        fn(grid, (32, ROWS_PER_BLOCK), (t, shift, log_norm, min_quad, np.int64(R), np.int32(K), np.int64(n_rows_per_seq), np.int32(H), np.int32(bool(log))))
    return min_quad


class Expansion(NamedTuple):
    """What every row needs from the mixtures, per mixture ``h`` (``H`` of them), computed once per call."""

    means: object  # (H, K, d)
    precisions: object  # (H, K, d): p = 1 / sigma^2
    centre: object  # (H, d): the mean of the means
    w: object  # (H, 2d, K): [-p^T / 2; (mc p)^T]
    shift: object  # (H, K): -c / 2 with c_k = sum_j mc_kj^2 p_kj
    sq_mu: object  # (H, K): c_k
    log_norm: object  # (H, K): log pi_k - (d/2) log 2 pi - (1/2) sum_j log sigma_kj^2
    max_precision: object  # (H, d): max_k p_kj, for the screen
    root_max_sq_mu: object  # (H,): sqrt(max_k c_k), for the screen
    kappa: float  # (4 + sqrt(2d)) u / 2: a logit's error per unit of s (one GEMM of 2d terms)
    screen_limit: float  # EXACT_LOGIT_TOL u / kappa


def expansion(xp, means, variances, log_weights) -> Expansion:
    """The per-call constants of :func:`posterior_xp`, for ``H`` mixtures: ``means, variances (H, K, d)``, ``log_weights (H, K)``."""
    d = means.shape[2]
    dtype = means.dtype
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        precisions = 1.0 / variances
        # (x - mu)^2 is invariant under a common shift c: centre on the mean of the means
        centre = means.mean(axis=1)
        mc = means - centre[:, None, :]
        sq_mu = xp.sum(mc * mc * precisions, axis=2)
        w = xp.ascontiguousarray(xp.concatenate([-0.5 * precisions, mc * precisions], axis=2).transpose(0, 2, 1))
        # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
        log_norm = log_weights - 0.5 * (d * LOG_2PI + xp.sum(xp.log(variances), axis=2))
        root_max_sq_mu = xp.sqrt(sq_mu.max(axis=1))
    # one GEMM adds 2d terms of total size s / 2: its error is about (4 + sqrt(2d)) u s / 2 (refimpl.tuned: sqrt(d), two GEMMs)
    kappa = tuned.logit_error_scale(2 * d, dtype)
    return Expansion(
        means, precisions, centre, w, xp.ascontiguousarray(-0.5 * sq_mu), sq_mu, xp.ascontiguousarray(log_norm),
        precisions.max(axis=1), root_max_sq_mu, kappa, dtype.type(tuned.EXACT_LOGIT_TOL * np.finfo(dtype).eps / kappa),
    )


def head_matmul(xp, a, w):
    """``a (G, H, N, m) @ w (H, m, K)`` per mixture: one GEMM when ``H = 1``, else a batched GEMM."""
    G, H, N, m = a.shape
    if H == 1:
        return xp.matmul(a.reshape(G * N, m), w[0]).reshape(G, 1, N, w.shape[2])
    return xp.matmul(a, w)


def _refine_head(xp, xb, xcat, ex, h, window):
    """The screen-and-recompute of :mod:`refimpl.tuned` on rows ``xb`` (S, d) of mixture ``h`` that the screen did not clear.

    Returns their ``-q / 2`` (S, K), the spoiled entries recomputed: what the
    row kernel normalises with a shift of 0 (adding ``-c / 2`` back to
    ``t = -q / 2 + c / 2`` would cancel again).
    """
    d = xb.shape[1]
    means, prec = ex.means[h], ex.precisions[h]
    with np.errstate(over="ignore", invalid="ignore"):
        # -q/2 and l = log_norm - q/2 of these rows by the expansion, as the GEMM computed them
        half = xp.matmul(xcat, ex.w[h]) + ex.shift[h]
        sq_x = xp.matmul(xcat[:, :d], xp.ascontiguousarray(prec.T))  # xi_ik = sum_j xc_ij^2 p_kj
    r, c = xp.nonzero(tuned.spoiled_logits(xp, half + ex.log_norm[h], half, sq_x, ex.sq_mu[h], ex.kappa, window))
    if r.size:
        half[r, c] = -0.5 * tuned.exact_quadratic_form(xp, xb, means, prec, r, c, _EXACT_BLOCK)
    return half


def posterior_xp(xp, x, ex, log=False, refine=True):
    """Core: the (log) responsibilities of ``x (G, H, N, d)`` under the ``H`` mixtures of ``ex``, and ``min_quad``.

    Sequence ``(g, h)`` uses mixture ``h``.  No validation, no raise: the
    caller checks ``min_quad`` (:func:`refimpl.validation.check_scaled_distances`).

    Returns
    -------
    gamma : array, shape (G, H, N, K)
    min_quad : array, shape (G, H, N)
    """
    G, H, N, d = x.shape
    K = ex.means.shape[1]
    xcat = xp.empty((G, H, N, 2 * d), dtype=x.dtype)  # [xc^2, xc]
    xc, xc2 = xcat[..., d:], xcat[..., :d]
    with np.errstate(over="ignore", invalid="ignore"):
        xp.subtract(x, ex.centre[:, None, :], out=xc)
        xp.multiply(xc, xc, out=xc2)
        # -q/2 - (-c/2) = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj: one GEMM
        t = head_matmul(xp, xcat, ex.w)
    min_quad = normalise_rows(xp, t.reshape(G * H * N, K), ex.shift, ex.log_norm, N, log).reshape(G, H, N)
    if not refine or t.size == 0:
        return t, min_quad
    with np.errstate(over="ignore", invalid="ignore"):
        # screen in O(N d): s_ik <= s_row = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k c_k))^2 for every k
        s_row = xp.sqrt(head_matmul(xp, xc2, ex.max_precision[:, :, None])[..., 0])
        s_row += ex.root_max_sq_mu[:, None]
        s_row *= s_row
    if all_true(xp, s_row <= ex.screen_limit):  # the common case, decided in one comparison (NaN fails it)
        return t, min_quad
    window = tuned.posterior_window(K, x.dtype)
    bad = tuned.suspect_rows(xp, s_row, min_quad, ex.screen_limit)
    t_flat, mq_flat = t.reshape(-1, K), min_quad.reshape(-1)
    x_flat, xcat_flat = x.reshape(-1, d), xcat.reshape(-1, 2 * d)
    for h in range(H):
        rows = xp.flatnonzero(bad[:, h, :])
        if rows.size == 0:
            continue
        # flat row of sequence (g, h), token i: (g H + h) N + i
        rows = (rows // N) * (H * N) + h * N + rows % N
        half = _refine_head(xp, x_flat[rows], xcat_flat[rows], ex, h, window)
        mq_flat[rows] = normalise_rows(xp, half, xp.zeros_like(ex.shift[h : h + 1]), ex.log_norm[h : h + 1], half.shape[0], log)
        t_flat[rows] = half
    return t, min_quad


def checked_posterior_xp(xp, x, means, variances, weights, log):
    """:func:`refimpl.gmm.responsibilities` (or its log) computed with ``xp``: the checks, the core, the check of ``min_quad``."""
    on_device = any(is_device_array(a) for a in (x, means, variances, weights))
    _, means, variances, weights = validation.check_gmm(host_view(x), to_host(means), to_host(variances), to_host(weights))
    check_finite(x, "x")
    dtype = means.dtype
    x = as_module_array(xp, x, dtype)
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    ex = expansion(xp, *(as_module_array(xp, a[None], dtype) for a in (means, variances, log_weights)))
    gamma, min_quad = posterior_xp(xp, x[None, None], ex, log)
    if not all_true(xp, xp.isfinite(min_quad)):
        validation.check_scaled_distances(to_host(min_quad).reshape(-1), "x")
    return result(gamma[0, 0], on_device)


def log_responsibilities(x, means, variances, weights):
    """Log posterior ``log p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.log_responsibilities`).

    Parameters
    ----------
    x : array_like or cupy.ndarray, shape (N, d)
    means : array_like or cupy.ndarray, shape (K, d)
    variances : array_like or cupy.ndarray, shape (K, d)
        All > 0.
    weights : array_like or cupy.ndarray, shape (K,)
        Nonnegative, summing to one.

    Returns
    -------
    numpy.ndarray or cupy.ndarray, shape (N, K)
        ``l_k(x_i) - logsumexp_m l_m(x_i)``; a CuPy array when any input is
        a device array, else NumPy.  Computed on the device.

    Raises
    ------
    RuntimeError
        When CuPy has no usable device and the inputs are NumPy arrays.
    """
    xp = device_module(x, means, variances, weights)
    return checked_posterior_xp(xp, x, means, variances, weights, True)


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.responsibilities`).

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    numpy.ndarray or cupy.ndarray, shape (N, K)
        Nonnegative rows that sum to one; a CuPy array when any input is a
        device array, else NumPy.
    """
    xp = device_module(x, means, variances, weights)
    return checked_posterior_xp(xp, x, means, variances, weights, False)
