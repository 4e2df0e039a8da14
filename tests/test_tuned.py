"""refimpl.tuned on the problem its screen exists for: means spread far apart.

``refimpl.gmm`` and ``refimpl.gma`` are the definitions (the differences
``x - mu``, per-token sums); ``refimpl.tuned`` expands the square, screens
for cancellation and sums by matrix products.  Its outputs, gradients and
refusals are held to the reference with every other backend's in
tests/test_conformance.py; here, the inputs where the expansion alone would
lose every digit.
"""

from __future__ import annotations

import numpy as np

from refimpl import gma, tuned


def test_gma_agrees_on_the_spread_means_problem():
    """Means spread far apart: the tuned expansion is screened and repaired, so GMA on top of it is right too."""
    rng = np.random.default_rng(2)
    x_q, x_k, v, means = rng.normal(size=(40, 3)), rng.normal(size=(40, 3)), rng.normal(size=(40, 2)), rng.normal(size=(4, 3))
    weights = np.full(4, 0.25)
    means = means * 1e5
    x_q, x_k = means[np.arange(40) % 4] + 1e-3 * x_q, means[np.arange(40) % 4] + 1e-3 * x_k
    variances = np.full_like(means, 1e-6)
    np.testing.assert_allclose(tuned.gma(x_q, x_k, v, means, variances, weights), gma.gma(x_q, x_k, v, means, variances, weights), rtol=1e-12, atol=1e-12)
