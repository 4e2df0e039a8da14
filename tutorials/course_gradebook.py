"""The autograder's gradebook: points, the written questions' scores, the files an LMS imports, and feedback reports.

:func:`write` turns the graded submissions of one lesson (``course_grader.grade``)
into, in the gradebook's folder:

* ``lesson_NN.csv``, one row per student: ``student`` (from the roster, or the
  submission's folder or file name), ``name``, one numeric column of points
  per exercise, ``written`` (the written questions' score), ``total``,
  ``maximum``, ``percent``, then each exercise's status (``status 4.1``, ...)
  and ``submission``.  Every number is a plain decimal, so no spreadsheet reads
  one as a date;
* ``lesson_NN_canvas.csv``: Canvas's gradebook import, ``Student``, ``ID``,
  ``SIS User ID``, ``SIS Login ID``, ``Section`` and one column for the
  lesson's total, with a ``Points Possible`` row under the header;
* ``lesson_NN_moodle.csv``: for Moodle's "Import grades from a CSV file":
  ``ID number``, ``Email address``, ``Full name``, the total and the percent;
* ``lesson_NN.json``: every result with every case and message in full;
* ``reports/SUBMISSION.md``: what the student receives, each exercise's result,
  points, the public check's message and hint, and of a hidden case only
  that it failed and what the mistake looks like (no hidden input, no
  expected value);
* ``instructor/SUBMISSION.md``: the same with every message in full.

``docs/course.md`` describes the roster and written-score files and how to
import the two LMS files.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

ROSTER_COLUMNS = ("submission", "name", "id", "sis_user_id", "sis_login_id", "email", "section")
POINTS_POSSIBLE = "Points Possible"


def unique(names: list[str]) -> list[str]:
    """``names`` with a repeated one numbered (``alice``, ``alice-2``): every report and notebook gets its own file."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return out


