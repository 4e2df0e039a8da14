"""app.model: every piece and the whole model against central differences, determinism, causality, errors."""

import numpy as np
import pytest
from scipy import special

from refimpl import gmm
from app import layers
from app import model as M
from refimpl.testing import GRAD_TOL

H_STEP = 1e-6
B, N, D, HEADS, K = 2, 5, 8, 2, 3


def config(mixer="gma", head="classify", causal=None, **kw):
    causal = head == "lm" if causal is None else causal
    base = dict(vocab_size=7, max_len=6, d_model=D, n_heads=HEADS, mixer=mixer, causal=causal, head=head, n_classes=3,
                n_components=K, d_route=2, mlp_hidden=6, ovq_max_size=3, ovq_chunk_size=2)
    return M.ModelConfig(**{**base, **kw})


def perturbed_params(c, seed=1, scale=0.3):
    """init_params moved off its symmetric start (gains 1, biases 0, uniform GMM weights)."""
    rng = np.random.default_rng(seed + 100)
    return {n: a + scale * rng.normal(size=a.shape) for n, a in M.init_params(c, seed).items()}


def tokens_for(c, seed=0, pads=True):
    rng = np.random.default_rng(seed)
    t = rng.integers(1, c.vocab_size, size=(B, N))
    if pads:
        t[0, -2:] = c.pad_id  # a padded sequence
    return t


def assert_matches_fd(loss, arrays, analytic, subset=None, seed=0):
    """Central differences of ``loss(arrays)`` against ``analytic``, array by array.

    ``subset``: check that many random entries of each array (all when None);
    then one random direction over every entry at once.
    """
    rng = np.random.default_rng(seed)
    for name, a in arrays.items():
        g = analytic[name]
        assert g.shape == a.shape and g.dtype == a.dtype, name
        idx = list(np.ndindex(a.shape))
        if subset is not None and len(idx) > subset:
            idx = [idx[i] for i in rng.choice(len(idx), subset, replace=False)]
        scale = max(1.0, float(np.max(np.abs(g))))
        for i in idx:
            plus, minus = a.copy(), a.copy()
            plus[i] += H_STEP
            minus[i] -= H_STEP
            fd = (loss({**arrays, name: plus}) - loss({**arrays, name: minus})) / (2 * H_STEP)
            np.testing.assert_allclose(g[i], fd, rtol=GRAD_TOL["rtol"], atol=GRAD_TOL["atol"] * scale, err_msg=f"{name}{i}")
    # one direction u over every entry: d/ds loss(arrays + s u) = <grad, u>
    u = {n: rng.normal(size=a.shape) for n, a in arrays.items()}
    fd = (loss({n: a + H_STEP * u[n] for n, a in arrays.items()}) - loss({n: a - H_STEP * u[n] for n, a in arrays.items()})) / (2 * H_STEP)
    exact = sum(float(np.sum(analytic[n] * u[n])) for n in arrays)
    norm = np.sqrt(sum(float(np.sum(analytic[n] ** 2)) for n in arrays) * sum(float(np.sum(u[n] ** 2)) for n in arrays))
    assert abs(fd - exact) <= 1e-6 * max(1.0, norm), (fd, exact)


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


def test_embedding_backward_scatter_adds_repeated_tokens():
    rng = np.random.default_rng(0)
    tokens = np.array([[1, 3, 1, 1, 0], [3, 3, 2, 6, 1]])  # repeats within and across sequences; 4 and 5 unused
    E = rng.normal(size=(7, D))
    G = rng.normal(size=(B, N, D))
    x, cache = M.embedding_forward(tokens, E)
    np.testing.assert_array_equal(x, E[tokens])
    dE = M.embedding_backward(G, cache)
    assert_matches_fd(lambda a: np.sum(G * M.embedding_forward(tokens, a["E"])[0]), {"E": E}, {"E": dE})
    np.testing.assert_array_equal(dE[[4, 5]], 0.0)


