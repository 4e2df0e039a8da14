"""The course's builds and its autograder (tutorials/course.py, tutorials/course_grader.py, tutorials/_course.py).

1. The student build holds no answers (no ``solutions/``: worked solutions, near
   misses, hidden cases, answer keys) and its checks work there: a stub is "not
   done yet", a right answer "correct".
2. Checks refuse an answer that calls the function they compare with (or its
   core), however it is reached, and a kernel exercise refuses an answer that
   launched no kernel of its own; the refused functions are themselves again
   afterwards.
3. The hidden cases: every worked solution passes them, and they catch an answer
   that the public check lets through.
4. A sample class of four fake submissions (all right, all stubs, one near miss
   per exercise, one that calls the oracle), made from the lessons and the
   solutions, gets the gradebook it should, cell by cell: graded directly for
   every lesson, and through executed notebooks saved outside ``tutorials/``
   for lessons 4 (the whole lesson) and 1 (imports and exercises only, with a
   fifth notebook that replaces the checks after answering).
"""

from __future__ import annotations

import csv
import functools
import importlib
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))

import _course  # noqa: E402  (tutorials/)
import course  # noqa: E402
import course_grader as grader  # noqa: E402

LESSONS = sorted(course.lessons())


def _stub_cells(lesson):
    cells = grader.code_cells(grader.lesson_script(lesson))
    stubs = {}
    for i, source in enumerate(cells):
        m = grader.CHECK_CALL.match(source.strip())
        if m:
            stubs[f"{m.group(1)}.{m.group(2)}"] = cells[i - 1]
    return cells[0], stubs


@functools.cache
def _imported(lesson):
    imports, _ = _stub_cells(lesson)
    namespace: dict = {"__name__": "__lesson__"}
    exec(compile(imports, f"lesson {lesson}: imports", "exec"), namespace)
    return namespace


def _namespace(lesson):
    """The globals of a lesson after its first code cell (its imports), as a notebook has them: a fresh copy."""
    return dict(_imported(lesson))


def _define(namespace, source, what):
    exec(compile(source, what, "exec"), namespace)
    return namespace


def _solutions(lesson):
    return importlib.import_module(f"solutions.lesson_{lesson:02d}")


def _oracle_calls():
    cases = []
    for lesson in LESSONS:
        hidden = grader.load_hidden(lesson)
        for ex_id in getattr(hidden, "ORACLE_CALLS", {}):
            cases.append(pytest.param(lesson, ex_id, id=ex_id))
    return cases


# ---------------------------------------------------------------------------
# 1. the student build
# ---------------------------------------------------------------------------


def test_the_student_build_has_no_answers_and_its_checks_work(tmp_path):
    out = course.build(tmp_path / "student", student=True)
    files = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert not (out / "tutorials" / "solutions").exists()
    leaked = [f for f in files if "solutions/" in f or "hidden_" in f or "/keys/" in f]
    assert not leaked, f"the student build holds answers: {leaked}"
    assert {"tutorials/_course.py", "tutorials/_exercises_04.py", "tutorials/04_gma_gradients.ipynb",
            "refimpl/gma.py", "app/model.py", "pyproject.toml", "Makefile", "constraints/cuda13.txt"} <= set(files)
    # the instructor build keeps them
    instructor = course.build(tmp_path / "instructor", student=False)
    assert (instructor / "tutorials" / "solutions" / "hidden_04.py").exists()

    # lesson 4's imports, the stub of 4.1 and its check cell, then a right answer and the check cell again,
    # run in the build's tutorials/ by a fresh Python that sees nothing of the checkout's tutorials/
    imports, stubs = _stub_cells(4)
    right = inspect.getsource(_solutions(4).guard_gradient)
    script = "\n".join([
        imports, "from _course import check", stubs["4.1"], 'assert check("4.1", guard_gradient) is False',
        right, 'assert check("4.1", guard_gradient) is True',
        "try:\n    import solutions\nexcept ModuleNotFoundError:\n    print('no solutions here')",
    ])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLBACKEND": "Agg", "TUTORIAL_SMALL": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=out / "tutorials", env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Exercise 4.1 (The gradient of the guard): not done yet" in run.stdout
    assert "Exercise 4.1 (The gradient of the guard): correct." in run.stdout
    assert "no solutions here" in run.stdout


def test_a_build_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit, match="not empty"):
        course.build(tmp_path)


# ---------------------------------------------------------------------------
# 2. refusals
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_refused_name_exists(lesson):
    for ex in _course.load(lesson):
        for name in ex.refuse:
            found = _course._resolve(name)
            assert found is not None and callable(getattr(*found)), f"exercise {ex.id} refuses {name!r}: no such function"


