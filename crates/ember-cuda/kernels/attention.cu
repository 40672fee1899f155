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
//   attention_tiles (below): prompt chunks and deep contexts, flash attention over tiles of
//     query vectors sharing a KV head, its key ranges merged by attention_merge when split.
//   attention_decode (below): few rows per sequence (decode), flash-decoding with the query
//     heads of a KV head in one block, so each K/V row is read once for all of them.

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
    u64 seq_row0;  // [n_seq] u32: each sequence's first row (attention_tiles only)
    u64 seq_n;     // [n_seq] u32: each sequence's rows (attention_tiles only)
    u32 n_rows, n_head, n_head_kv, head_dim;
    u32 ty, row_bytes, stride, layer;
    u32 n_kv, n_slots, n_pages, n_split;
    u32 keys_per_split, n_seq, heads_per_block;
    float scale;
};

// Value `e` of a cache row.
__device__ __forceinline__ float kv_at(const u8* row, u32 ty, u32 e) {
    if (ty == KV_F32) return ((const float*)row)[e];
    if (ty == KV_F16) return f16_to_f32(((const u16*)row)[e]);
    const u8* blk = row + (u64)(e / 32) * 34;
    return (float)(i8)blk[2 + e % 32] * f16_to_f32(*(const u16*)blk);
}

__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 f4(float x, float y, float z, float w) {
    float4 v;
    v.x = x;
    v.y = y;
    v.z = z;
    v.w = w;
    return v;
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
        o[i] = bad ? ATT_NAN : nu / de;
    }
}

// ---------------------------------------------------------------------------------------------
// attention_decode: a block of AD_WARPS warps takes one row, HB query heads that share a KV
// head (HB: a power of two dividing the GQA ratio, at most 8, chosen by the launcher to fill
// the GPU) and one range of the row's keys. Lane l holds dims 8l .. 8l + 8 of every head
// (head_dim <= 256, a multiple of 8), so a K or V row is one 16-byte load per lane (F16)
// serving all HB heads. Each warp walks groups of AD_KG consecutive keys (every AD_WARPS-th
// group of the range) with its own online softmax: the AD_KG x HB partial dot products of a
// lane are summed over the warp by a transposing reduction (each halving step sends half of
// the values, so after it lane l holds the whole sum of pair l >> SH), the softmax of each
// head runs on the lanes holding its scores, and the weights come back to every lane by
// shuffles for the P·V update. The warps are merged through shared memory, pairwise, in a
// fixed order (deterministic).
// Key ranges: a row of n keys is split into ceil(n / kps) ranges of kps = 64 · ceil(pages /
// splits) keys (splits: p.keys_per_split, the target ranges per row), a function of the row's
// own keys, so its result does not depend on the other rows of the call. With n_split > 1 the
// block writes its partial (max, sum, unnormalised values) for attention_merge; blocks past
// the row's ranges write an empty partial (sum 0) that the merge skips.
// Every head gets the same bits whatever HB is: its dot products are summed over the lanes in
// one butterfly order (offsets 16, 8, 4, 2, 1, whether by halving steps or plain sums), its
// softmax over a group's keys in one order, and every a·b + c that a compiler could contract
// differently in another instance is an explicit fmaf. So HB may follow the call's size.
// grid (n_head / HB, n_rows, n_split), blockDim 32 · AD_WARPS.

#define AD_WARPS 4
#define AD_KG 4  // keys per warp step

// Eight consecutive values (from element e0, a multiple of 8) of a cache row, loaded raw so a
// step's loads are all issued before any is converted.
template <int TY>
struct Row8;
template <>
struct Row8<KV_F16> {
    uint4 r;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        if (on) {
            r = *(const uint4*)(row + 2 * (u64)e0);
        } else {
            r.x = r.y = r.z = r.w = 0;
        }
    }
    __device__ __forceinline__ void get(float* x) const {
        const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
            x[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
        }
    }
};
template <>
struct Row8<KV_F32> {
    float4 a, b;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        if (on) {
            a = ((const float4*)(row + 4 * (u64)e0))[0];
            b = ((const float4*)(row + 4 * (u64)e0))[1];
        } else {
            a = b = f4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    __device__ __forceinline__ void get(float* x) const {
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
        x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    }
};
template <>
struct Row8<KV_Q8_0> {
    u32 lo, hi;
    float d;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        // Blocks of 34 bytes (f16 scale, 32 int8): 8 values aligned to 8 stay in one block.
        const u8* blk = row + (u64)(e0 / 32) * 34;
        lo = on ? ld_u32_a2(blk + 2 + e0 % 32) : 0;
        hi = on ? ld_u32_a2(blk + 6 + e0 % 32) : 0;
        d = on ? f16_to_f32(ld_u16(blk)) : 0.0f;
    }
    __device__ __forceinline__ void get(float* x) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = (float)(i8)(lo >> (8 * i)) * d;
            x[4 + i] = (float)(i8)(hi >> (8 * i)) * d;
        }
    }
};

