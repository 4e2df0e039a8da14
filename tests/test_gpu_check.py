"""``python -m gpu check``: its dry run in the CUDA simulator writes both result files, and its verdicts are right.

The dry run runs every stage of the check (environment, backends, a subset of
the GPU tests, the sanitizer's workload, ``bench_gpu.py --quick --check``) in
the simulator; its exit status says whether the machinery works.  The unit
tests below check the parts that decide a verdict: the JUnit reading and the
skip counting, the Markdown tables, the checks of the resolved CUDA stacks and
the refusal of a bad ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu import check
from gpu.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def _path_without_sanitizer():
    """``PATH`` without the folders that hold ``compute-sanitizer``: the dry run must show the sanitizer-absent path."""
    keep = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "compute-sanitizer").exists()]
    return os.pathsep.join(keep)


def _dry_run(out):
    env = dict(os.environ, PATH=_path_without_sanitizer())
    assert shutil.which("compute-sanitizer", path=env["PATH"]) is None
    return subprocess.run([sys.executable, "-m", "gpu", "check", "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def _cupy_on_a_device():
    """Whether CuPy can allocate on a GPU here (then the CuPy device tests run in the dry run too, and pass)."""
    from gpu.cupy_kernels import _backend

    return _backend.probe()[0]


def test_the_dry_run_exercises_every_stage_and_writes_both_files(tmp_path):
    """One dry run (about 30 s), checked stage by stage: one test, so that pytest-xdist runs it once."""
    out = tmp_path / "out"
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: the machinery works" in proc.stdout
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["dry_run"] is True and result["machinery_ok"] is True and result["complete"] is True
    assert result["passed"] is False, "a dry run never passes the GPU check"
    assert sum(result["stage_limits_s"].values()) <= check.MAX_SHARE * result["budget_s"] + 0.5

    # what a machine without a GPU gives
    stages = {s["name"]: s for s in result["stages"]}
    assert [s["name"] for s in result["stages"]] == ["environment", "backends", "tests", "second opinion", "workload", "memcheck",
                                                     "racecheck", "bench"]
    assert all(s["status"] in check.STATUSES for s in result["stages"])
    assert stages["environment"]["status"] == "passed"
    assert set(result["environment"]["packages"]) >= {"numpy", "numba", "numba-cuda", "cupy"}
    ptx = result["environment"]["ptx"]
    assert ptx["ok"] and ptx["driver"] == check.TARGET_DRIVER and ptx["route"] in ("nvJitLink", "driver JIT"), ptx
    assert "for the GPU machines' driver (CUDA 13.0)" in stages["environment"]["summary"]
    assert stages["backends"]["status"] == "failed" and "simulator" in stages["backends"]["summary"]
    tests = stages["tests"]
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0 and tests["counts"]["passed"] >= 1
    if _cupy_on_a_device():  # a GPU host: the CuPy device tests run, and must pass
        assert not any(s["id"] == "tests.test_cupy_device" for s in tests["skips"])
    else:  # the CuPy device tests skip without a GPU: the skip is counted, and fails the tests stage
        assert tests["status"] == "failed" and tests["counts"]["skipped"] >= 1
        assert any(s["id"] == "tests.test_cupy_device" for s in tests["skips"])
        assert "| `tests.test_cupy_device` | skipped (a failure) |" in (out / "gpu-check.md").read_text()
    # the second opinion runs in every dry run: the plain and the tuned kernels agree with the reference
    opinions = {o["function"]: o for o in stages["second opinion"]["opinions"]}
    assert stages["second opinion"]["status"] == "passed" and set(opinions) == set(check.SECOND_OPINION)
    assert all(o["plain_agrees"] and o["tuned_agrees"] for o in opinions.values())
    for name in ("memcheck", "racecheck"):
        assert stages[name]["status"] == "not run"
        assert stages[name]["summary"] == "not run: compute-sanitizer not on PATH"
    assert stages["workload"]["status"] == "passed"
    assert (out / "pytest-junit.xml").exists() and (out / "workload.log").exists()

    # the benchmark's rows, in the simulator: measured, none judged
    bench = stages["bench"]
    assert bench["status"] == "passed"
    functions = {(r["backend"], r["function"], r["variant"]) for r in bench["rows"]}
    for variant in ("bidirectional", "causal"):
        assert ("numba-cuda", "gma_forward", variant) in functions
        assert ("numba-cuda", "gma_backward", variant) in functions
    assert ("numba-cuda", "responsibilities", "") in functions
    assert ("numba-cuda", "ovq_attention", "causal") in functions
    judged = [r for r in bench["rows"] if r["target"]]
    assert {r["target_id"] for r in judged} == {"numba-resp-roofline", "numba-gma-gemm", "numba-ovq-speedup",
                                                "numba-ovq-speedup-bh32"}
    assert all(r["met"] is None and r["note"] == "not judged in the simulator" for r in judged)
    report = json.loads((out / "bench-gpu.json").read_text())
    assert report["rows"] == bench["rows"] and {v["status"] for v in report["verdicts"].values()} == {"not run"}

    # the Markdown report
    text = (out / "gpu-check.md").read_text()
    assert "**DRY RUN in the CUDA simulator**" in text and "INCOMPLETE" not in text
    assert "| stage | status | seconds | summary |" in text
    assert "| memcheck | not run | 0.0 | not run: compute-sanitizer not on PATH |" in text
    assert "| kernels reach the device |" in text
    header = next(line for line in text.splitlines() if line.startswith("| backend |"))
    for column in ("time (ms)", "bandwidth (GB/s)", "FLOP rate (TFLOP/s)", "bound", "roofline", "target", "met"):
        assert f"| {column} |" in header
    rows = [line for line in text.splitlines() if line.startswith("| numba-cuda | gma_forward |")]
    assert len(rows) == 2 and all("not judged in the simulator" in row for row in rows)


def _start_check(out):
    """A dry run of the check in a process group of its own, the sanitizer off PATH."""
    env = dict(os.environ, PATH=_path_without_sanitizer())
    return subprocess.Popen([sys.executable, "-m", "gpu", "check", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_for_stage(out, name, proc, seconds=120):
    """The check's JSON once stage ``name`` has started and its command's process group is recorded."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the check ended before it was stopped"
        try:
            result = json.loads((out / "gpu-check.json").read_text())  # every read must parse: the files are replaced whole
        except FileNotFoundError:
            result = None
        if result is not None:
            stage = next(s for s in result["stages"] if s["name"] == name)
            if stage.get("process_group"):
                return result, stage["process_group"]
        time.sleep(0.05)
    pytest.fail(f"stage {name} did not start within {seconds} s")


