"""Command line.

``python -m refimpl verify [-k PATTERN] [--list]``
    every registered numerical verification of a derivation, one table;
``python -m refimpl experiment {recall,regression,scaling} [--quick] [--seeds N] [--jobs J] [--out DIR]``
    one of the experiments of :mod:`refimpl.experiments`: a sweep with a
    progress bar that prints a table and writes ``DIR/NAME.csv`` and
    ``DIR/NAME.png`` (``DIR`` defaults to ``results/NAME``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refimpl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser(
        "verify",
        help="run every registered numerical verification of a derivation and print one table",
    )
    p_verify.add_argument("-k", "--pattern", default=None, help="only checks whose name matches this shell pattern")
    p_verify.add_argument("--list", action="store_true", help="list the checks without running them")
    p_exp = sub.add_parser("experiment", help="run one experiment's sweep: table, CSV and plot")
    p_exp.add_argument("name", choices=("recall", "regression", "scaling"), help="which experiment")
    p_exp.add_argument("--quick", action="store_true", help="the small grid, seconds long")
    p_exp.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    p_exp.add_argument("--jobs", type=int, default=1, help="grid points run in parallel (default 1; -1: every core)")
    p_exp.add_argument("--out", default=None, help="folder of the result file and the plot (default results/NAME)")
    p_exp.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "experiment":
        return _experiment(args)

    from .verify import format_table, registry, run_checks

    if args.list:
        for name, check in registry().items():
            print(f"{name}  {check.description}  (tol {check.tol:.1e})")
        return 0
    results = run_checks(args.pattern)
    if not results:
        print(f"no check matches {args.pattern!r}", file=sys.stderr)
        return 2
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


def _experiment(args) -> int:
    import time
    from pathlib import Path

    from .experiments import load, sweep

    out = Path(args.out if args.out is not None else Path("results") / args.name)
    start = time.perf_counter()
    try:
        sweep.check_options(args.seeds, args.jobs)
        experiment = load(args.name)
        rows = sweep.run(experiment, quick=args.quick, seeds=args.seeds, jobs=args.jobs, out=out, progress=not args.no_progress)
    except ValueError as err:
        print(f"python -m refimpl experiment {args.name}: {err}", file=sys.stderr)
        return 2
    print(experiment.table(rows))
    experiment.plot(rows, out / f"{args.name}.png")
    print(f"\n{len(rows)} points in {time.perf_counter() - start:.1f} s; results in {out / (args.name + '.csv')}, "
          f"plot in {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
