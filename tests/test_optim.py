"""app.optim: AdamW against a hand-computed example and a loop implementation, clipping, decay, purity, errors."""

import math

import numpy as np
import pytest

from app import optim


def test_two_steps_by_hand():
    """One scalar decayed ("x.W") and one not ("x.b"), gradients 0.5 then -0.25, lr 0.1, decay 0.1."""
    params = {"x.W": np.array([1.0]), "x.b": np.array([1.0])}
    state = optim.adam_init(params)
    kw = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    p1, s1, n1 = optim.adam_step(params, {"x.W": np.array([0.5]), "x.b": np.array([0.5])}, state, **kw)
    # step 1: m = 0.1 * 0.5 = 0.05, v = 0.001 * 0.25 = 0.00025; m_hat = 0.05 / 0.1 = 0.5, v_hat = 0.00025 / 0.001 = 0.25
    assert s1.step == 1 and n1 == pytest.approx(math.sqrt(0.5), rel=1e-15)
    assert s1.m["x.W"][0] == pytest.approx(0.05, rel=1e-15) and s1.v["x.W"][0] == pytest.approx(0.00025, rel=1e-15)
    assert p1["x.b"][0] == pytest.approx(1 - 0.1 * 0.5 / (0.5 + 1e-8), rel=1e-15)
    assert p1["x.W"][0] == pytest.approx(1 - 0.1 * (0.5 / (0.5 + 1e-8) + 0.1 * 1.0), rel=1e-15)
    p2, s2, _ = optim.adam_step(p1, {"x.W": np.array([-0.25]), "x.b": np.array([-0.25])}, s1, **kw)
    # step 2: m = 0.9 * 0.05 - 0.1 * 0.25 = 0.02, v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225,
    # m_hat = 0.02 / (1 - 0.81) = 0.02 / 0.19, v_hat = 0.00031225 / (1 - 0.998001) = 0.00031225 / 0.001999
    step2 = (0.02 / 0.19) / (math.sqrt(0.00031225 / 0.001999) + 1e-8)
    assert s2.step == 2
    assert s2.m["x.b"][0] == pytest.approx(0.02, rel=1e-14) and s2.v["x.b"][0] == pytest.approx(0.00031225, rel=1e-14)
    assert p2["x.b"][0] == pytest.approx(p1["x.b"][0] - 0.1 * step2, rel=1e-14)
    assert p2["x.W"][0] == pytest.approx(p1["x.W"][0] - 0.1 * (step2 + 0.1 * p1["x.W"][0]), rel=1e-14)
    # in round numbers: p1 = 1 - 0.1 (1 + 0.1) = 0.89, p2 = 0.89 - 0.1 (0.266335 + 0.1 * 0.89) = 0.8544665
    assert p2["x.W"][0] == pytest.approx(0.8544665, abs=1e-6)


def loop_adamw(params, grads_seq, lr, beta1, beta2, eps, weight_decay, clip_norm):
    """AdamW entry by entry in Python floats, straight from the definition."""
    p = {k: [float(x) for x in a.ravel()] for k, a in params.items()}
    m = {k: [0.0] * len(v) for k, v in p.items()}
    v = {k: [0.0] * len(x) for k, x in p.items()}
    norms = []
    for t, grads in enumerate(grads_seq, start=1):
        g = {k: [float(x) for x in a.ravel()] for k, a in grads.items()}
        norm = math.sqrt(sum(x * x for k in g for x in g[k]))
        norms.append(norm)
        if clip_norm is not None and norm > clip_norm:
            g = {k: [x * clip_norm / norm for x in g[k]] for k in g}
        for k in p:
            for i in range(len(p[k])):
                m[k][i] = beta1 * m[k][i] + (1 - beta1) * g[k][i]
                v[k][i] = beta2 * v[k][i] + (1 - beta2) * g[k][i] ** 2
                mhat = m[k][i] / (1 - beta1**t)
                vhat = v[k][i] / (1 - beta2**t)
                decay = weight_decay * p[k][i] if k.split(".")[-1].startswith("W") else 0.0
                p[k][i] -= lr * (mhat / (math.sqrt(vhat) + eps) + decay)
    return {k: np.array(x).reshape(params[k].shape) for k, x in p.items()}, norms


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_against_a_loop_implementation(clip_norm):
    rng = np.random.default_rng(0)
    shapes = {"embed": (4, 3), "layer0.mixer.W_q": (3, 2), "layer0.mixer.means": (2, 2, 2), "head.W": (3, 2), "head.b": (2,)}
    params = {k: rng.normal(size=s) for k, s in shapes.items()}
    grads_seq = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(5)]
    kw = dict(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.3, clip_norm=clip_norm)
    expected, norms = loop_adamw(params, grads_seq, **kw)
    p, state = params, optim.adam_init(params)
    for g, norm in zip(grads_seq, norms):
        p, state, n = optim.adam_step(p, g, state, **kw)
        assert n == pytest.approx(norm, rel=1e-14)
    assert state.step == 5
    for k in shapes:
        np.testing.assert_allclose(p[k], expected[k], rtol=1e-13, atol=1e-14, err_msg=k)


