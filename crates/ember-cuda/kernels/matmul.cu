// matmul: y[t][r] = Σ_j W[r][j]·x[t][j] for a weight in its file's block format and f32
// activations x [n_tok, k] -> y [n_tok, n_rows]. Reference: ember_ops::reference::matmul.
//
// Two paths (the launcher picks):
// * matmul_gemv_<type>: small n_tok. One warp per output row, up to GEMV_NT tokens per pass;
//   a warp walks the row in 256-weight chunks, each lane decoding 8 weights per chunk (one
//   4-byte load of quants for the block types, 16 bytes for f16/bf16, 32 for f32) so the lanes'
//   weight and x reads are both contiguous. Needs k % 8 == 0 (block types always qualify;
//   other float weights go tiled).
// * matmul_tiled: any shape. 64x64 output tiles, k in steps of 32, weights decoded into shared
//   memory by deq8. Plain f32 FMA: the exact path for many tokens, and the fallback below sm_80.
// * matmul_mmv_<type>_<8 NT>: 2 to MMA_MIN_TOKENS tokens under Precision::Fast, sm_80+: the
//   GEMV's shape (32 rows a block, k split over its warps) on tensor cores, f16 operands.
// * matmul_mma_<type>_<BM>: prompt-sized batches under Precision::Fast, sm_80+ (mma.cuh): f16
//   operands on tensor cores, f32 sums; BM tokens x 128 rows per block.

struct MatmulParams {
    u64 w;  // n_rows rows of row_bytes
    u64 x;  // [n_tok, k] f32
    u64 y;  // [n_tok, n_rows] f32
    u32 ty, k, n_rows, n_tok, row_bytes;
    u32 ksplit;  // GEMV: warps per row (1, 2 or 4), chosen by the launcher
};

#define GEMV_NT 8

// Block `bx` of the row blocks of `p` (blockIdx.x for one weight; matmul_gemv_multi maps its
// blocks onto several weights). Each row gets p.ksplit warps of the block: warp part j takes
// chunks j, j + ksplit, ..; the parts' sums are added in part order (the same for every launch
// of the same shape).
template <int TY>
__device__ __forceinline__ void gemv(const MatmulParams& p, u32 bx) {
    __shared__ float iq4[16];
    __shared__ float part_sum[4][GEMV_NT];
    load_iq4_table(iq4);
    const int ks = max(1, (int)p.ksplit);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = bx * ((blockDim.x / 32) / ks) + warp / ks;
    const int part = warp % ks;
    const bool valid = row < (int)p.n_rows;
    if (!valid && ks == 1) return;  // whole warps leave together (no barrier follows)
    const int t0 = blockIdx.y * GEMV_NT;
    const int nt = min(GEMV_NT, (int)p.n_tok - t0);
    const int k = p.k;
    const u8* wrow = (const u8*)p.w + (u64)(valid ? row : 0) * p.row_bytes;
    const float* x = (const float*)p.x + (u64)t0 * k;
    float acc[GEMV_NT];
#pragma unroll
    for (int t = 0; t < GEMV_NT; ++t) acc[t] = 0.0f;
    const int n_chunk = valid ? (k + 255) / 256 : 0;
#pragma unroll 2
    for (int c = part; c < n_chunk; c += ks) {
        float w[8];
        int a0, a1;
        if (!chunk8<TY>(wrow, c, lane, k, iq4, w, &a0, &a1)) continue;
#pragma unroll
        for (int t = 0; t < GEMV_NT; ++t) {
            if (t < nt) {
                const float4 x0 = *(const float4*)(x + (u64)t * k + a0), x1 = *(const float4*)(x + (u64)t * k + a1);
                acc[t] += w[0] * x0.x + w[1] * x0.y + w[2] * x0.z + w[3] * x0.w + w[4] * x1.x + w[5] * x1.y + w[6] * x1.z + w[7] * x1.w;
            }
        }
    }
    if (ks == 1) {
#pragma unroll
        for (int t = 0; t < GEMV_NT; ++t) {
            if (t < nt) {
                const float s = warp_sum(acc[t]);
                if (lane == 0) ((float*)p.y)[(u64)(t0 + t) * p.n_rows + row] = s;
            }
        }
        return;
    }
#pragma unroll
    for (int t = 0; t < GEMV_NT; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) part_sum[warp][t] = s;
    }
    __syncthreads();
    if (valid && part == 0 && lane < nt) {
        float s = 0.0f;
        for (int j = 0; j < ks; ++j) s += part_sum[warp + j][lane];
        ((float*)p.y)[(u64)(t0 + lane) * p.n_rows + row] = s;
    }
}

