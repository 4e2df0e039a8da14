"""environment.yml (conda) and pyproject.toml describe the same environment; the CUDA extras each bring one CUDA major.

environment.yml is the conda twin of the project's dependencies with the
``dev`` and ``cuda13`` extras (what ``make install`` installs).  ``dev`` names
no CUDA version, so that ``.[dev,cuda12]`` and ``.[dev,cuda13]`` both
resolve; ``tests/test_environment.py::test_both_cuda_extras_resolve`` asks pip
whenever the package index can be reached.
"""

import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


# the pip wheels that conda-forge names differently
PIP_TO_CONDA = {
    "cupy-cuda13x": "cupy",
    "nvidia-cuda-nvrtc": "cuda-nvrtc",
    "nvidia-cuda-nvcc": "cuda-nvcc",
    "nvidia-cuda-cuobjdump": "cuda-cuobjdump",
    "nvidia-cuda-nvdisasm": "cuda-nvdisasm",
}
#: the extra that environment.yml and `make install` add to dev
CONDA_EXTRA = "cuda13"


def _name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")
    return PIP_TO_CONDA.get(name, name)


def _pip_section(env) -> list[str]:
    """environment.yml's pip lines: the project itself, and the packages conda-forge does not have."""
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _conda_side(project):
    """What environment.yml must list: the dependencies, dev and the extra make install adds."""
    extras = project["optional-dependencies"]
    return project["dependencies"] + extras["dev"] + extras[CONDA_EXTRA]


def test_environment_yml_lists_the_same_packages_as_pyproject():
    pip_names = {_name(r) for r in _conda_side(_project())}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)] + _pip_section(env)
    conda_names = {_name(d) for d in conda if not d.startswith("-")} - {"python", "pip"}
    assert conda_names == pip_names
    pip_section = _pip_section(env)
    assert any(line.endswith("-e .") for line in pip_section), "the project itself is installed by pip"


def _lower_bound(requirement: str) -> str:
    """The ``>=`` bound alone: no name (conda and pip may spell it differently), no pip extras, no comment."""
    text = re.sub(r"\[.*?\]", "", requirement.split("#")[0].replace(" ", ""))
    found = re.search(r">=[^,;]+", text)
    return found.group(0) if found else ""


def test_lower_bounds_agree():
    pins = {_name(r): _lower_bound(r) for r in _conda_side(_project())}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    checked = 0
    for dep in [d for d in env["dependencies"] if isinstance(d, str)] + _pip_section(env):
        if _name(dep) in pins:
            assert _lower_bound(dep) == pins[_name(dep)], (dep, pins[_name(dep)])
            checked += 1
    assert checked == len(pins)


def test_python_requirement_agrees():
    project = _project()
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python{project['requires-python']}" in env["dependencies"]


# --- the CUDA extras ----------------------------------------------------------------------------------------

CUDA_NAMED = ("cupy", "cuda-", "nvidia-")


def _requirements(extra):
    return [Requirement(r.split("#")[0]) for r in _project()["optional-dependencies"][extra]]


def test_dev_names_no_cuda_major():
    """dev must resolve beside either CUDA extra: no CuPy wheel, no CUDA package, no numba-cuda[cuXX]."""
    for req in _requirements("dev"):
        assert not req.name.lower().startswith(CUDA_NAMED), f"dev pins a CUDA package: {req}"
        assert not req.extras, f"dev asks for an extra of {req.name} ({sorted(req.extras)}): that picks a CUDA major"


@pytest.mark.parametrize("extra, major", [("cuda12", 12), ("cuda13", 13)])
def test_each_cuda_extra_brings_one_major(extra, major):
    reqs = {r.name.lower(): r for r in _requirements(extra)}
    other = 25 - major  # 12 <-> 13
    assert reqs["numba-cuda"].extras == {f"cu{major}"}
    assert f"cupy-cuda{major}x" in reqs and f"cupy-cuda{other}x" not in reqs
    bindings = reqs["cuda-bindings"].specifier
    assert bindings.contains(f"{major}.9.1") and not bindings.contains(f"{other}.0.0") and not bindings.contains(f"{other}.9.1")
    nvrtc = [n for n in reqs if n.startswith("nvidia-cuda-nvrtc")]
    assert nvrtc == (["nvidia-cuda-nvrtc-cu12"] if major == 12 else ["nvidia-cuda-nvrtc"])
    if major == 13:
        assert not reqs["nvidia-cuda-nvrtc"].specifier.contains("12.9.86")


