r"""In-context regression: how many functions can a memory of key-value pairs hold?

The task
--------
A sequence binds ``F`` random linear maps :math:`W_f \in \mathbb R^{d_v\times d_x}`
(entries :math:`\mathcal N(0, 1/d_x)`) to ``F`` function codes
:math:`c_f`, random unit vectors of :math:`\mathbb R^{d_c}` drawn afresh for
every sequence.  The context holds ``T`` pairs, ``T / F`` per function in a
random order: an input :math:`x` uniform on the unit sphere of
:math:`\mathbb R^{d_x}`, the key

.. math::

    k = [c_f;\ x] / \sqrt 2 \quad(\text{unit norm: it carries the function and the input}),

and the value :math:`v = W_f x`.  A query is built the same way from a
function of the context and a fresh input; its target is :math:`W_f x`.
Each method reads the context as a memory, and its prediction is its
attention output for the query.  The metric is the normalised mean squared
error

.. math::

    \mathrm{nMSE} = \sum_i \|\hat y_i - y_i\|^2 \Big/ \sum_i \|y_i - \bar y\|^2 ,

over the queries: predicting the mean target scores 1, a perfect prediction 0.

The methods
-----------
All read the same context with the same scale :math:`\beta` (linear
attention has none):

* ``full``: softmax attention of the queries over all ``T`` context pairs,
  :math:`\operatorname{softmax}(\beta\,qK^\top)V`, i.e. Gaussian kernel
  regression (:func:`refimpl.gmr.kernel_regression`);
* ``ovq``: :func:`refimpl.ovq.ovq_attention` streams the context (library
  defaults: plateau growth, spread seeding, running means, count bias) into
  a dictionary of at most ``N`` centroids, in chunks of 64; the
  queries read it with :func:`refimpl.gmr.ovq_readout`,
  :math:`\operatorname{softmax}(\beta\,qD_k^\top + \log c)D_v`, Gaussian
  mixture regression over the context.  It is the output that
  ``ovq_attention`` gives a query placed right after the context in a chunk
  of its own (the tests check it);
* ``vq``: the same read-out with a static codebook of ``N`` unit codes fitted
  by spherical k-means (10 Lloyd steps of :func:`refimpl.gmm.kmeans_step`
  from ``N`` of its keys) on the keys of *another sequence* of the task,
  whose function codes are not this sequence's;
  every context key joins its nearest code, whose value is the running mean
  of its members' values, read with :math:`\beta\,q\cdot D_k[m] + \log L_m`:
  the read-out of :func:`refimpl.ovq.vq_attention` for past chunks;
* ``vq_own``: a control, the same with the codebook fitted on this
  sequence's own context keys (what a static codebook can do when its codes
  match the keys);
* ``linear``: :func:`refimpl.attention.linear_attention`, non-causal, the
  ``elu + 1`` feature map, library defaults;
* ``mean``: the mean of the context values, whatever the query (a
  predictor that ignores the key: about 1).

The claim checked
-----------------
OVQ attention learns all 128 functions of an in-context regression task,
where VQ attention and linear attention fail.  These runs have no training:
they test the memory mechanisms with the task's keys as given, not a learned
model.

The grid: ``F`` in 1, 2, ..., 128, ``T = 4096`` context pairs, 256 queries,
:math:`d_c = 64`, :math:`d_x = 2`, :math:`d_v = 8`; two memory sizes for
OVQ and VQ, ``N = T / 8 = 512`` and ``N = T / 2 = 2048``; and two scales,
the library default :math:`\beta = \sqrt d` (``d = 66``) and
:math:`\beta = 32` (a kernel narrow enough for full attention to separate
the functions and follow the input).  ``--quick``: ``F`` in 1, 8,
``T = 256``, ``N = T / 8``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refimpl.attention import linear_attention, softmax_attention
from refimpl.gmm import kmeans_step, running_mean_update
from refimpl.gmr import ovq_readout
from .. import backend
from refimpl.ovq import unit_rows

NAME = "regression"
PARAMS = ("functions", "context", "memory", "beta", "seed")
METHODS = ("full", "ovq", "vq", "vq_own", "linear", "mean")
METRICS = tuple(f"nmse_{m}" for m in METHODS)
TIMINGS = ()

#: Dimensions of the function code, the input and the output.
D_CODE, D_X, D_V = 64, 2, 8
#: Queries per point.
QUERIES = 256
#: OVQ's chunk size.
CHUNK = 64
#: OVQ's ``max_size`` and the VQ codebook size, ``N``, are ``context // d`` for ``d`` in these.
MEMORY_DIVISORS = (8, 2)
#: Lloyd steps of the spherical k-means that fits the VQ codebook.
KMEANS_STEPS = 10
#: The stated scale; ``"default"`` in the grid means the library's ``sqrt(d)``.
BETA_SHARP = 32.0

_FUNCTIONS = (1, 2, 4, 8, 16, 32, 64, 128)


class Task(NamedTuple):
    """One sequence of the in-context regression task (shapes in the comments)."""

    keys: np.ndarray  # (T, d_c + d_x): unit context keys [c_f; x] / sqrt(2)
    values: np.ndarray  # (T, d_v): W_f x of each context pair
    queries: np.ndarray  # (Q, d_c + d_x): unit query keys, built as the context keys
    targets: np.ndarray  # (Q, d_v): W_f x of each query
    functions: np.ndarray  # (T,) int: f of each context pair
    inputs: np.ndarray  # (T, d_x): x of each context pair (unit vectors)
    query_functions: np.ndarray  # (Q,) int
    query_inputs: np.ndarray  # (Q, d_x)
    codes: np.ndarray  # (F, d_c): unit function codes c_f
    maps: np.ndarray  # (F, d_v, d_x): W_f


def _keys(codes, functions, inputs):
    # k = [c_f; x] / sqrt(2): both halves are unit vectors, so ||k|| = 1
    return np.concatenate([codes[functions], inputs], axis=1) / np.sqrt(2.0)


def _apply(maps, functions, inputs):
    # v = W_f x, row by row
    return np.einsum("tij,tj->ti", maps[functions], inputs)


def make_task(rng, n_functions, context, queries=QUERIES, *, d_code=D_CODE, d_x=D_X, d_v=D_V) -> Task:
    """Draw one sequence: ``F`` codes and maps, ``T`` context pairs and ``Q`` queries.

    Parameters
    ----------
    rng : numpy.random.Generator
    n_functions : int
        ``F`` (>= 1); ``context`` must be a multiple of it.
    context : int
        ``T``, context pairs, ``T / F`` per function in a random order.
    queries : int, default 256
        ``Q``; each asks a function drawn uniformly from the ``F`` at a fresh input.
    d_code, d_x, d_v : int
        Dimensions of the code, the input and the output.

    Returns
    -------
    Task
    """
    if n_functions < 1 or context % n_functions:
        raise ValueError(f"context: expected a multiple of the number of functions {n_functions}, got {context}")
    codes = unit_rows(rng.standard_normal((n_functions, d_code)))
    maps = rng.standard_normal((n_functions, d_v, d_x)) / np.sqrt(d_x)
    functions = rng.permutation(np.arange(context) % n_functions)
    inputs = unit_rows(rng.standard_normal((context, d_x)))
    query_functions = rng.integers(n_functions, size=queries)
    query_inputs = unit_rows(rng.standard_normal((queries, d_x)))
    return Task(
        keys=_keys(codes, functions, inputs),
        values=_apply(maps, functions, inputs),
        queries=_keys(codes, query_functions, query_inputs),
        targets=_apply(maps, query_functions, query_inputs),
        functions=functions,
        inputs=inputs,
        query_functions=query_functions,
        query_inputs=query_inputs,
        codes=codes,
        maps=maps,
    )


def normalised_mse(prediction, targets):
    """``sum ||y^ - y||^2 / sum ||y - mean(y)||^2`` over the rows.

    Parameters
    ----------
    prediction, targets : ndarray, shape (Q, d_v)

    Returns
    -------
    float
        0 for a perfect prediction, 1 for the mean target.
    """
    return float(np.sum((prediction - targets) ** 2) / np.sum((targets - targets.mean(axis=0)) ** 2))


def kmeans_codebook(keys, size, steps=KMEANS_STEPS):
    """Spherical k-means: ``steps`` Lloyd steps from the first ``size`` keys, codes renormalised.

    Parameters
    ----------
    keys : ndarray, shape (T, d)
        Unit keys, ``T >= size``.
    size : int
        ``S``, codes.

    Returns
    -------
    ndarray, shape (S, d)
        Unit codes.
    """
    codes = keys[:size].copy()
    for _ in range(steps):
        codes = unit_rows(kmeans_step(keys, codes))
    return codes


def vq_readout(queries, keys, values, codebook, *, beta):
    """VQ attention's read-out of a context summarised by a static codebook.

    Parameters
    ----------
    queries : ndarray, shape (Q, d)
        Unit queries.
    keys : ndarray, shape (T, d)
        Unit context keys.
    values : ndarray, shape (T, d_v)
    codebook : ndarray, shape (S, d)
    beta : float

    Returns
    -------
    ndarray, shape (Q, d_v)
        ``softmax(beta q D_k[m] + log L_m) U_m`` over the codes ``m`` that
        some key joins, ``L_m`` their member counts and ``U_m`` the means of
        their values.
    """
    # z_j = argmax_m k_j . D_k[m] (ties to the lowest index, as vq_attention)
    z = np.argmax(keys @ codebook.T, axis=1)
    means, counts = running_mean_update(np.zeros((codebook.shape[0], values.shape[1])), np.zeros(codebook.shape[0], np.int64), values, z)
    used = counts > 0
    return ovq_readout(queries, codebook[used], means[used], counts[used], beta=beta)


def ovq_memory(keys, values, *, max_size, beta):
    """Stream the context through OVQ attention; its final dictionaries and counts.

    Parameters
    ----------
    keys : ndarray, shape (T, d)
    values : ndarray, shape (T, d_v)
    max_size : int
        ``N``.
    beta : float

    Returns
    -------
    key_means : ndarray, shape (n, d)
    value_means : ndarray, shape (n, d_v)
    counts : ndarray of int, shape (n,)
        The ``n`` active rows of the state (library defaults otherwise, chunks of :data:`CHUNK`).
    """
    _, state = backend.kernels().ovq_attention(keys, keys, values, max_size=max_size, chunk_size=CHUNK, beta=beta, return_state=True)
    n = state.size
    return state.keys[:n], state.values[:n], state.counts[:n]


def predictions(task: Task, other: Task, *, beta, memory):
    """Every method's prediction for the task's queries.

    Parameters
    ----------
    task : Task
        The sequence read.
    other : Task
        Another sequence of the task, whose keys fit the ``vq`` codebook.
    beta : float
        Scale of the softmax read-outs.
    memory : int
        OVQ's ``max_size`` and the codebook size.

    Returns
    -------
    dict of str to ndarray, shape (Q, d_v)
        Keyed by :data:`METHODS`.
    """
    k, v, q = task.keys, task.values, task.queries
    out = {}
    # softmax(beta q K^T) V: Gaussian kernel regression over every pair
    out["full"] = softmax_attention(q, k, v, scale=beta)
    # softmax(beta q D_k^T + log c) D_v over OVQ's dictionaries: GMR over the context
    out["ovq"] = ovq_readout(q, *ovq_memory(k, v, max_size=memory, beta=beta), beta=beta)
    out["vq"] = vq_readout(q, k, v, kmeans_codebook(other.keys, memory), beta=beta)
    out["vq_own"] = vq_readout(q, k, v, kmeans_codebook(k, memory), beta=beta)
    out["linear"] = linear_attention(q, k, v)
    out["mean"] = np.broadcast_to(v.mean(axis=0), task.targets.shape)
    return out


def _beta(value) -> float:
    return float(np.sqrt(D_CODE + D_X)) if value == "default" else float(value)


def grid(quick: bool, seeds: int) -> list[dict]:
    """The points: scale x memory ``N`` x ``F`` x seed.

    ``T = 4096`` and ``N = T / 8, T / 2``; the quick grid has ``F`` in 1, 8,
    ``T = 256`` and ``N = T / 8`` only.
    """
    functions, context, divisors = ((1, 8), 256, MEMORY_DIVISORS[:1]) if quick else (_FUNCTIONS, 4096, MEMORY_DIVISORS)
    return [
        {"functions": f, "context": context, "memory": context // m, "beta": beta, "seed": s}
        for beta in ("default", BETA_SHARP)
        for m in divisors
        for f in functions
        for s in range(seeds)
    ]


def run_point(point: dict) -> dict:
    """Draw the point's sequence (and the VQ codebook's other sequence) from its seed; every method's nMSE.

    The draw depends on ``seed``, ``functions`` and ``context`` only, so every
    scale and memory size reads the same sequences.
    """
    F, T = int(point["functions"]), int(point["context"])
    rng = np.random.default_rng([int(point["seed"]), F, T])
    task = make_task(rng, F, T)
    other = make_task(rng, F, T)
    preds = predictions(task, other, beta=_beta(point["beta"]), memory=int(point["memory"]))
    return {f"nmse_{m}": normalised_mse(p, task.targets) for m, p in preds.items()}


def _summary(rows):
    """``{(beta, N, F): {method: (mean, std, n)}}`` over the seeds."""
    groups = {}
    for row in rows:
        groups.setdefault((str(row["beta"]), int(row["memory"]), int(row["functions"])), []).append(row)
    out = {}
    for key, group in groups.items():
        out[key] = {}
        for m in METHODS:
            x = np.array([r[f"nmse_{m}"] for r in group], dtype=float)
            out[key][m] = (float(x.mean()), float(x.std()), x.size)
    return out


def _beta_label(beta) -> str:
    return f"beta = sqrt(d) = {_beta('default'):.2f}" if str(beta) == "default" else f"beta = {float(beta):g}"


def table(rows) -> str:
    """Mean +- std (over seeds) of every method's nMSE, one line per scale and ``F``."""
    summary = _summary(rows)
    header = f"{'beta':>6} {'N':>5} {'F':>4} {'T':>5} {'n':>2} " + " ".join(f"{m:>15}" for m in METHODS)
    lines = ["normalised MSE (mean +- std over seeds; 1 = predicting the mean target)", header, "-" * len(header)]
    contexts = {(str(r["beta"]), int(r["memory"]), int(r["functions"])): int(r["context"]) for r in rows}
    for (beta, N, F), stats in summary.items():
        b = f"{_beta(beta):.2f}"
        n = stats[METHODS[0]][2]
        cells = " ".join(f"{f'{mu:.3f} +- {sd:.3f}':>15}" for mu, sd, _ in stats.values())
        lines.append(f"{b:>6} {N:>5} {F:>4} {contexts[(beta, N, F)]:>5} {n:>2} {cells}")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """nMSE against ``F`` (log scales), one panel per scale and memory size, error bars one std over seeds."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or open figure is touched

    summary = _summary(rows)
    betas = list(dict.fromkeys(b for b, _, _ in summary))
    sizes = list(dict.fromkeys(N for _, N, _ in summary))
    fig = Figure(figsize=(5.5 * len(betas), 4.0 * len(sizes)))
    axes = fig.subplots(len(sizes), len(betas), sharey=True, squeeze=False)
    for (i, N), (j, beta) in ((a, b) for a in enumerate(sizes) for b in enumerate(betas)):
        ax = axes[i][j]
        Fs = sorted(F for b, n, F in summary if b == beta and n == N)
        for m, marker in zip(METHODS, "osv^Dx"):
            mu = [summary[(beta, N, F)][m][0] for F in Fs]
            sd = [summary[(beta, N, F)][m][1] for F in Fs]
            ax.errorbar(Fs, mu, yerr=sd, marker=marker, ms=4, capsize=3, label=m, ls="--" if m in ("vq_own", "mean") else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("functions F in the context")
        ax.set_title(f"{_beta_label(beta)}, N = {N} (OVQ, VQ)", fontsize=10)
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel("normalised MSE (1 = mean target)")
    axes[0][-1].legend(fontsize=8, loc="center right")
    fig.suptitle("In-context regression of F random linear maps (no training)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
