r"""The theory of Gaussian Mixture Attention, as functions that can be checked numerically.

Shapes follow :mod:`refimpl.gma`: points ``x`` are ``(N, d)``, ``means`` and
``variances`` ``(K, d)``, ``weights`` ``(K,)``, responsibilities ``(N, K)``.
These functions serve analysis on small problems: some form ``N x K x d``
tensors or ``N x N`` matrices on purpose; the mechanism itself lives in
:mod:`refimpl.gma`.  The derivations are in ``docs/derivations/gma.md``; this
docstring states the results.

* The responsibility Jacobian (``gma.md#the-responsibility-jacobian``):
  :math:`J(x) = (\operatorname{diag}\gamma - \gamma\gamma^\top)U` with rows
  :math:`u_m = (\mu_m - x)/\sigma_m^2` (:func:`responsibility_jacobian`).
* Lipschitz bounds (``gma.md#lipschitz-bounds``): on the ball
  :math:`\|x\| \le B_x`, with :math:`R = (B_x + B_\mu)/\sigma^2_{\min}`,
  :math:`\|J\|_2 \le \tfrac12\sqrt K R` (crude) and :math:`\|J\|_2 \le R`
  (K-free); the K-free constant sharpens to :math:`R/\sqrt2`, approached as
  :math:`B_x \to 0` by two components :math:`\pm B_\mu e_1` at :math:`x = 0`, and
  since :math:`\tfrac12\sqrt K R \ge R/\sqrt2` for every :math:`K \ge 2`
  (equality at :math:`K = 2`) the crude bound never beats it.
  :func:`lipschitz_bounds` reports :math:`R` as ``k_free``;
  :func:`empirical_lipschitz` estimates the constant from below.
* Responsibility-modulated gradients (``gma.md#gradient-bounds``): per token,
  :math:`|c_m| \le \gamma_m(1-\gamma_m)\operatorname{range}(g) \le \tfrac14\operatorname{range}(g)`,
  :math:`\|\partial L/\partial\mu_m\| \le \tfrac14\operatorname{range}(g)R`,
  :math:`\|\partial L/\partial x\| \le \tfrac12\operatorname{range}(g)R`
  (:func:`gradient_bounds`, attained by a symmetric pair at :math:`x = 0`).
* The affinity (``gma.md#the-affinity``): :math:`A = \Gamma_Q\Gamma_K^\top`,
  :math:`A_{ij} = P(z_i = z_j) \in [0, 1]`, rank and nonnegative rank at most
  :math:`K`, PSD when :math:`X_Q = X_K`.  Outputs
  (``gma.md#the-outputs-and-the-slot-means``): :math:`o_i = \sum_k w_{ik} m_k`
  with slot means :math:`m_k = \tilde V_k/Z_k` and weights summing to
  :math:`1 - \epsilon/(\gamma^Q_i\cdot Z+\epsilon)`: a convex combination of
  the slot means, hence in the convex hull of the values, only for
  :math:`\epsilon = 0`; for :math:`\epsilon > 0`, in the hull of the values and
  the origin.
* The isotropic collapse (``gma.md#the-isotropic-collapse``): with one shared
  isotropic variance the router is
  :math:`\operatorname{softmax}(x\mu^\top/\sigma^2 + b)`, linear in :math:`x`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import gmm, numerics, validation

__all__ = [
    "LipschitzBounds",
    "EmpiricalLipschitz",
    "PerTokenGradients",
    "GradientBounds",
    "bound_radius",
    "lipschitz_bounds",
    "responsibility_jacobian",
    "jacobian_spectral_norms",
    "sample_ball",
    "empirical_lipschitz",
    "per_token_gradients",
    "gradient_bounds",
    "affinity",
    "affinity_by_enumeration",
    "affinity_by_sampling",
    "slot_means",
    "mixing_weights",
    "isotropic_router_logits",
]


class LipschitzBounds(NamedTuple):
    """Upper bounds on ``||J(x)||_2`` over the ball ``||x|| <= bound_x``."""

    radius: float  # R = (B_x + B_mu) / sigma2_min
    crude: float  # sqrt(K) R / 2
    k_free: float  # R


class EmpiricalLipschitz(NamedTuple):
    """Lower estimates of the Lipschitz constant of ``x -> gamma(x)`` from samples."""

    jacobian_norm: float  # max ||J(x)||_2 over the sampled points
    difference_quotient: float  # max ||gamma(x) - gamma(x')|| / ||x - x'|| over the sampled pairs


class PerTokenGradients(NamedTuple):
    """Per-token gradients through the responsibilities, before summing over tokens."""

    x: np.ndarray  # (N, d): dL/dx_i
    means_norm: np.ndarray  # (N, K): ||dL/dmu_m|| contributed by token i
    logits: np.ndarray  # (N, K): c_im = dL/da_m contributed by token i


class GradientBounds(NamedTuple):
    """The bounds of the module docstring, per token (and per component)."""

    x: np.ndarray  # (N,): range(g_i) R / 2
    means: np.ndarray  # (N,): range(g_i) R / 4
    logits: np.ndarray  # (N,): range(g_i) / 4
    logits_modulated: np.ndarray  # (N, K): gamma_im (1 - gamma_im) range(g_i)


# ---------------------------------------------------------------------------
# Lipschitz continuity of the responsibility map
# ---------------------------------------------------------------------------


def bound_radius(means, variances, bound_x, *, min_variance=None) -> float:
    """``R = (B_x + B_mu) / sigma2_min``: the largest ``||(mu_m - x) / sigma_m^2||`` on the ball.

    Parameters
    ----------
    means : array_like, shape (K, d)
    variances : array_like, shape (K, d)
        All > 0.
    bound_x : float
        Radius ``B_x`` (>= 0) of the ball of inputs.
    min_variance : float, optional
        The floor ``sigma2_min``; by default the smallest entry of
        ``variances``.  A given floor must not exceed that entry.

    Returns
    -------
    float
    """
    means, variances, bound_x, floor = validation.check_bound_radius(means, variances, bound_x, min_variance)
    b_mu = float(np.max(np.linalg.norm(means.astype(np.float64), axis=1)))
    return (bound_x + b_mu) / floor


def lipschitz_bounds(means, variances, bound_x, *, min_variance=None) -> LipschitzBounds:
    """The crude and the K-free bounds on ``||J(x)||_2`` over ``||x|| <= bound_x``.

    Parameters are those of :func:`bound_radius`.

    Returns
    -------
    LipschitzBounds
        ``radius`` R, ``crude = sqrt(K) R / 2`` and ``k_free = R``; both bound
        the Lipschitz constant of ``x -> gamma(x)`` on the ball (module
        docstring).
    """
    r = bound_radius(means, variances, bound_x, min_variance=min_variance)
    K = np.asarray(means).shape[0]
    return LipschitzBounds(radius=float(r), crude=float(0.5 * np.sqrt(K) * r), k_free=float(r))


def responsibility_jacobian(x, means, variances, weights):
    """``d gamma_m / d x_j`` at every point: ``gamma_m (u_m - ubar)``.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means, variances : array_like, shape (K, d)
    weights : array_like, shape (K,)

    Returns
    -------
    ndarray, shape (N, K, d)
        Dtype of the inputs.  Forms ``N x K x d`` numbers: for analysis, not for the mechanism.
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    return _jacobian(gmm.responsibilities(x, means, variances, weights), x, means, variances)


