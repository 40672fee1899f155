// delta_rule_recurrent: the gated delta rule token by token (qwen35moe.md §6.4 step 8;
// arXiv:2412.06464). Reference: ember_ops::reference::delta_rule_recurrent.
// Per value head h (key head h % n_k_head), state stored transposed like the CPU's:
// st[h][jv][i] = S[i][jv], so value index jv's column of S is one contiguous d_k row.
//   S ← e^g S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ q.
// One warp per column (h, jv), the column in registers (d_k / 32 values per lane): one read and
// one write of the state per call, whatever n_tok (shared/GPU.md §3).
//   delta_rule_recurrent: one sequence, its state at `state`.
//   delta_rule_seqs: every sequence of a step in one launch; sequence s has rows
//     row0[s]..row0[s] + n[s] and its state in slot slot[s] of the store's DeltaNet buffer
//     (state + slot · slot_stride + offset). Only sequences of fewer than scan_below tokens:
//     delta_chunked.cu takes the others.

#define DELTA_MAX_PER_LANE 8  // d_k <= 256

struct DeltaRuleParams {
    u64 q;      // [n_tok, nk·dk] f32
    u64 k;      // [n_tok, nk·dk] f32
    u64 v;      // [n_tok, nv·dv] f32
    u64 g;      // [n_tok, nv] f32 (log decay, <= 0)
    u64 beta;   // [n_tok, nv] f32
    u64 state;  // [nv, dv, dk] f32, updated in place
    u64 out;    // [n_tok, nv·dv] f32
    u32 n_tok, n_k_head, d_k, n_v_head, d_v, pad;
};

struct DeltaSeqsParams {
    u64 q, k, v, g, beta;  // as above, n_rows rows
    u64 state;             // the store's DeltaNet buffer, updated in place
    u64 out;               // [n_rows, nv·dv] f32
    u64 row0;              // [n_seq] u32
    u64 n;                 // [n_seq] u32
    u64 slot;              // [n_seq] u32
    u64 slot_stride, offset;  // floats
    u32 n_k_head, d_k, n_v_head, d_v, n_slots, scan_below;
};

// Column `col` (value head h, index jv) over rows t0..t1, the column `st` in registers.
__device__ __forceinline__ void delta_column(const float* qp, const float* kp, const float* vp, const float* gp, const float* bp, float* st,
                                             float* outp, u32 t0, u32 t1, u32 nk, u32 dk, u32 nv, u32 dv, u32 col, int lane) {
    const u32 h = col / dv, kh = h % nk;
    const u32 n_per = dk / 32, nkdk = nk * dk;
    float s[DELTA_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) s[i] = i < (int)n_per ? st[32 * i + lane] : 0.0f;
    for (u32 t = t0; t < t1; ++t) {
        const float* q = qp + (u64)t * nkdk + kh * dk;
        const float* k = kp + (u64)t * nkdk + kh * dk;
        const float decay = expf(gp[(u64)t * nv + h]);
        const float b = bp[(u64)t * nv + h];
        float kv[DELTA_MAX_PER_LANE], qv[DELTA_MAX_PER_LANE];
        float sk = 0.0f;
#pragma unroll
        for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
            if (i < (int)n_per) {
                kv[i] = k[32 * i + lane];
                qv[i] = q[32 * i + lane];
                s[i] *= decay;
                sk += s[i] * kv[i];
            }
        }
        sk = warp_sum(sk);
        const float delta = b * (vp[(u64)t * nv * dv + col] - sk);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
            if (i < (int)n_per) {
                s[i] += kv[i] * delta;
                o += s[i] * qv[i];
            }
        }
        o = warp_sum(o);
        if (lane == 0) outp[(u64)t * nv * dv + col] = o;
    }
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i)
        if (i < (int)n_per) st[32 * i + lane] = s[i];
}

// blockDim 128 (4 columns per block); grid ceil(nv·dv / 4). d_k % 32 == 0.
extern "C" __global__ void delta_rule_recurrent(const DeltaRuleParams p) {
    pdl_enter();
    const u32 col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (col >= p.n_v_head * p.d_v) return;  // whole warps
    float* st = (float*)p.state + (u64)col * p.d_k;
    delta_column((const float*)p.q, (const float*)p.k, (const float*)p.v, (const float*)p.g, (const float*)p.beta, st, (float*)p.out, 0,
                 p.n_tok, p.n_k_head, p.d_k, p.n_v_head, p.d_v, col, threadIdx.x % 32);
}

