"""One command that validates both GPU backends on a GPU and writes the numbers: ``python -m gpu check --out DIR``.

``make gpu-check`` runs it (``PYTHONPATH=. $(PYTHON) -m gpu check``) with the
Python it is given, with no virtual environment and no pip, so that it works
on a GPU machine that reaches no package registry: that Python needs numpy,
scipy, threadpoolctl, pytest, hypothesis, numba, numba-cuda and cupy (the
``[cuda12]`` or ``[cuda13]`` extra brings the last three).

Stages
------
Each stage runs in its own process, with a timeout, so that a hung driver
or a crashed kernel ends that stage and not the check:

1. **environment**: the GPU's name, SM count and compute capability, the
   driver's version and the CUDA version it supports, the CUDA runtime
   versions numba-cuda and CuPy load, and the versions of numpy, numba,
   numba-cuda, cupy, cuda-bindings, pytest, pytest-xdist, hypothesis and
   torch ("not installed" for the missing ones).
2. **backends**: :func:`gpu.backend_status`; fails unless both backends run
   on a GPU (the CUDA simulator does not count).
3. **tests**: pytest over ``tests/test_gpu_*.py`` and ``tests/test_cupy_*.py``
   with ``NUMBA_ENABLE_CUDASIM=0`` (the suite's ``conftest.py`` would
   otherwise fall back to the simulator where the driver sees no device).
   pytest's JUnit XML is read back: every failure and error fails the
   stage, and so does every skip, because a skipped GPU test is a test that
   did not run on the GPU.  The one exception is a test that exists only for
   machines without a GPU (it shows the error a missing device gives, or the
   simulator's own rules) and skips where there is one: its reason matches
   :data:`NO_GPU_ONLY`, and it is listed as such.
4. **sanitizer**: where ``compute-sanitizer`` is on ``PATH``, its
   ``memcheck`` and ``racecheck`` tools over ``python -m gpu workload`` (every
   public function of both backends once, at small sizes); where it is not,
   the stage records ``not run: compute-sanitizer not on PATH`` (not a
   failure).
5. **bench**: ``benchmarks/bench_gpu.py --check --json FILE --repeats 3``
   at its full sizes (the best of three runs after a warm-up, to fit the
   budget): its rows (time, effective bandwidth, FLOP rate, fraction of the
   roofline, target, met per function and size) and its verdict; a target
   not met, or not judged, fails the stage.

The results go to ``DIR/gpu-check.json`` and ``DIR/gpu-check.md``, beside
each stage's log, pytest's ``pytest-junit.xml`` and the benchmark's
``bench-gpu.json``.  The exit status is 0 when every stage passed, 1 when
one failed (a backend cannot run, a test failed or skipped, a sanitizer
found an error, a target was not met), 2 for a bad argument.

Budget: at most 8 minutes on one H200 (:data:`BUDGET_S`): each stage has a
timeout (:data:`TIMEOUTS`: environment 20 s, tests 180 s, memcheck and
racecheck 75 s each, as the workload compiles its kernels under the
sanitizer, bench 130 s), and none runs past what is left of the whole
budget.

The dry run
-----------
``python -m gpu check --dry-run --out DIR`` runs the same stages in the CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1`` in every stage's environment), at tiny
sizes: a small subset of the tests (:data:`DRY_RUN_TESTS`), the workload in
the simulator without a sanitizer, and ``bench_gpu.py --quick``.  The GPU
verdicts come out as they must without a GPU (the backends stage fails, the
CuPy device tests skip and are counted as failures) and are reported as
such.  The dry run's own exit status says whether the machinery works: 0
when every stage ran to completion within its timeout and its output was
read back (the environment's report, a JUnit file with at least one test,
the benchmark's rows), the tests had no failure or error, the workload ran,
the benchmark exited 0, a JUnit file with one skipped test (written by the
check itself) is judged a failure, and both result files were written and
read back; 1 otherwise.  ``make test`` runs it (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = [
    "BUDGET_S",
    "TIMEOUTS",
    "GPU_TESTS",
    "CONFORMANCE_BACKENDS",
    "DRY_RUN_TESTS",
    "NO_GPU_ONLY",
    "run_check",
    "read_junit",
    "judge_tests",
    "markdown_report",
    "run_workload",
    "resolve_extras",
]

ROOT = Path(__file__).resolve().parents[1]

#: The whole check's budget in seconds: 8 minutes on one H200.
BUDGET_S = 480
#: Each stage's timeout in seconds (a stage never runs past what is left of :data:`BUDGET_S`).
TIMEOUTS = {"environment": 20, "tests": 180, "memcheck": 75, "racecheck": 75, "bench": 130}
#: The GPU test files, as globs under the project root; the conformance suite runs its GPU backends' cases only
#: (:data:`CONFORMANCE_BACKENDS`: ``make test`` holds the others to the reference).
GPU_TESTS = ("tests/test_gpu_*.py", "tests/test_cupy_*.py", "tests/test_conformance.py")
#: The backends of ``tests/test_conformance.py`` that the tests stage runs: the two GPU ones, on the device.
CONFORMANCE_BACKENDS = "numba_cuda,cupy"
#: The dry run's tests: the status of both backends, and the CuPy device tests (which skip without a GPU).
DRY_RUN_TESTS = ("tests/test_gpu_status.py", "tests/test_cupy_device.py")
#: Skip reasons of tests that exist only for machines without a GPU: on a GPU such a skip is expected, not a failure.
NO_GPU_ONLY = (
    r"only without a GPU",
    r"a CUDA device is usable here",
    r"^cupy runs here",
)
#: The packages whose versions the environment stage reports: ``{name shown: distribution names}``.
PACKAGES = {
    "numpy": ("numpy",),
    "numba": ("numba",),
    "numba-cuda": ("numba-cuda",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "cuda-bindings": ("cuda-bindings",),
    "pytest": ("pytest",),
    "pytest-xdist": ("pytest-xdist",),
    "hypothesis": ("hypothesis",),
    "torch": ("torch",),
}


# ---------------------------------------------------------------------------
# The output folder
# ---------------------------------------------------------------------------


def _check_out_folder(out):
    """:func:`refimpl.validation.check_out_folder`, read from its file if :mod:`refimpl` itself cannot be imported here."""
    try:
        from refimpl.validation import check_out_folder
    except ImportError:  # a Python without refimpl's dependencies but NumPy: the environment stage will say which
        found = importlib.util.spec_from_file_location("_refimpl_validation", ROOT / "refimpl" / "validation.py")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        check_out_folder = module.check_out_folder
    return check_out_folder(out, "--out")


# ---------------------------------------------------------------------------
# Running a stage
# ---------------------------------------------------------------------------


class _Clock:
    """What is left of the budget."""

    def __init__(self, budget):
        self.start, self.budget = time.monotonic(), budget

    def timeout(self, stage):
        return max(1.0, min(TIMEOUTS[stage], self.budget - (time.monotonic() - self.start)))


def _run(cmd, env, timeout, log):
    """Run ``cmd`` in the project root; ``(exit code or None on timeout, output, seconds)``, the output also in ``log``.

    The command runs in its own process group, so that a timeout ends its
    whole process group (pytest's workers, the program under the sanitizer),
    not only the command.
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as err:
        output = f"cannot run {cmd[0]}: {err}\n"
        log.write_text(output)
        return 127, output, time.monotonic() - start
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        code, output = None, (output or "") + f"\n[timed out after {timeout:.0f} s]\n"
    log.write_text(output)
    return code, output, time.monotonic() - start


def _stage(name, status, summary, seconds=0.0, **details):
    return {"name": name, "status": status, "summary": summary, "seconds": round(seconds, 1), **details}


def _tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------
# 1-2. Environment and backends
# ---------------------------------------------------------------------------

_PROBE = r"""
import ctypes, ctypes.util, importlib.metadata as md, json, os, platform, shutil, subprocess, sys
packages = json.loads(sys.argv[1])
report = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(), "packages": {}}
for shown, names in packages.items():
    for name in names:
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            continue
        report["packages"][shown] = version if name == shown else f"{version} ({name})"
        break
    else:
        report["packages"][shown] = "not installed"
gpu_info = {}
lib = None
for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
    if name:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            pass
if lib is None:
    gpu_info["driver"] = "no CUDA driver (libcuda not found)"
elif lib.cuInit(0) != 0:
    gpu_info["driver"] = "the CUDA driver failed to initialise (cuInit)"
else:
    v, n = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(v))
    lib.cuDeviceGetCount(ctypes.byref(n))
    gpu_info["cuda_driver_api"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    gpu_info["device_count"] = n.value
    if n.value:
        dev, buf, val = ctypes.c_int(0), ctypes.create_string_buffer(256), ctypes.c_int(0)
        lib.cuDeviceGet(ctypes.byref(dev), 0)
        lib.cuDeviceGetName(buf, 256, dev)
        gpu_info["name"] = buf.value.decode(errors="replace")
        attr = {}
        for key, code in (("sm_count", 16), ("cc_major", 75), ("cc_minor", 76)):
            lib.cuDeviceGetAttribute(ctypes.byref(val), code, dev)
            attr[key] = val.value
        gpu_info["sm_count"] = attr["sm_count"]
        gpu_info["compute_capability"] = f"{attr['cc_major']}.{attr['cc_minor']}"
        mem = ctypes.c_size_t(0)
        if lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev) == 0:
            gpu_info["memory_GiB"] = round(mem.value / 2**30, 1)
if shutil.which("nvidia-smi"):
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
        if out:
            gpu_info["driver_version"] = out[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
if "driver_version" not in gpu_info and os.path.exists("/proc/driver/nvidia/version"):
    words = open("/proc/driver/nvidia/version").read().split()
    gpu_info["driver_version"] = next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), "unknown")
report["gpu"] = gpu_info
runtime = {}
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    runtime["numba-cuda"] = "CUDA simulator (no runtime)"
else:
    try:
        from numba import cuda
        runtime["numba-cuda"] = ".".join(map(str, cuda.runtime.get_version()))
    except Exception as e:
        runtime["numba-cuda"] = f"unavailable ({type(e).__name__}: {e})"
try:
    import cupy
    v = cupy.cuda.runtime.runtimeGetVersion()
    runtime["cupy"] = f"{v // 1000}.{v % 1000 // 10}"
except Exception as e:
    runtime["cupy"] = f"unavailable ({type(e).__name__}: {e})"
report["cuda_runtime"] = runtime
import gpu
try:
    report["backends"] = {b: list(s) for b, s in gpu.backend_status().items()}
except Exception as e:  # a Python without numpy, say
    report["backends"] = {b: [False, f"gpu.backend_status() failed ({type(e).__name__}: {e})"] for b in gpu.BACKENDS}
print("PROBE " + json.dumps(report))
"""


def _environment(python, env, clock, out):
    code, output, seconds = _run([python, "-c", _PROBE, json.dumps(PACKAGES)], env, clock.timeout("environment"),
                                 out / "environment.log")
    line = next((x for x in output.splitlines() if x.startswith("PROBE ")), None)
    if code != 0 or line is None:
        why = "timed out" if code is None else f"exit {code}"
        return _stage("environment", "fail", f"the probe failed ({why}): {_tail(output, 3)}", seconds), None
    report = json.loads(line[len("PROBE "):])
    g = report["gpu"]
    summary = (f"{g['name']}, {g['sm_count']} SMs, driver {g.get('driver_version', 'unknown')} (CUDA {g['cuda_driver_api']})"
               if "name" in g else g.get("driver", "no CUDA device"))
    return _stage("environment", "pass", summary, seconds), report


def _backends(report, dry_run):
    if report is None:
        return _stage("backends", "fail", "not probed: the environment stage failed")
    problems = []
    for backend, (usable, why) in report["backends"].items():
        if not usable:
            problems.append(f"{backend}: {why}")
        elif "simulator" in why:
            problems.append(f"{backend} runs only in the CUDA simulator: {why}")
    if problems:
        expected = " (expected in a dry run: there is no GPU)" if dry_run else ""
        return _stage("backends", "fail", "a backend cannot run on a GPU" + expected + ": " + "; ".join(problems))
    return _stage("backends", "pass", "; ".join(why for _, why in report["backends"].values()))


# ---------------------------------------------------------------------------
# 3. Tests: pytest's JUnit XML, every skip a failure
# ---------------------------------------------------------------------------


def read_junit(path):
    """The test cases of a pytest JUnit XML file: a list of ``{"id", "outcome", "message"}``.

    ``outcome`` is ``"passed"``, ``"failed"``, ``"error"`` or ``"skipped"``;
    a module skipped as a whole (``pytest.skip(..., allow_module_level=True)``)
    is one skipped case whose message is its reason.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    list of dict

    Raises
    ------
    ValueError
        The file cannot be read or is not JUnit XML.
    """
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as err:
        raise ValueError(f"junit: cannot read {path} ({err})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"junit: {path} is not JUnit XML (its root is <{root.tag}>)")
    cases = []
    for case in root.iter("testcase"):
        name = ".".join(x for x in (case.get("classname"), case.get("name")) if x)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message") or ""
                if child.tag == "skipped" and message == "collection skipped":  # a module-level skip: the reason is the text
                    found = re.search(r"Skipped: (.*?)['\"]\)\s*$", child.text or "", re.S)
                    message = found.group(1) if found else (child.text or message).strip()
                break
        cases.append({"id": name, "outcome": outcome, "message": message})
    return cases


def judge_tests(cases):
    """The tests stage's verdict from :func:`read_junit`'s cases: every failure, error and skip fails it.

    A skip whose reason matches :data:`NO_GPU_ONLY` (a test that exists only
    for machines without a GPU) is listed apart and does not fail it.  No
    test at all fails it too.

    Parameters
    ----------
    cases : list of dict

    Returns
    -------
    dict
        ``passed`` (bool), ``counts`` (per outcome, plus ``no_gpu_only``),
        ``skips`` and ``failures`` (the cases that fail the stage, with their
        messages), ``no_gpu_only`` (the expected skips) and ``summary``.
    """
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "no_gpu_only")}
    skips, failures, expected = [], [], []
    for case in cases:
        if case["outcome"] == "skipped" and any(re.search(p, case["message"]) for p in NO_GPU_ONLY):
            counts["no_gpu_only"] += 1
            expected.append(case)
            continue
        counts[case["outcome"]] += 1
        if case["outcome"] == "skipped":
            skips.append(case)
        elif case["outcome"] in ("failed", "error"):
            failures.append(case)
    passed = bool(cases) and not skips and not failures
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
               f"{counts['skipped']} skipped (each a failure), {counts['no_gpu_only']} skipped as tests for machines without a GPU")
    if not cases:
        summary = "no test ran"
    return {"passed": passed, "counts": counts, "skips": skips, "failures": failures, "no_gpu_only": expected, "summary": summary}


