"""The argument checks of every public function of :mod:`refimpl`, in one place.

Validation happens once, at the public boundary: each public function makes
one call to the checker of its signature, and then does only math.  The
checkers live here, grouped by the module they serve (the primitives first,
then the signatures of :mod:`refimpl.gmm`, :mod:`refimpl.gma`,
:mod:`refimpl.attention`, :mod:`refimpl.gmr`, :mod:`refimpl.ovq` and
:mod:`refimpl.theory`), so that the modules of the mechanisms read as their
derivations; a checker that returns many values returns a named tuple.  The
few ``check_*`` functions that :mod:`refimpl.gma` and :mod:`refimpl.ovq`
export for the GPU backends only call the checkers here and gather the
results in their modules' named tuples; they raise nothing of their own.
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
import os
import stat
from collections import namedtuple
from pathlib import Path

import numpy as np

__all__ = [
    "as_float_array",
    "common_float_dtype",
    "common_dtype_arrays",
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
    "check_loaded_state",
    "check_out_folder",
    "check_nonempty",
    "check_nonnegative",
    "check_log_values",
    "check_counts",
    "check_grad_out",
    "check_cu_seqlens",
    "check_packed_tokens",
    "check_packed_end",
    "check_packed_states",
    "check_causal_lengths",
    "check_scan_options",
    "check_weights",
    "check_gmm",
    "check_qkv",
    "check_feature_maps",
    "check_softplus_values",
    "check_raw_from_variances",
    "check_points_and_means",
    "check_isotropic_gmm",
    "check_em_step",
    "check_running_mean",
    "check_gma_tokens",
    "check_gma_mixture",
    "check_like_means",
    "check_gma_weights",
    "check_gma_dense",
    "check_gma_state",
    "check_gma_step",
    "check_one_leading_shape",
    "check_batched_qkv",
    "check_attention_qkv",
    "LinearAttentionArguments",
    "check_linear_attention",
    "BatchedLinearAttentionArguments",
    "check_linear_attention_any",
    "FeatureAttentionArguments",
    "check_feature_attention",
    "SCORE_NAMES",
    "SCORE_FIX",
    "check_softmax_attention",
    "BatchedSoftmaxAttentionArguments",
    "check_batched_softmax_attention",
    "check_softmax_attention_any",
    "check_score_maxima",
    "check_key_value_means",
    "check_kernel_regression",
    "check_mixture_weights",
    "check_gmr_predict",
    "check_key_value_counts",
    "OVQReadoutArguments",
    "check_ovq_readout",
    "check_readout_gap_bound",
    "FitJointGMMArguments",
    "check_fit_joint_gmm",
    "check_joint_gmm_predict",
    "check_dictionary_size",
    "check_ovq_tokens",
    "check_ovq_qkv",
    "check_ovq_batch",
    "check_learning_rate",
    "check_ovq_state",
    "check_ovq_stream_state",
    "check_value_sums",
    "check_responsibilities",
    "check_responsibility_pair",
    "check_rng",
    "check_bound_radius",
    "check_sample_ball",
    "EmpiricalLipschitzArguments",
    "check_empirical_lipschitz",
    "check_per_token_gradients",
    "check_gradient_bounds",
    "check_affinity",
    "check_slot_means",
    "check_isotropic_router",
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


def common_dtype_arrays(*arrays) -> tuple:
    """The arrays cast to :func:`common_float_dtype` of all of them (no copy for those already of it)."""
    dtype = common_float_dtype(*arrays)
    return tuple(a.astype(dtype, copy=False) for a in arrays)


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


def check_loaded_state(path, what: str, state_type, *fields):
    """Return ``state_type(*fields)``, the state read from the file ``path``; an invalid field is a ``ValueError`` naming the file.

    The constructor's ``TypeError`` or ``ValueError`` is raised again as
    ``ValueError("{path}: invalid {what}: {message}")``, chained to it.
    """
    try:
        return state_type(*fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: invalid {what}: {e}") from e


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


def check_cu_seqlens(cu_seqlens) -> np.ndarray:
    """The offsets of packed sequences as int64 ``(S + 1,)``: integers, one-dimensional, from 0, non-decreasing."""
    offsets = np.asarray(cu_seqlens)
    if offsets.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens: expected integer offsets of the packed sequences, got {_describe_dtype(offsets)}")
    if offsets.ndim != 1 or offsets.size == 0:
        raise ValueError(f"cu_seqlens: expected shape (S + 1,), one offset per sequence and the end, got shape {offsets.shape}")
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected the first offset 0 (sequence 0 starts at row 0), got {offsets[0]}")
    drops = np.flatnonzero(np.diff(offsets) < 0)
    if drops.size:
        s = int(drops[0])
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{s + 1}] = {offsets[s + 1]} "
                         f"< cu_seqlens[{s}] = {offsets[s]}")
    return offsets.astype(np.int64)


def check_packed_tokens(x, name: str, given=None) -> None:
    """A packed token array is ``(T, d)`` or ``(T, H, d)`` on the host: ``cu_seqlens`` with a batch dimension as well,
    or with an array on a device (``given``, what ``x`` shows of it), is refused."""
    if hasattr(given, "__cuda_array_interface__") or hasattr(given, "copy_to_host"):  # CuPy, Numba (and its simulator)
        raise TypeError(f"cu_seqlens: packed sequences are taken as host arrays (NumPy), got {name} of type "
                        f"{type(given).__name__} on the device; pass a host copy, or call once per sequence")
    if np.ndim(x) > 3:
        raise ValueError(f"cu_seqlens: packed sequences lie along the first axis of {name}, of shape (T, d) or (T, H, d); "
                         f"got shape {np.shape(x)}, with a batch dimension as well")


def check_packed_end(offsets: np.ndarray, x, name: str) -> None:
    """The last offset is ``T``, the rows of the packed token array ``x``."""
    if offsets[-1] != np.shape(x)[0]:
        raise ValueError(f"cu_seqlens: expected the last offset T = {np.shape(x)[0]}, the rows of {name}, got {offsets[-1]}")


def check_packed_states(state, offsets: np.ndarray, what: str) -> tuple:
    """``state`` of a packed stream: ``None`` (each sequence from empty) or one ``what`` (or ``None``) per sequence."""
    S = offsets.size - 1
    if state is None:
        return (None,) * S
    if not isinstance(state, (list, tuple)) or len(state) != S:
        got = f"{type(state).__name__} of {len(state)}" if isinstance(state, (list, tuple)) else type(state).__name__
        raise ValueError(f"state: with cu_seqlens, expected None or one {what} (or None) per sequence, a list of S = {S}, got {got}")
    return tuple(state)


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


def check_feature_maps(phi_q, phi_k, v, names=("phi_q", "phi_k"), labels=("N_k", "F"), what=None) -> tuple:
    """Nonnegative feature maps ``phi_q (N_q, F)``, ``phi_k (N_k, F)`` and values ``v (N_k, d_v)``, cast to one dtype.

    ``names`` are the arguments' names, ``labels`` the dimension labels of
    ``phi_k``, ``what`` the word for the features in the message of a negative
    entry (the default of :func:`check_nonnegative` when ``None``).
    """
    phi_q = as_float_array(phi_q, names[0], ndim=2)
    phi_k = as_float_array(phi_k, names[1], ndim=2)
    v = as_float_array(v, "v", ndim=2)
    check_shape(phi_k, names[1], (None, phi_q.shape[1]), labels)
    check_shape(v, "v", (phi_k.shape[0], None), ("N_k", "d_v"))
    for a, name in ((phi_q, names[0]), (phi_k, names[1])):
        check_nonnegative(a, name, *(() if what is None else (what,)))
    return common_dtype_arrays(phi_q, phi_k, v)


def check_out_folder(out, name: str = "out") -> Path:
    """The output folder ``out`` as a :class:`~pathlib.Path`, refused unless it is or can become a writable folder.

    Nothing is created: the folder may not exist yet, but its nearest
    existing ancestor must then be a writable folder.

    Parameters
    ----------
    out : str or os.PathLike
        The folder.  An empty string is refused (it is not taken as the
        current folder).
    name : str, default "out"
        The argument's name in the messages.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        ``out`` is empty, is a file, lies below a file, or is (or would be
        created in) a folder that is not writable.
    TypeError
        ``out`` is not a path.
    """
    if isinstance(out, bytes) or not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a folder path, got {type(out).__name__}")
    if not str(os.fspath(out)).strip():
        raise ValueError(f"{name}: expected a folder, got an empty path {os.fspath(out)!r}; pass a folder such as results/run")
    path = Path(out)
    probe = path
    while True:
        try:
            mode = os.stat(probe).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                raise ValueError(f"{name}: {path} cannot be created: no part of it exists") from None
            probe = probe.parent
        except OSError as err:
            raise ValueError(f"{name}: cannot inspect {probe} ({err.strerror or err})") from None
    if not stat.S_ISDIR(mode):
        if probe == path:
            raise ValueError(f"{name}: {path} is a file, not a folder; pass a folder")
        raise ValueError(f"{name}: {path} lies below {probe}, which is a file, not a folder; pass a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = f"{path}" if probe == path else f"{probe}, where {path} would be created,"
        raise ValueError(f"{name}: {where} is not writable (permission denied); pass a folder you can write to")
    return path


# ---------------------------------------------------------------------------
# The signatures of refimpl.gmm
# ---------------------------------------------------------------------------


def check_softplus_values(y) -> np.ndarray:
    """``y`` of :func:`refimpl.gmm.softplus_inverse`: finite floats, all > 0."""
    y = as_float_array(y, "y")
    if np.any(y <= 0):
        raise ValueError(f"y: softplus takes only positive values, got minimum {np.min(y)}")
    return y


def check_raw_from_variances(variances, min_variance) -> tuple:
    """``(variances, min_variance)`` of :func:`refimpl.gmm.raw_from_variances`: ``variances > min_variance > 0``."""
    variances = as_float_array(variances, "variances")
    min_variance = check_positive_float(min_variance, "min_variance")
    if np.any(variances <= min_variance):
        raise ValueError(
            f"variances: expected values > min_variance = {min_variance}, got minimum {np.min(variances)}"
        )
    return variances, min_variance


def check_points_and_means(x, means) -> tuple:
    """Points ``x (N, d)`` and ``means (K, d)``, ``K >= 1``, cast to one dtype."""
    x = as_float_array(x, "x", ndim=2)
    means = as_float_array(means, "means", ndim=2)
    check_shape(means, "means", (None, x.shape[1]), ("K", "d"))
    check_nonempty(means, "means")
    return common_dtype_arrays(x, means)


def check_isotropic_gmm(x, means, beta, weights) -> tuple:
    """``(x, means, variances, weights)`` of an isotropic GMM with covariance ``I / beta``; uniform weights for ``None``."""
    x, means = check_points_and_means(x, means)
    beta = check_positive_float(beta, "beta")
    K = means.shape[0]
    weights = np.full(K, 1.0 / K, dtype=x.dtype) if weights is None else check_weights(weights, K)
    x, means, weights = common_dtype_arrays(x, means, weights)
    return x, means, np.full(means.shape, 1.0 / beta, dtype=x.dtype), weights


def check_em_step(x, means, variances, weights, reg_covar) -> tuple:
    """``(x, means, variances, weights, reg_covar)`` of :func:`refimpl.gmm.em_step`: :func:`check_gmm`, and ``reg_covar >= 0``."""
    return check_gmm(x, means, variances, weights) + (check_positive_float(reg_covar, "reg_covar", allow_zero=True),)


def check_running_mean(means, counts, x, assignments) -> tuple:
    """``(means (K, d), counts (K,), x (B, d), assignments (B,))`` of :func:`refimpl.gmm.running_mean_update`."""
    means = as_float_array(means, "means", ndim=2)
    x = as_float_array(x, "x", ndim=2)
    check_shape(x, "x", (None, means.shape[1]), ("B", "d"))
    counts = check_counts(counts, "counts", (means.shape[0],), ("K",))
    assignments = np.asarray(assignments)
    if not np.issubdtype(assignments.dtype, np.integer):
        raise TypeError(f"assignments: expected integers, got dtype {assignments.dtype}")
    check_shape(assignments, "assignments", (x.shape[0],), ("B",))
    if assignments.size and (assignments.min() < 0 or assignments.max() >= means.shape[0]):
        raise ValueError(
            f"assignments: expected indices in [0, {means.shape[0]}), got range "
            f"[{assignments.min()}, {assignments.max()}]"
        )
    dtype = common_float_dtype(means, x)
    return means.astype(dtype, copy=False), counts, x.astype(dtype, copy=False), assignments


# ---------------------------------------------------------------------------
# The signatures of refimpl.gma
# ---------------------------------------------------------------------------


def check_gma_tokens(x_q, x_k, v, causal) -> tuple:
    """``x_q (..., N_q, d_r)``, ``x_k (..., N_k, d_r)``, ``v (..., N_k, d_v)``: one leading shape, a token at least each."""
    x_q, x_k, v = (as_float_array(a, name) for a, name in ((x_q, "x_q"), (x_k, "x_k"), (v, "v")))
    for a, name, labels in ((x_q, "x_q", "N_q, d_r"), (x_k, "x_k", "N_k, d_r"), (v, "v", "N_k, d_v")):
        if a.ndim < 2:
            raise ValueError(
                f"{name}: expected a 2-D array ({labels}) or one with leading batch dimensions (..., {labels}), "
                f"got shape {a.shape} ({a.ndim}-D)"
            )
    leading = x_q.shape[:-2]
    for a, name in ((x_k, "x_k"), (v, "v")):
        if a.shape[:-2] != leading:
            raise ValueError(
                f"x_q, {name}: expected arrays with the same leading (batch) dimensions, got a {x_q.ndim}-D array "
                f"of shape {x_q.shape} and a {a.ndim}-D array of shape {a.shape}"
            )
    lead = ("...",) * bool(leading)
    check_shape(x_k, "x_k", leading + (None, x_q.shape[-1]), lead + ("N_k", "d_r"))
    check_shape(v, "v", leading + (x_k.shape[-2], None), lead + ("N_k", "d_v"))
    if 0 in leading:
        raise ValueError(f"x_q, x_k: expected at least one sequence, got leading (batch) dimensions {leading}")
    if x_q.shape[-2] < 1 or x_k.shape[-2] < 1:
        raise ValueError(f"x_q, x_k: expected at least one token each, got shapes {x_q.shape} and {x_k.shape}")
    check_causal_lengths(x_q.shape[-2], x_k.shape[-2], causal, names=("x_q", "x_k"))
    return x_q, x_k, v


def check_gma_mixture(x_q, means, second, second_name) -> tuple:
    """``means`` and ``variances`` (or ``raw_variances``): ``(K, d_r)`` shared, or ``(H, K, d_r)`` one GMM per head."""
    leading = x_q.shape[:-2]
    means = as_float_array(means, "means")
    per_head = means.ndim == 3 and len(leading) > 0
    if means.ndim != 2 and not per_head:
        head = (
            f", or a 3-D array (H, K, d_r) with H = {leading[-1]} (the last leading dimension of x_q), one GMM per head"
            if leading
            else "; a 3-D array (H, K, d_r), one GMM per head, needs x_q with a head axis (..., H, N_q, d_r)"
        )
        raise ValueError(f"means: expected a 2-D array (K, d_r) shared by every sequence{head}, got shape {means.shape} ({means.ndim}-D)")
    if per_head and means.shape[0] != leading[-1]:
        raise ValueError(
            f"means: a 3-D array (H, K, d_r) holds one GMM per head, so H must be the last leading dimension of x_q, "
            f"{leading[-1]}; got a 3-D array of shape {means.shape} (pass a 2-D array (K, d_r) to share one GMM)"
        )
    labels = ("H", "K", "d_r")[3 - means.ndim :]
    check_shape(means, "means", means.shape[:-2] + (None, x_q.shape[-1]), labels)
    check_nonempty(means[0] if per_head else means, "means")
    return means, check_like_means(second, second_name, means, means.ndim)


def check_like_means(a, name, means, ndim) -> np.ndarray:
    """``a`` of ``ndim`` dimensions and the shape ``means.shape[:ndim]``: the variances, or the per-head weights and logits."""
    a = as_float_array(a, name)
    labels = ("H", "K", "d_r")[3 - means.ndim :][:ndim]
    if a.ndim != ndim:
        listed = ", ".join(labels) + ("," if len(labels) == 1 else "")
        raise ValueError(f"{name}: expected a {ndim}-D array ({listed}) like means, got shape {a.shape} ({a.ndim}-D)")
    check_shape(a, name, means.shape[:ndim], labels)
    return a


def check_gma_weights(weights, means) -> np.ndarray:
    """GMA's ``weights``: ``(K,)`` for a shared GMM, ``(H, K)`` for one per head (``means`` 3-D); each row a probability vector."""
    if means.ndim == 2:
        return check_weights(weights, means.shape[0])
    weights = check_like_means(weights, "weights", means, 2)
    for h in range(weights.shape[0]):
        check_probability_vector(weights[h], f"weights[{h}]")
    return weights


