"""``python -m gpu check``: its dry run in the CUDA simulator writes both result files, and its verdicts are right.

The dry run runs every stage of the check (environment, backends, a subset of
the GPU tests, the sanitizer's workload, ``bench_gpu.py --quick --check``) in
the simulator; its exit status says whether the machinery works.  The unit
tests below check the parts that decide a verdict: the JUnit reading and the
skip counting, the Markdown tables, the checks of the resolved CUDA stacks and
the refusal of a bad ``--out``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_dry_run_exercises_every_stage_and_writes_both_files(tmp_path):
    """One dry run (about 20 s), checked stage by stage: one test, so that pytest-xdist runs it once."""
    out = tmp_path / "out"
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: the machinery works" in proc.stdout
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["dry_run"] is True and result["machinery_ok"] is True
    assert result["passed"] is False, "a dry run never passes the GPU check"

    # what a machine without a GPU gives
    stages = {s["name"]: s for s in result["stages"]}
    assert [s["name"] for s in result["stages"]] == ["environment", "backends", "tests", "workload", "memcheck", "racecheck", "bench"]
    assert stages["environment"]["status"] == "pass"
    assert set(result["environment"]["packages"]) >= {"numpy", "numba", "numba-cuda", "cupy"}
    assert stages["backends"]["status"] == "fail" and "simulator" in stages["backends"]["summary"]
    # the CuPy device tests skip without a GPU: the skip is counted, and fails the tests stage
    tests = stages["tests"]
    assert tests["status"] == "fail" and tests["counts"]["skipped"] >= 1 and tests["counts"]["passed"] >= 1
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0
    assert any(s["id"] == "tests.test_cupy_device" for s in tests["skips"])
    for name in ("memcheck", "racecheck"):
        assert stages[name]["status"] == "not run"
        assert stages[name]["summary"] == "not run: compute-sanitizer not on PATH"
    assert stages["workload"]["status"] == "pass"
    assert (out / "pytest-junit.xml").exists() and (out / "workload.log").exists()

    # the benchmark's rows, in the simulator: measured, none judged
    bench = stages["bench"]
    assert bench["status"] == "pass"
    functions = {(r["backend"], r["function"], r["variant"]) for r in bench["rows"]}
    for variant in ("bidirectional", "causal"):
        assert ("numba-cuda", "gma_forward", variant) in functions
        assert ("numba-cuda", "gma_backward", variant) in functions
    assert ("numba-cuda", "responsibilities", "") in functions
    assert ("numba-cuda", "ovq_attention", "causal") in functions
    judged = [r for r in bench["rows"] if r["target"]]
    assert {r["target_id"] for r in judged} == {"numba-resp-bandwidth", "numba-gma-gemm", "numba-ovq-speedup"}
    assert all(r["met"] is None and r["note"] == "not judged in the simulator" for r in judged)
    assert json.loads((out / "bench-gpu.json").read_text())["rows"] == bench["rows"]

    # the Markdown report
    text = (out / "gpu-check.md").read_text()
    assert "**DRY RUN in the CUDA simulator**" in text
    assert "| stage | status | seconds | summary |" in text
    assert "| memcheck | not run | 0.0 | not run: compute-sanitizer not on PATH |" in text
    header = next(line for line in text.splitlines() if line.startswith("| backend |"))
    for column in ("time (ms)", "bandwidth (GB/s)", "FLOP rate (TFLOP/s)", "roofline", "target", "met"):
        assert f"| {column} |" in header
    rows = [line for line in text.splitlines() if line.startswith("| numba-cuda | gma_forward |")]
    assert len(rows) == 2 and all("not judged in the simulator" in row for row in rows)
    assert "| `tests.test_cupy_device` | skipped (a failure) |" in text


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
       "launches_per_call": None}


def test_the_benchmark_table_has_one_line_per_row_with_every_column():
    plain = dict(ROW, target_id=None, target="", measured=None, met=None, backend="cupy", launches_per_call=7)
    table = check.bench_table([ROW, dict(ROW, met=True, measured=1.5), dict(ROW, met=None, note="n/a below T = 65536"), plain])
    lines = table.splitlines()
    assert len(lines) == 6
    assert lines[2] == ("| numba-cuda | gma_forward | causal | N=1048576 K=256 d_r=d_v=64 | 1.500 | 2000.0 | 20.000 | 50.0% "
                        "| forward / GEMMs <= 2 | 2.50 | **no** |  |")
    assert lines[3].endswith("| forward / GEMMs <= 2 | 1.50 | yes |  |")
    assert lines[4].endswith("| n/a below T = 65536 |  |")
    assert lines[5].endswith("| 50.0% |  |  |  | 7 |")


def test_the_markdown_report_lists_the_stages_and_the_tests_that_did_not_pass():
    skip = {"id": "tests.test_a.test_needs_gpu", "outcome": "skipped", "message": "no CUDA device | here"}
    result = {
        "dry_run": False, "passed": False, "date": "2026-01-01", "command": "python3 -m gpu check --out r",
        "environment": {"gpu": {"name": "NVIDIA H200", "sm_count": 132, "driver_version": "570.1"}, "packages": {"cupy": "not installed"},
                        "cuda_runtime": {}},
        "stages": [{"name": "tests", "status": "fail", "seconds": 1.0, "summary": "1 skipped", "ran": True, "skips": [skip],
                    "failures": [], "no_gpu_only": []},
                   {"name": "bench", "status": "fail", "seconds": 2.0, "summary": "1 target", "rows": [ROW],
                    "checks": ["check: NOT met: forward / GEMMs <= 2"]}],
    }
    text = check.markdown_report(result)
    assert "- GPU verdict: **fail**" in text and "DRY RUN" not in text
    assert "| GPU | NVIDIA H200 |" in text and "| SM count | 132 |" in text and "| cupy | not installed |" in text
    assert "| tests | fail | 1.0 | 1 skipped |" in text
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
    env = check.tests_environment(dict(os.environ))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    backends = {name for name in ("tuned", "toy", "cpu", "numba_cuda", "cupy_host", "cupy") if any(f"[{name}-" in i or f"[{name}]" in i for i in ids)}
    # cupy joins where CuPy can allocate on a device (a GPU); numba_cuda always
    assert "numba_cuda" in backends and backends <= {"numba_cuda", "cupy"}, backends
    assert len(ids) > 100
