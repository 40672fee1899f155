//! Per-sequence state owned by the backend ([`SeqStore`]): a fixed number of slots, each with
//! its DeltaNet conv + recurrent state in a fixed place and its K/V rows in pages drawn from a
//! bounded pool; snapshots that share KV pages and copy only the DeltaNet state.
//!
//! Callers hold [`Slot`]s and [`Snapshot`]s, guards that give their id back when dropped (the
//! store frees it at its next call), so a slot or snapshot is never leaked by an early return or
//! a dropped request. [`HostStore`] is the host implementation, shared by the reference and the
//! CPU backend.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{DeviceId, KV_PAGE, KvRows, KvType, LayerIdx, OpError, OpResult};

/// One KV page: [`KV_PAGE`] rows of bytes, drawn from a [`PagePool`] and given back when the
/// last holder (a sequence or a snapshot sharing it) drops it.
#[derive(Debug)]
pub struct PageBuf {
    data: Vec<u8>,
    pool: Arc<PoolInner>,
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        self.pool.used.fetch_sub(1, Ordering::Relaxed);
        lock(&self.pool.free).push(std::mem::take(&mut self.data));
    }
}

/// A shared KV page.
pub type KvPage = Arc<PageBuf>;

#[derive(Debug)]
struct PoolInner {
    cap: usize,
    used: AtomicUsize,
    /// Buffers of pages given back, reused before allocating.
    free: Mutex<Vec<Vec<u8>>>,
}

/// A bounded pool of KV pages: at most `cap` pages live at once. Buffers are allocated on first
/// use and recycled.
#[derive(Debug, Clone)]
pub struct PagePool(Arc<PoolInner>);

impl PagePool {
    pub fn new(cap: usize) -> Self {
        PagePool(Arc::new(PoolInner { cap, used: AtomicUsize::new(0), free: Mutex::new(Vec::new()) }))
    }

    /// A pool without a limit (kernel tests that build caches by hand).
    pub fn unbounded() -> Self {
        PagePool::new(usize::MAX)
    }

    /// A page of `bytes` bytes (contents unspecified), or `None` when `cap` pages are live.
    pub fn page(&self, bytes: usize) -> Option<KvPage> {
        let p = &self.0;
        p.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| (u < p.cap).then_some(u + 1)).ok()?;
        let data = match lock(&p.free).pop() {
            Some(mut b) if b.len() == bytes => {
                b.shrink_to_fit();
                b
            }
            _ => vec![0u8; bytes],
        };
        Some(Arc::new(PageBuf { data, pool: p.clone() }))
    }

    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Relaxed)
    }

    pub fn cap(&self) -> usize {
        self.0.cap
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain id lists: still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The index of a slot in its store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "slot {}", self.0)
    }
}

/// Ids dropped by their holders, freed by the store at its next call.
#[derive(Debug, Default)]
pub struct Reclaim {
    slots: Mutex<Vec<u32>>,
    snaps: Mutex<Vec<u32>>,
}

impl Reclaim {
    pub fn new() -> Arc<Self> {
        Arc::new(Reclaim::default())
    }

    /// A guard for slot `id` of the store owning `self`.
    pub fn slot(self: &Arc<Self>, id: u32) -> Slot {
        Slot { id: SlotId(id), back: self.clone() }
    }

    /// A guard for snapshot `id` of the store owning `self`.
    pub fn snapshot(self: &Arc<Self>, id: u32, info: SnapInfo) -> Snapshot {
        Snapshot { id, info, back: self.clone() }
    }

    /// The slot and snapshot ids dropped since the last call.
    pub fn take(&self) -> (Vec<u32>, Vec<u32>) {
        (std::mem::take(&mut *lock(&self.slots)), std::mem::take(&mut *lock(&self.snaps)))
    }

    /// Whether `slot` was handed out by the store owning `self`.
    pub fn owns_slot(self: &Arc<Self>, slot: &Slot) -> bool {
        Arc::ptr_eq(self, &slot.back)
    }

    pub fn owns_snapshot(self: &Arc<Self>, snap: &Snapshot) -> bool {
        Arc::ptr_eq(self, &snap.back)
    }
}

/// A sequence's slot in a store; dropping it frees the slot (and its pages).
#[derive(Debug)]
pub struct Slot {
    id: SlotId,
    back: Arc<Reclaim>,
}

impl Slot {
    pub fn id(&self) -> SlotId {
        self.id
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.back.slots).push(self.id.0);
    }
}

