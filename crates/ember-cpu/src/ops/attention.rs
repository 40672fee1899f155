//! Prompt attention in tiles (flash attention, arXiv:2205.14135 §3.1; reference
//! `ember_ops::reference::attention_head`): the query vectors of a tile (several tokens × the
//! query heads of one KV head) go through the cached keys and values block by block, each block
//! read once for all of them, with a running maximum and sum per query vector (online softmax).
//!
//! The decision a reader may question: each KV head's cache is converted to f32 once per call
//! (keys transposed, a block of [`BLK`] positions at a time) before any tile runs. The products
//! are then plain f32 matrix products in registers ([`Kernels::gemm_f32`]), every tile reads
//! the converted blocks, and the conversion (one pass over the cache) is shared by all the
//! tiles: at 512 prompt tokens × 8 query heads it is ~1/4096 of the multiply-adds.
//!
//! With a q8_0 cache (and an instruction set with [`Panel`] kernels) Q·Kᵀ is summed in
//! integers instead: the keys are unpacked into panels of 16 keys (the layout the Q8_0 weight
//! matmuls use, `crate::panel`) and the scaled query vectors are quantised once per KV head
//! to 8 bits in blocks of 32 with an f32 scale each ([`ActRow`], as the matmuls' activations),
//! so a score is `Σ_blocks d_q·d_k·Σ q_q·q_k` by `vpdpbusd` (`Kernels::panel_dot`). The
//! quantised query costs accuracy (measured in tests/conformance.rs); P·V stays in floats on
//! the converted values (probabilities are not 8-bit material).
//!
//! Where the CPU has AVX-512 BF16 ([`Kernels::has_bf16`]), P·V takes the values and each
//! block's probabilities rounded to bf16 and sums pairs of products in f32 (`vdpbf16ps`: twice
//! the multiply-adds of an f32 FMA per instruction). Both roundings are relative errors of at
//! most 2⁻⁹ per term, averaged over the block's positions; llama.cpp's CPU attention over an
//! f16 cache sums V in f16. The error is measured in the tests below and tests/conformance.rs.

use ember_gguf::GgmlType;
use ember_ops::{AttnShape, KvRows, KvType, Mat};

use super::CpuOps;
use crate::kernels::ActRow;
use crate::panel::{self, Panel};
use crate::pool::{MAX_PARTS, even_bounds, parts_for};
use crate::simd::{Gemm, GemmBf16, Kernels};

/// Key positions per block: one product of a tile's queries with the block's keys, then one
/// with its values.
const BLK: usize = 64;

/// Query vectors per tile (tokens × query heads of the KV head): the tile's queries, scores
/// and outputs (~64 + 16 + 64 KiB at head size 256) stay in L2 with a block of K and V.
const TILE_VECS: usize = 64;

/// Floats after each query row of a tile: rows 1 KiB apart (head size 256) would fall into a
/// quarter of L1's sets.
const QPAD: usize = 16;

/// Rows of a tile are padded to a multiple of this (the register tiles of `gemm_f32`).
const ROW_PAD: usize = 8;

/// Fewest positions per key range when a call's tiles are split over ranges.
const SPLIT_MIN: usize = 4 * BLK;

/// Fewest prompt tokens for which the tiled kernel runs (fewer go the per-token way, as decode).
pub(super) const TILED_MIN_TOKENS: usize = 4;

impl CpuOps {
    /// Whether [`CpuOps::attention_tiled`] takes this shape: a prompt, with the head size a
    /// multiple of 16 (the column tiles of the products).
    pub(super) fn tiled_attention_fits(s: &AttnShape) -> bool {
        s.n_tok >= TILED_MIN_TOKENS && s.head_dim.is_multiple_of(16) && s.head_dim > 0 && s.n_head.is_multiple_of(s.n_head_kv)
    }

