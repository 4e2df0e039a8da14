"""The cancellation screen of refimpl.tuned decided at each of its thresholds: just below, at, and just above.

``suspect_rows`` clears a row when its size bound ``s`` is at most the screen
limit ``EXACT_LOGIT_TOL u / kappa`` or at most ``CANCELLATION_RATIO`` times its
smallest distance; ``spoiled_logits`` recomputes an entry whose error bound
``kappa M`` exceeds ``EXACT_LOGIT_TOL u``, whose terms exceed the form
``CANCELLATION_RATIO`` times, and which may lie within ``window`` of the row
maximum.  Each comparison is tested one rounding unit on either side, so that
a changed threshold or a ``<`` for a ``<=`` fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import tuned
from refimpl.testing import exact_responsibilities, row_relative_error

DTYPES = [np.float64, np.float32]


def up(x):
    return np.nextafter(x, np.inf)


def down(x):
    return np.nextafter(x, -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_constants_are_the_documented_ones(dtype):
    u = np.finfo(dtype).eps
    assert tuned.EXACT_LOGIT_TOL == 2048 and tuned.CANCELLATION_RATIO == 16
    kappa = tuned.logit_error_scale(9, dtype)
    assert kappa.dtype == dtype and kappa == dtype(0.5 * (4 + 3) * u)
    assert tuned.posterior_window(7, dtype) == pytest.approx(np.log(7 / (2048 * u)), rel=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_cleared_up_to_the_screen_limit_and_not_beyond(dtype):
    limit = dtype(1000.0)
    min_quad = np.zeros(3, dtype)  # the ratio test never clears these rows: only the limit does
    s_row = np.array([down(limit), limit, up(limit)], dtype)
    np.testing.assert_array_equal(tuned.suspect_rows(np, s_row, min_quad, limit), [False, False, True])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_cleared_up_to_sixteen_times_its_distance_and_not_beyond(dtype):
    limit = dtype(1.0)  # far below s: only the ratio can clear these rows
    min_quad = np.full(3, 10.0, dtype)
    at = dtype(tuned.CANCELLATION_RATIO) * min_quad[0]
    s_row = np.array([down(at), at, up(at)], dtype)
    np.testing.assert_array_equal(tuned.suspect_rows(np, s_row, min_quad, limit), [False, False, True])
    # NaN is never cleared
    assert tuned.suspect_rows(np, np.array([np.nan], dtype), np.ones(1, dtype), limit)[0]


def _entries(dtype, sizes, halves, logits=None):
    """One row of entries with given sizes M (through sq_x, with zeta = 0) and forms -q/2."""
    sizes, halves = np.asarray(sizes, dtype), np.asarray(halves, dtype)
    logits = halves.copy() if logits is None else np.asarray(logits, dtype)
    return logits[None], halves[None], sizes[None], np.zeros(sizes.size, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_entry_is_spoiled_only_when_its_error_bound_exceeds_the_tolerance(dtype):
    kappa = tuned.logit_error_scale(4, dtype)
    tol = dtype(tuned.EXACT_LOGIT_TOL * np.finfo(dtype).eps)
    at = tol / kappa  # the size whose error bound kappa M is the tolerance
    sizes = [down(at), at, up(up(at))]
    # q tiny against M (cancellation real), all at the row maximum (near): only the tolerance decides
    logits, half, sq_x, sq_mu = _entries(dtype, sizes, [-1e-3] * 3)
    spoiled = tuned.spoiled_logits(np, logits, half, sq_x, sq_mu, kappa, np.inf)[0]
    errs = kappa * np.asarray(sizes, dtype)
    np.testing.assert_array_equal(spoiled, errs > tol)
    assert not spoiled[0] and spoiled[2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_entry_is_spoiled_only_when_its_terms_exceed_sixteen_times_its_form(dtype):
    kappa = tuned.logit_error_scale(4, dtype)
    M = dtype(1e10)  # error bound far above the tolerance: only the ratio decides
    q_at = M / dtype(tuned.CANCELLATION_RATIO)
    qs = [up(q_at), q_at, down(q_at)]  # M > 16 q only for the last
    logits, half, sq_x, sq_mu = _entries(dtype, [M] * 3, [-0.5 * q for q in qs], logits=[0.0] * 3)
    spoiled = tuned.spoiled_logits(np, logits, half, sq_x, sq_mu, kappa, np.inf)[0]
    np.testing.assert_array_equal(spoiled, [False, False, True])


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_entry_is_recomputed_only_within_the_window_of_the_row_maximum(dtype):
    kappa = tuned.logit_error_scale(4, dtype)
    M = dtype(1e6)  # spoiled: error bound kappa M above the tolerance, q tiny
    err = kappa * M
    window = dtype(30.0)
    # entry 0 sets the floor max(l - err) = -err; an entry is near when l + err >= floor - window
    edge = -err - window - err
    logits = [0.0, up(edge), edge, down(down(edge))]
    logits, half, sq_x, sq_mu = _entries(dtype, [M] * 4, [-1e-3] * 4, logits=logits)
    spoiled = tuned.spoiled_logits(np, logits, half, sq_x, sq_mu, kappa, window)[0]
    near = logits[0] + err >= (logits[0, 0] - err) - window
    np.testing.assert_array_equal(spoiled, near)
    assert spoiled[0] and spoiled[1] and not spoiled[3]


def test_an_entry_the_bound_cannot_vouch_for_is_recomputed():
    kappa = tuned.logit_error_scale(4, np.float64)
    logits, half, sq_x, sq_mu = _entries(np.float64, [1.0, np.inf, 1.0], [-1.0, -1.0, -1.0], logits=[0.0, 0.0, np.nan])
    np.testing.assert_array_equal(tuned.spoiled_logits(np, logits, half, sq_x, sq_mu, kappa, np.inf)[0], [False, True, True])


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_screen_repairs_what_it_must_on_either_side_of_the_tolerance(factor):
    """Means spread so that the expansion's error bound at the close pair is half or twice the tolerance: exact either way."""
    rng = np.random.default_rng(4)
    d = 2
    kappa = float(tuned.logit_error_scale(d, np.float64))
    tol = tuned.EXACT_LOGIT_TOL * np.finfo(np.float64).eps
    # a close pair at distance 2 of each other (sigma = 1) and a far component: M ~ (2 r)^2 at the pair, r from the centre
    r = np.sqrt(factor * tol / kappa) / 2
    means = np.array([[r, 0.0], [r + 2.0, 0.0], [-2 * r, 0.0]])
    x = means[0] + np.array([1.0, 0.0]) * rng.uniform(0, 2, size=(60, 1)) + 0.1 * rng.normal(size=(60, d))
    variances, weights = np.ones((3, d)), np.full(3, 1 / 3)
    exact = exact_responsibilities(x, means, variances, weights)
    assert row_relative_error(tuned.responsibilities(x, means, variances, weights), exact) < 1e-12


