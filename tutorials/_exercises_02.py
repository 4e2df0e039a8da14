"""Checks of lesson 2's exercises (Gaussian Mixture Attention).

Each check builds its own seeded responsibilities (``refimpl.gmm`` on random
points) at small sizes, calls the answer and compares with an independent
result: the explicit ``N x N`` affinity ``A = Gamma_Q Gamma_K^T`` formed
densely, sums written out entry by entry, and the GMM posterior with one
shared variance.  Where the point of an exercise is never to form ``A``, the
check also measures the answer's peak memory with ``tracemalloc`` (NumPy
reports its array buffers to it), which is deterministic.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np

import _hints
from _course import exercise
from refimpl import gmm

U = np.finfo(np.float64).eps  # machine epsilon u = 2^-52
# what computes the attention's rows, slots and norms: the theory module and every implementation of GMA in the project
GMA_CODE = ("refimpl.theory", "refimpl.attention", "refimpl.scan", "refimpl.gma", "refimpl.tuned", "cpu", "gpu")


def _shape(a, expected, what):
    a = np.asarray(a)
    assert a.shape == expected, _hints.explain(f"{what}: expected shape {expected}, got {a.shape}",
                                               hints=[_hints.shape(a.shape, expected)])
    return a


def _dense_hint(peak, N):
    """A hint when the peak memory is at least that of one N x N float64 matrix."""
    if peak >= 8 * N * N:
        return f"the dense N x N matrix formed: your peak is {peak / (8 * N * N):.2f} times the size of one"
    return None


def _gammas(rng, N_q, N_k, K, d_r=3):
    """Responsibilities of random routing queries and keys under one random diagonal GMM."""
    means = rng.normal(size=(K, d_r)) * 1.5
    variances = rng.uniform(0.3, 1.5, size=(K, d_r))
    weights = rng.dirichlet(np.ones(K))
    gamma_q = gmm.responsibilities(2 * rng.normal(size=(N_q, d_r)), means, variances, weights)
    gamma_k = gmm.responsibilities(2 * rng.normal(size=(N_k, d_r)), means, variances, weights)
    return gamma_q, gamma_k


def _peak_bytes(f):
    """Peak bytes allocated (as tracemalloc sees them) while f() runs, and f's result."""
    tracemalloc.start()
    try:
        out = f()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


@exercise("2.1", "One row of the attention, without the N x N matrix", 1, points=2, partial=True, refuse=GMA_CODE)
def check_attention_row(attention_row):
    """``attention_row(gamma_q, gamma_k, i, eps) -> (N_k,)``: row ``i`` of ``D^-1 A``, in ``O(N K)``.

    ``A = Gamma_Q Gamma_K^T`` and ``D = diag(A 1 + eps)``; ``gamma_q`` is
    (N_q, K), ``gamma_k`` (N_k, K).  Checked against the row of the dense
    matrix, for ``eps = 1e-6`` and for a large ``eps = 0.5`` (so that a
    forgotten guard shows), and on a problem with ``N_q = N_k = 4000`` where
    the answer may not allocate an ``N x N`` matrix.
    """
    rng = np.random.default_rng(21)
    gamma_q, gamma_k = _gammas(rng, 30, 40, 5)
    dense = gamma_q @ gamma_k.T
    for eps in (1e-6, 0.5):
        for i in (0, 17, 29):
            got = _shape(attention_row(gamma_q.copy(), gamma_k.copy(), i, eps), (40,),
                         f"attention_row(gamma_q, gamma_k, {i}, {eps}) with N_q = 30, N_k = 40, K = 5")
            expected = dense[i] / (dense[i].sum() + eps)
            # entries in [0, 1]: A_ij sums K products, the denominator N_k + K terms; (N_k + K + 2) u bounds each
            # relative error to first order, and two evaluations differ by at most twice that
            tol = 2 * (40 + 5 + 2) * U
            err = np.max(np.abs(got - expected))
            assert err <= tol, _hints.explain(
                f"row {i}, eps = {eps}: max error {err:.1e} against the dense row (allowed {tol:.1e}); "
                f"its sum is {got.sum():.6f}, it should be {expected.sum():.6f}",
                got, expected, known={
                    "the guard eps missing from the denominator": dense[i] / dense[i].sum(),
                    "normalised by the query's own mass sum_k gamma_ik = 1, not by gamma_i . Z":
                        dense[i] / (gamma_q[i].sum() + eps),
                })
    N = 4000
    gq_big, gk_big = _gammas(rng, N, N, 4)
    peak, got = _peak_bytes(lambda: attention_row(gq_big, gk_big, 7, 1e-6))
    got = _shape(got, (N,), f"attention_row with N_q = N_k = {N}")
    # a row costs O(N K): 64 N-vectors of float64 are far more than it needs and far less than 8 N^2 bytes
    assert peak <= 64 * 8 * N, _hints.explain(
        f"with N = {N} your row allocated {peak / 2**20:.1f} MiB at its peak (allowed {64 * 8 * N / 2**20:.1f} MiB; "
        f"an N x N float64 matrix is {8 * N * N / 2**20:.0f} MiB): read the slots, do not form A",
        hints=[_dense_hint(peak, N)])


