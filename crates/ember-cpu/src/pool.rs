//! A persistent thread pool for the ~10^3 small parallel regions of one decoded token.
//!
//! The caller works too; the other workers spin on a control word for a bounded time after each
//! region (`EMBER_SPIN_US`, default 200 µs), then park on a condition variable, so an idle server
//! does not burn cores (shared/STACK.md, "Thread pool": +1–4 µs per region vs rayon's +15 µs
//! once its workers sleep). A region is cut into a few parts per worker, claimed from a shared
//! counter. STACK.md measured a static split as slightly cheaper on an idle machine, but with a
//! static split one descheduled worker stalls every region for a whole time slice; measured on
//! the 2-core dev machine while others build, that doubled decode time. With claiming, the
//! caller never waits for a worker that has not started: a late worker finds the region closed.
//!
//! The decision a reader may question: this module holds `unsafe` code outside `simd`. A
//! persistent thread can only run a closure that borrows the caller's stack if the closure's
//! lifetime is erased while the region runs, which the borrow checker cannot see; the pool
//! makes that sound by not returning (nor unwinding) from [`Pool::run`] before every worker
//! that entered the region has left it. The other unsafe blocks hand disjoint sub-slices of one
//! `&mut` slice to the parts ([`Pool::split_mut`]).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

type Job = &'static (dyn Fn(usize) + Sync);

/// `ctl` packs the region's epoch (high 32 bits), a "closed" flag and the number of workers
/// inside the region, so entering (a CAS that checks epoch and flag) and closing are atomic
/// with respect to each other.
const CLOSED: u64 = 1 << 31;
const ACTIVE: u64 = CLOSED - 1;

struct Shared {
    ctl: AtomicU64,
    job: Mutex<Option<Job>>,
    /// Next part to claim, and the number of parts of the current region.
    next: AtomicUsize,
    n_parts: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
    spin: Duration,
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    n_threads: usize,
    /// One region at a time; a concurrent caller runs its region alone, inline.
    submit: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("n_threads", &self.n_threads).finish()
    }
}

