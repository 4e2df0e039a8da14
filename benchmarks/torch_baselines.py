"""What a PyTorch user would run instead of the GPU backends: the baselines of ``bench_gpu.py``.

* Softmax attention: ``torch.nn.functional.scaled_dot_product_attention``
  (SDPA), which picks a fused flash or memory-efficient kernel when one
  applies.
* GMA and OVQ have no PyTorch operator, so they are written here in PyTorch
  eager, the obvious way: the responsibilities by the expansion of the
  quadratic form (two matrix products), the bidirectional write and read as
  matrix products, the causal form as chunk states with a cumulative sum over
  chunks and a masked product inside each chunk, and OVQ as a Python loop
  over chunks with the default switches of :func:`refimpl.ovq.ovq_attention`
  (plateau growth, spread seeding, the count bias and the exact running
  mean).

Nothing here is tuned, and nothing here is part of the project's API: these
functions exist to be timed beside the backends, and their results are
compared with :mod:`refimpl` by ``tests/test_benchmarks.py`` wherever torch
is installed.  This module imports without torch; :func:`available` says
whether it can run.
"""

from __future__ import annotations

import importlib
import math

__all__ = ["available", "sdpa", "responsibilities", "gma", "ovq_attention"]


def available() -> tuple[bool, str]:
    """Whether torch can be imported here, and its version or the reason it cannot.

    Returns
    -------
    tuple of (bool, str)
    """
    try:
        torch = importlib.import_module("torch")
    except ImportError as err:
        return False, f"torch is not installed ({err})"
    return True, f"torch {torch.__version__}"


def _torch():
    import torch

    return torch


def sdpa(q, k, v, causal=False):
    """Softmax attention ``softmax(q k^T / sqrt(d)) v`` by torch SDPA, for ``(N, d)`` tensors.

    Parameters
    ----------
    q, k, v : torch.Tensor, shape (N, d)
    causal : bool, default False

    Returns
    -------
    torch.Tensor, shape (N, d)
    """
    torch = _torch()
    out = torch.nn.functional.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None], is_causal=causal)
    return out[0, 0]


def responsibilities(x, means, variances, weights):
    """The GMM's responsibilities ``softmax_k(log pi_k + log N(x | mu_k, diag sigma_k^2))`` in PyTorch eager.

    The quadratic form by its expansion,
    ``x^2 (1/sigma^2)^T - 2 x (mu/sigma^2)^T + sum mu^2/sigma^2``: two matrix
    products.

    Parameters
    ----------
    x : torch.Tensor, shape (N, d)
    means, variances : torch.Tensor, shape (K, d)
    weights : torch.Tensor, shape (K,)

    Returns
    -------
    torch.Tensor, shape (N, K)
    """
    torch = _torch()
    precision = 1 / variances
    quad = (x * x) @ precision.T - 2 * (x @ (means * precision).T) + (means * means * precision).sum(1)
    log_norm = torch.log(weights) - 0.5 * (torch.log(variances).sum(1) + x.shape[1] * math.log(2 * math.pi))
    return torch.softmax(log_norm - 0.5 * quad, dim=1)


def gma(x_q, x_k, v, means, variances, weights, causal=False, eps=1e-6, chunk_size=64):
    """Gaussian Mixture Attention ``(Gamma_Q Gamma_K^T V) / (Gamma_Q Gamma_K^T 1 + eps)`` in PyTorch eager.

    Causal: the lower triangle of the affinity, by chunk states
    ``Gamma_K,c^T [V_c, 1]``, their exclusive cumulative sum over chunks, and
    the masked product inside each chunk.

    Parameters
    ----------
    x_q, x_k : torch.Tensor, shape (N, d_r)
    v : torch.Tensor, shape (N, d_v)
    means, variances : torch.Tensor, shape (K, d_r)
    weights : torch.Tensor, shape (K,)
    causal : bool, default False
    eps : float, default 1e-6
    chunk_size : int, default 64

    Returns
    -------
    torch.Tensor, shape (N, d_v)
    """
    torch = _torch()
    gq = responsibilities(x_q, means, variances, weights)
    gk = responsibilities(x_k, means, variances, weights)
    v1 = torch.cat([v, torch.ones_like(v[:, :1])], dim=1)  # [V, 1]: numerators and the denominator together
    if not causal:
        mixed = gq @ (gk.T @ v1)
    else:
        N, K = gq.shape
        pad = (-N) % chunk_size  # padded rows have zero responsibilities: they add nothing
        gq, gk, v1 = (torch.nn.functional.pad(a, (0, 0, 0, pad)) for a in (gq, gk, v1))
        m = gq.shape[0] // chunk_size
        gq, gk, v1 = gq.view(m, chunk_size, K), gk.view(m, chunk_size, K), v1.view(m, chunk_size, -1)
        states = gk.transpose(1, 2) @ v1  # (m, K, d_v + 1)
        before = states.cumsum(0) - states  # what the chunks before each chunk wrote
        inside = torch.tril(gq @ gk.transpose(1, 2)) @ v1  # keys j <= t of the query's own chunk
        mixed = (gq @ before + inside).reshape(m * chunk_size, -1)[:N]
    return mixed[:, :-1] / (mixed[:, -1:] + eps)


