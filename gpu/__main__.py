"""``python -m gpu``: the GPU check, the workload its sanitizer runs, and the check that the CUDA extras resolve.

Commands::

    python -m gpu check --out DIR [--dry-run] [--budget S]   # validate both backends on the GPU, write DIR/gpu-check.{json,md}
    python -m gpu workload [--backend NAME]     # every public function once, at small sizes
    python -m gpu second-opinion [--function F]  # the plain and the tuned kernels against the reference
    python -m gpu resolve-extras                # pip --dry-run of .[dev,cuda12] and .[dev,cuda13]
    python -m gpu resolve-extras --gpu-stack-only   # the same for what CUDA constrains only (seconds)

:mod:`gpu.check` describes the stages, the budget and the dry run.  A bad
argument ends the command with exit status 2 and one line on standard
error.
"""

from __future__ import annotations

import argparse
import sys

from . import BACKENDS, check


def _parser():
    parser = argparse.ArgumentParser(prog="python -m gpu", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="validate both backends on the GPU and write the numbers")
    p.add_argument("--out", required=True, help="folder for gpu-check.json, gpu-check.md and the stages' logs")
    p.add_argument("--dry-run", action="store_true", help="every stage in the CUDA simulator at tiny sizes (no GPU needed)")
    p.add_argument("--budget", default=check.BUDGET_S, metavar="S",
                   help=f"seconds for the whole check (default {check.BUDGET_S}); each stage's limit is its share, "
                        f"{check.MAX_SHARE:.0%} of it in all")
    p = sub.add_parser("workload", help="call every public function of each backend once, at small sizes")
    p.add_argument("--backend", action="append", choices=BACKENDS, help="a backend (repeatable); both by default")
    p.add_argument("--tiny", action="store_true", help="sizes for the CUDA simulator")
    p = sub.add_parser("second-opinion", help="the plain and the tuned Numba-CUDA kernels, each against the reference")
    p.add_argument("--function", action="append", choices=list(check.SECOND_OPINION), help="a function (repeatable); all by default")
    p.add_argument("--tiny", action="store_true", help="sizes for the CUDA simulator")
    p = sub.add_parser("resolve-extras", help="check with pip --dry-run that .[dev,cuda12] and .[dev,cuda13] resolve")
    p.add_argument("--extra", action="append", choices=sorted(check.EXTRAS), help="an extra (repeatable); both by default")
    p.add_argument("--gpu-stack-only", action="store_true",
                   help="resolve only the project's dependencies, dev's numba and numba-cuda, and the extra (seconds, not a minute)")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        try:
            return check.run_check(args.out, dry_run=args.dry_run, budget=args.budget)
        except ValueError as err:
            parser.exit(2, f"python -m gpu check: error: {err}\n")
    if args.command == "workload":
        for line in check.run_workload(tuple(args.backend or BACKENDS), tiny=args.tiny):
            print(f"workload: {line}")
        return 0
    if args.command == "second-opinion":
        return _second_opinion(args)
    return check.resolve_extras(tuple(args.extra or check.EXTRAS), whole=not args.gpu_stack_only)


def _second_opinion(args) -> int:
    """Print each function's verdict, then one line ``OPINION [json]`` (what the check reads); 0 when all agree."""
    import json

    from . import use_simulator_without_device

    use_simulator_without_device()
    results = check.run_second_opinion(tuple(args.function or check.SECOND_OPINION), tiny=args.tiny)
    for r in results:
        print(f"second opinion: {r['function']}: {r['verdict']} (plain {r['plain']}, tuned {r['tuned']})")
    print("OPINION " + json.dumps(results))
    return 0 if all(r["plain_agrees"] and r["tuned_agrees"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
