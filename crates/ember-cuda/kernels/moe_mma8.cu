// moe_mma8: the grouped prompt MoE (moe.cu's moe_plan tiles) on int8 tensor cores, for the
// experts of Q4_K gate/up and Q4_K or Q6_K down; moe.cu holds the f16 tiles, the plan and the
// combine. Gate/up reads x quantised by quantize_q8, down h quantised the same way.

// ---- Q4_K gate/up on int8 tensor cores (sm_80+) ----
// The same tiles as moe_mma_gate_up_fused (the plan's tiles of up to MOE_BM pairs of one expert)
// with x quantised by quantize_q8 (blocks of 32: int8 values, then (d, d·Σq) per block) and the
// weights' 4-bit values fed to `mma.m16n8k32.s8` as they are: a lane's A register is one 32-bit
// load of 8 nibbles, masked to 4 bytes, with no per-weight decode. Per sub-block of 32 weights
// (one k-step) the integer sums are scaled: Σ_k w_k·x_k = dx·(d1·Σ q·xq) − m1·(dx·Σxq), with
// d1 = d·sc and m1 = dmin·m of the row's sub-block. Error: the activations' rounding to int8
// (as the per-pair int8 kernels of decode).
//
// Block: 64 rows of gate and the same 64 of up x 32 pairs, 8 warps: warp w takes 16 rows of
// gate (w < 4) or up (w >= 4), all 32 pairs (4 n-tiles of 8). The up warps hand their sums to
// the gate warps through shared memory for h = silu(g)·u.

#define MOE8_ROWS 64

struct MoeMma8Params {
    MoeMmaParams q;
    u64 xq;  // quantize_q8 of x (gate/up: n_tok·d) or of h (down: pairs·n_ff): int8, then (d, d·Σq) per block
};

// One warp's 16 weight rows (rows[0]: row g of them, rows[1]: row g + 8) against up to 32 int8
// vectors (4 n-tiles of 8) over k = 32·n_blk: vector v's values at xq + v·x_pitch, its block
// scales at xs[v·s_pitch + block] (global memory or a staged copy); bt[j]: the lane's B vector (column g of n-tile j), ct[j][c]:
// its C vectors (columns 2t + c), ~0u for none. acc[j][c]: c < 2 row g, vectors 2t + c; c >= 2
// row g + 8, vectors 2t + c − 2. The type's weights go into the A registers as they are.
template <int TY>
struct Mma8Rows;

// Q4_K: per sub-block of 32 (one k-step) Σ_k w_k·x_k = dx·(d1·Σ q·xq) − m1·(dx·Σxq), with
// d1 = d·sc and m1 = dmin·m of the row's sub-block. Two sub-blocks a round: they share their 32
// bytes of 4-bit values (low and high nibbles), so a lane's A words are loaded once for both,
// and both rounds' x loads are in flight together.
template <>
struct Mma8Rows<TY_Q4_K> {
    static __device__ __forceinline__ void run(const u8* const rows[2], u32 n_blk, const i8* xq, const float2* xs, u32 x_pitch, u32 s_pitch,
                                               const u32 bt[4], const u32 ct[4][2], const bool ct_ok[4][2], int t, float acc[4][4]) {
        u32 hd[2], hs[2][3];
        for (u32 step = 0; step < n_blk; step += 2) {
            const u32 sb = step / 8, sub = step % 8;  // sub even
            if (sub == 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const u8* b = rows[i] + 144 * sb;
                    hd[i] = *(const u32*)b;
                    hs[i][0] = *(const u32*)(b + 4), hs[i][1] = *(const u32*)(b + 8), hs[i][2] = *(const u32*)(b + 12);
                }
            }
            // A: rows g and g + 8, weights 4t..4t+3 and 16+4t..16+4t+3 of each sub-block.
            const u32 qoff = 144 * sb + 16 + 32 * (sub / 2) + 4 * t;
            const u32 raw[4] = {*(const u32*)(rows[0] + qoff), *(const u32*)(rows[1] + qoff), *(const u32*)(rows[0] + qoff + 16),
                                *(const u32*)(rows[1] + qoff + 16)};
            u32 bx[2][4][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    bx[h][j][0] = bx[h][j][1] = 0;
                    if (bt[j] != 0xffffffffu) {
                        const i8* xr = xq + (u64)bt[j] * x_pitch + 32 * (step + h) + 4 * t;
                        bx[h][j][0] = *(const u32*)xr, bx[h][j][1] = *(const u32*)(xr + 16);
                    }
                }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 a[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = (raw[i] >> (4 * h)) & 0x0F0F0F0Fu;
                float d1[2], m1[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    int sc, mn;
                    scale_min_k4_words(sub + h, hs[i][0], hs[i][1], hs[i][2], &sc, &mn);
                    d1[i] = f16_to_f32((u16)(hd[i] & 0xFFFF)) * sc;
                    m1[i] = f16_to_f32((u16)(hd[i] >> 16)) * mn;
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int ci[4];
                    mma8_k32(a, bx[h][j][0], bx[h][j][1], ci);
                    // C: ci[0], ci[1] row g, vectors 2t, 2t+1; ci[2], ci[3] row g + 8.
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (!ct_ok[j][c]) continue;
                        const float2 xd = xs[(u64)ct[j][c] * s_pitch + step + h];
                        const float s0 = __int_as_float(ci[c]) - MMA8_BIAS, s1 = __int_as_float(ci[2 + c]) - MMA8_BIAS;
                        acc[j][c] = fmaf(xd.x * d1[0], s0, fmaf(-m1[0], xd.y, acc[j][c]));
                        acc[j][2 + c] = fmaf(xd.x * d1[1], s1, fmaf(-m1[1], xd.y, acc[j][2 + c]));
                    }
                }
            }
        }
    }
};

