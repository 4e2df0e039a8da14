"""Every Numba-CUDA kernel compiles for real GPUs (sm_90 and sm_80), and the kernel sources keep the simulator's rules.

The CUDA simulator runs kernels as Python, so it accepts code that the CUDA
compiler refuses.  These tests compile every kernel registered with
``gpu.numba_cuda._device.kernel`` to PTX with :func:`numba.cuda.compile_ptx`,
in float32 and float64, for compute capabilities 9.0 and 8.0 where ptxas
is missing (with ptxas, ``tests/test_gpu_resources.py`` compiles every kernel
for both, from one lowering, and assembles sm_90's, which is the stricter
check; here each module's kernels are then only listed).  That needs
the real CUDA target, so each module is compiled in a fresh process with
``NUMBA_ENABLE_CUDASIM=0`` (this process may be running the simulator); it
needs NVVM (from the ``numba-cuda[cu12]`` or ``[cu13]`` wheels of the CUDA extra ``make install`` adds), not a GPU.
"""

from __future__ import annotations

import ast
import json
import os
import re
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
from gpu.numba_cuda._device import KERNELS, REPLACED, compile_targets, kernel_dtypes
names = [n for n in KERNELS if n.rsplit(".", 1)[0] == module.__name__]
ccs = [tuple(int(c) for c in cc.split(".")) for cc in sys.argv[2].split(",") if cc]
compiled = compile_targets(ccs, names) if ccs else {}
result = {f"sm_{cc[0]}{cc[1]}": sorted(f"{n}:{t}" for n, t in codes) for cc, codes in compiled.items()}
dtypes = {n: [str(f) for f in kernel_dtypes(n)] for n in names}
print(json.dumps({"kernels": names, "compiled": result, "dtypes": dtypes, "replaced": REPLACED}))
"""


def _real_target_env():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    return env


def _targets():
    """sm_90 and sm_80, unless ptxas is installed: then ``test_gpu_resources.py`` compiles every kernel for both from
    one lowering and assembles sm_90's (a stricter check of the same compile), so it is not done twice."""
    from gpu import sass

    return [] if sass.find_tool("ptxas") else ["9.0", "8.0"]


def _compile(module):
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, module, ",".join(_targets())], capture_output=True, text=True, cwd=ROOT,
        env=_real_target_env(), timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fresh_json(code, folder):
    """What ``code`` prints last, as JSON, run in a fresh process with the real CUDA target and ``folder`` as its
    first argument (where the test wrote its module)."""
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, cwd=ROOT,
                          env=_real_target_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
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


def _function_name(registered):
    """``module.function[float32]`` -> ``function``: the Python function a registry name stands for."""
    return registered.rsplit(".", 1)[1].split("[", 1)[0]


@pytest.mark.parametrize("module", MODULES)
def test_every_kernel_compiles_to_ptx_for_sm90_and_sm80(module):
    """Every kernel, in every float type it runs in (both, or the one of a per-type build), for both GPUs."""
    kernels, _ = _kernel_functions(PACKAGE / f"{module}.py")
    report = _compile(module)
    assert sorted({_function_name(n) for n in report["kernels"]}) == sorted(set(kernels))
    assert not report["replaced"], f"registered twice (give each build its dtypes=): {report['replaced']}"
    assert sorted(report["compiled"]) == sorted(f"sm_{cc.replace('.', '')}" for cc in _targets())
    for cc, compiled in report["compiled"].items():
        expected = sorted(f"{n}:{t}" for n in report["kernels"] for t in report["dtypes"][n])
        assert compiled == expected, cc
    covered = {(_function_name(n), t) for n in report["kernels"] for t in report["dtypes"][n]}
    assert covered == {(k, t) for k in kernels for t in ("float32", "float64")}, "a kernel misses a float type"


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


