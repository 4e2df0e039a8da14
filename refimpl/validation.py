"""Input validation shared by every public function of :mod:`refimpl`.

Validation happens once, at the public boundary: each public function makes
one call to a ``_check_*`` helper for its signature (in its own module, or
here when several modules share the signature), and then does only math.
The computational cores never raise; where a result can only be judged after
computing it (an overflowed distance, a zero denominator), the core returns
the quantity and the public function checks it with one of the
``check_*`` functions below.

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
    "check_nonempty",
    "check_nonnegative",
    "check_log_values",
    "check_counts",
    "check_grad_out",
    "check_causal_lengths",
    "check_scan_options",
    "check_gmm",
    "check_qkv",
    "check_weights",
    "check_softmax_logits",
    "check_overflowed_rows",
    "check_scaled_distances",
    "check_denominators",
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


def check_nonempty(arr: np.ndarray, name: str, what: str = "component", symbol: str = "K") -> None:
    """Raise ``ValueError`` if ``arr`` has no rows: a mixture needs at least one component."""
    if arr.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one {what} ({symbol} >= 1), got {symbol} = 0")


def check_nonnegative(arr: np.ndarray, name: str, what: str = "features (the denominators must stay positive)") -> None:
    """Raise ``ValueError`` if an entry of ``arr`` is negative, saying where."""
    if arr.size and np.min(arr) < 0:
        first = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise ValueError(f"{name}: expected nonnegative {what}, got {arr[first]} at index {first}")


def check_log_values(a, name: str) -> np.ndarray:
    """A float array in the log domain: ``-inf`` (the log of a zero weight) is allowed, NaN and ``+inf`` are not."""
    a = as_float_array(a, name, finite=False)
    bad = np.isnan(a) | np.isposinf(a)
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}: expected finite values or -inf (the log of a zero weight), "
            f"got {int(np.sum(bad))} NaN or +inf entries (first at index {first}: {a[first]})"
        )
    return a


def check_counts(counts, name: str, shape: tuple, labels: tuple, *, positive: bool = False) -> np.ndarray:
    """Counts: an integer or float array of ``shape``, finite, nonnegative (positive with ``positive``)."""
    counts = np.asarray(counts)
    if counts.dtype == bool or not (np.issubdtype(counts.dtype, np.integer) or np.issubdtype(counts.dtype, np.floating)):
        raise TypeError(f"{name}: expected an integer or float array, got dtype {counts.dtype}")
    check_shape(counts, name, shape, labels)
    if np.issubdtype(counts.dtype, np.floating):
        check_finite(counts, name)
    if positive:
        check_positive(counts, name)
    elif np.any(counts < 0):
        raise ValueError(f"{name}: expected nonnegative counts, got minimum {np.min(counts)}")
    return counts


def check_grad_out(grad_out, shape: tuple, labels: tuple, dtype) -> np.ndarray:
    """The upstream gradient of a backward: finite floats of the forward output's shape, cast to its dtype."""
    g = as_float_array(grad_out, "grad_out", ndim=len(shape))
    check_shape(g, "grad_out", shape, labels)
    return g.astype(dtype, copy=False)


def check_causal_lengths(n_q: int, n_k: int, causal: bool, names=("phi_q", "phi_k")) -> None:
    """Causal attention pairs query ``i`` with keys ``j <= i``: it needs as many queries as keys."""
    if causal and n_q != n_k:
        raise ValueError(
            f"causal=True needs as many queries as keys (position i attends to j <= i), "
            f"got {names[0]} with {n_q} rows and {names[1]} with {n_k}"
        )


def check_scan_options(causal, eps, chunk_size) -> tuple:
    """``causal`` a bool, ``eps >= 0`` a float, ``chunk_size >= 1`` an int."""
    return check_bool(causal, "causal"), check_positive_float(eps, "eps", allow_zero=True), check_int(chunk_size, "chunk_size", minimum=1)


def check_weights(weights, K: int, name: str = "weights", symbol: str = "K") -> np.ndarray:
    """Mixture weights: a 1-D float array of length ``K``, nonnegative, summing to one."""
    weights = as_float_array(weights, name, ndim=1)
    check_shape(weights, name, (K,), (symbol,))
    check_probability_vector(weights, name)
    return weights


