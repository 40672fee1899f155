// moe_route: one token's MoE prelude in one launch: h ← h + m, f = RMSNorm(h)·w with its int8
// copy, the router's logits and the shared expert's gate scalar from f, and the routing (softmax,
// top-k, renormalised). The same results, bit for bit, as the launches it replaces
// (rms_norm_q8 with its add, matmul_gemv_multi_f32 of the router and the gate row, route): each
// part repeats their arithmetic in their order (the norm's block sum as rms_norm's launch of
// norm_threads threads, each row's dot as the GEMV's ksplit warps, route_regs).
//
// A cluster of MR_BLOCKS blocks (sm_90): block b holds rows b·R .. b·R + R of the router (R =
// rows_per_block), the last block the gate row too, in shared memory, copied before pdl_enter
// (weights: never written by a step's kernels), so the router's 2 MB arrive while the kernel
// ahead runs. After the wait every block reads h and m (the whole row: each needs all of f for
// its dots) and normalises it; each block's logits go into block 0's shared memory; after the
// cluster's barrier block 0 writes h, f and f's int8 copy, and its first warp routes.
// The chain it replaces (docs/perf.md g19, g30): the norm ~3.9 us, the router ~2.8, the route
// ~4.1, three links. Measured on an H100 (g33): the 35B's decode 3.6 % slower than with those
// three launches (likely, not traced: a 1,024-thread block with 149 KB of shared memory cannot sit beside the out
// projection's GEMV blocks, so the router's rows are copied after it, not under it, by 16 SMs):
// off by default (EMBER_MOE_ROUTE=1).

#define MR_BLOCKS 16
#define MR_THREADS 1024

struct MoeRouteParams {
    RmsNormParams r;  // x: h [d], add: m [d], w: the norm's weight, out: f [d]; g = d, n_group 1
    u64 q;            // f's int8 copy (quantize_q8's layout for n = d)
    u64 router;       // [n_expert, d] f32
    u64 gate_inp;     // [d] f32: the shared expert's gate row
    u64 gs;           // [1] f32: its dot with f
    u64 ids;          // [k] u32
    u64 weights;      // [k] f32
    u64 pad0;
    u32 n_expert, k, rows_per_block, norm_threads;
    u32 ks_router, ks_gate;  // the GEMV's warps a row (gemv_ksplit) for each
    float sum_min;
    u32 pad1;
};

#if __CUDA_ARCH__ >= 900
// The GEMV's sum for one part of a row (matmul.cu's gemv<TY_F32> with one token: warp part j of
// ks takes chunks j, j + ks, ..; lane l weights 256c + 8l .. + 8), w and x in shared memory.
__device__ __forceinline__ float mr_dot_part(const float* w, const float* x, u32 d, u32 part, u32 ks, u32 lane) {
    float acc = 0.0f;
    const u32 n_chunk = (d + 255) / 256;
    for (u32 c = part; c < n_chunk; c += ks) {
        const u32 a0 = 256 * c + 8 * lane, a1 = a0 + 4;
        if (a0 >= d) continue;
        const float4 v0 = *(const float4*)(w + a0), v1 = *(const float4*)(w + a1);
        const float4 x0 = *(const float4*)(x + a0), x1 = *(const float4*)(x + a1);
        acc += v0.x * x0.x + v0.y * x0.y + v0.z * x0.z + v0.w * x0.w + v1.x * x1.x + v1.y * x1.y + v1.z * x1.z + v1.w * x1.w;
    }
    return warp_sum(acc);
}
#endif

// A cluster of 16 is past the portable 8: the launcher allows it on the function
// (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED) and asks the driver whether such a cluster
// fits (cuOccupancyMaxActiveClusters) before it uses the kernel. Below sm_90 the kernel is empty
// (never launched there).
#if __CUDA_ARCH__ >= 900
#define MR_CLUSTER __cluster_dims__(MR_BLOCKS, 1, 1)
#else
#define MR_CLUSTER
#endif

