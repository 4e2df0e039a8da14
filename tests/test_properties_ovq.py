"""Property-based tests (hypothesis) of OVQ attention: the invariants of docs/derivations/ovq_gmr.md.

Over shapes (N, d, d_v, max_size n_max, chunk_size C), options (growth, init,
count_bias, learning rate), seeds and values:

* ``sum(counts[:size]) == tokens_seen``, unused rows have count 0, active rows >= 1;
* ``size`` is the maximum over the chunks of ``growth(t)`` (t the tokens seen
  after the chunk).  From an empty state with one growth function this is
  ``dictionary_size(tokens_seen)``, because growth never decreases; a stream
  whose growth switches (linear, then plateau) keeps the larger, so there the
  maximum over chunks is the exact statement;
* ``size <= max_size``, and every key goes to a row below the size after its chunk;
* rows at or above ``size`` are never read: a state whose unused rows hold
  large values gives the same bits as one whose unused rows are zero;
* streaming in pieces whose lengths are multiples of C equals one call, bit for
  bit; a piece of another length closes its chunk early (documented), which is
  the same as feeding each of its chunks as a call of its own;
* the token-by-token loop oracle agrees: state bit for bit, outputs to rounding.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refimpl import ovq
from refimpl.ovq_oracle import ovq_attention_loop
from refimpl.testing import assert_same_state


@st.composite
def options(draw):
    return dict(
        growth=draw(st.sampled_from(ovq.GROWTHS)),
        init=draw(st.sampled_from(ovq.INITS)),
        count_bias=draw(st.booleans()),
        learning_rate=draw(st.one_of(st.none(), st.floats(0.01, 1.0))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def streams(draw, max_N=40):
    """(q, k, v, max_size, chunk_size): values drawn by hypothesis (zeros, repeats and all)."""
    N = draw(st.integers(1, max_N))
    d = draw(st.integers(1, 4))
    d_v = draw(st.integers(1, 3))
    elements = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
    q = draw(hnp.arrays(np.float64, (N, d), elements=elements))
    k = draw(hnp.arrays(np.float64, (N, d), elements=elements))
    v = draw(hnp.arrays(np.float64, (N, d_v), elements=elements))
    return q, k, v, draw(st.integers(1, 8)), draw(st.integers(1, 9))


@st.composite
def cut_points(draw, N, multiple_of=1):
    """Sorted cut positions in (0, N), each a multiple of ``multiple_of``."""
    candidates = list(range(multiple_of, N, multiple_of))
    if not candidates:
        return []
    return sorted(draw(st.sets(st.sampled_from(candidates), max_size=4)))


def _pieces(N, cuts):
    bounds = [0, *cuts, N]
    return list(zip(bounds[:-1], bounds[1:]))


def _stream(q, k, v, pieces, n_max, C, opts, state=None):
    outs = []
    for a, b in pieces:
        out, state = ovq.ovq_attention(q[a:b], k[a:b], v[a:b], max_size=n_max, chunk_size=C, state=state, return_state=True, **opts)
        outs.append(out)
    return np.concatenate(outs), state


@given(streams(), options())
def test_counts_sum_to_the_tokens_seen_and_size_follows_growth(stream, opts):
    q, k, v, n_max, C = stream
    N = q.shape[0]
    out, cache = ovq.ovq_attention_forward(q, k, v, max_size=n_max, chunk_size=C, **opts)
    st_ = cache.state
    assert np.all(np.isfinite(out)) and out.shape == v.shape
    assert st_.tokens_seen == N and int(st_.counts[: st_.size].sum()) == N
    assert np.all(st_.counts[: st_.size] >= 1) and np.all(st_.counts[st_.size :] == 0)
    assert 1 <= st_.size <= n_max
    # size after each chunk: the max over the chunks so far of growth(t), and growth never decreases
    sizes_after = [r.n for r in cache.records[1:]] + [st_.size]
    t_after = [r.stop for r in cache.records]
    running_max = np.maximum.accumulate([ovq.dictionary_size(t, n_max, opts["growth"]) for t in t_after])
    assert sizes_after == running_max.tolist()
    assert st_.size == ovq.dictionary_size(N, n_max, opts["growth"])
    for rec, n_after in zip(cache.records, sizes_after):
        assert np.all(rec.rows < n_after) and np.all(rec.rows >= 0)
        assert rec.seeds.size == n_after - rec.n <= rec.stop - rec.start
    # rows above the size were never written
    assert not np.any(st_.keys[st_.size :]) and not np.any(st_.values[st_.size :])


@given(streams(), options(), st.data())
def test_size_is_the_maximum_over_chunks_when_growth_switches(stream, opts, data):
    """Linear growth, then plateau growth: the size keeps the larger, so it is not dictionary_size(t, plateau)."""
    q, k, v, n_max, C = stream
    N = q.shape[0]
    cut = data.draw(st.integers(1, N))
    lin = dict(opts, growth="linear")
    _, first = ovq.ovq_attention(q[:cut], k[:cut], v[:cut], max_size=n_max, chunk_size=C, return_state=True, **lin)
    assert first.size == ovq.dictionary_size(cut, n_max, "linear")
    if cut == N:
        return
    plat = dict(opts, growth="plateau")
    _, cache = ovq.ovq_attention_forward(q[cut:], k[cut:], v[cut:], max_size=n_max, chunk_size=C, state=first, **plat)
    final = cache.state
    expected = max(first.size, *(ovq.dictionary_size(cut + r.stop, n_max, "plateau") for r in cache.records))
    assert final.size == expected == max(first.size, ovq.dictionary_size(N, n_max, "plateau"))
    assert final.size >= ovq.dictionary_size(N, n_max, "plateau")
    assert int(final.counts.sum()) == N and final.size <= n_max


@given(streams(), options(), st.data())
def test_rows_at_or_above_the_size_are_never_read(stream, opts, data):
    q, k, v, n_max, C = stream
    N = q.shape[0]
    assume(N >= 2)
    cut = data.draw(st.integers(1, N - 1))
    _, st_ = ovq.ovq_attention(q[:cut], k[:cut], v[:cut], max_size=n_max, chunk_size=C, return_state=True, **opts)
    n = st_.size
    before = [np.array(a, copy=True) for a in (st_.keys, st_.values, st_.counts)]
    rng = np.random.default_rng(cut)
    keys, values = np.array(st_.keys), np.array(st_.values)
    keys[n:] = 1e6 * rng.normal(size=keys[n:].shape)
    values[n:] = 1e6 * rng.normal(size=values[n:].shape)
    dirty = ovq.OVQState(keys, values, st_.counts, n, st_.tokens_seen)
    rest = (q[cut:], k[cut:], v[cut:])
    out, clean_end = ovq.ovq_attention(*rest, max_size=n_max, chunk_size=C, state=st_, return_state=True, **opts)
    out_d, dirty_end = ovq.ovq_attention(*rest, max_size=n_max, chunk_size=C, state=dirty, return_state=True, **opts)
    np.testing.assert_array_equal(out, out_d)
    m = clean_end.size
    assert (m, clean_end.tokens_seen) == (dirty_end.size, dirty_end.tokens_seen)
    assert np.array_equal(clean_end.counts, dirty_end.counts)
    assert np.array_equal(clean_end.keys[:m], dirty_end.keys[:m]) and np.array_equal(clean_end.values[:m], dirty_end.values[:m])
    # the unused rows are carried through untouched
    assert np.array_equal(dirty_end.keys[m:], keys[m:]) and np.array_equal(dirty_end.values[m:], values[m:])
    # the state passed in is unchanged
    assert st_.size == n and all(np.array_equal(a, b) for a, b in zip((st_.keys, st_.values, st_.counts), before))


@given(streams(), options(), st.data())
def test_streaming_in_whole_chunks_equals_one_call(stream, opts, data):
    q, k, v, n_max, C = stream
    N = q.shape[0]
    cuts = data.draw(cut_points(N, multiple_of=C))
    one, one_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **opts)
    pieces, pieces_state = _stream(q, k, v, _pieces(N, cuts), n_max, C, opts)
    np.testing.assert_array_equal(pieces, one)
    assert_same_state(pieces_state, one_state)


@given(streams(), options(), st.data())
def test_a_ragged_piece_closes_its_chunk_early(stream, opts, data):
    """Pieces of any length: each is cut into chunks from its own start, as if every chunk were its own call."""
    q, k, v, n_max, C = stream
    N = q.shape[0]
    pieces = _pieces(N, data.draw(cut_points(N)))
    out, state = _stream(q, k, v, pieces, n_max, C, opts)
    chunks = [(s, min(s + C, b)) for a, b in pieces for s in range(a, b, C)]
    ref, ref_state = _stream(q, k, v, chunks, n_max, C, opts)
    np.testing.assert_array_equal(out, ref)
    assert_same_state(state, ref_state)
    assert state.tokens_seen == N and int(state.counts.sum()) == N


@given(st.integers(1, 24), st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(1, 7), options(), st.integers(0, 2**32 - 1))
def test_the_loop_oracle_agrees(N, d, d_v, n_max, C, opts, seed):
    """State bit for bit, outputs to rounding (the oracle sums dot products in another order)."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(N, d)), rng.normal(size=(N, d)), rng.normal(size=(N, d_v))
    out, state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **opts)
    ref_out, ref_state = ovq_attention_loop(q, k, v, max_size=n_max, chunk_size=C, **opts)
    assert_same_state(state, ref_state)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13 * max(1.0, float(np.max(np.abs(v)))))


@given(streams(max_N=20), options())
def test_deterministic_for_a_seed_and_inputs_unchanged(stream, opts):
    q, k, v, n_max, C = stream
    copies = [a.copy() for a in (q, k, v)]
    a_out, a_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **opts)
    b_out, b_state = ovq.ovq_attention(q, k, v, max_size=n_max, chunk_size=C, return_state=True, **opts)
    np.testing.assert_array_equal(a_out, b_out)
    assert_same_state(a_state, b_state)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)
