"""The Numba CPU backend's responsibilities, causal scan and GMA against the NumPy reference.

``cpu.gmm``, ``cpu.scan`` and ``cpu.gma`` mirror ``refimpl.gmm``,
``refimpl.scan`` and ``refimpl.gma``: the same results to rounding in float64
and float32 (computed in float32), with batches, heads and awkward sizes;
the same refusals word for word; exact on the spread means; the same bits
with one thread or two.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from cpu import gma as cpu_gma  # noqa: E402
from cpu import gmm as cpu_gmm  # noqa: E402
from cpu import scan as cpu_scan  # noqa: E402
from refimpl import gma, gmm, scan  # noqa: E402
from refimpl.testing import TOL, exact_responsibilities, row_relative_error, spread_means_example  # noqa: E402
from test_tuned import CASES, DTYPES, _bad_gma, _bad_gmm, _problem, mixture  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, K, d", [(1, 1, 1), (3, 2, 1), (7, 3, 2), (65, 9, 5), (301, 16, 33)])
def test_the_responsibilities_agree(n, K, d, dtype):
    means, variances, weights = mixture(K, d, seed=n, dtype=dtype)
    x = np.random.default_rng(n + 1).normal(size=(n, d)).astype(dtype)
    for plain, fused in ((gmm.responsibilities, cpu_gmm.responsibilities), (gmm.log_responsibilities, cpu_gmm.log_responsibilities)):
        want, got = plain(x, means, variances, weights), fused(x, means, variances, weights)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(got, want, **TOL[dtype])


def test_float32_is_computed_in_float32():
    """A float64 computation rounded to float32 would be within half an ulp of every entry; float32 arithmetic is not."""
    means, variances, weights = (a.astype(np.float32) for a in mixture(16, 32, seed=3))
    x = np.random.default_rng(4).normal(size=(400, 32)).astype(np.float32)
    f32 = cpu_gmm.log_responsibilities(x, means, variances, weights)
    f64 = cpu_gmm.log_responsibilities(*(a.astype(np.float64) for a in (x, means, variances, weights)))
    assert f32.dtype == np.float32
    ulps = np.abs(f32.astype(np.float64) - f64) / np.spacing(np.abs(f64.astype(np.float32)))
    assert np.max(ulps) > 4


def test_the_spread_means_are_exact():
    """From the differences: no cancellation, whatever the means' magnitude (the expansion alone loses every digit here)."""
    x, means, variances, weights = spread_means_example(n=200)
    exact = exact_responsibilities(x, means, variances, weights)
    assert row_relative_error(cpu_gmm.responsibilities(x, means, variances, weights), exact) <= 1e-14


@pytest.mark.parametrize("name", ["responsibilities", "log_responsibilities"])
@pytest.mark.parametrize("case", range(len(_bad_gmm())))
def test_the_responsibilities_refuse_what_the_reference_refuses(name, case):
    kwargs = _bad_gmm()[case]
    with pytest.raises((TypeError, ValueError)) as ref:
        getattr(gmm, name)(**kwargs)
    with pytest.raises(type(ref.value)) as got:
        getattr(cpu_gmm, name)(**kwargs)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, F, d_v", [(1, 1, 1), (2, 3, 1), (7, 3, 5), (130, 17, 9), (300, 64, 20)])
def test_the_causal_scan_agrees(n, F, d_v, dtype):
    rng = np.random.default_rng(n)
    phi_q, phi_k = rng.uniform(0, 1, size=(2, n, F)).astype(dtype)
    v = rng.normal(size=(n, d_v)).astype(dtype)
    out, cache = cpu_scan.scan_forward(phi_q, phi_k, v, True, 1e-6, 16)
    want, want_cache = scan.scan_forward(phi_q, phi_k, v, True, 1e-6, 16)
    assert out.dtype == dtype and isinstance(cache, scan.FeatureAttentionCache)
    np.testing.assert_allclose(out, want, **TOL[dtype])
    np.testing.assert_allclose(cache.den, want_cache.den, **TOL[dtype])
    g = rng.normal(size=(n, d_v)).astype(dtype)
    got, ref = cpu_scan.scan_backward(g, cache), scan.scan_backward(g, want_cache)
    # the gradients are sums of terms of either sign: the tolerance is relative to the size of the terms
    scale = np.max(np.abs(g)) * max(1.0, np.max(np.abs(v))) * F / np.min(cache.den)
    for name in ref._fields:
        assert getattr(got, name).dtype == dtype
        np.testing.assert_allclose(getattr(got, name), getattr(ref, name), rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale, err_msg=name)


