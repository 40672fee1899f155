// gate: y ← y ⊙ act(g), act = SiLU (0) or sigmoid (1). Reference: ember_ops::reference::gate.

struct GateParams {
    u64 y;  // [n] f32, updated in place
    u64 g;  // [n] f32
    u64 n;
    u32 act, pad;
};

extern "C" __global__ void gate(const GateParams p) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n) return;
    const float g = ((const float*)p.g)[i];
    ((float*)p.y)[i] *= p.act == 0 ? silu_f(g) : sigmoid_f(g);
}
