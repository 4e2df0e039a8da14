"""An estimate of the Numba-CUDA functions on an H200, from the compiled code and the declared work: no GPU runs.

Usage::

    python benchmarks/gpu_model.py                      # compile every kernel (no GPU needed), print the estimates
    python benchmarks/gpu_model.py --json model.json    # and write every row as JSON (bench_gpu.py --model reads it)
    python benchmarks/gpu_model.py --markdown           # the table as Markdown (as in docs/gpu.md)
    python benchmarks/gpu_model.py --save-static k.json # keep the per-kernel static rows, to reuse with --static

For each public function of :mod:`gpu.numba_cuda`, at the sizes of
``benchmarks/bench_gpu.py`` and with its counts (:mod:`gpu.work`: the bytes
that must move, the useful floating-point operations), the script prints:

* the minimum HBM bytes and the FLOPs, the roofline time
  ``max(bytes / 4.8 TB/s, FLOPs / 67 TFLOP/s)`` (float64: 34 TFLOP/s);
* the estimate: the issue time of the kernels that do the work, counted from
  their SASS, their bytes with the intermediates, the launches, and, for OVQ,
  the chunks one after the other;
* a measured column, empty until ``bench_gpu.py`` has run on a GPU (which
  prints this estimate beside each time it measures).

The estimate and its assumptions
--------------------------------
* The work: each function runs the compute kernels of :data:`gpu.work.KERNELS`
  at its sizes (:data:`PARTS`), each declaring the FLOPs its loop region
  executes (padding and wasted tiles included) and the block work items
  (tiles) it runs.  A region executes ``computed / (its useful FLOPs per
  thread) / 32`` warp passes; the kernel's code outside its declared regions
  (the epilogues: a log-sum-exp's combine, an online softmax's rescaling, the
  staging of the first tile) runs once per warp per work item.  Both are
  lower counts than what runs: setup code counted once per item, not per
  block, and loops inside an epilogue (a combine tree) once.  A kernel made
  of device functions run at different rates (``gpu.work.KernelWork.calls``:
  the responsibilities kernel, the flash attention, OVQ's loop and predict
  kernels) has its code split by the call each instruction is inlined from
  (a build with line information, :func:`gpu.sass.kernel_calls`), each
  call's code counted as often as that call runs, the code of no call once
  per warp per work item unless the kernel says otherwise.  An instruction
  the compiler recomputes inside a loop keeps the line it came from: a
  call's value recomputed in the loop is counted at the call's rate.
* Issue: an SM issues at most 4 warp instructions a clock (4 schedulers), and
  each class of instruction has its own rate (:data:`H200` ``"pipes"``, warp
  instructions per clock per SM, from the CUDA programming guide's table for
  compute capability 9.0): float32 add/multiply/FMA 4, float64 2, integer
  and float compare/select/min/max 2, the special function unit 0.5,
  conversions 0.5, shared memory 1 wavefront (128 bytes, no bank conflict
  assumed), other memory instructions 1.  A warp pass of a region takes
  ``max(instructions / 4, count of each class / its rate)`` SM clocks: the
  pipes overlap, the busiest bounds it.
* The clock: 1.98 GHz, the one the 67 TFLOP/s float32 peak implies
  (132 SMs x 128 lanes x 2 FLOPs); a measured clock replaces it when a GPU
  is lent (``--clock``).
* Latency: a scheduler with at least 4 resident warps (the theoretical
  occupancy of :func:`gpu.sass.occupancy`) issues every clock; with fewer, in
  proportion.
* Memory: the kernel's declared bytes (its inputs, outputs and the
  intermediates it writes or reads: the responsibilities, the chunk states)
  at an assumed sustained 4.3 TB/s; each kernel takes the larger of its
  issue and memory times (they overlap completely); caches are perfect
  beyond that.
* Launches: each costs :data:`H200` ``"launch_s"`` (20 microseconds: a
  Numba launch of 20 to 32 arguments from the host, an assumption until a
  GPU measures it), added to the device time (no overlap of the host's
  launches with the device's work); the small one-thread-per-entry kernels
  (constants, flags, scans of chunk states, merges) count as launches and
  nothing else.
* OVQ: its chunks are sequential, all of them in one cooperative launch
  (the unit rows before it: two launches a call), each chunk three steps
  (predict, plan, merge) ended by a grid-wide barrier of :data:`H200`
  ``"grid_sync_s"`` (3 microseconds, an assumption until a GPU measures it).
  VQ still launches each chunk (its predict and merge kernels, after the unit
  rows and the codes).  The loop kernel's merge code counts once a warp of
  32 merge items (one a thread, ``L (d + 2 d_v)`` a chunk), its plan's once
  a warp of one block per sequence and chunk (VQ's merge kernel is counted
  as launches only).  A chunk takes the larger of its share of the
  GPU's issue rate and the time one work item takes alone (its warps on
  their own at one instruction per 4 clocks: the latency bound of a GPU the
  chunk does not fill), plus the plan of its last block: ``log2 P (log2 P
  + 1) / 2`` bitonic steps (``P`` the chunk rounded up to a power of two;
  twice when it seeds) of :data:`H200` ``"plan_step_cycles"`` clocks each
  (a barrier and a few dependent shared accesses).
* Not counted: the tail of the last wave of blocks, the host's checks (one
  copy a call), bank conflicts, cache misses.

The estimate is not a bound: these are modelling choices, stated so that a
GPU run of ``bench_gpu.py`` can test them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu import work  # noqa: E402  (after the path set-up above; it imports no numba until asked)

#: The H200 (SXM): peak HBM bandwidth, the sustained copy bandwidth assumed, peak float32 and float64 rates (without
#: tensor cores), multiprocessors, schedulers per multiprocessor, the clock the float32 peak implies, the cost of a
#: launch, the clocks of one step of OVQ's plan, and the rates of each issue class (warp instructions a clock per SM;
#: ``shared``: wavefronts; ``issue``: all instructions).
H200 = {
    "name": "H200",
    "peak_bandwidth_Bps": 4.8e12,
    "copy_bandwidth_Bps": 4.3e12,
    "peak_flops": {"float32": 67e12, "float64": 34e12},
    "sms": 132,
    "schedulers": 4,
    "clock_Hz": 1.98e9,
    "warp": 32,
    "warps_to_issue": 4,  # resident warps a scheduler needs to issue every cycle (the model's assumption)
    "launch_s": 20e-6,
    "grid_sync_s": 3e-6,  # one grid-wide barrier of a cooperative launch (the model's assumption)
    "plan_step_cycles": 200,
    "pipes": {"issue": 4, "fp32": 4, "fp64": 2, "alu": 2, "mufu": 0.5, "cvt": 0.5, "shared": 1, "mem": 1},
}

NOT_MEASURED = "not measured: no GPU run yet"

K_RESP = "gpu.numba_cuda.gmm._posterior_tiles[float32]"
K_STATES = "gpu.numba_cuda.scan._chunk_states[float32]"
K_ROWS = "gpu.numba_cuda.scan._chunk_rows[float32]"
K_DX = "gpu.numba_cuda.gma._responsibility_rows"
K_PARTIALS = "gpu.numba_cuda.gma._parameter_partials"
K_FLASH = "gpu.numba_cuda.attention._flash_forward[float32]"
K_PV = K_FLASH + " P V"
K_OVQ = "gpu.numba_cuda.ovq._chunk_loop_kernel"
K_VQ = "gpu.numba_cuda.ovq._predict_kernel"


def _gma_parts(N, K, d_r, d_v, backward):
    """The declared kernels of GMA at ``N`` tokens: the responsibilities of both sides and the scan's products (the
    backward: dL/dx and the parameter sums of both sides, and the scan's four products)."""
    resp = dict(B=1, N=N, K=K, d=d_r)
    scan = [(K_STATES, dict(B=1, N=N, F=K, E=d_v + 1, chunk=256), 1), (K_ROWS, dict(B=1, N=N, n_in=K, n_out=d_v + 1), 1)]
    if not backward:
        return [(K_RESP, resp, 2)] + scan
    return [(K_DX, resp, 2), (K_PARTIALS, resp, 2), (K_STATES, dict(B=1, N=N, F=K, E=d_v + 1, chunk=256), 1),
            (K_ROWS, dict(B=1, N=N, n_in=d_v + 1, n_out=K), 2), (K_ROWS, dict(B=1, N=N, n_in=K, n_out=d_v), 1)]


