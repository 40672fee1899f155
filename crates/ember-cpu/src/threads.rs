//! Thread count: physical cores, not SMT siblings (bandwidth-bound kernels gain nothing from
//! siblings; DESIGN.md, Execution).

/// Number of physical cores: distinct (physical id, core id) pairs of /proc/cpuinfo on Linux,
/// else the available parallelism.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return logical };
    let mut cores = std::collections::HashSet::new();
    let (mut phys, mut core) = (None::<String>, None::<String>);
    for line in info.lines().chain(std::iter::once("")) {
        if line.trim().is_empty() {
            if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                cores.insert((p, c));
            }
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            match k.trim() {
                "physical id" => phys = Some(v.trim().to_owned()),
                "core id" => core = Some(v.trim().to_owned()),
                _ => {}
            }
        }
    }
    // A VM may report fewer logical CPUs in the affinity mask than cpuinfo lists.
    if cores.is_empty() { logical } else { cores.len().min(logical).max(1) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn at_least_one_core() {
        assert!(super::physical_cores() >= 1);
    }
}
