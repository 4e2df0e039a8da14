"""Which kernels the model, training and the experiments call: NumPy, or the Numba CPU backend (:mod:`cpu`).

* ``"numpy"``: :mod:`refimpl.tuned` for GMA, :mod:`refimpl.attention` and
  :mod:`refimpl.ovq` for the other mixers;
* ``"numba"``: for each mixer the faster of :mod:`cpu`'s kernels and
  NumPy's at the sizes the application runs (:data:`FASTEST`).

Both take every sequence and head of a batch in one call (leading
dimensions).

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


def _mixers(gma, attention, ovq) -> dict:
    """The functions of each mixer, from a GMA module and an attention and an OVQ module of one implementation."""
    return {
        "gma": (gma.gma, gma.gma_forward, gma.gma_backward),
        "softmax": (attention.softmax_attention_forward, attention.softmax_attention_backward),
        "linear": (attention.linear_attention_forward, attention.linear_attention_backward),
        "ovq": (ovq.ovq_attention, ovq.ovq_attention_forward, ovq.ovq_attention_backward, ovq.vq_attention),
    }


def kernels(name=None) -> Kernels:
    """The functions of backend ``name`` (:func:`current` by default)."""
    name = current() if name is None else check_backend(name)
    from refimpl import attention, ovq, tuned

    chosen = _mixers(tuned, attention, ovq)
    if name == "numba":
        from cpu import attention as cpu_attention, gma as cpu_gma, ovq as cpu_ovq

        fast = _mixers(cpu_gma, cpu_attention, cpu_ovq)
        chosen = {mixer: fast[mixer] if FASTEST[mixer] == "cpu" else functions for mixer, functions in chosen.items()}
    return Kernels(name, *chosen["gma"], *chosen["softmax"], *chosen["linear"], *chosen["ovq"])
