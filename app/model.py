r"""A small sequence model around the mixers of the reference, every piece a hand-derived forward/backward pair.

Shapes: ``tokens`` are integers ``(B, N)`` with ``N <= max_len``; the
residual stream is ``(B, N, d)`` with ``d = d_model``; there are ``H``
heads of width ``d_h = d / H``.  Every backward returns new arrays; the
gradients of a parameter used at several positions (or by several
sequences) are summed.

Architecture
------------
.. math::

    x^{(0)}_{bt} = E[\text{tok}_{bt}] + P_t,\qquad
    x \leftarrow x + \operatorname{Mixer}(\operatorname{LN}_1(x)),\qquad
    x \leftarrow x + \operatorname{MLP}(\operatorname{LN}_2(x))

for each of the ``n_layers`` pre-norm residual blocks, then a final layer
norm and a head:

* ``"classify"``: mean pooling over the non-pad tokens
  (:math:`m_{bt} = [\text{tok}_{bt} \ne \text{pad}]`,
  :math:`\bar x_b = \sum_t m_{bt} x_{bt} / \max(1, \sum_t m_{bt})`, a
  sequence of pads only pools to 0), then :math:`\bar x W + c`, logits
  ``(B, n_classes)``;
* ``"lm"``: :math:`x_{bt} W + c` at every position, logits ``(B, N, vocab_size)``.

The loss is the softmax cross-entropy, the mean over the counted rows.

The attention over padding tokens is **not masked**: every mixer reads the
pads like any other token (the model learns to ignore them, and the mean
pooling of the classifier excludes them).

Pieces and their backward
-------------------------
With :math:`G = \partial L/\partial(\text{output})` of each piece:

* **Embedding lookup** :math:`y_{bt} = E[\text{tok}_{bt}]`: :math:`dE[v] = \sum_{bt:\,\text{tok}_{bt}=v} G_{bt}`,
  a scatter-add (``np.add.at``, so repeated tokens accumulate).
* **Learned positions** :math:`y_{bt} = x_{bt} + P_t`: :math:`dx = G`,
  :math:`dP_t = \sum_b G_{bt}` for :math:`t < N`, zero for the positions
  ``N .. max_len - 1`` that the batch does not reach.
* **Layer norm** over the last axis, :math:`\hat x = (x - \mu)/\sqrt{\sigma^2 + \epsilon}`
  (:math:`\epsilon = 10^{-5}`, biased variance), :math:`y = g\odot\hat x + c`:
  :math:`dg = \sum G\odot\hat x`, :math:`dc = \sum G`, and with :math:`\hat G = G\odot g`,

  .. math::

      dx = \frac{1}{\sqrt{\sigma^2+\epsilon}}\Big(\hat G - \overline{\hat G} - \hat x\,\overline{\hat G\odot\hat x}\Big)

  (bars are means over the last axis).
* **MLP** :math:`h = xW_1 + b_1`, :math:`a = \operatorname{GELU}(h)`, :math:`y = aW_2 + b_2`,
  with the tanh form :math:`\operatorname{GELU}(h) = \tfrac12 h(1 + \tanh u)`,
  :math:`u = \sqrt{2/\pi}\,(h + 0.044715 h^3)`:
  :math:`dW_2 = a^\top G`, :math:`db_2 = \sum G`, :math:`da = G W_2^\top`,
  :math:`dh = da \odot \operatorname{GELU}'(h)` with
  :math:`\operatorname{GELU}'(h) = \tfrac12(1+\tanh u) + \tfrac12 h (1-\tanh^2 u)\sqrt{2/\pi}(1 + 3\cdot 0.044715 h^2)`,
  :math:`dW_1 = x^\top dh`, :math:`db_1 = \sum dh`, :math:`dx = dh\,W_1^\top`.
* **Pre-norm residual** :math:`y = x + F(\operatorname{LN}(x))`:
  :math:`dx = G + \operatorname{LN}^\top(F^\top(G))` (the identity path adds ``G``).
* **Mixers**, one interface ``mixer_forward(x, params, config) -> (y, cache)``,
  ``mixer_backward(dy, cache) -> (dx, grads)``:

  - ``"gma"``: :func:`app.layers.multihead_gma_forward` /
    :func:`~app.layers.multihead_gma_backward`: ``H`` heads, each with
    its own GMM of ``K = n_components`` diagonal components in ``d_r = d_route``
    dimensions, values of width ``d_v = d / H``; causal when ``config.causal``.
  - ``"softmax"`` and ``"linear"``: multi-head attention
    :math:`Y = [O^{(1)}\cdots O^{(H)}]W_O`, :math:`O^{(h)} = \operatorname{Attn}(XW_Q^{(h)}, XW_K^{(h)}, XW_V^{(h)})`
    per (sequence, head), by :func:`refimpl.attention.softmax_attention_forward`
    (scale :math:`1/\sqrt{d_h}`) and :func:`refimpl.attention.linear_attention_forward`
    (``elu + 1`` features); causal when ``config.causal``.  Backward as in
    :mod:`app.layers`: :math:`dW_O = \sum_b O_b^\top G_b`, :math:`dO = GW_O^\top`,
    the attention's backward per (sequence, head) gives :math:`dQ, dK, dV`, then
    :math:`dW_Q = \sum_b X_b^\top dQ_b` (likewise K, V) and
    :math:`dX = dQ W_Q^\top + dK W_K^\top + dV W_V^\top`.
  - ``"ovq"``: the same projections around :func:`refimpl.ovq.ovq_attention_forward`
    per (sequence, head), with ``max_size = ovq_max_size`` and
    ``chunk_size = ovq_chunk_size``.  OVQ attention is **always causal**, also
    under the classifier head and whatever ``config.causal`` says; its
    dictionary starts empty for every sequence (and head).  Its backward is
    :func:`refimpl.ovq.ovq_attention_backward`, which holds the discrete choices
    of the forward (seeds, assignments, counts) fixed.
* **Kernels**: the backend of :mod:`app.backend` (numba's fused kernels of
  :mod:`cpu` when numba is installed, NumPy otherwise) computes the mixers,
  every sequence and head in one call; both give the same results to
  rounding.
* **Final layer norm**: as above.
* **Heads**: classify, :math:`dW = \bar x^\top G`, :math:`dc = \sum_b G_b`,
  :math:`dx_{bt} = m_{bt}\,(G_b W^\top)/\max(1, \sum_t m_{bt})`; lm,
  :math:`dW = \sum_{bt} x_{bt}^\top G_{bt}`, :math:`dc = \sum_{bt} G_{bt}`,
  :math:`dx = G W^\top`.
* **Softmax cross-entropy**, the mean over the ``n`` counted rows,
  :math:`L = -\frac1n\sum_{i} \log\operatorname{softmax}(z_i)_{y_i}` (the
  log-softmax with the row maximum subtracted, :func:`refimpl.numerics.log_softmax`):
  :math:`\partial L/\partial z_i = (\operatorname{softmax}(z_i) - e_{y_i})/n`
  for a counted row, 0 for the others.

The model's parameters
----------------------
A flat, ordered ``dict`` name -> array (:func:`param_shapes` lists them):
``embed`` ``(vocab_size, d)``, ``pos`` ``(max_len, d)``; per layer ``l``,
``layer{l}.ln1.gain``/``.bias`` ``(d,)``, ``layer{l}.mixer.W_q``, ``W_k``,
``W_v``, ``W_o`` (and for GMA ``means``, ``raw_variances`` ``(H, K, d_r)``,
``logits`` ``(H, K)``), ``layer{l}.ln2.gain``/``.bias``,
``layer{l}.mlp.W1`` ``(d, mlp_hidden)``, ``b1``, ``W2`` ``(mlp_hidden, d)``,
``b2``; ``ln_f.gain``/``.bias``; ``head.W`` ``(d, n_classes or vocab_size)``,
``head.b``.  :func:`init_params` draws them from one
``np.random.default_rng(seed)`` in this order: the token embedding standard
normal (a one-hot input has fan-in 1), the positions normal with standard
deviation 0.1 (so that the token identity dominates at the start), every
matrix Gaussian with variance ``1 / fan_in``, biases 0, gains 1; the GMA
parameters by :func:`app.layers.init_multihead_gma` on the same generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from refimpl import numerics, validation
from . import backend, layers
from refimpl.attention import feature_attention_backward

__all__ = [
    "MIXERS",
    "HEADS",
    "LN_EPS",
    "ModelConfig",
    "ModelCache",
    "CrossEntropyCache",
    "check_config",
    "param_shapes",
    "init_params",
    "embedding_forward",
    "embedding_backward",
    "positional_forward",
    "positional_backward",
    "layer_norm_forward",
    "layer_norm_backward",
    "gelu",
    "gelu_derivative",
    "mlp_forward",
    "mlp_backward",
    "mixer_forward",
    "mixer_backward",
    "block_forward",
    "block_backward",
    "classify_head_forward",
    "pack",
    "classify_head_backward",
    "lm_head_forward",
    "lm_head_backward",
    "model_forward",
    "model_backward",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "loss_and_grads",
    "gma_routing",
]

#: Accepted values of ``ModelConfig.mixer``.
MIXERS = ("gma", "softmax", "linear", "ovq")
#: Accepted values of ``ModelConfig.head``.
HEADS = ("classify", "lm")
#: The ``epsilon`` of every layer norm, added to the variance.
LN_EPS = 1e-5
#: Standard deviation of the initial positional embeddings.
POS_INIT_STD = 0.1

# GELU, tanh form: 0.5 h (1 + tanh(sqrt(2 / pi) (h + 0.044715 h^3)))
_GELU_C = float(np.sqrt(2.0 / np.pi))
_GELU_A = 0.044715


class ModelConfig(NamedTuple):
    """The sizes and choices of a model; :func:`check_config` checks them."""

    vocab_size: int
    max_len: int
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 2
    mixer: str = "gma"  # "gma" | "softmax" | "linear" | "ovq"
    causal: bool = False
    head: str = "classify"  # "classify" (mean pooling over non-pad tokens) | "lm" (per token)
    n_classes: int = 10
    n_components: int = 16
    d_route: int = 8
    mlp_hidden: int = 64
    ovq_max_size: int = 16
    ovq_chunk_size: int = 16
    pad_id: int = 0


# ---------------------------------------------------------------------------
# Configuration and parameters
# ---------------------------------------------------------------------------


def check_config(config) -> ModelConfig:
    """Check every field of a :class:`ModelConfig`; errors name the field (``config.d_model: ...``).

    Sizes are integers >= 1 (``vocab_size`` >= 2, ``n_classes`` >= 2),
    ``d_model`` is a multiple of ``n_heads``, ``pad_id`` is a token
    (``0 <= pad_id < vocab_size``), ``mixer`` is one of :data:`MIXERS`,
    ``head`` one of :data:`HEADS`, ``causal`` a bool, and the ``"lm"`` head
    needs ``causal=True`` (otherwise position ``t`` would read the token it
    predicts).

    Returns
    -------
    ModelConfig
        The same values as Python ints, bools and strs.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    minimum = dict(vocab_size=2, n_classes=2)
    ints = {
        f: validation.check_int(getattr(config, f), f"config.{f}", minimum=minimum.get(f, 1))
        for f in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "n_classes", "n_components",
                  "d_route", "mlp_hidden", "ovq_max_size", "ovq_chunk_size")
    }
    pad_id = validation.check_int(config.pad_id, "config.pad_id", minimum=0)
    if pad_id >= ints["vocab_size"]:
        raise ValueError(f"config.pad_id: expected a token id < vocab_size = {ints['vocab_size']}, got {pad_id}")
    if ints["d_model"] % ints["n_heads"]:
        raise ValueError(
            f"config.d_model: expected a multiple of n_heads = {ints['n_heads']} (heads of width d_model / n_heads), "
            f"got {ints['d_model']}"
        )
    mixer = validation.check_option(config.mixer, "config.mixer", MIXERS)
    head = validation.check_option(config.head, "config.head", HEADS)
    causal = validation.check_bool(config.causal, "config.causal")
    if head == "lm" and not causal:
        raise ValueError("config.causal: the lm head predicts the next token and needs causal=True, got False")
    return ModelConfig(**ints, mixer=mixer, causal=causal, head=head, pad_id=pad_id)


