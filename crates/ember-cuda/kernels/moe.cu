// moe: the routed experts of a MoE layer as two kernels (reference: ember_ops::reference::moe
// with reference::matmul; qwen35moe.md §6.6). The shared expert is a plain matmul + gate.
//   moe_gate_up_<type>: h[t][j] = silu(gate_e · x_t) ⊙ (up_e · x_t), e = ids[t][j], for every
//     token t and routing slot j: one warp per (row, t, j) at a time; only the routed experts are read.
//   moe_down_<type>: out[t] = Σ_j weights[t][j] · (down_e · h[t][j]): one warp per (row, t) at a time
//     sums its k experts itself (no atomics). The sum runs in routing order (largest weight
//     first); the reference adds experts in increasing id: the same terms, another order.
// An expert id >= n_expert gives NaN outputs (ids live on the device).
// Partial residency: with `slot_of` set, expert e's rows sit at slot slot_of[e] of the stacked
// tensors (which then hold n_slots experts), and an expert whose slot is MOE_MISS is not on the
// device: its pairs add nothing here (the host computes them and adds its sum). slot_of = 0:
// every expert at its own index.

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
        const u32 s = moe_slot(p, e);
        if (s == MOE_MISS) continue;  // moe_down skips the pair: h is not read
        const u64 at = ((u64)s * p.n_ff + r) * p.row_bytes_gu;
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
            const u32 s = moe_slot(p, e);
            if (s == MOE_MISS) continue;
            const u8* row = (const u8*)p.down + ((u64)s * p.d + r) * p.row_bytes_down;
            acc += ((const float*)p.weights)[pair] * warp_dot<TY>(row, p.n_ff, hs + j * p.n_ff, iq4);
        }
        if (lane == 0) ((float*)p.out)[(u64)t * p.d + r] = acc;
    }
}

#define MOE_ENTRIES(SUFFIX, TY)                                                               \
    extern "C" __global__ void moe_gate_up_##SUFFIX(const MoeParams p) { pdl_enter(); moe_gate_up<TY>(p); } \
    extern "C" __global__ void moe_down_##SUFFIX(const MoeParams p) { pdl_enter(); moe_down<TY>(p); }

MOE_ENTRIES(f32, TY_F32)
MOE_ENTRIES(f16, TY_F16)
MOE_ENTRIES(bf16, TY_BF16)
MOE_ENTRIES(q8_0, TY_Q8_0)
MOE_ENTRIES(q4_k, TY_Q4_K)
MOE_ENTRIES(q5_k, TY_Q5_K)
MOE_ENTRIES(q6_k, TY_Q6_K)
MOE_ENTRIES(iq4_xs, TY_IQ4_XS)

// ---- Decode-sized batches on int8 activations (Precision::Fast; q8.cuh) ----
// The same two kernels with x and h quantised to int8 and each weight block summed with dp4a.
// moe_gate_up_q8: blocks of 32 · seg threads give each of MOE_GU_ROWS = 32 consecutive rows
// (one int8 block of h) seg = wr · L lanes (wr workers of L lanes, Q8Unit; seg at most 32,
// whose seg_sum stays in shuffles: `part` would serve larger ones), summed by seg_sum; warp 0
// then quantises the block's 32 values of h (warp_q8, the layout of
// quantize_q8) into the memory of the f32 h buffer, which moe_down_q8 reads as its int8 input:
// no quantize_q8 launch between the two. moe_down_q8's `wr` workers share a row's k_top·units
// items (expert j = item / units), each weighted by its routing weight before the fixed-order sum.

// The shared expert may ride along (sd != 0): gate/up gets n_tok more blocks in y, which write
// its silu(gate·x) ⊙ up·x after the pairs' h (h[n_tok · k_top · n_ff + t · n_ff_s + r]); down adds
// sigmoid(gs[t]) · (down_s · h_s) to each row's sum. Its weights may be of another int8 type than
// the routed ones (ty_s_*, dispatched at run time); they use the routed layout's `seg` lanes per
// row (seg a multiple of their unit's lanes: the launcher's choice of wr).
struct MoeQ8Params {
    MoeParams m;
    u64 xq;  // quantize_q8 of x ([n_tok, d]) for gate/up, of h (n_hq values, in m.h) for down
    u64 sg, su, sd;  // the shared expert: gate, up [n_ff_s rows of d], down [d rows of n_ff_s]; sd = 0: none
    u64 gs;          // [n_tok] f32: the shared expert's gate logit
    u32 wr;          // workers per row (set per launch)
    u32 n_hq;        // values quantised for down: n_tok · k_top · n_ff (+ n_tok · n_ff_s)
    u32 ty_s_gu, ty_s_down, row_bytes_s_gu, row_bytes_s_down, n_ff_s;
    u32 prefetch;    // 1: down's blocks ask for their experts' rows in L2 before pdl_enter
};

