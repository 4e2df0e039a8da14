"""The course's builds and its autograder (tutorials/course.py, course_grader.py, course_sandbox.py, _course.py).

1. The student build holds no answers (no ``solutions/``: worked solutions, near
   misses, hidden cases, answer keys), holds the pages the lessons cite, is
   replaced only with ``--force``, and its checks work there.
2. Checks refuse an answer that runs the code they compare with, by what runs:
   however the answer reaches it (a default argument, a closure, an alias,
   ``getattr`` on a module, a wrapper, a helper no list names), and a kernel
   exercise refuses an answer that launched no kernel of its own.
3. The hidden cases: every worked solution passes them, and they catch an
   answer that the public check lets through; points and partial credit.
4. A sample class of four fake submissions (all right, all stubs, one near miss
   per exercise, one that calls the oracle) gets the gradebook it should,
   graded directly for every lesson, and through the sandbox for lesson 4.
5. Submissions that cheat, each graded in the sandbox: every cheat of the list
   below fails, an untouched stub never passes, and one submission's writes
   reach neither another's grade nor the grader's files.
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


def test_the_student_build_holds_every_page_the_lessons_cite(tmp_path):
    out = course.build(tmp_path / "student", student=True)
    cited = {m for script in course.lessons().values() for m in course.CITED.findall(script.read_text(encoding="utf-8"))}
    assert {"docs/glossary.md", "docs/floating_point.md"} <= cited
    missing = sorted(c for c in cited if not (out / c).is_file())
    assert not missing, f"the lessons cite pages the student build lacks: {missing}"
    # and every page a copied page links to is there too
    for page in (out / "docs").rglob("*.md"):
        for link in course.links(page):
            assert (page.parent / link).resolve().is_file(), f"{page.relative_to(out)} links to {link}, not in the build"
    # the appendix as a reader sees it: its fragments written in, not the documentation build's marker
    appendix = (out / "docs" / "floating_point.md").read_text(encoding="utf-8")
    assert course.FP_MARKER not in appendix and "## Lesson 4" in appendix


def test_a_build_refuses_a_folder_that_is_not_empty_unless_forced_over_an_earlier_build(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit, match="not empty") as info:
        course.build(tmp_path)
    assert "--force" in str(info.value)
    with pytest.raises(SystemExit, match="no build of the course wrote"):
        course.build(tmp_path, force=True)  # --force never empties a folder a build did not write
    assert (tmp_path / "x").exists()
    out = course.build(tmp_path / "b", student=True)
    (out / "stale.txt").write_text("left by hand")
    with pytest.raises(SystemExit, match="not empty"):
        course.build(out)
    course.build(out, student=True, force=True)
    assert not (out / "stale.txt").exists() and (out / "tutorials" / "_course.py").exists()


def test_the_makefile_variables_that_redirect_the_course_targets_are_documented():
    page = (ROOT / "docs" / "course.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for variable in ("STUDENT_COURSE", "FORCE", "GRADEBOOK", "LESSON", "SUBMISSIONS", "ROSTER", "WRITTEN", "JOBS"):
        assert f"$({variable})" in makefile, f"the Makefile does not use {variable}"
        assert f"{variable}=" in page, f"docs/course.md does not document make's {variable}"


# ---------------------------------------------------------------------------
# 2. refusals, by what runs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_refused_name_resolves_to_code(lesson):
    for ex in _course.load(lesson):
        rules = _course.refusal(ex.id)
        assert bool(rules) == bool(ex.refuse), ex.id
        for name in ex.refuse + ex.allow:
            assert _course._files_of(name) or _course._function_of(name)[0], f"exercise {ex.id}: {name!r} is no code"


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


# Answers to 4.2 and 4.3 that reuse the reference, each reaching it another way.  Every one computes the right
# gradients (the test runs the check on it without the refusal first): only the refusal can fail it.  The last two
# call public and private helpers that the exercises' lists of refused names did not name before.
FORWARD = ("    _, cache = {f}(gamma_q, gamma_k, v, causal=True, eps=eps)\n")
CHEATS = {
    "4.2": {
        "a default argument": "from refimpl import scan\n"
                              "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6, "
                              "_f=attention.feature_attention_forward, _b=scan.scan_backward):\n"
                              + FORWARD.format(f="_f") + "    return tuple(_b(G, cache))\n",
        "a closure": "def _make():\n    f, b = attention.feature_attention_forward, attention.feature_attention_backward\n"
                     "    def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
                     "        _, cache = f(gamma_q, gamma_k, v, causal=True, eps=eps)\n"
                     "        return tuple(b(G, cache))\n    return causal_mixing_backward\n"
                     "causal_mixing_backward = _make()\n",
        "an alias": "from refimpl.attention import feature_attention_forward as fwd, feature_attention_backward as bwd\n"
                    "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
                    + FORWARD.format(f="fwd") + "    return tuple(bwd(G, cache))\n",
        "getattr on a module": "import importlib\n"
                               "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
                               "    m = importlib.import_module('refimpl.' + 'attention')\n"
                               + FORWARD.format(f="getattr(m, 'feature_attention_' + 'forward')")
                               + "    return tuple(getattr(m, 'feature_attention_' + 'backward')(G, cache))\n",
        "a wrapper": "import functools\n@functools.wraps(attention.feature_attention_backward)\n"
                     "def _wrapped(*a, _f=attention.feature_attention_backward, **k):\n    return _f(*a, **k)\n"
                     "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
                     + FORWARD.format(f="attention.feature_attention_forward") + "    return tuple(_wrapped(G, cache))\n",
        # every function it needs rebuilt from its code object in a namespace of its own: no function object of the
        # reference is called, only its code runs
        "functions rebuilt from their code": (
            "import types\nfrom refimpl import scan\n"
            "_codes = {n: getattr(scan, n).__code__ for n in ('causal_recurrence_backward', '_through_the_normaliser')}\n"
            "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
            "    g = {'np': np, 'FeatureAttentionGrads': scan.FeatureAttentionGrads}\n"
            "    g.update({n: types.FunctionType(c, g) for n, c in _codes.items()})\n"
            "    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)\n"
            "    den = np.sum(gamma_q * np.cumsum(gamma_k, axis=0), axis=1) + eps\n"
            "    out = np.einsum('nk,nkd->nd', gamma_q, S) / den[:, None]\n"
            "    cache = scan.FeatureAttentionCache(gamma_q, gamma_k, v, out, den, True, eps, 64)\n"
            "    return tuple(g['causal_recurrence_backward'](G, cache))\n"),
        "a thread of its own": "import _thread, queue\n"
                               "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
                               "    box = queue.Queue()\n"
                               "    def work():\n"
                               "        _, cache = attention.feature_attention_forward(gamma_q, gamma_k, v, causal=True, eps=eps)\n"
                               "        box.put(tuple(attention.feature_attention_backward(G, cache)))\n"
                               "    _thread.start_new_thread(work, ())\n"
                               "    return box.get(timeout=20)\n",
        "a public helper no list named": (
            "from refimpl import scan\n"
            "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
            "    S = np.cumsum(gamma_k[:, :, None] * v[:, None, :], axis=0)\n"
            "    z = np.cumsum(gamma_k, axis=0)\n"
            "    den = np.sum(gamma_q * z, axis=1) + eps\n"
            "    out = np.einsum('nk,nkd->nd', gamma_q, S) / den[:, None]\n"
            "    cache = scan.FeatureAttentionCache(gamma_q, gamma_k, v, out, den, True, eps, 64)\n"
            "    return tuple(scan.causal_recurrence_backward(G, cache))\n"),
    },
    "4.3": {
        "a closure": "def _make():\n    backward, core = gma.backward_with, gma._responsibility_backward\n"
                     "    def causal_gma_backward(G, cache):\n        return tuple(backward(core, G, cache))\n"
                     "    return causal_gma_backward\ncausal_gma_backward = _make()\n",
        "getattr on a module": "import refimpl\n"
                               "def causal_gma_backward(G, cache):\n"
                               "    return tuple(getattr(getattr(refimpl, 'gma'), 'gma_' + 'backward')(G, cache))\n",
        "a private helper no list named": (
            "from refimpl import scan\n"
            "def causal_gma_backward(G, cache):\n"
            "    dg = scan.scan_backward(G, cache.mixing)\n"
            "    dxq, dmq, dvq, daq = gma._responsibility_backward(cache.x_q, cache.gamma_q, dg.phi_q, cache.means,\n"
            "                                                      cache.variances)\n"
            "    dxk, dmk, dvk, dak = gma._responsibility_backward(cache.x_k, cache.gamma_k, dg.phi_k, cache.means,\n"
            "                                                      cache.variances)\n"
            "    s = 1 / (1 + np.exp(-cache.raw_variances))\n"
            "    return dxq, dxk, dg.v, dmq + dmk, (dvq + dvk) * s, daq + dak\n"),
    },
}
CHEAT_CASES = [pytest.param(ex_id, how, id=f"{ex_id}-{how}") for ex_id, hows in CHEATS.items() for how in hows]


@pytest.mark.parametrize(("ex_id", "how"), CHEAT_CASES)
def test_reusing_the_reference_is_refused_by_what_runs(ex_id, how):
    name = grader.answer_names(4)[ex_id]
    answer = _define(_namespace(4), CHEATS[ex_id][how], how)[name]
    _course.get(ex_id).run(answer)  # the cheat works: without the refusal the check passes it
    with pytest.raises(_course.Refused, match="which this exercise refuses") as info:
        _course.run(ex_id, answer)
    assert "`refimpl." in str(info.value) or f"`{_course.THREAD}`" in str(info.value)


def test_the_refusal_names_the_private_function_that_ran():
    answer = _define(_namespace(4), CHEATS["4.3"]["a private helper no list named"], "helpers")["causal_gma_backward"]
    with pytest.raises(_course.Refused, match=r"`refimpl\.scan\.scan_backward`"):
        _course.run("4.3", answer)
    rules = _course.refusal("4.3")
    from refimpl import gma

    assert rules.refuses(gma._responsibility_backward.__code__) and rules.name(
        gma._responsibility_backward.__code__) == "refimpl.gma._responsibility_backward"


def test_allowed_code_inside_refused_code_runs():
    from refimpl import ovq

    rules = _course.refusal("8.2")
    assert rules.refuses(ovq._plan_chunk.__code__) and not rules.refuses(ovq.unit_rows.__code__)


def test_the_refusal_leaves_nothing_behind():
    import threading

    import scipy.special

    from refimpl import gmm

    before = sys.getprofile(), threading.getprofile()
    namespace = _define(_namespace(1), LSE_CHEATS["imported under another name"], "cheat")
    with pytest.raises(_course.Refused):
        _course.run("1.1", namespace["logsumexp_rows"])
    assert (sys.getprofile(), threading.getprofile()) == before
    a = np.array([[0.0, 1.0]])
    assert scipy.special.logsumexp(a) == gmm.logsumexp(a, axis=1)[0] == namespace["lse"](a)
    _course.run("1.1", _solutions(1).SOLUTIONS["1.1"])  # the check's own call of SciPy works


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
# a launch counts only when its kernel is defined outside refimpl, cpu, gpu and app
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
# 3. hidden cases, points, feedback
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


def test_a_hidden_case_catches_what_the_public_check_lets_through_and_partial_credit_counts_the_cases():
    namespace = _define(_namespace(10), HARD_CODED_HEADS, "two heads only")
    ex = _course.get("10.3")
    _course.run("10.3", namespace["multihead_forward"])  # the public check has two heads: it passes
    hidden = grader.load_hidden(10)
    result = grader.grade_exercise(_course, ex, namespace["multihead_forward"], hidden)
    total = 1 + len(grader.hidden_cases(ex, hidden))
    assert result.message.startswith("hidden case: one head, and three heads"), result
    assert ex.partial and result.status == "partial" and 0 < result.passed < total
    assert result.points == pytest.approx(ex.points * result.passed / total) and result.max_points == ex.points
    # the student's feedback says a hidden case failed, not which one or on what
    assert "one head, and three heads" not in result.feedback and f"hidden case {total} of {total} failed" in result.feedback


def test_an_exercise_without_partial_credit_earns_all_or_nothing_and_a_refusal_earns_nothing():
    near_miss = grader.first_near_miss(_solutions(4).NEAR_MISSES["4.4"])
    result = grader.grade_exercise(_course, _course.get("4.4"), near_miss, grader.load_hidden(4))
    assert not _course.get("4.4").partial and result.status == "fail" and result.points == 0
    cheat = _define(_namespace(4), CHEATS["4.2"]["a closure"], "closure")["causal_mixing_backward"]
    result = grader.grade_exercise(_course, _course.get("4.2"), cheat, grader.load_hidden(4))
    assert result.status == "refused" and result.points == 0 and "which this exercise refuses" in result.feedback


def test_points_are_declared_beside_every_exercise():
    for lesson in LESSONS:
        for ex in _course.load(lesson):
            assert ex.points > 0, ex.id
    with pytest.raises(ValueError, match="points must be a number > 0"):
        _course.exercise("99.9", "no points", 1, points=0)


def test_the_feedback_of_a_hidden_case_holds_neither_its_inputs_nor_its_answers():
    hidden = grader.load_hidden(4)
    near_miss = grader.first_near_miss(_solutions(4).NEAR_MISSES["4.1"])
    result = grader.grade_exercise(_course, _course.get("4.1"), near_miss, hidden)
    hidden_text = [c["message"] for c in result.details if c["hidden"]] + [
        (case.__doc__ or "") for case in hidden.CASES["4.1"]]
    assert all(c["status"] == "fail" for c in result.details) and result.details[-1]["hidden"]
    assert "the closed form gives" in result.details[-1]["message"]  # the instructor's message says more
    for line in result.feedback.splitlines():
        if line.startswith("hidden case"):
            assert not any(ch.isdigit() for ch in line.split("failed")[1]), line  # no number of a hidden case
    assert "dL/deps" not in result.feedback and "exactly" not in result.feedback and "N_q = 12" not in result.feedback
    assert "a flipped sign" in result.feedback  # what the mistake looks like, all the same
    assert all(text not in result.feedback for text in hidden_text if text)


def test_no_check_states_its_answer_and_the_bound_says_by_how_much_it_misses():
    assert "delta_i" not in (_course.get("4.1").run.__doc__ or "")
    x, means, variances, weights, g = _solutions(4).TIGHT_CASE
    almost = (x, means, variances * np.array([[1 + 1e-12, 1.0], [1.0, 1.0]]), weights, g)  # one variance off by 1e-12
    with pytest.raises(AssertionError) as info:
        _course.run("4.4", almost)
    gap = float(str(info.value).split("1 - ratio = ")[1].split(",")[0])  # printed at 12 decimals, the ratio read 1.0
    assert 1e-13 < gap < 1e-11, str(info.value)


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
        if kind == "near_miss":  # a near miss may pass a hidden case that never reaches its mistake: partial credit
            got = {i: "fail" if s == "partial" else s for i, s in got.items()}
        assert got == expected, f"lesson {lesson}, {kind}: {[(r.id, r.status, r.message[:200]) for r in results]}"
        for r in results:
            if kind == "right":  # the public check and every hidden case ran, and earned every point
                assert r.cases == 1 + len(grader.hidden_cases(_course.get(r.id), hidden)) >= 2, r
                assert r.points == r.max_points == _course.get(r.id).points
            if kind == "oracle" and r.status == "refused":
                assert "refuses" in r.message or "launched no kernel" in r.message, r


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


@pytest.mark.notebook
def test_the_sample_class_gets_its_gradebook_reports_and_lms_files(tmp_path):
    """Lesson 4's four sample notebooks, saved outside tutorials/, graded in the sandbox: every column as expected."""
    lesson = 4
    class_dir = tmp_path / "class"
    notebooks = grader.make_sample_class(lesson, class_dir)
    hidden = grader.load_hidden(lesson)
    ids = list(grader.answer_names(lesson))
    roster = tmp_path / "roster.csv"
    roster.write_text("submission,name,id,sis_user_id,sis_login_id,email,section\n"
                      "right,Ada Right,1001,S1001,ada,ada@example.org,A\n"
                      "stub,Sam Stub,1002,S1002,sam,sam@example.org,A\n", encoding="utf-8")
    written = tmp_path / "written.csv"
    written.write_text("student,4.1 learned,4.1 sign\nPoints Possible,2,1\n1001,2,0.5\nnear_miss,1,1\n", encoding="utf-8")
    path = grader.grade(lesson, notebooks, tmp_path / "gradebook", cell_timeout=120, time_limit=60, jobs=2,
                        roster=roster, written=written)
    rows = _rows(path)
    header, body = rows[0], {row[-1]: dict(zip(rows[0], row)) for row in rows[1:]}
    assert header == ["student", "name", *ids, "written", "total", "maximum", "percent",
                      *(f"status {i}" for i in ids), "submission"]
    points = {ex.id: ex.points for ex in _course.load(lesson)}
    maximum = sum(points.values()) + 3
    for kind in grader.SAMPLE_STUDENTS:
        row = body[kind]
        assert {i: row[f"status {i}"] for i in ids} == {i: grader.expected_status(kind, i, hidden) for i in ids}, row
        for column in (*ids, "written", "total", "maximum", "percent"):
            float(row[column])  # every score column is a plain number
        assert float(row["maximum"]) == maximum
    assert body["right"]["student"] == "1001" and body["right"]["name"] == "Ada Right"
    assert float(body["right"]["total"]) == sum(points.values()) + 2.5 and float(body["stub"]["total"]) == 0
    assert float(body["near_miss"]["written"]) == 2 and body["near_miss"]["student"] == "near_miss"
    assert float(body["right"]["percent"]) == pytest.approx(round(100 * (maximum - 0.5) / maximum, 2))
    canvas = _rows(path.parent / "lesson_04_canvas.csv")
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Lesson 4"]
    assert canvas[1][0] == "Points Possible" and float(canvas[1][-1]) == maximum
    assert ["Ada Right", "1001", "S1001", "ada", "A"] in [row[:5] for row in canvas[2:]]
    moodle = _rows(path.parent / "lesson_04_moodle.csv")
    assert moodle[0] == ["ID number", "Email address", "Full name", "Lesson 4", "Lesson 4 (%)"]
    assert ["1001", "ada@example.org", "Ada Right"] in [row[:3] for row in moodle[1:]]
    # one report per student; the student's holds no hidden case's words, the instructor's does
    reports = sorted(p.stem for p in (path.parent / "reports").glob("*.md"))
    assert reports == sorted(grader.SAMPLE_STUDENTS)
    student = (path.parent / "reports" / "near_miss.md").read_text(encoding="utf-8")
    instructor = (path.parent / "instructor" / "near_miss.md").read_text(encoding="utf-8")
    assert "hidden case" in student and "closed form gives" not in student and "closed form gives" in instructor
    assert all(f"| {i} " in student for i in ids) and "Written questions: 2 of 3 points" in student
    oracle = (path.parent / "reports" / "oracle.md").read_text(encoding="utf-8")
    assert "`refimpl.gma.gma_backward`, which this exercise refuses" in oracle
    detail = {s["student"]: s for s in json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))}
    # the near misses' own check cells raised, and the notebook ran on; the executed notebooks are kept
    assert detail["near_miss"]["cell_errors"] >= len(ids) and detail["right"]["cell_errors"] == 0
    assert Path(detail["right"]["executed"]).is_file()


