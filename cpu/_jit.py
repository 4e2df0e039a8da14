"""Every kernel compiled twice: across the threads (``prange``), and in the calling thread for small work."""

from __future__ import annotations

import contextlib
import types

import threadpoolctl
from numba import njit

__all__ = ["SERIAL_WORK", "threaded_and_serial", "pick", "single_threaded_blas", "call_with_one_blas_thread"]

SERIAL_WORK = 1 << 18
"""Below this many inner-loop steps a kernel runs in the calling thread.

Waking the thread pool costs tens of microseconds, and on a machine whose
cores the BLAS threads of the previous matrix product still hold it costs
far more: a training step calls hundreds of small kernels.  The two versions
run the same loops in the same order, so they give the same bits.
"""


def threaded_and_serial(fn, **options):
    """``(threaded, serial)``: ``fn`` compiled with ``parallel=True`` and without (``prange`` then runs as ``range``).

    ``options`` go to both compilations (``fastmath``, ``error_model``).
    """
    serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    serial.__qualname__ = fn.__qualname__ + "_serial"  # its own entry in the on-disk cache
    return njit(cache=True, parallel=True, **options)(fn), njit(cache=True, **options)(serial)


def pick(kernels, work):
    """The threaded kernel of a :func:`threaded_and_serial` pair for ``work`` >= :data:`SERIAL_WORK` steps, else the serial one."""
    return kernels[0] if work >= SERIAL_WORK else kernels[1]


_BLAS = []  # the thread-pool controller, made on first use (it reads the loaded libraries once)


@contextlib.contextmanager
def single_threaded_blas():
    """One BLAS thread while a kernel that calls BLAS from its own threads runs (the two pools would share the cores)."""
    if not _BLAS:
        _BLAS.append(threadpoolctl.ThreadpoolController())
    with _BLAS[0].limit(limits=1, user_api="blas"):
        yield


def call_with_one_blas_thread(kernels, work, *args):
    """Call the kernel :func:`pick` chooses for ``work`` on ``args``, BLAS held at one thread: for kernels that make
    BLAS calls from their own threads (two pools on the same cores would fight, and BLAS's spin after each call)."""
    with single_threaded_blas():
        return pick(kernels, work)(*args)

