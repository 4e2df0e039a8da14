r"""Packed variable-length batches: sequences laid one after another and cut by ``cu_seqlens``.

A packed batch holds ``S`` sequences of lengths ``n_0, ..., n_{S-1}`` one
after another along the first axis of its token arrays, ``x`` of shape
``(T, d)`` (or ``(T, H, d)`` with heads), ``T = sum_s n_s``, with no padding.
The offsets ``cu_seqlens`` (integers, shape ``(S + 1,)``) start at 0, never
decrease and end at ``T``; sequence ``s`` is rows
``cu_seqlens[s]:cu_seqlens[s + 1]``, and an empty sequence (two equal
offsets) gives an empty output.

The contract (``docs/derivations/varlen.md``): a packed call is the loop over
its sequences, each computed as on its own, the outputs laid back in the
sequences' rows; nothing crosses a boundary.  :func:`packed` is that loop,
written once for every function that takes ``cu_seqlens`` (the reference and,
through :mod:`refimpl.boundary`, every backend); :func:`packed_backward` is
its backward: the tokens' gradients laid back in their rows, the parameters'
summed over the sequences in order.  Every argument is checked before any
sequence is computed (:func:`check_packed`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import validation

__all__ = ["PackedCache", "check_packed", "checked_grad_out", "packed", "packed_backward", "packed_layout", "sequence_rows"]


class PackedCache(NamedTuple):
    """What the backward of a packed forward needs: the offsets, and the forward's cache of each sequence."""

    cu_seqlens: np.ndarray  # the offsets, int64 (S + 1,)
    caches: tuple  # the cache of each sequence, None for an empty one
    token_shapes: tuple  # the shapes of the forward's token arrays (x_q, x_k, v or q, k, v): their gradients' shapes
    out_shape: tuple  # (T, d_v) or (T, H, d_v): the shape of grad_out
    dtype: np.dtype  # the dtype of the output and of the gradients


def _same(a, kind=None):
    return a


