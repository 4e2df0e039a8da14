"""The in-context regression experiment: its task, its read-outs and its sweep."""

import numpy as np
import pytest

from refimpl import gmr, ovq
from refimpl.experiments import load, sweep
from refimpl.experiments import regression as reg


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("regression_quick")
    rows = sweep.run(load("regression"), quick=True, seeds=1, jobs=1, out=out, progress=False)
    return rows, out


def test_quick_sweep_is_finite_and_full_attention_solves_one_function(quick_rows):
    rows, _ = quick_rows
    assert len(rows) == len(reg.grid(True, 1))
    for row in rows:
        assert all(np.isfinite(row[m]) for m in reg.METRICS), row
        # a predictor that ignores the key (the context's mean value) scores about 1
        assert 0.8 < row["nmse_mean"] < 1.3, row
    for row in (r for r in rows if r["functions"] == 1):
        # one function, 256 pairs on the circle: kernel regression follows W x closely
        assert row["nmse_full"] < 0.1, row
        assert row["nmse_full"] < 0.2 * row["nmse_mean"], row


def test_sweep_csv_does_not_depend_on_jobs(quick_rows, tmp_path):
    _, out1 = quick_rows
    sweep.run(load("regression"), quick=True, seeds=1, jobs=2, out=tmp_path, progress=False)
    assert reg.TIMINGS == ()
    assert (tmp_path / "regression.csv").read_bytes() == (out1 / "regression.csv").read_bytes()


@pytest.mark.parametrize("F", [1, 5])
def test_task_keys_are_unit_and_values_are_the_right_map(F):
    task = reg.make_task(np.random.default_rng(3), F, 20 * F, 30)
    for keys, values, fs, xs in (
        (task.keys, task.values, task.functions, task.inputs),
        (task.queries, task.targets, task.query_functions, task.query_inputs),
    ):
        np.testing.assert_allclose(np.linalg.norm(keys, axis=1), 1.0, rtol=0, atol=1e-14)
        # the key carries the function (its code half) and the input (its other half)
        code_half, input_half = keys[:, : reg.D_CODE] * np.sqrt(2), keys[:, reg.D_CODE :] * np.sqrt(2)
        np.testing.assert_array_equal(np.argmax(code_half @ task.codes.T, axis=1), fs)
        np.testing.assert_allclose(code_half, task.codes[fs], rtol=0, atol=1e-15)
        np.testing.assert_allclose(input_half, xs, rtol=0, atol=1e-15)
        # v = W_f x with the f of the key, computed here row by row
        expected = np.stack([task.maps[f] @ x for f, x in zip(fs, xs)])
        np.testing.assert_allclose(values, expected, rtol=1e-14, atol=1e-14)
        if F > 1:
            other = np.stack([task.maps[(f + 1) % F] @ x for f, x in zip(fs, xs)])
            assert np.min(np.linalg.norm(values - other, axis=1)) > 1e-6
    # T / F pairs per function
    np.testing.assert_array_equal(np.bincount(task.functions, minlength=F), np.full(F, 20))


def test_readouts_are_the_library_attention_outputs_for_a_query_after_the_context():
    """OVQ/VQ read-out of the context = the causal output of a query in its own chunk after it.

    Giving that query the predicted value as its own value leaves the output
    unchanged exactly when the read-out of the context is the prediction.
    """
    task = reg.make_task(np.random.default_rng(7), 4, 256, 3)
    other = reg.make_task(np.random.default_rng(8), 4, 256, 1)
    beta, N, C = 9.0, 32, reg.CHUNK
    for i in range(3):
        q = task.queries[i : i + 1]
        keys = np.concatenate([task.keys, q])
        pred = gmr.ovq_readout(q, *reg.ovq_memory(task.keys, task.values, max_size=N, beta=beta), beta=beta)
        out = ovq.ovq_attention(keys, keys, np.concatenate([task.values, pred]), max_size=N, chunk_size=C, beta=beta)
        np.testing.assert_allclose(out[-1], pred[0], rtol=0, atol=1e-12)
        codebook = reg.kmeans_codebook(other.keys, N)
        pred = reg.vq_readout(q, task.keys, task.values, codebook, beta=beta)
        out = ovq.vq_attention(keys, keys, np.concatenate([task.values, pred]), codebook, chunk_size=C, beta=beta)
        np.testing.assert_allclose(out[-1], pred[0], rtol=0, atol=1e-12)
