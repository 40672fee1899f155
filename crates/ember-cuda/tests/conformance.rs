//! ember's backend conformance suite (`ember_ops::conformance`) on [`CudaOps`]: every op, the
//! state store and the error paths against the reference backend (`HostOps`), through the public
//! `Ops` API only.
//!
//! With no NVIDIA driver the test prints why and passes (CI has no GPU). On a GPU:
//! `cargo test -p ember-cuda --release --test conformance -- --nocapture`.

use ember_cuda::{CudaOps, Gpu};
use ember_ops::Ops;
use ember_ops::conformance::{self, Tolerances};

/// Tolerances (the suite's measures: `rel` = largest |got − ref| over the largest |ref| of a
/// result; `quant_nmse` = pooled Σ(got − ref)² / Σref² of quantised matmuls and the MoE).
/// Measured on the H200: see the report printed by the test (README.md records it).
const TOL: Tolerances = Tolerances { rel: 1e-3, quant_nmse: 1e-6 };

#[test]
fn cuda_ops_conform() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let report = conformance::run(
        &mut |w| {
            let mut o = CudaOps::new(0).unwrap_or_else(|e| panic!("CudaOps::new: {e}"));
            o.register(w).unwrap_or_else(|e| panic!("register: {e}"));
            Box::new(o)
        },
        TOL,
    );
    println!("CudaOps conformance, largest error per check:\n{report}");
}
