//! Attention's three paths: the query tiles (`attention_tiles`, prompt chunks), the decode
//! kernel (`attention_decode` + `attention_merge`: the query heads of a KV head in one block)
//! and the rows (`attention`, `attention_split` + `attention_merge`: the first decode path).
//!
//! `tiles_match_the_reference`: `CudaOps` (Exact and Fast) against the reference backend (`HostOps`, i.e.
//! `ember_ops::reference::attention`) over random shapes through the public `Ops` API: head_dim
//! 64..256, GQA ratios 1, 2 and 8, every KV type, 1-3 sequences per step of 1..260 rows each
//! (decode rows beside prompt chunks), depths crossing page boundaries.
//! `decode_matches_the_reference`: decode rows (1-3 per sequence) deep into caches filled by
//! prompt chunks, every KV type, GQA ratios 1, 2, 3, 8, 16, head_dims 40..256, against the
//! reference. `decode_ranges_agree`: the decode kernel over 1..128 key ranges per row against
//! the rows path, a row's result bit for bit the same alone or beside other rows and on 1, 2,
//! 4 or 8 query heads a block.
//! `bench_attention_tiles` (`--ignored --nocapture bench`): the 35B model's shape (16 query
//! heads, 2 KV heads, head_dim 256, F16 cache) at depths up to 32768 on the three paths, their
//! agreement, and GPU times. `bench_attention_decode_heads`: the decode kernel at that shape on
//! 1, 2, 4 and 8 query heads a block and the launcher's choice, depths 16..32768.
//! `decode_mma_matches_the_decode_kernel`: the decode path on tensor cores (Fast, F16) against
//! the scalar decode kernel; `bench_attention_decode_mma` times the two.
//! `gated_decode_is_attention_then_gate`: the gate in that path's launches, the two ops' bits.
//!
//! With no NVIDIA driver every test prints why and passes (CI has no GPU).

use std::sync::Arc;

use ember_cuda::ops::{ATTENTION_DECODE_SPLITS, Act, AttentionPath, AttentionShape, KV_PAGE, KvPages, Precision, SeqRows};
use ember_cuda::{Buf, CudaOps, Gpu};
use ember_gguf::GgmlType;
use ember_ops::conformance::{self, Rng};
use ember_ops::{AttnHeads, Batch, HostOps, KvType, LayerIdx, Ops, StateKind, StateLayout, WeightSet};

/// The conformance suite's `rel` (largest |got − ref| over the largest |ref|). Measured on the
/// H200 (2026-12-03, seeded inputs): tiles against the reference 1.84e-6 at most (head_dim 256,
/// F16), tiles against the rows up to depth 32768 3.2e-6.
const REL: f32 = 3e-5;

/// `rel` of the tensor-core tiles (`attention_mma`, Precision::Fast: Q, K, V and the softmax
/// weights rounded to f16, f32 sums) against the reference. Measured on the H200 (2026-12-04):
/// 2.1e-4 to 6.9e-4 over the shapes of `tiles_match_the_reference`, 2.0e-4 to 2.6e-4 against
/// the rows path at the 35B shape up to depth 32768; the same 2.1e-4 to 6.9e-4 on an H100 with
/// the exponentials as ex2.approx (2026-12-06, bench/results/20261206-1610-h100-mma8-issue).
const REL_FAST: f32 = 3e-3;

#[test]
fn tiles_match_the_reference() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let mut rng = Rng::new(2026);
    // (head_dim, query heads, KV heads): GQA 1, 2 and 8; head_dim 192 is a multiple of 64 but
    // not a power of two.
    let heads = [(64, 4, 4), (128, 4, 2), (256, 16, 2), (192, 8, 1), (64, 16, 2)];
    let mut worst_all = [0f32; 2];
    for (case, &(hd, nh, nkv)) in heads.iter().enumerate() {
        for (ti, kv_type) in [KvType::F32, KvType::F16, KvType::Q8_0].into_iter().enumerate() {
            for (pi, precision) in [Precision::Exact, Precision::Fast].into_iter().enumerate() {
                let bound = [REL, REL_FAST][pi];
                let h = AttnHeads { n_head: nh, n_head_kv: nkv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
                let width = nkv * hd;
                let layout = StateLayout { layers: vec![StateKind::Kv], kv_type, kv_width: width, conv: 0, rec: 0 };
                let mut g = CudaOps::with_precision(0, precision).unwrap();
                g.register(Arc::new(WeightSet::new())).unwrap();
                let mut r = HostOps::with_weights(Arc::new(WeightSet::new()));
                let n_seq = 1 + (case + ti) % 3;
                let mut slots = Vec::new();
                for o in [&mut g as &mut dyn Ops, &mut r] {
                    o.configure(layout.clone(), 3, 240).unwrap();
                    slots.push((0..n_seq).map(|_| o.alloc_slot().unwrap()).collect::<Vec<_>>());
                }
                let mut lens = vec![0usize; n_seq];
                let mut worst = 0f32;
                let mut shapes = Vec::new();
                for step in 0..4 {
                    // A prompt chunk of 1..260 rows (the f32 tiles from 64 rows, the
                    // tensor-core ones from 4 rows and 65,536 rows x keys), or a decode row
                    // (steps 2 and 3 of some sequences), so the calls mix both.
                    let rows: Vec<usize> =
                        (0..n_seq).map(|i| if step >= 2 && (i + step) % 2 == 0 { 1 } else { 1 + rng.below(260) }).collect();
                    let n: usize = rows.iter().sum();
                    let qs = if step % 2 == 0 { 1.0 } else { 4.0 };
                    let (k, v, q) = (rng.mat(n, width, 1.0), rng.mat(n, width, 1.0), rng.mat(n, nh * hd, qs));
                    let mut outs = Vec::new();
                    for (o, s) in [&mut g as &mut dyn Ops, &mut r].into_iter().zip(&slots) {
                        let mut b = Batch::default();
                        for i in 0..n_seq {
                            b.push(s[i].id(), lens[i], &vec![0; rows[i]]);
                        }
                        o.begin_step(&b).unwrap();
                        let (kt, vt, qt) = (o.upload(&k).unwrap(), o.upload(&v).unwrap(), o.upload(&q).unwrap());
                        o.kv_append(LayerIdx(0), kt, vt).unwrap();
                        let y = o.attention(LayerIdx(0), h, qt).unwrap();
                        outs.push(o.read(y).unwrap());
                        o.end_step().unwrap();
                    }
                    let e = conformance::max_rel(&outs[0].data, &outs[1].data);
                    assert!(e <= bound, "{hd}x{nh}/{nkv} {kv_type:?} {precision:?} step {step} rows {rows:?} at {lens:?}: rel {e:e}");
                    worst = worst.max(e);
                    shapes.push(format!("{rows:?}@{lens:?}"));
                    for (l, n) in lens.iter_mut().zip(&rows) {
                        *l += n;
                    }
                }
                println!("head_dim {hd:>3} heads {nh:>2}/{nkv} {kv_type:?} {precision:?}: max rel {worst:.2e} ({})", shapes.join(" "));
                worst_all[pi] = worst_all[pi].max(worst);
            }
        }
    }
    println!("tiles vs reference: max rel {:.2e} (Exact), {:.2e} (Fast)", worst_all[0], worst_all[1]);
}

