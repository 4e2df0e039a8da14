r"""Why OVQ trails full attention on positional recall: ablations and what the read-out is made of.

``python -m app experiment positional [--quick] [--seeds N] [--jobs J | --scheduler S]``

The question
------------
On the positional task of :mod:`~app.experiments.recall`, OVQ recalls
0.65-0.74 where full attention recalls 0.93-0.96, and without its count
bias it falls from 0.87 at ``T = 1024`` to 0.28 at ``T = 65,536``.  The task
asks for the *most recent* value of a base key: the same base key was bound
to other values in the three earlier segments, with keys of cosine about 0.8
to the query.  This experiment runs the task's sequences through OVQ with
one switch changed at a time, and splits each output into what it takes
from the right value and from the older values of the same base key.

The variants
------------
All at ``max_size = N = T / 8``, chunks of 64, ``beta = sqrt(d)``, library
defaults unless named:

* ``ovq``: the defaults (plateau growth, spread seeding, count bias,
  adaptive rate ``1/c``);
* ``last_segment_only``: the same sequence with its first three segments
  cut off (the query positions shifted): no earlier binding of the base key
  exists, so nothing can be blended;
* ``capacity_x2``, ``capacity_x4``: ``N = T/4`` and ``T/2``;
* ``random_init``: ``init="random"`` (the spread seeding is not the cause if
  this changes nothing);
* ``rate_0.1``, ``rate_0.3``: a constant step, ``D += eta (x - D)``: an
  exponential moving average that weighs recent tokens more;
* ``no_count_bias``, ``no_count_bias_random_init``: ``count_bias=False``,
  with either seeding.

The decomposition
-----------------
For a scored query asking for binding ``y`` of base key ``p``, the output
is fitted by least squares on the right value and the three older values of
``p``: ``o ~ a V_y + sum_s b_s V_{(p, s)}``.  ``target_weight`` is the mean
``a``, ``older_weight`` the mean ``sum_s b_s``, ``output_norm`` the mean
``|o|`` (the values have unit norm; what is neither is spread over other
bindings).  A running mean over all the tokens a centroid has absorbed gives
``a`` about the share of the right binding's tokens in the centroid.
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl.ovq import ovq_attention
from . import recall

__all__ = ["NAME", "PARAMS", "METRICS", "TIMINGS", "VARIANTS", "grid", "run_point", "decompose", "table", "plot"]

NAME = "positional"
PARAMS = ("T", "variant", "seed")
METRICS = ("accuracy", "target_weight", "older_weight", "output_norm")
TIMINGS = ()

T_SWEEP = (1024, 4096, 16384, 65536)
QUICK_T = (256, 512)
FRACTION = recall.FRACTION  #: N / T of every variant but the capacity ones

#: variant: (keyword arguments of ovq_attention, capacity factor over N = T / 8, keep only the last segment)
VARIANTS = {
    "ovq": ({}, 1, False),
    "last_segment_only": ({}, 1, True),
    "capacity_x2": ({}, 2, False),
    "capacity_x4": ({}, 4, False),
    "random_init": ({"init": "random"}, 1, False),
    "rate_0.1": ({"learning_rate": 0.1}, 1, False),
    "rate_0.3": ({"learning_rate": 0.3}, 1, False),
    "no_count_bias": ({"count_bias": False}, 1, False),
    "no_count_bias_random_init": ({"count_bias": False, "init": "random"}, 1, False),
}


def grid(quick: bool, seeds: int) -> list[dict]:
    """Every variant at every ``T``, largest ``T`` first, ``seeds`` seeds each."""
    sizes = QUICK_T if quick else T_SWEEP
    return [{"T": T, "variant": v, "seed": s} for T in sorted(sizes, reverse=True) for v in VARIANTS for s in range(seeds)]


def decompose(out, task) -> tuple[float, float]:
    """Mean ``(a, sum_s b_s)`` of the least-squares fits ``o ~ a V_y + sum_s b_s V_(p, s)`` (module docstring).

    Parameters
    ----------
    out : ndarray, shape (Q, d_v)
        Outputs at the scored positions.
    task : dict
        A positional task of :func:`app.experiments.recall.make_task`.

    Returns
    -------
    (float, float)
    """
    P = task["values"].shape[0] // recall.SEGMENTS
    a, b = [], []
    for o, y in zip(out, task["targets"]):
        older = [s * P + task["base"][y] for s in range(recall.SEGMENTS) if s * P + task["base"][y] != y]
        basis = task["values"][[y] + older].T  # (d_v, SEGMENTS): the right value first
        coef = np.linalg.lstsq(basis, o, rcond=None)[0]
        a.append(coef[0])
        b.append(coef[1:].sum())
    return float(np.mean(a)), float(np.mean(b))


def run_point(point: dict) -> dict:
    """Accuracy and decomposition of one OVQ variant on one positional sequence."""
    T, variant, seed = int(point["T"]), point["variant"], int(point["seed"])
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {tuple(VARIANTS)}, got {variant!r}")
    options, capacity, last_only = VARIANTS[variant]
    with threadpool_limits(limits=1):
        task = recall.make_task("positional", T, seed)
        start = T - T // recall.SEGMENTS if last_only else 0
        q, k, v = task["q"][start:], task["k"][start:], task["v"][start:]
        N = int(round(FRACTION * T)) * capacity
        out = ovq_attention(q, k, v, max_size=N, chunk_size=recall.CHUNK, beta=recall.BETA, seed=seed,
                            **options)[task["rows"] - start]
        target, older = decompose(out, task)
        acc = recall.accuracy(out, task["values"], task["targets"])
    return {"accuracy": acc, "target_weight": target, "older_weight": older,
            "output_norm": float(np.mean(np.linalg.norm(out, axis=1)))}


def _summary(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], int(r["T"])), []).append(r)
    return {key: {m: (float(np.mean([r[m] for r in g])), float(np.std([r[m] for r in g]))) for m in METRICS} | {"seeds": len(g)}
            for key, g in groups.items()}


def table(rows) -> str:
    """Per variant and ``T``: accuracy, the right value's weight, the older values' weight, ``|o|``."""
    s = _summary(rows)
    seeds = max((v["seeds"] for v in s.values()), default=0)
    lines = [f"positional recall of OVQ variants, mean ± std over {seeds} seed(s); o ~ a V_right + b (older values of "
             "the same base key)"]
    header = f"{'variant':26s} {'T':>6s} | {'accuracy':>15s} {'a (right)':>15s} {'b (older)':>15s} {'|o|':>15s}"
    lines += [header, "-" * len(header)]
    for variant in VARIANTS:
        for T in sorted({T for v, T in s if v == variant}):
            cells = " ".join(f"{s[(variant, T)][m][0]:.3f} ± {s[(variant, T)][m][1]:.3f}".rjust(15) for m in METRICS)
            lines.append(f"{variant:26s} {T:6d} | {cells}")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Accuracy, the right value's weight and the older values' weight against ``T``, one line per variant."""
    import matplotlib
    from matplotlib.figure import Figure

    s = _summary(rows)
    colors = dict(zip(VARIANTS, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for ax, metric, label in zip(axes, ("accuracy", "target_weight", "older_weight"),
                                 ("recall accuracy", "a: weight of the right value", "b: weight of the older values")):
        for variant in VARIANTS:
            pts = sorted((T, *s[(v, T)][metric]) for v, T in s if v == variant)
            if pts:
                T_, mean, std = np.array(pts).T
                ax.errorbar(T_, mean, yerr=std, fmt="o-", color=colors[variant], label=variant, capsize=3, ms=4)
        ticks = sorted({T for _, T in s})
        ax.set(xscale="log", xlabel="sequence length $T$", ylabel=label, title=label)
        ax.set_xticks(ticks, [str(T) for T in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
