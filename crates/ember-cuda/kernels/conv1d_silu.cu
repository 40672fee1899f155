// conv1d_silu: causal depthwise conv over time with the carried state, then SiLU.
// Reference: ember_ops::reference::conv1d_silu. u(i) for i < 0 is the state
// (state[(hist + i)·C + ch]); out[t][ch] = silu(Σ_j w[ch·K + j]·u(t − hist + j)); the new
// state is the last hist inputs.
//   conv1d_silu: one sequence, its state at `state`.
//   conv1d_silu_seqs: every sequence of a step in one launch; sequence s has rows
//     row0[s]..row0[s] + n[s] and its state in slot slot[s] of the store's DeltaNet buffer
//     (state + slot · slot_stride + offset).

#define CONV_MAX_K 8

struct ConvParams {
    u64 x;      // [n_tok, C] f32
    u64 w;      // [C · K] f32
    u64 state;  // [(K − 1) · C] f32, updated in place
    u64 out;    // [n_tok, C] f32
    u32 n_tok, c, k, pad;
};

struct ConvSeqsParams {
    u64 x;      // [n_rows, C] f32
    u64 w;      // [C · K] f32
    u64 state;  // the store's DeltaNet buffer, updated in place
    u64 out;    // [n_rows, C] f32
    u64 row0;   // [n_seq] u32
    u64 n;      // [n_seq] u32
    u64 slot;   // [n_seq] u32
    u64 slot_stride, offset;  // floats
    u32 c, k, n_slots, pad;
};

// Channel `ch` of rows t0..t1 of x, continuing and updating the history `state`.
__device__ __forceinline__ void conv_channel(const float* x, const float* wt, float* state, float* out, u32 t0, u32 t1, u32 c, u32 k,
                                             u32 ch) {
    const int hist = k - 1;
    float w[CONV_MAX_K], win[CONV_MAX_K];
    for (int j = 0; j < (int)k; ++j) w[j] = wt[(u64)ch * k + j];
    for (int j = 0; j < hist; ++j) win[j] = state[(u64)j * c + ch];
    for (u32 t = t0; t < t1; ++t) {
        win[hist] = x[(u64)t * c + ch];
        float acc = 0.0f;
        for (int j = 0; j < (int)k; ++j) acc += w[j] * win[j];
        out[(u64)t * c + ch] = silu_f(acc);
        for (int j = 0; j < hist; ++j) win[j] = win[j + 1];
    }
    for (int j = 0; j < hist; ++j) state[(u64)j * c + ch] = win[j];
}

// One thread per channel; it walks the tokens with the window in registers.
extern "C" __global__ void conv1d_silu(const ConvParams p) {
    pdl_enter();
    const u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= p.c) return;
    conv_channel((const float*)p.x, (const float*)p.w, (float*)p.state, (float*)p.out, 0, p.n_tok, p.c, p.k, ch);
}

// grid (ceil(C / blockDim), n_seq): one thread per (channel, sequence). The block's weights and
// state rows are asked for in L2 before pdl_enter (hints only; the sequence table was written
// before the step).
extern "C" __global__ void conv1d_silu_seqs(const ConvSeqsParams p) {
    const u32 c0 = blockIdx.x * blockDim.x, nc = c0 < p.c ? min(blockDim.x, p.c - c0) : 0;
    if (threadIdx.x < p.k && nc > 0) {
        if (threadIdx.x == 0) prefetch_l2((const float*)p.w + (u64)c0 * p.k, 4ull * nc * p.k);
        const u32 slot = ((const u32*)p.slot)[blockIdx.y];
        if (threadIdx.x + 1 < p.k && slot < p.n_slots)
            prefetch_l2((const float*)p.state + slot * p.slot_stride + p.offset + (u64)threadIdx.x * p.c + c0, 4ull * nc);
    }
    pdl_enter();
    const u32 ch = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (ch >= p.c) return;
    const u32 t0 = ((const u32*)p.row0)[s], t1 = t0 + ((const u32*)p.n)[s], slot = ((const u32*)p.slot)[s];
    if (slot >= p.n_slots) {
        for (u32 t = t0; t < t1; ++t) ((float*)p.out)[(u64)t * p.c + ch] = __int_as_float(0x7fffffff);
        return;
    }
    float* state = (float*)p.state + slot * p.slot_stride + p.offset;
    conv_channel((const float*)p.x, (const float*)p.w, state, (float*)p.out, t0, t1, p.c, p.k, ch);
}
