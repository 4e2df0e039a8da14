"""gpu: the GPU backends (Numba-CUDA and CuPy) of the reference.

The kernels mirror :mod:`refimpl` and are tested against it.  Both backends
are optional: install the extra that matches the CUDA driver (``nvidia-smi``
prints the highest CUDA version the driver supports in its header)::

    pip install -e '.[cuda12]'   # driver reports CUDA 12.x
    pip install -e '.[cuda13]'   # driver reports CUDA 13.x

Without a GPU, Numba-CUDA kernels run in the CUDA simulator: set
``NUMBA_ENABLE_CUDASIM=1`` before numba is imported.

A backend that cannot be used is never replaced silently by ``None``:
:func:`require` raises an error that says which backend is missing and how to
install it, and :func:`backend_status` reports every backend's state.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["BACKENDS", "backend_status", "require"]

BACKENDS = ("numba-cuda", "cupy")

_INSTALL_HINT = (
    "install the GPU extra that matches your driver: pip install -e '.[cuda12]' or "
    "pip install -e '.[cuda13]' (nvidia-smi shows the driver's CUDA version); "
    "without a GPU, set NUMBA_ENABLE_CUDASIM=1 before importing numba to use the simulator"
)


def _probe(backend: str) -> tuple[bool, str]:
    if backend == "numba-cuda":
        try:
            cuda = importlib.import_module("numba.cuda")
        except ImportError as e:
            return False, f"numba.cuda cannot be imported ({e}); {_INSTALL_HINT}"
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return True, "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU"
        try:
            if cuda.is_available():
                return True, f"device: {cuda.get_current_device().name}"
        except Exception as e:  # driver present but broken
            return False, f"numba.cuda found no usable device ({type(e).__name__}: {e})"
        return False, "numba.cuda found no CUDA device; set NUMBA_ENABLE_CUDASIM=1 to use the simulator"
    if backend == "cupy":
        try:
            cupy = importlib.import_module("cupy")
        except ImportError as e:
            return False, f"cupy cannot be imported ({e}); {_INSTALL_HINT}"
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            return False, f"cupy found no usable device ({type(e).__name__}: {e})"
        if n < 1:
            return False, "cupy found no CUDA device"
        return True, f"{n} device(s)"
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

    Parameters
    ----------
    backend : {'numba-cuda', 'cupy'}
    """
    ok, why = _probe(backend)
    if not ok:
        raise RuntimeError(f"GPU backend {backend!r} is not available: {why}")
