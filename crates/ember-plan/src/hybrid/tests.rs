use super::*;
use crate::{Budget, LayerSizes, ModelSizes, Options, plan};

/// The plan's KV share caps the pool whatever the slots' DeltaNet state (counted in the
/// free memory); free memory below the cap wins; no cap leaves the free memory's count.
#[test]
fn the_kv_cap_holds_the_plans_pages_for_any_slot_count() {
    // The 35B's layout at bench's 513-token context, planned for one sequence: 10 attention
    // layers of 9 pages each for K and V.
    let page = 65536;
    let plan_kv = 10 * 2 * 9 * page as u64;
    assert_eq!(kv_pages_within(Some(1 << 20), Some(plan_kv), page), Some(180));
    assert_eq!(kv_pages_within(Some(100), Some(plan_kv), page), Some(100));
    assert_eq!(kv_pages_within(None, Some(plan_kv), page), Some(180));
    assert_eq!(kv_pages_within(Some(7), None, page), Some(7));
    assert_eq!(kv_pages_within(None, None, page), None);
}

fn sizes() -> ModelSizes {
    let layers = (0..3).map(|_| LayerSizes { trunk: 100, expert: 10, kv: 0, delta: 0 }).collect();
    ModelSizes { layers, n_expert: 4, n_expert_used: 2, head: 0, embeddings: 0, unused: 0 }
}

#[test]
fn resident_lists_follow_the_plan() {
    // Room for the trunk and 6 of the 12 experts: two per layer, evenly without heat.
    let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 360 }], None, Options { compute_bytes: 0 }).unwrap();
    let r = resident_lists(&p).unwrap();
    assert_eq!(r.len(), 3);
    assert!(r.iter().all(|l| l.as_ref().is_some_and(|v| v.len() == 2)), "{r:?}");
    // Everything fits: every layer holds all its experts (None).
    let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 1000 }], None, Options { compute_bytes: 0 }).unwrap();
    assert!(resident_lists(&p).unwrap().iter().all(Option::is_none));
    // A trunk that does not fit is an error naming the layers that do.
    let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 250 }], None, Options { compute_bytes: 0 }).unwrap();
    let e = resident_lists(&p).unwrap_err();
    assert!(e.contains("layer") && e.contains("of 3 layers fit"), "{e}");
}

/// Two GPUs: each part's lists name its own layers' experts and leave the other part's
/// layers alone (None, their weights not the part's).
#[test]
fn resident_lists_on_each_device_cover_its_own_layers() {
    let budgets = |a: u64, b: u64| [Budget { device: 0, name: "a".into(), bytes: a }, Budget { device: 1, name: "b".into(), bytes: b }];
    // Room for 2 layers' trunks + 2 experts on a, 1 trunk + 3 experts on b.
    let p = plan(&sizes(), &budgets(220, 130), None, Options { compute_bytes: 0 }).unwrap();
    assert_eq!(p.layer_home, vec![Home::Device(0), Home::Device(0), Home::Device(1)]);
    let a = resident_lists_on(&p, 0).unwrap();
    let b = resident_lists_on(&p, 1).unwrap();
    assert_eq!(a[2], None, "layer 2 is b's");
    assert_eq!(b[0], None);
    assert_eq!(b[1], None);
    assert_eq!(a[0].as_ref().map(Vec::len).unwrap_or(4) + a[1].as_ref().map(Vec::len).unwrap_or(4), 2, "{a:?}");
    assert_eq!(b[2].as_ref().map(Vec::len), Some(3), "{b:?}");
    for (l, list) in a.iter().chain(&b).enumerate().filter_map(|(i, x)| x.as_ref().map(|x| (i % 3, x))) {
        assert!(list.iter().all(|&e| p.expert_home[l][e as usize] != Home::Host), "layer {l}: {list:?}");
    }
    // Everything fits: no lists; a device with no layers or a trunk on the host: errors.
    let p = plan(&sizes(), &budgets(1000, 1000), None, Options { compute_bytes: 0 }).unwrap();
    assert!(resident_lists_on(&p, 0).unwrap().iter().all(Option::is_none));
    let p = plan(&sizes(), &budgets(1000, 0), None, Options { compute_bytes: 0 }).unwrap();
    assert!(resident_lists_on(&p, 1).unwrap_err().contains("no layers"));
    let p = plan(&sizes(), &budgets(120, 110), None, Options { compute_bytes: 0 }).unwrap();
    let e = resident_lists_on(&p, 0).unwrap_err();
    assert!(e.contains("off the GPUs") && e.contains("2 of 3 layers fit"), "{e}");
}
