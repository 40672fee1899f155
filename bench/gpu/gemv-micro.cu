// A microbenchmark of the one-token int8 GEMV (kernels/gemv_q8.cu) against variants
// (gemv-micro.cuh), on the decode shapes of the 35B-A3B: where does its bandwidth go?
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I crates/ember-cuda/kernels -I bench/gpu \
//        bench/gpu/gemv-micro.cu -o /tmp/gemv-micro && /tmp/gemv-micro
//
// Weights are random blocks (scales set so no value is inf or NaN), copied enough times that
// the copies together exceed the L2 twice over; launch i reads copy i % copies, as a decode
// step reads each layer's weights once. Times: cudaEvents around ITERS back-to-back launches
// (no graph, no programmatic launch), so the figure includes the launch gap. Each variant's
// output is compared with the production kernel's on copy 0.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "prelude.cuh"
#include "dequant.cuh"
#include "q8.cuh"
#include "gemv_q8.cu"
#include "q6_repack.cu"
#include "gemv-micro.cuh"
#include "ck.cuh"

__global__ void fill_random(u8* p, u64 n, u64 seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = (i + seed) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        p[i] = (u8)(z >> 56);
    }
}

// Sets every block's f16 scale(s) to 2^-7 (0x2000): bytes at `off` (and off + 2 when two).
__global__ void fix_scales(u8* p, u64 n_blocks, int block_bytes, int off, int two) {
    for (u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x; b < n_blocks; b += (u64)gridDim.x * blockDim.x) {
        u8* q = p + b * block_bytes + off;
        q[0] = 0x00, q[1] = 0x20;
        if (two) q[2] = 0x00, q[3] = 0x20;
    }
}

struct Type {
    int ty, w, bb, lanes, scale_off, two;
    const char* name;
};
static const Type Q4K{TY_Q4_K, 256, 144, 8, 0, 1, "q4_k"};
static const Type Q6K{TY_Q6_K, 256, 210, 8, 208, 0, "q6_k"};
static const Type Q80{TY_Q8_0, 32, 34, 4, 0, 0, "q8_0"};

static int n_sm;
static cudaStream_t st;

// A launch on `st`, with programmatic dependent launch allowed when `pdl` (the kernel may start
// while the one ahead drains; its griddepcontrol.wait orders the rest).
template <typename... P, typename... A>
static void launch_ex(void (*k)(P...), dim3 g, dim3 b, size_t smem, bool pdl, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = g, cfg.blockDim = b, cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    cfg.attrs = at, cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, k, args...));
}

static int workers_per_row(int n_rows, int n_units, int lanes, int fill) {
    long want = ((long)n_sm * fill + (long)n_rows * lanes - 1) / ((long)n_rows * lanes);
    long p2 = 1;
    while (p2 < want) p2 *= 2;
    int units = n_units;
    if (units & (units - 1)) {
        int q = 1;
        while (q * 2 <= units) q *= 2;
        units = q;
    }
    long wr = p2 < units ? p2 : units;
    if (wr > 128 / lanes) wr = 128 / lanes;
    return (int)wr;
}

template <typename K>
static void launch_prod(K kern, const Type& T, const u8* w, float* y, const i8* xq, int rows, int k, int fill, bool pf = false, bool pdl = false) {
    GemvQ8Params p;
    memset(&p, 0, sizeof p);
    const int wr = workers_per_row(rows, k / T.w, T.lanes, fill);
    const int per_block = 128 / (wr * T.lanes);
    const u32 blocks = (rows + per_block - 1) / per_block;
    p.w[0] = (u64)w, p.y[0] = (u64)y, p.xq = (u64)xq;
    p.n_rows[0] = rows, p.row_bytes[0] = k / T.w * T.bb, p.wr[0] = wr;
    p.block0[0] = 0;
    for (int i = 1; i <= GEMV_Q8_MULTI; ++i) p.block0[i] = blocks;
    p.k = k, p.n = 1, p.prefetch = pf;
    for (int i = 0; i < GEMV_Q8_MULTI; ++i) p.wr[i] = i == 0 ? wr : 1;
    launch_ex(kern, blocks, 128, 0, pdl, p);
}

