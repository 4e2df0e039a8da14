"""Worked solutions to lesson 10's exercises; try first."""

from __future__ import annotations

import numpy as np

from refimpl import gma, gmm

from . import off_by  # near misses: small but real errors

# ---------------------------------------------------------------------------
# 10.1 The cross-entropy backward
# ---------------------------------------------------------------------------


def cross_entropy_grad(logits, targets):
    """dL/dz for L = -(1/B) sum_b log softmax(z_b)[y_b]: (softmax(z) - onehot(y)) / B, shape (B, C).

    d(-log softmax(z)[y])/dz_c = softmax(z)_c - [c = y]; the mean over the B
    rows divides by B. The row maximum is subtracted before exp, so logits
    of size 1e3 do not overflow.
    """
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(targets)), targets] -= 1.0
    return p / logits.shape[0]


# ---------------------------------------------------------------------------
# 10.2 One AdamW step
# ---------------------------------------------------------------------------


def adamw_step(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):
    """Step t (1, 2, ...) of AdamW on one decayed weight matrix; returns (theta, m, v).

    m <- rho1 m + (1 - rho1) g,  v <- rho2 v + (1 - rho2) g^2,
    m_hat = m / (1 - rho1^t),  v_hat = v / (1 - rho2^t),
    theta <- theta - lr (m_hat / (sqrt(v_hat) + delta) + weight_decay theta).
    The decay is decoupled: it never enters m or v.
    """
    m = rho1 * m + (1.0 - rho1) * g
    v = rho2 * v + (1.0 - rho2) * g * g
    m_hat = m / (1.0 - rho1**t)  # without the correction, the first steps would be (1 - rho1) times too short
    v_hat = v / (1.0 - rho2**t)
    theta = theta - lr * (m_hat / (np.sqrt(v_hat) + delta) + weight_decay * theta)
    return theta, m, v


# ---------------------------------------------------------------------------
# 10.3 The multi-head layer's forward
# ---------------------------------------------------------------------------


def multihead_forward(x, params):
    """The bidirectional multi-head GMA layer: project, split into heads, GMA per (sequence, head), concatenate, project."""
    B, N, _ = x.shape
    H, K, d_r = params.means.shape
    d_v = params.W_v.shape[1] // H
    # (B, N, d_model) @ (d_model, H d_r), then the last axis split into H blocks of d_r: head h is block h
    xq = (x @ params.W_q).reshape(B, N, H, d_r)
    xk = (x @ params.W_k).reshape(B, N, H, d_r)
    v = (x @ params.W_v).reshape(B, N, H, d_v)
    heads = np.empty((B, N, H, d_v))
    for h in range(H):
        variances = gmm.variances_from_raw(params.raw_variances[h])  # softplus(s) + sigma^2_min
        weights = gmm.softmax(params.logits[h])
        for b in range(B):
            heads[b, :, h] = gma.gma(xq[b, :, h], xk[b, :, h], v[b, :, h], params.means[h], variances, weights)
    return heads.reshape(B, N, H * d_v) @ params.W_o


# ---------------------------------------------------------------------------
# 10.4 The multi-head layer's backward
# ---------------------------------------------------------------------------


def multihead_backward(grad_out, x, params):
    """The gradients of L = sum(grad_out * y) for the bidirectional layer, as a dict keyed like app.layers' grads.

    Forward again (keeping each head's cache), then in reverse: Y = O W_O,
    each head's GMA backward (the mixture's gradients summed over the
    batch), and the three projections, all of which X feeds.
    """
    B, N, d_model = x.shape
    H, K, d_r = params.means.shape
    d_v = params.W_v.shape[1] // H
    xq = (x @ params.W_q).reshape(B, N, H, d_r)
    xk = (x @ params.W_k).reshape(B, N, H, d_r)
    v = (x @ params.W_v).reshape(B, N, H, d_v)
    heads = np.empty((B, N, H, d_v))
    caches = {}
    for b in range(B):
        for h in range(H):
            heads[b, :, h], caches[b, h] = gma.gma_forward(xq[b, :, h], xk[b, :, h], v[b, :, h], params.means[h],
                                                           params.raw_variances[h], params.logits[h])
    concat = heads.reshape(B * N, H * d_v)  # O, the heads side by side
    G = grad_out.reshape(B * N, d_model)
    # Y = O W_O: dW_O = O^T G (all sequences at once is the sum over b), dO = G W_O^T
    dW_o = concat.T @ G
    dheads = (G @ params.W_o.T).reshape(B, N, H, d_v)
    dxq, dxk, dv = np.empty_like(xq), np.empty_like(xk), np.empty_like(v)
    dmeans, draw, dlogits = (np.zeros_like(a) for a in (params.means, params.raw_variances, params.logits))
    for b in range(B):
        for h in range(H):
            g = gma.gma_backward(dheads[b, :, h], caches[b, h])
            dxq[b, :, h], dxk[b, :, h], dv[b, :, h] = g.x_q, g.x_k, g.v
            dmeans[h] += g.means  # one mixture per head, used by every sequence: the gradients add
            draw[h] += g.raw_variances
            dlogits[h] += g.logits
    X = x.reshape(B * N, d_model)
    dxq, dxk, dv = dxq.reshape(B * N, H * d_r), dxk.reshape(B * N, H * d_r), dv.reshape(B * N, H * d_v)
    # X_Q = X W_Q: dW_Q = X^T dX_Q; and X feeds all three projections, so dX has three terms
    dx = dxq @ params.W_q.T + dxk @ params.W_k.T + dv @ params.W_v.T
    return {
        "x": dx.reshape(B, N, d_model),
        "W_q": X.T @ dxq,
        "W_k": X.T @ dxk,
        "W_v": X.T @ dv,
        "W_o": dW_o,
        "means": dmeans,
        "raw_variances": draw,
        "logits": dlogits,
    }


