"""Plumbing shared by the Numba-CUDA kernels: the kernel registry, host/device arrays, launch sizes.

Kernel registry
---------------
Every kernel is declared with :func:`kernel`, which records its Python
function and its argument types so that :func:`compile_all` can compile it
for real GPUs with :func:`numba.cuda.compile_ptx` (no GPU needed), in
float32 and float64.  The simulator accepts code that the compiler refuses
(a shape that is not a compile-time constant, a Python object in a kernel);
compiling every kernel catches that on machines without a GPU.

Arrays in and out
-----------------
The public functions take NumPy arrays, Numba device arrays, or any object
with ``__cuda_array_interface__`` (a CuPy array, say).  Shapes, dtypes and
values are checked by the very functions :mod:`refimpl` uses, so the errors
are the same: a device array is checked through :func:`host_view`, a
zero-stride host array of its shape and dtype (no copy of the data), and its
values by :func:`check_finite`, which counts non-finite entries on the device
and copies to the host only to word the error.  NumPy in gives NumPy out;
any device array in gives device arrays out (:func:`result`), never copied to
the host.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
from numba import config, cuda, float32, float64

from refimpl import boundary, validation

__all__ = [
    "KERNELS",
    "LAUNCH",
    "DEFAULT_THREADS",
    "launch_info",
    "compile_options",
    "kernel_dtypes",
    "REPLACED",
    "DTYPES",
    "SIMULATOR",
    "kernel",
    "compile_all",
    "compile_targets",
    "is_device_array",
    "any_device",
    "host_view",
    "to_host",
    "to_device",
    "check_finite",
    "result",
    "blocks",
    "Checks",
]

#: The floating types every kernel is compiled for.
DTYPES = (float32, float64)

#: True when the kernels run in the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): every thread is a Python
#: thread there, so launches use small blocks; the code is the same.
SIMULATOR = bool(config.ENABLE_CUDASIM)

#: Threads per block of the finiteness count (a power of two, at most its shared array's 256 entries).
COUNT_THREADS = 32 if SIMULATOR else 256


def _serialise_simulated_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` allocate each array once per block, whatever the thread timing.

    The simulator keys a block's shared arrays by the source line that asks
    for them, and allocates one on a thread's first request: it looks the
    line up, and if nothing is there allocates and stores an array.  Between
    the look-up and the store it reads the caller's frame summary (with
    ``os.stat`` calls, which release the GIL), so two threads of one block
    can both find nothing and each get its own array: the block's threads
    then no longer share memory, and a kernel that is right gives a wrong
    answer now and then, depending on how the threads are scheduled.  This
    replaces it by the same allocation, keyed by the same (file, line), with
    the look-up and the store under one lock.  On a GPU nothing changes.
    """
    import sys
    import threading

    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    if getattr(shared.array, "serialised", False):
        return
    original = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused, or dynamic shared memory: no per-line allocation
            return original(self, shape, dtype, alignment)
        frame = sys._getframe(1)  # the kernel's line that asks for the array
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                if isinstance(dtype, types.Type):  # a Numba type (float64): its NumPy dtype
                    dtype = numpy_support.as_dtype(dtype)
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array.serialised = True
    array.original = original
    shared.array = array


if SIMULATOR:
    _serialise_simulated_shared_arrays()


