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
# # Lesson 4: The gradients of GMA, by hand
#
# GMA is trained end to end: the means $\mu$, the variances $\sigma^2$ and the
# prior weights $\pi$ of the mixture are learned by backpropagation together
# with the projections that produce $X_Q$, $X_K$ and $\mathbf V$. Unconstrained
# parameters keep them valid: $\sigma^2 = \operatorname{softplus}(s) + \sigma^2_{\min}$
# and $\pi = \operatorname{softmax}(a)$ (lesson 1).
#
# Notation follows `docs/glossary.md`.
#
# **You will learn to**
#
# - derive the gradients of GMA step by step: the quotient rule of the
#   read-out, the transposed products of the write, the softmax Jacobian of
#   the responsibilities and the derivatives of a Gaussian log-density;
# - implement them in NumPy and check them against `refimpl.gma.gma_backward`
#   and against central differences, bidirectional and causal;
# - explain why a component learns only from the tokens it shares, through
#   the factor $\gamma_m(1-\gamma_m)$;
# - derive explicit bounds on every gradient and measure how tight they are.
#
# **Before this lesson**: lessons 2 and 3 (GMA and its causal scan; the
# prefix sums $S_t$, $z_t$ come back in the causal gradients). From outside:
# the chain rule for vectors and matrices, the softmax and its Jacobian,
# Gaussian densities, floating-point rounding (`docs/floating_point.md`).
#
# **The claims of this lesson.**
#
# 1. The gradient of any loss $L$ through GMA follows from three elementary
#    steps: the quotient rule for the read-out, the transposed products of the
#    write, and the softmax Jacobian of the responsibilities, which gives the
#    per-token, per-component quantity
#    $c_m = \gamma_m(g_m - \bar g)$. Everything else is the derivative of a
#    Gaussian log-density. We derive each step, write it directly in NumPy,
#    and check it against `refimpl.gma.gma_backward` and against central
#    finite differences.
# 2. The gradients are **modulated by the responsibilities**:
#    $|c_m| \le \gamma_m(1 - \gamma_m)\operatorname{range}(g)$, so a component
#    that no token uses, or one that owns its tokens completely, receives
#    (almost) no gradient.
# 3. They are **bounded**, with explicit constants: on inputs with
#    $\|x\| \le B_x$, means with $\|\mu_m\| \le B_\mu$ and variances
#    $\ge\sigma^2_{\min}$, with $R = (B_x + B_\mu)/\sigma^2_{\min}$,
#    $\|\partial L/\partial\mu_m\| \le \tfrac14\operatorname{range}(g)R$,
#    $|\partial L/\partial a_m| \le \tfrac14\operatorname{range}(g)$ and
#    $\|\partial L/\partial x\| \le \tfrac12\operatorname{range}(g)R$ per token.
#
# `TUTORIAL_SMALL=1` (set by CI) runs on small arrays; the default is full size.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from refimpl import attention, gma, gmm, theory

SMALL = os.environ.get("TUTORIAL_SMALL", "0") not in ("", "0")
U = np.finfo(np.float64).eps  # machine epsilon u = 2.2e-16 (not the guard eps = 1e-6)
print(f"small sizes: {SMALL}")

# %% [markdown]
# The problem: $N_Q$ queries and $N_K$ keys (different lengths, to catch
# transposition mistakes), $K$ components, every parameter drawn at random.
# The loss is $L = \sum_{i,c} G_{ic} O_{ic}$ with a random *upstream gradient*
# $G = \partial L/\partial O$: any loss has this form locally, and a random $G$
# exercises every direction.

# %%
rng = np.random.default_rng(0)
N_q, N_k, K, d_r, d_v = (7, 9, 3, 2, 3) if SMALL else (16, 20, 5, 3, 4)
params = dict(
    x_q=rng.normal(size=(N_q, d_r)),
    x_k=rng.normal(size=(N_k, d_r)),
    v=rng.normal(size=(N_k, d_v)),
    means=rng.normal(size=(K, d_r)),
    raw_variances=rng.normal(size=(K, d_r)),
    logits=rng.normal(size=K),
)
MIN_VAR, EPS_DEN = 1e-6, 1e-6  # sigma2_min and the denominator guard: refimpl's defaults
out, cache = gma.gma_forward(*params.values())
G = rng.normal(size=out.shape)
ref = gma.gma_backward(G, cache)  # refimpl's gradients, fields named like params
variances = gmm.variances_from_raw(params["raw_variances"], MIN_VAR)
weights = gmm.weights_from_logits(params["logits"])
gamma_q, gamma_k = cache.gamma_q, cache.gamma_k
print(f"N_q = {N_q}, N_k = {N_k}, K = {K}, d_r = {d_r}, d_v = {d_v}; L = {np.sum(G * out):.4f}")

