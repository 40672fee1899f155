//! Synthetic models: the file round-trips, the model runs with finite, bounded activations, and
//! the router skew does what `ember.synthetic.skew` says.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_cpu::Precision;
use ember_gguf::{GgmlType, GgufFile};
use ember_model::{Forward, Logits, Model};
use ember_ops::{KvType, Mat, Ops};
use ember_synth::{Plan, Recipe, Shape, SynthOptions};

fn vocab() -> GgufFile {
    GgufFile::open(ember_synth::DEFAULT_VOCAB).expect("vocab fixture")
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write(opts: SynthOptions, path: &Path) -> Plan {
    let plan = Plan::new(opts, &vocab()).unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    ember_synth::write(&plan, &mut f, &mut |_, _| {}).unwrap();
    drop(f);
    plan
}

fn tiny(recipe: Recipe, skew: f32, mtp: bool) -> SynthOptions {
    let mut shape = Shape::preset("tiny").unwrap();
    shape.n_layer_mtp = mtp as usize;
    SynthOptions { shape, recipe, seed: 42, skew, preset: "tiny".into() }
}

#[test]
fn round_trip_shapes_types_and_tokenizer() {
    for (recipe, mtp) in [(Recipe::Q4KM, true), (Recipe::BF16, false), (Recipe::UdQ4KM, false)] {
        let path = tmp(&format!("rt-{}.gguf", recipe.name()));
        let plan = write(tiny(recipe, 0.5, mtp), &path);
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.tensors().len(), plan.tensors.len());
        for (got, want) in f.tensors().iter().zip(&plan.tensors) {
            assert_eq!(got.name, want.spec.name);
            assert_eq!(got.ggml_type, want.spec.ggml_type, "{}", got.name);
            assert_eq!(got.shape(), want.spec.ne, "{}", got.name);
        }
        // Types as asked: routers, conv and 1-D tensors F32; Q4_K_M's Q6_K picks.
        let ty = |n: &str| f.tensor(n).unwrap_or_else(|| panic!("{n}")).ggml_type;
        assert_eq!(ty("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.ssm_conv1d.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.ssm_a"), GgmlType::F32);
        match recipe {
            Recipe::Q4KM => {
                assert_eq!(ty("output.weight"), GgmlType::Q6K);
                assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
                // more_bits(i, 5): layers 2 and 4
                assert_eq!(ty("blk.0.ffn_down_exps.weight"), GgmlType::Q4K);
                assert_eq!(ty("blk.2.ffn_down_exps.weight"), GgmlType::Q6K);
                assert_eq!(ty("blk.2.attn_qkv.weight"), GgmlType::Q6K);
                assert_eq!(ty("blk.0.ffn_gate_exps.weight"), GgmlType::Q4K);
                assert_eq!(ty("blk.4.nextn.eh_proj.weight"), GgmlType::Q4K);
                assert_eq!(f.get_u32("qwen35moe.block_count").unwrap(), 5);
                assert_eq!(f.get_u32("qwen35moe.nextn_predict_layers").unwrap(), 1);
            }
            Recipe::BF16 => assert_eq!(ty("blk.0.attn_qkv.weight"), GgmlType::BF16),
            _ => assert_eq!(ty("blk.0.attn_qkv.weight"), GgmlType::Q8_0),
        }
        // The real tokenizer, and the synthetic keys.
        assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().len(), 248_320);
        assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "qwen35");
        assert!(f.get("tokenizer.chat_template").is_some());
        let tok = ember_tokenizer::Tokenizer::from_gguf(&f).unwrap();
        let want = ember_tokenizer::Tokenizer::from_gguf(&vocab()).unwrap();
        let text = "Hello, world! 日本語のテキスト def f(x): return x";
        assert_eq!(tok.encode(text, false), want.encode(text, false));
        assert_eq!(f.get_str("ember.synthetic.recipe").unwrap(), recipe.name());
        assert_eq!(f.get_f32("ember.synthetic.skew").unwrap(), 0.5);
        assert_eq!(f.get_u64("ember.synthetic.seed").unwrap(), 42);
        assert_eq!(f.file_len(), std::fs::metadata(&path).unwrap().len());
        drop(f);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn same_seed_same_bytes_any_thread_count() {
    let (a, b) = (tmp("det-a.gguf"), tmp("det-b.gguf"));
    rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| write(tiny(Recipe::Q8_0, 1.0, false), &a));
    rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap().install(|| write(tiny(Recipe::Q8_0, 1.0, false), &b));
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
    std::fs::remove_file(a).unwrap();
    std::fs::remove_file(b).unwrap();
}

/// Per-layer hidden RMS and an expert-selection histogram of a model on real text.
pub struct Probe {
    pub rms: Vec<f64>,
    /// counts[layer][expert], from the router applied to the layer's input stream (the tap
    /// shows layer outputs only; the mixer's share of the stream is small, see the test).
    pub counts: Vec<Vec<usize>>,
    pub logits: Mat,
}

