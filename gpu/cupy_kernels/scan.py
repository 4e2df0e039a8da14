r"""The normalised feature-map scan of :mod:`refimpl.scan` with CuPy: GEMMs for the states, one kernel for the chunks.

What it computes
----------------
For ``S`` sequences at once, nonnegative features ``phi_q (S, N_q, F)``,
``phi_k (S, N_k, F)`` and values ``v (S, N_k, d_v)``:
``O = D^{-1} A V`` with ``A = Phi_Q Phi_K^T`` (its lower triangle when
causal) and ``D = diag(A 1 + eps)``, and its backward, as
:func:`refimpl.scan.scan_forward` and :func:`refimpl.scan.scan_backward`
(with the column of ones appended to the values, so that the normaliser
rides along as one more value column).

Launch plan
-----------
Bidirectional: two batched GEMMs forward (the write ``[S, z] = Phi_K^T [V, 1]``,
the read ``Phi_Q [S, z]``), five backward.  Causal, with chunks of ``C``
tokens (the sequences padded with zero rows to a multiple of ``C``):

1. The per-chunk states ``Phi_{K,c}^T [V_c, 1]`` (S, n_c, F, d_v + 1): one batched GEMM.
2. Their exclusive prefix sum over the chunks (``cumsum``): the state each chunk starts from.
3. The carried term ``Phi_{Q,c} [S, z]_{c-1}``: one batched GEMM.
4. The masked ``C x C`` blocks (``scan.cu``, ``chunk_lower_*`` / ``chunk_upper_*``):
   one kernel adds ``tril(Phi_{Q,c} Phi_{K,c}^T) [V_c, 1]`` to the result of 3,
   tiled through shared memory (``TILE x TILE`` scores at a time).

The backward is the same three steps twice (a forward sweep for ``dPhi_Q``,
the reverse prefix sums for ``dPhi_K`` and ``dV``).  With NumPy the chunk
kernel's twin forms the masked blocks by batched matrix products.
"""

from __future__ import annotations

import numpy as np

from ._backend import RawModuleSource, Reduction, launch, matmul

__all__: list = []

_CU = RawModuleSource("scan.cu")

#: Rows and columns of the chunk kernel's tiles (``TILE`` in ``scan.cu``); blocks of ``TILE x 8`` threads.
TILE = 32

#: sum_j a_j b_j along the last axis: the row dot products ``g_i . out_i`` (scan backward) and ``gamma_i . g_i`` (GMA backward).
row_dot = Reduction(
    "row_dot", "T x, T w", "T y", "x * w", "a + b", "y = a", "0",
    twin=lambda a, b, axis=-1: np.sum(a * b, axis=axis),
)


def _suffix(dtype) -> str:
    return "f32" if np.dtype(dtype) == np.float32 else "f64"


