"""GMM responsibilities: what the exactness refinement costs, and how they compare with scikit-learn.

Usage::

    python benchmarks/bench_gmm.py            # N = 200000, K = 64, d = 32, float64
    python benchmarks/bench_gmm.py --quick    # small sizes, a few seconds

What is measured, in one run (best of ``--repeats``, interleaved so that the
load of a shared machine falls on every variant alike):

* ``refimpl.gmm.responsibilities``, the public function;
* the same computation without the refinement: the core
  ``refimpl.gmm.log_joint(..., refine=False)`` then ``numerics.log_softmax``
  and ``exp``; the ratio of the two is the price of the exactness screen;
* scikit-learn's ``GaussianMixture(covariance_type="diag").predict_proba``
  with the same parameters set by hand;
* accuracy on the spread-means example of ``docs/derivations/gmm_posteriors.md``
  (two means near +1e4, one at -1e4, variances 1e-8), against the definition
  evaluated with the differences in extended precision, for all three.

"Ordinary" inputs: x and the means standard normal, variances uniform in
[0.5, 2], uniform weights.  Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refimpl import gmm, numerics  # noqa: E402
from refimpl.testing import exact_responsibilities, row_relative_error, sklearn_gmm, spread_means_example  # noqa: E402


def plain_responsibilities(x, means, variances, weights):
    """The centred expansion without the refinement: the fast path alone."""
    logits, _ = gmm.log_joint(x, means, variances, np.log(weights), refine=False)
    return np.exp(numerics.log_softmax(logits, axis=1))


def interleaved_best(fns, repeats):
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant (best is kept)")
    args = parser.parse_args(argv)
    N, K, d = (20_000, 16, 16) if args.quick else (200_000, 64, 32)
    repeats = args.repeats or (3 if args.quick else 5)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, NumPy {np.__version__}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, d))
    means = rng.normal(size=(K, d))
    variances = rng.uniform(0.5, 2.0, size=(K, d))
    weights = np.full(K, 1.0 / K)
    model = sklearn_gmm(means, variances, weights)
    same = np.array_equal(gmm.responsibilities(x, means, variances, weights), plain_responsibilities(x, means, variances, weights))
    times = interleaved_best(
        {
            "refimpl responsibilities": lambda: gmm.responsibilities(x, means, variances, weights),
            "expansion alone (no refinement)": lambda: plain_responsibilities(x, means, variances, weights),
            "scikit-learn predict_proba": lambda: model.predict_proba(x),
        },
        repeats,
    )
    print(f"\nordinary inputs, N = {N}, K = {K}, d = {d}, float64 (best of {repeats}):")
    for name, t in times.items():
        print(f"  {name:34s} {t * 1e3:9.1f} ms")
    print(f"  cost of the exactness screen:      {times['refimpl responsibilities'] / times['expansion alone (no refinement)'] - 1:+.1%}")
    print(f"  scikit-learn / refimpl:            {times['scikit-learn predict_proba'] / times['refimpl responsibilities']:.2f}x")
    print(f"  refined == expansion bit for bit:  {same} (no entry needed recomputing)")

    xs, ms, vs, ws = spread_means_example(n=200)
    exact = exact_responsibilities(xs, ms, vs, ws)
    with np.errstate(all="ignore"):
        errors = {
            "refimpl responsibilities": row_relative_error(gmm.responsibilities(xs, ms, vs, ws), exact),
            "expansion alone (no refinement)": row_relative_error(plain_responsibilities(xs, ms, vs, ws), exact),
            "scikit-learn predict_proba": row_relative_error(sklearn_gmm(ms, vs, ws).predict_proba(xs), exact),
        }
    print("\nspread means (two near +1e4, one at -1e4, variances 1e-8): largest relative error per row")
    for name, e in errors.items():
        print(f"  {name:34s} {e:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
