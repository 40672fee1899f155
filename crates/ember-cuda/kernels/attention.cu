// attention: causal GQA attention of every row of a step's q [n_rows, n_head·hd] over its
// sequence's paged K/V cache of one layer (pages as in kv_append.cu), with an online softmax.
// Reference: ember_ops::reference::attention (qwen35moe.md §6.3): query head n reads KV head
// n / (n_head / n_head_kv); row r (a token at position pos[r]) sees positions 0..=pos[r].
//
// A block of warps works on one (query head, row) and a range of keys: each warp takes every
// n_warp-th key of the range with its own running max, sum and weighted value sum (lane l holds
// dims l, l + 32, ...; the K and V rows of two keys are loaded before either is used), and the
// warps are merged at the end. Deterministic: no atomics, a fixed order.
//   attention: one block per (head, row) over all its keys (many rows: prefill).
//   attention_split + attention_merge: few rows (decode): the keys split into n_split ranges,
//     a block per (head, row, range) writing its partial (max, sum, unnormalised values), then
//     a block per (head, row) merging the ranges (flash-decoding).

#define KV_PAGE 64
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8
#define ATT_MAX_PER_LANE 8  // head_dim <= 256
#define ATT_MAX_WARPS 8
#define ATT_NAN __int_as_float(0x7fffffff)
#define ATT_NEG_INF (-__int_as_float(0x7f800000))

struct AttentionParams {
    u64 q;         // [n_rows, n_head · hd] f32
    u64 out;       // [n_rows, n_head · hd] f32
    u64 pool;      // n_pages pages of page_bytes
    u64 table;     // [n_slots · n_kv · 2, stride] u32 page ids
    u64 row_slot;  // [n_rows] u32
    u64 pos;       // [n_rows] u32
    u64 part_ml;   // [n_rows, n_head, n_split, 2] f32: each range's max and sum (split only)
    u64 part_acc;  // [n_rows, n_head, n_split, hd] f32: each range's unnormalised values
    u32 n_rows, n_head, n_head_kv, head_dim;
    u32 ty, row_bytes, stride, layer;
    u32 n_kv, n_slots, n_pages, n_split;
    u32 keys_per_split;
    float scale;
};

// Value `e` of a cache row.
__device__ __forceinline__ float kv_at(const u8* row, u32 ty, u32 e) {
    if (ty == KV_F32) return ((const float*)row)[e];
    if (ty == KV_F16) return f16_to_f32(((const u16*)row)[e]);
    const u8* blk = row + (u64)(e / 32) * 34;
    return (float)(i8)blk[2 + e % 32] * f16_to_f32(*(const u16*)blk);
}

struct Warp {
    float m, l;
    float acc[ATT_MAX_PER_LANE];
    bool bad;
};

// One key's K and V values of this lane's dims.
struct KeyRows {
    float k[ATT_MAX_PER_LANE], v[ATT_MAX_PER_LANE];
    bool bad;
};

__device__ __forceinline__ void load_key(const AttentionParams& p, const u32* tk, const u32* tv, u32 key, u32 base, int lane, KeyRows& kr) {
    const u32 pk = tk[key / KV_PAGE], pv = tv[key / KV_PAGE];
    kr.bad = pk >= p.n_pages || pv >= p.n_pages;
    const u8* krow = (const u8*)p.pool + ((u64)(kr.bad ? 0 : pk) * KV_PAGE + key % KV_PAGE) * p.row_bytes;
    const u8* vrow = (const u8*)p.pool + ((u64)(kr.bad ? 0 : pv) * KV_PAGE + key % KV_PAGE) * p.row_bytes;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
        const u32 i = lane + 32 * j;
        kr.k[j] = i < p.head_dim ? kv_at(krow, p.ty, base + i) : 0.0f;
        kr.v[j] = i < p.head_dim ? kv_at(vrow, p.ty, base + i) : 0.0f;
    }
}

__device__ __forceinline__ void take_key(const AttentionParams& p, const float* qv, const KeyRows& kr, Warp& w) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) s += qv[j] * kr.k[j];
    s = warp_sum(s) * p.scale;
    const float m_new = fmaxf(w.m, s);
    const float corr = expf(w.m - m_new), e = expf(s - m_new);
    w.l = w.l * corr + e;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) w.acc[j] = w.acc[j] * corr + e * kr.v[j];
    w.m = m_new;
    w.bad |= kr.bad;
}

