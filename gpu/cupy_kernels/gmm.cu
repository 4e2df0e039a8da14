// Row kernels of gpu/cupy_kernels/gmm.py: the log-sum-exp and the normalisation of the GMM logits, fused.
//
// The GEMM (cupy.matmul) has written t_ik = sum_j [xc_ij^2, xc_ij] . [-p_kj / 2, mc_kj p_kj], the expanded
// -q_ik / 2 without its constant; one warp per row finishes the row in two passes over its K entries.
// Arrays are C-contiguous; row r of t belongs to the mixture h = (r / N) % H.
// neg_inf, lse_combine, nan_max, lse_absorb and warp_lse_max come from rows.cuh, which RawModuleSource puts in front of this file.

// The GEMM's input [xc^2, xc] of every row, and the count of the non-finite entries of x (the check of
// refimpl.validation.check_finite for a device input, folded into the pass that reads x anyway):
//   xc_ij = x_ij - centre_hj            ((x - mu)^2 is invariant under a common shift: centre on the mean of the means)
//   xcat_i = [xc_i^2, xc_i]             (R, 2d), row r of mixture h = (r / N) % H
// Launch: a grid-stride loop over the R d entries of x (contiguous); bad (a check pair) is read only when count_x.
template <typename T>
__device__ void centre_square(const T* x, const T* centre, T* xcat, long long R, int d, long long N, int H,
                              unsigned long long* bad, int count_x) {
    const long long total = R * d;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long r = e / d;
        const int j = (int)(e - r * d);
        const long long h = (r / N) % H;
        const T v = x[e];
        if (count_x && !isfinite(v)) check_fail(bad, e);
        const T xc = v - centre[h * d + j];
        xcat[r * 2 * d + j] = xc * xc;
        xcat[r * 2 * d + d + j] = xc;
    }
}

extern "C" __global__ void centre_square_f32(const float* x, const float* centre, float* xcat, long long R, int d,
                                             long long N, int H, unsigned long long* bad, int count_x) {
    centre_square<float>(x, centre, xcat, R, d, N, H, bad, count_x);
}

extern "C" __global__ void centre_square_f64(const double* x, const double* centre, double* xcat, long long R, int d,
                                             long long N, int H, unsigned long long* bad, int count_x) {
    centre_square<double>(x, centre, xcat, R, d, N, H, bad, count_x);
}

// The fused epilogue of the GEMM: one pass of one warp over each row's K entries.
// half_ik = t_ik + shift_hk          (-q/2 = -(1/2) sum_j xc_j^2 p_kj + sum_j xc_j mc_kj p_kj - c_k / 2)
// l_ik = half_ik + log_norm_hk       (l_ik = log_norm_k - q_ik / 2)
// min_quad_i = -2 max_k half_ik      (min_k q_ik = -2 max_k (-q_ik / 2))
// softmax(a) = softmax(a - m) per row, m the row maximum (0 where not finite): gamma = exp(l - m) * (1 / s),
// or log gamma = (l - m) - log s with s = sum_k exp(l_k - m).
// With screen, the screen of refimpl.tuned (row_size_bound, suspect_rows) on the same row:
//   s_i = (sqrt(sum_j xc_ij^2 max_k p_kj) + sqrt(max_k c_k))^2, suspect unless s_i <= max(screen_limit, 16 min_quad_i)
//   (NaN is suspect); a suspect row adds to the check suspect, a min_quad that is not finite to mq_bad.
// Launch: blockDim (32, ROWS_PER_BLOCK); warp y of block x owns row r = x ROWS_PER_BLOCK + y; lane k0 strides
// over k = k0, k0 + 32, ... [K].  Pass 1 keeps the lane's running (m, s) and max half, combined across the
// warp by a fixed xor butterfly (no shared memory, no atomics but the checks' integer counters); pass 2
// overwrites t with the result (the row is read again from cache).
template <typename T>
__device__ void posterior_rows(T* t, const T* shift, const T* log_norm, T* min_quad,
                               long long R, int K, long long N, int H, int log_out,
                               const T* xcat, int d, const T* max_precision, const T* root_max_sq_mu, T screen_limit,
                               int screen, unsigned long long* mq_bad, unsigned long long* suspect) {
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
    const T mq = T(-2) * hmax;
    if (lane == 0) min_quad[r] = mq;
    if (screen) {
        T acc = T(0);
        const T* xc2 = xcat + r * 2 * d;
        const T* mp = max_precision + h * d;
        for (int j = lane; j < d; j += 32) acc += xc2[j] * mp[j];
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        T size = sqrt(acc) + root_max_sq_mu[h];
        size *= size;
        const T ratio_bound = T(16) * mq;  // CANCELLATION_RATIO min_quad
        const T bound = mq != mq ? mq : (screen_limit > ratio_bound ? screen_limit : ratio_bound);
        if (lane == 0) {
            if (!(size <= bound)) check_fail(suspect, r);
            if (!isfinite(mq)) check_fail(mq_bad, r);
        }
    }
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

#define POSTERIOR_ROWS_ARGS(T) T* t, const T* shift, const T* log_norm, T* min_quad, long long R, int K, long long N, \
    int H, int log_out, const T* xcat, int d, const T* max_precision, const T* root_max_sq_mu, T screen_limit, \
    int screen, unsigned long long* mq_bad, unsigned long long* suspect
#define POSTERIOR_ROWS_PASS t, shift, log_norm, min_quad, R, K, N, H, log_out, xcat, d, max_precision, root_max_sq_mu, \
    screen_limit, screen, mq_bad, suspect

extern "C" __global__ void posterior_rows_f32(POSTERIOR_ROWS_ARGS(float)) { posterior_rows<float>(POSTERIOR_ROWS_PASS); }
extern "C" __global__ void posterior_rows_f64(POSTERIOR_ROWS_ARGS(double)) { posterior_rows<double>(POSTERIOR_ROWS_PASS); }
