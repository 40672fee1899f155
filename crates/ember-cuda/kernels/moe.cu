// moe: the routed experts of a MoE layer as two kernels (reference: ember_ops::reference::moe
// with reference::matmul; qwen35moe.md §6.6). The shared expert is a plain matmul + gate.
//   moe_gate_up_<type>: h[t][j] = silu(gate_e · x_t) ⊙ (up_e · x_t), e = ids[t][j], for every
//     token t and routing slot j: one warp per (row, t, j), only the routed experts are read.
//   moe_down_<type>: out[t] = Σ_j weights[t][j] · (down_e · h[t][j]): one warp per (row, t)
//     sums its k experts itself (no atomics). The sum runs in routing order (largest weight
//     first); the reference adds experts in increasing id: the same terms, another order.
// An expert id >= n_expert gives NaN outputs (ids live on the device).

struct MoeParams {
    u64 gate;     // [n_expert · n_ff] rows of k = d (ty_gu)
    u64 up;       // same
    u64 down;     // [n_expert · d] rows of k = n_ff (ty_down)
    u64 x;        // [n_tok, d] f32
    u64 ids;      // [n_tok, k_top] u32
    u64 weights;  // [n_tok, k_top] f32
    u64 h;        // [n_tok, k_top, n_ff] f32 (scratch between the two kernels)
    u64 out;      // [n_tok, d] f32
    u32 d, n_ff, n_expert, n_tok, k_top, row_bytes_gu, row_bytes_down, pad;
};

#define MOE_NAN __int_as_float(0x7fffffff)

// grid (ceil(n_ff / 4), n_tok · k_top), 128 threads.
template <int TY>
__device__ __forceinline__ void moe_gate_up(const MoeParams& p) {
    __shared__ float iq4[16];
    load_iq4_table(iq4);
    const int r = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= (int)p.n_ff) return;  // whole warps
    const u32 pair = blockIdx.y, t = pair / p.k_top, e = ((const u32*)p.ids)[pair];
    float* h = (float*)p.h + (u64)pair * p.n_ff;
    if (e >= p.n_expert) {
        if (lane == 0) h[r] = MOE_NAN;
        return;
    }
    const u64 at = ((u64)e * p.n_ff + r) * p.row_bytes_gu;
    const float* x = (const float*)p.x + (u64)t * p.d;
    const float g = warp_dot<TY>((const u8*)p.gate + at, p.d, x, iq4);
    const float u = warp_dot<TY>((const u8*)p.up + at, p.d, x, iq4);
    if (lane == 0) h[r] = silu_f(g) * u;
}

// grid (ceil(d / 4), n_tok), 128 threads.
template <int TY>
__device__ __forceinline__ void moe_down(const MoeParams& p) {
    __shared__ float iq4[16];
    load_iq4_table(iq4);
    const int r = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= (int)p.d) return;  // whole warps
    const u32 t = blockIdx.y;
    float acc = 0.0f;
    for (u32 j = 0; j < p.k_top; ++j) {
        const u32 pair = t * p.k_top + j, e = ((const u32*)p.ids)[pair];
        if (e >= p.n_expert) {
            acc = MOE_NAN;
            continue;
        }
        const u8* row = (const u8*)p.down + ((u64)e * p.d + r) * p.row_bytes_down;
        const float* h = (const float*)p.h + (u64)pair * p.n_ff;
        acc += ((const float*)p.weights)[pair] * warp_dot<TY>(row, p.n_ff, h, iq4);
    }
    if (lane == 0) ((float*)p.out)[(u64)t * p.d + r] = acc;
}

#define MOE_ENTRIES(SUFFIX, TY)                                                               \
    extern "C" __global__ void moe_gate_up_##SUFFIX(const MoeParams p) { moe_gate_up<TY>(p); } \
    extern "C" __global__ void moe_down_##SUFFIX(const MoeParams p) { moe_down<TY>(p); }

MOE_ENTRIES(f32, TY_F32)
MOE_ENTRIES(f16, TY_F16)
MOE_ENTRIES(bf16, TY_BF16)
MOE_ENTRIES(q8_0, TY_Q8_0)
MOE_ENTRIES(q4_k, TY_Q4_K)
MOE_ENTRIES(q5_k, TY_Q5_K)
MOE_ENTRIES(q6_k, TY_Q6_K)
MOE_ENTRIES(iq4_xs, TY_IQ4_XS)
