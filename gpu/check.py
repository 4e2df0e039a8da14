"""One command that validates both GPU backends on a GPU and writes the numbers: ``python -m gpu check --out DIR``.

``make gpu-check`` runs it (``PYTHONPATH=. $(PYTHON) -m gpu check``) with the
Python it is given, with no virtual environment and no pip, so that it works
on a GPU machine that reaches no package registry: that Python needs numpy,
scipy, threadpoolctl, pytest, hypothesis, numba, numba-cuda and cupy (the
``[cuda12]`` or ``[cuda13]`` extra brings the last three).  ``make
gpu-rehearsal`` runs its dry run in an environment built like those machines
(``constraints/rehearse.py``).

Stages
------
Each stage runs in its own process, with a time limit, so that a hung driver
or a crashed kernel ends that stage and not the check.  Every stage ends
``passed``, ``failed``, ``timed out`` or ``not run`` (with the reason):

1. **environment**: the GPU's name, SM count and compute capability, the
   driver's version and the CUDA version it supports, the CUDA runtime
   versions numba-cuda and CuPy load, and the versions of numpy, numba,
   numba-cuda, cupy, cuda-bindings, pytest, pytest-xdist, hypothesis and
   torch ("not installed" for the missing ones).  Then how the kernels will
   reach the device (:func:`ptx_route`): NVVM writes PTX of one ISA version,
   and a driver JIT-compiles only the ISA versions of its own CUDA release
   and older, so where NVVM's is newer than the driver's (NVVM 13.5 writes
   ISA 9.5, a CUDA 13.0 driver reads up to 9.0) the kernels must be linked
   into machine code by nvJitLink of a release at least NVVM's, which
   numba-cuda does whenever it finds one (its link-time optimisation).  The
   stage names the route; where neither works it fails, in one line naming
   both versions.  (NVVM cannot be asked for an older ISA; the other way out
   is an NVVM of the driver's release.)  A dry run checks the route against
   the GPU machines' driver, CUDA 13.0 (:data:`TARGET_DRIVER`).
2. **backends**: :func:`gpu.backend_status`; fails unless both backends run
   on a GPU (the CUDA simulator does not count).
3. **tests**: pytest over ``tests/test_gpu_*.py`` and ``tests/test_cupy_*.py``
   with ``NUMBA_ENABLE_CUDASIM=0`` (the suite's ``conftest.py`` would
   otherwise fall back to the simulator where the driver sees no device),
   but the static gates of :data:`STATIC_TESTS` (no GPU needed: ``make test``
   and ``make gpu-rehearsal`` run them) and the tests of
   :data:`NOT_IN_TESTS_STAGE` (they run a check themselves).
   pytest's JUnit XML is read back: every failure and error fails the
   stage, and so does every skip, because a skipped GPU test is a test that
   did not run on the GPU.  The one exception is a test that exists only for
   machines without a GPU (it shows the error a missing device gives, or the
   simulator's own rules) and skips where there is one: its reason matches
   :data:`NO_GPU_ONLY`, and it is listed as such.
4. **second opinion**: when a test of the tuned kernels failed, the plain
   kernels of :mod:`gpu.numba_cuda.plain` (one thread per output element)
   compute the same functions (:func:`run_second_opinion`, the functions of
   the failed tests), beside the tuned ones, against the reference: if the
   plain kernel agrees and the tuned one does not, the tuned kernel is at
   fault; if neither agrees, the device, its driver or the compiler is.
   ``not run`` when every test passed.
5. **sanitizer**: where ``compute-sanitizer`` is on ``PATH``, its
   ``memcheck`` and ``racecheck`` tools over ``python -m gpu workload`` (every
   public function of both backends once, at small sizes); where it is not,
   the stage records ``not run: compute-sanitizer not on PATH`` (not a
   failure).
6. **bench**: ``benchmarks/bench_gpu.py --check --json FILE --repeats 3``
   at its full sizes (the best of three runs after a warm-up, to fit the
   budget): its rows (time, effective bandwidth, FLOP rate, the row's bound,
   compute or memory, and the fraction of its own roofline, target, met per
   function and size) and its verdict; a target that ran and was missed
   fails the stage, and so does one that did not run, each named as such.

The results go to ``DIR/gpu-check.json`` and ``DIR/gpu-check.md``, beside
each stage's log, pytest's ``pytest-junit.xml`` and the benchmark's
``bench-gpu.json``.  Both files are written before the first stage (every
stage ``not run``), when each stage starts (its summary says it is running
and until when) and after each stage, each time to a new file renamed over
the old one: a check stopped at any point, by an outer time limit say,
leaves both files whole, with every stage it finished.  The exit status is
0 when every stage passed, 1 when one failed (a backend cannot run, a test
failed or skipped, a sanitizer found an error, a target was missed or did not
run), 2 for a bad argument.

Budget: ``--budget S`` seconds for the whole check, 480 (8 minutes on one
H200) by default (:data:`BUDGET_S`).  Each stage's limit is its share of the
budget (:data:`STAGE_SHARES`; :func:`stage_limits`), and the shares add up to
:data:`MAX_SHARE` (85%), so that the start of every process, the writing of
the files and a stage that ends late fit in what is left; no stage runs past
what is left of the budget.

The dry run
-----------
``python -m gpu check --dry-run --out DIR`` runs the same stages in the CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1`` in every stage's environment), at tiny
sizes: a small subset of the tests (:data:`DRY_RUN_TESTS`), the second
opinion (always, at tiny sizes), the workload in the simulator without a
sanitizer, and ``bench_gpu.py --quick``.  The GPU verdicts come out as they
must without a GPU (the backends stage fails, the CuPy device tests skip and
are counted as failures) and are reported as such.  The dry run's own exit
status says whether the machinery works: 0 when every stage ran to
completion within its limit and its output was read back (the environment's
report and a PTX route for the GPU machines' driver, a JUnit file with at
least one test, the second opinion's verdicts, the benchmark's rows), the
tests had no failure or error, the plain and the tuned kernels agreed with
the reference, the workload ran, the benchmark exited 0, a JUnit file with
one skipped test (written by the check itself) is judged a failure, and both
result files were written and read back; 1 otherwise.  ``make test`` runs it
(``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import contextlib
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
    "MAX_SHARE",
    "STAGE_SHARES",
    "stage_limits",
    "TIMEOUTS",
    "STATUSES",
    "TARGET_DRIVER",
    "ptx_isa",
    "ptx_route",
    "NOT_IN_TESTS_STAGE",
    "STATIC_TESTS",
    "run_second_opinion",
    "second_opinion_functions",
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

#: The whole check's default budget in seconds (``--budget``): 8 minutes on one H200.
BUDGET_S = 480
#: The most of the budget the stages' limits may take together: the rest is for starting processes, writing the
#: files and a stage that ends late.
MAX_SHARE = 0.85
#: Each stage's share of the budget (the workload of a dry run runs in memcheck's share); they add up to
#: :data:`MAX_SHARE`.  The tests, which compile every kernel, take the most; the benchmark next (full sizes, three
#: runs of each row after a warm-up that compiles).
STAGE_SHARES = {"environment": 0.04, "tests": 0.32, "second opinion": 0.08, "memcheck": 0.10, "racecheck": 0.10,
                "bench": 0.21}
#: How a stage ends.
STATUSES = ("passed", "failed", "timed out", "not run")


def stage_limits(budget=BUDGET_S):
    """Each stage's time limit in seconds for a check of ``budget`` seconds: its share (:data:`STAGE_SHARES`)."""
    return {name: share * budget for name, share in STAGE_SHARES.items()}


