"""OVQ and VQ attention: loop oracle vs vectorised, streaming, save/load, ablation switches, edge sizes, validation."""


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refimpl import gmr, ovq
from refimpl.attention import softmax_attention
from refimpl.ovq_oracle import ovq_attention_loop, vq_attention_loop
from refimpl.testing import TOL, assert_same_state, assignment_plan


def qkv(seed, N, d=4, d_v=3, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(N, n)).astype(dtype) for n in (d, d, d_v)]


SWITCHES = [
    {},
    {"growth": "linear"},
    {"init": "random", "seed": 11},
    {"count_bias": False},
    {"learning_rate": 0.07},
    {"beta": 7.5},
]

SIZES = [  # (N, chunk_size, max_size): N not a multiple of C, C = 1, n_max = 1, N = 1, C > N
    (61, 8, 12),
    (40, 1, 6),
    (33, 5, 1),
    (1, 4, 3),
    (19, 32, 5),
]


# --- loop oracle == vectorised -----------------------------------------------------------


@pytest.mark.parametrize("N, C, n_max", SIZES)
@pytest.mark.parametrize("kw", SWITCHES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_vectorised_equals_loop_oracle(N, C, n_max, kw):
    q, k, v = qkv(N * 31 + C, N)
    out, state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ovq_attention_loop(q, k, v, max_size=n_max, chunk_size=C, **kw)
    assert_same_state(state, ref_state)
    np.testing.assert_allclose(out, ref_out, **TOL[np.float64])


@given(
    N=st.integers(1, 40),
    C=st.integers(1, 12),
    n_max=st.integers(1, 15),
    d=st.integers(1, 5),
    d_v=st.integers(1, 4),
    kw=st.sampled_from(SWITCHES),
    seed=st.integers(0, 2**16),
)
def test_vectorised_equals_loop_oracle_at_awkward_sizes(N, C, n_max, d, d_v, kw, seed):
    q, k, v = qkv(seed, N, d=d, d_v=d_v)
    out, state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    ref_out, ref_state = ovq_attention_loop(q, k, v, max_size=n_max, chunk_size=C, **kw)
    assert_same_state(state, ref_state)
    np.testing.assert_allclose(out, ref_out, **TOL[np.float64])


def test_vectorised_equals_loop_oracle_float32():
    q, k, v = qkv(3, 50, d=5, d_v=4, dtype=np.float32)
    out, state = ovq.ovq_attention(q, k, v, max_size=10, chunk_size=7, return_state=True)
    ref_out, ref_state = ovq_attention_loop(q, k, v, max_size=10, chunk_size=7)
    assert out.dtype == np.float32 and state.keys.dtype == np.float32 and state.counts.dtype == np.int64
    assert_same_state(state, ref_state)
    np.testing.assert_allclose(out, ref_out, **TOL[np.float32])


def test_float32_meets_its_tolerance_against_float64():
    q, k, v = qkv(4, 90, d=6, d_v=5)
    out64, c64 = ovq.ovq_attention_forward(q, k, v, max_size=16, chunk_size=9)
    out32, c32 = ovq.ovq_attention_forward(*(a.astype(np.float32) for a in (q, k, v)), max_size=16, chunk_size=9)
    assert np.array_equal(assignment_plan(c64), assignment_plan(c32))  # same assignments, so the comparison is like for like
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, **TOL[np.float32])
    np.testing.assert_allclose(c32.state.keys, c64.state.keys, **TOL[np.float32])


def test_assignment_and_seeding_ties_go_to_the_lowest_index():
    # exact dot products (0, +-1) so that ties are real ties
    e1, e2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    k = np.stack([e1, e2, e2, -e1, -e1, e2, e1, -e2])
    q = np.ones_like(k)
    v = np.arange(16.0).reshape(8, 2)
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=3, chunk_size=4, growth="linear")
    first = cache.records[0]
    # first chunk, linear growth: n' = min(4, 3) = 3; scores against key 0 are [0, 0, -1] for keys 1, 2, 3:
    # key 3 (score -1), then key 1 (tied with key 2, lower index) seed centroids 1 and 2; key 2 joins 0
    assert first.seeds.tolist() == [0, 3, 1]
    assert first.rows.tolist() == [0, 2, 0, 1]
    # the whole sequence, with the oracle's own tie handling
    _, st = ovq.ovq_attention(q, k, v, max_size=3, chunk_size=4, growth="linear", return_state=True)
    _, ref = ovq_attention_loop(q, k, v, max_size=3, chunk_size=4, growth="linear")
    assert_same_state(st, ref)
    # a key tied between centroids 1 and 2 joins 1: centroids e1 and e1 (duplicates)
    state = ovq.OVQState(np.stack([e2, e1, e1]), np.zeros((3, 2)), [1, 1, 1], 3, 3)
    _, cache = ovq.ovq_attention_forward(e1[None], e1[None], np.ones((1, 2)), max_size=3, chunk_size=1, state=state)
    assert cache.records[0].rows.tolist() == [1]


