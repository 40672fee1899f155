// Block-format decoding shared by matmul.cu and get_rows.cu (prepended after prelude.cuh).
// Layouts: shared/spec/gguf-format.md §3-§5; the reference is ember_gguf::quant::dequantize.

// kvalues_iq4nl (gguf-format.md §4).
__constant__ float IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Six-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (`get_scale_min_k4`);
// `s` points at the 12 scale bytes.
__device__ __forceinline__ void scale_min_k4(int j, const u8* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// scale_min_k4 from the scale bytes as three little-endian words s0 = bytes 0..4, s1 = 4..8,
// s2 = 8..12.
__device__ __forceinline__ void scale_min_k4_words(int j, u32 s0, u32 s1, u32 s2, int* sc, int* mn) {
    if (j < 4) {
        *sc = (s0 >> (8 * j)) & 63;
        *mn = (s1 >> (8 * j)) & 63;
    } else {
        const int i = 8 * (j - 4);
        *sc = ((s2 >> i) & 0xF) | (((s0 >> (i + 6)) & 3) << 4);
        *mn = ((s2 >> (i + 4)) & 0xF) | (((s1 >> (i + 6)) & 3) << 4);
    }
}

// Six-bit IQ4_XS scale of sub-block s, minus 32.
__device__ __forceinline__ int scale_iq4xs(int s, const u8* b) {
    const int low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    const int high = (ld_u16(b + 2) >> (2 * s)) & 3;
    return (low | (high << 4)) - 32;
}

// Where block c of a Q6_K row of nb blocks is, and its f16 d. The GPU keeps Q6_K as q6k_repack
// (q6_repack.cu) leaves it at upload, not as the file's 210-byte blocks (d at byte 208 of each):
// the row's nb 208-byte runs (ql, qh, scales; run c at 208·c, so 16-byte aligned where the row
// is), then its nb d's, 2 bytes each: the same bytes a row, each block's fields at the same
// offsets within its run (docs/perf.md g27-g28: tg128 +2.7 % on an H100).
__device__ __forceinline__ const u8* q6k_blk(const u8* row, int nb, int c) { return row + 208 * c; }
__device__ __forceinline__ const u8* q6k_dp(const u8* row, int nb, int c) { return row + 208 * nb + 2 * c; }

// Weights i0..i0+8 of one row (i0 a multiple of 8; float types read zero past k).
// The simple, any-alignment path: byte loads, a runtime type switch. Used by get_rows and the
// tiled matmul; the GEMV has one specialised decoder per type instead.
__device__ void deq8(int ty, const u8* row, int i0, int k, float* out) {
    switch (ty) {
    case TY_F32:
        for (int j = 0; j < 8; ++j) out[j] = i0 + j < k ? ((const float*)row)[i0 + j] : 0.0f;
        break;
    case TY_F16:
        for (int j = 0; j < 8; ++j) out[j] = i0 + j < k ? f16_to_f32(((const u16*)row)[i0 + j]) : 0.0f;
        break;
    case TY_BF16:
        for (int j = 0; j < 8; ++j) out[j] = i0 + j < k ? bf16_to_f32(((const u16*)row)[i0 + j]) : 0.0f;
        break;
    case TY_Q8_0: {
        const u8* b = row + 34 * (i0 / 32);
        const float d = f16_to_f32(ld_u16(b));
        for (int j = 0; j < 8; ++j) out[j] = d * (float)(i8)b[2 + i0 % 32 + j];
        break;
    }
    case TY_Q4_K:
    case TY_Q5_K: {
        const bool q5 = ty == TY_Q5_K;
        const u8* b = row + (q5 ? 176 : 144) * (i0 / 256);
        const int i = i0 % 256, s = i / 32, j0 = i % 32;
        int sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        const float d1 = f16_to_f32(ld_u16(b)) * sc, m1 = f16_to_f32(ld_u16(b + 2)) * mn;
        const u8* qs = b + (q5 ? 48 : 16) + 32 * (s / 2);
        for (int j = 0; j < 8; ++j) {
            int q = (qs[j0 + j] >> (4 * (s & 1))) & 0xF;
            if (q5) q |= ((b[16 + j0 + j] >> s) & 1) << 4;
            out[j] = d1 * (float)q - m1;
        }
        break;
    }
    case TY_Q6_K: {
        const u8* b = q6k_blk(row, k / 256, i0 / 256);
        const int i = i0 % 256, s = i / 32, n = s / 4, r = s % 4, l0 = i % 32;
        const float dl = f16_to_f32(ld_u16(q6k_dp(row, k / 256, i0 / 256))) * (float)(i8)b[192 + i / 16];
        for (int j = 0; j < 8; ++j) {
            const int lo = (b[64 * n + 32 * (r & 1) + l0 + j] >> (4 * (r >> 1))) & 0xF;
            const int hi = (b[128 + 32 * n + l0 + j] >> (2 * r)) & 3;
            out[j] = dl * (float)((lo | (hi << 4)) - 32);
        }
        break;
    }
    case TY_IQ4_XS: {
        const u8* b = row + 136 * (i0 / 256);
        const int i = i0 % 256, s = i / 32, j0 = i % 32;
        const float dl = f16_to_f32(ld_u16(b)) * (float)scale_iq4xs(s, b);
        for (int j = 0; j < 8; ++j) {
            const u8 q = b[8 + 16 * s + j0 % 16 + j];
            out[j] = dl * IQ4_VALUES[j0 < 16 ? (q & 0xF) : (q >> 4)];
        }
        break;
    }
    default:
        for (int j = 0; j < 8; ++j) out[j] = __int_as_float(0x7fffffff);
    }
}

// ---- The GEMV decoders (matmul.cu, moe.cu) ----

// Byte c of v as an exact float minus `off`, without an int-to-float conversion (those issue at a
// fraction of the FMA rate): 0x4B000000 | byte is the float 2^23 + byte.
__device__ __forceinline__ float byte_f(u32 v, int c, float off) {
    return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7540 + c)) - off;
}
#define OFF_U 8388608.0f  // 2^23: byte as unsigned

