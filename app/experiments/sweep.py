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
(:func:`refimpl.validation.check_out_folder`).

The points run on joblib's default (process) backend, or, with
``scheduler``, on a dask.distributed cluster (:func:`dask_client`, :func:`dask_rows`): an
existing one at a scheduler address (``tcp://host:8786``; started by
``dask scheduler`` and ``dask worker``, or by dask-jobqueue), or a
``LocalCluster`` of N worker processes (``"local:N"``).  The cluster path
uses ``distributed.Client`` directly, one future per point, taken with
``as_completed`` as each finishes, so that rows reach the file in the same
way as joblib's ``return_as="generator_unordered"``.  A point whose worker
dies is run again by the scheduler on another worker (dask reschedules the
tasks of a lost worker); its row is written once, when it comes back.  A
sweep stopped for good (every worker gone, ``SIGINT``) resumes from the file
like any other.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import uuid
from pathlib import Path

from joblib import Parallel, delayed

from refimpl import validation

from .. import files

__all__ = ["run", "read_results", "point_key", "check_options", "parse_scheduler", "dask_client", "dask_rows", "WorkerLost"]

#: Seconds to wait for a dask scheduler to answer before the sweep is refused.
CONNECT_TIMEOUT_S = 10


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
    """:func:`read_results` of a file already read (:func:`app.files.read_csv`)."""
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


def _row(experiment, point, metrics):
    return {**{k: str(point[k]) for k in experiment.PARAMS}, **{k: float(metrics[k]) for k in experiment.METRICS}}


def _run_one(name, point):
    from . import load  # in a worker process, the experiment module is imported by name

    experiment = load(name)
    return _row(experiment, point, experiment.run_point(dict(point)))


def _run_on_worker(module_name, point, backend_name):
    """One point on a dask worker: its experiment module imported by name, with the client's ``--backend``."""
    import importlib

    from .. import backend

    experiment = importlib.import_module(module_name)
    previous = backend.use(backend_name)  # None: the worker's own $REFIMPL_BACKEND or default
    try:
        return _row(experiment, point, experiment.run_point(dict(point)))
    finally:
        backend.use(previous)


def parse_scheduler(text):
    """``("local", N)`` for ``"local:N"``, else ``("address", text)``: where a sweep's points run on dask.

    Raises
    ------
    ValueError
        ``local:`` without an integer N >= 1, or an empty address.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"scheduler: expected a dask scheduler address such as tcp://host:8786, or local:N, got {text!r}")
    if text.startswith("local:"):
        n = text[len("local:"):]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"scheduler: local:N takes a number of worker processes N >= 1, got {text!r}")
        return "local", int(n)
    return "address", text.strip()


@contextlib.contextmanager
def dask_client(scheduler):
    """A ``distributed.Client`` of the cluster ``scheduler`` (see :func:`parse_scheduler`), closed at the end.

    ``"local:N"`` starts a ``LocalCluster`` of N worker processes (one
    thread each, TCP on 127.0.0.1, no dashboard) and closes it too; an
    address connects to a running scheduler.  Every worker must be able to
    import the project (the same version) and the experiment's module.  dask
    sets each nanny-started worker's BLAS and OpenMP threads to 1.

    Raises
    ------
    ValueError
        A bad ``scheduler``, or no scheduler at the address within
        :data:`CONNECT_TIMEOUT_S` seconds.
    ImportError
        dask.distributed is not installed.
    """
    kind, where = parse_scheduler(scheduler)
    try:
        from distributed import Client, LocalCluster
    except ImportError as err:
        raise ImportError("--scheduler needs dask.distributed: pip install distributed") from err
    with contextlib.ExitStack() as stack:
        if kind == "local":
            cluster = stack.enter_context(LocalCluster(n_workers=where, threads_per_worker=1, processes=True,
                                                       host="127.0.0.1", dashboard_address=None))
            where = cluster.scheduler_address
        try:
            client = stack.enter_context(Client(where, timeout=CONNECT_TIMEOUT_S))
        except (OSError, TimeoutError) as err:
            raise ValueError(f"scheduler: no dask scheduler answered at {where!r} within {CONNECT_TIMEOUT_S} s ({err})") from None
        yield client


class WorkerLost(RuntimeError):
    """A point whose workers died more often than the scheduler allows (``distributed.scheduler.allowed-failures``)."""


def dask_rows(client, experiment, points):
    """Yield the row of each point as it finishes on ``client``'s cluster, one future per point.

    ``$REFIMPL_BACKEND`` of this process (what ``--backend`` sets) is passed
    with every point; unset, the workers use their own default.  Closing the
    generator cancels the points still pending.

    Raises
    ------
    WorkerLost
        A point's workers died more times than the scheduler's
        ``allowed-failures`` (3 by default); the rows already written stay,
        and a run again resumes from them.
    """
    from distributed import KilledWorker, as_completed

    from .. import backend

    chosen = os.environ.get(backend.ENV) or None
    futures = [client.submit(_run_on_worker, experiment.__name__, dict(p), chosen, pure=False,
                             key=f"{experiment.NAME}-{'-'.join(point_key(experiment, p))}-{uuid.uuid4().hex[:8]}")
               for p in points]
    try:
        for future in as_completed(futures):
            try:
                yield future.result()
            except KilledWorker as err:
                point = dict(points[futures.index(future)])
                raise WorkerLost(f"the point {point} was given up after the workers running it died ({err}); its worker "
                                 "may run out of memory, or the cluster lost its machines") from None
    finally:
        client.cancel([f for f in futures if not f.done()])


def check_options(seeds, jobs):
    """Refuse a number of seeds below 1 and a number of jobs that is neither >= 1 nor -1, naming the option."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds: expected an integer >= 1, got {seeds!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or (jobs < 1 and jobs != -1):
        raise ValueError(f"jobs: expected an integer >= 1, or -1 for every core, got {jobs!r}")