def test_zero_key_and_query_stay_finite():
    q, k, v = qkv(5, 12)
    q[3] = 0.0
    k[0] = 0.0
    k[7] = 0.0
    out, state = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=5, return_state=True)
    ref_out, ref_state = ovq_attention_loop(q, k, v, max_size=4, chunk_size=5)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(state.keys))
    assert_same_state(state, ref_state)
    np.testing.assert_allclose(out, ref_out, **TOL[np.float64])


# --- streaming and save/load ---------------------------------------------------------------


@pytest.mark.parametrize("kw", SWITCHES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_streaming_in_uneven_pieces_equals_one_call(kw):
    C, n_max, N = 6, 10, 6 * 13 + 4
    q, k, v = qkv(6, N)
    full_out, full_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    # pieces of 2, 5, 1 and 5 chunks, the last one ragged (5 C + 4 tokens)
    bounds = [0, 2 * C, 7 * C, 8 * C, N]
    state, outs = None, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, state = ovq.ovq_attention(q[lo:hi], k[lo:hi], v[lo:hi], max_size=n_max, chunk_size=C, state=state, return_state=True, **kw)
        outs.append(o)
    assert np.array_equal(np.concatenate(outs), full_out)
    assert_same_state(state, full_state)


def test_streaming_token_by_token_with_chunk_size_one():
    q, k, v = qkv(7, 30)
    full_out, full_state = ovq.ovq_attention(q, k, v, max_size=7, chunk_size=1, return_state=True)
    state, outs = None, []
    for i in range(30):
        o, state = ovq.ovq_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], max_size=7, chunk_size=1, state=state, return_state=True)
        outs.append(o)
    assert np.array_equal(np.concatenate(outs), full_out)
    assert_same_state(state, full_state)


def test_a_ragged_piece_restarts_the_chunk_grid():
    """Documented limit: a piece that is not a multiple of chunk_size closes its chunk early."""
    q, k, v = qkv(8, 24)
    full = ovq.ovq_attention(q, k, v, max_size=6, chunk_size=8)
    _, st = ovq.ovq_attention(q[:5], k[:5], v[:5], max_size=6, chunk_size=8, return_state=True)
    rest = ovq.ovq_attention(q[5:], k[5:], v[5:], max_size=6, chunk_size=8, state=st)
    assert st.tokens_seen == 5
    assert not np.allclose(rest, full[5:])


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 3}, {"learning_rate": 0.2}])
def test_save_load_then_continue_equals_one_call(tmp_path, kw):
    C, n_max, N = 5, 9, 73
    q, k, v = qkv(9, N)
    full_out, full_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **kw)
    cut = 6 * C
    first, state = ovq.ovq_attention(q[:cut], k[:cut], v[:cut], max_size=n_max, chunk_size=C, return_state=True, **kw)
    path = tmp_path / "ovq_state.npz"
    state.save(path)
    loaded = ovq.OVQState.load(path)
    assert_same_state(loaded, state)
    second, final = ovq.ovq_attention(q[cut:], k[cut:], v[cut:], max_size=n_max, chunk_size=C, state=loaded, return_state=True, **kw)
    assert np.array_equal(np.concatenate([first, second]), full_out)
    assert_same_state(final, full_state)


def test_save_load_float32_and_empty_state(tmp_path):
    q, k, v = qkv(10, 20, dtype=np.float32)
    _, st = ovq.ovq_attention(q, k, v, max_size=5, chunk_size=4, return_state=True)
    st.save(tmp_path / "a.npz")
    assert_same_state(ovq.OVQState.load(tmp_path / "a.npz"), st)
    empty = ovq.OVQState.empty(4, 3, 2)
    empty.save(tmp_path / "b.npz")
    assert_same_state(ovq.OVQState.load(tmp_path / "b.npz"), empty)
    # an empty state passed in behaves like no state
    q, k, v = qkv(11, 9, d=3, d_v=2)
    assert np.array_equal(
        ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, state=empty), ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3)
    )


