"""Every benchmark script runs in its quick mode and prints the ratios it exists for (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {
    "bench_gma.py": ["speed-up", "peak memory"],
    "bench_ovq.py": ["speed-up of OVQ over causal softmax attention", "state bytes ratio"],
    # on a GPU, measured; without one, --quick is a dry run in the CUDA simulator that says so
    "bench_gpu.py": [
        "responsibilities",
        "equivalent GEMMs",
        "gma_forward        bidirectional",
        "gma_forward        causal",
        "gma_backward       causal",
        "softmax_attention  bidirectional",
        "dense attention",
        "ovq_attention      causal",
        "speed-up of OVQ over dense causal attention",
    ],
    "bench_cpu.py": [
        "tuned / GEMM floor",
        "scikit-learn / tuned",
        "plain reference / tuned",
        "plain / tuned, bidirectional forward",
        "cost of the exactness screen",
        "refined == expansion bit for bit:  True",
        "float64 / float32",
        "bidirectional / floor",
        "causal / floor",
        "backward / floor",
        "peak memory",
        "ns per entry",
        "causal GMA padded / packed:",
        "causal GMA loop / packed:",
        "peak memory, causal GMA",
        "causal OVQ (n_max = 16, C = 16) loop / packed:",
    ],
}


def test_every_benchmark_is_listed():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_script_runs_in_quick_mode(script):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for phrase in EXPECTED[script]:
        assert phrase in proc.stdout, (phrase, proc.stdout)


# --- bench_gpu.py: its counts, its verdicts and its PyTorch baselines -----------------------------------------------


def _load(name):
    """benchmarks/NAME.py as a module (bench_gpu imports numba only when it measures)."""
    import importlib.util

    found = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _bench_gpu():
    return _load("bench_gpu")


def test_bench_gpu_counts_the_quadratic_form_as_4_nkd():
    # per (n, k, j): x - mu, its square, times the precision, added to the sum
    bg = _bench_gpu()
    N, K, d = 1 << 20, 256, 64
    assert bg.responsibilities_counts(N, K, d) == (4 * N * (d + K), 4 * N * K * d)


def test_bench_gpu_gma_counts_are_two_quadratic_forms_a_write_and_a_read():
    bg = _bench_gpu()
    N, K, d_r, d_v = 1000, 7, 5, 3
    resp = bg.responsibilities_counts(N, K, d_r)[1]
    write = read = 2 * N * K * (d_v + 1)  # Gamma_K^T [V, 1] and Gamma_Q [S, z]
    assert bg.gma_forward_counts(N, K, d_r, d_v) == (4 * N * (2 * d_r + 2 * d_v), 2 * resp + write + read)
    # backward: per side dx (two products) and the parameter sums (two products); three products through [S, z]; dV
    product = 2 * N * K
    assert bg.gma_backward_counts(N, K, d_r, d_v)[1] == 2 * 4 * product * d_r + 3 * product * (d_v + 1) + product * d_v
    assert bg.gemm_counts(N, K, d_r, d_v)[1] == 4 * product * d_r + 2 * product * d_v


def test_bench_gpu_attention_and_ovq_counts_match_a_token_by_token_count():
    from refimpl.ovq import dictionary_size

    bg = _bench_gpu()
    N, d = 37, 4
    causal = sum(2 * (a + 1) * d + 2 * (a + 1) * d for a in range(N))  # query a: q.k and p v over keys 0..a
    assert bg.attention_counts(N, d, causal=True) == (16 * N * d, causal)
    assert bg.attention_counts(N, d, causal=False)[1] == 4 * N * N * d
    T, n_max, C, d_v = 50, 6, 8, 3
    flops = 0
    for t in range(T):
        s = t - t % C  # the start of the token's chunk
        n = int(dictionary_size(s, n_max))
        seen = n + t - s + 1  # centroids, and the chunk's keys up to this one
        flops += 2 * seen * d + 2 * seen * d_v + 2 * n * d  # logits, weighted values, the assignment
    assert bg.ovq_counts(T, d, d_v, n_max, C) == (4 * T * (2 * d + 2 * d_v), flops)


def test_bench_gpu_roofline_is_the_slower_of_memory_and_arithmetic():
    bg = _bench_gpu()
    assert bg.roofline_fraction(2.0, 4e12, 1e12, 4e12, 1e12) == 0.5  # both bounds take 1 s
    assert bg.roofline_fraction(1.0, 1e12, 1e12, 4e12, 1e12) == 1.0  # arithmetic-bound
    assert bg.roofline_fraction(1.0, 2e12, 1e9, 4e12, 1e12) == 0.5  # memory-bound
    assert bg.roofline_fraction(1.0, 1, 1, None, 1e12) is None
    assert bg.device_peaks("NVIDIA H200") == (4.8e12, 67e12)
    assert bg.device_peaks("NVIDIA H200 NVL") == (4.8e12, 60e12)
    assert bg.device_peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 67e12)
    assert bg.device_peaks("Some GPU") == (None, None)


def _rows(bg, met):
    return [bg.make_row("numba-cuda", "f", "causal", "N=1", 1.0, 1, 1, target=t, measured=1.0, met=met) for t in bg.TARGETS]


def test_bench_gpu_check_tells_a_target_missed_from_one_that_did_not_run():
    bg = _bench_gpu()
    assert bg.judge(_rows(bg, True), simulated=False, full=True)[0] == 0
    rows = _rows(bg, True)
    rows[3]["met"] = False
    code, lines, verdicts = bg.judge(rows, simulated=False, full=True)
    assert code == 1 and lines[3].startswith("check: NOT met: forward / GEMMs <= 1.3")
    assert verdicts["cupy-gma-gemm"]["status"] == "missed" and verdicts["numba-gma-gemm"]["status"] == "met"
    code, lines, verdicts = bg.judge(_rows(bg, True)[1:], simulated=False, full=True)
    assert code == 3 and lines[0] == "check: did not run: time within 2.5x of its own roofline (>= 40% of it) (not measured)"
    assert verdicts["numba-resp-roofline"] == {"status": "not run", "why": "not measured"}
    # a target missed and another not run: missed wins (1), both are named
    code, lines, verdicts = bg.judge(rows[1:], simulated=False, full=True)
    assert code == 1 and [v["status"] for v in verdicts.values()].count("not run") == 1
    assert bg.judge(_rows(bg, True)[1:], simulated=False, full=False)[0] == 0  # --quick sizes
    code, _, verdicts = bg.judge(_rows(bg, False), simulated=True, full=False)  # the simulator judges nothing
    assert code == 0 and {v["status"] for v in verdicts.values()} == {"not run"}


def test_each_row_states_its_bound_from_its_own_flops_and_bytes():
    bg = _bench_gpu()
    peaks = bg.device_peaks("NVIDIA H200")
    # the responsibilities at full size: 4 N K d FLOPs take 1.03 ms at 67 TFLOP/s, 4 N (d + K) bytes 0.28 ms at 4.8 TB/s
    row = bg.make_row("numba-cuda", "responsibilities", "", "full", 2e-3, *bg.responsibilities_counts(1 << 20, 256, 64), peaks=peaks)
    assert row["bound"] == "compute" and abs(row["roofline_s"] - 1.0257e-3) < 1e-6
    assert abs(row["roofline_fraction"] - row["roofline_s"] / 2e-3) < 1e-12
    # a copy-like row (few FLOPs a byte) is memory-bound
    row = bg.make_row("numba-cuda", "f", "", "n", 1.0, 4.8e12, 1e12, peaks=peaks)
    assert row["bound"] == "memory" and row["roofline_s"] == 1.0
    assert bg.make_row("numba-cuda", "f", "", "n", 1.0, 1, 1)["bound"] is None  # no peaks: no bound stated


@pytest.mark.parametrize("device", sorted(_load("bench_gpu").PEAKS))
def test_no_target_exceeds_the_ceiling_of_its_own_row(device):
    """Each target's ceiling computed from its row's FLOPs and bytes at the full sizes: a target above it cannot be met."""
    bg = _bench_gpu()
    ceilings = bg.target_ceilings(bg.PEAKS[device])
    assert set(ceilings) == set(bg.TARGETS) == set(bg.TARGET_SPECS)
    for tid, (value, ceiling, bound) in ceilings.items():
        kind = bg.TARGET_SPECS[tid][0]
        assert bg.reachable(kind, value, ceiling), f"{device}: {tid} asks {value} ({kind}), its ceiling is {ceiling:.3f} ({bound}-bound)"


def test_a_bandwidth_target_for_the_compute_bound_responsibilities_is_caught():
    """The target the bench once had: 50% of the H200's peak bandwidth, where the FLOPs cap the row at 27%."""
    bg = _bench_gpu()
    specs = dict(bg.TARGET_SPECS, **{"numba-resp-roofline": ("bandwidth", 0.5, "responsibilities", None)})
    original, bg.TARGET_SPECS = bg.TARGET_SPECS, specs
    try:
        value, ceiling, bound = bg.target_ceilings(bg.PEAKS["H200"])["numba-resp-roofline"]
    finally:
        bg.TARGET_SPECS = original
    assert bound == "compute" and 0.26 < ceiling < 0.28 and not bg.reachable("bandwidth", value, ceiling)
    assert bg.reachable("ratio_max", 2.0, 1.005) and not bg.reachable("ratio_max", 1.0, 1.005)
    assert bg.reachable("ratio_min", 10.0, 21.0) and not bg.reachable("ratio_min", 30.0, 21.0)


