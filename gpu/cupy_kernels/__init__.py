"""gpu.cupy_kernels: the CuPy backend of :mod:`refimpl`, GEMMs through cuBLAS and the rest in fused kernels.

The same public functions as :mod:`gpu.numba_cuda`, with the same arguments,
defaults, results and errors: both are bound from :mod:`refimpl.boundary`
(each function's signature, docstring and checks written once) to their
kernels.  :data:`on_host` holds the same functions computed with NumPy in
place of CuPy, each fused kernel by its NumPy twin: they run anywhere.  CuPy arrays in give CuPy arrays out; NumPy
arrays in are computed on the device and come back as NumPy arrays.  Without
a usable device the functions raise a ``RuntimeError`` naming the backend.

Each public call copies to the host once, at its end: the counters of its
result checks (:func:`result_checks` turns them off: no copy at all).
:func:`launch_count` is the number of kernels launched and cuBLAS calls made
since import (:func:`count_launches` counts a block), and :func:`tf32` lets
float32 GEMMs use TF32 tensor cores (off by default).
"""

from refimpl import boundary

from . import _backend
from . import attention as _attention
from . import gma as _gma
from . import gmm as _gmm
from . import ovq as _ovq
from ._backend import count_launches, host_copy_count, launch_count, result_checks, tf32
from .attention import softmax_attention
from .gma import GMADeviceCache, gma, gma_backward, gma_forward
from .gmm import log_responsibilities, responsibilities
from .ovq import ovq_attention, vq_attention

#: The backend's record: every kernel of its modules, and how it moves arrays.
BACKEND = _backend.backend({**_gmm.KERNELS, **_gma.KERNELS, **_attention.KERNELS, **_ovq.KERNELS})

#: The same public functions computed with NumPy in place of CuPy (each fused kernel by its NumPy twin): on any machine.
on_host = boundary.bind(_backend.on_host(BACKEND), module="gpu.cupy_kernels.on_host")

__all__ = [
    "log_responsibilities",
    "responsibilities",
    "gma",
    "gma_forward",
    "gma_backward",
    "GMADeviceCache",
    "softmax_attention",
    "ovq_attention",
    "vq_attention",
    "launch_count",
    "host_copy_count",
    "count_launches",
    "tf32",
    "result_checks",
]
