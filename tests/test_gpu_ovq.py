"""gpu.numba_cuda.ovq against refimpl.ovq: every switch, streaming through a state, device arrays, errors, overflow.

Without a GPU the kernels run in the CUDA simulator (tests/conftest.py), which
runs every thread as a Python thread: the cases are tiny and few.
"""

import inspect
import warnings

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import ovq as gpu_ovq
from refimpl import ovq

TOL64 = dict(rtol=1e-10, atol=1e-12)
TOL32 = dict(rtol=1e-5, atol=1e-6)


def qkv(seed, N, d=3, d_v=2, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(N, n)).astype(dtype) for n in (d, d, d_v)]


def assert_state_close(state, ref, tol):
    assert isinstance(state, ovq.OVQState)
    assert (state.size, state.tokens_seen) == (ref.size, ref.tokens_seen)
    assert np.array_equal(state.counts, ref.counts)
    assert state.keys.dtype == ref.keys.dtype and state.counts.dtype == np.int64
    np.testing.assert_allclose(state.keys, ref.keys, **tol)
    np.testing.assert_allclose(state.values, ref.values, **tol)


def ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


# (N, chunk_size, max_size, d, options): chunk sizes 1, 3, 5 and > N, N not a multiple of C, N = 1, n_max = 1
CASES = [
    (9, 3, 5, 3, {}),
    (5, 1, 4, 2, {"growth": "linear"}),
    (11, 5, 6, 4, {"init": "random", "seed": 0}),
    (8, 3, 6, 3, {"init": "random", "seed": 7, "growth": "linear"}),
    (7, 9, 4, 3, {"count_bias": False}),
    (7, 3, 5, 2, {"learning_rate": 0.3}),
    (9, 5, 5, 3, {"learning_rate": 1.0, "init": "random", "seed": 3, "growth": "linear"}),
    (1, 3, 3, 3, {}),
    (7, 3, 1, 3, {"beta": 4.5}),
]


@pytest.mark.parametrize("N, C, n_max, d, kw", CASES, ids=[f"N{c[0]}-C{c[1]}-n_max{c[2]}-{ids(c[4])}" for c in CASES])
def test_ovq_matches_refimpl_float64(N, C, n_max, d, kw):
    q, k, v = qkv(N * 7 + C, N, d=d)
    out, state = gpu_ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (N, 2)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


def test_feature_and_value_dimensions_above_a_tile_and_a_later_key_tile_with_the_row_maximum():
    """d, d_v > TILE (several slabs); q = k without count bias: a row's largest logit, its own key, in a later tile."""
    assert gpu_ovq.TILE < 9
    q, _, v = qkv(12, 10, d=10, d_v=9)
    # the second chunk reads n = 5 centroids and 5 keys: two key tiles, rows 3 and 4 find their maximum in the second
    opts = dict(max_size=6, chunk_size=5, count_bias=False, growth="linear")
    out, state = gpu_ovq.ovq_attention(q, q, v, return_state=True, **opts)
    ref_out, ref_state = ovq.ovq_attention(q, q, v, return_state=True, **opts)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


@pytest.mark.parametrize("kw", [{}, {"learning_rate": 0.3, "init": "random", "seed": 5}], ids=ids)
def test_ovq_matches_refimpl_float32(kw):
    q, k, v = qkv(21, 10, d=4, d_v=3, dtype=np.float32)
    out, state = gpu_ovq.ovq_attention(q, k, v, max_size=5, chunk_size=3, return_state=True, **kw)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=5, chunk_size=3, return_state=True, **kw)
    assert out.dtype == np.float32 and state.keys.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, **TOL32)
    assert_state_close(state, ref_state, TOL32)


def test_ties_go_to_the_lowest_index_like_refimpl():
    """Exact ties: two identical centroids (the key joins the first), identical keys (the stable rank seeds the first)."""
    u, w = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])
    state = ovq.OVQState(np.array([u, u, w, 0 * u, 0 * u]), np.ones((5, 2)), np.array([1, 2, 1, 0, 0]), 3, 4)
    k = np.array([[0.9, 0.1, 0.2], [0.8, -0.3, 0.1], [0.7, 0.2, -0.4]])
    v = np.arange(6.0).reshape(3, 2)
    out, st = gpu_ovq.ovq_attention(k, k, v, max_size=5, chunk_size=3, state=state, return_state=True)
    ref_out, ref_st = ovq.ovq_attention(k, k, v, max_size=5, chunk_size=3, state=state, return_state=True)
    assert list(ref_st.counts) == [4, 2, 1, 0, 0]
    assert_state_close(st, ref_st, TOL64)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    # first chunk: keys 1, 2, 3 tie as the least similar to key 0 and seed rows 1, 2, 3 in index order
    b = np.array([-1.0, 0.2, 0.0])
    k = np.array([u, b, b, b, [0.1, 1.0, 0.0]])
    v = np.arange(10.0).reshape(5, 2)
    out, st = gpu_ovq.ovq_attention(k, k, v, max_size=100, chunk_size=5, return_state=True)
    ref_out, ref_st = ovq.ovq_attention(k, k, v, max_size=100, chunk_size=5, return_state=True)
    assert ref_st.size == 4 and np.array_equal(ref_st.values[1:4], v[1:4])
    assert_state_close(st, ref_st, TOL64)
    np.testing.assert_allclose(out, ref_out, **TOL64)


