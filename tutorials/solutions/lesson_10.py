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
    """The gradients of L = sum(grad_out * y) for the bidirectional layer, as a dict keyed like refimpl.layers' grads.

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
    "10.1": [_ce_sum_not_mean, _ce_flipped, _ce_unshifted, off_by(cross_entropy_grad, 1e-10)],
    "10.2": [_adam_no_bias_correction, _adam_l2_in_gradient, _adam_delta_inside, off_by(adamw_step, 1e-11)],
    "10.3": [_forward_interleaved_heads, _forward_without_output_projection, _forward_first_mixture_everywhere, off_by(multihead_forward, 1e-10)],
    "10.4": [_backward_w_q_transposed, _backward_first_sequence_only, _backward_w_o_transposed, off_by(multihead_backward, 1e-8)],
}
