// The attention kernels' shared part (attention.cu, attention_decode.cu, attention_prefill.cu):
// the paged K/V cache's layout, the parameters every attention launch takes and the row loads.

#define KV_PAGE 64
#define KV_F32 0
#define KV_F16 1
#define KV_Q8_0 8
#define ATT_MAX_PER_LANE 8  // head_dim <= 256
#define ATT_MAX_WARPS 8
#define ATT_NAN __int_as_float(0x7fffffff)
#define ATT_NEG_INF (-__int_as_float(0x7f800000))

struct AttentionParams {
    u64 q;         // [n_rows, n_head · hd] f32
    u64 out;       // [n_rows, n_head · hd] f32
    u64 pool;      // n_pages pages of page_bytes
    u64 table;     // [n_slots · n_kv · 2, stride] u32 page ids
    u64 row_slot;  // [n_rows] u32
    u64 pos;       // [n_rows] u32
    u64 part_ml;   // [n_rows, n_head, n_split, 2] f32: each range's max and sum (split only)
    u64 part_acc;  // [n_rows, n_head, n_split, hd] f32: each range's unnormalised values
    u64 seq_row0;  // [n_seq] u32: each sequence's first row (attention_tiles only)
    u64 seq_n;     // [n_seq] u32: each sequence's rows (attention_tiles only)
    u32 n_rows, n_head, n_head_kv, head_dim;
    u32 ty, row_bytes, stride, layer;
    u32 n_kv, n_slots, n_pages, n_split;
    u32 keys_per_split, n_seq, heads_per_block;
    float scale;
    // The gate after attention (decode on tensor cores, attention_decode_mma, and
    // attention_merge only): with `gate` set, out ← out ⊙ act(gate) (act: SiLU 0, sigmoid 1;
    // gate.cu's product), and with `q8` set also out's int8 copy (warp_q8's bits) for the int8
    // GEMV after it. gate: [n_rows, n_head · hd] f32, or 0; q8: the int8 scratch, or 0.
    u64 gate, q8;
    u32 act, pad;
};

// Value v of the output at index i (of n_rows · n_head · hd) after the gate.
__device__ __forceinline__ float attn_gated(const AttentionParams& p, float v, u64 i) {
    const float g = ((const float*)p.gate)[i];
    return v * (p.act == 0 ? silu_f(g) : sigmoid_f(g));
}

// The int8 copy of 4 consecutive values y at index i (a multiple of 4) of an n-value vector,
// 8 consecutive lanes of a warp holding one block of 32 (i / 4 the lane's position in it): the
// bits of warp_q8 with one value a lane (the block's largest magnitude, d = amax / 127, each
// value rounded to the nearest of its multiples, their integer sum), every lane of the warp
// taking part.
__device__ __forceinline__ void quad_q8(const float (&y)[4], u8* q, u64 n, u64 i) {
    float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    int qv[4], s = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        qv[j] = amax > 0.0f ? __float2int_rn(y[j] / d) : 0;
        s += qv[j];
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    *(u32*)(q + i) = (u32)(u8)(i8)qv[0] | (u32)(u8)(i8)qv[1] << 8 | (u32)(u8)(i8)qv[2] << 16 | (u32)(u8)(i8)qv[3] << 24;
    if (i % 32 == 0) ((float2*)(q + n))[i / 32] = make_float2(d, d * (float)s);
}

// Keys of each range of a decode row of n_keys keys (attention_decode.cu,
// attention_decode_mma.cu): whole pages, about `splits` ranges, a function of the row's own keys.
__host__ __device__ __forceinline__ u32 decode_keys_per_split(u32 n_keys, u32 splits) {
    const u32 pages = (n_keys + KV_PAGE - 1) / KV_PAGE;
    return KV_PAGE * max(1u, (pages + splits - 1) / splits);
}