# ---------------------------------------------------------------------------
# 5. cheating submissions, graded in the sandbox
# ---------------------------------------------------------------------------

# what each cell of a cheating notebook replaces: exercise id -> source (the answer cell), or "before" -> a cell run
# after the imports.  Each cheat listed in the issue of the course's grading has its notebook here.
CHECKOUT_SOLUTIONS = str(TUTORIALS / "solutions" / "lesson_04.py")
PROBE = "_sandbox_probe.txt"
NOTEBOOKS = {
    # a reference function captured in a default argument, and in a closure, before the check starts
    "cheat_bindings": {"4.2": CHEATS["4.2"]["a default argument"], "4.3": CHEATS["4.3"]["a closure"]},
    # an alias, and getattr on a module
    "cheat_names": {"4.2": CHEATS["4.2"]["an alias"], "4.3": CHEATS["4.3"]["getattr on a module"]},
    # a public helper and a private one that no list named: scan.causal_recurrence_backward answers 4.2,
    # scan.scan_backward with gma._responsibility_backward answers 4.3
    "cheat_helpers": {"4.2": CHEATS["4.2"]["a public helper no list named"],
                      "4.3": CHEATS["4.3"]["a private helper no list named"]},
    # the reference's functions rebuilt from their code objects, and a thread of its own (outside threading's watch)
    "cheat_threads": {"4.2": CHEATS["4.2"]["functions rebuilt from their code"],
                      "4.3": "import _thread, queue\n"
                             "def causal_gma_backward(G, cache):\n    box = queue.Queue()\n"
                             "    _thread.start_new_thread(lambda: box.put(tuple(gma.gma_backward(G, cache))), ())\n"
                             "    return box.get(timeout=20)\n"},
    # a wrapper on the refused function, recording the value the check computes as its reference, handed back
    "cheat_wrapper": {
        "before": "import functools\n_seen = {}\n"
                  "for _m, _n in ((attention, 'feature_attention_backward'), (gma, 'gma_backward')):\n"
                  "    def _recording(*a, _f=getattr(_m, _n), _n=_n, **k):\n"
                  "        _seen[_n] = _f(*a, **k)\n        return _seen[_n]\n"
                  "    setattr(_m, _n, _recording)\n",
        "4.2": "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n"
               "    return tuple(_seen['feature_attention_backward'])\n",
        "4.3": "def causal_gma_backward(G, cache):\n    return tuple(_seen['gma_backward'])\n"},
    # the worked solutions read from the grading machine's checkout
    "cheat_solutions": {
        "before": "import types\n_s = types.ModuleType('_s')\n_s.off_by = lambda f, r: f\n"
                  "try:\n"
                  f"    _code = open({CHECKOUT_SOLUTIONS!r}).read().replace('from . import off_by', '')\n"
                  "    exec(_code, _s.__dict__)\n"
                  "except Exception as _err:\n    print('could not read the solutions:', _err)\n",
        **{i: f"{stub}\ntry:\n    {grader.answer_names(4)[i]} = _s.SOLUTIONS[{i!r}]\nexcept Exception:\n    pass\n"
           for i, stub in _stub_cells(4)[1].items()}},
    # importlib.import_module replaced so that a "fresh" import of the checks returns a run that does nothing,
    # and check and _course.run replaced: the stubs stay
    "cheat_import_module": {
        "before": "import importlib, types, _course\n_real_import = importlib.import_module\n"
                  "_fake = types.ModuleType('_course')\n_fake.__dict__.update(vars(_course))\n"
                  "_fake.run = lambda *a, **k: None\n"
                  "importlib.import_module = lambda name, *a, **k: _fake if name == '_course' else _real_import(name, *a, **k)\n"
                  "_course.run = lambda *a, **k: None\ncheck = lambda *a: True\n"},
    # student a rewrites every copy of the checks' framework it can find, and the grader's own, so that every check
    # passes (its run a no-op); student b, graded beside it, handed in the stubs

    "tamper_a": {
        "before": "import _course, os, pathlib\n_written = []\n"
                  "_mine = pathlib.Path(_course.__file__).resolve()\n"
                  "_code = _mine.read_text() + '\\nrun = lambda *args, **kwargs: None  # every check passes\\n'\n"
                  "_targets = [_mine, _mine.parents[3] / 'build' / 'tutorials' / '_course.py', "
                  + repr(str(TUTORIALS / PROBE)) + "]\n"
                  "try:\n    _targets += [_mine.parents[3] / d / 'course' / 'tutorials' / '_course.py'\n"
                  "                 for d in os.listdir(_mine.parents[3])]\n"
                  "except OSError as _err:\n    print('refused:', _err)\n"
                  "for _t in _targets:\n"
                  "    try:\n        pathlib.Path(_t).write_text(_code)\n        _written.append(str(_t))\n"
                  "    except OSError as _err:\n        print('refused:', _t, _err)\n"
                  "print('written:', len(_written), _written)\n"},
    "tamper_b": {},
    # an answer past the time limit, and one past the memory cap; the grading goes on to a right answer
    # (it loops only in the process the grader calls it in, not while the notebook itself runs)
    "limits": {"4.1": "import os\n_notebook = os.getpid()\ndef guard_gradient(G, gamma_q, gamma_k, v, eps):\n"
                      "    while os.getpid() != _notebook:\n        pass\n    raise NotImplementedError\n",
               "4.2": "def causal_mixing_backward(G, gamma_q, gamma_k, v, eps=1e-6):\n    return np.ones(2**33)\n",
               "4.4": "tight_case = (np.zeros(2), np.array([[1.5, 0.0], [-1.5, 0.0]]), np.full((2, 2), 0.3), "
                      "np.array([0.5, 0.5]), np.array([1.0, -1.0]))\n"},
}
EXPECTED = {
    "cheat_bindings": {"4.1": "not done", "4.2": "refused", "4.3": "refused", "4.4": "not done"},
    "cheat_names": {"4.1": "not done", "4.2": "refused", "4.3": "refused", "4.4": "not done"},
    "cheat_helpers": {"4.1": "not done", "4.2": "refused", "4.3": "refused", "4.4": "not done"},
    "cheat_threads": {"4.1": "not done", "4.2": "refused", "4.3": "refused", "4.4": "not done"},
    "cheat_wrapper": {"4.1": "not done", "4.2": "fail", "4.3": "fail", "4.4": "not done"},
    "cheat_solutions": {i: "not done" for i in ("4.1", "4.2", "4.3", "4.4")},
    "cheat_import_module": {i: "not done" for i in ("4.1", "4.2", "4.3", "4.4")},
    "tamper_a": {i: "not done" for i in ("4.1", "4.2", "4.3", "4.4")},
    "tamper_b": {i: "not done" for i in ("4.1", "4.2", "4.3", "4.4")},
    "limits": {"4.1": "timeout", "4.2": "fail", "4.3": "not done", "4.4": "pass"},
}


