"""Plumbing shared by the CuPy kernels: the array module, host/device arrays, and the registry of CUDA C sources.

The array module
----------------
Host code that is plain array code is written once, for an array module
``xp`` (:mod:`numpy` or :mod:`cupy`), and every fused step is a
:class:`Elementwise`, :class:`Reduction` or :class:`RawModuleSource` kernel
that also carries a NumPy twin of the same math.  So the logic of every
public function runs on a machine without a GPU with ``xp = numpy`` (the
``*_xp`` functions of each module, which the tests compare with
:mod:`refimpl`), and on the device with ``xp = cupy``.  The public functions
always compute on the device (:func:`device_module`): CuPy arrays in give
CuPy arrays out, NumPy arrays in are copied to the device and the results
come back as NumPy arrays.  Without a usable device they raise a
``RuntimeError`` naming the backend.

Validation
----------
Shapes, dtypes and values are checked by the very functions :mod:`refimpl`
uses, so the errors are the same: a device array is checked through
:func:`host_view` (a zero-stride host array of its shape and dtype, no copy)
and its values by :func:`check_finite` (a device-side test, copied to the
host only to word the error).

Registry of CUDA C sources
--------------------------
Every CUDA C source the backend compiles at run time is registered here:
each ``.cu`` file (:class:`RawModuleSource`) and each element-wise or
reduction kernel body, wrapped in an equivalent ``extern "C" __global__``
function instantiated for float and double (:class:`Elementwise`,
:class:`Reduction`).  :func:`compile_all_sources` compiles them all with
NVRTC (``cuda.bindings.nvrtc``) for a given architecture, no GPU needed, so
that a syntax or type error fails CI.

Host syncs, launches and TF32
-----------------------------
Every result check of a public call (the finite inputs, ``min_quad``, the
screen's suspect rows, the denominators, the overflowed rows) is a counter
in one small device array (:class:`Checks`); kernels add to it on the
device, and it is copied to the host once, at the end of the call
(:func:`to_host`, the only copy of the checks).  Only when a counter is not
zero does the call copy more, to word the error with the checker of
:mod:`refimpl.validation` or to recompute the rows the screen flagged.
:func:`result_checks` turns the checks off (no copy at all).

:func:`launch_count` counts every kernel this backend launches (its
:class:`RawModuleSource`, :class:`Elementwise` and :class:`Reduction`
kernels) and every cuBLAS call it makes (:func:`matmul`), on the device or,
with NumPy, as the twins that stand for them; :func:`host_copy_count`
counts :func:`to_host`.  CuPy's own array routines (allocations, small
reductions over the parameters) are not counted.  :func:`tf32` lets cuBLAS
round float32 GEMM inputs to TF32 (off by default).
"""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np

from refimpl import boundary, validation

__all__ = [
    "SOURCES",
    "Elementwise",
    "Reduction",
    "RawModuleSource",
    "compile_source",
    "compile_all_sources",
    "probe",
    "is_device_array",
    "device_module",
    "host_view",
    "to_host",
    "as_module_array",
    "check_finite",
    "all_true",
    "result",
    "Checks",
    "launch",
    "matmul",
    "launch_count",
    "host_copy_count",
    "count_launches",
    "tf32",
    "tf32_enabled",
    "result_checks",
    "checks_enabled",
]

HERE = os.path.dirname(os.path.abspath(__file__))

#: ``{name: callable returning the CUDA C source to compile}``: every source the backend compiles at run time.
SOURCES: dict = {}

#: NVRTC options shared by every compilation (CuPy's RawModule gets the same standard).
NVRTC_OPTIONS = ("--std=c++17",)


# what launch_count and host_copy_count report: totals since import
_COUNTS = {"launches": 0, "host_copies": 0}
_SETTINGS = {"tf32": False, "checks": True}


def launch_count() -> int:
    """Kernels launched and cuBLAS calls made by this backend since import (twins on the NumPy path included)."""
    return _COUNTS["launches"]