#: Each stage's limit in seconds at the default budget (a stage never runs past what is left of the budget).
TIMEOUTS = stage_limits(BUDGET_S)
#: The GPU test files, as globs under the project root; the conformance suite runs its GPU backends' cases only
#: (:data:`CONFORMANCE_BACKENDS`: ``make test`` holds the others to the reference).
GPU_TESTS = ("tests/test_gpu_*.py", "tests/test_cupy_*.py", "tests/test_conformance.py")
#: The backends of ``tests/test_conformance.py`` that the tests stage runs: the two GPU ones, on the device.
CONFORMANCE_BACKENDS = "numba_cuda,cupy"
#: The dry run's tests: the status of both backends, and the CuPy device tests (which skip without a GPU).
DRY_RUN_TESTS = ("tests/test_gpu_status.py", "tests/test_cupy_device.py")
#: GPU test files that the tests stage leaves out: they need no GPU and compile every kernel for two capabilities in
#: processes of their own (the PTX, ptxas and SASS gates), so ``make test`` runs them with ptxas 13.5 and ``make
#: gpu-rehearsal`` with the GPU machines' ptxas 13.0 and with 13.5.
STATIC_TESTS = ("tests/test_gpu_ptx.py", "tests/test_gpu_resources.py")
#: Tests of the GPU test files that the tests stage leaves out: each runs a GPU check of its own (``make test`` runs them).
NOT_IN_TESTS_STAGE = (
    "tests/test_gpu_check.py::test_the_dry_run_exercises_every_stage_and_writes_both_files",
    "tests/test_gpu_check.py::test_a_check_stopped_during_a_stage_leaves_valid_files",
)
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
        self.start, self.budget, self.limits = time.monotonic(), budget, stage_limits(budget)

    def timeout(self, stage):
        return max(1.0, min(self.limits[stage], self.budget - (time.monotonic() - self.start)))


