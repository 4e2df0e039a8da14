"""The autograder: execute submitted lesson notebooks, run the public checks and the hidden cases, write a gradebook.

For the instructor only: it reads the hidden cases of ``tutorials/solutions/hidden_NN.py``
(and, for the sample class, the worked solutions), which the student build leaves out.

Grading one lesson's submissions (:func:`grade`) follows nbgrader's ``autograde``:

1. a student build of the course (:func:`course_build.build`, no ``solutions/``) is made
   in the output folder; each submission's kernel gets its ``tutorials/`` on
   ``PYTHONPATH``, so ``import _course`` resolves wherever the notebook was saved,
   and the worked solutions are not importable from the student's code;
2. the notebook is executed top to bottom by ``nbclient`` (the library nbgrader's
   ``Execute`` preprocessor runs on) with ``allow_errors=True``, a per-cell
   ``timeout`` and ``interrupt_on_timeout=True``, in a fresh kernel of this
   Python, in a folder of its own, at small size (``TUTORIAL_SMALL=1``) unless
   asked for full size: a wrong answer's ``AssertionError`` no longer stops the
   notebook, every answer is graded;
3. one grading cell is appended and runs in the same kernel after the student's
   cells: it imports fresh copies of ``_course`` and ``_exercises_NN`` (a notebook
   that replaced ``check`` or ``_course.run`` changes nothing), finds each
   exercise's answer by the name its check cell passes (``check("4.1", name)``),
   and runs on it the public check, then the hidden cases: the public check again
   with its random generators seeded otherwise (:func:`reseeded`, the offsets of
   ``SEEDS``), and the extra cases of ``CASES`` (other sizes, edge cases), each
   with a time limit, through :func:`_course.run` (refused functions raise, kernel
   launches are counted);
4. the results go to ``lesson_NN.csv`` (one row per student, one column per
   exercise: ``pass``, ``fail``, ``not done``, ``missing``, ``timeout`` or
   ``error``; the number passed; the failure messages) and ``lesson_NN.json`` (every
   message in full).

It is not a sandbox: a submission runs with the grader's rights. Grade in an
account or container that holds nothing else of value.

Commands (``tutorials/course.py`` passes them on)::

    .venv/bin/python tutorials/course.py sample-class 4 /tmp/class     # four fake submissions of lesson 4
    .venv/bin/python tutorials/course.py grade 4 /tmp/class/*.ipynb --out /tmp/gradebook
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
import shutil
import signal
import sys
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOLUTIONS = HERE / "solutions"
CHECK_CALL = re.compile(r'^check\("(\d+)\.(\d+)",\s*([A-Za-z_]\w*)\)\s*$')
STATUSES = ("pass", "fail", "not done", "missing", "timeout", "error")
GRADING_TAG = "course-grader"  # the metadata tag of the grading cell that grade() appends
SEED_STRIDE = 7919  # seed s of a check becomes s + 7919 * offset in a reseeded run
DEFAULT_SEEDS = (1,)  # the reseeded runs of an exercise that hidden_NN.SEEDS does not list (or of a lesson without one)


# ---------------------------------------------------------------------------
# What a lesson's exercises are, read from its script
# ---------------------------------------------------------------------------


def lesson_script(lesson: int, tutorials: Path = HERE) -> Path:
    found = sorted(tutorials.glob(f"{lesson:02d}_*.py"))
    if not found:
        raise SystemExit(f"no lesson {lesson} in {tutorials}")
    return found[0]


def code_cells(script: Path) -> list[str]:
    import jupytext

    return [c.source for c in jupytext.read(script, fmt="py:percent").cells if c.cell_type == "code"]


def answer_names(lesson: int, tutorials: Path = HERE) -> dict[str, str]:
    """Exercise id -> the name of the answer its check cell passes, in the lesson's order."""
    names = {}
    for source in code_cells(lesson_script(lesson, tutorials)):
        m = CHECK_CALL.match(source.strip())
        if m:
            names[f"{m.group(1)}.{m.group(2)}"] = m.group(3)
    return names


# ---------------------------------------------------------------------------
# Hidden cases
# ---------------------------------------------------------------------------


class _SeededRandom:
    """``numpy.random`` whose ``default_rng(seed)`` draws from ``seed + SEED_STRIDE * offset``."""

    def __init__(self, offset: int):
        self._offset = offset

    def default_rng(self, seed=None):
        import numpy as np

        if isinstance(seed, (int, np.integer)):
            seed = int(seed) + SEED_STRIDE * self._offset
        return np.random.default_rng(seed)

    def __getattr__(self, name):
        import numpy as np

        return getattr(np.random, name)