#define MOE_GU_ROWS 32
#define MOE_GU_MAX_SEG 16

// Quantises the block's MOE_GU_ROWS values hv (rows r0.. of h, at h index `at`) to int8 into
// the h buffer (values at `at`, (d, d·Σq) at n_hq + at / 32 float2s). Every thread calls it.
__device__ __forceinline__ void moe_gu_quantize(const MoeQ8Params& q, const float* hv, u64 at) {
    __syncthreads();  // hv complete
    if (threadIdx.x < 32) warp_q8(hv[threadIdx.x], (u8*)q.m.h, q.n_hq, at + threadIdx.x);
}

// Shared expert, gate and up, of token t: rows of this block at `seg` lanes per row.
template <int TS>
__device__ __forceinline__ void moe_shared_gate_up_ty(const MoeQ8Params& q, u32 t, int seg, float* part, float* hv) {
    using U = Q8Unit<TS>;
    const MoeParams& p = q.m;
    const int tid = threadIdx.x, wr = seg / U::L;
    const int r = blockIdx.x * MOE_GU_ROWS + tid / seg, wk = (tid % seg) / U::L, l = tid % U::L;
    const bool valid = r < (int)q.n_ff_s;
    float g = 0.0f, u = 0.0f;
    if (valid) {
        const u64 at = (u64)r * q.row_bytes_s_gu;
        const i8* xq = (const i8*)q.xq + (u64)t * p.d;
        const float2* xd = (const float2*)((const i8*)q.xq + (u64)p.n_tok * p.d) + (u64)t * (p.d / 32);
        const int n_units = p.d / U::W;
#pragma unroll 2
        for (int c = wk; c < n_units; c += wr) {
            g += U::dot((const u8*)q.sg + at, n_units, c, l, xq, xd);
            u += U::dot((const u8*)q.su + at, n_units, c, l, xq, xd);
        }
    }
    g = seg_sum(g, seg, part);
    u = seg_sum(u, seg, part);
    if (tid % seg == 0) hv[tid / seg] = valid ? silu_f(g) * u : 0.0f;
}

// The shared expert's rows blockIdx.x · MOE_GU_ROWS.. of token t into hv (of its gate/up type).
__device__ __forceinline__ void moe_shared_gate_up_hv(const MoeQ8Params& q, u32 t, int seg, float* part, float* hv) {
    switch (q.ty_s_gu) {
        case TY_Q4_K: moe_shared_gate_up_ty<TY_Q4_K>(q, t, seg, part, hv); break;
        case TY_Q6_K: moe_shared_gate_up_ty<TY_Q6_K>(q, t, seg, part, hv); break;
        case TY_Q8_0: moe_shared_gate_up_ty<TY_Q8_0>(q, t, seg, part, hv); break;
    }
}

// The shared expert's blocks: rows blockIdx.x · MOE_GU_ROWS.. of token t (blocks past n_ff_s
// write nothing; n_ff_s is a multiple of 32).
__device__ __forceinline__ void moe_shared_gate_up(const MoeQ8Params& q, u32 t, int seg, float* part, float* hv) {
    moe_shared_gate_up_hv(q, t, seg, part, hv);
    const u32 r0 = blockIdx.x * MOE_GU_ROWS;
    if (r0 < q.n_ff_s) moe_gu_quantize(q, hv, (u64)q.m.n_tok * q.m.k_top * q.m.n_ff + (u64)t * q.n_ff_s + r0);
}

// This lane's part of the shared expert's down row r for token t (unweighted).
template <int TS>
__device__ __forceinline__ float moe_shared_down_ty(const MoeQ8Params& q, u32 t, int r, int seg) {
    using U = Q8Unit<TS>;
    const MoeParams& p = q.m;
    const int tid = threadIdx.x, wr = seg / U::L, wk = (tid % seg) / U::L, l = tid % U::L;
    const u64 at = (u64)p.n_tok * p.k_top * p.n_ff + (u64)t * q.n_ff_s;
    const u8* row = (const u8*)q.sd + (u64)r * q.row_bytes_s_down;
    const i8* xq = (const i8*)q.xq + at;
    const float2* xd = (const float2*)((const i8*)q.xq + q.n_hq) + at / 32;
    float acc = 0.0f;
    const int n_units = q.n_ff_s / U::W;
    for (int c = wk; c < n_units; c += wr) acc += U::dot(row, n_units, c, l, xq, xd);
    return acc;
}

__device__ __forceinline__ float moe_shared_down(const MoeQ8Params& q, u32 t, int r, int seg) {
    switch (q.ty_s_down) {
        case TY_Q4_K: return moe_shared_down_ty<TY_Q4_K>(q, t, r, seg);
        case TY_Q6_K: return moe_shared_down_ty<TY_Q6_K>(q, t, r, seg);
        case TY_Q8_0: return moe_shared_down_ty<TY_Q8_0>(q, t, r, seg);
    }
    return MOE_NAN;
}

