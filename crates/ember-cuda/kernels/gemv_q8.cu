// gemv_q8: decode GEMVs (one token) on int8 activations, for Precision::Fast. y[r] = Σ_j
// W[r][j]·x[j] with x first quantised to int8 in blocks of 32 (`quantize_q8`: a scale d and the
// block's sum d·Σq beside the int8 values, as llama.cpp's q8_1) and the products summed in
// integers (dp4a) per block. The f32 GEMV (matmul.cu) reads 32 bytes of activations for every 4
// bytes of 4-bit weights; here 2, and a dp4a does four multiply-adds, so the weight stream sets
// the speed. Reference: ember_ops::reference::matmul; error: the activations' rounding (≤ d/2
// per value, the same as the CPU's fast path).
//
// Work split: a *unit* is one block of the weight's format for L lanes (Q4_K, Q6_K: 256 weights
// for 8 lanes, 32 each; Q8_0: 32 weights for 4 lanes, 8 each); a row's units go to `wr`
// workers of L lanes (wr a power of two, chosen by the launcher so the GPU is full), worker j
// taking units j, j + wr, ..; the lanes of a row (wr·L, at most the block's 128) are summed by
// shuffles, across warps through shared memory, in a fixed order.

// x [n, k] f32 → q: n·k int8, then n·k/32 float2 (d, d·Σq), block i of the values at i.
struct QuantizeQ8Params {
    u64 x;
    u64 q;
    u32 n;  // values (a multiple of 32)
    u32 pad;
};

// One warp per block of 32 values.
extern "C" __global__ void quantize_q8(const QuantizeQ8Params p) {
    pdl_enter();
    const u32 blk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (blk * 32 >= p.n) return;  // whole warps
    warp_q8(((const float*)p.x)[blk * 32 + lane], (u8*)p.q, p.n, blk * 32 + lane);
}

#define GEMV_Q8_MULTI 4
#define GEMV_Q8_THREADS Q8_THREADS

// Up to GEMV_Q8_MULTI weights of one type and k on the same quantised x: the row blocks of
// weight i are blocks block0[i]..block0[i + 1] of the grid.
struct GemvQ8Params {
    u64 w[GEMV_Q8_MULTI];
    u64 y[GEMV_Q8_MULTI];
    u64 xq;  // quantize_q8's output for k values
    u32 n_rows[GEMV_Q8_MULTI];
    u32 row_bytes[GEMV_Q8_MULTI];
    u32 block0[GEMV_Q8_MULTI + 1];
    u32 wr[GEMV_Q8_MULTI];  // workers per row: a power of two, wr·L <= GEMV_Q8_THREADS
    u32 k, n;
    u32 prefetch;  // 1: each block asks for its rows in L2 before pdl_enter (prefetch_l2)
};

template <int TY>
__device__ __forceinline__ void gemv_q8(const GemvQ8Params& p) {
    using U = Q8Unit<TY>;
    __shared__ float part[GEMV_Q8_THREADS / 32];
    u32 i = 0;
    while (i + 1 < p.n && blockIdx.x >= p.block0[i + 1]) ++i;
    const int tid = threadIdx.x, seg = (int)p.wr[i] * U::L;  // lanes per row
    const int row0 = (int)(blockIdx.x - p.block0[i]) * (GEMV_Q8_THREADS / seg), row = row0 + tid / seg;
    if (p.prefetch && tid == 0 && row0 < (int)p.n_rows[i]) {
        const int nr = min(GEMV_Q8_THREADS / seg, (int)p.n_rows[i] - row0);
        prefetch_l2((const u8*)p.w[i] + (u64)row0 * p.row_bytes[i], (u64)nr * p.row_bytes[i]);
    }
    pdl_enter();
    const int wk = (tid % seg) / U::L, t = tid % U::L, wr = p.wr[i];
    const int n_units = p.k / U::W;
    const bool valid = row < (int)p.n_rows[i];
    const i8* xq = (const i8*)p.xq;
    const float2* xd = (const float2*)(xq + p.k);
    float acc = 0.0f;
    if (valid) {
        const u8* wrow = (const u8*)p.w[i] + (u64)row * p.row_bytes[i];
#pragma unroll 4
        for (int u = wk; u < n_units; u += wr) acc += U::dot(wrow, n_units, u, t, xq, xd);
    }
    acc = seg_sum(acc, seg, part);
    if (valid && tid % seg == 0) ((float*)p.y[i])[row] = acc;
}

