use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use ember_gguf::{GgufFile, Value};
use ember_model::{Config, TensorGroup};
use serde_json::{Map, json};

use crate::load;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file (default: the bundled demo model).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let file = load::open_gguf(a.model.as_deref())?;
    let mut report = report(&file);
    report["gpus"] = crate::device::gpu_report();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    Ok(())
}

fn report(f: &GgufFile) -> serde_json::Value {
    let config = Config::from_gguf(f);
    let n_layer = match &config {
        Ok(c) => c.n_layer,
        Err(_) => usize::MAX,
    };
    let mut metadata = Map::new();
    for (k, v) in f.metadata() {
        if k == "tokenizer.chat_template" {
            metadata.insert(k.clone(), json!(format!("<{} bytes of Jinja>", v.as_str().map_or(0, str::len))));
            continue;
        }
        metadata.insert(k.clone(), value_json(v));
    }
    let tensors: Vec<_> = f
        .tensors()
        .iter()
        .map(|t| json!({ "name": t.name, "type": t.ggml_type.name(), "shape": t.shape(), "bytes": t.n_bytes, "group": TensorGroup::of(&t.name, n_layer).name() }))
        .collect();
    // bytes[group][type]
    let mut groups: BTreeMap<TensorGroup, BTreeMap<String, u64>> = BTreeMap::new();
    for t in f.tensors() {
        *groups.entry(TensorGroup::of(&t.name, n_layer)).or_default().entry(t.ggml_type.name().to_owned()).or_default() += t.n_bytes;
    }
    let groups_json: Map<String, serde_json::Value> = groups
        .iter()
        .map(|(g, by_type)| (g.name().to_owned(), json!({ "bytes": by_type.values().sum::<u64>(), "by_type": by_type })))
        .collect();
    json!({
        "file": { "bytes": f.file_len(), "gguf_version": f.version(), "alignment": f.alignment(), "n_tensors": f.tensors().len(), "n_kv": f.metadata().len() },
        "architecture": f.get_str("general.architecture").ok(),
        "config": match &config { Ok(c) => config_json(c), Err(e) => json!({ "error": e.to_string() }) },
        "tokenizer": tokenizer_json(f),
        "bytes_by_group": groups_json,
        "metadata": metadata,
        "tensors": tensors,
    })
}

