r"""Diagonal-GMM responsibilities on the GPU: :func:`refimpl.gmm.log_responsibilities` and :func:`refimpl.gmm.responsibilities`.

What it computes
----------------
For every point ``x_i`` and component ``m`` the log joint

.. math::

    \ell_{im} = \log\pi_m - \tfrac12\sum_j \log(2\pi\sigma^2_{mj})
               - \tfrac12\sum_j (x_{ij}-\mu_{mj})^2/\sigma^2_{mj},

then the responsibilities :math:`\gamma_{im} = \exp(\ell_{im} - \operatorname{logsumexp}_m \ell_{im})`
(or their logarithms), with the row maximum subtracted.  The quadratic form is
evaluated from the differences ``x - mu`` themselves (every term a rounded
square, all >= 0: no cancellation), which is what :mod:`refimpl.gmm`
recomputes wherever its expanded form could be off; so the two agree to
rounding on every input, however far apart the means are.  Nothing of size
``N x K x d`` is formed.

Launch plan
-----------
1. :func:`_component_constants`, one thread per component ``(h, m)``: the
   per-component constant ``log pi_m - (1/2)(d log 2 pi + sum_j log sigma2_mj)``,
   the half-precisions ``1 / (2 sigma2)`` and the means, both transposed to
   ``(H, d, K)`` so that threads on neighbouring components read neighbouring
   addresses.
2. :func:`_posterior_rows`, one block of :data:`THREADS` threads per row
   ``(b, i)`` (a 1-D grid over the ``B N`` rows, all sequences in one launch);
   the threads stride over the components.  First pass: each thread writes
   ``l_m`` of its components to the output and keeps a running pair
   ``(max, sum of exp(l - max))`` and its smallest half quadratic form; the
   pairs are combined by an ordered tree in shared memory.  Second pass: each
   thread reads back its own entries and normalises them.

:func:`posterior_device` is the device-level entry point (no validation) used
by :mod:`gpu.numba_cuda.gma`; the public functions validate with
:mod:`refimpl.validation` and call it with one sequence and one mixture.
"""

from __future__ import annotations

import math

import numpy as np
from numba import boolean, cuda

from refimpl import validation
from refimpl.gmm import LOG_2PI

from ._device import Checks, any_device, blocks, host_view, is_device_array, kernel, raise_bad_inputs, result, to_device, to_host

__all__ = ["log_responsibilities", "responsibilities"]

#: Threads per block: one block per row, its threads strided over the components (a power of two).
THREADS = 32


# log_norm = log_weights - 0.5 * (d * LOG_2PI + np.sum(np.log(variances), axis=1)) and precisions = 1.0 / variances
# (refimpl.gmm._expansion), here with the precisions halved: half_prec = 1 / (2 sigma^2), exactly half of 1 / sigma^2.
# One thread per component (h, m) over a 1-D grid of H K threads; it loops over the d coordinates and writes the means
# and half-precisions transposed, [H, d, K], so that the row kernel's threads (neighbouring m) read coalesced.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, ::1], f[:, :, ::1], f[:, :, ::1], f[:, ::1]))
def _component_constants(means, variances, log_weights, means_t, half_prec_t, log_norm):
    f = means.dtype.type
    H, K, d = means.shape
    c = cuda.grid(1)
    if c >= H * K:
        return
    h = c // K
    m = c - h * K
    half = f(0.5)
    log_det = f(0.0)
    for j in range(d):
        s2 = variances[h, m, j]
        log_det += math.log(s2)
        means_t[h, j, m] = means[h, m, j]
        half_prec_t[h, j, m] = half / s2
    log_norm[h, m] = log_weights[h, m] - half * (f(d * LOG_2PI) + log_det)