// Routed pair `pair` (expert e) of a one-token or few-token gate/up: this block's rows
// blockIdx.x · MOE_GU_ROWS.. into hv (NaN for an id out of range, 0 for a row past n_ff or an
// expert not here), `seg` lanes a row.
template <int TY, class U>
__device__ __forceinline__ void moe_gate_up_pair_hv(const MoeQ8Params& q, u32 pair, u32 e, int seg, float* part, float* hv) {
    const MoeParams& p = q.m;
    const int tid = threadIdx.x, wr = seg / U::L;
    const u32 t = pair / p.k_top;
    const int r = blockIdx.x * MOE_GU_ROWS + tid / seg, wk = (tid % seg) / U::L, l = tid % U::L;
    const bool valid = r < (int)p.n_ff;
    const u32 s = e < p.n_expert ? moe_slot(p, e) : MOE_MISS;
    float g = 0.0f, u = 0.0f;
    if (valid && s != MOE_MISS) {
        const u64 at = ((u64)s * p.n_ff + r) * p.row_bytes_gu;
        const i8* xq = (const i8*)q.xq + (u64)t * p.d;
        const float2* xd = (const float2*)((const i8*)q.xq + (u64)p.n_tok * p.d) + (u64)t * (p.d / 32);
        const int n_units = p.d / U::W;
#pragma unroll 2
        for (int c = wk; c < n_units; c += wr) {
            g += U::dot((const u8*)p.gate + at, n_units, c, l, xq, xd);
            u += U::dot((const u8*)p.up + at, n_units, c, l, xq, xd);
        }
    }
    g = seg_sum(g, seg, part);
    u = seg_sum(u, seg, part);
    // A pair not here: moe_down_q8 skips it (its h is zeros); an id out of range: NaN, which
    // moe_down_q8 also flags from the id.
    if (tid % seg == 0) hv[tid / seg] = e >= p.n_expert ? MOE_NAN : (valid && s != MOE_MISS ? silu_f(g) * u : 0.0f);
}

// grid (ceil(max(n_ff, n_ff_s) / MOE_GU_ROWS), n_tok · k_top (+ n_tok with the shared
// expert)), MOE_GU_ROWS · wr · L threads.
template <int TY, class U = Q8Unit<TY>>
__device__ __forceinline__ void moe_gate_up_q8(const MoeQ8Params& q) {
    const MoeParams& p = q.m;
    __shared__ float part[MOE_GU_MAX_SEG];
    __shared__ float hv[MOE_GU_ROWS];
    const int tid = threadIdx.x, wr = q.wr, seg = wr * U::L;
    if (blockIdx.y >= p.n_tok * p.k_top) {  // the shared expert's blocks (block-uniform)
        const u32 r0 = blockIdx.x * MOE_GU_ROWS;
        if (tid < 2 && r0 < q.n_ff_s) {  // its weights: never written by a step's kernels
            const u32 rb = q.row_bytes_s_gu, nr = min((u32)MOE_GU_ROWS, q.n_ff_s - r0);
            prefetch_l2((const u8*)(tid ? q.su : q.sg) + (u64)r0 * rb, (u64)nr * rb);
        }
        pdl_enter();
        moe_shared_gate_up(q, blockIdx.y - p.n_tok * p.k_top, seg, part, hv);
        return;
    }
    pdl_enter();
    const u32 pair = blockIdx.y, e = ((const u32*)p.ids)[pair];
    moe_gate_up_pair_hv<TY, U>(q, pair, e, seg, part, hv);
    const u32 r0 = blockIdx.x * MOE_GU_ROWS;
    if (r0 < p.n_ff) moe_gu_quantize(q, hv, (u64)pair * p.n_ff + r0);
}

