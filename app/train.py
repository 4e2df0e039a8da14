r"""Training the model of :mod:`app.model` on the tasks of :mod:`app.tasks`: ``python -m app train``.

One run is a :class:`TrainConfig` and an output folder ``OUT``:

* ``OUT/log.csv``: one row per step, :data:`LOG_COLUMNS`: the step (1, 2,
  ...), the loss and accuracy of the step's training batch (before its
  update), the global gradient norm (before clipping), the learning rate,
  the validation loss and accuracy at the evaluation steps (empty
  elsewhere), and the seconds since the run started (across resumptions).
  Floats are written with ``repr``, so the file holds them exactly.
* ``OUT/checkpoint.npz``: written at every evaluation step (every
  ``eval_every`` steps and at the last one); see *Checkpoints*.
* ``OUT/result.json``: the final metrics, time per step and peak memory.

Training
--------
AdamW (:func:`app.optim.adam_step`) on the mean cross-entropy of
batches of ``batch_size`` training sequences, with gradient clipping by the
global norm ``clip`` (0: none) and the learning rate

.. math::

    \eta_s = \eta\,\min(1, s / s_w)\,\big(0.55 + 0.45\cos(\pi s / S)\big),\qquad s = 1..S,

a linear warm-up over ``warmup`` steps :math:`s_w` and a cosine decay to a
tenth of ``lr`` at the last step :math:`S`.  The data order is drawn from
``np.random.default_rng(seed)``: every epoch is a fresh permutation of the
training set, cut into batches in order (the last incomplete batch of an
epoch is dropped).  The parameters come from
:func:`app.model.init_params` with the same seed; the data splits from
``data_seed`` (so the seeds of a study share one data set).

ListOps sequences are cut to the longest expression of the data (all
splits together) when ``trim`` is set: the columns beyond hold only
padding in every sequence.  The mixers read the padding (it is not masked,
:mod:`app.model`), so the width is one fixed function of the data,
never of the batch: a sequence gets the same prediction in any batch.

With ``pack`` every batch is packed (:func:`app.model.pack`): the sequences
one after another without their padding, cut by ``cu_seqlens``
(:mod:`refimpl.varlen`), each mixed on its own.  For a causal model (the
Markov task) this is the padded computation without the padding: the same
losses to rounding.  A bidirectional mixer (ListOps) reads the padding of a
padded batch, so there packing is the model without the padding's part in
the mixing, not the padded run; evaluation packs as training does.

Checkpoints and resumption
--------------------------
A checkpoint is an uncompressed ``.npz`` of plain arrays (read with
``allow_pickle=False``): the tag ``format`` (:data:`CHECKPOINT_FORMAT`), the
``config`` (JSON of :class:`TrainConfig`), the ``step``, the data order's
generator state ``rng_state`` (``bit_generator.state`` as JSON), the
current epoch's permutation ``order`` and the ``position`` in it, the
seconds so far ``elapsed``, the optimiser's ``adam_step``, and the arrays
``params/NAME``, ``adam_m/NAME``, ``adam_v/NAME`` of every parameter.  It
is written to ``checkpoint.npz.tmp``, flushed to disk, then renamed over
the old one (:func:`os.replace`, atomic): an interruption leaves the old
checkpoint or the new one, never a mixture.

``resume=True`` loads ``OUT/checkpoint.npz``, drops the rows of
``OUT/log.csv`` after its step (written after the checkpoint, before an
interruption) and continues.  Everything a step reads is in the
checkpoint, exactly, so the parameters, the log rows (but their seconds)
and the accuracies are bit for bit those of an uninterrupted run on the
same machine and libraries.  (A run uses one BLAS thread, through
threadpoolctl: more threads cost more than they give on matrices this
small, and one thread fixes the order of every sum whatever the number of
cores.)  A checkpoint that cannot be read, lacks or
adds an array, has an array of the wrong shape or dtype, holds a non-finite
value, was written by a different configuration, or whose ``step``,
``adam_step`` and data order disagree (the ``position``, the permutation
``order`` and ``rng_state`` must be those that ``step`` steps of seed
``seed`` reach, :func:`data_position`) is refused with an error that names
the problem, and nothing in ``OUT`` is changed.  So is a log that is not
UTF-8, lacks a row up to the checkpoint's step, or holds in one a value
that is not a finite number or a validation where there was no evaluation
(the error names the file and the line); its seconds at the checkpoint's
step must be the checkpoint's ``elapsed``.

A run without ``resume`` refuses an ``OUT`` that already holds a
checkpoint.  A run stopped before its first checkpoint has nothing to
resume: when it diverges, is interrupted (``SIGINT``, or ``SIGTERM`` through
the command line) or cannot write, it removes the log it began; killed
outright (``SIGKILL``), it leaves a log without a checkpoint, which a run
without ``resume`` replaces, while ``resume`` says to run without it.

Divergence
----------
A step whose loss, gradients or updated parameters are not finite (or
whose forward pass meets values its checks refuse) stops the run with an
error that names ``lr`` (or ``weight_decay`` when it is above 1), the step
and both values; the last checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import resource
import time
import tracemalloc
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl import validation
from . import files, model, tasks

__all__ = [
    "TASKS",
    "MIXERS",
    "LOG_COLUMNS",
    "CHECKPOINT_FORMAT",
    "TrainConfig",
    "TrainResult",
    "quick_config",
    "check_train_config",
    "model_config",
    "load_data",
    "learning_rate",
    "data_position",
    "evaluate",
    "save_checkpoint",
    "load_checkpoint",
    "train",
    "format_result",
]

TASKS = ("listops", "markov")
MIXERS = model.MIXERS
#: The columns of ``OUT/log.csv``.
LOG_COLUMNS = ("step", "train_loss", "train_accuracy", "grad_norm", "lr", "val_loss", "val_accuracy", "seconds")
#: The tag every checkpoint carries; a file with another tag is refused.
CHECKPOINT_FORMAT = "refimpl.train checkpoint v1"
CHECKPOINT_NAME = "checkpoint.npz"
LOG_NAME = "log.csv"
RESULT_NAME = "result.json"
EVAL_BATCH = 250  # sequences per forward pass when evaluating (memory only: the metrics do not depend on it)


class TrainConfig(NamedTuple):
    """Every hyper-parameter of a run.  The defaults: one ListOps run in a few minutes on 2 cores."""

    task: str = "listops"  # "listops" | "markov"
    mixer: str = "gma"  # "gma" | "softmax" | "linear" | "ovq"
    seed: int = 0  # initial parameters and data order
    data_seed: int = 0  # the data splits
    steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0  # global gradient norm; 0: no clipping
    d_model: int = 32
    layers: int = 1
    heads: int = 2
    components: int = 16  # GMA components per head (K)
    d_route: int = 8
    mlp_hidden: int = 64
    eval_every: int = 250
    n_train: int = 20000
    n_val: int = 1000
    n_test: int = 1000
    max_len: int = 128  # listops: longest sequence
    max_depth: int = 3  # listops: deepest nesting
    trim: bool = True  # listops: cut the sequences to the longest expression of the data
    length: int = 64  # markov: tokens per sequence
    vocab: int = 16  # markov: vocabulary, padding included
    pack: bool = False  # pack every batch without its padding (cu_seqlens) rather than pad it


#: What ``--quick`` changes: tiny sizes, a run of a few seconds (for tests).
QUICK = dict(steps=12, batch_size=8, warmup=2, d_model=8, heads=2, components=4, d_route=2, mlp_hidden=16, eval_every=4,
             n_train=64, n_val=16, n_test=16, max_len=40, max_depth=2, length=12, vocab=8)


class TrainResult(NamedTuple):
    """What :func:`train` returns (and writes, less the arrays, to ``OUT/result.json``)."""

    config: TrainConfig
    step: int  # the last step done
    finished: bool  # False when stopped early (stop_after): the metrics below are then those of the last evaluation
    params: dict
    val_loss: float
    val_accuracy: float
    test_loss: float  # nan unless finished
    test_accuracy: float
    majority_rate: float  # listops: the test accuracy of always answering the most frequent test class
    entropy_rate: float  # markov: the lowest achievable loss (nats per token); nan for listops
    seconds_per_step: float  # training steps of this call, evaluations excluded
    peak_step_bytes: int  # tracemalloc peak of one training step (forward, backward, update)
    max_rss_bytes: int  # the process's peak resident memory
    report: list | None  # gma: app.interpret.interpretability_report on the test set; otherwise None
    bounds: list | None  # gma: per layer, (queries, keys) app.interpret.gradient_bound_ratios on the test set
    out: Path


def quick_config(**overrides) -> TrainConfig:
    """The ``--quick`` configuration (:data:`QUICK` over the defaults), with ``overrides`` on top."""
    return TrainConfig(**{**QUICK, **overrides})


def check_train_config(config) -> TrainConfig:
    """Check every field; errors name it (``steps: expected an integer >= 1, got 0``).

    Returns the config with Python ints, floats and bools.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a TrainConfig, got {type(config).__name__}")
    c = config._asdict()
    validation.check_option(c["task"], "task", TASKS)
    validation.check_option(c["mixer"], "mixer", MIXERS)
    minimum = dict(seed=0, data_seed=0, warmup=0, max_depth=1, max_len=4, vocab=3)
    for f in ("seed", "data_seed", "steps", "batch_size", "warmup", "d_model", "layers", "heads", "components", "d_route",
              "mlp_hidden", "eval_every", "n_train", "n_val", "n_test", "max_len", "max_depth", "length", "vocab"):
        c[f] = validation.check_int(c[f], f, minimum=minimum.get(f, 1))
    c["lr"] = validation.check_positive_float(c["lr"], "lr")
    c["weight_decay"] = validation.check_positive_float(c["weight_decay"], "weight_decay", allow_zero=True)
    c["clip"] = validation.check_positive_float(c["clip"], "clip", allow_zero=True)
    c["trim"] = validation.check_bool(c["trim"], "trim")
    c["pack"] = validation.check_bool(c["pack"], "pack")
    if c["d_model"] % c["heads"]:
        raise ValueError(f"d_model: expected a multiple of heads = {c['heads']}, got {c['d_model']}")
    if c["batch_size"] > c["n_train"]:
        raise ValueError(f"batch_size: expected at most n_train = {c['n_train']}, got {c['batch_size']}")
    return TrainConfig(**c)


