"""Checks of lesson 4's exercises (the gradients of GMA, causal included, and their bounds).

Each check builds its own seeded problem at small sizes, calls the answer and
compares it with an independent result: central differences of the explicit
form (4.1), ``refimpl.attention.feature_attention_backward`` and
``refimpl.gma.gma_backward`` with ``causal=True`` and a chunk size that does
not divide the sequence (4.2, 4.3), ``refimpl.theory`` (4.4).  Machine
epsilon is ``U`` (the glossary's $u$); every tolerance says where it comes
from (``docs/floating_point.md``, section Lesson 4).
"""

from __future__ import annotations

import numpy as np

import _hints
from _course import exercise
from refimpl import attention, gma, gmm, numerics, theory

U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16
FIELDS = ("x_q", "x_k", "v", "means", "raw_variances", "logits")

# every implementation in the project of the causal mixing and its backward (the reference's modules, public and
# private functions alike, the tuned and CPU versions, the GPU kernels and their NumPy twins) and of the GMA backward
MIXING = ("refimpl.attention", "refimpl.scan", "cpu.scan", "gpu.numba_cuda.scan", "gpu.cupy_kernels.scan")
GMA_BACKWARD = ("refimpl.gma", "refimpl.tuned", "cpu.gma", "gpu.numba_cuda.gma", "gpu.cupy_kernels.gma", "app.layers")


def _call(answer, *args, **kwargs):
    """``answer(*args)`` with numpy's floating-point warnings silenced: a nan is reported by the check."""
    with np.errstate(all="ignore"):
        return answer(*args, **kwargs)


def _responsibilities(rng, n, K):
    return rng.dirichlet(np.ones(K), size=n)


def _array(a, shape, what):
    a = np.asarray(a, dtype=float)
    assert a.shape == shape, _hints.explain(f"{what}: expected shape {shape}, got {a.shape}", hints=[_hints.shape(a.shape, shape)])
    assert np.all(np.isfinite(a)), _hints.explain(f"{what}: has non-finite entries",
                                                  hints=["an overflow or 0 / 0: is a denominator den_t = 0 somewhere?"])
    return a


def _causal_pattern(bad_rows, n, reverse):
    """A hint when only the token whose (reverse) prefix sum is the full sum is right: the bidirectional backward."""
    bad = set(np.asarray(bad_rows).tolist())
    edge = 0 if reverse else n - 1
    if n > 1 and bad and edge not in bad:
        if reverse:
            return ("the bidirectional backward: right at the first token only, where the reverse sums over t >= j "
                    "take every query; sums over all the tokens where the reverse prefix sums belong")
        return ("the bidirectional backward: right at the last token only, where the prefix sum over j <= t is the "
                "full sum; sums over all the keys where the prefix sums belong")
    return None


