"""Experiments that check the papers' claims in miniature: ``python -m app experiment NAME``.

Each experiment is a module of this package with the same small interface
(:class:`app.experiments.sweep.Experiment`): a grid of points, a function
that runs one point, a table and a plot.  :func:`app.experiments.sweep.run`
runs a grid in parallel with joblib, shows a tqdm progress bar, writes every
finished point to a CSV file at once and, when run again, resumes from that
file.  The experiments have no training: they test the memory mechanisms
(what a context written into GMA's slots or OVQ's dictionaries lets a query
read back), not a learned model.
"""

from __future__ import annotations

import importlib

__all__ = ["EXPERIMENTS", "load"]

#: The experiments, by the name the command line takes.
EXPERIMENTS = ("recall", "regression", "scaling", "continual", "positional")


def load(name: str):
    """The module of experiment ``name`` (one of :data:`EXPERIMENTS`)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment: expected one of {', '.join(EXPERIMENTS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
