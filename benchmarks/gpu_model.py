"""A model of the Numba-CUDA functions on an H200, from the compiled code alone: no GPU runs, nothing here is a timing.

Usage::

    python benchmarks/gpu_model.py                      # compile every kernel (no GPU needed), print the model
    python benchmarks/gpu_model.py --json model.json    # and write every row as JSON
    python benchmarks/gpu_model.py --markdown           # the table as Markdown (as in docs/gpu.md)
    python benchmarks/gpu_model.py --save-static k.json # keep the per-kernel static rows, to reuse with --static

For each public function of :mod:`gpu.numba_cuda`, at the sizes of
``benchmarks/bench_gpu.py`` and with its counts (``responsibilities_counts``
and the others: the bytes that must move, the useful floating-point
operations), the script prints:

* the minimum HBM bytes and the FLOPs;
* the roofline time ``max(bytes / 4.8 TB/s, FLOPs / 67 TFLOP/s)``
  (float64: 34 TFLOP/s), the H200's peaks, and the memory time at an assumed
  sustained 4.3 TB/s (what a large device-to-device copy reaches, about 90% of
  the peak; not measured here);
* what the static analysis of :mod:`gpu.sass` predicts: the issue-bound time
  of the kernels that do the function's arithmetic, and the larger of it and
  the memory time at 4.3 TB/s;
* a measured column, empty ("not measured: no GPU run yet") until
  ``bench_gpu.py`` has run on a GPU.

The model and its assumptions
-----------------------------
* Each function's FLOPs are split into parts, each done by the kernels of one
  module (:data:`PARTS`): the responsibilities by ``gmm`` (and GMA's two
  quadratic forms: GMA computes them with the same kernel), the scan's write
  and read by ``scan``, the backward's per-row and per-parameter products by
  ``gma`` (a part each: ``gma:responsibility_rows`` does ``dL/dx``,
  ``gma:parameter_partials`` the sums over tokens), softmax attention by
  ``attention``, OVQ and VQ by ``ovq``.
* A part runs at the pace of its module's *main kernel* (:func:`main_kernel`):
  of the kernels named for the work (the part's kernel after the ``:``, else
  :data:`MAIN`), the one whose loop holds the most useful FLOPs.  The loop is the kernel's *work loop*
  (:func:`gpu.sass.work_loop`, in float32 or the float type asked): of the
  loop regions (innermost loop bodies, basic blocks inside a loop) that do
  useful arithmetic, the one nested in the most loops, ties to the most
  useful FLOPs.  Useful FLOPs (:func:`gpu.sass.work_flops`) are those of
  floating-point arithmetic on registers alone, without saturation or
  directed rounding (a fused multiply-add is two): the algorithm's products
  and sums, not the range reduction and polynomial of an ``exp``.  The
  deepest region is taken because it runs once per iteration of every loop
  around it: the product over the coordinates runs ``d`` times for each time
  the epilogue after it (a log-sum-exp's combine tree, an online softmax's
  rescaling) runs once, though the unrolled epilogue can hold more
  instructions and more raw FLOPs.  The fp-share gate of
  ``tests/test_gpu_resources.py`` reads the same loop.
  Its instructions per useful FLOP are that loop's instructions over its
  useful FLOPs.  So every useful FLOP is assumed to be done in that loop, by
  one thread once (work repeated across the threads of a warp, the setup
  outside the loop, the epilogues, the other loops of the kernel (a second
  product in a shallower loop, say) and the routines it calls are not
  counted: the prediction is a lower bound on the instructions).
* Issue: each of the 132 multiprocessors has 4 schedulers, each issuing at
  most one warp instruction (32 threads) per cycle at 1.7 GHz.  A scheduler
  is assumed to issue every cycle when it holds at least 4 resident warps
  (the dependent-issue latency of the arithmetic pipes is about 4 cycles),
  and a proportional fraction with fewer: efficiency ``min(1, 16 o / 4)``,
  ``o`` the theoretical occupancy of :func:`gpu.sass.occupancy` at the
  kernel's block size (16 ``o`` warps per scheduler).  The issue-bound time is
  ``FLOPs x (instructions per FLOP) / 32 / (132 x 4 x 1.7e9 x efficiency)``.
* Memory: the minimum bytes at 4.3 TB/s; caches are perfect (the ``K``-row
  parameters and re-read tiles cost no HBM traffic) and nothing else moves.
  The prediction is ``max(issue-bound time, memory time)``: the two overlap
  completely, launches cost nothing, the last partial wave of blocks is not
  counted, nor are the host's checks (one copy a call).

These are modelling choices, stated so that they can be checked: a GPU run
of ``bench_gpu.py`` gives the times to set beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402  (after the path set-up above; it imports no numba)

#: The H200 (SXM): peak HBM bandwidth, the sustained copy bandwidth assumed, peak float32 and float64 rates
#: (without tensor cores), multiprocessors, schedulers per multiprocessor, clock.
H200 = {
    "peak_bandwidth_Bps": 4.8e12,
    "copy_bandwidth_Bps": 4.3e12,
    "peak_flops": {"float32": 67e12, "float64": 34e12},
    "sms": 132,
    "schedulers": 4,
    "clock_Hz": 1.7e9,
    "warp": 32,
    "warps_to_issue": 4,  # resident warps a scheduler needs to issue every cycle (the model's assumption)
}

NOT_MEASURED = "not measured: no GPU run yet"

#: The kernels that do the bulk of each module's FLOPs, by name (a regular expression; see :func:`main_kernel`).
MAIN = {
    "gmm": r"posterior|responsibilit",
    "scan": r"chunk_states|chunk_rows|state|rows",
    "gma": r"responsibility_rows|parameter_partials|rows|partials",
    "attention": r"flash",
    "ovq": r"readout|predict|assign",
}

#: The modules whose kernels do each part of a function's FLOPs (see the module docstring).
PARTS = {
    "responsibilities": lambda N, K, d: [("gmm", 4 * N * K * d)],
    "gma_forward": lambda N, K, d_r, d_v: [("gmm", 8 * N * K * d_r), ("scan", 4 * N * K * (d_v + 1))],
    "gma_backward": lambda N, K, d_r, d_v: [("gma:responsibility_rows", 8 * N * K * d_r),
                                            ("gma:parameter_partials", 8 * N * K * d_r),
                                            ("scan", 6 * N * K * (d_v + 1) + 2 * N * K * d_v)],
}


def vq_counts(T, d, d_v, S, chunk_size):
    """``(bytes, flops)`` of VQ attention: :func:`bench_gpu.ovq_counts`' terms with ``S`` codes before every chunk."""
    flops = 0
    for s in range(0, T, chunk_size):
        L = min(chunk_size, T - s)
        flops += (2 * L * S + L * (L + 1)) * (d + d_v) + 2 * L * S * d
    return bench_gpu.FLOAT32 * T * (2 * d + 2 * d_v), flops


