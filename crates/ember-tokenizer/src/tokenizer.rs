//! The vocabulary loaded from GGUF metadata, and encode/decode.

use std::collections::HashMap;
use std::fmt;

use ember_gguf::GgufFile;

use crate::Error;
use crate::bpe::{self, FxBuild, Merges, NO_TOKEN, Scratch};
use crate::bytes::{byte_to_char, decode_byte_level};
use crate::pretok::{PreTokenizer, PreTokenizerKind};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";

/// Token texts llama.cpp adds to the end-of-generation set when present (llama.cpp `src/llama-vocab.cpp`): the ChatML
/// turn end, the document end, and the FIM pad / repo / file-separator tokens.
const EOG_TEXTS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];

/// `tokenizer.ggml.token_type` values (gguf-py `TokenType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    pub fn from_i64(v: i64) -> Option<Self> {
        Some(match v {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Added tokens that the partition step may match in raw text (llama.cpp's special
    /// token cache: CONTROL, USER_DEFINED, UNKNOWN).
    fn is_added(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }

    /// Matched in text, and rendered on decode, only when special tokens are asked for.
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// An added token the partition step looks for.
#[derive(Debug)]
struct Added {
    text: Box<str>,
    id: u32,
    special: bool,
}

/// What `ember inspect` prints about a vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerSummary {
    pub model: String,
    pub pre: String,
    pub n_vocab: usize,
    pub n_merges: usize,
    pub n_normal: usize,
    pub n_control: usize,
    pub n_user_defined: usize,
    pub n_unused: usize,
    pub n_byte: usize,
    pub n_unknown: usize,
    pub n_undefined: usize,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub eog_ids: Vec<u32>,
}

impl fmt::Display for TokenizerSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let id = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        writeln!(f, "tokenizer: {} / pre {}, n_vocab {}, n_merges {}", self.model, self.pre, self.n_vocab, self.n_merges)?;
        writeln!(
            f,
            "  types: normal {}, control {}, user_defined {}, unused {}, byte {}, unknown {}, undefined {}",
            self.n_normal, self.n_control, self.n_user_defined, self.n_unused, self.n_byte, self.n_unknown, self.n_undefined
        )?;
        write!(f, "  bos {}, eos {}, pad {}, eog {:?}", id(self.bos_id), id(self.eos_id), id(self.pad_id), self.eog_ids)
    }
}

/// A byte-level BPE tokenizer built from a GGUF file's `tokenizer.ggml.*` keys.
pub struct Tokenizer {
    model: String,
    pre_kind: PreTokenizerKind,
    pre: PreTokenizer,
    types: Vec<TokenType>,
    /// Bytes of every token, back to back: NORMAL tokens byte-decoded, the rest as written.
    piece_data: Vec<u8>,
    /// `piece_data[piece_off[i]..piece_off[i + 1]]` is token `i`.
    piece_off: Vec<usize>,
    text_to_id: HashMap<Box<str>, u32, FxBuild>,
    byte_ids: [u32; 256],
    merges: Merges,
    n_merges: usize,
    /// Longest text first (llama.cpp `tokenizer_st_partition`), ties by id.
    added: Vec<Added>,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    eog: Vec<u32>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("pre", &self.pre_kind)
            .field("n_vocab", &self.types.len())
            .field("n_merges", &self.n_merges)
            .finish()
    }
}

/// A piece of input text after the added-token partition.
enum Frag {
    Raw(usize, usize),
    Token(u32),
}

impl Tokenizer {
    /// Reads `tokenizer.ggml.{model,pre,tokens,token_type,merges}` and the special ids.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, Error> {
        let model = f.get_str(KEY_MODEL)?;
        if model != "gpt2" {
            return Err(Error::UnsupportedModel { found: model.to_string() });
        }
        let pre_name = f.get_str(KEY_PRE)?;
        let pre_kind = PreTokenizerKind::from_gguf_name(pre_name).ok_or_else(|| Error::UnsupportedPre { found: pre_name.to_string() })?;

        let tokens = f.get_str_array(KEY_TOKENS)?;
        let n_vocab = tokens.len();
        if n_vocab == 0 {
            return Err(Error::EmptyVocab);
        }
        // Ids are u32 and u32::MAX is our "no token" marker.
        if n_vocab >= NO_TOKEN as usize {
            return Err(Error::LengthMismatch { key: KEY_TOKENS, found: n_vocab, expected: NO_TOKEN as usize - 1 });
        }

