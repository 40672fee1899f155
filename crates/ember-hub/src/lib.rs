//! ember-hub: models where users keep them. Resolves llama.cpp's `-hf OWNER/REPO[:QUANT]` from
//! the local Hugging Face hub cache, and lists the GGUFs in that cache.
//!
//! The decision a reader would question: this never downloads. The cache is what
//! `huggingface-cli download` / `hf download` and llama.cpp's `-hf` fill; reading it needs no
//! network client, no token handling and no partial-download logic, and a user who has the
//! file gets it offline at once. A repository that is not there is an error that says which
//! command fetches it.
//!
//! Cache layout (huggingface_hub `file_download.py`): `models--OWNER--REPO/refs/main` holds the
//! commit of the main branch, `snapshots/COMMIT/PATH` are symlinks into `blobs/`.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// Quant picked when `-hf` names none (llama.cpp's default tag).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{0}` is not a Hugging Face model reference: use OWNER/REPO or OWNER/REPO:QUANT (e.g. unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M)")]
    BadRef(String),
    #[error("no Hugging Face cache directory: set HF_HUB_CACHE or HF_HOME (HOME is not set either)")]
    NoCache,
    #[error(
        "{repo} is not in the Hugging Face cache {} (no {}); ember does not download: fetch it with `hf download {repo} --include '*{quant}*'`",
        cache.display(),
        dir.display()
    )]
    NotCached { repo: String, quant: String, cache: PathBuf, dir: PathBuf },
    #[error("{repo} in {} has no GGUF file", dir.display())]
    NoGguf { repo: String, dir: PathBuf },
    #[error("no GGUF in {repo} matches quant `{quant}`; the cache has: {}", list(available))]
    NoMatch { repo: String, quant: String, available: Vec<String> },
    #[error("quant `{quant}` in {repo} matches several files ({}): name one more exactly", list(matches))]
    Ambiguous { repo: String, quant: String, matches: Vec<String> },
    #[error("reading {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

fn list(items: &[String]) -> String {
    items.join(", ")
}

/// `OWNER/REPO[:QUANT]` as llama.cpp's `-hf` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    pub repo: String,
    pub quant: Option<String>,
}

impl HubRef {
    pub fn parse(s: &str) -> Result<HubRef, Error> {
        let (repo, quant) = match s.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (s, None),
        };
        let ok_part = |p: &str| !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        match repo.split_once('/') {
            Some((owner, name)) if ok_part(owner) && ok_part(name) => {}
            _ => return Err(Error::BadRef(s.to_string())),
        }
        if quant.is_some_and(|q| q.is_empty() || q.contains('/')) {
            return Err(Error::BadRef(s.to_string()));
        }
        Ok(HubRef { repo: repo.to_string(), quant: quant.map(str::to_string) })
    }
}

/// The hub cache directory, as huggingface_hub finds it: `HF_HUB_CACHE`, else `HF_HOME/hub`,
/// else `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_dir() -> Result<PathBuf, Error> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("HF_HUB_CACHE") {
        return Ok(d);
    }
    if let Some(d) = var("HF_HOME") {
        return Ok(d.join("hub"));
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Ok(d.join("huggingface/hub"));
    }
    var("HOME").map(|h| h.join(".cache/huggingface/hub")).ok_or(Error::NoCache)
}

/// One GGUF model in the cache (a split model counts once, by its first part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModel {
    pub repo: String,
    /// Path inside the repository, e.g. `Q4_K_M/Model-Q4_K_M-00001-of-00002.gguf`.
    pub name: String,
    /// The snapshot path (a symlink into `blobs/`), what to open.
    pub path: PathBuf,
    /// Bytes, over every part of a split model.
    pub bytes: u64,
    pub n_parts: usize,
}

/// `models--OWNER--REPO` for `OWNER/REPO`.
fn repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