def _rows(path: Path) -> tuple[list[str], list[tuple[int, dict]]]:
    """The header and ``(line, row)`` of a UTF-8 CSV file (a byte-order mark, as spreadsheets write, is fine)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        rows = [(reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items() if k is not None})
                for row in reader]
    return header, rows


def read_roster(path: Path, submissions: list[str]) -> dict[str, dict]:
    """``{submission: {name, id, sis_user_id, sis_login_id, email, section}}`` from a roster CSV.

    The roster has a ``submission`` column (the folder or file name the
    grader gives a submission) and any of the others of
    :data:`ROSTER_COLUMNS`.  A roster that names no submission of this class,
    or names one twice, is refused; a submission it does not list keeps its
    name.
    """
    header, rows = _rows(Path(path))
    if "submission" not in header:
        raise SystemExit(f"{path}: a roster needs a 'submission' column (the folder or file name of each "
                         f"submission), and any of {', '.join(ROSTER_COLUMNS[1:])}; it has {', '.join(header)}")
    unknown = [h for h in header if h not in ROSTER_COLUMNS]
    if unknown:
        raise SystemExit(f"{path}: unknown roster columns {', '.join(unknown)} (known: {', '.join(ROSTER_COLUMNS)})")
    people: dict[str, dict] = {}
    for line, row in rows:
        key = row.get("submission", "")
        if not key:
            raise SystemExit(f"{path}, line {line}: no submission")
        if key in people:
            raise SystemExit(f"{path}, line {line}: submission {key!r} is listed twice")
        people[key] = {c: row.get(c, "") for c in ROSTER_COLUMNS[1:]}
    if people and not set(people) & set(submissions):
        raise SystemExit(f"{path}: the roster names none of the submissions ({', '.join(submissions[:5])}, ...)")
    return people


def student_id(submission: str, people: dict) -> str:
    """The identifier of a student in the gradebook: the roster's ``id`` (or SIS ids, or email), else the submission's name."""
    person = people.get(submission, {})
    for column in ("id", "sis_user_id", "sis_login_id", "email"):
        if person.get(column):
            return person[column]
    return submission


def keys_of(submissions: list[str], people: dict) -> dict[str, str]:
    """Every name a written-scores file may use for a student (its gradebook identifier or its submission) -> submission."""
    keys = {s: s for s in submissions}
    keys.update({student_id(s, people): s for s in submissions})
    return keys


def read_written(path: Path, keys: dict[str, str]) -> tuple[dict[str, float], float, list[str]]:
    """``({submission: score}, maximum, questions)`` from a CSV of the written questions' scores.

    One column ``student`` (a gradebook identifier or a submission's name),
    one column per written question, one row per student, and a row whose
    ``student`` is ``Points Possible`` holding each question's maximum.  A
    score that is not a number, is negative or is above its maximum, and a
    student not in this class, are refused naming the file and line.
    """
    header, rows = _rows(Path(path))
    questions = [h for h in header if h != "student"]
    if "student" not in header or not questions:
        raise SystemExit(f"{path}: the written scores need a 'student' column and one column per question")
    maxima, scores = None, {}
    for line, row in rows:
        values = {}
        for q in questions:
            text = row.get(q, "")
            try:
                values[q] = float(text) if text else 0.0
            except ValueError:
                raise SystemExit(f"{path}, line {line}: {q} = {text!r} is not a number") from None
            if values[q] < 0:
                raise SystemExit(f"{path}, line {line}: {q} = {text} is negative")
        if row["student"] == POINTS_POSSIBLE:
            maxima = values
            continue
        if row["student"] not in keys:
            raise SystemExit(f"{path}, line {line}: no submission of this class is {row['student']!r}")
        scores[keys[row["student"]]] = (line, values)
    if maxima is None:
        raise SystemExit(f"{path}: no '{POINTS_POSSIBLE}' row giving each question's maximum")
    total = {}
    for submission, (line, values) in scores.items():
        over = [q for q in questions if values[q] > maxima[q]]
        if over:
            raise SystemExit(f"{path}, line {line}: {', '.join(over)} above the {POINTS_POSSIBLE} row")
        total[submission] = sum(values.values())
    return total, sum(maxima.values()), questions


def _number(x: float) -> str:
    """A score as a plain decimal (``2``, ``2.5``, ``66.67``): never a form a spreadsheet reads as a date."""
    return f"{round(x, 2):g}" if abs(x) < 1e15 else f"{x:.2f}"


def _totals(sub, written):
    scores, written_max = (written[0], written[1]) if written else ({}, 0.0)
    done = sum(r.points for r in sub.results)
    maximum = sum(r.max_points for r in sub.results) + written_max
    extra = scores.get(sub.student, 0.0)
    total = done + extra
    return extra, total, maximum, (100.0 * total / maximum if maximum else 0.0)


def write(lesson: int, submissions: list, out: Path, people: dict | None = None, written=None) -> Path:
    """Write the gradebook, the LMS files, the JSON and the reports (the module docstring lists them); return the CSV."""
    people = people or {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = [r.id for r in submissions[0].results] if submissions else []
    name = f"lesson_{lesson:02d}"
    assignment = f"Lesson {lesson}"
    path = out / f"{name}.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "name", *ids, "written", "total", "maximum", "percent",
                    *(f"status {i}" for i in ids), "submission"])
        for sub in submissions:
            by_id = {r.id: r for r in sub.results}
            extra, total, maximum, percent = _totals(sub, written)
            w.writerow([student_id(sub.student, people), people.get(sub.student, {}).get("name", ""),
                        *(_number(by_id[i].points) for i in ids), _number(extra), _number(total), _number(maximum),
                        _number(percent), *(by_id[i].status for i in ids), sub.student])
    maximum = _totals(submissions[0], written)[2] if submissions else 0.0
    with open(out / f"{name}_canvas.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", assignment])
        w.writerow([POINTS_POSSIBLE, "", "", "", "", _number(maximum)])
        for sub in submissions:
            p = people.get(sub.student, {})
            w.writerow([p.get("name") or sub.student, p.get("id", ""), p.get("sis_user_id", ""),
                        p.get("sis_login_id", ""), p.get("section", ""), _number(_totals(sub, written)[1])])
    with open(out / f"{name}_moodle.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["ID number", "Email address", "Full name", assignment, f"{assignment} (%)"])
        for sub in submissions:
            p = people.get(sub.student, {})
            _, total, _, percent = _totals(sub, written)
            w.writerow([p.get("id") or p.get("sis_user_id") or sub.student, p.get("email", ""),
                        p.get("name") or sub.student, _number(total), _number(percent)])
    (out / f"{name}.json").write_text(json.dumps(
        [{**asdict(s), "identifier": student_id(s.student, people), "written": _totals(s, written)[0],
          "total": _totals(s, written)[1], "maximum": _totals(s, written)[2]} for s in submissions],
        indent=1), encoding="utf-8")
    for folder, instructor in (("reports", False), ("instructor", True)):
        (out / folder).mkdir(exist_ok=True)
        for sub in submissions:
            (out / folder / f"{sub.student}.md").write_text(report(lesson, sub, people, written, instructor),
                                                             encoding="utf-8")
    return path


def report(lesson: int, sub, people: dict, written, instructor: bool = False) -> str:
    """The feedback report of one submission, in Markdown: the student's, or with ``instructor`` every message in full."""
    import _course

    extra, total, maximum, percent = _totals(sub, written)
    titles = {ex.id: ex.title for ex in _course.load(lesson)}
    who = people.get(sub.student, {}).get("name") or sub.student
    lines = [f"# Lesson {lesson}: feedback for {who}", "",
             f"**Total: {_number(total)} of {_number(maximum)} points ({_number(percent)}%).**"]
    if written:
        lines.append(f"Written questions: {_number(extra)} of {_number(written[1])} points, graded by hand.")
    if sub.note:
        lines += ["", f"Note: {sub.note}"]
    lines += ["", "| exercise | result | points |", "| --- | --- | --- |"]
    for r in sub.results:
        lines.append(f"| {r.id} {titles.get(r.id, '')} | {r.status} | {_number(r.points)} of {_number(r.max_points)} |")
    for r in sub.results:
        text = r.message if instructor else (r.feedback or ("" if r.status in ("pass", "not done") else r.message))
        if r.status == "not done":
            text = "Not done yet: the answer is still the stub of the lesson."
        if not text and r.status == "pass":
            continue
        cases = f" ({r.passed} of {r.total} cases passed)" if r.total and r.status in ("pass", "partial", "fail") else ""
        lines += ["", f"## {r.id} {titles.get(r.id, '')}: {r.status}{cases}", "", "```text", text.strip(), "```"]
        if instructor:
            for case in r.details:
                if case["status"] != "pass" and case["message"] and case["message"] != r.message:
                    lines += ["", f"{case['label']} ({case['status']}):", "", "```text", case["message"].strip(), "```"]
    if instructor:
        lines += ["", f"Cells of the notebook that raised: {sub.cell_errors}."]
    return "\n".join(lines) + "\n"
