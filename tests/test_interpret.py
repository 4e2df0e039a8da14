"""app.interpret: usage, usage entropy, NMI (against scikit-learn), the report, the gradient-bound ratios."""

import numpy as np
import pytest
from sklearn.metrics import normalized_mutual_info_score

from refimpl import gmm
from app import interpret

B, H, N, K, D_R = 3, 2, 11, 6, 4


def synthetic_routing(seed=0, n_layers=2, dtype=np.float64):
    """Arrays in gma_routing's layout, the responsibilities computed from the mixture."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        means = rng.normal(size=(H, K, D_R))
        variances = rng.uniform(0.3, 1.5, size=(H, K, D_R))
        weights = rng.dirichlet(np.ones(K), size=H)
        layer = {"x_q": rng.normal(size=(B, H, N, D_R)), "x_k": rng.normal(size=(B, H, N, D_R)),
                     "means": means, "variances": variances, "weights": weights}
        for side in ("q", "k"):
            x = layer[f"x_{side}"]
            layer[f"gamma_{side}"] = np.stack(
                [np.stack([gmm.responsibilities(x[b, h], means[h], variances[h], weights[h]) for h in range(H)]) for b in range(B)]
            )
        layers.append({k: v.astype(dtype) for k, v in layer.items()})
    return layers


def categories(seed=0):
    return np.random.default_rng(seed + 100).integers(0, 4, size=(B, N))


# --- NMI ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_nmi_matches_scikit_learn_on_random_labelings(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    a = rng.integers(0, int(rng.integers(1, 8)), size=n)
    b = rng.integers(-3, int(rng.integers(-2, 9)), size=n)  # negative labels too
    expected = normalized_mutual_info_score(a, b)
    assert interpret.normalized_mutual_information(a, b) == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert interpret.normalized_mutual_information(b, a) == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_nmi_matches_scikit_learn_on_correlated_labelings():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 5, size=500)
    b = np.where(rng.random(500) < 0.7, a * 3 + 1, rng.integers(0, 20, size=500))  # mostly a relabelling of a
    nmi = interpret.normalized_mutual_information(a, b)
    assert 0.3 < nmi < 1
    assert nmi == pytest.approx(normalized_mutual_info_score(a, b), rel=1e-12)


@pytest.mark.parametrize(
    "a,b,expected",
    [
        ([0, 0, 0], [5, 5, 5], 1.0),  # both constant: the data are not split, a perfect match
        ([7], [2], 1.0),
        ([0, 0, 0, 0], [0, 1, 2, 3], 0.0),  # one constant: no information
        ([0, 1, 2, 3], [1, 1, 1, 1], 0.0),
        ([0, 0, 1, 1], [0, 1, 0, 1], 0.0),  # independent: exactly 0
        ([0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], 0.0),
        ([0, 0, 1, 1], [1, 1, 0, 0], 1.0),  # a relabelling
        ([0, 1, 2, 3], [3, 2, 1, 0], 1.0),
    ],
)
def test_nmi_degenerate_cases_are_those_of_scikit_learn(a, b, expected):
    assert normalized_mutual_info_score(a, b) == expected
    got = interpret.normalized_mutual_information(np.array(a), np.array(b))
    if expected == 0.0:
        assert got == 0.0  # exactly: independence is detected in integers
    else:
        assert got == pytest.approx(1.0, rel=1e-14)


def labels_from_table(table):
    """Two labelings whose contingency table is ``table``."""
    rows, cols = np.indices(np.shape(table))
    counts = np.ravel(table)
    return np.repeat(rows.ravel(), counts), np.repeat(cols.ravel(), counts)


def test_nmi_of_independent_labelings_is_exactly_zero_not_rounding_noise():
    # n n_ab = n_a n_b in every cell; the sum of the logarithms rounds to 5.6e-17 here, not to 0
    a, b = labels_from_table(np.outer([3, 2, 2, 1], [1, 1, 1]) * 3)
    assert normalized_mutual_info_score(a, b) == 0.0
    assert interpret.normalized_mutual_information(a, b) == 0.0
    a, b = labels_from_table(np.outer([1, 2], [3, 4, 5]))
    assert interpret.normalized_mutual_information(a, b) == 0.0
    # one count more and they are dependent
    a, b = labels_from_table(np.outer([1, 2], [3, 4, 5]) + np.eye(2, 3, dtype=int))
    assert interpret.normalized_mutual_information(a, b) == pytest.approx(normalized_mutual_info_score(a, b), rel=1e-12)
    assert interpret.normalized_mutual_information(a, b) > 0


def test_nmi_flattens_equal_shapes():
    a = np.random.default_rng(1).integers(0, 3, size=(4, 5))
    b = np.random.default_rng(2).integers(0, 4, size=(4, 5))
    assert interpret.normalized_mutual_information(a, b) == pytest.approx(normalized_mutual_info_score(a.ravel(), b.ravel()), rel=1e-12)


# --- usage ---------------------------------------------------------------------------


def test_usage_entropy_is_one_for_uniform_and_zero_for_one_hot():
    assert interpret.usage_entropy(np.full(8, 1 / 8)) == pytest.approx(1.0, rel=1e-15)
    assert interpret.usage_entropy(np.eye(8)[3]) == 0.0  # 0 log 0 = 0
    assert interpret.usage_entropy(np.array([1.0])) == 1.0  # K = 1, by convention
    # two of four components, equally: H = log 2, log K = log 4
    assert interpret.usage_entropy(np.array([0.5, 0.0, 0.5, 0.0])) == pytest.approx(0.5, rel=1e-15)


def test_usage_entropy_matches_scipy():
    from scipy.stats import entropy

    p = np.random.default_rng(3).dirichlet(np.full(10, 0.3))
    assert interpret.usage_entropy(p) == pytest.approx(entropy(p) / np.log(10), rel=1e-14)


def test_mean_responsibilities_averages_over_the_counted_tokens():
    gamma = np.zeros((2, 3, 4))
    gamma[0, :, 0] = 1.0  # batch row 0: component 0
    gamma[1, :, 2] = 1.0  # batch row 1: component 2
    gamma[1, 2] = [0.0, 0.0, 0.0, 1.0]
    np.testing.assert_array_equal(interpret.mean_responsibilities(gamma), [3 / 6, 0, 2 / 6, 1 / 6])
    mask = np.array([[True, False, False], [True, True, False]])
    np.testing.assert_array_equal(interpret.mean_responsibilities(gamma, mask), [1 / 3, 0, 2 / 3, 0])


def test_used_components_counts_strictly_above_the_threshold():
    p = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    assert interpret.used_components(p, 0.1) == 3
    assert interpret.used_components(p, 0.125) == 2  # strictly above
    assert interpret.used_components(p, 0.01) == 5  # the zero is never used
    assert interpret.used_components(p, 1.0) == 0
    assert interpret.usage_table(p, [0.01, 0.0625, 0.3]) == [(0.01, 5), (0.0625, 3), (0.3, 1)]


# --- the report ----------------------------------------------------------------------


def test_report_has_one_entry_per_layer_and_head_with_consistent_fields():
    routing = synthetic_routing()
    cats = categories()
    reports = interpret.interpretability_report(routing, cats, thresholds=(0.1, 0.5, 1.0))
    assert [(r.layer, r.head) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in reports:
        layer = routing[r.layer]
        assert r.n_components == K
        assert r.thresholds == pytest.approx((0.1 / K, 0.5 / K, 1.0 / K))
        p_q = interpret.mean_responsibilities(layer["gamma_q"][:, r.head])
        np.testing.assert_allclose(r.mean_gamma_q, p_q, rtol=1e-15)
        assert r.used_q == tuple(interpret.used_components(p_q, t) for t in r.thresholds)
        assert list(r.used_q) == sorted(r.used_q, reverse=True)  # a higher threshold never counts more
        assert r.entropy_q == interpret.usage_entropy(p_q)
        hard = np.argmax(layer["gamma_k"][:, r.head], axis=-1)
        assert r.nmi_k == pytest.approx(normalized_mutual_info_score(cats.ravel(), hard.ravel()), rel=1e-12, abs=1e-15)
    text = interpret.format_report(reports)
    assert text.count("layer ") == 4 and "0.5/K" in text and "NMI" in text


def test_report_uses_only_the_masked_tokens():
    routing = synthetic_routing(1, n_layers=1)
    cats = categories(1)
    mask = np.zeros((B, N), dtype=bool)
    mask[:, :5] = True
    r = interpret.interpretability_report(routing, cats, mask=mask)[1]
    gq = routing[0]["gamma_q"][:, 1]
    np.testing.assert_allclose(r.mean_gamma_q, gq[:, :5].reshape(-1, K).mean(axis=0), rtol=1e-14)
    hard = np.argmax(gq[:, :5], axis=-1)
    assert r.nmi_q == pytest.approx(normalized_mutual_info_score(cats[:, :5].ravel(), hard.ravel()), rel=1e-12, abs=1e-15)


def test_report_nmi_is_one_when_the_assignment_is_the_category():
    cats = categories(2)
    gamma = np.eye(K)[cats][:, None]  # (B, 1, N, K): component = category
    routing = [{"gamma_q": gamma, "gamma_k": gamma}]
    (r,) = interpret.interpretability_report(routing, cats)
    assert r.nmi_q == pytest.approx(1.0, rel=1e-14) and r.nmi_k == pytest.approx(1.0, rel=1e-14)
    assert r.used_q[0] == len(np.unique(cats))


def test_report_accepts_float32():
    routing = synthetic_routing(3, n_layers=1, dtype=np.float32)
    r = interpret.interpretability_report(routing, categories(3))[0]
    assert r.mean_gamma_q.dtype == np.float32


# --- gradient bounds -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_gradient_bound_ratios_are_at_most_one_on_random_routing(seed):
    layer = synthetic_routing(seed, n_layers=1)[0]
    if seed == 3:  # tight variances: large R, strongly modulated responsibilities
        layer["variances"] = layer["variances"] * 0.05
    rng = np.random.default_rng(seed + 50)
    g = rng.normal(size=(B, H, N, K))
    mask = rng.random((B, N)) < 0.8
    mask[0, 0] = True
    res = interpret.gradient_bound_ratios(layer["x_q"], layer["means"], layer["variances"], layer["weights"], g, mask=mask)
    for name in ("ratio_x", "ratio_means", "ratio_logits", "ratio_logits_modulated"):
        ratio = getattr(res, name)
        assert ratio.shape == (H,)
        assert np.all(ratio > 0) and np.all(ratio <= 1 + 1e-7), (name, ratio)  # rounding: module docstring
    assert res.x_norm.shape == (B, H, N)
    assert np.all(np.isnan(res.x_norm[~np.broadcast_to(mask[:, None], (B, H, N))]))
    assert not np.any(np.isnan(res.x_norm[np.broadcast_to(mask[:, None], (B, H, N))]))
    # B_x is the largest counted ||x||, so every counted token lies in the ball
    norms = np.linalg.norm(layer["x_q"], axis=-1)  # (B, H, N)
    for h in range(H):
        assert res.bound_x[h] == np.max(norms[:, h][mask])
    np.testing.assert_array_less(res.x_norm[~np.isnan(res.x_norm)], res.x_bound[~np.isnan(res.x_bound)] * (1 + 1e-12))


@pytest.mark.parametrize("g", [[1.0, -3.0], [0.0, 2.5]])
def test_gradient_bound_ratios_reach_one_where_the_bound_is_attained(g):
    """A symmetric pair mu = +-B e_1, equal variances and weights, every token at x = 0 (so B_x = 0)."""
    means = np.array([[[2.0, 0.0], [-2.0, 0.0]]])
    variances = np.full((1, 2, 2), 0.1)
    weights = np.full((1, 2), 0.5)
    x = np.zeros((2, 1, 3, 2))
    grad = np.broadcast_to(np.array(g), (2, 1, 3, 2)).copy()
    res = interpret.gradient_bound_ratios(x, means, variances, weights, grad)
    assert res.radius[0] == pytest.approx(20.0, rel=1e-15) and res.bound_x[0] == 0.0
    for name in ("ratio_x", "ratio_means", "ratio_logits", "ratio_logits_modulated"):
        assert getattr(res, name)[0] == pytest.approx(1.0, rel=1e-13), name


def test_gradient_bound_ratios_leave_out_bounds_lost_in_rounding():
    """An upstream of 1e3 plus 1e-12 noise: range(g) is below the rounding of c (a few ulps of 1e3)."""
    layer = synthetic_routing(5, n_layers=1)[0]
    g = 1e3 + 1e-12 * np.random.default_rng(6).normal(size=(B, H, N, K))
    res = interpret.gradient_bound_ratios(layer["x_q"], layer["means"], layer["variances"], layer["weights"], g)
    # every bound is ~1e-12 while c carries ~1e-13 of rounding: no ratio is meaningful, none is taken
    assert np.all(res.x_bound < 1e-9) and np.all(res.ratio_logits == 0) and np.all(res.ratio_x == 0)
    assert np.all(res.ratio_logits_modulated == 0)


def test_gradient_bound_ratios_are_defined_for_unreached_components_and_a_zero_radius():
    layer = synthetic_routing(7, n_layers=1)[0]
    means = layer["means"].copy()
    means[:, 0] = 1e3  # no token reaches component 0: gamma = 0 exactly, and so is its modulated bound
    g = np.random.default_rng(8).normal(size=(B, H, N, K))
    res = interpret.gradient_bound_ratios(layer["x_q"], means, layer["variances"], layer["weights"], g)
    assert np.all(np.isfinite(res.ratio_logits_modulated)) and np.all(res.ratio_logits_modulated <= 1 + 1e-7)
    # every token and every mean at the origin: R = 0, both R-based bounds and the gradients are 0
    zero = np.zeros((1, 1, 3, 2))
    res = interpret.gradient_bound_ratios(zero, np.zeros((1, 2, 2)), np.ones((1, 2, 2)), np.full((1, 2), 0.5), g[:1, :1, :3, :2])
    assert res.radius[0] == 0 and res.ratio_x[0] == 0 and res.ratio_means[0] == 0


def test_gradient_bound_ratios_skip_tokens_with_a_constant_upstream():
    layer = synthetic_routing(4, n_layers=1)[0]
    g = np.ones((B, H, N, K))  # range(g) = 0: bound 0 and no gradient
    res = interpret.gradient_bound_ratios(layer["x_k"], layer["means"], layer["variances"], layer["weights"], g)
    assert np.all(res.ratio_x == 0) and np.all(res.ratio_logits == 0)
    assert np.all(res.x_bound == 0)


# --- errors name the argument ----------------------------------------------------------


def _gamma():
    return synthetic_routing(0, n_layers=1)[0]["gamma_q"]


@pytest.mark.parametrize(
    "call,exc,fragment",
    [
        (lambda: interpret.mean_responsibilities(-_gamma()), ValueError, "gamma: expected nonnegative"),
        (lambda: interpret.mean_responsibilities(_gamma() * 1.01), ValueError, "gamma: expected rows that sum to 1"),
        (lambda: interpret.mean_responsibilities(_gamma(), mask=np.ones((B, H, N))), TypeError, "mask: expected a boolean"),
        (lambda: interpret.mean_responsibilities(_gamma(), mask=np.ones((B, N), bool)), ValueError, "mask: expected shape"),
        (lambda: interpret.mean_responsibilities(_gamma(), mask=np.zeros((B, H, N), bool)), ValueError, "mask: expected at least one"),
        (lambda: interpret.used_components(np.array([0.5, 0.6]), 0.1), ValueError, "mean_gamma:"),
        (lambda: interpret.used_components(np.array([0.5, 0.5]), 0.0), ValueError, "threshold: expected a threshold in (0, 1]"),
        (lambda: interpret.used_components(np.array([0.5, 0.5]), 1.5), ValueError, "threshold: expected a threshold in (0, 1]"),
        (lambda: interpret.used_components(np.array([0.5, 0.5]), True), TypeError, "threshold:"),
        (lambda: interpret.usage_table(np.array([0.5, 0.5]), [0.1, -1]), ValueError, "thresholds[1]:"),
        (lambda: interpret.usage_table(np.array([0.5, 0.5]), 0.1), TypeError, "thresholds:"),
        (lambda: interpret.usage_entropy(np.array([0.5, -0.5, 1.0])), ValueError, "mean_gamma:"),
        (lambda: interpret.normalized_mutual_information([0.0, 1.0], [0, 1]), TypeError, "labels_a: expected an integer"),
        (lambda: interpret.normalized_mutual_information([0, 1], [True, False]), TypeError, "labels_b: expected an integer"),
        (lambda: interpret.normalized_mutual_information([0, 1], [0, 1, 1]), ValueError, "labels_b: expected the shape"),
        (lambda: interpret.normalized_mutual_information(np.array([], int), np.array([], int)), ValueError, "labels_a: expected at least one"),
        (lambda: interpret.interpretability_report({}, categories()), TypeError, "routing:"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma()}], categories()), ValueError, "routing[0]: expected the key 'gamma_k'"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma(), "gamma_k": _gamma() * 2}], categories()), ValueError, "routing[0]['gamma_k']: expected rows"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma(), "gamma_k": _gamma()}], categories()[:, :4]), ValueError, "routing[0]['gamma_q']: expected shape"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma(), "gamma_k": _gamma()}], categories() * 1.0), TypeError, "categories:"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma(), "gamma_k": _gamma()}], categories(), thresholds=(0.5, K + 1)), ValueError, "thresholds[1]:"),
        (lambda: interpret.interpretability_report([{"gamma_q": _gamma(), "gamma_k": _gamma()[..., :-1] / _gamma()[..., :-1].sum(-1, keepdims=True)}], categories()), ValueError, "routing[0]['gamma_k']: expected shape"),
        (lambda: interpret.format_report("layer"), TypeError, "reports:"),
    ],
)
def test_bad_arguments_are_refused_with_a_message_naming_them(call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def _bound_args(**changes):
    layer = synthetic_routing(0, n_layers=1)[0]
    args = {"x": layer["x_q"], "means": layer["means"], "variances": layer["variances"], "weights": layer["weights"],
                "grad_resp": np.zeros((B, H, N, K))}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,exc,fragment",
    [
        ({"x": np.zeros((H, N, D_R))}, ValueError, "x: expected a 4-D"),
        ({"means": np.zeros((H + 1, K, D_R))}, ValueError, "means: expected shape"),
        ({"variances": np.zeros((H, K, D_R))}, ValueError, "variances: expected strictly positive"),
        ({"weights": np.full((H, K), 0.5)}, ValueError, "weights[0]:"),
        ({"grad_resp": np.zeros((B, H, N, K + 1))}, ValueError, "grad_resp: expected shape"),
        ({"grad_resp": np.full((B, H, N, K), np.nan)}, ValueError, "grad_resp: expected finite"),
        ({"mask": np.zeros((B, N), bool)}, ValueError, "mask: expected at least one"),
    ],
)
def test_gradient_bound_ratios_refuse_bad_arguments(changes, exc, fragment):
    with pytest.raises(exc) as info:
        interpret.gradient_bound_ratios(**_bound_args(**changes))
    assert fragment in str(info.value), str(info.value)


# --- thresholds hit exactly, masks that change the answer, no tokens, scale ---------------


def one_hot_usage(counts, K):
    """Responsibilities (1, 1, n, K), one-hot, component k taking counts[k] tokens: mean usage counts / n exactly."""
    labels = np.repeat(np.arange(K), counts)
    return np.eye(K)[labels][None, None]


def test_a_usage_exactly_at_the_threshold_is_not_used():
    # K = 4, 8 tokens: usages 3/8, 2/8, 2/8, 1/8 -- two of them exactly 1/K = 0.25, one exactly 0.125 = 0.5/K
    gamma = one_hot_usage([3, 2, 2, 1], 4)
    p = interpret.mean_responsibilities(gamma)
    np.testing.assert_array_equal(p, [0.375, 0.25, 0.25, 0.125])
    assert interpret.used_components(p, 0.25) == 1 and interpret.used_components(p, 0.125) == 3
    assert interpret.usage_table(p, [0.375, 0.25, 0.125]) == [(0.375, 0), (0.25, 1), (0.125, 3)]
    cats = np.zeros((1, 8), dtype=int)
    (r,) = interpret.interpretability_report([{"gamma_q": gamma, "gamma_k": gamma}], cats, thresholds=(0.5, 1.0, 1.5))
    assert r.thresholds == (0.125, 0.25, 0.375)
    assert r.used_q == (3, 1, 0) and r.used_k == (3, 1, 0)


def test_masked_tokens_change_nothing_of_either_side():
    """Tokens the mask leaves out, which would change every key-side and query-side metric if they counted."""
    K = 4
    counted = one_hot_usage([2, 2, 2, 2], K)  # 8 counted tokens: uniform usage, categories = components
    noise = one_hot_usage([0, 0, 0, 8], K)  # 8 tokens the mask leaves out, all on component 3
    gamma_k = np.concatenate([counted, noise], axis=2)
    gamma_q = np.concatenate([counted[..., ::-1], noise], axis=2)
    cats = np.concatenate([np.repeat(np.arange(K), 2), np.zeros(8, int)])[None]
    mask = np.arange(16)[None] < 8
    (r,) = interpret.interpretability_report([{"gamma_q": gamma_q, "gamma_k": gamma_k}], cats, mask=mask, thresholds=(0.5, 1.0))
    for side in ("q", "k"):
        np.testing.assert_array_equal(getattr(r, f"mean_gamma_{side}"), np.full(K, 0.25))
        assert getattr(r, f"used_{side}") == (4, 0)  # 0.25 > 0.5/K, and not above 1/K
        assert getattr(r, f"entropy_{side}") == pytest.approx(1.0, rel=1e-15)
        assert getattr(r, f"nmi_{side}") == pytest.approx(1.0, rel=1e-14)  # the assignment is the category
    # the same with every token counted: all different
    (full,) = interpret.interpretability_report([{"gamma_q": gamma_q, "gamma_k": gamma_k}], cats, thresholds=(0.5, 1.0))
    assert full.used_k != r.used_k and full.entropy_k < 0.9 and full.nmi_k < 0.9


@pytest.mark.parametrize("call, fragment", [
    (lambda: interpret.mean_responsibilities(np.zeros((0, 4))), "gamma: expected at least one token, got none"),
    (lambda: interpret.mean_responsibilities(np.zeros((2, 0, 4))), "gamma: expected at least one token, got none"),
    (lambda: interpret.interpretability_report([{"gamma_q": np.zeros((0, 1, 3, 2)), "gamma_k": np.zeros((0, 1, 3, 2))}],
                                               np.zeros((0, 3), int)), "categories: expected at least one token"),
    (lambda: interpret.gradient_bound_ratios(np.zeros((1, 1, 0, 2)), np.zeros((1, 2, 2)), np.ones((1, 2, 2)),
                                             np.full((1, 2), 0.5), np.zeros((1, 1, 0, 2))), "x: expected at least one token"),
])
def test_no_tokens_are_refused_not_a_nan(call, fragment):
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype, power, large", [(np.float64, 664, 1e200), (np.float32, 66, 1e20)])
def test_gradient_bound_ratios_are_scale_free_in_the_upstream(dtype, power, large):
    """Every measured gradient and bound is linear in g: a power of two changes no bit of a ratio and scales every
    per-token value exactly; a large factor (1e200, 1e20 in float32) leaves the ratios as they are, up to rounding."""
    layer = synthetic_routing(9, n_layers=1, dtype=dtype)[0]
    g = np.random.default_rng(10).normal(size=(B, H, N, K)).astype(dtype)
    args = (layer["x_q"], layer["means"], layer["variances"], layer["weights"])
    ref = interpret.gradient_bound_ratios(*args, g)
    exact = interpret.gradient_bound_ratios(*args, g * dtype(2.0**power))
    for name in ("ratio_x", "ratio_means", "ratio_logits", "ratio_logits_modulated", "logits_modulated_ratio", "radius"):
        np.testing.assert_array_equal(getattr(exact, name), getattr(ref, name), err_msg=name)
    for name in ("x_norm", "x_bound", "means_norm", "means_bound", "logits_abs", "logits_bound"):
        np.testing.assert_array_equal(getattr(exact, name), getattr(ref, name) * dtype(2.0**power), err_msg=name)
    scaled = interpret.gradient_bound_ratios(*args, g * dtype(large))
    rtol = 1e-13 if dtype == np.float64 else 1e-5
    for name in ("ratio_x", "ratio_means", "ratio_logits", "ratio_logits_modulated"):
        assert np.all(np.isfinite(getattr(scaled, name))), name
        np.testing.assert_allclose(getattr(scaled, name), getattr(ref, name), rtol=rtol, err_msg=name)