def _jacobian(gamma, x, means, variances):
    """``J(x_i)`` (N, K, d) from the responsibilities ``gamma`` (N, K) of checked arrays."""
    # u_m = d l_m / dx = (mu_m - x) / sigma_m^2
    u = (means[None, :, :] - x[:, None, :]) / variances[None, :, :]
    ubar = np.einsum("nk,nkd->nd", gamma, u)
    # J = (diag gamma - gamma gamma^T) U, row m = gamma_m (u_m - ubar)
    return gamma[:, :, None] * (u - ubar[:, None, :])


def jacobian_spectral_norms(x, means, variances, weights):
    """``||J(x_i)||_2`` (largest singular value) at every point.

    Parameters are those of :func:`responsibility_jacobian`.

    Returns
    -------
    ndarray, shape (N,)
    """
    x, means, variances, weights = validation.check_gmm(x, means, variances, weights)
    jac = _jacobian(gmm.responsibilities(x, means, variances, weights), x, means, variances)
    return np.linalg.norm(jac, ord=2, axis=(1, 2))


def sample_ball(n, d, radius, rng):
    """``n`` points uniform in the ball ``||x|| <= radius`` of ``R^d``.

    Parameters
    ----------
    n, d : int
        Number of points (>= 0) and dimension (>= 1).
    radius : float
        >= 0.
    rng : numpy.random.Generator

    Returns
    -------
    ndarray, shape (n, d)
    """
    n, d, radius, rng = validation.check_sample_ball(n, d, radius, rng)
    direction = rng.normal(size=(n, d))
    direction /= np.maximum(np.linalg.norm(direction, axis=1, keepdims=True), np.finfo(float).tiny)
    # P(||x|| <= r) = (r / radius)^d for the uniform law, so ||x|| = radius U^(1/d)
    return direction * (radius * rng.random(n) ** (1.0 / d))[:, None]