def _test_files(dry_run):
    if dry_run:
        return list(DRY_RUN_TESTS)
    return sorted(str(p.relative_to(ROOT)) for pattern in GPU_TESTS for p in ROOT.glob(pattern))


def tests_environment(env):
    """The tests stage's environment: ``env`` with the conformance suite kept to the GPU backends."""
    return {**env, "CONFORMANCE_BACKENDS": CONFORMANCE_BACKENDS}


def _tests(python, env, clock, out, dry_run, xdist):
    junit = out / "pytest-junit.xml"
    if junit.exists():
        junit.unlink()
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={junit}"]
    if not dry_run and xdist:
        cmd += ["-n", "4"]  # the compile tests are CPU-bound; four processes share the GPU
    cmd += _test_files(dry_run)
    code, output, seconds = _run(cmd, tests_environment(env), clock.timeout("tests"), out / "tests.log")
    if code is None:
        return _stage("tests", "fail", f"pytest timed out after {seconds:.0f} s: {_tail(output, 3)}", seconds, ran=False)
    try:
        verdict = judge_tests(read_junit(junit))
    except ValueError as err:
        return _stage("tests", "fail", f"pytest wrote no readable JUnit XML (exit {code}): {err}; {_tail(output, 3)}",
                      seconds, ran=False)
    status = "pass" if verdict["passed"] and code == 0 else "fail"
    return _stage("tests", status, verdict["summary"], seconds, ran=True, pytest_exit=code, files=_test_files(dry_run),
                  **{k: verdict[k] for k in ("counts", "skips", "failures", "no_gpu_only")})


