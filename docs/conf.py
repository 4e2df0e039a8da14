"""Sphinx configuration: MyST-NB renders the tutorials, autodoc the API, MathJax the math.

Three things are generated at every build, so that adding a lesson, a module or
a performance page needs no edit here:

* ``docs/tutorials/``: copies of ``tutorials/NN_name.ipynb`` (Sphinx reads only
  files under its source folder); ignored by git (``docs/.gitignore``);
* ``docs/api/generated/``: one autodoc page per public module of ``refimpl``,
  ``cpu``, ``gpu`` and ``app``, found with ``pkgutil``, and a table of the verifications that
  ``python -m refimpl verify`` runs; ignored by git;
* the "Performance" and "Experiments" toctrees of ``index.md``: every
  ``docs/performance_*.md`` and ``docs/experiment_*.md``,
  and no toctree at all while there is none (an empty glob would warn).

Notebooks are executed during the build (``nb_execution_mode = "force"``), in
their folder, by the kernel of the Python that runs Sphinx, at full size unless
``TUTORIAL_SMALL=1`` is set.  ``make docs`` builds this way;
``make docs-check`` (part of ``make test``) passes ``-D nb_execution_mode=off``
because the test suite has already executed every notebook: it saved each one,
with its outputs, in ``docs/_build/executed/``, and the build shows those
outputs for every lesson whose cells have not changed since (the clean
notebook otherwise).

Also written at every build: the course page's tables and the dependency graph
of the lessons (``tutorials/course.py``, drawn into ``docs/_build/generated/``),
the floating-point appendix from its fragments ``docs/_fp/*.md``, and on each
lesson page a box with a download link for its notebook and its measured run
time.  MathJax is served from the build (``sphinx-mathjax-offline``), so the
site renders its math without a network.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tutorials"))  # tutorials/course.py
# kernels that execute the notebooks import the checkout's packages as well
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# in a virtual environment, its own kernelspec wins over one in ~/.local
os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")

import course  # noqa: E402  (tutorials/course.py)
import nbformat  # noqa: E402
import refimpl  # noqa: E402  (after the path set-up above)

project = "gmattn-reference"
author = "the gmattn-reference authors"
copyright = "the gmattn-reference authors, MIT licence"
release = version = refimpl.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
# _fp/: the fragments of floating_point.md, included by it and not pages of their own
exclude_patterns = ["_build", "**/.ipynb_checkpoints", ".gitignore", "_fp"]
root_doc = "index"
html_theme = "furo"
html_title = f"gmattn-reference {release}"

# --- MathJax from the build, not from a CDN: the math renders offline ----------
# sphinx-mathjax-offline bundles MathJax 3 (its static/mathjax/ folder); html_static_path copies that folder
# to _static/mathjax/ and mathjax_path, relative to _static/, points there
MATHJAX_BUNDLE = Path(importlib.util.find_spec("sphinx-mathjax-offline").origin).parent / "static"
html_static_path = [str(MATHJAX_BUNDLE), "_static"]
html_css_files = ["course.css"]
mathjax_path = "mathjax/tex-chtml.js"

# --- MyST and MyST-NB ------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "force"  # every build runs every notebook: outputs are never stale
nb_execution_timeout = 600  # seconds per cell
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# --- autodoc: numpydoc-style docstrings, rst math ----------------------------
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# optional GPU back ends are not needed to read their docstrings; add others here if a gpu module needs them
autodoc_mock_imports = ["cupy", "cupyx"]
# napoleon turns every word of a parameter's type ("shape (B, N, d_model)") into a cross-reference; a word that
# names an attribute of two classes (ModelConfig.d_model, TrainConfig.d_model) is ambiguous, and is no reference
suppress_warnings = ["ref.python"]

DOCUMENTED_PACKAGES = ("refimpl", "cpu", "gpu", "app")
SKIPPED_SUBPACKAGES = {"refimpl.checks"}  # listed by the verification table instead


# --- generated sources -------------------------------------------------------
def _write_if_changed(path: Path, text: str) -> None:
    """Write only when the content differs, so unchanged pages are not rebuilt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _mirror(wanted: dict[str, bytes | str], folder: Path) -> None:
    """Make ``folder`` hold exactly the files in ``wanted`` (name -> content)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.iterdir():
        if stale.is_file() and stale.name not in wanted:
            stale.unlink()
    for name, content in wanted.items():
        path = folder / name
        if isinstance(content, str):
            _write_if_changed(path, content)
        elif not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)


EXECUTED = DOCS / "_build" / "executed"  # tests/test_tutorials.py saves each executed notebook here
GENERATED = DOCS / "_build" / "generated"


def _cell_sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def _executed_copy(notebook: Path) -> bytes | None:
    """The notebook as the test suite last executed it, if its cells are still the lesson's own."""
    saved = EXECUTED / notebook.name
    if not saved.exists():
        return None
    fresh = nbformat.read(notebook, as_version=4)
    ran = nbformat.read(saved, as_version=4)
    return saved.read_bytes() if _cell_sources(fresh) == _cell_sources(ran) else None