        let mut types = match f.get(KEY_TYPES) {
            None => vec![TokenType::Normal; n_vocab],
            Some(_) => {
                let raw = f.get_int_array(KEY_TYPES)?;
                if raw.len() != n_vocab {
                    return Err(Error::LengthMismatch { key: KEY_TYPES, found: raw.len(), expected: n_vocab });
                }
                raw.iter()
                    .enumerate()
                    .map(|(index, &value)| TokenType::from_i64(value).ok_or(Error::BadTokenType { index, value }))
                    .collect::<Result<Vec<_>, _>>()?
            }
        };

        let mut text_to_id: HashMap<Box<str>, u32, FxBuild> = HashMap::with_capacity_and_hasher(n_vocab, FxBuild::default());
        let mut piece_data = Vec::with_capacity(tokens.iter().map(|t| t.len()).sum());
        let mut piece_off = Vec::with_capacity(n_vocab + 1);
        piece_off.push(0);
        for (id, &text) in tokens.iter().enumerate() {
            // Duplicate texts: the last id wins, as in llama.cpp's `token_to_id`.
            text_to_id.insert(text.into(), id as u32);
            if types[id] == TokenType::Normal {
                decode_byte_level(text, &mut piece_data);
            } else {
                piece_data.extend_from_slice(text.as_bytes());
            }
            piece_off.push(piece_data.len());
        }

