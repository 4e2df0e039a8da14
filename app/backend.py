"""Which kernels the model, training and the experiments call: NumPy, or the Numba CPU backend (:mod:`cpu`).

* ``"numpy"``: :mod:`refimpl.tuned` for GMA, :mod:`refimpl.attention` and
  :mod:`refimpl.ovq` for the other mixers, one sequence and head at a time;
* ``"numba"``: for each mixer the faster of :mod:`cpu`'s kernels and
  NumPy's at the sizes the application runs (:data:`FASTEST`), every
  sequence and head of a batch in one call.

Both give the same results to rounding (``tests/test_backend.py``).  The
choice, in order: :func:`use`, else the environment variable
``REFIMPL_BACKEND`` (which the worker processes of an experiment inherit),
else ``"numba"`` when numba is installed and ``"numpy"`` otherwise.
``python -m app train`` and ``python -m app experiment`` take
``--backend numpy|numba``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import numpy as np

__all__ = ["BACKENDS", "ENV", "Kernels", "available", "current", "check_backend", "kernels", "use"]

BACKENDS = ("numpy", "numba")
ENV = "REFIMPL_BACKEND"

_chosen: list[str | None] = [None]

#: The implementation the ``"numba"`` backend takes for each mixer's functions, ``"cpu"`` (:mod:`cpu`) or ``"numpy"``:
#: the faster in one ListOps training step at the defaults (batch 32, 41 tokens, d_model 32, 2 heads), each variant
#: in its own process (``python benchmarks/bench_cpu.py --sections training``, which also times cpu's kernels for a
#: mixer set to ``"numpy"`` here).  On 2026-12-05, 2 cores: GMA 9.4 ms with cpu against 25.9 ms with NumPy, softmax
#: 11.7 against 15.5, linear 15.1 against 16.5, OVQ 13.4 against 58.3: cpu for every mixer.
FASTEST = {"gma": "cpu", "softmax": "cpu", "linear": "cpu", "ovq": "cpu"}


class Kernels(NamedTuple):
    """The functions a backend gives the model and the experiments (each with :mod:`refimpl`'s signature)."""

    name: str
    gma: object
    gma_forward: object
    gma_backward: object
    softmax_attention_forward: object
    softmax_attention_backward: object
    linear_attention_forward: object
    linear_attention_backward: object
    ovq_attention: object
    ovq_attention_forward: object
    ovq_attention_backward: object
    vq_attention: object
    batched: bool  # whether the attention and OVQ functions take leading (batch, head) dimensions


def available() -> bool:
    """Whether numba can be imported, without importing it."""
    return importlib.util.find_spec("numba") is not None


def check_backend(name, what="backend") -> str:
    """``name`` if it is one of :data:`BACKENDS` and can run here; a ``ValueError`` saying why otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    if name == "numba" and not available():
        raise ValueError(f"{what}: 'numba' needs numba, which is not installed (pip install numba, or choose 'numpy')")
    return name


def use(name) -> str:
    """Choose the backend for this process (``None``: back to the environment or the default); returns the previous choice."""
    previous = _chosen[0]
    _chosen[0] = None if name is None else check_backend(name)
    return previous


def current() -> str:
    """The backend in use: :func:`use`'s choice, else ``$REFIMPL_BACKEND``, else numba when installed."""
    if _chosen[0] is not None:
        return _chosen[0]
    if os.environ.get(ENV):
        return check_backend(os.environ[ENV], ENV)
    return "numba" if available() else "numpy"


class PerSequenceCache(NamedTuple):
    """The caches of a 2-D function called once per sequence of a batch (:func:`per_sequence`)."""

    leading: tuple
    caches: tuple


def per_sequence(forward, backward):
    """A 2-D ``forward(q, k, v, **options) -> (out, cache)`` and its ``backward(grad, cache) -> grads`` as
    functions of ``(..., N, d)`` batches, one sequence at a time (what the model would loop over otherwise)."""

    def batched_forward(q, k, v, **options):
        leading = q.shape[:-2]
        results = [forward(q[i], k[i], v[i], **options) for i in np.ndindex(leading)]
        out = np.stack([r[0] for r in results]).reshape(leading + results[0][0].shape)
        return out, PerSequenceCache(leading, tuple(r[1] for r in results))

    def batched_backward(grad_out, cache):
        grads = [backward(grad_out[i], c) for i, c in zip(np.ndindex(cache.leading), cache.caches)]
        first = grads[0]
        return type(first)(*(np.stack([g[f] for g in grads]).reshape(cache.leading + first[f].shape) for f in range(len(first))))

    return batched_forward, batched_backward


def kernels(name=None) -> Kernels:
    """The functions of backend ``name`` (:func:`current` by default)."""
    name = current() if name is None else check_backend(name)
    from refimpl import attention as ra, ovq as ro, tuned

    if name == "numba":
        from cpu import attention as ca, gma as cg, ovq as co

        fast = {m: FASTEST[m] == "cpu" for m in FASTEST}
        g = cg if fast["gma"] else tuned
        softmax = (ca.softmax_attention_forward, ca.softmax_attention_backward) if fast["softmax"] else per_sequence(
            ra.softmax_attention_forward, ra.softmax_attention_backward)
        linear = (ca.linear_attention_forward, ca.linear_attention_backward) if fast["linear"] else per_sequence(
            ra.linear_attention_forward, ra.linear_attention_backward)
        ovq = (co.ovq_attention, co.ovq_attention_forward, co.ovq_attention_backward, co.vq_attention)
        if not fast["ovq"]:
            ovq = (ro.ovq_attention, *per_sequence(ro.ovq_attention_forward, ro.ovq_attention_backward), ro.vq_attention)
        return Kernels(name, g.gma, g.gma_forward, g.gma_backward, *softmax, *linear, *ovq, True)
    return Kernels(
        name, tuned.gma, tuned.gma_forward, tuned.gma_backward, ra.softmax_attention_forward, ra.softmax_attention_backward,
        ra.linear_attention_forward, ra.linear_attention_backward, ro.ovq_attention, ro.ovq_attention_forward,
        ro.ovq_attention_backward, ro.vq_attention, False,
    )
