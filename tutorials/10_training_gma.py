# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 10: Training GMA without a framework
#
# **You will learn to**
#
# - derive the shapes of a multi-head GMA layer (projections, heads, output
#   projection) and write its forward from the single-head mechanism;
# - check a hand-written backward against central finite differences, and
#   justify the step and the tolerance;
# - implement an AdamW step (bias correction, decoupled weight decay) and
#   check it against `app.optim`;
# - train GMA's mixture by backpropagation and measure how its components
#   are used (used components, usage entropy, NMI);
# - check lesson 4's gradient bounds on a trained model, and pack its
#   batches without padding (`cu_seqlens`), checked against the loop over
#   the sequences.
#
# **Before this lesson**: lessons 2 and 4 (GMA, and its gradients through the
# responsibilities). From outside the course: the chain rule and
# backpropagation, the softmax cross-entropy loss, gradient-based
# optimisation (SGD, Adam), and entropy and mutual information.
#
# Notation follows `docs/glossary.md`.
#
# Lessons 2 to 4 derived GMA's forward and backward. Here the Gaussian
# mixture is *learned*: its means, variances and weights are trained by
# backpropagation together with the rest of a small network, as in the GMA
# paper, with every backward written by hand (`app.model`) and an AdamW
# optimiser (`app.optim`). No deep-learning framework is involved.
#
# **The claims of this lesson.**
#
# 1. The multi-head GMA layer (`app.layers`) is the mechanism of lesson 2
#    run once per head between learned projections; its backward, assembled
#    from GMA's backward and the projections', agrees with central finite
#    differences in the input and in every parameter.
# 2. The model's backward, assembled from the pieces of `app.model`
#    (embedding, positions, layer norm, the mixer, MLP, head, cross-entropy),
#    is the gradient of the loss: a finite-difference check along a random
#    direction in the space of *all* parameters agrees, for every mixer.
# 3. On ListOps-mini (nested MIN, MAX, MED and SUM_MOD expressions, 10
#    classes) the loss falls, and at full size GMA's test accuracy is at
#    least 10 points above the majority class.
# 4. Training decides how the tokens are shared among the components: we
#    watch the shares move, and count the components that take more than a
#    stated share.
# 5. The paper's interpretability metrics (used components, usage entropy,
#    NMI against token categories) on the trained model, next to the paper's
#    numbers, and why they differ; the responsibilities over a sequence.
# 6. Lesson 4's gradient bounds hold on the trained model, with the loss's
#    own gradients.
# 7. Much of a padded ListOps batch is padding; a packed batch holds none,
#    and the packed call is the loop over its sequences, bit for bit.
#
# `TUTORIAL_SMALL=1` (set by CI) trains a tiny model for a few hundred steps:
# claim 3's accuracy target is checked at full size only (about 5 minutes).

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from matplotlib.colors import LogNorm

from refimpl import gma, gmm
from app import interpret, layers, model, optim, tasks, train
from refimpl.gradcheck import numerical_gradient, relative_error

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
print(f"small sizes: {SMALL}")

# %% [markdown]
# ## 1. From the mechanism to a layer
#
# Lessons 2 to 4 studied one GMA: given routing inputs $X_Q$, $X_K$ and
# values $\mathbf V$, a mixture of $K$ Gaussians in $d_r$ dimensions mixes the
# values. A network does not hand GMA its routing inputs: a **layer** makes
# them from the residual stream $X$ ($N\times d_{\text{model}}$, one row per
# token) by learned projections, runs $H$ GMAs side by side (the *heads*,
# each with its own mixture), and projects their outputs back
# (`app.layers`; derivation in `docs/derivations/layers.md`). For one
# sequence and head $\nu$ ($\nu = 1, \dots, H$; the letter $h$ is kept for the
# finite-difference step below),
#
# $$X_Q^{(\nu)} = XW_Q^{(\nu)},\quad X_K^{(\nu)} = XW_K^{(\nu)},\quad \mathbf V^{(\nu)} = XW_V^{(\nu)},\quad
#   O^{(\nu)} = \operatorname{GMA}\bigl(X_Q^{(\nu)}, X_K^{(\nu)}, \mathbf V^{(\nu)};\ \mu^{(\nu)}, s^{(\nu)}, a^{(\nu)}\bigr),$$
#
# $$Y = \bigl[O^{(1)}\ \cdots\ O^{(H)}\bigr]\,W_O ,$$
#
# with $\sigma^{2(\nu)} = \operatorname{softplus}(s^{(\nu)}) + \sigma^2_{\min}$ and
# $\pi^{(\nu)} = \operatorname{softmax}(a^{(\nu)})$. In the model of this lesson
# each head is $d_h = d_{\text{model}}/H$ wide: its values have $d_v = d_h$
# columns, and its routing inputs $d_r$ (`d_route`), usually fewer. The
# shapes through the layer, for a batch of $B$ sequences:
#
# | what | shape | how |
# | --- | --- | --- |
# | input $x$ | $B\times N\times d_{\text{model}}$ | |
# | $W_Q$, $W_K$; $W_V$; $W_O$ | $d_{\text{model}}\times Hd_r$; $d_{\text{model}}\times Hd_h$; $Hd_h\times d_{\text{model}}$ | head $\nu$ uses the $\nu$-th block of $d_r$ (or $d_h$) columns, of rows for $W_O$ |
# | $X_Q$, $X_K$ | $B\times N\times H\times d_r$ | $xW_Q$, reshaped: the last axis split into $H$ blocks |
# | $\mathbf V$ | $B\times N\times H\times d_h$ | $xW_V$, reshaped |
# | $\mu^{(\nu)}$, $s^{(\nu)}$; $a^{(\nu)}$ | $K\times d_r$; $K$ | one mixture per head, shared by the $B$ sequences |
# | $\Gamma_Q^{(\nu)}$, $\Gamma_K^{(\nu)}$ | $N\times K$ | per sequence and head |
# | $O^{(\nu)}$ | $N\times d_h$ | GMA, per sequence and head |
# | heads, concatenated | $B\times N\times Hd_h$ | |
# | output $Y$ | $B\times N\times d_{\text{model}}$ | times $W_O$ |
#
# Here is that forward written out with lesson 2's GMA, one head at a time,
# against `app.layers.multihead_gma_forward`, on a tiny layer (with
# $d_r \ne d_h$, so that a block taken with the wrong width would show).

