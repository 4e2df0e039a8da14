"""Estimated study time per lesson: minutes of reading and of exercises, computed from the lessons themselves.

These are **estimates**, not measurements: nobody was timed. They are
reached by two stated rules, so that the table in ``tutorials/README.md``
and in ``docs/course.md`` follows the lessons when they change (a test
compares both tables with :func:`table`):

* **reading**: the words of the lesson's markdown cells (its prose,
  formulas counted word by word as written in the source) at
  :data:`WORDS_PER_MINUTE` words a minute, a slow reading pace, since the
  prose is dense with derivations; rounded up to whole minutes;
* **exercises**: a fixed time per exercise by its level (``_course.LEVELS``:
  warm-up, core, stretch), :data:`MINUTES_PER_EXERCISE`, summed over the
  exercises that ``tutorials/_exercises_NN.py`` registers.

Running the cells is not counted (the run times are in the course table).

Commands, from the repository root::

    .venv/bin/python tutorials/study_time.py          # print the table
    .venv/bin/python tutorials/study_time.py write    # rewrite it in tutorials/README.md and docs/course.md
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _course  # noqa: E402  (tutorials/_course.py: the exercises and their levels)
import course  # noqa: E402  (tutorials/course.py: the lessons and their titles)

#: Reading pace for the lessons' prose, in words per minute (an assumption, stated in the table).
WORDS_PER_MINUTE = 150
#: Minutes per exercise by level (1 warm-up, 2 core, 3 stretch; ``_course.LEVELS``): an assumption.
MINUTES_PER_EXERCISE = {1: 10, 2: 25, 3: 45}

_WRITTEN_BY = "study time: written by `python tutorials/study_time.py write`; edit study_time.py, not this"
#: Each file that holds the table, with its two marker lines (an HTML comment on GitHub, a MyST comment for Sphinx).
TARGETS = {
    HERE / "README.md": (f"<!-- {_WRITTEN_BY} -->", "<!-- end of the study time -->"),
    HERE.parent / "docs" / "course.md": (f"% {_WRITTEN_BY}", "% end of the study time"),
}


class Estimate(NamedTuple):
    """One lesson's estimate: its words of prose, the minutes to read them, its exercises by level, their minutes."""

    lesson: int
    words: int
    reading_min: int
    exercises: dict  # level -> count
    exercise_min: int


def prose_words(script: Path) -> int:
    """The number of words in the markdown cells of a lesson's py:percent script (tokens with a letter or digit)."""
    # a word holds a letter or a digit: heading marks, table rules and bullets are not words
    words = sum(1 for text in course.markdown_lines(script) for token in text.split() if re.search(r"\w", token))
    return words


def estimate(lesson: int, script: Path) -> Estimate:
    """The estimate of one lesson, by the two rules of the module docstring."""
    words = prose_words(script)
    levels: dict[int, int] = {}
    for ex in _course.load(lesson):
        levels[ex.level] = levels.get(ex.level, 0) + 1
    return Estimate(lesson, words, math.ceil(words / WORDS_PER_MINUTE), levels,
                    sum(MINUTES_PER_EXERCISE[level] * n for level, n in levels.items()))


def estimates() -> list[Estimate]:
    """Every lesson's estimate, in course order."""
    return [estimate(n, script) for n, script in course.lessons().items()]


def table() -> str:
    """The Markdown written between the markers of :data:`TARGETS`: the rules, then one row per lesson."""
    stars = {1: "★", 2: "★★", 3: "★★★"}
    per_level = ", ".join(f"{stars[k]} {m} min" for k, m in sorted(MINUTES_PER_EXERCISE.items()))
    rows = [
        "Estimated minutes of study per lesson. These are estimates, not measurements: reading is the words of "
        f"the lesson's prose at {WORDS_PER_MINUTE} words a minute, rounded up; exercises are a fixed time by level "
        f"({per_level}), summed over the lesson's exercises. Running the cells is not counted. "
        "`python tutorials/study_time.py write` recomputes this table from the lessons.",
        "",
        "| lesson | words of prose | reading (min) | exercises | exercises (min) | total (min) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in estimates():
        ex = ", ".join(f"{n} {stars[k]}" for k, n in sorted(e.exercises.items()))
        rows.append(f"| {e.lesson} | {e.words} | {e.reading_min} | {ex} | {e.exercise_min} | "
                    f"{e.reading_min + e.exercise_min} |")
    total_r = sum(e.reading_min for e in estimates())
    total_x = sum(e.exercise_min for e in estimates())
    rows.append(f"| all | {sum(e.words for e in estimates())} | {total_r} | | {total_x} | {total_r + total_x} |")
    return "\n".join(rows)


def block(path: Path) -> str:
    """What belongs between (and including) the markers of ``path``."""
    begin, end = TARGETS[path]
    return f"{begin}\n\n{table()}\n\n{end}"


def written_block(path: Path) -> str | None:
    """The block between (and including) the markers in ``path`` as it is now, or None when they are missing."""
    begin, end = TARGETS[path]
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        return None
    return begin + text.split(begin, 1)[1].split(end, 1)[0] + end


def write() -> list[Path]:
    """Rewrite the block in every file of :data:`TARGETS`; return those that changed."""
    changed = []
    for path in TARGETS:
        old = written_block(path)
        if old is None:
            raise SystemExit(f"{path} has no study-time block (the markers {TARGETS[path]})")
        text = path.read_text(encoding="utf-8")
        new = text.replace(old, block(path))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


if __name__ == "__main__":
    if sys.argv[1:] == ["write"]:
        print("rewritten: " + (", ".join(str(p) for p in write()) or "nothing, already up to date"))
    elif not sys.argv[1:]:
        print(table())
    else:
        raise SystemExit("usage: python tutorials/study_time.py [write]")
