// delta_prep: split the conv output cu [T, 2·nk·dk + nv·dv] into q | k | v, L2-normalise q and
// k per head (eps on the sum of squares; q then scaled by 1/sqrt(dk)), β = sigmoid(b),
// g = a·softplus(alpha + dt_bias) (threshold 20). Reference: ember_ops::reference::delta_prep
// (qwen35moe.md §6.4).

struct DeltaPrepParams {
    u64 cu;       // [n_tok, 2·nk·dk + nv·dv] f32
    u64 b;        // [n_tok, nv] f32
    u64 alpha;    // [n_tok, nv] f32
    u64 a;        // [nv] f32
    u64 dt_bias;  // [nv] f32
    u64 q;        // [n_tok, nk·dk] f32
    u64 k;        // [n_tok, nk·dk] f32
    u64 v;        // [n_tok, nv·dv] f32
    u64 g;        // [n_tok, nv] f32
    u64 beta;     // [n_tok, nv] f32
    u32 n_tok, n_k_head, d_k, n_v_head, d_v;
    float eps;
};

__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Values of v each copying block moves (blockDim 128 × 4).
#define DELTA_PREP_V_CHUNK 512

// grid (2·nk + 1 + ceil(nv·dv / DELTA_PREP_V_CHUNK), n_tok), 128 threads: blocks below 2·nk
// normalise one q or k head, block 2·nk computes g and β for every value head, the rest copy v
// a chunk each (one block copying all of v was a serial chain of 32 loads a thread).
extern "C" __global__ void delta_prep(const DeltaPrepParams p) {
    pdl_enter();
    __shared__ float scratch[32];
    const u32 t = blockIdx.y, nk = p.n_k_head, dk = p.d_k, nv = p.n_v_head;
    const u32 width = 2 * nk * dk + nv * p.d_v;
    const float* row = (const float*)p.cu + (u64)t * width;
    if (blockIdx.x < 2 * nk) {
        const bool is_q = blockIdx.x < nk;
        const u32 h = is_q ? blockIdx.x : blockIdx.x - nk;
        const float* src = row + (is_q ? 0 : nk * dk) + h * dk;
        float* dst = (float*)(is_q ? p.q : p.k) + (u64)t * nk * dk + h * dk;
        float ss = 0.0f;
        for (u32 i = threadIdx.x; i < dk; i += blockDim.x) ss += src[i] * src[i];
        ss = block_sum(ss, scratch);
        const float scale = 1.0f / sqrtf(ss + p.eps);
        const float q_scale = 1.0f / sqrtf((float)dk);
        for (u32 i = threadIdx.x; i < dk; i += blockDim.x) {
            const float x = src[i] * scale;
            dst[i] = is_q ? x * q_scale : x;
        }
        return;
    }
    if (blockIdx.x == 2 * nk) {
        for (u32 h = threadIdx.x; h < nv; h += blockDim.x) {
            const u64 at = (u64)t * nv + h;
            ((float*)p.beta)[at] = sigmoid_f(((const float*)p.b)[at]);
            const float x = ((const float*)p.alpha)[at] + ((const float*)p.dt_bias)[h];
            ((float*)p.g)[at] = ((const float*)p.a)[h] * softplus_f(x);
        }
        return;
    }
    const float* src = row + 2 * nk * dk;
    float* dst = (float*)p.v + (u64)t * nv * p.d_v;
    const u32 i0 = (blockIdx.x - 2 * nk - 1) * DELTA_PREP_V_CHUNK, i1 = min(i0 + DELTA_PREP_V_CHUNK, nv * p.d_v);
    for (u32 i = i0 + threadIdx.x; i < i1; i += blockDim.x) dst[i] = src[i];
}
