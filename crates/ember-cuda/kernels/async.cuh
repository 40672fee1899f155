// Shared-memory staging and fragment loads for the tensor-core attention kernels
// (attention_prefill.cu's tiles, attention_decode_mma.cu): cp.async copies, ldmatrix and
// movmatrix, and a two-instruction e^x. Prepended after mma.cuh (pack_f16x2, mma_16816).

// e^x as ex2.approx.ftz of x·log2(e): two instructions, where expf adds a range check and a
// slow path (~16 with its branch). Relative error ~2^-22 plus x·2^-24 from the product.
__device__ __forceinline__ float exp_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; n = 0 writes zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
// The same to a shared-memory address already converted (smem_addr).
__device__ __forceinline__ void cp_async16_at(u32 dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Four 8x8 f16 matrices: lanes 8q .. 8q + 8 give the row addresses of matrix q; lane l gets
// row l / 4, columns 2(l % 4) and + 1 of each (the A and B fragment layout of mma.m16n8k16).
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Four 8x8 f16 matrices, transposed: lanes 8q .. 8q + 8 give the row addresses of matrix q.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// One 8x8 f16 matrix held as the mma fragments hold it (lane l: row l / 4, columns 2(l % 4) and
// + 1, one 32-bit word), transposed among the lanes: afterwards lane l holds row l / 4 of the
// transpose (PTX ISA 7.8, sm_75+).
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
#endif
