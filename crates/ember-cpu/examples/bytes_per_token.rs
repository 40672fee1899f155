//! Bytes read and flops per decoded token of a qwen35moe GGUF (the roofline's numerator):
//! every trunk tensor once, `expert_used / expert_count` of each routed-expert tensor, one row of
//! the embedding table. State and KV traffic are listed separately by the caller (perf.md).
//!
//! `cargo run --release -p ember-cpu --example bytes_per_token -- FILE`

use ember_gguf::GgufFile;

fn main() {
    let path = std::env::args().nth(1).expect("usage: bytes_per_token FILE");
    let f = GgufFile::open(&path).unwrap();
    let arch = f.get_str("general.architecture").unwrap().to_owned();
    let n_exp = f.get_u64(&format!("{arch}.expert_count")).unwrap();
    let used = f.get_u64(&format!("{arch}.expert_used_count")).unwrap();
    let (mut bytes, mut flops) = (0f64, 0f64);
    let mut groups = std::collections::BTreeMap::<String, f64>::new();
    for t in f.tensors() {
        let nb = t.ggml_type.row_bytes(t.ne[0] as usize).unwrap() as f64 * t.n_rows() as f64;
        let ne = t.n_elements() as f64;
        let (b, fl, g) = if t.name.starts_with("token_embd") {
            (nb / t.ne[1] as f64, 0.0, "embedding row")
        } else if t.name.contains("_exps") {
            let s = used as f64 / n_exp as f64;
            (nb * s, 2.0 * ne * s, "routed experts (selected)")
        } else if t.name == "output.weight" {
            (nb, 2.0 * ne, "output head")
        } else {
            (nb, if t.ne[1] > 1 { 2.0 * ne } else { 0.0 }, "trunk")
        };
        bytes += b;
        flops += fl;
        *groups.entry(format!("{g:28} {}", t.ggml_type)).or_default() += b;
    }
    println!("{path}: file {:.3} GiB", f.file_len() as f64 / (1u64 << 30) as f64);
    for (g, b) in &groups {
        println!("  {g:40} {:9.1} MB/token", b / 1e6);
    }
    println!("weights read per token: {:.1} MB; matmul flops per token: {:.3} GFLOP", bytes / 1e6, flops / 1e9);
}
