"""refimpl.boundary: every public function written once and bound to each backend's record of kernels.

What binding promises, whatever the backend: the reference's signature (so
Python words a wrong call alike), the reference's docstring with the
backend's words, a clear refusal of a function whose kernel is missing, and
one error, :func:`gpu.require`'s, when a backend cannot run here.  A new
backend needs only its record: the toy backend below (the reference's own
kernels through :func:`refimpl.boundary.host_kernels`) gets the whole API,
and ``tests/test_conformance.py`` holds it to the reference with the others.
"""

from __future__ import annotations

import inspect
import re
import types

import numpy as np
import pytest

from refimpl import boundary, gma, gmm
from refimpl.testing import TOL

#: The reference's own kernels as a backend record: nothing but the record.
TOY = boundary.Backend(
    "toy",
    "Computed by the reference's own kernels, bound through a record.",
    {**boundary.host_kernels(boundary.reference_posterior, gma._responsibility_backward), **boundary.linear_attention_kernels()},
)


def _bound_modules():
    """``(backend name, module)`` of every module whose public functions are bound from the boundary."""
    import importlib

    mods = [("refimpl.tuned", "refimpl.tuned"), ("cpu", "cpu.gmm"), ("cpu", "cpu.gma"), ("cpu", "cpu.attention"), ("cpu", "cpu.ovq"),
            ("gpu.numba_cuda", "gpu.numba_cuda.gmm"), ("gpu.numba_cuda", "gpu.numba_cuda.gma"),
            ("gpu.numba_cuda", "gpu.numba_cuda.attention"), ("gpu.numba_cuda", "gpu.numba_cuda.ovq"),
            ("gpu.cupy_kernels", "gpu.cupy_kernels.gmm"), ("gpu.cupy_kernels", "gpu.cupy_kernels.gma"),
            ("gpu.cupy_kernels", "gpu.cupy_kernels.attention"), ("gpu.cupy_kernels", "gpu.cupy_kernels.ovq")]
    out = []
    for backend, name in mods:
        if name.startswith("cpu") or "numba_cuda" in name:
            pytest.importorskip("numba")
        out.append((backend, importlib.import_module(name)))
    return out


def test_every_bound_function_has_the_reference_signature_and_docstring():
    seen = set()
    for backend, module in _bound_modules():
        for name, (_, reference, _) in boundary.FUNCTIONS.items():
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "backend", None) is None:
                continue
            seen.add((backend, name))
            assert fn.backend.name == backend and fn.__module__ == module.__name__
            assert inspect.signature(fn) == inspect.signature(reference), (module.__name__, name)
            doc = fn.__doc__
            # the reference's summary, then the backend's paragraph naming the function it mirrors
            assert doc.splitlines()[0] == inspect.getdoc(reference).splitlines()[0]
            assert f":func:`{reference.__module__}.{reference.__name__}`" in doc.replace("\n", " ")
            # every parameter described, or the reference's pointer to the function of the same module that describes them
            described = {n for m in re.finditer(r"^([\w, ]+?)(?: : |\n)", doc, re.M) for n in m.group(1).split(", ")}
            pointer = re.search(r"Parameters are those of :func:`(\w+)`", doc)
            assert set(inspect.signature(reference).parameters) <= described or (pointer and hasattr(module, pointer.group(1))), (
                module.__name__, name)
    # the four backends bind every function they share with the reference: cpu all of them
    gmm_gma = {"responsibilities", "log_responsibilities", "gma", "gma_forward", "gma_backward"}
    assert {n for b, n in seen if b == "refimpl.tuned"} == gmm_gma
    assert {n for b, n in seen if b == "cpu"} == set(boundary.FUNCTIONS)
    for b in ("gpu.numba_cuda", "gpu.cupy_kernels"):
        assert {n for b2, n in seen if b2 == b} == gmm_gma | {"softmax_attention", "ovq_attention", "vq_attention"}, b