def _project_to_ball(x, radius):
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(norms > radius, x * (radius / np.maximum(norms, np.finfo(float).tiny)), x)


def _probe_points(means, variances, bound_x, n, rng):
    """Points where the responsibilities change fastest, plus uniform ones, all in the ball."""
    K, d = means.shape
    third = n // 3
    uniform = sample_ball(n - 2 * third, d, bound_x, rng)
    # near a component: mu_m + sigma_m z
    m = rng.integers(0, K, size=third)
    near = means[m] + np.sqrt(variances[m]) * rng.normal(size=(third, d))
    # on the segment between two components, where the posterior switches
    a, b = rng.integers(0, K, size=third), rng.integers(0, K, size=third)
    t = rng.random((third, 1))
    between = t * means[a] + (1 - t) * means[b] + 0.1 * np.sqrt(variances[a]) * rng.normal(size=(third, d))
    return _project_to_ball(np.concatenate([uniform, near, between]), bound_x)


def empirical_lipschitz(means, variances, weights, bound_x, *, n_points: int = 1000, n_pairs: int = 1000, seed=0) -> EmpiricalLipschitz:
    """Estimate the Lipschitz constant of ``x -> gamma(x)`` on ``||x|| <= bound_x`` from below.

    Points are drawn a third uniformly in the ball, a third near the means
    and a third between pairs of means (projected into the ball); pairs are
    a point and a perturbation of it at a log-uniform distance in
    ``[1e-4 B, 2 B]`` (``B = max(bound_x, 1e-12)``), also projected.

    Parameters
    ----------
    means, variances : array_like, shape (K, d)
    weights : array_like, shape (K,)
    bound_x : float
        Radius of the ball (>= 0).
    n_points : int, default 1000
        Points at which ``||J||_2`` is evaluated (>= 1).
    n_pairs : int, default 1000
        Pairs for the difference quotient (>= 1).
    seed : int or numpy.random.Generator, default 0

    Returns
    -------
    EmpiricalLipschitz
        Both are lower bounds on the true constant, to compare with
        :func:`lipschitz_bounds`.
    """
    args = validation.check_empirical_lipschitz(means, variances, weights, bound_x, n_points, n_pairs, seed)
    means, variances, weights, bound_x, n_points, n_pairs, rng = args
    pts = _probe_points(means, variances, bound_x, n_points, rng)
    jac = _jacobian(gmm.responsibilities(pts, means, variances, weights), pts, means, variances)
    jac_max = float(np.max(np.linalg.norm(jac, ord=2, axis=(1, 2))))

    x = _probe_points(means, variances, bound_x, n_pairs, rng)
    scale = max(bound_x, 1e-12)
    dist = scale * 10.0 ** rng.uniform(-4, np.log10(2.0), size=(n_pairs, 1))
    step = rng.normal(size=x.shape)
    step /= np.maximum(np.linalg.norm(step, axis=1, keepdims=True), np.finfo(float).tiny)
    x2 = _project_to_ball(x + dist * step, bound_x)
    gap = np.linalg.norm(x - x2, axis=1)
    # projection onto the sphere can leave a pair an ulp apart; rounding noise in
    # gamma (~1e-16) divided by such a gap is no lower bound on anything
    keep = gap >= 1e-6 * scale
    diff = np.linalg.norm(
        gmm.responsibilities(x[keep], means, variances, weights) - gmm.responsibilities(x2[keep], means, variances, weights), axis=1
    )
    quotient = float(np.max(diff / gap[keep])) if np.any(keep) else 0.0
    return EmpiricalLipschitz(jacobian_norm=jac_max, difference_quotient=quotient)