#: Called with the process id of every stage's command once it has started (:func:`run_check` records it).
_STARTED = []


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
    for started in _STARTED:
        started(proc.pid)
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
    if status not in STATUSES:
        raise ValueError(f"status: expected one of {', '.join(STATUSES)}, got {status!r}")
    return {"name": name, "status": status, "summary": summary, "seconds": round(seconds, 1), **details}


def _ended(code, seconds, passed, summary, name, **details):
    """A stage's record from its command's exit code: ``timed out`` when ``code`` is None, else passed or failed."""
    if code is None:
        return _stage(name, "timed out", f"timed out after {seconds:.0f} s; {summary}", seconds, **details)
    return _stage(name, "passed" if passed else "failed", summary, seconds, **details)


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


_PTX_PROBE = r"""
import json, re
report = {}
try:
    from gpu.numba_cuda import _device  # first: it loads numba-cuda's array support where NumPy 2.5 needs help
    report["numpy_2_5_shim"] = _device.NUMPY_2_5_SHIM
    from numba import cuda, float32
    from numba.cuda.cudadrv import driver

    def probe(a):
        a[0] = 1.0

    ptx, _ = cuda.compile_ptx(probe, (float32[::1],), cc=(9, 0))
    isa = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
    release = re.search(r"release (\d+\.\d+)", ptx)
    report["ptx_isa"] = isa.group(1) if isa else None
    report["nvvm"] = release.group(1) if release else None
    report["nvjitlink"] = None
    if driver._have_nvjitlink():
        from cuda.bindings import nvjitlink
        report["nvjitlink"] = ".".join(map(str, nvjitlink.version()))
except Exception as e:
    report["error"] = f"{type(e).__name__}: {e}"
print("PTX " + json.dumps(report))
"""

#: The driver of the GPU machines the check runs on (driver 580): a dry run checks the kernels' route against it.
TARGET_DRIVER = "13.0"
#: The PTX ISA version of each CUDA 12 release (a CUDA 13.x release reads and writes ISA 9.x).
_PTX_ISA_12 = {0: (8, 0), 1: (8, 1), 2: (8, 2), 3: (8, 3), 4: (8, 4), 5: (8, 5), 6: (8, 5), 8: (8, 7), 9: (8, 8)}


def _pair(text):
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def ptx_isa(release):
    """The PTX ISA version, ``(major, minor)``, that CUDA ``release`` (``"13.0"``) reads and writes; None when unknown."""
    pair = _pair(release)
    if pair is None:
        return None
    major, minor = pair
    if major == 13:
        return (9, minor)
    return _PTX_ISA_12.get(minor) if major == 12 else None


def ptx_route(driver, isa, nvvm, nvjitlink):
    """How kernels reach a device: ``(ok, route, line)``.

    Parameters
    ----------
    driver : str or None
        The CUDA version of the driver (``"13.0"``); None without one.
    isa, nvvm : str
        The PTX ISA version NVVM writes (``"9.5"``) and NVVM's CUDA release.
    nvjitlink : str or None
        The release of the nvJitLink that numba-cuda links with (it then
        links every kernel into machine code: link-time optimisation), or
        None without one.

    Returns
    -------
    tuple
        ``ok`` (bool), ``route`` (``"nvJitLink"``, ``"driver JIT"``, or
        None when neither works) and one line that says which and why, or
        why not, naming both versions.
    """
    driver_isa, ptx = ptx_isa(driver), _pair(isa)
    show = "none" if nvjitlink is None else nvjitlink
    if driver is None or ptx is None:
        return False, None, f"no route: the driver's CUDA version ({driver}) or NVVM's PTX ISA ({isa}) is not known"
    linker = ptx_isa(nvjitlink) if nvjitlink else None
    if driver_isa is None:
        return True, "nvJitLink" if nvjitlink else "driver JIT", (
            f"NVVM {nvvm} writes PTX ISA {isa}; the driver's CUDA {driver} is newer than the releases known here, "
            f"which read at most ISA 9.x; nvJitLink: {show}")
    shown_isa = f"{driver_isa[0]}.{driver_isa[1]}"
    if ptx <= driver_isa:
        how = f"linked by nvJitLink {nvjitlink}" if nvjitlink else "JIT-compiled by the driver"
        return True, "nvJitLink" if nvjitlink else "driver JIT", (
            f"NVVM {nvvm} writes PTX ISA {isa}, which the driver (CUDA {driver}, PTX ISA {shown_isa}) reads: kernels {how}")
    if linker is not None and linker >= ptx:
        return True, "nvJitLink", (
            f"NVVM {nvvm} writes PTX ISA {isa}, newer than the driver's PTX ISA {shown_isa} (CUDA {driver}): the kernels "
            f"link through nvJitLink {nvjitlink} into machine code the driver loads")
    return False, None, (
        f"PTX ISA {isa} (NVVM {nvvm}) is newer than the driver's PTX ISA {shown_isa} (CUDA {driver}), and no nvJitLink "
        f"of CUDA {nvvm} or later is there to link it (found: {show}): install nvidia-nvjitlink>={nvvm}, or an NVVM of "
        f"CUDA {driver}")


