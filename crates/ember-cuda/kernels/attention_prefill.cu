// attention_tiles: flash attention over a tile of query vectors (prefill). A block takes up to
// AT_M query vectors of one sequence: TR = AT_M / hb consecutive rows x hb query heads that
// share one KV head (GQA: hb is the largest power of two dividing n_head / n_head_kv, at most
// AT_M), so each K/V page it loads into shared memory serves all of them. It walks the pages of
// its key range (all keys up to the tile's last position, or range blockIdx.z of keys_per_split
// keys when n_split > 1) with an online softmax, masking keys past each row's position.
// Per page of AT_N = 64 keys: S = Q·Kᵀ [64 x 64] in chunks of AT_DC dims (Q and K chunks staged
// transposed in shared memory, each thread a 4 x 4 block of S), then the softmax update of the 4
// query vectors a thread owns (max and sum over the 16 threads sharing them), P to shared
// memory, and O += P·V in chunks of AT_VK keys (each thread 4 query vectors x 4·(hd/64) dims).
// f32 throughout (K/V converted when staged). 256 threads: thread t owns query vectors
// 4·(t / 16) .. +4, keys 4·(t % 16) .. +4 of S and dims 4·(t % 16) + 64·c of O.
// grid (tiles, n_head / hb, n_split): tile x of the call is found by walking the sequences'
// row counts (seq_n), ceil(n / TR) tiles each. head_dim a multiple of 64 (the launcher checks).

#define AT_M 64
#define AT_N 64
#define AT_DC 32
#define AT_VK 16
#define AT_LD (AT_M + 4)  // row stride of the transposed Q/K chunks and of P: float4-aligned
#define AT_THREADS 256