def _saved_state(tmp_path):
    q, k, v = qkv(12, 30)
    _, st = ovq.ovq_attention(q, k, v, max_size=8, chunk_size=6, return_state=True)
    return st


def _write(path, **fields):
    base = {"format": np.array("refimpl.ovq.OVQState"), "version": np.array(1)}
    base.update(fields)
    with open(path, "wb") as f:
        np.savez(f, **base)


def _fields(st, **changes):
    out = {"keys": st.keys, "values": st.values, "counts": st.counts, "size": np.array(st.size), "tokens_seen": np.array(st.tokens_seen)}
    out.update(changes)
    return out


def test_load_refuses_a_truncated_file(tmp_path):
    st = _saved_state(tmp_path)
    path = tmp_path / "s.npz"
    st.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a complete OVQState file"):
        ovq.OVQState.load(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a complete OVQState file"):
        ovq.OVQState.load(path)


def test_load_refuses_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        ovq.OVQState.load(tmp_path / "nope.npz")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda st: {"counts": st.counts + (np.arange(8) == 0)}, r"sum\(counts\) == tokens_seen"),
        (lambda st: {"counts": np.where(np.arange(8) == 0, -1, st.counts)}, "nonnegative"),
        (lambda st: {"size": np.array(9)}, "at most n_max = 8"),
        (lambda st: {"values": st.values[:5]}, r"values: expected shape \(n_max, d_v\)"),
        (lambda st: {"counts": st.counts[:7]}, r"counts: expected shape \(n_max,\)"),
        (lambda st: {"counts": st.counts.astype(np.float64)}, "integers"),
        (lambda st: {"keys": np.where(np.arange(8)[:, None] == 0, np.nan, st.keys)}, "finite"),
        (lambda st: {"keys": st.keys.astype(np.float32)}, "dtype of keys"),
        (lambda st: {"size": np.array(st.size - 1)}, "rows >= size"),
        (lambda st: {"tokens_seen": np.array([30, 1])}, "one integer"),
        (lambda st: {"format": np.array("something else")}, "expected format"),
        (lambda st: {"version": np.array(2)}, "expected version"),
    ],
)
def test_load_refuses_a_tampered_file(tmp_path, change, match):
    st = _saved_state(tmp_path)
    path = tmp_path / "t.npz"
    _write(path, **_fields(st, **change(st)))
    with pytest.raises(ValueError, match=match):
        ovq.OVQState.load(path)


def test_load_refuses_a_file_without_a_field(tmp_path):
    st = _saved_state(tmp_path)
    fields = _fields(st)
    del fields["counts"]
    _write(tmp_path / "m.npz", **fields)
    with pytest.raises(ValueError, match="missing field"):
        ovq.OVQState.load(tmp_path / "m.npz")


# --- purity and invariants ---------------------------------------------------------------


def test_inputs_and_state_are_not_mutated_and_the_state_is_read_only():
    q, k, v = qkv(13, 40)
    copies = [a.copy() for a in (q, k, v)]
    _, st = ovq.ovq_attention(q[:20], k[:20], v[:20], max_size=6, chunk_size=4, return_state=True)
    saved = (st.keys.copy(), st.values.copy(), st.counts.copy(), st.size, st.tokens_seen)
    _, st2 = ovq.ovq_attention(q[20:], k[20:], v[20:], max_size=6, chunk_size=4, state=st, return_state=True)
    assert st2 is not st
    for a, b in zip((q, k, v), copies):
        assert np.array_equal(a, b)
    assert np.array_equal(st.keys, saved[0]) and np.array_equal(st.values, saved[1]) and np.array_equal(st.counts, saved[2])
    assert (st.size, st.tokens_seen) == saved[3:]
    with pytest.raises(ValueError):
        st.keys[0, 0] = 1.0
    with pytest.raises(AttributeError):
        st.size = 3


def test_constructor_copies_its_arrays():
    keys, values, counts = np.ones((2, 3)), np.ones((2, 1)), np.array([2, 0])
    st = ovq.OVQState(keys, values, counts, 1, 2)
    keys[0, 0] = 5.0
    assert st.keys[0, 0] == 1.0


