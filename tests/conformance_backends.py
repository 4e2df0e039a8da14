"""The backends that tests/test_conformance.py holds to the reference, and the problems it feeds them.

Registry
--------
:data:`BACKENDS` maps a backend's name to a :class:`types.SimpleNamespace`
of the public functions it offers, under the names of the :mod:`refimpl`
functions they mirror (``responsibilities``, ``log_responsibilities``,
``gma``, ``gma_forward``, ``gma_backward``, ``softmax_attention``,
``ovq_attention``, ``vq_attention`` and, where the backend has them,
``log_likelihood``, ``em_step``, ``softmax_attention_forward``,
``softmax_attention_backward``, ``linear_attention``,
``linear_attention_forward``, ``linear_attention_backward``,
``ovq_attention_forward``, ``ovq_attention_backward``), each with the
reference's signature.  Two flags
ride along:

``simulator``
    The kernels run in the CUDA simulator (every thread a Python thread):
    the suite gives such a backend its few tiny cases only.
``bits_threads``
    The backend's results are the same bits with one thread or two; such a
    backend also has ``threads(n)``, a context manager that runs its calls
    on ``n`` threads with the threaded kernels forced for every size.

A backend whose packages do not import (numba, numba.cuda, cupy) is
registered all the same, with functions that skip through
``pytest.importorskip``: its cases are collected and skip, naming the
package.  :func:`require` does the same for a test that needs one by name.

Problems
--------
:func:`mixture`, :func:`_problem`, :data:`CASES` and :data:`DTYPES` are the
GMM and GMA problems shared by the suite and the per-backend files;
:func:`_bad_gmm` and :func:`_bad_gma` are the inputs the reference refuses.
"""

from __future__ import annotations

import importlib
import os
import types
from contextlib import contextmanager

import numpy as np
import pytest

__all__ = ["BACKENDS", "CASES", "DTYPES", "require", "mixture", "_problem", "_bad_gmm", "_bad_gma"]

DTYPES = [np.float64, np.float32]

CASES = [
    # (leading, per_head, causal, N, K, d_r, d_v)
    ((), False, False, 1, 1, 1, 1),
    ((), False, True, 65, 3, 2, 4),
    ((), False, False, 33, 5, 3, 2),
    ((2,), False, True, 9, 4, 2, 3),
    ((2, 3), True, True, 7, 3, 2, 2),
    ((3,), True, False, 5, 2, 3, 1),
]


