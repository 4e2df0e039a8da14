r"""Continual recall without training: does OVQ's sparse clustering forget less than dense state updates?

``python -m app experiment continual [--quick] [--seeds N] [--jobs J | --scheduler S]``

The claim checked
-----------------
OVQ's discussion argues that its sparse online clustering (each token moves
only the centroid it is assigned to) should resist catastrophic forgetting
better than the dense state updates of linear attention and SSMs (each
token adds to the whole state).  The claim is stated without a measurement;
this experiment measures it, with nothing trained: every method reads what a
stream of tasks wrote into its memory.

The stream
----------
:data:`N_TASKS` tasks arrive one after the other.  Task ``a`` is a set of
:data:`BINDINGS` key-value bindings whose clean keys come from its own
region of the sphere, a distribution that shifts from task to task:
``C_b = unit(mu_a + SPREAD u_b)``, with ``mu_a`` a random unit centre of task
``a`` and ``u_b`` random unit directions (cosine about 0.7 between a key and
its task's centre, about 0 across tasks).  Values are random unit vectors
(``d_v = 32``).  The task's phase is :data:`WRITES` ``x BINDINGS`` tokens,
each writing one of its bindings (drawn uniformly) with a noisy key
``unit(C_b + 0.3 g / sqrt(d))``, as in :mod:`~app.experiments.recall`.
After the phase of task ``a`` the memory is read, without writing, with the
clean keys of every task ``b <= a``; the answer is right when the output's
nearest value among the values of all tasks seen so far is the binding's own.
The metric ``after{a}_task{b}`` is that accuracy: row ``a`` of the recall
matrix ``R``.

The methods, at equal state
---------------------------
``budget`` is the dictionary size ``N`` of OVQ and VQ, whose state is
``N (d + d_v + 1)`` floats (keys, values, counts).  The linear-attention
variants get the same number of floats through their feature dimension
``m = round(N (d + d_v + 1) / (d_v + 1))``, with features of a fixed random
projection ``P`` (``m x d``, entries ``N(0, 1/d)``) of the unit key:

* ``linear``: ``phi(x) = elu(P x) + 1``, ``S += phi(k) v^T``, ``z += phi(k)``,
  read ``S^T phi(q) / (z^T phi(q))``;
* ``linear_decay``: the same with ``S <- gamma S + phi(k) v^T`` (and ``z``),
  ``gamma = 1 - 1 / (tokens of a phase)``: a memory horizon of one task;
* ``delta``: the delta rule (DeltaNet) on ``phi(x) = unit(P x)``:
  ``W <- W + phi(k) (v - W^T phi(k))^T``, read ``W^T phi(q)``; its state is
  ``m d_v`` floats, a little under the others';
* ``vq``: VQ attention's static codebook of ``N`` codes, fitted by
  spherical k-means to a held-out sample of the *first* task (the only one
  known when the stream starts), with a value mean and a count per code,
  read ``sum_m softmax(beta q . c_m + log n_m) vbar_m``;
* ``ovq``: :func:`refimpl.ovq.ovq_attention`, library defaults
  (``max_size = N``, plateau growth, spread initialisation, count bias,
  adaptive rate), fed the stream phase by phase through its state, and read
  from its dictionaries like VQ (the GMR read-out of the derivation);
  ``ovq_linear_growth`` the same with ``growth="linear"`` (the dictionary
  is full after ``N`` tokens, then every key updates an existing centroid);
* ``softmax``: full attention over every token so far, the upper bound; it
  keeps everything (``budget`` 0).

The grid and the summary
------------------------
``budget`` in :data:`BUDGETS` for the sized methods, seeds ``0 ..
seeds - 1``; every method at one seed reads the same stream.  The table gives,
per method and budget, the final mean recall of the earlier tasks
(``R[last, b]``, ``b < last``), the recall of the newest task, and the
forgetting ``mean_b (max_a R[a, b] - R[last, b])`` (how much of what a task
once reached it has lost by the end).
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl.ovq import ovq_attention, unit_rows
from refimpl.tuned import softmax_rows
from .recall import BETA, CHUNK, D, D_V, KMEANS_ITERS, NOISE, accuracy, spherical_kmeans

__all__ = [
    "NAME", "PARAMS", "METRICS", "TIMINGS", "METHODS", "grid", "run_point", "table", "plot",
    "make_stream", "recall_matrix", "summary",
]

NAME = "continual"
PARAMS = ("tasks", "bindings", "budget", "method", "seed")

N_TASKS = 5  #: tasks in the stream
BINDINGS = 32  #: bindings per task
WRITES = 16  #: tokens per binding in a task's phase
SPREAD = 1.0  #: C_b = unit(mu_a + SPREAD u_b): a task's keys cluster around its centre
BUDGETS = (32, 64, 128)  #: N of OVQ and VQ (the stream holds N_TASKS * BINDINGS = 160 bindings)
QUICK = {"N_TASKS": 3, "BINDINGS": 8, "BUDGETS": (16,)}
KMEANS_SAMPLE = 4  #: VQ's codebook is fitted to KMEANS_SAMPLE * N keys of a held-out copy of the first task

SIZED = ("linear", "linear_decay", "delta", "vq", "ovq", "ovq_linear_growth")
METHODS = ("softmax",) + SIZED
#: after{a}_task{b}: recall of task b after task a's phase, b <= a, for the full stream's tasks (a stream of fewer
#: tasks, the quick grid's, writes 0 for the tasks it does not have); state_floats: the memory's size at the end
METRICS = tuple(f"after{a}_task{b}" for a in range(N_TASKS) for b in range(a + 1)) + ("state_floats",)
TIMINGS = ()


def grid(quick: bool, seeds: int) -> list[dict]:
    """The points: every sized method at every budget, and ``softmax`` (budget 0), ``seeds`` seeds each."""
    n, b, budgets = (QUICK["N_TASKS"], QUICK["BINDINGS"], QUICK["BUDGETS"]) if quick else (N_TASKS, BINDINGS, BUDGETS)
    points = [{"tasks": n, "bindings": b, "budget": 0, "method": "softmax", "seed": s} for s in range(seeds)]
    points += [{"tasks": n, "bindings": b, "budget": N, "method": m, "seed": s}
               for N in budgets for m in SIZED for s in range(seeds)]
    return points


# ---------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------


def make_stream(n_tasks: int, bindings: int, seed: int, *, held_out: bool = False) -> dict:
    """The stream of tasks (module docstring): a function of ``(n_tasks, bindings, seed)``.

    Parameters
    ----------
    n_tasks, bindings : int
        Tasks, and bindings per task.
    seed : int
    held_out : bool, default False
        Another stream of the same tasks: the same centres, clean keys and
        values, other noisy copies and binding order (VQ fits its codebook
        to it).

    Returns
    -------
    dict
        ``k`` (T, d), ``v`` (T, d_v): the tokens, ``T = n_tasks * WRITES *
        bindings``; ``phase`` (T,): the task each token belongs to;
        ``clean`` (n_tasks * bindings, d) and ``values`` (n_tasks * bindings,
        d_v): the bindings, task by task.
    """
    rng = np.random.default_rng([seed, n_tasks, bindings])
    centres = unit_rows(rng.normal(size=(n_tasks, D)))
    task = np.repeat(np.arange(n_tasks), bindings)
    # C_b = unit(mu_a + SPREAD u_b), u_b a random unit direction
    clean = unit_rows(centres[task] + SPREAD * unit_rows(rng.normal(size=(task.size, D))))
    values = unit_rows(rng.normal(size=(task.size, D_V)))
    tokens = np.random.default_rng([seed, n_tasks, bindings, 1 if held_out else 0])
    per_phase = WRITES * bindings
    written = np.concatenate([a * bindings + tokens.integers(0, bindings, size=per_phase) for a in range(n_tasks)])
    # a noisy copy k = unit(C + sigma g / sqrt(d)), as in the recall experiment
    k = unit_rows(clean[written] + NOISE * tokens.normal(size=(written.size, D)) / np.sqrt(D))
    return {"k": k, "v": values[written], "phase": written // bindings, "clean": clean, "values": values}


# ---------------------------------------------------------------------------
# The memories: write a phase, read without writing
# ---------------------------------------------------------------------------


def _features(method, P, x):
    """phi(x) of the linear-attention variants: elu(P x) + 1, or unit(P x) for the delta rule."""
    z = x @ P.T
    if method == "delta":
        return unit_rows(z)
    return np.where(z > 0, z + 1.0, np.exp(np.minimum(z, 0.0)))  # elu(z) + 1


class _Linear:
    """Linear attention, decayed or not, and the delta rule, on features of dimension m."""

    def __init__(self, method, m, rng, gamma):
        self.method, self.gamma = method, gamma
        self.P = rng.normal(size=(m, D)) / np.sqrt(D)
        self.S, self.z = np.zeros((m, D_V)), np.zeros(m)

    def write(self, k, v):
        phi = _features(self.method, self.P, k)
        if self.method == "linear":
            self.S += phi.T @ v
            self.z += phi.sum(axis=0)
            return
        for f, value in zip(phi, v):  # a recurrence: token by token
            if self.method == "delta":
                # W <- W + phi (v - W^T phi)^T: the value stored under phi becomes v exactly (|phi| = 1)
                self.S += np.outer(f, value - f @ self.S)
            else:
                # S <- gamma S + phi v^T, z <- gamma z + phi
                self.S = self.gamma * self.S + np.outer(f, value)
                self.z = self.gamma * self.z + f

    def read(self, q):
        phi = _features(self.method, self.P, q)
        if self.method == "delta":
            return phi @ self.S
        return (phi @ self.S) / (phi @ self.z)[:, None]

    def floats(self):
        return self.S.size + (0 if self.method == "delta" else self.z.size)


def _read_dictionary(q, keys, values, counts):
    """o = sum_m softmax_m(beta q . k_m + log c_m) v_m over the centroids with c_m >= 1 (the GMR read-out)."""
    live = counts > 0
    logits = BETA * (unit_rows(q) @ keys[live].T) + np.log(counts[live])
    return softmax_rows(logits) @ values[live]


class _VQ:
    """A static codebook with a value mean and a count per code."""

    def __init__(self, codebook):
        self.codes = codebook
        self.sums, self.counts = np.zeros((codebook.shape[0], D_V)), np.zeros(codebook.shape[0])

    def write(self, k, v):
        # z = argmax_m k . c_m, the rule VQ attention assigns keys by
        z = np.argmax(k @ self.codes.T, axis=1)
        np.add.at(self.sums, z, v)
        self.counts += np.bincount(z, minlength=self.counts.size)

    def read(self, q):
        won = self.counts > 0
        means = np.zeros_like(self.sums)
        means[won] = self.sums[won] / self.counts[won, None]
        return _read_dictionary(q, self.codes, means, self.counts)

    def floats(self):
        return self.codes.size + self.sums.size + self.counts.size


class _OVQ:
    """:func:`refimpl.ovq.ovq_attention` fed phase by phase through its state, read from its dictionaries."""

    def __init__(self, N, seed, growth):
        self.N, self.seed, self.growth, self.state = N, seed, growth, None

    def write(self, k, v):
        _, self.state = ovq_attention(k, k, v, max_size=self.N, chunk_size=CHUNK, beta=BETA, seed=self.seed,
                                      growth=self.growth, state=self.state, return_state=True)

    def read(self, q):
        n = self.state.size
        return _read_dictionary(q, np.asarray(self.state.keys)[:n], np.asarray(self.state.values)[:n],
                                np.asarray(self.state.counts)[:n].astype(np.float64))

    def floats(self):
        return self.N * (D + D_V + 1)


class _Softmax:
    """Full attention: every key and value kept."""

    def __init__(self):
        self.k, self.v = np.empty((0, D)), np.empty((0, D_V))

    def write(self, k, v):
        self.k, self.v = np.concatenate([self.k, k]), np.concatenate([self.v, v])

    def read(self, q):
        return softmax_rows(BETA * (q @ self.k.T)) @ self.v

    def floats(self):
        return self.k.size + self.v.size


def _memory(method, N, stream, n_tasks, bindings, seed):
    rng = np.random.default_rng([seed, n_tasks, bindings, 2])
    if method == "softmax":
        return _Softmax()
    if method in ("ovq", "ovq_linear_growth"):
        return _OVQ(N, seed, "plateau" if method == "ovq" else "linear")
    if method == "vq":
        first = make_stream(n_tasks, bindings, seed, held_out=True)
        sample = first["k"][first["phase"] == 0][: KMEANS_SAMPLE * N]
        return _VQ(spherical_kmeans(sample, sample[rng.choice(sample.shape[0], size=N, replace=False)], KMEANS_ITERS))
    m = int(round(N * (D + D_V + 1) / (D_V + 1)))
    return _Linear(method, m, rng, gamma=1.0 - 1.0 / (WRITES * bindings))


def recall_matrix(method: str, N: int, seed: int, *, n_tasks: int = N_TASKS, bindings: int = BINDINGS):
    """``(R, floats)``: ``R[a, b]`` the recall of task ``b`` after task ``a``'s phase (NaN for ``b > a``), and the state size.

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    N : int
        The budget (ignored by ``softmax``).
    seed : int
    n_tasks, bindings : int
        The stream (module docstring).

    Returns
    -------
    R : ndarray, shape (n_tasks, n_tasks)
    floats : int
        Floats the memory holds at the end of the stream.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    stream = make_stream(n_tasks, bindings, seed)
    memory = _memory(method, N, stream, n_tasks, bindings, seed)
    R = np.full((n_tasks, n_tasks), np.nan)
    for a in range(n_tasks):
        phase = stream["phase"] == a
        memory.write(stream["k"][phase], stream["v"][phase])
        seen = (a + 1) * bindings  # the values of tasks 0..a compete for every answer
        for b in range(a + 1):
            asked = np.arange(b * bindings, (b + 1) * bindings)
            R[a, b] = accuracy(memory.read(stream["clean"][asked]), stream["values"][:seen], asked)
    return R, memory.floats()