def _load_array_support_under_numpy_2_5() -> bool:
    """Load Numba-CUDA's NumPy array support where NumPy no longer has ``np.row_stack``; True when it had to help.

    Numba-CUDA (0.30.4 and earlier) registers an overload of
    ``np.row_stack`` when its typing registries load, at the first kernel
    compiled; NumPy 2.5 removed that alias of ``np.vstack``, so under NumPy
    2.5 no kernel compiles (``AttributeError: module 'numpy' has no attribute
    'row_stack'``; NVIDIA/numba-cuda#907, which Numba-CUDA will not fix).  The
    module that registers it is imported here once with the alias in place,
    and the alias removed again: NumPy is left as it was, and the overload
    (of ``np.vstack``, the same function) is harmless.  Nothing is done in the
    simulator, under an older NumPy, or where Numba-CUDA no longer asks.
    """
    if SIMULATOR or hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401  (registers its overloads, np.row_stack's among them)
    except ImportError:
        return False
    finally:
        del np.row_stack
    return True


#: True when NumPy lacks ``np.row_stack`` and Numba-CUDA's array support was loaded with it in place (the GPU check's
#: environment stage reports it).
NUMPY_2_5_SHIM = _load_array_support_under_numpy_2_5()

#: ``{qualified name: (python function, signature builder)}``; the builder maps a float type to the argument types.
KERNELS: dict = {}

#: ``{qualified name: launch facts}``: ``threads`` (threads per block the public function launches it with, or a
#: callable of the float type giving them), ``tags`` (a set of words saying what the kernel is for, e.g.
#: ``"responsibilities"``, ``"gma"``, ``"attention"``).  Read it with :func:`launch_info`.
LAUNCH: dict = {}

#: Registry names registered a second time by another function (see :func:`kernel`'s ``dtypes``).
REPLACED: list = []

#: Threads per block assumed for a kernel registered without ``threads`` (the usual 1-D launch of these modules).
DEFAULT_THREADS = 256


def kernel(signature, threads=None, tags=(), options=None, dtypes=None):
    """Declare a kernel: register it for :func:`compile_all`, return ``cuda.jit(fn)``.

    Parameters
    ----------
    signature : callable
        ``signature(f)`` returns the tuple of Numba argument types for the
        float type ``f`` (``float32`` or ``float64``), e.g.
        ``lambda f: (f[:, ::1], f[::1], int64)``.
    threads : int or callable, optional
        Threads per block of the kernel's launches on a GPU (the product of
        the block's dimensions), or ``threads(f)`` giving them for the float
        type ``f``.  The static resource checks compute occupancy at this
        block size.  Default: :data:`DEFAULT_THREADS` (256), marked as assumed.
    tags : iterable of str, optional
        What the kernel is for (``"responsibilities"``, ``"gma"``,
        ``"attention"``, ...): the resource checks select kernels by tag.
    options : dict or callable, optional
        The compile options of :func:`numba.cuda.compile_ptx` the kernel is
        launched with (``launch_bounds``, ``fastmath``), or ``options(f)``
        giving them for the float type ``f``.  A dict is passed to
        ``cuda.jit`` as well; a module that compiles the kernel per float type
        with other options (``cuda.jit(k.py_func, **compile_options(name, f))``)
        gives them as a callable, so that :func:`compile_all` compiles what
        runs.
    dtypes : tuple of Numba float types, optional
        The float types this kernel runs in (default :data:`DTYPES`, both).  A
        module that builds one kernel per float type (other tile sizes, say)
        registers each build for its own type: the registry names it
        ``module.function[float32]``, so that the builds do not replace each
        other.  A kernel registered again under the same name by another
        function is listed in :data:`REPLACED` (the PTX check refuses it: the
        first build would escape the check).
    """

    def wrap(fn):
        name = f"{fn.__module__}.{fn.__name__}"
        types = DTYPES if dtypes is None else tuple(dtypes)
        if set(map(str, types)) != set(map(str, DTYPES)):
            name += "[" + ",".join(str(f) for f in types) + "]"
        if name in KERNELS and KERNELS[name][0] is not fn:
            REPLACED.append(name)
        KERNELS[name] = (fn, signature)
        LAUNCH[name] = {"threads": threads, "tags": frozenset(tags), "options": options, "dtypes": types}
        return cuda.jit(fn, **options) if isinstance(options, dict) else cuda.jit(fn)

    return wrap


def kernel_dtypes(name) -> tuple:
    """The float types the registered kernel ``name`` is compiled for (:data:`DTYPES` unless it was given others)."""
    return tuple(LAUNCH.get(name, {}).get("dtypes") or DTYPES)


def launch_info(name, f=float32):
    """``(threads per block, assumed, tags)`` of the registered kernel ``name`` for the float type ``f``.

    ``assumed`` is True when the kernel was registered without ``threads``
    (:data:`DEFAULT_THREADS` is returned then).
    """
    info = LAUNCH.get(name, {"threads": None, "tags": frozenset()})
    threads = info["threads"]
    if threads is None:
        return DEFAULT_THREADS, True, info["tags"]
    if callable(threads):
        threads = threads(f)
    return int(threads), False, info["tags"]


def compile_options(name, f=float32) -> dict:
    """The compile options of the registered kernel ``name`` for the float type ``f`` (``{}`` when none)."""
    options = LAUNCH.get(name, {}).get("options")
    if callable(options):
        options = options(f)
    return dict(options or {})


class _TargetDevice:
    """A stand-in for the current CUDA device that only reports a compute capability.

    Numba-CUDA compiles a device function (``@cuda.jit(device=True)``) called
    from a kernel for the *current* device: its dispatcher asks
    ``get_current_device().compute_capability``, which needs a CUDA driver.
    Compiling to PTX for a named capability needs no GPU otherwise, so
    :func:`compile_all` answers that question with the target's capability.
    """

    def __init__(self, cc):
        self.compute_capability = tuple(cc)


@contextlib.contextmanager
def _current_device_reports(cc):
    """Within the block, Numba-CUDA's dispatcher sees a current device of capability ``cc`` (no driver asked)."""
    from numba.cuda import dispatcher

    original = dispatcher.get_current_device
    stand_in = _TargetDevice(cc)
    dispatcher.get_current_device = lambda: stand_in
    try:
        yield stand_in
    finally:
        dispatcher.get_current_device = original


def _lowered_once(fn, sig, cc, options):
    """The code library of a kernel lowered once for ``cc`` (NVVM IR), or None where Numba-CUDA hides the step.

    :func:`numba.cuda.compile_ptx` lowers the kernel and asks NVVM for the PTX
    of one capability; its first step, kept here, lets NVVM write the PTX of
    several capabilities from one lowering (``library.get_asm_strs(cc=...)``).
    """
    from numba.cuda import compiler

    fixup = getattr(compiler, "_compile_pyfunc_with_fixup", None)
    if fixup is None:
        return None
    lib, _ = fixup(fn, sig, device=False, cc=cc, abi="numba", **options)
    return lib


def compile_targets(ccs, names=None):
    """The PTX of registered kernels for several compute capabilities, each kernel lowered once.

    Numba-CUDA lowers a kernel to NVVM IR (typing and code generation in
    Python: most of the time), then NVVM writes the PTX.  The IR depends on
    the capability only below 7.5 (``tanh.approx.f32`` under fastmath from
    7.5, the native atomics from 6.0), so for capabilities of 7.5 and above
    the IR lowered for the first one serves the others: NVVM writes each
    one's PTX from it, which is what :func:`numba.cuda.compile_ptx` gives for
    that capability (``tests/test_gpu_ptx.py`` checks it).  Without that step
    in this Numba-CUDA, or below 7.5, each capability is compiled in full.

    Parameters
    ----------
    ccs : sequence of tuple of int
        Compute capabilities, e.g. ``[(9, 0), (8, 0)]``; the first is lowered.
    names : collection of str, optional
        Qualified names of the kernels to compile (default: every one).

    Returns
    -------
    dict
        ``{cc: {(name, dtype name): PTX}}``.
    """
    ccs = [tuple(cc) for cc in ccs]
    shared = min(ccs) >= (7, 5)
    out = {cc: {} for cc in ccs}
    with _current_device_reports(ccs[0]):
        for name, (fn, signature) in sorted(KERNELS.items()):
            if names is not None and name not in names:
                continue
            for f in kernel_dtypes(name):
                options = compile_options(name, f)
                lib = _lowered_once(fn, signature(f), ccs[0], options) if shared else None
                for cc in ccs:
                    if lib is not None:
                        (code,) = lib.get_asm_strs(cc=cc)
                    else:
                        with _current_device_reports(cc):
                            code, _ = cuda.compile_ptx(fn, signature(f), cc=cc, **options)
                    out[cc][(name, str(f))] = code
    return out


def compile_all(cc=(9, 0), names=None, ptx=False):
    """Compile registered kernels to PTX for compute capability ``cc`` in float32 and float64 (or their own types).

    Needs the real CUDA target (not the simulator) and NVVM, which the
    ``numba-cuda[cu13]`` wheels ship; no GPU is needed.  The device functions
    a kernel calls are compiled for ``cc`` too: while compiling, Numba-CUDA's
    question for the current device's capability is answered with ``cc``
    (:class:`_TargetDevice`), so no CUDA driver is asked.  A device function
    is compiled once per argument types and kept by Numba, so after a first
    ``cc`` later ones reuse its compiled body (NVVM still writes each
    kernel's PTX for its own ``cc``).  It is :func:`compile_targets` for one
    capability.

    Parameters
    ----------
    cc : tuple of int
        The compute capability, e.g. ``(9, 0)``.
    names : collection of str, optional
        Qualified names of the kernels to compile (default: every one).
    ptx : bool
        Return the PTX text instead of its length.

    Returns
    -------
    dict
        ``{(name, dtype name): length of the PTX}`` (or the PTX itself).
    """
    codes = compile_targets([cc], names)[tuple(cc)]
    return codes if ptx else {key: len(code) for key, code in codes.items()}


def is_device_array(a) -> bool:
    """True for a Numba device array (real or simulated) or an object with ``__cuda_array_interface__``."""
    return hasattr(a, "__cuda_array_interface__") or (hasattr(a, "copy_to_host") and hasattr(a, "shape"))


def any_device(*arrays) -> bool:
    """True when any argument is a device array: the results then stay on the device."""
    return any(is_device_array(a) for a in arrays)


def _as_numba(a):
    # a CuPy array (or any __cuda_array_interface__ object) becomes a Numba view of the same memory
    return a if hasattr(a, "copy_to_host") else cuda.as_cuda_array(a)


def host_view(a):
    """For a device array, a read-only zero-stride host array of its shape and dtype; anything else unchanged.

    It lets :mod:`refimpl.validation` check shapes, dimensions and dtypes
    of device arrays without copying them (its values are all 0: check the
    values with :func:`check_finite`).
    """
    if not is_device_array(a):
        return a
    a = _as_numba(a)
    return np.broadcast_to(np.zeros((), dtype=a.dtype), a.shape)


def to_host(a):
    """A host copy of a device array (small arrays: parameters, per-row checks); anything else unchanged."""
    return _as_numba(a).copy_to_host() if is_device_array(a) else a


def to_device(a, dtype):
    """``a`` on the device, as a C-contiguous array of ``dtype`` (no copy when it already is one)."""
    dtype = np.dtype(dtype)
    if is_device_array(a):
        a = _as_numba(a)
        if a.dtype == dtype and a.is_c_contiguous():
            return a
        a = a.copy_to_host()
    return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))