/// Decode rows through `CudaOps` (the decode kernel: 1-3 rows per sequence) against the
/// reference, deep into caches written by prompt chunks (which are not attended here: the
/// reference's prompt attention would take minutes). Depths up to 8,400 keys: 132 pages, so
/// the default 64 ranges per row hold 3 pages each.
#[test]
fn decode_matches_the_reference() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let mut rng = Rng::new(77);
    // (head_dim, query heads, KV heads, deepest prompt): query heads per block 1, 2, 8 (of 8
    // and of 16: two blocks), 1 (GQA 3); head_dim 40 fits neither the tiles nor a q8_0 row.
    let heads: [(usize, usize, usize, usize); 6] =
        [(64, 4, 4, 700), (128, 4, 2, 2100), (256, 16, 2, 8400), (192, 8, 1, 1500), (64, 16, 1, 900), (40, 6, 2, 600)];
    let mut worst_all = 0f32;
    for &(hd, nh, nkv, deep) in &heads {
        for kv_type in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let width = nkv * hd;
            if kv_type == KvType::Q8_0 && !width.is_multiple_of(32) {
                continue;
            }
            let h = AttnHeads { n_head: nh, n_head_kv: nkv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
            let layout = StateLayout { layers: vec![StateKind::Kv], kv_type, kv_width: width, conv: 0, rec: 0 };
            let mut g = CudaOps::new(0).unwrap();
            // Rows the tensor-core decode kernel takes (F16 cache, Fast: Q and the softmax
            // weights rounded to f16) are held to the tiles' bound: measured 2.0e-4 on the H100
            // (64x4/4 F16, 2026-12-07); the others to REL.
            let mut probe = AttentionShape::new(nh, nkv, hd, h.scale, &[1], 64);
            (probe.path, probe.fast) = (AttentionPath::Decode, true);
            let mma = kv_type == KvType::F16 && g.gpu().attention_decode_uses_mma(&probe, GgmlType::F16);
            let bound = if mma { REL_FAST } else { REL };
            g.register(Arc::new(WeightSet::new())).unwrap();
            let mut r = HostOps::with_weights(Arc::new(WeightSet::new()));
            // K and V pages of both sequences, the decode rows included.
            let pages = 4 * (deep + 16).div_ceil(KV_PAGE) + 8;
            let mut slots = Vec::new();
            for o in [&mut g as &mut dyn Ops, &mut r] {
                o.configure(layout.clone(), 2, pages).unwrap();
                slots.push((0..2).map(|_| o.alloc_slot().unwrap()).collect::<Vec<_>>());
            }
            // Two sequences: one `deep` keys, one a random shallower depth.
            let mut lens = [0usize; 2];
            let prompt = [deep, 1 + rng.below(deep)];
            for (i, &n) in prompt.iter().enumerate() {
                for c0 in (0..n).step_by(512) {
                    let c = 512.min(n - c0);
                    let (k, v) = (rng.mat(c, width, 1.0), rng.mat(c, width, 1.0));
                    for (o, s) in [&mut g as &mut dyn Ops, &mut r].into_iter().zip(&slots) {
                        let mut b = Batch::default();
                        b.push(s[i].id(), c0, &vec![0; c]);
                        o.begin_step(&b).unwrap();
                        let (kt, vt) = (o.upload(&k).unwrap(), o.upload(&v).unwrap());
                        o.kv_append(LayerIdx(0), kt, vt).unwrap();
                        o.end_step().unwrap();
                    }
                }
                lens[i] = n;
            }
            let mut worst = 0f32;
            for step in 0..4 {
                // One row each, then 2 and 3 rows of one sequence beside one row of the other.
                let rows = match step {
                    0 | 1 => [1, 1],
                    2 => [2, 1],
                    _ => [1, 3],
                };
                let n: usize = rows.iter().sum();
                let qs = if step % 2 == 0 { 1.0 } else { 4.0 };
                let (k, v, q) = (rng.mat(n, width, 1.0), rng.mat(n, width, 1.0), rng.mat(n, nh * hd, qs));
                let mut outs = Vec::new();
                for (o, s) in [&mut g as &mut dyn Ops, &mut r].into_iter().zip(&slots) {
                    let mut b = Batch::default();
                    for i in 0..2 {
                        b.push(s[i].id(), lens[i], &vec![0; rows[i]]);
                    }
                    o.begin_step(&b).unwrap();
                    let (kt, vt, qt) = (o.upload(&k).unwrap(), o.upload(&v).unwrap(), o.upload(&q).unwrap());
                    o.kv_append(LayerIdx(0), kt, vt).unwrap();
                    let y = o.attention(LayerIdx(0), h, qt).unwrap();
                    outs.push(o.read(y).unwrap());
                    o.end_step().unwrap();
                }
                let e = conformance::max_rel(&outs[0].data, &outs[1].data);
                assert!(e <= bound, "{hd}x{nh}/{nkv} {kv_type:?} step {step} rows {rows:?} at {lens:?}: rel {e:e}");
                worst = worst.max(e);
                for (l, n) in lens.iter_mut().zip(&rows) {
                    *l += n;
                }
            }
            println!("head_dim {hd:>3} heads {nh:>2}/{nkv} {kv_type:?} at {lens:?}: max rel {worst:.2e}");
            worst_all = worst_all.max(worst);
        }
    }
    println!("decode vs reference: max rel {worst_all:.2e}");
}

