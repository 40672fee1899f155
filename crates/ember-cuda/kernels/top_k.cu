// top_k_rows: per row of logits, its k best entries (value descending with NaN as -inf, ties to
// the lower id) and the entries at some extra ids, for a sampler that needs no more of the row
// (ember_ops::top::top_of_row is the reference; the host sorts the output by id and drops the
// extras' duplicates).
//
// One block of 1024 threads per row. The k-th best entry's 32-bit order key T (top_key: larger
// key, larger value) comes from a radix select: three passes over the row (digits of 11, 11 and
// 10 bits, highest first), each a shared-memory histogram of the entries whose higher digits
// equal T's so far (the lanes of a warp with the same bin add together), and a warp that finds
// the digit where the count from the top reaches what is still needed. Then one pass writes
// the entries above T (their order unspecified) and, of those equal to T, the lowest ids (a
// block-wide ordered compaction, tile by tile in id order, until enough are taken): exactly k
// entries. Then the extra ids' entries.

struct TopKParams {
    u64 x;         // [n_rows, n] f32
    u64 extra;     // [Σ extras] u32, ids < n
    u64 extra_at;  // [n_rows + 1] u32: row r's extras are extra[extra_at[r]..extra_at[r + 1]]
    u64 out_ids;   // [n_rows, cap] u32: the k best, then the row's extras
    u64 out_vals;  // [n_rows, cap] f32
    u32 n, k, cap, pad;  // k <= n; cap >= k + the most extras of a row
};

#define TOPK_THREADS 1024

// Order-preserving key of an f32 (NaN as -inf; -0 below +0, as f32::total_cmp has them).
__device__ __forceinline__ u32 top_key(float v) {
    u32 b = __float_as_uint(v);
    if (v != v) b = 0xff800000u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// grid (n_rows), block TOPK_THREADS.
extern "C" __global__ void top_k_rows(const TopKParams p) {
    pdl_enter();
    __shared__ u32 hist[2048];
    __shared__ u32 warp_ties[TOPK_THREADS / 32];
    __shared__ u32 s_prefix, s_need, s_above, s_taken;
    const u32 tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const u64 row = blockIdx.x;
    const float* x = (const float*)p.x + row * p.n;
    u32* out_ids = (u32*)p.out_ids + row * p.cap;
    float* out_vals = (float*)p.out_vals + row * p.cap;
    const u32 k = p.k;
    if (k > 0) {
        // T's digits so far (prefix, under mask) and how many entries equal to them are still
        // wanted after those above.
        u32 prefix = 0, mask = 0, need = k;
        for (int pass = 0; pass < 3; ++pass) {
            const u32 bits = pass < 2 ? 11 : 10, shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
            const u32 nb = 1u << bits, per = nb / 32;
            for (u32 i = tid; i < nb; i += nt) hist[i] = 0;
            __syncthreads();
            // Lanes with the same bin add once, together (logits crowd into a few bins of the
            // first digit: one shared atomic a lane would serialise on them).
            for (u32 base = 0; base < p.n; base += nt) {
                const u32 i = base + tid;
                u32 bin = 0xffffffffu;
                if (i < p.n) {
                    const u32 key = top_key(x[i]);
                    if ((key & mask) == prefix) bin = (key >> shift) & (nb - 1);
                }
                const u32 peers = __match_any_sync(0xffffffffu, bin);
                if (bin != 0xffffffffu && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
            }
            __syncthreads();
            if (warp == 0) {
                // Lane l sums bins nb-1-l·per down to nb-(l+1)·per (lane 0: the top ones); the
                // lanes' inclusive sums from the top say which lane's bins reach `need` (some
                // does: the entries matching the prefix are at least `need`).
                u32 s = 0;
                for (u32 j = 0; j < per; ++j) s += hist[nb - 1 - lane * per - j];
                u32 incl = s;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
                    if ((int)lane >= o) incl += t;
                }
                const u32 first = __ffs(__ballot_sync(0xffffffffu, incl >= need)) - 1;
                if (lane == first) {
                    u32 cum = incl - s, j = 0;
                    for (; j + 1 < per; ++j) {
                        const u32 c = hist[nb - 1 - lane * per - j];
                        if (cum + c >= need) break;
                        cum += c;
                    }
                    s_need = need - cum;
                    s_prefix = prefix | ((nb - 1 - lane * per - j) << shift);
                }
            }
            __syncthreads();
            need = s_need;
            prefix = s_prefix;
            mask |= (nb - 1) << shift;
            __syncthreads();
        }
        // prefix = T; `need` entries equal to T are taken (the lowest ids), after k - need above.
        if (tid == 0) s_above = 0, s_taken = 0;
        __syncthreads();
        const u32 above = k - need;
        for (u32 base = 0; base < p.n; base += nt) {
            const u32 i = base + tid;
            bool tie = false;
            float v = 0.0f;
            if (i < p.n) {
                v = x[i];
                const u32 key = top_key(v);
                if (key > prefix) {
                    const u32 at = atomicAdd(&s_above, 1u);
                    out_ids[at] = i;
                    out_vals[at] = v;
                }
                tie = key == prefix;
            }
            // s_taken is the same for every thread here (written before the last barrier).
            if (s_taken < need) {
                const u32 ball = __ballot_sync(0xffffffffu, tie);
                if (lane == 0) warp_ties[warp] = __popc(ball);
                __syncthreads();
                u32 before = __popc(ball & ((1u << lane) - 1u));
                for (u32 w = 0; w < warp; ++w) before += warp_ties[w];
                const u32 taken = s_taken;
                if (tie && taken + before < need) {
                    out_ids[above + taken + before] = i;
                    out_vals[above + taken + before] = v;
                }
                __syncthreads();
                if (tid == 0) {
                    u32 t = 0;
                    for (u32 w = 0; w < nt / 32; ++w) t += warp_ties[w];
                    s_taken = taken + t;
                }
                __syncthreads();
            }
        }
    }
    const u32* extra = (const u32*)p.extra;
    const u32 e0 = ((const u32*)p.extra_at)[row], e1 = ((const u32*)p.extra_at)[row + 1];
    for (u32 j = e0 + tid; j < e1; j += nt) {
        const u32 id = extra[j];
        out_ids[k + j - e0] = id;
        out_vals[k + j - e0] = id < p.n ? x[id] : __int_as_float(0x7fffffff);
    }
}
