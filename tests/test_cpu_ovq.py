"""cpu.ovq against refimpl.ovq through its blocked BLAS products, and what is its own.

The default path (the loop nests, which every call below ``BLAS_WORK`` takes)
is held to refimpl.ovq in tests/test_conformance.py: outputs, states,
records, gradients, batches, streaming, refusals, thread counts.  Here the
same comparisons run through the BLAS path (forced), and the ties on both
paths; and packed calls in one kernel against cpu's own loop over the
sequences, bit for bit.
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


# ---------------------------------------------------------------------------
# Packed sequences (cu_seqlens): every (head, sequence) in one kernel call, the bits of cpu's own loop
# ---------------------------------------------------------------------------

PACKED = ("packed ovq_attention", "packed ovq_attention_forward")
# an empty sequence first, one of length 1, boundaries inside a chunk and on a chunk edge (C = 3), an empty one between
OFFSETS = [0, 0, 1, 4, 9, 9, 16]


def by_the_loop(call):
    """``call()`` with cpu's packed OVQ kernels set aside: the boundary's loop of one unpacked call per sequence."""
    kernels = cpu_ovq.ovq_attention.backend.kernels
    aside = {key: kernels.pop(key) for key in PACKED}
    try:
        return call()
    finally:
        kernels.update(aside)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the packed kernels called, in order."""
    calls = []
    for name in ("_packed_forward_kernel", "_packed_backward_kernel"):
        def counted(*args, kernel=getattr(cpu_ovq, name), name=name):
            calls.append(name)
            return kernel(*args)
        monkeypatch.setattr(cpu_ovq, name, counted)
    return calls


def assert_states_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.size, a.tokens_seen, a.dtype) == (b.size, b.tokens_seen, b.dtype)
        for f in ("keys", "values", "counts"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 3, "count_bias": False},
                                {"init": "random", "growth": "linear", "learning_rate": 0.3}], ids=["spread", "random-nobias", "random-rate"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("heads", [False, True], ids=["2d", "heads"])
def test_packed_calls_in_one_kernel_are_cpus_loop_bit_for_bit(kernel_calls, heads, dtype, kw):
    lead = (2,) if heads else ()
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(OFFSETS[-1],) + lead + (n,)).astype(dtype) for n in (3, 3, 2))
    options = dict(max_size=4, chunk_size=3, **kw)
    states = None
    if not heads:
        # some sequences continue streams of their own (two of them empty: their states come back as given)
        prior = [cpu_ovq.ovq_attention(*qkv(s, n, dtype=dtype), **options, return_state=True)[1] for s, n in ((1, 5), (2, 2))]
        # rows past its size hold something (never read): the rows a sequence never reaches come back as they were
        unused = np.arange(prior[1].max_size)[:, None] >= prior[1].size
        prior[1] = ovq.OVQState(np.where(unused, 0.5, prior[1].keys).astype(dtype), np.where(unused, -2.0, prior[1].values).astype(dtype),
                                prior[1].counts, prior[1].size, prior[1].tokens_seen)
        states = [prior[0], None, prior[1], prior[0], prior[1], None]
        out, got = cpu_ovq.ovq_attention(q, k, v, **options, state=states, return_state=True, cu_seqlens=OFFSETS)
        assert kernel_calls == ["_packed_forward_kernel"]
        want_out, want = by_the_loop(lambda: cpu_ovq.ovq_attention(q, k, v, **options, state=states, return_state=True, cu_seqlens=OFFSETS))
        assert out.dtype == dtype and np.array_equal(out, want_out)
        assert_states_equal(got, want)
        assert got[0] is states[0] and got[4] is states[4]
        assert np.array_equal(cpu_ovq.ovq_attention(q, k, v, **options, state=states, cu_seqlens=OFFSETS), out)
        kernel_calls.clear()
    out, cache = cpu_ovq.ovq_attention_forward(q, k, v, **options, state=states, cu_seqlens=OFFSETS)
    g = rng.normal(size=out.shape).astype(dtype)
    grads = cpu_ovq.ovq_attention_backward(g, cache)
    assert kernel_calls == ["_packed_forward_kernel", "_packed_backward_kernel"]
    assert isinstance(cache, cpu_ovq.OVQPackedCache) and isinstance(grads, ovq.OVQGrads)
    want_out, want_cache = by_the_loop(lambda: cpu_ovq.ovq_attention_forward(q, k, v, **options, state=states, cu_seqlens=OFFSETS))
    want = cpu_ovq.ovq_attention_backward(g, want_cache)
    assert out.dtype == dtype and np.array_equal(out, want_out)
    for a, b, x in zip(grads, want, (q, k, v)):
        assert a.dtype == dtype and a.shape == x.shape and np.array_equal(a, b)
    if heads:
        assert cache.states is None
    else:
        # the state after each sequence, as ovq_attention returns it (and as the loop's caches hold it)
        assert_states_equal(cache.states, got)
        assert all(c is None or (c.state is not None and np.array_equal(c.state.keys, s.keys))
                   for c, s in zip(want_cache.caches, cache.states))
    assert kernel_calls == ["_packed_forward_kernel", "_packed_backward_kernel"]


