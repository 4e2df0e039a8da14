"""Scaling: time and peak memory against the sequence length N, linear-time methods against softmax attention.

The claim checked: GMA (bidirectional and causal), OVQ attention and linear
attention cost time and memory proportional to N, dense softmax attention
proportional to N^2.  Each grid point runs one method at one N, in one
direction:

* ``forward``: the ``*_forward`` function alone (it keeps the cache that the
  backward needs, as training does);
* ``backward``: forward and backward together, ``*_backward`` given a fixed
  random ``dL/d out``; its peak memory is that of the whole training step,
  cache included.

Sizes: d = d_v = 64 (``d_r = 64`` for GMA), K = 64 Gaussian components,
float64, inputs standard normal from the point's seed.  OVQ runs with the
fixed ``max_size = 256`` centroids and ``chunk_size = 64``; linear attention
and GMA with their default chunk size 64.  Softmax attention forms the
N x N attention matrix, so it runs only up to :data:`SOFTMAX_MAX_N` (its
forward + backward peaks at 1.5 GiB there).  Causal softmax attention costs
what the bidirectional one costs here (the same dense matrix, masked), and
linear attention's causal scan what its bidirectional sums cost, so these
two run bidirectionally only; OVQ is causal by construction.

Measured per point:

* ``time_s``: the best of up to :data:`REPEATS` calls (``time.perf_counter``,
  no tracing active, the garbage collector paused; calls stop early once
  :data:`TIME_BUDGET_S` seconds are spent, so that the slowest points run
  once or twice).  Wall-clock, so it varies run to run (declared in
  :data:`TIMINGS`); the table keeps the best over seeds.
* ``peak_mib``: the peak that ``tracemalloc`` reports during one call, inputs
  excluded (they are created before tracing starts; NumPy reports its array
  buffers to ``tracemalloc``).  The call is measured after the timed calls
  (so nothing of a first call is counted) and with the garbage collector
  paused, and rounded to a multiple of :data:`PEAK_UNIT_MIB` (64 KiB): a few
  Python objects served from Python's free lists in one process and from
  the allocator in another move the raw peak by tens of bytes, which the
  rounding hides (short of a peak within those bytes of a rounding
  boundary), so the number is the same in any process and order.

Timing wants the points run one at a time (``--jobs 1``): points run in
parallel share the cores and disturb each other's times; memory is the same
under any ``--jobs``.  Each point is measured with BLAS limited to one
thread (``threadpoolctl``): on a machine shared with other work, a second
BLAS thread that waits for a busy core made calls up to ten times slower at
random, and the fitted time slopes meaningless.

:func:`fit_slope` fits ``log y = a + slope log N`` by least squares over the
:data:`FIT_POINTS` largest sizes of each method, where fixed costs no longer
matter: about 1 for the linear-time methods, about 2 for softmax attention.
"""

from __future__ import annotations

import contextlib
import gc
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl import attention, ovq
# NumPy's kernels whatever app.backend says: tracemalloc sees NumPy's buffers, not those Numba allocates
from refimpl import tuned as gma

__all__ = [
    "NAME", "PARAMS", "METRICS", "TIMINGS", "METHODS", "DIRECTIONS", "SIZES", "QUICK_SIZES", "SOFTMAX_MAX_N",
    "D", "K", "OVQ_MAX_SIZE", "OVQ_CHUNK_SIZE", "PEAK_UNIT_MIB", "REPEATS", "TIME_BUDGET_S", "FIT_POINTS",
    "grid", "run_point", "make_inputs", "method_call", "best_time", "peak_mib", "fit_slope", "slopes", "table", "plot",
]

NAME = "scaling"
PARAMS = ("method", "direction", "n", "seed")
METRICS = ("time_s", "peak_mib")
TIMINGS = ("time_s",)

#: The methods, by the name the grid and the table use.
METHODS = ("gma", "gma_causal", "ovq", "linear", "softmax")
#: ``forward``: the forward alone; ``backward``: forward and backward in one call.
DIRECTIONS = ("forward", "backward")
#: Sequence lengths of the full grid (softmax attention: those up to :data:`SOFTMAX_MAX_N`).
SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
#: Sequence lengths of the ``--quick`` grid.
QUICK_SIZES = (256, 512)
#: The longest sequence softmax attention runs at (its N x N matrices: 1.5 GiB with the backward).
SOFTMAX_MAX_N = 8192

D = 64  #: query, key and value width (d_r = d_v = d)
K = 64  #: GMA's number of Gaussian components
OVQ_MAX_SIZE = 256  #: OVQ's ``max_size`` (most centroids)
OVQ_CHUNK_SIZE = 64  #: OVQ's ``chunk_size``
PEAK_UNIT_MIB = 1 / 16  #: ``peak_mib`` is rounded to a multiple of this (64 KiB)
REPEATS = 3  #: most timed calls per point (the best is kept)
TIME_BUDGET_S = 3.0  #: no further timed call once the calls of a point took this long
FIT_POINTS = 3  #: the largest sizes of each method that the slope is fitted over