def test_both_cuda_extras_name_the_same_stack():
    def roles(extra):
        return sorted(re.sub(r"(-cu12|12x|13x)$", "", r.name.lower()) for r in _requirements(extra))

    stack = ["cuda-bindings", "cupy-cuda", "numba-cuda", "nvidia-cuda-nvcc", "nvidia-cuda-nvrtc"]
    assert roles("cuda12") == stack
    # cuobjdump and nvdisasm (the SASS of the hot loops) have CUDA 13 wheels only
    assert roles("cuda13") == sorted(stack + ["nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"])


def test_make_install_installs_dev_with_a_cuda_extra():
    makefile = (ROOT / "Makefile").read_text()
    default = re.search(r"^CUDA_EXTRA \?= (\S+)$", makefile, re.M)
    assert default and default.group(1) == CONDA_EXTRA
    assert "-e '.[dev,$(CUDA_EXTRA)]'" in makefile


def _index_reachable():
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/numba-cuda/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return True, url
    except (urllib.error.URLError, OSError) as err:
        return False, f"the package index cannot be reached ({url}: {err})"


@pytest.mark.slow
def test_both_cuda_extras_resolve():
    """pip resolves each extra with the dependencies and dev's numba and numba-cuda (the only dev packages CUDA touches)."""
    reachable, why = _index_reachable()
    if not reachable:
        pytest.skip(why)
    proc = subprocess.run([sys.executable, "-m", "gpu", "resolve-extras", "--gpu-stack-only"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("cuda12: resolves in") and "cupy-cuda12x" in line and "cuda-bindings 12." in line for line in lines)
    assert any(line.startswith("cuda13: resolves in") and "cupy-cuda13x" in line and "cuda-bindings 13." in line for line in lines)


# --- the locked versions (constraints/) ---------------------------------------------------------------------

def _lock(extra):
    lines = (ROOT / "constraints" / f"{extra}.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    return pins


@pytest.mark.parametrize("extra", ["cuda12", "cuda13"])
def test_the_lock_pins_every_requirement_within_its_range(extra):
    """Each constraints file names every package the project asks for (core, dev, course and the extra), at a version
    its requirement admits, and nothing twice; the project itself is not in it."""
    pins = _lock(extra)
    project = _project()
    extras = project["optional-dependencies"]
    assert "gmattn-reference" not in pins
    for text in project["dependencies"] + extras["dev"] + extras["course"] + extras[extra]:
        req = Requirement(text.split("#")[0])
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints/{extra}.txt does not pin {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
    lines = [line for line in (ROOT / "constraints" / f"{extra}.txt").read_text().splitlines() if line and line[0] != "#"]
    names = [line.split("==")[0] for line in lines]
    assert len(names) == len(pins) and names == sorted(names)


def test_the_two_locks_differ_only_in_the_cuda_stack():
    """cuda12.txt holds every package of cuda13.txt that names no CUDA major at cuda13.txt's version (CI tests those)."""
    twelve, thirteen = _lock("cuda12"), _lock("cuda13")
    cuda = ("cupy-", "cuda-", "nvidia-")
    shared12 = {n: v for n, v in twelve.items() if not n.startswith(cuda)}
    shared13 = {n: v for n, v in thirteen.items() if not n.startswith(cuda)}
    assert shared12 == shared13
    assert twelve["cuda-bindings"].startswith("12.") and thirteen["cuda-bindings"].startswith("13.")


def test_make_install_uses_the_lock_unless_told_otherwise():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK \?= constraints/\$\(CUDA_EXTRA\)\.txt$", makefile, re.M)
    assert "PIP_VERSIONS := $(if $(LOCK),-c $(LOCK),--upgrade --upgrade-strategy eager)" in makefile
    assert "-e '.[dev,$(CUDA_EXTRA)]' $(PIP_VERSIONS)" in makefile
    assert re.search(r"^install-latest:\n(\t.*\n)*\t\$\(MAKE\) --no-print-directory install VENV=\$\(LATEST_VENV\) LOCK=$", makefile, re.M)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test") < ci.index("make test-latest")
