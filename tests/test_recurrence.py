"""The causal forms token by token: the recurrence beside the chunked scan, and GMA streamed through its state.

``refimpl.scan.causal_recurrence`` states causal normalised attention as one
loop over the tokens; the chunked scan computes the same numbers in blocks.
``refimpl.gma.gma_step`` carries the slot sums of one head from one piece of
a stream to the next (``GMAState``); fed in pieces it gives causal GMA on the
whole stream.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gma, gmm, scan
from app import layers
from refimpl.testing import TOL, assert_grads_close, fd_gradients

DTYPES = [np.float64, np.float32]
# the recurrence and the chunks add the same terms in another order: a few rounding units of the result
RTOL = {np.float64: 1e-12, np.float32: 2e-5}


def features(n, F=5, d_v=3, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.05, 1.0, size=(n, F)).astype(dtype), rng.uniform(0.05, 1.0, size=(n, F)).astype(dtype),
            rng.normal(size=(n, d_v)).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, chunk", [(1, 1), (1, 8), (7, 8), (64, 64), (65, 64), (130, 16), (37, 5), (20, 500)])
def test_the_recurrence_equals_the_chunked_scan(n, chunk, dtype):
    pq, pk, v = features(n, seed=n + chunk, dtype=dtype)
    out, den, (s, z) = scan.causal_recurrence(pq, pk, v, 1e-6)
    chunked, cache = scan.scan_forward(pq, pk, v, True, 1e-6, chunk)
    assert out.dtype == dtype and den.dtype == dtype
    np.testing.assert_allclose(out, chunked, rtol=RTOL[dtype], atol=RTOL[dtype])
    np.testing.assert_allclose(den, cache.den, rtol=RTOL[dtype])
    # the final state is the bidirectional one: every key written
    s_all, z_all = scan.write(pk, v)
    np.testing.assert_allclose(s, s_all, rtol=RTOL[dtype], atol=RTOL[dtype])
    np.testing.assert_allclose(z, z_all, rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, chunk", [(1, 1), (9, 4), (64, 64), (65, 16), (33, 1)])
def test_the_backward_recurrence_equals_the_chunked_backward(n, chunk, dtype):
    pq, pk, v = features(n, seed=3 * n + chunk, dtype=dtype)
    out, cache = scan.scan_forward(pq, pk, v, True, 1e-6, chunk)
    g = np.random.default_rng(n).normal(size=out.shape).astype(dtype)
    want = scan.scan_backward(g, cache)
    got = scan.causal_recurrence_backward(g, cache)
    for name in want._fields:
        w, b = getattr(want, name), getattr(got, name)
        assert b.dtype == dtype
        # dphi_q_t = S_t gn_t + z_t delta_t cancels (exactly, for one token, as eps -> 0): the error is relative to
        # the size of its terms, which are O(1) here (features in [0.05, 1], standard normal values and gradients)
        np.testing.assert_allclose(b, w, rtol=RTOL[dtype], atol=RTOL[dtype] * max(1.0, np.max(np.abs(w))), err_msg=name)


def test_the_backward_recurrence_matches_finite_differences():
    pq, pk, v = features(6, F=3, d_v=2, seed=11)
    out, cache = scan.scan_forward(pq, pk, v, True, 1e-6, 6)
    g = np.random.default_rng(12).normal(size=out.shape)

    def forward(phi_q, phi_k, values):
        return scan.causal_recurrence(phi_q, phi_k, values, 1e-6)[0]

    assert_grads_close(scan.causal_recurrence_backward(g, cache), fd_gradients(forward, [pq, pk, v], g))


def test_the_recurrence_continues_from_a_state():
    pq, pk, v = features(23, seed=4)
    whole, den, state = scan.causal_recurrence(pq, pk, v, 1e-6)
    first, _, mid = scan.causal_recurrence(pq[:10], pk[:10], v[:10], 1e-6)
    rest, _, end = scan.causal_recurrence(pq[10:], pk[10:], v[10:], 1e-6, mid)
    # the same additions in the same order: the same bits
    np.testing.assert_array_equal(np.concatenate([first, rest]), whole)
    for a, b in zip(end, state):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_a_chunk_longer_than_the_sequence_is_the_sequence(causal):
    """chunk_size is capped at N: a huge chunk allocates nothing of its size and gives the one-chunk result."""
    pq, pk, v = features(9, seed=5)
    huge, cache = scan.scan_forward(pq, pk, v, causal, 1e-6, 10**12)
    np.testing.assert_array_equal(huge, scan.scan_forward(pq, pk, v, causal, 1e-6, 9)[0])
    assert cache.chunk_size == 9
    g = np.ones_like(huge)
    for a, b in zip(scan.scan_backward(g, cache), scan.scan_backward(g, scan.scan_forward(pq, pk, v, causal, 1e-6, 9)[1])):
        np.testing.assert_array_equal(a, b)


def test_layers_and_gma_take_a_huge_chunk_size():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 5, 8))
    params = layers.init_multihead_gma(8, 2, 2, 4, 3, seed=0)
    np.testing.assert_array_equal(
        layers.multihead_gma(x, params, causal=True, chunk_size=10**12), layers.multihead_gma(x, params, causal=True, chunk_size=5)
    )


# ---------------------------------------------------------------------------
# gma_step: the decode form
# ---------------------------------------------------------------------------


def mixture(K=4, d_r=3, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(K, d_r)).astype(dtype)
    variances = rng.uniform(0.5, 2.0, size=(K, d_r)).astype(dtype)
    return means, variances, rng.dirichlet(np.ones(K)).astype(dtype)


def stream(n, d_r=3, d_v=2, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d_r)).astype(dtype), rng.normal(size=(n, d_r)).astype(dtype), rng.normal(size=(n, d_v)).astype(dtype)


def feed(pieces, x_q, x_k, v, means, variances, weights, state=None):
    outs, start = [], 0
    for length in pieces:
        sl = slice(start, start + length)
        out, state = gma.gma_step(x_q[sl], x_k[sl], v[sl], means, variances, weights, state=state)
        outs.append(out)
        start += length
    return np.concatenate(outs), state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pieces", [[1] * 17, [17], [5, 1, 11], [3, 3, 3, 8], [16, 1]], ids=str)
def test_a_stream_fed_in_pieces_is_causal_gma_on_the_whole(pieces, dtype):
    means, variances, weights = mixture(dtype=dtype)
    x_q, x_k, v = stream(sum(pieces), dtype=dtype)
    out, state = feed(pieces, x_q, x_k, v, means, variances, weights)
    want = gma.gma(x_q, x_k, v, means, variances, weights, causal=True, chunk_size=4)
    assert out.dtype == dtype and state.dtype == dtype
    np.testing.assert_allclose(out, want, rtol=RTOL[dtype], atol=RTOL[dtype])
    # the state holds the slot sums of every key: V~ = Gamma_K^T V, Z = Gamma_K^T 1
    gamma_k = gmm.responsibilities(x_k, means, variances, weights)
    np.testing.assert_allclose(state.slots, gamma_k.T @ v, rtol=RTOL[dtype], atol=RTOL[dtype])
    np.testing.assert_allclose(state.norms, gamma_k.sum(axis=0), rtol=RTOL[dtype])
    assert state.tokens_seen == sum(pieces)


def test_the_state_is_the_same_size_whatever_the_length():
    means, variances, weights = mixture(K=5)
    x_q, x_k, v = stream(400, d_v=7)
    short = gma.gma_step(x_q[:3], x_k[:3], v[:3], means, variances, weights)[1]
    long = gma.gma_step(x_q, x_k, v, means, variances, weights)[1]
    assert short.nbytes == long.nbytes == 5 * (7 + 1) * 8
    assert gma.GMAState.empty(5, 7).nbytes == short.nbytes


def test_a_float64_state_makes_the_step_float64():
    means, variances, weights = mixture(dtype=np.float32)
    x_q, x_k, v = stream(6, dtype=np.float32)
    state = gma.GMAState.empty(4, 2, np.float64)
    out, new = gma.gma_step(x_q, x_k, v, means, variances, weights, state=state)
    assert out.dtype == np.float64 and new.dtype == np.float64


def test_the_state_is_never_modified():
    means, variances, weights = mixture()
    x_q, x_k, v = stream(8)
    _, state = gma.gma_step(x_q[:4], x_k[:4], v[:4], means, variances, weights)
    slots = state.slots.copy()
    with pytest.raises(ValueError):
        state.slots[0, 0] = 1.0
    gma.gma_step(x_q[4:], x_k[4:], v[4:], means, variances, weights, state=state)
    np.testing.assert_array_equal(state.slots, slots)


STEP_ERRORS = [
    ("state of another K", dict(state=gma.GMAState.empty(3, 2)), ValueError, "state: holds K = 3 slots of d_v = 2, but the GMM has K = 4"),
    ("state of another d_v", dict(state=gma.GMAState.empty(4, 5)), ValueError, "and v has d_v = 2"),
    ("state not a GMAState", dict(state={"slots": 1}), TypeError, "state: expected a GMAState (or None), got dict"),
    ("batched queries", dict(x_q=np.ones((2, 5, 3)), x_k=np.ones((2, 5, 3)), v=np.ones((2, 5, 2))), ValueError, "x_q: gma_step streams one sequence of one head"),
    ("queries and keys of two lengths", dict(x_k=np.ones((4, 3)), v=np.ones((4, 2))), ValueError, "causal=True needs as many queries as keys"),
    ("eps < 0", dict(eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
]


@pytest.mark.parametrize("change, exc, fragment", [pytest.param(c, e, f, id=i) for i, c, e, f in STEP_ERRORS])
def test_bad_step_arguments_are_refused(change, exc, fragment):
    means, variances, weights = mixture()
    x_q, x_k, v = stream(5)
    args = {**dict(x_q=x_q, x_k=x_k, v=v, means=means, variances=variances, weights=weights), **change}
    with pytest.raises(exc) as info:
        gma.gma_step(**args)
    assert fragment in str(info.value)


STATE_ERRORS = [
    ("integer slots", dict(slots=np.ones((3, 2), int)), TypeError, "slots: expected a real floating-point array"),
    ("slots 1-D", dict(slots=np.ones(3)), ValueError, "slots: expected a 2-D array"),
    ("no slots", dict(slots=np.ones((0, 2)), norms=np.ones(0)), ValueError, "slots: expected shape (K, d_v) with K >= 1 and d_v >= 1"),
    ("norms of another K", dict(norms=np.ones(4)), ValueError, "norms: expected shape (K,) = (3,), got (4,)"),
    ("negative norm", dict(norms=np.array([1.0, -0.5, 2.0])), ValueError, "norms: expected nonnegative sums of responsibilities"),
    ("norms of another dtype", dict(norms=np.ones(3, np.float32)), TypeError, "norms: expected the dtype of slots (float64), got float32"),
    ("infinite slot", dict(slots=np.array([[1.0, np.inf], [0, 0], [0, 0]])), ValueError, "slots: expected finite values"),
    ("negative tokens_seen", dict(tokens_seen=-1), ValueError, "tokens_seen: expected an integer >= 0"),
    ("float tokens_seen", dict(tokens_seen=2.0), TypeError, "tokens_seen: expected an integer"),
]


@pytest.mark.parametrize("change, exc, fragment", [pytest.param(c, e, f, id=i) for i, c, e, f in STATE_ERRORS])
def test_bad_states_are_refused(change, exc, fragment):
    args = {**dict(slots=np.ones((3, 2)), norms=np.ones(3), tokens_seen=2), **change}
    with pytest.raises(exc) as info:
        gma.GMAState(**args)
    assert fragment in str(info.value)


def test_a_saved_state_loads_back_and_continues_the_stream(tmp_path):
    """Files themselves are tested in tests/test_state_files.py, with OVQState's; here, a loaded state continues the stream."""
    means, variances, weights = mixture()
    x_q, x_k, v = stream(12)
    _, state = gma.gma_step(x_q[:7], x_k[:7], v[:7], means, variances, weights)
    state.save(tmp_path / "s.npz")
    loaded = gma.GMAState.load(tmp_path / "s.npz")
    assert loaded.tokens_seen == 7 and repr(loaded) == "GMAState(K=4, d_v=2, tokens_seen=7, dtype=float64)"
    a = gma.gma_step(x_q[7:], x_k[7:], v[7:], means, variances, weights, state=loaded)
    b = gma.gma_step(x_q[7:], x_k[7:], v[7:], means, variances, weights, state=state)
    np.testing.assert_array_equal(a[0], b[0])