def test_bench_gpu_causal_and_bidirectional_gma_are_both_judged():
    bg = _bench_gpu()
    rows = [bg.make_row("numba-cuda", "gma_forward", v, "N=1", 1.0, 1, 1, target="numba-gma-gemm", measured=r, met=r <= 2)
            for v, r in (("bidirectional", 1.5), ("causal", 2.5))]
    code, lines, _ = bg.judge(rows, simulated=False, full=False)
    assert code == 1 and "numba-cuda gma_forward causal N=1" in lines[2]


def test_bench_gpu_refuses_bad_arguments_in_one_line(tmp_path):
    for args, message in ((["--json", str(tmp_path)], "is a folder"), (["--json", str(tmp_path / "no" / "x.json")], "does not exist"),
                          (["--repeats", "0"], "expected a whole number >= 1"), (["--peak-flops", "-1"], "expected a number > 0")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], (args, proc.stderr)


def test_bench_gpu_counts_cupy_launches_where_the_backend_has_a_counter():
    from types import SimpleNamespace

    bg = _bench_gpu()

    def counter():
        return 3

    assert bg._launch_counter(SimpleNamespace(launch_count=counter)) is counter
    assert bg._launch_counter(SimpleNamespace(_backend=SimpleNamespace(launch_count=counter))) is counter
    assert bg._launch_counter(SimpleNamespace()) is None
    assert bg._launch_counter(None) is None


