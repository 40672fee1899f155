// The expert tier's mailbox (docs/backend.md, "The expert tier's decode layer"): a decode step's
// MoE layer that holds only some of its routed experts hands its routing to the host through
// host memory mapped into the GPU's address space, and waits for the host's sum of the
// non-resident pairs only when there are some. A layer whose routed pairs are all resident
// never waits on the host.
//
// A mailbox, in 32-bit words (host memory, written by both sides; src/gpu/mailbox.rs):
//   [0] routed  the step's generation, written last by moe_post (release, system scope)
//   [1] done    the generation, written by the host after sum[] (only when n_miss > 0)
//   [2] n_miss  pairs whose expert is not resident
//   [3] timed_out  the generation, written by moe_wait_add when it gave up on the host
//   [4 ..)      ids[cap_pairs] u32, weights[cap_pairs] f32, x[cap_x] f32, sum[cap_x] f32
// `need` is one word of device memory per mailbox: n_miss again, for moe_wait_add to read
// without a trip over PCIe.

#define MB_ROUTED 0
#define MB_DONE 1
#define MB_N_MISS 2
#define MB_TIMED_OUT 3
#define MB_HEAD 4
#define MB_MISS 0xffffffffu  // MOE_MISS of moe.cu: the expert is not on the device

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread 0 waits until `word` holds `gen` (acquire, system scope: the host's writes before it are
// then visible), sleeping between polls up to `max_sleep` ns; after `timeout_ns` it gives up,
// writes `gen` to `timed_out` and returns 0. Returns 1 when the word came.
__device__ __forceinline__ u32 wait_host_word(const u32* word, u32 gen, u64 timeout_ns, u32* timed_out, u32 max_sleep) {
    const u64 t0 = global_ns();
    u32 sleep = 32;
    for (;;) {
        if (ld_acquire_sys(word) == gen) return 1;
        if (global_ns() - t0 > timeout_ns) {
            st_release_sys(timed_out, gen);
            return 0;
        }
        __nanosleep(sleep);
        sleep = sleep < max_sleep ? 2 * sleep : max_sleep;
    }
}

struct MoePostParams {
    u64 ids;      // [n_pairs] u32, the routing on the device
    u64 weights;  // [n_pairs] f32
    u64 x;        // [n_x] f32, the MoE's input
    u64 slot_of;  // [n_expert] u32: slot or MB_MISS
    u64 step;      // one u32 of device memory: this step's generation
    u64 need;     // one u32 of device memory: n_miss for moe_wait_add
    u64 box;      // the mailbox (device address of the mapped host memory)
    u32 n_pairs, n_expert, n_x, cap_pairs;
};

// One block. Copies the routing into the mailbox (and x when some pair misses: the host
// computes those pairs from it), then publishes `routed`. An id out of range counts as
// resident here: the MoE kernels report it (NaN rows), as without a tier.
extern "C" __global__ void moe_post(const MoePostParams p) {
    pdl_enter();
    u32* box = (u32*)p.box;
    const u32* ids = (const u32*)p.ids;
    const float* w = (const float*)p.weights;
    const u32* slot_of = (const u32*)p.slot_of;
    u32* b_ids = box + MB_HEAD;
    float* b_w = (float*)(b_ids + p.cap_pairs);
    float* b_x = b_w + p.cap_pairs;
    __shared__ u32 n_miss;
    if (threadIdx.x == 0) n_miss = 0;
    __syncthreads();
    u32 mine = 0;
    for (u32 i = threadIdx.x; i < p.n_pairs; i += blockDim.x) {
        const u32 e = ids[i];
        mine += e < p.n_expert && slot_of[e] == MB_MISS;
        b_ids[i] = e;
        b_w[i] = w[i];
    }
    if (mine) atomicAdd(&n_miss, mine);
    __syncthreads();
    const u32 miss = n_miss;
    if (miss) {
        const float* x = (const float*)p.x;
        for (u32 i = threadIdx.x; i < p.n_x; i += blockDim.x) b_x[i] = x[i];
    }
    // Every thread's writes reach the host before `routed` does.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        *(u32*)p.need = miss;
        ((volatile u32*)box)[MB_N_MISS] = miss;
        st_release_sys(box + MB_ROUTED, *(const u32*)p.step);
    }
}

