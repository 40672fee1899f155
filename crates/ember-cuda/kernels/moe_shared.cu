// moe_shared: the last stage of the MoE op, adding the gated shared expert to the routed sum:
// out[t][i] += sigmoid(gate[t]) · s[t][i]. Reference: ember_ops::reference::moe (the shared
// expert is its last slot, token weight sigmoid(shared_gate[t])).

struct MoeSharedParams {
    u64 out;   // [n_tok, d] f32, updated in place
    u64 s;     // [n_tok, d] f32: the shared expert's output
    u64 gate;  // [n_tok] f32: the shared expert's scalar gate (before the sigmoid)
    u32 n_tok, d;
};

// grid (ceil(d / blockDim), n_tok).
extern "C" __global__ void moe_shared_add(const MoeSharedParams p) {
    pdl_enter();
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= p.d) return;
    const float w = sigmoid_f(((const float*)p.gate)[t]);
    const u64 at = (u64)t * p.d + i;
    ((float*)p.out)[at] += w * ((const float*)p.s)[at];
}
