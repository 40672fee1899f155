//! The expert tier on a GPU: placement changes which side computes a routed expert, never what
//! the model computes. On the tiny fixture models (4 layers of 4 experts, top-2):
//! * every expert on the GPU in another slot order gives bit-identical logits (the slot table
//!   only moves where an expert's rows are read);
//! * experts partly on the CPU ([`Hybrid`]: layer 0 none on the GPU, layer 1 two, layer 2 all,
//!   layer 3 one) give the all-GPU logits within the GPU-vs-CPU kernel bounds, and the same
//!   greedy continuations for 32 tokens while the tier moves experts between steps;
//! * a prompt whose missing experts are uploaded for the batch gives the all-GPU logits bit for
//!   bit (the kernels sum each token's experts in routing order, wherever their rows sit);
//! * a layer split of two Hybrids on one GPU (issue 16's code path) stays within the same bounds,
//!   each part placing and counting only its own layers' experts.
//!
//! With no NVIDIA driver the tests print why and pass (CI has no GPU). The fixtures and the
//! runs of them are `common`'s (paths by `ember_testkit::fixture`).

use std::sync::{Mutex, MutexGuard};

use ember_cuda::ops::MOE_MISS;
use ember_cuda::{CudaOps, Gpu, Precision as CudaPrecision};
use ember_model::{Forward, Logits, Model};
use ember_ops::{ExpertId, KvType, LayerIdx, Ops};
use ember_plan::hybrid::{HeatFile, Hybrid, MissPath, TierOptions};
use ember_plan::split::Split;
use ember_plan::tier::HeatMap;

mod common;
use common::{case_ids, greedy, logits, model};
use ember_testkit::{LogitStats, RefTensor};