    /// Attention of a prompt batch in tiles (see the module docs). Work items are (query tile,
    /// range of key blocks) per KV head; with fewer tiles than workers each tile's blocks are
    /// cut into ranges that merge by their maxima and sums, as in the decode split.
    pub(super) fn attention_tiled<K: Kernels>(&self, kn: K, s: AttnShape, q: &Mat, kc: &KvRows, vc: &KvRows) -> Mat {
        let hd = s.head_dim;
        let g = s.n_head / s.n_head_kv;
        let gw = g * hd;
        let npos = s.pos0 + s.n_tok;
        let n_blk = npos.div_ceil(BLK);
        let tt = (TILE_VECS / g).max(1); // tokens per tile
        let n_tiles = s.n_tok.div_ceil(tt);
        let rows_max = (tt * g).next_multiple_of(ROW_PAD);
        let threads = self.n_threads();
        let n_split = if n_tiles < threads { threads.div_ceil(n_tiles).min(npos / SPLIT_MIN).max(1) } else { 1 };
        let n_items = n_tiles * n_split;
        // Blocks of item i: range c of the blocks its tile sees (whole blocks from 0).
        let blocks = |i: usize| {
            let (tile, c) = (i / n_split, i % n_split);
            let t1 = ((tile + 1) * tt).min(s.n_tok);
            let nb = (s.pos0 + t1).div_ceil(BLK);
            let len = nb.div_ceil(n_split);
            ((c * len).min(nb), ((c + 1) * len).min(nb))
        };
        // Per item: its tt·g outputs, then (largest score, Σ exp(score − largest)) per vector.
        let slot = tt * gw + 2 * tt * g;
        let mut ob = vec![0f32; n_items * slot];
        // Items split by cost (blocks + a constant), on item boundaries.
        let cost = |i: usize| {
            let (b0, b1) = blocks(i);
            b1 - b0 + 1
        };
        let total: usize = (0..n_items).map(cost).sum();
        let parts = parts_for(threads).min(n_items);
        let mut ib = [0usize; MAX_PARTS + 1];
        let (mut acc, mut p) = (0usize, 1usize);
        for i in 0..n_items {
            if p < parts && acc >= total * p / parts {
                ib[p] = i;
                p += 1;
            }
            acc += cost(i);
        }
        for e in ib.iter_mut().take(parts + 1).skip(p) {
            *e = n_items;
        }
        let mut ob_b = ib;
        ob_b.iter_mut().for_each(|e| *e *= slot);
        // The converted cache of one KV head: keys [block][d][j], values [block][strip][j][c]
        // in strips of `sw` columns (a strip's rows adjacent: rows 1 KiB apart would share a few
        // L1 sets); the positions past npos stay zero (never written). With integer scores the
        // keys are panels instead ([`PANELS`] a block) and the queries [`ActRow`]s.
        let int_k = int_scores(kn, kc, hd);
        let mut kt = if int_k { Vec::new() } else { vec![0f32; n_blk * BLK * hd] };
        let mut kp = if int_k { vec![Panel::default(); n_blk * PANELS] } else { Vec::new() };
        let mut qa = if int_k { vec![ActRow::default(); s.n_tok * g] } else { Vec::new() };
        // An f32 cache asks for f32 precision: its P·V stays in f32.
        let bf = kn.has_bf16() && vc.ty != KvType::F32;
        let mut vf = if bf { Vec::new() } else { vec![0f32; n_blk * BLK * hd] };
        let mut vh = if bf { vec![0u16; n_blk * BLK * hd] } else { Vec::new() };
        let mut out = self.zeros(s.n_tok, s.n_head * hd);
        let mut bb = [0usize; MAX_PARTS + 1];
        let cparts = even_bounds(n_blk, parts_for(threads), 1, &mut bb);
        let vb = bb.map(|e| e * BLK * hd);
        let mut qb = [0usize; MAX_PARTS + 1];
        let qparts = even_bounds(qa.len(), parts_for(threads), 1, &mut qb);
        for m in 0..s.n_head_kv {
            if int_k {
                let pb = bb.map(|e| e * PANELS);
                self.pool.split_mut(&mut kp, &pb[..=cparts], |pi, kp| key_panels(kn, kc, m, hd, npos, bb[pi], kp));
                // Row r of the tiles' order: token r / g, query head m·g + r % g.
                self.pool.split_mut(&mut qa, &qb[..=qparts], |pi, qa| {
                    let mut x = vec![0f32; hd];
                    for (i, a) in qa.iter_mut().enumerate() {
                        let r = qb[pi] + i;
                        let src = &q.row(r / g)[m * gw + (r % g) * hd..][..hd];
                        x.iter_mut().zip(src).for_each(|(d, v)| *d = v * s.scale);
                        kn.quantize(&x, a);
                        a.fill_unsigned();
                    }
                });
            } else {
                self.pool.split_mut(&mut kt, &vb[..=cparts], |pi, kp| {
                    let mut row = vec![0f32; hd];
                    for (bi, kb) in kp.chunks_exact_mut(BLK * hd).enumerate() {
                        let p0 = (bb[pi] + bi) * BLK;
                        for j in 0..BLK.min(npos - p0) {
                            kv_row(kn, kc, p0 + j, m * hd, &mut row);
                            for (d, x) in row.iter().enumerate() {
                                kb[d * BLK + j] = *x;
                            }
                        }
                    }
                });
            }
            if bf {
                self.pool.split_mut(&mut vh, &vb[..=cparts], |pi, vp| values_bf16(kn, vc, m, hd, npos, bb[pi], vp));
            } else {
                self.pool.split_mut(&mut vf, &vb[..=cparts], |pi, vp| values_f32(kn, vc, m, hd, npos, bb[pi], vp));
            }
            let keys = if int_k { Keys::Int { panels: &kp, qa: &qa } } else { Keys::F32(&kt) };
            let vals = if bf { Vals::Bf16(&vh) } else { Vals::F32(&vf) };
            self.pool.split_mut(&mut ob, &ob_b[..=parts], |pi, items| {
                let mut w = Work::new(rows_max, hd);
                for (j, o) in items.chunks_exact_mut(slot).enumerate() {
                    let item = ib[pi] + j;
                    let t0 = item / n_split * tt;
                    let nt = tt.min(s.n_tok - t0);
                    let (b0, b1) = blocks(item);
                    let tile = Tile { kn, s, q, m, t0, nt, g, keys, vals };
                    tile.run(&mut w, b0, b1, o);
                }
            });
            // Scatter (and merge the ranges of) each tile into the output rows.
            for tile in 0..n_tiles {
                let t0 = tile * tt;
                let nt = tt.min(s.n_tok - t0);
                let items = &ob[tile * n_split * slot..(tile + 1) * n_split * slot];
                for r in 0..nt * g {
                    let (t, h) = (t0 + r / g, r % g);
                    let dst = &mut out.row_mut(t)[m * gw + h * hd..m * gw + (h + 1) * hd];
                    if n_split == 1 {
                        dst.copy_from_slice(&items[r * hd..(r + 1) * hd]);
                        continue;
                    }
                    // Each range's normalised output weighted by its share of the softmax mass.
                    let ml = |c: usize| (items[c * slot + tt * gw + 2 * r], items[c * slot + tt * gw + 2 * r + 1]);
                    let mx = (0..n_split).map(|c| ml(c).0).fold(f32::NEG_INFINITY, f32::max);
                    let mut mass = 0f32;
                    for c in 0..n_split {
                        let (mc, lc) = ml(c);
                        if lc == 0.0 {
                            continue;
                        }
                        let wc = lc * (mc - mx).exp();
                        mass += wc;
                        dst.iter_mut().zip(&items[c * slot + r * hd..c * slot + (r + 1) * hd]).for_each(|(x, y)| *x += wc * y);
                    }
                    dst.iter_mut().for_each(|x| *x /= mass);
                }
            }
        }
        out
    }
}