def model_config(config: TrainConfig) -> model.ModelConfig:
    """The :class:`app.model.ModelConfig` of a run: a classifier for ListOps, a causal language model for Markov."""
    config = check_train_config(config)
    listops = config.task == "listops"
    return model.ModelConfig(
        vocab_size=len(tasks.LISTOPS_TOKENS) if listops else config.vocab,
        max_len=config.max_len if listops else config.length,
        d_model=config.d_model, n_layers=config.layers, n_heads=config.heads, mixer=config.mixer,
        causal=not listops, head="classify" if listops else "lm", n_classes=10,
        n_components=config.components, d_route=config.d_route, mlp_hidden=config.mlp_hidden, pad_id=tasks.PAD_ID,
    )


def load_data(config: TrainConfig) -> dict:
    """The splits of a run, ``{"train": (tokens, targets), "val": ..., "test": ...}``, ListOps trimmed if asked."""
    config = check_train_config(config)
    if config.task == "markov":
        return tasks.markov_splits(config.n_train, config.n_val, config.n_test, length=config.length, vocab=config.vocab,
                                   seed=config.data_seed)
    splits = tasks.listops_splits(config.n_train, config.n_val, config.n_test, max_len=config.max_len,
                                  max_depth=config.max_depth, seed=config.data_seed)
    if config.trim:
        width = max(int(np.max(np.sum(x != tasks.PAD_ID, axis=1))) for x, _ in splits.values())
        splits = {k: (x[:, :width], y) for k, (x, y) in splits.items()}
    return splits


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of step ``step`` (1-based): linear warm-up, then a cosine decay to ``lr / 10``."""
    validation.check_instance(config, "config", TrainConfig, "a TrainConfig")
    step = validation.check_int(step, "step", minimum=1)
    warm = min(1.0, step / config.warmup) if config.warmup else 1.0
    return config.lr * warm * (0.55 + 0.45 * math.cos(math.pi * step / config.steps))


def _packed(x, y, mcfg, pack):
    """``(tokens, targets, {"cu_seqlens": ...})`` of a batch packed (:func:`app.model.pack`), or as it is."""
    if not pack:
        return x, y, {}
    x, y, cu_seqlens = model.pack(x, y, mcfg.pad_id, mcfg.head)
    return x, y, {"cu_seqlens": cu_seqlens}


def evaluate(params, tokens, targets, mcfg, pack=False) -> tuple:
    """Mean loss and accuracy over a whole split (every counted row weighs the same), in batches of ``EVAL_BATCH``,
    each packed with ``pack``."""
    validation.check_instance(mcfg, "mcfg", model.ModelConfig, "a ModelConfig (model_config of the run)")
    if len(tokens) < 1:
        raise ValueError("tokens: expected at least one sequence, got none")
    total_loss, correct, counted = 0.0, 0, 0
    for a in range(0, len(tokens), EVAL_BATCH):
        x, y, packed = _packed(tokens[a : a + EVAL_BATCH], targets[a : a + EVAL_BATCH], mcfg, pack)
        logits, _ = model.model_forward(params, x, mcfg, **packed)
        mask = None if mcfg.head == "classify" else x != mcfg.pad_id
        loss, _ = model.cross_entropy_forward(logits, y, mask)
        m = np.ones(len(y), dtype=bool) if mask is None else mask
        n = int(m.sum())
        total_loss += float(loss) * n
        correct += int(np.sum((np.argmax(logits, axis=-1) == y) & m))
        counted += n
    return total_loss / counted, correct / counted


# ----------------------------------------------------------------------------- checkpoints


class _State(NamedTuple):
    step: int
    params: dict
    adam: object  # app.optim.AdamState
    rng: np.random.Generator
    order: np.ndarray
    position: int
    elapsed: float


def save_checkpoint(path, config: TrainConfig, state) -> None:
    """Write ``state`` to ``path``: to ``path.tmp``, flushed to disk, then renamed over ``path``."""
    path = Path(path)
    arrays = {
        "format": np.array(CHECKPOINT_FORMAT),
        "config": np.array(json.dumps(config._asdict())),
        "step": np.array(state.step, dtype=np.int64),
        "rng_state": np.array(json.dumps(state.rng.bit_generator.state)),
        "order": np.asarray(state.order, dtype=np.int64),
        "position": np.array(state.position, dtype=np.int64),
        "elapsed": np.array(state.elapsed, dtype=np.float64),
        "adam_step": np.array(state.adam.step, dtype=np.int64),
    }
    for name in state.params:
        arrays[f"params/{name}"] = state.params[name]
        arrays[f"adam_m/{name}"] = state.adam.m[name]
        arrays[f"adam_v/{name}"] = state.adam.v[name]
    tmp = path.with_name(path.name + ".tmp")
    with files.naming(tmp), open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_readable(path):
    """The arrays of the ``.npz`` file at ``path``, or ``ValueError`` if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"checkpoint: {path} is not a readable .npz file ({type(err).__name__}: {err}); it may be truncated or "
            "corrupt: remove it, or train into another --out"
        ) from None


