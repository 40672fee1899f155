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

// Six-bit IQ4_XS scale of sub-block s, minus 32.
__device__ __forceinline__ int scale_iq4xs(int s, const u8* b) {
    const int low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    const int high = (ld_u16(b + 2) >> (2 * s)) & 3;
    return (low | (high << 4)) - 32;
}

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
        const u8* b = row + 210 * (i0 / 256);
        const int i = i0 % 256, s = i / 32, n = s / 4, r = s % 4, l0 = i % 32;
        const float dl = f16_to_f32(ld_u16(b + 208)) * (float)(i8)b[192 + i / 16];
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