def _group_ends(group, seconds=30):
    """Whether process group ``group`` is gone within ``seconds`` (its killed processes are reaped by init)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _end_group(group):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "terminated"])
def test_a_check_stopped_during_a_stage_leaves_valid_files(tmp_path, how):
    """Stopped during its tests stage (SIGKILL: nothing of it runs on; SIGTERM: an outer time limit), the check leaves
    both files whole, with the stage it finished and the ones it did not."""
    out = tmp_path / "out"
    proc = _start_check(out)
    group = None
    try:
        _, group = _wait_for_stage(out, "tests", proc)
        os.killpg(proc.pid, how)
        assert proc.wait(timeout=60) == (-how if how == signal.SIGKILL else 128 + how)
    finally:
        if proc.poll() is None:
            _end_group(proc.pid)
        if group and how == signal.SIGKILL:
            _end_group(group)  # the stage's pytest, in its own group, outlives a check killed outright
    result = json.loads((out / "gpu-check.json").read_text())
    stages = {s["name"]: s for s in result["stages"]}
    assert result["complete"] is False and list(stages) == check._stage_names(dry_run=True)
    assert stages["environment"]["status"] == "passed" and stages["environment"]["seconds"] > 0
    assert stages["backends"]["status"] == "failed"  # finished: no GPU
    assert stages["tests"]["status"] == "not run"
    if how == signal.SIGKILL:
        assert stages["tests"]["summary"].startswith("started at") and stages["tests"]["process_group"] == group
    else:
        assert stages["tests"]["summary"] == f"stopped by signal {int(how)} during this stage"
        assert _group_ends(group), f"the stage's process group {group} outlived the check stopped by SIGTERM"
        assert not (out / "pytest-junit.xml").exists(), "the stage's pytest ran on to its end"
    later = [stages[n] for n in ("second opinion", "workload", "memcheck", "racecheck", "bench")]
    assert all(s["status"] == "not run" and s["summary"].startswith("not reached") for s in later)
    text = (out / "gpu-check.md").read_text()
    assert text.startswith("# GPU check\n\n**INCOMPLETE**") and "| environment | passed |" in text
    assert not list(out.glob(".*.tmp")), "a half-written file was left behind"


def test_the_stage_limits_are_shares_of_the_budget_that_leave_15_percent():
    for budget in (60, check.BUDGET_S, 900, 3600):
        limits = check.stage_limits(budget)
        assert set(limits) == {"environment", "tests", "second opinion", "memcheck", "racecheck", "bench"}
        assert sum(limits.values()) <= 0.85 * budget + 1e-9 and all(v > 0 for v in limits.values())
    assert check.TIMEOUTS == check.stage_limits(check.BUDGET_S)
    assert abs(sum(check.STAGE_SHARES.values()) - check.MAX_SHARE) < 1e-12 and check.MAX_SHARE <= 0.85


@pytest.mark.parametrize("budget", ["0", "-5", "soon", "inf"])
def test_a_bad_budget_is_refused_in_one_line_with_exit_status_2(tmp_path, capsys, budget):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--out", str(tmp_path / "o"), "--dry-run", "--budget", budget])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget: expected a number of seconds > 0" in err
    assert not (tmp_path / "o").exists()


def test_the_tests_stage_leaves_out_the_tests_that_run_a_check_themselves():
    ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_gpu_check.py"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120).stdout.splitlines()
    for test in check.NOT_IN_TESTS_STAGE:  # each still exists (a renamed one would run inside the tests stage)
        assert any(i == test or i.startswith(test + "[") for i in ids), test


# --- the kernels' route to the device -------------------------------------------------------------------------


@pytest.mark.parametrize("driver, isa, nvvm, nvjitlink, ok, route, words", [
    ("13.0", "9.0", "13.0", "13.0", True, "nvJitLink", "which the driver (CUDA 13.0, PTX ISA 9.0) reads: kernels linked by nvJitLink 13.0"),
    ("13.0", "9.0", "13.0", None, True, "driver JIT", "JIT-compiled by the driver"),
    ("13.0", "9.5", "13.5", "13.5", True, "nvJitLink", "newer than the driver's PTX ISA 9.0 (CUDA 13.0): the kernels link through nvJitLink 13.5"),
    ("12.8", "8.8", "12.9", "12.9", True, "nvJitLink", "newer than the driver's PTX ISA 8.7"),
])
def test_the_route_of_the_kernels_to_the_device_is_named(driver, isa, nvvm, nvjitlink, ok, route, words):
    got = check.ptx_route(driver, isa, nvvm, nvjitlink)
    assert got[:2] == (ok, route) and words in got[2], got


@pytest.mark.parametrize("nvjitlink, found", [(None, "none"), ("13.0", "13.0")])
def test_a_ptx_isa_newer_than_the_driver_without_a_linker_fails_in_one_line_naming_both(nvjitlink, found):
    ok, route, line = check.ptx_route("13.0", "9.5", "13.5", nvjitlink)
    assert not ok and route is None and "\n" not in line
    assert line == ("PTX ISA 9.5 (NVVM 13.5) is newer than the driver's PTX ISA 9.0 (CUDA 13.0), and no nvJitLink of CUDA "
                    f"13.5 or later is there to link it (found: {found}): install nvidia-nvjitlink>=13.5, or an NVVM of CUDA 13.0")


def test_the_ptx_isa_of_each_cuda_release():
    assert check.ptx_isa("13.0") == (9, 0) and check.ptx_isa("13.5") == (9, 5) and check.ptx_isa("12.4") == (8, 4)
    assert check.ptx_isa("12.9") == (8, 8) and check.ptx_isa("11.8") is None and check.ptx_isa(None) is None


# --- the second opinion ---------------------------------------------------------------------------------------


def test_the_second_opinion_takes_the_functions_of_the_failed_tests():
    failed = [{"id": "tests.test_conformance.test_ovq_attention_and_its_state_match_the_reference[numba_cuda-N9]"},
              {"id": "tests.test_gpu_scan.test_tiles"}, {"id": "tests.test_gpu_attention.test_flash_geometry"},
              {"id": "tests.test_gpu_gmm.test_responsibilities_tiles"}, {"id": "tests.test_gpu_scan.test_other"}]
    assert check.second_opinion_functions(failed) == ["ovq_attention", "gma", "softmax_attention", "responsibilities"]
    assert check.second_opinion_functions(failed[:1] + [{"id": "tests.test_gpu_launch.test_grid"}]) == list(check.SECOND_OPINION)
    assert check.second_opinion_functions([]) == []


def test_the_second_opinion_finds_the_tuned_kernel_at_fault(monkeypatch):
    """A tuned kernel broken on purpose: the plain one still agrees, and the verdict blames the tuned one."""
    import gpu.numba_cuda as tuned

    monkeypatch.setattr(tuned, "responsibilities", lambda x, *a, **kw: np.full((x.shape[0], a[0].shape[0]), 0.5))
    (row,) = check.run_second_opinion(["responsibilities"], tiny=True)
    assert row["plain_agrees"] and not row["tuned_agrees"]
    assert row["verdict"] == "the tuned kernel is at fault: the plain one agrees with the reference on this device"
    with pytest.raises(ValueError, match="functions: expected some of"):
        check.run_second_opinion(["nope"], tiny=True)


# --- the JUnit XML and the skip counting ------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_needs_gpu"><skipped type="pytest.skip" message="no CUDA device here">x</skipped></testcase>
<testcase classname="" name="tests.test_b"><skipped message="collection skipped">('/r/tests/test_b.py', 16, 'Skipped: no CUDA device for CuPy: none')</skipped></testcase>
<testcase classname="tests.test_c" name="test_without_gpu"><skipped message="a CUDA device is usable here (H200): the error without one cannot be shown">x</skipped></testcase>
<testcase classname="tests.test_c" name="test_wrong"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_c" name="test_broken"><error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>
"""