// grid (ceil(d / rows), n_tok), Q8_THREADS threads, rows = Q8_THREADS / (wr · L). With
// `prefetch`, threads j < k_top ask for expert j's rows of this block (and thread k_top for the
// shared expert's) before pdl_enter: the ids come from the route kernel, at least two launches
// back (gate/up runs between), so they are complete (see prefetch_l2).
template <int TY, class U = Q8Unit<TY>>
__device__ __forceinline__ void moe_down_q8(const MoeQ8Params& q) {
    const MoeParams& p = q.m;
    __shared__ float part[Q8_THREADS / 32];
    const u32 t = blockIdx.y;
    const int tid = threadIdx.x, wr = q.wr, seg = wr * U::L;
    const int r = blockIdx.x * (Q8_THREADS / seg) + tid / seg, wk = (tid % seg) / U::L, l = tid % U::L;
    if (q.prefetch && tid <= (int)p.k_top) {
        const u32 r0 = blockIdx.x * (Q8_THREADS / seg), nr = min((u32)(Q8_THREADS / seg), p.d - min(r0, p.d));
        if (tid < (int)p.k_top) {
            const u32 e = ((const u32*)p.ids)[t * p.k_top + tid];
            const u32 s = e < p.n_expert ? moe_slot(p, e) : MOE_MISS;
            if (s != MOE_MISS) prefetch_l2((const u8*)p.down + ((u64)s * p.d + r0) * p.row_bytes_down, (u64)nr * p.row_bytes_down);
        } else if (q.sd) {
            prefetch_l2((const u8*)q.sd + (u64)r0 * q.row_bytes_s_down, (u64)nr * q.row_bytes_s_down);
        }
    }
    pdl_enter();
    const bool valid = r < (int)p.d;
    const int n_units = p.n_ff / U::W, items = p.k_top * n_units;
    float acc = 0.0f;
    bool nan = false;
    if (valid) {
        for (int it = wk; it < items; it += wr) {
            const int j = it / n_units, c = it - j * n_units;
            const u32 pair = t * p.k_top + j, e = ((const u32*)p.ids)[pair];
            if (e >= p.n_expert) {
                nan = true;
                continue;
            }
            const u32 s = moe_slot(p, e);
            if (s == MOE_MISS) continue;
            const u8* row = (const u8*)p.down + ((u64)s * p.d + r) * p.row_bytes_down;
            const i8* xq = (const i8*)q.xq + (u64)pair * p.n_ff;
            const float2* xd = (const float2*)((const i8*)q.xq + q.n_hq) + (u64)pair * (p.n_ff / 32);
            acc += ((const float*)p.weights)[pair] * U::dot(row, n_units, c, l, xq, xd);
        }
        if (q.sd) acc += sigmoid_f(((const float*)q.gs)[t]) * moe_shared_down(q, t, r, seg);
    }
    acc = seg_sum(nan ? MOE_NAN : acc, seg, part);
    if (valid && tid % seg == 0) ((float*)p.out)[(u64)t * p.d + r] = acc;
}

// (Both call pdl_enter themselves, after their prefetches.) Gate/up at most 64 registers (its
// blocks of up to 1,024 threads; at 512, two an SM: a 35B decode step's 144 blocks in one wave).
#define MOE_Q8_ENTRIES(SUFFIX, TY)                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) moe_gate_up_q8_##SUFFIX(const MoeQ8Params q) { moe_gate_up_q8<TY>(q); } \
    extern "C" __global__ void moe_down_q8_##SUFFIX(const MoeQ8Params q) { moe_down_q8<TY>(q); }

MOE_Q8_ENTRIES(q4_k, TY_Q4_K)
MOE_Q8_ENTRIES(q6_k, TY_Q6_K)
MOE_Q8_ENTRIES(q8_0, TY_Q8_0)
// Q4_K gate/up at 4 lanes a unit (Q8UnitQ4KWide; the shared expert keeps its own unit, so the
// launcher's seg stays a multiple of 8). At most 512 threads and 64 registers (2 blocks of 512
// an SM: the 144 blocks of a 35B decode step in one wave on 132 SMs; sm_90 spills 8 bytes for it,
// g30's measured form).
extern "C" __global__ void __launch_bounds__(512, 2) moe_gate_up_q8w_q4_k(const MoeQ8Params q) { moe_gate_up_q8<TY_Q4_K, Q8UnitQ4KWide>(q); }
// Q6_K down at 4 lanes a unit (Q8UnitQ6KWide; the shared expert keeps its own unit: seg a
// multiple of 8, the launcher's choice).
extern "C" __global__ void moe_down_q8w_q6_k(const MoeQ8Params q) { moe_down_q8<TY_Q6_K, Q8UnitQ6KWide>(q); }

// ---- One token's MoE in one launch: an expert's gate/up and down in one cluster (sm_90+) ----
// moe_fused_q8_<down type>: a cluster of MF_CLUSTER blocks an expert (grid (MF_CLUSTER, k_top + 1):
// the k routed pairs, then the shared expert), n_ff = MF_CLUSTER · MOE_GU_ROWS. Block b of a
// cluster does what gate/up's block b does (rows 32b.. of h, Q4_K at 4 lanes a unit, the same
// sums: moe_gate_up_pair_hv, moe_shared_gate_up_hv) and quantises them (warp_q8) into its own
// shared memory, not into global h; after the cluster's barrier it gathers the other blocks' 31
// int8 blocks of h from their shared memory, so each block holds the expert's whole h, and runs
// its d / MF_CLUSTER rows of the expert's down against it, from shared memory: the block copies
// those rows there (cp.async) as soon as it knows the expert, under its gate/up. Its rows'
// weighted sums (routing weight, or sigmoid of the shared gate logit) go to parts[pair], one row
// of d an expert; the norm after the MoE adds the k + 1 rows in order (rms_norm's n_add). One
// link of the decode chain where gate/up and down made two, and down's weights are in shared
// memory when its dots start. Each expert's down row is one seg_sum of its lanes times its weight:
// not moe_down_q8's grouping (which weights each unit and sums the experts in the lanes).
// With `logits` set, the routing runs here too, where the route kernel ran before: warp 0 of every
// routed block runs route_regs on the router's logits (the route kernel's code: the same ids and
// weights), the block takes its pair's expert and weight, and block 0 of each routed cluster
// writes its pair's id and weight to q.m.ids, q.m.weights (what the route kernel leaves there).
struct MoeFusedParams {
    MoeQ8Params q;   // q.xq: x's int8 copy; the shared expert (sg, su, sd, gs) is required
    u64 parts;       // [k_top + 1, d] f32
    u32 down_rows;   // rows of down a block: d / MF_CLUSTER, a multiple of MF_THREADS / MF_SEG
    u32 act_bytes;   // shared memory before the down rows: n_ff int8 and n_ff / 32 float2s, to 16 bytes
    u64 logits;      // [n_expert] f32: the router's logits to route here (n_expert <= 32 · ROUTE_PER_LANE), or 0
    float sum_min;   // the route's clamp of the chosen probabilities' sum (ROUTE_SUM_MIN)
    u32 pad;
};