// A decode block's range (attention_decode.cu, attention_decode_mma.cu): keys [k0, k1) of row
// r's range s, the K and V page tables of its slot and layer, where the partial results of its
// heads h0.. go (head h0 + h at at0 + h·n_split), and whether the slot or the range is bad
// (out of the slot table, or pages past the table's stride: the block then reads nothing and
// gives NaN).
struct DecodeRange {
    u32 k0, k1;
    u64 at0;
    const u32* tk;
    const u32* tv;
    bool bad;
};

// False when range s lies past the row's keys: then its first hb threads have written their
// heads' empty partials (which the merge skips) and the block returns.
__device__ __forceinline__ bool decode_range(const AttentionParams& p, u32 r, u32 s, u32 h0, u32 hb, DecodeRange& d) {
    const u32 n_keys = ((const u32*)p.pos)[r] + 1;
    const u32 kps = decode_keys_per_split(n_keys, p.keys_per_split);
    d.at0 = ((u64)r * p.n_head + h0) * p.n_split + s;
    if (s * kps >= n_keys) {
        if (threadIdx.x < hb) {
            float* ml = (float*)p.part_ml + (d.at0 + threadIdx.x * p.n_split) * 2;
            ml[0] = ATT_NEG_INF;
            ml[1] = 0.0f;
        }
        return false;
    }
    d.k0 = s * kps;
    d.k1 = min(n_keys, d.k0 + kps);
    const u32 slot = ((const u32*)p.row_slot)[r];
    d.bad = slot >= p.n_slots || (d.k1 + KV_PAGE - 1) / KV_PAGE > p.stride;
    d.tk = (const u32*)p.table + ((u64)(d.bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    d.tv = d.tk + p.stride;
    return true;
}

// Value `e` of a cache row.
__device__ __forceinline__ float kv_at(const u8* row, u32 ty, u32 e) {
    if (ty == KV_F32) return ((const float*)row)[e];
    if (ty == KV_F16) return f16_to_f32(((const u16*)row)[e]);
    const u8* blk = row + (u64)(e / 32) * 34;
    return (float)(i8)blk[2 + e % 32] * f16_to_f32(*(const u16*)blk);
}

__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 f4(float x, float y, float z, float w) {
    float4 v;
    v.x = x;
    v.y = y;
    v.z = z;
    v.w = w;
    return v;
}

// Eight consecutive values (from element e0, a multiple of 8) of a cache row, loaded raw so a
// step's loads are all issued before any is converted.
template <int TY>
struct Row8;
template <>
struct Row8<KV_F16> {
    uint4 r;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        if (on) {
            r = *(const uint4*)(row + 2 * (u64)e0);
        } else {
            r.x = r.y = r.z = r.w = 0;
        }
    }
    __device__ __forceinline__ void get(float* x) const {
        const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
            x[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
        }
    }
};
template <>
struct Row8<KV_F32> {
    float4 a, b;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        if (on) {
            a = ((const float4*)(row + 4 * (u64)e0))[0];
            b = ((const float4*)(row + 4 * (u64)e0))[1];
        } else {
            a = b = f4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    __device__ __forceinline__ void get(float* x) const {
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
        x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    }
};
template <>
struct Row8<KV_Q8_0> {
    u32 lo, hi;
    float d;
    __device__ __forceinline__ void load(const u8* row, u32 e0, bool on) {
        // Blocks of 34 bytes (f16 scale, 32 int8): 8 values aligned to 8 stay in one block.
        const u8* blk = row + (u64)(e0 / 32) * 34;
        lo = on ? ld_u32_a2(blk + 2 + e0 % 32) : 0;
        hi = on ? ld_u32_a2(blk + 6 + e0 % 32) : 0;
        d = on ? f16_to_f32(ld_u16(blk)) : 0.0f;
    }
    __device__ __forceinline__ void get(float* x) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            x[i] = (float)(i8)(lo >> (8 * i)) * d;
            x[4 + i] = (float)(i8)(hi >> (8 * i)) * d;
        }
    }
};