/// One worker's scratch for [`Tile::run`].
struct Work {
    q: Vec<f32>,  // [row][hd + QPAD], scaled
    sc: Vec<f32>, // [row][BLK]: scores, then probabilities
    /// [row][BLK]: the probabilities in bf16 (P·V in bf16).
    pb: Vec<u16>,
    o: Vec<f32>, // [row][hd], unnormalised
    mx: Vec<f32>,
    l: Vec<f32>,
    /// One panel's 16 scores per row (integer scores).
    ps: Vec<[f32; panel::ROWS]>,
}

impl Work {
    fn new(rows: usize, hd: usize) -> Self {
        Work {
            q: vec![0.0; rows * (hd + QPAD)],
            sc: vec![0.0; rows * BLK],
            pb: vec![0; rows * BLK],
            o: vec![0.0; rows * hd],
            mx: vec![0.0; rows],
            l: vec![0.0; rows],
            ps: vec![[0.0; panel::ROWS]; rows],
        }
    }
}

/// Tokens t0..t0 + nt against KV head m: row r of the tile is token t0 + r / g, query head
/// m·g + r % g.
struct Tile<'a, K> {
    kn: K,
    s: AttnShape,
    q: &'a Mat,
    m: usize,
    t0: usize,
    nt: usize,
    g: usize,
    keys: Keys<'a>,
    vals: Vals<'a>,
}

