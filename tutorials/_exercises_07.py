"""Checks of lesson 7's exercises (EM as a Newton method, the running mean).

Each check builds its own seeded data at small sizes, calls the answer (or
reads the value) and compares with an independent result: ``refimpl.gmm``
(the NLL, its gradient, the M-step, the running mean), central differences
of the gradient, or the batch mean of each cluster.  Machine epsilon is
``U`` (the glossary's $u$); every tolerance says where it comes from.
"""

from __future__ import annotations

import numpy as np

import _hints
from _course import exercise
from refimpl import gmm

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16


def _call(answer, *args):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args)


def _clusters(N, K, d, rng, spread=2.5):
    """N points around K random centres (unit noise), and K starting means drawn among them."""
    centres = spread * rng.normal(size=(K, d))
    x = centres[rng.integers(0, K, size=N)] + rng.normal(size=(N, d))
    return x, x[rng.choice(N, size=K, replace=False)] + 0.1 * rng.normal(size=(K, d))


def _fd_hessian(x, means, beta, weights, h):
    """Central differences of ``gmm.isotropic_nll_gradient``: column j is d grad / d (means.ravel())_j."""
    K, d = means.shape
    H = np.empty((K * d, K * d))
    for j in range(K * d):
        e = np.zeros(K * d)
        e[j] = h
        H[:, j] = (gmm.isotropic_nll_gradient(x, means + e.reshape(K, d), beta, weights)
                   - gmm.isotropic_nll_gradient(x, means - e.reshape(K, d), beta, weights)).ravel() / (2 * h)
    return H


@exercise("7.1", "The gradient of the NLL with respect to the means", 1, points=2, partial=True, refuse=("refimpl.gmm.isotropic_nll_gradient",))
def check_nll_gradient(nll_gradient):
    """``nll_gradient(x, means, beta, weights) -> g``, shape (K, d): ``g_n = -beta sum_i r_in (x_i - mu_n)``.

    ``x`` (N, d), ``means`` (K, d), ``beta`` > 0, ``weights`` (K,) summing to
    one; ``r`` the responsibilities of the isotropic mixture with covariance
    ``I / beta``.  Compared with ``gmm.isotropic_nll_gradient``.
    """
    rng = np.random.default_rng(71)
    for N, K, d, beta in ((80, 3, 2, 1.0), (50, 4, 3, 2.5), (40, 2, 1, 0.3)):
        x, means = _clusters(N, K, d, rng)
        weights = rng.dirichlet(np.full(K, 3.0))
        got = np.asarray(_call(nll_gradient, x.copy(), means.copy(), beta, weights.copy()))
        assert got.shape == (K, d), _hints.explain(f"N = {N}, K = {K}, d = {d}: expected shape (K, d) = {(K, d)}, got {got.shape}",
                                                   hints=[_hints.shape(got.shape, (K, d))])
        expected = gmm.isotropic_nll_gradient(x, means, beta, weights)
        # a sum over N points of terms beta r_in (x_i - mu_n): off by at most N u times the sum of their sizes,
        # in each of two implementations
        r = gmm.responsibilities(x, means, np.full(means.shape, 1 / beta), weights)
        size = beta * (r.T @ np.abs(x)).max() + beta * r.sum(axis=0).max() * np.abs(means).max()
        tol = 2 * N * U * size
        err = np.abs(got - expected)
        n, j = np.unravel_index(np.argmax(err), err.shape)
        assert err.max() <= tol, _hints.explain(
            f"N = {N}, K = {K}, beta = {beta}: g[{n}, {j}] = {got[n, j]:.10g}, expected {expected[n, j]:.10g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})",
            got, expected, factors={"beta": beta}, known={
                "the weights ignored: the responsibilities of a uniform prior":
                    gmm.isotropic_nll_gradient(x, means, beta, np.full(K, 1 / K)),
            })


