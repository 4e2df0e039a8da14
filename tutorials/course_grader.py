"""The autograder: execute submitted lesson notebooks, run the public checks and the hidden cases, write a gradebook.

For the instructor only: it reads the hidden cases of ``tutorials/solutions/hidden_NN.py``,
which the student build leaves out.

Grading one lesson's submissions (:func:`grade`) follows nbgrader's ``autograde``,
with the verdict out of the submission's reach:

1. **Each submission alone.**  A student build of the course (no
   ``solutions/``: no worked solutions, hidden cases or keys) is made once;
   each submission gets a temporary copy of it, with its own home, temporary
   and cache folders, and runs in a Jupyter kernel started by
   ``course_sandbox.py``: a memory cap, and an audit hook that keeps it out
   of the grader's checkout, the gradebook, the other submissions and their
   notebooks, lets it write only in its own folder and start no process.
   ``jobs`` submissions are graded at once, each with a time limit.
2. **The notebook runs** top to bottom under ``nbclient`` (the library
   nbgrader's ``Execute`` preprocessor runs on), with ``allow_errors=True``, a
   per-cell ``timeout`` and ``interrupt_on_timeout=True``, at small size
   (``TUTORIAL_SMALL=1``) unless asked for full size: a wrong answer's
   ``AssertionError`` no longer stops the notebook, every answer is graded.
3. **The verdict is the grader's.**  The checks, the hidden cases, the
   reference values and the comparisons run here, in the grader's own
   process, from its own files; nothing is appended to the notebook.  For
   each exercise the kernel forks a process for the answer
   (``course_sandbox.py``): the code the exercise refuses made unrunnable
   there, it receives each call's inputs, calls the answer (found by the name
   its check cell passes, ``check("4.1", name)``) and sends back only the
   results, as data (``_wire.py``): whatever the notebook did to its own
   modules, imports or files changes no reference, comparison or grade.
4. **Every case counts.**  The public check, the public check again with its
   random generators seeded otherwise (:func:`reseeded`, the offsets of
   ``SEEDS``), and the extra cases of ``CASES`` (other sizes, edge cases) each
   run within ``time_limit``; an exercise earns its ``points`` when all pass,
   or, where it is declared ``partial``, a share for each case that passes.
5. **The gradebook** (``course_gradebook.py``): ``lesson_NN.csv`` (numeric
   points per exercise, the written questions' score, total, maximum,
   percent; statuses beside them), the files Canvas and Moodle import,
   ``lesson_NN.json`` with every message in full, a feedback report per
   student (``reports/``, without the hidden cases' inputs or answers) and
   one for the instructor (``instructor/``), and the executed notebooks.

Commands (``tutorials/course.py`` passes them on)::

    .venv/bin/python tutorials/course.py sample-class 4 /tmp/class     # four fake submissions of lesson 4
    .venv/bin/python tutorials/course.py grade 4 /tmp/class/*.ipynb --out /tmp/gradebook
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOLUTIONS = HERE / "solutions"
CHECK_CALL = re.compile(r'^check\("(\d+)\.(\d+)",\s*([A-Za-z_]\w*)\)\s*$')
STATUSES = ("pass", "partial", "fail", "refused", "not done", "missing", "timeout", "error")
SEED_STRIDE = 7919  # seed s of a check becomes s + 7919 * offset in a reseeded run
DEFAULT_SEEDS = (1,)  # the reseeded runs of an exercise that hidden_NN.SEEDS does not list (or of a lesson without one)
KERNEL_NAME = "course-sandbox"
CONNECT_TIMEOUT = 60.0  # seconds the grader waits for a process of the submission to connect


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
# Grading one answer: every case, points
# ---------------------------------------------------------------------------


@dataclass
class Case:
    """One case of an exercise's grading: the public check or a hidden case, and how it went."""

    label: str
    status: str  # pass, fail, refused, not done or timeout
    message: str = ""
    hidden: bool = False


