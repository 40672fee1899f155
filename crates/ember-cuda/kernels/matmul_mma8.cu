// matmul_mma8: y = x·Wᵀ for prompt-sized batches of Q4_K weights on int8 tensor cores, x
// quantised by quantize_q8 (blocks of 32: int8 values, then (d, d·Σq) per block). The dense
// form of moe_mma8s_gate_up_q4_k: a block's 128 rows and 32 tokens, each super-block of k (the
// rows' 18 KB, the tokens' int8 values and block scales) copied into shared memory by cp.async
// MM8_STAGES super-blocks ahead, warp w taking rows 16w..16w+15 against all 32 tokens
// (q4k_mma8_superblock). Against matmul_mma's f16 tiles it decodes no weight (the 4-bit values
// are the mma's A operand) and reads x as int8 (a quarter of the f32 bytes). Error: x's
// rounding to int8, as the decode GEMVs' (gemv_q8).

struct MatmulMma8Params {
    u64 w;   // n_rows rows of row_bytes (Q4_K; k % 256 == 0), 16-byte aligned
    u64 xq;  // quantize_q8 of x [n_tok, k]: n_tok·k int8, then n_tok·k/32 float2
    u64 y;   // [n_tok, n_rows] f32
    u32 k, n_rows, n_tok, row_bytes;
};

#define MM8_ROWS 128
#define MM8_TOK 32
#define MM8_STAGES 3
#define MM8_XLD 272                          // bytes a token's x in a stage (256 + 16)
#define MM8_W_BYTES (MM8_ROWS * 144)         // the rows' super-block
#define MM8_X_BYTES (MM8_TOK * MM8_XLD)      // the tokens' 256 values
#define MM8_XS_BYTES (8 * (MM8_TOK + 1) * 8)  // their 8 block scales, [block][token]
#define MM8_STAGE_BYTES (MM8_W_BYTES + MM8_X_BYTES + MM8_XS_BYTES)  // 29,248 (ops/matmul.rs)

// grid (ceil(n_tok / 32), ceil(n_rows / 128)): tokens vary fastest over the blocks, so the
// blocks in flight share weight tiles (read once from memory, then from L2). 256 threads,
// MM8_STAGES · MM8_STAGE_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 2) matmul_mma8s_q4_k(const MatmulMma8Params p) {
    pdl_enter();
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) u8 stages[];
    const u32 t0 = blockIdx.x * MM8_TOK, r0 = blockIdx.y * MM8_ROWS;
    const u32 n = min((u32)MM8_TOK, p.n_tok - t0), n_blk = p.k / 32, n_sb = p.k / 256;
    const i8* xq = (const i8*)p.xq;
    const float2* xs = (const float2*)(xq + (u64)p.n_tok * p.k);
    // Super-block `sb` into stage `s`: rows past n_rows copy the last row, tokens past n_tok
    // zeros (neither is written out).
    auto load = [&](u32 sb, u32 s) {
        u8* st = stages + s * MM8_STAGE_BYTES;
        for (u32 i = threadIdx.x; i < MM8_ROWS * 9; i += 256) {
            const u32 row = i / 9, piece = i % 9;
            const u8* w = (const u8*)p.w + (u64)min(r0 + row, p.n_rows - 1) * p.row_bytes;
            mma8_cp16(st + row * 144 + 16 * piece, w + 144 * sb + 16 * piece, 16);
        }
        u8* xst = st + MM8_W_BYTES;
        for (u32 i = threadIdx.x; i < MM8_TOK * 16; i += 256) {
            const u32 m = i / 16, piece = i % 16, tok = t0 + min(m, n - 1);
            mma8_cp16(xst + m * MM8_XLD + 16 * piece, xq + (u64)tok * p.k + 256 * sb + 16 * piece, m < n ? 16 : 0);
        }
        float2* xss = (float2*)(xst + MM8_X_BYTES);
        {
            const u32 m = threadIdx.x / 8, b = threadIdx.x % 8, tok = t0 + min(m, n - 1);  // 32 tokens x 8 blocks
            mma8_cp8(xss + b * (MM8_TOK + 1) + m, xs + (u64)tok * n_blk + 8 * sb + b, m < n ? 8 : 0);
        }
    };
#pragma unroll
    for (u32 s = 0; s + 1 < MM8_STAGES; ++s) {
        if (s < n_sb) load(s, s);
        mma8_commit();  // a group even when empty, so the waits count super-blocks
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    bool ok[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) ok[j][c] = 8 * j + 2 * t + c < (int)n;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    for (u32 sb = 0; sb < n_sb; ++sb) {
        mma8_wait<MM8_STAGES - 2>();  // super-block sb has landed (this thread's pieces)
        __syncthreads();              // everyone's, and stage (sb - 1) % STAGES is free again
        if (sb + MM8_STAGES - 1 < n_sb) load(sb + MM8_STAGES - 1, (sb + MM8_STAGES - 1) % MM8_STAGES);
        mma8_commit();
        const u8* st = stages + (sb % MM8_STAGES) * MM8_STAGE_BYTES;
        const u8* w0 = st + (16 * warp + g) * 144;
        const u8* xst = st + MM8_W_BYTES;
        q4k_mma8_superblock(w0, w0 + 8 * 144, xst, MM8_XLD, (const float2*)(xst + MM8_X_BYTES), MM8_TOK + 1, g, t, ok, acc);
    }
    mma8_wait<0>();
    float* y = (float*)p.y;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 m = 8 * j + 2 * t + (c & 1), r = r0 + 16 * warp + g + (c >= 2 ? 8 : 0);
            if (m < n && r < p.n_rows) y[(u64)(t0 + m) * p.n_rows + r] = acc[j][c];
        }
#endif
}