@exercise("4.1", "The gradient of the guard", 1, points=2, partial=True)
def check_guard_gradient(guard_gradient):
    """``guard_gradient(G, gamma_q, gamma_k, v, eps) -> float``: $\\partial L/\\partial\\epsilon$.

    Bidirectional GMA from given responsibilities, ``gamma_q`` (N_q, K),
    ``gamma_k`` (N_k, K), ``v`` (N_k, d_v), loss ``L = sum(G * O)`` with
    ``G`` (N_q, d_v); compared with central differences of ``L`` in
    $\\epsilon$ (the explicit form, built here).
    """
    rng = np.random.default_rng(41)
    for n_q, n_k, K, d_v, eps in ((6, 8, 3, 2, 1e-6), (5, 4, 4, 3, 0.05), (9, 7, 2, 1, 1.0)):
        gamma_q, gamma_k = _responsibilities(rng, n_q, K), _responsibilities(rng, n_k, K)
        v, G = rng.normal(size=(n_k, d_v)), rng.normal(size=(n_q, d_v))
        got = _call(guard_gradient, G.copy(), gamma_q.copy(), gamma_k.copy(), v.copy(), eps)
        assert np.ndim(got) == 0, _hints.explain(
            f"N_q = {n_q}: expected one number (a sum over the queries), got shape {np.shape(got)}",
            hints=[_hints.shape(np.shape(got), ())])
        got = float(got)
        a = gamma_q @ gamma_k.T  # the explicit form, built here

        def loss(e):
            return np.sum(G * ((a @ v) / (a.sum(axis=1) + e)[:, None]))

        h = 1e-5
        fd = (loss(eps + h) - loss(eps - h)) / (2 * h)
        lam = np.sum(np.abs(G * ((a @ v) / (a.sum(axis=1) + eps)[:, None])))  # size of the terms of L
        d_min = a.sum(axis=1).min() + eps - h
        # truncation h^2/6 |L'''| with |L'''| <= 6 Lambda / d_min^3 (L is a sum of G.n_i / (d_i + e)),
        # plus rounding: L is off by about (N_k + K + 2) u Lambda, divided by 2h; twice that for safety
        tol = 2 * (h**2 * lam / d_min**3 + (n_k + K + 2) * U * lam / h)
        den = a.sum(axis=1) + eps
        assert abs(got - fd) <= tol, _hints.explain(
            f"N_q = {n_q}, N_k = {n_k}, K = {K}, eps = {eps}: got {got:.10g}, central differences give {fd:.10g} "
            f"(difference {abs(got - fd):.1e}, allowed {tol:.1e})",
            got, fd, known={
                "(G_i . n_i) / den_i: the numerator n_i in place of the output o_i (a factor den_i too many)":
                    -np.sum(np.sum(G * (a @ v), axis=1) / den),
            })


def _abs_mixing_terms(G, gq, gk, v, den, out):
    """Entrywise sums of |terms| of the causal mixing gradients: the scale of their rounding."""
    gn, delta = np.abs(G / den[:, None]), np.abs(np.sum(G * out, axis=1) / den)
    m = np.tril(gn @ np.abs(v).T + delta[:, None])  # |G~_t . v_j| + |delta_t| bounds, j <= t
    a = np.tril(gq @ gk.T)
    return m @ gk, m.T @ gq, a.T @ gn


@exercise("4.2", "The causal mixing backward", 2, points=4, partial=True, refuse=MIXING + GMA_BACKWARD)
def check_causal_mixing_backward(causal_mixing_backward):
    """``causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6) -> (d_gamma_q, d_gamma_k, d_v)``.

    The gradients of ``L = sum(G * O)`` through causal mixing
    ``o_t = (gamma_q_t^T S_t) / (gamma_q_t . z_t + eps)``, shapes (N, K),
    (N, K), (N, d_v): the forward prefix sums ``S_t``, ``z_t`` for the
    queries, the reverse prefix sums ``R_j``, ``r_j`` (``t >= j``) for the keys
    and values.
    """
    rng = np.random.default_rng(42)
    eps = 1e-6
    for n, K, d_v in ((1, 2, 2), (11, 3, 2), (17, 4, 3)):
        gq, gk = _responsibilities(rng, n, K), _responsibilities(rng, n, K)
        v, G = rng.normal(size=(n, d_v)), rng.normal(size=(n, d_v))
        out, cache = attention.feature_attention_forward(gq, gk, v, causal=True, eps=eps, chunk_size=3)
        ref = attention.feature_attention_backward(G, cache)
        got = _call(causal_mixing_backward, G.copy(), gq.copy(), gk.copy(), v.copy(), eps)
        assert isinstance(got, tuple) and len(got) == 3, "expected a tuple (d_gamma_q, d_gamma_k, d_v)"
        shapes = {"d_gamma_q": (n, K), "d_gamma_k": (n, K), "d_v": (n, d_v)}
        scales = _abs_mixing_terms(G, gq, gk, v, cache.den, out)
        hints = {
            "d_gamma_q": "S_t G~_t + delta_t z_t, with the prefix sums over j <= t",
            "d_gamma_k": "R_j v_j + r_j, with the reverse sums over t >= j (t = j included)",
            "d_v": "R_j^T gamma_k_j, with the reverse sums over t >= j (t = j included)",
        }
        # what the check can name: the term of t = j in the reverse sums, and delta's term in d_gamma_q
        G_n, delta = G / cache.den[:, None], -np.sum(G * out, axis=1) / cache.den
        known = {
            "d_gamma_q": {"the denominator's term delta_t z_t dropped": ref[0] - delta[:, None] * np.cumsum(gk, axis=0)},
            "d_gamma_k": {"reverse sums exclusive of t = j: key j misses its own query's term":
                          ref[1] - gq * np.sum(G_n * v, axis=1)[:, None] - gq * delta[:, None]},
            "d_v": {"reverse sums exclusive of t = j: value j misses its own query's term":
                    ref[2] - np.sum(gq * gk, axis=1)[:, None] * G_n},
        }
        for (name, shape), mine, theirs, scale in zip(shapes.items(), got, ref, scales):
            mine = _array(mine, shape, f"N = {n}, {name}")
            # each entry sums at most N + d_v + 2 rounded products of these sizes, in two orders
            tol = 4 * (n + K + d_v + 2) * U * scale
            bad = np.abs(mine - theirs) > tol
            if bad.any():
                i = tuple(int(k) for k in np.argwhere(bad)[0])
                raise AssertionError(_hints.explain(
                    f"N = {n}, K = {K}: {name}{list(i)} = {mine[i]:.6g}, refimpl gives {theirs[i]:.6g} "
                    f"(difference {abs(mine[i] - theirs[i]):.1e}, allowed {tol[i]:.1e}); {name} = {hints[name]}",
                    mine, theirs, known=known[name],
                    hints=[_causal_pattern(np.unique(np.nonzero(bad)[0]), n, reverse=name != "d_gamma_q")]))


