"""The CPU backend as a record of kernels: what its docstrings say of it, around the kernels each module supplies."""

from __future__ import annotations

from refimpl import boundary

__all__ = ["backend"]

SUMMARY = (
    "Computed by the fused Numba kernels of :mod:`cpu`, every reduction in an order fixed by the data (the same bits "
    "with one thread or many)."
)


def backend(kernels, **words) -> boundary.Backend:
    """The CPU backend with ``kernels`` (a module's share of them: :func:`refimpl.boundary.bind` binds its names).

    ``words`` are the record's docstring fields (``replace``, ``notes``) where the module's functions need them.
    """
    return boundary.Backend("cpu", SUMMARY, kernels, **words)
