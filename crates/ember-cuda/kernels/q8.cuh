// Int8-activation dot products shared by gemv_q8.cu and moe.cu (prepended after prelude.cuh and
// dequant.cuh): activations quantised by `quantize_q8` (gemv_q8.cu) to int8 in blocks of 32,
// each block's (d, d·Σq) beside; a weight block's products summed with dp4a.

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// 8 bytes at 2-byte alignment (Q6_K and Q8_0 blocks are 210 and 34 bytes).
__device__ __forceinline__ uint2 ld_u64_a2(const u8* p) { return make_uint2(ld_u32_a2(p), ld_u32_a2(p + 4)); }
// 8 bytes at 4-byte alignment.
__device__ __forceinline__ uint2 ld_u64_a4(const u8* p) { return make_uint2(*(const u32*)p, *(const u32*)(p + 4)); }

// The unit dot products: lane t (< L) of unit c (of the row's nb) of a row against the quantised
// x (xq: the int8 values of the whole row's k, xd: their blocks' (d, d·Σq)).
template <int TY>
struct Q8Unit;

// 16 bytes of Q4_K qs against int8 x: the low nibbles' products with xl added to sl, the high
// nibbles' with xh to sh (4 dp4a each, in word order).
__device__ __forceinline__ void q4k_nibble_dots(uint4 q, int4 xl, int4 xh, int& sl, int& sh) {
    sl = dp4a(q.x & 0x0F0F0F0F, xl.x, sl), sh = dp4a((q.x >> 4) & 0x0F0F0F0F, xh.x, sh);
    sl = dp4a(q.y & 0x0F0F0F0F, xl.y, sl), sh = dp4a((q.y >> 4) & 0x0F0F0F0F, xh.y, sh);
    sl = dp4a(q.z & 0x0F0F0F0F, xl.z, sl), sh = dp4a((q.z >> 4) & 0x0F0F0F0F, xh.z, sh);
    sl = dp4a(q.w & 0x0F0F0F0F, xl.w, sl), sh = dp4a((q.w >> 4) & 0x0F0F0F0F, xh.w, sh);
}

// Q4_K: lane t reads qs[16t..+16]: low nibbles are weights 64p + i0.. of sub-block 2p, high
// nibbles the same positions of sub-block 2p + 1 (p = t / 2, i0 = 16·(t % 2)). A weight is
// d·sc·q − dmin·mn, so a sub-block's sum is d·sc·dx·Σq·qx − dmin·mn·(dx·Σqx): the even lane of
// each pair adds the min term of the two sub-blocks it shares with its odd partner.
template <>
struct Q8Unit<TY_Q4_K> {
    static constexpr int L = 8, W = 256;
    static __device__ __forceinline__ float dot(const u8* row, int nb, int c, int t, const i8* xq, const float2* xd) {
        const u8* b = row + 144 * c;
        const uint4 h = *(const uint4*)b;
        const uint4 q = *(const uint4*)(b + 16 + 16 * t);
        const int p = t / 2, i0 = 16 * (t % 2);
        const int4 xl = *(const int4*)(xq + 256 * c + 64 * p + i0);
        const int4 xh = *(const int4*)(xq + 256 * c + 64 * p + 32 + i0);
        int sl = 0, sh = 0;
        q4k_nibble_dots(q, xl, xh, sl, sh);
        int sc0, mn0, sc1, mn1;
        scale_min_k4_words(2 * p, h.y, h.z, h.w, &sc0, &mn0);
        scale_min_k4_words(2 * p + 1, h.y, h.z, h.w, &sc1, &mn1);
        const float d = f16_to_f32((u16)(h.x & 0xFFFF)), dmin = f16_to_f32((u16)(h.x >> 16));
        const float2 a = xd[8 * c + 2 * p], e = xd[8 * c + 2 * p + 1];
        float r = d * ((float)sc0 * a.x * (float)sl + (float)sc1 * e.x * (float)sh);
        if (t % 2 == 0) r -= dmin * ((float)mn0 * a.y + (float)mn1 * e.y);
        return r;
    }
};

