"""The lessons' exercises: a registry of checks, and the ``check`` that a lesson's check cell calls.

Every exercise of lesson ``NN`` is a function in ``tutorials/_exercises_NN.py``
registered with :func:`exercise`.  It receives the student's answer (a
function, or a value) and ``assert``s on it: it builds its own inputs, calls
the answer and compares with an independent result (``refimpl``, a dense
formula, finite differences), and raises ``AssertionError`` with a message
that says what is wrong.  Beside it, the exercise declares its ``points``, and
whether its independent cases earn a share of them each (``partial``).

In a lesson, the exercise is two cells::

    def causal_gma_backward(dout, cache):          # the stub the student fills in
        raise NotImplementedError("exercise 4.1")

    check("4.1", causal_gma_backward)               # the check cell

Until the stub is filled in (it still raises ``NotImplementedError``, or a
value answer is still ``...``), the check cell prints that the exercise is not
done yet and the lesson runs on; a wrong answer raises ``AssertionError``.

Where ``refimpl`` (or SciPy, or another implementation in the project)
already computes what an exercise asks for, the exercise names that code in
``refuse``: whole modules or packages (every function in them, public or
private) or single functions.  While the check calls the answer, every call
into that code is refused by what runs, not by name: a profile function
(:func:`sys.setprofile`, and :func:`threading.setprofile` for the threads
the answer starts) sees each Python function the answer runs, however it
was bound (an alias, a default argument, a closure, ``getattr`` on a module,
a wrapper), and the first one whose code lies in the refused code fails the
answer with :class:`Refused`, naming it.  ``allow`` names the functions of
refused code that the answer may call all the same.  A kernel exercise
(``kernel=True``) also counts the launches of the answer's own
``numba.cuda`` kernels and fails an answer that launched none.

The autograder (``course_grader.py``) does not run the answer here: it runs
the checks in its own process and calls the answer in the submission's
process (``course_sandbox.py``), which refuses the same code there and
sends back only the answer's results; :func:`run` takes such a remote
answer (``answer.remote`` is true) as it is.

Worked solutions are in ``tutorials/solutions/lesson_NN.py``, out of sight of
the notebook.  ``tests/test_exercises.py`` runs every check against its
solution (it must pass), against the lesson's own stub (it must fail) and
against the wrong answers listed beside each solution (each must fail with an
``AssertionError``), so no check is unsolvable and none is vacuous.
"""

from __future__ import annotations

import _thread
import functools
import importlib
import importlib.util
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

LEVELS = {1: "warm-up", 2: "core", 3: "stretch"}


@dataclass(frozen=True)
class Exercise:
    """One exercise: its id ``"L.k"`` (lesson L, exercise k), a title, a level and the check.

    ``points`` is what the exercise is worth; ``partial`` says that each of its
    independent cases (the public check, each hidden case) earns a share of
    them.  ``refuse`` names the code the answer may not call (modules,
    packages or functions, as ``"package.module"`` or
    ``"package.module.name"``), ``allow`` the functions of it that it may
    call all the same; ``kernel`` says that the answer must launch a kernel of
    its own.
    """

    id: str
    title: str
    level: int
    run: Callable[[Any], None]
    refuse: tuple[str, ...] = ()
    kernel: bool = False
    points: float = 1.0
    partial: bool = False
    allow: tuple[str, ...] = ()

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])


EXERCISES: dict[str, Exercise] = {}


class NotAttempted(AssertionError):
    """The answer is still the stub: it raises ``NotImplementedError``, or is ``...``."""


class Refused(AssertionError):
    """The answer called code its exercise refuses, or launched no kernel of its own where one is asked for."""


# the packages whose kernels are the project's own, not an answer's: launching one does not answer a kernel exercise
PROJECT_PACKAGES = ("refimpl", "cpu", "gpu", "app")
# what a refusal names when an answer starts a thread outside threading (whose threads the refusal watches)
THREAD = "_thread.start_new_thread"
_THREAD_START = threading.Thread.start.__code__