/// The values of one KV head as the tiles read them: per block, strips of [`vstrip`] columns.
#[derive(Clone, Copy)]
enum Vals<'a> {
    /// f32, [block][strip][j][c].
    F32(&'a [f32]),
    /// bf16 in pairs of positions, [block][strip][j / 2][c][j % 2] (the B of [`GemmBf16`]).
    Bf16(&'a [u16]),
}

/// The keys of one KV head as the tiles read them.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// Converted to f32, transposed: [block][d][j].
    F32(&'a [f32]),
    /// [`PANELS`] panels per block, and every query vector of the call quantised (scaled),
    /// in the tiles' row order.
    Int { panels: &'a [Panel], qa: &'a [ActRow] },
}

impl<K: Kernels> Tile<'_, K> {
    /// Key blocks b0..b1 into `o`: the tile's nt·g output rows, normalised by their own sums,
    /// then (largest score, sum) per row; rows that see no key of the range get zeros and
    /// (−∞, 0), weight zero in the merge.
    fn run(&self, w: &mut Work, b0: usize, b1: usize, o: &mut [f32]) {
        let Tile { kn, s, q, m, t0, nt, g, keys, vals } = *self;
        let hd = s.head_dim;
        let gw = g * hd;
        let rows = nt * g;
        let rp = rows.next_multiple_of(ROW_PAD);
        let npos = s.pos0 + s.n_tok;
        // The queries, scaled (the scale folded in once per tile); padding rows zero.
        let ldq = hd + QPAD;
        let qi: Vec<&ActRow> = match keys {
            Keys::Int { qa, .. } => qa[t0 * g..t0 * g + rows].iter().collect(),
            Keys::F32(_) => Vec::new(),
        };
        // Padding rows' probabilities stay zero (P·V runs over all rp rows).
        w.sc[rows * BLK..rp * BLK].fill(0.0);
        for (r, qr) in w.q.chunks_exact_mut(ldq).take(if qi.is_empty() { rp } else { 0 }).enumerate() {
            if r < rows {
                let src = &q.row(t0 + r / g)[m * gw + (r % g) * hd..][..hd];
                qr[..hd].iter_mut().zip(src).for_each(|(d, x)| *d = x * s.scale);
            } else {
                qr.fill(0.0);
            }
        }
        w.o[..rp * hd].fill(0.0);
        w.mx[..rows].fill(f32::NEG_INFINITY);
        w.l[..rows].fill(0.0);
        let sw = vstrip(hd);
        for b in b0..b1 {
            match keys {
                Keys::F32(kt) => {
                    let kb = &kt[b * BLK * hd..(b + 1) * BLK * hd];
                    kn.gemm_f32(&Gemm { a: &w.q, lda: ldq, b: kb, ldb: BLK, ldc: BLK, m: rp, n: BLK, kd: hd, acc: false }, &mut w.sc);
                }
                Keys::Int { panels, .. } => {
                    // Panels wholly past npos hold nothing: their columns lie past every
                    // row's visible prefix and are never read.
                    for c in 0..PANELS.min((npos - b * BLK).div_ceil(panel::ROWS)) {
                        kn.panel_dot(&panels[b * PANELS + c], &qi, &mut w.ps[..rows]);
                        for (r, ps) in w.ps[..rows].iter().enumerate() {
                            w.sc[r * BLK + c * panel::ROWS..][..panel::ROWS].copy_from_slice(ps);
                        }
                    }
                }
            }
            for r in 0..rows {
                // Token t sees positions 0..=pos0 + t: a prefix of the block.
                let vis = (s.pos0 + t0 + r / g + 1).saturating_sub(b * BLK).min(BLK);
                let sr = &mut w.sc[r * BLK..(r + 1) * BLK];
                if vis == 0 {
                    sr.fill(0.0);
                    continue;
                }
                let bm = sr[..vis].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mn = w.mx[r].max(bm);
                let sum = kn.exp_sum(&mut sr[..vis], mn);
                sr[vis..].fill(0.0);
                if mn > w.mx[r] {
                    // exp(−∞) = 0 for a row's first visible block (its o and l are zero).
                    let corr = (w.mx[r] - mn).exp();
                    w.l[r] *= corr;
                    w.o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= corr);
                    w.mx[r] = mn;
                }
                w.l[r] += sum;
            }
            match vals {
                Vals::F32(vf) => {
                    for (st, vs) in vf[b * BLK * hd..(b + 1) * BLK * hd].chunks_exact(BLK * sw).enumerate() {
                        let g = Gemm { a: &w.sc, lda: BLK, b: vs, ldb: sw, ldc: hd, m: rp, n: sw, kd: BLK, acc: true };
                        kn.gemm_f32(&g, &mut w.o[st * sw..]);
                    }
                }
                Vals::Bf16(vh) => {
                    kn.f32_to_bf16(&w.sc[..rp * BLK], &mut w.pb[..rp * BLK]);
                    for (st, vs) in vh[b * BLK * hd..(b + 1) * BLK * hd].chunks_exact(BLK * sw).enumerate() {
                        let g = GemmBf16 { a: &w.pb, lda: BLK, b: vs, ldb: 2 * sw, ldc: hd, m: rp, n: sw, kp: BLK / 2 };
                        kn.gemm_bf16(&g, &mut w.o[st * sw..]);
                    }
                }
            }
        }
        let n_vec = o.len() / (hd + 2); // the slot's tt·g vectors
        let (out, ml) = o.split_at_mut(n_vec * hd);
        for r in 0..rows {
            let dst = &mut out[r * hd..(r + 1) * hd];
            let l = w.l[r];
            if l == 0.0 {
                dst.fill(0.0);
                (ml[2 * r], ml[2 * r + 1]) = (f32::NEG_INFINITY, 0.0);
                continue;
            }
            let inv = 1.0 / l;
            dst.iter_mut().zip(&w.o[r * hd..(r + 1) * hd]).for_each(|(d, x)| *d = x * inv);
            (ml[2 * r], ml[2 * r + 1]) = (w.mx[r], l);
        }
    }
}

