// Device side of gemv-micro.cu: variants of the one-token int8 GEMV (kernels/gemv_q8.cu) to
// find where its bandwidth goes. Compiled after prelude.cuh, dequant.cuh, q8.cuh and
// gemv_q8.cu (the production kernel, variant "prod").

// Bandwidth ceiling: read every byte of the weight with 16-byte loads, grid-stride.
extern "C" __global__ void read_all(const uint4* w, u64 n16, u32* out) {
    u32 acc = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) {
        const uint4 v = w[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;  // keeps the loads
}

// "pre": Q4_K, 8 lanes a unit, one row per 8 lanes (wr = 1), every unit's weights and header
// loaded before any arithmetic (NU units a row, compile-time).
template <int NU>
__global__ void q4k_pre(const u8* w, float* y, const i8* xq, int n_rows) {
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, row = tid / 8, t = tid % 8;
    const int k = NU * 256;
    const float2* xd = (const float2*)(xq + k);
    float acc = 0.0f;
    if (row < n_rows) {
        const u8* wrow = w + (u64)row * (144 * NU);
        uint4 h[NU], q[NU];
#pragma unroll
        for (int c = 0; c < NU; ++c) {
            h[c] = *(const uint4*)(wrow + 144 * c);
            q[c] = *(const uint4*)(wrow + 144 * c + 16 + 16 * t);
        }
        const int p = t / 2, i0 = 16 * (t % 2);
#pragma unroll
        for (int c = 0; c < NU; ++c) {
            const int4 xl = *(const int4*)(xq + 256 * c + 64 * p + i0);
            const int4 xh = *(const int4*)(xq + 256 * c + 64 * p + 32 + i0);
            const uint4 qq = q[c], hh = h[c];
            int sl = dp4a(qq.x & 0x0F0F0F0F, xl.x, 0), sh = dp4a((qq.x >> 4) & 0x0F0F0F0F, xh.x, 0);
            sl = dp4a(qq.y & 0x0F0F0F0F, xl.y, sl), sh = dp4a((qq.y >> 4) & 0x0F0F0F0F, xh.y, sh);
            sl = dp4a(qq.z & 0x0F0F0F0F, xl.z, sl), sh = dp4a((qq.z >> 4) & 0x0F0F0F0F, xh.z, sh);
            sl = dp4a(qq.w & 0x0F0F0F0F, xl.w, sl), sh = dp4a((qq.w >> 4) & 0x0F0F0F0F, xh.w, sh);
            int sc0, mn0, sc1, mn1;
            scale_min_k4_words(2 * p, hh.y, hh.z, hh.w, &sc0, &mn0);
            scale_min_k4_words(2 * p + 1, hh.y, hh.z, hh.w, &sc1, &mn1);
            const float d = f16_to_f32((u16)(hh.x & 0xFFFF)), dmin = f16_to_f32((u16)(hh.x >> 16));
            const float2 a = xd[8 * c + 2 * p], e = xd[8 * c + 2 * p + 1];
            float r = d * ((float)sc0 * a.x * (float)sl + (float)sc1 * e.x * (float)sh);
            if (t % 2 == 0) r -= dmin * ((float)mn0 * a.y + (float)mn1 * e.y);
            acc += r;
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    if (row < n_rows && t == 0) y[row] = acc;
}

// "l4": Q4_K, 4 lanes a unit (lane p: sub-blocks 2p and 2p + 1, 32 bytes of quants), one row
// per 4 lanes, every unit's loads first.
template <int NU>
__global__ void q4k_l4(const u8* w, float* y, const i8* xq, int n_rows) {
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, row = tid / 4, p = tid % 4;
    const int k = NU * 256;
    const float2* xd = (const float2*)(xq + k);
    float acc = 0.0f;
    if (row < n_rows) {
        const u8* wrow = w + (u64)row * (144 * NU);
        uint4 h[NU], qa[NU], qb[NU];
#pragma unroll
        for (int c = 0; c < NU; ++c) {
            h[c] = *(const uint4*)(wrow + 144 * c);
            qa[c] = *(const uint4*)(wrow + 144 * c + 16 + 32 * p);
            qb[c] = *(const uint4*)(wrow + 144 * c + 32 + 32 * p);
        }
#pragma unroll
        for (int c = 0; c < NU; ++c) {
            const int4 xl0 = *(const int4*)(xq + 256 * c + 64 * p), xl1 = *(const int4*)(xq + 256 * c + 64 * p + 16);
            const int4 xh0 = *(const int4*)(xq + 256 * c + 64 * p + 32), xh1 = *(const int4*)(xq + 256 * c + 64 * p + 48);
            const uint4 a = qa[c], b = qb[c], hh = h[c];
            int sl = dp4a(a.x & 0x0F0F0F0F, xl0.x, 0), sh = dp4a((a.x >> 4) & 0x0F0F0F0F, xh0.x, 0);
            sl = dp4a(a.y & 0x0F0F0F0F, xl0.y, sl), sh = dp4a((a.y >> 4) & 0x0F0F0F0F, xh0.y, sh);
            sl = dp4a(a.z & 0x0F0F0F0F, xl0.z, sl), sh = dp4a((a.z >> 4) & 0x0F0F0F0F, xh0.z, sh);
            sl = dp4a(a.w & 0x0F0F0F0F, xl0.w, sl), sh = dp4a((a.w >> 4) & 0x0F0F0F0F, xh0.w, sh);
            sl = dp4a(b.x & 0x0F0F0F0F, xl1.x, sl), sh = dp4a((b.x >> 4) & 0x0F0F0F0F, xh1.x, sh);
            sl = dp4a(b.y & 0x0F0F0F0F, xl1.y, sl), sh = dp4a((b.y >> 4) & 0x0F0F0F0F, xh1.y, sh);
            sl = dp4a(b.z & 0x0F0F0F0F, xl1.z, sl), sh = dp4a((b.z >> 4) & 0x0F0F0F0F, xh1.z, sh);
            sl = dp4a(b.w & 0x0F0F0F0F, xl1.w, sl), sh = dp4a((b.w >> 4) & 0x0F0F0F0F, xh1.w, sh);
            int sc0, mn0, sc1, mn1;
            scale_min_k4_words(2 * p, hh.y, hh.z, hh.w, &sc0, &mn0);
            scale_min_k4_words(2 * p + 1, hh.y, hh.z, hh.w, &sc1, &mn1);
            const float d = f16_to_f32((u16)(hh.x & 0xFFFF)), dmin = f16_to_f32((u16)(hh.x >> 16));
            const float2 e0 = xd[8 * c + 2 * p], e1 = xd[8 * c + 2 * p + 1];
            acc += d * ((float)sc0 * e0.x * (float)sl + (float)sc1 * e1.x * (float)sh) - dmin * ((float)mn0 * e0.y + (float)mn1 * e1.y);
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (row < n_rows && p == 0) y[row] = acc;
}

// "stg": the production row kernel (gemv_q8_rows in kernels/gemv_q8.cu, which this variant
// became): a warp stages R whole rows in shared memory with 16-byte cp.async, then its lanes take
// the R rows' units L lanes at a time. Shared memory: GEMV_Q8_ROWS_WARPS · R · row_bytes.
template <int TY, int R>
__global__ void stg(const u8* w, float* y, const i8* xq, int n_rows, int row_bytes, int k) {
    const GemvQ8RowsParams p = {(u64)w, (u64)y, (u64)xq, (u32)n_rows, (u32)row_bytes, (u32)k, 0};
    gemv_q8_rows<TY, R>(p);
}

// Adds this lane's units of staged rows r0..r0 + nr (of R) into acc[row].
template <int TY, int R>
__device__ __forceinline__ void stg_units(const u8* s, int r0, int nr, int row_bytes, int k, const i8* xq, float* acc) {
    using U = Q8Unit<TY>;
    const int lane = threadIdx.x % 32, n_units = k / U::W;
    const float2* xd = (const float2*)(xq + k);
    for (int u = lane / U::L; u < nr * n_units; u += 32 / U::L) {
        const int r = r0 + u / n_units;
        const float v = U::dot(s + r * row_bytes, n_units, u % n_units, lane % U::L, xq, xd);
#pragma unroll
        for (int j = 0; j < R; ++j) acc[j] += j == r ? v : 0.0f;
    }
}

// "stg2": as stg, but the warp's rows come in two halves of R / 2, the second half's copy in
// flight while the first half is computed (GEMV_Q8_ROWS_WARPS warps a block).
template <int TY, int R>
__global__ void stg2(const u8* w, float* y, const i8* xq, int n_rows, int row_bytes, int k) {
    extern __shared__ uint4 smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int row0 = (blockIdx.x * nw + warp) * R;
    if (row0 >= n_rows) return;
    const int nr = min(R, n_rows - row0);
    u8* s = (u8*)smem + (u64)warp * R * row_bytes;
    const u8* src = w + (u64)row0 * row_bytes;
    const int h = R / 2, n_a = min(h, nr), n_b = nr - n_a;
    for (int i = lane; i < n_a * row_bytes / 16; i += 32) copy16_async(s + 16 * i, src + 16 * i);
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int i = lane; i < n_b * row_bytes / 16; i += 32) copy16_async(s + h * row_bytes + 16 * i, src + h * row_bytes + 16 * i);
    asm volatile("cp.async.commit_group;" ::: "memory");
    float acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0.0f;
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncwarp();
    stg_units<TY, R>(s, 0, n_a, row_bytes, k, xq, acc);
    copy_async_wait();
    __syncwarp();
    stg_units<TY, R>(s, h, n_b, row_bytes, k, xq, acc);
#pragma unroll
    for (int j = 0; j < R; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0 && j < nr) y[row0 + j] = v;
    }
}
