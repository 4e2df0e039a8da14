"""Every variant timed in its own fresh process: the harness of ``bench_cpu.py``.

Why
---
Two functions timed in one process share what the first leaves behind: the
allocator's free lists and its thresholds, the huge pages the kernel has to
find for the next large array, the BLAS and Numba thread pools still
spinning, the caches.  Measured on this project's 2-core machine,
scikit-learn's ``predict_proba`` took 2 to 3 times as long when the float32
variants of the responsibilities ran in the same rounds as when it ran
alone, all of the extra time in the kernel (page faults), none in its own
code (``docs/performance_gmm.md`` has the measurement).  A ratio between two
such times says as much about the order of the calls as about the code.

How
---
The parent process never times anything.  For each of ``processes`` rounds
it starts, for every variant in turn (the order reversed every other round,
so that no variant always follows the same one), a fresh Python process that
builds the variant's inputs, makes one untimed call (first-touch page faults,
compilation or loading of cached kernels, thread-pool start-up), then times
``calls`` calls and prints their wall-clock times, and its user and system
CPU times, as one JSON line.  A variant's time is its best call over all its
processes (on a shared machine other work only ever adds time, so the best
is the least disturbed estimate); the spread printed beside it is the range
of the processes' bests, and says how far the processes agree.  Ratios are
of best times.

A variant is a name and a zero-argument function returning the callable to
time, in a module the child imports by path (``--child``); the peer in
another environment (PyTorch) is a command line instead
(:class:`Command`).  ``same_process=True`` runs every variant in the parent,
one call of each per round, the way the benchmarks used to: ``--quick``
uses it as a smoke test of the scripts (nothing it prints is a measurement),
and ``docs/performance_gmm.md`` uses it to show what a shared process does.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["Command", "Timings", "child_main", "machine", "run_variants", "time_calls"]


class Command(NamedTuple):
    """A variant run by its own command line (another interpreter, a peer's environment); it prints :func:`time_calls`'s JSON line."""

    argv: list
    env: dict = {}


class Timings(NamedTuple):
    """Per variant: each process's best call (s), all its calls, and the (user, system) CPU seconds of its timed calls."""

    best: dict
    calls: dict
    cpu: dict

    def time(self, name):
        """The best call over all the processes."""
        return float(min(self.best[name]))

    def spread(self, name):
        return min(self.best[name]), max(self.best[name])

    def ratio(self, a, b):
        return self.time(a) / self.time(b)

    def system_share(self, name):
        """System (kernel) time as a share of all CPU time of the timed calls, over every process."""
        user = sum(u for u, _ in self.cpu[name])
        system = sum(s for _, s in self.cpu[name])
        return system / max(user + system, 1e-12)


def time_calls(fn, calls):
    """One untimed call, then ``calls`` timed ones: ``{"times": [...], "user": s, "system": s}``."""
    fn()
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"times": times, "user": r1.ru_utime - r0.ru_utime, "system": r1.ru_stime - r0.ru_stime}


def child_main(variants, name, calls):
    """In the child: build variant ``name`` of ``variants`` (name -> factory), time it, print one JSON line."""
    fn = variants[name]()
    print("RESULT " + json.dumps(time_calls(fn, calls)), flush=True)
    return 0


def _run_child(argv, env, timeout):
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} without a result:\n{proc.stdout}\n{proc.stderr}")


def run_variants(names, child_argv, *, processes, calls, same_process=None, timeout=1800, progress=True):
    """Time every variant of ``names``.

    Parameters
    ----------
    names : list of str
    child_argv : callable
        ``child_argv(name, calls)`` -> a :class:`Command` (or a list of
        arguments) that runs variant ``name`` in a fresh process.
    processes, calls : int
        Processes per variant, timed calls per process.
    same_process : dict, optional
        name -> factory: run every variant here instead, one call of each
        per round over ``processes * calls`` rounds (the old way).
    """
    best = {n: [] for n in names}
    all_calls = {n: [] for n in names}
    cpu = {n: [] for n in names}
    if same_process is not None:
        fns = {n: same_process[n]() for n in names}
        for fn in fns.values():
            fn()
        used = {n: [0.0, 0.0] for n in names}
        for _ in range(processes * calls):
            for n, fn in fns.items():
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                fn()
                all_calls[n].append(time.perf_counter() - start)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                used[n][0] += r1.ru_utime - r0.ru_utime
                used[n][1] += r1.ru_stime - r0.ru_stime
        for n in names:
            best[n] = [min(all_calls[n])]
            all_calls[n] = [all_calls[n]]
            cpu[n] = [tuple(used[n])]
        return Timings(best, all_calls, cpu)
    for rnd in range(processes):
        order = names if rnd % 2 == 0 else names[::-1]
        for n in order:
            cmd = child_argv(n, calls)
            if not isinstance(cmd, Command):
                cmd = Command(list(cmd))
            result = _run_child(cmd.argv, cmd.env, timeout)
            best[n].append(min(result["times"]))
            all_calls[n].append(result["times"])
            cpu[n].append((result["user"], result["system"]))
            if progress:
                print(f"      [{rnd + 1}/{processes}] {n:44s} {min(result['times']) * 1e3:9.1f} ms", file=sys.stderr, flush=True)
    return Timings(best, all_calls, cpu)


def machine():
    """One line: CPU model, cores, the versions that set the speed."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, NumPy {np.__version__}; load average {load}")
