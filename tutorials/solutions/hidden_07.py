"""Hidden cases of lesson 7's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: edge cases (one component, batches of one point), exact or with
the public check's tolerance models.  ``ORACLE_CALLS``: answers that call
the function the check compares with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_07 as public

U = np.finfo(np.float64).eps

SEEDS = {"7.1": (1, 2), "7.2": (1, 2), "7.3": (1, 2), "7.4": (1,)}


def gradient_one_component(nll_gradient):
    """one component (K = 1): every responsibility is 1, so g = beta sum_i (mu - x_i)"""
    rng = np.random.default_rng(7101)
    x, means = rng.normal(size=(30, 2)), rng.normal(size=(1, 2))
    for beta in (0.5, 4.0):
        got = np.asarray(public._call(nll_gradient, x.copy(), means.copy(), beta, np.ones(1)))
        assert got.shape == (1, 2), f"K = 1: expected shape (1, 2), got {got.shape}"
        expected = beta * np.sum(means - x, axis=0, keepdims=True)
        tol = 4 * 30 * U * beta * np.sum(np.abs(means - x), axis=0).max()  # a sum of 30 terms, in two orders
        assert np.all(np.abs(got - expected) <= tol), f"K = 1, beta = {beta}: got {got}, beta sum_i (mu - x_i) = {expected}"


def running_mean_one_point_at_a_time(running_mean_update):
    """batches of one point into one row (K = 1) from a count of 0: the running mean is the mean of the prefix"""
    rng = np.random.default_rng(7301)
    x = rng.normal(size=(12, 2)) + 5.0
    mu, counts = np.full((1, 2), 123.0), np.zeros(1, dtype=np.int64)
    for i in range(12):
        out = public._call(running_mean_update, mu.copy(), counts.copy(), x[i:i + 1].copy(), np.zeros(1, dtype=np.int64))
        assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (means, counts), got {type(out).__name__}"
        mu, counts = np.asarray(out[0]), np.asarray(out[1])
        assert counts.tolist() == [i + 1], f"after {i + 1} points the count is {counts.tolist()}, expected [{i + 1}]"
        expected = x[:i + 1].mean(axis=0)
        tol = 4 * (i + 1) * U * np.abs(x).max()  # each fold rounds a few times (the public check's model)
        assert np.all(np.abs(mu[0] - expected) <= tol), (
            f"after {i + 1} points one at a time the mean is {mu[0]}, the mean of those points {expected}")


CASES = {"7.1": [gradient_one_component], "7.3": [running_mean_one_point_at_a_time]}

ORACLE_CALLS = {
    "7.1": "def nll_gradient(x, means, beta, weights):\n    return gmm.isotropic_nll_gradient(x, means, beta, weights)\n",
    "7.2": "def nll_hessian(x, means, beta, weights):\n"
           "    K, d = means.shape\n"
           "    H = np.empty((K * d, K * d))\n"
           "    for j in range(K * d):\n"
           "        e = np.zeros(K * d)\n"
           "        e[j] = 1e-5\n"
           "        H[:, j] = (gmm.isotropic_nll_gradient(x, means + e.reshape(K, d), beta, weights)\n"
           "                   - gmm.isotropic_nll_gradient(x, means - e.reshape(K, d), beta, weights)).ravel() / 2e-5\n"
           "    return H\n",
    "7.3": "def running_mean_update(means, counts, x, assign):\n"
           "    return gmm.running_mean_update(means, counts, x, assign)\n",
}
