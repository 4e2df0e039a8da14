"""The continual-recall experiment: its stream, its memories and its sweep."""

import numpy as np
import pytest

from app.experiments import continual as c
from app.experiments import load, sweep
from refimpl.ovq import ovq_attention, unit_rows


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("continual_quick")
    return sweep.run(load("continual"), quick=True, seeds=1, jobs=1, out=out, progress=False)


def test_quick_sweep_full_attention_recalls_every_task_and_the_table_has_every_method(quick_rows):
    assert len(quick_rows) == len(c.grid(True, 1))
    softmax = next(r for r in quick_rows if r["method"] == "softmax")
    n = c.QUICK["N_TASKS"]
    assert all(softmax[f"after{a}_task{b}"] == 1.0 for a in range(n) for b in range(a + 1))
    # the tasks the quick stream does not have are written as 0
    assert all(softmax[f"after{a}_task0"] == 0.0 for a in range(n, c.N_TASKS))
    text = c.table(quick_rows)
    assert all(f"\n{m} " in text for m in c.METHODS)


def test_the_stream_shifts_its_key_distribution_from_task_to_task():
    s = c.make_stream(4, 16, seed=3)
    T = 4 * c.WRITES * 16
    assert s["k"].shape == (T, c.D) and s["v"].shape == (T, c.D_V) and s["clean"].shape == (64, c.D)
    assert np.array_equal(s["phase"], np.repeat(np.arange(4), c.WRITES * 16))
    centre = unit_rows(np.stack([s["clean"][16 * a : 16 * (a + 1)].mean(axis=0) for a in range(4)]))
    within = np.mean([s["clean"][16 * a : 16 * (a + 1)] @ centre[a] for a in range(4)])
    across = np.mean([s["clean"][16 * a : 16 * (a + 1)] @ centre[(a + 1) % 4] for a in range(4)])
    assert within > 0.6 and abs(across) < 0.2, (within, across)
    held = c.make_stream(4, 16, seed=3, held_out=True)
    assert np.array_equal(held["clean"], s["clean"]) and np.array_equal(held["values"], s["values"])
    assert not np.array_equal(held["k"], s["k"])


def test_the_delta_rule_stores_the_last_value_exactly_and_the_decayed_sum_matches_its_closed_form():
    rng = np.random.default_rng(0)
    k, v = unit_rows(rng.normal(size=(7, c.D))), rng.normal(size=(7, c.D_V))
    delta = c._Linear("delta", 40, np.random.default_rng(1), gamma=1.0)
    delta.write(k, v)
    np.testing.assert_allclose(delta.read(k[-1:]), v[-1:], rtol=1e-12, atol=1e-12)
    gamma = 0.9
    decayed = c._Linear("linear_decay", 40, np.random.default_rng(1), gamma=gamma)
    decayed.write(k, v)
    phi = c._features("linear_decay", decayed.P, k)
    weights = gamma ** np.arange(6, -1, -1)  # S_T = sum_t gamma^(T - 1 - t) phi_t v_t^T
    np.testing.assert_allclose(decayed.S, (phi * weights[:, None]).T @ v, rtol=1e-12)
    np.testing.assert_allclose(decayed.z, weights @ phi, rtol=1e-12)


def test_ovq_is_fed_the_stream_phase_by_phase_as_one_call_would_be():
    s = c.make_stream(3, 8, seed=1)
    memory = c._OVQ(16, seed=1, growth="plateau")
    for a in range(3):
        phase = s["phase"] == a
        memory.write(s["k"][phase], s["v"][phase])
    _, whole = ovq_attention(s["k"], s["k"], s["v"], max_size=16, chunk_size=c.CHUNK, beta=c.BETA, seed=1,
                             return_state=True)
    np.testing.assert_array_equal(np.asarray(memory.state.keys), np.asarray(whole.keys))
    np.testing.assert_array_equal(np.asarray(memory.state.counts), np.asarray(whole.counts))


def test_the_dictionary_read_out_is_the_count_weighted_softmax_over_live_centroids():
    rng = np.random.default_rng(2)
    keys, values = unit_rows(rng.normal(size=(5, c.D))), rng.normal(size=(5, c.D_V))
    counts = np.array([3.0, 0.0, 1.0, 7.0, 2.0])
    q = unit_rows(rng.normal(size=(4, c.D)))
    logits = c.BETA * q @ keys.T + np.log(np.where(counts > 0, counts, 1.0))
    logits[:, counts == 0] = -np.inf  # a centroid with no token is not read
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(c._read_dictionary(q, keys, values, counts), (w / w.sum(axis=1, keepdims=True)) @ values,
                               rtol=1e-12)


def test_every_sized_method_gets_about_the_same_state():
    floats = {m: c.recall_matrix(m, 16, 0, n_tasks=2, bindings=4)[1] for m in c.SIZED}
    ovq = 16 * (c.D + c.D_V + 1)
    assert floats["ovq"] == floats["vq"] == ovq
    assert all(abs(floats[m] - ovq) <= c.D_V + 1 for m in ("linear", "linear_decay"))
    assert 0.9 * ovq < floats["delta"] < ovq  # m d_v: a little under


def test_summary_forgetting_is_the_drop_from_each_tasks_best():
    row = {"tasks": 3, "budget": 4, "method": "ovq", "seed": 0, "state_floats": 1.0,
           "after0_task0": 1.0, "after1_task0": 0.5, "after1_task1": 0.9, "after2_task0": 0.25, "after2_task1": 0.6,
           "after2_task2": 0.8}
    s = c.summary([row])[("ovq", 4)]
    assert s["earlier"][0] == pytest.approx((0.25 + 0.6) / 2)
    assert s["newest"][0] == 0.8
    assert s["forgetting"][0] == pytest.approx(((1.0 - 0.25) + (0.9 - 0.6)) / 2)
    np.testing.assert_array_equal(s["first_task"][0], [1.0, 0.5, 0.25])
