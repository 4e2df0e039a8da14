"""Checks of lesson 10's exercises (training GMA without a framework).

Each check builds its own seeded inputs at small sizes, calls the answer
and compares with an independent result: ``refimpl.model``'s cross-entropy
backward and central finite differences, ``refimpl.optim.adam_step``, and
``refimpl.layers``' multi-head forward and backward.  Each runs in well
under a second.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from _course import exercise
from refimpl import layers, model, optim
from refimpl.gradcheck import relative_error


def _shape(a, expected, what):
    a = np.asarray(a)
    assert a.shape == expected, f"{what}: expected shape {expected}, got {a.shape}"
    return a


def _compare(got, expected, what, tol):
    got = _shape(got, expected.shape, what)
    assert np.all(np.isfinite(got)), f"{what}: non-finite entries at {np.argwhere(~np.isfinite(got))[:3].tolist()}"
    err = np.abs(got - expected)
    worst = np.unravel_index(np.argmax(err), err.shape)
    rel = err.max() / max(np.max(np.abs(expected)), 1e-300)
    assert rel <= tol, (
        f"{what}: entry {tuple(int(i) for i in worst)} is {float(got[worst])!r}, expected {float(expected[worst])!r} "
        f"(max difference {err.max():.1e}, {rel:.1e} relative to the largest entry; allowed {tol:.0e})"
    )


@exercise("10.1", "The cross-entropy backward", 1)
def check_cross_entropy_grad(cross_entropy_grad):
    """``cross_entropy_grad(logits, targets) -> dL/dlogits``, shape (B, C).

    ``L = -(1/B) sum_b log softmax(logits_b)[targets_b]``, the mean over the
    rows; logits may be of size 1e3 (softmax must subtract the row maximum).
    """
    rng = np.random.default_rng(101)
    B, C = 4, 5
    for scale in (1.0, 1e3):
        logits = rng.standard_normal((B, C)) * scale
        targets = rng.integers(0, C, size=B)
        got = cross_entropy_grad(logits.copy(), targets.copy())
        _, cache = model.cross_entropy_forward(logits, targets)
        expected = model.cross_entropy_backward(cache)
        # softmax(z) - onehot, divided by B: a few roundings per entry of size <= 1/B; 1e-13 relative is ~100 u
        _compare(got, expected, f"dL/dlogits of {B} rows, {C} classes, logits of size ~{scale:g}", 1e-13)
    # the rows of the gradient sum to zero: softmax sums to 1 and so does the one-hot
    assert np.allclose(np.sum(got, axis=1), 0.0, atol=1e-15), f"each row should sum to 0, got {np.sum(got, axis=1)}"
    # and central differences of the loss agree at order-one logits (h = 1e-6: error ~ u L / h ~ 1e-10)
    logits = rng.standard_normal((B, C))
    targets = rng.integers(0, C, size=B)
    got = _shape(cross_entropy_grad(logits.copy(), targets.copy()), (B, C), "dL/dlogits")
    h = 1e-6
    numeric = np.zeros((B, C))
    for idx in np.ndindex(B, C):
        e = np.zeros((B, C))
        e[idx] = h
        numeric[idx] = (model.cross_entropy_forward(logits + e, targets)[0] - model.cross_entropy_forward(logits - e, targets)[0]) / (2 * h)
    err = relative_error(got, numeric)
    assert err <= 1e-6, f"central differences of the loss differ from your gradient by {err:.1e} relative (allowed 1e-6)"


@exercise("10.2", "One AdamW step", 2)
def check_adamw_step(adamw_step):
    """``adamw_step(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay) -> (theta, m, v)``, each of theta's shape.

    Step ``t = 1, 2, ...`` of AdamW on one weight matrix (decayed), no
    clipping: new moments, bias-corrected, the update ``m_hat / (sqrt(v_hat)
    + delta)`` plus the decoupled decay ``weight_decay * theta``, times ``lr``.
    """
    rng = np.random.default_rng(102)
    shape = (3, 4)
    theta0 = rng.standard_normal(shape)
    hyper = dict(lr=0.01, rho1=0.9, rho2=0.999, delta=1e-8)
    for weight_decay in (0.0, 0.1):
        theta, m, v = theta0.copy(), np.zeros(shape), np.zeros(shape)
        params, state = {"W": theta0.copy()}, optim.adam_init({"W": theta0})
        for t in range(1, 4):
            g = rng.standard_normal(shape) * np.logspace(-7, 1, shape[0] * shape[1]).reshape(shape)  # tiny to large
            g[0, 0] = 0.0  # a parameter that gets no gradient
            out = adamw_step(theta.copy(), g.copy(), m.copy(), v.copy(), t, hyper["lr"], hyper["rho1"], hyper["rho2"],
                             hyper["delta"], weight_decay)
            assert isinstance(out, tuple) and len(out) == 3, "return the tuple (theta, m, v)"
            theta, m, v = (_shape(a, shape, f"step {t}: {n}") for a, n in zip(out, ("theta", "m", "v")))
            params, state, _ = optim.adam_step(params, {"W": g}, state, lr=hyper["lr"], beta1=hyper["rho1"],
                                               beta2=hyper["rho2"], eps=hyper["delta"], weight_decay=weight_decay)
            # the same formula, entry by entry: only the order of a few roundings can differ; 1e-13 relative is ~500 u
            what = f"weight_decay={weight_decay}, step t={t}"
            _compare(m, state.m["W"], f"{what}: the first moment m", 1e-13)
            _compare(v, state.v["W"], f"{what}: the second moment v", 1e-13)
            _compare(theta - theta0, params["W"] - theta0, f"{what}: the change of theta from its start", 1e-10)
            theta = params["W"].copy()  # go on from the reference, so that one wrong step is not counted thrice


@exercise("10.3", "The multi-head layer's forward", 2)
def check_multihead_forward(multihead_forward):
    """``multihead_forward(x, params) -> y``: the bidirectional multi-head GMA layer, shape (B, N, d_model).

    ``params`` is a ``refimpl.layers.MultiheadGMAParams`` (``W_q``, ``W_k``,
    ``W_v``, ``W_o``, ``means``, ``raw_variances``, ``logits``); head ``h``
    uses the ``h``-th block of columns of the projections.
    """
    rng = np.random.default_rng(103)
    B, N, d_model, H, d_r, d_v, K = 2, 5, 4, 2, 2, 3, 3  # H d_v = 6 != d_model: a missing W_o changes the shape
    p = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=5)
    p = p._replace(logits=rng.standard_normal((H, K)), means=rng.standard_normal((H, K, d_r)))
    x = rng.standard_normal((B, N, d_model))
    got = multihead_forward(x.copy(), p)
    expected = layers.multihead_gma(x, p)
    # the same products per head, possibly in another order: a few roundings on outputs of order one
    _compare(got, expected, f"the layer's output (B, N, d_model) = {(B, N, d_model)}", 1e-12)


_GRAD_FIELDS = ("x",) + layers.MultiheadGMAParams._fields


@exercise("10.4", "The multi-head layer's backward", 3)
def check_multihead_backward(multihead_backward):
    """``multihead_backward(grad_out, x, params) -> grads``: a dict with the keys x, W_q, W_k, W_v, W_o, means, raw_variances, logits.

    The gradients of ``L = sum(grad_out * y)``, ``y`` the bidirectional
    layer's output, each of the shape of what it differentiates; the GMM
    gradients summed over the batch.
    """
    rng = np.random.default_rng(104)
    B, N, d_model, H, d_r, d_v, K = 2, 4, 4, 2, 2, 3, 3
    p = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=6)
    p = p._replace(logits=rng.standard_normal((H, K)), means=rng.standard_normal((H, K, d_r)))
    x = rng.standard_normal((B, N, d_model))
    G = rng.standard_normal((B, N, d_model))
    got = multihead_backward(G.copy(), x.copy(), p)
    assert isinstance(got, Mapping), f"return a dict with the keys {list(_GRAD_FIELDS)}, got {type(got).__name__}"
    missing = [f for f in _GRAD_FIELDS if f not in got]
    assert not missing, f"the dict lacks the keys {missing}"
    _, cache = layers.multihead_gma_forward(x, p)
    expected = layers.multihead_gma_backward(G, cache)  # checked against central differences in lesson 10, section 1
    for f in _GRAD_FIELDS:
        # the same sums in possibly another order; the responsibility backward subtracts row means, so allow 1e-10
        _compare(got[f], getattr(expected, f), f"dL/d{f}", 1e-10)