def _check_text(arrays, key, path):
    value = arrays[key]
    if value.shape != () or value.dtype.kind != "U":
        raise ValueError(f"checkpoint: {path}: {key!r} is not a text entry (dtype {value.dtype}, shape {value.shape})")
    return str(value)


def _check_same_config(saved_json, config, path):
    try:
        saved = json.loads(saved_json)
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint: {path}: its 'config' is not valid JSON ({err})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint: {path}: its 'config' is not a JSON object")
    wanted = config._asdict()
    differ = [f"{k} = {saved.get(k, '(missing)')!r} there, {v!r} here" for k, v in wanted.items() if saved.get(k, ...) != v]
    differ += [f"{k} = {saved[k]!r} there, unknown here" for k in saved if k not in wanted]
    if differ:
        raise ValueError(
            f"checkpoint: {path} was written by a run with another configuration: {'; '.join(differ)}; "
            "pass the options of that run with --resume, or train into another --out"
        )


def _check_scalar(arrays, key, path, kind, low, high):
    value = arrays[key]
    if value.shape != () or value.dtype.kind != kind:
        raise ValueError(f"checkpoint: {path}: {key!r} expected a scalar of kind {kind!r}, got dtype {value.dtype}, shape {value.shape}")
    number = value.item()
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"checkpoint: {path}: {key!r} = {number!r}, expected a finite value in [{low}, {high}]")
    return number


