r"""Gaussian Mixture Attention with CuPy: :func:`refimpl.gma.gma`, :func:`refimpl.gma.gma_forward`, :func:`refimpl.gma.gma_backward`.

What it computes
----------------
What :mod:`refimpl.gma` computes, for every sequence of a batch at once:
``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``, ``v (..., N_k, d_v)``, one
GMM shared by every sequence (``means (K, d_r)``) or one per head
(``means (H, K, d_r)``, ``H`` the last leading dimension).  The
responsibilities come from :mod:`gpu.cupy_kernels.gmm`, the mixing from the
scan of :mod:`gpu.cupy_kernels.scan`.

Launch plan
-----------
Forward: the parameter maps ``sigma^2 = softplus(s) + sigma2_min``
(an element-wise kernel) and ``log pi = log_softmax(a)`` (the row kernel of
``gmm.cu``); per side, one GEMM and one row kernel for the responsibilities
(the sequences ``(g, h)`` laid out ``(G, H, N, .)``, a batched GEMM over
the heads); then the scan: the write ``Gamma_K^T [V, 1]`` and the read
``Gamma_Q [S, z]`` are batched GEMMs, and when causal the chunk states too,
with the masked within-chunk blocks in one kernel (``scan.cu``).

Backward: the scan's backward (GEMMs and the chunk kernel), then, per side,
the gradients through the responsibilities as the matrix products of
``docs/derivations/gma.md#parameter-gradients-as-matrix-products``
(:func:`refimpl.tuned.gma_backward` on the host): the softmax backward (a row
reduction and an element-wise kernel), ``dx`` (one GEMM and an element-wise
kernel) and the sums over the tokens (one GEMM); the ``(K, d_r)`` parameter
gradients are finished with array code and the chain rule through the
softplus (an element-wise kernel).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.special import expit

from refimpl import boundary, numerics, validation
from refimpl.gma import GMAGrads, check_gma_grad_out, check_gma_results

from ._backend import (
    Checks, Elementwise, as_module_array, backend, host_view, is_device_array, matmul, result, to_host,
)
from .gmm import expansion, head_matmul, normalise_rows, posterior_xp, raise_bad_input, refine_xp
from .scan import row_dot, scan_backward_xp, scan_forward_xp

__all__ = ["gma", "gma_forward", "gma_backward", "GMADeviceCache"]

# sigma^2 = softplus(s) + sigma2_min, softplus(s) = logaddexp(0, s) as NumPy evaluates it
softplus_floor = Elementwise(
    "gma_softplus_floor", "T s, T m", "T y",
    "y = (s == (T)0 ? log((T)2) : (s > (T)0 ? s + log1p(exp(-s)) : log1p(exp(s)))) + m",
    twin=lambda s, m: numerics.softplus(s) + m,
)

# dL/ds = dL/dsigma^2 * sigmoid(s): sigma2 = softplus(s) + sigma2_min, dsigma2/ds = sigmoid(s)
sigmoid_chain = Elementwise(
    "gma_sigmoid_chain", "T g, T s", "T y",
    "y = g * ((T)1 / ((T)1 + exp(-s)))",
    twin=lambda g, s: g * expit(s),
)

# dL/dl_m = gamma_m (g_m - gbar) with gbar = sum_m gamma_m g_m (softmax Jacobian)
softmax_jacobian = Elementwise(
    "gma_softmax_jacobian", "T gam, T g, T gbar", "T c",
    "c = gam * (g - gbar)",
    twin=lambda gam, g, gbar: gam * (g - gbar),
)

# dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2 = (c @ (mc p))_i - xc_i * (c @ p)_i
dx_terms = Elementwise(
    "gma_dx_terms", "T a, T b, T xc", "T dx",
    "dx = a - xc * b",
    twin=lambda a, b, xc: a - xc * b,
)


class GMADeviceCache(NamedTuple):
    """What :func:`gma_backward` needs from :func:`gma_forward`: the batch laid out as ``G x H`` sequences on the device."""

    leading: tuple  # the leading (batch) shape of x_q, x_k and v
    per_head: bool  # True when the GMM has a head axis
    on_device: bool  # whether the forward's inputs were device arrays
    x_q: object  # (G, H, N_q, d_r)
    x_k: object  # (G, H, N_k, d_r)
    v: object  # (G H, N_k, d_v)
    means: object  # (H, K, d_r)
    raw_variances: object  # (H, K, d_r)
    variances: object  # (H, K, d_r)
    gamma_q: object  # (G, H, N_q, K)
    gamma_k: object  # (G, H, N_k, K)
    out: object  # (G H, N_q, d_v)
    den: object  # (G H, N_q)
    causal: bool
    eps: float
    chunk_size: int


def _layout(leading, per_head):
    """``(G, H)``: the sequences of the leading shape as ``G`` groups of ``H`` heads (``H = 1`` for a shared GMM)."""
    B = math.prod(leading)
    H = leading[-1] if per_head else 1
    return B // H, H


#: The checks of a forward, in the order refimpl evaluates them: the inputs, then the results.
FORWARD_CHECKS = ("x_q", "x_k", "v", "suspect:x_q", "suspect:x_k", "min_quad:x_q", "min_quad:x_k", "den")


def _forward_core(xp, x_q, x_k, v, means, variances, log_weights, per_head, causal, eps, chunk_size, on_device=(False,) * 3):
    """Core: ``(out, gamma_q, gamma_k, den, min_quad_q, min_quad_k)`` in the ``(G, H, N, .)`` layout, then the checks.

    The checks (device inputs that are not finite, suspect rows, ``min_quad``
    that is not finite, and with ``eps = 0`` denominators that are not > 0)
    are counted on the device and copied to the host once; the errors are
    refimpl's (:func:`refimpl.gma.check_gma_results`).  Only when the screen
    flags rows are they recomputed (:func:`gpu.cupy_kernels.gmm.refine_xp`)
    and the scan run again: the rare path, with syncs of its own.
    """
    leading = x_q.shape[:-2]
    G, H = _layout(leading, per_head)
    B = G * H
    (Nq, d), (Nk, dv) = x_q.shape[-2:], v.shape[-2:]
    checks = Checks(xp, FORWARD_CHECKS)
    if on_device[2]:
        checks.count_bad(v, "v")
    ex = expansion(xp, means, variances, log_weights)
    xq4, xk4 = x_q.reshape(G, H, Nq, d), x_k.reshape(G, H, Nk, d)
    gamma_q, mq_q = posterior_xp(xp, xq4, ex, checks=checks, side="x_q", count_x=on_device[0])
    gamma_k, mq_k = posterior_xp(xp, xk4, ex, checks=checks, side="x_k", count_x=on_device[1])
    K = gamma_q.shape[-1]

    def scan():
        # O = (Gamma_Q Gamma_K^T V) / (Gamma_Q Gamma_K^T 1 + eps), by the scan
        return scan_forward_xp(xp, gamma_q.reshape(B, Nq, K), gamma_k.reshape(B, Nk, K), v.reshape(B, Nk, dv), causal, eps, chunk_size)

    out, den = scan()
    if eps == 0:
        checks.count_bad(xp.ascontiguousarray(den), "den", positive=True)
    checks.fetch()
    for name, a in (("x_q", x_q), ("x_k", x_k), ("v", v)):
        raise_bad_input(checks, name, a)
    if checks.failed("suspect:x_q") or checks.failed("suspect:x_k"):
        # the rare path: rows that cancellation may have spoiled, recomputed from the differences; the scan again
        refine_xp(xp, xq4, gamma_q, mq_q, ex)
        refine_xp(xp, xk4, gamma_k, mq_k, ex)
        out, den = scan()
        check_gma_results(to_host(mq_q).reshape(-1), to_host(mq_k).reshape(-1), to_host(den).reshape(-1), eps)
    elif checks.failed("min_quad:x_q") or checks.failed("min_quad:x_k") or checks.failed("den"):
        check_gma_results(to_host(mq_q).reshape(-1), to_host(mq_k).reshape(-1), to_host(den).reshape(-1), eps)
    return out, gamma_q, gamma_k, den, mq_q, mq_k


def _heads(a, per_head):
    """Parameters with a head axis: ``(H, ...)`` as they are, shared ones with ``H = 1``."""
    return a if per_head else a[None]


def _gma_kernel(xp, args, given):
    """:func:`refimpl.gma.gma` on refimpl's checked arguments, computed with the array module ``xp`` (NumPy or CuPy)."""
    x_q, x_k, v = given[:3]
    on_device = any(is_device_array(a) for a in given)
    _, _, _, means, variances, weights, causal, eps, chunk_size = args
    dtype = means.dtype
    tokens_on_device = tuple(is_device_array(a) for a in (x_q, x_k, v))
    x_q, x_k, v = (as_module_array(xp, a, dtype) for a in (x_q, x_k, v))
    per_head = means.ndim == 3
    # a zero weight is a component that never wins: log 0 = -inf
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    params = (as_module_array(xp, _heads(a, per_head), dtype) for a in (means, variances, log_weights))
    out = _forward_core(xp, x_q, x_k, v, *params, per_head, causal, eps, chunk_size, tokens_on_device)[0]
    return result(out.reshape(x_q.shape[:-1] + v.shape[-1:]), on_device)


