//! A prefix cache over token sequences: a radix tree whose nodes may hold a state checkpoint
//! taken exactly after that node's tokens, in a byte budget with least-recently-used eviction.
//!
//! Attention KV could be truncated to any length, but DeltaNet state cannot be rewound, so a
//! prefix is reusable only where a checkpoint exists: [`PrefixCache::lookup`] returns the longest
//! stored checkpoint whose tokens are a prefix of the query. The cache is generic over the
//! checkpoint type so it stays pure data (the engine stores model snapshots in it).

use std::collections::HashMap;

/// What the cache needs to know about a checkpoint.
pub trait Checkpoint {
    /// Bytes it holds alone (for the budget).
    fn bytes(&self) -> usize;
    /// Blocks it may share with other checkpoints (KV pages): `(id, bytes)`, where equal ids
    /// are the same block. The budget counts each block once, however many entries hold it,
    /// so checkpoints of one growing conversation cost their own state plus the new pages.
    fn shared(&self) -> Vec<(usize, usize)>;
}

/// Checkpoints on the path to a new one that [`PrefixCache::insert`] always keeps.
pub const RECENT: usize = 3;

/// Counters for /metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub insertions: u64,
    pub evictions: u64,
    /// Checkpoints dropped to thin a conversation's path (see [`PrefixCache::insert`]).
    pub thinned: u64,
    pub entries: usize,
    pub bytes: usize,
}

struct Node<S> {
    /// Tokens on the edge from the parent to this node.
    edge: Vec<u32>,
    children: HashMap<u32, usize>,
    parent: Option<usize>,
    checkpoint: Option<S>,
    last_used: u64,
}

/// The radix tree; node 0 is the root (empty prefix). Freed nodes are recycled.
pub struct PrefixCache<S> {
    nodes: Vec<Option<Node<S>>>,
    free: Vec<usize>,
    budget_bytes: usize,
    clock: u64,
    stats: CacheStats,
    /// Shared blocks held by entries: id -> (entries holding it, bytes).
    blocks: HashMap<usize, (usize, usize)>,
}