def _mixer_shapes(c):
    d, H = c.d_model, c.n_heads
    if c.mixer == "gma":
        K, d_r = c.n_components, c.d_route
        return {
            "W_q": (d, H * d_r), "W_k": (d, H * d_r), "W_v": (d, d), "W_o": (d, d),
            "means": (H, K, d_r), "raw_variances": (H, K, d_r), "logits": (H, K),
        }
    return {"W_q": (d, d), "W_k": (d, d), "W_v": (d, d), "W_o": (d, d)}


def _shapes(c):
    """Core of :func:`param_shapes` on a checked config."""
    d = c.d_model
    shapes = {"embed": (c.vocab_size, d), "pos": (c.max_len, d)}
    for layer in range(c.n_layers):
        p = f"layer{layer}."
        shapes[p + "ln1.gain"] = (d,)
        shapes[p + "ln1.bias"] = (d,)
        shapes.update({p + "mixer." + k: s for k, s in _mixer_shapes(c).items()})
        shapes[p + "ln2.gain"] = (d,)
        shapes[p + "ln2.bias"] = (d,)
        shapes[p + "mlp.W1"] = (d, c.mlp_hidden)
        shapes[p + "mlp.b1"] = (c.mlp_hidden,)
        shapes[p + "mlp.W2"] = (c.mlp_hidden, d)
        shapes[p + "mlp.b2"] = (d,)
    n_out = c.n_classes if c.head == "classify" else c.vocab_size
    shapes["ln_f.gain"] = (d,)
    shapes["ln_f.bias"] = (d,)
    shapes["head.W"] = (d, n_out)
    shapes["head.b"] = (n_out,)
    return shapes