@pytest.mark.parametrize("growth", ["plateau", "linear"])
def test_size_counts_and_tokens_follow_the_growth_function(growth):
    N, C, n_max = 130, 9, 20
    q, k, v = qkv(14, N)
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, growth=growth)
    st = cache.state
    expected = max(ovq.dictionary_size(min(s + C, N), n_max, growth) for s in range(0, N, C))
    assert st.size == expected and st.tokens_seen == N
    assert st.counts.sum() == N and np.all(st.counts[: st.size] >= 1) and np.all(st.counts[st.size :] == 0)
    assert np.array_equal(st.counts, np.bincount(assignment_plan(cache), minlength=n_max))
    # every token updates exactly one row: the rows of its chunk's plan
    for rec in cache.records:
        assert rec.rows.shape == (rec.stop - rec.start,)


def test_state_memory_is_constant_in_N():
    sizes = []
    for N in (50, 500):
        q, k, v = qkv(15, N, d=8, d_v=6)
        _, st = ovq.ovq_attention(q, k, v, max_size=16, chunk_size=10, return_state=True)
        sizes.append(st.nbytes)
    assert sizes[0] == sizes[1] == 16 * (8 + 6) * 8 + 16 * 8


# --- ablation switches ---------------------------------------------------------------------


def test_linear_growth_with_room_for_every_token_is_causal_softmax():
    for dtype in (np.float64, np.float32):
        q, k, v = qkv(16, 45, d=5, dtype=dtype)
        out = ovq.ovq_attention(q, k, v, max_size=45, chunk_size=8, growth="linear")
        ref = softmax_attention(ovq.unit_rows(q), ovq.unit_rows(k), v, scale=np.sqrt(5), causal=True)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, ref, **TOL[dtype])


def test_plateau_and_linear_growth_differ_and_plateau_stays_below_max_size():
    q, k, v = qkv(17, 100)
    _, a = ovq.ovq_attention(q, k, v, max_size=12, chunk_size=10, return_state=True)
    _, b = ovq.ovq_attention(q, k, v, max_size=12, chunk_size=10, growth="linear", return_state=True)
    assert a.size == ovq.dictionary_size(100, 12) == 10 and b.size == 12


def test_spread_init_seeds_the_keys_least_similar_to_the_dictionary():
    q, k, v = qkv(18, 60, d=3)
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=30, chunk_size=10)
    khat = ovq.unit_rows(k)
    checked = 0
    for rec in cache.records[1:]:
        if rec.seeds.size == 0:
            continue
        score = np.max(khat[rec.start : rec.stop] @ rec.dict_keys.T, axis=1)
        order = np.argsort(score, kind="stable")
        assert rec.seeds.tolist() == order[: rec.seeds.size].tolist()
        assert np.all(score[rec.seeds] <= np.min(np.delete(score, rec.seeds)))
        checked += 1
    assert checked >= 3


def test_random_init_is_deterministic_for_a_seed_and_differs_across_seeds():
    q, k, v = qkv(19, 80)
    run = lambda **kw: ovq.ovq_attention(q, k, v, max_size=20, chunk_size=10, return_state=True, **kw)
    a_out, a = run(init="random", seed=1)
    b_out, b = run(init="random", seed=1)
    _, c = run(init="random", seed=2)
    _, s = run(init="spread")
    assert np.array_equal(a_out, b_out)
    assert_same_state(a, b)
    assert not np.array_equal(a.keys, c.keys)
    assert not np.array_equal(a.keys, s.keys)
    # the first chunk has no init branch in the contract: identical centroids after it
    _, a1 = ovq.ovq_attention(q[:10], k[:10], v[:10], max_size=20, chunk_size=10, init="random", seed=1, return_state=True)
    _, s1 = ovq.ovq_attention(q[:10], k[:10], v[:10], max_size=20, chunk_size=10, return_state=True)
    assert_same_state(a1, s1)


def _state_with_counts(counts, d=4, d_v=3, seed=20):
    rng = np.random.default_rng(seed)
    n = len(counts)
    keys = ovq.unit_rows(rng.normal(size=(n, d)))
    return ovq.OVQState(keys, rng.normal(size=(n, d_v)), counts, n, int(np.sum(counts)))


