"""Stream states on disk: one ``.npz`` layout for :class:`refimpl.ovq.OVQState` and :class:`refimpl.gma.GMAState`.

A state file is an uncompressed ``.npz`` archive (no pickles) that holds a
``format`` string, an integer ``version`` and the state's named fields.
:func:`load` refuses, with a ``ValueError`` that names the file and the
problem, anything that is not a complete archive of that format and version:
a truncated or foreign file, a missing field, a field that should be one
integer and is not.  The state's own constructor then checks its invariants.
"""

from __future__ import annotations

import zipfile

import numpy as np

__all__ = ["save", "load"]


def save(path, format: str, version: int, **fields) -> None:
    """Write ``fields`` (arrays, or integers stored as int64 scalars) with ``format`` and ``version`` to ``path``."""
    arrays = {name: np.array(value, dtype=np.int64) if isinstance(value, int) else value for name, value in fields.items()}
    with open(path, "wb") as f:
        np.savez(f, format=np.array(format), version=np.array(version, dtype=np.int64), **arrays)


def load(path, format: str, version: int, what: str, arrays: tuple, integers: tuple) -> dict:
    """Read a file written by :func:`save`: ``{name: value}`` for ``arrays`` (ndarrays) and ``integers`` (ints).

    ``what`` names the state in messages (``"OVQState"``).  Raises
    ``FileNotFoundError`` when ``path`` does not exist, ``ValueError`` for
    anything else that is wrong with the file.
    """
    fields = ("format", "version") + tuple(arrays) + tuple(integers)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy file holds one bare array
            raise ValueError(f"expected an .npz archive of named fields, got a single {type(data).__name__}")
        with data:
            missing = [f for f in fields if f not in data.files]
            if missing:
                raise ValueError(f"missing field(s) {missing}")
            values = {f: data[f] for f in fields}
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a complete {what} file ({type(e).__name__}: {e})") from e
    if values["format"].shape != () or str(values["format"]) != format:
        raise ValueError(f"{path}: expected format {format!r}, got {values['format']!r}")
    for f in ("version",) + tuple(integers):
        a = values[f]
        if a.shape != () or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{path}: field {f!r} must be one integer, got dtype {a.dtype} shape {a.shape}")
    if int(values["version"]) != version:
        raise ValueError(f"{path}: expected version {version}, got {int(values['version'])}")
    return {f: (int(values[f]) if f in integers else values[f]) for f in tuple(arrays) + tuple(integers)}