#: Launches of each function at the sizes of :func:`workloads` (one call): the responsibilities' constants and tiles;
#: GMA's forward: both sides' responsibilities, [V, 1], the chunk states, the scan over them, the read, the
#: normalisation; the backward: both sides' dL/dx, partials and the sums, the scan's products and scans.
LAUNCHES = {"responsibilities": 2, "gma_forward": 10, "gma_backward": 16, "softmax_attention": 1}


def workloads():
    """``[(function, variant, size, (bytes, flops), [(KERNELS key, case, count)], launches, ovq)]`` at the full sizes;
    ``ovq`` is ``(T, n_max, C, H, kernel)`` for the chunked rows (OVQ's loop kernel, VQ's predict kernel), else
    ``None``."""
    N, K, d = 1 << 20, 256, 64
    rows = []
    size = f"N={N} K={K} d={d}"
    for fn in ("responsibilities", "log_responsibilities"):
        rows.append((fn, "", size, work.responsibilities_counts(N, K, d),
                     [(K_RESP, dict(B=1, N=N, K=K, d=d, log=fn == "log_responsibilities"), 1)],
                     LAUNCHES["responsibilities"], None))
    for n in (1 << 14, 1 << 17, 1 << 20):
        size = f"N={n} K={K} d_r=d_v={d}"
        for variant in ("bidirectional", "causal"):
            rows.append(("gma_forward", variant, size, work.gma_forward_counts(n, K, d, d), _gma_parts(n, K, d, d, False),
                         LAUNCHES["gma_forward"], None))
            rows.append(("gma_backward", variant, size, work.gma_backward_counts(n, K, d, d), _gma_parts(n, K, d, d, True),
                         LAUNCHES["gma_backward"], None))
    n = 1 << 20
    rows.append(("gma", "bidirectional", f"N={n} K={K} d_r=d_v={d}", work.gma_forward_counts(n, K, d, d),
                 _gma_parts(n, K, d, d, False), LAUNCHES["gma_forward"], None))
    T, n_dict, C = 65536, 1024, 256
    for BH in (1, 32):
        for n, causal in ((4096, False), (16384, False), (T, True)):
            if BH > 1 and not causal:
                continue
            case = dict(BH=BH, N=n, d=d, causal=causal)
            nbytes, flops = work.attention_counts(n, d, causal=causal)
            rows.append(("softmax_attention", "causal" if causal else "bidirectional", f"N={n} d={d}" + _bh(BH),
                         (BH * nbytes, BH * flops), [(K_FLASH, case, 1), (K_PV, case, 1)], LAUNCHES["softmax_attention"],
                         None))
        nbytes, flops = work.ovq_counts(T, d, d, n_dict, C)
        rows.append(("ovq_attention", "causal", f"T={T} N={n_dict} C={C} d={d}" + _bh(BH), (BH * nbytes, BH * flops),
                     [(K_OVQ, dict(H=BH, T=T, n_max=n_dict, C=C, d=d), 1)], None, (T, n_dict, C, BH, K_OVQ)))
    rows.append(("vq_attention", "causal", f"T={T} S={n_dict} C={C} d={d}", vq_counts(T, d, d, n_dict, C),
                 [(K_VQ, dict(H=1, T=T, n_max=n_dict, C=C, d=d), 1)], None, (T, n_dict, C, 1, K_VQ)))
    return rows


