"""gpu.numba_cuda.attention.softmax_attention (tiled online softmax): its tiles, device arrays and launches.

Outputs, dtypes and refusals on host arrays are held to
refimpl.attention.softmax_attention in tests/test_conformance.py.

Runs the kernels in the CUDA simulator when there is no GPU (tests/conftest.py),
with the simulator's small tiles (4 query rows by 2 keys, so that a key tile can
be entirely masked) and, in two tests, the GPU's own tiles (64 x 64 in float32,
32 x 32 in float64).  Inputs that overflow on purpose run under :func:`quiet`:
the simulator evaluates the kernel with NumPy scalars in threads that
``np.errstate`` does not reach.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import _primitives
from gpu.numba_cuda import attention as G
from refimpl import attention as R

_GEOMETRY = G.GEOMETRY[np.dtype(np.float64)]
#: Query rows per tile, coordinates per chunk of d, value columns per block (the tiles the launches use).
TILE, DTILE, COLS = _GEOMETRY.tile_q, _GEOMETRY.D_CHUNK, _GEOMETRY.COLS


@contextmanager
def quiet():
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def qkv(batch, N_q, N_k, d, d_v, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


def test_large_scores_need_the_running_rescaling():
    """Scores of a few hundred: exp would overflow without the running maximum subtracted."""
    q, k, v = qkv((), TILE + 2, TILE + 2, 2, 2, seed=2)
    out = G.softmax_attention(30 * q, 30 * k, v, scale=1.0)
    np.testing.assert_allclose(out, R.softmax_attention(30 * q, 30 * k, v, scale=1.0), rtol=1e-10, atol=1e-12)


def test_device_arrays_in_give_device_arrays_out():
    q, k, v = qkv((2,), 3, 3, 2, 2, seed=3)
    dev = G.softmax_attention(cuda.to_device(q), k, v, causal=True)
    assert hasattr(dev, "copy_to_host") and dev.shape == (2, 3, 2)
    np.testing.assert_array_equal(dev.copy_to_host(), G.softmax_attention(q, k, v, causal=True))


def test_results_are_bit_identical_from_run_to_run():
    q, k, v = qkv((), TILE + 2, TILE + 2, 3, 2, seed=4)
    np.testing.assert_array_equal(G.softmax_attention(q, k, v, causal=True), G.softmax_attention(q, k, v, causal=True))


def _bad_calls():
    q, k, v = qkv((), 4, 4, 3, 2, seed=5)
    nan_k = k.copy()
    nan_k[1, 2] = np.nan
    return [
        ("k of another width", (q, k[:, :2].copy(), v), {}),
        ("causal lengths", (q[:3].copy(), k, v), {"causal": True}),
        ("leading sizes differ", (q[None], np.stack([k, k]), np.stack([v, v])), {}),
        ("q batched, k and v not", (q[None], k, v), {}),
        ("k with a NaN", (q, nan_k, v), {}),
        ("scale <= 0", (q, k, v), {"scale": -1.0}),
        ("causal not bool", (q, k, v), {"causal": "yes"}),
    ]


@pytest.mark.parametrize("name, args, kw", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_errors_on_device_arrays_are_the_references(name, args, kw):
    """q, k and v device arrays (host arrays: tests/test_conformance.py)."""
    with pytest.raises((ValueError, TypeError)) as ref:
        R.softmax_attention(*args, **kw)
    with pytest.raises(ref.type) as got:
        G.softmax_attention(*(cuda.to_device(np.ascontiguousarray(a)) for a in args), **kw)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize(
    "dtype, N_q, N_k, d, d_v, causal, rtol",
    [
        # float32: 64 x 64 tiles; 65 rows cross two query tiles and two key tiles, the second one masked in part
        (np.float32, 65, 65, 3, 2, True, 1e-5),
        # float64: 32 x 32 tiles; 33 rows and keys cross two tiles, d = 66 two chunks of 64 (the query tile staged per
        # key tile), d_v = 65 two groups of 64 columns
        (np.float64, 33, 33, 66, 65, True, 1e-12),
    ],
    ids=["float32 64x64", "float64 32x32"],
)
def test_the_gpus_own_tiles_match_the_reference(monkeypatch, dtype, N_q, N_k, d, d_v, causal, rtol):
    monkeypatch.setattr(G, "GEOMETRY", G.GPU_GEOMETRY)
    g = G.GPU_GEOMETRY[np.dtype(dtype)]
    assert N_q > g.tile_q and N_k > g.tile_k and (d > g.D_CHUNK or d_v > g.COLS or dtype == np.float32)
    q, k, v = qkv((), N_q, N_k, d, d_v, seed=7, dtype=dtype)
    out = G.softmax_attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, R.softmax_attention(q, k, v, causal=causal), rtol=rtol, atol=rtol / 10)


def _first_tile_all_minus_inf(N, tile_k):
    """q, k, v whose row ``tile_k + 1`` scores -inf (overflow) against every key of the first key tile, finite after."""
    rng = np.random.default_rng(8)
    q = np.zeros((N, 2))
    q[:, 1] = rng.normal(size=N)
    k = np.zeros((N, 2))
    k[:, 1] = rng.normal(size=N)
    k[:tile_k, 0] = -1e200  # q_i . k_j = 1e200 * -1e200 = -inf for the row below, 0 * -1e200 = 0 for the others
    q[tile_k + 1, 0] = 1e200
    v = rng.normal(size=(N, 3))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
def test_a_row_whose_first_key_tile_is_all_minus_inf(causal):
    """The running pair starts at (-inf, 0) and stays there through a whole tile: e^{-inf - (-inf)} must not enter."""
    tile_k = _GEOMETRY.tile_k
    q, k, v = _first_tile_all_minus_inf(3 * tile_k + 1, tile_k)
    with quiet():
        ref = R.softmax_attention(q, k, v, scale=1.0, causal=causal)
        out = G.softmax_attention(q, k, v, scale=1.0, causal=causal)
    assert np.all(np.isfinite(ref))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


def test_a_causal_key_tile_entirely_masked_for_some_rows():
    """Tiles of 4 rows by 2 keys: rows 0 and 1 of a query tile see nothing of its second key tile (all j > i)."""
    assert _GEOMETRY.tile_q > _GEOMETRY.tile_k or not G.SIMULATOR
    q, k, v = qkv((), 2 * _GEOMETRY.tile_q + 1, 2 * _GEOMETRY.tile_q + 1, 3, 2, seed=9)
    np.testing.assert_allclose(G.softmax_attention(q, k, v, causal=True), R.softmax_attention(q, k, v, causal=True),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_launch_geometry_keeps_every_hardware_limit(monkeypatch, dtype):
    """N = 2^24 queries and B H = 2^20 sequences, computed without launching."""
    monkeypatch.setattr(G, "GEOMETRY", G.GPU_GEOMETRY)
    g = G.GPU_GEOMETRY[np.dtype(dtype)]
    for BH, N, d_v in ((2**20, 2**24, 64), (2**20, 1, 1), (1, 2**24, 129), (65536, 7, 8), (3, 5, 2)):
        (x, y, z), block = G.launch_geometry(BH, N, d_v, dtype)
        assert 1 <= x <= _primitives.MAX_GRID_X and 1 <= y <= 65535 and 1 <= z <= 65535
        assert int(np.prod(block)) <= 1024 and block == (g.threads,)
        assert y * z >= BH and x * g.tile_q >= N * 1  # every sequence and every query tile has a block
        assert x == -(-N // g.tile_q) * -(-d_v // g.COLS)
    assert g.tile_q >= (64 if dtype == np.float32 else 32) and g.tile_k >= (64 if dtype == np.float32 else 32)
    assert g.shared_bytes(np.dtype(dtype).itemsize) <= 48 * 1024


def test_more_sequences_than_one_grid_axis_holds(monkeypatch):
    """B H = 70,000 > 65,535: the sequences go onto grid y and z (the old grid put them on y alone)."""
    monkeypatch.setattr(G, "sequence_axes", lambda n: (max(1, -(-n // 3)), 3) if n > 1 else (1, 1))
    q, k, v = qkv((7,), 3, 3, 2, 2, seed=10)
    np.testing.assert_allclose(G.softmax_attention(q, k, v, causal=True), R.softmax_attention(q, k, v, causal=True),
                               rtol=1e-12, atol=1e-13)


def test_a_device_call_across_tiles_copies_to_the_host_once(host_copies):
    q, k, v = (cuda.to_device(a) for a in qkv((2,), 2 * TILE + 1, 2 * TILE + 1, DTILE + 1, COLS + 1, seed=11))
    out = G.softmax_attention(q, k, v, causal=True)
    assert host_copies["n"] == 1 and hasattr(out, "copy_to_host")


@pytest.fixture
def flash_launches(monkeypatch):
    """The launches of :func:`G._flash_forward`, each logged as its grid."""
    log, build = [], G._flash_kernel

    def counted(dtype):
        kernel = build(dtype)

        class Counted:
            def __getitem__(self, config):
                log.append(config[0])
                return kernel[config]

        return Counted()

    monkeypatch.setattr(G, "_flash_kernel", counted)
    return log


@pytest.mark.parametrize("cu_seqlens, heads", [([0, 0, 5, 6, 6, 9], 2), ([0, 3, 4, 9], 0)],
                         ids=["5 sequences, 2 heads", "3 sequences"])
def test_a_packed_call_is_one_launch_for_all_its_sequences(flash_launches, cu_seqlens, heads):
    """One launch whatever the number of sequences (the loop launched once per sequence); each computed on its own."""
    shape = (9, heads) if heads else (9,)
    rng = np.random.default_rng(12)
    q, k, v = (rng.normal(size=shape + (w,)) for w in (3, 3, 5))
    out = G.softmax_attention(q, k, v, causal=True, cu_seqlens=np.array(cu_seqlens))
    assert len(flash_launches) == 1
    # grid x: every sequence's query tiles (a sequence of 5 rows owns two tiles of 4) by the 2 groups of 5 > 4 value
    # columns, and nothing more
    tiles = sum(-(-(b - a) // TILE) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    assert flash_launches[0][0] == tiles * -(-5 // COLS)
    np.testing.assert_allclose(out, R.softmax_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens), rtol=1e-12, atol=1e-13)


def test_a_packed_call_whose_scores_overflow_is_refused_as_the_loop_refuses_it():
    """The launch's row maxima find the overflow; the loop then words it for the sequence's own rows."""
    rng = np.random.default_rng(13)
    q, k, v = (rng.normal(size=(6, w)) for w in (2, 2, 2))
    q[4], k[3:] = 1e300, 1e10  # row 1 of sequence 1 overflows: "row 1", not the packed row 4
    cu_seqlens = np.array([0, 3, 6])
    with quiet(), pytest.raises(ValueError, match="first: row 1") as expected:
        R.softmax_attention(q, k, v, cu_seqlens=cu_seqlens)
    with quiet(), pytest.raises(ValueError) as got:
        G.softmax_attention(q, k, v, cu_seqlens=cu_seqlens)
    assert str(got.value) == str(expected.value)
