"""Sphinx configuration: MyST-NB renders the tutorials, autodoc the API, MathJax the math.

Three things are generated at every build, so that adding a lesson, a module or
a performance page needs no edit here:

* ``docs/tutorials/``: copies of ``tutorials/NN_name.ipynb`` (Sphinx reads only
  files under its source folder); ignored by git (``docs/.gitignore``);
* ``docs/api/generated/``: one autodoc page per public module of ``refimpl``
  and ``gpu``, found with ``pkgutil``, and a table of the verifications that
  ``python -m refimpl verify`` runs; ignored by git;
* the "Performance" and "Experiments" toctrees of ``index.md``: every
  ``docs/performance_*.md`` and ``docs/experiment_*.md``,
  and no toctree at all while there is none (an empty glob would warn).

Notebooks are executed during the build (``nb_execution_mode = "force"``), in
their folder, by the kernel of the Python that runs Sphinx, at full size unless
``TUTORIAL_SMALL=1`` is set.  ``make docs`` builds this way;
``make docs-check`` (part of ``make test``) passes ``-D nb_execution_mode=off``
because the test suite has already executed every notebook.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
# kernels that execute the notebooks import the checkout's packages as well
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# in a virtual environment, its own kernelspec wins over one in ~/.local
os.environ.setdefault("JUPYTER_PREFER_ENV_PATH", "1")

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
exclude_patterns = ["_build", "**/.ipynb_checkpoints", ".gitignore"]
root_doc = "index"
html_theme = "furo"
html_title = f"gmattn-reference {release}"

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

DOCUMENTED_PACKAGES = ("refimpl", "gpu")
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


def _copy_tutorials() -> None:
    """Copy the lessons (and any ``tutorials/_*.py`` helper they import) into ``docs/tutorials/``."""
    src = ROOT / "tutorials"
    notebooks = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise RuntimeError(f"no lesson notebooks tutorials/NN_name.ipynb found in {src}")
    helpers = sorted(src.glob("_*.py"))
    _mirror({p.name: p.read_bytes() for p in notebooks + helpers}, DOCS / "tutorials")


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
    # the performance toctree depends on which pages exist, not on index.md's own text
    return [root_doc]


_copy_tutorials()
_generate_api_pages()


def setup(app):
    app.connect("source-read", _performance_toctree)
    app.connect("env-get-outdated", _always_reread_index)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
