"""The public functions of every backend, written once, and the record of kernels that binds them.

Five implementations compute the same functions: the reference
(:mod:`refimpl.gmm`, :mod:`refimpl.gma`, :mod:`refimpl.attention`,
:mod:`refimpl.ovq`), :mod:`refimpl.tuned`, :mod:`cpu`, :mod:`gpu.numba_cuda`
and :mod:`gpu.cupy_kernels`.  What a caller sees of a function is the same
in all of them: its signature and defaults, its docstring, the checks of its
arguments (with the reference's exception types and messages, word for
word) and the rule for the dtype of its result.  That part is written here,
once per function; a backend supplies only what differs, in a
:class:`Backend` record:

* ``kernels``: the cores, one per public function, each given the checked
  arguments (what the reference's checker returned) beside the arguments as
  the caller passed them (device arrays stay on the device);
* ``module(*arrays)``: the array module the call computes with, or the error
  that says this backend cannot run here and how to get it;
* ``view(a, kind)``: what the reference's checker reads for the argument
  ``a`` (the array itself on the host; for a device array, a host stand-in of
  its shape and dtype, or a host copy of a small parameter).

:func:`bind` makes the public functions of a record: ``bind(record)`` gives
every function the record has kernels for, with the reference's signature
and its docstring (the parameters, results and errors, with the backend's
array types).  A backend that computes on host arrays by the reference's
batch rule needs fewer pieces still: :func:`host_kernels` builds the cores of
the responsibilities and of GMA from a posterior, a backward through it and
the two sides of the scan, and :func:`linear_attention_kernels` those of
linear attention from the scan alone.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from . import attention, gmm, numerics, ovq, scan, validation, varlen
from . import gma as spec_gma

__all__ = ["Backend", "FUNCTIONS", "bind", "host_kernels", "linear_attention_kernels", "reference_posterior", "same_array",
           "numpy_module"]


def same_array(a, kind=None):
    """The view of a host backend: the checkers read the argument itself."""
    return a


def numpy_module(*arrays):
    """The array module of a host backend: NumPy, which always runs."""
    return np


class Backend(NamedTuple):
    """A backend: its kernels, and how it moves arrays (the module docstring says what each piece is for)."""

    #: The module its functions are bound into (``"cpu"``, ``"gpu.numba_cuda"``, ...), as the docstrings name it.
    name: str
    #: How it computes, one sentence: the start of the docstrings' second paragraph.
    summary: str
    #: The cores by public name (:data:`FUNCTIONS` says what each is given); a name without one is a function it has not.
    #: ``"packed " + name``, optionally: the kernel of a packed call (``cu_seqlens``) in one call, else the loop (:func:`_packed`;
    #: OVQ's are also given the incoming state of each sequence, and ``ovq_attention``'s ``return_state``).
    kernels: Mapping[str, Callable]
    #: Which arrays it takes and gives, one sentence for the docstrings.
    arrays: str = "NumPy arrays in, NumPy arrays out; the dtype follows the inputs."
    #: What the docstrings call an array argument.
    array_type: str = "array_like"
    #: What the docstrings call an array result.
    result_type: str = "ndarray"
    #: ``view(a, kind)``: what the reference's checker reads for argument ``a``; ``kind`` is ``None`` for a token
    #: array, ``"parameter"`` for a small parameter array, ``"positive"`` for the variances, ``"probability"`` for
    #: the weights.
    view: Callable = same_array
    #: ``module(*arrays)``: the array module the call computes with; raises the backend's ``RuntimeError`` when it
    #: cannot run here.
    module: Callable = numpy_module
    #: Words of the reference's docstrings that name its own types (its caches), and what this backend's say instead.
    replace: Mapping[str, str] = types.MappingProxyType({})
    #: A Notes section per function name, in place of the reference's (which describes its own computation): plain
    #: paragraphs, filled to the docstrings' width.
    notes: Mapping[str, str] = types.MappingProxyType({})


# ---------------------------------------------------------------------------
# The public functions, each once: module, view, checks, kernel (the defaults are the reference's, from its signature)
# ---------------------------------------------------------------------------


def _gmm_arguments(b, x, means, variances, weights):
    """The checks of :mod:`refimpl.gmm`'s responsibilities: ``(x, means, variances, weights)`` in one dtype."""
    return validation.check_gmm(b.view(x), b.view(means, "parameter"), b.view(variances, "positive"), b.view(weights, "probability"))


def responsibilities(b, x, means, variances, weights):
    xp = b.module(x, means, variances, weights)
    return b.kernels["posterior"](xp, _gmm_arguments(b, x, means, variances, weights), (x, means, variances, weights), False)


