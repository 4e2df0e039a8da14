"""gpu.numba_cuda.ovq against refimpl.ovq: its tiles and block sizes, device arrays, launches, copies, geometry.

Outputs, states, streaming, ties, dtypes and refusals on host arrays are held
to refimpl.ovq in tests/test_conformance.py.

Without a GPU the kernels run in the CUDA simulator (tests/conftest.py), which
runs every thread as a Python thread: the cases are tiny and few, most at the
simulator's block sizes, a few at the GPU's (``gpu_ovq.block_sizes``).  Also
counted: the launches per call (the chunk loop in one), the copies to the host per call (one),
and the launch geometry at T = 2^24 and B H = 2^20 (computed, not launched).
"""

import contextlib
import inspect
import warnings

import numpy as np
import pytest
from numba import cuda

from gpu.numba_cuda import ovq as gpu_ovq
from refimpl import ovq

TOL64 = dict(rtol=1e-10, atol=1e-12)
TOL32 = dict(rtol=1e-5, atol=1e-6)


def qkv(seed, N, d=3, d_v=2, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(N, n)).astype(dtype) for n in (d, d, d_v)]


def assert_state_close(state, ref, tol):
    assert isinstance(state, ovq.OVQState)
    assert (state.size, state.tokens_seen) == (ref.size, ref.tokens_seen)
    assert np.array_equal(state.counts, ref.counts)
    assert state.keys.dtype == ref.keys.dtype and state.counts.dtype == np.int64
    np.testing.assert_allclose(state.keys, ref.keys, **tol)
    np.testing.assert_allclose(state.values, ref.values, **tol)


def ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


def test_feature_and_value_dimensions_above_a_tile_and_a_later_key_tile_with_the_row_maximum():
    """d, d_v above a slab (several slabs); q = k without count bias: a row's largest logit, its own key, in a later tile."""
    assert gpu_ovq.SLAB < 9 and gpu_ovq.KEYS < 9
    q, _, v = qkv(12, 10, d=10, d_v=9)
    # the second chunk reads n = 5 centroids and 5 keys: two key tiles, rows 3 and 4 find their maximum in the second
    opts = dict(max_size=6, chunk_size=5, count_bias=False, growth="linear")
    out, state = gpu_ovq.ovq_attention(q, q, v, return_state=True, **opts)
    ref_out, ref_state = ovq.ovq_attention(q, q, v, return_state=True, **opts)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


@pytest.mark.parametrize("kw", [{"growth": "linear"}, {}, {"init": "random", "seed": 4}], ids=ids)
def test_chunks_longer_than_the_sorting_network_are_planned_by_comparing_every_pair(kw):
    """Chunks of 10 > PLAN_SORT keys (8 in the simulator): the plan ranks the seeds and orders the members by comparing
    every pair, a staged tile at a time (TILE_PLAN < 10 too); identical keys tie, and tie like refimpl's stable sorts."""
    assert gpu_ovq.PLAN_SORT < 10 and gpu_ovq.TILE_PLAN < 10
    q, k, v = qkv(31, 20)
    k[[3, 5, 7]] = k[1]
    k[[12, 15]] = k[11]
    opts = dict(max_size=12, chunk_size=10, return_state=True, **kw)
    out, state = gpu_ovq.ovq_attention(q, k, v, **opts)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


def test_device_arrays_in_give_device_arrays_out():
    q, k, v = qkv(8, 7)
    out, state = gpu_ovq.ovq_attention(cuda.to_device(q), k, cuda.to_device(v), max_size=4, chunk_size=3, return_state=True)
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=4, chunk_size=3, return_state=True)
    assert hasattr(out, "copy_to_host") and not isinstance(out, np.ndarray)
    np.testing.assert_allclose(out.copy_to_host(), ref_out, **TOL64)
    assert_state_close(state, ref_state, TOL64)


