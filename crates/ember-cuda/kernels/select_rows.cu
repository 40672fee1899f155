// select_rows: out[i] = x[rows[i]]. Reference: ember_ops::reference::select_rows.
// A row index >= n gives a NaN row (indices live on the device; see get_rows.cu).

struct SelectRowsParams {
    u64 x;     // [n, d] f32
    u64 rows;  // [n_sel] u32
    u64 out;   // [n_sel, d] f32
    u32 n, d, n_sel, pad;
};

// grid (ceil(d / blockDim), n_sel).
extern "C" __global__ void select_rows(const SelectRowsParams p) {
    pdl_enter();
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.d) return;
    const u32 r = ((const u32*)p.rows)[blockIdx.y];
    const float v = r < p.n ? ((const float*)p.x)[(u64)r * p.d + c] : __int_as_float(0x7fffffff);
    ((float*)p.out)[(u64)blockIdx.y * p.d + c] = v;
}
