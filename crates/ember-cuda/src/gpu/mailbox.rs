//! [`Mailbox`]: page-locked host memory mapped into the GPU's address space, through which a
//! decode step's partly resident MoE layer hands its routing to the host and gets the host's
//! sum of the non-resident pairs back, with no stream synchronisation (kernels/mailbox.cu has
//! the layout and the GPU's side; docs/backend.md the protocol).
//!
//! The host side: [`Mailbox::routed`] is the generation `moe_post` last published (an acquire
//! load: once it equals the step's generation, the ids, weights, `n_miss` and x it wrote are
//! visible); [`Mailbox::answer`] writes the sum and then `done` (a release store), which
//! `moe_wait_add` spins on.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::{CudaStream, result, sys};

use super::{Buf, Gpu};
use crate::error::{Result, drv, shape};

/// Words before the arrays (kernels/mailbox.cu `MB_HEAD`).
const HEAD: usize = 4;
const ROUTED: usize = 0;
const DONE: usize = 1;
const N_MISS: usize = 2;
const TIMED_OUT: usize = 3;

/// How long `moe_wait_add` waits for the host before it writes NaN rows instead: the host
/// answers a layer within milliseconds (its misses' bytes read once, even from a cold disk), so
/// this only ends a step whose host side failed or stalled, instead of hanging the stream.
pub const MAILBOX_TIMEOUT_NS: u64 = 10_000_000_000;

/// One layer's mailbox: room for `cap_pairs` routed (token, expert) pairs and `cap_x` floats of
/// the MoE's input (and as many of the host's sum). Dropping it waits for the stream; launches
/// naming it that are still recorded, not sent ([`Gpu::flush`]), must be sent before.
pub struct Mailbox {
    /// `cuMemHostAlloc(DEVICEMAP | PORTABLE)`, [`Mailbox::words`] u32, freed in `drop`.
    host: *mut u32,
    dev: u64,
    cap_pairs: usize,
    cap_x: usize,
    /// One u32 on the device: `n_miss` again, for the wait kernel to read without PCIe.
    need: Buf<u32>,
    stream: Arc<CudaStream>,
    timeout_ns: u64,
}

// SAFETY: the mapping is plain page-locked host memory owned by this value; the GPU's accesses
// are ordered by the protocol above, and every host access goes through `&self`/`&mut self`
// methods that read or write it with atomics or after the acquire load of `routed`.
unsafe impl Send for Mailbox {}

impl Gpu {
    /// A mailbox for up to `cap_pairs` routed pairs and `cap_x` floats of x.
    pub fn mailbox(&self, cap_pairs: usize, cap_x: usize) -> Result<Mailbox> {
        let words = Mailbox::words_for(cap_pairs, cap_x);
        let need = self.zeros(1)?;
        let (host, dev) = self.mapped_words(words)?;
        Ok(Mailbox { host, dev, cap_pairs, cap_x, need, stream: self.stream.clone(), timeout_ns: MAILBOX_TIMEOUT_NS })
    }

    /// `words` u32 of zeroed page-locked host memory mapped into this GPU's address space
    /// (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`): the host pointer and the device address. The
    /// caller owns the allocation and frees it with `cuMemFreeHost` once no launch can read it
    /// (the mailboxes, [`super::Feed`]).
    pub(super) fn mapped_words(&self, words: usize) -> Result<(*mut u32, u64)> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: allocates `4 · words` bytes of page-locked host memory; nothing else owns it.
        let host = unsafe { result::malloc_host(4 * words, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(drv("cuMemHostAlloc"))?
            .cast::<u32>();
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP just above; the call writes the
        // device address of that allocation.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) };
        if let Err(e) = rc.result() {
            // SAFETY: `host` came from cuMemHostAlloc above and nothing else knows it.
            unsafe {
                let _ = result::free_host(host.cast());
            }
            return Err(drv("cuMemHostGetDevicePointer")(e));
        }
        // SAFETY: the allocation holds `words` u32 (page-aligned), no kernel knows it yet.
        unsafe { std::ptr::write_bytes(host, 0, words) };
        Ok((host, dev))
    }
}

impl Mailbox {
    fn words_for(cap_pairs: usize, cap_x: usize) -> usize {
        HEAD + 2 * cap_pairs + 2 * cap_x
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        debug_assert!(i < HEAD);
        // SAFETY: `i` is a header word inside the allocation, 4-byte aligned; AtomicU32 has
        // u32's layout, and every host access of these words is atomic.
        unsafe { &*self.host.add(i).cast::<AtomicU32>() }
    }

