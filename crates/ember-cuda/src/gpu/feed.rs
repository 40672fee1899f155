//! [`Feed`]: page-locked host memory mapped into the GPU's address space, through which the
//! host hands a queued decode step its tokens (kernels/mailbox.cu `feed_wait` has the layout
//! and the GPU's side; docs/backend.md, "Running ahead", the protocol).
//!
//! The host side: [`Feed::write`] writes the tokens and then `fed` = the step's generation (a
//! release store), which `feed_wait` spins on; [`Feed::timed_out`] is the generation whose wait
//! gave up.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::{CudaStream, result};

use super::Gpu;
use crate::error::{Result, shape};

/// Words before the tokens (kernels/mailbox.cu `FD_HEAD`).
const HEAD: usize = 4;
const FED: usize = 0;
const TIMED_OUT: usize = 1;

/// How long `feed_wait` waits for the host before it goes on with token 0 in every row: the
/// host feeds a step within microseconds of the one ahead of it ending, so this only ends a
/// step whose host side stopped (a bug), instead of hanging the stream.
pub const FEED_TIMEOUT_NS: u64 = 10_000_000_000;

/// Room for `cap` tokens. Dropping it waits for the stream; launches naming it that are still
/// recorded, not sent ([`Gpu::flush`]), must be sent before.
pub struct Feed {
    /// `cuMemHostAlloc(DEVICEMAP | PORTABLE)`, `HEAD + cap` u32, freed in `drop`.
    host: *mut u32,
    dev: u64,
    cap: usize,
    stream: Arc<CudaStream>,
}

// SAFETY: the mapping is plain page-locked host memory owned by this value; the GPU reads the
// tokens only after it acquires `fed`, which the host stores (release) after writing them, and
// every host access goes through `&self`/`&mut self` methods.
unsafe impl Send for Feed {}

impl Gpu {
    /// A feed for steps of up to `cap` rows.
    pub fn feed(&self, cap: usize) -> Result<Feed> {
        let (host, dev) = self.mapped_words(HEAD + cap)?;
        Ok(Feed { host, dev, cap, stream: self.stream.clone() })
    }
}

impl Feed {
    fn word(&self, i: usize) -> &AtomicU32 {
        debug_assert!(i < HEAD);
        // SAFETY: `i` is a header word inside the allocation, 4-byte aligned; AtomicU32 has
        // u32's layout, and every host access of these words is atomic.
        unsafe { &*self.host.add(i).cast::<AtomicU32>() }
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The feed's device address (`feed_wait`'s `feed`).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Writes the tokens of the step of generation `step`, then `fed = step`: its `feed_wait`
    /// goes on.
    pub fn write(&self, step: u32, tokens: &[u32]) -> Result<()> {
        if tokens.len() > self.cap {
            return Err(shape("feed", format!("{} tokens in a feed of {}", tokens.len(), self.cap)));
        }
        // SAFETY: `HEAD..HEAD + tokens.len()` lies inside the allocation (checked above); the GPU
        // reads these words only after it acquires `fed == step`, stored below, after them; the
        // step before this one has read its tokens already (the host feeds a step only after it
        // has the rows of the one before, whose feed_wait ran first).
        unsafe { std::ptr::copy_nonoverlapping(tokens.as_ptr(), self.host.add(HEAD), tokens.len()) };
        self.word(FED).store(step, Ordering::Release);
        Ok(())
    }

    /// The generation whose `feed_wait` gave up on the host (0: none did); read once the
    /// stream has finished that step.
    pub fn timed_out(&self) -> u32 {
        self.word(TIMED_OUT).load(Ordering::Acquire)
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        // A queued wait kernel may still read the mapping: let the stream finish first (it does
        // within the wait's timeout even when nobody feeds it).
        let _ = self.stream.synchronize();
        // SAFETY: `host` came from cuMemHostAlloc in Gpu::feed and is freed once, here, after
        // the stream (the only one that launches with it) has finished.
        unsafe {
            let _ = result::free_host(self.host.cast());
        }
    }
}
