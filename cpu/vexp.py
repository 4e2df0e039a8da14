r"""An exponential that LLVM vectorises: :func:`exp` for the kernels of :mod:`cpu`, within 2 ulp of :func:`numpy.exp`.

Numba turns ``math.exp`` into a call to the C library, one element at a
time: without a vector maths library (SVML, which this numba cannot load)
a loop that calls it does not vectorise, and the exponentials take half the
time of the responsibilities.  :func:`exp` is the textbook algorithm written
in plain arithmetic, with no call, no table and no branch, so that a loop
calling it vectorises like any other:

1. **Range reduction.**  :math:`k = \mathrm{round}(x / \ln 2)`, rounded by
   adding and subtracting :math:`1.5 \cdot 2^{52}`, and
   :math:`r = x - k \ln 2` with :math:`\ln 2` split in two parts
   (Cody and Waite): ``LN2_HI`` has 21 trailing zero bits, so
   :math:`k \cdot` ``LN2_HI`` is exact for :math:`|k| < 2^{21}` and
   :math:`|r| \le \ln 2 / 2` to within a few units of its last place.
2. **A polynomial.** :math:`e^r = \sum_{n \le 13} r^n / n!` by Horner's rule
   with fused multiply-adds; the first term left out is below
   :math:`(\ln 2/2)^{14} / 14! < 5 \cdot 10^{-18}`, 0.04 ulp.
3. **Scaling by** :math:`2^k` **in two factors**
   :math:`2^{k_1} \cdot 2^{k - k_1}` with :math:`k_1 = \mathrm{round}(k/2)`, each a
   normal number built from its exponent bits, so that the one rounding of
   the last product is correct on the whole range: it overflows to ``inf``
   above :math:`\ln(\text{max float})`, gives subnormals, then 0, below
   :math:`\ln(\text{min normal})`.

The input is clamped to ``[-746, 710]`` first (``exp`` is ``inf`` or 0
beyond in float64), which also sends ``-inf`` to 0 and ``inf`` to ``inf``;
NaN is passed through by a final select.

float32 inputs are computed in float64 (the same three steps with a
polynomial of degree 8 and one factor :math:`2^k`, since ``k`` stays within
float64's normal range) and rounded once to float32.  Over every float32
argument in ``[-104, 89]`` (2.24e9 of them, checked once, not in the test
suite: it takes minutes) the result is within 1 ulp of the float64
exponential rounded to float32, and equal to it for all but 40 thousand.
That matters because :func:`numpy.exp` in float32 is a rational
approximation (its SIMD loop) up to 3 ulp from that correctly rounded value;
an exponential computed in float32 arithmetic, itself about 0.6 ulp from the
truth, could differ from NumPy's by 4 ulp.  As it is, the two differ by
at most 2 ulp except at 3 arguments of the 2.24e9, where NumPy is 2.5 ulp
from the true value and this function is correctly rounded: 3 ulp apart.
The loops still vectorise; each step is twice as wide in float64 registers.

Accuracy, tested (``tests/test_cpu_vexp.py``): within 2 ulp of
:func:`numpy.exp` at a million random points per dtype across the whole
range (uniform where the result is neither 0 nor ``inf``, and random bit
patterns over every finite number) and on every edge (the overflow and
underflow thresholds and their neighbours, the subnormal range, ``0``,
``-0``, ``inf``, ``-inf``, NaN); in float64, within 1 ulp of the
exponential in extended precision (``np.longdouble``); in float32, within 1
ulp of the correctly rounded value, and equal to it for all but 0.1% of the
arguments.

Use it inside ``@njit`` code as ``vexp.exp(x)`` on a float64 or float32
scalar; :func:`exp_array` applies it to an array (for the tests and for
reading the machine code: ``exp_array.inspect_asm()`` shows packed ``vfmadd``
instructions on ``ymm`` or ``zmm`` registers).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["exp", "exp_array", "LN2_HI", "LN2_LO", "DEGREE"]

LOG2E = 1.4426950408889634
#: ``ln 2`` rounded to 32 significant bits (``0x3FE62E42FEE00000``): ``k * LN2_HI`` is exact for ``|k| < 2**21``.
LN2_HI = 6.93147180369123816490e-01
#: ``ln 2 - LN2_HI`` rounded to float64.
LN2_LO = 1.90821492927058770002e-10
#: ``1.5 * 2**52``: ``(y + SHIFT) - SHIFT`` is ``y`` rounded to the nearest integer for ``|y| < 2**51``.
SHIFT = 6755399441055744.0
#: The float64 bits of ``SHIFT + 1023``: bits 0-11 hold ``k + 1023`` after ``k`` is added, the exponent of ``2**k``.
BIAS = SHIFT + 1023.0
#: Degrees of the polynomials: float64 results, and float32 results computed in float64.
DEGREE = {np.dtype(np.float64): 13, np.dtype(np.float32): 8}
#: ``1 / n!`` for the Taylor series of ``exp`` at 0, highest degree first (Horner's order).
COEFFICIENTS = tuple(1.0 / math.factorial(n) for n in range(13, -1, -1))
COEFFICIENTS_32 = COEFFICIENTS[13 - 8 :]
#: Where the float64 exponential is ``inf`` (above) or 0 (below) for every input beyond.
CLAMP_HIGH, CLAMP_LOW = 710.0, -746.0
#: The same for float32 results (``exp(89) > 2**128`` and ``exp(-104) < 2**-150``).
CLAMP_HIGH_32, CLAMP_LOW_32 = 89.0, -104.0


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c``, fused where the machine has FMA (LLVM's ``fmuladd``: vectorises, one rounding when fused)."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        ty = context.get_value_type(signature.return_type)
        fn = builder.module.declare_intrinsic("llvm.fmuladd", [ty], ir.FunctionType(ty, [ty, ty, ty]))
        return builder.call(fn, args)

    return a(a, b, c), codegen


@intrinsic
def _bits(typingctx, x):
    """The bits of a float64 as an int64 (no conversion: a reinterpretation, free in a vector register)."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(x), codegen


