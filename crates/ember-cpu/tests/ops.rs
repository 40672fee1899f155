//! The fast CPU ops against the scalar reference ops (ember_ops::reference) on random inputs,
//! for token counts on both sides of the decode / prompt switch-overs (panels from 8 tokens,
//! the column-block delta rule from 2, the transposed-tap conv from 8).

use ember_cpu::{CpuOps, Precision};
use ember_ops::{DeltaShape, Gate, Mat, reference};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random_mat(n: usize, d: usize, seed: &mut u64) -> Mat {
    Mat::from_vec(n, d, (0..n * d).map(|_| lcg(seed)).collect())
}

fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// Causal conv + SiLU over several calls (the state carries across them): measured max
/// relative error 1.3e-7 (the fast path uses FMA and a vectorised exp); bound 1e-5.
#[test]
fn conv1d_silu_matches_reference() {
    let ops = CpuOps::new(Precision::Fast, 2);
    let mut seed = 1;
    let (c, kernel) = (72, 4);
    let w: Vec<f32> = (0..c * kernel).map(|_| lcg(&mut seed)).collect();
    let mut st_fast = vec![0f32; (kernel - 1) * c];
    let mut st_ref = st_fast.clone();
    for n in [1, 2, 5, 1, 9, 40, 3, 1] {
        let x = random_mat(n, c, &mut seed);
        let got = ops.conv1d_silu_vec(&x, &w, &mut st_fast);
        let want = reference::conv1d_silu(&x, &w, &mut st_ref);
        eprintln!("conv1d n={n}: max rel {:.1e}", max_rel(&got.data, &want.data));
        assert!(max_rel(&got.data, &want.data) < 1e-5, "n={n}: {}", max_rel(&got.data, &want.data));
        assert_eq!(st_fast, st_ref, "state after n={n}");
    }
}

/// The output gates (SiLU, sigmoid) with the vectorised exp, on one thread's worth and on a
/// prompt's worth split across workers, gate inputs up to ±40: measured max relative error
/// 6.0e-8 of the largest output; bound 1e-5.
#[test]
fn gate_matches_reference() {
    let ops = CpuOps::new(Precision::Fast, 2);
    let mut seed = 7;
    for (n, d) in [(1, 4096), (3, 1001), (40, 1000)] {
        for act in [Gate::Silu, Gate::Sigmoid] {
            let y = random_mat(n, d, &mut seed);
            let mut g = random_mat(n, d, &mut seed);
            g.data.iter_mut().for_each(|v| *v *= 40.0);
            let (mut got, mut want) = (y.clone(), y);
            ops.gate_mat(&mut got, &g, act);
            reference::gate(&mut want, &g, act);
            let err = max_rel(&got.data, &want.data);
            eprintln!("gate {act:?} {n}x{d}: max rel {err:.1e}");
            assert!(err < 1e-5, "{act:?} {n}x{d}: {err}");
        }
    }
}

/// RMSNorm per group (whole rows and per-head groups), decode-sized and prompt-sized (split
/// across workers): measured max relative error 1.4e-7 (the vector dot sums in another
/// order); bound 1e-5.
#[test]
fn rms_norm_matches_reference() {
    let ops = CpuOps::new(Precision::Fast, 2);
    let mut seed = 11;
    for (n, d, g) in [(1, 1024, 1024), (40, 1024, 1024), (37, 512, 128), (3, 96, 32)] {
        let x = random_mat(n, d, &mut seed);
        let w: Vec<f32> = (0..g).map(|_| lcg(&mut seed)).collect();
        let got = ops.rms_norm_vec(&x, &w, 1e-6);
        let want = reference::rms_norm(&x, &w, 1e-6);
        let err = max_rel(&got.data, &want.data);
        eprintln!("rms_norm {n}x{d} groups of {g}: max rel {err:.1e}");
        assert!(err < 1e-5, "{n}x{d}/{g}: {err}");
    }
}