def _cheating_notebook(base, cells: dict):
    """The lesson's quick notebook with answer cells replaced, and a cell ``cells["before"]`` after its imports."""
    nb = nbformat.from_dict(json.loads(json.dumps(base)))
    names = grader.answer_names(4)
    for i, cell in enumerate(nb.cells):
        m = grader.CHECK_CALL.match(cell.source.strip()) if cell.cell_type == "code" else None
        if m and f"{m.group(1)}.{m.group(2)}" in cells:
            nb.cells[i - 1].source = cells[f"{m.group(1)}.{m.group(2)}"]
    if "before" in cells:
        first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells.insert(first + 1, nbformat.v4.new_code_cell(cells["before"]))
    assert set(names) >= set(cells) - {"before"}
    return nb


@pytest.mark.notebook
def test_cheating_submissions_gain_nothing_and_reach_nothing(tmp_path):
    """Each cheat of NOTEBOOKS in a notebook of its own, graded in one sandboxed run beside the others."""
    base = grader.exercises_only(nbformat.read(grader.lesson_script(4).with_suffix(".ipynb"), as_version=4))
    folder = tmp_path / "hand-in"
    folder.mkdir()
    paths = []
    for name, cells in NOTEBOOKS.items():
        nbformat.write(_cheating_notebook(base, cells), folder / f"{name}.ipynb")
        paths.append(folder / f"{name}.ipynb")
    probe = TUTORIALS / PROBE
    assert not probe.exists()
    checks = {p: p.read_bytes() for p in (TUTORIALS / "_course.py", TUTORIALS / "_exercises_04.py")}
    path = grader.grade(4, paths, tmp_path / "gradebook", cell_timeout=60, time_limit=6, jobs=2, memory_mb=2048)
    rows = {row["submission"]: row for row in csv.DictReader(open(path, newline="", encoding="utf-8"))}
    got = {name: {i: rows[name][f"status {i}"] for i in EXPECTED[name]} for name in NOTEBOOKS}
    assert got == EXPECTED
    for name in NOTEBOOKS:
        if name != "limits":
            assert float(rows[name]["total"]) == 0, (name, rows[name])  # no cheat and no stub earns a point
    assert float(rows["limits"]["total"]) == _course.get("4.4").points
    # nothing reached the grader's files
    assert not probe.exists() and checks == {p: p.read_bytes() for p in checks}
    detail = {s["student"]: s for s in json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))}
    limits = {r["id"]: r for r in detail["limits"]["results"]}
    assert "ran past 6 s" in limits["4.1"]["message"] and "MemoryError" in limits["4.2"]["message"]
    # what each cheat met in its own kernel: the refusals are in its executed notebook
    outputs = {name: json.dumps(nbformat.read(detail[name]["executed"], as_version=4).cells)
               for name in ("cheat_solutions", "tamper_a")}
    assert "could not read the solutions" in outputs["cheat_solutions"] and "sandbox refuses" in outputs["cheat_solutions"]
    # its own copy was written, nothing else: not the build the copies come from, another copy or the checkout
    assert "written: 1 [" in outputs["tamper_a"] and outputs["tamper_a"].count("sandbox refuses") == 3


