// conv1d_silu: causal depthwise conv over time with the carried state, then SiLU.
// Reference: ember_ops::reference::conv1d_silu. u(i) for i < 0 is the state
// (state[(hist + i)·C + ch]); out[t][ch] = silu(Σ_j w[ch·K + j]·u(t − hist + j)); the new
// state is the last hist inputs.

#define CONV_MAX_K 8

struct ConvParams {
    u64 x;      // [n_tok, C] f32
    u64 w;      // [C · K] f32
    u64 state;  // [(K − 1) · C] f32, updated in place
    u64 out;    // [n_tok, C] f32
    u32 n_tok, c, k, pad;
};

// One thread per channel; it walks the tokens with the window in registers.
extern "C" __global__ void conv1d_silu(const ConvParams p) {
    const u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= p.c) return;
    const int hist = p.k - 1;
    float* state = (float*)p.state;
    const float* x = (const float*)p.x;
    float w[CONV_MAX_K], win[CONV_MAX_K];
    for (int j = 0; j < (int)p.k; ++j) w[j] = ((const float*)p.w)[(u64)ch * p.k + j];
    for (int j = 0; j < hist; ++j) win[j] = state[(u64)j * p.c + ch];
    for (u32 t = 0; t < p.n_tok; ++t) {
        win[hist] = x[(u64)t * p.c + ch];
        float acc = 0.0f;
        for (int j = 0; j < (int)p.k; ++j) acc += w[j] * win[j];
        ((float*)p.out)[(u64)t * p.c + ch] = silu_f(acc);
        for (int j = 0; j < hist; ++j) win[j] = win[j + 1];
    }
    for (int j = 0; j < hist; ++j) state[(u64)j * p.c + ch] = win[j];
}