def _per_token_scales(cache, G):
    """sum over tokens of |per-token term| for each gradient of gma_backward: the scale of their rounding."""
    mix = cache.mixing
    # |terms| of dL/dGamma_Q and dL/dGamma_K: g itself may be small by cancellation, its rounding is not
    g_abs_q, g_abs_k, _ = _abs_mixing_terms(G, mix.phi_q, mix.phi_k, mix.v, mix.den, mix.out)
    var, means = cache.variances, cache.means
    scales = {"means": 0.0, "raw_variances": 0.0, "logits": 0.0}
    for name, x, gam, g in (("x_q", cache.x_q, cache.gamma_q, g_abs_q), ("x_k", cache.x_k, cache.gamma_k, g_abs_k)):
        c = gam * (g + np.sum(gam * g, axis=1, keepdims=True))  # |terms| of c_m = gamma_m (g_m - gbar)
        diff = x[:, None, :] - means[None]
        scales[name] = np.einsum("nk,nkd->nd", c, np.abs(diff) / var)
        scales["means"] = scales["means"] + np.einsum("nk,nkd->kd", c, np.abs(diff) / var)
        scales["raw_variances"] = scales["raw_variances"] + np.einsum("nk,nkd->kd", c, (diff**2 + var) / (2 * var**2))
        scales["logits"] = scales["logits"] + c.sum(axis=0)
    den = cache.mixing.den
    scales["v"] = np.tril(cache.gamma_q @ cache.gamma_k.T).T @ np.abs(G / den[:, None])
    return scales


