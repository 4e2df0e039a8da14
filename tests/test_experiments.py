"""The sweep runner behind ``python -m app experiment``: results file, resume, grid order, errors.

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

import app.experiments as experiments
from app.experiments import sweep

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
    with pytest.raises(ValueError, match="experiment: expected one of recall, regression, scaling, continual, positional, got 'recal'"):
        experiments.load("recal")


@pytest.mark.parametrize("argv, message", [(["--seeds", "0"], "seeds: expected an integer >= 1"), (["--jobs", "0"], "jobs: expected an integer >= 1"), (["--seeds", "two"], "argument --seeds: invalid int value")])
def test_the_command_line_refuses_bad_options_with_their_name(tmp_path, argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "app", "experiment", "scaling", "--quick", "--no-progress", "--out", str(tmp_path), *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("name", experiments.EXPERIMENTS)
def test_every_experiment_runs_quick_from_the_command_line(tmp_path, name):
    """``--quick`` through the command line: a table on standard output, the CSV file and the plot in --out."""
    proc = subprocess.run(
        [sys.executable, "-m", "app", "experiment", name, "--quick", "--seeds", "1", "--jobs", "1", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exp = experiments.load(name)
    rows = sweep.read_results(exp, tmp_path / f"{name}.csv")
    assert len(rows) == len(exp.grid(True, 1))
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert f"results in {tmp_path / (name + '.csv')}" in proc.stdout


# ----------------------------------------------------------------------------- a results file read back strictly

HEADER = "size,method,seed,value,third\n"


def test_a_last_row_cut_mid_number_is_dropped_and_its_point_run_again(calls, tmp_path):
    made, exp = calls
    sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    complete = (tmp_path / "toy.csv").read_bytes()
    kept = b"".join(complete.splitlines(keepends=True)[:3])  # the header and the two points of size 1
    cut = kept + b"2,a,0,20."  # the next row, cut short: a number still, and a wrong one
    (tmp_path / "toy.csv").write_bytes(cut)
    assert set(sweep.read_results(exp, tmp_path / "toy.csv")) == {("1", "a", "0"), ("1", "b", "0")}
    # a rerun that is interrupted after one point: the cut row was cut off before that point was appended
    run_point = exp.run_point

    def interrupted(point):
        if point["method"] == "b":
            raise KeyboardInterrupt
        return run_point(point)

    exp.run_point = interrupted
    made.clear()
    with pytest.raises(KeyboardInterrupt):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == [(2, "a", 0)]
    assert (tmp_path / "toy.csv").read_bytes().startswith(kept + b"2,a,0,20.0,")
    assert sweep.read_results(exp, tmp_path / "toy.csv")[("2", "a", "0")]["value"] == 20.0
    exp.run_point = run_point
    made.clear()
    rows = sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == [(2, "b", 0)] and rows[-1]["value"] == 21.0
    assert (tmp_path / "toy.csv").read_bytes() == complete


@pytest.mark.parametrize("content, message", [
    (HEADER + "1,a,0,nan,0.5\n", r"toy.csv, line 2: value = 'nan' is not a finite number"),
    (HEADER + "1,a,0,10.0,0.5\n1,b,0,-inf,0.5\n", r"toy.csv, line 3: value = '-inf' is not a finite number"),
    (HEADER + "1,a,0,10.0,0.5\n2,a,0,20.0,0.5\n1,a,0,10.5,0.5\n", r"toy.csv, lines 2 and 4, give the point .* two different results"),
    (HEADER + "1,a,0,10.0,0.5\n1,b,0,1\xe9,0.5\n", r"toy.csv, line 3, is not UTF-8 text"),
    (HEADER + "1,a,0,10.0\n", r"toy.csv, line 2, is not a complete row"),
    (HEADER + "1,a,0,10.0,0.5,7\n", r"toy.csv, line 2, is not a complete row"),
    (HEADER + "1,a,0,ten,0.5\n", r"toy.csv, line 2, is not a complete row"),
])
def test_a_damaged_results_file_is_refused_naming_the_file_and_line_and_left_alone(calls, tmp_path, content, message):
    made, exp = calls
    data = content.encode("latin-1")
    (tmp_path / "toy.csv").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == [] and (tmp_path / "toy.csv").read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["toy.csv"]


def test_the_same_row_twice_is_one_point(calls, tmp_path):
    made, exp = calls
    (tmp_path / "toy.csv").write_text(HEADER + "1,a,0,10.0,0.5\n1,a,0,10.0,0.5\n")
    assert list(sweep.read_results(exp, tmp_path / "toy.csv")) == [("1", "a", "0")]
    sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert (1, "a", 0) not in made and lines(tmp_path / "toy.csv").count("1,a,0,10.0,0.5") == 1


def test_a_point_with_a_non_finite_metric_is_refused_and_not_written(calls, tmp_path):
    made, exp = calls
    run_point = exp.run_point
    exp.run_point = lambda point: {**run_point(point), "third": float("nan")} if point["size"] == 2 else run_point(point)
    with pytest.raises(ValueError, match=r"experiment 'toy': the point \{'size': '2', 'method': 'a', 'seed': '0'\} gave third = nan"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert all("nan" not in line for line in lines(tmp_path / "toy.csv"))


def test_an_unwritable_out_is_refused_before_anything_is_written(calls, tmp_path, monkeypatch):
    """The folder check (as root, which ignores permissions, os.access is what says no)."""
    made, exp = calls
    real_access = sweep.validation.os.access
    monkeypatch.setattr(sweep.validation.os, "access", lambda p, mode: False if str(p).startswith(str(tmp_path)) else real_access(p, mode))
    with pytest.raises(ValueError, match=rf"out: {tmp_path}, where {tmp_path / 'new'} would be created, is not writable"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path / "new", progress=False)
    with pytest.raises(ValueError, match=rf"out: {tmp_path} is not writable"):
        sweep.run(exp, quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert made == [] and list(tmp_path.iterdir()) == []


def test_the_command_line_reports_a_damaged_file_in_one_line(tmp_path):
    (tmp_path / "scaling.csv").write_text("method,direction,n,seed,time_s,peak_mib\ngma,forward,256,0,0.1,inf\n")
    proc = subprocess.run(
        [sys.executable, "-m", "app", "experiment", "scaling", "--quick", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"python -m app experiment scaling: --out: {tmp_path / 'scaling.csv'}, line 2: peak_mib = 'inf' "
                           "is not a finite number; remove the file or that line\n")
