"""The lessons' exercises: a registry of checks, and the ``check`` that a lesson's check cell calls.

Every exercise of lesson ``NN`` is a function in ``tutorials/_exercises_NN.py``
registered with :func:`exercise`.  It receives the student's answer (a
function, or a value) and ``assert``s on it: it builds its own inputs, calls
the answer and compares with an independent result (``refimpl``, a dense
formula, finite differences), and raises ``AssertionError`` with a message
that says what is wrong.

In a lesson, the exercise is two cells::

    def causal_gma_backward(dout, cache):          # the stub the student fills in
        raise NotImplementedError("exercise 4.1")

    check("4.1", causal_gma_backward)               # the check cell

Until the stub is filled in (it still raises ``NotImplementedError``, or a
value answer is still ``...``), the check cell prints that the exercise is not
done yet and the lesson runs on; a wrong answer raises ``AssertionError``.

Worked solutions are in ``tutorials/solutions/lesson_NN.py``, out of sight of
the notebook.  ``tests/test_exercises.py`` runs every check against its
solution (it must pass), against the lesson's own stub (it must fail) and
against the wrong answers listed beside each solution (each must fail with an
``AssertionError``), so no check is unsolvable and none is vacuous.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

LEVELS = {1: "warm-up", 2: "core", 3: "stretch"}


@dataclass(frozen=True)
class Exercise:
    """One exercise: its id ``"L.k"`` (lesson L, exercise k), a title, a level and the check."""

    id: str
    title: str
    level: int
    run: Callable[[Any], None]

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])


EXERCISES: dict[str, Exercise] = {}


class NotAttempted(AssertionError):
    """The answer is still the stub: it raises ``NotImplementedError``, or is ``...``."""


def exercise(id: str, title: str, level: int) -> Callable:
    """Register the decorated function as the check of exercise ``id``."""
    lesson, _, number = id.partition(".")
    if not (lesson.isdigit() and number.isdigit()):
        raise ValueError(f"an exercise id is 'L.k' with integers L and k, got {id!r}")
    if level not in LEVELS:
        raise ValueError(f"level is one of {sorted(LEVELS)}, got {level!r}")

    def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
        if id in EXERCISES:
            raise ValueError(f"exercise {id} is registered twice")
        EXERCISES[id] = Exercise(id, title, level, run)
        return run

    return register


def load(lesson: int) -> list[Exercise]:
    """Import ``_exercises_NN`` (registering its checks) and return lesson ``lesson``'s exercises in order."""
    importlib.import_module(f"_exercises_{lesson:02d}")
    found = [e for e in EXERCISES.values() if e.lesson == lesson]
    return sorted(found, key=lambda e: int(e.id.split(".")[1]))


def get(id: str) -> Exercise:
    """The exercise ``id``, importing its lesson's checks on first use."""
    if id not in EXERCISES:
        lesson = id.split(".")[0]
        if not lesson.isdigit():
            raise KeyError(f"no exercise {id!r}: ids look like '4.1'")
        load(int(lesson))
    if id not in EXERCISES:
        raise KeyError(f"no exercise {id!r} in lesson {id.split('.')[0]}")
    return EXERCISES[id]


def run(id: str, answer: Any) -> None:
    """Run exercise ``id``'s check on ``answer``; raise :class:`NotAttempted` if it is still the stub.

    Raises
    ------
    NotAttempted
        ``answer`` is ``...``, or calling it raised ``NotImplementedError``.
    AssertionError
        ``answer`` is wrong; the message says how.
    """
    ex = get(id)
    if answer is Ellipsis:
        raise NotAttempted(f"exercise {id}: the answer is still `...`")
    try:
        ex.run(answer)
    except NotImplementedError as err:
        raise NotAttempted(f"exercise {id}: the stub still raises NotImplementedError") from err


def check(id: str, answer: Any) -> bool:
    """The check cell of exercise ``id``: True when ``answer`` passes, False while it is still the stub.

    A wrong answer raises ``AssertionError`` with what is wrong, so that the
    cell shows it in red; a stub prints that the exercise is not done yet and
    lets the lesson run on.
    """
    ex = get(id)
    try:
        run(id, answer)
    except NotAttempted:
        print(f"Exercise {id} ({ex.title}): not done yet. Write your answer in the cell above, "
              "run it, then run this cell again.")
        return False
    print(f"Exercise {id} ({ex.title}): correct.")
    return True
