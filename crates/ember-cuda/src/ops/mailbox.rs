use cudarc::driver::DeviceRepr;

use super::moe::MoeRouting;
use super::{blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Feed, Gpu, Mailbox};
use crate::kernels::MAILBOX;

#[repr(C)]
struct MoePostParams {
    ids: u64,
    weights: u64,
    x: u64,
    slot_of: u64,
    step: u64,
    need: u64,
    mailbox: u64,
    n_pairs: u32,
    n_expert: u32,
    n_x: u32,
    cap_pairs: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoePostParams` in kernels/mailbox.cu (7 u64, 4 u32).
unsafe impl DeviceRepr for MoePostParams {}

#[repr(C)]
struct MoeWaitParams {
    out: u64,
    mailbox: u64,
    step: u64,
    need: u64,
    timeout_ns: u64,
    n_x: u32,
    cap_pairs: u32,
    cap_x: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeWaitParams` in kernels/mailbox.cu (5 u64, 4 u32).
unsafe impl DeviceRepr for MoeWaitParams {}

#[repr(C)]
struct FeedWaitParams {
    feed: u64,
    step: u64,
    tokens: u64,
    timeout_ns: u64,
    n: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `FeedWaitParams` in kernels/mailbox.cu (4 u64, 2 u32).
unsafe impl DeviceRepr for FeedWaitParams {}

impl Gpu {
    /// Publishes a routing of `n_pairs = routing.k · n_tok` pairs in `mb` for the host (and x
    /// [`n_x`] when some pair's expert is a miss in `slot_of` [n_expert]), tagged with the
    /// generation in `step` (one u32 on the device). See kernels/mailbox.cu.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_post(
        &self,
        routing: MoeRouting<'_>,
        n_tok: usize,
        x: &Buf<f32>,
        n_x: usize,
        slot_of: &Buf<u32>,
        n_expert: usize,
        step: &Buf<u32>,
        mb: &Mailbox,
    ) -> Result<()> {
        const OP: &str = "moe_post";
        let n_pairs = n_tok * routing.k;
        if n_pairs > mb.cap_pairs() || n_x > mb.cap_x() {
            return Err(shape(OP, format!("{n_pairs} pairs and {n_x} floats of x in a mailbox of {} and {}", mb.cap_pairs(), mb.cap_x())));
        }
        need(OP, "ids", routing.ids, n_pairs)?;
        need(OP, "weights", routing.weights, n_pairs)?;
        need(OP, "x", x, n_x)?;
        need(OP, "slot_of", slot_of, n_expert)?;
        need(OP, "step", step, 1)?;
        let p = MoePostParams {
            ids: routing.ids.ptr(),
            weights: routing.weights.ptr(),
            x: x.ptr(),
            slot_of: slot_of.ptr(),
            step: step.ptr(),
            need: mb.need().ptr(),
            mailbox: mb.device_ptr(),
            n_pairs: u32_of(OP, "pairs", n_pairs)?,
            n_expert: u32_of(OP, "n_expert", n_expert)?,
            n_x: u32_of(OP, "n_x", n_x)?,
            cap_pairs: u32_of(OP, "cap_pairs", mb.cap_pairs())?,
        };
        let f = self.function(&MAILBOX, "moe_post")?;
        // SAFETY: sizes checked above; the mailbox holds cap_pairs ids and weights and cap_x
        // floats of x, mapped for this GPU, and lives while this launch may run: its drop waits
        // for the stream, and its owner sends recorded launches before dropping it (Mailbox).
        unsafe { self.launch(&f, (1, 1, 1), 256, 0, &p) }
    }

    /// `out[..n_x] += ` the host's sum in `mb` once the host has answered this step's
    /// generation, when the last [`Gpu::moe_post`] on `mb` found misses; otherwise nothing.
    pub fn moe_wait_add(&self, out: &mut Buf<f32>, n_x: usize, step: &Buf<u32>, mb: &Mailbox) -> Result<()> {
        const OP: &str = "moe_wait_add";
        if n_x > mb.cap_x() {
            return Err(shape(OP, format!("{n_x} floats in a mailbox of {}", mb.cap_x())));
        }
        need(OP, "out", out, n_x)?;
        need(OP, "step", step, 1)?;
        let p = MoeWaitParams {
            out: out.ptr(),
            mailbox: mb.device_ptr(),
            step: step.ptr(),
            need: mb.need().ptr(),
            timeout_ns: mb.timeout_ns(),
            n_x: u32_of(OP, "n_x", n_x)?,
            cap_pairs: u32_of(OP, "cap_pairs", mb.cap_pairs())?,
            cap_x: u32_of(OP, "cap_x", mb.cap_x())?,
            pad: 0,
        };
        let f = self.function(&MAILBOX, "moe_wait_add")?;
        // A few blocks: each polls `done`, then adds its share of the sum over PCIe.
        let grid = blocks(n_x, 1024).clamp(1, 32);
        // SAFETY: sizes checked above; the mailbox holds cap_x floats of sum after its
        // routing and x, and lives while this launch may run (as for moe_post).
        unsafe { self.launch(&f, (grid, 1, 1), 256, 0, &p) }
    }

    /// Waits on the device until the host has fed the step of the generation in `step` (one
    /// u32 on the device) through `feed`, then writes its `n` tokens to `tokens` (token 0 in
    /// every row after `timeout_ns` without them). See kernels/mailbox.cu.
    pub fn feed_wait(&self, feed: &Feed, step: &Buf<u32>, tokens: &mut Buf<u32>, n: usize, timeout_ns: u64) -> Result<()> {
        const OP: &str = "feed_wait";
        if n > feed.cap() {
            return Err(shape(OP, format!("{n} tokens in a feed of {}", feed.cap())));
        }
        need(OP, "step", step, 1)?;
        need(OP, "tokens", tokens, n)?;
        let p =
            FeedWaitParams { feed: feed.device_ptr(), step: step.ptr(), tokens: tokens.ptr(), timeout_ns, n: u32_of(OP, "n", n)?, pad: 0 };
        let f = self.function(&MAILBOX, "feed_wait")?;
        // SAFETY: sizes checked above; the feed holds cap tokens after its header, mapped for this
        // GPU, and lives while this launch may run: its drop waits for the stream, and its owner
        // sends recorded launches before dropping it (Feed).
        unsafe { self.launch(&f, (1, 1, 1), 128, 0, &p) }
    }
}