def check_gma_dense(gamma_q, gamma_k, v, causal, eps) -> tuple:
    """``(gamma_q, gamma_k, v, causal, eps)`` of :func:`refimpl.gma.gma_dense`: nonnegative responsibilities."""
    gamma_q, gamma_k, v = check_feature_maps(gamma_q, gamma_k, v, ("gamma_q", "gamma_k"), ("N_k", "K"), "responsibilities")
    causal = check_bool(causal, "causal")
    eps = check_positive_float(eps, "eps", allow_zero=True)
    check_causal_lengths(gamma_q.shape[0], gamma_k.shape[0], causal, names=("gamma_q", "gamma_k"))
    return gamma_q, gamma_k, v, causal, eps


def check_gma_state(slots, norms, tokens_seen) -> tuple:
    """The sums of a :class:`refimpl.gma.GMAState`: ``slots (K, d_v)``, ``norms (K,)`` >= 0 of one dtype, ``tokens_seen >= 0``."""
    slots = as_float_array(slots, "slots", ndim=2)
    norms = as_float_array(norms, "norms", ndim=1)
    if min(slots.shape) < 1:
        raise ValueError(f"slots: expected shape (K, d_v) with K >= 1 and d_v >= 1, got {slots.shape}")
    check_shape(norms, "norms", slots.shape[:1], ("K",))
    if norms.dtype != slots.dtype:
        raise TypeError(f"norms: expected the dtype of slots ({slots.dtype}), got {norms.dtype}")
    check_nonnegative(norms, "norms", "sums of responsibilities")
    return slots, norms, check_int(tokens_seen, "tokens_seen", minimum=0)