def data_position(config: TrainConfig, step: int) -> tuple:
    r"""Where the data order stands after step ``step``: ``(epochs, position)``.

    Every epoch is a fresh permutation of the training set cut into
    ``n_train // batch_size`` batches (the incomplete last one dropped), and
    a permutation is drawn when a batch no longer fits in the current one.
    So after step :math:`s \ge 1`, with :math:`b` batches per epoch,
    :math:`\lceil s / b\rceil` permutations have been drawn and the
    position in the last one is :math:`((s - 1) \bmod b + 1)` batches.

    Parameters
    ----------
    config : TrainConfig
    step : int
        At least 1.

    Returns
    -------
    epochs : int
        Permutations drawn from ``np.random.default_rng(seed)``.
    position : int
        Sequences of the last permutation used.
    """
    config = check_train_config(config)
    step = validation.check_int(step, "step", minimum=1)
    per_epoch = config.n_train // config.batch_size
    # ceil(s / b) epochs begun; ((s - 1) mod b + 1) batches of the last one used
    return (step - 1) // per_epoch + 1, ((step - 1) % per_epoch + 1) * config.batch_size


def _check_data_order(config, step, order, position, rng, path):
    """Refuse a data order (position, permutation, generator state) that is not the one after ``step`` steps."""
    epochs, expected = data_position(config, step)
    if position != expected:
        raise ValueError(
            f"checkpoint: {path}: 'position' = {position} is not the position after step {step} ({expected}: "
            f"{config.n_train // config.batch_size} batches of {config.batch_size} per epoch); the checkpoint is "
            "inconsistent: remove it, or train into another --out"
        )
    replay = np.random.default_rng(config.seed)
    for _ in range(epochs):
        permutation = replay.permutation(config.n_train)
    if not np.array_equal(order, permutation):
        raise ValueError(
            f"checkpoint: {path}: 'order' is not the permutation of epoch {epochs} of seed {config.seed}, the epoch of "
            f"step {step}; the checkpoint is inconsistent: remove it, or train into another --out"
        )
    if rng.bit_generator.state != replay.bit_generator.state:
        raise ValueError(
            f"checkpoint: {path}: 'rng_state' is not the state of the data order after {epochs} epochs of seed "
            f"{config.seed}; the checkpoint is inconsistent: remove it, or train into another --out"
        )


