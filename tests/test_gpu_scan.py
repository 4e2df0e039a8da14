"""gpu.numba_cuda.scan (the chunked causal scan and its reverse, on the device) against refimpl.scan.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py),
with the simulator's small blocks (spans of 4 chunks, so that a few dozen
chunks make a tree of three levels) and, in one test, the GPU's own block
sizes (``TILE = 16``, spans of 16 chunks by 32 state entries).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import _primitives
from gpu.numba_cuda import scan as S
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
        (1, 19, 2, 2, True, 1),  # 19 chunks: spans of SPAN, three levels of the tree in the simulator
        (2, 23, 2, 3, True, 2),  # 12 chunks, the last one short
        (2, 9, 3, 2, True, 4),
        (1, 5, 2, 1, True, 8),  # one chunk longer than the sequence
        (2, 11, 3, 2, False, 4),
    ],
)
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-11), (np.float32, 2e-4)], ids=["float64", "float32"])
def test_forward_and_backward_match_the_reference(B, N, F, d_v, causal, chunk, dtype, rtol):
    _check(*_features(B, N, F, d_v, seed=N + chunk, dtype=dtype), causal, chunk, rtol)


def _gpu_sizes(monkeypatch, tile=True):
    if tile:
        monkeypatch.setattr(S, "TILE", 16)
        monkeypatch.setattr(S, "TILE2", (16, 16))
    monkeypatch.setattr(S, "SPAN", 16)
    monkeypatch.setattr(S, "LANES", 32)
    monkeypatch.setattr(S, "THREADS", 128)


def test_the_gpus_own_spans_match_the_reference(monkeypatch):
    """Spans of 16 chunks by 32 entries: 18 chunks of one token make two spans, then one: two levels."""
    _gpu_sizes(monkeypatch, tile=False)
    assert len(S.launch_geometry(1, 18, 5, 3, 1)["scan"]) == 2
    _check(*_features(1, 18, 5, 2, seed=3, dtype=np.float64), True, 1, 1e-11)


def test_the_gpus_own_tiles_match_the_reference(monkeypatch):
    """TILE = 16 as well: 17 features and rows across two tiles, three chunks of 16 tokens."""
    _gpu_sizes(monkeypatch)
    _check(*_features(1, 33, 17, 2, seed=4, dtype=np.float32), True, 16, 2e-4)


def test_the_scan_is_bit_identical_from_run_to_run():
    args = _features(1, 12, 3, 2, seed=5, dtype=np.float32)
    first, second = _device_scan(*args, True, 1), _device_scan(*args, True, 1)
    np.testing.assert_array_equal(first[0], second[0])
    for a, b in zip(first[2], second[2]):
        np.testing.assert_array_equal(a, b)


def test_the_tree_has_logarithmic_depth_and_linear_work(monkeypatch):
    """At N = 2^20 and C = 64: 16,384 chunks in ceil(log_16 16,384) = 4 levels (was one loop of 16,384 steps)."""
    _gpu_sizes(monkeypatch)
    n_chunks = 2**14
    plan = S.launch_geometry(1, 2**20, 8, 9, 64)
    levels = len(plan["scan"])
    assert levels == math.ceil(math.log(n_chunks, S.SPAN)) and len(plan["offsets"]) == levels - 1
    # the blocks of every level together cover the chunks of that level once: n + n / SPAN + ... < 2 n
    covered = [grid[0] // -(-(8 * 9) // S.LANES) * S.SPAN for grid, _ in plan["scan"]]
    assert covered[0] >= n_chunks and sum(covered) < 2 * n_chunks + S.SPAN * levels


def test_the_launch_geometry_keeps_every_hardware_limit(monkeypatch):
    """N = 2^24 tokens and B H = 2^20 sequences at the GPU's block sizes, computed without launching."""
    _gpu_sizes(monkeypatch)
    for B, N, F, E, chunk in ((2**20, 2**24, 16, 65, 64), (2**20, 2**24, 16, 65, 1), (1, 7, 3, 2, 64), (70000, 5, 2, 2, 2)):
        plan = S.launch_geometry(B, N, F, E, chunk)
        launches = [plan[k] for k in ("entries", "entries F", "states", "rows")] + plan["scan"] + plan["offsets"]
        for (x, y, z), block in launches:
            assert 1 <= x <= _primitives.MAX_GRID_X and 1 <= y <= 65535 and 1 <= z <= 65535
            assert y * z >= B and int(np.prod(block)) <= 1024


def test_more_sequences_than_one_grid_axis_holds(monkeypatch):
    """The sequences on grid y and z: with y forced to 1, every kernel must read its sequence from z."""
    monkeypatch.setattr(S, "sequence_axes", lambda n: (1, max(1, int(n))))
    _check(*_features(3, 9, 2, 2, seed=6, dtype=np.float64), True, 1, 1e-11)
    _check(*_features(3, 9, 2, 2, seed=7, dtype=np.float64), False, 2, 1e-11)


def test_the_device_cores_copy_nothing_to_the_host(host_copies):
    phi_q, phi_k, v, g = (cuda.to_device(a) for a in _features(2, 13, 3, 2, seed=8, dtype=np.float64))
    out, cache = S.scan_forward_device(phi_q, phi_k, v, True, EPS, 2)
    S.scan_backward_device(g, cache)
    assert host_copies["n"] == 0


def test_a_scan_wider_than_the_grid_steps_over_its_tiles(monkeypatch):
    """With the grid's x limit at 20 blocks, 3 spans x 8 tiles of entries do not fit: each block takes two tiles."""
    monkeypatch.setattr(S, "MAX_GRID_X", 20)
    plan = S.launch_geometry(1, 9, 5, 3, 1)
    assert S.SPAN != 4 or plan["scan"][0][0][0] == 3 * 6
    _check(*_features(1, 9, 5, 2, seed=9, dtype=np.float64), True, 1, 1e-11)
