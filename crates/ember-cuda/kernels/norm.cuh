// RMSNorm's parameters and its in-register form, shared by rms_norm.cu and delta_rule.cu (whose
// delta_rule_norm_seqs has each value head's last block normalise the head it finished).

struct RmsNormParams {
    u64 x;    // [n_group · g] f32
    u64 w;    // [g] f32
    u64 out;  // [n_group · g] f32
    u32 g, n_group;
    float eps;
    u32 n_add;  // rows of `add` summed (in order) before they are added to x: 0 or 1, one
    u64 add;    // [n_add, n_group · g] f32, or 0
    u64 gate;  // [n_group · g] f32, or 0
    u32 act, pad2;
};

// Value i of the addend of a group whose `add` row starts at a: a[i], or with n_add > 1 the sum
// of the n_add rows' values i in row order (a one-launch MoE's experts, moe_fused_q8).
__device__ __forceinline__ float norm_add_of(const RmsNormParams& p, const float* a, u32 i) {
    float v = a[i];
    if (p.n_add > 1) {
        const u64 st = (u64)p.n_group * p.g;
        for (u32 k = 1; k < p.n_add; ++k) v += a[k * st + i];
    }
    return v;
}

// The norm with each thread's values of its group in registers (g <= NORM_REGS · blockDim: the
// model's 2,048-wide rows at 1,024 threads, 2 a thread): the weight's values are read before
// pdl_enter (weights are never written by a step's kernels), x, the add and the gate together after it,
// so the chain after the kernel ahead ends is one round trip, the block sum and the stores. The
// two-pass path (wider rows) reads w and the gate (and x again) after the block sum: a second
// round trip, to DRAM for w, whose 8 KB leave L2 while the rest of a token's weights stream
// through it. The same arithmetic in the same order: the same bits. With `q`, also the int8 copy
// (rms_norm_q8). Measured against the two-pass form on the 35B (H100, docs/perf.md g18): decode
// tg128 +10 % (111 norms a token), prompts unchanged.
#define NORM_REGS 4

__device__ __forceinline__ bool norm_regs_fit(const RmsNormParams& p) { return p.g <= NORM_REGS * blockDim.x; }

// This thread's values of w: value tid + j·nthr in wv[j].
__device__ __forceinline__ void norm_regs_w(const RmsNormParams& p, float (&wv)[NORM_REGS], u32 tid, u32 nthr) {
    const float* w = (const float*)p.w;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        wv[j] = i < p.g ? w[i] : 0.0f;
    }
}

// Group `group` (of n values in all, for the int8 copy's layout) normalised by nthr threads, this
// one tid. ONE_WARP: the caller is one warp alone (nthr 32) and no other thread of its block
// takes part: the block sum of a 32-thread block without its barriers (the same sums, so the
// same bits as rms_norm's launch of 32 threads a group), and x read through L2 (other blocks of
// the same kernel wrote it).
// PARTS: the addend is norm_add_of's sum of n_add rows (n_add > 1), else add's one row.
template <bool ONE_WARP, bool PARTS = false>
__device__ __forceinline__ void norm_regs_group(const RmsNormParams& p, u64 q, const float (&wv)[NORM_REGS], u32 group, u64 n, u32 tid,
                                                u32 nthr, float* scratch) {
    float xv[NORM_REGS], av[NORM_REGS], gv[NORM_REGS];
    float* x = (float*)p.x + (u64)group * p.g;
    float* out = (float*)p.out + (u64)group * p.g;
    const float* a = p.add ? (const float*)p.add + (u64)group * p.g : nullptr;
    const float* gt = p.gate ? (const float*)p.gate + (u64)group * p.g : nullptr;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        const bool in = i < p.g;
        xv[j] = in ? (ONE_WARP ? __ldcg(x + i) : x[i]) : 0.0f;
        av[j] = in && a ? (PARTS ? norm_add_of(p, a, i) : a[i]) : 0.0f;
        gv[j] = in && gt ? gt[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        if (i < p.g) {
            float v = xv[j];
            if (a) {
                v += av[j];
                x[i] = v;
                xv[j] = v;
            }
            ss += v * v;
        }
    }
    // block_sum of one warp: the warp's sum, then lane 0's plus the zeros of the absent warps
    // (both sums by the whole warp: a shuffle needs every lane of its mask).
    if (ONE_WARP) {
        ss = warp_sum(ss);
        ss = warp_sum(tid % 32 == 0 ? ss : 0.0f);
    } else {
        ss = block_sum(ss, scratch);
    }
    const float scale = 1.0f / sqrtf(ss / (float)p.g + p.eps);
    const u64 base = (u64)group * p.g;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        if (i < p.g) {  // whole warps (g and blockDim multiples of 32 where q is set)
            float v = xv[j] * scale * wv[j];
            if (gt) v = v * (p.act == 0 ? silu_f(gv[j]) : sigmoid_f(gv[j]));
            out[i] = v;
            if (q) warp_q8(v, (u8*)q, n, base + i);
        }
    }
}

// One block a group, every thread of it (PARTS: n_add > 1 rows of add summed).
template <bool PARTS = false>
__device__ __forceinline__ void norm_regs(const RmsNormParams& p, u64 q) {
    float wv[NORM_REGS];
    norm_regs_w(p, wv, threadIdx.x, blockDim.x);
    pdl_enter();
    __shared__ float scratch[32];
    norm_regs_group<false, PARTS>(p, q, wv, blockIdx.x, (u64)gridDim.x * p.g, threadIdx.x, blockDim.x, scratch);
}