/// The gated delta rule over several calls against the reference recurrence: measured max
/// relative error 3.4e-7 on outputs, 1.2e-7 on the state; bound 1e-5.
#[test]
fn gated_delta_rule_matches_reference() {
    let ops = CpuOps::new(Precision::Fast, 2);
    let mut seed = 7;
    let (n_k_head, n_v_head, dk, dv) = (2, 4, 32, 48);
    let mut st_fast = vec![0f32; n_v_head * dk * dv];
    let mut st_ref = st_fast.clone();
    // 150 tokens: three chunks of the column-block kernel (64, 64, 22).
    for n in [1, 3, 1, 37, 2, 150, 1] {
        let s = DeltaShape { n_tok: n, n_k_head, n_v_head, d_k: dk, d_v: dv };
        let unit = |m: Mat| {
            let mut m = m;
            for row in m.data.chunks_exact_mut(dk) {
                let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                row.iter_mut().for_each(|x| *x /= norm);
            }
            m
        };
        let q = unit(random_mat(n, n_k_head * dk, &mut seed));
        let k = unit(random_mat(n, n_k_head * dk, &mut seed));
        let v = random_mat(n, n_v_head * dv, &mut seed);
        let g = Mat::from_vec(n, n_v_head, (0..n * n_v_head).map(|_| -0.3 * (lcg(&mut seed) + 1.0)).collect());
        let beta = Mat::from_vec(n, n_v_head, (0..n * n_v_head).map(|_| 0.5 * (lcg(&mut seed) + 1.0)).collect());
        let got = ops.delta_rule_mats(s, &q, &k, &v, &g, &beta, &mut st_fast, false);
        let want = reference::delta_rule_recurrent(s, &q, &k, &v, &g, &beta, &mut st_ref);
        eprintln!("delta n={n}: out {:.1e} state {:.1e}", max_rel(&got.data, &want.data), max_rel(&st_fast, &st_ref));
        assert!(max_rel(&got.data, &want.data) < 1e-5, "n={n}: out {}", max_rel(&got.data, &want.data));
        assert!(max_rel(&st_fast, &st_ref) < 1e-5, "n={n}: state {}", max_rel(&st_fast, &st_ref));
    }
}

/// Attention over an f16 KV cache (the AVX-512 kernel where present, the generic loop
/// elsewhere) against the reference, for decode and prompt steps, with more positions than
/// one 512-position block of the P·V pass: measured max relative error 1.0e-6; bound 1e-5
/// (both read the same f16 rows; the kernels use FMA and a vectorised exp), and
/// [`BF16_ATTN_BOUND`] for prompts where P·V runs in bf16 (up to 2.9e-3).
#[test]
fn attention_matches_reference() {
    use ember_ops::{AttnShape, KvRows, KvType};
    let ops = CpuOps::new(Precision::Fast, 2);
    let mut seed = 3;
    let (n_head, n_head_kv, hd) = (16, 2, 64);
    let mut kc = KvRows::new(KvType::F16, n_head_kv * hd);
    let mut vc = KvRows::new(KvType::F16, n_head_kv * hd);
    let mut pos = 0;
    for n in [600, 1, 7, 500, 1] {
        let pool = ember_ops::PagePool::unbounded();
        kc.push(&random_mat(n, n_head_kv * hd, &mut seed), &pool).unwrap();
        vc.push(&random_mat(n, n_head_kv * hd, &mut seed), &pool).unwrap();
        let q = random_mat(n, n_head * hd, &mut seed);
        let s = AttnShape { n_tok: n, n_head, n_head_kv, head_dim: hd, pos0: pos, scale: 1.0 / (hd as f32).sqrt() };
        let got = ops.attention_rows(s, &q, &kc, &vc);
        let want = reference::attention(s, &q, &kc, &vc);
        eprintln!("attention n={n} pos0={pos}: max rel {:.1e}", max_rel(&got.data, &want.data));
        let bound = f16_bound(n);
        assert!(max_rel(&got.data, &want.data) < bound, "n={n} pos0={pos}: {}", max_rel(&got.data, &want.data));
        pos += n;
    }
}