def test_positional_embedding_backward_sums_over_the_batch_and_leaves_later_positions():
    rng = np.random.default_rng(1)
    x, P, G = rng.normal(size=(B, N, D)), rng.normal(size=(N + 3, D)), rng.normal(size=(B, N, D))
    y, cache = M.positional_forward(x, P)
    np.testing.assert_array_equal(y, x + P[:N])
    dx, dP = M.positional_backward(G, cache)
    assert_matches_fd(lambda a: np.sum(G * M.positional_forward(a["x"], a["P"])[0]), {"x": x, "P": P}, {"x": dx, "P": dP})
    np.testing.assert_array_equal(dP[N:], 0.0)


def test_layer_norm_forward_and_backward():
    rng = np.random.default_rng(2)
    x, gain, bias, G = 3 + 2 * rng.normal(size=(B, N, D)), rng.normal(size=D), rng.normal(size=D), rng.normal(size=(B, N, D))
    y, cache = M.layer_norm_forward(x, gain, bias)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + M.LN_EPS)
    np.testing.assert_allclose(y, gain * xhat + bias, rtol=1e-12, atol=1e-12)
    dx, dg, db = M.layer_norm_backward(G, cache)

    def loss(a):
        return np.sum(G * M.layer_norm_forward(a["x"], a["gain"], a["bias"])[0])

    assert_matches_fd(loss, {"x": x, "gain": gain, "bias": bias}, {"x": dx, "gain": dg, "bias": db})


def test_gelu_is_the_tanh_form_and_its_derivative():
    h = np.linspace(-6, 6, 41)
    np.testing.assert_allclose(M.gelu(h), 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))), rtol=1e-15)
    # the tanh form is within 1e-3 of the exact h Phi(h)
    np.testing.assert_allclose(M.gelu(h), h * special.ndtr(h), atol=1e-3)
    fd = (M.gelu(h + H_STEP) - M.gelu(h - H_STEP)) / (2 * H_STEP)
    np.testing.assert_allclose(M.gelu_derivative(h), fd, rtol=1e-7, atol=1e-9)