/// The decode kernel at 1, 2, 3, 7, 40 and 128 key ranges per row against the rows path on one
/// cache (the 35B shape, F16, F32 and Q8_0, 3,000 keys), and each row's result bit for bit the
/// same when it runs alone as beside rows of other depths (a row's ranges depend on its own keys
/// only), on any number of query heads a block (which the launcher picks by the call's size) and
/// with or without the rows loaded ahead (the `_pf` entries, which the launcher takes by the
/// call's deepest row: at 1-7 ranges the 3,000-key row's ranges take them, the shallow rows
/// alone do not).
#[test]
fn decode_ranges_agree() {
    let Ok(g) = Gpu::new(0) else {
        println!("skipped: no GPU");
        return;
    };
    for ty in [GgmlType::F16, GgmlType::F32, GgmlType::Q8_0] {
        ranges_agree(&g, ty);
    }
}

fn ranges_agree(g: &Gpu, ty: GgmlType) {
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let width = nkv * hd;
    let n_keys: usize = 3000;
    let n_pages = n_keys.div_ceil(KV_PAGE);
    let rb = ty.row_bytes(width).unwrap();
    // K pages then V pages, in reverse order (the table is followed, not assumed).
    let table: Vec<u32> = (0..2 * n_pages as u32).rev().collect();
    let cache = Cache { pool: g.zeros::<u8>(2 * n_pages * KV_PAGE * rb).unwrap(), table: g.upload(&table).unwrap(), n_pages, width, ty };
    let mut rng = Rng::new(3);
    {
        let (k, v) = (g.upload(&rng.mat(n_keys, width, 1.0).data).unwrap(), g.upload(&rng.mat(n_keys, width, 1.0).data).unwrap());
        let pos: Vec<u32> = (0..n_keys as u32).collect();
        let (slot, pos) = (g.zeros::<u32>(n_keys).unwrap(), g.upload(&pos).unwrap());
        g.kv_append(&cache.pages(), &k, &v, n_keys, &slot, &pos).unwrap();
    }
    // Rows at positions 0, 63, 64, 700, 2999: each its own sequence.
    let positions = [0u32, 63, 64, 700, 2999];
    let q = g.upload(&rng.mat(positions.len(), nh * hd, 2.0).data).unwrap();
    // Query heads a block: 0 lets the call's size choose (a row alone may get fewer heads a
    // block than beside others), else 8, 4, 2 or 1.
    let run = |rows: &[usize], path: AttentionPath, splits: usize, heads: usize| -> Vec<f32> {
        let n = rows.len();
        let max_keys = rows.iter().map(|&i| positions[i] as usize + 1).max().unwrap();
        let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &vec![1; n], max_keys);
        s.path = path;
        s.decode_splits = splits;
        s.decode_heads = heads;
        assert_eq!(g.attention_path(&s), path);
        // The rows' queries, gathered.
        let qd = g.download(&q).unwrap();
        let qs: Vec<f32> = rows.iter().flat_map(|&i| qd[i * nh * hd..(i + 1) * nh * hd].to_vec()).collect();
        let qb = g.upload(&qs).unwrap();
        let row0 = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
        let (seq_n, slot) = (g.upload(&vec![1u32; n]).unwrap(), g.zeros::<u32>(n).unwrap());
        let seqs = SeqRows { row0: &row0, n: &seq_n, slot: &slot, n_seq: n };
        let pos = g.upload(&rows.iter().map(|&i| positions[i]).collect::<Vec<_>>()).unwrap();
        let mut out = g.zeros::<f32>(n * nh * hd).unwrap();
        let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
        g.attention(&cache.pages(), s, &qb, &seqs, &slot, &pos, &mut out, &mut scratch).unwrap();
        g.download(&out).unwrap()
    };
    let all: Vec<usize> = (0..positions.len()).collect();
    let rows_ref = run(&all, AttentionPath::Rows, 1, 0);
    let per = nh * hd;
    for splits in [1, 2, 3, 7, 40, 128] {
        let y = run(&all, AttentionPath::Decode, splits, 0);
        let e = conformance::max_rel(&y, &rows_ref);
        println!("decode {ty:?}, {splits:>3} ranges per row: rel {e:.2e} to the rows path");
        assert!(e <= REL, "{splits} ranges: rel {e:e}");
        for heads in [8, 4, 2, 1] {
            assert!(run(&all, AttentionPath::Decode, splits, heads) == y, "{splits} ranges, {heads} heads a block: other bits");
        }
        for (j, &i) in all.iter().enumerate() {
            for heads in [0, 8, 1] {
                let alone = run(&[i], AttentionPath::Decode, splits, heads);
                assert!(alone == y[j * per..(j + 1) * per], "{splits} ranges, heads {heads}: row at {} alone differs", positions[i]);
            }
        }
    }
}

