//! Index newtypes: the expert tier and placement key on `(LayerIdx, ExpertId)`, weights are
//! registered once and named by `WeightId`, and every op error says which `DeviceId` it ran on.

use std::fmt;

/// A decoder layer, 0-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerIdx(pub u16);

/// A routed expert of one layer, 0-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertId(pub u16);

/// A device that runs ops: the host (CPU) or an accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum DeviceId {
    #[default]
    Host,
    Gpu(u16),
}

/// A weight registered with a backend ([`crate::WeightSet`]): its index in the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

impl LayerIdx {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl ExpertId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl WeightId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Host => f.write_str("host"),
            DeviceId::Gpu(i) => write!(f, "gpu:{i}"),
        }
    }
}

impl fmt::Display for LayerIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {}", self.0)
    }
}