def param_shapes(config) -> dict:
    """The parameters of a model: an ordered ``dict`` name -> shape (the order of :func:`init_params`).

    Parameters
    ----------
    config : ModelConfig

    Returns
    -------
    dict of str -> tuple of int
    """
    return _shapes(check_config(config))


def init_params(config, seed=0) -> dict:
    """Random float64 parameters, deterministic in ``seed`` (module docstring: the scales).

    Parameters
    ----------
    config : ModelConfig
    seed : int, default 0
        Seeds one ``numpy.random.default_rng``; draws happen in the order of
        :func:`param_shapes`.

    Returns
    -------
    dict of str -> ndarray
        Flat and ordered like :func:`param_shapes`, float64.
    """
    c = check_config(config)
    seed = validation.check_int(seed, "seed", minimum=0)
    rng = np.random.default_rng(seed)
    shapes = _shapes(c)
    d, H = c.d_model, c.n_heads
    params = {}
    for name, shape in shapes.items():
        if name in params:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name == "embed":
            params[name] = rng.normal(size=shape)
        elif name == "pos":
            params[name] = POS_INIT_STD * rng.normal(size=shape)
        elif name.endswith(".mixer.W_q") and c.mixer == "gma":
            # the GMA layer's own initialisation, on the same generator (it is advanced)
            gp = layers.init_multihead_gma(d, H, c.d_route, d // H, c.n_components, seed=rng)
            prefix = name[: -len("W_q")]
            params.update({prefix + f: getattr(gp, f) for f in layers.MultiheadGMAParams._fields})
        elif leaf == "gain":
            params[name] = np.ones(shape)
        elif leaf in ("bias", "b", "b1", "b2"):
            params[name] = np.zeros(shape)
        else:
            # a matrix (fan_in, fan_out): variance 1 / fan_in
            params[name] = rng.normal(size=shape) / np.sqrt(shape[0])
    return {name: params[name] for name in shapes}


def _check_params(params, config):
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a dict name -> array (from init_params), got {type(params).__name__}")
    shapes = _shapes(config)
    missing = [n for n in shapes if n not in params]
    extra = [n for n in params if n not in shapes]
    if missing or extra:
        raise ValueError(
            f"params: do not match the config (mixer={config.mixer!r}, head={config.head!r}, n_layers={config.n_layers}): "
            f"missing {missing}, unexpected {extra}"
        )
    out = {}
    for name, shape in shapes.items():
        a = validation.as_float_array(params[name], f"params[{name!r}]", ndim=len(shape))
        validation.check_shape(a, f"params[{name!r}]", shape)
        out[name] = a
    dtype = validation.common_float_dtype(*out.values())
    return {n: a.astype(dtype, copy=False) for n, a in out.items()}


def _check_tokens(tokens, config):
    t = np.asarray(tokens)
    if t.dtype == bool or not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"tokens: expected an integer array, got dtype {t.dtype}")
    validation.check_ndim(t, "tokens", 2)
    B, N = t.shape
    if B < 1 or N < 1:
        raise ValueError(f"tokens: expected shape (B, N) with B >= 1 and N >= 1, got {t.shape}")
    if N > config.max_len:
        raise ValueError(f"tokens: sequences of N = {N} tokens exceed config.max_len = {config.max_len}")
    if t.min() < 0 or t.max() >= config.vocab_size:
        bad = t[(t < 0) | (t >= config.vocab_size)][0]
        raise ValueError(f"tokens: expected ids in [0, vocab_size = {config.vocab_size}), got {bad}")
    return t.astype(np.int64, copy=False)


def _check_packed_tokens(tokens, config, cu_seqlens):
    """``(tokens, offsets)``: :func:`_check_tokens`, or for a packed batch ``(1, T)`` its offsets and each length <= max_len."""
    if cu_seqlens is None:
        return _check_tokens(tokens, config), None
    offsets = validation.check_cu_seqlens(cu_seqlens)
    T = np.shape(tokens)[-1] if np.ndim(tokens) == 2 and np.shape(tokens)[0] == 1 else 0
    if np.ndim(tokens) != 2 or np.shape(tokens)[0] != 1:
        raise ValueError(f"tokens: a packed batch is one row (1, T), got shape {np.shape(tokens)}")
    validation.check_packed_end(offsets, np.empty((T, 0)), "tokens")
    longest = int(np.max(np.diff(offsets), initial=0))
    if longest > config.max_len:
        raise ValueError(f"tokens: sequences of N = {longest} tokens exceed config.max_len = {config.max_len}")
    return _check_tokens(tokens, config._replace(max_len=max(T, 1))), offsets