def exercise(id: str, title: str, level: int, *, points: float, partial: bool = False, refuse: tuple[str, ...] = (),
             allow: tuple[str, ...] = (), kernel: bool = False) -> Callable:
    """Register the decorated function as the check of exercise ``id``.

    Parameters
    ----------
    id, title, level
        ``"L.k"``, a short title, and 1, 2 or 3 (:data:`LEVELS`).
    points : float
        What the exercise is worth in the gradebook (> 0).
    partial : bool
        Each independent case of the check (the public check, each hidden
        case of the grader) earns ``points`` divided by their number; without
        it the exercise earns its points only when every case passes.
    refuse : tuple of str
        The code the answer must not call: modules or packages
        (``"refimpl.scan"``: every function in them, public or private) or
        functions (``"scipy.special.logsumexp"``), the reference the check
        compares with and every implementation of it in the project.
    allow : tuple of str
        Functions inside refused code that the answer may call all the same.
    kernel : bool
        The answer must launch at least one ``numba.cuda`` kernel defined
        outside :data:`PROJECT_PACKAGES` (its own) each time it is called.
    """
    lesson, _, number = id.partition(".")
    if not (lesson.isdigit() and number.isdigit()):
        raise ValueError(f"an exercise id is 'L.k' with integers L and k, got {id!r}")
    if level not in LEVELS:
        raise ValueError(f"level is one of {sorted(LEVELS)}, got {level!r}")
    bad = [name for name in refuse + allow if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ValueError(f"exercise {id}: refuse names functions as 'package.module.name', got {bad}")
    if not (isinstance(points, (int, float)) and points > 0):
        raise ValueError(f"exercise {id}: points must be a number > 0, got {points!r}")

    def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
        if id in EXERCISES:
            raise ValueError(f"exercise {id} is registered twice")
        EXERCISES[id] = Exercise(id, title, level, run, tuple(refuse), kernel, float(points), bool(partial), tuple(allow))
        return run

    return register


def load(lesson: int) -> list[Exercise]:
    """Import ``_exercises_NN`` (registering its checks) and return lesson ``lesson``'s exercises in order."""
    importlib.import_module(f"_exercises_{lesson:02d}")
    found = [e for e in EXERCISES.values() if e.lesson == lesson]
    return sorted(found, key=lambda e: int(e.id.split(".")[1]))


def get(id: str) -> Exercise:
    """The exercise ``id``, importing its lesson's checks on first use."""
    if id not in EXERCISES:
        lesson = id.split(".")[0]
        if not lesson.isdigit():
            raise KeyError(f"no exercise {id!r}: ids look like '4.1'")
        load(int(lesson))
    if id not in EXERCISES:
        raise KeyError(f"no exercise {id!r} in lesson {id.split('.')[0]}")
    return EXERCISES[id]


@dataclass(frozen=True)
class Refusal:
    """The code an exercise refuses, as what runs: files, and functions by file and qualified name.

    ``files``: every code object compiled from these files (a refused module
    or package); ``functions``: ``(file, qualname)`` pairs, each refusing
    that function and every function nested in it (a refused function, or
    a class: its methods); ``allowed``: the same pairs for what ``allow``
    names, which wins.  ``modules`` maps each file to its module's name, for
    the messages.  Comparing file names, not function objects, refuses the
    code however it was bound: under another name, in a default argument or a
    closure, through ``getattr``, inside a wrapper, or rebuilt from its code
    object.
    """

    files: frozenset = frozenset()
    functions: frozenset = frozenset()
    allowed: frozenset = frozenset()
    modules: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.files or self.functions)

    def refuses(self, code) -> bool:
        """Whether running ``code`` (a code object) is a call into the refused code."""
        file = code.co_filename
        whole = file in self.files
        if not whole and not any(f == file for f, _ in self.functions):
            return False
        name = getattr(code, "co_qualname", code.co_name)
        hit = whole
        while True:
            if (file, name) in self.allowed:
                return False
            hit = hit or (file, name) in self.functions
            if "." not in name:
                return hit
            name = name.rsplit(".", 1)[0]

    def name(self, code) -> str:
        """``module.qualname`` of ``code``, for a message."""
        module = dict(self.modules).get(code.co_filename, Path(code.co_filename).stem)
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"

    def moved(self, old_root: str, new_root: str) -> Refusal:
        """The same refusal for a copy of the project: files under ``old_root`` read as under ``new_root``."""
        def move(file):
            return new_root + file[len(old_root):] if file.startswith(old_root + os.sep) else file

        return Refusal(frozenset(map(move, self.files)), frozenset((move(f), q) for f, q in self.functions),
                       frozenset((move(f), q) for f, q in self.allowed), tuple((move(f), m) for f, m in self.modules))


def _project_root() -> Path:
    """The folder that holds the project's packages (``refimpl``, ``cpu``, ``gpu``, ``app``), found without importing them."""
    found = importlib.util.find_spec("refimpl")
    return Path(found.origin).resolve().parent.parent


