// Tensor-core tiles for prompt-sized matmuls (prepended after prelude.cuh and dequant.cuh, for
// matmul.cu and moe.cu). Weights are decoded from their file blocks into shared memory as f16,
// activations converted to f16, products summed in f32 by `mma.sync.aligned.m16n8k16` (inline
// PTX, sm_80+; header-free: no mma.h). Below sm_80 the entry points compile to nothing and the
// launchers never pick them.
//
// A block computes a tile of MMA_BM(MT) = 32·MT activation rows ("tokens", the mma's M) by
// MMA_BN = 128 weight rows (the mma's N) over k in steps of MMA_BK = 32: 8 warps as 2 (tokens)
// x 4 (rows), each warp 16·MT tokens x 32 rows (MT x 4 mma tiles of 16x8). Both operands sit
// in shared memory as [row][k] f16 with rows padded to MMA_LD halves, so each fragment register
// is one 32-bit load and the 32 lanes of a load hit 32 distinct banks (row stride 20 words:
// g·20 + t covers every bank once for g < 8, t < 4). Two buffers: a k-step writes one while
// warps may still read the other, one barrier per step.

#define MMA_BN 128
#define MMA_BK 32
#define MMA_LD 40
#define MMA_THREADS 256

// {hi, lo} f32 -> one f16x2 word, lo in the low half (round to nearest).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    u16 a, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi));
    r = (u32)a | ((u32)b << 16);
#endif
    return r;
}

// c += a·b for one 16x8x16 tile (fragment layouts: PTX ISA, "mma.m16n8k16", f16 operands).
__device__ __forceinline__ void mma_16816(float* c, const u32* a, const u32* b) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- Tile decoders: weights i0..i0+8 of a row (i0 a multiple of 8, < k) as f32 ----
// Block types: aligned wide loads where the block size allows (Q4_K/Q5_K/IQ4_XS blocks are
// multiples of 8 bytes; Q8_0 and Q6_K only of 2). `vec`: float rows with k % 8 == 0, whose
// 8-weight pieces are 16-byte aligned.