def pack(tokens, targets, pad_id, head="classify"):
    """A padded batch packed: ``(tokens (1, T), targets, cu_seqlens)``, every sequence without its trailing padding.

    ``tokens (B, N)``, padding only at the end of a sequence; ``targets`` ``(B,)`` (kept) for the ``"classify"`` head,
    ``(B, N)`` for ``"lm"`` (packed like the tokens).
    """
    tokens = np.asarray(tokens)
    if tokens.dtype == bool or not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"tokens: expected an integer array, got dtype {tokens.dtype}")
    validation.check_ndim(tokens, "tokens", 2)
    head = validation.check_option(head, "head", HEADS)
    if head == "lm":
        validation.check_shape(np.asarray(targets), "targets", tokens.shape, ("B", "N"))
    keep = tokens != pad_id
    # the length of a sequence: one past its last token that is not padding
    lengths = np.where(keep.any(axis=1), tokens.shape[1] - np.argmax(keep[:, ::-1], axis=1), 0)
    rows = np.arange(tokens.shape[1]) < lengths[:, None]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    packed_targets = targets if head == "classify" else np.asarray(targets)[rows][None]
    return tokens[rows][None], packed_targets, cu_seqlens


def _sub(params, prefix):
    """The entries of ``params`` under ``prefix``, with the prefix removed."""
    return {n[len(prefix):]: a for n, a in params.items() if n.startswith(prefix)}


# ---------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------


class _EmbeddingCache(NamedTuple):
    tokens: np.ndarray
    vocab_size: int


def embedding_forward(tokens, embed):
    """Core: the lookup ``embed[tokens]``; ``tokens (B, N)`` valid ids, ``embed (V, d)``.

    Returns ``(x (B, N, d), cache)``.
    """
    return embed[tokens], _EmbeddingCache(tokens, embed.shape[0])


def embedding_backward(dx, cache):
    """Core: ``dE``, the scatter-add of ``dx (B, N, d)`` into the rows of the looked-up tokens."""
    dembed = np.zeros((cache.vocab_size, dx.shape[-1]), dtype=dx.dtype)
    # dE[v] = sum over the positions holding token v: np.add.at accumulates repeated indices
    np.add.at(dembed, cache.tokens, dx)
    return dembed


def positional_forward(x, pos, positions=None):
    """Core: ``x + pos[:N]`` for ``x (B, N, d)``, ``pos (max_len, d)``; returns ``(y, cache)``.

    A packed batch (``x (1, T, d)``) gives each token its ``positions`` in its own sequence.
    """
    if positions is not None:
        return x + pos[positions], (pos.shape[0], positions)
    return x + pos[: x.shape[1]], pos.shape[0]


def positional_backward(dy, cache):
    """Core: ``(dx, dpos)``: ``dx = dy``, ``dpos[t] = sum_b dy[b, t]`` for ``t < N``, 0 beyond (packed: the sum over the
    tokens at position ``t`` of their sequences)."""
    if isinstance(cache, tuple):
        dpos = np.zeros((cache[0], dy.shape[-1]), dtype=dy.dtype)
        np.add.at(dpos, cache[1], dy[0])
        return dy.copy(), dpos
    dpos = np.zeros((cache, dy.shape[-1]), dtype=dy.dtype)
    dpos[: dy.shape[1]] = dy.sum(axis=0)
    return dy.copy(), dpos


# ---------------------------------------------------------------------------
# Layer norm, MLP
# ---------------------------------------------------------------------------


class _LayerNormCache(NamedTuple):
    xhat: np.ndarray
    inv_std: np.ndarray  # (..., 1)
    gain: np.ndarray


def layer_norm_forward(x, gain, bias):
    """Core: ``gain * (x - mean) / sqrt(var + LN_EPS) + bias`` over the last axis; returns ``(y, cache)``.

    Rows whose largest ``|x|`` exceeds 1 are first divided by a power of two ``s`` near it, so that neither the
    mean nor the sum of squares overflows (rows of 1e160 in float64, 1e20 in float32): a power of two scales
    every sum exactly, so the result is the same, bit for bit, as the plain formula wherever that does not overflow.
    """
    one = x.dtype.type(1)
    # s = 2^k with 1 <= max|x| / s < 2 (frexp: max|x| = m 2^e, 1/2 <= m < 1), and s = 1 for rows of max|x| < 2
    _, e = np.frexp(np.max(np.abs(x), axis=-1, keepdims=True))
    k = np.maximum(e - 1, 0)
    s = np.ldexp(one, k)
    xs = x / s
    mu = xs.mean(axis=-1, keepdims=True)
    xc = xs - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    # var(x) + eps = s^2 (var(x / s) + eps / s^2), so xhat = (x - mean) / sqrt(var + eps) = xc / sqrt(var(x / s) + eps / s^2)
    inv_std_s = one / np.sqrt(var + np.ldexp(x.dtype.type(LN_EPS), -2 * k))
    xhat = xc * inv_std_s
    # the backward's 1 / sqrt(var + eps), in the units of x
    inv_std = inv_std_s / s
    return xhat * gain + bias, _LayerNormCache(xhat, inv_std, gain)


def layer_norm_backward(dy, cache):
    """Core: ``(dx, dgain, dbias)``; the parameter gradients are summed over every leading axis."""
    xhat, inv_std = cache.xhat, cache.inv_std
    lead = tuple(range(dy.ndim - 1))
    dgain = np.sum(dy * xhat, axis=lead)
    dbias = np.sum(dy, axis=lead)
    g = dy * cache.gain
    # dx = (g - mean(g) - xhat mean(g xhat)) / sqrt(var + eps): the Jacobian of the centring and scaling
    dx = (g - g.mean(axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True)) * inv_std
    return dx, dgain, dbias


def gelu(h):
    """Core: GELU in its tanh form, ``0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))``.

    ``h^3`` as ``h * h * h``: ``h**3`` is a call to ``pow`` per entry, 80 times as long.
    """
    return 0.5 * h * (1.0 + np.tanh(_GELU_C * (h + _GELU_A * (h * h * h))))


def gelu_derivative(h):
    """Core: ``d gelu / dh = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 h^2)``, ``t = tanh(u)``."""
    t = np.tanh(_GELU_C * (h + _GELU_A * (h * h * h)))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * h * h)


class _MLPCache(NamedTuple):
    x: np.ndarray
    h: np.ndarray
    a: np.ndarray
    params: dict