def chunk_tri(xp, A, B, C, out, chunk, upper):
    """Fused: ``out_t += sum_{j in chunk(t), j <= t} (A_t . B_j) C_j`` (``j >= t`` with ``upper``), in place.

    ``A, B`` (S, N, F), ``C`` and ``out`` (S, N, W), ``N`` a multiple of
    ``chunk``; each array's last axis is contiguous and its sequences are
    ``N`` rows apart (a column slice of a contiguous array is fine).
    """
    S, N, F = A.shape
    W = C.shape[2]
    if S * N == 0 or W == 0:
        return out
    nc = N // chunk
    shape4 = lambda a: a.reshape(S, nc, chunk, a.shape[2])

    def twin():
        with np.errstate(over="ignore", invalid="ignore"):
            block = np.matmul(shape4(A), shape4(B).swapaxes(-1, -2))  # (S, n_c, C, C): A_t . B_j
        keep = np.triu(np.ones((chunk, chunk), dtype=bool)) if upper else np.tri(chunk, dtype=bool)
        np.copyto(block, 0, where=~keep)  # set to 0, not multiplied: inf * 0 is NaN
        shape4(out)[...] += np.matmul(block, shape4(C))

    item = A.dtype.itemsize
    lds = [a.strides[1] // item for a in (A, B, C, out)]
    if xp is not np:
        for a, ld in zip((A, B, C, out), lds):
            if a.strides[2] != item or a.strides[0] != N * ld * item:
                raise ValueError("chunk_tri: each array needs a contiguous last axis and sequences N rows apart")
    tiles = -(-chunk // TILE)
    grid = (S * nc * tiles, -(-W // TILE))
    launch(_CU, f"chunk_{'upper' if upper else 'lower'}_{_suffix(A.dtype)}", grid, (TILE, 8),
           (A, B, C, out, np.int64(N), np.int32(F), np.int32(W), *(np.int64(ld) for ld in lds), np.int32(chunk)), twin)
    return out


def _with_ones(xp, v, rows=None):
    """``[v, 1]`` (S, rows, d_v + 1), zero rows below the ``N`` of ``v`` when ``rows > N`` (padding)."""
    S, N, dv = v.shape
    rows = N if rows is None else rows
    out = xp.zeros((S, rows, dv + 1), dtype=v.dtype)
    out[:, :N, :dv] = v
    out[:, :N, dv] = 1
    return out


def _padded(xp, a, rows):
    """``a`` (S, N, w) with zero rows appended up to ``rows`` (no copy when ``rows == N``)."""
    S, N, w = a.shape
    if rows == N:
        return xp.ascontiguousarray(a)
    out = xp.zeros((S, rows, w), dtype=a.dtype)
    out[:, :N] = a
    return out


def _chunks(a, chunk):
    """(S, N, w) -> (S, N / chunk, chunk, w), a view."""
    S, N, w = a.shape
    return a.reshape(S, N // chunk, chunk, w)


def _exclusive_prefix(xp, states, reverse=False):
    """``sum_{c' < c} states_c'`` along axis 1 (``c' > c`` with ``reverse``): the state each chunk starts from."""
    out = xp.zeros_like(states)
    if states.shape[1] > 1:
        if reverse:
            out[:, :-1] = xp.cumsum(states[:, ::-1], axis=1)[:, ::-1][:, 1:]
        else:
            out[:, 1:] = xp.cumsum(states[:, :-1], axis=1)
    return out


def _chunk_layout(n, chunk_size):
    chunk = max(1, min(chunk_size, n))
    return chunk, -(-n // chunk) * chunk


def scan_forward_xp(xp, phi_q, phi_k, v, causal, eps, chunk_size):
    """Core: ``(out (S, N_q, d_v), den (S, N_q))`` of :func:`refimpl.scan.scan_forward` for ``S`` sequences; no raise."""
    S, N, F = phi_k.shape
    dtype = phi_q.dtype
    with np.errstate(over="ignore", invalid="ignore"):
        if not causal:
            # (Phi_Q Phi_K^T) [V, 1] = Phi_Q (Phi_K^T [V, 1]): an F x (d_v + 1) memory instead of an N x N matrix
            s1 = matmul(xp, phi_k.swapaxes(1, 2), _with_ones(xp, v))
            num = matmul(xp, phi_q, s1)
        else:
            chunk, rows = _chunk_layout(N, chunk_size)
            pq, pk, v1 = _padded(xp, phi_q, rows), _padded(xp, phi_k, rows), _with_ones(xp, v, rows)
            # [S, z] after each chunk c: S += phi_k_c^T [v_c, 1]; each chunk starts from the sum over the chunks before
            prev = _exclusive_prefix(xp, matmul(xp, _chunks(pk, chunk).swapaxes(-1, -2), _chunks(v1, chunk)))
            num = matmul(xp, _chunks(pq, chunk), prev).reshape(S, rows, v1.shape[2])
            # + tril(Phi_Q,c Phi_K,c^T) [V_c, 1], the masked block within the chunk
            chunk_tri(xp, pq, pk, v1, num, chunk, upper=False)
            num = num[:, :N]
        den = num[..., -1] + dtype.type(eps)
        out = num[..., :-1] / den[..., None]  # den = 0 only with eps = 0: the caller refuses it
    return out, den


def scaled_grads_xp(xp, g, out, den):
    """``[G / den, delta]`` with ``delta_i = -(g_i . out_i) / den_i``, ``(S, N_q, d_v + 1)``."""
    S, N, dv = g.shape
    g1 = xp.empty((S, N, dv + 1), dtype=g.dtype)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        xp.divide(g, den[..., None], out=g1[..., :dv])
        # out_i = num_i / den_i: d den_i = -(g_i . num_i) / den_i^2 = -(g_i . out_i) / den_i
        g1[..., dv] = -row_dot(g, out) / den
    return g1


def scan_backward_xp(xp, g, phi_q, phi_k, v, out, den, causal, chunk_size):
    """Core: ``(dphi_q, dphi_k, dv)`` of :func:`refimpl.scan.scan_backward` for ``S`` sequences; no raise."""
    S, N, F = phi_k.shape
    g1 = scaled_grads_xp(xp, g, out, den)  # [gn, delta]: gn_t . v_j + delta_t = g1_t . [v_j, 1]
    with np.errstate(over="ignore", invalid="ignore"):
        if not causal:
            v1 = _with_ones(xp, v)
            s1 = matmul(xp, phi_k.swapaxes(1, 2), v1)  # [S, z]
            r1 = matmul(xp, phi_q.swapaxes(1, 2), g1)  # [dS, dz] = Phi_Q^T [gn, delta]
            # dphi_q = gn S^T + delta z^T, dphi_k = v dS^T + 1 dz^T, dv = phi_k dS
            return matmul(xp, g1, s1.swapaxes(1, 2)), matmul(xp, v1, r1.swapaxes(1, 2)), matmul(xp, phi_k, r1[..., :-1])
        chunk, rows = _chunk_layout(N, chunk_size)
        pq, pk, v1, g1p = _padded(xp, phi_q, rows), _padded(xp, phi_k, rows), _with_ones(xp, v, rows), _padded(xp, g1, rows)
        dv_cols = v.shape[2]
        # forward sweep: dphi_q_t = [S, z]_t g1_t with the inclusive prefix sums
        prev = _exclusive_prefix(xp, matmul(xp, _chunks(pk, chunk).swapaxes(-1, -2), _chunks(v1, chunk)))
        dphi_q = matmul(xp, _chunks(g1p, chunk), prev.swapaxes(-1, -2)).reshape(S, rows, F)
        chunk_tri(xp, g1p, v1, pk, dphi_q, chunk, upper=False)
        # backward sweep with the reverse prefix sums [R, r]_t = sum_{j >= t} phi_q_j [gn_j, delta_j]^T:
        # dphi_k_t = [R, r]_t [v_t, 1], dv_t = R_t^T phi_k_t
        later = _exclusive_prefix(xp, matmul(xp, _chunks(pq, chunk).swapaxes(-1, -2), _chunks(g1p, chunk)), reverse=True)
        dphi_k = matmul(xp, _chunks(v1, chunk), later.swapaxes(-1, -2)).reshape(S, rows, F)
        chunk_tri(xp, v1, g1p, pq, dphi_k, chunk, upper=True)
        dv = matmul(xp, _chunks(pk, chunk), later[..., :dv_cols]).reshape(S, rows, dv_cols)
        chunk_tri(xp, pk, pq, g1p[..., :dv_cols], dv, chunk, upper=True)
    return dphi_q[:, :N], dphi_k[:, :N], dv[:, :N]
