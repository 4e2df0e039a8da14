"""The study-time estimates in the course plan are those that ``tutorials/study_time.py`` computes from the lessons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tutorials"))

import _course  # noqa: E402  (tutorials/_course.py)
import study_time  # noqa: E402  (tutorials/study_time.py)


@pytest.mark.parametrize("path", list(study_time.TARGETS), ids=lambda p: p.name)
def test_the_table_in_the_course_plan_is_up_to_date(path):
    written = study_time.written_block(path)
    assert written is not None, f"{path.relative_to(ROOT)} has no study-time block: {study_time.TARGETS[path]}"
    assert written == study_time.block(path), (
        f"the study-time table in {path.relative_to(ROOT)} is out of date: `python tutorials/study_time.py write`")


def test_the_estimates_follow_their_rules():
    estimates = study_time.estimates()
    assert [e.lesson for e in estimates] == sorted(e.lesson for e in estimates) and len(estimates) == 10
    assert set(study_time.MINUTES_PER_EXERCISE) == set(_course.LEVELS)
    for e in estimates:
        exercises = _course.load(e.lesson)
        assert sum(e.exercises.values()) == len(exercises) >= 3
        assert e.exercise_min == sum(study_time.MINUTES_PER_EXERCISE[ex.level] for ex in exercises)
        # at 150 words a minute, rounded up: between words / 150 and that plus one
        assert e.words / study_time.WORDS_PER_MINUTE <= e.reading_min < e.words / study_time.WORDS_PER_MINUTE + 1
        assert e.words > 1000, f"lesson {e.lesson}: {e.words} words of prose is too few to be the lesson"


def test_prose_words_counts_markdown_only(tmp_path):
    script = tmp_path / "99_x.py"
    script.write_text("# ---\n# jupyter: header words\n# ---\n\n# %% [markdown]\n# # Title here\n#\n# three more words\n\n"
                      "# %%\nx = 1  # code is not read\n\n# %% [markdown]\n# last\n", encoding="utf-8")
    assert study_time.prose_words(script) == 6  # "Title", "here", "three", "more", "words", "last"
