"""Hidden cases of lesson 1's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise
(offsets, see ``course_grader.reseeded``).  ``CASES``: other sizes and edge
cases, each a function of the answer that ``assert``s, with the public
check's tolerance model.  ``ORACLE_CALLS``: answers that call the function the
check compares with, as a student would type them in the lesson (its imports
in scope); the checks must refuse them.
"""

from __future__ import annotations

import numpy as np
from scipy import special

import _exercises_01 as public

U = np.finfo(np.float64).eps

SEEDS = {"1.1": (1, 2), "1.2": (1, 2), "1.3": (1,), "1.4": (1, 2)}


def lse_one_column(logsumexp_rows):
    """one column (K = 1): the log-sum-exp of a single number is that number, to 8 u"""
    a = np.array([[3.5], [-1e300], [1e300], [0.0]])
    got = public._shape(logsumexp_rows(a.copy()), (4,), "logsumexp_rows of a 4 x 1 array")
    err = np.abs(got - a[:, 0]) / np.maximum(1.0, np.abs(a[:, 0]))
    assert np.all(err <= 8 * U), f"K = 1: rows {a[:, 0]} give {got}; log(exp(a)) is a itself"


def lse_wide_rows(logsumexp_rows):
    """64 columns with ties at the maximum and -inf entries"""
    rng = np.random.default_rng(1101)
    a = rng.normal(size=(30, 64)) * 10.0 ** rng.uniform(-2, 200, size=(30, 1))
    a[:, :3] = a.max(axis=1, keepdims=True)  # three entries tie at the row maximum
    a[::3, 10:40] = -np.inf
    with np.errstate(all="ignore"):
        got = public._shape(logsumexp_rows(a.copy()), (30,), "logsumexp_rows of a 30 x 64 array")
    ref = special.logsumexp(a, axis=1)
    # 64 terms in [0, 1] after the shift: the sum carries ~K u, relative to max(1, |result|); 2 K u allowed
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    i = int(np.nanargmax(np.where(np.isfinite(err), err, np.inf)))
    assert np.all(np.isfinite(got)) and err[i] <= 2 * 64 * U, (
        f"K = 64, ties and -inf entries: row {i} gives {got[i]!r}, SciPy {ref[i]!r} (relative error {err[i]:.1e}, "
        f"allowed {2 * 64 * U:.1e})")


def resp_one_component(stable_responsibilities):
    """one component (K = 1): every responsibility is exactly 1, however far the points"""
    x = np.array([[0.0, 1.0], [1e6, -1e6], [-3.0, 2.0]])
    with np.errstate(all="ignore"):
        got = stable_responsibilities(x.copy(), np.zeros((1, 2)), np.full((1, 2), 1e-6), np.ones(1))
    got = public._shape(got, (3, 1), "responsibilities of 3 points, 1 component")
    assert np.all(got == 1.0), f"K = 1: expected all ones, got {got.ravel()}"


def resp_one_point_high_dimension(stable_responsibilities):
    """a single point in d = 400 with unequal variances, against the definition in extended precision"""
    rng = np.random.default_rng(1201)
    means = rng.normal(size=(4, 400))
    variances = rng.uniform(0.2, 3.0, size=(4, 400))
    weights = rng.dirichlet(np.ones(4))
    x = means[1:2] + 0.3 * rng.normal(size=(1, 400))
    with np.errstate(all="ignore"):
        got = stable_responsibilities(x.copy(), means.copy(), variances.copy(), weights.copy())
    got = public._shape(got, (1, 4), "responsibilities of 1 point, 4 components")
    ref, log_joint = public._reference(x, means, variances, weights)
    tol = 16 * U * max(1.0, float(np.max(np.abs(log_joint))))  # the public check's tolerance
    err = float(np.max(np.abs(got - ref)))
    assert np.all(np.isfinite(got)) and err <= tol, (
        f"d = 400: {np.round(got[0], 6)}, the definition gives {np.round(ref[0], 6)} (error {err:.1e}, allowed {tol:.1e})")


CASES = {"1.1": [lse_one_column, lse_wide_rows], "1.2": [resp_one_component, resp_one_point_high_dimension]}

ORACLE_CALLS = {
    "1.1": "def logsumexp_rows(a):\n    return special.logsumexp(a, axis=1)\n",
    "1.2": "def stable_responsibilities(x, means, variances, weights):\n"
           "    return gmm.responsibilities(x, means, variances, weights)\n",
}
