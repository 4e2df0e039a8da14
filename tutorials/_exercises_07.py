"""Checks of lesson 7's exercises (EM as a Newton method, the running mean).

Each check builds its own seeded data at small sizes, calls the answer (or
reads the value) and compares with an independent result: ``refimpl.gmm``
(the NLL, its gradient, the M-step, the running mean), central differences
of the gradient, or the batch mean of each cluster.  Machine epsilon is
``U`` (the glossary's $u$); every tolerance says where it comes from.
"""

from __future__ import annotations

import numpy as np

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


@exercise("7.1", "The gradient of the NLL with respect to the means", 1)
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
        assert got.shape == (K, d), f"N = {N}, K = {K}, d = {d}: expected shape (K, d) = {(K, d)}, got {got.shape}"
        expected = gmm.isotropic_nll_gradient(x, means, beta, weights)
        # a sum over N points of terms beta r_in (x_i - mu_n): off by at most N u times the sum of their sizes,
        # in each of two implementations
        r = gmm.responsibilities(x, means, np.full(means.shape, 1 / beta), weights)
        size = beta * (r.T @ np.abs(x)).max() + beta * r.sum(axis=0).max() * np.abs(means).max()
        tol = 2 * N * U * size
        err = np.abs(got - expected)
        n, j = np.unravel_index(np.argmax(err), err.shape)
        assert err.max() <= tol, (
            f"N = {N}, K = {K}, beta = {beta}: g[{n}, {j}] = {got[n, j]:.10g}, expected {expected[n, j]:.10g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})"
        )


@exercise("7.2", "The true Hessian of the NLL", 2)
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
        assert got.shape == (K * d, K * d), f"K = {K}, d = {d}: expected shape (K d, K d) = {(K * d, K * d)}, got {got.shape}"
        h = 1e-5
        H_h, H_2h = _fd_hessian(x, means, beta, weights, h), _fd_hessian(x, means, beta, weights, 2 * h)
        # truncation of H_h is c h^2, of H_2h 4 c h^2, so |H_h - H_2h| is 3 times the truncation of H_h;
        # the rounding of a difference quotient is about u max|grad| / h
        g_max = np.abs(gmm.isotropic_nll_gradient(x, means, beta, weights)).max()
        scale = np.abs(H_h).max()
        tol = 2 * np.abs(H_h - H_2h).max() + 8 * U * (g_max + scale) / h
        err = np.abs(got - H_h)
        i, j = np.unravel_index(np.argmax(err), err.shape)
        assert err.max() <= tol, (
            f"N = {N}, K = {K}, d = {d}: H[{i}, {j}] (component {i // d} coordinate {i % d}, component {j // d} "
            f"coordinate {j % d}) is {got[i, j]:.8g}, central differences give {H_h[i, j]:.8g} "
            f"(error {err.max():.1e}, allowed {tol:.1e})"
        )


@exercise("7.3", "The running-mean update", 2)
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
    for chunk in np.split(np.arange(N), cuts):
        out = _call(running_mean_update, mu.copy(), counts.copy(), x[chunk].copy(), assign[chunk].copy())
        assert isinstance(out, tuple) and len(out) == 2, f"expected a pair (means, counts), got {type(out).__name__}"
        mu, counts = np.asarray(out[0]), np.asarray(out[1])
        assert mu.shape == (K, d), f"means: expected shape {(K, d)}, got {mu.shape}"
        assert counts.shape == (K,), f"counts: expected shape {(K,)}, got {counts.shape}"
    sizes = np.bincount(assign, minlength=K)
    assert np.array_equal(counts, sizes), f"counts after the stream are {counts.tolist()}, the cluster sizes {sizes.tolist()}"
    assert np.array_equal(mu[K - 1], start[K - 1]), (
        f"row {K - 1} received no point and must stay {start[K - 1].tolist()}, got {mu[K - 1].tolist()}")
    batch = np.stack([x[assign == n].mean(axis=0) for n in range(K - 1)])
    n_chunks = len(cuts) + 1
    # each fold rounds a few times, relative u each, and the errors add up over the batches (section 6)
    tol = 4 * n_chunks * U * np.abs(batch).max()
    err = np.abs(mu[:K - 1] - batch)
    n, j = np.unravel_index(np.argmax(err), err.shape)
    assert np.all(np.isfinite(mu)) and err.max() <= tol, (
        f"after {n_chunks} batches, row {n} coordinate {j} is {float(mu[n, j])!r}, the batch mean of its points is "
        f"{float(batch[n, j])!r} (error {err.max():.1e}, allowed {tol:.1e})"
    )
    # one step from nonzero counts, against refimpl
    c0 = rng.integers(1, 10, size=K)
    xb, ab = rng.normal(size=(7, d)), rng.integers(0, K, size=7)
    got_mu, got_c = (np.asarray(a) for a in _call(running_mean_update, start.copy(), c0.copy(), xb.copy(), ab.copy()))
    exp_mu, exp_c = gmm.running_mean_update(start, c0, xb, ab)
    assert np.array_equal(got_c, exp_c), f"counts {c0.tolist()} + this batch: expected {exp_c.tolist()}, got {got_c.tolist()}"
    assert np.allclose(got_mu, exp_mu, rtol=0, atol=8 * U * np.abs(exp_mu).max()), (
        f"from counts {c0.tolist()}: expected means {np.round(exp_mu, 8).tolist()}, got {np.round(got_mu, 8).tolist()}")


@exercise("7.4", "A start where true Newton climbs and EM descends", 3)
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
    assert x.ndim == 2 and x.shape[1] == 1 and x.shape[0] >= 20, f"x: expected shape (N, 1) with N >= 20, got {x.shape}"
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
    assert eig.min() < -fd_err, f"the true Hessian has eigenvalues {np.round(eig, 4).tolist()}: not indefinite at this start"
    newton = means - np.linalg.solve(H, grad.ravel()).reshape(means.shape)
    em = gmm.isotropic_m_step(x, means, beta, weights)
    nll0, nll_newton, nll_em = (gmm.isotropic_nll(x, m, beta, weights) for m in (means, newton, em))
    # the NLL is a sum of N terms: rounding moves it by ~N u |NLL|; a change must exceed that to count
    noise = 4 * x.shape[0] * U * abs(nll0)
    assert nll_newton > nll0 + noise, (
        f"NLL {nll0:.8f} at the start, {nll_newton:.8f} after the true Newton step: it did not go up")
    assert nll_em < nll0 - noise, f"NLL {nll0:.8f} at the start, {nll_em:.8f} after the EM step: it did not go down"