def check_gma_step(args, state, state_type) -> tuple:
    """``(args, state)`` of :func:`refimpl.gma.gma_step`: checked :func:`refimpl.gma.gma` arguments of one sequence, and a state that fits.

    ``state`` ``None`` is an empty stream (``state_type.empty``).  A float64
    state makes the computation float64, as float64 inputs do.
    """
    if args.x_q.ndim != 2:
        raise ValueError(f"x_q: gma_step streams one sequence of one head, expected shape (N, d_r), got {args.x_q.shape}")
    K, d_v = args.means.shape[0], args.v.shape[1]
    state = state_type.empty(K, d_v, args.x_q.dtype) if state is None else check_instance(state, "state", state_type, "a GMAState (or None)")
    if (state.K, state.d_v) != (K, d_v):
        raise ValueError(f"state: holds K = {state.K} slots of d_v = {state.d_v}, but the GMM has K = {K} and v has d_v = {d_v}")
    dtype = common_float_dtype(args.x_q, state.slots)
    return args._replace(**{f: getattr(args, f).astype(dtype, copy=False) for f in ("x_q", "x_k", "v", "means", "variances", "weights")}), state


# ---------------------------------------------------------------------------
# The signatures of refimpl.attention
# ---------------------------------------------------------------------------


def check_one_leading_shape(q, k, v) -> tuple:
    """``(q, k, v)`` as float arrays (not cast, not checked finite) of one leading (batch) shape, each at least 2-D."""
    q, k, v = (as_float_array(a, name, finite=False) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    if min(q.ndim, k.ndim, v.ndim) < 2 or not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k, v: expected arrays with the same leading (batch) dimensions, each at least a 2-D array "
            f"(..., N_q, d), (..., N_k, d), (..., N_k, d_v); got shapes {q.shape}, {k.shape} and {v.shape}"
        )
    return q, k, v