/// Panels of [`panel::ROWS`] keys per block.
const PANELS: usize = BLK / panel::ROWS;

/// Whether Q·Kᵀ runs in integers: a q8_0 key cache, heads of whole q8_0 blocks, and panel
/// kernels on this instruction set (`Kernels::has_panels`; the scalar panel product is a
/// reference, not a kernel).
fn int_scores<K: Kernels>(kn: K, kc: &KvRows, hd: usize) -> bool {
    kc.ty == KvType::Q8_0 && hd.is_multiple_of(32) && kn.has_panels()
}

/// The keys of KV head `m` at the blocks from `b0` on into `kp` ([`PANELS`] panels a block;
/// panels wholly past `npos` are left as they were).
fn key_panels<K: Kernels>(kn: K, kc: &KvRows, m: usize, hd: usize, npos: usize, b0: usize, kp: &mut [Panel]) {
    let hb = hd / 32 * 34; // bytes of one head's keys in a row
    let mut rows = vec![0u8; panel::ROWS * hb];
    for (i, p) in kp.iter_mut().enumerate() {
        let p0 = (b0 * PANELS + i) * panel::ROWS;
        let n = panel::ROWS.min(npos.saturating_sub(p0));
        if n == 0 {
            break;
        }
        for (j, dst) in rows.chunks_exact_mut(hb).take(n).enumerate() {
            dst.copy_from_slice(&kc.row(p0 + j)[m * hb..(m + 1) * hb]);
        }
        kn.panel_unpack(GgmlType::Q8_0, hd, &rows, n, p);
    }
}

