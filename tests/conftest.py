"""Test-suite settings shared by every test module.

First of all, before anything imports numba: Numba-CUDA kernels run on a GPU
when there is one and in the CUDA simulator otherwise (numba reads
``NUMBA_ENABLE_CUDASIM`` once, at its first import; pytest loads this file
before any test module, in every xdist worker).
"""

import gpu

GPU_TARGET = gpu.use_simulator_without_device()
if GPU_TARGET == "simulator":
    # the simulator runs every GPU thread as a Python thread: switching often makes its barriers cheap
    import sys

    sys.setswitchinterval(1e-4)

from hypothesis import HealthCheck, settings  # noqa: E402

# Deterministic property tests: the same examples on every run and every machine,
# so CI never fails by chance; no per-example deadline (shared CI machines are noisy).
settings.register_profile(
    "reference",
    derandomize=True,
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("reference")


import pytest  # noqa: E402


@pytest.fixture
def host_copies(monkeypatch):
    """Count every ``copy_to_host`` of a Numba device array (the simulator's or a GPU's class): ``host_copies["n"]``."""
    from numba import cuda

    cls = type(cuda.device_array(1))
    original = cls.copy_to_host
    counter = {"n": 0}

    def counted(self, *a, **kw):
        counter["n"] += 1
        return original(self, *a, **kw)

    monkeypatch.setattr(cls, "copy_to_host", counted)
    return counter
