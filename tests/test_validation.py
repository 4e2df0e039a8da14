"""Every public array function: bad input gets a clear error, inputs are never mutated, results are deterministic.

Each entry of ``CASES`` is a public function of ``refimpl`` with a valid call.
Generic mutations are applied to every floating-point array argument in turn
(integer and complex dtypes, a NaN, an infinity, an extra dimension) and the
error must be the right type and name the argument.  Function-specific bad
values (non-positive variances, weights that do not sum to one, unknown
options, sizes below one, mismatched dimensions, a wrong cache or state) are
listed in ``SPECIFIC``.  Every case is also called twice to check that no input
changes and that the result is reproducible (seeded randomness included), and
once more in float32 to check that float32 in gives float32 out within the
float32 tolerance of the float64 result.

Functions whose arguments are bundles (the layer's ``params``, a ``JointGMM``,
an ``OVQState``, a backward's ``cache``) appear through small wrappers that
take the bundle's arrays as arguments, so that the same mutations reach them.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special

import gpu
from refimpl import attention, gma, gmm, gmr, layers, ovq, ovq_oracle, scan, theory
from refimpl.testing import TOL



# ---------------------------------------------------------------------------
# Valid calls
# ---------------------------------------------------------------------------


def _gmm_args(N=6, K=3, d=2):
    rng = np.random.default_rng(1)
    return dict(
        x=rng.normal(size=(N, d)),
        means=rng.normal(size=(K, d)),
        variances=rng.uniform(0.5, 2.0, size=(K, d)),
        weights=np.array([0.2, 0.3, 0.5]),
    )


def _qkv(N=5, d=3, dv=2):
    rng = np.random.default_rng(2)
    return dict(q=rng.normal(size=(N, d)), k=rng.normal(size=(N, d)), v=rng.normal(size=(N, dv)))


def _drop(d, *names):
    return {k: v for k, v in d.items() if k not in names}


def _with(make, **changes):
    return lambda: {**make(), **changes}


def _isotropic():
    return dict(_drop(_gmm_args(), "variances"), beta=1.5)


def _features(N=6, F=4, dv=3):
    rng = np.random.default_rng(3)
    return dict(phi_q=rng.uniform(0.1, 1.0, (N, F)), phi_k=rng.uniform(0.1, 1.0, (N, F)), v=rng.normal(size=(N, dv)))


def _gma_args(N=7, K=3, d_r=2, d_v=3):
    rng = np.random.default_rng(4)
    return dict(
        x_q=rng.normal(size=(N, d_r)),
        x_k=rng.normal(size=(N, d_r)),
        v=rng.normal(size=(N, d_v)),
        means=rng.normal(size=(K, d_r)),
        variances=rng.uniform(0.5, 2.0, size=(K, d_r)),
        weights=np.array([0.2, 0.3, 0.5]),
    )


def _gma_raw_args():
    args = _drop(_gma_args(), "variances", "weights")
    rng = np.random.default_rng(5)
    return dict(args, raw_variances=rng.normal(size=(3, 2)), logits=rng.normal(size=3))


def _gma_batched_args(leading=(2,), per_head=False, N=5, K=3, d_r=2, d_v=3):
    """gma() arguments with leading (batch) dimensions; per head, the GMM has the last leading dimension as H."""
    rng = np.random.default_rng(16)
    heads = leading[-1:] if per_head else ()
    return dict(
        x_q=rng.normal(size=leading + (N, d_r)),
        x_k=rng.normal(size=leading + (N, d_r)),
        v=rng.normal(size=leading + (N, d_v)),
        means=rng.normal(size=heads + (K, d_r)),
        variances=rng.uniform(0.5, 2.0, size=heads + (K, d_r)),
        weights=special.softmax(rng.normal(size=heads + (K,)), axis=-1),
    )


def _gma_batched_raw_args(leading=(2,), per_head=False):
    args = _drop(_gma_batched_args(leading, per_head), "variances", "weights")
    rng = np.random.default_rng(17)
    heads = leading[-1:] if per_head else ()
    return dict(args, raw_variances=rng.normal(size=heads + (3, 2)), logits=rng.normal(size=heads + (3,)))


def _gammas():
    a = _gma_args()
    gamma_q = gmm.responsibilities(a["x_q"], a["means"], a["variances"], a["weights"])
    gamma_k = gmm.responsibilities(a["x_k"], a["means"], a["variances"], a["weights"])
    return dict(gamma_q=gamma_q, gamma_k=gamma_k, v=a["v"])


def _mixture():
    return _drop(_gmm_args(), "x")


def _gmr_args(M=3, d=3, d_v=2):
    rng = np.random.default_rng(6)
    return dict(
        q=rng.normal(size=(5, d)),
        key_means=rng.normal(size=(M, d)),
        value_means=rng.normal(size=(M, d_v)),
    )


def _joint_data():
    rng = np.random.default_rng(7)
    return dict(k=rng.normal(size=(12, 2)), v=rng.normal(size=(12, 1)))


def _fit_fields():
    fit = gmr.fit_joint_gmm(**_joint_data(), n_components=3, n_iter=3)
    return dict(q=np.random.default_rng(8).normal(size=(4, 2)), **fit._asdict())


def _joint_gmm_predict(q, **fields):
    return gmr.joint_gmm_predict(q, gmr.JointGMM(**fields))


def _layer_fields(B=2, N=5, d_model=4, H=2, d_r=2, d_v=3, K=3):
    params = layers.init_multihead_gma(d_model, H, d_r, d_v, K, seed=9)
    x = np.random.default_rng(10).normal(size=(B, N, d_model))
    return dict(x=x, **params._asdict())


def _multihead_gma(x, *, causal=False, chunk_size=64, eps=1e-6, min_variance=1e-6, **fields):
    return layers.multihead_gma(
        x, layers.MultiheadGMAParams(**fields), causal=causal, chunk_size=chunk_size, eps=eps, min_variance=min_variance
    )


def _ovq_args(T=11, d=3, d_v=2):
    rng = np.random.default_rng(11)
    return dict(q=rng.normal(size=(T, d)), k=rng.normal(size=(T, d)), v=rng.normal(size=(T, d_v)), max_size=4, chunk_size=3)


def _ovq_state():
    rng = np.random.default_rng(12)
    q, k, v = rng.normal(size=(9, 3)), rng.normal(size=(9, 3)), rng.normal(size=(9, 2))
    return ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True)[1]


def _ovq_with_state():
    return dict(_ovq_args(), state=_ovq_state())


def _state_fields():
    st = _ovq_state()
    return dict(keys=np.array(st.keys), values=np.array(st.values), counts=np.array(st.counts), size=st.size, tokens_seen=st.tokens_seen)


def _codebook_args():
    return dict(_drop(_ovq_args(), "max_size"), codebook=np.random.default_rng(13).normal(size=(4, 3)))


# Backward passes: the wrapper runs the forward on the given inputs and feeds its cache to the backward.


def _grad(shape):
    return np.random.default_rng(14).normal(size=shape)


def _softmax_attention_backward(grad_out, q, k, v, causal=False):
    return attention.softmax_attention_backward(grad_out, attention.softmax_attention_forward(q, k, v, causal=causal)[1])


def _feature_attention_backward(grad_out, phi_q, phi_k, v, causal=False, chunk_size=4):
    cache = scan.feature_attention_forward(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size)[1]
    return scan.feature_attention_backward(grad_out, cache)


def _linear_attention_backward(grad_out, q, k, v, causal=False, chunk_size=4):
    cache = attention.linear_attention_forward(q, k, v, causal=causal, chunk_size=chunk_size)[1]
    return attention.linear_attention_backward(grad_out, cache)


def _gma_backward(grad_out, causal=False, chunk_size=4, **args):
    return gma.gma_backward(grad_out, gma.gma_forward(**args, causal=causal, chunk_size=chunk_size)[1])


def _multihead_gma_backward(grad_out, x, causal=False, **fields):
    cache = layers.multihead_gma_forward(x, layers.MultiheadGMAParams(**fields), causal=causal, chunk_size=2)[1]
    return layers.multihead_gma_backward(grad_out, cache)


def _ovq_attention_backward(grad_out, q, k, v, **kw):
    return ovq.ovq_attention_backward(grad_out, ovq.ovq_attention_forward(q, k, v, **kw)[1])


# (id, function, kwargs factory)
CASES = [
    # gmm: primitives
    ("gmm.logsumexp", gmm.logsumexp, lambda: dict(a=np.array([[0.5, -1.0, 2.0], [3.0, -np.inf, 0.0]]))),
    ("gmm.logsumexp(keepdims)", gmm.logsumexp, lambda: dict(a=np.array([[0.5, -1.0, 2.0], [3.0, 1.0, 0.0]]), axis=0, keepdims=True)),
    ("gmm.log_softmax", gmm.log_softmax, lambda: dict(a=np.array([[0.5, -1.0, 2.0], [3.0, -np.inf, 0.0]]))),
    ("gmm.softmax", gmm.softmax, lambda: dict(a=np.array([[0.5, -1.0, 2.0], [3.0, -np.inf, 0.0]]), axis=1)),
    ("gmm.softplus", gmm.softplus, lambda: dict(s=np.array([[-40.0, 0.3], [2.0, 800.0]]))),
    ("gmm.softplus_inverse", gmm.softplus_inverse, lambda: dict(y=np.array([[1e-8, 0.3], [2.0, 800.0]]))),
    ("gmm.sigmoid", gmm.sigmoid, lambda: dict(s=np.array([-40.0, 0.3, 2.0]))),
    ("gmm.variances_from_raw", gmm.variances_from_raw, lambda: dict(raw_variances=np.array([[-3.0, 0.5], [2.0, 40.0]]), min_variance=1e-3)),
    ("gmm.raw_from_variances", gmm.raw_from_variances, lambda: dict(variances=np.array([[0.01, 0.5], [2.0, 40.0]]), min_variance=1e-3)),
    ("gmm.weights_from_logits", gmm.weights_from_logits, lambda: dict(logits=np.array([2.0, -1.0, 0.5, -np.inf]))),
    # gmm: mixtures
    ("gmm.log_gaussian_diag", gmm.log_gaussian_diag, lambda: _drop(_gmm_args(), "weights")),
    ("gmm.log_responsibilities", gmm.log_responsibilities, _gmm_args),
    ("gmm.responsibilities", gmm.responsibilities, _gmm_args),
    ("gmm.log_likelihood", gmm.log_likelihood, _gmm_args),
    ("gmm.em_step", gmm.em_step, _gmm_args),
    ("gmm.isotropic_nll", gmm.isotropic_nll, _isotropic),
    ("gmm.isotropic_nll_gradient", gmm.isotropic_nll_gradient, _isotropic),
    ("gmm.isotropic_surrogate_hessian", gmm.isotropic_surrogate_hessian, _isotropic),
    ("gmm.isotropic_m_step", gmm.isotropic_m_step, _isotropic),
    ("gmm.newton_step", gmm.newton_step, _isotropic),
    ("gmm.newton_step(no weights)", gmm.newton_step, lambda: _drop(_isotropic(), "weights")),
    ("gmm.hard_assignments", gmm.hard_assignments, lambda: _drop(_gmm_args(), "variances", "weights")),
    ("gmm.kmeans_step", gmm.kmeans_step, lambda: _drop(_gmm_args(), "variances", "weights")),
    (
        "gmm.running_mean_update",
        gmm.running_mean_update,
        lambda: dict(
            means=np.zeros((3, 2)), counts=np.array([0, 2, 1]), x=np.ones((4, 2)), assignments=np.array([0, 2, 2, 1])
        ),
    ),
    (
        "gmm.running_mean_update(float counts)",
        gmm.running_mean_update,
        lambda: dict(
            means=np.ones((3, 2)), counts=np.array([0.0, 2.0, 1.5]), x=np.arange(8.0).reshape(4, 2), assignments=np.array([0, 2, 2, 1])
        ),
    ),
    # attention
    ("attention.softmax_attention", attention.softmax_attention, _qkv),
    ("attention.softmax_attention_causal", lambda **kw: attention.softmax_attention(**kw, causal=True), _qkv),
    ("attention.softmax_attention_forward", attention.softmax_attention_forward, _with(_qkv, scale=0.7)),
    ("attention.softmax_attention_backward", _softmax_attention_backward, lambda: dict(_qkv(), grad_out=_grad((5, 2)))),
    ("attention.softmax_attention_backward(causal)", _softmax_attention_backward, lambda: dict(_qkv(), grad_out=_grad((5, 2)), causal=True)),
    ("scan.feature_attention", scan.feature_attention, _features),
    ("scan.feature_attention(causal)", scan.feature_attention, _with(_features, causal=True, chunk_size=4)),
    ("scan.feature_attention_forward", scan.feature_attention_forward, _with(_features, causal=True, chunk_size=4, eps=0.0)),
    ("scan.feature_attention_backward", _feature_attention_backward, lambda: dict(_features(), grad_out=_grad((6, 3)))),
    ("scan.feature_attention_backward(causal)", _feature_attention_backward, lambda: dict(_features(), grad_out=_grad((6, 3)), causal=True)),
    ("attention.elu_feature_map", attention.elu_feature_map, lambda: dict(x=np.array([[-800.0, -1.0], [0.0, 3.0]]))),
    ("attention.linear_attention", attention.linear_attention, _qkv),
    ("attention.linear_attention(causal)", attention.linear_attention, _with(_qkv, causal=True, chunk_size=2)),
    ("attention.linear_attention_forward", attention.linear_attention_forward, _with(_qkv, causal=True, chunk_size=2)),
    ("attention.linear_attention_backward", _linear_attention_backward, lambda: dict(_qkv(), grad_out=_grad((5, 2)))),
    ("attention.linear_attention_backward(causal)", _linear_attention_backward, lambda: dict(_qkv(), grad_out=_grad((5, 2)), causal=True)),
    # gma
    ("gma.gma", gma.gma, _gma_args),
    ("gma.gma(causal)", gma.gma, _with(_gma_args, causal=True, chunk_size=3)),
    ("gma.gma_dense", gma.gma_dense, _gammas),
    ("gma.gma_dense(causal)", gma.gma_dense, _with(_gammas, causal=True, eps=0.0)),
    ("gma.gma_forward", gma.gma_forward, _gma_raw_args),
    ("gma.gma_forward(causal)", gma.gma_forward, _with(_gma_raw_args, causal=True, chunk_size=3, min_variance=1e-2)),
    ("gma.gma_backward", _gma_backward, lambda: dict(_gma_raw_args(), grad_out=_grad((7, 3)))),
    ("gma.gma_backward(causal)", _gma_backward, lambda: dict(_gma_raw_args(), grad_out=_grad((7, 3)), causal=True)),
    ("gma.gma(batched)", gma.gma, _gma_batched_args),
    ("gma.gma(heads)", gma.gma, lambda: _gma_batched_args((2, 3), per_head=True)),
    ("gma.gma(heads, causal)", gma.gma, lambda: dict(_gma_batched_args((3,), per_head=True), causal=True, chunk_size=2)),
    ("gma.gma(batched, shared GMM over heads)", gma.gma, lambda: _gma_batched_args((2, 3))),
    ("gma.gma_forward(batched)", gma.gma_forward, _gma_batched_raw_args),
    ("gma.gma_forward(heads)", gma.gma_forward, lambda: _gma_batched_raw_args((2, 3), per_head=True)),
    ("gma.gma_backward(batched)", _gma_backward, lambda: dict(_gma_batched_raw_args(), grad_out=_grad((2, 5, 3)))),
    ("gma.gma_backward(heads)", _gma_backward, lambda: dict(_gma_batched_raw_args((2, 3), per_head=True), grad_out=_grad((2, 3, 5, 3)), causal=True)),
    # layers
    ("layers.init_multihead_gma", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=2, d_route=2, d_value=3, n_components=3, seed=5)),
    ("layers.multihead_gma", _multihead_gma, _layer_fields),
    ("layers.multihead_gma(causal)", _multihead_gma, _with(_layer_fields, causal=True, chunk_size=2)),
    ("layers.multihead_gma_forward", lambda x, **f: layers.multihead_gma_forward(x, layers.MultiheadGMAParams(**f)), _layer_fields),
    ("layers.multihead_gma_backward", _multihead_gma_backward, lambda: dict(_layer_fields(), grad_out=_grad((2, 5, 4)))),
    ("layers.multihead_gma_backward(causal)", _multihead_gma_backward, lambda: dict(_layer_fields(), grad_out=_grad((2, 5, 4)), causal=True)),
    # theory
    ("theory.bound_radius", theory.bound_radius, lambda: dict(_drop(_mixture(), "weights"), bound_x=2.0, min_variance=0.25)),
    ("theory.lipschitz_bounds", theory.lipschitz_bounds, lambda: dict(_drop(_mixture(), "weights"), bound_x=2.0)),
    ("theory.responsibility_jacobian", theory.responsibility_jacobian, _gmm_args),
    ("theory.jacobian_spectral_norms", theory.jacobian_spectral_norms, _gmm_args),
    ("theory.sample_ball", theory.sample_ball, lambda: dict(n=5, d=3, radius=2.0, rng=np.random.default_rng(15))),
    ("theory.empirical_lipschitz", theory.empirical_lipschitz, lambda: dict(_mixture(), bound_x=2.0, n_points=20, n_pairs=20, seed=3)),
    ("theory.per_token_gradients", theory.per_token_gradients, lambda: dict(_gmm_args(), grad_resp=_grad((6, 3)))),
    ("theory.gradient_bounds", theory.gradient_bounds, lambda: dict(gamma=_gammas()["gamma_q"], grad_resp=_grad((7, 3)), radius=3.0)),
    ("theory.affinity", theory.affinity, lambda: _drop(_gammas(), "v")),
    ("theory.affinity(causal)", theory.affinity, lambda: dict(_drop(_gammas(), "v"), causal=True)),
    ("theory.affinity_by_enumeration", theory.affinity_by_enumeration, lambda: _drop(_gammas(), "v")),
    ("theory.affinity_by_sampling", theory.affinity_by_sampling, lambda: dict(_drop(_gammas(), "v"), n_samples=50, seed=4)),
    ("theory.slot_means", theory.slot_means, lambda: _drop(_gammas(), "gamma_q")),
    ("theory.mixing_weights", theory.mixing_weights, lambda: _drop(_gammas(), "v")),
    ("theory.isotropic_router_logits", theory.isotropic_router_logits, lambda: dict(_drop(_gmm_args(), "variances"), variance=0.7)),
    # gmr
    ("gmr.kernel_regression", gmr.kernel_regression, lambda: dict(_qkv(), beta=2.0)),
    ("gmr.gmr_predict", gmr.gmr_predict, lambda: dict(_gmr_args(), weights=np.array([0.2, 0.3, 0.5]), beta=2.0)),
    ("gmr.ovq_readout", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1, 4, 2]), beta=2.0)),
    ("gmr.ovq_readout(no bias)", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1.0, 4.0, 2.5]), beta=2.0, count_bias=False)),
    ("gmr.readout_gap", gmr.readout_gap, lambda: dict(_gmr_args(), counts=np.array([1, 4, 2]), beta=2.0)),
    ("gmr.readout_gap_bound", gmr.readout_gap_bound, lambda: dict(_drop(_gmr_args(), "q"), beta=2.0)),
    ("gmr.fit_joint_gmm", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=3, n_iter=4, seed=2)),
    ("gmr.joint_gmm_predict", _joint_gmm_predict, _fit_fields),
    # ovq
    ("ovq.unit_rows", ovq.unit_rows, lambda: dict(x=np.array([[3.0, 4.0], [0.0, 0.0], [1e-300, 0.0]]))),
    ("ovq.dictionary_size", ovq.dictionary_size, lambda: dict(t=np.arange(12), max_size=5, growth="linear")),
    ("ovq.OVQState", ovq.OVQState, _state_fields),
    ("ovq.OVQState.empty", ovq.OVQState.empty, lambda: dict(max_size=4, d=3, d_v=2, dtype=np.float32)),
    ("ovq.ovq_attention", ovq.ovq_attention, _with(_ovq_args, return_state=True)),
    ("ovq.ovq_attention(state)", ovq.ovq_attention, _with(_ovq_with_state, return_state=True)),
    ("ovq.ovq_attention(random init)", ovq.ovq_attention, _with(_ovq_args, init="random", seed=7, return_state=True)),
    ("ovq.ovq_attention(ablations)", ovq.ovq_attention, _with(_ovq_args, growth="linear", count_bias=False, learning_rate=0.2, beta=3.0)),
    ("ovq.ovq_attention_forward", ovq.ovq_attention_forward, _ovq_with_state),
    ("ovq.ovq_attention_backward", _ovq_attention_backward, lambda: dict(_ovq_args(), grad_out=_grad((11, 2)))),
    ("ovq.ovq_attention_backward(random init)", _ovq_attention_backward, lambda: dict(_ovq_args(), grad_out=_grad((11, 2)), init="random", seed=3)),
    ("ovq.vq_attention", ovq.vq_attention, _codebook_args),
    ("ovq_oracle.ovq_attention_loop", ovq_oracle.ovq_attention_loop, _with(_ovq_args, init="random", seed=2)),
    ("ovq_oracle.vq_attention_loop", ovq_oracle.vq_attention_loop, _codebook_args),
]

# Exceptions to the generic rules, each with its reason.
# Elementwise and per-axis primitives take arrays of any number of dimensions.
ANY_NDIM = {
    "gmm.logsumexp", "gmm.logsumexp(keepdims)", "gmm.log_softmax", "gmm.softmax", "gmm.softplus", "gmm.softplus_inverse",
    "gmm.sigmoid", "gmm.variances_from_raw", "gmm.raw_from_variances", "gmm.weights_from_logits", "attention.elu_feature_map",
}
# Log-domain inputs: -inf is the log of a zero weight and is accepted; +inf is refused.
LOG_DOMAIN = {"gmm.logsumexp", "gmm.logsumexp(keepdims)", "gmm.log_softmax", "gmm.softmax", "gmm.weights_from_logits"}
# Only these arguments are mutated: the others are the forward's (covered by its own case) or unused fields.
ONLY_ARGS = {
    "attention.softmax_attention_backward": ("grad_out",),
    "attention.softmax_attention_backward(causal)": ("grad_out",),
    "scan.feature_attention_backward": ("grad_out",),
    "scan.feature_attention_backward(causal)": ("grad_out",),
    "attention.linear_attention_backward": ("grad_out",),
    "attention.linear_attention_backward(causal)": ("grad_out",),
    "gma.gma_backward": ("grad_out",),
    "gma.gma_backward(causal)": ("grad_out",),
    "gma.gma_backward(batched)": ("grad_out",),
    "gma.gma_backward(heads)": ("grad_out",),
    "layers.multihead_gma_backward": ("grad_out",),
    "layers.multihead_gma_backward(causal)": ("grad_out",),
    "ovq.ovq_attention_backward": ("grad_out",),
    "ovq.ovq_attention_backward(random init)": ("grad_out",),
    # joint_gmm_predict reads the key marginals and the value means, not value_variances or the trace
    "gmr.joint_gmm_predict": ("q", "key_means", "value_means", "key_variances", "weights"),
}
# Results with no floating array to check for its dtype: Python floats, and indices.
NO_FLOAT_ARRAY_RESULT = {
    "gmm.isotropic_nll", "theory.bound_radius", "theory.lipschitz_bounds", "theory.empirical_lipschitz", "gmm.hard_assignments",
}
# Results that jump under rounding, compared for dtype only in float32: Monte Carlo draws against a cdf,
# and argmax / nearest-centroid decisions.
DISCONTINUOUS = {"theory.affinity_by_sampling", "gmm.kmeans_step"}

# arguments that legitimately take integers (counts and indices)
INTEGER_ARGS = {"counts", "assignments"}


def _float_array_args(cid, kwargs):
    names = [
        k for k, v in kwargs.items()
        if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) and k not in INTEGER_ARGS
    ]
    return [k for k in names if k in ONLY_ARGS.get(cid, names)]


def _set_first(a, value):
    return np.where(np.arange(a.size).reshape(a.shape) == 0, value, a)


def _generic_mutations(cid):
    muts = {
        "integer dtype": (lambda a: np.where(np.isfinite(a), np.round(a), 0).astype(np.int64), TypeError, "expected a real floating-point array"),
        "complex dtype": (lambda a: a + 1j, TypeError, "got complex"),
        "NaN": (lambda a: _set_first(a, np.nan), ValueError, "finite"),
        "+infinity": (lambda a: _set_first(a, np.inf), ValueError, "finite"),
        "-infinity": (lambda a: np.where(np.arange(a.size).reshape(a.shape) == a.size - 1, -np.inf, a), ValueError, "finite"),
        "extra dimension": (lambda a: a[np.newaxis], ValueError, "-D array"),
    }
    if cid in ANY_NDIM:
        del muts["extra dimension"]
    if cid in LOG_DOMAIN:
        del muts["-infinity"]
    return muts


GENERIC = [
    pytest.param(fn, make, arg, mut, id=f"{cid}-{arg}-{mname}")
    for cid, fn, make in CASES
    for arg in _float_array_args(cid, make())
    for mname, mut in _generic_mutations(cid).items()
]


def test_every_public_function_has_a_case():
    """Each function in a module's __all__ (and each public OVQState constructor) appears in CASES.

    Cores (docstring starting "Core"; all of :mod:`refimpl.numerics`) do no
    validation by design: their callers check once, at the public boundary.
    """
    covered = {cid.split("(")[0] for cid, _, _ in CASES}
    wrapped = {  # functions reached through a wrapper that builds their bundle argument
        "attention.softmax_attention_backward", "scan.feature_attention_backward", "attention.linear_attention_backward",
        "gma.gma_backward", "layers.multihead_gma_backward", "ovq.ovq_attention_backward", "gmr.joint_gmm_predict",
    }
    public = set()
    for module in (attention, gma, gmm, gmr, layers, ovq, ovq_oracle, scan, theory):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, type) and not (obj.__doc__ or "").startswith("Core"):
                public.add(f"{module.__name__.split('.')[-1]}.{name}")
    public |= {"ovq.OVQState", "ovq.OVQState.empty"}
    assert not public - covered - wrapped, sorted(public - covered - wrapped)
    assert wrapped <= covered


@pytest.mark.parametrize("fn,make,arg,mutation", GENERIC)
def test_bad_array_is_refused_with_a_message_naming_it(fn, make, arg, mutation):
    transform, exc, fragment = mutation
    kwargs = make()
    kwargs[arg] = transform(kwargs[arg])
    with pytest.raises(exc) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{arg}:") or f"{arg}" in msg.split(":")[0], msg
    assert fragment in msg, msg


def test_minus_infinity_is_a_zero_weight_in_the_log_domain():
    """The log-domain primitives accept -inf (and only -inf among the non-finite values)."""
    a = np.array([[-np.inf, 0.5, -1.0], [2.0, -np.inf, -np.inf]])
    np.testing.assert_allclose(gmm.logsumexp(a, axis=1), special.logsumexp(a, axis=1), rtol=1e-15)
    assert np.array_equal(gmm.softmax(a, axis=1) == 0, np.isneginf(a))
    assert np.array_equal(np.isneginf(gmm.log_softmax(a, axis=1)), np.isneginf(a))
    assert gmm.weights_from_logits(np.array([-np.inf, 0.0]))[0] == 0.0
    assert gmm.logsumexp(np.full(3, -np.inf)) == -np.inf


# ---------------------------------------------------------------------------
# Function-specific bad values
# ---------------------------------------------------------------------------


def _state(max_size, d, d_v, dtype=np.float64):
    return ovq.OVQState.empty(max_size, d, d_v, dtype)


def _feature_cache():
    return scan.feature_attention_forward(**_features())[1]


SPECIFIC = [
    # gmm
    ("variances <= 0", gmm.responsibilities, lambda: {**_gmm_args(), "variances": -_gmm_args()["variances"]}, ValueError, "variances: expected strictly positive"),
    ("weights sum 2", gmm.responsibilities, _with(_gmm_args, weights=np.array([0.4, 0.6, 1.0])), ValueError, "weights: expected weights that sum to 1"),
    ("weights sum 0.9", gmm.log_likelihood, _with(_gmm_args, weights=np.array([0.2, 0.3, 0.4])), ValueError, "weights: expected weights that sum to 1"),
    ("negative weight", gmm.responsibilities, _with(_gmm_args, weights=np.array([-0.5, 0.5, 1.0])), ValueError, "weights: expected nonnegative"),
    ("K mismatch", gmm.responsibilities, _with(_gmm_args, variances=np.ones((2, 2))), ValueError, "variances: expected shape (K, d) = (3, 2), got (2, 2)"),
    ("weights K mismatch", gmm.em_step, _with(_gmm_args, weights=np.array([0.5, 0.5])), ValueError, "weights: expected shape (K,) = (3,), got (2,)"),
    ("d mismatch", gmm.responsibilities, _with(_gmm_args, means=np.ones((3, 5))), ValueError, "means: expected shape (K, d) = (*, 2), got (3, 5)"),
    ("no components", gmm.log_gaussian_diag, lambda: dict(x=np.ones((2, 2)), means=np.ones((0, 2)), variances=np.ones((0, 2))), ValueError, "K >= 1"),
    ("reg_covar < 0", gmm.em_step, _with(_gmm_args, reg_covar=-1e-3), ValueError, "reg_covar: expected a finite number >= 0"),
    ("reg_covar string", gmm.em_step, _with(_gmm_args, reg_covar="0"), TypeError, "reg_covar: expected a real number"),
    ("beta = 0", gmm.isotropic_nll, lambda: dict(x=np.ones((2, 2)), means=np.ones((1, 2)), beta=0.0), ValueError, "beta: expected a finite number > 0"),
    ("beta inf", gmm.newton_step, _with(_isotropic, beta=np.inf), ValueError, "beta: expected a finite number > 0"),
    ("beta string", gmm.isotropic_nll, lambda: dict(x=np.ones((2, 2)), means=np.ones((1, 2)), beta="1"), TypeError, "beta: expected a real number"),
    ("isotropic weights sum", gmm.isotropic_m_step, _with(_isotropic, weights=np.array([0.5, 0.5, 0.5])), ValueError, "weights: expected weights that sum to 1"),
    ("isotropic d mismatch", gmm.isotropic_nll_gradient, _with(_isotropic, means=np.ones((3, 4))), ValueError, "means: expected shape (K, d)"),
    ("hard_assignments d mismatch", gmm.hard_assignments, lambda: dict(x=np.ones((2, 2)), means=np.ones((3, 1))), ValueError, "means: expected shape (K, d)"),
    ("kmeans no components", gmm.kmeans_step, lambda: dict(x=np.ones((2, 2)), means=np.ones((0, 2))), ValueError, "K >= 1"),
    ("counts < 0", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([-1, 0]), x=np.ones((1, 2)), assignments=np.array([0])), ValueError, "counts: expected nonnegative"),
    ("counts NaN", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([np.nan, 0.0]), x=np.ones((1, 2)), assignments=np.array([0])), ValueError, "counts: expected finite"),
    ("counts complex", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([1j, 0]), x=np.ones((1, 2)), assignments=np.array([0])), TypeError, "counts: expected an integer or float array"),
    ("counts K mismatch", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([0, 0, 0]), x=np.ones((1, 2)), assignments=np.array([0])), ValueError, "counts: expected shape (K,) = (2,)"),
    ("float assignments", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([0, 0]), x=np.ones((1, 2)), assignments=np.array([0.0])), TypeError, "assignments: expected integers"),
    ("assignments out of range", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([0, 0]), x=np.ones((1, 2)), assignments=np.array([2])), ValueError, "assignments: expected indices in [0, 2)"),
    ("x d mismatch", gmm.running_mean_update, lambda: dict(means=np.zeros((2, 2)), counts=np.array([0, 0]), x=np.ones((1, 3)), assignments=np.array([0])), ValueError, "x: expected shape (B, d)"),
    ("list of strings", gmm.responsibilities, _with(_gmm_args, x=[["a", "b"]]), TypeError, "x: expected a real floating-point array"),
    ("softmax +inf", gmm.softmax, lambda: dict(a=np.array([1.0, np.inf])), ValueError, "a: expected finite values or -inf"),
    ("logsumexp axis float", gmm.logsumexp, lambda: dict(a=np.ones((2, 2)), axis=1.0), TypeError, "axis: expected an integer"),
    ("logsumexp keepdims string", gmm.logsumexp, lambda: dict(a=np.ones((2, 2)), keepdims="yes"), TypeError, "keepdims: expected True or False"),
    ("softplus string", gmm.softplus, lambda: dict(s="1.0"), TypeError, "s: expected a real floating-point array"),
    ("softplus_inverse y <= 0", gmm.softplus_inverse, lambda: dict(y=np.array([0.5, 0.0])), ValueError, "y: softplus takes only positive values"),
    ("min_variance <= 0", gmm.variances_from_raw, lambda: dict(raw_variances=np.zeros(2), min_variance=-1e-3), ValueError, "min_variance: expected a finite number > 0"),
    ("min_variance string", gmm.raw_from_variances, lambda: dict(variances=np.ones(2), min_variance="1e-6"), TypeError, "min_variance: expected a real number"),
    ("variances at the floor", gmm.raw_from_variances, lambda: dict(variances=np.array([1e-3, 1.0]), min_variance=1e-3), ValueError, "variances: expected values > min_variance"),
    # attention
    ("scale <= 0", attention.softmax_attention, _with(_qkv, scale=-1.0), ValueError, "scale: expected a finite number > 0"),
    ("scale NaN", attention.softmax_attention_forward, _with(_qkv, scale=np.nan), ValueError, "scale: expected a finite number > 0"),
    ("causal not bool", attention.softmax_attention, _with(_qkv, causal="yes"), TypeError, "causal: expected True or False"),
    ("causal lengths", attention.softmax_attention, _with(_qkv, q=np.ones((3, 3)), causal=True), ValueError, "causal=True needs as many queries as keys"),
    ("v rows", attention.softmax_attention, _with(_qkv, v=np.ones((4, 2))), ValueError, "v: expected shape (N_k, d_v) = (5, *), got (4, 2)"),
    ("k d mismatch", attention.softmax_attention, _with(_qkv, k=np.ones((5, 4))), ValueError, "k: expected shape (N_k, d) = (*, 3), got (5, 4)"),
    ("no queries", attention.softmax_attention, _with(_qkv, q=np.ones((0, 3))), ValueError, "expected at least one row"),
    ("softmax grad_out shape", _softmax_attention_backward, lambda: dict(_qkv(), grad_out=np.ones((5, 3))), ValueError, "grad_out: expected shape (N_q, d_v) = (5, 2), got (5, 3)"),
    ("softmax cache type", attention.softmax_attention_backward, lambda: dict(grad_out=np.ones((5, 2)), cache=(1, 2)), TypeError, "cache: expected the SoftmaxAttentionCache"),
    ("negative features", scan.feature_attention, _with(_features, phi_q=-_features()["phi_q"]), ValueError, "phi_q: expected nonnegative features"),
    ("features F mismatch", scan.feature_attention, _with(_features, phi_k=np.ones((6, 5))), ValueError, "phi_k: expected shape (N_k, F) = (*, 4)"),
    ("feature eps < 0", scan.feature_attention, _with(_features, eps=-1e-6), ValueError, "eps: expected a finite number >= 0"),
    ("feature chunk_size 0", scan.feature_attention, _with(_features, causal=True, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("feature chunk_size float", scan.feature_attention, _with(_features, causal=True, chunk_size=2.0), TypeError, "chunk_size: expected an integer"),
    ("feature causal lengths", scan.feature_attention, _with(_features, phi_q=np.ones((4, 4)), causal=True), ValueError, "causal=True needs as many queries as keys"),
    ("feature eps = 0 with no overlap", scan.feature_attention, lambda: dict(phi_q=np.array([[1.0, 0.0]]), phi_k=np.array([[0.0, 1.0]]), v=np.ones((1, 1)), eps=0.0), ValueError, "eps: with eps = 0 the denominator of query row 0"),
    ("feature eps = 0 causal", scan.feature_attention, lambda: dict(phi_q=np.array([[1.0, 0.0], [0.0, 1.0]]), phi_k=np.array([[1.0, 0.0], [1.0, 0.0]]), v=np.ones((2, 1)), eps=0.0, causal=True, chunk_size=1), ValueError, "eps: with eps = 0 the denominator of query row 1"),
    ("feature grad_out shape", _feature_attention_backward, lambda: dict(_features(), grad_out=np.ones((5, 3))), ValueError, "grad_out: expected shape (N_q, d_v) = (6, 3), got (5, 3)"),
    ("feature cache type", scan.feature_attention_backward, lambda: dict(grad_out=np.ones((6, 3)), cache=None), TypeError, "cache: expected the FeatureAttentionCache"),
    ("elu string", attention.elu_feature_map, lambda: dict(x="1"), TypeError, "x: expected a real floating-point array"),
    ("linear chunk_size 0", attention.linear_attention, _with(_qkv, causal=True, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("linear eps NaN", attention.linear_attention, _with(_qkv, eps=np.nan), ValueError, "eps: expected a finite number >= 0"),
    ("linear causal lengths", attention.linear_attention, _with(_qkv, k=np.ones((4, 3)), v=np.ones((4, 2)), causal=True), ValueError, "causal=True needs as many queries as keys"),
    ("linear v rows", attention.linear_attention_forward, _with(_qkv, v=np.ones((6, 2))), ValueError, "v: expected shape (N_k, d_v)"),
    ("linear grad_out shape", _linear_attention_backward, lambda: dict(_qkv(), grad_out=np.ones((2, 5))), ValueError, "grad_out: expected shape (N_q, d_v) = (5, 2), got (2, 5)"),
    ("linear cache type", attention.linear_attention_backward, lambda: dict(grad_out=np.ones((6, 3)), cache=_feature_cache()), TypeError, "cache: expected the LinearAttentionCache"),
    # gma
    ("gma variances <= 0", gma.gma, _with(_gma_args, variances=np.zeros((3, 2))), ValueError, "variances: expected strictly positive"),
    ("gma weights sum", gma.gma, _with(_gma_args, weights=np.array([0.2, 0.3, 0.6])), ValueError, "weights: expected weights that sum to 1"),
    ("gma weights K", gma.gma, _with(_gma_args, weights=np.array([0.5, 0.5])), ValueError, "weights: expected shape (K,) = (3,)"),
    ("gma means d", gma.gma, _with(_gma_args, means=np.ones((3, 4))), ValueError, "means: expected shape (K, d_r) = (*, 2), got (3, 4)"),
    ("gma variances K", gma.gma, _with(_gma_args, variances=np.ones((4, 2))), ValueError, "variances: expected shape (K, d_r) = (3, 2), got (4, 2)"),
    ("gma x_k d", gma.gma, _with(_gma_args, x_k=np.ones((7, 3))), ValueError, "x_k: expected shape (N_k, d_r) = (*, 2)"),
    ("gma v rows", gma.gma, _with(_gma_args, v=np.ones((6, 3))), ValueError, "v: expected shape (N_k, d_v) = (7, *)"),
    ("gma no components", gma.gma, _with(_gma_args, means=np.ones((0, 2)), variances=np.ones((0, 2)), weights=np.ones(0)), ValueError, "K >= 1"),
    ("gma no tokens", gma.gma, _with(_gma_args, x_q=np.ones((0, 2))), ValueError, "at least one token"),
    ("gma causal lengths", gma.gma, _with(_gma_args, x_q=np.ones((5, 2)), causal=True), ValueError, "causal=True needs as many queries as keys (position i attends to j <= i), got x_q with 5 rows"),
    ("gma chunk_size 0", gma.gma, _with(_gma_args, causal=True, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("gma chunk_size float", gma.gma, _with(_gma_args, causal=True, chunk_size=1.5), TypeError, "chunk_size: expected an integer"),
    ("gma chunk_size bool", gma.gma, _with(_gma_args, causal=True, chunk_size=True), TypeError, "chunk_size: expected an integer"),
    ("gma eps < 0", gma.gma, _with(_gma_args, eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
    ("gma causal string", gma.gma, _with(_gma_args, causal="True"), TypeError, "causal: expected True or False"),
    ("gma_dense negative", gma.gma_dense, _with(_gammas, gamma_k=-_gammas()["gamma_k"]), ValueError, "gamma_k: expected nonnegative"),
    ("gma_dense K", gma.gma_dense, _with(_gammas, gamma_k=np.ones((7, 2))), ValueError, "gamma_k: expected shape (N_k, K) = (*, 3)"),
    ("gma_dense causal lengths", gma.gma_dense, _with(_gammas, gamma_q=np.ones((3, 3)), causal=True), ValueError, "got gamma_q with 3 rows"),
    ("gma_dense eps = 0 with no overlap", gma.gma_dense, lambda: dict(gamma_q=np.array([[1.0, 0.0]]), gamma_k=np.array([[0.0, 1.0]]), v=np.ones((1, 2)), eps=0.0), ValueError, "eps: with eps = 0"),
    ("gma_forward min_variance 0", gma.gma_forward, _with(_gma_raw_args, min_variance=0.0), ValueError, "min_variance: expected a finite number > 0"),
    ("gma_forward logits K", gma.gma_forward, _with(_gma_raw_args, logits=np.zeros(4)), ValueError, "logits: expected shape (K,) = (3,)"),
    ("gma_forward raw_variances shape", gma.gma_forward, _with(_gma_raw_args, raw_variances=np.zeros((3, 3))), ValueError, "raw_variances: expected shape (K, d_r) = (3, 2)"),
    ("gma_forward chunk_size -1", gma.gma_forward, _with(_gma_raw_args, chunk_size=-1), ValueError, "chunk_size: expected an integer >= 1"),
    ("gma grad_out shape", _gma_backward, lambda: dict(_gma_raw_args(), grad_out=np.ones((7, 2))), ValueError, "grad_out: expected shape (N_q, d_v) = (7, 3), got (7, 2)"),
    ("gma grad_out 1-D", _gma_backward, lambda: dict(_gma_raw_args(), grad_out=np.ones(21)), ValueError, "grad_out: expected a 2-D array"),
    ("gma batch x_k leading", gma.gma, lambda: {**_gma_batched_args(), "x_k": np.ones((3, 5, 2))}, ValueError, "x_q, x_k: expected arrays with the same leading (batch) dimensions, got a 3-D array of shape (2, 5, 2) and a 3-D array of shape (3, 5, 2)"),
    ("gma batch v 2-D", gma.gma, lambda: {**_gma_batched_args(), "v": np.ones((5, 3))}, ValueError, "x_q, v: expected arrays with the same leading (batch) dimensions"),
    ("gma batch x_q 1-D", gma.gma, _with(_gma_args, x_q=np.ones(2)), ValueError, "x_q: expected a 2-D array (N_q, d_r) or one with leading batch dimensions"),
    ("gma batch x_k d", gma.gma, lambda: {**_gma_batched_args(), "x_k": np.ones((2, 5, 3))}, ValueError, "x_k: expected shape (..., N_k, d_r) = (2, *, 2), got (2, 5, 3)"),
    ("gma batch empty", gma.gma, lambda: {**_gma_batched_args(), "x_q": np.ones((0, 5, 2)), "x_k": np.ones((0, 5, 2)), "v": np.ones((0, 5, 3))}, ValueError, "x_q, x_k: expected at least one sequence"),
    ("gma heads without a head axis", gma.gma, lambda: {**_gma_args(), **_drop(_gma_batched_args((2,), per_head=True), "x_q", "x_k", "v")}, ValueError, "a 3-D array (H, K, d_r), one GMM per head, needs x_q with a head axis"),
    ("gma heads H", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "means": np.ones((2, 3, 2))}, ValueError, "means: a 3-D array (H, K, d_r) holds one GMM per head, so H must be the last leading dimension of x_q, 3"),
    ("gma heads means 4-D", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "means": np.ones((1, 3, 3, 2))}, ValueError, "means: expected a 2-D array (K, d_r) shared by every sequence, or a 3-D array (H, K, d_r) with H = 3"),
    ("gma heads variances shared", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "variances": np.ones((3, 2))}, ValueError, "variances: expected a 3-D array (H, K, d_r) like means, got shape (3, 2) (2-D)"),
    ("gma heads variances K", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "variances": np.ones((3, 4, 2))}, ValueError, "variances: expected shape (H, K, d_r) = (3, 3, 2), got (3, 4, 2)"),
    ("gma heads weights shared", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "weights": np.full(3, 1 / 3)}, ValueError, "weights: expected a 2-D array (H, K) like means, got shape (3,) (1-D)"),
    ("gma heads weights sum", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "weights": np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.6]])}, ValueError, "weights[2]: expected weights that sum to 1"),
    ("gma heads weights negative", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "weights": np.array([[0.2, 0.3, 0.5], [-0.2, 0.7, 0.5], [0.2, 0.3, 0.5]])}, ValueError, "weights[1]: expected nonnegative weights"),
    ("gma heads weights H", gma.gma, lambda: {**_gma_batched_args((2, 3), per_head=True), "weights": np.full((2, 3), 1 / 3)}, ValueError, "weights: expected shape (H, K) = (3, 3), got (2, 3)"),
    ("gma_forward heads logits K", gma.gma_forward, lambda: {**_gma_batched_raw_args((2, 3), per_head=True), "logits": np.zeros((3, 4))}, ValueError, "logits: expected shape (H, K) = (3, 3), got (3, 4)"),
    ("gma_forward shared logits 2-D", gma.gma_forward, lambda: {**_gma_batched_raw_args((2, 3)), "logits": np.zeros((3, 3))}, ValueError, "logits: expected a 1-D array (K,) like means, got shape (3, 3) (2-D)"),
    ("gma batch grad_out shape", _gma_backward, lambda: dict(_gma_batched_raw_args(), grad_out=np.ones((2, 5, 2))), ValueError, "grad_out: expected shape (..., N_q, d_v) = (2, 5, 3), got (2, 5, 2)"),
    ("gma batch grad_out 2-D", _gma_backward, lambda: dict(_gma_batched_raw_args(), grad_out=np.ones((5, 3))), ValueError, "grad_out: expected a 3-D array"),
    ("gma batch causal lengths", gma.gma, lambda: {**_gma_batched_args(), "x_q": np.ones((2, 4, 2)), "causal": True}, ValueError, "got x_q with 4 rows and x_k with 5"),
    ("gma cache type", gma.gma_backward, lambda: dict(grad_out=np.ones((6, 3)), cache=_feature_cache()), TypeError, "cache: expected the GMACache"),
    # layers
    ("layer x 2-D", _multihead_gma, lambda: {**_layer_fields(), "x": np.ones((5, 4))}, ValueError, "x: expected a 3-D array"),
    ("layer d_model", _multihead_gma, lambda: {**_layer_fields(), "x": np.ones((2, 5, 3))}, ValueError, "params.W_q: expected shape (d_model, H * d_r) = (3, 4)"),
    ("layer W_o", _multihead_gma, lambda: {**_layer_fields(), "W_o": np.ones((5, 4))}, ValueError, "params.W_o: expected shape (H * d_v, d_model) = (6, 4)"),
    ("layer W_v", _multihead_gma, lambda: {**_layer_fields(), "W_v": np.ones((4, 5))}, ValueError, "params.W_v: expected shape (d_model, H * d_v)"),
    ("layer raw_variances", _multihead_gma, lambda: {**_layer_fields(), "raw_variances": np.ones((2, 3, 3))}, ValueError, "params.raw_variances: expected shape (H, K, d_r) = (2, 3, 2)"),
    ("layer logits", _multihead_gma, lambda: {**_layer_fields(), "logits": np.ones((2, 4))}, ValueError, "params.logits: expected shape (H, K) = (2, 3)"),
    ("layer min_variance", _multihead_gma, _with(_layer_fields, min_variance=-1.0), ValueError, "min_variance: expected a finite number > 0"),
    ("layer eps", _multihead_gma, _with(_layer_fields, eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
    ("layer chunk_size", _multihead_gma, _with(_layer_fields, causal=True, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("layer causal", _multihead_gma, _with(_layer_fields, causal=None), TypeError, "causal: expected True or False"),
    ("layer params missing", layers.multihead_gma, lambda: dict(x=np.ones((1, 2, 4)), params={"W_q": np.ones((4, 4))}), ValueError, "params: missing entries"),
    ("layer params list", layers.multihead_gma, lambda: dict(x=np.ones((1, 2, 4)), params=[np.ones((4, 4))]), TypeError, "params: expected a MultiheadGMAParams"),
    ("layer grad_out shape", _multihead_gma_backward, lambda: dict(_layer_fields(), grad_out=np.ones((2, 4, 4))), ValueError, "grad_out: expected shape (B, N, d_model) = (2, 5, 4)"),
    ("layer cache type", layers.multihead_gma_backward, lambda: dict(grad_out=np.ones((2, 5, 4)), cache={"x": 1}), TypeError, "cache: expected the MultiheadGMACache"),
    ("init n_heads 0", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=0, d_route=2, d_value=2, n_components=3), ValueError, "n_heads: expected an integer >= 1"),
    ("init d_model float", layers.init_multihead_gma, lambda: dict(d_model=4.0, n_heads=1, d_route=2, d_value=2, n_components=3), TypeError, "d_model: expected an integer"),
    ("init n_components 0", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=0), ValueError, "n_components: expected an integer >= 1"),
    ("init variance at floor", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, init_variance=1e-7), ValueError, "init_variance: expected a value > min_variance"),
    ("init seed string", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, seed="abc"), TypeError, "seed: expected an integer >= 0 or a numpy.random.Generator"),
    ("init seed float", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, seed=1.5), TypeError, "seed: expected an integer >= 0 or a numpy.random.Generator"),
    ("init seed < 0", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, seed=-1), ValueError, "seed: expected an integer >= 0"),
    ("init dtype int", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, dtype=np.int64), TypeError, "dtype: expected float32 or float64"),
    ("init dtype unknown", layers.init_multihead_gma, lambda: dict(d_model=4, n_heads=1, d_route=2, d_value=2, n_components=3, dtype="float99"), TypeError, "dtype: expected float32 or float64"),
    # theory
    ("bound_x < 0", theory.bound_radius, lambda: dict(_drop(_mixture(), "weights"), bound_x=-1.0), ValueError, "bound_x: expected a finite number >= 0"),
    ("floor above the variances", theory.lipschitz_bounds, lambda: dict(_drop(_mixture(), "weights"), bound_x=1.0, min_variance=10.0), ValueError, "min_variance: expected a floor <= the smallest variance"),
    ("bound variances shape", theory.bound_radius, lambda: dict(means=np.ones((3, 2)), variances=np.ones((3, 3)), bound_x=1.0), ValueError, "variances: expected shape (K, d) = (3, 2)"),
    ("jacobian variances <= 0", theory.responsibility_jacobian, _with(_gmm_args, variances=np.zeros((3, 2))), ValueError, "variances: expected strictly positive"),
    ("jacobian weights sum", theory.jacobian_spectral_norms, _with(_gmm_args, weights=np.array([0.3, 0.3, 0.3])), ValueError, "weights: expected weights that sum to 1"),
    ("jacobian d mismatch", theory.responsibility_jacobian, _with(_gmm_args, x=np.ones((4, 3))), ValueError, "means: expected shape (K, d) = (*, 3)"),
    ("sample_ball n < 0", theory.sample_ball, lambda: dict(n=-1, d=2, radius=1.0, rng=np.random.default_rng(0)), ValueError, "n: expected an integer >= 0"),
    ("sample_ball d 0", theory.sample_ball, lambda: dict(n=2, d=0, radius=1.0, rng=np.random.default_rng(0)), ValueError, "d: expected an integer >= 1"),
    ("sample_ball radius", theory.sample_ball, lambda: dict(n=2, d=2, radius=-1.0, rng=np.random.default_rng(0)), ValueError, "radius: expected a finite number >= 0"),
    ("sample_ball rng", theory.sample_ball, lambda: dict(n=2, d=2, radius=1.0, rng=0), TypeError, "rng: expected a numpy.random.Generator"),
    ("empirical n_points", theory.empirical_lipschitz, lambda: dict(_mixture(), bound_x=1.0, n_points=0), ValueError, "n_points: expected an integer >= 1"),
    ("empirical seed", theory.empirical_lipschitz, lambda: dict(_mixture(), bound_x=1.0, n_points=3, n_pairs=3, seed="x"), TypeError, "seed: expected an integer >= 0 or a numpy.random.Generator"),
    ("empirical bound_x NaN", theory.empirical_lipschitz, lambda: dict(_mixture(), bound_x=np.nan), ValueError, "bound_x: expected a finite number"),
    ("per_token grad_resp shape", theory.per_token_gradients, lambda: dict(_gmm_args(), grad_resp=np.ones((6, 2))), ValueError, "grad_resp: expected shape (N, K) = (6, 3)"),
    ("gradient_bounds rows", theory.gradient_bounds, lambda: dict(gamma=np.ones((2, 3)), grad_resp=np.ones((2, 3)), radius=1.0), ValueError, "gamma: expected rows that sum to 1"),
    ("gradient_bounds negative", theory.gradient_bounds, lambda: dict(gamma=np.array([[1.5, -0.5]]), grad_resp=np.ones((1, 2)), radius=1.0), ValueError, "gamma: expected nonnegative"),
    ("gradient_bounds radius", theory.gradient_bounds, lambda: dict(gamma=np.eye(2), grad_resp=np.ones((2, 2)), radius=-2.0), ValueError, "radius: expected a finite number >= 0"),
    ("gradient_bounds grad_resp shape", theory.gradient_bounds, lambda: dict(gamma=np.eye(2), grad_resp=np.ones((3, 2)), radius=1.0), ValueError, "grad_resp: expected shape (N, K) = (2, 2)"),
    ("affinity K", theory.affinity, lambda: dict(gamma_q=np.eye(3), gamma_k=np.eye(2)), ValueError, "gamma_k: expected shape (N, K) = (*, 3)"),
    ("affinity causal lengths", theory.affinity, lambda: dict(gamma_q=np.eye(3), gamma_k=np.eye(3)[:2], causal=True), ValueError, "causal=True needs N_q == N_k"),
    ("affinity causal string", theory.affinity, lambda: dict(gamma_q=np.eye(3), gamma_k=np.eye(3), causal="no"), TypeError, "causal: expected True or False"),
    ("enumeration rows", theory.affinity_by_enumeration, lambda: dict(gamma_q=np.eye(3) * 2, gamma_k=np.eye(3)), ValueError, "gamma_q: expected rows that sum to 1"),
    ("sampling n_samples", theory.affinity_by_sampling, lambda: dict(gamma_q=np.eye(3), gamma_k=np.eye(3), n_samples=0), ValueError, "n_samples: expected an integer >= 1"),
    ("sampling seed", theory.affinity_by_sampling, lambda: dict(gamma_q=np.eye(3), gamma_k=np.eye(3), n_samples=4, seed=-3), ValueError, "seed: expected an integer >= 0"),
    ("slot_means v rows", theory.slot_means, lambda: dict(gamma_k=np.eye(3), v=np.ones((2, 2))), ValueError, "v: expected shape (N_k, d_v) = (3, *)"),
    ("slot_means empty slot", theory.slot_means, lambda: dict(gamma_k=np.array([[1.0, 0.0], [1.0, 0.0]]), v=np.ones((2, 2))), ValueError, "gamma_k: every slot needs a positive mass"),
    ("mixing eps < 0", theory.mixing_weights, lambda: dict(gamma_q=np.eye(2), gamma_k=np.eye(2), eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
    ("mixing eps = 0 with no mass", theory.mixing_weights, lambda: dict(gamma_q=np.eye(2), gamma_k=np.array([[1.0, 0.0]]), eps=0.0), ValueError, "eps: with eps = 0 the denominator of query row 1"),
    ("router variance 0", theory.isotropic_router_logits, lambda: dict(_drop(_gmm_args(), "variances"), variance=0.0), ValueError, "variance: expected a finite number > 0"),
    ("router weights sum", theory.isotropic_router_logits, lambda: dict(_drop(_gmm_args(), "variances", "weights"), variance=1.0, weights=np.ones(3)), ValueError, "weights: expected weights that sum to 1"),
    # gmr
    ("kernel beta 0", gmr.kernel_regression, _with(_qkv, beta=0.0), ValueError, "beta: expected a finite number > 0"),
    ("kernel beta missing", gmr.kernel_regression, _with(_qkv, beta=None), TypeError, "beta: expected a real number"),
    ("kernel k d", gmr.kernel_regression, lambda: dict(_qkv(), k=np.ones((5, 2)), beta=1.0), ValueError, "k: expected shape (N_k, d) = (*, 3)"),
    ("kernel v rows", gmr.kernel_regression, lambda: dict(_qkv(), v=np.ones((3, 2)), beta=1.0), ValueError, "v: expected shape (N_k, d_v) = (5, *)"),
    ("gmr weights sum", gmr.gmr_predict, lambda: dict(_gmr_args(), weights=np.array([0.2, 0.2, 0.5]), beta=1.0), ValueError, "weights: expected weights that sum to 1"),
    ("gmr weights M", gmr.gmr_predict, lambda: dict(_gmr_args(), weights=np.array([0.5, 0.5]), beta=1.0), ValueError, "weights: expected shape (M,) = (3,)"),
    ("gmr beta < 0", gmr.gmr_predict, lambda: dict(_gmr_args(), weights=np.array([0.2, 0.3, 0.5]), beta=-1.0), ValueError, "beta: expected a finite number > 0"),
    ("gmr value_means M", gmr.gmr_predict, lambda: dict(_gmr_args(), value_means=np.ones((2, 2)), weights=np.array([0.2, 0.3, 0.5]), beta=1.0), ValueError, "value_means: expected shape (M, d_v) = (3, *)"),
    ("gmr key_means d", gmr.gmr_predict, lambda: dict(_gmr_args(), key_means=np.ones((3, 2)), weights=np.array([0.2, 0.3, 0.5]), beta=1.0), ValueError, "key_means: expected shape (M, d) = (*, 3)"),
    ("readout counts 0", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1, 0, 2]), beta=1.0), ValueError, "counts: expected strictly positive"),
    ("readout counts NaN", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1.0, np.nan, 2.0]), beta=1.0), ValueError, "counts: expected finite"),
    ("readout counts shape", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1, 2]), beta=1.0), ValueError, "counts: expected shape (M,) = (3,)"),
    ("readout counts bool", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([True, True, True]), beta=1.0), TypeError, "counts: expected an integer or float array"),
    ("readout count_bias", gmr.ovq_readout, lambda: dict(_gmr_args(), counts=np.array([1, 2, 3]), beta=1.0, count_bias=1), TypeError, "count_bias: expected True or False"),
    ("gap beta 0", gmr.readout_gap, lambda: dict(_gmr_args(), counts=np.array([1, 2, 3]), beta=0.0), ValueError, "beta: expected a finite number > 0"),
    ("gap counts shape", gmr.readout_gap, lambda: dict(_gmr_args(), counts=np.array([1, 2, 3, 4]), beta=1.0), ValueError, "counts: expected shape (M,) = (3,)"),
    ("gap bound beta", gmr.readout_gap_bound, lambda: dict(_drop(_gmr_args(), "q"), beta=-1.0), ValueError, "beta: expected a finite number > 0"),
    ("gap bound M", gmr.readout_gap_bound, lambda: dict(key_means=np.ones((3, 2)), value_means=np.ones((2, 2)), beta=1.0), ValueError, "value_means: expected shape (M, d_v) = (3, *)"),
    ("gap bound empty", gmr.readout_gap_bound, lambda: dict(key_means=np.ones((0, 2)), value_means=np.ones((0, 2)), beta=1.0), ValueError, "key_means: expected at least one component"),
    ("fit n_components > T", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=13), ValueError, "n_components: expected at most T = 12"),
    ("fit n_components 0", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=0), ValueError, "n_components: expected an integer >= 1"),
    ("fit n_iter < 0", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=2, n_iter=-1), ValueError, "n_iter: expected an integer >= 0"),
    ("fit reg_covar", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=2, reg_covar=-1.0), ValueError, "reg_covar: expected a finite number >= 0"),
    ("fit seed", gmr.fit_joint_gmm, lambda: dict(_joint_data(), n_components=2, seed=-1), ValueError, "seed: expected an integer >= 0"),
    (
        "fit collapses without reg_covar",
        gmr.fit_joint_gmm,
        lambda: dict(k=np.array([[0.0], [0.0], [1.0], [2.0]]), v=np.array([[1.0], [1.0], [0.0], [0.0]]), n_components=3, reg_covar=0.0),
        ValueError,
        "reg_covar: after EM iteration",
    ),
    ("fit v rows", gmr.fit_joint_gmm, lambda: dict(k=np.ones((4, 2)), v=np.ones((3, 1)), n_components=2), ValueError, "v: expected shape (T, d_v) = (4, *)"),
    ("predict fit type", gmr.joint_gmm_predict, lambda: dict(q=np.ones((2, 2)), fit={"key_means": 1}), TypeError, "fit: expected a JointGMM"),
    ("predict q d", _joint_gmm_predict, lambda: {**_fit_fields(), "q": np.ones((2, 3))}, ValueError, "fit.key_means: expected shape (M, d) = (*, 3), got (3, 2)"),
    ("predict value_means M", _joint_gmm_predict, lambda: {**_fit_fields(), "value_means": np.ones((2, 1))}, ValueError, "fit.value_means: expected shape (M, d_v) = (3, *)"),
    ("predict key_variances <= 0", _joint_gmm_predict, lambda: {**_fit_fields(), "key_variances": np.zeros((3, 2))}, ValueError, "fit.key_variances: expected strictly positive"),
    ("predict weights sum", _joint_gmm_predict, lambda: {**_fit_fields(), "weights": np.array([0.5, 0.5, 0.5])}, ValueError, "fit.weights: expected weights that sum to 1"),
    # ovq: growth, state, call
    ("size t < 0", ovq.dictionary_size, lambda: dict(t=-1, max_size=4), ValueError, "t: expected an integer >= 0"),
    ("size t float", ovq.dictionary_size, lambda: dict(t=2.5, max_size=4), TypeError, "t: expected an integer"),
    ("size t float array", ovq.dictionary_size, lambda: dict(t=np.array([1.0]), max_size=4), TypeError, "t: expected integers"),
    ("size t negative array", ovq.dictionary_size, lambda: dict(t=np.array([3, -1]), max_size=4), ValueError, "t: expected token counts >= 0"),
    ("size max_size 0", ovq.dictionary_size, lambda: dict(t=3, max_size=0), ValueError, "max_size: expected an integer >= 1"),
    ("size max_size float", ovq.dictionary_size, lambda: dict(t=3, max_size=4.0), TypeError, "max_size: expected an integer"),
    ("size growth", ovq.dictionary_size, lambda: dict(t=3, max_size=4, growth="exponential"), ValueError, "growth: expected one of 'plateau', 'linear'"),
    ("state size > N", ovq.OVQState, lambda: {**_state_fields(), "size": 5}, ValueError, "size: expected at most N = 4"),
    ("state negative count", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array([-1, 5, 3, 2])}, ValueError, "counts: expected nonnegative"),
    ("state counts sum", ovq.OVQState, lambda: {**_state_fields(), "tokens_seen": 10}, ValueError, "counts: expected sum(counts) == tokens_seen = 10"),
    ("state counts float", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array(_state_fields()["counts"], dtype=float)}, TypeError, "counts: expected integers"),
    ("state counts shape", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array([9, 0, 0])}, ValueError, "counts: expected shape (N,) = (4,)"),
    ("state values rows", ovq.OVQState, lambda: {**_state_fields(), "values": np.ones((3, 2))}, ValueError, "values: expected shape (N, d_v) = (4, *)"),
    ("state dtypes differ", ovq.OVQState, lambda: {**_state_fields(), "values": _state_fields()["values"].astype(np.float32)}, TypeError, "values: expected the dtype of keys"),
    ("state active count 0", ovq.OVQState, lambda: dict(keys=np.ones((3, 2)), values=np.ones((3, 1)), counts=np.array([2, 0, 0]), size=2, tokens_seen=2), ValueError, "every active row"),
    ("state unused count", ovq.OVQState, lambda: dict(keys=np.ones((3, 2)), values=np.ones((3, 1)), counts=np.array([1, 0, 1]), size=1, tokens_seen=2), ValueError, "rows >= size"),
    ("state size float", ovq.OVQState, lambda: {**_state_fields(), "size": 3.0}, TypeError, "size: expected an integer"),
    ("state no rows", ovq.OVQState, lambda: dict(keys=np.ones((0, 2)), values=np.ones((0, 1)), counts=np.zeros(0, int), size=0, tokens_seen=0), ValueError, "keys: expected shape (N, d) with N >= 1"),
    ("empty max_size", ovq.OVQState.empty, lambda: dict(max_size=0, d=2, d_v=2), ValueError, "max_size: expected an integer >= 1"),
    ("empty dtype int", ovq.OVQState.empty, lambda: dict(max_size=2, d=2, d_v=2, dtype=np.int32), TypeError, "dtype: expected float32 or float64"),
    ("empty dtype unknown", ovq.OVQState.empty, lambda: dict(max_size=2, d=2, d_v=2, dtype="f99"), TypeError, "dtype: expected float32 or float64"),
    ("ovq k rows", ovq.ovq_attention, _with(_ovq_args, k=np.ones((10, 3))), ValueError, "k: expected shape (T, d) = (11, 3)"),
    ("ovq v rows", ovq.ovq_attention, _with(_ovq_args, v=np.ones((12, 2))), ValueError, "v: expected shape (T, d_v) = (11, *)"),
    ("ovq d_v 0", ovq.ovq_attention, _with(_ovq_args, v=np.ones((11, 0))), ValueError, "d_v >= 1"),
    ("ovq T 0", ovq.ovq_attention, _with(_ovq_args, q=np.ones((0, 3)), k=np.ones((0, 3)), v=np.ones((0, 2))), ValueError, "T >= 1"),
    ("ovq max_size 0", ovq.ovq_attention, _with(_ovq_args, max_size=0), ValueError, "max_size: expected an integer >= 1"),
    ("ovq max_size float", ovq.ovq_attention, _with(_ovq_args, max_size=4.0), TypeError, "max_size: expected an integer"),
    ("ovq chunk_size 0", ovq.ovq_attention, _with(_ovq_args, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("ovq chunk_size float", ovq.ovq_attention_forward, _with(_ovq_args, chunk_size=3.0), TypeError, "chunk_size: expected an integer"),
    ("ovq growth", ovq.ovq_attention, _with(_ovq_args, growth="Plateau"), ValueError, "growth: expected one of 'plateau', 'linear'"),
    ("ovq init", ovq.ovq_attention, _with(_ovq_args, init="kmeans++"), ValueError, "init: expected one of 'spread', 'random'"),
    ("ovq init None", ovq.ovq_attention_forward, _with(_ovq_args, init=None), ValueError, "init: expected one of 'spread', 'random'"),
    ("ovq beta 0", ovq.ovq_attention, _with(_ovq_args, beta=0.0), ValueError, "beta: expected a finite number > 0"),
    ("ovq beta inf", ovq.ovq_attention, _with(_ovq_args, beta=np.inf), ValueError, "beta: expected a finite number > 0"),
    ("ovq learning_rate 0", ovq.ovq_attention, _with(_ovq_args, learning_rate=0.0), ValueError, "learning_rate: expected a finite number > 0"),
    ("ovq learning_rate string", ovq.ovq_attention, _with(_ovq_args, learning_rate="0.1"), TypeError, "learning_rate: expected a real number"),
    ("ovq seed < 0", ovq.ovq_attention, _with(_ovq_args, seed=-1), ValueError, "seed: expected an integer >= 0"),
    ("ovq seed float", ovq.ovq_attention, _with(_ovq_args, init="random", seed=0.5), TypeError, "seed: expected an integer"),
    ("ovq count_bias", ovq.ovq_attention, _with(_ovq_args, count_bias=1), TypeError, "count_bias: expected True or False"),
    ("ovq return_state", ovq.ovq_attention, _with(_ovq_args, return_state="yes"), TypeError, "return_state: expected True or False"),
    ("ovq state type", ovq.ovq_attention, _with(_ovq_args, state={"keys": 1}), TypeError, "state: expected an OVQState"),
    ("ovq state N", ovq.ovq_attention, _with(_ovq_args, state=_state(5, 3, 2)), ValueError, "state: has N = 5 rows but max_size = 4"),
    ("ovq state d", ovq.ovq_attention_forward, _with(_ovq_args, state=_state(4, 2, 2)), ValueError, "state: holds keys of dimension d = 2, but q and k have d = 3"),
    ("ovq state d_v", ovq.ovq_attention, _with(_ovq_args, state=_state(4, 3, 3)), ValueError, "state: holds values of dimension d_v = 3, but v has d_v = 2"),
    (
        "ovq state too small for its growth",
        ovq.ovq_attention,
        _with(_ovq_args, max_size=10, state=ovq.OVQState(np.ones((10, 3)), np.ones((10, 2)), np.array([40] + [0] * 9), 1, 40)),
        ValueError,
        "state: size = 1 after tokens_seen = 40 is too small for growth='plateau'",
    ),
    ("ovq grad_out shape", _ovq_attention_backward, lambda: dict(_ovq_args(), grad_out=np.ones((11, 3))), ValueError, "grad_out: expected shape (T, d_v) = (11, 2)"),
    ("ovq cache type", ovq.ovq_attention_backward, lambda: dict(grad_out=np.ones((11, 2)), cache=_feature_cache()), TypeError, "cache: expected the OVQCache"),
    ("vq codebook d", ovq.vq_attention, _with(_codebook_args, codebook=np.ones((4, 2))), ValueError, "codebook: expected shape (S, d) = (*, 3)"),
    ("vq codebook empty", ovq.vq_attention, _with(_codebook_args, codebook=np.ones((0, 3))), ValueError, "codebook: expected at least one code"),
    ("vq chunk_size 0", ovq.vq_attention, _with(_codebook_args, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("vq beta < 0", ovq.vq_attention, _with(_codebook_args, beta=-2.0), ValueError, "beta: expected a finite number > 0"),
    ("vq k rows", ovq.vq_attention, _with(_codebook_args, k=np.ones((3, 3))), ValueError, "k: expected shape (T, d) = (11, 3)"),
    ("loop growth", ovq_oracle.ovq_attention_loop, _with(_ovq_args, growth="exponential"), ValueError, "growth: expected one of"),
    ("loop chunk_size 0", ovq_oracle.ovq_attention_loop, _with(_ovq_args, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("loop integer q", ovq_oracle.ovq_attention_loop, _with(_ovq_args, q=np.ones((11, 3), dtype=int)), TypeError, "q: expected a real floating-point array"),
    ("vq loop codebook d", ovq_oracle.vq_attention_loop, _with(_codebook_args, codebook=np.ones((4, 2))), ValueError, "codebook: expected shape (S, d)"),
    # gpu
    ("gpu unknown backend", gpu.require, lambda: dict(backend="opencl"), ValueError, "backend: expected one of 'numba-cuda', 'cupy', got 'opencl'"),
    ("gpu backend not a string", gpu.require, lambda: dict(backend=3), ValueError, "backend: expected one of"),
]


@pytest.mark.parametrize("fn,make,exc,fragment", [pytest.param(*c[1:], id=c[0]) for c in SPECIFIC])
def test_specific_bad_values_are_refused(fn, make, exc, fragment):
    with pytest.raises(exc) as info:
        fn(**make())
    assert fragment in str(info.value), str(info.value)


def test_weights_within_the_tolerance_are_accepted():
    """The sum-to-one check allows rounding (sqrt(eps) per component), not a visible error."""
    args = _gmm_args()
    w = args["weights"] * (1 + 1e-12)
    np.testing.assert_allclose(gmm.responsibilities(**{**args, "weights": w}), gmm.responsibilities(**args), rtol=1e-11)
    w32 = np.array([0.2, 0.3, 0.5], dtype=np.float32) * np.float32(1 + 1e-5)
    assert gmm.responsibilities(**{**{k: v.astype(np.float32) for k, v in args.items()}, "weights": w32}).dtype == np.float32
    with pytest.raises(ValueError, match="weights: expected weights that sum to 1"):
        gmm.responsibilities(**{**args, "weights": args["weights"] * (1 + 1e-6)})


# ---------------------------------------------------------------------------
# Never mutates, deterministic, float32 in -> float32 out
# ---------------------------------------------------------------------------


def _leaves(obj):
    """Arrays and scalars of a result, depth first (tuples, named tuples, lists, dicts, states)."""
    if isinstance(obj, ovq.OVQState):
        return [obj.keys, obj.values, obj.counts, obj.size, obj.tokens_seen]
    if isinstance(obj, (tuple, list)):
        return [leaf for item in obj for leaf in _leaves(item)]
    if isinstance(obj, dict):
        return [leaf for key in sorted(obj) for leaf in _leaves(obj[key])]
    return [obj]


def _snapshot(kwargs):
    """Copies of every array an argument holds, to compare after the call."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, np.ndarray):
            out[k] = [v.copy()]
        elif isinstance(v, ovq.OVQState):
            out[k] = [np.array(a, copy=True) for a in _leaves(v)]
    return out