def test_packed_grad_out_is_checked_as_by_the_loop():
    q, k, v = qkv(3, 9)
    offsets = [0, 4, 9]
    _, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=3, chunk_size=2, cu_seqlens=offsets)
    _, loop_cache = by_the_loop(lambda: cpu_ovq.ovq_attention_forward(q, k, v, max_size=3, chunk_size=2, cu_seqlens=offsets))
    for bad in (np.ones((9, 3)), np.full((9, 2), np.nan), np.ones((1, 9, 2)), np.ones((9, 1, 2))):
        with pytest.raises((TypeError, ValueError)) as native:
            cpu_ovq.ovq_attention_backward(bad, cache)
        with pytest.raises(type(native.value)) as loop:
            cpu_ovq.ovq_attention_backward(bad, loop_cache)
        assert str(native.value) == str(loop.value)


def _packed_problem(N=12, dtype=np.float64):
    return qkv(9, N, dtype=dtype), [0, 5, N]


def test_packed_calls_the_one_kernel_cannot_match_are_left_to_the_loop(kernel_calls, monkeypatch):
    (q, k, v), offsets = _packed_problem(dtype=np.float32)
    # a float64 state makes its sequence float64 in the loop
    state = cpu_ovq.ovq_attention(*qkv(1, 4), max_size=4, chunk_size=3, return_state=True)[1]
    out, got = cpu_ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, state=[None, state], return_state=True, cu_seqlens=offsets)
    assert kernel_calls == [] and got[1].dtype == np.float64
    # a sequence long enough for the BLAS path
    monkeypatch.setattr(cpu_ovq, "BLAS_WORK", 0)
    _, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=4, chunk_size=3, cu_seqlens=offsets)
    assert kernel_calls == [] and not isinstance(cache, cpu_ovq.OVQPackedCache)
    # with two heads the loop's calls are batches, which never take it
    q2, k2, v2 = (np.stack([x, x], axis=1) for x in (q, k, v))
    _, cache = cpu_ovq.ovq_attention_forward(q2, k2, v2, max_size=4, chunk_size=3, cu_seqlens=offsets)
    assert kernel_calls == ["_packed_forward_kernel"] and isinstance(cache, cpu_ovq.OVQPackedCache)


def refusals(call):
    """The exception a packed call raises with cpu's packed kernels, and the loop's."""
    with pytest.raises(ValueError) as native:
        call()
    with pytest.raises(ValueError) as loop:
        by_the_loop(call)
    return str(native.value), str(loop.value)


def test_packed_refusals_found_per_sequence_are_the_loops(kernel_calls):
    (q, k, v), offsets = _packed_problem()
    # logits that overflow in the second sequence only (its state's keys are huge): computed, then refused as the loop
    # refuses them
    huge = ovq.OVQState(np.full((4, 3), 1e308), np.zeros((4, 2)), [2, 1, 0, 0], 2, 3)
    call = lambda: cpu_ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, state=[None, huge], cu_seqlens=offsets)  # noqa: E731
    native, loop = refusals(call)
    assert native == loop and "overflow" in native and kernel_calls == ["_packed_forward_kernel"]
    kernel_calls.clear()
    # a state that lets a chunk of 3 tokens seed what growth asks for, but not its own sequence's single token
    state = ovq.OVQState(np.eye(4, 3), np.zeros((4, 2)), [2, 1, 0, 0], 2, 3)
    (q, k, v), offsets = _packed_problem(N=6)
    call = lambda: cpu_ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, growth="linear", state=[None, state],  # noqa: E731
                                         cu_seqlens=[0, 5, 6])
    native, loop = refusals(call)
    assert native == loop and "too small for growth" in native and kernel_calls == []
