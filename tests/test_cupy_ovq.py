"""gpu.cupy_kernels.ovq: OVQ and VQ attention with CuPy against refimpl.ovq.

On the host, the generic code runs with ``xp = numpy`` (each kernel replaced
by its NumPy twin) and must equal refimpl bit for bit: the same arithmetic in
the same order (its refusals are held to refimpl's in tests/test_conformance.py,
backend ``cupy_host``).  On a GPU (skipped, with the reason, only where there is
no GPU; failing where there is one that CuPy cannot use) the kernels are
compared with their twins and the public functions with refimpl.
"""

import inspect

import numpy as np
import pytest

import gpu.cupy_kernels as ck
from gpu.cupy_kernels import on_host
from gpu.cupy_kernels import _backend
from gpu.cupy_kernels import ovq
from refimpl import ovq as ref_ovq

OK, WHY = _backend.probe()
DECISION, DECISION_WHY = _backend.device_test_decision()
# skipped only without a GPU; on a GPU that CuPy cannot use, the device tests fail (see _cupy)
device = pytest.mark.skipif(DECISION == "skip", reason=DECISION_WHY)
STATE_FIELDS = ("keys", "values", "counts", "size", "tokens_seen")


def _inputs(rng, N, d=3, dv=2, dtype=np.float64):
    return tuple(rng.normal(size=(N, w)).astype(dtype) for w in (d, d, dv))


def _same_state(ours, ref):
    assert type(ours) is ref_ovq.OVQState
    for f in STATE_FIELDS:
        a, b = getattr(ours, f), getattr(ref, f)
        assert type(a) is type(b), f
        np.testing.assert_array_equal(a, b, err_msg=f)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype, f


def _same_error(f, g, exc=ValueError):
    with pytest.raises(exc) as ours:
        f()
    with pytest.raises(exc) as theirs:
        g()
    assert str(ours.value) == str(theirs.value)


# ---------------------------------------------------------------------------
# Host: the generic code with NumPy equals refimpl bit for bit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("growth", ["plateau", "linear"])
@pytest.mark.parametrize("init, seed", [("spread", 0), ("random", 0), ("random", 1), ("random", 7)])
def test_ovq_matches_refimpl_bit_for_bit(init, seed, growth, dtype):
    rng = np.random.default_rng(seed + 10 * (growth == "linear"))
    N = 11
    q, k, v = _inputs(rng, N, dtype=dtype)
    for chunk in (1, 3, N + 5):
        for count_bias in (True, False):
            for lr in (None, 0.3, 1.0):
                kw = dict(max_size=5, chunk_size=chunk, growth=growth, init=init, seed=seed, count_bias=count_bias, learning_rate=lr)
                out, state = on_host.ovq_attention(q, k, v, return_state=True, **kw)
                ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, return_state=True, **kw)
                assert type(out) is np.ndarray and out.dtype == ref_out.dtype
                np.testing.assert_array_equal(out, ref_out, err_msg=str(kw))
                _same_state(state, ref_state)
                np.testing.assert_array_equal(on_host.ovq_attention(q, k, v, **kw), ref_out)


def test_ovq_default_options_and_a_larger_dictionary():
    # max_size 12 after 40 tokens: the plateau and the linear growth both seed several rows per chunk
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 40, d=4, dv=3)
    for kw in (dict(), dict(growth="linear"), dict(init="random", seed=5), dict(beta=0.7)):
        out, state = on_host.ovq_attention(q, k, v, max_size=12, chunk_size=6, return_state=True, **kw)
        ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, max_size=12, chunk_size=6, return_state=True, **kw)
        np.testing.assert_array_equal(out, ref_out)
        _same_state(state, ref_state)
    assert state.size > 6


def test_ovq_random_init_draws_refimpl_seeds():
    # the seeds differ with the seed, so the draw matters; ours follows refimpl's generator
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 30)
    kw = dict(max_size=8, chunk_size=5, init="random", growth="linear")
    states = []
    for seed in (0, 1):
        _, state = on_host.ovq_attention(q, k, v, seed=seed, return_state=True, **kw)
        _same_state(state, ref_ovq.ovq_attention(q, k, v, seed=seed, return_state=True, **kw)[1])
        states.append(state)
    assert not np.array_equal(states[0].keys, states[1].keys)


