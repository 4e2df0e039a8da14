"""The GPU backends on a real GPU: time, effective bandwidth, FLOP rate and fraction of the roofline, against the targets.

Usage::

    python benchmarks/bench_gpu.py                   # full sizes, on a CUDA GPU
    python benchmarks/bench_gpu.py --check           # and exit 1 when a target is not met
    python benchmarks/bench_gpu.py --json rows.json  # and write every row as JSON
    python benchmarks/bench_gpu.py --quick           # small sizes; without a GPU: a dry run in the CUDA simulator

What is measured
----------------
* Responsibilities (``responsibilities``) at N = 1,048,576, K = 256,
  d = 64, float32, by both backends.  The row is compute-bound (its
  ``4 N K d`` FLOPs take 1.03 ms at an H200's float32 peak, its bytes 0.28 ms
  at its peak bandwidth, which caps its effective bandwidth at 27% of peak).
  Targets: at least 40% of the row's own roofline, by both backends.
* GMA forward and backward (``gma_forward``/``gma_backward``, bidirectional
  and causal) at N up to 1,048,576, K = 256, d_r = d_v = 64, against the
  *equivalent GEMMs* done by cuBLAS through CuPy: the quadratic form's two
  products ``X (mu/sigma^2)^T`` and ``X^2 (1/sigma^2)^T`` for queries and
  keys, the write ``Gamma_K^T V`` and the read ``Gamma_Q V~``.  Targets, for
  both variants at every size: the forward within 2x of them
  (``gpu.numba_cuda``), within 1.3x (``gpu.cupy_kernels``).
* Softmax attention: the online-softmax kernel (``gpu.numba_cuda``) and the
  CuPy backend's dense one against dense attention by cuBLAS GEMMs (``Q K^T``,
  a softmax, ``P V``, through CuPy).
* OVQ (``ovq_attention``) at T = 65,536 against dense causal attention (the
  online-softmax kernel, causal).  Targets: OVQ at least 10x faster
  (``gpu.numba_cuda``, at T = 65,536), the CuPy OVQ at least as fast as the
  Numba one.  Then both for B H = 32 sequences: attention with a leading
  dimension of 32 (one launch), and OVQ's chunk loop for 32 packed
  sequences in its one cooperative launch, as a packed call (``cu_seqlens``)
  runs it after copying its host inputs (the sequences are on the device
  here: ``gpu.numba_cuda.ovq._ovq_loop``, with the call's chunk plans made on
  the host in the timed call).  Target: OVQ at least 10x faster.
* Where torch is importable, the same sizes through what a PyTorch user
  would otherwise run (``benchmarks/torch_baselines.py``): torch SDPA for
  softmax attention, GMA and OVQ written in PyTorch eager.  They are
  labelled as such and have no target.
* For the CuPy backend, the kernel launches and cuBLAS calls of one call
  (``gpu.cupy_kernels.launch_count``, where the backend has it).

Beside each ``gpu.numba_cuda`` time the script prints the estimate of
``benchmarks/gpu_model.py`` (``est. ms``; an estimate from the compiled
code, not a measurement): from ``--model FILE``, else, at full sizes,
computed by that script in a process of its own while the GPU is measured,
and printed with every row at the end (:class:`Estimates`).  The first GPU
run so tests the model too.

Each time is the best of ``--repeats`` runs after one warm-up run (which
compiles the kernels), taken with CUDA events around the call; inputs are on
the device already, so no transfer is timed.  The backends run with their
defaults (the CuPy backend's result checks included), as a caller gets them.

Counts
------
Every row carries the bytes that must move and the useful floating-point
operations of its function (a multiplication and an addition count as two;
the ``O(N K)`` exponentials, logarithms and divisions are left out), for
float32 (4 bytes an entry; the ``K``-row parameters are left out of the
bytes):

* responsibilities, ``N`` rows, ``K`` components, dimension ``d``: bytes
  ``4 N (d + K)`` (read ``x``, write ``gamma``); FLOPs ``4 N K d``, the
  quadratic form ``sum_j (x_j - mu_kj)^2 / sigma^2_kj`` (a subtraction, a
  square, a product with the precision and an addition per ``(n, k, j)``;
  equally the two GEMMs ``X (mu/sigma^2)^T`` and ``X^2 (1/sigma^2)^T`` of
  the expansion).
* GMA forward, both variants: bytes ``4 N (2 d_r + 2 d_v)`` (read ``x_q``,
  ``x_k``, ``v``, write the output); FLOPs ``8 N K d_r + 4 N K (d_v + 1)``:
  two quadratic forms, the write ``Gamma_K^T [V, 1]`` and the read
  ``Gamma_Q [S, z]``.  The causal variant is counted as the token recurrence,
  which needs the same products (the chunked scan's masked within-chunk
  products are extra work, not counted).
* GMA backward: bytes ``4 N (4 d_r + 3 d_v)`` (read ``g``, ``x_q``, ``x_k``,
  ``v``, write ``dx_q``, ``dx_k``, ``dv``); FLOPs
  ``16 N K d_r + 6 N K (d_v + 1) + 2 N K d_v``: per side the gradient in
  ``x`` (``c (mu/sigma^2)`` and ``x * (c (1/sigma^2))``, ``4 N K d_r``) and the
  sums over tokens for the means and variances (``c^T X``, ``c^T X^2``,
  ``4 N K d_r``); ``dGamma_Q = G [S, z]^T``, ``d[S, z] = Gamma_Q^T G`` and
  ``dGamma_K = [V, 1] d[S, z]^T`` (``2 N K (d_v + 1)`` each); ``dV = Gamma_K dS``
  (``2 N K d_v``).
* the equivalent GEMMs: FLOPs ``8 N K d + 4 N K d_v``, the products they run;
  bytes those of the GMA forward.
* softmax attention, ``N`` queries and keys, ``d = d_v``: bytes ``16 N d``;
  FLOPs ``4 N^2 d`` (``Q K^T`` and ``P V``), causal ``2 N (N + 1) d`` (the
  pairs ``b <= a`` only).
* OVQ, ``T`` tokens, chunks of ``L <= C`` tokens, ``n_c`` centroids before
  chunk ``c`` (:func:`refimpl.ovq.dictionary_size`): bytes ``16 T d``; FLOPs
  ``sum_c (2 L n_c + L (L + 1)) (d + d_v) + 2 L n_c d``: the read-out's logits
  and weighted values against the centroids and the chunk's keys ``b <= a``,
  and the assignment's similarities (the ``O(L (d + d_v))`` update is left
  out).

The roofline time is ``max(bytes / peak bandwidth, FLOPs / peak float32
rate)``, from the device's specification (``--peak-bandwidth`` and
``--peak-flops`` to give others); each row states its bound, ``compute`` or
``memory``, the larger of the two terms of its own FLOPs and bytes, and the
fraction of its roofline is that time over the measured one (1 is the
device's limit for that row).  Every target is judged against the ceiling
of its own row (:data:`TARGET_SPECS`): a fraction of the row's roofline is
at most 1; a ratio to another row at best the ratio of the two rooflines.
:func:`target_ceilings` computes each target's ceiling at the full sizes, and
``tests/test_benchmarks.py`` fails on a target that exceeds it (a bandwidth
target of 50% for the compute-bound responsibilities, whose ceiling is 27%,
would).

``--check`` exits 0 when every target was judged and met, 1 when one ran
and missed its target (``check: NOT met``), 3 when none missed but one did
not run (``check: did not run``, with why: CuPy cannot run, no peak known for
the device); ``--json`` writes each target's status (``met``, ``missed``,
``not run``) under ``verdicts``.

Without a GPU, ``--quick`` runs every step at tiny sizes in the CUDA
simulator, with NumPy standing in for cuBLAS, and says so: that checks this
script, not any speed, its numbers must not be read as GPU timings, and no
target is judged (``--check`` then exits 0 and says so).  Without a GPU and
without ``--quick`` the script explains that it needs one and exits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (after the path set-up above)

#: Peak memory bandwidth (bytes/s) and peak float32 rate without tensor cores (FLOP/s) by device name, from the
#: vendors' specifications; the first key found in the device's name is used.
PEAKS = {
    "H200 NVL": (4.8e12, 60e12),
    "H200": (4.8e12, 67e12),
    "H100 NVL": (3.9e12, 60e12),
    "H100 PCIe": (2.0e12, 51e12),
    "H100": (3.35e12, 67e12),
    "A100-SXM4-80GB": (2.039e12, 19.5e12),
    "A100 80GB PCIe": (1.935e12, 19.5e12),
    "A100": (1.555e12, 19.5e12),
    "L40S": (0.864e12, 91.6e12),
}

#: The targets: ``{id: text}``.  On a GPU at full sizes ``--check`` needs each judged and met.
TARGETS = {
    "numba-resp-roofline": "time within 2.5x of its own roofline (>= 40% of it)",
    "cupy-resp-roofline": "time within 2.5x of its own roofline (>= 40% of it)",
    "numba-gma-gemm": "forward / GEMMs <= 2",
    "cupy-gma-gemm": "forward / GEMMs <= 1.3",
    "numba-ovq-speedup": "causal attention / OVQ >= 10 at T = 65536",
    "numba-ovq-speedup-bh32": "causal attention / OVQ >= 10 at T = 65536, B H = 32 (one packed call's launch)",
    "cupy-ovq-vs-numba": "Numba OVQ / CuPy OVQ >= 1",
}

#: What each target measures, against what, at the full sizes: ``{id: (kind, value, row, other row)}``.  ``kind``
#: ``"roofline"``: the row's fraction of its own roofline >= value; ``"bandwidth"``: its effective bandwidth over the
#: peak >= value; ``"ratio_max"``: the row's time over the other's <= value; ``"ratio_min"``: the other's time over
#: the row's >= value.  A row is ``(function, sizes)`` for :func:`full_size_counts`.
TARGET_SPECS = {
    "numba-resp-roofline": ("roofline", 0.4, "responsibilities", None),
    "cupy-resp-roofline": ("roofline", 0.4, "responsibilities", None),
    "numba-gma-gemm": ("ratio_max", 2.0, "gma_forward", "equivalent GEMMs"),
    "cupy-gma-gemm": ("ratio_max", 1.3, "gma_forward", "equivalent GEMMs"),
    "numba-ovq-speedup": ("ratio_min", 10.0, "ovq_attention", "causal attention"),
    "numba-ovq-speedup-bh32": ("ratio_min", 10.0, "ovq_attention BH=32", "causal attention BH=32"),
    "cupy-ovq-vs-numba": ("ratio_min", 1.0, "ovq_attention", "ovq_attention"),
}

# --- counts: bytes that must move and useful FLOPs (module docstring) ------------------------------------
# One set of formulas, in gpu.work, for the measurements here, the model (gpu_model.py) and the static gates, which
# compare each kernel's compiled loop with them.
from gpu.work import (  # noqa: E402
    FLOAT32,
    attention_counts,
    gemm_counts,
    gma_backward_counts,
    gma_forward_counts,
    ovq_counts,
    responsibilities_counts,
)


def device_peaks(name):
    """``(peak bandwidth, peak float32 FLOP rate)`` for a device name, ``(None, None)`` when it is not in :data:`PEAKS`."""
    for key, value in PEAKS.items():
        if key in name:
            return value
    return None, None


#: The full sizes: responsibilities (N, K, d), GMA (every N, K, d_r = d_v), attention N, OVQ (T, max_size, chunk).
FULL = {"responsibilities": (1 << 20, 256, 64), "gma": ([1 << 14, 1 << 17, 1 << 20], 256, 64), "attention": [4096, 16384],
        "ovq": (65536, 1024, 256)}


def full_size_counts(row):
    """``[(bytes, flops)]`` of a target's row at the full sizes (one per size: GMA runs three)."""
    N, K, d = FULL["responsibilities"]
    sizes, K_g, d_g = FULL["gma"]
    T, n_max, C = FULL["ovq"]
    return {
        "responsibilities": [responsibilities_counts(N, K, d)],
        "gma_forward": [gma_forward_counts(n, K_g, d_g, d_g) for n in sizes],
        "equivalent GEMMs": [gemm_counts(n, K_g, d_g, d_g) for n in sizes],
        "ovq_attention": [ovq_counts(T, d, d, n_max, C)],
        "causal attention": [attention_counts(T, d, causal=True)],
        "ovq_attention BH=32": [tuple(32 * x for x in ovq_counts(T, d, d, n_max, C))],
        "causal attention BH=32": [tuple(32 * x for x in attention_counts(T, d, causal=True))],
    }[row]


