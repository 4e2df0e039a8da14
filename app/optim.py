r"""AdamW: Adam with bias correction, decoupled weight decay and clipping by the global gradient norm.

One step, for every parameter :math:`\theta` with gradient :math:`g` (after clipping), at step
:math:`t = 1, 2, \dots`:

.. math::

    \|g\| = \Big(\sum_{\text{all parameters}} \sum g^2\Big)^{1/2},\qquad
    g \leftarrow g\cdot\frac{c}{\|g\|}\ \text{ if } \|g\| > c\ \ (c = \text{clip\_norm}),

    m \leftarrow \rho_1 m + (1-\rho_1) g,\qquad v \leftarrow \rho_2 v + (1-\rho_2) g^2,\qquad
    \hat m = \frac{m}{1-\rho_1^t},\qquad \hat v = \frac{v}{1-\rho_2^t},

    \theta \leftarrow \theta - \eta\Big(\frac{\hat m}{\sqrt{\hat v} + \delta} + \lambda\,\theta\Big)

with the decay rates :math:`\rho_1, \rho_2` and the guard :math:`\delta`
named ``beta1``, ``beta2`` and ``eps`` in the code (the names every optimiser
library uses; ``docs/glossary.md`` keeps :math:`\beta` for the precision and
:math:`\epsilon` for the attention guard), the learning rate :math:`\eta`
``lr`` and the decay :math:`\lambda` ``weight_decay``
(Loshchilov and Hutter's AdamW with the learning rate :math:`\eta` multiplying
the decay, as in PyTorch's ``AdamW``).  The decay is *decoupled*: it is not
part of :math:`g`, so it does not enter :math:`m`, :math:`v` or the clipping.

It applies to the weight matrices only: the parameters whose last name
component starts with ``W`` (``layer0.mixer.W_q``, ``layer0.mlp.W1``,
``head.W``, ...; :func:`decays`).  Gains, biases, the token and positional
embeddings and the GMM parameters (``means``, ``raw_variances``, ``logits``)
are not decayed: decay would pull gains and variances towards values that
mean nothing special, and the means towards the origin.

The norm and the clipping factor are computed without overflow: the
gradients are divided by a power of two near their largest entry before
they are squared (exact, so ordinary gradients get the plain sum of squares
bit for bit), and :math:`c/\|g\|` is formed from that scaled norm.  So
gradients of :math:`10^{160}` in float64 or :math:`10^{20}` in float32 are
clipped as gradients of 1 are.  Without clipping, gradients whose squares
overflow the moments' dtype are refused (they would put ``inf`` into
:math:`v`).

:func:`adam_step` is a pure function: it returns new dicts of new arrays and
never modifies its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from refimpl import validation

__all__ = ["AdamState", "adam_init", "adam_step", "decays", "global_norm"]


class AdamState(NamedTuple):
    """The optimiser's state: the number of steps taken and the two moment estimates per parameter."""

    step: int
    m: dict
    v: dict


def decays(name: str) -> bool:
    """Whether weight decay applies to the parameter ``name``: its last ``.``-component starts with ``W``."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    return name.rsplit(".", 1)[-1].startswith("W")


def _global_norm_parts(arrays):
    """Core: ``(r, k)`` with the global norm ``r 2^k``, summed in the arrays' order; no square overflows.

    Every entry is divided by ``2^k`` first, ``k`` from the largest ``|entry|`` (``k = 0`` below 2), so that the
    squares stay below 4: ``||g|| = 2^k ||g / 2^k||``.  A power of two scales each square and each sum exactly,
    so ``r 2^k`` is, bit for bit, the plain ``sqrt(sum of squares)`` wherever that does not overflow.
    """
    arrays = list(arrays)
    largest = max((float(np.max(np.abs(a))) for a in arrays if a.size), default=0.0)
    # largest = m 2^e with 1/2 <= m < 1: entries / 2^(e - 1) lie below 2
    k = max(math.frexp(largest)[1] - 1, 0)
    scaled = arrays if k == 0 else [np.ldexp(a, -k) for a in arrays]
    return math.sqrt(sum(float(np.sum(a * a)) for a in scaled)), k


def _ldexp(r, k):
    """Core: ``r 2^k`` as a float, ``inf`` when it exceeds the largest float64."""
    try:
        return math.ldexp(r, k)
    except OverflowError:
        return math.inf


def _global_norm(arrays):
    """Core: ``sqrt(sum of squares)`` over every array, summed in the arrays' order (float), without overflow."""
    return _ldexp(*_global_norm_parts(arrays))


def global_norm(grads) -> float:
    """The norm of all the gradients taken as one vector, ``sqrt(sum_name sum grads[name]**2)``.

    Computed without overflow (module docstring): gradients of
    ``1e160`` in float64 or ``1e20`` in float32 have a norm that fits a
    float64, and get it; ``inf`` only for a norm beyond the largest float64.

    Parameters
    ----------
    grads : dict of str -> array
    """
    return _global_norm(_check_arrays(grads, "grads").values())


def _check_arrays(d, name):
    if not isinstance(d, Mapping):
        raise TypeError(f"{name}: expected a dict name -> array, got {type(d).__name__}")
    return {k: validation.as_float_array(a, f"{name}[{k!r}]") for k, a in d.items()}


def _check_like(d, name, ref, ref_name):
    d = _check_arrays(d, name)
    if list(d) != list(ref):
        missing = [k for k in ref if k not in d]
        extra = [k for k in d if k not in ref]
        if not missing and not extra:
            raise ValueError(f"{name}: expected the keys of {ref_name}, in order; got them in the order {list(d)}")
        raise ValueError(f"{name}: expected the keys of {ref_name}, in order; missing {missing}, unexpected {extra}")
    for k, a in d.items():
        validation.check_shape(a, f"{name}[{k!r}]", ref[k].shape)
    return d


