"""Every written question of the lessons' exercises has an instructor key in ``tutorials/solutions/keys/``.

What counts as a written question (the rule is deliberately simple): in the
markdown of a lesson's ``## Exercises`` section, every sentence that holds a
question mark, or the word "why" or "explain". The rest of a lesson (its
sections' rhetorical questions, answered in the text that follows them) is
not graded and is not scanned.

Each such sentence must be accounted for, in one of two ways:

* **a label** ``**Question N.k.**`` in the lesson (``k`` the exercise it
  belongs to), which covers the rest of its paragraph; lessons 3, 8 and 10
  use labels. The key is the section ``## Question N.k`` of
  ``keys/lesson_NN.md``;
* **a listed question** in :data:`LISTED` below: its exercise and the first
  words of the question, which must occur in that sentence. The key is the
  section ``## Exercise N.k: "first words"``.

And every key has a **Model answer.** and **Grading notes.**, every listed
question still occurs in its exercise (so the list cannot go stale), and the
keys hold no section for a question that no longer exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
KEYS = TUTORIALS / "solutions" / "keys"
SCRIPTS = {int(p.name[:2]): p for p in sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))}

#: lesson -> (exercise id, the first words of the question) for the lessons that do not label their questions
LISTED: dict[int, list[tuple[str, str]]] = {
    1: [("1.3", "Why does the adversarial mixture"), ("1.4", "Which of the two conditions")],
    2: [("2.2", 'Why is "$W M$ equals the output"'), ("2.3", "which terms"), ("2.4", "Can you also say why")],
    4: [("4.1", "Could $\\epsilon$ be learned"), ("4.1", "What is its sign")],
    5: [("5.3", "does it depend on $R$")],
    6: [("6.1", "what can be subtracted from a row of logits"), ("6.3", "where is the maximum")],
    7: [("7.4", "think about why it works")],
}

HIT = re.compile(r"\?|\bwhy\b|\bexplain\b", re.I)
LABEL = re.compile(r"\*\*Question (\d+)\.(\d+)\.?\*\*")
SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z*`$(])")


def _exercise_paragraphs(script: Path) -> list[tuple[str, str]]:
    """(exercise id, paragraph) for every markdown paragraph of the Exercises section, in order."""
    out, in_markdown, in_exercises, current, lines = [], False, False, "", []

    def flush():
        if lines and in_exercises:
            out.append((current, " ".join(s.strip() for s in lines)))
        lines.clear()

    for line in script.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            flush()
            in_markdown = "[markdown]" in line
            continue
        if not in_markdown:
            continue
        text = line[2:] if line.startswith("# ") else line.lstrip("#")
        if text.startswith("## Exercises"):
            in_exercises = True
        m = re.match(r"### Exercise (\d+\.\d+)", text)
        if m:
            flush()
            current = m.group(1)
            continue
        if not text.strip():
            flush()
        else:
            lines.append(text)
    flush()
    return out


def written_questions(lesson: int) -> list[tuple[str, str, str | None]]:
    """(exercise id, sentence, the label covering it or None) for every written-question sentence of a lesson.

    A label covers the sentence it starts in and every later sentence of its paragraph.
    """
    found = []
    for exercise, paragraph in _exercise_paragraphs(SCRIPTS[lesson]):
        label = LABEL.search(paragraph)
        position = 0
        for sentence in SENTENCE_END.split(paragraph):
            start = paragraph.index(sentence, position)
            position = start + len(sentence)
            if HIT.search(LABEL.sub("", sentence)):
                covered = label is not None and label.start() < position
                found.append((exercise, sentence, f"{label.group(1)}.{label.group(2)}" if covered else None))
    return found


def _keys(lesson: int) -> dict[str, str]:
    """Section heading -> its body, for every ``## `` section of the lesson's key file."""
    path = KEYS / f"lesson_{lesson:02d}.md"
    assert path.exists(), f"no instructor key {path.relative_to(ROOT)}"
    parts = re.split(r"^## (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2])}


def _expected_keys(lesson: int) -> set[str]:
    labels = {f"Question {n}.{k}" for n, k in LABEL.findall(SCRIPTS[lesson].read_text(encoding="utf-8"))}
    listed = {f'Exercise {ex}: "{words}"' for ex, words in LISTED.get(lesson, [])}
    return labels | listed


def test_every_lesson_has_a_key_file():
    assert sorted(SCRIPTS) == sorted(int(p.name[7:9]) for p in KEYS.glob("lesson_[0-9][0-9].md")), (
        "tutorials/solutions/keys/ needs one lesson_NN.md per lesson")


@pytest.mark.parametrize("lesson", sorted(SCRIPTS), ids=[f"lesson_{n:02d}" for n in sorted(SCRIPTS)])
def test_every_written_question_is_labelled_or_listed(lesson):
    listed = LISTED.get(lesson, [])
    for exercise, sentence, label in written_questions(lesson):
        if label is not None:
            assert label.split(".")[0] == str(lesson) and label == exercise, (
                f"lesson {lesson}: the label Question {label} sits in exercise {exercise}")
            continue
        assert any(ex == exercise and words in sentence for ex, words in listed), (
            f"lesson {lesson}, exercise {exercise}: a written question without a key: {sentence!r}. Label it "
            f"**Question {exercise}.** (lessons that use labels) or list its first words in LISTED of "
            f"tests/test_question_keys.py, and write its key in tutorials/solutions/keys/lesson_{lesson:02d}.md")


@pytest.mark.parametrize("lesson", sorted(LISTED), ids=[f"lesson_{n:02d}" for n in sorted(LISTED)])
def test_every_listed_question_is_still_in_its_exercise(lesson):
    sentences = written_questions(lesson)
    for ex, words in LISTED[lesson]:
        assert any(e == ex and words in s for e, s, _ in sentences), (
            f"lesson {lesson}: exercise {ex} no longer asks {words!r}: update LISTED and the key")


@pytest.mark.parametrize("lesson", sorted(SCRIPTS), ids=[f"lesson_{n:02d}" for n in sorted(SCRIPTS)])
def test_every_key_has_a_model_answer_and_grading_notes(lesson):
    keys, expected = _keys(lesson), _expected_keys(lesson)
    assert set(keys) == expected, (
        f"keys/lesson_{lesson:02d}.md: missing {sorted(expected - set(keys))}, no such question {sorted(set(keys) - expected)}")
    for heading, body in keys.items():
        for part in ("**Model answer.**", "**Grading notes.**"):
            assert part in body, f"keys/lesson_{lesson:02d}.md, {heading}: no {part}"
            after = body.split(part, 1)[1].split("**", 1)[0].strip()
            assert len(after.split()) >= 10, f"keys/lesson_{lesson:02d}.md, {heading}: {part} is empty or a stub"