@dataclass
class Result:
    """One exercise of one submission.

    ``message`` is the first failure in full, for the instructor;
    ``feedback`` what the student's report says: the public check's message,
    and of a hidden case only that it failed and what the mistake looks like.
    """

    id: str
    status: str
    message: str = ""
    cases: int = 0  # how many checks ran: the public one and the hidden cases
    points: float = 0.0
    max_points: float = 0.0
    passed: int = 0
    total: int = 0  # the cases in all: the public check and the hidden ones
    feedback: str = ""
    details: list = field(default_factory=list)  # every case, as Case's fields


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
    return threading.current_thread() is threading.main_thread()


def diagnosis(message: str) -> list[str]:
    """The names of the mistakes a check's message diagnoses (its ``This looks like:`` lines, up to their first colon)."""
    import _hints

    _, found, rest = message.partition(_hints.HEADER)
    if not found:
        return []
    lines = [line.strip()[2:] for line in rest.splitlines() if line.strip().startswith("- ")]
    return [line.split(": ")[0] for line in lines]


def _feedback(cases: list[Case], total: int) -> str:
    """What the student's report says of an exercise's cases: nothing of a hidden case's inputs or expected values."""
    out = []
    for n, case in enumerate(cases, start=1):
        if case.status == "pass":
            continue
        if not case.hidden or case.status == "refused":
            where = "the public check" if not case.hidden else f"hidden case {n} of {total}"
            out.append(f"{where}: {case.message}" if case.hidden else case.message)
        elif case.status == "timeout":
            out.append(f"hidden case {n} of {total}: {case.message}")
        else:
            names = diagnosis(case.message)
            kind = f" ({case.message.split(':')[0]})" if case.message.startswith("your answer raised") else ""
            out.append(f"hidden case {n} of {total} failed{kind}"
                       + (": this looks like " + "; ".join(names) if names else ""))
    return "\n".join(out)


def _scored(ex, cases: list[Case], total: int) -> Result:
    """The exercise's result from its cases: status, points (a share per case where it is ``partial``), messages."""
    passed = sum(c.status == "pass" for c in cases)
    statuses = {c.status for c in cases}
    if "refused" in statuses:
        status, points = "refused", 0.0
    elif passed == total:
        status, points = "pass", ex.points
    else:
        points = ex.points * passed / total if ex.partial else 0.0
        status = "timeout" if "timeout" in statuses else ("partial" if points > 0 else "fail")
    first = next((c for c in cases if c.status != "pass"), None)
    message = "" if first is None else (f"{first.label}: {first.message}" if first.hidden else first.message)
    return Result(ex.id, status, message, len(cases), round(points, 6), ex.points, passed, total,
                  _feedback(cases, total), [asdict(c) for c in cases])


def grade_exercise(course, ex, answer, hidden, time_limit: float | None = 60.0) -> Result:
    """Run the public check and every hidden case of ``ex`` on ``answer``; score them (:func:`_scored`).

    ``course`` is the ``_course`` module the checks were registered with;
    ``answer`` a value, a function, or a :class:`RemoteAnswer`.  A stub stops
    at the public check (``not done``); a refusal or a timeout ends the
    exercise.
    """
    checks = [("public check", None, False)] + [(label, check, True) for label, check in hidden_cases(ex, hidden)]
    cases: list[Case] = []
    for n, (label, check, is_hidden) in enumerate(checks, start=1):
        try:
            with _time_limit(time_limit):
                course.run(ex.id, answer, check)
            cases.append(Case(label, "pass", "", is_hidden))
        except course.NotAttempted as err:
            if n == 1:
                return Result(ex.id, "not done", "", 1, 0.0, ex.points, 0, len(checks), "",
                              [asdict(Case(label, "not done"))])
            cases.append(Case(label, "fail", f"the answer raised NotImplementedError: {err}", is_hidden))
        except course.Refused as err:
            cases.append(Case(label, "refused", str(err), is_hidden))
            break
        except AssertionError as err:
            cases.append(Case(label, "fail", str(err), is_hidden))
        except _Timeout:
            cases.append(Case(label, "timeout", f"ran past {time_limit:g} s", is_hidden))
            break
        except Exception as err:  # the answer raised: a wrong answer, said as such
            cases.append(Case(label, "fail", f"your answer raised {type(err).__name__}: {err}", is_hidden))
        if isinstance(answer, RemoteAnswer) and answer.ended:
            break
    return _scored(ex, cases, len(checks))