@pytest.mark.parametrize("count_bias", [True, False])
def test_count_bias_adds_log_counts_to_the_centroid_logits(count_bias):
    state = _state_with_counts([1, 50, 3, 7])
    q, k, v = qkv(21, 1)
    out = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=1, beta=3.0, count_bias=count_bias, state=state)
    # one token: the query reads the 4 centroids and its own key (count 1)
    means_k = np.concatenate([state.keys, ovq.unit_rows(k)])
    means_v = np.concatenate([state.values, v])
    counts = np.array([1, 50, 3, 7, 1]) if count_bias else np.ones(5)
    ref = gmr.ovq_readout(ovq.unit_rows(q), means_k, means_v, counts, beta=3.0)
    np.testing.assert_allclose(out, ref, **TOL[np.float64])


def test_count_bias_matters_only_when_counts_differ():
    q, k, v = qkv(22, 30)
    with_bias = ovq.ovq_attention(q, k, v, max_size=30, chunk_size=6, growth="linear")
    without = ovq.ovq_attention(q, k, v, max_size=30, chunk_size=6, growth="linear", count_bias=False)
    np.testing.assert_allclose(with_bias, without, rtol=0, atol=0)  # every count is 1: log 1 = 0
    merged = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=6)
    merged_nb = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=6, count_bias=False)
    assert np.max(np.abs(merged - merged_nb)) > 1e-3


def _ema(start, members, eta):
    """(1 - eta)^s D + eta sum_j (1 - eta)^(s - j) x_(j): the closed form of s constant steps in token order."""
    s = len(members)
    return (1 - eta) ** s * start + eta * sum((1 - eta) ** (s - j) * x for j, x in enumerate(members, start=1))


def test_constant_learning_rate_rule():
    """Each centroid is an exponential moving average of its members, in token order."""
    eta = 0.15
    state = _state_with_counts([4, 2, 9])
    q, k, v = qkv(23, 6)
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=3, chunk_size=6, learning_rate=eta, state=state)
    rows, new = cache.records[0].rows, cache.state
    kh = ovq.unit_rows(k)
    assert min(np.bincount(rows, minlength=3)) >= 1 and max(np.bincount(rows)) >= 2
    for m in range(3):
        S = np.flatnonzero(rows == m)
        np.testing.assert_allclose(new.keys[m], _ema(state.keys[m], list(kh[S]), eta), rtol=1e-13)
        np.testing.assert_allclose(new.values[m], _ema(state.values[m], list(v[S]), eta), rtol=1e-13)
        # the summed form D + eta sum (x - D) differs as soon as a centroid takes two keys
        if S.size >= 2:
            assert not np.allclose(new.keys[m], state.keys[m] + eta * np.sum(kh[S] - state.keys[m], axis=0), rtol=1e-6)
    assert np.array_equal(new.counts, state.counts + np.bincount(rows, minlength=3))
    _, adaptive = ovq.ovq_attention(q, k, v, max_size=3, chunk_size=6, state=state, return_state=True)
    assert not np.allclose(adaptive.keys, new.keys)


def test_constant_learning_rate_merges_the_first_chunk_into_centroid_0_by_the_same_rule():
    """Centroid 0 is seeded by key 0, then the other keys that join it are stepped in token order."""
    eta = 0.3
    q, k, v = qkv(26, 8)
    _, cache = ovq.ovq_attention_forward(q, k, v, max_size=1, chunk_size=8, learning_rate=eta)
    kh = ovq.unit_rows(k)
    np.testing.assert_allclose(cache.state.keys[0], _ema(kh[0], list(kh[1:]), eta), rtol=1e-13)
    np.testing.assert_allclose(cache.state.values[0], _ema(v[0], list(v[1:]), eta), rtol=1e-13)
    assert cache.state.counts.tolist() == [8]