def _assert_same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y or (x is None and y is None), (x, y)


@pytest.mark.parametrize("fn,make", [pytest.param(fn, make, id=cid) for cid, fn, make in CASES])
def test_inputs_are_never_mutated_and_results_are_deterministic(fn, make):
    kwargs = make()
    before = _snapshot(kwargs)
    first = fn(**kwargs)
    after = _snapshot(kwargs)
    assert before.keys() == after.keys()
    for k in before:
        for x, y in zip(before[k], after[k]):
            np.testing.assert_array_equal(x, y, err_msg=f"{k} was modified")
    # a fresh call from fresh arguments (a seed, never a generator already advanced) gives the same bits
    _assert_same(first, fn(**make()))


def _to_float32(value):
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        return value.astype(np.float32)
    if isinstance(value, ovq.OVQState):
        return ovq.OVQState(value.keys.astype(np.float32), value.values.astype(np.float32), value.counts, value.size, value.tokens_seen)
    return value


def _has_float_input(kwargs):
    return any(
        isinstance(v, ovq.OVQState) or (isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))
        for v in kwargs.values()
    )


F32_CASES = [
    pytest.param(cid, fn, make, id=cid)
    for cid, fn, make in CASES
    if _has_float_input(make()) and cid not in NO_FLOAT_ARRAY_RESULT
]


@pytest.mark.parametrize("cid,fn,make", F32_CASES)
def test_float32_in_float32_out(cid, fn, make):
    """Every floating array of the result is float32 and within the float32 tolerance of the float64 result."""
    ref = fn(**make())
    out = fn(**{k: _to_float32(v) for k, v in make().items()})
    assert len(_leaves(out)) == len(_leaves(ref))
    pairs = [
        (o, r) for o, r in zip(_leaves(out), _leaves(ref))
        if isinstance(o, np.ndarray) and np.issubdtype(o.dtype, np.floating)
    ]
    assert pairs, "the result holds no floating array"
    for o, r in pairs:
        assert o.dtype == np.float32
        if cid not in DISCONTINUOUS:
            finite = np.isfinite(r)
            assert np.array_equal(np.isfinite(o), finite)
            scale = max(1.0, float(np.max(np.abs(r[finite]), initial=0.0)))
            np.testing.assert_allclose(o[finite], r[finite], rtol=TOL[np.float32]["rtol"], atol=TOL[np.float32]["atol"] * scale)