def log_responsibilities(b, x, means, variances, weights):
    xp = b.module(x, means, variances, weights)
    return b.kernels["posterior"](xp, _gmm_arguments(b, x, means, variances, weights), (x, means, variances, weights), True)


def _native(b, kernel, tokens, names, cu_seqlens, check, *rest):
    """``native(xp, checked, given, offsets, *rest)``, the backend's packed kernel ``"packed " + kernel``, called once
    every check of the packed call has passed; ``NotImplemented`` where the backend has none (or it leaves the call
    to the loop)."""
    native = b.kernels.get(f"packed {kernel}")
    if native is None:
        return NotImplemented
    checked = []
    offsets = varlen.check_packed(cu_seqlens, tokens, names, lambda *x: checked.append(check(*x)), b.view)
    return native(b.module(*tokens), checked[0], tokens, offsets, *rest)


def _packed(b, definition, tokens, names, cu_seqlens, check, forward, *rest, kernel=None, **options):
    """A packed call of ``definition`` on ``b``: the backend's packed kernel ``"packed " + kernel`` where it has one
    and takes the call, else every sequence by its unpacked call (:func:`refimpl.varlen.packed`).

    A packed kernel is called ``native(xp, checked, given, offsets)``, ``checked`` what the checker returned for the
    whole packed arrays (heads first), ``offsets`` the checked ``cu_seqlens`` (int64); it returns what the public
    function returns, or ``NotImplemented`` to leave the call to the loop (which checks again and computes).
    """
    result = _native(b, kernel, tokens, names, cu_seqlens, check)
    if result is not NotImplemented:
        return result
    out, extras = varlen.packed(lambda s, *seq: definition(b, *seq, *rest, **options, cu_seqlens=None), tokens, cu_seqlens, names,
                                check, b.view, forward)
    return (out, extras) if forward else out


def gma(b, x_q, x_k, v, means, variances, weights, *, causal, eps, chunk_size, cu_seqlens):
    given = (x_q, x_k, v, means, variances, weights)
    xp = b.module(*given)
    params = (b.view(means, "parameter"), b.view(variances, "positive"), b.view(weights, "probability"))
    check = lambda q, k, v1: spec_gma.check_gma_arguments(q, k, v1, *params, causal, eps, chunk_size)  # noqa: E731
    if cu_seqlens is not None:
        return _packed(b, gma, given[:3], ("x_q", "x_k", "v"), cu_seqlens, check, False, *given[3:], kernel="gma", causal=causal,
                       eps=eps, chunk_size=chunk_size)
    return b.kernels["gma"](xp, check(b.view(x_q), b.view(x_k), b.view(v)), given)


def gma_forward(b, x_q, x_k, v, means, raw_variances, logits, *, causal, eps, min_variance, chunk_size, cu_seqlens):
    given = (x_q, x_k, v, means, raw_variances, logits)
    xp = b.module(*given)
    params = tuple(b.view(a, "parameter") for a in given[3:])
    check = lambda q, k, v1: spec_gma.check_gma_forward_arguments(q, k, v1, *params, causal, eps, min_variance, chunk_size)  # noqa: E731
    if cu_seqlens is not None:
        return _packed(b, gma_forward, given[:3], ("x_q", "x_k", "v"), cu_seqlens, check, True, *given[3:], kernel="gma_forward",
                       causal=causal, eps=eps, min_variance=min_variance, chunk_size=chunk_size)
    return b.kernels["gma_forward"](xp, check(b.view(x_q), b.view(x_k), b.view(v)), given)


def _attention(name, checker, forward):
    def definition(b, q, k, v, *, cu_seqlens, **options):
        xp = b.module(q, k, v)
        check = lambda q1, k1, v1: checker(q1, k1, v1, *options.values())  # noqa: E731
        if cu_seqlens is not None:
            return _packed(b, definition, (q, k, v), ("q", "k", "v"), cu_seqlens, check, forward, kernel=name, **options)
        return b.kernels[name](xp, check(b.view(q), b.view(k), b.view(v)), (q, k, v))

    return definition


def _softmax_attention(name):
    attention_call = _attention(name, validation.check_softmax_attention_any, name.endswith("_forward"))

    # options in the checker's order: scale, causal
    def definition(b, q, k, v, *, scale, causal, cu_seqlens):
        return attention_call(b, q, k, v, scale=scale, causal=causal, cu_seqlens=cu_seqlens)

    return definition