def _junit(tmp_path, text=JUNIT):
    path = tmp_path / "junit.xml"
    path.write_text(text)
    return path


def test_read_junit_gives_each_outcome_and_the_reason_of_a_module_skip(tmp_path):
    cases = {c["id"]: c for c in check.read_junit(_junit(tmp_path))}
    assert cases["tests.test_a.test_ok"]["outcome"] == "passed"
    assert cases["tests.test_a.test_needs_gpu"] == {"id": "tests.test_a.test_needs_gpu", "outcome": "skipped",
                                                    "message": "no CUDA device here"}
    assert cases["tests.test_b"]["message"] == "no CUDA device for CuPy: none"
    assert cases["tests.test_c.test_wrong"]["outcome"] == "failed"
    assert cases["tests.test_c.test_broken"]["outcome"] == "error"


def test_every_skip_fails_the_tests_stage_but_one_for_machines_without_a_gpu(tmp_path):
    verdict = check.judge_tests(check.read_junit(_junit(tmp_path)))
    assert not verdict["passed"]
    assert verdict["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 2, "no_gpu_only": 1}
    assert [c["id"] for c in verdict["skips"]] == ["tests.test_a.test_needs_gpu", "tests.test_b"]
    assert [c["id"] for c in verdict["no_gpu_only"]] == ["tests.test_c.test_without_gpu"]
    # the failed and the errored test are both listed, each with its message, for the report's table
    assert [(c["id"], c["outcome"], c["message"]) for c in verdict["failures"]] == [
        ("tests.test_c.test_wrong", "failed", "assert 1 == 2"), ("tests.test_c.test_broken", "error", "fixture failed")]


def test_an_errored_test_alone_fails_the_tests_stage_and_is_listed(tmp_path):
    cases = [c for c in check.read_junit(_junit(tmp_path)) if c["outcome"] in ("passed", "error")]
    verdict = check.judge_tests(cases)
    assert not verdict["passed"]
    assert verdict["counts"] == {"passed": 1, "failed": 0, "error": 1, "skipped": 0, "no_gpu_only": 0}
    assert [c["id"] for c in verdict["failures"]] == ["tests.test_c.test_broken"]
    assert "1 errors" in verdict["summary"]


def test_one_skip_alone_fails_the_tests_stage(tmp_path):
    one_skip = JUNIT.split("<testcase")[0] + "".join("<testcase" + c for c in JUNIT.split("<testcase")[1:3]) + "</testsuite></testsuites>"
    verdict = check.judge_tests(check.read_junit(_junit(tmp_path, one_skip)))
    assert verdict["counts"]["passed"] == 1 and verdict["counts"]["skipped"] == 1
    assert not verdict["passed"]
    assert check._self_test_skip_counting(tmp_path)


def test_only_passes_and_expected_skips_pass_the_tests_stage(tmp_path):
    cases = [{"id": "a", "outcome": "passed", "message": ""},
             {"id": "b", "outcome": "skipped", "message": "the simulator's shared arrays: only without a GPU"},
             {"id": "c", "outcome": "skipped", "message": "cupy runs here: gpu.cupy_kernels runs on the device H200"}]
    verdict = check.judge_tests(cases)
    assert verdict["passed"] and verdict["counts"]["no_gpu_only"] == 2
    assert not check.judge_tests([])["passed"], "no test at all is not a pass"


def test_a_file_that_is_not_junit_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not JUnit XML"):
        check.read_junit(_junit(tmp_path, "<html></html>"))
    with pytest.raises(ValueError, match="cannot read"):
        check.read_junit(tmp_path / "missing.xml")


# --- the tables ---------------------------------------------------------------------------------------------------

ROW = {"backend": "numba-cuda", "function": "gma_forward", "variant": "causal", "size": "N=1048576 K=256 d_r=d_v=64",
       "time_s": 1.5e-3, "bytes": 3e9, "flops": 3e10, "bandwidth_Bps": 2e12, "flop_rate": 2e13, "roofline_fraction": 0.5,
       "target_id": "numba-gma-gemm", "target": "forward / GEMMs <= 2", "measured": 2.5, "met": False, "note": "",
       "launches_per_call": None, "bound": "compute", "roofline_s": 7.5e-4}


def test_the_benchmark_table_has_one_line_per_row_with_every_column():
    plain = dict(ROW, target_id=None, target="", measured=None, met=None, backend="cupy", launches_per_call=7)
    table = check.bench_table([ROW, dict(ROW, met=True, measured=1.5), dict(ROW, met=None, note="n/a below T = 65536"), plain])
    lines = table.splitlines()
    assert len(lines) == 6
    assert lines[2] == ("| numba-cuda | gma_forward | causal | N=1048576 K=256 d_r=d_v=64 | 1.500 | 2000.0 | 20.000 | compute | 50.0% "
                        "| forward / GEMMs <= 2 | 2.50 | **no** |  |")
    assert lines[3].endswith("| forward / GEMMs <= 2 | 1.50 | yes |  |")
    assert lines[4].endswith("| n/a below T = 65536 |  |")
    assert lines[5].endswith("| compute | 50.0% |  |  |  | 7 |")


def test_the_markdown_report_lists_the_stages_and_the_tests_that_did_not_pass():
    skip = {"id": "tests.test_a.test_needs_gpu", "outcome": "skipped", "message": "no CUDA device | here"}
    result = {
        "dry_run": False, "passed": False, "date": "2026-01-01", "command": "python3 -m gpu check --out r",
        "environment": {"gpu": {"name": "NVIDIA H200", "sm_count": 132, "driver_version": "570.1"}, "packages": {"cupy": "not installed"},
                        "cuda_runtime": {}},
        "stages": [{"name": "tests", "status": "failed", "seconds": 1.0, "summary": "1 skipped", "ran": True, "skips": [skip],
                    "failures": [], "no_gpu_only": []},
                   {"name": "bench", "status": "failed", "seconds": 2.0, "summary": "1 target", "rows": [ROW],
                    "checks": ["check: NOT met: forward / GEMMs <= 2"]}],
    }
    text = check.markdown_report(result)
    assert "- GPU verdict: **fail**" in text and "DRY RUN" not in text
    assert "| GPU | NVIDIA H200 |" in text and "| SM count | 132 |" in text and "| cupy | not installed |" in text
    assert "| tests | failed | 1.0 | 1 skipped |" in text
    assert "| `tests.test_a.test_needs_gpu` | skipped (a failure) | no CUDA device / here |" in text
    assert "## Benchmarks" in text and "- check: NOT met: forward / GEMMs <= 2" in text


# --- the resolved CUDA stacks -------------------------------------------------------------------------------------

GOOD = {"numba-cuda": "0.30.4", "cuda-bindings": "12.9.10", "cupy-cuda12x": "14.2.0", "nvidia-cuda-nvrtc-cu12": "12.9.86",
        "nvidia-cuda-nvcc-cu12": "12.9.86", "numpy": "2.4.6"}


def test_a_resolved_cuda12_stack_of_one_major_has_no_problem():
    assert check._resolved_problems("cuda12", GOOD) == []


@pytest.mark.parametrize("change, problem", [
    ({"cuda-bindings": "13.5.0"}, "cuda-bindings 13.5.0 is not CUDA 12"),
    ({"cupy-cuda13x": "14.2.0"}, "cupy-cuda13x is resolved too"),
    ({"nvidia-nvvm": "13.5.37"}, "nvidia-nvvm belongs to the other CUDA major"),
])
def test_a_resolved_stack_that_mixes_majors_is_flagged(change, problem):
    assert check._resolved_problems("cuda12", dict(GOOD, **change)) == [problem]


def test_a_resolved_stack_without_cupy_is_flagged():
    stack = {k: v for k, v in GOOD.items() if k != "cupy-cuda12x"}
    assert check._resolved_problems("cuda12", stack) == ["cupy-cuda12x is missing"]
    assert "nvidia-cuda-nvrtc-cu12 belongs to the other CUDA major" in check._resolved_problems("cuda13", GOOD)


# --- the command line ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_out, message", [
    (lambda tmp: "", "--out: expected a folder, got an empty path"),
    (lambda tmp: tmp / "file.txt", "is a file, not a folder"),
    (lambda tmp: tmp / "file.txt" / "below", "lies below"),
])
def test_a_bad_out_is_refused_in_one_line_with_exit_status_2(tmp_path, capsys, make_out, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["check", "--out", str(make_out(tmp_path)), "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m gpu check: error: ") and message in err
    assert not (tmp_path / "file.txt" / "below").exists()


def test_a_bad_out_is_refused_where_refimpl_cannot_be_imported(tmp_path, monkeypatch):
    """A Python without refimpl's dependencies still gets the same one-line refusal (the check reads refimpl/validation.py)."""
    monkeypatch.setitem(sys.modules, "refimpl.validation", None)  # `from refimpl.validation import ...` raises ImportError
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match=r"--out: .*file\.txt is a file, not a folder"):
        check.run_check(tmp_path / "file.txt", dry_run=True)


