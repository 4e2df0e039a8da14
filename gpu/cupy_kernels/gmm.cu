// Row kernels of gpu/cupy_kernels/gmm.py: the log-sum-exp and the normalisation of the GMM logits, fused.
//
// The GEMM (cupy.matmul) has written t_ik = sum_j [xc_ij^2, xc_ij] . [-p_kj / 2, mc_kj p_kj], the expanded
// -q_ik / 2 without its constant; one warp per row finishes the row in two passes over its K entries.
// Arrays are C-contiguous; row r of t belongs to the mixture h = (r / N) % H.
// neg_inf, lse_combine, nan_max, lse_absorb and warp_lse_max come from rows.cuh, which RawModuleSource puts in front of this file.

// half_ik = t_ik + shift_hk          (-q/2 = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj - c_k / 2)
// l_ik = half_ik + log_norm_hk       (l_ik = log_norm_k - q_ik / 2)
// min_quad_i = -2 max_k half_ik      (min_k q_ik = -2 max_k (-q_ik / 2))
// softmax(a) = softmax(a - m) per row, m the row maximum (0 where not finite): gamma = exp(l - m) * (1 / s),
// or log gamma = (l - m) - log s with s = sum_k exp(l_k - m).
// Launch: blockDim (32, ROWS_PER_BLOCK); warp y of block x owns row r = x ROWS_PER_BLOCK + y; lane k0 strides
// over k = k0, k0 + 32, ... [K].  Pass 1 keeps the lane's running (m, s) and max half, combined across the
// warp by a fixed xor butterfly (no shared memory, no atomics); pass 2 overwrites t with the result.
template <typename T>
__device__ void posterior_rows(T* t, const T* shift, const T* log_norm, T* min_quad,
                               long long R, int K, long long N, int H, int log_out) {
    const long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= R) return;
    const int lane = threadIdx.x;
    const long long h = (r / N) % H;
    T* row = t + r * K;
    const T* sh = shift + h * K;
    const T* ln = log_norm + h * K;
    const T ninf = neg_inf<T>();
    T m = ninf, s = T(0), hmax = ninf;
    for (int k = lane; k < K; k += 32) {
        const T half = row[k] + sh[k];
        const T l = half + ln[k];
        hmax = nan_max(hmax, half);
        lse_absorb(m, s, l);
    }
    warp_lse_max(m, s, hmax);
    if (lane == 0) min_quad[r] = T(-2) * hmax;
    const T shift_m = isfinite(m) ? m : T(0);
    if (log_out) {
        const T log_s = log(s);
        for (int k = lane; k < K; k += 32) {
            const T l = (row[k] + sh[k]) + ln[k];
            row[k] = (l - shift_m) - log_s;
        }
    } else {
        const T inv_s = T(1) / s;
        for (int k = lane; k < K; k += 32) {
            const T l = (row[k] + sh[k]) + ln[k];
            row[k] = exp(l - shift_m) * inv_s;
        }
    }
}

extern "C" __global__ void posterior_rows_f32(float* t, const float* shift, const float* log_norm, float* min_quad,
                                              long long R, int K, long long N, int H, int log_out) {
    posterior_rows<float>(t, shift, log_norm, min_quad, R, K, N, H, log_out);
}

extern "C" __global__ void posterior_rows_f64(double* t, const double* shift, const double* log_norm, double* min_quad,
                                              long long R, int K, long long N, int H, int log_out) {
    posterior_rows<double>(t, shift, log_norm, min_quad, R, K, N, H, log_out);
}