def host_copy_count() -> int:
    """Device-to-host copies made through :func:`to_host` since import (calls on the NumPy path included)."""
    return _COUNTS["host_copies"]


def _count_launch(n: int = 1) -> None:
    _COUNTS["launches"] += n


class _Counter:
    """What :func:`count_launches` yields: the launches and host copies made inside the ``with`` block so far."""

    def __init__(self):
        self._launches, self._copies = launch_count(), host_copy_count()

    @property
    def launches(self) -> int:
        """Launches and cuBLAS calls since the block began."""
        return launch_count() - self._launches

    @property
    def host_copies(self) -> int:
        """Copies to the host since the block began."""
        return host_copy_count() - self._copies


@contextlib.contextmanager
def count_launches():
    """Count the launches and host copies of a block: ``with count_launches() as c: ...; c.launches, c.host_copies``."""
    yield _Counter()


class _Setting:
    """A module-level switch, set at once; as a context manager it restores the previous value on exit."""

    def __init__(self, key, value):
        self.key, self.previous = key, _SETTINGS[key]
        _SETTINGS[key] = bool(value)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _SETTINGS[self.key] = self.previous
        return False


def tf32(enabled: bool = True) -> _Setting:
    """Let cuBLAS compute float32 GEMMs with TF32 tensor cores (``True``) or in full float32 (``False``, the default).

    TF32 rounds the GEMM inputs to 10 bits of mantissa: about ``1e-3``
    relative error in the products, far more than the float32 tolerances of
    the tests, so it is off unless asked for.  Sets the switch at once, and
    as a context manager (``with tf32(True): ...``) restores the previous
    value on exit.  The backend sets CuPy's compute type for float32 around
    each of its GEMMs (``cupy._core.set_compute_type``), so CuPy's own
    default does not decide.  float64 GEMMs are never affected.
    """
    return _Setting("tf32", enabled)


def tf32_enabled() -> bool:
    """Whether :func:`tf32` is on."""
    return _SETTINGS["tf32"]


def result_checks(enabled: bool = True) -> _Setting:
    """Turn the result checks of the public functions on (the default) or off; a context manager too.

    Off, a public call copies nothing to the host (NumPy inputs still get
    their results copied back): no input finiteness test for device
    arrays, no check of ``min_quad``, the denominators or overflowed rows,
    and no recomputation of the responsibilities the exactness screen
    flags (the expansion is used as computed: exact to rounding unless the
    means lie far apart relative to the variances, where the screen would
    have recomputed some logits).  For benchmarks and trusted inputs.
    """
    return _Setting("checks", enabled)


def checks_enabled() -> bool:
    """Whether :func:`result_checks` is on."""
    return _SETTINGS["checks"]


def _register(name: str, source) -> None:
    if name in SOURCES:
        raise ValueError(f"CUDA C source {name!r} is registered twice")
    SOURCES[name] = source


# ---------------------------------------------------------------------------
# CuPy, when it can run
# ---------------------------------------------------------------------------

_PROBE = None


def _cupy():
    import cupy

    return cupy


def probe() -> tuple[bool, str]:
    """Whether CuPy can allocate on a device here, and why or why not (cached after the first call).

    ``import cupy`` works without a GPU; the first allocation is what fails,
    so the probe allocates one element.
    """
    global _PROBE
    if _PROBE is None:
        try:
            cupy = _cupy()
        except ImportError as e:
            _PROBE = (False, f"cupy cannot be imported ({e}); install the GPU extra: pip install -e '.[cuda12]' or '.[cuda13]'")
            return _PROBE
        try:
            cupy.zeros(1)
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else name
            _PROBE = (True, f"gpu.cupy_kernels runs on the device {name}")
        except Exception as e:  # no driver, no device, or a driver too old for this CuPy
            _PROBE = (False, f"CuPy cannot allocate on a CUDA device ({type(e).__name__}: {e})")
    return _PROBE


def is_device_array(a) -> bool:
    """True for a CuPy array or any object with ``__cuda_array_interface__`` (a Numba device array, say)."""
    return hasattr(a, "__cuda_array_interface__")


