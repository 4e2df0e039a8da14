"""gpu: the GPU backends of the reference.

:mod:`gpu.numba_cuda` holds Numba-CUDA kernels that mirror :mod:`refimpl`
function for function (same names, arguments, results and errors), written
thread by thread to be read, and tested against the reference.
:mod:`gpu.cupy_kernels` has the same functions on CuPy: the matrix products
through cuBLAS, the rest in fused kernels whose CUDA C sources NVRTC compiles.

On a machine with a GPU, install the extra that matches the CUDA driver
(``nvidia-smi`` prints the highest CUDA version the driver supports in its
header)::

    pip install -e '.[cuda12]'   # driver reports CUDA 12.x
    pip install -e '.[cuda13]'   # driver reports CUDA 13.x

Without a GPU, the same kernels run in the CUDA simulator (every thread a
Python thread: tiny sizes only).  Numba reads ``NUMBA_ENABLE_CUDASIM`` once,
when it is first imported, so choose first::

    import gpu
    gpu.use_simulator_without_device()   # before anything imports numba
    import gpu.numba_cuda as nc

A backend that cannot be used is never replaced silently by ``None``:
:func:`require` raises an error that says which backend is missing and how to
install it, and :func:`backend_status` reports every backend's state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import sys

__all__ = ["BACKENDS", "backend_status", "require", "use_simulator_without_device"]

BACKENDS = ("numba-cuda", "cupy")

_INSTALL_HINT = (
    "install the GPU extra that matches your driver: pip install -e '.[cuda12]' or "
    "pip install -e '.[cuda13]' (nvidia-smi shows the driver's CUDA version); "
    "without a GPU, set NUMBA_ENABLE_CUDASIM=1 before importing numba to use the simulator"
)

#: What :func:`require` adds to a reason that does not already say it.
_REQUIRE_HINT = (
    "on a machine with an NVIDIA GPU, install the extra that matches the CUDA version in the header of nvidia-smi: "
    "pip install -e '.[cuda12]' (CUDA 12.x) or pip install -e '.[cuda13]' (CUDA 13.x); without a GPU, gpu.numba_cuda "
    "runs the same functions in the CUDA simulator: call gpu.use_simulator_without_device() before numba is imported "
    "(NUMBA_ENABLE_CUDASIM=1)"
)


def _probe(backend: str) -> tuple[bool, str]:
    if backend == "numba-cuda":
        try:
            cuda = importlib.import_module("numba.cuda")
        except ImportError as e:
            return False, f"numba.cuda cannot be imported ({e}); {_INSTALL_HINT}"
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return True, "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): gpu.numba_cuda runs on the CPU, at tiny sizes only"
        try:
            if cuda.is_available():
                name = cuda.get_current_device().name
                name = name.decode() if isinstance(name, bytes) else name
                return True, f"gpu.numba_cuda runs on the device {name}"
        except Exception as e:  # driver present but broken
            return False, f"numba.cuda found no usable device ({type(e).__name__}: {e})"
        return False, "numba.cuda found no CUDA device; set NUMBA_ENABLE_CUDASIM=1 to use the simulator"
    if backend == "cupy":
        # import cupy works without a GPU; the probe allocates one element, which is what fails there
        from .cupy_kernels._backend import probe

        return probe()
    raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def backend_status() -> dict[str, tuple[bool, str]]:
    """Whether each backend can run here, and why or why not.

    Returns
    -------
    dict
        ``{backend: (usable, explanation)}`` for every name in :data:`BACKENDS`.
    """
    return {b: _probe(b) for b in BACKENDS}


def require(backend: str) -> None:
    """Raise ``RuntimeError`` naming the missing backend and how to install it, unless it can run.

    The message says why the backend cannot run, then what to do: the
    extra that matches the driver (``[cuda12]`` or ``[cuda13]``), where to
    read the driver's CUDA version (the header of ``nvidia-smi``), and, for
    a machine without a GPU, the CUDA simulator.

    Parameters
    ----------
    backend : {'numba-cuda', 'cupy'}
    """
    ok, why = _probe(backend)
    if not ok:
        hint = "" if all(word in why for word in ("[cuda12]", "[cuda13]", "nvidia-smi", "simulator")) else f"; {_REQUIRE_HINT}"
        raise RuntimeError(f"GPU backend {backend!r} is not available: {why}{hint}")


def _cuda_device_count() -> int:
    """CUDA devices the driver sees, asked through ``libcuda`` directly (0 without a driver): numba stays unimported."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def use_simulator_without_device() -> str:
    """Choose where Numba-CUDA kernels run, before numba is imported: a GPU if there is one, else the simulator.

    Sets ``NUMBA_ENABLE_CUDASIM=1`` when the CUDA driver reports no device
    (or there is no driver), so that the same code runs everywhere: on a GPU
    at full speed, elsewhere in the CUDA simulator (every thread a Python
    thread: tiny sizes only).  A value the user has already set is kept.
    Numba reads the variable once, when it is first imported, so this must
    run before that (the test suite's ``conftest.py`` and lesson 9 call it
    first).

    Returns
    -------
    str
        ``"simulator"`` or ``"device"``: where the kernels will run.

    Raises
    ------
    RuntimeError
        If numba is already imported with a different choice than the one
        asked for (it would be silently ignored).
    """
    wanted = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if wanted is None:
        wanted = "0" if _cuda_device_count() > 0 else "1"
        if "numba" in sys.modules and wanted == "1":
            raise RuntimeError(
                "NUMBA_ENABLE_CUDASIM: numba is already imported without the simulator and there is no CUDA device; "
                "set NUMBA_ENABLE_CUDASIM=1 before numba is first imported (first line of the script or notebook)"
            )
        os.environ["NUMBA_ENABLE_CUDASIM"] = wanted
    return "simulator" if wanted == "1" else "device"
