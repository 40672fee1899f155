//! Memory pressure: the tier gives experts back when another process takes GPU memory and
//! takes them again when it returns ([`Hybrid::watch_memory`]).

use std::time::{Duration, Instant};

use ember_ops::{ExpertId, LayerIdx};

use super::{GIB, Hybrid, say};

/// Watching the GPU's free memory (see [`Hybrid::watch_memory`]).
#[derive(Debug, Clone)]
pub(super) struct Pressure {
    reserve: u64,
    last: Instant,
    /// Per layer, the experts the plan gave it: what growth returns to.
    target: Vec<usize>,
}

/// How often the free memory is read.
const WATCH_EVERY: Duration = Duration::from_millis(200);
/// Eviction frees this much beyond the reserve; growth leaves this much beyond it (so the two
/// never alternate).
const EVICT_SLACK: u64 = 64 << 20;
const GROW_SLACK: u64 = 512 << 20;
/// Layers re-uploaded per check when memory comes back (each is a stall of tens of ms).
const GROW_LAYERS: usize = 4;

impl Hybrid {
    /// Keeps `reserve` bytes of the GPU free while serving: when another process takes memory
    /// and the free memory falls below it, the coldest resident experts (of any layer it owns; a layer
    /// holding all its experts becomes one with slots) leave the GPU until it is back, and
    /// their pairs run on the CPU; when memory comes back, layers grow again towards the plan's
    /// counts, hottest experts first. Checked at step ends, every [`WATCH_EVERY`].
    pub fn watch_memory(&mut self, reserve: u64) {
        let target = (0..self.resident.len().max(self.partial.len()))
            .map(|l| {
                let n = self.host.moe("watch_memory", LayerIdx(l as u16)).map_or(0, |m| m.n_expert);
                self.resident.get(l).and_then(|r| r.as_ref()).map_or(n, Vec::len)
            })
            .collect();
        self.pressure = Some(Pressure { reserve, last: Instant::now(), target });
    }

    /// The experts `layer` holds now.
    fn held(&self, layer: LayerIdx) -> Vec<u16> {
        match self.gpu.slot_experts(layer) {
            Some(e) => e.to_vec(),
            None => {
                let n = self.host.moe("watch_memory", layer).map_or(0, |m| m.n_expert);
                (0..n as u16).collect()
            }
        }
    }

    fn expert_bytes(&self, layer: LayerIdx) -> u64 {
        self.host.expert("watch_memory", layer, ExpertId(0)).map_or(0, |v| (v.gate.data.len() + v.up.data.len() + v.down.data.len()) as u64)
    }

    /// `layer` holds `list` from now on; on failure (the memory went meanwhile) none, and the
    /// CPU takes all its experts. What the pressure watch does; public for tests and tools.
    pub fn set_layer(&mut self, layer: LayerIdx, list: Vec<u16>) {
        // The re-upload waits for the stream, which may wait on a posted mailbox.
        if let Err(e) = self.drain() {
            say(format!("expert tier: {e}"));
        }
        if let Some(p) = self.partial.get_mut(layer.index()) {
            *p = true;
        } else {
            self.partial.resize(layer.index() + 1, false);
            self.partial[layer.index()] = true;
        }
        if let Err(e) = self.gpu.set_layer_experts(layer, list)
            && let Err(e2) = self.gpu.set_layer_experts(layer, Vec::new())
        {
            say(format!("expert tier: {layer} lost its experts ({e}) and could not be emptied ({e2})"));
        }
    }

    pub(super) fn check_memory(&mut self) {
        let Some(p) = self.pressure.as_mut() else { return };
        if p.last.elapsed() < WATCH_EVERY {
            return;
        }
        p.last = Instant::now();
        let (reserve, target) = (p.reserve, p.target.clone());
        let Ok((free, _)) = self.gpu.mem_info() else { return };
        let free = free as u64;
        let n_layer = target.len();
        if free < reserve {
            // The coldest residents first; equal heat (no routing seen yet) spreads over layers.
            let need = reserve - free + EVICT_SLACK;
            let mut res: Vec<(f64, u16, usize)> = Vec::new();
            for l in (0..n_layer).filter(|&l| self.owns(l)) {
                for e in self.held(LayerIdx(l as u16)) {
                    res.push((self.heat.get(l, e as usize), e, l));
                }
            }
            res.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            let mut out: Vec<Vec<u16>> = vec![Vec::new(); n_layer];
            let mut freed = 0u64;
            for (_, e, l) in res {
                if freed >= need {
                    break;
                }
                freed += self.expert_bytes(LayerIdx(l as u16));
                out[l].push(e);
            }
            let n: usize = out.iter().map(Vec::len).sum();
            let layers: Vec<usize> = (0..n_layer).filter(|&l| !out[l].is_empty()).collect();
            for &l in &layers {
                let layer = LayerIdx(l as u16);
                let keep: Vec<u16> = self.held(layer).into_iter().filter(|e| !out[l].contains(e)).collect();
                self.set_layer(layer, keep);
            }
            let after = self.gpu.mem_info().map_or(0, |m| m.0 as u64);
            self.stats.evictions += n as u64;
            say(format!(
                "expert tier: GPU free memory {:.2} GiB is below the reserve {:.2} GiB (another process took memory): {n} experts left the GPU from {} layers ({:.2} GiB); free now {:.2} GiB",
                free as f64 / GIB,
                reserve as f64 / GIB,
                layers.len(),
                freed as f64 / GIB,
                after as f64 / GIB
            ));
        } else if free > reserve + GROW_SLACK {
            let mut room = free - reserve - GROW_SLACK;
            let mut grown = (0, 0);
            let owned: Vec<bool> = (0..target.len()).map(|l| self.owns(l)).collect();
            for (l, &want) in target.iter().enumerate().filter(|(l, _)| owned[*l]) {
                if grown.0 >= GROW_LAYERS {
                    break;
                }
                let layer = LayerIdx(l as u16);
                let held = self.held(layer);
                if held.len() >= want {
                    continue;
                }
                let bytes = self.expert_bytes(layer).max(1);
                let fit = ((room / bytes) as usize).min(want - held.len());
                if fit == 0 {
                    break;
                }
                let mut cands: Vec<(f64, u16)> =
                    (0..self.heat.n_expert()).filter(|e| !held.contains(&(*e as u16))).map(|e| (self.heat.get(l, e), e as u16)).collect();
                cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut list = held;
                list.extend(cands.into_iter().take(fit).map(|c| c.1));
                self.set_layer(layer, list);
                room = room.saturating_sub(fit as u64 * bytes);
                grown = (grown.0 + 1, grown.1 + fit);
            }
            if grown.1 > 0 {
                self.stats.uploads += grown.1 as u64;
                say(format!(
                    "expert tier: GPU memory came back ({:.2} GiB free): {} experts back on the GPU in {} layers",
                    free as f64 / GIB,
                    grown.1,
                    grown.0
                ));
            }
        }
    }
}
