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
from refimpl import attention, gma, gmm, gmr, ovq, ovq_oracle, scan, theory
from app import interpret, layers, model, optim, tasks, train
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


def _ovq_args(N=11, d=3, d_v=2):
    rng = np.random.default_rng(11)
    return dict(q=rng.normal(size=(N, d)), k=rng.normal(size=(N, d)), v=rng.normal(size=(N, d_v)), max_size=4, chunk_size=3)


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
    cache = attention.feature_attention_forward(phi_q, phi_k, v, causal=causal, chunk_size=chunk_size)[1]
    return attention.feature_attention_backward(grad_out, cache)


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


# Model, optimiser, tasks, interpretability, training.  A model's ``params`` dict enters as keyword arguments
# named by its keys (``embed``, ``layer0.mixer.W_q``, ...), which the errors name as ``params['embed']``.

_MCFG = model.ModelConfig(vocab_size=7, max_len=6, d_model=8, n_heads=2, n_components=3, d_route=2, mlp_hidden=8)
_LMCFG = _MCFG._replace(head="lm", causal=True)


def _model_args(config=_MCFG, targets=True):
    rng = np.random.default_rng(20)
    tokens = rng.integers(1, config.vocab_size, size=(2, 5))
    tokens[1, -1] = config.pad_id
    args = dict(tokens=tokens, config=config, **model.init_params(config, seed=3))
    if targets:
        n_out = config.n_classes if config.head == "classify" else config.vocab_size
        args["targets"] = rng.integers(0, n_out, size=tokens.shape[:1] if config.head == "classify" else tokens.shape)
    return args


def _model_forward(tokens, config, **params):
    return model.model_forward(params, tokens, config)


def _model_backward(dlogits, tokens, config, **params):
    return model.model_backward(dlogits, model.model_forward(params, tokens, config)[1])


def _loss_and_grads(tokens, targets, config, **params):
    return model.loss_and_grads(params, tokens, targets, config)


def _gma_routing(tokens, config, targets=None, **params):
    return model.gma_routing(params, tokens, config, targets=targets)


def _logits_args():
    rng = np.random.default_rng(21)
    return dict(logits=rng.normal(size=(3, 4, 5)), targets=rng.integers(0, 5, size=(3, 4)), mask=rng.random((3, 4)) < 0.7)


def _cross_entropy_backward(logits, targets, mask=None):
    return model.cross_entropy_backward(model.cross_entropy_forward(logits, targets, mask)[1])


# optim: the dicts enter as keyword arguments named like the errors name them, params['W'], grads['W'], state.m['W'], ...
_OPT_SHAPES = {"layer0.W": (3, 2), "layer0.b": (2,)}


def _named(prefix, arrays):
    return {f"{prefix}[{k!r}]": a for k, a in arrays.items()}


def _unnamed(prefix, kwargs):
    head = prefix + "['"
    return {k[len(head):-2]: a for k, a in kwargs.items() if k.startswith(head)}


def _opt_arrays(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in _OPT_SHAPES.items()}


def _adam_args(step=3):
    v = {k: np.abs(a) for k, a in _opt_arrays(24).items()}
    return dict(
        _named("params", _opt_arrays(22)), **_named("grads", _opt_arrays(23)), **_named("state.m", _opt_arrays(25)),
        **_named("state.v", v), step=step, lr=1e-2, weight_decay=0.1, clip_norm=1.0,
    )


def _adam_step(*, step, **kw):
    arrays = {k: kw.pop(k) for k in [k for k in kw if "[" in k]}
    state = optim.AdamState(step, _unnamed("state.m", arrays), _unnamed("state.v", arrays))
    return optim.adam_step(_unnamed("params", arrays), _unnamed("grads", arrays), state, **kw)


def _adam_init(**arrays):
    return optim.adam_init(_unnamed("params", arrays))


def _global_norm(**arrays):
    return optim.global_norm(_unnamed("grads", arrays))


# interpret
def _gamma(shape, seed):
    return special.softmax(np.random.default_rng(seed).normal(size=shape), axis=-1)


def _report_args():
    rng = np.random.default_rng(26)
    return dict(
        gamma_q=_gamma((2, 2, 5, 3), 27), gamma_k=_gamma((2, 2, 5, 3), 28), categories=rng.integers(0, 4, size=(2, 5)),
        mask=np.array([[True] * 5, [True] * 4 + [False]]),
    )


def _interpretability_report(gamma_q, gamma_k, categories, **kw):
    return interpret.interpretability_report([dict(gamma_q=gamma_q, gamma_k=gamma_k)], categories, **kw)


def _bound_args(B=2, H=2, N=5, K=3, d=2):
    rng = np.random.default_rng(29)
    return dict(
        x=rng.normal(size=(B, H, N, d)), means=rng.normal(size=(H, K, d)), variances=rng.uniform(0.5, 2.0, size=(H, K, d)),
        weights=special.softmax(rng.normal(size=(H, K)), axis=-1), grad_resp=rng.normal(size=(B, H, N, K)),
        mask=np.array([[True] * N, [True] * (N - 1) + [False]]),
    )


_EXPRESSION = "[MAX 2 9 [MIN 4 7 ] 0 ]"


# train: a tiny run configuration (train itself, and the checkpoints, are covered by tests/test_train.py)
_TCFG = train.quick_config(n_train=8, n_val=4, n_test=4, batch_size=4, max_len=16)


def _evaluate(tokens, targets, mcfg, **params):
    return train.evaluate(params, tokens, targets, mcfg)


def _evaluate_args(config=_TCFG):
    mcfg = train.model_config(config)
    tokens, targets = train.load_data(config)["val"]
    return dict(tokens=tokens, targets=targets, mcfg=mcfg, **model.init_params(mcfg, seed=4))