def test_mlp_backward():
    rng = np.random.default_rng(3)
    x, G = rng.normal(size=(B, N, D)), rng.normal(size=(B, N, D))
    p = {"W1": rng.normal(size=(D, 6)), "b1": rng.normal(size=6), "W2": rng.normal(size=(6, D)), "b2": rng.normal(size=D)}
    y, cache = M.mlp_forward(x, p)
    np.testing.assert_allclose(y, M.gelu(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"], rtol=1e-14)
    dx, grads = M.mlp_backward(G, cache)

    def loss(a):
        return np.sum(G * M.mlp_forward(a["x"], {k: a[k] for k in p})[0])

    assert_matches_fd(loss, {"x": x, **p}, {"x": dx, **grads})


BLOCKS = [("gma", False), ("gma", True), ("softmax", False), ("softmax", True), ("linear", False), ("linear", True), ("ovq", False)]


@pytest.mark.parametrize("mixer,causal", BLOCKS)
def test_each_mixer_in_a_pre_norm_residual_block(mixer, causal):
    c = M.check_config(config(mixer, causal=causal))
    params = {k[len("layer0."):]: a for k, a in perturbed_params(c, seed=4).items() if k.startswith("layer0.")}
    rng = np.random.default_rng(5)
    x, G = rng.normal(size=(B, N, D)), rng.normal(size=(B, N, D))
    y, cache = M.block_forward(x, params, c)
    dx, grads = M.block_backward(G, cache)
    assert set(grads) == set(params)

    def loss(a):
        return np.sum(G * M.block_forward(a["x"], {k: a[k] for k in params}, c)[0])

    # every entry of the mixer; a sample of the input, the layer norms and the MLP
    mixer_part = {k: a for k, a in params.items() if k.startswith("mixer.")}
    arrays = {"x": x, **params}
    full = {"x", *mixer_part}

    def loss_full(a):
        return loss({**arrays, **a})

    assert_matches_fd(loss_full, {k: arrays[k] for k in full - {"x"}}, grads)
    assert_matches_fd(loss_full, {k: arrays[k] for k in arrays if k not in full - {"x"}}, {"x": dx, **grads}, subset=12)


def per_head_reference(x, p, c):
    """Slice the projections head by head and call the public single-head functions on each sequence."""
    from refimpl import attention, ovq

    Hn, dh = c.n_heads, c.d_model // c.n_heads
    calls = {
        "softmax": lambda q, k, v: attention.softmax_attention(q, k, v, causal=c.causal),
        "linear": lambda q, k, v: attention.linear_attention(q, k, v, causal=c.causal),
        "ovq": lambda q, k, v: ovq.ovq_attention(q, k, v, max_size=c.ovq_max_size, chunk_size=c.ovq_chunk_size),
    }
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        cols = [slice(h * dh, (h + 1) * dh) for h in range(Hn)]
        heads = [calls[c.mixer](x[b] @ p["W_q"][:, s], x[b] @ p["W_k"][:, s], x[b] @ p["W_v"][:, s]) for s in cols]
        out[b] = np.concatenate(heads, axis=1) @ p["W_o"]
    return out


@pytest.mark.parametrize("mixer,causal", BLOCKS)
def test_mixer_forward_is_the_per_head_composition(mixer, causal):
    c = M.check_config(config(mixer, causal=causal, ovq_max_size=2))
    p = {k[len("layer0.mixer."):]: a for k, a in perturbed_params(c, seed=40).items() if k.startswith("layer0.mixer.")}
    x = np.random.default_rng(41).normal(size=(B, 7, D))
    y, _ = M.mixer_forward(x, p, c)
    if mixer == "gma":
        ref = layers.multihead_gma(x, layers.MultiheadGMAParams(**p), causal=causal)
    else:
        ref = per_head_reference(x, p, c)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-13)


def test_residual_identity_path():
    """With the mixer's and the MLP's output projections at zero, the block is the identity and dx = dy."""
    c = M.check_config(config("softmax"))
    params = {k[len("layer0."):]: a for k, a in M.init_params(c, 0).items() if k.startswith("layer0.")}
    params["mixer.W_o"] = np.zeros_like(params["mixer.W_o"])
    params["mlp.W2"] = np.zeros_like(params["mlp.W2"])
    params["mlp.b2"] = np.zeros_like(params["mlp.b2"])
    x = np.random.default_rng(7).normal(size=(B, N, D))
    y, cache = M.block_forward(x, params, c)
    np.testing.assert_array_equal(y, x)
    G = np.random.default_rng(8).normal(size=(B, N, D))
    np.testing.assert_array_equal(M.block_backward(G, cache)[0], G)


@pytest.mark.parametrize("mixer", ["gma", "softmax", "linear"])
def test_bidirectional_mixers_read_the_future(mixer):
    c = M.check_config(config(mixer, causal=False))
    params = {k[len("layer0.mixer."):]: a for k, a in M.init_params(c, 0).items() if k.startswith("layer0.mixer.")}
    x = np.random.default_rng(9).normal(size=(B, N, D))
    later = x.copy()
    later[:, -1] += 1.0
    assert not np.allclose(M.mixer_forward(x, params, c)[0][:, 0], M.mixer_forward(later, params, c)[0][:, 0])


@pytest.mark.parametrize("mixer,causal", [("gma", True), ("softmax", True), ("linear", True), ("ovq", True), ("ovq", False)])
def test_causal_mixers_and_ovq_always_see_only_the_past(mixer, causal):
    c = M.check_config(config(mixer, causal=causal))
    params = {k[len("layer0.mixer."):]: a for k, a in M.init_params(c, 0).items() if k.startswith("layer0.mixer.")}
    x = np.random.default_rng(10).normal(size=(B, N, D))
    later = x.copy()
    later[:, 3:] = np.random.default_rng(11).normal(size=later[:, 3:].shape)
    np.testing.assert_array_equal(M.mixer_forward(x, params, c)[0][:, :3], M.mixer_forward(later, params, c)[0][:, :3])


def test_classify_head_pools_the_non_pad_tokens_only():
    rng = np.random.default_rng(12)
    tokens = np.array([[3, 4, 0, 0, 0], [0, 0, 0, 0, 0]])  # the second sequence is all padding
    x, W, b, G = rng.normal(size=(B, N, D)), rng.normal(size=(D, 3)), rng.normal(size=3), rng.normal(size=(B, 3))
    logits, cache = M.classify_head_forward(x, tokens, W, b, 0)
    np.testing.assert_allclose(logits[0], x[0, :2].mean(axis=0) @ W + b, rtol=1e-14)
    np.testing.assert_array_equal(logits[1], b)
    dx, dW, db = M.classify_head_backward(G, cache)

    def loss(a):
        return np.sum(G * M.classify_head_forward(a["x"], tokens, a["W"], a["b"], 0)[0])

    assert_matches_fd(loss, {"x": x, "W": W, "b": b}, {"x": dx, "W": dW, "b": db})
    np.testing.assert_array_equal(dx[0, 2:], 0.0)
    np.testing.assert_array_equal(dx[1], 0.0)


def test_lm_head_backward():
    rng = np.random.default_rng(13)
    x, W, b, G = rng.normal(size=(B, N, D)), rng.normal(size=(D, 7)), rng.normal(size=7), rng.normal(size=(B, N, 7))
    _, cache = M.lm_head_forward(x, W, b)
    dx, dW, db = M.lm_head_backward(G, cache)

    def loss(a):
        return np.sum(G * M.lm_head_forward(a["x"], a["W"], a["b"])[0])

    assert_matches_fd(loss, {"x": x, "W": W, "b": b}, {"x": dx, "W": dW, "b": db})


def test_cross_entropy_with_a_mask():
    rng = np.random.default_rng(14)
    logits = rng.normal(size=(B, N, 7))
    targets = rng.integers(0, 7, size=(B, N))
    mask = rng.random((B, N)) < 0.6
    targets[~mask] = 99  # not counted: never read
    loss, cache = M.cross_entropy_forward(logits, targets, mask)
    t = np.where(mask, targets, 0)
    nll = special.logsumexp(logits, axis=-1) - np.take_along_axis(logits, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, nll[mask].mean(), rtol=1e-14)
    g = M.cross_entropy_backward(cache)
    assert_matches_fd(lambda a: M.cross_entropy_forward(a["z"], targets, mask)[0], {"z": logits}, {"z": g})
    np.testing.assert_array_equal(g[~mask], 0.0)
    # no counted row: loss 0 and gradient 0
    loss0, c0 = M.cross_entropy_forward(logits, targets, np.zeros((B, N), bool))
    assert loss0 == 0.0 and not np.any(M.cross_entropy_backward(c0))


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [-1e300, 1e300, 0.0]])
    loss, cache = M.cross_entropy_forward(logits, np.array([1, 1]))
    # row 0: -log softmax = 1e4 (exactly representable), row 1: 0
    assert loss == pytest.approx(5e3, rel=1e-15)
    g = M.cross_entropy_backward(cache)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, [[0.5, -0.5, 0.0], [0.0, 0.0, 0.0]], atol=1e-300)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

