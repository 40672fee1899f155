//! The driver side: GPU discovery, a [`Gpu`] (primary context + one stream), typed device
//! buffers, module loading by kernel name and launches (eager, or recorded and replayed as a
//! CUDA graph: [`crate::graph`]).

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, ValidAsZeroBits, result, sys,
};
use cudarc::nvrtc::Ptx;

use crate::error::{Error, Result, drv};
use crate::graph::{self, GraphStats, Pending, Recorder};
use crate::kernels::{self, Kernel};
use crate::nvrtc::{Image, Nvrtc};

mod feed;
mod fusions;
mod mailbox;
mod profile;
mod skip;
mod trace;
mod transfers;
mod uploads;

pub use feed::{FEED_TIMEOUT_NS, Feed};
pub use mailbox::{MAILBOX_TIMEOUT_NS, Mailbox};
use profile::{FlushTime, Profile};
pub use transfers::{DevRange, Download, LaterDownload};
use transfers::{Small, Stage};
pub(crate) use uploads::UploadDone;

/// What the driver says about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub cc: (u32, u32),
    /// Streaming multiprocessors.
    pub n_sm: u32,
    pub bytes_total: usize,
    /// Free memory as `cuMemGetInfo` sees it once a context exists (the context itself costs
    /// ~0.5 GiB: shared/STACK.md, "GPU probe").
    pub bytes_free: usize,
}

impl DeviceInfo {
    /// `sm_XX` number: 90 for (9, 0).
    pub fn sm(&self) -> u32 {
        self.cc.0 * 10 + self.cc.1
    }
}

/// The CUDA version of the driver as `cuDriverGetVersion` gives it (13000 for 13.0), or the
/// error saying why there is no driver. Never panics: cudarc's lazily loaded symbols panic
/// when libcuda is absent, so its presence is checked first.
pub fn driver_version() -> Result<u32> {
    static INIT: OnceLock<std::result::Result<u32, String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen libcuda.so(.1) by name.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda.so.1 could not be loaded".into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let mut v = 0;
        // SAFETY: libcuda is loaded (checked above); the call writes one int.
        let rc = unsafe { sys::cuDriverGetVersion(&mut v) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDriverGetVersion: {rc:?}"));
        }
        Ok(v as u32)
    })
    .clone()
    .map_err(Error::NoDriver)
}

/// Every GPU the driver sees. An error (never a panic) when there is no driver or no device.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    driver_version()?;
    let n = result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    (0..n as usize).map(|i| info(&CudaContext::new(i).map_err(drv("cuDevicePrimaryCtxRetain"))?)).collect()
}

fn info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    let (maj, min) = ctx.compute_capability().map_err(drv("cuDeviceGetAttribute"))?;
    let (free, total) = ctx.mem_get_info().map_err(drv("cuMemGetInfo"))?;
    Ok(DeviceInfo {
        index: ctx.ordinal(),
        name: ctx.name().map_err(drv("cuDeviceGetName"))?,
        cc: (maj as u32, min as u32),
        n_sm: ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(drv("cuDeviceGetAttribute"))? as u32,
        bytes_total: total,
        bytes_free: free,
    })
}

/// Element types of device buffers.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {}
impl Elem for f32 {}
impl Elem for u32 {}
impl Elem for i32 {}
impl Elem for u16 {}
impl Elem for u8 {}

/// A typed device buffer of one [`Gpu`]; freed (stream-ordered) on drop, after the recorded
/// launches that may name it are on the stream.
pub struct Buf<T: Elem> {
    /// At least one element: the driver has no empty allocations. Taken only by `drop`.
    slice: ManuallyDrop<CudaSlice<T>>,
    len: usize,
    pending: Arc<Pending>,
}

impl<T: Elem> std::fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buf").field("ptr", &self.ptr()).field("len", &self.len).finish()
    }
}

impl<T: Elem> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        if graph::is_pending(&self.pending) {
            // Recorded launches may name this buffer: its stream-ordered free must come after
            // them, so it waits in the graveyard for the flush that sends them.
            self.pending.graveyard.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(slice));
        }
    }
}

