r"""Shared numerics: log-sum-exp, softmax and softplus, each written once.

These are *cores*: pure functions on arrays that the caller has already
checked (float32 or float64, one dtype).  They do no validation and never
raise; the checked public versions are :func:`refimpl.gmm.logsumexp`,
:func:`refimpl.gmm.softmax` and friends.  Every module of the reference that
needs a softmax calls the one here, and the GPU kernels mirror these lines.

The per-row maximum
-------------------
Log-densities of :math:`-10^{16}` are ordinary, so a row is never
exponentiated as it is.  Subtracting its maximum :math:`m` changes nothing,

.. math::

    \log\sum_k e^{a_k} = m + \log\sum_k e^{a_k - m},\qquad
    \operatorname{softmax}(a) = \operatorname{softmax}(a - m),

and puts the largest term at :math:`e^0 = 1`, so the sum lies in
:math:`[1, K]`: it neither overflows nor underflows.  A row that is all
:math:`-\infty` (every weight zero) has no finite maximum; it is shifted by 0
instead, so that ``exp`` gives zeros, not NaN (:func:`row_max`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_BYTES", "block_rows", "row_max", "logsumexp", "log_softmax", "softmax", "softplus"]

#: Bytes of work arrays per block of rows in the row-blocked loops of the
#: reference (responsibilities and their backward): about the L2 cache of one core.
BLOCK_BYTES = 1 << 21


def block_rows(row_bytes: int) -> int:
    """Core: rows per block so that a block's work arrays, ``row_bytes`` a row, take about :data:`BLOCK_BYTES`.

    Loops over blocks of this many rows keep their ``rows x K`` intermediates
    in cache, where an element-wise pass costs a fraction of one over an
    array in main memory.
    """
    return max(1, BLOCK_BYTES // row_bytes)


def row_max(a, axis=-1):
    """Core: the maximum along ``axis`` (kept as a length-one axis), 0 where it is not finite.

    The shift of every log-sum-exp here.  A slice of all ``-inf`` has maximum
    ``-inf``; shifting by it would give ``-inf - (-inf) = NaN``, so such a
    slice is shifted by 0 and ``exp`` gives the right zeros.
    """
    if a.ndim == 2 and axis in (1, -1):
        # max_k a_ik = a_i,argmax: NumPy's argmax along contiguous rows is vectorised and its max
        # reduction is not (4x faster at K = 64); the same value, NaN included (both take the first NaN)
        m = a[np.arange(a.shape[0]), np.argmax(a, axis=1)][:, None]
    else:
        m = np.max(a, axis=axis, keepdims=True)
    return np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)


def _sum(a, axis):
    """``sum(a, axis)`` kept as a length-one axis; the rows of a 2-D array by a matrix-vector product.

    ``a @ 1`` runs in BLAS at memory speed, where NumPy's reduction along
    short rows loops row by row (3x slower at K = 64).  The two differ only
    in the order of the additions.
    """
    if a.ndim == 2 and axis in (1, -1):
        return (a @ np.ones(a.shape[1], dtype=a.dtype))[:, None]
    return np.sum(a, axis=axis, keepdims=True)


def logsumexp(a, axis=-1, keepdims=False):
    """Core: ``log(sum(exp(a), axis))`` with the maximum along ``axis`` subtracted.

    A slice of all ``-inf`` gives ``-inf``.  Same dtype as ``a``.
    """
    m = row_max(a, axis)
    # log sum exp(a) = m + log sum exp(a - m): the largest term becomes exp(0) = 1.
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0.
    with np.errstate(divide="ignore", over="ignore"):
        out = np.log(_sum(np.exp(a - m), axis)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def log_softmax(a, axis=-1, out=None):
    """Core: ``a - logsumexp(a, axis)``, accurate even where ``|a|`` is huge.

    The maximum is subtracted first, which makes the largest entry exactly 0;
    only then is ``log sum exp`` (a number in ``[0, log K]``) subtracted.
    Forming ``logsumexp(a)`` first would add ``log K`` to a number like
    ``-1e16`` and lose it to rounding, so rows would stop normalising.
    ``out`` (same shape and dtype; may be ``a`` itself) receives the result.
    """
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0
    with np.errstate(over="ignore", divide="ignore"):
        shifted = np.subtract(a, row_max(a, axis), out=out)
        shifted -= np.log(_sum(np.exp(shifted), axis))
    return shifted


def softmax(a, axis=-1, out=None):
    """Core: ``exp(a) / sum(exp(a), axis)`` with the maximum along ``axis`` subtracted.

    ``out`` (same shape and dtype; may be ``a`` itself) receives the result:
    one exponential per entry and no temporary of the size of ``a``.
    """
    # softmax(a) = softmax(a - m): the largest term is exp(0) = 1, the sum is in [1, K]
    with np.errstate(over="ignore"):
        e = np.subtract(a, row_max(a, axis), out=out)
    np.exp(e, out=e)
    # one division per row, then a multiplication per entry (e / s costs twice e * (1/s) per entry);
    # a row of zeros (all -inf) gives 0 * inf = NaN, as 0 / 0 would
    with np.errstate(divide="ignore"):
        scale = 1 / _sum(e, axis)
    e *= scale
    return e


def softplus(s):
    """Core: ``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; float32 stays float32."""
    return np.logaddexp(np.zeros((), dtype=np.result_type(s, np.float32)), s)