// chunk8<TY>: lane `lane` decodes 8 of the 256 weights of chunk c of a row: w[0..4] are weights
// a0..a0+4 and w[4..8] weights a1..a1+4 (indices in the row). The lanes of a warp read the
// chunk's bytes contiguously, and their x reads (float4 at a0 and a1) are coalesced too.
// Returns false for lanes past k (only the 1- and 32-weight block types have partial chunks).
template <int TY>
__device__ __forceinline__ bool chunk8(const u8* row, int c, int lane, int k, const float* iq4, float* w, int* a0, int* a1);

template <>
__device__ __forceinline__ bool chunk8<TY_F32>(const u8* row, int c, int lane, int k, const float*, float* w, int* a0, int* a1) {
    *a0 = 256 * c + 8 * lane, *a1 = *a0 + 4;
    if (*a0 >= k) return false;
    const float4 v0 = *(const float4*)(row + 4 * *a0), v1 = *(const float4*)(row + 4 * *a1);
    w[0] = v0.x, w[1] = v0.y, w[2] = v0.z, w[3] = v0.w, w[4] = v1.x, w[5] = v1.y, w[6] = v1.z, w[7] = v1.w;
    return true;
}

template <int BF>
__device__ __forceinline__ bool chunk8_half(const u8* row, int c, int lane, int k, float* w, int* a0, int* a1) {
    *a0 = 256 * c + 8 * lane, *a1 = *a0 + 4;
    if (*a0 >= k) return false;
    const uint4 v = *(const uint4*)(row + 2 * *a0);
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u16 lo = (u16)(words[i] & 0xFFFF), hi = (u16)(words[i] >> 16);
        w[2 * i] = BF ? bf16_to_f32(lo) : f16_to_f32(lo);
        w[2 * i + 1] = BF ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
    return true;
}