/// Bound for attention over a q8_0 cache in fast precision: its scores are integer dots with
/// the query quantised to 8 bits per 32 values (as llama.cpp's CPU attention quantises it for
/// a q8_0 K), so the error is that rounding, not f32 summation. Measured max relative error
/// (of the largest output) up to 6.7e-3 in the tiled test (queries ×4: scores of a few units;
/// 7.4e-3 with P·V in bf16, below) and 1.8e-3 in the split decode test; bound 2e-2, 2.7x the
/// worst.
const Q8_0_ATTN_BOUND: f32 = 2e-2;

/// Bound for prompt attention over an f16 cache where P·V runs in bf16 (CPUs with AVX-512
/// BF16): the values and each block's probabilities rounded to 8 significant bits, products
/// summed in f32. Measured max relative error (of the largest output) up to 2.6e-3 in the
/// tiled test (8 f16 cases), 2.9e-3 in the other f16 tests; bound 2e-2, as for q8_0.
const BF16_ATTN_BOUND: f32 = 2e-2;

/// Whether this CPU's prompt attention takes P·V in bf16.
fn bf16_pv() -> bool {
    ember_cpu::simd::with_kernels!(ember_cpu::Isa::detect(), |k| ember_cpu::simd::Kernels::has_bf16(k))
}

/// The bound of an f16-cache attention step of `n_tok` tokens: prompts of 4 or more tokens
/// take the tiled kernel (bf16 P·V where [`bf16_pv`]), fewer the f32 decode kernel.
fn f16_bound(n_tok: usize) -> f32 {
    if n_tok >= 4 && bf16_pv() { BF16_ATTN_BOUND } else { 1e-5 }
}

/// Max relative error of fast-precision attention against the reference for one random case:
/// `[n_head_kv, g, hd, n_tok, pos0, threads]`, K and V rows of `pos0 + n_tok` positions and the
/// queries drawn from `seed` in that order, the queries ×4 (norm ~4·sqrt(hd): scores of a few
/// units, as after the model's q/k norms).
fn attention_error(ty: ember_ops::KvType, [n_head_kv, g, hd, n_tok, pos0, threads]: [usize; 6], seed: &mut u64) -> f32 {
    use ember_ops::{AttnShape, KvRows};
    let ops = CpuOps::new(Precision::Fast, threads);
    let pool = ember_ops::PagePool::unbounded();
    let mut kc = KvRows::new(ty, n_head_kv * hd);
    let mut vc = KvRows::new(ty, n_head_kv * hd);
    kc.push(&random_mat(pos0 + n_tok, n_head_kv * hd, seed), &pool).unwrap();
    vc.push(&random_mat(pos0 + n_tok, n_head_kv * hd, seed), &pool).unwrap();
    let mut q = random_mat(n_tok, g * n_head_kv * hd, seed);
    q.data.iter_mut().for_each(|x| *x *= 4.0);
    let s = AttnShape { n_tok, n_head: g * n_head_kv, n_head_kv, head_dim: hd, pos0, scale: 1.0 / (hd as f32).sqrt() };
    let got = ops.attention_rows(s, &q, &kc, &vc);
    let want = reference::attention(s, &q, &kc, &vc);
    max_rel(&got.data, &want.data)
}

