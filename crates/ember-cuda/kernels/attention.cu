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
//   attention_tiles (attention_prefill.cu): prompt chunks and deep contexts, flash attention over tiles of
//     query vectors sharing a KV head, its key ranges merged by attention_merge when split.
//   attention_decode (attention_decode.cu): few rows per sequence (decode), flash-decoding with the query
//     heads of a KV head in one block, so each K/V row is read once for all of them.

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

// The cache type is a template parameter of the per-row kernels (one instance per type, chosen
// at entry): a run-time type test per element kept every f16 / q8_0 load in its own branch and
// made the kernel 2.2x longer (72 -> 105 registers, 3 -> 2 blocks per SM).
template <int TY>
__device__ __forceinline__ void load_key(const AttentionParams& p, const u32* tk, const u32* tv, u32 key, u32 base, int lane, KeyRows& kr) {
    const u32 pk = tk[key / KV_PAGE], pv = tv[key / KV_PAGE];
    kr.bad = pk >= p.n_pages || pv >= p.n_pages;
    const u8* krow = (const u8*)p.pool + ((u64)(kr.bad ? 0 : pk) * KV_PAGE + key % KV_PAGE) * p.row_bytes;
    const u8* vrow = (const u8*)p.pool + ((u64)(kr.bad ? 0 : pv) * KV_PAGE + key % KV_PAGE) * p.row_bytes;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
        const u32 i = lane + 32 * j;
        kr.k[j] = i < p.head_dim ? kv_at(krow, TY, base + i) : 0.0f;
        kr.v[j] = i < p.head_dim ? kv_at(vrow, TY, base + i) : 0.0f;
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
template <int TY>
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
        load_key<TY>(p, tk, tv, key, base, lane, a);
        load_key<TY>(p, tk, tv, key + n_warp, base, lane, b);
        take_key(p, qv, a, w);
        take_key(p, qv, b, w);
    }
    if (key < k1) {
        KeyRows a;
        load_key<TY>(p, tk, tv, key, base, lane, a);
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
    pdl_enter();
    const u32 n = blockIdx.x, r = blockIdx.y;
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    float* out = (float*)p.out + (u64)r * p.n_head * p.head_dim + (u64)n * p.head_dim;
    switch (p.ty) {
        case KV_F32: attend<KV_F32>(p, n, r, 0, n_keys, out, nullptr); break;
        case KV_F16: attend<KV_F16>(p, n, r, 0, n_keys, out, nullptr); break;
        default: attend<KV_Q8_0>(p, n, r, 0, n_keys, out, nullptr); break;
    }
}

// grid (n_head, n_rows, n_split), blockDim 32 · n_warp: keys [s · kps, (s + 1) · kps) of the row's.
extern "C" __global__ void attention_split(const AttentionParams p) {
    pdl_enter();
    const u32 n = blockIdx.x, r = blockIdx.y, s = blockIdx.z;
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    const u32 k0 = min(n_keys, s * p.keys_per_split), k1 = min(n_keys, k0 + p.keys_per_split);
    const u64 at = ((u64)r * p.n_head + n) * p.n_split + s;
    float *acc = (float*)p.part_acc + at * p.head_dim, *ml = (float*)p.part_ml + at * 2;
    switch (p.ty) {
        case KV_F32: attend<KV_F32>(p, n, r, k0, k1, acc, ml); break;
        case KV_F16: attend<KV_F16>(p, n, r, k0, k1, acc, ml); break;
        default: attend<KV_Q8_0>(p, n, r, k0, k1, acc, ml); break;
    }
}

// grid (n_head, n_rows), blockDim 32 · ATT_MERGE_WARPS: out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s
// over the ranges with l_s > 0 (an empty range is skipped). Warp w sums ranges w, w + 8, ...
// (lane l dims l, l + 32, ...: coalesced), then the warps' sums are added in warp order, so
// trailing empty ranges change no bit of a row's result.
#define ATT_MERGE_WARPS 8
extern "C" __global__ void __launch_bounds__(32 * ATT_MERGE_WARPS) attention_merge(const AttentionParams p) {
    pdl_enter();
    __shared__ float sm_red[ATT_MERGE_WARPS];
    __shared__ float sm_num[ATT_MERGE_WARPS][ATT_MAX_PER_LANE * 32], sm_den[ATT_MERGE_WARPS];
    const u32 n = blockIdx.x, r = blockIdx.y, hd = p.head_dim;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 at = ((u64)r * p.n_head + n) * p.n_split;
    const float* ml = (const float*)p.part_ml + at * 2;
    const float* acc = (const float*)p.part_acc + at * hd;
    float mx = ATT_NEG_INF;
    bool bad = false;
    for (u32 s = threadIdx.x; s < p.n_split; s += blockDim.x) {
        bad |= ml[2 * s] != ml[2 * s];
        if (ml[2 * s + 1] > 0.0f) mx = fmaxf(mx, ml[2 * s]);
    }
    bad = __syncthreads_or(bad);
    mx = warp_max(mx);
    if (lane == 0) sm_red[warp] = mx;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < ATT_MERGE_WARPS; ++w) mx = fmaxf(mx, sm_red[w]);
    float num[ATT_MAX_PER_LANE], den = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) num[j] = 0.0f;
    for (u32 s = warp; s < p.n_split; s += ATT_MERGE_WARPS) {
        const float l = ml[2 * s + 1];
        if (!(l > 0.0f)) continue;
        const float f = expf(ml[2 * s] - mx);
        den += f * l;
#pragma unroll
        for (int j = 0; j < ATT_MAX_PER_LANE; ++j) {
            const u32 i = lane + 32 * j;
            if (i < hd) num[j] += f * acc[(u64)s * hd + i];
        }
    }
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; ++j) sm_num[warp][lane + 32 * j] = num[j];
    if (lane == 0) sm_den[warp] = den;
    __syncthreads();
    float* o = (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd;
    for (u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        float nu = 0.0f, de = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_MERGE_WARPS; ++w) {
            nu += sm_num[w][i];
            de += sm_den[w];
        }
        float v = bad ? ATT_NAN : nu / de;
        // The gate (and the int8 copy: hd a multiple of 32, one pass of whole warps) where the
        // launcher sets it.
        if (p.gate) {
            const u64 oi = ((u64)r * p.n_head + n) * hd + i;
            v = attn_gated(p, v, oi);
            if (p.q8) warp_q8(v, (u8*)p.q8, (u64)p.n_rows * p.n_head * hd, oi);
        }
        o[i] = v;
    }
}