// Q4_K at 4 lanes a unit (the MoE gate/up's wide form, EMBER_MOE_GU_WIDE): lane t reads
// qs[32t..+32] whole, the low nibbles weights 64t.. of sub-block 2t and the high nibbles
// sub-block 2t + 1: half the header loads and scale decodes of the 8-lane form a weight, and each
// lane adds its own sub-blocks' min terms. The same sums as Q8Unit<TY_Q4_K> in another grouping
// (each lane's integer sum covers 32 weights, not 16): not the same bits.
struct Q8UnitQ4KWide {
    static constexpr int L = 4, W = 256;
    static __device__ __forceinline__ float dot(const u8* row, int nb, int c, int t, const i8* xq, const float2* xd) {
        const u8* b = row + 144 * c;
        const uint4 h = *(const uint4*)b;
        const uint4 q0 = *(const uint4*)(b + 16 + 32 * t), q1 = *(const uint4*)(b + 32 + 32 * t);
        const i8* x = xq + 256 * c + 64 * t;
        const int4 xl0 = *(const int4*)x, xl1 = *(const int4*)(x + 16);
        const int4 xh0 = *(const int4*)(x + 32), xh1 = *(const int4*)(x + 48);
        int sl = 0, sh = 0;
        q4k_nibble_dots(q0, xl0, xh0, sl, sh);
        q4k_nibble_dots(q1, xl1, xh1, sl, sh);
        int sc0, mn0, sc1, mn1;
        scale_min_k4_words(2 * t, h.y, h.z, h.w, &sc0, &mn0);
        scale_min_k4_words(2 * t + 1, h.y, h.z, h.w, &sc1, &mn1);
        const float d = f16_to_f32((u16)(h.x & 0xFFFF)), dmin = f16_to_f32((u16)(h.x >> 16));
        const float2 a = xd[8 * c + 2 * t], e = xd[8 * c + 2 * t + 1];
        return d * ((float)sc0 * a.x * (float)sl + (float)sc1 * e.x * (float)sh) - dmin * ((float)mn0 * a.y + (float)mn1 * e.y);
    }
};

// Q6_K: lane t (n = t / 4, l0 = 8·(t % 4)) reads ql[64n + l0..+8] (quarters 0 and 2 of half n:
// low and high nibbles), ql[64n + 32 + l0..+8] (quarters 1 and 3) and qh[32n + l0..+8] (bits
// 2r of quarter r): weights 128n + 32r + l0.. for r < 4, scale sc[8n + 2r + l0 / 16].
// Lane t's part of Q6_K unit c against int8 x, from its bytes as Q8Unit<TY_Q6_K> reads them: ql
// (qa: quarters 0 and 2, qb: 1 and 3), qh, its half's 8 scales (s4, s4b) and d. (Shared with
// bench/gpu/gemv-micro.cuh's layouts.)
__device__ __forceinline__ float q6k_q8_lane(uint2 qa, uint2 qb, uint2 qh, u32 s4, u32 s4b, float d, int c, int t, const i8* xq,
                                             const float2* xd) {
    const int n = t / 4, l0 = 8 * (t % 4);
    const i8* x = xq + 256 * c + 128 * n + l0;
    float r = 0.0f;
#pragma unroll
    for (int rq = 0; rq < 4; ++rq) {
        const uint2 ql = (rq & 1) ? qb : qa;
        const int sh = 4 * (rq >> 1);
        u32 v0 = ((ql.x >> sh) & 0x0F0F0F0Fu) | (((qh.x >> (2 * rq)) & 0x03030303u) << 4);
        u32 v1 = ((ql.y >> sh) & 0x0F0F0F0Fu) | (((qh.y >> (2 * rq)) & 0x03030303u) << 4);
        // q − 32 per byte (q < 64): flip bit 5; where it is then set, q was < 32 and the byte is
        // negative: set bits 6 and 7 too.
        v0 ^= 0x20202020u, v1 ^= 0x20202020u;
        v0 |= (v0 & 0x20202020u) * 6, v1 |= (v1 & 0x20202020u) * 6;
        const int2 xv = *(const int2*)(x + 32 * rq);
        const int s = dp4a((int)v1, xv.y, dp4a((int)v0, xv.x, 0));
        const int j = 2 * rq + l0 / 16;  // scale 8n + j
        const int sc = (int)(i8)(((j < 4 ? s4 : s4b) >> (8 * (j % 4))) & 0xFF);
        r += (float)sc * xd[8 * c + 4 * n + rq].x * (float)s;
    }
    return d * r;
}

