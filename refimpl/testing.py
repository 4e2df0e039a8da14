r"""What the test suite and ``python -m refimpl verify`` share: tolerances, problem builders, finite differences.

One home for each: the float32 and float64 tolerances every comparison uses,
the random problems both draw (so a check and a test of the same identity
see the same inputs), the definition-level oracles, and the central
differences of a mechanism's outputs.

Tolerances
----------
float64 results are compared at ``rtol = 1e-12`` (a few hundred times the
machine epsilon ``u = 2.2e-16``: the reorderings of a sum of ``N K`` terms
that two correct implementations may differ by), float32 results against
float64 ones at ``rtol = 1e-4``, ``atol = 5e-4`` of the result's scale
(``u = 1.2e-7`` grown by the same reorderings and by the float32 rounding of
the inputs' exponentials).  Finite-difference gradients are compared at
``rtol = 1e-6`` (central differences with ``h = 1e-6`` are accurate to about
``1e-9`` relative for order-one losses, see :mod:`refimpl.gradcheck`; the
margin absorbs losses of larger curvature).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from .gradcheck import numerical_gradient

__all__ = [
    "TOL",
    "GRAD_TOL",
    "GMA_FIELDS",
    "assert_close",
    "assert_close_f32",
    "assert_grads_close",
    "fd_gradients",
    "random_gmm",
    "gma_problem",
    "direct_log_joint",
    "sklearn_gmm",
    "assert_same_state",
    "assignment_plan",
    "spread_means_example",
    "exact_log_joint",
    "exact_responsibilities",
    "row_relative_error",
]

#: ``np.testing.assert_allclose`` keyword arguments per result dtype.
TOL = {np.float64: dict(rtol=1e-12, atol=1e-13), np.float32: dict(rtol=1e-4, atol=5e-4)}
#: Hand-derived gradients against central differences (``atol`` is scaled by the gradient's size).
GRAD_TOL = dict(rtol=1e-6, atol=1e-8)
#: The inputs of :func:`refimpl.gma.gma_forward`, in order.
GMA_FIELDS = ("x_q", "x_k", "v", "means", "raw_variances", "logits")


def assert_close(actual, expected, dtype=np.float64, err_msg=""):
    """``assert_allclose`` with the tolerance of ``dtype`` (:data:`TOL`)."""
    np.testing.assert_allclose(actual, expected, err_msg=err_msg, **TOL[np.dtype(dtype).type])


def assert_close_f32(out32, ref64, err_msg=""):
    """A float32 result against the float64 result of the same inputs: rtol 1e-4, atol 5e-4 of the scale."""
    assert np.asarray(out32).dtype == np.float32, f"expected a float32 result, got {np.asarray(out32).dtype}"
    scale = max(1.0, float(np.max(np.abs(ref64)))) if np.size(ref64) else 1.0
    tol = TOL[np.float32]
    np.testing.assert_allclose(out32, ref64, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=err_msg)


def assert_grads_close(analytic, numerical, names=None):
    """Each analytic gradient against its finite differences (:data:`GRAD_TOL`, ``atol`` scaled by the size)."""
    for i, (a, b) in enumerate(zip(analytic, numerical, strict=True)):
        scale = max(1.0, float(np.max(np.abs(b)))) if np.size(b) else 1.0
        name = names[i] if names is not None else str(i)
        np.testing.assert_allclose(a, b, rtol=GRAD_TOL["rtol"], atol=GRAD_TOL["atol"] * scale, err_msg=name)


def fd_gradients(f, args, g, h=1e-6):
    """Central differences of ``sum(g * f(*args))`` with respect to every array in ``args``.

    The gradient of that loss is exactly what a backward returns for the
    upstream gradient ``g``.
    """

    def loss_of(i):
        return lambda a: np.sum(g * f(*args[:i], a, *args[i + 1 :]))

    return [numerical_gradient(loss_of(i), arr, h=h) for i, arr in enumerate(args)]


def random_gmm(seed, N=50, K=4, d=3, *, dtype=np.float64, scale=1.0, var_range=(0.3, 2.0)):
    """Points and a diagonal GMM: ``x, means ~ N(0, scale^2)``, variances uniform in ``var_range * scale^2``, Dirichlet weights.

    ``seed`` is an integer or a ``numpy.random.Generator`` (which is advanced).
    Returns the list ``[x, means, variances, weights]``.
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    x = rng.normal(size=(N, d)) * scale
    means = rng.normal(size=(K, d)) * scale
    variances = rng.uniform(*var_range, size=(K, d)) * scale**2
    weights = rng.dirichlet(np.ones(K))
    return [np.asarray(a).astype(dtype) for a in (x, means, variances, weights)]