def device_module(*arrays):
    """The array module the public functions compute with: :mod:`cupy`, or a ``RuntimeError`` naming the backend.

    Device arrays among the inputs mean a device is there; NumPy inputs need
    one too (they are copied to it).  Without one, the error is
    :func:`gpu.require`'s: why, and how to get the backend (the extra that
    matches the driver, where to read its CUDA version, the simulator).
    """
    if not any(is_device_array(a) for a in arrays) and not probe()[0]:
        import gpu

        gpu.require("cupy")
    return _cupy()


def host_view(a):
    """For a device array, a read-only zero-stride host array of its shape and dtype; anything else unchanged.

    :mod:`refimpl.validation` then checks its shape, dimensions and dtype
    without a copy (its values are all 0: :func:`check_finite` checks them).
    """
    if not is_device_array(a):
        return a
    a = _cupy().asarray(a)
    return np.broadcast_to(np.zeros((), dtype=a.dtype), a.shape)


def to_host(a):
    """A host copy of a computed device array (the checks, or rows to word an error); a host array unchanged.

    Every call is counted (:func:`host_copy_count`), on the NumPy path too,
    where it stands for the copy the device would make.
    """
    _COUNTS["host_copies"] += 1
    return _cupy().asnumpy(a) if is_device_array(a) else a


def parameter_to_host(a):
    """A host copy of a parameter the caller passed on the device (for the checkers); a host array unchanged."""
    return _cupy().asnumpy(a) if is_device_array(a) else a


def as_module_array(xp, a, dtype):
    """``a`` as a C-contiguous array of ``xp`` and ``dtype`` (no copy when it already is one)."""
    if xp is np:
        if is_device_array(a):
            raise TypeError("a device array cannot be computed on with NumPy")
        return np.ascontiguousarray(a, dtype=dtype)
    return xp.ascontiguousarray(xp.asarray(a, dtype=dtype))


def check_finite(a, name: str) -> None:
    """:func:`refimpl.validation.check_finite` for a device array: a device-side test, the message from the host copy.

    Host arrays were checked in full by the checker already.
    """
    if is_device_array(a):
        cupy = _cupy()
        a = cupy.asarray(a)
        if a.size and not bool(cupy.isfinite(a).all()):
            validation.check_finite(cupy.asnumpy(a), name)


def matmul(xp, a, b):
    """``a @ b`` (``xp.matmul``), counted as one cuBLAS call; float32 on the device in the :func:`tf32` mode asked for."""
    _count_launch()
    if xp is np or a.dtype != np.float32:
        return xp.matmul(a, b)
    core = _cupy()._core
    from cupy._core import _routines_linalg as linalg

    before = core.get_compute_type(np.dtype(np.float32))
    core.set_compute_type(np.dtype(np.float32), linalg.COMPUTE_TYPE_TF32 if tf32_enabled() else linalg.COMPUTE_TYPE_FP32)
    try:
        return xp.matmul(a, b)
    finally:
        core.set_compute_type(np.dtype(np.float32), before)


def launch(source, name: str, grid, block, args, twin=None):
    """Launch kernel ``name`` of ``source`` (a :class:`RawModuleSource`) when ``args`` hold a device array, else run ``twin()``.

    Either way one launch is counted: the NumPy twin stands for the kernel.
    """
    _count_launch()
    if any(is_device_array(a) for a in args):
        source.function(name)(grid, block, args)
        return None
    return twin() if twin is not None else None


def all_true(xp, *flags) -> bool:
    """Whether every boolean array (or bool) in ``flags`` is all true, with one transfer to the host."""
    ok = True
    for f in flags:
        ok = ok & (f.all() if hasattr(f, "all") else bool(f))
    return bool(ok)


def result(a, on_device: bool):
    """An array as the caller expects it: as it is (device inputs), or a NumPy copy (NumPy inputs)."""
    if a is None or on_device or isinstance(a, np.ndarray):
        return a
    return _cupy().asnumpy(a)