MODELS = [(m, h) for m in M.MIXERS for h in M.HEADS]


def _targets(c, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, c.n_classes, size=B) if c.head == "classify" else rng.integers(0, c.vocab_size, size=(B, N))


@pytest.mark.parametrize("mixer,head", MODELS)
def test_whole_model_against_central_differences(mixer, head):
    c = config(mixer, head)
    params = perturbed_params(c, seed=15)
    tokens, targets = tokens_for(c, 16), _targets(c, 17)
    loss, n_correct, n_counted, grads = M.loss_and_grads(params, tokens, targets, c)
    assert list(grads) == list(params)

    def f(a):
        return M.loss_and_grads({**params, **a}, tokens, targets, c)[0]

    assert_matches_fd(f, params, grads, subset=4, seed=18)


def test_two_layers_against_central_differences():
    c = config("gma", "classify", n_layers=2)
    params = perturbed_params(c, seed=19)
    tokens, targets = tokens_for(c, 20), _targets(c, 21)
    grads = M.loss_and_grads(params, tokens, targets, c)[3]
    assert any(k.startswith("layer1.") for k in grads)
    assert_matches_fd(lambda a: M.loss_and_grads({**params, **a}, tokens, targets, c)[0], params, grads, subset=3, seed=22)


@pytest.mark.parametrize("mixer,head", [("softmax", "classify"), ("ovq", "lm")])
def test_loss_and_grads_is_the_composition_of_its_pieces(mixer, head):
    c = config(mixer, head)
    params = perturbed_params(c, seed=23)
    tokens, targets = tokens_for(c, 24), _targets(c, 25)
    logits, cache = M.model_forward(params, tokens, c)
    mask = None if head == "classify" else tokens != c.pad_id
    if mask is not None:
        # the pad positions would be right: they must not count
        targets = np.where(mask, targets, logits.argmax(-1))
    loss, n_correct, n_counted, grads = M.loss_and_grads(params, tokens, targets, c)
    ce, ce_cache = M.cross_entropy_forward(logits, targets, mask)
    assert loss == float(ce) and isinstance(loss, float)
    for name, g in M.model_backward(M.cross_entropy_backward(ce_cache), cache).items():
        np.testing.assert_array_equal(grads[name], g, err_msg=name)
    counted = np.ones(B, bool) if mask is None else mask
    assert n_counted == int(counted.sum()) == (B if head == "classify" else B * N - 2)
    assert n_correct == int(np.sum((logits.argmax(-1) == targets) & counted))