@exercise("4.3", "The causal GMA backward", 2, points=4, partial=True, refuse=GMA_BACKWARD + MIXING)
def check_causal_gma_backward(causal_gma_backward):
    """``causal_gma_backward(G, cache) -> (x_q, x_k, v, means, raw_variances, logits)``.

    ``cache`` is the ``GMACache`` of ``gma.gma_forward(..., causal=True)``
    (fields ``x_q``, ``x_k``, ``means``, ``raw_variances``, ``variances``,
    ``gamma_q``, ``gamma_k``, ``mixing``; ``mixing.v`` is ``V``,
    ``mixing.eps`` the guard).  Return the six gradients of
    ``L = sum(G * O)`` in that order, shapes of the inputs, as
    ``gma.gma_backward`` returns them (without calling it).
    """
    rng = np.random.default_rng(43)
    for n, K, d_r, d_v in ((1, 2, 2, 2), (10, 3, 2, 3), (13, 4, 3, 2)):
        inputs = dict(
            x_q=rng.normal(size=(n, d_r)),
            x_k=rng.normal(size=(n, d_r)),
            v=rng.normal(size=(n, d_v)),
            means=rng.normal(size=(K, d_r)),
            raw_variances=rng.normal(size=(K, d_r)),
            logits=rng.normal(size=K),
        )
        out, cache = gma.gma_forward(*inputs.values(), causal=True, chunk_size=4)
        G = rng.normal(size=out.shape)
        ref = gma.gma_backward(G, cache)
        got = _call(causal_gma_backward, G.copy(), cache)
        assert len(got) == 6, f"expected six gradients {FIELDS}, got {len(got)}"
        scales = _per_token_scales(cache, G)
        # what the check can name: the queries' share of the parameter gradients, the softplus's derivative
        d_phi_q = attention.feature_attention_backward(G, cache.mixing).phi_q
        c_q = numerics.softmax_backward(cache.gamma_q, d_phi_q, axis=1)
        share_q = np.einsum("nk,nkd->kd", c_q, (cache.x_q[:, None, :] - cache.means[None]) / cache.variances)
        known = {
            "means": {"the keys' share forgotten: the queries' share of the parameter gradients only": share_q},
            "raw_variances": {"no sigmoid: dL/dsigma^2 for the raw variances, the chain rule through softplus dropped":
                              ref.raw_variances / gmm.sigmoid(cache.raw_variances)},
        }
        logit_sum = float(np.sum(np.asarray(got[5], dtype=float))) if np.size(got[5]) else 0.0
        scale_a = 64 * 2 * n * U * np.max(scales["logits"]) * K
        mean_hint = (f"the gamma-weighted mean gbar replaced: your logits gradient sums to {logit_sum:.3g} over the "
                     "components, not 0 (the softmax backward gamma_m (g_m - gbar), gbar = sum_m gamma_m g_m, sums to zero)"
                     if abs(logit_sum) > scale_a else None)
        for name, mine in zip(FIELDS, got):
            theirs = getattr(ref, name)
            mine = _array(mine, theirs.shape, f"N = {n}, gradient of {name}")
            err = np.max(np.abs(mine - theirs))
            # the lesson's bound 64 n u kappa (n = N_Q + N_K per-token terms), written without dividing
            # by the largest entry: 64 n u times the largest sum of |per-token terms|
            tol = 64 * 2 * n * U * np.max(scales[name])
            bad_rows = np.unique(np.nonzero(np.abs(mine - theirs) > tol)[0]) if mine.ndim else []
            assert err <= tol, _hints.explain(
                f"N = {n}, K = {K}: the gradient of {name} differs from refimpl's by {err:.1e} (allowed {tol:.1e}; "
                f"largest entry {np.max(np.abs(theirs)):.2e}). "
                + ("Check the mixing step (prefix sums for the queries, reverse sums for the keys)."
                   if name in ("x_q", "x_k", "v") else "Check the responsibilities step and the reparameterisation."),
                mine, theirs, known=known.get(name),
                hints=[mean_hint, _causal_pattern(bad_rows, n, reverse=name != "x_q") if name in ("x_q", "x_k", "v") else None])


