// add: h ← h + x, elementwise. Reference: ember_ops::reference::add.

struct AddParams {
    u64 h;  // [n] f32, updated in place
    u64 x;  // [n] f32
    u64 n;
};

extern "C" __global__ void add(const AddParams p) {
    pdl_enter();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) ((float*)p.h)[i] += ((const float*)p.x)[i];
}