def grid(quick: bool, seeds: int) -> list[dict]:
    """Every (method, direction, N, seed), method by method, N ascending.

    Parameters
    ----------
    quick : bool
        :data:`QUICK_SIZES` instead of :data:`SIZES`.
    seeds : int
        Seeds ``0 .. seeds - 1`` per configuration.

    Returns
    -------
    list of dict
        Keys ``method``, ``direction``, ``n``, ``seed``.
    """
    sizes = QUICK_SIZES if quick else SIZES
    return [
        {"method": method, "direction": direction, "n": n, "seed": seed}
        for method in METHODS
        for direction in DIRECTIONS
        for n in sizes
        if method != "softmax" or n <= SOFTMAX_MAX_N
        for seed in range(seeds)
    ]


def make_inputs(n: int, seed: int) -> dict:
    """Standard normal inputs of every method at sequence length ``n``, float64.

    Parameters
    ----------
    n : int
        Sequence length N.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    dict
        ``q``, ``k``, ``v`` and ``grad_out`` of shape (n, D); GMA's ``means``
        and ``raw_variances`` of shape (K, D) and ``logits`` of shape (K,).
    """
    rng = np.random.default_rng(seed)
    return dict(
        q=rng.normal(size=(n, D)),
        k=rng.normal(size=(n, D)),
        v=rng.normal(size=(n, D)),
        grad_out=rng.normal(size=(n, D)),
        means=rng.normal(size=(K, D)),
        raw_variances=rng.normal(size=(K, D)) + 2.0,
        logits=rng.normal(size=K),
    )


def method_call(method: str, direction: str, inputs: dict):
    """A function of no argument that runs ``method`` once in ``direction`` on ``inputs``.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    direction : str
        One of :data:`DIRECTIONS`.
    inputs : dict
        From :func:`make_inputs`.

    Returns
    -------
    callable
        Returns nothing; what the call computes is dropped when it returns.
    """
    q, k, v, g = inputs["q"], inputs["k"], inputs["v"], inputs["grad_out"]
    forward, backward = {
        "gma": (lambda: gma.gma_forward(q, k, v, inputs["means"], inputs["raw_variances"], inputs["logits"]), gma.gma_backward),
        "gma_causal": (
            lambda: gma.gma_forward(q, k, v, inputs["means"], inputs["raw_variances"], inputs["logits"], causal=True),
            gma.gma_backward,
        ),
        "ovq": (
            lambda: ovq.ovq_attention_forward(q, k, v, max_size=OVQ_MAX_SIZE, chunk_size=OVQ_CHUNK_SIZE),
            ovq.ovq_attention_backward,
        ),
        "linear": (lambda: attention.linear_attention_forward(q, k, v), attention.linear_attention_backward),
        "softmax": (lambda: attention.softmax_attention_forward(q, k, v), attention.softmax_attention_backward),
    }[method]

    def call():
        out, cache = forward()
        if direction == "backward":
            backward(g, cache)

    return call