pub fn probe(path: &Path, text: &str, n_tok: usize) -> Probe {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let model = Model::load(file.clone(), |_, _| {}).unwrap();
    let c = model.config.clone();
    let tok = ember_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let mut ids = tok.encode(text, false);
    while ids.len() < n_tok {
        ids.extend_from_within(..);
    }
    ids.truncate(n_tok);
    let mut ops = ember_cpu::backend(Precision::Fast, 0);
    ops.register(model.weights().clone()).unwrap();
    model.configure_store(&mut ops, KvType::F16, 1, ids.len() + 1, 0).unwrap();
    let mut st = model.new_state(&mut ops, ids.len() + 1).unwrap();
    let mut hs: Vec<Mat> = Vec::new();
    let logits = {
        let mut tap = |name: &str, _i: usize, m: &Mat| {
            if name == "embd" || name == "layer_out" {
                hs.push(m.clone());
            }
        };
        model.forward(&mut ops, &ids, &mut st, Forward { logits: Some(Logits::All), tap: Some(&mut tap), ..Default::default() }).unwrap()
    };
    let rms = hs.iter().map(|h| (h.data.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / h.data.len() as f64).sqrt()).collect();
    let mut counts = vec![vec![0usize; c.n_expert]; c.n_layer];
    for l in 0..c.n_layer {
        let t = file.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).unwrap();
        let mut w = vec![0f32; t.n_elements() as usize];
        ember_gguf::quant::dequantize(t.ggml_type, file.tensor_data(t), &mut w).unwrap();
        let h = &hs[l];
        for r in 0..h.n {
            let x = h.row(r);
            let ms = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
            let mut logit: Vec<(f64, usize)> = (0..c.n_expert)
                .map(|e| (w[e * c.n_embd..(e + 1) * c.n_embd].iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / ms, e))
                .collect();
            logit.sort_by(|a, b| b.0.total_cmp(&a.0));
            for &(_, e) in &logit[..c.n_expert_used] {
                counts[l][e] += 1;
            }
        }
    }
    Probe { rms, counts, logits }
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog. Gated DeltaNet layers carry a recurrent state; \
    full-attention layers keep a KV cache. 日本語のテキストを正しく分割できますか？ def fib(n): return n if n < 2 else fib(n-1) + fib(n-2)";

#[test]
fn tiny_runs_with_finite_bounded_activations() {
    let path = tmp("fwd.gguf");
    write(tiny(Recipe::Q8_0, 0.0, false), &path);
    let p = probe(&path, TEXT, 96);
    eprintln!("hidden rms by layer: {:?}", p.rms);
    assert!(p.logits.data.iter().all(|x| x.is_finite()));
    assert!(p.rms.iter().all(|r| r.is_finite() && *r > 0.5 && *r < 8.0), "{:?}", p.rms);
    let n = p.logits.data.len() as f64;
    let mean = p.logits.data.iter().map(|x| *x as f64).sum::<f64>() / n;
    let std = (p.logits.data.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    eprintln!("logit std {std:.3}");
    assert!((1.0..5.0).contains(&std), "logit std {std}");
    std::fs::remove_file(path).unwrap();
}

/// Share of selections taken by the most popular `n_top` experts, per layer, averaged.
fn top_share(counts: &[Vec<usize>], n_top: usize) -> f64 {
    let mut s = 0.0;
    for c in counts {
        let mut v = c.clone();
        v.sort_unstable_by(|a, b| b.cmp(a));
        s += v[..n_top].iter().sum::<usize>() as f64 / v.iter().sum::<usize>() as f64;
    }
    s / counts.len() as f64
}

#[test]
fn skew_concentrates_routing_on_the_popular_experts() {
    let path = tmp("skew.gguf");
    let mut shares = Vec::new();
    for skew in [0.0f32, 1.0, 2.0] {
        let plan = write(tiny(Recipe::Q8_0, skew, false), &path);
        let p = probe(&path, TEXT, 128);
        // The experts the generator made popular must be the ones routed to most.
        let rank0 = ember_synth::expert_rank(&plan, 0);
        let hot = (0..8).find(|&e| rank0[e] == 0).unwrap();
        let share = top_share(&p.counts, 2);
        eprintln!(
            "skew {skew}: top-2 of 8 experts take {:.3} of selections; layer 0 counts {:?}, hottest by design {hot}",
            share, p.counts[0]
        );
        if skew >= 1.0 {
            let max = *p.counts[0].iter().max().unwrap();
            assert_eq!(p.counts[0][hot], max, "skew {skew}: expert {hot} should be the most routed");
        }
        shares.push(share);
    }
    assert!(shares[0] < 0.45, "uniform routing too concentrated: {shares:?}");
    assert!(shares[0] < shares[1] && shares[1] < shares[2], "{shares:?}");
    std::fs::remove_file(path).unwrap();
}

/// Run on any synthetic file: `EMBER_SYNTH_FILE=x.gguf cargo test -p ember-synth --release -- --ignored probe_file --nocapture`.
#[test]
#[ignore]
fn probe_file() {
    let Ok(path) = std::env::var("EMBER_SYNTH_FILE") else { return };
    let n: usize = std::env::var("EMBER_SYNTH_TOKENS").ok().and_then(|s| s.parse().ok()).unwrap_or(64);
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/corpus/corpus.txt")).unwrap();
    let p = probe(Path::new(&path), &text, n);
    println!("hidden rms (embd, then each layer): {:?}", p.rms.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>());
    println!("logits finite: {}", p.logits.data.iter().all(|x| x.is_finite()));
    let n_e = p.counts[0].len();
    for k in [1usize, n_e / 32, n_e / 8] {
        if k > 0 {
            println!("top-{k} of {n_e} experts take {:.3} of selections (uniform: {:.3})", top_share(&p.counts, k), k as f64 / n_e as f64);
        }
    }
    let mut sorted = p.counts[0].clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    println!("layer 0 counts, sorted: {:?}", &sorted[..sorted.len().min(32)]);
}