# ---------------------------------------------------------------------------
# Responsibility-modulated gradients
# ---------------------------------------------------------------------------


def per_token_gradients(x, means, variances, weights, grad_resp) -> PerTokenGradients:
    """What each token contributes to the gradients through ``gamma(x)``.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means, variances : array_like, shape (K, d)
    weights : array_like, shape (K,)
    grad_resp : array_like, shape (N, K)
        Upstream ``g_i = dL/dgamma(x_i)``.

    Returns
    -------
    PerTokenGradients
        ``x`` (N, d): ``dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2``;
        ``means_norm`` (N, K): ``|c_im| ||(x_i - mu_m) / sigma_m^2||``;
        ``logits`` (N, K): ``c_im = gamma_im (g_im - gbar_i)``.  Summed over
        tokens these are the gradients :func:`refimpl.gma.gma_backward` returns.
    """
    x, means, variances, weights, g = validation.check_per_token_gradients(x, means, variances, weights, grad_resp)
    gamma = gmm.responsibilities(x, means, variances, weights)
    # dL/dl_m = gamma_m (g_m - gbar): the softmax backward
    c = numerics.softmax_backward(gamma, g, axis=1)
    u = (means[None, :, :] - x[:, None, :]) / variances[None, :, :]
    return PerTokenGradients(
        x=np.einsum("nk,nkd->nd", c, u),
        means_norm=np.abs(c) * np.linalg.norm(u, axis=2),
        logits=c,
    )


def gradient_bounds(gamma, grad_resp, radius) -> GradientBounds:
    """The per-token bounds of the module docstring.

    Parameters
    ----------
    gamma : array_like, shape (N, K)
        Responsibilities (rows on the simplex).
    grad_resp : array_like, shape (N, K)
        Upstream ``g_i = dL/dgamma(x_i)``.
    radius : float
        ``R`` from :func:`bound_radius` (>= 0).

    Returns
    -------
    GradientBounds
        ``x`` (N,) = ``range(g_i) R / 2``; ``means`` (N,) = ``range(g_i) R / 4``;
        ``logits`` (N,) = ``range(g_i) / 4``; ``logits_modulated`` (N, K) =
        ``gamma_im (1 - gamma_im) range(g_i)``.
    """
    gamma, g, radius = validation.check_gradient_bounds(gamma, grad_resp, radius)
    rng_g = np.ptp(g, axis=1)
    return GradientBounds(
        x=0.5 * rng_g * radius,
        means=0.25 * rng_g * radius,
        logits=0.25 * rng_g,
        logits_modulated=gamma * (1 - gamma) * rng_g[:, None],
    )


# ---------------------------------------------------------------------------
# The affinity and the outputs
# ---------------------------------------------------------------------------


def affinity(gamma_q, gamma_k, *, causal: bool = False):
    """The implicit affinity ``A = gamma_q gamma_k^T`` (its lower triangle when causal).

    Parameters
    ----------
    gamma_q : array_like, shape (N_q, K)
    gamma_k : array_like, shape (N_k, K)
        Responsibilities (rows on the simplex).
    causal : bool, default False

    Returns
    -------
    ndarray, shape (N_q, N_k)
    """
    gamma_q, gamma_k, causal = validation.check_affinity(gamma_q, gamma_k, causal)
    a = gamma_q @ gamma_k.T
    return np.tril(a) if causal else a


def affinity_by_enumeration(gamma_q, gamma_k):
    """``P(z_i = z_j)`` by summing the joint law of ``(z_i, z_j)`` over its diagonal.

    For every pair the ``K x K`` table ``P(z_i = a, z_j = b) = gamma_q_ia gamma_k_jb``
    (independent draws) is formed and the cells ``a = b`` are added: the
    definition of the event, with no use of the dot product.

    Returns
    -------
    ndarray, shape (N_q, N_k)
    """
    gamma_q, gamma_k = validation.check_responsibility_pair(gamma_q, gamma_k)
    K = gamma_q.shape[1]
    out = np.zeros((gamma_q.shape[0], gamma_k.shape[0]), dtype=validation.common_float_dtype(gamma_q, gamma_k))
    same = np.eye(K, dtype=bool)
    for i in range(gamma_q.shape[0]):
        for j in range(gamma_k.shape[0]):
            joint = np.outer(gamma_q[i], gamma_k[j])
            out[i, j] = joint[same].sum()
    return out