// Q6_K: a scale per 16 weights, so one m16n8k16 per 16 (two a k-step of 32):
// Σ_k w_k·x_k = dx·d·sc·Σ (q − 32)·xq, a step's A words and scales from q6k_mma8_step (mma8.cuh).
// Rows are 210 bytes a super-block (repacked: runs, then the d's): words are loaded 2-aligned.
template <>
struct Mma8Rows<TY_Q6_K> {
    static __device__ __forceinline__ void run(const u8* const rows[2], u32 n_blk, const i8* xq, const float2* xs, u32 x_pitch, u32 s_pitch,
                                               const u32 bt[4], const u32 ct[4][2], const bool ct_ok[4][2], int t, float acc[4][4]) {
        float dr[2];
        for (u32 step = 0; step < n_blk; ++step) {
            const u32 sb = step / 8, s0 = 2 * (step % 8);
            if (s0 == 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    dr[i] = f16_to_f32(ld_u16(q6k_dp(rows[i], n_blk / 8, sb)));
                }
            }
            u32 bx[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                bx[j][0] = bx[j][1] = 0;
                if (bt[j] != 0xffffffffu) {
                    const i8* xr = xq + (u64)bt[j] * x_pitch + 32 * step + 4 * t;
                    bx[j][0] = *(const u32*)xr, bx[j][1] = *(const u32*)(xr + 16);
                }
            }
            float dl[2][2];  // [row][group of the step]
            u32 a[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                q6k_mma8_step(q6k_blk(rows[i], n_blk / 8, sb), step % 8, t, dr[i], a[i], dl[i]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int ci[4];
                    mma8_k16(a[0][h], a[1][h], bx[j][h], ci);
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (!ct_ok[j][c]) continue;
                        const float dx = xs[(u64)ct[j][c] * s_pitch + step].x;
                        const float s_0 = __int_as_float(ci[c]) - MMA8_BIAS, s_1 = __int_as_float(ci[2 + c]) - MMA8_BIAS;
                        acc[j][c] = fmaf(dx * dl[0][h], s_0, acc[j][c]);
                        acc[j][2 + c] = fmaf(dx * dl[1][h], s_1, acc[j][2 + c]);
                    }
                }
        }
    }
};