_FAKE_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="2">
<testcase classname="tests.test_fake" name="test_runs" time="0.001"/>
<testcase classname="tests.test_fake" name="test_needs_a_gpu" time="0.000">
<skipped type="pytest.skip" message="no CUDA device">tests/test_fake.py:3: no CUDA device</skipped></testcase>
</testsuite></testsuites>
"""


def _self_test_skip_counting(folder):
    """The dry run's check of the skip counting: a JUnit file with one skipped test must fail the tests stage."""
    path = Path(folder) / "fake-junit.xml"
    path.write_text(_FAKE_JUNIT)
    verdict = judge_tests(read_junit(path))
    path.unlink()
    return (not verdict["passed"]) and verdict["counts"]["skipped"] == 1 and verdict["counts"]["passed"] == 1


# ---------------------------------------------------------------------------
# 4. compute-sanitizer over a small workload
# ---------------------------------------------------------------------------


def run_workload(backends=("numba-cuda", "cupy"), tiny=False):
    """Call every public function of each backend once, at small sizes (what the sanitizer watches).

    Parameters
    ----------
    backends : sequence of {'numba-cuda', 'cupy'}
    tiny : bool, default False
        Sizes for the CUDA simulator (a few tokens) instead of sizes that are
        not multiples of any tile or chunk.

    Returns
    -------
    list of str
        The calls made, in order.

    Raises
    ------
    RuntimeError
        A backend cannot run here (from :func:`gpu.require`).
    """
    import numpy as np

    import gpu

    N, K, d, T, n_max, C = (6, 3, 4, 6, 3, 4) if tiny else (300, 5, 16, 200, 8, 32)
    rng = np.random.default_rng(0)
    f32 = np.float32
    x, xk, mu = (rng.standard_normal(s).astype(f32) for s in ((N, d), (N, d), (K, d)))
    v, g = (rng.standard_normal((N, d)).astype(f32) for _ in range(2))
    var = (0.5 + rng.random((K, d))).astype(f32)
    w = np.full(K, 1 / K, dtype=f32)
    q, k, vt = (rng.standard_normal((T, d)).astype(f32) for _ in range(3))
    done = []
    for backend in backends:
        gpu.require(backend)
        if backend == "numba-cuda":
            import gpu.numba_cuda as m
        else:
            import gpu.cupy_kernels as m
        m.log_responsibilities(x, mu, var, w)
        m.responsibilities(x, mu, var, w)
        for causal in (False, True):
            m.gma(x, xk, v, mu, var, w, causal=causal)
            out, cache = m.gma_forward(x, xk, v, mu, np.zeros_like(mu), np.zeros_like(w), causal=causal)
            m.gma_backward(g, cache)
            m.softmax_attention(q, k, vt, causal=causal)
        m.ovq_attention(q, k, vt, max_size=n_max, chunk_size=C)
        m.vq_attention(q, k, vt, mu, chunk_size=C)
        done.append(f"{backend}: log_responsibilities, responsibilities, gma, gma_forward, gma_backward and "
                    "softmax_attention (bidirectional and causal), ovq_attention, vq_attention")
    return done


_SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")


def _sanitizer(python, env, clock, out, dry_run):
    stages = []
    tool = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if dry_run:
        # the simulator runs no device code: run the workload itself, so that its script is checked
        cmd = [python, "-m", "gpu", "workload", "--tiny", "--backend", "numba-cuda"]
        code, output, seconds = _run(cmd, env, clock.timeout("memcheck"), out / "workload.log")
        stages.append(_stage("workload", "pass" if code == 0 else "fail",
                             f"the sanitizer's workload in the simulator: exit {code}; {_tail(output, 1)}", seconds))
    if tool is None or dry_run:
        why = "compute-sanitizer not on PATH" if tool is None else "a dry run (the simulator runs no device code)"
        return stages + [_stage(name, "not run", f"not run: {why}") for name in ("memcheck", "racecheck")]
    for name in ("memcheck", "racecheck"):
        cmd = [tool, "--tool", name, "--error-exitcode", "3", "--target-processes", "all", python, "-m", "gpu", "workload"]
        code, output, seconds = _run(cmd, env, clock.timeout(name), out / f"{name}.log")
        found = _SUMMARY.findall(output)
        summary = found[-1] if found else "no summary line"
        if code is None:
            stages.append(_stage(name, "fail", f"timed out after {seconds:.0f} s; {summary}", seconds))
        else:
            stages.append(_stage(name, "pass" if code == 0 else "fail", f"exit {code}; {summary}", seconds))
    return stages