@exercise("7.2", "The true Hessian of the NLL", 2, points=4, partial=True, refuse=("refimpl.gmm.isotropic_nll_gradient",))
def check_nll_hessian(nll_hessian):
    """``nll_hessian(x, means, beta, weights) -> H``, shape (K d, K d), rows and columns in the order of ``means.ravel()``.

    Block ``(n, m)`` is ``beta N_n delta_nm I - beta^2 sum_i r_in (delta_nm - r_im)(x_i - mu_n)(x_i - mu_m)^T``
    (section 4).  Compared with central differences of ``gmm.isotropic_nll_gradient``.
    """
    rng = np.random.default_rng(72)
    for N, K, d, beta in ((60, 3, 2, 1.0), (40, 2, 3, 0.7)):
        x, means = _clusters(N, K, d, rng, spread=1.5)  # overlapping clusters: the second term matters
        weights = rng.dirichlet(np.full(K, 3.0))
        got = np.asarray(_call(nll_hessian, x.copy(), means.copy(), beta, weights.copy()))
        assert got.shape == (K * d, K * d), _hints.explain(
            f"K = {K}, d = {d}: expected shape (K d, K d) = {(K * d, K * d)}, got {got.shape}",
            hints=[_hints.shape(got.shape, (K * d, K * d))])
        h = 1e-5
        H_h, H_2h = _fd_hessian(x, means, beta, weights, h), _fd_hessian(x, means, beta, weights, 2 * h)
        # truncation of H_h is c h^2, of H_2h 4 c h^2, so |H_h - H_2h| is 3 times the truncation of H_h;
        # the rounding of a difference quotient is about u max|grad| / h
        g_max = np.abs(gmm.isotropic_nll_gradient(x, means, beta, weights)).max()
        scale = np.abs(H_h).max()
        tol = 2 * np.abs(H_h - H_2h).max() + 8 * U * (g_max + scale) / h
        err = np.abs(got - H_h)
        i, j = np.unravel_index(np.argmax(err), err.shape)
        # EM's surrogate beta N_n I (section 4), and the permutation of a coordinate-major order
        r = gmm.responsibilities(x, means, np.full(means.shape, 1 / beta), weights)
        surrogate = np.kron(np.diag(beta * r.sum(axis=0)), np.eye(d))
        order = np.arange(K * d).reshape(K, d).T.ravel()
        assert err.max() <= tol, _hints.explain(
            f"N = {N}, K = {K}, d = {d}: H[{i}, {j}] (component {i // d} coordinate {i % d}, component {j // d} "
            f"coordinate {j % d}) is {got[i, j]:.8g}, central differences give {H_h[i, j]:.8g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})",
            got, H_h, known={
                "EM's surrogate Hessian beta N_n I only: the second term missing": surrogate,
                "the second term with a flipped sign: the missing information added, not subtracted": 2 * surrogate - H_h,
                "the second term with beta where beta^2 belongs": surrogate + (H_h - surrogate) / beta,
                "rows and columns in coordinate-major order (coordinate, then component), not that of means.ravel()":
                    H_h[np.ix_(order, order)],
            })


