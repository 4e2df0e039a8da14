"""The diagnoses of ``tutorials/_hints.py``: each fires on its pattern and stays silent on plain noise.

Every pattern is built from a seeded random array ``e`` (the expected
result): ``-e``, ``c e``, ``e`` moved by one row, ``e`` transposed, rows
scaled each by its own factor, ``e`` with an inf, an error that grows along
the rows, two runs that differ, an error only at the edges of tiles.  The
same diagnosis on ``e`` plus rounding-sized noise (or noise far above
rounding but without the pattern) must say nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))

import _hints  # noqa: E402  (from tutorials/)

U = np.finfo(np.float64).eps


@pytest.fixture
def e():
    return np.random.default_rng(7).standard_normal((12, 5))


def _noisy(e, rel=1e-3, seed=8):
    """``e`` with independent relative noise of size ``rel``: wrong, but with no pattern."""
    return e * (1 + rel * np.random.default_rng(seed).standard_normal(e.shape))


def test_explains_accounts_for_the_error_or_not(e):
    assert _hints.explains(-e, -e, e)
    assert not _hints.explains(_noisy(e), -e, e)
    assert not _hints.explains(e, e, e)  # no error: nothing to explain


def test_flipped_sign(e):
    assert "flipped sign" in _hints.flipped_sign(-e, e)
    assert "flipped sign" in _hints.flipped_sign(-2.5, 2.5)
    assert _hints.flipped_sign(_noisy(e), e) is None
    assert _hints.flipped_sign(-_noisy(e, 0.3), e) is None


@pytest.mark.parametrize(("c", "words"), [(2.0, "factor 2 too many"), (0.5, "missing factor 2"),
                                          (np.sqrt(2), "factor sqrt 2 too many"), (1 / 3.0, "missing factor d"),
                                          (1 + 1e-9, "scaled by 1 + 1.0e-09"), (7.3, "7.3 times")])
def test_constant_factor_names_the_factor(e, c, words):
    line = _hints.constant_factor(c * e, e, factors={"d": 3.0})
    assert line is not None and words in line, line


def test_constant_factor_is_silent_without_one_factor(e):
    assert _hints.constant_factor(_noisy(e), e) is None
    assert _hints.constant_factor(e + 1e-3, e) is None  # an offset, not a factor
    assert _hints.constant_factor(e * (1 + 64 * U * np.random.default_rng(1).standard_normal(e.shape)), e) is None
    # one number has a ratio with any other: only a named one, or one close to 1, is reported
    assert _hints.constant_factor(7.3, 1.0) is None
    assert "factor 2" in _hints.constant_factor(2.0, 1.0)


def test_constant_factor_survives_huge_entries():
    e = np.array([1e300, -3e299, 2.0, 5e250])
    assert "scaled by 1 + 1.0e-11" in _hints.constant_factor(e * (1 + 1e-11), e)


def test_power():
    e = np.random.default_rng(3).uniform(0.5, 3.0, size=20)
    assert "squared" in _hints.power(e**2, e)
    assert "inverted" in _hints.power(1 / e, e)
    assert "square roots" in _hints.power(np.sqrt(e), e)
    assert _hints.power(_noisy(e), e) is None
    assert _hints.power(e * 1.5, e) is None


def test_transposed():
    e = np.random.default_rng(4).standard_normal((4, 4))
    assert "transposed" in _hints.transposed(e.T, e)
    assert "transposed" in _hints.transposed(np.ones((3, 5)), np.ones((5, 3)))  # a shape reversed
    assert _hints.transposed(_noisy(e), e) is None
    sym = e + e.T  # a symmetric expected value: a transpose is no explanation
    assert _hints.transposed(_noisy(sym), sym) is None


def test_shifted_by_one(e):
    later = np.vstack([np.zeros((1, 5)), e[:-1]])  # each row holds the expected value of the row before
    assert "one later" in _hints.shifted(later, e, axis=0, name="token")
    earlier = np.vstack([e[1:], np.zeros((1, 5))])
    assert "one earlier" in _hints.shifted(earlier, e, axis=0, name="token")
    assert _hints.shifted(_noisy(e), e, axis=0) is None
    assert _hints.shifted(np.roll(e, 2, axis=0), e, axis=0) is None  # by two: not an off-by-one


def test_per_row_scale_and_normalisation():
    p = np.random.default_rng(5).dirichlet(np.ones(6), size=8)
    scaled = p * np.random.default_rng(6).uniform(0.5, 2.0, size=(8, 1))
    assert "normalisation" in _hints.per_row_scale(scaled, p, axis=1)
    assert _hints.per_row_scale(_noisy(p), p, axis=1) is None
    assert _hints.per_row_scale(2 * p, p, axis=1) is None  # one factor for all rows: constant_factor's case
    assert "sum to" in _hints.not_normalised(scaled, axis=1)
    assert _hints.not_normalised(p, axis=1) is None


def test_nonfinite(e):
    bad = e.copy()
    bad[3, 1] = np.inf
    bad[4, 2] = np.nan
    line = _hints.nonfinite(bad, e)
    assert "overflow" in line and "row maximum" in line and "2 entries" in line
    assert _hints.nonfinite(_noisy(e), e) is None
    assert _hints.nonfinite(bad, bad) is None  # non-finite where it is expected too


def test_grows_with_a_size():
    n = 300
    t = np.arange(n)[:, None]
    e = np.random.default_rng(9).standard_normal((n, 2))
    growing = e + 1e-6 * t * np.random.default_rng(10).standard_normal((n, 2))
    assert "cancellation" in _hints.grows_with(growing, e, t, "t")
    flat = e + 1e-6 * np.random.default_rng(10).standard_normal((n, 2))
    assert _hints.grows_with(flat, e, t, "t") is None


def test_boundary_only():
    e = np.random.default_rng(11).standard_normal((16, 3))
    at_edges = e.copy()
    at_edges[[3, 4, 8]] += 1.0  # rows at the edges of tiles of 4
    assert "boundaries" in _hints.boundary_only(at_edges, e, 1e-12, 4, axis=0)
    inside = e.copy()
    inside[[5, 6]] += 1.0  # rows inside a tile
    assert _hints.boundary_only(inside, e, 1e-12, 4, axis=0) is None
    assert _hints.boundary_only(_noisy(e), e, 1e-12, 4, axis=0) is None  # everywhere: not a boundary pattern


def test_nondeterministic(e):
    other = e.copy()
    other[2, 2] += 1e-9
    line = _hints.nondeterministic(e, other)
    assert "race" in line and "cuda.syncthreads()" in line and "1 entries" in line
    nan = e.copy()
    nan[0, 0] = np.nan
    assert _hints.nondeterministic(nan, nan.copy()) is None  # nan equals nan between two runs
    assert _hints.nondeterministic(e, e.copy()) is None


def test_matches_a_known_wrong_result(e):
    known = {"the guard missing": 1.5 * e, "another": e + 1}
    assert _hints.matches(1.5 * e, known, e) == "the guard missing"
    assert _hints.matches(_noisy(e), known, e) is None
    assert _hints.matches(e + 1, known) == "another"


def test_shape():
    assert "transposed" in _hints.shape((3, 7), (7, 3))
    assert "not summed" in _hints.shape((6,), ())
    assert "axis missing" in _hints.shape((4,), (4, 2))
    assert _hints.shape((4, 2), (4, 2)) is None


def test_diagnose_names_a_known_result_first_and_alone(e):
    assert _hints.diagnose(-e, e, known={"the sign of the step": -e}) == ["the sign of the step"]
    assert _hints.diagnose(-e, e) == ["a flipped sign: your values are -1 times the expected ones"]
    assert _hints.diagnose(_noisy(e), e, axes={0: "row"}, rows=1, size=np.arange(12)[:, None]) == []


def test_diagnose_never_raises():
    assert _hints.diagnose(np.ones(3), "not an array") == []
    assert _hints.diagnose(np.ones(3), np.ones(4)) == []


def test_explain_keeps_the_message_and_adds_the_diagnosis(e):
    message = "entry (0, 0) is 1.0, expected 2.0 (allowed 1e-12)"
    out = _hints.explain(message, -e, e, hints=[None, "an exercise-specific hint"])
    assert out.startswith(message + "\n" + _hints.HEADER)
    assert "  - an exercise-specific hint" in out and "flipped sign" in out
    assert _hints.explain(message, _noisy(e), e) == message  # nothing to say: the message as it was


def test_compare_passes_within_the_tolerance_and_diagnoses_beyond(e):
    _hints.compare(e * (1 + 1e-14), e, "x", 1e-12, relative=True)
    with pytest.raises(AssertionError, match="scaled by 1 \\+ 1.0e-09"):
        _hints.compare(e * (1 + 1e-9), e, "x", 1e-12, relative=True)  # small, but a thousand times the tolerance
    with pytest.raises(AssertionError) as info:
        _hints.compare(2 * e, e, "x", 1e-12, relative=True)
    message = str(info.value)
    assert message.startswith("x: entry") and "allowed 1e-12" in message and "factor 2 too many" in message
    with pytest.raises(AssertionError, match="transposed"):
        _hints.compare(np.ones((5, 12)), e, "x", 1e-12)
    with pytest.raises(AssertionError, match="non-finite.*\n.*\n.*overflow"):
        _hints.compare(np.full_like(e, np.inf), e, "x", 1e-12)
