"""The gpu package says which backend is missing and how to install it, never silently None."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu

ROOT = Path(__file__).resolve().parents[1]


def test_backend_status_reports_every_backend_with_a_reason():
    status = gpu.backend_status()
    assert set(status) == set(gpu.BACKENDS)
    for usable, why in status.values():
        assert isinstance(usable, bool) and why


def test_numba_cuda_is_usable_here_on_the_simulator_or_a_device():
    usable, why = gpu.backend_status()["numba-cuda"]
    assert usable, why
    expected = "CUDA simulator" if os.environ["NUMBA_ENABLE_CUDASIM"] == "1" else "runs on the device"
    assert expected in why


def test_the_cupy_backend_reports_whether_it_can_allocate():
    """``import cupy`` works without a GPU; the status must say whether an allocation does, and require() must agree."""
    usable, why = gpu.backend_status()["cupy"]
    if usable:
        assert "gpu.cupy_kernels runs on the device" in why
        gpu.require("cupy")
    else:
        assert "cupy cannot be imported" in why or "CuPy cannot allocate" in why
        with pytest.raises(RuntimeError, match="'cupy' is not available"):
            gpu.require("cupy")


def test_require_names_the_backend_and_the_fix(monkeypatch):
    monkeypatch.setattr(gpu, "_probe", lambda b: (False, "cupy cannot be imported; install the GPU extra"))
    with pytest.raises(RuntimeError, match="'cupy' is not available.*install"):
        gpu.require("cupy")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend: expected one of"):
        gpu.require("opencl")


def _choice(env_value, device_count):
    """Run ``use_simulator_without_device`` in a fresh process with a faked device count."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if env_value is not None:
        env["NUMBA_ENABLE_CUDASIM"] = env_value
    code = (
        "import os, sys, gpu\n"
        f"gpu._cuda_device_count = lambda: {device_count}\n"
        "print(gpu.use_simulator_without_device(), os.environ['NUMBA_ENABLE_CUDASIM'], 'numba' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize(
    "env_value,devices,expected",
    [(None, 0, ["simulator", "1"]), (None, 1, ["device", "0"]), ("1", 1, ["simulator", "1"]), ("0", 0, ["device", "0"])],
)
def test_the_target_is_chosen_before_numba_is_imported(env_value, devices, expected):
    """No device: the simulator; a device: the GPU; a value the user set is kept; numba is not imported by the choice."""
    assert _choice(env_value, devices) == expected + ["False"]


def test_choosing_the_simulator_after_numba_is_imported_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = "import numba, gpu\ngpu._cuda_device_count = lambda: 0\ngpu.use_simulator_without_device()\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode != 0 and "NUMBA_ENABLE_CUDASIM: numba is already imported" in proc.stderr


HINTS = ("[cuda12]", "[cuda13]", "nvidia-smi", "simulator")


@pytest.mark.parametrize("backend, reason", [
    ("cupy", "CuPy cannot allocate on a CUDA device (CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version "
             "is insufficient for CUDA runtime version)"),
    ("numba-cuda", "numba.cuda found no CUDA device; set NUMBA_ENABLE_CUDASIM=1 to use the simulator"),
])
def test_require_without_a_usable_gpu_gives_every_hint_its_docstring_promises(monkeypatch, backend, reason):
    """The reasons the probes give on a machine without a usable GPU, and require's message on top of them."""
    monkeypatch.setattr(gpu, "_probe", lambda b: (False, reason))
    with pytest.raises(RuntimeError) as info:
        gpu.require(backend)
    message = str(info.value)
    assert message.startswith(f"GPU backend {backend!r} is not available: {reason}")
    assert all(hint in message for hint in HINTS), message


def test_the_cupy_probe_here_and_require_agree_on_the_hints():
    usable, why = gpu.backend_status()["cupy"]
    if usable:
        pytest.skip(f"cupy runs here: {why}")
    with pytest.raises(RuntimeError) as info:
        gpu.require("cupy")
    assert why in str(info.value) and all(hint in str(info.value) for hint in HINTS), str(info.value)