/// `attention_decode_mma` (the decode path on tensor cores: Fast, an F16 cache) against the
/// scalar decode kernel over the same cache: head_dims 64, 128 and 256, GQA ratios 1, 2, 3, 8
/// and 16 (8 heads a block: two blocks), rows whose range ends before a 16-key tile, on it and
/// past it, 1, 3, 64 and 128 ranges a row; and a row's result bit for bit the same alone as
/// beside the other rows (its ranges depend on its own keys).
#[test]
fn decode_mma_matches_the_decode_kernel() {
    let Ok(g) = Gpu::new(0) else {
        println!("skipped: no GPU");
        return;
    };
    if !g.has_mma() {
        println!("skipped: no tensor cores (sm_80+)");
        return;
    }
    let mut probe = AttentionShape::new(16, 2, 256, 0.0625, &[1], 64);
    (probe.path, probe.fast) = (AttentionPath::Decode, true);
    if !g.attention_decode_uses_mma(&probe, GgmlType::F16) {
        println!("skipped: the tensor-core decode kernel is off (EMBER_ATTN_DECODE_MMA)");
        return;
    }
    let mut rng = Rng::new(41);
    let positions = [0u32, 14, 15, 16, 63, 64, 700, 1000, 4999];
    let all: Vec<usize> = (0..positions.len()).collect();
    let mut worst_all = 0f32;
    for (hd, nh, nkv) in [(64usize, 4usize, 4usize), (128, 4, 2), (256, 16, 2), (128, 12, 4), (64, 16, 1)] {
        let cache = Cache::filled(&g, GgmlType::F16, nkv * hd, 5000, &mut rng);
        let q = rng.mat(positions.len(), nh * hd, 2.0).data;
        let per = nh * hd;
        let run = |rows: &[usize], splits: usize, mma: bool| -> Vec<f32> {
            let n = rows.len();
            let max_keys = rows.iter().map(|&i| positions[i] as usize + 1).max().unwrap();
            let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / (hd as f32).sqrt(), &vec![1; n], max_keys);
            s.path = AttentionPath::Decode;
            s.fast = true;
            s.decode_mma = mma;
            s.decode_splits = splits;
            assert_eq!(g.attention_decode_uses_mma(&s, GgmlType::F16), mma, "{hd}x{nh}/{nkv}");
            let qs: Vec<f32> = rows.iter().flat_map(|&i| q[i * per..(i + 1) * per].to_vec()).collect();
            let qb = g.upload(&qs).unwrap();
            let row0 = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
            let (seq_n, slot) = (g.upload(&vec![1u32; n]).unwrap(), g.zeros::<u32>(n).unwrap());
            let seqs = SeqRows { row0: &row0, n: &seq_n, slot: &slot, n_seq: n };
            let pos = g.upload(&rows.iter().map(|&i| positions[i]).collect::<Vec<_>>()).unwrap();
            let mut out = g.zeros::<f32>(n * per).unwrap();
            let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
            g.attention(&cache.pages(), s, &qb, &seqs, &slot, &pos, &mut out, &mut scratch).unwrap();
            g.download(&out).unwrap()
        };
        let mut worst = 0f32;
        for splits in [1, 3, 64, 128] {
            let y = run(&all, splits, true);
            let e = conformance::max_rel(&y, &run(&all, splits, false));
            assert!(e <= REL_FAST, "{hd}x{nh}/{nkv}, {splits} ranges: rel {e:e} to the scalar decode kernel");
            worst = worst.max(e);
            for i in [0, 3, 8] {
                assert!(
                    run(&[i], splits, true) == y[i * per..(i + 1) * per],
                    "{hd}x{nh}/{nkv}, {splits} ranges: row at {} alone differs",
                    positions[i]
                );
            }
        }
        println!("decode on tensor cores, head_dim {hd:>3} heads {nh:>2}/{nkv}: max rel {worst:.2e} to the scalar kernel");
        worst_all = worst_all.max(worst);
    }
    println!("decode on tensor cores vs the scalar kernel: max rel {worst_all:.2e}");
}

/// The gate in the attention's launches (`attention_gated`, the tensor-core decode kernel's
/// epilogue with one key range, the merge's with several) against `attention` then `gate_q8`:
/// the same output bits and the same int8 copy (read back through a GEMV), at head_dims 128 and
/// 256, 1 and 9 rows, 1 to 64 ranges, both activations.
#[test]
fn gated_decode_is_attention_then_gate() {
    let Ok(g) = Gpu::new(0) else {
        println!("skipped: no GPU");
        return;
    };
    let mut rng = Rng::new(43);
    let positions = [0u32, 15, 64, 700, 4999, 3, 1000, 2500, 4000];
    let mut ran = 0;
    for (hd, nh, nkv) in [(256usize, 16usize, 2usize), (128, 4, 2)] {
        let cache = Cache::filled(&g, GgmlType::F16, nkv * hd, 5000, &mut rng);
        let per = nh * hd;
        for (n, splits, act) in [(1usize, 1usize, Act::Sigmoid), (1, 64, Act::Sigmoid), (9, 3, Act::Silu), (9, 1, Act::Sigmoid)] {
            let max_keys = positions[..n].iter().map(|&p| p as usize + 1).max().unwrap();
            let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / (hd as f32).sqrt(), &vec![1; n], max_keys);
            (s.path, s.fast, s.decode_splits) = (AttentionPath::Decode, true, splits);
            if !g.attention_gates(&s, GgmlType::F16) {
                println!("gated decode {hd}x{nh}/{nkv}: not on this GPU");
                continue;
            }
            ran += 1;
            let qb = g.upload(&rng.mat(n, per, 2.0).data).unwrap();
            let gb = g.upload(&rng.mat(n, per, 3.0).data).unwrap();
            let row0 = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
            let (seq_n, slot) = (g.upload(&vec![1u32; n]).unwrap(), g.zeros::<u32>(n).unwrap());
            let seqs = SeqRows { row0: &row0, n: &seq_n, slot: &slot, n_seq: n };
            let pos = g.upload(&positions[..n]).unwrap();
            // A GEMV over the whole int8 copy (all n rows as one vector: the copy's layout).
            let w = rng.mat(7, n * per, 1.0).data;
            let mut wq = vec![0u8; GgmlType::Q8_0.row_bytes(n * per).unwrap() * 7];
            ember_gguf::quant::quantize(GgmlType::Q8_0, &w, &mut wq).unwrap();
            let probe = g.upload_weight(GgmlType::Q8_0, n * per, 7, &wq).unwrap();
            let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
            // The two ops.
            let mut o1 = g.zeros::<f32>(n * per).unwrap();
            g.attention(&cache.pages(), s, &qb, &seqs, &slot, &pos, &mut o1, &mut scratch).unwrap();
            g.gate_q8(&mut o1, &gb, n * per, act).unwrap();
            let mut y1 = g.zeros::<f32>(7).unwrap();
            g.gemv_q8_quantized(&[probe.all()], n * per, &mut [&mut y1]).unwrap();
            // The one.
            let mut o2 = g.zeros::<f32>(n * per).unwrap();
            let generation = g.attention_gated(&cache.pages(), s, &qb, &seqs, &slot, &pos, &mut o2, &mut scratch, &gb, act, true).unwrap();
            assert!(generation.is_some_and(|v| v == g.q8_generation()), "the int8 copy's generation");
            let mut y2 = g.zeros::<f32>(7).unwrap();
            g.gemv_q8_quantized(&[probe.all()], n * per, &mut [&mut y2]).unwrap();
            let what = format!("{hd}x{nh}/{nkv}, {n} rows, {splits} ranges, {act:?}");
            let bits = |b: &Buf<f32>| g.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o2), bits(&o1), "{what}: the gated output");
            assert_eq!(bits(&y2), bits(&y1), "{what}: the int8 copy through a GEMV");
            println!("gated decode {what}: the two ops' bits");
        }
    }
    println!("gated decode: {ran} cases ran");
}

