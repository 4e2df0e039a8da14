"""The course plan (tutorials/course.py) agrees with the lessons, and the README shows it as it is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tutorials"))

import course  # noqa: E402  (tutorials/course.py)

LESSONS = course.lessons()


def test_every_lesson_has_its_place_in_the_graph_after_what_it_needs():
    assert set(course.NEEDS) == set(LESSONS), "NEEDS in tutorials/course.py lists other lessons than tutorials/ has"
    for n, needs in course.NEEDS.items():
        assert all(m < n for m in needs), f"lesson {n} needs a later lesson: {needs}"
        assert len(set(needs)) == len(needs)


@pytest.mark.parametrize("n", sorted(LESSONS))
def test_each_lesson_names_the_lessons_it_needs(n):
    script = LESSONS[n]
    text = course.before(script)
    assert text, f"{script.name} has no '**Before this lesson**' paragraph"
    named = course.lessons_named_before(script)
    missing = set(course.NEEDS[n]) - named
    assert not missing, f"{script.name}: course.NEEDS says it builds on lessons {sorted(missing)}, its text does not: {text!r}"
    earlier_unlisted = {m for m in named if m < n} - set(course.NEEDS[n])
    assert not earlier_unlisted, (
        f"{script.name} names earlier lessons {sorted(earlier_unlisted)} that NEEDS does not list: {text!r}")


@pytest.mark.parametrize("n", sorted(LESSONS))
def test_each_lesson_states_three_to_five_objectives(n):
    items = course.objectives(LESSONS[n])
    assert 3 <= len(items) <= 5, f"{LESSONS[n].name}: {len(items)} objectives under '**You will learn to**'"
    assert all(len(item) > 10 for item in items), items


def test_the_parsers_read_what_they_should():
    assert course.lessons_named_before_text("lessons 1 and 2, and lesson 4") == {1, 2, 4}
    assert course.lessons_named_before_text("lessons 1, 3 or 5; no GPU") == {1, 3, 5}
    assert course.lessons_named_before_text("linear algebra; nothing else") == set()


def test_every_lesson_has_measured_run_times():
    times = course.run_times()["lessons"]
    for n in LESSONS:
        entry = times.get(str(n), {})
        assert entry.get("small_s", 0) > 0 and entry.get("full_s", 0) > 0, (
            f"lesson {n} has no run times: `python tutorials/course.py measure {n}`")
        assert entry["full_s"] >= entry["small_s"] * 0.5, entry
    assert course.run_times().get("date") and course.run_times().get("machine")


def test_the_readme_shows_the_course_as_it_is():
    text = course.README.read_text(encoding="utf-8")
    assert course.readme_section() in text, "tutorials/README.md is out of date: `python tutorials/course.py readme`"


def _closure(needs):
    """Every (earlier, later) pair that a graph of direct needs orders."""
    pairs = set()
    for n in needs:
        todo, seen = list(needs[n]), set()
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                pairs.add((m, n))
                todo.extend(needs[m])
    return pairs


def test_the_drawn_graph_keeps_every_order_and_no_implied_edge():
    reduced = course.reduced_needs()
    assert _closure(reduced) == _closure(course.NEEDS), "the picture loses or adds a reading order"
    for n, needs in reduced.items():
        for m in needs:
            without = {k: tuple(x for x in v if (k, x) != (n, m)) for k, v in reduced.items()}
            assert (m, n) not in _closure(without), f"the edge {m} -> {n} is implied by others"
    assert course.reduced_needs_of({1: (), 2: (1,), 3: (1, 2)}) == {1: (), 2: (1,), 3: (2,)}


def test_the_graph_draws_every_lesson_and_edge(tmp_path):
    svg = course.draw_graph(tmp_path / "graph.svg").read_text(encoding="utf-8")
    assert svg.startswith("<?xml") and "<svg" in svg
    mermaid = course.mermaid()
    for n, needs in course.reduced_needs().items():
        for m in needs:
            assert f"L{m} --> L{n}" in mermaid
    assert mermaid.count("-->") == sum(len(v) for v in course.reduced_needs().values())