# ---------------------------------------------------------------------------
# 5. The benchmark
# ---------------------------------------------------------------------------


def _bench(python, env, clock, out, dry_run):
    path = out / "bench-gpu.json"
    if path.exists():
        path.unlink()
    cmd = [python, "benchmarks/bench_gpu.py", "--check", "--json", str(path), "--repeats", "3"] + (["--quick"] if dry_run else [])
    code, output, seconds = _run(cmd, env, clock.timeout("bench"), out / "bench.log")
    try:
        report = json.loads(path.read_text())
        rows = report["rows"]
    except (OSError, ValueError, KeyError):
        report, rows = None, []
    checks = [line for line in output.splitlines() if line.startswith("check: ")]
    if code is None:
        return _stage("bench", "fail", f"timed out after {seconds:.0f} s", seconds, rows=rows, checks=checks), report
    if report is None or not rows:
        return _stage("bench", "fail", f"no rows written (exit {code}): {_tail(output, 3)}", seconds, rows=[], checks=checks), None
    if code == 1:
        failed = [c for c in checks if "NOT" in c]
        return _stage("bench", "fail", f"{len(failed)} target(s) not met or not judged", seconds, rows=rows, checks=checks), report
    if code != 0:
        return _stage("bench", "fail", f"exit {code}: {_tail(output, 3)}", seconds, rows=rows, checks=checks), report
    return _stage("bench", "pass", f"{len(rows)} rows; " + (checks[-1] if dry_run and checks else "every target met"),
                  seconds, rows=rows, checks=checks), report


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


def _num(value, scale, digits, suffix=""):
    return "n/a" if value is None else f"{value / scale:.{digits}f}{suffix}"


