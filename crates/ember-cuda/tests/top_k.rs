//! A logit row's best entries selected on the GPU ([`CudaOps`]'s `read_top`, kernels/top_k.cu)
//! equal [`ember_ops::top::top_of_row`]'s, entry for entry (ids and the values' bits: a
//! selection, no arithmetic): rows of 1 to 248,320 entries (the 35B's vocabulary), one and
//! several rows a call, k from 0 past the row's length, rows full of ties, NaN and -inf, every
//! entry equal, extra ids repeated, among the best and past the row; a call recorded in a step
//! (CUDA graphs) and one outside; extra ids for the wrong number of rows are refused. Both forms
//! of the kernel (one block a row; split over blocks, whose last step sorts the first digit's
//! candidates or, past `TOPK_CAND` of them, falls back to the one-block algorithm) on the same
//! long rows, called back to back (the split form's scratch must be left zeroed).
//!
//! With no NVIDIA driver the test prints why and passes (CI has no GPU).

use std::sync::Arc;

use ember_cuda::ops::{TOPK_BINS, TOPK_CAND, TopKScratch};
use ember_cuda::{CudaOps, Gpu};
use ember_ops::top::top_of_row;
use ember_ops::{Batch, Mat, Ops, WeightSet};
use ember_testkit::Rng;

/// Logits with what a selection can trip on: runs of equal values, NaN, -inf, +-0.
fn row(rng: &mut Rng, n: usize, kind: usize) -> Vec<f32> {
    (0..n)
        .map(|_| match kind {
            0 => (rng.below(4000) as f32 - 2000.0) * 0.01,
            1 => match rng.below(10) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => 0.0,
                3 => -0.0,
                4 => 7.5,
                _ => (rng.below(64) as f32 - 32.0) * 0.5,
            },
            // Spread like logits (a sum of four uniforms, std ~3): few entries share the k-th's
            // first digit, so the split form sorts its candidates.
            3 => (0..4).map(|_| rng.below(1 << 16) as f32 / 65536.0 - 0.5).sum::<f32>() * 5.2,
            _ => 1.25,
        })
        .collect()
}