def _bh(BH):
    return "" if BH == 1 else f" BH={BH}"


def vq_counts(T, d, d_v, S, chunk_size):
    """``(bytes, flops)`` of VQ attention: :func:`gpu.work.ovq_counts`' terms with ``S`` codes before every chunk."""
    flops = 0
    for s in range(0, T, chunk_size):
        L = min(chunk_size, T - s)
        flops += (2 * L * S + L * (L + 1)) * (d + d_v) + 2 * L * S * d
    return work.FLOAT32 * T * (2 * d + 2 * d_v), flops


def issue_efficiency(occupancy, device=H200):
    """The share of cycles a scheduler issues in: ``min(1, resident warps per scheduler / warps_to_issue)``."""
    warps_per_scheduler = occupancy * 64 / device["schedulers"]
    return min(1.0, warps_per_scheduler / device["warps_to_issue"])


def pass_cycles(pipes, device=H200):
    """SM clocks of one warp pass over instructions of the mix ``pipes`` (:func:`gpu.sass.pipes`): the busiest of the
    issue port and the pipes, each at its rate (:data:`H200` ``"pipes"``)."""
    rates = device["pipes"]
    return max([pipes["total"] / rates["issue"]] + [pipes.get(k, 0) / r for k, r in rates.items() if k != "issue"])


