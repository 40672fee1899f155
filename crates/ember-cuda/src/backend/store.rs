//! The device [`SeqStore`]: the same semantics as [`ember_ops::HostStore`] with the state in
//! GPU memory.
//!
//! * DeltaNet conv history and recurrent state of every slot in one buffer
//!   `[slot][delta layer][conv | rec]` (f32), allocated at `configure`.
//! * K and V rows in pages of [`KV_PAGE`] rows in one pool of `kv_pages` pages (rows of the
//!   layout's KV type, as the CPU stores them). The page tables live here on the host, one per
//!   (slot, KV layer, K or V), with a reference count per page (a slot and the snapshots that
//!   share a page each hold one); the device copy of the tables (`[cache][stride]` page ids,
//!   cache `(slot · n_kv + layer) · 2 + kv`) is uploaded when they change, before the next
//!   kernel that reads them. The stride (pages per cache) grows by doubling when a cache
//!   outgrows it.
//! * A snapshot shares every page (+1 reference) and copies the DeltaNet state device to device
//!   into a buffer of its own; the next append into a shared, partial last page copies that
//!   page first (copy-on-write), so a snapshot never sees later writes.

use std::sync::Arc;

use ember_ops::store::Reclaim;
use ember_ops::{
    DeviceId, KV_PAGE, KvType, LayerIdx, OpError, OpResult, Slot, SlotId, SnapInfo, Snapshot, StateKind, StateLayout, StoreStats,
};

use crate::{Buf, Gpu};

/// One K or V cache: its length and its pages (page i holds positions i·KV_PAGE..).
#[derive(Debug, Clone, Default)]
pub(super) struct Cache {
    pub len: usize,
    pub pages: Vec<u32>,
}

#[derive(Debug)]
struct SlotState {
    used: bool,
    len: usize,
    /// `2 · n_kv` caches: K then V of every attention layer.
    caches: Vec<Cache>,
}

struct SnapState {
    len: usize,
    caches: Vec<Cache>,
    delta: Buf<f32>,
}

pub(super) struct DevStore {
    dev: DeviceId,
    pub layout: StateLayout,
    reclaim: Arc<Reclaim>,
    slots: Vec<SlotState>,
    /// `[slot][delta layer][conv | rec]`; `None` before `configure`.
    pub delta: Option<Buf<f32>>,
    /// `cap` pages of `page_bytes`.
    pub pool: Option<Buf<u8>>,
    pub cap: usize,
    refs: Vec<u32>,
    free: Vec<u32>,
    /// The page tables, `[cache][stride]`, and their device copy.
    table: Vec<u32>,
    pub stride: usize,
    pub dev_table: Option<Buf<u32>>,
    dirty: bool,
    snaps: Vec<Option<SnapState>>,
}

fn err(op: &'static str, dev: DeviceId, shapes: impl Into<String>, cause: impl Into<String>) -> OpError {
    OpError::new(op, dev, shapes, cause)
}

fn cuda(op: &'static str, dev: DeviceId) -> impl Fn(crate::Error) -> OpError {
    move |e| OpError::new(op, dev, "", e.to_string())
}

impl DevStore {
    /// The KV pool's view for attention layer ordinal `layer` (kv_append, attention); an error
    /// while the store is not configured.
    pub(super) fn kv_pages(&self, op: &'static str, dev: DeviceId, layer: usize) -> OpResult<crate::ops::KvPages<'_>> {
        let (Some(pool), Some(table)) = (self.pool.as_ref(), self.dev_table.as_ref()) else {
            return Err(OpError::new(op, dev, "", "the store is not configured"));
        };
        Ok(crate::ops::KvPages {
            pool,
            table,
            ty: self.layout.kv_type.ggml(),
            width: self.layout.kv_width,
            n_pages: self.cap,
            stride: self.stride,
            n_kv: self.n_kv(),
            n_slots: self.n_slots(),
            layer,
        })
    }

    pub fn new(dev: DeviceId) -> Self {
        let layout = StateLayout { layers: Vec::new(), kv_type: KvType::F16, kv_width: 0, conv: 0, rec: 0 };
        DevStore {
            dev,
            layout,
            reclaim: Reclaim::new(),
            slots: Vec::new(),
            delta: None,
            pool: None,
            cap: 0,
            refs: Vec::new(),
            free: Vec::new(),
            table: Vec::new(),
            stride: 1,
            dev_table: None,
            dirty: false,
            snaps: Vec::new(),
        }
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn n_kv(&self) -> usize {
        self.layout.n_kv_layers()
    }

    /// Floats of one slot's DeltaNet state (every delta layer).
    pub fn slot_floats(&self) -> usize {
        self.layout.n_delta_layers() * (self.layout.conv + self.layout.rec)
    }

    pub fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }

    /// Frees what holders dropped.
    fn reclaim(&mut self) {
        let (slots, snaps) = self.reclaim.take();
        for s in slots {
            let i = s as usize;
            if i < self.slots.len() {
                self.slots[i].used = false;
                self.slots[i].len = 0;
                self.drop_caches(i);
            }
        }
        for s in snaps {
            if let Some(st) = self.snaps.get_mut(s as usize).and_then(Option::take) {
                st.caches.into_iter().flat_map(|c| c.pages).for_each(|p| self.release(p));
            }
        }
    }

    fn release(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(page);
        }
    }

