// The intra-chunk causal step of gpu/cupy_kernels/scan.py: the masked C x C blocks of the chunked scan.
//
// out_t += sum_{j in chunk(t), j <= t} (A_t . B_j) C_j        (LOWER: forward, and dphi_q of the backward)
// out_t += sum_{j in chunk(t), j >= t} (A_t . B_j) C_j        (UPPER: dphi_k and dv of the backward)
//
// refimpl.scan: "block = pq @ pk.T; np.copyto(block, 0, where=upper); num = pq @ s1 + block @ vc" (A = phi_q,
// B = phi_k, C = [v, 1]), "dphi_q[a:b] = gc @ s1.T + m @ pk" (A = g1, B = [v, 1], C = phi_k),
// "dphi_k[a:b] = vc @ r1.T + m.T @ pq" (A = [v, 1], B = g1, C = phi_q) and
// "dv[a:b] = pk @ r1[:, :-1] + block.T @ gc[:, :-1]" (A = phi_k, B = phi_q, C = g1 without its last column).
// The carried-state terms (the GEMMs) are already in out; this kernel adds the masked blocks.  Masked entries are
// set to 0, not multiplied (inf * 0 is NaN).
//
// Shapes: A (S, N, F) with row stride lda, B (S, N, F) stride ldb, C (S, N, W) stride ldc, out (S, N, W) stride ldo;
// S sequences of N tokens, N a multiple of the chunk length (the caller pads with zero rows).
// Launch: blockDim (TILE, TILE / ROWS) = (32, 8); blockIdx.x = (sequence, chunk, tile of TILE rows t) flattened,
// blockIdx.y = tile of TILE output columns w.  Thread (x, y) owns the outputs (t0 + y + 8 r, w0 + x), r < ROWS.
// For each tile of TILE keys j that meets the triangle: the TILE x TILE scores A_t . B_j from shared tiles of A and
// B over F (As, Bs: [TILE][TILE + 1], padded against bank conflicts), masked into Ss [TILE][TILE + 1]; then the
// tile of C rows (Cs [TILE][TILE + 1]) is multiplied in.  Sums run in a fixed order: no atomics, deterministic.

#define TILE 32
#define ROWS 4  // TILE / blockDim.y

template <typename T, bool UPPER>
__device__ void chunk_tri(const T* A, const T* Bm, const T* Cm, T* out, long long N, int F, int W,
                          long long lda, long long ldb, long long ldc, long long ldo, int chunk) {
    __shared__ T As[TILE][TILE + 1];
    __shared__ T Bs[TILE][TILE + 1];
    __shared__ T Ss[TILE][TILE + 1];
    __shared__ T Cs[TILE][TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tiles = (chunk + TILE - 1) / TILE;
    const long long n_chunks = N / chunk;
    long long bx = blockIdx.x;
    const int rt = (int)(bx % tiles);
    bx /= tiles;
    const long long c = bx % n_chunks;
    const long long s = bx / n_chunks;
    const long long row0 = s * N + c * chunk;  // first token of the chunk, as a row of the (S N) rows
    const int t0 = rt * TILE;
    const int w0 = blockIdx.y * TILE;
    T acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = T(0);
    const int jt_begin = UPPER ? rt : 0;
    const int jt_end = UPPER ? tiles : rt + 1;
    for (int jt = jt_begin; jt < jt_end; ++jt) {
        const int j0 = jt * TILE;
        T sc[ROWS];
        for (int r = 0; r < ROWS; ++r) sc[r] = T(0);
        // scores S_tj = A_t . B_j, F in tiles of TILE
        for (int f0 = 0; f0 < F; f0 += TILE) {
            for (int r = 0; r < ROWS; ++r) {
                const int i = ty + 8 * r;
                const int f = f0 + tx;
                As[i][tx] = (t0 + i < chunk && f < F) ? A[(row0 + t0 + i) * lda + f] : T(0);
                Bs[i][tx] = (j0 + i < chunk && f < F) ? Bm[(row0 + j0 + i) * ldb + f] : T(0);
            }
            __syncthreads();
            for (int r = 0; r < ROWS; ++r) {
                const int i = ty + 8 * r;
                T a = sc[r];
                for (int ff = 0; ff < TILE; ++ff) a += As[i][ff] * Bs[tx][ff];
                sc[r] = a;
            }
            __syncthreads();
        }
        // the mask: j <= t (LOWER) or j >= t (UPPER) within the chunk; other entries set to 0
        for (int r = 0; r < ROWS; ++r) {
            const int i = ty + 8 * r;
            const int t = t0 + i, j = j0 + tx;
            const bool keep = UPPER ? (j >= t) : (j <= t);
            Ss[i][tx] = keep ? sc[r] : T(0);
            const int w = w0 + tx;
            Cs[i][tx] = (j0 + i < chunk && w < W) ? Cm[(row0 + j0 + i) * ldc + w] : T(0);
        }
        __syncthreads();
        for (int r = 0; r < ROWS; ++r) {
            const int i = ty + 8 * r;
            T a = acc[r];
            for (int jj = 0; jj < TILE; ++jj) a += Ss[i][jj] * Cs[jj][tx];
            acc[r] = a;
        }
        __syncthreads();
    }
    const int w = w0 + tx;
    if (w < W) {
        for (int r = 0; r < ROWS; ++r) {
            const int t = t0 + ty + 8 * r;
            if (t < chunk) out[(row0 + t) * ldo + w] += acc[r];
        }
    }
}

#define CHUNK_TRI_ARGS(T) const T* A, const T* Bm, const T* Cm, T* out, long long N, int F, int W, \
    long long lda, long long ldb, long long ldc, long long ldo, int chunk
#define CHUNK_TRI_PASS A, Bm, Cm, out, N, F, W, lda, ldb, ldc, ldo, chunk

extern "C" __global__ void chunk_lower_f32(CHUNK_TRI_ARGS(float)) { chunk_tri<float, false>(CHUNK_TRI_PASS); }
extern "C" __global__ void chunk_lower_f64(CHUNK_TRI_ARGS(double)) { chunk_tri<double, false>(CHUNK_TRI_PASS); }
extern "C" __global__ void chunk_upper_f32(CHUNK_TRI_ARGS(float)) { chunk_tri<float, true>(CHUNK_TRI_PASS); }
extern "C" __global__ void chunk_upper_f64(CHUNK_TRI_ARGS(double)) { chunk_tri<double, true>(CHUNK_TRI_PASS); }
