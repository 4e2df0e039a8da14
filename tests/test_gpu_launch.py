"""Every launch of every public Numba-CUDA function stays inside the GPU's grid and block limits, at any size.

A grid has at most ``2^31 - 1`` blocks along ``x`` and 65,535 along ``y``
and ``z``; a block at most 1,024 threads.  A launch past them fails on the
GPU only (the simulator does not check), so each module of
:mod:`gpu.numba_cuda` gives its launches as a pure function of the shapes,
``launch_geometry``, and this test calls it, for every public function, at
``N = 2^24`` tokens, ``B H = 2^20`` sequences and both together, in float32
and float64.  The geometry is the GPU's: it is read in a process with the
real CUDA target (``NUMBA_ENABLE_CUDASIM=0``; no GPU is needed, no kernel is
compiled).

``launch_geometry`` may return one ``(grid, block)`` pair, a mapping or a
sequence of them, or a named tuple holding them; a grid or block is an int or
a tuple of up to three ints.  Its parameters are filled by name from the
shapes of the call (:data:`SHAPES`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_THREADS = 1024

#: The sizes: tokens, sequences (batch times heads).
CASES = {"N=2^24": (1 << 24, 1), "BH=2^20": (64, 1 << 20), "N=2^24, BH=2^20": (1 << 24, 1 << 20)}

#: The module of each public function whose ``launch_geometry`` gives its launches, and the values of its
#: parameters besides the sizes (``N``, ``B H``), by parameter name.
PUBLIC = {
    "responsibilities": "gmm",
    "log_responsibilities": "gmm",
    "softmax_attention": "attention",
    "gma": "gma",
    "gma_forward": "gma",
    "gma_backward": "gma",
    "ovq_attention": "ovq",
    "vq_attention": "ovq",
}

_PROBE = r"""
import importlib, inspect, json, sys
import numpy as np
import gpu.numba_cuda as nc

public, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}

def pairs(obj):
    # (grid, block) pairs in what launch_geometry returns
    def dims(x):
        return isinstance(x, (int, np.integer)) or (
            isinstance(x, tuple) and 1 <= len(x) <= 3 and all(isinstance(v, (int, np.integer)) for v in x))
    if isinstance(obj, tuple) and len(obj) == 2 and dims(obj[0]) and dims(obj[1]):
        return [[list(np.atleast_1d(obj[0]).tolist()), list(np.atleast_1d(obj[1]).tolist())]]
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in pairs(v)]
    if isinstance(obj, (tuple, list)):
        return [p for v in obj for p in pairs(v)]
    return []

for fn, module in public.items():
    mod = importlib.import_module("gpu.numba_cuda." + module)
    geometry = getattr(mod, "launch_geometry", None)
    if geometry is None:
        out[fn] = {"error": f"gpu.numba_cuda.{module} has no launch_geometry"}
        continue
    params = inspect.signature(geometry).parameters
    rows = {}
    for case, (N, BH) in cases.items():
        for dtype in ("float32", "float64"):
            # every name a module's launch_geometry uses for a shape of the call
            shapes = dict(N=N, N_q=N, N_k=N, T=N, B=BH, BH=BH, heads=BH, H=1, K=256, d=64, d_r=64, d_v=64, F=256, E=65,
                          n_max=1024, max_size=1024, chunk_size=256, chunk=256, C=256, S=1024,
                          dtype=np.dtype(dtype), causal=True, with_keys=fn != "vq_attention")
            missing = [p for p, v in params.items() if p not in shapes and v.default is inspect.Parameter.empty]
            if missing:
                rows[f"{case} {dtype}"] = {"error": f"launch_geometry{inspect.signature(geometry)}: no value for {missing}"}
                continue
            kwargs = {p: shapes[p] for p in params if p in shapes}
            rows[f"{case} {dtype}"] = {"launches": pairs(geometry(**kwargs))}
    out[fn] = rows
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def geometries():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(PUBLIC), json.dumps(CASES)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_public_function_is_checked():
    import ast

    tree = ast.parse((ROOT / "gpu" / "numba_cuda" / "__init__.py").read_text())
    names = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    public = {ast.literal_eval(e) for e in names.elts}
    functions = {n for n in public if n[0].islower()}  # classes (GMADeviceCache) launch nothing themselves
    assert functions == set(PUBLIC)


def violations(launches):
    """The launches ``[grid, block]`` that break a limit, each with the limit it breaks."""
    bad = []
    for grid, block in launches:
        grid = list(grid) + [1] * (3 - len(grid))
        threads = 1
        for b in block:
            threads *= b
        if not 1 <= grid[0] <= MAX_GRID_X:
            bad.append(f"grid x = {grid[0]}")
        if not all(1 <= g <= MAX_GRID_YZ for g in grid[1:]):
            bad.append(f"grid y, z = {grid[1:]}")
        if not 1 <= threads <= MAX_THREADS:
            bad.append(f"{threads} threads a block")
    return bad


def test_the_limit_check_sees_each_limit():
    assert violations([[[MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ], [32, 32]]]) == []
    assert violations([[[MAX_GRID_X + 1], [1]]]) == [f"grid x = {MAX_GRID_X + 1}"]
    assert violations([[[1, 65536], [1]]]) == ["grid y, z = [65536, 1]"]
    assert violations([[[1, 1, 65536], [1]]]) == ["grid y, z = [1, 65536]"]
    assert violations([[[1], [32, 33]]]) == ["1056 threads a block"]
    assert violations([[[0], [0]]]) == ["grid x = 0", "0 threads a block"]


@pytest.mark.parametrize("function", sorted(PUBLIC))
def test_every_launch_is_within_the_grid_and_block_limits(geometries, function):
    rows = geometries[function]
    assert "error" not in rows, rows.get("error")
    for case, row in rows.items():
        assert "error" not in row, f"{case}: {row.get('error')}"
        assert row["launches"], f"{case}: launch_geometry gave no (grid, block) pair"
        bad = violations(row["launches"])
        assert not bad, f"{function}, {case}: {bad} in {row['launches']}"