def run_point(point: dict) -> dict:
    """The recall matrix of one method at one budget and seed, as the metrics ``after{a}_task{b}``."""
    n_tasks, bindings = int(point["tasks"]), int(point["bindings"])
    if not 1 <= n_tasks <= N_TASKS:
        raise ValueError(f"tasks: expected 1 to {N_TASKS}, got {n_tasks}")
    with threadpool_limits(limits=1):
        R, floats = recall_matrix(point["method"], int(point["budget"]), int(point["seed"]), n_tasks=n_tasks,
                                  bindings=bindings)
    metrics = {f"after{a}_task{b}": (float(R[a, b]) if a < n_tasks else 0.0) for a in range(N_TASKS) for b in range(a + 1)}
    return {**metrics, "state_floats": float(floats)}


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def _matrix(row) -> np.ndarray:
    """The recall matrix of a result row (NaN above the diagonal)."""
    n = int(row["tasks"])
    R = np.full((n, n), np.nan)
    for a in range(n):
        for b in range(a + 1):
            R[a, b] = float(row[f"after{a}_task{b}"])
    return R


def summary(rows) -> dict:
    """``{(method, budget): stats}`` over seeds; each stat is ``(mean, std)``.

    The stats: ``earlier`` (mean recall of the earlier tasks at the end,
    ``R[last, b]`` for ``b < last``), ``newest`` (``R[last, last]``), ``all``
    (mean of the last row), ``forgetting`` (``mean_{b < last} max_a R[a, b] -
    R[last, b]``), ``first_task`` (the forgetting curve ``R[a, 0]``, an array
    over ``a``), ``matrix`` (the mean recall matrix) and ``state_floats``.
    """
    groups = {}
    for r in rows:
        groups.setdefault((r["method"], int(r["budget"])), []).append(r)
    out = {}
    for key, group in groups.items():
        Rs = np.stack([_matrix(r) for r in group])
        last = Rs[:, -1, :]
        stats = {
            "earlier": np.nanmean(last[:, :-1], axis=1) if last.shape[1] > 1 else last[:, 0],
            "newest": last[:, -1],
            "all": last.mean(axis=1),
            "forgetting": (np.nanmax(Rs, axis=1)[:, :-1] - last[:, :-1]).mean(axis=1) if last.shape[1] > 1
            else np.zeros(len(group)),
            "state_floats": np.array([float(r["state_floats"]) for r in group]),
        }
        out[key] = {name: (float(v.mean()), float(v.std())) for name, v in stats.items()}
        out[key]["first_task"] = (Rs[:, :, 0].mean(axis=0), Rs[:, :, 0].std(axis=0))
        out[key]["matrix"] = Rs.mean(axis=0)
        out[key]["seeds"] = len(group)
    return out


