"""The copies of the course and the kernel that executes a lesson: what ``course.py`` and ``course_grader.py`` share.

* :func:`build`: a copy of the course (the lessons, ``refimpl``, ``cpu``,
  ``gpu``, ``app`` and the files that install them), the student's without
  ``tutorials/solutions/``; ``python tutorials/course.py build-student OUT``
  and the grader's student build;
* :func:`execute`: a notebook executed in a fresh kernel of this very
  Python (:func:`this_interpreter_kernel`, never a kernel installed on disk),
  as ``course.py measure`` and the lesson tests run it; the grader starts the
  kernels of the submissions with the same :func:`this_interpreter_kernel`.

The course's commands live in ``course.py`` (which passes ``grade`` and
``sample-class`` on to ``course_grader.py``); both import this module, and it
imports neither.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def execute(nb, timeout_func) -> None:
    """Execute the notebook ``nb`` in place, in ``tutorials/``, in a fresh kernel of this very Python.

    The kernel is ipykernel's built-in ``python3``, whose command jupyter_client
    runs with ``sys.executable``; kernelspecs on disk (``~/.local/share/jupyter``,
    other environments) are never used.  ``timeout_func(cell)`` gives each
    cell's limit in seconds.  The kernel inherits this process's environment
    (``TUTORIAL_SMALL``, ``PYTHONPATH``): callers set it.
    """
    from nbclient import NotebookClient

    NotebookClient(nb, kernel_name="python3", kernel_manager_class=this_interpreter_kernel(), timeout_func=timeout_func,
                   startup_timeout=120, resources={"metadata": {"path": str(HERE)}}).execute()


def this_interpreter_kernel():
    """A ``KernelManager`` class that starts ipykernel's built-in ``python3`` with this Python, never a kernel installed on disk."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from traitlets import default

    class ThisInterpreterKernel(KernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self):
            return KernelSpecManager(kernel_dirs=[])  # no kernel directories: only the built-in kernel

    return ThisInterpreterKernel


# what a copy of the course holds: the lessons and the packages they import, and how to install them
COURSE_FILES = ("README.md", "pyproject.toml", "Makefile", "environment.yml", "constraints/cuda13.txt",
                "constraints/cuda12.txt")
COURSE_PACKAGES = ("refimpl", "cpu", "gpu", "app", "tutorials")
NEVER_COPIED = ("__pycache__", "*.pyc", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis")
# the answers: worked solutions, near misses, hidden cases of the grader (solutions/hidden_NN.py), answer keys
# (solutions/keys/); a student build leaves out the whole folder
ANSWERS = "solutions"


def build(out: Path, student: bool = True) -> Path:
    """Copy the course (the lessons, ``refimpl``, ``cpu``, ``gpu``, ``app`` and the files that install them) into ``out``.

    ``student=True``: without ``tutorials/solutions/`` (the worked solutions,
    the near misses, the grader's hidden cases and the answer keys), so the
    copy can be handed out; the checks of ``tutorials/_exercises_NN.py`` work
    in it as in the checkout.  ``student=False``: the instructor's copy, all
    of it.  ``out`` must not exist yet, or be empty.
    """
    import shutil

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    root = HERE.parent
    for name in COURSE_FILES:
        if (root / name).exists():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, out / name)
    for name in COURSE_PACKAGES:
        ignore = shutil.ignore_patterns(*NEVER_COPIED)
        if student and name == "tutorials":
            def ignore(folder, names, base=ignore):
                skipped = set(base(folder, names))
                return skipped | ({ANSWERS} if Path(folder).resolve() == HERE else set())
        shutil.copytree(root / name, out / name, ignore=ignore)
    return out
