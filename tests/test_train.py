"""app.train and ``python -m app train``: a run end to end, resumption bit for bit, refused checkpoints and options."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app import train
from app.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = train.quick_config()  # 12 steps, evaluations at 4, 8, 12


def rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def without_seconds(table):
    """The log without its wall-clock column, the one column that differs from run to run."""
    i = list(train.LOG_COLUMNS).index("seconds")
    return [r[:i] + r[i + 1 :] for r in table]


def same_params(a, b):
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted quick GMA run."""
    out = tmp_path_factory.mktemp("reference")
    return train.train(QUICK, out, progress=False)


# ----------------------------------------------------------------------------- a run


def test_the_command_line_runs_quick_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "app", "train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("validation: loss", "accuracy", "test:", "majority-class rate (test)", "ms per step",
                 "interpretability", "usage entropy", "NMI", "lesson-4 gradient bounds on the trained model"):
        assert text in proc.stdout, text
    assert (tmp_path / "checkpoint.npz").stat().st_size > 1000
    assert not (tmp_path / "checkpoint.npz.tmp").exists()
    assert (tmp_path / "result.json").exists()


def test_the_log_has_its_columns_a_row_per_step_and_validation_at_the_evaluation_steps(reference):
    table = rows(reference.out / "log.csv")
    assert tuple(table[0]) == train.LOG_COLUMNS
    body = table[1:]
    assert [int(r[0]) for r in body] == list(range(1, QUICK.steps + 1))
    evaluated = [int(r[0]) for r in body if r[train.LOG_COLUMNS.index("val_accuracy")]]
    assert evaluated == [4, 8, 12]
    last = body[-1]
    assert float(last[train.LOG_COLUMNS.index("val_accuracy")]) == reference.val_accuracy
    seconds = [float(r[-1]) for r in body]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert all(math.isfinite(float(r[1])) and 0 <= float(r[2]) <= 1 for r in body)


def test_the_result_holds_accuracies_the_baseline_and_the_costs(reference):
    r = reference
    assert r.finished and r.step == QUICK.steps
    assert 0 <= r.val_accuracy <= 1 and 0 <= r.test_accuracy <= 1
    assert 0.1 <= r.majority_rate <= 1
    assert r.seconds_per_step > 0 and r.peak_step_bytes > 0 and r.max_rss_bytes > 0
    assert len(r.report) == QUICK.layers * QUICK.heads  # one interpretability report per layer and head
    # the lesson-4 bounds with the loss's own dL/dgamma: measured / bound <= 1 (up to the rounding the ratios allow)
    assert len(r.bounds) == QUICK.layers
    for queries, keys in r.bounds:
        for b in (queries, keys):
            ratios = np.concatenate([b.ratio_x, b.ratio_means, b.ratio_logits, b.ratio_logits_modulated])
            assert ratios.shape == (4 * QUICK.heads,) and np.all(ratios > 0) and np.all(ratios <= 1 + 1e-7)


