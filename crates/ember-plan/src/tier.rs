//! The expert tier's bookkeeping (shared/DESIGN.md "Weights and placement", shared/GPU.md §4),
//! as data the runtime drives: routing heat per (layer, expert) with exponential decay, the heat
//! file that warm-starts the next run, and the residency decisions: admission with hysteresis
//! (a candidate must beat the coldest resident of its device by a margin), a cap on uploads per
//! step, and eviction of the coldest experts of one device when its memory shrinks.
//!
//! Decay is lazy: every count is stored divided by a growing scale, so a step costs O(routed
//! experts), not O(layers × experts); the counts are renormalised when the scale grows large.

use std::path::{Path, PathBuf};

use crate::{Heat, Home};

/// Routing heat: per (layer, expert), the routings it got, each weighted by 2^(−age / half-life)
/// with age in tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct HeatMap {
    n_layer: usize,
    n_expert: usize,
    half_life: f64,
    /// counts × 1 / scale = the decayed counts.
    counts: Vec<f64>,
    scale: f64,
    /// Tokens seen (for the file).
    tokens: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum HeatError {
    #[error("heat file {path}: {why}")]
    File { path: PathBuf, why: String },
    #[error("routing of layer {layer} names expert {expert}, the model has {n_expert}")]
    Expert { layer: usize, expert: u32, n_expert: usize },
    #[error("layer {layer} is beyond the model's {n_layer}")]
    Layer { layer: usize, n_layer: usize },
}

impl HeatMap {
    /// All zero; a routing `half_life` tokens old counts half.
    pub fn new(n_layer: usize, n_expert: usize, half_life: f64) -> HeatMap {
        HeatMap { n_layer, n_expert, half_life: half_life.max(1.0), counts: vec![0.0; n_layer * n_expert], scale: 1.0, tokens: 0 }
    }

    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Counts the routing of one layer for a step: `ids` are the experts chosen, k per token.
    pub fn record(&mut self, layer: usize, ids: &[u32]) -> Result<(), HeatError> {
        if layer >= self.n_layer {
            return Err(HeatError::Layer { layer, n_layer: self.n_layer });
        }
        for &e in ids {
            if e as usize >= self.n_expert {
                return Err(HeatError::Expert { layer, expert: e, n_expert: self.n_expert });
            }
            self.counts[layer * self.n_expert + e as usize] += self.scale;
        }
        Ok(())
    }

    /// Ages every count by `n_tok` tokens (call once per step, after its `record`s).
    pub fn advance(&mut self, n_tok: usize) {
        self.tokens += n_tok as u64;
        self.scale *= 2f64.powf(n_tok as f64 / self.half_life);
        if self.scale > 1e100 {
            for c in &mut self.counts {
                *c /= self.scale;
            }
            self.scale = 1.0;
        }
    }

    pub fn half_life(&self) -> f64 {
        self.half_life
    }

    /// Replaces the rows of the layers `take` picks with `other`'s (the same shape; another
    /// part of a layer split counted those), and keeps the larger token count. A map of
    /// another shape changes nothing.
    pub fn take_rows(&mut self, other: &HeatMap, take: impl Fn(usize) -> bool) {
        if (other.n_layer, other.n_expert) != (self.n_layer, self.n_expert) {
            return;
        }
        for l in (0..self.n_layer).filter(|&l| take(l)) {
            for e in 0..self.n_expert {
                self.counts[l * self.n_expert + e] = other.get(l, e) * self.scale;
            }
        }
        self.tokens = self.tokens.max(other.tokens);
    }

    pub fn get(&self, layer: usize, expert: usize) -> f64 {
        self.counts[layer * self.n_expert + expert] / self.scale
    }

    /// A snapshot for the planner.
    pub fn heat(&self) -> Heat {
        Heat((0..self.n_layer).map(|l| (0..self.n_expert).map(|e| self.get(l, e)).collect()).collect())
    }