# %%
B, N, d_model, H, d_r, K = 2, 5, 6, 2, 2, 3
d_h = d_model // H
lp = layers.init_multihead_gma(d_model, H, d_r, d_h, K, seed=3)
rng = np.random.default_rng(10)
lp = lp._replace(logits=rng.standard_normal((H, K)), raw_variances=lp.raw_variances + 0.3 * rng.standard_normal((H, K, d_r)))
x = rng.standard_normal((B, N, d_model))
print({f: a.shape for f, a in lp._asdict().items()})


def layer_forward(x, p, causal=False):
    """The multi-head layer from lesson 2's GMA: project, split into heads, mix per (sequence, head), concatenate, project."""
    B, N, _ = x.shape
    H, K, d_r = p.means.shape
    d_h = p.W_v.shape[1] // H
    xq = (x @ p.W_q).reshape(B, N, H, d_r)  # head nu: columns nu d_r .. (nu + 1) d_r - 1
    xk = (x @ p.W_k).reshape(B, N, H, d_r)
    v = (x @ p.W_v).reshape(B, N, H, d_h)
    heads = np.empty((B, N, H, d_h))
    for b in range(B):
        for head in range(H):
            variances = gmm.variances_from_raw(p.raw_variances[head])  # softplus(s) + sigma^2_min
            weights = gmm.softmax(p.logits[head])
            heads[b, :, head] = gma.gma(xq[b, :, head], xk[b, :, head], v[b, :, head], p.means[head], variances, weights,
                                        causal=causal, chunk_size=2)
    return heads.reshape(B, N, H * d_h) @ p.W_o


for causal in (False, True):
    y_ref, _ = layers.multihead_gma_forward(x, lp, causal=causal, chunk_size=2)
    err = relative_error(layer_forward(x, lp, causal), y_ref)
    print(f"causal={causal}: the layer written out against app.layers, relative difference {err:.1e}")
    assert err < 1e-13  # the same operations in the same order: only rounding, a few u

# %% [markdown]
# The backward runs the same steps in reverse (`docs/derivations/layers.md`):
# $dW_O = \sum_b O_b^\top G_b$ and $dO = GW_O^\top$; lesson 4's GMA backward
# turns each head's block of $dO$ into $dX_Q^{(\nu)}$, $dX_K^{(\nu)}$,
# $d\mathbf V^{(\nu)}$ and its mixture's gradients, **summed over the batch**,
# since every sequence uses the same mixture; and the projections give
# $dW_Q = \sum_b X_b^\top dX_{Q,b}$ (likewise $W_K$, $W_V$) and
# $dX = dX_QW_Q^\top + dX_KW_K^\top + d\mathbf V W_V^\top$: three terms,
# because $X$ feeds all three projections.
#
# The check: the loss $L = \sum G\odot Y$ with a fixed random $G$ has
# gradient exactly what the backward returns for $G$; central differences
# $\bigl(L(\theta + he_i) - L(\theta - he_i)\bigr)/2h$ estimate it entry by
# entry. With $h = 10^{-6}$ their error is about $u|L|/h + h^2|L'''|/6$, near
# $10^{-9}$ here, so a relative difference of $10^{-6}$ (to the largest
# entry of each gradient) leaves a margin of hundreds while any wrong term
# of the backward shows at order 1. Why this tolerance:
# `docs/floating_point.md`, section Lesson 10.

# %%
G = rng.standard_normal((B, N, d_model))
for causal in (False, True):
    y, cache = layers.multihead_gma_forward(x, lp, causal=causal, chunk_size=2)
    grads = layers.multihead_gma_backward(G, cache)

    def loss_of(name, value, causal=causal):
        if name == "x":
            return float(np.sum(G * layers.multihead_gma(value, lp, causal=causal, chunk_size=2)))
        return float(np.sum(G * layers.multihead_gma(x, lp._replace(**{name: value}), causal=causal, chunk_size=2)))

    worst = 0.0
    for name in ("x",) + layers.MultiheadGMAParams._fields:
        point = x if name == "x" else getattr(lp, name)
        numeric = numerical_gradient(lambda a, name=name: loss_of(name, a), point, h=1e-6)
        err = relative_error(getattr(grads, name), numeric)
        worst = max(worst, err)
        assert err < 1e-6, (name, causal, err)
    print(f"causal={causal}: backward of the layer against central differences, every input and parameter: "
          f"worst relative difference {worst:.1e}")

