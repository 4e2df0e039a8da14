"""gpu.cupy_kernels on the host: the generic array code (``xp = numpy``) against refimpl, and the backend's plumbing.

Every public function of the CuPy backend is ``f_xp(cupy, ...)``; here the
same code runs with ``f_xp(numpy, ...)``, where each fused kernel is replaced
by its NumPy twin, and must equal refimpl.  The public functions' outputs,
gradients, dtypes and refusals are held to refimpl in
tests/test_conformance.py (backend ``cupy_host``); here, the pieces under
them: the recomputation of suspect rows, the per-head layout, the scan and
its chunk twin, the parameter maps.  The kernels themselves are compared with
their twins in tests/test_cupy_device.py (on a GPU).
"""

import importlib

import numpy as np
import pytest

from gpu.cupy_kernels import _backend, attention, gmm, scan
from gpu.cupy_kernels import on_host
from refimpl import gmm as ref_gmm
from refimpl import numerics
from refimpl import scan as ref_scan

gma = importlib.import_module("gpu.cupy_kernels.gma")  # the package's attribute gma is the function

RTOL = {np.float64: 1e-10, np.float32: 1e-5}


def _close(a, b, dtype=np.float64, atol=None):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=RTOL[dtype], atol=RTOL[dtype] if atol is None else atol)


# ---------------------------------------------------------------------------
# Responsibilities
# ---------------------------------------------------------------------------


def test_responsibilities_far_apart_means_need_the_recomputation():
    # means 1e6 apart, tight components: the expansion cancels; the recomputed entries decide the posterior
    rng = np.random.default_rng(1)
    means = np.array([[1e7, 0.0], [1e7 + 0.01, 0.0], [-1e7, 3.0]])
    variances = np.full((3, 2), 1e-4)
    weights = np.array([0.3, 0.3, 0.4])
    x = means[[0, 1, 0, 2]] + rng.normal(scale=0.005, size=(4, 2))
    ref = ref_gmm.responsibilities(x, means, variances, weights)
    _close(on_host.responsibilities(x, means, variances, weights), ref)
    # without the recomputation the expansion is visibly wrong here: the test above guards the refinement
    ex = gmm.expansion(np, means[None], variances[None], np.log(weights)[None])
    plain, _ = gmm.posterior_xp(np, x[None, None], ex, refine=False)
    assert np.max(np.abs(plain[0, 0] - ref)) > 1e-6


def _definition(x, means, variances, log_weights):
    """The responsibilities and min_quad of refimpl.gmm, from the differences x - mu."""
    logits, min_quad = ref_gmm.log_joint(x, means, variances, log_weights)
    return numerics.softmax(logits, axis=1), min_quad


def test_responsibilities_zero_weight_and_per_head_layout():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 6, 2))  # G = 2 groups of H = 3 heads
    means = rng.normal(size=(3, 4, 2))
    variances = rng.uniform(0.5, 1.5, size=(3, 4, 2))
    weights = rng.dirichlet(np.ones(4), size=3)
    weights[1, 2] = 0.0
    weights[1] /= weights[1].sum()
    with np.errstate(divide="ignore"):
        log_weights = np.log(weights)
    gamma, min_quad = gmm.posterior_xp(np, x, gmm.expansion(np, means, variances, log_weights))
    for g in range(2):
        for h in range(3):
            ref, ref_mq = _definition(x[g, h], means[h], variances[h], log_weights[h])
            _close(gamma[g, h], ref)
            _close(min_quad[g, h], ref_mq)
    assert np.all(gamma[:, 1, :, 2] == 0)


def test_recomputed_rows_land_in_their_sequence_and_head():
    # G = 2 groups of H = 2 heads; only head 1 has far-apart tight means, so only its rows are redone
    rng = np.random.default_rng(9)
    means = np.stack([rng.normal(size=(3, 2)), np.array([[1e7, 0.0], [1e7 + 0.01, 0.0], [-1e7, 3.0]])])
    variances = np.stack([np.ones((3, 2)), np.full((3, 2), 1e-4)])
    log_weights = np.log(np.full((2, 3), 1 / 3))
    x = rng.normal(size=(2, 2, 5, 2))
    x[:, 1] = means[1][rng.integers(0, 3, size=(2, 5))] + rng.normal(scale=0.005, size=(2, 5, 2))
    gamma, min_quad = gmm.posterior_xp(np, x, gmm.expansion(np, means, variances, log_weights))
    for g in range(2):
        for h in range(2):
            ref, ref_mq = _definition(x[g, h], means[h], variances[h], log_weights[h])
            _close(gamma[g, h], ref)
            _close(min_quad[g, h], ref_mq)