/// A one-sequence, one-layer paged cache on the device: `n_pages` pages for K then as many for
/// V, in the table's order.
struct Cache {
    pool: Buf<u8>,
    table: Buf<u32>,
    n_pages: usize,
    width: usize,
    ty: GgmlType,
}

impl Cache {
    fn pages(&self) -> KvPages<'_> {
        KvPages {
            pool: &self.pool,
            table: &self.table,
            ty: self.ty,
            width: self.width,
            n_pages: 2 * self.n_pages,
            stride: self.n_pages,
            n_kv: 1,
            n_slots: 1,
            layer: 0,
        }
    }

    /// A cache of `ty` rows of `width` values whose positions 0..max_pos hold random K/V rows
    /// (kv_append converts them), pages in order, written 4096 at a time.
    fn filled(g: &Gpu, ty: GgmlType, width: usize, max_pos: usize, rng: &mut Rng) -> Cache {
        let n_pages = max_pos.div_ceil(KV_PAGE);
        let rb = ty.row_bytes(width).unwrap();
        let table: Vec<u32> = (0..2 * n_pages as u32).collect();
        let cache =
            Cache { pool: g.zeros::<u8>(2 * n_pages * KV_PAGE * rb).unwrap(), table: g.upload(&table).unwrap(), n_pages, width, ty };
        for p0 in (0..max_pos).step_by(4096) {
            let n = 4096.min(max_pos - p0);
            let (k, v) = (g.upload(&rng.mat(n, width, 1.0).data).unwrap(), g.upload(&rng.mat(n, width, 1.0).data).unwrap());
            let pos: Vec<u32> = (p0 as u32..(p0 + n) as u32).collect();
            let (slot, pos) = (g.zeros::<u32>(n).unwrap(), g.upload(&pos).unwrap());
            g.kv_append(&cache.pages(), &k, &v, n, &slot, &pos).unwrap();
        }
        cache
    }
}

/// Milliseconds of GPU time per call of `f` (events around `reps` calls after one warm-up).
fn gpu_ms(g: &Gpu, reps: usize, mut f: impl FnMut() -> ember_cuda::Result<()>) -> f64 {
    f().unwrap();
    let ms = g
        .time_ms(|| {
            for _ in 0..reps {
                f()?;
            }
            Ok(())
        })
        .unwrap();
    ms as f64 / reps as f64
}