extern "C" __global__ void matmul_gemv_f32(const MatmulParams p) { pdl_enter(); gemv<TY_F32>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_f16(const MatmulParams p) { pdl_enter(); gemv<TY_F16>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_bf16(const MatmulParams p) { pdl_enter(); gemv<TY_BF16>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_q8_0(const MatmulParams p) { pdl_enter(); gemv<TY_Q8_0>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_q4_k(const MatmulParams p) { pdl_enter(); gemv<TY_Q4_K>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_q5_k(const MatmulParams p) { pdl_enter(); gemv<TY_Q5_K>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_q6_k(const MatmulParams p) { pdl_enter(); gemv<TY_Q6_K>(p, blockIdx.x); }
extern "C" __global__ void matmul_gemv_iq4_xs(const MatmulParams p) { pdl_enter(); gemv<TY_IQ4_XS>(p, blockIdx.x); }

// matmul_gemv_multi_<type>: up to GEMV_MULTI weights of one type and k on the same activations
// in one launch (the several projections of a layer's input: one launch instead of each), the
// row blocks of weight i being blocks block0[i]..block0[i + 1] of the grid.
#define GEMV_MULTI 4

struct MatmulMultiParams {
    u64 w[GEMV_MULTI];
    u64 y[GEMV_MULTI];
    u64 x;
    u32 n_rows[GEMV_MULTI];
    u32 row_bytes[GEMV_MULTI];
    u32 block0[GEMV_MULTI + 1];
    u32 ty, k, n_tok, n;
    u32 ksplit[GEMV_MULTI];
    u32 prefetch;  // 1: each block asks for its rows in L2 before pdl_enter (prefetch_l2)
};

// The weight of a multi launch that block blockIdx.x belongs to, as one weight's parameters;
// `*bx` gets the block's index among that weight's blocks. `rows_per_block` (0: the GEMV's, from
// ksplit) sizes the L2 prefetch of the block's rows when mp.prefetch asks for it (before
// pdl_enter: weights only).
__device__ __forceinline__ MatmulParams multi_pick(const MatmulMultiParams& mp, u32 rows_per_block, u32* bx) {
    u32 i = 0;
    while (i + 1 < mp.n && blockIdx.x >= mp.block0[i + 1]) ++i;
    *bx = blockIdx.x - mp.block0[i];
    if (mp.prefetch && threadIdx.x == 0 && blockIdx.y == 0) {
        const u32 per = rows_per_block ? rows_per_block : (blockDim.x / 32) / max(1u, mp.ksplit[i]), r0 = *bx * per;
        if (r0 < mp.n_rows[i])
            prefetch_l2((const u8*)mp.w[i] + (u64)r0 * mp.row_bytes[i], (u64)min(per, mp.n_rows[i] - r0) * mp.row_bytes[i]);
    }
    MatmulParams p;
    p.w = mp.w[i];
    p.x = mp.x;
    p.y = mp.y[i];
    p.ty = mp.ty;
    p.k = mp.k;
    p.n_rows = mp.n_rows[i];
    p.n_tok = mp.n_tok;
    p.row_bytes = mp.row_bytes[i];
    p.ksplit = mp.ksplit[i];
    return p;
}

template <int TY>
__device__ __forceinline__ void gemv_multi(const MatmulMultiParams& mp) {
    u32 bx;
    const MatmulParams p = multi_pick(mp, 0, &bx);
    pdl_enter();
    gemv<TY>(p, bx);
}

// (gemv_multi prefetches, then calls pdl_enter.)
extern "C" __global__ void matmul_gemv_multi_f32(const MatmulMultiParams p) { gemv_multi<TY_F32>(p); }
extern "C" __global__ void matmul_gemv_multi_f16(const MatmulMultiParams p) { gemv_multi<TY_F16>(p); }
extern "C" __global__ void matmul_gemv_multi_bf16(const MatmulMultiParams p) { gemv_multi<TY_BF16>(p); }
extern "C" __global__ void matmul_gemv_multi_q8_0(const MatmulMultiParams p) { gemv_multi<TY_Q8_0>(p); }
extern "C" __global__ void matmul_gemv_multi_q4_k(const MatmulMultiParams p) { gemv_multi<TY_Q4_K>(p); }
extern "C" __global__ void matmul_gemv_multi_q5_k(const MatmulMultiParams p) { gemv_multi<TY_Q5_K>(p); }
extern "C" __global__ void matmul_gemv_multi_q6_k(const MatmulMultiParams p) { gemv_multi<TY_Q6_K>(p); }
extern "C" __global__ void matmul_gemv_multi_iq4_xs(const MatmulMultiParams p) { gemv_multi<TY_IQ4_XS>(p); }

// matmul_mmv_<type>_<8 NT>: the GEMV's job for 2 to a few dozen tokens on tensor cores (Fast
// only, sm_80+), where the f32 GEMV is bound by its FMAs (16 tokens: ~10 multiply-adds per
// weight byte). Block bx owns weight rows 32·bx .. +32 (two m16 tiles of the mma's A operand)
// and its MMV_WARPS warps split k; their sums are added in warp order through shared memory, so
// the bits depend only on k and the tokens' values, not on the grid. Weights are decoded from
// the file's blocks into A fragments (tile_deq8, rounded to f16), activations from f32 into B
// fragments (8 tokens an n-tile, NT tiles a pass, passes over blockIdx.y), sums in f32.
//
// In a step of 64 weights lane (g, t) = (lane / 4, lane % 4) decodes weights 8t .. 8t + 7 and
// 32 + 8t .. 32 + 8t + 7 of rows g, g + 8, g + 16, g + 24. The mma's k positions {2t, 2t + 1}
// and {2t + 8, 2t + 9} of lane t stand for four consecutive weights of those, in A and in B
// alike: the k order inside a step is permuted, each product is summed once.
//
// Two ways to the weights (the launcher picks): read by each lane from global memory (warp w
// takes steps w, w + MMV_WARPS, ..; any k % 64 == 0), or staged (block types whose rows are
// whole 16-byte chunks): the block copies its 32 rows' next MMV_WARPS super-blocks (256
// weights each) into shared memory with 16-byte asynchronous copies, then warp w decodes
// super-block w of them. A lane's own loads touch 8 rows a load (8 cache lines for ~32 bytes);
// the copies read whole lines.
#define MMV_ROWS 32
#define MMV_WARPS 8
#define MMV_STEP 64

__device__ __forceinline__ void mmv_zero(float* acc, int n) {
    for (int i = 0; i < n; ++i) acc[i] = 0.0f;
}

// One 64-weight step: weights wi .. wi + 64 of rows wr[0..4] (tile_deq8's indexing from each
// row pointer), activations xi .. xi + 64 of the tokens' rows xr (null: a token past the end).
template <int TY, int NT>
__device__ __forceinline__ void mmv_step(const u8* const* wr, int wi, const float* const* xr, int xi, int k, const float* iq4,
                                         float (&acc)[2][NT][4]) {
    const int t = threadIdx.x % 4;
    u32 a[2][4][4];  // [m tile][mma of the step][fragment register]
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v[8];
            tile_deq8<TY>(wr[i], wi + 8 * t + 32 * h, k, true, iq4, v);
            const int m = i / 2, hi = i & 1;  // rows g + 8i: m tile i / 2, its row g or g + 8
            a[m][2 * h][hi] = pack_f16x2(v[0], v[1]);
            a[m][2 * h][2 + hi] = pack_f16x2(v[2], v[3]);
            a[m][2 * h + 1][hi] = pack_f16x2(v[4], v[5]);
            a[m][2 * h + 1][2 + hi] = pack_f16x2(v[6], v[7]);
        }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        u32 b[4][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
            if (xr[j] != nullptr) {
                x0 = *(const float4*)(xr[j] + xi + 8 * t + 32 * h);
                x1 = *(const float4*)(xr[j] + xi + 8 * t + 32 * h + 4);
            }
            b[2 * h][0] = pack_f16x2(x0.x, x0.y);
            b[2 * h][1] = pack_f16x2(x0.z, x0.w);
            b[2 * h + 1][0] = pack_f16x2(x1.x, x1.y);
            b[2 * h + 1][1] = pack_f16x2(x1.z, x1.w);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int q = 0; q < 4; ++q) mma_16816(acc[m][j], a[m][q], b[q]);
    }
}

// Bytes of 256 weights of a block type (the staged path's super-block).
template <int TY>
__device__ constexpr int mmv_sb_bytes() {
    return TY == TY_Q4_K ? 144 : TY == TY_Q5_K ? 176 : TY == TY_IQ4_XS ? 136 : TY == TY_Q8_0 ? 272 : 0;
}

// Shared-memory bytes per staged row: MMV_WARPS super-blocks and the 16 bytes an unaligned start
// may add.
template <int TY>
__device__ constexpr int mmv_pitch() {
    return MMV_WARPS * mmv_sb_bytes<TY>() + 16;
}

// The block's sums, `part` [MMV_WARPS][MMV_ROWS][8 NT + 1] floats of shared memory, added in
// warp order into y.
template <int NT>
__device__ __forceinline__ void mmv_finish(const MatmulParams& p, int r0, int t0, float* part, const float (&acc)[2][NT][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    constexpr int LD = 8 * NT + 1;
    // acc[m][j][c]: row 16m + g (+8 for c >= 2), token 8j + 2t + (c & 1).
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                part[(warp * MMV_ROWS + 16 * m + g + (c >= 2 ? 8 : 0)) * LD + 8 * j + 2 * t + (c & 1)] = acc[m][j][c];
    __syncthreads();
    const int nt = min(8 * NT, (int)p.n_tok - t0);
    for (int u = threadIdx.x; u < MMV_ROWS * nt; u += blockDim.x) {
        const int row = u % MMV_ROWS, tok = u / MMV_ROWS;
        if (r0 + row >= (int)p.n_rows) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < MMV_WARPS; ++w) sum += part[(w * MMV_ROWS + row) * LD + tok];
        ((float*)p.y)[(u64)(t0 + tok) * p.n_rows + r0 + row] = sum;
    }
}

// STAGED: the shared-memory path (dynamic shared memory MMV_ROWS · mmv_pitch<TY>() bytes, which
// also holds `part` at the end; rows of whole 16-byte chunks, 16-byte aligned).
template <int TY, int NT, bool STAGED>
__device__ __forceinline__ void mmv(const MatmulParams& p, u32 bx) {
#if __CUDA_ARCH__ >= 800
    __shared__ float iq4[16];
    extern __shared__ uint4 mmv_smem[];
    load_iq4_table(iq4);
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
    const int k = p.k, n_rows = p.n_rows, r0 = bx * MMV_ROWS;
    const int t0 = blockIdx.y * 8 * NT;
    // Tokens past the end read zeros; rows past the end read the last row (their sums are
    // dropped).
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int tok = t0 + 8 * j + g;
        xr[j] = tok < (int)p.n_tok ? (const float*)p.x + (u64)tok * k : nullptr;
    }
    float acc[2][NT][4];
    mmv_zero(&acc[0][0][0], 2 * NT * 4);
    const u8* w = (const u8*)p.w;
    if constexpr (STAGED) {
        constexpr int S = mmv_sb_bytes<TY>(), PITCH = mmv_pitch<TY>();
        u8* stage = (u8*)mmv_smem;
        const int n_sb = k / 256;
        for (int sb0 = 0; sb0 < n_sb; sb0 += MMV_WARPS) {
            const int nsb = min(MMV_WARPS, n_sb - sb0);
            // Row r's bytes [a, e) hold super-blocks sb0 .. sb0 + nsb (row_bytes % 16 == 0 keeps
            // e inside the row).
            const int a = (sb0 * S) & ~15, n_chunk = ((((sb0 + nsb) * S + 15) & ~15) - a) / 16;
            for (int i = threadIdx.x; i < MMV_ROWS * n_chunk; i += blockDim.x) {
                const int r = i / n_chunk, c = i % n_chunk;
                copy16_async(stage + r * PITCH + 16 * c, w + (u64)min(r0 + r, n_rows - 1) * p.row_bytes + a + 16 * c);
            }
            copy_async_wait();
            __syncthreads();
            if (warp < nsb) {
                const u8* wr[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) wr[i] = stage + (g + 8 * i) * PITCH + (sb0 * S - a);
#pragma unroll
                for (int q = 0; q < 4; ++q) mmv_step<TY, NT>(wr, warp * 256 + q * MMV_STEP, xr, (sb0 + warp) * 256 + q * MMV_STEP, k, iq4, acc);
            }
            __syncthreads();  // before the next copies (or `part`) overwrite the stage
        }
        mmv_finish<NT>(p, r0, t0, (float*)mmv_smem, acc);
    } else {
        const u8* wr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) wr[i] = w + (u64)min(r0 + g + 8 * i, n_rows - 1) * p.row_bytes;
        const int n_step = k / MMV_STEP;
#pragma unroll 2
        for (int s = warp; s < n_step; s += MMV_WARPS) mmv_step<TY, NT>(wr, s * MMV_STEP, xr, s * MMV_STEP, k, iq4, acc);
        mmv_finish<NT>(p, r0, t0, (float*)mmv_smem, acc);
    }
#endif
}

#define MMV_ENTRY(NAME, TY, NT, STAGED)                                                                         \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32) matmul_mmv_##NAME(const MatmulParams p) {     \
        pdl_enter();                                                                                            \
        mmv<TY, NT, STAGED>(p, blockIdx.x);                                                                     \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32) matmul_mmv_multi_##NAME(const MatmulMultiParams mp) { \
        u32 bx;                                                                                                 \
        const MatmulParams p = multi_pick(mp, MMV_ROWS, &bx);                                                   \
        pdl_enter();                                                                                            \
        mmv<TY, NT, STAGED>(p, bx);                                                                             \
    }

