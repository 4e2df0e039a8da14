"""cpu.ovq against refimpl.ovq through its blocked BLAS products, and what is its own.

The default path (the loop nests, which every call below ``BLAS_WORK`` takes)
is held to refimpl.ovq in tests/test_conformance.py: outputs, states,
records, gradients, batches, streaming, refusals, thread counts.  Here the
same comparisons run through the BLAS path (forced), and the ties on both
paths.
"""

import numba
import numpy as np
import pytest

from cpu import ovq as cpu_ovq
from refimpl import ovq

TOL64 = dict(rtol=1e-12, atol=1e-13)
TOL32 = dict(rtol=1e-5, atol=1e-6)


def qkv(seed, N, d=3, d_v=2, dtype=np.float64, lead=()):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=lead + (N, n)).astype(dtype) for n in (d, d, d_v)]


@pytest.fixture(params=["loops", "blas"])
def path(request, monkeypatch):
    """Run a 2-D call through the loop nests or through the blocked BLAS products."""
    monkeypatch.setattr(cpu_ovq, "BLAS_WORK", 0 if request.param == "blas" else 1 << 62)
    return request.param


@pytest.fixture
def blas(monkeypatch):
    """Run a 2-D call through the blocked BLAS products, whatever its size."""
    monkeypatch.setattr(cpu_ovq, "BLAS_WORK", 0)


def assert_state_close(state, ref, tol):
    assert isinstance(state, ovq.OVQState)
    assert (state.size, state.tokens_seen, state.dtype) == (ref.size, ref.tokens_seen, ref.dtype)
    assert np.array_equal(state.counts, ref.counts)
    np.testing.assert_allclose(state.keys, ref.keys, **tol)
    np.testing.assert_allclose(state.values, ref.values, **tol)


def assert_records_equal(records, ref_records):
    assert len(records) == len(ref_records)
    for rec, ref in zip(records, ref_records):
        assert (rec.start, rec.stop, rec.n) == (ref.start, ref.stop, ref.n)
        for f in ("rows", "seeded", "seeds", "counts_mid", "added"):
            assert np.array_equal(getattr(rec, f), getattr(ref, f)), f


# (N, chunk_size, max_size, d, options): N not a multiple of C, N < C, N = 1, n_max = 1, n_max reached and not
CASES = [
    (9, 3, 5, 3, {}),
    (5, 1, 4, 2, {"growth": "linear"}),
    (11, 5, 6, 4, {"init": "random", "seed": 0}),
    (23, 4, 6, 3, {"init": "random", "seed": 7, "growth": "linear"}),
    (7, 9, 4, 3, {"count_bias": False}),
    (17, 3, 5, 2, {"learning_rate": 0.3}),
    (19, 5, 5, 3, {"learning_rate": 1.0, "init": "random", "seed": 3, "growth": "linear"}),
    (1, 3, 3, 3, {}),
    (13, 3, 1, 3, {"beta": 4.5}),
    (70, 16, 8, 5, {"beta": 2.0, "growth": "linear"}),
]
IDS = [f"N{c[0]}-C{c[1]}-n{c[2]}-" + (",".join(f"{k}={v}" for k, v in c[4].items()) or "default") for c in CASES]


@pytest.mark.parametrize("N, C, n_max, d, kw", CASES, ids=IDS)
def test_forward_backward_match_refimpl_float64(blas, N, C, n_max, d, kw):
    q, k, v = qkv(N * 7 + C, N, d=d)
    out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
    ref_out, ref_cache = ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
    assert isinstance(cache, ovq.OVQCache) and out.dtype == np.float64 and out.shape == (N, 2)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(cache.state, ref_cache.state, TOL64)
    assert_records_equal(cache.records, ref_cache.records)
    g = np.random.default_rng(N).normal(size=out.shape)
    grads = cpu_ovq.ovq_attention_backward(g, cache)
    ref = ovq.ovq_attention_backward(g, ref_cache)
    assert isinstance(grads, ovq.OVQGrads)
    for a, b in zip(grads, ref):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, **TOL64)
    # refimpl's backward reads the packed records as its own
    for a, b in zip(ovq.ovq_attention_backward(g, cache), ref):
        np.testing.assert_allclose(a, b, **TOL64)


@pytest.mark.parametrize("N, C, n_max, d, kw", CASES[:7], ids=IDS[:7])
def test_ovq_attention_and_state_match_refimpl(blas, N, C, n_max, d, kw):
    q, k, v = qkv(N + 100 * C, N, d=d)
    out, state = cpu_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)
    np.testing.assert_allclose(cpu_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, **kw), ref_out, **TOL64)