def roofline_time(nbytes, flops, peak_bandwidth, peak_flops):
    """``(seconds, bound)``: the larger of ``bytes / peak bandwidth`` and ``flops / peak rate``, and which it is
    (``"memory"`` or ``"compute"``); ``(None, None)`` without both peaks."""
    if not (peak_bandwidth and peak_flops):
        return None, None
    memory, compute = nbytes / peak_bandwidth, flops / peak_flops
    return (compute, "compute") if compute > memory else (memory, "memory")


def target_ceilings(peaks):
    """``{id: (target value, ceiling, bound)}`` at the full sizes on a device of ``peaks`` (bandwidth, FLOP/s).

    The ceiling is the best value the target's measure can take: 1 for a
    fraction of the row's own roofline; the bandwidth at the roofline time
    over the peak for a bandwidth target; for a ratio, that of the two rows'
    rooflines, the other row running at its roofline (the hardest case for
    the row judged).  A target is reachable only if it does not exceed its
    ceiling (below it for a ``ratio_max``).
    """
    out = {}
    for tid, (kind, value, row, other) in TARGET_SPECS.items():
        mine = [roofline_time(b, f, *peaks) for b, f in full_size_counts(row)]
        bound = "/".join(sorted({m[1] for m in mine}))
        if kind == "roofline":
            ceiling = 1.0
        elif kind == "bandwidth":
            ceiling = min(b / t / peaks[0] for (b, _), (t, _) in zip(full_size_counts(row), mine))
        else:
            ratios = [m[0] / o[0] for m, o in zip(mine, (roofline_time(b, f, *peaks) for b, f in full_size_counts(other)))]
            ceiling = max(ratios) if kind == "ratio_max" else min(1 / r for r in ratios)
        out[tid] = (value, ceiling, bound)
    return out


