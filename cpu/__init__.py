"""cpu: fused Numba kernels for the CPU, mirroring :mod:`refimpl` function for function.

The middle of the three layers: :mod:`refimpl` is the NumPy reference,
written from the equations; :mod:`cpu` computes the same functions with
``@njit`` kernels (``prange`` over rows or columns, one pass over ``N x K``
where the math allows); :mod:`gpu` has them as CUDA kernels.  Every public
function has the name, arguments, defaults, results and error messages of
the :mod:`refimpl` function it mirrors: those it shares with the GPU
backends are bound from :mod:`refimpl.boundary`, which writes each one's
signature, docstring and checks once, to this package's kernels.  They are
held to the reference by ``tests/test_conformance.py`` with every other
backend, and the rest by ``tests/test_cpu_*.py``:

* :mod:`cpu.gmm`: ``responsibilities`` and ``log_responsibilities`` from
  the differences ``x - mu`` (exact for every input, no screen);
* :mod:`cpu.scan`: the causal scan and its backward as one contraction with
  a running state;
* :mod:`cpu.gma`: ``gma``, ``gma_forward``, ``gma_backward``, bidirectional
  and causal, with batches and heads;
* :mod:`cpu.attention`: softmax attention as an online softmax (no
  ``N x N`` matrix), forward and backward, and linear attention;
* :mod:`cpu.ovq`: OVQ and VQ attention;
* :mod:`cpu.vexp`: the exponential every kernel uses, written so that LLVM
  vectorises the loops that call it (within 2 ulp of :func:`numpy.exp` at a
  million points and at the edges; correctly rounded but rarely in float32).

float32 inputs are computed in float32, float64 is the default, and every
reduction runs in an order fixed by the data, so a result is the same bits
with one thread or many.  The kernels are compiled on first use and cached
on disk (``cache=True``: ``__pycache__`` beside the sources), so later runs
start at once.  The model, ``python -m app train`` and the experiments
call this package when numba is installed (:mod:`app.backend`).
"""
