"""The in-context recall experiment (:mod:`app.experiments.recall`): its sweep, its methods, its tasks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refimpl.attention import softmax_attention
from app.experiments import load, sweep
from app.experiments import recall


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick sweep, one seed, one process: its rows and its CSV file."""
    out = tmp_path_factory.mktemp("recall_quick")
    rows = sweep.run(load("recall"), quick=True, seeds=1, jobs=1, out=out, progress=False)
    return rows, out / "recall.csv"


def _mean(rows, task, method):
    return float(np.mean([r["accuracy"] for r in rows if r["task"] == task and r["method"] == method]))


def test_quick_sweep_rows_are_finite_accuracies(quick):
    rows, _ = quick
    assert len(rows) == len(recall.grid(True, 1))
    assert {r["method"] for r in rows} == set(recall.METHODS)
    assert {r["task"] for r in rows} == set(recall.TASKS)
    for r in rows:
        assert all(math.isfinite(r[m]) for m in recall.METRICS), r
        assert 0.0 <= r["accuracy"] <= 1.0, r
        assert 0.0 < r["state_fraction"] <= 1.0, r
    assert recall.TIMINGS == ()


def test_full_attention_recalls_and_the_small_states_do_worse(quick):
    rows, _ = quick
    associative = [r for r in rows if r["task"] == "associative"]
    # the easy instance: every associative query of full attention is answered
    assert min(r["accuracy"] for r in associative if r["method"] == "softmax") >= 0.95
    # linear attention's d x d_v state cannot hold T / 16 bindings: near chance
    assert _mean(rows, "associative", "linear") <= 0.3
    # a static codebook fitted to another sequence's keys: far below full attention
    assert _mean(rows, "associative", "vq") <= _mean(rows, "associative", "softmax") - 0.3


def test_jobs_do_not_change_the_result_file(quick, tmp_path):
    _, one_job = quick
    sweep.run(load("recall"), quick=True, seeds=1, jobs=2, out=tmp_path, progress=False)
    assert (tmp_path / "recall.csv").read_bytes() == one_job.read_bytes()


def test_resume_runs_only_the_missing_point(quick, tmp_path, monkeypatch):
    _, complete = quick
    lines = complete.read_bytes().splitlines(keepends=True)
    (tmp_path / "recall.csv").write_bytes(b"".join(lines[:-1]))  # the last data line lost
    calls = []
    run_point = recall.run_point

    def counting(point):
        calls.append(dict(point))
        return run_point(point)

    monkeypatch.setattr(recall, "run_point", counting)
    sweep.run(load("recall"), quick=True, seeds=1, jobs=1, out=tmp_path, progress=False)
    assert len(calls) == 1
    assert sweep.point_key(recall, calls[0]) == tuple(lines[-1].decode().strip().split(",")[: len(recall.PARAMS)])
    assert (tmp_path / "recall.csv").read_bytes() == complete.read_bytes()