def _gma_forward_kernel(xp, args, given):
    """:func:`refimpl.gma.gma_forward` on refimpl's checked arguments, computed with ``xp``: ``(out, GMADeviceCache)``."""
    x_q, x_k, v = given[:3]
    on_device = any(is_device_array(a) for a in given)
    _, _, _, means, raw_variances, logits, causal, eps, min_variance, chunk_size = args
    dtype = means.dtype
    tokens_on_device = tuple(is_device_array(a) for a in (x_q, x_k, v))
    x_q, x_k, v = (as_module_array(xp, a, dtype) for a in (x_q, x_k, v))
    per_head = means.ndim == 3
    means, raw_variances, logits = (as_module_array(xp, _heads(a, per_head), dtype) for a in (means, raw_variances, logits))
    # sigma^2 = softplus(s) + sigma2_min
    variances = softplus_floor(raw_variances, xp.asarray(min_variance, dtype=dtype))
    # log pi = log_softmax(a), never log(softmax(a)): a weight of 1e-320 keeps its log (the row kernel, zero offsets)
    log_weights = logits.copy()
    zeros = xp.zeros((1, logits.shape[1]), dtype=dtype)
    normalise_rows(xp, log_weights, zeros, zeros, logits.shape[0], log=True)
    out, gamma_q, gamma_k, den, mq_q, mq_k = _forward_core(
        xp, x_q, x_k, v, means, variances, log_weights, per_head, causal, eps, chunk_size, tokens_on_device
    )
    leading = x_q.shape[:-2]
    G, H = _layout(leading, per_head)
    cache = GMADeviceCache(
        leading, per_head, on_device, x_q.reshape(G, H, *x_q.shape[-2:]), x_k.reshape(G, H, *x_k.shape[-2:]),
        v.reshape(G * H, *v.shape[-2:]), means, raw_variances, variances, gamma_q, gamma_k, out, den, causal, eps, chunk_size,
    )
    return result(out.reshape(leading + out.shape[-2:]), on_device), cache