#define MF_MAX_K 32  // routed pairs a routing here may hold (route_regs' weights in shared memory)

#define MF_CLUSTER 16
#define MF_SEG 16  // lanes a row, gate/up (4 workers of 4) and down
#define MF_THREADS (MOE_GU_ROWS * MF_SEG)

// Rows [0, n_rows) of a down slice in shared memory (`rb` bytes a row, k = n_ff) against the
// expert's int8 h (act: n_ff values, then their float2 scales), weighted, into out[0, n_rows).
template <class U>
__device__ __forceinline__ void mf_down(const u8* rows, u32 rb, u32 n_rows, const u8* act, u32 n_ff, float w, float* out) {
    constexpr int WR = MF_SEG / U::L;
    const int tid = threadIdx.x, wk = (tid % MF_SEG) / U::L, l = tid % U::L;
    const int n_units = n_ff / U::W;
    const i8* xq = (const i8*)act;
    const float2* xd = (const float2*)(act + n_ff);
    for (u32 r = tid / MF_SEG; r < n_rows; r += MF_THREADS / MF_SEG) {
        float acc = 0.0f;
        for (int c = wk; c < n_units; c += WR) acc += U::dot(rows + (u64)r * rb, n_units, c, l, xq, xd);
        acc = seg_sum(acc, MF_SEG, nullptr);  // seg <= 32: shuffles only
        if (tid % MF_SEG == 0) out[r] = w * acc;
    }
}