# %% [markdown]
# ## 2. The model, and its backward assembled from the pieces
#
# Tokens are embedded, a learned position vector is added, and each block
# is pre-norm residual: $x \leftarrow x + \mathrm{mixer}(\mathrm{LN}(x))$, then
# $x \leftarrow x + \mathrm{MLP}(\mathrm{LN}(x))$. A final layer norm feeds the
# head: mean pooling over the non-padding tokens and a linear map to the 10
# classes. The mixer is one of GMA, softmax attention, linear attention or
# OVQ, behind one interface.
#
# `model_backward` runs the pieces' backwards in reverse order: the head's,
# the final layer norm's, then per block the MLP's and the mixer's, each
# with its residual path adding the incoming gradient, then the positions'
# and the embedding's (a scatter-add over the token ids). Each piece is
# checked against finite differences in the test suite; here the whole
# model is, along one random direction $\xi$ in the space of all parameters:
# $\bigl(L(\theta + h\xi) - L(\theta - h\xi)\bigr)/2h \approx \nabla L\cdot \xi$.
# The finite difference is off by about $u|L|/h + h^2|L'''_\xi|/6$, a few
# $10^{-9}$ relative here (the second term, with $L'''_\xi$ the third
# derivative along $\xi$), while a wrong term of a backward shows at order
# one; the check allows $10^{-6}$. Why this tolerance:
# `docs/floating_point.md`, section Lesson 10.

# %%
cfg = model.ModelConfig(vocab_size=len(tasks.LISTOPS_TOKENS), max_len=12, d_model=8, n_heads=2, n_components=3,
                        d_route=2, mlp_hidden=16)
params = model.init_params(cfg, seed=0)
print(f"{'parameter':24s} shape")
for name, a in params.items():
    print(f"{name:24s} {a.shape}")

rng = np.random.default_rng(10)
tokens = rng.integers(1, len(tasks.LISTOPS_TOKENS), size=(3, 9))
tokens[0, 6:] = tasks.PAD_ID  # a padded sequence
targets = rng.integers(0, 10, size=3)
for mixer in model.MIXERS:
    c = cfg._replace(mixer=mixer)
    p = model.init_params(c, seed=1)
    loss, _, _, grads = model.loss_and_grads(p, tokens, targets, c)
    xi = {k: rng.standard_normal(a.shape) for k, a in p.items()}  # a random direction
    h = 1e-5

    def loss_at(t, p=p, c=c, xi=xi):
        return model.loss_and_grads({k: a + t * xi[k] for k, a in p.items()}, tokens, targets, c)[0]

    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    analytic = sum(float(np.sum(grads[k] * xi[k])) for k in p)
    rel = abs(numeric - analytic) / abs(analytic)
    print(f"{mixer:8s}: loss {loss:.4f}, directional derivative {analytic:+.8f}, finite differences {numeric:+.8f}, relative error {rel:.1e}")
    assert rel < 1e-6

# %% [markdown]
# ## 3. ListOps-mini
#
# Expressions nest the operators MIN, MAX, MED (the median; of an even
# count, the floor of the mean of the two middle values, `int(np.median(...))`
# as the original ListOps computes it, so `[MED 1 4 ]` is 2, not the lower
# middle value 1) and SUM_MOD (the sum modulo 10) over the digits 0 to 9, at
# most 3 deep and at most 128 tokens long; the label is the value, 0 to 9. The
# splits are drawn from one seed and share no expression.

# %%
# MED of an even count, as app.tasks evaluates it: the floor of the mean of the two middle values
for text, value in (("[MED 1 4 ]", 2), ("[MED 9 0 3 8 ]", 5), ("[MED 7 8 ]", 7)):
    assert tasks.listops_value(tasks.listops_encode(text)) == value == int(np.median([int(c) for c in text.split()[1:-1]]))
splits = tasks.listops_splits(2000, 200, 200, seed=0)
x_train, y_train = splits["train"]
for i in range(3):
    print(f"{tasks.listops_text(x_train[i])}   ->   {y_train[i]}")
    assert tasks.listops_value(x_train[i]) == y_train[i]
balance = tasks.class_balance(y_train)
print("class frequencies:", np.round(balance, 3))
print(f"majority-class rate (train): {tasks.majority_rate(y_train):.3f}")

# %% [markdown]
# ## 4. Training, with the mixture's usage recorded along the way
#
# `app.train` runs AdamW with warm-up, cosine decay, weight decay on the
# weight matrices and clipping at global norm 1. A run can stop with a
# checkpoint and resume bit for bit, so we train in segments and, between
# them, measure how much of the validation tokens each component takes: the
# mean responsibility $\bar\gamma_k$ over the non-padding tokens, first at
# step 0 (the initial parameters, `model.init_params` with the run's seed, as
# `app.train` draws them), then after each segment.

# %%
if SMALL:
    config = train.TrainConfig(steps=240, batch_size=16, d_model=16, components=8, d_route=4, mlp_hidden=32,
                               eval_every=40, warmup=20, n_train=1000, n_val=200, n_test=200, max_len=64)
else:
    config = train.TrainConfig()  # the defaults: the run of the documentation's table (seed 0)
mcfg = train.model_config(config)
data = train.load_data(config)
x_val, y_val = data["val"]
val_mask = x_val != tasks.PAD_ID
steps_seen = np.linspace(0, config.steps, 7).astype(int)  # step 0, then the end of each of 6 segments
out = Path(tempfile.mkdtemp(prefix="lesson10-"))


def component_usage(params):
    """(layers, heads, K): the mean responsibility of each component over the non-padding validation tokens."""
    routing = model.gma_routing(params, x_val, mcfg)
    return [[interpret.mean_responsibilities(r["gamma_q"][:, head], val_mask) for head in range(mcfg.n_heads)]
            for r in routing]


usage = [component_usage(model.init_params(mcfg, config.seed))]  # step 0: the parameters train() starts from
for i, stop in enumerate(steps_seen[1:]):
    result = train.train(config, out, resume=i > 0, progress=False, stop_after=int(stop) if stop < config.steps else None)
    usage.append(component_usage(result.params))