/// The 35B model's attention (16 query heads, 2 KV heads, head_dim 256, F16 cache) on one
/// sequence at depth d: a 512-row prompt chunk at d = 0, 4096, 8192, 32768 and a decode row at
/// 8192 and 32768 on both paths (rows: the kernels before the tiles; tiles: attention_tiles),
/// their largest difference, GPU ms per call and TFLOP/s (4·heads·head_dim per (row, key)
/// pair); then rows per call 1..64 at 8192 and 32768 (where the paths cross).
#[test]
#[ignore]
fn bench_attention_tiles() {
    let Ok(g) = Gpu::new(0) else { return };
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let width = nkv * hd;
    let max_pos: usize = 32768 + 512;
    let mut rng = Rng::new(35);
    let cache = Cache::filled(&g, GgmlType::F16, width, max_pos, &mut rng);
    let rb = GgmlType::F16.row_bytes(width).unwrap();
    let q_all = g.upload(&rng.mat(512, nh * hd, 1.0).data).unwrap();
    let seq_row0 = g.zeros::<u32>(1).unwrap();
    let slot0 = g.zeros::<u32>(1).unwrap();
    let mut out = g.zeros::<f32>(512 * nh * hd).unwrap();
    let mut run = |n: usize, depth: usize, path: AttentionPath, reps: usize, splits: usize, fast: bool| -> (f64, Vec<f32>, usize) {
        let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &[n], depth + n);
        s.path = path;
        s.fast = fast;
        assert_eq!(g.attention_uses_mma(&s), fast && path == AttentionPath::Tiles);
        if splits > 0 {
            s.decode_splits = splits;
        }
        let seq_n = g.upload(&[n as u32]).unwrap();
        let seqs = SeqRows { row0: &seq_row0, n: &seq_n, slot: &slot0, n_seq: 1 };
        let row_slot = g.zeros::<u32>(n).unwrap();
        let pos = g.upload(&(depth as u32..(depth + n) as u32).collect::<Vec<_>>()).unwrap();
        let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
        let splits = g.attention_splits(&s);
        let ms = gpu_ms(&g, reps, || g.attention(&cache.pages(), s, &q_all, &seqs, &row_slot, &pos, &mut out, &mut scratch));
        (ms, g.download_range(&out, 0, n * nh * hd).unwrap(), splits)
    };
    let tflops = |n: usize, depth: usize, ms: f64| {
        let pairs: f64 = (0..n).map(|i| (depth + i + 1) as f64).sum();
        4.0 * (nh * hd) as f64 * pairs / ms / 1e9
    };
    // The decode kernel: one row and 16 rows at depths 1024..32768, ranges per row swept.
    for depth in [1024, 4096, 8192, 32768] {
        for n in [1, 16] {
            let (ms_rows, y_rows, _) = run(n, depth, AttentionPath::Rows, 10, 0, false);
            let mut line = format!("decode {n:>2} rows at depth {depth:>5}: rows {ms_rows:7.3} ms");
            for splits in [16, 32, 64, 128, 256] {
                let (ms, y, sp) = run(n, depth, AttentionPath::Decode, 10, splits, false);
                let e = conformance::max_rel(&y, &y_rows);
                assert!(e <= REL, "decode at {n} rows, depth {depth}, {splits} ranges: {e:e}");
                // K and V of the rows' keys, read once per KV head.
                let gbs = (n * (depth + 1) * 2 * rb) as f64 / ms / 1e6;
                line += &format!("  {splits}: {ms:7.4} ms ({sp} ranges, {gbs:5.0} GB/s)");
            }
            println!("{line}");
        }
    }
    for (n, depth) in [(512, 0), (512, 4096), (512, 8192), (512, 32768), (1, 8192), (1, 32768)] {
        let reps = if depth >= 32768 && n > 1 { 2 } else { 10 };
        let (ms_rows, y_rows, sp_rows) = run(n, depth, AttentionPath::Rows, reps, 0, false);
        let (ms_tiles, y_tiles, sp_tiles) = run(n, depth, AttentionPath::Tiles, reps, 0, false);
        let e = conformance::max_rel(&y_tiles, &y_rows);
        let (ms_mma, y_mma, _) = run(n, depth, AttentionPath::Tiles, reps, 0, true);
        let e_mma = conformance::max_rel(&y_mma, &y_rows);
        println!(
            "bench attention {n:>3} rows at depth {depth:>5}: tensor-core tiles {ms_mma:9.3} ms ({:6.2} TFLOP/s)  {:5.2}x the f32 tiles  rel to the rows {e_mma:.2e}",
            tflops(n, depth, ms_mma),
            ms_tiles / ms_mma
        );
        assert!(e_mma <= REL_FAST, "tensor-core tiles vs rows at {n} rows, depth {depth}: {e_mma:e}");
        println!(
            "bench attention {n:>3} rows at depth {depth:>5}: rows {ms_rows:9.3} ms ({:6.2} TFLOP/s, {sp_rows} ranges)  tiles {ms_tiles:9.3} ms ({:6.2} TFLOP/s, {sp_tiles} ranges)  {:5.2}x  auto: {:?}  tiles vs rows rel {e:.2e}",
            tflops(n, depth, ms_rows),
            tflops(n, depth, ms_tiles),
            ms_rows / ms_tiles,
            g.attention_path(&AttentionShape::new(nh, nkv, hd, 1.0, &[n], depth + n)),
        );
        assert!(e <= REL, "tiles vs rows at {n} rows, depth {depth}: {e:e}");
    }
    for depth in [1024, 8192, 32768] {
        for n in [1, 2, 4, 8, 16, 32, 64, 128] {
            let (ms_rows, _, _) = run(n, depth, AttentionPath::Rows, 5, 0, false);
            let (ms_tiles, _, _) = run(n, depth, AttentionPath::Tiles, 5, 0, false);
            let (ms_dec, _, _) = run(n, depth, AttentionPath::Decode, 5, 0, false);
            let (ms_mma, _, _) = run(n, depth, AttentionPath::Tiles, 5, 0, true);
            println!(
                "crossover depth {depth:>5} {n:>2} rows: rows {ms_rows:8.3} ms  tiles {ms_tiles:8.3} ms  tensor-core tiles {ms_mma:8.3} ms  decode {ms_dec:8.3} ms"
            );
        }
    }
}

/// `rel` of `attention_wg` (both products on wgmma, docs/attention-wgmma.md step 3) against
/// `attention_mma_w8` (mma.sync) on the same f16 inputs. Measured on an H100 (2026-12-07,
/// bench/results/20261207-2229-h100-attention-wg): 0 in every case, the same bits (the same
/// products summed 16 at a time in the same order); the bound leaves an ulp of f32 sums for a
/// tensor core that orders them otherwise.
const REL_WG: f32 = 1e-6;

/// `attention_wg` against `attention_mma_w8` at the 35B model's shape (16 query heads, 2 KV
/// heads, head_dim 256, F16 cache): one sequence of 1..512 rows at depths from 4,096 keys (where
/// the tiles take 128 query vectors a block) to 9,000, rows ending inside a page and on its end,
/// one key range and several (`n_split`: the partial results and the merge).
#[test]
fn wg_tiles_match_the_mma_tiles() {
    let g = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    if !g.has_wgmma() {
        println!("skipped: compute capability {} has no wgmma", g.info().sm());
        return;
    }
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let max_pos = 9000 + 512;
    let mut rng = Rng::new(41);
    let cache = Cache::filled(&g, GgmlType::F16, nkv * hd, max_pos, &mut rng);
    let mut worst = 0f32;
    for (n, depth) in [(512usize, 4096usize), (1, 4100), (37, 4163), (300, 5000), (512, 8960), (130, 9000)] {
        let q = g.upload(&rng.mat(n, nh * hd, 1.0).data).unwrap();
        let (seq_row0, slot0, seq_n) = (g.zeros::<u32>(1).unwrap(), g.zeros::<u32>(1).unwrap(), g.upload(&[n as u32]).unwrap());
        let seqs = SeqRows { row0: &seq_row0, n: &seq_n, slot: &slot0, n_seq: 1 };
        let row_slot = g.zeros::<u32>(n).unwrap();
        let pos = g.upload(&(depth as u32..(depth + n) as u32).collect::<Vec<_>>()).unwrap();
        let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &[n], depth + n);
        s.path = AttentionPath::Tiles;
        s.fast = true;
        let mut outs = Vec::new();
        for wg in [false, true] {
            g.set_attention_wg(wg);
            assert_eq!(g.attention_uses_wg(&s, GgmlType::F16), wg, "{n} rows at {depth}");
            let mut out = g.zeros::<f32>(n * nh * hd).unwrap();
            let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
            g.attention(&cache.pages(), s, &q, &seqs, &row_slot, &pos, &mut out, &mut scratch).unwrap();
            outs.push(g.download(&out).unwrap());
        }
        g.set_attention_wg(false);
        let e = conformance::max_rel(&outs[0], &outs[1]);
        println!("attention_wg, {n:>3} rows at depth {depth}, {} ranges: max rel {e:.2e} to attention_mma_w8", g.attention_splits(&s));
        assert!(outs[1].iter().all(|x| x.is_finite()), "{n} rows at {depth}: non-finite output");
        assert!(e <= REL_WG, "{n} rows at {depth}: rel {e:e}");
        worst = worst.max(e);
    }
    println!("attention_wg against attention_mma_w8: max rel {worst:.2e}");
}