    fn take_page(&mut self) -> Option<u32> {
        let p = self.free.pop()?;
        self.refs[p as usize] = 1;
        Some(p)
    }

    fn used_pages(&self) -> usize {
        self.cap - self.free.len()
    }

    /// The index of a live slot of this store (frees dropped holders first).
    pub fn slot_index(&mut self, op: &'static str, slot: &Slot) -> OpResult<usize> {
        self.reclaim();
        let i = slot.id().0 as usize;
        if !self.reclaim.owns_slot(slot) || !self.slots.get(i).is_some_and(|s| s.used) {
            return Err(err(op, self.dev, slot.id().to_string(), "the slot does not belong to this store (or it was reconfigured)"));
        }
        Ok(i)
    }

    /// Frees dropped holders (at the start of a step).
    pub fn collect(&mut self) {
        self.reclaim();
    }

    /// Checks that `slot` is live (by id, as a batch names it) and returns its length.
    pub fn live_len(&self, op: &'static str, slot: SlotId) -> OpResult<usize> {
        match self.slots.get(slot.0 as usize) {
            Some(s) if s.used => Ok(s.len),
            _ => Err(err(op, self.dev, slot.to_string(), "no such slot in use")),
        }
    }

    /// Checks every slot of a step is live and appears once.
    pub fn live_all(&self, op: &'static str, slots: &[SlotId]) -> OpResult<()> {
        for (i, s) in slots.iter().enumerate() {
            if slots[..i].contains(s) {
                return Err(err(op, self.dev, s.to_string(), "a slot appears twice in one step"));
            }
            self.live_len(op, *s)?;
        }
        Ok(())
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
            Some(k) => Err(err(op, self.dev, layer.to_string(), format!("the layer holds {k:?} state, not {kind:?}"))),
            None => Err(err(op, self.dev, layer.to_string(), format!("the store has {} layers", self.layout.layers.len()))),
        }
    }

    /// The K (kv = 0) or V (kv = 1) cache of attention layer ordinal `a` of `slot`.
    pub fn cache(&self, slot: SlotId, a: usize, kv: usize) -> &Cache {
        &self.slots[slot.0 as usize].caches[2 * a + kv]
    }

    /// What [`DevStore::grow`] with these arguments takes from the pool (new pages, and copies
    /// of shared partial last pages) and the most pages a cache then has.
    fn page_need(&self, slots: &[SlotId], n: &[usize], a: usize) -> (usize, usize) {
        let (mut need, mut most) = (0, 0);
        for (s, &n) in slots.iter().zip(n) {
            for kv in 0..2 {
                let c = self.cache(*s, a, kv);
                let pages = (c.len + n).div_ceil(KV_PAGE);
                need += pages.saturating_sub(c.pages.len());
                if !c.len.is_multiple_of(KV_PAGE) && n > 0 && c.pages.last().is_some_and(|p| self.refs[*p as usize] > 1) {
                    need += 1;
                }
                most = most.max(pages);
            }
        }
        (need, most)
    }

    /// Whether [`DevStore::grow`] with these arguments, then [`DevStore::sync_table`], writes
    /// the page table (a page changes, or the table already has changes to write).
    pub fn grow_writes_table(&self, slots: &[SlotId], n: &[usize], a: usize) -> bool {
        self.dirty || self.page_need(slots, n, a).0 > 0
    }

    /// Makes room for `n[i]` more rows in the K and V caches of layer ordinal `a` of each
    /// `slots[i]` (live, distinct): new pages from the pool, a shared partial last page copied
    /// first. Returns each sequence's length before. Nothing changes when the pool has too few
    /// pages: an error naming the pool.
    pub fn grow(&mut self, gpu: &Gpu, op: &'static str, slots: &[SlotId], n: &[usize], a: usize) -> OpResult<Vec<usize>> {
        self.reserve(gpu, op, slots, n, a)?;
        let mut before = Vec::with_capacity(slots.len());
        for (s, &n) in slots.iter().zip(n) {
            let i = s.0 as usize;
            before.push(self.slots[i].caches[2 * a].len);
            if n > 0 {
                for kv in 0..2 {
                    self.slots[i].caches[2 * a + kv].len += n;
                }
            }
        }
        Ok(before)
    }

    /// [`DevStore::grow`]'s pages without the rows: every page the `n[i]` more rows need is in
    /// the cache's list (and the host table) and not shared, and the caches' lengths stay. A
    /// step that reserves before it is queued ([`DevStore::can_reserve`]) writes no table from
    /// its `kv_append`s.
    pub fn reserve(&mut self, gpu: &Gpu, op: &'static str, slots: &[SlotId], n: &[usize], a: usize) -> OpResult<()> {
        let (need, most) = self.page_need(slots, n, a);
        if need > self.free.len() {
            return Err(err(
                op,
                self.dev,
                format!("{} more pages, {} free", need, self.free.len()),
                format!("the KV page pool is full ({} pages)", self.cap),
            ));
        }
        if most > self.stride {
            self.grow_stride(most);
        }
        let pb = self.page_bytes();
        for (s, &n) in slots.iter().zip(n) {
            let i = s.0 as usize;
            for kv in 0..2 {
                let ci = 2 * a + kv;
                let len = self.slots[i].caches[ci].len;
                if n == 0 {
                    continue;
                }
                // The device table is rewritten only when a page changes (a new or copied
                // page), not on every append: an upload mid-step splits the step's graph.
                let mut changed = false;
                if !len.is_multiple_of(KV_PAGE) {
                    let last = self.slots[i].caches[ci].pages.len() - 1;
                    let old = self.slots[i].caches[ci].pages[last];
                    if self.refs[old as usize] > 1 {
                        // unwrap-free: the count above reserved this page.
                        let new = self.take_page().ok_or_else(|| err(op, self.dev, "", "page accounting"))?;
                        let pool = self.pool.as_mut().ok_or_else(|| err(op, self.dev, "", "no KV pool"))?;
                        gpu.copy_within(pool, old as usize * pb, new as usize * pb, pb).map_err(cuda(op, self.dev))?;
                        self.release(old);
                        self.slots[i].caches[ci].pages[last] = new;
                        changed = true;
                    }
                }
                let pages = (len + n).div_ceil(KV_PAGE);
                while self.slots[i].caches[ci].pages.len() < pages {
                    let p = self.take_page().ok_or_else(|| err(op, self.dev, "", "page accounting"))?;
                    self.slots[i].caches[ci].pages.push(p);
                    changed = true;
                }
                if changed {
                    self.write_table(i, ci);
                }
            }
        }
        Ok(())
    }

    /// Whether the pool holds the pages [`DevStore::reserve`] takes for `n[i]` more rows of
    /// every attention layer of each `slots[i]`.
    pub fn can_reserve(&self, slots: &[SlotId], n: &[usize]) -> bool {
        (0..self.n_kv()).map(|a| self.page_need(slots, n, a).0).sum::<usize>() <= self.free.len()
    }

    fn table_row(&self, slot: usize, ci: usize) -> usize {
        (slot * 2 * self.n_kv() + ci) * self.stride
    }

    /// Copies cache `ci` of `slot`'s page list into the host table.
    fn write_table(&mut self, slot: usize, ci: usize) {
        let at = self.table_row(slot, ci);
        let pages = &self.slots[slot].caches[ci].pages;
        self.table[at..at + pages.len()].copy_from_slice(pages);
        self.dirty = true;
    }

    fn grow_stride(&mut self, at_least: usize) {
        let stride = at_least.max(2 * self.stride);
        self.stride = stride;
        self.table = vec![0; self.slots.len() * 2 * self.n_kv() * stride];
        for s in 0..self.slots.len() {
            for c in 0..self.slots[s].caches.len() {
                self.write_table(s, c);
            }
        }
        self.dirty = true;
    }

    /// Uploads the page tables if they changed.
    pub fn sync_table(&mut self, gpu: &Gpu, op: &'static str) -> OpResult<()> {
        if !self.dirty {
            return Ok(());
        }
        let len = self.table.len().max(1);
        if self.dev_table.as_ref().is_none_or(|t| t.len() < len) {
            self.dev_table = None;
            self.dev_table = Some(gpu.zeros(len).map_err(cuda(op, self.dev))?);
        }
        // Queued, not waited for (through a pinned buffer): a page table written mid-step no
        // longer stalls the step, and one written before a step queued ahead does not wait
        // for the step before it.
        if let Some(t) = self.dev_table.as_mut()
            && !self.table.is_empty()
        {
            gpu.write_async(t, &self.table).map_err(cuda(op, self.dev))?;
        }
        self.dirty = false;
        Ok(())
    }

    /// Where DeltaNet layer ordinal `d` sits in a slot: (conv offset, rec offset) in floats.
    pub fn delta_at(&self, d: usize) -> (usize, usize) {
        let per = self.layout.conv + self.layout.rec;
        (d * per, d * per + self.layout.conv)
    }

    fn drop_caches(&mut self, slot: usize) {
        for c in 0..self.slots[slot].caches.len() {
            let pages = std::mem::take(&mut self.slots[slot].caches[c].pages);
            self.slots[slot].caches[c].len = 0;
            pages.into_iter().for_each(|p| self.release(p));
        }
    }

    fn zero_delta(&mut self, gpu: &Gpu, op: &'static str, slot: usize) -> OpResult<()> {
        let per = self.slot_floats();
        match self.delta.as_mut() {
            Some(d) if per > 0 => gpu.zero_range(d, slot * per, per).map_err(cuda(op, self.dev)),
            _ => Ok(()),
        }
    }

    pub fn configure(&mut self, gpu: &Gpu, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        const OP: &str = "configure";
        let dev = self.dev;
        if layout.n_kv_layers() > 0 && layout.kv_type.ggml().row_bytes(layout.kv_width).is_none() {
            return Err(err(
                OP,
                dev,
                format!("kv width {}", layout.kv_width),
                format!("not a whole number of {:?} blocks", layout.kv_type),
            ));
        }
        let per_slot = layout.n_delta_layers() * (layout.conv + layout.rec);
        let Some(floats) = slots.checked_mul(per_slot).filter(|n| n.checked_mul(4).is_some_and(|b| b < isize::MAX as usize)) else {
            return Err(err(OP, dev, format!("{slots} slots"), "the DeltaNet state does not fit in memory"));
        };
        let n_kv = layout.n_kv_layers();
        let pool_pages = if n_kv == 0 { 0 } else { kv_pages };
        let Some(pool_bytes) = pool_pages.checked_mul(layout.page_bytes()).filter(|b| *b < isize::MAX as usize) else {
            return Err(err(OP, dev, format!("{kv_pages} pages"), "the KV pool does not fit in memory"));
        };
        if u32::try_from(kv_pages).is_err() {
            return Err(err(OP, dev, format!("{kv_pages} pages"), "at most 2^32 − 1 pages"));
        }
        // Holders of the old store's slots and snapshots are refused from now on; its memory is
        // given back before the new store's is taken.
        self.reclaim = Reclaim::new();
        self.slots = Vec::new();
        self.snaps = Vec::new();
        self.delta = None;
        self.pool = None;
        self.dev_table = None;
        self.cap = 0;
        self.refs = Vec::new();
        self.free = Vec::new();
        self.table = Vec::new();
        self.layout = StateLayout { layers: Vec::new(), ..layout.clone() };
        let delta = gpu
            .zeros::<f32>(floats)
            .map_err(|e| err(OP, dev, format!("{slots} slots"), format!("cannot allocate {} bytes of DeltaNet state: {e}", 4 * floats)))?;
        let pool = gpu
            .alloc::<u8>(pool_bytes)
            .map_err(|e| err(OP, dev, format!("{kv_pages} pages"), format!("cannot allocate {pool_bytes} bytes of KV pages: {e}")))?;
        self.delta = Some(delta);
        self.pool = Some(pool);
        self.cap = kv_pages;
        self.refs = vec![0; kv_pages];
        self.free = (0..kv_pages as u32).rev().collect();
        let caches = vec![Cache::default(); 2 * n_kv];
        self.slots = (0..slots).map(|_| SlotState { used: false, len: 0, caches: caches.clone() }).collect();
        self.layout = layout;
        self.stride = kv_pages.clamp(1, 32);
        self.table = vec![0; slots * 2 * n_kv * self.stride];
        self.dirty = true;
        Ok(())
    }

    pub fn alloc_slot(&mut self, gpu: &Gpu) -> OpResult<Slot> {
        self.reclaim();
        let Some(i) = self.slots.iter().position(|s| !s.used) else {
            return Err(err("alloc_slot", self.dev, String::new(), format!("all {} slots are in use", self.slots.len())));
        };
        self.zero_delta(gpu, "alloc_slot", i)?;
        self.slots[i].used = true;
        self.slots[i].len = 0;
        Ok(self.reclaim.slot(i as u32))
    }

    pub fn clear_slot(&mut self, gpu: &Gpu, slot: &Slot) -> OpResult<()> {
        let i = self.slot_index("clear_slot", slot)?;
        self.drop_caches(i);
        self.slots[i].len = 0;
        self.zero_delta(gpu, "clear_slot", i)
    }

    pub fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        let i = self.slot_index("slot_len", slot)?;
        Ok(self.slots[i].len)
    }

    pub fn snapshot(&mut self, gpu: &Gpu, slot: &Slot) -> OpResult<Snapshot> {
        const OP: &str = "snapshot";
        let i = self.slot_index(OP, slot)?;
        let per = self.slot_floats();
        let mut copy = gpu.alloc::<f32>(per).map_err(cuda(OP, self.dev))?;
        if let Some(d) = self.delta.as_ref() {
            gpu.copy(d, i * per, &mut copy, 0, per).map_err(cuda(OP, self.dev))?;
        }
        let caches = self.slots[i].caches.clone();
        let pb = self.page_bytes();
        let mut pages = Vec::new();
        for c in &caches {
            for &p in &c.pages {
                self.refs[p as usize] += 1;
                pages.push((p as usize, pb));
            }
        }
        let state = SnapState { len: self.slots[i].len, caches, delta: copy };
        let info = SnapInfo { len: state.len, own_bytes: 4 * per, pages };
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

    pub fn restore(&mut self, gpu: &Gpu, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        const OP: &str = "restore";
        let i = self.slot_index(OP, slot)?;
        let known = self.reclaim.owns_snapshot(snap) && self.snaps.get(snap.id() as usize).is_some_and(Option::is_some);
        if !known {
            return Err(err(OP, self.dev, format!("snapshot {}", snap.id()), "the snapshot does not belong to this store"));
        }
        let per = self.slot_floats();
        let (len, caches) = {
            // unwrap-free: checked just above.
            let st = self.snaps[snap.id() as usize].as_ref().ok_or_else(|| err(OP, self.dev, "", "snapshot"))?;
            if let Some(d) = self.delta.as_mut() {
                gpu.copy(&st.delta, 0, d, i * per, per).map_err(cuda(OP, self.dev))?;
            }
            (st.len, st.caches.clone())
        };
        self.drop_caches(i);
        for c in &caches {
            for &p in &c.pages {
                self.refs[p as usize] += 1;
            }
        }
        self.slots[i].caches = caches;
        self.slots[i].len = len;
        for c in 0..self.slots[i].caches.len() {
            let most = self.slots[i].caches[c].pages.len();
            if most > self.stride {
                self.grow_stride(most);
            }
            self.write_table(i, c);
        }
        Ok(())
    }

    pub fn read_delta(&mut self, gpu: &Gpu, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        const OP: &str = "read_delta";
        let i = self.slot_index(OP, slot)?;
        let d = self.ordinal(OP, layer, StateKind::Delta)?;
        let (c, r) = self.delta_at(d);
        let base = i * self.slot_floats();
        let buf = self.delta.as_ref().ok_or_else(|| err(OP, self.dev, "", "the store holds no DeltaNet state"))?;
        let conv = gpu.download_range(buf, base + c, self.layout.conv).map_err(cuda(OP, self.dev))?;
        let rec = gpu.download_range(buf, base + r, self.layout.rec).map_err(cuda(OP, self.dev))?;
        Ok((conv, rec))
    }

    pub fn store_stats(&mut self) -> StoreStats {
        self.reclaim();
        StoreStats {
            slots: self.slots.len(),
            slots_free: self.slots.iter().filter(|s| !s.used).count(),
            pages: self.cap,
            pages_free: self.cap - self.used_pages(),
            page_bytes: self.layout.page_bytes(),
            snapshots: self.snaps.iter().filter(|s| s.is_some()).count(),
        }
    }
}
