// The paged KV cache's row writes, shared by kv_append.cu and attn_prep.cu (whose k heads may
// write their rows into the cache themselves): the pool's layout, where a step's row goes, and
// a value's conversion to the cache type (F32, F16 round-to-nearest-even, or Q8_0 blocks of 32
// quantised like ggml's quantize_row_q8_0_ref). Reference: ember_ops::KvRows::push.
//
// Caches live in pages of KV_PAGE rows in one pool; a page table row per cache lists its pages:
// cache index c = (slot · n_kv + layer) · 2 + (0 for K, 1 for V), table[c · stride + p / 64].

#define KV_PAGE 64
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8

struct KvDest {
    u64 pool;      // n_pages pages of KV_PAGE rows of row_bytes
    u64 table;     // [n_slots · n_kv · 2, stride] u32 page ids
    u64 row_slot;  // [n_rows] u32
    u64 pos;       // [n_rows] u32: the position each row is written at
    u32 ty, row_bytes, stride, layer;
    u32 n_kv, n_slots, n_pages, pad;
};

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The cache row that step row r's K (kv 0) or V (kv 1) goes to, or null when its slot,
// position or page is out of range (the row is skipped).
__device__ __forceinline__ u8* kv_row(const KvDest& p, u32 r, u32 kv) {
    const u32 slot = ((const u32*)p.row_slot)[r], pos = ((const u32*)p.pos)[r];
    if (slot >= p.n_slots || pos / KV_PAGE >= p.stride) return nullptr;
    const u64 c = ((u64)slot * p.n_kv + p.layer) * 2 + kv;
    const u32 page = ((const u32*)p.table)[c * p.stride + pos / KV_PAGE];
    if (page >= p.n_pages) return nullptr;
    return (u8*)p.pool + ((u64)page * KV_PAGE + pos % KV_PAGE) * p.row_bytes;
}

// Value x of block b of a Q8_0 row, lane `lane` of the warp holding the block's 32 values:
// d = amax / 127, q = roundf(x / d) (half away from zero), d stored as f16.
__device__ __forceinline__ void kv_store_q8(u8* dst, u32 b, int lane, float x) {
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = (int)roundf(x * id);
    q = q > 127 ? 127 : (q < -128 ? -128 : q);
    u8* blk = dst + (u64)b * 34;
    blk[2 + lane] = (u8)(i8)q;
    if (lane == 0) *(u16*)blk = f32_to_f16(d);
}

// Value x at index i of an F32 or F16 row.
__device__ __forceinline__ void kv_store(u8* dst, u32 ty, u32 i, float x) {
    if (ty == KV_F32) ((float*)dst)[i] = x;
    else ((u16*)dst)[i] = f32_to_f16(x);
}