@contextlib.contextmanager
def _collector_paused():
    """The garbage collector off inside the block (as :mod:`timeit` times), back as it was after.

    No ``gc.collect()`` before: in a long-lived process (a test session, a
    notebook) a full collection walks every object the process holds and
    costs more than the call it would precede.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def best_time(fn, repeats: int = REPEATS, budget: float = TIME_BUDGET_S) -> float:
    """The shortest wall-clock time of up to ``repeats`` calls of ``fn``, in seconds.

    At least one call; no further call once the calls so far took ``budget``
    seconds together.  The garbage collector is paused during the calls, so
    that no collection lands inside a timed call.
    """
    times = []
    with _collector_paused():
        while len(times) < max(repeats, 1) and sum(times) < budget:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times)


def peak_mib(fn) -> float:
    """The ``tracemalloc`` peak during one call of ``fn``, in MiB (2**20 bytes).

    What exists before the call (the inputs) is not counted.  The garbage
    collector is paused during the call, so that the peak does not depend on
    when a collection happens to run.
    """
    with _collector_paused():
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()


def run_point(point: dict) -> dict:
    """Time and peak memory of one method at one N, in one direction.

    Parameters
    ----------
    point : dict
        ``method``, ``direction``, ``n``, ``seed`` (a point of :func:`grid`).

    Returns
    -------
    dict
        ``time_s`` (best of the timed calls, seconds) and ``peak_mib``
        (``tracemalloc`` peak of one call, MiB, rounded to a multiple of
        :data:`PEAK_UNIT_MIB`).
    """
    inputs = make_inputs(int(point["n"]), int(point["seed"]))
    call = method_call(point["method"], point["direction"], inputs)
    # one BLAS thread: on a shared machine a second thread that waits for a busy core slows a call at random
    with threadpool_limits(limits=1, user_api="blas"):
        seconds = best_time(call)
        peak = round(peak_mib(call) / PEAK_UNIT_MIB) * PEAK_UNIT_MIB
    return {"time_s": seconds, "peak_mib": peak}


def fit_slope(n, y, last: int = FIT_POINTS) -> float:
    """Least-squares slope of ``log y`` against ``log n`` over the ``last`` largest ``n``.

    Parameters
    ----------
    n : array_like, shape (M,)
        Sizes (> 0), any order.
    y : array_like, shape (M,)
        Values at those sizes (> 0).
    last : int, default FIT_POINTS
        How many of the largest sizes to fit (all of them if fewer; at least 2 needed).

    Returns
    -------
    float
        The exponent ``p`` of ``y ~ c n^p``; ``nan`` with fewer than 2 sizes.
    """
    n = np.asarray(n, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    order = np.argsort(n)[-last:]
    if order.size < 2:
        return float("nan")
    return float(np.polyfit(np.log(n[order]), np.log(y[order]), 1)[0])


def _curves(rows):
    """``{(method, direction): (n, best time, peak memory)}``: per N, the best time and the largest peak over seeds."""
    best = {}
    for row in rows:
        key = (row["method"], row["direction"], int(row["n"]))
        t, m = best.get(key, (np.inf, 0.0))
        best[key] = (min(t, float(row["time_s"])), max(m, float(row["peak_mib"])))
    curves = {}
    for (method, direction, n), (t, m) in sorted(best.items(), key=lambda item: item[0][2]):
        curves.setdefault((method, direction), ([], [], []))
        for column, value in zip(curves[method, direction], (n, t, m)):
            column.append(value)
    return {key: tuple(np.asarray(c) for c in columns) for key, columns in curves.items()}


def slopes(rows) -> dict:
    """``{(method, direction): (time slope, memory slope)}`` of :func:`fit_slope` over the finished rows."""
    return {key: (fit_slope(n, t), fit_slope(n, m)) for key, (n, t, m) in _curves(rows).items()}


def _ordered(keys):
    rank = {(m, d): (i, j) for i, m in enumerate(METHODS) for j, d in enumerate(DIRECTIONS)}
    return sorted(keys, key=lambda key: rank.get(key, (len(METHODS), 0)))


def table(rows) -> str:
    """Two tables in Markdown: time and peak memory at every N, and the fitted slopes.

    Times are the best over seeds, memory the largest peak over seeds (the
    same for every seed).  ``backward`` means forward and backward together.
    """
    curves = _curves(rows)
    fitted = slopes(rows)
    lines = [
        "| method | direction | N | time (s) | peak memory (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for key in _ordered(curves):
        for n, t, m in zip(*curves[key]):
            lines.append(f"| {key[0]} | {key[1]} | {n} | {t:.4g} | {m:.4g} |")
    lines += [
        "",
        f"Slopes of log time and log peak memory against log N, fitted over the {FIT_POINTS} largest sizes of each method",
        "(1: linear, 2: quadratic):",
        "",
        "| method | direction | N fitted | time slope | memory slope |",
        "|---|---|---|---:|---:|",
    ]
    for key in _ordered(curves):
        n = curves[key][0][-FIT_POINTS:]
        lines.append(f"| {key[0]} | {key[1]} | {n[0]}-{n[-1]} | {fitted[key][0]:.2f} | {fitted[key][1]:.2f} |")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """A 2 x 2 figure on log-log axes: time and peak memory (columns) of the forward and of forward + backward (rows).

    Each method's legend entry gives its fitted slope.  Written to ``path``.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or open figure is touched

    curves = _curves(rows)
    fitted = slopes(rows)
    fig = Figure(figsize=(11, 8.5), constrained_layout=True)
    axes = fig.subplots(2, 2)
    markers = dict(zip(METHODS, "osD^v"))
    for i, direction in enumerate(DIRECTIONS):
        for j, (label, column) in enumerate((("time (s)", 1), ("peak memory (MiB)", 2))):
            ax = axes[i, j]
            for method, d in _ordered(k for k in curves if k[1] == direction):
                n, values = curves[method, d][0], curves[method, d][column]
                ax.loglog(n, values, marker=markers.get(method, "x"), label=f"{method} (slope {fitted[method, d][column - 1]:.2f})")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(label)
            ax.set_title(f"{'forward' if direction == 'forward' else 'forward + backward'}: {label.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Scaling with N (d = {D}, K = {K}, float64; slopes over the {FIT_POINTS} largest N of each method)")
    fig.savefig(path, dpi=110)