@kernel(lambda f: (f[::1], f[::1]))
def _count_nonfinite(x, counts):
    # counts[block] = number of non-finite entries among x[block*T : (block+1)*T]; thread t owns one entry.
    # The block sums its flags in shared memory by a tree (an ordered reduction: no atomics), [T]
    flags = cuda.shared.array(256, float64)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    flags[t] = 0.0
    if i < x.shape[0]:
        if not math.isfinite(x[i]):
            flags[t] = 1.0
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if t < stride:
            flags[t] += flags[t + stride]
        cuda.syncthreads()
        stride //= 2
    if t == 0:
        counts[cuda.blockIdx.x] = flags[0]


def check_finite(a, name: str) -> None:
    """The check of :func:`refimpl.validation.check_finite`, on the device for a device array.

    Non-finite entries are counted on the device, one flag per thread summed
    per block; only when there is one is the array copied to the host, so
    that the message is word for word the reference's.  Host arrays are
    checked on the host.
    """
    if not is_device_array(a):
        validation.check_finite(np.asarray(a), name)
        return
    a = _as_numba(a)
    if a.size == 0:
        return
    flat = a.reshape(a.size) if a.is_c_contiguous() else cuda.to_device(a.copy_to_host().ravel())
    n_blocks = blocks(a.size, COUNT_THREADS)
    counts = cuda.device_array(n_blocks, dtype=a.dtype)
    _count_nonfinite[n_blocks, COUNT_THREADS](flat, counts)
    if counts.copy_to_host().sum() > 0:
        validation.check_finite(a.copy_to_host(), name)


