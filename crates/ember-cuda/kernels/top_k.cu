// Per row of logits, its k best entries (value descending with NaN as -inf, ties to the lower
// id) and the entries at some extra ids, for a sampler that needs no more of the row
// (ember_ops::top::top_of_row is the reference; the host sorts the output by id and drops the
// extras' duplicates). Entries are compared by their 32-bit order key (top_key: larger key,
// larger value), ties by id.
//
// Two forms, the same entries:
// * top_k_rows: one block of 1024 threads a row. The k-th best key T comes from a radix select:
//   three passes over the row (digits of 11, 11 and 10 bits, highest first), each a shared
//   histogram of the entries whose higher digits equal T's so far (the lanes of a warp with the
//   same bin add together), and a warp that finds the digit where the count from the top
//   reaches what is still needed (top_scan). Then one pass writes the entries above T (their
//   order unspecified) and, of those equal to T, the lowest ids (a block-wide ordered
//   compaction, tile by tile in id order, until enough are taken): exactly k entries. One SM
//   reads the row four times.
// * split over many blocks a row (long rows, a decode step's 248k logits): top_k_hist adds
//   each block's histogram of the first digit to the row's in global memory; top_k_gather,
//   every block finding the first digit d1 from it, writes the entries above d1 and lists the
//   ids in d1 (the candidates); top_k_finish (one block a row) sorts the candidates' (key, id)
//   in shared memory (bitonic, descending) and takes the best it still needs, or, when there
//   are more candidates than TOPK_CAND (a crowded digit: ties), runs top_k_rows' algorithm on
//   the whole row instead; then it zeroes the row's histogram and counters for the next call.

#define TOPK_BINS 2048
// Candidates top_k_finish sorts in shared memory (64-bit keys: 32 KB).
#define TOPK_CAND 4096

struct TopKParams {
    u64 x;         // [n_rows, n] f32
    u64 extra;     // [Σ extras] u32, ids < n
    u64 extra_at;  // [n_rows + 1] u32: row r's extras are extra[extra_at[r]..extra_at[r + 1]]
    u64 out_ids;   // [n_rows, cap] u32: the k best, then the row's extras
    u64 out_vals;  // [n_rows, cap] f32
    u64 hist;      // split: [n_rows, TOPK_BINS] u32, zero on entry and left zero
    u64 counts;    // split: [n_rows, 2] u32 (entries above d1 written, candidates), the same
    u64 cand;      // split: [n_rows, TOPK_CAND] u32
    u32 n, k, cap, chunk;  // k <= n; cap >= k + the most extras of a row; chunk: entries a block
};

