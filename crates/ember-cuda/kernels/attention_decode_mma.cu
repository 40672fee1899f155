// attention_decode_mma: attention_decode's rows, key ranges and partial results on tensor cores
// (Precision::Fast, sm_80+, F16 cache, head_dim D = 64, 128 or 256). A block takes one row, the
// HB <= 8 query heads of one KV head's group that the launcher gives it, and one key range
// (decode_keys_per_split: the same ranges as attention_decode, a function of the row's own
// keys). Its W warps take the range's tiles of ADM_KT = 16 keys in turn (warp w: tiles w,
// w + W, ...), each staging its tiles' K and V rows in its own ring of S stages in shared memory
// by cp.async (S - 1 tiles in flight while it computes one; no barrier between warps), and keeps
// its own online softmax:
//   Sᵀ = K·Qᵀ, one mma.m16n8k16 a 16-dim step (M: the tile's 16 keys by ldmatrix, N: the 8
//     heads, Q's fragments held in registers for the whole range, zeros past HB), summed in
//     four accumulators (one dependent chain of D / 16 mmas would be latency bound);
//   the softmax: the accumulator gives lane l keys g, g + 8 (g = l / 4) of heads 2t, 2t + 1
//     (t = l % 4); each head's max over the tile by three shuffles;
//   Oᵀ += Vᵀ·Pᵀ, one mma a 16-dim tile of O (M: dims by ldmatrix.trans, N: the heads, K: the 16
//     keys): Pᵀ's fragment is the softmax's accumulator layout transposed per 8x8 matrix by
//     movmatrix. Oᵀ's accumulator (D / 16 tiles) gives lane l dims g, g + 8 of heads 2t, 2t + 1.
// The warps are merged through shared memory in a fixed order, as the decode kernel writes its
// output (n_split = 1) or its partial (max, sum, unnormalised values) for attention_merge.
// Q is scaled and rounded to f16, P to f16; sums in f32 (attention_mma's numerics). Per 16 keys
// and all HB heads a warp issues ~2·D / 16 ldmatrix and mmas where the scalar kernel issues
// ~3,700 instructions for 8 heads: a row alone at depth is then bound by its loads, not by each
// warp's chain of dependent steps (docs/perf.md GPU g25).
// grid (n_head / HB, n_rows, n_split), 32·W threads, ADM_SMEM(D, W, S) bytes of dynamic shared
// memory (the rings; the merge reuses them).

#define ADM_KT 16

template <int D, int W, int S>
__device__ void attend_decode_mma(const AttentionParams& p, u16* sm) {
#if __CUDA_ARCH__ >= 800
    constexpr int LD = D + 8;                // row stride in halves: ldmatrix's 8 rows hit distinct bank groups
    constexpr int STAGE = 2 * ADM_KT * LD;   // halves: the tile's K rows, then its V rows
    constexpr int NK = D / 16;               // 16-dim steps (Sᵀ) and 16-dim tiles (Oᵀ)
    constexpr int CH = D / 8;                // 16-byte chunks of a row
    constexpr int PER = ADM_KT * CH / 32;    // chunks a lane copies for K (and again for V)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
    const u32 hb = p.heads_per_block, r = blockIdx.y, s = blockIdx.z;
    const u32 h0 = blockIdx.x * hb, kvh = h0 / (p.n_head / p.n_head_kv);
    DecodeRange dr;
    if (!decode_range(p, r, s, h0, hb, dr)) return;  // past the row's ranges
    const u32 k0 = dr.k0, k1 = dr.k1;
    const u64 at0 = dr.at0;  // head h0 + h: at0 + h · n_split
    bool bad = dr.bad;
    const u32 *tk = dr.tk, *tv = dr.tv;
    const u64 e0 = (u64)kvh * D;

    // Qᵀ as B fragments (k: dims, n: head g of the block), scaled, f16; zeros past hb.
    u32 qb[NK][2];
    {
        const bool on = (u32)g < hb;
        const float* qr = (const float*)p.q + (u64)r * p.n_head * D + (u64)(h0 + (on ? g : 0)) * D + 2 * t;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            const float2 a = on ? *(const float2*)(qr + 16 * k) : make_float2(0.0f, 0.0f);
            const float2 b = on ? *(const float2*)(qr + 16 * k + 8) : make_float2(0.0f, 0.0f);
            qb[k][0] = pack_f16x2(a.x * p.scale, a.y * p.scale);
            qb[k][1] = pack_f16x2(b.x * p.scale, b.y * p.scale);
        }
    }

    u16* ring = sm + warp * S * STAGE;
    const u32 ring_at = smem_addr(ring);
    constexpr u32 STEP = ADM_KT * W;  // keys between a warp's tiles
    // Tile kb's K and V rows into stage `st` (keys past k1: zeros, read from nowhere); a tile
    // past k1 copies nothing. One commit group a tile either way, so the waits count tiles.
    auto fetch = [&](int st, u32 kb) {
        if (kb < k1) {
            u32 pk = tk[kb / KV_PAGE], pv = tv[kb / KV_PAGE];
            if (pk >= p.n_pages || pv >= p.n_pages) {
                bad = true;
                pk = pv = 0;
            }
            const u32 nk = min((u32)ADM_KT, k1 - kb);
            const u8* kr = (const u8*)p.pool + ((u64)pk * KV_PAGE + kb % KV_PAGE) * p.row_bytes + 2 * e0;
            const u8* vr = (const u8*)p.pool + ((u64)pv * KV_PAGE + kb % KV_PAGE) * p.row_bytes + 2 * e0;
            const u32 dst = ring_at + st * STAGE * 2;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int u = lane + 32 * i, row = u / CH, c = u % CH;
                const bool in = (u32)row < nk;
                const u64 off = (u64)(in ? row : 0) * p.row_bytes + 16 * c;
                cp_async16_at(dst + (row * LD + 8 * c) * 2, kr + off, in ? 16 : 0);
                cp_async16_at(dst + ((ADM_KT + row) * LD + 8 * c) * 2, vr + off, in ? 16 : 0);
            }
        }
        cp_async_commit();
    };

    float o[NK][4], m[2], l[2];