def reachable(kind, value, ceiling):
    """Whether a target of ``kind`` and ``value`` can be met under its ``ceiling`` (:func:`target_ceilings`)."""
    return value >= ceiling if kind == "ratio_max" else value <= ceiling


def roofline_fraction(seconds, nbytes, flops, peak_bandwidth, peak_flops):
    """``max(bytes / peak bandwidth, flops / peak rate) / seconds``, ``None`` without both peaks."""
    if not (peak_bandwidth and peak_flops) or seconds <= 0:
        return None
    return max(nbytes / peak_bandwidth, flops / peak_flops) / seconds


def make_row(backend, function, variant, size, seconds, nbytes, flops, peaks=(None, None), target=None, measured=None,
             met=None, note="", launches=None, estimate=None):
    """One result: what ran, its time, bytes, FLOPs, rates, its bound and roofline fraction, and the target it is judged by."""
    roof, bound = roofline_time(nbytes, flops, *peaks)
    return {
        "backend": backend,
        "function": function,
        "variant": variant,
        "size": size,
        "time_s": seconds,
        "bytes": nbytes,
        "flops": flops,
        "bandwidth_Bps": nbytes / seconds if seconds > 0 else None,
        "flop_rate": flops / seconds if seconds > 0 else None,
        "roofline_fraction": roofline_fraction(seconds, nbytes, flops, *peaks),
        "roofline_s": roof,
        "bound": bound,
        "target_id": target,
        "target": TARGETS.get(target, ""),
        "measured": measured,
        "met": met,
        "note": note,
        "launches_per_call": launches,
        "estimate_s": estimate,
    }


