"""Responsibilities of a diagonal GMM as one fused Numba kernel: :func:`refimpl.gmm.responsibilities` on the CPU.

The kernel computes, for every row ``x_i``, the log joint
``l_ik = log pi_k + log N(x_i | mu_k, diag sigma_k^2)`` from the differences
``x_ij - mu_kj`` (every term of the quadratic form is >= 0, so nothing
cancels and the result is right to rounding for every input, the spread
means included), then the row's maximum, the sum of ``exp(l_ik - max)`` and
the normalised row: one pass over the ``N x K`` output, where NumPy makes
about nine.

How the work maps onto the loops:

* ``prange`` over tasks of :data:`CHUNK` rows, each in groups of :data:`ROWS`
  rows: each thread owns whole rows, so every sum is taken in the same order
  whatever the number of threads (the same bits with one thread or many);
* inside a group, the coordinates ``j`` outside and the components ``k``
  inside: the means and precisions are stored transposed, ``(d, K)``, so the
  inner loop runs over contiguous ``k`` and vectorises, and each load of
  ``mu_kj`` and ``1/sigma_kj^2`` serves the :data:`ROWS` rows of the group;
  ``fastmath={"contract"}`` lets ``q + t * t * p`` be one fused multiply-add
  (nothing is reordered);
* per row: the minimum distance, the row maximum and the sum of the
  exponentials in eight interleaved partial results (:mod:`cpu._lanes`), the
  exponentials by :func:`cpu.vexp.exp` (the loop vectorises: this numba has
  no vector maths library, and ``math.exp`` was half the kernel's time), and
  the scaling by the reciprocal of the sum.

Float32 inputs are computed and accumulated in float32 (every constant is
cast to the input's dtype first), which the error analysis allows here: the
quadratic form is a sum of ``d`` terms of one sign, accurate to ``d u``
relative to itself (``u = 6e-8``); a logit ``-q/2`` of size 30 then carries
an error of ``30 d u``, 6e-5 at ``d = 32``, and a responsibility, which
depends on differences of logits, moves by at most twice that relative to
itself, within the float32 tolerances of ``tests/test_conformance.py``
(``rtol = 1e-5`` on entries that are mostly far smaller than the largest);
the row sum of ``K`` exponentials in ``[0, 1]`` is accurate to
``(K/8 + 3) u``.  The exponential of a float32 is computed in float64 and
rounded once (:mod:`cpu.vexp`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from refimpl import gmm as ref_gmm
from refimpl import boundary

from ._jit import pick, threaded_and_serial
from ._lanes import max8, min8, sum8
from .vexp import exp
from ._record import backend

__all__ = ["log_responsibilities", "responsibilities", "posterior"]

ROWS = 8
"""Rows that share each load of the means and precisions in the quadratic-form loop."""

CHUNK = 256
"""Rows per task of the thread pool (a multiple of :data:`ROWS`); each task allocates its work space once."""


@njit(cache=True, inline="always")
def quadratic_forms(x, a, r, mu_t, prec_t, q):
    """``q[s, k] = sum_j (x[a+s, j] - mu_t[j, k])^2 prec_t[j, k]`` for the ``r <= ROWS`` rows from ``a``.

    Coordinates outside, components inside (contiguous in ``k``); ``q`` is
    ``(ROWS, K)`` work space, overwritten.  Each term is a square times a
    positive number, so the sum is accurate to ``d`` rounding errors
    relative to itself whatever the input (no cancellation), in float32 as in
    float64: float32 sums stay in float32.
    """
    d, K = mu_t.shape
    q[:] = 0
    if r == ROWS:
        for j in range(d):
            x0, x1, x2, x3 = x[a, j], x[a + 1, j], x[a + 2, j], x[a + 3, j]
            x4, x5, x6, x7 = x[a + 4, j], x[a + 5, j], x[a + 6, j], x[a + 7, j]
            for k in range(K):
                m, p = mu_t[j, k], prec_t[j, k]
                # (x_ij - mu_kj)^2 / sigma_kj^2: a square times a positive number, nothing cancels
                t0, t1, t2, t3 = x0 - m, x1 - m, x2 - m, x3 - m
                t4, t5, t6, t7 = x4 - m, x5 - m, x6 - m, x7 - m
                q[0, k] += t0 * t0 * p
                q[1, k] += t1 * t1 * p
                q[2, k] += t2 * t2 * p
                q[3, k] += t3 * t3 * p
                q[4, k] += t4 * t4 * p
                q[5, k] += t5 * t5 * p
                q[6, k] += t6 * t6 * p
                q[7, k] += t7 * t7 * p
    else:
        for s in range(r):
            for j in range(d):
                xs = x[a + s, j]
                for k in range(K):
                    t = xs - mu_t[j, k]
                    q[s, k] += t * t * prec_t[j, k]


@njit(cache=True, inline="always")
def normalise_row(lrow, out_row, log):
    """Softmax (or log-softmax when ``log``) of one row of log joints ``lrow`` into ``out_row``; returns the sum.

    The row maximum is subtracted first, so the largest exponent is 0; the
    exponentials are :func:`cpu.vexp.exp` (the loop vectorises), the maximum
    and the sum are :mod:`cpu._lanes`' (eight interleaved partial results).
    The sum is NaN when a log joint is.
    """
    K = lrow.shape[0]
    m = max8(lrow, K)
    for k in range(K):
        # gamma_k = exp(l_k - m) / sum_m exp(l_m - m)
        out_row[k] = exp(lrow[k] - m)
    s = sum8(out_row, K)
    if log:
        # log gamma_k = (l_k - m) - log sum_m exp(l_m - m)
        ls = math.log(s)
        for k in range(K):
            out_row[k] = (lrow[k] - m) - ls
    else:
        r = 1 / s
        for k in range(K):
            out_row[k] = out_row[k] * r
    return s


def _posterior_kernel(x, mu_t, prec_t, log_norm, half, log, out, min_quad):
    n = x.shape[0]
    K = mu_t.shape[1]
    for c in prange((n + CHUNK - 1) // CHUNK):
        q = np.empty((ROWS, K), x.dtype)
        for a in range(c * CHUNK, min(n, (c + 1) * CHUNK), ROWS):
            r = min(ROWS, n - a)
            quadratic_forms(x, a, r, mu_t, prec_t, q)
            for s in range(r):
                row = q[s]
                mq = min8(row, K)
                for k in range(K):
                    # l_ik = log pi_k - (d/2) log 2 pi - (1/2) sum_j log sigma_kj^2 - q_ik / 2
                    row[k] = log_norm[k] - half * row[k]
                total = normalise_row(row, out[a + s], log)
                # a NaN distance (an overflow inside the form) makes the sum NaN: pass it on for the caller to refuse
                min_quad[a + s] = mq if total == total else total


#: ``contract``: a * b + c may be one fused multiply-add (one rounding instead of two; nothing is reordered).
#: ``numpy`` error model: a division by zero gives inf or NaN, with no check in the loop (so that it vectorises).
FAST = {"fastmath": {"contract"}, "error_model": "numpy"}

_POSTERIOR = threaded_and_serial(_posterior_kernel, **FAST)


def _constants(means, variances, log_weights):
    """``(mu_t (d, K), prec_t (d, K), log_norm (K,), 1/2)`` in the dtype of ``means``."""
    d = means.shape[1]
    # log N(x | mu, sigma^2) = -(d/2) log 2 pi - (1/2) sum_j log sigma_j^2 - q / 2
    log_norm = log_weights - 0.5 * (d * ref_gmm.LOG_2PI + np.sum(np.log(variances), axis=1))
    mu_t = np.ascontiguousarray(means.T)
    prec_t = np.ascontiguousarray((1.0 / variances).T)
    return mu_t, prec_t, log_norm.astype(means.dtype), means.dtype.type(0.5)


def posterior(x, means, variances, log_weights, *, log=False):
    """Core: ``(gamma (N, K), min_quad (N,))``, the responsibilities (or their logs) of checked arrays; no raise.

    The caller checks ``min_quad`` (:func:`refimpl.validation.check_scaled_distances`).
    """
    x = np.ascontiguousarray(x)
    out = np.empty((x.shape[0], means.shape[0]), dtype=x.dtype)
    min_quad = np.empty(x.shape[0], dtype=x.dtype)
    pick(_POSTERIOR, out.size * x.shape[1])(x, *_constants(means, variances, log_weights), bool(log), out, min_quad)
    return out, min_quad


#: The responsibilities of this module, bound to refimpl's boundary (signature, docstring, checks written once there).
_public = boundary.bind(backend(boundary.host_kernels(posterior)), ["responsibilities", "log_responsibilities"], module=__name__)
log_responsibilities = _public.log_responsibilities
responsibilities = _public.responsibilities
