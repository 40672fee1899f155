// What one link of a decode step's chain of dependent kernels costs, by how a kernel waits for
// the one ahead: a CUDA graph of N launches of a kernel that does almost nothing (each block
// reads one float the previous launch wrote and writes one), replayed; the time a link is the
// graph's time over N. A decode step of the 35B is ~490 such links (docs/perf.md g19, g20:
// ~2.3 us each at the floor, ~1.1 ms of a ~2.35 ms step).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/chain-micro.cu -o /tmp/chain-micro && /tmp/chain-micro
//
// Modes:
//   plain  graph edges as the stream orders them: a kernel starts after the one ahead ends
//   pdl    programmatic edges (what ember runs): every kernel opens with griddepcontrol.wait,
//          then launch_dependents, so the next kernel's blocks are resident and waiting
//   flag   programmatic edges, but a kernel's blocks wait on a counter instead of
//          griddepcontrol.wait: each block of the kernel ahead adds 1 with release semantics
//          after its write; a block spins (acquire loads) until the count reaches that
//          kernel's block count, then calls launch_dependents. The wait ends when the last
//          block ahead has written, not when the grid has ended and been flushed.
// for grids of 1, 132 and 1,024 blocks of 128 threads (a norm, a small kernel, a GEMV).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "ck.cuh"

enum Mode { PLAIN = 0, PDL = 1, FLAG = 2 };

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Link i of the chain: reads data[i - 1][b], writes data[i][b] (b = block), one float a block.
__global__ void link(int mode, int i, unsigned* count, float* data, int grid_prev, int grid) {
    if (mode == PDL) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    } else if (mode == FLAG) {
        if (i > 0 && threadIdx.x == 0)
            while (ld_acquire(count + i - 1) < (unsigned)grid_prev) {
            }
        __syncthreads();
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    const int b = blockIdx.x;
    if (threadIdx.x == 0) {
        const float v = i > 0 ? data[(size_t)(i - 1) * grid + b % grid_prev] : 0.0f;
        data[(size_t)i * grid + b] = v + 1.0f;
        if (mode == FLAG) red_release_add(count + i, 1);
    }
}

int main() {
    const int N = 400, REPS = 20;
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d SMs; %d links a graph, %d replays (median)\n", prop.name, prop.multiProcessorCount, N, REPS);
    unsigned* count;
    float* data;
    CK(cudaMalloc(&count, N * sizeof(unsigned)));
    CK(cudaMalloc(&data, (size_t)N * 1024 * sizeof(float)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int grid : {1, 132, 1024}) {
        for (int mode : {PLAIN, PDL, FLAG}) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            CK(cudaMemsetAsync(count, 0, N * sizeof(unsigned), s));
            for (int i = 0; i < N; ++i) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(grid);
                cfg.blockDim = dim3(128);
                cfg.stream = s;
                cudaLaunchAttribute attr[1];
                attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                attr[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.attrs = attr;
                cfg.numAttrs = (mode != PLAIN && i > 0) ? 1 : 0;
                CK(cudaLaunchKernelEx(&cfg, link, mode, i, count, data, grid, grid));
            }
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t ge;
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, s));  // warm-up
            CK(cudaStreamSynchronize(s));
            std::vector<float> ms;
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a));
            CK(cudaEventCreate(&b));
            for (int r = 0; r < REPS; ++r) {
                CK(cudaEventRecord(a, s));
                CK(cudaGraphLaunch(ge, s));
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float t;
                CK(cudaEventElapsedTime(&t, a, b));
                ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            // The chain's result: link N-1 of block 0 holds N (each link adds 1).
            float last;
            CK(cudaMemcpy(&last, data + (size_t)(N - 1) * grid, sizeof(float), cudaMemcpyDeviceToHost));
            const char* name[] = {"plain", "pdl", "flag"};
            printf("grid %4d  %-5s  %.3f us a link (graph %.1f us)%s\n", grid, name[mode], ms[REPS / 2] * 1000.0f / N,
                   ms[REPS / 2] * 1000.0f, last == (float)N ? "" : "  WRONG RESULT");
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
    }
    return 0;
}