/// GGUF models of one cached repository. Files of the snapshot `refs/main` points at come
/// first; files that only an older snapshot has are listed too (a file is kept once, from
/// the first snapshot that has it).
pub fn repo_models(cache: &Path, repo: &str) -> Result<Vec<CachedModel>, Error> {
    let dir = repo_dir(cache, repo);
    let snapshots = dir.join("snapshots");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let main = std::fs::read_to_string(dir.join("refs/main")).ok().map(|s| s.trim().to_string());
    let mut revs: Vec<String> = std::fs::read_dir(&snapshots)
        .map_err(io(&snapshots))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    revs.sort();
    revs.sort_by_key(|r| Some(r) != main.as_ref());
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for rev in revs {
        let root = snapshots.join(&rev);
        let mut found = Vec::new();
        walk(&root, &root, &mut found);
        for (name, path) in found {
            if !files.iter().any(|(n, _)| *n == name) {
                files.push((name, path));
            }
        }
    }
    files.sort();
    let mut models = Vec::new();
    for (name, path) in &files {
        let lower = name.to_ascii_lowercase();
        if !lower.ends_with(".gguf") {
            continue;
        }
        let split = split_of(name);
        if split.is_some_and(|(no, _)| no != 1) {
            continue;
        }
        // A missing blob (interrupted download) has no size: it is not a usable model.
        let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
        let Some(mut bytes) = size(path) else { continue };
        let mut n_parts = 1;
        if let Some((_, count)) = split {
            for i in 2..=count {
                let other = part_name(name, i, count);
                if let Some(b) = files.iter().find(|(n, _)| *n == other).and_then(|(_, p)| size(p)) {
                    bytes += b;
                    n_parts += 1;
                }
            }
        }
        models.push(CachedModel { repo: repo.to_string(), name: name.clone(), path: path.clone(), bytes, n_parts });
    }
    Ok(models)
}

/// Every GGUF model in the cache, by repository.
pub fn all_models(cache: &Path) -> Result<Vec<CachedModel>, Error> {
    let entries = match std::fs::read_dir(cache) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(Error::Io { path: cache.to_path_buf(), source }),
    };
    let mut repos: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_prefix("models--")).map(|r| r.replacen("--", "/", 1)))
        .collect();
    repos.sort();
    let mut out = Vec::new();
    for r in repos {
        out.extend(repo_models(cache, &r).unwrap_or_default());
    }
    Ok(out)
}

/// Files under `dir`, as paths relative to `root` with `/` separators.
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        // Snapshot entries are symlinks to blobs: follow them for the kind.
        if p.is_dir() {
            walk(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            let rel: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            out.push((rel.join("/"), p));
        }
    }
}

/// `(part, count)` of `NAME-0000K-of-0000N.gguf`.
pub fn split_of(name: &str) -> Option<(u32, u32)> {
    let stem = name.strip_suffix(".gguf").or_else(|| name.strip_suffix(".GGUF"))?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (_, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    (digits(no) && digits(count)).then(|| Some((no.parse().ok()?, count.parse().ok()?)))?
}

fn part_name(first: &str, i: u32, count: u32) -> String {
    let cut = first.len() - "00001-of-00000.gguf".len();
    format!("{}{i:05}-of-{count:05}.gguf", &first[..cut])
}

/// Whether `tag` occurs in `name` as a whole token, case-insensitively: after the start or one
/// of `-_./`, before the end or one of `-./` (`_` is part of quant names, so `Q4_K_M` is in
/// `Model-Q4_K_M.gguf` and `Q4_K_M/Model-00001-of-00002.gguf` but not in `Model-IQ4_K_M.gguf`
/// or `Model-Q4_K_M_L.gguf`, and `Q4_K` is not in `Model-Q4_K_M.gguf`).
fn has_tag(name: &str, tag: &str) -> bool {
    let (name, tag) = (name.to_ascii_uppercase(), tag.to_ascii_uppercase());
    let before = |c: Option<char>| c.is_none_or(|c| "-_./".contains(c));
    let after = |c: Option<char>| c.is_none_or(|c| "-./".contains(c));
    name.match_indices(&tag).any(|(at, _)| before(name[..at].chars().next_back()) && after(name[at + tag.len()..].chars().next()))
}

/// The model `-hf` means: the file whose name carries the quant tag (`DEFAULT_QUANT` when
/// none is given, or the only model when there is one), preferring the shortest name (so
/// `:Q4_K_M` picks `Model-Q4_K_M.gguf` over `Model-UD-Q4_K_M.gguf`). Projector files
/// (`mmproj`) are never picked unless named.
pub fn resolve(cache: &Path, r: &HubRef) -> Result<CachedModel, Error> {
    let dir = repo_dir(cache, &r.repo);
    let quant = r.quant.clone().unwrap_or_else(|| DEFAULT_QUANT.to_string());
    if !dir.is_dir() {
        return Err(Error::NotCached { repo: r.repo.clone(), quant, cache: cache.to_path_buf(), dir });
    }
    let models = repo_models(cache, &r.repo)?;
    if models.is_empty() {
        return Err(Error::NoGguf { repo: r.repo.clone(), dir });
    }
    let wants_mmproj = quant.to_ascii_lowercase().contains("mmproj");
    let usable: Vec<&CachedModel> = models.iter().filter(|m| wants_mmproj || !m.name.to_ascii_lowercase().contains("mmproj")).collect();
    let mut matches: Vec<&CachedModel> = usable.iter().copied().filter(|m| has_tag(&m.name, &quant)).collect();
    if matches.is_empty() && r.quant.is_none() && usable.len() == 1 {
        matches = usable;
    }
    let shortest = matches.iter().map(|m| m.name.len()).min();
    let best: Vec<&CachedModel> = matches.iter().copied().filter(|m| Some(m.name.len()) == shortest).collect();
    match best.as_slice() {
        [m] => Ok((*m).clone()),
        [] => {
            let quant = if r.quant.is_none() { format!("{quant} (the default when none is given: add :QUANT)") } else { quant };
            Err(Error::NoMatch { repo: r.repo.clone(), quant, available: models.iter().map(describe).collect() })
        }
        many => Err(Error::Ambiguous { repo: r.repo.clone(), quant, matches: many.iter().map(|m| m.name.clone()).collect() }),
    }
}

fn describe(m: &CachedModel) -> String {
    format!("{} ({})", m.name, human_bytes(m.bytes))
}

/// `20.13 GiB`, `5.4 MiB`.
pub fn human_bytes(b: u64) -> String {
    let gib = b as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 { format!("{gib:.2} GiB") } else { format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64) }
}

