"""gpu.numba_cuda.scan (the chunked causal scan and its reverse, on the device) against refimpl.scan.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py).
The forward and backward are checked against :mod:`refimpl.scan` with the
simulator's small tiles (:data:`gpu.numba_cuda.scan.SIMULATOR_GEOMETRY`:
4 x 4 block tiles of 2 x 2 register tiles, 2 entries a stage, key tiles of
2; spans of 4 chunks, so that a few dozen chunks make a tree of three levels)
on shapes that cross every tile.  The two product kernels are checked on
their own, against their formulas in NumPy, with the GPU's own tiles of each
float type (:data:`gpu.numba_cuda.scan.GPU_GEOMETRIES`: in float32 64 x 64
block tiles of 4 x 4 register tiles, in float64 32 x 64 block tiles of 2 x 4;
8 entries a stage, key tiles of 32) on shapes that cross a block tile, a
register tile, a stage and a key tile: the simulator runs each of the 256
threads of a block as a Python thread, so those shapes hold few blocks.  One test runs the scan's tree with the GPU's spans (16 chunks by 32
entries).
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import _primitives
from gpu.numba_cuda import scan as S
from gpu.numba_cuda._device import SIMULATOR
from refimpl import scan as R

EPS = 1e-6


def _features(B, N, F, d_v, seed, dtype):
    rng = np.random.default_rng(seed)
    phi_q = rng.uniform(0.1, 1.0, (B, N, F)).astype(dtype)
    phi_k = rng.uniform(0.1, 1.0, (B, N, F)).astype(dtype)
    v = rng.normal(size=(B, N, d_v)).astype(dtype)
    g = rng.normal(size=(B, N, d_v)).astype(dtype)
    return phi_q, phi_k, v, g


def _device_scan(phi_q, phi_k, v, g, causal, chunk):
    out, cache = S.scan_forward_device(cuda.to_device(phi_q), cuda.to_device(phi_k), cuda.to_device(v), causal, EPS, chunk)
    grads = S.scan_backward_device(cuda.to_device(g), cache)
    return out.copy_to_host(), cache.den.copy_to_host(), [a.copy_to_host() for a in grads]


def _check(phi_q, phi_k, v, g, causal, chunk, rtol):
    out, den, grads = _device_scan(phi_q, phi_k, v, g, causal, chunk)
    for b in range(phi_q.shape[0]):
        ref_out, cache = R.scan_forward(phi_q[b], phi_k[b], v[b], causal, EPS, chunk)
        ref_grads = R.scan_backward(g[b], cache)
        np.testing.assert_allclose(out[b], ref_out, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(den[b], cache.den, rtol=rtol, atol=rtol)
        for got, want in zip(grads, ref_grads):
            np.testing.assert_allclose(got[b], want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    "B, N, F, d_v, causal, chunk",
    [
        (1, 17, 2, 2, True, 1),  # 17 chunks: spans of SPAN, three levels of the tree in the simulator (17, 5, 2)
        # F = E = 5 cross a block tile (4) and a register tile (2); chunks of 6 cross a tile of rows and of keys and
        # are not a multiple of a stage; 3 chunks, the last one short
        (1, 17, 5, 4, True, 6),
        (1, 5, 2, 1, True, 8),  # one chunk longer than the sequence
        (2, 11, 6, 5, False, 4),  # bidirectional: 11 rows across three row tiles, F = E = 6 across two
    ],
)
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-11), (np.float32, 2e-4)], ids=["float64", "float32"])
def test_forward_and_backward_match_the_reference(B, N, F, d_v, causal, chunk, dtype, rtol):
    _check(*_features(B, N, F, d_v, seed=N + chunk, dtype=dtype), causal, chunk, rtol)


def test_the_masked_scores_are_exact_zeros():
    """A last key of infinite features: its scores are inf, masked for the rows before it, which stay finite (0 is
    set there, not 0 * inf) and equal the reference's on the sequence without that key.  The chunk's total state
    (unused) holds inf - inf: the simulator's RuntimeWarnings for it are silenced (a GPU raises none)."""
    # N = 8: the last row tile (of 4 rows in the simulator, 64 on a GPU) holds the last key and rows before it
    N = 8
    phi_q, phi_k, v, g = _features(1, N, 3, 2, seed=10, dtype=np.float64)
    phi_k[0, -1] = np.inf
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        out, _ = S.scan_forward_device(cuda.to_device(phi_q), cuda.to_device(phi_k), cuda.to_device(v), True, EPS, N)
    got = out.copy_to_host()[0, :-1]
    assert np.all(np.isfinite(got))
    ref_out, _ = R.scan_forward(phi_q[0, :-1], phi_k[0, :-1], v[0, :-1], True, EPS, N)
    np.testing.assert_allclose(got, ref_out, rtol=1e-11, atol=1e-11)


