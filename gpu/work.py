"""gpu.work: what each GPU kernel must compute, counted from the algorithm, and what its tiles make it compute.

Two counts per function and per compute kernel, neither read from the
compiled code:

* the *useful* floating-point operations and the bytes that must move, from
  the algorithm (a multiplication and an addition count as two; the
  ``O(N K)`` exponentials, logarithms and divisions are left out; float32,
  the ``K``-row parameters left out of the bytes): the formulas of
  :func:`responsibilities_counts` and the others, which
  ``benchmarks/bench_gpu.py`` reports its measurements with;
* the operations a kernel's work loop *executes*, from its launch geometry
  and tile sizes (:data:`KERNELS`): every thread of every block, every
  trip of the loops around the work, padding and masked or wasted tiles
  included.

Their ratio is the kernel's *useful fraction*: 1 when the tiles fit the
problem, below 1 when they pad it, compute a tile twice or do work the
algorithm does not need.  The gates of ``tests/test_gpu_resources.py``
multiply it by what the SASS says of the work loop (useful FLOPs per
instruction, :func:`gpu.sass.work_flops`) to get the useful FLOPs per issued
instruction, so that the compiled code cannot count its own waste as work.

Nothing here imports numba until a kernel's declaration is evaluated (it
reads the kernel module's GPU tile sizes, which exist in the simulator too).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

__all__ = ["FLOAT32", "responsibilities_counts", "gma_forward_counts", "gma_backward_counts", "gemm_counts",
           "attention_counts", "ovq_counts", "ovq_chunks", "KernelWork", "KERNELS", "declared"]

FLOAT32 = 4  # bytes an entry


# --- the algorithm's counts (bench_gpu.py's module docstring writes them out) ----------------------------------


def responsibilities_counts(N, K, d):
    """``(bytes, flops)``: read x, write gamma; the quadratic form ``4 N K d``."""
    return FLOAT32 * N * (d + K), 4 * N * K * d


def gma_forward_counts(N, K, d_r, d_v):
    """``(bytes, flops)``: read x_q, x_k, v, write out; two quadratic forms, the write and the read."""
    return FLOAT32 * N * (2 * d_r + 2 * d_v), 8 * N * K * d_r + 4 * N * K * (d_v + 1)


def gma_backward_counts(N, K, d_r, d_v):
    """``(bytes, flops)``: read g, x_q, x_k, v, write dx_q, dx_k, dv; the products of the module docstring."""
    return FLOAT32 * N * (4 * d_r + 3 * d_v), 16 * N * K * d_r + 6 * N * K * (d_v + 1) + 2 * N * K * d_v


def gemm_counts(N, K, d, d_v):
    """``(bytes, flops)`` of the equivalent GEMMs: X mu^T and X^2 mu^T for queries and keys, Gamma^T V, Gamma S."""
    return FLOAT32 * N * (2 * d + 2 * d_v), 8 * N * K * d + 4 * N * K * d_v


def attention_counts(N, d, causal):
    """``(bytes, flops)`` of softmax attention, ``d = d_v``: Q K^T and P V over every pair, or the pairs b <= a."""
    return FLOAT32 * 4 * N * d, (2 * N * (N + 1) * d if causal else 4 * N * N * d)


def ovq_chunks(T, max_size, chunk_size):
    """``[(L, n)]`` per chunk of OVQ over ``T`` tokens: its length and the centroids before it (the growth rule)."""
    from refimpl.ovq import dictionary_size

    return [(min(chunk_size, T - s), int(dictionary_size(s, max_size))) for s in range(0, T, chunk_size)]


def ovq_counts(T, d, d_v, max_size, chunk_size):
    """``(bytes, flops)`` of OVQ: the read-out and the assignment of every chunk, ``n_c`` from the growth rule."""
    flops = sum((2 * L * n + L * (L + 1)) * (d + d_v) + 2 * L * n * d for L, n in ovq_chunks(T, max_size, chunk_size))
    return FLOAT32 * T * (2 * d + 2 * d_v), flops


# --- what each compute kernel executes ---------------------------------------------------------------------------


def _ceil(a, b):
    return -(-a // b)


class KernelWork(NamedTuple):
    """A compute kernel's declared work at the sizes ``case`` (float32, its GPU tiles).

    ``flops``: the useful FLOPs of the algorithm done in its gated loop
    region; ``computed``: the FLOPs that region executes, summed over every
    thread and trip (the launch geometry and the tiles); ``step``: the
    FLOPs one thread's source step of that region does (or a function of no
    argument that gives them from the tiles; a multiple of it is
    what the compiled region holds: one step per unrolled copy); ``depth``:
    the loop depth of the region (``None``: :func:`gpu.sass.work_loop`'s;
    a region at a depth is the one with the most useful FLOPs there);
    ``bytes``: the bytes the kernel reads and writes at the least
    (intermediates included); ``launches``: how many times the function
    launches it at ``case``; ``kernel``: the kernel's qualified name when
    the key of :data:`KERNELS` is not (a second region of one kernel, the
    key then the name and the region's name).  ``what`` says in words what
    is counted.  ``items``: the work items (tiles) of the kernel's blocks,
    each of which runs the kernel's code outside its declared regions once
    (the model's epilogues).  ``calls``: for a kernel whose code is mostly
    device functions run at different rates, how often each runs, ``(unit,
    count)``: ``count(case)`` calls, each by a whole block (``"block"``) or
    by one thread (``"thread"``); the model then counts the code each call
    inlines (:func:`gpu.sass.kernel_calls`) that many times instead of all
    the kernel's code once per item (``"kernel"``: the code of no call).
    """

    case: dict
    flops: Callable
    computed: Callable
    step: int | Callable
    depth: int | None
    bytes: Callable
    what: str
    launches: Callable = lambda c: 1
    kernel: str | None = None  # the qualified name, when the key of KERNELS names a second region of a kernel
    items: Callable = lambda c: 0  # the block work items (tiles) whose epilogue runs once each, for the model
    calls: dict | None = None  # device function called -> ("block" or "thread", how often it runs at c), for the model


def _module(name):
    # importlib: the package's attributes of these names are functions (gpu.numba_cuda.gma is the function gma)
    import importlib

    return importlib.import_module("gpu.numba_cuda." + name)


def _gmm():
    gmm = _module("gmm")
    import numpy as np

    return gmm.tile_constants(gmm.GPU_GEOMETRIES[np.dtype(np.float32)])


def _scan():
    scan = _module("scan")

    return scan.tile_constants(scan.GPU_GEOMETRY), scan.SEGMENT


def _gma():
    gma = _module("gma")

    g = gma.GPU_GEOMETRY
    return dict(RM=g.rows_per_thread, RJ=g.coords_per_thread, TX=g.threads_x, TY=g.threads_y, MC=g.m_chunk, TILE=g.tile,
                PP=g.params_per_thread, NT=g.threads_x * g.threads_y, ROW_TILE=g.threads_y * g.rows_per_thread,
                COORD_TILE=g.threads_x * g.coords_per_thread, PTILE=g.tile * g.params_per_thread)


def _attention():
    attention = _module("attention")
    import numpy as np

    return attention.GPU_GEOMETRY[np.dtype(np.float32)]


def _ovq():
    ovq = _module("ovq")

    return ovq.tile_sizes(ovq.GPU_GEOMETRY)


def _posterior_computed(c):
    # every (row tile, component tile) of every thread, over d rounded up to whole stages: RM x RK (sub, mul, fma)
    t = _gmm()
    tiles = c["B"] * _ceil(c["N"], t["TILE_ROWS"]) * _ceil(c["K"], t["TILE_COMPS"])
    return tiles * t["NT"] * _ceil(c["d"], t["DC"]) * t["DC"] * t["RM"] * t["RK"] * 4


def _posterior_row_tiles(c):
    return c["B"] * _ceil(c["N"], _gmm()["TILE_ROWS"])


def _posterior_items(c):
    return _posterior_row_tiles(c) * _ceil(c["K"], _gmm()["TILE_COMPS"])


def _posterior_tail(c):
    # the last, partial stage of coordinates runs in every item where d is not a multiple of DC, in none where it is
    return _posterior_items(c) if c["d"] % _gmm()["DC"] else 0


def _posterior_calls():
    """How often each part of the responsibilities kernel runs, per block (``gpu.work.KernelWork.calls``)."""
    def rows_normalised(log):
        # each thread's RM rows: one entry of each, TX apart, per call: ceil(K / TX) calls (the last one masked)
        return lambda c: _posterior_row_tiles(c) * _ceil(c["K"], _gmm()["TX"]) if bool(c.get("log")) == log else 0

    return {
        # the epilogue of each component tile: l written, min q/2, the running (max, sum of exponentials)
        "absorb": ("block", _posterior_items),
        "load_tail": ("block", _posterior_tail),
        "stage_tail": ("block", _posterior_tail),
        # the lanes' ordered tree, log2(TX) steps per row tile
        "combine": ("block", lambda c: _posterior_row_tiles(c) * (_gmm()["TX"].bit_length() - 1)),
        "normalise": ("block", rows_normalised(False)),
        "log_normalise": ("block", rows_normalised(True)),
        # the kernel's own code: a row tile's setup and its rows' totals once per row tile (its per-component-tile
        # loop control, a few dozen instructions, is counted once too)
        "kernel": ("block", _posterior_row_tiles),
    }


def _states_computed(c):
    # every (chunk, feature tile, column tile) of every thread, over the chunk's tokens rounded up to whole stages
    t, _ = _scan()
    tiles = _ceil(c["F"], t["TILE_ROWS"]) * _ceil(c["E"], t["TILE_COLS"])
    tokens = sum(_ceil(min(c["chunk"], c["N"] - s), t["DC"]) * t["DC"] for s in range(0, c["N"], c["chunk"]))
    return c["B"] * tiles * tokens * t["NT"] * t["RM"] * t["RN"] * 2


def _rows_computed(c):
    # the carried state's product of every (row tile, column tile) of every thread, over n_in rounded up to stages
    t, _ = _scan()
    tiles = _ceil(c["N"], t["TILE_ROWS"]) * _ceil(c["n_out"], t["TILE_COLS"])
    return c["B"] * tiles * t["NT"] * _ceil(c["n_in"], t["DC"]) * t["DC"] * t["RM"] * t["RN"] * 2


def _dx_computed(c):
    # every (row tile, coordinate tile) of every thread, over K rounded up to whole stages: RM x RJ (sub, mul, fma)
    t = _gma()
    tiles = c["B"] * _ceil(c["N"], t["ROW_TILE"]) * _ceil(c["d"], t["COORD_TILE"])
    return tiles * t["NT"] * _ceil(c["K"], t["MC"]) * t["MC"] * t["RM"] * t["RJ"] * 4


def _partials_computed(c):
    # every (segment, component tile, coordinate tile) of every thread, over the segment's tokens rounded up to whole
    # stages: per token PP x PP (sub, fma, fma, fma) = 7 FLOPs an entry, and PP sums of c (one FLOP each)
    t = _gma()
    _, segment = _scan()
    tiles = _ceil(c["K"], t["PTILE"]) * _ceil(c["d"], t["PTILE"])
    tokens = sum(_ceil(min(segment, c["N"] - s), t["TILE"]) * t["TILE"] for s in range(0, c["N"], segment))
    return c["B"] * tiles * tokens * t["NT"] * (7 * t["PP"] ** 2 + t["PP"])


def _flash_computed(c):
    # q k^T: every (query tile, column group) of every thread, over the key tiles it visits (causal: those up to the
    # tile's last row), d rounded up to whole chunks of coordinates: RQ x RK fused multiply-adds a coordinate
    g = _attention()
    n_qt, n_cg = _ceil(c["N"], g.tile_q), max(1, _ceil(c["d"], g.COLS))
    if c["causal"]:
        k_tiles = sum(_ceil(min(c["N"], (q + 1) * g.tile_q), g.tile_k) for q in range(n_qt))
    else:
        k_tiles = n_qt * _ceil(c["N"], g.tile_k)
    return c["BH"] * n_cg * k_tiles * g.threads * c["d"] * g.RQ * g.RK * 2


def _flash_blocks(c):
    # one block per (sequence, query tile, column group)
    g = _attention()
    return c["BH"] * _ceil(c["N"], g.tile_q) * max(1, _ceil(c["d"], g.COLS))


def _flash_items(c):
    # the (query tile, column group, key tile) work items: every key tile a block visits
    return _flash_computed(c) // (_attention().tile_q * _attention().tile_k * 2 * c["d"])


def _flash_calls():
    """How often each part of the flash attention kernel runs, per block (``gpu.work.KernelWork.calls``)."""
    def q_stages(c):
        # q^T is staged once a block when it is resident (d <= D_CHUNK), else at every key tile, a chunk at a time
        chunks = _ceil(c["d"], _attention().D_CHUNK)
        return chunks * (_flash_blocks(c) if c["d"] <= _attention().D_CHUNK else _flash_items(c))

    return {
        "place": ("block", _flash_blocks),
        "locate": ("block", lambda c: _flash_blocks(c) if c.get("packed") else 0),
        "start": ("block", _flash_blocks),
        "stage_q": ("block", q_stages),
        "finish": ("block", _flash_blocks),
        # the kernel's own code: a key tile's (its staging, scores, mask, rescaling and the two products' loops)
        "kernel": ("block", _flash_items),
    }


def _flash_pv_computed(c):
    # P V: every (query tile, column group) of every thread, over the key tiles it visits and each tile's keys rounded
    # up to whole steps, every staged chunk of value columns: RQ x GC fused multiply-adds a key
    g = _attention()
    n_qt, n_cg = _ceil(c["N"], g.tile_q), max(1, _ceil(c["d"], g.COLS))
    step = min(4, g.tile_k)
    keys = 0
    for q in range(n_qt):
        end = min(c["N"], (q + 1) * g.tile_q) if c["causal"] else c["N"]
        keys += sum(_ceil(min(g.tile_k, c["N"] - k0), step) * step for k0 in range(0, end, g.tile_k))
    chunks = min(g.COLS // g.V_CHUNK, max(1, _ceil(c["d"], g.V_CHUNK)))
    return c["BH"] * n_cg * keys * chunks * g.threads * g.RQ * (g.V_CHUNK // g.TX) * 2


def _ovq_computed(c):
    # the coordinate product of the predict kernel, per chunk: the read-out items (row tile, key tile) that some
    # position of the row tile sees, and every assignment item (row tile, centroid tile); each over d rounded up to
    # whole stages, RQ x RK fused multiply-adds a coordinate, every thread
    t = _ovq()
    total = 0
    for L, n in ovq_chunks(c["T"], c["n_max"], c["C"]):
        row_tiles = _ceil(L, t["ROWS"])
        reads = sum(1 for r in range(row_tiles) for kt in range(_ceil(n + L, t["KEYS"]))
                    if kt * t["KEYS"] <= n + min(L, (r + 1) * t["ROWS"]) - 1)
        items = reads + row_tiles * _ceil(n, t["KEYS"])
        total += items * t["NT"] * _ceil(c["d"], t["DC"]) * t["DC"] * t["RQ"] * t["RK"] * 2
    return c["H"] * total


def _ovq_items(c):
    # the predict items: each coordinate product of ROWS x KEYS over d rounded up to whole stages
    return _ovq_computed(c) // (_ovq()["ROWS"] * _ovq()["KEYS"] * 2 * _ceil(c["d"], _ovq()["DC"]) * _ovq()["DC"])


def _ovq_flops(c):
    # the read-out's logits against the centroids and the chunk's keys b <= a, and the assignment's similarities
    return c["H"] * sum((2 * L * n + L * (L + 1)) * c["d"] + 2 * L * n * c["d"] for L, n in ovq_chunks(c["T"], c["n_max"], c["C"]))


#: The sizes of ``benchmarks/bench_gpu.py``'s full run.
_RESP = dict(B=1, N=1 << 20, K=256, d=64)

#: The compute kernels of :mod:`gpu.numba_cuda` (qualified names, the float32 builds), each with its declared work at
#: the benchmark's sizes.  The plain kernels (``gpu.numba_cuda.plain``) are the simple second opinion, not tuned: they
#: are not declared; nor are the one-thread-per-entry kernels (constants, flags, scans of chunk states, merges), whose
#: work is a few FLOPs an entry and whose time is their memory traffic.
KERNELS = {
    "gpu.numba_cuda.gmm._posterior_tiles[float32]": KernelWork(
        case=_RESP,
        flops=lambda c: 4 * c["B"] * c["N"] * c["K"] * c["d"],
        computed=_posterior_computed, step=64, depth=None,
        items=_posterior_items,
        bytes=lambda c: FLOAT32 * c["B"] * c["N"] * (c["d"] + c["K"]),
        what="the quadratic form sum_j (x_j - mu_kj)^2 p_kj: 4 N K d (responsibilities)",
        calls=_posterior_calls()),
    "gpu.numba_cuda.scan._chunk_states[float32]": KernelWork(
        case=dict(B=1, N=1 << 20, F=256, E=65, chunk=256),
        flops=lambda c: 2 * c["B"] * c["N"] * c["F"] * c["E"],
        computed=_states_computed, step=32, depth=None,
        items=lambda c: c["B"] * _ceil(c["N"], c["chunk"]) * _ceil(c["F"], _scan()[0]["TILE_ROWS"])
        * _ceil(c["E"], _scan()[0]["TILE_COLS"]),
        bytes=lambda c: FLOAT32 * c["B"] * (c["N"] * (c["F"] + c["E"]) + _ceil(c["N"], c["chunk"]) * c["F"] * c["E"]),
        what="the write Gamma_K^T [V, 1] per segment: 2 N K (d_v + 1) (GMA forward, bidirectional)"),
    "gpu.numba_cuda.scan._chunk_rows[float32]": KernelWork(
        case=dict(B=1, N=1 << 20, n_in=256, n_out=65),
        flops=lambda c: 2 * c["B"] * c["N"] * c["n_in"] * c["n_out"],
        computed=_rows_computed, step=32, depth=2,
        items=lambda c: c["B"] * _ceil(c["N"], _scan()[0]["TILE_ROWS"]) * _ceil(c["n_out"], _scan()[0]["TILE_COLS"]),
        bytes=lambda c: FLOAT32 * c["B"] * (c["N"] * (c["n_in"] + c["n_out"]) + c["n_in"] * c["n_out"]),
        what="the read Gamma_Q [S, z]: 2 N K (d_v + 1), the carried state's product (loop depth 2; depth 3 is the "
             "causal within-chunk term, not run bidirectionally) (GMA forward, bidirectional)"),
    "gpu.numba_cuda.gma._responsibility_rows": KernelWork(
        case=_RESP,
        flops=lambda c: 4 * c["B"] * c["N"] * c["K"] * c["d"],
        computed=_dx_computed, step=16, depth=None,
        items=lambda c: c["B"] * _ceil(c["N"], _gma()["ROW_TILE"]) * _ceil(c["d"], _gma()["COORD_TILE"]),
        bytes=lambda c: FLOAT32 * c["B"] * c["N"] * (2 * c["d"] + 3 * c["K"]),
        what="dL/dx = c (mu/sigma^2) - x (c (1/sigma^2)) per side: 4 N K d (GMA backward)"),
    "gpu.numba_cuda.gma._parameter_partials": KernelWork(
        case=_RESP,
        flops=lambda c: 4 * c["B"] * c["N"] * c["K"] * c["d"],
        computed=_partials_computed, step=30, depth=None,
        items=lambda c: c["B"] * _ceil(c["N"], _scan()[1]) * _ceil(c["K"], _gma()["PTILE"]) * _ceil(c["d"], _gma()["PTILE"]),
        bytes=lambda c: FLOAT32 * c["B"] * (c["N"] * (c["d"] + c["K"]) + 2 * _ceil(c["N"], _scan()[1]) * c["K"] * c["d"]),
        what="the sums over tokens c^T X and c^T X^2 per side: 4 N K d (GMA backward); the kernel sums "
             "c (x - mu) and c ((x - mu)^2 - sigma^2) from the differences, 7 FLOPs an entry and token"),
    "gpu.numba_cuda.attention._flash_forward[float32]": KernelWork(
        case=dict(BH=1, N=16384, d=64, causal=False),
        flops=lambda c: 2 * c["BH"] * c["N"] * c["N"] * c["d"],
        computed=_flash_computed, step=lambda: _attention().RQ * _attention().RK * 2, depth=None,
        items=_flash_items,
        bytes=lambda c: FLOAT32 * 4 * c["BH"] * c["N"] * c["d"],
        what="the scores q k^T: 2 N^2 d, half of softmax attention's 4 N^2 d (bidirectional)",
        calls=_flash_calls()),
    "gpu.numba_cuda.attention._flash_forward[float32] P V": KernelWork(
        case=dict(BH=1, N=16384, d=64, causal=False),
        flops=lambda c: 2 * c["BH"] * c["N"] * c["N"] * c["d"],
        computed=_flash_pv_computed, step=lambda: _attention().RQ * (_attention().V_CHUNK // _attention().TX) * 2,
        depth=2,
        bytes=lambda c: 0,
        what="the weighted values P V: 2 N^2 d, the other half (loop depth 2: the chunks of value columns are unrolled) "
             "(bidirectional)",
        kernel="gpu.numba_cuda.attention._flash_forward[float32]"),
    "gpu.numba_cuda.ovq._predict_kernel": KernelWork(
        case=dict(H=1, T=65536, n_max=1024, C=256, d=64),
        flops=_ovq_flops,
        computed=_ovq_computed, step=32, depth=None,
        items=_ovq_items,
        bytes=lambda c: FLOAT32 * c["H"] * c["T"] * 4 * c["d"],
        what="the read-out's logits (centroids, and the chunk's keys b <= a) and the assignment's similarities: "
             "sum_c (2 L n_c + L (L + 1)) d + 2 L n_c d (OVQ's work at T = 65,536, as launches per chunk: the kernel "
             "VQ launches so)",
        launches=lambda c: len(ovq_chunks(c["T"], c["n_max"], c["C"])),
        # the plan of each sequence's chunk runs in one block (its bitonic steps' latency is the model's plan time);
        # the kernel's own code (the item's place in the grid) is counted once an item
        calls={"_predict_item": ("block", _ovq_items), "kernel": ("block", _ovq_items),
               "_plan_chunk": ("block", lambda c: c["H"] * len(ovq_chunks(c["T"], c["n_max"], c["C"])))}),
}
# OVQ's loop kernel runs the predict kernel's items (the same device function), every chunk in one launch: the predict
# items, then each sequence's plan by one block, then the merge items, one a thread (L (d + 2 d_v) a chunk)
KERNELS["gpu.numba_cuda.ovq._chunk_loop_kernel"] = KERNELS["gpu.numba_cuda.ovq._predict_kernel"]._replace(
    what="the predict kernel's work, every chunk in the one launch of the loop (OVQ, T = 65,536)", launches=lambda c: 1,
    calls=dict(KERNELS["gpu.numba_cuda.ovq._predict_kernel"].calls,
               _merge_item=("thread", lambda c: c["H"] * sum(L for L, _ in ovq_chunks(c["T"], c["n_max"], c["C"]))
                            * 3 * c["d"])))


def declared(name):
    """``{"kernel", "flops", "computed", "useful_fraction", "bytes", "step", "depth", "launches", "case", "what"}`` of an
    entry of :data:`KERNELS` at its sizes."""
    w = KERNELS[name]
    flops, computed = w.flops(w.case), w.computed(w.case)
    return {"kernel": w.kernel or name, "flops": flops, "computed": computed, "useful_fraction": flops / computed, "bytes": w.bytes(w.case),
            "step": w.step() if callable(w.step) else w.step, "depth": w.depth, "launches": w.launches(w.case), "case": dict(w.case), "what": w.what}


def region(row, name):
    """The loop region of the static ``row`` (:func:`gpu.sass.analyse`) where :data:`KERNELS`' ``name`` does its work:
    the work loop, or the region of the declared depth with the most useful FLOPs (:func:`gpu.sass.regions`);
    ``None`` when the row has no such region."""
    depth = KERNELS[name].depth
    if depth is None:
        mix = row.get("work_loop")
        if not mix or not row.get("work_loop_flops"):
            return None
        return {"depth": row["work_loop_depth"], "instructions": mix["total"], "flops": row["work_loop_flops"],
                "arithmetic": row["work_loop_arithmetic"], "ffma": row["work_loop_ffma"],
                "wavefronts": row["work_loop_wavefronts"], "pipes": row.get("work_loop_pipes")}
    return next((r for r in row.get("regions") or () if r["depth"] == depth), None)


def gate_metrics(row, name):
    """What the gates read of kernel ``name`` from its static ``row``, against its declared work.

    ``useful_fraction`` (:func:`declared`), ``flops_per_instruction``: the
    algorithm's useful FLOPs per instruction the region issues (the useful
    fraction times the region's :func:`gpu.sass.work_flops` per
    instruction: what it would be if every executed FLOP were useful, scaled
    down by the waste), ``ffma_per_wavefront`` (fused multiply-adds per
    shared-memory wavefront, :func:`gpu.sass.shared_wavefronts`; ``inf``
    without shared accesses), ``fp_share`` (:func:`gpu.sass.arithmetic` over
    the region's instructions), ``steps`` (the source steps the compiled
    region holds: its useful FLOPs over the declared ``step``, a whole
    number when the region is the declared one) and the region itself.
    """
    dec = declared(name)
    reg = region(row, name)
    if reg is None:
        return None
    return dict(dec, region=reg, flops_per_instruction=dec["useful_fraction"] * reg["flops"] / reg["instructions"],
                ffma_per_wavefront=reg["ffma"] / reg["wavefronts"] if reg["wavefronts"] else float("inf"),
                fp_share=reg["arithmetic"] / reg["instructions"], steps=reg["flops"] / dec["step"])