def test_a_kernel_calling_a_device_function_compiles_without_a_gpu(tmp_path):
    """Numba-CUDA compiles a device function for the current device; :func:`compile_all` stands in for it.

    Without the stand-in, compiling a kernel that calls ``@cuda.jit(device=True)``
    asks the CUDA driver for the current device's compute capability and fails
    on a machine without one.  The PTX must hold the device function's body
    (its ``x + x`` as an ``add`` of the kernel's float type).
    """
    source = '''
from numba import cuda
from gpu.numba_cuda._device import kernel

@cuda.jit(device=True)
def twice(a):
    return a + a

@kernel(lambda f: (f[::1],))
def calls_twice(x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = twice(x[i])
'''
    (tmp_path / "device_function_module.py").write_text(source)
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import device_function_module\n"
        "from gpu.numba_cuda._device import compile_all\n"
        "out = {}\n"
        "for cc in ((9, 0), (8, 0)):\n"
        "    for (n, t), ptx in compile_all(cc, ['device_function_module.calls_twice'], ptx=True).items():\n"
        "        out[f'sm_{cc[0]}{cc[1]}:{t}'] = ptx\n"
        "print(json.dumps(out))\n"
    )
    ptx = _fresh_json(code, tmp_path)
    assert sorted(ptx) == ["sm_80:float32", "sm_80:float64", "sm_90:float32", "sm_90:float64"]
    for key, text in ptx.items():
        cc, t = key.split(":")
        assert f".target {cc}" in text, key
        assert "twice" in text, key  # the device function is part of the module
        assert f"add.f{t[-2:]}" in text or f"add.rn.f{t[-2:]}" in text, key


def _same_code(ptx):
    """PTX with its symbol names made neutral: the mangled names encode the compile flags (the capability among
    them) and the shared arrays are numbered in compile order, so two compiles of one kernel differ only there."""
    return re.sub(r"_cudapy_smem_\d+", "_cudapy_smem", re.sub(r"_ZN\w+", "_ZN", ptx))


def test_one_lowering_gives_each_capability_the_ptx_of_its_own_compile(tmp_path):
    """:func:`compile_targets` lowers a kernel once; the PTX NVVM writes from it for sm_90 and for sm_80 is, but for
    symbol names, the PTX of a full :func:`numba.cuda.compile_ptx` for each (a kernel with a device function, launch bounds and a
    shared array)."""
    source = '''
from numba import cuda
from gpu.numba_cuda._device import kernel

@cuda.jit(device=True)
def twice(a):
    return a + a

@kernel(lambda f: (f[::1],), threads=64, options={"launch_bounds": (64, 8)})
def staged(x):
    sh = cuda.shared.array(64, dtype=x.dtype)
    i = cuda.grid(1)
    sh[cuda.threadIdx.x] = twice(x[i]) if i < x.shape[0] else 0
    cuda.syncthreads()
    if i < x.shape[0]:
        x[i] = sh[63 - cuda.threadIdx.x] * x[i]
'''
    (tmp_path / "lowering_module.py").write_text(source)
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import lowering_module\n"
        "from numba import cuda\n"
        "from gpu.numba_cuda import _device\n"
        "name = 'lowering_module.staged'\n"
        "once = _device.compile_targets([(9, 0), (8, 0)], [name])\n"
        "fn, signature = _device.KERNELS[name]\n"
        "out = {}\n"
        "for cc in ((9, 0), (8, 0)):\n"
        "    for f in _device.kernel_dtypes(name):\n"
        "        with _device._current_device_reports(cc):\n"
        "            full, _ = cuda.compile_ptx(fn, signature(f), cc=cc, **_device.compile_options(name, f))\n"
        "        out[f'sm_{cc[0]}{cc[1]}:{f}'] = [once[cc][(name, str(f))], full]\n"
        "print(json.dumps(out))\n"
    )
    pairs = _fresh_json(code, tmp_path)
    assert sorted(pairs) == ["sm_80:float32", "sm_80:float64", "sm_90:float32", "sm_90:float64"]
    for key, (once, full) in pairs.items():
        assert f".target {key.split(':')[0]}" in once and ".maxntid 64" in once and "_cudapy_smem" in once, key
        assert _same_code(once) == _same_code(full), key


