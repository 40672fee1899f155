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

// One token's step of a column held in registers (s: the lane's n_per values of it) with the
// token's k and q in kv and qv (the lane's values), whose i-th `prep(i)` makes ready first:
// S ← e^g S (decay = e^g); δ = β (v − Sᵀk) with v read from `v`; S ← S + k δᵀ; returns
// o = Sᵀ q (every lane gets it).
template <class Prep>
__device__ __forceinline__ float delta_token(float* s, float* kv, float* qv, u32 n_per, float decay, float b, const float* v, Prep prep) {
    float sk = 0.0f;
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
        if (i < (int)n_per) {
            prep(i);
            s[i] *= decay;
            sk += s[i] * kv[i];
        }
    }
    sk = warp_sum(sk);
    const float delta = b * (*v - sk);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
        if (i < (int)n_per) {
            s[i] += kv[i] * delta;
            o += s[i] * qv[i];
        }
    }
    return warp_sum(o);
}

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
        const float o = delta_token(s, kv, qv, n_per, decay, b, vp + (u64)t * nv * dv + col, [&](int i) {
            kv[i] = k[32 * i + lane];
            qv[i] = q[32 * i + lane];
        });
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

// ---- delta_rule_seqs_prep: delta_prep and the scan in one launch ----
// For one-token steps (decode): each warp reads its rows of the conv output `cu` itself,
// L2-normalises its key head's q and k (q then times 1/sqrt(d_k)) and computes its value head's
// β = sigmoid(b) and g = a·softplus(alpha + dt_bias) (threshold 20), in the same operations
// and the same order as delta_prep (whose sums of squares `delta_sq_sum` replays), so q, k, g
// and β are delta_prep's bits; then the same column update as delta_column. No q, k, v, g, β
// buffers.

struct DeltaSeqsPrepParams {
    u64 cu;       // [n_rows, 2·nk·dk + nv·dv] f32
    u64 b;        // [n_rows, nv] f32
    u64 alpha;    // [n_rows, nv] f32
    u64 a;        // [nv] f32
    u64 dt_bias;  // [nv] f32
    u64 state;    // the store's DeltaNet buffer, updated in place
    u64 out;      // [n_rows, nv·dv] f32
    u64 row0;     // [n_seq] u32
    u64 n;        // [n_seq] u32
    u64 slot;     // [n_seq] u32
    u64 slot_stride, offset;  // floats
    u32 n_k_head, d_k, n_v_head, d_v, n_slots;
    float eps;
};

__device__ __forceinline__ float delta_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Σ x² over a head's d_k values held as x[i] = element 32·i + lane (i < n_per), summed in
// delta_prep's order: its 128 threads each add elements t, t + 128, .. in turn (block_sum's
// thread t is warp t / 32, lane t % 32, so element 32·i + lane belongs to warp i % 4), each
// warp's 32 sums then warp_sum'ed, and block_sum's second warp_sum of the four warps' sums
// (lanes 0..3, zeros elsewhere: the xor tree adds lanes 0 and 2, 1 and 3, then the two) gives
// (s0 + s2) + (s1 + s3). Every lane gets it.
__device__ __forceinline__ float delta_sq_sum(const float* x, u32 n_per) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i)
        if (i < (int)n_per) acc[i % 4] += x[i] * x[i];
    const float s0 = warp_sum(acc[0]), s1 = warp_sum(acc[1]), s2 = warp_sum(acc[2]), s3 = warp_sum(acc[3]);
    return (s0 + s2) + (s1 + s3);
}

// blockDim 128 (4 columns per block); grid (ceil(nv·dv / 4), n_seq). d_k % 32 == 0, d_k <= 256.
extern "C" __global__ void delta_rule_seqs_prep(const DeltaSeqsPrepParams p) {
    const u32 col0 = blockIdx.x * (blockDim.x / 32);
    if (threadIdx.x == 0 && col0 < p.n_v_head * p.d_v) {
        const u32 slot = ((const u32*)p.slot)[blockIdx.y], nc = min(blockDim.x / 32, p.n_v_head * p.d_v - col0);
        if (slot < p.n_slots) prefetch_l2((const float*)p.state + slot * p.slot_stride + p.offset + (u64)col0 * p.d_k, 4ull * nc * p.d_k);
    }
    pdl_enter();
    const u32 col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, sq = blockIdx.y;
    const u32 nk = p.n_k_head, dk = p.d_k, nv = p.n_v_head, dv = p.d_v;
    if (col >= nv * dv) return;  // whole warps
    const int lane = threadIdx.x % 32;
    const u32 n = ((const u32*)p.n)[sq], t0 = ((const u32*)p.row0)[sq], t1 = t0 + n, slot = ((const u32*)p.slot)[sq];
    if (slot >= p.n_slots) {
        if (lane == 0)
            for (u32 t = t0; t < t1; ++t) ((float*)p.out)[(u64)t * nv * dv + col] = __int_as_float(0x7fffffff);
        return;
    }
    float* st = (float*)p.state + slot * p.slot_stride + p.offset + (u64)col * dk;
    const u32 h = col / dv, kh = h % nk, n_per = dk / 32, width = 2 * nk * dk + nv * dv;
    const float q_scale = 1.0f / sqrtf((float)dk);
    const float ah = ((const float*)p.a)[h], dtb = ((const float*)p.dt_bias)[h];
    float s[DELTA_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) s[i] = i < (int)n_per ? st[32 * i + lane] : 0.0f;
    for (u32 t = t0; t < t1; ++t) {
        const float* row = (const float*)p.cu + (u64)t * width;
        float kv[DELTA_MAX_PER_LANE], qv[DELTA_MAX_PER_LANE];
#pragma unroll
        for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
            qv[i] = i < (int)n_per ? row[kh * dk + 32 * i + lane] : 0.0f;
            kv[i] = i < (int)n_per ? row[nk * dk + kh * dk + 32 * i + lane] : 0.0f;
        }
        const float b = sigmoid_f(((const float*)p.b)[(u64)t * nv + h]);
        const float g = ah * delta_softplus(((const float*)p.alpha)[(u64)t * nv + h] + dtb);  // delta_prep's g
        const float decay = expf(g);
        const float qs = 1.0f / sqrtf(delta_sq_sum(qv, n_per) + p.eps), ks = 1.0f / sqrtf(delta_sq_sum(kv, n_per) + p.eps);
        const float o = delta_token(s, kv, qv, n_per, decay, b, row + 2 * nk * dk + col, [&](int i) {
            qv[i] = qv[i] * qs * q_scale;
            kv[i] = kv[i] * ks;
        });
        if (lane == 0) ((float*)p.out)[(u64)t * nv * dv + col] = o;
    }
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i)
        if (i < (int)n_per) st[32 * i + lane] = s[i];
}
