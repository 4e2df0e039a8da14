"""The stream states load back what they saved, and refuse every broken or tampered file naming the file and the problem.

``refimpl.ovq.OVQState`` and ``refimpl.gma.GMAState`` share one file layout
(``refimpl.statefile``); every way a file can be wrong is tried on both: not
an .npz at all, cut at any length, a corrupted byte, a missing field, pickled
objects; then wrong dtypes and shapes for every field of each, and an OVQ
state that is consistent on its own but cannot continue the stream it is
used for.  tests/test_ovq.py covers the first cases of OVQState too.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

import numpy as np
import pytest

from refimpl import gma, ovq


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


def _gma_state():
    rng = np.random.default_rng(1)
    means, variances, weights = rng.normal(size=(4, 3)), rng.uniform(0.5, 2.0, size=(4, 3)), np.full(4, 0.25)
    x_q, x_k, v = rng.normal(size=(9, 3)), rng.normal(size=(9, 3)), rng.normal(size=(9, 2))
    return gma.gma_step(x_q, x_k, v, means, variances, weights)[1]


def _gma_fields(st):
    return dict(format=np.array("refimpl.gma.GMAState"), version=np.array(1, dtype=np.int64), slots=np.array(st.slots),
                norms=np.array(st.norms), tokens_seen=np.array(st.tokens_seen, dtype=np.int64))


class Kind(NamedTuple):
    cls: type
    make: object  # () -> a state
    fields: object  # state -> the dict of arrays a file holds
    arrays: tuple  # (name, getter) of the state's arrays, compared after loading
    scalars: tuple  # names of the state's integer fields

    @property
    def name(self):
        return self.cls.__name__


KINDS = [
    Kind(ovq.OVQState, _state, _fields, (("keys", lambda s: s.keys), ("values", lambda s: s.values), ("counts", lambda s: s.counts)), ("size", "tokens_seen")),
    Kind(gma.GMAState, _gma_state, _gma_fields, (("slots", lambda s: s.slots), ("norms", lambda s: s.norms)), ("tokens_seen",)),
]
BOTH = pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])


def _write(path, fields, allow_pickle=False):
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=allow_pickle, **fields)


@BOTH
def test_a_saved_state_loads_back_unchanged(tmp_path, kind):
    """The control for every refusal below: the same writer with untouched fields is accepted, and so is save()."""
    st = kind.make()
    _write(tmp_path / "ok.npz", kind.fields(st))
    st.save(tmp_path / "saved.npz")
    for path in ("ok.npz", "saved.npz"):
        loaded = kind.cls.load(tmp_path / path)
        for _, get in kind.arrays:
            np.testing.assert_array_equal(get(loaded), get(st))
            assert get(loaded).dtype == get(st).dtype
        assert all(getattr(loaded, f) == getattr(st, f) for f in kind.scalars)


@BOTH
def test_files_of_another_kind_are_refused(tmp_path, kind):
    np.save(tmp_path / "one_array.npy", np.ones(3))
    (tmp_path / "text.txt").write_text("keys, values, counts\n1, 2, 3\n")
    (tmp_path / "obj.pkl").write_bytes(pickle.dumps({"keys": np.ones((2, 2))}))
    for name in ("one_array.npy", "text.txt", "obj.pkl"):
        with pytest.raises(ValueError, match=f"{name}: not a complete {kind.name} file"):
            kind.cls.load(tmp_path / name)
    with pytest.raises(ValueError, match=f"not a complete {kind.name} file"):
        kind.cls.load(tmp_path)  # a directory
    with pytest.raises(FileNotFoundError):
        kind.cls.load(tmp_path / "nothing.npz")


def test_one_kind_of_state_is_not_the_other(tmp_path):
    _state().save(tmp_path / "ovq.npz")
    _gma_state().save(tmp_path / "gma.npz")
    with pytest.raises(ValueError, match=r"missing field\(s\) \['slots', 'norms'\]"):
        gma.GMAState.load(tmp_path / "ovq.npz")
    with pytest.raises(ValueError, match=r"missing field\(s\) \['keys', 'values', 'counts', 'size'\]"):
        ovq.OVQState.load(tmp_path / "gma.npz")


@BOTH
def test_a_file_cut_at_any_length_is_refused(tmp_path, kind):
    kind.make().save(tmp_path / "full.npz")
    data = (tmp_path / "full.npz").read_bytes()
    cut = tmp_path / "cut.npz"
    for n in sorted({1, 10, 100, len(data) // 3, len(data) - 100, len(data) - 22, len(data) - 1}):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"not a complete {kind.name} file"):
            kind.cls.load(cut)


@BOTH
def test_a_corrupted_byte_is_refused(tmp_path, kind):
    """A flipped byte inside the first array: the archive's CRC no longer matches."""
    st = kind.make()
    st.save(tmp_path / "s.npz")
    data = bytearray((tmp_path / "s.npz").read_bytes())
    at = data.find(kind.arrays[0][1](st).tobytes()[:16])
    assert at > 0
    data[at + 3] ^= 0xFF
    (tmp_path / "s.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"not a complete {kind.name} file.*BadZipFile"):
        kind.cls.load(tmp_path / "s.npz")


@pytest.mark.parametrize("kind, missing", [pytest.param(k, f, id=f"{k.name}-{f}") for k in KINDS for f in k.fields(k.make())])
def test_every_missing_field_is_named(tmp_path, kind, missing):
    fields = kind.fields(kind.make())
    del fields[missing]
    _write(tmp_path / "m.npz", fields)
    with pytest.raises(ValueError, match=rf"missing field\(s\) \['{missing}'\]"):
        kind.cls.load(tmp_path / "m.npz")


@BOTH
def test_a_pickled_object_inside_the_archive_is_refused_not_unpickled(tmp_path, kind):
    fields = kind.fields(kind.make())
    fields[kind.arrays[0][0]] = np.array([{"evil": 1}], dtype=object)
    _write(tmp_path / "p.npz", fields, allow_pickle=True)
    with pytest.raises(ValueError, match=f"not a complete {kind.name} file.*allow_pickle"):
        kind.cls.load(tmp_path / "p.npz")


def _tampered():
    st = _state()
    n_max = st.max_size
    return [
        ("integer keys", {"keys": np.ones((n_max, 3), dtype=np.int64)}, "keys: expected a real floating-point array"),
        ("complex values", {"values": st.values + 1j}, "values: expected a real floating-point array"),
        ("keys 1-D", {"keys": st.keys.ravel()}, "keys: expected a 2-D array"),
        ("keys of another n_max", {"keys": st.keys[:-1]}, r"values: expected shape \(n_max, d_v\) = \(5, \*\)"),
        ("infinite key", {"keys": np.where(np.arange(n_max)[:, None] == 1, np.inf, st.keys)}, "keys: expected finite values"),
        ("NaN value", {"values": np.where(np.arange(n_max)[:, None] == 0, np.nan, st.values)}, "values: expected finite values"),
        ("counts of booleans", {"counts": st.counts > 0}, "counts: expected integers"),
        ("counts 2-D", {"counts": st.counts[None]}, r"counts: expected shape \(n_max,\)"),
        ("negative count, same sum", {"counts": st.counts + np.where(np.arange(n_max) == 0, -st.counts[0] - 1, 0) + np.where(np.arange(n_max) == 1, st.counts[0] + 1, 0)}, "counts: expected nonnegative"),
        ("sum of counts != tokens_seen", {"tokens_seen": np.array(st.tokens_seen + 1)}, r"sum\(counts\) == tokens_seen"),
        ("size above the rows", {"size": np.array(n_max + 1)}, f"size: expected at most n_max = {n_max}"),
        ("negative size", {"size": np.array(-1)}, "size: expected an integer >= 0"),
        ("negative tokens_seen", {"tokens_seen": np.array(-5)}, "tokens_seen: expected an integer >= 0"),
        ("float size", {"size": np.array(float(st.size))}, "field 'size' must be one integer"),
        ("boolean version", {"version": np.array(True)}, "field 'version' must be one integer"),
        ("a newer version", {"version": np.array(2)}, "expected version 1, got 2"),
        ("an older version", {"version": np.array(0)}, "expected version 1, got 0"),
        ("a negative version", {"version": np.array(-1)}, "expected version 1, got -1"),
        ("format as bytes", {"format": np.array(b"something")}, "expected format"),
        ("format as a list", {"format": np.array(["refimpl.ovq.OVQState"])}, "expected format"),
    ]


@pytest.mark.parametrize("change, match", [pytest.param(c, m, id=i) for i, c, m in _tampered()])
def test_every_tampered_ovq_field_is_refused_with_its_name(tmp_path, change, match):
    fields = {**_fields(_state()), **change}
    path = tmp_path / "t.npz"
    _write(path, fields)
    with pytest.raises(ValueError, match=match) as info:
        ovq.OVQState.load(path)
    assert str(path) in str(info.value)


def test_a_consistent_state_that_cannot_continue_its_growth_is_refused_when_used(tmp_path):
    """Counts that add up but a size far below growth(tokens_seen): loads, then the next call says why it stops."""
    st = _state()
    n_max = st.max_size
    counts = np.zeros(n_max, dtype=np.int64)
    counts[0] = 500
    fields = {**_fields(st), "counts": counts, "size": np.array(1), "tokens_seen": np.array(500)}
    _write(tmp_path / "g.npz", fields)
    loaded = ovq.OVQState.load(tmp_path / "g.npz")
    q = np.ones((3, 3))
    with pytest.raises(ValueError, match="state: size = 1 after tokens_seen = 500 is too small for growth='plateau'"):
        ovq.ovq_attention(q, q, np.ones((3, 2)), max_size=n_max, chunk_size=1, state=loaded)


def _gma_tampered():
    st = _gma_state()
    return [
        ("integer slots", {"slots": np.ones((4, 2), dtype=np.int64)}, "slots: expected a real floating-point array"),
        ("complex norms", {"norms": st.norms + 1j}, "norms: expected a real floating-point array"),
        ("slots 1-D", {"slots": st.slots.ravel()}, "slots: expected a 2-D array"),
        ("norms of another K", {"norms": st.norms[:-1]}, r"norms: expected shape \(K,\) = \(4,\)"),
        ("NaN slot", {"slots": np.where(np.arange(4)[:, None] == 1, np.nan, st.slots)}, "slots: expected finite values"),
        ("negative norm", {"norms": -st.norms}, "norms: expected nonnegative"),
        ("norms of another dtype", {"norms": st.norms.astype(np.float32)}, r"norms: expected the dtype of slots \(float64\)"),
        ("negative tokens_seen", {"tokens_seen": np.array(-5)}, "tokens_seen: expected an integer >= 0"),
        ("float tokens_seen", {"tokens_seen": np.array(9.0)}, "field 'tokens_seen' must be one integer"),
        ("boolean version", {"version": np.array(True)}, "field 'version' must be one integer"),
        ("a newer version", {"version": np.array(2)}, "expected version 1, got 2"),
        ("an older version", {"version": np.array(0)}, "expected version 1, got 0"),
        ("a negative version", {"version": np.array(-1)}, "expected version 1, got -1"),
        ("format as bytes", {"format": np.array(b"something")}, "expected format"),
        ("the OVQ format", {"format": np.array("refimpl.ovq.OVQState")}, "expected format 'refimpl.gma.GMAState'"),
    ]


@pytest.mark.parametrize("change, match", [pytest.param(c, m, id=i) for i, c, m in _gma_tampered()])
def test_every_tampered_gma_field_is_refused_with_its_name(tmp_path, change, match):
    path = tmp_path / "t.npz"
    _write(path, {**_gma_fields(_gma_state()), **change})
    with pytest.raises(ValueError, match=match) as info:
        gma.GMAState.load(path)
    assert str(path) in str(info.value)