@exercise("7.3", "The running-mean update", 2, points=4, partial=True, refuse=("refimpl.gmm.running_mean_update", "refimpl.gmm.fold_running_means", "refimpl.ovq"))
def check_running_mean(running_mean_update):
    """``running_mean_update(means, counts, x, assign) -> (means', counts')``: fold a batch into running means.

    ``means`` (K, d), ``counts`` (K,) integers >= 0, ``x`` (B, d), ``assign``
    (B,) integers in [0, K).  Rows that receive points become
    ``(c_n mu_n + sum_{i in S_n} x_i) / (c_n + |S_n|)``, the others stay as
    they are; ``counts' = counts + |S_n|``.  Folding a stream in uneven
    batches must give the batch mean of each cluster.
    """
    rng = np.random.default_rng(73)
    K, d, N = 5, 3, 240
    x = rng.normal(size=(N, d)) + 3 * rng.normal(size=(1, d))
    assign = rng.integers(0, K - 1, size=N)  # the last row never receives a point
    start = rng.normal(size=(K, d))  # rows with count 0: their value must not matter, and the last must stay
    cuts = np.sort(rng.choice(np.arange(1, N), size=10, replace=False))
    cuts[3] = cuts[2]  # one empty batch
    mu, counts = start.copy(), np.zeros(K, dtype=np.int64)
    last_batch = {}  # each row's mean over the last batch that reached it
    for chunk in np.split(np.arange(N), cuts):
        out = _call(running_mean_update, mu.copy(), counts.copy(), x[chunk].copy(), assign[chunk].copy())
        assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (means, counts), got {type(out).__name__}"
        mu, counts = np.asarray(out[0]), np.asarray(out[1])
        assert mu.shape == (K, d), _hints.explain(f"means: expected shape {(K, d)}, got {mu.shape}", hints=[_hints.shape(mu.shape, (K, d))])
        assert counts.shape == (K,), _hints.explain(f"counts: expected shape {(K,)}, got {counts.shape}",
                                                    hints=[_hints.shape(counts.shape, (K,))])
        for n in np.unique(assign[chunk]):
            last_batch[n] = x[chunk][assign[chunk] == n].mean(axis=0)
    sizes = np.bincount(assign, minlength=K)
    assert np.array_equal(counts, sizes), _hints.explain(
        f"counts after the stream are {counts.tolist()}, the cluster sizes {sizes.tolist()}",
        hints=["the counts frozen: they never change from their start, |S_n| is not added" if not np.any(counts) else None])
    assert np.array_equal(mu[K - 1], start[K - 1]), _hints.explain(
        f"row {K - 1} received no point and must stay {start[K - 1].tolist()}, got {mu[K - 1].tolist()}",
        hints=["a row that received no point updated: the empty ones too (0 / 0 for a count of 0); update only rows with "
               "|S_n| > 0" + ("" if np.all(np.isfinite(mu[K - 1])) else ", here giving nan")])
    batch = np.stack([x[assign == n].mean(axis=0) for n in range(K - 1)])
    n_chunks = len(cuts) + 1
    # each fold rounds a few times, relative u each, and the errors add up over the batches (section 6)
    tol = 4 * n_chunks * U * np.abs(batch).max()
    err = np.abs(mu[:K - 1] - batch)
    n, j = np.unravel_index(np.argmax(err), err.shape)
    # one step from nonzero counts, against refimpl (also what a failure of the stream is compared with)
    c0 = rng.integers(1, 10, size=K)
    xb, ab = rng.normal(size=(7, d)), rng.integers(0, K, size=7)
    if not (np.all(np.isfinite(mu)) and err.max() <= tol):
        step_mu = np.asarray(_call(running_mean_update, start.copy(), c0.copy(), xb.copy(), ab.copy())[0], dtype=float)
        exp_step = gmm.running_mean_update(start, c0, xb, ab)[0]
        step = [f"one step from counts {c0.tolist()}, its change of the means: {h}"
                for h in _hints.diagnose(step_mu - start, exp_step - start)]
        past = np.stack([last_batch[n] for n in range(K - 1)])
        raise AssertionError(_hints.explain(
            f"after {n_chunks} batches, row {n} coordinate {j} is {float(mu[n, j])!r}, the batch mean of its points is "
            f"{float(batch[n, j])!r} (error {err.max():.1e}, allowed {tol:.1e})",
            hints=["a division by the old count c_n, which is 0 at first: the means are not finite; the step is "
                   "1 / (c_n + |S_n|), with the new count" if not np.all(np.isfinite(mu)) else None,
                   "the past forgotten: each row is the mean of the last batch that reached it"
                   if np.allclose(mu[:K - 1], past, rtol=1e-12, atol=1e-12) else None, *step]))
    got_mu, got_c = (np.asarray(a) for a in _call(running_mean_update, start.copy(), c0.copy(), xb.copy(), ab.copy()))
    exp_mu, exp_c = gmm.running_mean_update(start, c0, xb, ab)
    assert np.array_equal(got_c, exp_c), _hints.explain(
        f"counts {c0.tolist()} + this batch: expected {exp_c.tolist()}, got {got_c.tolist()}", got_c, exp_c)
    assert np.allclose(got_mu, exp_mu, rtol=0, atol=8 * U * np.abs(exp_mu).max()), _hints.explain(
        f"from counts {c0.tolist()}: expected means {np.round(exp_mu, 8).tolist()}, got {np.round(got_mu, 8).tolist()}",
        hints=[f"the change of the means: {h}" for h in _hints.diagnose(got_mu - start, exp_mu - start)])