def _train_result(**changes):
    fields = dict(
        config=_TCFG, step=_TCFG.steps, finished=True, params={}, val_loss=2.1, val_accuracy=0.25, test_loss=2.2,
        test_accuracy=0.2, majority_rate=0.25, entropy_rate=float("nan"), seconds_per_step=0.01, peak_step_bytes=2**20,
        max_rss_bytes=2**27, report=None, bounds=None, out=train.Path("run"),
    )
    return train.TrainResult(**{**fields, **changes})


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
    ("attention.feature_attention", attention.feature_attention, _features),
    ("attention.feature_attention(causal)", attention.feature_attention, _with(_features, causal=True, chunk_size=4)),
    ("attention.feature_attention_forward", attention.feature_attention_forward, _with(_features, causal=True, chunk_size=4, eps=0.0)),
    ("attention.feature_attention_backward", _feature_attention_backward, lambda: dict(_features(), grad_out=_grad((6, 3)))),
    ("attention.feature_attention_backward(causal)", _feature_attention_backward, lambda: dict(_features(), grad_out=_grad((6, 3)), causal=True)),
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
    ("gma.gma_step", gma.gma_step, _gma_args),
    ("gma.gma_step(state)", gma.gma_step, lambda: dict(_gma_args(), state=gma.GMAState(np.ones((3, 3)), np.ones(3), 2))),
    ("gma.GMAState", gma.GMAState, lambda: dict(slots=np.ones((3, 2)), norms=np.array([0.5, 0.0, 2.0]), tokens_seen=4)),
    ("gma.GMAState.empty", gma.GMAState.empty, lambda: dict(K=3, d_v=2, dtype=np.float32)),
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
    # model
    ("model.check_config", model.check_config, lambda: dict(config=_MCFG)),
    ("model.param_shapes", model.param_shapes, lambda: dict(config=_LMCFG._replace(mixer="softmax", n_layers=2))),
    ("model.init_params", model.init_params, lambda: dict(config=_MCFG, seed=5)),
    ("model.pack", model.pack, lambda: dict(tokens=_model_args()["tokens"], targets=_model_args()["targets"], pad_id=0)),
    ("model.model_forward", _model_forward, lambda: _model_args(targets=False)),
    ("model.model_forward(lm, softmax)", _model_forward, lambda: _model_args(_LMCFG._replace(mixer="softmax"), targets=False)),
    ("model.model_forward(linear)", _model_forward, lambda: _model_args(_MCFG._replace(mixer="linear"), targets=False)),
    ("model.model_forward(ovq)", _model_forward, lambda: _model_args(_MCFG._replace(mixer="ovq", ovq_max_size=3, ovq_chunk_size=2), targets=False)),
    ("model.model_backward", _model_backward, lambda: dict(_model_args(targets=False), dlogits=_grad((2, 10)))),
    ("model.model_backward(lm)", _model_backward, lambda: dict(_model_args(_LMCFG, targets=False), dlogits=_grad((2, 5, 7)))),
    ("model.cross_entropy_forward", model.cross_entropy_forward, _logits_args),
    ("model.cross_entropy_forward(no mask)", model.cross_entropy_forward, lambda: _drop(_logits_args(), "mask")),
    ("model.cross_entropy_backward", _cross_entropy_backward, _logits_args),
    ("model.loss_and_grads", _loss_and_grads, _model_args),
    ("model.loss_and_grads(lm)", _loss_and_grads, lambda: _model_args(_LMCFG)),
    ("model.gma_routing", _gma_routing, lambda: _model_args(targets=False)),
    ("model.gma_routing(targets)", _gma_routing, _model_args),
    # optim
    ("optim.adam_init", _adam_init, lambda: _named("params", _opt_arrays(22))),
    ("optim.adam_step", _adam_step, _adam_args),
    ("optim.adam_step(first step, no clipping)", _adam_step, lambda: dict(_adam_args(step=0), clip_norm=None, weight_decay=0.0, beta1=0.0)),
    ("optim.decays", optim.decays, lambda: dict(name="layer0.mlp.W1")),
    ("optim.global_norm", _global_norm, lambda: _named("grads", _opt_arrays(23))),
    # tasks
    ("tasks.listops_splits", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, max_len=16, max_depth=2, seed=1)),
    ("tasks.listops_value", tasks.listops_value, lambda: dict(expression_tokens=tasks.listops_encode(_EXPRESSION, max_len=14))),
    ("tasks.listops_text", tasks.listops_text, lambda: dict(tokens=tasks.listops_encode(_EXPRESSION, max_len=14))),
    ("tasks.listops_encode", tasks.listops_encode, lambda: dict(text=_EXPRESSION, max_len=14)),
    ("tasks.listops_depth", tasks.listops_depth, lambda: dict(expression_tokens=tasks.listops_encode(_EXPRESSION))),
    ("tasks.token_categories", tasks.token_categories, lambda: dict(tokens=np.stack([tasks.listops_encode(_EXPRESSION, max_len=14)] * 2))),
    ("tasks.class_balance", tasks.class_balance, lambda: dict(labels=np.array([0, 3, 3, 9]), n_classes=10)),
    ("tasks.majority_rate", tasks.majority_rate, lambda: dict(labels=np.array([1, 3, 3, 2]), n_classes=4)),
    ("tasks.markov_chain", tasks.markov_chain, lambda: dict(vocab=5, n_successors=2, seed=1)),
    ("tasks.markov_entropy_rate", tasks.markov_entropy_rate, lambda: dict(vocab=5, n_successors=2, seed=1)),
    ("tasks.markov_splits", tasks.markov_splits, lambda: dict(n_train=3, n_val=2, n_test=2, length=5, vocab=5, n_successors=2, seed=1)),
    # interpret
    ("interpret.mean_responsibilities", interpret.mean_responsibilities, lambda: dict(gamma=_gamma((2, 5, 3), 30), mask=_report_args()["mask"])),
    ("interpret.mean_responsibilities(no mask)", interpret.mean_responsibilities, lambda: dict(gamma=_gamma((6, 3), 31))),
    ("interpret.used_components", interpret.used_components, lambda: dict(mean_gamma=np.array([0.05, 0.15, 0.8]), threshold=0.1)),
    ("interpret.usage_table", interpret.usage_table, lambda: dict(mean_gamma=np.array([0.05, 0.15, 0.8]), thresholds=[0.01, 0.1, 0.5, 1.0])),
    ("interpret.usage_entropy", interpret.usage_entropy, lambda: dict(mean_gamma=np.array([0.0, 0.25, 0.75]))),
    ("interpret.normalized_mutual_information", interpret.normalized_mutual_information, lambda: dict(labels_a=np.array([0, 0, 1, 2, 2]), labels_b=np.array([5, 5, 3, 3, 1]))),
    ("interpret.interpretability_report", _interpretability_report, _report_args),
    ("interpret.interpretability_report(no mask)", _interpretability_report, lambda: dict(_drop(_report_args(), "mask"), thresholds=(0.5, 3))),
    ("interpret.format_report", interpret.format_report, lambda: dict(reports=_interpretability_report(**_report_args()))),
    ("interpret.gradient_bound_ratios", interpret.gradient_bound_ratios, _bound_args),
    # train
    ("train.quick_config", train.quick_config, lambda: dict(steps=5, mixer="softmax")),
    ("train.check_train_config", train.check_train_config, lambda: dict(config=_TCFG)),
    ("train.model_config", train.model_config, lambda: dict(config=_TCFG)),
    ("train.model_config(markov)", train.model_config, lambda: dict(config=_TCFG._replace(task="markov"))),
    ("train.load_data", train.load_data, lambda: dict(config=_TCFG)),
    ("train.load_data(markov)", train.load_data, lambda: dict(config=_TCFG._replace(task="markov"))),
    ("train.learning_rate", train.learning_rate, lambda: dict(config=_TCFG, step=3)),
    ("train.data_position", train.data_position, lambda: dict(config=_TCFG, step=3)),
    ("train.evaluate", _evaluate, _evaluate_args),
    ("train.evaluate(markov)", _evaluate, lambda: _evaluate_args(_TCFG._replace(task="markov"))),
    ("train.format_result", train.format_result, lambda: dict(result=_train_result())),
    ("train.format_result(markov, report)", train.format_result, lambda: dict(result=_train_result(
        config=_TCFG._replace(task="markov"), report=_interpretability_report(**_report_args()),
        bounds=[(interpret.gradient_bound_ratios(**_bound_args()),) * 2]))),
    ("train.format_result(stopped)", train.format_result, lambda: dict(result=_train_result(finished=False, step=4))),
]