    /// Writes the heat file (JSON; written to a temporary name, then renamed).
    pub fn save(&self, path: &Path, model_key: &str) -> Result<(), HeatError> {
        let err = |why: String| HeatError::File { path: path.to_path_buf(), why };
        let heat: Vec<Vec<f64>> = self.heat().0.into_iter().map(|row| row.into_iter().map(|x| (x * 1e4).round() / 1e4).collect()).collect();
        let j = serde_json::json!({
            "version": 1, "model": model_key, "n_layer": self.n_layer, "n_expert": self.n_expert,
            "half_life_tokens": self.half_life, "tokens": self.tokens, "heat": heat,
        });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(format!("cannot create its folder: {e}")))?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, j.to_string()).map_err(|e| err(format!("cannot write: {e}")))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(format!("cannot rename into place: {e}"))
        })
    }

    /// Reads a heat file written for the same model (`model_key`) and shape.
    pub fn load(path: &Path, model_key: &str, n_layer: usize, n_expert: usize, half_life: f64) -> Result<HeatMap, HeatError> {
        let err = |why: String| HeatError::File { path: path.to_path_buf(), why };
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let j: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| err(format!("not JSON: {e}")))?;
        if j["version"] != 1 {
            return Err(err(format!("version {} is not 1", j["version"])));
        }
        if j["model"].as_str() != Some(model_key) {
            return Err(err(format!("written for model {}, not {model_key}", j["model"])));
        }
        if j["n_layer"].as_u64() != Some(n_layer as u64) || j["n_expert"].as_u64() != Some(n_expert as u64) {
            return Err(err(format!("shape {} x {}, the model {n_layer} x {n_expert}", j["n_layer"], j["n_expert"])));
        }
        let rows = j["heat"].as_array().filter(|r| r.len() == n_layer).ok_or_else(|| err("heat is not one row per layer".into()))?;
        let mut m = HeatMap::new(n_layer, n_expert, half_life);
        for (l, row) in rows.iter().enumerate() {
            let row = row.as_array().filter(|r| r.len() == n_expert).ok_or_else(|| err(format!("row {l} is not {n_expert} numbers")))?;
            for (e, x) in row.iter().enumerate() {
                let x = x.as_f64().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| err(format!("heat[{l}][{e}] is not a count")))?;
                m.counts[l * n_expert + e] = x;
            }
        }
        m.tokens = j["tokens"].as_u64().unwrap_or(0);
        Ok(m)
    }
}

/// A key naming a model file's contents for the heat file: its size and a hash of its tensor
/// table (names, types, shapes, offsets), cheap to compute and stable across copies.
pub fn model_key(file: &ember_gguf::GgufFile) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b.iter().chain(&[0xff]) {
            h ^= x as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for t in file.tensors() {
        eat(t.name.as_bytes());
        eat(format!("{:?} {:?} {} {}", t.ggml_type, t.ne, t.offset, t.n_bytes).as_bytes());
    }
    format!("{}-{:016x}", file.file_len(), h)
}

/// The default heat file of a model: `$XDG_CACHE_HOME/ember/heat/KEY.json` or
/// `~/.cache/ember/heat/KEY.json`.
pub fn default_heat_path(model_key: &str) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ember").join("heat").join(format!("{model_key}.json")))
}

/// One residency change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub layer: usize,
    pub expert: usize,
    pub to: Home,
}

/// Which experts are resident where, and the rules that change it.
#[derive(Debug, Clone, PartialEq)]
pub struct Residency {
    /// Per layer, per expert.
    pub home: Vec<Vec<Home>>,
    /// Per layer: its device, or the host.
    pub layer_home: Vec<Home>,
    /// Per device: how many more experts fit.
    pub free_slots: Vec<usize>,
    /// A candidate replaces a resident when its heat exceeds the resident's × (1 + margin).
    pub margin: f64,
    /// Uploads per step at most.
    pub max_uploads: usize,
}