class _SeededNumpy(types.ModuleType):
    """``numpy`` with :class:`_SeededRandom` as ``random``; everything else is numpy's."""

    def __init__(self, offset: int):
        super().__init__("numpy")
        self.random = _SeededRandom(offset)

    def __getattr__(self, name):
        import numpy as np

        return getattr(np, name)


def reseeded(check, offset: int):
    """The check function ``check`` with its ``np.random.default_rng(seed)`` calls seeded at ``seed + 7919 offset``.

    The check's own body draws other inputs; the module's other functions it calls
    keep their seeds.  Offset 0 is the public check itself.
    """
    if offset == 0:
        return check
    namespace = dict(check.__globals__)
    namespace["np"] = _SeededNumpy(offset)
    f = types.FunctionType(check.__code__, namespace, check.__name__, check.__defaults__, check.__closure__)
    f.__kwdefaults__ = check.__kwdefaults__
    f.__doc__ = check.__doc__
    return f


def load_hidden(lesson: int, solutions: Path = SOLUTIONS):
    """The module ``solutions/hidden_NN.py`` loaded from its file (not from ``sys.path``); None if there is none."""
    path = solutions / f"hidden_{lesson:02d}.py"
    if not path.exists():
        return None
    return load_file(f"_course_hidden_{lesson:02d}", path)


def load_file(name: str, path: Path) -> types.ModuleType:
    """Import the Python file ``path`` as the module ``name`` without putting its folder on ``sys.path``."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # before running it: dataclasses look their module up there
    exec(compile(Path(path).read_text(encoding="utf-8"), str(path), "exec"), module.__dict__)
    return module


def hidden_cases(ex, hidden) -> list[tuple[str, object]]:
    """(label, check) of every hidden case of exercise ``ex``: the reseeded public check, then the extra cases.

    ``hidden`` is the lesson's ``hidden_NN`` module, or None: then the public
    check is rerun at :data:`DEFAULT_SEEDS` only.
    """
    seeds = getattr(hidden, "SEEDS", {}).get(ex.id, DEFAULT_SEEDS)
    cases = [(f"hidden case: the public check with seeds + {SEED_STRIDE} x {k}", reseeded(ex.run, k)) for k in seeds]
    for case in getattr(hidden, "CASES", {}).get(ex.id, ()):
        doc = (case.__doc__ or case.__name__).strip().splitlines()[0]
        cases.append((f"hidden case: {doc}", case))
    return cases


# ---------------------------------------------------------------------------
# Grading the answers of one namespace (what the grading cell runs in the kernel)
# ---------------------------------------------------------------------------


@dataclass
class Result:
    """One exercise of one submission."""

    id: str
    status: str
    message: str = ""
    cases: int = 0  # how many checks ran: the public one and the hidden cases


class _Timeout(BaseException):
    pass


@contextmanager
def _time_limit(seconds: float):
    """Raise :class:`_Timeout` in this thread after ``seconds`` (SIGALRM; no limit off the main thread or on Windows)."""
    if seconds is None or not hasattr(signal, "setitimer") or not _on_main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def grade_exercise(course, ex, answer, hidden, time_limit: float | None = 60.0) -> Result:
    """Run the public check and the hidden cases of ``ex`` on ``answer``; the first failure decides.

    ``course`` is the ``_course`` module the checks were registered with.
    """
    checks = [("public check", None)] + hidden_cases(ex, hidden)
    for n, (label, check) in enumerate(checks, start=1):
        try:
            with _time_limit(time_limit):
                course.run(ex.id, answer, check)
        except course.NotAttempted:
            return Result(ex.id, "not done", "", n)
        except AssertionError as err:
            where = "" if check is None else f"{label}: "
            return Result(ex.id, "fail", f"{where}{err}", n)
        except _Timeout:
            return Result(ex.id, "timeout", f"{label}: ran past {time_limit:g} s", n)
        except Exception as err:  # the answer raised: a wrong answer, said as such
            return Result(ex.id, "fail", f"{label}: your answer raised {type(err).__name__}: {err}", n)
    return Result(ex.id, "pass", "", len(checks))


def grade_namespace(lesson: int, namespace: dict, names: dict[str, str], hidden=None, course=None,
                    time_limit: float | None = 60.0) -> list[Result]:
    """Grade the answers a notebook left in ``namespace`` (its globals); ``names``: id -> answer name."""
    if course is None:
        course = importlib.import_module("_course")
    exercises = {ex.id: ex for ex in course.load(lesson)}
    results = []
    for ex_id, name in names.items():
        if ex_id not in exercises:
            results.append(Result(ex_id, "error", f"exercise {ex_id} is not registered by _exercises_{lesson:02d}.py"))
        elif name not in namespace:
            results.append(Result(ex_id, "missing", f"the notebook defines no `{name}` (the answer to {ex_id})"))
        else:
            results.append(grade_exercise(course, exercises[ex_id], namespace[name], hidden, time_limit))
    return results


def grade_in_kernel(lesson: int, namespace: dict, names: dict[str, str], tutorials: str, hidden_dir: str,
                    result_path: str, time_limit: float) -> None:
    """The grading cell's body: fresh check modules from ``tutorials``, the hidden cases, results as JSON."""
    for key in [k for k in sys.modules if k == "_course" or k.startswith("_exercises_")]:
        del sys.modules[key]  # the submission may have changed them: the checks come fresh from the files
    if tutorials not in sys.path:
        sys.path.insert(0, tutorials)
    course = importlib.import_module("_course")
    hidden = load_hidden(lesson, Path(hidden_dir))
    results = grade_namespace(lesson, namespace, names, hidden, course, time_limit)
    Path(result_path).write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")


