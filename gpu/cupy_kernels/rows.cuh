// Device helpers shared by the row kernels of gpu.cupy_kernels (gmm.cu, attention.cu, ovq.cu).
// RawModuleSource puts this file in front of each of them, for CuPy and for the NVRTC check alike.

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// (m, s) with s = sum exp(l - m): the pair of a running log-sum-exp.  Combining two pairs is symmetric
// (IEEE addition and multiplication commute), so every lane of a butterfly ends with the same bits.
template <typename T>
__device__ __forceinline__ void lse_combine(T& m, T& s, T m_o, T s_o) {
    const T ninf = neg_inf<T>();
    const T big = m_o > m ? m_o : m;
    const T a = (m == ninf) ? T(0) : s * exp(m - big);
    const T b = (m_o == ninf) ? T(0) : s_o * exp(m_o - big);
    m = big;
    s = a + b;
}

// NaN-propagating maximum (NumPy's max; the reference's argmax stops at the first NaN): NaN if either is NaN,
// else the larger; the same on every lane.
template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
    return (b > a || b != b) && a == a ? b : a;
}

// (m, s) absorbs one logit l: s = sum exp(l - m), rescaled by exp(m_old - m_new) when the maximum grows;
// a logit of -inf adds nothing (and -inf - (-inf) is never formed).
template <typename T>
__device__ __forceinline__ void lse_absorb(T& m, T& s, T l) {
    if (l > m) {
        s = s * exp(m - l) + T(1);
        m = l;
    } else if (l != neg_inf<T>()) {
        s += exp(l - m);
    }
}

// The lanes' pairs (m, s) and NaN-propagating maxima mx, combined across the warp by a fixed xor butterfly
// (no shared memory, no atomics): afterwards every lane holds the same bits.
template <typename T>
__device__ __forceinline__ void warp_lse_max(T& m, T& s, T& mx) {
    for (int off = 16; off > 0; off >>= 1) {
        const T m_o = __shfl_xor_sync(0xffffffffu, m, off);
        const T s_o = __shfl_xor_sync(0xffffffffu, s, off);
        const T x_o = __shfl_xor_sync(0xffffffffu, mx, off);
        lse_combine(m, s, m_o, s_o);
        mx = nan_max(mx, x_o);
    }
}

// A result check (gpu/cupy_kernels/_backend.py, Checks): the pair (count, first) of unsigned 64-bit counters, how
// many entries failed and the smallest flat index among them (~0 while none has).  Integer atomics only: the totals
// and the minimum do not depend on the order in which the threads get there.
__device__ __forceinline__ void check_fail(unsigned long long* check, long long i) {
    atomicAdd(check, 1ULL);
    atomicMin(check + 1, (unsigned long long)i);
}