/// What a snapshot holds, known when it is taken (it never changes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapInfo {
    /// Tokens covered.
    pub len: usize,
    /// Bytes only this snapshot holds (its copy of the DeltaNet state and of a partial page).
    pub own_bytes: usize,
    /// The KV pages it shares, `(id, bytes)`: the same page has the same id in every snapshot
    /// and sequence holding it.
    pub pages: Vec<(usize, usize)>,
}

/// A copy of a slot's state after `len` tokens; dropping it releases its pages and copy.
#[derive(Debug)]
pub struct Snapshot {
    id: u32,
    info: SnapInfo,
    back: Arc<Reclaim>,
}

impl Snapshot {
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.info.len
    }

    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }

    pub fn own_bytes(&self) -> usize {
        self.info.own_bytes
    }

    pub fn kv_pages(&self) -> &[(usize, usize)] {
        &self.info.pages
    }

    /// Own bytes plus every page it references (pages shared with others counted in full).
    pub fn bytes(&self) -> usize {
        self.info.own_bytes + self.info.pages.iter().map(|p| p.1).sum::<usize>()
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        lock(&self.back.snaps).push(self.id);
    }
}

/// The kind of state a layer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// K and V rows (full attention).
    Kv,
    /// DeltaNet conv history and recurrent state.
    Delta,
    /// None here: the layer's state is kept by another store (a layer split's other part).
    Elsewhere,
}

/// What every slot of a store holds: per layer, its kind; the KV row type and width; the
/// DeltaNet conv history and recurrent state sizes (f32 values per layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    pub layers: Vec<StateKind>,
    pub kv_type: KvType,
    /// Values per K (or V) row: n_head_kv · head_dim.
    pub kv_width: usize,
    /// Conv history per layer: (kernel − 1) · channels, oldest first.
    pub conv: usize,
    /// Recurrent state per layer: n_v_head · d_v · d_k (row = value index).
    pub rec: usize,
}

impl StateLayout {
    pub fn n_kv_layers(&self) -> usize {
        self.layers.iter().filter(|k| **k == StateKind::Kv).count()
    }

    pub fn n_delta_layers(&self) -> usize {
        self.layers.iter().filter(|k| **k == StateKind::Delta).count()
    }

    /// Bytes of one KV page.
    pub fn page_bytes(&self) -> usize {
        // unwrap_or: a width that is not a block multiple is rejected by `configure`.
        KV_PAGE * self.kv_type.ggml().row_bytes(self.kv_width).unwrap_or(0)
    }

    /// Pages a sequence holds at `len` tokens (K and V of every attention layer).
    pub fn pages_at(&self, len: usize) -> usize {
        2 * self.n_kv_layers() * len.div_ceil(KV_PAGE)
    }

    /// DeltaNet bytes of one slot (also what a snapshot copies).
    pub fn delta_bytes(&self) -> usize {
        4 * self.n_delta_layers() * (self.conv + self.rec)
    }
}

/// How full a store is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub slots: usize,
    pub slots_free: usize,
    pub pages: usize,
    pub pages_free: usize,
    pub page_bytes: usize,
    pub snapshots: usize,
}

/// Per-sequence state kept by a backend. Sequence ops name slots through the step's batch
/// ([`crate::Batch`]).
pub trait SeqStore {
    /// Sizes the store: `slots` sequences of `layout`, at most `kv_pages` KV pages (sequences
    /// and snapshots together). Drops every slot's state; a slot or snapshot handed out before
    /// is refused afterwards.
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()>;

    /// A free slot with an empty state (length 0, DeltaNet state zero); an error when every slot
    /// is in use.
    fn alloc_slot(&mut self) -> OpResult<Slot>;

    /// Empties a slot (length 0, pages given back, DeltaNet state zero).
    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()>;

    /// Tokens a slot has processed.
    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize>;

    /// A snapshot of a slot: its KV pages shared (the next write into the last, partial page
    /// copies it), its DeltaNet state copied.
    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot>;

    /// Replaces a slot's state by a snapshot's.
    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()>;

    /// The DeltaNet state of `layer` of a slot: the conv history and the recurrent state.
    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)>;

    fn store_stats(&mut self) -> StoreStats;

    /// The most KV pages a store of `slots` slots of `layout` could hold in the memory this
    /// backend has free now (after giving back its current store), or `None` when the backend
    /// does not budget its memory (host RAM: the pool is a count, buffers come on demand). An
    /// engine clamps its pool to this before [`SeqStore::configure`].
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>>;
}

