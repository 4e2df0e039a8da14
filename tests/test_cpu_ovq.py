"""cpu.ovq against refimpl.ovq: outputs, states, gradients, both product paths, batches, errors, thread counts."""

import warnings

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
def test_forward_backward_match_refimpl_float64(path, N, C, n_max, d, kw):
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
def test_ovq_attention_and_state_match_refimpl(path, N, C, n_max, d, kw):
    q, k, v = qkv(N + 100 * C, N, d=d)
    out, state = cpu_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)
    np.testing.assert_allclose(cpu_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, **kw), ref_out, **TOL64)


def test_float32_matches_refimpl_with_clear_margins(path):
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
def test_streaming_in_pieces(path, kw):
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


def test_float64_state_makes_float32_inputs_float64():
    q, k, v = qkv(3, 10, d=3)
    _, state = ovq.ovq_attention(q, k, v, max_size=5, chunk_size=5, return_state=True)
    q2, k2, v2 = (x.astype(np.float32) for x in qkv(4, 7, d=3))
    out, st = cpu_ovq.ovq_attention(q2, k2, v2, max_size=5, chunk_size=5, state=state, return_state=True)
    ref, ref_st = ovq.ovq_attention(q2, k2, v2, max_size=5, chunk_size=5, state=state, return_state=True)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref, **TOL64)
    assert_state_close(st, ref_st, TOL64)


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 1, "learning_rate": 0.2}, {"count_bias": False}])
def test_batch_equals_refimpl_per_sequence(kw):
    lead, N, C, n_max = (2, 3), 37, 8, 6
    q, k, v = qkv(9, N, d=4, d_v=3, lead=lead)
    out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **kw)
    assert out.shape == lead + (N, 3) and cache.state is None
    g = np.random.default_rng(1).normal(size=out.shape)
    grads = cpu_ovq.ovq_attention_backward(g, cache)
    for i in np.ndindex(*lead):
        ref_out, ref_cache = ovq.ovq_attention_forward(q[i], k[i], v[i], max_size=n_max, chunk_size=C, **kw)
        np.testing.assert_allclose(out[i], ref_out, **TOL64)
        ref = ovq.ovq_attention_backward(g[i], ref_cache)
        for a, b in zip(grads, ref):
            assert a.shape == lead + b.shape
            np.testing.assert_allclose(a[i], b, **TOL64)


def test_model_mixer_shapes_batched_equal_per_sequence_float32():
    # the model's sizes: chunk 16, 16 centroids, heads of width 16, a length that leaves a chunk of 1
    rng = np.random.default_rng(0)
    B, H, N, dh = 3, 2, 33, 16
    centres = np.linalg.qr(rng.normal(size=(dh, dh)))[0][:6]
    k = (centres[rng.integers(0, 6, (B, H, N))] + 0.02 * rng.normal(size=(B, H, N, dh))).astype(np.float32)
    q = rng.normal(size=(B, H, N, dh)).astype(np.float32)
    v = rng.normal(size=(B, H, N, dh)).astype(np.float32)
    out, cache = cpu_ovq.ovq_attention_forward(q, k, v, max_size=16, chunk_size=16)
    g = rng.normal(size=out.shape).astype(np.float32)
    grads = cpu_ovq.ovq_attention_backward(g, cache)
    for i in np.ndindex(B, H):
        ref_out, ref_cache = ovq.ovq_attention_forward(q[i], k[i], v[i], max_size=16, chunk_size=16)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out[i], ref_out, **TOL32)
        for a, b in zip(grads, ovq.ovq_attention_backward(g[i], ref_cache)):
            np.testing.assert_allclose(a[i], b, **TOL32)


@pytest.mark.parametrize("batched", [False, True])
def test_same_bits_for_one_and_two_threads(path, batched):
    lead = (3,) if batched else ()
    q, k, v = qkv(21, 150, d=6, d_v=4, lead=lead)
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


@pytest.mark.parametrize("dtype, tol", [(np.float64, TOL64), (np.float32, TOL32)])
@pytest.mark.parametrize("N, C", [(17, 4), (5, 9), (1, 1)])
def test_vq_matches_refimpl(dtype, tol, N, C):
    q, k, v = qkv(N + C, N, d=3, dtype=dtype)
    codebook = np.random.default_rng(0).normal(size=(5, 3)).astype(dtype)
    out = cpu_ovq.vq_attention(q, k, v, codebook, chunk_size=C)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, ovq.vq_attention(q, k, v, codebook, chunk_size=C), **tol)
    np.testing.assert_allclose(cpu_ovq.vq_attention(q, k, v, codebook, chunk_size=C, beta=0.7),
                               ovq.vq_attention(q, k, v, codebook, chunk_size=C, beta=0.7), **tol)


