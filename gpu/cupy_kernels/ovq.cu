// Kernels of gpu/cupy_kernels/ovq.py: the unit rows (once per call), then three launches per chunk: the read-out of
// the chunk against the dictionary (an online softmax) together with the assignment of its keys, the seeding, and
// the update of both dictionaries in token order.
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

// x^ = x / max(||x||, 1e-12): unit rows, and no division by zero (refimpl.ovq.unit_rows), for q and k at once.
// Launch: a grid-stride loop over the 2 N rows (q's, then k's); one thread per row sums its squares in column order.
template <typename T>
__device__ void ovq_unit_rows(const T* q, const T* k, T* qhat, T* khat, long long N, int d, T eps) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < 2 * N; r += stride) {
        const T* x = r < N ? q + r * d : k + (r - N) * d;
        T* y = r < N ? qhat + r * d : khat + (r - N) * d;
        T acc = T(0);
        for (int j = 0; j < d; ++j) acc = add_rn(acc, mul_rn(x[j], x[j]));
        T norm = sqrt(acc);
        if (norm < eps) norm = eps;  // max(norm, eps); a NaN norm stays NaN, as in NumPy
        for (int j = 0; j < d; ++j) y[j] = div_rn(x[j], norm);
    }
}

extern "C" __global__ void ovq_unit_rows_f32(const float* q, const float* k, float* qhat, float* khat, long long N, int d,
                                             float eps) {
    ovq_unit_rows<float>(q, k, qhat, khat, N, d, eps);
}

extern "C" __global__ void ovq_unit_rows_f64(const double* q, const double* k, double* qhat, double* khat, long long N,
                                             int d, double eps) {
    ovq_unit_rows<double>(q, k, qhat, khat, N, d, eps);
}

// np.argmax's order on (value, index): a NaN wins (the first NaN), else the larger value, ties to the lower index.
template <typename T>
__device__ __forceinline__ bool argmax_before(T v1, long long i1, T v2, long long i2) {
    const bool n1 = v1 != v1, n2 = v2 != v2;
    if (n1 || n2) return n1 && (!n2 || i1 < i2);
    return v1 > v2 || (v1 == v2 && i1 < i2);
}

