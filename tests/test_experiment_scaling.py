"""The scaling experiment: its quick sweep, memory that does not depend on ``--jobs``, the slope fit.

Assertions are on peak memory, which is deterministic, never on time.
"""

from __future__ import annotations

import csv
import gc
import math

import numpy as np
import pytest

from app.experiments import load, sweep
from app.experiments.scaling import fit_slope

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


# ----------------------------------------------------------------------------- the measurements against their definitions


def test_best_time_is_the_shortest_call_within_the_repeats_and_the_budget(monkeypatch):
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 29.0, 40.0, 41.0])  # calls of 5, 2, 9 and 1 seconds
    monkeypatch.setattr(scaling.time, "perf_counter", lambda: next(clock))
    calls = []
    assert scaling.best_time(lambda: calls.append(1), repeats=3, budget=100.0) == 2.0 and len(calls) == 3
    clock = iter([0.0, 5.0, 10.0, 12.0])
    calls.clear()
    assert scaling.best_time(lambda: calls.append(1), repeats=3, budget=6.0) == 2.0 and len(calls) == 2  # 7 s > budget


@pytest.mark.parametrize("was_enabled", [True, False])
def test_the_measured_calls_run_with_the_collector_paused_and_leave_it_as_it_was(was_enabled):
    seen = []
    (gc.enable if was_enabled else gc.disable)()
    try:
        scaling.best_time(lambda: seen.append(gc.isenabled()), repeats=3, budget=100.0)
        scaling.peak_mib(lambda: seen.append(gc.isenabled()))
        assert seen == [False] * 4 and gc.isenabled() is was_enabled
    finally:
        gc.enable()


def test_peak_mib_counts_what_a_call_allocates_in_mib():
    n = 3 * 2**17  # 3 MiB of float64
    assert scaling.peak_mib(lambda: np.ones(n)) == pytest.approx(3.0, abs=0.01)


def test_the_table_keeps_the_best_time_and_the_largest_peak_over_seeds():
    rows = [{"method": "gma", "direction": "forward", "n": n, "seed": s, "time_s": t, "peak_mib": m}
            for n, s, t, m in [(256, 0, 0.5, 3.0), (256, 1, 0.25, 2.0), (512, 0, 1.0, 6.0), (512, 1, 2.0, 4.0),
                               (1024, 0, 2.0, 12.0)]]
    table = scaling.table(rows)
    assert "| gma | forward | 256 | 0.25 | 3 |" in table and "| gma | forward | 512 | 1 | 6 |" in table
    time_slope, memory_slope = scaling.slopes(rows)[("gma", "forward")]
    assert time_slope == pytest.approx(fit_slope([256, 512, 1024], [0.25, 1.0, 2.0]), rel=1e-14)
    assert memory_slope == pytest.approx(fit_slope([256, 512, 1024], [3.0, 6.0, 12.0]), rel=1e-14) and memory_slope == pytest.approx(1.0)


def test_run_point_rounds_the_peak_to_its_unit(monkeypatch):
    monkeypatch.setattr(scaling, "peak_mib", lambda fn: 1.0 + 0.7 * scaling.PEAK_UNIT_MIB)
    monkeypatch.setattr(scaling, "best_time", lambda fn: 0.5)
    got = scaling.run_point({"method": "linear", "direction": "forward", "n": 64, "seed": 0})
    assert got == {"time_s": 0.5, "peak_mib": 1.0 + scaling.PEAK_UNIT_MIB}


def test_the_full_grid_runs_softmax_up_to_its_limit_and_the_others_to_the_largest_size():
    points = scaling.grid(False, 2)
    sizes = {m: sorted({p["n"] for p in points if p["method"] == m}) for m in scaling.METHODS}
    assert sizes["softmax"] == [n for n in scaling.SIZES if n <= scaling.SOFTMAX_MAX_N] and scaling.SOFTMAX_MAX_N in scaling.SIZES
    assert all(sizes[m] == list(scaling.SIZES) for m in scaling.METHODS if m != "softmax")
    assert len(points) == 2 * len(scaling.DIRECTIONS) * sum(len(v) for v in sizes.values())
