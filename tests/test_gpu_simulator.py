"""The CUDA simulator's shared arrays are shared by every thread of a block (gpu.numba_cuda._device installs the fix).

The simulator allocates a block's shared array on the first request from
its source line, with a look-up and a store that other threads can
interleave: two threads could each get an array of their own, and a right
kernel then gives a wrong answer now and then.  ``gpu.numba_cuda`` puts the
look-up and the store under a lock.  The race is made certain here by
slowing the allocation down, so the test fails without the lock.
"""

import threading
import time

import numpy as np
import pytest
from numba import cuda, float64

from gpu.numba_cuda import _device

pytestmark = pytest.mark.skipif(not _device.SIMULATOR, reason="the simulator's shared arrays: only without a GPU")


def _distinct_arrays(method, monkeypatch, n_threads=8):
    """How many different arrays ``n_threads`` threads get from one source line of one block, all asking at once."""
    from numba.cuda.simulator import kernelapi

    empty = np.empty

    def slow_empty(*args, **kwargs):  # widen the window between the look-up and the store
        time.sleep(0.005)
        return empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    shared = kernelapi.FakeCUDAShared(0)
    got = [None] * n_threads
    start = threading.Barrier(n_threads)

    def thread(i):
        start.wait()
        got[i] = method(shared, 4, np.float64)  # one source line for every thread

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(np, "empty", empty)
    return len({id(a) for a in got})


def test_every_thread_of_a_block_gets_the_same_shared_array(monkeypatch):
    from numba.cuda.simulator import kernelapi

    assert kernelapi.FakeCUDAShared.array.serialised
    assert _distinct_arrays(kernelapi.FakeCUDAShared.array, monkeypatch) == 1


def test_without_the_lock_the_simulator_hands_out_several(monkeypatch):
    """The race the lock removes is real: the simulator's own allocation, under the same timing."""
    from numba.cuda.simulator import kernelapi

    assert _distinct_arrays(kernelapi.FakeCUDAShared.array.original, monkeypatch) > 1


@cuda.jit
def _rotate(out):
    a = cuda.shared.array(8, float64)  # [T]
    b = cuda.shared.array(8, dtype=out.dtype)  # [T], another line: another array
    t = cuda.threadIdx.x
    a[t] = t
    b[t] = 10 * t
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = a[(t + 1) % 8] + b[(t + 2) % 8]


def test_arrays_on_different_lines_stay_different_and_a_kernel_sees_one_per_line():
    out = np.zeros((3, 8))
    _rotate[3, 8](out)
    t = np.arange(8)
    assert np.array_equal(out, np.broadcast_to((t + 1) % 8 + 10 * ((t + 2) % 8), (3, 8)))