// The lane's B vectors (column g of each n-tile) and C vectors (columns 2t, 2t + 1) of a tile's
// MOE_BM entries `vec` (~0u: none).
__device__ __forceinline__ void mma8_lanes(const u32* vec, int g, int t, u32 bt[4], u32 ct[4][2], bool ct_ok[4][2]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        bt[j] = vec[8 * j + g];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            ct[j][c] = vec[8 * j + 2 * t + c];
            ct_ok[j][c] = ct[j][c] != 0xffffffffu;
        }
    }
}

// ---- Q4_K gate/up on int8 tensor cores (sm_80+) ----
// The same tiles as moe_mma_gate_up_fused (the plan's tiles of up to MOE_BM pairs of one expert)
// with x quantised by quantize_q8 (blocks of 32: int8 values, then (d, d·Σq) per block) and the
// weights' 4-bit values fed to `mma.m16n8k32.s8` as they are (Mma8Rows): a lane's A register is
// one 32-bit load of 8 nibbles, masked to 4 bytes, with no per-weight decode. Error: the
// activations' rounding to int8 (as the per-pair int8 kernels of decode).
//
// Block: 64 rows of gate and the same 64 of up x 32 pairs, 8 warps: warp w takes 16 rows of
// gate (w < 4) or up (w >= 4), all 32 pairs (4 n-tiles of 8). The up warps hand their sums to
// the gate warps through shared memory for h = silu(g)·u.

// The end both int8 gate/up kernels share: the up warps' sums (warps 4..7) to `ups`, then
// the gate warps write h = silu(g)·u for the tile's n pairs, row r of the block's 64 at
// h[pair · n_ff + r] (h: the block's first row). A barrier inside: every thread calls it.
__device__ __forceinline__ void moe8_swiglu_out(float (*ups)[MOE_BM + 1], const float acc[4][4], bool is_up, int r_w, int g, int t, u32 n,
                                                const u32* pair, float* h, u32 n_ff) {
    if (is_up) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) ups[r_w + g + (c >= 2 ? 8 : 0)][8 * j + 2 * t + (c & 1)] = acc[j][c];
    }
    __syncthreads();
    if (!is_up) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = 8 * j + 2 * t + (c & 1), r = r_w + g + (c >= 2 ? 8 : 0);
                if (m < (int)n) h[(u64)pair[m] * n_ff + r] = silu_f(acc[j][c]) * ups[r][m];
            }
    }
}

// grid (n_ff / MOE8_ROWS, max_tiles), 256 threads; d % 256 == 0, n_ff % MOE8_ROWS == 0.
extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8_gate_up_q4_k(const MoeMma8Params p8) {
    pdl_enter();
#if __CUDA_ARCH__ >= 800
    const MoeMmaParams& q = p8.q;
    const MoeParams& p = q.m;
    __shared__ float ups[MOE8_ROWS][MOE_BM + 1];
    __shared__ u32 pair[MOE_BM];
    __shared__ u32 tok[MOE_BM];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) {
        pair[m] = m < n ? list[first + m] : 0;
        tok[m] = m < n ? list[first + m] / p.k_top : 0xffffffffu;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool is_up = warp >= 4;
    const int r_w = 16 * (warp % 4);  // the warp's first row of the block's 64
    const u32 r0 = blockIdx.x * MOE8_ROWS;
    const u8* base = (const u8*)(is_up ? p.up : p.gate) + ((u64)e * p.n_ff + r0 + r_w + g) * p.row_bytes_gu;
    const u8* const rows[2] = {base, base + 8 * (u64)p.row_bytes_gu};
    const i8* xq = (const i8*)p8.xq;
    const float2* xs = (const float2*)(xq + (u64)p.n_tok * p.d);
    u32 bt[4], ct[4][2];
    bool ct_ok[4][2];
    mma8_lanes(tok, g, t, bt, ct, ct_ok);
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    Mma8Rows<TY_Q4_K>::run(rows, p.d / 32, xq, xs, p.d, p.d / 32, bt, ct, ct_ok, t, acc);
    moe8_swiglu_out(ups, acc, is_up, r_w, g, t, n, pair, (float*)p.h + r0, p.n_ff);
#endif
}

