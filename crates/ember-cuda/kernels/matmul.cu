// matmul: y[t][r] = Σ_j W[r][j]·x[t][j] for a weight in its file's block format and f32
// activations x [n_tok, k] -> y [n_tok, n_rows]. Reference: ember_ops::reference::matmul.
//
// Two paths (the launcher picks):
// * matmul_gemv_<type>: small n_tok. One warp per output row, up to GEMV_NT tokens per pass;
//   each lane decodes one 32-weight unit at a time with 16-byte loads where the block layout
//   is 16-byte aligned (Q4_K, Q5_K, floats), 8-byte (IQ4_XS) or 2-byte (Q8_0, Q6_K) otherwise.
//   Needs k % 32 == 0 (always true for block formats; float weights with other k go tiled).
// * matmul_tiled: any shape. 64x64 output tiles, k in steps of 32, weights decoded into shared
//   memory by deq8. Plain FMA; tensor cores come later.

struct MatmulParams {
    u64 w;  // n_rows rows of row_bytes
    u64 x;  // [n_tok, k] f32
    u64 y;  // [n_tok, n_rows] f32
    u32 ty, k, n_rows, n_tok, row_bytes, pad;
};

#define GEMV_NT 8

// Decodes unit u (weights 32u..32u+32) of one row into w.
template <int TY>
__device__ __forceinline__ void unit_deq(const u8* row, int u, const float* iq4, float* w);

template <>
__device__ __forceinline__ void unit_deq<TY_F32>(const u8* row, int u, const float*, float* w) {
    const float4* p = (const float4*)(row + 128 * u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 v = p[i];
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
}

template <int BF>
__device__ __forceinline__ void unit_deq_half(const u8* row, int u, float* w) {
    const uint4* p = (const uint4*)(row + 64 * u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = p[i];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u16 lo = (u16)(words[c] & 0xFFFF), hi = (u16)(words[c] >> 16);
            w[8 * i + 2 * c] = BF ? bf16_to_f32(lo) : f16_to_f32(lo);
            w[8 * i + 2 * c + 1] = BF ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
}

template <>
__device__ __forceinline__ void unit_deq<TY_F16>(const u8* row, int u, const float*, float* w) {
    unit_deq_half<0>(row, u, w);
}

template <>
__device__ __forceinline__ void unit_deq<TY_BF16>(const u8* row, int u, const float*, float* w) {
    unit_deq_half<1>(row, u, w);
}

template <>
__device__ __forceinline__ void unit_deq<TY_Q8_0>(const u8* row, int u, const float*, float* w) {
    const u8* b = row + 34 * u;
    const float d = f16_to_f32(ld_u16(b));
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u16 v = ld_u16(b + 2 + 2 * j);
        w[2 * j] = d * (float)(i8)(v & 0xFF);
        w[2 * j + 1] = d * (float)(i8)(v >> 8);
    }
}

// Q4_K and Q5_K: unit u is sub-block s = u % 8 of super-block u / 8; its quants are the low
// (s even) or high (s odd) nibbles of qs[32·(s/2)..+32], plus bit s of qh[0..32] for Q5_K.
template <int Q5>
__device__ __forceinline__ void unit_deq_k4(const u8* row, int u, float* w) {
    const u8* b = row + (Q5 ? 176 : 144) * (u >> 3);
    const int s = u & 7;
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    const float d1 = f16_to_f32(ld_u16(b)) * sc, m1 = f16_to_f32(ld_u16(b + 2)) * mn;
    const uint4* q = (const uint4*)(b + (Q5 ? 48 : 16) + 32 * (s >> 1));
    const uint4 q0 = q[0], q1 = q[1];
    const u32 qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    u32 hw[8];
    if (Q5) {
        const uint4* h = (const uint4*)(b + 16);
        const uint4 h0 = h[0], h1 = h[1];
        hw[0] = h0.x, hw[1] = h0.y, hw[2] = h0.z, hw[3] = h0.w;
        hw[4] = h1.x, hw[5] = h1.y, hw[6] = h1.z, hw[7] = h1.w;
    }
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            int v = (qw[i] >> (8 * c + shift)) & 0xF;
            if (Q5) v |= ((hw[i] >> (8 * c + s)) & 1) << 4;
            w[4 * i + c] = d1 * (float)v - m1;
        }
    }
}

template <>
__device__ __forceinline__ void unit_deq<TY_Q4_K>(const u8* row, int u, const float*, float* w) {
    unit_deq_k4<0>(row, u, w);
}

template <>
__device__ __forceinline__ void unit_deq<TY_Q5_K>(const u8* row, int u, const float*, float* w) {
    unit_deq_k4<1>(row, u, w);
}

