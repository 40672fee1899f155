// rms_norm: every `g`-wide group of every row, x / sqrt(mean(x²) + eps) · w (g = len(w)).
// Reference: ember_ops::reference::rms_norm (sum of squares in f64 there; f32 tree sum here).

struct RmsNormParams {
    u64 x;    // [n_group · g] f32
    u64 w;    // [g] f32
    u64 out;  // [n_group · g] f32
    u32 g, n_group;
    float eps;
    u32 pad;
};

// One block per group.
extern "C" __global__ void rms_norm(const RmsNormParams p) {
    __shared__ float scratch[32];
    const float* x = (const float*)p.x + (u64)blockIdx.x * p.g;
    float* out = (float*)p.out + (u64)blockIdx.x * p.g;
    const float* w = (const float*)p.w;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)p.g + p.eps);
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) out[i] = x[i] * scale * w[i];
}

// rms_norm_q8: rms_norm that also writes its output quantised to int8 in blocks of 32, as
// quantize_q8 (gemv_q8.cu) would (q: n·g int8, then n·g/32 float2 (d, d·Σq)), for the int8
// GEMVs that read it next. g a multiple of 32 and of blockDim-aligned warps: value i of a row is
// thread i % blockDim's, so each warp holds 32 consecutive values per pass.
struct RmsNormQ8Params {
    RmsNormParams r;
    u64 q;
};

extern "C" __global__ void rms_norm_q8(const RmsNormQ8Params q) {
    const RmsNormParams& p = q.r;
    __shared__ float scratch[32];
    const float* x = (const float*)p.x + (u64)blockIdx.x * p.g;
    float* out = (float*)p.out + (u64)blockIdx.x * p.g;
    const float* w = (const float*)p.w;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)p.g + p.eps);
    const u64 n = (u64)gridDim.x * p.g, base = (u64)blockIdx.x * p.g;
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) {  // whole warps (g % 32 == 0)
        const float v = x[i] * scale * w[i];
        out[i] = v;
        const float amax = warp_max(fabsf(v));
        const float d = amax / 127.0f;
        const int qv = amax > 0.0f ? __float2int_rn(v / d) : 0;
        int s = qv;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        ((i8*)q.q)[base + i] = (i8)qv;
        if (threadIdx.x % 32 == 0) ((float2*)((u8*)q.q + n))[(base + i) / 32] = make_float2(d, d * (float)s);
    }
}