/// The tensor-core tiles alone at the 35B model's shape (16 query heads, 2 KV heads, head_dim
/// 256, F16 cache): 512 rows at depths 0..32768, GPU ms per call and TFLOP/s, for A/B runs of
/// the kernel's switches (`EMBER_KERNEL_DEFINES`); the tiles' agreement with the reference is
/// `tiles_match_the_reference`'s.
#[test]
#[ignore]
fn bench_attention_mma() {
    let Ok(g) = Gpu::new(0) else { return };
    let (nh, nkv, hd, n) = (16usize, 2usize, 256usize, 512usize);
    let max_pos: usize = 32768 + n;
    let mut rng = Rng::new(37);
    let cache = Cache::filled(&g, GgmlType::F16, nkv * hd, max_pos, &mut rng);
    let q_all = g.upload(&rng.mat(n, nh * hd, 1.0).data).unwrap();
    let seq_row0 = g.zeros::<u32>(1).unwrap();
    let slot0 = g.zeros::<u32>(1).unwrap();
    let seq_n = g.upload(&[n as u32]).unwrap();
    let seqs = SeqRows { row0: &seq_row0, n: &seq_n, slot: &slot0, n_seq: 1 };
    let row_slot = g.zeros::<u32>(n).unwrap();
    let mut out = g.zeros::<f32>(n * nh * hd).unwrap();
    for depth in [0usize, 4096, 8192, 32768] {
        let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &[n], depth + n);
        s.path = AttentionPath::Tiles;
        s.fast = true;
        assert!(g.attention_uses_mma(&s));
        let pos = g.upload(&(depth as u32..(depth + n) as u32).collect::<Vec<_>>()).unwrap();
        let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
        let ms = gpu_ms(&g, 10, || g.attention(&cache.pages(), s, &q_all, &seqs, &row_slot, &pos, &mut out, &mut scratch));
        let pairs: f64 = (0..n).map(|i| (depth + i + 1) as f64).sum();
        let tflops = 4.0 * (nh * hd) as f64 * pairs / ms / 1e9;
        let kernel = if g.attention_uses_wg(&s, GgmlType::F16) { "attention_wg" } else { "attention_mma" };
        println!("bench {kernel} {n} rows at depth {depth:>5}: {ms:8.3} ms ({tflops:6.1} TFLOP/s, {} ranges)", g.attention_splits(&s));
    }
}

/// The decode kernel's heads per block at the 35B model's shape (16 query heads, 2 KV heads,
/// head_dim 256), F16 and q8_0 caches: GPU us per call (kernel and merge) for 1 and 16 rows at
/// depths 16..32768 on 8, 4, 2 and 1 heads a block and on the launcher's choice, every one the
/// same bits.
#[test]
#[ignore]
fn bench_attention_decode_heads() {
    let Ok(g) = Gpu::new(0) else { return };
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let width = nkv * hd;
    let max_pos: usize = 32768 + 16;
    let mut rng = Rng::new(36);
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        let cache = Cache::filled(&g, ty, width, max_pos, &mut rng);
        let pages = cache.pages();
        let q_all = g.upload(&rng.mat(16, nh * hd, 1.0).data).unwrap();
        let mut out = g.zeros::<f32>(16 * nh * hd).unwrap();
        for depth in [16usize, 256, 1024, 4096, 8192, 16384, 32768] {
            for n in [1usize, 16] {
                // n sequences of one row each, all in slot 0 at the same depth.
                let row0 = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
                let (seq_n, slot) = (g.upload(&vec![1u32; n]).unwrap(), g.zeros::<u32>(n).unwrap());
                let seqs = SeqRows { row0: &row0, n: &seq_n, slot: &slot, n_seq: n };
                let pos = g.upload(&vec![depth as u32 - 1; n]).unwrap();
                let mut line = format!("decode heads {ty:?} {n:>2} rows at depth {depth:>5}:");
                let mut base: Option<Vec<f32>> = None;
                for heads in [8usize, 4, 2, 1, 0] {
                    let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &vec![1; n], depth);
                    s.path = AttentionPath::Decode;
                    s.decode_heads = heads;
                    let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
                    let ms = gpu_ms(&g, 20, || g.attention(&pages, s, &q_all, &seqs, &slot, &pos, &mut out, &mut scratch));
                    let y = g.download_range(&out, 0, n * nh * hd).unwrap();
                    // The heads a block change no bits.
                    assert!(base.as_ref().is_none_or(|b| *b == y), "{ty:?} {n} rows at {depth}, {heads} heads: other bits than 8");
                    base.get_or_insert(y);
                    line += &match heads {
                        0 => format!("  auto ({}): {:7.1} us", g.attention_decode_heads(&s), ms * 1e3),
                        _ => format!("  {heads}: {:7.1} us", ms * 1e3),
                    };
                }
                println!("{line}");
            }
        }
    }
}