def test_two_runs_are_bit_identical():
    q, k, v = qkv(9, 6)
    opts = dict(max_size=5, chunk_size=3, init="random", seed=4, learning_rate=0.5)
    a, sa = gpu_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    b, sb = gpu_ovq.ovq_attention(q, k, v, return_state=True, **opts)
    assert np.array_equal(a, b)
    assert np.array_equal(sa.keys, sb.keys) and np.array_equal(sa.values, sb.values)
    assert np.array_equal(sa.counts, sb.counts)


def test_signature_is_refimpls():
    assert inspect.signature(gpu_ovq.ovq_attention) == inspect.signature(ovq.ovq_attention)
    assert inspect.signature(gpu_ovq.vq_attention) == inspect.signature(ovq.vq_attention)


def _raised(f):
    with pytest.raises(Exception) as info:
        f()
    return type(info.value), str(info.value)


_Q, _K, _V = qkv(0, 4)
_NAN = _Q.copy()
_NAN[2, 1] = np.nan
_STATE = ovq.OVQState(np.zeros((3, 3)), np.zeros((3, 2)), np.zeros(3, np.int64), 0, 0)
_LAGGING = ovq.OVQState(np.eye(6, 3), np.ones((6, 2)), np.array([4, 0, 0, 0, 0, 0]), 1, 4)
BAD_OVQ = {
    "missing max_size": ((_Q, _K, _V), dict(chunk_size=2)),
    "unknown keyword": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, chunksize=2)),
    "positional option": ((_Q, _K, _V, 3), dict(chunk_size=2)),
    "growth": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, growth="cubic")),
    "learning_rate": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, learning_rate=1.5)),
    "k shape": ((_Q, _K[:3], _V), dict(max_size=3, chunk_size=2)),
    "nan q": ((_NAN, _K, _V), dict(max_size=3, chunk_size=2)),
    "return_state": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, return_state="yes")),
    "state type": ((_Q, _K, _V), dict(max_size=3, chunk_size=2, state=(1, 2))),
    "state max_size": ((_Q, _K, _V), dict(max_size=4, chunk_size=2, state=_STATE)),
    "state lags its growth": ((_Q, _K, _V), dict(max_size=6, chunk_size=4, growth="linear", state=_LAGGING)),
}


@pytest.mark.parametrize("case", list(BAD_OVQ))
def test_ovq_errors_on_device_arrays_are_refimpls(case):
    """q, k and v device arrays (host arrays: tests/test_conformance.py)."""
    args, kw = BAD_OVQ[case]
    dev_args = tuple(cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args)
    expected = _raised(lambda: ovq.ovq_attention(*args, **kw))
    assert _raised(lambda: gpu_ovq.ovq_attention(*dev_args, **kw)) == expected


# --- VQ attention -----------------------------------------------------------------------


def test_vq_matches_refimpl_float32_and_device_arrays_stay_on_the_device():
    q, k, v = qkv(3, 9, d=4, d_v=3, dtype=np.float32)
    codebook = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    out = gpu_ovq.vq_attention(cuda.to_device(q), k, v, cuda.to_device(codebook), chunk_size=4, beta=1.7)
    assert hasattr(out, "copy_to_host") and out.dtype == np.float32
    np.testing.assert_allclose(out.copy_to_host(), ovq.vq_attention(q, k, v, codebook, chunk_size=4, beta=1.7), **TOL32)


BAD_VQ = {
    "codebook d": ((_Q, _K, _V, np.ones((2, 2))), dict(chunk_size=2)),
    "empty codebook": ((_Q, _K, _V, np.ones((0, 3))), dict(chunk_size=2)),
    "chunk_size": ((_Q, _K, _V, np.ones((2, 3))), dict(chunk_size=0)),
    "beta": ((_Q, _K, _V, np.ones((2, 3))), dict(chunk_size=2, beta=-1.0)),
    "nan q": ((_NAN, _K, _V, np.ones((2, 3))), dict(chunk_size=2)),
    "nan codebook": ((_Q, _K, _V, np.array([[1.0, np.nan, 0.0]])), dict(chunk_size=2)),
}