/// The name of a llama.cpp `general.file_type` (`enum llama_ftype`), e.g. 15 -> `Q4_K_M`.
pub fn file_type_name(ftype: u64) -> Option<&'static str> {
    Some(match ftype {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

/// Architecture and quant of a GGUF, from its metadata (`general.architecture`,
/// `general.file_type`); `None` for what the file does not say.
pub fn describe_gguf(path: &Path) -> Result<(Option<String>, Option<String>), ember_gguf::Error> {
    let f = ember_gguf::GgufFile::open(path)?;
    let arch = f.get_str("general.architecture").ok().map(str::to_string);
    let quant = f.get_u64("general.file_type").ok().map(|t| file_type_name(t).map_or_else(|| format!("type {t}"), str::to_string));
    Ok((arch, quant))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_parse_like_llama_cpp() {
        assert_eq!(
            HubRef::parse("unsloth/Qwen3.6-35B-A3B-GGUF:UD-Q4_K_M").unwrap(),
            HubRef { repo: "unsloth/Qwen3.6-35B-A3B-GGUF".into(), quant: Some("UD-Q4_K_M".into()) }
        );
        assert_eq!(HubRef::parse("a/b").unwrap().quant, None);
        for bad in ["ab", "a/b/c", "/b", "a/", "a/b:", "../x", "a/b:c/d", "a b/c"] {
            assert!(HubRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tags_are_whole_tokens() {
        assert!(has_tag("Model-Q4_K_M.gguf", "q4_k_m"));
        assert!(has_tag("Q4_K_M/Model-00001-of-00002.gguf", "Q4_K_M"));
        assert!(has_tag("Model-UD-Q4_K_M.gguf", "UD-Q4_K_M"));
        assert!(!has_tag("Model-IQ4_K_M.gguf", "Q4_K_M"));
        assert!(!has_tag("Model-Q4_K_M_L.gguf", "Q4_K_M"));
        assert!(!has_tag("Model-Q4_K_M.gguf", "Q4_K"));
        assert_eq!(split_of("a-b-00002-of-00010.gguf"), Some((2, 10)));
        assert_eq!(split_of("a-2-of-3.gguf"), None);
        assert_eq!(part_name("x-00001-of-00003.gguf", 3, 3), "x-00003-of-00003.gguf");
    }
}
