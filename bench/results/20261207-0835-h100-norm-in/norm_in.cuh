// The RMS norm of one row as the start of the launch that reads it (prepended after prelude.cuh
// by gemv_q8.cu and matmul.cu): every block of a one-token projection normalises the residual h
// itself, y = h / sqrt(mean(h²) + eps) · w, into its own shared memory (int8 in blocks of 32 as
// quantize_q8 lays it out, or f32), and reads x from there; block 0 also writes y and its int8
// copy to global memory, as rms_norm_q8 would, for the kernels after it. The norm's own launch,
// one block whose chain (wait, load, block sum, store) cost ~3.7 us a norm in the decode step
// (81 a token), is gone; each block repeats ~2,048 values' work (a few hundred instructions a
// block), and nothing waits on another block (g25's last-block tails did, and lost).
//
// Thread t takes float4 chunks c = t + j·blockDim (j < J) of the row: a group of 32
// values is 8 consecutive chunks, so 8 consecutive lanes of one warp, and its maximum and int8
// sum take 3 shuffles. The sum of squares runs in another order than rms_norm's (this block's
// threads, then block_sum), so y is not rms_norm's bits; its int8 copy is quantize_q8's of this y
// bit for bit (the same max, d, rounding and integer sum as warp_q8).

struct NormInParams {
    u64 h;  // [d] f32, the residual
    u64 w;  // [d] f32, the norm's weight
    u64 y;  // [d] f32, written by block 0: the normed row
    u64 q;  // the int8 scratch (quantize_q8's layout for d values), written by block 0
    float eps;
    u32 d;  // a multiple of 32, at most 4 · J · blockDim
};

// J: float4 chunks a thread holds (NORM_IN_J(NT) for blocks of NT threads: rows up to 2,048).
#define NORM_IN_J(NT) ((NT) >= 512 ? 1 : 512 / (NT))

// The norm weight's chunks of this thread, read before pdl_enter (weights are never written by
// a kernel).
template <int J>
__device__ __forceinline__ void norm_in_weight(const NormInParams& n, float4* wv) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const u32 c = threadIdx.x + j * blockDim.x;
        wv[j] = c < n.d / 4 ? ((const float4*)n.w)[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// After pdl_enter, every thread of the block: the normed row into `xs` (F32: d floats; else d
// int8 values, then a float2 (d, d·Σq) per 32 at xs + d), 16-byte aligned shared memory; block
// (0, 0) also writes y and the int8 copy to n.y and n.q. `scratch`: 32 floats of shared memory.
// Ends with a barrier: xs is ready for every thread.
template <bool F32, int J>
__device__ __forceinline__ void norm_in(const NormInParams& n, const float4* wv, u8* xs, float* scratch) {
    const u32 nc = n.d / 4;
    float4 v[J];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const u32 c = threadIdx.x + j * blockDim.x;
        v[j] = c < nc ? ((const float4*)n.h)[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)n.d + n.eps);
    const bool writer = (blockIdx.x | blockIdx.y) == 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const u32 c = threadIdx.x + j * blockDim.x;
        const bool in = c < nc;  // whole groups of 8 lanes (nc % 8 == 0)
        const float4 y = make_float4(v[j].x * scale * wv[j].x, v[j].y * scale * wv[j].y, v[j].z * scale * wv[j].z, v[j].w * scale * wv[j].w);
        if (F32 && in) ((float4*)xs)[c] = y;
        if (F32 && !writer) continue;  // block-uniform
        float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float d = amax / 127.0f;
        const int q0 = amax > 0.0f ? __float2int_rn(y.x / d) : 0, q1 = amax > 0.0f ? __float2int_rn(y.y / d) : 0;
        const int q2 = amax > 0.0f ? __float2int_rn(y.z / d) : 0, q3 = amax > 0.0f ? __float2int_rn(y.w / d) : 0;
        int s = q0 + q1 + q2 + q3;
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const u32 packed = (u32)(q0 & 0xFF) | (u32)(q1 & 0xFF) << 8 | (u32)(q2 & 0xFF) << 16 | (u32)(q3 & 0xFF) << 24;
        const float2 ds = make_float2(d, d * (float)s);
        if (!in) continue;
        if (!F32) {
            ((u32*)xs)[c] = packed;
            if (c % 8 == 0) ((float2*)(xs + n.d))[c / 8] = ds;
        }
        if (writer) {
            ((float4*)n.y)[c] = y;
            ((u32*)n.q)[c] = packed;
            if (c % 8 == 0) ((float2*)((u8*)n.q + n.d))[c / 8] = ds;
        }
    }
    __syncthreads();
}