impl Residency {
    /// The residency of a plan; `margin` and `max_uploads` as in [`Residency`].
    pub fn of_plan(plan: &crate::Plan, margin: f64, max_uploads: usize) -> Residency {
        Residency {
            home: plan.expert_home.clone(),
            layer_home: plan.layer_home.clone(),
            free_slots: vec![0; plan.devices.len()],
            margin,
            max_uploads,
        }
    }

    /// Residency changes for this step, at most `max_uploads` uploads: free slots first go to
    /// the hottest non-resident experts of each device's layers; then a candidate replaces the
    /// coldest resident of its device only when it is hotter by the margin (no thrashing between
    /// experts of about the same heat). Evictions come first in the list, then uploads.
    pub fn rebalance(&mut self, heat: &HeatMap) -> Vec<Move> {
        let mut evict = Vec::new();
        let mut admit = Vec::new();
        for d in 0..self.free_slots.len() {
            let mut cands = Vec::new();
            let mut resident = Vec::new();
            for (l, row) in self.home.iter().enumerate() {
                if self.layer_home[l] != Home::Device(d) {
                    continue;
                }
                for (e, h) in row.iter().enumerate() {
                    let x = heat.get(l, e);
                    if *h == Home::Device(d) { resident.push((x, l, e)) } else { cands.push((x, l, e)) }
                }
            }
            cands.sort_by(|a, b| b.0.total_cmp(&a.0));
            resident.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut coldest = resident.into_iter();
            for (x, l, e) in cands {
                if admit.len() >= self.max_uploads || x <= 0.0 {
                    break;
                }
                if self.free_slots[d] > 0 {
                    self.free_slots[d] -= 1;
                } else {
                    match coldest.next() {
                        Some((y, rl, re)) if x > y * (1.0 + self.margin) => {
                            self.home[rl][re] = Home::Host;
                            evict.push(Move { layer: rl, expert: re, to: Home::Host });
                        }
                        _ => break,
                    }
                }
                self.home[l][e] = Home::Device(d);
                admit.push(Move { layer: l, expert: e, to: Home::Device(d) });
            }
        }
        evict.extend(admit);
        evict
    }

    /// Device `d` must give back `n` experts' memory (another process took VRAM): its coldest
    /// residents go to the host. Other devices are untouched.
    pub fn shrink(&mut self, d: usize, n: usize, heat: &HeatMap) -> Vec<Move> {
        let mut resident: Vec<(f64, usize, usize)> = Vec::new();
        for (l, row) in self.home.iter().enumerate() {
            for (e, h) in row.iter().enumerate() {
                if *h == Home::Device(d) {
                    resident.push((heat.get(l, e), l, e));
                }
            }
        }
        resident.sort_by(|a, b| a.0.total_cmp(&b.0));
        let take = n.saturating_sub(self.free_slots.get(d).copied().unwrap_or(0));
        if let Some(f) = self.free_slots.get_mut(d) {
            *f = f.saturating_sub(n);
        }
        resident
            .into_iter()
            .take(take)
            .map(|(_, l, e)| {
                self.home[l][e] = Home::Host;
                Move { layer: l, expert: e, to: Home::Host }
            })
            .collect()
    }

    /// Device `d` may hold `n` more experts (memory came back); `rebalance` fills them by heat.
    pub fn grow(&mut self, d: usize, n: usize) {
        if let Some(f) = self.free_slots.get_mut(d) {
            *f += n;
        }
    }

