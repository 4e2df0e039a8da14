"""Checks of lesson 10's exercises (training GMA without a framework).

Each check builds its own seeded inputs at small sizes, calls the answer
and compares with an independent result: ``app.model``'s cross-entropy
backward and central finite differences, ``app.optim.adam_step``, and
``app.layers``' multi-head forward and backward, ``app.model``'s
layer norm and GELU backwards, and a loss whose gradient is known in closed
form.  Each runs in well under a second.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from _course import exercise
from app import layers, model, optim
from refimpl.gradcheck import numerical_gradient, relative_error


def _shape(a, expected, what):
    a = np.asarray(a)
    assert a.shape == expected, _hints.explain(f"{what}: expected shape {expected}, got {a.shape}",
                                               hints=[_hints.shape(a.shape, expected)])
    return a


def _compare(got, expected, what, tol, **options):
    """``got`` against ``expected``, ``tol`` relative to the largest expected entry; a failure diagnoses (``_hints``)."""
    _hints.compare(got, expected, what, tol, relative=True, **options)


@exercise("10.1", "The cross-entropy backward", 1, points=2, partial=True, refuse=("app.model.cross_entropy_backward",))
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
        _compare(got, expected, f"dL/dlogits of {B} rows, {C} classes, logits of size ~{scale:g}", 1e-13,
                 factors={f"B = {B}, the number of rows": B})
    # the rows of the gradient sum to zero: softmax sums to 1 and so does the one-hot
    assert np.allclose(np.sum(got, axis=1), 0.0, atol=1e-15), _hints.explain(
        f"each row should sum to 0, got {np.sum(got, axis=1)}",
        hints=[_hints.not_normalised(got, axis=1, total=0.0, tol=1e-15) and
               "rows that do not sum to zero: softmax(z) sums to one and so does the one-hot, so their difference to zero"])
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
    assert err <= 1e-6, _hints.explain(
        f"central differences of the loss differ from your gradient by {err:.1e} relative (allowed 1e-6)",
        got, numeric, factors={f"B = {B}, the number of rows": B})


@exercise("10.2", "One AdamW step", 2, points=4, partial=True, refuse=("app.optim",))
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
            theta_in, m_in = theta.copy(), m.copy()
            out = adamw_step(theta.copy(), g.copy(), m.copy(), v.copy(), t, hyper["lr"], hyper["rho1"], hyper["rho2"],
                             hyper["delta"], weight_decay)
            assert isinstance(out, tuple) and len(out) == 3, "return the tuple (theta, m, v)"
            theta, m, v = (_shape(a, shape, f"step {t}: {n}") for a, n in zip(out, ("theta", "m", "v")))
            params, state, _ = optim.adam_step(params, {"W": g}, state, lr=hyper["lr"], beta1=hyper["rho1"],
                                               beta2=hyper["rho2"], eps=hyper["delta"], weight_decay=weight_decay)
            # the same formula, entry by entry: only the order of a few roundings can differ; 1e-13 relative is ~500 u
            what = f"weight_decay={weight_decay}, step t={t}"
            lr, rho1, rho2, delta = hyper["lr"], hyper["rho1"], hyper["rho2"], hyper["delta"]
            m_ref, v_ref = state.m["W"], state.v["W"]
            _compare(m, m_ref, f"{what}: the first moment m", 1e-13, known={
                "the decay in the gradient (L2): m built from g + weight_decay theta, not decoupled":
                    rho1 * m_in + (1 - rho1) * (g + weight_decay * theta_in)})
            _compare(v, v_ref, f"{what}: the second moment v", 1e-13)
            _compare(theta - theta0, params["W"] - theta0, f"{what}: the change of theta from its start", 1e-10, known={
                "no bias correction: m / (sqrt(v) + delta) where m_hat / (sqrt(v_hat) + delta) belongs":
                    theta_in - lr * (m_ref / (np.sqrt(v_ref) + delta) + weight_decay * theta_in) - theta0,
                "delta inside the square root: sqrt(v_hat + delta), not sqrt(v_hat) + delta":
                    theta_in - lr * (m_ref / (1 - rho1**t) / np.sqrt(v_ref / (1 - rho2**t) + delta)
                                     + weight_decay * theta_in) - theta0,
            })
            theta = params["W"].copy()  # go on from the reference, so that one wrong step is not counted thrice


@exercise("10.3", "The multi-head layer's forward", 2, points=4, partial=True,
          refuse=("app.layers",))
def check_multihead_forward(multihead_forward):
    """``multihead_forward(x, params) -> y``: the bidirectional multi-head GMA layer, shape (B, N, d_model).

    ``params`` is a ``app.layers.MultiheadGMAParams`` (``W_q``, ``W_k``,
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
    # head h's columns dealt out in turn (h, h + H, ...) instead of the h-th block
    turns = [r * H + h for h in range(H) for r in range(d_r)]
    # the same products per head, possibly in another order: a few roundings on outputs of order one
    _compare(got, expected, f"the layer's output (B, N, d_model) = {(B, N, d_model)}", 1e-12, hints=[
        f"no output projection W_o: your last axis is H d_v = {H * d_v}, the heads concatenated but not projected"
        if np.shape(got)[-1:] == (H * d_v,) else None], known={
        "heads interleaved: head h takes the columns h, h + H, ... of W_q and W_k, not the h-th block":
            layers.multihead_gma(x, p._replace(W_q=p.W_q[:, turns], W_k=p.W_k[:, turns])),
        "the first head's mixture (its means) in every head":
            layers.multihead_gma(x, p._replace(means=np.repeat(p.means[:1], H, axis=0))),
    })


_GRAD_FIELDS = ("x",) + layers.MultiheadGMAParams._fields


@exercise("10.4", "The multi-head layer's backward", 3, points=6, partial=True, refuse=("app.layers",))
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
    first = layers.multihead_gma_backward(G[:1], layers.multihead_gma_forward(x[:1], p)[1])
    for f in _GRAD_FIELDS:
        # the same sums in possibly another order; the responsibility backward subtracts row means, so allow 1e-10
        _compare(got[f], getattr(expected, f), f"dL/d{f}", 1e-10, known={
            "the first sequence only: the mixture's gradients not summed over the batch": getattr(first, f)}
            if f in ("means", "raw_variances", "logits") else None)


# ---------------------------------------------------------------------------
# 10.5 and 10.6: the layer norm and GELU backward, and a gradient check of a whole model
# ---------------------------------------------------------------------------

import _hints  # noqa: E402  (tutorials/_hints.py: what a wrong answer's error pattern suggests)


def _ln_gelu_reference(dy, x, gain, bias, *, inv_std=None, gelu_prime=None, project=True):
    """(dx, dgain, dbias) from app.model's layer norm and GELU, or with one step swapped for a named mistake."""
    z, cache = model.layer_norm_forward(x, gain, bias)
    if inv_std is not None:  # the scaling 1 / sqrt(var + eps) replaced
        xc = x - x.mean(axis=-1, keepdims=True)
        s = inv_std(np.mean(xc * xc, axis=-1, keepdims=True))
        cache = cache._replace(xhat=xc * s, inv_std=s)
        z = cache.xhat * gain + bias
    dz = dy * (model.gelu_derivative(z) if gelu_prime is None else gelu_prime(z))
    if project:
        return model.layer_norm_backward(dz, cache)
    g = dz * gain
    lead = tuple(range(x.ndim - 1))
    dx = (g - g.mean(axis=-1, keepdims=True)) * cache.inv_std
    return dx, np.sum(dz * cache.xhat, axis=lead), np.sum(dz, axis=lead)


@exercise("10.5", "The layer norm and GELU backward", 3, points=6, partial=True,
          refuse=("app.model.layer_norm_backward", "app.model.gelu_derivative", "app.model.mlp_backward"))
def check_ln_gelu_backward(ln_gelu_backward):
    """``ln_gelu_backward(dy, x, gain, bias) -> (dx, dgain, dbias)`` for ``y = gelu(LN(x) gain + bias)``.

    Layer norm over the last axis with ``app.model.LN_EPS`` inside the
    square root, GELU in its tanh form; ``dgain``, ``dbias`` summed over
    every leading axis.  Compared with ``app.model``'s backwards and
    with central differences in ``x``, ``gain`` and ``bias``.
    """
    from scipy.special import ndtr

    rng = np.random.default_rng(105)
    B, N, d = 2, 3, 5
    x = 3.0 * rng.standard_normal((B, N, d)) + 1.5  # rows off-centre and wider than 1: the centring and scaling matter
    gain, bias = 1.0 + 0.5 * rng.standard_normal(d), 0.3 * rng.standard_normal(d)
    dy = rng.standard_normal((B, N, d))
    out = ln_gelu_backward(dy.copy(), x.copy(), gain.copy(), bias.copy())
    assert isinstance(out, tuple) and len(out) == 3, "return the tuple (dx, dgain, dbias)"
    expected = _ln_gelu_reference(dy, x, gain, bias)
    # wrong results the check can name, each computed from app.model's pieces with one step swapped
    known = {
        "the scaling's projection term xhat mean(g xhat) is missing from dx (only the centring's Jacobian)":
            _ln_gelu_reference(dy, x, gain, bias, project=False),
        "the exact (erf) GELU derivative Phi(z) + z phi(z), not the derivative of the tanh form the model uses":
            _ln_gelu_reference(dy, x, gain, bias,
                               gelu_prime=lambda z: ndtr(z) + z * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)),
        "eps added to the standard deviation, outside the square root: 1 / (std + eps), not 1 / sqrt(var + eps)":
            _ln_gelu_reference(dy, x, gain, bias, inv_std=lambda var: 1.0 / (np.sqrt(var) + model.LN_EPS)),
    }
    names = ("dx (B, N, d)", "dgain (d,): summed over B and N", "dbias (d,): summed over B and N")
    for i, what in enumerate(names):
        # the same formulas, sums possibly in another order: a few roundings on entries of order one
        _hints.compare(out[i], expected[i], what, 1e-12, relative=True, known={k: v[i] for k, v in known.items()})

    # central differences of L = sum(dy * y): h = 1e-6, error ~ u |L| / h + h^2 |L'''| / 6 ~ 1e-9 relative
    def loss(x_, gain_, bias_):
        return float(np.sum(dy * model.gelu(model.layer_norm_forward(x_, gain_, bias_)[0])))

    for i, point in enumerate((x, gain, bias)):
        args = [x, gain, bias]

        def along(a, i=i, args=args):
            return loss(*(a if j == i else args[j] for j in range(3)))

        err = relative_error(np.asarray(out[i]), numerical_gradient(along, point, h=1e-6))
        assert err <= 1e-6, f"{names[i]}: central differences differ from your gradient by {err:.1e} relative (allowed 1e-6)"