def table(rows) -> str:
    """One line per (method, budget): state, final recall of the earlier tasks and of the newest, forgetting."""
    s = summary(rows)
    seeds = max((v["seeds"] for v in s.values()), default=0)
    tasks = max((int(r["tasks"]) for r in rows), default=0)
    lines = [f"continual recall over {tasks} tasks, mean ± std over {seeds} seed(s); budget N = dictionary size "
             "(the linear variants get as many floats)"]
    header = (f"{'method':18s} {'N':>4s} {'floats':>7s} | {'earlier tasks':>15s} {'newest task':>15s} "
              f"{'all tasks':>15s} {'forgetting':>15s}")
    lines += [header, "-" * len(header)]
    order = sorted(s, key=lambda key: (key[1], METHODS.index(key[0])))
    for method, N in order:
        v = s[(method, N)]
        cells = " ".join(f"{v[name][0]:.3f} ± {v[name][1]:.3f}".rjust(15) for name in ("earlier", "newest", "all", "forgetting"))
        lines.append(f"{method:18s} {N:4d} {v['state_floats'][0]:7.0f} | {cells}")
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Forgetting curves of the first task, final recall against the state, and OVQ's and the delta rule's recall matrices."""
    import matplotlib
    from matplotlib.figure import Figure

    s = summary(rows)
    budgets = sorted({N for _, N in s if N > 0})
    middle = budgets[len(budgets) // 2] if budgets else 0
    colors = dict(zip(METHODS, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig = Figure(figsize=(17, 4.2))
    ax_curve, ax_state, ax_ovq, ax_delta = fig.subplots(1, 4)
    for method in METHODS:
        key = (method, 0 if method == "softmax" else middle)
        if key in s:
            mean, std = s[key]["first_task"]
            ax_curve.errorbar(np.arange(mean.size), mean, yerr=std, fmt="s--" if method == "softmax" else "o-",
                              color="k" if method == "softmax" else colors[method], label=method, capsize=3, ms=4)
        pts = sorted((s[k]["state_floats"][0], *s[k]["all"]) for k in s if k[0] == method)
        if pts:
            x, mean, std = np.array(pts).T
            ax_state.errorbar(x, mean, yerr=std, fmt="s" if method == "softmax" else "o-",
                              color="k" if method == "softmax" else colors[method], label=method, capsize=3, ms=4)
    ax_curve.set(xlabel="after the phase of task", ylabel="recall of task 0", ylim=(-0.02, 1.05),
                 title=f"forgetting the first task (N = {middle})")
    ax_state.set(xscale="log", xlabel="state (floats)", ylabel="mean recall of all tasks at the end", ylim=(-0.02, 1.05),
                 title="recall at the end against the state")
    for ax in (ax_curve, ax_state):
        ax.grid(alpha=0.3)
    ax_state.legend(fontsize=7, loc="center right")
    for ax, method in ((ax_ovq, "ovq"), (ax_delta, "delta")):
        if (method, middle) in s:
            R = s[(method, middle)]["matrix"]
            im = ax.imshow(R, vmin=0, vmax=1, cmap="viridis", origin="upper")
            ax.set(xlabel="recall of task b", ylabel="after task a", title=f"{method}: mean R[a, b] (N = {middle})",
                   xticks=range(R.shape[0]), yticks=range(R.shape[0]))
            for a in range(R.shape[0]):
                for b in range(a + 1):
                    ax.text(b, a, f"{R[a, b]:.2f}", ha="center", va="center", fontsize=7,
                            color="w" if R[a, b] < 0.5 else "k")
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
