"""The registry of numerical verifications behind ``python -m refimpl verify``.

A *check* is a function of no arguments that recomputes one derivation two
independent ways (or evaluates one bound) and returns a nonnegative number:
the largest error it measured.  It passes when that number is finite and at
most the tolerance it was registered with.  Checks live in the modules of
:mod:`refimpl.checks`, one per topic, and register themselves on import::

    from refimpl.verify import register

    @register("gmm.rows_sum_to_one", "responsibility rows sum to 1", tol=1e-12)
    def _():
        ...
        return float(np.max(np.abs(resp.sum(1) - 1)))

Every check seeds its own random generator, so the table is the same on
every run.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Check", "CheckResult", "register", "registry", "run_checks", "format_table"]


@dataclass(frozen=True)
class Check:
    """One registered verification."""

    name: str
    description: str
    tol: float
    func: Callable[[], float]


@dataclass(frozen=True)
class CheckResult:
    """The outcome of running a :class:`Check`."""

    name: str
    description: str
    error: float
    tol: float
    passed: bool
    seconds: float
    exception: str | None = None


_REGISTRY: dict[str, Check] = {}


def _where(func) -> tuple:
    # the same source location may register twice (a module reloaded); another may not
    code = getattr(func, "__code__", None)
    return (func.__module__, func.__qualname__, code.co_filename if code else None, code.co_firstlineno if code else None)


def register(name: str, description: str, *, tol: float):
    """Decorator that adds a check to the registry under a unique ``name``."""
    if not (np.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite number >= 0, got {tol!r}")

    def deco(func: Callable[[], float]) -> Callable[[], float]:
        if name in _REGISTRY and _where(_REGISTRY[name].func) != _where(func):
            raise ValueError(f"a check named {name!r} is already registered")
        _REGISTRY[name] = Check(name, description, float(tol), func)
        return func

    return deco


def _load_checks() -> None:
    from . import checks

    for info in pkgutil.iter_modules(checks.__path__):
        importlib.import_module(f"{checks.__name__}.{info.name}")


def registry() -> dict[str, Check]:
    """All registered checks (importing every module of :mod:`refimpl.checks`), by name."""
    _load_checks()
    return dict(sorted(_REGISTRY.items()))


def run_checks(pattern: str | None = None) -> list[CheckResult]:
    """Run the checks whose names match the shell-style ``pattern`` (all by default)."""
    results = []
    for name, check in registry().items():
        if pattern is not None and not fnmatch.fnmatch(name, pattern):
            continue
        start = time.perf_counter()
        try:
            error = float(check.func())
            exc = None
        except Exception as e:  # a check that crashes is reported as failed, not hidden
            error, exc = float("nan"), f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        passed = exc is None and np.isfinite(error) and 0 <= error <= check.tol
        results.append(CheckResult(name, check.description, error, check.tol, bool(passed), seconds, exc))
    return results


def format_table(results: list[CheckResult]) -> str:
    """A plain-text table: check, what it verifies, max error, tolerance, result."""
    header = ("check", "verifies", "max error", "tolerance", "result")
    rows = [
        (
            r.name,
            r.description,
            f"{r.error:.2e}",
            f"{r.tol:.1e}",
            ("pass" if r.passed else "FAIL") + ("" if r.exception is None else f" ({r.exception})"),
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    n_fail = sum(not r.passed for r in results)
    out.append(line)
    out.append(f"{len(results) - n_fail}/{len(results)} checks passed in {sum(r.seconds for r in results):.1f} s")
    return "\n".join(out)