def _gc_records(result, params, grads, n_entries, what):
    """The checked records ``(name, index, analytic, numeric, rel_error)`` of a gradient check's answer."""
    assert isinstance(result, (list, tuple)), f"{what}: return a list of (name, index, analytic, numeric, rel_error)"
    assert len(result) == n_entries, f"{what}: expected {n_entries} records, one per entry checked, got {len(result)}"
    records, seen = [], set()
    for r in result:
        assert len(r) == 5, f"{what}: each record is (name, index, analytic, numeric, rel_error), got {r!r}"
        name, index, analytic, numeric, rel = r
        assert name in params, f"{what}: {name!r} is not a parameter (they are {sorted(params)})"
        index = tuple(int(i) for i in np.atleast_1d(index)) if np.ndim(params[name]) else ()
        assert len(index) == np.ndim(params[name]) and all(0 <= i < n for i, n in zip(index, params[name].shape)), (
            f"{what}: index {index} is not an entry of {name} {params[name].shape}")
        assert (name, index) not in seen, f"{what}: entry {name}{list(index)} is checked twice; draw distinct entries"
        seen.add((name, index))
        assert float(analytic) == float(grads[name][index]), (
            f"{what}: the analytic value of {name}{list(index)} is {float(analytic)!r}, but grads[{name!r}] holds "
            f"{float(grads[name][index])!r} there")
        a, n = float(analytic), float(numeric)
        # CS231n's relative error |a - n| / max(|a|, |n|), 0 when both are 0
        expected = abs(a - n) / max(abs(a), abs(n)) if max(abs(a), abs(n)) > 0 else 0.0
        one_sided = abs(a - n) / abs(a) if a else None
        hint = ("the relative error divided by |analytic| alone, not by max(|a|, |n|): it is not symmetric, and "
                "infinite where the analytic value is 0"
                if one_sided is not None and abs(float(rel) - one_sided) <= 1e-12 * one_sided else None)
        assert abs(float(rel) - expected) <= 1e-12 * expected, _hints.explain(
            f"{what}: for {name}{list(index)}, analytic {a!r} and numeric {n!r} give the relative error "
            f"|a - n| / max(|a|, |n|) = {expected!r}, you report {float(rel)!r}", hints=[hint])
        records.append((name, index, a, n, float(rel)))
    return records