def test_streaming_through_a_state_equals_one_call_and_refimpl():
    q, k, v = qkv(5, 9)
    opts = dict(max_size=5, chunk_size=3, init="random", seed=2)
    whole, whole_state = gpu_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    first, mid = gpu_ovq.ovq_attention(q[:6], k[:6], v[:6], return_state=True, **opts)
    second, end = gpu_ovq.ovq_attention(q[6:], k[6:], v[6:], state=mid, return_state=True, **opts)
    ref_first, ref_mid = ovq.ovq_attention(q[:6], k[:6], v[:6], return_state=True, **opts)
    ref_second, ref_end = ovq.ovq_attention(q[6:], k[6:], v[6:], state=ref_mid, return_state=True, **opts)
    assert_state_close(mid, ref_mid, TOL64)
    assert_state_close(end, ref_end, TOL64)
    np.testing.assert_allclose(np.concatenate([first, second]), np.concatenate([ref_first, ref_second]), **TOL64)
    assert_state_close(end, whole_state, TOL64)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, **TOL64)
    # the state passed in is not modified
    assert_state_close(mid, ref_mid, TOL64)


def test_a_float64_state_makes_float32_inputs_compute_in_float64():
    q, k, v = qkv(6, 4, dtype=np.float32)
    st = ovq.OVQState(np.eye(3), np.ones((3, 2)), np.array([2, 1, 0]), 2, 3)
    out, state = gpu_ovq.ovq_attention(q, k, v, max_size=3, chunk_size=4, state=st, return_state=True)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=3, chunk_size=4, state=st, return_state=True)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


def test_device_arrays_in_give_device_arrays_out():
    q, k, v = qkv(8, 7)
    out, state = gpu_ovq.ovq_attention(cuda.to_device(q), k, cuda.to_device(v), max_size=4, chunk_size=3, return_state=True)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True)
    assert hasattr(out, "copy_to_host") and not isinstance(out, np.ndarray)
    np.testing.assert_allclose(out.copy_to_host(), ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


def test_two_runs_are_bit_identical():
    q, k, v = qkv(9, 6)
    opts = dict(max_size=5, chunk_size=3, init="random", seed=4, learning_rate=0.5)
    a, sa = gpu_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    b, sb = gpu_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    assert np.array_equal(a, b)
    assert np.array_equal(sa.keys, sb.keys) and np.array_equal(sa.values, sb.values)
    assert np.array_equal(sa.counts, sb.counts)


def test_signature_is_refimpls():
    assert inspect.signature(gpu_ovq.ovq_attention) == inspect.signature(ovq.ovq_attention)
    assert inspect.signature(gpu_ovq.vq_attention) == inspect.signature(ovq.vq_attention)


def _raised(f):
    with pytest.raises(Exception) as info:
        f()
    return type(info.value), str(info.value)


_Q, _K, _V = qkv(0, 4)
_NAN = _Q.copy()
_NAN[2, 1] = np.nan
_STATE = ovq.OVQState(np.zeros((3, 3)), np.zeros((3, 2)), np.zeros(3, np.int64), 0, 0)
_LAGGING = ovq.OVQState(np.eye(6, 3), np.ones((6, 2)), np.array([4, 0, 0, 0, 0, 0]), 1, 4)
BAD_OVQ = {
    "missing max_size": ((_Q, _K, _V), dict(chunk_size=2)),
    "unknown keyword": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, chunksize=2)),
    "positional option": ((_Q, _K, _V, 3), dict(chunk_size=2)),
    "growth": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, growth="cubic")),
    "learning_rate": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, learning_rate=1.5)),
    "k shape": ((_Q, _K[:3], _V), dict(max_size=3, chunk_size=2)),
    "nan q": ((_NAN, _K, _V), dict(max_size=3, chunk_size=2)),
    "return_state": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, return_state="yes")),
    "state type": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, state=(1, 2))),
    "state max_size": ((_Q, _K, _V), dict(max_size=4, chunk_size=2, state=_STATE)),
    "state lags its growth": ((_Q, _K, _V), dict(max_size=6, chunk_size=4, growth="linear", state=_LAGGING)),
}


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("case", list(BAD_OVQ))
def test_ovq_errors_are_refimpls(case, on_device):
    args, kw = BAD_OVQ[case]
    dev_args = tuple(cuda.to_device(a) if on_device and isinstance(a, np.ndarray) else a for a in args)
    expected = _raised(lambda: ovq.ovq_attention(*args, **kw))
    assert _raised(lambda: gpu_ovq.ovq_attention(*dev_args, **kw)) == expected


