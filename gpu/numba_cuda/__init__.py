"""gpu.numba_cuda: CUDA kernels written in Python with Numba, mirroring :mod:`refimpl` function for function.

Every public function has the name, arguments, defaults, results and error
messages of the :mod:`refimpl` function it mirrors, and is tested against
it:

* :func:`~gpu.numba_cuda.gmm.log_responsibilities` and
  :func:`~gpu.numba_cuda.gmm.responsibilities` mirror :mod:`refimpl.gmm`
  (one fused kernel: log-densities, log-sum-exp, normalise);
* :func:`~gpu.numba_cuda.attention.softmax_attention` mirrors
  :func:`refimpl.attention.softmax_attention` (a tiled online softmax);
* :func:`~gpu.numba_cuda.gma.gma`, :func:`~gpu.numba_cuda.gma.gma_forward` and
  :func:`~gpu.numba_cuda.gma.gma_backward` mirror :mod:`refimpl.gma` (the
  scan of :mod:`gpu.numba_cuda.scan`);
* :func:`~gpu.numba_cuda.ovq.ovq_attention` and
  :func:`~gpu.numba_cuda.ovq.vq_attention` mirror :mod:`refimpl.ovq` (a host
  loop over chunks; the state stays on the device).

``gma``, ``gma_forward``/``gma_backward`` and ``softmax_attention`` take
leading batch and head dimensions ``(..., N, d)``, with one GMM per head
``(H, K, d_r)``; every sequence runs in the same launch.

NumPy arrays in give NumPy arrays out.  Numba device arrays, or any object
with ``__cuda_array_interface__`` (a CuPy array, say), give Numba device
arrays out, never copied to the host.  float32 and float64 are both
supported, and the dtype follows the inputs.  Every reduction is done in a
fixed order (no float atomics), so two runs give the same bits.

Each kernel carries, above its definition, the formula it computes (in the
words of the :mod:`refimpl` line it mirrors) and how its work maps to
threads, blocks and shared memory.  Without a GPU, the kernels run in the
CUDA simulator (:func:`gpu.use_simulator_without_device`, before numba is
imported), where block sizes are smaller; the code is the same.  Lesson 9
(``tutorials/09_gpu_kernels.ipynb``) teaches how they are written.
"""

from .attention import softmax_attention
from .gma import GMADeviceCache, gma, gma_backward, gma_forward
from .gmm import log_responsibilities, responsibilities
from .ovq import ovq_attention, vq_attention

__all__ = [
    "log_responsibilities",
    "responsibilities",
    "softmax_attention",
    "gma",
    "gma_forward",
    "gma_backward",
    "GMADeviceCache",
    "ovq_attention",
    "vq_attention",
]