/// The host [`SeqStore`]: KV pages from a [`PagePool`], DeltaNet state of all slots in one
/// buffer `[slot][delta layer][conv | rec]`.
#[derive(Debug)]
pub struct HostStore {
    dev: DeviceId,
    layout: StateLayout,
    pool: PagePool,
    reclaim: Arc<Reclaim>,
    /// Per slot: in use, length, K/V rows per attention layer.
    slots: Vec<SlotKv>,
    delta: Vec<f32>,
    snaps: Vec<Option<SnapState>>,
}

#[derive(Debug, Clone)]
struct SlotKv {
    used: bool,
    len: usize,
    kv: Vec<(KvRows, KvRows)>,
}

#[derive(Debug)]
struct SnapState {
    len: usize,
    kv: Vec<(KvRows, KvRows)>,
    delta: StateCopy,
}

/// A snapshot's copy of a slot's DeltaNet state, in an anonymous mapping of its own with
/// transparent huge pages asked for (Linux; elsewhere the hint is skipped). While the prompt
/// cache fills, every snapshot is new memory: from the heap its 4 KiB pages were faulted in and
/// zeroed one at a time, ~6,000 for the 25 MB state of `small`, two snapshots a request, and
/// requests through `ember serve` prefilled at 0.92 of the same prompts with the cache off
/// (2-core Xeon VM, 2026-12-05; 0.97 with THP on for the whole system).
struct StateCopy {
    map: memmap2::MmapMut,
    len: usize,
}