@exercise("2.2", "Slot means and mixing weights", 2, points=4, partial=True,
          refuse=GMA_CODE)
def check_slots_and_weights(slots_and_weights):
    """``slots_and_weights(gamma_q, gamma_k, v, eps) -> (W, M)``: the output as mixtures of slot means.

    ``M`` (K, d_v): ``m_k = sum_j gamma^K_jk v_j / Z_k``, the slot means;
    ``W`` (N_q, K): ``w_ik = gamma^Q_ik Z_k / (gamma^Q_i . Z + eps)``, so that
    ``W M`` is GMA's output ``Gamma_Q Gamma_K^T V / (A 1 + eps)`` and the rows
    of ``W`` sum to ``1 - eps / (gamma^Q_i . Z + eps)``.
    """
    rng = np.random.default_rng(22)
    N_q, N_k, K, d_v = 25, 35, 6, 3
    gamma_q, gamma_k = _gammas(rng, N_q, N_k, K)
    v = rng.normal(size=(N_k, d_v))
    # the slot means entry by entry, as weighted averages (no matrix product)
    z = [math.fsum(gamma_k[:, k]) for k in range(K)]
    M_ref = np.array([[math.fsum(gamma_k[:, k] * v[:, c]) / z[k] for c in range(d_v)] for k in range(K)])
    for eps in (1e-6, 0.5):
        got = slots_and_weights(gamma_q.copy(), gamma_k.copy(), v.copy(), eps)
        assert isinstance(got, tuple) and len(got) == 2, f"return the pair (W, M), got {type(got).__name__}"
        W = _shape(got[0], (N_q, K), f"W with N_q = {N_q}, K = {K}")
        M = _shape(got[1], (K, d_v), f"M with K = {K}, d_v = {d_v}")
        # M: sums of N_k products, then a division: (N_k + 2) u relative to the largest |v|, twice for two evaluations
        tol_m = 2 * (N_k + 2) * U * np.max(np.abs(v))
        err_m = np.max(np.abs(M - M_ref), axis=1)
        k = int(np.argmax(err_m))
        assert err_m[k] <= tol_m, _hints.explain(
            f"eps = {eps}: slot mean {k} is {M[k]}, the weighted average of the values with weights "
            f"gamma_k[:, {k}] / Z_{k} is {M_ref[k]} (error {err_m[k]:.1e}, allowed {tol_m:.1e})",
            M, M_ref, rows=1, known={
                "slot sums, not divided by the slot masses Z_k": M_ref * np.array(z)[:, None],
                "divided by the queries' masses, not the keys'": M_ref * (np.array(z) / gamma_q.sum(axis=0))[:, None],
            })
        assert np.all(W >= 0), f"eps = {eps}: W has negative entries, e.g. {W[W < 0][:3]}"
        den = gamma_q @ gamma_k.sum(axis=0)
        # each row sum: K terms and one division, within (K + 4) u of the exact value
        err_sum = np.max(np.abs(W.sum(axis=1) - (1 - eps / (den + eps))))
        assert err_sum <= (K + 4) * U, _hints.explain(
            f"eps = {eps}: the rows of W should sum to 1 - eps / (gamma_q_i . Z + eps); off by {err_sum:.1e} "
            f"(allowed {(K + 4) * U:.1e})",
            hints=["the guard eps missing: every row of W sums to 1 exactly"
                   if np.max(np.abs(W.sum(axis=1) - 1)) <= (K + 4) * U else None])
        A = gamma_q @ gamma_k.T
        out = (A @ v) / (A.sum(axis=1) + eps)[:, None]
        # the rounding model of the lesson's section 2: 4 (N + K + 1) u max|v|
        tol_o = 4 * (N_k + K + 1) * U * np.max(np.abs(v))
        err_o = np.max(np.abs(W @ M - out))
        assert err_o <= tol_o, _hints.explain(f"eps = {eps}: W M differs from GMA's output by {err_o:.1e} (allowed {tol_o:.1e})",
                                              W @ M, out, rows=1)


