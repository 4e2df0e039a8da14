r"""In-context recall without training: full attention, linear attention, VQ, OVQ (and its ablations), GMA.

``python -m app experiment recall [--quick] [--seeds N] [--jobs J]``

The claim checked
-----------------
OVQ attention recalls close to full softmax attention with 10-25% of its
state (the KV cache), and far better than VQ attention with a static codebook
and than linear attention.  Nothing is trained: every method gets the same
unit queries and keys and reads what the sequence wrote into its memory, so
the experiment tests the memory mechanisms, not a learned model.

The tasks
---------
A sequence of ``T`` tokens holds ``M = T / 16`` bindings: clean unit keys
``C_b`` (``d = 64``) bound to values ``V_b``, random unit vectors
(``d_v = 32``).  Every token writes one binding ``z_t``, drawn uniformly: its
key is a noisy copy ``unit(C_b + 0.3 g / sqrt(d))``, ``g`` standard normal, and
its value is ``V_b`` (each binding is written about 16 times).  A scored
position ``t`` asks for a binding ``y_t`` written before ``t`` (and not the
one ``t`` writes itself): its query is the clean key ``C_{y_t}``.  The answer
is right when the output's nearest value among the ``M`` values,
``argmax_b o_t . V_b`` (the values have unit norm), is ``V_{y_t}``.  At most
:data:`QUERIES` positions are scored, drawn from the scoring window.

* ``associative``: the keys ``C_b`` are independent; the window is the second
  half of the sequence.
* ``positional``: what is recalled depends on where the query stands.  The
  sequence has :data:`SEGMENTS` segments of equal length; in each, the same
  ``M / SEGMENTS`` base keys ``K_p`` are bound to new values, and the key of
  base key ``p`` in segment ``s`` carries a code of the segment (a coarse
  absolute position code ``E_s``, a random unit vector):
  ``C_{(p, s)} = unit(K_p + 0.5 E_s)``.  The window is the second half of the
  last segment and a query asks for the *most recent* value of a base key,
  the one it was bound to in the query's own segment; the bindings of the same
  base key in earlier segments (keys of cosine about 0.8 with the query, with
  three to six times as many copies as the right one has when it is asked)
  are wrong answers.  There are ``M`` bindings in
  all, as in the associative task.

The methods
-----------
All read unit queries and keys with ``beta = sqrt(d)`` (OVQ's default) where
they have a temperature.  ``fraction`` is the size parameter ``N / T`` of the
methods that have one (``N`` rows against the ``T`` of the KV cache); the
metric ``state_fraction`` is the number of floats each method keeps, over the
KV cache's ``T (d + d_v)``.

* ``softmax``: full causal softmax attention, computed only at the scored
  rows, row-blocked (:func:`causal_softmax_rows`); ``fraction`` 0 (no size
  parameter), state 1.
* ``linear``: causal linear attention (``elu + 1`` features) on the unit
  queries and keys, as given (no scaling); ``fraction`` 0.
* ``vq``: VQ attention with a static codebook of ``N`` codes, fitted by
  :data:`KMEANS_ITERS` Lloyd steps of spherical k-means (assignment by largest
  dot product, as VQ attention assigns) on the keys of *another* sequence
  from the same generator: its bindings are not this sequence's.
* ``ovq``: OVQ attention with ``max_size = N``, library defaults (plateau
  growth, spread initialisation, count bias, adaptive rate ``1/c``), chunks of
  :data:`CHUNK` tokens; the ablations flip one switch each:
  ``ovq_random_init`` (``init="random"``), ``ovq_linear_growth``
  (``growth="linear"``), ``ovq_constant_rate`` (``learning_rate`` =
  :data:`CONSTANT_RATE`), ``ovq_no_count_bias`` (``count_bias=False``).
* ``gma``: causal GMA with ``K = N`` diagonal components fitted to this
  sequence's keys (all of them, future ones included: the mixture is fitted
  offline, the attention is causal) by :data:`EM_STEPS` steps of exact EM
  (``reg_covar`` = :data:`REG_COVAR`), started from ``K`` distinct keys
  drawn at random, the keys' variance per dimension and equal weights.  Each
  step is :func:`refimpl.tuned.streamed_em_step`: the step of
  :func:`refimpl.gmm.em_step` to rounding, computed :data:`EM_BLOCK_ROWS`
  keys at a time (memory ``O(EM_BLOCK_ROWS K)``: the ``T x K``
  responsibilities would take 4.3 GB at ``T = 65,536``), with the
  responsibilities from the backend's kernel (:func:`cpu.gmm.posterior`
  under numba, :func:`refimpl.tuned.posterior` under NumPy).

The grid
--------
The length sweep ``T`` in :data:`T_SWEEP` at ``fraction`` :data:`FRACTION`,
and the state sweep ``fraction`` in :data:`FRACTIONS` at ``T`` =
:data:`T_FRACTIONS`, for both tasks, every method at every point (GMA's
fit costs ``O(T K d)`` a step: a GMA point at ``T = 65,536`` took 353 s
of one core's CPU time, fit and forward pass, and 8.6 GB of memory, most
of it the forward pass's ``T x K`` responsibilities of the queries and the
keys; :data:`GMA_MAX_T` would leave out the longer ``T``).  A point is one method on one
sequence; every method at the same ``(task, T, seed)`` reads the same
sequence.  Each point runs with one BLAS thread, so its result does not
depend on ``--jobs``.
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from .. import backend
from refimpl.attention import linear_attention
from refimpl.tuned import softmax_rows, streamed_em_step
from refimpl.ovq import unit_rows

__all__ = [
    "NAME", "PARAMS", "METRICS", "TIMINGS", "TASKS", "METHODS",
    "grid", "run_point", "table", "plot",
    "make_task", "causal_softmax_rows", "accuracy", "spherical_kmeans",
]

NAME = "recall"
PARAMS = ("task", "T", "fraction", "method", "seed")
METRICS = ("accuracy", "state_fraction")
TIMINGS = ()

TASKS = ("associative", "positional")
#: Methods without a size parameter (``fraction`` 0 in the grid).
UNSIZED = ("softmax", "linear")

D = 64  #: key dimension
D_V = 32  #: value dimension
BETA = float(np.sqrt(D))  #: inverse temperature of every softmax (OVQ's default sqrt(d))
NOISE = 0.3  #: norm (about) of the noise added to a clean key in each written copy
WRITES = 16  #: tokens per binding: M = T / WRITES
SEGMENTS = 4  #: segments of the positional task
SEGMENT_CODE = 0.5  #: weight of the segment code: C = unit(K_p + 0.5 E_s)
QUERIES = 512  #: most scored positions per sequence
CHUNK = 64  #: chunk size of OVQ, VQ and the scans
KMEANS_ITERS = 5  #: Lloyd steps of VQ's codebook
KMEANS_POINTS = 4  #: VQ's codebook is fitted to the first KMEANS_POINTS * N keys of the other sequence
EM_STEPS = 3  #: EM steps of GMA's mixture
EM_BLOCK_ROWS = 512  #: keys per block of the streamed EM (a block's responsibilities: 512 K floats)
REG_COVAR = 1e-4  #: added to every EM variance (keeps a component of one key from collapsing)
CONSTANT_RATE = 0.1  #: learning rate of the ablation ``ovq_constant_rate``

FRACTION = 1 / 8  #: N / T of the length sweep
T_SWEEP = (1024, 4096, 16384, 65536)
FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4)
T_FRACTIONS = 4096  #: T of the state sweep
GMA_MAX_T = 65536  #: the longest T at which GMA runs (every T of the sweep)
QUICK = {"T_SWEEP": (256, 512), "FRACTIONS": (1 / 16, 1 / 4), "T_FRACTIONS": 512, "GMA_MAX_T": 512}

#: OVQ and its ablations: the keyword arguments of :func:`refimpl.ovq.ovq_attention` each one sets.
OVQ_VARIANTS = {
    "ovq": {},
    "ovq_random_init": {"init": "random"},
    "ovq_linear_growth": {"growth": "linear"},
    "ovq_constant_rate": {"learning_rate": CONSTANT_RATE},
    "ovq_no_count_bias": {"count_bias": False},
}
METHODS = UNSIZED + ("vq",) + tuple(OVQ_VARIANTS) + ("gma",)

_TASK_ID = {name: i for i, name in enumerate(TASKS)}


# ---------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------


def _configurations(quick: bool) -> list[tuple]:
    """``(task, T, fraction, method)`` of the grid, largest ``T`` first (the long points start first)."""
    sizes = QUICK if quick else {"T_SWEEP": T_SWEEP, "FRACTIONS": FRACTIONS, "T_FRACTIONS": T_FRACTIONS,
                                 "GMA_MAX_T": GMA_MAX_T}
    pairs = [(T, FRACTION) for T in sizes["T_SWEEP"]]
    pairs += [(sizes["T_FRACTIONS"], f) for f in sizes["FRACTIONS"] if (sizes["T_FRACTIONS"], f) not in pairs]
    pairs.sort(key=lambda p: (-p[0], p[1]))
    configs = []
    for task in TASKS:
        for T in sorted({T for T, _ in pairs}, reverse=True):
            configs += [(task, T, 0.0, method) for method in UNSIZED]
            for T_f, f in pairs:
                if T_f == T:
                    configs += [(task, T, f, m) for m in METHODS[len(UNSIZED):] if m != "gma" or T <= sizes["GMA_MAX_T"]]
    return configs


def grid(quick: bool, seeds: int) -> list[dict]:
    """The points: the length sweep and the state sweep, for both tasks, ``seeds`` seeds each.

    Parameters
    ----------
    quick : bool
        The small grid (``T <= 512``, seconds in all).
    seeds : int
        Seeds ``0 .. seeds - 1`` per configuration.

    Returns
    -------
    list of dict
        Keys :data:`PARAMS`; ``fraction`` is 0 for ``softmax`` and ``linear``.
    """
    return [{"task": task, "T": T, "fraction": f, "method": m, "seed": s}
            for task, T, f, m in _configurations(quick) for s in range(seeds)]


# ---------------------------------------------------------------------------
# The tasks
# ---------------------------------------------------------------------------


def _noisy_copies(clean, rng):
    # k = unit(C + sigma g / sqrt(d)): noise of norm about sigma
    return unit_rows(clean + NOISE * rng.normal(size=clean.shape) / np.sqrt(clean.shape[1]))


def make_task(task: str, T: int, seed: int) -> dict:
    """One sequence of the recall task (module docstring).

    Parameters
    ----------
    task : {"associative", "positional"}
    T : int
        Sequence length, a multiple of ``2 * SEGMENTS * WRITES`` (>= 128).
    seed : int
        The sequence is a function of ``(task, T, seed)`` only.

    Returns
    -------
    dict
        ``q``, ``k`` (T, d): queries (the clean key asked for at scored
        positions, the token's own key elsewhere) and keys; ``v`` (T, d_v);
        ``values`` (M, d_v) and ``clean`` (M, d): the bindings; ``written``
        (T,): the binding each token writes; ``rows`` (Q,): the scored
        positions, ascending; ``targets`` (Q,): the binding each asks for;
        ``segment`` (M,): the segment of each binding (0 in the associative
        task); ``base`` (M,): its base key (the binding itself in the
        associative task).
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if T < 2 * SEGMENTS * WRITES or T % (2 * SEGMENTS * WRITES):
        raise ValueError(f"T: expected a multiple of {2 * SEGMENTS * WRITES}, got {T}")
    rng = np.random.default_rng([seed, _TASK_ID[task], T])
    M = T // WRITES
    t = np.arange(T)
    if task == "associative":
        clean = unit_rows(rng.normal(size=(M, D)))
        segment, base = np.zeros(M, dtype=np.int64), np.arange(M)
        written = rng.integers(0, M, size=T)
        window = np.arange(T // 2, T)
    else:
        P, length = M // SEGMENTS, T // SEGMENTS
        base_keys, codes = unit_rows(rng.normal(size=(P, D))), unit_rows(rng.normal(size=(SEGMENTS, D)))
        # binding b = s P + p: base key p in segment s, C_b = unit(K_p + gamma E_s)
        segment, base = np.repeat(np.arange(SEGMENTS), P), np.tile(np.arange(P), SEGMENTS)
        clean = unit_rows(base_keys[base] + SEGMENT_CODE * codes[segment])
        written = (t // length) * P + rng.integers(0, P, size=T)
        window = np.arange(T - length // 2, T)
    values = unit_rows(rng.normal(size=(M, D_V)))
    k = _noisy_copies(clean[written], rng)
    first = np.full(M, T)
    np.minimum.at(first, written, t)  # first position that writes each binding
    rows = np.sort(rng.choice(window, size=min(QUERIES, window.size), replace=False))
    targets = np.empty(rows.size, dtype=np.int64)
    for i, row in enumerate(rows):
        # a binding written before the query, not the one the query's token writes, in the query's segment
        allowed = (first < row) & (np.arange(M) != written[row]) & (segment == segment[written[row]])
        candidates = np.flatnonzero(allowed)
        targets[i] = candidates[rng.integers(candidates.size)]
    q = k.copy()
    q[rows] = clean[targets]
    return {"q": q, "k": k, "v": values[written], "values": values, "clean": clean, "written": written,
            "rows": rows, "targets": targets, "segment": segment, "base": base}


def accuracy(out, values, targets) -> float:
    """Fraction of outputs whose nearest value is the right one.

    Parameters
    ----------
    out : ndarray, shape (Q, d_v)
        Outputs at the scored positions.
    values : ndarray, shape (M, d_v)
        The bindings' values, unit rows.
    targets : ndarray of int, shape (Q,)

    Returns
    -------
    float
    """
    # unit values: argmin_b ||o - V_b||^2 = argmax_b o . V_b
    return float(np.mean(np.argmax(out @ values.T, axis=1) == targets))


# ---------------------------------------------------------------------------
# The methods
# ---------------------------------------------------------------------------


def causal_softmax_rows(q, k, v, rows, *, beta, block: int = 64):
    """Causal softmax attention at the query positions ``rows`` only, a block of rows at a time.

    Parameters
    ----------
    q : ndarray, shape (T, d)
    k : ndarray, shape (T, d)
    v : ndarray, shape (T, d_v)
    rows : ndarray of int, shape (R,)
        Query positions (any order).
    beta : float
        Scale of the dot products.
    block : int, default 64
        Query rows per block: memory ``O(block * T)``.

    Returns
    -------
    ndarray, shape (R, d_v)
        ``o_i = sum_{j <= i} softmax_j(beta q_i . k_j) v_j`` for ``i`` in
        ``rows``; equals ``softmax_attention(q, k, v, scale=beta,
        causal=True)[rows]`` to rounding.
    """
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((rows.size, v.shape[1]))
    for lo in range(0, rows.size, block):
        r = rows[lo : lo + block]
        stop = int(r.max()) + 1  # no row of the block reads a key after its last row
        logits = beta * (q[r] @ k[:stop].T)
        # causal: row i reads the keys j <= i only
        logits[np.arange(stop)[None, :] > r[:, None]] = -np.inf
        # softmax with the row maximum subtracted, in place (refimpl.tuned)
        out[lo : lo + block] = softmax_rows(logits) @ v[:stop]
    return out


def spherical_kmeans(x, codes, n_iter: int, *, block: int = 4096):
    """Lloyd steps with assignment by largest dot product and unit-normalised means.

    Parameters
    ----------
    x : ndarray, shape (n, d)
        Unit rows.
    codes : ndarray, shape (S, d)
        Starting codes.
    n_iter : int
    block : int, default 4096
        Rows of ``x`` per assignment block (memory ``O(block * S)``).

    Returns
    -------
    ndarray, shape (S, d)
        Unit codes; a code that wins no row stays where it was.
    """
    codes = codes.copy()
    for _ in range(n_iter):
        # z_i = argmax_m x_i . D[m], the rule VQ attention assigns keys by
        z = np.concatenate([np.argmax(x[s : s + block] @ codes.T, axis=1) for s in range(0, x.shape[0], block)])
        sums = np.zeros_like(codes)
        np.add.at(sums, z, x)
        won = np.bincount(z, minlength=codes.shape[0]) > 0
        # D[m] = unit(mean of its members)
        codes[won] = unit_rows(sums[won])
    return codes


def _fit_gmm(x, K, rng, posterior=None):
    """Diagonal GMM of ``K`` components fitted to ``x`` (n, d) by :data:`EM_STEPS` exact EM steps, streamed.

    ``posterior`` is the E-step's kernel (:func:`refimpl.tuned.streamed_em_step`;
    ``None``: :func:`refimpl.tuned.posterior`).
    """
    means = x[rng.choice(x.shape[0], size=K, replace=False)]
    variances = np.tile(x.var(axis=0), (K, 1))
    weights = np.full(K, 1.0 / K)
    for _ in range(EM_STEPS):
        means, variances, weights = streamed_em_step(x, means, variances, weights, reg_covar=REG_COVAR,
                                                     block_rows=EM_BLOCK_ROWS, posterior=posterior)
    return means, variances, weights


def _em_posterior(kern):
    """The responsibilities of the E-step under backend ``kern``: the Numba kernel under numba, else NumPy's."""
    if kern.name == "numba":
        from cpu.gmm import posterior

        return posterior
    return None


def _state_fraction(method, T, N):
    """Floats the method keeps, over the KV cache's ``T (d + d_v)``."""
    kv = T * (D + D_V)
    if method == "softmax":
        return 1.0
    if method == "linear":
        return D * (D_V + 1) / kv  # S = sum phi(k) v^T and z = sum phi(k)
    if method == "gma":
        return N * (2 * D + 1 + D_V + 1) / kv  # means, variances, weights; sum gamma v^T and sum gamma
    return N * (D + D_V + 1) / kv  # VQ: codes, value means, counts; OVQ: D_k, D_v, counts


def run_point(point: dict) -> dict:
    """Accuracy and state fraction of one method on one sequence.

    Parameters
    ----------
    point : dict
        ``task``, ``T``, ``fraction``, ``method``, ``seed`` (a point of :func:`grid`).

    Returns
    -------
    dict
        ``accuracy`` (in [0, 1]) and ``state_fraction``; a function of the
        point only (one BLAS thread, seeds from the point).
    """
    task, T, method, seed = point["task"], int(point["T"]), point["method"], int(point["seed"])
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    N = int(round(float(point["fraction"]) * T))
    kern = backend.kernels()  # GMA, VQ and OVQ from numba's kernels or NumPy (app.backend)
    with threadpool_limits(limits=1):
        data = make_task(task, T, seed)
        q, k, v, rows = data["q"], data["k"], data["v"], data["rows"]
        if method == "softmax":
            out = causal_softmax_rows(q, k, v, rows, beta=BETA)
        elif method == "linear":
            out = linear_attention(q, k, v, causal=True, chunk_size=CHUNK)[rows]
        elif method == "vq":
            # codebook from another sequence of the same generator (its own bindings)
            held_out = make_task(task, T, seed + 1_000_003)["k"][: KMEANS_POINTS * N]
            codebook = spherical_kmeans(held_out, held_out[:N], KMEANS_ITERS)
            out = kern.vq_attention(q, k, v, codebook, chunk_size=CHUNK, beta=BETA)[rows]
        elif method == "gma":
            means, variances, weights = _fit_gmm(k, N, np.random.default_rng([seed, _TASK_ID[task], T, 2]),
                                                 _em_posterior(kern))
            out = kern.gma(q, k, v, means, variances, weights, causal=True, chunk_size=CHUNK)[rows]
        else:
            out = kern.ovq_attention(q, k, v, max_size=N, chunk_size=CHUNK, beta=BETA, seed=seed,
                                **OVQ_VARIANTS[method])[rows]
        acc = accuracy(out, data["values"], data["targets"])
    return {"accuracy": acc, "state_fraction": _state_fraction(method, T, N)}


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def _summary(rows):
    """``{(task, T, fraction, method): (mean, std, seeds)}`` of the accuracy over seeds."""
    groups = {}
    for r in rows:
        groups.setdefault((r["task"], int(r["T"]), float(r["fraction"]), r["method"]), []).append(r["accuracy"])
    return {key: (float(np.mean(a)), float(np.std(a)), len(a)) for key, a in groups.items()}


def table(rows) -> str:
    """Mean and std over seeds of the accuracy: one line per (task, T, fraction), one column per method.

    ``softmax`` and ``linear`` (no size parameter) are repeated on every line
    of their ``(task, T)``; ``-`` marks a method not run there.
    """
    summary = _summary(rows)
    seeds = max((n for _, _, n in summary.values()), default=0)
    lines = [f"recall accuracy, mean ± std over {seeds} seed(s); fraction = N / T of the sized methods"]
    header = f"{'task':11s} {'T':>6s} {'fraction':>8s} | " + " ".join(f"{m:>17s}" for m in METHODS)
    lines += [header, "-" * len(header)]
    lines_keys = sorted({(t, T, f) for t, T, f, _ in summary if f > 0}, key=lambda x: (TASKS.index(x[0]), x[2], x[1]))
    for task, T, f in lines_keys:
        cells = []
        for m in METHODS:
            key = (task, T, 0.0, m) if m in UNSIZED else (task, T, f, m)
            cells.append(f"{summary[key][0]:.3f} ± {summary[key][1]:.3f}" if key in summary else "-")
        lines.append(f"{task:11s} {T:6d} {f:8.4f} | " + " ".join(f"{c:>17s}" for c in cells))
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Accuracy against ``T`` (log axis) and against the state fraction, one row of two panels per task.

    Error bars: std over seeds.  ``softmax`` and ``linear`` appear in the
    fraction panel as horizontal lines (their state does not depend on it).
    """
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend or open figure is touched

    summary = _summary(rows)
    tasks = [t for t in TASKS if any(key[0] == t for key in summary)]
    fig = Figure(figsize=(12, 4.2 * len(tasks)))
    axes = fig.subplots(len(tasks), 2, squeeze=False)
    colors = dict(zip(METHODS, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"] * 2))
    styles = {"softmax": "s--", "linear": "o:"}
    for (ax_t, ax_f), task in zip(axes, tasks):
        keys = [key for key in summary if key[0] == task]
        sized = sorted({f for _, _, f, _ in keys if f > 0})
        f_sweep = max(sized, key=lambda f: len({T for _, T, g, _ in keys if g == f})) if sized else 0.0
        T_frac = max(({T for _, T, f, _ in keys if f > 0 and f != f_sweep} or {0}))
        for m in METHODS:
            fr = 0.0 if m in UNSIZED else f_sweep
            pts = sorted((T, *summary[key][:2]) for key in keys for T in [key[1]] if key[2] == fr and key[3] == m)
            if pts:
                T_, mean, std = np.array(pts).T
                ax_t.errorbar(T_, mean, yerr=std, fmt=styles.get(m, "o-"), color="k" if m == "softmax" else colors[m], label=m, capsize=3, ms=5)
            if m in UNSIZED:
                if (task, T_frac, 0.0, m) in summary:
                    mean, std, _ = summary[(task, T_frac, 0.0, m)]
                    ax_f.axhline(mean, ls=styles[m].lstrip("so"), color=colors[m] if m != "softmax" else "k", label=m)
                continue
            pts = sorted((f, *summary[key][:2]) for key in keys for f in [key[2]] if key[1] == T_frac and key[3] == m
                         and f > 0)
            if pts:
                f_, mean, std = np.array(pts).T
                ax_f.errorbar(100 * f_, mean, yerr=std, fmt="o-", color=colors[m], label=m, capsize=3, ms=5)
        ax_t.set(xscale="log", xlabel="sequence length $T$", ylabel="recall accuracy", ylim=(-0.02, 1.05),
                 title=f"{task}: accuracy vs $T$ (N = {100 * f_sweep:.1f}% of $T$)")
        ax_f.set(xscale="log", xlabel="state size N as % of the KV cache ($N / T$)", ylabel="recall accuracy",
                 ylim=(-0.02, 1.05), title=f"{task}: accuracy vs state, $T$ = {T_frac}")
        T_ticks = sorted({key[1] for key in keys})
        ax_t.set_xticks(T_ticks, [str(T) for T in T_ticks])
        ax_f.set_xticks([100 * f for f in sized], [f"{100 * f:.3g}" for f in sized])
        for ax in (ax_t, ax_f):
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        ax_f.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
