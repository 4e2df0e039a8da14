"""The shape of the reference: one home for each idea, cores a kernel can mirror, a self-contained repository.

* No module of ``refimpl`` imports a private (``_``-prefixed) name from
  another module: what is shared has a public home.
* No core raises.  A core is a ``_``-prefixed function that is not a
  ``_check_*`` validator, or a public function whose docstring starts with
  "Core"; checks happen once, at the public boundary, on what the cores return.
* No file of the repository points to a file outside it.
* ``import refimpl`` does not import numba (a GPU dependency, not the reference's).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "refimpl").rglob("*.py"))


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _private_imports(tree):
    """(line, what) for every import of a private name, and every use of a private attribute of an imported module."""
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and alias.name != "__future__" and node.module != "__future__":
                    found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}"))
                modules.add(alias.asname or alias.name)
            if node.module and any(part.startswith("_") for part in node.module.split(".")) and node.module != "__future__":
                found.append((node.lineno, f"from {'.' * node.level}{node.module} import ..."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_no_module_imports_a_private_name_from_another(path):
    found = _private_imports(ast.parse(path.read_text(), filename=str(path)))
    assert not found, f"{path.name} uses private names of other modules: {found}"


def test_the_private_import_scan_finds_what_it_looks_for():
    source = "from .gmm import _softmax\nfrom . import _validation as V\nfrom . import gmm\ngmm._log_joint(1)\n"
    found = [what for _, what in _private_imports(ast.parse(source))]
    assert found == ["from .gmm import _softmax", "from . import _validation", "gmm._log_joint"]


def _cores(tree):
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        doc = ast.get_docstring(node) or ""
        private_core = node.name.startswith("_") and not node.name.startswith(("_check", "__"))
        if private_core or doc.startswith("Core"):
            yield node


def _raises(func):
    return [n.lineno for n in ast.walk(func) if isinstance(n, (ast.Raise, ast.Assert))]


@pytest.mark.parametrize("path", MODULES, ids=_ids(MODULES))
def test_no_core_raises(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    offenders = {f.name: _raises(f) for f in _cores(tree) if _raises(f)}
    assert not offenders, f"{path.name}: cores that raise or assert (move the check to the public boundary): {offenders}"


def test_the_core_scan_sees_the_cores():
    """The scan is not vacuous: it finds the known cores, and a raise inside one of them."""
    gmm = ast.parse((ROOT / "refimpl" / "gmm.py").read_text())
    names = {f.name for f in _cores(gmm)}
    assert {"log_joint", "log_posterior", "posterior", "merge_running_means", "_expanded_half_quadratic_form", "_entries_to_recompute"} <= names
    assert "_check_isotropic" not in names and "responsibilities" not in names
    bad = ast.parse('def _core(x):\n    if x:\n        raise ValueError("x")\n    return x\n')
    assert [f.name for f in _cores(bad) if _raises(f)] == ["_core"]


# documents that exist only outside the repository (written as patterns, so this file does not name them)
OUTSIDE = re.compile(r"spec/(?:gma|ovq)\.md|\.\./shared\b|\bshared/(?:spec|seeds|style\.md)")


def _tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p]


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in _tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
        # the contract is docs/derivations/, never "the spec" (a document outside the repository)
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in re.finditer(r"\bspec(?:'s)?\b", text)]
    assert not offenders, offenders


def test_the_outside_patterns_match_what_they_guard():
    # each example is split in two literals, so that this file does not contain what it forbids
    for text in ("see spec/" "ovq.md section 4", ".." "/shared/spec/" "gma.md", "shared/" "style.md", "spec/" "gma.md"):
        assert OUTSIDE.search(text), text
    for text in ("docs/derivations/ovq_gmr.md", "a shared GMM", "kernelspec"):
        assert not OUTSIDE.search(text) and not re.search(r"\bspec(?:'s)?\b", text), text


def test_refimpl_does_not_import_numba():
    code = "import sys, refimpl; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _slug(heading: str) -> str:
    """The anchor MyST gives a heading (``myst_heading_anchors``): lower case, punctuation dropped, spaces to '-'."""
    import re

    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_derivation_link_in_the_reference_resolves():
    """``page.md#anchor`` in a docstring names a heading that exists in docs/derivations/."""
    import re

    pages = {p.name: _anchors(p) for p in (ROOT / "docs" / "derivations").glob("*.md")}
    found, broken = 0, []
    for path in MODULES:
        text = path.read_text()
        for page, anchor in re.findall(r"(\w+\.md)#([\w-]+)", text):
            found += 1
            if page not in pages or anchor not in pages[page]:
                broken.append(f"{path.name}: {page}#{anchor}")
        # a bare ``#anchor`` after a page link in the same sentence refers to the same page
        for page, rest in re.findall(r"``(\w+\.md)#[\w-]+``((?:, ``#[\w-]+``)+)", text):
            for anchor in re.findall(r"#([\w-]+)", rest):
                found += 1
                if anchor not in pages.get(page, set()):
                    broken.append(f"{path.name}: {page}#{anchor}")
    assert found >= 20 and not broken, broken


def test_the_loop_oracle_uses_nothing_of_the_code_it_checks():
    """refimpl.ovq_oracle may use the shared argument checks, never refimpl.ovq, gmm, numerics or attention."""
    tree = ast.parse((ROOT / "refimpl" / "ovq_oracle.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            imported |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert imported <= {"validation", "math", "numpy", "typing", "__future__"}, imported
