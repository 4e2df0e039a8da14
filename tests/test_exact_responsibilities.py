"""Responsibilities right to rounding for every input, however far apart the means are.

``refimpl.gmm`` computes the quadratic form from the differences ``x - mu``,
which is exact by construction.  ``refimpl.tuned`` expands the square, which
cancels when the means are spread apart, even centred on the mean of the
means; its ``log_joint`` detects the entries that cancellation may have
spoiled and recomputes them from the differences.  Both are held to the same
targets.  The reference here is the definition itself, evaluated with the
differences ``x - mu`` in extended precision (``np.longdouble``).
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gmm, tuned
from refimpl.testing import exact_log_joint, exact_responsibilities, row_relative_error, sklearn_gmm, spread_means_example

# relative error per row, max_k |gamma - gamma*| / max_k gamma*: the target of the refinement
TARGET = 1e-12
# the definition and the screened expansion: the same functions, the same targets
MODULES = pytest.mark.parametrize("module", [gmm, tuned], ids=["gmm", "tuned"])


def sklearn_responsibilities(x, means, variances, weights):
    with np.errstate(all="ignore"):
        return sklearn_gmm(means, variances, weights).predict_proba(x)


def spread_problem(seed):
    """Groups of overlapping components (means a few sigma apart), the groups up to 1e8 sigma apart,
    far from the origin; points within 3 sigma of a mean, so that several responsibilities matter."""
    rng = np.random.default_rng(seed)
    d = int(rng.choice([1, 2, 5, 16, 32]))
    groups, per_group = int(rng.integers(2, 5)), int(rng.integers(2, 4))
    K = groups * per_group
    sigma = 10 ** rng.uniform(-4, 0, size=(K, d))
    spread = 10 ** rng.uniform(0, 8)
    centres = rng.normal(size=d) * 10 ** rng.uniform(0, 6) + rng.normal(size=(groups, d)) * spread * sigma.max()
    means = np.repeat(centres, per_group, axis=0) + 2 * sigma * rng.normal(size=(K, d))
    k = rng.integers(0, K, size=60)
    x = means[k] + sigma[k] * rng.normal(size=(60, d)) * rng.uniform(0, 3, size=(60, 1))
    return x, means, sigma**2, rng.dirichlet(np.ones(K))


@MODULES
def test_counterexample_is_exact_where_the_expansion_and_scikit_learn_are_not(module):
    x, means, variances, weights = spread_means_example()
    exact = exact_responsibilities(x, means, variances, weights)
    assert row_relative_error(module.responsibilities(x, means, variances, weights), exact) < TARGET
    # the plain centred expansion, and scikit-learn's uncentred one, lose the answer entirely
    logits, _ = tuned.log_joint(x, means, variances, np.log(weights), refine=False)
    expansion = np.exp(logits - logits.max(axis=1, keepdims=True))
    expansion /= expansion.sum(axis=1, keepdims=True)
    assert row_relative_error(expansion, exact) > 0.05
    assert row_relative_error(sklearn_responsibilities(x, means, variances, weights), exact) > 0.05


@MODULES
@pytest.mark.parametrize("seed", range(40))
def test_random_spreads_up_to_1e8_sigma_are_exact(module, seed):
    x, means, variances, weights = spread_problem(seed)
    exact = exact_responsibilities(x, means, variances, weights)
    assert row_relative_error(module.responsibilities(x, means, variances, weights), exact) < TARGET
    np.testing.assert_allclose(module.log_responsibilities(x, means, variances, weights).max(axis=1), np.log(exact.max(axis=1)), rtol=0, atol=TARGET)


def test_spreads_that_defeat_the_expansion_are_among_the_random_ones():
    """The random family is not too easy: the plain expansion fails on many of its problems."""
    failures = 0
    for seed in range(40):
        x, means, variances, weights = spread_problem(seed)
        logits, _ = tuned.log_joint(x, means, variances, np.log(weights), refine=False)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        failures += row_relative_error(e / e.sum(axis=1, keepdims=True), exact_responsibilities(x, means, variances, weights)) > 1e-6
    assert failures >= 10


@pytest.mark.parametrize("seed", range(20))
def test_the_rounding_model_bounds_the_expansion_entry_by_entry(seed):
    """|q_expanded - q| <= (4 + sqrt(d)) u (sqrt(a) + sqrt(c))^2: the bound the refinement trusts."""
    x, means, variances, _ = spread_problem(seed)
    d = x.shape[1]
    u = np.finfo(np.float64).eps
    centre = means.mean(axis=0)
    xc, mc, prec = x - centre, means - centre, 1 / variances
    a = (xc * xc) @ prec.T
    c = np.sum(mc * mc * prec, axis=1)
    logits, _ = tuned.log_joint(x, means, variances, np.zeros(len(means)), refine=False)
    q_expanded = -2 * (logits + 0.5 * (d * np.log(2 * np.pi) + np.log(variances).sum(axis=1)))
    _, q = exact_log_joint(x, means, variances, np.ones(len(means)))
    err = np.abs(q_expanded - q.astype(np.float64))
    bound = (4 + np.sqrt(d)) * u * (np.sqrt(a) + np.sqrt(c)) ** 2
    # the log-normaliser adds rounding of its own size to the recovered q: 2 u |l| per entry
    slack = 4 * u * (np.abs(logits) + 0.5 * d * np.log(2 * np.pi) + np.abs(np.log(variances).sum(axis=1)))
    assert np.all(err <= bound + slack)


def test_log_densities_are_exact_for_every_entry_not_only_near_the_maximum():
    x, means, variances, _ = spread_means_example()
    logits, _ = exact_log_joint(x, means, variances, np.ones(3))
    # |l| ~ 1e16 for the far component: compare relative to each entry's own size, near ones absolutely
    np.testing.assert_allclose(gmm.log_gaussian_diag(x, means, variances), logits.astype(np.float64), rtol=1e-13, atol=1e-9)
    # the expansion with the window of a log-density (inf): every entry recomputed where it could be off
    expanded, _ = tuned.log_joint(x, means, variances, np.zeros(3))
    np.testing.assert_allclose(expanded, logits.astype(np.float64), rtol=1e-13, atol=1e-9)


@MODULES
def test_log_likelihood_is_exact_on_the_counterexample(module):
    x, means, variances, weights = spread_means_example()
    logits, _ = exact_log_joint(x, means, variances, weights)
    m = logits.max(axis=1)
    exact = (m + np.log(np.exp(logits - m[:, None]).sum(axis=1))).astype(np.float64)
    np.testing.assert_allclose(module.log_likelihood(x, means, variances, weights), exact, rtol=0, atol=1e-9)


@MODULES
def test_far_points_whose_expansion_overflows_are_recomputed(module):
    """x^2 / sigma^2 overflows in the expansion, the difference x - mu does not."""
    x = np.array([[1e200, 0.0]])
    means = np.array([[1e200, 0.0], [-1e200, 0.0]])
    variances = np.ones((2, 2))
    with np.errstate(over="ignore"):
        resp = module.responsibilities(x, means, variances, np.array([0.5, 0.5]))
    np.testing.assert_array_equal(resp, [[1.0, 0.0]])


@MODULES
def test_float32_counterexample_is_exact_to_float32_rounding(module):
    x, means, variances, weights = spread_means_example(d=2)
    x, means, variances, weights = (a.astype(np.float32) for a in (x, means, variances, weights))
    exact = exact_responsibilities(x, means, variances, weights)
    resp = module.responsibilities(x, means, variances, weights)
    assert resp.dtype == np.float32
    # float32 inputs are the problem; the answer is right to float32 rounding of the logits (2048 u = 2.4e-4)
    assert row_relative_error(resp, exact) < 1e-3


def test_ordinary_inputs_need_no_recomputation():
    """The O(N d) screen clears well-scaled rows: the refined logits equal the plain expansion bit for bit."""
    rng = np.random.default_rng(5)
    x, means, variances = rng.normal(size=(500, 32)), rng.normal(size=(16, 32)), rng.uniform(0.5, 2.0, size=(16, 32))
    log_w = np.full(16, -np.log(16))
    refined, _ = tuned.log_joint(x, means, variances, log_w)
    plain, _ = tuned.log_joint(x, means, variances, log_w, refine=False)
    np.testing.assert_array_equal(refined, plain)


@pytest.mark.parametrize("seed", range(10))
def test_logits_near_the_maximum_are_within_the_tolerance_where_cancellation_is_mild(seed):
    """Spreads where the expansion's error is a few times EXACT_LOGIT_TOL u: no such error may survive."""
    rng = np.random.default_rng(100 + seed)
    d, K, n = 8, 6, 400
    means = rng.normal(size=(K, d)) * 40.0  # terms of size (40/sigma)^2 d ~ 1e4: errors of a few 1e-12
    variances = np.ones((K, d))
    x = means[rng.integers(0, K, size=n)] + rng.normal(size=(n, d))
    log_w = np.full(K, -np.log(K))
    logits, _ = tuned.log_joint(x, means, variances, log_w)
    exact, _ = exact_log_joint(x, means, variances, np.exp(log_w))
    exact = exact.astype(np.float64)
    near = exact >= exact.max(axis=1, keepdims=True) - 30
    tol = 2048 * np.finfo(np.float64).eps  # the documented EXACT_LOGIT_TOL, 4.5e-13
    # within the tolerance, plus the rounding of the definition itself ((4 + sqrt(d)) u q / 2)
    q = -2 * (exact - exact.max(axis=1, keepdims=True)) + 2 * d
    assert np.all(np.abs(logits - exact)[near] <= tol + (4 + np.sqrt(d)) * np.finfo(np.float64).eps * q[near])