def _linear_attention(name):
    attention_call = _attention(name, validation.check_linear_attention_any, name.endswith("_forward"))

    # options in the checker's order: causal, eps, chunk_size
    def definition(b, q, k, v, *, causal, eps, chunk_size, cu_seqlens):
        return attention_call(b, q, k, v, causal=causal, eps=eps, chunk_size=chunk_size, cu_seqlens=cu_seqlens)

    return definition


def _backward(name):
    def definition(b, grad_out, cache):
        if isinstance(cache, varlen.PackedCache):
            return varlen.packed_backward(lambda g, c: definition(b, g, c), grad_out, cache, b.view)
        return b.kernels[name](b.module(grad_out), grad_out, cache)

    return definition


def ovq_attention(b, q, k, v, *, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state, return_state,
                  cu_seqlens):
    if cu_seqlens is not None:
        options = dict(max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init, count_bias=count_bias,
                       learning_rate=learning_rate, seed=seed)
        states, check = ovq.packed_states(state, cu_seqlens, options, ovq.check_ovq_arguments)
        return_state = validation.check_bool(return_state, "return_state")
        b.module(q, k, v)
        result = _native(b, "ovq_attention", (q, k, v), ("q", "k", "v"), cu_seqlens, check, states, return_state)
        if result is not NotImplemented:
            return result
        one = lambda s, q1, k1, v1: ovq_attention(b, q1, k1, v1, **options, state=states[s], return_state=return_state, cu_seqlens=None)  # noqa: E731
        out, extras = varlen.packed(one, (q, k, v), cu_seqlens, ("q", "k", "v"), check, b.view)
        return (out, ovq.sequence_states(extras, states, max_size, b.view(q), b.view(v), out.dtype)) if return_state else out
    xp = b.module(q, k, v)
    options = (max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state)
    a = ovq.check_ovq_arguments(b.view(q), b.view(k), b.view(v), *options)
    return_state = validation.check_bool(return_state, "return_state")
    return b.kernels["ovq_attention"](xp, a, (q, k, v), return_state)


def ovq_attention_forward(b, q, k, v, *, max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state, cu_seqlens):
    if cu_seqlens is not None:
        options = dict(max_size=max_size, chunk_size=chunk_size, beta=beta, growth=growth, init=init, count_bias=count_bias,
                       learning_rate=learning_rate, seed=seed)
        states, check = ovq.packed_states(state, cu_seqlens, options, ovq.check_ovq_forward_arguments)
        b.module(q, k, v)
        result = _native(b, "ovq_attention_forward", (q, k, v), ("q", "k", "v"), cu_seqlens, check, states)
        if result is not NotImplemented:
            return result
        one = lambda s, q1, k1, v1: ovq_attention_forward(b, q1, k1, v1, **options, state=states[s], cu_seqlens=None)  # noqa: E731
        return varlen.packed(one, (q, k, v), cu_seqlens, ("q", "k", "v"), check, b.view, forward=True)
    xp = b.module(q, k, v)
    options = (max_size, chunk_size, beta, growth, init, count_bias, learning_rate, seed, state)
    a = ovq.check_ovq_forward_arguments(b.view(q), b.view(k), b.view(v), *options)
    return b.kernels["ovq_attention_forward"](xp, a, (q, k, v))


def vq_attention(b, q, k, v, codebook, *, chunk_size, beta, cu_seqlens):
    xp = b.module(q, k, v, codebook)
    book = b.view(codebook, "parameter")
    check = lambda q1, k1, v1: ovq.check_vq_arguments(q1, k1, v1, book, chunk_size, beta)  # noqa: E731
    if cu_seqlens is not None:
        return _packed(b, vq_attention, (q, k, v), ("q", "k", "v"), cu_seqlens, check, False, codebook, chunk_size=chunk_size, beta=beta)
    return b.kernels["vq_attention"](xp, check(b.view(q), b.view(k), b.view(v)), (q, k, v, codebook))