@pytest.mark.parametrize("lr", [None, 0.5])
def test_ovq_streams_through_a_state(lr):
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 14)
    kw = dict(max_size=6, chunk_size=3, learning_rate=lr)
    whole, whole_state = on_host.ovq_attention(q, k, v, return_state=True, **kw)
    state, ref_state, outs = None, None, []
    for a, b in ((0, 6), (6, 9), (9, 14)):  # pieces of multiples of the chunk, the last shorter
        out, state = on_host.ovq_attention(q[a:b], k[a:b], v[a:b], state=state, return_state=True, **kw)
        ref_out, ref_state = ref_ovq.ovq_attention(q[a:b], k[a:b], v[a:b], state=ref_state, return_state=True, **kw)
        np.testing.assert_array_equal(out, ref_out)
        _same_state(state, ref_state)
        outs.append(out)
    np.testing.assert_array_equal(np.concatenate(outs), whole)
    _same_state(state, whole_state)


def test_ovq_float64_state_makes_float64_and_state_is_not_changed():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 9, dtype=np.float32)
    _, state = ref_ovq.ovq_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), max_size=4, chunk_size=3, return_state=True)
    before = state.keys.copy()
    out, new = on_host.ovq_attention(q, k, v, max_size=4, chunk_size=3, state=state, return_state=True)
    ref_out, ref_new = ref_ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, state=state, return_state=True)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, ref_out)
    _same_state(new, ref_new)
    np.testing.assert_array_equal(state.keys, before)
    assert new is not state


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("N, S, chunk", [(1, 1, 4), (7, 3, 1), (10, 4, 3), (9, 5, 20)])
def test_vq_matches_refimpl_bit_for_bit(N, S, chunk, dtype):
    rng = np.random.default_rng(N * S + chunk)
    q, k, v = _inputs(rng, N, dtype=dtype)
    codebook = rng.normal(size=(S, 3)).astype(dtype)
    for beta in (None, 2.5):
        out = on_host.vq_attention(q, k, v, codebook, chunk_size=chunk, beta=beta)
        ref = ref_ovq.vq_attention(q, k, v, codebook, chunk_size=chunk, beta=beta)
        assert type(out) is np.ndarray and out.dtype == ref.dtype
        np.testing.assert_array_equal(out, ref)


def test_signatures_are_refimpls():
    assert inspect.signature(ck.ovq_attention) == inspect.signature(ref_ovq.ovq_attention)
    assert inspect.signature(on_host.ovq_attention) == inspect.signature(ref_ovq.ovq_attention)
    assert list(inspect.signature(ck.vq_attention).parameters) == list(inspect.signature(ref_ovq.vq_attention).parameters)
    assert "ovq_attention" in ck.__all__ and "vq_attention" in ck.__all__


def test_twins_are_the_loops_they_stand_for():
    rng = np.random.default_rng(8)
    # the read-out twin: beta t (+ bias on the centroids), causal inside the chunk, row maxima, softmax
    L, n, beta = 4, 3, 1.7
    t = rng.normal(size=(L, n + L))
    bias = np.log(np.array([1.0, 4.0, 2.0]))
    row_max = np.empty(L)
    P = ovq.readout_rows(np, t.copy(), bias, beta, n, row_max)
    for a in range(L):
        logits = np.concatenate([beta * t[a, :n] + bias, beta * t[a, n:n + a + 1]])
        expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(P[a, :n + a + 1], expected, rtol=1e-14, atol=0)
        assert np.all(P[a, n + a + 1:] == 0)
        assert row_max[a] == logits.max()
    # the update twin: running mean and constant rate, member by member in token order
    D, x = rng.normal(size=(3, 2)), rng.normal(size=(5, 2))
    assign, counts = np.array([2, -1, 0, 2, 2]), np.array([1, 4, 2])
    mean = D.copy()
    new_counts = ovq.update_rows(np, mean, x, assign, counts, None)
    np.testing.assert_array_equal(new_counts, [2, 4, 5])
    np.testing.assert_allclose(mean[0], (D[0] + x[2]) / 2, rtol=1e-15)
    np.testing.assert_allclose(mean[2], (2 * D[2] + x[0] + x[3] + x[4]) / 5, rtol=1e-15)
    np.testing.assert_array_equal(mean[1], D[1])
    ema = D.copy()
    np.testing.assert_array_equal(ovq.update_rows(np, ema, x, assign, counts, 0.25), [2, 4, 5])
    expected = D[2]
    for i in (0, 3, 4):
        expected = expected + 0.25 * (x[i] - expected)
    np.testing.assert_array_equal(ema[2], expected)