struct MoeWaitParams {
    u64 out;   // [n_x] f32: the GPU's MoE output (hits + shared expert), updated in place
    u64 box;
    u64 step;
    u64 need;
    u64 timeout_ns;
    u32 n_x, cap_pairs, cap_x, pad;
};

// Any grid. When moe_post found misses: waits until the host has written the sum of those
// pairs (`done` = this step's generation), then out += sum. A host that has not answered after
// timeout_ns gets NaN rows instead of a hang, and `timed_out` says so (the host then reports the
// step as failed).
extern "C" __global__ void moe_wait_add(const MoeWaitParams p) {
    pdl_enter();
    if (*(const u32*)p.need == 0) return;
    const u32* box = (const u32*)p.box;
    __shared__ u32 ok;
    // (Every block that gives up writes `timed_out`.)
    if (threadIdx.x == 0) ok = wait_host_word(box + MB_DONE, *(const u32*)p.step, p.timeout_ns, (u32*)box + MB_TIMED_OUT, 512);
    __syncthreads();
    // Volatile: the host rewrites sum[] every step, so no cached copy may be read.
    const volatile float* sum = (const volatile float*)(box + MB_HEAD + 2 * p.cap_pairs + p.cap_x);
    float* out = (float*)p.out;
    const float nan = __int_as_float(0x7fc00000);
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_x; i += gridDim.x * blockDim.x) {
        out[i] = ok ? out[i] + sum[i] : nan;
    }
}

// A step's tokens fed by the host (docs/backend.md, "Running ahead"): a decode step queued while
// the one before it still runs starts with feed_wait, which waits until the host has sampled
// that step's tokens from the previous one's rows and written them into the feed (host memory
// mapped into the GPU's address space, src/gpu/feed.rs), then copies them to the step's token
// table. The rest of the step (already queued behind it) goes on from there.
//
// A feed, in 32-bit words:
//   [0] fed        the step's generation, written by the host after tokens[] (release)
//   [1] timed_out  the generation, written by feed_wait when it gave up on the host
//   [2], [3]       unused
//   [4 ..)         tokens[cap]
#define FD_FED 0
#define FD_TIMED_OUT 1
#define FD_HEAD 4

struct FeedWaitParams {
    u64 feed;        // the feed (device address of the mapped host memory)
    u64 step;        // one u32 of device memory: this step's generation
    u64 tokens;      // [n] u32: the step's token table on the device
    u64 timeout_ns;
    u32 n, pad;
};

// One block. A host that has not fed the step after timeout_ns gets token 0 in every row (a
// step of garbage rather than a hung stream) and `timed_out` says so; the host then fails
// that step.
extern "C" __global__ void feed_wait(const FeedWaitParams p) {
    pdl_enter();
    const u32* feed = (const u32*)p.feed;
    __shared__ u32 ok;
    // Short sleeps: the host answers within microseconds of the step ahead's end, and every
    // microsecond here is one the GPU idles.
    if (threadIdx.x == 0) ok = wait_host_word(feed + FD_FED, *(const u32*)p.step, p.timeout_ns, (u32*)feed + FD_TIMED_OUT, 128);
    __syncthreads();
    // Volatile: the host rewrites tokens[] every step, so no cached copy may be read.
    const volatile u32* src = (const volatile u32*)(feed + FD_HEAD);
    u32* dst = (u32*)p.tokens;
    for (u32 i = threadIdx.x; i < p.n; i += blockDim.x) dst[i] = ok ? src[i] : 0u;
}