def mlp_forward(x, params):
    """Core: ``gelu(x W1 + b1) W2 + b2`` for ``x (..., d)``, ``params`` with keys ``W1, b1, W2, b2``."""
    h = x @ params["W1"] + params["b1"]
    a = gelu(h)
    return a @ params["W2"] + params["b2"], _MLPCache(x, h, a, params)


def mlp_backward(dy, cache):
    """Core: ``(dx, grads)``, ``grads`` a dict with keys ``W1, b1, W2, b2``."""
    x, h, a, p = cache
    d_out, d_hid, d_in = dy.shape[-1], h.shape[-1], x.shape[-1]
    dyf, af, xf = dy.reshape(-1, d_out), a.reshape(-1, d_hid), x.reshape(-1, d_in)
    # y = a W2 + b2: dW2 = a^T dy, da = dy W2^T
    dW2 = af.T @ dyf
    dh = (dyf @ p["W2"].T) * gelu_derivative(h.reshape(-1, d_hid))
    # h = x W1 + b1: dW1 = x^T dh, dx = dh W1^T
    grads = {"W1": xf.T @ dh, "b1": dh.sum(axis=0), "W2": dW2, "b2": dyf.sum(axis=0)}
    return (dh @ p["W1"].T).reshape(x.shape), grads


# ---------------------------------------------------------------------------
# Mixers: one interface, forward(x, params, config) -> (y, cache), backward(dy, cache) -> (dx, grads)
# ---------------------------------------------------------------------------


class _MixerCache(NamedTuple):
    mixer: str
    x: np.ndarray
    params: dict
    heads: np.ndarray  # (B, N, d) concatenated head outputs (attention mixers); None for gma
    inner: object  # MultiheadGMACache, or (backward, H, cache, packed): the cache of every (sequence, head) at once


def _single_head(mixer, config, kern):
    """The forward and backward of the attention mixers, from the backend's kernels ``kern`` (:mod:`app.backend`).

    Every (sequence, head) at once, ``(B, H, N, d_h)``.
    """
    if mixer == "softmax":
        return (lambda q, k, v, **kw: kern.softmax_attention_forward(q, k, v, causal=config.causal, **kw)), kern.softmax_attention_backward
    if mixer == "linear":
        return (lambda q, k, v, **kw: kern.linear_attention_forward(q, k, v, causal=config.causal, **kw)), kern.linear_attention_backward
    # OVQ is causal by construction; a fresh (empty) dictionary for every sequence and head
    return (
        lambda q, k, v, **kw: kern.ovq_attention_forward(q, k, v, max_size=config.ovq_max_size, chunk_size=config.ovq_chunk_size, **kw)
    ), kern.ovq_attention_backward


def mixer_forward(x, params, config, cu_seqlens=None):
    """Core: the token mixer ``config.mixer`` on ``x (B, N, d)``; ``params`` the layer's ``mixer.*`` entries, short names.

    Returns ``(y (B, N, d), cache)``.  With ``cu_seqlens``, ``x`` is a packed batch ``(1, T, d)``: each sequence mixed on
    its own (:mod:`refimpl.varlen`).
    """
    if config.mixer == "gma":
        gp = layers.MultiheadGMAParams(**{f: params[f] for f in layers.MultiheadGMAParams._fields})
        y, cache = layers.multihead_gma_forward(x, gp, causal=config.causal, cu_seqlens=cu_seqlens)
        return y, _MixerCache("gma", x, params, None, cache)
    B, N, d = x.shape
    H = config.n_heads
    dh = d // H
    kern = backend.kernels()
    forward, backward = _single_head(config.mixer, config, kern)
    # the projections of all B N tokens at once, split into H heads of width d_h
    q = (x @ params["W_q"]).reshape(B, N, H, dh)
    k = (x @ params["W_k"]).reshape(B, N, H, dh)
    v = (x @ params["W_v"]).reshape(B, N, H, dh)
    if cu_seqlens is not None:
        # packed: the T tokens (T, H, d_h), each sequence on its own
        per_head, caches = forward(q[0], k[0], v[0], cu_seqlens=cu_seqlens)
        heads = per_head.reshape(B, N, d)
        return heads @ params["W_o"], _MixerCache(config.mixer, x, params, heads, (backward, H, caches, True))
    # every (sequence, head) in one call: (B, H, N, d_h)
    per_head, caches = forward(*(np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)))
    heads = per_head.transpose(0, 2, 1, 3).reshape(B, N, d)
    return heads @ params["W_o"], _MixerCache(config.mixer, x, params, heads, (backward, H, caches, False))


def mixer_backward(dy, cache):
    """Core: ``(dx, grads)`` of :func:`mixer_forward`, ``grads`` keyed like its ``params``."""
    if cache.mixer == "gma":
        g = layers.multihead_gma_backward(dy, cache.inner)
        return g.x, {f: getattr(g, f) for f in layers.MultiheadGMAParams._fields}
    x, p, heads = cache.x, cache.params, cache.heads
    backward, H, caches, packed = cache.inner
    B, N, d = x.shape
    dh = d // H
    # Y = O W_o: dW_o = sum_b O_b^T G_b, dO = G W_o^T
    dW_o = heads.reshape(B * N, d).T @ dy.reshape(B * N, d)
    dheads = (dy @ p["W_o"].T).reshape(B, N, H, dh)
    if packed:
        g = backward(dheads[0], caches)  # packed: gradients (T, H, d_h)
        dq, dk, dv = g.q, g.k, g.v
    else:
        # one cache for every (sequence, head): gradients (B, H, N, d_h)
        g = backward(np.ascontiguousarray(dheads.transpose(0, 2, 1, 3)), caches)
        dq, dk, dv = (a.transpose(0, 2, 1, 3) for a in (g.q, g.k, g.v))
    dq, dk, dv = (a.reshape(B * N, d) for a in (dq, dk, dv))
    xf = x.reshape(B * N, d)
    # Q = X W_q: dW_q = X^T dQ and dX = dQ W_q^T (likewise for k and v)
    dx = dq @ p["W_q"].T + dk @ p["W_k"].T + dv @ p["W_v"].T
    grads = {"W_q": xf.T @ dq, "W_k": xf.T @ dk, "W_v": xf.T @ dv, "W_o": dW_o}
    return dx.reshape(B, N, d), grads


# ---------------------------------------------------------------------------
# The pre-norm residual block
# ---------------------------------------------------------------------------


