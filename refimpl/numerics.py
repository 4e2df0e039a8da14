r"""Shared numerics: log-sum-exp, softmax, its backward and softplus, each written once.

These are *cores*: pure functions on arrays that the caller has already
checked (float32 or float64, one dtype).  They do no validation and never
raise; the checked public versions are :func:`refimpl.gmm.logsumexp`,
:func:`refimpl.gmm.softmax` and friends.  Every module of the reference that
needs a softmax, or its backward, calls the one here, and the GPU kernels
mirror these lines.  They are written for reading; the same operations tuned
for speed (in place, reductions as matrix products) are in
:mod:`refimpl.tuned`.

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

The softmax backward
--------------------
For :math:`p = \operatorname{softmax}(a)` and an upstream gradient
:math:`\bar p = \partial L/\partial p`, the Jacobian
:math:`\partial p_k/\partial a_m = p_k(\delta_{km} - p_m)` gives

.. math::

    \bar a_m = p_m\Big(\bar p_m - \sum_k p_k\bar p_k\Big)

(:func:`softmax_backward`).  Entries with :math:`p_m = 0` (masked, or
underflowed) get :math:`\bar a_m = 0`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_BYTES", "block_rows", "row_max", "logsumexp", "log_softmax", "softmax", "softmax_backward", "softplus", "log_weights"]

#: Bytes of work arrays per block of rows in the row-blocked loops of the
#: reference: a loop over blocks of rows bounds the memory of an ``N x K x d``
#: computation by this much, whatever ``N`` is.
BLOCK_BYTES = 1 << 21


def block_rows(row_bytes: int) -> int:
    """Core: rows per block so that a block's work arrays, ``row_bytes`` a row, take about :data:`BLOCK_BYTES`."""
    return max(1, BLOCK_BYTES // row_bytes)


def row_max(a, axis=-1):
    """Core: the maximum along ``axis`` (kept as a length-one axis), 0 where it is not finite.

    The shift of every log-sum-exp here.  A slice of all ``-inf`` has maximum
    ``-inf``; shifting by it would give ``-inf - (-inf) = NaN``, so such a
    slice is shifted by 0 and ``exp`` gives the right zeros.
    """
    m = np.max(a, axis=axis, keepdims=True)
    return np.where(np.isfinite(m), m, 0).astype(a.dtype, copy=False)


def logsumexp(a, axis=-1, keepdims=False):
    """Core: ``log(sum(exp(a), axis))`` with the maximum along ``axis`` subtracted.

    A slice of all ``-inf`` gives ``-inf``.  Same dtype as ``a``.
    """
    m = row_max(a, axis)
    # log sum exp(a) = m + log sum exp(a - m): the largest term becomes exp(0) = 1.
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0.
    with np.errstate(divide="ignore", over="ignore"):
        out = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def log_softmax(a, axis=-1):
    """Core: ``a - logsumexp(a, axis)``, accurate even where ``|a|`` is huge.

    The maximum is subtracted first, which makes the largest entry exactly 0;
    only then is ``log sum exp`` (a number in ``[0, log K]``) subtracted.
    Forming ``logsumexp(a)`` first would add ``log K`` to a number like
    ``-1e16`` and lose it to rounding, so rows would stop normalising.
    """
    # a - m may overflow to -inf (a = -1e308, m = 1e308): exp gives the right 0
    with np.errstate(over="ignore", divide="ignore"):
        shifted = a - row_max(a, axis)
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def softmax(a, axis=-1):
    """Core: ``exp(a) / sum(exp(a), axis)`` with the maximum along ``axis`` subtracted.

    A slice of all ``-inf`` gives NaN (``0 / 0``): the callers refuse such rows.
    """
    # softmax(a) = softmax(a - m): the largest term is exp(0) = 1, the sum is in [1, K]
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(a - row_max(a, axis))
        return e / np.sum(e, axis=axis, keepdims=True)


def softmax_backward(p, dp, axis=-1):
    """Core: ``dL/da`` for ``p = softmax(a)`` along ``axis`` and ``dp = dL/dp``: ``p * (dp - sum(p * dp))``.

    The softmax Jacobian ``dp_k / da_m = p_k (delta_km - p_m)`` applied to
    ``dp`` (module docstring); ``p`` and ``dp`` of one shape and dtype.
    """
    # dL/da_m = p_m (dp_m - sum_k p_k dp_k)
    return p * (dp - np.sum(p * dp, axis=axis, keepdims=True))


def log_weights(weights):
    """Core: ``log(weights)``, a weight of 0 giving ``-inf`` (a component that never wins) without a warning."""
    with np.errstate(divide="ignore"):
        return np.log(weights)


def softplus(s):
    """Core: ``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; float32 stays float32."""
    return np.logaddexp(np.zeros((), dtype=np.result_type(s, np.float32)), s)