# Exceptions to the generic rules, each with its reason.
# Elementwise and per-axis primitives take arrays of any number of dimensions.
ANY_NDIM = {
    "gmm.logsumexp", "gmm.logsumexp(keepdims)", "gmm.log_softmax", "gmm.softmax", "gmm.softplus", "gmm.softplus_inverse",
    "gmm.sigmoid", "gmm.variances_from_raw", "gmm.raw_from_variances", "gmm.weights_from_logits", "attention.elu_feature_map",
    # responsibilities (..., K) of any leading shape; with a mask, an extra dimension is a mask mismatch, named "mask"
    "interpret.mean_responsibilities", "interpret.mean_responsibilities(no mask)",
    # logits (..., C) of any leading shape; an extra dimension is a targets mismatch, named "targets"
    "model.cross_entropy_forward", "model.cross_entropy_forward(no mask)",
    # dicts of arrays of any shape: params sets the shapes, a grads or state entry of another shape is refused naming it
    # (SPECIFIC: "adam grads shape", "adam state.m shape")
    "optim.adam_init", "optim.adam_step", "optim.adam_step(first step, no clipping)", "optim.global_norm",
}
# Log-domain inputs: -inf is the log of a zero weight and is accepted; +inf is refused.
LOG_DOMAIN = {"gmm.logsumexp", "gmm.logsumexp(keepdims)", "gmm.log_softmax", "gmm.softmax", "gmm.weights_from_logits"}
# Only these arguments are mutated: the others are the forward's (covered by its own case) or unused fields.
ONLY_ARGS = {
    "attention.softmax_attention_backward": ("grad_out",),
    "attention.softmax_attention_backward(causal)": ("grad_out",),
    "attention.feature_attention_backward": ("grad_out",),
    "attention.feature_attention_backward(causal)": ("grad_out",),
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
    "model.model_backward": ("dlogits",),
    "model.model_backward(lm)": ("dlogits",),
    # the loss is the last step: no upstream gradient; its logits are the forward's
    "model.cross_entropy_backward": (),
    # every entry of params goes through the one check that model.model_forward and model.loss_and_grads mutate in
    # full; the other cases mutate a sample of it
    "model.model_forward(lm, softmax)": ("embed", "head.W"),
    "model.model_forward(linear)": ("pos", "layer0.mixer.W_q"),
    "model.model_forward(ovq)": ("layer0.mixer.W_o", "ln_f.gain"),
    "model.loss_and_grads(lm)": ("embed", "head.b"),
    "model.gma_routing": ("layer0.mixer.means", "layer0.mixer.raw_variances", "layer0.mixer.logits"),
    "model.gma_routing(targets)": ("layer0.mixer.W_k", "layer0.ln1.bias"),
    "train.evaluate": ("embed", "layer0.mlp.W1"),
    "train.evaluate(markov)": ("head.W",),
}
# Results with no floating array to check for its dtype: Python floats, and indices.
NO_FLOAT_ARRAY_RESULT = {
    "gmm.isotropic_nll", "theory.bound_radius", "theory.lipschitz_bounds", "theory.empirical_lipschitz", "gmm.hard_assignments",
    "optim.global_norm", "interpret.used_components", "interpret.usage_table", "interpret.usage_entropy", "train.evaluate",
    "train.evaluate(markov)",
}
# Results that jump under rounding, compared for dtype only in float32: Monte Carlo draws against a cdf,
# and argmax / nearest-centroid decisions.
DISCONTINUOUS = {"theory.affinity_by_sampling", "gmm.kmeans_step"}
# Known to return float64 arrays for float32 input, marked as expected failures (strict: the mark must go once fixed).
FLOAT64_RESULT = {}

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
        "attention.softmax_attention_backward", "attention.feature_attention_backward", "attention.linear_attention_backward",
        "gma.gma_backward", "layers.multihead_gma_backward", "ovq.ovq_attention_backward", "gmr.joint_gmm_predict",
        "model.model_forward", "model.model_backward", "model.cross_entropy_backward", "model.loss_and_grads",
        "model.gma_routing", "optim.adam_init", "optim.adam_step", "optim.global_norm", "interpret.interpretability_report",
        "train.evaluate",
    }
    elsewhere = {  # a case here would take seconds or needs files: covered by tests/test_train.py instead
        "train.train",  # a whole run (log, checkpoints, result.json): the end-to-end and resume tests
        "train.save_checkpoint", "train.load_checkpoint",  # files: the checkpoint round-trip and corrupt-file tests
    }
    # the batch rules of gma and linear attention, and the checkers the GPU backends share: reached through gma, gma_forward and gma_backward
    building_blocks = {"gma.forward_with", "gma.backward_with", "attention.linear_forward_with", "attention.linear_backward_with"}
    public = set()
    for module in (attention, gma, gmm, gmr, layers, ovq, ovq_oracle, scan, theory, model, optim, tasks, interpret, train):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not isinstance(obj, type) and not (obj.__doc__ or "").startswith("Core") and not name.startswith("check_"):
                public.add(f"{module.__name__.split('.')[-1]}.{name}")
    public |= {"ovq.OVQState", "ovq.OVQState.empty", "gma.GMAState", "gma.GMAState.empty"}
    public -= building_blocks
    assert not public - covered - wrapped - elsewhere, sorted(public - covered - wrapped - elsewhere)
    assert wrapped <= covered
    assert elsewhere <= public and not elsewhere & covered


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
    return attention.feature_attention_forward(**_features())[1]


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
    ("negative features", attention.feature_attention, _with(_features, phi_q=-_features()["phi_q"]), ValueError, "phi_q: expected nonnegative features"),
    ("features F mismatch", attention.feature_attention, _with(_features, phi_k=np.ones((6, 5))), ValueError, "phi_k: expected shape (N_k, F) = (*, 4)"),
    ("feature eps < 0", attention.feature_attention, _with(_features, eps=-1e-6), ValueError, "eps: expected a finite number >= 0"),
    ("feature chunk_size 0", attention.feature_attention, _with(_features, causal=True, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("feature chunk_size float", attention.feature_attention, _with(_features, causal=True, chunk_size=2.0), TypeError, "chunk_size: expected an integer"),
    ("feature causal lengths", attention.feature_attention, _with(_features, phi_q=np.ones((4, 4)), causal=True), ValueError, "causal=True needs as many queries as keys"),
    ("feature eps = 0 with no overlap", attention.feature_attention, lambda: dict(phi_q=np.array([[1.0, 0.0]]), phi_k=np.array([[0.0, 1.0]]), v=np.ones((1, 1)), eps=0.0), ValueError, "eps: with eps = 0 the denominator of query row 0"),
    ("feature eps = 0 causal", attention.feature_attention, lambda: dict(phi_q=np.array([[1.0, 0.0], [0.0, 1.0]]), phi_k=np.array([[1.0, 0.0], [1.0, 0.0]]), v=np.ones((2, 1)), eps=0.0, causal=True, chunk_size=1), ValueError, "eps: with eps = 0 the denominator of query row 1"),
    ("feature grad_out shape", _feature_attention_backward, lambda: dict(_features(), grad_out=np.ones((5, 3))), ValueError, "grad_out: expected shape (N_q, d_v) = (6, 3), got (5, 3)"),
    ("feature cache type", attention.feature_attention_backward, lambda: dict(grad_out=np.ones((6, 3)), cache=None), TypeError, "cache: expected the FeatureAttentionCache"),
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
    ("state size > n_max", ovq.OVQState, lambda: {**_state_fields(), "size": 5}, ValueError, "size: expected at most n_max = 4"),
    ("state negative count", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array([-1, 5, 3, 2])}, ValueError, "counts: expected nonnegative"),
    ("state counts sum", ovq.OVQState, lambda: {**_state_fields(), "tokens_seen": 10}, ValueError, "counts: expected sum(counts) == tokens_seen = 10"),
    ("state counts float", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array(_state_fields()["counts"], dtype=float)}, TypeError, "counts: expected integers"),
    ("state counts shape", ovq.OVQState, lambda: {**_state_fields(), "counts": np.array([9, 0, 0])}, ValueError, "counts: expected shape (n_max,) = (4,)"),
    ("state values rows", ovq.OVQState, lambda: {**_state_fields(), "values": np.ones((3, 2))}, ValueError, "values: expected shape (n_max, d_v) = (4, *)"),
    ("state dtypes differ", ovq.OVQState, lambda: {**_state_fields(), "values": _state_fields()["values"].astype(np.float32)}, TypeError, "values: expected the dtype of keys"),
    ("state active count 0", ovq.OVQState, lambda: dict(keys=np.ones((3, 2)), values=np.ones((3, 1)), counts=np.array([2, 0, 0]), size=2, tokens_seen=2), ValueError, "every active row"),
    ("state unused count", ovq.OVQState, lambda: dict(keys=np.ones((3, 2)), values=np.ones((3, 1)), counts=np.array([1, 0, 1]), size=1, tokens_seen=2), ValueError, "rows >= size"),
    ("state size float", ovq.OVQState, lambda: {**_state_fields(), "size": 3.0}, TypeError, "size: expected an integer"),
    ("state no rows", ovq.OVQState, lambda: dict(keys=np.ones((0, 2)), values=np.ones((0, 1)), counts=np.zeros(0, int), size=0, tokens_seen=0), ValueError, "keys: expected shape (n_max, d) with n_max >= 1"),
    ("empty max_size", ovq.OVQState.empty, lambda: dict(max_size=0, d=2, d_v=2), ValueError, "max_size: expected an integer >= 1"),
    ("empty dtype int", ovq.OVQState.empty, lambda: dict(max_size=2, d=2, d_v=2, dtype=np.int32), TypeError, "dtype: expected float32 or float64"),
    ("empty dtype unknown", ovq.OVQState.empty, lambda: dict(max_size=2, d=2, d_v=2, dtype="f99"), TypeError, "dtype: expected float32 or float64"),
    ("ovq k rows", ovq.ovq_attention, _with(_ovq_args, k=np.ones((10, 3))), ValueError, "k: expected shape (N, d) = (11, 3)"),
    ("ovq v rows", ovq.ovq_attention, _with(_ovq_args, v=np.ones((12, 2))), ValueError, "v: expected shape (N, d_v) = (11, *)"),
    ("ovq d_v 0", ovq.ovq_attention, _with(_ovq_args, v=np.ones((11, 0))), ValueError, "d_v >= 1"),
    ("ovq N 0", ovq.ovq_attention, _with(_ovq_args, q=np.ones((0, 3)), k=np.ones((0, 3)), v=np.ones((0, 2))), ValueError, "N >= 1"),
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
    ("ovq state n_max", ovq.ovq_attention, _with(_ovq_args, state=_state(5, 3, 2)), ValueError, "state: has n_max = 5 rows but max_size = 4"),
    ("ovq state d", ovq.ovq_attention_forward, _with(_ovq_args, state=_state(4, 2, 2)), ValueError, "state: holds keys of dimension d = 2, but q and k have d = 3"),
    ("ovq state d_v", ovq.ovq_attention, _with(_ovq_args, state=_state(4, 3, 3)), ValueError, "state: holds values of dimension d_v = 3, but v has d_v = 2"),
    (
        "ovq state too small for its growth",
        ovq.ovq_attention,
        _with(_ovq_args, max_size=10, state=ovq.OVQState(np.ones((10, 3)), np.ones((10, 2)), np.array([40] + [0] * 9), 1, 40)),
        ValueError,
        "state: size = 1 after tokens_seen = 40 is too small for growth='plateau'",
    ),
    ("ovq grad_out shape", _ovq_attention_backward, lambda: dict(_ovq_args(), grad_out=np.ones((11, 3))), ValueError, "grad_out: expected shape (N, d_v) = (11, 2)"),
    ("ovq cache type", ovq.ovq_attention_backward, lambda: dict(grad_out=np.ones((11, 2)), cache=_feature_cache()), TypeError, "cache: expected the OVQCache"),
    ("vq codebook d", ovq.vq_attention, _with(_codebook_args, codebook=np.ones((4, 2))), ValueError, "codebook: expected shape (S, d) = (*, 3)"),
    ("vq codebook empty", ovq.vq_attention, _with(_codebook_args, codebook=np.ones((0, 3))), ValueError, "codebook: expected at least one code"),
    ("vq chunk_size 0", ovq.vq_attention, _with(_codebook_args, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("vq beta < 0", ovq.vq_attention, _with(_codebook_args, beta=-2.0), ValueError, "beta: expected a finite number > 0"),
    ("vq k rows", ovq.vq_attention, _with(_codebook_args, k=np.ones((3, 3))), ValueError, "k: expected shape (N, d) = (11, 3)"),
    ("loop growth", ovq_oracle.ovq_attention_loop, _with(_ovq_args, growth="exponential"), ValueError, "growth: expected one of"),
    ("loop chunk_size 0", ovq_oracle.ovq_attention_loop, _with(_ovq_args, chunk_size=0), ValueError, "chunk_size: expected an integer >= 1"),
    ("loop integer q", ovq_oracle.ovq_attention_loop, _with(_ovq_args, q=np.ones((11, 3), dtype=int)), TypeError, "q: expected a real floating-point array"),
    ("vq loop codebook d", ovq_oracle.vq_attention_loop, _with(_codebook_args, codebook=np.ones((4, 2))), ValueError, "codebook: expected shape (S, d)"),
    # model
    ("config type", model.check_config, lambda: dict(config=dict(vocab_size=7, max_len=6)), TypeError, "config: expected a ModelConfig"),
    ("config vocab_size 1", model.param_shapes, lambda: dict(config=_MCFG._replace(vocab_size=1)), ValueError, "config.vocab_size: expected an integer >= 2"),
    ("config d_model float", model.init_params, lambda: dict(config=_MCFG._replace(d_model=8.0)), TypeError, "config.d_model: expected an integer"),
    ("config d_model % n_heads", model.check_config, lambda: dict(config=_MCFG._replace(d_model=9)), ValueError, "config.d_model: expected a multiple of n_heads = 2"),
    ("config mixer", model.check_config, lambda: dict(config=_MCFG._replace(mixer="rnn")), ValueError, "config.mixer: expected one of 'gma', 'softmax', 'linear', 'ovq'"),
    ("config head", model.check_config, lambda: dict(config=_MCFG._replace(head="seq")), ValueError, "config.head: expected one of 'classify', 'lm'"),
    ("config lm not causal", model.check_config, lambda: dict(config=_MCFG._replace(head="lm")), ValueError, "config.causal: the lm head predicts the next token and needs causal=True"),
    ("config pad_id", model.check_config, lambda: dict(config=_MCFG._replace(pad_id=7)), ValueError, "config.pad_id: expected a token id < vocab_size = 7"),
    ("config causal string", model.check_config, lambda: dict(config=_MCFG._replace(causal="yes")), TypeError, "config.causal: expected True or False"),
    ("init seed < 0", model.init_params, lambda: dict(config=_MCFG, seed=-1), ValueError, "seed: expected an integer >= 0"),
    ("tokens float", _model_forward, lambda: {**_model_args(targets=False), "tokens": np.ones((2, 5))}, TypeError, "tokens: expected an integer array"),
    ("tokens 1-D", _model_forward, lambda: {**_model_args(targets=False), "tokens": np.ones(5, int)}, ValueError, "tokens: expected a 2-D array"),
    ("tokens longer than max_len", _model_forward, lambda: {**_model_args(targets=False), "tokens": np.ones((2, 7), int)}, ValueError, "tokens: sequences of N = 7 tokens exceed config.max_len = 6"),
    ("tokens id", _loss_and_grads, lambda: {**_model_args(), "tokens": np.full((2, 5), 7)}, ValueError, "tokens: expected ids in [0, vocab_size = 7)"),
    ("tokens empty", _model_forward, lambda: {**_model_args(targets=False), "tokens": np.ones((0, 5), int)}, ValueError, "tokens: expected shape (B, N) with B >= 1 and N >= 1"),
    ("params missing", _model_forward, lambda: _drop(_model_args(targets=False), "pos"), ValueError, "params: do not match the config (mixer='gma', head='classify', n_layers=1): missing ['pos']"),
    ("params of another mixer", _model_forward, lambda: dict(_model_args(targets=False), config=_MCFG._replace(mixer="softmax")), ValueError, "unexpected ['layer0.mixer.means'"),
    ("params shape", _loss_and_grads, lambda: {**_model_args(), "embed": np.ones((6, 8))}, ValueError, "params['embed']: expected shape (7, 8), got (6, 8)"),
    ("params not a dict", model.model_forward, lambda: dict(params=[1], tokens=np.ones((2, 5), int), config=_MCFG), TypeError, "params: expected a dict name -> array"),
    ("dlogits shape", _model_backward, lambda: dict(_model_args(targets=False), dlogits=np.ones((2, 7))), ValueError, "dlogits: expected shape (B, n_classes) = (2, 10), got (2, 7)"),
    ("dlogits lm shape", _model_backward, lambda: dict(_model_args(_LMCFG, targets=False), dlogits=np.ones((2, 5, 10))), ValueError, "dlogits: expected shape (B, N, vocab_size) = (2, 5, 7)"),
    ("model cache type", model.model_backward, lambda: dict(dlogits=np.ones((2, 10)), cache=None), TypeError, "cache: expected the ModelCache"),
    ("targets float", _loss_and_grads, lambda: {**_model_args(), "targets": np.ones(2)}, TypeError, "targets: expected an integer array"),
    ("targets class 10", _loss_and_grads, lambda: {**_model_args(), "targets": np.array([0, 10])}, ValueError, "targets: expected class ids in [0, C = 10) where counted, got 10"),
    ("targets shape", _loss_and_grads, lambda: {**_model_args(), "targets": np.array([0, 1, 2])}, ValueError, "targets: expected shape (2,), got (3,)"),
    ("lm targets shape", _loss_and_grads, lambda: {**_model_args(_LMCFG), "targets": np.zeros(2, int)}, ValueError, "targets: expected shape (2, 5)"),
    ("routing needs gma", _gma_routing, lambda: _model_args(_MCFG._replace(mixer="softmax"), targets=False), ValueError, "config.mixer: gma_routing needs mixer='gma', got 'softmax'"),
    ("routing targets", _gma_routing, lambda: {**_model_args(), "targets": np.array([0, 11])}, ValueError, "targets: expected class ids in [0, C = 10)"),
    ("ce mask int", model.cross_entropy_forward, lambda: {**_logits_args(), "mask": np.ones((3, 4), int)}, TypeError, "mask: expected a boolean array"),
    ("ce mask shape", model.cross_entropy_forward, lambda: {**_logits_args(), "mask": np.ones((2, 4), bool)}, ValueError, "mask: expected shape (3, 4), got (2, 4)"),
    ("ce targets class", model.cross_entropy_forward, lambda: {**_logits_args(), "targets": np.full((3, 4), 5)}, ValueError, "targets: expected class ids in [0, C = 5) where counted, got 5"),
    ("ce logits 0-D", model.cross_entropy_forward, lambda: dict(logits=np.float64(1.0), targets=np.array(0)), ValueError, "logits: expected shape (..., C) with C >= 1"),
    ("ce cache type", model.cross_entropy_backward, lambda: dict(cache=(1, 2)), TypeError, "cache: expected the CrossEntropyCache"),
    # optim
    ("adam lr 0", _adam_step, _with(_adam_args, lr=0.0), ValueError, "lr: expected a finite number > 0, got 0.0"),
    ("adam lr < 0", _adam_step, _with(_adam_args, lr=-1e-3), ValueError, "lr: expected a finite number > 0"),
    ("adam lr string", _adam_step, _with(_adam_args, lr="0.1"), TypeError, "lr: expected a real number"),
    ("adam beta1 1", _adam_step, _with(_adam_args, beta1=1.0), ValueError, "beta1: expected a number in [0, 1), got 1.0"),
    ("adam beta2 > 1", _adam_step, _with(_adam_args, beta2=1.5), ValueError, "beta2: expected a number in [0, 1), got 1.5"),
    ("adam beta2 < 0", _adam_step, _with(_adam_args, beta2=-0.1), ValueError, "beta2: expected a finite number >= 0"),
    ("adam eps 0", _adam_step, _with(_adam_args, eps=0.0), ValueError, "eps: expected a finite number > 0"),
    ("adam weight_decay < 0", _adam_step, _with(_adam_args, weight_decay=-0.1), ValueError, "weight_decay: expected a finite number >= 0"),
    ("adam clip_norm 0", _adam_step, _with(_adam_args, clip_norm=0.0), ValueError, "clip_norm: expected a finite number > 0"),
    ("adam step < 0", _adam_step, _with(_adam_args, step=-1), ValueError, "state.step: expected an integer >= 0"),
    ("adam step float", _adam_step, _with(_adam_args, step=1.0), TypeError, "state.step: expected an integer"),
    ("adam state.v negative", _adam_step, lambda: {**_adam_args(), "state.v['layer0.b']": -np.ones(2)}, ValueError, "state.v: expected nonnegative second moments, got a negative entry in 'layer0.b'"),
    ("adam grads shape", _adam_step, lambda: {**_adam_args(), "grads['layer0.W']": np.ones((2, 3))}, ValueError, "grads['layer0.W']: expected shape (3, 2), got (2, 3)"),
    ("adam state.m shape", _adam_step, lambda: {**_adam_args(), "state.m['layer0.b']": np.ones(3)}, ValueError, "state.m['layer0.b']: expected shape (2,), got (3,)"),
    ("adam grads keys", optim.adam_step, lambda: dict(params={"a": np.ones(2)}, grads={"b": np.ones(2)}, state=optim.adam_init({"a": np.ones(2)}), lr=0.1), ValueError, "grads: expected the keys of params, in order; missing ['a'], unexpected ['b']"),
    ("adam grads order", optim.adam_step, lambda: dict(params={"a": np.ones(2), "b": np.ones(1)}, grads={"b": np.ones(1), "a": np.ones(2)}, state=optim.adam_init({"a": np.ones(2), "b": np.ones(1)}), lr=0.1), ValueError, "grads: expected the keys of params, in order; got them in the order ['b', 'a']"),
    ("adam state type", optim.adam_step, lambda: dict(params={"a": np.ones(2)}, grads={"a": np.ones(2)}, state=(0, {}, {}), lr=0.1), TypeError, "state: expected an AdamState"),
    ("adam_init not a dict", optim.adam_init, lambda: dict(params=[np.ones(2)]), TypeError, "params: expected a dict name -> array"),
    ("decays not a str", optim.decays, lambda: dict(name=3), TypeError, "name: expected a str"),
    ("global_norm not a dict", optim.global_norm, lambda: dict(grads=[np.ones(2)]), TypeError, "grads: expected a dict name -> array"),
    # tasks
    ("listops n_train 0", tasks.listops_splits, lambda: dict(n_train=0, n_val=2, n_test=2), ValueError, "n_train: expected an integer >= 1, got 0"),
    ("listops n_val float", tasks.listops_splits, lambda: dict(n_train=3, n_val=2.0, n_test=2), TypeError, "n_val: expected an integer"),
    ("listops max_len 3", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, max_len=3), ValueError, "max_len: expected an integer >= 4"),
    ("listops max_depth 0", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, max_depth=0), ValueError, "max_depth: expected an integer >= 1"),
    ("listops max_args 1", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, max_args=1), ValueError, "max_args: expected an integer >= 2"),
    ("listops p_nest 0", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, p_nest=0.0), ValueError, "p_nest: expected a finite number > 0"),
    ("listops p_nest > 1", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, p_nest=1.5), ValueError, "p_nest: expected a probability in (0, 1]"),
    ("listops seed < 0", tasks.listops_splits, lambda: dict(n_train=3, n_val=2, n_test=2, seed=-1), ValueError, "seed: expected an integer >= 0"),
    ("listops too few expressions", tasks.listops_splits, lambda: dict(n_train=500, n_val=2, n_test=2, max_len=4, max_depth=1), ValueError, "n_train + n_val + n_test: asked for 504 distinct expressions"),
    ("value not closed", tasks.listops_value, lambda: dict(expression_tokens=tasks.listops_encode("[MAX 2 9")), ValueError, "expression_tokens: 1 expression(s) not closed"),
    ("value padding inside", tasks.listops_value, lambda: dict(expression_tokens=np.array([12, 2, 0, 9, 15])), ValueError, "expression_tokens: expected one expression followed only by padding"),
    ("value digit alone", tasks.listops_value, lambda: dict(expression_tokens=np.array([3])), ValueError, "expression_tokens: digit at position 0 outside an expression"),
    ("value float", tasks.listops_value, lambda: dict(expression_tokens=np.array([12.0, 2.0, 15.0])), TypeError, "expression_tokens: expected integer token ids"),
    ("value 2-D", tasks.listops_value, lambda: dict(expression_tokens=np.ones((1, 3), int)), ValueError, "expression_tokens: expected a 1-D array"),
    ("text id", tasks.listops_text, lambda: dict(tokens=np.array([-1])), ValueError, "tokens: expected token ids in 0..15, got -1"),
    ("encode unknown", tasks.listops_encode, lambda: dict(text="[MAX 2 X ]"), ValueError, "text: unknown token 'X'"),
    ("encode pad", tasks.listops_encode, lambda: dict(text="[MAX 2 <pad> ]"), ValueError, "text: unknown token '<pad>'"),
    ("encode too long", tasks.listops_encode, lambda: dict(text=_EXPRESSION, max_len=5), ValueError, "text: 9 tokens, more than max_len = 5"),
    ("encode bytes", tasks.listops_encode, lambda: dict(text=b"[MAX 2 ]"), TypeError, "text: expected a string"),
    ("encode max_len 0", tasks.listops_encode, lambda: dict(text=_EXPRESSION, max_len=0), ValueError, "max_len: expected an integer >= 1"),
    ("depth float", tasks.listops_depth, lambda: dict(expression_tokens=np.array([12.0, 15.0])), TypeError, "expression_tokens: expected integer token ids"),
    ("categories id", tasks.token_categories, lambda: dict(tokens=np.array([[30]])), ValueError, "tokens: expected token ids in 0..15, got 30"),
    ("labels out of range", tasks.class_balance, lambda: dict(labels=np.array([0, 10])), ValueError, "labels: expected classes in 0..9"),
    ("labels negative", tasks.majority_rate, lambda: dict(labels=np.array([-1, 0])), ValueError, "labels: expected classes in 0..9"),
    ("labels float", tasks.class_balance, lambda: dict(labels=np.array([0.0, 1.0])), ValueError, "labels: expected a non-empty 1-D array of integer class labels"),
    ("labels 2-D", tasks.majority_rate, lambda: dict(labels=np.array([[0, 1]])), ValueError, "labels: expected a non-empty 1-D array"),
    ("labels empty", tasks.class_balance, lambda: dict(labels=np.array([], int)), ValueError, "labels: expected a non-empty 1-D array"),
    ("n_classes 0", tasks.class_balance, lambda: dict(labels=np.array([0]), n_classes=0), ValueError, "n_classes: expected an integer >= 1"),
    ("markov vocab 2", tasks.markov_chain, lambda: dict(vocab=2), ValueError, "vocab: expected an integer >= 3"),
    ("markov n_successors >= vocab", tasks.markov_chain, lambda: dict(vocab=5, n_successors=5), ValueError, "n_successors: expected at most vocab - 1 = 4"),
    ("markov n_successors 0", tasks.markov_entropy_rate, lambda: dict(vocab=5, n_successors=0), ValueError, "n_successors: expected an integer >= 1"),
    ("markov seed float", tasks.markov_chain, lambda: dict(vocab=5, seed=1.5), TypeError, "seed: expected an integer"),
    ("markov seed generator", tasks.markov_splits, lambda: dict(n_train=3, n_val=2, n_test=2, seed=np.random.default_rng(0)), TypeError, "seed: expected an integer"),
    ("markov length 0", tasks.markov_splits, lambda: dict(n_train=3, n_val=2, n_test=2, length=0), ValueError, "length: expected an integer >= 1"),
    ("markov n_test 0", tasks.markov_splits, lambda: dict(n_train=3, n_val=2, n_test=0), ValueError, "n_test: expected an integer >= 1"),
    # interpret
    ("threshold 0", interpret.used_components, lambda: dict(mean_gamma=np.array([0.5, 0.5]), threshold=0.0), ValueError, "threshold: expected a threshold in (0, 1], got 0.0"),
    ("threshold > 1", interpret.used_components, lambda: dict(mean_gamma=np.array([0.5, 0.5]), threshold=1.5), ValueError, "threshold: expected a threshold in (0, 1], got 1.5"),
    ("threshold string", interpret.used_components, lambda: dict(mean_gamma=np.array([0.5, 0.5]), threshold="0.1"), TypeError, "threshold: expected a real number in (0, 1]"),
    ("threshold bool", interpret.used_components, lambda: dict(mean_gamma=np.array([0.5, 0.5]), threshold=True), TypeError, "threshold: expected a real number in (0, 1]"),
    ("thresholds empty", interpret.usage_table, lambda: dict(mean_gamma=np.array([0.5, 0.5]), thresholds=[]), TypeError, "thresholds: expected a non-empty sequence of numbers"),
    ("thresholds string", interpret.usage_table, lambda: dict(mean_gamma=np.array([0.5, 0.5]), thresholds="0.1"), TypeError, "thresholds: expected a non-empty sequence of numbers"),
    ("thresholds[1] 0", interpret.usage_table, lambda: dict(mean_gamma=np.array([0.5, 0.5]), thresholds=[0.1, 0.0]), ValueError, "thresholds[1]: expected a threshold in (0, 1], got 0.0"),
    ("mean_gamma sum", interpret.used_components, lambda: dict(mean_gamma=np.array([0.5, 0.6]), threshold=0.1), ValueError, "mean_gamma: expected weights that sum to 1"),
    ("mean_gamma negative", interpret.usage_entropy, lambda: dict(mean_gamma=np.array([-0.5, 1.5])), ValueError, "mean_gamma: expected nonnegative weights"),
    ("mean_gamma empty", interpret.usage_entropy, lambda: dict(mean_gamma=np.zeros(0)), ValueError, "mean_gamma: expected at least one component (K >= 1)"),
    ("gamma rows sum", interpret.mean_responsibilities, lambda: dict(gamma=np.full((2, 3), 0.5)), ValueError, "gamma: expected rows that sum to 1"),
    ("gamma negative", interpret.mean_responsibilities, lambda: dict(gamma=np.array([[1.5, -0.5]])), ValueError, "gamma: expected nonnegative responsibilities"),
    ("gamma K 0", interpret.mean_responsibilities, lambda: dict(gamma=np.ones((2, 0))), ValueError, "gamma: expected responsibilities of shape (..., K) with K >= 1"),
    ("mask all False", interpret.mean_responsibilities, lambda: dict(gamma=_gamma((2, 3), 1), mask=np.zeros(2, bool)), ValueError, "mask: expected at least one True entry"),
    ("mask int", interpret.mean_responsibilities, lambda: dict(gamma=_gamma((2, 3), 1), mask=np.ones(2, int)), TypeError, "mask: expected a boolean array"),
    ("mask shape", interpret.mean_responsibilities, lambda: dict(gamma=_gamma((2, 3), 1), mask=np.ones(3, bool)), ValueError, "mask: expected shape (2,), got (3,)"),
    ("nmi lengths", interpret.normalized_mutual_information, lambda: dict(labels_a=np.array([0, 1, 1]), labels_b=np.array([0, 1])), ValueError, "labels_b: expected the shape of labels_a (3,), got (2,)"),
    ("nmi float labels", interpret.normalized_mutual_information, lambda: dict(labels_a=np.array([0.0, 1.0]), labels_b=np.array([0, 1])), TypeError, "labels_a: expected an integer array of labels"),
    ("nmi empty", interpret.normalized_mutual_information, lambda: dict(labels_a=np.array([], int), labels_b=np.array([], int)), ValueError, "labels_a: expected at least one label"),
    ("report routing dict", interpret.interpretability_report, lambda: dict(routing=_drop(_report_args(), "categories", "mask"), categories=_report_args()["categories"]), TypeError, "routing: expected a non-empty list of per-layer dicts"),
    ("report routing empty", interpret.interpretability_report, lambda: dict(routing=[], categories=_report_args()["categories"]), TypeError, "routing: expected a non-empty list"),
    ("report missing gamma_k", interpret.interpretability_report, lambda: dict(routing=[_drop(_report_args(), "gamma_k", "categories", "mask")], categories=_report_args()["categories"]), ValueError, "routing[0]: expected the key 'gamma_k'"),
    ("report gamma_k K", _interpretability_report, _with(_report_args, gamma_k=_gamma((2, 2, 5, 4), 1)), ValueError, "routing[0]['gamma_k']: expected shape (B, H, N, K) = (2, 2, 5, 3), got (2, 2, 5, 4)"),
    ("report gamma rows sum", _interpretability_report, _with(_report_args, gamma_q=np.full((2, 2, 5, 3), 0.5)), ValueError, "routing[0]['gamma_q']: expected rows that sum to 1"),
    ("report categories float", _interpretability_report, lambda: {**_report_args(), "categories": np.zeros((2, 5))}, TypeError, "categories: expected an integer array"),
    ("report categories N", _interpretability_report, lambda: {**_report_args(), "categories": np.zeros((2, 4), int)}, ValueError, "routing[0]['gamma_q']: expected shape (B, H, N, K) = (2, *, 4, *)"),
    ("report thresholds 0", _interpretability_report, _with(_report_args, thresholds=(0.0,)), ValueError, "thresholds[0]: expected a multiple c of the uniform usage 1/K with 0 < c <= K = 3"),
    ("report thresholds > K", _interpretability_report, _with(_report_args, thresholds=(1, 4)), ValueError, "thresholds[1]: expected a multiple c of the uniform usage 1/K with 0 < c <= K = 3"),
    ("report thresholds string", _interpretability_report, _with(_report_args, thresholds="1"), TypeError, "thresholds: expected a non-empty sequence of multiples of 1/K"),
    ("report mask all False", _interpretability_report, _with(_report_args, mask=np.zeros((2, 5), bool)), ValueError, "mask: expected at least one True entry"),
    ("format_report not reports", interpret.format_report, lambda: dict(reports=[1]), TypeError, "reports: expected a list of HeadReport"),
    ("bounds variances 0", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "variances": np.zeros((2, 3, 2))}, ValueError, "variances: expected strictly positive"),
    ("bounds weights rows sum", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "weights": np.full((2, 3), 0.5)}, ValueError, "weights[0]: expected weights that sum to 1"),
    ("bounds means H", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "means": np.ones((1, 3, 2))}, ValueError, "means: expected shape (H, K, d_r) = (2, *, 2), got (1, 3, 2)"),
    ("bounds grad_resp K", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "grad_resp": np.ones((2, 2, 5, 2))}, ValueError, "grad_resp: expected shape (B, H, N, K) = (2, 2, 5, 3)"),
    ("bounds mask shape", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "mask": np.ones((2, 4), bool)}, ValueError, "mask: expected shape (B, N) = (2, 5), got (2, 4)"),
    ("bounds no components", interpret.gradient_bound_ratios, lambda: {**_bound_args(), "means": np.ones((2, 0, 2)), "variances": np.ones((2, 0, 2)), "weights": np.ones((2, 0)), "grad_resp": np.ones((2, 2, 5, 0))}, ValueError, "means: expected at least one component (K >= 1)"),
    # train
    ("train config type", train.check_train_config, lambda: dict(config=_TCFG._asdict()), TypeError, "config: expected a TrainConfig, got dict"),
    ("train task", train.check_train_config, lambda: dict(config=_TCFG._replace(task="copy")), ValueError, "task: expected one of 'listops', 'markov'"),
    ("train mixer", train.model_config, lambda: dict(config=_TCFG._replace(mixer="rnn")), ValueError, "mixer: expected one of 'gma', 'softmax', 'linear', 'ovq'"),
    ("train steps 0", train.check_train_config, lambda: dict(config=_TCFG._replace(steps=0)), ValueError, "steps: expected an integer >= 1, got 0"),
    ("train lr 0", train.check_train_config, lambda: dict(config=_TCFG._replace(lr=0.0)), ValueError, "lr: expected a finite number > 0"),
    ("train clip < 0", train.check_train_config, lambda: dict(config=_TCFG._replace(clip=-1.0)), ValueError, "clip: expected a finite number >= 0"),
    ("train trim int", train.check_train_config, lambda: dict(config=_TCFG._replace(trim=1)), TypeError, "trim: expected True or False"),
    ("train d_model % heads", train.check_train_config, lambda: dict(config=_TCFG._replace(d_model=9)), ValueError, "d_model: expected a multiple of heads = 2"),
    ("train batch_size > n_train", train.check_train_config, lambda: dict(config=_TCFG._replace(batch_size=9)), ValueError, "batch_size: expected at most n_train = 8"),
    ("model_config type", train.model_config, lambda: dict(config=_TCFG._asdict()), TypeError, "config: expected a TrainConfig"),
    ("load_data n_train 0", train.load_data, lambda: dict(config=_TCFG._replace(n_train=0)), ValueError, "n_train: expected an integer >= 1, got 0"),
    ("learning_rate step 0", train.learning_rate, lambda: dict(config=_TCFG, step=0), ValueError, "step: expected an integer >= 1, got 0"),
    ("learning_rate step float", train.learning_rate, lambda: dict(config=_TCFG, step=1.5), TypeError, "step: expected an integer"),
    ("learning_rate config", train.learning_rate, lambda: dict(config=None, step=1), TypeError, "config: expected a TrainConfig"),
    ("evaluate mcfg", _evaluate, lambda: {**_evaluate_args(), "mcfg": _TCFG}, TypeError, "mcfg: expected a ModelConfig"),
    ("evaluate no sequences", _evaluate, lambda: {**_evaluate_args(), "tokens": np.zeros((0, 12), int), "targets": np.zeros(0, int)}, ValueError, "tokens: expected at least one sequence"),
    ("evaluate targets", _evaluate, lambda: {**_evaluate_args(), "targets": np.zeros(2, int)}, ValueError, "targets: expected shape (4,), got (2,)"),
    ("format_result type", train.format_result, lambda: dict(result=_TCFG), TypeError, "result: expected a TrainResult"),
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
    if isinstance(obj, gma.GMAState):
        return [obj.slots, obj.norms, obj.tokens_seen]
    if type(obj).__name__ == "ChunkRecords":  # cpu.ovq's packed per-chunk records: their arrays
        return [getattr(obj, f) for f in ("rows", "seeded", "seeds", "counts_mid", "added", "dict_keys", "dict_values")]
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
        elif isinstance(v, (ovq.OVQState, gma.GMAState)):
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
    if isinstance(value, gma.GMAState):
        return gma.GMAState(value.slots.astype(np.float32), value.norms.astype(np.float32), value.tokens_seen)
    return value