class _BlockCache(NamedTuple):
    ln1: _LayerNormCache
    mixer: _MixerCache
    ln2: _LayerNormCache
    mlp: _MLPCache


def block_forward(x, params, config, cu_seqlens=None):
    """Core: ``x + mixer(LN1(x))``, then ``+ MLP(LN2(.))``; ``params`` the layer's entries without ``layer{l}.``.

    Returns ``(y (B, N, d), cache)``; ``cu_seqlens`` as in :func:`mixer_forward`.
    """
    a, c1 = layer_norm_forward(x, params["ln1.gain"], params["ln1.bias"])
    m, cm = mixer_forward(a, _sub(params, "mixer."), config, cu_seqlens)
    x = x + m
    b, c2 = layer_norm_forward(x, params["ln2.gain"], params["ln2.bias"])
    f, cf = mlp_forward(b, _sub(params, "mlp."))
    return x + f, _BlockCache(c1, cm, c2, cf)


def block_backward(dy, cache):
    """Core: ``(dx, grads)`` of :func:`block_forward`, ``grads`` keyed like its ``params``."""
    dx, grads, _ = _block_backward(dy, cache)
    return dx, grads


def _block_backward(dy, cache):
    """:func:`block_backward`, also returning ``dL/dm``, the gradient at the mixer's output ``m``."""
    grads = {}
    # y = x1 + MLP(LN2(x1)): dx1 = dy + LN2^T(MLP^T(dy)), the identity path adds dy
    db, g = mlp_backward(dy, cache.mlp)
    grads.update({"mlp." + k: a for k, a in g.items()})
    dx1, grads["ln2.gain"], grads["ln2.bias"] = layer_norm_backward(db, cache.ln2)
    dx1 = dx1 + dy
    # x1 = x + mixer(LN1(x)): dx = dx1 + LN1^T(mixer^T(dx1))
    da, g = mixer_backward(dx1, cache.mixer)
    grads.update({"mixer." + k: a for k, a in g.items()})
    dx, grads["ln1.gain"], grads["ln1.bias"] = layer_norm_backward(da, cache.ln1)
    return dx + dx1, grads, dx1


# ---------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------


class _ClassifyCache(NamedTuple):
    mask: np.ndarray  # (B, N, 1) 1.0 on the non-pad tokens
    count: np.ndarray  # (B, 1) max(1, number of non-pad tokens)
    pooled: np.ndarray  # (B, d)
    W: np.ndarray
    segments: np.ndarray | None = None  # packed: the sequence of each token (T,)


def classify_head_forward(x, tokens, W, b, pad_id, cu_seqlens=None):
    """Core: mean pooling of ``x (B, N, d)`` over the tokens ``!= pad_id``, then ``pooled W + b``; logits ``(B, C)``.

    A packed batch (``x (1, T, d)``, ``cu_seqlens`` of ``S + 1`` offsets) pools each sequence's tokens: logits ``(S, C)``.
    """
    mask = (tokens != pad_id)[..., None].astype(x.dtype)
    if cu_seqlens is not None:
        segments = np.repeat(np.arange(len(cu_seqlens) - 1), np.diff(cu_seqlens))
        count = np.maximum(np.bincount(segments, weights=mask[0, :, 0], minlength=len(cu_seqlens) - 1), 1)[:, None].astype(x.dtype)
        pooled = np.zeros((len(cu_seqlens) - 1, x.shape[-1]), dtype=x.dtype)
        np.add.at(pooled, segments, (x * mask)[0])
        pooled /= count
        return pooled @ W + b, _ClassifyCache(mask, count, pooled, W, segments)
    # a sequence of pads only pools to 0 rather than 0 / 0
    count = np.maximum(mask.sum(axis=1), 1)
    pooled = (x * mask).sum(axis=1) / count
    return pooled @ W + b, _ClassifyCache(mask, count, pooled, W)


def classify_head_backward(dlogits, cache):
    """Core: ``(dx (B, N, d), dW, db)`` of :func:`classify_head_forward`."""
    dpooled = dlogits @ cache.W.T
    # pooled_b = sum_t m_bt x_bt / n_b: dx_bt = m_bt dpooled_b / n_b (packed: b the sequence of token t)
    dx = cache.mask * ((dpooled / cache.count)[cache.segments][None] if cache.segments is not None else (dpooled / cache.count)[:, None, :])
    return dx, cache.pooled.T @ dlogits, dlogits.sum(axis=0)


def lm_head_forward(x, W, b):
    """Core: ``x W + b`` at every position; logits ``(B, N, V)``."""
    return x @ W + b, (x, W)


def lm_head_backward(dlogits, cache):
    """Core: ``(dx, dW, db)`` of :func:`lm_head_forward`, ``dW`` and ``db`` summed over the positions."""
    x, W = cache
    d, V = W.shape
    g = dlogits.reshape(-1, V)
    return dlogits @ W.T, x.reshape(-1, d).T @ g, g.sum(axis=0)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class ModelCache(NamedTuple):
    """What :func:`model_backward` needs from :func:`model_forward`."""

    config: ModelConfig
    tokens: np.ndarray
    dtype: np.dtype
    embedding: _EmbeddingCache
    positions: int
    blocks: tuple  # one _BlockCache per layer
    final_ln: _LayerNormCache
    head: object
    logits_shape: tuple


def _forward(params, tokens, c, cu_seqlens=None):
    """Core of :func:`model_forward` on checked arguments."""
    x, ce = embedding_forward(tokens, params["embed"])
    # packed: each token at its position in its own sequence
    positions = None if cu_seqlens is None else np.arange(tokens.shape[1]) - np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens))
    x, cp = positional_forward(x, params["pos"], positions)
    blocks = []
    for layer in range(c.n_layers):
        x, cb = block_forward(x, _sub(params, f"layer{layer}."), c, cu_seqlens)
        blocks.append(cb)
    x, cf = layer_norm_forward(x, params["ln_f.gain"], params["ln_f.bias"])
    if c.head == "classify":
        logits, ch = classify_head_forward(x, tokens, params["head.W"], params["head.b"], c.pad_id, cu_seqlens)
    else:
        logits, ch = lm_head_forward(x, params["head.W"], params["head.b"])
    dtype = params["embed"].dtype
    return logits, ModelCache(c, tokens, dtype, ce, cp, tuple(blocks), cf, ch, logits.shape)