    pub fn resident(&self, d: usize) -> usize {
        self.home.iter().flatten().filter(|h| **h == Home::Device(d)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Budget, LayerSizes, ModelSizes, Options, plan};

    #[test]
    fn heat_decays_by_its_half_life() {
        let mut h = HeatMap::new(2, 4, 100.0);
        h.record(0, &[1, 1, 3]).unwrap();
        h.advance(1);
        assert!((h.get(0, 1) - 2.0 * 0.5f64.powf(0.01)).abs() < 1e-12);
        h.advance(99);
        assert!((h.get(0, 1) - 1.0).abs() < 1e-9, "{}", h.get(0, 1));
        assert!((h.get(0, 3) - 0.5).abs() < 1e-9);
        assert_eq!(h.get(1, 0), 0.0);
        // Long runs renormalise without losing the ratios.
        for _ in 0..200 {
            h.record(1, &[2]).unwrap();
            h.advance(500);
        }
        // One routing every 5 half-lives, read just after aging: Σ 2^(−5k), k >= 1 = 1/31.
        assert!((h.get(1, 2) - 1.0 / 31.0).abs() < 1e-9, "{}", h.get(1, 2));
        assert!(h.get(0, 1).is_finite() && h.get(0, 1) >= 0.0);
        assert!(h.record(0, &[4]).is_err());
        assert!(h.record(2, &[0]).is_err());
    }

    #[test]
    fn the_heat_file_round_trips_and_refuses_another_model() {
        let dir = std::env::temp_dir().join(format!("ember-heat-{}", std::process::id()));
        let path = dir.join("m.json");
        let mut h = HeatMap::new(3, 5, 1000.0);
        h.record(2, &[4, 4, 0]).unwrap();
        h.advance(10);
        h.save(&path, "key-a").unwrap();
        let back = HeatMap::load(&path, "key-a", 3, 5, 1000.0).unwrap();
        for l in 0..3 {
            for e in 0..5 {
                assert!((back.get(l, e) - h.get(l, e)).abs() < 1e-4);
            }
        }
        assert_eq!(back.tokens(), 10);
        for (key, nl, ne, what) in [("key-b", 3, 5, "not key-b"), ("key-a", 4, 5, "shape"), ("key-a", 3, 6, "shape")] {
            let e = HeatMap::load(&path, key, nl, ne, 1000.0).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        std::fs::write(&path, "{not json").unwrap();
        assert!(HeatMap::load(&path, "key-a", 3, 5, 1000.0).unwrap_err().to_string().contains("not JSON"));
        assert!(HeatMap::load(&dir.join("none.json"), "key-a", 3, 5, 1000.0).unwrap_err().to_string().contains("cannot read"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn small_plan() -> (ModelSizes, crate::Plan) {
        let layers = (0..4).map(|_| LayerSizes { trunk: 100, expert: 10, kv: 0, delta: 0 }).collect();
        let s = ModelSizes { layers, n_expert: 8, n_expert_used: 2, head: 0, embeddings: 0, unused: 0 };
        // Two devices of 2 layers each, 4 experts per layer resident (80 bytes left for experts).
        let b = vec![Budget { device: 0, name: "a".into(), bytes: 280 }, Budget { device: 1, name: "b".into(), bytes: 280 }];
        let p = plan(&s, &b, None, Options { compute_bytes: 0 }).unwrap();
        (s, p)
    }

    /// A split's parts each count their own layers: one part's rows taken into another's map
    /// give the map of both, whatever each map's lazy scale.
    #[test]
    fn rows_taken_from_another_parts_map_keep_both_parts_counts() {
        let mut a = HeatMap::new(3, 2, 10.0);
        let mut b = HeatMap::new(3, 2, 10.0);
        a.record(0, &[1, 1]).unwrap();
        a.advance(30); // a's scale is 8, b's 1
        b.record(2, &[0]).unwrap();
        b.record(0, &[0]).unwrap(); // b's row 0 is not b's to give
        b.advance(5);
        a.take_rows(&b, |l| l == 2);
        assert!((a.get(0, 1) - 2.0 / 8.0).abs() < 1e-12, "a keeps its own row");
        assert_eq!(a.get(0, 0), 0.0);
        assert!((a.get(2, 0) - b.get(2, 0)).abs() < 1e-12 && b.get(2, 0) > 0.7, "b's row 2: {}", a.get(2, 0));
        assert_eq!(a.tokens(), 30);
        // Another shape changes nothing.
        let before = a.clone();
        a.take_rows(&HeatMap::new(2, 2, 10.0), |_| true);
        assert_eq!(a, before);
    }

    #[test]
    fn admission_needs_the_margin_and_respects_the_cap() {
        let (_, p) = small_plan();
        assert_eq!(p.devices[0].experts, 8);
        let mut r = Residency::of_plan(&p, 0.25, 3);
        let mut h = HeatMap::new(4, 8, 1e9);
        // Residents are experts 0..4 of each layer (evenly, in id order), each routed 10 times.
        // Expert 7 of layer 0 a little hotter than them: within the margin, nothing moves.
        for l in 0..4 {
            for e in 0..4 {
                h.record(l, &[e; 10]).unwrap();
            }
        }
        h.record(0, &[7; 11]).unwrap();
        assert!(r.rebalance(&h).is_empty(), "11 vs 10 is inside the 25 % margin");
        // Four candidates of device 0 well past the margin: the cap lets three in, each
        // replacing a resident of device 0.
        h.record(0, &[7; 10]).unwrap();
        h.record(0, &[6; 30]).unwrap();
        h.record(0, &[5; 30]).unwrap();
        h.record(1, &[4; 30]).unwrap();
        let moves = r.rebalance(&h);
        let ups: Vec<_> = moves.iter().filter(|m| m.to != Home::Host).collect();
        let downs: Vec<_> = moves.iter().filter(|m| m.to == Home::Host).collect();
        assert_eq!(ups.len(), 3, "the cap: {moves:?}");
        assert_eq!(downs.len(), 3);
        assert!(ups.iter().all(|m| h.get(m.layer, m.expert) == 30.0), "the hottest first: {moves:?}");
        assert!(downs.iter().all(|m| h.get(m.layer, m.expert) == 10.0), "{moves:?}");
        assert!(moves.iter().all(|m| m.layer < 2), "device 1 untouched: {moves:?}");
        assert_eq!(r.resident(0), 8);
        assert_eq!(r.resident(1), 8);
        // The one held back by the cap (heat 21 vs 10) comes in next step; then it is stable.
        let again = r.rebalance(&h);
        assert_eq!(again.iter().filter(|m| m.to != Home::Host).count(), 1, "{again:?}");
        assert!(r.rebalance(&h).is_empty());
    }

    #[test]
    fn pressure_evicts_the_coldest_of_that_device_only_and_growth_refills_by_heat() {
        let (_, p) = small_plan();
        let mut r = Residency::of_plan(&p, 0.25, 100);
        let mut h = HeatMap::new(4, 8, 1e9);
        for l in 0..4 {
            for e in 0..4u32 {
                h.record(l, &vec![e; (e as usize + 1) * 5]).unwrap();
            }
        }
        let moves = r.shrink(1, 3, &h);
        assert_eq!(moves.len(), 3);
        for m in &moves {
            assert!(m.layer >= 2 && m.to == Home::Host, "{m:?}");
        }
        let mut heats: Vec<f64> = moves.iter().map(|m| h.get(m.layer, m.expert)).collect();
        heats.sort_by(f64::total_cmp);
        assert_eq!(heats, [5.0, 5.0, 10.0], "the coldest residents: {moves:?}");
        assert_eq!(r.resident(0), 8);
        assert_eq!(r.resident(1), 5);
        // Memory returns: the evicted experts (the hottest non-residents) come back.
        r.grow(1, 3);
        let back = r.rebalance(&h);
        assert_eq!(back.len(), 3, "{back:?}");
        assert!(back.iter().all(|m| m.to == Home::Device(1)));
        assert_eq!(r.resident(1), 8);
    }
}
