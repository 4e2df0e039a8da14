"""gpu.cupy_kernels: the CuPy backend of :mod:`refimpl`, GEMMs through cuBLAS and the rest in fused kernels.

The same public functions as :mod:`gpu.numba_cuda`, with the same arguments,
defaults, results and errors.  CuPy arrays in give CuPy arrays out; NumPy
arrays in are computed on the device and come back as NumPy arrays.  Without
a usable device the functions raise a ``RuntimeError`` naming the backend.

Each public call copies to the host once, at its end: the counters of its
result checks (:func:`result_checks` turns them off: no copy at all).
:func:`launch_count` is the number of kernels launched and cuBLAS calls made
since import (:func:`count_launches` counts a block), and :func:`tf32` lets
float32 GEMMs use TF32 tensor cores (off by default).
"""

from ._backend import count_launches, host_copy_count, launch_count, result_checks, tf32
from .attention import softmax_attention
from .gma import GMADeviceCache, gma, gma_backward, gma_forward
from .gmm import log_responsibilities, responsibilities
from .ovq import ovq_attention, vq_attention

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