def _token_sums(xp, c, b):
    """``sum over the tokens of every sequence of head h of c^T b``: ``c (G, H, N, K)``, ``b (G, H, N, m)`` -> ``(H, K, m)``."""
    G, H, N, K = c.shape
    if H == 1:
        return matmul(xp, c.reshape(G * N, K).T, b.reshape(G * N, b.shape[3]))[None]
    return matmul(xp, c.swapaxes(-1, -2), b).sum(axis=0)


def _responsibility_backward(xp, x, gamma, grad, mc, prec, centre):
    """Push ``dL/dgamma`` (G, H, N, K) through ``gamma = softmax(l(x))``: ``(dx, csum (H, K), c^T [xc^2, xc] (H, K, 2d))``."""
    G, H, N, d = x.shape
    gbar = row_dot(gamma, grad)
    c = softmax_jacobian(gamma, grad, gbar[..., None])
    xcat = xp.empty((G, H, N, 2 * d), dtype=x.dtype)  # [xc^2, xc]
    xc = xcat[..., d:]
    xp.subtract(x, centre[:, None, :], out=xc)
    xp.multiply(xc, xc, out=xcat[..., :d])
    # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2: one GEMM c @ [mc p, p], then the element-wise terms
    t = head_matmul(xp, c, xp.ascontiguousarray(xp.concatenate([mc * prec, prec], axis=2)))
    dx = dx_terms(t[..., :d], t[..., d:], xc)
    return dx, c.sum(axis=(0, 2)), _token_sums(xp, c, xcat)