def _minus(a, b):
    return {k: max(0, a[k] - b.get(k, 0)) for k in a}


def _calls(row):
    """The row's split of its code by device function (:func:`gpu.sass.kernel_calls`), when it is of the same code
    (the same length as the plain build's body); else ``None``."""
    split = row.get("calls")
    return split if split and split["instructions"] == row["body_pipes"]["total"] else None


def _region_call(row, split, reg):
    """The call whose code holds the declared region ``reg`` (found among the row's regions by its shape)."""
    for r in row.get("regions") or ():
        if (r["depth"], r["instructions"], r["flops"]) == (reg["depth"], reg["instructions"], reg["flops"]):
            return split["region_calls"].get(str(r["start"]))
    return None


def _outside(row, w, declared):
    """``[(unit, count, pipes)]``: the kernel's code outside its ``declared`` regions and how often it runs.

    Without a split of the code by call (or a kernel that declares none): all
    of it, once per warp per work item.  With one: each call's code (its
    declared regions taken out) as often as the kernel declares that call
    runs (``gpu.work.KernelWork.calls``; a call it does not name: once per
    warp per item).
    """
    split = _calls(row) if w.calls else None
    if split is None:
        outside = row["body_pipes"]
        for r in declared:
            outside = _minus(outside, r["pipes"])
        return [("block", w.items, outside)]
    out = []
    for call, code in split["pipes"].items():
        for r in declared:
            if _region_call(row, split, r) == call:
                code = _minus(code, r["pipes"])
        unit, count = w.calls.get(call, ("block", w.items))
        out.append((unit, count, code))
    return out


def kernel_estimate(key, case, rows, device=H200):
    """The estimate of the kernel region ``key`` of :data:`gpu.work.KERNELS` at the sizes ``case``.

    ``rows`` maps a qualified kernel name to its static row (:func:`gpu.sass.analyse`).  Returns ``{"key",
    "kernel", "flops", "computed", "bytes", "region_s", "epilogue_s", "issue_s", "memory_s", "time_s",
    "occupancy", "pass_cycles", "warp_passes"}``; ``None`` when the row or its region is missing.
    """
    w = work.KERNELS[key]
    name = w.kernel or key
    row = rows.get(name)
    reg = None if row is None else work.region(row, key)
    if reg is None or not reg.get("pipes"):
        return None
    rate = device["sms"] * device["clock_Hz"] * issue_efficiency(row["occupancy"], device)
    computed = w.computed(case)
    passes = computed / reg["flops"] / device["warp"]
    region_s = passes * pass_cycles(reg["pipes"], device) / rate
    epilogue_s = 0.0
    if w.items(case) and row.get("body_pipes"):
        declared = [r for other, ow in work.KERNELS.items() if (ow.kernel or other) == name
                    and (r := work.region(row, other)) is not None]
        for unit, count, code in _outside(row, w, declared):
            passes = count(case) * (row["threads"] if unit == "block" else 1) / device["warp"]
            epilogue_s += passes * pass_cycles(code, device) / rate
    nbytes = w.bytes(case)
    memory_s = nbytes / device["copy_bandwidth_Bps"]
    issue_s = region_s + epilogue_s
    return {"key": key, "kernel": name, "flops": w.flops(case), "computed": computed, "bytes": nbytes,
            "region_s": region_s, "epilogue_s": epilogue_s, "issue_s": issue_s, "memory_s": memory_s,
            "time_s": max(issue_s, memory_s), "occupancy": row["occupancy"], "pass_cycles": pass_cycles(reg["pipes"], device),
            "warp_passes": passes}


def _plan_steps(L):
    P = 1 << max(0, (L - 1).bit_length())
    k = P.bit_length() - 1
    return k * (k + 1) // 2


