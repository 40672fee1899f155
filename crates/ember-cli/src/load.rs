//! Opening model files (or the bundled demo model) with a progress bar.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use ember_gguf::{GgufFile, LoadMode};
use ember_model::Model;

/// The tiny random-weight qwen35moe model (tests/fixtures/tiny-a, Q8_0), served when no model
/// is given. Its output is random text: it exists so every command can be tried at once.
pub const DEMO_MODEL: &[u8] = include_bytes!("../../../tests/fixtures/tiny-a/gguf/tiny-a-Q8_0.gguf");
pub const DEMO_NAME: &str = "tiny-a-Q8_0 (bundled demo: random weights, random output)";

/// `--no-mmap`: read model files into memory instead of mapping them.
static NO_MMAP: AtomicBool = AtomicBool::new(false);

pub fn set_no_mmap(on: bool) {
    NO_MMAP.store(on, Ordering::Relaxed);
}

pub fn no_mmap() -> bool {
    NO_MMAP.load(Ordering::Relaxed)
}

/// A byte progress bar on stderr (drawn only on a terminal).
fn bytes_bar(what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{binary_bytes}}/{{binary_total_bytes}} {{binary_bytes_per_sec}}"
        ))
        // unwrap: the template is built from a constant and a word, and parses.
        .unwrap(),
    );
    bar
}

pub fn open_gguf(path: Option<&Path>) -> Result<Arc<GgufFile>> {
    let f = match path {
        Some(p) => {
            let mode = if NO_MMAP.load(Ordering::Relaxed) { LoadMode::Read } else { LoadMode::Mmap };
            let bar = bytes_bar("reading");
            let f = GgufFile::open_with(p, mode, &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            });
            bar.finish_and_clear();
            f.with_context(|| format!("loading {}", p.display()))?
        }
        None => GgufFile::from_bytes(DEMO_MODEL.to_vec()).context("loading the bundled demo model")?,
    };
    Ok(Arc::new(f))
}

/// Opens and validates a model, showing a progress bar on a terminal.
pub fn open_model(path: Option<&PathBuf>) -> Result<Model> {
    let file = open_gguf(path.map(|p| p.as_path()))?;
    if path.is_none() {
        eprintln!("note: no -m given, using {DEMO_NAME}");
    }
    file.advise_willneed();
    // Fault the whole file in up front when it fits in memory with room to spare (llama.cpp
    // maps with MAP_POPULATE likewise); a model larger than that keeps streaming on demand.
    if mem_available().is_some_and(|avail| file.file_len().saturating_mul(5) / 4 < avail) {
        let bar = bytes_bar("paging in");
        file.populate_with(&mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:30} {pos}/{len} layers {elapsed}")
            // unwrap: the template is a constant known to parse.
            .unwrap(),
    );
    let model = Model::load(file, |i, n| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    });
    bar.finish_and_clear();
    let model = model.with_context(|| match path {
        Some(p) => format!("loading model {}", p.display()),
        None => "loading the bundled demo model".into(),
    })?;
    Ok(model)
}

/// The tokenizer of a file, with the file path in errors.
pub fn tokenizer(file: &GgufFile) -> Result<ember_tokenizer::Tokenizer> {
    ember_tokenizer::Tokenizer::from_gguf(file).context("reading the tokenizer from the GGUF metadata")
}

/// A count that must be at least 1 (sequences, tokens per pass).
pub fn parse_at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}' is not a count: {e}")),
    }
}

pub fn parse_kv_type(s: &str) -> Result<ember_ops::KvType, String> {
    ember_ops::KvType::parse(s).ok_or_else(|| format!("unknown KV cache type '{s}' (use f16, q8_0 or f32)"))
}

/// `MemAvailable` from /proc/meminfo, in bytes (Linux; None elsewhere or when unreadable).
pub fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
