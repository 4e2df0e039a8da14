"""refimpl.tuned is the plain reference computed the fast way: the same results to rounding, the same errors word for word.

``refimpl.gmm`` and ``refimpl.gma`` are the definitions (the differences
``x - mu``, per-token sums); ``refimpl.tuned`` expands the square, screens
for cancellation and sums by matrix products.  Here every tuned function is
held to its reference: outputs and gradients in float64 and float32, with
batches and heads and awkward sizes, and every refusal.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gma, gmm, tuned
from refimpl.testing import TOL

DTYPES = [np.float64, np.float32]


def mixture(K, d, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(K, d)).astype(dtype), rng.uniform(0.5, 2.0, size=(K, d)).astype(dtype),
            rng.dirichlet(np.ones(K)).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, K, d", [(1, 1, 1), (7, 3, 2), (65, 9, 5), (300, 16, 32)])
def test_the_responsibilities_agree(n, K, d, dtype):
    means, variances, weights = mixture(K, d, seed=n, dtype=dtype)
    x = np.random.default_rng(n + 1).normal(size=(n, d)).astype(dtype)
    for plain, fast in ((gmm.responsibilities, tuned.responsibilities), (gmm.log_responsibilities, tuned.log_responsibilities),
                        (gmm.log_likelihood, tuned.log_likelihood)):
        want, got = plain(x, means, variances, weights), fast(x, means, variances, weights)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(got, want, **TOL[dtype])
    for a, b in zip(gmm.em_step(x, means, variances, weights), tuned.em_step(x, means, variances, weights)):
        np.testing.assert_allclose(b, a, **TOL[dtype])


CASES = [
    # (leading, per_head, causal, N, K, d_r, d_v)
    ((), False, False, 1, 1, 1, 1),
    ((), False, True, 65, 3, 2, 4),
    ((), False, False, 33, 5, 3, 2),
    ((2,), False, True, 9, 4, 2, 3),
    ((2, 3), True, True, 7, 3, 2, 2),
    ((3,), True, False, 5, 2, 3, 1),
]


def _problem(leading, per_head, N, K, d_r, d_v, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x_q, x_k = rng.normal(size=(2,) + leading + (N, d_r))
    v = rng.normal(size=leading + (N, d_v))
    heads = leading[-1:] if per_head else ()
    means = rng.normal(size=heads + (K, d_r))
    raw = rng.normal(size=heads + (K, d_r))
    logits = rng.normal(size=heads + (K,))
    return tuple(a.astype(dtype) for a in (x_q, x_k, v, means, raw, logits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading, per_head, causal, N, K, d_r, d_v", CASES)
def test_gma_forward_and_backward_agree(leading, per_head, causal, N, K, d_r, d_v, dtype):
    args = _problem(leading, per_head, N, K, d_r, d_v, dtype, seed=N + K)
    out, cache = gma.gma_forward(*args, causal=causal, chunk_size=4)
    out_t, cache_t = tuned.gma_forward(*args, causal=causal, chunk_size=4)
    assert type(cache_t) is type(cache) and out_t.dtype == dtype
    np.testing.assert_allclose(out_t, out, **TOL[dtype])
    g = np.random.default_rng(1).normal(size=out.shape).astype(dtype)
    want, got = gma.gma_backward(g, cache), tuned.gma_backward(g, cache_t)
    for name in want._fields:
        w, b = getattr(want, name), getattr(got, name)
        assert b.shape == w.shape and b.dtype == dtype, name
        np.testing.assert_allclose(b, w, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * max(1.0, np.max(np.abs(w))), err_msg=name)
    # the two backwards are interchangeable on each other's caches: the caches hold the same quantities
    for name in want._fields:
        np.testing.assert_allclose(getattr(tuned.gma_backward(g, cache), name), getattr(want, name), **TOL[dtype], err_msg=name)


def test_gma_agrees_on_the_spread_means_problem():
    """Means spread far apart: the tuned expansion is screened and repaired, so GMA on top of it is right too."""
    rng = np.random.default_rng(2)
    x_q, x_k, v, means = rng.normal(size=(40, 3)), rng.normal(size=(40, 3)), rng.normal(size=(40, 2)), rng.normal(size=(4, 3))
    weights = np.full(4, 0.25)
    means = means * 1e5
    x_q, x_k = means[np.arange(40) % 4] + 1e-3 * x_q, means[np.arange(40) % 4] + 1e-3 * x_k
    variances = np.full_like(means, 1e-6)
    np.testing.assert_allclose(tuned.gma(x_q, x_k, v, means, variances, weights), gma.gma(x_q, x_k, v, means, variances, weights), rtol=1e-12, atol=1e-12)


def _bad_gmm():
    x = np.random.default_rng(3).normal(size=(6, 2))
    means, variances, weights = mixture(3, 2)
    ok = dict(x=x, means=means, variances=variances, weights=weights)
    return [
        {**ok, "x": np.where(np.arange(12).reshape(6, 2) == 3, np.nan, x)},
        {**ok, "x": x.astype(int)},
        {**ok, "x": x[:, 0]},
        {**ok, "means": means[:, :1]},
        {**ok, "means": means[:0], "variances": variances[:0], "weights": weights[:0]},
        {**ok, "variances": -variances},
        {**ok, "weights": weights * 2},
        {**ok, "weights": weights[:2]},
        {**ok, "x": np.full((1, 2), 1e200), "variances": np.full((3, 2), 1e-200)},
    ]


@pytest.mark.parametrize("name", ["responsibilities", "log_responsibilities", "log_likelihood", "em_step"])
@pytest.mark.parametrize("case", range(len(_bad_gmm())))
def test_the_gmm_functions_refuse_what_the_reference_refuses(name, case):
    kwargs = _bad_gmm()[case]
    with pytest.raises((TypeError, ValueError)) as ref:
        getattr(gmm, name)(**kwargs)
    with pytest.raises(type(ref.value)) as got:
        getattr(tuned, name)(**kwargs)
    assert str(got.value) == str(ref.value)


def _bad_gma():
    x_q, x_k, v, means, raw, logits = _problem((2, 3), True, 5, 3, 2, 2, np.float64)
    ok = dict(x_q=x_q, x_k=x_k, v=v, means=means, raw_variances=raw, logits=logits)
    return [
        {**ok, "x_q": x_q[0, 0, 0]},
        {**ok, "x_k": x_k[0]},
        {**ok, "v": v[..., :3, :]},
        {**ok, "means": means[:2]},
        {**ok, "means": means[0, :0], "raw_variances": raw[0, :0], "logits": logits[0, :0]},
        {**ok, "raw_variances": raw[..., :1]},
        {**ok, "logits": logits[0]},
        {**ok, "x_q": np.where(x_q > 1, np.inf, x_q)},
        {**ok, "causal": 1},
        {**ok, "causal": True, "x_k": x_k[..., :4, :], "v": v[..., :4, :]},
        {**ok, "chunk_size": 0},
        {**ok, "eps": -1.0},
        {**ok, "min_variance": 0.0},  # gma_forward's own argument: the last case
    ]


@pytest.mark.parametrize("case", range(len(_bad_gma())))
def test_the_gma_functions_refuse_what_the_reference_refuses(case):
    kwargs = _bad_gma()[case]
    with pytest.raises((TypeError, ValueError)) as ref:
        gma.gma_forward(**kwargs)
    with pytest.raises(type(ref.value)) as got:
        tuned.gma_forward(**kwargs)
    assert str(got.value) == str(ref.value)
    if "min_variance" in kwargs:
        return
    # gma: the same checks with variances and weights
    variances = gmm.variances_from_raw(kwargs["raw_variances"]) if np.ndim(kwargs["raw_variances"]) else kwargs["raw_variances"]
    plain_args = {k: w for k, w in kwargs.items() if k not in ("raw_variances", "logits", "min_variance")}
    plain_args.update(variances=variances, weights=gmm.weights_from_logits(kwargs["logits"]) if np.size(kwargs["logits"]) else kwargs["logits"])
    with pytest.raises((TypeError, ValueError)) as ref:
        gma.gma(**plain_args)
    with pytest.raises(type(ref.value)) as got:
        tuned.gma(**plain_args)
    assert str(got.value) == str(ref.value)


def test_a_bad_cache_or_gradient_is_refused_alike():
    args = _problem((), False, 6, 3, 2, 2, np.float64)
    out, cache = gma.gma_forward(*args)
    for grad, c in ((np.ones((5, 2)), cache), (np.ones(out.shape), None), (np.ones(out.shape), cache._asdict())):
        with pytest.raises((TypeError, ValueError)) as ref:
            gma.gma_backward(grad, c)
        with pytest.raises(type(ref.value)) as got:
            tuned.gma_backward(grad, c)
        assert str(got.value) == str(ref.value)