@pytest.mark.parametrize("mixer,head", [("gma", "classify"), ("linear", "lm"), ("ovq", "classify")])
def test_runs_are_reproducible_bit_for_bit(mixer, head):
    c = config(mixer, head)
    p1, p2 = M.init_params(c, 7), M.init_params(c, 7)
    assert list(p1) == list(M.param_shapes(c))
    for n in p1:
        assert p1[n].dtype == np.float64 and p1[n].shape == M.param_shapes(c)[n]
        np.testing.assert_array_equal(p1[n], p2[n])
    assert any(not np.array_equal(p1[n], a) for n, a in M.init_params(c, 8).items())
    tokens, targets = tokens_for(c, 26), _targets(c, 27)
    r1, r2 = M.loss_and_grads(p1, tokens, targets, c), M.loss_and_grads(p2, tokens, targets, c)
    assert r1[:3] == r2[:3]
    for n in r1[3]:
        np.testing.assert_array_equal(r1[3][n], r2[3][n])


def test_init_scales():
    c = config("softmax", d_model=64, mlp_hidden=128, vocab_size=50, max_len=40)
    p = M.init_params(c, 0)
    np.testing.assert_array_equal(p["layer0.ln1.gain"], 1.0)
    np.testing.assert_array_equal(p["layer0.mlp.b1"], 0.0)
    np.testing.assert_array_equal(p["head.b"], 0.0)
    for name, std in (("embed", 1.0), ("pos", M.POS_INIT_STD), ("layer0.mixer.W_q", 1 / 8), ("layer0.mlp.W2", 1 / np.sqrt(128))):
        assert abs(p[name].std() / std - 1) < 0.1, name
    g = M.init_params(config("gma"), 0)
    gp = layers.init_multihead_gma(D, HEADS, 2, D // HEADS, K, seed=0)
    np.testing.assert_array_equal(g["layer0.mixer.raw_variances"], gp.raw_variances)
    np.testing.assert_array_equal(g["layer0.mixer.logits"], 0.0)


@pytest.mark.parametrize("mixer", ["gma", "softmax", "linear", "ovq"])
def test_lm_logits_do_not_see_the_future(mixer):
    c = config(mixer, "lm")
    params = perturbed_params(c, seed=28)
    tokens = tokens_for(c, 29, pads=False)
    later = tokens.copy()
    later[:, 3:] = (later[:, 3:] % (c.vocab_size - 1)) + 1
    assert not np.array_equal(later, tokens)
    a, _ = M.model_forward(params, tokens, c)
    b, _ = M.model_forward(params, later, c)
    np.testing.assert_array_equal(a[:, :3], b[:, :3])


def test_gma_routing_reads_each_layer():
    c = config("gma", n_layers=2)
    params = perturbed_params(c, seed=30)
    tokens = tokens_for(c, 31)
    routing = M.gma_routing(params, tokens, c)
    assert len(routing) == 2
    for r in routing:
        assert r["x_q"].shape == r["x_k"].shape == (B, HEADS, N, 2)
        assert r["gamma_q"].shape == r["gamma_k"].shape == (B, HEADS, N, K)
        assert r["means"].shape == r["variances"].shape == (HEADS, K, 2) and r["weights"].shape == (HEADS, K)
        for b in range(B):
            for h in range(HEADS):
                for x, gam in ((r["x_q"], r["gamma_q"]), (r["x_k"], r["gamma_k"])):
                    ref = gmm.responsibilities(x[b, h], r["means"][h], r["variances"][h], r["weights"][h])
                    np.testing.assert_allclose(gam[b, h], ref, rtol=1e-12, atol=1e-14)
    # layer 0's routing inputs: the layer-normed embeddings projected by W_q, split into heads
    x0 = params["embed"][tokens] + params["pos"][:N]
    a, _ = M.layer_norm_forward(x0, params["layer0.ln1.gain"], params["layer0.ln1.bias"])
    xq = (a @ params["layer0.mixer.W_q"]).reshape(B, N, HEADS, 2).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(routing[0]["x_q"], xq, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(routing[0]["weights"], special.softmax(params["layer0.mixer.logits"], axis=1), rtol=1e-14)
    np.testing.assert_allclose(
        routing[1]["variances"], gmm.variances_from_raw(params["layer1.mixer.raw_variances"], 1e-6), rtol=1e-15)
    with pytest.raises(ValueError, match="config.mixer: gma_routing needs mixer='gma'"):
        M.gma_routing(perturbed_params(config("softmax")), tokens, config("softmax"))


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("change,exc,fragment", [
    (dict(d_model=9), ValueError, "config.d_model: expected a multiple of n_heads"),
    (dict(n_heads=0), ValueError, "config.n_heads: expected an integer >= 1"),
    (dict(n_layers=1.0), TypeError, "config.n_layers: expected an integer"),
    (dict(vocab_size=1), ValueError, "config.vocab_size: expected an integer >= 2"),
    (dict(pad_id=7), ValueError, "config.pad_id: expected a token id < vocab_size"),
    (dict(mixer="mamba"), ValueError, "config.mixer: expected one of 'gma', 'softmax', 'linear', 'ovq'"),
    (dict(head="regress"), ValueError, "config.head: expected one of"),
    (dict(causal=1), TypeError, "config.causal: expected True or False"),
    (dict(head="lm", causal=False), ValueError, "config.causal: the lm head"),
    (dict(ovq_chunk_size=0), ValueError, "config.ovq_chunk_size"),
    (dict(n_components=0), ValueError, "config.n_components"),
])
def test_bad_config_names_the_field(change, exc, fragment):
    with pytest.raises(exc, match=fragment):
        M.check_config(config(**change))
    with pytest.raises(exc, match=fragment):
        M.init_params(config(**change), 0)


def test_bad_inputs_name_the_argument():
    c = config("softmax")
    p = M.init_params(c, 0)
    tokens, targets = tokens_for(c, 0), _targets(c, 1)
    with pytest.raises(TypeError, match="config: expected a ModelConfig"):
        M.check_config(dict(c._asdict()))
    with pytest.raises(ValueError, match=r"seed: expected an integer >= 0"):
        M.init_params(c, -1)
    with pytest.raises(ValueError, match=r"params: do not match the config .*missing \['head.b'\]"):
        M.model_forward({k: a for k, a in p.items() if k != "head.b"}, tokens, c)
    with pytest.raises(ValueError, match=r"unexpected \['layer0.mixer.means'\]"):
        M.model_forward({**p, "layer0.mixer.means": np.zeros((2, 3, 2))}, tokens, c)
    with pytest.raises(ValueError, match=r"params\['head.W'\]: expected shape"):
        M.model_forward({**p, "head.W": p["head.W"][:, :-1]}, tokens, c)
    with pytest.raises(ValueError, match=r"params\['embed'\]: expected finite values"):
        M.model_forward({**p, "embed": np.full_like(p["embed"], np.nan)}, tokens, c)
    with pytest.raises(TypeError, match="tokens: expected an integer array"):
        M.model_forward(p, tokens.astype(float), c)
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, vocab_size = 7\), got 7"):
        M.model_forward(p, np.full((B, N), 7), c)
    with pytest.raises(ValueError, match="tokens: sequences of N = 7 tokens exceed config.max_len = 6"):
        M.model_forward(p, np.ones((B, 7), int), c)
    with pytest.raises(ValueError, match="tokens: expected a 2-D array"):
        M.model_forward(p, tokens[0], c)
    with pytest.raises(ValueError, match=r"targets: expected shape"):
        M.loss_and_grads(p, tokens, targets[:1], c)
    with pytest.raises(ValueError, match=r"targets: expected class ids in \[0, C = 3\)"):
        M.loss_and_grads(p, tokens, np.array([0, 3]), c)
    logits, cache = M.model_forward(p, tokens, c)
    with pytest.raises(ValueError, match=r"dlogits: expected shape \(B, n_classes\)"):
        M.model_backward(logits[:, :-1], cache)
    with pytest.raises(TypeError, match="cache: expected the ModelCache"):
        M.model_backward(logits, None)
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        M.cross_entropy_forward(logits, targets, np.ones(B))
    with pytest.raises(TypeError, match="cache: expected the CrossEntropyCache"):
        M.cross_entropy_backward(cache)


def test_inputs_are_not_mutated():
    c = config("gma", "lm")
    p = perturbed_params(c, seed=32)
    copies = {k: a.copy() for k, a in p.items()}
    tokens, targets = tokens_for(c, 33), _targets(c, 34)
    t_copy, y_copy = tokens.copy(), targets.copy()
    M.loss_and_grads(p, tokens, targets, c)
    M.gma_routing(p, tokens, c)
    for k in p:
        np.testing.assert_array_equal(p[k], copies[k])
    np.testing.assert_array_equal(tokens, t_copy)
    np.testing.assert_array_equal(targets, y_copy)


def test_gma_routing_gradients_wrt_the_responsibilities_give_the_logit_gradients():
    """dL/da_m = sum over tokens of gamma_m (g_m - sum_j gamma_j g_j), queries and keys: the softmax Jacobian, per layer and head."""
    cfg = M.ModelConfig(vocab_size=7, max_len=6, d_model=8, n_layers=2, n_heads=2, n_components=3, d_route=2, mlp_hidden=8)
    params = M.init_params(cfg, 3)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 7, size=(2, 5))
    targets = rng.integers(0, 10, size=2)
    routing = M.gma_routing(params, tokens, cfg, targets=targets)
    grads = M.loss_and_grads(params, tokens, targets, cfg)[3]
    for layer, r in enumerate(routing):
        expected = 0.0
        for side in ("q", "k"):
            gamma, g = r[f"gamma_{side}"], r[f"grad_gamma_{side}"]
            c = gamma * (g - np.sum(gamma * g, axis=-1, keepdims=True))
            expected = expected + c.sum(axis=(0, 2))  # (H, K)
        got = grads[f"layer{layer}.mixer.logits"]
        np.testing.assert_allclose(expected, got, rtol=1e-10, atol=1e-14 * np.abs(got).max())
    assert "grad_gamma_q" not in M.gma_routing(params, tokens, cfg)[0]