template <>
__device__ __forceinline__ bool chunk8<TY_F16>(const u8* row, int c, int lane, int k, const float*, float* w, int* a0, int* a1) {
    return chunk8_half<0>(row, c, lane, k, w, a0, a1);
}

template <>
__device__ __forceinline__ bool chunk8<TY_BF16>(const u8* row, int c, int lane, int k, const float*, float* w, int* a0, int* a1) {
    return chunk8_half<1>(row, c, lane, k, w, a0, a1);
}

// Q8_0: 4 lanes per 32-weight block, 8 blocks per chunk; quants are signed bytes, flipped to
// unsigned (x ^ 0x80) for byte_f.
template <>
__device__ __forceinline__ bool chunk8<TY_Q8_0>(const u8* row, int c, int lane, int k, const float*, float* w, int* a0, int* a1) {
    *a0 = 256 * c + 8 * lane, *a1 = *a0 + 4;
    if (*a0 >= k) return false;
    const u8* b = row + 34 * (*a0 / 32);
    const float d = f16_to_f32(ld_u16(b));
    const u8* q = b + 2 + *a0 % 32;
    const u32 q0 = ld_u32_a2(q) ^ 0x80808080u, q1 = ld_u32_a2(q + 4) ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = d * byte_f(q0, i, OFF_U + 128.0f);
        w[4 + i] = d * byte_f(q1, i, OFF_U + 128.0f);
    }
    return true;
}

// Q4_K / Q5_K: chunk = super-block. Lane (p, m) = (lane / 8, lane % 8) reads qs[32p + 4m..+4]:
// the low nibbles are weights 64p + 4m.. (sub-block 2p), the high ones 64p + 32 + 4m..
// (sub-block 2p + 1); Q5_K adds bit 2p (2p + 1) of qh[4m..+4] as bit 4.
template <int Q5>
__device__ __forceinline__ bool chunk8_k4(const u8* row, int c, int lane, float* w, int* a0, int* a1) {
    const u8* b = row + (Q5 ? 176 : 144) * c;
    const int p = lane / 8, m = lane % 8;
    *a0 = 256 * c + 64 * p + 4 * m, *a1 = *a0 + 32;
    // d, dmin and the 12 scale bytes as four 4-byte loads (the block is 4-byte aligned).
    const u32 dd = *(const u32*)b, s0 = *(const u32*)(b + 4), s1 = *(const u32*)(b + 8), s2 = *(const u32*)(b + 12);
    const float d = f16_to_f32((u16)(dd & 0xFFFF)), dmin = f16_to_f32((u16)(dd >> 16));
    int sc0, mn0, sc1, mn1;
    scale_min_k4_words(2 * p, s0, s1, s2, &sc0, &mn0);
    scale_min_k4_words(2 * p + 1, s0, s1, s2, &sc1, &mn1);
    const u32 qw = *(const u32*)(b + (Q5 ? 48 : 16) + 32 * p + 4 * m);
    u32 lo = qw & 0x0F0F0F0Fu, hi = (qw >> 4) & 0x0F0F0F0Fu;
    if (Q5) {
        const u32 hw = *(const u32*)(b + 16 + 4 * m);
        lo |= ((hw >> (2 * p)) & 0x01010101u) << 4;
        hi |= ((hw >> (2 * p + 1)) & 0x01010101u) << 4;
    }
    const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = d0 * byte_f(lo, i, OFF_U) - m0;
        w[4 + i] = d1 * byte_f(hi, i, OFF_U) - m1;
    }
    return true;
}

template <>
__device__ __forceinline__ bool chunk8<TY_Q4_K>(const u8* row, int c, int lane, int, const float*, float* w, int* a0, int* a1) {
    return chunk8_k4<0>(row, c, lane, w, a0, a1);
}

template <>
__device__ __forceinline__ bool chunk8<TY_Q5_K>(const u8* row, int c, int lane, int, const float*, float* w, int* a0, int* a1) {
    return chunk8_k4<1>(row, c, lane, w, a0, a1);
}

