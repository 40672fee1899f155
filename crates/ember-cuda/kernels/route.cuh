// route.cuh: one token's routing by one warp, shared by route.cu (the route kernel) and
// matmul.cu (the router GEMV's last warp, RouteTail). Reference: ember_ops::reference::route.

// Experts per lane held in registers by route_regs (256 experts: the 35B-A3B's).
#define ROUTE_PER_LANE 8

// The routing of one token's e_n <= 32·ROUTE_PER_LANE logits `l` into ids[0..k) and w[0..k) by
// the calling warp (every lane; lane = threadIdx.x % 32), each lane's probabilities (experts
// lane, lane + 32, ..) in registers: the same arithmetic in the same order as route.cu's
// shared-memory path, so the same results. With L2, the logits are read from L2 (`__ldcg`): the
// router GEMV's last warp reads what other SMs wrote.
template <bool L2>
__device__ __forceinline__ void route_warp(const float* l, int e_n, u32 k, float sum_min, u32* ids, float* w) {
    const int lane = threadIdx.x % 32;
    const float neg_inf = -__int_as_float(0x7f800000);
    float v[ROUTE_PER_LANE];
    float m = neg_inf;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < e_n ? (L2 ? __ldcg(l + e) : l[e]) : neg_inf;
        m = fmaxf(m, v[i]);
    }
    m = warp_max(m);
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        if (lane + 32 * i < e_n) {
            v[i] = expf(v[i] - m);
            s += (double)v[i];
        }
    }
    s = warp_sum_f64(s);
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) v[i] = lane + 32 * i < e_n ? (float)((double)v[i] / s) : -2.0f;
    float sum = 0.0f;
#if __CUDA_ARCH__ >= 800
    // Each round's warp argmax as two redux.sync, not five rounds of two shuffles (below, before
    // sm_80): a probability p >= 0 as the key bits(p) + 1 (monotone in p; 0 for a taken or absent
    // expert), the warp's largest key, then the lowest expert id holding it. The same choice
    // (largest p, ties to the lower id) and the same sums: the same results. H100, the 35B's
    // decode (docs/perf.md g23): the route 4.95 -> 4.67 us a call alone, 4.6 -> 3.85 us in the
    // step's chain; tg128 +1.6 % (three rounds).
    u32 key[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) key[i] = v[i] >= 0.0f ? __float_as_uint(v[i]) + 1u : 0u;
    for (u32 r = 0; r < k; ++r) {
        u32 kl = 0;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) kl = max(kl, key[i]);
        const u32 kmax = __reduce_max_sync(0xffffffffu, kl);
        u32 mine = 0xffffffffu;
#pragma unroll
        for (int i = ROUTE_PER_LANE - 1; i >= 0; --i)
            if (key[i] == kmax) mine = lane + 32 * i;
        // kmax 0 (no expert left, or NaN probabilities): what the shuffle form gives then.
        const u32 best_e = kmax ? __reduce_min_sync(0xffffffffu, mine) : 0x7fffffffu;
        const float best = kmax ? __uint_as_float(kmax - 1u) : -2.0f;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i)
            if (lane + 32 * i == (int)best_e) key[i] = 0u;
        if (lane == 0) ids[r] = best_e;
        if (lane == (int)(r % 32)) w[r] = best;
        sum += best;
    }
#else
    for (u32 r = 0; r < k; ++r) {
        float best = -2.0f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i)
            if (v[i] > best) best = v[i], best_e = lane + 32 * i;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
        }
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i)
            if (lane + 32 * i == best_e) v[i] = -1.0f;
        if (lane == 0) ids[r] = best_e;
        if (lane == (int)(r % 32)) w[r] = best;
        sum += best;
    }
#endif
    const float norm = fmaxf(sum, sum_min);
    __syncwarp();
    for (u32 r = lane; r < k; r += 32) w[r] = w[r] / norm;
}

