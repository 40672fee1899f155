// delta_rule_recurrent: the gated delta rule token by token (qwen35moe.md §6.4 step 8;
// arXiv:2412.06464). Reference: ember_ops::reference::delta_rule_recurrent.
// Per value head h (key head h % n_k_head), state stored transposed like the CPU's:
// st[h][jv][i] = S[i][jv], so value index jv's column of S is one contiguous d_k row.
//   S ← e^g S;  δ = β (v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ q.
// One warp per column (h, jv), the column in registers (d_k / 32 values per lane): one read and
// one write of the state per call, whatever n_tok (shared/GPU.md §3).

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

// blockDim 128 (4 columns per block); grid ceil(nv·dv / 4). d_k % 32 == 0.
extern "C" __global__ void delta_rule_recurrent(const DeltaRuleParams p) {
    const u32 col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (col >= p.n_v_head * p.d_v) return;  // whole warps
    const u32 h = col / p.d_v, jv = col % p.d_v, kh = h % p.n_k_head;
    const u32 dk = p.d_k, n_per = dk / 32, nkdk = p.n_k_head * dk;
    float* st = (float*)p.state + (u64)col * dk;
    float s[DELTA_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) s[i] = i < (int)n_per ? st[32 * i + lane] : 0.0f;
    for (u32 t = 0; t < p.n_tok; ++t) {
        const float* q = (const float*)p.q + (u64)t * nkdk + kh * dk;
        const float* k = (const float*)p.k + (u64)t * nkdk + kh * dk;
        const float decay = expf(((const float*)p.g)[(u64)t * p.n_v_head + h]);
        const float b = ((const float*)p.beta)[(u64)t * p.n_v_head + h];
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
        const float delta = b * (((const float*)p.v)[(u64)t * p.n_v_head * p.d_v + col] - sk);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DELTA_MAX_PER_LANE; ++i) {
            if (i < (int)n_per) {
                s[i] += kv[i] * delta;
                o += s[i] * qv[i];
            }
        }
        o = warp_sum(o);
        if (lane == 0) ((float*)p.out)[(u64)t * p.n_v_head * p.d_v + col] = o;
    }
#pragma unroll
    for (int i = 0; i < DELTA_MAX_PER_LANE; ++i)
        if (i < (int)n_per) st[32 * i + lane] = s[i];
}