def test_clipping_returns_the_norm_before_and_feeds_the_clipped_gradient():
    rng = np.random.default_rng(1)
    params = {"a.W": rng.normal(size=(3, 4)), "a.b": rng.normal(size=4)}
    grads = {k: 10 * rng.normal(size=a.shape) for k, a in params.items()}
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    assert optim.global_norm(grads) == pytest.approx(norm, rel=1e-15)
    _, state, n = optim.adam_step(params, grads, optim.adam_init(params), lr=0.1, beta1=0.9, clip_norm=1.0)
    assert n == pytest.approx(norm, rel=1e-15) and norm > 1.0
    # first step: m = (1 - beta1) g_clipped, and the clipped gradient has norm clip_norm, in the same direction
    m_norm = math.sqrt(sum(float(np.sum(a * a)) for a in state.m.values()))
    assert m_norm == pytest.approx(0.1 * 1.0, rel=1e-14)
    np.testing.assert_allclose(state.m["a.W"], 0.1 * grads["a.W"] / norm, rtol=1e-14)
    # a norm below clip_norm is left alone
    _, s_big, n_big = optim.adam_step(params, grads, optim.adam_init(params), lr=0.1, clip_norm=2 * norm)
    _, s_none, _ = optim.adam_step(params, grads, optim.adam_init(params), lr=0.1)
    assert n_big == n
    for k in params:
        np.testing.assert_array_equal(s_big.m[k], s_none.m[k])


def test_weight_decay_applies_to_the_weight_matrices_only():
    names = ["embed", "pos", "layer0.ln1.gain", "layer0.ln1.bias", "layer0.mixer.W_q", "layer0.mixer.W_o",
             "layer0.mixer.means", "layer0.mixer.raw_variances", "layer0.mixer.logits", "layer0.mlp.W1", "layer0.mlp.b1",
             "layer0.mlp.W2", "ln_f.gain", "head.W", "head.b"]
    decayed = {"layer0.mixer.W_q", "layer0.mixer.W_o", "layer0.mlp.W1", "layer0.mlp.W2", "head.W"}
    assert {n for n in names if optim.decays(n)} == decayed
    # with zero gradients the moments stay 0 and only the decay moves a parameter: theta (1 - lr lambda)
    params = {n: np.full(3, 2.0) for n in names}
    zeros = {n: np.zeros(3) for n in names}
    new, _, _ = optim.adam_step(params, zeros, optim.adam_init(params), lr=0.1, weight_decay=0.5)
    for n in names:
        np.testing.assert_allclose(new[n], 2.0 * (1 - 0.05) if n in decayed else 2.0, rtol=1e-15, err_msg=n)


