"""The shape of the reference: one home for each idea, cores a kernel can mirror, a self-contained repository.

* No module of ``refimpl`` or ``app`` imports a private (``_``-prefixed) name
  from another module: what is shared has a public home.
* No core raises.  A core is a ``_``-prefixed function that is not a
  ``_check_*`` validator, or a public function whose docstring starts with
  "Core"; checks happen once, at the public boundary, on what the cores return.
* No file of the repository points to a file outside it.
* ``import refimpl`` does not import numba (a GPU dependency, not the reference's).
* No public function of ``refimpl`` or ``app`` is longer than 60 lines.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "refimpl").rglob("*.py")) + sorted((ROOT / "app").rglob("*.py"))


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
    assert {"log_joint", "m_step", "_nearest_means"} <= names
    assert "responsibilities" not in names
    tuned = ast.parse((ROOT / "refimpl" / "tuned.py").read_text())
    assert {"log_joint", "spoiled_logits", "suspect_rows", "_block_log_joint", "_responsibility_backward"} <= {f.name for f in _cores(tuned)}
    validation = ast.parse((ROOT / "refimpl" / "validation.py").read_text())
    assert not {f.name for f in _cores(validation)} & {"check_gmm", "check_gma_tokens"}
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


# ---------------------------------------------------------------------------
# The spec path: how many calls from a public function to its math, and how much of a module is validation
# ---------------------------------------------------------------------------

#: The modules that state the mechanisms and their theory: read to check a formula, so kept plain.  (The
#: model built on them, app.layers and app.model, runs on refimpl.tuned or cpu; the argument checks of every
#: public function are in refimpl.validation.)
SPEC_MODULES = ("numerics", "gmm", "scan", "attention", "gma", "ovq", "ovq_oracle", "gmr", "theory")
#: The most calls a public function of a spec module may go through to reach its math.
MAX_CALL_DEPTH = 3
#: The largest share of a spec module's function lines that may be argument checking.
MAX_VALIDATION_SHARE = 0.30


def _is_check(name: str) -> bool:
    return re.match(r"_?check_", name) is not None


def _module_functions(root: Path):
    """``{(module, function): ast node}`` of the top-level functions of ``refimpl/*.py``, and each module's imports."""
    functions, imports = {}, {}
    for path in sorted((root / "refimpl").glob("*.py")):
        mod = path.stem
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {}  # local name -> ("module", mod) or ("function", (mod, name))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("refimpl")):
                source = (node.module or "").removeprefix("refimpl").lstrip(".")
                for alias in node.names:
                    local = alias.asname or alias.name
                    names[local] = ("module", alias.name) if not source else ("function", (source, alias.name))
            elif isinstance(node, ast.FunctionDef):
                functions[(mod, node.name)] = node
        imports[mod] = names
    return functions, imports


def _callees(mod, node, functions, imports):
    """The refimpl functions that ``node`` calls or passes on (a function handed to another is called by it)."""
    out = set()
    names = imports[mod]
    for sub in ast.walk(node):
        target = None
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            if (mod, sub.id) in functions:
                target = (mod, sub.id)
            elif names.get(sub.id, ("", None))[0] == "function":
                target = names[sub.id][1]
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            kind, what = names.get(sub.value.id, ("", None))
            if kind == "module":
                target = (what, sub.attr)
        if target is None or target not in functions or target == (mod, node.name):
            continue
        # argument checks are not the path to the math
        if target[0] == "validation" or _is_check(target[1]):
            continue
        out.add(target)
    return out


def call_depths(root: Path = ROOT) -> dict:
    """``{(module, function): depth}``: the longest chain of calls from each refimpl function to code that calls none."""
    functions, imports = _module_functions(root)
    graph = {key: _callees(key[0], node, functions, imports) for key, node in functions.items()}
    depth = {}

    def visit(key, stack):
        if key in depth:
            return depth[key]
        if key in stack:  # recursion: the cycle adds nothing
            return 0
        stack.add(key)
        depth[key] = max((1 + visit(c, stack) for c in graph[key]), default=0)
        stack.discard(key)
        return depth[key]

    for key in graph:
        visit(key, set())
    return depth


def _public_functions(root: Path, mod: str):
    tree = ast.parse((root / "refimpl" / f"{mod}.py").read_text())
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = set(ast.literal_eval(node.value))
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in exported and not _is_check(n.name)]


def _code_lines(node) -> set:
    """The line numbers of ``node``'s body that hold code: no docstring, blank line or comment."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    lines = set()
    for stmt in body:
        for sub in ast.walk(stmt):
            if hasattr(sub, "lineno") and not (isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.lineno != getattr(sub, "end_lineno", sub.lineno)):
                lines.update(range(sub.lineno, (getattr(sub, "end_lineno", None) or sub.lineno) + 1))
    return lines


def _validation_lines(node) -> set:
    """The code lines of ``node`` that check arguments: a whole checker, or the statements that call one or raise."""
    if _is_check(node.name):
        return _code_lines(node)
    lines = set()
    for stmt in ast.walk(node):
        if not isinstance(stmt, ast.stmt) or stmt is node:
            continue
        checks = isinstance(stmt, (ast.Raise, ast.Assert)) or (
            isinstance(stmt, ast.If) and all(isinstance(s, ast.Raise) for s in stmt.body) and not stmt.orelse
        )
        if not checks and isinstance(stmt, (ast.Expr, ast.Assign, ast.Return)):
            for call in ast.walk(stmt):
                if isinstance(call, ast.Call):
                    f = call.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                    if owner == "validation" or _is_check(name):
                        checks = True
        if checks:
            lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def validation_share(root: Path, mod: str) -> tuple:
    """``(validation lines, function lines)`` of ``refimpl/mod.py``: code lines of every function and method."""
    tree = ast.parse((root / "refimpl" / f"{mod}.py").read_text())
    total, checking = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            code = _code_lines(node)
            total |= code
            checking |= _validation_lines(node) & code
    return len(checking), len(total)


@pytest.mark.parametrize("mod", SPEC_MODULES)
def test_public_functions_reach_their_math_in_few_calls(mod):
    depth = call_depths()
    deep = {f: depth[(mod, f)] for f in _public_functions(ROOT, mod) if depth[(mod, f)] > MAX_CALL_DEPTH}
    assert not deep, f"refimpl/{mod}.py: public functions more than {MAX_CALL_DEPTH} calls from their math: {deep}"


@pytest.mark.parametrize("mod", SPEC_MODULES)
def test_validation_is_a_minor_part_of_each_spec_module(mod):
    checking, total = validation_share(ROOT, mod)
    assert checking <= MAX_VALIDATION_SHARE * total, f"refimpl/{mod}.py: {checking} of {total} function lines check arguments"


def test_the_depth_and_share_measures_see_what_they_measure():
    """The two measures are not vacuous: a chain of four calls is depth 4, a checker's lines all count as validation."""
    src = (
        "from . import validation\n"
        "def a(x):\n    validation.check_finite(x, 'x')\n    return b(x)\n"
        "def b(x):\n    return c(x) + 1\n"
        "def c(x):\n    return d(x)\n"
        "def d(x):\n    return e(x)\n"
        "def e(x):\n    return x\n"
        "def _check_y(y):\n    if y < 0:\n        raise ValueError('y')\n    return y\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "refimpl").mkdir()
        (Path(tmp) / "refimpl" / "toy.py").write_text(src)
        (Path(tmp) / "refimpl" / "validation.py").write_text("def check_finite(x, name):\n    return x\n")
        depth = call_depths(Path(tmp))
        assert depth[("toy", "a")] == 4 and depth[("toy", "e")] == 0
        checking, total = validation_share(Path(tmp), "toy")
        # a: 2 lines (1 check), b..e: 1 each, _check_y: 3 lines, all checking
        assert (checking, total) == (4, 9)


def structure_report(root: Path = ROOT) -> str:
    """The table ``python tests/test_structure.py [ROOT]`` prints: call depth of each public function, validation share."""
    depth = call_depths(root)
    lines = ["module       validation share   public functions deeper than 1 (depth)"]
    for mod in SPEC_MODULES:
        if not (root / "refimpl" / f"{mod}.py").exists():
            continue
        checking, total = validation_share(root, mod)
        deep = ", ".join(f"{f} {depth[(mod, f)]}" for f in _public_functions(root, mod) if depth[(mod, f)] > 1)
        lines.append(f"{mod:<12} {checking:>4}/{total:<4} {checking / max(total, 1):>5.0%}   {deep}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# No public function longer than a screen
# ---------------------------------------------------------------------------

#: The package folders (relative to the repository root) whose modules, recursively, the length rule covers.
LENGTH_RULE_PACKAGES = ("refimpl", "app")
#: The most lines a public function's body may take, from its first statement after the docstring to its last line.
MAX_PUBLIC_BODY_LINES = 60


def _public_body_lengths(tree) -> dict:
    """``{name: lines}`` of the public functions of a module and the public methods of its classes (``Class.name``).

    The body is counted from the first statement after the docstring to the
    function's last line, blank lines and comments inside it included.
    """
    def length(func):
        body = func.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]
        return func.end_lineno - body[0].lineno + 1 if body else 0

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    found = {node.name: length(node) for node in tree.body if isinstance(node, functions) and not node.name.startswith("_")}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        found |= {f"{cls.name}.{m.name}": length(m) for m in cls.body if isinstance(m, functions) and not m.name.startswith("_")}
    return found


def test_no_public_function_body_is_longer_than_60_lines():
    """Every public function of the covered packages fits a screen: at most 60 lines after its docstring."""
    # the measure sees what it measures: 61 lines after a docstring of three, 60 without one; private functions are free
    toy = ('def long(x):\n    """A docstring\n\n    of three lines."""\n' + "    x += 1\n" * 60 + "    return x\n"
           + "def short(x):\n" + "    x += 1\n" * 59 + "    return x\n"
           + "def _private(x):\n" + "    x += 1\n" * 70 + "    return x\n"
           + "class Toy:\n    def method(self):\n        '''Doc.'''\n" + "        pass\n" * 61)
    lengths = _public_body_lengths(ast.parse(toy))
    assert lengths == {"long": 61, "short": 60, "Toy.method": 61}
    assert [name for name, n in lengths.items() if n > MAX_PUBLIC_BODY_LINES] == ["long", "Toy.method"]
    paths = [p for package in LENGTH_RULE_PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(paths) >= 15 and ROOT / "refimpl" / "tuned.py" in paths and ROOT / "refimpl" / "ovq_oracle.py" in paths
    offenders = {}
    for path in paths:
        lengths = _public_body_lengths(ast.parse(path.read_text(), filename=str(path)))
        offenders |= {f"{path.relative_to(ROOT)}:{name}": n for name, n in lengths.items() if n > MAX_PUBLIC_BODY_LINES}
    assert not offenders, f"public functions longer than {MAX_PUBLIC_BODY_LINES} lines (split them into named steps): {offenders}"


if __name__ == "__main__":
    print(structure_report(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
