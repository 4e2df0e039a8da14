r"""Gaussian Mixture Attention on the GPU: :func:`refimpl.gma.gma`, :func:`~refimpl.gma.gma_forward`, :func:`~refimpl.gma.gma_backward`.

What it computes
----------------
For every sequence of ``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``,
``v (..., N_k, d_v)``, with one GMM shared by every sequence or one per head
(the last leading dimension): the responsibilities :math:`\Gamma_Q`,
:math:`\Gamma_K` (:func:`gpu.numba_cuda.gmm.posterior_device`), then the
scan of :mod:`gpu.numba_cuda.scan`,
:math:`O = \Gamma_Q\Gamma_K^\top V / (\Gamma_Q\Gamma_K^\top\mathbf 1 + \epsilon)`
(its lower triangle when causal).  The backward runs the scan's backward
for :math:`g = \partial L/\partial\gamma`, then the gradients through the
responsibilities of ``docs/derivations/gma.md#backward-through-the-responsibilities``:
per token the softmax backward and ``dL/dx``, and the parameter gradients as
ordered sums over the tokens, per head (or over every sequence for a shared
GMM).  The differences ``x - mu`` are formed per token: no expansion, no
cancellation.

Launch plan
-----------
The leading dimensions are flattened to ``B`` sequences (C order, so that
sequence ``b`` has head ``b % H``); every kernel has the sequence as a grid
axis, so each step is one launch for the whole batch.

1. Responsibilities of the queries and of the keys: two launches of
   :func:`gpu.numba_cuda.gmm.posterior_device`; the small GMM arrays
   (``H x K x d_r``: softplus, log-softmax, sigmoid) are computed on the
   host by :mod:`refimpl.numerics`, exactly as :mod:`refimpl.gma` does.
2. The scan forward (:func:`gpu.numba_cuda.scan.scan_forward_device`); the
   per-row ``min_quad`` and denominators are copied to the host and checked
   by :func:`refimpl.gma.check_gma_results`.
3. Backward: the scan backward, then :func:`_responsibility_rows` (``c`` and
   ``dx`` per row, a block per ``TILE`` rows), :func:`_parameter_partials`
   (per segment of :data:`~gpu.numba_cuda.scan.SEGMENT` tokens, a block per
   ``TILE x TILE`` tile of ``(m, j)``) and :func:`_parameter_sums` (one thread
   per parameter entry, adding the partials over segments and sequences in a
   fixed order).  No atomics: the results are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda, int64
from scipy.special import expit

from refimpl import numerics, validation
from refimpl.gma import (
    GMAGrads,
    check_gma_arguments,
    check_gma_forward_arguments,
    check_gma_grad_out,
    check_gma_results,
)
from refimpl.scan import DEFAULT_CHUNK_SIZE

from ._device import Checks, any_device, blocks, host_view, is_device_array, kernel, raise_bad_inputs, result, to_device, to_host
from .gmm import posterior_device
from . import scan as device_scan
from .scan import THREADS, TILE, TILE2, ScanDeviceCache, scan_backward_device, scan_forward_device

__all__ = ["gma", "gma_forward", "gma_backward", "GMADeviceCache"]


class GMADeviceCache(NamedTuple):
    """What :func:`gma_backward` needs from :func:`gma_forward`: shapes, and device arrays of ``B`` flattened sequences."""

    leading: tuple  # the leading (batch) shape of x_q, x_k, v
    per_head: bool  # the GMM has a head axis
    on_device: bool  # the forward's inputs included a device array: the gradients stay on the device
    x_q: object  # (B, N_q, d_r)
    x_k: object  # (B, N_k, d_r)
    means: object  # (H, K, d_r); H = 1 for a shared GMM
    variances: object  # (H, K, d_r)
    sigmoid_raw: object  # (H, K, d_r): dsigma2/ds = sigmoid(s)
    scan: ScanDeviceCache  # gamma_q, gamma_k, [V, 1], out, den, the chunk states


# c = grad - gbar[:, None]; c *= gam with gbar = (gam * grad) @ ones (dL/dl_m = gamma_m (g_m - gbar)), then
# dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2 (refimpl.gma._responsibility_backward), from the differences.
# Grid (row tiles, B); block TILE x TILE: row i = i0 + ty, its TILE threads tx stride over the components
# (gbar: partial sums in shared memory [T rows, T lanes], combined by an ordered tree over the lanes), write c,
# then stride over the coordinates j for dx.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1]))
def _responsibility_rows(x, gamma, grad, means, variances, c, dx):
    sh = cuda.shared.array(TILE2, dtype=x.dtype)  # [T rows, T lanes]
    zero = x.dtype.type(0.0)
    N = x.shape[1]
    d = x.shape[2]
    K = gamma.shape[2]
    H = means.shape[0]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y
    h = b % H
    i = cuda.blockIdx.x * TILE + ty
    ok = i < N
    part = zero
    if ok:
        for m in range(tx, K, TILE):
            part += gamma[b, i, m] * grad[b, i, m]
    sh[ty, tx] = part
    cuda.syncthreads()
    stride = TILE // 2
    while stride > 0:
        if tx < stride:
            sh[ty, tx] += sh[ty, tx + stride]
        cuda.syncthreads()
        stride //= 2
    gbar = sh[ty, 0]
    if ok:
        for m in range(tx, K, TILE):
            c[b, i, m] = (grad[b, i, m] - gbar) * gamma[b, i, m]
    cuda.syncthreads()
    if ok:
        for j in range(tx, d, TILE):
            acc = zero
            xj = x[b, i, j]
            for m in range(K):
                acc += c[b, i, m] * (means[h, m, j] - xj) / variances[h, m, j]
            dx[b, i, j] = acc


# ctx += c.T @ xc, ctx2 += c.T @ xc**2, csum += ones @ c over the blocks of rows (refimpl.gma._responsibility_backward),
# here from the differences x - mu per token: sum_i c_im (x_ij - mu_mj) and sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj),
# and sum_i c_im, over the tokens of segment s.
# Grid (segments * m-tiles * j-tiles, B); block TILE x TILE, thread (ty, tx) owns entry (m0 + ty, j0 + tx) [K, d_r];
# the segment's tokens are read TILE at a time into shared tiles c [T tokens, T components] and x [T tokens, T coords].
# The threads tx = 0 of the blocks with j0 = 0 also sum c over the tokens for dlogits.
@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], int64, f[:, :, :, ::1], f[:, :, :, ::1], f[:, :, ::1]))
def _parameter_partials(x, c, means, variances, segment, part_mu, part_var, part_c):
    sh_c = cuda.shared.array(TILE2, dtype=x.dtype)  # [T tokens, T components]
    sh_x = cuda.shared.array(TILE2, dtype=x.dtype)  # [T tokens, T coordinates]
    zero = x.dtype.type(0.0)
    N = x.shape[1]
    d = x.shape[2]
    K = c.shape[2]
    H = means.shape[0]
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    b = cuda.blockIdx.y
    h = b % H
    m_tiles = (K + TILE - 1) // TILE
    j_tiles = max(1, (d + TILE - 1) // TILE)
    s = cuda.blockIdx.x // (m_tiles * j_tiles)
    rest = cuda.blockIdx.x - s * m_tiles * j_tiles
    m0 = (rest // j_tiles) * TILE
    j0 = (rest % j_tiles) * TILE
    m = m0 + ty
    j = j0 + tx
    entry = m < K and j < d
    mu = means[h, m, j] if entry else zero
    s2 = variances[h, m, j] if entry else zero
    acc_mu = zero
    acc_var = zero
    acc_c = zero
    i_start = s * segment
    i_end = min(i_start + segment, N)
    for i0 in range(i_start, i_end, TILE):
        i = i0 + ty
        sh_c[ty, tx] = c[b, i, m0 + tx] if i < i_end and m0 + tx < K else zero
        sh_x[ty, tx] = x[b, i, j] if i < i_end and j < d else zero
        cuda.syncthreads()
        for tt in range(TILE):
            cm = sh_c[tt, ty]
            diff = sh_x[tt, tx] - mu
            acc_mu += cm * diff
            acc_var += cm * (diff * diff - s2)
            acc_c += cm
        cuda.syncthreads()
    if entry:
        part_mu[b, s, m, j] = acc_mu
        part_var[b, s, m, j] = acc_var
    if j0 == 0 and tx == 0 and m < K:
        part_c[b, s, m] = acc_c


# dmeans = (ctx - csum mc) * prec, dvariances = 0.5 * sq * prec * prec, draw = (dvar_q + dvar_k) * expit(raw),
# logits = da_q + da_k (refimpl.gma._gma_backward), summed over the sequences of head h (every sequence when shared).
# One thread per entry (h, m, j) of the (H, K, d_r + 1) parameters (j = d_r: the logit), over a 1-D grid; it adds
# the partials of the query and the key tokens over the segments, sequence by sequence in order: deterministic.
@kernel(lambda f: (f[:, :, :, ::1], f[:, :, :, ::1], f[:, :, ::1], f[:, :, :, ::1], f[:, :, :, ::1], f[:, :, ::1],
                   f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f[:, ::1]))
def _parameter_sums(mu_q, var_q, c_q, mu_k, var_k, c_k, variances, sigmoid_raw, dmeans, draw, dlogits):
    zero = variances.dtype.type(0.0)
    half = variances.dtype.type(0.5)
    H, K, d = variances.shape
    B = mu_q.shape[0]
    n_q = mu_q.shape[1]
    n_k = mu_k.shape[1]
    idx = cuda.grid(1)
    if idx >= H * K * (d + 1):
        return
    j = idx % (d + 1)
    m = (idx // (d + 1)) % K
    h = idx // ((d + 1) * K)
    if j == d:
        acc = zero
        for b in range(h, B, H):
            tq = zero
            for s in range(n_q):
                tq += c_q[b, s, m]
            tk = zero
            for s in range(n_k):
                tk += c_k[b, s, m]
            acc += tq + tk
        dlogits[h, m] = acc
        return
    acc_mu = zero
    acc_var = zero
    for b in range(h, B, H):
        tq = zero
        tv = zero
        for s in range(n_q):
            tq += mu_q[b, s, m, j]
            tv += var_q[b, s, m, j]
        tk = zero
        tw = zero
        for s in range(n_k):
            tk += mu_k[b, s, m, j]
            tw += var_k[b, s, m, j]
        acc_mu += tq + tk
        acc_var += tv + tw
    prec = variances.dtype.type(1.0) / variances[h, m, j]
    dmeans[h, m, j] = acc_mu * prec
    draw[h, m, j] = half * acc_var * prec * prec * sigmoid_raw[h, m, j]


def _flat(a, dtype, leading):
    """``a`` on the device as ``(B, N, d)`` with ``B`` the product of the leading dimensions."""
    a = to_device(a, dtype)
    B = int(np.prod(leading, dtype=np.int64))
    shape = tuple(a.shape)
    return a.reshape(B, shape[-2], shape[-1])


def _heads(a, per_head):
    """A GMM array with its head axis: a shared one, ``(K, d_r)`` or ``(K,)``, as one head; a per-head one unchanged."""
    return a if per_head else a[None]


def _forward(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size, leading):
    """Responsibilities and scan on the device; checks the inputs, min_quad and the denominators as refimpl does.

    Every check is gathered on the device and copied to the host once
    (:class:`~gpu.numba_cuda._device.Checks`); only a failing one copies more,
    to word refimpl's error.
    """
    dtype = means.dtype
    inputs = ((x_q, "x_q"), (x_k, "x_k"), (v, "v"))
    xq, xk, vd = (_flat(a, dtype, leading) for a, _ in inputs)
    checks = Checks(dtype)
    # host arrays were fully checked by refimpl's checker; device arrays are checked on the device
    for (a, name), dev in zip(inputs, (xq, xk, vd)):
        if is_device_array(a):
            checks.finite(dev, name)
    m, var, lw = (to_device(np.ascontiguousarray(a, dtype=dtype), dtype) for a in (means, variances, log_weights))
    gamma_q, min_quad_q = posterior_device(xq, m, var, lw)
    gamma_k, min_quad_k = posterior_device(xk, m, var, lw)
    out, scan = scan_forward_device(gamma_q, gamma_k, vd, causal, eps, chunk_size)
    checks.finite(min_quad_q, "min_quad_q")
    checks.finite(min_quad_k, "min_quad_k")
    if eps == 0:
        checks.rows(scan.den, "den")
    raise_bad_inputs(checks.fetch(), inputs)
    den_bad = eps == 0 and not np.all(checks.part("den") > 0) if "den" in checks.host else False
    if checks.failed("min_quad_q") or checks.failed("min_quad_k") or den_bad:
        check_gma_results(to_host(min_quad_q).ravel(), to_host(min_quad_k).ravel(), to_host(scan.den).ravel(), eps)
    return xq, xk, m, var, out, scan


def gma(x_q, x_k, v, means, variances, weights, *, causal: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Gaussian Mixture Attention on the GPU (:func:`refimpl.gma.gma`).

    Parameters
    ----------
    x_q : array_like or device array, shape (..., N_q, d_r)
    x_k : array_like or device array, shape (..., N_k, d_r)
    v : array_like or device array, shape (..., N_k, d_v)
        One leading (batch) shape for the three.
    means : array_like or device array, shape (K, d_r) or (H, K, d_r)
        Shared, or one GMM per head (``H`` the last leading dimension).
    variances : array_like or device array, shape of ``means``
        All > 0.
    weights : array_like or device array, shape (K,) or (H, K)
        Nonnegative, summing to one (per head).
    causal : bool, default False
    eps : float, default 1e-6
    chunk_size : int, default 64
        Tokens per chunk of the causal scan (>= 1).

    Returns
    -------
    ndarray or device array, shape (..., N_q, d_v)
        A device array when any input is one.
    """
    on_device = any_device(x_q, x_k, v, means, variances, weights)
    checked = check_gma_arguments(
        host_view(x_q), host_view(x_k), host_view(v), to_host(means), to_host(variances), to_host(weights), causal, eps, chunk_size
    )
    hq, _, hv, means, variances, weights, causal, eps, chunk_size = checked
    leading = hq.shape[:-2]
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    per_head = means.ndim == 3
    gmm = (_heads(a, per_head) for a in (means, variances, log_weights))
    out = _forward(x_q, x_k, v, *gmm, causal, eps, chunk_size, leading)[4]
    return result(out.reshape(leading + tuple(out.shape)[1:]), on_device)


