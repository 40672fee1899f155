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
#define MOE8_BIAS_BITS 0x4B400000
#define MOE8_BIAS 12582912.0f

struct MoeMma8Params {
    MoeMmaParams q;
    u64 xq;  // quantize_q8 of x (gate/up: n_tok·d) or of h (down: pairs·n_ff): int8, then (d, d·Σq) per block
};

// mma.m16n8k32 (s8) into sums that start at the bits of 1.5·2^23: the int32 result read as a
// float is exactly 1.5·2^23 + Σq·xq (|Σ| < 2^22 for 32 products of |q| <= 32 and |xq| <= 127),
// so one float subtraction converts it (I2F runs at an eighth of the FMA rate).
__device__ __forceinline__ void mma8_k32(const u32 a[4], u32 b0, u32 b1, int ci[4]) {
    ci[0] = ci[1] = ci[2] = ci[3] = MOE8_BIAS_BITS;
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(ci[0]), "+r"(ci[1]), "+r"(ci[2]), "+r"(ci[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same for k = 16 (A: rows g and g + 8, k 4t..4t+3; B: k 4t..4t+3 of column g).
__device__ __forceinline__ void mma8_k16(u32 a0, u32 a1, u32 b0, int ci[4]) {
    ci[0] = ci[1] = ci[2] = ci[3] = MOE8_BIAS_BITS;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+r"(ci[0]), "+r"(ci[1]), "+r"(ci[2]), "+r"(ci[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// One warp's 16 weight rows (rows[0]: row g of them, rows[1]: row g + 8) against up to 32 int8
// vectors (4 n-tiles of 8) over k = 32·n_blk: vector v's values at xq + v·n_blk·32, its block
// scales at xs[v·n_blk + block]; bt[j]: the lane's B vector (column g of n-tile j), ct[j][c]:
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
    static __device__ __forceinline__ void run(const u8* const rows[2], u32 n_blk, const i8* xq, const float2* xs, const u32 bt[4],
                                               const u32 ct[4][2], const bool ct_ok[4][2], int t, float acc[4][4]) {
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
                        const i8* xr = xq + (u64)bt[j] * n_blk * 32 + 32 * (step + h) + 4 * t;
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
                        const float2 xd = xs[(u64)ct[j][c] * n_blk + step + h];
                        const float s0 = __int_as_float(ci[c]) - MOE8_BIAS, s1 = __int_as_float(ci[2 + c]) - MOE8_BIAS;
                        acc[j][c] = fmaf(xd.x * d1[0], s0, fmaf(-m1[0], xd.y, acc[j][c]));
                        acc[j][2 + c] = fmaf(xd.x * d1[1], s1, fmaf(-m1[1], xd.y, acc[j][2 + c]));
                    }
                }
            }
        }
    }
};

