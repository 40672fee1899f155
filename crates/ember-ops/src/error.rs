//! The one error every op returns.

use crate::DeviceId;

/// An op that could not run: which op, on which device, the shapes it was given, and why.
/// Display: "op `matmul` on host (x 3x2048, w 512x2048 Q4_K): ...".
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("op `{op}` on {device} ({shapes}): {cause}")]
pub struct OpError {
    pub op: &'static str,
    pub device: DeviceId,
    pub shapes: String,
    pub cause: String,
}

impl OpError {
    pub fn new(op: &'static str, device: DeviceId, shapes: impl Into<String>, cause: impl Into<String>) -> Self {
        OpError { op, device, shapes: shapes.into(), cause: cause.into() }
    }
}

pub type OpResult<T> = Result<T, OpError>;

/// `Err(OpError)` unless `cond`; for shape checks at the top of an op.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $op:expr, $dev:expr, $shapes:expr, $($cause:tt)+) => {
        if !$cond {
            return Err($crate::OpError::new($op, $dev, $shapes, format!($($cause)+)));
        }
    };
}
