"""cpu.attention's softmax attention (online softmax, Numba): what is its own beyond tests/test_conformance.py.

Its outputs, gradients, refusals, dtypes and bits with one thread or two are
held to refimpl.attention in tests/test_conformance.py.  Here: a late tile
whose scores rescale the earlier ones, strided inputs, its batched
``grad_out`` and cache messages, and no ``N x N`` memory.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpu import attention as C
from cpu.attention import TILE
from refimpl import attention as R


def qkv(batch, N_q, N_k, d, d_v, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=batch + shape).astype(dtype) for shape in ((N_q, d), (N_k, d), (N_k, d_v)))


def reference_grads(q, k, v, g, **kw):
    """refimpl's gradients."""
    return R.softmax_attention_backward(g, R.softmax_attention_forward(q, k, v, **kw)[1])


def assert_close(got, ref, tol):
    """Every entry within ``tol`` relative to itself or to the largest entry of ``ref`` (outputs near 0 cancel)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.max(np.abs(ref), initial=0.0))


def test_a_late_tile_with_much_larger_scores_rescales_the_earlier_ones():
    """The maximum jumps by hundreds in the third tile: exp(m - m') underflows to 0 and the first tiles drop out."""
    q, k, v = qkv((), 9, 3 * TILE + 5, 4, 3, seed=6)
    k[2 * TILE + 3] = 60 * q.mean(axis=0)
    k[5] = -60 * q.mean(axis=0)
    g = np.random.default_rng(7).normal(size=(9, 3))
    out, cache = C.softmax_attention_forward(q, k, v, scale=1.0)
    assert_close(out, R.softmax_attention(q, k, v, scale=1.0), 1e-13)
    for got, ref in zip(C.softmax_attention_backward(g, cache), reference_grads(q, k, v, g, scale=1.0)):
        assert_close(got, ref, 1e-13)


def test_strided_inputs_give_the_contiguous_results():
    """(B, N, H, d_h) projections viewed as (B, H, N, d_h): the model's call."""
    q, k, v = (np.random.default_rng(9).normal(size=(2, 2 * TILE + 1, 3, 8)).transpose(0, 2, 1, 3) for _ in range(3))
    g = np.random.default_rng(10).normal(size=q.shape)
    out, cache = C.softmax_attention_forward(q, k, v, causal=True)
    out_c, cache_c = C.softmax_attention_forward(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True)
    np.testing.assert_array_equal(out, out_c)
    for a, b in zip(C.softmax_attention_backward(g, cache), C.softmax_attention_backward(np.ascontiguousarray(g), cache_c)):
        np.testing.assert_array_equal(a, b)


def test_batched_grad_out_of_another_shape_is_refused_naming_the_expected_one():
    q, k, v = qkv((2,), 4, 4, 3, 2, seed=13)
    _, cache = C.softmax_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(\.\.\., N_q, d_v\) = \(2, 4, 2\), got \(2, 4, 3\)"):
        C.softmax_attention_backward(np.ones((2, 4, 3)), cache)


def test_backward_refuses_a_cache_of_another_type():
    q, k, v = qkv((), 4, 4, 3, 2, seed=14)
    _, ref_cache = R.softmax_attention_forward(q, k, v)
    with pytest.raises(TypeError) as got:
        C.softmax_attention_backward(np.ones((4, 2)), ref_cache)
    assert str(got.value) == "cache: expected the OnlineSoftmaxCache from cpu.attention.softmax_attention_forward, got SoftmaxAttentionCache"


def _peak_rss_increase(fn):
    """Bytes of resident memory that ``fn()`` adds at its peak (Linux: VmHWM reset through clear_refs)."""

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident memory")
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


def test_forward_and_backward_make_no_n_by_n_allocation():
    N = 4096
    q, k, v = qkv((), N, N, 16, 16, seed=19)
    g = np.random.default_rng(20).normal(size=(N, 16))
    _, cache = C.softmax_attention_forward(q[:100], k[:100], v[:100], causal=True)  # compiled or loaded beforehand
    C.softmax_attention_backward(g[:100], cache)
    square = N * N * 8
    holder = {}
    grew = _peak_rss_increase(lambda: holder.update(fwd=C.softmax_attention_forward(q, k, v, causal=True)))
    assert grew < square / 16, f"the forward grew the resident memory by {grew} bytes (N x N float64 is {square})"
    grew = _peak_rss_increase(lambda: C.softmax_attention_backward(g, holder["fwd"][1]))
    assert grew < square / 16, f"the backward grew the resident memory by {grew} bytes (N x N float64 is {square})"
    # the measurement sees an N x N array when there is one
    assert _peak_rss_increase(lambda: np.ones((N, N)).sum()) > square * 0.9


@pytest.mark.parametrize("causal", [True, False])
def test_a_packed_linear_attention_call_is_one_scan_call_whatever_the_number_of_sequences(causal, monkeypatch):
    """The packed kernel: one token-by-token contraction over every (head, sequence) forward, three backward, never
    the unpacked kernel per sequence; the loop's results (the same bits when causal: the same sums in the same order)."""
    from cpu import scan as cpu_scan
    from refimpl import varlen

    offsets = np.array([0, 0, 5, 6, 6, 8, 16, 16, 23])
    rng = np.random.default_rng(14)
    q, k, v = (rng.normal(size=(23, 2, n)) for n in (3, 3, 4))
    calls = []
    contract = cpu_scan.prefix_contract
    monkeypatch.setattr(cpu_scan, "prefix_contract", lambda *a, **kw: (calls.append("prefix_contract"), contract(*a, **kw))[1])
    kernels = C.linear_attention_forward.backend.kernels
    for key in ("linear_attention_forward", "packed linear_attention_forward"):
        monkeypatch.setitem(kernels, key, lambda *a, _k=key, _f=kernels[key]: (calls.append(_k), _f(*a))[1])
    out, cache = C.linear_attention_forward(q, k, v, causal=causal, cu_seqlens=offsets)
    assert calls == ["packed linear_attention_forward", "prefix_contract"]
    calls.clear()
    grads = C.linear_attention_backward(np.ones_like(out), cache)
    assert calls == ["prefix_contract"] * 3
    monkeypatch.delitem(kernels, "packed linear_attention_forward")  # the loop: one unpacked call per sequence
    calls.clear()
    out_loop, cache_loop = C.linear_attention_forward(q, k, v, causal=causal, cu_seqlens=offsets)
    assert isinstance(cache_loop, varlen.PackedCache) and calls.count("linear_attention_forward") == 5
    for got, want in zip([out, *grads], [out_loop, *C.linear_attention_backward(np.ones_like(out), cache_loop)], strict=True):
        assert np.array_equal(got, want) if causal else np.allclose(got, want, rtol=1e-13, atol=1e-15)


def _softmax_packed_and_loop(q, k, v, g, offsets, monkeypatch, **kw):
    """The packed forward, output and backward of cpu.attention's softmax attention, then the same by the loop (the
    packed kernels set aside); the names of the kernels each ran."""
    calls = []
    for name in ("_forward_kernel", "_dq_kernel", "_dkdv_kernel"):
        kernel = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, _k=name, _f=kernel: (calls.append(_k), _f(*a))[1])
    kernels = C.softmax_attention_forward.backend.kernels
    for key in ("softmax_attention", "softmax_attention_forward", "packed softmax_attention", "packed softmax_attention_forward"):
        monkeypatch.setitem(kernels, key, lambda *a, _k=key, _f=kernels[key]: (calls.append(_k), _f(*a))[1])
    results = []
    for packed in (True, False):
        if not packed:  # the loop: one unpacked call per sequence
            monkeypatch.delitem(kernels, "packed softmax_attention")
            monkeypatch.delitem(kernels, "packed softmax_attention_forward")
        out, cache = C.softmax_attention_forward(q, k, v, **kw, cu_seqlens=offsets)
        arrays = [out, C.softmax_attention(q, k, v, **kw, cu_seqlens=offsets), *C.softmax_attention_backward(g, cache)]
        results.append((list(calls), arrays))
        calls.clear()
    return results


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("heads", [False, True], ids=["2d", "heads"])
def test_a_packed_softmax_attention_call_is_one_kernel_call_the_loops_results_bit_for_bit(heads, dtype, causal, monkeypatch):
    """The packed kernels: every (head, sequence) in one call of the forward kernel, and of each backward pass, never
    the unpacked call per sequence, the tokens left packed; the loop's outputs and gradients to the last bit (each row
    the same sums in the same order).  Empty sequences, one of length 1, one of two tiles and one of two blocks."""
    offsets = np.array([0, 0, 5, 6, 6, 6 + TILE + 3, 6 + TILE + 3, 6 + TILE + 3 + 40])
    rng = np.random.default_rng(15)
    lead = (offsets[-1], 3) if heads else (offsets[-1],)
    q, k, v, g = (rng.normal(size=lead + (n,)).astype(dtype) for n in (5, 5, 3, 3))
    (calls, packed), (loop_calls, loop) = _softmax_packed_and_loop(q, k, v, g, offsets, monkeypatch, causal=causal, scale=0.8)
    assert calls == ["packed softmax_attention_forward", "_forward_kernel", "packed softmax_attention", "_forward_kernel",
                     "_dq_kernel", "_dkdv_kernel"], calls
    assert loop_calls.count("softmax_attention_forward") == 4 and loop_calls.count("_dq_kernel") == 4, loop_calls
    for got, want in zip(packed, loop, strict=True):
        assert got.dtype == dtype and got.shape == want.shape and np.array_equal(got, want)


