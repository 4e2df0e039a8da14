"""The copies of the course and the kernel that executes a lesson: what ``course.py`` and ``course_grader.py`` share.

* :func:`build`: a copy of the course (the lessons, the documentation pages
  they cite, ``refimpl``, ``cpu``, ``gpu``, ``app`` and the files that install
  them), the student's without ``tutorials/solutions/``; ``python
  tutorials/course.py build-student OUT [--force]`` and the grader's student
  build;
* :func:`execute`: a notebook executed in a fresh kernel of this very
  Python (:func:`this_interpreter_kernel`, never a kernel installed on disk),
  as ``course.py measure`` and the lesson tests run it; the grader starts the
  kernels of the submissions with the same :func:`this_interpreter_kernel`.

The course's commands live in ``course.py`` (which passes ``grade`` and
``sample-class`` on to ``course_grader.py``); both import this module, and it
imports neither.
"""

from __future__ import annotations

import re
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
# the file every build writes at its top: --force replaces only a folder that holds it (or nothing)
MARKER = ".course-build"
# the documentation pages the lessons cite (``docs/name.md``) and, from them, every page they link to
CITED = re.compile(r"docs/[\w./-]+\.md")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
# the line of docs/floating_point.md where the documentation build includes the fragments docs/_fp/*.md
FP_MARKER = "% floating-point fragments: conf.py includes docs/_fp/*.md here"


def fp_fragments(docs: Path) -> list[str]:
    """The floating-point appendix's fragments in course order: the lessons' (``NN.md``), then the derivation pages'."""
    frags = sorted(p.name for p in (Path(docs) / "_fp").glob("*.md"))
    return [f for f in frags if f[:2].isdigit()] + [f for f in frags if not f[:2].isdigit()]


def links(page: Path) -> list[str]:
    """The Markdown pages ``page`` links to, as written (relative to its folder, anchors dropped).

    The floating-point appendix links to what its fragments (``docs/_fp/``,
    written into it) link to.
    """
    text = Path(page).read_text(encoding="utf-8")
    if FP_MARKER in text:
        text += "".join((Path(page).parent / "_fp" / f).read_text(encoding="utf-8") for f in fp_fragments(Path(page).parent))
    return LINK.findall(text)


def cited_pages(root: Path = HERE.parent) -> list[Path]:
    """The documentation pages the lessons cite, and every page those link to, as paths under ``root/docs``."""
    docs = (root / "docs").resolve()
    todo = sorted({root / m for script in (root / "tutorials").glob("[0-9][0-9]_*.py")
                   for m in CITED.findall(script.read_text(encoding="utf-8"))})
    found: set[Path] = set()
    while todo:
        page = todo.pop().resolve()
        if page in found or not page.is_file() or docs not in page.parents:
            continue
        found.add(page)
        todo += [page.parent / link for link in links(page)]
    return sorted(found)


def _copy_docs(root: Path, out: Path) -> None:
    """The cited pages into ``out/docs`` as plain Markdown, the appendix with its fragments written in."""
    docs = root / "docs"
    for page in cited_pages(root):
        target = out / "docs" / page.relative_to(docs.resolve())
        target.parent.mkdir(parents=True, exist_ok=True)
        text = page.read_text(encoding="utf-8")
        if FP_MARKER in text:
            text = text.replace(FP_MARKER, "\n".join((docs / "_fp" / f).read_text(encoding="utf-8")
                                                     for f in fp_fragments(docs)))
        target.write_text(text, encoding="utf-8")


def _clear(out: Path, force: bool) -> None:
    """Make ``out`` an empty folder: a new one, an empty one, or with ``force`` one an earlier build wrote."""
    import shutil

    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise SystemExit(f"{out} exists and is not empty: give a new folder\n"
                         f"(or --force, make ... FORCE=1, to replace a build made there before)")
    root = HERE.parent.resolve()
    if out.resolve() == root or out.resolve() in root.parents or not (out / MARKER).is_file():
        raise SystemExit(f"{out} holds files that no build of the course wrote (no {MARKER}): --force replaces "
                         "only an earlier build; give a new folder")
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def build(out: Path, student: bool = True, force: bool = False) -> Path:
    """Copy the course (the lessons, the pages they cite, the packages and the files that install them) into ``out``.

    ``student=True``: without ``tutorials/solutions/`` (the worked solutions,
    the near misses, the grader's hidden cases and the answer keys), so the
    copy can be handed out; the checks of ``tutorials/_exercises_NN.py`` work
    in it as in the checkout.  ``student=False``: the instructor's copy, all
    of it.  ``out`` must not exist yet, or be empty, or, with ``force``, hold
    an earlier build (its :data:`MARKER` file), which is replaced.
    """
    import shutil

    out = Path(out)
    _clear(out, force)
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
    _copy_docs(root, out)
    (out / MARKER).write_text("a copy of the course made by tutorials/course.py build-"
                              + ("student" if student else "instructor") + "\n", encoding="utf-8")
    return out
