/// The ggml tensor types this crate knows (ids from ggml.h `enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ4NL,
    IQ4XS,
    BF16,
}

/// (type, ggml id, block size in weights, bytes per block, name).
const TABLE: &[(GgmlType, u32, usize, usize, &str)] = &[
    (GgmlType::F32, 0, 1, 4, "F32"),
    (GgmlType::F16, 1, 1, 2, "F16"),
    (GgmlType::Q4_0, 2, 32, 18, "Q4_0"),
    (GgmlType::Q4_1, 3, 32, 20, "Q4_1"),
    (GgmlType::Q5_0, 6, 32, 22, "Q5_0"),
    (GgmlType::Q5_1, 7, 32, 24, "Q5_1"),
    (GgmlType::Q8_0, 8, 32, 34, "Q8_0"),
    (GgmlType::Q8_1, 9, 32, 36, "Q8_1"),
    (GgmlType::Q2K, 10, 256, 84, "Q2_K"),
    (GgmlType::Q3K, 11, 256, 110, "Q3_K"),
    (GgmlType::Q4K, 12, 256, 144, "Q4_K"),
    (GgmlType::Q5K, 13, 256, 176, "Q5_K"),
    (GgmlType::Q6K, 14, 256, 210, "Q6_K"),
    (GgmlType::Q8K, 15, 256, 292, "Q8_K"),
    (GgmlType::IQ4NL, 20, 32, 18, "IQ4_NL"),
    (GgmlType::IQ4XS, 23, 256, 136, "IQ4_XS"),
    (GgmlType::BF16, 30, 1, 2, "BF16"),
];

impl GgmlType {
    /// This type's TABLE row: TABLE lists the variants in declaration order (checked by the
    /// `table_is_complete` test), so the discriminant is the index. Sizes are read per weight
    /// row in the kernels' hot loops, hence the direct index and the inlining.
    #[inline]
    fn row(self) -> &'static (GgmlType, u32, usize, usize, &'static str) {
        &TABLE[self as usize]
    }

    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        TABLE.iter().find(|r| r.4.eq_ignore_ascii_case(name)).map(|r| r.0)
    }

    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Number of weights in one block.
    #[inline]
    pub fn block_size(self) -> usize {
        self.row().2
    }

    /// Bytes in one block.
    #[inline]
    pub fn type_size(self) -> usize {
        self.row().3
    }

    pub fn name(self) -> &'static str {
        self.row().4
    }

    /// Bytes of a row of `n` weights, or None if `n` is not a multiple of the block size.
    #[inline]
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        // Block sizes are powers of two (1, 32, 256): masks and shifts, not divisions (this
        // runs once per weight row in the kernels).
        let bs = self.block_size();
        debug_assert!(bs.is_power_of_two());
        if n & (bs - 1) != 0 {
            return None;
        }
        (n >> bs.trailing_zeros()).checked_mul(self.type_size())
    }

    /// The type llama.cpp's CPU backend quantises activations to before a dot product
    /// with a weight of this type (gguf-format.md §7.1).
    pub fn vec_dot_type(self) -> GgmlType {
        use GgmlType::*;
        match self {
            F32 => F32,
            F16 => F16,
            BF16 => BF16,
            Q4_0 | Q5_0 | Q8_0 | IQ4NL => Q8_0,
            Q4_1 | Q5_1 => Q8_1,
            Q2K | Q3K | Q4K | Q5K | Q6K | IQ4XS => Q8K,
            Q8_1 => Q8_1,
            Q8K => Q8K,
        }
    }

    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|r| r.0)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_complete() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::all().count(), 17);
        // `row` indexes TABLE by discriminant; `row_bytes` relies on power-of-two blocks.
        for t in GgmlType::all() {
            assert!(t.block_size().is_power_of_two(), "{t}");
        }
        for (i, r) in TABLE.iter().enumerate() {
            assert_eq!(r.0 as usize, i, "TABLE row {i} is {:?}", r.0);
        }
    }
}