def _parameter_grads(csum, sums, mc, prec, variances):
    """``(dmeans, dvariances)`` (H, K, d) from the sums over the tokens of one side (:func:`refimpl.gma._responsibility_backward`)."""
    d = mc.shape[2]
    ctx2, ctx = sums[..., :d], sums[..., d:]
    # dL/dmu_m = sum_i c_im (x_i - mu_m) / sigma_m^2
    dmeans = (ctx - csum[..., None] * mc) * prec
    # dL/dsigma2_mj = sum_i c_im ((x_ij - mu_mj)^2 - sigma2_mj) / (2 sigma2_mj^2), (x - mu)^2 expanded
    sq = ctx2 - 2.0 * mc * ctx + (mc * mc - variances) * csum[..., None]
    return dmeans, 0.5 * sq * prec * prec


def _gma_backward_kernel(xp, grad_out, cache):
    """:func:`refimpl.gma.gma_backward` from a :class:`GMADeviceCache`, computed with ``xp``."""
    validation.check_instance(cache, "cache", GMADeviceCache, "the GMADeviceCache from gpu.cupy_kernels.gma.gma_forward")
    on_device = cache.on_device or is_device_array(grad_out)
    dtype = cache.out.dtype
    out_shape = cache.leading + cache.out.shape[-2:]
    check_gma_grad_out(host_view(grad_out), out_shape, np.dtype(dtype))
    checks = Checks(xp, ["grad_out"])
    g = as_module_array(xp, grad_out, dtype).reshape(cache.out.shape)
    if is_device_array(grad_out):
        checks.count_bad(g, "grad_out")
    G, H, Nq, K = cache.gamma_q.shape
    Nk = cache.gamma_k.shape[2]
    dphi_q, dphi_k, dv = scan_backward_xp(
        xp, g, cache.gamma_q.reshape(G * H, Nq, K), cache.gamma_k.reshape(G * H, Nk, K), cache.v, cache.out, cache.den,
        cache.causal, cache.chunk_size,
    )
    means, variances = cache.means, cache.variances
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # x - mu is invariant under the common shift by the centre of the means
        centre = means.mean(axis=1)
        mc = means - centre[:, None, :]
        prec = 1.0 / variances
        dx_q, csum_q, sums_q = _responsibility_backward(xp, cache.x_q, cache.gamma_q, dphi_q.reshape(G, H, Nq, K), mc, prec, centre)
        dx_k, csum_k, sums_k = _responsibility_backward(xp, cache.x_k, cache.gamma_k, dphi_k.reshape(G, H, Nk, K), mc, prec, centre)
        dmu_q, dvar_q = _parameter_grads(csum_q, sums_q, mc, prec, variances)
        dmu_k, dvar_k = _parameter_grads(csum_k, sums_k, mc, prec, variances)
    # sigma2 = softplus(s) + sigma2_min: dsigma2/ds = sigmoid(s); dL/da_k = c_k (the log-softmax term vanishes)
    params = (dmu_q + dmu_k, sigmoid_chain(dvar_q + dvar_k, cache.raw_variances), csum_q + csum_k)
    if not cache.per_head:
        params = tuple(p[0] for p in params)
    # the one copy of the call: grad_out's check (a backward has no other)
    raise_bad_input(checks.fetch(), "grad_out", grad_out)
    lead = cache.leading
    return GMAGrads(
        x_q=result(dx_q.reshape(lead + dx_q.shape[-2:]), on_device),
        x_k=result(dx_k.reshape(lead + dx_k.shape[-2:]), on_device),
        v=result(dv.reshape(lead + dv.shape[-2:]), on_device),
        means=result(params[0], on_device),
        raw_variances=result(params[1], on_device),
        logits=result(params[2], on_device),
    )


#: GMA bound to refimpl's boundary, which writes the signatures, docstrings and checks once.
KERNELS = {"gma": _gma_kernel, "gma_forward": _gma_forward_kernel, "gma_backward": _gma_backward_kernel}
_public = boundary.bind(backend(KERNELS), module=__name__)
gma = _public.gma
gma_forward = _public.gma_forward
gma_backward = _public.gma_backward
