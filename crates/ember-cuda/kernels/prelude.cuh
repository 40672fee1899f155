// Prepended to every kernel source by ember-cuda (src/kernels.rs). Header-free on purpose:
// NVRTC has no include path by default, so there is no <cuda_fp16.h>; the conversions below
// are one PTX instruction each (shared/STACK.md, "Verdict" 1).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

// ggml type ids (gguf-format.md §2), as passed in the `ty` fields of the parameter structs.
#define TY_F32 0
#define TY_F16 1
#define TY_Q8_0 8
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
#define TY_IQ4_XS 23
#define TY_BF16 30

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Little-endian loads at 2-byte alignment (block formats with odd block sizes: Q8_0, Q6_K).
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warp = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warp ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Programmatic dependent launch (sm_90+). Inside a CUDA graph built with programmatic edges
// (src/graph.rs) a kernel's blocks may be resident before the kernel ahead of it has finished.
// Every kernel calls this first, before it touches global memory (only weights, and what
// kernels at least two launches back wrote, may be read before it: see prefetch_l2), and no
// block returns before it: it waits until the kernel ahead has finished and its writes are
// visible, then lets the next kernel's blocks launch (they wait here in turn, so at most two
// kernels overlap). Outside a programmatic launch, and before sm_90, it does nothing.
//
// Under the kernel define EMBER_TRACE (with EMBER_CUDA_TRACE set: src/gpu/trace.rs), block 0's
// thread 0 of every launch appends (%globaltimer once the wait is over, the module's number,
// the grid) to a device buffer: when each kernel's predecessor finished, in launch order, from
// inside CUDA graphs too. Timing only; the results are unchanged.
#ifdef EMBER_TRACE
__device__ unsigned long long* ember_trace_buf = 0;  // [0] count, [1] capacity, then 2 a launch
__device__ unsigned int ember_trace_mod = 0;         // this module's index in kernels::ALL
#endif
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef EMBER_TRACE
    if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x) == 0 && ember_trace_buf) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const unsigned long long i = atomicAdd(ember_trace_buf, 1ull);
        if (i < ember_trace_buf[1]) {
            ember_trace_buf[2 + 2 * i] = t;
            ember_trace_buf[3 + 2 * i] = ((unsigned long long)ember_trace_mod << 40) |
                                         ((unsigned long long)min(gridDim.y, 0xfffffu) << 20) | min(gridDim.x, 0xfffffu);
        }
    }
#endif
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+; kernels that use them are empty below): this block's rank in
// its cluster, the cluster's barrier in two halves (every thread of every block: arrive, then wait
// until all have arrived; with release / acquire, what each wrote before arriving, in any block's
// shared memory or in global memory, is seen by all after the wait; `cluster_arrive` with release,
// `cluster_arrive_relaxed` without), and a load from / a store into another block's shared memory
// at the address this block's `p` has in its own.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
// The 4 bytes at the address this block's `p` has in its own shared memory, from block `rank`'s.
__device__ __forceinline__ u32 ld_cluster_u32(const void* p, u32 rank) {
    u32 a = (u32)__cvta_generic_to_shared(p), ra, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(ra) : "memory");
    return v;
}
__device__ __forceinline__ void st_cluster_f32(const float* p, u32 rank, float v) {
    u32 a = (u32)__cvta_generic_to_shared(p), ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(v) : "memory");
}
#endif

// Asks for bytes [p, p + n) to be brought into L2 (sm_90+: one bulk prefetch, a hint that
// never faults or blocks; before sm_90 nothing). The range shrinks to whole 16-byte chunks
// inside it, as the instruction needs. Kernels call it on their weights *before* pdl_enter:
// weights are written only at upload (the copy, and Q6_K's repack in place: q6_repack.cu,
// stream-ordered before any step that reads them), never by the kernel ahead in a step's
// chain, so their reads may start while it runs, and
// a GEMV's DRAM latency and ramp overlap the previous kernel instead of following it. Anything
// a kernel at least two launches back wrote is also safe to read there (this kernel launched
// after the one ahead passed its own pdl_enter, i.e. after that one's predecessor finished).
__device__ __forceinline__ void prefetch_l2(const void* p, u64 n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const u64 a = ((u64)p + 15) & ~(u64)15, e = ((u64)p + n) & ~(u64)15;
    for (u64 at = a; at < e; at += 1u << 30) {
        const u32 len = (u32)(e - at < (1u << 30) ? e - at : (1u << 30));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(len) : "memory");
    }
#endif
}

// int8 block quantisation of activations (the layout of quantize_q8 in gemv_q8.cu, read by the
// int8 GEMVs): the 32 lanes of a warp hold values 32·b .. 32·b + 31 of an n-value vector (lane
// l the value at `idx` = 32·b + l); q holds the n int8 values, then a float2 (d, d·Σq) per
// block at q + n. Every lane of the warp calls it.
__device__ __forceinline__ void warp_q8(float v, u8* q, u64 n, u64 idx) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int qv = amax > 0.0f ? __float2int_rn(v / d) : 0;
    int s = qv;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    ((i8*)q)[idx] = (i8)qv;
    if (idx % 32 == 0) ((float2*)(q + n))[idx / 32] = make_float2(d, d * (float)s);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// 16 bytes from global to shared memory without a register round trip (sm_80+: cp.async, to be
// waited for with copy_async_wait; before sm_80 a plain copy). Both addresses 16-byte aligned.
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem));
#else
    *(uint4*)smem = *(const uint4*)gmem;
#endif
}

__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