def test_torch_baselines_import_without_torch_and_say_why():
    import importlib.util

    tb = _load("torch_baselines")
    ok, why = tb.available()
    assert ok == (importlib.util.find_spec("torch") is not None)
    assert why.startswith("torch ")


def test_torch_baselines_agree_with_the_reference():
    """Where torch is installed: SDPA, and GMA and OVQ in PyTorch eager, against refimpl in float64."""
    torch = pytest.importorskip("torch", reason="torch is not installed: the PyTorch baselines of bench_gpu.py are not run")
    import numpy as np

    from refimpl import attention, gma, gmm, ovq

    tb = _load("torch_baselines")
    rng = np.random.default_rng(1)
    N, K, d, d_v = 150, 5, 4, 3
    xq, xk, v, mu = (rng.standard_normal(s) for s in ((N, d), (N, d), (N, d_v), (K, d)))
    var = 0.5 + rng.random((K, d))
    w = rng.random(K)
    w /= w.sum()
    T = torch.from_numpy
    np.testing.assert_allclose(tb.responsibilities(T(xq), T(mu), T(var), T(w)).numpy(), gmm.responsibilities(xq, mu, var, w),
                               rtol=1e-12, atol=1e-14)
    for causal in (False, True):
        for chunk in (64, 7):
            np.testing.assert_allclose(tb.gma(T(xq), T(xk), T(v), T(mu), T(var), T(w), causal=causal, chunk_size=chunk).numpy(),
                                       gma.gma(xq, xk, v, mu, var, w, causal=causal, chunk_size=chunk), rtol=1e-10, atol=1e-12)
    q, k, vv = (rng.standard_normal((N, d)) for _ in range(3))
    for causal in (False, True):
        np.testing.assert_allclose(tb.sdpa(T(q), T(k), T(vv), causal).numpy(), attention.softmax_attention(q, k, vv, causal=causal),
                                   rtol=1e-10, atol=1e-12)
    for n_max, chunk in ((8, 16), (3, 4), (40, 10), (1, 5)):
        np.testing.assert_allclose(tb.ovq_attention(T(q), T(k), T(vv), max_size=n_max, chunk_size=chunk).numpy(),
                                   ovq.ovq_attention(q, k, vv, max_size=n_max, chunk_size=chunk), rtol=1e-10, atol=1e-12)


# --- gpu_model.py: an estimate from the compiled code and the declared work, never a timing --------------------------


def _pipes(total, fp32=0, alu=0, shared=0, mufu=0, mem=0):
    return {"fp32": fp32, "fp64": 0, "alu": alu, "mufu": mufu, "cvt": 0, "shared": shared, "mem": mem,
            "other": total - fp32 - alu - mufu - mem, "total": total}