/// The values of KV head `m` at the blocks from `b0` on into `vp` (`[block][strip][j][c]`,
/// strips of [`vstrip`] columns); positions past `npos` are not written.
fn values_f32<K: Kernels>(kn: K, vc: &KvRows, m: usize, hd: usize, npos: usize, b0: usize, vp: &mut [f32]) {
    let sw = vstrip(hd);
    let mut row = vec![0f32; hd];
    for (bi, vb) in vp.chunks_exact_mut(BLK * hd).enumerate() {
        let p0 = (b0 + bi) * BLK;
        for j in 0..BLK.min(npos - p0) {
            kv_row(kn, vc, p0 + j, m * hd, &mut row);
            for (st, x) in row.chunks_exact(sw).enumerate() {
                vb[st * BLK * sw + j * sw..][..sw].copy_from_slice(x);
            }
        }
    }
}

/// The values of KV head `m` at the blocks from `b0` on into `vp` in bf16
/// (`[block][strip][j / 2][c][j % 2]`, strips of [`vstrip`] columns); positions past `npos`
/// are not written.
fn values_bf16<K: Kernels>(kn: K, vc: &KvRows, m: usize, hd: usize, npos: usize, b0: usize, vp: &mut [u16]) {
    let sw = vstrip(hd);
    let mut row = vec![0f32; hd];
    let mut h = vec![0u16; hd];
    for (bi, vb) in vp.chunks_exact_mut(BLK * hd).enumerate() {
        let p0 = (b0 + bi) * BLK;
        for j in 0..BLK.min(npos - p0) {
            kv_row(kn, vc, p0 + j, m * hd, &mut row);
            kn.f32_to_bf16(&row, &mut h);
            for (st, x) in h.chunks_exact(sw).enumerate() {
                let dst = &mut vb[st * BLK * sw + j / 2 * 2 * sw + j % 2..];
                x.iter().enumerate().for_each(|(c, v)| dst[2 * c] = *v);
            }
        }
    }
}

/// Columns per strip of the converted values.
fn vstrip(hd: usize) -> usize {
    if hd.is_multiple_of(64) { 64 } else { 16 }
}

/// The bytes of values `start..start + len` of cached row `p` for the f16 cache and the q8_0
/// one when `start` and `len` are whole blocks; None for the layouts read value by value.
#[inline]
pub(super) fn kv_bytes(c: &KvRows, p: usize, start: usize, len: usize) -> Option<&[u8]> {
    match c.ty {
        KvType::F16 => Some(&c.row(p)[2 * start..2 * (start + len)]),
        KvType::Q8_0 if start.is_multiple_of(32) && len.is_multiple_of(32) => Some(&c.row(p)[start / 32 * 34..(start + len) / 32 * 34]),
        _ => None,
    }
}

/// Values `start..start + out.len()` of cached row `p`, as f32 (for q8_0, `start` and the
/// length are whole blocks).
#[inline]
pub(super) fn kv_row<K: Kernels>(kn: K, c: &KvRows, p: usize, start: usize, out: &mut [f32]) {
    match (c.ty, kv_bytes(c, p, start, out.len())) {
        (KvType::F16, Some(b)) => kn.f16_to_f32(b, out),
        (KvType::Q8_0, Some(b)) => kn.q8_0_to_f32(b, out),
        _ => c.read(p, start, out),
    }
}
