//! `ember models` and `-hf`: models from the local Hugging Face cache (ember-hub).
//!
//! `-hf OWNER/REPO[:QUANT]` is spelled as llama.cpp spells it, which clap cannot parse (it
//! reads `-hf` as `-h -f`), so it is rewritten before clap sees the arguments: `-hf X`,
//! `--hf-repo X` and `--hf-repo=X` become `-m PATH` of the resolved file. Every command that
//! takes `-m` thereby takes `-hf`.

use std::ffi::OsString;

use anyhow::{Context, Result, bail};
use ember_hub::HubRef;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Rewrites `-hf REF` / `--hf-repo REF` / `--hf-repo=REF` into `-m PATH`.
pub fn expand_hf_args(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let s = a.to_str().unwrap_or("");
        if s == "--" {
            out.push(a);
            out.extend(it);
            break;
        }
        let value = if s == "-hf" || s == "--hf-repo" {
            let v = it.next().with_context(|| format!("{s} needs a value: OWNER/REPO[:QUANT]"))?;
            Some(v.into_string().map_err(|_| anyhow::anyhow!("{s}: the value is not UTF-8"))?)
        } else {
            s.strip_prefix("--hf-repo=").or_else(|| s.strip_prefix("-hf=")).map(str::to_string)
        };
        match value {
            Some(v) => {
                let path = resolve(&v)?;
                out.push("-m".into());
                out.push(path.into_os_string());
            }
            None => out.push(a),
        }
    }
    Ok(out)
}

fn resolve(reference: &str) -> Result<std::path::PathBuf> {
    let r = HubRef::parse(reference)?;
    let cache = ember_hub::cache_dir()?;
    let m = ember_hub::resolve(&cache, &r)?;
    eprintln!("{reference}: {} ({}) from {}", m.name, ember_hub::human_bytes(m.bytes), cache.display());
    Ok(m.path)
}

pub fn main(a: Args) -> Result<()> {
    let cache = ember_hub::cache_dir()?;
    let models = ember_hub::all_models(&cache)?;
    let rows: Vec<_> = models
        .iter()
        .map(|m| {
            let (arch, quant) = match ember_hub::describe_gguf(&m.path) {
                Ok(d) => d,
                Err(e) => (Some(format!("unreadable: {e}")), None),
            };
            let quant = quant.or_else(|| guess_quant(&m.name));
            (m, arch, quant)
        })
        .collect();
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|(m, arch, quant)| {
                serde_json::json!({
                    "repo": m.repo, "file": m.name, "path": m.path, "bytes": m.bytes, "parts": m.n_parts,
                    "architecture": arch, "quant": quant,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if rows.is_empty() {
        bail!("no GGUF models in the Hugging Face cache {} (set HF_HUB_CACHE or HF_HOME to look elsewhere)", cache.display());
    }
    println!("{}", cache.display());
    println!("{:<48} {:>10} {:<12} {:<10} file", "-hf", "size", "arch", "quant");
    for (m, arch, quant) in rows {
        // The shortest `-hf` spelling that picks exactly this file, if the name has one.
        let picks = |q: Option<String>| {
            let r = HubRef { repo: m.repo.clone(), quant: q.clone() };
            ember_hub::resolve(&cache, &r).is_ok_and(|x| x.name == m.name).then(|| match q {
                Some(q) => format!("{}:{q}", m.repo),
                None => m.repo.clone(),
            })
        };
        let reference = picks(None).or_else(|| name_tags(&m.name).into_iter().find_map(|t| picks(Some(t)))).unwrap_or_else(|| "-".into());
        let parts = if m.n_parts > 1 { format!(" ({} parts)", m.n_parts) } else { String::new() };
        println!(
            "{reference:<48} {:>10} {:<12} {:<10} {}{parts}",
            ember_hub::human_bytes(m.bytes),
            arch.as_deref().unwrap_or("?"),
            quant.as_deref().unwrap_or("?"),
            m.name
        );
    }
    Ok(())
}

/// Quant tags a file name carries: its last `-` field, then the last two
/// (`Model-UD-Q4_K_M.gguf` -> `Q4_K_M`, `UD-Q4_K_M`); the folder of a split model too.
fn name_tags(name: &str) -> Vec<String> {
    let (dir, file) = name.rsplit_once('/').unwrap_or(("", name));
    let mut stem = file.trim_end_matches(".gguf");
    if ember_hub::split_of(file).is_some() {
        stem = stem.rsplitn(3, '-').nth(2).unwrap_or(stem);
    }
    let fields: Vec<&str> = stem.rsplit('-').take(2).collect();
    let mut tags: Vec<String> = Vec::new();
    if let Some(last) = fields.first() {
        tags.push(last.to_string());
    }
    if let [last, before] = fields.as_slice() {
        tags.push(format!("{before}-{last}"));
    }
    if !dir.is_empty() {
        tags.push(dir.rsplit('/').next().unwrap_or(dir).to_string());
    }
    tags
}

/// A quant name from a file name when the metadata has none (`...-Q4_K_M.gguf`).
fn guess_quant(name: &str) -> Option<String> {
    let tag = name_tags(name).into_iter().next()?.to_ascii_uppercase();
    (tag.starts_with('Q') || tag.starts_with("IQ") || ["F16", "BF16", "F32"].contains(&tag.as_str())).then_some(tag)
}
