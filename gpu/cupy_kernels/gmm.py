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
1. One kernel (``gmm.cu``, ``centre_square_*``): ``xcat = [xc^2, xc]`` with
   ``xc = x - centre``, counting the non-finite entries of a device ``x``
   into the call's checks.
2. One GEMM (``cupy.matmul``, cuBLAS): ``t = [xc^2, xc] @ [-p^T / 2; (mc p)^T]``,
   ``(N, 2d) @ (2d, K)``; the two products of the reference's expansion in
   one, per mixture (a batched GEMM over heads).
3. One fused epilogue (``gmm.cu``, ``posterior_rows_*``): one warp per row
   adds the per-component constants, takes ``min_k q_ik``, the row maximum
   and the sum of exponentials (a warp butterfly), overwrites ``t`` with the
   responsibilities (or their logarithms), and evaluates the screen of
   :mod:`refimpl.tuned` on the row (``s_i`` from ``xc^2`` and ``max_k p``):
   suspect rows and rows whose ``min_quad`` is not finite are counted into
   the checks.  No host sync: the checks are copied once, at the end of the
   public call (:class:`gpu.cupy_kernels._backend.Checks`).
4. Only when that copy shows suspect rows (far-apart means), the spoiled
   logits of those rows are recomputed from the differences
   (:func:`refine_xp`, with syncs of its own), and those rows go through
   the row kernel once more.

