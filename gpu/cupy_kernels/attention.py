r"""Softmax attention with CuPy: :func:`refimpl.attention.softmax_attention`, for one sequence or a batch.

What it computes
----------------
``softmax(scale q k^T) v`` per sequence (entries ``j > i`` dropped when
causal): the ``N_q x N_k`` oracle the linear-time mechanisms are compared
with.

Launch plan
-----------
1. The scores ``q k^T`` of every sequence: one batched GEMM (``cupy.matmul``).
2. One fused row kernel (``attention.cu``, ``softmax_rows_*``), one warp per
   row: the scale, the causal mask, the row maximum (kept, for the check of
   overflowed rows) and the softmax, in place.
3. ``P v``: one batched GEMM.

The finite inputs (device arrays only) and the row maxima are counted into
the call's checks, copied to the host once at the end.

With NumPy the row kernel's twin is :func:`refimpl.tuned.softmax_rows`.
"""

from __future__ import annotations

import numpy as np

from refimpl import boundary, tuned
from refimpl.validation import check_finite, check_score_maxima

from ._backend import Checks, RawModuleSource, as_module_array, backend, is_device_array, launch, matmul, result, to_host

__all__ = ["softmax_attention"]

_CU = RawModuleSource("attention.cu", headers=("rows.cuh",))

#: Rows per block of the row kernel: one warp (32 threads) per row.
ROWS_PER_BLOCK = 8


def softmax_rows(xp, t, scale, n_q, causal):
    """Fused: score rows ``t`` (R, N_k) become ``softmax(scale t)`` (masked when causal), in place; returns the row maxima (R,).

    Row ``r`` is query ``r % n_q`` of its sequence.
    """
    R, Nk = t.shape
    row_max = xp.empty(R, dtype=t.dtype)

    def twin():
        t3 = t.reshape(-1, n_q, Nk)
        with np.errstate(over="ignore", invalid="ignore"):
            t3 *= t.dtype.type(scale)
        if causal:
            # entries j > i get -inf, so exp gives exactly 0 (the diagonal keeps every row non-empty)
            upper = np.triu_indices(n_q, k=1)
            t3[:, upper[0], upper[1]] = -np.inf
        row_max[...] = np.max(t, axis=1)
        tuned.softmax_rows(t)

    if R:
        f = t.dtype.type
        name = f"softmax_rows_{'f32' if t.dtype == np.float32 else 'f64'}"
        launch(_CU, name, (-(-R // ROWS_PER_BLOCK),), (32, ROWS_PER_BLOCK),
               (t, row_max, np.int64(R), np.int32(Nk), np.int32(n_q), f(scale), np.int32(bool(causal))), twin)
    return row_max


def _softmax_attention_kernel(xp, checked, given):
    """:func:`refimpl.attention.softmax_attention` on refimpl's checked arguments, computed with ``xp``; one copy to the host."""
    on_device = any(is_device_array(a) for a in given)
    hq, hk, hv, scale, causal, batch_shape = checked
    dtype = hq.dtype
    Nq, (Nk, dv) = hq.shape[-2], hv.shape[-2:]
    checks = Checks(xp, ["q", "k", "v", "row_max"])
    inputs = given
    q, k, v = (as_module_array(xp, a, dtype).reshape(-1, *a.shape[-2:]) for a in inputs)
    for original, a, name in zip(inputs, (q, k, v), "qkv"):
        if is_device_array(original):
            checks.count_bad(a, name)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = matmul(xp, q, k.swapaxes(1, 2))  # (B, N_q, N_k)
    row_max = softmax_rows(xp, scores.reshape(-1, Nk), scale, Nq, causal)
    checks.count_bad(row_max, "row_max")
    out = matmul(xp, scores, v)
    checks.fetch()
    for original, name in zip(inputs, "qkv"):
        if checks.failed(name):
            check_finite(to_host(original), name)
    if checks.failed("row_max"):
        check_score_maxima(to_host(row_max).reshape(batch_shape + (Nq,)))
    return result(out.reshape(batch_shape + (Nq, dv)), on_device)


#: softmax_attention bound to refimpl's boundary, which writes its signature, docstring and checks once.
KERNELS = {"softmax_attention": _softmax_attention_kernel}
softmax_attention = boundary.bind(backend(KERNELS), module=__name__).softmax_attention
