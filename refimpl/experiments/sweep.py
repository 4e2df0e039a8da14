"""Run an experiment's grid: in parallel, with a progress bar, resumable from its result file.

An experiment is a module with

* ``NAME`` (str) and ``PARAMS``, the names of the columns that identify a
  grid point (``seed`` among them), and ``METRICS``, the names of the values
  a point produces; ``TIMINGS``, the metrics that are wall-clock
  measurements and so differ from run to run (possibly empty);
* ``grid(quick: bool, seeds: int) -> list[dict]``: the points, each a dict
  with a value for every name in ``PARAMS``;
* ``run_point(point: dict) -> dict``: the metrics of one point, from its own
  seed only, so that a point gives the same result in any process and order;
* ``table(rows) -> str`` and ``plot(rows, path)``: the summary of the finished
  rows (each a dict of ``PARAMS`` and ``METRICS``).

:func:`run` appends each finished point to ``OUT/NAME.csv`` as soon as it
is done, so an interrupted sweep loses at most the points in flight; run
again with the same ``--out``, it skips the points the file already holds.
At the end the file is rewritten in grid order (to a temporary file, then
renamed), so that its content does not depend on ``--jobs``.

The file is read back strictly (:func:`read_results`): a last line without
its newline (a row that a kill or a full disk cut short) is dropped, cut
from the file and its point run again; a file that is not UTF-8, a row that
is not complete, a metric that is not a finite number, and a point given
twice with different results are refused with the file and the line.  A
point whose metrics are not finite is refused too, and never written.
``OUT`` is refused before anything is written when it is an empty path, a
file, below a file or not writable
(:func:`refimpl.files.check_out_folder`).

The points run on joblib's default (process) backend.  On a cluster, the
same sweep runs on joblib's dask backend without a code change::

    from dask.distributed import Client
    from joblib import parallel_config
    from refimpl.experiments import load, sweep

    client = Client("scheduler-address:8786")
    with parallel_config(backend="dask"):
        sweep.run(load("recall"), quick=False, seeds=3, jobs=-1, out="results/recall")
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from joblib import Parallel, delayed

from .. import files

__all__ = ["run", "read_results", "point_key", "check_options"]


def point_key(experiment, point) -> tuple:
    """The identity of a grid point: its ``PARAMS`` values as text (what the CSV file holds)."""
    return tuple(str(point[name]) for name in experiment.PARAMS)


def _columns(experiment):
    return list(experiment.PARAMS) + list(experiment.METRICS)


def read_results(experiment, path) -> dict:
    """``{point_key: row}`` of a result file; metrics as floats, parameters as text.

    A last line without its newline is a row cut short: it is left out
    (its point is run again).

    Raises
    ------
    ValueError
        Naming the file, and the line where there is one: columns that are
        not the experiment's (a file from another experiment or another
        version is not silently mixed in), text that is not UTF-8, a row
        that is not complete, a metric that is not a finite number, or a
        point that two rows give different results.
    """
    return _check_results_file(experiment, Path(path), files.read_csv(path, "out"))


def _check_results_file(experiment, path, table) -> dict:
    """:func:`read_results` of a file already read (:func:`refimpl.files.read_csv`)."""
    if table.header is not None and table.header != _columns(experiment):
        raise ValueError(
            f"out: {path} has the columns {table.header}, expected {_columns(experiment)} for experiment "
            f"{experiment.NAME!r}; pass another --out or remove the file"
        )
    rows, lines = {}, {}
    n_params = len(experiment.PARAMS)
    for line, row in table.rows:
        try:
            if len(row) != len(_columns(experiment)):
                raise ValueError
            metrics = [float(text) for text in row[n_params:]]
        except ValueError:
            raise ValueError(f"out: {path}, line {line}, is not a complete row of numbers; remove the file or that line") from None
        bad = [(name, text) for name, text, value in zip(experiment.METRICS, row[n_params:], metrics) if not math.isfinite(value)]
        if bad:
            raise ValueError(f"out: {path}, line {line}: {bad[0][0]} = {bad[0][1]!r} is not a finite number; remove the file "
                             "or that line")
        key = tuple(row[:n_params])
        parsed = {**dict(zip(experiment.PARAMS, key)), **dict(zip(experiment.METRICS, metrics))}
        if key in rows and rows[key] != parsed:
            raise ValueError(f"out: {path}, lines {lines[key]} and {line}, give the point {dict(zip(experiment.PARAMS, key))} "
                             "two different results; remove one of them")
        rows[key], lines[key] = parsed, lines.get(key, line)
    return rows


def _run_one(name, point):
    from . import load  # in a worker process, the experiment module is imported by name

    experiment = load(name)
    metrics = experiment.run_point(dict(point))
    return {**{k: str(point[k]) for k in experiment.PARAMS}, **{k: float(metrics[k]) for k in experiment.METRICS}}


def check_options(seeds, jobs):
    """Refuse a number of seeds below 1 and a number of jobs that is neither >= 1 nor -1, naming the option."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds: expected an integer >= 1, got {seeds!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or (jobs < 1 and jobs != -1):
        raise ValueError(f"jobs: expected an integer >= 1, or -1 for every core, got {jobs!r}")


