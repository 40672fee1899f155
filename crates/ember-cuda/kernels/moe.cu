// moe: the routed experts of a MoE layer as two kernels (reference: ember_ops::reference::moe
// with reference::matmul; qwen35moe.md §6.6). The shared expert is a plain matmul + gate.
//   moe_gate_up_<type>: h[t][j] = silu(gate_e · x_t) ⊙ (up_e · x_t), e = ids[t][j], for every
//     token t and routing slot j: one warp per (row, t, j) at a time; only the routed experts are read.
//   moe_down_<type>: out[t] = Σ_j weights[t][j] · (down_e · h[t][j]): one warp per (row, t) at a time
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
    u32 d, n_ff, n_expert, n_tok, k_top, row_bytes_gu, row_bytes_down;
    u32 rows_per_block;  // set per launch (gate/up rows of n_ff, down rows of d)
};

#define MOE_NAN __int_as_float(0x7fffffff)

// Both kernels stage their activations (x_t, or h[t][0..k]) in shared memory once per block and
// give the block's warps rows_per_block rows in turn (the same reason as matmul.cu's GEMV).

// grid (ceil(n_ff / rows_per_block), n_tok · k_top), 256 threads, shared memory d floats.
template <int TY>
__device__ __forceinline__ void moe_gate_up(const MoeParams& p) {
    extern __shared__ float4 xs4[];
    __shared__ float iq4[16];
    const u32 pair = blockIdx.y, t = pair / p.k_top, e = ((const u32*)p.ids)[pair];
    const float4* xg = (const float4*)((const float*)p.x + (u64)t * p.d);
    for (u32 i = threadIdx.x; i < p.d / 4; i += blockDim.x) xs4[i] = xg[i];
    load_iq4_table(iq4);
    const float* xs = (const float*)xs4;
    const int lane = threadIdx.x % 32;
    float* h = (float*)p.h + (u64)pair * p.n_ff;
    const int r_end = min((int)p.n_ff, (int)((blockIdx.x + 1) * p.rows_per_block));
    for (int r = blockIdx.x * p.rows_per_block + threadIdx.x / 32; r < r_end; r += blockDim.x / 32) {
        if (e >= p.n_expert) {
            if (lane == 0) h[r] = MOE_NAN;
            continue;
        }
        const u64 at = ((u64)e * p.n_ff + r) * p.row_bytes_gu;
        const float g = warp_dot<TY>((const u8*)p.gate + at, p.d, xs, iq4);
        const float u = warp_dot<TY>((const u8*)p.up + at, p.d, xs, iq4);
        if (lane == 0) h[r] = silu_f(g) * u;
    }
}

// grid (ceil(d / rows_per_block), n_tok), 256 threads, shared memory k_top · n_ff floats.
template <int TY>
__device__ __forceinline__ void moe_down(const MoeParams& p) {
    extern __shared__ float4 hs4[];
    __shared__ float iq4[16];
    const u32 t = blockIdx.y;
    const float4* hg = (const float4*)((const float*)p.h + (u64)t * p.k_top * p.n_ff);
    for (u32 i = threadIdx.x; i < p.k_top * p.n_ff / 4; i += blockDim.x) hs4[i] = hg[i];
    load_iq4_table(iq4);
    const float* hs = (const float*)hs4;
    const int lane = threadIdx.x % 32;
    const int r_end = min((int)p.d, (int)((blockIdx.x + 1) * p.rows_per_block));
    for (int r = blockIdx.x * p.rows_per_block + threadIdx.x / 32; r < r_end; r += blockDim.x / 32) {
        float acc = 0.0f;
        for (u32 j = 0; j < p.k_top; ++j) {
            const u32 pair = t * p.k_top + j, e = ((const u32*)p.ids)[pair];
            if (e >= p.n_expert) {
                acc = MOE_NAN;
                continue;
            }
            const u8* row = (const u8*)p.down + ((u64)e * p.d + r) * p.row_bytes_down;
            acc += ((const float*)p.weights)[pair] * warp_dot<TY>(row, p.n_ff, hs + j * p.n_ff, iq4);
        }
        if (lane == 0) ((float*)p.out)[(u64)t * p.d + r] = acc;
    }
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