@pytest.mark.parametrize("case", list(BAD_VQ))
def test_vq_errors_on_device_arrays_are_refimpls(case):
    """Every array on the device (host arrays: tests/test_conformance.py)."""
    args, kw = BAD_VQ[case]
    dev_args = tuple(cuda.to_device(a) for a in args)
    expected = _raised(lambda: ovq.vq_attention(*args, **kw))
    assert _raised(lambda: gpu_ovq.vq_attention(*dev_args, **kw)) == expected


# --- the GPU's block sizes, launches per chunk, copies per call, launch geometry -----------------


def _gpu_block_sizes():
    """The GPU's block sizes: switched to in the simulator, already in force on a GPU."""
    return gpu_ovq.block_sizes(gpu_ovq.GPU_GEOMETRY) if gpu_ovq.SIMULATOR else contextlib.nullcontext()


def _gpu_tiles():
    """The predict kernel's tiles at the GPU's block sizes (:func:`gpu.numba_cuda.ovq.tile_sizes`)."""
    return gpu_ovq.tile_sizes(gpu_ovq.GPU_GEOMETRY)


# (options, dtype): a stream continued from refimpl's state after 72 tokens (n = 72 > KEYS = 64 centroids: two key
# tiles of centroids in the assignment and in the read-out, the second one shared with the chunk's keys), then a chunk
# of 33 > ROWS = 32 positions (two position tiles) and one of 2; d = 17 > 2 DC = 16 coordinates (three stages, the
# last ragged); float64 with d_v = 33 > VC = 32 value columns (two stages)
GPU_CASES = [
    ({"growth": "linear"}, np.float64, 33),
    ({"growth": "linear", "init": "random", "seed": 1, "learning_rate": 0.25, "count_bias": False}, np.float32, 3),
]


@pytest.mark.parametrize("kw, dtype, d_v", GPU_CASES, ids=[f"{ids(c[0])}-{np.dtype(c[1])}" for c in GPU_CASES])
def test_ovq_at_the_gpu_block_sizes_matches_refimpl(kw, dtype, d_v):
    t = _gpu_tiles()
    q, k, v = qkv(len(kw), 107, d=17, d_v=d_v, dtype=dtype)
    opts = dict(max_size=110, chunk_size=33, return_state=True, **kw)
    _, mid = ovq.ovq_attention(q[:72], k[:72], v[:72], **opts)
    ref_out, ref_state = ovq.ovq_attention(q[72:], k[72:], v[72:], state=mid, **opts)
    assert t["KEYS"] < mid.size < 2 * t["KEYS"] and t["ROWS"] < 33 and 2 * t["DC"] < 17 and t["VC"] < 33
    with _gpu_block_sizes():
        assert (gpu_ovq.ROWS, gpu_ovq.KEYS, gpu_ovq.DC, gpu_ovq.VC) == (t["ROWS"], t["KEYS"], t["DC"], t["VC"])
        out, state = gpu_ovq.ovq_attention(q[72:], k[72:], v[72:], state=mid, **opts)
    tol = TOL64 if dtype == np.float64 else TOL32
    assert out.dtype == dtype
    np.testing.assert_allclose(out, ref_out, **tol)
    assert_state_close(state, ref_state, tol)


@pytest.mark.parametrize("dtype", [np.float32])
def test_vq_at_the_gpu_block_sizes_matches_refimpl(dtype):
    """S = 65 codes: two key tiles of codes; chunks of 33 > ROWS positions and of 2."""
    q, k, v = qkv(17, 35, d=17, d_v=3, dtype=dtype)
    codebook = np.random.default_rng(4).normal(size=(65, 17)).astype(dtype)
    with _gpu_block_sizes():
        out = gpu_ovq.vq_attention(q, k, v, codebook, chunk_size=33)
    tol = TOL64 if dtype == np.float64 else TOL32
    np.testing.assert_allclose(out, ovq.vq_attention(q, k, v, codebook, chunk_size=33), **tol)


