"""An experiment for ``tests/test_sweep_dask.py``: its point ``hold`` waits for a file, so that a test can kill its worker.

Each point touches ``$SWEEP_HOLD_DIR/started-NAME-PID`` when it starts; the
point ``hold`` then waits (up to a minute) for ``$SWEEP_HOLD_DIR/release``.
A test kills the process named in the first ``started-hold-*`` file, then
creates ``release``: the point can only finish by being run again elsewhere.
"""

import os
import time
from pathlib import Path

NAME = "hold"
PARAMS = ("name", "seed")
METRICS = ("value",)
TIMINGS = ()


def grid(quick, seeds):
    return [{"name": n, "seed": s} for n in ("a", "hold", "bb", "ccc") for s in range(seeds)]


def run_point(point):
    folder = Path(os.environ["SWEEP_HOLD_DIR"])
    (folder / f"started-{point['name']}-{os.getpid()}").touch()
    if point["name"] == "hold":
        deadline = time.monotonic() + 60
        while not (folder / "release").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{folder / 'release'} never appeared")
            time.sleep(0.05)
    return {"value": float(10 * len(point["name"]) + point["seed"])}


def table(rows):
    return f"{len(rows)} rows"


def plot(rows, path):
    pass