def workloads():
    """``[(function, variant, size, (bytes, flops) in float32, [(part, flops)])]`` at ``bench_gpu.py``'s full sizes."""
    N, K, d = 1 << 20, 256, 64
    rows = []
    size = f"N={N} K={K} d={d}"
    for fn in ("responsibilities", "log_responsibilities"):
        rows.append((fn, "", size, bench_gpu.responsibilities_counts(N, K, d), PARTS["responsibilities"](N, K, d)))
    d_r = d_v = d
    for n in (1 << 14, 1 << 17, 1 << 20):
        size = f"N={n} K={K} d_r=d_v={d_v}"
        for variant in ("bidirectional", "causal"):
            rows.append(("gma_forward", variant, size, bench_gpu.gma_forward_counts(n, K, d_r, d_v),
                         PARTS["gma_forward"](n, K, d_r, d_v)))
            rows.append(("gma_backward", variant, size, bench_gpu.gma_backward_counts(n, K, d_r, d_v),
                         PARTS["gma_backward"](n, K, d_r, d_v)))
    n = 1 << 20
    rows.append(("gma", "bidirectional", f"N={n} K={K} d_r=d_v={d_v}", bench_gpu.gma_forward_counts(n, K, d_r, d_v),
                 PARTS["gma_forward"](n, K, d_r, d_v)))
    for n in (4096, 16384):
        counts = bench_gpu.attention_counts(n, d, causal=False)
        rows.append(("softmax_attention", "bidirectional", f"N={n} d={d}", counts, [("attention", counts[1])]))
    T, n_dict, C = 65536, 1024, 256
    counts = bench_gpu.attention_counts(T, d, causal=True)
    rows.append(("softmax_attention", "causal", f"N={T} d={d}", counts, [("attention", counts[1])]))
    counts = bench_gpu.ovq_counts(T, d, d, n_dict, C)
    rows.append(("ovq_attention", "causal", f"T={T} N={n_dict} C={C} d={d}", counts, [("ovq", counts[1])]))
    counts = vq_counts(T, d, d, n_dict, C)
    rows.append(("vq_attention", "causal", f"T={T} S={n_dict} C={C} d={d}", counts, [("ovq", counts[1])]))
    return rows


