"""Faults injected into real processes of ``python -m app train`` and ``python -m app experiment``.

Each test runs the command line in a child process and makes something go
wrong there: an output folder that cannot be written, a disk that fills up
while a checkpoint or a results file is written, ``SIGTERM`` in the middle
of a sweep or of a training run, ``SIGKILL`` before the first checkpoint.
It then checks what a user sees (exit status, one line on standard error
that names the file or says what to run, no traceback), what is left on
disk, and that the command the message names finishes the work as an
uninterrupted run does.

The faults are injected through a ``sitecustomize`` module on the child's
``PYTHONPATH`` that runs the code in ``REFIMPL_FAULT`` at start-up (in every
process: the sweep's workers too).  Where the tests run as root, which
ignores file permissions, a read-only folder is simulated that way as well:
``os.access``, ``os.mkdir`` and ``open`` say no for the paths below it.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app import train
from app.__main__ import main
from app.experiments import load, sweep

ROOT = Path(__file__).resolve().parents[1]
QUICK = train.quick_config()  # 12 steps, evaluations and checkpoints at 4, 8, 12
TRAIN = ["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress"]
REGRESSION = ["experiment", "regression", "--quick", "--seeds", "1", "--no-progress"]

SITECUSTOMIZE = '''import os
code = os.environ.get("REFIMPL_FAULT")
if code:
    exec(compile(code, "<REFIMPL_FAULT>", "exec"), {"__name__": "refimpl_fault"})
'''

# paths below FOLDER cannot be written: os.access says so, and mkdir and open refuse
READ_ONLY = '''
import builtins, errno, io, os
FOLDER = os.path.abspath({folder!r})

def below(path):
    try:
        path = os.path.abspath(os.fspath(path))
    except TypeError:
        return False
    return path == FOLDER or path.startswith(FOLDER + os.sep)

def denied(path):
    return PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

access, mkdir, real_open = os.access, os.mkdir, io.open
os.access = lambda path, mode, **kw: False if below(path) and mode & os.W_OK else access(path, mode, **kw)

def guarded_mkdir(path, *args, **kw):
    if below(path):
        raise denied(path)
    return mkdir(path, *args, **kw)

def guarded_open(file, mode="r", *args, **kw):
    if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and below(file):
        raise denied(file)
    return real_open(file, mode, *args, **kw)

os.mkdir = guarded_mkdir
builtins.open = io.open = guarded_open
'''

# the open of the n-th file whose name ends with SUFFIX gives a file that takes KEEP bytes, then is out of space
FULL_DISK = '''
import builtins, errno, io, os
SUFFIX, NTH, KEEP = {suffix!r}, {nth!r}, {keep!r}
real_open, opened = io.open, []

class Full:
    def __init__(self, f):
        self._f, self._left = f, KEEP
    def write(self, data):
        if len(data) > self._left:
            self._f.write(data[: self._left])
            self._f.flush()
            self._left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left -= len(data)
        return self._f.write(data)
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self._f.close()
    def __iter__(self):
        return iter(self._f)

def guarded_open(file, mode="r", *args, **kw):
    f = real_open(file, mode, *args, **kw)
    if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(SUFFIX) and set(mode) & set("wa"):
        opened.append(file)
        if len(opened) == NTH:
            return Full(f)
    return f

builtins.open = io.open = guarded_open
'''

# a permission denied on the n-th open of a file whose name ends with SUFFIX
DENIED_AT = '''
import builtins, errno, io, os
SUFFIX, NTH = {suffix!r}, {nth!r}
real_open, opened = io.open, []

def guarded_open(file, mode="r", *args, **kw):
    if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(SUFFIX) and set(mode) & set("wa"):
        opened.append(file)
        if len(opened) == NTH:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
    return real_open(file, mode, *args, **kw)

builtins.open = io.open = guarded_open
'''

# every call of MODULE.FUNCTION sleeps SECONDS first (a slow step, a slow grid point)
SLOW = '''
import importlib, time
module = importlib.import_module({module!r})
original = getattr(module, {function!r})

def slow(*args, **kw):
    time.sleep({seconds!r})
    return original(*args, **kw)

setattr(module, {function!r}, slow)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = tmp_path_factory.mktemp("site")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


def child_env(site, fault):
    env = {k: v for k, v in os.environ.items() if k != "REFIMPL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if fault is not None:
        env["REFIMPL_FAULT"] = fault
    return env


def run_cli(site, argv, fault=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "app", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(site, fault), timeout=timeout)


def start_cli(site, argv, fault, log):
    """The command in the background, its output to ``log`` (a pipe would be held open by any process it leaves)."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "app", *argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(site, fault))


