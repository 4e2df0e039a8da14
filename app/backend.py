"""Which kernels the model, training and the experiments call: NumPy, or the Numba CPU backend (:mod:`cpu`).

* ``"numpy"``: :mod:`refimpl.tuned` for GMA, :mod:`refimpl.attention` and
  :mod:`refimpl.ovq` for the other mixers;
* ``"numba"``: the fused kernels of :mod:`cpu`.

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


def kernels(name=None) -> Kernels:
    """The functions of backend ``name`` (:func:`current` by default)."""
    name = current() if name is None else check_backend(name)
    if name == "numba":
        from cpu import attention as a, gma as g, ovq as o

        return Kernels(
            name, g.gma, g.gma_forward, g.gma_backward, a.softmax_attention_forward, a.softmax_attention_backward,
            a.linear_attention_forward, a.linear_attention_backward, o.ovq_attention, o.ovq_attention_forward,
            o.ovq_attention_backward, o.vq_attention,
        )
    from refimpl import attention as a, ovq as o, tuned as g

    return Kernels(
        name, g.gma, g.gma_forward, g.gma_backward, a.softmax_attention_forward, a.softmax_attention_backward,
        a.linear_attention_forward, a.linear_attention_backward, o.ovq_attention, o.ovq_attention_forward,
        o.ovq_attention_backward, o.vq_attention,
    )
