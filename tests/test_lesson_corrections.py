"""Corrections to lessons 3, 8 and 10, the glossary and the course plan, held in place.

The numerical corrections are asserted inside the lessons themselves (run by
``tests/test_tutorials.py``): AdamW against SGD on a small gradient and the
heatmap's column centres (lesson 10, section 5), the NMI bound and the 15
non-padding token types (section 6), BLAS pinned to one thread while lesson
3 times its chunk sizes. This module guards the wording and the symbols,
which no assertion in a lesson can see.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
sys.path.insert(0, str(TUTORIALS))

import course  # noqa: E402  (tutorials/course.py)


def _markdown(script: Path) -> str:
    return "\n".join(course.markdown_lines(script))


def _between(text: str, start: str, end: str) -> str:
    assert start in text, f"{start!r} not found"
    rest = text.split(start, 1)[1]
    return rest.split(end, 1)[0] if end in rest else rest


LESSON_10 = _markdown(TUTORIALS / "10_training_gma.py")


def test_lesson_10_does_not_claim_that_unused_components_stay_dead():
    assert "would stay dead" not in LESSON_10
    assert "AdamW divides by" in LESSON_10 and "app.optim.adam_step" in LESSON_10


def test_lesson_10_counts_the_token_types_right():
    assert "16 token types in 3 non-padding categories" not in LESSON_10
    assert "15 non-padding token types" in LESSON_10


def test_lesson_10_truncation_terms_have_their_sixth():
    terms = re.findall(r"h\^2\|L'''[^|$]*\|(/6)?", LESSON_10)
    assert terms and all(t == "/6" for t in terms), f"a truncation term h^2|L'''| without /6 in lesson 10: {terms}"


def test_lesson_10_keeps_h_for_the_step_and_c_for_the_chunk():
    section_1 = _between(LESSON_10, "## 1. From the mechanism to a layer", "## 2.")
    assert "^{(h)}" not in section_1 and "head $h$" not in section_1, "section 1 uses h as a head index"
    exercise_1 = _between(LESSON_10, "### Exercise 10.1", "### Exercise 10.2")
    assert not re.search(r"\\times C\$|\(B, C\)", exercise_1), "exercise 10.1 uses C (the chunk length) for classes"


def test_exercise_8_4_has_one_symbol_for_the_chunk_length():
    text = _between(_markdown(TUTORIALS / "08_ovq.py"), "### Exercise 8.4", "\n### ")
    assert not re.search(r"\(L, |n \+ L\b|\bL positions", text), "exercise 8.4 calls the chunk length L"
    assert "C'" in text


def test_lesson_3_times_with_pinned_blas_and_says_why():
    script = (TUTORIALS / "03_causal_gma.py").read_text(encoding="utf-8")
    assert "broad optimum" not in script
    assert 'threadpool_limits(limits=1, user_api="blas")' in script and "np.median(runs)" in script
    # the text says what was wrong with the earlier figure
    assert "competed for the same cores" in _markdown(TUTORIALS / "03_causal_gma.py").replace("\n", " ")


@pytest.mark.parametrize("name", sorted(set(re.findall(r"`(refimpl(?:\.\w+)+)`",
                                                        (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")))))
def test_every_object_the_glossary_cites_exists(name):
    module, _, attr = name.rpartition(".")
    try:
        importlib.import_module(name)  # a module
        return
    except ImportError:
        pass
    assert hasattr(importlib.import_module(module), attr), f"docs/glossary.md cites {name}, which does not exist"


def test_the_course_plan_bounds_the_plateau_by_n_max():
    text = (TUTORIALS / "README.md").read_text(encoding="utf-8")
    assert "plateau (at most n_max − 1 rows)" in text
    assert not re.search(r"at most N\s*[−-]\s*1", text)


def test_lesson_10_says_what_med_of_an_even_count_is_as_app_tasks_computes_it():
    """The floor of the mean of the two middle values (LRA's ``int(np.median(...))``), not the lower middle value."""
    from app import tasks

    section = _between(LESSON_10, "## 3. ListOps-mini", "## 4.")
    assert "lower middle value as an integer" not in section and "floor of the mean of the two middle values" in section
    assert "`[MED 1 4 ]` is 2" in section and tasks.listops_value(tasks.listops_encode("[MED 1 4 ]")) == 2
    # and the lesson asserts it against app.tasks when it runs
    code = (TUTORIALS / "10_training_gma.py").read_text(encoding="utf-8")
    assert "tasks.listops_value(tasks.listops_encode(text)) == value" in code