def test_a_packed_call_whose_scores_overflow_is_refused_as_the_loop_refuses_it(monkeypatch):
    """An overflowed row: the packed kernel leaves the call to the loop, whose message names the row in its sequence."""
    offsets = [0, 3, 7, 9]
    q, k, v = qkv((), 9, 9, 2, 2, seed=16)
    q[5], k[4] = [1e200, 0.0], [1e200, 0.0]  # row 2 of sequence 1 scores inf against its key 1
    messages = []
    for native in (True, False):
        if not native:
            monkeypatch.delitem(C.softmax_attention_forward.backend.kernels, "packed softmax_attention_forward")
        with np.errstate(over="ignore", invalid="ignore"), pytest.raises(ValueError) as got:
            C.softmax_attention_forward(q, k, v, cu_seqlens=offsets)
        messages.append(str(got.value))
    assert messages[0] == messages[1] and "row 2" in messages[0], messages


def test_a_packed_backward_refuses_grad_out_as_the_loop_does(monkeypatch):
    q, k, v = qkv((), 9, 9, 4, 3, seed=17)
    messages = []
    for native in (True, False):
        if not native:
            monkeypatch.delitem(C.softmax_attention_forward.backend.kernels, "packed softmax_attention_forward")
        _, cache = C.softmax_attention_forward(q, k, v, cu_seqlens=[0, 4, 9])
        for bad in (np.ones((9, 4)), np.ones((1, 9, 3)), np.ones((9, 1, 3)), "g"):
            with pytest.raises((TypeError, ValueError)) as got:
                C.softmax_attention_backward(bad, cache)
            messages.append(f"{got.type.__name__}: {got.value}")
    assert messages[:4] == messages[4:], messages