def test_pure_and_deterministic():
    rng = np.random.default_rng(2)
    params = {"a.W": rng.normal(size=(2, 3)), "a.b": rng.normal(size=3)}
    grads = {k: rng.normal(size=a.shape) for k, a in params.items()}
    state = optim.adam_init(params)
    state = optim.adam_step(params, grads, state, lr=0.1)[1]
    copies = [{k: a.copy() for k, a in d.items()} for d in (params, grads, state.m, state.v)]
    r1 = optim.adam_step(params, grads, state, lr=0.1, weight_decay=0.1, clip_norm=0.5)
    r2 = optim.adam_step(params, grads, state, lr=0.1, weight_decay=0.1, clip_norm=0.5)
    for d, c in zip((params, grads, state.m, state.v), copies):
        for k in d:
            np.testing.assert_array_equal(d[k], c[k])
    assert state.step == 1 and r1[1].step == 2
    for a, b in ((r1[0], r2[0]), (r1[1].m, r2[1].m), (r1[1].v, r2[1].v)):
        assert list(a) == list(params)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
            assert a[k] is not params[k]
    f32 = {k: a.astype(np.float32) for k, a in params.items()}
    out = optim.adam_step(f32, grads, optim.adam_init(f32), lr=0.1)[0]
    assert all(a.dtype == np.float32 for a in out.values())


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(lr=0.0), ValueError, "lr: expected a finite number > 0"),
    (dict(lr="0.1"), TypeError, "lr: expected a real number"),
    (dict(lr=0.1, beta1=1.0), ValueError, r"beta1: expected a number in \[0, 1\)"),
    (dict(lr=0.1, beta2=-0.1), ValueError, "beta2: expected a finite number >= 0"),
    (dict(lr=0.1, eps=0.0), ValueError, "eps: expected a finite number > 0"),
    (dict(lr=0.1, weight_decay=-1.0), ValueError, "weight_decay: expected a finite number >= 0"),
    (dict(lr=0.1, clip_norm=0.0), ValueError, "clip_norm: expected a finite number > 0"),
    (dict(lr=np.inf), ValueError, "lr: expected a finite number > 0"),
])
def test_bad_options_name_the_argument(kw, exc, fragment):
    params = {"a.W": np.ones((2, 2))}
    with pytest.raises(exc, match=fragment):
        optim.adam_step(params, {"a.W": np.ones((2, 2))}, optim.adam_init(params), **kw)


