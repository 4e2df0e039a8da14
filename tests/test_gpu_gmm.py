"""gpu.numba_cuda.gmm against refimpl.gmm: device arrays, hard inputs, the device core, its tiles and its SASS.

Outputs, dtypes and refusals on host arrays are held to refimpl.gmm in
tests/test_conformance.py.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py),
with the simulator's small tiles, and, in the tests named ``gpu_geometry``,
with the GPU's own tiles (:data:`gpu.numba_cuda.gmm.GPU_GEOMETRY`) on shapes
that cross two tiles of rows, two of components and two stages of coordinates.
The GPU builds' stage loop is also read in the sm_90 SASS (ptxas and cuobjdump,
no GPU): unrolled, 128-bit shared loads, instructions per FLOP, no spills.
The simulator evaluates a kernel with NumPy scalars in threads of its own,
where ``np.errstate`` does not reach: inputs that overflow on purpose are run
under :func:`quiet`, which silences those RuntimeWarnings (a GPU raises none).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import gmm as G
from gpu.numba_cuda._device import SIMULATOR
from gpu.numba_cuda.gmm import GPU_GEOMETRIES, GPU_GEOMETRY, GPU_GEOMETRY_F64, THREADS, launch_geometry, posterior_device
from refimpl import gmm as R
from refimpl import numerics
from refimpl.testing import exact_responsibilities, row_relative_error, spread_means_example


@contextmanager
def quiet():
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def problem(N, K, d, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, d))
    means = rng.normal(size=(K, d))
    variances = rng.uniform(0.3, 2.0, size=(K, d))
    weights = rng.dirichlet(np.ones(K))
    return tuple(a.astype(dtype) for a in (x, means, variances, weights))


def gpu_tiles():
    """The GPU's tile geometries (by dtype): switched on in the simulator, already there on a GPU."""
    return G.geometry(GPU_GEOMETRIES) if SIMULATOR else nullcontext()


def crossing(g=None):
    """``(N, K, d)`` one more than a tile of rows, a tile of components and a stage of coordinates of geometry ``g``."""
    g = g or G.GEOMETRIES[np.dtype(np.float64)]
    return g.threads_y * g.rows_per_thread + 1, g.threads_x * g.comps_per_thread + 1, g.d_chunk + 1