def check_batched_qkv(q, k, v) -> tuple:
    """``q (..., N_q, d)``, ``k (..., N_k, d)``, ``v (..., N_k, d_v)`` with one leading shape; the GPU backends share it.

    Returns ``(q, k, v, batch_shape)``, the arrays cast to their common float
    dtype.  2-D arrays are checked by :func:`check_qkv`
    (``batch_shape = ()``); with leading dimensions, every ``(..., N, d)``
    slice must pass the same check, so the messages about the last two
    dimensions are the 2-D ones.
    """
    if all(np.ndim(a) == 2 for a in (q, k, v)):
        return check_qkv(q, k, v) + ((),)
    q, k, v = check_one_leading_shape(q, k, v)
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_finite(a, name)
    # the 2-D checks of one (N, d) slice: zero-stride stand-ins of the last two dimensions (there may be no slice)
    check_qkv(*(np.broadcast_to(np.zeros((), a.dtype), a.shape[-2:]) for a in (q, k, v)))
    dtype = common_float_dtype(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), q.shape[:-2]


def check_attention_qkv(q, k, v, causal) -> tuple:
    """``(q, k, v, causal)`` of one sequence (:func:`check_qkv`), with as many queries as keys when causal."""
    q, k, v = check_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    check_causal_lengths(q.shape[0], k.shape[0], causal, names=("q", "k"))
    return q, k, v, causal


LinearAttentionArguments = namedtuple("LinearAttentionArguments", "q k v causal eps chunk_size")


def check_linear_attention(q, k, v, causal, eps, chunk_size) -> LinearAttentionArguments:
    """The arguments of :func:`refimpl.attention.linear_attention_forward`, checked."""
    q, k, v, causal = check_attention_qkv(q, k, v, causal)
    causal, eps, chunk_size = check_scan_options(causal, eps, chunk_size)
    return LinearAttentionArguments(q, k, v, causal, eps, chunk_size)


BatchedLinearAttentionArguments = namedtuple("BatchedLinearAttentionArguments", "q k v causal eps chunk_size batch_shape")


def check_linear_attention_any(q, k, v, causal, eps, chunk_size) -> BatchedLinearAttentionArguments:
    """The checks of :func:`refimpl.attention.linear_attention_forward`: the 2-D ones, or with leading dimensions.

    Returns ``(q, k, v, causal, eps, chunk_size, batch_shape)``,
    ``batch_shape`` ``()`` for 2-D inputs.  With leading dimensions the
    arrays pass :func:`check_batched_qkv` (the 2-D messages for the last two
    dimensions) and hold at least one sequence.
    """
    if all(np.ndim(a) == 2 for a in (q, k, v)):
        return BatchedLinearAttentionArguments(*check_linear_attention(q, k, v, causal, eps, chunk_size), ())
    q, k, v, batch_shape = check_batched_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    check_causal_lengths(q.shape[-2], k.shape[-2], causal, names=("q", "k"))
    causal, eps, chunk_size = check_scan_options(causal, eps, chunk_size)
    if 0 in batch_shape:
        raise ValueError(f"q, k, v: expected at least one sequence, got leading (batch) dimensions {batch_shape}")
    return BatchedLinearAttentionArguments(q, k, v, causal, eps, chunk_size, batch_shape)