/// The tiled prompt attention (`attention.rs`: blocks of 64 keys, tiles of 64 query vectors,
/// key ranges merged when tiles are fewer than workers) against the reference, over random
/// shapes: 1–3 KV heads, 1–8 query heads each, head sizes 32–256, 4–150 prompt tokens (odd
/// counts, partial tiles and blocks), 0–3000 cached positions before them, 1, 2 or 8 workers,
/// every KV type. Measured max relative error (of the largest output) 2.6e-6 over 24 cases
/// (f32 accumulation over up to ~3150 keys, FMA, the vectorised exp, online softmax; the
/// 8-worker cases with fewer tiles than workers split key ranges); bound 1e-5 as above,
/// [`Q8_0_ATTN_BOUND`] for q8_0 caches (integer scores), and [`BF16_ATTN_BOUND`] for f16 ones
/// on CPUs whose P·V runs in bf16.
#[test]
fn tiled_prompt_attention_matches_reference() {
    use ember_ops::KvType;
    let mut seed = 11;
    let mut worst = 0f32;
    for case in 0..24u64 {
        let mut pick = |n: u64| (lcg(&mut seed).abs() * n as f32) as usize % n as usize;
        let ty = [KvType::F16, KvType::Q8_0, KvType::F32][case as usize % 3];
        let n_head_kv = 1 + pick(3);
        let g = [1, 2, 3, 8][pick(4)];
        let hd = [32, 64, 96, 256][pick(4)];
        let n_tok = 4 + pick(147);
        let pos0 = if case % 4 == 0 { 0 } else { pick(3001) };
        let threads = [1, 2, 8][pick(3)];
        let e = attention_error(ty, [n_head_kv, g, hd, n_tok, pos0, threads], &mut seed);
        eprintln!("tiled attention {ty:?} kv={n_head_kv} g={g} hd={hd} n={n_tok} pos0={pos0} threads={threads}: max rel {e:.1e}");
        let bound = match ty {
            KvType::Q8_0 => Q8_0_ATTN_BOUND,
            KvType::F16 if bf16_pv() => BF16_ATTN_BOUND,
            _ => 1e-5,
        };
        assert!(e < bound, "{ty:?} kv={n_head_kv} g={g} hd={hd} n={n_tok} pos0={pos0} threads={threads}: {e}");
        worst = worst.max(e);
    }
    eprintln!("tiled attention: worst max rel {worst:.1e}");
}

/// Decode steps (1–3 tokens: the per-token kernels, not the tiled one) over random shapes:
/// 1–2 KV heads, 1–8 query heads each (every group size the AVX-512 kernels instantiate),
/// head sizes 32–256 (the q8_0 kernel takes multiples of 64 up to 256, others the generic
/// loop), 1–5000 cached positions, 1, 2 or 3 workers (split ranges), every KV type, queries
/// ×4 as in the tiled test. Measured max relative error (of the largest output) over 40
/// cases: f32 2.3e-6, f16 4.6e-7, q8_0 7.9e-3 (the integer scores': the same with P·V in f32,
/// bf16 or 16-bit integers); bounds 1e-5 and [`Q8_0_ATTN_BOUND`] as above.
#[test]
fn decode_attention_matches_reference() {
    use ember_ops::KvType;
    let mut seed = 17;
    let mut worst = [0f32; 3];
    for case in 0..40u64 {
        let mut pick = |n: u64| (lcg(&mut seed).abs() * n as f32) as usize % n as usize;
        let ti = case as usize % 3;
        let ty = [KvType::F16, KvType::Q8_0, KvType::F32][ti];
        let n_head_kv = 1 + pick(2);
        let g = 1 + (case as usize / 3) % 8;
        let hd = [32, 64, 128, 192, 256][pick(5)];
        let n_tok = 1 + pick(3);
        let pos0 = 1 + pick(5000);
        let threads = 1 + pick(3);
        let e = attention_error(ty, [n_head_kv, g, hd, n_tok, pos0, threads], &mut seed);
        eprintln!("decode attention {ty:?} kv={n_head_kv} g={g} hd={hd} n={n_tok} pos0={pos0} threads={threads}: max rel {e:.1e}");
        let bound = if ty == KvType::Q8_0 { Q8_0_ATTN_BOUND } else { 1e-5 };
        assert!(e < bound, "{ty:?} kv={n_head_kv} g={g} hd={hd} n={n_tok} pos0={pos0} threads={threads}: {e}");
        worst[ti] = worst[ti].max(e);
    }
    eprintln!("decode attention: worst max rel f16 {:.1e}, q8_0 {:.1e}, f32 {:.1e}", worst[0], worst[1], worst[2]);
}