def grade_namespace(lesson: int, namespace: dict, names: dict[str, str], hidden=None, course=None,
                    time_limit: float | None = 60.0) -> list[Result]:
    """Grade, in this process, the answers that ``namespace`` holds (a lesson's globals); ``names``: id -> answer name.

    The grader itself calls each answer in the submission's process
    (:func:`grade_submission`); this is the same grading for answers at hand.
    """
    if course is None:
        import _course as course
    exercises = {ex.id: ex for ex in course.load(lesson)}
    results = []
    for ex_id, name in names.items():
        if ex_id not in exercises:
            results.append(Result(ex_id, "error", f"exercise {ex_id} is not registered by _exercises_{lesson:02d}.py"))
        elif name not in namespace:
            results.append(Result(ex_id, "missing", f"the notebook defines no `{name}` (the answer to {ex_id})",
                                  max_points=exercises[ex_id].points))
        else:
            results.append(grade_exercise(course, exercises[ex_id], namespace[name], hidden, time_limit))
    return results


# ---------------------------------------------------------------------------
# The answer in the submission's process
# ---------------------------------------------------------------------------


MISSING = object()  # what the answer's process reports for a name the notebook does not define


class AnswerEnded(RuntimeError):
    """The answer's process is gone (it exited, crashed, ran out of memory or past its time)."""


def _rebuilt(name: str, bases: list, message: str) -> BaseException:
    """An exception like the one the answer raised: its builtin base's type, under its name; never one that stops the grader."""
    base = next((getattr(builtins, b) for b in bases if isinstance(getattr(builtins, b, None), type)
                 and issubclass(getattr(builtins, b), Exception)), Exception)
    if base.__name__ == name:
        return base(message)
    safe = name if isinstance(name, str) and name.isidentifier() else "Error"
    return type(safe, (base,), {"__module__": "submission"})(message)


class RemoteAnswer:
    """The grader's handle on an answer that runs in its own process: calling it sends the inputs there.

    ``refused`` lists every call into refused code the process reported;
    ``ended`` says why the process is gone, once it is.  A function among
    the inputs runs here when the answer calls it.
    """

    remote = True

    def __init__(self, conn, pid: int, ex, course):
        self.conn, self.pid, self.ex, self.course = conn, pid, ex, course
        self.refused: list[str] = []
        self.ended = ""

    def _recv(self):
        import _wire

        try:
            return _wire.recv(self.conn)
        except BaseException as err:
            self.stop("its process ended" if isinstance(err, (EOFError, OSError)) else
                      "its process was stopped" if isinstance(err, _Timeout) else f"the grader could not read it ({err})")
            if isinstance(err, (EOFError, OSError, _wire.WireError)):
                raise AnswerEnded(f"the answer's process ended before it replied ({self.ended}): it exited, crashed "
                                  "or ran out of memory") from None
            raise

    def stop(self, why: str) -> None:
        """End the answer's process (a timeout, the end of the exercise)."""
        self.ended = self.ended or why
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.conn.close()

    def __call__(self, *args, **kwargs):
        import numpy as np

        import _wire

        if self.ended:
            raise AnswerEnded(f"the answer's process is gone ({self.ended})")
        data, functions = _wire.dumps_inputs(args, kwargs)
        leaves = _wire.array_leaves((args, kwargs))
        _wire.send(self.conn, {"op": "call", "errstate": np.geterr(), "switchinterval": sys.getswitchinterval()}, [data])
        while True:
            header, buffers = self._recv()
            op = header.get("op")
            if op == "callback":
                self._callback(functions, header, buffers)
            elif op == "result":
                for i, tree in header.get("changed", []):
                    new = _wire.decode(tree, buffers)
                    if 0 <= i < len(leaves) and leaves[i].shape == np.shape(new):
                        np.copyto(leaves[i], new, casting="unsafe")
                if self.ex.kernel and not header.get("launches"):
                    raise self.course.Refused(self.course._no_kernel_message(self.ex))
                return _wire.decode(header["value"], buffers)
            elif op == "refused":
                names = [str(n) for n in header.get("names", [])]
                self.refused += names
                raise self.course.Refused(self.course._refusal_message(self.ex, names))
            elif op == "raised":
                raise _rebuilt(str(header.get("type")), list(header.get("bases", [])), str(header.get("message", "")))
            else:
                self.stop("it broke the grader's protocol")
                raise AnswerEnded(str(header.get("message") or f"the answer's process sent {op!r} where its result "
                                                                "belongs"))

    def _callback(self, functions, header, buffers) -> None:
        """Run the grader's function the answer called (``loss`` of exercise 10.6) and send its result back."""
        import pickle

        import _wire

        try:
            function = functions[int(header["number"])]
            args = _wire.decode(header["args"], buffers)
            kwargs = _wire.decode(header["kwargs"], buffers)
            result = function(*args, **{str(k): v for k, v in kwargs.items()})
        except Exception as err:  # the answer's arguments broke the grader's function: an error for the answer
            _wire.send(self.conn, {"op": "callback-raised", "type": type(err).__name__, "message": str(err)})
            return
        _wire.send(self.conn, {"op": "callback-result"}, [pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)])


