"""Values whose running mean would overflow are refused before any work, naming v; values just below the bound are exact.

OVQ's exact running mean and VQ's value means compute ``(c D + sum_S v) / (c + |S|)``,
whose numerator is at most ``tokens * max|v|``: below ``finfo.max`` nothing
can overflow, above it the result could be ``inf``.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpu.numba_cuda as nc
from refimpl import ovq

N, d = 12, 3


def _inputs(dtype, magnitude):
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, N, d)).astype(dtype)
    v = np.full((N, 2), magnitude, dtype=dtype)
    v[::2] *= -1
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("backend", [ovq, nc], ids=["refimpl", "numba_cuda"])
def test_the_bound_is_tight(backend, dtype):
    top = float(np.finfo(dtype).max)
    below = dtype(top / N * (1 - 1e-3 if dtype == np.float32 else 1 - 1e-12))
    above = dtype(top / N * (1 + 1e-3 if dtype == np.float32 else 1 + 1e-12))
    # the worst case, N values of one sign in one running mean: the sum fits just below the bound, not just above
    with np.errstate(over="ignore"):
        assert np.isfinite(np.sum(np.full(N, below, dtype=dtype))) and np.isinf(np.sum(np.full(N, above, dtype=dtype)))
    q, k, v = _inputs(dtype, below)
    out = backend.ovq_attention(q, k, v, max_size=4, chunk_size=N)
    assert np.all(np.isfinite(out))
    # every value has magnitude `below`: each output is a convex combination of +-below
    assert np.max(np.abs(out)) <= below
    q, k, v = _inputs(dtype, above)
    with pytest.raises(ValueError, match=rf"v: the running means of the values add up to {N} values before dividing"):
        backend.ovq_attention(q, k, v, max_size=4, chunk_size=N)
    with pytest.raises(ValueError, match="would overflow"):
        backend.vq_attention(q, k, v, np.eye(d, dtype=dtype), chunk_size=4)


def test_a_state_counts_its_tokens_and_its_values():
    q, k, v = _inputs(np.float64, 1.0)
    _, state = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=4, return_state=True)
    top = float(np.finfo(np.float64).max)
    # the stream holds 2 N tokens after the next call: values that fit N tokens do not fit 2 N
    q, k, v = _inputs(np.float64, top / N / 1.5)
    ovq.ovq_attention(q, k, v, max_size=4, chunk_size=4)
    with pytest.raises(ValueError, match=f"add up to {2 * N} values"):
        ovq.ovq_attention(q, k, v, max_size=4, chunk_size=4, state=state)
    # a state whose values are huge counts too, even with small new values
    big = ovq.OVQState(state.keys, np.full(state.values.shape, top / N), state.counts, state.size, state.tokens_seen)
    with pytest.raises(ValueError, match="with magnitudes up to"):
        ovq.ovq_attention(q[:1], k[:1], np.ones((1, 2)), max_size=4, chunk_size=4, state=big)


def test_float32_points_to_float64():
    q, k, v = _inputs(np.float32, 1e38)
    with pytest.raises(ValueError, match="rescale v, or compute in float64"):
        ovq.ovq_attention(q, k, v, max_size=4, chunk_size=N)
