//! Issue 17: models from where users keep them. A Hugging Face hub cache is laid out in a temp
//! dir exactly as huggingface_hub writes it (`models--OWNER--REPO/{refs/main, blobs/HASH,
//! snapshots/REV/FILE -> ../../blobs/HASH}`), with the tiny fixture as a single file and as a
//! 3-part split in a folder. `-hf` (llama.cpp's spelling), `--hf-repo`, `ember models`,
//! split loading and `--no-mmap` are checked through the real binary.
//!
//! Exactness: greedy generation (`--temp 0`) from the split, the `-hf` file and `--no-mmap`
//! must print the same bytes as from the single file: the same weights give the same tokens.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ember_testkit::fixture;

struct Cache {
    root: PathBuf,
}

impl Drop for Cache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const REPO: &str = "ember-test/Tiny-A-GGUF";
const REV: &str = "0123456789abcdef0123456789abcdef01234567";

/// Puts `src` into the cache as `rel` (a blob plus a relative snapshot symlink).
fn add(repo_dir: &Path, rel: &str, src: &Path, blob: &str) {
    std::fs::copy(src, repo_dir.join("blobs").join(blob)).unwrap();
    let link = repo_dir.join("snapshots").join(REV).join(rel);
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    let depth = rel.matches('/').count() + 2;
    let target = format!("{}blobs/{blob}", "../".repeat(depth));
    std::os::unix::fs::symlink(target, &link).unwrap();
}

fn cache(name: &str) -> Cache {
    let root = std::env::temp_dir().join(format!("ember-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let hub = root.join("hub");
    let repo_dir = hub.join(format!("models--{}", REPO.replace('/', "--")));
    std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), REV).unwrap();
    add(&repo_dir, "tiny-a-Q8_0.gguf", &fixture("tiny-a/gguf/tiny-a-Q8_0.gguf"), "b1");
    // The Q4_K_M file as llama.cpp's gguf-split would cut it, in a folder (as unsloth does).
    let src = ember_gguf::GgufFile::open(fixture("tiny-a/gguf/tiny-a-Q4_K_M.gguf")).unwrap();
    let parts = ember_gguf::write_split(&src, 3, &root.join("tiny-a-Q4_K_M")).unwrap();
    for (i, p) in parts.iter().enumerate() {
        let rel = format!("Q4_K_M/{}", p.file_name().unwrap().to_str().unwrap());
        add(&repo_dir, &rel, p, &format!("s{i}"));
    }
    Cache { root }
}

fn ember(c: &Cache, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember")).args(args).env_remove("HF_HUB_CACHE").env("HF_HOME", &c.root).output().expect("run ember")
}

fn ok(c: &Cache, args: &[&str]) -> String {
    let o = ember(c, args);
    assert!(o.status.success(), "ember {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn fails(c: &Cache, args: &[&str]) -> String {
    let o = ember(c, args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "ember {args:?} should fail");
    assert!(!err.contains("panicked"), "{err}");
    err
}

const GEN: [&str; 8] = ["-p", "Hello", "-n", "6", "--temp", "0", "-t", "1"];

fn run(c: &Cache, model: &[&str]) -> String {
    let mut args = vec!["run"];
    args.extend_from_slice(model);
    args.extend_from_slice(&GEN);
    ok(c, &args)
}

#[test]
fn r17_hf_refs_resolve_from_the_cache() {
    let c = cache("hf");
    let single = fixture("tiny-a/gguf/tiny-a-Q8_0.gguf");
    let want = run(&c, &["-m", single.to_str().unwrap()]);
    assert_eq!(run(&c, &["-hf", &format!("{REPO}:Q8_0")]), want, "-hf as llama.cpp spells it");
    assert_eq!(run(&c, &["--hf-repo", &format!("{REPO}:q8_0")]), want, "--hf-repo, quant in any case");
    assert_eq!(run(&c, &[&format!("--hf-repo={REPO}:Q8_0"), "--no-mmap"]), want, "--no-mmap");

    // The split Q4_K_M opens from its first part and generates what the single file does.
    let want4 = run(&c, &["-m", fixture("tiny-a/gguf/tiny-a-Q4_K_M.gguf").to_str().unwrap()]);
    assert_eq!(run(&c, &["-hf", REPO]), want4, "no quant: llama.cpp's default Q4_K_M");
    assert_eq!(run(&c, &["-hf", &format!("{REPO}:Q4_K_M"), "--no-mmap"]), want4);

    let err = fails(&c, &["run", "-hf", &format!("{REPO}:Q5_K_S"), "-p", "x"]);
    assert!(
        err.contains("Q5_K_S") && err.contains("tiny-a-Q8_0.gguf") && err.contains("Q4_K_M/tiny-a-Q4_K_M-00001-of-00003.gguf"),
        "{err}"
    );
    let err = fails(&c, &["run", "-hf", "nobody/Nothing-GGUF", "-p", "x"]);
    assert!(err.contains("not in the Hugging Face cache") && err.contains("models--nobody--Nothing-GGUF"), "{err}");
    let err = fails(&c, &["run", "-hf", "not-a-repo", "-p", "x"]);
    assert!(err.contains("OWNER/REPO"), "{err}");
}

#[test]
fn r17_models_lists_the_cache() {
    let c = cache("models");
    let out = ok(&c, &["models", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{out}");
    let by_file = |f: &str| rows.iter().find(|r| r["file"] == f).unwrap_or_else(|| panic!("{f} not listed: {out}"));
    let q8 = by_file("tiny-a-Q8_0.gguf");
    assert_eq!(q8["architecture"], "qwen35moe");
    assert_eq!(q8["quant"], "Q8_0");
    assert_eq!(q8["bytes"], std::fs::metadata(fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap().len());
    let q4 = by_file("Q4_K_M/tiny-a-Q4_K_M-00001-of-00003.gguf");
    assert_eq!(q4["parts"], 3);
    assert_eq!(q4["quant"], "Q4_K_M");
    let table = ok(&c, &["models"]);
    assert!(table.contains(&format!("{REPO}:Q8_0")) && table.contains("qwen35moe"), "{table}");

    // A broken split (a part missing) is an error naming the part.
    let repo_dir = c.root.join("hub").join(format!("models--{}", REPO.replace('/', "--")));
    std::fs::remove_file(repo_dir.join("snapshots").join(REV).join("Q4_K_M/tiny-a-Q4_K_M-00002-of-00003.gguf")).unwrap();
    let err = fails(&c, &["inspect", "-hf", &format!("{REPO}:Q4_K_M")]);
    assert!(err.contains("part 2 of 3 is missing") && err.contains("tiny-a-Q4_K_M-00002-of-00003.gguf"), "{err}");
}
