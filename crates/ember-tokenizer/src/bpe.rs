//! Byte-level BPE over token ids (spec §2).
//!
//! llama.cpp and HF merge strings; we merge ids. Every symbol is a token (the 256 byte
//! tokens to start with, and every merge result is checked to be a token at load time), so
//! "the pair of texts `a b` has rank r" is the same as "the pair of ids (a, b) has rank r".
//! The lowest rank is merged first, the leftmost pair on ties, with a heap: O(n log n) in
//! the word length, so a 100 KB run of one letter is fine.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// A byte with no token of its own (incomplete vocab): never merges, emits nothing, like
/// llama.cpp's per-byte fallback that skips bytes it cannot find.
pub(crate) const NO_TOKEN: u32 = u32::MAX;

/// FxHash (rustc's hasher): ids and token texts are not attacker-chosen keys, and SipHash
/// would double the vocab build time.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const FX_K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(FX_K);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.add(n as u64);
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(n as u64);
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

#[inline]
fn pair_key(left: u32, right: u32) -> u64 {
    ((left as u64) << 32) | right as u64
}

/// The merge table: (left id, right id) -> (rank, merged id).
#[derive(Debug, Default)]
pub(crate) struct Merges {
    map: HashMap<u64, (u32, u32), FxBuild>,
}

impl Merges {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self { map: HashMap::with_capacity_and_hasher(n, FxBuild::default()) }
    }

    /// Adds a merge unless the pair already has one (llama.cpp keeps the first, i.e. the
    /// best rank, of duplicated merges).
    pub(crate) fn insert(&mut self, left: u32, right: u32, rank: u32, merged: u32) {
        self.map.entry(pair_key(left, right)).or_insert((rank, merged));
    }

    #[inline]
    fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        if left == NO_TOKEN || right == NO_TOKEN {
            return None;
        }
        self.map.get(&pair_key(left, right)).copied()
    }
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
    dead: bool,
}

/// A mergeable adjacent pair. Field order is the priority: lowest rank, then leftmost
/// (llama.cpp `llm_bigram_bpe` comparator).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: u32,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

/// Reusable buffers for one `encode` call.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<Candidate>>,
}

const NONE: u32 = u32::MAX;

/// Encodes one pre-token's bytes, appending its ids to `out`.
pub(crate) fn encode_word(merges: &Merges, byte_ids: &[u32; 256], word: &[u8], out: &mut Vec<u32>, sc: &mut Scratch) {
    match word {
        [] => return,
        [b] => {
            if byte_ids[*b as usize] != NO_TOKEN {
                out.push(byte_ids[*b as usize]);
            }
            return;
        }
        _ => {}
    }
    let n = word.len() as u32;
    sc.syms.clear();
    sc.heap.clear();
    for (i, &b) in word.iter().enumerate() {
        let i = i as u32;
        sc.syms.push(Sym {
            id: byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            dead: false,
        });
    }
    let push = |sc: &mut Scratch, l: u32, r: u32| {
        let (lid, rid) = (sc.syms[l as usize].id, sc.syms[r as usize].id);
        if let Some((rank, merged)) = merges.get(lid, rid) {
            sc.heap.push(Reverse(Candidate { rank, left: l, left_id: lid, right_id: rid, merged }));
        }
    };
    for i in 0..n - 1 {
        push(sc, i, i + 1);
    }
    while let Some(Reverse(c)) = sc.heap.pop() {
        let l = c.left;
        let left = sc.syms[l as usize];
        let r = left.next;
        // Stale entry: one side has merged since (its id changed) or died.
        if left.dead || left.id != c.left_id || r == NONE {
            continue;
        }
        let right = sc.syms[r as usize];
        if right.dead || right.id != c.right_id {
            continue;
        }
        sc.syms[l as usize].id = c.merged;
        sc.syms[l as usize].next = right.next;
        sc.syms[r as usize].dead = true;
        if right.next != NONE {
            sc.syms[right.next as usize].prev = l;
        }
        if left.prev != NONE {
            push(sc, left.prev, l);
        }
        if right.next != NONE {
            push(sc, l, right.next);
        }
    }
    // Symbol 0 is never the right side of a merge, so it is alive and heads the list.
    let mut i = 0u32;
    while i != NONE {
        let s = sc.syms[i as usize];
        if s.id != NO_TOKEN {
            out.push(s.id);
        }
        i = s.next;
    }
}