fn config_json(c: &Config) -> serde_json::Value {
    let kinds: String = c.layer_kinds.iter().map(|k| if *k == ember_model::LayerKind::Attention { 'A' } else { 'D' }).collect();
    json!({
        "n_vocab": c.n_vocab, "n_ctx_train": c.n_ctx_train, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_layer_mtp": c.n_layer_mtp,
        "layers": kinds, "n_attention_layers": c.n_attention_layers(), "rms_eps": c.rms_eps,
        "attention": { "n_head": c.n_head, "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "n_rot": c.n_rot, "rope_base": c.rope_base },
        "deltanet": { "n_k_head": c.n_k_head, "n_v_head": c.n_v_head, "d_k": c.d_k, "d_v": c.d_v, "conv_kernel": c.conv_kernel },
        "moe": { "n_expert": c.n_expert, "n_expert_used": c.n_expert_used, "n_ff_exp": c.n_ff_exp, "n_ff_shexp": c.n_ff_shexp },
    })
}

fn tokenizer_json(f: &GgufFile) -> serde_json::Value {
    let Ok(tokens) = f.get_array("tokenizer.ggml.tokens") else { return json!(null) };
    let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
    if let Ok(types) = f.get_int_array("tokenizer.ggml.token_type") {
        for t in types {
            let name = match t {
                1 => "normal",
                2 => "unknown",
                3 => "control",
                4 => "user_defined",
                5 => "unused",
                6 => "byte",
                _ => "other",
            };
            *by_type.entry(name).or_default() += 1;
        }
    }
    let id = |k: &str| f.get_u32(k).ok();
    json!({
        "model": f.get_str("tokenizer.ggml.model").ok(),
        "pre": f.get_str("tokenizer.ggml.pre").ok(),
        "n_tokens": tokens.len(),
        "n_merges": f.get_array("tokenizer.ggml.merges").map(|m| m.len()).ok(),
        "by_type": by_type,
        "bos": id("tokenizer.ggml.bos_token_id"), "eos": id("tokenizer.ggml.eos_token_id"), "pad": id("tokenizer.ggml.padding_token_id"),
        "add_bos": f.get_bool("tokenizer.ggml.add_bos_token").ok(),
        "chat_template": f.get("tokenizer.chat_template").is_some(),
    })
}

fn value_json(v: &Value) -> serde_json::Value {
    match v {
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(t, items) if items.len() > 16 => json!(format!("[{} x {t:?}]", items.len()).to_lowercase()),
        Value::Array(_, items) => serde_json::Value::Array(items.iter().map(value_json).collect()),
        other => other.as_int().map_or(serde_json::Value::Null, |i| json!(i as i64)),
    }
}

fn print_text(r: &serde_json::Value) {
    let file = &r["file"];
    println!(
        "file: {} bytes ({:.2} GiB), GGUF v{}, {} tensors, {} metadata keys",
        file["bytes"],
        gib(&file["bytes"]),
        file["gguf_version"],
        file["n_tensors"],
        file["n_kv"]
    );
    println!("architecture: {}", r["architecture"].as_str().unwrap_or("(none)"));
    match r["gpus"].as_array() {
        Some(gpus) if !gpus.is_empty() => {
            for g in gpus {
                println!(
                    "gpu {}: {} (compute {}), {:.2} GiB free of {:.2} GiB",
                    g["index"],
                    g["name"].as_str().unwrap_or("?"),
                    g["compute_capability"].as_str().unwrap_or("?"),
                    gib(&g["free_bytes"]),
                    gib(&g["total_bytes"])
                );
            }
        }
        Some(_) => println!("gpus: none"),
        None => println!("gpus: none ({})", r["gpus"]["error"].as_str().unwrap_or("unknown")),
    }
    println!("\nhyper-parameters:");
    match r["config"].get("error") {
        Some(e) => println!("  (not loadable as a model: {})", e.as_str().unwrap_or("")),
        None => print_tree(&r["config"], 2),
    }
    println!("\ntokenizer:");
    if r["tokenizer"].is_null() {
        println!("  (none)");
    } else {
        print_tree(&r["tokenizer"], 2);
    }
    let synthetic: Vec<_> = r["metadata"].as_object().into_iter().flatten().filter(|(k, _)| k.starts_with("ember.synthetic.")).collect();
    if !synthetic.is_empty() {
        println!("\nsynthetic model (ember synth: random weights, real tokenizer; for speed measurement only):");
        for (k, v) in synthetic {
            println!("  {} = {}", k.trim_start_matches("ember.synthetic."), compact(v));
        }
    }
    println!("\nmetadata:");
    for (k, v) in r["metadata"].as_object().into_iter().flatten() {
        if k.starts_with("tokenizer.ggml.") && v.is_string() && v.as_str().is_some_and(|s| s.starts_with('[')) {
            println!("  {k} = {}", v.as_str().unwrap_or(""));
        } else {
            println!("  {k} = {}", compact(v));
        }
    }
    println!("\n{:<48} {:<7} {:<22} {:>14}  group", "tensor", "type", "shape", "bytes");
    for t in r["tensors"].as_array().into_iter().flatten() {
        println!(
            "{:<48} {:<7} {:<22} {:>14}  {}",
            t["name"].as_str().unwrap_or(""),
            t["type"].as_str().unwrap_or(""),
            compact(&t["shape"]),
            t["bytes"],
            t["group"].as_str().unwrap_or("")
        );
    }
    println!("\nbytes by group and type:");
    let total: f64 = r["bytes_by_group"].as_object().into_iter().flatten().map(|(_, g)| g["bytes"].as_f64().unwrap_or(0.0)).sum();
    for (g, v) in r["bytes_by_group"].as_object().into_iter().flatten() {
        let b = v["bytes"].as_f64().unwrap_or(0.0);
        println!("  {g:<16} {:>16} B  {:>9.3} GiB  {:>5.1}%", v["bytes"], b / 1073741824.0, 100.0 * b / total.max(1.0));
        for (t, n) in v["by_type"].as_object().into_iter().flatten() {
            println!("      {t:<10} {:>16} B  {:>9.3} GiB", n, n.as_f64().unwrap_or(0.0) / 1073741824.0);
        }
    }
}

fn print_tree(v: &serde_json::Value, indent: usize) {
    for (k, x) in v.as_object().into_iter().flatten() {
        if x.is_object() {
            println!("{:indent$}{k}:", "");
            print_tree(x, indent + 2);
        } else {
            println!("{:indent$}{k}: {}", "", compact(x));
        }
    }
}

fn compact(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn gib(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(0.0) / 1073741824.0
}
