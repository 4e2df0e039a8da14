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

__all__ = ["row_max", "logsumexp", "log_softmax", "softmax", "softplus"]


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
    """Core: ``exp(a) / sum(exp(a), axis)`` with the maximum along ``axis`` subtracted."""
    # softmax(a) = softmax(a - m): the largest term is exp(0) = 1, the sum is in [1, K]
    with np.errstate(over="ignore"):
        e = np.exp(a - row_max(a, axis))
    return e / np.sum(e, axis=axis, keepdims=True)


def softplus(s):
    """Core: ``log(1 + exp(s))`` without overflow, as ``logaddexp(0, s)``; float32 stays float32."""
    return np.logaddexp(np.zeros((), dtype=np.result_type(s, np.float32)), s)
