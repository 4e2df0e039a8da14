"""The row-blocked and chunked paths give the results of the unblocked formulas.

``refimpl.tuned`` evaluates the expanded log-joint a block of rows at a time,
``refimpl.gmm`` and ``refimpl.gma`` take the differences ``x - mu`` a block
of rows at a time, and the causal scan of ``refimpl.scan`` carries the
normaliser as an extra value column.  Here each is compared with the one-line formula it optimises,
evaluated on whole arrays: at block boundaries, with N not a multiple of the
block size, for N = 1 and K = 1, in float64 and float32.  A different
blocking may change the order in which BLAS adds the terms of a product, so
the comparison allows the rounding model of the expansion,
``(4 + sqrt(d)) u s_ik`` per quadratic form, and nothing more.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gma, gmm, numerics, scan, tuned
from refimpl.testing import exact_responsibilities, row_relative_error, spread_means_example

DTYPES = [np.float64, np.float32]


def problem(n, K, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(dtype)
    means = rng.normal(size=(K, d)).astype(dtype)
    variances = rng.uniform(0.5, 2.0, size=(K, d)).astype(dtype)
    log_weights = np.log(rng.dirichlet(np.ones(K))).astype(dtype)
    return x, means, variances, log_weights


def formula(x, means, variances, log_weights):
    """The unblocked one-liner: logits, q and the size s of the expansion's terms, on whole arrays."""
    d = x.shape[1]
    p = 1 / variances
    centre = means.mean(axis=0)
    xc, mc = x - centre, means - centre
    c = np.sum(mc * mc * p, axis=1)
    q = (xc * xc) @ p.T - 2 * (xc @ (mc * p).T) + c
    log_norm = log_weights - 0.5 * (d * np.log(2 * np.pi, dtype=x.dtype) + np.sum(np.log(variances), axis=1))
    s = (np.sqrt((xc * xc) @ p.T) + np.sqrt(c)) ** 2
    return log_norm - 0.5 * q, q, s


def model_bound(x, s):
    """Twice the rounding model (both sides carry it) of the quadratic form, halved for a logit, plus the log-normaliser's rounding."""
    u = np.finfo(x.dtype).eps
    return (4 + np.sqrt(x.shape[1])) * u * s + 8 * u * (1 + np.abs(s))


