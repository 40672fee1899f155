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
    u32 k, n, pad;
};

template <int TY>
__device__ __forceinline__ void gemv_q8(const GemvQ8Params& p) {
    using U = Q8Unit<TY>;
    __shared__ float part[GEMV_Q8_THREADS / 32];
    u32 i = 0;
    while (i + 1 < p.n && blockIdx.x >= p.block0[i + 1]) ++i;
    const int tid = threadIdx.x, seg = (int)p.wr[i] * U::L;  // lanes per row
    const int row = (int)(blockIdx.x - p.block0[i]) * (GEMV_Q8_THREADS / seg) + tid / seg;
    const int wk = (tid % seg) / U::L, t = tid % U::L, wr = p.wr[i];
    const int n_units = p.k / U::W;
    const bool valid = row < (int)p.n_rows[i];
    const i8* xq = (const i8*)p.xq;
    const float2* xd = (const float2*)(xq + p.k);
    float acc = 0.0f;
    if (valid) {
        const u8* wrow = (const u8*)p.w[i] + (u64)row * p.row_bytes[i];
#pragma unroll 4
        for (int u = wk; u < n_units; u += wr) acc += U::dot(wrow, u, t, xq, xd);
    }
    acc = seg_sum(acc, seg, part);
    if (valid && tid % seg == 0) ((float*)p.y[i])[row] = acc;
}

extern "C" __global__ void gemv_q8_q4_k(const GemvQ8Params p) { pdl_enter(); gemv_q8<TY_Q4_K>(p); }
extern "C" __global__ void gemv_q8_q6_k(const GemvQ8Params p) { pdl_enter(); gemv_q8<TY_Q6_K>(p); }
extern "C" __global__ void gemv_q8_q8_0(const GemvQ8Params p) { pdl_enter(); gemv_q8<TY_Q8_0>(p); }
