// rms_norm: every `g`-wide group of every row, x / sqrt(mean(x²) + eps) · w (g = len(w)).
// Reference: ember_ops::reference::rms_norm (sum of squares in f64 there; f32 tree sum here).
// With `add` set, x ← x + add first (written back): a residual add fused with the norm that reads
// it next, the same sums as `add` then `rms_norm`. With `gate` set, out ⊙= act(gate) after
// (act: SiLU 0, sigmoid 1; gate.cu's product): a gated norm and its gate in one pass.

// Value i of this block's group after the norm (and the gate, when set).
__device__ __forceinline__ float normed(const RmsNormParams& p, const float* x, const float* w, float scale, u32 i) {
    const float v = x[i] * scale * w[i];
    if (!p.gate) return v;
    const float g = ((const float*)p.gate)[(u64)blockIdx.x * p.g + i];
    return v * (p.act == 0 ? silu_f(g) : sigmoid_f(g));
}

// Σ x² over this block's group, after x ← x + add when `add` is set; every thread gets it. A
// thread later reads back only the x[i] it wrote.
__device__ __forceinline__ float group_sum_sq(const RmsNormParams& p, float* x, float* scratch) {
    const float* a = p.add ? (const float*)p.add + (u64)blockIdx.x * p.g : nullptr;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) {
        float v = x[i];
        if (a) {
            v += a[i];
            x[i] = v;
        }
        ss += v * v;
    }
    return block_sum(ss, scratch);
}

// One block per group.
extern "C" __global__ void rms_norm(const RmsNormParams p) {
    if (norm_regs_fit(p)) {
        norm_regs(p, 0);
        return;
    }
    pdl_enter();
    __shared__ float scratch[32];
    float* x = (float*)p.x + (u64)blockIdx.x * p.g;
    float* out = (float*)p.out + (u64)blockIdx.x * p.g;
    const float* w = (const float*)p.w;
    const float ss = group_sum_sq(p, x, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)p.g + p.eps);
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) out[i] = normed(p, x, w, scale, i);
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
    if (norm_regs_fit(q.r)) {
        norm_regs(q.r, q.q);
        return;
    }
    pdl_enter();
    const RmsNormParams& p = q.r;
    __shared__ float scratch[32];
    float* x = (float*)p.x + (u64)blockIdx.x * p.g;
    float* out = (float*)p.out + (u64)blockIdx.x * p.g;
    const float* w = (const float*)p.w;
    const float ss = group_sum_sq(p, x, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)p.g + p.eps);
    const u64 n = (u64)gridDim.x * p.g, base = (u64)blockIdx.x * p.g;
    for (u32 i = threadIdx.x; i < p.g; i += blockDim.x) {  // whole warps (g % 32 == 0)
        const float v = normed(p, x, w, scale, i);
        out[i] = v;
        warp_q8(v, (u8*)q.q, n, base + i);
    }
}

// rms_norm_parts, rms_norm_q8_parts: rms_norm and rms_norm_q8 whose add is the sum of its n_add > 1
// rows (norm_add_of: a one-launch MoE's experts, moe_fused_q8), for rows whose norm fits in
// registers (norm_regs_fit; the launcher's check). Their own entries: the plain ones' code stays.
extern "C" __global__ void rms_norm_parts(const RmsNormParams p) { norm_regs<true>(p, 0); }
extern "C" __global__ void rms_norm_q8_parts(const RmsNormQ8Params q) { norm_regs<true>(q.r, q.q); }
