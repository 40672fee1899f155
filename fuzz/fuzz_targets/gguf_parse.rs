//! Any byte string either parses or returns an `Error`; on success every accessor is safe.

#![no_main]

use ember_gguf::{GgufFile, Value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let mut sum = 0u64;
    for t in f.tensors() {
        // Every tensor's bytes, its shape helpers and its lookup by name.
        let bytes = f.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        sum = bytes.iter().fold(sum, |s, &b| s.wrapping_add(b as u64));
        sum = sum.wrapping_add(t.n_elements()).wrapping_add(t.n_rows()).wrapping_add(t.shape().len() as u64);
        if t.n_bytes > 0 {
            assert_eq!(t.row_bytes() as u64 * t.n_rows(), t.n_bytes);
        }
        assert!(f.tensor(&t.name).is_some());
        assert_eq!(t.offset % f.alignment(), 0);
    }
    for (key, value) in f.metadata() {
        // The typed getters must agree with the stored value and never panic.
        assert!(f.get(key).is_some());
        let _ = f.get_str(key);
        let _ = f.get_u64(key);
        let _ = f.get_u32(key);
        let _ = f.get_f32(key);
        let _ = f.get_bool(key);
        let _ = f.get_str_array(key);
        let _ = f.get_int_array(key);
        if let Ok(items) = f.get_array(key) {
            sum = sum.wrapping_add(items.len() as u64);
        }
        let _ = value.type_name();
        if let Value::String(s) = value {
            sum = sum.wrapping_add(s.len() as u64);
        }
    }
    sum = sum.wrapping_add(f.version() as u64).wrapping_add(f.data_offset()).wrapping_add(f.file_len());
    std::hint::black_box(sum);
});