// (gemv_q8 prefetches, then calls pdl_enter.)
extern "C" __global__ void gemv_q8_q4_k(const GemvQ8Params p) { gemv_q8<TY_Q4_K>(p); }
extern "C" __global__ void gemv_q8_q6_k(const GemvQ8Params p) { gemv_q8<TY_Q6_K>(p); }
extern "C" __global__ void gemv_q8_q8_0(const GemvQ8Params p) { gemv_q8<TY_Q8_0>(p); }

// Weights of different types in one launch (a layer's projections of one input: DeltaNet's
// Q6_K qkv beside its Q4_K gate and its a and b): weight i's blocks run gemv_q8<ty[i]>, so each
// output is what that type's own kernel gives, bit for bit, and the second weight's rows no
// longer wait for the first's launch to drain. ty[i]: TY_Q4_K, TY_Q6_K or TY_Q8_0.
struct GemvQ8MixedParams {
    GemvQ8Params g;
    u32 ty[GEMV_Q8_MULTI];
};

extern "C" __global__ void gemv_q8_mixed(const GemvQ8MixedParams p) {
    u32 i = 0;
    while (i + 1 < p.g.n && blockIdx.x >= p.g.block0[i + 1]) ++i;
    switch (p.ty[i]) {  // block-uniform
        case TY_Q4_K: gemv_q8<TY_Q4_K>(p.g); break;
        case TY_Q6_K: gemv_q8<TY_Q6_K>(p.g); break;
        case TY_Q8_0: gemv_q8<TY_Q8_0>(p.g); break;
        default: __trap();  // the launcher passes only these
    }
}

// ---- gemv_q8_rows_<type>: the same product for large weights (the output head) ----
// A warp copies R whole rows into shared memory with 16-byte asynchronous copies (rows are
// multiples of 16 bytes, whatever the block size: Q6_K's 210 and Q8_0's 34-byte blocks are
// otherwise read 2 bytes at a time), then its lanes take the R rows' units L at a time, each lane
// summing into its unit's row; the warp's lanes sum each row in a fixed order. Measured
// (bench/gpu/gemv-micro.cu, H200, 248,320 rows of k = 2048, 2026-12-04): Q8_0 386 → 154 us,
// Q6_K 186 → 159 us. On weights of a few MiB it is slower than gemv_q8 (fewer warps in flight).

struct GemvQ8RowsParams {
    u64 w;
    u64 y;
    u64 xq;  // quantize_q8's output for k values
    u32 n_rows, row_bytes, k, pad;
};

#define GEMV_Q8_ROWS_WARPS 4

// grid ceil(n_rows / (GEMV_Q8_ROWS_WARPS · R)), 32 · GEMV_Q8_ROWS_WARPS threads, shared memory
// GEMV_Q8_ROWS_WARPS · R · row_bytes.
template <int TY, int R>
__device__ __forceinline__ void gemv_q8_rows(const GemvQ8RowsParams& p) {
    using U = Q8Unit<TY>;
    extern __shared__ uint4 rows_smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * GEMV_Q8_ROWS_WARPS + warp) * R;
    if (row0 >= (int)p.n_rows) return;  // whole warps; no block-wide barrier below
    const int nr = min(R, (int)p.n_rows - row0), rb = (int)p.row_bytes;
    u8* s = (u8*)rows_smem + warp * R * rb;
    const u8* src = (const u8*)p.w + (u64)row0 * rb;
    for (int i = lane; i < nr * rb / 16; i += 32) copy16_async(s + 16 * i, src + 16 * i);
    copy_async_wait();
    __syncwarp();
    const int n_units = p.k / U::W, g = lane / U::L, t = lane % U::L;
    const i8* xq = (const i8*)p.xq;
    const float2* xd = (const float2*)(xq + p.k);
    float acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0.0f;
    for (int u = g; u < nr * n_units; u += 32 / U::L) {
        const int r = u / n_units;
        const float v = U::dot(s + r * rb, n_units, u - r * n_units, t, xq, xd);
#pragma unroll
        for (int j = 0; j < R; ++j) acc[j] += j == r ? v : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0 && j < nr) ((float*)p.y)[row0 + j] = v;
    }
}

#define GEMV_Q8_ROWS_Q6_K 4
#define GEMV_Q8_ROWS_Q8_0 2
extern "C" __global__ void gemv_q8_rows_q6_k(const GemvQ8RowsParams p) { pdl_enter(); gemv_q8_rows<TY_Q6_K, GEMV_Q8_ROWS_Q6_K>(p); }
extern "C" __global__ void gemv_q8_rows_q8_0(const GemvQ8RowsParams p) { pdl_enter(); gemv_q8_rows<TY_Q8_0, GEMV_Q8_ROWS_Q8_0>(p); }
