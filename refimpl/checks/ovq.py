r"""Verifications of OVQ attention (``docs/derivations/ovq_gmr.md``).

Growth against the Chinese-restaurant process
---------------------------------------------
A CRP with concentration :math:`n_{\max}` (the capacity) opens a new table at
customer :math:`i` with probability :math:`n_{\max}/(n_{\max}+i)`, so after :math:`t` customers the expected
number of tables is

.. math::

    E(t) = \sum_{i<t} \frac{n_{\max}}{n_{\max}+i} = n_{\max}\,(\psi(n_{\max}+t) - \psi(n_{\max})).

The plateau curve is :math:`n(t) = \max(1, \lfloor f(t)\rfloor)` with
:math:`f(t) = t n_{\max}/(t+n_{\max}) = n_{\max}(1 - n_{\max}/(n_{\max}+t))`.  It is *not* :math:`E(t)`: both start
with slope 1, but :math:`E` keeps growing like :math:`n_{\max}\log(1+t/n_{\max})` while
:math:`f` approaches :math:`n_{\max}` from below and never reaches it (so
:math:`n(t) \le n_{\max} - 1`).  The exact gap follows from two elementary
bounds.  The summand is decreasing, so the sum exceeds the integral by at
most its first term: :math:`0 \le E(t) - n_{\max}\log(1+t/n_{\max}) \le 1`.  And
:math:`|n(t) - f(t)| < 1`.  Hence, with :math:`x = t/n_{\max}` and
:math:`g(x) = \log(1+x) - x/(1+x) \ge 0`,

.. math::

    \big|\,(E(t) - n(t)) - n_{\max} g(t/n_{\max})\,\big| < 2 \quad\text{tables, for every } t \ge 1.

The check measures the left side: the plateau curve sits below the CRP
expectation by :math:`n_{\max} g(t/n_{\max})` (about :math:`n_{\max} x^2/2` early on, 28% of
:math:`E` at :math:`t = n_{\max}`, growing without bound later) and nothing else.

Per chunk of :math:`C` tokens the contract approximates the plateau increment by
:math:`C\,(n_{\max}/(n_{\max}+t))^2 = C f'(t)`.  The exact increment of :math:`f` is
:math:`f(t+C) - f(t) = C f'(t)\cdot (n_{\max}+t)/(n_{\max}+t+C)`, and the floors move it by
less than 1 (at chunk boundaries :math:`t = jC \ge C \ge 2`, where
:math:`f \ge 1`), so

.. math::

    |\Delta n - C (n_{\max}/(n_{\max}+t))^2| < 1 + C (n_{\max}/(n_{\max}+t))^2 \frac{C}{n_{\max}+t+C}.

The check reports the largest ratio of the left side to that bound.  Note that
:math:`C(n_{\max}/(n_{\max}+t))^2` is the slope of the plateau curve, not the CRP's
expected number of new tables in the chunk, which is about :math:`C n_{\max}/(n_{\max}+t)`.
"""

from __future__ import annotations

import numpy as np
from scipy.special import digamma

from .. import ovq
from ..attention import softmax_attention
from ..gradcheck import numerical_gradient, relative_error
from ..ovq_oracle import ovq_attention_loop
from ..testing import assignment_plan
from ..verify import register


@register(
    "ovq.loop_oracle_state_bit_for_bit",
    "token-by-token loop oracle vs vectorised OVQ, 5 switch settings: state bit for bit (else inf), max output difference",
    tol=1e-14,
)
def _oracle():
    rng = np.random.default_rng(50)
    worst = 0.0
    N, d, d_v = 45, 4, 3
    for kw in (
        {},
        {"growth": "linear"},
        {"init": "random", "seed": 7},
        {"count_bias": False},
        {"learning_rate": 0.05},
    ):
        q, k, v = rng.normal(size=(N, d)), rng.normal(size=(N, d)), rng.normal(size=(N, d_v))
        out, st = ovq.ovq_attention(q, k, v, max_size=9, chunk_size=6, return_state=True, **kw)
        ref, rs = ovq_attention_loop(q, k, v, max_size=9, chunk_size=6, **kw)
        same = (
            np.array_equal(st.keys, rs.keys)
            and np.array_equal(st.values, rs.values)
            and np.array_equal(st.counts, rs.counts)
            and (st.size, st.tokens_seen) == (rs.size, rs.tokens_seen)
        )
        if not same:
            return float("inf")
        worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(v))))
    return worst