# l_ik = log_norm_k - q_ik / 2 with q_ik = sum_j (x_ij - mu_kj)^2 p_kj from the differences (refimpl.gmm._exact_quadratic_form),
# then softmax(a) = softmax(a - m) per row (refimpl.numerics.softmax / log_softmax), min_quad = min_k q_ik.
# One block per row r = b N + i (sequence b, token i, mixture h = b % H), THREADS threads strided over the K components.
# Pass 1: thread t computes l_ik for k = t, t + T, ..., writes it to gamma[b, i, k] and keeps (m_t, s_t) with
# s_t = sum exp(l_ik - m_t) (rescaled by exp(m_old - m_new) when m_t grows) and min_k q_ik / 2.
# The T pairs are combined by a tree in shared memory ([T] each for m, s and min q/2), in a fixed order.
# Pass 2: thread t reads back its own entries: exp(l - M) * (1 / S), or (l - M) - log S.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, ::1], boolean, f[:, :, ::1], f[:, ::1]))
def _posterior_rows(x, means_t, half_prec_t, log_norm, log, gamma, min_quad):
    f = x.dtype.type
    row_max = cuda.shared.array(THREADS, dtype=x.dtype)  # [T]
    row_sum = cuda.shared.array(THREADS, dtype=x.dtype)  # [T]
    row_min = cuda.shared.array(THREADS, dtype=x.dtype)  # [T]
    B, N, d = x.shape
    H = means_t.shape[0]
    K = means_t.shape[2]
    t = cuda.threadIdx.x
    T = cuda.blockDim.x
    r = cuda.blockIdx.x
    b = r // N
    i = r - b * N
    h = b % H
    neg_inf = f(-math.inf)
    one = f(1.0)
    m_t = neg_inf
    s_t = f(0.0)
    q_t = f(math.inf)  # the smallest q / 2; NaN, once met, stays
    for k in range(t, K, T):
        hq = f(0.0)
        for j in range(d):
            diff = x[b, i, j] - means_t[h, j, k]
            hq += diff * diff * half_prec_t[h, j, k]
        lk = log_norm[h, k] - hq
        gamma[b, i, k] = lk
        if hq < q_t or hq != hq:
            q_t = hq
        if lk > m_t:
            s_t = s_t * math.exp(m_t - lk) + one
            m_t = lk
        elif lk != neg_inf:  # exp(-inf) = 0 adds nothing; skipping it avoids -inf - (-inf)
            s_t += math.exp(lk - m_t)
    row_max[t] = m_t
    row_sum[t] = s_t
    row_min[t] = q_t
    cuda.syncthreads()
    stride = T // 2
    while stride > 0:
        if t < stride:
            m_a = row_max[t]
            m_b = row_max[t + stride]
            if m_b > m_a:
                row_sum[t] = row_sum[t] * math.exp(m_a - m_b) + row_sum[t + stride]
                row_max[t] = m_b
            elif m_b != neg_inf:
                row_sum[t] = row_sum[t] + row_sum[t + stride] * math.exp(m_b - m_a)
            q_b = row_min[t + stride]
            if q_b < row_min[t] or q_b != q_b:
                row_min[t] = q_b
        cuda.syncthreads()
        stride //= 2
    big_m = row_max[0]
    big_s = row_sum[0]
    if t == 0:
        min_quad[b, i] = f(2.0) * row_min[0]
    if log:
        log_s = neg_inf  # log 0 = -inf (a row of -inf logits), as on the device; math.log(0) would raise in the simulator
        if big_s != f(0.0):
            log_s = math.log(big_s)
        for k in range(t, K, T):
            gamma[b, i, k] = (gamma[b, i, k] - big_m) - log_s
    else:
        inv_s = one / big_s
        for k in range(t, K, T):
            gamma[b, i, k] = math.exp(gamma[b, i, k] - big_m) * inv_s