def gma_forward(
    x_q,
    x_k,
    v,
    means,
    raw_variances,
    logits,
    *,
    causal: bool = False,
    eps: float = 1e-6,
    min_variance: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """GMA with unconstrained GMM parameters on the GPU, keeping what :func:`gma_backward` needs (:func:`refimpl.gma.gma_forward`).

    Parameters
    ----------
    x_q : array_like or device array, shape (..., N_q, d_r)
    x_k : array_like or device array, shape (..., N_k, d_r)
    v : array_like or device array, shape (..., N_k, d_v)
    means : array_like or device array, shape (K, d_r) or (H, K, d_r)
    raw_variances : array_like or device array, shape of ``means``
        ``variances = softplus(raw_variances) + min_variance``.
    logits : array_like or device array, shape (K,) or (H, K)
        ``weights = softmax(logits)``.
    causal : bool, default False
    eps : float, default 1e-6
    min_variance : float, default 1e-6
    chunk_size : int, default 64

    Returns
    -------
    out : ndarray or device array, shape (..., N_q, d_v)
    cache : GMADeviceCache
        Device arrays: the flattened inputs, the GMM, both responsibility
        matrices and the scan's states.
    """
    on_device = any_device(x_q, x_k, v, means, raw_variances, logits)
    checked = check_gma_forward_arguments(
        host_view(x_q), host_view(x_k), host_view(v), to_host(means), to_host(raw_variances), to_host(logits),
        causal, eps, min_variance, chunk_size,
    )
    hq, _, _, means, raw_variances, logits, causal, eps, min_variance, chunk_size = checked
    leading = hq.shape[:-2]
    per_head = means.ndim == 3
    means, raw_variances, logits = (_heads(a, per_head) for a in (means, raw_variances, logits))
    # sigma^2 = softplus(s) + sigma2_min; log pi = log_softmax(a), per head, as refimpl.gma._gma_forward
    variances = numerics.softplus(raw_variances) + raw_variances.dtype.type(min_variance)
    log_weights = np.stack([numerics.log_softmax(row) for row in logits])
    xq, xk, m, var, out, scan = _forward(x_q, x_k, v, means, variances, log_weights, causal, eps, chunk_size, leading)
    sig = to_device(np.ascontiguousarray(expit(raw_variances)), means.dtype)
    cache = GMADeviceCache(leading, per_head, on_device, xq, xk, m, var, sig, scan)
    return result(out.reshape(leading + tuple(out.shape)[1:]), on_device), cache


def gma_backward(grad_out, cache) -> GMAGrads:
    """Gradients of :func:`gma_forward` on the GPU (:func:`refimpl.gma.gma_backward`); returns new arrays.

    Parameters
    ----------
    grad_out : array_like or device array, shape (..., N_q, d_v)
        ``dL/d out``.
    cache : GMADeviceCache
        From :func:`gma_forward`.

    Returns
    -------
    refimpl.gma.GMAGrads
        ``x_q`` (..., N_q, d_r), ``x_k`` (..., N_k, d_r), ``v`` (..., N_k, d_v),
        ``means`` and ``raw_variances`` of the GMM's shape, ``logits`` (K,) or
        (H, K) (per head: sums over that head's sequences; shared: over every
        sequence).  Device arrays when the forward's inputs or ``grad_out``
        included one.
    """
    validation.check_instance(cache, "cache", GMADeviceCache, "the GMADeviceCache from gpu.numba_cuda.gma.gma_forward")
    scan = cache.scan
    dtype = scan.out.dtype
    out_shape = cache.leading + tuple(scan.out.shape)[1:]
    check_gma_grad_out(host_view(grad_out), out_shape, dtype)
    on_device = cache.on_device or is_device_array(grad_out)
    g = _flat(grad_out, dtype, cache.leading)
    checks = Checks(dtype)
    if is_device_array(grad_out):
        checks.finite(g, "grad_out")
    # the one copy of the call: grad_out's check (a backward has no other), before the kernels read it
    raise_bad_inputs(checks.fetch(), ((grad_out, "grad_out"),))
    dphi_q, dphi_k, dv = scan_backward_device(g, scan)
    means, variances = cache.means, cache.variances
    H, K, d = means.shape
    parts = []
    dxs = []
    for x, gamma, dgamma in ((cache.x_q, scan.phi_q, dphi_q), (cache.x_k, scan.phi_k, dphi_k)):
        B, N, _ = x.shape
        c = cuda.device_array(gamma.shape, dtype=dtype)
        dx = cuda.device_array(x.shape, dtype=dtype)
        _responsibility_rows[(blocks(N, TILE), B), (TILE, TILE)](x, gamma, dgamma, means, variances, c, dx)
        segment = device_scan.SEGMENT  # read at call time
        n_seg = blocks(N, segment)
        part_mu = cuda.device_array((B, n_seg, K, d), dtype=dtype)
        part_var = cuda.device_array((B, n_seg, K, d), dtype=dtype)
        part_c = cuda.device_array((B, n_seg, K), dtype=dtype)
        grid = (n_seg * blocks(K, TILE) * blocks(d, TILE), B)
        _parameter_partials[grid, (TILE, TILE)](x, c, means, variances, segment, part_mu, part_var, part_c)
        parts.append((part_mu, part_var, part_c))
        dxs.append(dx)
    dmeans = cuda.device_array((H, K, d), dtype=dtype)
    draw = cuda.device_array((H, K, d), dtype=dtype)
    dlogits = cuda.device_array((H, K), dtype=dtype)
    n = H * K * (d + 1)
    _parameter_sums[blocks(n, THREADS), THREADS](*parts[0], *parts[1], variances, cache.sigmoid_raw, dmeans, draw, dlogits)
    lead = cache.leading
    if not cache.per_head:
        dmeans, draw, dlogits = dmeans.reshape(K, d), draw.reshape(K, d), dlogits.reshape(K)
    return GMAGrads(
        x_q=result(dxs[0].reshape(lead + tuple(dxs[0].shape)[1:]), on_device),
        x_k=result(dxs[1].reshape(lead + tuple(dxs[1].shape)[1:]), on_device),
        v=result(dv.reshape(lead + tuple(dv.shape)[1:]), on_device),
        means=result(dmeans, on_device),
        raw_variances=result(draw, on_device),
        logits=result(dlogits, on_device),
    )