def _copy_tutorials(use_executed: bool) -> None:
    """Copy the lessons (and any ``tutorials/_*.py`` helper they import) into ``docs/tutorials/``.

    With ``use_executed`` (no execution during this build), a lesson that the
    test suite has executed since its last edit is copied with its outputs.
    """
    src = ROOT / "tutorials"
    notebooks = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise RuntimeError(f"no lesson notebooks tutorials/NN_name.ipynb found in {src}")
    helpers = sorted(src.glob("_*.py"))
    wanted = {p.name: p.read_bytes() for p in helpers}
    for p in notebooks:
        wanted[p.name] = (use_executed and _executed_copy(p)) or p.read_bytes()
    _mirror(wanted, DOCS / "tutorials")


def _public_modules() -> list[str]:
    names = []
    for package in DOCUMENTED_PACKAGES:
        pkg = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
            parts = info.name.split(".")
            if any(p.startswith("_") for p in parts[1:]):
                continue  # private modules and __main__
            if any(info.name == s or info.name.startswith(s + ".") for s in SKIPPED_SUBPACKAGES):
                continue
            names.append(info.name)
    return names


def _reexports_only(module: str) -> bool:
    """A package whose public names are all defined in its submodules (documented on their own pages)."""
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", [])
    return hasattr(mod, "__path__") and bool(names) and all(
        getattr(getattr(mod, n), "__module__", module) != module for n in names
    )


def _api_page(module: str) -> str:
    title = f"``{module}``"
    # a package that only re-exports would document each function twice (once here, once on its module's page)
    options = "   :no-members:\n" if _reexports_only(module) else ""
    return f"{title}\n{'=' * len(title)}\n\n.. automodule:: {module}\n{options}"


def _verification_page() -> str:
    from refimpl.verify import registry

    rows = [
        "Verifications",
        "=============",
        "",
        "Every numerical verification registered in :mod:`refimpl.checks`: ``python -m refimpl verify``",
        "runs them all and prints the measured error of each next to its tolerance",
        "(``-k PATTERN`` selects some, ``--list`` lists them).",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 30 55 15",
        "",
        "   * - check",
        "     - what it verifies",
        "     - tolerance",
    ]
    for name, check in registry().items():
        description = re.sub(r"([\\*`|_])", r"\\\1", check.description)  # plain text, no rst markup
        rows += [f"   * - ``{name}``", f"     - {description}", f"     - {check.tol:.0e}"]
    return "\n".join(rows) + "\n"


def _generate_api_pages() -> None:
    pages = {f"{m}.rst": _api_page(m) for m in _public_modules()}
    pages["verifications.rst"] = _verification_page()
    _mirror(pages, DOCS / "api" / "generated")


