// gate: y ← y ⊙ act(g), act = SiLU (0) or sigmoid (1). Reference: ember_ops::reference::gate.

// With q set (n a multiple of 32), the result is also written quantised to int8 as quantize_q8
// would (warp_q8), for the int8 GEMV that reads it next.
struct GateParams {
    u64 y;  // [n] f32, updated in place
    u64 g;  // [n] f32
    u64 n;
    u32 act, pad;
    u64 q;  // int8 copy (q8 layout), or 0
};

extern "C" __global__ void gate(const GateParams p) {
    pdl_enter();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n) return;  // whole warps when q is set (n % 32 == 0)
    const float g = ((const float*)p.g)[i];
    const float v = ((float*)p.y)[i] * (p.act == 0 ? silu_f(g) : sigmoid_f(g));
    ((float*)p.y)[i] = v;
    if (p.q) warp_q8(v, (u8*)p.q, p.n, i);
}