def test_bad_arrays_name_the_argument():
    params = {"a.W": np.ones((2, 2)), "a.b": np.ones(2)}
    state = optim.adam_init(params)
    grads = {"a.W": np.ones((2, 2)), "a.b": np.ones(2)}
    with pytest.raises(ValueError, match=r"grads: expected the keys of params, in order; missing \['a.b'\]"):
        optim.adam_step(params, {"a.W": grads["a.W"]}, state, lr=0.1)
    with pytest.raises(ValueError, match=r"grads: expected the keys of params, in order; missing \[\], unexpected \['c.W'\]"):
        optim.adam_step(params, {**grads, "c.W": np.ones(2)}, state, lr=0.1)
    with pytest.raises(ValueError, match=r"grads: expected the keys of params, in order"):
        optim.adam_step(params, {"a.b": grads["a.b"], "a.W": grads["a.W"]}, state, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\['a.b'\]: expected shape"):
        optim.adam_step(params, {**grads, "a.b": np.ones(3)}, state, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\['a.W'\]: expected finite values"):
        optim.adam_step(params, {**grads, "a.W": np.full((2, 2), np.nan)}, state, lr=0.1)
    with pytest.raises(TypeError, match="state: expected an AdamState"):
        optim.adam_step(params, grads, (0, {}, {}), lr=0.1)
    with pytest.raises(ValueError, match=r"state.m: expected the keys of params"):
        optim.adam_step(params, grads, optim.adam_init({"a.W": params["a.W"]}), lr=0.1)
    with pytest.raises(ValueError, match="state.step: expected an integer >= 0"):
        optim.adam_step(params, grads, state._replace(step=-1), lr=0.1)
    with pytest.raises(ValueError, match="state.v: expected nonnegative"):
        optim.adam_step(params, grads, state._replace(v={k: -np.ones_like(a) for k, a in params.items()}), lr=0.1)
    with pytest.raises(TypeError, match="params: expected a dict"):
        optim.adam_init([np.ones(2)])


# ----------------------------------------------------------------------------- the overflow edge

# float64: squares overflow above 1.34e154; float32: above 1.84e19 (and a float32 sum of squares far sooner)
EDGE = {np.float64: (1e160, np.finfo(np.float64).max / 4), np.float32: (1e20, np.finfo(np.float32).max / 4)}


def edge_grads(dtype, scale):
    rng = np.random.default_rng(7)
    grads = {"a.W": rng.normal(size=(3, 4)), "a.b": rng.normal(size=4), "c.W": rng.normal(size=(2, 2))}
    top = max(float(np.max(np.abs(g))) for g in grads.values())
    return {k: (g / top * scale).astype(dtype) for k, g in grads.items()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_global_norm_of_gradients_at_the_overflow_edge_is_their_norm(dtype):
    for scale in EDGE[dtype]:
        grads = edge_grads(dtype, scale)
        values = [float(x) for g in grads.values() for x in g.ravel()]
        expected = math.hypot(*values)  # scaled by its own algorithm: no overflow
        assert math.isfinite(expected)
        assert optim.global_norm(grads) == pytest.approx(expected, rel=1e-13 if dtype == np.float64 else 1e-6), scale


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clipping_at_the_overflow_edge_is_clipping_of_the_same_direction(dtype):
    """Clipping is scale-free: gradients c g with ||c g|| > clip give the step of g scaled to the same norm."""
    params = {k: np.ones_like(g) for k, g in edge_grads(dtype, 1.0).items()}
    for scale in EDGE[dtype]:
        grads = edge_grads(dtype, scale)
        moderate = {k: (g.astype(np.float64) / scale * 1e3).astype(dtype) for k, g in grads.items()}  # ||.|| > 1 as well
        got = optim.adam_step(params, grads, optim.adam_init(params), lr=0.1, clip_norm=1.0, weight_decay=0.1)
        ref = optim.adam_step(params, moderate, optim.adam_init(params), lr=0.1, clip_norm=1.0, weight_decay=0.1)
        tol = 1e-12 if dtype == np.float64 else 1e-5
        assert got[2] == pytest.approx(optim.global_norm(grads), rel=1e-15)
        for k in params:
            np.testing.assert_allclose(got[1].m[k], ref[1].m[k], rtol=tol, err_msg=k)  # m = (1 - beta1) g clip / ||g||
            np.testing.assert_allclose(got[1].v[k], ref[1].v[k], rtol=2 * tol, err_msg=k)
            np.testing.assert_allclose(got[0][k], ref[0][k], rtol=tol, err_msg=k)
        assert all(np.all(np.isfinite(v)) and np.any(v > 0) for v in got[1].v.values())


def test_clipping_by_a_power_of_two_changes_no_bit():
    params = {k: np.ones_like(g) for k, g in edge_grads(np.float64, 1.0).items()}
    grads = edge_grads(np.float64, 3.0)
    ref = optim.adam_step(params, grads, optim.adam_init(params), lr=0.1, clip_norm=1.0)
    big = {k: g * 2.0**600 for k, g in grads.items()}
    got = optim.adam_step(params, big, optim.adam_init(params), lr=0.1, clip_norm=1.0)
    assert got[2] == ref[2] * 2.0**600
    for k in params:
        np.testing.assert_array_equal(got[0][k], ref[0][k])
        np.testing.assert_array_equal(got[1].v[k], ref[1].v[k])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_unclipped_gradients_whose_squares_overflow_are_refused_not_stored(dtype):
    grads = edge_grads(dtype, EDGE[dtype][0])
    params = {k: np.ones_like(g) for k, g in grads.items()}
    state = optim.adam_init(params)
    with pytest.raises(ValueError, match=rf"grads\['a.W'\]: expected entries whose squares fit {np.dtype(dtype).name}"):
        optim.adam_step(params, grads, state, lr=0.1)
    # below the edge they are taken, and v stays finite
    fine = {k: g / dtype(EDGE[dtype][0]) * dtype(1e150 if dtype == np.float64 else 1e18) for k, g in grads.items()}
    _, new, _ = optim.adam_step(params, fine, state, lr=0.1)
    assert all(np.all(np.isfinite(v)) for v in new.v.values())
    # a clip below the edge makes them safe
    _, clipped, _ = optim.adam_step(params, grads, state, lr=0.1, clip_norm=1e3)
    assert all(np.all(np.isfinite(v)) for v in clipped.v.values())


def test_the_bias_corrections_use_the_step_number_of_the_state():
    """One zero-gradient step from a state with moments: the corrections 1 - beta^t take t = state.step + 1."""
    params = {"a.b": np.array([0.0])}
    state = optim.AdamState(4, {"a.b": np.array([0.2])}, {"a.b": np.array([0.09])})
    new, s, _ = optim.adam_step(params, {"a.b": np.array([0.0])}, state, lr=1.0, beta1=0.5, beta2=0.75, eps=1e-8)
    m, v = 0.5 * 0.2, 0.75 * 0.09  # the moments decay by beta
    expected = -(m / (1 - 0.5**5)) / (math.sqrt(v / (1 - 0.75**5)) + 1e-8)
    assert s.step == 5 and new["a.b"][0] == pytest.approx(expected, rel=1e-15)
