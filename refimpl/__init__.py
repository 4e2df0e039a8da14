"""refimpl: a readable NumPy reference for Gaussian-mixture attention mechanisms.

Modules
-------
gmm
    Diagonal Gaussian mixtures: log-densities and responsibilities from the
    definition, EM, and the isotropic EM = Newton identity.
numerics
    The shared numerical cores: log-sum-exp, softmax and its backward,
    softplus, with the per-row maximum subtracted.
scan
    The cores of normalised feature-map attention that linear attention and
    GMA share: bidirectional (write, then read) and causal, token by token
    and in chunks, forward and backward.
attention
    Softmax attention, linear attention and attention with given feature maps.
gma
    Gaussian Mixture Attention, bidirectional and causal, with its
    hand-derived backward, and the streaming state of one head.
theory
    The responsibility Jacobian, Lipschitz and gradient bounds, and the
    structure of the implicit affinity.
gmr
    Gaussian kernel regression, Gaussian Mixture Regression, and the OVQ
    read-out as GMR.
ovq
    Online Vector-Quantized attention and the static VQ baseline.
ovq_oracle
    The token-by-token loop oracles for OVQ and VQ, written straight from the
    contract in ``docs/derivations/ovq_gmr.md``.
validation
    The argument checks of every public function (each makes one call).
boundary
    The public functions that :mod:`tuned`, :mod:`cpu` and :mod:`gpu` share
    with the reference, written once (signature, defaults, docstring,
    checks), and the record of kernels that binds them to a backend.
varlen
    Packed variable-length batches: the sequences one after another, cut
    by ``cu_seqlens``, each computed as on its own.
statefile
    The ``.npz`` files of the stream states (``OVQState``, ``GMAState``).
tuned
    The GMM and GMA functions computed the fast way (the expansion of the
    square with its cancellation screen, cache-sized blocks, reductions as
    matrix products): what the application (:mod:`app`) calls under NumPy.
gradcheck
    Central differences of a scalar loss, for the gradient checks.
testing
    What the tests and ``verify`` share: tolerances, problem builders,
    definition-level oracles.
verify
    The registry of numerical verifications run by ``python -m refimpl verify``.

``import refimpl`` needs NumPy and SciPy only.  The kernels that mirror it
(:mod:`cpu`, :mod:`gpu`) import it, and the application built on them, the
model, its training and the experiments (:mod:`app`, ``python -m app``),
imports those; nothing here imports any of them.
"""

from . import attention, boundary, gma, gmm, gmr, numerics, ovq, ovq_oracle, scan, statefile, theory, tuned, validation, varlen

__all__ = ["attention", "boundary", "gma", "gmm", "gmr", "numerics", "ovq", "ovq_oracle", "scan", "statefile", "theory", "tuned", "validation",
           "varlen"]
__version__ = "0.1.0"