def result(a, on_device: bool):
    """A kernel's output as the caller expects it: the device array itself, or its host copy."""
    return a if on_device else a.copy_to_host()


def blocks(n: int, threads: int) -> int:
    """The number of blocks of ``threads`` threads that cover ``n`` items (at least 1)."""
    return max(1, -(-int(n) // int(threads)))


class Checks:
    """The result checks of one public call, gathered on the device and copied to the host once.

    :meth:`finite` counts the non-finite entries of a device array (the
    per-block counts of :func:`_count_nonfinite`); :meth:`rows` keeps a
    small per-row array whole (the denominators with ``eps = 0``).
    :meth:`fetch` copies every part into one device buffer (device to
    device) and that buffer to the host: one ``copy_to_host`` per call.
    Only when a count is not zero is more copied, to word the error with
    the checker of :mod:`refimpl.validation`.

    Parameters
    ----------
    dtype : dtype
        The float dtype of the call (every part has it).
    """

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.parts = {}
        self.host = {}

    def finite(self, a, name: str) -> None:
        """Count the non-finite entries of the device array ``a`` as check ``name`` (on the device)."""
        a = _as_numba(a)
        if a.size == 0:
            return
        flat = a.reshape(a.size) if a.is_c_contiguous() else to_device(a, a.dtype).reshape(a.size)
        if flat.dtype != self.dtype:
            raise ValueError("Checks.finite: the array's dtype is not the call's")
        n_blocks = blocks(a.size, COUNT_THREADS)
        counts = cuda.device_array(n_blocks, dtype=self.dtype)
        _count_nonfinite[n_blocks, COUNT_THREADS](flat, counts)
        self.parts[name] = counts

    def rows(self, a, name: str) -> None:
        """Keep the device array ``a`` (of the call's dtype) whole as part ``name``."""
        a = _as_numba(a)
        if a.size:
            self.parts[name] = a.reshape(a.size)

    def fetch(self) -> "Checks":
        """One device buffer holding every part, copied to the host once; nothing when there is no part."""
        total = sum(p.size for p in self.parts.values())
        if total == 0:
            return self
        buf = cuda.device_array(total, dtype=self.dtype)
        offsets, o = {}, 0
        for name, part in self.parts.items():
            buf[o : o + part.size].copy_to_device(part)
            offsets[name] = (o, o + part.size)
            o += part.size
        host = buf.copy_to_host()
        self.host = {name: host[a:b] for name, (a, b) in offsets.items()}
        return self

    def failed(self, name: str) -> bool:
        """Whether check ``name`` counted a non-finite entry (after :meth:`fetch`; False when it was not asked for)."""
        part = self.host.get(name)
        return part is not None and part.sum() > 0

    def part(self, name: str):
        """The host copy of part ``name`` (after :meth:`fetch`)."""
        return self.host[name]


def raise_bad_inputs(checks, arrays) -> None:
    """After :meth:`Checks.fetch`: refimpl's error for the first device input ``(array, name)`` that is not finite."""
    for a, name in arrays:
        if checks.failed(name):
            validation.check_finite(_as_numba(a).copy_to_host(), name)


# ---------------------------------------------------------------------------
# The backend's record: how its public functions read their arguments
# ---------------------------------------------------------------------------


def stand_in(a, kind=None):
    """What refimpl's checker reads in place of the device array ``a``: its shape and dtype, values that pass.

    Host arrays are returned unchanged.  For a device array, a zero-stride
    host array of its shape and dtype (no copy): zeros, or with ``kind``
    ``"positive"`` ones (variances), ``"probability"`` ``1 / K`` along the
    last axis (weights).  The checker then words every shape and dtype error
    as for host arrays; the values are checked on the device
    (:func:`queue_parameter_checks`).
    """
    view = host_view(a)
    if not is_device_array(a) or kind is None or view.dtype.kind != "f" or view.ndim == 0:
        return view
    K = view.shape[-1]
    value = 1.0 if kind == "positive" else (1.0 / K if K else 0.0)
    return np.broadcast_to(np.asarray(value, dtype=view.dtype), view.shape)


def view(a, kind=None):
    """What refimpl's checkers read for argument ``a`` (:class:`refimpl.boundary.Backend`): a stand-in of a device array."""
    return stand_in(a, kind if kind in ("positive", "probability") else None)


_READY = []


def ready(*arrays):
    """The array module of a call (none: the kernels take Numba device arrays), once it is sure the backend can run.

    A device array among the arguments means a device (or the simulator) is
    there; otherwise the first call asks :func:`gpu.require`, whose error
    says how to get the backend: the extra, the driver, the simulator.
    """
    if not _READY and not any_device(*arrays):
        import gpu

        gpu.require("numba-cuda")
        _READY.append(True)


SUMMARY = (
    "Computed by the Numba-CUDA kernels of :mod:`gpu.numba_cuda` (in the CUDA simulator without a GPU), every reduction "
    "in a fixed order: two runs give the same bits."
)

ARRAYS = (
    "NumPy arrays in give NumPy arrays out; Numba device arrays, or any object with ``__cuda_array_interface__`` (a "
    "CuPy array), give Numba device arrays out, never copied to the host. The dtype follows the inputs."
)


def backend(kernels, notes=None) -> boundary.Backend:
    """The Numba-CUDA backend with ``kernels`` (a module's share of them: :func:`refimpl.boundary.bind` binds its names)."""
    return boundary.Backend(
        "gpu.numba_cuda", SUMMARY, kernels, ARRAYS, "array_like or device array", "ndarray or device array", view, ready,
        replace={"GMACache or GMABatchCache": "GMADeviceCache"}, notes=notes or {},
    )


@contextlib.contextmanager
def swapped_geometry(geometries, g, check, where):
    """Run with ``geometries`` (a module's tile geometry by dtype) set to ``g``, each checked by ``check``; the simulator only.

    ``g`` is one geometry for both float types, or a dict by dtype.  The
    simulator builds a kernel for the geometry at launch, so a test can run
    the GPU's own tiles there; a GPU compiles them into the kernel once, so
    this refuses to run on one (``where`` names the caller in the error).
    """
    if not SIMULATOR:
        raise RuntimeError(f"{where}: the tile geometry is fixed on a GPU (compile-time constants)")
    new = {np.dtype(dt): v for dt, v in g.items()} if isinstance(g, dict) else {dt: g for dt in geometries}
    for v in new.values():
        check(v)  # refuses a geometry the kernels cannot run
    old = dict(geometries)
    geometries.update(new)
    try:
        yield
    finally:
        geometries.clear()
        geometries.update(old)
