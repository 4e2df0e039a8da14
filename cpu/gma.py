"""Gaussian Mixture Attention on the CPU with Numba kernels: :mod:`refimpl.gma`'s ``gma``, ``gma_forward``, ``gma_backward``.

The same arguments, results (:class:`refimpl.gma.GMACache`,
:class:`~refimpl.gma.GMABatchCache`, :class:`~refimpl.gma.GMAGrads`) and
errors as :mod:`refimpl.gma`, whose batch rule (:func:`refimpl.gma.forward_with`,
:func:`~refimpl.gma.backward_with`) runs here with three kernels in place of
NumPy's passes:

* the responsibilities, one fused pass over ``N x K`` (:mod:`cpu.gmm`);
* the causal scan and its two sweeps (:mod:`cpu.scan`; the bidirectional
  form is two matrix products, as in the reference);
* the backward through the responsibilities (:func:`responsibility_backward`):
  ``prange`` over blocks of :data:`BLOCK` rows, each thread writing the
  ``dx`` of its rows and its block's partial sums of the parameter
  gradients; the partials are then added in block order, so the result does
  not depend on the number of threads.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from refimpl import boundary
from refimpl.gma import GMABatchCache, GMACache, GMAGrads

from . import gmm as cpu_gmm
from . import scan as cpu_scan
from ._jit import pick, threaded_and_serial
from ._lanes import sum8
from ._record import backend

__all__ = ["gma", "gma_forward", "gma_backward", "responsibility_backward", "GMACache", "GMABatchCache", "GMAGrads"]

BLOCK = 256
"""Rows per block of the backward's partial sums (a fixed number: the order of the sums is fixed)."""


def _responsibility_backward_kernel(x, gamma, grad, means, precisions, dx, part_mu, part_sq, part_c):
    n, d = x.shape
    K = means.shape[0]
    for blk in prange(part_c.shape[0]):
        c = np.empty(K, x.dtype)
        for i in range(blk * BLOCK, min(n, (blk + 1) * BLOCK)):
            # c_im = gamma_im (g_im - sum_m gamma_im g_im): the softmax backward
            gbar = x.dtype.type(0)
            for k in range(K):
                gbar += gamma[i, k] * grad[i, k]
            for k in range(K):
                c[k] = gamma[i, k] * (grad[i, k] - gbar)
                part_c[blk, k] += c[k]
            for j in range(d):
                dx[i, j] = 0
            for k in range(K):
                ck = c[k]
                for j in range(d):
                    t = x[i, j] - means[k, j]
                    u = ck * (t * precisions[k, j])
                    # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2
                    dx[i, j] -= u
                    # dL/dmu_m = sum_i c_im (x_i - mu_m) / sigma_m^2
                    part_mu[blk, k, j] += u
                    # sum_i c_im (x_ij - mu_mj)^2 (the sigma2_mj sum_i c_im term is added after)
                    part_sq[blk, k, j] += ck * (t * t)


_RESPONSIBILITY_BACKWARD = threaded_and_serial(_responsibility_backward_kernel)


GEMM_WORK = 1 << 20
"""``N K d`` from which the backward's sums over rows and components are matrix products (below: one fused loop)."""

FAST = {"fastmath": {"contract"}, "error_model": "numpy"}


def _softmax_backward_kernel(x, centre, gamma, grad, c, xx, part_c):
    n, d = x.shape
    K = gamma.shape[1]
    for blk in prange(part_c.shape[0]):
        for i in range(blk * BLOCK, min(n, (blk + 1) * BLOCK)):
            gam, g, ci = gamma[i], grad[i], c[i]
            for k in range(K):
                ci[k] = gam[k] * g[k]
            gbar = sum8(ci, K)
            for k in range(K):
                # c_im = gamma_im (g_im - sum_m gamma_im g_im): the softmax backward
                ci[k] = gam[k] * (g[k] - gbar)
                part_c[blk, k] += ci[k]
            for j in range(d):
                # [xc, xc^2], xc = x - centre: the operands of the two products
                t = x[i, j] - centre[j]
                xx[i, j] = t
                xx[i, d + j] = t * t


def _dx_kernel(xx, prod, dx):
    n, d = dx.shape
    for i in prange(n):
        for j in range(d):
            # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2 = (c (mc p))_i - xc_i (c p)_i
            dx[i, j] = prod[i, j] - xx[i, j] * prod[i, d + j]


_SOFTMAX_BACKWARD = threaded_and_serial(_softmax_backward_kernel, **FAST)
_DX = threaded_and_serial(_dx_kernel, **FAST)