extern "C" __global__ void __launch_bounds__(AT_THREADS, 2) attention_tiles(const AttentionParams p) {
    pdl_enter();
    // Q chunk [AT_DC][AT_LD] then K chunk [AT_DC][AT_LD]; in the value product, V [AT_VK][256].
    __shared__ __align__(16) float sm_qkv[2 * AT_DC * AT_LD];
    __shared__ __align__(16) float sm_p[AT_N * AT_LD];  // P transposed: [key][query vector]
    __shared__ u32 sm_kend;
    const u32 tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const u32 hd = p.head_dim, hb = p.heads_per_block, tr = AT_M / hb;
    const u32* seq_n = (const u32*)p.seq_n;
    // This block's tile: rows r0 .. r0 + nr of one sequence.
    u32 t = blockIdx.x, s = 0;
    for (; s < p.n_seq; ++s) {
        const u32 nt = (seq_n[s] + tr - 1) / tr;
        if (t < nt) break;
        t -= nt;
    }
    if (s >= p.n_seq) return;
    const u32 r0 = ((const u32*)p.seq_row0)[s] + t * tr, nr = min(tr, seq_n[s] - t * tr);
    const u32 h0 = blockIdx.y * hb, kvh = h0 / (p.n_head / p.n_head_kv);
    const u32* pos = (const u32*)p.pos;
    if (tid == 0) {
        u32 last = 0;
        for (u32 i = 0; i < nr; ++i) last = max(last, pos[r0 + i]);
        sm_kend = last + 1;
    }
    // The causal limit of each of this thread's query vectors (-1: not a row of the tile).
    int lim[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 row = (ty * 4 + a) / hb;
        lim[a] = row < nr ? (int)pos[r0 + row] : -1;
    }
    __syncthreads();
    const u32 slot = ((const u32*)p.row_slot)[r0];
    const u32 k_lo = blockIdx.z * p.keys_per_split;
    u32 k_hi = min(sm_kend, k_lo + p.keys_per_split);
    bool bad = slot >= p.n_slots || (k_hi + KV_PAGE - 1) / KV_PAGE > p.stride;
    if (bad || k_hi < k_lo) k_hi = k_lo;
    const u32* tk = (const u32*)p.table + ((u64)(bad ? 0 : slot) * p.n_kv + p.layer) * 2 * p.stride;
    const u32* tv = tk + p.stride;
    const float* q = (const float*)p.q;
    float* qs = sm_qkv;
    float* ks = sm_qkv + AT_DC * AT_LD;
    float* vs = sm_qkv;

    float m[4], l[4], o[4][16];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = ATT_NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) o[a][j] = 0.0f;
    }

    for (u32 kb = k_lo; kb < k_hi; kb += AT_N) {
        const u32 nk = min((u32)AT_N, k_hi - kb);
        u32 pk = tk[kb / KV_PAGE], pv = tv[kb / KV_PAGE];
        if (pk >= p.n_pages || pv >= p.n_pages) {
            bad = true;
            pk = pv = 0;
        }
        const u8* kpage = (const u8*)p.pool + (u64)pk * KV_PAGE * p.row_bytes;
        const u8* vpage = (const u8*)p.pool + (u64)pv * KV_PAGE * p.row_bytes;

        // S = scale · Q·Kᵀ.
        float sc[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) sc[a][b] = 0.0f;
        for (u32 c0 = 0; c0 < hd; c0 += AT_DC) {
            __syncthreads();  // the previous chunk (or the previous page's V) is consumed
            const u32 d = tid % 32;
#pragma unroll
            for (int j = 0; j < AT_M / 8; ++j) {
                const u32 i = tid / 32 + 8 * j, row = i / hb;
                qs[d * AT_LD + i] =
                    row < nr ? q[(u64)(r0 + row) * p.n_head * hd + (u64)(h0 + i % hb) * hd + c0 + d] * p.scale : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < AT_N / 8; ++j) {
                const u32 key = tid / 32 + 8 * j;
                ks[d * AT_LD + key] = key < nk ? kv_at(kpage + (u64)key * p.row_bytes, p.ty, kvh * hd + c0 + d) : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int c = 0; c < AT_DC; ++c) {
                const float4 qa = ld4(qs + c * AT_LD + ty * 4), kk = ld4(ks + c * AT_LD + tx * 4);
                const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) sc[a][b] = fmaf(qv[a], kv[b], sc[a][b]);
            }
        }

        // Online softmax of the 4 query vectors over this page's keys; P to shared memory.
        // (sc becomes P in place.)
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            float mt = ATT_NEG_INF;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 key = kb + tx * 4 + b;
                if (key >= k_hi || (int)key > lim[a]) sc[a][b] = ATT_NEG_INF;
                mt = fmaxf(mt, sc[a][b]);
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
            const float m_new = fmaxf(m[a], mt);
            // No key seen yet (m_new = -inf): nothing to rescale, every p is 0.
            const bool none = m_new == ATT_NEG_INF;
            const float corr = none ? 1.0f : expf(m[a] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                sc[a][b] = none ? 0.0f : expf(sc[a][b] - m_new);
                sum += sc[a][b];
            }
#pragma unroll
            for (int off = 1; off < 16; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            l[a] = l[a] * corr + sum;
            m[a] = m_new;
#pragma unroll
            for (int j = 0; j < 16; ++j) o[a][j] *= corr;
        }