def test_numpy_inputs_without_a_device_raise_naming_the_backend():
    if OK:
        pytest.skip(f"a CUDA device is usable here ({WHY}): the error without one cannot be shown")
    x = np.zeros((3, 2))
    with pytest.raises(RuntimeError, match="GPU backend 'cupy' is not available: "):
        ck.ovq_attention(x, x, x, max_size=2, chunk_size=2)
    with pytest.raises(RuntimeError, match="GPU backend 'cupy' is not available: "):
        ck.vq_attention(x, x, x, x, chunk_size=2)


# ---------------------------------------------------------------------------
# Device: the kernels against their twins, the public functions against refimpl
# ---------------------------------------------------------------------------

RTOL = {np.float64: 1e-10, np.float32: 1e-5}


def _cupy():
    if DECISION == "fail":
        pytest.fail(DECISION_WHY)
    import cupy

    return cupy


def _close(ours, ref, dtype):
    cupy = _cupy()
    assert isinstance(ours, cupy.ndarray)
    ours = cupy.asnumpy(ours)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_allclose(ours, ref, rtol=RTOL[dtype], atol=RTOL[dtype])


@device
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("eta", [None, 0.3, 1.0])
def test_device_chunk_kernels_match_their_twins(eta, dtype):
    # the three launches of every chunk and the unit rows against the NumPy twins: the state bit for bit where the
    # arithmetic is exact (the counts), the rest to rounding (the dot products are summed in another order)
    cupy = _cupy()
    rng = np.random.default_rng(20)
    q, k, v = _inputs(rng, 97, d=5, dv=3, dtype=dtype)
    p = ref_ovq.check_ovq_arguments(q, k, v, 9, 10, None, "linear", "spread", True, eta, 0, None).params
    out, (Dk, Dv, counts, n, t), row_max = ovq._ovq_run_xp(np, q, k, v, p, None, dtype)
    d_out, (d_Dk, d_Dv, d_counts, d_n, d_t), d_max = ovq._ovq_run_xp(cupy, *(cupy.asarray(a) for a in (q, k, v)), p, None, dtype)
    assert (d_n, d_t) == (n, t)
    np.testing.assert_array_equal(cupy.asnumpy(d_counts), counts)
    for ours, ref in ((d_out, out), (d_Dk, Dk), (d_Dv, Dv), (d_max, row_max)):
        _close(ours, ref, dtype)


@device
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kw", [
    dict(max_size=6, chunk_size=4),
    dict(max_size=6, chunk_size=1, growth="linear", learning_rate=0.3),
    dict(max_size=80, chunk_size=40, init="random", seed=3, count_bias=False),
    dict(max_size=9, chunk_size=500, learning_rate=1.0),
])
def test_device_ovq_matches_refimpl(kw, dtype):
    cupy = _cupy()
    rng = np.random.default_rng(kw["chunk_size"])
    q, k, v = _inputs(rng, 210, d=8, dv=5, dtype=dtype)
    ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, return_state=True, **kw)
    out, state = ck.ovq_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), return_state=True, **kw)
    _close(out, ref_out, dtype)
    np.testing.assert_array_equal(state.counts, ref_state.counts)  # the same assignments and seeds
    assert (state.size, state.tokens_seen) == (ref_state.size, ref_state.tokens_seen)
    np.testing.assert_allclose(state.keys, ref_state.keys, rtol=RTOL[dtype], atol=RTOL[dtype])
    np.testing.assert_allclose(state.values, ref_state.values, rtol=RTOL[dtype], atol=RTOL[dtype])
    # NumPy in, NumPy out; deterministic
    host = ck.ovq_attention(q, k, v, **kw)
    assert type(host) is np.ndarray
    np.testing.assert_array_equal(host, cupy.asnumpy(out))