// Order-preserving key of an f32 (NaN as -inf; -0 below +0, as f32::total_cmp has them).
__device__ __forceinline__ u32 top_key(float v) {
    u32 b = __float_as_uint(v);
    if (v != v) b = 0xff800000u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Run by one whole warp: of the histogram `hist` (nb bins, a multiple of 32, of the digit at
// `shift` among the entries matching `prefix`), the bin where the count from the top reaches
// `need` (at least the histogram's total): *s_prefix = prefix with that digit, *s_need = what
// is still needed of that bin after the bins above it.
__device__ __forceinline__ void top_scan(const u32* hist, u32 nb, u32 need, u32 prefix, u32 shift, u32* s_prefix,
                                         u32* s_need) {
    const u32 lane = threadIdx.x & 31, per = nb / 32;
    // Lane l sums bins nb-1-l·per down to nb-(l+1)·per (lane 0: the top ones); the lanes'
    // inclusive sums from the top say which lane's bins reach `need`.
    u32 s = 0;
    for (u32 j = 0; j < per; ++j) s += hist[nb - 1 - lane * per - j];
    u32 incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
        if ((int)lane >= o) incl += t;
    }
    const u32 ball = __ballot_sync(0xffffffffu, incl >= need);
    if (ball == 0) {
        // Fewer entries than needed (a caller's broken contract): take nothing of this digit.
        if (lane == 0) *s_need = 0, *s_prefix = prefix;
        return;
    }
    const u32 first = __ffs(ball) - 1;
    if (lane == first) {
        u32 cum = incl - s, j = 0;
        for (; j + 1 < per; ++j) {
            const u32 c = hist[nb - 1 - lane * per - j];
            if (cum + c >= need) break;
            cum += c;
        }
        *s_need = need - cum;
        *s_prefix = prefix | ((nb - 1 - lane * per - j) << shift);
    }
}

// The k (> 0, <= n) best entries of row x into out_ids / out_vals [0, k): top_k_rows' algorithm
// (see the top), by the whole block.
__device__ void top_k_row(const float* x, u32 n, u32 k, u32* out_ids, float* out_vals) {
    __shared__ u32 hist[TOPK_BINS];
    __shared__ u32 warp_ties[32];
    __shared__ u32 s_prefix, s_need, s_above, s_taken;
    const u32 tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    // T's digits so far (prefix, under mask) and how many entries equal to them are still
    // wanted after those above.
    u32 prefix = 0, mask = 0, need = k;
    for (int pass = 0; pass < 3; ++pass) {
        const u32 bits = pass < 2 ? 11 : 10, shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const u32 nb = 1u << bits;
        for (u32 i = tid; i < nb; i += nt) hist[i] = 0;
        __syncthreads();
        // Lanes with the same bin add once, together (logits crowd into a few bins of the
        // first digit: one shared atomic a lane would serialise on them).
        for (u32 base = 0; base < n; base += nt) {
            const u32 i = base + tid;
            u32 bin = 0xffffffffu;
            if (i < n) {
                const u32 key = top_key(x[i]);
                if ((key & mask) == prefix) bin = (key >> shift) & (nb - 1);
            }
            const u32 peers = __match_any_sync(0xffffffffu, bin);
            if (bin != 0xffffffffu && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
        }
        __syncthreads();
        if (warp == 0) top_scan(hist, nb, need, prefix, shift, &s_prefix, &s_need);
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
    for (u32 base = 0; base < n; base += nt) {
        const u32 i = base + tid;
        bool tie = false;
        float v = 0.0f;
        if (i < n) {
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

// Row `row`'s extra ids' entries after its k best.
__device__ __forceinline__ void top_extras(const TopKParams& p, u64 row, const float* x, u32* out_ids, float* out_vals) {
    const u32* extra = (const u32*)p.extra;
    const u32 e0 = ((const u32*)p.extra_at)[row], e1 = ((const u32*)p.extra_at)[row + 1];
    for (u32 j = e0 + threadIdx.x; j < e1; j += blockDim.x) {
        const u32 id = extra[j];
        out_ids[p.k + j - e0] = id;
        out_vals[p.k + j - e0] = id < p.n ? x[id] : __int_as_float(0x7fffffff);
    }
}

// grid (n_rows), block 1024.
extern "C" __global__ void __launch_bounds__(1024) top_k_rows(const TopKParams p) {
    pdl_enter();
    const u64 row = blockIdx.x;
    const float* x = (const float*)p.x + row * p.n;
    u32* out_ids = (u32*)p.out_ids + row * p.cap;
    float* out_vals = (float*)p.out_vals + row * p.cap;
    if (p.k > 0) top_k_row(x, p.n, p.k, out_ids, out_vals);
    top_extras(p, row, x, out_ids, out_vals);
}

// A block's chunk of the row, x[lo..hi), into registers, all loads in flight at once: value j
// of thread t is x[lo + j · blockDim + t] (0 past hi). chunk <= TOPK_MAX_PER · blockDim (the
// launcher's contract). The loop over the values then waits on none of them one by one.
#define TOPK_MAX_PER 8
__device__ __forceinline__ void top_chunk_load(const float* x, u32 lo, u32 hi, float* v) {
#pragma unroll
    for (u32 j = 0; j < TOPK_MAX_PER; ++j) {
        const u32 i = lo + j * blockDim.x + threadIdx.x;
        v[j] = i < hi ? x[i] : 0.0f;
    }
}

// The split form, step 1. grid (n_rows, blocks a row), block 1024; k > 0.
extern "C" __global__ void __launch_bounds__(1024) top_k_hist(const TopKParams p) {
    pdl_enter();
    __shared__ u32 hist[TOPK_BINS];
    const u32 tid = threadIdx.x, nt = blockDim.x, lane = tid & 31;
    const u64 row = blockIdx.x;
    const float* x = (const float*)p.x + row * p.n;
    const u32 lo = blockIdx.y * p.chunk, hi = lo + p.chunk < p.n ? lo + p.chunk : p.n;
    float v[TOPK_MAX_PER];
    top_chunk_load(x, lo, hi, v);
    for (u32 i = tid; i < TOPK_BINS; i += nt) hist[i] = 0;
    __syncthreads();
#pragma unroll
    for (u32 j = 0; j < TOPK_MAX_PER; ++j) {
        const u32 i = lo + j * nt + tid;
        if (lo + j * nt >= hi) break;  // block-uniform
        const u32 bin = i < hi ? top_key(v[j]) >> 21 : 0xffffffffu;
        const u32 peers = __match_any_sync(0xffffffffu, bin);
        if (bin != 0xffffffffu && lane == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
    }
    __syncthreads();
    u32* g = (u32*)p.hist + row * TOPK_BINS;
    for (u32 i = tid; i < TOPK_BINS; i += nt)
        if (hist[i]) atomicAdd(&g[i], hist[i]);
}

// A slot for each lane of the warp that wants one, from one atomic on `counter` a warp: the
// lane's index (every lane of the warp calls this together).
__device__ __forceinline__ u32 warp_append(bool want, u32* counter) {
    const u32 ball = __ballot_sync(0xffffffffu, want), lane = threadIdx.x & 31;
    if (ball == 0) return 0;
    const u32 leader = __ffs(ball) - 1;
    u32 base = 0;
    if (lane == leader) base = atomicAdd(counter, (u32)__popc(ball));
    base = __shfl_sync(0xffffffffu, base, leader);
    return base + __popc(ball & ((1u << lane) - 1u));
}

// The split form, step 2. grid (n_rows, blocks a row), block 1024.
extern "C" __global__ void __launch_bounds__(1024) top_k_gather(const TopKParams p) {
    pdl_enter();
    __shared__ u32 hist[TOPK_BINS];
    __shared__ u32 s_digit, s_need;
    const u32 tid = threadIdx.x, nt = blockDim.x;
    const u64 row = blockIdx.x;
    const float* x = (const float*)p.x + row * p.n;
    float xv[TOPK_MAX_PER];
    top_chunk_load(x, blockIdx.y * p.chunk, min(blockIdx.y * p.chunk + p.chunk, p.n), xv);
    // The scan walks bins one after another: from shared memory, not an L2 trip each.
    for (u32 i = tid; i < TOPK_BINS; i += nt) hist[i] = ((const u32*)p.hist)[row * TOPK_BINS + i];
    __syncthreads();
    if (tid < 32) top_scan(hist, TOPK_BINS, p.k, 0, 21, &s_digit, &s_need);
    __syncthreads();
    const u32 d1 = s_digit >> 21, above = p.k - s_need;
    u32* cnt = (u32*)p.counts + row * 2;
    u32* out_ids = (u32*)p.out_ids + row * p.cap;
    float* out_vals = (float*)p.out_vals + row * p.cap;
    u32* cand = (u32*)p.cand + row * TOPK_CAND;
    const u32 lo = blockIdx.y * p.chunk, hi = lo + p.chunk < p.n ? lo + p.chunk : p.n;
#pragma unroll
    for (u32 j = 0; j < TOPK_MAX_PER; ++j) {
        const u32 i = lo + j * nt + tid;
        if (lo + j * nt >= hi) break;  // block-uniform
        const float v = xv[j];
        const u32 d = i < hi ? top_key(v) >> 21 : 0;
        const bool up = i < hi && d > d1, in = i < hi && d == d1;
        const u32 a = warp_append(up, &cnt[0]);
        // (a < above always, the scratch being zero on entry; the bound keeps a dirty one from
        // writing past the row's output.)
        if (up && a < above) out_ids[a] = i, out_vals[a] = v;
        const u32 c = warp_append(in, &cnt[1]);
        if (in && c < TOPK_CAND) cand[c] = i;
    }
}

// The split form, step 3. grid (n_rows), block 1024, dynamic shared memory TOPK_CAND u64.
extern "C" __global__ void __launch_bounds__(1024) top_k_finish(const TopKParams p) {
    pdl_enter();
    extern __shared__ u64 keys[];
    __shared__ u32 s_digit, s_need;
    const u32 tid = threadIdx.x, nt = blockDim.x;
    const u64 row = blockIdx.x;
    const float* x = (const float*)p.x + row * p.n;
    u32* hist = (u32*)p.hist + row * TOPK_BINS;
    u32* cnt = (u32*)p.counts + row * 2;
    u32* out_ids = (u32*)p.out_ids + row * p.cap;
    float* out_vals = (float*)p.out_vals + row * p.cap;
    u32* bins = (u32*)keys;  // the histogram, in the sort's buffer until the sort
    for (u32 i = tid; i < TOPK_BINS; i += nt) bins[i] = hist[i];
    __syncthreads();
    if (tid < 32) top_scan(bins, TOPK_BINS, p.k, 0, 21, &s_digit, &s_need);
    __syncthreads();
    const u32 need = s_need, above = p.k - need, c = cnt[1];
    if (c <= TOPK_CAND) {
        // (key, id) with lower ids ranking higher among equal keys; padded with 0, below any.
        u32 m = 1;
        while (m < c) m <<= 1;
        const u32* cand = (const u32*)p.cand + row * TOPK_CAND;
        for (u32 j = tid; j < m; j += nt) {
            const u32 id = j < c ? cand[j] : 0xffffffffu;
            keys[j] = id < p.n ? ((u64)top_key(x[id]) << 32) | (u64)(0xffffffffu - id) : 0;
        }
        __syncthreads();
        // Bitonic sort, descending.
        for (u32 size = 2; size <= m; size <<= 1) {
            for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
                for (u32 t = tid; t < m / 2; t += nt) {
                    const u32 i = 2 * t - (t & (stride - 1)), j = i + stride;
                    const u64 a = keys[i], b = keys[j];
                    if ((a < b) == ((i & size) == 0)) keys[i] = b, keys[j] = a;
                }
                __syncthreads();
            }
        }
        for (u32 j = tid; j < need && j < m; j += nt) {
            const u32 id = 0xffffffffu - (u32)keys[j];
            out_ids[above + j] = id;
            out_vals[above + j] = id < p.n ? x[id] : __int_as_float(0x7fffffff);
        }
    } else {
        top_k_row(x, p.n, p.k, out_ids, out_vals);
    }
    top_extras(p, row, x, out_ids, out_vals);
    // Every block of this call has read the histogram and counters: zero them for the next.
    __syncthreads();
    for (u32 j = tid; j < TOPK_BINS; j += nt) hist[j] = 0;
    if (tid == 0) cnt[0] = 0, cnt[1] = 0;
}