#pragma unroll
        for (int b = 0; b < 4; ++b)
            *(float4*)(sm_p + (tx * 4 + b) * AT_LD + ty * 4) = f4(sc[0][b], sc[1][b], sc[2][b], sc[3][b]);

        // O += P·V, AT_VK keys at a time.
        for (u32 v0 = 0; v0 < nk; v0 += AT_VK) {
            __syncthreads();  // P is written; the K chunk (or the previous V chunk) is consumed
            for (u32 e = tid; e < AT_VK * hd; e += AT_THREADS) {
                const u32 key = e / hd, d = e % hd;
                vs[key * 256 + d] = v0 + key < nk ? kv_at(vpage + (u64)(v0 + key) * p.row_bytes, p.ty, kvh * hd + d) : 0.0f;
            }
            __syncthreads();
#pragma unroll 4
            for (int k = 0; k < AT_VK; ++k) {
                const float4 pa = ld4(sm_p + (v0 + k) * AT_LD + ty * 4);
                const float pv4[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (c * 64 >= hd) break;
                    const float4 vv = ld4(vs + k * 256 + c * 64 + tx * 4);
#pragma unroll
                    for (int a = 0; a < 4; ++a) {
                        o[a][c * 4 + 0] = fmaf(pv4[a], vv.x, o[a][c * 4 + 0]);
                        o[a][c * 4 + 1] = fmaf(pv4[a], vv.y, o[a][c * 4 + 1]);
                        o[a][c * 4 + 2] = fmaf(pv4[a], vv.z, o[a][c * 4 + 2]);
                        o[a][c * 4 + 3] = fmaf(pv4[a], vv.w, o[a][c * 4 + 3]);
                    }
                }
            }
        }
    }

    // The output (n_split = 1) or this range's partial result.
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 i = ty * 4 + a, row = i / hb;
        if (row >= nr) continue;
        const u32 r = r0 + row, n = h0 + i % hb;
        const u64 at = ((u64)r * p.n_head + n) * p.n_split + blockIdx.z;
        float* dst = p.n_split == 1 ? (float*)p.out + (u64)r * p.n_head * hd + (u64)n * hd : (float*)p.part_acc + at * hd;
        const float f = p.n_split == 1 ? 1.0f / l[a] : 1.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (c * 64 >= hd) break;
            const float4 v = bad ? f4(ATT_NAN, ATT_NAN, ATT_NAN, ATT_NAN)
                                 : f4(o[a][c * 4] * f, o[a][c * 4 + 1] * f, o[a][c * 4 + 2] * f, o[a][c * 4 + 3] * f);
            *(float4*)(dst + c * 64 + tx * 4) = v;
        }
        if (p.n_split > 1 && tx == 0) {
            float* ml = (float*)p.part_ml + at * 2;
            ml[0] = bad ? ATT_NAN : m[a];
            ml[1] = l[a];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attention_mma: attention_tiles on tensor cores (Precision::Fast, sm_80+): the same tiles,
// grid, key ranges and partial results, with S = Q·Kᵀ and O += P·V as mma.m16n8k16 over f16
// operands (Q scaled then rounded to f16, K and V rounded to f16 when staged, P rounded to f16)
// and f32 sums and softmax. 4 warps; warp w owns query vectors 16w .. 16w + 16 of the tile
// and every head dim of O (head_dim / 8 accumulator tiles of 16 x 8 in registers). Shared
// memory (dynamic, ATM_SMEM bytes = 99 KiB, what sm_86 allows a block): Q, the page's K and
// its V, each [64][ATM_LD] f16 (row stride 132 words: ldmatrix's 8 rows of 16 bytes hit
// distinct bank groups). An F16 cache is copied to shared memory as it is, by cp.async, one
// page ahead: the next page's K loads while this page's softmax and P·V run, its V while the
// next S runs; other cache types are converted by the threads. Every fragment comes by
// ldmatrix.x4: Q's A and K's B (two 8-key tiles a load) for S, V's B by ldmatrix.trans for
// P·V; the S loop is unrolled by two 16-dim steps and P·V takes a pair of 8-dim tiles over the
// page's 4 key steps at a time, so loads go out ahead of the mmas that use them (H100,
// bench_attention_mma at depth 32768: 2.121 -> 1.668 ms, 131 -> 166 TFLOP/s; docs/perf.md
// g23). head_dim a multiple of 16, at most 256; the thread with lane l holds rows
// g = l / 4 and g + 8 of its warp's tile and keys / dims 2t, 2t + 1 (t = l % 4) of each
// 8-wide tile: the accumulator layout of the mma, which is also the A layout of P for P·V
// (PTX ISA, "Matrix Fragments for mma.m16n8k16").

#define ATM_LD 264  // 256 + 8 halves
#define ATM_THREADS 128
#define ATM_SMEM (3 * 64 * ATM_LD * 2)

#if __CUDA_ARCH__ >= 800
// One K or V page (keys [0, nk) of it; zeros past them) into buf [64][ATM_LD] as f16.
template <int TY>
__device__ __forceinline__ void stage_one(u16* buf, const u8* page, u32 row_bytes, u32 e0, u32 nk, u32 key, u32 d8) {
    const u8* src = page + (u64)(key < nk ? key : 0) * row_bytes;
    if (TY == KV_F16) {
        cp_async16(buf + key * ATM_LD + d8, src + 2 * (u64)(e0 + d8), key < nk ? 16 : 0);
    } else {
        Row8<TY> raw;
        raw.load(src, e0 + d8, key < nk);
        float x[8];
        raw.get(x);
        *(uint4*)(buf + key * ATM_LD + d8) = pack8(x);
    }
}

// N copies of 16 bytes of F16 rows for keys key0 + i·step (head_dim 256: 16, 128: 8), page
// whole (nk = AT_N) or not.
template <int N>
__device__ __forceinline__ void stage_f16(u16* buf, const u8* page, u32 row_bytes, u32 e0, u32 nk, u32 step, u32 key0, u32 d8) {
    const u8* src0 = page + 2 * (u64)(e0 + d8);
    const u8* src = src0 + (u64)key0 * row_bytes;
    const u64 src_step = (u64)step * row_bytes;
    const u32 dst = smem_addr(buf + key0 * ATM_LD + d8), dst_step = step * ATM_LD * 2;
    if (nk == AT_N) {
#pragma unroll
        for (int i = 0; i < N; ++i, src += src_step) cp_async16_at(dst + i * dst_step, src, 16);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i, src += src_step) {
            const bool in = key0 + i * step < nk;
            cp_async16_at(dst + i * dst_step, in ? src : src0, in ? 16 : 0);
        }
    }
}

