// wgmma_check: one warpgroup checks the wgmma building blocks (wgmma.cuh) against plain
// arithmetic on the host (tests/wgmma.rs): S = Q·Kᵀ [64 x 64] over 256 dims by 16 shared-memory
// wgmmas, and O = P·V [64 x 256] over 64 keys by 4 register-A wgmmas with V as stored (rows of
// 256). Inputs f16 row-major in global memory, outputs f32. Not used by the model (step 0 of
// docs/attention-wgmma.md): it pins down the descriptors, the swizzle and the operand layouts
// before attention is built on them. Without sm_90a the kernel writes NaN.

struct WgmmaCheckParams {
    u64 q;  // [64][256] f16
    u64 k;  // [64][256] f16
    u64 v;  // [64][256] f16
    u64 p;  // [64][64] f16
    u64 s;  // [64][64] f32 out
    u64 o;  // [64][256] f32 out
    u32 v_lbo, v_sbo;  // V's descriptor offsets (bytes): 8192 and 1024 as attention uses them
};

// Dynamic shared memory: 1 KiB of slack (the tiles start 1,024-aligned), then Q, K, V tiles of
// 64 rows x 256 halves (32 KiB each).
#define WGC_TILE (64 * 256 * 2)

#ifdef EMBER_WGMMA
// A warpgroup's m64nN accumulator (this thread's N / 2 values, the mma.m16n8 layout of its
// warp's 16 rows) into row-major out [64][N].
template <int H>
__device__ __forceinline__ void wgc_store(const float (&d)[H], float* out, u32 warp, u32 g, u32 t) {
    constexpr u32 N = 2 * H;
#pragma unroll
    for (int j = 0; j < H / 4; ++j) {
        const u32 r = 16 * warp + g, c = 8 * j + 2 * t;
        out[r * N + c] = d[4 * j];
        out[r * N + c + 1] = d[4 * j + 1];
        out[(r + 8) * N + c] = d[4 * j + 2];
        out[(r + 8) * N + c + 1] = d[4 * j + 3];
    }
}
#endif

extern "C" __global__ void __launch_bounds__(128, 1) wgmma_check(const WgmmaCheckParams p) {
    const u32 tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#ifdef EMBER_WGMMA
    extern __shared__ __align__(16) u8 wgc_sm[];
    const u32 base_addr = smem_addr(wgc_sm), pad = (1024 - (base_addr & 1023)) & 1023;
    u8* tiles = wgc_sm + pad;
    const u32 tq = base_addr + pad, tk = tq + WGC_TILE, tv = tk + WGC_TILE;
    // Stage the three tiles swizzled: 8 halves (16 bytes) a store.
    for (u32 u = tid; u < 3 * 64 * 32; u += 128) {
        const u32 m = u / (64 * 32), row = u / 32 % 64, d = u % 32 * 8;
        const u16* src = (const u16*)(m == 0 ? p.q : m == 1 ? p.k : p.v) + row * 256 + d;
        *(uint4*)(tiles + m * WGC_TILE + sw128_offset(64, row, d)) = *(const uint4*)src;
    }
    fence_proxy_async();
    __syncthreads();
    // S = Q·Kᵀ: k-step s covers dims 16s .. 16s + 16, 32 bytes into chunk s / 4.
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (u32 ks = 0; ks < 16; ++ks) {
        const u32 off = (ks / 4) * 64 * 128 + (ks % 4) * 32;
        wgmma_ss_64x64(s, wgmma_desc(tq + off, 16, 1024), wgmma_desc(tk + off, 16, 1024), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgc_store(s, (float*)p.s, warp, g, t);
    // O = P·V: k-step kk covers keys 16kk .. 16kk + 16 (2,048 bytes of each chunk); V's chunks
    // are the N direction, 64 rows x 128 bytes (8 KiB) apart.
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    const u16* pp = (const u16*)p.p;
    u32 a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const u32 r = 16 * warp + g, c = 16 * kk + 2 * t;
        a[kk][0] = *(const u32*)(pp + r * 64 + c);
        a[kk][1] = *(const u32*)(pp + (r + 8) * 64 + c);
        a[kk][2] = *(const u32*)(pp + r * 64 + c + 8);
        a[kk][3] = *(const u32*)(pp + (r + 8) * 64 + c + 8);
    }
    wgmma_fence();
#pragma unroll
    for (u32 kk = 0; kk < 4; ++kk) wgmma_rs_64x256(o, a[kk], wgmma_desc(tv + kk * 2048, p.v_lbo, p.v_sbo), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgc_store(o, (float*)p.o, warp, g, t);
#else
    const float nan = __int_as_float(0x7fc00000);
    for (u32 i = tid; i < 64 * 64; i += 128) ((float*)p.s)[i] = nan;
    for (u32 i = tid; i < 64 * 256; i += 128) ((float*)p.o)[i] = nan;
    (void)warp, (void)g, (void)t, (void)lane;
#endif
}
