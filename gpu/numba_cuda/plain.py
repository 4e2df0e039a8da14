r"""gpu.numba_cuda.plain: a plain kernel beside each tuned one, one thread per output element.

The kernels of :mod:`gpu.numba_cuda` are tuned: register tiles, shared
memory staged in stages, straight-line code built by closures, launch bounds.
When one of them gives a wrong answer on a GPU, the question is whether the
kernel is wrong or the device (its driver, the compiler, the toolkit) is.
The kernels here answer it: each computes the same thing in the plainest way,
in the style of Numba-CUDA's documentation examples (``cuda.grid``, a bounds
test, a loop; declared with ``_device.kernel`` and their argument types, like
every kernel of the package, so that they are compiled for sm_90 without a
GPU): **one thread per output element**, reading what it needs from
global memory, no shared memory, no tile, no reduction between threads.  They
are slow and easy to check by eye; ``python -m gpu check`` runs them as a
second opinion when a tuned kernel's test fails, and lesson 9 reads them
before the tuned ones.

===================  ======================================================  ============================
kernel               one thread computes                                     tuned kernel beside it
===================  ======================================================  ============================
:func:`log_joint`    the logit ``l_ik`` of row ``i``, component ``k``        ``gmm._posterior_tiles``
:func:`row_softmax`  ``gamma_ik`` (or its log) from row ``i``'s logits       its fused epilogue
:func:`write`        entry ``(k, e)`` of the state ``Gamma_K^T [V, 1]``      ``scan._chunk_states``
:func:`read`         entry ``(i, e)`` of ``Gamma_Q [S, z]``, divided         ``scan._chunk_rows``
:func:`causal_scan`  entry ``(t, e)`` of the causal output, keys ``j <= t``  the three steps of the scan
:func:`attention`    entry ``(i, e)`` of ``softmax(scale q k^T) v``          ``attention._flash_forward``
:func:`ovq_readout`  entry ``(a, e)`` of an OVQ chunk's read-out             ``ovq._predict_kernel``
===================  ======================================================  ============================

The backend they make, bound through :mod:`refimpl.boundary` like the others
(``tests/test_conformance.py`` holds it to the reference at the simulator's
tiny sizes): ``responsibilities`` and ``log_responsibilities``; ``gma`` (the
reference's batch rule around the kernels above; no ``gma_forward`` or
backward: the tuned backend's gradients are checked against the reference's
own); ``softmax_attention``; ``ovq_attention`` (the reference's chunk loop,
each chunk's read-out by :func:`ovq_readout`; no ``vq_attention``).  NumPy arrays in, NumPy
arrays out: every call copies its inputs to the device and its result back.
"""

from __future__ import annotations

import math

import numpy as np
from numba import boolean, cuda

from refimpl import boundary, validation
from refimpl import ovq as spec_ovq
from refimpl.scan import FeatureAttentionCache

from . import _device
from ._device import kernel

__all__ = ["log_joint", "row_softmax", "write", "read", "causal_scan", "attention", "ovq_readout", "BACKEND",
           "responsibilities", "log_responsibilities", "gma", "softmax_attention", "ovq_attention"]

#: Threads per block in x and y: 16 x 16 on a GPU; 4 x 4 in the simulator, where every thread is a Python thread.
THREADS = (4, 4) if _device.SIMULATOR else (16, 16)
#: How every kernel is declared (:func:`gpu.numba_cuda._device.kernel`, so that the PTX and ptxas tests compile it):
#: its block size and its tag; each kernel's signature (its argument types for a float type ``f``) is above it.
PLAIN = {"threads": THREADS[0] * THREADS[1], "tags": ("plain",)}
LOG_2PI = math.log(2.0 * math.pi)


# ---------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------


