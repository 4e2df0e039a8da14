"""The sweep runner behind ``python -m refimpl experiment``: results file, resume, grid order, errors.

The experiments themselves are tested in ``test_experiment_*.py``; here a
small experiment defined in this file exercises the runner (``--jobs 1`` runs
in this process, so the experiment can be swapped in with monkeypatch).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import refimpl.experiments as experiments
from refimpl.experiments import sweep

ROOT = Path(__file__).resolve().parents[1]


def toy(calls):
    """An experiment of 6 points: a metric that is a known function of the point."""

    def grid(quick, seeds):
        sizes = (1, 2) if quick else (1, 2, 3)
        return [{"size": n, "method": m, "seed": s} for n in sizes for m in ("a", "b") for s in range(seeds)]

    def run_point(point):
        calls.append((point["size"], point["method"], point["seed"]))
        return {"value": point["size"] * 10.0 + (point["method"] == "b") + point["seed"] / 8, "third": 1 / 3}

    return SimpleNamespace(
        NAME="toy", PARAMS=("size", "method", "seed"), METRICS=("value", "third"), TIMINGS=(), grid=grid, run_point=run_point,
        table=lambda rows: f"{len(rows)} rows", plot=lambda rows, path: None,
    )


@pytest.fixture
def calls(monkeypatch):
    made = []
    exp = toy(made)
    monkeypatch.setattr(experiments, "load", lambda name: exp)
    return made, exp


def lines(path):
    return Path(path).read_text().splitlines()


def test_rows_come_back_in_grid_order_with_typed_points_and_exact_floats(calls, tmp_path):
    made, exp = calls
    rows = sweep.run(exp, quick=False, seeds=2, jobs=1, out=tmp_path, progress=False)
    assert [(r["size"], r["method"], r["seed"]) for r in rows] == [(p["size"], p["method"], p["seed"]) for p in exp.grid(False, 2)]
    assert rows[3] == {"size": 1, "method": "b", "seed": 1, "value": 11.125, "third": 1 / 3}
    with (tmp_path / "toy.csv").open() as f:
        written = list(csv.DictReader(f))
    assert float(written[0]["third"]) == 1 / 3  # repr: the file round-trips every float exactly
    assert len(made) == 12


def test_an_interrupted_sweep_resumes_where_the_file_stops(calls, tmp_path):
    made, exp = calls
    sweep.run(exp, quick=False, seeds=1, jobs=1, out=tmp_path, progress=False)
    complete = lines(tmp_path / "toy.csv")
    # interrupted after four points: the header and four rows are on disk
    (tmp_path / "toy.csv").write_text("\n".join(complete[:5]) + "\n")
    made.clear()
    rows = sweep.run(exp, quick=False, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == [(3, "a", 0), (3, "b", 0)]  # only the missing points ran
    assert lines(tmp_path / "toy.csv") == complete
    assert len(rows) == 6


def test_a_finished_sweep_runs_nothing_again(calls, tmp_path):
    made, exp = calls
    sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    made.clear()
    sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == []


def test_rows_of_another_grid_in_the_same_folder_are_kept(calls, tmp_path):
    made, exp = calls
    sweep.run(exp, quick=False, seeds=1, jobs=1, out=tmp_path, progress=False)
    full = set(lines(tmp_path / "toy.csv"))
    rows = sweep.run(exp, quick=True, seeds=2, jobs=1, out=tmp_path, progress=False)
    assert len(rows) == 8  # the quick grid with two seeds
    assert full <= set(lines(tmp_path / "toy.csv"))  # nothing of the full run was dropped


def test_a_result_file_of_another_experiment_is_refused(calls, tmp_path):
    _, exp = calls
    (tmp_path / "toy.csv").write_text("size,method,seed,other\n1,a,0,3.0\n")
    with pytest.raises(ValueError, match=r"out: .*toy.csv has the columns .* pass another --out or remove the file"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)


def test_a_truncated_row_is_refused_with_its_line(calls, tmp_path):
    _, exp = calls
    (tmp_path / "toy.csv").write_text("size,method,seed,value,third\n1,a,0,10.0,0.3\n1,b,0,11.\n")
    with pytest.raises(ValueError, match=r"toy.csv, line 3, is not a complete row"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)


@pytest.mark.parametrize("seeds, jobs, message", [(0, 1, "seeds: expected an integer >= 1"), (1, 0, "jobs: expected an integer >= 1"), (1.5, 1, "seeds"), (1, -2, "jobs")])
def test_bad_options_name_the_option(calls, tmp_path, seeds, jobs, message):
    _, exp = calls
    with pytest.raises(ValueError, match=message):
        sweep.run(exp, quick=True, seeds=seeds, jobs=jobs, out=tmp_path, progress=False)


def test_a_grid_that_repeats_a_point_is_refused(calls, tmp_path):
    _, exp = calls
    exp.grid = lambda quick, seeds: [{"size": 1, "method": "a", "seed": 0}] * 2
    with pytest.raises(ValueError, match="repeats a point"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)


def test_load_refuses_an_unknown_experiment():
    with pytest.raises(ValueError, match="experiment: expected one of recall, regression, scaling, got 'recal'"):
        experiments.load("recal")


@pytest.mark.parametrize("argv, message", [(["--seeds", "0"], "seeds: expected an integer >= 1"), (["--jobs", "0"], "jobs: expected an integer >= 1"), (["--seeds", "two"], "argument --seeds: invalid int value")])
def test_the_command_line_refuses_bad_options_with_their_name(tmp_path, argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "refimpl", "experiment", "scaling", "--quick", "--no-progress", "--out", str(tmp_path), *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("name", experiments.EXPERIMENTS)
def test_every_experiment_runs_quick_from_the_command_line(tmp_path, name):
    """``--quick`` through the command line: a table on standard output, the CSV file and the plot in --out."""
    proc = subprocess.run(
        [sys.executable, "-m", "refimpl", "experiment", name, "--quick", "--seeds", "1", "--jobs", "1", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exp = experiments.load(name)
    rows = sweep.read_results(exp, tmp_path / f"{name}.csv")
    assert len(rows) == len(exp.grid(True, 1))
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert f"results in {tmp_path / (name + '.csv')}" in proc.stdout