# ---------------------------------------------------------------------------
# One submission: its own copy, its own kernel, its answers graded here
# ---------------------------------------------------------------------------


@dataclass
class Submission:
    student: str
    notebook: str
    results: list[Result] = field(default_factory=list)
    cell_errors: int = 0  # cells of the notebook that raised (a wrong answer's check cell among them)
    note: str = ""
    executed: str = ""  # the executed notebook, in the gradebook's folder


@dataclass
class Job:
    """What a worker needs to grade one submission."""

    index: int
    notebook: str
    student: str
    lesson: int
    build: str  # the student build to copy
    scratch: str  # the folder of every submission's temporary copy
    executed: str  # where the executed notebook goes
    deny: list  # folders the submission may not read: the checkout, the gradebook, the scratch, every notebook's folder
    cell_timeout: float = 300
    time_limit: float = 60
    small: bool = True
    memory_mb: int = 4096
    submission_timeout: float = 1800


def student_name(path: Path, lesson_stem: str) -> str:
    """The notebook's name, or its folder's where the notebook keeps the lesson's own name (``alice/04_....ipynb``)."""
    return path.parent.name if path.stem == lesson_stem else path.stem


def _peer_pid(conn) -> int:
    """The pid of the process at the other end of a Unix socket, as the kernel reports it (Linux)."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", data)[0]


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return int(f.read().rpartition(")")[2].split()[1])


class Listener:
    """The grader's socket for one submission: each connection queued with the pid the kernel vouches for."""

    def __init__(self, path: Path):
        import queue

        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(8)
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.queue.put((conn, _peer_pid(conn)))

    def wait(self, accept, timeout: float = CONNECT_TIMEOUT):
        """The first connection whose pid ``accept(pid)`` takes (the others closed), with its first 9 bytes read."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                conn, pid = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AnswerEnded("no process of the submission connected") from None
            try:
                conn.settimeout(timeout)
                hello = _exactly(conn, 9)
                conn.settimeout(None)
            except OSError:
                conn.close()
                continue
            if accept(pid) and int.from_bytes(hello[1:], "big") == pid:
                return conn, pid, hello[:1]
            conn.close()

    def close(self):
        self.server.close()


def _exactly(conn, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the other side closed the connection")
        data += chunk
    return data


def _exercise_lines(ex_id: str, name: str, kernel: bool, refusal) -> bytes:
    """The parameters an answer's process reads (``course_sandbox._read_exercise``): one per line."""
    lines = [ex_id, name, "kernel" if kernel else "", "[files]", *sorted(refusal.files), "[functions]",
             *sorted(f"{f}\t{q}" for f, q in refusal.functions), "[allowed]",
             *sorted(f"{f}\t{q}" for f, q in refusal.allowed), "[modules]",
             *sorted(f"{f}\t{m}" for f, m in refusal.modules)]
    body = "\n".join(lines).encode("utf-8")
    return len(body).to_bytes(8, "big") + body


