// Kernels of gpu/cupy_kernels/ovq.py: the read-out rows of one chunk (with the intra-chunk causal step), and the
// merge of a chunk's keys and values into the dictionary rows, in token order.
//
// Products that round once in refimpl (logits *= beta; logits[:, :n] += log_c; D + eta (x - D); (c D + sum) / c') use the
// _rn intrinsics, which the compiler never contracts into a fused multiply-add: the same bits as NumPy.
// neg_inf, lse_combine, nan_max, lse_absorb and warp_lse_max come from rows.cuh, which RawModuleSource puts in front of this file.

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// The read-out of one chunk (refimpl.ovq._chunk_logits and _run; refimpl.ovq._vq):
//   logits *= beta; logits[:, :n] += log_c   (a centroid of count c stands for c tokens: weight pi ~ c, logit + log c)
//   causal inside the chunk: position a sees the chunk keys b <= a only   (columns n + b, b > a, get -inf)
//   row_max_a = max_u logits_au   (the caller refuses rows where it is not finite: overflow)
//   o_a = softmax(l_a) [D_v[:n]; v_0..v_a]: here the rows become softmax(l_a), the product is a GEMM afterwards
// t (L, n + L) holds q^_a . [D_k[:n]; k^]_u from the GEMM (VQ: [codebook; codebook[z]]), rows contiguous; bias (n,)
// is log c (VQ: log L_m, -inf for an unused code), read only when use_bias.
// Launch: blockDim (32, ROWS_PER_BLOCK); warp y of block x owns row a = x ROWS_PER_BLOCK + y, its lanes stride over
// the columns u.  Pass 1: running (max, sum of exp) per lane, a fixed xor butterfly across the warp; pass 2
// overwrites the row with P = exp(l - m) * (1 / sum), m the row maximum (0 where not finite).  No shared memory,
// no atomics.
template <typename T>
__device__ void ovq_readout_rows(T* t, const T* bias, T* row_max, int L, int n, T beta, int use_bias) {
    const int a = blockIdx.x * blockDim.y + threadIdx.y;
    if (a >= L) return;
    const int lane = threadIdx.x;
    const int width = n + L;
    const int end = n + a + 1;  // columns u < end are read: the n centroids, then the chunk keys b <= a
    T* row = t + (long long)a * width;
    const T ninf = neg_inf<T>();
    T m = ninf, s = T(0), mx = ninf;
    for (int u = lane; u < end; u += 32) {
        T l = mul_rn(row[u], beta);
        if (use_bias && u < n) l = add_rn(l, bias[u]);
        row[u] = l;
        lse_absorb(m, s, l);
        mx = nan_max(mx, l);
    }
    warp_lse_max(m, s, mx);
    if (lane == 0) row_max[a] = mx;
    const T shift = isfinite(mx) ? mx : T(0);
    const T inv_s = T(1) / s;
    // each lane rewrites the entries it wrote in pass 1 (no other lane touches them): no barrier needed
    for (int u = lane; u < width; u += 32) {
        row[u] = u < end ? exp(row[u] - shift) * inv_s : T(0);
    }
}

extern "C" __global__ void ovq_readout_rows_f32(float* t, const float* bias, float* row_max, int L, int n, float beta,
                                                int use_bias) {
    ovq_readout_rows<float>(t, bias, row_max, L, n, beta, use_bias);
}

extern "C" __global__ void ovq_readout_rows_f64(double* t, const double* bias, double* row_max, int L, int n, double beta,
                                                int use_bias) {
    ovq_readout_rows<double>(t, bias, row_max, L, n, beta, use_bias);
}

// The update of one chunk, for the rows m < n_rows of a dictionary D (n_rows, W) with row stride ldd, from the
// chunk's rows x (L, W) with row stride ldx; assign[i] is the row token i joins (-1: it seeded a row, or is not merged):
//   running mean (constant = 0): c'_m = c_m + |S_m|, D[m] <- (c_m D[m] + sum_{i in S_m} x_i) / c'_m, the sum from 0
//       in token order (refimpl.gmm.merge_running_means: np.add.at, then (c_old * means + sums) / c_new)
//   constant rate (constant = 1): D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order
// counts (n_rows,) are the counts after seeding, c_m (read only); counts_out (n_rows,), another buffer, receives
// c'_m = c_m + |S_m| (the running mean and the constant rate alike: the counts still add up).
// Launch: blockDim (32, 8); thread (x, y) of block (bx, by) owns the entry (m, w) = (8 by + y, 32 bx + x), reads only
// D[m, w] and the column w of x (coalesced across the warp), so D is updated in place without a barrier between
// owners and without atomics.  The assignments are staged through shared memory in tiles of 256 tokens.
#define UPDATE_TILE 256

template <typename T>
__device__ void ovq_update(T* D, long long ldd, const T* x, long long ldx, const long long* assign, const long long* counts,
                           long long* counts_out, int L, int n_rows, int W, T eta, int constant) {
    __shared__ long long tile[UPDATE_TILE];
    const int w = blockIdx.x * 32 + threadIdx.x;
    const int m = blockIdx.y * 8 + threadIdx.y;
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const bool mine = m < n_rows && w < W;
    T d = mine ? D[m * ldd + w] : T(0);
    T sum = T(0);
    long long members = 0;
    for (int i0 = 0; i0 < L; i0 += UPDATE_TILE) {
        __syncthreads();
        if (i0 + tid < L) tile[tid] = assign[i0 + tid];
        __syncthreads();
        const int stop = L - i0 < UPDATE_TILE ? L - i0 : UPDATE_TILE;
        if (mine) {
            for (int i = 0; i < stop; ++i) {
                if (tile[i] != m) continue;
                const T xi = x[(long long)(i0 + i) * ldx + w];
                if (constant) {
                    d = add_rn(d, mul_rn(eta, sub_rn(xi, d)));
                } else {
                    sum = add_rn(sum, xi);
                }
                ++members;
            }
        }
    }
    if (!mine) return;
    if (w == 0) counts_out[m] = counts[m] + members;  // c'_m = c_m + |S_m|, one writer per row
    if (members == 0) return;
    if (!constant) {
        const T c_old = (T)counts[m];
        const T c_new = (T)(counts[m] + members);
        d = div_rn(add_rn(mul_rn(c_old, d), sum), c_new);
    }
    D[m * ldd + w] = d;
}

#define OVQ_UPDATE_ARGS(T) T* D, long long ldd, const T* x, long long ldx, const long long* assign, \
    const long long* counts, long long* counts_out, int L, int n_rows, int W, T eta, int constant
#define OVQ_UPDATE_PASS D, ldd, x, ldx, assign, counts, counts_out, L, n_rows, W, eta, constant

extern "C" __global__ void ovq_update_f32(OVQ_UPDATE_ARGS(float)) { ovq_update<float>(OVQ_UPDATE_PASS); }
extern "C" __global__ void ovq_update_f64(OVQ_UPDATE_ARGS(double)) { ovq_update<double>(OVQ_UPDATE_PASS); }
