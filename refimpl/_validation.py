"""Input validation shared by every public function of :mod:`refimpl`.

Every check raises ``TypeError`` (wrong kind of object or dtype) or
``ValueError`` (wrong shape or value) with a message that names the argument,
says what it got and what is expected, so that a user can fix the call without
reading the source.  The helpers never modify their inputs: arrays are
converted with :func:`numpy.asarray` (no copy when already an array) and
callers must not write into what they get back.
"""

from __future__ import annotations

import numbers
import operator

import numpy as np

__all__ = [
    "as_float_array",
    "common_float_dtype",
    "check_ndim",
    "check_shape",
    "check_finite",
    "check_positive",
    "check_probability_vector",
    "check_int",
    "check_positive_float",
    "check_option",
    "check_bool",
    "check_seed",
    "check_float_dtype",
    "check_instance",
]


def _describe_dtype(arr) -> str:
    return f"dtype {np.asarray(arr).dtype}"


def as_float_array(value, name: str, *, ndim: int | None = None, finite: bool = True):
    """Return ``value`` as a floating-point ndarray, or raise a clear error.

    Parameters
    ----------
    value : array_like
        The argument to check.
    name : str
        The argument's name, used in error messages.
    ndim : int, optional
        Required number of dimensions.
    finite : bool, default True
        Reject NaN and infinite entries.

    Returns
    -------
    ndarray
        ``np.asarray(value)``; float16 is promoted to float32, other floating
        dtypes are kept (no copy is made for an ndarray of a floating dtype).

    Raises
    ------
    TypeError
        If the dtype is not a real floating type (integers, booleans, complex
        and object arrays are refused: convert explicitly, e.g.
        ``x.astype(np.float64)``).
    ValueError
        If the number of dimensions is wrong or an entry is not finite.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name}: expected a real floating-point array, got {type(value).__name__}")
    arr = np.asarray(value)
    if arr.dtype == np.float16:
        arr = arr.astype(np.float32)
    if not np.issubdtype(arr.dtype, np.floating):
        kind = "complex" if np.iscomplexobj(arr) else str(arr.dtype)
        raise TypeError(
            f"{name}: expected a real floating-point array (float32 or float64), "
            f"got {kind} values; convert explicitly, e.g. {name}.astype(np.float64)"
        )
    if arr.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name}: expected float32 or float64, got {_describe_dtype(arr)}")
    if ndim is not None:
        check_ndim(arr, name, ndim)
    if finite:
        check_finite(arr, name)
    return arr


def common_float_dtype(*arrays) -> np.dtype:
    """The floating dtype that the result of a computation on ``arrays`` has.

    It is :func:`numpy.result_type` of the inputs: float32 only when every
    input is float32, float64 as soon as one input is float64.
    """
    return np.result_type(*arrays)


def check_ndim(arr: np.ndarray, name: str, ndim: int) -> None:
    """Raise ``ValueError`` unless ``arr.ndim == ndim``."""
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape} ({arr.ndim}-D)")


def check_shape(arr: np.ndarray, name: str, expected: tuple, labels: tuple | None = None) -> None:
    """Raise ``ValueError`` unless ``arr.shape`` matches ``expected``.

    ``expected`` holds ints or ``None`` (any size).  ``labels`` names the
    dimensions (e.g. ``("K", "d")``) so the message can say where a size came
    from, e.g. ``means: expected shape (K, d) = (3, 2), got (3, 5)``.
    """
    ok = arr.ndim == len(expected) and all(e is None or e == s for e, s in zip(expected, arr.shape))
    if ok:
        return
    shown = tuple("*" if e is None else e for e in expected)
    shown = "(" + ", ".join(str(s) for s in shown) + ("," if len(shown) == 1 else "") + ")"
    if labels is not None:
        msg = f"{name}: expected shape ({', '.join(labels)}{',' if len(labels) == 1 else ''}) = {shown}, got {arr.shape}"
    else:
        msg = f"{name}: expected shape {shown}, got {arr.shape}"
    raise ValueError(msg)


def check_finite(arr: np.ndarray, name: str) -> None:
    """Raise ``ValueError`` if ``arr`` holds NaN or an infinity, saying where."""
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{name}: expected finite values, got {len(bad)} non-finite "
            f"entr{'y' if len(bad) == 1 else 'ies'} (first at index {first}: {arr[first]})"
        )


def check_positive(arr: np.ndarray, name: str) -> None:
    """Raise ``ValueError`` unless every entry of ``arr`` is > 0."""
    if arr.size and not np.all(arr > 0):
        bad = np.argwhere(~(arr > 0))
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{name}: expected strictly positive values, got {arr[first]} at index {first} "
            f"(minimum {np.min(arr)})"
        )


def check_probability_vector(arr: np.ndarray, name: str, *, atol: float | None = None) -> None:
    """Raise ``ValueError`` unless ``arr`` is nonnegative and sums to one.

    The default tolerance on the sum is ``sqrt(eps) * max(1, len(arr))`` of
    the array's dtype (about 1.5e-8 per entry in float64, 3.5e-4 in float32).
    """
    if np.any(arr < 0):
        raise ValueError(f"{name}: expected nonnegative weights, got minimum {np.min(arr)}")
    if atol is None:
        atol = float(np.sqrt(np.finfo(arr.dtype).eps)) * max(1, arr.size)
    total = float(np.sum(arr, dtype=np.float64))
    if abs(total - 1.0) > atol:
        raise ValueError(
            f"{name}: expected weights that sum to 1 (within {atol:.1e}), got sum {total!r}; "
            f"normalise them, e.g. {name} / {name}.sum()"
        )


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, refusing floats, bools and values below ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def check_positive_float(value, name: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a finite Python float > 0 (>= 0 with ``allow_zero``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value!r}")
    return value


def check_option(value, name: str, choices) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}: expected one of {listed}, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_seed(seed, name: str = "seed"):
    """Return ``seed`` if it is an integer >= 0 or a ``numpy.random.Generator``, else raise.

    Booleans and floats are refused (``TypeError``), negative integers too
    (``ValueError``), so a typo never reaches ``numpy.random.default_rng``.
    """
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{name}: expected an integer >= 0 or a numpy.random.Generator, got {type(seed).__name__} {seed!r}"
        )
    return check_int(seed, name, minimum=0)


def check_float_dtype(dtype, name: str = "dtype") -> np.dtype:
    """Return ``np.dtype(dtype)`` if it is float32 or float64, else raise ``TypeError``."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: expected float32 or float64, got {dtype!r} ({e})") from None
    if dt not in (np.float32, np.float64):
        raise TypeError(f"{name}: expected float32 or float64, got {dt}")
    return dt


def check_instance(value, name: str, cls, what: str):
    """Return ``value`` if it is an instance of ``cls``, else raise ``TypeError`` saying ``what`` is expected."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return value
