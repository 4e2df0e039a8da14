"""refimpl: a readable NumPy reference for Gaussian-mixture attention mechanisms.

Modules
-------
gmm
    Diagonal Gaussian mixtures: log-densities, responsibilities, EM, and the
    isotropic EM = Newton identity.
numerics
    The shared numerical cores: log-sum-exp, softmax and softplus with the
    per-row maximum subtracted.
validation
    Argument checks shared by the public functions (each makes one call).
scan
    Normalised feature-map attention: the linear-time scan, bidirectional and
    causal, forward and backward, that linear attention and GMA share.
attention
    Baselines: softmax attention and linear attention.
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
    The token-by-token loop oracles for OVQ and VQ, written straight from the
    contract in ``docs/derivations/ovq_gmr.md``.
model
    A small classifier or language model, every piece a hand-derived
    forward/backward pair: embedding, positions, pre-norm residual blocks with
    an interchangeable mixer (GMA, softmax, linear or OVQ attention), MLP,
    layer norm, heads and softmax cross-entropy.
optim
    AdamW with global-norm gradient clipping.
tasks
    The generated training tasks: ListOps-mini and a Markov language model.
train
    The training loop of ``python -m refimpl train``: progress, CSV log,
    checkpoints that resume bit for bit.
interpret
    What a trained GMA learned: used components, usage entropy, NMI against
    token categories, and the gradient bounds on the trained model.
verify
    The registry of numerical verifications run by ``python -m refimpl verify``.
"""

from . import attention, gma, gmm, gmr, interpret, layers, model, numerics, optim, ovq, ovq_oracle, scan, tasks, theory, train, validation

__all__ = [
    "attention", "gma", "gmm", "gmr", "interpret", "layers", "model", "numerics", "optim", "ovq", "ovq_oracle", "scan",
    "tasks", "theory", "train", "validation",
]
__version__ = "0.1.0"
