"""The lessons' exercises: a registry of checks, and the ``check`` that a lesson's check cell calls.

Every exercise of lesson ``NN`` is a function in ``tutorials/_exercises_NN.py``
registered with :func:`exercise`.  It receives the student's answer (a
function, or a value) and ``assert``s on it: it builds its own inputs, calls
the answer and compares with an independent result (``refimpl``, a dense
formula, finite differences), and raises ``AssertionError`` with a message
that says what is wrong.

In a lesson, the exercise is two cells::

    def causal_gma_backward(dout, cache):          # the stub the student fills in
        raise NotImplementedError("exercise 4.1")

    check("4.1", causal_gma_backward)               # the check cell

Until the stub is filled in (it still raises ``NotImplementedError``, or a
value answer is still ``...``), the check cell prints that the exercise is not
done yet and the lesson runs on; a wrong answer raises ``AssertionError``.

Where ``refimpl`` (or SciPy) already has the function an exercise asks for,
the exercise names it in ``refuse``: while the check calls the answer, those
functions, and every module attribute bound to them, raise, so an answer that
calls the reference it is compared with fails with :class:`Refused`.  A kernel
exercise (``kernel=True``) also counts the launches of the answer's own
``numba.cuda`` kernels and fails an answer that launched none.

Worked solutions are in ``tutorials/solutions/lesson_NN.py``, out of sight of
the notebook.  ``tests/test_exercises.py`` runs every check against its
solution (it must pass), against the lesson's own stub (it must fail) and
against the wrong answers listed beside each solution (each must fail with an
``AssertionError``), so no check is unsolvable and none is vacuous.
"""

from __future__ import annotations

import functools
import importlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

LEVELS = {1: "warm-up", 2: "core", 3: "stretch"}


@dataclass(frozen=True)
class Exercise:
    """One exercise: its id ``"L.k"`` (lesson L, exercise k), a title, a level and the check.

    ``refuse`` names the functions (``"package.module.name"``) the answer may
    not call; ``kernel`` says that the answer must launch a kernel of its own.
    """

    id: str
    title: str
    level: int
    run: Callable[[Any], None]
    refuse: tuple[str, ...] = ()
    kernel: bool = False

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])


EXERCISES: dict[str, Exercise] = {}


class NotAttempted(AssertionError):
    """The answer is still the stub: it raises ``NotImplementedError``, or is ``...``."""


class Refused(AssertionError):
    """The answer called a function its exercise refuses, or launched no kernel of its own where one is asked for."""


# the packages whose kernels are the project's own, not an answer's: launching one does not answer a kernel exercise
PROJECT_PACKAGES = ("refimpl", "cpu", "gpu")


def exercise(id: str, title: str, level: int, *, refuse: tuple[str, ...] = (), kernel: bool = False) -> Callable:
    """Register the decorated function as the check of exercise ``id``.

    Parameters
    ----------
    id, title, level
        ``"L.k"``, a short title, and 1, 2 or 3 (:data:`LEVELS`).
    refuse : tuple of str
        Functions, as ``"package.module.name"``, that the answer must not call:
        the reference the check compares with, and what it is built on.
    kernel : bool
        The answer must launch at least one ``numba.cuda`` kernel defined
        outside :data:`PROJECT_PACKAGES` (its own) each time it is called.
    """
    lesson, _, number = id.partition(".")
    if not (lesson.isdigit() and number.isdigit()):
        raise ValueError(f"an exercise id is 'L.k' with integers L and k, got {id!r}")
    if level not in LEVELS:
        raise ValueError(f"level is one of {sorted(LEVELS)}, got {level!r}")
    bad = [name for name in refuse if name.count(".") < 1]
    if bad:
        raise ValueError(f"exercise {id}: refuse names functions as 'package.module.name', got {bad}")

    def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
        if id in EXERCISES:
            raise ValueError(f"exercise {id} is registered twice")
        EXERCISES[id] = Exercise(id, title, level, run, tuple(refuse), kernel)
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


