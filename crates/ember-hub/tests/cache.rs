//! A hub cache laid out as huggingface_hub writes it (blobs + relative symlinks per snapshot,
//! `refs/main`), with the file names real GGUF repositories use: which file `-hf` picks.

use std::path::{Path, PathBuf};

use ember_hub::{Error, HubRef, all_models, repo_models, resolve};

struct Tmp(PathBuf);

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const REPO: &str = "unsloth/Qwen3.6-35B-A3B-GGUF";

/// `files`: (snapshot, path in the repo, bytes).
fn cache(name: &str, main: &str, files: &[(&str, &str, usize)]) -> Tmp {
    let root = std::env::temp_dir().join(format!("ember-hub-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("models--unsloth--Qwen3.6-35B-A3B-GGUF");
    std::fs::create_dir_all(dir.join("blobs")).unwrap();
    std::fs::create_dir_all(dir.join("refs")).unwrap();
    std::fs::write(dir.join("refs/main"), main).unwrap();
    for (i, (rev, rel, n)) in files.iter().enumerate() {
        let blob = format!("blob{i}");
        std::fs::write(dir.join("blobs").join(&blob), vec![0u8; *n]).unwrap();
        let link = dir.join("snapshots").join(rev).join(rel);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(format!("{}blobs/{blob}", "../".repeat(rel.matches('/').count() + 2)), link).unwrap();
    }
    Tmp(root)
}

fn pick(root: &Path, r: &str) -> Result<String, Error> {
    resolve(root, &HubRef::parse(r).unwrap()).map(|m| m.name)
}

#[test]
fn quant_tags_pick_the_file_llama_cpp_would() {
    let t = cache(
        "pick",
        "r2",
        &[
            ("r2", "Qwen3.6-35B-A3B-Q4_K_M.gguf", 40),
            ("r2", "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf", 41),
            ("r2", "Qwen3.6-35B-A3B-IQ4_XS.gguf", 30),
            ("r2", "mmproj-F16.gguf", 5),
            ("r2", "BF16/Qwen3.6-35B-A3B-BF16-00001-of-00002.gguf", 100),
            ("r2", "BF16/Qwen3.6-35B-A3B-BF16-00002-of-00002.gguf", 50),
            ("r2", "README.md", 1),
            ("r1", "Qwen3.6-35B-A3B-Q8_0.gguf", 80),
        ],
    );
    let root = &t.0;
    assert_eq!(pick(root, &format!("{REPO}:Q4_K_M")).unwrap(), "Qwen3.6-35B-A3B-Q4_K_M.gguf", "shortest name wins over UD-");
    assert_eq!(pick(root, REPO).unwrap(), "Qwen3.6-35B-A3B-Q4_K_M.gguf", "default quant");
    assert_eq!(pick(root, &format!("{REPO}:ud-q4_k_m")).unwrap(), "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf");
    assert_eq!(pick(root, &format!("{REPO}:BF16")).unwrap(), "BF16/Qwen3.6-35B-A3B-BF16-00001-of-00002.gguf");
    assert_eq!(pick(root, &format!("{REPO}:Q8_0")).unwrap(), "Qwen3.6-35B-A3B-Q8_0.gguf", "older snapshots count too");
    let e = pick(root, &format!("{REPO}:F16")).unwrap_err().to_string();
    assert!(e.contains("mmproj-F16.gguf"), "a projector is never picked, but the listing names it: {e}");
    let e = pick(root, &format!("{REPO}:Q5_K_M")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NoMatch { .. }), "{msg}");
    assert!(
        msg.contains("Q5_K_M")
            && msg.contains("Qwen3.6-35B-A3B-IQ4_XS.gguf")
            && msg.contains("BF16/Qwen3.6-35B-A3B-BF16-00001-of-00002.gguf"),
        "{msg}"
    );

    let models = repo_models(root, REPO).unwrap();
    let bf16 = models.iter().find(|m| m.name.starts_with("BF16/")).unwrap();
    assert_eq!((bf16.n_parts, bf16.bytes), (2, 150), "a split model counts once, with every part's bytes");
    assert_eq!(models.len(), 6, "README and the second BF16 part are not models: {models:?}");
    assert_eq!(all_models(root).unwrap().len(), 6);
}

#[test]
fn a_missing_repo_says_how_to_fetch_it() {
    let t = cache("missing", "r", &[("r", "M-Q4_K_M.gguf", 1)]);
    let e = pick(&t.0, "Qwen/Other-GGUF:Q8_0").unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, Error::NotCached { .. }) && msg.contains("models--Qwen--Other-GGUF") && msg.contains("hf download Qwen/Other-GGUF"),
        "{msg}"
    );
    assert!(all_models(&t.0.join("nowhere")).unwrap().is_empty(), "a cache that does not exist holds no models");
}