FeatureAttentionArguments = namedtuple("FeatureAttentionArguments", "phi_q phi_k v causal eps chunk_size")


def check_feature_attention(phi_q, phi_k, v, causal, eps, chunk_size) -> FeatureAttentionArguments:
    """The arguments of :func:`refimpl.attention.feature_attention_forward`, checked."""
    phi_q, phi_k, v = check_feature_maps(phi_q, phi_k, v)
    causal, eps, chunk_size = check_scan_options(causal, eps, chunk_size)
    check_causal_lengths(phi_q.shape[0], phi_k.shape[0], causal)
    return FeatureAttentionArguments(phi_q, phi_k, v, causal, eps, chunk_size)


#: Who is blamed, and the fix, when the scores of a row of softmax attention overflow.
SCORE_NAMES = "scale, q, k"
SCORE_FIX = "lower scale or rescale q and k"


def check_softmax_attention(q, k, v, scale, causal):
    """The checks of :func:`refimpl.attention.softmax_attention_forward` (2-D ``q, k, v``); the GPU backends share it."""
    q, k, v, causal = check_attention_qkv(q, k, v, causal)
    scale = 1.0 / np.sqrt(q.shape[1]) if scale is None else check_positive_float(scale, "scale")
    return q, k, v, scale, causal


BatchedSoftmaxAttentionArguments = namedtuple("BatchedSoftmaxAttentionArguments", "q k v scale causal batch_shape")


def check_batched_softmax_attention(q, k, v, scale, causal) -> BatchedSoftmaxAttentionArguments:
    """The checks of :func:`refimpl.attention.softmax_attention` (leading batch dimensions allowed); the GPU backends share it.

    Returns ``(q, k, v, scale, causal, batch_shape)``.
    """
    q, k, v, batch_shape = check_batched_qkv(q, k, v)
    causal = check_bool(causal, "causal")
    check_causal_lengths(q.shape[-2], k.shape[-2], causal, names=("q", "k"))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else check_positive_float(scale, "scale")
    return BatchedSoftmaxAttentionArguments(q, k, v, scale, causal, batch_shape)


def check_softmax_attention_any(q, k, v, scale, causal) -> BatchedSoftmaxAttentionArguments:
    """The checks :func:`refimpl.attention.softmax_attention` makes: the 2-D ones for 2-D inputs, the batched ones otherwise.

    Returns ``(q, k, v, scale, causal, batch_shape)``, ``batch_shape`` ``()``
    for 2-D inputs.
    """
    if all(np.ndim(a) == 2 for a in (q, k, v)):
        return BatchedSoftmaxAttentionArguments(*check_softmax_attention(q, k, v, scale, causal), ())
    return check_batched_softmax_attention(q, k, v, scale, causal)


def check_score_maxima(row_max) -> None:
    """Refuse score rows whose maximum is not finite (overflow), as the forward's check of its logits; the GPU backends share it.

    ``row_max`` holds the maximum score of every row, the rows of all
    sequences counted in C order (row ``b N_q + i`` for query ``i`` of
    sequence ``b``); the message is that of
    :func:`check_softmax_logits` on those rows.
    """
    row_max = np.asarray(row_max)
    bad = ~np.isfinite(row_max.ravel())
    check_overflowed_rows(int(np.sum(bad)), int(np.argmax(bad)) if bad.size else 0, row_max.dtype, SCORE_NAMES, SCORE_FIX)


# ---------------------------------------------------------------------------
# The signatures of refimpl.gmr
# ---------------------------------------------------------------------------


def check_key_value_means(q, key_means, value_means, names=("key_means", "value_means")) -> tuple:
    """Queries ``q (N_q, d)``, key means ``(M, d)`` and value means ``(M, d_v)``, ``M >= 1`` (not cast)."""
    q = as_float_array(q, "q", ndim=2)
    key_means = as_float_array(key_means, names[0], ndim=2)
    value_means = as_float_array(value_means, names[1], ndim=2)
    check_shape(key_means, names[0], (None, q.shape[1]), ("M", "d"))
    M = key_means.shape[0]
    check_nonempty(key_means, names[0], symbol="M")
    check_shape(value_means, names[1], (M, None), ("M", "d_v"))
    return q, key_means, value_means


def check_kernel_regression(q, k, v, beta) -> tuple:
    """``(q, k, v, beta)`` of :func:`refimpl.gmr.kernel_regression`."""
    return check_qkv(q, k, v) + (check_positive_float(beta, "beta"),)


def check_mixture_weights(weights, name, M) -> np.ndarray:
    """A probability vector of length ``M`` (the components of a mixture), named ``name``."""
    weights = as_float_array(weights, name, ndim=1)
    check_shape(weights, name, (M,), ("M",))
    check_probability_vector(weights, name)
    return weights


def check_gmr_predict(q, key_means, value_means, weights, beta) -> tuple:
    """``(q, key_means, value_means, weights, beta)`` of :func:`refimpl.gmr.gmr_predict`, cast to one dtype."""
    q, key_means, value_means = check_key_value_means(q, key_means, value_means)
    beta = check_positive_float(beta, "beta")
    weights = check_mixture_weights(weights, "weights", key_means.shape[0])
    return common_dtype_arrays(q, key_means, value_means, weights) + (beta,)


def check_key_value_counts(q, key_means, value_means, counts) -> tuple:
    """``(q, key_means, value_means, counts)``: :func:`check_key_value_means` and positive counts ``(M,)``."""
    q, key_means, value_means = check_key_value_means(q, key_means, value_means)
    return q, key_means, value_means, check_counts(counts, "counts", (key_means.shape[0],), ("M",), positive=True)


OVQReadoutArguments = namedtuple("OVQReadoutArguments", "q key_means value_means counts beta count_bias")


