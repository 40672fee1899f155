//! GPT-2 `bytes_to_unicode`: every byte gets a printable character so that byte-level BPE
//! tokens can be stored as strings (space 0x20 -> `Ġ` U+0120, newline 0x0A -> `Ċ` U+010A).

/// Byte -> code point of its byte-level character.
const fn build_forward() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        // Printable ASCII `!`..`~`, `¡`..`¬` and `®`..`ÿ` map to themselves; the other 68
        // bytes take U+0100, U+0101, ... in byte order.
        let printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        table[b] = if printable {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        b += 1;
    }
    table
}

const FORWARD: [u32; 256] = build_forward();

/// Highest code point used by the table (U+0143) plus one.
const N_INVERSE: usize = 0x144;

const fn build_inverse() -> [i16; N_INVERSE] {
    let mut table = [-1i16; N_INVERSE];
    let mut b = 0usize;
    while b < 256 {
        table[FORWARD[b] as usize] = b as i16;
        b += 1;
    }
    table
}

const INVERSE: [i16; N_INVERSE] = build_inverse();

/// The byte-level character that stands for byte `b`.
pub(crate) fn byte_to_char(b: u8) -> char {
    // Every table entry is below U+0144, a valid scalar value.
    char::from_u32(FORWARD[b as usize]).unwrap_or('\u{FFFD}')
}

/// Decodes a byte-level token text to raw bytes. A character outside the table (a vocab
/// that is not purely byte-level) is kept as its own UTF-8 bytes.
pub(crate) fn decode_byte_level(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match INVERSE.get(c as usize) {
            Some(&b) if b >= 0 => out.push(b as u8),
            _ => out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection_with_known_anchors() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xAD), '\u{0143}');
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c));
            let mut out = Vec::new();
            decode_byte_level(&c.to_string(), &mut out);
            assert_eq!(out, vec![b]);
        }
    }
}
