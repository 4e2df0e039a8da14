"""Host syncs and launches: at most one copy to the host per public call, at most three launches per OVQ chunk.

The CuPy backend is counted on its NumPy host path (its logic with NumPy in
place of CuPy, every kernel replaced by its twin): every copy to the host
goes through ``_backend.to_host`` and every launch through its counted
helpers.  The Numba backend is counted in the CUDA simulator (or on a GPU):
every ``copy_to_host`` of a device array, with device inputs (whose results
stay on the device).
"""

import importlib

import numpy as np
import pytest
from numba import cuda

import gpu.cupy_kernels as ck
from gpu.cupy_kernels import _backend, on_host, ovq
from refimpl import ovq as ref_ovq


def _rng():
    return np.random.default_rng(0)


def _gmm(rng, N=13, K=4, d=3):
    return rng.normal(size=(N, d)), rng.normal(size=(K, d)), rng.uniform(0.5, 2.0, size=(K, d)), np.full(K, 1 / K)


def _cupy_calls(rng):
    """``(name, call)``: every public function of the CuPy backend on its NumPy path."""
    x, means, variances, weights = _gmm(rng)
    q, k, v = rng.normal(size=(2, 3, 9, 4)), rng.normal(size=(2, 3, 9, 4)), rng.normal(size=(2, 3, 9, 2))
    raw, logits = rng.normal(size=(4, 3)), rng.normal(size=4)
    xq, xk, xv = rng.normal(size=(2, 11, 3)), rng.normal(size=(2, 11, 3)), rng.normal(size=(2, 11, 2))
    _, cache = on_host.gma_forward(xq, xk, xv, means, raw, logits, causal=True, eps=1e-6, min_variance=1e-6, chunk_size=4)
    g = rng.normal(size=(2, 11, 2))
    oq, ok_, ov = rng.normal(size=(40, 3)), rng.normal(size=(40, 3)), rng.normal(size=(40, 2))
    return [
        ("responsibilities", lambda: on_host.responsibilities(x, means, variances, weights)),
        ("log_responsibilities", lambda: on_host.log_responsibilities(x, means, variances, weights)),
        ("softmax_attention", lambda: on_host.softmax_attention(q, k, v, scale=None, causal=True)),
        ("gma", lambda: on_host.gma(xq, xk, xv, means, variances, weights, causal=True, eps=1e-6, chunk_size=4)),
        ("gma eps=0", lambda: on_host.gma(xq, xk, xv, means, variances, weights, causal=False, eps=0.0, chunk_size=4)),
        ("gma_forward", lambda: on_host.gma_forward(xq, xk, xv, means, raw, logits, causal=True, eps=1e-6, min_variance=1e-6, chunk_size=4)),
        ("gma_backward", lambda: on_host.gma_backward(g, cache)),
        ("ovq_attention", lambda: on_host.ovq_attention(oq, ok_, ov, max_size=6, chunk_size=4)),
        ("ovq_attention random", lambda: on_host.ovq_attention(oq, ok_, ov, max_size=9, chunk_size=3, init="random", growth="linear")),
        ("vq_attention", lambda: on_host.vq_attention(oq, ok_, ov, oq[:5], chunk_size=4)),
    ]


@pytest.mark.parametrize("index", range(10))
def test_cupy_public_calls_copy_to_the_host_once(index):
    name, call = _cupy_calls(_rng())[index]
    with ck.count_launches() as c:
        call()
    assert c.host_copies == 1, name
    assert c.launches >= 1, name


@pytest.mark.parametrize("index", range(10))
def test_cupy_public_calls_without_checks_copy_nothing(index):
    name, call = _cupy_calls(_rng())[index]
    with ck.result_checks(False), ck.count_launches() as c:
        call()
    assert c.host_copies == 0, name
    assert _backend.checks_enabled()