# %% [markdown]
# ## 1. The read-out: the quotient rule
#
# Write the forward pass as named intermediate quantities:
#
# $$
# \tilde V = \Gamma_K^\top\mathbf V,\quad Z = \Gamma_K^\top\mathbf 1,\quad
# n_i = (\gamma^Q_i)^\top\tilde V \in\mathbb R^{d_v},\quad
# \mathrm{den}_i = \gamma^Q_i\cdot Z + \epsilon,\quad
# o_i = n_i/\mathrm{den}_i .
# $$
#
# With $G_i = \partial L/\partial o_i$, the quotient rule gives
#
# $$
# \frac{\partial L}{\partial n_i} = \frac{G_i}{\mathrm{den}_i} =: \tilde G_i,
# \qquad
# \frac{\partial L}{\partial\,\mathrm{den}_i} = -\frac{G_i\cdot n_i}{\mathrm{den}_i^2} = -\frac{G_i\cdot o_i}{\mathrm{den}_i} =: \delta_i .
# $$
#
# $n_i$ and $\mathrm{den}_i$ are linear in $\gamma^Q_i$, in $\tilde V$ and in
# $Z$, so
#
# $$
# \frac{\partial L}{\partial\gamma^Q_i} = \tilde V\tilde G_i + \delta_i Z
# \quad\Longleftrightarrow\quad
# d\Gamma_Q = \tilde G\tilde V^\top + \delta Z^\top,
# \qquad
# d\tilde V = \Gamma_Q^\top\tilde G,\qquad dZ = \Gamma_Q^\top\delta .
# $$
#
# ## 2. The write: transposed products
#
# $\tilde V = \Gamma_K^\top\mathbf V$ and $Z = \Gamma_K^\top\mathbf 1$: for a product
# $Y = E^\top F$ the gradients are $dE = F\,dY^\top$ and $dF = E\,dY$, so
#
# $$
# d\Gamma_K = \mathbf V\,d\tilde V^\top + \mathbf 1\,dZ^\top,\qquad d\mathbf V = \Gamma_K\,d\tilde V .
# $$
#
# In code, with the responsibilities treated as free inputs (steps 1 and 2
# never use that their rows sum to one):

# %%
def mixing_forward(gq, gk, v, eps=EPS_DEN):
    v_tilde, z = gk.T @ v, gk.sum(axis=0)
    return (gq @ v_tilde) / (gq @ z + eps)[:, None]


def mixing_backward(G, gq, gk, v, eps=EPS_DEN):
    v_tilde, z = gk.T @ v, gk.sum(axis=0)
    den = gq @ z + eps
    o = (gq @ v_tilde) / den[:, None]
    G_n = G / den[:, None]  # dL/dn_i
    delta = -np.sum(G * o, axis=1) / den  # dL/dden_i
    d_gq = G_n @ v_tilde.T + delta[:, None] * z[None, :]  # read-out
    d_vt, d_z = gq.T @ G_n, gq.T @ delta
    d_gk = v @ d_vt.T + d_z[None, :]  # write
    d_v = gk @ d_vt
    return d_gq, d_gk, d_v


d_gq, d_gk, dv_mix = mixing_backward(G, gamma_q, gamma_k, params["v"])
mix_ref = attention.feature_attention_backward(G, cache.mixing)  # refimpl's mixing backward
err_mix = max(np.max(np.abs(d_gq - mix_ref.phi_q)), np.max(np.abs(d_gk - mix_ref.phi_k)), np.max(np.abs(dv_mix - mix_ref.v)))
print(f"mixing backward vs refimpl.attention.feature_attention_backward: {err_mix:.1e}")
assert err_mix <= 1e-13  # the same few products in the same order: agreement to a few u of O(1) numbers

# %% [markdown]
# **Checking a gradient by central differences.** We move one entry at a
# time by $\pm h$ and compare $\frac{f(\theta + h e) - f(\theta - h e)}{2h}$
# with the analytic gradient. Truncation (of order $h^2$) and rounding (of
# order $u\Lambda/h$, with machine epsilon $u = 2.2\cdot10^{-16}$ and
# $\Lambda = \sum|G\odot O|$ the size of the terms added up in $L$) balance
# at $h^\star = (u\Lambda)^{1/3}$, which we use, and we allow
# $100\,(u\Lambda)^{2/3}$ relative to the largest entry of each gradient,
# about $10^{-8}$ in float64. Why this tolerance: `docs/floating_point.md`,
# section Lesson 4.

# %%
def central_differences(f, arrays, name, h):
    """d f / d arrays[name] by central differences, one entry at a time."""
    fd = np.zeros_like(arrays[name])
    for idx in np.ndindex(fd.shape):
        plus = {k: a.copy() for k, a in arrays.items()}
        minus = {k: a.copy() for k, a in arrays.items()}
        plus[name][idx] += h
        minus[name][idx] -= h
        fd[idx] = (f(**plus) - f(**minus)) / (2 * h)
    return fd