// ---- down on int8 tensor cores (Q4_K, Q6_K; sm_80+) ----
// part[pair] = w_pair · down_e · hq[pair], hq = quantize_q8 of h (pairs·n_ff values): the plan's
// tiles again, 128 rows of down x 32 pairs a block, warp w rows 16w..16w+15 (Mma8Rows). Error:
// h's rounding to int8 (as the per-pair int8 down of decode).

#define MOE8D_ROWS 128

// grid (d / MOE8D_ROWS, max_tiles), 256 threads; n_ff % 256 == 0, d % MOE8D_ROWS == 0.
template <int TY>
__device__ __forceinline__ void moe_mma8_down(const MoeMma8Params& p8) {
#if __CUDA_ARCH__ >= 800
    const MoeMmaParams& q = p8.q;
    const MoeParams& p = q.m;
    __shared__ u32 pair[MOE_BM];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) pair[m] = m < n ? list[first + m] : 0xffffffffu;
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 r0 = blockIdx.x * MOE8D_ROWS + 16 * warp;  // the warp's first row
    const u8* base = (const u8*)p.down + ((u64)e * p.d + r0 + g) * p.row_bytes_down;
    const u8* const rows[2] = {base, base + 8 * (u64)p.row_bytes_down};
    const i8* hq = (const i8*)p8.xq;
    const float2* hs = (const float2*)(hq + (u64)p.n_tok * p.k_top * p.n_ff);
    u32 bt[4], ct[4][2];
    bool ct_ok[4][2];
    mma8_lanes(pair, g, t, bt, ct, ct_ok);
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    Mma8Rows<TY>::run(rows, p.n_ff / 32, hq, hs, p.n_ff, p.n_ff / 32, bt, ct, ct_ok, t, acc);
    float* part = (float*)q.part;
    const float* wt = (const float*)p.weights;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 pr = ct[j][c & 1];
            if (ct_ok[j][c & 1]) part[(u64)pr * p.d + r0 + g + (c >= 2 ? 8 : 0)] = wt[pr] * acc[j][c];
        }
#endif
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8_down_q4_k(const MoeMma8Params p8) {
    pdl_enter();
    moe_mma8_down<TY_Q4_K>(p8);
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8_down_q6_k(const MoeMma8Params p8) {
    pdl_enter();
    moe_mma8_down<TY_Q6_K>(p8);
}

// ---- Q4_K gate/up on int8 tensor cores, staged through shared memory (sm_80+) ----
// moe_mma8_gate_up_q4_k's tiles and sums (the same integer products, scaled in the same order)
// with the weights and x no longer read straight into registers: ncu had that kernel at 24 %
// occupancy (126 registers) with each warp's next loads waiting on its last, ~7x the time its
// bytes need at pp512. Here a block copies each super-block of k (256 weights) of its 128 rows
// (gate 64, up 64: 18 KB), the tile's 32 int8 x rows and their block scales into shared memory
// with cp.async, MOE8S_STAGES super-blocks ahead, and the warps read their mma operands from
// there (layouts padded so a warp's operand loads hit 32 distinct banks).

#define MOE8S_STAGES 3
#define MOE8S_XLD 272                                // bytes a pair's x row in a stage (256 + 16)
#define MOE8S_W_BYTES (2 * MOE8_ROWS * 144)          // the gate and up rows' super-block
#define MOE8S_X_BYTES (MOE_BM * MOE8S_XLD)           // the tile's x, 256 values a pair
#define MOE8S_XS_BYTES (8 * (MOE_BM + 1) * 8)        // their 8 block scales (d, d·Σq), [block][pair]
#define MOE8S_STAGE_BYTES (MOE8S_W_BYTES + MOE8S_X_BYTES + MOE8S_XS_BYTES)  // 29,248 (ops/moe/mod.rs)


// grid (n_ff / MOE8_ROWS, max_tiles), 256 threads, MOE8S_STAGES · MOE8S_STAGE_BYTES of dynamic
// shared memory; d % 256 == 0, n_ff % MOE8_ROWS == 0.
extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8s_gate_up_q4_k(const MoeMma8Params p8) {
    pdl_enter();
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) u8 stages[];
    const MoeMmaParams& q = p8.q;
    const MoeParams& p = q.m;
    __shared__ u32 pair[MOE_BM];
    __shared__ u32 tok[MOE_BM];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) {
        pair[m] = m < n ? list[first + m] : 0;
        tok[m] = m < n ? list[first + m] / p.k_top : 0;  // pair 0's row stands in (zeros copied)
    }
    __syncthreads();
    const u32 r0 = blockIdx.x * MOE8_ROWS, n_blk = p.d / 32, n_sb = p.d / 256;
    const i8* xq = (const i8*)p8.xq;
    const float2* xs = (const float2*)(xq + (u64)p.n_tok * p.d);
    // Super-block `sb` of every operand into stage `s`: 1,152 + 512 16-byte pieces and 256
    // 8-byte ones, 7.5 a thread.
    auto load = [&](u32 sb, u32 s) {
        u8* st = stages + s * MOE8S_STAGE_BYTES;
        for (u32 i = threadIdx.x; i < 2 * MOE8_ROWS * 9; i += 256) {
            const u32 row = i / 9, piece = i % 9, r = row % MOE8_ROWS;
            const u8* w = (const u8*)(row < MOE8_ROWS ? p.gate : p.up) + ((u64)e * p.n_ff + r0 + r) * p.row_bytes_gu;
            mma8_cp16(st + row * 144 + 16 * piece, w + 144 * sb + 16 * piece, 16);
        }
        u8* xst = st + MOE8S_W_BYTES;
        for (u32 i = threadIdx.x; i < MOE_BM * 16; i += 256) {
            const u32 m = i / 16, piece = i % 16;
            mma8_cp16(xst + m * MOE8S_XLD + 16 * piece, xq + (u64)tok[m] * p.d + 256 * sb + 16 * piece, m < n ? 16 : 0);
        }
        float2* xss = (float2*)(xst + MOE8S_X_BYTES);
        {
            const u32 m = threadIdx.x / 8, b = threadIdx.x % 8;  // 256 threads: 32 pairs x 8 blocks
            mma8_cp8(xss + b * (MOE_BM + 1) + m, xs + (u64)tok[m] * n_blk + 8 * sb + b, m < n ? 8 : 0);
        }
    };