def bench_table(rows):
    """The benchmark's rows as a Markdown table: per function and size, time, bandwidth, FLOP rate, roofline, target, met.

    Parameters
    ----------
    rows : list of dict
        The rows of ``bench_gpu.py --json``.

    Returns
    -------
    str
    """
    lines = [
        "| backend | function | variant | size | time (ms) | bandwidth (GB/s) | FLOP rate (TFLOP/s) | roofline | target | measured | met | launches per call |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        if r.get("target"):
            met = {True: "yes", False: "**no**"}.get(r["met"]) or r.get("note") or "not judged"
        else:
            met = ""
        launches = "" if r.get("launches_per_call") is None else str(r["launches_per_call"])
        lines.append(
            f"| {r['backend']} | {r['function']} | {r['variant']} | {r['size']} | {_num(r['time_s'], 1e-3, 3)} "
            f"| {_num(r['bandwidth_Bps'], 1e9, 1)} | {_num(r['flop_rate'], 1e12, 3)} | {_num(r['roofline_fraction'], 0.01, 1, '%')} "
            f"| {r.get('target', '')} | {'' if not r.get('target') else _num(r.get('measured'), 1, 2)} | {met} | {launches} |"
        )
    return "\n".join(lines)


def markdown_report(result):
    """``gpu-check.md``: the verdict, the device and software, each stage, the tests that did not pass, the benchmark table.

    Parameters
    ----------
    result : dict
        What :func:`run_check` writes to ``gpu-check.json``.

    Returns
    -------
    str
    """
    lines = ["# GPU check", ""]
    if result["dry_run"]:
        lines += ["**DRY RUN in the CUDA simulator**: no GPU was used; every time below is the simulator's, not GPU speed, "
                  "and must not be reported as a measurement.", ""]
        lines += [f"- machinery: {'works' if result['machinery_ok'] else '**broken**'} ({result['machinery_summary']})"]
    verdict = "**pass**" if result["passed"] else ("**fail** (no GPU in a dry run)" if result["dry_run"] else "**fail**")
    lines += [f"- GPU verdict: {verdict}",
              f"- date: {result['date']}", f"- command: `{result['command']}`", ""]
    env = result.get("environment") or {}
    gpu_info, runtime, packages = env.get("gpu", {}), env.get("cuda_runtime", {}), env.get("packages", {})
    lines += ["## Device and software", "", "| item | value |", "| --- | --- |"]
    items = [("GPU", gpu_info.get("name", gpu_info.get("driver", "none"))), ("SM count", gpu_info.get("sm_count", "n/a")),
             ("compute capability", gpu_info.get("compute_capability", "n/a")),
             ("memory (GiB)", gpu_info.get("memory_GiB", "n/a")),
             ("driver", gpu_info.get("driver_version", "n/a")), ("CUDA (driver)", gpu_info.get("cuda_driver_api", "n/a"))]
    items += [(f"CUDA runtime ({k})", v) for k, v in runtime.items()]
    items += [("Python", f"{env.get('python', 'n/a')} ({env.get('executable', '')})")]
    items += list(packages.items())
    lines += [f"| {k} | {v} |" for k, v in items]
    lines += ["", "## Stages", "", "| stage | status | seconds | summary |", "| --- | --- | ---: | --- |"]
    for s in result["stages"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['summary'].replace('|', '/')} |")
    tests = next((s for s in result["stages"] if s["name"] == "tests"), None)
    if tests and tests.get("ran"):
        bad = [("skipped (a failure)", c) for c in tests["skips"]] + [(c["outcome"], c) for c in tests["failures"]]
        if bad or tests["no_gpu_only"]:
            lines += ["", "## Tests that did not pass", "", "| test | outcome | message |", "| --- | --- | --- |"]
            bad += [("skipped: only for machines without a GPU", c) for c in tests["no_gpu_only"]]
            for outcome, c in bad:
                message = c["message"].replace("|", "/").replace("\n", " ")[:300]
                lines.append(f"| `{c['id']}` | {outcome} | {message} |")
    bench = next((s for s in result["stages"] if s["name"] == "bench"), None)
    if bench and bench.get("rows"):
        lines += ["", "## Benchmarks", "", "From `benchmarks/bench_gpu.py` (its docstring gives every byte and FLOP count)."]
        device = (result.get("bench_device") or {})
        if device.get("peak_bandwidth_Bps"):
            lines += [f"Roofline: peak bandwidth {device['peak_bandwidth_Bps'] / 1e12:.2f} TB/s, "
                      f"peak float32 {device['peak_flops'] / 1e12:.1f} TFLOP/s ({device['name']})."]
        lines += ["", bench_table(bench["rows"]), ""]
        lines += [f"- {c}" for c in bench.get("checks", [])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def _environment_for(dry_run):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # the simulator in a dry run; otherwise never (the suite's conftest would fall back to it without a device)
    env["NUMBA_ENABLE_CUDASIM"] = "1" if dry_run else "0"
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def run_check(out, dry_run=False, python=None, budget=BUDGET_S, echo=print):
    """Run every stage, write ``gpu-check.json`` and ``gpu-check.md`` in ``out``, and return the exit status.

    Parameters
    ----------
    out : str or os.PathLike
        The output folder (created; refused unless it is or can become a
        writable folder).
    dry_run : bool, default False
        Every stage in the CUDA simulator at tiny sizes (module docstring).
    python : str, optional
        The Python of every stage; this one by default.
    budget : float, default BUDGET_S
        Seconds for the whole check.
    echo : callable, default print
        Where the progress lines go.

    Returns
    -------
    int
        0 or 1 (module docstring: for a dry run, whether the machinery works).

    Raises
    ------
    ValueError
        ``out`` is not a folder that can be written.
    """
    out = _check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    python = python or sys.executable
    env = _environment_for(dry_run)
    clock = _Clock(budget)
    mode = "dry run in the CUDA simulator" if dry_run else "on the GPU"
    echo(f"gpu check ({mode}), budget {budget:.0f} s, results in {out}")
    stages = []

    def record(stage):
        stages.append(stage)
        echo(f"  {stage['name']:12s} {stage['status']:8s} {stage['seconds']:6.1f} s  {stage['summary']}")

    stage, env_report = _environment(python, env, clock, out)
    record(stage)
    if env_report:
        g, rt = env_report["gpu"], env_report["cuda_runtime"]
        echo(f"  GPU: {g.get('name', g.get('driver', 'none'))}; SMs: {g.get('sm_count', 'n/a')}; "
             f"driver: {g.get('driver_version', 'n/a')} (CUDA {g.get('cuda_driver_api', 'n/a')}); "
             f"CUDA runtime: numba-cuda {rt.get('numba-cuda')}, cupy {rt.get('cupy')}")
        echo("  packages: " + ", ".join(f"{k} {v}" for k, v in env_report["packages"].items()))
    record(_backends(env_report, dry_run))
    xdist = bool(env_report) and env_report["packages"].get("pytest-xdist") != "not installed"
    record(_tests(python, env, clock, out, dry_run, xdist))
    for stage in _sanitizer(python, env, clock, out, dry_run):
        record(stage)
    stage, bench_report = _bench(python, env, clock, out, dry_run)
    record(stage)

    passed = all(s["status"] in ("pass", "not run") for s in stages) and not dry_run
    result = {
        "dry_run": dry_run,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(python).name, "-m", "gpu", "check", "--out", str(out)] + (["--dry-run"] if dry_run else [])),
        "budget_s": budget,
        "environment": env_report,
        "bench_device": (bench_report or {}).get("device"),
        "stages": stages,
        "passed": passed,
    }
    if dry_run:
        problems = _dry_run_problems(stages, env_report, out)
        result["machinery_ok"] = not problems
        result["machinery_summary"] = "; ".join(problems) or "every stage ran and was read back; a skip counts as a failure"
    problems = _write(result, out)
    if dry_run and problems:
        result["machinery_ok"] = False
        echo("  machinery: " + "; ".join(problems))
    if dry_run:
        echo(f"dry run: the machinery {'works' if result['machinery_ok'] else 'is broken'} "
             f"({result['machinery_summary']}); GPU verdict: fail (no GPU in a dry run)")
        code = 0 if result["machinery_ok"] else 1
    else:
        echo(f"GPU check: {'pass' if passed else 'FAIL'}")
        code = 0 if passed else 1
    echo(f"results: {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
    return code


def _dry_run_problems(stages, env_report, out):
    """What keeps a dry run from showing that the machinery works (empty when it does)."""
    by = {s["name"]: s for s in stages}
    problems = []
    if env_report is None:
        problems.append("the environment probe failed")
    tests = by["tests"]
    if not tests.get("ran"):
        problems.append("the tests did not run or their JUnit XML was not read")
    elif tests["failures"] or tests["pytest_exit"] not in (0,) or not sum(tests["counts"].values()):
        problems.append(f"the tests did not pass in the simulator: {tests['summary']}")
    if by["workload"]["status"] != "pass":
        problems.append("the sanitizer's workload failed in the simulator")
    if by["bench"]["status"] != "pass":
        problems.append(f"the benchmark failed: {by['bench']['summary']}")
    if not _self_test_skip_counting(out):
        problems.append("a JUnit file with a skipped test was not judged a failure")
    return problems


def _write(result, out):
    """Write both files and read them back; the problems found (empty when both are right)."""
    json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    md_path.write_text(markdown_report(result))
    problems = []
    try:
        back = json.loads(json_path.read_text())
        if back["stages"] != result["stages"]:
            problems.append("gpu-check.json does not read back as written")
    except (OSError, ValueError, KeyError) as err:
        problems.append(f"gpu-check.json cannot be read back ({err})")
    text = md_path.read_text()
    if "## Stages" not in text or ("## Benchmarks" not in text and any(s.get("rows") for s in result["stages"])):
        problems.append("gpu-check.md lacks its stages or its benchmark table")
    return problems


# ---------------------------------------------------------------------------
# Installs: the CUDA extras resolve
# ---------------------------------------------------------------------------

#: The packages each CUDA extra must bring, and the majors of the stack: ``{extra: (major, must have)}``.
EXTRAS = {
    "cuda12": (12, ("numba-cuda", "cupy-cuda12x", "cuda-bindings", "nvidia-cuda-nvrtc-cu12")),
    "cuda13": (13, ("numba-cuda", "cupy-cuda13x", "cuda-bindings", "nvidia-cuda-nvrtc")),
}


def _resolved_problems(extra, installed):
    """What is wrong with the set ``{name: version}`` that pip resolved for ``.[dev,extra]``."""
    major, needed = EXTRAS[extra]
    problems = [f"{name} is missing" for name in needed if name not in installed]
    bindings = installed.get("cuda-bindings", "")
    if bindings and not bindings.startswith(f"{major}."):
        problems.append(f"cuda-bindings {bindings} is not CUDA {major}")
    other = 13 if major == 12 else 12
    if f"cupy-cuda{other}x" in installed:
        problems.append(f"cupy-cuda{other}x is resolved too")
    for name in installed:
        # CUDA 12 wheels are named -cu12; the CUDA 13 ones have no suffix
        if name.startswith("nvidia-") and (name.endswith("-cu12") != (major == 12)):
            problems.append(f"{name} belongs to the other CUDA major")
    return problems


#: The ``dev`` packages that the CUDA extras constrain; every other ``dev`` package is independent of CUDA.
DEV_GPU_PACKAGES = ("numba", "numba-cuda")


def _requirement_name(requirement):
    return re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pip_targets(extra, whole):
    """What pip resolves for ``extra``: the project with ``[dev,extra]``, or only the requirements CUDA touches."""
    if whole:
        return ["-e", f"{ROOT}[dev,{extra}]"]
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    dev = [r for r in extras["dev"] if _requirement_name(r) in DEV_GPU_PACKAGES]
    return [r.split("#")[0].strip() for r in project["dependencies"] + dev + extras[extra]]


def resolve_extras(extras=tuple(EXTRAS), python=None, echo=print, whole=True):
    """Resolve ``pip install -e '.[dev,EXTRA]'`` for each CUDA extra with ``pip --dry-run``, and check the stack.

    Each extra must resolve, and to one CUDA major: its ``cuda-bindings``,
    its CuPy wheel and its ``nvidia-*`` wheels.  Needs the package index
    (nothing is installed).

    Parameters
    ----------
    extras : sequence of str, default ('cuda12', 'cuda13')
    python : str, optional
        The Python whose pip resolves; this one by default.
    echo : callable, default print
    whole : bool, default True
        Resolve the project with ``[dev,EXTRA]`` (about a minute for both
        extras), or, when false, only what CUDA can constrain: the project's
        dependencies, the ``dev`` packages of :data:`DEV_GPU_PACKAGES` and the
        extra (a few seconds; no other ``dev`` package names a CUDA package,
        which ``tests/test_environment.py`` checks).

    Returns
    -------
    int
        0 when every extra resolves to its major, 1 otherwise.
    """
    python = python or sys.executable
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ValueError(f"extras: expected some of {', '.join(EXTRAS)}, got {', '.join(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for extra in extras:
            report = Path(tmp) / f"{extra}.json"
            cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
                   "--report", str(report)] + _pip_targets(extra, whole)
            procs[extra] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), report,
                            time.monotonic())
        code = 0
        for extra, (proc, report, start) in procs.items():
            output = proc.communicate()[0]
            seconds = time.monotonic() - start
            if proc.returncode != 0:
                errors = [line for line in output.splitlines() if line.startswith("ERROR")]
                echo(f"{extra}: does NOT resolve ({seconds:.0f} s): " + (" ".join(errors)[:2000] or _tail(output, 5)))
                code = 1
                continue
            installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
            problems = _resolved_problems(extra, installed)
            shown = ", ".join(f"{n} {installed[n]}" for n in sorted(installed)
                              if n.startswith(("numba", "cupy", "cuda-", "nvidia-cuda-nvrtc", "nvidia-nvvm", "nvidia-cuda-nvcc")))
            if problems:
                echo(f"{extra}: resolves, but: {'; '.join(problems)} ({shown})")
                code = 1
            else:
                echo(f"{extra}: resolves in {seconds:.0f} s to {len(installed)} packages: {shown}")
    return code