def rel_err(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


scale = np.sum(np.abs(G * out))  # Lambda
h_star = (U * scale) ** (1 / 3)
tol_fd = 100 * (U * scale) ** (2 / 3)  # relative to the largest entry of the gradient
print(f"Lambda = {scale:.2f}, h* = {h_star:.1e}, tolerance {tol_fd:.1e} relative")

mix_inputs = dict(gq=gamma_q, gk=gamma_k, v=params["v"])
loss_mix = lambda gq, gk, v: np.sum(G * mixing_forward(gq, gk, v))  # noqa: E731
for name, analytic in (("gq", d_gq), ("gk", d_gk), ("v", dv_mix)):
    e = rel_err(analytic, central_differences(loss_mix, mix_inputs, name, h_star))
    print(f"  d{name}: {e:.1e}")
    assert e <= tol_fd

# %% [markdown]
# ## 3. Through the responsibilities: $c_m = \gamma_m(g_m - \bar g)$
#
# Take one token $x$ (a query or a key) with upstream gradient
# $g = \partial L/\partial\gamma(x) \in \mathbb R^K$, one row of $d\Gamma_Q$
# or $d\Gamma_K$. The responsibilities are a softmax of the log-joints
# $\ell_k(x) = \log\pi_k + \log\mathcal N(x\mid\mu_k,\sigma_k^2)$:
# $\gamma_m = e^{\ell_m}/\sum_k e^{\ell_k}$, so
# $\partial\gamma_m/\partial\ell_k = \gamma_m(\delta_{mk} - \gamma_k)$ and, by the
# chain rule,
#
# $$
# c_k := \frac{\partial L}{\partial\ell_k} = \sum_m g_m\,\gamma_m(\delta_{mk}-\gamma_k)
#   = \gamma_k\Big(g_k - \sum_m\gamma_m g_m\Big) = \gamma_k(g_k - \bar g).
# $$
#
# Two facts about $c$ drive the rest of the lesson: $\sum_k c_k = \bar g - \bar g = 0$,
# and $c_k$ carries the factor $\gamma_k$.
#
# Now differentiate one log-joint,
# $\ell_m = \log\pi_m - \tfrac12\sum_j\log(2\pi\sigma^2_{mj}) - \tfrac12\sum_j (x_j-\mu_{mj})^2/\sigma^2_{mj}$:
#
# $$
# \frac{\partial\ell_m}{\partial x} = \frac{\mu_m - x}{\sigma_m^2},\qquad
# \frac{\partial\ell_m}{\partial\mu_m} = \frac{x - \mu_m}{\sigma_m^2},\qquad
# \frac{\partial\ell_m}{\partial\sigma^2_{mj}} = \frac{(x_j-\mu_{mj})^2 - \sigma^2_{mj}}{2\sigma^4_{mj}}
# $$
#
# (division elementwise). Multiply by $c_m$ and sum over what depends on what:
#
# $$
# \frac{\partial L}{\partial x} = \sum_m c_m\frac{\mu_m - x}{\sigma_m^2},\qquad
# \frac{\partial L}{\partial\mu_m} = c_m\frac{x-\mu_m}{\sigma_m^2},\qquad
# \frac{\partial L}{\partial\sigma^2_{mj}} = c_m\frac{(x_j-\mu_{mj})^2 - \sigma^2_{mj}}{2\sigma^4_{mj}} .
# $$
#
# **Reparameterisations.** $\sigma^2 = \operatorname{softplus}(s) + \sigma^2_{\min}$
# has $d\sigma^2/ds = \operatorname{sigmoid}(s)$, so
# $\partial L/\partial s_{mj} = \partial L/\partial\sigma^2_{mj}\cdot\operatorname{sigmoid}(s_{mj})$.
# The prior enters only through $\log\pi_m = a_m - \log\sum_k e^{a_k}$, with
# $\partial\log\pi_m/\partial a_k = \delta_{mk} - \pi_k$:
#
# $$
# \frac{\partial L}{\partial a_k} = \sum_m c_m(\delta_{mk} - \pi_k) = c_k - \pi_k\sum_m c_m = c_k ,
# $$
#
# the normalisation term cancels because $\sum_m c_m = 0$. The parameters are
# shared by every query and every key, so their gradients are sums of these
# per-token terms over both sets of tokens. Written directly (an
# $N\times K\times d_r$ array per set of tokens, fine for a lesson; `refimpl`
# expands the squares into matrix products instead):

# %%
def responsibility_backward(x, gamma, g, means, variances):
    """Per-token gradients through gamma(x) = softmax(l(x)); g = dL/dgamma, shape (N, K)."""
    c = gamma * (g - np.sum(gamma * g, axis=1, keepdims=True))  # dL/dl_m = gamma_m (g_m - gbar)
    diff = x[:, None, :] - means[None, :, :]  # x - mu_m, (N, K, d)
    dx = np.einsum("nk,nkd->nd", c, -diff / variances)  # sum_m c_m (mu_m - x) / sigma_m^2
    dmeans = c[:, :, None] * diff / variances  # per token: c_m (x - mu_m) / sigma_m^2
    dvar = c[:, :, None] * (diff**2 - variances) / (2 * variances**2)
    return c, dx, dmeans, dvar


c_q, dx_q, dmu_q, dvar_q = responsibility_backward(params["x_q"], gamma_q, d_gq, params["means"], variances)
c_k, dx_k, dmu_k, dvar_k = responsibility_backward(params["x_k"], gamma_k, d_gk, params["means"], variances)
mine = dict(
    x_q=dx_q,
    x_k=dx_k,
    v=dv_mix,
    means=dmu_q.sum(axis=0) + dmu_k.sum(axis=0),
    raw_variances=(dvar_q.sum(axis=0) + dvar_k.sum(axis=0)) * gmm.sigmoid(params["raw_variances"]),
    logits=c_q.sum(axis=0) + c_k.sum(axis=0),
)
sum_c = max(np.max(np.abs(c_q.sum(axis=1))), np.max(np.abs(c_k.sum(axis=1))))
print(f"max_token |sum_m c_m| = {sum_c:.1e}  (the cancellation behind dL/da = sum of c)")
assert sum_c <= 4 * K * U * max(np.max(np.abs(d_gq)), np.max(np.abs(d_gk)))

# %% [markdown]
# Against `gma.gma_backward`: the same sums in a different grouping (refimpl
# centres $x$ and $\mu$ on the mean of the means and expands the squares), so
# the two agree to rounding. Each gradient entry sums at most
# $n = N_Q + N_K$ per-token terms; the printed *cancellation factor*
# $\kappa$ is the largest $\sum_{\text{tokens}}|\text{term}|$ relative to
# the largest entry of the gradient, and we allow $64\,n\,u\,\kappa$. Why
# this tolerance: `docs/floating_point.md`, section Lesson 4.

# %%
per_token_abs = dict(
    x_q=np.einsum("nk,nkd->nd", np.abs(c_q), np.abs(params["x_q"][:, None] - params["means"]) / variances),
    x_k=np.einsum("nk,nkd->nd", np.abs(c_k), np.abs(params["x_k"][:, None] - params["means"]) / variances),
    v=np.abs(gamma_k) @ np.abs(gamma_q.T @ (G / (gamma_q @ gamma_k.sum(0) + EPS_DEN)[:, None])),
    means=np.abs(dmu_q).sum(axis=0) + np.abs(dmu_k).sum(axis=0),
    raw_variances=np.abs(dvar_q).sum(axis=0) + np.abs(dvar_k).sum(axis=0),
    logits=np.abs(c_q).sum(axis=0) + np.abs(c_k).sum(axis=0),
)
n_terms = N_q + N_k
for name in params:
    err = rel_err(mine[name], getattr(ref, name))
    kappa = np.max(per_token_abs[name]) / np.max(np.abs(getattr(ref, name)))
    tol = 64 * n_terms * U * kappa
    print(f"  {name:14s} relative difference {err:.1e}, cancellation factor {kappa:5.2f}, tolerance {tol:.1e}")
    assert err <= tol

# %% [markdown]
# And the decisive check, independent of every derivation above: central
# differences of the whole forward pass `gma.gma_forward` with respect to all
# six inputs, in float64, bidirectional and causal.
#
# The causal variant differs only in the mixing step. With the prefix sums
# $S_t = \sum_{j\le t}\gamma^K_j v_j^\top$, $z_t = \sum_{j\le t}\gamma^K_j$
# of lesson 3, token $t$ reads $n_t = S_t^\top\gamma^Q_t$ and
# $\mathrm{den}_t = \gamma^Q_t\cdot z_t + \epsilon$; the quotient rule of
# section 1 is unchanged ($\tilde G_t = G_t/\mathrm{den}_t$,
# $\delta_t = -G_t\cdot o_t/\mathrm{den}_t$), and the read-out gives
#
# $$
# \frac{\partial L}{\partial\gamma^Q_t} = S_t\tilde G_t + \delta_t z_t,\qquad
# \frac{\partial L}{\partial S_t} = \gamma^Q_t\tilde G_t^\top,\qquad
# \frac{\partial L}{\partial z_t} = \gamma^Q_t\,\delta_t .
# $$
#
# Key $j$ is written into every state $S_t$, $z_t$ with $t \ge j$, so its
# gradients collect those of all later states: the *reverse* prefix sums
#
# $$
# R_j = \sum_{t\ge j}\gamma^Q_t\tilde G_t^\top\ (K\times d_v),\qquad
# r_j = \sum_{t\ge j}\gamma^Q_t\,\delta_t\ (K),\qquad
# \frac{\partial L}{\partial\gamma^K_j} = R_j v_j + r_j,\qquad
# \frac{\partial L}{\partial v_j} = R_j^\top\gamma^K_j
# $$
#
# (the subscript keeps $R_j$ apart from the radius $R$ of section 5). Both
# sums include $t = j$: key $j$ is read by its own query. `refimpl` runs the
# forward and the reverse sums chunk by chunk, like the forward scan; the
# responsibilities step is unchanged. Exercises 4.2 and 4.3 ask you to code
# them.

# %%
N_c, chunk = (10, 4) if SMALL else (26, 4)  # N_c not a multiple of the chunk
params_c = dict(
    x_q=rng.normal(size=(N_c, d_r)),
    x_k=rng.normal(size=(N_c, d_r)),
    v=rng.normal(size=(N_c, d_v)),
    means=rng.normal(size=(K, d_r)),
    raw_variances=rng.normal(size=(K, d_r)),
    logits=rng.normal(size=K),
)
for causal, p in ((False, params), (True, params_c)):
    out_p, cache_p = gma.gma_forward(*p.values(), causal=causal, chunk_size=chunk)
    G_p = G if not causal else np.random.default_rng(1).normal(size=out_p.shape)
    grads_p = gma.gma_backward(G_p, cache_p)
    scale_p = np.sum(np.abs(G_p * out_p))
    h_p, tol_p = (U * scale_p) ** (1 / 3), 100 * (U * scale_p) ** (2 / 3)
    loss = lambda **kw: np.sum(G_p * gma.gma_forward(*kw.values(), causal=causal, chunk_size=chunk)[0])  # noqa: E731
    errs = {name: rel_err(getattr(grads_p, name), central_differences(loss, p, name, h_p)) for name in p}
    print(f"{'causal' if causal else 'bidirectional'}: h = {h_p:.1e}, tolerance {tol_p:.1e}; "
          + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    assert max(errs.values()) <= tol_p

# %% [markdown]
# ## 4. Responsibility-modulated gradients
#
# Why the factor $\gamma_m$ in $c_m = \gamma_m(g_m-\bar g)$ matters. Since
# $\sum_k\gamma_k = 1$,
#
# $$
# g_m - \bar g = \sum_{k}\gamma_k(g_m - g_k) = \sum_{k\ne m}\gamma_k(g_m - g_k),
# \qquad\text{so}\qquad
# |g_m - \bar g| \le (1-\gamma_m)\operatorname{range}(g),
# $$
#
# with $\operatorname{range}(g) = \max_k g_k - \min_k g_k$. Hence
#
# $$
# |c_m| \le \gamma_m(1-\gamma_m)\operatorname{range}(g) \le \tfrac14\operatorname{range}(g).
# $$
#
# Every parameter gradient of component $m$ is $c_m$ times something, so a
# component gets gradient from a token only in proportion to
# $\gamma_m(1-\gamma_m)$: nothing from tokens that ignore it
# ($\gamma_m \approx 0$), and nothing from tokens it owns completely
# ($\gamma_m \approx 1$). It learns from the tokens it *shares*. We plot
# $|c_m|/\operatorname{range}(g)$ against $\gamma_m(1-\gamma_m)$ for every
# (token, component) pair of a larger GMA, with the real upstream gradients of
# its mixing step.

# %%
r = np.random.default_rng(2)
N_s, K_s, d_s = (400, 6, 2) if SMALL else (3000, 8, 2)
xs_q, xs_k, vs = 1.5 * r.normal(size=(N_s, d_s)), 1.5 * r.normal(size=(N_s, d_s)), r.normal(size=(N_s, 3))
means_s, raw_s, logits_s = 1.5 * r.normal(size=(K_s, d_s)), r.normal(size=(K_s, d_s)) - 1.5, r.normal(size=K_s)
out_s, cache_s = gma.gma_forward(xs_q, xs_k, vs, means_s, raw_s, logits_s)
G_s = r.normal(size=out_s.shape)
g_resp = attention.feature_attention_backward(G_s, cache_s.mixing)  # dL/dGamma_Q, dL/dGamma_K
gam = np.concatenate([cache_s.gamma_q, cache_s.gamma_k])
g_all = np.concatenate([g_resp.phi_q, g_resp.phi_k])
c_all = gam * (g_all - np.sum(gam * g_all, axis=1, keepdims=True))
rng_g = np.ptp(g_all, axis=1)[:, None]
modulation = gam * (1 - gam)
# rounding: the computed c_m carries an error of order K u max|g| (from gbar), even where the
# exact value underflows, so the bound is checked up to that, in units of range(g)
violation = np.max((np.abs(c_all) - modulation * rng_g) / rng_g)
tol_mod = 4 * K_s * U * np.max(np.abs(g_all) / rng_g)
print(f"max over (token, component) of (|c_m| - gamma_m (1 - gamma_m) range(g)) / range(g) = {violation:.1e} "
      f"(<= {tol_mod:.1e})")
assert violation <= tol_mod

fig, ax = plt.subplots(figsize=(6.5, 4.5))
ax.scatter(modulation.ravel(), (np.abs(c_all) / rng_g).ravel(), s=3, alpha=0.4)
ax.plot([0, 0.25], [0, 0.25], "k--", label=r"$|c_m| = \gamma_m(1-\gamma_m)\,\mathrm{range}(g)$")
ax.set(xlabel=r"$\gamma_m(1-\gamma_m)$", ylabel=r"$|c_m| / \mathrm{range}(g)$",
       title="every (token, component) pair lies under the line")
ax.legend()
plt.show()

# %% [markdown]
# For $K = 2$ the bound is an equality:
# $c_1 = \gamma_1(g_1 - \gamma_1 g_1 - \gamma_2 g_2) = \gamma_1\gamma_2(g_1 - g_2)$,
# so $|c_1| = \gamma_1(1-\gamma_1)\operatorname{range}(g)$ exactly; the line in
# the plot cannot be lowered.

# %%
gam2 = r.dirichlet([1.0, 1.0], size=200)
g2 = r.normal(size=(200, 2))
c2 = gam2 * (g2 - np.sum(gam2 * g2, axis=1, keepdims=True))
gap2 = np.max(np.abs(np.abs(c2) - gam2 * (1 - gam2) * np.ptp(g2, axis=1)[:, None]) / np.ptp(g2, axis=1)[:, None])
print(f"K = 2: | |c_m| - gamma_m (1 - gamma_m) range(g) | / range(g) <= {gap2:.1e}")
assert gap2 <= 8 * U * np.max(np.abs(g2) / np.ptp(g2, axis=1)[:, None])

# %% [markdown]
# **Unused and saturated components.** A mixture built to show both extremes:
# component 0 sits on a tight cluster of tokens far from the others and owns
# it ($\gamma_0 \approx 1$ there); components 1 and 2 share a second cluster
# (the tokens sit between them); component 3 lies far from every token
# ($\gamma_3 \approx 0$ everywhere). We run the real forward and backward pass
# of `refimpl.gma` and compare the gradient norms of each component's
# parameters.

# %%
r = np.random.default_rng(3)
n_half = 50 if SMALL else 500
centre_a, centre_b = np.array([-6.0, 0.0]), np.array([3.0, 0.0])
xx = np.concatenate([centre_a + 0.3 * r.normal(size=(n_half, 2)), centre_b + 0.3 * r.normal(size=(n_half, 2))])
means_u = np.array([centre_a, centre_b + [-0.6, 0.0], centre_b + [0.6, 0.0], [0.0, 12.0]])
raw_u = gmm.raw_from_variances(np.full((4, 2), 0.5))
vv = r.normal(size=(2 * n_half, 3))
out_u, cache_u = gma.gma_forward(xx, xx, vv, means_u, raw_u, np.zeros(4))
grads_u = gma.gma_backward(r.normal(size=out_u.shape), cache_u)
usage = cache_u.gamma_k.mean(axis=0)
shared = np.mean(cache_u.gamma_k * (1 - cache_u.gamma_k), axis=0)
norm_mu = np.linalg.norm(grads_u.means, axis=1)
norm_s = np.linalg.norm(grads_u.raw_variances, axis=1)
norm_a = np.abs(grads_u.logits)
print("component  mean gamma  mean gamma(1-gamma)   ||dL/dmu||   ||dL/ds||   |dL/da|")
for m in range(4):
    print(f"{m:9d} {usage[m]:11.3f} {shared[m]:20.1e} {norm_mu[m]:12.1e} {norm_s[m]:11.1e} {norm_a[m]:9.1e}")
active = min(norm_mu[1:3].min(), norm_s[1:3].min(), norm_a[1:3].min())
for m in (0, 3):
    assert max(norm_mu[m], norm_s[m], norm_a[m]) <= 1e-6 * active

fig, ax = plt.subplots(figsize=(6.5, 3.8))
width = 0.25
for i, (vals, label) in enumerate(((norm_mu, r"$\|\partial L/\partial\mu_m\|$"), (norm_s, r"$\|\partial L/\partial s_m\|$"),
                                   (norm_a, r"$|\partial L/\partial a_m|$"))):
    ax.bar(np.arange(4) + (i - 1) * width, np.maximum(vals, 1e-300), width, label=label)
ax.set(yscale="log", ylim=(1e-65, 1e3), xticks=range(4),
       xticklabels=["0: owns its cluster", "1: shares", "2: shares", "3: unused"], ylabel="gradient norm",
       title="who gets gradient")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Component 0 is used by half the tokens, yet its gradient is tens of orders of
# magnitude below that of components 1 and 2: the tokens are certain of it,
# $1 - \gamma_0$ is tiny, and moving it would not change any responsibility.
# Component 3 receives nothing because no token reaches it. Both are the
# "dead" and "frozen" components of mixture models; the factor
# $\gamma_m(1-\gamma_m)$ is how they show up in the gradient, and why
# initialisation and the variance floor matter when training GMA.
#
# ## 5. Bounded gradients
#
# From $|c_m| \le \tfrac14\operatorname{range}(g)$ and, on the ball
# $\|x\|\le B_x$ with $\|\mu_m\|\le B_\mu$ and $\sigma^2 \ge \sigma^2_{\min}$,
#
# $$
# \Big\|\frac{x - \mu_m}{\sigma_m^2}\Big\| \le \frac{\|x\| + \|\mu_m\|}{\sigma^2_{\min}} \le R := \frac{B_x + B_\mu}{\sigma^2_{\min}},
# $$
#
# one token contributes $\|\partial L/\partial\mu_m\| \le \tfrac14\operatorname{range}(g)R$
# and $|\partial L/\partial a_m| \le \tfrac14\operatorname{range}(g)$. For the
# input, with $u_m = (\mu_m - x)/\sigma^2_m$ and $\|u_m\| \le R$,
#
# $$
# \Big\|\frac{\partial L}{\partial x}\Big\| = \Big\|\sum_m c_m u_m\Big\|
#   \le R\sum_m\gamma_m|g_m - \bar g|
#   \le R\Big(\sum_m\gamma_m(g_m-\bar g)^2\Big)^{1/2}
#   \le \tfrac12\operatorname{range}(g)\,R ,
# $$
#
# by Cauchy–Schwarz (the $\gamma_m$ are probabilities) and Popoviciu's
# inequality (a variance is at most a quarter of the squared range). The sum
# has $K$ terms, but their weights $\gamma_m$ sum to one, so the bound does not
# grow with $K$; bounding each $|c_m|$ by $\tfrac14\operatorname{range}(g)$
# instead would give $\tfrac K4\operatorname{range}(g)R$. A sequence's
# parameter gradient sums these per-token terms over its queries and keys, so
# it is bounded by the sum of the bounds.
#
# `theory.per_token_gradients` returns the per-token terms and
# `theory.gradient_bounds` the bounds; we report *measured / bound* for the
# GMA of section 4 (random, $K = 6$ or 8) and for a harder one with small
# variances ($\sigma^2 \approx 0.05$, $K = 16$), per token, and for the summed
# gradients that `gma.gma_backward` returns.

# %%
def bound_ratios(x_q, x_k, v, means, raw, logits, G_up, seed_label):
    out_b, cache_b = gma.gma_forward(x_q, x_k, v, means, raw, logits)
    grads_b = gma.gma_backward(G_up, cache_b)
    g_b = attention.feature_attention_backward(G_up, cache_b.mixing)
    var_b, w_b = cache_b.variances, gmm.weights_from_logits(logits)
    b_x = max(np.linalg.norm(x_q, axis=1).max(), np.linalg.norm(x_k, axis=1).max())
    R = theory.bound_radius(means, var_b, b_x)
    ratios = {}
    summed_mu, summed_a = 0.0, 0.0
    for x, gam_b, g in ((x_q, cache_b.gamma_q, g_b.phi_q), (x_k, cache_b.gamma_k, g_b.phi_k)):
        per = theory.per_token_gradients(x, means, var_b, w_b, g)
        bnd = theory.gradient_bounds(gam_b, g, R)
        ratios["x"] = max(ratios.get("x", 0), np.max(np.linalg.norm(per.x, axis=1) / bnd.x))
        ratios["mu"] = max(ratios.get("mu", 0), np.max(per.means_norm.max(axis=1) / bnd.means))
        ratios["a"] = max(ratios.get("a", 0), np.max(np.abs(per.logits).max(axis=1) / bnd.logits))
        summed_mu, summed_a = summed_mu + bnd.means.sum(), summed_a + bnd.logits.sum()
    ratios["sum mu"] = np.max(np.linalg.norm(grads_b.means, axis=1)) / summed_mu
    ratios["sum a"] = np.max(np.abs(grads_b.logits)) / summed_a
    print(f"{seed_label:24s} R = {R:6.1f}: " + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()))
    return ratios


worst_ratio = {}
r = np.random.default_rng(4)
n_b = 200 if SMALL else 2000
cases = [
    ("section 4 mixture", (xs_q, xs_k, vs, means_s, raw_s, logits_s), G_s),
    ("K = 16, sigma^2 ~ 0.05", (r.normal(size=(n_b, 2)), r.normal(size=(n_b, 2)), r.normal(size=(n_b, 3)),
                                r.normal(size=(16, 2)), gmm.raw_from_variances(r.uniform(0.03, 0.08, size=(16, 2))),
                                r.normal(size=16)), r.normal(size=(n_b, 3))),
]
for label, args, G_up in cases:
    for k, val in bound_ratios(*args, G_up, label).items():
        worst_ratio[k] = max(worst_ratio.get(k, 0), val)
# a bound that is attained (the logit bound, at gamma = 1/2) can be exceeded by the rounding of c_m only
assert max(worst_ratio.values()) <= 1 + 16 * U

# %% [markdown]
# All ratios are at most one, as proved (up to the rounding of $c_m$, a few
# $u$, which matters only for a bound that is attained). How tight are the bounds? The logit
# bound $\tfrac14\operatorname{range}(g)$ comes within a few percent: the
# factor $\gamma(1-\gamma)$ reaches $\tfrac14$ at $\gamma = \tfrac12$, and
# with many tokens some token has two components at nearly $\tfrac12$ each
# and $g$ spread between them. The $R$-based bounds are loose by an order of
# magnitude or more: $R$ assumes a token at distance $B_x + B_\mu$ from a
# component *and* at the variance floor at once, while the tokens that carry
# gradient sit between components, close to them in units of $\sigma$. The
# summed bounds are looser still, because per-token gradients of different
# signs cancel in the sum. They are guarantees (nothing can explode while
# inputs, means and the variance floor are controlled), not estimates;
# lesson 5 studies the same $R$ in the Lipschitz constant of $\gamma(x)$.
#
# ## Summary
#
# | claim | measured | allowed |
# |---|---|---|
# | mixing backward (quotient rule, transposed products) $=$ refimpl | $\sim 10^{-16}$ | $10^{-13}$ |
# | mixing backward $=$ central differences | $\sim 10^{-10}$ | $100(u\Lambda)^{2/3} \approx 10^{-8}$ |
# | $\sum_m c_m = 0$ per token | $\sim 10^{-17}$ | $4K\,u\max\lvert g\rvert$ |
# | hand-written gradients of all six inputs $=$ `gma_backward` | $\sim 10^{-16}$ | $64 n\,u\kappa$ |
# | `gma_backward` $=$ central differences, bidirectional and causal, all six inputs | $\sim 10^{-10}$ | $\approx 10^{-8}$ |
# | $\lvert c_m\rvert \le \gamma_m(1-\gamma_m)\operatorname{range}(g)$, equality for $K = 2$ | holds | rounding |
# | owned and unused components: gradient / active gradient | $< 10^{-6}$ | $10^{-6}$ |
# | per-token and summed gradient bounds, measured / bound | $\le 1$ | $1$ |
#
# Not shown here: training. These gradients are what a NumPy training loop
# uses; the bounds say that no gradient can blow up as long as the inputs and
# means stay bounded and the variance floor $\sigma^2_{\min}$ holds.

# %% [markdown]
# ## Exercises
#
# Four exercises, graded ★ warm-up, ★★ core, ★★★ stretch. Each has a cell
# for your answer and a check cell after it; until you answer, the check
# prints that the exercise is not done yet and the lesson runs on, and a wrong
# answer stops with a message that says what is wrong. Worked solutions are in
# `tutorials/solutions/lesson_04.py`: try first.
# In a course, the copy you are given leaves `tutorials/solutions/` out: your
# instructor says when the solutions are handed out.

# %%
from _course import check  # noqa: E402  (the exercises come after the lesson)

# %% [markdown]
# ### Exercise 4.1 ★ The gradient of the guard
#
# Could $\epsilon$ be learned? Its gradient follows from section 1 in two
# lines. Write `guard_gradient(G, gamma_q, gamma_k, v, eps)` returning
# $\partial L/\partial\epsilon$ (one number) for bidirectional GMA from given
# responsibilities (`gamma_q` of shape `(N_Q, K)`, `gamma_k` `(N_K, K)`,
# `v` `(N_K, d_v)`) and the loss $L = \sum G\odot O$ (`G` of shape
# `(N_Q, d_v)`). Hint: $\epsilon$ enters only through
# $\mathrm{den}_i$. The check compares with central differences in
# $\epsilon$. What is its sign when the outputs point along $G$?

# %%
def guard_gradient(G, gamma_q, gamma_k, v, eps):
    """dL/deps, a float."""
    raise NotImplementedError("exercise 4.1")


# %%
check("4.1", guard_gradient)

# %% [markdown]
# ### Exercise 4.2 ★★ The causal mixing backward
#
# Code the causal backward from the derivation at the end of section 3:
# `causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6)` returns
# `(d_gamma_q, d_gamma_k, d_v)`, of shapes `(N, K)`, `(N, K)`, `(N, d_v)`,
# the gradients of $L = \sum G\odot O$ through
# $o_t = S_t^\top\gamma^Q_t/(\gamma^Q_t\cdot z_t + \epsilon)$. Recompute the
# forward quantities you need ($S_t$, $z_t$, $\mathrm{den}_t$, $o_t$), then
# $\tilde G$ and $\delta$; the queries use the prefix sums, the keys and
# values the reverse prefix sums $R_j$, $r_j$ (exercise 3.2 met the same
# suffix sums). `np.cumsum` on a reversed array computes them; an
# $N\times K\times d_v$ array is fine here. The check compares with
# `refimpl.attention.feature_attention_backward` (causal, chunks of 3 tokens),
# entry by entry, and names the first wrong one.

# %%
def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):
    """(d_gamma_q (N, K), d_gamma_k (N, K), d_v (N, d_v)) for causal mixing."""
    raise NotImplementedError("exercise 4.2")