def affinity_by_sampling(gamma_q, gamma_k, n_samples: int, seed=0):
    """Monte Carlo frequency of ``z_i = z_j`` with ``z_i ~ gamma_q_i``, ``z_j ~ gamma_k_j`` independent.

    Parameters
    ----------
    gamma_q : array_like, shape (N_q, K)
    gamma_k : array_like, shape (N_k, K)
    n_samples : int
        Independent draws of every ``z`` (>= 1).  The standard error of each
        entry is at most ``0.5 / sqrt(n_samples)``.
    seed : int or numpy.random.Generator, default 0

    Returns
    -------
    ndarray, shape (N_q, N_k)
    """
    gamma_q, gamma_k = validation.check_responsibility_pair(gamma_q, gamma_k)
    n_samples, rng = validation.check_int(n_samples, "n_samples", minimum=1), validation.check_rng(seed)
    K = gamma_q.shape[1]

    def draw(gamma):
        # inverse-CDF sampling: z = #{k : cdf_k <= u}, clipped for rows that sum to 1 - tiny
        cdf = np.cumsum(gamma, axis=1)
        u = rng.random((gamma.shape[0], n_samples))
        z = np.sum(u[:, :, None] >= cdf[:, None, :], axis=2)
        return np.minimum(z, K - 1)

    zq, zk = draw(gamma_q), draw(gamma_k)
    return np.mean(zq[:, None, :] == zk[None, :, :], axis=2).astype(validation.common_float_dtype(gamma_q, gamma_k), copy=False)


def slot_means(gamma_k, v):
    """``m_k = sum_j gamma_jk v_j / sum_j gamma_jk``: the value each slot holds.

    Parameters
    ----------
    gamma_k : array_like, shape (N_k, K)
        Key responsibilities; every column needs a positive sum.
    v : array_like, shape (N_k, d_v)

    Returns
    -------
    ndarray, shape (K, d_v)
        Each row is a convex combination of the rows of ``v``.
    """
    gamma_k, v = validation.check_slot_means(gamma_k, v)
    z = gamma_k.sum(axis=0)
    return (gamma_k.T @ v) / z[:, None]


def mixing_weights(gamma_q, gamma_k, *, eps: float = 1e-6):
    """``w_ik = gamma_q_ik Z_k / (gamma_q_i . Z + eps)``: ``out = w @ slot_means`` (bidirectional).

    Parameters
    ----------
    gamma_q : array_like, shape (N_q, K)
    gamma_k : array_like, shape (N_k, K)
    eps : float, default 1e-6

    Returns
    -------
    ndarray, shape (N_q, K)
        Nonnegative rows summing to ``1 - eps / (gamma_q_i . Z + eps)``.
    """
    gamma_q, gamma_k = validation.check_responsibility_pair(gamma_q, gamma_k)
    eps = validation.check_positive_float(eps, "eps", allow_zero=True)
    z = gamma_k.sum(axis=0)
    weighted = gamma_q * z[None, :]
    den = weighted.sum(axis=1, keepdims=True) + weighted.dtype.type(eps)
    validation.check_denominators(den[:, 0], eps, ("gamma_q", "gamma_k"))
    return weighted / den


def isotropic_router_logits(x, means, variance, weights):
    """``x mu^T / sigma^2 + log pi - ||mu||^2 / (2 sigma^2)``: the router when all variances are equal.

    Parameters
    ----------
    x : array_like, shape (N, d)
    means : array_like, shape (K, d)
    variance : float
        The one shared variance (> 0).
    weights : array_like, shape (K,)

    Returns
    -------
    ndarray, shape (N, K)
        ``softmax`` of these rows equals the responsibilities of the GMM with
        ``variances = variance`` everywhere (module docstring).
    """
    x, means, variance, weights = validation.check_isotropic_router(x, means, variance, weights)
    log_w = numerics.log_weights(weights)
    # -||x - mu||^2 / (2 s) = x . mu / s - ||mu||^2 / (2 s) - ||x||^2 / (2 s); the last is common to the row
    return x @ means.T / variance + log_w - np.sum(means * means, axis=1) / (2 * variance)
