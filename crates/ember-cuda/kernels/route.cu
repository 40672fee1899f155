// route: per token, softmax over the experts (sum in f64), the k largest probabilities (ties to
// the lower id, largest first), weights renormalised by their sum clamped to ROUTE_SUM_MIN.
// Reference: ember_ops::reference::route (qwen35moe.md §6.6).

// One warp per token, blockDim 32, dynamic shared memory n_expert floats (unused by route_regs).
extern "C" __global__ void route(const RouteParams p) {
    pdl_enter();
    extern __shared__ float prob[];
    if (p.n_expert <= 32 * ROUTE_PER_LANE) {
        const u64 t = blockIdx.x;
        route_regs(p, (const float*)p.logits + t * p.n_expert, (u32*)p.ids + t * p.k, (float*)p.weights + t * p.k);
        return;
    }
    const int lane = threadIdx.x, t = blockIdx.x, e_n = p.n_expert;
    const float* l = (const float*)p.logits + (u64)t * e_n;
    float m = -__int_as_float(0x7f800000);  // -inf (no math headers)
    for (int e = lane; e < e_n; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    double s = 0.0;
    for (int e = lane; e < e_n; e += 32) {
        const float v = expf(l[e] - m);
        prob[e] = v;
        s += (double)v;
    }
    s = warp_sum_f64(s);
    __syncwarp();
    for (int e = lane; e < e_n; e += 32) prob[e] = (float)((double)prob[e] / s);
    __syncwarp();
    u32* ids = (u32*)p.ids + (u64)t * p.k;
    float* w = (float*)p.weights + (u64)t * p.k;
    // k rounds of a warp argmax; a taken expert is marked -1 (probabilities are >= 0).
    float sum = 0.0f;
    for (u32 r = 0; r < p.k; ++r) {
        float best = -2.0f;
        int best_e = 0x7fffffff;
        for (int e = lane; e < e_n; e += 32) {
            const float v = prob[e];
            if (v > best) best = v, best_e = e;  // lanes scan increasing e: ties keep the lower
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
        }
        if (lane == 0) {
            ids[r] = best_e;
            w[r] = best;
            prob[best_e] = -1.0f;
        }
        sum += best;  // the same order as the reference's sequential sum
        __syncwarp();
    }
    const float norm = fmaxf(sum, p.sum_min);
    __syncwarp();
    if (lane < (int)p.k) w[lane] = w[lane] / norm;
    for (u32 r = 32 + lane; r < p.k; r += 32) w[r] = w[r] / norm;
}