def _files_of(name: str) -> dict[str, str] | None:
    """``{file: module}`` of the module or package ``name``, or None where it is neither.

    The project's own are found in their folders, without importing them
    (``gpu.numba_cuda`` would import numba); others by importing them.
    """
    if name.split(".")[0] in PROJECT_PACKAGES:
        base = _project_root().joinpath(*name.split("."))
        if base.with_suffix(".py").is_file():
            return {str(base.with_suffix(".py")): name}
        if base.is_dir():
            return {str(p): ".".join(p.relative_to(_project_root()).with_suffix("").parts).removesuffix(".__init__")
                    for p in sorted(base.rglob("*.py"))}
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    folders = getattr(module, "__path__", None)
    if folders:
        return {str(p): name for folder in folders for p in sorted(Path(folder).rglob("*.py"))}
    return {str(module.__file__): name} if getattr(module, "__file__", None) else None


def _function_of(name: str) -> tuple[set, dict[str, str]]:
    """``({(file, qualname)}, {file: module})`` of the function or class ``"module.name"`` (and what it wraps)."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"refused name {name!r}: no module {module_name!r}") from err
    if not hasattr(module, attr):
        raise ValueError(f"refused name {name!r}: {module_name} has no attribute {attr!r}")
    obj, pairs, modules = getattr(module, attr), set(), {}
    while obj is not None:
        code = getattr(obj, "__code__", None)
        if code is not None:
            pairs.add((code.co_filename, getattr(code, "co_qualname", code.co_name)))
            modules[code.co_filename] = getattr(obj, "__module__", module_name)
        elif isinstance(obj, type) and getattr(sys.modules.get(obj.__module__), "__file__", None):
            file = sys.modules[obj.__module__].__file__
            pairs.add((file, obj.__qualname__))
            modules[file] = obj.__module__
        obj = getattr(obj, "__wrapped__", None)
    if not pairs:
        raise ValueError(f"refused name {name!r}: not a Python function, class, module or package")
    return pairs, modules


def _pairs(names: tuple[str, ...]) -> tuple[set, set, dict]:
    files, functions, modules = set(), set(), {}
    for name in names:
        found = _files_of(name)
        if found is not None:
            files.update(found)
            modules.update(found)
        else:
            pairs, where = _function_of(name)
            functions |= pairs
            modules.update(where)
    return files, functions, modules


@functools.cache
def refusal(id: str) -> Refusal:
    """What exercise ``id`` refuses, as a :class:`Refusal` (its ``refuse`` and ``allow``, resolved in this process)."""
    ex = get(id)
    files, functions, modules = _pairs(ex.refuse)
    _, allowed, more = _pairs(ex.allow)
    # both spellings of a file: the code's own (as imported) and the real path
    files |= {os.path.realpath(f) for f in files}
    functions |= {(os.path.realpath(f), q) for f, q in functions}
    allowed |= {(os.path.realpath(f), q) for f, q in allowed}
    modules.update(more)
    modules.update({os.path.realpath(f): m for f, m in list(modules.items())})
    return Refusal(frozenset(files), frozenset(functions), frozenset(allowed), tuple(sorted(modules.items())))


def _refusal_message(ex: Exercise, called: list[str]) -> str:
    return (f"exercise {ex.id}: your answer calls {', '.join(f'`{c}`' for c in called)}, which this exercise "
            f"refuses: the check compares your answer with it (or with what it is built on), so calling it "
            f"proves nothing. Refused here: {', '.join(ex.refuse)}. Write the computation yourself.")


def _no_kernel_message(ex: Exercise) -> str:
    return (f"exercise {ex.id}: your function launched no kernel of its own (a `@cuda.jit` function called as "
            f"`kernel[blocks, threads](...)`), so it is not the kernel the exercise asks for, even where its "
            f"result is right: NumPy on the host, or the project's own kernels in `gpu`, do not count.")


@contextmanager
def watching(ex: Exercise, called: list[str]):
    """While the block runs, a call into the code ``ex`` refuses raises :class:`Refused` (and is recorded in ``called``).

    A profile function on this thread, and on every thread started with
    :mod:`threading` meanwhile, looks at each Python function as it starts:
    one whose code the exercise refuses (:func:`refusal`) raises before it
    computes anything, and so does a thread started around :mod:`threading`
    (``_thread.start_new_thread``), which no profile function would watch.  Raising stops Python's profiling of that thread, so
    the caller judges by ``called``, which keeps every refused call.
    """
    rules = refusal(ex.id)
    if not rules:
        yield
        return

    def profile(frame, event, arg):
        if event == "call" and rules.refuses(frame.f_code):
            name = rules.name(frame.f_code)
        elif event == "c_call" and arg is _thread.start_new_thread and frame.f_code is not _THREAD_START:
            name = THREAD  # a thread no profile function would watch
        else:
            return
        called.append(name)
        raise Refused(_refusal_message(ex, [name]))

    before, before_threads = sys.getprofile(), threading.getprofile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(before)
        threading.setprofile(before_threads)


def _launch_class():
    """The class whose call launches a numba.cuda kernel, its launch method's name, and how to read its Python function."""
    import numba

    if numba.config.ENABLE_CUDASIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        return FakeCUDAKernel, "__call__", lambda k: k.fn, lambda k: not k._device
    from numba.cuda.dispatcher import CUDADispatcher

    return CUDADispatcher, "call", lambda k: k.py_func, lambda k: True


