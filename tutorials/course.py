"""The course around the lessons: their dependency graph, objectives, measured run times, and its builds.

One source for what the course page of the documentation and the course
section of ``tutorials/README.md`` say about the lessons:

* ``NEEDS``, below: which earlier lessons each lesson builds on (the lesson's
  own "Before this lesson" paragraph names the same ones; the tests check it);
* each lesson's "You will learn to" list, read from its script;
* ``run_times.json``, in this folder: the seconds each lesson took to execute,
  at small size (``TUTORIAL_SMALL=1``) and at full size, written by
  ``python tutorials/course.py measure``.

Commands, from the repository root::

    .venv/bin/python tutorials/course.py measure [--small-only] [LESSON ...]   # time the lessons
    .venv/bin/python tutorials/course.py readme                               # rewrite README's course section
    .venv/bin/python tutorials/course.py build-student OUT [--force]          # a copy to hand out, no answers
    .venv/bin/python tutorials/course.py build-instructor OUT [--force]       # the same with solutions/
    .venv/bin/python tutorials/course.py grade LESSON NOTEBOOK ... --out DIR  # the autograder (course_grader.py)
    .venv/bin/python tutorials/course.py sample-class LESSON OUT              # four fake submissions to grade

The documentation build draws the dependency graph (:func:`draw_graph`) and
writes the tables of ``docs/course.md`` from the same functions.

The imports go one way: this module imports ``course_build.py`` (:func:`build`,
:func:`execute`, shared with the grader) and passes ``grade`` and
``sample-class`` on to ``course_grader.py``, which imports ``course_build.py``
and nothing of this module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path

# the copies of the course and the kernel that executes a lesson: shared with the grader (course_grader.py)
from course_build import (  # noqa: F401
    ANSWERS, CITED, COURSE_FILES, COURSE_PACKAGES, FP_MARKER, NEVER_COPIED, build, cited_pages, execute, fp_fragments,
    links, this_interpreter_kernel,
)

HERE = Path(__file__).resolve().parent
RUN_TIMES = HERE / "run_times.json"
README = HERE / "README.md"
README_BEGIN = "<!-- course section: written by `python tutorials/course.py readme`; edit course.py, not this -->"
README_END = "<!-- end of the course section -->"

# lesson -> the earlier lessons it builds on (an edge a -> b: read a before b)
NEEDS: dict[int, tuple[int, ...]] = {
    1: (),
    2: (1,),
    3: (2,),
    4: (2, 3),
    5: (1, 4),
    6: (1,),
    7: (1,),
    8: (6, 7),
    9: (1, 2, 3, 4),
    10: (2, 4),
}


def lessons() -> dict[int, Path]:
    """Lesson number -> its script ``tutorials/NN_name.py``."""
    return {int(p.name[:2]): p for p in sorted(HERE.glob("[0-9][0-9]_*.py"))}


def markdown_lines(script: Path) -> list[str]:
    """The script's markdown lines with the leading ``# `` removed (code lines dropped)."""
    out, in_markdown = [], False
    for line in script.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
            continue
        if in_markdown:
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    return out


def title(script: Path) -> str:
    """The lesson's level-1 title without its "Lesson N: " prefix."""
    for line in markdown_lines(script):
        if line.startswith("# "):
            return re.sub(r"^Lesson \d+:\s*", "", line[2:].strip())
    raise ValueError(f"{script.name} has no level-1 title")


def _block(script: Path, marker: str) -> list[str]:
    """The lines of the paragraph or list that follows ``**marker**`` in the lesson's markdown."""
    lines = markdown_lines(script)
    for i, line in enumerate(lines):
        if line.strip().startswith(f"**{marker}"):
            rest = line.strip()[len(f"**{marker}"):].lstrip("*:").strip()
            block = [rest] if rest else []
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    if block:
                        break
                    continue
                block.append(nxt.rstrip())
            return block
    return []


def objectives(script: Path) -> list[str]:
    """The bullets of the lesson's "You will learn to" list."""
    items: list[str] = []
    for line in _block(script, "You will learn to"):
        if re.match(r"^\s*[-*]\s+", line):
            items.append(re.sub(r"^\s*[-*]\s+", "", line).strip())
        elif items:
            items[-1] += " " + line.strip()
    return items


def before(script: Path) -> str:
    """The lesson's "Before this lesson" paragraph, as one line."""
    return " ".join(s.strip() for s in _block(script, "Before this lesson"))


def lessons_named_before(script: Path) -> set[int]:
    """The lesson numbers the "Before this lesson" paragraph names ("lessons 1 and 2", "lesson 4")."""
    return lessons_named_before_text(before(script))


