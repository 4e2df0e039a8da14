"""refimpl.attention: softmax, the shared normalised feature-map scan and linear attention.

Each forward is compared with an explicit quadratic form and (for the scan)
a literal token-by-token recurrence; each backward with central differences
in float64 under a random upstream gradient, for every input, bidirectional
and causal, with sequence lengths that are not multiples of the chunk size.
"""

import tracemalloc

import numpy as np
import pytest
from scipy import special

from refimpl import attention as A
from refimpl import scan as S
from refimpl.testing import TOL, assert_grads_close, fd_gradients



def dense_normalised(phi_q, phi_k, v, causal, eps):
    """D^-1 A V with the explicit affinity."""
    a = phi_q @ phi_k.T
    if causal:
        a = np.tril(a)
    return (a @ v) / (a.sum(1) + eps)[:, None]


def recurrence(phi_q, phi_k, v, eps):
    """The causal scan one token at a time: S_t, z_t as literal prefix sums."""
    s, z = np.zeros((phi_k.shape[1], v.shape[1])), np.zeros(phi_k.shape[1])
    out = np.empty((len(phi_q), v.shape[1]))
    for t in range(len(phi_q)):
        s += np.outer(phi_k[t], v[t])
        z += phi_k[t]
        out[t] = phi_q[t] @ s / (phi_q[t] @ z + eps)
    return out


def features(seed, n_q, n_k, F, d_v):
    rng = np.random.default_rng(seed)
    return rng.random((n_q, F)), rng.random((n_k, F)), rng.normal(size=(n_k, d_v))


def elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


# --- softmax attention --------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_matches_scipy_softmax(causal):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(9, 4)), rng.normal(size=(9, 4)), rng.normal(size=(9, 3))
    s = q @ k.T / 2.0  # default scale 1 / sqrt(4)
    if causal:
        s = np.where(np.tril(np.ones((9, 9), bool)), s, -np.inf)
    np.testing.assert_allclose(A.softmax_attention(q, k, v, causal=causal), special.softmax(s, axis=1) @ v, **TOL[np.float64])


@pytest.mark.parametrize("causal,n", [(False, 1), (False, 7), (True, 1), (True, 6)])
def test_softmax_attention_backward_matches_finite_differences(causal, n):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(n, 3)), rng.normal(size=(n, 3)), rng.normal(size=(n, 2))
    out, cache = A.softmax_attention_forward(q, k, v, scale=0.7, causal=causal)
    g = rng.normal(size=out.shape)
    grads = A.softmax_attention_backward(g, cache)
    fd = fd_gradients(lambda *a: A.softmax_attention(*a, scale=0.7, causal=causal), [q, k, v], g)
    assert_grads_close(grads, fd)


# --- the shared normalised scan -----------------------------------------------------


@pytest.mark.parametrize("n,chunk", [(1, 8), (7, 8), (37, 8), (63, 64), (64, 64), (65, 64), (130, 64), (20, 1), (20, 20), (20, 500)])
def test_causal_scan_matches_dense_tril_and_token_recurrence(n, chunk):
    pq, pk, v = features(n, n, n, 5, 3)
    out = A.feature_attention(pq, pk, v, causal=True, chunk_size=chunk)
    np.testing.assert_allclose(out, dense_normalised(pq, pk, v, True, 1e-6), **TOL[np.float64])
    np.testing.assert_allclose(out, recurrence(pq, pk, v, 1e-6), **TOL[np.float64])


@pytest.mark.parametrize("n_q,n_k,F", [(1, 1, 1), (7, 11, 4), (40, 3, 2)])
def test_bidirectional_matches_dense(n_q, n_k, F):
    pq, pk, v = features(3, n_q, n_k, F, 2)
    np.testing.assert_allclose(A.feature_attention(pq, pk, v), dense_normalised(pq, pk, v, False, 1e-6), **TOL[np.float64])


