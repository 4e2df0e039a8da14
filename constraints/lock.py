"""Write the constraints files that ``make install`` installs with: ``python constraints/lock.py`` (``make lock``).

Each file pins every package that ``pip install -e '.[dev,course,EXTRA]'``
resolves to today, one ``name==version`` a line, for ``pip install -c``:

* ``cuda13.txt``: the newest releases pip resolves for ``.[dev,course,cuda13]``,
  the set CI installs (``make install``) and tests;
* ``cuda12.txt``: ``.[dev,course,cuda12]`` resolved with every package of
  ``cuda13.txt`` that names no CUDA major held at its version, so the two
  differ only in the CUDA stack (CuPy, ``cuda-*`` and ``nvidia-*``).

The resolution is pip's own (``pip install --dry-run --ignore-installed
--report``), by the Python that runs this script, for its platform.  Commit
the files once ``make test`` and ``.ci/run`` pass with them: they are then the
versions CI last passed with.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROJECT = "gmattn-reference"
#: packages whose release is tied to one CUDA major; the rest of a lock is the same for both extras
CUDA_PREFIXES = ("cupy-", "cuda-", "nvidia-")


def resolve(extras: str, constraints: Path | None = None) -> dict[str, str]:
    """``{name: version}`` that pip resolves for ``-e '.[extras]'`` (``-c constraints`` when given), the project left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--report", str(report), "-e", f"{ROOT}[{extras}]"]
        if constraints is not None:
            cmd += ["-c", str(constraints)]
        subprocess.run(cmd, check=True)
        installed = json.loads(report.read_text())["install"]
    pins = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in installed}
    pins.pop(PROJECT, None)
    return dict(sorted(pins.items()))


def write(path: Path, pins: dict[str, str], extras: str, note: str) -> None:
    today = datetime.date.today().isoformat()
    where = f"Python {platform.python_version()}, {platform.system()} {platform.machine()}"
    header = [
        f"# The versions `make install CUDA_EXTRA={extras.rsplit(',', 1)[-1]}` installs (pip -c): .[{extras}] as pip",
        f"# resolved it on {today} ({where}). {note}",
        "# Written by `make lock` (constraints/lock.py); `make install LOCK=` or `make install-latest` ignores it.",
    ]
    path.write_text("\n".join(header + [f"{name}=={version}" for name, version in pins.items()]) + "\n")
    print(f"{path.relative_to(ROOT)}: {len(pins)} packages")


def main() -> int:
    cuda13 = resolve("dev,course,cuda13")
    write(HERE / "cuda13.txt", cuda13, "dev,course,cuda13", "CI installs and tests these.")
    shared = {n: v for n, v in cuda13.items() if not n.startswith(CUDA_PREFIXES)}
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "shared.txt"
        held.write_text("".join(f"{n}=={v}\n" for n, v in shared.items()))
        cuda12 = resolve("dev,course,cuda12", held)
    write(HERE / "cuda12.txt", cuda12, "dev,course,cuda12",
          "CI runs cuda13: all but the CUDA 12 stack is held at cuda13.txt's versions.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