def check_gmm(x, means, variances, weights=None) -> tuple:
    """Points and a diagonal GMM: ``x (N, d)``, ``means, variances (K, d)``, ``weights (K,)``.

    ``weights`` may be omitted (``None``: not part of the call).  Returns the
    arrays cast to their common float dtype (``None`` stays ``None``).
    """
    x = as_float_array(x, "x", ndim=2)
    means = as_float_array(means, "means", ndim=2)
    variances = as_float_array(variances, "variances", ndim=2)
    check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    check_nonempty(means, "means")
    check_shape(variances, "variances", means.shape, ("K", "d"))
    check_positive(variances, "variances")
    arrays = [x, means, variances]
    if weights is not None:
        arrays.append(check_weights(weights, means.shape[0]))
    dtype = common_float_dtype(*arrays)
    out = tuple(a.astype(dtype, copy=False) for a in arrays)
    return out if weights is not None else out + (None,)


def check_qkv(q, k, v) -> tuple:
    """Queries ``(N_q, d)``, keys ``(N_k, d)`` and values ``(N_k, d_v)``, at least one row each, cast to one dtype."""
    q = as_float_array(q, "q", ndim=2)
    k = as_float_array(k, "k", ndim=2)
    v = as_float_array(v, "v", ndim=2)
    check_shape(k, "k", (None, q.shape[1]), ("N_k", "d"))
    check_shape(v, "v", (k.shape[0], None), ("N_k", "d_v"))
    if q.shape[0] < 1 or k.shape[0] < 1:
        raise ValueError(f"q, k: expected at least one row each, got shapes {q.shape} and {k.shape}")
    dtype = common_float_dtype(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)


# ---------------------------------------------------------------------------
# Checks of computed quantities: the cores return them, the public functions check them
# ---------------------------------------------------------------------------


def check_softmax_logits(logits: np.ndarray, names: str, fix: str) -> None:
    """Refuse rows of a 2-D ``logits`` whose softmax is undefined because a product overflowed.

    ``+inf`` (or NaN) in a row, or a row that is all ``-inf``, cannot come
    from finite inputs except through overflow; a softmax would turn it into
    a row of NaN.  These are exactly the rows whose maximum is not finite, so
    one reduction finds them.  ``names`` are the arguments to blame, ``fix``
    says what to change.
    """
    bad = ~np.isfinite(np.max(logits, axis=1))
    check_overflowed_rows(int(np.sum(bad)), int(np.argmax(bad)), logits.dtype, names, fix)


def check_overflowed_rows(n_bad: int, first: int, dtype, names: str, fix: str) -> None:
    """Refuse ``n_bad > 0`` rows of logits that overflowed ``dtype`` (``first`` is the first of them)."""
    if n_bad:
        raise ValueError(
            f"{names}: the logits of {n_bad} row(s) (first: row {first}) overflow "
            f"{np.dtype(dtype)}, so their softmax is undefined; {fix}"
        )


def check_scaled_distances(min_quad: np.ndarray, name: str) -> None:
    """Refuse rows whose smallest scaled squared distance ``min_k sum_j (x_j - mu_kj)^2 / sigma_kj^2`` is not finite.

    A component at an infinite distance simply gets responsibility 0.  A row
    whose every distance overflows (minimum ``+inf``) has no representable
    posterior; NaN means the computation itself overflowed.  Either would
    give a NaN or a wrong row downstream, so it is refused, with the fix.
    """
    bad = ~np.isfinite(min_quad)
    if np.any(bad):
        hint = ", or compute in float64" if min_quad.dtype == np.float32 else ""
        raise ValueError(
            f"{name}: the scaled squared distance sum_j (x_j - mu_kj)^2 / sigma_kj^2 overflows {min_quad.dtype} "
            f"in {int(np.sum(bad))} row(s) (first: row {int(np.argmax(bad))}), for every component or inside its "
            f"expansion, so no posterior can be formed; rescale {name}, the means and the variances{hint}"
        )


def check_denominators(den: np.ndarray, eps: float, names=("phi_q", "phi_k")) -> None:
    """With ``eps = 0`` a query whose features meet no key's has the output 0/0: refuse it."""
    if eps == 0 and den.size and not np.all(den > 0):
        i = int(np.argmin(den > 0))
        raise ValueError(
            f"eps: with eps = 0 the denominator of query row {i} is {den[i]} ({names[0]} row {i} has no overlap "
            f"with any row of {names[1]} it reads, or it underflowed), so its output would be 0/0; pass eps > 0"
        )
