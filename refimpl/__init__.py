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
files
    The output folder and the CSV files that training and the experiments
    write and read back: checked before anything is written, refused naming
    the file and line when damaged.
interpret
    What a trained GMA learned: used components, usage entropy, NMI against
    token categories, and the gradient bounds on the trained model.
validation
    The argument checks of every public function (each makes one call).
statefile
    The ``.npz`` files of the stream states (``OVQState``, ``GMAState``).
tuned
    The GMM and GMA functions computed the fast way (the expansion of the
    square with its cancellation screen, cache-sized blocks, reductions as
    matrix products): what the model, training and the experiments call.
verify
    The registry of numerical verifications run by ``python -m refimpl verify``.
"""

from . import attention, files, gma, gmm, gmr, interpret, layers, model, numerics, optim, ovq, ovq_oracle, scan, statefile, tasks, theory, train, tuned, validation

__all__ = [
    "attention", "files", "gma", "gmm", "gmr", "interpret", "layers", "model", "numerics", "optim", "ovq", "ovq_oracle", "scan",
    "statefile", "tasks", "theory", "train", "tuned", "validation",
]
__version__ = "0.1.0"