class Sandbox:
    """The submission's kernel and the grader's end of its processes (``course_sandbox.py`` is the other end)."""

    def __init__(self, job: Job, root: Path):
        import course_sandbox

        self.job, self.root = job, root
        self.course_dir = Path(os.path.realpath(root / "course"))
        shutil.copytree(job.build, self.course_dir, symlinks=False)
        for name in ("home", "tmp", "work", "kernels", "numba"):
            (root / name).mkdir()
        self.listener = Listener(root / "grader.sock")
        kernel = root / "kernels" / KERNEL_NAME
        kernel.mkdir()
        (kernel / "kernel.json").write_text(json.dumps({
            "argv": course_sandbox.kernel_argv(sys.executable), "display_name": "graded submission",
            "language": "python", "metadata": {"debugger": False}}), encoding="utf-8")
        allow = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(root / "home"), "TMPDIR": str(root / "tmp"), "IPYTHONDIR": str(root / "home" / ".ipython"),
            "MPLCONFIGDIR": str(root / "home" / ".matplotlib"), "JUPYTER_CONFIG_DIR": str(root / "home" / ".jupyter"),
            "JUPYTER_DATA_DIR": str(root / "home" / ".jupyter-data"), "NUMBA_CACHE_DIR": str(root / "numba"),
            "PYTHONPATH": os.pathsep.join([str(self.course_dir), str(self.course_dir / "tutorials")]),
            "TUTORIAL_SMALL": "1" if job.small else "0", "MPLBACKEND": "Agg", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
            course_sandbox.CONFIG: course_sandbox.config(
                str(root / "grader.sock"), str(root), list(job.deny), allow, job.memory_mb << 20,
                str(HERE / "_wire.py"), str(HERE / "_course.py")),
        }
        self._warm_matplotlib()
        self.kernel_pid = 0
        self.channel = None

    def _warm_matplotlib(self):
        """Matplotlib's font list, copied from the grader's cache: every kernel would otherwise build it again."""
        try:
            import matplotlib
        except ImportError:
            return
        cache = Path(matplotlib.get_cachedir())
        target = self.root / "home" / ".matplotlib"
        target.mkdir(parents=True, exist_ok=True)
        for f in cache.glob("fontlist-*.json"):
            shutil.copy2(f, target / f.name)

    def kernel_manager(self):
        """The kernel's manager: asynchronous, as nbclient drives it (a synchronous one cannot interrupt a cell there)."""
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager

        # its connection file (the key that signs every message to it) in the submission's own folder, out of the
        # other submissions' reach
        return AsyncKernelManager(kernel_name=KERNEL_NAME, connection_file=str(self.root / "kernels" / "connection.json"),
                                  kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self.root / "kernels")]))

    def connect_kernel(self, km):
        """The kernel's own connection, made by ``course_sandbox.launch`` before any of the notebook ran."""
        self.kernel_pid = km.provisioner.process.pid
        self.channel, _, kind = self.listener.wait(lambda pid: pid == self.kernel_pid)
        if kind != b"K":
            raise AnswerEnded("the kernel did not introduce itself")

    def answer(self, ex, name: str, refusal, course):
        """The answer ``name`` in a process forked for it: a :class:`RemoteAnswer`, a value, or a status string."""
        if self.channel is None:
            raise AnswerEnded("the submission's kernel is gone")
        try:
            self.channel.sendall(b"f")
            pid = int.from_bytes(_exactly(self.channel, 8), "big")
        except OSError as err:
            raise AnswerEnded(f"the submission's kernel is gone ({err})") from None
        conn, pid, _ = self.listener.wait(lambda p: p == pid and p != self.kernel_pid
                                          and _parent_pid(p) == self.kernel_pid)
        handle = RemoteAnswer(conn, pid, ex, course)
        conn.sendall(_exercise_lines(ex.id, name, ex.kernel, refusal.moved(str(course._project_root()), str(self.course_dir))))
        header, buffers = handle._recv()
        op = header.get("op")
        if op == "callable":
            return handle, handle
        handle.stop("done")
        if op == "value":
            import _wire

            return handle, _wire.decode(header["value"], buffers)
        if op == "missing":
            return handle, MISSING
        raise AnswerEnded(str(header.get("message", f"the answer's process sent {op!r}")))

    def close(self, km):
        from jupyter_core.utils import run_sync

        for action in (lambda: self.channel and self.channel.sendall(b"q"),
                       lambda: run_sync(km.shutdown_kernel)(now=True),
                       lambda: os.killpg(self.kernel_pid, signal.SIGKILL) if self.kernel_pid and
                       os.getpgid(self.kernel_pid) != os.getpgid(0) else None):
            try:
                action()
            except Exception:  # noqa: BLE001 -- already gone
                pass
        self.listener.close()