#: Each public function: ``(its definition here, the reference function whose signature and docstring it has,
#: the kernel it calls)``.  The kernels are called ``kernel(xp, checked, given, *rest)``: ``xp`` the array module,
#: ``checked`` what the reference's checker returned, ``given`` the arrays as the caller passed them; the
#: responsibilities add ``log``, OVQ adds ``return_state``; a backward's is ``kernel(xp, grad_out, cache)``, the
#: cache being what the backend's forward returned (its own type, checked by the kernel).
FUNCTIONS = {
    "responsibilities": (responsibilities, gmm.responsibilities, "posterior"),
    "log_responsibilities": (log_responsibilities, gmm.log_responsibilities, "posterior"),
    "gma": (gma, spec_gma.gma, "gma"),
    "gma_forward": (gma_forward, spec_gma.gma_forward, "gma_forward"),
    "gma_backward": (_backward("gma_backward"), spec_gma.gma_backward, "gma_backward"),
    "softmax_attention": (_softmax_attention("softmax_attention"), attention.softmax_attention, "softmax_attention"),
    "softmax_attention_forward": (_softmax_attention("softmax_attention_forward"), attention.softmax_attention_forward,
                                  "softmax_attention_forward"),
    "softmax_attention_backward": (_backward("softmax_attention_backward"), attention.softmax_attention_backward,
                                   "softmax_attention_backward"),
    "linear_attention": (_linear_attention("linear_attention"), attention.linear_attention, "linear_attention"),
    "linear_attention_forward": (_linear_attention("linear_attention_forward"), attention.linear_attention_forward,
                                 "linear_attention_forward"),
    "linear_attention_backward": (_backward("linear_attention_backward"), attention.linear_attention_backward,
                                  "linear_attention_backward"),
    "ovq_attention": (ovq_attention, ovq.ovq_attention, "ovq_attention"),
    "ovq_attention_forward": (ovq_attention_forward, ovq.ovq_attention_forward, "ovq_attention_forward"),
    "ovq_attention_backward": (_backward("ovq_attention_backward"), ovq.ovq_attention_backward, "ovq_attention_backward"),
    "vq_attention": (vq_attention, ovq.vq_attention, "vq_attention"),
}


# ---------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------

_SECTION = re.compile(r"^(\w[\w ]*)\n-+$", re.MULTILINE)


def _sections(doc):
    """``(head, [(title, body), ...])``: a numpydoc docstring cut at its section headings."""
    marks = list(_SECTION.finditer(doc))
    head = doc[: marks[0].start()] if marks else doc
    parts = [(m.group(1), doc[m.end() : (marks[i + 1].start() if i + 1 < len(marks) else len(doc))]) for i, m in enumerate(marks)]
    return head.rstrip(), parts


def document(reference, backend, name):
    """The docstring of ``backend``'s ``name``: the reference's, with the backend's words.

    The reference's summary, then a paragraph naming the backend and the
    reference function, then every section of the reference's docstring
    (its array types those of the backend) but its Notes, which describe the
    reference's own computation: the backend's notes stand there instead.
    """
    head, parts = _sections(inspect.getdoc(reference))
    summary, _, rest = head.partition("\n\n")
    about = (f"{backend.summary} The arguments, defaults, results and errors of "
             f":func:`{reference.__module__}.{reference.__name__}`, word for word. {backend.arrays}")
    lines = [summary, "", textwrap.fill(about, 79, break_on_hyphens=False, break_long_words=False)]
    if rest.strip():
        lines += ["", rest.strip()]
    for title, body in parts:
        if title == "Notes":
            continue
        if title in ("Parameters", "Returns"):
            body = re.sub(r"^(\s*[\w, ]+ : )array_like", rf"\g<1>{backend.array_type}", body, flags=re.MULTILINE)
            body = re.sub(r"^(\s*(?:[\w]+ : )?)ndarray", rf"\g<1>{backend.result_type}", body, flags=re.MULTILINE)
        lines += ["", title, "-" * len(title), body.strip("\n")]
    if name in backend.notes:
        paragraphs = backend.notes[name].split("\n\n")
        notes = "\n\n".join(textwrap.fill(" ".join(p.split()), 79, break_on_hyphens=False, break_long_words=False) for p in paragraphs)
        lines += ["", "Notes", "-----", notes]
    doc = "\n".join(lines)
    for old, new in backend.replace.items():
        doc = doc.replace(old, new)
    return doc


def _bound(backend, name, module):
    """``name`` of ``backend`` as a function with the reference's own parameters: Python words every call error alike."""
    definition, reference, _ = FUNCTIONS[name]
    params = inspect.signature(reference).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    header = ", ".join(positional + (["*"] + keywords if keywords else []))
    call = ", ".join(["backend"] + positional + [f"{k}={k}" for k in keywords])
    namespace = {"definition": definition, "backend": backend}
    exec(f"def {name}({header}):\n    return definition({call})\n", namespace)  # noqa: S102 -- source built from a signature
    public = namespace[name]
    public.__defaults__, public.__kwdefaults__ = reference.__defaults__, reference.__kwdefaults__
    public.__annotations__ = dict(reference.__annotations__)
    public.__qualname__ = name
    public.__module__ = module
    public.__doc__ = document(reference, backend, name)
    public.backend = backend
    return public