usage = np.array(usage)  # (moments, layers, heads, K): step 0 and the end of each segment
print(f"trained {result.step} steps in {len(steps_seen) - 1} segments, {1000 * result.seconds_per_step:.1f} ms per step")
print(f"validation accuracy {result.val_accuracy:.3f}, test accuracy {result.test_accuracy:.3f}, "
      f"majority class {result.majority_rate:.3f}")

# %%
log = np.genfromtxt(out / "log.csv", delimiter=",", names=True)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
window = max(1, config.steps // 50)
smooth = np.convolve(log["train_loss"], np.ones(window) / window, mode="valid")
ax1.plot(log["step"], log["train_loss"], alpha=0.3, label="train loss")
ax1.plot(log["step"][window - 1 :], smooth, label=f"mean of {window} steps")
ax1.set_xlabel("step")
ax1.set_ylabel("cross-entropy")
ax1.legend()
evaluated = ~np.isnan(log["val_accuracy"])
ax2.plot(log["step"][evaluated], log["val_accuracy"][evaluated], "o-", label="validation accuracy")
ax2.axhline(result.majority_rate, color="gray", ls="--", label="majority class")
ax2.set_xlabel("step")
ax2.set_ylabel("accuracy")
ax2.legend()
plt.show()
first, last = log["train_loss"][: config.steps // 10].mean(), log["train_loss"][-(config.steps // 10) :].mean()
print(f"mean training loss: first tenth {first:.3f}, last tenth {last:.3f} (log 10 = {np.log(10):.3f})")
assert last < first
if not SMALL:
    assert result.test_accuracy >= result.majority_rate + 0.10, (result.test_accuracy, result.majority_rate)

# %% [markdown]
# ## 5. How the components are used during training
#
# Each column below is one moment of training, centred on its step (step 0
# included); each row a component of layer 0, head 0; the colour is its
# share $\bar\gamma_k$ of the validation tokens, on a **logarithmic** scale:
# a linear one would paint every share below about $0.05$ the same dark
# colour, and the components that are nearly unused are the interesting
# ones. Training moves the means, the variances and the weights together
# with the projections that make the routing queries.
#
# **Does a component that few tokens reach stay dead?** Its gradient through
# the responsibilities is small, not zero:
# $\partial L/\partial a_k = \sum_i \gamma_{ik}(g_{ik} - \bar g_i)$ shrinks with
# $\gamma_{ik}$. Under plain gradient descent a small gradient means a small
# step, and such a component would indeed barely move. AdamW divides by
# $\sqrt{\hat v}$: a gradient that is small but *consistent* in sign gets
# $\hat m/(\sqrt{\hat v} + \delta) \approx g/(|g| + \delta)$, a step of nearly
# the full learning rate. The cell below runs `app.optim.adam_step` for
# 100 steps on one parameter with the constant gradient $g = 10^{-7}$ at the
# default learning rate $\eta = 3\times10^{-3}$: it moves by
# $100\,\eta\, g/(g + \delta) = 0.27$ ($\delta = 10^{-8}$), where SGD with the
# same rate moves it by $100\,\eta g = 3\times10^{-8}$. So a nearly unused
# component can come back; the counts printed below say how many components
# are above $0.1/K$ at each moment, and whether the count rose. In the
# full-size run ($K = 16$, this cell at `TUTORIAL_SMALL=0`, run once on
# 2 cores) the count of head 1 went from 11 at step 1500 to 13 at step 2000,
# and that of head 0 from 10 at step 1000 to 11 at step 1500: components
# below the threshold came back.

# %%
# AdamW against SGD on a small, consistent gradient
eta, g_small, n_steps = 3e-3, 1e-7, 100
theta, state = {"logits": np.zeros(1)}, optim.adam_init({"logits": np.zeros(1)})
for _ in range(n_steps):
    theta, state, _ = optim.adam_step(theta, {"logits": np.full(1, g_small)}, state, lr=eta)
adam_moved, sgd_moved = abs(float(theta["logits"][0])), n_steps * eta * g_small
print(f"{n_steps} steps with g = {g_small:g}, lr = {eta:g}: AdamW moves the parameter {adam_moved:.4f}, SGD {sgd_moved:.1e}")
# constant g: m_hat = g and v_hat = g^2 exactly up to rounding, so each step is eta g / (g + delta)
assert abs(adam_moved - n_steps * eta * g_small / (g_small + 1e-8)) < 1e-12
assert round(adam_moved, 2) == 0.27 and adam_moved > 1e6 * sgd_moved

K = mcfg.n_components
share = usage[:, 0, 0, :].T  # (K, moments)
spacing = steps_seen[1] - steps_seen[0]  # the moments are equally spaced
extent = (steps_seen[0] - spacing / 2, steps_seen[-1] + spacing / 2, -0.5, K - 0.5)
centres = extent[0] + (np.arange(share.shape[1]) + 0.5) * (extent[1] - extent[0]) / share.shape[1]
assert np.allclose(centres, steps_seen), (centres, steps_seen)  # each column drawn at its own step
fig, ax = plt.subplots(figsize=(6, 3.5))
floor = 1e-4  # shares below this are drawn in the lowest colour
im = ax.imshow(np.maximum(share, floor), aspect="auto", cmap="viridis", origin="lower", extent=extent,
               norm=LogNorm(vmin=floor, vmax=1.0))
ax.set_xticks(steps_seen)
ax.set_xlabel("step")
ax.set_ylabel("component")
fig.colorbar(im, label="mean responsibility (log scale)")
plt.show()
threshold = 0.1 / K
used = (usage > threshold).sum(axis=-1)  # (moments, layers, heads)
for stop, n_used in zip(steps_seen, used[:, 0, :]):
    print(f"step {stop:5d}: components with mean responsibility > 0.1/K, per head of layer 0: {[int(n) for n in n_used]} of {K}")
rises = np.diff(used[:, 0, :], axis=0)  # (segments, heads)
print(f"largest rise of a head's count from one moment to the next: {int(rises.max())}")
assert np.allclose(usage.sum(axis=-1), 1.0)
assert used[-1].min() >= 1

# %% [markdown]
# ## 6. The paper's interpretability metrics
#
# On the test sequences (non-padding tokens), for each head:
#
# * **used components**: those whose mean responsibility exceeds a
#   threshold. The paper does not say which threshold gave its 104 of 128;
#   the count depends on it, so it is shown at several, as multiples of the
#   uniform share $1/K$;
# * **usage entropy** $-\sum_k\bar\gamma_k\log\bar\gamma_k\,/\log K$: 1 when
#   every component takes the same share, 0 when one takes everything;
# * **NMI** between the hard assignments $\arg\max_k\gamma_{ik}$ and the token
#   categories (digit, operator, bracket; padding is left out here).

# %%
report = result.report
print(interpret.format_report(report))
paper = dict(used="104 of 128", entropy=0.933, nmi=0.244)
print(f"\nthe paper (a language model, K = 128): {paper['used']} components used, usage entropy {paper['entropy']}, "
      f"NMI {paper['nmi']}")
for r in report:
    print(f"here, layer {r.layer} head {r.head} (K = {r.n_components}): used above 0.1/K: {r.used_q[1]}, "
          f"usage entropy {r.entropy_q:.3f}, NMI {r.nmi_q:.3f}")
    assert 0 <= r.entropy_q <= 1 and 0 <= r.nmi_q <= 1

# %% [markdown]
# The responsibilities over one test sequence: each column a token, each row
# a component of layer 0, head 0. Tokens of one category (the operators,
# say) tend to go to the same few components, which is what the NMI
# measures.

# %%
x_test = data["test"][0]
seq = x_test[int(np.argmax(np.sum(x_test != tasks.PAD_ID, axis=1) > 12))]  # a test sequence of more than 12 tokens
seq = seq[None, : int(np.sum(seq != tasks.PAD_ID))]
gamma_seq = model.gma_routing(result.params, seq, mcfg)[0]["gamma_q"][0, 0]  # (N, K)
fig, ax = plt.subplots(figsize=(max(6, 0.35 * seq.shape[1]), 3.5))
ax.imshow(gamma_seq.T, aspect="auto", cmap="magma", origin="lower", vmin=0, vmax=1)
ax.set_xticks(range(seq.shape[1]))
ax.set_xticklabels([tasks.LISTOPS_TOKENS[t] for t in seq[0]], rotation=90)
ax.set_ylabel("component")
ax.set_title("responsibilities of the routing queries, layer 0, head 0")
plt.show()
assert np.allclose(gamma_seq.sum(axis=1), 1.0)

# %% [markdown]
# The numbers are not the paper's, and should not be: its model routes the
# tokens of natural text (a vocabulary of thousands, surface categories such
# as punctuation and parts of speech) through 128 components, while ListOps
# has 15 non-padding token types (the digits 0 to 9, four operators and the
# closing bracket; 16 with padding) in 3 categories, and the components here
# are few.
#
# **How high can the NMI be?** With $A$ the hard assignments and
# $\mathrm{cat}$ the categories, $\mathcal H$ the entropy (in nats; not the head
# count $H$), $\mathrm{NMI} = 2I(A;\mathrm{cat})/(\mathcal H(A) + \mathcal H(\mathrm{cat}))$
# (the arithmetic normalisation of `app.interpret`), and
# $I(A;\mathrm{cat}) \le \mathcal H(\mathrm{cat})$, so
#
# $$\mathrm{NMI} \le \frac{2\,\mathcal H(\mathrm{cat})}{\mathcal H(A) + \mathcal H(\mathrm{cat})} .$$
#
# Three categories carry at most $\log 3$ nats, far less than the
# $\log K$ that $K$ components spread evenly would carry: when the
# assignments use all $K$ components about equally, even a perfect
# category detector cannot reach NMI 1. The cell below computes the bound
# with the measured $\mathcal H(\mathrm{cat})$ of the test tokens, for the
# measured $\mathcal H(A)$ of each head and for $\mathcal H(A) = \log K$ with
# $K = 16$ (the full-size run) down to $8$ (the small one), and asserts that
# every head's NMI is below its bound. Beyond the bound, the routing
# queries depend on the position and the context too (a digit inside a MIN
# and one inside a SUM_MOD are different tokens for the task).

# %%
def entropy_nats(labels):
    """The entropy, in nats, of the empirical distribution of integer labels."""
    _, counts = np.unique(labels, return_counts=True)
    q = counts / counts.sum()
    return float(-np.sum(q * np.log(q)))


test_mask = x_test != tasks.PAD_ID
cats = tasks.token_categories(x_test)[test_mask]
types = np.unique(x_test[test_mask])
print(f"non-padding token types in the test set: {types.size}; categories: {np.unique(cats).size}")
assert types.size <= len(tasks.LISTOPS_TOKENS) - 1 == 15 and set(np.unique(cats)) == {1, 2, 3}
H_cat = entropy_nats(cats)
for k_bound in (16, 8):
    print(f"H(cat) = {H_cat:.3f} nats: with H(A) = log {k_bound}, NMI <= {2 * H_cat / (np.log(k_bound) + H_cat):.3f}")
routing_test = model.gma_routing(result.params, x_test, mcfg)
for r in report:
    assignments = np.argmax(routing_test[r.layer]["gamma_q"][:, r.head], axis=-1)[test_mask]
    nmi = interpret.normalized_mutual_information(assignments, cats)
    assert abs(nmi - r.nmi_q) < 1e-12  # the same hard assignments as the report's
    bound = 2 * H_cat / (entropy_nats(assignments) + H_cat)
    print(f"layer {r.layer} head {r.head}: NMI {nmi:.3f} <= bound {bound:.3f} at its own H(A) = {entropy_nats(assignments):.3f}")
    assert nmi <= bound + 1e-12

# %% [markdown]
# ## 7. Lesson 4's bounds on the trained model
#
# Lesson 4 bounded the gradients that flow through the responsibilities, in
# terms of the spread of the upstream gradient $g = \partial L/\partial\gamma$
# and the radius $R$ of the mixture. Here $g$ is the loss's own gradient on
# the test sequences (`model.gma_routing(..., targets=...)`), and each ratio
# is the largest measured gradient over its bound, over the test tokens.

# %%
for layer, (queries, keys) in enumerate(result.bounds):
    for side, b in (("queries", queries), ("keys", keys)):
        for h in range(mcfg.n_heads):
            ratios = (b.ratio_x[h], b.ratio_means[h], b.ratio_logits[h], b.ratio_logits_modulated[h])
            print(f"layer {layer} head {h} {side:7s}: dL/dx {ratios[0]:.3f}, dL/dmu {ratios[1]:.3f}, "
                  f"dL/da {ratios[2]:.3f}, dL/da modulated {ratios[3]:.3f}")
            assert all(0 < r <= 1 + 1e-7 for r in ratios)

# %% [markdown]
# The bounds hold, as they must. How close a ratio comes to 1 says how
# tight its bound is on this model. The bounds on the logits depend only on
# the spread of $g$ (and, modulated, on $\gamma_{ik}(1-\gamma_{ik})$), so a
# single token can come close to them; the bounds on $\partial L/\partial x$
# and $\partial L/\partial\mu$ multiply by the radius $R$, set by the largest
# norm and the smallest variance together, which no single token need meet.

# %% [markdown]
# ## 8. Packed batches: training without padding
#
# A batch of ListOps expressions of different lengths is padded to its
# longest, and every mixer spends time and memory on the padding. How much of
# a batch is padding, measured on batches of 32 training sequences:

# %%
pad = tasks.PAD_ID


def cut(b):
    """A padded batch cut to its longest sequence."""
    return b[:, : int(np.max(np.sum(b != pad, axis=1)))]


batch = x_train[:32]
print(f"padded to {batch.shape[1]} tokens: padding {np.mean(batch == pad):.0%} of the tokens")
print(f"padded to the batch's longest, {cut(batch).shape[1]}: padding {np.mean(cut(batch) == pad):.0%}")
fractions = [np.mean(cut(x_train[a : a + 32]) == pad) for a in range(0, 640, 32)]
print(f"20 batches cut to their longest: padding {np.min(fractions):.0%} to {np.max(fractions):.0%}")
assert np.min(fractions) > 0.25

# %% [markdown]
# Packed, the batch is its $T = \sum_s n_s$ real tokens one after another,
# and the offsets `cu_seqlens` ($S + 1$ integers from 0 to $T$) say where
# each sequence starts: sequence $s$ is rows `cu_seqlens[s]:cu_seqlens[s+1]`
# (the page *Packed variable-length batches* of `docs/derivations/`). Every
# function of the reference takes `cu_seqlens` and computes each sequence on
# its own: causal prefix sums start at zero at each sequence, bidirectional
# GMA writes each sequence's own slots. The packed call *is* the loop over
# the sequences:

# %%
tokens, targets, cu_seqlens = model.pack(batch, y_train[:32], pad)
print(f"packed: tokens {tokens.shape}, {len(cu_seqlens) - 1} sequences, cu_seqlens[:5] = {cu_seqlens[:5]}")
rng_pack = np.random.default_rng(10)
H_pack, K_pack, d_pack = 2, 4, 3
table_q, table_k, table_v = rng_pack.normal(size=(3, len(tasks.LISTOPS_TOKENS), H_pack, d_pack))
x_q, x_k, v = table_q[tokens[0]], table_k[tokens[0]], table_v[tokens[0]]  # (T, H, d): a feature per token and head
means_p = rng_pack.normal(size=(H_pack, K_pack, d_pack))
variances_p, weights_p = np.ones((H_pack, K_pack, d_pack)), np.full((H_pack, K_pack), 1 / K_pack)
for causal in (True, False):
    packed_out = gma.gma(x_q, x_k, v, means_p, variances_p, weights_p, causal=causal, cu_seqlens=cu_seqlens)
    # the definition: each sequence alone, its heads a batch (H, n, d)
    loop = np.concatenate([
        gma.gma(*(a[s:e].transpose(1, 0, 2) for a in (x_q, x_k, v)), means_p, variances_p, weights_p, causal=causal).transpose(1, 0, 2)
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])
    ])
    assert np.array_equal(packed_out, loop)
