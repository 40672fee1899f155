// attention_wg: attention_mma_w8's tiles (128 query vectors, 8 warps = two warpgroups of 64
// rows) for an F16 cache of head_dim 256 with both products on wgmma and the pages in flight
// two deep (docs/attention-wgmma.md step 3; sm_90a only; EMBER_ATTN_WG=0 turns it off: it gives
// attention_mma_w8's bits at 1.7x its speed on an H100, docs/perf.md g32). Per
// page n, every thread of a warpgroup:
//   wait for K(n) and V(n - 1); issue S(n) = Q·K(n)ᵀ and O += P(n - 1)·V(n - 1); wait for S(n)
//   only and run page n's softmax on the CUDA cores while the tensor cores add P(n - 1)·V(n - 1);
//   wait for that; O by page n's correction, P(n) = f16(S(n)); then, once every warp is past
//   both products, load K(n + 2) and V(n + 1) into the stages just freed.
// Shared memory (1,024-aligned: the launch gives 1 KiB of slack): Q [128][256], K twice and V
// twice [64][256], each a 128-byte-swizzled tile (wgmma.cuh): 192 KiB (and with
// EMBER_ATTN_WG_PS, P [64][64] a warpgroup after them: 208 KiB; the launch gives that). Same grid, parameters,
// masking, partial results and bad-id handling as attend_mma (attention_tile.cuh, which both
// take them from); the launcher picks it only where attention_mma_w8 would run with these types
// and sizes on compute capability 9.0 (the module is built for sm_90a there).
#define AT_N 64  // keys a page (KV_PAGE): a K or V tile's rows
#define WG_TILE (AT_N * 256 * 2)
#ifdef EMBER_WGMMA
// One F16 page of head_dim 256 (its keys [0, nk); zeros past them) into a swizzled 64-key tile
// at shared address dst, by 256 threads: each copies dims d8 .. d8 + 8 of keys key0 + 8i, which
// share their row's swizzle (key % 8), so the i-th lands 1,024 bytes after the first.
__device__ __forceinline__ void wg_stage(u32 dst, const u8* page, u32 row_bytes, u32 e0, u32 nk) {
    const u32 d8 = (threadIdx.x & 31) * 8, key0 = threadIdx.x >> 5;
    const u8* src0 = page + 2 * (u64)(e0 + d8);
    const u32 at = dst + sw128_offset(AT_N, key0, d8);
#pragma unroll
    for (u32 i = 0; i < 8; ++i) {
        const u32 key = key0 + 8 * i;
        const bool in = key < nk;
        cp_async16_at(at + i * 1024, in ? src0 + (u64)key * row_bytes : src0, in ? 16 : 0);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1) attention_wg(const AttentionParams p) {
    pdl_enter();
#ifdef EMBER_WGMMA
    constexpr u32 M = 128, HD = 256;
    extern __shared__ __align__(16) u8 wg_sm[];
    const u32 sm0 = smem_addr(wg_sm), pad = (1024 - (sm0 & 1023)) & 1023;
    u8* const qs = wg_sm + pad;
    const u32 qa = sm0 + pad, ka = qa + M * HD * 2, va = ka + 2 * WG_TILE;
    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane >> 2, t = lane & 3;
    MmaTile tl;  // attention_tile.cuh
    if (!mma_tile<M>(p, warp, g, tl)) return;
    const u32 k_lo = tl.k_lo, k_hi = tl.k_hi;
    const u32 *tk = tl.tk, *tv = tl.tv;
    auto page = [&](const u32* tab, u32 kb) { return mma_tile_page(p, tl, tab, kb); };
    const u32 e0 = tl.kvh * HD, np = (k_hi - k_lo + AT_N - 1) / AT_N;
    auto nk_of = [&](u32 j) { return min((u32)AT_N, k_hi - (k_lo + j * AT_N)); };
    // Groups of copies in flight: {K(0)}, then {K(1), V(0)}; page n's iteration adds
    // {K(n + 2), V(n + 1)}, so at the top of iteration n the group {K(n), V(n - 1)} is the one
    // before the newest.
    if (np > 0) wg_stage(ka, page(tk, k_lo), p.row_bytes, e0, nk_of(0));
    cp_async_commit();
    if (np > 1) wg_stage(ka + WG_TILE, page(tk, k_lo + AT_N), p.row_bytes, e0, nk_of(1));
    if (np > 0) wg_stage(va, page(tv, k_lo), p.row_bytes, e0, nk_of(0));
    cp_async_commit();
    // Q: vector i = (row i / hb, head h0 + i % hb), scaled, as f16; zeros past the tile's rows.
    for (u32 u = tid; u < M * (HD / 8); u += 256) {
        const u32 i = u / (HD / 8), d8 = u % (HD / 8) * 8;
        *(uint4*)(qs + sw128_offset(M, i, d8)) = mma_tile_q8(p, tl, i, d8);
    }

    float o[128], sc[32], m[2], l[2], corr[2];
#ifndef EMBER_ATTN_WG_PS
    u32 pa[4][4];
#endif
#pragma unroll
    for (int n = 0; n < 128; ++n) o[n] = 0.0f;
#pragma unroll
    for (int a = 0; a < 2; ++a) m[a] = ATT_NEG_INF, l[a] = 0.0f, corr[a] = 1.0f;
    const u32 qw = qa + (warp / 4) * 64 * 128;  // this warpgroup's 64 rows of Q
#ifdef EMBER_ATTN_WG_PS
    // (EMBER_KERNEL_DEFINES=EMBER_ATTN_WG_PS: P·V reads P from shared memory, after the V
    // stages, 8 KiB a warpgroup, so no registers of P are held while it runs; prow is this
    // thread's row g of its warp's 16 in the tile, bytes.)
    const u32 pw = va + 2 * WG_TILE + (warp / 4) * AT_N * 128;
    u8* const ps = qs + (pw - qa);
    const u32 prow = (16 * (warp % 4) + g) * 128 + 4 * t;
#endif
    // The steps of a page, each the whole warpgroup's. The loop below issues both products
    // unconditionally (page 0's S and the last page's P·V are peeled off): with a wgmma issued
    // under a condition ptxas cannot tell which group a wait leaves running and serialises them.
    auto top = [&]() {
        cp_async_wait<1>();  // K(n) and V(n - 1)
        fence_proxy_async();  // their (and Q's) generic-proxy writes, for wgmma's reads
        __syncthreads();
    };
    // S(n): 16 steps of 16 dims; sc's layout is the mma.m16n8 accumulator's (tile j's values of
    // rows g, g + 8 at keys 8j + 2t, + 1: sc[4j + c]).
    auto issue_s = [&](u32 n) {
        const u32 kt = ka + (n & 1) * WG_TILE;
        wgmma_keep(sc);
        wgmma_fence();
#pragma unroll
        for (u32 s16 = 0; s16 < HD / 16; ++s16) {
            const u32 c = s16 / 4 * 128, b = s16 % 4 * 32;
            wgmma_ss_64x64(sc, wgmma_desc(qw + c * M + b, 16, 1024), wgmma_desc(kt + c * AT_N + b, 16, 1024), s16 > 0);
        }
        wgmma_commit();
    };
    // O += P(n)·V(n): 4 steps of 16 keys against all 256 dims (o's layout is the m64n256
    // accumulator's: tile c's values at o[4c + ..]).
    auto issue_pv = [&](u32 n) {
        const u32 vt = va + (n & 1) * WG_TILE;
        wgmma_keep(o);
#ifdef EMBER_ATTN_WG_PS
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_ss_64x256(o, wgmma_desc(pw + kk * 32, 16, 1024), wgmma_desc(vt + kk * 2048, WG_V_LBO, WG_V_SBO), 1);
#else
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_keep(pa[kk]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_64x256(o, pa[kk], wgmma_desc(vt + kk * 2048, WG_V_LBO, WG_V_SBO), 1);
#endif
        wgmma_commit();
    };
    // Online softmax of page n for rows g and g + 8 (a quad of lanes shares a row): sc becomes
    // the unnormalised weights, corr the factor O takes before P(n)·V(n) is added.
    auto softmax = [&](u32 n) {
        wgmma_keep(sc);
        const u32 kb = k_lo + n * AT_N;
        const bool whole = kb + AT_N <= k_hi && (int)(kb + AT_N - 1) <= tl.lim_lo;
        if (!whole) {  // warp-uniform: the mask only where some key of the page is out of a row
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const u32 key = kb + 8 * j + 2 * t + (c & 1);
                    if (key >= k_hi || (int)key > tl.lim[c >> 1]) sc[4 * j + c] = ATT_NEG_INF;
                }
        }
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            float mt = ATT_NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) mt = fmaxf(mt, sc[4 * j + 2 * a + c]);
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            const float m_new = fmaxf(m[a], mt);
            const bool none = m_new == ATT_NEG_INF;
            corr[a] = none ? 1.0f : exp_fast(m[a] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float e = none ? 0.0f : exp_fast(sc[4 * j + 2 * a + c] - m_new);
                    sc[4 * j + 2 * a + c] = e;
                    sum += e;
                }
            l[a] = l[a] * corr[a] + sum;  // this thread's keys; the quad's are added at the end
            m[a] = m_new;
        }
        // Computed here, not sunk past the wait that follows (which would end the overlap).
        wgmma_keep(sc);
        wgmma_keep(corr);
        wgmma_keep(l);
    };
    // With no wgmma in flight: O by page n's correction, P(n) = f16(S(n)).
    auto rescale_pack = [&]() {
        wgmma_keep(o);
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            if (__all_sync(0xffffffffu, corr[a] == 1.0f)) continue;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j + 2 * a] *= corr[a];
                o[4 * j + 2 * a + 1] *= corr[a];
            }
        }
