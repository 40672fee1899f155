// matmul_mma8: y = x·Wᵀ for prompt-sized batches of Q4_K weights on int8 tensor cores, x
// quantised by quantize_q8 (blocks of 32: int8 values, then (d, d·Σq) per block). The dense
// form of moe_mma8s_gate_up_q4_k: a block's 128 rows and 32 (or 64) tokens, each super-block of
// k (the rows' 18 KB, the tokens' int8 values and block scales) copied into shared memory by
// cp.async 3 (2) super-blocks ahead, warp w taking rows 16w..16w+15 against all the tokens
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
#define MM8_XLD 272  // bytes a token's x in a stage (256 + 16)

// A stage: the rows' super-block (128 x 144 bytes), the tokens' 256 values each, their 8 block
// scales [block][token] (pitch TOK + 1). TOK = 32: 29,248 bytes, 3 stages; TOK = 64: 40,000
// bytes, 2 stages (ops/matmul.rs mm8_smem).
template <int TOK>
struct Mm8 {
    static constexpr u32 W_BYTES = MM8_ROWS * 144, X_BYTES = TOK * MM8_XLD, XS_BYTES = 8 * (TOK + 1) * 8;
    static constexpr u32 STAGE_BYTES = W_BYTES + X_BYTES + XS_BYTES;
    static constexpr u32 STAGES = TOK == 32 ? 3 : 2;
};

// grid (ceil(n_tok / TOK), ceil(n_rows / 128)): tokens vary fastest over the blocks, so the
// blocks in flight share weight tiles (read once from memory, then from L2). 256 threads,
// STAGES · STAGE_BYTES of dynamic shared memory.
template <int TOK>
__device__ __forceinline__ void matmul_mma8s(const MatmulMma8Params& p) {
#if __CUDA_ARCH__ >= 800
    using C = Mm8<TOK>;
    constexpr int NJ = TOK / 8;  // n-tiles of 8 tokens
    extern __shared__ __align__(16) u8 stages[];
    const u32 t0 = blockIdx.x * TOK, r0 = blockIdx.y * MM8_ROWS;
    const u32 n = min((u32)TOK, p.n_tok - t0), n_blk = p.k / 32, n_sb = p.k / 256;
    const i8* xq = (const i8*)p.xq;
    const float2* xs = (const float2*)(xq + (u64)p.n_tok * p.k);
    // Super-block `sb` into stage `s`: rows past n_rows copy the last row, tokens past n_tok
    // zeros (neither is written out).
    auto load = [&](u32 sb, u32 s) {
        u8* st = stages + s * C::STAGE_BYTES;
        for (u32 i = threadIdx.x; i < MM8_ROWS * 9; i += 256) {
            const u32 row = i / 9, piece = i % 9;
            const u8* w = (const u8*)p.w + (u64)min(r0 + row, p.n_rows - 1) * p.row_bytes;
            mma8_cp16(st + row * 144 + 16 * piece, w + 144 * sb + 16 * piece, 16);
        }
        u8* xst = st + C::W_BYTES;
        for (u32 i = threadIdx.x; i < TOK * 16; i += 256) {
            const u32 m = i / 16, piece = i % 16, tok = t0 + min(m, n - 1);
            mma8_cp16(xst + m * MM8_XLD + 16 * piece, xq + (u64)tok * p.k + 256 * sb + 16 * piece, m < n ? 16 : 0);
        }
        float2* xss = (float2*)(xst + C::X_BYTES);
        for (u32 i = threadIdx.x; i < TOK * 8; i += 256) {
            const u32 m = i / 8, b = i % 8, tok = t0 + min(m, n - 1);
            mma8_cp8(xss + b * (TOK + 1) + m, xs + (u64)tok * n_blk + 8 * sb + b, m < n ? 8 : 0);
        }
    };
#pragma unroll
    for (u32 s = 0; s + 1 < C::STAGES; ++s) {
        if (s < n_sb) load(s, s);
        mma8_commit();  // a group even when empty, so the waits count super-blocks
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    for (u32 sb = 0; sb < n_sb; ++sb) {
        mma8_wait<C::STAGES - 2>();  // super-block sb has landed (this thread's pieces)
        __syncthreads();             // everyone's, and stage (sb - 1) % STAGES is free again
        if (sb + C::STAGES - 1 < n_sb) load(sb + C::STAGES - 1, (sb + C::STAGES - 1) % C::STAGES);
        mma8_commit();
        const u8* st = stages + (sb % C::STAGES) * C::STAGE_BYTES;
        const u8* w0 = st + (16 * warp + g) * 144;
        const u8* xst = st + C::W_BYTES;
        // Every n-tile, the last block's tokens past n_tok too (zeros; not written out).
        q4k_mma8_superblock<NJ, NJ>(w0, w0 + 8 * 144, xst, MM8_XLD, (const float2*)(xst + C::X_BYTES), TOK + 1, 1, g, t, acc);
    }
    mma8_wait<0>();
    float* y = (float*)p.y;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 m = 8 * j + 2 * t + (c & 1), r = r0 + 16 * warp + g + (c >= 2 ? 8 : 0);
            if (m < n && r < p.n_rows) y[(u64)(t0 + m) * p.n_rows + r] = acc[j][c];
        }
#endif
}

extern "C" __global__ void __launch_bounds__(256, 2) matmul_mma8s_q4_k(const MatmulMma8Params p) {
    pdl_enter();
    matmul_mma8s<32>(p);
}
extern "C" __global__ void __launch_bounds__(256, 2) matmul_mma8s_q4_k_64(const MatmulMma8Params p) {
    pdl_enter();
    matmul_mma8s<64>(p);
}
