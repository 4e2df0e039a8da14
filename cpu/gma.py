"""Gaussian Mixture Attention on the CPU with Numba kernels: :mod:`refimpl.gma`'s ``gma``, ``gma_forward``, ``gma_backward``.

The same arguments, results (:class:`refimpl.gma.GMACache`,
:class:`~refimpl.gma.GMABatchCache`, :class:`~refimpl.gma.GMAGrads`) and
errors as :mod:`refimpl.gma`, computed by kernels where a fused loop wins and
by matrix products called from the driver where BLAS wins:

* the responsibilities, one fused pass over ``N x K`` (:mod:`cpu.gmm`);
* the mixing: bidirectional, two matrix products (write, then read) with
  ``[V, 1]`` carrying the denominators; causal, :mod:`cpu.scan` (chunks and
  products for long sequences, token by token for short ones);
* the backward through the responsibilities (:func:`responsibility_backward`):
  one kernel from the differences for small work, the sums as two matrix
  products on centred data for large work, with the softmax backward and
  ``dx`` fused in kernels around them; partial sums over fixed blocks of
  :data:`BLOCK` rows, added in block order, so the result does not depend on
  the number of threads.

A batch (leading dimensions, what the model's multi-head layer passes)
runs as :func:`refimpl.gma.forward_with`'s batch rule says, but with one
kernel call per head for the responsibilities (the rows of all the head's
sequences stacked), the bidirectional mixing as batched matrix products, and
the backward through the responsibilities one call per head: the per-sequence
Python calls were most of a training step's time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numba
from numba import get_thread_id, prange

from scipy.special import expit

from refimpl import boundary, numerics
from refimpl import gma as spec_gma
from refimpl.gma import GMABatchCache, GMACache, GMAGrads
from refimpl.scan import FeatureAttentionCache

from . import gmm as cpu_gmm
from . import scan as cpu_scan
from ._jit import call_with_one_blas_thread, pick, threaded_and_serial
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


def _by_products_kernel(x, centre, gamma, grad, weights, rows, c_buf, xx_buf, prod_buf, dx, part_c, part_sums):
    n, d = x.shape
    K = gamma.shape[1]
    for blk in prange((n + rows - 1) // rows):
        a = blk * rows
        m = min(n, a + rows) - a
        # the thread's work arrays, reused from block to block (fresh ones would be fresh pages every block)
        t = get_thread_id()
        c = c_buf[t, : m * K].reshape((m, K))
        xx = xx_buf[t, : m * 2 * d].reshape((m, 2 * d))
        prod = prod_buf[t, : m * 2 * d].reshape((m, 2 * d))
        for r in range(m):
            i = a + r
            gam, g, ci = gamma[i], grad[i], c[r]
            for k in range(K):
                ci[k] = gam[k] * g[k]
            gbar = sum8(ci, K)
            for k in range(K):
                # c_im = gamma_im (g_im - sum_m gamma_im g_im): the softmax backward
                ci[k] = gam[k] * (g[k] - gbar)
                part_c[i // BLOCK, k] += ci[k]
            for j in range(d):
                # [xc, xc^2], xc = x - centre: the operands of the two products
                u = x[i, j] - centre[j]
                xx[r, j] = u
                xx[r, d + j] = u * u
        # the block's [c^T xc, c^T xc^2] (K, 2 d_r), and [c (mc p), c p] (m, 2 d_r): single-threaded products
        np.dot(c.T, xx, part_sums[blk])
        np.dot(c, weights, prod)
        for r in range(m):
            for j in range(d):
                # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2 = (c (mc p))_i - xc_i (c p)_i
                dx[a + r, j] = prod[r, j] - xx[r, j] * prod[r, d + j]


_BY_PRODUCTS = threaded_and_serial(_by_products_kernel, **FAST)


def _backward_by_products(x, gamma, grad_gamma, means, variances):
    """The sums of :func:`responsibility_backward` as two matrix products on centred data, the rest fused.

    One kernel, ``prange`` over blocks of rows whose work arrays fit the cache
    (:func:`refimpl.numerics.block_rows`; each thread's reused from block to
    block: on whole arrays the fresh ``N x 2 d_r`` temporaries cost more in
    page faults and cache misses than the products themselves): per block the
    softmax backward and the centred operands, the block's two products as
    single-threaded BLAS calls (BLAS held at one thread meanwhile, as the
    causal scan's chunks are: BLAS's own threads, left spinning after a call,
    would hold the cores the next Numba kernel wants), and ``dx``; the
    blocks' sums added in block order.
    """
    n, d = x.shape
    K = means.shape[0]
    dtype = x.dtype
    # x - mu is invariant under the common shift by the centre of the means
    centre = means.mean(axis=0)
    mc = means - centre
    prec = 1.0 / variances
    weights = np.ascontiguousarray(np.concatenate([mc * prec, prec], axis=1))  # [mc p, p] (K, 2 d_r)
    rows = max(BLOCK, numerics.block_rows((2 * K + 6 * d) * dtype.itemsize) // BLOCK * BLOCK)
    threads = numba.config.NUMBA_NUM_THREADS  # get_thread_id's range
    c_buf = np.empty((threads, rows * K), dtype=dtype)
    xx_buf = np.empty((threads, rows * 2 * d), dtype=dtype)
    prod_buf = np.empty((threads, rows * 2 * d), dtype=dtype)
    part_c = np.zeros(((n + BLOCK - 1) // BLOCK, K), dtype=dtype)
    part_sums = np.empty(((n + rows - 1) // rows, K, 2 * d), dtype=dtype)
    dx = np.empty_like(x)
    call_with_one_blas_thread(_BY_PRODUCTS, gamma.size * d, x, centre, gamma, grad_gamma, weights, rows, c_buf, xx_buf,
                              prod_buf, dx, part_c, part_sums)
    # the partial sums added in block order (NumPy's reduction over the first axis is sequential)
    csum, sums = part_c.sum(axis=0), part_sums.sum(axis=0)
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


# ---------------------------------------------------------------------------
# Batches: every sequence of a head in one kernel call
# ---------------------------------------------------------------------------


def _heads(leading, means):
    """``[(GMM index, the flat indices of its sequences)]``: head ``h`` owns the sequences whose last leading index
    is ``h`` (every sequence shares the one GMM when ``means`` is 2-D)."""
    count = int(np.prod(leading))
    if means.ndim == 2:
        return [((), slice(None))]
    H = leading[-1]
    return [((h,), slice(h, count, H)) for h in range(H)]


def _batched_posteriors(x, means, variances, log_weights, leading):
    """The responsibilities of every sequence of ``x (S, N, d)``: one kernel call per head (its sequences' rows
    stacked), ``(gamma (S, N, K), min_quad (S, N))``."""
    S, N, d = x.shape
    K = means.shape[-2]
    gamma = np.empty((S, N, K), dtype=x.dtype)
    min_quad = np.empty((S, N), dtype=x.dtype)
    for h, seqs in _heads(leading, means):
        rows = x[seqs].reshape(-1, d)
        g, m = cpu_gmm.posterior(rows, means[h], variances[h], log_weights[h])
        gamma[seqs] = g.reshape(-1, N, K)
        min_quad[seqs] = m.reshape(-1, N)
    return gamma, min_quad


def _forward_batched(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size, raw_variances=None, keep=True):
    """:func:`refimpl.gma.forward_with`'s batch rule with one call per head for the responsibilities and, when
    bidirectional, batched matrix products for the mixing (``[V, 1]``: the denominators as one more column)."""
    leading = x_q.shape[:-2]
    (Nq, d), (Nk, dv) = x_q.shape[-2:], v.shape[-2:]
    xq, xk, vv = x_q.reshape(-1, Nq, d), x_k.reshape(-1, Nk, d), v.reshape(-1, Nk, dv)
    S = xq.shape[0]
    gq, mq = _batched_posteriors(xq, means, variances, log_weights, leading)
    gk, mk = _batched_posteriors(xk, means, variances, log_weights, leading)
    if causal:
        mixed = [cpu_scan.scan_forward(gq[s], gk[s], vv[s], True, eps, chunk_size) for s in range(S)]
        out = np.stack([m[0] for m in mixed]) if S else np.empty((0, Nq, dv), x_q.dtype)
        den = np.stack([m[1].den for m in mixed]) if S else np.empty((0, Nq), x_q.dtype)
    else:
        v1 = np.ones((S, Nk, dv + 1), dtype=v.dtype)
        v1[..., :dv] = vv
        # [num, den - eps] = Gamma_Q (Gamma_K^T [V, 1]), sequence by sequence
        num = np.matmul(gq, np.matmul(gk.transpose(0, 2, 1), v1))
        den = num[..., dv] + x_q.dtype.type(eps)
        with np.errstate(divide="ignore", invalid="ignore"):  # den = 0 only with eps = 0: refused below
            out = num[..., :dv] / den[..., None]
    spec_gma.check_gma_results(mq.reshape(-1), mk.reshape(-1), den.reshape(-1), eps)
    out_shaped = out.reshape(leading + (Nq, dv))
    if not keep:
        return out_shaped, None
    chunk = max(1, min(chunk_size, Nq))
    caches = []
    for s, idx in enumerate(np.ndindex(leading)):
        h = idx[-1:] if means.ndim == 3 else ()
        mixing = mixed[s][1] if causal else FeatureAttentionCache(gq[s], gk[s], vv[s], out[s], den[s], False, eps, chunk)
        raw = None if raw_variances is None else raw_variances[h]
        caches.append(GMACache(xq[s], xk[s], means[h], raw, variances[h], gq[s], gk[s], mixing))
    return out_shaped, GMABatchCache(leading, means.ndim == 3, tuple(caches))


def _backward_batched(grad_out, cache):
    """:func:`refimpl.gma.backward_with` for a :class:`GMABatchCache`: the mixing's backward batched when
    bidirectional, the backward through the responsibilities one call per head (its sequences' rows stacked;
    the GMM gradients of a head summed over all its rows at once)."""
    leading, caches = cache.leading, cache.caches
    first = caches[0]
    g = spec_gma.check_gma_grad_out(grad_out, leading + first.mixing.out.shape, first.gamma_q.dtype)
    S = len(caches)
    (Nq, dv), d = first.mixing.out.shape, first.x_q.shape[-1]
    g = g.reshape(S, Nq, dv)
    stack = lambda field: np.stack([getattr(c, field) for c in caches])  # noqa: E731
    gq, gk, xq, xk = stack("gamma_q"), stack("gamma_k"), stack("x_q"), stack("x_k")
    if first.mixing.causal:
        grads = [cpu_scan.scan_backward(g[s], c.mixing) for s, c in enumerate(caches)]
        dgq, dgk, dv_ = (np.stack([getattr(r, f) for r in grads]) for f in ("phi_q", "phi_k", "v"))
    else:
        vv = np.stack([c.mixing.v for c in caches])
        den = np.stack([c.mixing.den for c in caches])
        out = np.stack([c.mixing.out for c in caches])
        # out = num / den: gn = g / den, delta = -(g . out) / den; [gn, delta] against [V, 1]
        g1 = np.empty((S, Nq, dv + 1), dtype=g.dtype)
        g1[..., :dv] = g / den[..., None]
        g1[..., dv] = -np.sum(g * out, axis=-1) / den
        v1 = np.ones((S, vv.shape[1], dv + 1), dtype=vv.dtype)
        v1[..., :dv] = vv
        state = np.matmul(gk.transpose(0, 2, 1), v1)  # [S, z] = Gamma_K^T [V, 1]
        dstate = np.matmul(gq.transpose(0, 2, 1), g1)  # [dS, dz] = Gamma_Q^T [gn, delta]
        dgq = np.matmul(g1, state.transpose(0, 2, 1))
        dgk = np.matmul(v1, dstate.transpose(0, 2, 1))
        dv_ = np.matmul(gk, dstate[..., :dv])
    per_head = cache.per_head
    heads = leading[-1:] if per_head else ()
    dxq, dxk = np.empty_like(xq), np.empty_like(xk)
    dmeans = np.zeros(heads + first.means.shape, dtype=g.dtype)
    draw = np.zeros(heads + first.means.shape, dtype=g.dtype)
    dlogits = np.zeros(heads + first.means.shape[:1], dtype=g.dtype)
    for h, seqs in _heads(leading, first.means[None] if per_head else first.means):
        c = caches[seqs][0] if per_head else first
        rq = responsibility_backward(xq[seqs].reshape(-1, d), gq[seqs].reshape(-1, gq.shape[-1]),
                                     dgq[seqs].reshape(-1, gq.shape[-1]), c.means, c.variances)
        rk = responsibility_backward(xk[seqs].reshape(-1, d), gk[seqs].reshape(-1, gk.shape[-1]),
                                     dgk[seqs].reshape(-1, gk.shape[-1]), c.means, c.variances)
        dxq[seqs] = rq[0].reshape(-1, Nq, d)
        dxk[seqs] = rk[0].reshape(-1, xk.shape[1], d)
        dmeans[h] += rq[1] + rk[1]
        # sigma2 = softplus(s) + sigma2_min: dsigma2/ds = sigmoid(s)
        draw[h] += (rq[2] + rk[2]) * expit(c.raw_variances)
        dlogits[h] += rq[3] + rk[3]
    return GMAGrads(x_q=dxq.reshape(leading + xq.shape[1:]), x_k=dxk.reshape(leading + xk.shape[1:]),
                    v=dv_.reshape(leading + dv_.shape[1:]), means=dmeans, raw_variances=draw, logits=dlogits)


# ---------------------------------------------------------------------------
# Packed sequences (cu_seqlens): every sequence and head in one call of each kernel
# ---------------------------------------------------------------------------


class GMAPackedCache(NamedTuple):
    """What :func:`gma_backward` needs of a packed forward computed in one call (every sequence's rows together)."""

    offsets: np.ndarray  # cu_seqlens, int64 (S + 1,)
    x_q: np.ndarray  # (H, T, d), heads first (H = 1 without heads)
    x_k: np.ndarray
    v: np.ndarray  # (H, T, d_v)
    means: np.ndarray  # (K, d) or (H, K, d)
    raw_variances: np.ndarray
    variances: np.ndarray
    gamma_q: np.ndarray  # (H, T, K)
    gamma_k: np.ndarray
    out: np.ndarray  # (H T, d_v): the heads' rows one after another
    den: np.ndarray  # (H T,)
    causal: bool
    leading: tuple  # () without heads, (H,) with
    out_shape: tuple  # (T, d_v) or (T, H, d_v): the shape of grad_out


def _packed_forward(a, variances, log_weights, offsets, raw_variances=None, keep=True):
    """GMA of packed sequences (checked arrays heads first, ``offsets`` checked): the responsibilities one call per
    head over all its rows, the mixing one :func:`cpu.scan.packed_forward` call over every (head, sequence);
    ``NotImplemented`` where the longest sequence is long enough for chunks and matrix products (the loop's way)."""
    leading = a.x_q.shape[:-2]
    (T, d), dv, K = a.x_q.shape[-2:], a.v.shape[-1], a.means.shape[-2]
    if np.diff(offsets).max(initial=0) * K * (dv + 1) > cpu_scan.CHUNK_WORK:
        return NotImplemented
    xq, xk, vv = a.x_q.reshape(-1, T, d), a.x_k.reshape(-1, T, d), a.v.reshape(-1, T, dv)
    H = xq.shape[0]
    gq, mq = _batched_posteriors(xq, a.means, variances, log_weights, leading)
    gk, mk = _batched_posteriors(xk, a.means, variances, log_weights, leading)
    out, den = cpu_scan.packed_forward(gq.reshape(-1, K), gk.reshape(-1, K), vv.reshape(-1, dv), a.causal, a.eps,
                                       cpu_scan.head_offsets(offsets, H, T))
    try:
        spec_gma.check_gma_results(mq.reshape(-1), mk.reshape(-1), den, a.eps)
    except ValueError:
        return NotImplemented  # the loop refuses it, naming the sequence's row as it always has
    packed = cpu_scan.packed_layout(out, leading)
    if not keep:
        return packed
    cache = GMAPackedCache(offsets, xq, xk, vv, a.means, raw_variances, variances, gq, gk, out, den, a.causal, leading, packed.shape)
    return packed, cache


def _packed_gma_kernel(xp, a, given, offsets):
    return _packed_forward(a, a.variances, numerics.log_weights(a.weights), offsets, keep=False)


def _packed_gma_forward_kernel(xp, a, given, offsets):
    variances, log_weights = spec_gma.mixture_from_raw(a.raw_variances, a.logits, a.min_variance)
    return _packed_forward(a, variances, log_weights, offsets, raw_variances=a.raw_variances)


def _packed_backward(grad_out, cache):
    """The backward of :func:`_packed_forward`: the mixing's in one :func:`cpu.scan.packed_backward` call, the
    responsibilities' one call per head over all its rows (the GMM gradients summed over every sequence at once)."""
    g = cpu_scan.packed_grad_out(grad_out, cache.out_shape, cache.out.dtype)
    (H, T, d), K, dv = cache.x_q.shape, cache.gamma_q.shape[-1], cache.v.shape[-1]
    gq, gk = cache.gamma_q.reshape(-1, K), cache.gamma_k.reshape(-1, K)
    mixing = cpu_scan.packed_backward(g, gq, gk, cache.v.reshape(-1, dv), cache.out, cache.den, cache.causal,
                                      cpu_scan.head_offsets(cache.offsets, H, T))
    dgq, dgk = mixing.phi_q.reshape(H, T, K), mixing.phi_k.reshape(H, T, K)
    dxq, dxk = np.empty_like(cache.x_q), np.empty_like(cache.x_k)
    dmeans, draw = np.zeros_like(cache.means), np.zeros_like(cache.means)
    dlogits = np.zeros(cache.means.shape[:-1], dtype=g.dtype)
    for h, seqs in _heads(cache.leading, cache.means):
        means, variances = cache.means[h], cache.variances[h]
        rq = responsibility_backward(cache.x_q[seqs].reshape(-1, d), cache.gamma_q[seqs].reshape(-1, K), dgq[seqs].reshape(-1, K),
                                     means, variances)
        rk = responsibility_backward(cache.x_k[seqs].reshape(-1, d), cache.gamma_k[seqs].reshape(-1, K), dgk[seqs].reshape(-1, K),
                                     means, variances)
        dxq[seqs], dxk[seqs] = rq[0].reshape(-1, T, d), rk[0].reshape(-1, T, d)
        dmeans[h] += rq[1] + rk[1]
        # sigma2 = softplus(s) + sigma2_min: dsigma2/ds = sigmoid(s)
        draw[h] += (rq[2] + rk[2]) * expit(cache.raw_variances[h])
        dlogits[h] += rq[3] + rk[3]
    back = lambda x: cpu_scan.packed_layout(x, cache.leading)  # noqa: E731
    return GMAGrads(x_q=back(dxq), x_k=back(dxk), v=back(mixing.v), means=dmeans, raw_variances=draw, logits=dlogits)


def _gma_kernel(xp, a, given):
    args = (a.x_q, a.x_k, a.v, a.means, a.variances, numerics.log_weights(a.weights), a.causal, a.eps, a.chunk_size)
    if a.x_q.ndim == 2:
        return _SINGLE["gma"](xp, a, given)
    return _forward_batched(*args, keep=False)[0]


def _gma_forward_kernel(xp, a, given):
    if a.x_q.ndim == 2:
        return _SINGLE["gma_forward"](xp, a, given)
    variances, log_weights = spec_gma.mixture_from_raw(a.raw_variances, a.logits, a.min_variance)
    args = (a.x_q, a.x_k, a.v, a.means, variances, log_weights, a.causal, a.eps, a.chunk_size)
    return _forward_batched(*args, raw_variances=a.raw_variances)


def _gma_backward_kernel(xp, grad_out, cache):
    if isinstance(cache, GMAPackedCache):
        return _packed_backward(grad_out, cache)
    if isinstance(cache, GMABatchCache) and cache.caches:
        return _backward_batched(grad_out, cache)
    return _SINGLE["gma_backward"](xp, grad_out, cache)


#: The kernels of one sequence: refimpl's batch rule around this package's cores.
_SINGLE = boundary.host_kernels(cpu_gmm.posterior, responsibility_backward, cpu_scan.scan_forward, cpu_scan.scan_backward)
#: GMA with this package's kernels, bound to refimpl's boundary; a batch in one call per head (``_forward_batched``).
KERNELS = {**_SINGLE, "gma": _gma_kernel, "gma_forward": _gma_forward_kernel, "gma_backward": _gma_backward_kernel,
           "packed gma": _packed_gma_kernel, "packed gma_forward": _packed_gma_forward_kernel}
_public = boundary.bind(backend(KERNELS), ["gma", "gma_forward", "gma_backward"], module=__name__)
gma = _public.gma
gma_forward = _public.gma_forward
gma_backward = _public.gma_backward
