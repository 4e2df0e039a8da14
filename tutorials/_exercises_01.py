"""Checks of lesson 1's exercises (GMM posteriors, computed to the last digit).

Each check builds its own seeded inputs at small sizes, calls the answer and
compares with an independent result: SciPy's ``logsumexp``, and the
definition of the posterior evaluated with the differences ``x - mu`` formed
first, in ``np.longdouble`` (80-bit extended precision on x86-64), as the
lesson's reference of section 3 does.  ``refimpl.gmm`` is used only to show
that a case is solvable and to give the centred expansion whose failure
exercise 1.3 asks for.
"""

from __future__ import annotations

import numpy as np
from scipy import special

import _hints
from _course import exercise
from refimpl import gmm, tuned

U = np.finfo(np.float64).eps  # machine epsilon u = 2^-52
# every implementation of the responsibilities in the project (public and private functions alike), and scikit-learn's
RESPONSIBILITIES = ("refimpl.gmm", "refimpl.tuned", "cpu.gmm", "gpu.numba_cuda.gmm", "gpu.cupy_kernels.gmm", "sklearn.mixture")


def _shape(a, expected, what):
    a = np.asarray(a)
    assert a.shape == expected, _hints.explain(f"{what}: expected shape {expected}, got {a.shape}",
                                               hints=[_hints.shape(a.shape, expected)])
    return a


def _whole_array_maximum(row_max, bad_rows):
    """A hint when the rows that failed are exactly those far (> 700) below the largest entry of the whole array."""
    far = np.flatnonzero(row_max < np.max(row_max) - 700)
    if len(bad_rows) and set(np.asarray(bad_rows).tolist()) <= set(far.tolist()):
        return ("one maximum for the whole array (or none) cannot serve these rows: the rows that fail are those whose own "
                "maximum lies more than 700 below the array's largest entry, where exp underflows; shift each row by its own "
                "maximum")
    return None


def _reference(x, means, variances, weights):
    """(responsibilities rounded to float64, log-joint) from the definition in np.longdouble, differences first."""
    xl, ml, vl = (np.asarray(a, dtype=np.longdouble) for a in (x, means, variances))
    diff = xl[:, None, :] - ml[None, :, :]
    q = np.sum(diff * diff / vl, axis=2)
    log_joint = np.log(np.asarray(weights, dtype=np.longdouble)) - 0.5 * np.sum(np.log(2 * np.pi * vl), axis=1) - 0.5 * q
    e = np.exp(log_joint - log_joint.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float64), log_joint


def _row_error(resp, ref):
    """Relative error of each row: max_k |resp_ik - ref_ik| / max_k ref_ik."""
    return np.max(np.abs(resp - ref), axis=1) / np.max(ref, axis=1)


def _direct_log_joint(x, means, variances, weights):
    """The log-joint in float64 with the differences formed first (the definition, no expansion)."""
    diff = x[:, None, :] - means[None, :, :]
    return np.log(weights) - 0.5 * np.sum(np.log(2 * np.pi * variances) + diff**2 / variances, axis=2)


def _centred_expansion(x, means, variances, weights):
    """Softmax of the centred expansion's logits, without refimpl's recomputation."""
    logits, _ = tuned.log_joint(x, means, variances, np.log(weights), refine=False)
    return gmm.softmax(logits, axis=1), logits


def counterexample(n_points=200, seed=6):
    """The lesson's counterexample: a close pair near 1e4 * 1, ten sd apart, a third mean at -1e4 * 1; points along the pair."""
    one = np.ones(3)
    means = np.array([1e4 * one, 1e4 * one + 1e-3 * np.array([1.0, -1.0, 0.0]) / np.sqrt(2), -1e4 * one])
    variances = np.full((3, 3), 1e-8)
    weights = np.full(3, 1 / 3)
    rng = np.random.default_rng(seed)
    tau = rng.uniform(-0.25, 1.25, size=(n_points, 1))
    x = means[0] + tau * (means[1] - means[0]) + 1e-4 * rng.normal(size=(n_points, 3))
    return x, means, variances, weights