    /// Copies `n` words from word offset `at` (the caller has seen this step's `routed`).
    fn read<T: Copy + Default>(&self, at: usize, n: usize) -> Vec<T> {
        debug_assert!(size_of::<T>() == 4 && at + n <= Mailbox::words_for(self.cap_pairs, self.cap_x));
        let mut v = vec![T::default(); n];
        // SAFETY: `at..at + n` lies inside the allocation (the callers bound `n` by the
        // capacities); the GPU wrote these words before its release store of `routed`, which
        // the caller acquired, and writes them again only in a later step.
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(at).cast::<T>(), v.as_mut_ptr(), n) };
        v
    }

    pub fn cap_pairs(&self) -> usize {
        self.cap_pairs
    }

    pub fn cap_x(&self) -> usize {
        self.cap_x
    }

    /// The mailbox's device address (kernels/mailbox.cu's `box`).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// The device word holding the last `n_miss`.
    pub fn need(&self) -> &Buf<u32> {
        &self.need
    }

    pub fn timeout_ns(&self) -> u64 {
        self.timeout_ns
    }

    /// How long the wait kernel waits for [`Mailbox::answer`] (from the next launch on).
    pub fn set_timeout_ns(&mut self, ns: u64) {
        self.timeout_ns = ns;
    }

    /// The generation `moe_post` last published.
    pub fn routed(&self) -> u32 {
        self.word(ROUTED).load(Ordering::Acquire)
    }

    /// Pairs of the last published routing whose expert is not resident.
    pub fn n_miss(&self) -> u32 {
        self.word(N_MISS).load(Ordering::Acquire)
    }

    /// The generation whose wait gave up on the host (NaN rows instead of the sum), if any
    /// was; read once the stream has finished that step.
    pub fn timed_out(&self) -> u32 {
        self.word(TIMED_OUT).load(Ordering::Acquire)
    }

    /// The last published routing's first `n` ids and weights.
    pub fn routing(&self, n: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        if n > self.cap_pairs {
            return Err(shape("mailbox", format!("{n} pairs in a mailbox of {}", self.cap_pairs)));
        }
        Ok((self.read(HEAD, n), self.read(HEAD + self.cap_pairs, n)))
    }

    /// The first `n` floats of x as published with misses.
    pub fn x(&self, n: usize) -> Result<Vec<f32>> {
        if n > self.cap_x {
            return Err(shape("mailbox", format!("{n} floats in a mailbox of {}", self.cap_x)));
        }
        Ok(self.read(HEAD + 2 * self.cap_pairs, n))
    }

    /// Writes the host's sum (added to the GPU's output by `moe_wait_add`), then `done = step`.
    pub fn answer(&self, step: u32, sum: &[f32]) -> Result<()> {
        if sum.len() > self.cap_x {
            return Err(shape("mailbox", format!("a sum of {} floats in a mailbox of {}", sum.len(), self.cap_x)));
        }
        let at = HEAD + 2 * self.cap_pairs + self.cap_x;
        // SAFETY: `at..at + sum.len()` lies inside the allocation (checked above); the GPU reads
        // these words only after it acquires `done == step`, which is stored below, after them.
        unsafe { std::ptr::copy_nonoverlapping(sum.as_ptr(), self.host.add(at).cast::<f32>(), sum.len()) };
        self.word(DONE).store(step, Ordering::Release);
        Ok(())
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // A queued wait kernel may still read the mapping: let the stream finish first (it does
        // within the wait's timeout even when nobody answers).
        let _ = self.stream.synchronize();
        // SAFETY: `host` came from cuMemHostAlloc in Gpu::mailbox and is freed once, here,
        // after the stream (the only one that launches with it) has finished.
        unsafe {
            let _ = result::free_host(self.host.cast());
        }
    }
}