/// One GPU test at a time (they share the device's memory).
fn gpu_lock() -> Option<MutexGuard<'static, ()>> {
    static LOCK: Mutex<()> = Mutex::new(());
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    match Gpu::new(0) {
        Ok(_) => Some(g),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn gpu(m: &Model, p: CudaPrecision, resident: Option<Vec<Option<Vec<u16>>>>) -> CudaOps {
    let mut o = CudaOps::with_precision(0, p).unwrap();
    if let Some(r) = resident {
        o.set_resident_experts(r);
    }
    o.register(m.weights().clone()).unwrap();
    o
}

/// The all-position logits of `cases` on `b` against `a`'s, pooled.
fn compare(m: &Model, a: &mut dyn Ops, b: &mut dyn Ops, cases: &[&str]) -> LogitStats {
    let stats: Vec<LogitStats> = cases
        .iter()
        .map(|case| {
            let ids = case_ids(case);
            let want = logits(m, a, &ids);
            let got = logits(m, b, &ids);
            let v = want.len() / ids.len();
            LogitStats::compare(&got, &RefTensor { shape: vec![ids.len(), v], data: want.iter().map(|&x| x as f64).collect() })
        })
        .collect();
    LogitStats::pooled(&stats)
}

/// Layer 0 holds none of its experts, layer 1 two (in reverse order), layer 2 all, layer 3 one.
fn partial() -> Vec<Option<Vec<u16>>> {
    vec![Some(vec![]), Some(vec![3, 1]), None, Some(vec![2])]
}

/// Prompt misses on the CPU (the default Auto would pick per batch by the measured costs).
fn hybrid(m: &Model, p: CudaPrecision, cpu: ember_cpu::Precision) -> Hybrid {
    hybrid_with(m, p, cpu, MissPath::Cpu)
}

fn hybrid_with(m: &Model, p: CudaPrecision, cpu: ember_cpu::Precision, prompt_misses: MissPath) -> Hybrid {
    // The upload path is the download form's: batches up to X_WITH_ROUTING_BYTES (256 tokens
    // of these models) would go to the mailbox, where misses always run on the CPU.
    let mailbox = prompt_misses != MissPath::Upload;
    hybrid_opts(m, p, cpu, TierOptions { half_life: 64.0, prompt_misses, mailbox, ..Default::default() })
}

fn hybrid_opts(m: &Model, p: CudaPrecision, cpu: ember_cpu::Precision, opts: TierOptions) -> Hybrid {
    let ops = CudaOps::with_precision(0, p).unwrap();
    let heat = HeatMap::new(4, 4, 64.0);
    let mut h = Hybrid::new(ops, ember_cpu::CpuOps::new(cpu, 2), partial(), heat, None, opts);
    h.register(m.weights().clone()).unwrap();
    h
}

#[test]
fn another_slot_order_gives_the_same_logits_bit_for_bit() {
    let Some(_g) = gpu_lock() else { return };
    // Reversed slots in every layer; Fast takes the grouped tensor-core MoE for the 130-token
    // prompt (more than 48 tokens) and the GEMV MoE for decode, Exact the GEMV MoE for both.
    let reversed = || (0..4).map(|_| Some(vec![3, 2, 1, 0])).collect::<Vec<_>>();
    for q in ["BF16", "Q4_K_M"] {
        let m = model(q);
        for p in [CudaPrecision::Exact, CudaPrecision::Fast] {
            let mut a = gpu(&m, p, None);
            let mut b = gpu(&m, p, Some(reversed()));
            assert_eq!(b.slot_experts(LayerIdx(1)), Some(&[3u16, 2, 1, 0][..]));
            for case in ["p5", "p130"] {
                let ids = case_ids(case);
                let (x, y) = (logits(&m, &mut a, &ids), logits(&m, &mut b, &ids));
                assert!(x == y, "{q} {p:?} {case}: logits differ with reversed slots");
            }
            assert_eq!(greedy(&m, &mut a, &case_ids("g_p37"), 16), greedy(&m, &mut b, &case_ids("g_p37"), 16), "{q} {p:?}");
            println!("{q} {p:?}: reversed slots: logits and greedy tokens bit-identical");
        }
    }
}

/// Bounds on the logits of the hybrid against the all-GPU run, both at Exact: the misses run the
/// CPU backend's exact kernels, so the bound is tests/model.rs's GPU-vs-CPU bound with F32 KV
/// rows (2e-5 / 2e-4; measured there 2.7e-6 / 2.9e-5).
const EXACT_BOUNDS: (f64, f64) = (2e-5, 2e-4);

#[test]
fn experts_on_the_cpu_give_the_gpu_logits_and_greedy_tokens() {
    let Some(_g) = gpu_lock() else { return };
    for q in ["BF16", "Q8_0", "Q6_K", "Q4_K_M"] {
        let m = model(q);
        let mut all = gpu(&m, CudaPrecision::Exact, None);
        let mut h = hybrid(&m, CudaPrecision::Exact, ember_cpu::Precision::Exact);
        let s = compare(&m, &mut all, &mut h, &["p1", "p37", "p130", "rand50"]);
        let t = h.stats();
        println!(
            "{q}: hybrid vs all-GPU (exact): max rel {:.2e}, max abs {:.2e}, top-1 {:.3}; pairs on the GPU {} on the CPU {} (hit rate {:.2}), uploads {}",
            s.max_rel(),
            s.max_abs,
            s.top1,
            t.hits,
            t.misses,
            t.hit_rate(),
            t.uploads
        );
        assert!(s.max_rel() <= EXACT_BOUNDS.0 && s.max_abs <= EXACT_BOUNDS.1, "{q}: beyond {EXACT_BOUNDS:?}");
        assert_eq!(s.top1, 1.0, "{q}: the argmax differs");
        assert!(t.misses > 0 && t.hits > 0, "{q}: both sides computed pairs: {t:?}");
        for case in ["g_chat", "g_p37"] {
            let ids = case_ids(case);
            let before = h.stats().uploads;
            let want = greedy(&m, &mut all, &ids, 32);
            let got = greedy(&m, &mut h, &ids, 32);
            let moved = h.stats().uploads - before;
            println!(
                "{q} {case}: greedy equal for {}/32 tokens, {moved} experts moved onto the GPU meanwhile",
                got.iter().zip(&want).take_while(|(a, b)| a == b).count()
            );
            assert_eq!(got, want, "{q} {case}: greedy continuation differs from the all-GPU run");
        }
        assert!(h.stats().uploads > 0, "{q}: the tier moved no expert: {:?}", h.stats());
        // Layer 2 holds all its experts and is never the tier's; the others keep their slot counts.
        assert_eq!(h.resident(LayerIdx(2)), None);
        assert_eq!(h.resident(LayerIdx(1)).map(|r| r.len()), Some(2));
        assert_eq!(h.resident(LayerIdx(0)).map(|r| r.len()), Some(0));
    }
}

/// Fast precision: the GPU's Fast path (f32 activations for decode, f16 tensor-core tiles for
/// the 130-token prompt, the grouped MoE leaving the misses out) with the CPU's Fast path for the
/// misses, which quantises activations to 8 bits as llama.cpp does, against the all-GPU Fast run.
/// So the distance is that of an int8-activation backend, not the GPU-vs-CPU exact bound: on the
/// H200 (2026-12-04) Q8_0 gave median rel 8.2e-3, top-1 0.988 (max rel 1.2e-1 at a position with
/// small logits). Bounds: median at most 2e-2 and top-1 at least 0.95, i.e. no further from the
/// all-GPU run than llama.cpp's own default path is from the f64 references on these files
/// (median 2.1e-2 to 3.3e-2, top-1 0.926 to 0.949: tests/references.rs of ember-cuda).
#[test]
fn experts_on_the_cpu_at_fast_precision_stay_close() {
    let Some(_g) = gpu_lock() else { return };
    for q in ["Q8_0", "Q4_K_M"] {
        let m = model(q);
        let mut all = gpu(&m, CudaPrecision::Fast, None);
        let mut h = hybrid(&m, CudaPrecision::Fast, ember_cpu::Precision::Fast);
        let s = compare(&m, &mut all, &mut h, &["p37", "p130"]);
        let p50 = s.percentile(50.0);
        println!(
            "{q}: hybrid vs all-GPU (fast): max rel {:.2e}, p50 rel {p50:.2e}, max abs {:.2e}, top-1 {:.3}",
            s.max_rel(),
            s.max_abs,
            s.top1
        );
        assert!(p50 <= 2e-2 && s.top1 >= 0.95, "{q}: median {p50:e} or top-1 {} beyond the bounds", s.top1);
    }
}

#[test]
fn prompt_experts_uploaded_for_the_batch_give_the_same_logits_bit_for_bit() {
    let Some(_g) = gpu_lock() else { return };
    for q in ["BF16", "Q4_K_M"] {
        let m = model(q);
        for p in [CudaPrecision::Exact, CudaPrecision::Fast] {
            let mut all = gpu(&m, p, None);
            let cpu = if p == CudaPrecision::Exact { ember_cpu::Precision::Exact } else { ember_cpu::Precision::Fast };
            let mut h = hybrid_with(&m, p, cpu, MissPath::Upload);
            for case in ["p37", "p130"] {
                let ids = case_ids(case);
                let (x, y) = (logits(&m, &mut all, &ids), logits(&m, &mut h, &ids));
                assert!(x == y, "{q} {p:?} {case}: logits differ with the misses uploaded for the batch");
            }
            let t = h.stats();
            println!(
                "{q} {p:?}: misses uploaded for the batch: {} pairs, {} bytes; logits bit-identical; cost model {:?}",
                t.streamed_pairs,
                t.streamed_bytes,
                h.cost_model()
            );
            assert!(t.streamed_pairs > 0 && t.streamed_pairs == t.misses, "{q} {p:?}: every miss of the prompts went up: {t:?}");
        }
    }
}

/// Experts moved in on the copy stream (`place_expert`, then `finish_uploads`): until the
/// upload is seen done the incoming expert and the evicted one are both out of the slot table,
/// and afterwards the layer computes exactly what a layer registered with that final set does:
/// logits bit for bit (Exact and Fast, BF16 and Q4_K_M; the missing expert adds nothing on
/// either side, these are CudaOps alone).
#[test]
fn experts_uploaded_on_the_copy_stream_give_a_registered_layers_logits() {
    let Some(_g) = gpu_lock() else { return };
    for q in ["BF16", "Q4_K_M"] {
        let m = model(q);
        for p in [CudaPrecision::Exact, CudaPrecision::Fast] {
            let mut moved = gpu(&m, p, Some(vec![Some(vec![0, 1, 2]); 4]));
            for l in 0..4u16 {
                let layer = LayerIdx(l);
                moved.place_expert(layer, 0, ExpertId(3)).unwrap();
                assert_eq!(moved.expert_slots(layer).unwrap()[..], [MOE_MISS, 1, 2, MOE_MISS], "{q} {p:?} {layer}: 0 left, 3 not in yet");
                assert!(moved.place_expert(layer, 0, ExpertId(0)).is_err(), "the slot is on its way");
                moved.place_expert(layer, 1, ExpertId(0)).unwrap();
                assert_eq!(moved.uploading(layer), [(0, 3), (1, 0)]);
            }
            assert_eq!(moved.finish_uploads(true).unwrap(), 8);
            assert_eq!(moved.expert_slots(LayerIdx(2)).unwrap()[..], [1, MOE_MISS, 2, 0]);
            let mut registered = gpu(&m, p, Some(vec![Some(vec![3, 0, 2]); 4]));
            for case in ["p5", "p130"] {
                let ids = case_ids(case);
                let (x, y) = (logits(&m, &mut registered, &ids), logits(&m, &mut moved, &ids));
                assert!(x == y, "{q} {p:?} {case}: logits differ after the uploads");
            }
            println!("{q} {p:?}: 8 experts moved in on the copy stream: logits bit-identical to the registered layers");
        }
    }
}

/// The prompt's logits and each greedy decode step's, `n` steps.
fn decode_logits(m: &Model, ops: &mut dyn Ops, ids: &[u32], n: usize) -> Vec<Vec<f32>> {
    m.configure_store(ops, KvType::F32, 1, ids.len() + n + 8, 0).unwrap();
    let mut st = m.new_state(ops, ids.len() + n + 8).unwrap();
    let mut l = m.forward(ops, ids, &mut st, Forward { logits: Some(Logits::All), ..Default::default() }).unwrap();
    let mut out = vec![l.data.clone()];
    for _ in 0..n {
        let last = &l.data[l.data.len() - l.d..];
        let t = ember_testkit::argmax(last.iter().map(|&x| x as f64)) as u32;
        l = m.forward(ops, &[t], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
        out.push(l.data.clone());
    }
    out
}

/// The mailbox form (routing published by the GPU, the host answering only layers with misses)
/// and the download form (routing brought down and waited for in every partial layer) compute
/// the same pairs on the same sides and add the CPU's sum in the same f32 add: the prompts'
/// logits (37 and 130 tokens, mailboxes too on these models: x of 130 × 256 floats is under
/// X_WITH_ROUTING_BYTES) and 24 decode steps' are equal bit for bit, with the same hit and miss
/// counts. The tier moves experts between steps in both the same way (same heat).
#[test]
fn mailbox_and_download_forms_give_the_same_logits_bit_for_bit() {
    let Some(_g) = gpu_lock() else { return };
    for q in ["BF16", "Q4_K_M"] {
        let m = model(q);
        for (p, cpu) in [(CudaPrecision::Exact, ember_cpu::Precision::Exact), (CudaPrecision::Fast, ember_cpu::Precision::Fast)] {
            let opts = |mailbox| TierOptions { half_life: 64.0, prompt_misses: MissPath::Cpu, mailbox, ..Default::default() };
            let mut posted = hybrid_opts(&m, p, cpu, opts(true));
            let mut waited = hybrid_opts(&m, p, cpu, opts(false));
            for case in ["g_p37", "p130"] {
                let ids = case_ids(case);
                let (a, b) = (decode_logits(&m, &mut posted, &ids, 24), decode_logits(&m, &mut waited, &ids, 24));
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(x == y, "{q} {p:?} {case}: logits of step {i} differ between the mailbox and download forms");
                }
            }
            let (s, t) = (posted.stats(), waited.stats());
            assert_eq!((s.hits, s.misses, s.uploads), (t.hits, t.misses, t.uploads), "{q} {p:?}");
            assert!(s.misses > 0 && s.hits > 0, "{q} {p:?}: both sides computed pairs: {s:?}");
            println!(
                "{q} {p:?}: mailbox = download form bit for bit; pairs on the GPU {} on the CPU {}, uploads {}",
                s.hits, s.misses, s.uploads
            );
        }
    }
}

/// Layers shrunk and grown on the device (what the pressure watch does): a layer holding every
/// expert shrinks to two, a layer of two grows to three (one kept, two uploaded); the logits stay
/// within the exact bounds of the all-GPU run.
#[test]
fn layers_shrunk_and_grown_keep_the_logits() {
    let Some(_g) = gpu_lock() else { return };
    let m = model("Q4_K_M");
    let mut all = gpu(&m, CudaPrecision::Exact, None);
    let mut h = hybrid(&m, CudaPrecision::Exact, ember_cpu::Precision::Exact);
    h.set_layer(LayerIdx(2), vec![3, 1]);
    h.set_layer(LayerIdx(1), vec![0, 1, 2]);
    let mut held1 = h.resident(LayerIdx(1)).unwrap();
    held1.sort_unstable();
    assert_eq!(held1, [0, 1, 2]);
    assert_eq!(h.resident(LayerIdx(2)).map(|r| r.len()), Some(2));
    let s = compare(&m, &mut all, &mut h, &["p130"]);
    println!("shrunk/grown layers vs all-GPU: max rel {:.2e}, max abs {:.2e}, top-1 {:.3}", s.max_rel(), s.max_abs, s.top1);
    assert!(s.max_rel() <= EXACT_BOUNDS.0 && s.max_abs <= EXACT_BOUNDS.1 && s.top1 == 1.0);
}

/// Issue 16's two GPUs, run on one: a layer split ([`Split`]) of two Hybrids, each given only
/// its layers' weights (part 0 layers 0-1: layer 0 none of its experts, layer 1 two; part 1
/// layers 2-3: layer 2 all, layer 3 one, as `partial()` has them), against the all-GPU run:
/// within the exact bounds above, the same greedy continuations for 32 tokens while each
/// part's tier moves its own layers' experts, each part counting only its own layers, part 0
/// holding no weight of layer 2, and the heat file holding both parts' rows after both saved.
#[test]
fn two_hybrid_parts_on_one_gpu_keep_the_logits_and_their_own_layers() {
    let Some(_g) = gpu_lock() else { return };
    let dir = std::env::temp_dir().join(format!("ember-split-heat-{}", std::process::id()));
    let file = HeatFile { path: dir.join("heat.json"), model_key: "tiny".into() };
    let part = |resident: Vec<Option<Vec<u16>>>| -> Box<dyn Ops> {
        let ops = CudaOps::with_precision(0, CudaPrecision::Exact).unwrap();
        let opts = TierOptions { half_life: 64.0, prompt_misses: MissPath::Cpu, ..Default::default() };
        let cpu = ember_cpu::CpuOps::new(ember_cpu::Precision::Exact, 2);
        Box::new(Hybrid::new(ops, cpu, resident, HeatMap::new(4, 4, 64.0), Some(file.clone()), opts))
    };
    for q in ["BF16", "Q4_K_M"] {
        let _ = std::fs::remove_file(&file.path);
        let m = model(q);
        let mut all = gpu(&m, CudaPrecision::Exact, None);
        let p0 = part(vec![Some(vec![]), Some(vec![3, 1]), None, None]);
        let p1 = part(vec![None, None, None, Some(vec![2])]);
        let mut s = Split::new(vec![p0, p1], vec![0, 0, 1, 1]).unwrap();
        s.register(m.weights().clone()).unwrap();
        let w = m.weights().ids().find(|&id| m.weights().info(id).unwrap().name.starts_with("blk.2.")).unwrap();
        let x = s.parts_mut()[0].upload(&ember_ops::Mat::zeros(1, m.weights().info(w).unwrap().k)).unwrap();
        let e = s.parts_mut()[0].matmul(w, x).unwrap_err();
        assert!(e.to_string().contains("not registered"), "{q}: part 0 holds layer 2's weight: {e}");
        let st = compare(&m, &mut all, &mut s, &["p1", "p37", "p130", "rand50"]);
        println!(
            "{q}: two Hybrid parts vs all-GPU (exact): max rel {:.2e}, max abs {:.2e}, top-1 {:.3}",
            st.max_rel(),
            st.max_abs,
            st.top1
        );
        assert!(st.max_rel() <= EXACT_BOUNDS.0 && st.max_abs <= EXACT_BOUNDS.1 && st.top1 == 1.0, "{q}: beyond {EXACT_BOUNDS:?}");
        for case in ["g_chat", "g_p37"] {
            let ids = case_ids(case);
            assert_eq!(greedy(&m, &mut s, &ids, 32), greedy(&m, &mut all, &ids, 32), "{q} {case}: greedy differs from the all-GPU run");
        }
        let t = s.expert_stats().unwrap();
        println!("{q}: pairs on the GPUs {}, on the CPU {}, uploads {}", t.hits, t.misses, t.uploads);
        assert!(t.hits > 0 && t.misses > 0 && t.uploads > 0, "{q}: {t:?}");
        // Each layer the tier manages is counted once, by its own part (layer 2 holds all its
        // experts and is nobody's to count).
        let mut layers: Vec<u16> = s.expert_layer_stats().iter().map(|c| c.0.0).collect();
        layers.sort_unstable();
        assert_eq!(layers, [0, 1, 3], "{q}");
        drop(s);
        let heat = HeatMap::load(&file.path, "tiny", 4, 4, 64.0).unwrap();
        let row = |l: usize| (0..4).map(|e| heat.get(l, e)).sum::<f64>();
        assert!(row(0) > 0.0 && row(1) > 0.0 && row(3) > 0.0, "{q}: both parts' rows: {heat:?}");
        assert_eq!(row(2), 0.0, "{q}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