@register(
    "ovq.linear_growth_equals_causal_softmax",
    "OVQ, growth=linear, max_size >= N (every key its own centroid, count 1): == softmax_attention(q^, k^, v, scale=beta, causal)",
    tol=1e-13,
)
def _linear_is_softmax():
    rng = np.random.default_rng(51)
    worst = 0.0
    for N, C, beta in ((203, 16, None), (64, 64, 5.0), (50, 1, 2.0)):
        q, k, v = rng.normal(size=(N, 8)), rng.normal(size=(N, 8)), rng.normal(size=(N, 3))
        out = ovq.ovq_attention(q, k, v, max_size=N, chunk_size=C, beta=beta, growth="linear")
        scale = np.sqrt(8) if beta is None else beta
        ref = softmax_attention(ovq.unit_rows(q), ovq.unit_rows(k), v, scale=scale, causal=True)
        worst = max(worst, float(np.max(np.abs(out - ref)) / np.max(np.abs(v))))
    return worst


@register(
    "ovq.update_equals_newton_step",
    "OVQ chunk update of D_k, D_v == Newton step mu - H^-1 grad on the NLL of all tokens seen, H = beta c' I, assignments fixed",
    tol=1e-13,
)
def _newton():
    rng = np.random.default_rng(52)
    N, C, n_max, beta = 96, 16, 8, 3.0
    q, k, v = rng.normal(size=(N, 5)), rng.normal(size=(N, 5)), rng.normal(size=(N, 4))
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, beta=beta, growth="linear")
    last = cache.records[-1]
    if last.n != n_max or last.seeds.size:  # the last chunk must only update existing centroids
        return float("inf")
    rows = assignment_plan(cache)
    x = {"keys": ovq.unit_rows(k), "values": v}
    before = {"keys": last.dict_keys, "values": last.dict_values}
    after = {"keys": cache.state.keys, "values": cache.state.values}
    worst = 0.0
    for name in ("keys", "values"):
        mu = before[name]
        # NLL surrogate sum_i (beta/2) ||x_i - mu_{a_i}||^2 over every token seen, at mu = D before the chunk
        grad = np.zeros_like(mu)
        np.add.at(grad, rows, -beta * (x[name] - mu[rows]))
        hess = beta * np.bincount(rows, minlength=n_max)[:, None]
        newton = mu - grad / hess
        worst = max(worst, float(np.max(np.abs(newton - after[name])) / np.max(np.abs(after[name]))))
    return worst


@register(
    "ovq.dictionary_is_batch_mean",
    "after 300 tokens in 19 chunks: every D_k, D_v row == batch mean of the unit keys / values assigned to it (plateau, spread)",
    tol=1e-13,
)
def _batch_mean():
    rng = np.random.default_rng(53)
    N, d, d_v, n_max = 300, 6, 4, 24
    q, k, v = rng.normal(size=(N, d)), rng.normal(size=(N, d)), rng.normal(size=(N, d_v)) + 2.0
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=16)
    rows, st = assignment_plan(cache), cache.state
    kh = ovq.unit_rows(k)
    worst = 0.0
    for m in range(st.size):
        sel = rows == m
        worst = max(
            worst,
            float(np.max(np.abs(kh[sel].mean(axis=0) - st.keys[m]))),
            float(np.max(np.abs(v[sel].mean(axis=0) - st.values[m])) / np.max(np.abs(v))),
        )
    return worst