def test_the_markov_task_reports_the_entropy_rate(tmp_path, capsys):
    assert main(["train", "--task", "markov", "--mixer", "linear", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "entropy rate of the source" in out and "majority" not in out and "interpretability" not in out


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    c = QUICK._replace(steps=100, warmup=10, lr=1.0)
    assert train.learning_rate(c, 5) == pytest.approx(0.5 * (0.55 + 0.45 * math.cos(math.pi * 0.05)))
    assert train.learning_rate(c, 100) == pytest.approx(0.1)
    assert max(train.learning_rate(c, s) for s in range(1, 101)) <= 1.0


# ----------------------------------------------------------------------------- resumption


def test_a_stopped_run_resumed_ends_bit_for_bit_like_an_uninterrupted_one(reference, tmp_path):
    first = train.train(QUICK, tmp_path, progress=False, stop_after=6)  # between evaluations: checkpoint at 6
    assert not first.finished and first.step == 6
    assert train.load_checkpoint(tmp_path / "checkpoint.npz", QUICK).step == 6  # the stop leaves its own checkpoint
    resumed = train.train(QUICK, tmp_path, resume=True, progress=False)
    assert resumed.finished
    assert same_params(resumed.params, reference.params)
    assert (resumed.val_accuracy, resumed.test_accuracy, resumed.val_loss, resumed.test_loss) == (
        reference.val_accuracy, reference.test_accuracy, reference.val_loss, reference.test_loss)
    assert without_seconds(rows(tmp_path / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


def test_rows_written_after_the_checkpoint_are_replaced_on_resume(reference, tmp_path):
    """An interruption after step 7 with the checkpoint of step 4: rows 5..7 and a torn row are dropped, then redone."""
    train.train(QUICK, tmp_path, progress=False, stop_after=4)
    saved = (tmp_path / "checkpoint.npz").read_bytes()
    train.train(QUICK, tmp_path, resume=True, progress=False, stop_after=7)
    (tmp_path / "checkpoint.npz").write_bytes(saved)  # as if the run had died after step 7, before a checkpoint
    with open(tmp_path / "log.csv", "a") as f:
        f.write("8,2.31")  # a row torn by the interruption
    assert len(rows(tmp_path / "log.csv")) == 1 + 8
    resumed = train.train(QUICK, tmp_path, resume=True, progress=False)
    assert same_params(resumed.params, reference.params)
    assert without_seconds(rows(tmp_path / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


def test_resuming_through_the_command_line(reference, tmp_path, capsys):
    args = ["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress", "--out", str(tmp_path)]
    assert main(args + ["--stop-after", "5"]) == 0
    assert "stopped after step 5 of 12" in capsys.readouterr().out
    assert main(args + ["--resume"]) == 0
    assert f"accuracy {reference.test_accuracy:.4f}" in capsys.readouterr().out
    assert without_seconds(rows(tmp_path / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


# ----------------------------------------------------------------------------- refused checkpoints


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped at step 4, with its checkpoint; each test works on a copy."""
    out = tmp_path_factory.mktemp("stopped")
    train.train(QUICK, out, progress=False, stop_after=4)
    return out


def rewrite(path, change):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def set_nan(arrays):
    arrays["params/head.W"] = arrays["params/head.W"].copy()
    arrays["params/head.W"][0, 1] = np.nan


CORRUPTIONS = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is not a readable .npz file"),
    "not a zip": (lambda p: p.write_bytes(b"not a checkpoint at all"), "is not a readable .npz file"),
    "missing array": (lambda p: rewrite(p, lambda a: a.pop("adam_v/head.b")), r"missing arrays \['adam_v/head.b'\]"),
    "extra array": (lambda p: rewrite(p, lambda a: a.update(extra=np.zeros(2))), r"unexpected arrays \['extra'\]"),
    "wrong shape": (lambda p: rewrite(p, lambda a: a.update({"params/embed": np.zeros((3, 3))})),
                    r"'params/embed' expected float64 of shape \(16, 8\), got float64 of shape \(3, 3\)"),
    "wrong dtype": (lambda p: rewrite(p, lambda a: a.update({"adam_m/head.b": a["adam_m/head.b"].astype(np.float32)})),
                    "'adam_m/head.b' expected float64"),
    "non-finite": (lambda p: rewrite(p, set_nan), "'params/head.W' holds 1 non-finite values"),
    "format tag": (lambda p: rewrite(p, lambda a: a.update(format=np.array("something else v9"))), "format tag 'something else v9'"),
    "step": (lambda p: rewrite(p, lambda a: a.update(step=np.array(99))), r"'step' = 99, expected a finite value in \[1, 12\]"),
    "order": (lambda p: rewrite(p, lambda a: a.update(order=np.zeros(QUICK.n_train, dtype=np.int64))), "'order' is not a permutation"),
    "rng state": (lambda p: rewrite(p, lambda a: a.update(rng_state=np.array('{"bit_generator": "MT19937"}'))), "'rng_state' is not a state"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupt_checkpoint_is_refused_naming_the_problem_and_left_intact(stopped, tmp_path, kind):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    corrupt, message = CORRUPTIONS[kind]
    corrupt(out / "checkpoint.npz")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=message):
        train.train(QUICK, out, resume=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing in the folder changed


def test_a_checkpoint_of_another_configuration_is_refused_naming_the_fields(stopped, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    before = (out / "checkpoint.npz").read_bytes()
    with pytest.raises(ValueError, match=r"another configuration: seed = 0 there, 1 here; lr = 0.003 there, 0.001 here; pass the options"):
        train.train(QUICK._replace(lr=0.001, seed=1), out, resume=True, progress=False)
    code = main(["train", "--task", "listops", "--mixer", "softmax", "--quick", "--no-progress", "--out", str(out), "--resume"])
    assert code == 2 and "mixer = 'gma' there, 'softmax' here" in capsys.readouterr().err
    assert (out / "checkpoint.npz").read_bytes() == before


def test_a_log_that_does_not_reach_the_checkpoint_is_refused(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    table = rows(out / "log.csv")
    (out / "log.csv").write_text("\n".join(",".join(r) for r in table[:3]) + "\n")  # steps 1, 2 of 4
    with pytest.raises(ValueError, match=r"log: .* does not hold the rows of steps 1..4"):
        train.train(QUICK, out, resume=True, progress=False)


def test_an_existing_run_is_not_overwritten_and_resume_needs_a_checkpoint(stopped, tmp_path):
    before = (stopped / "checkpoint.npz").read_bytes()
    with pytest.raises(ValueError, match="already holds checkpoint.npz of an earlier run; pass --resume"):
        train.train(QUICK, stopped, progress=False)
    assert (stopped / "checkpoint.npz").read_bytes() == before
    with pytest.raises(ValueError, match="resume: no checkpoint .* to resume from"):
        train.train(QUICK, tmp_path / "empty", resume=True, progress=False)


def test_a_checkpoint_write_that_fails_leaves_the_old_one(stopped, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    before = (out / "checkpoint.npz").read_bytes()
    state = train.load_checkpoint(out / "checkpoint.npz", QUICK)

    def failing_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", failing_savez)
    with pytest.raises(OSError, match="disk full"):
        train.save_checkpoint(out / "checkpoint.npz", QUICK, state)
    assert (out / "checkpoint.npz").read_bytes() == before
    monkeypatch.undo()
    train.save_checkpoint(out / "checkpoint.npz", QUICK, state)  # a later save replaces the leftover temporary file
    assert (out / "checkpoint.npz").read_bytes() == before and not (out / "checkpoint.npz.tmp").exists()


# ----------------------------------------------------------------------------- refused options


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size: expected an integer >= 1, got 0"),
    (["--batch-size", "65"], "--batch-size: expected at most n_train = 64, got 65"),
    (["--lr", "-0.1"], "--lr: expected a finite number > 0, got -0.1"),
    (["--lr", "nan"], "--lr: expected a finite number > 0, got nan"),
    (["--weight-decay", "-1"], "--weight-decay: expected a finite number >= 0"),
    (["--clip", "-1"], "--clip: expected a finite number >= 0"),
    (["--heads", "3"], "--d-model: expected a multiple of heads = 3, got 8"),
    (["--seed", "-2"], "--seed: expected an integer >= 0, got -2"),
    (["--eval-every", "0"], "--eval-every: expected an integer >= 1"),
    (["--stop-after", "0"], "--stop-after: expected an integer >= 1, got 0"),
])
def test_bad_options_are_refused_naming_the_option(tmp_path, capsys, argv, message):
    code = main(["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress", "--out", str(tmp_path / "o"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, message", [
    (["--task", "listops", "--mixer", "gmb"], "argument --mixer: invalid choice: 'gmb'"),
    (["--task", "copy", "--mixer", "gma"], "argument --task: invalid choice: 'copy'"),
    (["--task", "listops", "--mixer", "gma", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
    (["--mixer", "gma"], "the following arguments are required: --task"),
])
def test_malformed_options_are_refused_by_the_parser(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------- the whole log, resumed


def fake_clock(monkeypatch):
    """``train``'s clock replaced by one that advances by exactly 1 s per reading: the seconds become reproducible."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(train, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def log_column(table, name):
    return [r[train.LOG_COLUMNS.index(name)] for r in table[1:]]


def test_a_resumed_log_is_the_uninterrupted_log_column_for_column_seconds_included(tmp_path, monkeypatch):
    """10 steps, evaluations at 4, 8 and the last step 10; one run straight through, one stopped at 6 and resumed.

    With a clock that ticks once per reading, the seconds of a run are a function of its steps: a resumption that
    forgot the elapsed time would restart them from 0.
    """
    config = QUICK._replace(steps=10)
    fake_clock(monkeypatch)
    straight = train.train(config, tmp_path / "straight", progress=False)
    first = train.train(config, tmp_path / "resumed", progress=False, stop_after=6)
    resumed = train.train(config, tmp_path / "resumed", resume=True, progress=False)
    log = rows(tmp_path / "straight" / "log.csv")
    assert rows(tmp_path / "resumed" / "log.csv") == log  # every column, the seconds too
    assert [int(s) for s, v in zip(log_column(log, "step"), log_column(log, "val_loss")) if v] == [4, 8, 10]
    seconds = [float(s) for s in log_column(log, "seconds")]
    assert all(b > a for a, b in zip(seconds, seconds[1:]))
    # the last step is evaluated, its metrics are the result's, and it is checkpointed with the log's seconds
    for run in (straight, resumed):
        assert run.finished and (run.val_loss, run.val_accuracy) == (float(log[-1][5]), float(log[-1][6]))
        state = train.load_checkpoint(run.out / "checkpoint.npz", config)
        assert state.step == 10 and state.elapsed == seconds[-1]
    assert same_params(resumed.params, straight.params)
    assert (resumed.test_loss, resumed.test_accuracy) == (straight.test_loss, straight.test_accuracy)
    assert not first.finished and first.step == 6
    # the result's test metrics are those of the test split, its baseline the test split's majority class
    data, mcfg = train.load_data(config), train.model_config(config)
    assert (straight.test_loss, straight.test_accuracy) == train.evaluate(straight.params, *data["test"], mcfg)
    assert (straight.val_loss, straight.val_accuracy) == train.evaluate(straight.params, *data["val"], mcfg)
    assert straight.majority_rate == train.tasks.majority_rate(data["test"][1])


def test_a_stopped_run_reports_the_metrics_of_its_last_evaluation(tmp_path):
    """Stopped at 9 (evaluations at 4 and 8), resumed and stopped at 11 without a new evaluation: those of step 8."""
    first = train.train(QUICK, tmp_path, progress=False, stop_after=9)
    log = rows(tmp_path / "log.csv")
    at_8 = (float(log[8][5]), float(log[8][6]))
    assert (first.val_loss, first.val_accuracy) == at_8 and float(log[4][5]) != at_8[0]
    second = train.train(QUICK, tmp_path, resume=True, progress=False, stop_after=11)
    assert not second.finished and second.step == 11
    assert (second.val_loss, second.val_accuracy) == at_8


# ----------------------------------------------------------------------------- the data order and the metrics


@pytest.mark.parametrize("n_train, batch_size, steps", [(24, 8, 7), (20, 8, 5)])
def test_the_batches_follow_the_documented_data_order(monkeypatch, tmp_path, n_train, batch_size, steps):
    """Every epoch a fresh permutation from default_rng(seed), cut into n_train // batch_size batches in order."""
    config = QUICK._replace(n_train=n_train, batch_size=batch_size, steps=steps, eval_every=100)
    seen = []
    loss_and_grads = train.model.loss_and_grads

    def recording(params, tokens, targets, mcfg):
        seen.append(tokens.copy())
        return loss_and_grads(params, tokens, targets, mcfg)

    monkeypatch.setattr(train.model, "loss_and_grads", recording)
    train.train(config, tmp_path, progress=False)
    x_train = train.load_data(config)["train"][0]
    rng, expected = np.random.default_rng(config.seed), []
    while len(expected) < steps:
        order = rng.permutation(n_train)
        expected += [order[i : i + batch_size] for i in range(0, n_train - batch_size + 1, batch_size)]
    for step, idx in enumerate(expected[:steps], start=1):
        np.testing.assert_array_equal(seen[step - 1], x_train[idx], err_msg=f"step {step}")
        epochs, position = train.data_position(config, step)
        assert epochs == (step - 1) // (n_train // batch_size) + 1 and position == len(idx) * ((step - 1) % (n_train // batch_size) + 1)


def _log_softmax_nll(logits, targets):
    from scipy.special import log_softmax

    return -np.take_along_axis(log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("task", ["listops", "markov"])
def test_evaluate_is_the_mean_over_every_counted_item_of_the_split(monkeypatch, task):
    """Against one forward pass of the whole split: the mean cross-entropy and accuracy over the sequences
    (listops) or the non-padding tokens (markov), however the split is cut into batches of unequal counts."""
    config = QUICK._replace(task=task, n_val=11)
    mcfg = train.model_config(config)
    params = train.model.init_params(mcfg, 3)
    x, y = train.load_data(config)["val"]
    if task == "markov":  # sequences of different lengths: padding at the end of some
        x, y = x.copy(), y.copy()
        for i, cut in enumerate([3, 12, 7, 12, 1, 9, 12, 5, 12, 2, 10]):
            x[i, cut:] = mcfg.pad_id
    logits, _ = train.model.model_forward(params, x, mcfg)
    counted = np.ones(len(y), bool) if task == "listops" else x != mcfg.pad_id
    nll, right = _log_softmax_nll(logits, y), np.argmax(logits, axis=-1) == y
    expected = (float(np.mean(nll[counted])), float(np.mean(right[counted])))
    for batch in (250, 3):
        monkeypatch.setattr(train, "EVAL_BATCH", batch)
        loss, accuracy = train.evaluate(params, x, y, mcfg)
        assert loss == pytest.approx(expected[0], rel=1e-12) and accuracy == expected[1], batch


# ----------------------------------------------------------------------------- inconsistent checkpoints and logs


def edit_log(path, line, column, value):
    table = rows(path)
    table[line - 1][train.LOG_COLUMNS.index(column)] = value
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(table)


def another_permutation(arrays):
    arrays["order"] = np.random.default_rng(99).permutation(QUICK.n_train)


def rng_of_another_seed(arrays):
    rng = np.random.default_rng(QUICK.seed + 1)
    rng.permutation(QUICK.n_train)
    arrays["rng_state"] = np.array(json.dumps(rng.bit_generator.state))


INCONSISTENT = {
    # step 4 (position 32 of an epoch of 8 batches of 8): step and adam_step edited to 2, the rest left
    "step and adam_step": (lambda a: a.update(step=np.array(2), adam_step=np.array(2)),
                           r"'position' = 32 is not the position after step 2 \(16"),
    "adam_step alone": (lambda a: a.update(adam_step=np.array(3)), r"'adam_step' = 3, expected a finite value in \[4, 4\]"),
    "position": (lambda a: a.update(position=np.array(24)), "'position' = 24 is not the position after step 4"),
    "another permutation": (another_permutation, "'order' is not the permutation of epoch 1 of seed 0"),
    "rng state of another seed": (rng_of_another_seed, "'rng_state' is not the state of the data order after 1 epochs"),
    "elapsed": (lambda a: a.update(elapsed=np.array(1234.5)), r"log: .*line 5: seconds = .* says 1234.5"),
}


@pytest.mark.parametrize("kind", INCONSISTENT)
def test_an_inconsistent_checkpoint_is_refused_and_left_intact(stopped, tmp_path, capsys, kind):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    change, message = INCONSISTENT[kind]
    rewrite(out / "checkpoint.npz", change)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=message):
        train.train(QUICK, out, resume=True, progress=False)
    code = main(["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


BAD_LOGS = {
    "val_loss not a number": (lambda p: edit_log(p, 5, "val_loss", "abc"), r"log\.csv, line 5: val_loss = 'abc' is not a finite number"),
    "train_loss not a number": (lambda p: edit_log(p, 3, "train_loss", "2.3x"), r"log\.csv, line 3: train_loss = '2.3x' is not a finite"),
    "train_loss nan": (lambda p: edit_log(p, 2, "train_loss", "nan"), r"log\.csv, line 2: train_loss = 'nan' is not a finite"),
    "a validation off an evaluation step": (lambda p: edit_log(p, 3, "val_loss", "0.5"), r"line 3: val_loss = '0.5' at step 2, which is no evaluation"),
    "missing column": (lambda p: p.write_text("\n".join(",".join(r[:-1]) if i == 2 else ",".join(r) for i, r in enumerate(rows(p))) + "\n"),
                       r"log\.csv, line 3: 7 columns, expected 8"),
    "not UTF-8": (lambda p: p.write_bytes(p.read_bytes().replace(b"\n3,", b"\n3\xff,", 1)), r"log: .*log\.csv, line 4, is not UTF-8 text"),
}


@pytest.mark.parametrize("kind", BAD_LOGS)
def test_a_damaged_log_is_refused_naming_the_file_and_line_and_nothing_changes(stopped, tmp_path, capsys, kind):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    damage, message = BAD_LOGS[kind]
    damage(out / "log.csv")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=message):
        train.train(QUICK, out, resume=True, progress=False)
    code = main(["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("python -m app train: log: ") and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_rows_after_the_checkpoint_are_dropped_however_damaged(stopped, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    with open(out / "log.csv", "a") as f:
        f.write("not,a,row\n5,garbage\n")  # written after the checkpoint of step 4: done again
    resumed = train.train(QUICK, out, resume=True, progress=False)
    assert same_params(resumed.params, reference.params)
    assert without_seconds(rows(out / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


# ----------------------------------------------------------------------------- divergence, output folders, early stops


TRAIN = ["train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (["--lr", "1e300"], "--lr: training diverged at step "),
    (["--weight-decay", "1e300"], "--weight-decay: training diverged at step "),
    (["--lr", "1e300", "--clip", "0"], "--lr: training diverged at step "),
])
@pytest.mark.parametrize("exists", [False, True])
def test_a_diverging_run_names_the_option_and_leaves_nothing(tmp_path, capsys, argv, message, exists):
    out = tmp_path / "run"
    if exists:
        out.mkdir()
    assert main(TRAIN + ["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m app train: {message}") and len(err.strip().splitlines()) == 1, err
    assert (list(out.iterdir()) == []) if exists else not out.exists()


def test_a_run_that_diverges_after_a_checkpoint_keeps_it(tmp_path, monkeypatch):
    """A run that goes non-finite at step 6 keeps the checkpoint of step 4, from which it resumes."""
    loss_and_grads, calls = train.model.loss_and_grads, []

    def diverging(params, tokens, targets, mcfg):
        calls.append(1)
        loss, n_correct, n_counted, grads = loss_and_grads(params, tokens, targets, mcfg)
        return (np.float64(np.inf) if len(calls) == 6 else loss), n_correct, n_counted, grads

    monkeypatch.setattr(train.model, "loss_and_grads", diverging)
    with pytest.raises(ValueError, match="lr: training diverged at step 6: the loss is inf"):
        train.train(QUICK, tmp_path, progress=False)
    assert train.load_checkpoint(tmp_path / "checkpoint.npz", QUICK).step == 4


@pytest.mark.parametrize("kind", ["a file", "below a file", "empty"])
@pytest.mark.parametrize("command", ["train", "experiment"])
def test_an_out_that_is_no_folder_is_refused_naming_the_option(tmp_path, monkeypatch, capsys, kind, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file\n")
    out = {"a file": "file", "below a file": "file/run", "empty": ""}[kind]
    argv = TRAIN if command == "train" else ["experiment", "scaling", "--quick", "--no-progress"]
    assert main([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    expected = {"a file": "--out: file is a file, not a folder", "below a file": "--out: file/run lies below file, which is a file",
                "empty": "--out: expected a folder, got an empty path ''"}[kind]
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "a file\n"


def test_a_run_stopped_before_its_first_checkpoint_leaves_nothing_and_says_what_to_run(reference, tmp_path, monkeypatch, capsys):
    loss_and_grads, calls = train.model.loss_and_grads, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return loss_and_grads(*args)

    monkeypatch.setattr(train.model, "loss_and_grads", interrupted)
    out = tmp_path / "run"
    try:
        code = main(TRAIN + ["--out", str(out)])
    except KeyboardInterrupt:
        pytest.fail("the interruption escaped the command line")
    assert code == 130
    assert "interrupted; no checkpoint was written, so there is nothing to resume: run the same command again, without --resume" in capsys.readouterr().err
    assert not out.exists()
    monkeypatch.undo()
    assert main(TRAIN + ["--out", str(out)]) == 0
    assert without_seconds(rows(out / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


def test_a_log_without_a_checkpoint_is_replaced_by_a_plain_run_and_resume_says_so(reference, tmp_path, capsys):
    """What SIGKILL before the first checkpoint leaves: a log and no checkpoint."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.csv").write_text("\n".join(",".join(r) for r in rows(reference.out / "log.csv")[:3]) + "\n")
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: " in err and "stopped before its first checkpoint (step 4)" in err and "without --resume" in err
    assert main(TRAIN + ["--out", str(out)]) == 0
    assert without_seconds(rows(out / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "log.csv").write_text("my,own,notes\n")
    assert main(TRAIN + ["--out", str(tmp_path / "other")]) == 2
    assert "is not a training log" in capsys.readouterr().err


@pytest.mark.parametrize("failing_step", [4, 8])
def test_a_checkpoint_that_cannot_be_written_ends_with_one_line_and_the_run_resumes(reference, tmp_path, monkeypatch, capsys,
                                                                                    failing_step):
    savez, calls = np.savez, []

    def full_disk(f, **arrays):
        calls.append(1)
        if len(calls) == failing_step // 4:
            f.write(b"PK\x03\x04 part of a file")
            raise OSError(28, "No space left on device")
        return savez(f, **arrays)

    monkeypatch.setattr(np, "savez", full_disk)
    out = tmp_path / "run"
    assert main(TRAIN + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m app train: cannot write {out / 'checkpoint.npz.tmp'} (No space left on device); ")
    assert len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    if failing_step == 4:  # the first checkpoint: nothing to resume, nothing left
        assert "run the same command again, without --resume" in err and not out.exists()
        assert main(TRAIN + ["--out", str(out)]) == 0
    else:
        assert "continue with the same options and --resume" in err
        assert train.load_checkpoint(out / "checkpoint.npz", QUICK).step == 4
        assert main(TRAIN + ["--out", str(out), "--resume"]) == 0
    assert without_seconds(rows(out / "log.csv")) == without_seconds(rows(reference.out / "log.csv"))


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_every_step_is_adamw_with_the_runs_schedule_decay_and_clipping(tmp_path, monkeypatch, clip):
    """The optimiser gets the learning rate of the step's schedule, the decay, and the clip (0: none)."""
    from app import optim

    config = QUICK._replace(steps=6, clip=clip, weight_decay=0.05)
    calls, adam_step = [], optim.adam_step

    def recording(params, grads, state, **kw):
        calls.append((state.step, kw))
        return adam_step(params, grads, state, **kw)

    monkeypatch.setattr(optim, "adam_step", recording)
    train.train(config, tmp_path, progress=False)
    steps = [(t, kw) for t, kw in calls][: config.steps]  # the last call measures the peak memory of a step
    assert [t for t, _ in steps] == list(range(config.steps))
    for t, kw in steps:
        assert kw == {"lr": train.learning_rate(config, t + 1), "weight_decay": 0.05, "clip_norm": clip or None}, t
    norms = [float(r[3]) for r in rows(tmp_path / "log.csv")[1:]]
    assert clip == 0 or max(norms) > clip  # the log has the norm before clipping


def test_an_update_that_leaves_a_parameter_non_finite_stops_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    """A NaN that the update puts into a parameter is a divergence at that step, never written into a checkpoint."""
    from app import optim

    adam_step = optim.adam_step

    def spoiling(params, grads, state, **kw):
        new, s, norm = adam_step(params, grads, state, **kw)
        if s.step == 4:
            new = {**new, "head.b": np.full_like(new["head.b"], np.nan)}
        return new, s, norm

    monkeypatch.setattr(optim, "adam_step", spoiling)
    with pytest.raises(ValueError, match="lr: training diverged at step 4: the parameter head.b is not finite"):
        train.train(QUICK, tmp_path / "run", progress=False, stop_after=4)
    assert not (tmp_path / "run").exists()


def test_listops_is_trimmed_to_its_longest_expression_and_nothing_else():
    config = QUICK._replace(max_len=60)
    trimmed, full = train.load_data(config), train.load_data(config._replace(trim=False))
    width = max(int(np.max(np.sum(x != train.tasks.PAD_ID, axis=1))) for x, _ in full.values())
    assert width < config.max_len
    for split in full:
        x, y = trimmed[split]
        assert x.shape[1] == width and np.array_equal(y, full[split][1])
        np.testing.assert_array_equal(x, full[split][0][:, :width])
        assert np.all(full[split][0][:, width:] == train.tasks.PAD_ID)  # only padding was cut


@pytest.mark.parametrize("argv, step", [([], 4), (["--eval-every", "6"], 6), (["--stop-after", "2"], 2), (["--steps", "3"], 3)])
def test_resume_without_a_checkpoint_names_the_step_of_the_first_one(reference, tmp_path, capsys, argv, step):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.csv").write_text(",".join(train.LOG_COLUMNS) + "\n")
    assert main(TRAIN + ["--out", str(out), "--resume", *argv]) == 2
    assert f"stopped before its first checkpoint (step {step})" in capsys.readouterr().err


def test_a_packed_run_logs_the_losses_of_the_padded_run_on_the_same_batches(tmp_path):
    """The causal language model: packing every batch (cu_seqlens) changes no loss, accuracy or gradient norm."""
    config = QUICK._replace(task="markov", steps=6, eval_every=3)
    padded = train.train(config, tmp_path / "padded", progress=False)
    packed = train.train(config._replace(pack=True), tmp_path / "packed", progress=False)
    a, b = rows(padded.out / "log.csv"), rows(packed.out / "log.csv")
    assert a[0] == b[0] and len(a) == len(b) == 7
    numbers = [i for i, name in enumerate(a[0]) if name not in ("step", "seconds")]
    for ra, rb in zip(a[1:], b[1:]):
        assert [x == "" for x in ra] == [x == "" for x in rb]
        np.testing.assert_allclose([float(rb[i]) for i in numbers if ra[i]], [float(ra[i]) for i in numbers if ra[i]], rtol=1e-12)
    np.testing.assert_allclose(packed.test_loss, padded.test_loss, rtol=1e-12)