@kernel(lambda f: (f[:, ::1], f[:, ::1], f[:, ::1], f[::1], f[:, ::1], f[:, ::1]), **PLAIN)
def log_joint(x, means, variances, log_weights, logits, quad):
    # logits[i, k] = log pi_k - (1/2) sum_j (log 2 pi sigma2_kj + (x_ij - mu_kj)^2 / sigma2_kj); quad[i, k] the sum of
    # squares: thread (i, k), the differences themselves (every term >= 0: nothing cancels)
    i, k = cuda.grid(2)
    if i < x.shape[0] and k < means.shape[0]:
        half = x.dtype.type(0.5)
        q = x.dtype.type(0)
        log_det = x.dtype.type(x.shape[1] * LOG_2PI)
        for j in range(x.shape[1]):
            diff = x[i, j] - means[k, j]
            q += diff * diff / variances[k, j]
            log_det += math.log(variances[k, j])
        quad[i, k] = q
        logits[i, k] = (log_weights[k] - half * log_det) - half * q


@kernel(lambda f: (f[:, ::1], boolean, f[:, ::1]), **PLAIN)
def row_softmax(logits, log, out):
    # out[i, k] = exp(l_ik - m_i) / s_i, or l_ik - m_i - log s_i: m_i the row's maximum, s_i = sum_m exp(l_im - m_i);
    # thread (i, k) reads its whole row twice
    i, k = cuda.grid(2)
    if i < logits.shape[0] and k < logits.shape[1]:
        m = logits[i, 0]
        for c in range(1, logits.shape[1]):
            m = _max(m, logits[i, c])
        s = logits.dtype.type(0)
        for c in range(logits.shape[1]):
            s += math.exp(logits[i, c] - m)
        if log:
            out[i, k] = logits[i, k] - m - math.log(s)
        else:
            out[i, k] = math.exp(logits[i, k] - m) / s


@kernel(lambda f: (f[:, ::1], f[:, ::1], f[:, ::1]), **PLAIN)
def write(phi_k, v, state):
    # state[k, e] = sum_j phi_k[j, k] [v_j, 1]_e: the bidirectional state [S, z] (K, d_v + 1), thread (k, e)
    k, e = cuda.grid(2)
    if k < state.shape[0] and e < state.shape[1]:
        acc = v.dtype.type(0)
        for j in range(phi_k.shape[0]):
            acc += phi_k[j, k] * (v[j, e] if e < v.shape[1] else v.dtype.type(1))
        state[k, e] = acc


@kernel(lambda f: (f[:, ::1], f[:, ::1], f, f[:, ::1], f[::1]), **PLAIN)
def read(phi_q, state, eps, out, den):
    # out[i, e] = phi_q_i . S[:, e] / (phi_q_i . z + eps), den[i] the denominator: thread (i, e), the last column z
    i, e = cuda.grid(2)
    if i < out.shape[0] and e < out.shape[1]:
        num = phi_q.dtype.type(0)
        norm = phi_q.dtype.type(0)
        for k in range(phi_q.shape[1]):
            num += phi_q[i, k] * state[k, e]
            norm += phi_q[i, k] * state[k, out.shape[1]]
        norm += eps
        out[i, e] = num / norm
        if e == 0:
            den[i] = norm


@kernel(lambda f: (f[:, ::1], f[:, ::1], f[:, ::1], f, f[:, ::1], f[::1]), **PLAIN)
def causal_scan(phi_q, phi_k, v, eps, out, den):
    # out[t, e] = sum_{j <= t} (phi_q_t . phi_k_j) v_je / (sum_{j <= t} phi_q_t . phi_k_j + eps): the token recurrence
    # S_t = S_{t-1} + phi_k_t v_t^T read at every t at once; thread (t, e) walks the keys j <= t
    t, e = cuda.grid(2)
    if t < out.shape[0] and e < out.shape[1]:
        num = v.dtype.type(0)
        norm = v.dtype.type(0)
        for j in range(t + 1):
            a = v.dtype.type(0)
            for k in range(phi_q.shape[1]):
                a += phi_q[t, k] * phi_k[j, k]
            num += a * v[j, e]
            norm += a
        norm += eps
        out[t, e] = num / norm
        if e == 0:
            den[t] = norm