def check_ovq_readout(q, key_means, value_means, counts, beta, count_bias) -> OVQReadoutArguments:
    """``(q, key_means, value_means, counts, beta, count_bias)`` of :func:`refimpl.gmr.ovq_readout`, cast to one dtype."""
    q, key_means, value_means = check_key_value_means(q, key_means, value_means)
    beta = check_positive_float(beta, "beta")
    counts = check_counts(counts, "counts", (key_means.shape[0],), ("M",), positive=True)
    count_bias = check_bool(count_bias, "count_bias")
    return OVQReadoutArguments(*(common_dtype_arrays(q, key_means, value_means) + (counts, beta, count_bias)))


def check_readout_gap_bound(key_means, value_means, beta) -> tuple:
    """``(key_means, value_means, beta)`` of :func:`refimpl.gmr.readout_gap_bound`."""
    key_means = as_float_array(key_means, "key_means", ndim=2)
    value_means = as_float_array(value_means, "value_means", ndim=2)
    check_nonempty(key_means, "key_means", symbol="M")
    check_shape(value_means, "value_means", (key_means.shape[0], None), ("M", "d_v"))
    return key_means, value_means, check_positive_float(beta, "beta")


FitJointGMMArguments = namedtuple("FitJointGMMArguments", "k v n_components n_iter reg_covar seed")


def check_fit_joint_gmm(k, v, n_components, n_iter, reg_covar, seed) -> FitJointGMMArguments:
    """``(k, v, M, n_iter, reg_covar, seed)`` of :func:`refimpl.gmr.fit_joint_gmm`, ``k`` and ``v`` of one dtype."""
    k = as_float_array(k, "k", ndim=2)
    v = as_float_array(v, "v", ndim=2)
    check_shape(v, "v", (k.shape[0], None), ("T", "d_v"))
    T = k.shape[0]
    M = check_int(n_components, "n_components", minimum=1)
    if M > T:
        raise ValueError(f"n_components: expected at most T = {T} components (one per row), got {M}")
    n_iter = check_int(n_iter, "n_iter", minimum=0)
    reg_covar = check_positive_float(reg_covar, "reg_covar", allow_zero=True)
    return FitJointGMMArguments(*(common_dtype_arrays(k, v) + (M, n_iter, reg_covar, check_int(seed, "seed", minimum=0))))


def check_joint_gmm_predict(q, fit, fit_type) -> tuple:
    """``(q, key_means, value_means, key_variances, weights)`` of a fitted joint GMM ``fit`` (a ``fit_type``), one dtype."""
    if not isinstance(fit, fit_type):
        raise TypeError(f"fit: expected a JointGMM from fit_joint_gmm, got {type(fit).__name__}")
    q, key_means, value_means = check_key_value_means(q, fit.key_means, fit.value_means, ("fit.key_means", "fit.value_means"))
    key_variances = as_float_array(fit.key_variances, "fit.key_variances", ndim=2)
    check_shape(key_variances, "fit.key_variances", key_means.shape, ("M", "d"))
    check_positive(key_variances, "fit.key_variances")
    weights = check_mixture_weights(fit.weights, "fit.weights", key_means.shape[0])
    return common_dtype_arrays(q, key_means, value_means, key_variances, weights)




# ---------------------------------------------------------------------------
# The signatures of refimpl.ovq
# ---------------------------------------------------------------------------


def check_dictionary_size(t, max_size, growth, growths) -> tuple:
    """``(t, n_max, growth)`` of :func:`refimpl.ovq.dictionary_size`: ``t >= 0`` an int or an int64 array, ``growth`` one of ``growths``."""
    n_max = check_int(max_size, "max_size", minimum=1)
    growth = check_option(growth, "growth", growths)
    if not isinstance(t, (np.ndarray, list, tuple)):
        return check_int(t, "t", minimum=0), n_max, growth
    t = np.asarray(t)
    if not np.issubdtype(t.dtype, np.integer) or t.dtype == bool:
        raise TypeError(f"t: expected integers, got dtype {t.dtype}")
    if t.size and np.min(t) < 0:
        raise ValueError(f"t: expected token counts >= 0, got minimum {np.min(t)}")
    # growth computes t * n_max in int64
    if t.size and np.max(t) > (np.iinfo(np.int64).max - n_max) // n_max:
        raise ValueError(f"t: t * max_size overflows int64 (max t = {np.max(t)}, max_size = {n_max})")
    return t.astype(np.int64), n_max, growth


def check_ovq_tokens(q, k, v) -> tuple:
    """Queries and keys ``(N, d)`` and values ``(N, d_v)`` of OVQ and VQ attention, ``N, d >= 1`` (not cast)."""
    q, k, v = (as_float_array(x, name, ndim=2) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"q: expected shape (N, d) with N >= 1 and d >= 1, got {q.shape}")
    check_shape(k, "k", q.shape, ("N", "d"))
    check_shape(v, "v", (q.shape[0], None), ("N", "d_v"))
    return q, k, v


def check_ovq_qkv(q, k, v) -> tuple:
    """``(q, k, v)`` of :func:`refimpl.ovq.ovq_attention`: :func:`check_ovq_tokens`, and values of ``d_v >= 1``."""
    q, k, v = check_ovq_tokens(q, k, v)
    if v.shape[1] < 1:
        raise ValueError(f"v: expected shape (N, d_v) with d_v >= 1, got {v.shape}")
    return q, k, v


def check_ovq_batch(q, k, v, state) -> tuple:
    """``(q, k, v, lead)`` of OVQ's forward with leading dimensions: float arrays of one leading shape, no state.

    Only what a batch adds is checked here (not cast, not checked finite):
    each sequence is then checked as a 2-D call.
    """
    q, k, v = check_one_leading_shape(q, k, v)
    lead = q.shape[:-2]
    if state is not None:
        raise ValueError(f"state: a stream continues one sequence, q of shape (N, d); got leading dimensions {lead}, "
                         f"so call once per sequence")
    if 0 in lead:
        raise ValueError(f"q: expected at least one sequence in the leading dimensions, got shape {q.shape}")
    return q, k, v, lead