# the overflow edge: rows whose sum of squares (and, at the top, whose mean) overflows the dtype
SCALES = {np.float64: (1e160, 2.0**1020, 1e10), np.float32: (1e20, 2.0**125, 1e5)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layer_norm_is_scale_invariant_up_to_the_overflow_edge(dtype):
    """LN(c x) = LN(x) once c^2 var(x) dwarfs eps: the same at c = 1e160 (1e20 in float32) and at the largest
    power of two whose rows still fit, as at a moderate c where the plain formula cannot overflow."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, N, D))
    x = (x / np.max(np.abs(x), axis=-1, keepdims=True)).astype(dtype)  # rows of max |x| = 1
    gain, bias, G = (rng.normal(size=s).astype(dtype) for s in ((D,), (D,), (B, N, D)))
    *large, moderate = (dtype(c) for c in SCALES[dtype])
    y_ref, cache_ref = M.layer_norm_forward(x * moderate, gain, bias)
    dx_ref = M.layer_norm_backward(G, cache_ref)[0] * moderate
    eps = np.finfo(dtype).eps
    for c in large:
        y, cache = M.layer_norm_forward(x * c, gain, bias)
        assert y.dtype == dtype and np.all(np.isfinite(y))
        np.testing.assert_allclose(y, y_ref, rtol=0, atol=16 * eps * float(np.max(np.abs(y_ref))), err_msg=f"c = {c}")
        dx, dgain, dbias = M.layer_norm_backward(G, cache)
        # dL/dx scales as 1 / c
        np.testing.assert_allclose(dx * c, dx_ref, rtol=0, atol=64 * eps * float(np.max(np.abs(dx_ref))), err_msg=f"c = {c}")
        np.testing.assert_allclose(dgain, M.layer_norm_backward(G, cache_ref)[1], rtol=0, atol=64 * eps * D * B * N)


@pytest.mark.parametrize("dtype, large, fits", [(np.float64, 1e160, 1e150), (np.float32, 1e20, 1e15)])
def test_huge_embeddings_give_the_logits_of_merely_large_ones(dtype, large, fits):
    """Every residual stream of a pre-norm model goes through layer norm: embeddings of 1e160 give the logits of
    1e150 (where the sum of squares still fits), not the head's bias alone."""
    c = config()
    params = {n: a.astype(dtype) for n, a in perturbed_params(c).items()}
    tokens = tokens_for(c)

    def logits(scale):
        scaled = {**params, "embed": params["embed"] * dtype(scale), "pos": params["pos"] * dtype(scale)}
        return M.model_forward(scaled, tokens, c)[0]

    at_large, at_fits = logits(large), logits(fits)
    assert np.all(np.isfinite(at_large)) and not np.allclose(at_large, params["head.b"])
    tol = 1e-9 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(at_large, at_fits, rtol=tol, atol=tol)


@pytest.mark.parametrize("mixer", ["gma", "softmax", "linear", "ovq"])
def test_a_packed_listops_batch_gives_the_padded_loss_and_gradients_of_a_causal_model(mixer):
    """Causal mixers never read the trailing padding and the pooling skips it: packed is padded without the padding."""
    from app import tasks

    x, y = tasks.listops_splits(8, 1, 1, max_len=24, max_depth=2, seed=3)["train"]
    c = config(mixer, causal=True, vocab_size=len(tasks.LISTOPS_TOKENS), max_len=24, n_classes=10)
    params = perturbed_params(c)
    tokens, targets, cu_seqlens = M.pack(x, y, c.pad_id)
    assert tokens.shape[1] == np.sum(x != c.pad_id) < x.size  # the batch was padded
    loss, correct, counted, grads = M.loss_and_grads(params, x, y, c)
    packed = M.loss_and_grads(params, tokens, targets, c, cu_seqlens=cu_seqlens)
    assert packed[1:3] == (correct, counted)
    np.testing.assert_allclose(packed[0], loss, rtol=1e-13)
    for name, g in grads.items():
        np.testing.assert_allclose(packed[3][name], g, rtol=1e-10, atol=1e-13 * max(1.0, np.abs(g).max()), err_msg=name)
