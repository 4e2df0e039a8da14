"""Every Numba-CUDA kernel compiles for real GPUs (sm_90 and sm_80), and the kernel sources keep the simulator's rules.

The CUDA simulator runs kernels as Python, so it accepts code that the CUDA
compiler refuses.  These tests compile every kernel registered with
``gpu.numba_cuda._device.kernel`` to PTX with :func:`numba.cuda.compile_ptx`,
in float32 and float64, for compute capabilities 9.0 and 8.0.  That needs
the real CUDA target, so each module is compiled in a fresh process with
``NUMBA_ENABLE_CUDASIM=0`` (this process may be running the simulator); it
needs NVVM (from the ``numba-cuda[cu12]`` or ``[cu13]`` wheels of the CUDA extra ``make install`` adds), not a GPU.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpu" / "numba_cuda"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")

_COMPILE = """
import importlib, json, sys
module = importlib.import_module("gpu.numba_cuda." + sys.argv[1])
from gpu.numba_cuda._device import KERNELS, compile_all
names = [n for n in KERNELS if n.rsplit(".", 1)[0] == module.__name__]
result = {f"sm_{cc[0]}{cc[1]}": sorted(f"{n}:{t}" for n, t in compile_all(cc, names)) for cc in ((9, 0), (8, 0))}
print(json.dumps({"kernels": names, "compiled": result}))
"""


def _real_target_env():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    return env


def _compile(module):
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, module], capture_output=True, text=True, cwd=ROOT, env=_real_target_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernel_functions(path):
    """Names of the functions of ``path`` decorated as kernels (``@kernel(...)``) or with ``cuda.jit``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    kernels, raw_jit = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec.func if isinstance(dec, ast.Call) else dec
            text = ast.unparse(call)
            if text == "kernel":
                kernels.append(node.name)
            elif text == "cuda.jit":
                device = isinstance(dec, ast.Call) and any(
                    kw.arg == "device" and isinstance(kw.value, ast.Constant) and kw.value.value for kw in dec.keywords
                )
                if not device:
                    raw_jit.append(node.name)
    return kernels, raw_jit


@pytest.mark.parametrize("module", MODULES)
def test_every_kernel_compiles_to_ptx_for_sm90_and_sm80(module):
    kernels, _ = _kernel_functions(PACKAGE / f"{module}.py")
    report = _compile(module)
    assert sorted(n.rsplit(".", 1)[1] for n in report["kernels"]) == sorted(kernels)
    for cc, compiled in report["compiled"].items():
        expected = sorted(f"{n}:{t}" for n in report["kernels"] for t in ("float32", "float64"))
        assert compiled == expected, cc


@pytest.mark.parametrize("module", MODULES)
def test_every_kernel_is_registered(module):
    """A kernel declared with a bare ``cuda.jit`` would escape the PTX check: every kernel uses ``@kernel``."""
    _, raw_jit = _kernel_functions(PACKAGE / f"{module}.py")
    assert not raw_jit, f"{module}: declare these kernels with @kernel(signature): {raw_jit}"


def test_the_compile_check_catches_what_the_simulator_accepts(tmp_path):
    """A shared array sized at run time runs in the simulator (it is Python there) but cannot compile."""
    source = '''
from numba import cuda, float64
from gpu.numba_cuda._device import kernel

@kernel(lambda f: (f[::1],))
def bad(x):
    tmp = cuda.shared.array(x.shape[0], float64)
    tmp[0] = 1.0
    x[0] = tmp[0]
'''
    (tmp_path / "bad_kernel_module.py").write_text(source)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import bad_kernel_module, numpy as np\n"
        "from numba import cuda\n"
        "import os\n"
        "if os.environ['NUMBA_ENABLE_CUDASIM'] == '1':\n"
        "    bad_kernel_module.bad[1, 1](np.ones(2)); print('ran')\n"
        "else:\n"
        "    from gpu.numba_cuda._device import compile_all\n"
        "    compile_all((9, 0), ['bad_kernel_module.bad'])\n"
    )
    sim = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=300)
    assert sim.returncode == 0 and "ran" in sim.stdout, sim.stderr[-2000:]
    real = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          env=_real_target_env(), timeout=300)
    assert real.returncode != 0 and "TypingError" in real.stderr, real.stderr[-2000:]


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


@pytest.mark.parametrize("module", MODULES)
def test_simulator_rules_hold_in_the_kernel_sources(module):
    """One ``cuda.shared.array`` per source line, and no warp shuffles (the simulator has none)."""
    path = PACKAGE / f"{module}.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    shared_lines = [node.lineno for node, name in _calls(tree) if name == "cuda.shared.array"]
    assert len(shared_lines) == len(set(shared_lines)), f"{module}: two shared arrays on one line"
    shuffles = [name for _, name in _calls(tree) if "shfl" in name]
    assert not shuffles, f"{module}: warp shuffles {shuffles}"


def test_the_rule_scans_see_what_they_look_for(tmp_path):
    tree = ast.parse("a = cuda.shared.array(4, f); b = cuda.shared.array(4, f)\ny = cuda.shfl_down_sync(m, v, 1)")
    names = [name for _, name in _calls(tree)]
    assert names.count("cuda.shared.array") == 2 and "cuda.shfl_down_sync" in names
    probe = tmp_path / "probe.py"
    probe.write_text(
        "@kernel(lambda f: (f[::1],))\ndef a(x): pass\n"
        "@cuda.jit\ndef b(x): pass\n"
        "@cuda.jit(device=True)\ndef c(x): return x\n"
    )
    assert _kernel_functions(probe) == (["a"], ["b"])
