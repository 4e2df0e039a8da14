"""Hidden cases of lesson 2's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: other sizes and edge cases (one key, one component), with the
public check's tolerance models.  ``ORACLE_CALLS``: answers that call the
function the check compares with; they must be refused.
"""

from __future__ import annotations

import math

import numpy as np

import _exercises_02 as public

U = np.finfo(np.float64).eps

SEEDS = {"2.1": (1,), "2.2": (1, 2), "2.3": (1, 2), "2.4": (1,)}


def row_one_key_one_component(attention_row):
    """one key (N_k = 1) and one component (K = 1): the row is the single number 1 / (1 + eps)"""
    for n_q, eps in ((1, 1e-6), (3, 0.5)):
        gamma_q, gamma_k = np.ones((n_q, 1)), np.ones((1, 1))
        got = public._shape(attention_row(gamma_q.copy(), gamma_k.copy(), n_q - 1, eps), (1,),
                            f"attention_row with N_q = {n_q}, N_k = 1, K = 1")
        expected = 1.0 / (1.0 + eps)
        assert abs(float(got[0]) - expected) <= 4 * U, f"N_k = K = 1, eps = {eps}: got {got}, expected [{expected!r}]"


def norm_one_component(affinity_norm):
    """one component (K = 1): every entry of A is 1, so ||A||_F = sqrt(N_q N_k)"""
    for n_q, n_k in ((1, 1), (7, 30)):
        got = np.asarray(affinity_norm(np.ones((n_q, 1)), np.ones((n_k, 1))))
        assert got.ndim == 0, f"N_q = {n_q}, N_k = {n_k}, K = 1: expected one number, got shape {got.shape}"
        exact = math.sqrt(n_q * n_k)
        tol = (n_q + n_k + 8) * U * exact  # the public check's model with K = 1
        assert abs(float(got) - exact) <= tol, f"K = 1, N_q = {n_q}, N_k = {n_k}: got {float(got)!r}, expected {exact!r}"


CASES = {"2.1": [row_one_key_one_component], "2.4": [norm_one_component]}

ORACLE_CALLS = {
    "2.1": "def attention_row(gamma_q, gamma_k, i, eps=1e-6):\n"
           "    a = theory.affinity(gamma_q[i:i + 1], gamma_k)[0]\n"
           "    return a / (a.sum() + eps)\n",
    "2.2": "def slots_and_weights(gamma_q, gamma_k, v, eps=1e-6):\n"
           "    return theory.mixing_weights(gamma_q, gamma_k, eps=eps), theory.slot_means(gamma_k, v)\n",
    "2.3": "def isotropic_router(means, variance, weights):\n"
           "    d = means.shape[1]\n"
           "    b = theory.isotropic_router_logits(np.zeros((1, d)), means, variance, weights)[0]\n"
           "    return (theory.isotropic_router_logits(np.eye(d), means, variance, weights) - b), b\n",
    "2.4": "def affinity_norm(gamma_q, gamma_k):\n    return np.linalg.norm(theory.affinity(gamma_q, gamma_k))\n",
}