def _work(row):
    """``(instructions, useful FLOPs)`` per thread of a static row's work loop (:func:`gpu.sass.work_loop`)."""
    return row["work_loop"]["total"], row["work_loop_flops"]


def main_kernel(kernel_rows, module, dtype, name=None):
    """The static row of ``module``'s main kernel in ``dtype``; ``None`` when none of its kernels has FLOPs in a loop.

    Among the module's kernels whose work loop holds useful FLOPs, those
    whose name matches :data:`MAIN` (all of them when none does), and of
    these the one whose work loop holds the most useful FLOPs.  With
    ``name`` (a regular expression), only the kernels it matches: ``None``
    when none does.
    """
    import re

    mine = [r for r in kernel_rows if r["kernel"].rsplit(".", 2)[-2] == module and r["dtype"] == dtype
            and r.get("loop") and r.get("work_loop") is not None and _work(r)[1]]
    named = [r for r in mine if re.search(name or MAIN.get(module, "$^"), r["kernel"].rsplit(".", 1)[-1])]
    return max(named if name else (named or mine), key=lambda r: (_work(r)[1], r["kernel"]), default=None)


def issue_efficiency(occupancy, device=H200):
    """The share of cycles a scheduler issues in: ``min(1, resident warps per scheduler / warps_to_issue)``."""
    warps_per_scheduler = occupancy * 64 / device["schedulers"]
    return min(1.0, warps_per_scheduler / device["warps_to_issue"])


def issue_time(flops, row, device=H200):
    """Seconds to issue the instructions of ``flops`` useful FLOPs at the pace of the static ``row``'s loop."""
    instructions, work = _work(row)
    per_flop = instructions / work
    rate = device["sms"] * device["schedulers"] * device["clock_Hz"] * issue_efficiency(row["occupancy"], device)
    return flops * per_flop / device["warp"] / rate