def _read_notebook(path: str):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def grade_submission(job: Job) -> Submission:
    """Grade one submitted notebook in a copy of its own (the module docstring says how); the worker of :func:`grade`."""
    import _course as course
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    sub = Submission(job.student, job.notebook)
    names = answer_names(job.lesson)
    exercises = {ex.id: ex for ex in course.load(job.lesson)}
    try:
        nb = _read_notebook(job.notebook)
    except Exception as err:  # not a notebook
        sub.note = f"could not read the notebook: {type(err).__name__}: {err}"
        sub.results = [Result(i, "error", sub.note, max_points=exercises[i].points) for i in names]
        return sub
    root = Path(tempfile.mkdtemp(prefix=f"{job.index:03d}-", dir=job.scratch))
    sandbox = Sandbox(job, root)
    km = sandbox.kernel_manager()
    deadline = time.monotonic() + job.submission_timeout
    watchdog = threading.Timer(job.submission_timeout, lambda: sandbox.close(km))
    watchdog.daemon = True
    watchdog.start()
    hidden = load_hidden(job.lesson)
    try:
        # a cell past its time is interrupted and reported as an error at once, and the notebook goes on
        client = NotebookClient(nb, km=km, timeout=int(job.cell_timeout), allow_errors=True, interrupt_on_timeout=True,
                                error_on_timeout={"ename": "CellTimeoutError", "evalue": f"the cell ran past "
                                                  f"{job.cell_timeout:g} s and was interrupted", "traceback": []},
                                startup_timeout=120, resources={"metadata": {"path": str(root / "work")}})
        log = root / "kernel.log"
        try:
            with open(log, "wb") as output:  # the kernel's own stdout and stderr: its start-up, a crash
                client.execute(env=sandbox.env, stdout=output, stderr=output)
        except (DeadKernelError, CellTimeoutError, RuntimeError) as err:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            sub.note = (f"the notebook did not finish: {type(err).__name__}: {str(err).strip().splitlines()[0]}"
                        + (f" (the kernel said: {' / '.join(tail)})" if tail else ""))
        sub.cell_errors = sum(1 for c in nb.cells if c.cell_type == "code"
                              and any(o.get("output_type") == "error" for o in c.get("outputs", [])))
        Path(job.executed).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, job.executed)
        sub.executed = job.executed
        try:
            sandbox.connect_kernel(km)
        except AnswerEnded as err:
            sub.note = sub.note or str(err)
        for ex_id, name in names.items():
            ex = exercises[ex_id]
            if time.monotonic() > deadline:
                sub.results.append(Result(ex_id, "timeout", f"the submission ran past {job.submission_timeout:g} s",
                                          max_points=ex.points))
                continue
            try:
                handle, answer = sandbox.answer(ex, name, course.refusal(ex_id), course)
            except (AnswerEnded, OSError) as err:
                sub.results.append(Result(ex_id, "error", f"the answer could not be reached: {err}", max_points=ex.points))
                continue
            if answer is MISSING:
                sub.results.append(Result(ex_id, "missing", f"the notebook defines no `{name}` (the answer to {ex_id})",
                                          max_points=ex.points))
                continue
            try:
                result = grade_exercise(course, ex, answer, hidden, job.time_limit)
            finally:
                handle.stop("done")
            if time.monotonic() > deadline and result.status != "pass":
                result.status = "timeout"
                result.message = f"the submission ran past {job.submission_timeout:g} s; {result.message}"
            sub.results.append(result)
    finally:
        watchdog.cancel()
        sandbox.close(km)
        shutil.rmtree(root, ignore_errors=True)
    return sub


def _workers(jobs: int | None) -> int:
    if jobs:
        return max(1, int(jobs))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _folders_to_deny(notebooks: list[Path]) -> list[str]:
    """The folders of the submitted notebooks (a submission may not read another's), but never ``/`` or the home folder."""
    keep_open = {os.path.realpath(os.sep), os.path.realpath(Path.home())}
    return sorted({os.path.realpath(nb.parent) for nb in notebooks} - keep_open)


