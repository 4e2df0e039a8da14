"""Command line.

``python -m refimpl verify [-k PATTERN] [--list] [--json]``
    every registered numerical verification of a derivation, one table
    (``--json``: one record per check, every error to the last digit).

Training the model and running the experiments belong to the application
built on the reference: ``python -m app train ...`` and ``python -m app
experiment ...``.  ``python -m refimpl train`` and ``python -m refimpl
experiment`` end with exit status 2 and one line that names the new command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

#: the commands that moved to ``python -m app``
MOVED = ("train", "experiment")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MOVED:
        print(f"python -m refimpl {argv[0]}: moved to python -m app {argv[0]}, with the same options: "
              f"{shlex.join(['python', '-m', 'app', *argv])}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m refimpl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser(
        "verify",
        help="run every registered numerical verification of a derivation and print one table",
    )
    p_verify.add_argument("-k", "--pattern", default=None, help="only checks whose name matches this shell pattern")
    p_verify.add_argument("--list", action="store_true", help="list the checks without running them")
    p_verify.add_argument("--json", action="store_true",
                          help="print the results as JSON, each error exact (repr of the float), instead of the table")
    args = parser.parse_args(argv)

    import fnmatch

    from .verify import format_table, registry, run_checks

    if args.list:
        listed = {n: c for n, c in registry().items() if args.pattern is None or fnmatch.fnmatch(n, args.pattern)}
        if not listed:
            print(f"no check matches {args.pattern!r}", file=sys.stderr)
            return 2
        for name, check in listed.items():
            print(f"{name}  {check.description}  (tol {check.tol:.1e})")
        return 0
    results = run_checks(args.pattern)
    if not results:
        print(f"no check matches {args.pattern!r}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"check": r.name, "error": repr(r.error), "tolerance": r.tol, "passed": r.passed} for r in results],
                         indent=1))
    else:
        print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
