//! Keeps freed activation buffers in the process instead of handing them back to the OS.
//!
//! Every op returns fresh matrices (a prompt's projections are tens of MB). glibc serves
//! allocations above its mmap threshold with new mappings and trims the heap top on free, so
//! each op paid page faults and kernel page zeroing for its outputs: 9-10 % of a pp512 profile
//! (`clear_page_erms`, `exc_page_fault`). Raising both thresholds once makes the freed memory
//! reusable; the heap then holds at most what the largest op needed at once, which the peak
//! RSS had to hold anyway.

/// Raises glibc's mmap and trim thresholds (once per process; elsewhere a no-op).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // glibc's <malloc.h> parameters.
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_THRESHOLD: i32 = -3;
            unsafe extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            // SAFETY: mallopt only changes allocator tuning; glibc accepts these parameters at
            // any time (the mmap threshold is capped at 32 MiB on 64-bit, larger requests
            // keep their own mappings).
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 32 << 20);
                mallopt(M_TRIM_THRESHOLD, 512 << 20);
            }
        });
    }
}