# ---------------------------------------------------------------------------
# Executing the submissions
# ---------------------------------------------------------------------------


@dataclass
class Submission:
    student: str
    notebook: str
    results: list[Result] = field(default_factory=list)
    cell_errors: int = 0  # cells of the notebook that raised (a wrong answer's check cell among them)
    note: str = ""


def student_name(path: Path, lesson_stem: str) -> str:
    """The notebook's name, or its folder's where the notebook keeps the lesson's own name (``alice/04_....ipynb``)."""
    return path.parent.name if path.stem == lesson_stem else path.stem


@contextmanager
def _environment(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _grading_cell(lesson: int, names: dict[str, str], tutorials: Path, result_path: Path, time_limit: float):
    import nbformat

    source = "\n".join([
        "# appended by the grader: the public checks and the hidden cases on this notebook's answers",
        "import sys as _grader_sys, types as _grader_types",
        "_grader = _grader_types.ModuleType('_course_grader')",
        f"_grader.__file__ = {str(HERE / 'course_grader.py')!r}",
        "_grader_sys.modules['_course_grader'] = _grader  # dataclasses look their module up there",
        "exec(compile(open(_grader.__file__, encoding='utf-8').read(), _grader.__file__, 'exec'), _grader.__dict__)",
        f"_grader.grade_in_kernel({lesson}, globals(), {names!r}, {str(tutorials)!r}, {str(SOLUTIONS)!r}, "
        f"{str(result_path)!r}, {time_limit!r})",
    ])
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = [GRADING_TAG]
    return cell


def execute_submission(notebook: Path, lesson: int, names: dict[str, str], tutorials: Path, workdir: Path,
                       cell_timeout: float, time_limit: float, small: bool) -> Submission:
    """Execute one submitted notebook with errors allowed, then grade its answers in the same kernel."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    import course_build

    lesson_stem = lesson_script(lesson).stem
    sub = Submission(student_name(notebook, lesson_stem), str(notebook))
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / "results.json"
    result_path.unlink(missing_ok=True)
    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as err:  # not a notebook
        sub.note = f"could not read the notebook: {type(err).__name__}: {err}"
        sub.results = [Result(i, "error", sub.note) for i in names]
        return sub
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.append(_grading_cell(lesson, names, tutorials, result_path, time_limit))
    n_exercises = max(1, len(names))

    def timeout_func(cell):
        # the grading cell runs every check and its hidden cases: each exercise gets time_limit per case, ~4 cases
        return int(4 * n_exercises * time_limit + 60) if GRADING_TAG in cell.metadata.get("tags", []) else int(cell_timeout)

    path = os.pathsep.join(filter(None, [str(tutorials), os.environ.get("PYTHONPATH")]))
    with _environment(PYTHONPATH=path, TUTORIAL_SMALL="1" if small else "0", MPLBACKEND="Agg"):
        client = NotebookClient(nb, kernel_name="python3", kernel_manager_class=course_build.this_interpreter_kernel(),
                                timeout_func=timeout_func, allow_errors=True, interrupt_on_timeout=True,
                                startup_timeout=120, resources={"metadata": {"path": str(workdir)}})
        try:
            client.execute()
        except (DeadKernelError, CellTimeoutError, RuntimeError) as err:
            sub.note = f"the notebook did not finish: {type(err).__name__}: {str(err).strip().splitlines()[0]}"
    nbformat.write(nb, workdir / "executed.ipynb")
    sub.cell_errors = sum(1 for c in nb.cells[:-1] if c.cell_type == "code"
                          and any(o.get("output_type") == "error" for o in c.get("outputs", [])))
    if result_path.exists():
        sub.results = [Result(**r) for r in json.loads(result_path.read_text(encoding="utf-8"))]
    else:
        errors = [o for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "error"]
        why = sub.note or (f"the grading cell failed: {errors[0].get('ename')}: {errors[0].get('evalue')}" if errors
                           else "the grading cell wrote no results")
        sub.note = why
        sub.results = [Result(i, "error", why) for i in names]
    return sub


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_gradebook(lesson: int, submissions: list[Submission], out: Path) -> Path:
    """``lesson_NN.csv`` (one row per student) and ``lesson_NN.json`` (the same, messages in full), in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    ids = list(answer_names(lesson))
    csv_path = out / f"lesson_{lesson:02d}.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *ids, "passed", "messages"])
        for sub in submissions:
            by_id = {r.id: r for r in sub.results}
            row = [by_id[i].status if i in by_id else "missing" for i in ids]
            messages = [f"{i}: {_one_line(by_id[i].message)}" for i in ids if i in by_id and by_id[i].message]
            if sub.note:
                messages.insert(0, _one_line(sub.note))
            w.writerow([sub.student, *row, f"{row.count('pass')}/{len(ids)}", " | ".join(messages)])
    (out / f"lesson_{lesson:02d}.json").write_text(
        json.dumps([asdict(s) for s in submissions], indent=1), encoding="utf-8")
    return csv_path


def grade(lesson: int, notebooks: list[Path], out: Path, cell_timeout: float = 300, time_limit: float = 60,
          small: bool = True) -> Path:
    """Grade the submitted notebooks of lesson ``lesson`` into ``out/lesson_NN.csv``; return its path."""
    import course_build

    out = Path(out).resolve()
    build_dir = out / "course"
    if build_dir.exists():
        shutil.rmtree(build_dir)
    course_build.build(build_dir, student=True)
    tutorials = build_dir / "tutorials"
    names = answer_names(lesson)
    submissions = []
    for i, nb in enumerate(sorted(Path(p).resolve() for p in notebooks)):
        sub = execute_submission(nb, lesson, names, tutorials, out / "work" / f"{i:03d}-{nb.stem}", cell_timeout,
                                 time_limit, small)
        submissions.append(sub)
        print(f"{sub.student}: " + ", ".join(f"{r.id} {r.status}" for r in sub.results), flush=True)
    path = write_gradebook(lesson, submissions, out)
    print(f"gradebook: {path}")
    return path


# ---------------------------------------------------------------------------
# A sample class: four fake submissions made from the lesson and the solutions
# ---------------------------------------------------------------------------

SAMPLE_STUDENTS = ("right", "stub", "near_miss", "oracle")

_SAMPLE_ANSWERS = '''"""Answers for the sample class: the worked solutions, their first near misses, the oracle-calling answers."""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the copy of solutions/ beside this file


def _module(ex_id):
    return importlib.import_module(f"solutions.lesson_{int(ex_id.split('.')[0]):02d}")


def first_near_miss(listed):
    """The first near miss of an exercise: NEAR_MISSES maps a label to each (or lists them)."""
    return next(iter(listed.values())) if isinstance(listed, dict) else listed[0]


def solution(ex_id):
    return _module(ex_id).SOLUTIONS[ex_id]


def near_miss(ex_id):
    return first_near_miss(_module(ex_id).NEAR_MISSES[ex_id])
'''


def first_near_miss(listed):
    """The first near miss of an exercise: ``NEAR_MISSES`` maps a label saying which mistake to each (or lists them)."""
    return next(iter(listed.values())) if isinstance(listed, dict) else listed[0]


def sample_answer_cell(kind: str, ex_id: str, name: str, hidden) -> str | None:
    """The source of the answer cell of student ``kind`` for exercise ``ex_id``; None keeps the stub."""
    if kind == "right":
        return f"from sample_answers import solution\n\n{name} = solution({ex_id!r})  # the worked solution\n"
    if kind == "near_miss":
        return f"from sample_answers import near_miss\n\n{name} = near_miss({ex_id!r})  # its first near miss\n"
    if kind == "oracle":
        source = getattr(hidden, "ORACLE_CALLS", {}).get(ex_id)
        return source  # None: no function of refimpl answers it; the stub stays
    return None  # "stub": the lesson as handed out


def exercises_only(nb):
    """The notebook cut to its first code cell (the imports) and its ``## Exercises`` section: a quick submission."""
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    start = next((i for i, c in enumerate(nb.cells)
                  if c.cell_type == "markdown" and re.search(r"^## Exercises\s*$", c.source, re.M)), None)
    if start is None:
        raise ValueError("the lesson has no '## Exercises' section")
    nb.cells = [nb.cells[first]] + nb.cells[start:]
    return nb


def make_sample_class(lesson: int, out: Path, quick: bool = False) -> list[Path]:
    """Write the four fake submissions of lesson ``lesson`` into ``out``: ``right``, ``stub``, ``near_miss``, ``oracle``.

    Each is the lesson's notebook with its answer cells replaced: the worked
    solution, the stub left as it is, the first near miss of ``NEAR_MISSES``,
    and the oracle-calling answer of ``hidden_NN.ORACLE_CALLS`` (the stub where
    none exists).  The solutions come from a copy of ``solutions/`` in ``out``,
    which the first two import through ``sample_answers.py``.  ``quick``: only
    the imports and the exercises (:func:`exercises_only`), seconds to execute.
    """
    import nbformat

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "solutions").exists():
        shutil.rmtree(out / "solutions")
    shutil.copytree(SOLUTIONS, out / "solutions", ignore=shutil.ignore_patterns("__pycache__", "hidden_*", "keys"))
    (out / "sample_answers.py").write_text(_SAMPLE_ANSWERS, encoding="utf-8")
    hidden = load_hidden(lesson)
    script = lesson_script(lesson)
    nb = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    if quick:
        nb = exercises_only(nb)
    check_at = {}
    for i, cell in enumerate(nb.cells):
        m = CHECK_CALL.match(cell.source.strip()) if cell.cell_type == "code" else None
        if m:
            check_at[i] = (f"{m.group(1)}.{m.group(2)}", m.group(3))
    paths = []
    for kind in SAMPLE_STUDENTS:
        copy = nbformat.from_dict(json.loads(json.dumps(nb)))
        prelude = nbformat.v4.new_code_cell(f"import sys\nsys.path.insert(0, {str(out)!r})  # the sample answers")
        for i, (ex_id, name) in check_at.items():
            source = sample_answer_cell(kind, ex_id, name, hidden)
            if source is not None:
                copy.cells[i - 1].source = source
        copy.cells.insert(0, prelude)
        path = out / f"{kind}.ipynb"
        nbformat.write(copy, path)
        paths.append(path)
    return paths


