//! Incremental detokenizer for streaming: a single token may end inside a UTF-8 sequence
//! (e.g. one of the three bytes of a CJK character), so bytes are buffered until the
//! sequence is complete.

use crate::Tokenizer;

/// Turns ids into text chunks as they are generated. Every chunk is valid UTF-8 and the
/// chunks concatenate to `String::from_utf8_lossy(&tokenizer.decode(ids, render_special))`:
/// an incomplete sequence at the end is held back (at most 3 bytes); bytes that can never
/// become valid become U+FFFD right away, exactly where the lossy one-shot decode puts them.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    render_special: bool,
}

impl StreamDecoder {
    /// `render_special`: CONTROL tokens (`<|im_end|>`, …) appear as their text.
    pub fn new(render_special: bool) -> Self {
        Self { pending: Vec::new(), render_special }
    }

    /// Adds one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        let render = self.render_special;
        self.push_bytes(tok.piece(id, render))
    }

    /// Adds raw bytes (a piece obtained elsewhere); returns the text that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut at = 0;
        while at < self.pending.len() {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    out.push_str(s);
                    at = self.pending.len();
                }
                Err(e) => {
                    let valid = &self.pending[at..at + e.valid_up_to()];
                    out.push_str(&String::from_utf8_lossy(valid));
                    at += e.valid_up_to();
                    match e.error_len() {
                        // A truncated but so far valid sequence: wait for more bytes.
                        None => break,
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            at += n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..at);
        out
    }

    /// Flushes what is left (an incomplete sequence becomes U+FFFD) and resets.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back, waiting for the rest of a UTF-8 sequence.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}
