"""gpu.numba_cuda: CUDA kernels written in Python with Numba, mirroring :mod:`refimpl` function for function.

Every public function has the name, arguments, defaults, results and error
messages of the :mod:`refimpl` function it mirrors: it is bound from
:mod:`refimpl.boundary`, which writes each one's signature, docstring and
checks once, to this package's kernels (``_device.backend`` is its record),
and held to the reference by ``tests/test_conformance.py``:

* :func:`~gpu.numba_cuda.gmm.log_responsibilities` and
  :func:`~gpu.numba_cuda.gmm.responsibilities` mirror :mod:`refimpl.gmm`
  (per-component constants, then one register-tiled kernel: each thread a
  tile of rows by components, the quadratic form from the differences, the
  coordinates staged in shared memory, the row softmax fused into its
  epilogue);
* :func:`~gpu.numba_cuda.attention.softmax_attention` mirrors
  :func:`refimpl.attention.softmax_attention` (a tiled online softmax, each
  thread a register tile of queries by keys);
* :func:`~gpu.numba_cuda.gma.gma`, :func:`~gpu.numba_cuda.gma.gma_forward` and
  :func:`~gpu.numba_cuda.gma.gma_backward` mirror :mod:`refimpl.gma` (the
  responsibilities above, then the scan of :mod:`gpu.numba_cuda.scan`, whose
  chunk states are prefix-summed by a work-efficient tree);
* :func:`~gpu.numba_cuda.ovq.ovq_attention` and
  :func:`~gpu.numba_cuda.ovq.vq_attention` mirror :mod:`refimpl.ovq` (OVQ's
  chunk loop in one cooperative launch for all the sequences of a call, VQ's
  two launches per chunk; the read-out split over key tiles and merged; the
  state stays on the device).

The device functions several kernels share (the online softmax's running
pair, ordered block reductions, the tree scan) are written once, in
``gpu.numba_cuda._primitives``.  Beside each tuned kernel,
:mod:`gpu.numba_cuda.plain` has a plain one (one thread per output element,
no shared memory), bound as a backend of its own: the second opinion of
``python -m gpu check`` when a tuned kernel's test fails, and what lesson 9
reads first.

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
threads, blocks and shared memory.  Each module gives the grid and block of
every launch as a pure function of the shapes, ``launch_geometry``, within
the GPU's limits for any size.  Every kernel is declared with
``_device.kernel``, with the block size it is launched with, what it is for
(its tags) and its compile options (launch bounds), so that the tests compile
exactly what runs: to PTX for sm_90 and sm_80, then through ``ptxas`` and
``cuobjdump`` for its registers, spills, shared memory, occupancy and the
instruction mix of its work loop (:mod:`gpu.sass`), all without a GPU; the
compute kernels declare the work they must do and the work their tiles make
them do (:mod:`gpu.work`), which the gates compare with that loop, and
``benchmarks/gpu_model.py`` turns these into an estimate of each function on
an H200, labelled as an estimate.  Without a GPU, the kernels run in the CUDA
simulator (:func:`gpu.use_simulator_without_device`, before numba is
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