def load_checkpoint(path, config: TrainConfig):
    """Read and check the checkpoint at ``path`` against ``config``; return the training state.

    Raises
    ------
    ValueError
        Naming the file and what is wrong: unreadable (truncated, not a
        zip), another format tag, another configuration (the fields that
        differ), a missing or unexpected array, a wrong shape or dtype, a
        non-finite value, an inconsistent step or data order.  The file is
        only read.
    """
    from .optim import AdamState

    config = check_train_config(config)
    path = Path(path)
    arrays = _check_readable(path)
    if "format" not in arrays or arrays["format"].shape != () or str(arrays["format"]) != CHECKPOINT_FORMAT:
        got = str(arrays["format"]) if "format" in arrays and arrays["format"].shape == () else None
        raise ValueError(f"checkpoint: {path}: format tag {got!r}, expected {CHECKPOINT_FORMAT!r}")
    shapes = model.param_shapes(model_config(config))
    fixed = ("format", "config", "step", "rng_state", "order", "position", "elapsed", "adam_step")
    expected = set(fixed) | {f"{g}/{n}" for g in ("params", "adam_m", "adam_v") for n in shapes}
    missing = sorted(expected - set(arrays))
    extra = sorted(set(arrays) - expected)
    if "config" in arrays:
        _check_same_config(_check_text(arrays, "config", path), config, path)
    if missing or extra:
        raise ValueError(f"checkpoint: {path}: missing arrays {missing}, unexpected arrays {extra}")
    groups = {}
    for g in ("params", "adam_m", "adam_v"):
        groups[g] = {}
        for name, shape in shapes.items():
            a = arrays[f"{g}/{name}"]
            if a.dtype != np.float64 or a.shape != tuple(shape):
                raise ValueError(f"checkpoint: {path}: '{g}/{name}' expected float64 of shape {tuple(shape)}, got {a.dtype} of shape {a.shape}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"checkpoint: {path}: '{g}/{name}' holds {int(np.sum(~np.isfinite(a)))} non-finite values")
            if g == "adam_v" and np.any(a < 0):
                raise ValueError(f"checkpoint: {path}: 'adam_v/{name}' holds negative second moments")
            groups[g][name] = a
    step = _check_scalar(arrays, "step", path, "i", 1, config.steps)
    adam_step = _check_scalar(arrays, "adam_step", path, "i", step, step)
    position = _check_scalar(arrays, "position", path, "i", 0, config.n_train)
    elapsed = _check_scalar(arrays, "elapsed", path, "f", 0.0, math.inf)
    order = arrays["order"]
    if order.dtype != np.int64 or not np.array_equal(np.sort(order), np.arange(config.n_train)):
        raise ValueError(f"checkpoint: {path}: 'order' is not a permutation of the {config.n_train} training sequences")
    rng = np.random.default_rng()
    try:
        rng.bit_generator.state = json.loads(_check_text(arrays, "rng_state", path))
    except (json.JSONDecodeError, TypeError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint: {path}: 'rng_state' is not a state of {type(rng.bit_generator).__name__} ({err})") from None
    _check_data_order(config, int(step), order, int(position), rng, path)
    adam = AdamState(step=int(adam_step), m=groups["adam_m"], v=groups["adam_v"])
    return _State(int(step), groups["params"], adam, rng, order, int(position), float(elapsed))


# ----------------------------------------------------------------------------- the log


def _check_log_row(config, path, line, row):
    """Refuse a row of the log that is not one :func:`train` writes: every column a number, validation only at evaluations."""
    if len(row) != len(LOG_COLUMNS):
        raise ValueError(f"log: {path}, line {line}: {len(row)} columns, expected {len(LOG_COLUMNS)}; the log was edited "
                         "or damaged: restore it, or train into another --out")
    step = row[0]
    if not step.isdigit() or int(step) < 1:
        raise ValueError(f"log: {path}, line {line}: step = {step!r} is not a step number; the log was edited or damaged: "
                         "restore it, or train into another --out")
    evaluated = int(step) % config.eval_every == 0 or int(step) == config.steps
    for name, text in zip(LOG_COLUMNS[1:], row[1:]):
        if name in ("val_loss", "val_accuracy") and not evaluated:
            if text:
                raise ValueError(f"log: {path}, line {line}: {name} = {text!r} at step {step}, which is no evaluation step; "
                                 "the log was edited or damaged: restore it, or train into another --out")
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"log: {path}, line {line}: {name} = {text!r} is not a finite number; the log was edited or "
                             "damaged: restore it, or train into another --out")


def _check_log(config, path, step, checkpoint, elapsed):
    """The rows of the log at ``path`` up to ``step`` (as text), refusing a log that does not hold them all.

    Rows after ``step`` (written after the checkpoint) and a torn last row are left out; every row kept is
    checked (:func:`_check_log_row`), and the seconds of the last one must be the checkpoint's ``elapsed``.
    """
    log = files.read_csv(path, "log")
    if log.header != list(LOG_COLUMNS):
        raise ValueError(f"log: {path} has the columns {log.header}, expected {list(LOG_COLUMNS)}")
    kept = []
    for line, row in log.rows:
        if len(kept) == step or (row and row[0].isdigit() and int(row[0]) > step):
            break  # written after the checkpoint, before the interruption: done again
        _check_log_row(config, path, line, row)
        kept.append((line, row))
    if [int(r[0]) for _, r in kept] != list(range(1, step + 1)):
        raise ValueError(f"log: {path} does not hold the rows of steps 1..{step}, the step of the checkpoint {checkpoint}")
    line, last = kept[-1]
    if float(last[LOG_COLUMNS.index("seconds")]) != elapsed:
        raise ValueError(f"log: {path}, line {line}: seconds = {last[-1]} at step {step}, but the checkpoint {checkpoint} "
                         f"says {elapsed!r}; the log is not that of the checkpoint: restore it, or train into another --out")
    return [row for _, row in kept]


def _format_row(row: dict) -> list:
    return ["" if row[k] is None else (repr(row[k]) if isinstance(row[k], float) else str(row[k])) for k in LOG_COLUMNS]


def _rewrite_log(path, rows):
    tmp = path.with_name(path.name + ".tmp")
    with files.naming(tmp), open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(LOG_COLUMNS)
        writer.writerows(rows)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the run


def _fresh_state(config, mcfg) -> _State:
    from .optim import adam_init

    params = model.init_params(mcfg, config.seed)
    return _State(0, params, adam_init(params), np.random.default_rng(config.seed), np.zeros(0, dtype=np.int64), 0, 0.0)


def _next_batch(state: _State, batch_size: int, n_train: int):
    """Core: the indices of the next batch, and the order and position after it (a new permutation per epoch)."""
    order, position = state.order, state.position
    if position + batch_size > len(order):
        order, position = state.rng.permutation(n_train), 0
    return order[position : position + batch_size], order, position + batch_size


def _peak_step_bytes(params, adam, tokens, targets, mcfg, config) -> int:
    """Core: the tracemalloc peak of one training step (the state is not changed)."""
    from .optim import adam_step

    tracemalloc.start()
    try:
        tokens, targets, packed = _packed(tokens, targets, mcfg, config.pack)
        _, _, _, grads = model.loss_and_grads(params, tokens, targets, mcfg, **packed)
        adam_step(params, grads, adam, lr=config.lr, weight_decay=config.weight_decay, clip_norm=config.clip or None)
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def _first_checkpoint(config, stop_after) -> int:
    """The step of a run's first checkpoint: its first evaluation, or its stop if that comes first."""
    return min(config.eval_every, config.steps, stop_after or config.steps)


def _check_out(out: Path, resume: bool, config, stop_after):
    """Refuse an ``out`` that this call may not start in or resume from; the message says which command to run."""
    ckpt, log = out / CHECKPOINT_NAME, out / LOG_NAME
    if resume and not ckpt.exists():
        if log.exists():
            raise ValueError(
                f"resume: {out} holds a log but no checkpoint: its run stopped before its first checkpoint (step "
                f"{_first_checkpoint(config, stop_after)}), so there is nothing to resume; run the same command without "
                "--resume to start it again"
            )
        raise ValueError(f"resume: no checkpoint {ckpt} to resume from; run without --resume to start")
    if resume:
        return
    if ckpt.exists():
        raise ValueError(f"out: {out} already holds {ckpt.name} of an earlier run; pass --resume to continue it, or another --out")
    if log.exists():
        # a log without a checkpoint: a run killed before its first checkpoint, which starts again from step 1
        header = files.read_csv(log, "log").header
        if header != list(LOG_COLUMNS):
            raise ValueError(f"out: {out} already holds a {log.name} that is not a training log (columns {header}); "
                             "pass another --out")


def train(config: TrainConfig, out, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """Train one model; write the log, the checkpoints and the result into ``out``.

    A run stopped before its first checkpoint (diverged, interrupted, or
    out of disk) removes the log it began, and the folder if it created it:
    it leaves nothing to resume, and the same call without ``resume``
    starts it again.  A run killed outright at that stage (``SIGKILL``)
    leaves its log behind; a call without ``resume`` replaces it.

    Parameters
    ----------
    config : TrainConfig
    out : str or os.PathLike
        The run's folder (created if needed); not empty, not a file, writable.
    resume : bool, default False
        Continue from ``out/checkpoint.npz`` (module docstring).
    progress : bool, default True
        Show a tqdm progress bar (standard error) with the running loss and accuracy.
    stop_after : int, optional
        Stop after this step, with a checkpoint, as an interruption would
        (a later ``resume=True`` finishes the run); for tests and time-limited jobs.

    Returns
    -------
    TrainResult

    Raises
    ------
    ValueError
        A bad option, an ``out`` that cannot be written or does not hold
        what ``resume`` asks for, a refused checkpoint or log (nothing in
        ``out`` is changed then), or a divergence: a non-finite loss,
        gradient or parameter, reported with the step and the options
        ``lr`` and ``weight_decay``.
    OSError
        A file of ``out`` could not be written (its name is the error's
        ``filename``); the last checkpoint is left intact.
    """
    config = check_train_config(config)
    if stop_after is not None:
        stop_after = validation.check_int(stop_after, "stop_after", minimum=1)
    resume = validation.check_bool(resume, "resume")
    out = validation.check_out_folder(out, "out")
    _check_out(out, resume, config, stop_after)
    # one BLAS thread: faster on these small matrices, and the same sums on every machine
    with threadpool_limits(limits=1):
        return _train(config, out, resume, bool(progress), stop_after)


def _check_finite_step(config, step, *, loss=None, arrays=(), refused=None):
    """Refuse a step whose loss or arrays are not finite, or that ``refused`` describes, naming the option.

    A diverging run is the learning rate's doing, or, when it is larger than 1 (a decay of more than the weights
    per unit of learning rate), the weight decay's.
    """
    if refused is not None:
        what = refused
    elif loss is not None and not math.isfinite(loss):
        what = f"the loss is {loss}"
    else:
        what = next((f"{name} is not finite" for name, a in arrays if not np.all(np.isfinite(a))), None)
    if what is not None:
        option = "weight_decay" if config.weight_decay > 1 else "lr"
        raise ValueError(
            f"{option}: training diverged at step {step}: {what} (lr = {config.lr!r}, weight_decay = "
            f"{config.weight_decay!r}); lower the {'weight decay' if option == 'weight_decay' else 'learning rate'}"
        )


def _forward_backward(state, x, y, mcfg, config, step):
    """The loss, counts and gradients of one batch; a non-finite one is refused as a divergence naming its option."""
    try:
        # a diverging step overflows: the checks below report it, once, as a divergence (no warnings on the way)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            x, y, packed = _packed(x, y, mcfg, config.pack)
            loss, n_correct, n_counted, grads = model.loss_and_grads(state.params, x, y, mcfg, **packed)
    except ValueError:  # a value of the model's own that its checks refuse: the parameters diverged
        _check_finite_step(config, step, refused="the model met values that are not finite")
    _check_finite_step(config, step, loss=float(loss), arrays=[(f"the gradient of {k}", g) for k, g in grads.items()])
    return loss, n_correct, n_counted, grads


def _update(state, grads, lr, config, step):
    """The AdamW step of the run; non-finite parameters are refused as a divergence naming its option."""
    from .optim import adam_step

    try:
        with np.errstate(over="ignore", invalid="ignore"):  # an update that overflows is reported just below
            params, adam, grad_norm = adam_step(state.params, grads, state.adam, lr=lr, weight_decay=config.weight_decay,
                                                clip_norm=config.clip or None)
    except ValueError:  # gradients whose squares overflow the second moment (no clipping)
        _check_finite_step(config, step, refused="the gradients are too large for the optimiser's second moment")
    _check_finite_step(config, step, arrays=[(f"the parameter {k}", p) for k, p in params.items()])
    return params, adam, grad_norm


def _evaluate_checked(params, x, y, mcfg, config, step):
    """:func:`evaluate` during training; a non-finite loss is refused as a divergence naming its option."""
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # reported below as a divergence
            val_loss, val_acc = evaluate(params, x, y, mcfg, config.pack)
    except ValueError:  # a value of the model's own that its checks refuse: the parameters diverged
        _check_finite_step(config, step, refused="the model met values that are not finite")
    _check_finite_step(config, step, loss=val_loss)
    return val_loss, val_acc


def _remove_unfinished(log_path, out, created):
    """Core: remove the log of a run stopped before its first checkpoint (and ``out`` if this run created it, empty)."""
    for path in (log_path, log_path.with_name(log_path.name + ".tmp"), out / (CHECKPOINT_NAME + ".tmp")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()  # only if empty


def _train(config, out, resume, progress, stop_after) -> TrainResult:
    """Core of :func:`train`, on checked arguments."""
    mcfg = model_config(config)
    ckpt_path, log_path = out / CHECKPOINT_NAME, out / LOG_NAME
    if resume:
        state = load_checkpoint(ckpt_path, config)
        kept = _check_log(config, log_path, state.step, ckpt_path, state.elapsed)
    else:
        state = _fresh_state(config, mcfg)
        kept = []
    data = load_data(config)
    (x_train, y_train), (x_val, y_val) = data["train"], data["val"]

    created = not out.exists()
    try:
        with files.naming(out):
            out.mkdir(parents=True, exist_ok=True)
        _rewrite_log(log_path, kept)  # drops the rows written after the checkpoint
        val_loss = val_acc = math.nan
        for row in reversed(kept):  # the metrics of the last evaluation
            if row[LOG_COLUMNS.index("val_loss")]:
                val_loss, val_acc = float(row[LOG_COLUMNS.index("val_loss")]), float(row[LOG_COLUMNS.index("val_accuracy")])
                break
        start = time.perf_counter() - state.elapsed
        train_seconds, steps_run = 0.0, 0
        last = config.steps if stop_after is None else min(stop_after, config.steps)
        ema_loss = ema_acc = None
        with files.naming(log_path), open(log_path, "a", newline="", encoding="utf-8") as f, files.progress_bar(
            total=config.steps, initial=state.step, desc=f"{config.task} {config.mixer}", disable=not progress
        ) as bar:
            writer = csv.writer(f)
            while state.step < last:
                t0 = time.perf_counter()
                step = state.step + 1
                idx, order, position = _next_batch(state, config.batch_size, config.n_train)
                loss, n_correct, n_counted, grads = _forward_backward(state, x_train[idx], y_train[idx], mcfg, config, step)
                lr = learning_rate(config, step)
                params, adam, grad_norm = _update(state, grads, lr, config, step)
                state = state._replace(step=step, params=params, adam=adam, order=order, position=position)
                train_seconds += time.perf_counter() - t0
                steps_run += 1
                evaluating = step % config.eval_every == 0 or step == config.steps
                if evaluating:
                    val_loss, val_acc = _evaluate_checked(state.params, x_val, y_val, mcfg, config, step)
                accuracy = n_correct / n_counted
                state = state._replace(elapsed=time.perf_counter() - start)
                writer.writerow(_format_row({
                    "step": step, "train_loss": float(loss), "train_accuracy": accuracy, "grad_norm": float(grad_norm),
                    "lr": lr, "val_loss": val_loss if evaluating else None, "val_accuracy": val_acc if evaluating else None,
                    "seconds": state.elapsed,
                }))
                f.flush()
                if evaluating or step == last:
                    save_checkpoint(ckpt_path, config, state)
                ema_loss = loss if ema_loss is None else 0.95 * ema_loss + 0.05 * loss
                ema_acc = accuracy if ema_acc is None else 0.95 * ema_acc + 0.05 * accuracy
                bar.set_postfix(loss=f"{ema_loss:.3f}", acc=f"{ema_acc:.3f}", val_acc=f"{val_acc:.3f}", refresh=False)
                bar.update()
    finally:
        if not resume and not ckpt_path.exists():  # stopped before its first checkpoint: nothing to resume, nothing left
            _remove_unfinished(log_path, out, created)

    finished = state.step == config.steps
    x_test, y_test = data["test"]
    test_loss = test_acc = math.nan
    report = bounds = None
    if finished:
        val_loss, val_acc = evaluate(state.params, x_val, y_val, mcfg, config.pack)
        test_loss, test_acc = evaluate(state.params, x_test, y_test, mcfg, config.pack)
        if config.mixer == "gma":
            report, bounds = _interpretability(state.params, x_test[:EVAL_BATCH], y_test[:EVAL_BATCH], mcfg)
    peak = _peak_step_bytes(state.params, state.adam, x_train[: config.batch_size], y_train[: config.batch_size], mcfg, config)
    result = TrainResult(
        config=config, step=state.step, finished=finished, params=state.params, val_loss=val_loss, val_accuracy=val_acc,
        test_loss=test_loss, test_accuracy=test_acc,
        majority_rate=tasks.majority_rate(y_test) if config.task == "listops" else math.nan,
        entropy_rate=tasks.markov_entropy_rate(config.vocab, seed=config.data_seed) if config.task == "markov" else math.nan,
        seconds_per_step=train_seconds / steps_run if steps_run else math.nan,
        peak_step_bytes=peak, max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        report=report, bounds=bounds, out=out,
    )
    _write_result(out / RESULT_NAME, result)
    return result


def _interpretability(params, tokens, targets, mcfg):
    """The interpretability report of the trained GMA on ``tokens`` (non-padding tokens), and the lesson-4 gradient bounds.

    The bounds are evaluated with the loss's own ``dL/dgamma`` on these test sequences: per layer, the ratios of
    the routing queries and of the routing keys.
    """
    from .interpret import gradient_bound_ratios, interpretability_report

    routing = model.gma_routing(params, tokens, mcfg, targets=targets)
    mask = tokens != tasks.PAD_ID
    report = interpretability_report(routing, tasks.token_categories(tokens), mask=mask)
    bounds = [
        tuple(gradient_bound_ratios(r[f"x_{s}"], r["means"], r["variances"], r["weights"], r[f"grad_gamma_{s}"], mask=mask)
              for s in ("q", "k"))
        for r in routing
    ]
    return report, bounds


def _write_result(path, result: TrainResult):
    skip = ("params", "report", "bounds", "out", "config")
    doc = {k: v for k, v in result._asdict().items() if k not in skip}
    doc = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in doc.items()}
    doc["config"] = result.config._asdict()
    tmp = path.with_name(path.name + ".tmp")
    with files.naming(tmp):
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def format_result(result: TrainResult) -> str:
    """The end-of-run summary that ``python -m app train`` prints."""
    validation.check_instance(result, "result", TrainResult, "a TrainResult (what train returns)")
    c = result.config
    if not result.finished:
        return (f"stopped after step {result.step} of {c.steps} (checkpoint in {result.out / CHECKPOINT_NAME}); "
                f"continue with the same options and --resume")
    lines = [f"{c.task} {c.mixer}, seed {c.seed}: {result.step} steps, {1000 * result.seconds_per_step:.1f} ms per step, "
             f"peak {result.peak_step_bytes / 2**20:.1f} MiB per step (tracemalloc), {result.max_rss_bytes / 2**20:.0f} MiB resident"]
    lines.append(f"validation: loss {result.val_loss:.4f}, accuracy {result.val_accuracy:.4f}")
    lines.append(f"test:       loss {result.test_loss:.4f}, accuracy {result.test_accuracy:.4f}")
    if c.task == "listops":
        lines.append(f"majority-class rate (test): {result.majority_rate:.4f}")
    else:
        lines.append(f"entropy rate of the source (the lowest achievable loss): {result.entropy_rate:.4f} nats per token")
    if result.report is not None:
        from .interpret import format_report

        lines.append("interpretability (test sequences, non-padding tokens):")
        lines.append(format_report(result.report))
    if result.bounds is not None:
        lines.append("lesson-4 gradient bounds on the trained model (largest measured / bound over the test tokens, per head):")
        for layer, sides in enumerate(result.bounds):
            for side, b in zip(("queries", "keys"), sides):
                for h in range(len(b.ratio_x)):
                    lines.append(f"  layer {layer} head {h} {side:7s}: dL/dx {b.ratio_x[h]:.3f}, dL/dmu {b.ratio_means[h]:.3f}, "
                                 f"dL/da {b.ratio_logits[h]:.3f}, dL/da modulated {b.ratio_logits_modulated[h]:.3f}")
    lines.append(f"log in {result.out / LOG_NAME}, checkpoint in {result.out / CHECKPOINT_NAME}, result in {result.out / RESULT_NAME}")
    return "\n".join(lines)
