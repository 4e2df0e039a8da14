"""The files that ``python -m app train`` and ``python -m app experiment`` write and read back.

Both commands write into one output folder (``--out``) and read their own
CSV files back when they resume.  This module holds what they share:

* the folder itself is checked by :func:`refimpl.validation.check_out_folder`
  (refused, before anything is written, when it is an empty path, a file, a
  path below a file, or not writable);
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
from pathlib import Path
from typing import NamedTuple

__all__ = ["CsvFile", "read_csv", "naming", "progress_bar"]


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