print("the packed call equals the loop over the sequences, bit for bit (causal and bidirectional)")

# %% [markdown]
# Does packing change the model? A causal mixer never reads the padding that
# trails a sequence, and the classifier's pooling skips it, so for a causal
# model the packed batch gives the padded batch's loss and gradients, to
# rounding. A bidirectional mixer does read the padding of a padded batch
# (`app.model` does not mask it), so there a packed batch is the model
# *without* the padding's part in the mixing: another function.

# %%
for causal in (True, False):
    mcfg_p = train.model_config(train.quick_config())._replace(causal=causal, max_len=cut(batch).shape[1])
    params_p = model.init_params(mcfg_p, seed=0)
    padded_loss, _, _, padded_grads = model.loss_and_grads(params_p, cut(batch), y_train[:32], mcfg_p)
    packed_loss, _, _, packed_grads = model.loss_and_grads(params_p, tokens, targets, mcfg_p, cu_seqlens=cu_seqlens)
    gap = max(np.max(np.abs(packed_grads[k] - g)) / max(np.max(np.abs(g)), 1e-300) for k, g in padded_grads.items())
    print(f"causal={causal}: loss padded {padded_loss:.12f}, packed {packed_loss:.12f}; largest relative gradient gap {gap:.1e}")
    if causal:
        assert abs(packed_loss - padded_loss) <= 1e-12 * abs(padded_loss) and gap < 1e-9
    else:
        assert abs(packed_loss - padded_loss) > 1e-6  # the padded model reads its padding

