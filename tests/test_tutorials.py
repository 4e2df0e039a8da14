"""The tutorials: each notebook is paired with its script, committed clean, and runs top to bottom.

Every ``tutorials/NN_name.ipynb`` is found by its name; nothing registers it.
For each one this module checks that

1. its jupytext twin ``tutorials/NN_name.py`` exists and has the same cells;
2. it is committed without outputs and without execution counts;
3. it executes without an error (marked ``notebook``), with ``TUTORIAL_SMALL=1``
   unless the environment sets ``TUTORIAL_SMALL`` already (``TUTORIAL_SMALL=0``
   runs the full-size lessons), in a kernel of the Python running pytest, in
   ``tutorials/``, within ``TUTORIAL_TIMEOUT`` seconds per notebook (default
   300).  A lesson's ``assert`` on a measured error fails this test.  The
   executed notebook is saved in ``docs/_build/executed/``, where
   ``make docs-check`` finds its outputs (figures included) for the site.

The kernel is ipykernel's own kernelspec for ``sys.executable``; kernelspecs
installed elsewhere (``~/.local/share/jupyter``, other environments) are never
used, so a fresh virtual environment with the ``dev`` extras is all it needs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
sys.path.insert(0, str(TUTORIALS))

import course  # noqa: E402  (tutorials/course.py: executes a lesson the way its run times are measured)

NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
EXECUTED = ROOT / "docs" / "_build" / "executed"  # read by docs/conf.py
TIMEOUT_S = float(os.environ.get("TUTORIAL_TIMEOUT", "300"))

SYNC_HINT = (
    "edit the script, then regenerate the notebook without outputs: "
    "`jupytext --to ipynb tutorials/{stem}.py` (or `jupytext --sync tutorials/{stem}.py` "
    "if the notebook is the newer file); see tutorials/README.md"
)


def _ids(paths):
    return [p.stem for p in paths]


def _cells(nb):
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def test_there_are_lessons():
    assert NOTEBOOKS, f"no tutorials/NN_name.ipynb found in {TUTORIALS}"


def test_every_script_has_a_notebook_and_every_notebook_a_script():
    notebooks, scripts = {p.stem for p in NOTEBOOKS}, {p.stem for p in SCRIPTS}
    assert not scripts - notebooks, (
        f"scripts without a notebook: {sorted(scripts - notebooks)}; create it with "
        "`jupytext --to ipynb tutorials/NN_name.py`"
    )
    assert not notebooks - scripts, (
        f"notebooks without a script: {sorted(notebooks - scripts)}; pair them with "
        "`jupytext --set-formats ipynb,py:percent tutorials/NN_name.ipynb`"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_matches_its_script(notebook):
    script = notebook.with_suffix(".py")
    if not script.exists():
        pytest.fail(f"{script.name} is missing; {SYNC_HINT.format(stem=notebook.stem)}")
    from_script = _cells(jupytext.read(script, fmt="py:percent"))
    from_notebook = _cells(nbformat.read(notebook, as_version=4))
    for i, (a, b) in enumerate(zip(from_script, from_notebook)):
        assert a == b, (
            f"cell {i} differs between {script.name} and {notebook.name}:\n"
            f"script:   {a[0]}: {a[1][:200]!r}\nnotebook: {b[0]}: {b[1][:200]!r}\n"
            + SYNC_HINT.format(stem=notebook.stem)
        )
    assert len(from_script) == len(from_notebook), (
        f"{script.name} has {len(from_script)} cells, {notebook.name} has {len(from_notebook)}; "
        + SYNC_HINT.format(stem=notebook.stem)
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_committed_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{notebook.name}: cells {dirty} have outputs or execution counts; "
        + SYNC_HINT.format(stem=notebook.stem)
    )


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(notebook, monkeypatch):
    # small sizes unless the caller chose otherwise; the kernel inherits this environment
    monkeypatch.setenv("TUTORIAL_SMALL", os.environ.get("TUTORIAL_SMALL", "1"))
    # the checkout's packages, whether or not they are installed in this environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # the kernel's own inline backend, as a teacher sees it, whatever the caller set
    monkeypatch.delenv("MPLBACKEND", raising=False)

    nb = nbformat.read(notebook, as_version=4)
    start = time.monotonic()
    deadline = start + TIMEOUT_S
    # per cell: whatever is left of the notebook's budget (at least 1 s: 0 would mean no limit)
    course.execute(nb, timeout_func=lambda cell: max(1, int(deadline - time.monotonic())))
    seconds = time.monotonic() - start
    EXECUTED.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, EXECUTED / notebook.name)
    print(f"{notebook.name}: executed in {seconds:.1f} s with TUTORIAL_SMALL={os.environ['TUTORIAL_SMALL']} "
          f"by {sys.executable}")
    assert seconds <= TIMEOUT_S, f"{notebook.name} took {seconds:.0f} s, more than TUTORIAL_TIMEOUT = {TIMEOUT_S:.0f} s"