def test_causal_scan_does_not_depend_on_chunk_size():
    pq, pk, v = features(4, 101, 101, 6, 5)
    ref = A.feature_attention(pq, pk, v, causal=True, chunk_size=1)
    for chunk in (2, 7, 64, 100, 101, 1000):
        np.testing.assert_allclose(A.feature_attention(pq, pk, v, causal=True, chunk_size=chunk), ref, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    "causal,n_q,n_k,F,chunk",
    [(False, 6, 9, 3, 4), (True, 10, 10, 3, 4), (True, 10, 10, 1, 3), (True, 1, 1, 2, 4), (False, 1, 1, 2, 4), (True, 9, 9, 2, 9)],
)
def test_scan_backward_matches_finite_differences(causal, n_q, n_k, F, chunk):
    pq, pk, v = features(5, n_q, n_k, F, 3)
    pq, pk = pq + 0.1, pk + 0.1  # stay away from the nonnegativity boundary under +-h
    out, cache = A.feature_attention_forward(pq, pk, v, causal=causal, chunk_size=chunk)
    g = np.random.default_rng(6).normal(size=out.shape)
    grads = A.feature_attention_backward(g, cache)
    fd = fd_gradients(lambda *a: A.feature_attention(*a, causal=causal, chunk_size=chunk), [pq, pk, v], g)
    assert_grads_close(grads, fd)


def test_backward_returns_new_arrays_and_does_not_accumulate():
    pq, pk, v = features(7, 12, 12, 3, 2)
    out, cache = A.feature_attention_forward(pq, pk, v, causal=True, chunk_size=5)
    g = np.ones_like(out)
    first = A.feature_attention_backward(g, cache)
    second = A.feature_attention_backward(g, cache)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
        assert not np.shares_memory(a, b)
    for a, b in zip(first, (pq, pk, v)):
        assert not np.shares_memory(a, b)


def test_causal_scan_memory_has_no_n_by_features_by_dv_or_n_by_n_allocation():
    n, F, d_v = 4096, 32, 32
    pq, pk, v = features(8, n, n, F, d_v)
    tracemalloc.start()
    try:
        out, cache = A.feature_attention_forward(pq, pk, v, causal=True, chunk_size=64)
        A.feature_attention_backward(out, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # inputs excluded; the output, the denominators and three gradients of N x 32 are ~4 MiB
    assert peak < n * F * d_v * 8 / 4  # the cumsum form would need 32 MiB
    assert peak < n * n * 8 / 8  # one N x N matrix is 128 MiB


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_scan_dtype_follows_input(dtype, causal):
    pq, pk, v = features(9, 50, 50, 4, 3)
    out, cache = A.feature_attention_forward(pq.astype(dtype), pk.astype(dtype), v.astype(dtype), causal=causal, chunk_size=16)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, dense_normalised(pq, pk, v, causal, 1e-6), **TOL[dtype])
    grads = A.feature_attention_backward(np.ones(out.shape, dtype), cache)
    ref = A.feature_attention_backward(np.ones(out.shape), A.feature_attention_forward(pq, pk, v, causal=causal, chunk_size=16)[1])
    for a, b in zip(grads, ref):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, **TOL[dtype])


# --- linear attention ---------------------------------------------------------------


@pytest.mark.parametrize("causal,n,chunk", [(False, 13, 64), (True, 13, 4), (True, 1, 4), (True, 64, 64), (True, 65, 64)])
def test_linear_attention_matches_explicit_form(causal, n, chunk):
    rng = np.random.default_rng(10)
    q, k, v = rng.normal(size=(n, 4)), rng.normal(size=(n, 4)), rng.normal(size=(n, 3))
    ref = dense_normalised(elu1(q), elu1(k), v, causal, 1e-6)
    np.testing.assert_allclose(A.linear_attention(q, k, v, causal=causal, chunk_size=chunk), ref, **TOL[np.float64])


