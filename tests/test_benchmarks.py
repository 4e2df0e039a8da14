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
        "responsibilities  N =",
        "fraction of peak memory bandwidth",
        "GMA forward and backward",
        "online-softmax attention",
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