def spread_mixture(rng, spread, n_points, n_pairs=3, d=3):
    """Pairs of components ~3 sd apart, pair centres ~`spread` sd apart, points around the pairs (lesson, section 3)."""
    centres = spread * rng.normal(size=(n_pairs, d))
    direction = rng.normal(size=(n_pairs, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    means = np.concatenate([centres - 1.5 * direction, centres + 1.5 * direction])
    variances = rng.uniform(0.5, 2.0, size=(2 * n_pairs, d))
    weights = rng.dirichlet(np.ones(2 * n_pairs))
    x = centres[rng.integers(0, n_pairs, n_points)] + rng.normal(size=(n_points, d))
    return x, means, variances, weights


def crowded_counterexample(n_points=200, seed=16):
    """The counterexample plus four components about 100 sd from the close pair, on its side of the centre.

    Their logits are spoiled by cancellation too (their terms are as large as
    the pair's), but they lie thousands below the row maximum: a posterior
    never needs them.
    """
    x, means, variances, weights = counterexample(n_points, seed)
    rng = np.random.default_rng(seed)
    extra = means[0] + 1e-2 * rng.normal(size=(4, 3))  # ~100 sd from the pair
    means = np.vstack([means, extra])
    variances = np.full(means.shape, 1e-8)
    weights = np.full(len(means), 1 / len(means))
    return x, means, variances, weights


def _why_centring_works(x, means, variances, weights):
    """What makes the centred expansion right on a proposed case: a one-hot posterior, or means close together."""
    lj = np.sort(_direct_log_joint(x, means, variances, weights), axis=1)
    if np.min(lj[:, -1] - lj[:, -2]) > 50:
        return ("points far from every component but one: the two largest log-joints of every row differ by more than "
                "50, a one-hot posterior that the expansion's errors cannot move")
    spread = float(np.max(np.linalg.norm((means - means.mean(axis=0)) / np.sqrt(variances), axis=1)))
    return (f"means close together: at most {spread:.3g} sd from the mean of the means (spread only that far), where "
            "centring removes the cancellation; spread them much further")


def well_scaled(rng, n_points=200, K=5, d=4):
    means = rng.normal(size=(K, d)) * 1.5
    variances = rng.uniform(0.3, 2.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    x = rng.normal(size=(n_points, d)) * 1.5
    return x, means, variances, weights


@exercise("1.1", "Log-sum-exp with the per-row maximum", 1, points=2, partial=True,
          refuse=("scipy.special.logsumexp", "refimpl.gmm.logsumexp", "refimpl.numerics.logsumexp",
                  "scipy.special.log_softmax", "refimpl.numerics", "refimpl.tuned"))
def check_logsumexp_rows(logsumexp_rows):
    """``logsumexp_rows(a) -> (N,)``: ``log sum_k exp(a_ik)`` of each row of ``a`` (N, K), for rows of any scale.

    Rows reach ``+-1e300`` (``exp`` alone overflows or underflows), rows of one
    array differ by hundreds of orders of magnitude (one shift for the whole
    array is not enough), and an entry may be ``-inf`` (a component of weight
    0).  The result must be finite and agree with SciPy's ``logsumexp``.
    """
    rng = np.random.default_rng(11)
    a = np.array([[1000.0, 999.0, 998.0, 997.0], [-1000.0, -1001.0, -1002.0, -1003.0],
                  [0.5, -0.5, 0.0, 1.0], [3.0, -np.inf, 2.0, 1.0]])
    scales = 10.0 ** rng.uniform(-3, 300, size=(60, 1))
    a = np.vstack([a, rng.normal(size=(60, 4)) * scales])
    with np.errstate(all="ignore"):  # a wrong answer's overflow is reported below, not as a warning
        got = logsumexp_rows(a.copy())
    got = _shape(got, (len(a),), f"logsumexp_rows of a {a.shape[0]} x {a.shape[1]} array")
    ref = special.logsumexp(a, axis=1)
    bad = ~np.isfinite(got)
    assert not bad.any(), _hints.explain(
        f"rows {np.flatnonzero(bad)[:5].tolist()} give {got[bad][:3]}: exp overflowed or underflowed "
        "(subtract each row's own maximum before exponentiating, and add it back)",
        got, ref, hints=[_whole_array_maximum(np.max(a, axis=1), np.flatnonzero(bad))])
    # after the shift the sum has K = 4 terms in [0, 1], the largest exactly 1: the log carries ~K u relative
    # to max(1, |result|); 8 u allows twice that
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    i = int(np.argmax(err))
    assert err[i] <= 8 * U, _hints.explain(
        f"row {i} = {a[i]}: you give {float(got[i])!r}, SciPy {float(ref[i])!r} (relative error {err[i]:.1e}, allowed 8 u = {8 * U:.1e})",
        got, ref, known={"the shift not added back: you give the log-sum-exp minus each row's maximum": ref - np.max(a, axis=1)})


@exercise("1.2", "Responsibilities that never overflow", 2, points=4, partial=True,
          refuse=RESPONSIBILITIES + ("scipy.special.logsumexp", "scipy.special.softmax", "refimpl.numerics"))
def check_stable_responsibilities(stable_responsibilities):
    """``stable_responsibilities(x, means, variances, weights) -> (N, K)``: the posterior, finite for every input.

    ``x`` (N, d), ``means`` and ``variances`` (K, d), ``weights`` (K,).
    Checked on a well-scaled mixture with unequal variances and weights, on
    points 40 standard deviations from every component (all densities
    underflow) and on ``sigma^2 = 1e-8`` in ``d = 100`` (all densities
    overflow), in one array with ordinary points, against the definition in
    extended precision.
    """
    rng = np.random.default_rng(12)
    cases = {"well-scaled mixture, unequal variances and weights": well_scaled(rng)}
    # points 40 sd from both components, and ordinary points, in one array
    far_x = np.array([[40.0], [-40.0], [0.5], [120.0]])
    cases["points 40 sd from every component, with ordinary points"] = (
        far_x, np.array([[0.0], [80.0]]), np.array([[1.0], [2.0]]), np.array([0.3, 0.7]))
    mu_tiny = 1e-4 * rng.normal(size=(2, 100))
    x_tiny = mu_tiny.mean(axis=0) + 1e-4 * rng.normal(size=(3, 100))
    cases["sigma^2 = 1e-8 in d = 100"] = (x_tiny, mu_tiny, np.full((2, 100), 1e-8), np.array([0.5, 0.5]))
    for name, (x, m, v, w) in cases.items():
        with np.errstate(all="ignore"):
            got = stable_responsibilities(x.copy(), m.copy(), v.copy(), w.copy())
        got = _shape(got, (len(x), len(w)), f"{name}: responsibilities of {len(x)} points, {len(w)} components")
        ref, log_joint = _reference(x, m, v, w)
        bad_rows = np.flatnonzero(~np.all(np.isfinite(got), axis=1))
        assert np.all(np.isfinite(got)), _hints.explain(
            f"{name}: rows {bad_rows.tolist()} are not finite "
            "(densities that under- or overflow: work with log-densities and the per-row maximum)",
            got, ref, hints=[_whole_array_maximum(np.max(log_joint, axis=1).astype(np.float64), bad_rows)])
        # a logit of size |l| is rounded by a few u |l| in float64; a responsibility moves by at most twice the
        # logit error: 16 u max|l| is the lesson's tolerance of section 2 (and at least 16 u)
        tol = 16 * U * max(1.0, float(np.max(np.abs(log_joint))))
        err = np.max(np.abs(got - ref), axis=1)
        i = int(np.argmax(err))
        direct = _direct_log_joint(x, m, v, w)
        assert err[i] <= tol, _hints.explain(
            f"{name}: row {i} is {np.round(got[i], 6)}, the definition gives {np.round(ref[i], 6)} "
            f"(max error {err[i]:.1e}, allowed {tol:.1e}; did you keep log pi_k and -1/2 sum_j log(2 pi sigma_kj^2)?)",
            got, ref, rows=1, known={
                "the log-determinant term -1/2 sum_j log(2 pi sigma_kj^2) dropped":
                    gmm.softmax(direct + 0.5 * np.sum(np.log(2 * np.pi * v), axis=1), axis=1),
                "the weights log pi_k dropped from the log-joint": gmm.softmax(direct - np.log(w), axis=1),
            })


@exercise("1.3", "Build the spread-means failure case", 2, points=4, partial=False)
def check_spread_failure_case(case):
    """``spread_failure_case = (x, means, variances, weights)``: a mixture where centring alone fails.

    Shapes ``(N, d)``, ``(K, d)``, ``(K, d)``, ``(K,)`` with ``N <= 2000``,
    ``2 <= K <= 20``, ``d <= 10``; finite, variances positive, weights positive
    summing to one.  Required:

    * the posterior is well posed: the definition evaluated in float64 with
      the differences formed first, and ``gmm.responsibilities``, agree with
      the extended-precision reference to ``1e-12`` in every row;
    * the centred expansion (``tuned.log_joint(..., refine=False)``, then a
      softmax) is wrong by more than ``0.1`` of the largest entry in some row.
    """
    assert isinstance(case, tuple) and len(case) == 4, (
        f"the answer is a tuple (x, means, variances, weights), got {type(case).__name__}"
        + (f" of length {len(case)}" if isinstance(case, tuple) else "")
    )
    x, means, variances, weights = (np.asarray(a, dtype=np.float64) for a in case)
    assert x.ndim == 2 and means.ndim == 2, f"x and means are 2-D, got shapes {x.shape} and {means.shape}"
    N, d = x.shape
    K = means.shape[0]
    assert 1 <= N <= 2000 and 1 <= d <= 10 and 2 <= K <= 20, f"sizes N = {N}, d = {d}, K = {K}: keep N <= 2000, d <= 10, 2 <= K <= 20"
    _shape(means, (K, d), "means")
    _shape(variances, (K, d), "variances")
    _shape(weights, (K,), "weights")
    assert all(np.all(np.isfinite(a)) for a in (x, means, variances, weights)), "every entry must be finite"
    assert np.all(variances > 0) and np.all(weights > 0), "variances and weights must be positive"
    assert abs(weights.sum() - 1) <= 1e-12, f"the weights sum to {weights.sum()!r}, not 1"

    ref, _ = _reference(x, means, variances, weights)
    err_def = _row_error(gmm.softmax(_direct_log_joint(x, means, variances, weights), axis=1), ref)
    err_refimpl = _row_error(gmm.responsibilities(x, means, variances, weights), ref)
    # 1e-12 per row: the lesson's tolerance (section 3), which the definition meets wherever its distances q near the
    # row maximum stay below ~100; a case that misses it is ill posed, not a failure of the expansion
    assert err_def.max() <= 1e-12 and err_refimpl.max() <= 1e-12, (
        f"the case is not well posed: the definition in float64 is off by {err_def.max():.1e} and refimpl by "
        f"{err_refimpl.max():.1e} per row (allowed 1e-12); keep the points near the components that share them"
    )
    centred, _ = _centred_expansion(x, means, variances, weights)
    err_centred = _row_error(centred, ref)
    assert err_centred.max() > 0.1, _hints.explain(
        f"the centred expansion is right here: worst row error {err_centred.max():.1e}, needed > 0.1. Centring removes "
        "the cancellation when the means sit close together; spread them (a close pair far from the mean of the means)",
        hints=[_why_centring_works(x, means, variances, weights)])


def _flag_pattern(mask):
    """A hint when the mask flags nothing, or everything."""
    if not mask.any():
        return "nothing flagged: you recompute nothing in this case, and cancellation spoils entries near the row maximum"
    if mask.all():
        return "everything flagged: every entry recomputed, those that carry no weight and those that are exact too"
    return None


@exercise("1.4", "Fix it: choose the entries to recompute", 3, points=6, partial=True,
          refuse=("refimpl.tuned", "cpu.gmm", "gpu.numba_cuda.gmm", "gpu.cupy_kernels.gmm"))
def check_entries_to_recompute(entries_to_recompute):
    """``entries_to_recompute(x, means, variances, weights) -> (N, K) bool``: the logits to recompute from ``x - mu``.

    The check takes the centred expansion's logits, replaces the flagged
    entries by the definition evaluated from the differences in float64, and
    takes the softmax.  Required:

    * accurate: every row within ``1e-12`` of the extended-precision
      reference, on the lesson's counterexample, on mixtures whose means are
      spread up to ``1e8`` standard deviations, and on the counterexample
      crowded with four more components ~100 sd from the close pair;
    * frugal: nothing flagged on a well-scaled mixture (no entry's error bound
      exceeds ``2048 u``), and on the crowded counterexample no flagged entry
      more than 50 below its row's maximum (such entries carry no weight).
    """
    rng = np.random.default_rng(14)
    accurate = {"the lesson's counterexample": counterexample()}
    for S in (1e4, 1e6, 1e8):
        accurate[f"pairs spread {S:.0e} sd apart"] = spread_mixture(rng, S, 200)
    accurate["the crowded counterexample"] = crowded_counterexample()
    ordinary = well_scaled(rng)

    def flagged(x, m, v, w, name):
        mask = entries_to_recompute(x.copy(), m.copy(), v.copy(), w.copy())
        mask = _shape(mask, (len(x), len(w)), f"{name}: the mask of {len(x)} points, {len(w)} components")
        assert mask.dtype == bool, f"{name}: the mask must be boolean, got dtype {mask.dtype}"
        return mask

    for name, (x, m, v, w) in accurate.items():
        mask = flagged(x, m, v, w, name)
        _, logits = _centred_expansion(x, m, v, w)
        logits = np.where(mask, _direct_log_joint(x, m, v, w), logits)
        ref, log_joint = _reference(x, m, v, w)
        err = _row_error(gmm.softmax(logits, axis=1), ref)
        i = int(np.argmax(err))
        # 1e-12 per row: the lesson's tolerance for refimpl (section 3, the fix; docs/floating_point.md, Lesson 1)
        assert err[i] <= 1e-12, _hints.explain(
            f"{name}: row {i} is off by {err[i]:.1e} relative (allowed 1e-12); you flag components "
            f"{np.flatnonzero(mask[i]).tolist()} of that row, the reference's largest are "
            f"{np.argsort(-ref[i])[:2].tolist()}: an entry spoiled by cancellation near the row maximum was left",
            hints=[_flag_pattern(mask), None if set(np.argsort(-ref[i])[:2].tolist()) & set(np.flatnonzero(mask[i]).tolist())
                   else f"the entries near the row maximum not flagged: components {np.argsort(-ref[i])[:2].tolist()} "
                        f"of row {i} carry the weight and are left to the expansion"])
        if name == "the crowded counterexample":
            gap = (log_joint.max(axis=1, keepdims=True) - log_joint).astype(np.float64)
            wasted = mask & (gap > 50)
            assert not wasted.any(), _hints.explain(
                f"{name}: you flag {int(wasted.sum())} entries more than 50 below their row maximum (e.g. row "
                f"{np.argwhere(wasted)[0][0]}, component {np.argwhere(wasted)[0][1]}, {gap[tuple(np.argwhere(wasted)[0])]:.0f} "
                "below): they carry no weight. Keep only entries within the window log(K / (2048 u)) of the row maximum",
                hints=[_flag_pattern(mask) or "no window around the row maximum: entries far below it are flagged"])
    mask = flagged(*ordinary, "a well-scaled mixture")
    assert not mask.any(), _hints.explain(
        f"a well-scaled mixture: you flag {int(mask.sum())} of {mask.size} entries; none has an error bound "
        "(4 + sqrt d) u s / 2 above 2048 u, so ordinary inputs should pay nothing",
        hints=[_flag_pattern(mask) or "entries flagged whose error bound is small: compare the bound with 2048 u"])