def test_rows_just_above_the_screen_limit_are_screened_entry_by_entry():
    """A block whose largest size bound is a few times the screen limit: its spoiled entries come from the differences, bit for bit."""
    rng = np.random.default_rng(5)
    d = 2
    kappa = float(tuned.logit_error_scale(d, np.float64))
    limit = tuned.EXACT_LOGIT_TOL * np.finfo(np.float64).eps / kappa
    r = np.sqrt(2 * limit) / 2  # M ~ (2 r)^2 = 2 * limit at the close pair
    means = np.array([[r, 0.0], [r + 2.0, 0.0], [-2 * r, 0.0]])
    x = means[0] + np.array([1.0, 0.0]) * rng.uniform(0, 2, size=(60, 1)) + 0.1 * rng.normal(size=(60, d))
    variances, log_w = np.ones((3, d)), np.log(np.full(3, 1 / 3))
    plain, _ = tuned.log_joint(x, means, variances, log_w, refine=False)
    refined, _ = tuned.log_joint(x, means, variances, log_w)
    # which entries the screen must redo, from the expansion's own numbers
    centre = means.mean(axis=0)
    xc2 = (x - centre) ** 2
    mc = means - centre
    sq_mu = np.sum(mc * mc / variances, axis=1)
    assert limit < tuned.row_size_bound(np, xc2, (1 / variances).max(axis=0), np.sqrt(sq_mu.max())).max() < 8 * limit
    log_norm = log_w - 0.5 * (d * np.log(2 * np.pi) + np.sum(np.log(variances), axis=1))
    spoiled = tuned.spoiled_logits(np, plain, plain - log_norm, xc2 @ (1 / variances).T, sq_mu, kappa, np.inf)
    rows, cols = np.nonzero(spoiled)
    assert rows.size > 0
    exact = log_norm[cols] - 0.5 * tuned.exact_quadratic_form(np, x, means, 1 / variances, rows, cols)
    np.testing.assert_array_equal(refined[rows, cols], exact)
    assert np.any(plain[rows, cols] != exact)  # the recomputation is visible: the expansion differs there
    np.testing.assert_array_equal(refined[~spoiled], plain[~spoiled])