#pragma unroll
    for (u32 s = 0; s + 1 < MOE8S_STAGES; ++s) {
        if (s < n_sb) load(s, s);
        mma8_commit();  // a group even when empty, so the waits count super-blocks
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool is_up = warp >= 4;
    const int r_w = 16 * (warp % 4);  // the warp's first row of the block's 64
    const u32 wrow = (is_up ? MOE8_ROWS : 0) + r_w + g;  // the lane's first row in a stage
    const u32 na = (n + 7) / 8;  // n-tiles that hold pairs (1..4)
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    for (u32 sb = 0; sb < n_sb; ++sb) {
        mma8_wait<MOE8S_STAGES - 2>();  // super-block sb has landed (this thread's pieces)
        __syncthreads();                // everyone's, and stage (sb - 1) % STAGES is free again
        if (sb + MOE8S_STAGES - 1 < n_sb) load(sb + MOE8S_STAGES - 1, (sb + MOE8S_STAGES - 1) % MOE8S_STAGES);
        mma8_commit();
        const u8* st = stages + (sb % MOE8S_STAGES) * MOE8S_STAGE_BYTES;
        const u8* w0 = st + wrow * 144;
        const u8* w1 = w0 + 8 * 144;
        const u8* xst = st + MOE8S_W_BYTES;
        const float2* xss = (const float2*)(xst + MOE8S_X_BYTES);
        switch (na) {  // block-uniform
        case 1: q4k_mma8_superblock<4, 1>(w0, w1, xst, MOE8S_XLD, xss, MOE_BM + 1, 1, g, t, acc); break;
        case 2: q4k_mma8_superblock<4, 2>(w0, w1, xst, MOE8S_XLD, xss, MOE_BM + 1, 1, g, t, acc); break;
        case 3: q4k_mma8_superblock<4, 3>(w0, w1, xst, MOE8S_XLD, xss, MOE_BM + 1, 1, g, t, acc); break;
        default: q4k_mma8_superblock<4, 4>(w0, w1, xst, MOE8S_XLD, xss, MOE_BM + 1, 1, g, t, acc); break;
        }
    }
    mma8_wait<0>();
    __syncthreads();  // every warp is done with the stages: the up sums take their place
    moe8_swiglu_out((float(*)[MOE_BM + 1])stages, acc, is_up, r_w, g, t, n, pair, (float*)p.h + r0, p.n_ff);
#endif
}