impl<S: Checkpoint> PrefixCache<S> {
    pub fn new(budget_bytes: usize) -> Self {
        let root = Node { edge: Vec::new(), children: HashMap::new(), parent: None, checkpoint: None, last_used: 0 };
        PrefixCache {
            nodes: vec![Some(root)],
            free: Vec::new(),
            budget_bytes,
            clock: 0,
            stats: CacheStats::default(),
            blocks: HashMap::new(),
        }
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    fn node(&self, i: usize) -> &Node<S> {
        // unwrap: indices reachable from the tree always point at live nodes.
        self.nodes[i].as_ref().unwrap()
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<S> {
        // unwrap: as in `node`.
        self.nodes[i].as_mut().unwrap()
    }

    /// Whether a checkpoint for exactly `tokens` is stored (no statistics, no LRU update).
    pub fn contains(&self, tokens: &[u32]) -> bool {
        let (mut at, mut depth) = (0usize, 0usize);
        while depth < tokens.len() {
            let Some(&next) = self.node(at).children.get(&tokens[depth]) else { return false };
            let edge = &self.node(next).edge;
            if tokens.len() - depth < edge.len() || tokens[depth..depth + edge.len()] != edge[..] {
                return false;
            }
            depth += edge.len();
            at = next;
        }
        depth > 0 && self.node(at).checkpoint.is_some()
    }

    /// The longest checkpointed prefix of `tokens`: its length and checkpoint. Counts a hit or
    /// a miss and marks the entry as recently used.
    pub fn lookup(&mut self, tokens: &[u32]) -> Option<(usize, &S)> {
        self.lookup_with(tokens, |_, _| true)
    }

    /// [`PrefixCache::lookup`] among the checkpoints `accept(depth, checkpoint)` takes.
    pub fn lookup_with(&mut self, tokens: &[u32], accept: impl Fn(usize, &S) -> bool) -> Option<(usize, &S)> {
        let mut at = 0usize; // node
        let mut depth = 0usize; // tokens matched so far
        let mut best: Option<(usize, usize)> = None; // (node, depth)
        loop {
            if depth > 0 && self.node(at).checkpoint.as_ref().is_some_and(|c| accept(depth, c)) {
                best = Some((at, depth));
            }
            let Some(&next) = tokens.get(depth).and_then(|t| self.node(at).children.get(t)) else { break };
            let edge = &self.node(next).edge;
            if tokens.len() - depth < edge.len() || tokens[depth..depth + edge.len()] != edge[..] {
                break; // the query diverges inside this edge
            }
            depth += edge.len();
            at = next;
        }
        self.clock += 1;
        match best {
            Some((n, d)) => {
                self.stats.hits += 1;
                let clock = self.clock;
                self.node_mut(n).last_used = clock;
                // unwrap: `best` only records nodes holding a checkpoint.
                Some((d, self.node(n).checkpoint.as_ref().unwrap()))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Stores a checkpoint taken after exactly `tokens`; replaces an existing one. Thins the
    /// older checkpoints on its path (`thin_ancestors`). Evicts least recently used
    /// checkpoints until the budget holds; a checkpoint larger than the whole
    /// budget is not stored. Returns the number of evictions.
    pub fn insert(&mut self, tokens: &[u32], checkpoint: S) -> usize {
        let size = checkpoint.bytes() + checkpoint.shared().iter().map(|b| b.1).sum::<usize>();
        if size > self.budget_bytes || tokens.is_empty() {
            return 0;
        }
        let node = self.find_or_split(tokens);
        self.clock += 1;
        let clock = self.clock;
        self.add_blocks(&checkpoint);
        let n = self.node_mut(node);
        n.last_used = clock;
        let old = n.checkpoint.replace(checkpoint);
        match old {
            Some(o) => self.remove_blocks(&o),
            None => self.stats.entries += 1,
        }
        self.stats.insertions += 1;
        self.thin_ancestors(node, tokens.len());
        let mut evicted = 0;
        while self.stats.bytes > self.budget_bytes {
            if !self.evict_lru(node) {
                break;
            }
            evicted += 1;
        }
        evicted
    }

    /// Thins the checkpoints on the path to a new one at `depth`: the [`RECENT`] nearest stay,
    /// and beyond them an older one stays only at no more than half the depth of the last one
    /// kept. A growing conversation then holds O(log n) checkpoints, not one per message: a
    /// follow-up restores from the newest, a branch off a recent message from a recent one, an
    /// edit far back recomputes at most as much as it keeps. (Each checkpoint holds a whole
    /// DeltaNet state, ~60 MiB at 35B.)
    fn thin_ancestors(&mut self, node: usize, depth: usize) {
        let mut at = self.node(node).parent;
        let mut d = depth - self.node(node).edge.len();
        let (mut kept, mut last_kept) = (0usize, depth);
        while let Some(i) = at {
            let n = self.node(i);
            let (parent, edge_len, has) = (n.parent, n.edge.len(), n.checkpoint.is_some());
            if has && i != 0 {
                kept += 1;
                if kept <= RECENT || 2 * d <= last_kept {
                    last_kept = d;
                } else {
                    // unwrap: `has` says the node holds a checkpoint.
                    let cp = self.node_mut(i).checkpoint.take().unwrap();
                    self.remove_blocks(&cp);
                    self.stats.entries -= 1;
                    self.stats.thinned += 1;
                    // Only this node can go: it has a descendant (the new checkpoint's path).
                    self.prune(i);
                }
            }
            at = parent;
            d -= edge_len;
        }
    }

    /// Counts a new entry's own bytes and the shared blocks it is the first to hold.
    fn add_blocks(&mut self, cp: &S) {
        self.stats.bytes += cp.bytes();
        for (id, bytes) in cp.shared() {
            let e = self.blocks.entry(id).or_insert((0, bytes));
            if e.0 == 0 {
                self.stats.bytes += bytes;
            }
            e.0 += 1;
        }
    }

    /// Uncounts a removed entry: its own bytes and the shared blocks no other entry holds.
    fn remove_blocks(&mut self, cp: &S) {
        self.stats.bytes -= cp.bytes();
        for (id, _) in cp.shared() {
            if let Some(e) = self.blocks.get_mut(&id) {
                e.0 -= 1;
                if e.0 == 0 {
                    self.stats.bytes -= e.1;
                    self.blocks.remove(&id);
                }
            }
        }
    }

    /// The node for exactly `tokens`, creating (and splitting edges) as needed.
    fn find_or_split(&mut self, tokens: &[u32]) -> usize {
        let mut at = 0usize;
        let mut depth = 0usize;
        while depth < tokens.len() {
            let first = tokens[depth];
            let Some(&child) = self.node(at).children.get(&first) else {
                let leaf = self.alloc(Node {
                    edge: tokens[depth..].to_vec(),
                    children: HashMap::new(),
                    parent: Some(at),
                    checkpoint: None,
                    last_used: 0,
                });
                self.node_mut(at).children.insert(first, leaf);
                return leaf;
            };
            let edge_len = self.node(child).edge.len();
            let common = self.node(child).edge.iter().zip(&tokens[depth..]).take_while(|(a, b)| a == b).count();
            if common == edge_len {
                at = child;
                depth += edge_len;
                continue;
            }
            // Split the edge at `common`: parent -> mid -> child.
            let child_edge = self.node(child).edge.clone();
            let mid = self.alloc(Node {
                edge: child_edge[..common].to_vec(),
                children: HashMap::new(),
                parent: Some(at),
                checkpoint: None,
                last_used: 0,
            });
            {
                let c = self.node_mut(child);
                c.edge = child_edge[common..].to_vec();
                c.parent = Some(mid);
            }
            self.node_mut(mid).children.insert(child_edge[common], child);
            self.node_mut(at).children.insert(first, mid);
            at = mid;
            depth += common;
        }
        at
    }

    fn alloc(&mut self, n: Node<S>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// Drops the least recently used checkpoint (to make room elsewhere, e.g. KV pages for a
    /// new sequence); false if the cache is empty.
    pub fn evict_one(&mut self) -> bool {
        self.evict_lru(usize::MAX)
    }

    /// Drops the least recently used checkpoint other than `keep`; false if there is none.
    fn evict_lru(&mut self, keep: usize) -> bool {
        let victim = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().filter(|n| n.checkpoint.is_some() && i != keep).map(|n| (n.last_used, i)))
            .min();
        let Some((_, v)) = victim else { return false };
        // unwrap: the victim holds a checkpoint by the filter above.
        let cp = self.node_mut(v).checkpoint.take().unwrap();
        self.remove_blocks(&cp);
        self.stats.entries -= 1;
        self.stats.evictions += 1;
        self.prune(v);
        true
    }

    /// Removes `i` and empty ancestors that no longer lead to a checkpoint; merges a node left
    /// with one child and no checkpoint into that child.
    fn prune(&mut self, mut i: usize) {
        while i != 0 {
            let n = self.node(i);
            if n.checkpoint.is_some() {
                return;
            }
            match n.children.len() {
                0 => {
                    // unwrap: every non-root node has a parent.
                    let parent = n.parent.unwrap();
                    let first = n.edge[0];
                    self.node_mut(parent).children.remove(&first);
                    self.nodes[i] = None;
                    self.free.push(i);
                    i = parent;
                }
                1 => {
                    let (&_, &only) = n.children.iter().next().expect("one child");
                    let (parent, edge) = (n.parent.unwrap(), n.edge.clone());
                    let c = self.node_mut(only);
                    let mut merged = edge.clone();
                    merged.extend_from_slice(&c.edge);
                    c.edge = merged;
                    c.parent = Some(parent);
                    self.node_mut(parent).children.insert(edge[0], only);
                    self.nodes[i] = None;
                    self.free.push(i);
                    return;
                }
                _ => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Cp(&'static str, usize);
    impl Checkpoint for Cp {
        fn bytes(&self) -> usize {
            self.1
        }
        fn shared(&self) -> Vec<(usize, usize)> {
            Vec::new()
        }
    }

    /// A checkpoint with its own bytes and shared blocks `(id, bytes)`.
    struct Paged(usize, Vec<(usize, usize)>);
    impl Checkpoint for Paged {
        fn bytes(&self) -> usize {
            self.0
        }
        fn shared(&self) -> Vec<(usize, usize)> {
            self.1.clone()
        }
    }

    /// Shared blocks count once while any entry holds them, and leave the total with the last.
    #[test]
    fn shared_blocks_count_once() {
        let mut c = PrefixCache::new(1000);
        c.insert(&[1], Paged(10, vec![(1, 100), (2, 100)]));
        assert_eq!(c.stats().bytes, 210);
        c.insert(&[1, 2], Paged(10, vec![(1, 100), (2, 100), (3, 100)]));
        assert_eq!(c.stats().bytes, 320, "only page 3 and the own bytes are new");
        c.insert(&[1, 2], Paged(10, vec![(1, 100), (4, 100)]));
        assert_eq!(c.stats().bytes, 320, "replaced: page 3 released, page 4 added");
        // Budget 200, pages of 50: evicting an entry frees its own bytes and only the pages no
        // other entry holds.
        let mut c = PrefixCache::new(200);
        c.insert(&[1], Paged(10, vec![(1, 50)])); // 60
        c.insert(&[9], Paged(10, vec![(9, 50)])); // 120
        c.insert(&[1, 2], Paged(10, vec![(1, 50), (2, 50)])); // 180
        assert_eq!(c.insert(&[1, 2, 3], Paged(10, vec![(1, 50), (2, 50), (3, 50)])), 2);
        assert_eq!(c.stats().bytes, 240 - 10 - 60, "[1] freed 10 (its page stays), [9] freed 60");
        assert!(c.lookup(&[9, 5]).is_none() && c.lookup(&[1, 2, 3, 9]).is_some() && c.lookup(&[1, 2, 7]).is_some());
    }

    #[test]
    fn lookup_with_skips_the_checkpoints_it_refuses() {
        let mut c = PrefixCache::new(1000);
        c.insert(&[1, 2], Cp("a", 10));
        c.insert(&[1, 2, 3, 4], Cp("b", 10));
        // As the engine asks: the whole query only from an entry that says so ("b" does not).
        let whole_ok = |n: usize, s: &Cp| n < 4 || s.0 == "x";
        assert_eq!(c.lookup_with(&[1, 2, 3, 4], whole_ok).map(|(n, s)| (n, s.0)), Some((2, "a")));
        assert_eq!(c.lookup_with(&[1, 2, 3, 4, 5], |_, _| true).map(|(n, s)| (n, s.0)), Some((4, "b")));
        assert_eq!(c.lookup_with(&[1, 2], |_, _| false).map(|(n, _)| n), None);
        assert_eq!((c.stats().hits, c.stats().misses), (2, 1), "one count per lookup");
    }

    #[test]
    fn longest_checkpointed_prefix() {
        let mut c = PrefixCache::new(1000);
        assert!(c.lookup(&[1, 2, 3]).is_none());
        c.insert(&[1, 2, 3], Cp("a", 10));
        c.insert(&[1, 2, 3, 4, 5], Cp("b", 10));
        c.insert(&[1, 2, 9], Cp("c", 10));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]).map(|(n, s)| (n, s.0)), Some((5, "b")));
        assert_eq!(c.lookup(&[1, 2, 3, 4]).map(|(n, s)| (n, s.0)), Some((3, "a")));
        assert_eq!(c.lookup(&[1, 2, 9, 9]).map(|(n, s)| (n, s.0)), Some((3, "c")));
        assert_eq!(c.lookup(&[1, 2]).map(|(n, _)| n), None, "no checkpoint at [1, 2]");
        assert_eq!(c.lookup(&[7]).map(|(n, _)| n), None);
        assert!(c.contains(&[1, 2, 3]) && c.contains(&[1, 2, 3, 4, 5]) && !c.contains(&[1, 2]) && !c.contains(&[1, 2, 3, 4]));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries, s.bytes), (3, 3, 3, 30));
    }

    #[test]
    fn lru_eviction_under_budget() {
        let mut c = PrefixCache::new(25);
        c.insert(&[1, 1], Cp("a", 10));
        c.insert(&[2, 2], Cp("b", 10));
        c.lookup(&[1, 1, 5]); // a is now more recent than b
        let ev = c.insert(&[3, 3], Cp("c", 10));
        assert_eq!(ev, 1);
        assert!(c.lookup(&[2, 2]).is_none(), "b (least recently used) evicted");
        assert!(c.lookup(&[1, 1]).is_some());
        assert!(c.lookup(&[3, 3]).is_some());
        assert_eq!(c.stats().bytes, 20);
        assert_eq!(c.insert(&[4], Cp("huge", 26)), 0, "larger than the budget: not stored");
        assert!(c.lookup(&[4]).is_none());
    }

    #[test]
    fn replace_and_prune_keep_the_tree_consistent() {
        let mut c = PrefixCache::new(100);
        c.insert(&[1, 2, 3, 4], Cp("a", 10));
        c.insert(&[1, 2, 3, 4], Cp("a2", 20));
        assert_eq!(c.stats().bytes, 20);
        c.insert(&[1, 2, 5], Cp("b", 10));
        c.insert(&[1, 2], Cp("p", 10));
        // Evict everything but the last insert by shrinking through inserts.
        let mut small = PrefixCache::new(10);
        for i in 0..50u32 {
            small.insert(&[i % 7, i, i + 1], Cp("x", 10));
            assert_eq!(small.stats().entries, 1);
            assert!(small.lookup(&[i % 7, i, i + 1, 0]).is_some());
        }
        assert!(small.nodes.iter().filter(|n| n.is_some()).count() <= 3, "pruned nodes are recycled");
        assert_eq!(c.lookup(&[1, 2, 3, 4, 0]).map(|(n, s)| (n, s.0)), Some((4, "a2")));
        assert_eq!(c.lookup(&[1, 2, 5]).map(|(n, s)| (n, s.0)), Some((3, "b")));
        assert_eq!(c.lookup(&[1, 2, 7]).map(|(n, s)| (n, s.0)), Some((2, "p")));
    }
}