template <>
struct Q8Unit<TY_Q6_K> {
    static constexpr int L = 8, W = 256;
    static __device__ __forceinline__ float dot(const u8* row, int nb, int c, int t, const i8* xq, const float2* xd) {
        const int n = t / 4, l0 = 8 * (t % 4);
        const u8* b = q6k_blk(row, nb, c);
        // The repacked runs are 8-byte aligned where the row is (k a multiple of 2,048: rows of
        // whole 16-byte chunks): one 8-byte load a field (gemv-micro's q6r). Rows of 210·nb
        // bytes are 4-byte aligned for even nb (the MoE's down at k = 512: 420-byte rows, every
        // other one off 8): two 4-byte loads a field there. Else 2-byte ones.
        uint2 qa, qb, qh;
        u32 s4, s4b;
        if (((u64)b & 7) == 0) {
            qa = *(const uint2*)(b + 64 * n + l0), qb = *(const uint2*)(b + 64 * n + 32 + l0);
            qh = *(const uint2*)(b + 128 + 32 * n + l0);
            const uint2 sc = *(const uint2*)(b + 192 + 8 * n);
            s4 = sc.x, s4b = sc.y;
#ifndef EMBER_Q6_A2
        } else if (((u64)b & 3) == 0) {
            qa = ld_u64_a4(b + 64 * n + l0), qb = ld_u64_a4(b + 64 * n + 32 + l0);
            qh = ld_u64_a4(b + 128 + 32 * n + l0);
            s4 = *(const u32*)(b + 192 + 8 * n), s4b = *(const u32*)(b + 196 + 8 * n);
#endif
        } else {
            qa = ld_u64_a2(b + 64 * n + l0), qb = ld_u64_a2(b + 64 * n + 32 + l0);
            qh = ld_u64_a2(b + 128 + 32 * n + l0);
            s4 = ld_u32_a2(b + 192 + 8 * n), s4b = ld_u32_a2(b + 196 + 8 * n);
        }
        const float d = f16_to_f32(ld_u16(q6k_dp(row, nb, c)));
        return q6k_q8_lane(qa, qb, qh, s4, s4b, d, c, t, xq, xd);
    }
};