def judge(rows, simulated, full):
    """``(exit code, lines, verdicts)`` of ``--check``: each target ``met``, ``missed`` (it ran) or ``not run``.

    The code is 1 when a target ran and missed, else 3 when one did not run
    at full sizes on a GPU, else 0; in the simulator and at ``--quick`` sizes
    nothing is judged and the code is 0.  ``verdicts`` is ``{id: {"status",
    "why"}}``.
    """
    if simulated:
        why = "not judged in the CUDA simulator"
        return 0, ["check: no target is judged in the CUDA simulator (its times are not GPU speed)"], {
            tid: {"status": "not run", "why": why} for tid in TARGETS}
    lines, missed_any, not_run_any, verdicts = [], False, False, {}
    for tid, text in TARGETS.items():
        mine = [r for r in rows if r["target_id"] == tid]
        judged = [r for r in mine if r["met"] is not None]
        failed = [r for r in judged if not r["met"]]
        if failed:
            missed_any = True
            where = ", ".join(f"{r['backend']} {r['function']} {r['variant']} {r['size']}".replace("  ", " ") for r in failed)
            lines.append(f"check: NOT met: {text} ({where})")
            verdicts[tid] = {"status": "missed", "why": where}
        elif judged:
            lines.append(f"check: met: {text} ({len(judged)} row(s))")
            verdicts[tid] = {"status": "met", "why": f"{len(judged)} row(s)"}
        else:
            why = "; ".join(sorted({r["note"] for r in mine if r["note"]})) or "not measured"
            verdicts[tid] = {"status": "not run", "why": why}
            if full:
                not_run_any = True
                lines.append(f"check: did not run: {text} ({why})")
            else:
                lines.append(f"check: not judged at --quick sizes: {text} ({why})")
    return (1 if missed_any else 3 if not_run_any else 0), lines, verdicts


def _fmt(value, scale, digits, unit=""):
    return "n/a" if value is None else f"{value / scale:.{digits}f}{unit}"


def format_rows(rows):
    """The rows as a plain-text table (what the script prints after each section): launches per call for the CuPy
    backend, and beside each ``gpu.numba_cuda`` time the estimate of ``benchmarks/gpu_model.py`` (``n/a`` without
    one: not at these sizes, or no model)."""
    head = (f"{'backend':28s} {'function':18s} {'variant':14s} {'size':28s} {'ms':>10s} {'est. ms':>9s} {'GB/s':>8s} "
            f"{'TFLOP/s':>8s} {'bound':>8s} {'roofline':>8s} {'launches':>8s}  target")
    lines = [head]
    for r in rows:
        met = ({True: "met", False: "NOT met"}.get(r["met"]) or r["note"] or "not judged") if r["target"] else ""
        target = f"{r['target']} (measured {_fmt(r['measured'], 1, 2)}): {met}" if r["target"] else ""
        launches = "" if r["launches_per_call"] is None else str(r["launches_per_call"])
        estimate = "" if r["backend"] != "numba-cuda" else _fmt(r.get("estimate_s"), 1e-3, 3)
        lines.append(
            f"{r['backend']:28s} {r['function']:18s} {r['variant']:14s} {r['size']:28s} {_fmt(r['time_s'], 1e-3, 3):>10s} "
            f"{estimate:>9s} {_fmt(r['bandwidth_Bps'], 1e9, 1):>8s} {_fmt(r['flop_rate'], 1e12, 2):>8s} "
            f"{r.get('bound') or 'n/a':>8s} {_fmt(r['roofline_fraction'], 0.01, 1, '%'):>8s} {launches:>8s}  {target}"
        )
    return "\n".join(lines)


#: Seconds ``bench_gpu.py`` waits, after its last measurement, for the estimates computed beside it (:class:`Estimates`).
MODEL_WAIT_S = 30


