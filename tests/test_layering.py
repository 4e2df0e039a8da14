"""The floors of the project: every module imports only from its own floor or those below.

0. ``refimpl``: the mechanisms, with NumPy and SciPy only;
1. ``cpu`` and ``gpu``: the kernels that mirror them (each on its own: neither imports the other);
2. ``app``: the model, training and the experiments, on either backend;
3. ``tutorials``, ``benchmarks`` and ``tests``: what reads, measures and checks the rest.

The imports are read from the source (every ``import`` and ``from ... import``, at any depth of a module,
relative ones resolved, and the module names given to ``importlib.import_module`` as literal strings), the way
``tests/test_structure.py`` reads the call depth.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package (top-level folder) -> floor
FLOORS = {"refimpl": 0, "cpu": 1, "gpu": 1, "app": 2, "tutorials": 3, "benchmarks": 3, "tests": 3}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(root: Path, path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the file ``path`` (a file of the tree at ``root``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def upward_imports(root: Path = ROOT) -> list[str]:
    """``"file:line imports module (floor a -> floor b)"`` for every import of a higher floor or of a sibling backend."""
    bad = []
    for package, floor in FLOORS.items():
        for path in sorted((root / package).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            for line, name in imported_modules(root, path):
                top = name.split(".")[0]
                if top not in FLOORS or top == package:
                    continue
                other = FLOORS[top]
                if other > floor or (other == floor and floor != 3):
                    where = path.relative_to(root).as_posix()
                    bad.append(f"{where}:{line} imports {name} ({package}, floor {floor} -> {top}, floor {other})")
    return bad


def test_no_module_imports_from_a_higher_floor():
    bad = upward_imports()
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)


def test_the_scan_sees_upward_relative_dynamic_and_sideways_imports(tmp_path):
    """Not vacuous: a reference module importing the application (absolutely, relatively from below, inside a
    function, or by name), a kernel importing the other backend, are each found; importing downward is not."""
    files = {
        "refimpl/__init__.py": "",
        "refimpl/a.py": "import numpy\nfrom . import b\nfrom app import model\n",
        "refimpl/sub/__init__.py": "",
        "refimpl/sub/c.py": "def f():\n    from ...app.train import train\n    return train\n",
        "refimpl/d.py": "import importlib\nm = importlib.import_module('app.experiments.recall')\n",
        "cpu/__init__.py": "import refimpl\nfrom gpu import numba_cuda\n",
        "app/__init__.py": "from refimpl import gmm\nimport cpu\n",
        "tests/test_x.py": "import app, cpu, gpu, refimpl\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = upward_imports(tmp_path)
    assert [b.split(" (")[0] for b in bad] == [
        "refimpl/a.py:3 imports app",
        "refimpl/d.py:2 imports app.experiments.recall",
        "refimpl/sub/c.py:2 imports app.train",
        "cpu/__init__.py:2 imports gpu",
    ]


# the modules a Python with only the standard library, NumPy and SciPy lets refimpl import
_BLOCKER = textwrap.dedent("""
    import importlib, pkgutil, sys
    ALLOWED = {"numpy", "scipy", "refimpl"}
    class Blocked:
        @staticmethod
        def find_spec(name, path=None, target=None):
            top = name.split(".")[0]
            if top in ALLOWED or top in sys.stdlib_module_names or top.startswith("_"):
                return None
            raise ModuleNotFoundError(f"blocked: {name}")
    sys.meta_path.insert(0, Blocked)
    import refimpl
    import refimpl.checks, refimpl.gradcheck, refimpl.testing, refimpl.verify
    for info in pkgutil.walk_packages(refimpl.__path__, "refimpl."):
        if info.name != "refimpl.__main__":
            importlib.import_module(info.name)
    from refimpl.__main__ import main
    sys.exit(main(["verify", "-k", "gma.*"]))
""")


def test_refimpl_imports_and_verifies_with_numpy_and_scipy_only():
    """Every module of refimpl imports, and ``verify`` runs, with every package but NumPy and SciPy blocked."""
    run = subprocess.run([sys.executable, "-c", _BLOCKER], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "checks passed" in run.stdout


def test_the_blocker_blocks():
    code = _BLOCKER.split("import refimpl\n")[0] + "import app\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "blocked: app" in run.stderr


@pytest.mark.parametrize("command", ["train", "experiment"])
def test_the_old_commands_name_the_new_one(command):
    run = subprocess.run([sys.executable, "-m", "refimpl", command, "--quick", "--out", "x y"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (f"python -m refimpl {command}: moved to python -m app {command}, with the same options: "
                          f"python -m app {command} --quick --out 'x y'\n")
