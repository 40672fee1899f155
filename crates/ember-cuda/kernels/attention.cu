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

__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 f4(float x, float y, float z, float w) {
    float4 v;
    v.x = x;
    v.y = y;
    v.z = z;
    v.w = w;
    return v;
}

extern "C" __global__ void __launch_bounds__(AT_THREADS, 2) attention_tiles(const AttentionParams p) {
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