def model_forward(params, tokens, config, cu_seqlens=None):
    """The logits of the model (module docstring), keeping what :func:`model_backward` needs.

    Parameters
    ----------
    params : dict of str -> array
        From :func:`init_params` (the names and shapes of :func:`param_shapes`).
    tokens : array_like of int, shape (B, N)
        Ids in ``[0, vocab_size)``, ``1 <= N <= max_len``.
    config : ModelConfig
    cu_seqlens : sequence of int, shape (S + 1,), optional
        A packed batch (:func:`pack`): ``tokens`` are ``(1, T)``, the ``S``
        sequences one after another (each at most ``max_len``), each mixed,
        positioned and pooled on its own; the logits are then ``(S,
        n_classes)`` or ``(1, T, vocab_size)``.

    Returns
    -------
    logits : ndarray
        ``(B, n_classes)`` for the ``"classify"`` head, ``(B, N, vocab_size)``
        for ``"lm"``; dtype of the parameters.
    cache : ModelCache
    """
    c = check_config(config)
    params = _check_params(params, c)
    tokens, cu_seqlens = _check_packed_tokens(tokens, c, cu_seqlens)
    return _forward(params, tokens, c, cu_seqlens)


def _backward(g, cache, mixer_output_grads=None):
    """Core of :func:`model_backward`: the gradients, ordered like the parameters.

    ``mixer_output_grads``, a list, receives ``dL/dm`` at each layer's mixer output (last layer first).
    """
    c = cache.config
    grads = {}
    if c.head == "classify":
        dx, grads["head.W"], grads["head.b"] = classify_head_backward(g, cache.head)
    else:
        dx, grads["head.W"], grads["head.b"] = lm_head_backward(g, cache.head)
    dx, grads["ln_f.gain"], grads["ln_f.bias"] = layer_norm_backward(dx, cache.final_ln)
    for layer in reversed(range(c.n_layers)):
        dx, gb, dm = _block_backward(dx, cache.blocks[layer])
        grads.update({f"layer{layer}." + k: a for k, a in gb.items()})
        if mixer_output_grads is not None:
            mixer_output_grads.append(dm)
    dx, grads["pos"] = positional_backward(dx, cache.positions)
    grads["embed"] = embedding_backward(dx, cache.embedding)
    return {name: grads[name] for name in _shapes(c)}


def model_backward(dlogits, cache) -> dict:
    """Hand-derived gradients of :func:`model_forward`; new arrays.

    Parameters
    ----------
    dlogits : array_like
        ``dL/d logits``, the shape of the forward's logits.
    cache : ModelCache
        From :func:`model_forward`.

    Returns
    -------
    dict of str -> ndarray
        The same keys, order and shapes as the parameters.
    """
    validation.check_instance(cache, "cache", ModelCache, "the ModelCache from model_forward")
    labels = ("B", "n_classes") if cache.config.head == "classify" else ("B", "N", "vocab_size")
    g = validation.as_float_array(dlogits, "dlogits", ndim=len(cache.logits_shape))
    validation.check_shape(g, "dlogits", cache.logits_shape, labels)
    return _backward(g.astype(cache.dtype, copy=False), cache)


# ---------------------------------------------------------------------------
# Softmax cross-entropy
# ---------------------------------------------------------------------------


class CrossEntropyCache(NamedTuple):
    """What :func:`cross_entropy_backward` needs: log-probabilities, targets and mask, rows flattened."""

    log_probs: np.ndarray  # (R, C)
    targets: np.ndarray  # (R,) (0 where not counted)
    mask: np.ndarray  # (R,) bool
    count: int
    shape: tuple  # the logits' shape


def _check_cross_entropy(logits, targets, mask):
    logits = validation.as_float_array(logits, "logits")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape (..., C) with C >= 1, got {logits.shape}")
    t = np.asarray(targets)
    if t.dtype == bool or not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"targets: expected an integer array, got dtype {t.dtype}")
    validation.check_shape(t, "targets", logits.shape[:-1])
    if mask is None:
        m = np.ones(t.shape, dtype=bool)
    else:
        m = np.asarray(mask)
        if m.dtype != bool:
            raise TypeError(f"mask: expected a boolean array, got dtype {m.dtype}")
        validation.check_shape(m, "mask", t.shape)
    C = logits.shape[-1]
    bad = m & ((t < 0) | (t >= C))
    if np.any(bad):
        raise ValueError(f"targets: expected class ids in [0, C = {C}) where counted, got {t[bad][0]}")
    return logits, t.astype(np.int64), m


def _cross_entropy(logits, t, m):
    """Core of :func:`cross_entropy_forward`: ``(loss, cache)``."""
    C = logits.shape[-1]
    # log softmax with the row maximum subtracted (refimpl.numerics)
    log_probs = numerics.log_softmax(logits.reshape(-1, C).copy(), axis=1)
    mask = m.ravel()
    targets = np.where(mask, t.ravel(), 0)
    count = int(mask.sum())
    nll = -log_probs[np.arange(targets.size), targets]
    # the mean over the counted rows; no counted row gives 0
    loss = nll[mask].sum() / max(count, 1)
    return logits.dtype.type(loss), CrossEntropyCache(log_probs, targets, mask, count, logits.shape)


def cross_entropy_forward(logits, targets, mask=None):
    """Softmax cross-entropy, the mean over the counted rows.

    Parameters
    ----------
    logits : array_like, shape (..., C)
    targets : array_like of int, shape (...)
        Class ids in ``[0, C)`` (checked where counted only).
    mask : array_like of bool, shape (...), optional
        The rows that count; all of them by default.

    Returns
    -------
    loss : float scalar of the logits' dtype
        ``-mean log softmax(logits)[target]`` over the counted rows (0 when none counts).
    cache : CrossEntropyCache
    """
    return _cross_entropy(*_check_cross_entropy(logits, targets, mask))


def _cross_entropy_backward(cache):
    """Core of :func:`cross_entropy_backward`."""
    # dL/dz = (softmax(z) - onehot(y)) / n on the counted rows, 0 elsewhere
    g = np.exp(cache.log_probs)
    g[np.arange(cache.targets.size), cache.targets] -= 1
    g *= (cache.mask / max(cache.count, 1)).astype(g.dtype)[:, None]
    return g.reshape(cache.shape)