// 16 bytes at p, whose alignment mod 16 is `a` (0, 8, 4 or else 2): the widest loads it allows.
__device__ __forceinline__ uint4 ld_u128_at(const u8* p, u32 a) {
    if (a == 0) return *(const uint4*)p;
    uint2 lo, hi;
    if ((a & 7) == 0) lo = *(const uint2*)p, hi = *(const uint2*)(p + 8);
    else if ((a & 3) == 0) lo = ld_u64_a4(p), hi = ld_u64_a4(p + 8);
    else lo = ld_u64_a2(p), hi = ld_u64_a2(p + 8);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// Q6_K at 4 lanes a unit (the MoE down's wide form, EMBER_MOE_DOWN_WIDE): lane t (n = t / 2,
// l0 = 16·(t % 2)) reads 16 bytes of each field where Q8Unit<TY_Q6_K>'s lanes read 8 (ql at
// 64n + l0 and 64n + 32 + l0, qh at 32n + l0: weights 128n + 32r + l0..+16 for r < 4, one
// scale each, sc[8n + 2r + t % 2]) against 16 bytes of x a quarter: half the x and scale loads
// and the scale picks a weight. The fields are as aligned as the row (208-byte runs); rows of
// 210·nb bytes may be 2-, 4-, 8- or 16-byte aligned (ld_u128_at). Another grouping of the same
// sums as the 8-lane form: not the same bits.
struct Q8UnitQ6KWide {
    static constexpr int L = 4, W = 256;
    static __device__ __forceinline__ float dot(const u8* row, int nb, int c, int t, const i8* xq, const float2* xd) {
        const int n = t / 2, l0 = 16 * (t % 2);
        const u8* b = q6k_blk(row, nb, c);
        const u32 a = (u32)((u64)b & 15);
        const uint4 qa = ld_u128_at(b + 64 * n + l0, a), qb = ld_u128_at(b + 64 * n + 32 + l0, a);
        const uint4 qh = ld_u128_at(b + 128 + 32 * n + l0, a);
        const uint2 sc = (a & 7) == 0 ? *(const uint2*)(b + 192 + 8 * n)
                         : (a & 3) == 0 ? ld_u64_a4(b + 192 + 8 * n)
                                        : ld_u64_a2(b + 192 + 8 * n);
        const float d = f16_to_f32(ld_u16(q6k_dp(row, nb, c)));
        const i8* x = xq + 256 * c + 128 * n + l0;
        float r = 0.0f;
#pragma unroll
        for (int rq = 0; rq < 4; ++rq) {
            const uint4 ql = (rq & 1) ? qb : qa;
            const int sh = 4 * (rq >> 1);
            const u32 l[4] = {ql.x, ql.y, ql.z, ql.w}, h[4] = {qh.x, qh.y, qh.z, qh.w};
            const int4 xv = *(const int4*)(x + 32 * rq);
            const int xs[4] = {xv.x, xv.y, xv.z, xv.w};
            int s = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 v = ((l[i] >> sh) & 0x0F0F0F0Fu) | (((h[i] >> (2 * rq)) & 0x03030303u) << 4);
                v ^= 0x20202020u;  // q − 32 per byte, as q6k_q8_lane
                v |= (v & 0x20202020u) * 6;
                s = dp4a((int)v, xs[i], s);
            }
            const int j = 2 * rq + (t % 2);  // scale 8n + j
            const int scv = (int)(i8)(((j < 4 ? sc.x : sc.y) >> (8 * (j % 4))) & 0xFF);
            r += (float)scv * xd[8 * c + 4 * n + rq].x * (float)s;
        }
        return d * r;
    }
};

// Q8_0: lane t reads quants 8t..+8 of the block.
template <>
struct Q8Unit<TY_Q8_0> {
    static constexpr int L = 4, W = 32;
    static __device__ __forceinline__ float dot(const u8* row, int nb, int c, int t, const i8* xq, const float2* xd) {
        const u8* b = row + 34 * c;
        const uint2 w = ld_u64_a2(b + 2 + 8 * t);
        const int2 xv = *(const int2*)(xq + 32 * c + 8 * t);
        const int s = dp4a((int)w.y, xv.y, dp4a((int)w.x, xv.x, 0));
        return f16_to_f32(ld_u16(b)) * xd[c].x * (float)s;
    }
};

// The sum of v over the `seg` consecutive threads of a row (seg a power of two, at most the
// block's 128 threads), in a fixed order; every thread of the row gets it. `part`: shared memory
// of blockDim.x / 32 floats. Every thread of the block calls it (it may hold barriers).
__device__ __forceinline__ float seg_sum(float v, int seg, float* part) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < seg) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (seg <= 32) return v;
    __syncthreads();  // a previous call's readers are done with part
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    const int w0 = (threadIdx.x / seg) * (seg / 32);
    float s = 0.0f;
    for (int j = 0; j < seg / 32; ++j) s += part[w0 + j];
    return s;
}

#define Q8_THREADS 128