@pytest.mark.parametrize("causal,n_q,n_k,chunk", [(False, 5, 8, 4), (True, 9, 9, 4), (True, 1, 1, 4), (False, 1, 1, 4)])
def test_linear_attention_backward_matches_finite_differences(causal, n_q, n_k, chunk):
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(n_q, 3)), rng.normal(size=(n_k, 3)), rng.normal(size=(n_k, 2))
    # keep every coordinate at least 1e-3 away from the kink of elu at 0
    q += np.where(np.abs(q) < 1e-3, 1e-2, 0)
    k += np.where(np.abs(k) < 1e-3, 1e-2, 0)
    out, cache = A.linear_attention_forward(q, k, v, causal=causal, chunk_size=chunk)
    g = rng.normal(size=out.shape)
    grads = A.linear_attention_backward(g, cache)
    assert grads._fields == ("q", "k", "v")
    fd = fd_gradients(lambda *a: A.linear_attention(*a, causal=causal, chunk_size=chunk), [q, k, v], g)
    assert_grads_close(grads, fd)


def test_elu_feature_map_has_no_overflow_and_is_positive():
    x = np.array([-800.0, -1.0, 0.0, 1e-3, 700.0, 1e300])
    phi = A.elu_feature_map(x)  # RuntimeWarnings are errors in this suite
    assert phi[0] == 0.0  # exp(-800) underflows, without a warning
    assert np.all(phi[1:] > 0)
    np.testing.assert_allclose(phi[1:], [np.exp(-1.0), 1.0, 1.001, 701.0, 1e300])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_attention_float32(dtype):
    rng = np.random.default_rng(12)
    q, k, v = rng.normal(size=(40, 4)), rng.normal(size=(40, 4)), rng.normal(size=(40, 3))
    for causal in (False, True):
        out, cache = A.linear_attention_forward(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=causal, chunk_size=16)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, A.linear_attention(q, k, v, causal=causal), **TOL[dtype])
        grads = A.linear_attention_backward(np.ones(out.shape, dtype), cache)
        ref = A.linear_attention_backward(np.ones(out.shape), A.linear_attention_forward(q, k, v, causal=causal)[1])
        for a, b in zip(grads, ref):
            assert a.dtype == dtype
            np.testing.assert_allclose(a, b, **TOL[dtype])


def test_inputs_are_not_mutated():
    rng = np.random.default_rng(13)
    args = [rng.normal(size=(11, 3)), rng.normal(size=(11, 3)), rng.normal(size=(11, 2))]
    copies = [a.copy() for a in args]
    for causal in (False, True):
        out, cache = A.linear_attention_forward(*args, causal=causal, chunk_size=4)
        A.linear_attention_backward(np.ones_like(out), cache)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a, c)


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(chunk_size=0), ValueError, "chunk_size: expected an integer >= 1, got 0"),
        (dict(chunk_size=8.0), TypeError, "chunk_size: expected an integer"),
        (dict(eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
        (dict(causal="yes"), TypeError, "causal: expected True or False"),
    ],
)
def test_bad_options_get_clear_errors(kwargs, exc, match):
    pq, pk, v = features(14, 5, 5, 2, 2)
    with pytest.raises(exc, match=match):
        A.feature_attention(pq, pk, v, **kwargs)
    with pytest.raises(exc, match=match):
        A.linear_attention(pq, pk, v, **kwargs)


def test_bad_arrays_get_clear_errors():
    pq, pk, v = features(15, 5, 6, 2, 2)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        A.feature_attention(pq, pk, v, causal=True)
    with pytest.raises(ValueError, match="phi_k: expected nonnegative features"):
        A.feature_attention(pq, -pk, v)
    with pytest.raises(ValueError, match=r"v: expected shape \(N_k, d_v\)"):
        A.feature_attention(pq, pk, v[:-1])
    with pytest.raises(ValueError, match=r"phi_k: expected shape \(N_k, F\)"):
        A.feature_attention(pq, pk[:, :1], v)
    with pytest.raises(TypeError, match="q: expected a real floating-point array"):
        A.linear_attention(np.ones((3, 2), int), pk[:3], v[:3])
    out, cache = A.linear_attention_forward(pq, pk, v)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(N_q, d_v\)"):
        A.linear_attention_backward(np.ones((4, 2)), cache)