@exercise("7.4", "A start where true Newton climbs and EM descends", 3, points=6, partial=False)
def check_saddle_case(saddle_case):
    """``saddle_case = (x, means, weights)``: one-dimensional data where Newton with the true Hessian raises the NLL.

    ``x`` (N, 1) with N >= 20, ``means`` (2, 1), ``weights`` (2,) positive and
    summing to one; ``beta = 1``.  At this start the true Hessian (central
    differences of ``gmm.isotropic_nll_gradient``) must be indefinite, the
    Newton step ``mu - H^{-1} grad`` must raise the NLL and the EM step
    (``gmm.isotropic_m_step``) must lower it.
    """
    assert isinstance(saddle_case, tuple) and len(saddle_case) == 3, "expected a tuple (x, means, weights)"
    x, means, weights = (np.asarray(a, dtype=float) for a in saddle_case)
    assert x.ndim == 2 and x.shape[1] == 1 and x.shape[0] >= 20, _hints.explain(
        f"x: expected shape (N, 1) with N >= 20, got {x.shape}",
        hints=[f"too few points: N = {x.shape[0]} < 20" if x.ndim == 2 and x.shape[0] < 20 else _hints.shape(x.shape, (20, 1))])
    assert means.shape == (2, 1), f"means: expected shape (2, 1), got {means.shape}"
    assert weights.shape == (2,) and np.all(weights > 0) and abs(weights.sum() - 1) <= 4 * U, (
        f"weights: expected two positive numbers summing to one, got {weights.tolist()}")
    beta, h = 1.0, 1e-5
    H = _fd_hessian(x, means, beta, weights, h)
    H = 0.5 * (H + H.T)
    # as in 7.2: truncation from two steps, rounding u max|grad| / h
    grad = gmm.isotropic_nll_gradient(x, means, beta, weights)
    fd_err = 2 * np.abs(H - 0.5 * (_fd_hessian(x, means, beta, weights, 2 * h) + _fd_hessian(x, means, beta, weights, 2 * h).T)).max() \
        + 8 * U * (np.abs(grad).max() + np.abs(H).max()) / h
    eig = np.linalg.eigvalsh(H)
    assert eig.min() < -fd_err, _hints.explain(
        f"the true Hessian has eigenvalues {np.round(eig, 4).tolist()}: not indefinite at this start",
        hints=["every eigenvalue positive: a start near a separated optimum, where the NLL is convex; put both means "
               "inside one broad cluster, near the saddle where two components split it" if eig.min() > 0 else
               f"the most negative eigenvalue {eig.min():.2e} is within the finite differences' error {fd_err:.1e}"])
    newton = means - np.linalg.solve(H, grad.ravel()).reshape(means.shape)
    em = gmm.isotropic_m_step(x, means, beta, weights)
    nll0, nll_newton, nll_em = (gmm.isotropic_nll(x, m, beta, weights) for m in (means, newton, em))
    # the NLL is a sum of N terms: rounding moves it by ~N u |NLL|; a change must exceed that to count
    noise = 4 * x.shape[0] * U * abs(nll0)
    assert nll_newton > nll0 + noise, _hints.explain(
        f"NLL {nll0:.8f} at the start, {nll_newton:.8f} after the true Newton step: it did not go up",
        hints=[f"an exact saddle: the gradient is zero here (max |grad| = {np.abs(grad).max():.1e}), so no step moves; "
               "move the means off the symmetric point" if np.abs(grad).max() <= fd_err else None])
    assert nll_em < nll0 - noise, f"NLL {nll0:.8f} at the start, {nll_em:.8f} after the EM step: it did not go down"