template <class UD>
__device__ __forceinline__ void moe_fused_q8(const MoeFusedParams& f) {
#if __CUDA_ARCH__ >= 900
    const MoeQ8Params& q = f.q;
    const MoeParams& p = q.m;
    extern __shared__ __align__(16) u8 mf_sm[];
    __shared__ float part[MOE_GU_MAX_SEG];
    __shared__ float hv[MOE_GU_ROWS];
    u8* act = mf_sm;
    u8* rows = mf_sm + f.act_bytes;
    const u32 tid = threadIdx.x, rank = blockIdx.x;  // the cluster spans x: its rank is blockIdx.x
    const u32 r0 = rank * f.down_rows;
    const bool shared = blockIdx.y >= p.k_top;  // block-uniform; no thread leaves early (the barriers)
    auto stage = [&](const u8* src, u32 n) {
        for (u32 i = 16 * tid; i < n; i += 16 * MF_THREADS) copy16_async(rows + i, src + i);
    };
    float w;
    bool nan = false;
    if (shared) {
        // Its weights are never written by a step's kernels: asked for before the wait.
        if (tid < 2) {
            const u32 rb = q.row_bytes_s_gu;
            prefetch_l2((const u8*)(tid ? q.su : q.sg) + (u64)rank * MOE_GU_ROWS * rb, (u64)MOE_GU_ROWS * rb);
        }
        stage((const u8*)q.sd + (u64)r0 * q.row_bytes_s_down, f.down_rows * q.row_bytes_s_down);
        pdl_enter();
        moe_shared_gate_up_hv(q, 0, MF_SEG, part, hv);
        w = sigmoid_f(((const float*)q.gs)[0]);
    } else {
        pdl_enter();
        const u32 pair = blockIdx.y;
        u32 e;
        if (f.logits) {
            __shared__ u32 r_ids[MF_MAX_K];
            __shared__ float r_w[MF_MAX_K];
            if (tid < 32) {
                RouteParams rp;
                rp.n_tok = 1;
                rp.n_expert = p.n_expert;
                rp.k = p.k_top;
                rp.sum_min = f.sum_min;
                route_regs(rp, (const float*)f.logits, r_ids, r_w);
            }
            __syncthreads();
            e = r_ids[pair];
            if (rank == 0 && tid == 0) {
                ((u32*)p.ids)[pair] = e;
                ((float*)p.weights)[pair] = r_w[pair];
            }
            w = r_w[pair];
        } else {
            e = ((const u32*)p.ids)[pair];
        }
        nan = e >= p.n_expert;
        if (!nan) stage((const u8*)p.down + ((u64)e * p.d + r0) * p.row_bytes_down, f.down_rows * p.row_bytes_down);
        moe_gate_up_pair_hv<TY_Q4_K, Q8UnitQ4KWide>(q, pair, e, MF_SEG, part, hv);
        if (!f.logits) w = ((const float*)p.weights)[pair];
    }
    __syncthreads();  // hv complete
    // Warp 0 writes the block's int8 block of h and arrives with release (on sm_90 a GPU-scope
    // fence: one warp's, not the block's); the others have written nothing the cluster reads.
    if (tid < 32) {
        warp_q8(hv[tid], act, p.n_ff, rank * MOE_GU_ROWS + tid);
        cluster_arrive();
    } else {
        cluster_arrive_relaxed();
    }
    cluster_wait();  // every block's int8 block of h is in its shared memory (and every block runs)
    // The other blocks' int8 blocks: 8 words of values and 2 of (d, d·Σq) each.
    if (tid < 10 * MF_CLUSTER) {
        const u32 src = tid / 10, wd = tid % 10;
        if (src != rank) {
            u32* a = wd < 8 ? (u32*)(act + 32 * src) + wd : (u32*)(act + p.n_ff + 8 * src) + (wd - 8);
            *a = ld_cluster_u32(a, src);
        }
    }
    cluster_arrive_relaxed();  // done with the others' shared memory (each load's value is stored)
    copy_async_wait();
    __syncthreads();  // h whole, the down rows in place
    float* out = (float*)f.parts + (u64)blockIdx.y * p.d + r0;
    if (nan) {
        for (u32 r = tid; r < f.down_rows; r += MF_THREADS) out[r] = MOE_NAN;
    } else if (!shared) {
        mf_down<UD>(rows, p.row_bytes_down, f.down_rows, act, p.n_ff, w, out);
    } else {
        switch (q.ty_s_down) {
            case TY_Q4_K: mf_down<Q8Unit<TY_Q4_K>>(rows, q.row_bytes_s_down, f.down_rows, act, p.n_ff, w, out); break;
            case TY_Q6_K: mf_down<Q8Unit<TY_Q6_K>>(rows, q.row_bytes_s_down, f.down_rows, act, p.n_ff, w, out); break;
            case TY_Q8_0: mf_down<Q8Unit<TY_Q8_0>>(rows, q.row_bytes_s_down, f.down_rows, act, p.n_ff, w, out); break;
        }
    }
    cluster_wait();  // the others are done with this block's shared memory before it leaves
#endif
}

#if __CUDA_ARCH__ >= 900
#define MF_CLUSTER_DIMS __cluster_dims__(MF_CLUSTER, 1, 1)
#else
#define MF_CLUSTER_DIMS
#endif
// 512 threads and 64 registers, as moe_gate_up_q8w_q4_k (two blocks an SM); a cluster of 16 is
// past the portable 8 (the launcher allows it and asks the driver whether it fits).
extern "C" __global__ void MF_CLUSTER_DIMS __launch_bounds__(MF_THREADS, 2) moe_fused_q8_q4_k(const MoeFusedParams f) {
    moe_fused_q8<Q8Unit<TY_Q4_K>>(f);
}
extern "C" __global__ void MF_CLUSTER_DIMS __launch_bounds__(MF_THREADS, 2) moe_fused_q8_q6_k(const MoeFusedParams f) {
    moe_fused_q8<Q8Unit<TY_Q6_K>>(f);
}

// ---- Prompt batches on tensor cores (Precision::Fast, sm_80+), grouped by expert ----
// moe_plan lists the (token, slot) pairs of each expert and cuts each list into tiles of
// MOE_BM pairs; moe_mma_gate_up_fused_<type> and moe_mma_down_<type> then run one tensor-core tile
// (mma.cuh) per (tile, 128 rows), so an expert's rows are read once per tile of its tokens, not
// once per token; moe_combine sums each token's k weighted expert outputs in slot order. All on
// the device: the launches are sized for the most tiles there can be, and blocks past the
// plan's tile count leave at once. Where a pair lands in its expert's list (atomics) does not
// change any result: each output is one row of x against one weight row.
//
// The plan (u32 words): [0] the tile count, then per tile (the expert's slot, first list entry,
// pairs), then the list of pair indices (t · k_top + j) grouped by expert. Pairs of experts not
// resident (slot MOE_MISS) are left out; moe_combine adds nothing for them.

struct MoePlanParams {
    u64 ids;      // [n_pairs] u32
    u64 plan;     // u32 words, see above
    u64 slot_of;  // as in MoeParams
    u32 n_pairs, n_expert, max_tiles, pad;
};