def expected_status(kind: str, ex_id: str, hidden) -> str:
    """What the gradebook must say for sample student ``kind`` on ``ex_id``."""
    if kind == "right":
        return "pass"
    if kind == "near_miss":
        return "fail"
    if kind == "oracle":
        return "fail" if ex_id in getattr(hidden, "ORACLE_CALLS", {}) else "not done"
    return "not done"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="grade submitted notebooks of one lesson into a gradebook")
    g.add_argument("lesson", type=int)
    g.add_argument("notebooks", nargs="+", type=Path)
    g.add_argument("--out", type=Path, default=Path("gradebook"), help="the gradebook's folder (default ./gradebook)")
    g.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell of a notebook (default 300)")
    g.add_argument("--time-limit", type=float, default=60, help="seconds per check of an answer (default 60)")
    g.add_argument("--full", action="store_true", help="execute at full size (default: TUTORIAL_SMALL=1)")
    s = sub.add_parser("sample-class", help="write four fake submissions of a lesson (right, stub, near miss, oracle)")
    s.add_argument("lesson", type=int)
    s.add_argument("out", type=Path)
    s.add_argument("--quick", action="store_true", help="only the imports and the exercises of the lesson")
    args = parser.parse_args(argv)
    if args.command == "grade":
        grade(args.lesson, args.notebooks, args.out, args.cell_timeout, args.time_limit, not args.full)
    else:
        for p in make_sample_class(args.lesson, args.out, args.quick):
            print(p)
    return 0


if __name__ == "__main__":
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    sys.exit(main())