def _gc_unchanged(params, before, what):
    """Assert that every array of ``params`` is bit for bit as in ``before``; name the entry that moved."""
    for k in params:
        if not np.array_equal(params[k], before[k]):
            idx = np.unravel_index(int(np.argmax(np.abs(params[k] - before[k]))), np.shape(params[k]))
            moved = float(params[k][idx] - before[k][idx])
            raise AssertionError(_hints.explain(
                f"{what}: params[{k!r}] was changed", hints=[
                    f"params left changed: {k}{[int(i) for i in idx]} is off by {moved:+.1e} from its value, an entry "
                    "not put back after its two evaluations (restore the saved value)"]))


def _gc_numeric_hints(loss, params, records, h, truth):
    """What the answer's numeric derivatives suggest, against ``truth``: (name, index) -> the correct derivative."""
    hints = []
    forward = []
    base = loss(params)
    for name, index, _, n, _ in records:
        plus = {**params, name: params[name].copy()}
        plus[name][index] += h
        forward.append(abs(n - (loss(plus) - base) / h) <= 1e-9 * max(abs(n), 1e-300))
    if forward and all(forward):
        hints.append("a one-sided (forward) difference (L(theta + h e) - L(theta)) / h: its truncation error is "
                     "h |L''| / 2, the central difference's h^2 |L'''| / 6")
    ratios = [n / truth[(name, index)] for name, index, _, n, _ in records if truth[(name, index)] != 0]
    if ratios and all(abs(r - ratios[0]) <= 1e-9 for r in ratios) and abs(ratios[0] - 1) > 1e-9:
        hints.append(f"every numeric derivative off by the same relative amount {ratios[0] - 1:+.1e}: a constant "
                     "slightly off in the difference quotient (2h, the step)")
    return hints


