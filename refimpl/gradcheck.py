r"""Central finite differences: the check every hand-derived gradient here is held to.

For a scalar loss :math:`L` and one entry :math:`x_i` of an array,

.. math::

    \frac{\partial L}{\partial x_i} \approx \frac{L(x + h e_i) - L(x - h e_i)}{2h},

with truncation error :math:`O(h^2 L''')` and rounding error
:math:`O(\epsilon |L| / h)`; :math:`h \approx 10^{-6}` balances the two in
float64 (about 1e-9 to 1e-10 relative error for smooth, order-one losses).
To check the backward of a mechanism ``f`` with an upstream gradient ``G``,
differentiate :math:`L(x) = \sum G \odot f(x)`: its gradient is exactly what
``f``'s backward returns for ``G``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import validation

__all__ = ["numerical_gradient", "relative_error"]


def numerical_gradient(loss: Callable[[np.ndarray], float], x, *, h: float = 1e-6) -> np.ndarray:
    """Central differences of a scalar function, entry by entry.

    Parameters
    ----------
    loss : callable
        ``loss(array) -> float``; called ``2 * x.size`` times, each time with
        a fresh copy of ``x`` in which one entry is moved by ``+h`` or ``-h``.
    x : array_like of float
        The point; it is not modified.
    h : float, default 1e-6
        The step (> 0).

    Returns
    -------
    ndarray, same shape and dtype as ``x``
        ``(loss(x + h e_i) - loss(x - h e_i)) / (2 h)`` for every entry ``i``.
    """
    x = validation.as_float_array(x, "x")
    h = validation.check_positive_float(h, "h")
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        grad[idx] = (loss(plus) - loss(minus)) / (2 * h)
    return grad


def relative_error(actual, expected) -> float:
    """``max |actual - expected| / max |expected|``: one number per comparison.

    Relative to the largest entry of ``expected`` (not entry by entry), so
    entries that are zero up to rounding do not inflate it.  Two all-zero
    arrays give 0.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise ValueError(f"actual, expected: shapes differ, got {actual.shape} and {expected.shape}")
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    err = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return err / scale if scale > 0 else err
