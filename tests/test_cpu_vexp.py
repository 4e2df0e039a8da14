"""cpu.vexp.exp, the exponential of the CPU kernels: within 2 ulp of np.exp on the whole range, and vectorised.

Distances are counted in units in the last place as the difference of the
two results' bit patterns (exp is never negative, so the bit patterns of its
results are ordered like the numbers): 1 between neighbours, and between the
largest finite number and ``inf``; 0 and the subnormals are counted the same
way.
"""

from __future__ import annotations

import platform
import re

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from cpu import vexp  # noqa: E402

DTYPES = [np.float64, np.float32]
INT = {np.float64: np.int64, np.float32: np.int32}
# the range where exp is neither 0 nor inf, a little beyond on both sides
RANGE = {np.float64: (-746.0, 710.0), np.float32: (-104.0, 89.0)}


def ulps(got, want):
    """``|bits(got) - bits(want)|`` entry by entry for results >= 0; -1 where one is NaN and the other is not."""
    it = INT[got.dtype.type]
    d = np.abs(got.view(it).astype(np.int64) - want.view(it).astype(np.int64))
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    d[nan_got & nan_want] = 0
    d[nan_got != nan_want] = -1
    return d


def random_points(dtype, n, seed):
    """Half uniform over the interesting range, half random bit patterns (every finite number, either sign)."""
    rng = np.random.default_rng(seed)
    lo, hi = RANGE[dtype]
    uniform = rng.uniform(lo, hi, n // 2).astype(dtype)
    it = INT[dtype]
    info = np.iinfo(it)
    bits = rng.integers(info.min, info.max, n - n // 2, dtype=it, endpoint=True).view(dtype)
    return np.concatenate([uniform, bits[np.isfinite(bits)]])


def edges(dtype):
    """0, -0, inf, -inf, NaN, the overflow and underflow thresholds and their neighbours, the subnormal range,
    reduction boundaries, tiny and huge arguments."""
    f = np.finfo(dtype)
    big = np.log(np.float64(f.max))  # exp is finite below, inf above
    small = np.log(np.float64(f.smallest_normal))  # below: subnormal results
    zero = np.log(np.float64(f.smallest_subnormal)) - np.log(2.0)  # below: exp rounds to 0
    points = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, f.eps, -f.eps, f.tiny, -f.tiny,
              f.smallest_subnormal, -f.smallest_subnormal, f.max, -f.max, 1e30, -1e30]
    for c in (big, small, zero):
        x = dtype(c)
        for _ in range(8):  # the threshold and its neighbours on both sides
            points.append(x)
            x = np.nextafter(x, dtype(np.inf))
        x = dtype(c)
        for _ in range(8):
            x = np.nextafter(x, dtype(-np.inf))
            points.append(x)
    points += list(np.linspace(small, zero - 1, 2001))  # across the subnormal results and the step to 0
    half = np.log(2.0) / 2
    for k in range(-160, 160):  # where the reduction changes k, and k ln 2 itself
        points += [k * np.log(2.0) + half, k * np.log(2.0) - half, k * np.log(2.0)]
    with np.errstate(over="ignore"):
        x = np.array(points, dtype=np.float64).astype(dtype)
        return np.concatenate([x, np.nextafter(x, dtype(np.inf)), np.nextafter(x, dtype(-np.inf))])


@pytest.mark.parametrize("dtype", DTYPES)
def test_within_two_ulp_of_numpy_at_a_million_points(dtype):
    x = random_points(dtype, 1_000_000, seed=1)
    with np.errstate(over="ignore"):
        want = np.exp(x)
    got = vexp.exp_array(x)
    assert got.dtype == dtype and got.shape == x.shape
    d = ulps(got, want)
    assert d.min() >= 0, x[d < 0][:5]
    assert d.max() <= 2, (x[np.argmax(d)], got[np.argmax(d)], want[np.argmax(d)])
    # inf and 0 exactly where NumPy has them
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(got == 0, want == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_within_two_ulp_of_numpy_at_the_edges(dtype):
    x = edges(dtype)
    with np.errstate(over="ignore"):
        want = np.exp(x)
    got = vexp.exp_array(x)
    d = ulps(got, want)
    assert d.min() >= 0, x[d < 0][:5]
    assert d.max() <= 2, (x[np.argmax(d)], got[np.argmax(d)], want[np.argmax(d)])
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(got == 0, want == 0)
    specials = {0.0: 1.0, np.inf: np.inf, -np.inf: 0.0}
    for arg, value in specials.items():
        assert vexp.exp_array(np.array([arg], dtype))[0] == value
    assert vexp.exp_array(np.array([-0.0], dtype))[0] == 1.0
    assert np.isnan(vexp.exp_array(np.array([np.nan], dtype))[0])
    # results in the subnormal range are there, not flushed to 0
    f = np.finfo(dtype)
    sub = got[(want > 0) & (want < f.smallest_normal)]
    assert sub.size > 100 and np.all(sub > 0)


def test_float64_within_one_ulp_of_the_exponential_in_extended_precision():
    if np.finfo(np.longdouble).nmant <= np.finfo(np.float64).nmant:
        pytest.skip("np.longdouble is float64 here")
    x = np.random.default_rng(2).uniform(-745.0, 709.7, 200_000)
    exact = np.exp(x.astype(np.longdouble)).astype(np.float64)
    assert ulps(vexp.exp_array(x), exact).max() <= 1


def test_float32_is_the_correctly_rounded_exponential_almost_everywhere():
    """Computed in float64 and rounded once: off the float64 exponential rounded to float32 by 1 ulp at most, and
    that for fewer than 0.1% of the arguments (those within about 1e-10 of a rounding boundary)."""
    x = np.random.default_rng(3).uniform(-104.0, 89.0, 1_000_000).astype(np.float32)
    with np.errstate(over="ignore"):
        rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    d = ulps(vexp.exp_array(x), rounded)
    assert d.max() <= 1
    assert np.count_nonzero(d) <= 1e-3 * x.size


def test_inside_kernels_the_scalar_form_gives_the_same_bits():
    @numba.njit
    def scalar(a):
        return vexp.exp(a)

    for dtype in DTYPES:
        x = random_points(dtype, 2000, seed=4)
        one_by_one = np.array([scalar(v) for v in x], dtype=dtype)
        assert np.array_equal(one_by_one, vexp.exp_array(x), equal_nan=True)
    # outside compiled code it is NumPy's
    assert vexp.exp(np.float64(1.5)) == np.exp(1.5)


def test_refuses_other_dtypes():
    with pytest.raises(TypeError, match="expected a float64 or float32 array, got int64"):
        vexp.exp_array(np.arange(3))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="reads x86 machine code")
def test_the_loop_is_vectorised():
    """The machine code of the array loop has packed fused multiply-adds on 256- or 512-bit registers."""
    import llvmlite.binding as ll

    features = ll.get_host_cpu_features()
    if not (features.get("avx2") and features.get("fma")):
        pytest.skip("the host has no AVX2 and FMA")
    @numba.njit(error_model="numpy")  # not cached: the machine code of a cached function cannot be read back
    def loop(x, out):
        for i in range(x.shape[0]):
            out[i] = vexp.exp(x[i])

    for dtype in DTYPES:
        x = np.zeros(16, dtype)
        loop(x, np.empty_like(x))
    for sig, asm in loop.inspect_asm().items():
        # packed double FMAs (float32 is computed in float64 too): Horner's rule on 4 or 8 lanes at a time
        packed = re.findall(r"\bvfmadd\d+pd\s+[^\n]*%[yz]mm", asm)
        assert len(packed) >= 8, (sig, len(packed))