// Q6_K: lane (n, r1, m) = (lane / 16, lane / 8 % 2, lane % 8) reads ql[64n + 32r1 + 4m..+4] and
// qh[32n + 4m..+4]. Low nibbles: weights 128n + 32r1 + 4m.. (quarter r = r1, high bits
// qh >> 2r); high nibbles: the same + 64 (quarter r1 + 2). Scale: sc[weight / 16].
template <>
__device__ __forceinline__ bool chunk8<TY_Q6_K>(const u8* row, int c, int lane, int k, const float*, float* w, int* a0, int* a1) {
    const u8* b = q6k_blk(row, k / 256, c);
    const float d = f16_to_f32(ld_u16(q6k_dp(row, k / 256, c)));
    const int n = lane / 16, r1 = (lane / 8) % 2, m = lane % 8;
    const int i0 = 128 * n + 32 * r1 + 4 * m;
    *a0 = 256 * c + i0, *a1 = *a0 + 64;
    const float dl0 = d * (float)(i8)b[192 + i0 / 16], dl1 = d * (float)(i8)b[192 + (i0 + 64) / 16];
    const u32 lq = ld_u32_a2(b + 64 * n + 32 * r1 + 4 * m), hq = ld_u32_a2(b + 128 + 32 * n + 4 * m);
    const u32 lo = (lq & 0x0F0F0F0Fu) | (((hq >> (2 * r1)) & 0x03030303u) << 4);
    const u32 hi = ((lq >> 4) & 0x0F0F0F0Fu) | (((hq >> (2 * r1 + 4)) & 0x03030303u) << 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = dl0 * byte_f(lo, i, OFF_U + 32.0f);
        w[4 + i] = dl1 * byte_f(hi, i, OFF_U + 32.0f);
    }
    return true;
}

// IQ4_XS: lane (s, m) = (lane / 4, lane % 4) reads qs[16s + 4m..+4]: low nibbles are weights
// 32s + 4m.., high ones 32s + 16 + 4m..; values from the table in shared memory.
template <>
__device__ __forceinline__ bool chunk8<TY_IQ4_XS>(const u8* row, int c, int lane, int, const float* iq4, float* w, int* a0, int* a1) {
    const u8* b = row + 136 * c;
    const int s = lane / 4, m = lane % 4;
    *a0 = 256 * c + 32 * s + 4 * m, *a1 = *a0 + 16;
    const float dl = f16_to_f32(ld_u16(b)) * (float)scale_iq4xs(s, b);
    const u32 qw = *(const u32*)(b + 8 + 16 * s + 4 * m);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = dl * iq4[(qw >> (8 * i)) & 0xF];
        w[4 + i] = dl * iq4[(qw >> (8 * i + 4)) & 0xF];
    }
    return true;
}

// Σ_j row[j]·x[j] over k weights by one warp (every lane returns the sum). x: k floats,
// 16-byte aligned.
template <int TY>
__device__ __forceinline__ float warp_dot(const u8* row, int k, const float* x, const float* iq4) {
    const int lane = threadIdx.x % 32;
    float acc = 0.0f;
#pragma unroll 2
    for (int c = 0; c < (k + 255) / 256; ++c) {
        float w[8];
        int a0, a1;
        if (!chunk8<TY>(row, c, lane, k, iq4, w, &a0, &a1)) continue;
        const float4 x0 = *(const float4*)(x + a0), x1 = *(const float4*)(x + a1);
        acc += w[0] * x0.x + w[1] * x0.y + w[2] * x0.z + w[3] * x0.w + w[4] * x1.x + w[5] * x1.y + w[6] * x1.z + w[7] * x1.w;
    }
    return warp_sum(acc);
}

// Fills the shared IQ4_XS table (every kernel that decodes with chunk8 calls this first, with
// all its threads: it holds a barrier). Lanes index the table at random, which the constant
// cache would serialise; 16 floats sit in 16 distinct banks.
__device__ __forceinline__ void load_iq4_table(float* iq4) {
    if (threadIdx.x < 16) iq4[threadIdx.x] = IQ4_VALUES[threadIdx.x];
    __syncthreads();
}