@kernel(lambda f: (f[:, :, ::1], f[:, :, ::1], f[:, :, ::1], f, boolean, f[:, :, ::1], f[:, ::1]), **PLAIN)
def attention(q, k, v, scale, causal, out, row_max):
    # out[b, i, e] = sum_j softmax_j(scale q_bi . k_bj) v_bje (keys j <= i when causal): thread (b N_q + i, e), three
    # passes over the keys (the maximum, then the sums); row_max[b, i] the maximum score
    r, e = cuda.grid(2)
    b, i = r // q.shape[1], r % q.shape[1]
    if b < q.shape[0] and e < v.shape[2]:
        last = i + 1 if causal else k.shape[1]
        m = scale * _dot(q, k, b, i, 0)
        for j in range(1, last):
            m = _max(m, scale * _dot(q, k, b, i, j))
        s = q.dtype.type(0)
        acc = q.dtype.type(0)
        for j in range(last):
            p = math.exp(scale * _dot(q, k, b, i, j) - m)
            s += p
            acc += p * v[b, j, e]
        out[b, i, e] = acc / s
        if e == 0:
            row_max[b, i] = m


@cuda.jit(device=True)
def _max(a, b):
    # the larger of a and b, NaN if either is NaN (as NumPy's max: the checks see a NaN score)
    return b if b > a or b != b else a


@cuda.jit(device=True)
def _dot(q, k, b, i, j):
    acc = q.dtype.type(0)
    for c in range(q.shape[2]):
        acc += q[b, i, c] * k[b, j, c]
    return acc


@kernel(lambda f: (f[:, ::1], f[:, ::1], f[:, ::1], f[:, ::1], f[:, ::1], f[::1], f, f[:, ::1], f[::1]), **PLAIN)
def ovq_readout(qhat, khat, dict_keys, dict_values, v, log_c, beta, out, row_max):
    # out[a, e]: row a's softmax over the n centroids (logit beta qhat_a . D_m + log c_m) and the chunk's keys b <= a
    # (logit beta qhat_a . khat_b), times their values D_v and v; thread (a, e); row_max[a] the largest logit
    a, e = cuda.grid(2)
    n = dict_keys.shape[0]
    if a < out.shape[0] and e < out.shape[1]:
        m = _ovq_logit(qhat, khat, dict_keys, log_c, beta, a, 0)
        for j in range(1, n + a + 1):
            m = _max(m, _ovq_logit(qhat, khat, dict_keys, log_c, beta, a, j))
        s = qhat.dtype.type(0)
        acc = qhat.dtype.type(0)
        for j in range(n + a + 1):
            p = math.exp(_ovq_logit(qhat, khat, dict_keys, log_c, beta, a, j) - m)
            s += p
            acc += p * (dict_values[j, e] if j < n else v[j - n, e])
        out[a, e] = acc / s
        if e == 0:
            row_max[a] = m


@cuda.jit(device=True)
def _ovq_logit(qhat, khat, dict_keys, log_c, beta, a, j):
    n = dict_keys.shape[0]
    acc = qhat.dtype.type(0)
    for c in range(qhat.shape[1]):
        acc += qhat[a, c] * (dict_keys[j, c] if j < n else khat[j - n, c])
    return acc * beta + (log_c[j] if j < n else qhat.dtype.type(0))


# ---------------------------------------------------------------------------
# Launching them: a 2-D grid over the output, host arrays in and out
# ---------------------------------------------------------------------------


def _grid(rows, cols):
    """The blocks of :data:`THREADS` threads that cover a ``rows x cols`` output (at least one each way)."""
    return (_device.blocks(rows, THREADS[0]), _device.blocks(cols, THREADS[1]))


def _launch(kernel, shape, *args):
    kernel[_grid(*shape), THREADS](*args)


def posterior(x, means, variances, log_weights, *, log=False):
    """``(gamma or log gamma (N, K), min_quad (N,))`` of checked host arrays: :func:`log_joint`, then :func:`row_softmax`."""
    N, K = x.shape[0], means.shape[0]
    logits, quad, out = (cuda.device_array((N, K), dtype=x.dtype) for _ in range(3))
    _launch(log_joint, (N, K), x, means, variances, log_weights, logits, quad)
    _launch(row_softmax, (N, K), logits, log, out)
    quad = quad.copy_to_host()
    return out.copy_to_host(), (np.min(quad, axis=1) if K else np.full(N, np.inf, x.dtype))


