"""The `python -m refimpl verify` main job and its registry."""

import subprocess
import sys

import numpy as np
import pytest

from refimpl import verify
from refimpl.__main__ import main


def test_every_registered_check_passes():
    results = verify.run_checks()
    assert len(results) >= 8
    failed = [(r.name, r.error, r.tol, r.exception) for r in results if not r.passed]
    assert not failed, failed


def test_required_foundation_checks_are_registered():
    names = set(verify.registry())
    for required in (
        "gmm.responsibilities_rows_and_direct",
        "gmm.stability_1e4_1e-8",
        "gmm.em_step_equals_newton_step",
        "gmm.online_mean_equals_batch_mean",
        "gmm.em_never_increases_nll",
    ):
        assert required in names


def test_a_failing_or_crashing_check_is_reported_and_sets_the_exit_code(monkeypatch, capsys):
    # registry() imports the checks first: imported into the copy, they would be lost for the tests that follow
    monkeypatch.setattr(verify, "_REGISTRY", verify.registry())
    verify.register("zz.too_big", "an error above its tolerance", tol=1e-3)(lambda: 1.0)
    verify.register("zz.nan", "a NaN error never passes", tol=1.0)(lambda: float("nan"))

    def boom():
        raise ArithmeticError("broken derivation")

    verify.register("zz.crash", "an exception is a failure", tol=1.0)(boom)
    assert main(["verify", "-k", "zz.*"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 3 and "ArithmeticError: broken derivation" in out
    assert "0/3 checks passed" in out


def test_duplicate_names_and_bad_tolerances_are_refused(monkeypatch):
    monkeypatch.setattr(verify, "_REGISTRY", verify.registry())
    verify.register("zz.once", "first", tol=1.0)(lambda: 0.0)
    with pytest.raises(ValueError, match="already registered"):
        verify.register("zz.once", "second", tol=1.0)(lambda: 0.0)
    with pytest.raises(ValueError, match="tol"):
        verify.register("zz.bad", "negative", tol=-1.0)


def test_command_line_prints_the_table_and_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "refimpl", "verify", "-k", "gmm.*"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header == ["check", "verifies", "max", "error", "tolerance", "result"]
    assert "FAIL" not in proc.stdout


def test_unknown_pattern_exits_two(capsys):
    assert main(["verify", "-k", "no-such-check*"]) == 2


def test_checks_are_deterministic():
    a = {r.name: r.error for r in verify.run_checks("gmm.*")}
    b = {r.name: r.error for r in verify.run_checks("gmm.*")}
    assert a == b and all(np.isfinite(v) for v in a.values())


def test_list_honours_the_pattern(capsys):
    assert main(["verify", "--list", "-k", "gmm.*"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed and all(name.startswith("gmm.") for name in listed)
    assert set(listed) == {n for n in verify.registry() if n.startswith("gmm.")}
    assert main(["verify", "--list", "-k", "no-such-check"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no check matches 'no-such-check'" in captured.err


def test_json_holds_every_error_to_the_last_digit(capsys):
    import json

    assert main(["verify", "-k", "gmm.*", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    expected = {r.name: r for r in verify.run_checks("gmm.*")}
    assert [r["check"] for r in records] == list(expected)
    for r in records:
        assert float(r["error"]) == expected[r["check"]].error  # repr round-trips the float exactly
        assert r["tolerance"] == expected[r["check"]].tol and r["passed"] is True