def check_learning_rate(learning_rate):
    """OVQ's ``learning_rate``: ``None`` (the adaptive ``1/c`` running mean), or a constant step ``eta`` in ``(0, 1]``."""
    if learning_rate is None:
        return None
    eta = check_positive_float(learning_rate, "learning_rate")
    if eta > 1:
        raise ValueError(f"learning_rate: expected a constant step in (0, 1] (D += eta (x - D) token by token), "
                         f"or None for the adaptive 1/c running mean, got {eta!r}")
    return eta


def check_ovq_state(keys, values, counts, size, tokens_seen) -> tuple:
    """The fields of a :class:`refimpl.ovq.OVQState`, each invariant of its docstring refused with its own message.

    Returns ``(keys, values, counts, size, tokens_seen)``: ``keys (n_max, d)``
    and ``values (n_max, d_v)`` of one float dtype, integer ``counts
    (n_max,)`` (not cast), ``0 <= size <= n_max``, and ``tokens_seen =
    sum(counts)``.
    """
    keys, values = as_float_array(keys, "keys", ndim=2), as_float_array(values, "values", ndim=2)
    n_max = keys.shape[0]
    if n_max < 1 or keys.shape[1] < 1:
        raise ValueError(f"keys: expected shape (n_max, d) with n_max >= 1 and d >= 1, got {keys.shape}")
    check_shape(values, "values", (n_max, None), ("n_max", "d_v"))
    if keys.dtype != values.dtype:
        raise TypeError(f"values: expected the dtype of keys ({keys.dtype}), got {values.dtype}")
    counts = np.asarray(counts)
    if counts.dtype == bool or not np.issubdtype(counts.dtype, np.integer):
        raise TypeError(f"counts: expected integers (int64), got dtype {counts.dtype}")
    check_counts(counts, "counts", (n_max,), ("n_max",))
    size = check_int(size, "size", minimum=0)
    if size > n_max:
        raise ValueError(f"size: expected at most n_max = {n_max} (the rows of keys), got {size}")
    tokens_seen = check_int(tokens_seen, "tokens_seen", minimum=0)
    if np.any(counts[:size] < 1):
        raise ValueError(f"counts: every active row (< size = {size}) needs a count >= 1, got minimum {np.min(counts[:size])}")
    if np.any(counts[size:] != 0):
        raise ValueError(f"counts: rows >= size = {size} are unused and must have count 0, got {int(np.sum(counts[size:] != 0))} nonzero")
    if np.sum(counts, dtype=np.int64) != tokens_seen:
        raise ValueError(f"counts: expected sum(counts) == tokens_seen = {tokens_seen}, got {int(np.sum(counts, dtype=np.int64))}")
    return keys, values, counts, size, tokens_seen


def check_ovq_stream_state(state, state_type, params, N, d, d_v, growth_of) -> None:
    """A ``state`` (a ``state_type``) that a call of OVQ with options ``params`` on ``N`` tokens can continue.

    Its capacity and dimensions must be those of the call, and its size must
    let the first chunk seed what the growth asks for; ``growth_of(t, n_max,
    growth)`` is the dictionary size after ``t`` tokens
    (:func:`refimpl.ovq.dictionary_size` of checked arguments).
    """
    check_instance(state, "state", state_type, "an OVQState (or None)")
    if state.max_size != params.max_size:
        raise ValueError(f"state: has n_max = {state.max_size} rows but max_size = {params.max_size}; pass max_size={state.max_size}")
    if state.d != d:
        raise ValueError(f"state: holds keys of dimension d = {state.d}, but q and k have d = {d}")
    if state.d_v != d_v:
        raise ValueError(f"state: holds values of dimension d_v = {state.d_v}, but v has d_v = {d_v}")
    # n' - n <= L: the first chunk must be able to seed the rows growth asks for
    # (after it, n >= growth(t) and growth rises by at most one per token)
    L = min(params.chunk_size, N)
    needed = growth_of(state.tokens_seen + L, params.max_size, params.growth) - state.size
    if needed > L:
        least = growth_of(state.tokens_seen, params.max_size, params.growth)
        raise ValueError(f"state: size = {state.size} after tokens_seen = {state.tokens_seen} is too small for growth={params.growth!r}: "
                         f"the first chunk of {L} tokens would need {needed} new centroids; a state that ovq_attention returned "
                         f"with this growth has size >= dictionary_size(tokens_seen, max_size, growth) = {least}")


def check_value_sums(v, tokens: int, dtype, state_values=None) -> None:
    """Refuse values whose running mean could overflow ``dtype``: OVQ and VQ add up to ``tokens`` of them before dividing.

    The exact running mean is ``(c D + sum_S v) / (c + |S|)``, whose numerator
    is at most ``tokens * max|v|`` in magnitude (``state_values``, the value
    dictionary of a state passed in, count as values).  Below that bound
    nothing overflows; above it the result could be ``inf``.
    """
    vmax = float(np.max(np.abs(v), initial=0.0))
    if state_values is not None:
        vmax = max(vmax, float(np.max(np.abs(state_values), initial=0.0)))
    if vmax * tokens > float(np.finfo(dtype).max):
        hint = ", or compute in float64" if np.dtype(dtype) == np.float32 else ""
        raise ValueError(
            f"v: the running means of the values add up to {tokens} values before dividing, and with magnitudes up to "
            f"{vmax:.3g} that sum would overflow {np.dtype(dtype)}; rescale v{hint}"
        )


# ---------------------------------------------------------------------------
# The signatures of refimpl.theory
# ---------------------------------------------------------------------------