def test_the_flagged_rows_cost_more_copies_only_when_flagged():
    # far-apart tight means: the screen flags rows, so the rare path copies again; the result is still refimpl's
    from refimpl import gmm as ref_gmm

    means = np.array([[1e7, 0.0], [1e7 + 0.01, 0.0], [-1e7, 3.0]])
    variances, weights = np.full((3, 2), 1e-4), np.array([0.3, 0.3, 0.4])
    x = means[[0, 1, 0, 2]] + _rng().normal(scale=0.005, size=(4, 2))
    with ck.count_launches() as c:
        ours = on_host.responsibilities(x, means, variances, weights)
    assert c.host_copies > 1
    np.testing.assert_allclose(ours, ref_gmm.responsibilities(x, means, variances, weights), rtol=1e-10, atol=1e-10)


def _ovq_launches(N, C, **kw):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(N, 3)), rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
    with ck.count_launches() as c:
        on_host.ovq_attention(q, k, v, max_size=8, chunk_size=C, **kw)
    return c.launches


@pytest.mark.parametrize("kw", [dict(), dict(growth="linear", init="random", seed=3), dict(learning_rate=0.5, count_bias=False)])
def test_ovq_launches_at_most_three_per_chunk(kw):
    one, many = _ovq_launches(4, 4, **kw), _ovq_launches(4 * 9, 4, **kw)
    assert one <= 5  # the unit rows, three launches, the count of overflowed rows
    assert (many - one) <= 3 * 8
    assert many - one >= 2 * 8  # the read-out and the update of every chunk are counted


def test_vq_launches_three_per_chunk():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(30, 3)), rng.normal(size=(30, 3)), rng.normal(size=(30, 2))
    counts = []
    for N in (5, 30):
        with ck.count_launches() as c:
            on_host.vq_attention(q[:N], k[:N], v[:N], q[:4], chunk_size=5)
        counts.append(c.launches)
    assert counts[1] - counts[0] == 3 * 5


class _CountingNumpy:
    """NumPy, counting every routine called through the module object (not the twins, which call numpy directly)."""

    __name__ = "numpy"

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(np, name)
        if callable(attr) and not isinstance(attr, type):
            def counted(*a, **kw):
                self.calls += 1
                return attr(*a, **kw)
            return counted
        return attr


def test_ovq_chunk_loop_calls_no_array_routine():
    # with CuPy each routine of xp would be a launch of its own: the chunk loop may call none (its three kernels only)
    rng = np.random.default_rng(3)
    calls = []
    for N in (4, 40):
        q, k, v = rng.normal(size=(N, 3)), rng.normal(size=(N, 3)), rng.normal(size=(N, 2))
        p = ref_ovq.check_ovq_arguments(q, k, v, 8, 4, None, "linear", "spread", True, None, 0, None).params
        xp = _CountingNumpy()
        ovq._ovq_run_xp(xp, q, k, v, p, None, np.float64)
        calls.append(xp.calls)
    assert calls[0] == calls[1]


def test_launch_count_is_an_int_total_and_counts_gemms():
    before = ck.launch_count()
    assert isinstance(before, int)
    x, means, variances, weights = _gmm(_rng())
    on_host.responsibilities(x, means, variances, weights)
    # the centring kernel, the GEMM and the fused epilogue
    assert ck.launch_count() - before == 3


def test_tf32_is_off_by_default_and_a_context_restores_it():
    assert not _backend.tf32_enabled()
    with ck.tf32(True):
        assert _backend.tf32_enabled()
    assert not _backend.tf32_enabled()


@pytest.mark.parametrize("probes, cupy_ok, expected", [
    ((True, False, False), False, "fail"),
    ((False, True, False), False, "fail"),
    ((False, False, True), False, "fail"),
    ((False, False, False), False, "skip"),
    ((True, True, True), True, "run"),
    ((False, False, False), True, "run"),
])
def test_device_tests_skip_only_without_a_gpu(monkeypatch, probes, cupy_ok, expected):
    names = [name for name, _ in _backend.GPU_PROBES]
    monkeypatch.setattr(_backend, "GPU_PROBES", tuple((n, (lambda r=r: r)) for n, r in zip(names, probes)))
    monkeypatch.setattr(_backend, "probe", lambda: (cupy_ok, "CuPy cannot allocate on a CUDA device (why)"))
    decision, why = _backend.device_test_decision()
    assert decision == expected
    if expected == "fail":
        assert "has a GPU" in why and "(why)" in why


