r"""Interpretability metrics of a trained GMA: component usage, usage entropy, NMI, and the gradient bounds.

The inputs are the routing quantities of a GMA layer, in the layout of
``app.model.gma_routing``: per layer a dict with ``x_q``, ``x_k``
``(B, H, N, d_r)``, ``means``, ``variances`` ``(H, K, d_r)``, ``weights``
``(H, K)`` and the responsibilities ``gamma_q``, ``gamma_k`` ``(B, H, N, K)``,
together with integer token categories ``(B, N)`` (``app.tasks.token_categories``:
0 padding, 1 digit, 2 operator, 3 bracket) and an optional boolean ``mask``
``(B, N)``, True for the tokens that count.  Without a mask every token
counts, padding included: padding is one of the categories.

Definitions
-----------
* **Mean responsibility** (usage) of component :math:`k`:
  :math:`p_k = \frac1{|T|}\sum_{t\in T}\gamma_{tk}`, the mean over the
  counted tokens :math:`T`.  Each :math:`\gamma_t` lies on the simplex, so
  :math:`p` does too (:func:`mean_responsibilities`).
* **Used components** at a threshold :math:`\tau \in (0, 1]`: the number of
  :math:`k` with :math:`p_k > \tau`, strictly above (:func:`used_components`,
  :func:`usage_table`).  The GMA paper reports 104 of 128 components used,
  but it states no threshold in the text this reference follows; so no
  number here claims to be the paper's.  :func:`interpretability_report`
  counts at a stated set of thresholds, multiples :math:`c/K` of the uniform
  usage :math:`1/K` (by default :math:`c = 0.01, 0.1, 0.5, 1`), which shows
  the threshold's effect: at :math:`c = 1` only components used more than
  average count, and a perfectly uniform usage counts none.
* **Usage entropy**: :math:`H(p)/\log K` with
  :math:`H(p) = -\sum_k p_k\log p_k` and the convention :math:`0\log 0 = 0`
  (the limit of :math:`x\log x` at 0).  It is 1 for the uniform usage and 0
  when one component takes every token; for :math:`K = 1`, where
  :math:`H(p) = \log K = 0`, it is defined as 1 (the only distribution on one
  component is the uniform one) (:func:`usage_entropy`).
* **Normalised mutual information** of two labelings :math:`A`, :math:`B` of
  the same :math:`n` items, from the contingency table
  :math:`n_{ab} = |\{t: A_t = a, B_t = b\}|` with marginals :math:`n_a`,
  :math:`n_b`:

  .. math::

     I(A;B) = \sum_{a,b:\,n_{ab}>0}\frac{n_{ab}}{n}\log\frac{n\,n_{ab}}{n_a n_b},\qquad
     \mathrm{NMI}(A,B) = \frac{I(A;B)}{(H(A) + H(B))/2},

  the arithmetic normalisation that scikit-learn's
  ``normalized_mutual_info_score`` uses by default; the logarithm's base
  cancels.  Degenerate cases, as scikit-learn: both labelings constant
  (:math:`H(A) = H(B) = 0`, the data are not split and the two agree): 1.0;
  otherwise, when :math:`I = 0`, 0.0 (for instance when one labeling is
  constant).  :math:`I = 0` exactly when the table is the outer product of its
  marginals, :math:`n\,n_{ab} = n_a n_b` for every cell, a test done here in
  integers, so independent labelings give exactly 0.0 rather than rounding
  noise; for any other table :math:`I > 0`, and its computed value is
  that up to rounding.  Empty labelings are refused (scikit-learn returns 1.0 for them).
  (:func:`normalized_mutual_information`.)  The report pairs the hard
  assignments :math:`\arg\max_k\gamma_{tk}` (the first index on a tie) with
  the categories, separately for the query side (``gamma_q``) and the key
  side (``gamma_k``).
* **Gradient bounds** (lesson 4; ``docs/derivations/gma.md#gradient-bounds``;
  :mod:`refimpl.theory`): for a token :math:`x` with upstream gradient
  :math:`g = \partial L/\partial\gamma(x)`, :math:`c_m = \gamma_m(g_m-\bar g)`
  and, on the ball :math:`\|x\|\le B_x`, with
  :math:`R = (B_x + B_\mu)/\sigma^2_{\min}`,
  :math:`\|\partial L/\partial x\| \le \tfrac12\operatorname{range}(g)R`,
  :math:`\|\partial L/\partial\mu_m\| \le \tfrac14\operatorname{range}(g)R`,
  :math:`|c_m| \le \gamma_m(1-\gamma_m)\operatorname{range}(g) \le \tfrac14\operatorname{range}(g)`.
  :func:`gradient_bound_ratios` measures the left-hand sides with
  :func:`refimpl.theory.per_token_gradients`, the bounds with
  :func:`refimpl.theory.gradient_bounds`, per head with :math:`B_x` the
  largest :math:`\|x\|` over the counted tokens of that head (the smallest
  ball that holds them), :math:`B_\mu` and :math:`\sigma^2_{\min}` those of the
  head's mixture.  Every ratio measured / bound is at most 1 by the theorem,
  up to the rounding of :math:`c_m` (a few ulps of :math:`\max|g|`); a
  ratio is taken only where its bound exceeds :math:`\sqrt{\epsilon}\max|g|`,
  which keeps that rounding below about :math:`\sqrt{\epsilon}` of it
  (:class:`GradientBoundRatios`).  All
  four bounds are attained by a symmetric pair :math:`\mu = \pm B e_1` with
  equal variances and weights at the token :math:`x = 0` when the ball is
  that point (:math:`B_x = 0`); with the tokens of a trained model the
  :math:`R`-based ratios are typically far below 1 and the logit ratio close
  to it (lesson 4, section 5).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from refimpl import gmm, theory, validation

__all__ = [
    "DEFAULT_THRESHOLDS",
    "GradientBoundRatios",
    "HeadReport",
    "format_report",
    "gradient_bound_ratios",
    "interpretability_report",
    "mean_responsibilities",
    "normalized_mutual_information",
    "usage_entropy",
    "usage_table",
    "used_components",
]

# Thresholds of the report, as multiples c of the uniform usage 1/K: a component is used when p_k > c / K.
DEFAULT_THRESHOLDS = (0.01, 0.1, 0.5, 1.0)


class HeadReport(NamedTuple):
    """The interpretability metrics of one head of one layer (see the module docstring)."""

    layer: int
    head: int
    n_components: int  # K
    thresholds: tuple  # absolute thresholds c / K, one per multiple c
    used_q: tuple  # components with mean gamma_q above each threshold
    used_k: tuple  # the same for gamma_k
    entropy_q: float  # H(mean gamma_q) / log K
    entropy_k: float
    nmi_q: float  # NMI(argmax gamma_q, categories) over the counted tokens
    nmi_k: float
    mean_gamma_q: np.ndarray  # (K,)
    mean_gamma_k: np.ndarray  # (K,)


class GradientBoundRatios(NamedTuple):
    """Measured per-token gradients through the responsibilities, their lesson-4 bounds, and the ratios.

    Per-token arrays are ``(B, H, N)``, NaN at the tokens the mask leaves out.
    The ratios are measured / bound where the bound is not lost in rounding:
    the computed ``c_m`` carries an error of a few ulps of ``max|g_i|`` (from
    ``gbar``), so a token counts only when ``range(g_i) > sqrt(eps) max|g_i|``,
    and a component, in the modulated ratio, only when also
    ``(1 - gamma_im) range(g_i) > sqrt(eps) max|g_i|`` (and ``gamma_im > 0``);
    the rounding then moves a ratio by about ``sqrt(eps)`` at most.  A token
    with ``range(g_i) = 0`` has bound 0 and no gradient.  The ``ratio_*``
    fields are per head ``(H,)``: the largest ratio over the counted tokens
    (0.0 when none counts).
    """

    radius: np.ndarray  # (H,): R = (B_x + B_mu) / sigma2_min
    bound_x: np.ndarray  # (H,): B_x, the largest ||x|| over the counted tokens
    x_norm: np.ndarray  # ||dL/dx_i||
    x_bound: np.ndarray  # range(g_i) R / 2
    means_norm: np.ndarray  # max_m ||dL/dmu_m|| contributed by token i
    means_bound: np.ndarray  # range(g_i) R / 4
    logits_abs: np.ndarray  # max_m |c_im|
    logits_bound: np.ndarray  # range(g_i) / 4
    logits_modulated_ratio: np.ndarray  # max_m |c_im| / (gamma_im (1 - gamma_im) range(g_i)) over m with a positive bound
    ratio_x: np.ndarray  # (H,)
    ratio_means: np.ndarray  # (H,)
    ratio_logits: np.ndarray  # (H,)
    ratio_logits_modulated: np.ndarray  # (H,)


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_responsibilities(gamma, name, ndim=None):
    """Responsibilities ``(..., K)``: finite floats, nonnegative, rows summing to 1 within sqrt(eps) K."""
    gamma = validation.as_float_array(gamma, name, ndim=ndim)
    if gamma.ndim < 1 or gamma.shape[-1] < 1:
        raise ValueError(f"{name}: expected responsibilities of shape (..., K) with K >= 1, got shape {gamma.shape}")
    validation.check_nonnegative(gamma, name, "responsibilities")
    tol = float(np.sqrt(np.finfo(gamma.dtype).eps)) * max(1, gamma.shape[-1])
    off = np.abs(gamma.sum(axis=-1) - 1)
    if off.size and float(np.max(off)) > tol:
        first = tuple(int(i) for i in np.unravel_index(np.argmax(off), off.shape))
        raise ValueError(
            f"{name}: expected rows that sum to 1 (within {tol:.1e}), got a row off by {float(np.max(off)):.2e} "
            f"(row {first})"
        )
    return gamma


def _check_mask(mask, name, shape, labels, data="gamma"):
    """A boolean mask of ``shape`` with at least one True, or None (everything counts: at least one token needed)."""
    if mask is None:
        if not all(shape):
            raise ValueError(f"{data}: expected at least one token, got none (token shape {tuple(shape)}): a mean over no "
                             "tokens is undefined")
        return np.ones(shape, dtype=bool)
    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(f"{name}: expected a boolean array (True for the tokens that count), got dtype {mask.dtype}")
    validation.check_shape(mask, name, shape, labels)
    if not np.any(mask):
        raise ValueError(f"{name}: expected at least one True entry (a token that counts), got none")
    return mask


def _check_labels(labels, name):
    labels = np.asarray(labels)
    if labels.dtype == bool or not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array of labels, got dtype {labels.dtype}")
    if labels.size == 0:
        raise ValueError(f"{name}: expected at least one label, got an empty array")
    return labels.ravel()


def _check_usage(mean_gamma, name="mean_gamma"):
    mean_gamma = validation.as_float_array(mean_gamma, name, ndim=1)
    validation.check_nonempty(mean_gamma, name)
    validation.check_probability_vector(mean_gamma, name)
    return mean_gamma


def _check_threshold(threshold, name):
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"{name}: expected a real number in (0, 1], got {type(threshold).__name__} {threshold!r}")
    threshold = float(threshold)
    if not (0 < threshold <= 1):
        raise ValueError(f"{name}: expected a threshold in (0, 1], got {threshold!r}")
    return threshold


def _check_thresholds(thresholds, name):
    if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence) or len(thresholds) == 0:
        raise TypeError(f"{name}: expected a non-empty sequence of numbers, got {thresholds!r}")
    return [_check_threshold(t, f"{name}[{i}]") for i, t in enumerate(thresholds)]


def _check_multiples(thresholds, K, name):
    """Multiples c of 1/K with c / K in (0, 1]."""
    if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence) or len(thresholds) == 0:
        raise TypeError(f"{name}: expected a non-empty sequence of multiples of 1/K, got {thresholds!r}")
    out = []
    for i, c in enumerate(thresholds):
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real):
            raise TypeError(f"{name}[{i}]: expected a real number, got {type(c).__name__} {c!r}")
        if not (0 < float(c) <= K):
            raise ValueError(
                f"{name}[{i}]: expected a multiple c of the uniform usage 1/K with 0 < c <= K = {K} "
                f"(threshold c / K in (0, 1]), got {c!r}"
            )
        out.append(float(c))
    return out


def _check_routing(routing, categories, mask):
    if isinstance(routing, Mapping) or not isinstance(routing, Sequence) or len(routing) == 0:
        raise TypeError(f"routing: expected a non-empty list of per-layer dicts (model.gma_routing), got {type(routing).__name__}")
    categories = np.asarray(categories)
    if categories.dtype == bool or not np.issubdtype(categories.dtype, np.integer):
        raise TypeError(f"categories: expected an integer array (token_categories), got dtype {categories.dtype}")
    validation.check_ndim(categories, "categories", 2)
    layers = []
    for i, layer in enumerate(routing):
        if not isinstance(layer, Mapping):
            raise TypeError(f"routing[{i}]: expected a dict with 'gamma_q' and 'gamma_k', got {type(layer).__name__}")
        pair = []
        for key in ("gamma_q", "gamma_k"):
            if key not in layer:
                raise ValueError(f"routing[{i}]: expected the key {key!r}, got keys {sorted(layer)}")
            name = f"routing[{i}]['{key}']"
            gamma = _check_responsibilities(layer[key], name, ndim=4)
            shape = (categories.shape[0], None, categories.shape[1], None)
            validation.check_shape(gamma, name, shape, ("B", "H", "N", "K"))
            pair.append(gamma)
        validation.check_shape(pair[1], f"routing[{i}]['gamma_k']", pair[0].shape, ("B", "H", "N", "K"))
        layers.append(tuple(pair))
    mask = _check_mask(mask, "mask", categories.shape, ("B", "N"), data="categories")
    return layers, categories, mask


def _check_bound_inputs(x, means, variances, weights, grad_resp, mask):
    x = validation.as_float_array(x, "x", ndim=4)
    means = validation.as_float_array(means, "means", ndim=3)
    variances = validation.as_float_array(variances, "variances", ndim=3)
    weights = validation.as_float_array(weights, "weights", ndim=2)
    g = validation.as_float_array(grad_resp, "grad_resp", ndim=4)
    B, H, N, d = x.shape
    validation.check_shape(means, "means", (H, None, d), ("H", "K", "d_r"))
    K = means.shape[1]
    if K < 1:
        raise ValueError("means: expected at least one component (K >= 1), got K = 0")
    validation.check_shape(variances, "variances", means.shape, ("H", "K", "d_r"))
    validation.check_positive(variances, "variances")
    validation.check_shape(weights, "weights", (H, K), ("H", "K"))
    for h in range(H):
        validation.check_probability_vector(weights[h], f"weights[{h}]")
    validation.check_shape(g, "grad_resp", (B, H, N, K), ("B", "H", "N", "K"))
    mask = _check_mask(mask, "mask", (B, N), ("B", "N"), data="x")
    return x, means, variances, weights, g, mask


# ---------------------------------------------------------------------------
# Usage
# ---------------------------------------------------------------------------


def _mean_over_mask(gamma, mask):
    # p_k = (1/|T|) sum_{t in T} gamma_tk
    return gamma[mask].mean(axis=0)


def mean_responsibilities(gamma, mask=None):
    """The mean responsibility of each component over the counted tokens.

    Parameters
    ----------
    gamma : array_like, shape (..., K)
        Responsibilities: nonnegative rows that sum to 1 (within
        ``sqrt(eps) K`` of the dtype).
    mask : array_like of bool, shape (...), optional
        True for the tokens that count (at least one); by default all.

    Returns
    -------
    ndarray, shape (K,)
        ``p_k``, dtype of ``gamma``; on the simplex.
    """
    gamma = _check_responsibilities(gamma, "gamma")
    mask = _check_mask(mask, "mask", gamma.shape[:-1], None)
    return _mean_over_mask(gamma, mask)


def used_components(mean_gamma, threshold) -> int:
    """How many components have a mean responsibility strictly above ``threshold``.

    Parameters
    ----------
    mean_gamma : array_like, shape (K,)
        Mean responsibilities (nonnegative, summing to 1).
    threshold : float
        In (0, 1].

    Returns
    -------
    int
    """
    mean_gamma = _check_usage(mean_gamma)
    threshold = _check_threshold(threshold, "threshold")
    return int(np.count_nonzero(mean_gamma > threshold))


def usage_table(mean_gamma, thresholds) -> list:
    """Used components at each of several thresholds.

    Parameters
    ----------
    mean_gamma : array_like, shape (K,)
        Mean responsibilities (nonnegative, summing to 1).
    thresholds : sequence of float
        Each in (0, 1].

    Returns
    -------
    list of (float, int)
        ``(threshold, count)`` in the order given.
    """
    mean_gamma = _check_usage(mean_gamma)
    thresholds = _check_thresholds(thresholds, "thresholds")
    return [(t, int(np.count_nonzero(mean_gamma > t))) for t in thresholds]


def _normalized_entropy(p):
    K = p.shape[0]
    if K == 1:
        return 1.0  # H(p) = log K = 0; the only distribution on one component is the uniform one
    nz = p[p > 0]  # 0 log 0 = 0
    return float(-np.sum(nz * np.log(nz)) / np.log(K))


def usage_entropy(mean_gamma) -> float:
    """``H(p) / log K``: 1 for the uniform usage, 0 for a single component taking every token.

    Parameters
    ----------
    mean_gamma : array_like, shape (K,)
        Mean responsibilities (nonnegative, summing to 1).

    Returns
    -------
    float
        In [0, 1] up to rounding; 1.0 when ``K = 1`` (module docstring).
    """
    return _normalized_entropy(_check_usage(mean_gamma))


# ---------------------------------------------------------------------------
# Normalised mutual information
# ---------------------------------------------------------------------------


def _entropy_of_counts(counts, n):
    p = counts / n
    return float(-np.sum(p * np.log(p)))  # counts > 0: every label present occurs


def _nmi(a, b):
    _, ia = np.unique(a, return_inverse=True)
    _, ib = np.unique(b, return_inverse=True)
    ka, kb = int(ia.max()) + 1, int(ib.max()) + 1
    if ka == 1 and kb == 1:
        return 1.0  # both constant: the data are not split, and the two labelings agree
    n = ia.shape[0]
    table = np.bincount(ia * kb + ib, minlength=ka * kb).reshape(ka, kb).astype(np.int64)
    na, nb = table.sum(axis=1), table.sum(axis=0)
    # I(A;B) = 0 exactly when n n_ab = n_a n_b for every cell (independence), checked in integers
    if np.array_equal(n * table, np.outer(na, nb)):
        return 0.0
    ra, rb = np.nonzero(table)
    nab = table[ra, rb].astype(np.float64)
    # I(A;B) = sum_ab (n_ab / n) log(n n_ab / (n_a n_b))
    mi = float(np.sum(nab / n * (np.log(nab) + np.log(n) - np.log(na[ra].astype(np.float64)) - np.log(nb[rb].astype(np.float64)))))
    # NMI = I / ((H(A) + H(B)) / 2), the arithmetic normalisation; H(A) + H(B) > 0 since not both are constant
    return mi / (0.5 * (_entropy_of_counts(na, n) + _entropy_of_counts(nb, n)))


def normalized_mutual_information(labels_a, labels_b) -> float:
    """NMI with the arithmetic normalisation, from the contingency table (module docstring).

    Equal to ``sklearn.metrics.normalized_mutual_info_score(labels_a, labels_b)``
    (``average_method="arithmetic"``, its default) to rounding, degenerate
    cases included: both labelings constant give 1.0, independent ones 0.0.

    Parameters
    ----------
    labels_a, labels_b : array_like of int
        Two labelings of the same items, of the same shape (flattened), not
        empty.  Label values are arbitrary integers (only equality matters).

    Returns
    -------
    float
        In [0, 1] up to rounding; symmetric in its arguments.
    """
    a = _check_labels(labels_a, "labels_a")
    b = _check_labels(labels_b, "labels_b")
    if np.shape(labels_a) != np.shape(labels_b):
        raise ValueError(f"labels_b: expected the shape of labels_a {np.shape(labels_a)}, got {np.shape(labels_b)}")
    return _nmi(a, b)


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


def interpretability_report(routing, categories, *, mask=None, thresholds=DEFAULT_THRESHOLDS) -> list:
    """Used components, usage entropy and NMI against the token categories, per layer and head.

    Parameters
    ----------
    routing : list of dict
        One dict per layer, as ``app.model.gma_routing`` returns; only
        ``"gamma_q"`` and ``"gamma_k"`` ``(B, H, N, K)`` are read.
    categories : array_like of int, shape (B, N)
        Token categories (``app.tasks.token_categories``).
    mask : array_like of bool, shape (B, N), optional
        True for the tokens that count (at least one).  By default every
        token, padding included.
    thresholds : sequence of float, default ``DEFAULT_THRESHOLDS``
        Multiples ``c`` of the uniform usage ``1/K``, each with
        ``0 < c <= K``; a component is used at ``c`` when its mean
        responsibility exceeds ``c / K``.  The paper's threshold is not
        stated; these are stated ones, and the report shows their effect.

    Returns
    -------
    list of HeadReport
        Layer-major: ``(layer 0, head 0), (layer 0, head 1), ...``.
    """
    layers, categories, mask = _check_routing(routing, categories, mask)
    reports = []
    for li, (gamma_q, gamma_k) in enumerate(layers):
        K = gamma_q.shape[-1]
        multiples = _check_multiples(thresholds, K, "thresholds")
        absolute = tuple(c / K for c in multiples)
        cats = categories[mask]
        for h in range(gamma_q.shape[1]):
            p_q = _mean_over_mask(gamma_q[:, h], mask)
            p_k = _mean_over_mask(gamma_k[:, h], mask)
            reports.append(
                HeadReport(
                    layer=li,
                    head=h,
                    n_components=K,
                    thresholds=absolute,
                    used_q=tuple(int(np.count_nonzero(p_q > t)) for t in absolute),
                    used_k=tuple(int(np.count_nonzero(p_k > t)) for t in absolute),
                    entropy_q=_normalized_entropy(p_q),
                    entropy_k=_normalized_entropy(p_k),
                    # hard assignments: argmax_k gamma_tk, the first index on a tie
                    nmi_q=_nmi(np.argmax(gamma_q[:, h], axis=-1)[mask], cats),
                    nmi_k=_nmi(np.argmax(gamma_k[:, h], axis=-1)[mask], cats),
                    mean_gamma_q=p_q,
                    mean_gamma_k=p_k,
                )
            )
    return reports


def format_report(reports) -> str:
    """The report as text, one block per head, for printing.

    Parameters
    ----------
    reports : list of HeadReport
        What :func:`interpretability_report` returns.

    Returns
    -------
    str
    """
    if isinstance(reports, HeadReport) or not isinstance(reports, Sequence) or not all(isinstance(r, HeadReport) for r in reports):
        raise TypeError("reports: expected a list of HeadReport (interpretability_report's result)")
    lines = []
    for r in reports:
        K = r.n_components
        used = ", ".join(f"p > {t * K:g}/K: {q}/{k}" for t, q, k in zip(r.thresholds, r.used_q, r.used_k))
        lines.append(f"layer {r.layer} head {r.head} (K = {K}): used components (queries/keys) {used}")
        lines.append(
            f"    usage entropy {r.entropy_q:.3f}/{r.entropy_k:.3f}, NMI(argmax gamma, category) {r.nmi_q:.3f}/{r.nmi_k:.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Gradient bounds
# ---------------------------------------------------------------------------


def _max_ratio(measured, bound, keep):
    return float(np.max(measured[keep] / bound[keep])) if np.any(keep) else 0.0


def gradient_bound_ratios(x, means, variances, weights, grad_resp, *, mask=None) -> GradientBoundRatios:
    """The lesson-4 per-token gradient bounds on given routing inputs, with measured / bound.

    For each head ``h`` the counted tokens ``x[:, h][mask]`` go through
    :func:`refimpl.theory.per_token_gradients` and
    :func:`refimpl.theory.gradient_bounds` with
    ``R = theory.bound_radius(means[h], variances[h], B_x)``, ``B_x`` the
    largest ``||x||`` among them.  Arrays in :mod:`refimpl.theory`'s layout
    (``x (N, d)``, ``means (K, d)``, ``weights (K,)``, ``grad_resp (N, K)``)
    go in as ``x[None, None]``, ``means[None]``, ``variances[None]``,
    ``weights[None]``, ``grad_resp[None, None]``.

    Parameters
    ----------
    x : array_like, shape (B, H, N, d_r)
        Routing inputs (``x_q`` or ``x_k`` of ``gma_routing``).
    means, variances : array_like, shape (H, K, d_r)
        Variances > 0.
    weights : array_like, shape (H, K)
        Each row nonnegative, summing to 1.
    grad_resp : array_like, shape (B, H, N, K)
        Upstream ``dL/dgamma`` at those tokens (``dL/dgamma_q`` for ``x_q``,
        ``dL/dgamma_k`` for ``x_k``); the bounds hold for any upstream.
    mask : array_like of bool, shape (B, N), optional
        True for the tokens that count (at least one); by default all.

    Returns
    -------
    GradientBoundRatios
        Every ratio is <= 1 up to the rounding of ``c_m`` (module docstring).
    """
    x, means, variances, weights, g, mask = _check_bound_inputs(x, means, variances, weights, grad_resp, mask)
    B, H, N, _ = x.shape
    dtype = validation.common_float_dtype(x, means, variances, weights, g)
    per_token = {k: np.full((B, H, N), np.nan, dtype=dtype) for k in ("x_norm", "x_bound", "means_norm", "means_bound", "logits_abs", "logits_bound", "logits_modulated_ratio")}
    radius, bound_x = np.zeros(H, dtype=dtype), np.zeros(H, dtype=dtype)
    ratios = {k: np.zeros(H, dtype=dtype) for k in ("ratio_x", "ratio_means", "ratio_logits", "ratio_logits_modulated")}
    for h in range(H):
        xs, gs = x[:, h][mask], g[:, h][mask]  # (M, d_r), (M, K): the counted tokens of head h
        # every measured gradient and every bound is linear in g_i, and each ratio is scale-free: each token's g_i is
        # divided by a power of two 2^k_i near max|g_i| (exact), and the per-token values are scaled back by 2^k_i
        top = np.max(np.abs(gs), axis=1)
        k = np.where(top > 0, np.frexp(top)[1] - 1, 0)
        gs = np.ldexp(gs, -k[:, None])
        bound_x[h] = float(np.max(np.linalg.norm(xs, axis=1)))
        radius[h] = theory.bound_radius(means[h], variances[h], bound_x[h])
        per = theory.per_token_gradients(xs, means[h], variances[h], weights[h], gs)
        gamma = gmm.responsibilities(xs, means[h], variances[h], weights[h])
        bnd = theory.gradient_bounds(gamma, gs, radius[h])
        abs_c = np.abs(per.logits)
        # c_m carries a rounding error of a few ulps of max|g_i| (from gbar); a ratio counts only where its
        # bound exceeds sqrt(eps) max|g_i|, so that this error moves it by at most ~sqrt(eps)
        floor = np.sqrt(np.finfo(dtype).eps) * np.max(np.abs(gs), axis=1)  # (M,)
        spread = np.ptp(gs, axis=1)
        keep = spread > floor
        keep_m = keep[:, None] & ((1 - gamma) * spread[:, None] > floor[:, None])
        measured = {
            "x_norm": np.linalg.norm(per.x, axis=1),
            "x_bound": bnd.x,
            "means_norm": per.means_norm.max(axis=1),
            "means_bound": bnd.means,
            "logits_abs": abs_c.max(axis=1),
            "logits_bound": bnd.logits,
            # |c_m| / (gamma_m (1 - gamma_m) range(g)) over the m whose bound is not lost in rounding
            "logits_modulated_ratio": np.max(
                np.divide(abs_c, bnd.logits_modulated, out=np.zeros_like(abs_c), where=keep_m & (gamma > 0)), axis=1
            ),
        }
        for name, v in measured.items():
            # back in the units of g, but for the ratio, which has none
            per_token[name][:, h][mask] = v if name == "logits_modulated_ratio" else np.ldexp(v, k)
        ratios["ratio_x"][h] = _max_ratio(measured["x_norm"], bnd.x, keep & (radius[h] > 0))
        ratios["ratio_means"][h] = _max_ratio(measured["means_norm"], bnd.means, keep & (radius[h] > 0))
        ratios["ratio_logits"][h] = _max_ratio(measured["logits_abs"], bnd.logits, keep)
        ratios["ratio_logits_modulated"][h] = float(np.max(measured["logits_modulated_ratio"]))
    return GradientBoundRatios(radius=radius, bound_x=bound_x, **per_token, **ratios)
