// q6k_repack: Q6_K rows from the file's 210-byte blocks to the layout every kernel reads
// (kernels/dequant.cuh, q6k_blk / q6k_dp), in place: a row's nb blocks
// become nb 208-byte runs (ql, qh, scales: each block's fields at their offsets within its run)
// followed by the nb f16 d's. The same bytes a row, so row addressing, expert slots and device
// copies of rows are unchanged. Run once on each range of rows after it is uploaded. Reference:
// ember_cuda::ops::q6k_repack_row (src/ops/q6_repack.rs).

struct Q6RepackParams {
    u64 w;       // the first row
    u64 n_rows;
    u32 row_bytes;  // 210 · nb
    u32 nb;
};

// Blocks of 256 threads, a row at a time each (grid-stride over rows), the row through dynamic
// shared memory (row_bytes).
extern "C" __global__ void q6k_repack(const Q6RepackParams p) {
    extern __shared__ __align__(16) u8 row_s[];
    pdl_enter();
    const u32 runs = 208 * p.nb;
    for (u64 r = blockIdx.x; r < p.n_rows; r += gridDim.x) {
        u8* row = (u8*)p.w + r * p.row_bytes;
        for (u32 i = threadIdx.x; i < p.row_bytes; i += blockDim.x) row_s[i] = row[i];
        __syncthreads();
        for (u32 i = threadIdx.x; i < p.row_bytes; i += blockDim.x) {
            const u32 src = i < runs ? 210 * (i / 208) + i % 208 : 210 * ((i - runs) / 2) + 208 + (i - runs) % 2;
            row[i] = row_s[src];
        }
        __syncthreads();  // the next row's copy overwrites row_s
    }
}
