// Row kernel of gpu/cupy_kernels/attention.py: scale, causal mask and softmax of the score rows, fused.
//
// The GEMM (cupy.matmul) has written t_ij = q_i . k_j for every sequence; rows are C-contiguous, N_k entries each,
// row r is query i = r % N_q of its sequence.
// neg_inf, lse_combine, nan_max, lse_absorb and warp_lse_max come from rows.cuh, which RawModuleSource puts in front of this file.

// scores *= scale; entries j > i get -inf when causal, so exp gives exactly 0 (refimpl.attention._softmax_scores)
// row_max_i = max_j scores_ij (the forward refuses rows where it is not finite: overflow)
// softmax(a) = softmax(a - m): P_ij = exp(s_ij - m) * (1 / sum_j exp(s_ij - m)), m = row max (0 where not finite)
// Launch: blockDim (32, ROWS_PER_BLOCK); warp y of block x owns row r = x ROWS_PER_BLOCK + y, its lanes stride
// over j [N_k].  Pass 1: running (max, sum of exp) per lane, a fixed xor butterfly across the warp; pass 2
// overwrites the row with P.  No shared memory, no atomics.
template <typename T>
__device__ void softmax_rows(T* t, T* row_max, long long R, int Nk, int Nq, T scale, int causal) {
    const long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= R) return;
    const int lane = threadIdx.x;
    const int i = (int)(r % Nq);
    const int end = causal ? (i + 1 < Nk ? i + 1 : Nk) : Nk;  // keys j < end are read
    T* row = t + r * (long long)Nk;
    const T ninf = neg_inf<T>();
    T m = ninf, s = T(0), mx = ninf;
    for (int j = lane; j < end; j += 32) {
        const T l = row[j] * scale;
        lse_absorb(m, s, l);
        mx = nan_max(mx, l);
    }
    warp_lse_max(m, s, mx);
    if (lane == 0) row_max[r] = mx;
    const T shift = isfinite(m) ? m : T(0);
    const T inv_s = T(1) / s;
    for (int j = lane; j < Nk; j += 32) {
        row[j] = j < end ? exp(row[j] * scale - shift) * inv_s : T(0);
    }
}

extern "C" __global__ void softmax_rows_f32(float* t, float* row_max, long long R, int Nk, int Nq, float scale, int causal) {
    softmax_rows<float>(t, row_max, R, Nk, Nq, scale, causal);
}

extern "C" __global__ void softmax_rows_f64(double* t, double* row_max, long long R, int Nk, int Nq, double scale, int causal) {
    softmax_rows<double>(t, row_max, R, Nk, Nq, scale, causal);
}