SOLUTIONS = {"10.1": cross_entropy_grad, "10.2": adamw_step, "10.3": multihead_forward, "10.4": multihead_backward}


# ---------------------------------------------------------------------------
# Near misses: plausible wrong answers that the checks must catch
# ---------------------------------------------------------------------------


def _ce_sum_not_mean(logits, targets):
    return cross_entropy_grad(logits, targets) * logits.shape[0]  # the sum over the rows, not the mean


def _ce_flipped(logits, targets):
    return -cross_entropy_grad(logits, targets)  # onehot - softmax: the gradient of -L


def _ce_unshifted(logits, targets):
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(logits)  # no row maximum: exp(1e3) = inf, inf / inf = nan
        p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(targets)), targets] -= 1.0
    return p / logits.shape[0]


def _adam_no_bias_correction(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):
    m = rho1 * m + (1.0 - rho1) * g
    v = rho2 * v + (1.0 - rho2) * g * g
    return theta - lr * (m / (np.sqrt(v) + delta) + weight_decay * theta), m, v


def _adam_l2_in_gradient(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):
    return adamw_step(theta, g + weight_decay * theta, m, v, t, lr, rho1, rho2, delta, 0.0)  # Adam with L2, not AdamW


def _adam_delta_inside(theta, g, m, v, t, lr, rho1, rho2, delta, weight_decay):
    m = rho1 * m + (1.0 - rho1) * g
    v = rho2 * v + (1.0 - rho2) * g * g
    m_hat, v_hat = m / (1.0 - rho1**t), v / (1.0 - rho2**t)
    return theta - lr * (m_hat / np.sqrt(v_hat + delta) + weight_decay * theta), m, v


def _forward_interleaved_heads(x, params):
    # columns dealt out to the heads in turn (reshape to (..., d_r, H)) instead of in blocks
    B, N, _ = x.shape
    H, K, d_r = params.means.shape
    d_v = params.W_v.shape[1] // H
    xq = (x @ params.W_q).reshape(B, N, d_r, H)
    xk = (x @ params.W_k).reshape(B, N, d_r, H)
    v = (x @ params.W_v).reshape(B, N, H, d_v)
    heads = np.empty((B, N, H, d_v))
    for h in range(H):
        variances, weights = gmm.variances_from_raw(params.raw_variances[h]), gmm.softmax(params.logits[h])
        for b in range(B):
            heads[b, :, h] = gma.gma(xq[b, :, :, h], xk[b, :, :, h], v[b, :, h], params.means[h], variances, weights)
    return heads.reshape(B, N, H * d_v) @ params.W_o


def _forward_without_output_projection(x, params):
    return multihead_forward(x, params._replace(W_o=np.eye(params.W_o.shape[0])))  # heads concatenated, not projected


def _forward_first_mixture_everywhere(x, params):
    H = params.means.shape[0]
    return multihead_forward(x, params._replace(means=np.repeat(params.means[:1], H, axis=0)))


def _backward_w_q_transposed(grad_out, x, params):
    full = multihead_backward(grad_out, x, params)
    return {**full, "W_q": full["W_q"].T}  # dX_Q^T X instead of X^T dX_Q (square here: d_model = H d_r = 4)


def _backward_first_sequence_only(grad_out, x, params):
    full = multihead_backward(grad_out, x, params)
    first = multihead_backward(grad_out[:1], x[:1], params)
    return {**full, "means": first["means"], "raw_variances": first["raw_variances"], "logits": first["logits"]}


def _backward_w_o_transposed(grad_out, x, params):
    full = multihead_backward(grad_out, x, params)
    return {**full, "W_o": full["W_o"].T}