// One halving step at lane offset O over C values: keep the half that lane bit O selects.
template <int C, int O>
__device__ __forceinline__ void halve(float* x, int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int j = 0; j < C / 2; ++j) {
        const float send = up ? x[j] : x[j + C / 2], keep = up ? x[j + C / 2] : x[j];
        x[j] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    if constexpr (C > 2) halve<C / 2, O / 2>(x, lane);
}

// The sum over the warp of each of a lane's NV values (NV a power of two, at most 32): each
// halving step keeps the half of the values the lane's bit selects and adds the partner's
// copy of it; afterwards lane l holds the sum of value l >> (5 - log2 NV).
template <int NV>
__device__ __forceinline__ float transpose_sum(float* x, int lane) {
    if constexpr (NV > 1) halve<NV, 16>(x, lane);
    // Offsets below the halving steps: plain sums.
#pragma unroll
    for (int o = 16 / NV; o > 0; o /= 2) x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
    return x[0];
}

__host__ __device__ __forceinline__ u32 decode_keys_per_split(u32 n_keys, u32 splits) {
    const u32 pages = (n_keys + KV_PAGE - 1) / KV_PAGE;
    return KV_PAGE * max(1u, (pages + splits - 1) / splits);
}

template <int TY, int HB>
__device__ void attend_decode(const AttentionParams& p, float* sm) {
    constexpr int NV = AD_KG * HB;  // (key, head) pairs of a warp step
    constexpr int SH = NV == 32 ? 0 : NV == 16 ? 1 : NV == 8 ? 2 : NV == 4 ? 3 : 4;  // lane l holds pair l >> SH
    // The kernel's shared buffer: [AD_WARPS / 2][HB][256] values, then the maxima and sums.
    float(*sm_acc)[HB][ATT_MAX_PER_LANE * 32] = (float(*)[HB][ATT_MAX_PER_LANE * 32])sm;
    float(*sm_m)[HB] = (float(*)[HB])(sm + AD_WARPS / 2 * HB * ATT_MAX_PER_LANE * 32);
    float(*sm_l)[HB] = (float(*)[HB])(sm + AD_WARPS / 2 * HB * (ATT_MAX_PER_LANE * 32 + 1));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u32 r = blockIdx.y, s = blockIdx.z, hd = p.head_dim;
    const u32 h0 = blockIdx.x * HB, kvh = h0 / (p.n_head / p.n_head_kv);
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    const u32 kps = decode_keys_per_split(n_keys, p.keys_per_split);
    const u64 at0 = ((u64)r * p.n_head + h0) * p.n_split + s;  // head h0 + h: at0 + h · n_split
    if (s * kps >= n_keys) {
        if (threadIdx.x < HB) {
            float* ml = (float*)p.part_ml + (at0 + threadIdx.x * p.n_split) * 2;
            ml[0] = ATT_NEG_INF;
            ml[1] = 0.0f;
        }
        return;
    }
    const u32 k0 = s * kps, k1 = min(n_keys, k0 + kps);
    const u32 slot = ((const u32*)p.row_slot)[r];
    bool bad = slot >= p.n_slots || (k1 + KV_PAGE - 1) / KV_PAGE > p.stride;
    const u32* tk = (const u32*)p.table + ((u64)(bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    const u32* tv = tk + p.stride;
    const bool on = (u32)lane * 8 < hd;
    const u32 e0 = kvh * hd + lane * 8;

    float q[HB][8], acc[HB][8];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        const float* qr = (const float*)p.q + (u64)r * p.n_head * hd + (u64)(h0 + h) * hd + lane * 8;
        const float4 a = on ? ld4(qr) : f4(0.0f, 0.0f, 0.0f, 0.0f), b = on ? ld4(qr + 4) : f4(0.0f, 0.0f, 0.0f, 0.0f);
        q[h][0] = a.x * p.scale, q[h][1] = a.y * p.scale, q[h][2] = a.z * p.scale, q[h][3] = a.w * p.scale;
        q[h][4] = b.x * p.scale, q[h][5] = b.y * p.scale, q[h][6] = b.z * p.scale, q[h][7] = b.w * p.scale;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
    }
    // The running max and sum of this lane's head ((lane >> SH) % HB), equal on its lanes.
    float m_mine = ATT_NEG_INF, l_mine = 0.0f;
    const int pair = lane >> SH, key_of = pair / HB;
    // A bad slot or a range past the table reads nothing (and gives NaN).
    for (u32 kb = bad ? k1 : k0 + warp * AD_KG; kb < k1; kb += AD_WARPS * AD_KG) {
        u32 pk = tk[kb / KV_PAGE], pv = tv[kb / KV_PAGE];
        if (pk >= p.n_pages || pv >= p.n_pages) {
            bad = true;
            pk = pv = 0;
        }
        // kb is a multiple of AD_KG, so the group's keys share a page; keys past k1 are not
        // read (zeros: their rows may hold anything, NaN included) and masked.
        const u8* kr = (const u8*)p.pool + ((u64)pk * KV_PAGE + kb % KV_PAGE) * p.row_bytes;
        const u8* vr = (const u8*)p.pool + ((u64)pv * KV_PAGE + kb % KV_PAGE) * p.row_bytes;
        Row8<TY> kraw[AD_KG], vraw[AD_KG];
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) kraw[j].load(kr + (u64)j * p.row_bytes, e0, on && kb + j < k1);
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) vraw[j].load(vr + (u64)j * p.row_bytes, e0, on && kb + j < k1);
        float x[NV];
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) {
            float kf[8];
            kraw[j].get(kf);
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d = fmaf(q[h][i], kf[i], d);
                x[j * HB + h] = d;
            }
        }
        float sc = transpose_sum<NV>(x, lane);
        if (kb + key_of >= k1) sc = ATT_NEG_INF;
        // The head's max and sum over the group's keys: its lanes differ in the bits above HB << SH.
        float mt = sc;
