"""Checks of lesson 6's exercises (attention as regression, GMR and the OVQ read-out).

Each check builds its own seeded inputs at small sizes, calls the answer and
compares it with an independent result: ``refimpl.gmr`` (kernel regression
from differences, the exact GMR posterior from the full Gaussian log-density,
the read-out gap and its bound), or the definition of a conditional mean
evaluated by quadrature.  Machine epsilon is ``U`` (the glossary's $u$).
Where a tolerance rests on rounded logits it uses the tilt bound of the
lesson's section 4: logits off by at most $e$ move a softmax-weighted
average by at most $\\tanh(2e/4) \\le e/2$ times the range of what is averaged.
"""

from __future__ import annotations

import numpy as np
from scipy import integrate

import _hints
from _course import exercise
from refimpl import gmr, ovq

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16


def _call(answer, *args):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args)


def _softmax(logits, axis=1):
    """A softmax with the maximum subtracted along ``axis``."""
    e = np.exp(logits - np.max(logits, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _worst(err):
    idx = np.unravel_index(np.argmax(err), err.shape)
    return tuple(int(i) for i in idx)


@exercise("6.1", "Nadaraya-Watson regression that does not overflow", 1, points=2, partial=True, refuse=("refimpl.gmr", "refimpl.attention"))
def check_nadaraya_watson(nadaraya_watson):
    """``nadaraya_watson(q, k, v, beta) -> m``, shape (N_q, d_v): kernel regression with ``exp(-(beta/2)||q - k_j||^2)``.

    ``q`` (N_q, d), ``k`` (N_k, d), ``v`` (N_k, d_v), raw vectors (not unit).
    The weights must be computed stably: with ``beta = 1000`` on these raw
    vectors every kernel value underflows to 0, and the prediction must
    still be finite.  Compared with ``gmr.kernel_regression``.
    """
    rng = np.random.default_rng(61)
    for N_q, N_k, d, d_v, beta, unit in ((7, 11, 3, 2, 0.5, False), (5, 13, 8, 1, 1000.0, False),
                                         (9, 6, 4, 3, 30.0, True)):
        q, k = rng.normal(size=(N_q, d)), rng.normal(size=(N_k, d))
        if unit:
            q, k = ovq.unit_rows(q), ovq.unit_rows(k)
        v = rng.normal(size=(N_k, d_v))
        got = np.asarray(_call(nadaraya_watson, q.copy(), k.copy(), v.copy(), beta))
        assert got.shape == (N_q, d_v), _hints.explain(
            f"q {q.shape}, k {k.shape}, v {v.shape}: expected shape {(N_q, d_v)}, got {got.shape}",
            hints=[_hints.shape(got.shape, (N_q, d_v))])
        expected = gmr.kernel_regression(q, k, v, beta=beta)
        bad = ~np.isfinite(got)
        assert not bad.any(), _hints.explain(
            f"beta = {beta}: {int(bad.sum())} non-finite entries (first at {tuple(np.argwhere(bad)[0].tolist())}); "
            "every exp(-(beta/2)||q - k||^2) of that row underflowed: subtract the row's largest logit first",
            got, expected)
        logits = -0.5 * beta * np.sum((q[:, None, :] - k[None, :, :]) ** 2, axis=2)
        # every logit, however it is formed (differences or ||q||^2 - 2 q.k + ||k||^2), is off by at most about
        # (d + 4) u L with L = (beta/2)(max||q|| + max||k||)^2; the tilt bound turns that into (d + 4) u L range(v)
        L = 0.5 * beta * (np.linalg.norm(q, axis=1).max() + np.linalg.norm(k, axis=1).max()) ** 2
        tol = (d + 4) * U * L * np.max(np.ptp(v, axis=0))
        err = np.abs(got - expected)
        i = _worst(err)
        assert err.max() <= tol, _hints.explain(
            f"beta = {beta}, d = {d}: entry {i} is {got[i]:.10g}, kernel regression gives {expected[i]:.10g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})",
            got, expected, known={
                "the half dropped in the exponent: your prediction is kernel regression with 2 beta":
                    gmr.kernel_regression(q, k, v, beta=2 * beta),
                "dot products only: softmax(beta q . k_j), the norm term ||k_j||^2 dropped (right only for unit keys)":
                    _softmax(beta * q @ k.T) @ v,
                "the weights normalised along the wrong axis: over the queries, not the keys": _softmax(logits, axis=0) @ v,
            })


@exercise("6.2", "The exact GMR posterior of isotropic components", 2, points=4, partial=True,
          refuse=("refimpl.gmr", "refimpl.gmm", "refimpl.tuned", "cpu.gmm", "gpu.numba_cuda.gmm", "gpu.cupy_kernels.gmm",
                  "sklearn.mixture"))
def check_gmr_weights(gmr_weights):
    """``gmr_weights(q, key_means, weights, beta) -> h``, shape (N_q, K): the posterior of each component given a key.

    Key covariance ``I / beta`` for every component, weights ``pi`` (K,).
    ``h`` must keep the norm term ``-(beta/2)||mu^k_m||^2`` (section 3), sum
    to one along each row and stay finite at ``beta = 1000``.  Compared with
    ``gmr.gmr_predict`` with the identity as value means, which returns the
    posterior itself.
    """
    rng = np.random.default_rng(62)
    for N_q, K, d, beta in ((30, 4, 3, 1.0), (25, 7, 5, 16.0), (20, 5, 4, 1000.0)):
        key_means = ovq.unit_rows(rng.normal(size=(K, d))) * rng.uniform(0.5, 1.0, size=(K, 1))
        weights = rng.dirichlet(np.ones(K))
        q = ovq.unit_rows(np.concatenate([rng.normal(size=(N_q - K, d)), key_means + 0.1 * rng.normal(size=(K, d))]))
        got = np.asarray(_call(gmr_weights, q.copy(), key_means.copy(), weights.copy(), beta))
        assert got.shape == (N_q, K), _hints.explain(
            f"q {q.shape}, key_means {key_means.shape}: expected shape {(N_q, K)}, got {got.shape}",
            hints=[_hints.shape(got.shape, (N_q, K))])
        expected = gmr.gmr_predict(q, key_means, np.eye(K), weights, beta=beta)
        assert np.all(np.isfinite(got)), _hints.explain(
            f"beta = {beta}: non-finite weights (exp of large logits overflows: subtract the row maximum)", got, expected)
        with np.errstate(divide="ignore"):
            log_h = np.log(expected)  # the exact posterior's logits, up to a constant per row
        norm = 0.5 * beta * np.sum(key_means**2, axis=1)
        # logits of size at most L (the quadratic form, the Gaussian constant and log pi); each is rounded to a few
        # u L, and the tilt bound makes that an error of at most a few u L in each weight: we allow 16 u L
        L = 2 * beta + 0.5 * d * abs(np.log(2 * np.pi / beta)) + np.max(np.abs(np.log(weights)))
        tol = 16 * U * L
        err = np.abs(got - expected)
        i = _worst(err)
        assert err.max() <= tol, _hints.explain(
            f"beta = {beta}: h[{i[0]}, {i[1]}] = {got[i]:.10g}, the exact posterior is {expected[i]:.10g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})",
            got, expected, normalised=(1, 1.0), known={
                "the norm term -(beta/2)||mu^k_m||^2 dropped: OVQ's logits, not GMR's": _softmax(log_h + norm),
                "the norm term with a flipped sign: +(beta/2)||mu^k_m||^2": _softmax(log_h + 2 * norm),
                "the prior log pi_m missing": _softmax(log_h - np.log(weights)),
            })


@exercise("6.3", "The bound on what dropping the norm term costs", 2, points=4, partial=True, refuse=("refimpl.gmr",))
def check_gap_bound(readout_gap_bound):
    """``readout_gap_bound(key_means, value_means, beta) -> b``, shape (d_v,): ``tanh(r/4)`` times the range of each value coordinate.

    ``r = (beta/2)(max_m ||mu^k_m||^2 - min_m ||mu^k_m||^2)``.  Compared with
    ``gmr.readout_gap_bound``; it must also lie above the measured gap
    ``|OVQ - GMR|`` on random queries and be reached on the two-centroid sweep
    of section 4.
    """
    rng = np.random.default_rng(63)
    for K, d, d_v, beta, s in ((6, 4, 2, 4.0, 0.3), (10, 8, 3, 16.0, 0.1), (3, 2, 1, 1.0, 0.5)):
        key_means = ovq.unit_rows(rng.normal(size=(K, d))) * (1 - s * rng.random(size=(K, 1)))
        value_means = rng.normal(size=(K, d_v))
        got = np.asarray(_call(readout_gap_bound, key_means.copy(), value_means.copy(), beta))
        assert got.shape == (d_v,), _hints.explain(f"value_means {value_means.shape}: expected shape {(d_v,)}, got {got.shape}",
                                                   hints=[_hints.shape(got.shape, (d_v,))])
        expected = gmr.readout_gap_bound(key_means, value_means, beta=beta)
        sq = np.sum(key_means**2, axis=1)
        r, spread = 0.5 * beta * np.ptp(sq), np.ptp(value_means, axis=0)
        # a few roundings (norms, one tanh, one subtraction): 16 u relative
        assert np.allclose(got, expected, rtol=16 * U, atol=0), _hints.explain(
            f"beta = {beta}, K = {K}: got {np.round(got, 10).tolist()}, expected {np.round(expected, 10).tolist()}",
            got, expected, known={
                "tanh(r/2) in place of tanh(r/4)": np.tanh(r / 2) * spread,
                "r/4 itself, without the tanh (a valid bound, not the sharp one)": r / 4 * spread,
                "the range of the norms ||mu^k_m||, not of their squares":
                    np.tanh(0.5 * beta * np.ptp(np.sqrt(sq)) / 4) * spread,
            })
        q = ovq.unit_rows(rng.normal(size=(300, d)))
        gap = np.max(np.abs(gmr.readout_gap(q, key_means, value_means, rng.integers(1, 20, size=K), beta=beta)), axis=0)
        slack = 8 * U * beta * np.ptp(value_means, axis=0)  # the rounding of the two read-outs (section 4)
        assert np.all(gap <= got + slack), f"beta = {beta}: measured gap {gap.tolist()} above your bound {got.tolist()}"
    # attained: norms 1 and 0.7, values 0 and 1, queries on the quarter circle between the two centroids
    key_means, value_means = np.array([[1.0, 0.0], [0.0, 0.7]]), np.array([[0.0], [1.0]])
    angles = np.linspace(0, np.pi / 2, 2001)
    q = np.column_stack([np.cos(angles), np.sin(angles)])
    for beta in (1.0, 16.0):
        bound = float(np.asarray(_call(readout_gap_bound, key_means.copy(), value_means.copy(), beta)).ravel()[0])
        gap = np.abs(gmr.readout_gap(q, key_means, value_means, np.array([1, 1]), beta=beta)).max()
        # the gap is smooth in the angle with an interior maximum: a grid of step h misses it by O(h^2) ~ 1e-6
        assert gap >= bound * (1 - 1e-4), f"beta = {beta}: the largest gap {gap:.6f} stays below your bound {bound:.6f}"


def _slopes_hint(got, expected, q, key_means, mass):
    """Fit both predictions as blends of one line per component, ``sum_m h_m(q) (a_m + b_m (q - mu^k_m))``, and compare slopes.

    ``mass`` (N_q, K) holds each component's share of the joint density at
    each query (by quadrature), so ``h_m(q)`` is its row normalised.
    """
    h = mass / mass.sum(axis=1, keepdims=True)
    design = np.hstack([h, h * (q[:, None] - key_means[None, :])])  # (N_q, 2K)
    K = h.shape[1]
    fits = [np.linalg.lstsq(design, f, rcond=None) for f in (got, expected)]
    (coef_g, *_), (coef_e, *_) = fits
    if np.max(np.abs(design @ coef_g - got)) > 1e-6 * max(1.0, np.ptp(got)):
        return None  # not a blend of lines: the slopes say nothing
    b_g, b_e = coef_g[K:], coef_e[K:]
    if np.allclose(b_g, b_e, rtol=1e-6, atol=1e-9):
        return None
    if np.allclose(b_g, 0, atol=1e-6 * np.max(np.abs(b_e))):
        return (f"the cross-covariance term dropped: your local lines are flat, the joint density's have slopes "
                f"{np.round(b_e, 4).tolist()}")
    if np.allclose(b_g, -b_e, rtol=1e-6, atol=1e-9):
        return f"the slope's sign flipped: your local lines have slopes {np.round(b_g, 4).tolist()}, the joint density's the opposite"
    return (f"a wrong slope of the local lines: yours are {np.round(b_g, 4).tolist()}, the joint density's "
            f"{np.round(b_e, 4).tolist()} (ratios {np.round(b_g / b_e, 4).tolist()})")


@exercise("6.4", "GMR with a key-value cross-covariance", 3, points=6, partial=True)
def check_full_gmr(gmr_full_predict):
    """``gmr_full_predict(q, weights, means, covariances) -> E[v | k = q]``, shape (N_q,), for scalar keys and values.

    ``q`` (N_q,), ``weights`` (K,), ``means`` (K, 2) with rows ``(mu^k_m, mu^v_m)``,
    ``covariances`` (K, 2, 2) with ``[[s_kk, s_kv], [s_vk, s_vv]]``.  Compared
    with the definition ``int v p(q, v) dv / int p(q, v) dv`` by the trapezoid rule.
    """
    rng = np.random.default_rng(64)
    K, N_q, n_grid = 4, 40, 4001
    weights = rng.dirichlet(np.ones(K))
    means = np.column_stack([rng.uniform(-2, 2, K), rng.normal(size=K)])
    sd = rng.uniform(0.3, 1.0, size=(K, 2))
    corr = rng.uniform(-0.9, 0.9, size=K)  # conditional sd at least sqrt(1 - 0.81) = 0.44 of the marginal one
    covariances = np.empty((K, 2, 2))
    covariances[:, 0, 0], covariances[:, 1, 1] = sd[:, 0] ** 2, sd[:, 1] ** 2
    covariances[:, 0, 1] = covariances[:, 1, 0] = corr * sd[:, 0] * sd[:, 1]
    q = np.linspace(-3, 3, N_q)
    got = np.asarray(_call(gmr_full_predict, q.copy(), weights.copy(), means.copy(), covariances.copy()))
    assert got.shape == (N_q,), _hints.explain(f"q of shape {q.shape}: expected shape {(N_q,)}, got {got.shape}",
                                               hints=[_hints.shape(got.shape, (N_q,))])
    assert np.all(np.isfinite(got)), _hints.explain("non-finite predictions", hints=["an overflow: exp without the row maximum?"])
    # the joint density on a grid of v reaching 30 marginal standard deviations beyond every component
    y = np.linspace(np.min(means[:, 1] - 30 * sd[:, 1]), np.max(means[:, 1] + 30 * sd[:, 1]), n_grid)
    dk = q[:, None, None] - means[None, None, :, 0]  # (N_q, 1, K)
    dv = y[None, :, None] - means[None, None, :, 1]  # (1, n_grid, K)
    det = covariances[:, 0, 0] * covariances[:, 1, 1] - covariances[:, 0, 1] ** 2
    quad = (covariances[:, 1, 1] * dk**2 - 2 * covariances[:, 0, 1] * dk * dv + covariances[:, 0, 0] * dv**2) / det
    log_p = np.log(weights) - np.log(2 * np.pi * np.sqrt(det)) - 0.5 * quad  # (N_q, n_grid, K)
    shift = log_p.max(axis=(1, 2), keepdims=True)  # a common factor per query cancels in the ratio
    per_component = np.exp(log_p - shift)  # (N_q, n_grid, K)
    density = per_component.sum(axis=2)  # (N_q, n_grid)
    expected = integrate.trapezoid(density * y, y, axis=1) / integrate.trapezoid(density, y, axis=1)
    # the trapezoid rule on a Gaussian integrand with a step of 1/60 of a marginal sd (at least 1/25 of a
    # conditional one) is exact to far below rounding; sums of n_grid terms are off by at most n_grid u of the
    # largest |v| on the grid, in the numerator and the denominator
    tol = 2 * n_grid * U * np.max(np.abs(y))
    err = np.abs(got - expected)
    i = int(np.argmax(err))
    assert err.max() <= tol, _hints.explain(
        f"at q = {q[i]:.4g} you predict {got[i]:.10g}, the conditional mean of the joint density is "
        f"{expected[i]:.10g} (error {err.max():.1e}, allowed {tol:.1e})",
        got, expected, hints=[_slopes_hint(got, expected, q, means[:, 0], integrate.trapezoid(per_component, y, axis=1))])