def run(experiment, *, quick: bool, seeds: int, jobs: int, out, progress: bool = True, scheduler=None) -> list[dict]:
    """Run every point of the experiment's grid not yet in ``OUT/NAME.csv``; return all rows in grid order.

    A row is the point's dict (its values as the grid gave them) with the
    metrics added, as floats.  Rows in the file that belong to no point of
    this grid (from a ``--quick`` run into the same folder, say) are kept.

    Parameters
    ----------
    experiment : module
        One of :func:`app.experiments.load`'s modules.
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
    scheduler : str, optional
        Run the points on a dask cluster instead of joblib (:func:`dask_rows`):
        a scheduler address, or ``"local:N"`` for a ``LocalCluster`` of N
        worker processes.  ``jobs`` must then be 1 (the workers set the
        parallelism).

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
    if scheduler is not None:
        parse_scheduler(scheduler)
        if jobs != 1:
            raise ValueError(f"jobs: the dask cluster's workers run the points in parallel; leave --jobs out with --scheduler "
                             f"(got {jobs!r})")
    points = experiment.grid(quick, seeds)
    keys = [point_key(experiment, p) for p in points]
    if len(set(keys)) != len(keys):
        raise ValueError(f"experiment {experiment.NAME!r}: its grid repeats a point")
    out = validation.check_out_folder(out, "out")
    path = out / f"{experiment.NAME}.csv"
    table = files.read_csv(path, "out") if path.exists() else None
    done = {} if table is None else _check_results_file(experiment, path, table)
    todo = [p for p, k in zip(points, keys) if k not in done]
    columns = _columns(experiment)
    new_file = not done
    with contextlib.ExitStack() as cluster:
        # connect before the file is touched: a scheduler that does not answer writes nothing
        client = cluster.enter_context(dask_client(scheduler)) if scheduler is not None and todo else None
        _run_points(experiment, todo, jobs, client, path, out, table, new_file, columns, done, len(points), progress)
    others = [row for k, row in done.items() if k not in set(keys)]  # another grid's rows (--quick, other seeds): kept
    with files.naming(path):
        _rewrite_in_grid_order(path, columns, [done[k] for k in keys] + others)
    return [{**p, **{m: done[k][m] for m in experiment.METRICS}} for p, k in zip(points, keys)]


def _run_points(experiment, todo, jobs, client, path, out, table, new_file, columns, done, total, progress):
    """Run ``todo`` on joblib (``client`` None) or the dask cluster, appending each row to ``path`` as it comes."""
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
            with files.progress_bar(total=total, initial=total - len(todo), desc=experiment.NAME,
                                    disable=not progress) as bar:
                if client is None:
                    results = Parallel(n_jobs=jobs, return_as="generator_unordered")(
                        delayed(_run_one)(experiment.NAME, p) for p in todo
                    )
                else:
                    results = dask_rows(client, experiment, todo)
                with contextlib.closing(results):
                    for row in results:
                        _check_finite_row(experiment, row)
                        writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
                        f.flush()
                        done[tuple(row[k] for k in experiment.PARAMS)] = row
                        bar.update()


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