// The whole block: keys [k0, k1) of row r for query head n. With `ml` null, writes the
// normalised output to out[0..hd); else the unnormalised values relative to the block's max to
// out[0..hd) and (max, sum) to ml[0..2). A page id out of range gives NaN.
__device__ void attend(const AttentionParams& p, u32 n, u32 r, u32 k0, u32 k1, float* out, float* ml) {
    __shared__ float sm_m[ATT_MAX_WARPS], sm_l[ATT_MAX_WARPS];
    __shared__ float sm_acc[ATT_MAX_WARPS][ATT_MAX_PER_LANE * 32];
    const u32 hd = p.head_dim;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warp = blockDim.x / 32;
    const u32 kvh = n / (p.n_head / p.n_head_kv), base = kvh * hd;
    const u32 slot = ((const u32*)p.row_slot)[r];
    const bool ok = slot < p.n_slots && (k1 + KV_PAGE - 1) / KV_PAGE <= p.stride;
    const float* qrow = (const float*)p.q + (u64)r * p.n_head * hd + (u64)n * hd;
    float qv[ATT_MAX_PER_LANE];
    Warp w;
    w.m = ATT_NEG_INF;
    w.l = 0.0f;
    w.bad = !ok;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
        const u32 i = lane + 32 * j;
        qv[j] = i < hd ? qrow[i] : 0.0f;
        w.acc[j] = 0.0f;
    }
    const u32* tk = (const u32*)p.table + ((u64)(ok ? slot : 0) * p.n_kv + p.layer) * 2 * p.stride;
    const u32* tv = tk + p.stride;
    // Two keys per iteration, both loaded before either is used.
    u32 key = ok ? k0 + warp : k1;
    for (; key + n_warp < k1; key += 2 * n_warp) {
        KeyRows a, b;
        load_key(p, tk, tv, key, base, lane, a);
        load_key(p, tk, tv, key + n_warp, base, lane, b);
        take_key(p, qv, a, w);
        take_key(p, qv, b, w);
    }
    if (key < k1) {
        KeyRows a;
        load_key(p, tk, tv, key, base, lane, a);
        take_key(p, qv, a, w);
    }
    if (lane == 0) {
        sm_m[warp] = w.bad ? ATT_NAN : w.m;
        sm_l[warp] = w.l;
    }
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) sm_acc[warp][lane + 32 * j] = w.acc[j];
    __syncthreads();
    // Merge the warps: M = max m_w, out = Σ_w e^{m_w − M} acc_w / Σ_w e^{m_w − M} l_w.
    float mx = ATT_NEG_INF;
    bool any_bad = false;
    for (int i = 0; i < n_warp; ++i) {
        any_bad |= sm_m[i] != sm_m[i];  // NaN
        mx = fmaxf(mx, sm_m[i]);
    }
    float den = 0.0f, f[ATT_MAX_WARPS];
    for (int i = 0; i < n_warp; ++i) {
        // A warp that saw no key has l = 0 and contributes nothing.
        f[i] = sm_l[i] > 0.0f ? expf(sm_m[i] - mx) : 0.0f;
        den += f[i] * sm_l[i];
    }
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        float num = 0.0f;
        for (int j = 0; j < n_warp; ++j) num += f[j] * sm_acc[j][i];
        out[i] = any_bad ? ATT_NAN : (ml ? num : num / den);
    }
    if (ml && threadIdx.x == 0) {
        ml[0] = any_bad ? ATT_NAN : mx;
        ml[1] = den;
    }
}

// grid (n_head, n_rows), blockDim 32 · n_warp (n_warp <= ATT_MAX_WARPS).
extern "C" __global__ void attention(const AttentionParams p) {
    const u32 n = blockIdx.x, r = blockIdx.y;
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    attend(p, n, r, 0, n_keys, (float*)p.out + (u64)r * p.n_head * p.head_dim + (u64)n * p.head_dim, nullptr);
}

// grid (n_head, n_rows, n_split), blockDim 32 · n_warp: keys [s · kps, (s + 1) · kps) of the row's.
extern "C" __global__ void attention_split(const AttentionParams p) {
    const u32 n = blockIdx.x, r = blockIdx.y, s = blockIdx.z;
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    const u32 k0 = min(n_keys, s * p.keys_per_split), k1 = min(n_keys, k0 + p.keys_per_split);
    const u64 at = ((u64)r * p.n_head + n) * p.n_split + s;
    attend(p, n, r, k0, k1, (float*)p.part_acc + at * p.head_dim, (float*)p.part_ml + at * 2);
}

// grid (n_head, n_rows), blockDim a multiple of 32: out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s.
extern "C" __global__ void attention_merge(const AttentionParams p) {
    const u32 n = blockIdx.x, r = blockIdx.y, hd = p.head_dim;
    const u64 at = ((u64)r * p.n_head + n) * p.n_split;
    const float* ml = (const float*)p.part_ml + at * 2;
    const float* acc = (const float*)p.part_acc + at * hd;
    float mx = ATT_NEG_INF;
    bool bad = false;
    for (u32 s = 0; s < p.n_split; ++s) {
        bad |= ml[2 * s] != ml[2 * s];
        if (ml[2 * s + 1] > 0.0f) mx = fmaxf(mx, ml[2 * s]);
    }
    float den = 0.0f;
    for (u32 s = 0; s < p.n_split; ++s)
        if (ml[2 * s + 1] > 0.0f) den += expf(ml[2 * s] - mx) * ml[2 * s + 1];
    float* o = (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        float num = 0.0f;
        for (u32 s = 0; s < p.n_split; ++s)
            if (ml[2 * s + 1] > 0.0f) num += expf(ml[2 * s] - mx) * acc[(u64)s * hd + i];
        o[i] = bad ? ATT_NAN : num / den;
    }
}
