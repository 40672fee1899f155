// What the tensor-core prompt tiles share (attend_mma in attention_prefill.cu, attention_wg in
// attention_wg.cu): which rows, heads and keys a block takes, its pages, the Q tile's f16 rows,
// and the output (or a key range's partial result). Grid (tiles, n_head / hb, n_split): tile
// blockIdx.x of the call is found by walking the sequences' row counts, ceil(n / tr) tiles each
// of tr = M / hb rows; each of a tile's M query vectors is (row i / hb, head h0 + i % hb). A warp
// keeps the 16 vectors 16·warp .. + 16, lane (g, t) the two vectors 16·warp + g (+ 8).

__device__ __forceinline__ uint4 pack8(const float* x) {
    uint4 v;
    v.x = pack_f16x2(x[0], x[1]);
    v.y = pack_f16x2(x[2], x[3]);
    v.z = pack_f16x2(x[4], x[5]);
    v.w = pack_f16x2(x[6], x[7]);
    return v;
}

struct MmaTile {
    u32 r0, nr;      // rows r0 .. r0 + nr of one sequence
    u32 h0, kvh;     // first query head, its KV head
    u32 k_lo, k_hi;  // keys [k_lo, k_hi) of this block's range (empty for a bad slot)
    int lim[2];      // causal limits of the lane's two vectors (-1: not a row of the tile)
    int lim_lo;      // the lowest of the warp's
    bool bad;        // slot or table out of range (and, once a page id is, that too)
    const u32* tk;   // the layer's K and V page tables for the tile's slot
    const u32* tv;
};

// This block's tile of M query vectors; false when the grid has no tile for it (the block ends).
template <int M>
__device__ __forceinline__ bool mma_tile(const AttentionParams& p, u32 warp, u32 g, MmaTile& tl) {
    const u32 hb = p.heads_per_block, tr = M / hb;
    const u32* seq_n = (const u32*)p.seq_n;
    u32 ti = blockIdx.x, s = 0;
    for (; s < p.n_seq; ++s) {
        const u32 nt = (seq_n[s] + tr - 1) / tr;
        if (ti < nt) break;
        ti -= nt;
    }
    if (s >= p.n_seq) return false;
    tl.r0 = ((const u32*)p.seq_row0)[s] + ti * tr;
    tl.nr = min(tr, seq_n[s] - ti * tr);
    tl.h0 = blockIdx.y * hb;
    tl.kvh = tl.h0 / (p.n_head / p.n_head_kv);
    const u32* pos = (const u32*)p.pos;
    u32 kend = 0;  // every thread: one past the tile's last position
    for (u32 i = 0; i < tl.nr; ++i) kend = max(kend, pos[tl.r0 + i] + 1);
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 row = (16 * warp + g + 8 * a) / hb;
        tl.lim[a] = row < tl.nr ? (int)pos[tl.r0 + row] : -1;
    }
    int lim_lo = min(tl.lim[0], tl.lim[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lim_lo = min(lim_lo, __shfl_xor_sync(0xffffffffu, lim_lo, o));
    tl.lim_lo = lim_lo;
    const u32 slot = ((const u32*)p.row_slot)[tl.r0];
    tl.k_lo = blockIdx.z * p.keys_per_split;
    tl.k_hi = min(kend, tl.k_lo + p.keys_per_split);
    tl.bad = slot >= p.n_slots || (tl.k_hi + KV_PAGE - 1) / KV_PAGE > p.stride;
    if (tl.bad || tl.k_hi < tl.k_lo) tl.k_hi = tl.k_lo;
    tl.tk = (const u32*)p.table + ((u64)(tl.bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    tl.tv = tl.tk + p.stride;
    return true;
}

// Page kb of the K (or V) cache through table `tab`; an id out of range reads page 0 and marks
// the tile bad.
__device__ __forceinline__ const u8* mma_tile_page(const AttentionParams& p, MmaTile& tl, const u32* tab, u32 kb) {
    u32 id = tab[kb / KV_PAGE];
    if (id >= p.n_pages) {
        tl.bad = true;
        id = 0;
    }
    return (const u8*)p.pool + (u64)id * KV_PAGE * p.row_bytes;
}

// Q's 8 values d8 .. d8 + 8 of vector i, scaled (zeros past the tile's rows).
__device__ __forceinline__ uint4 mma_tile_q8(const AttentionParams& p, const MmaTile& tl, u32 i, u32 d8) {
    const u32 hd = p.head_dim, row = i / p.heads_per_block;
    float x[8];
    if (row < tl.nr) {
        const float* qr = (const float*)p.q + (u64)(tl.r0 + row) * p.n_head * hd + (u64)(tl.h0 + i % p.heads_per_block) * hd + d8;
        const float4 a = ld4(qr), b = ld4(qr + 4);
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] *= p.scale;
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = 0.0f;
    }
    return pack8(x);
}

// The output (n_split = 1: O / l) or this range's partial result (O, and the max and sum) of the
// lane's two vectors: o in the mma.m16n8 accumulator layout, 8-dim tile c's values of vector
// 16·warp + g + 8a at o[4c + 2a], + 1; l the lane's share of each sum.
__device__ __forceinline__ void mma_tile_store(const AttentionParams& p, const MmaTile& tl, const float* o, const float (&m)[2], float (&l)[2],
                                               u32 warp, u32 g, u32 t) {
    const u32 hd = p.head_dim;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        l[a] += __shfl_xor_sync(0xffffffffu, l[a], 1);
        l[a] += __shfl_xor_sync(0xffffffffu, l[a], 2);
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 i = 16 * warp + g + 8 * a, row = i / p.heads_per_block;
        if (row >= tl.nr) continue;
        const u32 r = tl.r0 + row, n = tl.h0 + i % p.heads_per_block;
        const u64 at = ((u64)r * p.n_head + n) * p.n_split + blockIdx.z;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd : (float*)p.part_acc + at * hd;
        const float f = p.n_split == 1 ? 1.0f / l[a] : 1.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            if (8 * c >= (int)hd) break;
            float2 v;
            v.x = tl.bad ? ATT_NAN : o[4 * c + 2 * a] * f;
            v.y = tl.bad ? ATT_NAN : o[4 * c + 2 * a + 1] * f;
            *(float2*)(dst + 8 * c + 2 * t) = v;
        }
        if (p.n_split > 1 && t == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = tl.bad ? ATT_NAN : m[a];
            ml[1] = l[a];
        }
    }
}