def one_line(text):
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def without_seconds(table):
    return [r[:-1] for r in table]


def data_rows(path):
    """Complete rows after the header, 0 while the file is missing."""
    try:
        return max(len(Path(path).read_bytes().split(b"\n")) - 2, 0)
    except FileNotFoundError:
        return 0


def wait_for(condition, proc, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the command ended before the fault could be injected"
        assert time.monotonic() < end, "timed out waiting for the command"
        time.sleep(0.01)


def descendants(pid):
    """The processes below ``pid`` (from /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid):
    """Alive and not a zombie (a zombie has ended: it only waits to be reaped)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted quick training run."""
    return train.train(QUICK, tmp_path_factory.mktemp("reference"), progress=False)


@pytest.fixture(scope="module")
def regression_csv(tmp_path_factory):
    """The quick regression sweep's results file, run uninterrupted."""
    out = tmp_path_factory.mktemp("regression")
    sweep.run(load("regression"), quick=True, seeds=1, jobs=1, out=out, progress=False)
    return (out / "regression.csv").read_bytes()


def same_run(out, reference):
    assert without_seconds(rows(out / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))
    state = train.load_checkpoint(out / "checkpoint.npz", QUICK)
    assert state.step == QUICK.steps and all(np.array_equal(state.params[k], reference.params[k]) for k in reference.params)


# ----------------------------------------------------------------------------- an output folder that cannot be written


@pytest.mark.parametrize("command, where", [("train", "the folder"), ("experiment", "below it")])
def test_a_read_only_output_folder_is_refused_in_one_line_and_nothing_is_written(site, tmp_path, command, where):
    folder = tmp_path / "read-only"
    folder.mkdir()
    out = folder if where == "the folder" else folder / "run"
    fault = READ_ONLY.format(folder=str(folder)) if os.geteuid() == 0 else None
    if fault is None:
        folder.chmod(0o555)
    try:
        proc = run_cli(site, (TRAIN if command == "train" else REGRESSION) + ["--out", str(out)], fault)
    finally:
        folder.chmod(0o755)
    assert proc.returncode == 2
    where_text = f"{folder}" if out == folder else f"{folder}, where {out} would be created,"
    assert one_line(proc.stderr).endswith(f": --out: {where_text} is not writable (permission denied); pass a folder you can write to")
    assert list(folder.iterdir()) == []


def test_permission_denied_at_a_checkpoint_keeps_the_last_one_and_resume_finishes(site, reference, tmp_path, capsys):
    out = tmp_path / "run"
    proc = run_cli(site, TRAIN + ["--out", str(out)], DENIED_AT.format(suffix="checkpoint.npz.tmp", nth=2))
    assert proc.returncode == 2
    assert one_line(proc.stderr) == (f"python -m app train: cannot write {out / 'checkpoint.npz.tmp'} (Permission denied); "
                                     f"the last checkpoint is {out / 'checkpoint.npz'}: continue with the same options and --resume")
    assert train.load_checkpoint(out / "checkpoint.npz", QUICK).step == 4
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 0
    same_run(out, reference)


# ----------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("nth", [1, 2])
def test_a_disk_that_fills_during_a_checkpoint_ends_in_one_line_and_the_named_command_finishes(site, reference, tmp_path, nth):
    """The first checkpoint (nothing to resume: the run starts again) or the second (the first one stays)."""
    out = tmp_path / "run"
    proc = run_cli(site, TRAIN + ["--out", str(out)], FULL_DISK.format(suffix="checkpoint.npz.tmp", nth=nth, keep=600))
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith(f"python -m app train: cannot write {out / 'checkpoint.npz.tmp'} (No space left on device); ")
    if nth == 1:
        assert line.endswith("no checkpoint was written, so there is nothing to resume: run the same command again, without --resume")
        assert not out.exists()
        assert main(TRAIN + ["--out", str(out)]) == 0
    else:
        assert line.endswith("continue with the same options and --resume")
        assert train.load_checkpoint(out / "checkpoint.npz", QUICK).step == 4
        assert main(TRAIN + ["--out", str(out), "--resume"]) == 0
    same_run(out, reference)


def test_a_disk_that_fills_during_a_sweep_leaves_a_cut_row_that_the_rerun_drops(site, regression_csv, tmp_path):
    out = tmp_path / "sweep"
    header = regression_csv.split(b"\n")[0] + b"\n"
    row = len(regression_csv.split(b"\n")[1]) + 1
    keep = len(header) + row + row // 2  # the header, one row, half of the next
    proc = run_cli(site, REGRESSION + ["--jobs", "1", "--out", str(out)], FULL_DISK.format(suffix="regression.csv", nth=1, keep=keep))
    assert proc.returncode == 2
    result = out / "regression.csv"
    assert one_line(proc.stderr) == (f"python -m app experiment regression: cannot write {result} (No space left on device); "
                                     f"the finished points are in {result}: run the same command again to continue")
    assert not result.read_bytes().endswith(b"\n")  # the cut row
    assert len(sweep.read_results(load("regression"), result)) == 1
    assert main(REGRESSION + ["--jobs", "1", "--out", str(out)]) == 0
    assert result.read_bytes() == regression_csv


# ----------------------------------------------------------------------------- SIGTERM and SIGKILL


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
def test_sigterm_to_a_parallel_sweep_leaves_no_process_and_the_rerun_finishes(site, regression_csv, tmp_path):
    out = tmp_path / "sweep"
    slow = SLOW.format(module="app.experiments.regression", function="run_point", seconds=0.5)
    proc = start_cli(site, REGRESSION + ["--jobs", "2", "--out", str(out)], slow, tmp_path / "output")
    below = []
    try:
        wait_for(lambda: data_rows(out / "regression.csv") >= 1, proc)
        below = descendants(proc.pid)
        assert below, "no worker processes"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(running(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in below if running(p)], "processes left behind"
    finally:
        for p in [proc.pid] * (proc.poll() is None) + [p for p in below if running(p)]:
            os.kill(p, signal.SIGKILL)  # what a failed run left: not left to the next test
    result = out / "regression.csv"
    assert one_line((tmp_path / "output").read_text()) == (
        f"python -m app experiment regression: interrupted; the finished points are in {result}: run the same command "
        "again to continue")
    assert 1 <= len(sweep.read_results(load("regression"), result)) < 4
    assert main(REGRESSION + ["--jobs", "1", "--out", str(out)]) == 0
    assert result.read_bytes() == regression_csv


@pytest.mark.parametrize("when", ["after a checkpoint", "before the first checkpoint"])
def test_sigterm_mid_training_stops_cleanly_and_the_named_command_finishes(site, reference, tmp_path, when):
    out = tmp_path / "run"
    slow = SLOW.format(module="app.model", function="loss_and_grads", seconds=0.15)
    proc = start_cli(site, TRAIN + ["--out", str(out)], slow, tmp_path / "output")
    try:
        rows_wanted = 6 if when == "after a checkpoint" else 1  # checkpoints at 4, 8, 12
        wait_for(lambda: data_rows(out / "log.csv") >= rows_wanted, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    line = one_line((tmp_path / "output").read_text())
    if when == "after a checkpoint":
        assert line == (f"python -m app train: interrupted; the last checkpoint is {out / 'checkpoint.npz'}: continue "
                        "with the same options and --resume")
        assert train.load_checkpoint(out / "checkpoint.npz", QUICK).step in (4, 8)
        assert main(TRAIN + ["--out", str(out), "--resume"]) == 0
    else:
        assert line == ("python -m app train: interrupted; no checkpoint was written, so there is nothing to resume: run "
                        "the same command again, without --resume")
        assert not out.exists()
        assert main(TRAIN + ["--out", str(out)]) == 0
    same_run(out, reference)


def test_sigkill_before_the_first_checkpoint_can_be_restarted_and_resume_says_how(site, reference, tmp_path, capsys):
    out = tmp_path / "run"
    slow = SLOW.format(module="app.model", function="loss_and_grads", seconds=0.15)
    proc = start_cli(site, TRAIN + ["--out", str(out)], slow, tmp_path / "output")
    try:
        wait_for(lambda: data_rows(out / "log.csv") >= 1, proc)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (out / "log.csv").exists() and not (out / "checkpoint.npz").exists()
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    assert one_line(capsys.readouterr().err).endswith("run the same command without --resume to start it again")
    assert main(TRAIN + ["--out", str(out)]) == 0
    same_run(out, reference)