# ---------------------------------------------------------------------------
# Kernels: CuPy kernels with a NumPy twin, registered for the NVRTC check
# ---------------------------------------------------------------------------

_C_TYPES = {"T": "T", "float64": "double", "float32": "float", "int32": "int", "int64": "long long", "bool": "bool"}


def _params(params: str):
    """``'T a, T b'`` -> ``[('T', 'a'), ('T', 'b')]`` (element-wise parameters only: no ``raw``)."""
    out = []
    for part in params.split(","):
        words = part.split()
        if len(words) != 2 or words[0] not in _C_TYPES:
            raise ValueError(f"kernel parameter {part.strip()!r}: expected '<type> <name>' with a type in {sorted(_C_TYPES)}")
        out.append((_C_TYPES[words[0]], words[1]))
    return out


def _typed(args: str, t: str) -> str:
    return re.sub(r"\bT\b", t, args)


def _templated(name: str, args: str, body: str) -> str:
    """The CUDA C of ``template <typename T> __global__ void name(args) { body }``, instantiated for float and double."""
    return (f"template <typename T>\n__global__ void {name}({args}) {{\n{body}}}\n"
            + "".join(f"template __global__ void {name}<{t}>({_typed(args, t)});\n" for t in ("float", "double")))


class Elementwise:
    """A :class:`cupy.ElementwiseKernel` with a NumPy twin, registered for :func:`compile_all_sources`.

    Parameters
    ----------
    name : str
        Kernel name (unique in the package).
    in_params, out_params : str
        CuPy's parameter lists, e.g. ``'T s, T m'`` and ``'T y'``.
    operation : str
        The CUDA C body of one element.
    twin : callable
        The same math on NumPy arrays: ``twin(*inputs)`` returns the output
        (or a tuple of outputs).
    preamble : str, optional
        CUDA C device functions the body calls.
    """

    def __init__(self, name, in_params, out_params, operation, twin, preamble=""):
        self.name, self.in_params, self.out_params = name, in_params, out_params
        self.operation, self.twin, self.preamble = operation, twin, preamble
        self._kernel = None
        _register(f"elementwise:{name}", self.wrapped_source)

    def wrapped_source(self) -> str:
        """An equivalent ``__global__`` function (one thread per element, float and double) for the NVRTC check."""
        ins, outs = _params(self.in_params), _params(self.out_params)
        args = ", ".join([f"const {t}* _in_{n}" for t, n in ins] + [f"{t}* _out_{n}" for t, n in outs] + ["long long _n"])
        loads = "".join(f"    const {t} {n} = _in_{n}[i];\n" for t, n in ins)
        decls = "".join(f"    {t} {n};\n" for t, n in outs)
        stores = "".join(f"    _out_{n}[i] = {n};\n" for t, n in outs)
        body = (f"    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                f"    if (i >= _n) return;\n{loads}{decls}    {self.operation};\n{stores}")
        return f"{self.preamble}\n" + _templated(f"ew_{self.name}", args, body)

    def __call__(self, *args):
        _count_launch()
        if not any(is_device_array(a) for a in args):
            return self.twin(*args)
        if self._kernel is None:
            self._kernel = _cupy().ElementwiseKernel(self.in_params, self.out_params, self.operation, self.name, preamble=self.preamble)
        return self._kernel(*args)


class Reduction:
    """A :class:`cupy.ReductionKernel` with a NumPy twin, registered for :func:`compile_all_sources`.

    ``map_expr``, ``reduce_expr`` (on ``a`` and ``b``), ``post_map_expr``
    and ``identity`` are CuPy's; the wrapped check reduces each output
    element's ``n`` inputs in a loop.  ``twin(*inputs, axis)`` is the NumPy
    math.
    """

    def __init__(self, name, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, twin):
        self.name, self.in_params, self.out_params = name, in_params, out_params
        self.map_expr, self.reduce_expr, self.post_map_expr, self.identity = map_expr, reduce_expr, post_map_expr, identity
        self.twin = twin
        self._kernel = None
        _register(f"reduction:{name}", self.wrapped_source)

    def wrapped_source(self) -> str:
        """An equivalent ``__global__`` function (one thread per output element, float and double)."""
        ins, outs = _params(self.in_params), _params(self.out_params)
        if len(outs) != 1:
            raise ValueError(f"reduction {self.name}: one output expected")
        (t_out, out_name), = outs
        args = ", ".join([f"const {t}* _in_{n}" for t, n in ins] + [f"{t_out}* _out_{out_name}", "long long _n_out", "long long _n_in"])
        loads = "".join(f"        const {t} {n} = _in_{n}[o * _n_in + _j];\n" for t, n in ins)
        body = (f"    const long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                f"    if (o >= _n_out) return;\n"
                f"    {t_out} _acc = ({t_out})({self.identity});\n"
                f"    for (long long _j = 0; _j < _n_in; ++_j) {{\n{loads}"
                f"        _acc = REDUCE_{self.name}(_acc, ({t_out})({self.map_expr}));\n    }}\n"
                f"    {t_out} {out_name};\n    POST_MAP_{self.name}(_acc);\n"
                f"    _out_{out_name}[o] = {out_name};\n")
        # CuPy expands reduce_expr and post_map_expr as macros of (a, b) and (a): so does the check
        return (
            f"#define REDUCE_{self.name}(a, b) ({self.reduce_expr})\n"
            f"#define POST_MAP_{self.name}(a) ({self.post_map_expr})\n"
            + _templated(f"red_{self.name}", args, body)
            + f"#undef REDUCE_{self.name}\n#undef POST_MAP_{self.name}\n"
        )

    def __call__(self, *args, axis=-1):
        _count_launch()
        if not any(is_device_array(a) for a in args):
            return self.twin(*args, axis=axis)
        if self._kernel is None:
            self._kernel = _cupy().ReductionKernel(
                self.in_params, self.out_params, self.map_expr, self.reduce_expr, self.post_map_expr, self.identity, self.name
            )
        return self._kernel(*args, axis=axis)


class RawModuleSource:
    """A ``.cu`` file beside the module that loads it, compiled once by :class:`cupy.RawModule`.

    ``headers`` name ``.cuh`` files of shared device helpers, put in front of
    the file's text (no include path to configure, for CuPy or NVRTC).

    Its kernels are ``extern "C"`` functions (one per float type), so the
    file itself is what :func:`compile_all_sources` compiles.
    """

    def __init__(self, filename: str, headers=()):
        self.paths = [os.path.join(HERE, name) for name in (*headers, filename)]
        self._module = None
        _register(f"cu:{filename}", self.source)

    def source(self) -> str:
        """The ``headers`` (``.cuh`` files beside it, shared helpers), then the file itself: one translation unit."""
        parts = []
        for path in self.paths:
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
        return "\n".join(parts)

    def function(self, name: str):
        """The kernel ``name`` of the compiled module (compiled at the first call)."""
        if self._module is None:
            self._module = _cupy().RawModule(code=self.source(), options=NVRTC_OPTIONS)
        return self._module.get_function(name)


def compile_source(source: str, arch: str = "sm_90", name: str = "source.cu") -> int:
    """Compile one CUDA C source with NVRTC for ``arch``; returns the size of the CUBIN.

    Raises
    ------
    RuntimeError
        With NVRTC's log, if the source does not compile.
    """
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{name}: nvrtcCreateProgram failed ({err})")
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in NVRTC_OPTIONS]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{name}: NVRTC failed to compile for {arch} ({err}):\n{log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        return int(size)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_all_sources(arch: str = "sm_90", names=None) -> dict:
    """Compile every registered source (:data:`SOURCES`) with NVRTC for ``arch`` (``"sm_90"``, ``"sm_80"``).

    Import the modules whose kernels should be included first (importing
    :mod:`gpu.cupy_kernels` imports them all).

    Returns
    -------
    dict
        ``{source name: size of its CUBIN}``.
    """
    out = {}
    for name, source in sorted(SOURCES.items()):
        if names is None or name in names:
            out[name] = compile_source(source(), arch, name.replace(":", "_"))
    return out


# ---------------------------------------------------------------------------
# The result checks of a public call: one small device array, one copy
# ---------------------------------------------------------------------------

_CHECKS_CU = RawModuleSource("checks.cu", headers=("rows.cuh",))

#: The ``first`` of a check that no entry has failed: the largest 64-bit unsigned integer.
NO_INDEX = np.iinfo(np.uint64).max

#: Threads per block and most blocks of the counting kernel (a grid-stride loop).
COUNT_THREADS, COUNT_BLOCKS = 256, 1024


class Checks:
    """The result checks of one public call: ``(count, first)`` per named check, on the device, copied once.

    Kernels add to a check through :meth:`slot` (the device pointer of its
    pair, ``check_fail`` in ``rows.cuh``); :meth:`count_bad` counts the bad
    entries of an array.  :meth:`fetch` copies the whole array to the host
    (one :func:`to_host`), after which :meth:`failed` and :meth:`first` read
    it.  With :func:`result_checks` off :meth:`count_bad` counts nothing,
    :meth:`fetch` copies nothing and every check reads 0.

    Parameters
    ----------
    xp : module
        :mod:`numpy` (the twins add to a host array) or :mod:`cupy`.
    names : sequence of str
        The checks of the call, in the order they are evaluated.
    """

    def __init__(self, xp, names):
        self.xp = xp
        self.enabled = checks_enabled()
        self.index = {name: i for i, name in enumerate(names)}
        self.host = None
        values = np.zeros((len(self.index), 2), dtype=np.uint64)
        values[:, 1] = NO_INDEX
        self.values = values if xp is np else xp.asarray(values)

    def slot(self, name):
        """The pair of check ``name``: a view of one row, the device pointer a kernel adds to."""
        return self.values[self.index[name]]

    def add(self, name, bad) -> None:
        """NumPy twin of ``check_fail``: add the true entries of the host boolean array ``bad`` (flat order) to ``name``."""
        bad = np.asarray(bad).reshape(-1)
        n = int(np.count_nonzero(bad))
        if n:
            row = self.values[self.index[name]]
            row[0] += np.uint64(n)
            row[1] = min(int(row[1]), int(np.argmax(bad)))

    def count_bad(self, a, name, positive: bool = False) -> None:
        """Count the entries of the contiguous array ``a`` that are not finite (or, with ``positive``, not > 0) into ``name``."""
        if not self.enabled or a.size == 0:
            return
        flat = a.reshape(-1)
        mode = 1 if positive else 0
        if is_device_array(flat) and not flat.flags.c_contiguous:
            raise ValueError("Checks.count_bad: a contiguous array is needed")

        def twin():
            with np.errstate(invalid="ignore"):
                self.add(name, ~(flat > 0) if positive else ~np.isfinite(flat))

        suffix = "f32" if flat.dtype == np.float32 else "f64"
        grid = (max(1, min(COUNT_BLOCKS, -(-flat.size // COUNT_THREADS))),)
        launch(_CHECKS_CU, f"count_bad_{suffix}", grid, (COUNT_THREADS,),
               (flat, np.int64(flat.size), np.int32(mode), self.slot(name)), twin)

    def fetch(self) -> "Checks":
        """Copy every check to the host at once (the call's one copy); nothing when checks are off."""
        if not self.enabled:
            self.host = np.zeros((len(self.index), 2), dtype=np.uint64)
        else:
            self.host = np.asarray(to_host(self.values))
        return self

    def failed(self, name) -> int:
        """How many entries failed check ``name`` (after :meth:`fetch`)."""
        return int(self.host[self.index[name], 0])

    def first(self, name) -> int:
        """The smallest flat index that failed check ``name``, or -1 (after :meth:`fetch`)."""
        value = self.host[self.index[name], 1]
        return -1 if value == NO_INDEX else int(value)

    def any_failed(self) -> bool:
        """Whether any check failed (after :meth:`fetch`)."""
        return bool(self.host[:, 0].any())


# ---------------------------------------------------------------------------
# Is there a GPU, whatever CuPy says
# ---------------------------------------------------------------------------


def _nvidia_smi_lists_a_gpu() -> bool:
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and "GPU" in proc.stdout


def _device_node_exists() -> bool:
    return os.path.exists("/dev/nvidia0")


def _driver_device_count() -> int:
    import gpu

    return gpu._cuda_device_count()


#: The probes of :func:`gpu_present`, in order: ``(name, callable returning a truth value)``.
GPU_PROBES = (
    ("nvidia-smi -L", _nvidia_smi_lists_a_gpu),
    ("/dev/nvidia0", _device_node_exists),
    ("cuDeviceGetCount", lambda: _driver_device_count() > 0),
)


def gpu_present() -> tuple[bool, str]:
    """Whether this machine has an NVIDIA GPU, decided without CuPy: ``(present, which probe said so)``.

    The probes (:data:`GPU_PROBES`): ``nvidia-smi -L`` lists a GPU, the
    device node ``/dev/nvidia0`` exists, or the CUDA driver library loads
    and ``cuInit``/``cuDeviceGetCount`` report at least one device.
    """
    for name, probe_fn in GPU_PROBES:
        try:
            if probe_fn():
                return True, name
        except Exception:  # a probe that cannot run says nothing
            continue
    return False, "no probe found a GPU (nvidia-smi -L, /dev/nvidia0, cuDeviceGetCount)"


def device_test_decision() -> tuple[str, str]:
    """What the CuPy device tests do here: ``("run" | "skip" | "fail", why)``.

    They run where CuPy can allocate; they are skipped only where there is
    no GPU (:func:`gpu_present`); on a machine with a GPU where CuPy cannot
    allocate (a driver too old for the CUDA runtime, a missing library) they
    fail, with CuPy's reason.
    """
    ok, why = probe()
    if ok:
        return "run", why
    present, which = gpu_present()
    if not present:
        return "skip", f"no GPU on this machine ({which}): {why}"
    return "fail", f"this machine has a GPU ({which}) but CuPy cannot use it: {why}"


# ---------------------------------------------------------------------------
# The backend's record: how its public functions read their arguments
# ---------------------------------------------------------------------------


def view(a, kind=None):
    """What refimpl's checkers read for argument ``a`` (:class:`refimpl.boundary.Backend`).

    A token array on the device: its :func:`host_view` (shape and dtype, no
    copy; its values are checked on the device); a parameter on the device:
    its host copy (:func:`parameter_to_host`, small).
    """
    return host_view(a) if kind is None else parameter_to_host(a)


SUMMARY = (
    "Computed with CuPy (:mod:`gpu.cupy_kernels`): the matrix products through cuBLAS, the rest in fused kernels "
    "that NVRTC compiles."
)

ARRAYS = (
    "CuPy arrays (or any object with ``__cuda_array_interface__``) in give CuPy arrays out; NumPy arrays in are "
    "computed on the device and come back as NumPy arrays. The dtype follows the inputs."
)


def backend(kernels) -> boundary.Backend:
    """The CuPy backend with ``kernels`` (a module's share of them: :func:`refimpl.boundary.bind` binds its names)."""
    return boundary.Backend(
        "gpu.cupy_kernels", SUMMARY, kernels, ARRAYS, "array_like or cupy.ndarray", "numpy.ndarray or cupy.ndarray", view,
        device_module, replace={"GMACache or GMABatchCache": "GMADeviceCache"},
    )


def on_host(b: boundary.Backend) -> boundary.Backend:
    """``b`` computed with NumPy in place of CuPy: each fused kernel by its NumPy twin, on any machine."""
    return b._replace(name="gpu.cupy_kernels.host", module=boundary.numpy_module,
                      summary=b.summary + " Here with NumPy in place of CuPy, each fused kernel by its NumPy twin.")