        let mut byte_ids = [NO_TOKEN; 256];
        let mut buf = String::new();
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            buf.clear();
            buf.push(byte_to_char(b as u8));
            *slot = text_to_id.get(buf.as_str()).copied().unwrap_or(NO_TOKEN);
        }

        let merge_texts = f.get_str_array(KEY_MERGES)?;
        let mut merges = Merges::with_capacity(merge_texts.len());
        for (rank, &m) in merge_texts.iter().enumerate() {
            let bad = |msg: String| Error::BadMerge { index: rank, merge: m.to_string(), msg };
            // llama.cpp splits at the first space after the first byte.
            let Some(sp) = m.as_bytes().iter().skip(1).position(|&c| c == b' ') else {
                return Err(bad("expected two token texts separated by a space".into()));
            };
            let (left, right) = (&m[..sp + 1], &m[sp + 2..]);
            if right.is_empty() {
                return Err(bad("the right-hand token text is empty".into()));
            }
            let lookup = |t: &str, side: &str| text_to_id.get(t).copied().ok_or_else(|| bad(format!("{side} {t:?} is not a token")));
            let l = lookup(left, "left")?;
            let r = lookup(right, "right")?;
            buf.clear();
            buf.push_str(left);
            buf.push_str(right);
            let merged = lookup(&buf, "the merged text")?;
            merges.insert(l, r, rank as u32, merged);
        }

        let special_id = |key: &'static str| -> Result<Option<u32>, Error> {
            if f.get(key).is_none() {
                return Ok(None);
            }
            let id = f.get_u32(key)?;
            if id as usize >= n_vocab {
                return Err(Error::BadSpecialId { key, id: id as i128, n_vocab });
            }
            Ok(Some(id))
        };
        let bos = special_id(KEY_BOS)?;
        let eos = special_id(KEY_EOS)?;
        let pad = special_id(KEY_PAD)?;
        let eot = special_id(KEY_EOT)?;
        let eom = special_id(KEY_EOM)?;

        // End of generation, resolved by text like llama.cpp; it also makes such a token
        // CONTROL when the file typed it otherwise, so it is never shown nor matched in plain
        // text.
        let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = text_to_id.get(*text) {
                eog.push(id);
                types[id as usize] = TokenType::Control;
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let mut added: Vec<Added> = types
            .iter()
            .enumerate()
            .filter(|(id, t)| t.is_added() && !tokens[*id].is_empty())
            .map(|(id, t)| Added { text: tokens[id].into(), id: id as u32, special: t.is_special() })
            .collect();
        added.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));

        Ok(Self {
            model: model.to_string(),
            pre_kind,
            pre: PreTokenizer::new(pre_kind)?,
            types,
            piece_data,
            piece_off,
            text_to_id,
            byte_ids,
            merges,
            n_merges: merge_texts.len(),
            added,
            bos,
            eos,
            pad,
            eog,
        })
    }

    /// Text -> ids. Never adds BOS. With `parse_special` every added token (CONTROL and
    /// USER_DEFINED) found in the text becomes its id; without it only USER_DEFINED ones
    /// (`<think>`, `<tool_call>`, …) do and CONTROL text (`<|im_start|>`) is ordinary text
    /// (llama.cpp `parse_special`).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut sc = Scratch::default();
        for frag in self.partition(text, parse_special) {
            match frag {
                Frag::Token(id) => out.push(id),
                Frag::Raw(s, e) => self.pre.split(&text[s..e], |word| {
                    // BPE positions are u32; a word over 1 GiB (never seen in practice) is
                    // encoded in 1 GiB slices rather than overflow.
                    for chunk in word.as_bytes().chunks(1 << 30) {
                        bpe::encode_word(&self.merges, &self.byte_ids, chunk, &mut out, &mut sc);
                    }
                }),
            }
        }
        out
    }

    /// Splits out added tokens, longest token text first over the whole text, then the
    /// next longest in what remains (llama.cpp `tokenizer_st_partition`).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = vec![Frag::Raw(0, text.len())];
        if text.is_empty() {
            return frags;
        }
        for a in &self.added {
            if (a.special && !parse_special) || !text.contains(&*a.text) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Frag::Raw(s, e) = frag else {
                    next.push(frag);
                    continue;
                };
                let mut p = s;
                while let Some(i) = text[p..e].find(&*a.text) {
                    if i > 0 {
                        next.push(Frag::Raw(p, p + i));
                    }
                    next.push(Frag::Token(a.id));
                    p += i + a.text.len();
                }
                if p < e {
                    next.push(Frag::Raw(p, e));
                }
            }
            frags = next;
        }
        frags
    }

    /// Ids -> exact bytes (not necessarily UTF-8: see [`crate::StreamDecoder`]). CONTROL
    /// tokens give their text only with `render_special`; USER_DEFINED always give their
    /// text; UNUSED (`[PAD…]`), BYTE and UNDEFINED tokens and ids >= `n_vocab` give nothing.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.piece(id, render_special));
        }
        out
    }

    /// The bytes one token decodes to (see [`Tokenizer::decode`]).
    pub fn piece(&self, id: u32, render_special: bool) -> &[u8] {
        let Some(&t) = self.types.get(id as usize) else {
            return &[];
        };
        let shown = match t {
            TokenType::Normal | TokenType::UserDefined => true,
            TokenType::Control | TokenType::Unknown => render_special,
            TokenType::Unused | TokenType::Byte | TokenType::Undefined => false,
        };
        if !shown {
            return &[];
        }
        let i = id as usize;
        &self.piece_data[self.piece_off[i]..self.piece_off[i + 1]]
    }

    pub fn n_vocab(&self) -> usize {
        self.types.len()
    }

    /// Exact token text as stored in the GGUF (byte-level spelling for ordinary tokens,
    /// e.g. `"Ġthe"` for `" the"`; added tokens as written, e.g. `"<|im_end|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text).copied()
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// From the file, if present. Never added to prompts.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// End of generation: stop when the model emits this id.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation ids, ascending: EOS (and EOT/EOM when the file names them),
    /// plus `<|im_end|>`, `<|endoftext|>`, `<|fim_pad|>`, `<|repo_name|>`, `<|file_sep|>`
    /// when present.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The token's type; [`TokenType::Undefined`] for ids >= `n_vocab`. EOG tokens found by
    /// text report CONTROL even if the file said otherwise (as llama.cpp treats them).
    pub fn token_type(&self, id: u32) -> TokenType {
        self.types.get(id as usize).copied().unwrap_or(TokenType::Undefined)
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn pre_tokenizer(&self) -> PreTokenizerKind {
        self.pre_kind
    }

    pub fn summary(&self) -> TokenizerSummary {
        let count = |t: TokenType| self.types.iter().filter(|&&x| x == t).count();
        TokenizerSummary {
            model: self.model.clone(),
            pre: self.pre_kind.gguf_name().to_string(),
            n_vocab: self.n_vocab(),
            n_merges: self.n_merges,
            n_normal: count(TokenType::Normal),
            n_control: count(TokenType::Control),
            n_user_defined: count(TokenType::UserDefined),
            n_unused: count(TokenType::Unused),
            n_byte: count(TokenType::Byte),
            n_unknown: count(TokenType::Unknown),
            n_undefined: count(TokenType::Undefined),
            bos_id: self.bos,
            eos_id: self.eos,
            pad_id: self.pad,
            eog_ids: self.eog.clone(),
        }
    }
}