# %%
check("4.2", causal_mixing_backward)

# %% [markdown]
# ### Exercise 4.3 ★★ The causal GMA backward
#
# Now the whole causal GMA backward, from the cache that
# `gma.gma_forward(..., causal=True)` returns: write
# `causal_gma_backward(G, cache)` returning the six gradients in the order
# `(x_q, x_k, v, means, raw_variances, logits)`, each of its input's shape.
# The cache holds `x_q`, `x_k`, `means`, `raw_variances`, `variances`,
# `gamma_q`, `gamma_k` and `mixing` (whose `v` is $\mathbf V$ and `eps` the
# guard). Your mixing step of exercise 4.2 gives
# $\partial L/\partial\Gamma_Q$ and $\partial L/\partial\Gamma_K$; section 3's
# `responsibility_backward` and the reparameterisation
# $\sigma^2 = \operatorname{softplus}(s) + \sigma^2_{\min}$ do the rest (the
# parameters are shared by queries and keys). The check compares with
# `gma.gma_backward`, within the lesson's $64\,n\,u\,\kappa$; do not call it.

# %%
def causal_gma_backward(G, cache):
    """(dx_q, dx_k, dv, dmeans, draw_variances, dlogits), each the shape of its input."""
    raise NotImplementedError("exercise 4.3")


# %%
check("4.3", causal_gma_backward)

# %% [markdown]
# ### Exercise 4.4 ★★★ The input bound is attained
#
# Section 5 proves $\|\partial L/\partial x\| \le \tfrac12\operatorname{range}(g)R$
# per token through a chain of inequalities: the triangle inequality,
# $\|u_m\|\le R$, Cauchy–Schwarz and Popoviciu. Find when every link is an
# equality, and give a token and a mixture where the bound is attained:
# `tight_case = (x, means, variances, weights, g)` with `x` of shape
# `(d,)`, `means` and `variances` `(K, d)` ($K \ge 2$), `weights` `(K,)`
# on the simplex and `g` `(K,)`, the upstream gradient with respect to
# $\gamma(x)$. The check takes $B_x = \|x\|$, $B_\mu = \max_m\|\mu_m\|$ and
# $\sigma^2_{\min}$ the smallest variance entry, and asks
# $\|\partial L/\partial x\| = \tfrac12\operatorname{range}(g)R$ up to
# rounding. (Lesson 5 meets the same configuration for the Jacobian.)

# %%
tight_case = ...

# %%
check("4.4", tight_case)