template <int TY, int THREADS>
__device__ __forceinline__ void stage_page(u16* buf, const u8* page, u32 row_bytes, u32 e0, u32 nk, u32 d8s) {
    // d8s a power of two (head_dim 16, 32, 64, 128, 256): each thread keeps its 8 dims and steps
    // keys by THREADS / d8s, with no division by d8s (~40 instructions a copy otherwise).
    if ((d8s & (d8s - 1)) == 0) {
        const u32 sh = __ffs(d8s) - 1, d8 = (threadIdx.x & (d8s - 1)) * 8;
        // F16 rows: the thread's N = AT_N / step copies at constant strides from its first key,
        // unrolled whole, not each address computed again (stage_one: ~19 SASS instructions a
        // 16-byte copy, 32 copies a thread a page at head_dim 256); a whole page needs no bound
        // test. Keys past nk copy nothing from key 0's row (zeros), as stage_one.
        if (TY == KV_F16 && (sh == 5 || sh == 4)) {
            if (sh == 5) {
                stage_f16<AT_N / (THREADS >> 5)>(buf, page, row_bytes, e0, nk, THREADS >> 5, threadIdx.x >> 5, d8);
            } else {
                stage_f16<AT_N / (THREADS >> 4)>(buf, page, row_bytes, e0, nk, THREADS >> 4, threadIdx.x >> 4, d8);
            }
            cp_async_commit();
            return;
        }
#pragma unroll 4
        for (u32 key = threadIdx.x >> sh; key < AT_N; key += THREADS >> sh) stage_one<TY>(buf, page, row_bytes, e0, nk, key, d8);
        cp_async_commit();
        return;
    }
    for (u32 u = threadIdx.x; u < AT_N * d8s; u += THREADS) stage_one<TY>(buf, page, row_bytes, e0, nk, u / d8s, u % d8s * 8);
    cp_async_commit();  // a group even when empty, so the waits below count pages
}
#endif

#if defined(EMBER_WGMMA) && defined(EMBER_ATTN_WGMMA)
// (EMBER_KERNEL_DEFINES=EMBER_ATTN_WGMMA, for measuring; docs/attention-wgmma.md step 1: S = Q·Kᵀ
// by wgmma, Q and K in 128-byte-swizzled tiles, P·V as before.)
#define ATM_WG 1
#ifdef EMBER_ATTN_WGMMA_PV
// (With EMBER_ATTN_WGMMA_PV too, step 2: O += P·V by register-A wgmmas, V swizzled as K is and
// read through the transposed-B descriptor; head_dim 256 only.)
#define ATM_WG_PV 1
#endif
// stage_page into a swizzled tile (kernels/wgmma.cuh) of 64 keys: the same copies, each to its
// swizzled address; head_dim a multiple of 64 (the caller's test).
template <int TY, int THREADS>
__device__ __forceinline__ void stage_page_sw(u8* buf, const u8* page, u32 row_bytes, u32 e0, u32 nk, u32 d8s) {
    const u32 base = smem_addr(buf);
    for (u32 u = threadIdx.x; u < AT_N * d8s; u += THREADS) {
        const u32 key = u / d8s, d8 = u % d8s * 8;
        const u8* src = page + (u64)(key < nk ? key : 0) * row_bytes;
        if (TY == KV_F16) {
            cp_async16_at(base + sw128_offset(AT_N, key, d8), src + 2 * (u64)(e0 + d8), key < nk ? 16 : 0);
        } else {
            Row8<TY> raw;
            raw.load(src, e0 + d8, key < nk);
            float x[8];
            raw.get(x);
            *(uint4*)(buf + sw128_offset(AT_N, key, d8)) = pack8(x);
        }
    }
    cp_async_commit();
}
#endif