NEAR_MISSES = {
    "10.1": {
        "the sum over the rows, not the mean: a factor B": _ce_sum_not_mean,
        "a flipped sign": _ce_flipped,
        "no row maximum subtracted: exp overflows": _ce_unshifted,
        "every value scaled by 1 + 1e-10": off_by(cross_entropy_grad, 1e-10),
    },
    "10.2": {
        "no bias correction": _adam_no_bias_correction,
        "the decay in the gradient (L2), not decoupled": _adam_l2_in_gradient,
        "delta inside the square root": _adam_delta_inside,
        "every value scaled by 1 + 1e-11": off_by(adamw_step, 1e-11),
    },
    "10.3": {
        "heads interleaved, not in blocks": _forward_interleaved_heads,
        "no output projection W_o": _forward_without_output_projection,
        "the first head's mixture in every head": _forward_first_mixture_everywhere,
        "every value scaled by 1 + 1e-10": off_by(multihead_forward, 1e-10),
    },
    "10.4": {
        "dW_q transposed": _backward_w_q_transposed,
        "the first sequence only, not summed over the batch": _backward_first_sequence_only,
        "dW_o transposed": _backward_w_o_transposed,
        "every value scaled by 1 + 1e-8": off_by(multihead_backward, 1e-8),
    },
}


# ---------------------------------------------------------------------------
# 10.5 The layer norm and GELU backward
# ---------------------------------------------------------------------------

_LN_EPS = 1e-5  # app.model.LN_EPS
_GELU_C, _GELU_A = float(np.sqrt(2.0 / np.pi)), 0.044715