def test_a_stage_past_its_timeout_is_ended_with_every_process_it_started(tmp_path):
    import time

    pidfile = tmp_path / "pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "open(sys.argv[1], 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    code, output, seconds = check._run([sys.executable, "-c", script, str(pidfile)], None, 2, tmp_path / "stage.log")
    assert code is None and "[timed out after 2 s]" in output and seconds < 30
    assert (tmp_path / "stage.log").read_text() == output
    pid = int(pidfile.read_text())
    for _ in range(50):  # the grandchild is gone once init has reaped it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid}, started by the stage, survived its timeout")


def test_the_tests_stage_runs_the_conformance_suite_for_the_gpu_backends_only():
    """On a GPU the tests stage holds both GPU backends to the reference at every size; the host backends stay in make test."""
    assert "tests/test_conformance.py" in check._test_files(dry_run=False)
    assert "tests/test_conformance.py" not in check._test_files(dry_run=True)
    # the static gates need no GPU: make test and make gpu-rehearsal run them, the tests stage does not
    assert all((ROOT / f).is_file() and f not in check._test_files(dry_run=False) for f in check.STATIC_TESTS)
    assert "tests/test_gpu_gmm.py" in check._test_files(dry_run=False)
    env = check.tests_environment(dict(os.environ))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    backends = {name for name in ("tuned", "toy", "cpu", "numba_cuda", "cupy_host", "cupy") if any(f"[{name}-" in i or f"[{name}]" in i for i in ids)}
    # cupy joins where CuPy can allocate on a device (a GPU); numba_cuda always
    assert "numba_cuda" in backends and backends <= {"numba_cuda", "cupy"}, backends
    assert len(ids) > 100
