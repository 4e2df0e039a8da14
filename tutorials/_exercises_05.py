"""Checks of lesson 5's exercises (Lipschitz bounds for the responsibilities).

Each check builds its own seeded mixtures at small sizes, calls the answer
and compares it with an independent result: ``refimpl.theory`` (the bounds,
the Jacobian and its spectral norm), central differences of
``refimpl.gmm.responsibilities``, or the configuration of section 2 where
the sharpened bound is attained.  Machine epsilon is ``U`` (the glossary's
$u$); every tolerance says where it comes from.
"""

from __future__ import annotations

import numpy as np

import _hints
from _course import exercise
from refimpl import gmm, theory

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16


def _call(answer, *args):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args)


def _mixture(K, d, rng, var_min=0.05):
    """A seeded diagonal mixture with its variance floor attained."""
    means = theory.sample_ball(K, d, 1.5, rng)
    variances = rng.uniform(var_min, 4 * var_min, size=(K, d))
    variances[rng.integers(K), rng.integers(d)] = var_min
    return means, variances, rng.dirichlet(np.ones(K))


@exercise("5.1", "The sharpened Lipschitz bound from the parameters", 1, points=2, partial=True,
          refuse=("refimpl.theory",))
def check_sharp_bound(sharp_lipschitz_bound):
    """``sharp_lipschitz_bound(means, variances, bound_x) -> float``: $R/\\sqrt2$, $R = (B_x + B_\\mu)/\\sigma^2_{\\min}$.

    ``means`` and ``variances`` are (K, d_r); ``B_mu`` is the largest norm of a
    mean, ``sigma2_min`` the smallest variance entry.  The value must equal
    ``theory.lipschitz_bounds(...).k_free / sqrt(2)`` and lie above every
    measured ``||J(x)||_2`` in the ball.
    """
    rng = np.random.default_rng(51)
    for K, d, bound_x in ((2, 1, 0.5), (5, 3, 2.0), (12, 4, 1.0), (3, 2, 0.0)):
        means, variances, weights = _mixture(K, d, rng)
        got = _call(sharp_lipschitz_bound, means.copy(), variances.copy(), bound_x)
        assert np.ndim(got) == 0, _hints.explain(f"K = {K}, d_r = {d}: expected one number, got an array of shape {np.shape(got)}",
                                                 hints=[_hints.shape(np.shape(got), ())])
        got = float(got)
        expected = theory.lipschitz_bounds(means, variances, bound_x).k_free / np.sqrt(2)
        # a norm, a sum, a division and a square root: a few roundings, 16 u relative is ample
        b_mu = np.max(np.linalg.norm(means, axis=1))
        assert abs(got - expected) <= 16 * U * expected, _hints.explain(
            f"K = {K}, d_r = {d}, B_x = {bound_x}: got {got!r}, expected R / sqrt 2 = {float(expected)!r} "
            f"(ratio {got / expected:.6f}; R = {expected * np.sqrt(2):.6g})",
            got, expected, known={
                "the largest variance where the floor (the smallest) belongs":
                    expected * np.min(variances) / np.max(variances),
                "the radius B_x of the ball left out of R": expected * b_mu / (bound_x + b_mu),
            })
        x = theory.sample_ball(200, d, bound_x, rng)
        measured = theory.jacobian_spectral_norms(x, means, variances, weights).max()
        assert measured <= got, f"K = {K}: measured ||J||_2 = {measured:.6g} exceeds your bound {got:.6g}"


def _centred(gamma, u):
    """gamma_m (u_m - sum_k gamma_k u_k), the responsibility Jacobian's form, for any rows u_m."""
    return gamma[:, None] * (u - gamma @ u)