def _is_own(fn) -> bool:
    return getattr(fn, "__module__", "").split(".")[0] not in PROJECT_PACKAGES


@contextmanager
def counted_launches(counts: list[str]):
    """While the block runs, append to ``counts`` the name of every kernel launched that is not the project's own."""
    cls, method, py_func, is_launch = _launch_class()
    original = cls.__dict__[method]

    @functools.wraps(original)
    def counting(self, *args, **kwargs):
        if is_launch(self) and _is_own(py_func(self)):
            counts.append(getattr(py_func(self), "__name__", "?"))
        return original(self, *args, **kwargs)

    setattr(cls, method, counting)
    try:
        yield
    finally:
        setattr(cls, method, original)


def guarded(ex: Exercise, answer: Any) -> Any:
    """``answer`` as its check calls it: calls into the refused code raising, and its kernel launches counted.

    A value answer (not callable) and an exercise with neither ``refuse`` nor
    ``kernel`` get ``answer`` itself.  A refused call fails the answer with
    :class:`Refused` even where the answer caught the error it raised.
    """
    if not callable(answer) or not (ex.refuse or ex.kernel):
        return answer

    @functools.wraps(answer)
    def call(*args, **kwargs):
        launches: list[str] = []
        called: list[str] = []
        try:
            with watching(ex, called):
                if ex.kernel:
                    with counted_launches(launches):
                        out = answer(*args, **kwargs)
                else:
                    out = answer(*args, **kwargs)
        except BaseException as err:
            if called and not isinstance(err, Refused):  # the answer caught the refusal and failed otherwise
                raise Refused(_refusal_message(ex, sorted(set(called)))) from err
            raise
        if called:  # the answer caught the refusal and went on
            raise Refused(_refusal_message(ex, sorted(set(called))))
        if ex.kernel and not launches:
            raise Refused(_no_kernel_message(ex))
        return out

    return call


def run(id: str, answer: Any, check: Callable[[Any], None] | None = None) -> None:
    """Run exercise ``id``'s check (or ``check``, another case of it) on ``answer``; raise :class:`NotAttempted` if it is still the stub.

    The answer is called through :func:`guarded`: calls into the code the
    exercise refuses raise while it runs, and a kernel exercise counts its
    launches.  A remote answer (``answer.remote``: the grader's handle on a
    function that runs in the submission's own process) is refused there, and
    its ``refused`` lists what it called of the refused code.

    Raises
    ------
    NotAttempted
        ``answer`` is ``...``, or calling it raised ``NotImplementedError``.
    Refused
        ``answer`` called refused code, or launched no kernel of its own.
    AssertionError
        ``answer`` is wrong; the message says how.
    """
    ex = get(id)
    if answer is Ellipsis:
        raise NotAttempted(f"exercise {id}: the answer is still `...`")
    remote = getattr(answer, "remote", False) is True
    try:
        (check or ex.run)(answer if remote else guarded(ex, answer))
    except NotImplementedError as err:
        raise NotAttempted(f"exercise {id}: the stub still raises NotImplementedError") from err
    except BaseException as err:
        if remote and answer.refused and not isinstance(err, Refused):
            raise Refused(_refusal_message(ex, sorted(set(answer.refused)))) from err
        raise
    if remote and answer.refused:
        raise Refused(_refusal_message(ex, sorted(set(answer.refused))))


def check(id: str, answer: Any) -> bool:
    """The check cell of exercise ``id``: True when ``answer`` passes, False while it is still the stub.

    A wrong answer raises ``AssertionError`` with what is wrong, so that the
    cell shows it in red; a stub prints that the exercise is not done yet and
    lets the lesson run on.
    """
    ex = get(id)
    try:
        run(id, answer)
    except NotAttempted:
        print(f"Exercise {id} ({ex.title}): not done yet. Write your answer in the cell above, "
              "run it, then run this cell again.")
        return False
    print(f"Exercise {id} ({ex.title}): correct.")
    return True
