"""Hidden cases of lesson 6's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: edge cases (one sample, one component), exact in closed form.
``ORACLE_CALLS``: answers that call the function the check compares with;
they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_06 as public

U = np.finfo(np.float64).eps

SEEDS = {"6.1": (1, 2), "6.2": (1, 2), "6.3": (1, 2), "6.4": (1,)}


def regression_one_sample(nadaraya_watson):
    """one sample (N_k = 1), queries far from it, beta = 1e4: every prediction is that sample's value"""
    rng = np.random.default_rng(6101)
    q, k, v = 10 * rng.normal(size=(6, 3)), rng.normal(size=(1, 3)), rng.normal(size=(1, 2))
    got = np.asarray(public._call(nadaraya_watson, q.copy(), k.copy(), v.copy(), 1e4))
    assert got.shape == (6, 2), f"N_k = 1: expected shape (6, 2), got {got.shape}"
    err = np.abs(got - v)
    assert np.all(np.isfinite(got)) and err.max() <= 4 * U * np.abs(v).max(), (
        f"N_k = 1, beta = 1e4: one sample's weight is 1 for every query; expected {v[0]}, got rows like {got[0]}")


def weights_one_component(gmr_weights):
    """one component (K = 1): the posterior is 1 for every query, at beta = 1 and beta = 1e4"""
    rng = np.random.default_rng(6201)
    q = rng.normal(size=(5, 3))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    for beta in (1.0, 1e4):
        got = np.asarray(public._call(gmr_weights, q.copy(), np.array([[0.6, 0.0, -0.3]]), np.ones(1), beta))
        assert got.shape == (5, 1), f"K = 1: expected shape (5, 1), got {got.shape}"
        assert np.all(np.abs(got - 1.0) <= 4 * U), f"K = 1, beta = {beta}: expected all ones, got {got.ravel()}"


CASES = {"6.1": [regression_one_sample], "6.2": [weights_one_component]}

ORACLE_CALLS = {
    "6.1": "def nadaraya_watson(q, k, v, beta):\n    return gmr.kernel_regression(q, k, v, beta=beta)\n",
    "6.2": "def gmr_weights(q, key_means, weights, beta):\n"
           "    return gmr.gmr_predict(q, key_means, np.eye(len(weights)), weights, beta=beta)\n",
    "6.3": "def readout_gap_bound(key_means, value_means, beta):\n"
           "    return gmr.readout_gap_bound(key_means, value_means, beta=beta)\n",
}