def test_overflowing_logits_are_refused_like_refimpl():
    """A state built by hand with huge keys and a large beta (refimpl's robustness case)."""
    q = np.ones((3, 2))
    state = ovq.OVQState(np.array([[1e300, 0.0], [0.0, 0.0]]), np.ones((2, 1)), np.array([1, 0]), 1, 1)
    kw = dict(max_size=2, chunk_size=3, beta=1e10, state=state)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _raised(lambda: ovq.ovq_attention(q, q, np.ones((3, 1)), **kw))
    assert expected[1].startswith("beta, state: the logits of 3 row(s) (first: row 0) overflow float64")
    # the simulator computes with NumPy scalars, which warn where a GPU overflows silently
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert _raised(lambda: gpu_ovq.ovq_attention(q, q, np.ones((3, 1)), **kw)) == expected


# --- VQ attention -----------------------------------------------------------------------


@pytest.mark.parametrize("N, C, S", [(5, 1, 4), (10, 3, 10), (7, 9, 1)])
def test_vq_matches_refimpl_float64(N, C, S):
    """S = 10 codes: two tiles of codes in the assignment and in the read-out."""
    q, k, v = qkv(N + 31 * C, N)
    codebook = np.random.default_rng(C).normal(size=(S, 3))
    out = gpu_ovq.vq_attention(q, k, v, codebook, chunk_size=C)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    np.testing.assert_allclose(out, ovq.vq_attention(q, k, v, codebook, chunk_size=C), **TOL64)


def test_vq_matches_refimpl_float32_and_device_arrays_stay_on_the_device():
    q, k, v = qkv(3, 9, d=4, d_v=3, dtype=np.float32)
    codebook = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    out = gpu_ovq.vq_attention(cuda.to_device(q), k, v, cuda.to_device(codebook), chunk_size=4, beta=1.7)
    assert hasattr(out, "copy_to_host") and out.dtype == np.float32
    np.testing.assert_allclose(out.copy_to_host(), ovq.vq_attention(q, k, v, codebook, chunk_size=4, beta=1.7), **TOL32)


BAD_VQ = {
    "codebook d": ((_Q, _K, _V, np.ones((2, 2))), dict(chunk_size=2)),
    "empty codebook": ((_Q, _K, _V, np.ones((0, 3))), dict(chunk_size=2)),
    "chunk_size": ((_Q, _K, _V, np.ones((2, 3))), dict(chunk_size=0)),
    "beta": ((_Q, _K, _V, np.ones((2, 3))), dict(chunk_size=2, beta=-1.0)),
    "nan q": ((_NAN, _K, _V, np.ones((2, 3))), dict(chunk_size=2)),
    "nan codebook": ((_Q, _K, _V, np.array([[1.0, np.nan, 0.0]])), dict(chunk_size=2)),
}


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("case", list(BAD_VQ))
def test_vq_errors_are_refimpls(case, on_device):
    args, kw = BAD_VQ[case]
    dev_args = tuple(cuda.to_device(a) if on_device else a for a in args)
    expected = _raised(lambda: ovq.vq_attention(*args, **kw))
    assert _raised(lambda: gpu_ovq.vq_attention(*dev_args, **kw)) == expected


def test_vq_refuses_a_codebook_whose_logits_overflow_like_refimpl():
    q = np.ones((3, 2))
    args = (q, q, np.ones((3, 1)), np.array([[1e300, 1e300]]))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = _raised(lambda: ovq.vq_attention(*args, chunk_size=3, beta=1e10))
    assert expected[1].startswith("beta, codebook: the logits of 3 row(s)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert _raised(lambda: gpu_ovq.vq_attention(*args, chunk_size=3, beta=1e10)) == expected