def _ptx_report(python, env, clock, out, driver, dry_run):
    """The PTX probe (NVVM, its ISA, nvJitLink) and the route for ``driver`` (the GPU machines' in a dry run)."""
    code, output, _ = _run([python, "-c", _PTX_PROBE], dict(env, NUMBA_ENABLE_CUDASIM="0"), clock.timeout("environment"),
                           out / "ptx.log")
    line = next((x for x in output.splitlines() if x.startswith("PTX ")), None)
    report = json.loads(line[len("PTX "):]) if line else {"error": f"exit {code}: {_tail(output, 2)}"}
    if "error" in report:
        report.update(ok=False, route=None, line=f"NVVM could not compile a kernel: {report['error']}")
        return report
    against = TARGET_DRIVER if dry_run or driver is None else driver
    ok, route, text = ptx_route(against, report["ptx_isa"], report["nvvm"], report["nvjitlink"])
    if dry_run or driver is None:
        text = f"for the GPU machines' driver (CUDA {against}): {text}"
    if report.get("numpy_2_5_shim"):
        text += "; numba-cuda compiles under NumPy 2.5 only with the np.row_stack alias its import needs (put back for it)"
    report.update(ok=ok, route=route, line=text, driver=against)
    return report


def _environment(python, env, clock, out, dry_run=False):
    code, output, seconds = _run([python, "-c", _PROBE, json.dumps(PACKAGES)], env, clock.timeout("environment"),
                                 out / "environment.log")
    line = next((x for x in output.splitlines() if x.startswith("PROBE ")), None)
    if code != 0 or line is None:
        why = "timed out" if code is None else f"exit {code}"
        status = "timed out" if code is None else "failed"
        return _stage("environment", status, f"the probe failed ({why}): {_tail(output, 3)}", seconds), None
    report = json.loads(line[len("PROBE "):])
    g = report["gpu"]
    start = time.monotonic()
    report["ptx"] = _ptx_report(python, env, clock, out, g.get("cuda_driver_api"), dry_run)
    seconds += time.monotonic() - start
    summary = (f"{g['name']}, {g['sm_count']} SMs, driver {g.get('driver_version', 'unknown')} (CUDA {g['cuda_driver_api']})"
               if "name" in g else g.get("driver", "no CUDA device"))
    summary += f"; kernels: {report['ptx']['line']}"
    return _stage("environment", "passed" if report["ptx"]["ok"] else "failed", summary, seconds), report


def _backends(report, dry_run):
    if report is None:
        return _stage("backends", "not run", "not probed: the environment stage failed")
    problems = []
    for backend, (usable, why) in report["backends"].items():
        if not usable:
            problems.append(f"{backend}: {why}")
        elif "simulator" in why:
            problems.append(f"{backend} runs only in the CUDA simulator: {why}")
    if problems:
        expected = " (expected in a dry run: there is no GPU)" if dry_run else ""
        return _stage("backends", "failed", "a backend cannot run on a GPU" + expected + ": " + "; ".join(problems))
    return _stage("backends", "passed", "; ".join(why for _, why in report["backends"].values()))


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
    found = sorted(str(p.relative_to(ROOT)) for pattern in GPU_TESTS for p in ROOT.glob(pattern))
    return [f for f in found if f not in STATIC_TESTS]


def tests_environment(env):
    """The tests stage's environment: ``env`` with the conformance suite kept to the GPU backends."""
    return {**env, "CONFORMANCE_BACKENDS": CONFORMANCE_BACKENDS}