@pytest.mark.parametrize(("lesson", "ex_id"), _oracle_calls())
def test_an_answer_that_calls_the_oracle_is_refused(lesson, ex_id):
    hidden = grader.load_hidden(lesson)
    ex = _course.get(ex_id)
    name = grader.answer_names(lesson)[ex_id]
    namespace = _define(_namespace(lesson), hidden.ORACLE_CALLS[ex_id], f"oracle call {ex_id}")
    with pytest.raises(_course.Refused) as info:
        _course.run(ex_id, namespace[name])
    message = str(info.value)
    if ex.kernel and "refuses" not in message:
        assert "launched no kernel of its own" in message, message
    else:
        assert "which this exercise refuses" in message and ", ".join(ex.refuse) in message, message
    # and the check cell shows it as a wrong answer, not as a stub
    with pytest.raises(_course.Refused):
        _course.check(ex_id, namespace[name])


LSE_CHEATS = {
    "imported under another name": "from scipy.special import logsumexp as lse\n"
                                   "def logsumexp_rows(a):\n    return lse(a, axis=1)\n",
    "imported inside the function": "def logsumexp_rows(a):\n    import refimpl.numerics\n"
                                    "    return refimpl.numerics.logsumexp(a, axis=1)\n",
    "the refusal caught": "def logsumexp_rows(a):\n    try:\n        return special.logsumexp(a, axis=1)\n"
                          "    except Exception:\n        return a.max(axis=1)\n",
    "through a function of another cell": "def _rows(a):\n    return gmm.logsumexp(a, axis=1)\n"
                                          "def logsumexp_rows(a):\n    return _rows(a)\n",
}


@pytest.mark.parametrize("how", LSE_CHEATS)
def test_the_oracle_is_refused_however_it_is_reached(how):
    namespace = _define(_namespace(1), LSE_CHEATS[how], how)
    with pytest.raises(_course.Refused, match="which this exercise refuses"):
        _course.run("1.1", namespace["logsumexp_rows"])


def test_the_refused_functions_are_restored():
    import scipy.special

    from refimpl import gmm

    original = scipy.special.logsumexp, gmm.logsumexp
    namespace = _define(_namespace(1), LSE_CHEATS["imported under another name"], "cheat")
    with pytest.raises(_course.Refused):
        _course.run("1.1", namespace["logsumexp_rows"])
    assert (scipy.special.logsumexp, gmm.logsumexp) == original and namespace["lse"] is original[0]
    _course.run("1.1", _solutions(1).SOLUTIONS["1.1"])  # the check's own call of SciPy works