def model_rows(kernel_rows, dtype="float32", device=H200):
    """One row of the model per workload of :func:`workloads` (see the module docstring for what each field means)."""
    itemsize = {"float32": 4, "float64": 8}[dtype]
    out = []
    for fn, variant, size, (nbytes, flops), parts in workloads():
        nbytes = nbytes * itemsize // bench_gpu.FLOAT32
        peak_flops = device["peak_flops"][dtype]
        roofline = max(nbytes / device["peak_bandwidth_Bps"], flops / peak_flops)
        memory = nbytes / device["copy_bandwidth_Bps"]
        issue, kernels, missing = 0.0, [], []
        for part, part_flops in parts:
            module, _, name = part.partition(":")  # "gma:parameter_partials": that kernel of gma
            row = main_kernel(kernel_rows, module, dtype, name or None)
            if row is None:
                missing.append(part)
                continue
            issue += issue_time(part_flops, row, device)
            kernels.append({
                "module": part,
                "kernel": row["kernel"],
                "flops": part_flops,
                "instructions_per_flop": _work(row)[0] / _work(row)[1],
                "work_loop_fp_share": row["work_loop"]["fp"] / row["work_loop"]["total"],
                "work_loop_depth": row.get("work_loop_depth"),
                "occupancy": row["occupancy"],
                "threads": row["threads"],
                "registers": row["registers"],
            })
        predicted_issue = None if missing else issue
        out.append({
            "function": fn,
            "variant": variant,
            "size": size,
            "dtype": dtype,
            "bytes": nbytes,
            "flops": flops,
            "roofline_s": roofline,
            "roofline_bound": "memory" if nbytes / device["peak_bandwidth_Bps"] >= flops / peak_flops else "arithmetic",
            "memory_at_copy_s": memory,
            "issue_bound_s": predicted_issue,
            "predicted_s": None if missing else max(issue, memory),
            "predicted_bound": None if missing else ("issue" if issue > memory else "memory"),
            "kernels": kernels,
            "no_static_data": missing,
            "measured_s": None,
            "measured_note": NOT_MEASURED,
        })
    return out


def _ms(x):
    return "n/a" if x is None else f"{x * 1e3:.3f}"


def format_rows(rows, markdown=False):
    """The model as a plain-text (or Markdown) table."""
    head = ["function", "variant", "size", "HBM MB", "GFLOP", "roofline ms", "bound", "mem @4.3 ms", "issue ms",
            "model ms", "instr/FLOP", "occupancy", "measured ms"]
    lines = []
    body = []
    for r in rows:
        ipf = "/".join(f"{k['instructions_per_flop']:.2f}" for k in r["kernels"]) or "n/a"
        occ = "/".join(f"{100 * k['occupancy']:.0f}%" for k in r["kernels"]) or "n/a"
        body.append([r["function"], r["variant"] or "-", r["size"], f"{r['bytes'] / 1e6:.1f}", f"{r['flops'] / 1e9:.1f}",
                     _ms(r["roofline_s"]), r["roofline_bound"], _ms(r["memory_at_copy_s"]), _ms(r["issue_bound_s"]),
                     _ms(r["predicted_s"]), ipf, occ, r["measured_note"]])
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(" --- " for _ in head) + "|")
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def static_rows(dtype):
    """The per-kernel static rows (:func:`gpu.sass.kernel_rows`), compiling every kernel here (real CUDA target)."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # before numba is first imported: the kernels compile for a real GPU
    from gpu import sass

    for tool in ("ptxas", "cuobjdump"):
        if sass.find_tool(tool) is None:
            raise SystemExit(f"gpu_model.py: {tool} not found: install the {sass.TOOL_WHEELS[tool]} wheel "
                             "(the cuda13 extra has both)")
    return sass.kernel_rows(sass.compile_kernels((9, 0)), sass_dtypes=(dtype,))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--static", type=Path, default=None, metavar="FILE",
                        help="read the per-kernel static rows from FILE (written by --save-static) instead of compiling")
    parser.add_argument("--save-static", type=Path, default=None, metavar="FILE", help="write the per-kernel static rows")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the model's rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kernels = json.loads(args.static.read_text()) if args.static else static_rows(args.dtype)
    if args.save_static:
        args.save_static.write_text(json.dumps(kernels, indent=1) + "\n")
    rows = model_rows(kernels, args.dtype)
    print(f"MODEL of gpu.numba_cuda on an H200, {args.dtype}, from the compiled code (ptxas, cuobjdump): no GPU ran;")
    print("every time below is a prediction under the assumptions of benchmarks/gpu_model.py, not a measurement.")
    print(format_rows(rows, markdown=args.markdown))
    if args.json:
        report = {"model": True, "device": H200, "dtype": args.dtype, "rows": rows,
                  "assumptions": __doc__.split("The model and its assumptions")[1].strip()}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