/// Decode over a q8_0 cache with the queries' rounding taken out: each 32-value block of a
/// query is integers times 2^-3 with one of them ±127, and the head sizes (64, 256) make the
/// scale a power of two, so the query quantises exactly and the integer scores match the
/// reference's to f32 rounding; what is left is P·V's (scores of several units: probabilities
/// over a range of ~e^20). Measured max relative error (of the largest output) over 12 cases:
/// 9.6e-5 with the probabilities times the values' d's in 16-bit integers (AVX-512); the
/// kernel before it measured 3.9e-3 with them rounded to bf16 and 1.2e-6 in f32; bound 1e-3.
#[test]
fn q8_0_decode_values_sum_precisely() {
    use ember_ops::{AttnShape, KvRows, KvType};
    let mut seed = 23;
    let mut worst = 0f32;
    for case in 0..12usize {
        let (n_head_kv, g, hd) = ([1, 2][case % 2], [1, 4, 8][case % 3], [64, 256][case / 3 % 2]);
        let (pos0, threads) = ([63, 640, 4097][case % 3], 1 + case % 2);
        let ops = CpuOps::new(Precision::Fast, threads);
        let pool = ember_ops::PagePool::unbounded();
        let mut kc = KvRows::new(KvType::Q8_0, n_head_kv * hd);
        let mut vc = KvRows::new(KvType::Q8_0, n_head_kv * hd);
        kc.push(&random_mat(pos0 + 1, n_head_kv * hd, &mut seed), &pool).unwrap();
        vc.push(&random_mat(pos0 + 1, n_head_kv * hd, &mut seed), &pool).unwrap();
        let mut q = random_mat(1, g * n_head_kv * hd, &mut seed);
        for b in q.data.chunks_exact_mut(32) {
            b.iter_mut().for_each(|x| *x = (*x * 127.0).round() / 8.0);
            b[0] = 127.0 / 8.0;
        }
        let s = AttnShape { n_tok: 1, n_head: g * n_head_kv, n_head_kv, head_dim: hd, pos0, scale: 1.0 / (hd as f32).sqrt() };
        let e = max_rel(&ops.attention_rows(s, &q, &kc, &vc).data, &reference::attention(s, &q, &kc, &vc).data);
        eprintln!("q8_0 decode P·V kv={n_head_kv} g={g} hd={hd} pos0={pos0} threads={threads}: max rel {e:.1e}");
        assert!(e < 1e-3, "kv={n_head_kv} g={g} hd={hd} pos0={pos0} threads={threads}: {e}");
        worst = worst.max(e);
    }
    eprintln!("q8_0 decode P·V: worst max rel {worst:.1e}");
}

/// Decode with more workers than (KV head, token) pairs splits each pair's positions into
/// ranges and merges them (flash-decoding): 8 workers, one KV head, contexts that give 1 to 8
/// ranges (contexts of 1403, 2049 and 3135 split into 5, 8 and 8 ranges of whole pages, the
/// last one partial or empty), every KV type, against
/// the reference. Measured max relative error 2.4e-6 (f32; f16 2.2e-6); bound 1e-5 as above,
/// [`Q8_0_ATTN_BOUND`] for q8_0 (integer scores; 1.8e-3), and [`BF16_ATTN_BOUND`] for the
/// f16 prompt chunks where P·V runs in bf16 (up to 2.7e-3).
#[test]
fn split_decode_attention_matches_reference() {
    use ember_ops::{AttnShape, KvRows, KvType};
    let ops = CpuOps::new(Precision::Fast, 8);
    let mut seed = 5;
    let (n_head, n_head_kv, hd) = (4, 1, 64);
    for ty in [KvType::F16, KvType::F32, KvType::Q8_0] {
        let mut kc = KvRows::new(ty, n_head_kv * hd);
        let mut vc = KvRows::new(ty, n_head_kv * hd);
        let pool = ember_ops::PagePool::unbounded();
        let mut pos = 0;
        for n in [300, 1, 200, 1, 900, 1, 645, 1, 1085, 1] {
            kc.push(&random_mat(n, n_head_kv * hd, &mut seed), &pool).unwrap();
            vc.push(&random_mat(n, n_head_kv * hd, &mut seed), &pool).unwrap();
            let q = random_mat(n, n_head * hd, &mut seed);
            let s = AttnShape { n_tok: n, n_head, n_head_kv, head_dim: hd, pos0: pos, scale: 1.0 / (hd as f32).sqrt() };
            let got = ops.attention_rows(s, &q, &kc, &vc);
            let want = reference::attention(s, &q, &kc, &vc);
            let e = max_rel(&got.data, &want.data);
            eprintln!("split attention {ty:?} n={n} pos0={pos}: max rel {e:.1e}");
            let bound = match ty {
                KvType::Q8_0 => Q8_0_ATTN_BOUND,
                KvType::F16 => f16_bound(n),
                _ => 1e-5,
            };
            assert!(e < bound, "{ty:?} n={n} pos0={pos}: {e}");
            pos += n;
        }
    }
}