def _resolve(name: str):
    """The module and attribute of ``"package.module.name"``; None where the module is not installed."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    if not hasattr(module, attr):
        raise ValueError(f"refused name {name!r}: {module_name} has no attribute {attr!r}")
    return module, attr


def _bindings(refuse: tuple[str, ...], answer: Any) -> list[tuple[dict, str, Any, str]]:
    """Every place a refused function is bound: (namespace, key, the function, its refused name).

    Its own module, every loaded module of the same top-level package that
    imported it under any name, and the globals of the answer (a notebook's
    ``from scipy.special import logsumexp``).  It reads every loaded module of
    those packages: :class:`_Bindings` keeps the result for the calls of one
    check.
    """
    targets: dict[int, tuple[Any, str]] = {}
    for name in refuse:
        found = _resolve(name)
        if found is not None:
            obj = getattr(*found)
            targets[id(obj)] = (obj, name)
    if not targets:
        return []
    tops = {name.split(".")[0] for name in refuse}
    namespaces = [vars(m) for key, m in list(sys.modules.items())
                  if m is not None and key.split(".")[0] in tops]
    for fn in (answer, getattr(answer, "__call__", None)):
        g = getattr(fn, "__globals__", None)
        if isinstance(g, dict):
            namespaces.append(g)
    out, seen = [], set()
    for ns in namespaces:
        if id(ns) in seen:
            continue
        seen.add(id(ns))
        for key, value in list(ns.items()):
            hit = targets.get(id(value))
            if hit is not None and hit[0] is value:
                out.append((ns, key, value, hit[1]))
    return out


def _refusal_message(ex: Exercise, called: list[str]) -> str:
    return (f"exercise {ex.id}: your answer calls {', '.join(f'`{c}`' for c in called)}, which this exercise "
            f"refuses: the check compares your answer with it (or with what it is built on), so calling it "
            f"proves nothing. Refused here: {', '.join(ex.refuse)}. Write the computation yourself.")


class _Bindings:
    """:func:`_bindings` of one answer, found again only when a module was imported since the last time.

    A check calls the answer many times (thousands, for a table of integer
    cases); reading every loaded module at each call would cost more than the
    answer.  A new binding of a refused function can only come from an import
    (a new module in ``sys.modules``), or from the answer assigning one into a
    module, which the scan of the answer's own globals also catches when that
    is where it assigns.  Stale entries are dropped: a namespace whose key no
    longer holds the function is not patched.
    """

    def __init__(self, refuse: tuple[str, ...], answer: Any):
        self.refuse, self.answer = refuse, answer
        self.modules = -1
        self.found: list[tuple[dict, str, Any, str]] = []

    def __call__(self) -> list[tuple[dict, str, Any, str]]:
        if len(sys.modules) != self.modules:
            self.modules = len(sys.modules)
            self.found = _bindings(self.refuse, self.answer)
        return [b for b in self.found if b[0].get(b[1]) is b[2]]


@contextmanager
def refused(ex: Exercise, answer: Any, bindings: _Bindings | None = None):
    """While the block runs, every function ``ex`` refuses raises :class:`Refused` (and the call is recorded).

    Raises :class:`Refused` at the end of the block if a refused function was
    called, even when the answer caught the first error.  ``bindings`` (one
    per check) spares the search for the refused functions at every call.
    """
    bindings = (bindings or _Bindings(ex.refuse, answer))()
    called: list[str] = []

    def raiser_for(name):
        def refuse_call(*args, **kwargs):
            called.append(name)
            raise Refused(_refusal_message(ex, [name]))

        return refuse_call

    raisers = {name: raiser_for(name) for name in ex.refuse}
    for ns, key, _, name in bindings:
        ns[key] = raisers[name]
    try:
        yield
    except BaseException as err:
        if called and not isinstance(err, Refused):  # the answer caught the refusal and failed otherwise
            raise Refused(_refusal_message(ex, sorted(set(called)))) from err
        raise
    finally:
        for ns, key, value, _ in bindings:
            ns[key] = value
    if called:  # the answer caught the refusal and went on
        raise Refused(_refusal_message(ex, sorted(set(called))))


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
    """``answer`` as its check calls it: with the refused functions raising, and its kernel launches counted.

    A value answer (not callable) and an exercise with neither ``refuse`` nor
    ``kernel`` get ``answer`` itself.
    """
    if not callable(answer) or not (ex.refuse or ex.kernel):
        return answer

    bindings = _Bindings(ex.refuse, answer)

    @functools.wraps(answer)
    def call(*args, **kwargs):
        launches: list[str] = []
        with refused(ex, answer, bindings):
            if ex.kernel:
                with counted_launches(launches):
                    out = answer(*args, **kwargs)
            else:
                out = answer(*args, **kwargs)
        if ex.kernel and not launches:
            raise Refused(
                f"exercise {ex.id}: your function launched no kernel of its own (a `@cuda.jit` function called as "
                f"`kernel[blocks, threads](...)`), so it is not the kernel the exercise asks for, even where its "
                f"result is right: NumPy on the host, or the project's own kernels in `gpu`, do not count.")
        return out

    return call


def run(id: str, answer: Any, check: Callable[[Any], None] | None = None) -> None:
    """Run exercise ``id``'s check (or ``check``, another case of it) on ``answer``; raise :class:`NotAttempted` if it is still the stub.

    The answer is called through :func:`guarded`: the functions the exercise
    refuses raise while it runs, and a kernel exercise counts its launches.

    Raises
    ------
    NotAttempted
        ``answer`` is ``...``, or calling it raised ``NotImplementedError``.
    Refused
        ``answer`` called a refused function, or launched no kernel of its own.
    AssertionError
        ``answer`` is wrong; the message says how.
    """
    ex = get(id)
    if answer is Ellipsis:
        raise NotAttempted(f"exercise {id}: the answer is still `...`")
    try:
        (check or ex.run)(guarded(ex, answer))
    except NotImplementedError as err:
        raise NotAttempted(f"exercise {id}: the stub still raises NotImplementedError") from err


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
