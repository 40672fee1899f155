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

// Tokens a thread of conv1d_silu_seqs walks (CONV_CHUNK in src/ops/conv1d_silu.rs); at least
// CONV_MAX_K so that only a sequence's first chunk reaches back into the state.
#define CONV_CHUNK 16

// One thread's chunk: rows ta..tb of a sequence whose rows start at t0 (z0 = ta − t0) with n
// rows. KK: the kernel length at compile time (its window in registers), 0: p.k at run time.
template <int KK>
__device__ __forceinline__ void conv_chunk(const ConvSeqsParams& p, float* state, u32 ch, u32 t0, u32 n, u32 z0, u32 ta, u32 tb) {
    const float* x = (const float*)p.x;
    float* out = (float*)p.out;
    const u32 c = p.c;
    const int k = KK ? KK : (int)p.k, hist = k - 1;
    float w[KK ? KK : CONV_MAX_K], win[KK ? KK : CONV_MAX_K], old[KK ? KK : CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < k; ++j) w[j] = ((const float*)p.w)[(u64)ch * k + j];
    // u(i) for i < 0 is the history; the window before row z0 is u(z0 - hist) .. u(z0 - 1).
#pragma unroll
    for (int j = 0; j < hist; ++j) {
        const int i = (int)z0 - hist + j;
        win[j] = i >= 0 ? x[(u64)(t0 + i) * c + ch] : state[(u64)(hist + i) * c + ch];
        old[j] = win[j];
    }
    for (u32 t = ta; t < tb; ++t) {
        win[hist] = x[(u64)t * c + ch];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < k; ++j) acc += w[j] * win[j];
        out[(u64)t * c + ch] = silu_f(acc);
#pragma unroll
        for (int j = 0; j < hist; ++j) win[j] = win[j + 1];
    }
    if (z0 == 0) {
        // The new history u(n - hist) .. u(n - 1); old[] holds u(-hist) .. u(-1).
#pragma unroll
        for (int j = 0; j < hist; ++j) {
            const int i = (int)n - hist + j;
            state[(u64)j * c + ch] = i >= 0 ? x[(u64)(t0 + i) * c + ch] : old[hist + i];
        }
    }
}

// grid (ceil(C / blockDim), n_seq, chunks): one thread per (channel, sequence, chunk of
// CONV_CHUNK tokens); blocks past a sequence's rows leave. A chunk after the first takes its
// window from x (the rows before it); the first chunk's thread also reads the old history and
// writes the new one (the sequence's last inputs, from x or, for fewer rows than the history,
// partly the old history), so nothing else reads the state it writes. Each output is the same
// sum in the same order whatever the chunking. The block's weights and state rows are asked for
// in L2 before pdl_enter (hints only; the sequence table was written before the step).
extern "C" __global__ void conv1d_silu_seqs(const ConvSeqsParams p) {
    const u32 c0 = blockIdx.x * blockDim.x, nc = c0 < p.c ? min(blockDim.x, p.c - c0) : 0;
    if (threadIdx.x < p.k && nc > 0 && blockIdx.z == 0) {
        if (threadIdx.x == 0) prefetch_l2((const float*)p.w + (u64)c0 * p.k, 4ull * nc * p.k);
        const u32 slot = ((const u32*)p.slot)[blockIdx.y];
        if (threadIdx.x + 1 < p.k && slot < p.n_slots)
            prefetch_l2((const float*)p.state + slot * p.slot_stride + p.offset + (u64)threadIdx.x * p.c + c0, 4ull * nc);
    }
    pdl_enter();
    const u32 ch = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    const u32 n = ((const u32*)p.n)[s], z0 = blockIdx.z * CONV_CHUNK;
    if (ch >= p.c || z0 >= n) return;
    const u32 t0 = ((const u32*)p.row0)[s], slot = ((const u32*)p.slot)[s];
    const u32 ta = t0 + z0, tb = t0 + min(n, z0 + CONV_CHUNK);
    if (slot >= p.n_slots) {
        for (u32 t = ta; t < tb; ++t) ((float*)p.out)[(u64)t * p.c + ch] = __int_as_float(0x7fffffff);
        return;
    }
    float* state = (float*)p.state + slot * p.slot_stride + p.offset;
    if (p.k == 4) {
        conv_chunk<4>(p, state, ch, t0, n, z0, ta, tb);  // the models' conv (ssm_d_conv = 4)
    } else {
        conv_chunk<0>(p, state, ch, t0, n, z0, ta, tb);
    }
}