// blockDim 128 (4 columns per block); grid (ceil(nv·dv / 4), n_seq). d_k % 32 == 0. The
// block's state columns are asked for in L2 before pdl_enter (the step's sequence table was
// written before the step; a prefetch is only a hint to the coherent L2).
extern "C" __global__ void delta_rule_seqs(const DeltaSeqsParams p) {
    const u32 col0 = blockIdx.x * (blockDim.x / 32);
    if (threadIdx.x == 0 && col0 < p.n_v_head * p.d_v) {
        const u32 slot = ((const u32*)p.slot)[blockIdx.y], nc = min(blockDim.x / 32, p.n_v_head * p.d_v - col0);
        if (slot < p.n_slots) prefetch_l2((const float*)p.state + slot * p.slot_stride + p.offset + (u64)col0 * p.d_k, 4ull * nc * p.d_k);
    }
    pdl_enter();
    const u32 col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, s = blockIdx.y;
    if (col >= p.n_v_head * p.d_v) return;  // whole warps
    const u32 n = ((const u32*)p.n)[s];
    if (n >= p.scan_below) return;
    const u32 t0 = ((const u32*)p.row0)[s], t1 = t0 + n, slot = ((const u32*)p.slot)[s];
    if (slot >= p.n_slots) {
        if (threadIdx.x % 32 == 0)
            for (u32 t = t0; t < t1; ++t) ((float*)p.out)[(u64)t * p.n_v_head * p.d_v + col] = __int_as_float(0x7fffffff);
        return;
    }
    float* st = (float*)p.state + slot * p.slot_stride + p.offset + (u64)col * p.d_k;
    delta_column((const float*)p.q, (const float*)p.k, (const float*)p.v, (const float*)p.g, (const float*)p.beta, st, (float*)p.out, t0, t1,
                 p.n_k_head, p.d_k, p.n_v_head, p.d_v, col, threadIdx.x % 32);
}

// delta_rule_norm_seqs: delta_rule_seqs for steps whose sequences have one row each (decode),
// then the gated RMSNorm of each value head's output (rms_norm_q8 with a gate: o / rms(o) · w ⊙
// act(z), and its int8 copy), without a launch of its own: each block counts itself done on its
// (sequence, head) counter, and the head's last block normalises the head with one warp (the
// same arithmetic as rms_norm's 32-thread launch a group, so the same bits). The counters are
// zero before the launch and the last block leaves them zero (atomicInc wraps). d_v % 32 == 0
// and d_v <= NORM_REGS · 32, so a block's 4 columns lie in one head and the norm is one warp's.
struct DeltaNormParams {
    DeltaSeqsParams d;  // scan_below unused (one row a sequence)
    RmsNormParams r;    // x = d.out, g = d_v, n_group = rows · n_v_head, gate = z
    u64 q;              // r.out's int8 copy (q8_bytes of rows · n_v_head · d_v)
    u64 count;          // [n_seq · n_v_head] u32
};

// atomicInc (the old value; the counter back to 0 past `limit`) with release and acquire
// semantics at the device's scope (sm_70+; before, fences around a relaxed one).
__device__ __forceinline__ u32 atomic_inc_acq_rel(u32* p, u32 limit) {
#if __CUDA_ARCH__ >= 700
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(limit) : "memory");
    return old;
#else
    __threadfence();
    const u32 old = atomicInc(p, limit);
    __threadfence();
    return old;
#endif
}