def adam_init(params) -> AdamState:
    """A fresh state for ``params``: step 0 and zero moments of each parameter's shape and dtype.

    Parameters
    ----------
    params : dict of str -> array

    Returns
    -------
    AdamState
    """
    params = _check_arrays(params, "params")
    return AdamState(0, {k: np.zeros_like(a) for k, a in params.items()}, {k: np.zeros_like(a) for k, a in params.items()})


def _check_beta(value, name):
    value = validation.check_positive_float(value, name, allow_zero=True)
    if value >= 1:
        raise ValueError(f"{name}: expected a number in [0, 1), got {value!r}")
    return value


def _check_step(params, grads, state, lr, beta1, beta2, eps, weight_decay, clip_norm):
    params = _check_arrays(params, "params")
    grads = _check_like(grads, "grads", params, "params")
    if not isinstance(state, AdamState):
        raise TypeError(f"state: expected an AdamState (from adam_init), got {type(state).__name__}")
    step = validation.check_int(state.step, "state.step", minimum=0)
    m = _check_like(state.m, "state.m", params, "params")
    v = _check_like(state.v, "state.v", params, "params")
    bad = [k for k, a in v.items() if np.any(a < 0)]
    if bad:
        raise ValueError(f"state.v: expected nonnegative second moments, got a negative entry in {bad[0]!r}")
    lr = validation.check_positive_float(lr, "lr")
    beta1 = _check_beta(beta1, "beta1")
    beta2 = _check_beta(beta2, "beta2")
    eps = validation.check_positive_float(eps, "eps")
    weight_decay = validation.check_positive_float(weight_decay, "weight_decay", allow_zero=True)
    if clip_norm is not None:
        clip_norm = validation.check_positive_float(clip_norm, "clip_norm")
    _check_squares_fit(params, grads, clip_norm)
    return params, grads, AdamState(step, m, v), lr, beta1, beta2, eps, weight_decay, clip_norm


def _check_squares_fit(params, grads, clip_norm):
    """Refuse gradients whose squares, after clipping, overflow the dtype of the second moment ``v``."""
    for k, g in grads.items():
        largest = float(np.max(np.abs(g))) if g.size else 0.0
        # after clipping every |g_i| is at most clip_norm (and never grows)
        bound = largest if clip_norm is None else min(largest, clip_norm)
        dtype = min((g.dtype, params[k].dtype), key=lambda t: np.finfo(t).max)
        limit = math.sqrt(float(np.finfo(dtype).max))
        if bound > limit:
            raise ValueError(
                f"grads[{k!r}]: expected entries whose squares fit {np.dtype(dtype).name} (|g| <= {limit:.3g}) for the "
                f"second moment, got |g| = {largest:.3g}; clip the gradients (clip_norm) or scale the loss down"
            )


def _adam_step(params, grads, state, lr, beta1, beta2, eps, weight_decay, clip_norm):
    """Core of :func:`adam_step` on checked arguments."""
    root, k2 = _global_norm_parts(grads.values())
    norm = _ldexp(root, k2)
    # clipping by the global norm: g <- g c / ||g|| when ||g|| > c (one factor for every parameter),
    # c / ||g|| = (c / r) 2^-k from the parts of the norm, finite even where ||g|| itself overflows
    scale = math.ldexp(clip_norm / root, -k2) if clip_norm is not None and norm > clip_norm else 1.0
    t = state.step + 1
    # bias corrections 1 - beta^t: E[m_t] = (1 - beta1^t) E[g] for a stationary gradient
    c1 = 1.0 - beta1**t
    c2 = 1.0 - beta2**t
    new_params, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k] * scale if scale != 1.0 else grads[k]
        m = beta1 * state.m[k] + (1.0 - beta1) * g
        v = beta2 * state.v[k] + (1.0 - beta2) * (g * g)
        update = (m / c1) / (np.sqrt(v / c2) + eps)
        if weight_decay and decays(k):
            # decoupled decay: lr * lambda * theta, outside the moments
            update = update + weight_decay * p
        new_params[k] = (p - lr * update).astype(p.dtype, copy=False)
        new_m[k] = m.astype(p.dtype, copy=False)
        new_v[k] = v.astype(p.dtype, copy=False)
    return new_params, AdamState(t, new_m, new_v), norm


def adam_step(params, grads, state, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, clip_norm=None):
    """One AdamW step (module docstring); returns new dicts, the inputs are not modified.

    Parameters
    ----------
    params, grads : dict of str -> array
        The same keys, in the same order, and shapes.
    state : AdamState
        From :func:`adam_init` or the previous step.
    lr : float
        The learning rate ``eta`` (> 0).
    beta1, beta2 : float, default 0.9, 0.999
        Moment decay rates, in ``[0, 1)``.
    eps : float, default 1e-8
        Added to ``sqrt(v_hat)`` (> 0).
    weight_decay : float, default 0.0
        ``lambda`` (>= 0), applied to the parameters :func:`decays` selects.
    clip_norm : float, optional
        Rescale the gradients when their global norm exceeds it (> 0); no clipping by default.

    Returns
    -------
    new_params : dict of str -> ndarray
    new_state : AdamState
        ``step + 1`` and the new moments.
    grad_norm : float
        The global norm of ``grads`` before clipping.

    Raises
    ------
    ValueError
        Naming the argument: bad options, keys or shapes, non-finite or
        negative moments, non-finite gradients, or gradients whose squares
        (after clipping) overflow the parameters' dtype.
    """
    return _adam_step(*_check_step(params, grads, state, lr, beta1, beta2, eps, weight_decay, clip_norm))