@exercise("5.2", "The Jacobian of the responsibilities", 2, points=4, partial=True, refuse=("refimpl.theory",))
def check_jacobian(responsibility_jacobian):
    """``responsibility_jacobian(x, means, variances, weights) -> J``, shape (K, d_r), at one point ``x`` (d_r,).

    ``J[m, j] = d gamma_m / d x_j = gamma_m (u_m - ubar)_j`` with
    ``u_m = (mu_m - x) / sigma_m^2`` (elementwise) and ``ubar = sum_k gamma_k u_k``.
    """
    rng = np.random.default_rng(52)
    h = U ** (1 / 3)
    for K, d in ((2, 1), (5, 3), (4, 6)):
        means = rng.normal(size=(K, d))
        variances = rng.uniform(0.3, 1.0, size=(K, d))
        weights = rng.dirichlet(np.ones(K))
        for x in theory.sample_ball(4, d, 2.0, rng):
            J = np.asarray(_call(responsibility_jacobian, x.copy(), means.copy(), variances.copy(), weights.copy()))
            assert J.shape == (K, d), _hints.explain(f"K = {K}, d_r = {d}: expected J of shape (K, d_r) = {(K, d)}, got {J.shape}",
                                                     hints=[_hints.shape(J.shape, (K, d))])
            assert np.all(np.isfinite(J)), _hints.explain(f"K = {K}, d_r = {d}: J has non-finite entries",
                                                          hints=["an overflow: exp of large log-joints without the row maximum?"])
            # central differences of gmm.responsibilities, one coordinate at a time
            J_fd = np.empty((K, d))
            for j in range(d):
                e = np.zeros(d)
                e[j] = h
                J_fd[:, j] = (gmm.responsibilities((x + e)[None], means, variances, weights)[0]
                              - gmm.responsibilities((x - e)[None], means, variances, weights)[0]) / (2 * h)
            u_max = np.max(np.linalg.norm((means - x) / variances, axis=1))
            # section 1: rounding ~ a few u / h, truncation h^2 |gamma'''| / 6 with |gamma'''| <~ max ||u_m||^3
            tol = U ** (2 / 3) * (4 + u_max**3 / 6)
            err = np.abs(J - J_fd)
            m, j = np.unravel_index(np.argmax(err), err.shape)
            gamma = gmm.responsibilities(x[None], means, variances, weights)[0]
            col_sums = np.abs(J.sum(axis=0)).max()
            assert err.max() <= tol, _hints.explain(
                f"K = {K}, d_r = {d}: entry (m={m}, j={j}) is {J[m, j]:.6g}, central differences give "
                f"{J_fd[m, j]:.6g} (error {err.max():.1e}, allowed {tol:.1e})",
                J, J_fd, hints=[
                    f"without centring: your columns sum to {col_sums:.3g}, not 0 (the gamma_m sum to one, so their "
                    "derivatives sum to zero; ubar = sum_k gamma_k u_k is subtracted for that)" if col_sums > tol * K else None,
                    "divided by sigma, not sigma^2: your J is that of u_m = (mu_m - x) / sigma_m"
                    if _hints.explains(J, _centred(gamma, (means - x) / np.sqrt(variances)), J_fd) else None,
                ])


@exercise("5.3", "The crude bound never beats the sharpened one", 2, points=4, partial=True, refuse=("refimpl.theory",))
def check_crude_over_sharp(crude_over_sharp):
    """``crude_over_sharp(K) -> ratio``: (crude bound) / (sharpened bound) for an integer array ``K`` (any shape).

    The crude bound is ``sqrt(K) R / 2``, the sharpened one ``R / sqrt(2)``;
    the ratio must not depend on ``R``.  The check compares it with
    ``theory.lipschitz_bounds`` on seeded mixtures with K = 1 .. 300, then
    uses your function to locate where the two bounds meet and verifies there,
    on the configuration of section 2, that the crude bound is attained.
    """
    rng = np.random.default_rng(53)
    Ks = np.arange(1, 301)
    got = np.asarray(_call(crude_over_sharp, Ks.copy()), dtype=float)
    assert got.shape == Ks.shape, _hints.explain(f"crude_over_sharp(K) for K of shape {Ks.shape}: got shape {got.shape}",
                                                 hints=[_hints.shape(got.shape, Ks.shape)])
    got2 = np.asarray(_call(crude_over_sharp, Ks.reshape(20, 15).copy()), dtype=float)
    assert got2.shape == (20, 15), _hints.explain(f"crude_over_sharp(K) for K of shape (20, 15): got shape {got2.shape}",
                                                  hints=[_hints.shape(got2.shape, (20, 15))])
    sampled = (1, 2, 3, 5, 17, 64, 300)
    expected_all = []
    for K in sampled:
        means, variances, _ = _mixture(K, 3, rng)
        b = theory.lipschitz_bounds(means, variances, rng.uniform(0.1, 3.0))
        expected_all.append(b.crude / (b.k_free / np.sqrt(2)))
    expected_all = np.array(expected_all)
    for K, expected in zip(sampled, expected_all):
        # two square roots and two divisions on each side: 8 u relative
        assert abs(got[K - 1] - expected) <= 8 * U * expected, _hints.explain(
            f"K = {K}: your ratio is {float(got[K - 1])!r}, refimpl's bounds give crude / (R / sqrt 2) = {float(expected)!r}",
            got[np.array(sampled) - 1], expected_all)
    # never beats: the ratio is >= 1 for every K >= 2 (to rounding)
    below = Ks[(Ks >= 2) & (got < 1 - 8 * U)]
    assert below.size == 0, f"your ratio is below 1 at K = {below[:5].tolist()}: the crude bound would beat R / sqrt 2"
    # where they meet: the K with ratio 1, found from your function
    meet = Ks[np.abs(got - 1) <= 8 * U]
    assert meet.size == 1, f"your ratio equals 1 at K = {meet.tolist()}; the bounds must meet at exactly one K"
    K_meet = int(meet[0])
    # at K_meet the crude bound must be attained: two components at +-B e1 share the mass at x = 0,
    # the K - 2 others have weight 1e-20 (section 2); ||J(0)||_2 = R / sqrt 2 for every K
    B, var_min = 1.0, 0.05
    for K, attained in ((K_meet, True), (K_meet + 1, False)):
        if K < 2:
            continue
        angles = np.pi * (np.arange(K - 2) + 0.5) / max(K - 2, 1)
        means = np.vstack([[[B, 0.0], [-B, 0.0]], B * np.column_stack([np.cos(angles), np.sin(angles)])])
        variances = np.full((K, 2), var_min)
        weights = np.r_[0.5, 0.5, np.full(K - 2, 1e-20)]
        J0 = theory.jacobian_spectral_norms(np.zeros((1, 2)), means, variances, weights)[0]
        crude = theory.lipschitz_bounds(means, variances, 0.0).crude
        # both computed to a few roundings (section 2): 16 u relative
        if attained:
            assert abs(J0 - crude) <= 16 * U * crude, (
                f"at your meeting point K = {K} the crude bound {crude:.6g} is not attained (||J(0)||_2 = {J0:.6g})"
            )
        else:
            assert J0 < crude * (1 - 16 * U), f"at K = {K} the crude bound should be strictly above ||J(0)||_2"


