"""Command line of the application: training the model and running the experiments.

``python -m app experiment {recall,regression,scaling,continual,positional} [--quick] [--seeds N] [--jobs J | --scheduler S] [--out DIR]``
    one of the experiments of :mod:`app.experiments`: a sweep with a
    progress bar that prints a table and writes ``DIR/NAME.csv`` and
    ``DIR/NAME.png`` (``DIR`` defaults to ``results/NAME``); its points run
    in J local processes, or on a dask cluster (``--scheduler
    tcp://host:8786``, or ``--scheduler local:N`` for N worker processes);
``python -m app train --task listops|markov --mixer gma|softmax|linear|ovq [options]``
    train the model of :mod:`app.model` (:mod:`app.train`): a progress
    bar, ``DIR/log.csv``, a checkpoint ``DIR/checkpoint.npz`` that ``--resume``
    continues bit for bit, and the final validation and test accuracy
    (``DIR`` defaults to ``results/train/TASK-MIXER-seedS``).

A user error (a bad option, an ``--out`` that is empty, a file or not
writable, a damaged checkpoint, log or results file, a diverging run, a
file that cannot be written) ends the command with exit status 2 and one
line on standard error that names the option or the file (and line),
without a traceback.  ``SIGINT`` and ``SIGTERM`` stop ``train`` and
``experiment`` cleanly (the sweep's worker processes with them), with
exit status 130 and 143 and a line that says how to continue.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_exp = sub.add_parser("experiment", help="run one experiment's sweep: table, CSV and plot")
    p_exp.add_argument("name", choices=("recall", "regression", "scaling", "continual", "positional"), help="which experiment")
    p_exp.add_argument("--quick", action="store_true", help="the small grid, seconds long")
    p_exp.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    p_exp.add_argument("--jobs", type=int, default=None, help="grid points run in parallel (default 1; -1: every core)")
    p_exp.add_argument("--scheduler", default=None,
                       help="run the points on a dask cluster: its scheduler's address (tcp://host:8786), or local:N to start "
                            "a LocalCluster of N worker processes")
    p_exp.add_argument("--out", default=None, help="folder of the result file and the plot (default results/NAME)")
    p_exp.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_backend_option(p_exp)
    _add_train_parser(sub)
    args = parser.parse_args(argv)

    if not _choose_backend(args):
        return 2
    with _terminate_as_interrupt():
        return _experiment(args) if args.command == "experiment" else _train(args)


class Terminated(KeyboardInterrupt):
    """``SIGTERM``, raised where ``SIGINT`` raises ``KeyboardInterrupt``, so that the same clean-up runs."""


def raise_terminated(signum, frame):
    """The ``SIGTERM`` handler of ``train`` and ``experiment``: raise :class:`Terminated`."""
    raise Terminated(signum)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Within the block, ``SIGTERM`` raises :class:`Terminated` (joblib then stops its workers, as on ``SIGINT``)."""
    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted_status(err) -> int:
    # the shell's convention: 128 + the signal's number
    return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)


def _option_names(message: str, names: dict) -> str:
    """The message with its leading ``field:`` written as the option (``steps: ...`` -> ``--steps: ...``)."""
    return re.sub(r"^(\w+):", lambda m: names.get(m.group(1), m.group(1)) + ":", message)


def _check_sweep_options(args) -> int:
    """The number of jobs (1 when not given); refuse ``--jobs`` with ``--scheduler``, and a bad value of either."""
    from .experiments import sweep

    if args.scheduler is not None and args.jobs is not None:
        raise ValueError("scheduler: the dask cluster's workers run the points in parallel; pass --scheduler or --jobs, "
                         "not both")
    jobs = 1 if args.jobs is None else args.jobs
    sweep.check_options(args.seeds, jobs)
    if args.scheduler is not None:
        sweep.parse_scheduler(args.scheduler)
    return jobs