impl<T: Elem> Buf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw device address, for a kernel's parameter struct.
    pub fn ptr(&self) -> u64 {
        // Event tracking is off (Gpu::new), so the returned guard records nothing.
        self.slice.device_ptr(self.slice.stream()).0
    }
}

/// Checks that `at..at + len` lies inside a buffer of `cap` elements.
fn range(op: &'static str, cap: usize, at: usize, len: usize) -> Result<()> {
    if at.checked_add(len).is_none_or(|end| end > cap) {
        return Err(crate::error::shape(op, format!("elements {at}..{} of a buffer of {cap}", at.saturating_add(len))));
    }
    Ok(())
}

/// One GPU: its primary context and one stream every call of this crate runs on, in order.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    driver: u32,
    nvrtc: OnceLock<std::result::Result<Arc<Nvrtc>, String>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Pinned staging buffers for large uploads, made on the first one (None inside: pinned
    /// memory could not be had, large uploads go pageable).
    stage: Mutex<Option<Option<Stage>>>,
    /// Pinned buffers for a step's small transfers ([`Gpu::download_ranges`],
    /// [`Gpu::write_async`]), made on the first one.
    small: Mutex<Option<Small>>,
    /// The copy stream and its pinned buffers for [`Gpu::upload_async`], made on first use.
    lane: Mutex<Option<uploads::CopyLane>>,
    /// Per-kernel GPU time, when `EMBER_CUDA_PROFILE` is set.
    profile: Option<Mutex<Profile>>,
    /// Kernels left out of the run after their first launches (`EMBER_CUDA_SKIP`), for
    /// measuring what a kernel costs a step: wrong results, timing only.
    skip: Option<skip::Skip>,
    /// The in-GPU launch timeline (`EMBER_CUDA_TRACE`, see [`trace::Trace`]).
    trace: Option<trace::Trace>,
    /// Whether [`Gpu::begin_record`] records (`EMBER_CUDA_GRAPH=0` and the profile turn it off).
    graphs: AtomicBool,
    /// Launches go to `recorder` instead of the stream (between begin_record and end_record).
    recording: AtomicBool,
    recorder: Mutex<Recorder>,
    /// The most launches recorded before they are sent (`EMBER_CUDA_GRAPH_CHUNK`): the first
    /// list of a step is flushed at [`graph::FIRST_CHUNK`] launches, each next one at twice the
    /// last, up to this, so the GPU starts early and runs while the host records the rest.
    chunk: usize,
    /// Set while `recorder` holds launches; buffers dropped meanwhile wait in its graveyard.
    pending: Arc<Pending>,
    /// GPU time of every flush, when `EMBER_CUDA_GRAPH_STATS` is set.
    flush_time: Option<Mutex<FlushTime>>,
    /// Set by [`Gpu::begin_record`], cleared by the step's first flush, which notes its
    /// instant in `first_flush` (when the GPU got the step's first launches).
    awaiting_first: AtomicBool,
    first_flush: Mutex<Option<std::time::Instant>>,
    /// Whether one-token Fast matmuls take the int8 GEMV (`EMBER_GEMV_Q8=0`: no).
    gemv_q8: bool,
    /// Whether the automatic attention path may take the decode kernel (`EMBER_ATTN_DECODE=0`:
    /// no, the paths before it, for measuring it).
    attn_decode: bool,
    /// Whether Fast prompt attention may take the tensor-core tiles (`EMBER_ATTN_MMA=0`: no).
    attn_mma: bool,
    /// `EMBER_ATTN_MMA_WIDE`: 1 the tensor-core tiles of 128 query vectors (`attention_mma_w8`)
    /// at every depth where the GPU allows their shared memory, 0 never; unset (None): from
    /// `ATTN_MMA_WIDE_MIN_KEYS` keys (ops/attention.rs).
    attn_mma_wide: Option<bool>,
    /// Whether those wide tiles run as `attention_wg` (both products on wgmma, pages in flight
    /// two deep; docs/attention-wgmma.md step 3) where it applies (`EMBER_ATTN_WG=0`: never;
    /// [`Gpu::set_attention_wg`]). Measured on an H100 (docs/perf.md g32): the same bits as
    /// `attention_mma_w8`, 1.67x its speed at 32768 keys; the 35B's pp8192 @ d32768 +18 %.
    attn_wg: AtomicBool,
    /// The decode chain's fused launches and whether each is on ([`fusions::Fusions`]).
    fusions: fusions::Fusions,
    /// `EMBER_ATTN_HEADS`: query heads of every decode attention block (0: the launcher's choice).
    attn_heads: usize,
    /// Whether a one-token int8 MoE runs the shared expert inside the routed experts' kernels
    /// (`EMBER_MOE_SHARED=0`: no, its own GEMVs, gate and add, for measuring it).
    moe_shared: bool,
    /// Whether a grouped prompt MoE with Q4_K gate/up runs them on int8 tensor cores
    /// (`moe_mma8_gate_up_q4_k`) when its experts average at most 32 pairs
    /// (`EMBER_MOE_MMA8=0`: the f16 tiles always).
    pub(crate) moe_mma8: bool,
    /// Whether such a MoE runs a Q4_K or Q6_K down on int8 tensor cores (`moe_mma8_down_<type>`)
    /// under the same bound (`EMBER_MOE_MMA8_DOWN=0`: the f16 tiles always).
    pub(crate) moe_mma8_down: bool,
    /// Whether that int8 gate/up stages its operands through shared memory
    /// (`moe_mma8s_gate_up_q4_k`; `EMBER_MOE_MMA8_STAGED=0`: `moe_mma8_gate_up_q4_k`, which reads
    /// them straight into registers).
    pub(crate) moe_mma8_staged: bool,
    /// The most pairs an expert on average for the staged int8 gate/up
    /// (`EMBER_MOE_MMA8_MAX_PAIRS`; ops/moe/mod.rs MOE8S_MAX_PAIRS by default).
    pub(crate) moe_mma8s_max_pairs: usize,
    /// The same for the staged int8 down (`EMBER_MOE_MMA8_DOWN_MAX_PAIRS`; ops/moe/mod.rs
    /// MOE8SD_MAX_PAIRS by default).
    pub(crate) moe_mma8s_down_max_pairs: usize,
    /// Tokens above which Fast MoE calls group by expert (`EMBER_MOE_MMA_MIN_TOKENS` overrides
    /// [`crate::ops::MOE_MMA_MIN_TOKENS`]).
    pub(crate) moe_mma_min_tokens: usize,
    /// The int8 activations of [`Gpu::quantize_q8`] (grown on demand).
    q8: Mutex<Option<Buf<u8>>>,
    /// Bumped by every write of the int8 scratch ([`Gpu::q8_generation`]).
    q8_gen: std::sync::atomic::AtomicU64,
    /// Zeroed u32 counters for kernels whose last block of a group finishes the group's work
    /// ([`Gpu::counters`]; grown on demand).
    counters: Mutex<Option<Buf<u32>>>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Launches never flushed have no observer left; the graphs go before their modules.
        self.recorder.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.pending.any.store(false, Ordering::Release);
        graph::bury(&self.pending);
        if let Some(t) = &self.trace
            && let Err(e) = t.dump(&self.stream)
        {
            eprintln!("EMBER_CUDA_TRACE: {e}");
        }
        if let Some(t) = &self.flush_time {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            t.collect();
            let stats = self.recorder.lock().unwrap_or_else(|e| e.into_inner()).stats;
            eprintln!(
                "CUDA graphs (EMBER_CUDA_GRAPH_STATS): {stats:?}; GPU time inside flushes {:.1} ms over {} flushes; host time recording {} steps {:.1} ms",
                t.ms, t.n, t.steps, t.record_ms
            );
        }
        if let Some(p) = &self.profile {
            let report = p.lock().unwrap_or_else(|e| e.into_inner()).report();
            eprint!("{report}");
        }
    }
}

