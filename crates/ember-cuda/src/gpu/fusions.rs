//! The decode chain's fused launches, each behind a switch (its environment variable at the
//! start, a setter for tests and measuring), and whether a cluster launch of each fits the GPU.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Gpu;

pub(super) struct Fusions {
    /// Whether a one-token MoE prelude (residual add, norm, router, routing) runs as one
    /// cluster launch, `moe_route` (`EMBER_MOE_ROUTE=1`; off by default: decode 3.6 % slower
    /// than the three launches on an H100, docs/perf.md g33).
    moe_route: AtomicBool,
    /// Whether `moe_route`'s cluster of 16 fits this GPU (asked of the driver at its first use).
    moe_route_fits: OnceLock<bool>,
    /// Whether a one-token int8 MoE with its shared expert runs as one launch, a cluster an
    /// expert (`moe_fused_q8_<down type>`: gate/up, then down from shared memory; the norm after
    /// it adds the experts' rows). `EMBER_MOE_FUSED=1` or `2` (or [`Gpu::set_moe_fused`]).
    moe_fused: AtomicBool,
    /// Whether that launch also routes the router's logits itself, where the route kernel ran
    /// before it (`EMBER_MOE_FUSED=2`, or [`Gpu::set_moe_fused_route`]).
    moe_fused_route: AtomicBool,
    /// Whether the gate after a decode step's attention runs in the attention's own launches
    /// (`EMBER_ATTN_GATE=1`, or [`Gpu::set_attention_gate`]; where [`Gpu::attention_gates`]).
    attn_gate: AtomicBool,
    /// Whether attn_prep's k heads write their rows into the KV caches themselves, where the
    /// kv_append launch wrote them (`EMBER_ATTN_PREP_KV=1`, or [`Gpu::set_attn_prep_kv`]).
    attn_prep_kv: AtomicBool,
    /// Whether a cluster of `moe_fused_q8_<type>` fits this GPU, per down type (Q4_K, Q6_K).
    moe_fused_fits: [OnceLock<bool>; 2],
}

impl Fusions {
    pub(super) fn from_env() -> Fusions {
        let on = |name: &str, values: &[&str]| std::env::var(name).is_ok_and(|v| values.contains(&v.as_str()));
        Fusions {
            moe_route: AtomicBool::new(on("EMBER_MOE_ROUTE", &["1"])),
            moe_route_fits: OnceLock::new(),
            moe_fused: AtomicBool::new(on("EMBER_MOE_FUSED", &["1", "2"])),
            moe_fused_route: AtomicBool::new(on("EMBER_MOE_FUSED", &["2"])),
            attn_gate: AtomicBool::new(on("EMBER_ATTN_GATE", &["1"])),
            attn_prep_kv: AtomicBool::new(on("EMBER_ATTN_PREP_KV", &["1"])),
            moe_fused_fits: [OnceLock::new(), OnceLock::new()],
        }
    }
}

impl Gpu {
    pub(crate) fn moe_route_on(&self) -> bool {
        self.fusions.moe_route.load(Ordering::Relaxed)
    }

    /// Lets a one-token MoE prelude run as one `moe_route` launch where it applies, or not
    /// (what `EMBER_MOE_ROUTE` sets at the start; for tests and measuring).
    pub fn set_moe_route(&self, on: bool) {
        self.fusions.moe_route.store(on, Ordering::Relaxed);
    }

    pub(crate) fn moe_route_fits(&self) -> &OnceLock<bool> {
        &self.fusions.moe_route_fits
    }

    pub(crate) fn moe_fused_on(&self) -> bool {
        self.fusions.moe_fused.load(Ordering::Relaxed)
    }

    /// Lets a one-token int8 MoE run as one `moe_fused_q8` launch where it applies, or not
    /// (`EMBER_MOE_FUSED` sets the start).
    pub fn set_moe_fused(&self, on: bool) {
        self.fusions.moe_fused.store(on, Ordering::Relaxed);
    }

    pub(crate) fn moe_fused_route_on(&self) -> bool {
        self.fusions.moe_fused_route.load(Ordering::Relaxed)
    }

    /// Lets the one-launch MoE route the router's logits itself where it runs, or not
    /// (`EMBER_MOE_FUSED=2` sets the start).
    pub fn set_moe_fused_route(&self, on: bool) {
        self.fusions.moe_fused_route.store(on, Ordering::Relaxed);
    }

    pub(crate) fn attention_gate_on(&self) -> bool {
        self.fusions.attn_gate.load(Ordering::Relaxed)
    }

    /// Lets the gate after a decode step's attention run in the attention's launches, or not
    /// (`EMBER_ATTN_GATE` sets the start).
    pub fn set_attention_gate(&self, on: bool) {
        self.fusions.attn_gate.store(on, Ordering::Relaxed);
    }

    pub(crate) fn attn_prep_kv_on(&self) -> bool {
        self.fusions.attn_prep_kv.load(Ordering::Relaxed)
    }

    /// Lets attn_prep write the step's K and V rows itself where the model asks for both ops,
    /// or not (`EMBER_ATTN_PREP_KV` sets the start).
    pub fn set_attn_prep_kv(&self, on: bool) {
        self.fusions.attn_prep_kv.store(on, Ordering::Relaxed);
    }

    pub(crate) fn moe_fused_fits(&self, q6: bool) -> &OnceLock<bool> {
        &self.fusions.moe_fused_fits[usize::from(q6)]
    }
}
