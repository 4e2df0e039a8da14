"""Diagnoses for the exercises' checks: what a wrong answer's error pattern suggests.

A check compares the student's result with an independent one; when they
differ, the entry, the expected value and the tolerance say *where* the
answer is wrong.  The functions here look at *how* it is wrong, from the
two arrays alone (never from a worked solution): a flipped sign, a constant
factor such as 2, 1/2 or sqrt(d), a value squared or inverted, a shift by one along an axis (a mask or an
index off by one), a transpose, rows right up to their own factor (the
normalisation), NaN or inf where the expected value is finite (an
overflow), an error that grows with the size of what is summed
(cancellation), differences between two runs of a kernel or only at tile
boundaries (a race: a missing ``cuda.syncthreads()``), or a result that
matches a wrong formula the check computes from its own quantities.

Each diagnosis is a small pure function that returns one line of text when
its pattern fits and ``None`` otherwise; :func:`diagnose` runs those that
apply, :func:`explain` appends their lines to a check's message under
``This looks like:``, and :func:`compare` is the usual comparison with that
message.  :func:`diagnose` never raises: a pattern it cannot test is skipped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

HEADER = "This looks like:"
U = np.finfo(np.float64).eps  # machine epsilon u = 2^-52

#: Constants a factor is compared with before it is reported as a number (their inverses too).
FACTORS = {"2": 2.0, "sqrt 2": math.sqrt(2.0), "4": 4.0}


def _pair(got, expected):
    """``got`` and ``expected`` as float64 arrays of one shape, or None when that is not possible."""
    try:
        g = np.asarray(got, dtype=np.float64)
        e = np.asarray(expected, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if g.shape != e.shape or g.size == 0:
        return None
    return g, e


def _on_pair(diagnosis):
    """``diagnosis(g, e, ...)`` called as ``diagnosis(got, expected, ...)``: on :func:`_pair`'s float64 arrays, None
    (no diagnosis) when they have no common shape."""

    @functools.wraps(diagnosis)
    def on_pair(got, expected, *args, **kwargs):
        pair = _pair(got, expected)
        return None if pair is None else diagnosis(*pair, *args, **kwargs)

    return on_pair


def _noise(e):
    """The rounding level of values like ``e``: 64 u times their largest size (a few roundings each)."""
    finite = e[np.isfinite(e)]
    return 64 * U * (float(np.max(np.abs(finite))) if finite.size else 1.0)


def explains(got, candidate, expected, share=1e-2):
    """Whether ``candidate`` accounts for the difference between ``got`` and ``expected``.

    True when ``got`` is within ``share`` of its error (and rounding) of ``candidate``:
    ``max|got - candidate| <= share max|got - expected| + 64 u max|expected|``.

    Parameters
    ----------
    got, candidate, expected : array_like
        Of one shape, finite.
    share : float
        The part of the error that may stay unexplained.

    Returns
    -------
    bool
    """
    g, c, e = (np.asarray(a, dtype=np.float64) for a in (got, candidate, expected))
    if not (g.shape == c.shape == e.shape) or not (np.all(np.isfinite(g)) and np.all(np.isfinite(c))):
        return False
    err = float(np.max(np.abs(g - e)))
    return err > 0 and float(np.max(np.abs(g - c))) <= share * err + _noise(e)


@_on_pair
def nonfinite(g, e):
    """NaN or inf where the expected value is finite: an overflow, an underflow to 0 / 0, or a log of 0.

    Returns
    -------
    str or None
    """
    bad = ~np.isfinite(g) & np.isfinite(e)
    if not bad.any():
        return None
    kinds = ", ".join(sorted({str(x) for x in g[bad].ravel()[:50]}))
    return (f"an overflow or underflow: {int(bad.sum())} entries are {kinds} where the expected values are finite "
            "(exp of a large number, log 0, or 0 / 0 after every term underflowed): subtract the row maximum before exp")


@_on_pair
def flipped_sign(g, e):
    """``got`` is ``-expected``: a sign flipped somewhere (an ascent for a descent, a difference the other way).

    Returns
    -------
    str or None
    """
    if not np.any(e != 0):
        return None
    if explains(g, -e, e):
        return "a flipped sign: your values are -1 times the expected ones"
    return None


def _name_factor(c, factors):
    """(name, 'extra' or 'missing') when ``c`` is a named factor or its inverse, to 1e-6 relative."""
    for name, f in {**(factors or {}), **FACTORS}.items():  # the check's own names first
        f = float(f)
        if f == 0 or not np.isfinite(f) or abs(f) == 1:
            continue
        if abs(c / f - 1) <= 1e-6:
            return name, "extra"
        if abs(c * f - 1) <= 1e-6:
            return name, "missing"
    return None


@_on_pair
def constant_factor(g, e, factors=None):
    """``got`` is ``c expected`` for one constant ``c``: a factor dropped or added, named when it is known.

    ``c`` is compared with 2, sqrt 2, 4, the ``factors`` given (a name for
    each value: ``{"beta": 2.5, "d": 3}``) and their inverses.  A ``c``
    close to 1 is reported as a small relative error common to every entry.
    For a single number only a named factor is reported (any two numbers
    have a ratio).

    Returns
    -------
    str or None
    """
    if not (np.all(np.isfinite(g)) and np.all(np.isfinite(e))):
        return None
    top = float(np.max(np.abs(e)))
    if top == 0:
        return None
    g, e = g / top, e / top  # products of entries near 1e300 would overflow
    ee = float(np.sum(e * e))
    c = float(np.sum(g * e)) / ee
    if c == 0 or c == 1 or abs(c + 1) <= 1e-9 or not explains(g, c * e, e):
        return None
    named = _name_factor(c, factors)
    if named:
        name, kind = named
        return (f"a factor {name} too many: your values are {c:.6g} times the expected ones" if kind == "extra"
                else f"a missing factor {name}: your values are {c:.6g} times the expected ones (1/{name})")
    if abs(c - 1) <= 1e-3:
        what = "every entry off by the same relative amount" if np.count_nonzero(e) >= 2 else "a small relative error"
        return (f"{what} {c - 1:+.1e}: your values are scaled by "
                f"1 {'+' if c > 1 else '-'} {abs(c - 1):.1e}, a constant slightly off somewhere")
    if np.count_nonzero(e) < 3:
        return None
    return f"a constant factor: your values are {c:.6g} times the expected ones"


@_on_pair
def power(g, e):
    """``got`` is ``expected`` squared, its square root or its inverse: a square root dropped or a ratio upside down.

    Returns
    -------
    str or None
    """
    if not (np.all(np.isfinite(g)) and np.all(np.isfinite(e)) and np.all(e > 0)) or np.all(e == 1):
        return None
    if np.min(e) < 1e-3 or np.max(e) > 1e3 or not np.all(g > 0):  # near 0 every power of e looks alike
        return None
    for p, what in ((2.0, "squared: a square root dropped"), (0.5, "their square roots: a square root too many"),
                    (-1.0, "inverted: the ratio upside down (1 / the expected values)")):
        if explains(g, e**p, e):
            return f"your values are the expected ones {what}"
    return None


def transposed(got, expected):
    """``got`` is the transpose of ``expected`` (the last two axes swapped), or has its shape reversed.

    Returns
    -------
    str or None
    """
    try:
        g, e = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if e.ndim < 2:
        return None
    et = np.swapaxes(e, -1, -2)
    if g.shape == et.shape and g.shape != e.shape:
        if np.allclose(g, et, rtol=1e-8, atol=_noise(e)):
            return f"transposed: your array is the expected one with its last two axes swapped (shape {g.shape})"
        return f"transposed: your shape {g.shape} is the expected {e.shape} with the last two axes swapped"
    if g.shape == e.shape and not np.array_equal(e, et) and explains(g, et, e):
        return "transposed: your values are the expected ones with rows and columns swapped"
    return None


@_on_pair
def shifted(g, e, axis=0, name=None):
    """``got`` is ``expected`` moved by one place along ``axis``: a mask, a window or an index off by one.

    Compared on the entries both have (all but the first or last along ``axis``).

    Returns
    -------
    str or None
    """
    if g.ndim == 0 or g.shape[axis] < 3:
        return None
    label = name or f"axis {axis}"
    n = g.shape[axis]
    for step, word in ((1, "one later"), (-1, "one earlier")):
        src = slice(0, n - 1) if step == 1 else slice(1, n)
        dst = slice(1, n) if step == 1 else slice(0, n - 1)
        gs = np.take(g, range(n)[dst], axis=axis)
        es = np.take(e, range(n)[src], axis=axis)
        if np.any(gs != np.take(e, range(n)[dst], axis=axis)) and explains(gs, es, np.take(e, range(n)[dst], axis=axis)):
            return (f"an off-by-one along the {label}: each of your entries is the expected value {word} "
                    "(a mask, a window or an index shifted by one)")
    return None


@_on_pair
def per_row_scale(g, e, axis=-1):
    """Each row (along ``axis``) is right up to its own factor: the normalisation is wrong.

    Returns
    -------
    str or None
    """
    if g.ndim < 2:
        return None
    if not (np.all(np.isfinite(g)) and np.all(np.isfinite(e))) or not np.any(e):
        return None
    top = float(np.max(np.abs(e)))
    g, e = g / top, e / top  # products of entries near 1e300 would overflow
    ee = np.sum(e * e, axis=axis, keepdims=True)
    if np.any(ee == 0):
        return None
    c = np.sum(g * e, axis=axis, keepdims=True) / ee
    if np.ptp(c) <= 1e-6 * np.max(np.abs(c)) or not explains(g, c * e, e):
        return None  # one constant for all rows is constant_factor's case
    sums_g, sums_e = np.sum(g, axis=axis), np.sum(e, axis=axis)
    return (f"a wrong normalisation: each row is right up to its own factor (from {np.min(c):.4g} to {np.max(c):.4g}); "
            f"your rows sum to {np.round(sums_g.ravel()[:3], 6).tolist()}, the expected ones to "
            f"{np.round(sums_e.ravel()[:3], 6).tolist()}")


def not_normalised(got, axis=-1, total=1.0, tol=1e-9):
    """The rows of ``got`` (along ``axis``) do not sum to ``total`` (probabilities that should sum to one).

    Returns
    -------
    str or None
    """
    try:
        g = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if g.ndim == 0 or not np.all(np.isfinite(g)):
        return None
    sums = np.sum(g, axis=axis)
    off = np.abs(sums - total)
    if np.max(off) <= tol * max(1.0, abs(total)):
        return None
    return f"a wrong normalisation: your rows sum to {[float(f'{s:.12g}') for s in sums.ravel()[:3]]}, not {total:g}"


@_on_pair
def boundary_only(g, e, tol, block, axis=0, name="tile"):
    """The entries beyond ``tol`` all sit at the edges of blocks of ``block`` along ``axis``.

    Returns
    -------
    str or None
    """
    if block < 2:
        return None
    bad = np.abs(g - e) > tol
    bad |= ~np.isfinite(g)
    if not bad.any():
        return None
    where = np.unique(np.nonzero(bad)[axis])
    n = g.shape[axis]
    edges = {i for i in range(n) if i % block in (0, block - 1) or i == n - 1}
    if len(where) == n or not set(where.tolist()) <= edges:
        return None
    return (f"differences only at {name} boundaries (indices {where[:6].tolist()} along {name}s of {block}): "
            "a missing barrier, cuda.syncthreads(), between writing shared memory and reading it, or an edge off by one")


def nondeterministic(first, second):
    """Two runs of one kernel on one input differ: a race, most often a missing ``cuda.syncthreads()``.

    Returns
    -------
    str or None
    """
    try:
        a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if a.shape != b.shape:
        return "a race: two runs of your kernel give results of different shapes; missing cuda.syncthreads()?"
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return None
    return (f"a race: two runs of your kernel on the same input differ in {int((~same).sum())} entries: "
            "a missing cuda.syncthreads() between writing shared memory and reading it")


@_on_pair
def grows_with(g, e, size, name="t"):
    """The error grows with ``size`` (the length or magnitude of what was summed): cancellation.

    Compares the median error among the entries of the largest third of
    ``size`` with that among the smallest tenth: five times larger counts.

    Returns
    -------
    str or None
    """
    s = np.broadcast_to(np.asarray(size, dtype=np.float64), g.shape).ravel()
    err = np.abs(g - e).ravel()
    if not np.all(np.isfinite(err)) or err.size < 6:
        return None
    order = np.argsort(s, kind="stable")
    low = float(np.median(err[order[: max(1, err.size // 10)]]))
    high = float(np.median(err[order[-(err.size // 3):]]))
    if high <= 5 * low or high <= _noise(e):
        return None
    return (f"cancellation: the error grows with {name} (median {low:.1e} for the smallest tenth, {high:.1e} for the "
            "largest third): a difference of two large sums keeps their rounding; sum the small quantity directly")


def matches(got, known, expected=None):
    """``got`` equals one of the ``known`` wrong results (a name for each array), to rounding.

    ``known`` holds what the check itself computes for mistakes it can name:
    the mask without the diagonal, the sum without the guard...  With
    ``expected`` given, the match must also account for the error
    (:func:`explains`); without it, to 1e-9 relative.

    Returns
    -------
    str or None
    """
    for label, candidate in (known or {}).items():
        try:
            if expected is not None:
                if explains(got, candidate, expected):
                    return label
            else:
                g, c = np.asarray(got, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
                if g.shape == c.shape and np.allclose(g, c, rtol=1e-9, atol=_noise(c)):
                    return label
        except (TypeError, ValueError):
            continue
    return None


def shape(got_shape, expected_shape):
    """What a wrong shape suggests: axes swapped, an axis too many (not summed) or one missing (summed away).

    Returns
    -------
    str or None
    """
    got_shape, expected_shape = tuple(got_shape), tuple(expected_shape)
    if got_shape == expected_shape:
        return None
    if len(got_shape) == len(expected_shape) >= 2 and got_shape == expected_shape[::-1]:
        return f"transposed: your shape {got_shape} is the expected {expected_shape} reversed"
    if len(got_shape) > len(expected_shape):
        return (f"an axis too many: your shape {got_shape} has more axes than {expected_shape} "
                "(per-item values not summed?)")
    if len(got_shape) < len(expected_shape):
        return (f"an axis missing: your shape {got_shape} has fewer axes than {expected_shape} "
                "(summed over an axis that should stay?)")
    return None


def diagnose(got, expected, *, factors=None, axes=None, transpose=True, normalised=None, rows=None, size=None,
             size_name="t", known=None, tol=None, block=None):
    """Every diagnosis that fits ``got`` against ``expected``: a list of lines, most specific first.

    Parameters
    ----------
    got, expected : array_like
        The answer's result and the check's.
    factors : dict, optional
        Named constants a factor may be (``{"beta": beta}``).
    axes : dict, optional
        ``{axis: name}``: the axes along which an off-by-one is looked for.
    transpose : bool
        Look for a transpose.
    normalised : tuple, optional
        ``(axis, total)``: the rows along ``axis`` of the expected result sum to ``total``.
    rows : int, optional
        The axis along which a per-row factor (a normalisation) is looked for.
    size : array_like, optional
        A size per entry (a position, a magnitude); an error growing with it is cancellation.
    size_name : str
        What ``size`` is, in the message.
    known : dict, optional
        ``{label: array}``: wrong results the check computes; a match is named first.
    tol : float or array_like, optional
        The check's tolerance, for :func:`boundary_only`.
    block : tuple, optional
        ``(size, axis, name)`` of the tiles, for :func:`boundary_only`.

    Returns
    -------
    list of str
    """
    tests: list[Callable[[], str | None]] = [
        lambda: matches(got, known, expected),
        lambda: nonfinite(got, expected),
        lambda: flipped_sign(got, expected),
        lambda: constant_factor(got, expected, factors),
        lambda: power(got, expected),
    ]
    if transpose:
        tests.append(lambda: transposed(got, expected))
    for axis, name in (axes or {}).items():
        tests.append(lambda axis=axis, name=name: shifted(got, expected, axis, name))
    if rows is not None:
        tests.append(lambda: per_row_scale(got, expected, rows))
    if normalised is not None:
        tests.append(lambda: not_normalised(got, *normalised))
    if size is not None:
        tests.append(lambda: grows_with(got, expected, size, size_name))
    if block is not None and tol is not None:
        tests.append(lambda: boundary_only(got, expected, tol, *block))
    lines = []
    for test in tests:
        try:
            line = test()
        except Exception:  # a diagnosis must never hide the failure it explains
            line = None
        if line and line not in lines:
            lines.append(line)
        if lines and test is tests[0]:
            break  # a wrong result the check itself names: the patterns below would only restate it
    return lines


def explain(message, got=None, expected=None, *, hints=(), **options):
    """``message`` followed by the diagnoses of ``got`` against ``expected`` and the check's own ``hints``.

    Parameters
    ----------
    message : str
        What the check says today: the entry, the expected value, the tolerance.
    got, expected : array_like, optional
        The two results; without them only ``hints`` are added.
    hints : iterable of str or None
        Exercise-specific diagnoses the check has found true (``None`` entries are skipped).
    **options
        Passed to :func:`diagnose`.

    Returns
    -------
    str
    """
    lines = [h for h in hints if h]
    if got is not None and expected is not None:
        lines += [line for line in diagnose(got, expected, **options) if line not in lines]
    if not lines:
        return message
    return message + "\n" + HEADER + "".join(f"\n  - {line}" for line in lines)


def compare(got, expected, what, tol, *, relative=False, hints=(), **options):
    """Assert that ``got`` matches ``expected`` within ``tol``; the message names the worst entry and diagnoses.

    Parameters
    ----------
    got, expected : array_like
        Of one shape (a different shape fails, with what it suggests).
    what : str
        What is compared, for the message.
    tol : float
        The allowed difference, absolute, or relative to ``max|expected|`` when ``relative``.
    relative : bool
        Whether ``tol`` is relative to the largest expected entry.
    hints : iterable of str or None
        Exercise-specific diagnoses.
    **options
        Passed to :func:`diagnose`.

    Raises
    ------
    AssertionError
        When a shape differs, an entry is not finite or a difference exceeds the tolerance.
    """
    g, e = np.asarray(got), np.asarray(expected)
    assert g.shape == e.shape, explain(f"{what}: expected shape {e.shape}, got {g.shape}", hints=[shape(g.shape, e.shape), *hints])
    g = g.astype(np.float64)
    e = e.astype(np.float64)
    bad = ~np.isfinite(g) & np.isfinite(e)
    assert not bad.any(), explain(f"{what}: non-finite entries at {np.argwhere(bad)[:3].tolist()}", g, e, hints=hints, **options)
    err = np.abs(g - e)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.ndim else ()
    scale = max(float(np.max(np.abs(e))), 1e-300) if relative else 1.0
    where = f"entry {tuple(int(i) for i in worst)} is" if err.ndim else "you give"
    assert float(err.max()) <= tol * scale, explain(
        f"{what}: {where} {float(g[worst])!r}, expected {float(e[worst])!r} (max difference {err.max():.1e}"
        + (f", {err.max() / scale:.1e} relative to the largest entry; allowed {tol:.0e})" if relative else f", allowed {tol:.1e})"),
        g, e, hints=hints, **options)


__all__ = [
    "FACTORS", "HEADER", "boundary_only", "compare", "constant_factor", "diagnose", "explain", "explains",
    "flipped_sign", "grows_with", "matches", "nondeterministic", "nonfinite", "not_normalised", "per_row_scale", "power",
    "shape", "shifted", "transposed",
]