def ln_gelu_backward(dy, x, gain, bias):
    """(dx, dgain, dbias) of L = sum(dy * y), y = gelu(z), z = gain xhat + bias, xhat = (x - mean) / sqrt(var + eps).

    GELU (tanh form): gelu(z) = z Phi~(z) with Phi~(z) = (1 + tanh(u)) / 2, u = c (z + a z^3), so
    gelu'(z) = (1 + t) / 2 + z (1 - t^2) c (1 + 3 a z^2) / 2, t = tanh(u).
    Layer norm, per row of d entries, with s = 1 / sqrt(var + eps) and g = dz * gain:
    d xhat_j / d x_i = s (delta_ij - 1/d - xhat_i xhat_j / d), hence
    dx = s (g - mean(g) - xhat mean(g xhat)): the centring removes the mean of g, the scaling the part of g along xhat.
    The gain and the bias are shared by every row: their gradients are summed over all leading axes.
    """
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    s = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + _LN_EPS)
    xhat = xc * s
    z = xhat * gain + bias
    t = np.tanh(_GELU_C * (z + _GELU_A * z**3))
    dz = dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * z * z))
    lead = tuple(range(x.ndim - 1))
    g = dz * gain
    dx = s * (g - g.mean(axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, np.sum(dz * xhat, axis=lead), np.sum(dz, axis=lead)


# ---------------------------------------------------------------------------
# 10.6 A gradient check of the whole model
# ---------------------------------------------------------------------------


def gradient_check(loss, params, grads, n_entries, h, seed):
    """CS231n's sampled gradient check: n_entries distinct random entries, each (name, index, analytic, numeric, rel).

    numeric = (loss(theta + h e) - loss(theta - h e)) / 2h, truncation h^2 L''' / 6 and rounding ~ u |L| / h;
    rel = |a - n| / max(|a|, |n|), which is scale-free (0 when both vanish). Every entry is put back afterwards,
    from a saved value (not by adding h back, which could round to another number).
    """
    rng = np.random.default_rng(seed)
    names = list(params)
    sizes = np.array([params[k].size for k in names])
    flat = rng.choice(int(sizes.sum()), size=n_entries, replace=False)  # distinct entries, uniform over all of them
    starts = np.concatenate([[0], np.cumsum(sizes)])
    records = []
    for f in flat:
        i = int(np.searchsorted(starts, f, side="right")) - 1
        name = names[i]
        index = np.unravel_index(int(f - starts[i]), params[name].shape)
        saved = params[name][index]
        params[name][index] = saved + h
        plus = loss(params)
        params[name][index] = saved - h
        minus = loss(params)
        params[name][index] = saved
        a, n = float(grads[name][index]), (plus - minus) / (2 * h)
        rel = abs(a - n) / max(abs(a), abs(n)) if max(abs(a), abs(n)) > 0 else 0.0
        records.append((name, tuple(int(j) for j in index), a, n, rel))
    return records


SOLUTIONS.update({"10.5": ln_gelu_backward, "10.6": gradient_check})


def _tanh_gelu_prime(z):
    t = np.tanh(_GELU_C * (z + _GELU_A * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * z * z)


def _ln_gelu_variant(dy, x, gain, bias, *, inv_std=None, gelu_prime=_tanh_gelu_prime, project=True, leading=None):
    """The solution's steps with one of them swapped for a plausible wrong one (the near misses below)."""
    xc = x - x.mean(axis=-1, keepdims=True)
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    s = 1.0 / np.sqrt(var + _LN_EPS) if inv_std is None else inv_std(var)
    xhat = xc * s
    z = xhat * gain + bias
    dz = dy * gelu_prime(z)
    g = dz * gain
    dx = s * (g - g.mean(axis=-1, keepdims=True) - (xhat * np.mean(g * xhat, axis=-1, keepdims=True) if project else 0.0))
    lead = tuple(range(x.ndim - 1)) if leading is None else leading
    return dx, np.sum(dz * xhat, axis=lead), np.sum(dz, axis=lead)


def _ln_no_projection_term(dy, x, gain, bias):
    # dx = s (g - mean(g)): the centring's Jacobian only, the scaling's xhat mean(g xhat) term dropped
    return _ln_gelu_variant(dy, x, gain, bias, project=False)


def _ln_erf_gelu(dy, x, gain, bias):
    # the exact GELU's derivative Phi(z) + z phi(z) where the model uses the tanh form: off by up to ~1e-3
    from scipy.special import ndtr

    return _ln_gelu_variant(dy, x, gain, bias, gelu_prime=lambda z: ndtr(z) + z * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi))


def _ln_eps_outside_root(dy, x, gain, bias):
    # 1 / (std + eps) instead of 1 / sqrt(var + eps): a relative change of about eps / (2 std) in every entry
    return _ln_gelu_variant(dy, x, gain, bias, inv_std=lambda var: 1.0 / (np.sqrt(var) + _LN_EPS))


def _ln_gain_summed_over_rows_only(dy, x, gain, bias):
    # dgain, dbias summed over the last leading axis only: shape (B, d), not (d,)
    return _ln_gelu_variant(dy, x, gain, bias, leading=(x.ndim - 2,))


def _gc_forward_difference(loss, params, grads, n_entries, h, seed):
    # one-sided (L(theta + h e) - L(theta)) / h: truncation h L'' / 2, not h^2 L''' / 6
    out = []
    for name, index, a, _, _ in gradient_check(loss, params, grads, n_entries, h, seed):
        base = loss(params)
        saved = params[name][index]
        params[name][index] = saved + h
        n = (loss(params) - base) / h
        params[name][index] = saved
        out.append((name, index, a, n, abs(a - n) / max(abs(a), abs(n)) if max(abs(a), abs(n)) > 0 else 0.0))
    return out


def _gc_relative_to_analytic(loss, params, grads, n_entries, h, seed):
    # |a - n| / |a|: not symmetric, and infinite where the analytic value is 0
    return [(name, index, a, n, abs(a - n) / abs(a) if a else 0.0)
            for name, index, a, n, _ in gradient_check(loss, params, grads, n_entries, h, seed)]


def _gc_not_restored(loss, params, grads, n_entries, h, seed):
    out = gradient_check(loss, params, grads, n_entries, h, seed)
    name, index = out[0][0], out[0][1]
    params[name][index] -= h  # left at theta - h, as a loop that forgets to put the entry back would
    return out


def _gc_numeric_nudged(loss, params, grads, n_entries, h, seed):
    # the numeric derivative off by 1e-6 relative: above the 1e-7 allowed, far below a loosened 1e-1
    return [(name, index, a, n * (1 + 1e-6), abs(a - n * (1 + 1e-6)) / max(abs(a), abs(n * (1 + 1e-6)))
             if max(abs(a), abs(n)) > 0 else 0.0)
            for name, index, a, n, _ in gradient_check(loss, params, grads, n_entries, h, seed)]


NEAR_MISSES.update({
    "10.5": {
        "the scaling's projection term missing from dx": _ln_no_projection_term,
        "the exact erf GELU derivative, not the tanh form": _ln_erf_gelu,
        "eps outside the square root, added to the standard deviation": _ln_eps_outside_root,
        "dgain and dbias summed over one axis only, not over every row": _ln_gain_summed_over_rows_only,
        "every value scaled by 1 + 1e-10": off_by(ln_gelu_backward, 1e-10),
    },
    "10.6": {
        "a one-sided (forward) difference, not the central one": _gc_forward_difference,
        "the relative error divided by |analytic| only": _gc_relative_to_analytic,
        "params left changed: an entry not put back": _gc_not_restored,
        "the numeric derivative off by 1e-6 relative": _gc_numeric_nudged,
    },
})