__device__ __forceinline__ bool moe_plan_takes(const MoePlanParams& p, u32 e) {
    return e < p.n_expert && (!p.slot_of || ((const u32*)p.slot_of)[e] != MOE_MISS);
}

// One block of 1024 threads; shared memory 2 · n_expert words.
extern "C" __global__ void moe_plan(const MoePlanParams p) {
    pdl_enter();
    extern __shared__ u32 cnt[];
    u32* cur = cnt + p.n_expert;
    u32* plan = (u32*)p.plan;
    u32* list = plan + 1 + 3 * p.max_tiles;
    const u32* ids = (const u32*)p.ids;
    for (u32 e = threadIdx.x; e < p.n_expert; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (u32 q = threadIdx.x; q < p.n_pairs; q += blockDim.x) {
        const u32 e = ids[q];
        if (moe_plan_takes(p, e)) atomicAdd(&cnt[e], 1u);
    }
    __syncthreads();
    // Thread i takes experts [i·per, (i + 1)·per): its pairs and tiles, an exclusive scan of
    // both over the block (warp shuffles, then the warps' totals), then it writes its experts'
    // tiles and list starts: the plan one thread walking every expert in order would write (it
    // took ~33 us a call on the H100, a serial loop over 256 experts).
    __shared__ u32 warp_pairs[32], warp_tiles[32];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warp = blockDim.x / 32;
    const u32 per = (p.n_expert + blockDim.x - 1) / blockDim.x;
    const u32 e0 = min(threadIdx.x * per, p.n_expert), e1 = min(e0 + per, p.n_expert);
    u32 my_pairs = 0, my_tiles = 0;
    for (u32 e = e0; e < e1; ++e) {
        my_pairs += cnt[e];
        my_tiles += (cnt[e] + MOE_BM - 1) / MOE_BM;
    }
    u32 ip = my_pairs, it = my_tiles;  // inclusive sums over the warp's lanes
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 a = __shfl_up_sync(0xffffffffu, ip, o), b = __shfl_up_sync(0xffffffffu, it, o);
        if (lane >= o) ip += a, it += b;
    }
    if (lane == 31) warp_pairs[warp] = ip, warp_tiles[warp] = it;
    __syncthreads();
    if (warp == 0) {
        u32 a = lane < n_warp ? warp_pairs[lane] : 0, b = lane < n_warp ? warp_tiles[lane] : 0;
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            const u32 x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
            if (lane >= o) a += x, b += y;
        }
        warp_pairs[lane] = a, warp_tiles[lane] = b;  // inclusive over the warps
    }
    __syncthreads();
    u32 at = (warp ? warp_pairs[warp - 1] : 0) + ip - my_pairs, nt = (warp ? warp_tiles[warp - 1] : 0) + it - my_tiles;
    for (u32 e = e0; e < e1; ++e) {
        const u32 slot = p.slot_of ? ((const u32*)p.slot_of)[e] : e;
        for (u32 s = 0; s < cnt[e]; s += MOE_BM) {
            plan[1 + 3 * nt] = slot;
            plan[2 + 3 * nt] = at + s;
            plan[3 + 3 * nt] = min((u32)MOE_BM, cnt[e] - s);
            ++nt;
        }
        cur[e] = at;
        at += cnt[e];
    }
    if (threadIdx.x == blockDim.x - 1) plan[0] = nt;
    __syncthreads();
    for (u32 q = threadIdx.x; q < p.n_pairs; q += blockDim.x) {
        const u32 e = ids[q];
        if (moe_plan_takes(p, e)) list[atomicAdd(&cur[e], 1u)] = q;
    }
}

// grid (ceil(n_ff / MMA_BN), max_tiles), MMA_THREADS threads: h[pair] = silu(gate_e · x_t) ⊙
// up_e · x_t, gate and up in one pass over k (mma_tiles with NW = 2): each step's activations are
// gathered, converted and stored once for both matrices (at 32 pairs a tile the activations are
// more bytes a step than the weights), and each barrier covers twice the tensor-core work.
// Shared memory 46 KB (four weight tiles), so half the blocks an SM holds. (One pass each, as
// mma_tile twice, was 2.4 % slower in pp512 and pp2048 on the H100:
// bench/results/20261205-1750-h100-moe-int8/, and is gone.)
template <int TY>
__device__ __forceinline__ void moe_mma_gate_up_fused(const MoeMmaParams& q) {
#if __CUDA_ARCH__ >= 800
    const MoeParams& p = q.m;
    __shared__ __align__(16) u16 ws[2 * 2 * MMA_BN * MMA_LD];
    __shared__ __align__(16) u16 xs[2 * MOE_BM * MMA_LD];
    __shared__ const float* xrow[MOE_BM];
    __shared__ u32 pair[MOE_BM];
    __shared__ float iq4[16];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) {
        pair[m] = m < n ? list[first + m] : 0;
        xrow[m] = m < n ? (const float*)p.x + (u64)(pair[m] / p.k_top) * p.d : nullptr;
    }
    load_iq4_table(iq4);
    const int r0 = blockIdx.x * MMA_BN, n_w = min(MMA_BN, (int)p.n_ff - r0);
    const u64 at = ((u64)e * p.n_ff + r0) * p.row_bytes_gu;
    const MmaIn in[2] = {{(const u8*)p.gate + at, p.row_bytes_gu, n_w, (int)p.d}, {(const u8*)p.up + at, p.row_bytes_gu, n_w, (int)p.d}};
    float gu[2][1][4][4];
    mma_tiles<TY, 1, 2>(in, xrow, iq4, ws, xs, gu);
    float* h = (float*)p.h;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int m = mma_out_token<1>(0, c), r = mma_out_row(j, c);
            if (m < (int)n && r < n_w) h[(u64)pair[m] * p.n_ff + r0 + r] = silu_f(gu[0][0][j][c]) * gu[1][0][j][c];
        }