def test_a_wrong_call_is_worded_as_for_the_reference():
    toy, x = boundary.bind(TOY), np.zeros((2, 2))
    for call in (lambda m: m.gma(x, x, x, x, x, x, x), lambda m: m.responsibilities(x, x, x),
                 lambda m: m.gma(x, x, x, x, x, x, causal=True, bad=1)):
        with pytest.raises(TypeError) as ref:
            call(types.SimpleNamespace(gma=gma.gma, responsibilities=gmm.responsibilities))
        with pytest.raises(TypeError) as got:
            call(toy)
        assert str(got.value) == str(ref.value)


def test_binding_a_function_without_its_kernel_is_refused():
    with pytest.raises(ValueError, match="backend 'toy' has no kernel for softmax_attention"):
        boundary.bind(TOY, ["gma", "softmax_attention"])
    assert set(vars(boundary.bind(TOY))) == {"responsibilities", "log_responsibilities", "gma", "gma_forward", "gma_backward",
                                             "linear_attention", "linear_attention_forward", "linear_attention_backward"}


def test_the_toy_backend_is_the_reference():
    """The record alone: the reference's kernels through the boundary give the reference's results, bit for bit."""
    toy = boundary.bind(TOY)
    rng = np.random.default_rng(0)
    x, means = rng.normal(size=(7, 3)), rng.normal(size=(4, 3))
    variances, weights = rng.uniform(0.5, 2, size=(4, 3)), rng.dirichlet(np.ones(4))
    assert np.array_equal(toy.responsibilities(x, means, variances, weights), gmm.responsibilities(x, means, variances, weights))
    np.testing.assert_allclose(toy.log_responsibilities(x, means, variances, weights),
                               gmm.log_responsibilities(x, means, variances, weights), **TOL[np.float64])
    args = [rng.normal(size=s) for s in ((2, 5, 3), (2, 5, 3), (2, 5, 2), (4, 3), (4, 3), (4,))]
    out, cache = toy.gma_forward(*args, causal=True, chunk_size=2)
    ref_out, ref_cache = gma.gma_forward(*args, causal=True, chunk_size=2)
    assert np.array_equal(out, ref_out)
    g = rng.normal(size=out.shape)
    for a, b in zip(toy.gma_backward(g, cache), gma.gma_backward(g, ref_cache)):
        assert np.array_equal(a, b)


def test_a_backend_that_cannot_run_says_how_to_get_it(monkeypatch):
    """The error of a call is :func:`gpu.require`'s, word for word: the reason, the extra, nvidia-smi, the simulator."""
    import gpu
    from gpu.cupy_kernels import _backend

    ok, _ = _backend.probe()
    if ok:
        pytest.skip("a CUDA device is usable here: the error without one cannot be shown")
    import gpu.cupy_kernels as ck

    with pytest.raises(RuntimeError) as want:
        gpu.require("cupy")
    x = np.zeros((2, 2))
    for call in (lambda: ck.responsibilities(x, x, np.ones((2, 2)), np.full(2, 0.5)), lambda: ck.softmax_attention(x, x, x),
                 lambda: ck.ovq_attention(x, x, x, max_size=2, chunk_size=2), lambda: ck.vq_attention(x, x, x, x, chunk_size=2)):
        with pytest.raises(RuntimeError) as got:
            call()
        assert str(got.value) == str(want.value)
    assert all(word in str(want.value) for word in ("[cuda12]", "[cuda13]", "nvidia-smi", "simulator"))


def test_numba_cuda_without_a_device_or_the_simulator_says_how_to_get_it(monkeypatch):
    pytest.importorskip("numba")
    import gpu
    from gpu.numba_cuda import _device

    import gpu.numba_cuda as nc

    monkeypatch.setattr(_device, "_READY", [])
    monkeypatch.setattr(gpu, "_probe", lambda backend: (False, "numba.cuda found no CUDA device"))
    with pytest.raises(RuntimeError) as want:
        gpu.require("numba-cuda")
    with pytest.raises(RuntimeError) as got:
        nc.gma(*(np.zeros((2, 2)),) * 4, np.ones((2, 2)), np.full(2, 0.5))
    assert str(got.value) == str(want.value) and "simulator" in str(got.value)