@intrinsic
def _from_bits(typingctx, n):
    """The float64 whose bits are the int64 ``n``."""
    if n != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(n), codegen


@njit(inline="always")
def _pow2(kf):
    """``2**k`` for an integer-valued float64 ``kf`` in ``[-1022, 1023]``: its exponent bits, nothing else."""
    # BIAS + k holds k + 1023 in its low bits; shifted to bits 52-62 it is the exponent of 2**k (mantissa 0)
    return _from_bits(_bits(kf + BIAS) << 52)


@njit(inline="always")
def _reduce(x, low, high):
    """``(k, r)`` with ``x``, clamped to ``[low, high]``, equal to ``k ln 2 + r``: ``k`` an integer-valued float64
    and ``|r| <= ln(2) / 2`` (Cody-Waite)."""
    xc = x if x > low else low
    xc = xc if xc < high else high
    kf = (xc * LOG2E + SHIFT) - SHIFT
    r = _fma(-kf, LN2_HI, xc)
    r = _fma(-kf, LN2_LO, r)
    return kf, r


@njit
def _exp64(x):
    # exp(x) = inf above ~709.78, 0 below ~-745.13: the clamp changes nothing but keeps k within [-1077, 1025]
    kf, r = _reduce(x, CLAMP_LOW, CLAMP_HIGH)
    # e^r = sum_n r^n / n!, Horner's rule
    p = COEFFICIENTS[0]
    for c in COEFFICIENTS[1:]:
        p = _fma(p, r, c)
    # e^x = e^r 2^k, 2^k = 2^k1 2^k2 (k1 = k / 2 rounded): both factors normal, one rounding in the last product
    k1 = (kf * 0.5 + SHIFT) - SHIFT
    y = (p * _pow2(k1)) * _pow2(kf - k1)
    # NaN in, NaN out (the clamp turned it into a number)
    return y if x == x else x


@njit
def _exp32(x):
    # computed in float64 and rounded once: the correctly rounded float32 exp but within 2e-10 of a boundary
    kf, r = _reduce(np.float64(x), CLAMP_LOW_32, CLAMP_HIGH_32)
    p = COEFFICIENTS_32[0]
    for c in COEFFICIENTS_32[1:]:
        p = _fma(p, r, c)
    # k in [-150, 129]: 2^k is a normal float64, and the float32 rounding gives inf, subnormals and 0
    y = np.float32(p * _pow2(kf))
    return y if x == x else x


def exp(x):
    """``e**x`` for a float64 or float32 scalar, inside ``@njit`` code; outside, :func:`numpy.exp` of ``x``.

    Within 2 ulp of :func:`numpy.exp` on the whole range, ``inf``, ``-inf``,
    NaN and the subnormals included (the module docstring says how); the
    result has the dtype of ``x``.
    """
    return np.exp(x)


@overload(exp)
def _exp_overload(x):
    if x == types.float64:
        return lambda x: _exp64(x)
    if x == types.float32:
        return lambda x: _exp32(x)
    return None


@njit(cache=True, error_model="numpy")
def _exp_loop(x, out):
    for i in range(x.shape[0]):
        out[i] = exp(x[i])


def exp_array(x):
    """:func:`exp` of every entry of a float64 or float32 array (a new array of the same shape and dtype)."""
    x = np.asarray(x)
    if x.dtype not in (np.float64, np.float32):
        raise TypeError(f"exp_array: expected a float64 or float32 array, got {x.dtype}")
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(flat)
    _exp_loop(flat, out)
    return out.reshape(x.shape)