def _experiment(args) -> int:
    import time

    from . import files
    from .experiments import load, sweep

    prog = f"python -m app experiment {args.name}"
    out = args.out if args.out is not None else str(Path("results") / args.name)
    result_file = Path(out) / f"{args.name}.csv"
    resume = f"the finished points are in {result_file}: run the same command again to continue"
    start = time.perf_counter()
    try:
        jobs = _check_sweep_options(args)
        experiment = load(args.name)
        rows = sweep.run(experiment, quick=args.quick, seeds=args.seeds, jobs=jobs, out=out, progress=not args.no_progress,
                         scheduler=args.scheduler)
        print(experiment.table(rows))
        plot = Path(out) / f"{args.name}.png"
        with files.naming(plot):
            experiment.plot(rows, plot)
    except ValueError as err:
        names = {"seeds": "--seeds", "jobs": "--jobs", "out": "--out", "scheduler": "--scheduler"}
        print(f"{prog}: {_option_names(str(err), names)}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{prog}: cannot write {err.filename or out} ({err.strerror or err}); {resume}", file=sys.stderr)
        return 2
    except sweep.WorkerLost as err:
        print(f"{prog}: {err}; {resume}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"{prog}: interrupted; {resume}", file=sys.stderr)
        return _interrupted_status(err)
    print(f"\n{len(rows)} points in {time.perf_counter() - start:.1f} s; results in {result_file}, plot in {plot}")
    return 0


# the options of ``train`` that set a TrainConfig field: (option, field, type, help)
_TRAIN_OPTIONS = (
    ("--seed", "seed", int, "seed of the initial parameters and the data order"),
    ("--data-seed", "data_seed", int, "seed of the data splits"),
    ("--steps", "steps", int, "training steps"),
    ("--batch-size", "batch_size", int, "sequences per step"),
    ("--lr", "lr", float, "peak learning rate (AdamW)"),
    ("--warmup", "warmup", int, "steps of linear warm-up"),
    ("--weight-decay", "weight_decay", float, "decoupled weight decay"),
    ("--clip", "clip", float, "clip the gradients to this global norm (0: no clipping)"),
    ("--d-model", "d_model", int, "width of the residual stream"),
    ("--layers", "layers", int, "residual blocks"),
    ("--heads", "heads", int, "heads of the mixer"),
    ("--components", "components", int, "GMA components per head (K)"),
    ("--d-route", "d_route", int, "GMA routing dimensions per head"),
    ("--mlp-hidden", "mlp_hidden", int, "hidden width of the MLP"),
    ("--eval-every", "eval_every", int, "steps between evaluations (and checkpoints)"),
    ("--n-train", "n_train", int, "training sequences"),
    ("--n-val", "n_val", int, "validation sequences"),
    ("--n-test", "n_test", int, "test sequences"),
)


def _add_backend_option(p):
    p.add_argument(
        "--backend", choices=("numpy", "numba"), default=None,
        help="the kernels (app.backend): numba's fused CPU kernels, the default when numba is installed, or NumPy",
    )


def _choose_backend(args) -> bool:
    """Set the backend of ``--backend`` for this process and its workers (the environment); False after an error message."""
    from . import backend

    if args.backend is None:
        return True
    try:
        backend.use(args.backend)
    except ValueError as err:
        print(f"python -m app {args.command}: --{err}", file=sys.stderr)
        return False
    os.environ[backend.ENV] = args.backend  # the experiments' worker processes inherit it
    return True


def _add_train_parser(sub):
    from .train import TrainConfig, quick_config

    defaults, quick = TrainConfig(), quick_config()
    p = sub.add_parser("train", help="train a model on ListOps-mini or the Markov source: progress bar, CSV log, checkpoints")
    p.add_argument("--task", required=True, choices=("listops", "markov"), help="the task")
    p.add_argument("--mixer", required=True, choices=("gma", "softmax", "linear", "ovq"), help="the token mixer")
    for option, field, kind, text in _TRAIN_OPTIONS:
        small = getattr(quick, field)
        shown = f"default {getattr(defaults, field)}" + (f", --quick {small}" if small != getattr(defaults, field) else "")
        p.add_argument(option, dest=field, type=kind, default=None, help=f"{text} ({shown})")
    p.add_argument("--pack", action="store_true",
                   help="pack every batch without its padding (cu_seqlens) rather than pad it (default off)")
    p.add_argument("--out", default=None, help="folder of the log, the checkpoint and the result (default results/train/TASK-MIXER-seedS)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out (pass its options again)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step with a checkpoint, as an interruption would")
    p.add_argument("--quick", action="store_true", help="tiny sizes, a run of seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_backend_option(p)


def _train(args) -> int:
    from . import train

    prog = "python -m app train"
    options = {field: option for option, field, _, _ in _TRAIN_OPTIONS}
    given = {field: getattr(args, field) for field in options if getattr(args, field) is not None}
    seed = train.TrainConfig().seed if args.seed is None else args.seed
    out = args.out if args.out is not None else str(Path("results") / "train" / f"{args.task}-{args.mixer}-seed{seed}")

    def next_step() -> str:
        checkpoint = Path(out) / train.CHECKPOINT_NAME
        if checkpoint.exists():
            return f"the last checkpoint is {checkpoint}: continue with the same options and --resume"
        return "no checkpoint was written, so there is nothing to resume: run the same command again, without --resume"

    try:
        base = train.quick_config() if args.quick else train.TrainConfig()
        config = train.check_train_config(base._replace(task=args.task, mixer=args.mixer, pack=bool(args.pack), **given))
        result = train.train(config, out, resume=args.resume, progress=not args.no_progress, stop_after=args.stop_after)
    except ValueError as err:
        # name the option, not the field: "steps: ..." -> "--steps: ..."
        names = {**options, "stop_after": "--stop-after", "resume": "--resume", "out": "--out"}
        print(f"{prog}: {_option_names(str(err), names)}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{prog}: cannot write {err.filename or out} ({err.strerror or err}); {next_step()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"{prog}: interrupted; {next_step()}", file=sys.stderr)
        return _interrupted_status(err)
    print(train.format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