PERFORMANCE_MARKER = "% performance pages: conf.py puts a toctree here"
EXPERIMENT_MARKER = "% experiment pages: conf.py puts a toctree here"


def _toctree(pattern, caption):
    pages = sorted(p.stem for p in DOCS.glob(pattern))
    return "```{toctree}\n:maxdepth: 1\n:caption: " + caption + "\n\n" + "\n".join(pages) + "\n```\n" if pages else ""


def _performance_toctree(app, docname, source):
    if docname != root_doc:
        return
    source[0] = source[0].replace(PERFORMANCE_MARKER, _toctree("performance_*.md", "Performance"))
    source[0] = source[0].replace(EXPERIMENT_MARKER, _toctree("experiment_*.md", "Experiments"))


def _always_reread_index(app, env, added, changed, removed):
    # generated content depends on files Sphinx does not track (the pages that exist, run_times.json, _fp/)
    return [d for d in (root_doc, "course", "floating_point") if d in env.found_docs]


COURSE_MARKER = "% course tables: conf.py puts them here"
FP_MARKER = course.FP_MARKER


def _fp_fragments() -> list[str]:
    """The appendix's fragments in course order (the student build writes them in the same order)."""
    return course.fp_fragments(DOCS)


def _course_page() -> str:
    graph = course.draw_graph(GENERATED / "lesson_graph.svg")
    return "\n".join([
        "## The lessons",
        "",
        course.table(),
        "",
        course.measured_on(),
        "",
        "## Which lesson needs which",
        "",
        "An arrow from one lesson to another: read the first before the second. Orders that follow through "
        "another lesson are not drawn (2 before 4, since 2 comes before 3 and 3 before 4); the table above "
        "lists every lesson each one builds on.",
        "",
        f"```{{image}} {os.path.relpath(graph, DOCS)}",
        ":alt: the dependency graph of the lessons",
        ":width: 100%",
        "```",
        "",
        "## What each lesson teaches",
        "",
        course.objectives_markdown("###"),
    ])


def _lesson_box(docname: str) -> str | None:
    """The box at the top of a lesson page: download the notebook, and its measured run time."""
    m = re.fullmatch(r"tutorials/(\d\d)_\w+", docname)
    if not m:
        return None
    name = docname.split("/")[1]
    lesson = int(m.group(1))
    return (
        ":::{admonition} Run this lesson yourself\n:class: tip lesson-box\n\n"
        f"{{download}}`Download the notebook <{name}.ipynb>` and open it in JupyterLab (`make lab` in a "
        f"checkout). Run time: {course.run_time_line(lesson)}. Notation: [the glossary](../glossary.md).\n:::\n"
    )


def _generated_sources(app, docname, source):
    """Fill the markers of index.md, course.md and floating_point.md, and put the box on each lesson page."""
    if docname == root_doc:
        _performance_toctree(app, docname, source)
    elif docname == "course":
        source[0] = source[0].replace(COURSE_MARKER, _course_page())
    elif docname == "floating_point":
        includes = "\n".join(f"```{{include}} _fp/{f}\n```\n" for f in _fp_fragments())
        source[0] = source[0].replace(FP_MARKER, includes)
    box = _lesson_box(docname)
    if box is not None:
        # right under the lesson's title, the first line of its first cell
        nb = json.loads(source[0])
        first = nb["cells"][0]
        text = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
        title, _, rest = text.partition("\n")
        if not title.startswith("# "):
            raise ValueError(f"{docname}: the first cell does not open with the lesson's title")
        first["source"] = f"{title}\n\n{box}\n{rest}"
        source[0] = json.dumps(nb)


def _config_inited(app, config):
    _copy_tutorials(use_executed=config.nb_execution_mode == "off")


_generate_api_pages()


def setup(app):
    app.connect("config-inited", _config_inited)
    app.connect("source-read", _generated_sources)
    app.connect("env-get-outdated", _always_reread_index)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