// Q6_K: unit u is weights 32s..32s+32 (s = u % 8) of super-block u / 8: half n = s / 4,
// quarter r = s % 4; low 4 bits from ql[64n + 32(r&1) + l] (nibble r/2), high 2 bits from
// qh[32n + l] >> 2r; scale sc[2s] for l < 16, sc[2s+1] after.
template <>
__device__ __forceinline__ void unit_deq<TY_Q6_K>(const u8* row, int u, const float*, float* w) {
    const u8* b = row + 210 * (u >> 3);
    const int s = u & 7, n = s >> 2, r = s & 3;
    const float d = f16_to_f32(ld_u16(b + 208));
    const float dl0 = d * (float)(i8)b[192 + 2 * s], dl1 = d * (float)(i8)b[193 + 2 * s];
    const u8* ql = b + 64 * n + 32 * (r & 1);
    const u8* qh = b + 128 + 32 * n;
#pragma unroll
    for (int l = 0; l < 32; l += 4) {
        const u32 lq = ld_u32_a2(ql + l), hq = ld_u32_a2(qh + l);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int q = ((lq >> (8 * c + 4 * (r >> 1))) & 0xF) | (((hq >> (8 * c + 2 * r)) & 3) << 4);
            w[l + c] = (l < 16 ? dl0 : dl1) * (float)(q - 32);
        }
    }
}

// IQ4_XS: sub-block s = u % 8; 16 bytes qs[16s..]: low nibble weight j, high weight j + 16.
template <>
__device__ __forceinline__ void unit_deq<TY_IQ4_XS>(const u8* row, int u, const float* iq4, float* w) {
    const u8* b = row + 136 * (u >> 3);
    const int s = u & 7;
    const float dl = f16_to_f32(ld_u16(b)) * (float)scale_iq4xs(s, b);
    const uint2* q = (const uint2*)(b + 8 + 16 * s);
    const uint2 q0 = q[0], q1 = q[1];
    const u32 qw[4] = {q0.x, q0.y, q1.x, q1.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 v = qw[i] >> (8 * c);
            w[4 * i + c] = dl * iq4[v & 0xF];
            w[4 * i + c + 16] = dl * iq4[(v >> 4) & 0xF];
        }
    }
}

template <int TY>
__device__ __forceinline__ void gemv(const MatmulParams& p) {
    // The IQ4_XS table in shared memory: lanes index it at random, which the constant cache
    // would serialise; 16 floats sit in 16 distinct banks.
    __shared__ float iq4[16];
    if (threadIdx.x < 16) iq4[threadIdx.x] = IQ4_VALUES[threadIdx.x];
    __syncthreads();
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (int)p.n_rows) return;  // whole warps leave together
    const int t0 = blockIdx.y * GEMV_NT;
    const int nt = min(GEMV_NT, (int)p.n_tok - t0);
    const u8* wrow = (const u8*)p.w + (u64)row * p.row_bytes;
    const float* x = (const float*)p.x + (u64)t0 * p.k;
    float acc[GEMV_NT];
#pragma unroll
    for (int t = 0; t < GEMV_NT; ++t) acc[t] = 0.0f;
    const int n_unit = p.k / 32;
    for (int u = lane; u < n_unit; u += 32) {
        float w[32];
        unit_deq<TY>(wrow, u, iq4, w);
#pragma unroll
        for (int t = 0; t < GEMV_NT; ++t) {
            if (t < nt) {
                const float4* xv = (const float4*)(x + (u64)t * p.k + 32 * u);
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 v = xv[j];
                    s += w[4 * j] * v.x + w[4 * j + 1] * v.y + w[4 * j + 2] * v.z + w[4 * j + 3] * v.w;
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_NT; ++t) {
        if (t < nt) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) ((float*)p.y)[(u64)(t0 + t) * p.n_rows + row] = s;
        }
    }
}

extern "C" __global__ void matmul_gemv_f32(const MatmulParams p) { gemv<TY_F32>(p); }
extern "C" __global__ void matmul_gemv_f16(const MatmulParams p) { gemv<TY_F16>(p); }
extern "C" __global__ void matmul_gemv_bf16(const MatmulParams p) { gemv<TY_BF16>(p); }
extern "C" __global__ void matmul_gemv_q8_0(const MatmulParams p) { gemv<TY_Q8_0>(p); }
extern "C" __global__ void matmul_gemv_q4_k(const MatmulParams p) { gemv<TY_Q4_K>(p); }
extern "C" __global__ void matmul_gemv_q5_k(const MatmulParams p) { gemv<TY_Q5_K>(p); }
extern "C" __global__ void matmul_gemv_q6_k(const MatmulParams p) { gemv<TY_Q6_K>(p); }
extern "C" __global__ void matmul_gemv_iq4_xs(const MatmulParams p) { gemv<TY_IQ4_XS>(p); }

// grid (ceil(n_rows / 64), ceil(n_tok / 64)), 256 threads: thread (tr, tt) = (tid / 16,
// tid % 16) owns rows tr + 16i and tokens tt + 16j, i, j < 4.
extern "C" __global__ void matmul_tiled(const MatmulParams p) {
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