# %% [markdown]
# `python -m app train --pack` packs every batch this way, and
# `benchmarks/bench_cpu.py` times a packed batch of 64 ListOps sequences
# against the padded one.

# %% [markdown]
# ## What to remember
#
# * A layer is the mechanism between learned maps: project the residual
#   stream to routing inputs and values, split the columns into $H$ heads of
#   $d_r$ and $d_h$ columns, run GMA per (sequence, head), concatenate, and
#   project back with $W_O$. Its backward is GMA's backward between the
#   projections', with the mixture's gradients summed over the batch and
#   three terms in $dX$.
# * Check a backward against central differences with $h\approx10^{-6}$ in
#   float64: the difference is then accurate to about $10^{-9}$, and any
#   wrong term shows at order one.
# * The mixture is trained like any weight: AdamW with bias correction and
#   decoupled decay (not applied to the means, variances and weights). A
#   nearly unused component is not dead under AdamW: a small gradient of
#   constant sign gets a step of nearly the full learning rate.
# * How the components end up used (counts above a threshold, usage
#   entropy, NMI with token categories) is measured, not assumed; the
#   counts depend on the threshold.
# * Lesson 4's bounds hold on a trained model; the logit bounds come close,
#   the bounds that multiply by $R$ are loose.
# * Pack sequences of different lengths rather than pad them: `cu_seqlens`
#   cuts the packed rows into sequences, each computed on its own (the loop,
#   bit for bit); for a causal model nothing else changes.