def _loose_links(x, means, variances, weights, g, R):
    """Which links of section 5's chain of inequalities are strict for this case: one hint each."""
    gamma = gmm.responsibilities(x[None], means, variances, weights)[0]
    u = (means - x) / variances
    c = gamma * (g - gamma @ g)
    hints = []
    if np.linalg.norm(x) > 0:
        hints.append(f"x off the origin (||x|| = {np.linalg.norm(x):.3g}): the u_m of both signs of c_m cannot then be opposite")
    hi, lo = int(np.argmax(g)), int(np.argmin(g))
    if abs(gamma[hi] - 0.5) > 1e-12 or abs(gamma[lo] - 0.5) > 1e-12:
        hints.append(f"an uneven split of gamma: gamma(x) = {np.round(gamma, 4).tolist()}; Popoviciu is an equality "
                     "only with the mass split 1/2, 1/2 between the largest and the smallest g_m")
    w = c[:, None] * u
    w = w[np.linalg.norm(w, axis=1) > 0]
    if len(w) > 1:
        cos = (w @ w[0]) / (np.linalg.norm(w, axis=1) * np.linalg.norm(w[0]))
        if np.min(cos) < 1 - 1e-9:
            hints.append("the vectors c_m u_m do not point the same way: the u_m of positive and negative c_m must be "
                         "opposite (the triangle inequality)")
    short = [m for m in range(len(c)) if c[m] != 0 and np.linalg.norm(u[m]) < R * (1 - 1e-12)]
    if short:
        hints.append(f"||u_m|| < R for components {short}: a variance above the floor or a mean short of the largest norm")
    return hints


@exercise("4.4", "The input bound is attained", 3, points=6, partial=False)
def check_bound_attained(tight_case):
    """``tight_case = (x, means, variances, weights, g)``: a token and a mixture where the bound is an equality.

    ``x`` (d,), ``means`` and ``variances`` (K, d) with K >= 2, ``weights``
    (K,) on the simplex, ``g`` (K,) the upstream gradient with respect to
    $\\gamma(x)$.  With $R = (\\|x\\| + \\max_m\\|\\mu_m\\|)/\\min\\sigma^2$ (the
    smallest variance entry as the floor), $\\|\\partial L/\\partial x\\|$ must
    equal $\\tfrac12\\operatorname{range}(g)R$ up to rounding.
    """
    assert isinstance(tight_case, tuple) and len(tight_case) == 5, "expected a tuple (x, means, variances, weights, g)"
    x, means, variances, weights, g = (np.asarray(a, dtype=float) for a in tight_case)
    assert x.ndim == 1, f"x: expected a vector (d,), got shape {x.shape}"
    d = x.shape[0]
    assert means.ndim == 2 and means.shape[1] == d and means.shape[0] >= 2, (
        f"means: expected shape (K, d) with K >= 2 and d = {d}, got {means.shape}")
    K = means.shape[0]
    assert variances.shape == (K, d), f"variances: expected shape (K, d) = {(K, d)}, got {variances.shape}"
    assert np.all(variances > 0), "variances: every entry must be > 0"
    assert weights.shape == (K,) and g.shape == (K,), f"weights, g: expected shape (K,) = {(K,)}, got {weights.shape}, {g.shape}"
    assert np.all(weights >= 0) and abs(weights.sum() - 1) <= 4 * K * U, "weights: expected a probability vector"
    assert np.ptp(g) > 0, "g: a constant g gives no gradient at all (range(g) = 0); the bound is then trivially 0 = 0"
    dx = theory.per_token_gradients(x[None], means, variances, weights, g[None]).x[0]
    R = theory.bound_radius(means, variances, float(np.linalg.norm(x)))
    bound = 0.5 * np.ptp(g) * R
    ratio = np.linalg.norm(dx) / bound
    # an equality computed through a softmax, a few products and a norm: each off by a few u
    assert ratio >= 1 - 64 * U, _hints.explain(
        f"||dL/dx|| / (range(g) R / 2) = {float(ratio)!r}, not 1 (1 - ratio = {1 - ratio:.1e}, allowed 64 u = {64 * U:.1e}): "
        "follow the chain of inequalities of section 5 "
        "and make each one an equality (the triangle inequality, Cauchy-Schwarz, Popoviciu, ||u_m|| <= R)",
        hints=_loose_links(x, means, variances, weights, g, R))
    assert ratio <= 1 + 64 * U, f"||dL/dx|| / bound = {ratio!r} exceeds 1: that would contradict section 5"
