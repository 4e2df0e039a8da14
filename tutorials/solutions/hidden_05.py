"""Hidden cases of lesson 5's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: edge cases (one component, positions far along the ridge), with
the public check's tolerance models.  ``ORACLE_CALLS``: answers that call
the function the check compares with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_05 as public
from refimpl import theory

U = np.finfo(np.float64).eps

SEEDS = {"5.1": (1, 2), "5.2": (1, 2), "5.3": (1,), "5.4": (1, 2)}


def bound_one_component(sharp_lipschitz_bound):
    """one component (K = 1) in d_r = 1 and d_r = 3: R / sqrt 2 with R = (B_x + ||mu||) / sigma2_min"""
    for means, variances, bound_x in ((np.array([[-0.5]]), np.array([[0.2]]), 1.5),
                                      (np.array([[0.3, -0.4, 1.2]]), np.array([[0.9, 0.25, 2.0]]), 0.0)):
        got = public._call(sharp_lipschitz_bound, means.copy(), variances.copy(), bound_x)
        assert np.ndim(got) == 0, f"K = 1: expected one number, got shape {np.shape(got)}"
        expected = (bound_x + np.linalg.norm(means[0])) / variances.min() / np.sqrt(2)
        assert abs(float(got) - expected) <= 16 * U * expected, (
            f"K = 1, B_x = {bound_x}: got {float(got)!r}, expected {expected!r}")


def ridge_far_out(ridge_jacobian_norm):
    """positions far along the axis (log odds up to 2e5): the norm is finite and tiny, as theory gives it"""
    for B, var, w1 in ((1.0, 0.01, 0.5), (0.5, 0.02, 1e-3)):
        t = np.array([-1e3, -50.0, -5.0, 0.0, 5.0, 50.0, 1e3]) * B
        got = np.asarray(public._call(ridge_jacobian_norm, t.copy(), B, var, w1), dtype=float)
        assert got.shape == t.shape, f"t of shape {t.shape}: got shape {got.shape}"
        assert np.all(np.isfinite(got)), f"B = {B}, var = {var}: non-finite values at t = {t[~np.isfinite(got)]}"
        x = np.column_stack([t, np.zeros_like(t)])
        expected = theory.jacobian_spectral_norms(x, np.array([[B, 0.0], [-B, 0.0]]), np.full((2, 2), var),
                                                  np.array([w1, 1 - w1]))
        scale = B / (np.sqrt(2) * var)
        err = np.abs(got - expected)
        assert err.max() <= 64 * U * scale, (  # the public check's model
            f"B = {B}, var = {var}, w1 = {w1}: at t = {t[np.argmax(err)]} you give {got[np.argmax(err)]!r}, "
            f"theory {expected[np.argmax(err)]!r}")


CASES = {"5.1": [bound_one_component], "5.4": [ridge_far_out]}

ORACLE_CALLS = {
    "5.1": "def sharp_lipschitz_bound(means, variances, bound_x):\n"
           "    return theory.lipschitz_bounds(means, variances, bound_x).k_free / np.sqrt(2)\n",
    "5.2": "def responsibility_jacobian(x, means, variances, weights):\n"
           "    return theory.responsibility_jacobian(x[None], means, variances, weights)[0]\n",
    "5.3": "def crude_over_sharp(K):\n"
           "    K = np.asarray(K)\n"
           "    bounds = [theory.lipschitz_bounds(np.ones((k, 1)), np.ones((k, 1)), 1.0) for k in K.ravel()]\n"
           "    return np.array([b.crude / (b.k_free / np.sqrt(2)) for b in bounds]).reshape(K.shape)\n",
    "5.4": "def ridge_jacobian_norm(t, B, var, w1):\n"
           "    x = np.column_stack([t, np.zeros_like(t)])\n"
           "    means = np.array([[B, 0.0], [-B, 0.0]])\n"
           "    return theory.jacobian_spectral_norms(x, means, np.full((2, 2), var), np.array([w1, 1 - w1]))\n",
}