// Q6_K: a scale per 16 weights, so one m16n8k16 per 16 (two a k-step of 32):
// Σ_k w_k·x_k = dx·d·sc·Σ (q − 32)·xq. Group s (0..15) of a super-block is weights 16s..16s+15:
// half n = s / 8, quarter r = s % 8 / 2, offset l = 16·(s % 2); its 4-bit values are
// ql[64n + 32(r & 1) + l..] (high nibbles for r >= 2), its 2-bit ones qh[32n + l..] >> 2r, its
// scale sc[s] (kernels/dequant.cuh). Rows are 210-byte blocks: words are loaded 2-aligned.
template <>
struct Mma8Rows<TY_Q6_K> {
    static __device__ __forceinline__ void run(const u8* const rows[2], u32 n_blk, const i8* xq, const float2* xs, const u32 bt[4],
                                               const u32 ct[4][2], const bool ct_ok[4][2], int t, float acc[4][4]) {
        float dr[2];
        for (u32 step = 0; step < n_blk; ++step) {
            const u32 sb = step / 8, s0 = 2 * (step % 8);
            if (s0 == 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i) dr[i] = f16_to_f32(ld_u16(rows[i] + 210 * sb + 208));
            }
            u32 bx[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                bx[j][0] = bx[j][1] = 0;
                if (bt[j] != 0xffffffffu) {
                    const i8* xr = xq + (u64)bt[j] * n_blk * 32 + 32 * step + 4 * t;
                    bx[j][0] = *(const u32*)xr, bx[j][1] = *(const u32*)(xr + 16);
                }
            }
            const u32 n = s0 / 8, r = (s0 % 8) / 2;
            float dl[2][2];
            u32 a[2][2];  // [group of the step][row]
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u8* b = rows[i] + 210 * sb;
                const u32 sc2 = ld_u16(b + 192 + s0);  // the scales of groups s0 and s0 + 1
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 l = 16 * h + 4 * t;
                    const u32 lq = ld_u32_a2(b + 64 * n + 32 * (r & 1) + l), hq = ld_u32_a2(b + 128 + 32 * n + l);
                    u32 v = ((lq >> (4 * (r >> 1))) & 0x0F0F0F0Fu) | (((hq >> (2 * r)) & 0x03030303u) << 4);
                    // q − 32 per byte (q < 64): flip bit 5; where it is then set, q was < 32 and
                    // the byte is negative: set bits 6 and 7 too.
                    v ^= 0x20202020u;
                    a[h][i] = v | (v & 0x20202020u) * 6;
                    dl[h][i] = dr[i] * (float)(i8)((sc2 >> (8 * h)) & 0xFF);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int ci[4];
                    mma8_k16(a[h][0], a[h][1], bx[j][h], ci);
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (!ct_ok[j][c]) continue;
                        const float dx = xs[(u64)ct[j][c] * n_blk + step].x;
                        const float s_0 = __int_as_float(ci[c]) - MOE8_BIAS, s_1 = __int_as_float(ci[2 + c]) - MOE8_BIAS;
                        acc[j][c] = fmaf(dx * dl[h][0], s_0, acc[j][c]);
                        acc[j][2 + c] = fmaf(dx * dl[h][1], s_1, acc[j][2 + c]);
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

// grid (n_ff / MOE8_ROWS, max_tiles), 256 threads; d % 256 == 0, n_ff % MOE8_ROWS == 0.
extern "C" __global__ void __launch_bounds__(256, 2) moe_mma8_gate_up_q4_k(const MoeMma8Params p8) {
    pdl_enter();
#if __CUDA_ARCH__ >= 800
    const MoeMmaParams& q = p8.q;
    const MoeParams& p = q.m;
    __shared__ float ups[MOE8_ROWS][MOE_BM + 1];
    __shared__ u32 pair[MOE_BM];
    __shared__ u32 tok[MOE_BM];
    const u32* plan = (const u32*)q.plan;
    const u32 tile = blockIdx.y;
    if (tile >= plan[0]) return;  // the whole block
    const u32 e = plan[1 + 3 * tile] /* the slot */, first = plan[2 + 3 * tile], n = plan[3 + 3 * tile];
    const u32* list = plan + 1 + 3 * q.max_tiles;
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
    Mma8Rows<TY_Q4_K>::run(rows, p.d / 32, xq, xs, bt, ct, ct_ok, t, acc);
    // The up warps' sums to shared memory; the gate warps write h = silu(g)·u.
    if (is_up) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) ups[r_w + g + (c >= 2 ? 8 : 0)][8 * j + 2 * t + (c & 1)] = acc[j][c];
    }
    __syncthreads();
    if (!is_up) {
        float* h = (float*)p.h;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = 8 * j + 2 * t + (c & 1), r = r_w + g + (c >= 2 ? 8 : 0);
                if (m < (int)n) h[(u64)pair[m] * p.n_ff + r0 + r] = silu_f(acc[j][c]) * ups[r][m];
            }
    }
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
    const u32* plan = (const u32*)q.plan;
    const u32 tile = blockIdx.y;
    if (tile >= plan[0]) return;  // the whole block
    const u32 e = plan[1 + 3 * tile] /* the slot */, first = plan[2 + 3 * tile], n = plan[3 + 3 * tile];
    const u32* list = plan + 1 + 3 * q.max_tiles;
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
    Mma8Rows<TY>::run(rows, p.n_ff / 32, hq, hs, bt, ct, ct_ok, t, acc);
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
#define MOE8S_STAGE_BYTES (MOE8S_W_BYTES + MOE8S_X_BYTES + MOE8S_XS_BYTES)  // 29,248 (ops/moe.rs)

#if __CUDA_ARCH__ >= 800
// 16 (n = 16) or no bytes (n = 0: zeros) from global to shared memory, asynchronously.
__device__ __forceinline__ void moe8_cp16(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void moe8_cp8(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void moe8_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void moe8_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

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
    const u32* plan = (const u32*)q.plan;
    const u32 tile = blockIdx.y;
    if (tile >= plan[0]) return;  // the whole block
    const u32 e = plan[1 + 3 * tile] /* the slot */, first = plan[2 + 3 * tile], n = plan[3 + 3 * tile];
    const u32* list = plan + 1 + 3 * q.max_tiles;
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
            moe8_cp16(st + row * 144 + 16 * piece, w + 144 * sb + 16 * piece, 16);
        }
        u8* xst = st + MOE8S_W_BYTES;
        for (u32 i = threadIdx.x; i < MOE_BM * 16; i += 256) {
            const u32 m = i / 16, piece = i % 16;
            moe8_cp16(xst + m * MOE8S_XLD + 16 * piece, xq + (u64)tok[m] * p.d + 256 * sb + 16 * piece, m < n ? 16 : 0);
        }
        float2* xss = (float2*)(xst + MOE8S_X_BYTES);
        {
            const u32 m = threadIdx.x / 8, b = threadIdx.x % 8;  // 256 threads: 32 pairs x 8 blocks
            moe8_cp8(xss + b * (MOE_BM + 1) + m, xs + (u64)tok[m] * n_blk + 8 * sb + b, m < n ? 8 : 0);
        }
    };
