"""The exercises: every lesson has 3 to 6, each solvable and none vacuous.

For every lesson ``tutorials/NN_name.py`` this module checks that

1. it has a ``## Exercises`` section with 3 to 6 check cells ``check("N.k", name)``,
   numbered 1, 2, ... in order, each right after the stub cell that defines ``name``,
   and that these are exactly the exercises ``tutorials/_exercises_NN.py`` registers;
2. the section says where the solutions are (``tutorials/solutions/lesson_NN.py``);
3. every check passes on the worked solution in ``tutorials/solutions/lesson_NN.py``;
4. every check fails on the lesson's own stub (the stub cell executed after the
   lesson's first code cell, the imports), so the notebook ships unsolved;
5. every check fails, with an ``AssertionError``, on each wrong answer listed for
   it in ``NEAR_MISSES`` (at least one per exercise: a flipped sign, a dropped
   factor, an off-by-one mask), so a check that asserts nothing is caught; and
   where a check has a tolerance, on an answer whose error is small but real
   (``solutions.off_by``: the solution's result off by a relative amount above
   the tolerance and below it loosened a millionfold), so a check whose
   tolerance was loosened that much is caught too;
6. every near miss carries a label saying which mistake it makes (``NEAR_MISSES``
   maps each label to its answer), and its failure message diagnoses it: below
   the entry, the expected value and the tolerance, a ``This looks like:``
   section (``tutorials/_hints.py``) names the mistake with a word of its label.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))

import _course  # noqa: E402  (from tutorials/)
import _hints  # noqa: E402  (from tutorials/)

CHECK_CALL = re.compile(r'^check\("(\d+)\.(\d+)",\s*([A-Za-z_]\w*)\)\s*$')


def _lesson(script: Path) -> int:
    return int(script.name[:2])


def _code_cells(script: Path) -> list[str]:
    return [c.source for c in jupytext.read(script, fmt="py:percent").cells if c.cell_type == "code"]


def _exercise_cells(script: Path):
    """(id, answer name, stub cell source) for every check cell of the lesson, in order."""
    cells = _code_cells(script)
    found = []
    for i, source in enumerate(cells):
        m = CHECK_CALL.match(source.strip())
        if m:
            found.append((f"{m.group(1)}.{m.group(2)}", m.group(3), cells[i - 1]))
    return found


def _solutions(lesson: int):
    return importlib.import_module(f"solutions.lesson_{lesson:02d}")


def _cases():
    cases = []
    for script in SCRIPTS:
        lesson = _lesson(script)
        try:
            exercises = _course.load(lesson)
        except ModuleNotFoundError:
            continue  # test_every_lesson_has_three_to_six_exercises says so
        for ex in exercises:
            cases.append(pytest.param(script, ex.id, id=ex.id))
    return cases


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_lesson_has_three_to_six_exercises(script):
    lesson = _lesson(script)
    text = script.read_text(encoding="utf-8")
    assert re.search(r"^# ## Exercises\s*$", text, re.M), f"{script.name} has no '## Exercises' section"
    assert f"tutorials/solutions/lesson_{lesson:02d}.py" in text, (
        f"{script.name}'s exercises do not say where the solutions are (tutorials/solutions/lesson_{lesson:02d}.py)"
    )
    in_notebook = [ex_id for ex_id, _, _ in _exercise_cells(script)]
    assert 3 <= len(in_notebook) <= 6, f"{script.name} has {len(in_notebook)} exercises, not 3 to 6"
    assert in_notebook == [f"{lesson}.{k}" for k in range(1, len(in_notebook) + 1)], in_notebook
    registered = [e.id for e in _course.load(lesson)]
    assert registered == in_notebook, f"_exercises_{lesson:02d}.py registers {registered}, the lesson checks {in_notebook}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_every_stub_cell_defines_the_answer_it_checks(script):
    for ex_id, name, stub in _exercise_cells(script):
        tree = ast.parse(stub)
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert name in defined, f"exercise {ex_id}: the cell before `check` does not define {name!r}"


@pytest.mark.parametrize(("script", "ex_id"), _cases())
def test_the_solution_passes(script, ex_id):
    solutions = _solutions(_lesson(script))
    assert ex_id in solutions.SOLUTIONS, f"no solution for exercise {ex_id} in {solutions.__file__}"
    _course.run(ex_id, solutions.SOLUTIONS[ex_id])


@pytest.mark.parametrize(("script", "ex_id"), _cases())
def test_the_stub_fails(script, ex_id):
    cells = _code_cells(script)
    stubs = {i: (name, stub) for i, name, stub in _exercise_cells(script)}
    name, stub = stubs[ex_id]
    namespace: dict = {"__name__": "__lesson__"}
    exec(compile(cells[0], f"{script.name}:imports", "exec"), namespace)
    exec(compile(stub, f"{script.name}:stub {ex_id}", "exec"), namespace)
    with pytest.raises(_course.NotAttempted):
        _course.run(ex_id, namespace[name])
    # and the check cell itself reports it without stopping the lesson
    assert _course.check(ex_id, namespace[name]) is False


# words of a near miss's label too common to name a mistake: one of the others must appear in the diagnosis
_COMMON = {"with", "from", "that", "this", "than", "into", "instead", "wrong", "answer", "value", "values",
           "entry", "entries", "every", "each", "only", "their", "your", "them", "they", "where", "when", "which"}


def _keywords(label):
    """The words of a near miss's label that name its mistake: four characters or more, not common, plural s dropped."""
    words = {w for w in re.findall(r"[a-z0-9_'^-]+", label.lower()) if len(w.strip("'-^")) >= 4} - _COMMON
    return {w[:-1] if w.endswith("s") and len(w) > 4 else w for w in words}


