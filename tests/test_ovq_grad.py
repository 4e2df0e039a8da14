"""OVQ backward (assignments held fixed) against central finite differences, float64; float32 against float64."""

import numpy as np
import pytest

from refimpl import ovq
from refimpl.gradcheck import numerical_gradient
from refimpl.testing import TOL, assignment_plan

H = 1e-6


def setup(seed, N, d, d_v):
    rng = np.random.default_rng(seed)
    inputs = {"q": rng.normal(size=(N, d)), "k": rng.normal(size=(N, d)), "v": rng.normal(size=(N, d_v))}
    return inputs, rng.normal(size=(N, d_v))


def finite_differences(inputs, G, name, kw):
    """Central differences of sum(G * out) in every entry of inputs[name], with the assignment plan checked unchanged."""
    _, cache = ovq.ovq_attention_forward(**inputs, **kw)
    base = assignment_plan(cache)

    def loss(a):
        out, c2 = ovq.ovq_attention_forward(**{**inputs, name: a}, **kw)
        # the gradient is defined with the assignments held fixed: the test point must not flip one
        assert np.array_equal(assignment_plan(c2), base), f"perturbing {name} changed an assignment"
        return np.sum(G * out)

    return numerical_gradient(loss, inputs[name], h=H)


CASES = [
    # (N, d, d_v, max_size, chunk_size, switches)
    (13, 3, 2, 5, 4, {}),  # N not a multiple of C
    (12, 3, 2, 4, 4, {"learning_rate": 0.2}),
    (10, 2, 3, 6, 3, {"count_bias": False, "growth": "linear"}),
    (11, 3, 2, 6, 3, {"init": "random", "seed": 4, "beta": 5.0}),
    (9, 2, 2, 4, 1, {}),  # chunk_size = 1
    (10, 3, 2, 1, 4, {}),  # max_size = 1: one centroid takes every key
    (1, 3, 2, 3, 4, {}),  # N = 1
]


@pytest.mark.parametrize("N, d, d_v, n_max, C, kw", CASES)
def test_backward_matches_central_differences(N, d, d_v, n_max, C, kw):
    inputs, G = setup(100 + N + n_max, N, d, d_v)
    kw = dict(kw, max_size=n_max, chunk_size=C)
    _, cache = ovq.ovq_attention_forward(**inputs, **kw)
    grads = ovq.ovq_attention_backward(G, cache)
    for name in ("q", "k", "v"):
        g = getattr(grads, name)
        assert g.shape == inputs[name].shape and g.dtype == np.float64
        np.testing.assert_allclose(g, finite_differences(inputs, G, name, kw), rtol=1e-6, atol=1e-8 * np.max(np.abs(g)))


def test_backward_with_an_incoming_state_treats_it_as_a_constant():
    inputs, G = setup(7, 20, 3, 2)
    _, st = ovq.ovq_attention(**inputs, max_size=6, chunk_size=4, return_state=True)
    later, G2 = setup(8, 10, 3, 2)
    kw = dict(max_size=6, chunk_size=4, state=st)
    _, cache = ovq.ovq_attention_forward(**later, **kw)
    grads = ovq.ovq_attention_backward(G2, cache)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(getattr(grads, name), finite_differences(later, G2, name, kw), rtol=1e-6, atol=1e-9)


def test_gradient_flows_through_the_dictionary_into_earlier_chunks():
    """The last chunk's output depends on the first chunk's keys and values only through D_k, D_v."""
    inputs, _ = setup(9, 16, 3, 2)
    G = np.zeros((16, 2))
    G[12:] = 1.0
    _, cache = ovq.ovq_attention_forward(**inputs, max_size=4, chunk_size=4)
    grads = ovq.ovq_attention_backward(G, cache)
    assert np.all(grads.q[:12] == 0)
    assert np.max(np.abs(grads.k[:4])) > 1e-4 and np.max(np.abs(grads.v[:4])) > 1e-4


def test_backward_returns_new_arrays_and_does_not_accumulate():
    inputs, G = setup(10, 14, 3, 2)
    _, cache = ovq.ovq_attention_forward(**inputs, max_size=5, chunk_size=4)
    a = ovq.ovq_attention_backward(G, cache)
    b = ovq.ovq_attention_backward(G, cache)
    for x, y in zip(a, b):
        assert np.array_equal(x, y) and x is not y


def test_float32_backward_against_float64():
    inputs, G = setup(11, 40, 5, 4)
    _, c64 = ovq.ovq_attention_forward(**inputs, max_size=8, chunk_size=6)
    inputs32 = {n: a.astype(np.float32) for n, a in inputs.items()}
    _, c32 = ovq.ovq_attention_forward(**inputs32, max_size=8, chunk_size=6)
    assert np.array_equal(assignment_plan(c64), assignment_plan(c32))
    g64 = ovq.ovq_attention_backward(G, c64)
    g32 = ovq.ovq_attention_backward(G.astype(np.float32), c32)
    for x, y in zip(g32, g64):
        assert x.dtype == np.float32
        np.testing.assert_allclose(x, y, rtol=TOL[np.float32]["rtol"], atol=TOL[np.float32]["atol"] * np.max(np.abs(y)))


def test_backward_validates_its_inputs():
    inputs, G = setup(12, 6, 3, 2)
    _, cache = ovq.ovq_attention_forward(**inputs, max_size=3, chunk_size=2)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(N, d_v\)"):
        ovq.ovq_attention_backward(G[:5], cache)
    with pytest.raises(ValueError, match="grad_out: expected finite values"):
        ovq.ovq_attention_backward(np.full_like(G, np.nan), cache)
    with pytest.raises(TypeError, match="cache: expected the OVQCache"):
        ovq.ovq_attention_backward(G, (1, 2))
