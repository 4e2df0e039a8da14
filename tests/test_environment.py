"""environment.yml (conda) and pyproject.toml describe the same environment."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


# the pip wheels that conda-forge names differently
PIP_TO_CONDA = {"cupy-cuda13x": "cupy", "nvidia-cuda-nvrtc": "cuda-nvrtc"}


def _name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")
    return PIP_TO_CONDA.get(name, name)


def _pip_section(env) -> list[str]:
    """environment.yml's pip lines: the project itself, and the packages conda-forge does not have."""
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_names = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)] + _pip_section(env)
    conda_names = {_name(d) for d in conda if not d.startswith("-")} - {"python", "pip"}
    assert conda_names == pip_names
    pip_section = _pip_section(env)
    assert any(line.endswith("-e .") for line in pip_section), "the project itself is installed by pip"


def _bound(requirement: str) -> str:
    """The version bound alone: no name (conda and pip may spell it differently), no pip extras, no comment."""
    text = re.sub(r"\[.*?\]", "", requirement.split("#")[0].replace(" ", ""))
    return text[len(re.split(r"[<>=!~;]", text, maxsplit=1)[0]):]


def test_lower_bounds_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {_name(r): _bound(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    checked = 0
    for dep in [d for d in env["dependencies"] if isinstance(d, str)] + _pip_section(env):
        if _name(dep) in pins:
            assert _bound(dep) == pins[_name(dep)], (dep, pins[_name(dep)])
            checked += 1
    assert checked == len(pins)


def test_python_requirement_agrees():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python{project['requires-python']}" in env["dependencies"]
