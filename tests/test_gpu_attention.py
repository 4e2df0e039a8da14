"""gpu.numba_cuda.attention.softmax_attention (tiled online softmax) against refimpl.attention.softmax_attention.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py).
Inputs that overflow on purpose run under :func:`quiet`: the simulator
evaluates the kernel with NumPy scalars in threads that ``np.errstate`` does
not reach.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import attention as G
from gpu.numba_cuda.attention import COLS, DTILE, TILE
from refimpl import attention as R


@contextmanager
def quiet():
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def qkv(batch, N_q, N_k, d, d_v, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


# (batch, N_q, N_k, d, d_v, causal): tiles of TILE rows, d in steps of DTILE, d_v in groups of COLS
CASES = [
    ((), 5, 5, 3, 2, False),
    ((), TILE + 3, TILE + 3, 3, 4, True),
    ((), 1, 1, 2, 1, True),
    ((), 1, 3, 2, 1, False),
    ((), 3, TILE + 5, DTILE + 2, COLS + 3, False),
    ((2, 3), 4, 4, 3, 2, True),
]


@pytest.mark.parametrize("batch, N_q, N_k, d, d_v, causal", CASES)
def test_float64_matches_the_reference(batch, N_q, N_k, d, d_v, causal):
    q, k, v = qkv(batch, N_q, N_k, d, d_v, seed=N_q + d)
    out = G.softmax_attention(q, k, v, causal=causal)
    assert isinstance(out, np.ndarray) and out.shape == batch + (N_q, d_v)
    np.testing.assert_allclose(out, R.softmax_attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-13)


def test_float32_matches_the_reference_in_float32_with_a_scale():
    q, k, v = qkv((2,), TILE + 1, TILE + 1, 3, 2, seed=1, dtype=np.float32)
    out = G.softmax_attention(q, k, v, scale=1.7, causal=True)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, R.softmax_attention(q, k, v, scale=1.7, causal=True), rtol=1e-5, atol=1e-6)


def test_large_scores_need_the_running_rescaling():
    """Scores of a few hundred: exp would overflow without the running maximum subtracted."""
    q, k, v = qkv((), TILE + 2, TILE + 2, 2, 2, seed=2)
    out = G.softmax_attention(30 * q, 30 * k, v, scale=1.0)
    np.testing.assert_allclose(out, R.softmax_attention(30 * q, 30 * k, v, scale=1.0), rtol=1e-10, atol=1e-12)


def test_device_arrays_in_give_device_arrays_out():
    q, k, v = qkv((2,), 3, 3, 2, 2, seed=3)
    dev = G.softmax_attention(cuda.to_device(q), k, v, causal=True)
    assert hasattr(dev, "copy_to_host") and dev.shape == (2, 3, 2)
    np.testing.assert_array_equal(dev.copy_to_host(), G.softmax_attention(q, k, v, causal=True))


def test_results_are_bit_identical_from_run_to_run():
    q, k, v = qkv((), TILE + 2, TILE + 2, 3, 2, seed=4)
    np.testing.assert_array_equal(G.softmax_attention(q, k, v, causal=True), G.softmax_attention(q, k, v, causal=True))


def _bad_calls():
    q, k, v = qkv((), 4, 4, 3, 2, seed=5)
    nan_k = k.copy()
    nan_k[1, 2] = np.nan
    return [
        ("k of another width", (q, k[:, :2].copy(), v), {}),
        ("causal lengths", (q[:3].copy(), k, v), {"causal": True}),
        ("leading sizes differ", (q[None], np.stack([k, k]), np.stack([v, v])), {}),
        ("q batched, k and v not", (q[None], k, v), {}),
        ("k with a NaN", (q, nan_k, v), {}),
        ("scale <= 0", (q, k, v), {"scale": -1.0}),
        ("causal not bool", (q, k, v), {"causal": "yes"}),
    ]


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("name, args, kw", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors_are_the_references(name, args, kw, on_device):
    with pytest.raises((ValueError, TypeError)) as ref:
        R.softmax_attention(*args, **kw)
    gpu_args = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in args) if on_device else args
    with pytest.raises(ref.type) as got:
        G.softmax_attention(*gpu_args, **kw)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize(
    "q, k, kw",
    [
        (np.array([[2.0, 0.0], [0.0, 2.0]]), np.array([[2.0, 0.0], [0.0, 2.0]]), {"scale": 1e308}),
        (np.array([[2e200, 0.0], [0.0, 2e200]]), np.array([[2e200, 0.0], [0.0, 2e200]]), {"causal": True}),
        (np.stack([np.eye(2), np.array([[0.0, 1e300], [1.0, 0.0]])]), np.stack([np.eye(2), np.full((2, 2), 1e300)]), {}),
        (np.array([[0.5, 0.5], [1e300, 1e300]]), np.array([[0.0, 0.0], [1e300, -1e300]]), {}),
    ],
    ids=["scale 1e308", "causal, q k = 4e400", "batched, second sequence's first row", "inf - inf = NaN beside a finite score"],
)
def test_overflowed_scores_are_refused_with_the_references_message(q, k, kw):
    v = np.ones(q.shape[:-1] + (1,))
    with quiet():
        with pytest.raises(ValueError) as ref:
            R.softmax_attention(q, k, v, **kw)
        with pytest.raises(ValueError) as got:
            G.softmax_attention(q, k, v, **kw)
    assert str(got.value) == str(ref.value)
    assert "the logits of" in str(ref.value)
