"""Command line: ``python -m refimpl verify [-k PATTERN] [--list]``."""

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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
