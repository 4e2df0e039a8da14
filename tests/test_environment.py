"""environment.yml (conda) and pyproject.toml describe the same environment."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_names = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    conda_names = {_name(d) for d in conda} - {"python", "pip"}
    assert conda_names == pip_names
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(line.endswith("-e .") for line in pip_section), "the project itself is installed by pip"


def test_lower_bounds_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {_name(r): r.replace(" ", "") for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    for dep in env["dependencies"]:
        if isinstance(dep, str) and _name(dep) in pins:
            assert dep.replace(" ", "") == pins[_name(dep)], (dep, pins[_name(dep)])


def test_python_requirement_agrees():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert f"python{project['requires-python']}" in env["dependencies"]
