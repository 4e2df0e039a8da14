"""OVQState.load refuses every broken or tampered file with a ValueError that names the file and the problem.

tests/test_ovq.py covers a file cut in half, an empty file, a missing field
and the first tampered fields; this module adds the other ways a file can be
wrong: not an .npz at all, cut at any length, a corrupted byte, wrong dtypes
and shapes for every field, non-finite entries, pickled objects, and a state
that is consistent on its own but cannot continue the stream it is used for.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from refimpl import ovq

FIELDS = ("format", "version", "keys", "values", "counts", "size", "tokens_seen")


def _state():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(20, 3)), rng.normal(size=(20, 3)), rng.normal(size=(20, 2))
    return ovq.ovq_attention(q, k, v, max_size=6, chunk_size=4, return_state=True)[1]


def _fields(st):
    return dict(
        format=np.array("refimpl.ovq.OVQState"),
        version=np.array(1, dtype=np.int64),
        keys=np.array(st.keys),
        values=np.array(st.values),
        counts=np.array(st.counts),
        size=np.array(st.size, dtype=np.int64),
        tokens_seen=np.array(st.tokens_seen, dtype=np.int64),
    )


def _write(path, fields, allow_pickle=False):
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=allow_pickle, **fields)


def test_a_saved_state_loads_back_unchanged(tmp_path):
    """The control for every refusal below: the same writer with untouched fields is accepted."""
    st = _state()
    _write(tmp_path / "ok.npz", _fields(st))
    loaded = ovq.OVQState.load(tmp_path / "ok.npz")
    for a, b in zip((loaded.keys, loaded.values, loaded.counts), (st.keys, st.values, st.counts)):
        np.testing.assert_array_equal(a, b)
    assert (loaded.size, loaded.tokens_seen) == (st.size, st.tokens_seen)


def test_files_of_another_kind_are_refused(tmp_path):
    np.save(tmp_path / "one_array.npy", np.ones(3))
    (tmp_path / "text.txt").write_text("keys, values, counts\n1, 2, 3\n")
    (tmp_path / "obj.pkl").write_bytes(pickle.dumps({"keys": np.ones((2, 2))}))
    for name in ("one_array.npy", "text.txt", "obj.pkl"):
        with pytest.raises(ValueError, match=f"{name}: not a complete OVQState file"):
            ovq.OVQState.load(tmp_path / name)
    with pytest.raises(ValueError, match="not a complete OVQState file"):
        ovq.OVQState.load(tmp_path)  # a directory


def test_a_file_cut_at_any_length_is_refused(tmp_path):
    st = _state()
    st.save(tmp_path / "full.npz")
    data = (tmp_path / "full.npz").read_bytes()
    cut = tmp_path / "cut.npz"
    for n in sorted({1, 10, 100, len(data) // 3, len(data) - 100, len(data) - 22, len(data) - 1}):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="not a complete OVQState file"):
            ovq.OVQState.load(cut)


def test_a_corrupted_byte_is_refused(tmp_path):
    """A flipped byte inside the keys: the archive's CRC no longer matches."""
    st = _state()
    st.save(tmp_path / "s.npz")
    data = bytearray((tmp_path / "s.npz").read_bytes())
    at = data.find(st.keys.tobytes()[:16])
    assert at > 0
    data[at + 3] ^= 0xFF
    (tmp_path / "s.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a complete OVQState file.*BadZipFile"):
        ovq.OVQState.load(tmp_path / "s.npz")


@pytest.mark.parametrize("missing", FIELDS)
def test_every_missing_field_is_named(tmp_path, missing):
    fields = _fields(_state())
    del fields[missing]
    _write(tmp_path / "m.npz", fields)
    with pytest.raises(ValueError, match=rf"missing field\(s\) \['{missing}'\]"):
        ovq.OVQState.load(tmp_path / "m.npz")


def _tampered():
    st = _state()
    N = st.max_size
    return [
        ("integer keys", {"keys": np.ones((N, 3), dtype=np.int64)}, "keys: expected a real floating-point array"),
        ("complex values", {"values": st.values + 1j}, "values: expected a real floating-point array"),
        ("keys 1-D", {"keys": st.keys.ravel()}, "keys: expected a 2-D array"),
        ("keys of another N", {"keys": st.keys[:-1]}, r"values: expected shape \(N, d_v\) = \(5, \*\)"),
        ("infinite key", {"keys": np.where(np.arange(N)[:, None] == 1, np.inf, st.keys)}, "keys: expected finite values"),
        ("NaN value", {"values": np.where(np.arange(N)[:, None] == 0, np.nan, st.values)}, "values: expected finite values"),
        ("counts of booleans", {"counts": st.counts > 0}, "counts: expected integers"),
        ("counts 2-D", {"counts": st.counts[None]}, r"counts: expected shape \(N,\)"),
        ("negative count, same sum", {"counts": st.counts + np.where(np.arange(N) == 0, -st.counts[0] - 1, 0) + np.where(np.arange(N) == 1, st.counts[0] + 1, 0)}, "counts: expected nonnegative"),
        ("sum of counts != tokens_seen", {"tokens_seen": np.array(st.tokens_seen + 1)}, r"sum\(counts\) == tokens_seen"),
        ("size above the rows", {"size": np.array(N + 1)}, f"size: expected at most N = {N}"),
        ("negative size", {"size": np.array(-1)}, "size: expected an integer >= 0"),
        ("negative tokens_seen", {"tokens_seen": np.array(-5)}, "tokens_seen: expected an integer >= 0"),
        ("float size", {"size": np.array(float(st.size))}, "field 'size' must be one integer"),
        ("boolean version", {"version": np.array(True)}, "field 'version' must be one integer"),
        ("format as bytes", {"format": np.array(b"something")}, "expected format"),
        ("format as a list", {"format": np.array(["refimpl.ovq.OVQState"])}, "expected format"),
    ]


@pytest.mark.parametrize("change, match", [pytest.param(c, m, id=i) for i, c, m in _tampered()])
def test_every_tampered_field_is_refused_with_its_name(tmp_path, change, match):
    fields = {**_fields(_state()), **change}
    path = tmp_path / "t.npz"
    _write(path, fields)
    with pytest.raises(ValueError, match=match) as info:
        ovq.OVQState.load(path)
    assert str(path) in str(info.value)


def test_a_pickled_object_inside_the_archive_is_refused_not_unpickled(tmp_path):
    fields = {**_fields(_state()), "keys": np.array([{"evil": 1}], dtype=object)}
    _write(tmp_path / "p.npz", fields, allow_pickle=True)
    with pytest.raises(ValueError, match="not a complete OVQState file.*allow_pickle"):
        ovq.OVQState.load(tmp_path / "p.npz")


def test_a_consistent_state_that_cannot_continue_its_growth_is_refused_when_used(tmp_path):
    """Counts that add up but a size far below growth(tokens_seen): loads, then the next call says why it stops."""
    st = _state()
    N = st.max_size
    counts = np.zeros(N, dtype=np.int64)
    counts[0] = 500
    fields = {**_fields(st), "counts": counts, "size": np.array(1), "tokens_seen": np.array(500)}
    _write(tmp_path / "g.npz", fields)
    loaded = ovq.OVQState.load(tmp_path / "g.npz")
    q = np.ones((3, 3))
    with pytest.raises(ValueError, match="state: size = 1 after tokens_seen = 500 is too small for growth='plateau'"):
        ovq.ovq_attention(q, q, np.ones((3, 2)), max_size=N, chunk_size=1, state=loaded)