// The delta rule part of the fused kernels below: this block's columns col0.. (a warp each) of
// sequence s's one row t, after asking for their state in L2 and reading the norm's weight into
// wv before pdl_enter; a slot out of range gives NaN o.
__device__ __forceinline__ void delta_norm_rule_part(const DeltaNormParams& dn, u32 col0, u32 s, u32* t, float (&wv)[NORM_REGS]) {
    const DeltaSeqsParams& p = dn.d;
    if (threadIdx.x == 0) {
        const u32 slot = ((const u32*)p.slot)[s];
        if (slot < p.n_slots)
            prefetch_l2((const float*)p.state + slot * p.slot_stride + p.offset + (u64)col0 * p.d_k, 4ull * (blockDim.x / 32) * p.d_k);
    }
    norm_regs_w(dn.r, wv, threadIdx.x % 32, 32);
    pdl_enter();
    const u32 col = col0 + threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 slot = ((const u32*)p.slot)[s];
    *t = ((const u32*)p.row0)[s];
    if (slot >= p.n_slots) {
        if (lane == 0) ((float*)p.out)[(u64)*t * p.n_v_head * p.d_v + col] = __int_as_float(0x7fffffff);
    } else {
        float* st = (float*)p.state + slot * p.slot_stride + p.offset + (u64)col * p.d_k;
        delta_column((const float*)p.q, (const float*)p.k, (const float*)p.v, (const float*)p.g, (const float*)p.beta, st, (float*)p.out, *t,
                     *t + 1, p.n_k_head, p.d_k, p.n_v_head, p.d_v, col, lane);
    }
}

// blockDim 128, grid (n_v_head · d_v / 4, n_seq).
extern "C" __global__ void delta_rule_norm_seqs(const DeltaNormParams dn) {
    const DeltaSeqsParams& p = dn.d;
    const u32 col0 = blockIdx.x * (blockDim.x / 32), s = blockIdx.y, lane = threadIdx.x % 32;
    u32 t;
    float wv[NORM_REGS];
    delta_norm_rule_part(dn, col0, s, &t, wv);
    // The block's outputs, then its count: the block's barrier, then thread 0's increment with
    // release and acquire at the device's scope (the arrive of a grid barrier: the barrier makes
    // the block's stores thread 0's to release; the last block's acquire, then its barrier, make
    // every block's stores visible to its warp 0, which reads them through L2 besides:
    // norm_regs_group<true>). call x (docs/perf.md g29) had a sequentially consistent fence in
    // every thread before the count and after it.
    __syncthreads();
    __shared__ u32 last;
    const u32 h = col0 / p.d_v, per_head = p.d_v / (blockDim.x / 32);
    if (threadIdx.x == 0) last = atomic_inc_acq_rel((u32*)dn.count + (u64)s * p.n_v_head + h, per_head - 1) == per_head - 1;
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    norm_regs_group<true>(dn.r, dn.q, wv, t * p.n_v_head + h, (u64)dn.r.n_group * dn.r.g, lane, 32, nullptr);
}

// delta_rule_norm_cluster: delta_rule_norm_seqs for value heads of d_v = 128 (sm_90) with the
// cluster's barrier where that kernel counts: 16 columns a block (512 threads), a cluster of
// DN_CLUSTER = 8 blocks a head, so the barrier (release / acquire at the cluster's scope: every
// block's stores of o seen by all after it) tells the head's first block that the head is done,
// and that block's warp 0 normalises it as the counting kernel's last block does (the same
// arithmetic: the same bits). No counters, no atomic at the device's scope.
#define DN_CLUSTER 8
#if __CUDA_ARCH__ >= 900
#define DN_CLUSTER_DIMS __cluster_dims__(DN_CLUSTER, 1, 1)
#else
#define DN_CLUSTER_DIMS
#endif

// blockDim 512, grid (n_v_head · 128 / 16, n_seq).
extern "C" __global__ void DN_CLUSTER_DIMS __launch_bounds__(512) delta_rule_norm_cluster(const DeltaNormParams dn) {
#if __CUDA_ARCH__ >= 900
    const DeltaSeqsParams& p = dn.d;
    const u32 col0 = blockIdx.x * (blockDim.x / 32), s = blockIdx.y, lane = threadIdx.x % 32;
    u32 t;
    float wv[NORM_REGS];
    delta_norm_rule_part(dn, col0, s, &t, wv);
    cluster_sync();
    if (cluster_rank() != 0 || threadIdx.x >= 32) return;
    norm_regs_group<true>(dn.r, dn.q, wv, t * p.n_v_head + col0 / p.d_v, (u64)dn.r.n_group * dn.r.g, lane, 32, nullptr);
#endif
}