template <int TY, int R>
static void launch_stg(bool two, const u8* w, float* y, const i8* xq, int rows, int row_bytes, int k) {
    const int warps = GEMV_Q8_ROWS_WARPS, per_block = warps * R;
    const int blocks = (rows + per_block - 1) / per_block;
    const size_t smem = (size_t)warps * R * row_bytes;
    if (two) {
        static bool set = false;
        if (!set) {
            CK(cudaFuncSetAttribute(stg2<TY, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
            set = true;
        }
        stg2<TY, R><<<blocks, 32 * warps, smem, st>>>(w, y, xq, rows, row_bytes, k);
    } else {
        static bool set = false;
        if (!set) {
            CK(cudaFuncSetAttribute(stg<TY, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
            set = true;
        }
        stg<TY, R><<<blocks, 32 * warps, smem, st>>>(w, y, xq, rows, row_bytes, k);
    }
}

template <int TY>
static void add_stg(std::vector<std::pair<std::string, std::function<void(const u8*, float*)>>>& v, const i8* xq, int rows, int rb, int k) {
    v.push_back({"stg R=2", [=](const u8* w, float* y) { launch_stg<TY, 2>(false, w, y, xq, rows, rb, k); }});
    v.push_back({"stg R=4", [=](const u8* w, float* y) { launch_stg<TY, 4>(false, w, y, xq, rows, rb, k); }});
    v.push_back({"stg2 R=4", [=](const u8* w, float* y) { launch_stg<TY, 4>(true, w, y, xq, rows, rb, k); }});
}

static void run_shape(const char* label, const Type& T, int rows, int k) {
    const int row_bytes = k / T.w * T.bb;
    const size_t bytes = (size_t)rows * row_bytes;
    int copies = (int)((size_t)(256u << 20) / bytes) + 1;
    if (copies < 2) copies = 2;
    u8* w;
    CK(cudaMalloc(&w, bytes * copies));
    fill_random<<<n_sm * 8, 256>>>(w, bytes * copies, 12345);
    const u64 n_blocks = bytes * copies / T.bb;
    fix_scales<<<n_sm * 8, 256>>>(w, n_blocks, T.bb, T.scale_off, T.two);
    // Q6_K as the GPU keeps it: each row repacked at upload (kernels/q6_repack.cu; docs/perf.md
    // g28), every copy in place.
    if (T.ty == TY_Q6_K) {
        const Q6RepackParams rp = {(u64)w, (u64)rows * copies, (u32)row_bytes, (u32)(k / 256)};
        q6k_repack<<<n_sm * 16, 256, row_bytes>>>(rp);
    }
    CK(cudaDeviceSynchronize());
    // x: k int8 values in [-127, 127] and k / 32 (d, d·Σq) pairs.
    std::vector<u8> hx(k + 8 * (k / 32));
    srand(7);
    for (int i = 0; i < k; ++i) hx[i] = (u8)(i8)(rand() % 255 - 127);
    for (int b = 0; b < k / 32; ++b) {
        int s = 0;
        for (int i = 0; i < 32; ++i) s += (i8)hx[32 * b + i];
        const float d = 0.01f, ds = d * s;
        memcpy(&hx[k + 8 * b], &d, 4);
        memcpy(&hx[k + 8 * b + 4], &ds, 4);
    }
    i8* xq;
    CK(cudaMalloc(&xq, hx.size()));
    CK(cudaMemcpy(xq, hx.data(), hx.size(), cudaMemcpyHostToDevice));
    float *y, *yref;
    CK(cudaMalloc(&y, rows * sizeof(float)));
    CK(cudaMalloc(&yref, rows * sizeof(float)));
    u32* sink;
    CK(cudaMalloc(&sink, 4));

    std::vector<std::pair<std::string, std::function<void(const u8*, float*)>>> v;
    v.push_back({"read_all", [=](const u8* w, float*) {
                     const u64 n16 = bytes / 16;
                     read_all<<<n_sm * 8, 512, 0, st>>>((const uint4*)w, n16, sink);
                 }});
    for (int fill : {512, 2048}) {
        const std::string name = "prod fill " + std::to_string(fill);
        v.push_back({name, [=](const u8* w, float* y) {
                         if (T.ty == TY_Q4_K) launch_prod(gemv_q8_q4_k, T, w, y, xq, rows, k, fill);
                         if (T.ty == TY_Q6_K) launch_prod(gemv_q8_q6_k, T, w, y, xq, rows, k, fill);
                         if (T.ty == TY_Q8_0) launch_prod(gemv_q8_q8_0, T, w, y, xq, rows, k, fill);
                     }});
    }
    for (int fill : {512, 2048}) {
        for (int mode = 1; mode < 4; ++mode) {
            const bool pf = mode & 1, pdl = mode & 2;
            const std::string name = std::string(pf ? "pf" : "") + (pdl ? "+pdl" : "") + " " + std::to_string(fill);
            v.push_back({name, [=](const u8* w, float* y) {
                             if (T.ty == TY_Q4_K) launch_prod(gemv_q8_q4_k, T, w, y, xq, rows, k, fill, pf, pdl);
                             if (T.ty == TY_Q6_K) launch_prod(gemv_q8_q6_k, T, w, y, xq, rows, k, fill, pf, pdl);
                             if (T.ty == TY_Q8_0) launch_prod(gemv_q8_q8_0, T, w, y, xq, rows, k, fill, pf, pdl);
                         }});
        }
    }
    if (T.ty == TY_Q4_K && (k == 2048 || k == 4096)) {
        v.push_back({"pre", [=](const u8* w, float* y) {
                         const int th = rows * 8;
                         if (k == 2048) q4k_pre<8><<<(th + 127) / 128, 128, 0, st>>>(w, y, xq, rows);
                         else q4k_pre<16><<<(th + 127) / 128, 128, 0, st>>>(w, y, xq, rows);
                     }});
        v.push_back({"l4", [=](const u8* w, float* y) {
                         const int th = rows * 4;
                         if (k == 2048) q4k_l4<8><<<(th + 127) / 128, 128, 0, st>>>(w, y, xq, rows);
                         else q4k_l4<16><<<(th + 127) / 128, 128, 0, st>>>(w, y, xq, rows);
                     }});
    }
    // (The staged rows need rows of whole 16-byte chunks: not an expert's Q6_K down, 420 bytes.)
    if (T.ty == TY_Q4_K && row_bytes % 16 == 0) add_stg<TY_Q4_K>(v, xq, rows, row_bytes, k);
    if (T.ty == TY_Q6_K && row_bytes % 16 == 0) add_stg<TY_Q6_K>(v, xq, rows, row_bytes, k);
    if (T.ty == TY_Q8_0 && row_bytes % 16 == 0) add_stg<TY_Q8_0>(v, xq, rows, row_bytes, k);

    // The reference: production kernel, fill 512, copy 0.
    v[1].second(w, yref);
    CK(cudaStreamSynchronize(st));
    std::vector<float> ref(rows), got(rows);
    CK(cudaMemcpy(ref.data(), yref, rows * 4, cudaMemcpyDeviceToHost));
    float rmax = 0;
    for (float r : ref) rmax = fmaxf(rmax, fabsf(r));

    const int iters = bytes > (64u << 20) ? 40 : 200;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("%-10s %-5s rows %6d k %5d: %7.2f MB, %d copies\n", label, T.name, rows, k, bytes / 1e6, copies);
    for (auto& [name, f] : v) {
        CK(cudaMemset(y, 0, rows * 4));
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < 10; ++i) f(w + (size_t)(i % copies) * bytes, y);
        CK(cudaGetLastError());
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < iters; ++i) f(w + (size_t)(i % copies) * bytes, y);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = 1e3 * ms / iters;
        f(w, y);
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(got.data(), y, rows * 4, cudaMemcpyDeviceToHost));
        double err = 0;
        for (int i = 0; i < rows; ++i) err = fmax(err, fabs(got[i] - ref[i]));
        if (name == "read_all") err = 0;
        printf("  %-14s %9.2f us %8.0f GB/s   max err / max |y| %.2e\n", name.c_str(), us, bytes / us / 1e3, rmax > 0 ? err / rmax : err);
    }
    CK(cudaFree(w));
    CK(cudaFree(xq));
    CK(cudaFree(y));
    CK(cudaFree(yref));
    CK(cudaFree(sink));
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    n_sm = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("%s, %d SMs, L2 %d MB\n", prop.name, n_sm, prop.l2CacheSize >> 20);
    if (getenv("Q6_ONLY")) {  // the Q6_K shapes alone
        run_shape("q6 qkv", Q6K, 8192, 2048);
        run_shape("q6 down", Q6K, 2048, 512);
        run_shape("head", Q6K, 248320, 2048);
        return 0;
    }
    run_shape("qkvz", Q4K, 12288, 2048);
    run_shape("out", Q4K, 2048, 4096);
    run_shape("expert", Q4K, 512, 2048);
    run_shape("q6 proj", Q6K, 12288, 2048);
    run_shape("q6 qkv", Q6K, 8192, 2048);
    run_shape("q6 down", Q6K, 2048, 512);
    run_shape("head", Q6K, 248320, 2048);
    run_shape("qkvz", Q80, 12288, 2048);
    run_shape("out", Q80, 2048, 4096);
    run_shape("head", Q80, 248320, 2048);
    return 0;
}
