"""gpu.numba_cuda.gma against refimpl.gma: device arrays, segment sums, determinism, its own tiles and launches.

Outputs, the six gradients, dtypes and refusals on host arrays are held to
refimpl.gma in tests/test_conformance.py; here the device GMM parameters and
device tokens, and what the GPU's tiles and grids add.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py),
so the shapes are tiny; the simulator's blocks are then 2 x 2 or 4 x 4 threads, so
even these shapes cross tile, chunk and (with SEGMENT patched) segment boundaries.
The tests named ``gpu_geometry`` run the GPU's own tiles (``geometry()``) on
shapes that cross them.
"""

import importlib
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import gmm as gpu_gmm
from gpu.numba_cuda import scan as gpu_scan
from gpu.numba_cuda._device import SIMULATOR
from refimpl import gma, gmm, numerics

gpu_gma = importlib.import_module("gpu.numba_cuda.gma")  # the package's attribute gma is the function

F64 = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=2e-5, atol=2e-6)


def problem(seed, leading=(), per_head=False, n=5, K=3, d_r=2, d_v=3, dtype=np.float64):
    """Inputs of gma_forward: tokens with ``leading`` dimensions, a shared or per-head GMM."""
    rng = np.random.default_rng(seed)
    heads = leading[-1:] if per_head else ()
    shapes = [leading + (n, d_r), leading + (n, d_r), leading + (n, d_v), heads + (K, d_r), heads + (K, d_r), heads + (K,)]
    return [rng.normal(size=s).astype(dtype) for s in shapes]


def assert_matches(out, grads, ref_out, ref_grads, tol):
    assert isinstance(out, np.ndarray) and out.shape == ref_out.shape and out.dtype == ref_out.dtype
    np.testing.assert_allclose(out, ref_out, **tol)
    assert isinstance(grads, gma.GMAGrads)
    for name, a, b in zip(gma.GMAGrads._fields, grads, ref_grads):
        assert isinstance(a, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype, name
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=name)


CASES = [
    # (leading, per_head, causal, chunk_size, n, K, device GMM parameters); host arrays: tests/test_conformance.py
    pytest.param((2,), False, True, 3, 5, 2, True, id="batch-causal-device-gmm"),
    pytest.param((2, 3), True, True, 2, 2, 2, True, id="heads-per-head-causal-device-gmm"),
]


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a


@pytest.mark.parametrize("leading,per_head,causal,chunk,n,K,device_gmm", CASES)
def test_forward_and_all_gradients_match_refimpl_float64(leading, per_head, causal, chunk, n, K, device_gmm):
    """Outputs and gradients; with device GMM parameters, the small GMM arrays computed on the device (softplus,
    log-softmax, sigmoid, precisions) give refimpl's results too (and device gradients)."""
    args = problem(n * 10 + K, leading, per_head, n=n, K=K)
    gpu_args = args[:3] + [cuda.to_device(a) for a in args[3:]] if device_gmm else args
    out, cache = gpu_gma.gma_forward(*gpu_args, causal=causal, chunk_size=chunk)
    ref_out, ref_cache = gma.gma_forward(*args, causal=causal, chunk_size=chunk)
    g = np.random.default_rng(1).normal(size=ref_out.shape)
    grads = gpu_gma.gma_backward(g, cache)
    assert all(hasattr(a, "copy_to_host") == device_gmm for a in (out, *grads))
    assert_matches(_host(out), gma.GMAGrads(*map(_host, grads)), ref_out, gma.gma_backward(g, ref_cache), F64)


def test_cross_attention_and_the_segment_sums(monkeypatch):
    """N_q != N_k, with segments of 2 tokens: the bidirectional write and the parameter sums add several partials."""
    monkeypatch.setattr(gpu_scan, "SEGMENT", 2)
    rng = np.random.default_rng(2)
    args = [rng.normal(size=s) for s in ((2, 3, 2), (2, 5, 2), (2, 5, 3), (3, 2), (3, 2), (3,))]
    out, cache = gpu_gma.gma_forward(*args)
    ref_out, ref_cache = gma.gma_forward(*args)
    g = rng.normal(size=ref_out.shape)
    assert_matches(out, gpu_gma.gma_backward(g, cache), ref_out, gma.gma_backward(g, ref_cache), F64)