// matmul_mmv[_multi]_<type>_<8|16> (lanes' loads) and, for block types, _<type>_<8|16>_staged.
#define MMV_ENTRIES(SUFFIX, TY)            \
    MMV_ENTRY(SUFFIX##_8, TY, 1, false)    \
    MMV_ENTRY(SUFFIX##_16, TY, 2, false)
#define MMV_STAGED_ENTRIES(SUFFIX, TY)           \
    MMV_ENTRY(SUFFIX##_8_staged, TY, 1, true)    \
    MMV_ENTRY(SUFFIX##_16_staged, TY, 2, true)

MMV_ENTRIES(f32, TY_F32)
MMV_ENTRIES(f16, TY_F16)
MMV_ENTRIES(bf16, TY_BF16)
MMV_ENTRIES(q8_0, TY_Q8_0)
MMV_ENTRIES(q4_k, TY_Q4_K)
MMV_ENTRIES(q5_k, TY_Q5_K)
MMV_ENTRIES(q6_k, TY_Q6_K)
MMV_ENTRIES(iq4_xs, TY_IQ4_XS)
MMV_STAGED_ENTRIES(q8_0, TY_Q8_0)
MMV_STAGED_ENTRIES(q4_k, TY_Q4_K)
MMV_STAGED_ENTRIES(q5_k, TY_Q5_K)
MMV_STAGED_ENTRIES(iq4_xs, TY_IQ4_XS)

// grid (ceil(n_rows / 64), ceil(n_tok / 64)), 256 threads: thread (tr, tt) = (tid / 16,
// tid % 16) owns rows tr + 16i and tokens tt + 16j, i, j < 4.
extern "C" __global__ void matmul_tiled(const MatmulParams p) {
    pdl_enter();
    __shared__ float ws[64][33];
    __shared__ float xs[64][33];
    const int tid = threadIdx.x, tr = tid / 16, tt = tid % 16;
    const int r0 = blockIdx.x * 64, t0 = blockIdx.y * 64;
    const float* x = (const float*)p.x;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < (int)p.k; k0 += 32) {
        const int rr = tid / 4, piece = tid % 4;
        float v[8];
        if (r0 + rr < (int)p.n_rows) {
            deq8(p.ty, (const u8*)p.w + (u64)(r0 + rr) * p.row_bytes, k0 + 8 * piece, p.k, v);
        } else {
            for (int j = 0; j < 8; ++j) v[j] = 0.0f;
        }
        for (int j = 0; j < 8; ++j) ws[rr][8 * piece + j] = v[j];
        const int t = t0 + rr;
        for (int j = 0; j < 8; ++j) {
            const int i = k0 + 8 * piece + j;
            xs[rr][8 * piece + j] = t < (int)p.n_tok && i < (int)p.k ? x[(u64)t * p.k + i] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < 32; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = ws[tr + 16 * i][kk], b[i] = xs[tt + 16 * i][kk];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        const int r = r0 + tr + 16 * i;
        for (int j = 0; j < 4; ++j) {
            const int t = t0 + tt + 16 * j;
            if (r < (int)p.n_rows && t < (int)p.n_tok) ((float*)p.y)[(u64)t * p.n_rows + r] = acc[i][j];
        }
    }
}

// grid (ceil(n_tok / BM), ceil(n_rows / MMA_BN)), MMA_THREADS threads. Tokens vary fastest over
// the blocks, so the blocks in flight share weight tiles (read once from memory, then from L2);
// the activations (n_tok x k f32) stay in L2.
template <int TY, int MT>
__device__ __forceinline__ void matmul_mma(const MatmulParams& p) {
#if __CUDA_ARCH__ >= 800
    constexpr int BM = 32 * MT;
    __shared__ __align__(16) u16 ws[2 * MMA_BN * MMA_LD];
    __shared__ __align__(16) u16 xs[2 * BM * MMA_LD];
    __shared__ const float* xrow[BM];
    __shared__ float iq4[16];
    const int t0 = blockIdx.x * BM, r0 = blockIdx.y * MMA_BN;
    const int n_tok = p.n_tok, n_rows = p.n_rows;
    for (int m = threadIdx.x; m < BM; m += blockDim.x) xrow[m] = t0 + m < n_tok ? (const float*)p.x + (u64)(t0 + m) * p.k : nullptr;
    load_iq4_table(iq4);  // (a barrier: xrow is ready too)
    const MmaIn in = {(const u8*)p.w + (u64)r0 * p.row_bytes, p.row_bytes, min(MMA_BN, n_rows - r0), (int)p.k};
    float acc[MT][4][4];
    mma_tile<TY, MT>(in, xrow, iq4, ws, xs, acc);
    float* y = (float*)p.y;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int t = t0 + mma_out_token<MT>(i, c), r = r0 + mma_out_row(j, c);
                if (t < n_tok && r < n_rows) y[(u64)t * n_rows + r] = acc[i][j][c];
            }
#endif
}

#define MMA_ENTRIES(SUFFIX, TY)                                                                   \
    extern "C" __global__ void matmul_mma_##SUFFIX##_32(const MatmulParams p) { pdl_enter(); matmul_mma<TY, 1>(p); }   \
    extern "C" __global__ void matmul_mma_##SUFFIX##_64(const MatmulParams p) { pdl_enter(); matmul_mma<TY, 2>(p); }   \
    extern "C" __global__ void matmul_mma_##SUFFIX##_128(const MatmulParams p) { pdl_enter(); matmul_mma<TY, 4>(p); }

MMA_ENTRIES(f32, TY_F32)
MMA_ENTRIES(f16, TY_F16)
MMA_ENTRIES(bf16, TY_BF16)
MMA_ENTRIES(q8_0, TY_Q8_0)
MMA_ENTRIES(q4_k, TY_Q4_K)
MMA_ENTRIES(q5_k, TY_Q5_K)
MMA_ENTRIES(q6_k, TY_Q6_K)
MMA_ENTRIES(iq4_xs, TY_IQ4_XS)
