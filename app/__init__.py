"""app: the application built on the mechanisms: a small model trained end to end, and the experiments.

The floors of the project, each importing only those below it:

1. :mod:`refimpl`, the mechanisms (NumPy and SciPy only);
2. :mod:`cpu` and :mod:`gpu`, the kernels that mirror them;
3. this package, which calls either through :mod:`app.backend`;
4. the tutorials, the benchmarks and the tests.

Modules
-------
backend
    Which kernels the model, training and the experiments call: NumPy
    (:mod:`refimpl.tuned`, :mod:`refimpl.attention`, :mod:`refimpl.ovq`) or the
    Numba CPU backend (:mod:`cpu`); ``--backend numpy|numba``.
layers
    A multi-head GMA layer with Q/K/V/output projections.
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
    The training loop of ``python -m app train``: progress, CSV log,
    checkpoints that resume bit for bit.
interpret
    What a trained GMA learned: used components, usage entropy, NMI against
    token categories, and the gradient bounds on the trained model.
files
    The output folder and the CSV files that training and the experiments
    write and read back: checked before anything is written, refused naming
    the file and line when damaged.
experiments
    The sweeps of ``python -m app experiment``: recall, regression, scaling,
    continual and positional.
"""

from . import backend, files, interpret, layers, model, optim, tasks, train

__all__ = ["backend", "files", "interpret", "layers", "model", "optim", "tasks", "train"]