def cross_entropy_backward(cache):
    """``dL/d logits`` of :func:`cross_entropy_forward` (the loss is the last step, so no upstream gradient).

    Parameters
    ----------
    cache : CrossEntropyCache

    Returns
    -------
    ndarray, the logits' shape
    """
    validation.check_instance(cache, "cache", CrossEntropyCache, "the CrossEntropyCache from cross_entropy_forward")
    return _cross_entropy_backward(cache)


# ---------------------------------------------------------------------------
# Loss and gradients; the routing of the GMA layers
# ---------------------------------------------------------------------------


def loss_and_grads(params, tokens, targets, config, cu_seqlens=None):
    """The mean cross-entropy of a batch, the correct predictions, and the gradients of every parameter.

    Parameters
    ----------
    params : dict of str -> array
    tokens : array_like of int, shape (B, N)
    targets : array_like of int
        ``(B,)`` classes for the ``"classify"`` head; ``(B, N)`` next tokens
        for ``"lm"``, where the positions holding ``pad_id`` are not counted.
    config : ModelConfig
    cu_seqlens : sequence of int, optional
        A packed batch, as in :func:`model_forward` (:func:`pack` makes one):
        ``(S,)`` classes, or ``(1, T)`` next tokens.

    Returns
    -------
    loss : float
    n_correct : int
        Counted rows whose arg-max logit (the first on ties) is the target.
    n_counted : int
        ``B`` for ``"classify"``; the non-pad positions for ``"lm"``.
    grads : dict of str -> ndarray
        Keyed and shaped like ``params``.
    """
    c = check_config(config)
    params = _check_params(params, c)
    tokens, cu_seqlens = _check_packed_tokens(tokens, c, cu_seqlens)
    rows = tokens.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    mask = np.ones(rows, dtype=bool) if c.head == "classify" else tokens != c.pad_id
    logits, cache = _forward(params, tokens, c, cu_seqlens)
    _, t, m = _check_cross_entropy(logits, targets, mask)
    loss, ce = _cross_entropy(logits, t, m)
    grads = _backward(_cross_entropy_backward(ce), cache)
    n_correct = int(np.sum((np.argmax(logits, axis=-1) == t) & m))
    return float(loss), n_correct, int(m.sum()), grads


def gma_routing(params, tokens, config, targets=None) -> list:
    """The routing of every GMA layer on ``tokens``: its inputs, GMM and responsibilities.

    Runs the forward (:func:`model_forward`) and reads each layer's GMA
    cache: the routing queries and keys are the layer-normed residual stream
    projected by ``W_q`` and ``W_k``, split into heads.  With ``targets``, it
    also runs the backward of the loss of :func:`loss_and_grads` and returns
    ``dL/dgamma`` of every head: with ``G = dL/dm`` at the layer's output
    ``m = [O^1 ... O^H] W_o``, head ``h`` gets ``dO^h`` from the columns of
    ``G W_o^T`` and the scan's backward
    (:func:`refimpl.attention.feature_attention_backward`) turns it into
    ``dL/dgamma_q`` and ``dL/dgamma_k``.

    Parameters
    ----------
    params : dict of str -> array
    tokens : array_like of int, shape (B, N)
    config : ModelConfig
        With ``mixer="gma"``.

    Returns
    -------
    list of dict, one per layer
        ``"x_q"``, ``"x_k"`` ``(B, H, N, d_r)``; ``"means"``, ``"variances"``
        ``(H, K, d_r)`` (``softplus(raw) + min_variance``); ``"weights"``
        ``(H, K)`` (softmax of the logits); ``"gamma_q"``, ``"gamma_k"``
        ``(B, H, N, K)``, the responsibilities of the routing queries and keys;
        with ``targets``, also ``"grad_gamma_q"`` and ``"grad_gamma_k"``
        ``(B, H, N, K)``, the loss's gradients with respect to them.
    """
    c = check_config(config)
    if c.mixer != "gma":
        raise ValueError(f"config.mixer: gma_routing needs mixer='gma', got {c.mixer!r}")
    params = _check_params(params, c)
    tokens = _check_tokens(tokens, c)
    logits, cache = _forward(params, tokens, c)
    grad_m = None
    if targets is not None:
        mask = np.ones(tokens.shape[0], dtype=bool) if c.head == "classify" else tokens != c.pad_id
        _, t, m = _check_cross_entropy(logits, targets, mask)
        _, ce = _cross_entropy(logits, t, m)
        grad_m = []
        _backward(_cross_entropy_backward(ce), cache, grad_m)
        grad_m.reverse()  # first layer first
    out = []
    for layer, block in enumerate(cache.blocks):
        per = block.mixer.inner.gma  # per[b][h]: the GMACache of sequence b, head h
        H = len(per[0])

        def stack(field, per=per):
            return np.stack([np.stack([getattr(c, field) for c in row]) for row in per])

        logits = params[f"layer{layer}.mixer.logits"]
        out.append({
            "x_q": stack("x_q"),
            "x_k": stack("x_k"),
            "means": params[f"layer{layer}.mixer.means"].copy(),
            "variances": np.stack([per[0][h].variances for h in range(H)]),
            "weights": numerics.softmax(logits.copy(), axis=1),
            "gamma_q": stack("gamma_q"),
            "gamma_k": stack("gamma_k"),
        })
        if grad_m is not None:
            out[-1].update(_responsibility_grads(grad_m[layer], params[f"layer{layer}.mixer.W_o"], per))
    return out


def _responsibility_grads(grad_m, W_o, per):
    """``dL/dgamma_q`` and ``dL/dgamma_k`` ``(B, H, N, K)`` of one GMA layer, from ``dL/dm`` at its output."""
    B, H = len(per), len(per[0])
    # m = [O^1 ... O^H] W_o: dO = G W_o^T, head h in its block of d_v columns
    d_heads = (grad_m @ W_o.T).reshape(B, grad_m.shape[1], H, -1)
    grads = [[feature_attention_backward(d_heads[b, :, h], per[b][h].mixing) for h in range(H)] for b in range(B)]
    return {
        "grad_gamma_q": np.stack([np.stack([g.phi_q for g in row]) for row in grads]),
        "grad_gamma_k": np.stack([np.stack([g.phi_k for g in row]) for row in grads]),
    }