// Launch 1 of a chunk [s, s + L): blockDim (32, ROWS_PER_BLOCK), one warp per row; the first read_blocks blocks
// read out query rows a, the others assign key rows b (either part may be empty: VQ assigns first, then reads out).
// Read-out (refimpl.ovq._chunk_logits and _run; refimpl.ovq._vq), for a < L:
//   l_au = beta q^_a . D_k[u] + log c_u   (u < n; a centroid of count c stands for c tokens: weight pi ~ c, logit + log c)
//   l_au = beta q^_a . k^_b               (u = n + b, b <= a: causal inside the chunk; VQ: the key is D_k[z_b])
//   row_max_a = max_u l_au;  o_a = softmax(l_a) [D_v[:n]; v_0..v_a]
//   pass 1: lane u0 strides over u, writes l_au to the scratch row P[a] and keeps its running (m, s) and maximum,
//   combined across the warp by the xor butterfly of rows.cuh; pass 2: lane w0 strides over the value columns,
//   o_aw = (sum_u exp(l_au - m) value_uw) / s, the weights read back from P[a] (no shared memory, no atomics).
// Assignment (refimpl.ovq._plan_chunk), for b < L: rows_b = argmax_m k^_b . dict_m (np.argmax: the first maximum)
//   and scores_b = that similarity; the first chunk (first = 1) scores against dict = k^_0 and joins row 0.
//   Lane m0 strides over the n_dict rows of dict, then an xor butterfly on (value, index) in np.argmax's order.
template <typename T>
__device__ void ovq_chunk(const T* qhat, const T* khat, const T* v, const T* Dk, const T* Dv, const long long* counts,
                          const long long* z, int indirect, long long s, int L, int n, int d, int dv, T beta,
                          int use_bias, T* P, long long ldp, T* out, T* row_max, int read_blocks,
                          const T* dict, int n_dict, int first, long long* rows, T* scores, long long* seeded) {
    const int lane = threadIdx.x;
    const T ninf = neg_inf<T>();
    if ((int)blockIdx.x < read_blocks) {
        const int a = blockIdx.x * blockDim.y + threadIdx.y;
        if (a >= L) return;  // the whole warp: the butterflies below see every lane
        const T* qa = qhat + (s + a) * d;
        T* pa = P + a * ldp;
        const int U = n + a + 1;  // the n centroids, then the chunk keys b <= a
        T m = ninf, sum = T(0), mx = ninf;
        for (int u = lane; u < U; u += 32) {
            const T* key = u < n ? Dk + (long long)u * d : (indirect ? Dk + z[u - n] * d : khat + (s + u - n) * d);
            T dot = T(0);
            for (int j = 0; j < d; ++j) dot += qa[j] * key[j];
            T l = mul_rn(dot, beta);
            if (use_bias && u < n) l = add_rn(l, (T)log((T)counts[u]));
            pa[u] = l;
            lse_absorb(m, sum, l);
            mx = nan_max(mx, l);
        }
        warp_lse_max(m, sum, mx);
        if (lane == 0) row_max[s + a] = mx;
        __syncwarp();
        const T shift = isfinite(m) ? m : T(0);
        const T inv_s = T(1) / sum;
        for (int w0 = 0; w0 < dv; w0 += 32) {
            const int w = w0 + lane;
            T acc = T(0);
            for (int u = 0; u < U; ++u) {
                const T p = exp(pa[u] - shift);
                if (w < dv) acc += p * (u < n ? Dv[(long long)u * dv + w] : v[(s + u - n) * dv + w]);
            }
            if (w < dv) out[(s + a) * dv + w] = acc * inv_s;
        }
        return;
    }
    const int b = (blockIdx.x - read_blocks) * blockDim.y + threadIdx.y;
    if (b >= L) return;
    const T* kb = khat + (s + b) * d;
    T best = T(0);
    long long arg = -1;
    for (int r = lane; r < n_dict; r += 32) {
        const T* row = dict + (long long)r * d;
        T dot = T(0);
        for (int j = 0; j < d; ++j) dot += kb[j] * row[j];
        if (arg < 0 || argmax_before(dot, (long long)r, best, arg)) {
            best = dot;
            arg = r;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const T b_o = __shfl_xor_sync(0xffffffffu, best, off);
        const long long a_o = __shfl_xor_sync(0xffffffffu, arg, off);
        if (a_o >= 0 && (arg < 0 || argmax_before(b_o, a_o, best, arg))) {
            best = b_o;
            arg = a_o;
        }
    }
    if (lane == 0) {
        rows[b] = first ? 0 : arg;
        scores[b] = best;
        seeded[b] = 0;
    }
}

#define OVQ_CHUNK_ARGS(T) const T* qhat, const T* khat, const T* v, const T* Dk, const T* Dv, const long long* counts, \
    const long long* z, int indirect, long long s, int L, int n, int d, int dv, T beta, int use_bias, T* P, long long ldp, \
    T* out, T* row_max, int read_blocks, const T* dict, int n_dict, int first, long long* rows, T* scores, long long* seeded
#define OVQ_CHUNK_PASS qhat, khat, v, Dk, Dv, counts, z, indirect, s, L, n, d, dv, beta, use_bias, P, ldp, out, row_max, \
    read_blocks, dict, n_dict, first, rows, scores, seeded

extern "C" __global__ void ovq_chunk_f32(OVQ_CHUNK_ARGS(float)) { ovq_chunk<float>(OVQ_CHUNK_PASS); }
extern "C" __global__ void ovq_chunk_f64(OVQ_CHUNK_ARGS(double)) { ovq_chunk<double>(OVQ_CHUNK_PASS); }

// NumPy's stable ascending order on (score, index), NaN last: whether (y, o) comes before (x, b).
template <typename T>
__device__ __forceinline__ bool sorts_before(T y, long long o, T x, long long b) {
    const bool ny = y != y, nx = x != x;
    if (ny || nx) return !ny || (nx && o < b);
    return y < x || (y == x && o < b);
}

// Launch 2 (when the dictionary grows by n_add rows n, n + 1, ...): rows[seeds] = n + arange(n_add), seeded[seeds] = 1.
//   spread: seeds = np.argsort(scores, kind="stable")[:n_add]: key b seeds row n + rank(b), rank(b) = the keys that
//           sort before it (a smaller score, or an equal one and a smaller index);
//   first chunk: key 0 seeds centroid 0; the n_add - 1 keys least similar to it seed centroids 1.. in ascending order
//           of score (rank(b) = 1 + the same count among the keys b' >= 1);
//   random: seeds drawn on the host with refimpl's generator, in centroid order (drawn[r] seeds row n + r).
// Launch: one thread per key b of the chunk; O(L) work per thread.
template <typename T>
__device__ void ovq_seed(const T* scores, int L, int n, int n_add, const long long* drawn, int use_drawn, int first,
                         long long* rows, long long* seeded) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= L) return;
    if (use_drawn) {
        for (int r = 0; r < n_add; ++r) {
            if (drawn[r] == b) {
                rows[b] = n + r;
                seeded[b] = 1;
            }
        }
        return;
    }
    int rank = 0;
    if (!(first && b == 0)) {
        const int start = first ? 1 : 0;
        rank = start;
        const T x = scores[b];
        for (int o = start; o < L; ++o) {
            if (o != b && sorts_before(scores[o], (long long)o, x, (long long)b)) ++rank;
        }
    }
    if (rank < n_add) {
        rows[b] = n + rank;
        seeded[b] = 1;
    }
}

