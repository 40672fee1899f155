// moe.cuh: what the MoE kernels of moe.cu and moe_mma8.cu share: the layer's parameters, where
// an expert sits (partial residency), and the grouped prompt MoE's tile parameters.

struct MoeParams {
    u64 gate;     // [n_expert · n_ff] rows of k = d (ty_gu)
    u64 up;       // same
    u64 down;     // [n_expert · d] rows of k = n_ff (ty_down)
    u64 x;        // [n_tok, d] f32
    u64 ids;      // [n_tok, k_top] u32
    u64 weights;  // [n_tok, k_top] f32
    u64 h;        // [n_tok, k_top, n_ff] f32 (scratch between the two kernels)
    u64 out;      // [n_tok, d] f32
    u64 slot_of;  // [n_expert] u32 slots, or 0 (every expert resident at its index)
    u32 d, n_ff, n_expert, n_tok, k_top, row_bytes_gu, row_bytes_down;
    u32 rows_per_block;  // set per launch (gate/up rows of n_ff, down rows of d)
};

#define MOE_NAN __int_as_float(0x7fffffff)
#define MOE_MISS 0xffffffffu

// Where expert e (< n_expert) sits in the stacked tensors, or MOE_MISS.
__device__ __forceinline__ u32 moe_slot(const MoeParams& p, u32 e) {
    return p.slot_of ? ((const u32*)p.slot_of)[e] : e;
}

// Pairs of one expert a tensor-core tile (moe_plan's tiles).
#define MOE_BM 32

struct MoeMmaParams {
    MoeParams m;
    u64 plan;
    u64 part;  // [n_tok · k_top, d] f32: weighted expert outputs
    u32 max_tiles, pad;
};

// Tile blockIdx.y of a grouped MoE launch (moe_plan's tiles): up to MOE_BM pairs of one expert,
// `e` its slot in the stacked tensors, its pairs list[first .. first + n).
struct MoeTile {
    u32 e, first, n;
    const u32* list;
};

// The block's tile; false when the plan holds fewer tiles than the grid (the whole block returns).
__device__ __forceinline__ bool moe_tile(const MoeMmaParams& q, MoeTile& t) {
    const u32* plan = (const u32*)q.plan;
    const u32 tile = blockIdx.y;
    if (tile >= plan[0]) return false;
    t = {plan[1 + 3 * tile], plan[2 + 3 * tile], plan[3 + 3 * tile], plan + 1 + 3 * q.max_tiles};
    return true;
}