template <int TY>
__device__ __forceinline__ void tile_deq8(const u8* row, int i0, int k, bool vec, const float* iq4, float* out) {
    deq8(TY, row, i0, k, out);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_F32>(const u8* row, int i0, int k, bool vec, const float*, float* out) {
    if (!vec) {
        deq8(TY_F32, row, i0, k, out);
        return;
    }
    const float4 a = *(const float4*)(row + 4 * i0), b = *(const float4*)(row + 4 * i0 + 16);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <int BF>
__device__ __forceinline__ void tile_deq8_half(const u8* row, int i0, int k, bool vec, float* out) {
    if (!vec) {
        deq8(BF ? TY_BF16 : TY_F16, row, i0, k, out);
        return;
    }
    const uint4 v = *(const uint4*)(row + 2 * i0);
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u16 lo = (u16)(words[i] & 0xFFFF), hi = (u16)(words[i] >> 16);
        out[2 * i] = BF ? bf16_to_f32(lo) : f16_to_f32(lo);
        out[2 * i + 1] = BF ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
}

template <>
__device__ __forceinline__ void tile_deq8<TY_F16>(const u8* row, int i0, int k, bool vec, const float*, float* out) {
    tile_deq8_half<0>(row, i0, k, vec, out);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_BF16>(const u8* row, int i0, int k, bool vec, const float*, float* out) {
    tile_deq8_half<1>(row, i0, k, vec, out);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_Q8_0>(const u8* row, int i0, int, bool, const float*, float* out) {
    const u8* b = row + 34 * (i0 / 32);
    const float d = f16_to_f32(ld_u16(b));
    const u8* q = b + 2 + i0 % 32;
    const u32 q0 = ld_u32_a2(q) ^ 0x80808080u, q1 = ld_u32_a2(q + 4) ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[i] = d * byte_f(q0, i, OFF_U + 128.0f);
        out[4 + i] = d * byte_f(q1, i, OFF_U + 128.0f);
    }
}

// Weights i0..i0+8 of a Q4_K (Q5 = 0) or Q5_K row: their values q as the bytes of q0 (weights
// 0..3) and q1 (4..7), weight = d1·q − m1.
template <int Q5>
__device__ __forceinline__ void k4_piece(const u8* row, int i0, float* d1, float* m1, u32* q0, u32* q1) {
    const u8* b = row + (Q5 ? 176 : 144) * (i0 / 256);
    const int i = i0 % 256, s = i / 32, j0 = i % 32;
    const u32 dd = *(const u32*)b, s0 = *(const u32*)(b + 4), s1 = *(const u32*)(b + 8), s2 = *(const u32*)(b + 12);
    int sc, mn;
    scale_min_k4_words(s, s0, s1, s2, &sc, &mn);
    *d1 = f16_to_f32((u16)(dd & 0xFFFF)) * sc, *m1 = f16_to_f32((u16)(dd >> 16)) * mn;
    const uint2 qw = *(const uint2*)(b + (Q5 ? 48 : 16) + 32 * (s / 2) + j0);
    const int sh = 4 * (s & 1);
    *q0 = (qw.x >> sh) & 0x0F0F0F0Fu, *q1 = (qw.y >> sh) & 0x0F0F0F0Fu;
    if (Q5) {
        const uint2 hw = *(const uint2*)(b + 16 + j0);
        *q0 |= ((hw.x >> s) & 0x01010101u) << 4;
        *q1 |= ((hw.y >> s) & 0x01010101u) << 4;
    }
}

template <int Q5>
__device__ __forceinline__ void tile_deq8_k4(const u8* row, int i0, float* out) {
    float d1, m1;
    u32 q0, q1;
    k4_piece<Q5>(row, i0, &d1, &m1, &q0, &q1);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        out[c] = d1 * byte_f(q0, c, OFF_U) - m1;
        out[4 + c] = d1 * byte_f(q1, c, OFF_U) - m1;
    }
}

template <>
__device__ __forceinline__ void tile_deq8<TY_Q4_K>(const u8* row, int i0, int, bool, const float*, float* out) {
    tile_deq8_k4<0>(row, i0, out);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_Q5_K>(const u8* row, int i0, int, bool, const float*, float* out) {
    tile_deq8_k4<1>(row, i0, out);
}

// Q6_K: weight i of a super-block is in quarter r = i / 32 % 4 of half n = i / 128: low four
// bits from ql[64n + 32(r & 1) + l] (nibble r >> 1), high two from qh[32n + l] (bits 2r).
// Weights i0..i0+8: their values q (0..63) as the bytes of q[0] (weights 0..3) and q[1] (4..7),
// weight = dl·(q − 32).
// nb: the row's blocks (for where a repacked row's d's are: dequant.cuh's q6k_dp).
__device__ __forceinline__ void q6k_piece(const u8* row, int i0, int nb, float* dl, u32 q[2]) {
    const u8* b = q6k_blk(row, nb, i0 / 256);
    const int i = i0 % 256, n = i / 128, r = (i / 32) % 4, l0 = i % 32;
    *dl = f16_to_f32(ld_u16(q6k_dp(row, nb, i0 / 256))) * (float)(i8)b[192 + i / 16];
    const u8* ql = b + 64 * n + 32 * (r & 1) + l0;
    const u8* qh = b + 128 + 32 * n + l0;
    const int sl = 4 * (r >> 1), shh = 2 * r;
    const u32 l[2] = {ld_u32_a2(ql), ld_u32_a2(ql + 4)}, h[2] = {ld_u32_a2(qh), ld_u32_a2(qh + 4)};
#pragma unroll
    for (int w = 0; w < 2; ++w) q[w] = ((l[w] >> sl) & 0x0F0F0F0Fu) | (((h[w] >> shh) & 0x03030303u) << 4);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_Q6_K>(const u8* row, int i0, int k, bool, const float*, float* out) {
    float dl;
    u32 q[2];
    q6k_piece(row, i0, k / 256, &dl, q);
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
        for (int c = 0; c < 4; ++c) out[4 * w + c] = dl * byte_f(q[w], c, OFF_U + 32.0f);
}

template <>
__device__ __forceinline__ void tile_deq8<TY_IQ4_XS>(const u8* row, int i0, int, bool, const float* iq4, float* out) {
    const u8* b = row + 136 * (i0 / 256);
    const int i = i0 % 256, s = i / 32, j0 = i % 32;
    const float dl = f16_to_f32(ld_u16(b)) * (float)scale_iq4xs(s, b);
    const uint2 qw = *(const uint2*)(b + 8 + 16 * s + j0 % 16);
    const int sh = j0 < 16 ? 0 : 4;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        out[c] = dl * iq4[(qw.x >> (8 * c + sh)) & 0xF];
        out[4 + c] = dl * iq4[(qw.y >> (8 * c + sh)) & 0xF];
    }
}

// ---- f16x2 decoders: weights i0..i0+8 of a row as four f16x2 words (weight 2i in word i's low
// half), for the block types whose values are small integers: a value byte q (< 64) becomes
// the f16 1024 + q by a byte permute beside 0x64 (exact), one f16x2 subtraction makes it q (or
// q − 32) exactly, one f16x2 fma or multiply applies the scale (and minimum): ~1.5
// instructions a weight where the f32 path spends ~3.5 (convert, scale, pack). The scale and
// minimum are rounded to f16 first, so a weight takes up to three f16 roundings where the f32
// path takes one. EMBER_MMA_F32_DECODE (EMBER_KERNEL_DEFINES) keeps the f32 path for A/B.

// Bytes 0 and 1 (sel 0x4140) or 2 and 3 (sel 0x4342) of q as the f16x2 (1024 + q_lo, 1024 + q_hi).
__device__ __forceinline__ u32 byte_pair_h2(u32 q, u32 sel) { return __byte_perm(q, 0x64646464u, sel); }

__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// The four words of values q (bytes of q0 then q1) as f16x2 of scale·(q − off) + add, where
// `off2` is f16x2 of 1024 + off; `add2` null: no addend.
__device__ __forceinline__ uint4 bytes_h2(u32 q0, u32 q1, u32 off2, u32 scale2, u32 add2, bool add) {
    const u32 w[4] = {byte_pair_h2(q0, 0x4140), byte_pair_h2(q0, 0x4342), byte_pair_h2(q1, 0x4140), byte_pair_h2(q1, 0x4342)};
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 v = h2_sub(w[i], off2);
        o[i] = add ? h2_fma(v, scale2, add2) : h2_mul(v, scale2);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

template <int TY>
__device__ __forceinline__ uint4 tile_deq8_h(const u8* row, int i0, int k, bool vec, const float* iq4) {
    float v[8];
    tile_deq8<TY>(row, i0, k, vec, iq4, v);
    return make_uint4(pack_f16x2(v[0], v[1]), pack_f16x2(v[2], v[3]), pack_f16x2(v[4], v[5]), pack_f16x2(v[6], v[7]));
}

#ifndef EMBER_MMA_F32_DECODE
template <int Q5>
__device__ __forceinline__ uint4 tile_deq8_k4_h(const u8* row, int i0) {
    float d1, m1;
    u32 q0, q1;
    k4_piece<Q5>(row, i0, &d1, &m1, &q0, &q1);
    return bytes_h2(q0, q1, 0x64006400u, pack_f16x2(d1, d1), pack_f16x2(-m1, -m1), true);
}

template <>
__device__ __forceinline__ uint4 tile_deq8_h<TY_Q4_K>(const u8* row, int i0, int, bool, const float*) {
    return tile_deq8_k4_h<0>(row, i0);
}

template <>
__device__ __forceinline__ uint4 tile_deq8_h<TY_Q5_K>(const u8* row, int i0, int, bool, const float*) {
    return tile_deq8_k4_h<1>(row, i0);
}

// Q6_K as tile_deq8<TY_Q6_K>: values q − 32 (1024 + 32 = 0x6420 as f16).
template <>
__device__ __forceinline__ uint4 tile_deq8_h<TY_Q6_K>(const u8* row, int i0, int k, bool, const float*) {
    float dl;
    u32 q[2];
    q6k_piece(row, i0, k / 256, &dl, q);
    return bytes_h2(q[0], q[1], 0x64206420u, pack_f16x2(dl, dl), 0, false);
}
#endif

// ---- The tile loop ----

// The operands of one block's tile. `xrow[m]`: activation row m of the tile (k f32, or null:
// zeros); `w`: the first of `n_w` weight rows of `row_bytes` (rows past n_w read as zeros).
struct MmaIn {
    const u8* w;
    u32 row_bytes;
    int n_w;
    int k;
};

// acc[w][i][j][c]: for weight matrix w of the NW, token 16i + g (+8 for c >= 2) of the warp's
// tokens, weight row 8j + 2t + (c & 1) of its rows (g = lane / 4, t = lane % 4); the caller's
// epilogue maps these to outputs (mma_out_token / mma_out_row below). NW = 2 (the MoE's gate and
// up): one pass over k for both, each step's activations converted and stored once for both
// (`ws` holds 2·NW tiles).
template <int TY, int MT, int NW>
__device__ __forceinline__ void mma_tiles(const MmaIn (&in)[NW], const float* const* xrow, const float* iq4, u16* ws, u16* xs,
                                          float (&acc)[NW][MT][4][4]) {
    constexpr int BM = 32 * MT;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = warp / 4, wn = warp % 4;
    const int k = in[0].k;
    const bool vec = k % 8 == 0, xvec = k % 4 == 0;
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[w][i][j][c] = 0.0f;
    const int n_step = (k + MMA_BK - 1) / MMA_BK;
    for (int step = 0; step < n_step; ++step) {
        const int k0 = step * MMA_BK;
        u16* wb = ws + (step & 1) * (NW * MMA_BN * MMA_LD);
        u16* xb = xs + (step & 1) * (BM * MMA_LD);
        // Weights: NW x 128 rows x 4 pieces of 8.
#pragma unroll
        for (int w = 0; w < NW; ++w)
#pragma unroll
            for (int u = tid; u < MMA_BN * 4; u += MMA_THREADS) {
                const int r = u / 4, piece = u % 4, i0 = k0 + 8 * piece;
                uint4 p = make_uint4(0, 0, 0, 0);
                if (r < in[w].n_w && i0 < k) p = tile_deq8_h<TY>(in[w].w + (u64)r * in[w].row_bytes, i0, k, vec, iq4);
                *(uint4*)(wb + (w * MMA_BN + r) * MMA_LD + 8 * piece) = p;
            }
        // Activations: BM rows x 4 pieces of 8.
        for (int u = tid; u < BM * 4; u += MMA_THREADS) {
            const int m = u / 4, piece = u % 4, i0 = k0 + 8 * piece;
            const float* xr = xrow[m];
            float v[8];
            if (xr != nullptr && xvec && i0 + 8 <= k) {
                const float4 a = *(const float4*)(xr + i0), b = *(const float4*)(xr + i0 + 4);
                v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = xr != nullptr && i0 + j < k ? xr[i0 + j] : 0.0f;
            }
            uint4 p;
            p.x = pack_f16x2(v[0], v[1]), p.y = pack_f16x2(v[2], v[3]), p.z = pack_f16x2(v[4], v[5]), p.w = pack_f16x2(v[6], v[7]);
            *(uint4*)(xb + m * MMA_LD + 8 * piece) = p;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MMA_BK; kk += 16) {
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u16* base = xb + (wm * 16 * MT + 16 * i + g) * MMA_LD + kk + 2 * t;
                a[i][0] = *(const u32*)base;
                a[i][1] = *(const u32*)(base + 8 * MMA_LD);
                a[i][2] = *(const u32*)(base + 8);
                a[i][3] = *(const u32*)(base + 8 * MMA_LD + 8);
            }
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                u32 b[4][2];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u16* base = wb + (w * MMA_BN + wn * 32 + 8 * j + g) * MMA_LD + kk + 2 * t;
                    b[j][0] = *(const u32*)base;
                    b[j][1] = *(const u32*)(base + 8);
                }
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) mma_16816(acc[w][i][j], a[i], b[j]);
            }
        }
    }
}

// One weight matrix: `ws` holds 2 tiles (two k-steps).
template <int TY, int MT>
__device__ __forceinline__ void mma_tile(const MmaIn in, const float* const* xrow, const float* iq4, u16* ws, u16* xs,
                                         float (&acc)[MT][4][4]) {
    const MmaIn ins[1] = {in};
    float one[1][MT][4][4];
    mma_tiles<TY, MT, 1>(ins, xrow, iq4, ws, xs, one);
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = one[0][i][j][c];
}

// The tile token (0..BM) and weight row (0..MMA_BN) of acc[i][j][c].
template <int MT>
__device__ __forceinline__ int mma_out_token(int i, int c) {
    const int lane = threadIdx.x % 32, wm = threadIdx.x / 32 / 4;
    return wm * 16 * MT + 16 * i + lane / 4 + (c >= 2 ? 8 : 0);
}

__device__ __forceinline__ int mma_out_row(int j, int c) {
    const int lane = threadIdx.x % 32, wn = (threadIdx.x / 32) % 4;
    return wn * 32 + 8 * j + 2 * (lane % 4) + (c & 1);
}
