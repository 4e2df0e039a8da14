"""Worked solutions to the lessons' exercises (``lesson_NN.py``), with the near misses each check must catch."""

from __future__ import annotations

import numpy as np


def off_by(answer, rel):
    """``answer`` with every float it returns multiplied by ``1 + rel``: an error that is small but real.

    A near miss made with it sits above its check's tolerance and below
    that tolerance loosened a millionfold: the check fails it, and a check
    whose tolerance was loosened that much would let it pass, which
    ``tests/test_exercises.py`` then reports.

    Parameters
    ----------
    answer : callable
        A worked solution.
    rel : float
        The relative error to give every float of its result (arrays,
        scalars, and those inside tuples, named tuples and dicts).

    Returns
    -------
    callable
        Takes the arguments of ``answer``.
    """

    def scale(out):
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            return type(out)(*map(scale, out))
        if isinstance(out, tuple):
            return tuple(map(scale, out))
        if isinstance(out, dict):
            return {k: scale(v) for k, v in out.items()}
        if isinstance(out, np.ndarray) and out.dtype.kind == "f":
            return out * out.dtype.type(1 + rel)
        if isinstance(out, (float, np.floating)):
            return type(out)(out * (1 + rel))
        return out

    def nudged(*args, **kwargs):
        return scale(answer(*args, **kwargs))

    return nudged