def bind(backend, names=None, module=None):
    """The public functions of ``backend``: ``{name: function}`` for ``names`` (every function it has kernels for).

    Parameters
    ----------
    backend : Backend
    names : iterable of str, optional
        Which of :data:`FUNCTIONS` to bind; by default those whose kernel
        ``backend.kernels`` holds.
    module : str, optional
        The ``__module__`` of the functions (``backend.name`` by default).

    Returns
    -------
    types.SimpleNamespace
        The functions as attributes, under the reference's names.
    """
    names = [n for n, f in FUNCTIONS.items() if f[2] in backend.kernels] if names is None else list(names)
    missing = [n for n in names if FUNCTIONS[n][2] not in backend.kernels]
    if missing:
        raise ValueError(f"backend {backend.name!r} has no kernel for {', '.join(missing)}")
    return types.SimpleNamespace(**{n: _bound(backend, n, module or backend.name) for n in names})


# ---------------------------------------------------------------------------
# Host backends: the reference's batch rule around a posterior and a scan
# ---------------------------------------------------------------------------


def reference_posterior(x, means, variances, log_weights, *, log=False):
    """The reference's posterior of checked arrays: ``(gamma or log gamma (N, K), min_quad (N,))``; no raise."""
    logits, min_quad = gmm.log_joint(x, means, variances, log_weights)
    return (numerics.log_softmax(logits, axis=1) if log else numerics.softmax(logits, axis=1)), min_quad


def host_kernels(posterior, responsibility_backward=None, scan_forward=scan.scan_forward, scan_backward=scan.scan_backward):
    """The cores of the responsibilities and of GMA for a backend on host arrays.

    Parameters
    ----------
    posterior : Callable
        ``posterior(x, means, variances, log_weights, *, log=False) -> (gamma, min_quad)``
        on checked 2-D arrays of one dtype; never raises (``min_quad`` not
        finite marks a row without a posterior).
    responsibility_backward : Callable, optional
        ``(x, gamma, dL/dgamma, means, variances) -> (dx, dmeans, dvariances, dlogits)``;
        without it there is no ``gma_backward``.
    scan_forward, scan_backward : Callable
        The mixing and its backward (:func:`refimpl.scan.scan_forward`,
        :func:`refimpl.scan.scan_backward` by default).

    Returns
    -------
    dict
        Kernels for :class:`Backend`: ``posterior``, ``gma``, ``gma_forward``
        and, with ``responsibility_backward``, ``gma_backward``; every
        sequence of a batch computed as on its own, by
        :func:`refimpl.gma.forward_with` and :func:`refimpl.gma.backward_with`.
    """

    def posterior_kernel(xp, checked, given, log):
        x, means, variances, weights = checked
        gamma, min_quad = posterior(x, means, variances, numerics.log_weights(weights), log=log)
        validation.check_scaled_distances(min_quad, "x")
        return gamma

    def gma_kernel(xp, a, given):
        args = (a.x_q, a.x_k, a.v, a.means, a.variances, numerics.log_weights(a.weights), a.causal, a.eps, a.chunk_size)
        return spec_gma.forward_with(posterior, *args, keep=False, scan=scan_forward)[0]

    def gma_forward_kernel(xp, a, given):
        variances, log_weights = spec_gma.mixture_from_raw(a.raw_variances, a.logits, a.min_variance)
        args = (a.x_q, a.x_k, a.v, a.means, variances, log_weights, a.causal, a.eps, a.chunk_size)
        return spec_gma.forward_with(posterior, *args, raw_variances=a.raw_variances, scan=scan_forward)

    kernels = {"posterior": posterior_kernel, "gma": gma_kernel, "gma_forward": gma_forward_kernel}
    if responsibility_backward is not None:
        kernels["gma_backward"] = lambda xp, grad_out, cache: spec_gma.backward_with(responsibility_backward, grad_out, cache, scan=scan_backward)
    return kernels


def linear_attention_kernels(scan_forward=scan.scan_forward, scan_backward=scan.scan_backward):
    """The cores of linear attention for a backend on host arrays: the reference's batch rule around two scans.

    Returns
    -------
    dict
        Kernels for :class:`Backend`: ``linear_attention``,
        ``linear_attention_forward`` and ``linear_attention_backward``, by
        :func:`refimpl.attention.linear_forward_with` and
        :func:`refimpl.attention.linear_backward_with`.
    """

    def forward_kernel(xp, checked, given):
        return attention.linear_forward_with(scan_forward, *checked)

    return {
        "linear_attention": lambda xp, checked, given: forward_kernel(xp, checked, given)[0],
        "linear_attention_forward": forward_kernel,
        "linear_attention_backward": lambda xp, grad_out, cache: attention.linear_backward_with(scan_backward, grad_out, cache),
    }
