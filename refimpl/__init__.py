"""refimpl: a readable NumPy reference for Gaussian-mixture attention mechanisms.

Modules
-------
gmm
    Diagonal Gaussian mixtures: log-densities, responsibilities, EM, and the
    isotropic EM = Newton identity.
attention
    Baselines: softmax attention, linear attention, and the chunked causal
    scan that linear attention and GMA share.
gma
    Gaussian Mixture Attention, bidirectional and causal, with its
    hand-derived backward.
layers
    A multi-head GMA layer with Q/K/V/output projections.
theory
    The responsibility Jacobian, Lipschitz and gradient bounds, and the
    structure of the implicit affinity.
gmr
    Gaussian kernel regression, Gaussian Mixture Regression, and the OVQ
    read-out as GMR.
ovq
    Online Vector-Quantized attention and the static VQ baseline.
ovq_oracle
    The token-by-token loop oracle for OVQ, written straight from the spec.
verify
    The registry of numerical verifications run by ``python -m refimpl verify``.
"""

from . import attention, gma, gmm, gmr, layers, ovq, ovq_oracle, theory

__all__ = ["attention", "gma", "gmm", "gmr", "layers", "ovq", "ovq_oracle", "theory"]
__version__ = "0.1.0"