// W warps: a tile of M = 16·W query vectors (attention_mma: 4, attention_mma_w8: 8).
template <int TY, int W>
__device__ void attend_mma(const AttentionParams& p, u16* qs) {
#if __CUDA_ARCH__ >= 800
    constexpr int M = 16 * W, THREADS = 32 * W;
    u16 *ks = qs + M * ATM_LD, *vs = ks + 64 * ATM_LD;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane >> 2, t = lane & 3;
    const u32 hd = p.head_dim, d8s = hd / 8;
#ifdef ATM_WG
    // Q [M][256] and K [64][256] swizzled from a 1,024-aligned start (the launch's shared memory
    // has the slack), V after them in the padded layout; head_dim a multiple of 64, else as before.
    const bool wg = hd % 64 == 0;
#ifdef ATM_WG_PV
    const bool wgv = wg && hd == 256;
#endif
    if (wg) {
        const u32 pad = (1024 - (smem_addr(qs) & 1023)) & 1023;
        qs = (u16*)((u8*)qs + pad);
        ks = qs + M * 256;
        vs = ks + 64 * 256;
    }
#endif
    MmaTile tl;  // attention_tile.cuh
    if (!mma_tile<M>(p, warp, g, tl)) return;
    const u32 k_lo = tl.k_lo, k_hi = tl.k_hi, e0 = tl.kvh * hd;
    const int lim_lo = tl.lim_lo;
    const int(&lim)[2] = tl.lim;
    const u32 *tk = tl.tk, *tv = tl.tv;
    auto page = [&](const u32* tab, u32 kb) { return mma_tile_page(p, tl, tab, kb); };
    if (k_lo < k_hi) {
#ifdef ATM_WG
        if (wg) {
            stage_page_sw<TY, THREADS>((u8*)ks, page(tk, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
        } else
#endif
            stage_page<TY, THREADS>(ks, page(tk, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
#ifdef ATM_WG_PV
        if (wgv) {
            stage_page_sw<TY, THREADS>((u8*)vs, page(tv, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
        } else
#endif
            stage_page<TY, THREADS>(vs, page(tv, k_lo), p.row_bytes, e0, min((u32)AT_N, k_hi - k_lo), d8s);
    }
    // Q: vector i = (row i / hb, head h0 + i % hb), scaled, as f16; zeros past the tile's rows.
    for (u32 u = tid; u < M * d8s; u += THREADS) {
        const u32 i = u / d8s, d8 = u % d8s * 8;
#ifdef ATM_WG
        if (wg) {
            *(uint4*)((u8*)qs + sw128_offset(M, i, d8)) = mma_tile_q8(p, tl, i, d8);
            continue;
        }
#endif
        *(uint4*)(qs + i * ATM_LD + d8) = mma_tile_q8(p, tl, i, d8);
    }

    float o[32][4], m[2], l[2];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    m[0] = m[1] = ATT_NEG_INF;
    l[0] = l[1] = 0.0f;
    // ldmatrix rows of this lane for P·V: matrix q = lane / 8 is keys 8(q & 1) .. + 8 of a
    // 16-key step at dims 8(q >> 1) .. + 8 of a pair of 8-dim tiles.
    const u16* vl = vs + ((lane >> 3 & 1) * 8 + (lane & 7)) * ATM_LD + (lane >> 4) * 8;
    // ldmatrix rows of this lane for Q·Kᵀ. Q (A, 16 x 16 at k0): matrix q is rows 8(q & 1) .. + 8
    // of the warp's tile at dims k0 + 8(q >> 1): a[0..3] in the fragment's order. K (B of two
    // 8-key tiles j, j + 1): matrix q is keys 8j + 8(q >> 1) .. + 8 at dims k0 + 8(q & 1): b[0..1]
    // of tile j, then b[0..1] of tile j + 1.
    const u16* ql = qs + (16 * warp + (lane >> 3 & 1) * 8 + (lane & 7)) * ATM_LD + (lane >> 4) * 8;
    const u16* kl = ks + ((lane >> 4) * 8 + (lane & 7)) * ATM_LD + (lane >> 3 & 1) * 8;

    for (u32 kb = k_lo; kb < k_hi; kb += AT_N) {
        const u32 next = kb + AT_N, nk_next = next < k_hi ? min((u32)AT_N, k_hi - next) : 0;
        cp_async_wait<1>();  // this page's K (its V may still be in flight)
#ifdef ATM_WG
        if (wg) fence_proxy_async();  // Q's and K's generic-proxy writes, for wgmma's reads
#endif
        __syncthreads();
        // S = Q·Kᵀ: 8 tiles of 8 keys.
        float sc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#ifdef ATM_WG
        // By wgmma: warpgroup w/4's 64 rows against the page's 64 keys, 16 dims a step; its
        // accumulator layout is sc's (tile j's values of rows g, g + 8 at keys 8j + 2t, + 1).
        if (wg) {
            float(&d)[32] = *reinterpret_cast<float(*)[32]>(&sc[0][0]);
            const u32 qa = smem_addr(qs) + (warp / 4) * 64 * 128, ka = smem_addr(ks);
            wgmma_keep(d);
            wgmma_fence();
            for (u32 s16 = 0; s16 < hd / 16; ++s16) {
                const u32 c = s16 / 4 * 128, b = s16 % 4 * 32;
                wgmma_ss_64x64(d, wgmma_desc(qa + c * M + b, 16, 1024), wgmma_desc(ka + c * AT_N + b, 16, 1024), s16 > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_keep(d);
        } else
#endif
#pragma unroll 2  // the next 16 dims' loads issued before this step's mmas
        for (u32 k0 = 0; k0 < hd; k0 += 16) {
            u32 a[4];
            ldmatrix_x4(a, ql + k0);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                u32 b[4];
                ldmatrix_x4(b, kl + 8 * j * ATM_LD + k0);
                mma_16816(sc[j], a, b);
                mma_16816(sc[j + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with K: the next page's K loads meanwhile
        if (nk_next > 0) {
#ifdef ATM_WG
            if (wg) {
                stage_page_sw<TY, THREADS>((u8*)ks, page(tk, next), p.row_bytes, e0, nk_next, d8s);
            } else
#endif
                stage_page<TY, THREADS>(ks, page(tk, next), p.row_bytes, e0, nk_next, d8s);
        } else {
            cp_async_commit();
        }
        // Online softmax of rows g and g + 8 (a quad of lanes shares a row); sc becomes P.
        // A page every row of the warp sees whole needs no mask (warp-uniform).
        const bool whole = kb + AT_N <= k_hi && (int)(kb + AT_N - 1) <= lim_lo;
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            float mt = ATT_NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const u32 key = kb + 8 * j + 2 * t + c;
                    if (!whole && (key >= k_hi || (int)key > lim[a])) sc[j][2 * a + c] = ATT_NEG_INF;
                    mt = fmaxf(mt, sc[j][2 * a + c]);
                }
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            const float m_new = fmaxf(m[a], mt);
            const bool none = m_new == ATT_NEG_INF;
            // ex2.approx of x·log2(e) (P is rounded to f16 next: its error is far below that).
            const float corr = none ? 1.0f : exp_fast(m[a] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float e = none ? 0.0f : exp_fast(sc[j][2 * a + c] - m_new);
                    sc[j][2 * a + c] = e;
                    sum += e;
                }
            l[a] = l[a] * corr + sum;  // this thread's keys; the quad's are added at the end
            m[a] = m_new;
            if (__all_sync(0xffffffffu, corr == 1.0f)) continue;  // no row's max moved
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                o[n][2 * a] *= corr;
                o[n][2 * a + 1] *= corr;
            }
        }
        cp_async_wait<1>();  // this page's V (the next page's K may still be in flight)
#ifdef ATM_WG_PV
        if (wgv) fence_proxy_async();  // V's generic-proxy writes, for wgmma's reads
#endif
        __syncthreads();
        // O += P·V: 4 steps of 16 keys, head_dim / 16 pairs of 8-dim tiles.
        // Pairs of tiles outside, the 4 key steps inside: one head_dim test a pair instead of
        // one a step and pair, and a pair's 4 ldmatrix issued together ahead of its 8 mmas. Each
        // o[n] still adds the steps 0..3 in order (the same bits).
        u32 pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            pa[kk][0] = pack_f16x2(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = pack_f16x2(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = pack_f16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = pack_f16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
#ifdef ATM_WG_PV
        // By wgmma: warpgroup w/4's 64 rows, 4 steps of 16 keys against all 256 dims (o's layout
        // is the m64n256 accumulator's: tile n's values at d[4n + c]); o was just rescaled by
        // ordinary instructions, hence the fence first.
        if (wgv) {
            float(&d)[128] = *reinterpret_cast<float(*)[128]>(&o[0][0]);
            const u32 va = smem_addr(vs);
            wgmma_keep(d);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_keep(pa[kk]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_rs_64x256(d, pa[kk], wgmma_desc(va + kk * 2048, WG_V_LBO, WG_V_SBO), 1);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_keep(d);
        } else
#endif
#pragma unroll
        for (int n = 0; n < 32; n += 2) {
            if (8 * n >= (int)hd) break;
            u32 b[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) ldmatrix_x4_trans(b[kk], vl + 16 * kk * ATM_LD + 8 * n);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                mma_16816(o[n], pa[kk], b[kk]);
                mma_16816(o[n + 1], pa[kk], b[kk] + 2);
            }
        }
        __syncthreads();  // every warp is done with V: the next page's V loads meanwhile
        if (nk_next > 0) {
#ifdef ATM_WG_PV
            if (wgv) {
                stage_page_sw<TY, THREADS>((u8*)vs, page(tv, next), p.row_bytes, e0, nk_next, d8s);
            } else
#endif
                stage_page<TY, THREADS>(vs, page(tv, next), p.row_bytes, e0, nk_next, d8s);
        } else {
            cp_async_commit();
        }
    }
    cp_async_wait<0>();
    mma_tile_store(p, tl, &o[0][0], m, l, warp, g, t);
#endif
}

// attend_mma for the call's cache type (after the wait for the kernel ahead).
template <int W>
__device__ __forceinline__ void attend_mma_entry(const AttentionParams& p) {
    pdl_enter();
    extern __shared__ __align__(16) u16 atm_sm[];
    switch (p.ty) {
        case KV_F32: attend_mma<KV_F32, W>(p, atm_sm); break;
        case KV_F16: attend_mma<KV_F16, W>(p, atm_sm); break;
        default: attend_mma<KV_Q8_0, W>(p, atm_sm); break;
    }
}

// grid and parameters as attention_tiles; dynamic shared memory ATM_SMEM bytes.
extern "C" __global__ void __launch_bounds__(ATM_THREADS, 2) attention_mma(const AttentionParams p) { attend_mma_entry<4>(p); }

// attention_mma on tiles of 128 query vectors, 8 warps (EMBER_ATTN_MMA_WIDE=1, measuring): each
// K/V page staged in shared memory serves twice the query vectors, so a chunk's tiles stream
// the cache half as often. One block an SM: ATM_SMEM_W8 bytes (Q 128 rows, K and V 64 each:
// 132 KiB, sm_80 and sm_90 allow it); grid (tiles of 128 / heads_per_block rows, ...).
#define ATM_SMEM_W8 ((128 + 2 * 64) * ATM_LD * 2)
extern "C" __global__ void __launch_bounds__(2 * ATM_THREADS, 1) attention_mma_w8(const AttentionParams p) { attend_mma_entry<8>(p); }