class _CountedKernel:
    """A kernel whose launches are logged by name: ``kernel[grid, block](...)`` appends to ``log``."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, config):
        launch = self.kernel[config]

        def call(*args):
            self.log.append(self.name)
            return launch(*args)

        return call

    def __getattr__(self, name):
        return getattr(self.kernel, name)  # the rest of the kernel's interface (compile, typeof_pyval, ...)


@pytest.fixture
def launches(monkeypatch):
    """Every launch of a kernel of gpu.numba_cuda.ovq, by name, in order.

    The kernels compiled with launch bounds are taken from their getters (``_predict``, ``_loop``: on a GPU a build
    of their own, kept per dtype), the others from the module."""
    log = []
    for name in ("_unit_rows_kernel", "_codes_kernel", "_merge_kernel", "_pack_counts_kernel"):
        monkeypatch.setattr(gpu_ovq, name, _CountedKernel(getattr(gpu_ovq, name), name, log))
    for getter, name in (("_predict", "_predict_kernel"), ("_loop", "_chunk_loop_kernel")):
        build = getattr(gpu_ovq, getter)
        monkeypatch.setattr(gpu_ovq, getter, lambda dtype, build=build, name=name: _CountedKernel(build(dtype), name, log))
    return log


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 2, "growth": "linear", "learning_rate": 0.5}], ids=ids)
def test_ovq_runs_its_whole_chunk_loop_in_one_launch(launches, kw):
    """8 chunks, one launch of the loop kernel (the unit rows before it, the counts packed after it), however many
    chunks; a packed call of five sequences (one empty) makes the same three launches."""
    q, k, v = qkv(3, 22)
    gpu_ovq.ovq_attention(q, k, v, max_size=6, chunk_size=3, return_state=True, **kw)
    assert launches == ["_unit_rows_kernel", "_chunk_loop_kernel", "_pack_counts_kernel"]
    launches.clear()
    gpu_ovq.ovq_attention(q, k, v, max_size=6, chunk_size=3, return_state=True, cu_seqlens=[0, 4, 4, 13, 14, 22], **kw)
    assert launches == ["_unit_rows_kernel", "_chunk_loop_kernel", "_pack_counts_kernel"]


def test_vq_launches_two_kernels_per_chunk(launches):
    q, k, v = qkv(4, 10)
    gpu_ovq.vq_attention(q, k, v, q[:3], chunk_size=4)
    assert launches == ["_unit_rows_kernel", "_codes_kernel"] + ["_predict_kernel", "_merge_kernel"] * 3


@pytest.mark.parametrize("device", [False, True], ids=["host inputs", "device inputs"])
def test_one_copy_to_the_host_per_call_with_the_state_and_the_output(host_copies, device):
    q, k, v = qkv(5, 13)
    args = [cuda.to_device(x) for x in (q, k, v)] if device else [q, k, v]
    out, state = gpu_ovq.ovq_attention(*args, max_size=5, chunk_size=3, init="random", seed=1, return_state=True)
    assert host_copies["n"] == 1
    ref_out, ref_state = ovq.ovq_attention(q, k, v, max_size=5, chunk_size=3, init="random", seed=1, return_state=True)
    assert_state_close(state, ref_state, TOL64)
    host_copies["n"] = 0
    codebook = q[:4]
    vargs = [cuda.to_device(x) for x in (q, k, v, codebook)] if device else [q, k, v, codebook]
    vout = gpu_ovq.vq_attention(*vargs, chunk_size=3)
    assert host_copies["n"] == 1
    np.testing.assert_allclose(out.copy_to_host() if device else out, ref_out, **TOL64)
    np.testing.assert_allclose(vout.copy_to_host() if device else vout, ovq.vq_attention(q, k, v, codebook, chunk_size=3), **TOL64)


def test_counts_beyond_float32_integers_reach_the_host_exactly():
    """The counts travel in 24-bit pieces in the call's float dtype: a count above 2^24 (and 2^48) comes back exact."""
    big = 2**50 + 2**24 + 3
    state = ovq.OVQState(np.eye(3, dtype=np.float32)[:, :3], np.ones((3, 2), np.float32), np.array([big, 5, 0]), 2, big + 5)
    q, k, v = qkv(6, 2, dtype=np.float32)
    _, st = gpu_ovq.ovq_attention(q, k, v, max_size=3, chunk_size=2, state=state, return_state=True)
    _, ref_st = ovq.ovq_attention(q, k, v, max_size=3, chunk_size=2, state=state, return_state=True)
    assert st.counts.dtype == np.int64 and np.array_equal(st.counts, ref_st.counts) and st.counts[0] >= big


