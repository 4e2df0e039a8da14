"""The in-context regression experiment: its task, its read-outs and its sweep."""

import numpy as np
import pytest

from refimpl import gmr, ovq
from app.experiments import load, sweep
from app.experiments import regression as reg


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


# ----------------------------------------------------------------------------- the metrics against their formulas


def test_normalised_mse_on_cases_with_known_answers():
    y = np.array([[1.0, 0.0], [3.0, 4.0], [2.0, 2.0]])  # column means 2, 2: sum ||y - mean||^2 = (1 + 4) + (1 + 4) + 0 = 10
    assert reg.normalised_mse(y, y) == 0.0
    assert reg.normalised_mse(np.broadcast_to(y.mean(axis=0), y.shape), y) == pytest.approx(1.0, rel=1e-15)
    assert reg.normalised_mse(y + np.array([1.0, -2.0]), y) == pytest.approx(3 * 5 / 10, rel=1e-15)
    # the mean is taken per output column, not over all entries
    assert reg.normalised_mse(np.full_like(y, 2.0), y) == pytest.approx(1.0, rel=1e-15)
    z = np.array([[0.0, 10.0], [2.0, 10.0]])
    assert reg.normalised_mse(np.array([[1.0, 10.0], [1.0, 10.0]]), z) == pytest.approx(1.0, rel=1e-15)


def test_vq_readout_is_the_count_weighted_softmax_over_the_used_codes():
    codebook = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    keys = reg.unit_rows(np.array([[1.0, 0.1], [1.0, -0.2], [0.3, 1.0]]))  # two join code 0, one code 1, none code 2
    values = np.array([[1.0], [3.0], [10.0]])
    q = np.array([[0.6, 0.8]])
    beta = 2.0
    # softmax_m(beta q . D_m + log L_m) U_m over the used codes 0 (L = 2, U = 2) and 1 (L = 1, U = 10)
    logits = np.array([beta * 0.6 + np.log(2.0), beta * 0.8 + np.log(1.0)])
    w = np.exp(logits - logits.max())
    w /= w.sum()
    expected = w[0] * 2.0 + w[1] * 10.0
    np.testing.assert_allclose(reg.vq_readout(q, keys, values, codebook, beta=beta), [[expected]], rtol=1e-14)


def test_kmeans_codebook_gives_unit_codes_at_the_means_of_their_members():
    # the codes start at the first two keys; each cluster is symmetric about them
    keys = reg.unit_rows(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.2], [1.0, -0.2], [0.1, 1.0], [-0.1, 1.0]]))
    codes = reg.kmeans_codebook(keys, 2, steps=3)
    np.testing.assert_allclose(np.linalg.norm(codes, axis=1), 1.0, rtol=1e-15)
    np.testing.assert_allclose(codes[0], [1.0, 0.0], atol=1e-15)  # the mean of the first cluster, renormalised
    np.testing.assert_allclose(codes[1], [0.0, 1.0], atol=1e-15)


def test_the_mean_method_predicts_the_context_mean_and_the_scale_default_is_sqrt_d():
    task = reg.make_task(np.random.default_rng(2), 2, 64, 5)
    other = reg.make_task(np.random.default_rng(3), 2, 64, 1)
    preds = reg.predictions(task, other, beta=3.0, memory=8)
    np.testing.assert_array_equal(preds["mean"], np.broadcast_to(task.values.mean(axis=0), task.targets.shape))
    assert reg._beta("default") == np.sqrt(reg.D_CODE + reg.D_X) and reg._beta(32.0) == 32.0


def test_the_table_gives_mean_and_population_std_over_seeds():
    rows = [{"functions": 2, "context": 64, "memory": 8, "beta": "default", "seed": s,
             **{f"nmse_{m}": v for m in reg.METHODS}} for s, v in enumerate([0.2, 0.6])]
    line = reg.table(rows).splitlines()[-1]
    assert line.split()[:5] == [f"{np.sqrt(66):.2f}", "8", "2", "64", "2"]
    assert line.count("0.400 +- 0.200") == len(reg.METHODS)


def test_vq_reads_a_codebook_fitted_to_another_sequence_and_vq_own_its_own(monkeypatch):
    task = reg.make_task(np.random.default_rng(4), 2, 64, 5)
    other = reg.make_task(np.random.default_rng(5), 2, 64, 1)
    fitted, kmeans_codebook = [], reg.kmeans_codebook
    monkeypatch.setattr(reg, "kmeans_codebook", lambda keys, size: fitted.append(keys) or kmeans_codebook(keys, size))
    reg.predictions(task, other, beta=3.0, memory=8)
    assert len(fitted) == 2 and fitted[0] is other.keys and fitted[1] is task.keys