impl StateCopy {
    /// A copy of `src`; None when the system has no memory for it.
    fn of(src: &[f32]) -> Option<StateCopy> {
        let mut map = memmap2::MmapOptions::new().len((4 * src.len()).max(1)).map_anon().ok()?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        for (d, x) in map.chunks_exact_mut(4).zip(src) {
            d.copy_from_slice(&x.to_ne_bytes());
        }
        Some(StateCopy { map, len: src.len() })
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Writes the copy into `dst` (of the copy's length).
    fn copy_to(&self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len, "a state copy restored into a slot of another size");
        for (d, b) in dst.iter_mut().zip(self.map.chunks_exact(4)) {
            *d = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

impl std::fmt::Debug for StateCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StateCopy({} values)", self.len)
    }
}

impl HostStore {
    pub fn new(dev: DeviceId) -> Self {
        let layout = StateLayout { layers: Vec::new(), kv_type: KvType::F16, kv_width: 0, conv: 0, rec: 0 };
        HostStore { dev, layout, pool: PagePool::new(0), reclaim: Reclaim::new(), slots: Vec::new(), delta: Vec::new(), snaps: Vec::new() }
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    fn err(&self, op: &'static str, shapes: String, cause: impl Into<String>) -> OpError {
        OpError::new(op, self.dev, shapes, cause)
    }

    /// Frees what holders dropped.
    fn reclaim(&mut self) {
        let (slots, snaps) = self.reclaim.take();
        for s in slots {
            if let Some(st) = self.slots.get_mut(s as usize) {
                st.used = false;
                st.len = 0;
                st.kv.iter_mut().for_each(|(k, v)| {
                    k.truncate(0);
                    v.truncate(0);
                });
            }
        }
        for s in snaps {
            if let Some(x) = self.snaps.get_mut(s as usize) {
                *x = None;
            }
        }
    }

    /// The index of a live slot of this store.
    pub fn slot_index(&mut self, op: &'static str, slot: &Slot) -> OpResult<usize> {
        self.reclaim();
        let i = slot.id().0 as usize;
        if !self.reclaim.owns_slot(slot) || !self.slots.get(i).is_some_and(|s| s.used) {
            return Err(self.err(op, slot.id().to_string(), "the slot does not belong to this store (or it was reconfigured)"));
        }
        Ok(i)
    }

    /// Checks that `slot` is live (by id, as a batch names it) and returns its length.
    pub fn live_len(&self, op: &'static str, slot: SlotId) -> OpResult<usize> {
        match self.slots.get(slot.0 as usize) {
            Some(s) if s.used => Ok(s.len),
            _ => Err(self.err(op, slot.to_string(), "no such slot in use")),
        }
    }

    /// Adds `n` tokens to the length of `slot` (the step that fed them is done).
    pub fn advance(&mut self, slot: SlotId, n: usize) {
        if let Some(s) = self.slots.get_mut(slot.0 as usize) {
            s.len += n;
        }
    }

    /// The ordinal of `layer` among the layers of `kind`.
    pub fn ordinal(&self, op: &'static str, layer: LayerIdx, kind: StateKind) -> OpResult<usize> {
        let l = layer.0 as usize;
        match self.layout.layers.get(l) {
            Some(k) if *k == kind => Ok(self.layout.layers[..l].iter().filter(|x| **x == kind).count()),
            Some(k) => Err(self.err(op, layer.to_string(), format!("the layer holds {k:?} state, not {kind:?}"))),
            None => Err(self.err(op, layer.to_string(), format!("the store has {} layers", self.layout.layers.len()))),
        }
    }

    /// The K/V rows of attention layer ordinal `a` of each slot in `slots` (distinct), and the
    /// page pool to grow them from.
    pub fn kv_of(&mut self, op: &'static str, slots: &[SlotId], a: usize) -> OpResult<(Vec<(&mut KvRows, &mut KvRows)>, &PagePool)> {
        distinct(op, self.dev, slots)?;
        let mut by: Vec<Option<&mut SlotKv>> = self.slots.iter_mut().map(Some).collect();
        let mut out = Vec::with_capacity(slots.len());
        for s in slots {
            let st = by.get_mut(s.0 as usize).and_then(Option::take).filter(|st| st.used);
            let st = st.ok_or_else(|| OpError::new(op, self.dev, s.to_string(), "no such slot in use"))?;
            let (k, v) = &mut st.kv[a];
            out.push((k, v));
        }
        Ok((out, &self.pool))
    }

    /// The conv history and recurrent state of DeltaNet layer ordinal `d` of each slot.
    pub fn delta_of(&mut self, op: &'static str, slots: &[SlotId], d: usize) -> OpResult<DeltaStates<'_>> {
        distinct(op, self.dev, slots)?;
        let (conv, rec, nd) = (self.layout.conv, self.layout.rec, self.layout.n_delta_layers());
        let per_slot = nd * (conv + rec);
        for s in slots {
            self.live_len(op, *s)?;
        }
        let mut by: Vec<Option<&mut [f32]>> = if per_slot == 0 { vec![] } else { self.delta.chunks_mut(per_slot).map(Some).collect() };
        let (mut cs, mut rs) = (Vec::with_capacity(slots.len()), Vec::with_capacity(slots.len()));
        for s in slots {
            let st = by.get_mut(s.0 as usize).and_then(Option::take);
            let st = st.ok_or_else(|| OpError::new(op, self.dev, s.to_string(), "the store holds no DeltaNet state"))?;
            let (c, r) = st[d * (conv + rec)..(d + 1) * (conv + rec)].split_at_mut(conv);
            cs.push(c);
            rs.push(r);
        }
        Ok((cs, rs))
    }

    fn delta_range(&self, slot: usize) -> std::ops::Range<usize> {
        let per = self.layout.n_delta_layers() * (self.layout.conv + self.layout.rec);
        slot * per..(slot + 1) * per
    }
}

/// Per sequence: the conv history and the recurrent state of one DeltaNet layer.
pub type DeltaStates<'a> = (Vec<&'a mut [f32]>, Vec<&'a mut [f32]>);

fn distinct(op: &'static str, dev: DeviceId, slots: &[SlotId]) -> OpResult<()> {
    for (i, s) in slots.iter().enumerate() {
        if slots[..i].contains(s) {
            return Err(OpError::new(op, dev, s.to_string(), "a slot appears twice in one step"));
        }
    }
    Ok(())
}

impl SeqStore for HostStore {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        const OP: &str = "configure";
        if layout.n_kv_layers() > 0 && layout.kv_type.ggml().row_bytes(layout.kv_width).is_none() {
            return Err(self.err(
                OP,
                format!("kv width {}", layout.kv_width),
                format!("not a whole number of {:?} blocks", layout.kv_type),
            ));
        }
        let per_slot = layout.n_delta_layers() * (layout.conv + layout.rec);
        let total = slots.checked_mul(per_slot).filter(|n| n.checked_mul(4).is_some_and(|b| b < isize::MAX as usize));
        let Some(total) = total else {
            return Err(self.err(OP, format!("{slots} slots"), "the DeltaNet state does not fit in memory"));
        };
        let kv =
            (0..layout.n_kv_layers()).map(|_| (KvRows::new(layout.kv_type, layout.kv_width), KvRows::new(layout.kv_type, layout.kv_width)));
        let slot = SlotKv { used: false, len: 0, kv: kv.collect() };
        // Holders of the old store's slots and snapshots are refused from now on.
        self.reclaim = Reclaim::new();
        self.slots = vec![slot; slots];
        self.delta = Vec::new();
        self.delta
            .try_reserve_exact(total)
            .map_err(|_| self.err(OP, format!("{slots} slots"), format!("cannot allocate {} bytes of DeltaNet state", 4 * total)))?;
        self.delta.resize(total, 0.0);
        self.snaps = Vec::new();
        self.pool = PagePool::new(kv_pages);
        self.layout = layout;
        Ok(())
    }

    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.reclaim();
        let Some(i) = self.slots.iter().position(|s| !s.used) else {
            return Err(self.err("alloc_slot", String::new(), format!("all {} slots are in use", self.slots.len())));
        };
        self.slots[i].used = true;
        self.slots[i].len = 0;
        let r = self.delta_range(i);
        self.delta[r].fill(0.0);
        Ok(self.reclaim.slot(i as u32))
    }

    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        let i = self.slot_index("clear_slot", slot)?;
        let s = &mut self.slots[i];
        s.len = 0;
        s.kv.iter_mut().for_each(|(k, v)| {
            k.truncate(0);
            v.truncate(0);
        });
        let r = self.delta_range(i);
        self.delta[r].fill(0.0);
        Ok(())
    }

    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        let i = self.slot_index("slot_len", slot)?;
        Ok(self.slots[i].len)
    }

    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        let i = self.slot_index("snapshot", slot)?;
        let Some(delta) = StateCopy::of(&self.delta[self.delta_range(i)]) else {
            let bytes = 4 * self.delta_range(i).len();
            return Err(self.err("snapshot", format!("slot {i}"), format!("no memory for a {bytes}-byte state copy")));
        };
        let s = &self.slots[i];
        let state = SnapState { len: s.len, kv: s.kv.clone(), delta };
        let mut pages = Vec::new();
        for (k, v) in &state.kv {
            for c in [k, v] {
                let pb = KV_PAGE * c.row_bytes();
                pages.extend(c.pages().iter().map(|p| (Arc::as_ptr(p) as usize, pb)));
            }
        }
        let info = SnapInfo { len: state.len, own_bytes: 4 * state.delta.len(), pages };
        let id = match self.snaps.iter().position(Option::is_none) {
            Some(j) => {
                self.snaps[j] = Some(state);
                j
            }
            None => {
                self.snaps.push(Some(state));
                self.snaps.len() - 1
            }
        };
        Ok(self.reclaim.snapshot(id as u32, info))
    }

    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        const OP: &str = "restore";
        let i = self.slot_index(OP, slot)?;
        let st = if self.reclaim.owns_snapshot(snap) { self.snaps.get(snap.id() as usize).and_then(Option::as_ref) } else { None };
        let Some(st) = st else {
            return Err(self.err(OP, format!("snapshot {}", snap.id()), "the snapshot does not belong to this store"));
        };
        let r = self.delta_range(i);
        st.delta.copy_to(&mut self.delta[r]);
        let s = &mut self.slots[i];
        s.len = st.len;
        for (dst, src) in s.kv.iter_mut().zip(&st.kv) {
            dst.0.clone_from(&src.0);
            dst.1.clone_from(&src.1);
        }
        Ok(())
    }

    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        const OP: &str = "read_delta";
        let i = self.slot_index(OP, slot)?;
        let d = self.ordinal(OP, layer, StateKind::Delta)?;
        let (cs, rs) = self.delta_of(OP, &[SlotId(i as u32)], d)?;
        Ok((cs[0].to_vec(), rs[0].to_vec()))
    }

    fn kv_pages_that_fit(&mut self, _layout: &StateLayout, _slots: usize) -> OpResult<Option<usize>> {
        Ok(None)
    }

    fn store_stats(&mut self) -> StoreStats {
        self.reclaim();
        StoreStats {
            slots: self.slots.len(),
            slots_free: self.slots.iter().filter(|s| !s.used).count(),
            pages: self.pool.cap(),
            pages_free: self.pool.cap().saturating_sub(self.pool.used()),
            page_bytes: self.layout.page_bytes(),
            snapshots: self.snaps.iter().filter(|s| s.is_some()).count(),
        }
    }
}
