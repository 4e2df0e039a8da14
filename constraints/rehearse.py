"""The GPU check rehearsed in an environment built like the GPU machines: ``python constraints/rehearse.py`` (``make gpu-rehearsal``).

The machines ``make gpu-check`` runs on (``constraints/gpu-machine.txt``)
have Python 3.12 with their own packages, no virtual environment, no package
index and no install of this project, and the CUDA 13.0 toolkit's ``ptxas``
and ``cuobjdump`` on ``PATH``.  This script builds the nearest thing the
package index allows, then runs what the check would:

1. a virtual environment ``.venv-rehearsal`` from a Python 3.12 (``python3.12``
   on ``PATH``, else pyenv's, else ``REHEARSAL_PYTHON``; failing all three,
   the Python running this script, and it says so), with the packages of
   ``gpu-machine.txt`` at the machine's versions where the index has them
   (the nearest below where it does not: it says which) and NVVM, nvJitLink,
   NVRTC and the runtime of CUDA 13.0; the project is not installed, only put
   on ``PYTHONPATH``;
2. two sets of tools, each in a folder of its own put first on ``PATH``:
   ``ptxas`` and ``cuobjdump`` (with the ``nvdisasm`` it runs) of CUDA 13.0
   (the oldest wheels of ``cuobjdump`` and ``nvdisasm`` are 13.2) and of CUDA
   13.5;
3. with each set on ``PATH``: ``python -m gpu check --dry-run`` (it must
   exit 0) and the static gates, ``tests/test_gpu_resources.py`` and
   ``tests/test_gpu_ptx.py`` (they must pass);
4. a table of the versions (the machine's against the rehearsal's) and of
   every dry run's stages, also in ``results/rehearsal/rehearsal.md``.

Exit status 0 when every dry run and every gate passed, 1 otherwise.  Needs
the package index (pip); the first run downloads about 1.5 GB, later runs
reuse the environment while ``gpu-machine.txt`` is unchanged.
``REHEARSAL_TORCH=1`` adds torch 2.11.0 (the CUDA build, several GB).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TABLE = HERE / "gpu-machine.txt"
VENV = ROOT / os.environ.get("REHEARSAL_VENV", ".venv-rehearsal")
OUT = ROOT / "results" / "rehearsal"
#: The tool sets: ``{name: wheels}``, each installed into ``VENV/tools-NAME`` and put first on ``PATH`` in turn.
TOOLSETS = {
    "13.0": ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-cuobjdump==13.2.51", "nvidia-cuda-nvdisasm==13.2.51"),
    "13.5": ("nvidia-cuda-nvcc==13.5.37", "nvidia-cuda-cuobjdump==13.5.37", "nvidia-cuda-nvdisasm==13.5.37"),
}
#: The tools of the table that come from the tool sets, not from pip into the environment.
TOOLS = ("ptxas", "cuobjdump", "nvdisasm")
GATES = ("tests/test_gpu_resources.py", "tests/test_gpu_ptx.py")


def read_table(path=TABLE):
    """``[(name, machine version, what pip is asked for)]`` of ``gpu-machine.txt`` (comments and blank lines left out)."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, machine, wanted = (part.strip() for part in line.split("|"))
            rows.append((name, machine, wanted))
    return rows


def _runs_312(python):
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.split() == ["3", "12"]