# --- the two products with the GPU's own tiles, against their formulas ------------------------------------------


def gpu_tiles():
    """The GPU's tile geometries (one per float type): switched on in the simulator, already there on a GPU."""
    return S.geometry(S.GPU_GEOMETRIES) if SIMULATOR else nullcontext()


def _states_formula(y, z, chunk):
    """``partial[b, c] = Y_c^T Z_c`` per chunk of ``chunk`` tokens."""
    B, N, _ = y.shape
    return np.stack([np.stack([y[b, c:c + chunk].T @ z[b, c:c + chunk] for c in range(0, N, chunk)]) for b in range(B)])


def _rows_formula(p, states, transposed, x, y, z, chunk, within, lower, n_out):
    """``out[r] = p_r state_c (+ sum over the chunk's keys j <= r, or j >= r, of (x_r . y_j) z_j[:n_out])``."""
    B, N, _ = p.shape
    out = np.zeros((B, N, n_out), dtype=p.dtype)
    for b in range(B):
        for c0 in range(0, N, chunk):
            rows = slice(c0, min(c0 + chunk, N))
            state = states[b, c0 // chunk].T if transposed else states[b, c0 // chunk]
            out[b, rows] = p[b, rows] @ state[:, :n_out]
            if within:
                scores = x[b, rows] @ y[b, rows].T
                out[b, rows] += (np.tril(scores) if lower else np.triu(scores)) @ z[b, rows, :n_out]
    return out


@pytest.mark.parametrize("dtype, rtol, f_tiles", [(np.float64, 1e-12, 3), (np.float32, 1e-5, 2)],
                         ids=["float64", "float32"])
def test_gpu_geometry_chunk_states_cross_every_tile(dtype, rtol, f_tiles):
    """F = 65, E = 66: two block tiles each way in float32 (three of 32 features in float64), the last a part of a
    register tile; a chunk of 9 tokens: two stages, the second ragged."""
    B, N, F, E, chunk = 1, 9, 65, 66, 9
    rng = np.random.default_rng(11)
    y, z = rng.uniform(0.1, 1.0, (B, N, F)).astype(dtype), rng.normal(size=(B, N, E)).astype(dtype)
    n = -(-N // chunk)
    partial = cuda.device_array((B, n, F, E), dtype=dtype)
    with gpu_tiles():
        grid, block = S.launch_geometry(B, N, F, E, chunk, dtype)["states"]
        assert grid[0] == n * f_tiles * 2 and block == (16, 16)
        none = cuda.device_array(0, dtype=np.int64)  # no packed sequences: B sequences of N tokens
        S._states_kernel(dtype)[grid, block](S._flat(cuda.to_device(y)), S._flat(cuda.to_device(z)), (B, N, F, E, chunk, n),
                                     S._flat(partial), none, none)
    np.testing.assert_allclose(partial.copy_to_host(), _states_formula(y, z, chunk), rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    "N, chunk, n_in, n_pair, n_out, n_z, transposed, within, lower, dtype",
    [
        # the causal read: one chunk of 66 rows, three row tiles of 32 (float64); the lower mask across three key
        # tiles of 32; 9 entries h: two stages
        (66, 66, 9, 3, 5, 5, False, True, True, np.float64),
        # dphi_k's shape: the state transposed, the upper mask; 65 columns of 66 in z: two column tiles; chunks of 9,
        # 9 pair dimensions: two stages; in both types' tiles
        (12, 9, 3, 9, 65, 66, True, True, False, np.float32),
        (12, 9, 3, 9, 65, 66, True, True, False, np.float64),
        # the bidirectional read: one chunk of 70 rows, no within-chunk term, 65 columns
        (70, 70, 2, 2, 65, 65, False, False, True, np.float32),
    ],
    ids=["lower", "upper-transposed", "upper-transposed-float64", "bidirectional"],
)
def test_gpu_geometry_chunk_rows_cross_every_tile(N, chunk, n_in, n_pair, n_out, n_z, transposed, within, lower, dtype):
    rng = np.random.default_rng(N + n_out)
    n = -(-N // chunk)
    p = rng.uniform(0.1, 1.0, (1, N, n_in)).astype(dtype)
    states = rng.normal(size=(1, n, n_out, n_in) if transposed else (1, n, n_in, n_out + 1)).astype(dtype)
    x, y = (rng.uniform(0.1, 1.0, (1, N, n_pair)).astype(dtype) for _ in range(2))
    z = rng.normal(size=(1, N, n_z)).astype(dtype)
    with gpu_tiles():
        out = S._rows(*(cuda.to_device(a) for a in (p, states)), transposed, *(cuda.to_device(a) for a in (x, y, z)),
                      chunk, within, lower, n_out).copy_to_host()
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, _rows_formula(p, states, transposed, x, y, z, chunk, within, lower, n_out),
                               rtol=rtol, atol=rtol)


# --- the tree, the launch plan, the host copies -----------------------------------------------------------------


def _gpu_spans(monkeypatch):
    monkeypatch.setattr(S, "SPAN", 16)
    monkeypatch.setattr(S, "LANES", 32)
    monkeypatch.setattr(S, "THREADS", 128)


def test_the_gpus_own_span_is_a_reverse_exclusive_prefix(monkeypatch):
    """One span of 16 chunks by 32 entries (a block of 512 threads), reversed: the tree of the backward's sweep.

    The levels above a span are checked with the simulator's spans of 4 (19 chunks: three levels)."""
    _gpu_spans(monkeypatch)
    x = np.random.default_rng(3).normal(size=(1, 16, 3))
    d_x, total = cuda.to_device(x), cuda.device_array((1, 1, 3))
    plan = S.launch_geometry(1, 16, 3, 1, 1)
    assert len(plan["scan"]) == 1 and plan["scan"][0][1] == (32, 16)
    S._prefix(d_x, True, True, total, plan["scan"], plan["offsets"])
    later = np.cumsum(x[:, ::-1], axis=1)[:, ::-1] - x  # sum over the chunks after each
    np.testing.assert_allclose(d_x.copy_to_host(), later, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(total.copy_to_host()[:, 0], x.sum(axis=1), rtol=1e-12, atol=1e-12)


def test_the_scan_is_bit_identical_from_run_to_run():
    args = _features(1, 8, 5, 4, seed=5, dtype=np.float32)
    first, second = _device_scan(*args, True, 3), _device_scan(*args, True, 3)
    np.testing.assert_array_equal(first[0], second[0])
    for a, b in zip(first[2], second[2]):
        np.testing.assert_array_equal(a, b)


def test_the_tree_has_logarithmic_depth_and_linear_work(monkeypatch):
    """At N = 2^20 and C = 64: 16,384 chunks in ceil(log_16 16,384) = 4 levels (was one loop of 16,384 steps)."""
    _gpu_spans(monkeypatch)
    n_chunks = 2**14
    with gpu_tiles():
        plan = S.launch_geometry(1, 2**20, 8, 9, 64)
    levels = len(plan["scan"])
    assert levels == math.ceil(math.log(n_chunks, S.SPAN)) and len(plan["offsets"]) == levels - 1
    # the blocks of every level together cover the chunks of that level once: n + n / SPAN + ... < 2 n
    covered = [grid[0] // -(-(8 * 9) // S.LANES) * S.SPAN for grid, _ in plan["scan"]]
    assert covered[0] >= n_chunks and sum(covered) < 2 * n_chunks + S.SPAN * levels


def test_the_launch_geometry_keeps_every_hardware_limit(monkeypatch):
    """N = 2^24 tokens and B H = 2^20 sequences at the GPU's block sizes, computed without launching."""
    _gpu_spans(monkeypatch)
    with gpu_tiles():
        for B, N, F, E, chunk in ((2**20, 2**24, 16, 65, 64), (2**20, 2**24, 16, 65, 1), (1, 7, 3, 2, 64),
                                  (70000, 5, 2, 2, 2)):
            plan = S.launch_geometry(B, N, F, E, chunk)
            launches = [plan[k] for k in ("entries", "entries F", "states", "rows", "rows F", "rows V")]
            for (x, y, z), block in launches + plan["scan"] + plan["offsets"]:
                assert 1 <= x <= _primitives.MAX_GRID_X and 1 <= y <= 65535 and 1 <= z <= 65535
                assert y * z >= B and int(np.prod(block)) <= 1024
        # 64 x 64 output tiles (float32): 2^20 one-token chunks, 256 features and 65 columns make 2^20 x 4 x 2 blocks
        # of the states, 2^20 x 4 of the rows of dphi_q and dphi_k, 2^20 x 2 of the read and 2^20 x 1 of dv; 32 x 64
        # (float64): twice the states' blocks (8 x 2 feature and column tiles), the same rows (one-token chunks)
        plan = S.launch_geometry(1, 2**20, 256, 65, 1, dtype=np.float32)
        assert [plan[k][0][0] for k in ("states", "rows F", "rows", "rows V")] == [2**20 * 8, 2**20 * 4, 2**20 * 2, 2**20]
        plan = S.launch_geometry(1, 2**20, 256, 65, 1, dtype=np.float64)
        assert [plan[k][0][0] for k in ("states", "rows F", "rows", "rows V")] == [2**20 * 16, 2**20 * 4, 2**20 * 2, 2**20]
        # 64-token chunks: 2 row tiles of 32 in float64, 1 of 64 in float32
        rows = [S.launch_geometry(1, 2**20, 256, 65, 64, dtype=t)["rows"][0][0] for t in (np.float32, np.float64)]
        assert rows == [2**14 * 2, 2**14 * 2 * 2]


def test_more_sequences_than_one_grid_axis_holds(monkeypatch):
    """The sequences on grid y and z: with y forced to 1, every kernel must read its sequence from z."""
    monkeypatch.setattr(S, "sequence_axes", lambda n: (1, max(1, int(n))))
    _check(*_features(3, 6, 5, 2, seed=6, dtype=np.float64), True, 3, 1e-11)
    _check(*_features(3, 5, 2, 2, seed=7, dtype=np.float64), False, 2, 1e-11)


def test_the_device_cores_copy_nothing_to_the_host(host_copies):
    phi_q, phi_k, v, g = (cuda.to_device(a) for a in _features(2, 5, 3, 2, seed=8, dtype=np.float64))
    out, cache = S.scan_forward_device(phi_q, phi_k, v, True, EPS, 2)
    S.scan_backward_device(g, cache)
    assert host_copies["n"] == 0


def test_a_scan_wider_than_the_grid_steps_over_its_tiles(monkeypatch):
    """With the grid's x limit at 20 blocks, 3 spans x 8 tiles of entries do not fit: each block takes two tiles."""
    monkeypatch.setattr(S, "MAX_GRID_X", 20)
    plan = S.launch_geometry(1, 9, 5, 3, 1)
    assert S.SPAN != 4 or plan["scan"][0][0][0] == 3 * 6
    _check(*_features(1, 9, 5, 2, seed=9, dtype=np.float64), True, 1, 1e-11)
