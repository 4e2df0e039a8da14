"""The Numba CPU backend's responsibilities and causal scan, beyond what tests/test_conformance.py holds it to.

``cpu.gmm``, ``cpu.scan`` and ``cpu.gma`` mirror ``refimpl.gmm``,
``refimpl.scan`` and ``refimpl.gma``; their outputs, gradients, refusals and
bits with one thread or two are held to the reference in
tests/test_conformance.py.  Here: float32 arithmetic really in float32,
exact responsibilities on the spread means, and the scan's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from conformance_backends import DTYPES, mixture  # noqa: E402
from cpu import gmm as cpu_gmm  # noqa: E402
from cpu import scan as cpu_scan  # noqa: E402
from refimpl import gmm, scan  # noqa: E402
from refimpl.testing import TOL, exact_responsibilities, row_relative_error, spread_means_example  # noqa: E402


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


@pytest.mark.parametrize("path", ["token by token", "chunks and products"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, F, d_v", [(1, 1, 1), (2, 3, 1), (7, 3, 5), (130, 17, 9), (300, 64, 20)])
def test_the_causal_scan_agrees(n, F, d_v, dtype, path, monkeypatch):
    """Both forms of cpu.scan, whichever the size would pick: one chunk, part of one, and several with a short last one."""
    monkeypatch.setattr(cpu_scan, "CHUNK_WORK", 1 << 60 if path == "token by token" else -1)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q, n_k", [(1, 1), (7, 3), (1100, 2500), (2049, 1024)])
def test_the_bidirectional_write_and_read_by_blocks_agree(n_q, n_k, dtype):
    """cpu.scan's bidirectional form and its backward by blocks of BLOCK_ROWS rows (one, several, a short last one, of
    queries or keys) against the reference; the same bits with one thread or two."""
    from conformance_backends import _numba_threads

    rng = np.random.default_rng(n_q + n_k)
    phi_q, phi_k = rng.uniform(0, 1, size=(n_q, 32)).astype(dtype), rng.uniform(0, 1, size=(n_k, 32)).astype(dtype)
    v = rng.normal(size=(n_k, 3)).astype(dtype)
    want, want_cache = scan.scan_forward(phi_q, phi_k, v, False, 1e-6, 16)
    g = rng.normal(size=(n_q, 3)).astype(dtype)
    runs = []
    for threads in (1, 2):
        with _numba_threads(threads):
            out, cache = cpu_scan.scan_forward(phi_q, phi_k, v, False, 1e-6, 16)
            runs.append((out, cache.den, *cpu_scan.scan_backward(g, cache)))
    assert runs[0][0].dtype == dtype and isinstance(cache, scan.FeatureAttentionCache) and not cache.causal
    for one, two in zip(*runs, strict=True):
        assert one.dtype == dtype and np.array_equal(one, two)
    np.testing.assert_allclose(runs[0][0], want, **TOL[dtype])
    np.testing.assert_allclose(runs[0][1], want_cache.den, **TOL[dtype])
    ref = scan.scan_backward(g, want_cache)
    # the gradients are sums of terms of either sign: the tolerance is relative to the size of the terms
    scale = np.max(np.abs(g)) * max(1.0, np.max(np.abs(v))) * 32 / np.min(want_cache.den)
    for name, got in zip(ref._fields, runs[0][2:], strict=True):
        np.testing.assert_allclose(got, getattr(ref, name), rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale, err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_the_long_forms_allocate_their_results_and_no_other_array_of_n_rows(causal, monkeypatch):
    """The bidirectional and chunked forward normalise each block in a thread's work block: the call's peak is its
    two results, the work blocks and (causal) the chunks' states, not the [V, 1] and numerators of N rows each that
    it used to allocate (fresh pages, zeroed by the kernel, at every call)."""
    import tracemalloc

    monkeypatch.setattr(cpu_scan, "CHUNK_WORK", -1)
    rng = np.random.default_rng(11)
    n, F, d_v = 40_000, 8, 15
    phi_q, phi_k = rng.uniform(0, 1, size=(2, n, F))
    v = rng.normal(size=(n, d_v))
    cpu_scan.scan_forward(phi_q, phi_k, v, causal, 1e-6, 64)  # compiled before tracing
    tracemalloc.start()
    try:
        out, cache = cpu_scan.scan_forward(phi_q, phi_k, v, causal, 1e-6, 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    rows = cpu_scan.CHUNK if causal else cpu_scan.BLOCK_ROWS
    work = cpu_scan._thread_buffers(rows, v).nbytes + (cpu_scan._chunk_states(1, phi_k, v).nbytes if causal else 0)
    results = out.nbytes + cache.den.nbytes
    # one more array of N x (d_v + 1) would add 5.1 MB to the 4.8 MB of the results; 1 MiB for the rest (the call's
    # Python objects, the blocks' sum)
    assert results <= peak <= results + work + (1 << 20), (peak, results, work)
    np.testing.assert_allclose(out, scan.scan_forward(phi_q, phi_k, v, causal, 1e-6, 64)[0], **TOL[np.float64])


def test_prefix_contract_is_its_definition():
    rng = np.random.default_rng(5)
    b, a, w = rng.normal(size=(9, 3)), rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
    for offsets in ([0, 9], [0, 0, 3, 4, 4, 9]):  # one sequence, or packed ones (empty, of length 1): j in t's own
        for reverse, whole in ((False, False), (True, False), (False, True)):
            got = cpu_scan.prefix_contract(b, a, w, reverse=reverse, whole=whole, offsets=np.array(offsets, dtype=np.int64))
            for start, stop in zip(offsets[:-1], offsets[1:]):
                for t in range(start, stop):
                    js = range(start, stop) if whole else range(t, stop) if reverse else range(start, t + 1)
                    state = sum(np.outer(b[j], a[j]) for j in js)
                    np.testing.assert_allclose(got[t], state @ w[t], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, K, d", [(1, 1, 1), (5, 3, 2), (257, 16, 9), (600, 7, 33), (6000, 16, 9)])
def test_the_backward_through_the_responsibilities_agrees_both_ways(n, K, d, dtype, monkeypatch):
    """The loop from the differences and the matrix products around fused kernels, against the reference."""
    from cpu import gma as cpu_gma
    from refimpl import gma as ref_gma

    means, variances, weights = (a.astype(dtype) for a in mixture(K, d, seed=n))
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, d)).astype(dtype)
    gamma = gmm.responsibilities(x, means, variances, weights)
    grad = rng.normal(size=(n, K)).astype(dtype)
    want = ref_gma._responsibility_backward(x, gamma, grad, means, variances)
    for work in (1 << 60, -1):
        monkeypatch.setattr(cpu_gma, "GEMM_WORK", work)
        got = cpu_gma.responsibility_backward(x, gamma, grad, means, variances)
        for g, w in zip(got, want):
            assert g.dtype == dtype and g.shape == w.shape
            scale = max(1.0, float(np.max(np.abs(w)))) if w.size else 1.0
            np.testing.assert_allclose(g, w, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


def test_the_backward_by_products_gives_the_same_bits_with_one_thread_or_two(monkeypatch):
    """Many blocks of rows shared by the threads, each thread with its own work arrays: the same bits, and the
    reference's values."""
    from conformance_backends import _numba_threads
    from cpu import gma as cpu_gma
    from refimpl import gma as ref_gma

    monkeypatch.setattr(cpu_gma, "GEMM_WORK", -1)
    means, variances, weights = mixture(16, 9, seed=8)
    rng = np.random.default_rng(8)
    x = rng.normal(size=(20000, 9))
    gamma = gmm.responsibilities(x, means, variances, weights)
    grad = rng.normal(size=gamma.shape)
    runs = []
    for threads in (1, 2):
        with _numba_threads(threads):
            runs.append(cpu_gma.responsibility_backward(x, gamma, grad, means, variances))
    want = ref_gma._responsibility_backward(x, gamma, grad, means, variances)
    for one, two, w in zip(*runs, want, strict=True):
        assert np.array_equal(one, two)
        np.testing.assert_allclose(one, w, rtol=TOL[np.float64]["rtol"], atol=TOL[np.float64]["atol"] * max(1.0, np.max(np.abs(w))))


