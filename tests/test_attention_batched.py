"""refimpl.attention.softmax_attention with leading batch (and head) dimensions.

A batch is a loop over its ``(N, d)`` slices: each slice's output is the 2-D
function's, bit for bit; the 2-D path itself is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import attention


def qkv(batch, N_q=5, N_k=5, d=3, d_v=2, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", [(2,), (2, 3), (1, 1, 2)])
def test_every_slice_is_the_2d_result_bit_for_bit(batch, causal):
    q, k, v = qkv(batch, N_q=6, N_k=6 if causal else 4)
    out = attention.softmax_attention(q, k, v, scale=0.7, causal=causal)
    assert out.shape == batch + (6, 2)
    for idx in np.ndindex(*batch):
        np.testing.assert_array_equal(out[idx], attention.softmax_attention(q[idx], k[idx], v[idx], scale=0.7, causal=causal))


def test_the_2d_path_is_the_forward():
    q, k, v = qkv(())
    np.testing.assert_array_equal(attention.softmax_attention(q, k, v), attention.softmax_attention_forward(q, k, v)[0])


def test_float32_stays_float32_and_the_default_scale_uses_d():
    q, k, v = qkv((2,), d=4, dtype=np.float32)
    out = attention.softmax_attention(q, k, v)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[1], attention.softmax_attention(q[1], k[1], v[1], scale=0.5))


def test_an_empty_batch_gives_an_empty_result():
    q, k, v = qkv((0, 3))
    assert attention.softmax_attention(q, k, v).shape == (0, 3, 5, 2)


@pytest.mark.parametrize(
    "shapes",
    [((2, 5, 3), (3, 5, 3), (2, 5, 2)), ((2, 5, 3), (5, 3), (5, 2)), ((2, 5, 3), (2, 5, 3), (2, 1, 5, 2)), ((5,), (2, 5, 3), (2, 5, 2))],
    ids=["leading sizes differ", "q batched, k and v not", "v with an extra axis", "q 1-D"],
)
def test_bad_batch_shapes_are_refused_naming_the_arguments(shapes):
    q, k, v = (np.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=r"^q, k, v: expected arrays with the same leading \(batch\) dimensions, each at least a 2-D array"):
        attention.softmax_attention(q, k, v)


def test_slice_shapes_and_values_get_the_2d_messages():
    q, k, v = qkv((2,))
    with pytest.raises(ValueError, match=r"k: expected shape \(N_k, d\) = \(\*, 3\), got \(5, 4\)"):
        attention.softmax_attention(q, np.ones((2, 5, 4)), v)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        attention.softmax_attention(q[:, :3], k, v, causal=True)
    bad = q.copy()
    bad[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match=r"q: expected finite values, got 1 non-finite entry \(first at index \(1, 2, 0\)"):
        attention.softmax_attention(bad, k, v)
    with pytest.raises(TypeError, match="q: expected a real floating-point array"):
        attention.softmax_attention(q.astype(int), k, v)
    with pytest.raises(ValueError, match="scale: expected a finite number > 0"):
        attention.softmax_attention(q, k, v, scale=0.0)


def test_overflowed_rows_are_counted_over_the_whole_batch():
    q, k, v = qkv((2, 2), N_q=3, N_k=3)
    q[1, 0, 2] = 1e300  # query 2 of sequence (1, 0): flat row (1 * 2 + 0) * 3 + 2 = 8; its scores are 3e600 = inf
    k[1, 0] = 1e300
    with np.errstate(over="ignore", invalid="ignore"):
        with pytest.raises(ValueError, match=r"^scale, q, k: the logits of 1 row\(s\) \(first: row 8\) overflow float64"):
            attention.softmax_attention(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_the_forward_and_backward_of_a_batch_are_the_2d_ones_bit_for_bit(batch, causal):
    """softmax_attention_forward/backward and linear_attention_forward/backward: each slice as on its own."""
    q, k, v = qkv(batch, N_q=6, N_k=6 if causal else 4, seed=3)
    g = np.random.default_rng(4).normal(size=batch + (6, 2))
    calls = [
        (lambda q, k, v: attention.softmax_attention_forward(q, k, v, scale=0.7, causal=causal), attention.softmax_attention_backward),
        (lambda q, k, v: attention.linear_attention_forward(q, k, v, causal=causal, chunk_size=4), attention.linear_attention_backward),
    ]
    for forward, backward in calls:
        out, cache = forward(q, k, v)
        grads = backward(g, cache)
        assert out.shape == batch + (6, 2) and [a.shape for a in grads] == [q.shape, k.shape, v.shape]
        for idx in np.ndindex(*batch):
            out_1, cache_1 = forward(q[idx], k[idx], v[idx])
            np.testing.assert_array_equal(out[idx], out_1)
            for got, want in zip(grads, backward(g[idx], cache_1), strict=True):
                np.testing.assert_array_equal(got[idx], want)


def test_a_linear_attention_batch_counts_zero_denominators_over_all_sequences():
    """eps = 0 and features that underflow in sequence (1, 0) only: its rows are rows 6.. of the batch, in C order."""
    q, k, v = qkv((2, 2), N_q=3, N_k=3)
    q[1, 0], k[1, 0] = -1000.0, -1000.0  # exp(-1000) = 0: every denominator of that sequence is 0
    with pytest.raises(ValueError, match=r"^eps: with eps = 0 the denominator of query row 6 is 0.0 "):
        attention.linear_attention(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match=r"^q, k, v: expected at least one sequence, got leading \(batch\) dimensions \(0, 2\)$"):
        attention.linear_attention_forward(*qkv((0, 2)))