def test_coordinates_of_1e6_with_variances_at_the_floor_and_rows_far_from_every_component():
    rng = np.random.default_rng(3)
    means = 1e6 * rng.normal(size=(5, 3))
    variances = np.full((5, 3), 1e-6)
    near = means[[0, 3, 3]] + 1e-3 * rng.normal(size=(3, 3))
    far = 1e6 * rng.normal(size=(2, 3))
    x = np.concatenate([near, far])
    weights = np.full(5, 0.2)
    resp = G.responsibilities(x, means, variances, weights)
    np.testing.assert_allclose(resp, R.responsibilities(x, means, variances, weights), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(resp.sum(axis=1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(G.log_responsibilities(x, means, variances, weights).max(axis=1), 0.0, atol=1e-14)


def test_4096_components_one_row():
    rng = np.random.default_rng(4)
    means = 1e6 * rng.normal(size=(4096, 2))
    variances = np.full((4096, 2), 1e-6)
    x = means[[17]] + 1e-3 * rng.normal(size=(1, 2))
    weights = np.full(4096, 1 / 4096)
    log_resp = G.log_responsibilities(x, means, variances, weights)
    ref = R.log_responsibilities(x, means, variances, weights)
    near = ref > -700  # the entries with a weight; the others are huge negative numbers, compared relatively
    np.testing.assert_allclose(log_resp[near], ref[near], rtol=0, atol=1e-12)
    np.testing.assert_allclose(log_resp, ref, rtol=1e-12)


def test_the_spread_means_counterexample_is_exact():
    """Means 1e4 apart with variances 1e-8: the differences ``x - mu`` give every digit."""
    x, means, variances, weights = spread_means_example(n=3)
    exact = exact_responsibilities(x, means, variances, weights)
    assert row_relative_error(G.responsibilities(x, means, variances, weights), exact) < 1e-12
    np.testing.assert_allclose(G.log_responsibilities(x, means, variances, weights).max(axis=1), np.log(exact.max(axis=1)), rtol=0, atol=1e-12)


def test_a_row_with_some_overflowing_distances_still_has_a_posterior():
    """Only the components at an infinite distance drop out (x^2 / sigma^2 = inf for the second)."""
    x, means, variances = np.array([[1e10]]), np.zeros((2, 1)), np.array([[1.0], [1e-300]])
    with quiet():
        resp = G.responsibilities(x, means, variances, np.array([0.5, 0.5]))
    np.testing.assert_array_equal(resp, [[1.0, 0.0]])


def test_far_points_whose_expansion_overflows_are_exact():
    """x^2 / sigma^2 overflows in an expansion, the difference x - mu does not."""
    x, means = np.array([[1e200, 0.0]]), np.array([[1e200, 0.0], [-1e200, 0.0]])
    with quiet():
        resp = G.responsibilities(x, means, np.ones((2, 2)), np.array([0.5, 0.5]))
    np.testing.assert_array_equal(resp, [[1.0, 0.0]])


@pytest.mark.parametrize("dtype, variance", [(np.float32, 1e-30), (np.float64, 1e-300)])
def test_rows_whose_every_distance_overflows_are_refused_with_the_reference_message(dtype, variance):
    x = np.array([[1e6, 0.5], [0.0, 0.0]], dtype=dtype)
    means = np.array([[0.0, 1.0], [0.0, -1.0]], dtype=dtype)
    variances = np.full((2, 2), variance, dtype=dtype)
    weights = np.array([0.5, 0.5], dtype=dtype)
    with quiet():
        with pytest.raises(ValueError) as ref:
            R.responsibilities(x, means, variances, weights)
        for fn in (G.responsibilities, G.log_responsibilities):
            with pytest.raises(ValueError) as got:
                fn(cuda.to_device(x), means, variances, weights)
            assert str(got.value) == str(ref.value)
    assert "(first: row 0)" in str(ref.value)


def _bad_calls():
    x, means, variances, weights = problem(4, 3, 2, seed=5)
    nan_x = x.copy()
    nan_x[2, 1] = np.nan
    return [
        ("variances <= 0", (x, means, -variances, weights)),
        ("weights do not sum to one", (x, means, variances, 2 * weights)),
        ("means of the wrong width", (x, means[:, :1].copy(), variances, weights)),
        ("x 1-D", (x[0].copy(), means, variances, weights)),
        ("x with a NaN", (nan_x, means, variances, weights)),
        ("integer x", (x.astype(np.int64), means, variances, weights)),
    ]


@pytest.mark.parametrize("name, args", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors_on_device_arrays_are_the_references(name, args):
    """Every argument a device array (host arrays: tests/test_conformance.py)."""
    with pytest.raises((ValueError, TypeError)) as ref:
        R.responsibilities(*args)
    with quiet(), pytest.raises(ref.type) as got:  # device values are checked after the kernels ran on them
        G.responsibilities(*(cuda.to_device(a) for a in args))
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("on_device", [(True, True, True), (False, True, False)], ids=["all", "variances"])
def test_errors_of_device_parameters_are_the_references(on_device):
    """Parameters on the device, x on the host: each value error worded as refimpl words it (the device counts it,
    refimpl's checker on host copies words it)."""
    x, means, variances, weights = problem(4, 3, 2, seed=5)
    bad = [(-variances, 1), (np.where(variances > 1.0, 0.0, variances), 1), (np.full_like(means, np.nan), 0),
           (np.array([0.2, 0.2, 0.2]), 2), (np.array([1.0, np.inf, 0.0]), 2), (np.array([1.5, -0.5, 0.0]), 2)]
    checked = 0
    for value, slot in bad:
        if not on_device[slot]:
            continue
        args = [means, variances, weights]
        args[slot] = value
        with pytest.raises(ValueError) as ref:
            R.responsibilities(x, *args)
        dev = [cuda.to_device(a) if d else a for a, d in zip(args, on_device)]
        with quiet(), pytest.raises(ValueError) as got:
            G.log_responsibilities(x, *dev)
        assert str(got.value) == str(ref.value)
        checked += 1
    assert checked >= 2


def test_device_parameters_give_the_host_parameters_results_with_one_copy(host_copies):
    """Device means, variances and weights (a zero weight among them): the host parameters' responsibilities, one copy
    to the host; weights off one by 3/4 of refimpl's tolerance pass its check and cost more copies (the device only
    screens: a row past half the tolerance is checked again on the host)."""
    x, means, variances, weights = problem(*crossing(), seed=9)
    weights[1] = 0.0
    weights /= weights.sum()
    host = G.log_responsibilities(x, means, variances, weights)
    host_copies["n"] = 0
    dev = G.log_responsibilities(cuda.to_device(x), *(cuda.to_device(a) for a in (means, variances, weights)))
    assert host_copies["n"] == 1
    np.testing.assert_allclose(dev.copy_to_host(), host, rtol=1e-14, atol=1e-14)
    atol = np.sqrt(np.finfo(np.float64).eps) * weights.size
    near = weights.copy()
    near[0] += 0.75 * atol
    host_copies["n"] = 0
    got = G.responsibilities(x, means, variances, cuda.to_device(near))
    assert host_copies["n"] > 1
    np.testing.assert_allclose(got, R.responsibilities(x, means, variances, near), rtol=1e-12, atol=1e-14)


def test_device_arrays_in_give_device_arrays_out():
    args = problem(2, 3, 2, seed=6)
    host = G.log_responsibilities(*args)
    assert isinstance(host, np.ndarray)
    dev = G.log_responsibilities(cuda.to_device(args[0]), *args[1:])
    assert hasattr(dev, "copy_to_host") and dev.shape == (2, 3)
    np.testing.assert_array_equal(dev.copy_to_host(), host)
    dev = G.responsibilities(*args[:3], cuda.to_device(args[3]))
    assert hasattr(dev, "copy_to_host")
    np.testing.assert_array_equal(dev.copy_to_host(), G.responsibilities(*args))


def test_results_are_bit_identical_from_run_to_run():
    args = problem(2, THREADS + 3, 3, seed=7)
    np.testing.assert_array_equal(G.responsibilities(*args), G.responsibilities(*args))


@pytest.mark.parametrize("log", [False, True])
def test_posterior_device_runs_every_sequence_under_mixture_b_mod_h(log):
    rng = np.random.default_rng(8)
    B, H, N, K, d = 4, 2, 2, 3, 2
    x = rng.normal(size=(B, N, d))
    means = rng.normal(size=(H, K, d))
    variances = rng.uniform(0.5, 2.0, size=(H, K, d))
    log_weights = np.log(rng.dirichlet(np.ones(K), size=H))
    gamma, min_quad = posterior_device(*(cuda.to_device(a) for a in (x, means, variances, log_weights)), log=log)
    assert gamma.shape == (B, N, K) and min_quad.shape == (B, N)
    gamma, min_quad = gamma.copy_to_host(), min_quad.copy_to_host()
    normalise = numerics.log_softmax if log else numerics.softmax
    for b in range(B):
        h = b % H
        logits, ref_min = R.log_joint(x[b], means[h], variances[h], log_weights[h])
        ref = normalise(logits, axis=1)
        np.testing.assert_allclose(gamma[b], ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(min_quad[b], ref_min, rtol=1e-12)


def test_posterior_device_with_one_point_and_one_component():
    x, means, variances = np.array([[[0.5, -1.0]]]), np.array([[[0.0, 1.0]]]), np.array([[[2.0, 0.5]]])
    gamma, min_quad = posterior_device(*(cuda.to_device(a) for a in (x, means, variances, np.zeros((1, 1)))), log=True)
    assert gamma.copy_to_host().tolist() == [[[0.0]]]
    np.testing.assert_allclose(min_quad.copy_to_host(), [[0.25 / 2.0 + 4.0 / 0.5]], rtol=1e-15)


def test_gpu_geometry_float64_crosses_every_tile():
    """float64's 32 x 32 block tiles of 16 x 16 threads (2 x 2 registers), 8 coordinates a stage: N = 33, K = 33,
    d = 9 cross each once."""
    N, K, d = crossing(GPU_GEOMETRY_F64)
    args = problem(N, K, d, seed=11)
    # half the rows at the last component, alone in the second component tile: the row maxima rise there, so the
    # running sums of the first tile must be rescaled
    args[0][::2] = args[1][-1] + 0.05 * np.random.default_rng(12).normal(size=(len(args[0][::2]), d))
    with gpu_tiles():
        c = G.constants(np.float64)
        assert (c["TILE_ROWS"], c["TILE_COMPS"], c["DC"], c["RM"], c["RK"]) == (N - 1, K - 1, d - 1, 2, 2)
        got = G.responsibilities(*args)
    np.testing.assert_allclose(got, R.responsibilities(*args), rtol=1e-12, atol=1e-14)


def test_gpu_geometry_float32_log_crosses_every_tile():
    """float32 log-responsibilities with float32's 64 x 64 tiles (4 x 4 registers) and 8-coordinate stages crossed once:
    N = 65, K = 65, d = 9 (each thread stages two coordinates of a row of x, the second past d in the last stage; b % H
    with several mixtures below)."""
    N, K, d = crossing(GPU_GEOMETRY)
    rng = np.random.default_rng(12)
    x = rng.normal(size=(1, N, d)).astype(np.float32)
    means = rng.normal(size=(1, K, d)).astype(np.float32)
    variances = rng.uniform(0.5, 2.0, size=(1, K, d)).astype(np.float32)
    log_weights = np.log(rng.dirichlet(np.ones(K), size=1)).astype(np.float32)
    x[0, ::2] = means[0, -1]  # rows whose maximum is in the second component tile: the running sums are rescaled
    with gpu_tiles():
        assert G.constants(np.float32)["TILE_ROWS"] == N - 1 and G.constants(np.float32)["RM"] == 4
        gamma, min_quad = posterior_device(*(cuda.to_device(a) for a in (x, means, variances, log_weights)), log=True)
    gamma, min_quad = gamma.copy_to_host(), min_quad.copy_to_host()
    assert gamma.dtype == np.float32
    logits, ref_min = R.log_joint(x[0], means[0], variances[0], log_weights[0])
    np.testing.assert_allclose(gamma[0], numerics.log_softmax(logits, axis=1), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(min_quad[0], ref_min, rtol=2e-5, atol=1e-6)


def test_blocks_loop_over_the_tiles_when_the_grid_is_capped(monkeypatch):
    """With grid x capped at 2 blocks, each block runs several (sequence, row tile) pairs in turn."""
    monkeypatch.setattr(G, "MAX_GRID_X", 2)
    rng = np.random.default_rng(13)
    B, H = 3, 3
    N, K, d = crossing()
    x = rng.normal(size=(B, N, d))
    means = rng.normal(size=(H, K, d))
    variances = rng.uniform(0.5, 2.0, size=(H, K, d))
    log_weights = np.log(rng.dirichlet(np.ones(K), size=H))
    assert launch_geometry(B, N, K, d, H)["_posterior_tiles"][0] == 2
    gamma, min_quad = posterior_device(*(cuda.to_device(a) for a in (x, means, variances, log_weights)))
    gamma, min_quad = gamma.copy_to_host(), min_quad.copy_to_host()
    for b in range(B):
        logits, ref_min = R.log_joint(x[b], means[b], variances[b], log_weights[b])
        np.testing.assert_allclose(gamma[b], numerics.softmax(logits, axis=1), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(min_quad[b], ref_min, rtol=1e-12)


def _assert_inside_the_limits(launches):
    for name, (grid, block) in launches.items():
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        assert all(isinstance(n, int) and n >= 1 for n in grid + block), name
        assert grid[0] <= 2**31 - 1 and all(n <= 65535 for n in grid[1:]), (name, grid)
        assert np.prod(block) <= 1024 and block[0] <= 1024 and all(n <= 64 for n in block[2:]), (name, block)


@pytest.mark.parametrize("B, N, K, H", [(1, 2**24, 256, 1), (2**20, 64, 256, 2**10), (2**20, 2**24, 4096, 2**20), (1, 1, 1, 1)])
def test_launch_geometry_is_inside_every_hardware_limit(B, N, K, H):
    """N = 2^24 points, B H = 2^20 sequences and more: every grid and block inside the limits, computed without launching."""
    with gpu_tiles():
        for dtype in (np.float32, np.float64):
            launches = launch_geometry(B, N, K, 64, H, dtype)
            _assert_inside_the_limits(launches)
            assert launches["_posterior_tiles"][1] == (16, 16)
            c = G.constants(dtype)
            tiles = B * -(-N // c["TILE_ROWS"])
            assert launches["_posterior_tiles"][0] == min(tiles, 2**31 - 1)
            # static shared memory of the tiles kernel: at most 48 KiB
            assert np.dtype(dtype).itemsize * (c["SH_X"] + c["SH_C"] + 3 * c["SH_RED"]) <= 48 * 1024


def test_the_component_pairs_are_padded_to_whole_stages_and_tiles():
    """``padded``: d and K rounded up to the GPU's 8-coordinate stages and 64- (float32) or 32-component (float64) tiles,
    one stage when d = 0."""
    with gpu_tiles():
        assert G.padded(65, 9, np.float32) == (16, 128)
        assert G.padded(64, 8, np.float32) == (8, 64)
        assert G.padded(33, 9, np.float64) == (16, 64)
        assert G.padded(1, 0, np.float64) == (8, 32)


def test_a_geometry_whose_staged_entries_leave_a_run_of_components_is_refused():
    """A thread stages LOADS_X consecutive coordinates of a row of x and LOADS_C consecutive components, which must not
    wrap past threads_x (their slots then follow RK apart)."""
    c = G.tile_constants(G.Geometry(1, 1, 4, 2, 8))  # 8 threads: 2 coordinates of x and 4 components each
    assert (c["LOADS_X"], c["LOADS_C"], c["UNROLL"]) == (2, 4, 8)
    with pytest.raises(ValueError, match="one run of threads_x components"):
        G.tile_constants(G.Geometry(1, 4, 4, 1, 4))  # 4 threads of 16 components each, threads_x = 4


# --- the compiled inner loop (ptxas and cuobjdump, sm_90, without a GPU) ----------------------------------------

_COMPILE_TILES = """
import json, sys
import numpy as np
from gpu import sass
from gpu.numba_cuda import _device, gmm
names = {n for n in _device.KERNELS if n.startswith("gpu.numba_cuda.gmm._posterior_tiles")}
out = {}
for (name, dt), ptx in _device.compile_targets([(9, 0)], names=names)[(9, 0)].items():
    r = sass.assemble(ptx)
    (entry, res), = r["resources"].items()
    code = r["sass"].get(entry) or next(iter(r["sass"].values()))
    out[dt] = {"resources": res, "sass": code, "constants": gmm.tile_constants(gmm.GPU_GEOMETRIES[np.dtype(dt)])}
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def tiles_sass(request, tmp_path_factory):
    """``{dtype name: {"resources", "sass", "constants"}}`` of the GPU's two builds of ``_posterior_tiles``, compiled for
    sm_90 in a fresh process (the real CUDA target), kept in pytest's cache under a digest of the sources."""
    import hashlib
    import json
    import os
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    from gpu import sass

    for tool in ("ptxas", "cuobjdump"):
        if sass.find_tool(tool) is None:
            pytest.skip(f"{tool} not found: the {sass.TOOL_WHEELS[tool]} wheel (in the CUDA extras) is not installed")
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(_COMPILE_TILES.encode())
    for path in sorted((root / "gpu" / "numba_cuda").glob("*.py")) + [root / "gpu" / "sass.py"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("numba-cuda", "numba"):
        h.update(metadata.version(dist).encode())
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("gpu-gmm-tiles") if cache is not None else tmp_path_factory.mktemp("tiles")
    out = folder / f"sm90-{h.hexdigest()[:32]}.json"
    if not out.is_file():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([sys.executable, "-c", _COMPILE_TILES, str(tmp)], capture_output=True, text=True,
                              cwd=root, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        os.replace(tmp, out)
    return {dt: dict(v, sass=[tuple(i) for i in v["sass"]]) for dt, v in json.loads(out.read_text()).items()}


def _stage_loop(code):
    """The body of the stage loop: the one innermost loop that loads from global memory (LDG) and waits at a barrier
    (BAR): it stages a tile of coordinates, then takes their product."""
    from gpu import sass

    found = sass.loops(code)
    inner = [lp for lp in found if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in found)]
    bodies = [[ins for ins in code if lp[0] <= ins[0] <= lp[1]] for lp in inner]
    stages = [body for body in bodies if {"LDG", "BAR"} <= {ins[1].split(".")[0] for ins in body}]
    assert len(stages) == 1, [(body[0][0], len(body)) for body in stages]
    return stages[0]


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_the_stage_loop_is_unrolled_with_128_bit_shared_loads_and_no_spills(tiles_sass, dt):
    """Each GPU build's stage loop (sm_90 SASS): every coordinate of the stage in it (one FMA a register-tile entry and
    coordinate), its shared reads 128-bit only (a thread's rows, then its components' pairs); the kernel at most 64
    registers (50% occupancy), no spills.  (Its instructions a useful FLOP: tests/test_gpu_resources.py.)"""
    row = tiles_sass[dt]
    c = row["constants"]
    res = row["resources"]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert res["registers"] <= 64, res
    fma = "FFMA" if dt == "float32" else "DFMA"
    body = _stage_loop(row["sass"])
    loads = [ins[1] for ins in body if ins[1].split(".")[0] == "LDS"]
    per_step = (c["RM"] + 2 * c["RK"]) * np.dtype(dt).itemsize // 16
    assert sum(ins[1].split(".")[0] == fma for ins in body) == c["RM"] * c["RK"] * c["DC"]
    assert loads == ["LDS.128"] * (per_step * c["DC"]), loads