def test_the_large_paths_give_the_same_bits_with_one_thread_or_two(monkeypatch):
    """The chunked scan and the backward by matrix products (forced at a small size): one thread, two, serial builds."""
    from conformance_backends import _numba_threads, _problem
    from cpu import gma as cpu_gma

    monkeypatch.setattr(cpu_scan, "CHUNK_WORK", -1)
    monkeypatch.setattr(cpu_gma, "GEMM_WORK", -1)
    args = _problem((2,), True, 300, 5, 3, 4, np.float64, seed=9)
    runs = []
    for n in (1, 2, None):
        with _numba_threads(n):
            results = []
            for causal in (False, True):
                out, cache = cpu_gma.gma_forward(*args, causal=causal)
                results += [out, *cpu_gma.gma_backward(np.ones_like(out), cache)]
            runs.append(results)
    for one, two, serial in zip(*runs, strict=True):
        assert np.array_equal(one, two) and np.array_equal(one, serial)


@pytest.mark.parametrize("causal", [False, True])
def test_a_batch_equals_its_sequences_one_by_one(causal):
    """One call per head for a batch (cpu.gma's batched driver) against one call per sequence, to rounding."""
    from conformance_backends import _problem
    from cpu import gma as cpu_gma

    x_q, x_k, v, means, raw, logits = _problem((3, 2), True, 37, 6, 5, 4, np.float64, seed=11)
    out, cache = cpu_gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal)
    g = np.random.default_rng(12).normal(size=out.shape)
    grads = cpu_gma.gma_backward(g, cache)
    dmeans = np.zeros_like(means)
    for b in range(3):
        for h in range(2):
            o, c = cpu_gma.gma_forward(x_q[b, h], x_k[b, h], v[b, h], means[h], raw[h], logits[h], causal=causal)
            np.testing.assert_allclose(out[b, h], o, rtol=1e-13, atol=1e-15)
            one = cpu_gma.gma_backward(g[b, h], c)
            for f in ("x_q", "x_k", "v"):
                np.testing.assert_allclose(getattr(grads, f)[b, h], getattr(one, f), rtol=1e-12, atol=1e-14)
            dmeans[h] += one.means
    np.testing.assert_allclose(grads.means, dmeans, rtol=1e-12, atol=1e-13)