// Dynamic shared memory: (R + 1)·d floats of rows, d of f, n_expert of logits, 4·(R + 1) of part
// sums (smem_bytes in src/ops/moe_route.rs).
extern "C" __global__ void MR_CLUSTER __launch_bounds__(MR_THREADS, 1) moe_route(const MoeRouteParams p) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) float sm[];
    __shared__ float scratch[32];
    const RmsNormParams& r = p.r;
    const u32 d = r.g, R = p.rows_per_block, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const u32 rank = cluster_rank();
    float* rows = sm;
    float* xs = rows + (R + 1) * d;
    float* lg = xs + d;
    float* part = lg + p.n_expert;
    const u32 e0 = rank * R;
    const u32 n_rows = e0 < p.n_expert ? min(R, p.n_expert - e0) : 0;
    const bool gate_here = rank == MR_BLOCKS - 1;
    // This block's rows (contiguous in the router) and the gate row, into shared memory.
    const float* src = (const float*)p.router + (u64)e0 * d;
    for (u32 i = tid; i < n_rows * d / 4; i += MR_THREADS) copy16_async(rows + 4 * i, src + 4 * i);
    if (gate_here)
        for (u32 i = tid; i < d / 4; i += MR_THREADS) copy16_async(rows + R * d + 4 * i, (const float*)p.gate_inp + 4 * i);
    // Arrived once the block runs: the wait before the first store into block 0's shared memory
    // then knows every block has started (the rule for another block's shared memory).
    cluster_arrive_relaxed();
    const u32 nthr = p.norm_threads;
    const bool norm_thread = tid < nthr;
    float wv[NORM_REGS];
    norm_regs_w(r, wv, norm_thread ? tid : 0, nthr);
    pdl_enter();

    // h + m and its norm, as norm_regs_group over nthr threads (block_sum of nthr / 32 warps).
    float xv[NORM_REGS];
    const float* h = (const float*)r.x;
    const float* m = (const float*)r.add;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        xv[j] = norm_thread && i < d ? h[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        if (norm_thread && i < d) {
            const float v = xv[j] + m[i];
            xv[j] = v;
            ss += v * v;
        }
    }
    ss = warp_sum(ss);
    if (lane == 0 && warp < nthr / 32) scratch[warp] = ss;
    __syncthreads();
    ss = warp_sum(lane < nthr / 32 ? scratch[lane] : 0.0f);
    const float scale = 1.0f / sqrtf(ss / (float)d + r.eps);
    float fv[NORM_REGS];
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        fv[j] = xv[j] * scale * wv[j];
        if (norm_thread && i < d) xs[i] = fv[j];
    }
    copy_async_wait();
    __syncthreads();

    // The dots: task t is (row slot t / 4, part t % 4); slot R is the gate row.
    for (u32 t = warp; t < 4 * (R + 1); t += MR_THREADS / 32) {
        const u32 s = t / 4, j = t % 4;
        const bool gate = s == R;
        if (gate ? !gate_here : s >= n_rows) continue;
        const u32 ks = gate ? p.ks_gate : p.ks_router;
        if (j >= ks) continue;
        const float v = mr_dot_part(rows + s * d, xs, d, j, ks, lane);
        if (lane == 0) part[4 * s + j] = v;
    }
    __syncthreads();
    // Each row's parts added in part order (the GEMV's), into block 0's logits.
    cluster_wait();
    if (tid < n_rows + (gate_here ? 1 : 0)) {
        const u32 s = tid < n_rows ? tid : R;
        const bool gate = s == R;
        const u32 ks = gate ? p.ks_gate : p.ks_router;
        float v;
        if (ks == 1) {
            v = part[4 * s];
        } else {
            v = 0.0f;
            for (u32 j = 0; j < ks; ++j) v += part[4 * s + j];
        }
        if (gate) *(float*)p.gs = v;
        else st_cluster_f32(lg + e0 + s, 0, v);
    }
    cluster_sync();
    if (rank != 0) return;

    // Block 0: h, f and f's int8 copy (whole warps: d and nthr multiples of 32), then the routing.
    float* ho = (float*)r.x;
    float* fo = (float*)r.out;
#pragma unroll
    for (int j = 0; j < NORM_REGS; ++j) {
        const u32 i = tid + j * nthr;
        if (norm_thread && i < d) {
            ho[i] = xv[j];
            fo[i] = fv[j];
            warp_q8(fv[j], (u8*)p.q, d, i);
        }
    }
    if (warp == 0) {
        RouteParams rp;
        rp.n_tok = 1;
        rp.n_expert = p.n_expert;
        rp.k = p.k;
        rp.sum_min = p.sum_min;
        route_regs(rp, lg, (u32*)p.ids, (float*)p.weights);
    }
#endif
}
