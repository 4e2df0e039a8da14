// The result checks of gpu/cupy_kernels: one counter pair per check in a small device array that is copied to the
// host once per public call (Checks in _backend.py).  check_fail comes from rows.cuh, which RawModuleSource puts in
// front of this file.
//
// mode 0: the entry is not finite (refimpl.validation.check_finite, check_scaled_distances, check_score_maxima and
//         the overflowed rows of refimpl.ovq.check_overflow: NaN or an infinity);
// mode 1: the entry is not > 0 (refimpl.validation.check_denominators with eps = 0: a zero, negative or NaN den).
// Launch: a grid-stride loop over the n entries of a contiguous array, any grid.
template <typename T>
__device__ void count_bad(const T* x, long long n, int mode, unsigned long long* check) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T v = x[i];
        const bool bad = mode == 0 ? !isfinite(v) : !(v > T(0));
        if (bad) check_fail(check, i);
    }
}

extern "C" __global__ void count_bad_f32(const float* x, long long n, int mode, unsigned long long* check) {
    count_bad<float>(x, n, mode, check);
}

extern "C" __global__ void count_bad_f64(const double* x, long long n, int mode, unsigned long long* check) {
    count_bad<double>(x, n, mode, check);
}