@pytest.mark.parametrize("T, block", [(203, 64), (128, 64), (50, 7)])
def test_row_blocked_softmax_equals_softmax_attention(T, block):
    rng = np.random.default_rng(T)
    q, k, v = rng.normal(size=(T, 8)), rng.normal(size=(T, 8)), rng.normal(size=(T, 3))
    expected = softmax_attention(q, k, v, scale=1.7, causal=True)
    every_row = recall.causal_softmax_rows(q, k, v, np.arange(T), beta=1.7, block=block)
    np.testing.assert_allclose(every_row, expected, rtol=0, atol=1e-12)
    some = rng.permutation(T)[: T // 3]  # a subset, in any order
    np.testing.assert_allclose(recall.causal_softmax_rows(q, k, v, some, beta=1.7, block=block), expected[some],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("task", recall.TASKS)
def test_task_keys_values_and_targets(task):
    T = 1024
    data = recall.make_task(task, T, seed=3)
    M = T // recall.WRITES
    k, clean, values, written = data["k"], data["clean"], data["values"], data["written"]
    rows, targets = data["rows"], data["targets"]
    np.testing.assert_allclose(np.linalg.norm(k, axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(clean, axis=1), 1.0, atol=1e-12)
    assert clean.shape == (M, recall.D) and values.shape == (M, recall.D_V)
    # distinct keys and values: no two bindings alike
    off_diagonal = ~np.eye(M, dtype=bool)
    assert np.max((clean @ clean.T)[off_diagonal]) < 0.95
    assert np.max((values @ values.T)[off_diagonal]) < 0.95
    np.testing.assert_array_equal(data["v"], values[written])
    # a query is the clean key of a binding written before it, not the one its own token writes
    np.testing.assert_array_equal(data["q"][rows], clean[targets])
    for row, target in zip(rows, targets):
        assert target != written[row]
        assert np.any(written[:row] == target)
    # the same sequence from the same seed
    again = recall.make_task(task, T, seed=3)
    assert all(np.array_equal(data[name], again[name]) for name in data)


def test_positional_answer_is_the_most_recent_binding_of_the_base_key():
    T = 1024
    data = recall.make_task("positional", T, seed=5)
    length, P = T // recall.SEGMENTS, T // recall.WRITES // recall.SEGMENTS
    written, base, segment = data["written"], data["base"], data["segment"]
    # every base key is bound to a different value in every segment
    per_base = data["values"].reshape(recall.SEGMENTS, P, recall.D_V)
    for p in range(P):
        assert np.linalg.matrix_rank(per_base[:, p]) == recall.SEGMENTS
    for row, target in zip(data["rows"], data["targets"]):
        assert segment[target] == row // length  # the binding of the query's own segment
        earlier = np.flatnonzero(base[written[:row]] == base[target])
        assert written[earlier[-1]] == target  # the most recent occurrence of its base key
        assert np.any(segment[written[earlier]] < segment[target])  # earlier bindings of it exist, and are wrong


# ----------------------------------------------------------------------------- the metrics against their formulas


def test_accuracy_is_the_share_of_outputs_nearest_their_target():
    values = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [-1.0, 0, 0]])
    out = np.array([[0.9, 0.1, 0], [0.1, 0.2, 0.9], [0, 0, 2.0], [-0.5, 0.4, 0]])  # nearest: 0, 2, 2, 3
    assert recall.accuracy(out, values, np.array([0, 2, 2, 3])) == 1.0
    assert recall.accuracy(out, values, np.array([0, 1, 2, 0])) == 0.5
    assert recall.accuracy(out, values, np.array([1, 1, 1, 1])) == 0.0


@pytest.mark.parametrize("method", recall.METHODS)
def test_the_state_fraction_of_every_method_is_its_formula(method):
    """Floats kept over the KV cache's T (d + d_v), as the module docstring counts them."""
    T, f = 256, 1 / 8
    N = int(T * f)
    point = {"task": "associative", "T": T, "fraction": 0.0 if method in recall.UNSIZED else f, "method": method, "seed": 0}
    kv = T * (recall.D + recall.D_V)
    expected = {
        "softmax": 1.0,
        "linear": recall.D * (recall.D_V + 1) / kv,  # S = sum phi(k) v^T, z = sum phi(k)
        "gma": N * (2 * recall.D + 1 + recall.D_V + 1) / kv,  # means, variances, weights; sum gamma v^T, sum gamma
    }.get(method, N * (recall.D + recall.D_V + 1) / kv)  # codes or key means, value means, counts
    got = recall.run_point(point)
    assert got["state_fraction"] == pytest.approx(expected, rel=1e-15)
    assert 0 <= got["accuracy"] <= 1


def test_the_table_gives_mean_and_population_std_over_seeds():
    rows = [{"task": "associative", "T": 256, "fraction": 0.125, "method": "ovq", "seed": s, "accuracy": a, "state_fraction": 0.1}
            for s, a in enumerate([0.25, 0.75, 0.5])]
    rows += [{"task": "associative", "T": 256, "fraction": 0.0, "method": "softmax", "seed": 0, "accuracy": 1.0, "state_fraction": 1.0}]
    line = [line for line in recall.table(rows).splitlines() if line.startswith("associative")]
    assert len(line) == 1
    spread = float(np.sqrt(((0.25 - 0.5) ** 2 + (0.75 - 0.5) ** 2) / 3))
    assert f"0.500 ± {spread:.3f}" in line[0] and "1.000 ± 0.000" in line[0]  # ovq; softmax repeated on the line


@pytest.mark.parametrize("task", recall.TASKS)
def test_the_scored_positions_lie_in_the_window(task):
    T = 1024
    rows = recall.make_task(task, T, seed=1)["rows"]
    low = T // 2 if task == "associative" else T - T // recall.SEGMENTS // 2
    assert rows.min() >= low and rows.max() < T and rows.size == min(recall.QUERIES, T - low)


def test_spherical_kmeans_moves_codes_to_the_unit_mean_of_their_members():
    x = recall.unit_rows(np.array([[1.0, 0.1], [1.0, -0.3], [0.1, 1.0], [-0.2, 1.0], [0.0, 1.0]]))
    codes = recall.spherical_kmeans(x, np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]), 1)
    np.testing.assert_allclose(codes[0], recall.unit_rows(x[:2].sum(0, keepdims=True))[0], rtol=1e-15)
    np.testing.assert_allclose(codes[1], recall.unit_rows(x[2:].sum(0, keepdims=True))[0], rtol=1e-15)
    np.testing.assert_array_equal(codes[2], [-1.0, 0.0])  # a code that wins no row stays where it was