def posterior_device(x, means, variances, log_weights, *, log=False):
    """Core: the responsibilities of ``B`` sequences under ``H`` mixtures, on the device; no validation, no raise.

    Parameters
    ----------
    x : device array, shape (B, N, d)
        ``B`` sequences of ``N`` points.
    means, variances : device arrays, shape (H, K, d)
        ``H`` diagonal mixtures (variances > 0); sequence ``b`` uses mixture ``b % H``
        (``H`` divides ``B``; ``H = 1``: one shared mixture).
    log_weights : device array, shape (H, K)
        ``log pi``; ``-inf`` for a component of weight 0.
    log : bool, default False
        Return ``log gamma`` instead of ``gamma``.

    All arrays C-contiguous, of one float dtype.

    Returns
    -------
    gamma : device array, shape (B, N, K)
        Rows that sum to one (log responsibilities with ``log=True``).
    min_quad : device array, shape (B, N)
        ``min_k sum_j (x_ij - mu_kj)^2 / sigma_kj^2``: not finite for a row
        without a representable posterior; the caller checks it
        (:func:`refimpl.validation.check_scaled_distances`).
    """
    B, N, d = x.shape
    H, K, _ = means.shape
    dtype = x.dtype
    gamma = cuda.device_array((B, N, K), dtype=dtype)
    min_quad = cuda.device_array((B, N), dtype=dtype)
    if B * N == 0 or K == 0:
        return gamma, min_quad
    means_t = cuda.device_array((H, d, K), dtype=dtype)
    half_prec_t = cuda.device_array((H, d, K), dtype=dtype)
    log_norm = cuda.device_array((H, K), dtype=dtype)
    _component_constants[blocks(H * K, THREADS), THREADS](means, variances, log_weights, means_t, half_prec_t, log_norm)
    _posterior_rows[B * N, THREADS](x, means_t, half_prec_t, log_norm, bool(log), gamma, min_quad)
    return gamma, min_quad


def _checked_posterior(x, means, variances, weights, log):
    """Validate as :mod:`refimpl.gmm` does, run :func:`posterior_device` with ``B = H = 1``, check ``min_quad``.

    The checks (a device ``x``'s finiteness, ``min_quad``) are counted on the
    device and copied to the host once (:class:`~gpu.numba_cuda._device.Checks`).
    """
    on_device = any_device(x, means, variances, weights)
    _, means, variances, weights = validation.check_gmm(host_view(x), to_host(means), to_host(variances), to_host(weights))
    dtype = means.dtype
    x_in = x
    x = to_device(x, dtype)
    checks = Checks(dtype)
    if is_device_array(x_in):
        checks.finite(x, "x")
    N, d = x.shape
    K = means.shape[0]
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    gamma, min_quad = posterior_device(
        x.reshape(1, N, d), to_device(means[None], dtype), to_device(variances[None], dtype),
        to_device(log_weights[None], dtype), log=log,
    )
    checks.finite(min_quad, "min_quad")
    raise_bad_inputs(checks.fetch(), ((x_in, "x"),))
    if checks.failed("min_quad"):
        validation.check_scaled_distances(min_quad.copy_to_host()[0], "x")
    return result(gamma.reshape(N, K), on_device)


def log_responsibilities(x, means, variances, weights):
    """Log posterior ``log p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.log_responsibilities`).

    Parameters
    ----------
    x : array_like or device array, shape (N, d)
    means : array_like or device array, shape (K, d)
    variances : array_like or device array, shape (K, d)
        All > 0.
    weights : array_like or device array, shape (K,)
        Nonnegative, summing to one.

    Returns
    -------
    ndarray or device array, shape (N, K)
        ``l_k(x_i) - logsumexp_m l_m(x_i)``; a device array when any input is one.
    """
    return _checked_posterior(x, means, variances, weights, True)


def responsibilities(x, means, variances, weights):
    """Posterior ``gamma_k(x_i) = p(z = k | x_i)`` under a diagonal GMM (:func:`refimpl.gmm.responsibilities`).

    Parameters are those of :func:`log_responsibilities`.

    Returns
    -------
    ndarray or device array, shape (N, K)
        Nonnegative rows that sum to one; a device array when any input is one.
    """
    return _checked_posterior(x, means, variances, weights, False)
