"""Hidden cases of lesson 10's exercises, for the grader (``tutorials/course_grader.py``); not in the student build.

``SEEDS``: the public check run again with its generators seeded otherwise.
``CASES``: other sizes and edge cases (one row, one head, a late AdamW step),
with the public check's tolerances.  ``ORACLE_CALLS``: answers that call the
function the check compares with; they must be refused.
"""

from __future__ import annotations

import numpy as np

import _exercises_10 as public
from app import layers, model, optim

SEEDS = {"10.1": (1, 2), "10.2": (1, 2), "10.3": (1, 2), "10.4": (1,)}


def ce_one_row_two_classes(cross_entropy_grad):
    """one row of two classes, and eight rows that all target class 0 with logits of size 1e5"""
    rng = np.random.default_rng(10101)
    for logits, targets in ((np.array([[0.3, -0.2]]), np.array([1])),
                            (rng.standard_normal((8, 3)) * 1e5, np.zeros(8, dtype=int))):
        got = cross_entropy_grad(logits.copy(), targets.copy())
        _, cache = model.cross_entropy_forward(logits, targets)
        public._compare(got, model.cross_entropy_backward(cache), f"dL/dlogits of {logits.shape}", 1e-13)


def adamw_late_step(adamw_step):
    """a vector parameter at step t = 1000 (bias correction near 1), decayed"""
    rng = np.random.default_rng(10201)
    theta0 = rng.standard_normal(5)
    m, v = rng.standard_normal(5) * 0.1, rng.random(5) * 0.01
    g = rng.standard_normal(5)
    hyper = dict(lr=1e-3, rho1=0.9, rho2=0.99, delta=1e-8, weight_decay=0.05)
    out = adamw_step(theta0.copy(), g.copy(), m.copy(), v.copy(), 1000, *hyper.values())
    assert isinstance(out, tuple) and len(out) == 3, "return the tuple (theta, m, v)"
    state = optim.adam_init({"W": theta0})._replace(m={"W": m.copy()}, v={"W": v.copy()}, step=999)
    params, state, _ = optim.adam_step({"W": theta0.copy()}, {"W": g}, state, lr=hyper["lr"], beta1=hyper["rho1"],
                                       beta2=hyper["rho2"], eps=hyper["delta"], weight_decay=hyper["weight_decay"])
    public._compare(out[1], state.m["W"], "t = 1000: the first moment m", 1e-13)
    public._compare(out[2], state.v["W"], "t = 1000: the second moment v", 1e-13)
    public._compare(out[0] - theta0, params["W"] - theta0, "t = 1000: the change of theta", 1e-10)


def forward_one_and_three_heads(multihead_forward):
    """one head, and three heads of unequal routing and value widths"""
    rng = np.random.default_rng(10301)
    for B, N, d_model, H, d_r, d_v, K in ((1, 3, 3, 1, 2, 2, 2), (2, 4, 5, 3, 1, 2, 4)):
        p = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=7)
        p = p._replace(logits=rng.standard_normal((H, K)), means=rng.standard_normal((H, K, d_r)))
        x = rng.standard_normal((B, N, d_model))
        public._compare(multihead_forward(x.copy(), p), layers.multihead_gma(x, p),
                        f"H = {H}, the layer's output {(B, N, d_model)}", 1e-12)


def backward_one_head(multihead_backward):
    """one head, one sequence"""
    rng = np.random.default_rng(10401)
    B, N, d_model, H, d_r, d_v, K = 1, 3, 3, 1, 2, 2, 2
    p = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=8)
    p = p._replace(logits=rng.standard_normal((H, K)), means=rng.standard_normal((H, K, d_r)))
    x, G = rng.standard_normal((B, N, d_model)), rng.standard_normal((B, N, d_model))
    got = multihead_backward(G.copy(), x.copy(), p)
    _, cache = layers.multihead_gma_forward(x, p)
    expected = layers.multihead_gma_backward(G, cache)
    for f in ("x",) + layers.MultiheadGMAParams._fields:
        assert f in got, f"the dict lacks the key {f!r}"
        public._compare(got[f], getattr(expected, f), f"H = 1: dL/d{f}", 1e-10)


CASES = {"10.1": [ce_one_row_two_classes], "10.2": [adamw_late_step], "10.3": [forward_one_and_three_heads],
         "10.4": [backward_one_head]}

ORACLE_CALLS = {
    "10.1": "def cross_entropy_grad(logits, targets):\n"
            "    _, cache = model.cross_entropy_forward(logits, targets)\n"
            "    return model.cross_entropy_backward(cache)\n",
    "10.2": "def adamw_step(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):\n"
            "    state = optim.adam_init({'W': theta})._replace(m={'W': m}, v={'W': v}, step=t - 1)\n"
            "    params, state, _ = optim.adam_step({'W': theta}, {'W': g}, state, lr=lr, beta1=rho1, beta2=rho2,\n"
            "                                       eps=delta, weight_decay=weight_decay)\n"
            "    return params['W'], state.m['W'], state.v['W']\n",
    "10.3": "def multihead_forward(x, params):\n    return layers.multihead_gma(x, params)\n",
    "10.4": "def multihead_backward(grad_out, x, params):\n"
            "    _, cache = layers.multihead_gma_forward(x, params)\n"
            "    return layers.multihead_gma_backward(grad_out, cache)._asdict()\n",
}