# ---------------------------------------------------------------------------
# 6. the gradebook's files and what crosses between the processes
# ---------------------------------------------------------------------------


def test_a_roster_and_written_scores_are_read_and_their_mistakes_refused_naming_the_line(tmp_path):
    import course_gradebook as book

    roster = tmp_path / "roster.csv"
    roster.write_text("\ufeffsubmission,name,id\nalice,Alice A,7\n", encoding="utf-8")
    people = book.read_roster(roster, ["alice", "bob"])
    assert people["alice"]["id"] == "7" and book.student_id("alice", people) == "7" and book.student_id("bob", people) == "bob"
    keys = book.keys_of(["alice", "bob"], people)
    for text, message in (("student,q1\nPoints Possible,2\n7,3\n", "line 3: q1 above"),
                          ("student,q1\nPoints Possible,2\ncarol,1\n", "line 3: no submission of this class"),
                          ("student,q1\nPoints Possible,2\nbob,x\n", "line 3: q1 = 'x' is not a number"),
                          ("student,q1\nbob,1\n", "no 'Points Possible' row")):
        (tmp_path / "w.csv").write_text(text, encoding="utf-8")
        with pytest.raises(SystemExit, match=message):
            book.read_written(tmp_path / "w.csv", keys)
    (tmp_path / "w.csv").write_text("student,q1,q2\nPoints Possible,2,3\n7,1.5,3\nbob,,1\n", encoding="utf-8")
    assert book.read_written(tmp_path / "w.csv", keys) == ({"alice": 4.5, "bob": 1.0}, 5.0, ["q1", "q2"])
    roster.write_text("submission,nickname\nalice,A\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown roster columns nickname"):
        book.read_roster(roster, ["alice"])