def scan_forward(phi_q, phi_k, v, causal, eps, chunk_size):
    """:func:`refimpl.scan.scan_forward` by :func:`write` and :func:`read`, or :func:`causal_scan`: ``(out, cache)``."""
    (N, K), d_v = phi_q.shape, v.shape[1]
    eps = phi_q.dtype.type(eps)
    out, den = cuda.device_array((N, d_v), dtype=phi_q.dtype), cuda.device_array(N, dtype=phi_q.dtype)
    if causal:
        _launch(causal_scan, (N, d_v), phi_q, phi_k, v, eps, out, den)
    else:
        state = cuda.device_array((K, d_v + 1), dtype=phi_q.dtype)
        _launch(write, (K, d_v + 1), phi_k, v, state)
        _launch(read, (N, d_v), phi_q, state, eps, out, den)
    out = out.copy_to_host()
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den.copy_to_host(), causal, eps, chunk_size)


def _softmax_attention_kernel(xp, checked, given):
    """:func:`refimpl.attention.softmax_attention` on checked arguments: :func:`attention` over every sequence at once."""
    q, k, v, scale, causal, batch_shape = checked
    (N_q, d), (N_k, d_v) = q.shape[-2:], v.shape[-2:]
    B = int(np.prod(batch_shape, dtype=np.int64))
    out, row_max = cuda.device_array((B, N_q, d_v), dtype=q.dtype), cuda.device_array((B, N_q), dtype=q.dtype)
    flat = (np.ascontiguousarray(a).reshape(B, *a.shape[-2:]) for a in (q, k, v))
    _launch(attention, (B * N_q, d_v), *flat, q.dtype.type(scale), bool(causal), out, row_max)
    validation.check_score_maxima(row_max.copy_to_host())
    return out.copy_to_host().reshape(batch_shape + (N_q, d_v))


def _ovq_predict(qhat, khat, dict_keys, dict_values, vc, log_c, beta, mask):
    """One chunk's read-out by :func:`ovq_readout`: ``(out rows, each row's largest logit as a column)``."""
    L, dtype = qhat.shape[0], qhat.dtype
    log_c = np.zeros(dict_keys.shape[0], dtype) if log_c is None else log_c
    out, row_max = cuda.device_array((L, vc.shape[1]), dtype=dtype), cuda.device_array(L, dtype=dtype)
    arrays = (np.ascontiguousarray(a, dtype=dtype) for a in (qhat, khat, dict_keys, dict_values, vc, log_c))
    _launch(ovq_readout, (L, vc.shape[1]), *arrays, dtype.type(beta), out, row_max)
    return out.copy_to_host(), row_max.copy_to_host()[:, None]


def _ovq_attention_kernel(xp, a, given, return_state):
    """:func:`refimpl.ovq.ovq_attention` on checked arguments: the reference's chunk loop, the read-outs by the kernel."""
    out, new_state, _, overflow = spec_ovq._ovq_chunks(a.q, a.k, a.v, a.params, a.state, record=False, predict=_ovq_predict)
    spec_ovq.check_overflow(overflow, a.state, a.dtype)
    return (out, spec_ovq.OVQState(*new_state)) if return_state else out


# ---------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------

#: The plain kernels' backend record: :func:`refimpl.boundary.bind` makes its public functions.
BACKEND = boundary.Backend(
    "gpu.numba_cuda.plain",
    "Computed by the plain kernels of :mod:`gpu.numba_cuda.plain` (one thread per output element; in the CUDA "
    "simulator without a GPU), a second opinion on the tuned kernels.",
    {**{name: kern for name, kern in boundary.host_kernels(posterior, scan_forward=scan_forward).items() if name != "gma_forward"},
     "softmax_attention": _softmax_attention_kernel, "ovq_attention": _ovq_attention_kernel},
    module=_device.ready,
)

_public = boundary.bind(BACKEND, module=__name__)
responsibilities = _public.responsibilities
log_responsibilities = _public.log_responsibilities
gma = _public.gma
softmax_attention = _public.softmax_attention
ovq_attention = _public.ovq_attention
