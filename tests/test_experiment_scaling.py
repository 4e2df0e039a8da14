"""The scaling experiment: its quick sweep, memory that does not depend on ``--jobs``, the slope fit.

Assertions are on peak memory, which is deterministic, never on time.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from refimpl.experiments import load, sweep
from refimpl.experiments.scaling import fit_slope

scaling = load("scaling")


def _sweep(out, jobs):
    return sweep.run(scaling, quick=True, seeds=1, jobs=jobs, out=out, progress=False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick sweep run one point at a time: (rows, folder of its CSV)."""
    out = tmp_path_factory.mktemp("scaling_jobs1")
    return _sweep(out, jobs=1), out


def _memory(rows, method, direction):
    return {int(r["n"]): r["peak_mib"] for r in rows if r["method"] == method and r["direction"] == direction}


def test_quick_sweep_gives_finite_positive_metrics(quick):
    rows, _ = quick
    assert {r["method"] for r in rows} == set(scaling.METHODS)
    assert {r["direction"] for r in rows} == set(scaling.DIRECTIONS)
    assert len(rows) == len(scaling.METHODS) * len(scaling.DIRECTIONS) * len(scaling.QUICK_SIZES)
    for row in rows:
        for metric in scaling.METRICS:
            assert math.isfinite(row[metric]) and row[metric] > 0, (row, metric)


@pytest.mark.parametrize("direction", scaling.DIRECTIONS)
def test_softmax_memory_grows_quadratically_the_others_linearly(quick, direction):
    rows, _ = quick
    small, large = scaling.QUICK_SIZES
    assert large == 2 * small
    for method in scaling.METHODS:
        memory = _memory(rows, method, direction)
        ratio = memory[large] / memory[small]
        if method == "softmax":
            assert 3.2 < ratio < 4.5, (method, direction, memory)  # about 4 = 2^2
        else:
            assert 1.4 < ratio < 2.3, (method, direction, memory)  # about 2


def _without_timings(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in row.items() if k not in scaling.TIMINGS} for row in rows]


def test_memory_columns_do_not_depend_on_jobs(quick, tmp_path):
    _, out1 = quick
    _sweep(tmp_path, jobs=2)
    one = _without_timings(out1 / "scaling.csv")
    two = _without_timings(tmp_path / "scaling.csv")
    assert "peak_mib" in one[0] and "time_s" not in one[0]
    assert [{k: v for k, v in r.items() if k != "peak_mib"} for r in one] == [{k: v for k, v in r.items() if k != "peak_mib"} for r in two]
    # the rounded peaks are equal unless a raw peak sits within a few bytes of a rounding boundary: then one unit apart
    for a, b in zip(one, two):
        assert abs(float(a["peak_mib"]) - float(b["peak_mib"])) <= scaling.PEAK_UNIT_MIB, (a, b)
    assert sum(a["peak_mib"] == b["peak_mib"] for a, b in zip(one, two)) >= len(one) - 1


def test_fit_slope_on_exact_power_laws():
    n = 2.0 ** np.arange(8, 15)
    assert fit_slope(n, 3.0 * n) == pytest.approx(1.0, abs=1e-12)
    assert fit_slope(n, 0.5 * n**2) == pytest.approx(2.0, abs=1e-12)
    # only the largest sizes are fitted, whatever the order: linear below, quadratic over the last three
    y = np.where(n < 2.0**12, 1e3 * n, n**2 / 4.0)
    order = np.random.default_rng(0).permutation(n.size)
    assert fit_slope(n[order], y[order], last=3) == pytest.approx(2.0, abs=1e-12)
    assert math.isnan(fit_slope([4.0], [16.0]))