def test_device_arrays_in_device_arrays_out_and_deterministic():
    """Device tokens in give device arrays out; a second run (from NumPy inputs) gives the same bits (device GMM
    parameters take the device's softplus and log-softmax, equal to refimpl's to rounding: the CASES above)."""
    args = problem(6, (), False, n=3)
    runs = []
    for inputs in ([cuda.to_device(a) for a in args[:3]] + args[3:], args):
        out, cache = gpu_gma.gma_forward(*inputs, causal=True, chunk_size=2)
        grads = gpu_gma.gma_backward(np.ones(tuple(out.shape)), cache)
        on_device = inputs is not args
        assert all(hasattr(a, "copy_to_host") == on_device for a in (out, *grads))
        runs.append([a.copy_to_host() if on_device else a for a in (out, *grads)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    ref_out, ref_cache = gma.gma_forward(*args, causal=True, chunk_size=2)
    assert_matches(runs[1][0], gma.GMAGrads(*runs[1][1:]), ref_out, gma.gma_backward(np.ones(ref_out.shape), ref_cache), F64)


def test_float32_with_device_parameters_matches_refimpl_in_float32():
    """float32, per-head GMM on the device: outputs and gradients as refimpl computes them in float32; and gma with
    device variances and weights (float64) as refimpl's gma."""
    args = problem(3, (2,), True, n=4, dtype=np.float32)
    out, cache = gpu_gma.gma_forward(*args[:3], *(cuda.to_device(a) for a in args[3:]), causal=True, chunk_size=2)
    ref_out, ref_cache = gma.gma_forward(*args, causal=True, chunk_size=2)
    g = np.random.default_rng(4).normal(size=ref_out.shape).astype(np.float32)
    grads = gpu_gma.gma_backward(g, cache)
    assert_matches(out.copy_to_host(), gma.GMAGrads(*map(_host, grads)), ref_out, gma.gma_backward(g, ref_cache), F32)
    constrained = constrained_host(problem(5, (2,), True, n=3))
    got = gpu_gma.gma(*constrained[:3], *(cuda.to_device(a) for a in constrained[3:]), causal=True, chunk_size=2)
    np.testing.assert_allclose(got.copy_to_host(), gma.gma(*constrained, causal=True, chunk_size=2), **F64)


def _with(args, slot, value):
    args = list(args)
    args[slot] = value
    return args


def test_errors_of_device_parameters_are_refimpls():
    """A value check of gma_forward's and of gma's on device parameters (tokens on the host): counted on the device,
    worded by refimpl (per-head weights name their row; the other checks, the same code, in tests/test_gpu_gmm.py)."""
    args = problem(33, (2,), True, n=2, K=3)
    for slot, value in ((4, np.full((2, 3, 2), np.inf)),):
        bad = _with(args, slot, value)
        dev = bad[:3] + [cuda.to_device(a) for a in bad[3:]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _raises_like_refimpl(lambda: gpu_gma.gma_forward(*dev), lambda: gma.gma_forward(*bad))
    constrained = constrained_host(args)
    weights = constrained[5].copy()
    weights[1] *= 2.0
    for slot, value in ((5, weights),):
        bad = _with(constrained, slot, value)
        dev = bad[:3] + [cuda.to_device(a) for a in bad[3:]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _raises_like_refimpl(lambda: gpu_gma.gma(*dev), lambda: gma.gma(*bad))


def constrained_host(args):
    x_q, x_k, v, means, raw, logits = args
    return [x_q, x_k, v, means, gmm.variances_from_raw(raw), gmm.softmax(logits, axis=-1)]


def _raises_like_refimpl(gpu_call, ref_call):
    with pytest.raises(Exception) as ref:
        ref_call()
    with pytest.raises(type(ref.value)) as got:
        gpu_call()
    assert str(got.value) == str(ref.value)


def test_errors_on_device_arrays_and_computed_quantities_are_refimpls():
    args = problem(8, (2,), False, n=3)
    bad = args[1].copy()
    bad[1, 2, 0] = np.inf
    dev = [cuda.to_device(a) for a in args]
    # the input checks are read with the results, after the kernels ran on the infinity: the simulator evaluates each
    # thread with NumPy scalars and warns where a GPU computes inf silently
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _raises_like_refimpl(lambda: gpu_gma.gma_forward(dev[0], cuda.to_device(bad), *dev[2:]), lambda: gma.gma_forward(args[0], bad, *args[2:]))
    short = np.ascontiguousarray(args[1][:, :2])
    _raises_like_refimpl(lambda: gpu_gma.gma_forward(dev[0], cuda.to_device(short), *dev[2:]), lambda: gma.gma_forward(args[0], short, *args[2:]))
    # eps = 0 and a query of sequence 1 that meets no key: the denominator check, rows counted over the batch
    means = np.array([[-50.0, 0.0], [50.0, 0.0]])
    x_k = np.tile(means[0], (2, 3, 1))
    x_q = x_k.copy()
    x_q[1, 2] = means[1]
    call = dict(v=np.ones((2, 3, 1)), means=means, variances=np.ones((2, 2)), weights=np.array([0.5, 0.5]), eps=0.0)
    _raises_like_refimpl(lambda: gpu_gma.gma(cuda.to_device(x_q), x_k, **call), lambda: gma.gma(x_q, x_k, **call))
    # backward: the grad_out shape, a NaN on the device, and the cache type
    out, cache = gpu_gma.gma_forward(*dev)
    _, ref_cache = gma.gma_forward(*args)
    _raises_like_refimpl(lambda: gpu_gma.gma_backward(np.ones((2, 3, 2)), cache), lambda: gma.gma_backward(np.ones((2, 3, 2)), ref_cache))
    g = np.ones((2, 3, 3))
    g[0, 1, 2] = np.nan
    _raises_like_refimpl(lambda: gpu_gma.gma_backward(cuda.to_device(g), cache), lambda: gma.gma_backward(g, ref_cache))
    with pytest.raises(TypeError, match="cache: expected the GMADeviceCache from gpu.numba_cuda.gma.gma_forward, got GMABatchCache"):
        gpu_gma.gma_backward(np.ones((2, 3, 3)), ref_cache)


# ---------------------------------------------------------------------------
# The GPU's own tiles in the simulator, and the launch geometry
# ---------------------------------------------------------------------------


def gpu_tiles(responsibilities=True):
    """The GPU's tile geometries (the backward's, and the responsibilities' unless False): switched on in the
    simulator, already there on a GPU."""
    if not SIMULATOR:
        return nullcontext()
    return gpu_gma.geometry() if responsibilities else gpu_gma.geometry(gmm=gpu_gmm.SIMULATOR_GEOMETRY)


def test_gpu_geometry_forward_and_gradients_cross_the_tiles():
    """GPU tiles of the backward, float64: N = 33 crosses dL/dx's 32-row tile and the partials' 16-token stages,
    K = 33 dL/dx's 16-component stages (two whole, one partial) and the 32 x 32 partial tiles (the responsibilities
    keep the simulator's tiles here: theirs are crossed in tests/test_gpu_gmm.py)."""
    g = gpu_gma.GPU_GEOMETRY
    n, K = g.threads_y * g.rows_per_thread + 1, g.tile * g.params_per_thread + 1
    args = problem(21, (), False, n=n, K=K, d_r=3, d_v=2)
    with gpu_tiles(responsibilities=False):
        assert (gpu_gma.ROW_TILE, gpu_gma.PTILE, 2 * gpu_gma.MC, gpu_gma.TILE) == (n - 1, K - 1, K - 1, 16)
        out, cache = gpu_gma.gma_forward(*args)
        g_out = np.random.default_rng(22).normal(size=out.shape)
        grads = gpu_gma.gma_backward(g_out, cache)
    ref_out, ref_cache = gma.gma_forward(*args)
    assert_matches(out, grads, ref_out, gma.gma_backward(g_out, ref_cache), F64)


def test_gpu_geometry_row_gradients_cross_the_coordinate_tile():
    """dL/dx and c of _responsibility_rows at the GPU's tiles with d_r = 33: two 32-coordinate tiles, two stages of K."""
    g = gpu_gma.GPU_GEOMETRY
    N, K, d = 20, g.m_chunk + 1, g.threads_x * g.coords_per_thread + 1
    rng = np.random.default_rng(23)
    x = rng.normal(size=(1, N, d))
    means = rng.normal(size=(1, K, d))
    variances = rng.uniform(0.5, 2.0, size=(1, K, d))
    gamma = rng.dirichlet(np.ones(K), size=(1, N))
    grad = rng.normal(size=(1, N, K))
    c, dx = cuda.device_array((1, N, K)), cuda.device_array((1, N, d))
    with gpu_tiles():
        assert gpu_gma.COORD_TILE == d - 1
        grid, block = gpu_gma.backward_geometry(1, N, N, K, d)["_responsibility_rows q"]
        flat = [cuda.to_device(a.ravel()) for a in (x, gamma, grad, means, 1.0 / variances)]
        gpu_gma._rows_kernel(np.float64)[grid, block](*flat, c.reshape(c.size), dx.reshape(dx.size), 1, N, K, d, 1)
    ref_c = numerics.softmax_backward(gamma[0], grad[0], axis=1)
    # dL/dx_i = sum_m c_im (mu_m - x_i) / sigma_m^2
    ref_dx = np.einsum("im,imj->ij", ref_c, (means[0][None] - x[0][:, None]) / variances[0][None])
    np.testing.assert_allclose(c.copy_to_host()[0], ref_c, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx.copy_to_host()[0], ref_dx, rtol=1e-11, atol=1e-13)


def test_backward_blocks_loop_over_the_tiles_when_the_grid_is_capped(monkeypatch):
    """Grid x capped at 2 blocks: every backward kernel loops over several (sequence, tile) pairs; same gradients."""
    monkeypatch.setattr(gpu_gma, "MAX_GRID_X", 2)
    monkeypatch.setattr(gpu_gmm, "MAX_GRID_X", 2)
    monkeypatch.setattr(gpu_scan, "SEGMENT", 2)
    # K = d_r = 5: the parameter partials cross a tile of components and one of coordinates (PTILE = 4 here)
    args = problem(24, (3,), True, n=5, K=5, d_r=5)
    launches = gpu_gma.backward_geometry(3, 5, 5, 5, 5, 3, 2)
    assert all(grid <= 2 for grid, _ in launches.values())
    out, cache = gpu_gma.gma_forward(*args)
    ref_out, ref_cache = gma.gma_forward(*args)
    g = np.random.default_rng(25).normal(size=ref_out.shape)
    assert_matches(out, gpu_gma.gma_backward(g, cache), ref_out, gma.gma_backward(g, ref_cache), F64)


@pytest.mark.parametrize("B, N, K, d_r, H", [(1, 2**24, 256, 64, 1), (2**20, 64, 256, 64, 2**10), (2**20, 2**24, 1024, 129, 2**20)])
def test_launch_geometry_is_inside_every_hardware_limit(B, N, K, d_r, H):
    """N = 2^24 tokens, B H = 2^20 sequences: every launch of gma_forward's responsibilities and of gma_backward's
    kernels inside the limits (grid x < 2^31, y and z <= 65,535, <= 1024 threads), computed without launching."""
    with gpu_tiles():
        launches = {**gpu_gma.forward_geometry(B, N, N, K, d_r, H), **gpu_gma.backward_geometry(B, N, N, K, d_r, H, 256)}
        assert len(launches) == 9
        whole = gpu_gma.launch_geometry(B, N, N, K, d_r, 64, H, causal=True, chunk_size=64)
        assert whole["forward"] == gpu_gma.forward_geometry(B, N, N, K, d_r, H)
        assert whole["backward"] == gpu_gma.backward_geometry(B, N, N, K, d_r, H)
        for name, (grid, block) in launches.items():
            grid = grid if isinstance(grid, tuple) else (grid,)
            block = block if isinstance(block, tuple) else (block,)
            assert all(isinstance(v, int) and v >= 1 for v in grid + block), name
            assert grid[0] <= 2**31 - 1 and all(v <= 65535 for v in grid[1:]), (name, grid)
            assert int(np.prod(block)) <= 1024 and all(v <= 64 for v in block[2:]), (name, block)
        assert launches["_responsibility_rows q"][0] == min(B * -(-N // gpu_gma.ROW_TILE), 2**31 - 1)
        # static shared memory of dL/dx's kernel in float64: at most 48 KiB
        assert 8 * (gpu_gma.SH_RED + gpu_gma.SH_CR + gpu_gma.SH_MP) <= 48 * 1024


@pytest.fixture
def simulated_launches(monkeypatch):
    """The name of every kernel launched in the CUDA simulator, in order."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    log, launch = [], FakeCUDAKernel.__getitem__

    def logged(self, configuration):
        log.append(self.fn.__name__)
        return launch(self, configuration)

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", logged)
    return log


@pytest.mark.skipif(not SIMULATOR, reason="counts the simulator's launches")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_packed_call_launches_each_kernel_as_one_call_on_its_longest_sequence_does(simulated_launches, causal):
    """One launch per stage for all the sequences and heads: the launches of the longest sequence's own call, in order,
    whether 2 or 4 sequences are packed (the loop made those of every sequence); each sequence computed on its own."""
    rng = np.random.default_rng(14)
    x_q, x_k, v = (rng.normal(size=(7, 2, w)) for w in (2, 2, 3))  # 7 packed tokens of 2 heads
    params = (rng.normal(size=(2, 2, 2)), rng.uniform(0.5, 2.0, size=(2, 2, 2)), np.full((2, 2), 0.5))  # a GMM per head
    kw = dict(causal=causal, chunk_size=2)
    gpu_gma.gma(*(a[3:].transpose(1, 0, 2) for a in (x_q, x_k, v)), *params, **kw)  # the longest sequence: 4 tokens
    alone = list(simulated_launches)
    for cu_seqlens in ([0, 3, 7], [0, 0, 1, 1, 2, 3, 7]):
        simulated_launches.clear()
        out = gpu_gma.gma(x_q, x_k, v, *params, **kw, cu_seqlens=np.array(cu_seqlens))
        assert simulated_launches == alone
        np.testing.assert_allclose(out, gma.gma(x_q, x_k, v, *params, **kw, cu_seqlens=cu_seqlens), **F64)


@pytest.mark.skipif(not SIMULATOR, reason="counts the simulator's launches")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_packed_forward_and_its_backward_launch_each_kernel_as_the_longest_sequence_alone_does(simulated_launches, causal):
    """gma_forward and gma_backward of a packed call: the launches of the longest sequence's own forward and backward,
    whatever the number of sequences; the cache is the device cache, and the results are the reference's loop."""
    rng = np.random.default_rng(15)
    x_q, x_k, v = (rng.normal(size=(7, 2, w)) for w in (2, 2, 3))  # 7 packed tokens of 2 heads
    params = (rng.normal(size=(2, 2, 2)), rng.normal(size=(2, 2, 2)), rng.normal(size=(2, 2)))  # a GMM per head
    kw = dict(causal=causal, chunk_size=2)
    grad_out = rng.normal(size=(7, 2, 3))
    out, cache = gpu_gma.gma_forward(*(a[3:].transpose(1, 0, 2) for a in (x_q, x_k, v)), *params, **kw)  # 4 tokens
    forward = list(simulated_launches)
    simulated_launches.clear()
    gpu_gma.gma_backward(grad_out[3:].transpose(1, 0, 2), cache)
    backward = list(simulated_launches)
    for cu_seqlens in ([0, 3, 7], [0, 0, 1, 1, 2, 3, 7]):
        simulated_launches.clear()
        out, cache = gpu_gma.gma_forward(x_q, x_k, v, *params, **kw, cu_seqlens=np.array(cu_seqlens))
        assert simulated_launches == forward and isinstance(cache, gpu_gma.GMADeviceCache)
        simulated_launches.clear()
        grads = gpu_gma.gma_backward(grad_out, cache)
        assert simulated_launches == backward
        ref_out, ref_cache = gma.gma_forward(x_q, x_k, v, *params, **kw, cu_seqlens=cu_seqlens)
        assert_matches(out, grads, ref_out, gma.gma_backward(grad_out, ref_cache), F64)