@exercise("10.6", "A gradient check of the whole model", 2, points=4, partial=True, refuse=("refimpl.gradcheck",))
def check_gradient_check(gradient_check):
    """``gradient_check(loss, params, grads, n_entries, h, seed) -> records``, CS231n's sampled gradient check.

    ``n_entries`` distinct random entries of the dict ``params`` (drawn with
    ``np.random.default_rng(seed)``), each as ``(name, index, analytic,
    numeric, rel_error)``: ``grads[name][index]``, the central difference
    ``(loss(+h) - loss(-h)) / 2h`` in that entry, and ``|a - n| / max(|a|,
    |n|)``.  ``params`` must be left as it was.
    """
    rng = np.random.default_rng(106)
    # a loss whose gradient is known in closed form: L = sum(exp(a)) + sum(sin(b))
    toy = {"a": 0.5 * rng.standard_normal((3, 4)), "b": rng.standard_normal(5)}
    exact = {"a": np.exp(toy["a"]), "b": np.cos(toy["b"])}

    def toy_loss(p):
        return float(np.sum(np.exp(p["a"])) + np.sum(np.sin(p["b"])))

    for grads, what in ((exact, "the exact gradient"), ({k: 0.5 * g for k, g in exact.items()}, "a gradient half too small")):
        before = {k: a.copy() for k, a in toy.items()}
        got = gradient_check(toy_loss, toy, grads, 8, 1e-5, 0)
        _gc_unchanged(toy, before, f"L = sum(exp(a)) + sum(sin(b)), {what}")
        records = _gc_records(got, toy, grads, 8, f"L = sum(exp(a)) + sum(sin(b)), {what}")
        truth = {(name, index): float(exact[name][index]) for name, index, *_ in records}
        for name, index, a, n, rel in records:
            # central: error h^2 |L'''| / 6 + u |L| / h ~ 1e-10 relative; a one-sided difference is off by h |L''| / 2 ~ 1e-6
            true = truth[(name, index)]
            assert abs(n - true) <= 1e-7 * abs(true), _hints.explain(
                f"{what}: your numeric derivative in {name}{list(index)} is {n!r}, the exact one {true!r} "
                f"(difference {abs(n - true):.1e}, allowed 1e-7 relative)",
                hints=_gc_numeric_hints(toy_loss, toy, records, 1e-5, truth))
    # the tiny model of section 2, with its own gradients (checked there along a random direction)
    cfg = model.ModelConfig(vocab_size=16, max_len=12, d_model=8, n_heads=2, n_components=3, d_route=2, mlp_hidden=16)
    params = model.init_params(cfg, seed=2)
    tokens = rng.integers(1, 16, size=(2, 7))
    targets = rng.integers(0, 10, size=2)
    _, _, _, grads = model.loss_and_grads(params, tokens, targets, cfg)

    def model_loss(p):
        return model.loss_and_grads(p, tokens, targets, cfg)[0]

    before = {k: a.copy() for k, a in params.items()}
    got = gradient_check(model_loss, params, grads, 6, 1e-5, 1)
    _gc_unchanged(params, before, "the tiny model")
    for name, index, a, n, rel in _gc_records(got, params, grads, 6, "the tiny model"):
        p_plus, p_minus = {**params, name: params[name].copy()}, {**params, name: params[name].copy()}
        p_plus[name][index] += 1e-5
        p_minus[name][index] -= 1e-5
        mine = (model_loss(p_plus) - model_loss(p_minus)) / 2e-5
        # the same difference quotient: only the rounding of the two losses, ~ u |L| / h ~ 1e-10, can differ
        assert abs(n - mine) <= 1e-8 + 1e-6 * abs(mine), (
            f"the tiny model, {name}{list(index)}: your numeric derivative is {n!r}, the central difference {mine!r}")