def find_python():
    """``(python, note)``: a Python 3.12, or this one with a note saying that it is not."""
    candidates = [os.environ.get("REHEARSAL_PYTHON"), shutil.which("python3.12")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")), reverse=True)
    for python in filter(None, candidates):
        if _runs_312(python):
            return python, ""
    return sys.executable, f"no Python 3.12 found: the rehearsal runs on {sys.version.split()[0]}"


def _pip(python, *args):
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    print("  $ " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)


def build(rows, with_torch):
    """Create ``VENV`` with the packages and tool sets, unless it was built from the same table; its Python."""
    stamp = VENV / ".rehearsal-stamp"
    key = hashlib.sha256(TABLE.read_bytes() + str(with_torch).encode()).hexdigest()
    python = VENV / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == key and python.exists():
        return python
    base, note = find_python()
    if note:
        print(f"rehearsal: {note}")
    if VENV.exists():
        shutil.rmtree(VENV)
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    specs = [wanted for name, _, wanted in rows if name not in ("python",) + TOOLS and "REHEARSAL_TORCH" not in wanted]
    if with_torch:
        specs.append("torch==2.11.0")
    print(f"rehearsal: installing {len(specs)} packages into {VENV.name} (no project install)", flush=True)
    _pip(str(python), *specs)
    for name, wheels in TOOLSETS.items():
        _pip(str(python), "--no-deps", "--target", str(VENV / f"tools-{name}"), *wheels)
    stamp.write_text(key)
    return python


def tool_folder(name):
    """The folder that holds toolset ``name``'s ``ptxas`` and ``cuobjdump`` (CUDA 13 wheels: ``nvidia/cu13/bin``)."""
    found = sorted((VENV / f"tools-{name}").glob("nvidia/*/bin/ptxas"))
    if not found:
        raise FileNotFoundError(f"toolset {name}: no ptxas under {VENV / f'tools-{name}'}")
    return found[0].parent


def tool_version(path):
    """``"13.0"``: the release a CUDA tool prints with ``--version``."""
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
    for word in out.replace(",", " ").split():
        if word[:1].isdigit() and word.count(".") == 1 and "release" in out:
            return word
    return "unknown"


def versions(python, rows):
    """``{name: version}`` in the rehearsal's Python, for every package of the table."""
    names = [name for name, _, _ in rows if name not in ("python",) + TOOLS]
    code = ("import importlib.metadata as m, json, sys\nout = {'python': sys.version.split()[0]}\n"
            "for n in json.loads(sys.argv[1]):\n    try:\n        out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError:\n        out[n] = 'not installed'\nprint(json.dumps(out))")
    return json.loads(subprocess.run([str(python), "-c", code, json.dumps(names)], capture_output=True, text=True,
                                     check=True).stdout)


def environment(tools):
    """The environment of a rehearsed command: the project on ``PYTHONPATH`` only, ``tools`` first on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = str(ROOT)
    env["PATH"] = os.pathsep.join([str(tools), str(VENV / "bin"), env.get("PATH", "")])
    return env


def version_table(rows, found):
    """The table of versions: the GPU machine's against the rehearsal's, with a note wherever they differ."""
    lines = ["| package | GPU machine | rehearsal | note |", "| --- | --- | --- | --- |"]
    for name, machine, _ in rows:
        have, note, wants = found.get(name, ""), "", machine.split()[0]
        if name in TOOLS:
            have = ", ".join(f"tools {t}: {found.get(f'{name} {t}', '?')}" for t in TOOLSETS)
            older = [t for t in TOOLSETS if not found.get(f"{name} {t}", "").startswith(t)]
            if older:
                note = f"**differs**: tools {', '.join(older)} carry {name} " + ", ".join(found.get(f"{name} {t}", "?") for t in older)
                note += " (the oldest wheel on the package index)"
        elif have == "not installed":
            note = "not installed (REHEARSAL_TORCH=1 installs it)" if name == "torch" else "**missing**"
        elif wants[:1].isdigit() and not have.startswith(wants):
            note = f"**differs**: {have} here, {wants} there (the nearest the package index or this machine has)"
        lines.append(f"| {name} | {machine} | {have} | {note} |")
    return "\n".join(lines)


def main():
    rows = read_table()
    with_torch = os.environ.get("REHEARSAL_TORCH", "") not in ("", "0")
    python = build(rows, with_torch)
    found = versions(python, rows)
    for name in TOOLSETS:
        folder = tool_folder(name)
        found[f"ptxas {name}"] = tool_version(folder / "ptxas")
        found[f"cuobjdump {name}"] = tool_version(folder / "cuobjdump")
        found[f"nvdisasm {name}"] = tool_version(folder / "nvdisasm")
    report = ["# GPU check rehearsal", "", version_table(rows, found), ""]
    print("\n" + report[2] + "\n", flush=True)
    failed = []
    for name in TOOLSETS:
        env = environment(tool_folder(name))
        out = OUT / f"tools-{name}"
        start = time.monotonic()
        proc = subprocess.run([str(python), "-m", "gpu", "check", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        print(proc.stdout + proc.stderr, flush=True)
        report += [f"## Tools {name} on PATH", "", f"- dry run: exit {proc.returncode} in {time.monotonic() - start:.0f} s"]
        if proc.returncode != 0:
            failed.append(f"the dry run with tools {name} (exit {proc.returncode})")
        try:
            result = json.loads((out / "gpu-check.json").read_text())
            report += ["", "| stage | status | seconds | summary |", "| --- | --- | ---: | --- |"]
            report += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['summary'].replace('|', '/')} |" for s in result["stages"]]
        except (OSError, ValueError, KeyError) as err:
            report.append(f"- gpu-check.json unreadable: {err}")
        start = time.monotonic()
        gates = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *GATES], cwd=ROOT,
                               env=dict(env, NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True)
        last = (gates.stdout.strip().splitlines() or ["no output"])[-1]
        print(f"static gates with tools {name}: exit {gates.returncode}: {last}", flush=True)
        if gates.returncode != 0:
            print(gates.stdout[-6000:] + gates.stderr[-2000:])
            failed.append(f"the static gates with tools {name} (exit {gates.returncode})")
        report += ["", f"- static gates ({', '.join(GATES)}): exit {gates.returncode} in {time.monotonic() - start:.0f} s: {last}", ""]
    OUT.mkdir(parents=True, exist_ok=True)
    report += ["", "verdict: " + ("every dry run and every gate passed" if not failed else "FAILED: " + "; ".join(failed))]
    (OUT / "rehearsal.md").write_text("\n".join(report) + "\n")
    print("\n".join(report[4:]))
    print(f"rehearsal: {'pass' if not failed else 'FAIL'} (report: {OUT / 'rehearsal.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