def check_responsibilities(gamma, name, K=None) -> np.ndarray:
    """Responsibilities ``(N, K)``: nonnegative rows that sum to one (within ``sqrt(u) K``)."""
    gamma = as_float_array(gamma, name, ndim=2)
    if K is not None:
        check_shape(gamma, name, (None, K), ("N", "K"))
    check_nonnegative(gamma, name, "responsibilities")
    tol = float(np.sqrt(np.finfo(gamma.dtype).eps)) * max(1, gamma.shape[1])
    worst = float(np.max(np.abs(gamma.sum(axis=1) - 1))) if gamma.size else 0.0
    if worst > tol:
        raise ValueError(f"{name}: expected rows that sum to 1 (within {tol:.1e}), got a row off by {worst:.2e}")
    return gamma


def check_responsibility_pair(gamma_q, gamma_k) -> tuple:
    """Query and key responsibilities ``(N_q, K)``, ``(N_k, K)``."""
    gamma_q = check_responsibilities(gamma_q, "gamma_q")
    return gamma_q, check_responsibilities(gamma_k, "gamma_k", K=gamma_q.shape[1])


def check_rng(seed, name: str = "seed") -> np.random.Generator:
    """A ``numpy.random.Generator``: ``seed`` itself, or one seeded with it (:func:`check_seed`)."""
    seed = check_seed(seed, name)
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def check_bound_radius(means, variances, bound_x, min_variance) -> tuple:
    """``(means, variances, bound_x, floor)`` of :func:`refimpl.theory.bound_radius`; ``floor`` is the variance floor."""
    means = as_float_array(means, "means", ndim=2)
    variances = as_float_array(variances, "variances", ndim=2)
    check_shape(variances, "variances", means.shape, ("K", "d"))
    check_positive(variances, "variances")
    bound_x = check_positive_float(bound_x, "bound_x", allow_zero=True)
    floor = float(np.min(variances))
    if min_variance is not None:
        min_variance = check_positive_float(min_variance, "min_variance")
        if min_variance > floor:
            raise ValueError(f"min_variance: expected a floor <= the smallest variance {floor!r}, got {min_variance!r}")
        floor = min_variance
    return means, variances, bound_x, floor


def check_sample_ball(n, d, radius, rng) -> tuple:
    """``(n, d, radius, rng)`` of :func:`refimpl.theory.sample_ball`."""
    n = check_int(n, "n", minimum=0)
    d = check_int(d, "d", minimum=1)
    radius = check_positive_float(radius, "radius", allow_zero=True)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator, got {type(rng).__name__}")
    return n, d, radius, rng


EmpiricalLipschitzArguments = namedtuple("EmpiricalLipschitzArguments", "means variances weights bound_x n_points n_pairs rng")


def check_empirical_lipschitz(means, variances, weights, bound_x, n_points, n_pairs, seed) -> EmpiricalLipschitzArguments:
    """``(means, variances, weights, bound_x, n_points, n_pairs, rng)`` of :func:`refimpl.theory.empirical_lipschitz`."""
    means = as_float_array(means, "means", ndim=2)
    bound_x = check_positive_float(bound_x, "bound_x", allow_zero=True)
    n_points = check_int(n_points, "n_points", minimum=1)
    n_pairs = check_int(n_pairs, "n_pairs", minimum=1)
    rng = check_rng(seed)
    # analysis in float64: the points are drawn in float64 whatever the dtype of the mixture
    _, means, variances, weights = check_gmm(np.zeros((1, means.shape[1])), means, variances, weights)
    return EmpiricalLipschitzArguments(means, variances, weights, bound_x, n_points, n_pairs, rng)


def check_per_token_gradients(x, means, variances, weights, grad_resp) -> tuple:
    """``(x, means, variances, weights, grad_resp)`` of :func:`refimpl.theory.per_token_gradients`, one dtype."""
    x, means, variances, weights = check_gmm(x, means, variances, weights)
    g = as_float_array(grad_resp, "grad_resp", ndim=2)
    check_shape(g, "grad_resp", (x.shape[0], means.shape[0]), ("N", "K"))
    return common_dtype_arrays(x, means, variances, weights, g)


def check_gradient_bounds(gamma, grad_resp, radius) -> tuple:
    """``(gamma, grad_resp, radius)`` of :func:`refimpl.theory.gradient_bounds`."""
    gamma = check_responsibilities(gamma, "gamma")
    g = as_float_array(grad_resp, "grad_resp", ndim=2)
    check_shape(g, "grad_resp", gamma.shape, ("N", "K"))
    return gamma, g, check_positive_float(radius, "radius", allow_zero=True)


def check_affinity(gamma_q, gamma_k, causal) -> tuple:
    """``(gamma_q, gamma_k, causal)`` of :func:`refimpl.theory.affinity`."""
    gamma_q, gamma_k = check_responsibility_pair(gamma_q, gamma_k)
    causal = check_bool(causal, "causal")
    if causal and gamma_q.shape[0] != gamma_k.shape[0]:
        raise ValueError(f"causal=True needs N_q == N_k, got {gamma_q.shape[0]} and {gamma_k.shape[0]}")
    return gamma_q, gamma_k, causal


def check_slot_means(gamma_k, v) -> tuple:
    """``(gamma_k, v)`` of :func:`refimpl.theory.slot_means`: every slot with a positive mass."""
    gamma_k = check_responsibilities(gamma_k, "gamma_k")
    v = as_float_array(v, "v", ndim=2)
    check_shape(v, "v", (gamma_k.shape[0], None), ("N_k", "d_v"))
    z = gamma_k.sum(axis=0)
    if np.any(z <= 0):
        raise ValueError(f"gamma_k: every slot needs a positive mass, got column sums with minimum {np.min(z)}")
    return gamma_k, v


def check_isotropic_router(x, means, variance, weights) -> tuple:
    """``(x, means, variance, weights)`` of :func:`refimpl.theory.isotropic_router_logits`."""
    variance = check_positive_float(variance, "variance")
    means = as_float_array(means, "means", ndim=2)
    x, means, _, weights = check_gmm(x, means, np.full(means.shape, variance, dtype=means.dtype), weights)
    return x, means, variance, weights


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