def test_prefix_contract_is_its_definition():
    rng = np.random.default_rng(5)
    b, a, w = rng.normal(size=(9, 3)), rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
    for reverse in (False, True):
        got = cpu_scan.prefix_contract(b, a, w, reverse=reverse)
        for t in range(9):
            js = range(t, 9) if reverse else range(t + 1)
            state = sum(np.outer(b[j], a[j]) for j in js)
            np.testing.assert_allclose(got[t], state @ w[t], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading, per_head, causal, N, K, d_r, d_v", CASES)
def test_gma_forward_and_backward_agree(leading, per_head, causal, N, K, d_r, d_v, dtype):
    args = _problem(leading, per_head, N, K, d_r, d_v, dtype, seed=N + K)
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=4)
    out_c, cache_c = cpu_gma.gma_forward(*args, causal=causal, chunk_size=4)
    assert type(cache_c) is type(cache) and out_c.dtype == dtype
    np.testing.assert_allclose(out_c, out, **TOL[dtype])
    g = np.random.default_rng(1).normal(size=out.shape).astype(dtype)
    want, got = gma.gma_backward(g, cache), cpu_gma.gma_backward(g, cache_c)
    for name in want._fields:
        w, b = getattr(want, name), getattr(got, name)
        assert b.shape == w.shape and b.dtype == dtype, name
        np.testing.assert_allclose(b, w, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * max(1.0, np.max(np.abs(w))), err_msg=name)
    # gma with variances and weights: the same numbers
    variances, log_weights = gma.mixture_from_raw(args[4], args[5], 1e-6)
    plain = (args[0], args[1], args[2], args[3], variances, np.exp(log_weights))
    np.testing.assert_allclose(cpu_gma.gma(*plain, causal=causal), gma.gma(*plain, causal=causal), **TOL[dtype])


@pytest.mark.parametrize("case", range(len(_bad_gma())))
def test_gma_refuses_what_the_reference_refuses(case):
    kwargs = _bad_gma()[case]
    with pytest.raises((TypeError, ValueError)) as ref:
        gma.gma_forward(**kwargs)
    with pytest.raises(type(ref.value)) as got:
        cpu_gma.gma_forward(**kwargs)
    assert str(got.value) == str(ref.value)


def test_a_bad_cache_or_gradient_is_refused_alike():
    args = _problem((), False, 6, 3, 2, 2, np.float64)
    out, cache = gma.gma_forward(*args)
    for grad, c in ((np.ones((5, 2)), cache), (np.ones(out.shape), None), (np.ones(out.shape), cache._asdict())):
        with pytest.raises((TypeError, ValueError)) as ref:
            gma.gma_backward(grad, c)
        with pytest.raises(type(ref.value)) as got:
            cpu_gma.gma_backward(grad, c)
        assert str(got.value) == str(ref.value)


def _all_results():
    x, means, variances, weights = *[np.random.default_rng(7).normal(size=(1001, 8))], *mixture(5, 8, seed=8)
    args = _problem((2,), True, 600, 5, 3, 4, np.float64, seed=9)
    results = [cpu_gmm.responsibilities(x, means, variances, weights)]
    for causal in (False, True):
        out, cache = cpu_gma.gma_forward(*args, causal=causal)
        results += [out, *cpu_gma.gma_backward(np.ones_like(out), cache)]
    return results


def test_the_same_bits_with_one_thread_or_two(monkeypatch):
    """Every sum is taken in an order fixed by the data, not by how the rows are shared among threads.

    The threaded kernels (forced here for every size) with one thread and
    with two, and the serial kernels that small work runs, all give the same bits.
    """
    from cpu import _jit

    threads = numba.get_num_threads()
    try:
        monkeypatch.setattr(_jit, "SERIAL_WORK", 0)
        numba.set_num_threads(1)
        one = _all_results()
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = _all_results()
        monkeypatch.setattr(_jit, "SERIAL_WORK", float("inf"))
        serial = _all_results()
    finally:
        numba.set_num_threads(threads)
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(one, two, serial))