Every step is written for an array module ``xp``: the ``*_xp`` functions run
with NumPy (the row kernel's NumPy twin is :func:`refimpl.tuned.softmax_rows`)
on a machine without a GPU, and with CuPy on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refimpl import boundary, tuned, validation
from refimpl.gmm import LOG_2PI

from ._backend import (
    Checks, RawModuleSource, as_module_array, backend, is_device_array, launch, matmul,
    result, to_host,
)

__all__ = ["log_responsibilities", "responsibilities"]

_CU = RawModuleSource("gmm.cu", headers=("rows.cuh",))

#: Rows per block of the row kernel: one warp (32 threads) per row.
ROWS_PER_BLOCK = 8

# Pairs recomputed exactly at a time in the rare path: at most this many rows of d numbers.
_EXACT_BLOCK = 1 << 16


def _suffix(dtype) -> str:
    return "f32" if np.dtype(dtype) == np.float32 else "f64"


def normalise_rows(xp, t, shift, log_norm, n_rows_per_seq, log, screen=None):
    """Fused: ``t`` (R, K) becomes the (log) softmax of ``t + shift_h + log_norm_h`` per row, in place.

    Row ``r`` uses mixture ``h = (r // n_rows_per_seq) % H`` of ``shift`` and
    ``log_norm`` (H, K).  Returns ``min_quad`` (R,): ``-2 max_k (t + shift)``.
    With NumPy the same math runs through :func:`refimpl.tuned.softmax_rows`.

    ``screen``, optional, is ``(xcat (R, 2d), ex, checks, side)``: the rows'
    screen quantity ``s_i`` is formed from ``xc^2`` (the first ``d`` columns
    of ``xcat``) and the rows the screen cannot clear are counted into
    ``checks`` as ``suspect:side``, the rows whose ``min_quad`` is not finite
    as ``min_quad:side``.
    """
    R, K = t.shape
    H = shift.shape[0]
    min_quad = xp.empty(R, dtype=t.dtype)
    if screen is not None:
        xcat, ex, checks, side = screen
        d = xcat.shape[1] // 2
        args = (xcat, np.int32(d), ex.max_precision, ex.root_max_sq_mu, t.dtype.type(ex.screen_limit), np.int32(1),
                checks.slot(f"min_quad:{side}"), checks.slot(f"suspect:{side}"))
    else:
        args = (t, np.int32(0), shift, shift, t.dtype.type(0), np.int32(0), min_quad, min_quad)

    def twin():
        t4 = t.reshape(-1, H, n_rows_per_seq, K)
        with np.errstate(over="ignore", invalid="ignore"):
            # half_ik = t_ik + shift_hk (-q/2), min_k q_ik = -2 max_k half_ik, l_ik = half_ik + log_norm_hk
            half = t4 + shift[:, None, :]
            min_quad[...] = (-2 * np.max(half, axis=-1)).reshape(R)
            np.add(half, log_norm[:, None, :], out=t4)
        (tuned.log_softmax_rows if log else tuned.softmax_rows)(t)
        if screen is not None:
            s_row = screen_sizes(np, xcat.reshape(-1, H, n_rows_per_seq, 2 * d)[..., :d], ex).reshape(R)
            checks.add(f"suspect:{side}", tuned.suspect_rows(np, s_row, min_quad, ex.screen_limit))
            checks.add(f"min_quad:{side}", ~np.isfinite(min_quad))

    if R:
        grid = (-(-R // ROWS_PER_BLOCK),)
        launch(_CU, f"posterior_rows_{_suffix(t.dtype)}", grid, (32, ROWS_PER_BLOCK),
               (t, shift, log_norm, min_quad, np.int64(R), np.int32(K), np.int64(n_rows_per_seq), np.int32(H),
                np.int32(bool(log)), *args), twin)
    return min_quad


def screen_sizes(xp, xc2, ex):
    """``s_i = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k c_k))^2`` of ``xc2 (G, H, N, d)``: the screen's row size (G, H, N)."""
    with np.errstate(over="ignore", invalid="ignore"):
        # screen in O(N d): s_ik <= s_row = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k c_k))^2 for every k
        s_row = xp.sqrt(head_matmul(xp, xp.ascontiguousarray(xc2), ex.max_precision[:, :, None], count=False)[..., 0])
        s_row += ex.root_max_sq_mu[:, None]
        s_row *= s_row
    return s_row


def centre_square(xp, x, centre, checks=None, name=None):
    """Fused: ``[xc^2, xc]`` (G, H, N, 2d) of ``x (G, H, N, d)``, ``xc = x - centre_h``; counts non-finite ``x`` into ``checks[name]``."""
    G, H, N, d = x.shape
    xcat = xp.empty((G, H, N, 2 * d), dtype=x.dtype)
    count_x = checks is not None and name is not None and checks.enabled

    def twin():
        xc, xc2 = xcat[..., d:], xcat[..., :d]
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(x, centre[:, None, :], out=xc)
            np.multiply(xc, xc, out=xc2)
        if count_x:
            checks.add(name, ~np.isfinite(x))

    total = G * H * N * d
    if total:
        bad = checks.slot(name) if count_x else xcat
        grid = (max(1, min(4096, -(-total // 256))),)
        launch(_CU, f"centre_square_{_suffix(x.dtype)}", grid, (256,),
               (x, centre, xcat, np.int64(G * H * N), np.int32(d), np.int64(N), np.int32(H), bad, np.int32(count_x)), twin)
    return xcat


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


def head_matmul(xp, a, w, count=True):
    """``a (G, H, N, m) @ w (H, m, K)`` per mixture: one GEMM when ``H = 1``, else a batched GEMM (one cuBLAS call)."""
    G, H, N, m = a.shape
    mm = matmul if count else (lambda _, p, q: xp.matmul(p, q))
    if H == 1:
        return mm(xp, a.reshape(G * N, m), w[0]).reshape(G, 1, N, w.shape[2])
    return mm(xp, a, w)


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
        half = matmul(xp, xcat, ex.w[h]) + ex.shift[h]
        sq_x = matmul(xp, xcat[:, :d], xp.ascontiguousarray(prec.T))  # xi_ik = sum_j xc_ij^2 p_kj
    r, c = xp.nonzero(tuned.spoiled_logits(xp, half + ex.log_norm[h], half, sq_x, ex.sq_mu[h], ex.kappa, window))
    if r.size:
        half[r, c] = -0.5 * tuned.exact_quadratic_form(xp, xb, means, prec, r, c, _EXACT_BLOCK)
    return half


def posterior_xp(xp, x, ex, log=False, refine=True, checks=None, side="x", count_x=False):
    """Core: the (log) responsibilities of ``x (G, H, N, d)`` under the ``H`` mixtures of ``ex``, and ``min_quad``.

    Sequence ``(g, h)`` uses mixture ``h``.  No validation, no raise: the
    caller checks ``min_quad`` (:func:`refimpl.validation.check_scaled_distances`).

    Without ``checks`` the call is self-contained: with ``refine`` the
    screen's count is copied to the host (one copy) and the flagged rows are
    recomputed.  With ``checks`` (the caller's :class:`Checks`, holding
    ``suspect:side`` and ``min_quad:side``, and ``side`` itself when
    ``count_x``) nothing is copied: the caller fetches the checks once and
    calls :func:`refine_xp` when ``suspect:side`` is not 0.

    Returns
    -------
    gamma : array, shape (G, H, N, K)
    min_quad : array, shape (G, H, N)
    """
    G, H, N, d = x.shape
    K = ex.means.shape[1]
    own = checks is None
    if own:
        checks = Checks(xp, [f"suspect:{side}", f"min_quad:{side}"])
    xcat = centre_square(xp, x, ex.centre, checks, side if count_x else None)
    with np.errstate(over="ignore", invalid="ignore"):
        # -q/2 - (-c/2) = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj: one GEMM
        t = head_matmul(xp, xcat, ex.w)
    screen = (xcat.reshape(-1, 2 * d), ex, checks, side) if refine else None
    min_quad = normalise_rows(xp, t.reshape(G * H * N, K), ex.shift, ex.log_norm, N, log, screen).reshape(G, H, N)
    if own and refine and t.size and checks.fetch().failed(f"suspect:{side}"):
        refine_xp(xp, x, t, min_quad, ex, log)
    return t, min_quad


def refine_xp(xp, x, t, min_quad, ex, log=False):
    """The rare path: recompute, in place, the spoiled logits of the rows of ``t`` the screen cannot clear.

    ``t`` and ``min_quad`` as :func:`posterior_xp` returned them.  Syncs with
    the host (the rows to redo are found on it); called only when the checks
    say that some row is suspect.
    """
    G, H, N, d = x.shape
    K = ex.means.shape[1]
    xcat = xp.empty((G, H, N, 2 * d), dtype=x.dtype)  # [xc^2, xc]
    with np.errstate(over="ignore", invalid="ignore"):
        xp.subtract(x, ex.centre[:, None, :], out=xcat[..., d:])
        xp.multiply(xcat[..., d:], xcat[..., d:], out=xcat[..., :d])
    s_row = screen_sizes(xp, xcat[..., :d], ex)
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


def raise_bad_input(checks, name, a):
    """After :meth:`Checks.fetch`: refimpl's error for a device input ``a`` with non-finite entries (a copy to word it)."""
    if checks.failed(name):
        validation.check_finite(to_host(a), name)


def _posterior_kernel(xp, checked, given, log):
    """The responsibilities (or their logs) of refimpl's checked arguments, computed with ``xp``; then ``min_quad``'s check.

    One copy to the host (the checks) unless one fails or a row is suspect.
    """
    x = given[0]
    on_device = any(is_device_array(a) for a in given)
    x_on_device = is_device_array(x)
    _, means, variances, weights = checked
    dtype = means.dtype
    x_in = x
    x = as_module_array(xp, x, dtype)
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    ex = expansion(xp, *(as_module_array(xp, a[None], dtype) for a in (means, variances, log_weights)))
    checks = Checks(xp, ["x", "suspect:x", "min_quad:x"])
    gamma, min_quad = posterior_xp(xp, x[None, None], ex, log, checks=checks, count_x=x_on_device)
    checks.fetch()
    raise_bad_input(checks, "x", x_in)
    if checks.failed("suspect:x"):
        refine_xp(xp, x[None, None], gamma, min_quad, ex, log)
        validation.check_scaled_distances(to_host(min_quad).reshape(-1), "x")
    elif checks.failed("min_quad:x"):
        validation.check_scaled_distances(to_host(min_quad).reshape(-1), "x")
    return result(gamma[0, 0], on_device)


#: The responsibilities bound to refimpl's boundary, which writes their signature, docstring and checks once.
KERNELS = {"posterior": _posterior_kernel}
_public = boundary.bind(backend(KERNELS), module=__name__)
log_responsibilities = _public.log_responsibilities
responsibilities = _public.responsibilities