def block_sizes(n):
    return sorted({1, 2, 3, max(1, n // 2), max(1, n - 1), n, n + 1, 64})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, K, d", [(1, 1, 1), (1, 5, 3), (37, 1, 4), (130, 7, 5), (257, 16, 32)])
def test_blocked_log_joint_is_the_formula_at_every_blocking(n, K, d, dtype):
    x, means, variances, log_weights = problem(n, K, d, dtype)
    want, q, s = formula(x, means, variances, log_weights)
    tol = model_bound(x, s)
    for rows in block_sizes(n):
        logits, min_quad = tuned.log_joint(x, means, variances, log_weights, refine=False, block_rows=rows)
        assert logits.dtype == dtype and min_quad.dtype == dtype
        assert np.all(np.abs(logits - want) <= tol), rows
        assert np.all(np.abs(min_quad - q.min(axis=1)) <= 2 * tol.max(axis=1)), rows


def tuned_blocks(monkeypatch, rows, K, d, dtype):
    """Make refimpl.tuned's responsibilities take ``rows`` rows per block (their work arrays hold 4K + 2d numbers a row)."""
    monkeypatch.setattr(numerics, "BLOCK_BYTES", rows * (4 * K + 2 * d) * np.dtype(dtype).itemsize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_blocked_posteriors_are_the_softmax_of_the_formula(monkeypatch, n, dtype):
    x, means, variances, log_weights = problem(n, 9, 6, dtype, seed=1)
    weights = np.exp(log_weights)
    want, _, _ = formula(x, means, variances, np.log(weights))
    u = np.finfo(dtype).eps
    shifted = want - want.max(axis=1, keepdims=True)
    gamma_want = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    for rows in (1, 7, 64, n):
        tuned_blocks(monkeypatch, rows, 9, 6, dtype)
        gamma = tuned.responsibilities(x, means, variances, weights)
        log_gamma = tuned.log_responsibilities(x, means, variances, weights)
        assert gamma.dtype == dtype and log_gamma.dtype == dtype
        np.testing.assert_allclose(gamma, gamma_want, rtol=0, atol=200 * u)
        np.testing.assert_allclose(np.exp(log_gamma), gamma, rtol=0, atol=200 * u)
        np.testing.assert_allclose(gamma.sum(axis=1), 1, rtol=0, atol=20 * u)


def test_the_default_blocking_covers_every_row_of_a_long_input():
    """N several default blocks long and not a multiple of one: no row is skipped or written twice."""
    K, d = 2, 1
    rows = numerics.block_rows((4 * K + 2 * d) * 8)
    n = 3 * rows + 5
    x, means, variances, log_weights = problem(n, K, d, np.float64, seed=2)
    want, q, s = formula(x, means, variances, log_weights)
    logits, min_quad = tuned.log_joint(x, means, variances, log_weights)
    assert np.all(np.abs(logits - want) <= model_bound(x, s))
    np.testing.assert_allclose(min_quad, q.min(axis=1), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_the_refinement_is_exact_whatever_the_blocking(monkeypatch, rows):
    """The spread-means counterexample needs recomputation in every row: blocks must not lose any."""
    x, means, variances, weights = spread_means_example()
    exact = exact_responsibilities(x, means, variances, weights)
    tuned_blocks(monkeypatch, rows, *means.shape, x.dtype)
    gamma = tuned.responsibilities(x, means, variances, weights)
    assert row_relative_error(gamma, exact) < 1e-12
    _, min_quad = tuned.log_joint(x, means, variances, np.log(weights), block_rows=rows)
    _, min_full = tuned.log_joint(x, means, variances, np.log(weights), block_rows=len(x))
    np.testing.assert_array_equal(min_quad, min_full)  # recomputed from the differences: no BLAS, no blocking effect


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_the_definition_does_not_depend_on_the_blocks(monkeypatch, rows, dtype):
    """refimpl.gmm takes the differences of a block of rows at a time (K d numbers a row): every blocking, the same bits."""
    x, means, variances, log_weights = problem(45, 7, 5, dtype, seed=rows)
    whole = gmm.log_joint(x, means, variances, log_weights)
    monkeypatch.setattr(numerics, "BLOCK_BYTES", rows * 7 * 5 * np.dtype(dtype).itemsize)
    blocked = gmm.log_joint(x, means, variances, log_weights)
    for w, b in zip(whole, blocked):
        np.testing.assert_array_equal(b, w)


def test_block_rows_follow_the_cache_budget():
    assert numerics.block_rows((4 * 64 + 2 * 32) * 8) * (4 * 64 + 2 * 32) * 8 <= numerics.BLOCK_BYTES
    assert numerics.block_rows((4 * 64 + 2 * 32) * 4) == 2 * numerics.block_rows((4 * 64 + 2 * 32) * 8)
    assert numerics.block_rows(10**12) == 1


# ---------------------------------------------------------------------------
# refimpl.tuned's row reductions against refimpl.numerics' plain ones
# ---------------------------------------------------------------------------


def test_row_max_by_argmax_equals_the_max_reduction():
    a = np.array([[0.0, 3.0, -1.0], [-np.inf, -np.inf, -np.inf], [np.nan, 1.0, 2.0], [1.0, np.nan, np.inf], [2.0, 2.0, 2.0]])
    with np.errstate(invalid="ignore"):
        want = np.max(a, axis=1, keepdims=True)
    want = np.where(np.isfinite(want), want, 0)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(numerics.row_max(a, axis=1), want)
        np.testing.assert_array_equal(numerics.row_max(a.T, axis=0), want.T)
    np.testing.assert_array_equal(tuned.row_max(a), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_in_place_equals_softmax_out_of_place(dtype):
    a = np.random.default_rng(3).normal(size=(17, 9)).astype(dtype) * 30
    want = numerics.softmax(a, axis=1)
    b = a.copy()
    got = tuned.softmax_rows(b)
    assert got is b
    # the row sums differ only in the order of the additions (BLAS's against NumPy's pairwise sum): each sum of n
    # positive terms is within gamma_{n-1} of the exact one, whatever the order; the division is a multiplication by
    # 1 / sum on one side (two roundings) and one rounding on the other
    n, u = a.shape[1], np.finfo(dtype).eps / 2
    np.testing.assert_allclose(got, want, rtol=(2 * (n - 1) + 3) * u, atol=0)
    ref = np.exp(a - a.max(axis=1, keepdims=True))
    np.testing.assert_allclose(want, ref / ref.sum(axis=1, keepdims=True), rtol=20 * np.finfo(dtype).eps)
    c = a.copy()
    np.testing.assert_allclose(tuned.log_softmax_rows(c), numerics.log_softmax(a, axis=1), rtol=4 * np.finfo(dtype).eps, atol=4 * np.finfo(dtype).eps)


# ---------------------------------------------------------------------------
# the causal scan with the normaliser as an extra value column
# ---------------------------------------------------------------------------


def causal_formula(phi_q, phi_k, v, eps):
    """tril(Phi_Q Phi_K^T) V / (tril(Phi_Q Phi_K^T) 1 + eps) on whole arrays: the unchunked formula."""
    a = np.tril(phi_q @ phi_k.T)
    return (a @ v) / (a.sum(axis=1) + eps)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, chunk", [(1, 1), (1, 64), (5, 2), (64, 64), (65, 64), (130, 16), (100, 7)])
def test_causal_scan_is_the_formula_at_chunk_boundaries(n, chunk, dtype):
    rng = np.random.default_rng(n + chunk)
    phi_q, phi_k = rng.uniform(0.05, 1.0, size=(2, n, 6)).astype(dtype)
    v = rng.normal(size=(n, 3)).astype(dtype)
    out, cache = scan.scan_forward(phi_q, phi_k, v, True, 1e-6, chunk)
    rtol = 1e-12 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(out, causal_formula(phi_q, phi_k, v, 1e-6), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(cache.den, np.tril(phi_q @ phi_k.T).sum(axis=1) + 1e-6, rtol=rtol)
    # the backward (checked against finite differences in test_attention) must not depend on where the chunks fall
    g = rng.normal(size=out.shape).astype(dtype)
    ref = scan.scan_backward(g, scan.scan_forward(phi_q, phi_k, v, True, 1e-6, n)[1])
    got = scan.scan_backward(g, cache)
    for name in ("phi_q", "phi_k", "v"):
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("module", [gma, tuned], ids=["gma", "tuned"])
def test_gma_float32_stays_float32(module):
    x, means, variances, log_weights = problem(70, 5, 4, np.float32)
    v = np.ones((70, 3), dtype=np.float32)
    out, cache = module.gma_forward(x, x, v, means, variances, log_weights, causal=True, chunk_size=16)
    assert out.dtype == np.float32 and cache.gamma_q.dtype == np.float32
    grads = module.gma_backward(np.ones_like(out), cache)
    assert all(g.dtype == np.float32 for g in grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, rows", [(1, 1), (23, 1), (23, 2), (23, 5), (64, 7)])
@pytest.mark.parametrize("module, row_numbers", [(gma, lambda K, d: K * d), (tuned, lambda K, d: 2 * K + 3 * d)], ids=["gma", "tuned"])
def test_blocked_gma_backward_does_not_depend_on_the_blocks(monkeypatch, module, row_numbers, n, rows, dtype):
    """The responsibility backward accumulates its sums over blocks of rows: blocks of 1, 2, 5, 7 rows give the whole-array result."""
    K, d = 6, 4
    x, means, raw_variances, logits = problem(n, K, d, dtype, seed=n + rows)
    rng = np.random.default_rng(rows)
    x_k = rng.normal(size=(n, d)).astype(dtype)
    v = rng.normal(size=(n, 3)).astype(dtype)
    out, cache = module.gma_forward(x, x_k, v, means, raw_variances, logits, causal=True, chunk_size=4)
    g = rng.normal(size=out.shape).astype(dtype)
    whole = module.gma_backward(g, cache)  # one block: n rows are far below the default budget
    monkeypatch.setattr(numerics, "BLOCK_BYTES", rows * row_numbers(K, d) * np.dtype(dtype).itemsize)
    blocked = module.gma_backward(g, cache)
    rtol = 1e-12 if dtype == np.float64 else 2e-5
    for name in whole._fields:
        w, b = getattr(whole, name), getattr(blocked, name)
        np.testing.assert_allclose(b, w, rtol=rtol, atol=rtol * np.max(np.abs(w)), err_msg=name)


def test_masked_products_that_overflow_do_not_reach_the_causal_output():
    """Above the diagonal the chunk's product may overflow to inf; the mask must set it to 0, not multiply it (inf * 0 = NaN)."""
    phi_q = np.array([[1e200], [1e-300], [1.0]])
    phi_k = np.array([[1e-300], [1e200], [1.0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    g = np.ones((3, 2))
    with np.errstate(over="ignore"):
        out, cache = scan.scan_forward(phi_q, phi_k, v, True, 1e-6, 3)
        grads = scan.scan_backward(g, cache)
    a00 = 1e200 * 1e-300
    np.testing.assert_allclose(out[0], a00 * v[0] / (a00 + 1e-6), rtol=1e-14)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(x)) for x in grads)
