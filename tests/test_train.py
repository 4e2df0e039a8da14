"""refimpl.train and ``python -m refimpl train``: a run end to end, resumption bit for bit, refused checkpoints and options."""

from __future__ import annotations

import csv
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refimpl import train
from refimpl.__main__ import main

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
        [sys.executable, "-m", "refimpl", "train", "--task", "listops", "--mixer", "gma", "--quick", "--no-progress",
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