def _tests(python, env, clock, out, dry_run, xdist):
    junit = out / "pytest-junit.xml"
    if junit.exists():
        junit.unlink()
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={junit}"]
    if not dry_run and xdist:
        # the compiles are CPU-bound (NVVM, ptxas): half the cores, 2 to 8 processes, share the GPU
        cmd += ["-n", str(min(8, max(2, (os.cpu_count() or 4) // 2)))]
    cmd += [f"--deselect={test}" for test in NOT_IN_TESTS_STAGE] + _test_files(dry_run)
    code, output, seconds = _run(cmd, tests_environment(env), clock.timeout("tests"), out / "tests.log")
    if code is None:
        return _stage("tests", "timed out", f"pytest timed out after {seconds:.0f} s: {_tail(output, 3)}", seconds, ran=False)
    try:
        verdict = judge_tests(read_junit(junit))
    except ValueError as err:
        return _stage("tests", "failed", f"pytest wrote no readable JUnit XML (exit {code}): {err}; {_tail(output, 3)}",
                      seconds, ran=False)
    status = "passed" if verdict["passed"] and code == 0 else "failed"
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


# ---------------------------------------------------------------------------
# 4. The second opinion: the plain kernels where a tuned one failed
# ---------------------------------------------------------------------------

#: The functions the second opinion computes, and the words of a failed test's id that name each (first match wins).
SECOND_OPINION = {"ovq_attention": r"ovq|vq_", "softmax_attention": r"attention", "gma": r"gma|scan",
                  "responsibilities": r"gmm|responsibilit"}


def second_opinion_functions(failures):
    """The functions of :data:`SECOND_OPINION` that the failed tests (``{"id": ...}`` cases) are about; all of them when
    a failure names none."""
    found = []
    for case in failures:
        name = next((f for f, words in SECOND_OPINION.items() if re.search(words, case["id"], re.I)), None)
        if name is None:
            return list(SECOND_OPINION)
        if name not in found:
            found.append(name)
    return found


def _opinion_problems(rng, tiny):
    """``{function: (call(module), reference result)}`` on float64 problems of awkward sizes (tiny for the simulator)."""
    import numpy as np

    from refimpl import attention, gma, gmm, ovq

    N, K, d, T, C = (7, 3, 2, 9, 4) if tiny else (301, 19, 17, 333, 64)
    x, xk = rng.standard_normal((N, d)), rng.standard_normal((N, d))
    v = rng.standard_normal((N, d + 1))
    mu, var, w = rng.standard_normal((K, d)), rng.uniform(0.5, 2.0, (K, d)), rng.dirichlet(np.ones(K))
    q, k, vt = (rng.standard_normal((2, T, d)) for _ in range(3))
    options = dict(max_size=5 if tiny else 48, chunk_size=C)
    return {
        "responsibilities": (lambda m: m.responsibilities(x, mu, var, w), gmm.responsibilities(x, mu, var, w)),
        "gma": (lambda m: [m.gma(x, xk, v, mu, var, w, causal=c, chunk_size=C) for c in (False, True)],
                [gma.gma(x, xk, v, mu, var, w, causal=c, chunk_size=C) for c in (False, True)]),
        "softmax_attention": (lambda m: [m.softmax_attention(q, k, vt, causal=c) for c in (False, True)],
                              [attention.softmax_attention(q, k, vt, causal=c) for c in (False, True)]),
        "ovq_attention": (lambda m: m.ovq_attention(q[0], k[0], vt[0], **options), ovq.ovq_attention(q[0], k[0], vt[0], **options)),
    }


def run_second_opinion(functions=tuple(SECOND_OPINION), tiny=False, tolerance=1e-9):
    """The plain and the tuned Numba-CUDA kernels of ``functions``, each against the reference, in float64.

    Parameters
    ----------
    functions : sequence of str
        Keys of :data:`SECOND_OPINION`.
    tiny : bool, default False
        Sizes for the CUDA simulator.
    tolerance : float, default 1e-9
        The largest difference to the reference, relative to its largest entry (at least 1), that agrees.

    Returns
    -------
    list of dict
        Per function: ``function``, ``plain`` and ``tuned`` (the relative
        difference, or the error raised, as text), ``plain_agrees``,
        ``tuned_agrees`` and ``verdict``, one sentence.

    Raises
    ------
    RuntimeError
        Numba-CUDA cannot run here (from :func:`gpu.require`).
    """
    import numpy as np

    import gpu

    gpu.require("numba-cuda")
    import gpu.numba_cuda as tuned
    from gpu.numba_cuda import plain

    unknown = [f for f in functions if f not in SECOND_OPINION]
    if unknown:
        raise ValueError(f"functions: expected some of {', '.join(SECOND_OPINION)}, got {', '.join(unknown)}")
    problems = _opinion_problems(np.random.default_rng(40), tiny)
    results = []
    for function in functions:
        call, want = problems[function]
        row = {"function": function}
        for name, module in (("plain", plain), ("tuned", tuned)):
            try:
                got = call(module)
                err = max(float(np.max(np.abs(np.asarray(a) - b), initial=0.0)) / max(1.0, float(np.max(np.abs(b), initial=0.0)))
                          for a, b in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]))
                row[name], row[f"{name}_agrees"] = f"{err:.1e}", bool(err <= tolerance)
            except Exception as err:  # a kernel that cannot launch or raises is a disagreement, with its words
                row[name], row[f"{name}_agrees"] = f"{type(err).__name__}: {str(err)[:200]}", False
        row["verdict"] = {
            (True, True): "both agree with the reference",
            (True, False): "the tuned kernel is at fault: the plain one agrees with the reference on this device",
            (False, True): "the plain kernel disagrees, the tuned one agrees",
            (False, False): "neither agrees: suspect the device, its driver or the compiler before the tuned kernel",
        }[(row["plain_agrees"], row["tuned_agrees"])]
        results.append(row)
    return results


def _second_opinion(python, env, clock, out, dry_run, tests):
    """Stage 4: the plain kernels beside the tuned ones, for the functions of the failed tests (always in a dry run)."""
    if not dry_run:
        if tests.get("status") == "passed":
            return _stage("second opinion", "not run", "not run: every test of the tuned kernels passed")
        failures = tests.get("failures", []) + tests.get("skips", [])
        functions = second_opinion_functions(failures) if tests.get("ran") else list(SECOND_OPINION)
    else:
        functions = list(SECOND_OPINION)
    cmd = [python, "-m", "gpu", "second-opinion"] + (["--tiny"] if dry_run else [])
    for f in functions:
        cmd += ["--function", f]
    code, output, seconds = _run(cmd, env, clock.timeout("second opinion"), out / "second-opinion.log")
    line = next((x for x in output.splitlines() if x.startswith("OPINION ")), None)
    if code is None or line is None:
        summary = f"no verdict (exit {code}): {_tail(output, 2)}"
        return _ended(code, seconds, False, summary, "second opinion", opinions=[])
    opinions = json.loads(line[len("OPINION "):])
    summary = "; ".join(f"{o['function']}: {o['verdict']} (plain {o['plain']}, tuned {o['tuned']})" for o in opinions)
    return _ended(code, seconds, all(o["plain_agrees"] and o["tuned_agrees"] for o in opinions), summary, "second opinion",
                  opinions=opinions)


# ---------------------------------------------------------------------------
# 5. compute-sanitizer over a small workload
# ---------------------------------------------------------------------------

_SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")


def _workload(python, env, clock, out):
    """A dry run's stand-in for the sanitizer: the workload itself in the simulator, so that its script is checked."""
    cmd = [python, "-m", "gpu", "workload", "--tiny", "--backend", "numba-cuda"]
    code, output, seconds = _run(cmd, env, clock.timeout("memcheck"), out / "workload.log")
    return _ended(code, seconds, code == 0, f"the sanitizer's workload in the simulator: exit {code}; {_tail(output, 1)}",
                  "workload")


def _sanitizer(name, python, env, clock, out, dry_run):
    """``compute-sanitizer --tool name`` over the workload, or ``not run`` and why."""
    tool = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if tool is None or dry_run:
        why = "compute-sanitizer not on PATH" if tool is None else "a dry run (the simulator runs no device code)"
        return _stage(name, "not run", f"not run: {why}")
    cmd = [tool, "--tool", name, "--error-exitcode", "3", "--target-processes", "all", python, "-m", "gpu", "workload"]
    code, output, seconds = _run(cmd, env, clock.timeout(name), out / f"{name}.log")
    found = _SUMMARY.findall(output)
    summary = found[-1] if found else "no summary line"
    return _ended(code, seconds, code == 0, f"exit {code}; {summary}" if code is not None else summary, name)


# ---------------------------------------------------------------------------
# 6. The benchmark
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
        return _stage("bench", "timed out", f"timed out after {seconds:.0f} s", seconds, rows=rows, checks=checks), report
    if report is None or not rows:
        return _stage("bench", "failed", f"no rows written (exit {code}): {_tail(output, 3)}", seconds, rows=[], checks=checks), None
    if code in (1, 3):
        verdicts = report.get("verdicts", {})
        missed = sorted(t for t, v in verdicts.items() if v["status"] == "missed")
        not_run = sorted(t for t, v in verdicts.items() if v["status"] == "not run")
        summary = f"{len(missed)} target(s) ran and missed ({', '.join(missed) or 'none'}); {len(not_run)} did not run ({', '.join(not_run) or 'none'})"
        return _stage("bench", "failed", summary, seconds, rows=rows, checks=checks), report
    if code != 0:
        return _stage("bench", "failed", f"exit {code}: {_tail(output, 3)}", seconds, rows=rows, checks=checks), report
    return _stage("bench", "passed", f"{len(rows)} rows; " + (checks[-1] if dry_run and checks else "every target met"),
                  seconds, rows=rows, checks=checks), report


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


def _num(value, scale, digits, suffix=""):
    return "n/a" if value is None else f"{value / scale:.{digits}f}{suffix}"


def bench_table(rows):
    """The benchmark's rows as a Markdown table: per function and size, time, bandwidth, FLOP rate, bound, roofline, target, met.

    Parameters
    ----------
    rows : list of dict
        The rows of ``bench_gpu.py --json``.

    Returns
    -------
    str
    """
    lines = [
        "| backend | function | variant | size | time (ms) | bandwidth (GB/s) | FLOP rate (TFLOP/s) | bound | roofline | target | measured | met | launches per call |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        if r.get("target"):
            met = {True: "yes", False: "**no**"}.get(r["met"]) or r.get("note") or "not judged"
        else:
            met = ""
        launches = "" if r.get("launches_per_call") is None else str(r["launches_per_call"])
        lines.append(
            f"| {r['backend']} | {r['function']} | {r['variant']} | {r['size']} | {_num(r['time_s'], 1e-3, 3)} "
            f"| {_num(r['bandwidth_Bps'], 1e9, 1)} | {_num(r['flop_rate'], 1e12, 3)} | {r.get('bound') or 'n/a'} "
            f"| {_num(r['roofline_fraction'], 0.01, 1, '%')} "
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
    if not result.get("complete", True):
        lines += ["**INCOMPLETE**: the check has not finished, or was stopped; the stages below that say so did not run "
                  "to their end.", ""]
    if result["dry_run"]:
        lines += ["**DRY RUN in the CUDA simulator**: no GPU was used; every time below is the simulator's, not GPU speed, "
                  "and must not be reported as a measurement.", ""]
        if "machinery_ok" in result:
            lines += [f"- machinery: {'works' if result['machinery_ok'] else '**broken**'} ({result['machinery_summary']})"]
    verdict = "**pass**" if result["passed"] else ("**fail** (no GPU in a dry run)" if result["dry_run"] else "**fail**")
    if not result.get("complete", True):
        verdict = "none yet"
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
    ptx = env.get("ptx") or {}
    if ptx:
        items += [("NVVM (PTX ISA)", f"{ptx.get('nvvm')} ({ptx.get('ptx_isa')})"), ("nvJitLink", ptx.get("nvjitlink") or "none"),
                  ("kernels reach the device", ptx.get("line", "n/a"))]
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


def _stage_names(dry_run):
    """The stages of a check, in order."""
    sanitizer = ["workload", "memcheck", "racecheck"] if dry_run else ["memcheck", "racecheck"]
    return ["environment", "backends", "tests", "second opinion", *sanitizer, "bench"]


def run_check(out, dry_run=False, python=None, budget=BUDGET_S, echo=print):
    """Run every stage, write ``gpu-check.json`` and ``gpu-check.md`` in ``out`` after each, and return the exit status.

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
        Seconds for the whole check; each stage's limit is its share
        (:func:`stage_limits`).
    echo : callable, default print
        Where the progress lines go.

    Returns
    -------
    int
        0 or 1 (module docstring: for a dry run, whether the machinery works).

    Raises
    ------
    ValueError
        ``out`` is not a folder that can be written, or ``budget`` is not a
        positive number of seconds.
    """
    out = _check_out_folder(out)
    budget = _check_budget(budget)
    out.mkdir(parents=True, exist_ok=True)
    python = python or sys.executable
    env = _environment_for(dry_run)
    clock = _Clock(budget)
    mode = "dry run in the CUDA simulator" if dry_run else "on the GPU"
    echo(f"gpu check ({mode}), budget {budget:.0f} s, results in {out}")
    names = _stage_names(dry_run)
    stages = {n: _stage(n, "not run", "not reached: the check stopped before this stage") for n in names}
    result = {
        "dry_run": dry_run,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(python).name, "-m", "gpu", "check", "--out", str(out), "--budget", f"{budget:g}"]
                            + (["--dry-run"] if dry_run else [])),
        "budget_s": budget,
        "stage_limits_s": {n: round(v, 1) for n, v in clock.limits.items()},
        "complete": False,
        "environment": None,
        "bench_device": None,
        "stages": [],
        "passed": False,
    }

    def save():
        result["stages"] = [stages[n] for n in names]
        _save(result, out)

    def begin(name):
        limit = clock.timeout(name if name in clock.limits else "memcheck")  # the workload runs in memcheck's share
        stages[name] = _stage(name, "not run", f"started at {datetime.datetime.now():%H:%M:%S} with {limit:.0f} s and not "
                                               "finished: if the check is no longer running, it stopped during this stage")
        save()

    def record(stage):
        stages[stage["name"]] = stage
        save()
        echo(f"  {stage['name']:14s} {stage['status']:9s} {stage['seconds']:6.1f} s  {stage['summary']}")

    def started(pid):
        # the running stage's process group: a check killed meanwhile leaves it running; its id is in the files
        running = next((n for n in names if stages[n]["summary"].startswith("started at")), None)
        if running is None:
            return
        stages[running]["process_group"] = pid
        save()

    def stopped(signum, frame):
        # an outer time limit: end the running stage's process group, say so, keep what was measured
        for name in names:
            group = stages[name].get("process_group")
            if stages[name]["summary"].startswith("started at") and group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
                stages[name] = _stage(name, "not run", f"stopped by signal {signum} during this stage")
        save()
        raise SystemExit(128 + signum)

    _STARTED.append(started)
    previous = _on_signal(signal.SIGTERM, stopped)
    try:
        return _stages(result, stages, names, begin, record, save, python, env, clock, out, dry_run, echo)
    finally:
        _STARTED.remove(started)
        _on_signal(signal.SIGTERM, previous)


def _on_signal(signum, handler):
    """Install ``handler`` for ``signum`` where this thread can (the main one); the previous handler, or None."""
    if handler is None:
        return None
    try:
        return signal.signal(signum, handler)
    except ValueError:  # not the main thread: signals stay as they are
        return None


def _stages(result, stages, names, begin, record, save, python, env, clock, out, dry_run, echo):
    """The stages of :func:`run_check`, in order, each begun and recorded (so written) as it goes; the exit status."""
    save()
    begin("environment")
    stage, env_report = _environment(python, env, clock, out, dry_run)
    result["environment"] = env_report
    record(stage)
    if env_report:
        g, rt = env_report["gpu"], env_report["cuda_runtime"]
        echo(f"  GPU: {g.get('name', g.get('driver', 'none'))}; SMs: {g.get('sm_count', 'n/a')}; "
             f"driver: {g.get('driver_version', 'n/a')} (CUDA {g.get('cuda_driver_api', 'n/a')}); "
             f"CUDA runtime: numba-cuda {rt.get('numba-cuda')}, cupy {rt.get('cupy')}")
        echo("  packages: " + ", ".join(f"{k} {v}" for k, v in env_report["packages"].items()))
    record(_backends(env_report, dry_run))
    xdist = bool(env_report) and env_report["packages"].get("pytest-xdist") != "not installed"
    begin("tests")
    record(_tests(python, env, clock, out, dry_run, xdist))
    begin("second opinion")
    record(_second_opinion(python, env, clock, out, dry_run, stages["tests"]))
    if dry_run:
        begin("workload")
        record(_workload(python, env, clock, out))
    for name in ("memcheck", "racecheck"):
        begin(name)
        record(_sanitizer(name, python, env, clock, out, dry_run))
    begin("bench")
    stage, bench_report = _bench(python, env, clock, out, dry_run)
    result["bench_device"] = (bench_report or {}).get("device")
    record(stage)

    done = [stages[n] for n in names]
    result["passed"] = all(s["status"] in ("passed", "not run") for s in done) and not dry_run
    result["complete"] = True
    if dry_run:
        problems = _dry_run_problems(done, env_report, out)
        result["machinery_ok"] = not problems
        result["machinery_summary"] = "; ".join(problems) or "every stage ran and was read back; a skip counts as a failure"
    save()
    problems = _read_back(result, out)
    if dry_run and problems:
        result["machinery_ok"] = False
        echo("  machinery: " + "; ".join(problems))
    if dry_run:
        echo(f"dry run: the machinery {'works' if result['machinery_ok'] else 'is broken'} "
             f"({result['machinery_summary']}); GPU verdict: fail (no GPU in a dry run)")
        code = 0 if result["machinery_ok"] else 1
    else:
        echo(f"GPU check: {'pass' if result['passed'] else 'FAIL'}")
        code = 0 if result["passed"] else 1
    echo(f"results: {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
    return code


def _check_budget(budget):
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"--budget: expected a number of seconds > 0, got {budget!r}") from None
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"--budget: expected a number of seconds > 0, got {budget!r}")
    return value


def _dry_run_problems(stages, env_report, out):
    """What keeps a dry run from showing that the machinery works (empty when it does)."""
    by = {s["name"]: s for s in stages}
    problems = []
    if env_report is None:
        problems.append("the environment probe failed")
    elif by["environment"]["status"] != "passed":
        problems.append(f"the environment stage failed: {by['environment']['summary']}")
    tests = by["tests"]
    if not tests.get("ran"):
        problems.append("the tests did not run or their JUnit XML was not read")
    elif tests["failures"] or tests["pytest_exit"] not in (0,) or not sum(tests["counts"].values()):
        problems.append(f"the tests did not pass in the simulator: {tests['summary']}")
    if by["second opinion"]["status"] != "passed":
        problems.append(f"the second opinion failed in the simulator: {by['second opinion']['summary']}")
    if by["workload"]["status"] != "passed":
        problems.append("the sanitizer's workload failed in the simulator")
    if by["bench"]["status"] != "passed":
        problems.append(f"the benchmark failed: {by['bench']['summary']}")
    if not _self_test_skip_counting(out):
        problems.append("a JUnit file with a skipped test was not judged a failure")
    return problems


def _replace(path, text):
    """Write ``text`` to ``path`` through a new file renamed over it: a reader, or a check stopped meanwhile, sees the
    old file whole or the new one whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save(result, out):
    """Write ``gpu-check.json`` and ``gpu-check.md`` as they stand (each through :func:`_replace`)."""
    _replace(out / "gpu-check.json", json.dumps(result, indent=1) + "\n")
    _replace(out / "gpu-check.md", markdown_report(result))


def _read_back(result, out):
    """Read both files back; the problems found (empty when both are right)."""
    json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
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
