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

// One q or k head of row t: src's dk values L2-normalised (q also ·1/√dk) into dst. Every thread
// of the block calls it; a thread reads only the src[i] of its own i (src may be a block's shared
// values it wrote).
__device__ __forceinline__ void prep_head(const DeltaPrepParams& p, const float* src, float* dst, bool is_q, float* scratch) {
    const u32 dk = p.d_k;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < dk; i += blockDim.x) ss += src[i] * src[i];
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss + p.eps);
    const float q_scale = 1.0f / sqrtf((float)dk);
    for (u32 i = threadIdx.x; i < dk; i += blockDim.x) {
        const float x = src[i] * scale;
        dst[i] = is_q ? x * q_scale : x;
    }
}

// g and β of row t for every value head (one block).
__device__ __forceinline__ void prep_gate(const DeltaPrepParams& p, u32 t) {
    const u32 nv = p.n_v_head;
    for (u32 h = threadIdx.x; h < nv; h += blockDim.x) {
        const u64 at = (u64)t * nv + h;
        ((float*)p.beta)[at] = sigmoid_f(((const float*)p.b)[at]);
        const float x = ((const float*)p.alpha)[at] + ((const float*)p.dt_bias)[h];
        ((float*)p.g)[at] = ((const float*)p.a)[h] * softplus_f(x);
    }
}

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
        prep_head(p, src, (float*)(is_q ? p.q : p.k) + (u64)t * nk * dk + h * dk, is_q, scratch);
        return;
    }
    if (blockIdx.x == 2 * nk) {
        prep_gate(p, t);
        return;
    }
    const float* src = row + 2 * nk * dk;
    float* dst = (float*)p.v + (u64)t * nv * p.d_v;
    const u32 i0 = (blockIdx.x - 2 * nk - 1) * DELTA_PREP_V_CHUNK, i1 = min(i0 + DELTA_PREP_V_CHUNK, nv * p.d_v);
    for (u32 i = i0 + threadIdx.x; i < i1; i += blockDim.x) dst[i] = src[i];
}

// conv_delta_prep: conv1d_silu (kernels/conv1d_silu.cu, kernel length 4) and delta_prep in one
// launch, for steps whose sequences each have one row (decode): the conv output never goes to
// memory. The same arithmetic in the same order as the two launches (the conv's taps summed in
// tap order, one thread a channel; each q / k head's sum of squares over its values in thread
// order, then block_sum), so the same bits. grid (2·nk + 1 + ceil(nv·dv / DELTA_PREP_V_CHUNK),
// n_seq), 128 threads, d_k floats of dynamic shared memory: blocks below 2·nk convolve one q or
// k head's channels and normalise them, block 2·nk computes g and β, the rest convolve a chunk of
// v's channels each. Sequence s's row is row0[s]; a slot out of range gives NaN q, k and v (as
// the conv's NaN rows would).
struct ConvPrepParams {
    DeltaPrepParams p;  // p.cu unused
    u64 x;              // [n_rows, c] f32: the conv's input
    u64 w;              // [c · 4] f32
    u64 state;          // the store's DeltaNet buffer, updated in place
    u64 row0;           // [n_seq] u32
    u64 slot;           // [n_seq] u32
    u64 slot_stride, offset;  // floats
    u32 c, n_slots;
};

// Channel ch of row t: silu of the conv over the slot's history and x (conv_chunk<4> for one row),
// the history shifted by one in place.
__device__ __forceinline__ float conv4_one(const ConvPrepParams& cp, float* state, bool ok, const float* w4, u32 t, u32 ch) {
    if (!ok) return __int_as_float(0x7fffffff);
    const u32 c = cp.c;
    float win[4];
#pragma unroll
    for (int j = 0; j < 3; ++j) win[j] = state[(u64)j * c + ch];
    win[3] = ((const float*)cp.x)[(u64)t * c + ch];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) acc += w4[j] * win[j];
#pragma unroll
    for (int j = 0; j < 3; ++j) state[(u64)j * c + ch] = win[j + 1];
    return silu_f(acc);
}

extern "C" __global__ void conv_delta_prep(const ConvPrepParams cp) {
    extern __shared__ float vals[];  // a q / k head's conv outputs (d_k)
    __shared__ float scratch[32];
    const DeltaPrepParams& p = cp.p;
    const u32 nk = p.n_k_head, dk = p.d_k, nv = p.n_v_head, s = blockIdx.y;
    // This block's channels: a q / k head's, or a chunk of v's.
    u32 c0 = 0, c1 = 0;
    if (blockIdx.x < 2 * nk) {
        c0 = blockIdx.x * dk, c1 = c0 + dk;
    } else if (blockIdx.x > 2 * nk) {
        c0 = 2 * nk * dk + (blockIdx.x - 2 * nk - 1) * DELTA_PREP_V_CHUNK, c1 = min(c0 + DELTA_PREP_V_CHUNK, 2 * nk * dk + nv * p.d_v);
    }
    // Their taps and the sequence's history rows asked for in L2 (hints: weights are never
    // written by a step's kernels, and the sequence table was written before the step).
    if (threadIdx.x < 4 && c1 > c0) {
        const u32 slot = ((const u32*)cp.slot)[s];
        if (threadIdx.x == 3) prefetch_l2((const float*)cp.w + (u64)c0 * 4, 16ull * (c1 - c0));
        else if (slot < cp.n_slots)
            prefetch_l2((const float*)cp.state + slot * cp.slot_stride + cp.offset + (u64)threadIdx.x * cp.c + c0, 4ull * (c1 - c0));
    }
    pdl_enter();
    const u32 t = ((const u32*)cp.row0)[s], slot = ((const u32*)cp.slot)[s];
    const bool ok = slot < cp.n_slots;
    float* state = (float*)cp.state + (ok ? slot * cp.slot_stride + cp.offset : 0);
    const float* w = (const float*)cp.w;
    if (blockIdx.x < 2 * nk) {
        const bool is_q = blockIdx.x < nk;
        const u32 h = is_q ? blockIdx.x : blockIdx.x - nk;
        for (u32 i = threadIdx.x; i < dk; i += blockDim.x) {
            const u32 ch = c0 + i;
            const float w4[4] = {w[4 * ch], w[4 * ch + 1], w[4 * ch + 2], w[4 * ch + 3]};
            vals[i] = conv4_one(cp, state, ok, w4, t, ch);
        }
        prep_head(p, vals, (float*)(is_q ? p.q : p.k) + (u64)t * nk * dk + h * dk, is_q, scratch);
        return;
    }
    if (blockIdx.x == 2 * nk) {
        prep_gate(p, t);
        return;
    }
    float* dst = (float*)p.v + (u64)t * nv * p.d_v;
    for (u32 ch = c0 + threadIdx.x; ch < c1; ch += blockDim.x) {
        const float w4[4] = {w[4 * ch], w[4 * ch + 1], w[4 * ch + 2], w[4 * ch + 3]};
        dst[ch - 2 * nk * dk] = conv4_one(cp, state, ok, w4, t, ch);
    }
}
