"""app.backend: the choice of kernels, and the same training curves and experiment metrics with either.

The model, ``python -m app train`` and the experiments call numba's fused
kernels (:mod:`cpu`) when numba is installed and NumPy otherwise; the two give
the same numbers to rounding.  Fifty training steps on each backend follow
the same curve (losses to 1e-9 relative in float64: the rounding differences
of the kernels grow a little through the optimiser, never to a visible
change), and the experiments' metrics at ``--quick`` are the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app import backend, model, train

ROOT = Path(__file__).resolve().parents[1]
numba = pytest.importorskip("numba")


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv(backend.ENV, raising=False)
    previous = backend.use(None)
    yield
    backend.use(previous)


def test_the_default_is_numba_where_it_is_installed(monkeypatch):
    assert backend.current() == "numba"
    monkeypatch.setattr(backend, "available", lambda: False)
    assert backend.current() == "numpy"
    with pytest.raises(ValueError, match="backend: 'numba' needs numba, which is not installed"):
        backend.use("numba")


def test_use_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.setenv(backend.ENV, "numpy")
    assert backend.current() == "numpy" and backend.kernels().name == "numpy"
    backend.use("numba")
    assert backend.current() == "numba" and backend.kernels().name == "numba"
    backend.use(None)
    assert backend.current() == "numpy"
    monkeypatch.setenv(backend.ENV, "cuda")
    with pytest.raises(ValueError, match=r"REFIMPL_BACKEND: expected one of 'numpy', 'numba', got 'cuda'"):
        backend.current()
    with pytest.raises(ValueError, match=r"backend: expected one of 'numpy', 'numba', got 'torch'"):
        backend.use("torch")


def test_the_kernels_of_each_backend_come_from_their_package():
    from cpu import gma as cpu_gma
    from refimpl import tuned

    assert backend.kernels("numba").gma_forward is cpu_gma.gma_forward
    assert backend.kernels("numpy").gma_forward is tuned.gma_forward


def _run(name, mixer, tmp_path, steps=50):
    backend.use(name)
    config = train.quick_config(mixer=mixer, steps=steps, eval_every=10)
    return train.train(config, tmp_path / f"{mixer}-{name}", progress=False)


def _log(result):
    import csv

    with open(result.out / train.LOG_NAME, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("mixer", model.MIXERS)
def test_fifty_training_steps_follow_the_same_curve(mixer, tmp_path):
    a, b = _run("numpy", mixer, tmp_path), _run("numba", mixer, tmp_path)
    log_a, log_b = _log(a), _log(b)
    assert len(log_a) == len(log_b) > 0
    for ra, rb in zip(log_a, log_b):
        assert ra["step"] == rb["step"]
        for key in ("train_loss", "val_loss"):
            if key in ra and ra[key] not in ("", None):
                np.testing.assert_allclose(float(rb[key]), float(ra[key]), rtol=1e-9, err_msg=f"{key} at step {ra['step']}")
    for name, p in a.params.items():
        np.testing.assert_allclose(b.params[name], p, rtol=1e-7, atol=1e-9, err_msg=name)
    assert a.val_accuracy == b.val_accuracy and a.test_accuracy == b.test_accuracy


@pytest.mark.parametrize("experiment", ["recall", "regression"])
def test_the_experiments_give_the_same_metrics_with_either_backend(experiment, tmp_path):
    import csv

    rows = {}
    for name in backend.BACKENDS:
        out = tmp_path / name
        cmd = [sys.executable, "-m", "app", "experiment", experiment, "--quick", "--seeds", "1", "--no-progress",
               "--backend", name, "--out", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr
        with open(out / f"{experiment}.csv", newline="") as f:
            rows[name] = list(csv.DictReader(f))
    from app.experiments import load

    module = load(experiment)
    assert len(rows["numpy"]) == len(rows["numba"]) > 0
    for ra, rb in zip(rows["numpy"], rows["numba"]):
        assert all(ra[p] == rb[p] for p in module.PARAMS)
        for metric in module.METRICS:
            np.testing.assert_allclose(float(rb[metric]), float(ra[metric]), rtol=1e-9, atol=1e-12, err_msg=f"{metric} at {ra}")


def test_a_bad_backend_option_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "available", lambda: False)
    from app.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--task", "listops", "--mixer", "gma", "--quick", "--backend", "cuda", "--out", str(tmp_path / "a")])
    assert exit_.value.code == 2
    assert main(["train", "--task", "listops", "--mixer", "gma", "--quick", "--backend", "numba", "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("mixer", ["softmax", "linear", "ovq", "gma"])
def test_a_mixer_the_numba_backend_gives_to_numpy_runs_numpys_functions(mixer, monkeypatch):
    """app.backend.FASTEST set to "numpy" for a mixer: the numba backend calls NumPy's functions (on the whole batch,
    as the reference takes it), and a training step's loss and gradients equal the cpu kernels' to rounding."""
    from refimpl import attention as ra
    from refimpl import ovq as ro
    from refimpl import tuned

    config = train.quick_config(mixer=mixer)
    mcfg = train.model_config(config)
    params = model.init_params(mcfg, 0)
    tokens, targets = (a[: config.batch_size] for a in train.load_data(config)["train"])
    backend.use("numba")
    want = model.loss_and_grads(params, tokens, targets, mcfg)
    monkeypatch.setitem(backend.FASTEST, mixer, "numpy")
    kern = backend.kernels("numba")
    numpy_forward = {"softmax": ra.softmax_attention_forward, "linear": ra.linear_attention_forward,
                     "ovq": ro.ovq_attention_forward, "gma": tuned.gma_forward}[mixer]
    assert getattr(kern, f"{'gma' if mixer == 'gma' else mixer + '_attention'}_forward") is numpy_forward
    got = model.loss_and_grads(params, tokens, targets, mcfg)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    assert got[1:3] == want[1:3]
    for name in want[3]:
        np.testing.assert_allclose(got[3][name], want[3][name], rtol=1e-7, atol=1e-10, err_msg=name)
