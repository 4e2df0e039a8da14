"""refimpl: a readable NumPy reference for Gaussian-mixture attention mechanisms.

Modules
-------
gmm
    Diagonal Gaussian mixtures: log-densities, responsibilities, EM, and the
    isotropic EM = Newton identity.
verify
    The registry of numerical verifications run by ``python -m refimpl verify``.
"""

from . import gmm

__all__ = ["gmm"]
__version__ = "0.1.0"
