"""The files that ``python -m refimpl train`` and ``python -m refimpl experiment`` write and read back.

Both commands write into one output folder (``--out``) and read their own
CSV files back when they resume.  This module holds what they share:

* :func:`check_out_folder`: the folder is refused, before anything is
  written, when it is an empty path, a file, a path below a file, or not
  writable;
* :func:`read_csv`: a CSV file as text rows with their line numbers, read as
  UTF-8.  A last line without its newline is the row a kill or a full disk
  cut short: it is left out (the caller recomputes it), never read as
  complete;
* :func:`naming`: an ``OSError`` raised while writing a file carries that
  file's name, so that the command can say which file it could not write;
* :func:`progress_bar`: the tqdm bar of both, cleared when the work ends in
  an error, so that the error's line is the one that stays.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import stat
from pathlib import Path
from typing import NamedTuple

__all__ = ["CsvFile", "check_out_folder", "read_csv", "naming", "progress_bar"]


def check_out_folder(out, name: str = "out") -> Path:
    """The output folder ``out`` as a :class:`~pathlib.Path`, refused unless it is or can become a writable folder.

    Nothing is created: the folder may not exist yet, but its nearest
    existing ancestor must then be a writable folder.

    Parameters
    ----------
    out : str or os.PathLike
        The folder.  An empty string is refused (it is not taken as the
        current folder).
    name : str, default "out"
        The argument's name in the messages.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        ``out`` is empty, is a file, lies below a file, or is (or would be
        created in) a folder that is not writable.
    TypeError
        ``out`` is not a path.
    """
    if isinstance(out, bytes) or not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a folder path, got {type(out).__name__}")
    if not str(os.fspath(out)).strip():
        raise ValueError(f"{name}: expected a folder, got an empty path {os.fspath(out)!r}; pass a folder such as results/run")
    path = Path(out)
    probe = path
    while True:
        try:
            mode = os.stat(probe).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                raise ValueError(f"{name}: {path} cannot be created: no part of it exists") from None
            probe = probe.parent
        except OSError as err:
            raise ValueError(f"{name}: cannot inspect {probe} ({err.strerror or err})") from None
    if not stat.S_ISDIR(mode):
        if probe == path:
            raise ValueError(f"{name}: {path} is a file, not a folder; pass a folder")
        raise ValueError(f"{name}: {path} lies below {probe}, which is a file, not a folder; pass a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = f"{path}" if probe == path else f"{probe}, where {path} would be created,"
        raise ValueError(f"{name}: {where} is not writable (permission denied); pass a folder you can write to")
    return path


class CsvFile(NamedTuple):
    """What :func:`read_csv` returns."""

    header: list | None  # the first row, None for a file without a complete line
    rows: list  # (line number, list of str) of every complete row after the header, in order
    complete_bytes: int  # the length of the file up to its last newline (what stays when the torn end is cut)
    torn: bool  # the file ends with a line that has no newline (left out of header and rows)


def read_csv(path, name: str) -> CsvFile:
    """The complete rows of the CSV file at ``path``, as text, with their line numbers.

    The file is read as UTF-8.  Its last line is left out when it has no
    newline: a writer that is killed, or runs out of disk, leaves such a
    line, and a number cut short still parses as a (wrong) number.

    Parameters
    ----------
    path : str or os.PathLike
    name : str
        What the file is, as the messages name it (``"log"``, ``"out"``).

    Returns
    -------
    CsvFile

    Raises
    ------
    ValueError
        The file is not UTF-8 text (the message gives the first bad line),
        or cannot be read.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{name}: cannot read {path} ({err.strerror or err})") from None
    end = data.rfind(b"\n") + 1  # after the last newline: what follows it was cut short
    try:
        text = data[:end].decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{name}: {path}, line {line}, is not UTF-8 text; the file is damaged or not one of ours: "
                         "remove it or that line") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows = []
    for row in reader:
        rows.append((reader.line_num, row))
    header = rows.pop(0)[1] if rows else None
    return CsvFile(header, rows, end, end < len(data))


@contextlib.contextmanager
def naming(path):
    """Within the block, an ``OSError`` without a file name (a failed ``write``, say) gets ``path`` as its file name.

    Parameters
    ----------
    path : str or os.PathLike
        The file the block writes.
    """
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise type(err)(err.errno, err.strerror or str(err), str(path)) from err


@contextlib.contextmanager
def progress_bar(**kwargs):
    """A ``tqdm.auto.tqdm`` bar for the block (on standard error), left on screen only when the block succeeds.

    Parameters
    ----------
    **kwargs
        Passed to ``tqdm`` (``total``, ``initial``, ``desc``, ``disable``).
    """
    from tqdm.auto import tqdm

    bar = tqdm(**kwargs)
    succeeded = False
    try:
        yield bar
        succeeded = True
    finally:
        bar.leave = bar.leave and succeeded
        bar.close()
