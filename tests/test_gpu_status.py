"""The gpu package says which backend is missing and how to install it, never silently None."""

import pytest

import gpu


def test_backend_status_reports_every_backend_with_a_reason():
    status = gpu.backend_status()
    assert set(status) == set(gpu.BACKENDS)
    for usable, why in status.values():
        assert isinstance(usable, bool) and why


def test_require_names_the_backend_and_the_fix(monkeypatch):
    monkeypatch.setattr(gpu, "_probe", lambda b: (False, "cupy cannot be imported; install the GPU extra"))
    with pytest.raises(RuntimeError, match="'cupy' is not available.*install"):
        gpu.require("cupy")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend: expected one of"):
        gpu.require("opencl")