def _backward_by_products(x, gamma, grad_gamma, means, variances):
    """The sums of :func:`responsibility_backward` as two matrix products on centred data, the rest fused."""
    n, d = x.shape
    dtype = x.dtype
    blocks = (n + BLOCK - 1) // BLOCK
    # x - mu is invariant under the common shift by the centre of the means
    centre = means.mean(axis=0)
    mc = means - centre
    prec = 1.0 / variances
    c = np.empty_like(gamma)
    xx = np.empty((n, 2 * d), dtype=dtype)
    part_c = np.zeros((blocks, means.shape[0]), dtype=dtype)
    work = gamma.size * d
    pick(_SOFTMAX_BACKWARD, work)(x, centre, gamma, grad_gamma, c, xx, part_c)
    # the products: [c^T xc, c^T xc^2] (K, 2 d_r) and [c (mc p), c p] (N, 2 d_r)
    sums = c.T @ xx
    prod = c @ np.concatenate([mc * prec, prec], axis=1)
    dx = np.empty_like(x)
    pick(_DX, work)(xx, prod, dx)
    csum = part_c.sum(axis=0)  # the partial sums added in block order
    ctx, ctx2 = sums[:, :d], sums[:, d:]
    # dL/dmu_m = sum_i c_im (x_i - mu_m) / sigma_m^2
    dmeans = (ctx - csum[:, None] * mc) * prec
    # dL/dsigma2_mj = sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj) / (2 sigma2_mj^2), (x - mu)^2 expanded
    sq = ctx2 - 2.0 * mc * ctx + (mc * mc - variances) * csum[:, None]
    dvariances = 0.5 * sq * prec * prec
    return dx, dmeans.astype(dtype, copy=False), dvariances.astype(dtype, copy=False), csum


def responsibility_backward(x, gamma, grad_gamma, means, variances):
    """Core: :func:`refimpl.gma`'s backward through ``gamma = softmax(l(x))``: ``(dx, dmeans, dvariances, dlogits)``.

    Arrays checked, of one dtype.  Two ways, by size:

    * up to :data:`GEMM_WORK` (``N K d``): from the differences ``x_i - mu_m``
      (``gma.md#backward-through-the-responsibilities``) in one kernel, in the
      calling thread below :data:`cpu._jit.SERIAL_WORK`: a training step's calls;
    * above: as :mod:`refimpl.tuned` does, the sums over rows and components
      as matrix products on ``x`` and the means centred on the mean of the
      means (``gma.md#parameter-gradients-as-matrix-products``), with the
      softmax backward, the centring and ``dx`` fused in kernels around the
      two products.  The loop from the differences is bound by its three
      accumulations per entry and took 2.5 to 3 times as long as the products
      at ``N = 16384, K = d = 64``.

    Float32 is accumulated in float32 in both (the sums over ``K`` in
    :func:`cpu._lanes.sum8`'s eight partial sums, the sums over rows in blocks
    of :data:`BLOCK` and in BLAS): each sum has terms of both signs, and its
    error, ``n u`` times the sum of the magnitudes for ``n`` terms, is what the
    float32 tolerances of ``tests/test_conformance.py`` allow.
    """
    x, gamma, grad_gamma = (np.ascontiguousarray(a) for a in (x, gamma, grad_gamma))
    if gamma.size * x.shape[1] > GEMM_WORK:
        return _backward_by_products(x, gamma, grad_gamma, means, variances)
    n = x.shape[0]
    blocks = (n + BLOCK - 1) // BLOCK
    dx = np.empty_like(x)
    part_mu = np.zeros((blocks,) + means.shape, dtype=x.dtype)
    part_sq = np.zeros_like(part_mu)
    part_c = np.zeros((blocks, means.shape[0]), dtype=x.dtype)
    precisions = 1.0 / variances
    kernel = pick(_RESPONSIBILITY_BACKWARD, gamma.size * x.shape[1])
    kernel(x, gamma, grad_gamma, means, precisions, dx, part_mu, part_sq, part_c)
    # the partial sums added in block order (NumPy's reduction over the first axis is sequential)
    dmeans, sq, csum = part_mu.sum(axis=0), part_sq.sum(axis=0), part_c.sum(axis=0)
    # dL/dsigma2_mj = sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj) / (2 sigma2_mj^2)
    dvariances = 0.5 * (sq - variances * csum[:, None]) * precisions * precisions
    # dL/da_m = sum_i c_im: the -pi_m sum_k c_ik term of the log-softmax Jacobian vanishes (rows of c sum to 0)
    return dx, dmeans, dvariances.astype(x.dtype, copy=False), csum


#: GMA with this package's kernels, bound to refimpl's boundary: refimpl's batch rule around them.
KERNELS = boundary.host_kernels(cpu_gmm.posterior, responsibility_backward, cpu_scan.scan_forward, cpu_scan.scan_backward)
_public = boundary.bind(backend(KERNELS), ["gma", "gma_forward", "gma_backward"], module=__name__)
gma = _public.gma
gma_forward = _public.gma_forward
gma_backward = _public.gma_backward
