"""Every public array function: bad input gets a clear error, inputs are never mutated, results are deterministic.

Each entry of ``CASES`` is a public function with a valid call.  Generic
mutations are applied to every floating-point array argument in turn (integer
and complex dtypes, a NaN, an infinity, a missing dimension) and the error must
be the right type and name the argument.  Function-specific bad values
(non-positive variances, weights that do not sum to one, unknown options,
sizes below one) are listed in ``SPECIFIC``.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import attention, gmm

RNG = np.random.default_rng(0)


def _gmm_args(N=6, K=3, d=2):
    rng = np.random.default_rng(1)
    return dict(
        x=rng.normal(size=(N, d)),
        means=rng.normal(size=(K, d)),
        variances=rng.uniform(0.5, 2.0, size=(K, d)),
        weights=np.array([0.2, 0.3, 0.5]),
    )


def _qkv(N=5, d=3, dv=2):
    rng = np.random.default_rng(2)
    return dict(q=rng.normal(size=(N, d)), k=rng.normal(size=(N, d)), v=rng.normal(size=(N, dv)))


def _drop(d, *names):
    return {k: v for k, v in d.items() if k not in names}


# (id, function, kwargs factory)
CASES = [
    ("gmm.log_gaussian_diag", gmm.log_gaussian_diag, lambda: _drop(_gmm_args(), "weights")),
    ("gmm.log_responsibilities", gmm.log_responsibilities, _gmm_args),
    ("gmm.responsibilities", gmm.responsibilities, _gmm_args),
    ("gmm.log_likelihood", gmm.log_likelihood, _gmm_args),
    ("gmm.em_step", gmm.em_step, _gmm_args),
    ("gmm.isotropic_nll", gmm.isotropic_nll, lambda: dict(_drop(_gmm_args(), "variances"), beta=1.5)),
    ("gmm.isotropic_nll_gradient", gmm.isotropic_nll_gradient, lambda: dict(_drop(_gmm_args(), "variances"), beta=1.5)),
    ("gmm.isotropic_surrogate_hessian", gmm.isotropic_surrogate_hessian, lambda: dict(_drop(_gmm_args(), "variances"), beta=1.5)),
    ("gmm.isotropic_m_step", gmm.isotropic_m_step, lambda: dict(_drop(_gmm_args(), "variances"), beta=1.5)),
    ("gmm.newton_step", gmm.newton_step, lambda: dict(_drop(_gmm_args(), "variances"), beta=1.5)),
    ("gmm.hard_assignments", gmm.hard_assignments, lambda: _drop(_gmm_args(), "variances", "weights")),
    ("gmm.kmeans_step", gmm.kmeans_step, lambda: _drop(_gmm_args(), "variances", "weights")),
    (
        "gmm.running_mean_update",
        gmm.running_mean_update,
        lambda: dict(
            means=np.zeros((3, 2)), counts=np.array([0, 2, 1]), x=np.ones((4, 2)), assignments=np.array([0, 2, 2, 1])
        ),
    ),
    ("attention.softmax_attention", attention.softmax_attention, _qkv),
    ("attention.softmax_attention_causal", lambda **kw: attention.softmax_attention(**kw, causal=True), _qkv),
]

# arguments that legitimately take integers (counts and indices)
INTEGER_ARGS = {"counts", "assignments"}


def _float_array_args(kwargs):
    return [
        k for k, v in kwargs.items()
        if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) and k not in INTEGER_ARGS
    ]


def _generic_mutations():
    return {
        "integer dtype": (lambda a: np.round(a).astype(np.int64), TypeError, "expected a real floating-point array"),
        "complex dtype": (lambda a: a + 1j, TypeError, "got complex"),
        "NaN": (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 0, np.nan, a), ValueError, "finite"),
        "infinity": (lambda a: np.where(np.arange(a.size).reshape(a.shape) == a.size - 1, -np.inf, a), ValueError, "finite"),
        "extra dimension": (lambda a: a[np.newaxis], ValueError, "-D array"),
    }


GENERIC = [
    pytest.param(fn, make, arg, mut, id=f"{cid}-{arg}-{mname}")
    for cid, fn, make in CASES
    for arg in _float_array_args(make())
    for mname, mut in _generic_mutations().items()
]


@pytest.mark.parametrize("fn,make,arg,mutation", GENERIC)
def test_bad_array_is_refused_with_a_message_naming_it(fn, make, arg, mutation):
    transform, exc, fragment = mutation
    kwargs = make()
    kwargs[arg] = transform(kwargs[arg])
    with pytest.raises(exc) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{arg}:") or f"{arg}" in msg.split(":")[0], msg
    assert fragment in msg, msg


SPECIFIC = [
    ("variances <= 0", gmm.responsibilities, lambda: {**_gmm_args(), "variances": -_gmm_args()["variances"]}, ValueError, "variances: expected strictly positive"),
    ("weights sum 2", gmm.responsibilities, lambda: {**_gmm_args(), "weights": np.array([0.4, 0.6, 1.0])}, ValueError, "weights: expected weights that sum to 1"),
    ("negative weight", gmm.responsibilities, lambda: {**_gmm_args(), "weights": np.array([-0.5, 0.5, 1.0])}, ValueError, "weights: expected nonnegative"),
    ("K mismatch", gmm.responsibilities, lambda: {**_gmm_args(), "variances": np.ones((2, 2))}, ValueError, "variances: expected shape (K, d) = (3, 2), got (2, 2)"),
    ("d mismatch", gmm.responsibilities, lambda: {**_gmm_args(), "means": np.ones((3, 5))}, ValueError, "means: expected shape (K, d) = (*, 2), got (3, 5)"),
    ("no components", gmm.log_gaussian_diag, lambda: dict(x=np.ones((2, 2)), means=np.ones((0, 2)), variances=np.ones((0, 2))), ValueError, "K >= 1"),
    ("reg_covar < 0", gmm.em_step, lambda: {**_gmm_args(), "reg_covar": -1e-3}, ValueError, "reg_covar: expected a finite number >= 0"),
    ("beta = 0", gmm.isotropic_nll, lambda: dict(x=np.ones((2, 2)), means=np.ones((1, 2)), beta=0.0), ValueError, "beta: expected a finite number > 0"),
    ("beta string", gmm.isotropic_nll, lambda: dict(x=np.ones((2, 2)), means=np.ones((1, 2)), beta="1"), TypeError, "beta: expected a real number"),
    ("counts < 0", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([-1, 0]), x=np.ones((1, 2)), assignments=np.array([0])), ValueError, "counts: expected nonnegative"),
    ("float assignments", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([0, 0]), x=np.ones((1, 2)), assignments=np.array([0.0])), TypeError, "assignments: expected integers"),
    ("scale <= 0", attention.softmax_attention, lambda: {**_qkv(), "scale": -1.0}, ValueError, "scale: expected a finite number > 0"),
    ("causal not bool", attention.softmax_attention, lambda: {**_qkv(), "causal": "yes"}, TypeError, "causal: expected True or False"),
    ("causal lengths", attention.softmax_attention, lambda: {**_qkv(), "q": np.ones((3, 3)), "causal": True}, ValueError, "causal=True needs as many queries as keys"),
    ("v rows", attention.softmax_attention, lambda: {**_qkv(), "v": np.ones((4, 2))}, ValueError, "v: expected shape (N_k, d_v) = (5, *), got (4, 2)"),
    ("list of strings", gmm.responsibilities, lambda: {**_gmm_args(), "x": [["a", "b"]]}, TypeError, "x: expected a real floating-point array"),
]


@pytest.mark.parametrize("fn,make,exc,fragment", [pytest.param(*c[1:], id=c[0]) for c in SPECIFIC])
def test_specific_bad_values_are_refused(fn, make, exc, fragment):
    with pytest.raises(exc) as info:
        fn(**make())
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("fn,make", [pytest.param(fn, make, id=cid) for cid, fn, make in CASES])
def test_inputs_are_never_mutated_and_results_are_deterministic(fn, make):
    kwargs = make()
    copies = {k: v.copy() for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    first = fn(**kwargs)
    second = fn(**kwargs)
    for k, v in copies.items():
        np.testing.assert_array_equal(kwargs[k], v, err_msg=f"{k} was modified")
    for a, b in zip(np.atleast_1d(first) if not isinstance(first, tuple) else first,
                    np.atleast_1d(second) if not isinstance(second, tuple) else second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fn,make", [pytest.param(fn, make, id=cid) for cid, fn, make in CASES])
def test_float32_in_float32_out(fn, make):
    kwargs = {
        k: (v.astype(np.float32) if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) else v)
        for k, v in make().items()
    }
    out = fn(**kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        if isinstance(o, np.ndarray) and np.issubdtype(o.dtype, np.floating):
            assert o.dtype == np.float32