def _static_row(kernel, total, flops, occupancy, body=None, regions=(), threads=256):
    """A per-kernel static row as gpu.sass.kernel_rows gives it, with the fields the model reads: a work loop of
    ``total`` instructions (half of them FFMA), ``flops`` useful FLOPs, 8 shared wavefronts; ``body`` instructions in
    the whole kernel (the work loop's and ``100`` more, 60 of them ALU, by default)."""
    pipes = _pipes(total, fp32=total // 2, shared=8)
    mix = {"total": total, "fp": total // 2}
    return {"kernel": kernel, "dtype": "float32", "loop": True, "work_loop": mix, "work_loop_flops": flops,
            "work_loop_depth": 3, "work_loop_arithmetic": total // 2, "work_loop_ffma": total // 2,
            "work_loop_wavefronts": 8, "work_loop_pipes": pipes, "occupancy": occupancy, "threads": threads,
            "registers": 32, "regions": list(regions), "body_pipes": body or _pipes(total + 100, fp32=total // 2, alu=60,
                                                                                        shared=8)}


def test_gpu_model_counts_each_pipe_at_its_own_rate():
    gm = _load("gpu_model")
    # 100 instructions, 80 FFMA, 10 wavefronts: the issue port (100 / 4 = 25 clocks) bounds the pass, not the FMA pipes
    # (80 / 4 = 20) nor shared memory (10 / 1)
    assert gm.pass_cycles(_pipes(100, fp32=80, shared=10)) == 25
    assert gm.pass_cycles(_pipes(100, fp32=40, shared=40)) == 40  # shared memory: one wavefront a clock
    assert gm.pass_cycles(_pipes(100, fp32=20, mufu=30)) == 60  # the special function unit: half a warp a clock
    assert gm.pass_cycles(_pipes(100, fp32=10, alu=70)) == 35  # integer and comparisons: two warps a clock
    assert gm.issue_efficiency(0.125) == 0.5 and gm.issue_efficiency(0.25) == 1.0


def test_gpu_model_estimate_of_a_kernel_on_a_hand_worked_row():
    gm, bg = _load("gpu_model"), _bench_gpu()
    from gpu import work

    case = dict(B=1, N=1 << 20, K=256, d=64)
    row = _static_row(gm.K_RESP, 100, 512, 0.5)
    est = gm.kernel_estimate(gm.K_RESP, case, {gm.K_RESP: row})
    # 2^36 FLOPs executed, 512 a pass: 2^36 / 512 / 32 = 4,194,304 warp passes of max(100 / 4, 50 / 4, 8) = 25 clocks
    # over 132 SMs at 1.98 GHz
    assert est["region_s"] == pytest.approx(4194304 * 25 / (132 * 1.98e9), rel=1e-12)
    # the epilogue: the body's 200 instructions less the work loop's, 60 of the 100 left ALU ones (30 clocks at 2 a
    # clock; 50 with the work loop's, at the issue port), once per warp (8 a block) per item (16,384 row tiles by 4
    # component tiles)
    assert est["epilogue_s"] == pytest.approx(16384 * 4 * 8 * 30 / (132 * 1.98e9), rel=1e-12)
    assert est["bytes"] == bg.responsibilities_counts(1 << 20, 256, 64)[0] and est["time_s"] == est["issue_s"]
    assert est["computed"] == work.KERNELS[gm.K_RESP].computed(case) == 1 << 36
    # a quarter of the occupancy: one warp a scheduler, a quarter of the clocks issue
    assert gm.kernel_estimate(gm.K_RESP, case, {gm.K_RESP: dict(row, occupancy=0.0625)})["region_s"] == pytest.approx(
        4 * est["region_s"], rel=1e-12)
    # padding is paid for: one more component costs a whole tile of 64 (five tiles for four)
    assert gm.kernel_estimate(gm.K_RESP, dict(case, K=257), {gm.K_RESP: row})["region_s"] == pytest.approx(
        5 / 4 * est["region_s"], rel=1e-12)


def test_gpu_model_counts_the_epilogue_outside_every_declared_region_of_a_kernel():
    gm = _load("gpu_model")
    # the flash kernel: two declared regions (q k^T at depth 3, P V at depth 2); its epilogue is what is in neither
    pv = {"depth": 2, "start": 0x400, "instructions": 40, "flops": 32, "arithmetic": 16, "ffma": 16, "wavefronts": 16,
          "pipes": _pipes(40, fp32=16, shared=16)}
    body = _pipes(300, fp32=100, alu=100, shared=30)
    row = _static_row(gm.K_FLASH, 60, 64, 0.5, body=body, regions=[pv], threads=512)
    case = dict(BH=1, N=4096, d=64, causal=False)
    qk = gm.kernel_estimate(gm.K_FLASH, case, {gm.K_FLASH: row})
    outside = gm.pass_cycles(_pipes(300 - 60 - 40, fp32=100 - 30 - 16, alu=100, shared=30 - 8 - 16))
    assert outside == 50  # 100 ALU instructions; the body's 300 at the issue port would take 75
    items = (4096 // 64) ** 2  # (query tile, key tile) pairs
    assert qk["epilogue_s"] == pytest.approx(items * 16 * outside / (132 * 1.98e9), rel=1e-12)
    assert gm.kernel_estimate(gm.K_PV, case, {gm.K_FLASH: row})["epilogue_s"] == 0  # counted once, with q k^T


def test_gpu_model_counts_the_code_of_each_call_as_often_as_it_runs():
    """OVQ's loop kernel is three device functions run at three rates: its predict items, each sequence's plan once a
    chunk, its merge items one a thread.  Split by call (gpu.sass.kernel_calls), each part is counted that often;
    unsplit, or split from other code, all of it once per warp per predict item (an overcount: the plan is the model's
    plan time besides)."""
    gm = _load("gpu_model")
    from gpu import work

    case = work.KERNELS[gm.K_OVQ].case
    loop = {"depth": 3, "start": 0x100, "instructions": 60, "flops": 128, "arithmetic": 30, "ffma": 30, "wavefronts": 8,
            "pipes": _pipes(60, fp32=30, shared=8)}
    parts = {"_predict_item": _pipes(300, fp32=30, shared=8), "_plan_chunk": _pipes(500), "_merge_item": _pipes(200),
             "kernel": _pipes(40)}
    body = _pipes(1040, fp32=30, shared=8)
    row = dict(_static_row(gm.K_OVQ, 60, 128, 0.25, body=body, regions=[loop], threads=128))
    split = dict(row, calls={"pipes": parts, "instructions": 1040, "region_calls": {str(0x100): "_predict_item"}})
    rate = 132 * 1.98e9  # 4 warps a scheduler at a quarter of the occupancy: every clock issues
    items = work.KERNELS[gm.K_OVQ].items(case)
    chunks = len(work.ovq_chunks(case["T"], case["n_max"], case["C"]))
    merges = sum(L for L, _ in work.ovq_chunks(case["T"], case["n_max"], case["C"])) * 3 * case["d"]
    # the predict item's 240 instructions besides its loop (60 clocks) and the kernel's 40 (10), 4 warps an item; the
    # plan's 500 (125) by the 4 warps of one block a chunk; the merge's 200 (50) once a warp of 32 items
    want = (items * 4 * (60 + 10) + chunks * 4 * 125 + merges / 32 * 50) / rate
    assert gm.kernel_estimate(gm.K_OVQ, case, {gm.K_OVQ: split})["epilogue_s"] == pytest.approx(want, rel=1e-12)
    whole = items * 4 * (1040 - 60) / 4 / rate
    assert gm.kernel_estimate(gm.K_OVQ, case, {gm.K_OVQ: row})["epilogue_s"] == pytest.approx(whole, rel=1e-12)
    other = dict(split, calls=dict(split["calls"], instructions=1041))  # a split of other code than the row's
    assert gm.kernel_estimate(gm.K_OVQ, case, {gm.K_OVQ: other})["epilogue_s"] == pytest.approx(whole, rel=1e-12)
    assert want < whole


def test_gpu_model_counts_the_responsibilities_epilogue_as_often_as_each_part_runs():
    """The responsibilities kernel's code split by call: a component tile's epilogue (absorb) once per (row tile,
    component tile), the lanes' tree log2(TX) times and each row's normalisation ceil(K / TX) times per row tile, the
    kernel's own code once per row tile; the last, partial stage only where d is not a multiple of DC, and the log
    form's normalisation only in log_responsibilities (code that does not run is not counted)."""
    gm = _load("gpu_model")
    from gpu import work
    from gpu.numba_cuda import gmm

    t = gmm.tile_constants(gmm.GPU_GEOMETRY)
    loop = {"depth": 3, "start": 0x100, "instructions": 60, "flops": 128, "arithmetic": 30, "ffma": 30, "wavefronts": 8,
            "pipes": _pipes(60, fp32=30, shared=8)}
    # float32 code only: a warp pass takes a quarter of its instructions in clocks
    parts = {"absorb": _pipes(400, fp32=400), "load_tail": _pipes(40, fp32=40), "stage_tail": _pipes(400, fp32=400),
             "combine": _pipes(80, fp32=80), "normalise": _pipes(40, fp32=40), "log_normalise": _pipes(20, fp32=20),
             "kernel": _pipes(60 + 240, fp32=30 + 240, shared=8)}
    total = sum(p["total"] for p in parts.values())
    body = _pipes(total, fp32=total - 30, shared=8)
    row = dict(_static_row(gm.K_RESP, 60, 128, 0.5, body=body, regions=[loop], threads=t["NT"]))
    split = dict(row, calls={"pipes": parts, "instructions": total, "region_calls": {str(0x100): "kernel"}})
    rate = 132 * 1.98e9  # at half the occupancy every clock issues
    warps = t["NT"] // 32

    def epilogue(N, K, d, log):
        case = dict(B=1, N=N, K=K, d=d, log=log)
        return gm.kernel_estimate(gm.K_RESP, case, {gm.K_RESP: split})["epilogue_s"]

    for N, K, d in ((1 << 20, 256, 64), (1000, 100, 60)):
        row_tiles = -(-N // t["TILE_ROWS"])
        items = row_tiles * -(-K // t["TILE_COMPS"])
        steps, entries = t["TX"].bit_length() - 1, -(-K // t["TX"])
        tail = items * (10 + 100) if d % t["DC"] else 0
        want = warps * (items * 100 + tail + row_tiles * (steps * 20 + entries * 10 + 60)) / rate
        assert epilogue(N, K, d, False) == pytest.approx(want, rel=1e-12)
        want_log = want + warps * row_tiles * entries * (5 - 10) / rate
        assert epilogue(N, K, d, True) == pytest.approx(want_log, rel=1e-12)
    assert work.KERNELS[gm.K_RESP].calls["stage_tail"][1](dict(B=1, N=64, K=64, d=64)) == 0


def test_gpu_model_counts_the_flash_kernels_per_block_code_once_a_block():
    """The flash kernel's place, start, q's staging (resident: d <= D_CHUNK) and the rows' results run once a block;
    the packed search only in a packed call; the kernel's own code (a key tile's) once per key tile.  Counted all per
    key tile, as an unsplit kernel is, the once-a-block code weighed as many times as a block has key tiles."""
    import numpy as np

    gm = _load("gpu_model")
    from gpu import work
    from gpu.numba_cuda import attention

    g = attention.GPU_GEOMETRY[np.dtype(np.float32)]
    qk = {"depth": 3, "start": 0x100, "instructions": 60, "flops": 128, "arithmetic": 30, "ffma": 30, "wavefronts": 8,
          "pipes": _pipes(60, fp32=30, shared=8)}
    parts = {"place": _pipes(80, fp32=80), "locate": _pipes(40, fp32=40), "start": _pipes(20, fp32=20),
             "stage_q": _pipes(100, fp32=100), "finish": _pipes(200, fp32=200),
             "kernel": _pipes(60 + 400, fp32=30 + 400, shared=8)}
    total = sum(p["total"] for p in parts.values())
    body = _pipes(total, fp32=total - 30, shared=8)
    row = dict(_static_row(gm.K_FLASH, 60, 128, 0.5, body=body, regions=[qk], threads=g.threads))
    split = dict(row, calls={"pipes": parts, "instructions": total, "region_calls": {str(0x100): "kernel"}})
    rate = 132 * 1.98e9
    warps = g.threads // 32
    for N, d, causal, packed in ((4096, 64, False, False), (1000, 64, True, True), (512, 128, False, False)):
        case = dict(BH=2, N=N, d=d, causal=causal, packed=packed)
        blocks = 2 * -(-N // g.tile_q) * max(1, -(-d // g.COLS))
        items = work.KERNELS[gm.K_FLASH].items(case)
        assert items > blocks
        chunks = -(-d // g.D_CHUNK)
        stages = chunks * (blocks if d <= g.D_CHUNK else items)
        want = warps * (blocks * (20 + 5 + 50 + (10 if packed else 0)) + stages * 25 + items * 100) / rate
        got = gm.kernel_estimate(gm.K_FLASH, case, {gm.K_FLASH: split})["epilogue_s"]
        assert got == pytest.approx(want, rel=1e-12)
        unsplit = gm.kernel_estimate(gm.K_FLASH, case, {gm.K_FLASH: row})["epilogue_s"]
        assert unsplit == pytest.approx(warps * items * (total - 60) / 4 / rate, rel=1e-12) and unsplit > got


def _declared_static_rows(gm):
    regions = {gm.K_ROWS: 2, gm.K_PV: 2}  # the regions declared at a depth other than the work loop's
    rows = []
    from gpu import work

    for key, w in work.KERNELS.items():
        name = w.kernel or key
        if any(r["kernel"] == name for r in rows):
            continue
        step_flops = 4 * work.declared(key)["step"]
        pv = [{"depth": 2, "start": 0x400, "instructions": 40, "flops": 4 * work.declared(k)["step"], "arithmetic": 16,
               "ffma": 16, "wavefronts": 16, "pipes": _pipes(40, fp32=16, shared=16)} for k in regions if
              (work.KERNELS[k].kernel or k) == name]
        rows.append(_static_row(name, 120, step_flops, 0.5, regions=pv))
    return rows


def test_gpu_model_json_covers_every_public_function_and_measures_nothing(tmp_path):
    import ast
    import json

    gm, bg = _load("gpu_model"), _bench_gpu()
    static = _declared_static_rows(gm)
    (tmp_path / "static.json").write_text(json.dumps(static))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_model.py"), "--static", str(tmp_path / "static.json"),
                           "--json", str(tmp_path / "model.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MODEL" in proc.stdout and "not a measurement" in proc.stdout
    report = json.loads((tmp_path / "model.json").read_text())
    assert "launch" in report["assumptions"] and report["device"]["clock_Hz"] == 1.98e9
    tree = ast.parse((ROOT / "gpu" / "numba_cuda" / "__init__.py").read_text())
    names = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__")
    public = {ast.literal_eval(e) for e in names.elts if ast.literal_eval(e)[0].islower()}
    rows = report["rows"]
    assert {r["function"] for r in rows} == public
    assert all(r["measured_s"] is None and r["measured_note"] == gm.NOT_MEASURED for r in rows)
    assert all(r["estimate_s"] is not None for r in rows)
    resp = next(r for r in rows if r["function"] == "responsibilities")
    nbytes, flops = bg.responsibilities_counts(1 << 20, 256, 64)
    assert (resp["bytes"], resp["flops"]) == (nbytes, flops)
    assert resp["roofline_s"] == pytest.approx(max(nbytes / 4.8e12, flops / 67e12))
    one = gm.kernel_estimate(gm.K_RESP, dict(B=1, N=1 << 20, K=256, d=64), {r["kernel"]: r for r in static})
    assert resp["estimate_s"] == pytest.approx(one["time_s"] + 2 * 20e-6, rel=1e-12)
    # GMA's forward writes and reads the responsibilities and the chunk states: more bytes than its inputs and output
    fwd = next(r for r in rows if r["function"] == "gma_forward" and r["size"].startswith("N=1048576"))
    assert fwd["intermediate_bytes"] > 2 * fwd["bytes"]
    # OVQ: 256 chunks in one launch after the unit rows' (20 microseconds each), three grid barriers a chunk (3 each)
    ovq = next(r for r in rows if r["function"] == "ovq_attention" and "BH" not in r["size"])
    assert ovq["launches"] == 2 and ovq["chunks"]["launch_s"] == pytest.approx(2 * 20e-6)
    assert ovq["chunks"]["sync_s"] == pytest.approx(3 * 256 * 3e-6)
    assert ovq["estimate_s"] > ovq["chunks"]["launch_s"] + ovq["chunks"]["plan_s"] + ovq["chunks"]["sync_s"] > 0
    # with a slow memory, a kernel's estimate is its memory time
    slow = gm.model_rows(static, device=dict(gm.H200, copy_bandwidth_Bps=1e9))
    resp = next(r for r in slow if r["function"] == "responsibilities")
    assert resp["estimate_s"] == pytest.approx(nbytes / 1e9 + 2 * 20e-6, rel=1e-12)


def test_every_variant_is_timed_in_its_own_process_in_alternating_order():
    """isolated.run_variants: one fresh process per variant and round, the order reversed every other round."""
    iso = _load("isolated")
    code = ("import json, os, sys, time; time.sleep(0.01); "
            "print('RESULT ' + json.dumps({'times': [float(os.getpid()), 1.0], 'user': 0.0, 'system': 0.0}))")
    seen = []

    def argv(name, calls):
        seen.append(name)
        return [sys.executable, "-c", code]

    t = iso.run_variants(["a", "b", "c"], argv, processes=2, calls=2, progress=False)
    assert seen == ["a", "b", "c", "c", "b", "a"]
    # each process reports its own pid as a time: six processes, six different pids (the best of each is 1.0 here)
    pids = [calls[0] for n in "abc" for calls in t.calls[n]]
    assert len(set(pids)) == 6 and all(b == [1.0, 1.0] for b in t.best.values())
    with pytest.raises(RuntimeError, match="without a result"):
        iso.run_variants(["x"], lambda name, calls: [sys.executable, "-c", "print('no result')"], processes=1, calls=1,
                         progress=False)


def test_bench_gpu_prints_the_estimate_beside_each_numba_time_at_full_sizes(tmp_path):
    import json

    gm, bg = _load("gpu_model"), _bench_gpu()
    keys = {(w[0], w[1], w[2]) for w in gm.workloads()}
    # the rows bench_gpu.py measures for gpu.numba_cuda at full sizes, named as it names them: each has its estimate
    N, K, d = bg.FULL["responsibilities"]
    measured = [("responsibilities", "", f"N={N} K={K} d={d}")]
    measured += [(fn, v, f"N={n} K={K} d_r=d_v={d}") for n in bg.FULL["gma"][0] for v in ("bidirectional", "causal")
                 for fn in ("gma_forward", "gma_backward")]
    measured += [("softmax_attention", "bidirectional", f"N={n} d={d}") for n in bg.FULL["attention"]]
    T, n_max, C = bg.FULL["ovq"]
    measured += [("softmax_attention", "causal", f"N={T} d={d}"), ("ovq_attention", "causal", f"T={T} N={n_max} C={C} d={d}")]
    assert set(measured) <= keys, set(measured) - keys
    (tmp_path / "model.json").write_text(json.dumps({"rows": [{"function": "responsibilities", "variant": "",
                                                               "size": measured[0][2], "estimate_s": 2.5e-3}]}))
    given = bg.Estimates(bg.parse_args(["--model", str(tmp_path / "model.json")]), full=True)
    assert given.table == {measured[0]: 2.5e-3} and "gpu_model.py" in given.note and given.proc is None
    row = bg.make_row("numba-cuda", *measured[0], 3e-3, *bg.responsibilities_counts(N, K, d), estimate=2.5e-3)
    table = bg.format_rows([row, bg.make_row("cupy", *measured[0], 3e-3, 1, 1, estimate=None)])
    assert "est. ms" in table.splitlines()[0] and "     3.000     2.500 " in table.splitlines()[1]
    assert bg.Estimates(bg.parse_args([]), full=False).table == {}


def test_bench_gpu_computes_the_estimates_beside_the_measurements_and_waits_for_them_a_bounded_time(tmp_path, monkeypatch):
    import json
    import subprocess

    bg = _bench_gpu()
    real = subprocess.Popen
    rows = [{"function": "responsibilities", "variant": "", "size": "N=1048576 K=256 d=64", "estimate_s": 2.5e-3}]
    write = f"import json, sys; json.dump({{'rows': {rows!r}}}, open(sys.argv[-1], 'w'))"

    def fake(cmd, **kw):  # gpu_model.py --json OUT, as a process that writes OUT at once (or sleeps)
        assert cmd[1].endswith("gpu_model.py") and cmd[2] == "--json" and kw["env"]["NUMBA_ENABLE_CUDASIM"] == "0"
        return real([cmd[0], "-c", program, cmd[3]], **kw)

    monkeypatch.setattr(subprocess, "Popen", fake)
    program = write
    est = bg.Estimates(bg.parse_args([]), full=True, folder=tmp_path)
    assert est.proc is not None and est.table == {}
    measured = bg.make_row("numba-cuda", "responsibilities", "", rows[0]["size"], 3e-3, 1, 1)
    other = bg.make_row("cupy", "responsibilities", "", rows[0]["size"], 3e-3, 1, 1)
    assert est.finish() == {("responsibilities", "", rows[0]["size"]): 2.5e-3}
    assert est.attach([measured, other]) == 1 and measured["estimate_s"] == 2.5e-3 and other["estimate_s"] is None
    program = "import time; time.sleep(30)"
    slow = bg.Estimates(bg.parse_args([]), full=True, folder=tmp_path)
    assert slow.finish(wait_s=0.5) == {} and "had not finished 0.5 s after" in slow.note and slow.proc is None
    program = "import sys; sys.exit('ptxas not found')"
    broken = bg.Estimates(bg.parse_args([]), full=True, folder=tmp_path / "none")
    assert broken.finish() == {} and "exited 1 (ptxas not found)" in broken.note