#pragma unroll
    for (u32 s = 0; s + 1 < MOE8S_STAGES; ++s) {
        if (s < n_sb) load(s, s);
        moe8_commit();  // a group even when empty, so the waits count super-blocks
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool is_up = warp >= 4;
    const int r_w = 16 * (warp % 4);  // the warp's first row of the block's 64
    const u32 wrow = (is_up ? MOE8_ROWS : 0) + r_w + g;  // the lane's first row in a stage
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
        moe8_wait<MOE8S_STAGES - 2>();  // super-block sb has landed (this thread's pieces)
        __syncthreads();                // everyone's, and stage (sb - 1) % STAGES is free again
        if (sb + MOE8S_STAGES - 1 < n_sb) load(sb + MOE8S_STAGES - 1, (sb + MOE8S_STAGES - 1) % MOE8S_STAGES);
        moe8_commit();
        const u8* st = stages + (sb % MOE8S_STAGES) * MOE8S_STAGE_BYTES;
        const u8* w0 = st + wrow * 144;
        const u8* w1 = w0 + 8 * 144;
        const u8* xst = st + MOE8S_W_BYTES;
        const float2* xss = (const float2*)(xst + MOE8S_X_BYTES);
        const u32 hd[2] = {*(const u32*)w0, *(const u32*)w1};
        const u32 hs[2][3] = {{*(const u32*)(w0 + 4), *(const u32*)(w0 + 8), *(const u32*)(w0 + 12)},
                              {*(const u32*)(w1 + 4), *(const u32*)(w1 + 8), *(const u32*)(w1 + 12)}};
        const float dd[2] = {f16_to_f32((u16)(hd[0] & 0xFFFF)), f16_to_f32((u16)(hd[1] & 0xFFFF))};
        const float dm[2] = {f16_to_f32((u16)(hd[0] >> 16)), f16_to_f32((u16)(hd[1] >> 16))};
#pragma unroll  // (rolled: pp512 -2.4 %, H100)
        for (u32 sub = 0; sub < 8; sub += 2) {
            // A: rows g and g + 8, weights 4t..4t+3 and 16+4t..16+4t+3 of sub-blocks sub, sub + 1.
            const u32 qoff = 16 + 32 * (sub / 2) + 4 * t;
            const u32 raw[4] = {*(const u32*)(w0 + qoff), *(const u32*)(w1 + qoff), *(const u32*)(w0 + qoff + 16),
                                *(const u32*)(w1 + qoff + 16)};
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
                    d1[i] = dd[i] * sc;
                    m1[i] = dm[i] * mn;
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // B: column g of n-tile j (pair 8j + g), k 4t..4t+3 and 16+4t..16+4t+3.
                    const u8* xr = xst + (8 * j + g) * MOE8S_XLD + 32 * (sub + h) + 4 * t;
                    int ci[4];
                    mma8_k32(a, *(const u32*)xr, *(const u32*)(xr + 16), ci);
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        if (!ok[j][c]) continue;
                        const float2 xd = xss[(sub + h) * (MOE_BM + 1) + 8 * j + 2 * t + c];
                        const float s0 = __int_as_float(ci[c]) - MOE8_BIAS, s1 = __int_as_float(ci[2 + c]) - MOE8_BIAS;
                        acc[j][c] = fmaf(xd.x * d1[0], s0, fmaf(-m1[0], xd.y, acc[j][c]));
                        acc[j][2 + c] = fmaf(xd.x * d1[1], s1, fmaf(-m1[1], xd.y, acc[j][2 + c]));
                    }
                }
            }
        }
    }
    moe8_wait<0>();
    __syncthreads();  // every warp is done with the stages: the up sums take their place
    float(*ups)[MOE_BM + 1] = (float(*)[MOE_BM + 1])stages;
    if (is_up) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) ups[r_w + g + (c >= 2 ? 8 : 0)][8 * j + 2 * t + (c & 1)] = acc[j][c];
    }
    __syncthreads();
    if (!is_up) {
        float* hb = (float*)p.h;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = 8 * j + 2 * t + (c & 1), r = r_w + g + (c >= 2 ? 8 : 0);
                if (m < (int)n) hb[(u64)pair[m] * p.n_ff + r0 + r] = silu_f(acc[j][c]) * ups[r][m];
            }
    }
#endif
}