#pragma unroll
    for (int k = 0; k < NK; ++k) o[k][0] = o[k][1] = o[k][2] = o[k][3] = 0.0f;
    m[0] = m[1] = ATT_NEG_INF;
    l[0] = l[1] = 0.0f;
    // ldmatrix rows of this lane. K (A of Sᵀ, 16 keys x 16 dims): matrix q = lane / 8 is keys
    // 8(q & 1) .. + 8 at dims 8(q >> 1) .. + 8. V (A of Oᵀ by .trans, 16 dims x 16 keys):
    // matrix q is keys 8(q >> 1) .. + 8 at dims 8(q & 1) .. + 8.
    const int ka = ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
    const int va = (ADM_KT + (lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);

    const u32 kb0 = bad ? k1 : k0 + ADM_KT * warp;
#pragma unroll
    for (int i = 0; i < S - 1; ++i) fetch(i, kb0 + i * STEP);
    int st = 0;
    for (u32 kb = kb0; kb < k1; kb += STEP) {
        __syncwarp();  // every lane is done with the stage the next fetch fills (the last tile's)
        fetch((st + S - 1) % S, kb + (S - 1) * STEP);
        cp_async_wait<S - 1>();  // this tile's copies (this lane's)
        __syncwarp();            // and every lane's
        const u16* tile = ring + st * STAGE;
        st = st + 1 == S ? 0 : st + 1;
        // Sᵀ = K·Qᵀ: lane holds (key g, head 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
        float c4[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) c4[j][0] = c4[j][1] = c4[j][2] = c4[j][3] = 0.0f;
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            u32 a[4];
            ldmatrix_x4(a, tile + ka + 16 * k);
            mma_16816(c4[k % 4], a, qb[k]);
        }
        float sc[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[j] = (c4[0][j] + c4[1][j]) + (c4[2][j] + c4[3][j]);
        if (kb + ADM_KT > k1) {  // the range's last tile: keys past k1 are not keys
            if (kb + g >= k1) sc[0] = sc[1] = ATT_NEG_INF;
            if (kb + g + 8 >= k1) sc[2] = sc[3] = ATT_NEG_INF;
        }
        // The online softmax of heads 2t + c: the tile's max over its 16 keys (lanes of one t).
        float corr[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float mt = fmaxf(sc[c], sc[c + 2]);
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
            const float m_new = fmaxf(m[c], mt);
            const bool none = m_new == ATT_NEG_INF;
            corr[c] = none ? 1.0f : exp_fast(m[c] - m_new);
            const float ea = none ? 0.0f : exp_fast(sc[c] - m_new), eb = none ? 0.0f : exp_fast(sc[c + 2] - m_new);
            sc[c] = ea;
            sc[c + 2] = eb;
            l[c] = l[c] * corr[c] + (ea + eb);  // this lane's keys; the others' are added at the end
            m[c] = m_new;
        }
        if (!__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) {
#pragma unroll
            for (int k = 0; k < NK; ++k) {
                o[k][0] *= corr[0];
                o[k][1] *= corr[1];
                o[k][2] *= corr[0];
                o[k][3] *= corr[1];
            }
        }
        // Pᵀ as the B fragment of Oᵀ += Vᵀ·Pᵀ (k: keys 2t, 2t + 1 and + 8, n: head g).
        u32 pb[2];
        pb[0] = movmatrix_trans(pack_f16x2(sc[0], sc[1]));
        pb[1] = movmatrix_trans(pack_f16x2(sc[2], sc[3]));
#pragma unroll
        for (int k = 0; k < NK; ++k) {
            u32 a[4];
            ldmatrix_x4_trans(a, tile + va + 16 * k);
            mma_16816(o[k], a, pb);
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        l[c] += __shfl_xor_sync(0xffffffffu, l[c], 4);
        l[c] += __shfl_xor_sync(0xffffffffu, l[c], 8);
        l[c] += __shfl_xor_sync(0xffffffffu, l[c], 16);
    }
    bad = __syncthreads_or(bad);  // also: every warp is done with its ring, which the merge reuses
    // The warps' (max, sum, values) through shared memory: [W][8][D] values, then [W][8] maxima
    // and sums.
    float* so = (float*)sm;
    float* sm_m = so + W * 8 * D;
    float* sm_l = sm_m + W * 8;
#pragma unroll
    for (int k = 0; k < NK; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) so[(warp * 8 + 2 * t + (j & 1)) * D + 16 * k + g + 8 * (j >> 1)] = o[k][j];
    if (g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sm_m[warp * 8 + 2 * t + c] = m[c];
            sm_l[warp * 8 + 2 * t + c] = l[c];
        }
    }
    __syncthreads();
    // Thread u of the block: head u / (D / 4), dims 4(u % (D / 4)) .. + 4; warps in order.
    for (u32 u = threadIdx.x; u < hb * (D / 4); u += 32 * W) {
        const u32 h = u / (D / 4), d = 4 * (u % (D / 4));
        float mx = ATT_NEG_INF;
#pragma unroll
        for (int w = 0; w < W; ++w)
            if (sm_l[w * 8 + h] > 0.0f) mx = fmaxf(mx, sm_m[w * 8 + h]);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, den = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float lw = sm_l[w * 8 + h];
            const float f = lw > 0.0f ? expf(sm_m[w * 8 + h] - mx) : 0.0f;  // a warp that saw no key adds nothing
            const float4 v = *(const float4*)(so + (w * 8 + h) * D + d);
            acc[0] = fmaf(v.x, f, acc[0]);
            acc[1] = fmaf(v.y, f, acc[1]);
            acc[2] = fmaf(v.z, f, acc[2]);
            acc[3] = fmaf(v.w, f, acc[3]);
            den = fmaf(lw, f, den);
        }
        const u64 at = at0 + (u64)h * p.n_split;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * D + (u64)(h0 + h) * D : (float*)p.part_acc + at * D;
        float y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) y[i] = bad ? ATT_NAN : p.n_split == 1 ? acc[i] / den : acc[i];
        // The gate (and the int8 copy) on the output: whole warps of 8-lane blocks where the
        // launcher sets it (D a multiple of 128: hb · D / 4 threads a multiple of 32).
        const bool gated = p.n_split == 1 && p.gate;
        const u64 oi = ((u64)r * p.n_head + h0 + h) * D + d;
        if (gated) {
#pragma unroll
            for (int i = 0; i < 4; ++i) y[i] = attn_gated(p, y[i], oi + i);
        }
        *(float4*)(dst + d) = f4(y[0], y[1], y[2], y[3]);
        if (gated && p.q8) quad_q8(y, (u8*)p.q8, (u64)p.n_rows * p.n_head * D, oi);
        if (p.n_split > 1 && d == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = bad ? ATT_NAN : mx;
            ml[1] = den;
        }
    }
#endif
}

// Dynamic shared memory of an entry: the W rings of S stages (the merge's W·8·(D + 2) floats fit
// in them for every instance below).
#define ADM_SMEM(D, W, S) ((W) * (S) * 2 * ADM_KT * ((D) + 8) * 2)

#define ATTENTION_DECODE_MMA_ENTRY(D, W, S)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W, 1) attention_decode_mma_d##D##_w##W##_s##S(const AttentionParams p) { \
        pdl_enter();                                                                                             \
        extern __shared__ __align__(16) u16 adm_sm[];                                                            \
        attend_decode_mma<D, W, S>(p, adm_sm);                                                                   \
    }
ATTENTION_DECODE_MMA_ENTRY(64, 4, 2)
ATTENTION_DECODE_MMA_ENTRY(128, 4, 2)
ATTENTION_DECODE_MMA_ENTRY(256, 4, 2)
ATTENTION_DECODE_MMA_ENTRY(256, 4, 3)
ATTENTION_DECODE_MMA_ENTRY(256, 2, 2)
ATTENTION_DECODE_MMA_ENTRY(256, 2, 3)