#endif
}

// grid (ceil(d / MMA_BN), max_tiles), MMA_THREADS threads: part[pair] = w_pair · down_e · h[pair].
template <int TY>
__device__ __forceinline__ void moe_mma_down(const MoeMmaParams& q) {
#if __CUDA_ARCH__ >= 800
    const MoeParams& p = q.m;
    __shared__ __align__(16) u16 ws[2 * MMA_BN * MMA_LD];
    __shared__ __align__(16) u16 xs[2 * MOE_BM * MMA_LD];
    __shared__ const float* xrow[MOE_BM];
    __shared__ u32 pair[MOE_BM];
    __shared__ float iq4[16];
    MoeTile tl;
    if (!moe_tile(q, tl)) return;  // the whole block
    const u32 e = tl.e /* the slot */, first = tl.first, n = tl.n;
    const u32* list = tl.list;
    for (u32 m = threadIdx.x; m < MOE_BM; m += blockDim.x) {
        pair[m] = m < n ? list[first + m] : 0;
        xrow[m] = m < n ? (const float*)p.h + (u64)pair[m] * p.n_ff : nullptr;
    }
    load_iq4_table(iq4);
    const int r0 = blockIdx.x * MMA_BN, n_w = min(MMA_BN, (int)p.d - r0);
    const u64 at = ((u64)e * p.d + r0) * p.row_bytes_down;
    float acc[1][4][4];
    mma_tile<TY, 1>({(const u8*)p.down + at, p.row_bytes_down, n_w, (int)p.n_ff}, xrow, iq4, ws, xs, acc);
    float* part = (float*)q.part;
    const float* wt = (const float*)p.weights;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int m = mma_out_token<1>(0, c), r = mma_out_row(j, c);
            if (m < (int)n && r < n_w) part[(u64)pair[m] * p.d + r0 + r] = wt[pair[m]] * acc[0][j][c];
        }
#endif
}

// grid ceil(n_tok · d / 256), 256 threads: out[t][i] = Σ_j part[t·k + j][i] in slot order (NaN
// for an expert id out of range; nothing for an expert not resident).
extern "C" __global__ void moe_combine(const MoeMmaParams q) {
    pdl_enter();
    const MoeParams& p = q.m;
    const u64 at = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (at >= (u64)p.n_tok * p.d) return;
    const u64 t = at / p.d, i = at % p.d;
    float s = 0.0f;
    for (u32 j = 0; j < p.k_top; ++j) {
        const u64 pr = t * p.k_top + j;
        const u32 e = ((const u32*)p.ids)[pr];
        if (e >= p.n_expert) s += MOE_NAN;
        else if (moe_slot(p, e) != MOE_MISS) s += ((const float*)q.part)[pr * p.d + i];
    }
    ((float*)p.out)[at] = s;
}

#define MOE_MMA_ENTRIES(SUFFIX, TY)                                                                          \
    extern "C" __global__ void moe_mma_gate_up_fused_##SUFFIX(const MoeMmaParams q) { pdl_enter(); moe_mma_gate_up_fused<TY>(q); } \
    extern "C" __global__ void moe_mma_down_##SUFFIX(const MoeMmaParams q) { pdl_enter(); moe_mma_down<TY>(q); }

MOE_MMA_ENTRIES(f32, TY_F32)
MOE_MMA_ENTRIES(f16, TY_F16)
MOE_MMA_ENTRIES(bf16, TY_BF16)
MOE_MMA_ENTRIES(q8_0, TY_Q8_0)
MOE_MMA_ENTRIES(q4_k, TY_Q4_K)
MOE_MMA_ENTRIES(q5_k, TY_Q5_K)
MOE_MMA_ENTRIES(q6_k, TY_Q6_K)
MOE_MMA_ENTRIES(iq4_xs, TY_IQ4_XS)
