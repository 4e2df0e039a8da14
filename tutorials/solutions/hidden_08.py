"""Hidden cases of lesson 8's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: edge cases (integers beyond float64, a chunk of one key, one
position reading only itself), exact.  ``ORACLE_CALLS``: answers that call
the function the check compares with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_08 as public
from refimpl import ovq

SEEDS = {"8.1": (1,), "8.2": (1, 2), "8.3": (1,), "8.4": (1, 2)}


def plateau_huge_integers(plateau_size):
    """t and n_max far beyond 2**53: the floor in exact integers"""
    for t, n_max in ((10**30, 10**20), (10**40 + 7, 3), (1, 10**25), (10**18 - 1, 10**18)):
        got = public._call(plateau_size, t, n_max)
        expected = max(1, t * n_max // (t + n_max))
        assert isinstance(got, (int, np.integer)) and int(got) == expected, (
            f"plateau_size({t}, {n_max}) = {got!r}, expected {expected}")


def assign_one_key(assign_chunk):
    """a chunk of one key: the first chunk of a stream, and one joining a dictionary of three"""
    khat = np.array([[0.6, 0.8]])
    three = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    cases = ((np.empty((0, 2)), 1, "first chunk, n_add = 1"), (three, 0, "n = 3, n_add = 0"), (three, 1, "n = 3, n_add = 1"))
    for dict_keys, n_add, where in cases:
        rows, _, seeds = ovq._plan_chunk(khat, dict_keys, dict_keys.shape[0], n_add, "spread", 0, 0)
        public._check_plan(assign_chunk, khat, dict_keys, n_add, rows, seeds, f"one key, {where}")


def readout_one_position(readout_backward):
    """one position reading only itself (n = 0, L = 1): the weight is 1, so d_qhat = d_keys = 0 and d_values = G"""
    qhat, keys = np.array([[0.6, 0.8]]), np.array([[0.0, 1.0]])
    values, G = np.array([[2.0, -1.0, 0.5]]), np.array([[0.3, 0.1, -2.0]])
    got = public._call(readout_backward, qhat.copy(), keys.copy(), values.copy(), np.empty(0), 1.5, G.copy())
    assert isinstance(got, tuple) and len(got) == 3, "expected a tuple (d_qhat, d_keys, d_values)"
    for name, mine, expected in zip(("d_qhat", "d_keys", "d_values"), got, (np.zeros((1, 2)), np.zeros((1, 2)), G)):
        mine = np.asarray(mine)
        assert mine.shape == expected.shape and np.all(np.abs(mine - expected) <= 1e-15), (
            f"n = 0, L = 1: {name} is {mine.tolist()}, expected {expected.tolist()}")


CASES = {"8.1": [plateau_huge_integers], "8.2": [assign_one_key], "8.4": [readout_one_position]}

ORACLE_CALLS = {
    "8.1": "def plateau_size(t, n_max):\n    return int(ovq.dictionary_size(t, n_max))\n",
    "8.2": "def assign_chunk(khat, dict_keys, n_add):\n"
           "    rows, _, seeds = ovq._plan_chunk(khat, dict_keys, dict_keys.shape[0], n_add, 'spread', 0, 0)\n"
           "    return rows, seeds\n",
    "8.4": "import types\n\n"
           "def readout_backward(qhat, keys, values, log_c, beta, G):\n"
           "    n = log_c.shape[0]\n"
           "    rec = types.SimpleNamespace(n=n, dict_keys=keys[:n], dict_values=values[:n], log_c=log_c)\n"
           "    return ovq._readout_backward(rec, G, qhat, keys[n:], values[n:], beta)\n",
}