// ---- down on int8 tensor cores, staged through shared memory (Q4_K, Q6_K; sm_80+) ----
// moe_mma8_down's tiles and sums (the same operands in the same order as its Mma8Rows, here
// through q4k_ / q6k_mma8_superblock, only the n-tiles that hold pairs) with the
// block's 128 rows of down (all of k = n_ff <= 512), the tile's 32 int8 h rows and their block
// scales copied into shared memory by cp.async first, one group a super-block, so the first
// super-block's products start while the second's bytes land. Q6_K rows are 210 bytes a
// super-block (repacked at upload: two 208-byte runs, then the two d's), 2-byte aligned: they are copied as whole 420-byte rows
// (n_ff = 512: 4-byte aligned) in 4-byte pieces; Q4_K rows in 16-byte ones.

#define MOE8SD_HLD 528  // bytes an h row in shared memory (512 + 16: 32 distinct banks for a warp's B loads)
#define MOE8SD_SLD 17   // float2 an h row's block scales (16 + 1)

template <int TY>
struct Moe8sDown;
template <>
struct Moe8sDown<TY_Q4_K> {
    static constexpr u32 PITCH = 304;  // 2·144 + 16: rows g and g + 8 of a warp's 8 on distinct banks
    // Super-block sb (of nb) of the lane's two staged rows against the tile's h (hsb: its 256
    // values of sb a pair, pitch MOE8SD_HLD; hss: its block scales, MOE8SD_SLD a pair), NA
    // n-tiles.
    template <int NA>
    static __device__ __forceinline__ void superblock(const u8* r0, const u8* r1, int nb, int sb, const u8* hsb, const float2* hss, int g, int t,
                                                      float acc[4][4]) {
        q4k_mma8_superblock<4, NA>(r0 + 144 * sb, r1 + 144 * sb, hsb, MOE8SD_HLD, hss, 1, MOE8SD_SLD, g, t, acc);
    }
};
template <>
struct Moe8sDown<TY_Q6_K> {
    static constexpr u32 PITCH = 432;  // 2·210 + 12
    template <int NA>
    static __device__ __forceinline__ void superblock(const u8* r0, const u8* r1, int nb, int sb, const u8* hsb, const float2* hss, int g, int t,
                                                      float acc[4][4]) {
        q6k_mma8_superblock<4, NA>(r0, r1, nb, sb, hsb, MOE8SD_HLD, hss, 1, MOE8SD_SLD, g, t, acc);
    }
};