def gma_problem(seed, n_q=9, n_k=9, K=3, d_r=2, d_v=3, dtype=np.float64):
    """Unconstrained GMA inputs, standard normal, in the order of :data:`GMA_FIELDS` (``gma_forward``)."""
    rng = np.random.default_rng(seed)
    shapes = [(n_q, d_r), (n_k, d_r), (n_k, d_v), (K, d_r), (K, d_r), (K,)]
    return [rng.normal(size=shape).astype(dtype) for shape in shapes]


def direct_log_joint(x, means, variances, weights):
    """``log pi_k + sum_j log N(x_j; mu_kj, sigma_kj^2)`` per component, by ``scipy.stats``: the definition."""
    cols = [stats.norm.logpdf(x, loc=means[k], scale=np.sqrt(variances[k])).sum(axis=1) for k in range(len(weights))]
    with np.errstate(divide="ignore"):
        return np.stack(cols, axis=1) + np.log(weights)


def sklearn_gmm(means, variances, weights):
    """scikit-learn's ``GaussianMixture(covariance_type="diag")`` with its parameters set by hand: an independent oracle.

    scikit-learn is a test dependency (the ``dev`` extra), imported here only when called.
    """
    from sklearn.mixture import GaussianMixture

    g = GaussianMixture(n_components=len(weights), covariance_type="diag")
    g.means_, g.covariances_, g.weights_ = means, variances, weights
    g.precisions_cholesky_ = 1.0 / np.sqrt(variances)
    return g


def assert_same_state(a, b):
    """Two OVQ states (or loop-oracle states) equal bit for bit: every array, the size and the tokens seen."""
    assert np.array_equal(a.keys, b.keys)
    assert np.array_equal(a.values, b.values)
    assert np.array_equal(a.counts, b.counts)
    assert (a.size, a.tokens_seen) == (b.size, b.tokens_seen)
    assert a.keys.dtype == b.keys.dtype


def assignment_plan(cache):
    """The row every key of an OVQ forward went to, in token order (the assignments a backward holds fixed)."""
    return np.concatenate([r.rows for r in cache.records])


def spread_means_example(n=40, d=3, seed=0):
    """Two means near +1e4 (1e-3 apart) and one at -1e4, variances 1e-8, points near the close pair.

    The example of ``docs/derivations/gmm_posteriors.md`` where the expanded
    quadratic form, centred or not, loses every digit.  Returns
    ``(x, means, variances, weights)``.
    """
    rng = np.random.default_rng(seed)
    means = np.array([[1e4] * d, [1e4 + 1e-3] * d, [-1e4] * d])
    variances = np.full((3, d), 1e-8)
    weights = np.full(3, 1 / 3)
    x = means[:2].mean(axis=0) + 3e-4 * rng.normal(size=(n, d))
    return x, means, variances, weights


def exact_log_joint(x, means, variances, weights):
    """``(l, q)``: ``l_ik = log pi_k + log N(x_i | mu_k, sigma_k^2)`` and the quadratic form, from the differences, in long double."""
    X, M, S = (np.asarray(a, dtype=np.longdouble) for a in (x, means, variances))
    quad = np.sum((X[:, None, :] - M[None]) ** 2 / S[None], axis=2)
    d = X.shape[1]
    with np.errstate(divide="ignore"):
        log_w = np.log(np.asarray(weights, dtype=np.longdouble))
    return log_w - 0.5 * (d * np.log(2 * np.pi, dtype=np.longdouble) + np.sum(np.log(S), axis=1)) - 0.5 * quad, quad


def exact_responsibilities(x, means, variances, weights):
    """The responsibilities from :func:`exact_log_joint`, rounded to float64 at the end."""
    logits, _ = exact_log_joint(x, means, variances, weights)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float64)


def row_relative_error(resp, exact) -> float:
    """``max_i max_k |resp_ik - exact_ik| / max_k exact_ik``: the error of the worst row, relative to its largest entry."""
    return float(np.max(np.max(np.abs(resp - exact), axis=1) / np.max(np.abs(exact), axis=1)))
