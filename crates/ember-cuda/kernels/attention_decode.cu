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

// The K and V rows of one group of AD_KG keys, as loaded (Row8: this lane's 8 dims of a row).
template <int TY>
struct KvGroup {
    Row8<TY> k[AD_KG], v[AD_KG];
};

// Groups a warp of a `_pf` entry loads ahead of the one it computes (attend_decode's ring), as
// measured on an H100 (docs/perf.md, GPU g21): F16 2, or 1 for 8 heads (8 heads' q and acc
// hold 128 registers; an F16 row is 4 registers a key); F32 1, none for 8 heads (it spills);
// Q8_0 none (two groups ahead were slower than none at depth 32768: 75 against 64 us).
// EMBER_AD_PF0: none anywhere (for A/B runs).
__host__ __device__ constexpr int ad_prefetch(int ty, int hb) {
#ifdef EMBER_AD_PF0
    return 0 * ty * hb;
#else
    return ty == KV_Q8_0 ? 0 : ty == KV_F32 ? (hb >= 8 ? 0 : 1) : (hb >= 8 ? 1 : 2);
#endif
}

template <int TY, int HB, int PF>
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
    DecodeRange dr;
    if (!decode_range(p, r, s, h0, HB, dr)) return;
    const u32 k0 = dr.k0, k1 = dr.k1;
    const u64 at0 = dr.at0;
    bool bad = dr.bad;
    const u32 *tk = dr.tk, *tv = dr.tv;
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
    // The warp's groups: kb = kb0, kb0 + KS, ... below k1. A group's K and V rows are loaded
    // PF groups ahead of their use, into a ring of PF + 1 groups in registers, so the warp
    // has that many groups' loads in flight while it computes one (a step is otherwise a full
    // round trip to memory, then the step's shuffles: one row at depth 32768 is 32 steps a warp).
    // A bad slot or a range past the table reads nothing (and gives NaN).
    constexpr u32 KS = AD_WARPS * AD_KG;
    const u32 kb0 = bad ? k1 : k0 + warp * AD_KG;
    // kb is a multiple of AD_KG, so a group's keys share a page; keys past k1 are not read
    // (zeros: their rows may hold anything, NaN included) and masked; a group past k1 loads nothing.
    auto fetch = [&](KvGroup<TY>& g, u32 kb) {
        if (kb >= k1) return;
        u32 pk = tk[kb / KV_PAGE], pv = tv[kb / KV_PAGE];
        if (pk >= p.n_pages || pv >= p.n_pages) {
            bad = true;
            pk = pv = 0;
        }
        const u8* kr = (const u8*)p.pool + ((u64)pk * KV_PAGE + kb % KV_PAGE) * p.row_bytes;
        const u8* vr = (const u8*)p.pool + ((u64)pv * KV_PAGE + kb % KV_PAGE) * p.row_bytes;
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) g.k[j].load(kr + (u64)j * p.row_bytes, e0, on && kb + j < k1);
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) g.v[j].load(vr + (u64)j * p.row_bytes, e0, on && kb + j < k1);
    };
    // One group's step: scores, the online softmax, the values.
    auto step = [&](const KvGroup<TY>& g, u32 kb) {
        float x[NV];
#pragma unroll
        for (int j = 0; j < AD_KG; ++j) {
            float kf[8];
            g.k[j].get(kf);
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
            g.v[j].get(vf);
#pragma unroll
            for (int h = 0; h < HB; ++h) {
                const float w = __shfl_sync(0xffffffffu, e, (j * HB + h) << SH);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(w, vf[i], acc[h][i]);
            }
        }
    };
    KvGroup<TY> ring[PF + 1];
#pragma unroll
    for (int i = 0; i < PF; ++i) fetch(ring[i], kb0 + i * KS);
    for (u32 kb = kb0; kb < k1; kb += (PF + 1) * KS) {
#pragma unroll
        for (int b = 0; b <= PF; ++b) {
            const u32 kc = kb + b * KS;
            if (kc >= k1) break;
            fetch(ring[(b + PF) % (PF + 1)], kc + PF * KS);
            step(ring[b], kc);
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

// One entry for each cache type and HB (the launcher names the one for p.ty and
// p.heads_per_block), each with the registers its own instance needs: the smaller ones are not
// held to the 8-head one's count (240 registers in one entry: 2 blocks an SM). `_pf` entries
// load ad_prefetch groups ahead, at the cost of registers (F16, 4 heads: 218 against 128, so 2
// blocks an SM, not 4): the launcher takes them where a warp walks many groups.
#define ATTENTION_DECODE_ENTRY(NAME, TY, HB, SUFFIX, PF)                                              \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attention_decode_##NAME##_h##HB##SUFFIX(const AttentionParams p) { \
        pdl_enter();                                                                                  \
        __shared__ __align__(16) float sm[AD_WARPS / 2 * HB * (ATT_MAX_PER_LANE * 32 + 2)];           \
        attend_decode<TY, HB, PF>(p, sm);                                                             \
    }
#define ATTENTION_DECODE_ENTRIES(NAME, TY) \
    ATTENTION_DECODE_ENTRY(NAME, TY, 1, , 0)    \
    ATTENTION_DECODE_ENTRY(NAME, TY, 2, , 0)    \
    ATTENTION_DECODE_ENTRY(NAME, TY, 4, , 0)    \
    ATTENTION_DECODE_ENTRY(NAME, TY, 8, , 0)
#define ATTENTION_DECODE_PF_ENTRIES(NAME, TY)                    \
    ATTENTION_DECODE_ENTRY(NAME, TY, 1, _pf, ad_prefetch(TY, 1)) \
    ATTENTION_DECODE_ENTRY(NAME, TY, 2, _pf, ad_prefetch(TY, 2)) \
    ATTENTION_DECODE_ENTRY(NAME, TY, 4, _pf, ad_prefetch(TY, 4)) \
    ATTENTION_DECODE_ENTRY(NAME, TY, 8, _pf, ad_prefetch(TY, 8))
ATTENTION_DECODE_ENTRIES(f32, KV_F32)
ATTENTION_DECODE_ENTRIES(f16, KV_F16)
ATTENTION_DECODE_ENTRIES(q8_0, KV_Q8_0)
// Q8_0 has no ring (ad_prefetch), so no _pf entries.
ATTENTION_DECODE_PF_ENTRIES(f32, KV_F32)
ATTENTION_DECODE_PF_ENTRIES(f16, KV_F16)