def lessons_named_before_text(text: str) -> set[int]:
    """The lesson numbers a text names: "lessons 1 and 2", "lesson 4", "lessons 1, 3 or 5"."""
    found: set[int] = set()
    for m in re.finditer(r"[Ll]essons?\s+((?:\d+(?:\s*(?:,|and|or|-|–)\s*)?)+)", text):
        found |= {int(n) for n in re.findall(r"\d+", m.group(1))}
    return found


def run_times() -> dict:
    """The measured run times: ``{"lessons": {"1": {"small_s": ..., "full_s": ...}}, "machine": ..., "date": ...}``."""
    if not RUN_TIMES.exists():
        return {"lessons": {}}
    return json.loads(RUN_TIMES.read_text(encoding="utf-8"))


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "not measured"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def run_time_line(lesson: int) -> str:
    """"12 s at small size, 2.1 min at full size", from ``run_times.json``."""
    entry = run_times()["lessons"].get(str(lesson), {})
    return (f"{format_seconds(entry.get('small_s'))} at small size (`TUTORIAL_SMALL=1`), "
            f"{format_seconds(entry.get('full_s'))} at full size")


def table() -> str:
    """The Markdown table of the lessons: title, what comes before, run times."""
    times = run_times()["lessons"]
    rows = ["| lesson | builds on | run time: small / full size |", "| --- | --- | --- |"]
    for n, script in lessons().items():
        needs = ", ".join(str(m) for m in NEEDS.get(n, ())) or "none"
        entry = times.get(str(n), {})
        rows.append(f"| {n}. {title(script)} (`{script.stem}`) | {needs} | "
                    f"{format_seconds(entry.get('small_s'))} / {format_seconds(entry.get('full_s'))} |")
    return "\n".join(rows)


def objectives_markdown(heading: str = "####") -> str:
    """Each lesson's objectives as a heading and a list, in course order."""
    parts = []
    for n, script in lessons().items():
        items = [re.sub(r"[;.,]\s*$", "", item) for item in objectives(script)]
        parts += [f"{heading} Lesson {n}: {title(script)}", "", "You will learn to:", ""]
        parts += [f"- {item}" for item in items] + [""]
    return "\n".join(parts).rstrip() + "\n"


def measured_on() -> str:
    """One line saying where and when ``run_times.json`` was measured."""
    t = run_times()
    if not t.get("lessons"):
        return "Run times have not been measured yet (`python tutorials/course.py measure`)."
    return (f"Run times measured on {t.get('date', '?')} on {t.get('machine', '?')} "
            f"by `python tutorials/course.py measure` (one run each; the machine was shared, so read them as "
            f"the order of magnitude).")


def mermaid() -> str:
    """The reading order as a Mermaid flowchart (GitHub draws it in the README), edges of :func:`reduced_needs`."""
    lines = ["```mermaid", "flowchart LR"]
    for n, script in lessons().items():
        lines.append(f'  L{n}["{n}. {script.stem[3:].replace("_", " ")}"]')
    for n, needs in reduced_needs().items():
        lines += [f"  L{m} --> L{n}" for m in needs]
    lines.append("```")
    return "\n".join(lines)


def reduced_needs() -> dict[int, tuple[int, ...]]:
    """``NEEDS`` without the orders another lesson implies (2 -> 4 when 2 -> 3 -> 4): the edges the picture draws."""
    return reduced_needs_of(NEEDS)


