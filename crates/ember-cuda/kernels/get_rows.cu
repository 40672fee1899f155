// get_rows: dequantised rows of a weight by token id (the embedding lookup).
// Reference: ember_ops::reference::get_rows. An id >= n_rows yields a NaN row (ids live on the
// device, so the host cannot check them; NaN makes the bug visible instead of reading past).

struct GetRowsParams {
    u64 w;    // n_rows rows of row_bytes
    u64 ids;  // [n_ids] u32
    u64 out;  // [n_ids, k] f32
    u32 ty, k, n_rows, n_ids, row_bytes, pad;
};

// grid (ceil(k / 8 / blockDim), n_ids): one thread per 8 outputs.
extern "C" __global__ void get_rows(const GetRowsParams p) {
    pdl_enter();
    const int i0 = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i0 >= (int)p.k) return;
    const u32 id = ((const u32*)p.ids)[blockIdx.y];
    float* o = (float*)p.out + (u64)blockIdx.y * p.k + i0;
    float v[8];
    if (id < p.n_rows) {
        deq8(p.ty, (const u8*)p.w + (u64)id * p.row_bytes, i0, p.k, v);
    } else {
        for (int j = 0; j < 8; ++j) v[j] = __int_as_float(0x7fffffff);
    }
    for (int j = 0; j < 8 && i0 + j < (int)p.k; ++j) o[j] = v[j];
}