def sequence_rows(cu_seqlens):
    """The rows of each sequence, ``slice(cu_seqlens[s], cu_seqlens[s + 1])`` for ``s`` in order."""
    return [slice(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def _heads_first(x):
    """One sequence ``(n, H, d)`` as the batch ``(H, n, d)`` of its heads (a view); ``(n, d)`` as it is."""
    return x.transpose(1, 0, 2) if x.ndim == 3 else x


def check_packed(cu_seqlens, tokens, names, check, view=_same):
    """Every check of a packed call, before anything is computed: the offsets (int64), or the first error.

    ``tokens`` are the token arrays (``names`` their names), ``check(*tokens)``
    the function's own checker, called on the whole packed arrays, heads first
    (what ``view`` shows of them); the token arrays must be ``(T, ...)`` with
    no batch dimension, and the offsets end at ``T``.
    """
    offsets = validation.check_cu_seqlens(cu_seqlens)
    shown = [view(x) for x in tokens]
    for x, given, name in zip(shown, tokens, names):
        validation.check_packed_tokens(x, name, given)
    check(*(_heads_first(np.asarray(x)) for x in shown))
    for x, name in zip(shown, names):
        validation.check_packed_end(offsets, x, name)
    return offsets


def _join(parts, rows, shape, dtype):
    """The parts of the sequences (each heads first) laid back in their rows of one ``(T, ...)`` array."""
    out = np.empty(shape, dtype=dtype)
    for part, r in zip(parts, rows):
        if part is not None:
            out[r] = part.transpose(1, 0, 2) if part.ndim == 3 else part  # (H, n, d) back to (n, H, d)
    return out


def packed(function, tokens, cu_seqlens, names, check, view=_same, forward=False):
    """The packed call: ``function(s, *tokens of sequence s)`` for every sequence, the outputs laid back in its rows.

    Parameters
    ----------
    function : Callable
        ``function(s, *tokens)``: the call on sequence ``s`` alone (its tokens
        ``(n, d)``, or ``(H, n, d)`` heads first), returning its output, or
        ``(output, extra)``; never called for an empty sequence.
    tokens : tuple of array_like
        The packed token arrays ``(T, d)`` or ``(T, H, d)``; the output has
        the rows of the first and the width of the last.
    cu_seqlens, names, check, view
        As in :func:`check_packed`.
    forward : bool, default False
        ``function`` is a forward, its ``extra`` the sequence's cache: return
        them as one :class:`PackedCache`.

    Returns
    -------
    out : ndarray, shape (T, d_v) or (T, H, d_v)
    extras : list or PackedCache
        Each sequence's ``extra`` (``None`` for an empty one, or where the
        function returns its output alone); with ``forward``, the
        :class:`PackedCache` of the caches.
    """
    offsets = check_packed(cu_seqlens, tokens, names, check, view)
    tokens = tuple(x if hasattr(x, "transpose") else np.asarray(x) for x in tokens)
    rows = sequence_rows(offsets)
    outs, extras = [], []
    for s, r in enumerate(rows):
        # sequence s alone: rows cu_seqlens[s]:cu_seqlens[s+1] of every token array, nothing of another sequence
        result = function(s, *(_heads_first(x[r]) for x in tokens)) if r.stop > r.start else None
        out, extra = result if isinstance(result, tuple) else (result, None)
        outs.append(out)
        extras.append(extra)
    dtype = next(o for o in outs if o is not None).dtype
    out = _join(outs, rows, np.shape(view(tokens[0]))[:-1] + np.shape(view(tokens[-1]))[-1:], dtype)
    if forward:
        shapes = tuple(tuple(np.shape(view(x))) for x in tokens)
        return out, PackedCache(offsets, tuple(extras), shapes, tuple(out.shape), out.dtype)
    return out, extras


def checked_grad_out(grad_out, out_shape, dtype, view=_same):
    """``grad_out`` of a packed output of ``out_shape``, ``(T, d_v)`` or ``(T, H, d_v)``, checked: no batch dimension,
    then the shape and dtype."""
    labels = ("T", "H", "d_v") if len(out_shape) == 3 else ("T", "d_v")
    validation.check_packed_tokens(view(grad_out), "grad_out", grad_out)
    return validation.check_grad_out(view(grad_out), tuple(out_shape), labels, dtype)


def packed_layout(x, leading):
    """Rows ``(H T, w)`` or ``(H, T, w)``, heads first, back in the packed layout: ``(T, w)``, or ``(T, H, w)`` with heads."""
    H = int(np.prod(leading))
    x = x.reshape(H, -1, x.shape[-1])
    return x.transpose(1, 0, 2).reshape((x.shape[1],) + tuple(leading) + x.shape[-1:])


def packed_backward(backward, grad_out, cache, view=_same):
    """The backward of a packed forward: ``backward(grad_out of sequence s, its cache)`` for every sequence.

    The gradients of the token arrays (the first fields of the result, as
    many as the forward had token arrays) are laid back in their rows; the
    others (a GMM's parameters) are summed over the sequences, in order.
    """
    g = checked_grad_out(grad_out, cache.out_shape, cache.dtype, view)
    rows = sequence_rows(cache.cu_seqlens)
    grads = [backward(_heads_first(g[r]), c) if c is not None else None for r, c in zip(rows, cache.caches)]
    first = next(x for x in grads if x is not None)
    fields = []
    for i in range(len(first)):
        parts = [None if x is None else x[i] for x in grads]
        if i < len(cache.token_shapes):
            fields.append(_join(parts, rows, cache.token_shapes[i], cache.dtype))
        else:
            total = None
            for p in parts:  # the parameters' gradient: the sum over the sequences, in order
                total = p if total is None else (total + p if p is not None else total)
            fields.append(total)
    return type(first)(*fields)