#ifdef EMBER_ATTN_WG_PS
        // P(n) into the warpgroup's swizzled [64 rows][64 keys] tile: this thread's keys 8j + 2t,
        // + 1 of its rows g and g + 8 (the fence and the barrier at the next page's top make the
        // stores visible to the wgmma).
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            *(u32*)(ps + prow + ((j ^ g) << 4)) = pack_f16x2(sc[4 * j], sc[4 * j + 1]);
            *(u32*)(ps + prow + 8 * 128 + ((j ^ g) << 4)) = pack_f16x2(sc[4 * j + 2], sc[4 * j + 3]);
        }
#else
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            pa[kk][0] = pack_f16x2(sc[8 * kk], sc[8 * kk + 1]);
            pa[kk][1] = pack_f16x2(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack_f16x2(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack_f16x2(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
#endif
    };
    // Once every warp is past S(n) and P(n - 1)·V(n - 1): K(n + 2) and V(n + 1) into the stages
    // they freed.
    auto load_next = [&](u32 n) {
        __syncthreads();
        const u32 kb = k_lo + n * AT_N;
        if (n + 2 < np) wg_stage(ka + (n & 1) * WG_TILE, page(tk, kb + 2 * AT_N), p.row_bytes, e0, nk_of(n + 2));
        if (n + 1 < np) wg_stage(va + ((n + 1) & 1) * WG_TILE, page(tv, kb + AT_N), p.row_bytes, e0, nk_of(n + 1));
        cp_async_commit();
    };
    if (np > 0) {
        top();
        issue_s(0);
        wgmma_wait<0>();
        softmax(0);
        rescale_pack();
        load_next(0);
    }
    for (u32 n = 1; n < np; ++n) {
        top();
        issue_s(n);
        issue_pv(n - 1);
        wgmma_wait<1>();  // S(n); P(n - 1)·V(n - 1) may still run
        softmax(n);
        wgmma_wait<0>();
        rescale_pack();
        load_next(n);
    }
    if (np > 0) {
        top();
        issue_pv(np - 1);
        wgmma_wait<0>();
        wgmma_keep(o);
    }
    cp_async_wait<0>();
    mma_tile_store(p, tl, o, m, l, warp, g, t);
#endif
}