def test_vq_reads_a_codebook_fitted_to_another_sequence(monkeypatch):
    """VQ's codebook is fitted to the keys of the sequence of seed + 1_000_003, never to the one it reads."""
    seen = []
    make_task = recall.make_task
    monkeypatch.setattr(recall, "make_task", lambda task, T, seed: seen.append(seed) or make_task(task, T, seed))
    recall.run_point({"task": "associative", "T": 256, "fraction": 0.125, "method": "vq", "seed": 4})
    assert seen == [4, 4 + 1_000_003]


@pytest.mark.parametrize("task", recall.TASKS)
def test_each_written_key_is_its_clean_key_plus_noise_of_norm_about_the_stated_one(task):
    """k = unit(C + 0.3 g / sqrt(d)): cos(k, C) = 1 / sqrt(1 + 0.3^2) up to the spread of ||g|| / sqrt(d)."""
    data = recall.make_task(task, 1024, seed=2)
    cos = np.sum(data["k"] * data["clean"][data["written"]], axis=1)
    assert np.mean(cos) == pytest.approx(1 / np.sqrt(1 + recall.NOISE**2), abs=0.01)


# ----------------------------------------------------------------------------- GMA's mixture


def test_gma_runs_at_every_length_of_the_sweep():
    lengths = {p["T"] for p in recall.grid(False, 1) if p["method"] == "gma"}
    assert lengths == set(recall.T_SWEEP) | {recall.T_FRACTIONS}
    assert max(recall.T_SWEEP) <= recall.GMA_MAX_T


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_gma_mixture_is_exact_em_streamed(backend_name):
    """The fit is EM_STEPS steps of refimpl.gmm.em_step, to rounding, computed EM_BLOCK_ROWS keys at a time."""
    from refimpl import gmm
    from app import backend

    if backend_name == "numba" and not backend.available():
        pytest.skip("numba is not installed")
    kern = backend.kernels(backend_name)
    k = recall.make_task("associative", 1024, 0)["k"]
    K = 128
    fitted = recall._fit_gmm(k, K, np.random.default_rng(7), recall._em_posterior(kern))
    rng = np.random.default_rng(7)
    means, variances, weights = k[rng.choice(k.shape[0], size=K, replace=False)], np.tile(k.var(axis=0), (K, 1)), np.full(K, 1 / K)
    for _ in range(recall.EM_STEPS):
        means, variances, weights = gmm.em_step(k, means, variances, weights, reg_covar=recall.REG_COVAR)
    assert k.shape[0] > recall.EM_BLOCK_ROWS  # more than one block
    for a, b in zip(fitted, (means, variances, weights)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)