impl Pool {
    /// A pool of `n_threads` workers including the calling thread (at least 1).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let spin_us = std::env::var("EMBER_SPIN_US").ok().and_then(|s| s.parse().ok()).unwrap_or(200u64);
        let shared = Arc::new(Shared {
            ctl: AtomicU64::new(CLOSED),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            n_parts: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            spin: Duration::from_micros(spin_us),
        });
        let workers = (1..n_threads)
            .map(|tid| {
                let s = shared.clone();
                // unwrap: failing to spawn at start-up leaves nothing sensible to continue with.
                std::thread::Builder::new().name(format!("ember-cpu-{tid}")).spawn(move || worker(&s)).unwrap()
            })
            .collect();
        Pool { shared, workers, n_threads, submit: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(part)` once for every part in `0..n_parts`, spread over the workers (the caller
    /// takes parts too), and returns when all are done. Parts are claimed from a shared counter:
    /// a worker the OS has descheduled simply takes none, and the caller never waits for a
    /// worker that had not started. A panic in any part is re-raised here.
    pub fn run<F: Fn(usize) + Sync>(&self, n_parts: usize, f: F) {
        let guard = match self.submit.try_lock() {
            Ok(g) => g,
            Err(_) => {
                // Another thread owns the workers right now: do the whole region here.
                (0..n_parts).for_each(&f);
                return;
            }
        };
        if self.n_threads == 1 || n_parts <= 1 {
            (0..n_parts).for_each(&f);
            return;
        }
        let s = &*self.shared;
        let job: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: the 'static reference is used only by workers that entered this region (a
        // CAS on `ctl` that fails once the region is closed); `Finish` below closes the region
        // and blocks (also when the caller's part unwinds) until every worker that entered has
        // left, then clears the slot, so no use of the reference outlives `f`.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        *lock(&s.job) = Some(job);
        s.next.store(0, SeqCst);
        s.n_parts.store(n_parts, SeqCst);
        let epoch = ((s.ctl.load(SeqCst) >> 32) + 1) & 0xFFFF_FFFF;
        s.ctl.store(epoch << 32, SeqCst); // open, nobody inside
        if s.sleepers.load(SeqCst) > 0 {
            let _g = lock(&s.sleep_lock);
            s.wake.notify_all();
        }
        struct Finish<'a>(&'a Shared);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                let c = &self.0.ctl;
                c.fetch_or(CLOSED, SeqCst);
                let mut spins = 0u32;
                while c.load(Acquire) & ACTIVE != 0 {
                    spins += 1;
                    if spins < 4096 {
                        std::hint::spin_loop();
                    } else {
                        // A worker inside the region was descheduled: give it our core.
                        std::thread::yield_now();
                    }
                }
                *lock(&self.0.job) = None;
            }
        }
        let finish = Finish(s);
        claim_parts(s, &f);
        drop(finish);
        drop(guard);
        if s.panicked.swap(false, SeqCst) {
            panic!("a CPU pool worker panicked");
        }
    }

    /// Splits `data` at `bounds` (non-decreasing, first 0, last `data.len()`) and runs
    /// `f(part, &mut data[bounds[part]..bounds[part + 1]])` for every part, in parallel.
    pub fn split_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(&self, data: &mut [T], bounds: &[usize], f: F) {
        let n_parts = bounds.len().saturating_sub(1);
        check_bounds(data.len(), bounds);
        let base = SendPtr(data.as_mut_ptr());
        self.run(n_parts, |part| {
            let (a, b) = (bounds[part], bounds[part + 1]);
            let p = &base;
            // SAFETY: the bounds were checked to be non-decreasing within `data.len()`, so the
            // parts are in bounds and pairwise disjoint; `run` runs each part exactly once, and
            // `data` stays mutably borrowed until it returns.
            let part_data = unsafe { std::slice::from_raw_parts_mut(p.0.add(a), b - a) };
            f(part, part_data);
        });
    }

    /// `len` zeros, written in parallel over the parts `bounds` gives (non-decreasing, first
    /// 0, last `len`), into memory that is not cleared first: `vec![0.0; len]` clears memory
    /// the allocator reuses on the calling thread alone.
    pub fn zeroed(&self, len: usize, bounds: &[usize]) -> Vec<f32> {
        let mut data: Vec<f32> = Vec::with_capacity(len);
        self.split_mut(&mut data.spare_capacity_mut()[..len], bounds, |_, part| part.fill(std::mem::MaybeUninit::new(0.0)));
        // SAFETY: split_mut checked that the bounds cover 0..len in non-decreasing steps and
        // ran every part exactly once before returning (a panicking part is re-raised by `run`
        // before this line), so each of the first len values was written.
        unsafe { data.set_len(len) };
        data
    }

    /// [`Pool::split_mut`] over two slices at once: part `p` of each goes to the same call.
    pub fn split_mut2<A: Send, B: Send, F: Fn(usize, &mut [A], &mut [B]) + Sync>(
        &self,
        a: &mut [A],
        bounds_a: &[usize],
        b: &mut [B],
        bounds_b: &[usize],
        f: F,
    ) {
        assert_eq!(bounds_a.len(), bounds_b.len(), "split_mut2: part counts differ");
        check_bounds(a.len(), bounds_a);
        check_bounds(b.len(), bounds_b);
        let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
        self.run(bounds_a.len().saturating_sub(1), |part| {
            let (pa, pb) = (&pa, &pb);
            // SAFETY: as in split_mut, for each slice: checked, disjoint, in-bounds parts, each
            // run once, the slices borrowed mutably until `run` returns.
            let (x, y) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.0.add(bounds_a[part]), bounds_a[part + 1] - bounds_a[part]),
                    std::slice::from_raw_parts_mut(pb.0.add(bounds_b[part]), bounds_b[part + 1] - bounds_b[part]),
                )
            };
            f(part, x, y);
        });
    }
}

/// Most matrices one [`Pool::split_cols`] region writes side by side.
pub const MAX_COL_MATS: usize = 8;

/// Part `p` of a [`Pool::split_cols`] region: the global columns `c0..c1` of matrices laid side
/// by side (global column c is column c − start of the matrix holding it), in every row. Every
/// access is bounds-checked against those columns and the matrix.
pub struct ColsMut<'a> {
    mats: [(*mut f32, usize); MAX_COL_MATS], // (data, columns)
    starts: [usize; MAX_COL_MATS + 1],
    n_rows: usize,
    c0: usize,
    c1: usize,
    _data: std::marker::PhantomData<&'a mut [f32]>,
}

impl ColsMut<'_> {
    /// Row t, global columns c..c + len, which must lie in this part's columns and in one
    /// matrix.
    #[inline]
    pub fn run(&mut self, t: usize, c: usize, len: usize) -> &mut [f32] {
        assert!(
            t < self.n_rows && c >= self.c0 && c + len <= self.c1,
            "ColsMut: row {t} columns {c}..{} outside {}..{}",
            c + len,
            self.c0,
            self.c1
        );
        let mut i = 0;
        while c >= self.starts[i + 1] {
            i += 1;
        }
        let (ptr, ld) = self.mats[i];
        let lc = c - self.starts[i];
        assert!(lc + len <= ld, "ColsMut: columns {c}..{} cross a matrix boundary", c + len);
        // SAFETY: row t < n_rows and columns lc..lc + len ≤ ld are inside matrix i, and they
        // are in this part's global columns, which no other part touches while the region runs
        // (split_cols).
        unsafe { std::slice::from_raw_parts_mut(ptr.add(t * ld + lc), len) }
    }

    /// The element (t, c).
    #[inline]
    pub fn at(&mut self, t: usize, c: usize) -> &mut f32 {
        &mut self.run(t, c, 1)[0]
    }
}

impl Pool {
    /// Runs `f(part, cols)` for every part of the row-major matrices `mats` (each `n` rows;
    /// matrix i has `mats[i].len() / n` columns), laid side by side and cut by global columns
    /// at `bounds` (non-decreasing, first 0, last the total), in parallel: each part may write
    /// its own columns of every row. For outputs laid out `[token][row]` whose weight rows are
    /// split across workers.
    pub fn split_cols<F: Fn(usize, ColsMut<'_>) + Sync>(&self, mats: &mut [&mut [f32]], n: usize, bounds: &[usize], f: F) {
        assert!(n > 0 && !mats.is_empty() && mats.len() <= MAX_COL_MATS, "split_cols: {} matrices of {n} rows", mats.len());
        let mut ptrs: [(SendPtr<f32>, usize); MAX_COL_MATS] = std::array::from_fn(|_| (SendPtr(std::ptr::null_mut()), 0));
        let mut starts = [usize::MAX; MAX_COL_MATS + 1];
        starts[0] = 0;
        for (i, m) in mats.iter_mut().enumerate() {
            assert!(m.len().is_multiple_of(n), "split_cols: {} values are not {n} rows", m.len());
            ptrs[i] = (SendPtr(m.as_mut_ptr()), m.len() / n);
            starts[i + 1] = starts[i] + m.len() / n;
        }
        let n_mats = mats.len();
        check_bounds(starts[n_mats], bounds);
        self.run(bounds.len().saturating_sub(1), |part| {
            let ptrs = &ptrs;
            f(
                part,
                ColsMut {
                    mats: std::array::from_fn(|i| (ptrs[i].0.0, ptrs[i].1)),
                    starts,
                    n_rows: n,
                    c0: bounds[part],
                    c1: bounds[part + 1],
                    _data: std::marker::PhantomData,
                },
            );
        });
    }
}

fn check_bounds(len: usize, bounds: &[usize]) {
    assert!(bounds.first() == Some(&0) && bounds.last() == Some(&len), "split: bounds must span the slice");
    assert!(bounds.windows(2).all(|w| w[0] <= w[1]), "split: bounds must not decrease");
}

/// Claims and runs parts of the current region until none are left.
fn claim_parts(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_parts.load(Acquire);
    loop {
        let p = s.next.fetch_add(1, AcqRel);
        if p >= n {
            return;
        }
        f(p);
    }
}

/// Parts a region over `n_threads` workers is cut into: a few per worker, so one that the OS
/// deschedules delays the region by a part, not by its whole share.
pub fn parts_for(n_threads: usize) -> usize {
    if n_threads == 1 { 1 } else { (4 * n_threads).min(MAX_PARTS) }
}

/// `n` items split into `parts` contiguous ranges of nearly equal size, each a multiple of
/// `align` except the last: returns `parts + 1` boundaries.
pub fn even_bounds(n: usize, parts: usize, align: usize, out: &mut [usize; MAX_PARTS + 1]) -> usize {
    let parts = parts.clamp(1, MAX_PARTS);
    let units = n.div_ceil(align);
    for (p, b) in out.iter_mut().enumerate().take(parts + 1) {
        *b = (units * p / parts * align).min(n);
    }
    parts
}

/// As [`even_bounds`], but with part sizes falling linearly (part p gets `parts − p` shares):
/// parts are claimed in order, so the big ones run first and the last, which one thread runs
/// while the others wait at the region's end, is the smallest (1/36 of the work for 8 parts,
/// against 1/8). For regions that stream weights, where that wait is a loss on every op.
pub fn tapered_bounds(n: usize, parts: usize, align: usize, out: &mut [usize; MAX_PARTS + 1]) -> usize {
    let parts = parts.clamp(1, MAX_PARTS);
    let units = n.div_ceil(align);
    for (p, b) in out.iter_mut().enumerate().take(parts + 1) {
        *b = (units * tapered_share(p, parts) / tapered_share(parts, parts) * align).min(n);
    }
    parts
}

/// Shares of the first `p` of `parts` tapered parts: Σ_{i<p} (parts − i).
pub fn tapered_share(p: usize, parts: usize) -> usize {
    p * (2 * parts + 1 - p) / 2
}

/// Most parts a region is split into (threads beyond this idle).
pub const MAX_PARTS: usize = 256;

struct SendPtr<T>(*mut T);
// SAFETY: used only to hand disjoint sub-slices of a `&mut [T]` with `T: Send` to other
// threads inside one region (`split_mut`).
unsafe impl<T: Send> Sync for SendPtr<T> {}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a job panicked; the data (an Option or ()) is still valid.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn worker(s: &Shared) {
    let mut seen = s.ctl.load(SeqCst) >> 32;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let mut c = s.ctl.load(Acquire);
        while c >> 32 == seen {
            if s.stop.load(Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > s.spin {
                // Park. sleepers is raised before ctl is re-read (both SeqCst), so a caller that
                // opens a region after our read sees sleepers > 0 and notifies.
                let mut g = lock(&s.sleep_lock);
                s.sleepers.fetch_add(1, SeqCst);
                while s.ctl.load(SeqCst) >> 32 == seen && !s.stop.load(SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                spins = 0;
            } else {
                std::hint::spin_loop();
            }
            c = s.ctl.load(Acquire);
        }
        if s.stop.load(SeqCst) {
            return;
        }
        seen = c >> 32;
        // Enter the region unless it is already closed (or a newer one has opened).
        let entered = loop {
            if c >> 32 != seen || c & CLOSED != 0 {
                break false;
            }
            match s.ctl.compare_exchange_weak(c, c + 1, AcqRel, Acquire) {
                Ok(_) => break true,
                Err(now) => c = now,
            }
        };
        if !entered {
            continue;
        }
        let job = *lock(&s.job);
        if let Some(f) = job
            && catch_unwind(AssertUnwindSafe(|| claim_parts(s, f))).is_err()
        {
            s.panicked.store(true, SeqCst);
        }
        s.ctl.fetch_sub(1, Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, SeqCst);
        s.ctl.fetch_add(1 << 32, SeqCst);
        {
            let _g = lock(&s.sleep_lock);
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_runs_once_per_region() {
        for n in [1, 2, 3, 5] {
            let pool = Pool::new(n);
            for parts in [0, 1, 2, 7, 40] {
                for _ in 0..200 {
                    let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
                    pool.run(parts, |i| {
                        hits[i].fetch_add(1, SeqCst);
                    });
                    assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
                }
            }
        }
    }

    #[test]
    fn zeroed_is_all_zeros_over_any_parts() {
        let pool = Pool::new(3);
        for len in [0, 1, 1000, 300_001] {
            let mut b = [0usize; MAX_PARTS + 1];
            let parts = even_bounds(len, 7, 1024, &mut b);
            // The allocator may hand back memory an earlier vector filled with non-zeros.
            drop(vec![f32::NAN; len]);
            let z = pool.zeroed(len, &b[..=parts]);
            assert_eq!(z.len(), len);
            assert!(z.iter().all(|&v| v.to_bits() == 0), "len {len}");
        }
    }

    #[test]
    fn split_mut_writes_disjoint_parts() {
        let pool = Pool::new(3);
        let mut data = vec![0usize; 1001];
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(data.len(), 7, 8, &mut b);
        pool.split_mut(&mut data, &b[..parts + 1], |p, chunk| chunk.iter_mut().for_each(|x| *x += p + 1));
        assert!(data.iter().all(|&x| (1..=7).contains(&x)));
        assert_eq!(data[0], 1);
        assert_eq!(data[1000], 7);
    }

    #[test]
    fn tapered_bounds_cover_and_shrink() {
        let mut b = [0usize; MAX_PARTS + 1];
        for (n, parts, align) in [(1024, 8, 16), (1000, 8, 16), (7, 8, 1), (248320, 8, 16), (5, 1, 1), (4096, 3, 64)] {
            let p = tapered_bounds(n, parts, align, &mut b);
            assert_eq!((b[0], b[p]), (0, n));
            for i in 0..p {
                assert!(b[i] <= b[i + 1]);
                assert!(b[i + 1] == n || b[i + 1] % align == 0, "{n} {parts} {align}: {:?}", &b[..=p]);
                // Falling sizes, up to one alignment unit of rounding.
                if i + 2 <= p && b[i + 2] < n {
                    assert!(b[i + 2] - b[i + 1] <= b[i + 1] - b[i] + align, "{n} {parts} {align}: {:?}", &b[..=p]);
                }
            }
        }
        tapered_bounds(36 * 64, 8, 1, &mut b);
        assert_eq!(b[8] - b[7], 64);
        assert_eq!(b[1] - b[0], 8 * 64);
    }

    #[test]
    fn workers_wake_after_parking() {
        // 2 ms between regions is longer than the default spin, so workers park every time.
        let pool = Pool::new(2);
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(2));
            let c = AtomicUsize::new(0);
            pool.run(8, |_| {
                c.fetch_add(1, SeqCst);
            });
            assert_eq!(c.load(SeqCst), 8);
        }
    }

    #[test]
    fn a_part_panic_reaches_the_caller() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(4, |i| assert_ne!(i, 1, "boom"))));
        assert!(r.is_err());
        // The pool still works afterwards.
        let c = AtomicUsize::new(0);
        pool.run(4, |_| {
            c.fetch_add(1, SeqCst);
        });
        assert_eq!(c.load(SeqCst), 4);
    }

    #[test]
    fn concurrent_callers_do_not_deadlock() {
        let pool = Arc::new(Pool::new(2));
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let p = pool.clone();
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        let c = AtomicUsize::new(0);
                        p.run(5, |_| {
                            c.fetch_add(1, SeqCst);
                        });
                        assert_eq!(c.load(SeqCst), 5);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
}