def test_the_registry_keeps_block_sizes_tags_and_compile_options(tmp_path):
    """``kernel(..., threads=, tags=, options=)``: what the resource checks read, and the launch bounds compiled in.

    A kernel registered without ``threads`` is given the default block size,
    marked as assumed; options given per float type reach the PTX (the
    launch bounds become ``.maxntid`` and ``.minnctapersm``); a kernel built
    once per float type is compiled in that type only, and a build that
    replaces another under the same name is recorded.
    """
    source = '''
from numba import cuda, float32, float64
from gpu.numba_cuda._device import kernel

@kernel(lambda f: (f[::1],))
def plain(x):
    x[cuda.grid(1)] = 0

@kernel(lambda f: (f[::1],), threads=lambda f: 128 if f == float32 else 64, tags=("gma",),
        options=lambda f: {"launch_bounds": (128 if f == float32 else 64, 4)})
def bounded(x):
    x[cuda.grid(1)] = 0

def build(f, width):
    @kernel(lambda f: (f[::1],), dtypes=(f,))
    def per_type(x):
        x[cuda.grid(1)] = width
    return per_type

build(float32, 1)
build(float64, 2)
build(float64, 3)  # a second build under the name of the second: it replaces it
'''
    (tmp_path / "registry_module.py").write_text(source)
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import registry_module\n"
        "from numba import float32, float64\n"
        "from gpu.numba_cuda._device import compile_all, launch_info, DEFAULT_THREADS\n"
        "info = {n: [list(launch_info('registry_module.' + n, f)[:2]) + [sorted(launch_info('registry_module.' + n, f)[2])]\n"
        "            for f in (float32, float64)] for n in ('plain', 'bounded')}\n"
        "ptx = {t: p for (n, t), p in compile_all((9, 0), ['registry_module.bounded'], ptx=True).items()}\n"
        "from gpu.numba_cuda._device import KERNELS, REPLACED\n"
        "per_type = sorted(f'{n}:{t}' for n, t in compile_all((9, 0), [k for k in KERNELS if 'per_type' in k]))\n"
        "print(json.dumps({'info': info, 'default': DEFAULT_THREADS, 'ptx': ptx, 'per_type': per_type,\n"
        "                  'replaced': REPLACED}))\n"
    )
    out = _fresh_json(code, tmp_path)
    default = out["default"]
    assert out["info"]["plain"] == [[default, True, []], [default, True, []]]
    assert out["info"]["bounded"] == [[128, False, ["gma"]], [64, False, ["gma"]]]
    assert ".maxntid 128" in out["ptx"]["float32"] and ".maxntid 64" in out["ptx"]["float64"]
    assert all(".minnctapersm 4" in p for p in out["ptx"].values())
    # one build per float type: each compiled in its own type only, a second build of one type recorded
    assert out["per_type"] == ["registry_module.per_type[float32]:float32", "registry_module.per_type[float64]:float64"]
    assert [n for n in out["replaced"] if n.startswith("registry_module.")] == ["registry_module.per_type[float64]"]


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


_WITHOUT_ROW_STACK = """
import json
import numpy as np
import refimpl  # SciPy first: it copies NumPy's names, row_stack among them, while NumPy still has it
if hasattr(np, "row_stack"):  # a NumPy before 2.5: made like 2.5, which removed the alias
    del np.row_stack
from gpu.numba_cuda import _device
from numba import cuda, float32

def probe(a):
    a[0] = 1.0

ptx, _ = cuda.compile_ptx(probe, (float32[::1],), cc=(9, 0))
print(json.dumps([_device.NUMPY_2_5_SHIM, hasattr(np, "row_stack"), ptx.count(".entry")]))
"""


def test_kernels_compile_under_a_numpy_without_row_stack(tmp_path):
    """NumPy 2.5 removed ``np.row_stack``, whose overload Numba-CUDA 0.30.4 registers at its first compile: without
    ``_device``'s help no kernel compiles there (the GPU machines have NumPy 2.5); with it, NumPy is left without it."""
    shim, alias_left, entries = _fresh_json(_WITHOUT_ROW_STACK, tmp_path)
    assert shim is True and alias_left is False and entries == 1