def test_what_an_answer_sends_back_is_read_as_data_only():
    import pickle

    import _wire

    value = (1, 2.5, -np.inf, 1j, "s", b"b", None, ..., True, np.float32(3), [np.arange(6).reshape(2, 3)],
             {"k": np.ones(2, np.bool_), (1, 2): np.array(["x"])})
    buffers: list = []
    back = _wire.decode(_wire.encode(value, buffers), buffers)
    assert repr(back[:10]) == repr(value[:10]) and type(back[9]) is np.float32
    assert np.array_equal(back[10][0], value[10][0]) and back[11][(1, 2)][0] == "x"
    for bad in (np.array([object()]), object(), np.zeros(2, dtype=[("a", "f8")])):
        with pytest.raises(_wire.WireError, match="grader"):
            _wire.encode(bad, [])
    # a tree naming a dtype that would unpickle, or bytes that do not fill the shape, is refused
    with pytest.raises(_wire.WireError):
        _wire.decode(["a", "|O", [1], 0], [pickle.dumps(print)[:8]])  # bytes that fill one object pointer
    with pytest.raises(_wire.WireError):
        _wire.decode(["a", "<f8", [3], 0], [b"\0" * 8])


def test_inputs_cross_with_their_functions_left_behind():
    import _wire

    def loss(p):
        return float(np.sum(p["a"]))

    data, functions = _wire.dumps_inputs((loss, {"a": np.ones(3)}), {"scale": np.float64(2)})
    assert functions == [loss]
    asked = []
    (stand_in, params), kwargs = _wire.loads_inputs(data, lambda n, a, k: asked.append((n, a)) or 7.0)
    assert stand_in(params) == 7.0 and asked[0][0] == 0 and np.array_equal(asked[0][1][0]["a"], np.ones(3))
    assert [a.shape for a in _wire.array_leaves((params, kwargs))] == [(3,)]


