// attention: causal GQA attention of every row of a step's q [n_rows, n_head·hd] over its
// sequence's paged K/V cache of one layer (pages as in kv_append.cu), with an online softmax.
// Reference: ember_ops::reference::attention (qwen35moe.md §6.3): query head n reads KV head
// n / (n_head / n_head_kv); row r (a token at position pos[r]) sees positions 0..=pos[r].
//
// One block per (query head, row); each warp takes every n_warp-th key, keeps its own running
// max, sum and weighted value sum (lane l holds dims l, l + 32, ...), and the warps are merged
// at the end. Deterministic: no atomics, a fixed order.

#define KV_PAGE 64
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8
#define ATT_MAX_PER_LANE 8  // head_dim <= 256
#define ATT_MAX_WARPS 8

struct AttentionParams {
    u64 q;         // [n_rows, n_head · hd] f32
    u64 out;       // [n_rows, n_head · hd] f32
    u64 pool;      // n_pages pages of page_bytes
    u64 table;     // [n_slots · n_kv · 2, stride] u32 page ids
    u64 row_slot;  // [n_rows] u32
    u64 pos;       // [n_rows] u32
    u32 n_rows, n_head, n_head_kv, head_dim;
    u32 ty, row_bytes, stride, layer;
    u32 n_kv, n_slots, n_pages;
    float scale;
};

// Value `e` of a cache row.
__device__ __forceinline__ float kv_at(const u8* row, u32 ty, u32 e) {
    if (ty == KV_F32) return ((const float*)row)[e];
    if (ty == KV_F16) return f16_to_f32(((const u16*)row)[e]);
    const u8* blk = row + (u64)(e / 32) * 34;
    return (float)(i8)blk[2 + e % 32] * f16_to_f32(*(const u16*)blk);
}

// grid (n_head, n_rows), blockDim 32 · n_warp (n_warp <= ATT_MAX_WARPS).
extern "C" __global__ void attention(const AttentionParams p) {
    __shared__ float sm_m[ATT_MAX_WARPS], sm_l[ATT_MAX_WARPS];
    __shared__ float sm_acc[ATT_MAX_WARPS][ATT_MAX_PER_LANE * 32];
    const u32 n = blockIdx.x, r = blockIdx.y, hd = p.head_dim;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warp = blockDim.x / 32;
    const u32 kvh = n / (p.n_head / p.n_head_kv);
    const u32 slot = ((const u32*)p.row_slot)[r], n_keys = ((const u32*)p.pos)[r] + 1;
    float* o = (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd;
    const bool ok = slot < p.n_slots && (n_keys + KV_PAGE - 1) / KV_PAGE <= p.stride;
    const float* qrow = (const float*)p.q + (u64)r * p.n_head * hd + (u64)n * hd;
    float qv[ATT_MAX_PER_LANE], acc[ATT_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
        const u32 i = lane + 32 * j;
        qv[j] = i < hd ? qrow[i] : 0.0f;
        acc[j] = 0.0f;
    }
    const u64 ck = ((u64)slot * p.n_kv + p.layer) * 2;
    const u32* tk = (const u32*)p.table + ck * p.stride;
    const u32* tv = tk + p.stride;
    float m = -__int_as_float(0x7f800000), l = 0.0f;
    bool bad = !ok;
    for (u32 key = ok ? warp : n_keys; key < n_keys; key += n_warp) {
        const u32 pk = tk[key / KV_PAGE], pv = tv[key / KV_PAGE];
        if (pk >= p.n_pages || pv >= p.n_pages) {
            bad = true;
            break;
        }
        const u8* krow = (const u8*)p.pool + ((u64)pk * KV_PAGE + key % KV_PAGE) * p.row_bytes;
        const u8* vrow = (const u8*)p.pool + ((u64)pv * KV_PAGE + key % KV_PAGE) * p.row_bytes;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
            const u32 i = lane + 32 * j;
            if (i < hd) s += qv[j] * kv_at(krow, p.ty, kvh * hd + i);
        }
        s = warp_sum(s) * p.scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), e = expf(s - m_new);
        l = l * corr + e;
#pragma unroll
        for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
            const u32 i = lane + 32 * j;
            if (i < hd) acc[j] = acc[j] * corr + e * kv_at(vrow, p.ty, kvh * hd + i);
        }
        m = m_new;
    }
    if (lane == 0) {
        sm_m[warp] = bad ? __int_as_float(0x7fffffff) : m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) sm_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    // Merge the warps: M = max m_w, out = Σ_w e^{m_w − M} acc_w / Σ_w e^{m_w − M} l_w.
    float mx = -__int_as_float(0x7f800000);
    bool any_bad = false;
    for (int w = 0; w < n_warp; ++w) {
        any_bad |= sm_m[w] != sm_m[w];  // NaN
        mx = fmaxf(mx, sm_m[w]);
    }
    float den = 0.0f, f[ATT_MAX_WARPS];
    for (int w = 0; w < n_warp; ++w) {
        // A warp that saw no key has m = -inf and contributes nothing.
        f[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - mx) : 0.0f;
        den += f[w] * sm_l[w];
    }
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < n_warp; ++w) num += f[w] * sm_acc[w][i];
        o[i] = any_bad ? __int_as_float(0x7fffffff) : num / den;
    }
}
