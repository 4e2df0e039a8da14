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


# --- gpu_model.py: a model from the compiled code, never a timing -------------------------------------------------


def _static_row(kernel, total, flops, occupancy, dtype="float32"):
    """A per-kernel static row as gpu.sass.kernel_rows gives it, with the fields the model reads (one loop: hot = work)."""
    mix = {"total": total, "fp": flops // 2}
    return {"kernel": kernel, "dtype": dtype, "loop": True, "hot_loop": mix, "hot_loop_flops": flops,
            "work_loop": dict(mix), "work_loop_flops": flops, "work_loop_depth": 2, "occupancy": occupancy,
            "threads": 256, "registers": 32}


def test_gpu_model_issue_time_on_a_hand_worked_row():
    gm = _load("gpu_model")
    row = _static_row("gpu.numba_cuda.gmm._rows", 100, 50, 0.5)  # 2 instructions a FLOP, 8 warps a scheduler
    # 1e12 FLOPs x 2 / 32 threads = 6.25e10 warp instructions at 132 x 4 x 1.7e9 = 8.976e11 a second
    assert gm.issue_time(1e12, row) == pytest.approx(0.0696301, rel=1e-6)
    # 12.5% occupancy: 2 warps a scheduler, half of the 4 it needs to issue every cycle
    assert gm.issue_efficiency(0.125) == 0.5 and gm.issue_efficiency(0.25) == 1.0
    assert gm.issue_time(1e12, dict(row, occupancy=0.125)) == pytest.approx(2 * 0.0696301, rel=1e-6)


def test_gpu_model_picks_the_kernel_named_for_the_work():
    gm = _load("gpu_model")
    rows = [_static_row("gpu.numba_cuda.gmm._component_constants", 200, 80, 0.5),
            _static_row("gpu.numba_cuda.gmm._posterior_rows", 200, 16, 0.4),
            _static_row("gpu.numba_cuda.gmm._posterior_rows", 200, 16, 0.4, dtype="float64")]
    assert gm.main_kernel(rows, "gmm", "float32") is rows[1]  # named for the work, though it has fewer FLOPs
    assert gm.main_kernel(rows[:1], "gmm", "float32") is rows[0]  # none named: the most FLOPs
    assert gm.main_kernel(rows, "scan", "float32") is None
    # a part that names its kernel is paced by that kernel alone, though another of the module has more FLOPs
    gma_rows = [_static_row("gpu.numba_cuda.gma._responsibility_rows", 200, 16, 0.4),
                _static_row("gpu.numba_cuda.gma._parameter_partials", 200, 30, 0.4)]
    assert gm.main_kernel(gma_rows, "gma", "float32") is gma_rows[1]
    assert gm.main_kernel(gma_rows, "gma", "float32", "responsibility_rows") is gma_rows[0]
    assert gm.main_kernel(gma_rows[1:], "gma", "float32", "responsibility_rows") is None
    # the hot loop (an epilogue: 200 instructions, 100 raw FLOPs) is not the work loop (30 instructions, 20 useful
    # FLOPs): the work loop paces the part, at 1.5 instructions a FLOP, and picks the kernel
    flash = dict(_static_row("gpu.numba_cuda.attention._flash", 200, 100, 0.5), work_loop={"total": 30, "fp": 10},
                 work_loop_flops=20)
    assert gm.issue_time(1e12, flash) == pytest.approx(1.5 / 2 * 0.0696301, rel=1e-6)
    other = dict(_static_row("gpu.numba_cuda.attention._flash_other", 30, 30, 0.5))
    assert gm.main_kernel([flash, other], "attention", "float32") is other  # 30 useful FLOPs in its work loop, not 20
    no_work = dict(_static_row("gpu.numba_cuda.attention._flash", 100, 40, 0.5), work_loop_flops=0)
    assert gm.main_kernel([no_work], "attention", "float32") is None


def test_gpu_model_json_covers_every_public_function_and_measures_nothing(tmp_path):
    import ast
    import json

    gm, bg = _load("gpu_model"), _bench_gpu()
    static = [_static_row(f"gpu.numba_cuda.{m}._{name}", 120, 40, 0.5)
              for m, name in (("gmm", "posterior_rows"), ("scan", "chunk_states"), ("gma", "parameter_partials"),
                              ("attention", "flash_forward"))]
    (tmp_path / "static.json").write_text(json.dumps(static))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_model.py"), "--static", str(tmp_path / "static.json"),
                           "--json", str(tmp_path / "model.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MODEL" in proc.stdout and "not a measurement" in proc.stdout
    report = json.loads((tmp_path / "model.json").read_text())
    tree = ast.parse((ROOT / "gpu" / "numba_cuda" / "__init__.py").read_text())
    names = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__")
    public = {ast.literal_eval(e) for e in names.elts if ast.literal_eval(e)[0].islower()}
    rows = report["rows"]
    assert {r["function"] for r in rows} == public
    assert all(r["measured_s"] is None and r["measured_note"] == gm.NOT_MEASURED for r in rows)
    resp = next(r for r in rows if r["function"] == "responsibilities")
    nbytes, flops = bg.responsibilities_counts(1 << 20, 256, 64)
    assert (resp["bytes"], resp["flops"]) == (nbytes, flops)
    assert resp["roofline_s"] == pytest.approx(max(nbytes / 4.8e12, flops / 67e12))
    assert resp["issue_bound_s"] == pytest.approx(gm.issue_time(flops, static[0]))
    assert resp["predicted_s"] == max(resp["issue_bound_s"], nbytes / 4.3e12)
    ovq = next(r for r in rows if r["function"] == "ovq_attention")  # no ovq kernel in the static table: no prediction
    assert ovq["predicted_s"] is None and ovq["no_static_data"] == ["ovq"]
    # with a slow memory, the model is the memory time
    slow = gm.model_rows(static, device=dict(gm.H200, copy_bandwidth_Bps=1e9))
    resp = next(r for r in slow if r["function"] == "responsibilities")
    assert resp["predicted_s"] == nbytes / 1e9 and resp["predicted_bound"] == "memory"


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
