//! The reference backend passes its own conformance suite exactly (and returns the shape
//! errors the suite expects): a check that the suite itself runs end to end.

use ember_ops::conformance::{self, Tolerances};
use ember_ops::{HostOps, Ops};

#[test]
fn reference_conforms_exactly() {
    let report = conformance::run(&mut |w| Box::new(HostOps::with_weights(w)) as Box<dyn Ops>, Tolerances { rel: 0.0, quant_nmse: 0.0 });
    eprintln!("{report}");
    assert!(report.errors.len() > 20, "the suite ran {} checks", report.errors.len());
}
