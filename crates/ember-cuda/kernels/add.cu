// add: h ← h + x, elementwise. Reference: ember_ops::reference::add. With n_add > 1, x is n_add
// rows of n summed in row order first (a one-launch MoE's experts, moe_fused_q8); with `set`, h
// ← that sum.

struct AddParams {
    u64 h;  // [n] f32, updated in place
    u64 x;  // [n_add, n] f32
    u64 n;
    u32 n_add, set;
};

extern "C" __global__ void add(const AddParams p) {
    pdl_enter();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n) return;
    const float* x = (const float*)p.x;
    float v = x[i];
    for (u32 k = 1; k < p.n_add; ++k) v += x[k * p.n + i];
    float* h = (float*)p.h;
    h[i] = p.set ? v : h[i] + v;
}
