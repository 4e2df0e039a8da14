"""Experiment sweeps on a real dask cluster: ``--scheduler local:N`` and addresses, and a worker killed mid-sweep.

Each test starts a ``LocalCluster`` of worker processes that talk TCP on
127.0.0.1 (``python -m app experiment NAME --scheduler local:2``, or
:func:`app.experiments.sweep.run` with ``scheduler=``), as a sweep on a
lab's cluster would, only with the scheduler and the workers on this machine.
"""

from __future__ import annotations

import csv
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.experiments import load, sweep

pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _experiment(*argv, out):
    return subprocess.run(
        [sys.executable, "-m", "app", "experiment", "regression", "--quick", "--seeds", "1", "--no-progress",
         "--out", str(out), *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_sweep_on_a_local_cluster_writes_the_same_file_as_joblib(tmp_path):
    here = _experiment("--jobs", "1", out=tmp_path / "joblib")
    assert here.returncode == 0, here.stderr
    cluster = _experiment("--scheduler", "local:2", out=tmp_path / "dask")
    assert cluster.returncode == 0, cluster.stderr
    regression = load("regression")
    deterministic = [c for c in (*regression.PARAMS, *regression.METRICS) if c not in regression.TIMINGS]
    a, b = _rows(tmp_path / "joblib" / "regression.csv"), _rows(tmp_path / "dask" / "regression.csv")
    assert len(a) == len(b) == len(regression.grid(True, 1))
    assert [[r[c] for c in deterministic] for r in a] == [[r[c] for c in deterministic] for r in b]


def test_a_scheduler_that_does_not_answer_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(ValueError, match=r"^scheduler: no dask scheduler answered at 'tcp://127.0.0.1:9' within 1 s"):
        sweep.run(load("regression"), quick=True, seeds=1, jobs=1, out=tmp_path / "out", progress=False,
                  scheduler="tcp://127.0.0.1:9")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--scheduler", "local:0"], "--scheduler: local:N takes a number of worker processes N >= 1, got 'local:0'"),
    (["--scheduler", "local:two"], "--scheduler: local:N takes a number of worker processes N >= 1, got 'local:two'"),
    (["--scheduler", "local:2", "--jobs", "2"], "--scheduler: the dask cluster's workers run the points in parallel"),
])
def test_bad_scheduler_options_exit_2_with_one_line(tmp_path, argv, message):
    proc = _experiment(*argv, out=tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def _wait_for(found, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not (result := found()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)
    return result


@pytest.fixture
def hold(tmp_path, monkeypatch):
    """The experiment of ``tests/_sweep_hold.py``, importable by this process and by the workers the test starts."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SWEEP_HOLD_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(str(TESTS))
    return importlib.import_module("_sweep_hold")


def _kill_the_hold_point_mid_sweep(tmp_path, sweep_on_the_cluster, release):
    """Run the sweep in a thread, SIGKILL the worker running the point ``hold``; its pid and the sweep's outcome."""
    outcome = {}

    def target():
        try:
            outcome["rows"] = sweep_on_the_cluster()
        except BaseException as err:  # reported by the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    started = _wait_for(lambda: sorted(tmp_path.glob("started-hold-*")), "the point 'hold' starting")
    killed = int(started[0].name.rsplit("-", 1)[1])
    os.kill(killed, signal.SIGKILL)
    if release:
        (tmp_path / "release").touch()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the sweep did not finish after its worker was killed"
    return killed, outcome


def test_a_worker_killed_mid_point_loses_no_point_and_duplicates_none(tmp_path, hold):
    """SIGKILL the worker running the point ``hold``: the scheduler runs it again on a live worker, and its row is written once."""
    killed, outcome = _kill_the_hold_point_mid_sweep(
        tmp_path, lambda: sweep.run(hold, quick=True, seeds=2, jobs=1, out=tmp_path / "out", progress=False,
                                    scheduler="local:2"), release=True)
    assert "error" not in outcome, repr(outcome.get("error"))

    runs = {int(p.name.rsplit("-", 1)[1]) for p in tmp_path.glob("started-hold-*")}
    assert killed in runs and len(runs) >= 2, f"the point 'hold' ran in {sorted(runs)}; it must have run again after {killed}"
    rows = _rows(tmp_path / "out" / "hold.csv")
    keys = [(r["name"], r["seed"]) for r in rows]
    expected = [(p["name"], str(p["seed"])) for p in hold.grid(True, 2)]
    assert keys == expected  # every point once, in grid order
    assert [float(r["value"]) for r in rows] == [10.0 * len(n) + int(s) for n, s in expected]
    assert [r["value"] for r in outcome["rows"]] == [10.0 * len(n) + int(s) for n, s in expected]


def test_a_point_whose_workers_keep_dying_is_given_up_and_a_rerun_resumes(tmp_path, hold):
    """With ``allowed-failures`` 0 the killed point is not run again: WorkerLost names it, and the next run finishes the grid."""
    dask = pytest.importorskip("dask")

    def sweep_on_the_cluster():
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            return sweep.run(hold, quick=True, seeds=1, jobs=1, out=tmp_path / "out", progress=False, scheduler="local:2")

    _, outcome = _kill_the_hold_point_mid_sweep(tmp_path, sweep_on_the_cluster, release=False)
    assert isinstance(outcome.get("error"), sweep.WorkerLost), repr(outcome.get("error"))
    # the point named is one the killed worker held: 'hold', or one the scheduler had queued behind it there
    named = re.search(r"^the point \{'name': '(\w+)', 'seed': 0\} was given up", str(outcome["error"]))
    assert named and named.group(1) in {p["name"] for p in hold.grid(True, 1)}, str(outcome["error"])
    written = [(r["name"], r["seed"]) for r in _rows(tmp_path / "out" / "hold.csv")]
    assert ("hold", "0") not in written and (named.group(1), "0") not in written and len(set(written)) == len(written)

    (tmp_path / "release").touch()
    rows = sweep.run(hold, quick=True, seeds=1, jobs=1, out=tmp_path / "out", progress=False, scheduler="local:1")
    assert [(r["name"], r["value"]) for r in rows] == [("a", 10.0), ("hold", 40.0), ("bb", 20.0), ("ccc", 30.0)]
    assert [(r["name"], r["seed"]) for r in _rows(tmp_path / "out" / "hold.csv")] == [(n, "0") for n in ("a", "hold", "bb", "ccc")]