/// The decode path on tensor cores (`attention_decode_mma`, the entry `EMBER_ATTN_DECODE_MMA`
/// picks) against the scalar decode kernel (the launcher's heads a block) at the 35B model's
/// shape (16 query heads, 2 KV heads, head_dim 256, F16 cache): GPU us per call (kernel and
/// merge) and the K/V read rate for 1, 4 and 16 rows at depths 256..32768, and their agreement.
#[test]
#[ignore]
fn bench_attention_decode_mma() {
    let Ok(g) = Gpu::new(0) else { return };
    let mut probe = AttentionShape::new(16, 2, 256, 0.0625, &[1], 64);
    (probe.path, probe.fast) = (AttentionPath::Decode, true);
    if !g.attention_decode_uses_mma(&probe, GgmlType::F16) {
        println!("skipped: no tensor cores or EMBER_ATTN_DECODE_MMA=0");
        return;
    }
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let width = nkv * hd;
    let rb = GgmlType::F16.row_bytes(width).unwrap();
    let max_pos: usize = 32768 + 16;
    let mut rng = Rng::new(38);
    let cache = Cache::filled(&g, GgmlType::F16, width, max_pos, &mut rng);
    let pages = cache.pages();
    let q_all = g.upload(&rng.mat(16, nh * hd, 1.0).data).unwrap();
    let mut out = g.zeros::<f32>(16 * nh * hd).unwrap();
    let entry = std::env::var("EMBER_ATTN_DECODE_MMA").unwrap_or_else(|_| "default".into());
    for depth in [256usize, 1024, 4096, 8192, 16384, 32768] {
        for n in [1usize, 4, 16] {
            let row0 = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
            let (seq_n, slot) = (g.upload(&vec![1u32; n]).unwrap(), g.zeros::<u32>(n).unwrap());
            let seqs = SeqRows { row0: &row0, n: &seq_n, slot: &slot, n_seq: n };
            let pos = g.upload(&vec![depth as u32 - 1; n]).unwrap();
            let mut time_split = |mma: bool, splits: usize| {
                let mut s = AttentionShape::new(nh, nkv, hd, 1.0 / 16.0, &vec![1; n], depth);
                s.path = AttentionPath::Decode;
                s.fast = true;
                s.decode_mma = mma;
                s.decode_splits = splits;
                assert_eq!(g.attention_decode_uses_mma(&s, GgmlType::F16), mma);
                let mut scratch = g.zeros::<f32>(g.attention_scratch(&s).max(1)).unwrap();
                let ms = gpu_ms(&g, 20, || g.attention(&pages, s, &q_all, &seqs, &slot, &pos, &mut out, &mut scratch));
                (ms * 1e3, g.download_range(&out, 0, n * nh * hd).unwrap())
            };
            let mut time = |mma: bool| time_split(mma, ATTENTION_DECODE_SPLITS);
            let (us, y) = time(false);
            let (us_mma, y_mma) = time(true);
            let e = conformance::max_rel(&y_mma, &y);
            assert!(e <= REL_FAST, "{n} rows at {depth}: rel {e:e}");
            // One or four rows deep: more ranges a row (fewer tiles a warp in a row).
            if n <= 4 && depth >= 8192 {
                for splits in [128, 256] {
                    let (us_s, y_s) = time_split(true, splits);
                    let e = conformance::max_rel(&y_s, &y);
                    assert!(e <= REL_FAST, "{n} rows at {depth}, {splits} ranges: rel {e:e}");
                    println!("decode mma ({entry}) {n:>2} rows at depth {depth:>5}, {splits} ranges: {us_s:7.1} us");
                }
            }
            let gbs = |us: f64| (n * depth * 2 * rb) as f64 / us / 1e3;
            println!(
                "decode mma ({entry}) {n:>2} rows at depth {depth:>5}: scalar {us:7.1} us ({:5.0} GB/s)  tensor cores {us_mma:7.1} us ({:5.0} GB/s)  {:4.2}x  rel {e:.2e}",
                gbs(us),
                gbs(us_mma),
                us / us_mma
            );
        }
    }
}

/// The tiles path refuses a head_dim that is not a multiple of 64 (an error, not a panic).
#[test]
fn tiles_refuse_odd_head_dims() {
    let Ok(g) = Gpu::new(0) else {
        println!("skipped: no GPU");
        return;
    };
    let (nkv, hd) = (1, 96);
    let rb = GgmlType::F32.row_bytes(nkv * hd).unwrap();
    let pool = g.zeros::<u8>(2 * KV_PAGE * rb).unwrap();
    let table = g.upload(&[0u32, 1]).unwrap();
    let pages =
        KvPages { pool: &pool, table: &table, ty: GgmlType::F32, width: nkv * hd, n_pages: 2, stride: 1, n_kv: 1, n_slots: 1, layer: 0 };
    let mut s = AttentionShape::new(2, nkv, hd, 0.1, &[4], 4);
    s.path = AttentionPath::Tiles;
    let (q, mut out, mut scratch) = (g.zeros::<f32>(4 * 2 * hd).unwrap(), g.zeros::<f32>(4 * 2 * hd).unwrap(), g.zeros::<f32>(1).unwrap());
    let (row0, n, slot) = (g.zeros::<u32>(1).unwrap(), g.upload(&[4u32]).unwrap(), g.zeros::<u32>(1).unwrap());
    let seqs = SeqRows { row0: &row0, n: &n, slot: &slot, n_seq: 1 };
    let (rs, pos) = (g.zeros::<u32>(4).unwrap(), g.upload(&[0u32, 1, 2, 3]).unwrap());
    let e = g.attention(&pages, s, &q, &seqs, &rs, &pos, &mut out, &mut scratch).unwrap_err();
    println!("refused: {e}");
    // Auto falls back to the rows for it.
    s.path = AttentionPath::Auto;
    g.attention(&pages, s, &q, &seqs, &rs, &pos, &mut out, &mut scratch).unwrap();
}
