"""gpu.cupy_kernels: the CuPy backend of :mod:`refimpl`, GEMMs through cuBLAS and the rest in fused kernels.

The same public functions as :mod:`gpu.numba_cuda`, with the same arguments,
defaults, results and errors.  CuPy arrays in give CuPy arrays out; NumPy
arrays in are computed on the device and come back as NumPy arrays.  Without
a usable device the functions raise a ``RuntimeError`` naming the backend.
"""

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
]