/// `n` entries of 0.25 with `top` of them (spread over the row) at 1.0: the best k <= top share
/// one first digit with exactly `top` entries in it.
fn crowded(n: usize, top: usize) -> Vec<f32> {
    let mut v = vec![0.25f32; n];
    for j in 0..top {
        v[j * (n / top)] = 1.0;
    }
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn rows_best_entries_on_the_gpu_equal_the_host_selection() {
    let mut o = match CudaOps::new(0) {
        Ok(o) => o,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    o.register(Arc::new(WeightSet::new())).unwrap();
    let mut rng = Rng::new();
    let mut checked = 0;
    for (n, rows) in [(1usize, 1usize), (7, 3), (1000, 1), (4099, 2), (248_320, 1), (248_320, 4)] {
        for kind in 0..4 {
            for k in [0usize, 1, 2, 41, 257, 1025, n, n + 5] {
                let data: Vec<Vec<f32>> = (0..rows).map(|_| row(&mut rng, n, kind)).collect();
                let extra: Vec<Vec<u32>> = (0..rows)
                    .map(|r| if r % 2 == 0 { vec![0, (n / 2) as u32, (n / 2) as u32, n as u32 + 3, (n - 1) as u32] } else { Vec::new() })
                    .collect();
                // Alternately inside a recorded step and outside one.
                let in_step = checked % 2 == 0;
                if in_step {
                    o.begin_step(&Batch::default()).unwrap();
                }
                let x = o.upload(&Mat::from_vec(rows, n, data.concat())).unwrap();
                let got = o.read_top(x, k, &extra).unwrap();
                if in_step {
                    o.end_step().unwrap();
                }
                assert_eq!(got.len(), rows);
                for (r, g) in got.iter().enumerate() {
                    let want = top_of_row(&data[r], k, &extra[r]);
                    assert_eq!(g.ids, want.ids, "n {n} kind {kind} k {k} row {r}: ids");
                    assert_eq!(bits(&g.vals), bits(&want.vals), "n {n} kind {kind} k {k} row {r}: values");
                }
                checked += 1;
            }
        }
    }
    // No extras at all, and extras for the wrong number of rows.
    let data = row(&mut rng, 5000, 0);
    let x = o.upload(&Mat::from_vec(1, 5000, data.clone())).unwrap();
    assert_eq!(o.read_top(x, 40, &[]).unwrap(), vec![top_of_row(&data, 40, &[])]);
    let e = o.read_top(x, 40, &[vec![], vec![]]).unwrap_err();
    assert!(e.to_string().contains("extra"), "{e}");
    println!("{checked} selections equal the host's");
}

#[test]
fn both_forms_of_the_kernel_select_the_same_entries() {
    let g = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let mut rng = Rng::new();
    let (rows, n) = (3usize, 100_003usize);
    let (hist, counts, cand) =
        (g.zeros::<u32>(rows * TOPK_BINS).unwrap(), g.zeros::<u32>(rows * 2).unwrap(), g.zeros::<u32>(rows * TOPK_CAND).unwrap());
    let extra = g.upload(&[5u32, 77, 5]).unwrap();
    let extra_at = g.upload(&[0u32, 3, 3, 3]).unwrap();
    // Kinds 0-3 as `row` makes them; 4 and 5: exactly TOPK_CAND and one more entries in the
    // best first digit (the last sort, the first fallback).
    for kind in 0..6 {
        for k in [1usize, 40, 41, 1024, 5000] {
            let data: Vec<f32> = (0..rows)
                .flat_map(|_| match kind {
                    4 => crowded(n, TOPK_CAND),
                    5 => crowded(n, TOPK_CAND + 1),
                    _ => row(&mut rng, n, kind),
                })
                .collect();
            let x = g.upload(&data).unwrap();
            let cap = k + 3;
            let mut got = Vec::new();
            for split in [false, true, true] {
                let (mut ids, mut vals) = (g.zeros::<u32>(rows * cap).unwrap(), g.zeros::<f32>(rows * cap).unwrap());
                let scratch = split.then_some(TopKScratch { hist: &hist, counts: &counts, cand: &cand });
                g.top_k_rows(&x, rows, n, k, &extra, &extra_at, cap, &mut ids, &mut vals, scratch).unwrap();
                let (ids, vals) = (g.download(&ids).unwrap(), g.download(&vals).unwrap());
                let per_row: Vec<(Vec<u32>, Vec<u32>)> = (0..rows)
                    .map(|r| {
                        let m = k + if r == 0 { 3 } else { 0 };
                        let mut pairs: Vec<(u32, u32)> = (0..m).map(|j| (ids[r * cap + j], vals[r * cap + j].to_bits())).collect();
                        pairs.sort_unstable();
                        pairs.dedup_by_key(|p| p.0);
                        (pairs.iter().map(|p| p.0).collect(), pairs.iter().map(|p| p.1).collect())
                    })
                    .collect();
                got.push(per_row);
            }
            for r in 0..rows {
                let want = top_of_row(&data[r * n..(r + 1) * n], k, if r == 0 { &[5, 77, 5] } else { &[] });
                for (form, g) in ["one block", "split", "split again"].iter().zip(&got) {
                    assert_eq!(g[r].0, want.ids, "{form}: kind {kind} k {k} row {r}: ids");
                    assert_eq!(g[r].1, bits(&want.vals), "{form}: kind {kind} k {k} row {r}: values");
                }
            }
        }
    }
    assert!(g.download(&hist).unwrap().iter().all(|&h| h == 0), "the split form leaves its histogram zeroed");
    assert!(g.download(&counts).unwrap().iter().all(|&c| c == 0), "and its counters");
}