extern "C" __global__ void ovq_seed_f32(const float* scores, int L, int n, int n_add, const long long* drawn, int use_drawn,
                                        int first, long long* rows, long long* seeded) {
    ovq_seed<float>(scores, L, n, n_add, drawn, use_drawn, first, rows, seeded);
}

extern "C" __global__ void ovq_seed_f64(const double* scores, int L, int n, int n_add, const long long* drawn, int use_drawn,
                                        int first, long long* rows, long long* seeded) {
    ovq_seed<double>(scores, L, n, n_add, drawn, use_drawn, first, rows, seeded);
}

// Launch 3: both dictionaries at once, for the rows m < n_rows.  A seeded row starts at its key and value with
// count 1; then, for the other keys of row m (S_m, in token order):
//   running mean (constant = 0): c'_m = c_m + |S_m|, D[m] <- (c_m D[m] + sum_{i in S_m} x_i) / c'_m, the sum from 0
//       in token order (refimpl.gmm.running_mean_update: the sums, then (c_old * means + sums) / c_new)
//   constant rate (constant = 1): D[m] <- D[m] + eta (x_i - D[m]) for each i in S_m, token by token in token order
// counts (read only) and counts_out (another buffer, swapped by the host) hold c_m and c'_m, so no thread reads a
// count another one writes.  with_keys = 0 updates D_v only (VQ: U_m / L_m, the running mean of the values).
// Launch: a grid-stride loop over the entries (m, column) of [D_k | D_v], flat m (d + d_v) + column, so a warp
// reads consecutive columns; every thread walks the chunk's rows in token order (the same entry for all threads at
// once: a broadcast load), and each entry has one writer: deterministic, no atomics, no barrier.
template <typename T>
__device__ void ovq_update(const T* khat, const T* v, long long s, int L, const long long* rows, const long long* seeded,
                           T* Dk, T* Dv, int d, int dv, const long long* counts, long long* counts_out, int n_rows,
                           T eta, int constant, int with_keys) {
    const int wk = with_keys ? d : 0;
    const int width = wk + dv;
    const long long total = (long long)n_rows * width;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long m = e / width;
        const int col = (int)(e - m * width);
        const bool key = col < wk;
        const int c = key ? col : col - wk;
        T D = key ? Dk[m * d + c] : Dv[m * dv + c];
        long long c_old = counts[m];
        T sum = T(0);
        long long members = 0;
        for (int b = 0; b < L; ++b) {
            if (rows[b] != m) continue;
            const T x = key ? khat[(s + b) * d + c] : v[(s + b) * dv + c];
            if (seeded[b]) {
                D = x;
                c_old = 1;
            } else {
                ++members;
                if (constant) {
                    D = add_rn(D, mul_rn(eta, sub_rn(x, D)));
                } else {
                    sum = add_rn(sum, x);
                }
            }
        }
        if (members > 0 && !constant) D = div_rn(add_rn(mul_rn((T)c_old, D), sum), (T)(c_old + members));
        if (key) {
            Dk[m * d + c] = D;
        } else {
            Dv[m * dv + c] = D;
        }
        if (col == 0) counts_out[m] = c_old + members;
    }
}

#define OVQ_UPDATE_ARGS(T) const T* khat, const T* v, long long s, int L, const long long* rows, const long long* seeded, \
    T* Dk, T* Dv, int d, int dv, const long long* counts, long long* counts_out, int n_rows, T eta, int constant, int with_keys
#define OVQ_UPDATE_PASS khat, v, s, L, rows, seeded, Dk, Dv, d, dv, counts, counts_out, n_rows, eta, constant, with_keys

extern "C" __global__ void ovq_update_f32(OVQ_UPDATE_ARGS(float)) { ovq_update<float>(OVQ_UPDATE_PASS); }
extern "C" __global__ void ovq_update_f64(OVQ_UPDATE_ARGS(double)) { ovq_update<double>(OVQ_UPDATE_PASS); }