@pytest.mark.notebook
def test_kernel_answers_run_in_the_sandbox_with_the_simulators_threads(tmp_path):
    """Lesson 9's right answers: the CUDA simulator's threads (started by threading) run, watched, and pass; the
    oracle's answers are refused there, 9.3's for launching no kernel of its own."""
    paths = [p for p in grader.make_sample_class(9, tmp_path / "class", quick=True) if p.stem in ("right", "oracle")]
    path = grader.grade(9, paths, tmp_path / "gradebook", cell_timeout=120, time_limit=60, jobs=2)
    rows = {row["submission"]: row for row in csv.DictReader(open(path, newline="", encoding="utf-8"))}
    hidden = grader.load_hidden(9)
    for kind in ("right", "oracle"):
        got = {i: rows[kind][f"status {i}"] for i in grader.answer_names(9)}
        assert got == {i: grader.expected_status(kind, i, hidden) for i in got}, rows[kind]
    detail = {s["student"]: s for s in json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))}
    assert "launched no kernel of its own" in {r["id"]: r for r in detail["oracle"]["results"]}["9.3"]["message"]


def test_a_swapped_function_refuses_under_every_binding_and_records_its_name():
    """The answer's process gives every function of refused code a __code__ that raises: aliases, defaults, closures."""
    import course_sandbox as sandbox

    def outer():
        cell = 3

        def reference(x, y=1):
            return x + y + cell

        return reference

    reference = outer()
    alias, holder = reference, {"f": reference}

    def answer(x, f=reference):
        return f(x)

    assert answer(1) == 5
    latch: list = []
    reference.__code__ = sandbox._refuser(reference.__code__, "module.reference", latch, sandbox.Refused, {})
    for call in (lambda: reference(1), lambda: alias(1), lambda: holder["f"](1), lambda: answer(1)):
        with pytest.raises(sandbox.Refused, match="module.reference"):
            call()
    assert latch == ["module.reference"] * 4 and reference.__qualname__.endswith("reference")
    rules = (frozenset(), frozenset({(__file__, "test_a_swapped_function_refuses_under_every_binding_and_records_its_name")}),
             frozenset({__file__}), frozenset())
    assert sandbox._matches(outer.__code__, *rules) is True  # nested in the refused function
    assert sandbox._matches(test_points_are_declared_beside_every_exercise.__code__, *rules) is False
    allowed = rules[:3] + (frozenset({(__file__, outer.__code__.co_qualname)}),)
    assert sandbox._matches(outer.__code__, *allowed) is False and sandbox._matches(sys._getframe().f_code, *allowed)
