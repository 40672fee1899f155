// mma8.cuh: int8 tensor-core pieces the grouped MoE (moe_mma8.cu) and the dense prompt matmul
// (matmul_mma8.cu) share: the s8 mma with its sums read back as floats, cp.async, and one
// super-block of Q4_K (or Q6_K) rows against staged int8 activations.

#define MMA8_BIAS_BITS 0x4B400000
#define MMA8_BIAS 12582912.0f

// mma.m16n8k32 (s8) into sums that start at the bits of 1.5·2^23: the int32 result read as a
// float is exactly 1.5·2^23 + Σq·xq (|Σ| < 2^22 for 32 products of |q| <= 32 and |xq| <= 127),
// so one float subtraction converts it (I2F runs at an eighth of the FMA rate).
__device__ __forceinline__ void mma8_k32(const u32 a[4], u32 b0, u32 b1, int ci[4]) {
    ci[0] = ci[1] = ci[2] = ci[3] = MMA8_BIAS_BITS;
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(ci[0]), "+r"(ci[1]), "+r"(ci[2]), "+r"(ci[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same for k = 16 (A: rows g and g + 8, k 4t..4t+3; B: k 4t..4t+3 of column g).
__device__ __forceinline__ void mma8_k16(u32 a0, u32 a1, u32 b0, int ci[4]) {
    ci[0] = ci[1] = ci[2] = ci[3] = MMA8_BIAS_BITS;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+r"(ci[0]), "+r"(ci[1]), "+r"(ci[2]), "+r"(ci[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

#if __CUDA_ARCH__ >= 800
// 16 (n = 16) or no bytes (n = 0: zeros) from global to shared memory, asynchronously.
__device__ __forceinline__ void mma8_cp16(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void mma8_cp8(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void mma8_cp4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void mma8_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void mma8_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// Q4_K against int8 activations, one super-block (256 weights) of k, everything in shared
// memory: w0 / w1 the lane's rows g and g + 8 of its warp's 16 (144-byte blocks as in the file),
// xst the 8·NJ vectors' int8 values of this super-block (vector v at xst + v·x_pitch), xss their
// 8 block scales (d, d·Σq) of this super-block (block b of vector v at xss[b·xs_b + v·xs_v]). The
// first NA n-tiles (vectors 0 .. 8·NA) are computed, the rest left alone: a caller passes the
// tiles that hold vectors. Adds into acc[j][c] (c < 2: row g, vectors 8j + 2t + c; c >= 2: row
// g + 8, vectors 8j + 2t + c − 2): per sub-block of 32 weights,
// Σ_k w_k·x_k = dx·(d1·Σ q·xq) − m1·(dx·Σxq), d1 = d·sc and m1 = dmin·m of the row's sub-block.
// The weights' 4-bit values go to `mma.m16n8k32.s8` as they are (a lane's A register is one
// 32-bit load of 8 nibbles, masked to 4 bytes). A sub-block's NA mmas are issued together,
// their sums scaled after: no branch between them (a vector past the caller's count gets sums
// too, from the zeros its copy left, and is never written out), so their latencies overlap,
// where a branch per vector around each mma's scaling had ptxas issue one mma at a time into
// the same registers. A warp's loads hit 32 distinct banks when x_pitch and the rows' pitch are
// 16 mod 32 bytes (144, 272, 304, ...).
template <int NJ, int NA>
__device__ __forceinline__ void q4k_mma8_superblock(const u8* w0, const u8* w1, const u8* xst, u32 x_pitch, const float2* xss, u32 xs_b,
                                                    u32 xs_v, int g, int t, float acc[NJ][4]) {
    static_assert(NA >= 1 && NA <= NJ, "1 to NJ active n-tiles");
    const u32 hd[2] = {*(const u32*)w0, *(const u32*)w1};
    const u32 hs[2][3] = {{*(const u32*)(w0 + 4), *(const u32*)(w0 + 8), *(const u32*)(w0 + 12)},
                          {*(const u32*)(w1 + 4), *(const u32*)(w1 + 8), *(const u32*)(w1 + 12)}};
    const float dd[2] = {f16_to_f32((u16)(hd[0] & 0xFFFF)), f16_to_f32((u16)(hd[1] & 0xFFFF))};
    const float dm[2] = {f16_to_f32((u16)(hd[0] >> 16)), f16_to_f32((u16)(hd[1] >> 16))};
    // The four lanes of a quad share rows g and g + 8: lane t decodes sub-blocks t and t + 4 of
    // both (scale_min_k4_words's fields, the same products), the others take them by shuffles
    // (each lane decoding all eight cost the staged gate/up ~340 more SASS instructions; g22:
    // pp512 +3 % with the shuffles).
    float d1q[2][2], m1q[2][2];  // [row][0: sub-block t, 1: t + 4]
    {
        const u32 sh = 8 * t;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int sc_lo = (hs[i][0] >> sh) & 63, mn_lo = (hs[i][1] >> sh) & 63;
            const int sc_hi = ((hs[i][2] >> sh) & 0xF) | (((hs[i][0] >> (sh + 6)) & 3) << 4);
            const int mn_hi = ((hs[i][2] >> (sh + 4)) & 0xF) | (((hs[i][1] >> (sh + 6)) & 3) << 4);
            d1q[i][0] = dd[i] * sc_lo, m1q[i][0] = dm[i] * mn_lo;
            d1q[i][1] = dd[i] * sc_hi, m1q[i][1] = dm[i] * mn_hi;
        }
    }
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
            int ci[NA][4];
#pragma unroll
            for (int j = 0; j < NA; ++j) {
                // B: column g of n-tile j (vector 8j + g), k 4t..4t+3 and 16+4t..16+4t+3.
                const u8* xr = xst + (8 * j + g) * x_pitch + 32 * (sub + h) + 4 * t;
                mma8_k32(a, *(const u32*)xr, *(const u32*)(xr + 16), ci[j]);
            }
            float d1[2], m1[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int s = sub + h, src = 4 * g + s % 4;  // the quad's lane that decoded s
                d1[i] = __shfl_sync(0xffffffffu, d1q[i][s / 4], src);
                m1[i] = __shfl_sync(0xffffffffu, m1q[i][s / 4], src);
            }
#pragma unroll
            for (int j = 0; j < NA; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float2 xd = xss[(sub + h) * xs_b + (8 * j + 2 * t + c) * xs_v];
                    const float s0 = __int_as_float(ci[j][c]) - MMA8_BIAS, s1 = __int_as_float(ci[j][2 + c]) - MMA8_BIAS;
                    acc[j][c] = fmaf(xd.x * d1[0], s0, fmaf(-m1[0], xd.y, acc[j][c]));
                    acc[j][2 + c] = fmaf(xd.x * d1[1], s1, fmaf(-m1[1], xd.y, acc[j][2 + c]));
                }
        }
    }
}

// One row's part of a Q6_K k-step of 32 (groups s0 = 2·step and s0 + 1 of the 208-byte run
// b, its d's in the row's plane: dequant.cuh's q6k_dp): the lane's A words (weights 16h + 4t .. + 3 of group s0 + h, q − 32 as int8) and their
// scales dr·sc[s0 + h], for h = 0, 1. Group s (0..15) is weights 16s..16s+15: half n = s / 8,
// quarter r = s % 8 / 2, offset l = 16·(s % 2); its 4-bit values are
// ql[64n + 32(r & 1) + l..] (high nibbles for r >= 2), its 2-bit ones qh[32n + l..] >> 2r, its
// scale sc[s] (kernels/dequant.cuh).
__device__ __forceinline__ void q6k_mma8_step(const u8* b, u32 step, int t, float dr, u32 a[2], float dl[2]) {
    const u32 s0 = 2 * step, n = s0 / 8, r = (s0 % 8) / 2;
    const u32 sc2 = ld_u16(b + 192 + s0);  // the scales of groups s0 and s0 + 1
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 l = 16 * h + 4 * t;
        const u32 lq = ld_u32_a2(b + 64 * n + 32 * (r & 1) + l), hq = ld_u32_a2(b + 128 + 32 * n + l);
        u32 v = ((lq >> (4 * (r >> 1))) & 0x0F0F0F0Fu) | (((hq >> (2 * r)) & 0x03030303u) << 4);
        // q − 32 per byte (q < 64): flip bit 5; where it is then set, q was < 32 and the byte
        // is negative: set bits 6 and 7 too.
        v ^= 0x20202020u;
        a[h] = v | (v & 0x20202020u) * 6;
        dl[h] = dr * (float)(i8)((sc2 >> (8 * h)) & 0xFF);
    }
}

// Q6_K against int8 activations, one super-block (256 weights, a 208-byte run and its d, 2-byte
// aligned) of k from shared memory, as q4k_mma8_superblock (the same operands, NA of NJ n-tiles,
// the mmas of a step issued together): a scale per 16 weights, so one m16n8k16 per 16 (two a
// k-step of 32), Σ_k w_k·x_k = dx·d·sc·Σ (q − 32)·xq (q6k_mma8_step).
// Rows r0 and r1 (of nb blocks), super-block sb.
template <int NJ, int NA>
__device__ __forceinline__ void q6k_mma8_superblock(const u8* r0, const u8* r1, int nb, int sb, const u8* xst, u32 x_pitch, const float2* xss,
                                                    u32 xs_b, u32 xs_v, int g, int t, float acc[NJ][4]) {
    static_assert(NA >= 1 && NA <= NJ, "1 to NJ active n-tiles");
    const u8* const rows[2] = {q6k_blk(r0, nb, sb), q6k_blk(r1, nb, sb)};
    const float dr[2] = {f16_to_f32(ld_u16(q6k_dp(r0, nb, sb))), f16_to_f32(ld_u16(q6k_dp(r1, nb, sb)))};
#pragma unroll 2
    for (u32 step = 0; step < 8; ++step) {
        u32 bx[NA][2];
#pragma unroll
        for (int j = 0; j < NA; ++j) {
            const u8* xr = xst + (8 * j + g) * x_pitch + 32 * step + 4 * t;
            bx[j][0] = *(const u32*)xr, bx[j][1] = *(const u32*)(xr + 16);
        }
        float dl[2][2];  // [row][group of the step]
        u32 a[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) q6k_mma8_step(rows[i], step, t, dr[i], a[i], dl[i]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int ci[NA][4];
#pragma unroll
            for (int j = 0; j < NA; ++j) mma8_k16(a[0][h], a[1][h], bx[j][h], ci[j]);
#pragma unroll
            for (int j = 0; j < NA; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float dx = xss[step * xs_b + (8 * j + 2 * t + c) * xs_v].x;
                    const float s_0 = __int_as_float(ci[j][c]) - MMA8_BIAS, s_1 = __int_as_float(ci[j][2 + c]) - MMA8_BIAS;
                    acc[j][c] = fmaf(dx * dl[0][h], s_0, acc[j][c]);
                    acc[j][2 + c] = fmaf(dx * dl[1][h], s_1, acc[j][2 + c]);
                }
        }
    }
}