@register(
    "ovq.counts_sum_to_tokens_seen",
    "sum(c) == t, c == number of tokens assigned per row, unused rows 0, over 6 settings fed in uneven pieces (exact)",
    tol=0.0,
)
def _counts():
    rng = np.random.default_rng(54)
    worst = 0
    for n_max, C, kw in ((16, 8, {}), (1, 5, {}), (30, 1, {}), (12, 7, {"growth": "linear"}), (10, 4, {"init": "random"}), (9, 3, {"learning_rate": 0.1})):
        q, k, v = rng.normal(size=(200, 3)), rng.normal(size=(200, 3)), rng.normal(size=(200, 2))
        state, rows = None, []
        for lo, hi in ((0, 3 * C), (3 * C, 5 * C), (5 * C, 200)):
            _, cache = ovq.ovq_attention_forward(q[lo:hi], k[lo:hi], v[lo:hi], max_size=n_max, chunk_size=C, state=state, **kw)
            state = cache.state
            rows.append(assignment_plan(cache))
        c = state.counts
        per_row = np.bincount(np.concatenate(rows), minlength=n_max)
        worst = max(worst, abs(int(c.sum()) - state.tokens_seen), abs(state.tokens_seen - 200),
                    int(np.max(np.abs(c - per_row))), int(np.count_nonzero(c[state.size :])))
    return float(worst)


@register(
    "ovq.growth_vs_crp_expected_tables",
    "plateau n(t) vs CRP E[tables] = n_max(psi(n_max+t)-psi(n_max)): |(E - n) - n_max(log(1+t/n_max) - t/(n_max+t))| tables, "
    "t <= 64 n_max (< 2)",
    tol=2.0,
)
def _growth_crp():
    worst = 0.0
    for n_max in (4, 64, 1024):
        t = np.arange(1, 64 * n_max + 1)
        n = ovq.dictionary_size(t, n_max, "plateau")
        expected = n_max * (digamma(n_max + t) - digamma(n_max))
        if n_max == 64 and not np.allclose(expected, np.cumsum(n_max / (n_max + np.arange(t.size))), rtol=1e-12):
            return float("inf")  # the digamma closed form must be the sum it stands for
        x = t / n_max
        gap = n_max * (np.log1p(x) - x / (1 + x))
        worst = max(worst, float(np.max(np.abs((expected - n) - gap))))
    return worst


@register(
    "ovq.growth_increments_vs_spec",
    "plateau increment per chunk vs the slope C (n_max/(n_max+t))^2: |error| / (1 + C (n_max/(n_max+t))^2 C/(n_max+t+C)), "
    "strictly < 1",
    tol=1.0,
)
def _growth_increments():
    worst = 0.0
    for n_max, C in ((64, 16), (1024, 256), (1024, 64)):
        t = np.arange(0, 64 * n_max, C)
        dn = ovq.dictionary_size(t + C, n_max) - ovq.dictionary_size(t, n_max)
        slope = C * (n_max / (n_max + t)) ** 2
        bound = 1 + slope * C / (n_max + t + C)
        worst = max(worst, float(np.max(np.abs(dn - slope) / bound)))
    return worst


@register(
    "ovq.backward_vs_finite_differences",
    "hand-derived dL/dq, dL/dk, dL/dv (assignments fixed) vs central differences, random upstream gradient, 2 settings",
    tol=1e-7,
)
def _backward():
    rng = np.random.default_rng(55)
    N, d, d_v, n_max, C, h = 11, 3, 2, 4, 4, 1e-6
    worst = 0.0
    for kw in ({}, {"learning_rate": 0.3, "count_bias": False}):
        inputs = {"q": rng.normal(size=(N, d)), "k": rng.normal(size=(N, d)), "v": rng.normal(size=(N, d_v))}
        G = rng.normal(size=(N, d_v))
        _, cache = ovq.ovq_attention_forward(**inputs, max_size=n_max, chunk_size=C, **kw)
        grads = ovq.ovq_attention_backward(G, cache)
        plan = assignment_plan(cache)
        flipped = []

        def loss(a, name):
            out, c2 = ovq.ovq_attention_forward(**{**inputs, name: a}, max_size=n_max, chunk_size=C, **kw)
            # the gradient holds the assignments fixed: a perturbation that flips one is no test point
            flipped.append(not np.array_equal(assignment_plan(c2), plan))
            return float(np.sum(G * out))

        for name in ("q", "k", "v"):
            fd = numerical_gradient(lambda a: loss(a, name), inputs[name], h=h)
            if any(flipped):
                return float("inf")
            worst = max(worst, relative_error(fd, getattr(grads, name)))
    return worst