def ovq_estimate(T, n_max, C, H, d, rows, device=H200, kernel=K_OVQ):
    """OVQ's (or, ``kernel=K_VQ``, VQ's) chunks one after the other (see the module docstring): ``{"time_s",
    "device_s", "serial_s", "plan_s", "launches", "launch_s", "sync_s"}``; ``None`` without the kernel's static row."""
    chunks = work.ovq_chunks(T, n_max, C)
    whole = kernel_estimate(kernel, dict(H=H, T=T, n_max=n_max, C=C, d=d), rows, device)
    if whole is None:
        return None
    row = rows[work.KERNELS[kernel].kernel or kernel]
    case = dict(H=H, T=T, n_max=n_max, C=C, d=d)
    reg = work.region(row, kernel)
    # one work item alone: each of its warps makes its passes of the region and its epilogue once, at one instruction
    # per warps_to_issue clocks (nothing else to issue on its scheduler)
    warps = row["threads"] / device["warp"]
    passes = whole["warp_passes"] / max(1, work.KERNELS[kernel].items(case)) / warps
    split = _calls(row)
    # the code of one item besides its region: the predict call's and the kernel's own (split), else all the kernel's
    body = (split["pipes"]["_predict_item"]["total"] + split["pipes"]["kernel"]["total"]) if split else row["body_pipes"]["total"]
    alone = passes * reg["instructions"] + max(0, body - reg["instructions"])
    serial_s = alone * device["warps_to_issue"] / device["clock_Hz"]
    device_s = plan_s = 0.0
    for i, (L, n) in enumerate(chunks):
        share = whole["issue_s"] * _chunk_share(L, n, chunks)
        device_s += max(share, serial_s)
        grows = i + 1 < len(chunks) and chunks[i + 1][1] > n
        plan_s += _plan_steps(L) * (2 if grows else 1) * device["plan_step_cycles"] / device["clock_Hz"]
    if kernel == K_OVQ:
        launches = 2  # the unit rows, then the one launch of the chunk loop
        sync_s = 3 * len(chunks) * device["grid_sync_s"]  # after each chunk's predict, plan and merge
    else:
        launches = 2 * len(chunks) + 2  # VQ: the unit rows and the codes, then predict and merge per chunk
        sync_s = 0.0
    launch_s = launches * device["launch_s"]
    return {"time_s": max(device_s, whole["memory_s"]) + plan_s + launch_s + sync_s, "device_s": device_s,
            "serial_s": serial_s, "plan_s": plan_s, "launches": launches, "launch_s": launch_s, "sync_s": sync_s,
            "kernel": whole}


def _chunk_share(L, n, chunks):
    """A chunk's share of OVQ's predict work: its ``(2 L n + L (L + 1)) + 2 L n`` over the sum of all chunks'."""
    total = sum(4 * L2 * n2 + L2 * (L2 + 1) for L2, n2 in chunks)
    return (4 * L * n + L * (L + 1)) / total


def model_rows(kernel_rows, dtype="float32", device=H200):
    """One row of the estimate per workload of :func:`workloads` (see the module docstring for what each field
    means).  ``kernel_rows``: the static rows of :func:`gpu.sass.kernel_rows` (the float32 ones are read)."""
    itemsize = {"float32": 4, "float64": 8}[dtype]
    rows = {r["kernel"]: r for r in kernel_rows if r["dtype"] == "float32"}
    out = []
    for fn, variant, size, (nbytes, flops), parts, launches, ovq in workloads():
        nbytes = nbytes * itemsize // work.FLOAT32
        peak_flops = device["peak_flops"][dtype]
        roofline = max(nbytes / device["peak_bandwidth_Bps"], flops / peak_flops)
        kernels, missing, estimate, chunked = [], [], 0.0, None
        for key, case, count in parts:
            k = kernel_estimate(key, case, rows, device)
            if k is None:
                missing.append(key)
                continue
            kernels.append(dict(k, count=count))
            estimate += count * k["time_s"]
        if ovq is not None and not missing:
            T, n_max, C, H, kernel = ovq
            chunked = ovq_estimate(T, n_max, C, H, 64, rows, device, kernel)
            estimate, launches = chunked["time_s"], chunked["launches"]
        elif launches:
            estimate += launches * device["launch_s"]
        ok = not missing
        out.append({
            "function": fn,
            "variant": variant,
            "size": size,
            "dtype": dtype,
            "bytes": nbytes,
            "flops": flops,
            "roofline_s": roofline,
            "roofline_bound": "memory" if nbytes / device["peak_bandwidth_Bps"] >= flops / peak_flops else "arithmetic",
            "intermediate_bytes": sum(k["count"] * k["bytes"] for k in kernels),
            "issue_s": sum(k["count"] * k["issue_s"] for k in kernels) if ok and ovq is None else (
                chunked["device_s"] if ok else None),
            "epilogue_s": sum(k["count"] * k["epilogue_s"] for k in kernels) if ok else None,
            "launches": launches,
            "launch_s": (launches or 0) * device["launch_s"],
            "chunks": chunked and {k: v for k, v in chunked.items() if k != "kernel"},
            "estimate_s": estimate if ok else None,
            "kernels": kernels,
            "no_static_data": missing,
            "measured_s": None,
            "measured_note": NOT_MEASURED,
        })
    return out