def test_the_search_for_refused_functions_runs_once_per_check_unless_a_module_is_imported(monkeypatch):
    import types

    from refimpl import ovq

    scans = []
    search = _course._bindings
    monkeypatch.setattr(_course, "_bindings", lambda *a: scans.append(1) or search(*a))
    ex = _course.get("8.1")
    late = "refimpl._late_import_for_test"
    monkeypatch.delitem(sys.modules, late, raising=False)

    def answer(t, n_max):
        module = sys.modules.get(late)
        if module is not None:  # an import between two calls binds the oracle under another name
            return module.size(t, n_max)
        return max(1, t * n_max // (t + n_max)) if t else 0

    call = _course.guarded(ex, answer)
    for t in range(200):
        call(t, 7)
    assert len(scans) == 1  # one search for 200 calls
    monkeypatch.setitem(sys.modules, late, types.SimpleNamespace(size=ovq.dictionary_size))
    with pytest.raises(_course.Refused, match="which this exercise refuses"):
        call(5, 7)  # the new module is searched too
    assert len(scans) == 2 and sys.modules[late].size is ovq.dictionary_size  # and restored


NUMPY_KERNEL_ANSWERS = {
    "9.2": "def row_softmax(a):\n    e = np.exp(a - a.max(axis=1, keepdims=True))\n"
           "    return e / e.sum(axis=1, keepdims=True)\n",
    "9.3": "def chunk_states(gamma_k, v, C):\n    v1 = np.hstack([v, np.ones((len(v), 1))])\n"
           "    return np.stack([gamma_k[: c * C].T @ v1[: c * C] for c in range(-(-len(v) // C))])\n",
    "9.4": "def online_attention(q, k, v, causal):\n    s = q @ k.T / np.sqrt(q.shape[1])\n"
           "    if causal:\n        s = np.where(np.tri(len(q), len(k), dtype=bool), s, -np.inf)\n"
           "    p = np.exp(s - s.max(axis=1, keepdims=True))\n    return (p / p.sum(axis=1, keepdims=True)) @ v\n",
}


# answers that launch the project's own kernels (gpu.numba_cuda, which lesson 9 imports as nc) and none of their own:
# a launch counts only when its kernel is defined outside refimpl, cpu and gpu
PROJECT_KERNEL_ANSWERS = {
    "9.3": "def chunk_states(gamma_k, v, C):\n    # the project's kernel builds [v, 1] on the device; NumPy does the rest\n"
           "    N, E = v.shape[0], v.shape[1] + 1\n    v1 = cuda.device_array((1, N, E))\n"
           "    nc.scan._ones_column[(-(-N * E // nc.scan.THREADS), 1, 1), (nc.scan.THREADS,)](cuda.to_device(v[None].copy()), v1)\n"
           "    v1 = v1.copy_to_host()[0]\n"
           "    return np.stack([gamma_k[: c * C].T @ v1[: c * C] for c in range(-(-N // C))])\n",
    "9.4": "def online_attention(q, k, v, causal):\n    return nc.attention.softmax_attention(q, k, v, causal=causal)\n",
}


KERNEL_ANSWERS = [pytest.param(ex_id, source, id=f"numpy-{ex_id}") for ex_id, source in sorted(NUMPY_KERNEL_ANSWERS.items())]
KERNEL_ANSWERS += [pytest.param(ex_id, source, id=f"project-{ex_id}") for ex_id, source in sorted(PROJECT_KERNEL_ANSWERS.items())]


@pytest.mark.parametrize("ex_id, source", KERNEL_ANSWERS)
def test_an_answer_that_launches_no_kernel_of_its_own_is_refused(ex_id, source):
    """NumPy on the host, or only the project's kernels: nothing it calls is refused, and its values are right."""
    name = grader.answer_names(9)[ex_id]
    namespace = _define(_namespace(9), source, f"answer to {ex_id}")
    with pytest.raises(_course.Refused, match="launched no kernel of its own"):
        _course.run(ex_id, namespace[name])
    assert _course.get(ex_id).kernel and not any(r.split(".")[0] == "gpu" for r in _course.get(ex_id).refuse)
    # the same computation is right: the refusal, not the values, fails it
    _course.get(ex_id).run(namespace[name])


def test_a_kernel_defined_in_the_answer_counts_and_one_of_the_project_does_not():
    from numba import cuda

    namespace = _define(_namespace(9), "@cuda.jit\ndef fill(a):\n    i = cuda.grid(1)\n    if i < a.size:\n        a[i] = i\n",
                        "a kernel of its own")
    out, v1 = cuda.device_array(8), cuda.device_array((1, 2, 3))
    launches: list[str] = []
    with _course.counted_launches(launches):
        namespace["fill"][1, 8](out)
        import gpu.numba_cuda.scan as project_scan

        project_scan._ones_column[(1, 1, 1), (project_scan.THREADS,)](cuda.to_device(np.zeros((1, 2, 2))), v1)
    assert launches == ["fill"]
    assert list(out.copy_to_host()) == list(range(8)) and np.all(v1.copy_to_host()[..., -1] == 1)


# ---------------------------------------------------------------------------
# 3. hidden cases
# ---------------------------------------------------------------------------


def test_reseeded_checks_draw_other_inputs():
    seen = []

    def answer(a):
        seen.append(a.copy())
        return _solutions(1).logsumexp_rows(a)

    ex = _course.get("1.1")
    _course.run("1.1", answer)
    _course.run("1.1", answer, grader.reseeded(ex.run, 1))
    _course.run("1.1", answer, grader.reseeded(ex.run, 1))
    assert seen[0].shape == seen[1].shape and not (seen[0] == seen[1]).all()
    assert (seen[1] == seen[2]).all(), "a reseeded check is still deterministic"


HARD_CODED_HEADS = '''
def multihead_forward(x, params):
    """Right for two heads only: H is taken as 2, not read from params."""
    B, N, _ = x.shape
    H = 2
    d_r, d_v = params.W_q.shape[1] // H, params.W_v.shape[1] // H
    xq, xk = (x @ params.W_q).reshape(B, N, H, d_r), (x @ params.W_k).reshape(B, N, H, d_r)
    v = (x @ params.W_v).reshape(B, N, H, d_v)
    heads = np.empty((B, N, H, d_v))
    for h in range(H):
        var, w = gmm.variances_from_raw(params.raw_variances[h]), gmm.softmax(params.logits[h])
        for b in range(B):
            heads[b, :, h] = gma.gma(xq[b, :, h], xk[b, :, h], v[b, :, h], params.means[h], var, w)
    return heads.reshape(B, N, H * d_v) @ params.W_o
'''


def test_a_hidden_case_catches_what_the_public_check_lets_through():
    namespace = _define(_namespace(10), HARD_CODED_HEADS, "two heads only")
    _course.run("10.3", namespace["multihead_forward"])  # the public check has two heads: it passes
    result = grader.grade_exercise(_course, _course.get("10.3"), namespace["multihead_forward"], grader.load_hidden(10))
    assert result.status == "fail" and result.message.startswith("hidden case: one head, and three heads"), result


def test_an_answer_past_its_time_limit_is_a_timeout():
    def slow(logits, targets):
        time.sleep(30)

    start = time.monotonic()
    result = grader.grade_exercise(_course, _course.get("10.1"), slow, None, time_limit=0.5)
    assert result.status == "timeout" and "ran past 0.5 s" in result.message
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------
# 4. the sample class
# ---------------------------------------------------------------------------


def _sample_answer(kind, lesson, ex_id, namespace, stubs, hidden):
    name = grader.answer_names(lesson)[ex_id]
    if kind == "right":
        namespace[name] = _solutions(lesson).SOLUTIONS[ex_id]
    elif kind == "near_miss":
        namespace[name] = grader.first_near_miss(_solutions(lesson).NEAR_MISSES[ex_id])
    elif kind == "oracle" and ex_id in getattr(hidden, "ORACLE_CALLS", {}):
        _define(namespace, hidden.ORACLE_CALLS[ex_id], f"oracle {ex_id}")
    else:
        _define(namespace, stubs[ex_id], f"stub {ex_id}")


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_sample_class_graded_directly(lesson):
    """Every lesson: the four sample students' answers in a lesson namespace, public checks and hidden cases."""
    hidden = grader.load_hidden(lesson)
    names = grader.answer_names(lesson)
    _, stubs = _stub_cells(lesson)
    for kind in grader.SAMPLE_STUDENTS:
        namespace = _namespace(lesson)
        for ex_id in names:
            _sample_answer(kind, lesson, ex_id, namespace, stubs, hidden)
        results = grader.grade_namespace(lesson, namespace, names, hidden, _course)
        got = {r.id: r.status for r in results}
        expected = {ex_id: grader.expected_status(kind, ex_id, hidden) for ex_id in names}
        assert got == expected, f"lesson {lesson}, {kind}: {[(r.id, r.status, r.message[:200]) for r in results]}"
        for r in results:
            if kind == "right":  # the public check and every hidden case ran
                assert r.cases == 1 + len(grader.hidden_cases(_course.get(r.id), hidden)) >= 2, r
            if kind == "oracle" and r.status == "fail":
                assert "refuses" in r.message or "launched no kernel" in r.message, r


TAMPER = "import _course\n_course.run = lambda *args, **kwargs: None\ncheck = lambda *args: True\n"


@pytest.mark.notebook
@pytest.mark.parametrize(("lesson", "quick"), [(4, False), (1, True)], ids=["4-whole", "1-quick"])
def test_the_sample_class_gets_its_gradebook(tmp_path, lesson, quick):
    """Executed notebooks saved outside tutorials/, graded into lesson_NN.csv: every cell as expected."""
    class_dir = tmp_path / "class"
    notebooks = grader.make_sample_class(lesson, class_dir, quick=quick)
    hidden = grader.load_hidden(lesson)
    expected = {p.stem: {i: grader.expected_status(p.stem, i, hidden) for i in grader.answer_names(lesson)}
                for p in notebooks}
    if lesson == 1:
        # a near miss whose notebook replaces the checks afterwards: the grader's fresh checks still fail it
        nb = nbformat.read(class_dir / "near_miss.ipynb", as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(TAMPER))
        nbformat.write(nb, class_dir / "tamper.ipynb")
        notebooks.append(class_dir / "tamper.ipynb")
        expected["tamper"] = expected["near_miss"]
    path = grader.grade(lesson, notebooks, tmp_path / "gradebook", cell_timeout=120, time_limit=60)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    ids = list(grader.answer_names(lesson))
    assert list(rows[0]) == ["student", *ids, "passed", "messages"]
    got = {row["student"]: {i: row[i] for i in ids} for row in rows}
    assert got == expected, [(r["student"], r["messages"][:300]) for r in rows]
    by_student = {row["student"]: row for row in rows}
    assert by_student["right"]["passed"] == f"{len(ids)}/{len(ids)}" and by_student["right"]["messages"] == ""
    assert by_student["stub"]["messages"] == ""
    for i in ids:  # every failure says why
        assert f"{i}: " in by_student["near_miss"]["messages"]
    for i in getattr(hidden, "ORACLE_CALLS", {}):
        assert f"{i}: exercise {i}: your" in by_student["oracle"]["messages"]
    detail = {s["student"]: s for s in json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))}
    # the near misses' own check cells raised, and the notebook ran on to the grading cell
    assert detail["near_miss"]["cell_errors"] >= len(ids) and detail["right"]["cell_errors"] == 0
