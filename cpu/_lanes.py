"""Row reductions in eight interleaved partial results: vectorised by LLVM, in an order fixed by the data.

A loop ``s += a[k]`` is a chain of dependent additions that LLVM may not
reorder (floating-point addition is not associative), so it runs one element
per addition latency, 4 cycles, and its neighbours in the kernel cannot
vectorise with it.  Here entry ``k`` goes to partial result ``k % 8``, the
eight partials are independent (one or two vector registers: the loop
vectorises), and they are combined pairwise at the end,
``((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))``; entries past the last
multiple of eight go to ``p0`` first.  The order depends only on the length,
so a result is the same bits on any number of threads.  The error of such a
sum is at most that of the plain loop (about ``(n/8 + 3) u`` times the sum of
the magnitudes against ``n u``); maxima and minima are exact in any order.
"""

from __future__ import annotations

from numba import njit

__all__ = ["max8", "min8", "sum8"]


@njit(inline="always")
def max8(a, n):
    """``max(a[:n])`` for ``n >= 1`` (a NaN entry may be skipped: callers refuse NaN elsewhere)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = a[0]
    n8 = n - n % 8
    for k in range(0, n8, 8):
        x0, x1, x2, x3, x4, x5, x6, x7 = a[k], a[k + 1], a[k + 2], a[k + 3], a[k + 4], a[k + 5], a[k + 6], a[k + 7]
        m0 = x0 if x0 > m0 else m0
        m1 = x1 if x1 > m1 else m1
        m2 = x2 if x2 > m2 else m2
        m3 = x3 if x3 > m3 else m3
        m4 = x4 if x4 > m4 else m4
        m5 = x5 if x5 > m5 else m5
        m6 = x6 if x6 > m6 else m6
        m7 = x7 if x7 > m7 else m7
    for k in range(n8, n):
        m0 = a[k] if a[k] > m0 else m0
    m0 = m4 if m4 > m0 else m0
    m1 = m5 if m5 > m1 else m1
    m2 = m6 if m6 > m2 else m2
    m3 = m7 if m7 > m3 else m3
    m0 = m2 if m2 > m0 else m0
    m1 = m3 if m3 > m1 else m1
    return m1 if m1 > m0 else m0


@njit(inline="always")
def min8(a, n):
    """``min(a[:n])`` for ``n >= 1``, as :func:`max8`."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = a[0]
    n8 = n - n % 8
    for k in range(0, n8, 8):
        x0, x1, x2, x3, x4, x5, x6, x7 = a[k], a[k + 1], a[k + 2], a[k + 3], a[k + 4], a[k + 5], a[k + 6], a[k + 7]
        m0 = x0 if x0 < m0 else m0
        m1 = x1 if x1 < m1 else m1
        m2 = x2 if x2 < m2 else m2
        m3 = x3 if x3 < m3 else m3
        m4 = x4 if x4 < m4 else m4
        m5 = x5 if x5 < m5 else m5
        m6 = x6 if x6 < m6 else m6
        m7 = x7 if x7 < m7 else m7
    for k in range(n8, n):
        m0 = a[k] if a[k] < m0 else m0
    m0 = m4 if m4 < m0 else m0
    m1 = m5 if m5 < m1 else m1
    m2 = m6 if m6 < m2 else m2
    m3 = m7 if m7 < m3 else m3
    m0 = m2 if m2 < m0 else m0
    m1 = m3 if m3 < m1 else m1
    return m1 if m1 < m0 else m0


@njit(inline="always")
def sum8(a, n):
    """``sum(a[:n])`` in eight interleaved partial sums (0 for ``n = 0``), combined pairwise."""
    z = a.dtype.type(0)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = z
    n8 = n - n % 8
    for k in range(0, n8, 8):
        s0 += a[k]
        s1 += a[k + 1]
        s2 += a[k + 2]
        s3 += a[k + 3]
        s4 += a[k + 4]
        s5 += a[k + 5]
        s6 += a[k + 6]
        s7 += a[k + 7]
    for k in range(n8, n):
        s0 += a[k]
    return ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))