/// The per-token ops split across the workers (`ops/prep.rs`) give the reference's bits, for
/// any thread count and token count (one token, a few, a prompt's worth split into parts).
#[test]
fn prep_ops_split_across_workers_match_reference_exactly() {
    use ember_ops::{AttnPrep, DeltaPrep, WeightId};
    let mut seed = 11;
    for threads in [1, 2, 3] {
        let ops = CpuOps::new(Precision::Fast, threads);
        for n in [1, 5, 300] {
            // delta_prep: 3 key heads of 32, 6 value heads of 16.
            let s = DeltaPrep { n_k_head: 3, n_v_head: 6, d_k: 32, d_v: 16, eps: 1e-6, a: WeightId(0), dt_bias: WeightId(1) };
            let (a, dt): (Vec<f32>, Vec<f32>) = ((0..6).map(|_| -lcg(&mut seed).abs()).collect(), (0..6).map(|_| lcg(&mut seed)).collect());
            let cu = random_mat(n, 2 * 3 * 32 + 6 * 16, &mut seed);
            let (b, alpha) = (random_mat(n, 6, &mut seed), random_mat(n, 6, &mut seed));
            let got = ops.delta_prep_mats(&s, &a, &dt, &cu, &b, &alpha);
            assert_eq!(got, reference::delta_prep(&s, &a, &dt, &cu, &b, &alpha), "delta_prep threads={threads} n={n}");

            // route: 64 experts, 8 a token (and k above the expert count); 300 tokens are split.
            let logits = random_mat(n, 64, &mut seed);
            for k in [8, 65] {
                let (got, want) = (ops.route_table(&logits, k), reference::route(&logits, k));
                assert_eq!((got.n_tok, got.k), (want.n_tok, want.k));
                assert_eq!((got.ids, got.weights), (want.ids, want.weights), "route threads={threads} n={n} k={k}");
            }

            // add.
            let (h, x) = (random_mat(n, 96, &mut seed), random_mat(n, 96, &mut seed));
            let (mut got, mut want) = (h.clone(), h);
            ops.add_mat(&mut got, &x);
            reference::add(&mut want, &x);
            assert_eq!(got, want, "add threads={threads} n={n}");

            // attn_prep: 4 query heads of 64 with their gates, 2 KV heads, 32 dims rotated; its
            // norms are rms_norm_vec's (tested above), the split and RoPE the reference's.
            let s = AttnPrep {
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                n_rot: 32,
                rope_base: 1e7,
                eps: 1e-6,
                q_norm: WeightId(0),
                k_norm: WeightId(1),
            };
            let (qn, kn): (Vec<f32>, Vec<f32>) = ((0..64).map(|_| lcg(&mut seed)).collect(), (0..64).map(|_| lcg(&mut seed)).collect());
            let (qg, kx) = (random_mat(n, 2 * 4 * 64, &mut seed), random_mat(n, 2 * 64, &mut seed));
            let pos: Vec<u32> = (0..n as u32).map(|t| 1000 + 7 * t).collect();
            let got = ops.attn_prep_mats(&s, &qn, &kn, &qg, &kx, &pos);
            let (mut q, mut gate) = (Vec::new(), Vec::new());
            for head in qg.data.chunks_exact(2 * 64) {
                q.extend_from_slice(&head[..64]);
                gate.extend_from_slice(&head[64..]);
            }
            let mut q = ops.rms_norm_vec(&Mat::from_vec(n, 4 * 64, q), &qn, s.eps);
            let mut k = ops.rms_norm_vec(&kx, &kn, s.eps);
            reference::rope_at(&mut q, 64, 32, &pos, s.rope_base);
            reference::rope_at(&mut k, 64, 32, &pos, s.rope_base);
            assert_eq!((got.q, got.gate, got.k), (q, Mat::from_vec(n, 4 * 64, gate), k), "attn_prep threads={threads} n={n}");
        }
    }
}