# ---------------------------------------------------------------------------
# The scan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N, chunk", [(1, 64), (7, 3), (9, 1), (12, 4), (5, 64)])
def test_scan_matches_refimpl(causal, N, chunk):
    rng = np.random.default_rng(N * 10 + chunk)
    S, F, dv = 3, 4, 2
    pq, pk = rng.random((S, N, F)), rng.random((S, N, F))
    v, g = rng.normal(size=(S, N, dv)), rng.normal(size=(S, N, dv))
    out, den = scan.scan_forward_xp(np, pq, pk, v, causal, 1e-6, chunk)
    grads = scan.scan_backward_xp(np, g, pq, pk, v, out, den, causal, chunk)
    for s in range(S):
        ref_out, cache = ref_scan.scan_forward(pq[s], pk[s], v[s], causal, 1e-6, chunk)
        _close(out[s], ref_out)
        _close(den[s], cache.den)
        for ours, ref in zip(grads, ref_scan.scan_backward(g[s], cache)):
            _close(ours[s], ref)


@pytest.mark.parametrize("upper", [False, True])
def test_chunk_twin_is_the_masked_block(upper):
    # out_t += sum_{j in chunk(t), j <= t (or >= t)} (A_t . B_j) C_j, summed pair by pair
    rng = np.random.default_rng(4)
    S, N, F, W, chunk = 2, 6, 3, 2, 3
    A, B, C = rng.normal(size=(S, N, F)), rng.normal(size=(S, N, F)), rng.normal(size=(S, N, W))
    base = rng.normal(size=(S, N, W))
    out = scan.chunk_tri(np, A, B, C, base.copy(), chunk, upper)
    expected = base.copy()
    for s in range(S):
        for t in range(N):
            for j in range(N):
                if j // chunk == t // chunk and (j >= t if upper else j <= t):
                    expected[s, t] += (A[s, t] @ B[s, j]) * C[s, j]
    _close(out, expected)


# ---------------------------------------------------------------------------
# GMA
# ---------------------------------------------------------------------------


def test_parameter_maps_match_refimpl():
    rng = np.random.default_rng(7)
    s = np.concatenate([rng.normal(size=20) * 30, [0.0, -800.0, 800.0]])
    np.testing.assert_array_equal(gma.softplus_floor(s, 1e-6), ref_gmm.variances_from_raw(s, 1e-6))
    g = rng.normal(size=s.shape)
    np.testing.assert_array_equal(gma.sigmoid_chain(g, s), g * ref_gmm.sigmoid(s))
    logits = rng.normal(size=(3, 5)) * 100
    lw = logits.copy()
    zeros = np.zeros((1, 5))
    gmm.normalise_rows(np, lw, zeros, zeros, 3, log=True)
    np.testing.assert_array_equal(lw, ref_gmm.log_softmax(logits))


# ---------------------------------------------------------------------------
# The backend's plumbing
# ---------------------------------------------------------------------------


def test_numpy_inputs_without_a_device_raise_naming_the_backend():
    ok, why = _backend.probe()
    assert isinstance(ok, bool) and why
    if ok:
        pytest.skip(f"a CUDA device is usable here ({why}): the error without one cannot be shown")
    x = np.zeros((2, 2))
    for call in (lambda: gmm.responsibilities(x, x, np.ones((2, 2)), np.full(2, 0.5)),
                 lambda: attention.softmax_attention(x, x, x),
                 lambda: gma.gma(x, x, x, x, np.ones((2, 2)), np.full(2, 0.5))):
        with pytest.raises(RuntimeError, match="GPU backend 'cupy' is not available: "):
            call()


def test_result_keeps_numpy_and_twins_run_without_a_device():
    a = np.arange(3.0)
    assert _backend.result(a, False) is a
    assert _backend.device_module.__doc__
    np.testing.assert_array_equal(scan.row_dot(np.ones((2, 3)), np.full((2, 3), 2.0)), [6.0, 6.0])
    assert _backend.as_module_array(np, [1, 2], np.float32).dtype == np.float32
