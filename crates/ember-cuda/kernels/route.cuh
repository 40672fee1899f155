// The route's parameters and its one-warp, in-register form (route.cu's kernel; moe_route.cu's
// block 0 runs it on the logits its cluster gathered).

struct RouteParams {
    u64 logits;   // [n_tok, n_expert] f32
    u64 ids;      // [n_tok, k] u32
    u64 weights;  // [n_tok, k] f32
    u32 n_tok, n_expert, k;
    float sum_min;
};

// Experts per lane held in registers by route_regs (256 experts: the 35B-A3B's).
#define ROUTE_PER_LANE 8

// route for n_expert <= 32·ROUTE_PER_LANE with each lane's probabilities (experts lane,
// lane + 32, ..) in registers: the same arithmetic in the same order as the shared-memory
// path of route.cu, so the same results, without its loads in every round.
__device__ __forceinline__ void route_regs(const RouteParams& p, const float* l, u32* ids, float* w) {
    const int lane = threadIdx.x % 32, e_n = p.n_expert;
    const float neg_inf = -__int_as_float(0x7f800000);
    float v[ROUTE_PER_LANE];
    float m = neg_inf;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < e_n ? l[e] : neg_inf;
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
#ifdef EMBER_ROUTE_REGW
    // (EMBER_KERNEL_DEFINES=EMBER_ROUTE_REGW, for measuring: the first 32 weights stay in the
    // register of the lane that chose them, lane j round j's, and are divided and stored once,
    // not stored, loaded back after __syncwarp and stored again at the end of the chain. The
    // same arithmetic: the same bits.)
    float mine_w = 0.0f;
#define ROUTE_KEEP_W(r, best)                    \
    if (lane == (int)((r) % 32)) {                \
        if ((r) < 32) mine_w = (best);            \
        else w[r] = (best);                       \
    }
#else
#define ROUTE_KEEP_W(r, best) \
    if (lane == (int)((r) % 32)) w[r] = (best);
#endif
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
    for (u32 r = 0; r < p.k; ++r) {
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
        ROUTE_KEEP_W(r, best);
        sum += best;
    }
#else
    for (u32 r = 0; r < p.k; ++r) {
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
        ROUTE_KEEP_W(r, best);
        sum += best;
    }
#endif
    const float norm = fmaxf(sum, p.sum_min);
#ifdef EMBER_ROUTE_REGW
    if (lane < (int)p.k) w[lane] = mine_w / norm;
    __syncwarp();
    for (u32 r = 32 + lane; r < p.k; r += 32) w[r] = w[r] / norm;
#else
    __syncwarp();
    for (u32 r = lane; r < p.k; r += 32) w[r] = w[r] / norm;
#endif
}