#pragma unroll
        for (int o = HB << SH; o < 32; o <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
        const float m_new = fmaxf(m_mine, mt);
        const bool none = m_new == ATT_NEG_INF;  // no key of this head seen yet
        const float corr = none ? 1.0f : expf(m_mine - m_new), e = none ? 0.0f : expf(sc - m_new);
        float es = e;
#pragma unroll
        for (int o = HB << SH; o < 32; o <<= 1) es += __shfl_xor_sync(0xffffffffu, es, o);
        l_mine = fmaf(l_mine, corr, es);
        m_mine = m_new;
#pragma unroll
        for (int h = 0; h < HB; ++h) {
            const float c = __shfl_sync(0xffffffffu, corr, h << SH);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] *= c;
        }
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) {
            float vf[8];
            vraw[j].get(vf);
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                const float w = __shfl_sync(0xffffffffu, e, (j * HB + h) << SH);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(w, vf[i], acc[h][i]);
            }
        }
    }
    // Every head's max and sum on every lane, then the warps merged pairwise.
    float m[HB], l[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        m[h] = __shfl_sync(0xffffffffu, m_mine, h << SH);
        l[h] = __shfl_sync(0xffffffffu, l_mine, h << SH);
    }
    bad = __syncthreads_or(bad);
#pragma unroll
    for (int half = AD_WARPS / 2; half >= 1; half /= 2) {
        if (warp >= half && warp < 2 * half) {
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                if (lane == 0) {
                    sm_m[warp - half][h] = m[h];
                    sm_l[warp - half][h] = l[h];
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) sm_acc[warp - half][h][lane * 8 + i] = acc[h][i];
            }
        }
        __syncthreads();
        if (warp < half) {
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                const float mo = sm_m[warp][h], lo = sm_l[warp][h], mx = fmaxf(m[h], mo);
                // A side that saw no key (sum 0, max -inf) contributes nothing.
                const float fa = l[h] > 0.0f ? expf(m[h] - mx) : 0.0f, fb = lo > 0.0f ? expf(mo - mx) : 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(acc[h][i], fa, sm_acc[warp][h][lane * 8 + i] * fb);
                l[h] = fmaf(l[h], fa, lo * fb);
                m[h] = mx;
            }
        }
        __syncthreads();
    }
    if (warp != 0 || !on) return;