@exercise("2.3", "The isotropic router is linear", 2, points=4, partial=True, refuse=("refimpl.theory",))
def check_isotropic_router(isotropic_router):
    """``isotropic_router(means, variance, weights) -> (R, b)``: ``R`` (d, K) and ``b`` (K,) with
    ``softmax(x R + b)`` equal to the GMM posterior when every variance equals ``variance``.

    Checked on random points against the posterior computed from the
    distances ``||x - mu_k||^2`` themselves.
    """
    rng = np.random.default_rng(23)
    for K, d, variance in ((4, 2, 0.5), (7, 5, 2.0)):
        means = rng.normal(size=(K, d)) * 2
        weights = rng.dirichlet(np.ones(K))
        x = rng.normal(size=(50, d)) * 2
        got = isotropic_router(means.copy(), variance, weights.copy())
        assert isinstance(got, tuple) and len(got) == 2, f"return the pair (R, b), got {type(got).__name__}"
        R = _shape(got[0], (d, K), f"R with d = {d}, K = {K}")
        b = _shape(got[1], (K,), f"b with K = {K}")
        logits = x @ R + b
        sq = np.sum((x[:, None, :] - means[None]) ** 2, axis=2)
        ell = np.log(weights) - sq / (2 * variance)  # the log-joint up to the terms common to a row
        expected = np.exp(ell - ell.max(axis=1, keepdims=True))
        expected /= expected.sum(axis=1, keepdims=True)
        gamma = np.exp(logits - logits.max(axis=1, keepdims=True))
        gamma /= gamma.sum(axis=1, keepdims=True)
        # the lesson's tolerance of section 6: a few u per logit, times their size; 16 u max|l| (at least 16 u)
        tol = 16 * U * max(1.0, float(np.max(np.abs(ell))))
        err = np.max(np.abs(gamma - expected), axis=1)
        i = int(np.argmax(err))
        def posterior(logits):
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)

        def centred(a):
            return a - a.mean(axis=1, keepdims=True)

        scaled = _hints.constant_factor(centred(logits), centred(ell))
        assert err[i] <= tol, _hints.explain(
            f"K = {K}, d = {d}, variance {variance}: at point {i} softmax(x R + b) = {np.round(gamma[i], 4)}, "
            f"the posterior is {np.round(expected[i], 4)} (error {err[i]:.1e}, allowed {tol:.1e})",
            gamma, expected, hints=[scaled and f"your logits x R + b, up to a constant per row: {scaled}"], known={
                "the prior log pi_k missing from b": posterior(ell - np.log(weights)),
                "the norm term's half dropped: ||mu_k||^2 / s^2 in b where ||mu_k||^2 / (2 s^2) belongs":
                    posterior(ell - np.sum(means**2, axis=1) / (2 * variance)),
                "R without the precision 1 / s^2": posterior(ell + (x @ means.T) * (1 - 1 / variance)),
            })


@exercise("2.4", "The size of A without forming it", 3, points=6, partial=True, refuse=GMA_CODE)
def check_affinity_norm(affinity_norm):
    """``affinity_norm(gamma_q, gamma_k) -> float``: the Frobenius norm of ``A = Gamma_Q Gamma_K^T``, in ``O(N K^2)``.

    Checked against the dense matrix summed exactly (``math.fsum``), and on
    ``N = 4000`` where the answer may not allocate an ``N x N`` matrix.
    """
    rng = np.random.default_rng(24)
    for N_q, N_k, K in ((40, 60, 5), (120, 90, 12)):
        gamma_q, gamma_k = _gammas(rng, N_q, N_k, K)
        got = np.asarray(affinity_norm(gamma_q.copy(), gamma_k.copy()))
        assert got.ndim == 0, _hints.explain(f"return one number, got an array of shape {got.shape}",
                                             hints=[_hints.shape(got.shape, ())])
        got = float(got)
        A = gamma_q @ gamma_k.T
        exact = math.sqrt(math.fsum((A * A).ravel()))
        # every term is nonnegative: the dense A carries (2K + 2) u relative, two N-term Gram sums N u,
        # and K^2 products summed K^2 u; the norm halves the squared norm's relative error
        tol = (N_q + N_k + K * K + 2 * K + 4) * U * exact
        gram_q, gram_k = gamma_q.T @ gamma_q, gamma_k.T @ gamma_k
        assert abs(got - exact) <= tol, _hints.explain(
            f"N_q = {N_q}, N_k = {N_k}, K = {K}: you give {got!r}, ||A||_F = {exact!r} "
            f"(error {abs(got - exact):.1e}, allowed {tol:.1e}; ratio {got / exact:.4f})",
            got, exact, known={
                "the square of the norm: the square root forgotten": exact**2,
                "the bound ||Gamma_Q||_F ||Gamma_K||_F, not the norm": np.linalg.norm(gamma_q) * np.linalg.norm(gamma_k),
                "all entries of the product of the Gram matrices summed, not its trace": np.sqrt(np.sum(gram_q @ gram_k)),
            })
    N = 4000
    gq_big, gk_big = _gammas(rng, N, N, 8)
    peak, got = _peak_bytes(lambda: affinity_norm(gq_big, gk_big))
    # O(N K^2) needs K x K matrices and at most a few N x K arrays: 16 of them are plenty, far below 8 N^2 bytes
    assert peak <= 16 * 8 * N * 8, _hints.explain(
        f"with N = {N}, K = 8 your answer allocated {peak / 2**20:.1f} MiB at its peak (allowed "
        f"{16 * 8 * N * 8 / 2**20:.1f} MiB; A alone is {8 * N * N / 2**20:.0f} MiB): do not form A",
        hints=[_dense_hint(peak, N)])
