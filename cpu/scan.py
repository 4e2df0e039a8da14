r"""The causal scan as one Numba kernel: :func:`refimpl.scan.scan_forward` and :func:`~refimpl.scan.scan_backward` on the CPU.

Every sum of the causal form and of its backward (``docs/derivations/scan.md``)
is one contraction with a running state:

.. math::

    \mathrm{out}_t[i] = \sum_m \Big(\sum_{j \le t} b_j[i]\, a_j[m]\Big)\, w_t[m]
    \qquad (\text{or } j \ge t \text{ for the reverse sweep}),

which :func:`prefix_contract` computes token by token, keeping the state
``sum_j a_j b_j^T`` (``M x I``).  With ``v1 = [v, 1]`` and
``g1 = [g / den, -(g . out) / den]``:

* forward numerators: ``b = v1``, ``a = phi_k``, ``w = phi_q`` (the last
  column is the denominator);
* ``dphi_q``: ``b = phi_k``, ``a = v1``, ``w = g1``;
* ``dphi_k``: ``b = phi_q``, ``a = g1``, ``w = v1``, reverse;
* ``dv``: ``b = g1[:, :d_v]`` (``g / den``), ``a = phi_q``, ``w = phi_k``,
  reverse.

How the work maps onto the loops: ``prange`` over blocks of :data:`COLS`
output columns ``i``; each thread keeps the state of its columns and runs
over the tokens, the inner loops contiguous in ``i`` (they vectorise).  Every
output entry is computed by one thread in the same order whatever the
number of threads.  The bidirectional form is two matrix products (write,
then read) and stays with :mod:`refimpl.scan`.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from refimpl import scan as ref_scan
from refimpl.scan import FeatureAttentionCache, FeatureAttentionGrads

from ._jit import pick, threaded_and_serial

__all__ = ["prefix_contract", "scan_forward", "scan_backward"]

COLS = 8
"""Output columns per thread's block: two AVX2 vectors of float64."""


def _prefix_contract(b, a, w, reverse, out):
    # b and out have a multiple of COLS columns: every inner loop has COLS trips, known when compiling
    n, I = b.shape
    M = a.shape[1]
    for blk in prange(I // COLS):
        i0 = blk * COLS
        state = np.zeros((M, COLS), b.dtype)
        for step in range(n):
            t = n - 1 - step if reverse else step
            acc = np.zeros(COLS, b.dtype)
            for m in range(M):
                am, wm = a[t, m], w[t, m]
                for i in range(COLS):
                    # the state after token t: sum_{j <= t} a_j b_j^T (j >= t in reverse), then its product with w_t
                    s = state[m, i] + am * b[t, i0 + i]
                    state[m, i] = s
                    acc[i] += wm * s
            for i in range(COLS):
                out[t, i0 + i] = acc[i]


_PREFIX_CONTRACT = threaded_and_serial(_prefix_contract)


def prefix_contract(b, a, w, *, reverse=False):
    """Core: ``out_t = (sum_{j <= t} b_j a_j^T) w_t`` for every token ``t`` (``j >= t`` when ``reverse``).

    Parameters
    ----------
    b : ndarray, shape (N, I)
    a, w : ndarray, shape (N, M)
        One float dtype for the three.
    reverse : bool
        Suffix sums instead of prefix sums.

    Returns
    -------
    ndarray, shape (N, I)
    """
    a, w = np.ascontiguousarray(a), np.ascontiguousarray(w)
    n, I = b.shape
    padded = np.zeros((n, -(-I // COLS) * COLS), dtype=b.dtype)  # zero columns up to a multiple of COLS
    padded[:, :I] = b
    out = np.empty_like(padded)
    pick(_PREFIX_CONTRACT, n * padded.shape[1] * a.shape[1])(padded, a, w, bool(reverse), out)
    return out[:, :I]


def _ones_column(v):
    """``[v, 1]`` (N, d_v + 1): the last column carries the normaliser through every contraction."""
    v1 = np.ones((v.shape[0], v.shape[1] + 1), dtype=v.dtype)
    v1[:, :-1] = v
    return v1


def scan_forward(phi_q, phi_k, v, causal, eps, chunk_size):
    """Core: :func:`refimpl.scan.scan_forward` with the causal form as one kernel; ``(out, cache)``, no raise.

    The caller checks ``cache.den`` (:func:`refimpl.validation.check_denominators`).
    """
    if not causal:
        return ref_scan.scan_forward(phi_q, phi_k, v, causal, eps, chunk_size)
    # [num, den - eps]_t = (sum_{j <= t} [v_j, 1] phi_k_j^T) phi_q_t
    num = prefix_contract(_ones_column(v), phi_k, phi_q)
    den = num[:, -1] + phi_q.dtype.type(eps)
    with np.errstate(divide="ignore", invalid="ignore"):  # den = 0 only with eps = 0: the caller refuses it
        out = num[:, :-1] / den[:, None]
    chunk = max(1, min(chunk_size, phi_q.shape[0]))
    return out, FeatureAttentionCache(phi_q, phi_k, v, out, den, True, eps, chunk)


def scan_backward(g, cache):
    """Core: :func:`refimpl.scan.scan_backward` with the causal sweeps as kernels (``g`` checked; no raise)."""
    if not cache.causal:
        return ref_scan.scan_backward(g, cache)
    # out_t = num_t / den_t: dnum_t = g_t / den_t, dden_t = -(g_t . out_t) / den_t
    g1 = np.empty((g.shape[0], g.shape[1] + 1), dtype=g.dtype)
    g1[:, :-1] = g / cache.den[:, None]
    g1[:, -1] = -np.sum(g * cache.out, axis=1) / cache.den
    v1 = _ones_column(cache.v)
    # dphi_q_t = [S, z]_t g1_t, the prefix sums of phi_k_j [v_j, 1]^T
    dphi_q = prefix_contract(cache.phi_k, v1, g1)
    # dphi_k_t = [R, r]_t [v_t, 1], the suffix sums of phi_q_j g1_j^T
    dphi_k = prefix_contract(cache.phi_q, g1, v1, reverse=True)
    # dv_t = R_t^T phi_k_t, R the suffix sums of phi_q_j (g_j / den_j)^T
    dv = prefix_contract(g1[:, :-1], cache.phi_q, cache.phi_k, reverse=True)
    return FeatureAttentionGrads(phi_q=dphi_q, phi_k=dphi_k, v=dv)