def _same_error(cpu_call, ref_call):
    with pytest.raises(Exception) as ref_err, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # refimpl's overflowing products warn before the refusal
        ref_call()
    with pytest.raises(type(ref_err.value)) as err:
        cpu_call()
    assert str(err.value) == str(ref_err.value)


def test_errors_word_for_word():
    q, k, v = qkv(0, 6)
    bad_q = q.copy()
    bad_q[2, 1] = np.nan
    good = dict(max_size=4, chunk_size=3)
    _, state = ovq.ovq_attention(q, k, v, return_state=True, **good)
    # a state whose keys make beta q.D_k overflow
    huge = ovq.OVQState(np.full((4, 3), 1e308), np.zeros((4, 2)), [1, 1, 1, 0], 3, 3)
    cases = [
        ((bad_q, k, v), good),
        ((q, k[:5], v), good),
        ((q, k, v[:, :0]), good),
        ((q.astype(int), k, v), good),
        ((q, k, v), dict(good, max_size=0)),
        ((q, k, v), dict(good, chunk_size=1.5)),
        ((q, k, v), dict(good, growth="log")),
        ((q, k, v), dict(good, init="kmeans++")),
        ((q, k, v), dict(good, learning_rate=2.0)),
        ((q, k, v), dict(good, beta=-1.0)),
        ((q, k, v), dict(good, seed=-3)),
        ((q, k, v), dict(good, max_size=5, state=state)),
        ((q[:, :2], k[:, :2], v), dict(good, state=state)),
        ((q, k, v / np.max(np.abs(v)) * 1e308), good),
        ((q, k, v), dict(good, beta=10.0, state=huge)),
        ((q, k, v), dict(good, return_state="yes")),
    ]
    for args, kw in cases:
        _same_error(lambda: cpu_ovq.ovq_attention(*args, **kw), lambda: ovq.ovq_attention(*args, **kw))
        if "return_state" not in kw:
            _same_error(lambda: cpu_ovq.ovq_attention_forward(*args, **kw),
                        lambda: ovq.ovq_attention_forward(*args, **kw))
    # a batch raises what refimpl's loop over its sequences raises first
    qb, kb, vb = qkv(1, 6, lead=(2,))
    qb[1, 4, 0] = np.inf
    _same_error(lambda: cpu_ovq.ovq_attention_forward(qb, kb, vb, **good), lambda: ovq.ovq_attention_forward(qb[1], kb[1], vb[1], **good))
    vb[0, 3] = 1e308
    _same_error(lambda: cpu_ovq.ovq_attention_forward(kb, kb, vb, **good), lambda: ovq.ovq_attention_forward(kb[0], kb[0], vb[0], **good))
    _, cache = cpu_ovq.ovq_attention_forward(q, k, v, **good)
    _, ref_cache = ovq.ovq_attention_forward(q, k, v, **good)
    for g, c, rc in ((np.ones((5, 2)), cache, ref_cache), (np.ones((6, 2)), "cache", "cache"), (np.full((6, 2), np.nan), cache, ref_cache)):
        _same_error(lambda: cpu_ovq.ovq_attention_backward(g, c), lambda: ovq.ovq_attention_backward(g, rc))
    codebook = np.eye(3)
    for args, kw in (((q, k, v, codebook[:, :2]), dict(chunk_size=2)), ((q, k, v, codebook), dict(chunk_size=0)),
                     ((q, k, v, codebook * 1e308), dict(chunk_size=2, beta=10.0)), ((bad_q, k, v, codebook), dict(chunk_size=2))):
        _same_error(lambda: cpu_ovq.vq_attention(*args, **kw), lambda: ovq.vq_attention(*args, **kw))


def test_leading_dimensions_refuse_a_state_and_mismatched_shapes():
    q, k, v = qkv(0, 6, lead=(2,))
    _, state = ovq.ovq_attention(q[0], k[0], v[0], max_size=4, chunk_size=3, return_state=True)
    with pytest.raises(ValueError, match="state: a stream continues one sequence"):
        cpu_ovq.ovq_attention_forward(q, k, v, max_size=4, chunk_size=3, state=state)
    with pytest.raises(ValueError, match=r"k: expected shape \(\.\.\., N, d\) with the leading dimensions \(2,\)"):
        cpu_ovq.ovq_attention_forward(q, k[:1], v, max_size=4, chunk_size=3)
    # ovq_attention itself is 2-D, like refimpl's
    _same_error(lambda: cpu_ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True),
                lambda: ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True))


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