def test_a_probe_that_raises_says_nothing(monkeypatch):
    def broken():
        raise OSError("no driver")

    monkeypatch.setattr(_backend, "GPU_PROBES", (("broken", broken), ("none", lambda: False)))
    assert _backend.gpu_present()[0] is False


# ---------------------------------------------------------------------------
# Numba: copy_to_host in the simulator (or on a GPU), device inputs
# ---------------------------------------------------------------------------


def _numba_calls():
    from gpu.numba_cuda import attention as na
    ngma = importlib.import_module("gpu.numba_cuda.gma")  # the package's attribute gma is the function
    ngmm = importlib.import_module("gpu.numba_cuda.gmm")
    novq = importlib.import_module("gpu.numba_cuda.ovq")

    rng = np.random.default_rng(4)
    x, means, variances, weights = _gmm(rng, N=5, K=3, d=2)
    xs, ms, vs, ws = _gmm(rng, N=40, K=35, d=5)  # several row, component and coordinate tiles (and blocks)
    dev = cuda.to_device
    xq, xk, xv = rng.normal(size=(1, 6, 2)), rng.normal(size=(1, 6, 2)), rng.normal(size=(1, 6, 2))
    raw, logits = rng.normal(size=(3, 2)), rng.normal(size=3)
    q, k, v = rng.normal(size=(6, 2)), rng.normal(size=(6, 2)), rng.normal(size=(6, 2))
    return [
        ("responsibilities", lambda: ngmm.responsibilities(dev(x), means, variances, weights)),
        ("log_responsibilities", lambda: ngmm.log_responsibilities(dev(x), means, variances, weights)),
        ("log_responsibilities device parameters", lambda: ngmm.log_responsibilities(dev(x), dev(means), dev(variances), dev(weights))),
        ("gma_forward device parameters", lambda: ngma.gma_forward(dev(xq), dev(xk), dev(xv), dev(means), dev(raw), dev(logits))),
        ("gma device parameters", lambda: ngma.gma(dev(xq), dev(xk), dev(xv), dev(means), dev(variances), dev(weights), eps=0.0)),
        ("responsibilities over several tiles", lambda: ngmm.responsibilities(dev(xs), ms, vs, ws)),
        ("softmax_attention", lambda: na.softmax_attention(dev(q), dev(k), dev(v))),
        ("gma", lambda: ngma.gma(dev(xq), dev(xk), dev(xv), means, variances, weights, causal=True, chunk_size=3)),
        ("gma eps=0", lambda: ngma.gma(dev(xq), dev(xk), dev(xv), means, variances, weights, eps=0.0)),
        ("gma_forward", lambda: ngma.gma_forward(dev(xq), dev(xk), dev(xv), means, raw, logits)),
        ("gma_backward", lambda: ngma.gma_backward(dev(xv), ngma.gma_forward(dev(xq), dev(xk), dev(xv), means, raw, logits)[1])),
        ("ovq_attention", lambda: novq.ovq_attention(dev(q), dev(k), dev(v), max_size=3, chunk_size=2)),
        ("vq_attention", lambda: novq.vq_attention(dev(q), dev(k), dev(v), q[:2], chunk_size=2)),
    ]


@pytest.mark.parametrize("index", range(13))
def test_numba_public_calls_copy_to_the_host_at_most_once(index, host_copies):
    name, call = _numba_calls()[index]
    if name == "gma_backward":
        ngma = importlib.import_module("gpu.numba_cuda.gma")
        rng = np.random.default_rng(5)
        a = [cuda.to_device(rng.normal(size=(1, 6, 2))) for _ in range(3)]
        _, cache = ngma.gma_forward(*a, rng.normal(size=(3, 2)), rng.normal(size=(3, 2)), rng.normal(size=3))
        host_copies["n"] = 0
        ngma.gma_backward(cuda.to_device(rng.normal(size=(1, 6, 2))), cache)
    else:
        call()
    assert host_copies["n"] <= 1, (name, host_copies["n"])
    if name.endswith("device parameters"):  # their checks are in the one result-check flag: exactly one copy
        assert host_copies["n"] == 1, (name, host_copies["n"])