def _has_float_input(kwargs):
    return any(
        isinstance(v, (ovq.OVQState, gma.GMAState)) or (isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))
        for v in kwargs.values()
    )


F32_CASES = [
    pytest.param(
        cid, fn, make, id=cid,
        marks=[pytest.mark.xfail(strict=True, reason=FLOAT64_RESULT[cid])] if cid in FLOAT64_RESULT else [],
    )
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


# ---------------------------------------------------------------------------
# Checked once, at the boundary: the checks live in refimpl.validation, the chunk loops call cores
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("module", [gma, ovq, gmm], ids=lambda m: m.__name__)
def test_the_mechanisms_leave_their_checks_to_validation(module):
    """gma, ovq and gmm raise nothing themselves and define no ``_check_*`` helper: every check is a call into validation."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    raises = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Raise, ast.Assert))]
    helpers = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("_check")]
    assert not raises and not helpers, (raises, helpers)


def test_the_ovq_and_vq_chunk_loops_do_not_check_again(monkeypatch):
    """The running means of every chunk go through gmm's core: check_running_mean is never called inside the loops."""
    from refimpl import validation

    calls = []
    original = validation.check_running_mean
    monkeypatch.setattr(validation, "check_running_mean", lambda *a: calls.append(1) or original(*a))
    qkv = _qkv(N=40)
    out, state = ovq.ovq_attention(**qkv, max_size=6, chunk_size=4, return_state=True)
    ovq.ovq_attention_forward(**qkv, max_size=6, chunk_size=4, state=state)
    ovq.vq_attention(**qkv, codebook=np.eye(3), chunk_size=4)
    gmm.kmeans_step(qkv["q"], qkv["q"][:3])
    assert calls == []
    gmm.running_mean_update(np.zeros((2, 3)), np.zeros(2, np.int64), qkv["q"], np.arange(40) % 2)
    assert calls == [1]


def test_the_running_mean_core_is_the_public_rule():
    """gmm.fold_running_means gives the bits of gmm.running_mean_update on checked arguments, integer or float counts."""
    rng = np.random.default_rng(5)
    means, x = rng.normal(size=(4, 3)), rng.normal(size=(50, 3))
    assignments = rng.integers(0, 4, size=50)
    for counts in (np.array([0, 3, 1, 0]), np.array([0.0, 2.0, 0.0, 5.0])):
        for a, b in zip(gmm.running_mean_update(means, counts, x, assignments), gmm.fold_running_means(means, counts, x, assignments)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_the_row_blocks_come_from_numerics_block_rows(monkeypatch):
    """gmm.log_joint and GMA's responsibility backward size their row blocks by numerics.block_rows, K d numbers a row."""
    from refimpl import numerics

    asked = []
    original = numerics.block_rows
    monkeypatch.setattr(numerics, "block_rows", lambda row_bytes: asked.append(row_bytes) or original(row_bytes))
    a = _gma_args()
    K, d_r = a["means"].shape
    gmm.log_joint(a["x_q"], a["means"], a["variances"], np.log(a["weights"]))
    assert asked == [K * d_r * 8]
    asked.clear()
    out, cache = gma.gma_forward(a["x_q"], a["x_k"], a["v"], a["means"], np.zeros((K, d_r)), np.zeros(K))
    assert asked == [K * d_r * 8] * 2  # the forward's log joint, of the queries and of the keys
    asked.clear()
    gma.gma_backward(np.ones_like(out), cache)
    assert asked == [K * d_r * 8] * 2


def test_a_state_file_that_breaks_an_invariant_names_the_file_and_keeps_the_cause(tmp_path):
    """validation.check_loaded_state: the constructor's error becomes a ValueError naming the file, chained to it."""
    for state, field, bad in ((gma.GMAState.empty(3, 2), "norms", -np.ones(3)), (ovq.OVQState.empty(4, 3, 2), "size", np.array(9))):
        path = tmp_path / f"{type(state).__name__}.npz"
        state.save(path)
        fields = dict(np.load(path))
        fields[field] = bad
        np.savez(path, **fields)
        with pytest.raises(ValueError, match=rf"^{path}: invalid {type(state).__name__}: {field}: expected") as info:
            type(state).load(path)
        assert isinstance(info.value.__cause__, ValueError)