# %% [markdown]
# ## Exercises
#
# Six exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell below it; until you answer, the check
# prints that the exercise is not done yet, and a wrong answer stops with a
# message that says what is wrong. You may use `refimpl.gma` and
# `refimpl.gmm` inside your answers (the single-head GMA and its backward),
# but not `app.layers`, `app.optim`, the loss functions and the
# backwards of `app.model` or `refimpl.gradcheck`: those are what the
# checks compare with. Worked solutions
# are in `tutorials/solutions/lesson_10.py`; try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises need it only here)

# %% [markdown]
# ### Exercise 10.1 ★ The cross-entropy backward
#
# The classifier's loss is the mean over the $B$ rows of
# $-\log\operatorname{softmax}(z_b)_{y_b}$. Derive its gradient with respect
# to the logits $z$ ($B\times n_{\text{cls}}$, one column per class; $C$ is
# kept for the chunk length, as in the glossary) and write
# `cross_entropy_grad(logits, targets)` returning it, shape
# $(B, n_{\text{cls}})$ (`targets` holds the class ids $y_b$). The check uses logits of size up to $10^3$, so the softmax must
# subtract each row's maximum, and compares with `app.model` and with
# central differences of the loss.

# %%
def cross_entropy_grad(logits, targets):
    """dL/dlogits of the mean softmax cross-entropy over the rows; logits (B, n_cls), targets (B,) ints; shape (B, n_cls)."""
    raise NotImplementedError("exercise 10.1")


# %%
check("10.1", cross_entropy_grad)

# %% [markdown]
# ### Exercise 10.2 ★★ One AdamW step
#
# Write `adamw_step(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay)`,
# step $t = 1, 2, \dots$ of AdamW on one weight matrix $\theta$ with gradient
# $g$ (no clipping), returning the new `(theta, m, v)`:
#
# $$m \leftarrow \rho_1 m + (1-\rho_1)g,\quad v \leftarrow \rho_2 v + (1-\rho_2)g^2,\quad
#   \hat m = \frac{m}{1-\rho_1^t},\quad \hat v = \frac{v}{1-\rho_2^t},\quad
#   \theta \leftarrow \theta - \eta\Bigl(\frac{\hat m}{\sqrt{\hat v}+\delta} + \lambda\theta\Bigr),$$
#
# with $\eta$ = `lr` and $\lambda$ = `weight_decay` (`app.optim` names
# $\rho_1, \rho_2, \delta$ `beta1`, `beta2`, `eps`). The check runs three
# steps against `app.optim.adam_step`, with and without decay, on
# gradients from $10^{-7}$ to $10$ (where it matters whether $\delta$ is
# added inside or outside the square root) and one entry with no gradient.
# **Question 10.2.** Why must the decay stay out of $g$?

# %%
def adamw_step(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):
    """One AdamW step (t = 1, 2, ...) on one weight matrix; returns (theta, m, v), each of theta's shape."""
    raise NotImplementedError("exercise 10.2")


# %%
check("10.2", adamw_step)

