//! Split GGUFs (llama.cpp `gguf-split`: `NAME-00001-of-0000N.gguf`, `split.*` keys) open as
//! one file from the first part: same metadata, same tensors, byte-identical tensor data, in
//! mmap and read mode. Missing, foreign and out-of-order parts are errors naming the file.

use std::path::PathBuf;

use ember_gguf::{Error, GgufFile, LoadMode, write_split};

fn tiny() -> GgufFile {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    GgufFile::open(p).expect("tiny-a fixture")
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ember-gguf-split-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn split_msg(r: Result<GgufFile, Error>) -> (PathBuf, String) {
    match r {
        Err(Error::Split { path, msg }) => (path, msg),
        Err(e) => panic!("expected a split error, got {e}"),
        Ok(_) => panic!("expected a split error, got a file"),
    }
}

fn same_model(a: &GgufFile, b: &GgufFile) {
    assert_eq!(a.tensors().len(), b.tensors().len());
    for t in a.tensors() {
        let u = b.tensor(&t.name).unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!((t.ggml_type, t.ne), (u.ggml_type, u.ne), "{}", t.name);
        assert!(a.tensor_data(t) == b.tensor_data(u), "{}: data differs", t.name);
    }
    for (k, v) in a.metadata() {
        if !k.starts_with("split.") {
            assert_eq!(b.get(k), Some(v), "{k}");
        }
    }
}

#[test]
fn three_parts_read_as_one() {
    let src = tiny();
    let dir = temp_dir("ok");
    let paths = write_split(&src, 3, &dir.join("tiny")).unwrap();
    assert_eq!(paths[0].file_name().unwrap(), "tiny-00001-of-00003.gguf");
    for mode in [LoadMode::Mmap, LoadMode::Read] {
        let mut last = (0, 0);
        let f = GgufFile::open_with(&paths[0], mode, &mut |d, t| last = (d, t)).unwrap();
        assert_eq!(f.n_parts(), 3);
        let sizes: u64 = paths.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
        assert_eq!(f.file_len(), sizes);
        if mode == LoadMode::Read {
            assert_eq!(last, (sizes, sizes), "progress reaches the total of all parts");
        }
        same_model(&src, &f);
        assert!(f.tensors().iter().any(|t| t.part == 2));
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_single_file_reads_the_same_without_mmap() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    let f = GgufFile::open_with(&p, LoadMode::Read, &mut |_, _| {}).unwrap();
    same_model(&tiny(), &f);
    assert_eq!(f.n_parts(), 1);
}

#[test]
fn missing_foreign_and_wrong_parts_are_named() {
    let src = tiny();
    let dir = temp_dir("bad");
    let paths = write_split(&src, 3, &dir.join("m")).unwrap();

    // Opening a later part points at the first one.
    let (p, msg) = split_msg(GgufFile::open(&paths[1]));
    assert_eq!(p, paths[1]);
    assert!(msg.contains("part 2 of 3") && msg.contains("m-00001-of-00003.gguf"), "{msg}");

    // A missing part.
    let moved = dir.join("moved.gguf");
    std::fs::rename(&paths[2], &moved).unwrap();
    let (p, msg) = split_msg(GgufFile::open(&paths[0]));
    assert_eq!(p, paths[2]);
    assert!(msg.contains("part 3 of 3 is missing"), "{msg}");
    std::fs::rename(&moved, &paths[2]).unwrap();

    // A part of another split put in its place (same name, different split.count).
    let other = write_split(&src, 2, &dir.join("o")).unwrap();
    std::fs::copy(&other[1], &paths[1]).unwrap();
    let (p, msg) = split_msg(GgufFile::open(&paths[0]));
    assert_eq!(p, paths[1]);
    assert!(msg.contains("different splits"), "{msg}");

    // A first part renamed so the others cannot be found.
    let lone = dir.join("lone.gguf");
    std::fs::copy(&paths[0], &lone).unwrap();
    let (_, msg) = split_msg(GgufFile::open(&lone));
    assert!(msg.contains("-NNNNN-of-NNNNN.gguf"), "{msg}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tensor_count_must_match_split_tensors_count() {
    let src = tiny();
    let dir = temp_dir("count");
    let paths = write_split(&src, 2, &dir.join("c")).unwrap();
    // Rewrite part 2 without its last tensor.
    // (from_bytes parses one file as it is; open would refuse a part other than the first.)
    let part2 = GgufFile::from_bytes(std::fs::read(&paths[1]).unwrap()).unwrap();
    let keep = &part2.tensors()[..part2.tensors().len() - 1];
    let mut w = ember_gguf::GgufWriter::new();
    for (k, v) in part2.metadata() {
        w.set(k.clone(), v.clone());
    }
    for t in keep {
        w.add_tensor(ember_gguf::TensorSpec::new(t.name.clone(), t.ggml_type, &t.ne[..t.n_dims as usize]));
    }
    let data: Vec<&[u8]> = keep.iter().map(|t| part2.tensor_data(t)).collect();
    let bytes = w.to_bytes(&data).unwrap();
    drop(part2);
    std::fs::write(&paths[1], bytes).unwrap();
    let (_, msg) = split_msg(GgufFile::open(&paths[0]));
    assert!(msg.contains("split.tensors.count"), "{msg}");
    std::fs::remove_dir_all(dir).unwrap();
}