def _ms(x):
    return "n/a" if x is None else f"{x * 1e3:.3f}"


def format_rows(rows, markdown=False):
    """The estimate as a plain-text (or Markdown) table."""
    head = ["function", "variant", "size", "HBM MB", "GFLOP", "roofline ms", "bound", "bytes+int. MB", "issue ms",
            "epilogue ms", "launches", "estimate ms", "measured ms"]
    lines = []
    body = []
    for r in rows:
        body.append([r["function"], r["variant"] or "-", r["size"], f"{r['bytes'] / 1e6:.1f}", f"{r['flops'] / 1e9:.1f}",
                     _ms(r["roofline_s"]), r["roofline_bound"], f"{r['intermediate_bytes'] / 1e6:.1f}", _ms(r["issue_s"]),
                     _ms(r["epilogue_s"]), str(r["launches"]), _ms(r["estimate_s"]), r["measured_note"]])
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(" --- " for _ in head) + "|")
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def estimates(rows):
    """``{(function, variant, size): estimate in seconds}`` of :func:`model_rows`' rows (or a ``--json`` file's), the
    key ``bench_gpu.py`` finds its rows by."""
    return {(r["function"], r["variant"], r["size"]): r["estimate_s"] for r in rows}


def static_rows(dtype):
    """The per-kernel static rows (:func:`gpu.sass.kernel_rows`), compiling every kernel here (real CUDA target)."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # before numba is first imported: the kernels compile for a real GPU
    from gpu import sass

    for tool in ("ptxas", "cuobjdump"):
        if sass.find_tool(tool) is None:
            raise SystemExit(f"gpu_model.py: {tool} not found: install the {sass.TOOL_WHEELS[tool]} wheel "
                             "(the cuda13 extra has both)")
    rows = sass.kernel_rows(sass.compile_kernels((9, 0)), sass_dtypes=(dtype,))
    if sass.find_tool("nvdisasm") is None:
        print(f"gpu_model.py: nvdisasm not found (the {sass.TOOL_WHEELS['nvdisasm']} wheel): the kernels made of device "
              "functions are counted unsplit, all their code once per warp and work item", file=sys.stderr)
        return rows
    # the kernels whose code is device functions run at different rates: their code split by call (a build with lines)
    for key, w in work.KERNELS.items():
        for row in rows:
            if w.calls and row["kernel"] == (w.kernel or key) and row["dtype"] == dtype and row.get("body_pipes"):
                row["calls"] = sass.kernel_calls(row["kernel"], [c for c in w.calls if c != "kernel"], dtype)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--static", type=Path, default=None, metavar="FILE",
                        help="read the per-kernel static rows from FILE (written by --save-static) instead of compiling")
    parser.add_argument("--save-static", type=Path, default=None, metavar="FILE", help="write the per-kernel static rows")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the model's rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--clock", type=float, default=None, metavar="HZ",
                        help=f"the SM clock to assume (default {H200['clock_Hz'] / 1e9:.2f} GHz, the float32 peak's)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kernels = json.loads(args.static.read_text()) if args.static else static_rows(args.dtype)
    if args.save_static:
        args.save_static.write_text(json.dumps(kernels, indent=1) + "\n")
    device = dict(H200, clock_Hz=args.clock) if args.clock else H200
    rows = model_rows(kernels, args.dtype, device)
    print(f"MODEL of gpu.numba_cuda on an H200, {args.dtype}, from the compiled code (ptxas, cuobjdump): no GPU ran;")
    print("every time below is an estimate under the assumptions of benchmarks/gpu_model.py, not a measurement.")
    print(format_rows(rows, markdown=args.markdown))
    if args.json:
        report = {"model": True, "device": device, "dtype": args.dtype, "rows": rows,
                  "assumptions": __doc__.split("The estimate and its assumptions")[1].strip()}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