@exercise("5.4", "The height of the ridge between two components", 3, points=6, partial=True,
          refuse=("refimpl.theory",))
def check_ridge(ridge_jacobian_norm):
    """``ridge_jacobian_norm(t, B, var, w1) -> ||J(t e_1)||_2``, shape of ``t``, in closed form.

    The mixture: d_r = 2, two components with means ``+B e_1`` and ``-B e_1``,
    every variance ``var``, weights ``(w1, 1 - w1)``; ``t`` an array of
    positions along ``e_1``.  Compared with ``theory.jacobian_spectral_norms``.
    """
    rng = np.random.default_rng(54)
    for B, var, w1 in ((1.0, 0.05, 0.5), (0.7, 0.3, 0.2), (2.0, 1.0, 0.9), (0.3, 0.02, 0.05)):
        t = np.concatenate([np.linspace(-2 * B, 2 * B, 41), rng.normal(scale=0.2 * B, size=9)])
        got = np.asarray(_call(ridge_jacobian_norm, t.copy(), B, var, w1), dtype=float)
        assert got.shape == t.shape, _hints.explain(f"t of shape {t.shape}: got shape {got.shape}",
                                                    hints=[_hints.shape(got.shape, t.shape)])
        assert np.all(np.isfinite(got)), _hints.explain(
            "non-finite values", hints=["an overflow: exp of a large log odds; write the product gamma_1 gamma_2 stably"])
        means = np.array([[B, 0.0], [-B, 0.0]])
        variances = np.full((2, 2), var)
        x = np.column_stack([t, np.zeros_like(t)])
        expected = theory.jacobian_spectral_norms(x, means, variances, np.array([w1, 1 - w1]))
        scale = B / (np.sqrt(2) * var)  # the height of the ridge, R / sqrt 2 at B_x = 0
        # both sides are products of a few rounded factors of size <= scale: 64 u of the scale
        err = np.abs(got - expected)
        i = int(np.argmax(err))
        assert err.max() <= 64 * U * scale, _hints.explain(
            f"B = {B}, var = {var}, w1 = {w1}: at t = {t[i]:.4g} you give {got[i]:.8g}, "
            f"the spectral norm of the Jacobian is {expected[i]:.8g} (error {err.max():.1e})",
            got, expected, known={
                "the weights ignored: your curve is that of equal weights (log(w1 / w2) missing from the log odds)":
                    theory.jacobian_spectral_norms(x, means, variances, np.array([0.5, 0.5])),
                "half the distance in the log odds: your curve is the right one at t / 2 (B t where 2 B t belongs)":
                    theory.jacobian_spectral_norms(x / 2, means, variances, np.array([w1, 1 - w1])),
            })