def test_float32_matches_refimpl_with_clear_margins(blas):
    # keys drawn around 4 well separated directions: every assignment and seed has a wide margin
    rng = np.random.default_rng(5)
    N, d = 45, 4
    centres = np.eye(d)
    k = (centres[rng.integers(0, d, N)] + 0.05 * rng.normal(size=(N, d))).astype(np.float32)
    q = rng.normal(size=(N, d)).astype(np.float32)
    v = rng.normal(size=(N, 3)).astype(np.float32)
    for kw in ({}, {"learning_rate": 0.5}, {"count_bias": False, "growth": "linear"}):
        out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=6, chunk_size=8, **kw)
        ref_out, ref_cache = ovq.ovq_attention_forward(q, k, v, max_size=6, chunk_size=8, **kw)
        assert out.dtype == np.float32 and cache.state.dtype == np.float32
        np.testing.assert_allclose(out, ref_out, **TOL32)
        assert_state_close(cache.state, ref_cache.state, TOL32)
        assert_records_equal(cache.records, ref_cache.records)
        g = rng.normal(size=out.shape).astype(np.float32)
        for a, b in zip(cpu_ovq.ovq_attention_backward(g, cache), ovq.ovq_attention_backward(g, ref_cache)):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b, **TOL32)


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 2}, {"growth": "linear", "learning_rate": 0.4}])
def test_streaming_in_pieces(blas, kw):
    q, k, v = qkv(11, 31, d=3)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=7, chunk_size=4, return_state=True, **kw)
    out1, s1 = cpu_ovq.ovq_attention(q[:12], k[:12], v[:12], max_size=7, chunk_size=4, return_state=True, **kw)
    out2, s2 = cpu_ovq.ovq_attention(q[12:], k[12:], v[12:], max_size=7, chunk_size=4, state=s1, return_state=True, **kw)
    np.testing.assert_allclose(np.concatenate([out1, out2]), ref_out, **TOL64)
    assert_state_close(s2, ref_state, TOL64)
    # continuing from refimpl's own state, forward and backward
    _, r1 = ovq.ovq_attention(q[:12], k[:12], v[:12], max_size=7, chunk_size=4, return_state=True, **kw)
    out, cache = cpu_ovq.ovq_attention_forward(q[12:], k[12:], v[12:], max_size=7, chunk_size=4, state=r1, **kw)
    ref2, ref_cache = ovq.ovq_attention_forward(q[12:], k[12:], v[12:], max_size=7, chunk_size=4, state=r1, **kw)
    np.testing.assert_allclose(out, ref2, **TOL64)
    assert_state_close(cache.state, ref_cache.state, TOL64)
    g = np.ones_like(out)
    for a, b in zip(cpu_ovq.ovq_attention_backward(g, cache), ovq.ovq_attention_backward(g, ref_cache)):
        np.testing.assert_allclose(a, b, **TOL64)


def test_same_bits_for_one_and_two_threads(blas):
    """One sequence (a batch never takes the BLAS path)."""
    q, k, v = qkv(21, 150, d=6, d_v=4)
    g = np.random.default_rng(2).normal(size=v.shape)
    saved = numba.get_num_threads()
    results = []
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=20, chunk_size=40)
            results.append((out, *cpu_ovq.ovq_attention_backward(g, cache)))
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(*results):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("batched", [False, True])
def test_ties_go_to_the_lowest_index(path, batched):
    # three directions repeated: equal scores seed duplicates (stable order), and later keys meet identical centroids
    rng = np.random.default_rng(4)
    base = rng.normal(size=(3, 4))
    k = base[rng.integers(0, 3, 40)]
    q, v = rng.normal(size=(40, 4)), rng.normal(size=(40, 2))
    ref_out, ref_cache = ovq.ovq_attention_forward(q, k, v, max_size=9, chunk_size=6, growth="linear")
    assert any(len(set(map(tuple, np.round(rec.dict_keys, 12)))) < rec.n for rec in ref_cache.records)
    if batched:
        out, cache = cpu_ovq.ovq_attention_forward(q[None], k[None], v[None], max_size=9, chunk_size=6, growth="linear")
        out, rows = out[0], cache.records.rows[0]
        assert np.array_equal(rows, np.concatenate([rec.rows for rec in ref_cache.records]))
    else:
        out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=9, chunk_size=6, growth="linear")
        assert_records_equal(cache.records, ref_cache.records)
    np.testing.assert_allclose(out, ref_out, **TOL64)
