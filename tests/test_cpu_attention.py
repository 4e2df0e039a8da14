"""cpu.attention's softmax attention (online softmax, Numba) against refimpl.attention.

Outputs and gradients in float64 and float32 for awkward sizes, one sequence
and batches, causal and not; the errors word for word; the same bits with
one thread and two; no ``N x N`` memory.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import numba
import numpy as np
import pytest

from cpu import attention as C
from cpu.attention import ROWS, TILE
from refimpl import attention as R


@contextmanager
def quiet():
    """refimpl's NumPy warns on the overflowing inputs that these tests pass on purpose."""
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def qkv(batch, N_q, N_k, d, d_v, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


def reference_grads(q, k, v, g, **kw):
    """refimpl's backward, one (N, d) slice at a time (it takes 2-D arrays)."""
    grads = [np.empty_like(a) for a in (q, k, v)]
    for idx in np.ndindex(*q.shape[:-2]):
        _, cache = R.softmax_attention_forward(q[idx], k[idx], v[idx], **kw)
        for out, got in zip(grads, R.softmax_attention_backward(g[idx], cache)):
            out[idx] = got
    return grads


def assert_close(got, ref, tol):
    """Every entry within ``tol`` relative to itself or to the largest entry of ``ref`` (outputs near 0 cancel)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.max(np.abs(ref), initial=0.0))


# (batch, N_q, N_k, d, d_v, causal): one row, a block of ROWS plus one, tiles of TILE plus two, odd widths
CASES = [
    ((), 1, 1, 1, 1, True),
    ((), 1, 7, 3, 2, False),
    ((), 7, 7, 3, 2, True),
    ((), 33, 130, 17, 5, False),
    ((), 130, 130, 1, 3, True),
    ((), TILE + 2, 2 * TILE + 2, 64, 64, False),
    ((), ROWS + 1, ROWS + 1, 4, 9, True),
    ((2,), 130, 130, 17, 3, True),
    ((2, 3), 33, 7, 3, 17, False),
]
IDS = [f"{'x'.join(map(str, b)) or '2d'}-Nq{nq}-Nk{nk}-d{d}-dv{dv}{'-causal' if c else ''}" for b, nq, nk, d, dv, c in CASES]


@pytest.mark.parametrize("batch, N_q, N_k, d, d_v, causal", CASES, ids=IDS)
def test_float64_output_and_gradients_match_the_reference(batch, N_q, N_k, d, d_v, causal):
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=N_q + d)
    g = np.random.default_rng(1).normal(size=batch + (N_q, d_v))
    out = C.softmax_attention(q, k, v, causal=causal)
    assert_close(out, R.softmax_attention(q, k, v, causal=causal), 1e-13)
    out_f, cache = C.softmax_attention_forward(q, k, v, causal=causal)
    np.testing.assert_array_equal(out_f, out)
    grads = C.softmax_attention_backward(g, cache)
    assert isinstance(grads, R.SoftmaxAttentionGrads)
    for got, ref in zip(grads, reference_grads(q, k, v, g, causal=causal)):
        assert_close(got, ref, 1e-13)


@pytest.mark.parametrize("batch, N_q, N_k, d, d_v, causal", CASES[2::2], ids=IDS[2::2])
def test_float32_is_computed_in_float32_and_matches_the_reference(batch, N_q, N_k, d, d_v, causal):
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=3, dtype=np.float32)
    g = np.random.default_rng(4).normal(size=batch + (N_q, d_v)).astype(np.float32)
    out, cache = C.softmax_attention_forward(q, k, v, scale=0.7, causal=causal)
    assert out.dtype == np.float32 and cache.row_sum.dtype == np.float32
    ref = R.softmax_attention(q, k, v, scale=0.7, causal=causal)
    assert_close(out, ref, 1e-5)
    assert_close(C.softmax_attention(q, k, v, scale=0.7, causal=causal), ref, 1e-5)
    for got, want in zip(C.softmax_attention_backward(g, cache), reference_grads(q, k, v, g, scale=0.7, causal=causal)):
        assert_close(got, want, 1e-5)


def test_mixed_dtypes_compute_in_float64_like_the_reference():
    q, k, v = qkv((), 5, 6, 3, 2, seed=5)
    out = C.softmax_attention(q.astype(np.float32), k, v)
    assert out.dtype == np.float64
    assert_close(out, R.softmax_attention(q.astype(np.float32), k, v), 1e-13)


def test_a_late_tile_with_much_larger_scores_rescales_the_earlier_ones():
    """The maximum jumps by hundreds in the third tile: exp(m - m') underflows to 0 and the first tiles drop out."""
    q, k, v = qkv((), 9, 3 * TILE + 5, 4, 3, seed=6)
    k[2 * TILE + 3] = 60 * q.mean(axis=0)
    k[5] = -60 * q.mean(axis=0)
    g = np.random.default_rng(7).normal(size=(9, 3))
    out, cache = C.softmax_attention_forward(q, k, v, scale=1.0)
    assert_close(out, R.softmax_attention(q, k, v, scale=1.0), 1e-13)
    for got, ref in zip(C.softmax_attention_backward(g, cache), reference_grads(q, k, v, g, scale=1.0)):
        assert_close(got, ref, 1e-13)


def test_strided_inputs_give_the_contiguous_results():
    """(B, N, H, d_h) projections viewed as (B, H, N, d_h): the model's call."""
    q, k, v = (np.random.default_rng(9).normal(size=(2, 2 * TILE + 1, 3, 8)).transpose(0, 2, 1, 3) for _ in range(3))
    g = np.random.default_rng(10).normal(size=q.shape)
    out, cache = C.softmax_attention_forward(q, k, v, causal=True)
    out_c, cache_c = C.softmax_attention_forward(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True)
    np.testing.assert_array_equal(out, out_c)
    for a, b in zip(C.softmax_attention_backward(g, cache), C.softmax_attention_backward(np.ascontiguousarray(g), cache_c)):
        np.testing.assert_array_equal(a, b)


def test_an_empty_batch_gives_the_references_empty_result():
    q, k, v = qkv((0, 2), 3, 3, 2, 4)
    out, cache = C.softmax_attention_forward(q, k, v, causal=True)
    ref = R.softmax_attention(q, k, v, causal=True)
    assert out.shape == ref.shape == (0, 2, 3, 4) and out.dtype == ref.dtype
    assert [a.shape for a in C.softmax_attention_backward(np.zeros(out.shape), cache)] == [q.shape, k.shape, v.shape]


def _bad_calls():
    q, k, v = qkv((), 4, 4, 3, 2, seed=11)
    nan_k = k.copy()
    nan_k[1, 2] = np.nan
    return [
        ("q 1-D", (q[0], k, v), {}),
        ("k of another width", (q, k[:, :2].copy(), v), {}),
        ("v of another length", (q, k, v[:3].copy()), {}),
        ("integer q", (q.astype(np.int64), k, v), {}),
        ("causal lengths", (q[:3].copy(), k, v), {"causal": True}),
        ("batched causal lengths", (q[None, :3].copy(), k[None], v[None]), {"causal": True}),
        ("leading sizes differ", (q[None], np.stack([k, k]), np.stack([v, v])), {}),
        ("q batched, k and v not", (q[None], k, v), {}),
        ("k with a NaN", (q, nan_k, v), {}),
        ("batched k with a NaN", (q[None], nan_k[None], v[None]), {}),
        ("no rows", (q[:0], k, v), {}),
        ("scale <= 0", (q, k, v), {"scale": -1.0}),
        ("scale a string", (q, k, v), {"scale": "1"}),
        ("causal not bool", (q, k, v), {"causal": "yes"}),
    ]


@pytest.mark.parametrize("name, args, kw", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors_are_the_references(name, args, kw):
    with pytest.raises((ValueError, TypeError)) as ref:
        R.softmax_attention(*args, **kw)
    with pytest.raises(ref.type) as got:
        C.softmax_attention(*args, **kw)
    assert str(got.value) == str(ref.value)
    with pytest.raises(ref.type) as got_forward:
        C.softmax_attention_forward(*args, **kw)
    assert str(got_forward.value) == str(ref.value)


@pytest.mark.parametrize(
    "q, k, kw",
    [
        (np.array([[2.0, 0.0], [0.0, 2.0]]), np.array([[2.0, 0.0], [0.0, 2.0]]), {"scale": 1e308}),
        (np.array([[2e200, 0.0], [0.0, 2e200]]), np.array([[2e200, 0.0], [0.0, 2e200]]), {"causal": True}),
        (np.stack([np.eye(2), np.array([[0.0, 1e300], [1.0, 0.0]])]), np.stack([np.eye(2), np.full((2, 2), 1e300)]), {}),
        (np.array([[0.5, 0.5], [1e300, 1e300]]), np.array([[0.0, 0.0], [1e300, -1e300]]), {}),
        (np.array([[1.0, 0.0], [-1e300, 0.0]]), np.array([[1e300, 0.0], [1e300, 0.0]]), {}),
    ],
    ids=["scale 1e308", "causal, q k = 4e400", "batched, second sequence's first row", "inf - inf = NaN beside a finite score", "every score -inf"],
)
def test_overflowed_scores_are_refused_with_the_references_message(q, k, kw):
    v = np.ones(q.shape[:-1] + (1,))
    with quiet():
        with pytest.raises(ValueError) as ref:
            R.softmax_attention(q, k, v, **kw)
    with pytest.raises(ValueError) as got:
        C.softmax_attention(q, k, v, **kw)
    assert str(got.value) == str(ref.value)
    assert "the logits of" in str(ref.value)
    with pytest.raises(ValueError) as got_forward:
        C.softmax_attention_forward(q, k, v, **kw)
    assert str(got_forward.value) == str(ref.value)


@pytest.mark.parametrize(
    "grad_out",
    [np.ones((4, 3)), np.ones(4), np.full((4, 2), np.nan), np.ones((4, 2), dtype=np.int64)],
    ids=["wrong width", "1-D", "NaN", "integers"],
)
def test_grad_out_errors_are_the_references(grad_out):
    q, k, v = qkv((), 4, 4, 3, 2, seed=12)
    with pytest.raises((ValueError, TypeError)) as ref:
        R.softmax_attention_backward(grad_out, R.softmax_attention_forward(q, k, v)[1])
    with pytest.raises(ref.type) as got:
        C.softmax_attention_backward(grad_out, C.softmax_attention_forward(q, k, v)[1])
    assert str(got.value) == str(ref.value)


def test_batched_grad_out_of_another_shape_is_refused_naming_the_expected_one():
    q, k, v = qkv((2,), 4, 4, 3, 2, seed=13)
    _, cache = C.softmax_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(\.\.\., N_q, d_v\) = \(2, 4, 2\), got \(2, 4, 3\)"):
        C.softmax_attention_backward(np.ones((2, 4, 3)), cache)


def test_backward_refuses_a_cache_of_another_type():
    q, k, v = qkv((), 4, 4, 3, 2, seed=14)
    _, ref_cache = R.softmax_attention_forward(q, k, v)
    with pytest.raises(TypeError) as got:
        C.softmax_attention_backward(np.ones((4, 2)), ref_cache)
    assert str(got.value) == "cache: expected the OnlineSoftmaxCache from cpu.attention.softmax_attention_forward, got SoftmaxAttentionCache"


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two Numba threads")
def test_one_thread_and_two_give_the_same_bits():
    q, k, v = qkv((2,), 3 * ROWS + 5, 3 * ROWS + 5, 17, 6, seed=15)
    g = np.random.default_rng(16).normal(size=(2, 3 * ROWS + 5, 6))
    kq, kk, kv = qkv((), 2 * ROWS + 1, 5 * ROWS + 3, 8, 3, seed=17)
    kg = np.random.default_rng(18).normal(size=(2 * ROWS + 1, 3))

    def run():
        results = []
        for dtype in (np.float64, np.float32):
            for args, grad, causal in (((q, k, v), g, True), ((kq, kk, kv), kg, False)):
                out, cache = C.softmax_attention_forward(*(a.astype(dtype) for a in args), causal=causal)
                results += [out, *C.softmax_attention_backward(grad.astype(dtype), cache)]
        return results

    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run()
        numba.set_num_threads(2)
        two = run()
    finally:
        numba.set_num_threads(before)
    assert len(one) == len(two) == 16
    for a, b in zip(one, two):
        assert np.array_equal(a, b)


def _peak_rss_increase(fn):
    """Bytes of resident memory that ``fn()`` adds at its peak (Linux: VmHWM reset through clear_refs)."""

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident memory")
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


def test_forward_and_backward_make_no_n_by_n_allocation():
    N = 4096
    q, k, v = qkv((), N, N, 16, 16, seed=19)
    g = np.random.default_rng(20).normal(size=(N, 16))
    _, cache = C.softmax_attention_forward(q[:100], k[:100], v[:100], causal=True)  # compiled or loaded beforehand
    C.softmax_attention_backward(g[:100], cache)
    square = N * N * 8
    holder = {}
    grew = _peak_rss_increase(lambda: holder.update(fwd=C.softmax_attention_forward(q, k, v, causal=True)))
    assert grew < square / 16, f"the forward grew the resident memory by {grew} bytes (N x N float64 is {square})"
    grew = _peak_rss_increase(lambda: C.softmax_attention_backward(g, holder["fwd"][1]))
    assert grew < square / 16, f"the backward grew the resident memory by {grew} bytes (N x N float64 is {square})"
    # the measurement sees an N x N array when there is one
    assert _peak_rss_increase(lambda: np.ones((N, N)).sum()) > square * 0.9