class Estimates:
    """The estimates of ``benchmarks/gpu_model.py`` for the rows: ``{(function, variant, size): seconds}``.

    From ``--model FILE`` (a ``gpu_model.py --json`` file) at once; else, at
    full sizes on a GPU, computed by ``gpu_model.py`` in a process of its own
    started before the first measurement (it compiles, assembles and
    disassembles every kernel on the CPU while the GPU is measured) and read
    after the last one, waiting at most :data:`MODEL_WAIT_S` seconds, so that
    the benchmark's time grows by that at most; else none.  ``note`` says
    which, or why none.
    """

    def __init__(self, args, full, folder=None):
        import gpu_model

        self.table, self.proc, self.out = {}, None, None
        if args.model is not None:
            report = json.loads(args.model.read_text())
            self.table = gpu_model.estimates(report["rows"])
            self.note = f"estimates from {args.model} (benchmarks/gpu_model.py)"
        elif not full:
            self.note = "no estimates at these sizes (the model is of the full sizes; pass --model FILE for others)"
        else:
            import subprocess
            import tempfile

            self.out = Path(folder or tempfile.mkdtemp(prefix="gpu-model-")) / "gpu-model.json"
            env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
            script = Path(__file__).resolve().parent / "gpu_model.py"
            self.proc = subprocess.Popen([sys.executable, str(script), "--json", str(self.out)], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.note = "estimates of benchmarks/gpu_model.py, computed beside the measurements (printed at the end)"

    def finish(self, wait_s=MODEL_WAIT_S):
        """Read the estimates of the process started by the constructor (at most ``wait_s`` seconds more); the table."""
        if self.proc is None:
            return self.table
        import gpu_model
        import subprocess

        try:
            _, err = self.proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.note = f"no estimates: benchmarks/gpu_model.py had not finished {wait_s:g} s after the measurements"
        else:
            if self.proc.returncode == 0 and self.out.is_file():
                self.table = gpu_model.estimates(json.loads(self.out.read_text())["rows"])
            else:
                last = (err or "").strip().splitlines()[-1:] or ["no output"]
                self.note = f"no estimates: benchmarks/gpu_model.py exited {self.proc.returncode} ({last[0]})"
        self.proc = None
        return self.table

    def attach(self, rows):
        """Set ``estimate_s`` on each ``gpu.numba_cuda`` row that has an estimate; the number set."""
        n = 0
        for r in rows:
            if r["backend"] == "numba-cuda" and (key := (r["function"], r["variant"], r["size"])) in self.table:
                r["estimate_s"] = self.table[key]
                n += 1
        return n


def _json_path(text):
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty one")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; pass a file such as {path / 'bench-gpu.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path}: its folder {parent} is not writable")
    return path


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run in the simulator without a GPU)")
    parser.add_argument("--repeats", type=_positive_int, default=5)
    parser.add_argument("--peak-bandwidth", type=_positive_float, default=None, help="bytes/s; by default from the device name")
    parser.add_argument("--peak-flops", type=_positive_float, default=None,
                        help="float32 FLOP/s; by default from the device name")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target ran and was missed, 3 when one did not run (on a GPU at full sizes)")
    parser.add_argument("--json", type=_json_path, default=None, metavar="FILE", help="write every row, and the device, as JSON")
    parser.add_argument("--model", type=Path, default=None, metavar="FILE",
                        help="the estimates to print beside the times: a file of benchmarks/gpu_model.py --json "
                             "(by default computed beside the measurements at full sizes on a GPU)")
    return parser.parse_args(argv)


class _Bench:
    """The measurement context: where it runs, how it times, and the rows measured so far."""

    def __init__(self, cuda, simulated, repeats, peaks):
        self.cuda, self.simulated, self.repeats, self.peaks = cuda, simulated, repeats, peaks
        self.rows = []
        self.estimates = None  # the estimates of benchmarks/gpu_model.py (Estimates)

    def time(self, fn):
        """Best wall time of ``repeats`` calls (CUDA events on a GPU) after one warm-up call (none in the simulator)."""
        cuda = self.cuda
        if not self.simulated:
            fn()
            cuda.synchronize()
        best = float("inf")
        for _ in range(self.repeats):
            if self.simulated:
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
                continue
            start, stop = cuda.event(timing=True), cuda.event(timing=True)
            cuda.synchronize()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            best = min(best, cuda.event_elapsed_time(start, stop) / 1e3)
        return best

    def add(self, backend, function, variant, size, seconds, counts, **judgement):
        estimate = self.estimates.table.get((function, variant, size)) if backend == "numba-cuda" else None
        row = make_row(backend, function, variant, size, seconds, *counts, peaks=self.peaks, estimate=estimate, **judgement)
        self.rows.append(row)
        return row

    def verdict(self, target, measured, ok, unjudged=None):
        """The ``target``, ``measured``, ``met`` and ``note`` of a row: not judged in the simulator or when ``unjudged`` says why."""
        if self.simulated:
            return dict(target=target, measured=measured, met=None, note="not judged in the simulator")
        if unjudged:
            return dict(target=target, measured=measured, met=None, note=unjudged)
        return dict(target=target, measured=measured, met=bool(ok))


def _cupy(simulated):
    """``(cupy, gpu.cupy_kernels, note)`` when the CuPy backend can run, else ``(None, None, why)``."""
    if simulated:
        return None, None, "the CuPy backend does not run in the CUDA simulator"
    usable, why = gpu.backend_status()["cupy"]
    if not usable:
        return None, None, f"CuPy backend not measured: {why}"
    import cupy

    import gpu.cupy_kernels as ck

    return cupy, ck, "cuBLAS and the CuPy backend through CuPy " + cupy.__version__


def _launch_counter(ck):
    """The CuPy backend's count of launches since import, where it has one (``None`` otherwise)."""
    if ck is None:
        return None
    if hasattr(ck, "launch_count"):
        return ck.launch_count
    backend = getattr(ck, "_backend", None)
    return getattr(backend, "launch_count", None)


def _torch(simulated):
    """``(torch, device, label, note)``: torch on the GPU, on the CPU in the simulator's dry run, or ``None`` and why."""
    import torch_baselines

    ok, why = torch_baselines.available()
    if not ok:
        return None, None, None, f"no torch rows: {why}"
    import torch

    if simulated:
        return torch, "cpu", " (CPU, dry run)", f"{why} on the CPU: a dry run of the torch rows, not GPU speed"
    if not torch.cuda.is_available():
        return None, None, None, f"no torch rows: {why} has no CUDA device here"
    return torch, "cuda", "", f"{why} on {torch.cuda.get_device_name()}"