def _tied_keys(rng):
    # keys along three axes: unit rows, running means and dot products are exact (0 or 1) on any hardware, so
    # the assignments (duplicated centroids) and the spread scores tie exactly and the lowest index must win
    return np.eye(4)[rng.integers(0, 3, size=24)], rng.normal(size=(24, 4)), rng.normal(size=(24, 3))


def test_tied_keys_tie_and_match_refimpl():
    k, q, v = _tied_keys(np.random.default_rng(11))
    kw = dict(max_size=7, chunk_size=4)
    out, state = on_host.ovq_attention(q, k, v, return_state=True, **kw)
    ref_out, ref_state = ref_ovq.ovq_attention(q, k, v, return_state=True, **kw)
    np.testing.assert_array_equal(out, ref_out)
    _same_state(state, ref_state)
    assert len(np.unique(state.keys[:state.size], axis=0)) < state.size  # duplicated centroids: the ties are real


@device
def test_device_ovq_streams_and_ties_go_to_the_lowest_index():
    cupy = _cupy()
    k, q, v = _tied_keys(np.random.default_rng(11))
    kw = dict(max_size=7, chunk_size=4)
    state, ref_state = None, None
    for a in range(0, 24, 8):
        sl = slice(a, a + 8)
        out, state = ck.ovq_attention(cupy.asarray(q[sl]), cupy.asarray(k[sl]), cupy.asarray(v[sl]), state=state, return_state=True, **kw)
        ref_out, ref_state = ref_ovq.ovq_attention(q[sl], k[sl], v[sl], state=ref_state, return_state=True, **kw)
        _close(out, ref_out, np.float64)
        np.testing.assert_array_equal(state.counts, ref_state.counts)
        np.testing.assert_array_equal(state.keys, ref_state.keys)  # exact arithmetic: the same centroids, bit for bit


@device
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_device_vq_matches_refimpl(dtype):
    cupy = _cupy()
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, 150, d=6, dv=4, dtype=dtype)
    codebook = rng.normal(size=(45, 6)).astype(dtype)
    for chunk in (1, 32, 200):
        ref = ref_ovq.vq_attention(q, k, v, codebook, chunk_size=chunk)
        _close(ck.vq_attention(*(cupy.asarray(a) for a in (q, k, v, codebook)), chunk_size=chunk), ref, dtype)
        np.testing.assert_allclose(ck.vq_attention(q, k, v, codebook, chunk_size=chunk), ref, rtol=RTOL[dtype], atol=RTOL[dtype])


@device
def test_device_errors_match_refimpl():
    cupy = _cupy()
    rng = np.random.default_rng(13)
    q, k, v = _inputs(rng, 6)
    bad = q.copy()
    bad[3, 1] = np.nan
    dev = lambda a: cupy.asarray(a)
    kw = dict(max_size=4, chunk_size=2)
    _same_error(lambda: ck.ovq_attention(dev(bad), dev(k), dev(v), **kw), lambda: ref_ovq.ovq_attention(bad, k, v, **kw))
    _same_error(lambda: ck.ovq_attention(dev(q), dev(k[:5]), dev(v), **kw), lambda: ref_ovq.ovq_attention(q, k[:5], v, **kw))
    huge = ref_ovq.OVQState(np.full((4, 3), 1e300), np.ones((4, 2)), [2, 1, 0, 0], 2, 3)
    with np.errstate(over="ignore", invalid="ignore"):
        _same_error(lambda: ck.ovq_attention(dev(q), dev(k), dev(v), state=huge, beta=1e10, **kw),
                    lambda: ref_ovq.ovq_attention(q, k, v, state=huge, beta=1e10, **kw))
        cb = rng.normal(size=(3, 3)) * 1e300
        _same_error(lambda: ck.vq_attention(dev(q), dev(k), dev(v), dev(cb), chunk_size=2, beta=1e10),
                    lambda: ref_ovq.vq_attention(q, k, v, cb, chunk_size=2, beta=1e10))
    _same_error(lambda: ck.vq_attention(dev(bad), dev(k), dev(v), dev(q[:2]), chunk_size=2),
                lambda: ref_ovq.vq_attention(bad, k, v, q[:2], chunk_size=2))
