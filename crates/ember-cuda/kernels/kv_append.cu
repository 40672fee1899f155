// kv_append: every row of a step's k and v [n_rows, width] written into its sequence's K and V
// caches of one attention layer, as rows of the cache type (F32, F16 round-to-nearest-even, or
// Q8_0 blocks of 32 quantised like ggml's quantize_row_q8_0_ref). Reference:
// ember_ops::KvRows::push.
//
// Caches live in pages of KV_PAGE rows in one pool; a page table row per cache lists its pages:
// cache index c = (slot · n_kv + layer) · 2 + (0 for K, 1 for V), table[c · stride + p / 64].
// Row r goes to position pos[r] of the cache of slot row_slot[r].

#define KV_PAGE 64
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8

struct KvAppendParams {
    u64 k;         // [n_rows, width] f32
    u64 v;         // [n_rows, width] f32
    u64 pool;      // n_pages pages of page_bytes
    u64 table;     // [n_slots · n_kv · 2, stride] u32 page ids
    u64 row_slot;  // [n_rows] u32
    u64 pos;       // [n_rows] u32: the position each row is written at
    u32 n_rows, width, ty, row_bytes;
    u32 stride, layer, n_kv, n_slots;
    u32 n_pages, pad;
};

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// grid (n_rows, 2: K then V), blockDim a multiple of 32. For Q8_0 each warp quantises whole
// blocks of 32 values (width is a multiple of 32, checked by the launcher).
extern "C" __global__ void kv_append(const KvAppendParams p) {
    pdl_enter();
    const u32 r = blockIdx.x, kv = blockIdx.y;
    const u32 slot = ((const u32*)p.row_slot)[r], pos = ((const u32*)p.pos)[r];
    if (slot >= p.n_slots || pos / KV_PAGE >= p.stride) return;
    const u64 c = ((u64)slot * p.n_kv + p.layer) * 2 + kv;
    const u32 page = ((const u32*)p.table)[c * p.stride + pos / KV_PAGE];
    if (page >= p.n_pages) return;
    u8* dst = (u8*)p.pool + ((u64)page * KV_PAGE + pos % KV_PAGE) * p.row_bytes;
    const float* src = (const float*)(kv == 0 ? p.k : p.v) + (u64)r * p.width;
    if (p.ty == KV_F32) {
        for (u32 i = threadIdx.x; i < p.width; i += blockDim.x) ((float*)dst)[i] = src[i];
    } else if (p.ty == KV_F16) {
        for (u32 i = threadIdx.x; i < p.width; i += blockDim.x) ((u16*)dst)[i] = f32_to_f16(src[i]);
    } else {
        // Q8_0: d = amax / 127, q = roundf(x / d) (half away from zero), d stored as f16.
        const int lane = threadIdx.x % 32;
        for (u32 b = threadIdx.x / 32; b < p.width / 32; b += blockDim.x / 32) {
            const float x = src[b * 32 + lane];
            const float amax = warp_max(fabsf(x));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            int q = (int)roundf(x * id);
            q = q > 127 ? 127 : (q < -128 ? -128 : q);
            u8* blk = dst + (u64)b * 34;
            blk[2 + lane] = (u8)(i8)q;
            if (lane == 0) *(u16*)blk = f32_to_f16(d);
        }
    }
}
