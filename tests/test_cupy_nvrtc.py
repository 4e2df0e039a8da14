"""Every CUDA C source of gpu.cupy_kernels compiles with NVRTC for sm_90 and sm_80 (no GPU needed).

The CuPy backend compiles its kernels at run time, on the user's machine; a
syntax or type error would only show there.  Each registered source (each
``.cu`` file, and each element-wise or reduction body wrapped in an
equivalent ``__global__`` function, float and double) is compiled here by
NVRTC through ``cuda.bindings.nvrtc``, and the registry is checked to cover
every kernel the package's sources construct.
"""

import ast
import importlib
import os
import pkgutil

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed: pip install -e '.[dev,cuda13]' (or cuda12)")

import gpu.cupy_kernels  # noqa: E402
from gpu.cupy_kernels import _backend  # noqa: E402

PACKAGE_DIR = os.path.dirname(gpu.cupy_kernels.__file__)
MODULES = sorted(m.name for m in pkgutil.iter_modules([PACKAGE_DIR]))
for _name in MODULES:  # every module registers its sources when imported (ovq too, when it is there)
    importlib.import_module(f"gpu.cupy_kernels.{_name}")

# CuPy's kernel constructors: only _backend may call them, inside the classes that register what they compile
CUPY_KERNELS = {"ElementwiseKernel", "ReductionKernel", "RawKernel", "RawModule"}
REGISTERING = {"Elementwise": "elementwise", "Reduction": "reduction", "RawModuleSource": "cu"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", sorted(_backend.SOURCES))
def test_source_compiles(name, arch):
    assert _backend.compile_all_sources(arch, names={name})[name] > 0


def _calls(module):
    with open(os.path.join(PACKAGE_DIR, f"{module}.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            yield name, node


def test_registry_covers_every_kernel_and_cu_file():
    registered = set(_backend.SOURCES)
    seen = set()
    for module in MODULES:
        for name, node in _calls(module):
            if name in CUPY_KERNELS:
                assert module == "_backend", f"{module}.py builds a cupy.{name} directly: use _backend's registering classes"
            if name in REGISTERING and module != "_backend":
                first = node.args[0]
                assert isinstance(first, ast.Constant) and isinstance(first.value, str), f"{module}.py: {name} needs a literal name"
                key = f"{REGISTERING[name]}:{first.value}"
                assert key in registered, f"{module}.py: {key} is not registered"
                seen.add(key)
    cu_files = {f"cu:{f}" for f in os.listdir(PACKAGE_DIR) if f.endswith(".cu")}
    assert cu_files and cu_files <= registered, f"unregistered .cu files: {sorted(cu_files - registered)}"
    assert registered == seen | cu_files, f"registered but not constructed in the sources: {sorted(registered - seen - cu_files)}"
    # the backend's own constructors of CuPy kernels sit in the registering classes only
    backend_kernels = [name for name, _ in _calls("_backend") if name in CUPY_KERNELS]
    assert sorted(backend_kernels) == ["ElementwiseKernel", "RawModule", "ReductionKernel"]


def test_broken_source_fails_with_the_log():
    broken = 'extern "C" __global__ void k(float* a) { a[threadIdx.x] = undeclared_name + ; }'
    with pytest.raises(RuntimeError, match=r"broken\.cu: NVRTC failed to compile for sm_90(.|\n)*undeclared_name"):
        _backend.compile_source(broken, "sm_90", "broken.cu")


def test_broken_kernel_body_fails():
    body = _backend.Elementwise.__new__(_backend.Elementwise)
    body.name, body.in_params, body.out_params, body.preamble = "broken_body", "T s", "T y", ""
    body.operation = "y = s * no_such_function(s)"
    with pytest.raises(RuntimeError, match="no_such_function"):
        _backend.compile_source(body.wrapped_source(), "sm_80", "broken_body")
