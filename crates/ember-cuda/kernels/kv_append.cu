// kv_append: every row of a step's k and v [n_rows, width] written into its sequence's K and V
// caches of one attention layer, as rows of the cache type (kv_store.cuh). Row r goes to
// position pos[r] of the cache of slot row_slot[r].

struct KvAppendParams {
    u64 k;  // [n_rows, width] f32
    u64 v;  // [n_rows, width] f32
    KvDest dst;
    u32 n_rows, width;
};

// grid (n_rows, 2: K then V), blockDim a multiple of 32. For Q8_0 each warp quantises whole
// blocks of 32 values (width is a multiple of 32, checked by the launcher).
extern "C" __global__ void kv_append(const KvAppendParams p) {
    pdl_enter();
    const u32 r = blockIdx.x, kv = blockIdx.y;
    u8* dst = kv_row(p.dst, r, kv);
    if (!dst) return;
    const float* src = (const float*)(kv == 0 ? p.k : p.v) + (u64)r * p.width;
    if (p.dst.ty != KV_Q8_0) {
        for (u32 i = threadIdx.x; i < p.width; i += blockDim.x) kv_store(dst, p.dst.ty, i, src[i]);
    } else {
        const int lane = threadIdx.x % 32;
        for (u32 b = threadIdx.x / 32; b < p.width / 32; b += blockDim.x / 32) kv_store_q8(dst, b, lane, src[b * 32 + lane]);
    }
}
