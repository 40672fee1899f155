//! Pre-tokenizers: split a text fragment into the "words" that BPE encodes one by one.
//!
//! The HF patterns (spec §3) end in `\s+(?!\S)|\s+`. Instead of running the lookahead in a
//! backtracking VM we compile the pattern without it (plain leftmost-first regex, linear
//! time) and apply the lookahead by hand: when the last alternative matched a whitespace
//! run of two or more characters that is followed by a non-space, the run gives back its
//! last character, which then starts the next word (`"  Hello"` -> `" "`, `" Hello"`).
//! This is exactly what `\s+(?!\S)` followed by `\s+` do: alternatives 1-5 are unchanged,
//! and when they fail on whitespace the run holds no CR/LF.
//! A test compares this with fancy-regex running the original pattern.

use fancy_regex::Regex;

use crate::Error;

/// Which pre-tokenizer a vocabulary uses (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreTokenizerKind {
    /// Qwen3.5 / Qwen3.6: letters may carry combining marks (`\p{M}`).
    Qwen35,
    /// Qwen2 / Qwen2.5 / Qwen3.
    Qwen2,
}

impl PreTokenizerKind {
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "qwen35" => Some(Self::Qwen35),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Qwen35 => "qwen35",
            Self::Qwen2 => "qwen2",
        }
    }

    /// The full pattern with the lookahead, in llama.cpp's form (explicit case classes
    /// instead of `(?i:…)`, so `'ſ` is not a contraction, as in llama.cpp `src/llama-vocab.cpp`).
    pub fn pattern(self) -> &'static str {
        match self {
            Self::Qwen35 => {
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
            Self::Qwen2 => {
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
        }
    }

    /// The pattern with `\s+(?!\S)|` removed (the lookahead is applied by hand).
    fn plain_pattern(self) -> String {
        self.pattern().replace(r"\s+(?!\S)|", "")
    }
}

#[derive(Debug)]
pub(crate) struct PreTokenizer {
    re: Regex,
}

impl PreTokenizer {
    pub(crate) fn new(kind: PreTokenizerKind) -> Result<Self, Error> {
        let re = Regex::new(&kind.plain_pattern()).map_err(|e| Error::Regex { pre: kind.gguf_name(), msg: e.to_string() })?;
        Ok(Self { re })
    }

    /// Calls `word` for each pre-token of `text`, in order; the words concatenate to `text`.
    pub(crate) fn split<'t>(&self, text: &'t str, mut word: impl FnMut(&'t str)) {
        let mut pos = 0;
        while pos < text.len() {
            let (start, mut end) = match self.re.find_from_pos(text, pos) {
                Ok(Some(m)) => (m.start(), m.end()),
                // Every character matches some alternative, so this cannot happen; keep
                // the rest as one word rather than lose text.
                _ => (text.len(), text.len()),
            };
            if start > pos {
                word(&text[pos..start]);
            }
            if start >= text.len() {
                break;
            }
            if end <= start {
                // An empty match cannot happen either (every alternative consumes); step
                // over one character so the loop always advances.
                end = start + text[start..].chars().next().map_or(1, char::len_utf8);
            } else if end < text.len() {
                end = lookahead_fixup(text, start, end);
            }
            word(&text[start..end]);
            pos = end;
        }
    }
}

/// `\s+(?!\S)`: a pure-whitespace match (no CR/LF, so it came from the last alternative)
/// of two or more characters that stops before a non-space gives back its last character.
fn lookahead_fixup(text: &str, start: usize, end: usize) -> usize {
    let m = &text[start..end];
    let mut chars = m.char_indices();
    let Some((_, first)) = chars.next() else {
        return end;
    };
    if !first.is_whitespace() {
        return end;
    }
    let Some((last_at, last)) = m.char_indices().next_back() else {
        return end;
    };
    if last_at == 0 || !m.chars().all(|c| c.is_whitespace() && c != '\r' && c != '\n') {
        return end;
    }
    debug_assert!(last.is_whitespace());
    start + last_at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        static P: std::sync::OnceLock<[PreTokenizer; 2]> = std::sync::OnceLock::new();
        let p = P.get_or_init(|| [PreTokenizerKind::Qwen35, PreTokenizerKind::Qwen2].map(|k| PreTokenizer::new(k).unwrap()));
        let mut out = Vec::new();
        p[kind as usize].split(text, |w| out.push(w.to_string()));
        out
    }

    #[test]
    fn whitespace_lookahead_by_hand() {
        let k = PreTokenizerKind::Qwen35;
        assert_eq!(words(k, "   Hello"), ["  ", " Hello"]);
        assert_eq!(words(k, "a  \n  b"), ["a", "  \n", " ", " b"]);
        assert_eq!(words(k, "x   "), ["x", "   "]);
        assert_eq!(words(k, "\t3"), ["\t", "3"]);
        assert_eq!(words(k, "333"), ["3", "3", "3"]);
        assert_eq!(words(k, "I'm"), ["I", "'m"]);
        assert_eq!(words(k, "e\u{301}"), ["e\u{301}"]);
        assert_eq!(words(PreTokenizerKind::Qwen2, "e\u{301}"), ["e", "\u{301}"]);
    }

    /// The by-hand lookahead equals fancy-regex running the original pattern.
    fn reference(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        static R: std::sync::OnceLock<[Regex; 2]> = std::sync::OnceLock::new();
        let re =
            &R.get_or_init(|| [PreTokenizerKind::Qwen35, PreTokenizerKind::Qwen2].map(|k| Regex::new(k.pattern()).unwrap()))[kind as usize];
        re.find_iter(text).map(|m| m.unwrap().as_str().to_string()).collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(5000))]
        #[test]
        fn same_split_as_lookahead_regex(
            text in "([ \t\r\n\u{a0}\u{3000}]|[aZé]|\u{301}|\u{0e31}|[0-9٣]|[.'!,]|'s|'LL|中|👋|\\PC){0,24}"
        ) {
            for kind in [PreTokenizerKind::Qwen35, PreTokenizerKind::Qwen2] {
                proptest::prop_assert_eq!(words(kind, &text), reference(kind, &text));
            }
        }
    }
}