def reduced_needs_of(needs_of: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """The transitive reduction of a graph given as lesson -> the lessons it needs."""
    def reachable(start: int) -> set[int]:
        seen, todo = set(), list(needs_of[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(needs_of[m])
        return seen

    return {n: tuple(m for m in needs if not any(m in reachable(k) for k in needs if k != m))
            for n, needs in needs_of.items()}


def draw_graph(path: Path) -> Path:
    """Draw the reading order of the lessons into ``path`` (SVG or PNG): an arrow from a lesson to one that needs it.

    Orders implied through another lesson are left out (:func:`reduced_needs`).
    Lessons sit in columns by depth, ordered in each column by the mean height
    of the lessons they need.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = reduced_needs()
    depth: dict[int, int] = {}
    for n in sorted(NEEDS):
        depth[n] = 1 + max((depth[m] for m in NEEDS[n]), default=-1)
    pos: dict[int, tuple[float, float]] = {}
    for d in range(max(depth.values()) + 1):
        column = [n for n in sorted(depth) if depth[n] == d]
        mean_parent = {n: sum(pos[m][1] for m in edges[n]) / len(edges[n]) if edges[n] else 0.0 for n in column}
        column.sort(key=lambda n: (-mean_parent[n], n))
        for i, n in enumerate(column):
            pos[n] = (d, (len(column) - 1) / 2 - i + 0.5 * (sum(mean_parent.values()) / len(column)))
    names = {n: script.stem[3:].replace("_", " ") for n, script in lessons().items()}
    height = max(y for _, y in pos.values()) - min(y for _, y in pos.values())
    fig, ax = plt.subplots(figsize=(2.4 * (max(depth.values()) + 1), 1.2 * height + 1.6))
    boxes = {n: ax.text(x, y, f"{n}\n{names.get(n, '')}", ha="center", va="center", fontsize=9,
                        bbox=dict(boxstyle="round,pad=0.45", fc="#e8f0fb", ec="#3465a4"))
             for n, (x, y) in pos.items()}
    fig.canvas.draw()  # the boxes get their sizes, so that the arrows end at their edges
    for n, needs in edges.items():
        for m in needs:
            ax.annotate("", xy=pos[n], xytext=pos[m],
                        arrowprops=dict(arrowstyle="-|>", color="0.4", lw=1.3, shrinkA=0, shrinkB=0,
                                        patchA=boxes[m].get_bbox_patch(), patchB=boxes[n].get_bbox_patch()))
    ax.set_xlim(-0.6, max(depth.values()) + 0.6)
    ax.set_ylim(min(y for _, y in pos.values()) - 0.7, max(y for _, y in pos.values()) + 0.7)
    ax.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path


def readme_section() -> str:
    """The generated course section of ``tutorials/README.md``."""
    return "\n".join([
        README_BEGIN,
        "",
        "### The lessons",
        "",
        table(),
        "",
        measured_on(),
        "",
        "### What each lesson teaches",
        "",
        objectives_markdown("####"),
        "### Which lesson needs which",
        "",
        "An arrow from a lesson to another: read the first before the second. Orders that follow through "
        "another lesson are not drawn (2 before 4, since 2 comes before 3 and 3 before 4); the table lists "
        "every lesson each one builds on.",
        "",
        mermaid(),
        "",
        README_END,
    ])


def write_readme() -> bool:
    """Rewrite the course section of ``tutorials/README.md``; True if it changed."""
    text = README.read_text(encoding="utf-8")
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{README} has no course section (the markers {README_BEGIN!r} ... {README_END!r})")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    new = head + readme_section() + tail
    if new != text:
        README.write_text(new, encoding="utf-8")
    return new != text


def _time_lesson(notebook: Path, small: bool, timeout: float) -> float:
    """Execute ``notebook`` at small or full size; return the seconds it took."""
    import nbformat

    os.environ["TUTORIAL_SMALL"] = "1" if small else "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    os.environ.pop("MPLBACKEND", None)
    nb = nbformat.read(notebook, as_version=4)
    start = time.monotonic()
    execute(nb, timeout_func=lambda cell: int(timeout))
    return time.monotonic() - start


def measure(selected: list[int], small_only: bool, timeout: float) -> None:
    times = run_times()
    entries = times.setdefault("lessons", {})
    for n, script in lessons().items():
        if selected and n not in selected:
            continue
        notebook = script.with_suffix(".ipynb")
        entry = entries.setdefault(str(n), {})
        entry["small_s"] = round(_time_lesson(notebook, True, timeout), 1)
        if not small_only:
            entry["full_s"] = round(_time_lesson(notebook, False, timeout), 1)
        print(f"lesson {n}: {entry}", flush=True)
    times["date"] = date.today().isoformat()
    times["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, no GPU"
    RUN_TIMES.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="execute the lessons and record their run times in run_times.json")
    m.add_argument("lessons", nargs="*", type=int, help="lesson numbers (default: all)")
    m.add_argument("--small-only", action="store_true", help="time only the small size")
    m.add_argument("--timeout", type=float, default=1800, help="seconds per cell (default 1800)")
    sub.add_parser("readme", help="rewrite the course section of tutorials/README.md")
    for name, what in (("build-student", "a copy of the course to hand out: no solutions, keys or hidden cases"),
                       ("build-instructor", "a copy of the course with the solutions, keys and hidden cases")):
        b = sub.add_parser(name, help=what)
        b.add_argument("out", type=Path, help="a new folder")
        b.add_argument("--force", action="store_true", help="replace a build made in OUT before")
    for name, what in (("grade", "grade submitted notebooks of one lesson into a gradebook (course_grader.py)"),
                       ("sample-class", "four fake submissions of a lesson: right, stub, near miss, oracle")):
        sub.add_parser(name, help=what, add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("grade", "sample-class"):
        import course_grader

        return course_grader.main(argv)
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.lessons, args.small_only, args.timeout)
        write_readme()
    elif args.command in ("build-student", "build-instructor"):
        print(build(args.out, student=args.command == "build-student", force=args.force))
    else:
        print("README.md " + ("rewritten" if write_readme() else "already up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