// grid (d / MOE8D_ROWS, max_tiles), 256 threads, 128·PITCH + 32·MOE8SD_HLD + 32·MOE8SD_SLD·8
// bytes of dynamic shared memory (ops/moe/mod.rs); d % 128 == 0; n_ff 256 or 512 (Q4_K), 512 (Q6_K).
template <int TY>
__device__ __forceinline__ void moe_mma8s_down(const MoeMma8Params& p8) {
#if __CUDA_ARCH__ >= 800
    using C = Moe8sDown<TY>;
    extern __shared__ __align__(16) u8 stages[];
    const MoeMmaParams& q = p8.q;
    const MoeParams& p = q.m;
    __shared__ u32 pair[MOE_BM];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    // The host launches only these n_ff (ops/moe/mod.rs moe8s_down_fits); anything else would read
    // past the staged rows.
    if (TY == TY_Q6_K ? p.n_ff != 512 : p.n_ff != 256 && p.n_ff != 512) return;
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) pair[m] = m < n ? list[first + m] : list[first];  // (zeros copied)
    __syncthreads();
    const u32 r_blk = blockIdx.x * MOE8D_ROWS, n_blk = p.n_ff / 32, n_sb = p.n_ff / 256;
    u8* ws = stages;
    u8* hst = ws + MOE8D_ROWS * C::PITCH;
    float2* hss = (float2*)(hst + MOE_BM * MOE8SD_HLD);
    const i8* hq = (const i8*)p8.xq;
    const float2* hs = (const float2*)(hq + (u64)p.n_tok * p.k_top * p.n_ff);
    const u8* wbase = (const u8*)p.down + ((u64)e * p.d + r_blk) * p.row_bytes_down;
    for (u32 sb = 0; sb < n_sb; ++sb) {
        if (TY == TY_Q6_K) {
            // Words 0..51 of a row (the first super-block's run) and 104 (both d's), then 52..103.
            const u32 w0 = sb == 0 ? 0 : 52, nw = sb == 0 ? 53 : 52;
            for (u32 i = threadIdx.x; i < MOE8D_ROWS * nw; i += 256) {
                const u32 row = i / nw, j = i % nw, w = sb == 0 && j == 52 ? 104 : w0 + j;
                mma8_cp4(ws + row * C::PITCH + 4 * w, wbase + (u64)row * p.row_bytes_down + 4 * w);
            }
        } else {
            for (u32 i = threadIdx.x; i < MOE8D_ROWS * 9; i += 256) {
                const u32 row = i / 9, at = 144 * sb + 16 * (i % 9);
                mma8_cp16(ws + row * C::PITCH + at, wbase + (u64)row * p.row_bytes_down + at, 16);
            }
        }
        for (u32 i = threadIdx.x; i < MOE_BM * 16; i += 256) {
            const u32 m = i / 16, at = 256 * sb + 16 * (i % 16);
            mma8_cp16(hst + m * MOE8SD_HLD + at, hq + (u64)pair[m] * p.n_ff + at, m < n ? 16 : 0);
        }
        {
            const u32 m = threadIdx.x / 8, b = 8 * sb + threadIdx.x % 8;  // 256 threads: 32 pairs x 8 blocks
            mma8_cp8(hss + m * MOE8SD_SLD + b, hs + (u64)pair[m] * n_blk + b, m < n ? 8 : 0);
        }
        mma8_commit();
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 r_w = 16 * warp;  // the warp's first row of the block's 128
    const u32 na = (n + 7) / 8;  // n-tiles that hold pairs (1..4)
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;
    for (u32 sb = 0; sb < n_sb; ++sb) {
        if (sb + 1 < n_sb) {
            mma8_wait<1>();
        } else {
            mma8_wait<0>();
        }
        __syncthreads();  // every thread's pieces of super-block sb
        const u8* const rows[2] = {ws + (r_w + g) * C::PITCH, ws + (r_w + g + 8) * C::PITCH};
        const u8* hsb = hst + 256 * sb;
        switch (na) {  // block-uniform
        case 1: Moe8sDown<TY>::template superblock<1>(rows[0], rows[1], n_sb, sb, hsb, hss + 8 * sb, g, t, acc); break;
        case 2: Moe8sDown<TY>::template superblock<2>(rows[0], rows[1], n_sb, sb, hsb, hss + 8 * sb, g, t, acc); break;
        case 3: Moe8sDown<TY>::template superblock<3>(rows[0], rows[1], n_sb, sb, hsb, hss + 8 * sb, g, t, acc); break;
        default: Moe8sDown<TY>::template superblock<4>(rows[0], rows[1], n_sb, sb, hsb, hss + 8 * sb, g, t, acc); break;
        }
    }
    float* part = (float*)q.part;
    const float* wt = (const float*)p.weights;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 m = 8 * j + 2 * t + (c & 1);
            if (m >= n) continue;
            const u32 pr = pair[m];
            part[(u64)pr * p.d + r_blk + r_w + g + (c >= 2 ? 8 : 0)] = wt[pr] * acc[j][c];
        }
#endif
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8s_down_q4_k(const MoeMma8Params p8) {
    pdl_enter();
    moe_mma8s_down<TY_Q4_K>(p8);
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8s_down_q6_k(const MoeMma8Params p8) {
    pdl_enter();
    moe_mma8s_down<TY_Q6_K>(p8);
}