def test_learning_rate_one_keeps_the_last_member_and_stays_bounded():
    """eta = 1 replaces a centroid by its last member; the old summed rule ran away to 1e94 here."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(20000, 4)) for _ in range(3))
    _, st = ovq.ovq_attention(q, k, v, max_size=2, chunk_size=64, learning_rate=1.0, return_state=True)
    assert np.all(np.linalg.norm(st.keys, axis=1) <= 1 + 1e-12)  # convex combinations of unit keys
    _, cache = ovq.ovq_attention_forward(q[:64], k[:64], v[:64], max_size=2, chunk_size=64, learning_rate=1.0)
    rows = cache.records[0].rows
    last = max(i for i in range(64) if rows[i] == 0)
    np.testing.assert_array_equal(cache.state.keys[0], ovq.unit_rows(k)[last])


@pytest.mark.parametrize("bad", [1.0 + 1e-9, 2.0, 1e3])
def test_learning_rate_above_one_is_refused_naming_learning_rate(bad):
    q, k, v = qkv(27, 5)
    with pytest.raises(ValueError, match=r"^learning_rate: expected a constant step in \(0, 1\]"):
        ovq.ovq_attention(q, k, v, max_size=2, chunk_size=2, learning_rate=bad)
    with pytest.raises(ValueError, match=r"^learning_rate: expected a constant step in \(0, 1\]"):
        ovq_attention_loop(q, k, v, max_size=2, chunk_size=2, learning_rate=bad)


def test_max_size_one_keeps_the_mean_of_all_unit_keys():
    q, k, v = qkv(24, 37)
    _, st = ovq.ovq_attention(q, k, v, max_size=1, chunk_size=5, return_state=True)
    assert st.size == 1 and st.counts.tolist() == [37]
    np.testing.assert_allclose(st.keys[0], ovq.unit_rows(k).mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(st.values[0], v.mean(axis=0), rtol=1e-13)


def test_single_token():
    q, k, v = qkv(25, 1)
    out, st = ovq.ovq_attention(q, k, v, max_size=3, chunk_size=4, return_state=True)
    np.testing.assert_array_equal(out, v)  # one key attends to itself only
    assert (st.size, st.tokens_seen, st.counts.tolist()) == (1, 1, [1, 0, 0])


# --- dictionary_size ---------------------------------------------------------------------------


def test_dictionary_size_values():
    assert ovq.dictionary_size(0, 8) == 0
    assert ovq.dictionary_size(1, 8) == 1
    assert ovq.dictionary_size(8, 8) == 4
    assert ovq.dictionary_size(56, 8) == 7
    assert ovq.dictionary_size(10**9, 8) == 7  # floor(t n_max / (t + n_max)) < n_max: the plateau never reaches n_max
    assert ovq.dictionary_size(5, 8, "linear") == 5 and ovq.dictionary_size(50, 8, "linear") == 8
    assert ovq.dictionary_size(3, 1) == 1


@pytest.mark.parametrize("growth", ["plateau", "linear"])
def test_dictionary_size_arrays_match_scalars_and_grow_monotonically(growth):
    t = np.arange(0, 3000)
    arr = ovq.dictionary_size(t, 100, growth)
    assert arr.dtype == np.int64
    assert arr.tolist() == [ovq.dictionary_size(int(i), 100, growth) for i in t]
    assert np.all(np.diff(arr) >= 0) and np.all(np.diff(arr) <= 1)


def test_dictionary_size_validation():
    with pytest.raises(ValueError, match="t: expected an integer >= 0"):
        ovq.dictionary_size(-1, 4)
    with pytest.raises(TypeError, match="t: expected an integer"):
        ovq.dictionary_size(2.5, 4)
    with pytest.raises(TypeError, match="t: expected integers"):
        ovq.dictionary_size(np.array([1.0]), 4)
    with pytest.raises(ValueError, match="max_size"):
        ovq.dictionary_size(3, 0)
    with pytest.raises(ValueError, match="growth: expected one of"):
        ovq.dictionary_size(3, 4, "exponential")


# --- validation ----------------------------------------------------------------------------


def _call(**changes):
    q, k, v = qkv(26, 10)
    args = dict(q=q, k=k, v=v, max_size=4, chunk_size=3)
    args.update(changes)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return ovq.ovq_attention(q, k, v, **args)


@pytest.mark.parametrize(
    "changes, exc, match",
    [
        ({"k": np.ones((9, 4))}, ValueError, r"k: expected shape \(N, d\)"),
        ({"v": np.ones((11, 3))}, ValueError, r"v: expected shape \(N, d_v\)"),
        ({"q": np.ones(10)}, ValueError, "q: expected a 2-D array"),
        ({"q": np.full((10, 4), np.nan)}, ValueError, "q: expected finite values"),
        ({"v": np.full((10, 3), np.inf)}, ValueError, "v: expected finite values"),
        ({"q": np.ones((10, 4), dtype=np.int64)}, TypeError, "q: expected a real floating-point array"),
        ({"k": np.ones((10, 4), dtype=complex)}, TypeError, "k: .*complex"),
        ({"q": np.ones((0, 4)), "k": np.ones((0, 4)), "v": np.ones((0, 3))}, ValueError, "N >= 1"),
        ({"max_size": 0}, ValueError, "max_size: expected an integer >= 1"),
        ({"chunk_size": 0}, ValueError, "chunk_size: expected an integer >= 1"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size: expected an integer"),
        ({"growth": "exponential"}, ValueError, "growth: expected one of 'plateau', 'linear'"),
        ({"init": "kmeans++"}, ValueError, "init: expected one of 'spread', 'random'"),
        ({"beta": 0.0}, ValueError, "beta: expected a finite number > 0"),
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
        ({"seed": -1}, ValueError, "seed"),
        ({"count_bias": 1}, TypeError, "count_bias: expected True or False"),
        ({"return_state": "yes"}, TypeError, "return_state"),
        ({"state": {"keys": 1}}, TypeError, "state: expected an OVQState"),
        ({"state": ovq.OVQState.empty(5, 4, 3)}, ValueError, "state: has n_max = 5 rows but max_size = 4"),
        ({"state": ovq.OVQState.empty(4, 2, 3)}, ValueError, "state: holds keys of dimension d = 2"),
        ({"state": ovq.OVQState.empty(4, 4, 1)}, ValueError, "state: holds values of dimension d_v = 1"),
    ],
)
def test_invalid_inputs_are_refused_with_a_message_naming_the_argument(changes, exc, match):
    with pytest.raises(exc, match=match):
        _call(**changes)


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.ones((2, 3)), np.ones((2, 1)), [1, 1], 3, 2), "size: expected at most n_max = 2"),
        ((np.ones((2, 3)), np.ones((2, 1)), [1, 0], 2, 1), "every active row"),
        ((np.ones((2, 3)), np.ones((3, 1)), [1, 0], 1, 1), "values: expected shape"),
        ((np.ones((2, 3)), np.ones((2, 1)), [1.0, 0.0], 1, 1), "counts: expected integers"),
        ((np.ones((2, 3)), np.ones((2, 1)), [2, 0], 1, 3), r"sum\(counts\) == tokens_seen = 3"),
    ],
)
def test_state_constructor_checks_its_invariants(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ovq.OVQState(*args)


# --- VQ baseline ---------------------------------------------------------------------------


@pytest.mark.parametrize("N, C, S", [(29, 6, 5), (12, 1, 3), (7, 10, 1)])
def test_vq_attention_equals_its_loop_oracle(N, C, S):
    q, k, v = qkv(27 + N, N)
    codebook = np.random.default_rng(N).normal(size=(S, 4))
    np.testing.assert_allclose(vq_attention_loop(q, k, v, codebook, chunk_size=C), ovq.vq_attention(q, k, v, codebook, chunk_size=C), **TOL[np.float64])


def test_vq_with_the_unit_keys_as_codebook_is_causal_softmax():
    q, k, v = qkv(28, 33)
    out = ovq.vq_attention(q, k, v, ovq.unit_rows(k), chunk_size=7, beta=2.5)
    ref = softmax_attention(ovq.unit_rows(q), ovq.unit_rows(k), v, scale=2.5, causal=True)
    np.testing.assert_allclose(out, ref, **TOL[np.float64])


def test_vq_float32_and_validation():
    q, k, v = qkv(29, 20, dtype=np.float32)
    codebook = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    out = ovq.vq_attention(q, k, v, codebook, chunk_size=6)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ovq.vq_attention(*(a.astype(np.float64) for a in (q, k, v, codebook)), chunk_size=6), **TOL[np.float32])
    with pytest.raises(ValueError, match=r"codebook: expected shape \(S, d\)"):
        ovq.vq_attention(q, k, v, codebook[:, :3], chunk_size=6)
    with pytest.raises(ValueError, match="codebook: expected at least one code"):
        ovq.vq_attention(q, k, v, codebook[:0], chunk_size=6)
    with pytest.raises(ValueError, match="chunk_size"):
        ovq.vq_attention(q, k, v, codebook, chunk_size=0)


def test_unit_rows():
    x = np.array([[3.0, 4.0], [0.0, 0.0], [1e-300, 0.0]])
    out = ovq.unit_rows(x)
    np.testing.assert_allclose(out[0], [0.6, 0.8], rtol=1e-15)
    assert np.array_equal(out[1], [0.0, 0.0]) and np.all(np.isfinite(out))


def test_both_entry_points_share_one_signature_and_name_themselves_in_errors():
    import inspect

    q, k, v = qkv(28, 5)
    fwd, att = inspect.signature(ovq.ovq_attention_forward), inspect.signature(ovq.ovq_attention)
    assert list(att.parameters) == list(fwd.parameters) + ["return_state"]
    assert fwd.parameters["growth"].default == "plateau" and att.parameters["learning_rate"].default is None
    with pytest.raises(TypeError, match=r"^ovq_attention\(\) got an unexpected keyword argument 'learnig_rate'"):
        ovq.ovq_attention(q, k, v, max_size=2, chunk_size=2, learnig_rate=0.1)
    with pytest.raises(TypeError, match=r"^ovq_attention_forward\(\) missing 1 required keyword-only argument: 'max_size'"):
        ovq.ovq_attention_forward(q, k, v, chunk_size=2)


@pytest.mark.parametrize("n_max", [1, 2, 3, 8, 64, 1000])
def test_plateau_never_reaches_n_max_and_reaches_n_max_minus_1_exactly_at_n_max_times_n_max_minus_1(n_max):
    """floor(t n_max/(t+n_max)) < n_max for every t, so with plateau growth row n_max - 1 is never used (for n_max >= 2)."""
    assert ovq.dictionary_size(10**15, n_max) == max(1, n_max - 1)
    if n_max >= 2:
        t = n_max * (n_max - 1)
        assert ovq.dictionary_size(t, n_max) == n_max - 1
        assert ovq.dictionary_size(t - 1, n_max) == max(1, n_max - 2)
    assert ovq.dictionary_size(10**15, n_max, "linear") == n_max
    # a real stream: the last row stays empty under plateau growth
    if 2 <= n_max <= 8:
        q, k, v = qkv(29, 40 * n_max * n_max)
        _, st = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=4, return_state=True)
        assert st.size == n_max - 1 and st.counts[n_max - 1] == 0 and np.all(st.keys[n_max - 1] == 0)


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 5, "learning_rate": 0.3}], ids=["default", "random-lr0.3"])
def test_a_batch_is_each_sequence_on_its_own_bit_for_bit(kw):
    """ovq_attention_forward/backward with leading dimensions: every sequence from its own empty dictionary."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.normal(size=(2, 3, 11, n)) for n in (4, 4, 3))
    g = rng.normal(size=(2, 3, 11, 3))
    out, cache = ovq.ovq_attention_forward(q, k, v, max_size=5, chunk_size=4, **kw)
    grads = ovq.ovq_attention_backward(g, cache)
    assert out.shape == (2, 3, 11, 3) and cache.state is None and len(cache.records) == 6
    for i, idx in enumerate(np.ndindex(2, 3)):
        out_1, cache_1 = ovq.ovq_attention_forward(q[idx], k[idx], v[idx], max_size=5, chunk_size=4, **kw)
        np.testing.assert_array_equal(out[idx], out_1)
        assert [r.rows.tolist() for r in cache.records[i]] == [r.rows.tolist() for r in cache_1.records]
        for got, want in zip(grads, ovq.ovq_attention_backward(g[idx], cache_1), strict=True):
            np.testing.assert_array_equal(got[idx], want)


def test_a_batch_refuses_a_state_and_names_the_sequence_that_fails():
    q, k, v = qkv(0, 6)
    _, state = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True)
    batch = [np.stack([a, a]) for a in (q, k, v)]
    with pytest.raises(ValueError, match=r"^state: a stream continues one sequence, q of shape \(N, d\); got leading dimensions \(2,\)"):
        ovq.ovq_attention_forward(*batch, max_size=4, chunk_size=3, state=state)
    batch[2][1, 2, 0] = np.nan
    with pytest.raises(ValueError) as want:
        ovq.ovq_attention_forward(batch[0][1], batch[1][1], batch[2][1], max_size=4, chunk_size=3)
    with pytest.raises(ValueError) as got:
        ovq.ovq_attention_forward(*batch, max_size=4, chunk_size=3)
    assert str(got.value) == str(want.value) and str(got.value).startswith("v: ") and "(2, 0)" in str(got.value)
