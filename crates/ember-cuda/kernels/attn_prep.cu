// attn_prep: split each head of qg [T, n_head·2·hd] into q | gate, RMSNorm q and k per head
// (head_dim-wide weights), NeoX RoPE on the first n_rot dims at each row's position.
// Reference: ember_ops::reference::attn_prep and rope_at (qwen35moe.md §6.3.4): pairs
// (d, d + n_rot/2), angle pos · base^(−2d/n_rot), computed in f64 like the reference.

struct AttnPrepParams {
    u64 qg;      // [n_tok, n_head · 2 · hd] f32
    u64 k;       // [n_tok, n_head_kv · hd] f32
    u64 q_norm;  // [hd] f32
    u64 k_norm;  // [hd] f32
    u64 pos;     // [n_tok] u32
    u64 q_out;   // [n_tok, n_head · hd] f32
    u64 gate;    // [n_tok, n_head · hd] f32
    u64 k_out;   // [n_tok, n_head_kv · hd] f32
    u32 n_tok, n_head, n_head_kv, head_dim, n_rot, pad;
    float eps, rope_base;
    // With kv.pool set, each k head's block also writes its head of k (normed, rotated) and of
    // v into the step row's K and V cache rows (kv_append's conversions, kv_store.cuh), so the
    // kv_append launch after it is not needed (head_dim a multiple of 32: Q8_0 blocks stay
    // inside a head).
    KvDest kv;
    u64 v;  // [n_tok, n_head_kv · hd] f32
};

// grid (n_head + n_head_kv, n_tok), blockDim a multiple of 32; dynamic shared memory
// head_dim floats. Blocks below n_head do a q head (and copy its gate), the rest a k head.
extern "C" __global__ void attn_prep(const AttnPrepParams p) {
    pdl_enter();
    extern __shared__ float v[];
    __shared__ float scratch[32];
    const u32 t = blockIdx.y, hd = p.head_dim;
    const bool is_q = blockIdx.x < p.n_head;
    const u32 h = is_q ? blockIdx.x : blockIdx.x - p.n_head;
    const float* src;
    float* dst;
    const float* w;
    if (is_q) {
        const float* row = (const float*)p.qg + (u64)t * p.n_head * 2 * hd + (u64)h * 2 * hd;
        src = row;
        float* g = (float*)p.gate + (u64)t * p.n_head * hd + (u64)h * hd;
        for (u32 i = threadIdx.x; i < hd; i += blockDim.x) g[i] = row[hd + i];
        dst = (float*)p.q_out + (u64)t * p.n_head * hd + (u64)h * hd;
        w = (const float*)p.q_norm;
    } else {
        src = (const float*)p.k + (u64)t * p.n_head_kv * hd + (u64)h * hd;
        dst = (float*)p.k_out + (u64)t * p.n_head_kv * hd + (u64)h * hd;
        w = (const float*)p.k_norm;
    }
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) ss += src[i] * src[i];
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)hd + p.eps);
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) v[i] = src[i] * scale * w[i];
    __syncthreads();
    const u32 half = p.n_rot / 2;
    const double pos = (double)((const u32*)p.pos)[t];
    // A k head with kv.pool set: its K and V rows in the cache (block-uniform; null: skipped).
    const bool to_kv = !is_q && p.kv.pool;
    u8* kr = to_kv ? kv_row(p.kv, t, 0) : nullptr;
    u8* vr = to_kv ? kv_row(p.kv, t, 1) : nullptr;
    const float* vs = (const float*)p.v + (u64)t * p.n_head_kv * hd + (u64)h * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = v[i];
        if (i < p.n_rot) {
            const u32 d = i < half ? i : i - half;
            const double f = pow((double)p.rope_base, -2.0 * (double)d / (double)p.n_rot);
            const float c = (float)cos(pos * f), s = (float)sin(pos * f);
            const float a = v[d], b = v[d + half];
            o = i < half ? a * c - b * s : a * s + b * c;
        }
        dst[i] = o;
        // Head h of the K and V rows: value e of a row (whole warps: hd a multiple of 32, so a
        // Q8_0 block's 32 values are one warp's, lane e % 32).
        const u32 e = h * hd + i;
        if (kr) {
            if (p.kv.ty == KV_Q8_0) kv_store_q8(kr, e / 32, (int)(e % 32), o);
            else kv_store(kr, p.kv.ty, e, o);
        }
        if (vr) {
            if (p.kv.ty == KV_Q8_0) kv_store_q8(vr, e / 32, (int)(e % 32), vs[i]);
            else kv_store(vr, p.kv.ty, e, vs[i]);
        }
    }
}