def grade(lesson: int, notebooks: list[Path], out: Path, cell_timeout: float = 300, time_limit: float = 60,
          small: bool = True, *, jobs: int | None = None, memory_mb: int = 4096, submission_timeout: float = 1800,
          roster: Path | None = None, written: Path | None = None) -> Path:
    """Grade the submitted notebooks of lesson ``lesson`` into ``out`` (the module docstring says how); return ``out/lesson_NN.csv``.

    Parameters
    ----------
    lesson : int
    notebooks : list of Path
        The submissions: ``name.ipynb`` is graded as ``name``, and a notebook
        that keeps the lesson's own file name as its folder's name.
    out : Path
        The gradebook's folder.
    cell_timeout, time_limit : float
        Seconds per cell of a notebook, and per check of an answer.
    small : bool
        Execute at small size (``TUTORIAL_SMALL=1``).
    jobs : int, optional
        Submissions graded at once (default: the cores this process may use).
    memory_mb : int
        The memory cap of each submission's processes, in MiB.
    submission_timeout : float
        Seconds for one submission in all; past them its kernel is stopped.
    roster : Path, optional
        A CSV that gives each submission its student (``course_gradebook.read_roster``).
    written : Path, optional
        A CSV of the written questions' scores (``course_gradebook.read_written``).
    """
    import course_build
    import course_gradebook

    if not sys.platform.startswith("linux"):
        raise SystemExit("the grader runs submissions in processes of their own that only Linux lets it check "
                         f"(peer credentials of a Unix socket); this is {sys.platform}")
    out = Path(out).resolve()
    notebooks = sorted(Path(p).resolve() for p in notebooks)
    stem = lesson_script(lesson).stem
    students = course_gradebook.unique([student_name(nb, stem) for nb in notebooks])
    people = course_gradebook.read_roster(roster, students) if roster else {}
    scores = course_gradebook.read_written(written, course_gradebook.keys_of(students, people)) if written else None
    out.mkdir(parents=True, exist_ok=True)
    try:  # the font list every kernel copies (Sandbox._warm_matplotlib), built once here
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass
    scratch = Path(tempfile.mkdtemp(prefix="course-grade-"))
    try:
        build = course_build.build(scratch / "build", student=True)
        deny = [str(ROOT), str(out), str(scratch)] + _folders_to_deny(notebooks)
        work = [Job(i, str(nb), student, lesson, str(build), str(scratch), str(out / "executed" / f"{student}.ipynb"),
                    deny, cell_timeout, time_limit, small, memory_mb, submission_timeout)
                for i, (nb, student) in enumerate(zip(notebooks, students))]
        submissions = list(_run(work, _workers(jobs)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    path = course_gradebook.write(lesson, sorted(submissions, key=lambda s: s.student), out, people, scores)
    print(f"gradebook: {path}")
    return path


def _run(work: list[Job], workers: int):
    """Each job's :class:`Submission`, graded ``workers`` at a time (in this process when one), printed as it ends."""
    def report(sub):
        points = sum(r.points for r in sub.results)
        print(f"{sub.student}: " + ", ".join(f"{r.id} {r.status}" for r in sub.results)
              + f" ({points:g} points)", flush=True)
        return sub

    if workers == 1 or len(work) == 1:
        for job in work:
            yield report(grade_submission(job))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawned, not forked: the caller may have threads of its own (a test runner's), which a fork would copy half-way
    with ProcessPoolExecutor(max_workers=min(workers, len(work)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(grade_submission, job) for job in work]):
            yield report(future.result())


# ---------------------------------------------------------------------------
# A sample class: four fake submissions made from the lesson and the solutions
# ---------------------------------------------------------------------------

SAMPLE_STUDENTS = ("right", "stub", "near_miss", "oracle")

_SAMPLE_PRELUDE = '''# the sample class's answers: the worked solutions, carried in this notebook (a submission is its notebook alone)
import sys as _sys
import types as _types

def _sample_module(name, source, package=None):
    module = _types.ModuleType(name)
    module.__package__ = package or name
    if package is None:
        module.__path__ = []
    _sys.modules[name] = module
    exec(compile(source, f"<sample {{name}}>", "exec"), module.__dict__)
    return module

_sample_module("sample_solutions", {package!r})
_sample_solutions = _sample_module("sample_solutions.lesson_{lesson:02d}", {lesson_source!r}, "sample_solutions")


def solution(ex_id):
    return _sample_solutions.SOLUTIONS[ex_id]


def near_miss(ex_id):
    listed = _sample_solutions.NEAR_MISSES[ex_id]
    return next(iter(listed.values())) if isinstance(listed, dict) else listed[0]
'''


def first_near_miss(listed):
    """The first near miss of an exercise: ``NEAR_MISSES`` maps a label saying which mistake to each (or lists them)."""
    return next(iter(listed.values())) if isinstance(listed, dict) else listed[0]


def sample_answer_cell(kind: str, ex_id: str, name: str, hidden) -> str | None:
    """The source of the answer cell of student ``kind`` for exercise ``ex_id``; None keeps the stub."""
    if kind == "right":
        return f"{name} = solution({ex_id!r})  # the worked solution\n"
    if kind == "near_miss":
        return f"{name} = near_miss({ex_id!r})  # its first near miss\n"
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


def sample_prelude(lesson: int) -> str:
    """The first cell of a sample notebook: the worked solutions of ``lesson``, carried in the notebook itself."""
    package = (SOLUTIONS / "__init__.py").read_text(encoding="utf-8")
    source = (SOLUTIONS / f"lesson_{lesson:02d}.py").read_text(encoding="utf-8")
    return _SAMPLE_PRELUDE.format(package=package, lesson=lesson, lesson_source=source)


def make_sample_class(lesson: int, out: Path, quick: bool = False) -> list[Path]:
    """Write the four fake submissions of lesson ``lesson`` into ``out``: ``right``, ``stub``, ``near_miss``, ``oracle``.

    Each is the lesson's notebook with its answer cells replaced: the worked
    solution, the stub left as it is, the first near miss of ``NEAR_MISSES``,
    and the oracle-calling answer of ``hidden_NN.ORACLE_CALLS`` (the stub where
    none exists).  The solutions travel in a first cell of each notebook
    (:func:`sample_prelude`), as a submission has nothing beside its
    notebook.  ``quick``: only the imports and the exercises
    (:func:`exercises_only`), seconds to execute.
    """
    import nbformat

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
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
    prelude = sample_prelude(lesson)
    paths = []
    for kind in SAMPLE_STUDENTS:
        copy = nbformat.from_dict(json.loads(json.dumps(nb)))
        for i, (ex_id, name) in check_at.items():
            source = sample_answer_cell(kind, ex_id, name, hidden)
            if source is not None:
                copy.cells[i - 1].source = source
        if kind in ("right", "near_miss"):
            copy.cells.insert(0, nbformat.v4.new_code_cell(prelude))
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
        return "refused" if ex_id in getattr(hidden, "ORACLE_CALLS", {}) else "not done"
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
    g.add_argument("--jobs", type=int, default=None, help="submissions graded at once (default: the cores available)")
    g.add_argument("--memory", type=int, default=4096, help="memory cap of each submission's processes, MiB (default 4096)")
    g.add_argument("--submission-timeout", type=float, default=1800,
                   help="seconds for one submission in all (default 1800)")
    g.add_argument("--roster", type=Path, help="CSV: submission, and any of name, id, sis_user_id, sis_login_id, "
                                               "email, section (docs/course.md)")
    g.add_argument("--written", type=Path, help="CSV of the written questions' scores, with a 'Points Possible' row")
    s = sub.add_parser("sample-class", help="write four fake submissions of a lesson (right, stub, near miss, oracle)")
    s.add_argument("lesson", type=int)
    s.add_argument("out", type=Path)
    s.add_argument("--quick", action="store_true", help="only the imports and the exercises of the lesson")
    args = parser.parse_args(argv)
    if args.command == "grade":
        grade(args.lesson, args.notebooks, args.out, args.cell_timeout, args.time_limit, not args.full, jobs=args.jobs,
              memory_mb=args.memory, submission_timeout=args.submission_timeout, roster=args.roster,
              written=args.written)
    else:
        for p in make_sample_class(args.lesson, args.out, args.quick):
            print(p)
    return 0


if __name__ == "__main__":
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    sys.exit(main())