# %% [markdown]
# ### Exercise 10.3 ★★ The multi-head layer's forward
#
# Write `multihead_forward(x, params)`: the bidirectional multi-head GMA
# layer of section 1 on `x` ($B\times N\times d_{\text{model}}$), with
# `params` a `app.layers.MultiheadGMAParams` (fields `W_q`, `W_k`, `W_v`,
# `W_o`, `means`, `raw_variances`, `logits`), returning
# $B\times N\times d_{\text{model}}$. Use `refimpl.gma.gma` for each (sequence,
# head), with variances $\operatorname{softplus}(s) + \sigma^2_{\min}$
# (`refimpl.gmm.variances_from_raw`) and weights $\operatorname{softmax}(a)$
# (`refimpl.gmm.softmax`). Mind which columns belong to head $\nu$. The check
# uses $Hd_v \ne d_{\text{model}}$ and compares with `app.layers`.

# %%
def multihead_forward(x, params):
    """The multi-head GMA layer (bidirectional): x (B, N, d_model) -> (B, N, d_model)."""
    raise NotImplementedError("exercise 10.3")


# %%
check("10.3", multihead_forward)

# %% [markdown]
# ### Exercise 10.4 ★★★ The multi-head layer's backward
#
# Write `multihead_backward(grad_out, x, params)`: the gradients of
# $L = \sum G\odot Y$ ($G$ = `grad_out`, $Y$ the output of exercise 10.3) with
# respect to `x` and to every parameter, as a dict with the keys `x`, `W_q`,
# `W_k`, `W_v`, `W_o`, `means`, `raw_variances`, `logits`, each of the shape
# of what it differentiates. Run the forward with `refimpl.gma.gma_forward`
# (it takes the raw variances and the logits and returns a cache), then
# reverse the steps as in section 1, with `refimpl.gma.gma_backward` for each
# (sequence, head). The check compares with `app.layers`, itself checked
# against central differences in section 1; to debug, compare one gradient
# at a time with `numerical_gradient` as section 1 does.

# %%
def multihead_backward(grad_out, x, params):
    """Gradients of sum(grad_out * layer(x)): a dict x, W_q, W_k, W_v, W_o, means, raw_variances, logits."""
    raise NotImplementedError("exercise 10.4")


# %%
check("10.4", multihead_backward)

# %% [markdown]
# ### Exercise 10.5 ★★★ The layer norm and GELU backward
#
# Every block of the model runs $z = \mathrm{LN}(x)\odot g + b$ (layer norm
# over the last axis, gain $g$, bias $b$) and the MLP applies
# $\operatorname{gelu}$. Take the two together, $y = \operatorname{gelu}(z)$ with
#
# $$\hat x = \frac{x - \operatorname{mean}(x)}{\sqrt{\operatorname{var}(x) + \epsilon_{\mathrm{LN}}}},\qquad
#   \operatorname{gelu}(z) = \tfrac12 z\bigl(1 + \tanh\bigl(\sqrt{2/\pi}\,(z + 0.044715\,z^3)\bigr)\bigr),$$
#
# mean and variance over the $d$ entries of each row, $\epsilon_{\mathrm{LN}}$ =
# `app.model.LN_EPS` $= 10^{-5}$. Derive $\operatorname{gelu}'$ and the
# Jacobian $\partial\hat x_j/\partial x_i$ of one row (hint: it has a
# centring part and a part along $\hat x$), then write
# `ln_gelu_backward(dy, x, gain, bias)` returning the gradients of
# $L = \sum \mathtt{dy}\odot y$ as `(dx, dgain, dbias)`: `dx` of the shape of
# `x` ($B\times N\times d$), `dgain` and `dbias` of shape $(d,)$, summed over
# every row, since every row shares them. The check compares with
# `app.model`'s `layer_norm_backward` and `gelu_derivative` (which your
# answer may not call) and with central differences in `x`, `gain` and
# `bias` (tolerance $10^{-6}$: `docs/floating_point.md`, section Lesson 10).

# %%
def ln_gelu_backward(dy, x, gain, bias):
    """(dx (B, N, d), dgain (d,), dbias (d,)) of L = sum(dy * gelu(LN(x) * gain + bias))."""
    raise NotImplementedError("exercise 10.5")


# %%
check("10.5", ln_gelu_backward)

# %% [markdown]
# ### Exercise 10.6 ★★ A gradient check of the whole model
#
# Section 2 checked the model's gradient along one random direction. The
# check of CS231n (Stanford's course on neural networks) looks at single
# entries instead: pick a few parameter entries at random, move each by
# $\pm h$, and compare $n = (L(\theta + he) - L(\theta - he))/2h$ with the
# analytic $a$ by the relative error $|a - n|/\max(|a|, |n|)$, which does not
# depend on the scale of the gradient (take it as 0 when both are 0).
#
# Write `gradient_check(loss, params, grads, n_entries, h, seed)`: `loss`
# maps a dict of parameter arrays to a float, `grads` holds the analytic
# gradients (keyed like `params`). Draw `n_entries` distinct entries of all
# the parameters with `np.random.default_rng(seed)` (how you draw them is up
# to you) and return a list of records
# `(name, index, analytic, numeric, rel_error)`, `index` a tuple into
# `params[name]`. Leave `params` as you found it, bit for bit. You may not
# call `refimpl.gradcheck.numerical_gradient`. The check runs your function on
# a loss whose gradient is known in closed form (so a one-sided difference,
# off by $hL''/2$ instead of $h^2L'''/6$, shows), on a gradient that is half
# too small, and on the tiny model of section 2.
#
# **Question 10.6.** With $h = 10^{-5}$, what relative error do you expect
# for a correct gradient, and why can it be large for an entry whose
# gradient is near $10^{-10}$?

# %%
def gradient_check(loss, params, grads, n_entries, h, seed):
    """[(name, index, analytic, numeric, rel_error)] for n_entries distinct random entries of params."""
    raise NotImplementedError("exercise 10.6")


# %%
check("10.6", gradient_check)
