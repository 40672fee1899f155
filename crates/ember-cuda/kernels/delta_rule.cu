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

// The gated norm that reads the delta rule's output next (rms_norm_gate per value head: group
// d_v, a weight shared by the heads, out ⊙ act(gate)), done per head and sequence by whichever of
// the head's d_v / 4 blocks counts itself last. That takes the norm's launch (one a DeltaNet
// layer) out of a decode step's chain. The last block's first warp does what rms_norm.cu's
// norm_regs does for a group of at most 128 values with 32 threads: the same sums in the same
// order, the same bits.
struct DeltaNormTail {
    u64 w;      // [d_v] f32, the norm's weight (0: no tail)
    u64 gate;   // [n_rows, nv·dv] f32
    u64 y;      // [n_rows, nv·dv] f32
    u64 q;      // y's int8 copy (quantize_q8's layout over q_n values), or 0
    u64 count;  // [n_seq · nv] u32, 0 before the launch and after it (the last block puts it back)
    float eps;
    u32 act;  // SiLU 0, sigmoid 1
    u32 q_n, pad;
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
    DeltaNormTail tail;  // with tail.w: d_v a multiple of 4, at most 128, and no sequence chunked
};
static_assert(sizeof(DeltaSeqsParams) == 176, "DeltaSeqsParams: the layout src/ops/delta_rule.rs passes");

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
// Every thread of the block calls it once the block's columns (all of value head h) hold rows
// t0..t1 of sequence s (it holds barriers).
__device__ __forceinline__ void delta_norm_tail(const DeltaSeqsParams& p, u32 s, u32 h, u32 t0, u32 t1) {
    __shared__ u32 last;
    const DeltaNormTail& t = p.tail;
    u32* count = (u32*)t.count + (u64)s * p.n_v_head + h;
    __threadfence();  // this block's rows, device-wide, before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count, 1u) == p.d_v / (blockDim.x / 32) - 1;
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();  // every block of the head counted after writing its rows
    const u32 lane = threadIdx.x, dv = p.d_v;
    const u64 width = (u64)p.n_v_head * dv;
    const float* w = (const float*)t.w;
    const float* out = (const float*)p.out;
    float wv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wv[j] = lane + 32 * j < dv ? w[lane + 32 * j] : 0.0f;
    for (u32 r = t0; r < t1; ++r) {
        const u64 base = (u64)r * width + (u64)h * dv;
        float xv[4], gv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 i = lane + 32 * j;
            xv[j] = i < dv ? __ldcg(out + base + i) : 0.0f;  // L2: the other blocks' rows
            gv[j] = i < dv ? ((const float*)t.gate)[base + i] : 0.0f;
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (lane + 32 * j < dv) ss += xv[j] * xv[j];
        ss = warp_sum(ss);  // block_sum at 32 threads: this, then a sum with 31 zeros
        const float scale = 1.0f / sqrtf(ss / (float)dv + t.eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 i = lane + 32 * j;
            if (i < dv) {  // whole warps (dv a multiple of 32 where q is set)
                float v = xv[j] * scale * wv[j];
                v = v * (t.act == 0 ? silu_f(gv[j]) : sigmoid_f(gv[j]));
                ((float*)t.y)[base + i] = v;
                if (t.q) warp_q8(v, (u8*)t.q, t.q_n, base + i);
            }
        }
    }
    if (lane == 0) *(volatile u32*)count = 0;
}

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
    } else {
        float* st = (float*)p.state + slot * p.slot_stride + p.offset + (u64)col * p.d_k;
        delta_column((const float*)p.q, (const float*)p.k, (const float*)p.v, (const float*)p.g, (const float*)p.beta, st, (float*)p.out, t0,
                     t1, p.n_k_head, p.d_k, p.n_v_head, p.d_v, col, threadIdx.x % 32);
    }
    // With a tail no thread returned above (the grid covers nv·dv exactly, no sequence is
    // chunked, and the block's columns are one head's: d_v % 4 == 0).
    if (p.tail.w) delta_norm_tail(p, s, col / p.d_v, t0, t1);
}