def mixture(K, d, seed=0, dtype=np.float64):
    """``means, variances, weights`` of a diagonal GMM: normal means, variances in [0.5, 2], Dirichlet weights."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(K, d)).astype(dtype), rng.uniform(0.5, 2.0, size=(K, d)).astype(dtype),
            rng.dirichlet(np.ones(K)).astype(dtype))


def _problem(leading, per_head, N, K, d_r, d_v, dtype, seed=0):
    """The six inputs of ``gma_forward``: tokens with ``leading`` dimensions, a shared or per-head GMM."""
    rng = np.random.default_rng(seed)
    x_q, x_k = rng.normal(size=(2,) + leading + (N, d_r))
    v = rng.normal(size=leading + (N, d_v))
    heads = leading[-1:] if per_head else ()
    means = rng.normal(size=heads + (K, d_r))
    raw = rng.normal(size=heads + (K, d_r))
    logits = rng.normal(size=heads + (K,))
    return tuple(a.astype(dtype) for a in (x_q, x_k, v, means, raw, logits))


def _bad_gmm():
    """Keyword arguments of ``responsibilities`` that the reference refuses."""
    x = np.random.default_rng(3).normal(size=(6, 2))
    means, variances, weights = mixture(3, 2)
    ok = dict(x=x, means=means, variances=variances, weights=weights)
    return [
        {**ok, "x": np.where(np.arange(12).reshape(6, 2) == 3, np.nan, x)},
        {**ok, "x": x.astype(int)},
        {**ok, "x": x[:, 0]},
        {**ok, "means": means[:, :1]},
        {**ok, "means": means[:0], "variances": variances[:0], "weights": weights[:0]},
        {**ok, "variances": -variances},
        {**ok, "weights": weights * 2},
        {**ok, "weights": weights[:2]},
        {**ok, "x": np.full((1, 2), 1e200), "variances": np.full((3, 2), 1e-200)},
    ]


def _bad_gma():
    """Keyword arguments of ``gma_forward`` that the reference refuses (the last, ``min_variance``, is its own)."""
    x_q, x_k, v, means, raw, logits = _problem((2, 3), True, 5, 3, 2, 2, np.float64)
    ok = dict(x_q=x_q, x_k=x_k, v=v, means=means, raw_variances=raw, logits=logits)
    return [
        {**ok, "x_q": x_q[0, 0, 0]},
        {**ok, "x_k": x_k[0]},
        {**ok, "v": v[..., :3, :]},
        {**ok, "means": means[:2]},
        {**ok, "means": means[0, :0], "raw_variances": raw[0, :0], "logits": logits[0, :0]},
        {**ok, "raw_variances": raw[..., :1]},
        {**ok, "logits": logits[0]},
        {**ok, "x_q": np.where(x_q > 1, np.inf, x_q)},
        {**ok, "causal": 1},
        {**ok, "causal": True, "x_k": x_k[..., :4, :], "v": v[..., :4, :]},
        {**ok, "chunk_size": 0},
        {**ok, "eps": -1.0},
        {**ok, "min_variance": 0.0},
    ]


def _tuned():
    from refimpl import tuned

    names = ("responsibilities", "log_responsibilities", "log_likelihood", "em_step", "gma", "gma_forward", "gma_backward")
    return types.SimpleNamespace(**{n: getattr(tuned, n) for n in names}, simulator=False, bits_threads=False)


@contextmanager
def _numba_threads(n):
    """``n`` Numba threads with every cpu kernel in its threaded build (whatever the size), or (``n=None``) every
    kernel in its serial build; restored afterwards."""
    import numba

    from cpu import _jit

    saved, serial_work = numba.get_num_threads(), _jit.SERIAL_WORK
    try:
        _jit.SERIAL_WORK = float("inf") if n is None else 0
        numba.set_num_threads(min(n or 1, numba.config.NUMBA_NUM_THREADS))
        yield
    finally:
        _jit.SERIAL_WORK = serial_work
        numba.set_num_threads(saved)


def _cpu():
    from cpu import attention, gma, gmm, ovq

    return types.SimpleNamespace(
        responsibilities=gmm.responsibilities, log_responsibilities=gmm.log_responsibilities,
        gma=gma.gma, gma_forward=gma.gma_forward, gma_backward=gma.gma_backward,
        softmax_attention=attention.softmax_attention, softmax_attention_forward=attention.softmax_attention_forward,
        softmax_attention_backward=attention.softmax_attention_backward, linear_attention=attention.linear_attention,
        linear_attention_forward=attention.linear_attention_forward, linear_attention_backward=attention.linear_attention_backward,
        ovq_attention=ovq.ovq_attention, ovq_attention_forward=ovq.ovq_attention_forward,
        ovq_attention_backward=ovq.ovq_attention_backward, vq_attention=ovq.vq_attention,
        simulator=False, bits_threads=True, threads=_numba_threads,
    )


def _numba_cuda():
    attention = importlib.import_module("gpu.numba_cuda.attention")
    gma = importlib.import_module("gpu.numba_cuda.gma")
    gmm = importlib.import_module("gpu.numba_cuda.gmm")
    ovq = importlib.import_module("gpu.numba_cuda.ovq")
    return types.SimpleNamespace(
        responsibilities=gmm.responsibilities, log_responsibilities=gmm.log_responsibilities,
        gma=gma.gma, gma_forward=gma.gma_forward, gma_backward=gma.gma_backward,
        softmax_attention=attention.softmax_attention, ovq_attention=ovq.ovq_attention, vq_attention=ovq.vq_attention,
        simulator=os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", bits_threads=False,
    )


def _numba_cuda_plain():
    """gpu.numba_cuda.plain: one thread per output element, the GPU check's second opinion (tiny cases in the simulator)."""
    plain = importlib.import_module("gpu.numba_cuda.plain")
    names = ("responsibilities", "log_responsibilities", "gma", "softmax_attention", "ovq_attention")
    return types.SimpleNamespace(**{n: getattr(plain, n) for n in names}, simulator=os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                                 bits_threads=False)