#pragma unroll
    for (int h = 0; h < HB; ++h) {
        const u64 at = at0 + (u64)h * p.n_split;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * hd + (u64)(h0 + h) * hd : (float*)p.part_acc + at * hd;
        // Divided as attention_merge divides (num / den), so a row alone (one range, no merge)
        // gets the bits it gets beside deeper rows (its one range merged).
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = bad ? ATT_NAN : p.n_split == 1 ? acc[h][i] / l[h] : acc[h][i];
        *(float4*)(dst + lane * 8) = f4(y[0], y[1], y[2], y[3]);
        *(float4*)(dst + lane * 8 + 4) = f4(y[4], y[5], y[6], y[7]);
        if (p.n_split > 1 && lane == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = bad ? ATT_NAN : m[h];
            ml[1] = l[h];
        }
    }
}

// HB = p.heads_per_block (1, 2, 4 or 8; the launcher checks), the cache type from p.ty.
template <int HB>
__device__ __forceinline__ void attend_decode_ty(const AttentionParams& p, float* sm) {
    switch (p.ty) {
        case KV_F32: attend_decode<KV_F32, HB>(p, sm); break;
        case KV_F16: attend_decode<KV_F16, HB>(p, sm); break;
        default: attend_decode<KV_Q8_0, HB>(p, sm); break;
    }
}

extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attention_decode(const AttentionParams p) {
    pdl_enter();
    __shared__ __align__(16) float sm[AD_WARPS / 2 * 8 * (ATT_MAX_PER_LANE * 32 + 2)];
    switch (p.heads_per_block) {
        case 1: attend_decode_ty<1>(p, sm); break;
        case 2: attend_decode_ty<2>(p, sm); break;
        case 4: attend_decode_ty<4>(p, sm); break;
        default: attend_decode_ty<8>(p, sm); break;
    }
}

// ---------------------------------------------------------------------------------------------
// attention_tiles: flash attention over a tile of query vectors (prefill). A block takes up to
// AT_M query vectors of one sequence: TR = AT_M / hb consecutive rows x hb query heads that
// share one KV head (GQA: hb is the largest power of two dividing n_head / n_head_kv, at most
// AT_M), so each K/V page it loads into shared memory serves all of them. It walks the pages of
// its key range (all keys up to the tile's last position, or range blockIdx.z of keys_per_split
// keys when n_split > 1) with an online softmax, masking keys past each row's position.
// Per page of AT_N = 64 keys: S = Q·Kᵀ [64 x 64] in chunks of AT_DC dims (Q and K chunks staged
// transposed in shared memory, each thread a 4 x 4 block of S), then the softmax update of the 4
// query vectors a thread owns (max and sum over the 16 threads sharing them), P to shared
// memory, and O += P·V in chunks of AT_VK keys (each thread 4 query vectors x 4·(hd/64) dims).
// f32 throughout (K/V converted when staged). 256 threads: thread t owns query vectors
// 4·(t / 16) .. +4, keys 4·(t % 16) .. +4 of S and dims 4·(t % 16) + 64·c of O.
// grid (tiles, n_head / hb, n_split): tile x of the call is found by walking the sequences'
// row counts (seq_n), ceil(n / TR) tiles each. head_dim a multiple of 64 (the launcher checks).

#define AT_M 64
#define AT_N 64
#define AT_DC 32
#define AT_VK 16
#define AT_LD (AT_M + 4)  // row stride of the transposed Q/K chunks and of P: float4-aligned
#define AT_THREADS 256


