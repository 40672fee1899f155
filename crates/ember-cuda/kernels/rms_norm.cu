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