@pytest.mark.parametrize("N, heads, C, with_keys", [
    (2**24, 2**20, 256, True), (2**24, 2**20, 2**24, True), (2**24, 1, 256, False), (1, 1, 1, True), (2**31 + 7, 3, 2**30, True),
])
def test_launch_geometry_stays_within_the_hardware_limits(N, heads, C, with_keys):
    d, d_v, n_max = 64, 64, 1024
    with _gpu_block_sizes():
        g = gpu_ovq.launch_geometry(N, heads, d, d_v, n_max, C, with_keys)
        rows, keys, flat = gpu_ovq.ROWS, gpu_ovq.KEYS, gpu_ovq.FLAT
    for grid, threads in (g.unit, g.codes, g.predict, g.merge, g.pack):
        x, y, z = grid
        assert 1 <= x <= 2**31 - 1 and 1 <= y <= 65535 and 1 <= z <= 65535 and 1 <= threads <= 1024
        assert all(isinstance(n, int) for n in (x, y, z, threads))
    Cm = min(C, N)
    assert g.chunk == Cm and g.splits * keys >= n_max + Cm and g.row_tiles * rows >= Cm
    # every head has its blocks: y z >= heads (the unit rows: q and k of each head)
    assert g.predict[0][1] * g.predict[0][2] >= heads and g.merge[0][1] * g.merge[0][2] >= heads
    assert g.unit[0][1] * g.unit[0][2] >= 2 * heads
    # the grids cover the work, or are capped at 2^31 - 1 blocks (the kernels loop grid-stride over the rest)
    width = d + d_v if with_keys else d_v
    assert g.centroid_tiles == (-(-n_max // keys) if with_keys else 0)
    for (grid, threads), items in ((g.predict, g.row_tiles * (g.splits + g.centroid_tiles)), (g.merge, -(-Cm * (d_v + width) // flat)),
                                   (g.unit, -(-N // (flat // keys))), (g.codes, -(-N // flat))):
        assert grid[0] == min(items, 2**31 - 1)
    assert g.predict[1] == gpu_ovq.tile_sizes(gpu_ovq.GPU_GEOMETRY)["NT"]


def test_launch_geometry_refuses_more_heads_than_two_grid_axes_hold():
    with pytest.raises(ValueError, match="heads"):
        gpu_ovq.launch_geometry(8, 65535**2, 4, 4, 8, 4)


def by_chunk_launches(q, k, v, p, Dk, Dv, counts, n, t):
    """OVQ's chunk loop as two launches per chunk (:func:`_predict_kernel`, then :func:`_merge_kernel`, the kernels VQ
    runs) for the H sequences of device arrays ``(H, N, .)``, all from ``(n, t)``: ``out (H, N, d_v)``, the states
    updated in place."""
    H, N, d = q.shape
    d_v = v.shape[2]
    f = q.dtype.type
    g = gpu_ovq.launch_geometry(N, H, d, d_v, p.max_size, p.chunk_size)
    plans, draws, _, _ = gpu_ovq._chunk_plans(N, p, n, t)
    draws = cuda.to_device(np.concatenate(draws) if draws else np.zeros(1, np.int64))
    qhat, khat = gpu_ovq._normalise(q, k, g)
    w = gpu_ovq._scratch(g, H, d_v, q.dtype)
    out, rowmax = cuda.device_array((H, N, d_v), q.dtype), cuda.device_array((H, N), q.dtype)
    eta = f(0 if p.eta is None else p.eta)
    for s, L, n, n_add, offset, use in plans:
        grid, threads, tiles, ctiles = g.predict_for(n, L)
        gpu_ovq._predict(q.dtype)[grid, threads](
            qhat, khat, v, cuda.device_array((1, 1), np.int64), s, L, Dk, Dv, counts, n, f(p.beta), f(-np.inf),
            np.int32(p.count_bias), tiles, ctiles, w.pmax, w.psum, w.pnum, w.abest, w.aarg, w.ticket, w.rows, w.seeded,
            w.order, w.srow, w.cbase, w.scores, n_add, draws, offset, np.int32(use), H)
        gpu_ovq._merge_kernel[g.merge_for(L)](
            khat, v, s, L, w.pmax, w.psum, w.pnum, n, out, rowmax, Dk, Dv, w.order, w.srow, w.seeded, w.cbase, eta,
            np.int32(1 | (2 if p.eta is not None else 0)), f(-np.inf), H)
    return out.copy_to_host()


def test_heads_launched_together_equal_one_call_each():
    """The chunk kernels take H sequences at once (heads on the grid's y, z); each head is refimpl's call on its own."""
    N, n_max, C, d, d_v = 10, 5, 3, 3, 2
    seqs = [qkv(40 + h, N, d=d, d_v=d_v) for h in range(3)]
    p = ovq.check_ovq_arguments(*seqs[0], n_max, C, None, "linear", "random", True, None, 1, None).params
    q, k, v = (cuda.to_device(np.stack([s[i] for s in seqs])) for i in range(3))
    Dk, Dv = cuda.to_device(np.zeros((3, n_max, d))), cuda.to_device(np.zeros((3, n_max, d_v)))
    counts = cuda.to_device(np.zeros((3, n_max), np.int64))
    out = by_chunk_launches(q, k, v, p, Dk, Dv, counts, 0, 0)
    Dk, counts = Dk.copy_to_host(), counts.copy_to_host()
    for h, (qh, kh, vh) in enumerate(seqs):
        ref_out, ref_state = ovq.ovq_attention(qh, kh, vh, max_size=n_max, chunk_size=C, growth="linear", init="random",
                                               seed=1, return_state=True)
        np.testing.assert_allclose(out[h], ref_out, **TOL64)
        np.testing.assert_allclose(Dk[h], ref_state.keys, **TOL64)
        assert np.array_equal(counts[h], ref_state.counts)


# (options, dtype, N, C, max_size, from a state of so many tokens): spread and random seeding, both updates, the count
# bias off, chunks longer than the sorting network (comparing every pair), a stream continued from a state
LOOP_CASES = [
    ({}, np.float64, 22, 3, 6, 0),
    ({"init": "random", "seed": 2, "growth": "linear", "learning_rate": 0.5}, np.float32, 22, 3, 6, 0),
    ({"count_bias": False, "growth": "linear"}, np.float64, 20, 10, 6, 0),
    ({"init": "random", "seed": 5}, np.float64, 13, 4, 9, 7),
]


def _state_arrays(state, n_max, d, d_v, dtype):
    if state is None:
        return np.zeros((1, n_max, d), dtype), np.zeros((1, n_max, d_v), dtype), np.zeros((1, n_max), np.int64), 0, 0
    return (state.keys[None].astype(dtype), state.values[None].astype(dtype), state.counts[None].copy(), state.size,
            state.tokens_seen)


@pytest.mark.parametrize("kw, dtype, N, C, n_max, before", LOOP_CASES, ids=[f"{ids(c[0])}-{np.dtype(c[1])}-{c[2]}/{c[3]}" for c in LOOP_CASES])
def test_the_loop_in_one_launch_gives_the_bits_of_two_launches_per_chunk(kw, dtype, N, C, n_max, before):
    """Output and state of the one-launch loop equal, bit for bit, those of the chunk loop as two launches per chunk
    (the same items, plans and merges, each computed as in its own launch)."""
    q, k, v = qkv(sum(map(ord, ids(kw))), before + N, dtype=dtype)
    opts = dict(max_size=n_max, chunk_size=C, **kw)
    state = ovq.ovq_attention(q[:before], k[:before], v[:before], return_state=True, **opts)[1] if before else None
    q, k, v = q[before:], k[before:], v[before:]
    out, new = gpu_ovq.ovq_attention(q, k, v, state=state, return_state=True, **opts)
    defaults = inspect.signature(ovq.ovq_attention).parameters
    p = ovq.check_ovq_arguments(q, k, v, n_max, C, None, *(opts.get(x, defaults[x].default) for x in
                                ("growth", "init", "count_bias", "learning_rate", "seed")), state).params
    Dk, Dv, counts, n, t = _state_arrays(state, n_max, q.shape[1], v.shape[1], dtype)
    Dk, Dv, counts = cuda.to_device(Dk), cuda.to_device(Dv), cuda.to_device(counts)
    ref = by_chunk_launches(*(cuda.to_device(x[None]) for x in (q, k, v)), p, Dk, Dv, counts, n, t)
    assert out.dtype == dtype and np.array_equal(out, ref[0])
    assert np.array_equal(new.keys, Dk.copy_to_host()[0]) and np.array_equal(new.values, Dv.copy_to_host()[0])
    assert np.array_equal(new.counts, counts.copy_to_host()[0])


def test_the_loop_at_the_gpu_block_sizes_gives_the_bits_of_two_launches_per_chunk():
    """At the GPU's tiles, from a state of 72 tokens (n = 72 > KEYS = 64: two key tiles of centroids), a chunk of 33 > ROWS
    = 32 positions (two position tiles), d = 9 > DC = 8 coordinates (two stages, the last ragged)."""
    q, k, v = qkv(9, 105, d=9, d_v=3)
    opts = dict(max_size=110, chunk_size=33, growth="linear")
    state = ovq.ovq_attention(q[:72], k[:72], v[:72], return_state=True, **opts)[1]
    q, k, v = q[72:], k[72:], v[72:]
    with _gpu_block_sizes():
        out, new = gpu_ovq.ovq_attention(q, k, v, state=state, return_state=True, **opts)
        p = ovq.check_ovq_arguments(q, k, v, 110, 33, None, "linear", "spread", True, None, 0, state).params
        Dk, Dv, counts, n, t = _state_arrays(state, 110, 9, 3, np.float64)
        Dk, Dv, counts = cuda.to_device(Dk), cuda.to_device(Dv), cuda.to_device(counts)
        ref = by_chunk_launches(*(cuda.to_device(x[None]) for x in (q, k, v)), p, Dk, Dv, counts, n, t)
    assert _gpu_tiles()["KEYS"] < state.size and _gpu_tiles()["ROWS"] < 33 < 2 * _gpu_tiles()["ROWS"]
    assert np.array_equal(out, ref[0]) and np.array_equal(new.keys, Dk.copy_to_host()[0])
    assert np.array_equal(new.values, Dv.copy_to_host()[0]) and np.array_equal(new.counts, counts.copy_to_host()[0])


PACKED = [0, 5, 5, 6, 15, 23]  # five sequences: 5 tokens, none, 1, 9, 8


@pytest.mark.parametrize("kw", [{}, {"init": "random", "seed": 3, "learning_rate": 0.5, "growth": "linear"}], ids=ids)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_packed_call_runs_every_sequence_in_the_one_launch_as_its_own_call(kw, dtype, host_copies):
    """Each sequence of a packed call (states given to some) equals its own call bit for bit, output and state; an
    empty sequence keeps the state it was given; one copy to the host."""
    q, k, v = qkv(21, 30, dtype=dtype)
    opts = dict(max_size=6, chunk_size=3, **kw)
    given = ovq.ovq_attention(q[23:], k[23:], v[23:], return_state=True, **opts)[1]
    states = [None, given, given, None, given]
    host_copies["n"] = 0
    out, new = gpu_ovq.ovq_attention(q[:23], k[:23], v[:23], cu_seqlens=PACKED, state=states, return_state=True, **opts)
    assert host_copies["n"] == 1 and out.dtype == dtype and len(new) == 5
    assert new[1] is given
    for i, (a, b) in enumerate(zip(PACKED[:-1], PACKED[1:])):
        if a == b:
            continue
        one, st = gpu_ovq.ovq_attention(q[a:b], k[a:b], v[a:b], state=states[i], return_state=True, **opts)
        assert np.array_equal(out[a:b], one)
        assert (new[i].size, new[i].tokens_seen) == (st.size, st.tokens_seen) and np.array_equal(new[i].counts, st.counts)
        assert np.array_equal(new[i].keys, st.keys) and np.array_equal(new[i].values, st.values)
    ref_out = ovq.ovq_attention(q[:23], k[:23], v[:23], cu_seqlens=PACKED, state=states, **opts)
    np.testing.assert_allclose(out, ref_out, **(TOL64 if dtype == np.float64 else TOL32))


def test_a_packed_call_leaves_a_refusal_to_the_loop_with_its_words():
    """A float32 call whose logits overflow (beta beyond float32), and a state refused for its own sequence (too small
    for the 2 centroids its one token's chunk would need, though the whole call's chunk of 3 could seed them), are refused
    as the per-sequence loop refuses them, word for word."""
    q, k, v = qkv(22, 12, dtype=np.float32)
    opts = dict(max_size=4, chunk_size=3)
    small = ovq.OVQState(np.eye(4, 3, dtype=np.float32), np.zeros((4, 2), np.float32), np.array([11, 0, 0, 0]), 1, 11)
    for extra, cuts, says in (({"beta": 1e39}, [0, 4, 12], "first: row 0"), ({"state": [None, small]}, [0, 11, 12], "first chunk of 1")):
        words = []
        for impl in (gpu_ovq, ovq):
            with pytest.raises(ValueError) as err, warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                impl.ovq_attention(q, k, v, cu_seqlens=cuts, **opts, **extra)
            words.append(str(err.value))
        assert words[0] == words[1] and says in words[0]


def test_the_loop_table_deals_each_sequence_its_own_chunks():
    """loop_plans: each sequence's chunks from its own first row, size and tokens seen; rounds past its end are empty;
    the drawn seeds of every sequence in one array, each chunk pointing at its own."""
    p = ovq.check_ovq_arguments(*qkv(0, 4), 6, 3, None, "linear", "random", True, None, 1, None).params
    plans, draws, ends = gpu_ovq.loop_plans([(0, 7, 0, 0), (7, 2, 5, 5), (9, 4, 2, 2)], p)
    assert plans.shape == (3, 3, 6)
    assert plans[0, :, :2].tolist() == [[0, 3], [3, 3], [6, 1]]
    assert plans[1, :, :2].tolist() == [[7, 2], [0, 0], [0, 0]]
    assert plans[2, :, :3].tolist() == [[9, 3, 2], [12, 1, 5], [0, 0, 0]]
    for j, (first, N, n, t) in enumerate([(0, 7, 0, 0), (7, 2, 5, 5), (9, 4, 2, 2)]):
        mine, drawn, n_end, t_end = gpu_ovq._chunk_plans(N, p, n, t)
        assert ends[j] == (n_end, t_end)
        for r, (s, L, n0, n_add, off, use) in enumerate(mine):
            assert plans[j, r, :4].tolist() == [first + s, L, n0, n_add] and plans[j, r, 5] == use
            if use:
                assert np.array_equal(draws[plans[j, r, 4]:plans[j, r, 4] + n_add], drawn[sum(x[5] for x in mine[:r])])
    reads, merges = gpu_ovq.loop_items(plans, 7)
    for r in range(3):
        # the running sums of the round's items over the sequences: predict items as the geometry counts them, merge
        # items 7 a key
        assert reads[r].tolist() == np.cumsum([-(-L // gpu_ovq.ROWS) * (-(-(n + L) // gpu_ovq.KEYS) + -(-n // gpu_ovq.KEYS))
                                               for _, L, n, *_ in plans[:, r]]).tolist()
        assert merges[r].tolist() == np.cumsum(7 * plans[:, r, 1]).tolist()
    g = gpu_ovq.launch_geometry(7, 1, 3, 2, 6, 3)
    assert reads[0, 0] == g.predict_for(0, 3)[0][0] and reads[1, 0] - 0 == g.predict_for(3, 3)[0][0]