def test_a_packed_call_is_one_call_of_each_kernel_whatever_the_number_of_sequences(monkeypatch):
    """cpu.gma's packed kernel: the responsibilities one call per head and token array, the mixing one scan call
    (three in the backward), never the unpacked kernel per sequence; the loop's results, the same bits with one
    thread or two."""
    from conformance_backends import _numba_threads
    from cpu import gma as cpu_gma
    from cpu import _jit as cpu_jit
    from cpu import gmm as cpu_gmm_module
    from refimpl import varlen

    offsets = np.array([0, 0, 5, 6, 6, 8, 16, 16, 23])
    rng = np.random.default_rng(13)
    x_q, x_k, v = (rng.normal(size=(23, 2, n)) for n in (3, 3, 4))
    means, raw, logits = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5))
    calls = []
    monkeypatch.setattr(cpu_jit, "SERIAL_WORK", 0)  # the threaded builds, even at this size

    def counted(module, name):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(name), original(*a, **k))[1])

    counted(cpu_scan, "prefix_contract")
    counted(cpu_gmm_module, "posterior")
    counted(cpu_gma, "responsibility_backward")
    kernels = cpu_gma.gma_forward.backend.kernels
    for key in ("gma_forward", "packed gma_forward"):
        original = kernels[key]
        monkeypatch.setitem(kernels, key, lambda *a, _k=key, _f=original: (calls.append(_k), _f(*a))[1])
    packed = kernels["packed gma_forward"]
    for causal in (True, False):
        runs = []
        for threads in (1, 2):
            calls.clear()
            with _numba_threads(threads):
                out, cache = cpu_gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, cu_seqlens=offsets)
                assert sorted(calls) == ["packed gma_forward"] + ["posterior"] * 4 + ["prefix_contract"], calls
                calls.clear()
                grads = cpu_gma.gma_backward(np.ones_like(out), cache)
                assert sorted(calls) == ["prefix_contract"] * 3 + ["responsibility_backward"] * 4, calls
            runs.append([out, *grads])
        assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))
        monkeypatch.delitem(kernels, "packed gma_forward")  # the loop over the sequences, one unpacked call each
        calls.clear()
        out_loop, cache_loop = cpu_gma.gma_forward(x_q, x_k, v, means, raw, logits, causal=causal, cu_seqlens=offsets)
        assert isinstance(cache_loop, varlen.PackedCache) and calls.count("gma_forward") == 5
        np.testing.assert_allclose(out, out_loop, rtol=1e-13, atol=1e-15)
        for got, want in zip(grads, cpu_gma.gma_backward(np.ones_like(out), cache_loop), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
        monkeypatch.setitem(kernels, "packed gma_forward", packed)