def run(experiment, *, quick: bool, seeds: int, jobs: int, out, progress: bool = True) -> list[dict]:
    """Run every point of the experiment's grid not yet in ``OUT/NAME.csv``; return all rows in grid order.

    A row is the point's dict (its values as the grid gave them) with the
    metrics added, as floats.  Rows in the file that belong to no point of
    this grid (from a ``--quick`` run into the same folder, say) are kept.

    Parameters
    ----------
    experiment : module
        One of :func:`refimpl.experiments.load`'s modules.
    quick : bool
        The small grid (seconds), for tests.
    seeds : int
        Seeds per configuration (>= 1).
    jobs : int
        Points run in parallel (joblib ``n_jobs``; -1 for every core).
    out : str or os.PathLike
        Folder of the result file ``NAME.csv`` and the plot ``NAME.png``
        (created if needed); not empty, not a file, writable.
    progress : bool, default True
        Show the tqdm progress bar (on standard error).

    Raises
    ------
    ValueError
        A bad option, an ``out`` that cannot be written, a results file that
        :func:`read_results` refuses (nothing is written then), or a point
        whose metrics are not finite.
    OSError
        The results file could not be written (its name is the error's
        ``filename``); the rows written so far stay, for the next run.
    """
    check_options(seeds, jobs)
    points = experiment.grid(quick, seeds)
    keys = [point_key(experiment, p) for p in points]
    if len(set(keys)) != len(keys):
        raise ValueError(f"experiment {experiment.NAME!r}: its grid repeats a point")
    out = files.check_out_folder(out, "out")
    path = out / f"{experiment.NAME}.csv"
    table = files.read_csv(path, "out") if path.exists() else None
    done = {} if table is None else _check_results_file(experiment, path, table)
    todo = [p for p, k in zip(points, keys) if k not in done]
    columns = _columns(experiment)
    new_file = not done
    with files.naming(path):
        out.mkdir(parents=True, exist_ok=True)
        if not new_file:
            # a last line without its newline was cut short: cut it off, its point runs again
            os.truncate(path, table.complete_bytes)
        with path.open("w" if new_file else "a", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            if new_file:
                writer.writeheader()
                f.flush()
            with files.progress_bar(total=len(points), initial=len(points) - len(todo), desc=experiment.NAME,
                                    disable=not progress) as bar:
                results = Parallel(n_jobs=jobs, return_as="generator_unordered")(
                    delayed(_run_one)(experiment.NAME, p) for p in todo
                )
                for row in results:
                    _check_finite_row(experiment, row)
                    writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
                    f.flush()
                    done[tuple(row[k] for k in experiment.PARAMS)] = row
                    bar.update()
        others = [row for k, row in done.items() if k not in set(keys)]  # another grid's rows (--quick, other seeds): kept
        _rewrite_in_grid_order(path, columns, [done[k] for k in keys] + others)
    return [{**p, **{m: done[k][m] for m in experiment.METRICS}} for p, k in zip(points, keys)]


def _check_finite_row(experiment, row):
    """Refuse a point whose metrics are not finite numbers (nothing is written for it)."""
    bad = [m for m in experiment.METRICS if not math.isfinite(row[m])]
    if bad:
        point = {k: row[k] for k in experiment.PARAMS}
        raise ValueError(f"experiment {experiment.NAME!r}: the point {point} gave {bad[0]} = {row[bad[0]]!r}, not a finite "
                         "number; nothing was written for it")


def _rewrite_in_grid_order(path, columns, rows):
    tmp = path.with_name(path.name + ".tmp")
    with files.naming(tmp), tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    os.replace(tmp, path)