impl Gpu {
    /// Opens GPU `index`.
    pub fn new(index: usize) -> Result<Gpu> {
        let driver = driver_version()?;
        let ctx = CudaContext::new(index).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: called before any allocation of this context; we order work ourselves on the
        // one stream (and later with explicit events), so per-buffer events are not needed and
        // cost 1.5–2.4 µs per launch (shared/STACK.md, "cudarc").
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let info = info(&ctx)?;
        let mut recorder = Recorder::default();
        recorder.set_programmatic(info.sm() >= 90 && graph::programmatic_from_env());
        let trace = trace::Trace::from_env(&stream, index)?;
        Ok(Gpu {
            ctx,
            stream,
            info,
            driver,
            nvrtc: OnceLock::new(),
            modules: Mutex::default(),
            functions: Mutex::default(),
            stage: Mutex::default(),
            small: Mutex::default(),
            lane: Mutex::default(),
            skip: skip::Skip::from_env(),
            trace,
            profile: std::env::var_os("EMBER_CUDA_PROFILE").filter(|v| !v.is_empty() && v != "0").map(|_| Mutex::default()),
            graphs: AtomicBool::new(graph::graphs_from_env()),
            recording: AtomicBool::new(false),
            chunk: graph::chunk_from_env(),
            recorder: Mutex::new(recorder),
            pending: Arc::default(),
            flush_time: std::env::var_os("EMBER_CUDA_GRAPH_STATS").filter(|v| !v.is_empty() && v != "0").map(|_| Mutex::default()),
            awaiting_first: AtomicBool::new(false),
            first_flush: Mutex::default(),
            gemv_q8: std::env::var_os("EMBER_GEMV_Q8").is_none_or(|v| v != "0"),
            attn_decode: std::env::var_os("EMBER_ATTN_DECODE").is_none_or(|v| v != "0"),
            attn_mma: std::env::var_os("EMBER_ATTN_MMA").is_none_or(|v| v != "0"),
            attn_mma_wide: std::env::var_os("EMBER_ATTN_MMA_WIDE").map(|v| v == "1"),
            attn_wg: AtomicBool::new(std::env::var_os("EMBER_ATTN_WG").is_none_or(|v| v != "0")),
            fusions: fusions::Fusions::from_env(),
            attn_heads: std::env::var("EMBER_ATTN_HEADS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            moe_shared: std::env::var_os("EMBER_MOE_SHARED").is_none_or(|v| v != "0"),
            moe_mma8: std::env::var_os("EMBER_MOE_MMA8").is_none_or(|v| v != "0"),
            moe_mma8_down: std::env::var_os("EMBER_MOE_MMA8_DOWN").is_none_or(|v| v != "0"),
            moe_mma8_staged: std::env::var_os("EMBER_MOE_MMA8_STAGED").is_none_or(|v| v != "0"),
            moe_mma8s_max_pairs: std::env::var("EMBER_MOE_MMA8_MAX_PAIRS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(crate::ops::MOE8S_MAX_PAIRS),
            moe_mma8s_down_max_pairs: std::env::var("EMBER_MOE_MMA8_DOWN_MAX_PAIRS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(crate::ops::MOE8SD_MAX_PAIRS),
            moe_mma_min_tokens: std::env::var("EMBER_MOE_MMA_MIN_TOKENS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(crate::ops::MOE_MMA_MIN_TOKENS),
            q8: Mutex::default(),
            q8_gen: Default::default(),
            counters: Mutex::default(),
        })
    }

    /// Whether one-token Fast matmuls may take the int8 GEMV (`EMBER_GEMV_Q8=0` turns it off).
    pub(crate) fn gemv_q8_on(&self) -> bool {
        self.gemv_q8
    }

    /// Whether [`crate::ops::AttentionPath::Auto`] may take the decode kernel
    /// (`EMBER_ATTN_DECODE=0` turns it off).
    pub(crate) fn attn_decode_on(&self) -> bool {
        self.attn_decode
    }

    /// Whether Fast prompt attention may take the tensor-core tiles (`EMBER_ATTN_MMA=0` turns
    /// it off).
    pub(crate) fn attn_mma_on(&self) -> bool {
        self.attn_mma
    }

    /// Whether the tensor-core tiles take 128 query vectors a block by `EMBER_ATTN_MMA_WIDE`
    /// (None: unset, the launcher chooses by depth).
    pub(crate) fn attn_mma_wide_on(&self) -> Option<bool> {
        self.attn_mma_wide
    }

    /// Whether the wide prompt tiles may run as `attention_wg` (`EMBER_ATTN_WG=0` turns it off).
    pub(crate) fn attn_wg_on(&self) -> bool {
        self.attn_wg.load(Ordering::Relaxed)
    }

    /// Lets the wide prompt tiles run as `attention_wg` where it applies, or not (what
    /// `EMBER_ATTN_WG` sets at the start; for tests and measuring).
    pub fn set_attention_wg(&self, on: bool) {
        self.attn_wg.store(on, Ordering::Relaxed);
    }

    /// Query heads of every decode attention block that `EMBER_ATTN_HEADS` asks for (0: none,
    /// the launcher chooses; an A/B switch).
    pub(crate) fn attn_heads(&self) -> usize {
        self.attn_heads
    }

    /// Whether a one-token int8 MoE may run the shared expert in its kernels
    /// (`EMBER_MOE_SHARED=0` turns it off).
    pub(crate) fn moe_shared_on(&self) -> bool {
        self.moe_shared
    }

    /// The address of the int8 activation scratch, grown to hold `bytes` (the launches
    /// recorded so far keep the old buffer alive: see [`Buf`]'s drop).
    pub(crate) fn q8_scratch(&self, bytes: usize) -> Result<u64> {
        let mut q8 = self.q8.lock().unwrap_or_else(|e| e.into_inner());
        match &*q8 {
            Some(b) if b.len() >= bytes => Ok(b.ptr()),
            _ => {
                let b = self.alloc::<u8>(bytes.max(64 << 10))?;
                let ptr = b.ptr();
                *q8 = Some(b);
                Ok(ptr)
            }
        }
    }

    /// At least `len` u32 counters, zero between launches: a kernel that counts on them must
    /// leave each at zero when it ends (kernels/delta_rule.cu's `atomicInc` wraps its own).
    pub(crate) fn counters(&self, len: usize) -> Result<u64> {
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        match &*c {
            Some(b) if b.len() >= len => Ok(b.ptr()),
            _ => {
                let b = self.zeros::<u32>(len.max(4096))?;
                let ptr = b.ptr();
                *c = Some(b);
                Ok(ptr)
            }
        }
    }

    /// Which write of the int8 scratch it holds now: a caller that quantised a tensor there
    /// and finds the same generation later may use it without quantising again.
    pub fn q8_generation(&self) -> u64 {
        self.q8_gen.load(Ordering::Relaxed)
    }

    /// Marks a new write of the int8 scratch; returns its generation.
    pub(crate) fn bump_q8_generation(&self) -> u64 {
        self.q8_gen.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// From now on kernel launches are recorded, not sent, until [`Gpu::end_record`]; every call
    /// that touches the stream or memory sends them first ([`Gpu::flush`]), so the stream sees
    /// the same work in the same order. A no-op when graphs are off (`EMBER_CUDA_GRAPH=0`,
    /// [`Gpu::set_graphs`]) or under `EMBER_CUDA_PROFILE` (which times every launch).
    pub fn begin_record(&self) {
        self.begin_record_with(None, false);
    }

    /// [`Gpu::begin_record`] with the step's first list sent at `first` launches (None: the
    /// default, [`graph::FIRST_CHUNK`] or `EMBER_CUDA_GRAPH_FIRST`), and with `build_now` its
    /// lists seen for the first time built as graphs at once, not launched one by one (a step
    /// queued behind a wait for the host: [`graph::Recorder::restart_chunks`]).
    pub fn begin_record_with(&self, first: Option<usize>, build_now: bool) {
        let on = self.graphs.load(Ordering::Relaxed) && self.profile.is_none();
        self.recording.store(on, Ordering::Relaxed);
        self.recorder.lock().unwrap_or_else(|e| e.into_inner()).restart_chunks(first, build_now);
        self.awaiting_first.store(on, Ordering::Relaxed);
        if let Some(t) = &self.flush_time {
            t.lock().unwrap_or_else(|e| e.into_inner()).record_start = Some(std::time::Instant::now());
        }
    }

    /// Sends what was recorded and stops recording.
    pub fn end_record(&self) -> Result<()> {
        self.recording.store(false, Ordering::Relaxed);
        let r = self.flush();
        if let Some(t) = &self.flush_time {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            if let (Some(t0), Some(t1)) = (t.record_start.take(), t.last_flush.take()) {
                t.record_ms += (t1 - t0).as_secs_f64() * 1e3;
                t.steps += 1;
            }
        }
        r
    }

    /// Turns graph replay on or off (sends what was recorded first). For A/B runs and tests;
    /// the default comes from `EMBER_CUDA_GRAPH`.
    pub fn set_graphs(&self, on: bool) -> Result<()> {
        self.graphs.store(on, Ordering::Relaxed);
        if !on {
            return self.end_record();
        }
        Ok(())
    }

    /// Whether a kernel may wait on the host mid-step (the expert tier's mailbox): not when
    /// launches or flushes are timed (`EMBER_CUDA_PROFILE`, `EMBER_CUDA_GRAPH_STATS`: those
    /// wait on their events now and then, mid-step), nor without stream-ordered allocation
    /// (then freeing a buffer waits for the stream).
    pub fn host_waits_ok(&self) -> bool {
        self.profile.is_none() && self.flush_time.is_none() && self.ctx.has_async_alloc()
    }

    /// When the recorded step's first launches went to the stream (its first flush), if one
    /// did since [`Gpu::begin_record`]; taking it clears it.
    pub fn take_first_flush(&self) -> Option<std::time::Instant> {
        self.first_flush.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether [`Gpu::begin_record`] records.
    pub fn graphs(&self) -> bool {
        self.graphs.load(Ordering::Relaxed) && self.profile.is_none()
    }

    /// How the flushes went so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.recorder.lock().unwrap_or_else(|e| e.into_inner()).stats
    }

    /// Puts the recorded launches on the stream (as a CUDA graph when one pays), then frees the
    /// buffers dropped while they were pending.
    pub fn flush(&self) -> Result<()> {
        if !self.pending.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut rec = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
        if self.awaiting_first.swap(false, Ordering::Relaxed) {
            *self.first_flush.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        }
        if let Some(t) = &self.flush_time {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            if t.record_start.is_some() {
                t.last_flush = Some(std::time::Instant::now());
            }
        }
        let timed = self.timed_flush_start();
        let r = self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent")).and_then(|()| {
            // SAFETY: every launch was recorded under `launch`'s contract, whose buffers are
            // still live: a buffer dropped since waits in the graveyard until after this call.
            unsafe { rec.flush(&self.stream) }
        });
        self.timed_flush_end(timed);
        // A failed flush loses the list (the stream's state is unknown): the next flush starts
        // afresh.
        rec.discard();
        self.pending.any.store(false, Ordering::Release);
        drop(rec);
        graph::bury(&self.pending);
        r
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The driver's CUDA version (13000 for 13.0).
    pub fn driver_version(&self) -> u32 {
        self.driver
    }

    /// An event recorded before a flush, when flushes are timed.
    fn timed_flush_start(&self) -> Option<CudaEvent> {
        self.flush_time.as_ref()?;
        let ev = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()?;
        ev.record(&self.stream).ok()?;
        Some(ev)
    }

    fn timed_flush_end(&self, start: Option<CudaEvent>) {
        let (Some(t), Some(a)) = (&self.flush_time, start) else { return };
        let Ok(b) = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)) else { return };
        if b.record(&self.stream).is_ok() {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            t.pending.push((a, b));
            if t.pending.len() >= 1024 {
                t.collect();
            }
        }
    }

    /// The stream every call runs on. Work put on it directly must come after [`Gpu::flush`].
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether everything put on the stream so far has finished (`cuStreamQuery`; recorded
    /// launches not yet flushed do not count). An error the stream hit shows here.
    pub fn stream_idle(&self) -> Result<bool> {
        // SAFETY: queries this Gpu's live stream; no memory is touched.
        match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(drv("cuStreamQuery")(cudarc::driver::DriverError(e))),
        }
    }

    /// (free, total) bytes now.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("cuMemGetInfo"))
    }

    /// The NVRTC this GPU compiles with (loaded on first use, no newer than the driver).
    pub fn nvrtc(&self) -> Result<Arc<Nvrtc>> {
        self.nvrtc
            .get_or_init(|| Nvrtc::load(Some(self.driver / 1000)).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(|msg| Error::Nvrtc { op: "load", msg })
    }

    /// An uninitialised buffer of `len` elements. Fails with [`Error::OutOfMemory`] naming the
    /// bytes asked for and free.
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<Buf<T>> {
        // Buffers this replaces are freed after the launches recorded so far.
        self.flush()?;
        let bytes = len * std::mem::size_of::<T>();
        let oom = |free| Error::OutOfMemory { device: self.info.index, bytes_asked: bytes, bytes_free: free };
        let (free, _) = self.mem_info()?;
        if bytes > free {
            return Err(oom(free));
        }
        // SAFETY: the memory is uninitialised; every kernel and copy of this crate writes a
        // buffer before reading it, and `download` of an unwritten buffer only yields garbage
        // values of a plain-old-data type (Elem: ValidAsZeroBits types have no invalid bits).
        match unsafe { self.stream.alloc::<T>(len.max(1)) } {
            Ok(slice) => Ok(Buf { slice: ManuallyDrop::new(slice), len, pending: self.pending.clone() }),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(oom(self.mem_info().map(|m| m.0).unwrap_or(0))),
            Err(e) => Err(drv("cuMemAlloc")(e)),
        }
    }

    /// Runs `f` on this thread while worker threads compile (or read from the disk cache) every
    /// kernel not loaded yet, then loads their modules: a cold start compiles all kernels in
    /// parallel behind `f` (the weight upload) instead of one at a time on first use.
    pub fn preparing_kernels<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let nvrtc = self.nvrtc()?;
        let cc = self.info.sm();
        let todo: Vec<&'static Kernel> = {
            let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            kernels::ALL.iter().copied().filter(|k| !m.contains_key(k.name)).collect()
        };
        let next = AtomicUsize::new(0);
        let n_threads = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(1, todo.len().max(1));
        let (r, images) = std::thread::scope(|s| {
            let workers: Vec<_> = (0..n_threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&k) = todo.get(i) else { break out };
                            out.push((k, kernels::load_or_compile(&nvrtc, k, cc)));
                        }
                    })
                })
                .collect();
            let r = f();
            // A worker that panicked leaves its kernels to be compiled on first use.
            let images: Vec<_> = workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect();
            (r, images)
        });
        for (k, image) in images {
            self.load_image(k, image?)?;
        }
        Ok(r)
    }

    /// The kernel function `entry` of source `kernel`, compiling (or reading the disk cache)
    /// and loading the module on first use.
    pub fn function(&self, kernel: &'static Kernel, entry: &str) -> Result<CudaFunction> {
        let key = format!("{}/{entry}", kernel.name);
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(f.clone());
        }
        let module = self.module(kernel)?;
        let f = module.load_function(entry).map_err(drv("cuModuleGetFunction"))?;
        if let Some(s) = &self.skip {
            s.register(entry, f.cu_function() as usize);
        }
        if let Some(p) = &self.profile {
            p.lock().unwrap_or_else(|e| e.into_inner()).names.insert(f.cu_function() as usize, key.clone());
        }
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(key, f.clone());
        Ok(f)
    }

    fn module(&self, kernel: &'static Kernel) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.lock().unwrap_or_else(|e| e.into_inner()).get(kernel.name) {
            return Ok(m.clone());
        }
        let image = kernels::load_or_compile(&*self.nvrtc()?, kernel, self.info.sm())?;
        self.load_image(kernel, image)
    }

    fn load_image(&self, kernel: &'static Kernel, image: Image) -> Result<Arc<CudaModule>> {
        let ptx = match image {
            Image::Cubin(b) => Ptx::from_binary(b),
            Image::Ptx(s) => Ptx::from_src(s),
        };
        let m = self.ctx.load_module(ptx).map_err(drv("cuModuleLoadData"))?;
        if let Some(t) = &self.trace {
            t.attach(&self.stream, &m, kernel)?;
        }
        self.modules.lock().unwrap_or_else(|e| e.into_inner()).insert(kernel.name, m.clone());
        Ok(m)
    }

    /// Launches `f` with one parameter struct on the stream, or records the launch while
    /// recording ([`Gpu::begin_record`]; then a launch error shows at the next flush).
    ///
    /// # Safety
    /// `P` must have exactly the layout of the kernel's parameter struct and no padding bytes
    /// (a recorded launch keeps and compares its bytes), and every device pointer in it must
    /// point into live buffers of this GPU large enough for what the kernel reads and writes
    /// with these sizes (each op's launcher checks that).
    pub(crate) unsafe fn launch<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &P,
    ) -> Result<()> {
        if self.skip.as_ref().is_some_and(|s| s.skips(f.cu_function() as usize)) {
            return Ok(());
        }
        if self.recording.load(Ordering::Relaxed) {
            // SAFETY: P has no padding (the contract above), so all its bytes are initialised;
            // the view lives no longer than `params`.
            let bytes = unsafe { std::slice::from_raw_parts((params as *const P).cast::<u8>(), std::mem::size_of::<P>()) };
            let full =
                self.recorder.lock().unwrap_or_else(|e| e.into_inner()).record(f.cu_function(), grid, block, smem, bytes, self.chunk);
            self.pending.any.store(true, Ordering::Release);
            // A full list goes out now: the GPU runs it while the host records the next.
            return if full { self.flush() } else { Ok(()) };
        }
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
        let Some(prof) = &self.profile else {
            // SAFETY: the caller's contract above.
            unsafe { self.stream.launch_builder(f).arg(params).launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
            return Ok(());
        };
        let mut p = prof.lock().unwrap_or_else(|e| e.into_inner());
        let (a, b) = match p.spare.pop() {
            Some(pair) => pair,
            None => {
                let ev = || self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
                (ev()?, ev()?)
            }
        };
        a.record(&self.stream).map_err(drv("cuEventRecord"))?;
        // SAFETY: the caller's contract above.
        unsafe { self.stream.launch_builder(f).arg(params).launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        b.record(&self.stream).map_err(drv("cuEventRecord"))?;
        let name = p.names.get(&(f.cu_function() as usize)).cloned().unwrap_or_else(|| "?".into());
        p.pending.push((name, a, b));
        if p.pending.len() >= 4096 {
            p.flush();
        }
        Ok(())
    }

    /// Milliseconds of GPU time that `f`'s work takes, from events around it (the driver must be
    /// ≥ 12.8 for `cuEventElapsedTime_v2`; older drivers get host time after a sync).
    pub fn time_ms(&self, mut f: impl FnMut() -> Result<()>) -> Result<f32> {
        self.flush()?;
        if self.driver < 12080 {
            self.sync()?;
            let t = std::time::Instant::now();
            f()?;
            self.sync()?;
            return Ok(t.elapsed().as_secs_f32() * 1e3);
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        let end = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        start.record(&self.stream).map_err(drv("cuEventRecord"))?;
        f()?;
        self.flush()?;
        end.record(&self.stream).map_err(drv("cuEventRecord"))?;
        end.synchronize().map_err(drv("cuEventSynchronize"))?;
        start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))
    }
}