def run(args):
    """Measure every row (see the module docstring); returns ``(rows, device description, simulated, full)``."""
    target = gpu.use_simulator_without_device()  # before numba is imported
    simulated = target == "simulator"
    if simulated and not args.quick:
        return None, None, simulated, False

    import numpy as np
    from numba import cuda

    import gpu.numba_cuda as nc
    import gpu.numba_cuda.ovq as nc_ovq
    import refimpl.ovq as refimpl_ovq
    import torch_baselines as tb

    full = not (simulated or args.quick)
    repeats = 1 if simulated else args.repeats
    if simulated:
        sys.setswitchinterval(1e-4)  # every simulated GPU thread is a Python thread: switch often, barriers are cheaper
        name, peaks = "CUDA simulator", (None, None)
    else:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        bw, fl = device_peaks(name)
        peaks = (args.peak_bandwidth or bw, args.peak_flops or fl)
    cupy, ck, cupy_note = _cupy(simulated)
    torch, tdev, tlabel, torch_note = _torch(simulated)
    count = _launch_counter(ck)
    xp = cupy if cupy is not None else (np if simulated else None)  # cuBLAS, or NumPy standing in for it in the dry run
    gemm_label = "cuBLAS (CuPy)" if cupy is not None else "NumPy (dry run)"
    bench = _Bench(cuda, simulated, repeats, peaks)
    bench.estimates = Estimates(args, full, args.json.parent if args.json is not None else None)
    dtype = np.float32
    rng = np.random.default_rng(0)

    print("GPU backends on " + ("the CUDA simulator" if simulated else "a GPU"))
    print(f"date: {datetime.date.today().isoformat()}")
    if simulated:
        print("DRY RUN in the CUDA simulator (no GPU here): every step runs at tiny sizes to check this script;")
        print("the numbers below are NOT GPU speed and must not be reported as such.")
    else:
        cc = cuda.get_current_device().compute_capability
        print(f"device: {name} (compute capability {cc[0]}.{cc[1]}), peak bandwidth "
              + (f"{peaks[0] / 1e12:.2f} TB/s" if peaks[0] else "unknown (pass --peak-bandwidth)")
              + ", peak float32 " + (f"{peaks[1] / 1e12:.1f} TFLOP/s" if peaks[1] else "unknown (pass --peak-flops)"))
    print(f"float32, best of {repeats} run(s) after a warm-up; {cupy_note}; {torch_note}")
    print(f"est. ms: {bench.estimates.note}: an estimate, not a measurement (its assumptions: benchmarks/gpu_model.py)")
    if ck is not None and count is None:
        print("launches per call: not counted (gpu.cupy_kernels has no launch_count)")
    print()

    def host(*shapes):
        return [rng.standard_normal(s).astype(dtype) for s in shapes]

    def on_torch(*arrays):
        return [torch.from_numpy(a).to(tdev) for a in arrays]

    def launches(fn):
        if count is None:
            return None
        before = count()
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        return count() - before

    def sync_xp():
        if xp is not np:
            cupy.cuda.runtime.deviceSynchronize()

    # --- responsibilities ---------------------------------------------------------------
    N, K, d = (1 << 20, 256, 64) if full else ((8, 3, 4) if simulated else (1 << 16, 256, 64))
    size = f"N={N} K={K} d={d}"
    hx, hmu = host((N, d), (K, d))
    hvar = (0.5 + rng.random((K, d))).astype(dtype)
    hw = np.full(K, 1 / K, dtype=dtype)
    counts = responsibilities_counts(N, K, d)
    no_peak = None if peaks[0] and peaks[1] else "no peaks known for this device (pass --peak-bandwidth and --peak-flops)"
    args_nb = [cuda.to_device(a) for a in (hx, hmu, hvar, hw)]
    t = bench.time(lambda: nc.responsibilities(*args_nb))
    frac = roofline_fraction(t, *counts, *peaks)
    bench.add("numba-cuda", "responsibilities", "", size, t, counts,
              **bench.verdict("numba-resp-roofline", frac, frac is not None and frac >= TARGET_SPECS["numba-resp-roofline"][1], no_peak))
    if ck is not None:
        args_cp = [cupy.asarray(a) for a in (hx, hmu, hvar, hw)]
        t = bench.time(lambda: ck.responsibilities(*args_cp))
        frac = roofline_fraction(t, *counts, *peaks)
        bench.add("cupy", "responsibilities", "", size, t, counts, launches=launches(lambda: ck.responsibilities(*args_cp)),
                  **bench.verdict("cupy-resp-roofline", frac, frac is not None and frac >= TARGET_SPECS["cupy-resp-roofline"][1], no_peak))
    del args_nb
    print(format_rows(bench.rows[-2:] if ck is not None else bench.rows[-1:]))
    print()

    # --- GMA forward and backward, against the equivalent GEMMs ---------------------------
    d_r = d_v = d
    sizes = [1 << 14, 1 << 17, 1 << 20] if full else ([8] if simulated else [1 << 14])
    start = len(bench.rows)
    for N in sizes:
        size = f"N={N} K={K} d_r=d_v={d_v}"
        hxq, hxk, hv, hmu, hg = host((N, d_r), (N, d_r), (N, d_v), (K, d_r), (N, d_v))
        hraw, hlogits = np.zeros((K, d_r), dtype), np.zeros(K, dtype)
        t_gemm = None
        if xp is not None:
            gx = xp.asarray(hxq)
            gg = xp.asarray(rng.random((N, K)).astype(dtype))
            gv, gm = xp.asarray(hv), xp.asarray(hmu)

            def gemms():
                for _ in range(2):  # queries and keys: X (mu p)^T and X^2 p^T
                    gx @ gm.T
                    (gx * gx) @ gm.T
                s = gg.T @ gv  # the write
                gg @ s  # the read
                sync_xp()

            t_gemm = bench.time(gemms)
            bench.add(gemm_label, "equivalent GEMMs", "", size, t_gemm, gemm_counts(N, K, d_r, d_v))
        no_gemm = None if t_gemm is not None else "no GEMM time: CuPy cannot run here"
        nb = [cuda.to_device(a) for a in (hxq, hxk, hv, hmu, hraw, hlogits)]
        g_nb = cuda.to_device(hg)
        cp = [cupy.asarray(a) for a in (hxq, hxk, hv, hmu, hraw, hlogits)] if ck is not None else None
        g_cp = cupy.asarray(hg) if ck is not None else None
        for causal in (False, True):
            variant = "causal" if causal else "bidirectional"
            cache = {}

            def fwd():
                cache["c"] = nc.gma_forward(*nb, causal=causal)[1]

            tf = bench.time(fwd)
            ratio = tf / t_gemm if t_gemm else None
            bench.add("numba-cuda", "gma_forward", variant, size, tf, gma_forward_counts(N, K, d_r, d_v),
                      **bench.verdict("numba-gma-gemm", ratio, ratio is not None and ratio <= 2, no_gemm))
            t_back = bench.time(lambda: nc.gma_backward(g_nb, cache["c"]))
            bench.add("numba-cuda", "gma_backward", variant, size, t_back, gma_backward_counts(N, K, d_r, d_v))
            if ck is not None:
                def cfwd():
                    cache["cp"] = ck.gma_forward(*cp, causal=causal)[1]

                tf = bench.time(cfwd)
                ratio = tf / t_gemm
                bench.add("cupy", "gma_forward", variant, size, tf, gma_forward_counts(N, K, d_r, d_v),
                          launches=launches(cfwd), **bench.verdict("cupy-gma-gemm", ratio, ratio <= 1.3))
                t_back = bench.time(lambda: ck.gma_backward(g_cp, cache["cp"]))
                bench.add("cupy", "gma_backward", variant, size, t_back, gma_backward_counts(N, K, d_r, d_v),
                          launches=launches(lambda: ck.gma_backward(g_cp, cache["cp"])))
            if torch is not None:
                tq, tk, tv, tm = on_torch(hxq, hxk, hv, hmu)
                tvar = torch.full_like(tm, math.log(2) + 1e-6)  # what the raw variances 0 give: softplus(0) + min_variance
                tw = torch.full((K,), 1 / K, dtype=tm.dtype, device=tdev)
                t = bench.time(lambda: tb.gma(tq, tk, tv, tm, tvar, tw, causal=causal))
                bench.add("PyTorch eager" + tlabel, "gma (forward)", variant, size, t, gma_forward_counts(N, K, d_r, d_v))
        del nb, cp, cache
    print(format_rows(bench.rows[start:]))
    print()

    # --- softmax attention against dense attention by cuBLAS GEMMs -----------------------
    att_sizes = [4096, 16384] if full else ([8] if simulated else [2048])
    start = len(bench.rows)
    for N in att_sizes:
        size = f"N={N} d={d}"
        hq, hk, hv = host((N, d), (N, d), (N, d))
        counts = attention_counts(N, d, causal=False)
        nb = [cuda.to_device(a) for a in (hq, hk, hv)]
        bench.add("numba-cuda", "softmax_attention", "bidirectional", size, bench.time(lambda: nc.softmax_attention(*nb)), counts)
        if xp is not None:
            dq, dk, dv = (xp.asarray(a) for a in (hq, hk, hv))

            def dense():
                s = (dq @ dk.T) * dtype(1 / np.sqrt(d))
                s -= s.max(axis=1, keepdims=True)
                p = xp.exp(s)
                p /= p.sum(axis=1, keepdims=True)
                p @ dv
                sync_xp()

            bench.add(gemm_label, "dense attention", "bidirectional", size, bench.time(dense), counts)
        if ck is not None:
            cq, ck_, cv = (cupy.asarray(a) for a in (hq, hk, hv))
            bench.add("cupy", "softmax_attention", "bidirectional", size, bench.time(lambda: ck.softmax_attention(cq, ck_, cv)),
                      counts, launches=launches(lambda: ck.softmax_attention(cq, ck_, cv)))
        if torch is not None:
            tq, tk, tv = on_torch(hq, hk, hv)
            bench.add("torch SDPA" + tlabel, "softmax attention", "bidirectional", size,
                      bench.time(lambda: tb.sdpa(tq, tk, tv)), counts)
    print(format_rows(bench.rows[start:]))
    print()

    # --- OVQ against dense causal attention ----------------------------------------------
    T, N_dict, C = (65536, 1024, 256) if full else ((8, 3, 4) if simulated else (8192, 256, 128))
    size = f"T={T} N={N_dict} C={C} d={d}"
    start = len(bench.rows)
    hq, hk, hv = host((T, d), (T, d), (T, d))
    nb = [cuda.to_device(a) for a in (hq, hk, hv)]
    t_causal = bench.time(lambda: nc.softmax_attention(*nb, causal=True))
    t_ovq = bench.time(lambda: nc.ovq_attention(*nb, max_size=N_dict, chunk_size=C))
    speedup = t_causal / t_ovq
    bench.add("numba-cuda", "softmax_attention", "causal", f"N={T} d={d}", t_causal, attention_counts(T, d, causal=True))
    bench.add("numba-cuda", "ovq_attention", "causal", size, t_ovq, ovq_counts(T, d, d, N_dict, C),
              **bench.verdict("numba-ovq-speedup", speedup, speedup >= 10, None if T == 65536 else "n/a below T = 65536"))
    if ck is not None:
        cq, ck_, cv = (cupy.asarray(a) for a in (hq, hk, hv))

        def covq():
            ck.ovq_attention(cq, ck_, cv, max_size=N_dict, chunk_size=C)

        t_cp = bench.time(covq)
        bench.add("cupy", "ovq_attention", "causal", size, t_cp, ovq_counts(T, d, d, N_dict, C), launches=launches(covq),
                  **bench.verdict("cupy-ovq-vs-numba", t_ovq / t_cp, t_cp <= t_ovq))
    if torch is not None:
        tq, tk, tv = on_torch(hq, hk, hv)
        bench.add("torch SDPA" + tlabel, "softmax attention", "causal", f"N={T} d={d}",
                  bench.time(lambda: tb.sdpa(tq, tk, tv, causal=True)), attention_counts(T, d, causal=True))
        bench.add("PyTorch eager" + tlabel, "ovq_attention", "causal", size,
                  bench.time(lambda: tb.ovq_attention(tq, tk, tv, max_size=N_dict, chunk_size=C)), ovq_counts(T, d, d, N_dict, C))
    print(format_rows(bench.rows[start:]))
    print(f"speed-up of OVQ over dense causal attention: {speedup:.1f}x")
    print()

    # --- OVQ against dense causal attention, B H sequences at once ------------------------
    BH = 32 if full else 2
    start = len(bench.rows)
    # the previous rows' sequence, BH times, copied on the device (a host array of 32 would take seconds to draw)
    nb = [cuda.device_array((BH, T, d), dtype) for _ in range(3)]
    for many, one in zip(nb, (hq, hk, hv)):
        one = cuda.to_device(one)
        for b in range(BH):
            many[b].copy_to_device(one)
    t_causal = bench.time(lambda: nc.softmax_attention(*nb, causal=True))
    options = (N_dict, C, None, "plateau", "spread", True, None, 0, None)  # ovq_attention's defaults, as timed above
    params = refimpl_ovq.check_ovq_arguments(hq, hk, hv, *options).params
    packed = [x.reshape(1, BH * T, d) for x in nb]  # the sequences one after another, as cu_seqlens lays them
    sequences = [(b * T, T, 0, 0) for b in range(BH)]

    def packed_ovq():
        # each call from empty dictionaries, as a packed call without states
        Dk, Dv = cuda.to_device(np.zeros((BH, N_dict, d), dtype)), cuda.to_device(np.zeros((BH, N_dict, d), dtype))
        counts = cuda.to_device(np.zeros((BH, N_dict), np.int64))
        nc_ovq._ovq_loop(*packed, params, Dk, Dv, counts, sequences)

    t_ovq = bench.time(packed_ovq)
    speedup = t_causal / t_ovq
    bh = f" BH={BH}"
    bench.add("numba-cuda", "softmax_attention", "causal", f"N={T} d={d}" + bh, t_causal,
              tuple(BH * x for x in attention_counts(T, d, causal=True)))
    bench.add("numba-cuda", "ovq_attention", "causal", size + bh, t_ovq,
              tuple(BH * x for x in ovq_counts(T, d, d, N_dict, C)),
              **bench.verdict("numba-ovq-speedup-bh32", speedup, speedup >= 10,
                              None if T == 65536 and BH == 32 else "n/a below T = 65536, B H = 32"))
    print(format_rows(bench.rows[start:]))
    print(f"speed-up of OVQ over dense causal attention, {BH} sequences: {speedup:.1f}x")
    print()
    if bench.estimates.proc is not None:
        bench.estimates.finish()
        if bench.estimates.attach(bench.rows):
            print("gpu.numba_cuda against the estimates of benchmarks/gpu_model.py (an estimate, not a measurement):")
            print(format_rows([r for r in bench.rows if r["backend"] == "numba-cuda"]))
        else:
            print(f"est. ms: {bench.estimates.note}")
        print()
    return bench.rows, {"name": name, "peak_bandwidth_Bps": peaks[0], "peak_flops": peaks[1]}, simulated, full


def main(argv=None):
    args = parse_args(argv)
    rows, device, simulated, full = run(args)
    if rows is None:
        print("bench_gpu.py needs a CUDA GPU: none was found (gpu.backend_status() says why).")
        print("Run it with --quick for a dry run in the CUDA simulator, which checks the script but measures no GPU speed.")
        return 0
    code, lines, verdicts = judge(rows, simulated, full)
    print("\n".join(lines))
    if args.json is not None:
        report = {"device": device, "simulated": simulated, "full_sizes": full, "date": datetime.date.today().isoformat(),
                  "targets": TARGETS, "verdicts": verdicts, "check_exit_code": code, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"rows written to {args.json}")
    if simulated:
        print("dry run finished: every benchmark step ran in the simulator; run on a GPU for numbers")
    return code if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