def _cupy_host():
    import gpu.cupy_kernels as ck

    return types.SimpleNamespace(**vars(ck.on_host), simulator=False, bits_threads=False)


def _cupy():
    """The CuPy backend on the device: registered only where CuPy can allocate on one (the GPU check runs it there)."""
    import gpu.cupy_kernels as ck

    names = ("responsibilities", "log_responsibilities", "gma", "gma_forward", "gma_backward", "softmax_attention",
             "ovq_attention", "vq_attention")
    return types.SimpleNamespace(**{n: getattr(ck, n) for n in names}, simulator=False, bits_threads=False)


def _cupy_device_usable():
    from gpu.cupy_kernels import _backend

    return _backend.probe()[0]


def _toy():
    """The reference's own kernels as a backend: nothing but a record, bound through :mod:`refimpl.boundary`."""
    from refimpl import boundary, gma

    record = boundary.Backend(
        "toy", "Computed by the reference's own kernels, bound through a record.",
        {**boundary.host_kernels(boundary.reference_posterior, gma._responsibility_backward), **boundary.linear_attention_kernels()},
    )
    return types.SimpleNamespace(**vars(boundary.bind(record)), simulator=False, bits_threads=False)


#: The packages each backend needs, and the functions it offers (named before it is imported).
NEEDS = {"tuned": (), "toy": (), "cpu": ("numba",), "numba_cuda": ("numba", "numba.cuda"), "cupy_host": ("cupy",),
         "numba_cuda_plain": ("numba", "numba.cuda")}
_GMM = ("responsibilities", "log_responsibilities")
_GMA = ("gma", "gma_forward", "gma_backward")
_OFFERS = {
    "cpu": _GMM + _GMA + ("softmax_attention", "softmax_attention_forward", "softmax_attention_backward", "linear_attention",
                          "linear_attention_forward", "linear_attention_backward", "ovq_attention", "ovq_attention_forward",
                          "ovq_attention_backward", "vq_attention"),
    "numba_cuda": _GMM + _GMA + ("softmax_attention", "ovq_attention", "vq_attention"),
    "cupy_host": _GMM + _GMA + ("softmax_attention", "ovq_attention", "vq_attention"),
    "numba_cuda_plain": _GMM + ("gma", "softmax_attention", "ovq_attention"),
}
_BUILD = {"tuned": _tuned, "toy": _toy, "cpu": _cpu, "numba_cuda": _numba_cuda, "cupy_host": _cupy_host,
          "numba_cuda_plain": _numba_cuda_plain}


def _missing(name):
    """The backend ``name`` whose packages do not import: every function skips, naming the package."""

    def skip(*args, **kwargs):
        for module in NEEDS[name]:
            pytest.importorskip(module)
        raise ImportError(f"{name}: {NEEDS[name]} import, yet the backend could not be built")

    return types.SimpleNamespace(**{fn: skip for fn in _OFFERS[name]}, simulator=False, bits_threads=False)


def _importable(modules):
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        return False
    return True


if _importable(("cupy",)) and _cupy_device_usable():
    NEEDS["cupy"] = ("cupy",)
    _BUILD["cupy"] = _cupy

#: ``CONFORMANCE_BACKENDS="numba_cuda,cupy"`` (the GPU check's tests stage) keeps only the backends named.
_ONLY = [n for n in os.environ.get("CONFORMANCE_BACKENDS", "").split(",") if n]

BACKENDS: dict[str, types.SimpleNamespace] = {
    name: build() if _importable(NEEDS[name]) else _missing(name)
    for name, build in _BUILD.items()
    if not _ONLY or name in _ONLY
}


def require(name):
    """The backend ``name``, or a skip naming the package it lacks (``pytest.importorskip``)."""
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
    return BACKENDS[name]