@pytest.mark.parametrize(("script", "ex_id"), _cases())
def test_every_wrong_answer_fails(script, ex_id):
    solutions = _solutions(_lesson(script))
    wrong = solutions.NEAR_MISSES.get(ex_id, {})
    assert wrong, f"exercise {ex_id}: list at least one wrong answer in NEAR_MISSES of {solutions.__file__}"
    assert isinstance(wrong, dict), (
        f"exercise {ex_id}: NEAR_MISSES maps a label saying which mistake each wrong answer makes to the answer, "
        f"got a {type(wrong).__name__}"
    )
    for label, answer in wrong.items():
        with pytest.raises(AssertionError) as info:
            _course.run(ex_id, answer)
        assert not isinstance(info.value, _course.NotAttempted), f"exercise {ex_id}: near miss {label!r} counts as a stub"
        # the message diagnoses: below its usual lines (entry, expected value, tolerance) it names the mistake
        message = str(info.value)
        assert _hints.HEADER in message, f"exercise {ex_id}, near miss {label!r}: the message diagnoses nothing:\n{message}"
        diagnosis = message.split(_hints.HEADER, 1)[1].lower()
        words = _keywords(label)
        assert words, f"exercise {ex_id}: the label {label!r} has no word that names a mistake"
        assert any(w in diagnosis for w in words), (
            f"exercise {ex_id}, near miss {label!r}: the diagnosis names none of {sorted(words)}:\n{message}"
        )


def test_the_keyword_rule_is_not_vacuous():
    assert _keywords("the guard eps missing") == {"guard", "missing"}
    assert _keywords("no shift, so exp overflows") == {"shift", "overflow"}
    assert _keywords("every value with the wrong answer") == set()


def test_the_framework_tells_a_stub_from_a_wrong_answer():
    @_course.exercise("99.1", "square", 1, points=1)
    def _square(f):
        assert f(3.0) == 9.0, f"f(3) = {f(3.0)}, expected 9"

    try:
        def stub(x):
            raise NotImplementedError

        assert _course.check("99.1", stub) is False
        assert _course.check("99.1", lambda x: x * x) is True
        with pytest.raises(AssertionError, match="expected 9"):
            _course.check("99.1", lambda x: x + x)
        with pytest.raises(_course.NotAttempted):
            _course.run("99.1", ...)
    finally:
        del _course.EXERCISES["99.1"]