def ovq_attention(q, k, v, *, max_size, chunk_size, beta=None):
    """OVQ attention with the default switches of :func:`refimpl.ovq.ovq_attention`, in PyTorch eager.

    Plateau growth, spread seeding, the count bias ``log c`` and the exact
    running mean; a Python loop over chunks.

    Parameters
    ----------
    q, k : torch.Tensor, shape (T, d)
    v : torch.Tensor, shape (T, d_v)
    max_size : int
    chunk_size : int
    beta : float, optional
        ``sqrt(d)`` by default.

    Returns
    -------
    torch.Tensor, shape (T, d_v)
    """
    torch = _torch()
    T, d = q.shape
    beta = math.sqrt(d) if beta is None else beta
    qh = q / q.norm(dim=1, keepdim=True).clamp_min(1e-12)
    kh = k / k.norm(dim=1, keepdim=True).clamp_min(1e-12)
    dict_k = q.new_zeros(max_size, d)
    dict_v = v.new_zeros(max_size, v.shape[1])
    counts = q.new_zeros(max_size)
    out = torch.empty_like(v)
    n = t = 0
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        L = e - s
        qc, kc, vc = qh[s:e], kh[s:e], v[s:e]
        # read out before the chunk touches the dictionary: the n centroids (plus log c) and the chunk's keys b <= a
        logits = beta * (qc @ torch.cat([dict_k[:n], kc]).T)
        logits[:, :n] += torch.log(counts[:n])
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        logits[:, n:] = logits[:, n:].masked_fill(mask, float("-inf"))
        out[s:e] = torch.softmax(logits, dim=1) @ torch.cat([dict_v[:n], vc])
        # grow: n' = max(n, max(1, floor(t n_max / (t + n_max))))
        t += L
        n_next = max(n, max(1, t * max_size // (t + max_size)))
        n_add = n_next - n
        if n == 0:
            # key 0 seeds centroid 0, the keys least similar to it seed the others; every key joins centroid 0
            order = torch.argsort(kc[1:] @ kc[0], stable=True)[: n_add - 1] + 1
            seeds = torch.cat([order.new_zeros(1), order])
            rows = torch.zeros(L, dtype=torch.long, device=q.device)
        else:
            sims = kc @ dict_k[:n].T
            rows = sims.argmax(dim=1)  # the first maximum: ties go to the lowest index
            seeds = torch.argsort(sims.gather(1, rows[:, None])[:, 0], stable=True)[:n_add]
        rows[seeds] = n + torch.arange(n_add, device=q.device)
        seeded = torch.zeros(L, dtype=torch.bool, device=q.device)
        seeded[seeds] = True
        dict_k[n:n_next], dict_v[n:n_next], counts[n:n_next] = kc[seeds], vc[seeds], 1
        # the running mean (c D + sum x) / (c + |S|) over each centroid's members
        a = rows[~seeded]
        added = torch.bincount(a, minlength=n_next).to(counts.dtype)
        c_new = counts[:n_next] + added
        sum_k = torch.zeros_like(dict_k[:n_next]).index_add_(0, a, kc[~seeded])
        sum_v = torch.zeros_like(dict_v[:n_next]).index_add_(0, a, vc[~seeded])
        joined = added[:, None] > 0  # a centroid no key joined keeps its row
        c_old = counts[:n_next, None]
        dict_k[:n_next] = torch.where(joined, (c_old * dict_k[:n_next] + sum_k) / c_new[:, None], dict_k[:n_next])
        dict_v[:n_next] = torch.where(joined, (c_old * dict_v[:n_next] + sum_v) / c_new[:, None], dict_v[:n_next])
        counts[:n_next] = c_new
        n = n_next
    return out
