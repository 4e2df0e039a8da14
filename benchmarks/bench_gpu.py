"""The Numba-CUDA kernels on a real GPU: times, ratios from one run, achieved bandwidth and FLOP rate.

Usage::

    python benchmarks/bench_gpu.py            # full sizes, on a CUDA GPU
    python benchmarks/bench_gpu.py --quick    # small sizes; without a GPU: a dry run in the CUDA simulator

What is measured
----------------
* Responsibilities (``gpu.numba_cuda.responsibilities``) at N = 1,048,576,
  K = 256, d = 64, float32: the time, the bytes that must move (read ``x``,
  write ``gamma``: ``4 N (d + K)``) over the time as a fraction of the GPU's
  peak memory bandwidth, and ``3 N K d`` floating-point operations over the
  time.  Target: at least 50% of the peak bandwidth.
* GMA forward and backward (``gma_forward``/``gma_backward``, bidirectional
  and causal) at N up to 1,048,576, K = 256, d_r = d_v = 64, against the
  *equivalent GEMMs* done by cuBLAS through CuPy (when CuPy is installed):
  the quadratic form's two products ``X (mu/sigma^2)^T`` and
  ``X^2 (1/sigma^2)^T`` for queries and keys, the write ``Gamma_K^T V`` and
  the read ``Gamma_Q V~``.  Target: the forward within 2x of them.
* The online-softmax kernel (``softmax_attention``) against dense attention
  by cuBLAS GEMMs (``Q K^T``, a softmax, ``P V``, through CuPy).
* OVQ (``ovq_attention``) at T = 65,536 against dense causal attention (the
  online-softmax kernel, causal).  Target: OVQ at least 10x faster.
* The CuPy backend (``gpu.cupy_kernels``), when it can run: the
  responsibilities' fraction of peak bandwidth (target: at least 60%), its GMA
  forward against the same GEMMs (target: within 1.3x), and its OVQ against
  the Numba one (target: at least as fast).

Each time is the best of ``--repeats`` runs after one warm-up run (which
compiles the kernels), taken with CUDA events around the call and a
synchronisation; inputs are on the device already, so no transfer is timed.
The peak bandwidth is the device's specification (``--peak-bandwidth`` to
give another); the printed fraction is ``bytes / time / peak``.

Without a GPU, ``--quick`` runs every step at tiny sizes in the CUDA
simulator and says so: that checks this script, not any speed, and its
numbers must not be read as GPU timings.  Without a GPU and without
``--quick`` the script explains that it needs one and exits.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu  # noqa: E402  (after the path set-up above)

TARGET = gpu.use_simulator_without_device()  # before numba is imported

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import gpu.numba_cuda as nc  # noqa: E402

#: Peak memory bandwidth (bytes/s) by device name, from the vendors' specifications.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
}


def peak_bandwidth(name):
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def timed(fn, repeats, simulated):
    """Best wall time of ``repeats`` calls (CUDA events on a GPU) after one warm-up call (none in the simulator)."""
    if not simulated:
        fn()
    best = float("inf")
    for _ in range(repeats):
        if simulated:
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


def try_cupy(simulated):
    """CuPy and the CuPy backend when they can run on the device, else ``(None, None, why)``."""
    if simulated:
        return None, None, "CuPy columns skipped: no GPU"
    usable, why = gpu.backend_status()["cupy"]
    if not usable:
        return None, None, f"CuPy columns skipped: {why}"
    import cupy

    import gpu.cupy_kernels as ck

    return cupy, ck, "cuBLAS through CuPy " + cupy.__version__


def device_arrays(rng, dtype, *shapes):
    return [cuda.to_device(rng.standard_normal(s).astype(dtype)) for s in shapes]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run in the simulator without a GPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s; by default from the device name")
    args = parser.parse_args(argv)
    simulated = TARGET == "simulator"
    if simulated and not args.quick:
        print("bench_gpu.py needs a CUDA GPU: none was found (gpu.backend_status() says why).")
        print("Run it with --quick for a dry run in the CUDA simulator, which checks the script but measures no GPU speed.")
        return 0
    repeats = 1 if simulated else args.repeats
    if simulated:
        sys.setswitchinterval(1e-4)  # every simulated GPU thread is a Python thread: switch often, barriers are cheaper
    dtype = np.float32
    rng = np.random.default_rng(0)

    print("Numba-CUDA kernels on " + ("the CUDA simulator" if simulated else "a GPU"))
    print(f"date: {datetime.date.today().isoformat()}")
    if simulated:
        print("DRY RUN in the CUDA simulator (no GPU here): every step runs at tiny sizes to check this script;")
        print("the numbers below are NOT GPU speed and must not be reported as such.")
        name, peak = "CUDA simulator", None
    else:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        peak = args.peak_bandwidth or peak_bandwidth(name)
        cc = dev.compute_capability
        print(f"device: {name} (compute capability {cc[0]}.{cc[1]}), peak bandwidth "
              + (f"{peak / 1e12:.2f} TB/s" if peak else "unknown (pass --peak-bandwidth)"))
    cupy, ck, cupy_note = try_cupy(simulated)
    print(f"float32, best of {repeats} run(s) after a warm-up; {cupy_note}")
    print()

    big = not (simulated or args.quick)
    N_resp, K, d = (1 << 20, 256, 64) if big else ((8, 3, 4) if simulated else (1 << 16, 256, 64))

    # --- responsibilities -------------------------------------------------------------
    x, means = device_arrays(rng, dtype, (N_resp, d), (K, d))
    variances = cuda.to_device((0.5 + rng.random((K, d))).astype(dtype))
    weights = cuda.to_device(np.full(K, 1 / K, dtype=dtype))
    t = timed(lambda: nc.responsibilities(x, means, variances, weights), repeats, simulated)
    moved = 4 * N_resp * (d + K)
    print(f"responsibilities  N = {N_resp}, K = {K}, d = {d}")
    print(f"  time {t * 1e3:9.3f} ms   bandwidth {moved / t / 1e9:8.1f} GB/s   {3 * N_resp * K * d / t / 1e12:6.2f} TFLOP/s")
    if peak:
        frac = moved / t / peak
        print(f"  fraction of peak memory bandwidth: {frac:.1%}   (target >= 50%: {'met' if frac >= 0.5 else 'NOT met'})")
    else:
        print("  fraction of peak memory bandwidth: n/a (no peak known)")
    if ck is not None:
        cx, cm, cvar, cw = (cupy.asarray(a) for a in (x, means, variances, weights))
        t_cp = timed(lambda: ck.responsibilities(cx, cm, cvar, cw), repeats, simulated)
        line = f"  CuPy backend: time {t_cp * 1e3:9.3f} ms   bandwidth {moved / t_cp / 1e9:8.1f} GB/s"
        if peak:
            frac = moved / t_cp / peak
            line += f"   fraction of peak {frac:.1%} (target >= 60%: {'met' if frac >= 0.6 else 'NOT met'})"
        print(line)
    print()

    # --- GMA forward and backward -------------------------------------------------------
    d_r = d_v = d
    sizes = [1 << 14, 1 << 17, 1 << 20] if big else ([8] if simulated else [1 << 14])
    print(f"GMA forward and backward  K = {K}, d_r = d_v = {d_v}" + ("" if cupy else "   (no CuPy: no GEMM column)"))
    print("      N   variant          forward ms   backward ms   equivalent GEMMs ms   forward / GEMMs")
    ratios = []
    cupy_rows = []
    for N in sizes:
        xq, xk, v, mu = device_arrays(rng, dtype, (N, d_r), (N, d_r), (N, d_v), (K, d_r))
        raw = cuda.to_device(np.zeros((K, d_r), dtype=dtype))
        logits = cuda.to_device(np.zeros(K, dtype=dtype))
        g = cuda.to_device(rng.standard_normal((N, d_v)).astype(dtype))
        gemm = None
        if cupy is not None:
            cx, cg, cv = cupy.asarray(xq), cupy.asarray(rng.random((N, K)).astype(dtype)), cupy.asarray(v)
            cm = cupy.asarray(rng.standard_normal((K, d_r)).astype(dtype))

            def gemms():
                for _ in range(2):  # queries and keys: X (mu p)^T and X^2 p^T
                    cx @ cm.T
                    (cx * cx) @ cm.T
                s = cg.T @ cv  # the write
                cg @ s  # the read
                cupy.cuda.runtime.deviceSynchronize()

            gemm = timed(gemms, repeats, simulated)
        for causal in (False, True):
            cache = {}

            def fwd():
                cache["c"] = nc.gma_forward(xq, xk, v, mu, raw, logits, causal=causal)[1]

            tf = timed(fwd, repeats, simulated)
            tb = timed(lambda: nc.gma_backward(g, cache["c"]), repeats, simulated)
            label = "causal" if causal else "bidirectional"
            if ck is not None:
                cargs = [cupy.asarray(a) for a in (xq, xk, v, mu, raw, logits)]
                t_ck = timed(lambda: ck.gma_forward(*cargs, causal=causal), repeats, simulated)
                cupy_rows.append((N, label, t_ck, gemm))
            if gemm is not None:
                ratios.append((N, label, tf / gemm))
                extra = f"{gemm * 1e3:14.3f}        {tf / gemm:8.2f}x"
            else:
                extra = "           n/a              n/a"
            print(f"  {N:8d}  {label:14s} {tf * 1e3:10.3f}   {tb * 1e3:11.3f}   {extra}")
    if ratios:
        worst = max(r for n, lab, r in ratios if lab == "bidirectional")
        print(f"  target: forward within 2x of its GEMMs (bidirectional, worst {worst:.2f}x): {'met' if worst <= 2 else 'NOT met'}")
    if cupy_rows:
        print("  CuPy backend (gpu.cupy_kernels.gma_forward):")
        for N, label, t_ck, gemm in cupy_rows:
            print(f"  {N:8d}  {label:14s} {t_ck * 1e3:10.3f} ms   / GEMMs {t_ck / gemm:6.2f}x")
        worst = max(t / g for n, lab, t, g in cupy_rows if lab == "bidirectional")
        print(f"  target: CuPy forward within 1.3x of its GEMMs (bidirectional, worst {worst:.2f}x): {'met' if worst <= 1.3 else 'NOT met'}")
    print()

    # --- online softmax against dense cuBLAS attention ----------------------------------
    att_sizes = [4096, 16384] if big else ([8] if simulated else [2048])
    print(f"online-softmax attention (d = {d}) against dense attention by cuBLAS GEMMs")
    for N in att_sizes:
        q, k, v = device_arrays(rng, dtype, (N, d), (N, d), (N, d))
        t_online = timed(lambda: nc.softmax_attention(q, k, v), repeats, simulated)
        line = f"  N = {N:6d}: online-softmax {t_online * 1e3:9.3f} ms"
        if cupy is not None:
            dq, dk, dv = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)

            def dense():
                s = (dq @ dk.T) * dtype(1 / np.sqrt(d))
                s -= s.max(axis=1, keepdims=True)
                p = cupy.exp(s)
                p /= p.sum(axis=1, keepdims=True)
                p @ dv
                cupy.cuda.runtime.deviceSynchronize()

            t_dense = timed(dense, repeats, simulated)
            line += f"   dense (cuBLAS) {t_dense * 1e3:9.3f} ms   online / dense {t_online / t_dense:6.2f}x"
        print(line)
    print()

    # --- OVQ against dense causal attention ----------------------------------------------
    T, N_dict, C = (65536, 1024, 256) if big else ((8, 3, 4) if simulated else (8192, 256, 128))
    q, k, v = device_arrays(rng, dtype, (T, d), (T, d), (T, d))
    t_ovq = timed(lambda: nc.ovq_attention(q, k, v, max_size=N_dict, chunk_size=C), repeats, simulated)
    t_causal = timed(lambda: nc.softmax_attention(q, k, v, causal=True), repeats, simulated)
    print(f"OVQ (N = {N_dict}, C = {C}) against dense causal attention (online-softmax kernel), T = {T}, d = d_v = {d}")
    print(f"  OVQ {t_ovq * 1e3:10.3f} ms   causal attention {t_causal * 1e3:10.3f} ms")
    if ck is not None:
        cq_, ck_, cv_ = (cupy.asarray(a) for a in (q, k, v))
        t_ovq_cp = timed(lambda: ck.ovq_attention(cq_, ck_, cv_, max_size=N_dict, chunk_size=C), repeats, simulated)
        print(f"  CuPy OVQ {t_ovq_cp * 1e3:10.3f} ms: Numba / CuPy {t_ovq / t_ovq_cp:.2f}x (target >= 1: {'met' if t_ovq_cp <= t_ovq else 'NOT met'})")
    ratio = t_causal / t_ovq
    print(f"  speed-up of OVQ over dense causal attention: {ratio:.1f}x"
          + ("" if simulated else f"   (target >= 10x at T = 65536: {'met' if ratio >= 10 and big else 'NOT met' if big else 'n/a at this T'})"))
    if simulated:
        print()
        print("dry run finished: every benchmark step ran in the simulator; run on a GPU for numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