extern "C" __global__ void __launch_bounds__(AT_THREADS, 2) attention_tiles(const AttentionParams p) {
    pdl_enter();
    // Q chunk [AT_DC][AT_LD] then K chunk [AT_DC][AT_LD]; in the value product, V [AT_VK][256].
    __shared__ __align__(16) float sm_qkv[2 * AT_DC * AT_LD];
    __shared__ __align__(16) float sm_p[AT_N * AT_LD];  // P transposed: [key][query vector]
    __shared__ u32 sm_kend;
    const u32 tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const u32 hd = p.head_dim, hb = p.heads_per_block, tr = AT_M / hb;
    const u32* seq_n = (const u32*)p.seq_n;
    // This block's tile: rows r0 .. r0 + nr of one sequence.
    u32 t = blockIdx.x, s = 0;
    for (; s < p.n_seq; ++s) {
        const u32 nt = (seq_n[s] + tr - 1) / tr;
        if (t < nt) break;
        t -= nt;
    }
    if (s >= p.n_seq) return;
    const u32 r0 = ((const u32*)p.seq_row0)[s] + t * tr, nr = min(tr, seq_n[s] - t * tr);
    const u32 h0 = blockIdx.y * hb, kvh = h0 / (p.n_head / p.n_head_kv);
    const u32* pos = (const u32*)p.pos;
    if (tid == 0) {
        u32 last = 0;
        for (u32 i = 0; i < nr; ++i) last = max(last, pos[r0 + i]);
        sm_kend = last + 1;
    }
    // The causal limit of each of this thread's query vectors (-1: not a row of the tile).
    int lim[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 row = (ty * 4 + a) / hb;
        lim[a] = row < nr ? (int)pos[r0 + row] : -1;
    }
    __syncthreads();
    const u32 slot = ((const u32*)p.row_slot)[r0];
    const u32 k_lo = blockIdx.z * p.keys_per_split;
    u32 k_hi = min(sm_kend, k_lo + p.keys_per_split);
    bool bad = slot >= p.n_slots || (k_hi + KV_PAGE - 1) / KV_PAGE > p.stride;
    if (bad || k_hi < k_lo) k_hi = k_lo;
    const u32* tk = (const u32*)p.table + ((u64)(bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    const u32* tv = tk + p.stride;
    const float* q = (const float*)p.q;
    float* qs = sm_qkv;
    float* ks = sm_qkv + AT_DC * AT_LD;
    float* vs = sm_qkv;

    float m[4], l[4], o[4][16];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = ATT_NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) o[a][j] = 0.0f;
    }

    for (u32 kb = k_lo; kb < k_hi; kb += AT_N) {
        const u32 nk = min((u32)AT_N, k_hi - kb);
        u32 pk = tk[kb / KV_PAGE], pv = tv[kb / KV_PAGE];
        if (pk >= p.n_pages || pv >= p.n_pages) {
            bad = true;
            pk = pv = 0;
        }
        const u8* kpage = (const u8*)p.pool + (u64)pk * KV_PAGE * p.row_bytes;
        const u8* vpage = (const u8*)p.pool + (u64)pv * KV_PAGE * p.row_bytes;

        // S = scale · Q·Kᵀ.
        float sc[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) sc[a][b] = 0.0f;
        for (u32 c0 = 0; c0 < hd; c0 += AT_DC) {
            __syncthreads();  // the previous chunk (or the previous page's V) is consumed
            const u32 d = tid % 32;
#pragma unroll
            for (int j = 0; j < AT_M / 8; ++j) {
                const u32 i = tid / 32 + 8 * j, row = i / hb;
                qs[d * AT_LD + i] =
                    row < nr ? q[(u64)(r0 + row) * p.n_head * hd + (u64)(h0 + i % hb) * hd + c0 + d] * p.scale : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < AT_N / 8; ++j) {
                const u32 key = tid / 32 + 8 * j;
                ks[d * AT_LD + key] = key < nk ? kv_at(kpage + (u64)key * p.row_bytes, p.ty, kvh * hd + c0 + d) : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int c = 0; c < AT_DC; ++c) {
                const float4 qa = ld4(qs + c * AT_LD + ty * 4), kk = ld4(ks + c * AT_LD + tx * 4);
                const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) sc[a][b] = fmaf(qv[a], kv[b], sc[a][b]);
            }
        }

        // Online softmax of the 4 query vectors over this page's keys; P to shared memory.
        // (sc becomes P in place.)
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            float mt = ATT_NEG_INF;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 key = kb + tx * 4 + b;
                if (key >= k_hi || (int)key > lim[a]) sc[a][b] = ATT_NEG_INF;
                mt = fmaxf(mt, sc[a][b]);
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
            const float m_new = fmaxf(m[a], mt);
            // No key seen yet (m_new = -inf): nothing to rescale, every p is 0.
            const bool none = m_new == ATT_NEG_INF;
            const float corr = none ? 1.0f : expf(m[a] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                sc[a][b] = none ? 0.0f : expf(sc[a][b] - m_new);
                sum += sc[a][b];
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            l[a] = l[a] * corr + sum;
            m[a] = m_new;
#pragma unroll
            for (int j = 0; j < 16; ++j) o[a][j] *= corr;
        }
#pragma unroll
        for (int b = 0; b < 4; ++b)
            *(float4*)(sm_p + (tx * 4 + b) * AT_LD + ty * 4) = f4(sc[0][b], sc[1][b], sc[2][b], sc[3][b]);

        // O += P·V, AT_VK keys at a time.
        for (u32 v0 = 0; v0 < nk; v0 += AT_VK) {
            __syncthreads();  // P is written; the K chunk (or the previous V chunk) is consumed
            for (u32 e = tid; e < AT_VK * hd; e += AT_THREADS) {
                const u32 key = e / hd, d = e % hd;
                vs[key * 256 + d] = v0 + key < nk ? kv_at(vpage + (u64)(v0 + key) * p.row_bytes, p.ty, kvh * hd + d) : 0.0f;
            }
            __syncthreads();
#pragma unroll 4
            for (int k = 0; k < AT_VK; ++k) {
                const float4 pa = ld4(sm_p + (v0 + k) * AT_LD + ty * 4);
                const float pv4[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (c * 64 >= hd) break;
                    const float4 vv = ld4(vs + k * 256 + c * 64 + tx * 4);
#pragma unroll
                    for (int a = 0; a < 4; ++a) {
                        o[a][c * 4 + 0] = fmaf(pv4[a], vv.x, o[a][c * 4 + 0]);
                        o[a][c * 4 + 1] = fmaf(pv4[a], vv.y, o[a][c * 4 + 1]);
                        o[a][c * 4 + 2] = fmaf(pv4[a], vv.z, o[a][c * 4 + 2]);
                        o[a][c * 4 + 3] = fmaf(pv4[a], vv.w, o[a][c * 4 + 3]);
                    }
                }
            }
        }
    }

    // The output (n_split = 1) or this range's partial result.
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 i = ty * 4 + a, row = i / hb;
        if (row >= nr) continue;
        const u32 r = r0 + row, n = h0 + i % hb;
        const u64 at = ((u64)r * p.n_head + n) * p.n_split + blockIdx.z;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd : (float*)p.part_acc + at * hd;
        const float f = p.n_split == 1 ? 1.0f / l[a] : 1.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (c * 64 >= hd) break;
            const float4 v = bad ? f4(ATT_NAN, ATT_NAN, ATT_NAN, ATT_NAN)
                                 : f4(o[a][c * 4] * f, o[a][c * 4 + 1] * f, o[a][c * 4 + 2] * f, o[a][c * 4 + 3] * f);
            *(float4*)(dst + c * 64 + tx * 4) = v;
        }
        if (p.n_split > 1 && tx == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = bad ? ATT_NAN : m[a];
            ml[1] = l[a];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attention_mma: attention_tiles on tensor cores (Precision::Fast, sm_80+): the same tiles,
// grid, key ranges and partial results, with S = Q·Kᵀ and O += P·V as mma.m16n8k16 over f16
// operands (Q scaled then rounded to f16, K and V rounded to f16 when staged, P rounded to f16)
// and f32 sums and softmax. 4 warps; warp w owns query vectors 16w .. 16w + 16 of the tile
// and every head dim of O (head_dim / 8 accumulator tiles of 16 x 8 in registers). Shared
// memory (dynamic, ATM_SMEM bytes = 99 KiB, what sm_86 allows a block): Q, the page's K and
// its V, each [64][ATM_LD] f16 (row stride 132 words: the 32 lanes of a fragment load, row g
// and word t, hit 32 banks; ldmatrix's 8 rows of 16 bytes hit distinct bank groups). An F16
// cache is copied to shared memory as it is, by cp.async, one page ahead: the next page's K
// loads while this page's softmax and P·V run, its V while the next S runs; other cache
// types are converted by the threads. The B fragments of P·V come from V [key][dim] by
// ldmatrix.trans. head_dim a multiple of 16, at most 256; the thread with lane l holds rows
// g = l / 4 and g + 8 of its warp's tile and keys / dims 2t, 2t + 1 (t = l % 4) of each
// 8-wide tile: the accumulator layout of the mma, which is also the A layout of P for P·V
// (PTX ISA, "Matrix Fragments for mma.m16n8k16").

#define ATM_LD 264  // 256 + 8 halves
#define ATM_THREADS 128
#define ATM_SMEM (3 * 64 * ATM_LD * 2)

__device__ __forceinline__ uint4 pack8(const float* x) {
    uint4 v;
    v.x = pack_f16x2(x[0], x[1]);
    v.y = pack_f16x2(x[2], x[3]);
    v.z = pack_f16x2(x[4], x[5]);
    v.w = pack_f16x2(x[6], x[7]);
    return v;
}

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; n = 0 writes zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Four 8x8 f16 matrices, transposed: lanes 8q .. 8q + 8 give the row addresses of matrix q.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// One K or V page (keys [0, nk) of it; zeros past them) into buf [64][ATM_LD] as f16.
template <int TY>
__device__ __forceinline__ void stage_page(u16* buf, const u8* page, u32 row_bytes, u32 e0, u32 nk, u32 d8s) {
    for (u32 u = threadIdx.x; u < AT_N * d8s; u += ATM_THREADS) {
        const u32 key = u / d8s, d8 = u % d8s * 8;
        const u8* src = page + (u64)(key < nk ? key : 0) * row_bytes;
        if (TY == KV_F16) {
            cp_async16(buf + key * ATM_LD + d8, src + 2 * (u64)(e0 + d8), key < nk ? 16 : 0);
        } else {
            Row8<TY> raw;
            raw.load(src, e0 + d8, key < nk);
            float x[8];
            raw.get(x);
            *(uint4*)(buf + key * ATM_LD + d8) = pack8(x);
        }
    }
    cp_async_commit();  // a group even when empty, so the waits below count pages
}
#endif

template <int TY>
__device__ void attend_mma(const AttentionParams& p, u16* qs) {
#if __CUDA_ARCH__ >= 800
    u16 *ks = qs + 64 * ATM_LD, *vs = ks + 64 * ATM_LD;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane >> 2, t = lane & 3;
    const u32 hd = p.head_dim, hb = p.heads_per_block, tr = AT_M / hb, d8s = hd / 8;
    const u32* seq_n = (const u32*)p.seq_n;
    u32 ti = blockIdx.x, s = 0;
    for (; s < p.n_seq; ++s) {
        const u32 nt = (seq_n[s] + tr - 1) / tr;
        if (ti < nt) break;
        ti -= nt;
    }
    if (s >= p.n_seq) return;
    const u32 r0 = ((const u32*)p.seq_row0)[s] + ti * tr, nr = min(tr, seq_n[s] - ti * tr);
    const u32 h0 = blockIdx.y * hb, kvh = h0 / (p.n_head / p.n_head_kv);
    const u32* pos = (const u32*)p.pos;
    u32 kend = 0;  // every thread: one past the tile's last position
    for (u32 i = 0; i < nr; ++i) kend = max(kend, pos[r0 + i] + 1);
    int lim[2];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 row = (16 * warp + g + 8 * a) / hb;
        lim[a] = row < nr ? (int)pos[r0 + row] : -1;
    }
    const u32 slot = ((const u32*)p.row_slot)[r0];
    const u32 k_lo = blockIdx.z * p.keys_per_split;
    u32 k_hi = min(kend, k_lo + p.keys_per_split);
    bool bad = slot >= p.n_slots || (k_hi + KV_PAGE - 1) / KV_PAGE > p.stride;
    if (bad || k_hi < k_lo) k_hi = k_lo;
    const u32* tk = (const u32*)p.table + ((u64)(bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    const u32* tv = tk + p.stride;
    // Page kb of the K (or V) cache; an id out of range reads page 0 and marks the result bad.
    auto page = [&](const u32* tab, u32 kb) {
        u32 id = tab[kb / KV_PAGE];
        if (id >= p.n_pages) {
            bad = true;
            id = 0;
        }
        return (const u8*)p.pool + (u64)id * KV_PAGE * p.row_bytes;
    };
    const u32 e0 = kvh * hd;
    if (k_lo < k_hi) {
        stage_page<TY>(ks, page(tk, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
        stage_page<TY>(vs, page(tv, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
    }
    // Q: vector i = (row i / hb, head h0 + i % hb), scaled, as f16; zeros past the tile's rows.
    for (u32 u = tid; u < AT_M * d8s; u += ATM_THREADS) {
        const u32 i = u / d8s, d8 = u % d8s * 8, row = i / hb;
        float x[8];
        if (row < nr) {
            const float* qr = (const float*)p.q + (u64)(r0 + row) * p.n_head * hd + (u64)(h0 + i % hb) * hd + d8;
            const float4 a = ld4(qr), b = ld4(qr + 4);
            x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] *= p.scale;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = 0.0f;
        }
        *(uint4*)(qs + i * ATM_LD + d8) = pack8(x);
    }

    float o[32][4], m[2], l[2];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    m[0] = m[1] = ATT_NEG_INF;
    l[0] = l[1] = 0.0f;
    const u16* qa = qs + (16 * warp + g) * ATM_LD + 2 * t;
    // ldmatrix rows of this lane for P·V: matrix q = lane / 8 is keys 8(q & 1) .. + 8 of a
    // 16-key step at dims 8(q >> 1) .. + 8 of a pair of 8-dim tiles.
    const u16* vl = vs + ((lane >> 3 & 1) * 8 + (lane & 7)) * ATM_LD + (lane >> 4) * 8;

    for (u32 kb = k_lo; kb < k_hi; kb += AT_N) {
        const u32 next = kb + AT_N, nk_next = next < k_hi ? min((u32)AT_N, k_hi - next) : 0;
        cp_async_wait<1>();  // this page's K (its V may still be in flight)
        __syncthreads();
        // S = Q·Kᵀ: 8 tiles of 8 keys.
        float sc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        for (u32 k0 = 0; k0 < hd; k0 += 16) {
            u32 a[4];
            a[0] = *(const u32*)(qa + k0);
            a[1] = *(const u32*)(qa + 8 * ATM_LD + k0);
            a[2] = *(const u32*)(qa + k0 + 8);
            a[3] = *(const u32*)(qa + 8 * ATM_LD + k0 + 8);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u16* kr = ks + (8 * j + g) * ATM_LD + k0 + 2 * t;
                const u32 b[2] = {*(const u32*)kr, *(const u32*)(kr + 8)};
                mma_16816(sc[j], a, b);
            }
        }
        __syncthreads();  // every warp is done with K: the next page's K loads meanwhile
        if (nk_next > 0) {
            stage_page<TY>(ks, page(tk, next), p.row_bytes, e0, nk_next, d8s);
        } else {
            cp_async_commit();
        }
        // Online softmax of rows g and g + 8 (a quad of lanes shares a row); sc becomes P.
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            float mt = ATT_NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const u32 key = kb + 8 * j + 2 * t + c;
                    if (key >= k_hi || (int)key > lim[a]) sc[j][2 * a + c] = ATT_NEG_INF;
                    mt = fmaxf(mt, sc[j][2 * a + c]);
                }
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            const float m_new = fmaxf(m[a], mt);
            const bool none = m_new == ATT_NEG_INF;
            const float corr = none ? 1.0f : expf(m[a] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float e = none ? 0.0f : expf(sc[j][2 * a + c] - m_new);
                    sc[j][2 * a + c] = e;
                    sum += e;
                }
            l[a] = l[a] * corr + sum;  // this thread's keys; the quad's are added at the end
            m[a] = m_new;
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                o[n][2 * a] *= corr;
                o[n][2 * a + 1] *= corr;
            }
        }
        cp_async_wait<1>();  // this page's V (the next page's K may still be in flight)
        __syncthreads();
        // O += P·V: 4 steps of 16 keys, head_dim / 16 pairs of 8-dim tiles.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[4];
            a[0] = pack_f16x2(sc[2 * kk][0], sc[2 * kk][1]);
            a[1] = pack_f16x2(sc[2 * kk][2], sc[2 * kk][3]);
            a[2] = pack_f16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            a[3] = pack_f16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < 32; n += 2) {
                if (8 * n >= (int)hd) break;
                u32 b[4];
                ldmatrix_x4_trans(b, vl + 16 * kk * ATM_LD + 8 * n);
                mma_16816(o[n], a, b);
                mma_16816(o[n + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with V: the next page's V loads meanwhile
        if (nk_next > 0) {
            stage_page<TY>(vs, page(tv, next), p.row_bytes, e0, nk_next, d8s);
        } else {
            cp_async_commit();
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        l[a] += __shfl_xor_sync(0xffffffffu, l[a], 1);
        l[a] += __shfl_xor_sync(0xffffffffu, l[a], 2);
    }
    // The output (n_split = 1) or this range's partial result, as attention_tiles writes it.
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 i = 16 * warp + g + 8 * a, row = i / hb;
        if (row >= nr) continue;
        const u32 r = r0 + row, n = h0 + i % hb;
        const u64 at = ((u64)r * p.n_head + n) * p.n_split + blockIdx.z;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd : (float*)p.part_acc + at * hd;
        const float f = p.n_split == 1 ? 1.0f / l[a] : 1.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            if (8 * c >= (int)hd) break;
            float2 v;
            v.x = bad ? ATT_NAN : o[c][2 * a] * f;
            v.y = bad ? ATT_NAN : o[c][2 * a + 1] * f;
            *(float2*)(dst + 8 * c + 2 * t) = v;
        }
        if (p.n_split > 1 && t == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = bad ? ATT_NAN : m[a];
            ml[1] = l[a];
        }
    }
#endif
}

// grid and parameters as attention_tiles; dynamic shared memory ATM_SMEM bytes.
extern "C" __global__ void __launch_bounds__(ATM_THREADS, 2) attention_mma(const AttentionParams p) {
    pdl_enter();
    extern __shared__ __align__(16) u16 atm_sm[];
    switch (p.ty) {
        case KV_F32: attend_mma<KV_F32>(p, atm_sm); break;
        case KV_F16: attend_mma<KV_F16>(p, atm_sm); break;
        default: attend_mma<KV_Q8_0>(p, atm_sm); break;
    }
}
