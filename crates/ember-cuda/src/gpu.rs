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
    /// Per-kernel GPU time, when `EMBER_CUDA_PROFILE` is set.
    profile: Option<Mutex<Profile>>,
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
    /// Whether one-token Fast matmuls take the int8 GEMV (`EMBER_GEMV_Q8=0`: no).
    gemv_q8: bool,
    /// Whether the automatic attention path may take the decode kernel (`EMBER_ATTN_DECODE=0`:
    /// no, the paths before it, for measuring it).
    attn_decode: bool,
    /// Whether Fast prompt attention may take the tensor-core tiles (`EMBER_ATTN_MMA=0`: no).
    attn_mma: bool,
    /// Whether a one-token int8 MoE runs the shared expert inside the routed experts' kernels
    /// (`EMBER_MOE_SHARED=0`: no, its own GEMVs, gate and add, for measuring it).
    moe_shared: bool,
    /// The int8 activations of [`Gpu::quantize_q8`] (grown on demand).
    q8: Mutex<Option<Buf<u8>>>,
    /// Bumped by every write of the int8 scratch ([`Gpu::q8_generation`]).
    q8_gen: std::sync::atomic::AtomicU64,
}

/// GPU time from an event pair around every flush (`EMBER_CUDA_GRAPH_STATS=1`): with graphs on,
/// the GPU time of the step's kernels (the stream is idle when a flush starts, so the pair spans
/// the graph's start to its end); printed with the [`GraphStats`] when the [`Gpu`] is dropped.
#[derive(Default)]
struct FlushTime {
    pending: Vec<(CudaEvent, CudaEvent)>,
    n: u64,
    ms: f64,
}

impl FlushTime {
    fn collect(&mut self) {
        if let Some((_, end)) = self.pending.last() {
            let _ = end.synchronize();
        }
        for (a, b) in self.pending.drain(..) {
            self.ms += a.elapsed_ms(&b).unwrap_or(0.0) as f64;
            self.n += 1;
        }
    }
}

/// GPU time per kernel entry from an event pair around every launch (`EMBER_CUDA_PROFILE=1`),
/// read back in batches; the totals go to stderr when the [`Gpu`] is dropped. The events cost
/// host time per launch, so wall-clock figures of a profiled run are not the engine's.
#[derive(Default)]
struct Profile {
    names: HashMap<usize, String>,
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    spare: Vec<(CudaEvent, CudaEvent)>,
    totals: HashMap<String, (u64, f64)>,
}

impl Profile {
    /// Adds every pending pair's time to the totals (waits for the last one).
    fn flush(&mut self) {
        if let Some((_, _, end)) = self.pending.last() {
            let _ = end.synchronize();
        }
        for (name, a, b) in self.pending.drain(..) {
            let ms = a.elapsed_ms(&b).unwrap_or(0.0) as f64;
            let t = self.totals.entry(name).or_default();
            t.0 += 1;
            t.1 += ms;
            self.spare.push((a, b));
        }
    }

    fn report(&mut self) -> String {
        self.flush();
        let mut rows: Vec<_> = self.totals.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let total: f64 = rows.iter().map(|r| r.1.1).sum();
        let calls: u64 = rows.iter().map(|r| r.1.0).sum();
        let mut out = format!("GPU time per kernel (EMBER_CUDA_PROFILE): {total:.1} ms in {calls} launches\n");
        out += &format!("{:<40} {:>9} {:>11} {:>9} {:>7}\n", "kernel", "calls", "total ms", "us/call", "share");
        for (name, (n, ms)) in rows {
            out += &format!("{name:<40} {n:>9} {ms:>11.2} {:>9.2} {:>6.1}%\n", 1e3 * ms / *n as f64, 100.0 * ms / total.max(1e-9));
        }
        out
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Launches never flushed have no observer left; the graphs go before their modules.
        self.recorder.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.pending.any.store(false, Ordering::Release);
        graph::bury(&self.pending);
        if let Some(t) = &self.flush_time {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            t.collect();
            let stats = self.recorder.lock().unwrap_or_else(|e| e.into_inner()).stats;
            eprintln!("CUDA graphs (EMBER_CUDA_GRAPH_STATS): {stats:?}; GPU time inside flushes {:.1} ms over {} flushes", t.ms, t.n);
        }
        if let Some(p) = &self.profile {
            let report = p.lock().unwrap_or_else(|e| e.into_inner()).report();
            eprint!("{report}");
        }
    }
}

/// Bytes per staging buffer: large enough that a copy's fixed cost is noise, small enough that
/// two of them are no burden on the host.
const STAGE_BYTES: usize = 64 << 20;

/// Two pinned host buffers and, for each, an event recorded after the copy that last read it:
/// the host fills one while the copy engine drains the other.
struct Stage {
    bufs: [PinnedHostSlice<u8>; 2],
    done: [CudaEvent; 2],
}

/// The largest transfer that goes through the small pinned buffers ([`Gpu::download_ranges`],
/// [`Gpu::write_async`]): a step's routing and activations (2,048 tokens of 2,048 f32 are
/// 16 MiB). Larger ones go pageable.
const SMALL_BYTES_MAX: usize = 16 << 20;
/// The smallest of those buffers; each grows to the next power of two a transfer needs.
const SMALL_BYTES_MIN: usize = 64 << 10;

/// A pinned host buffer grown on demand, and an event recorded after the last copy that used
/// it: the host does not write, read or free the buffer before that copy is done.
struct Pinned {
    buf: Option<PinnedHostSlice<u8>>,
    done: CudaEvent,
    /// The smallest allocation refused so far (not asked for again).
    refused: usize,
}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>) -> Result<Pinned> {
        let done = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(drv("cuEventCreate"))?;
        Ok(Pinned { buf: None, done, refused: usize::MAX })
    }

    /// The buffer's first `bytes`, once the copy that last used it is done (grown first if
    /// needed), and the event to record after the next; None when `bytes` is over
    /// [`SMALL_BYTES_MAX`] or pinned memory cannot be had.
    fn take(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<Option<(&mut [u8], &CudaEvent)>> {
        self.done.synchronize().map_err(drv("cuEventSynchronize"))?;
        if bytes > SMALL_BYTES_MAX {
            return Ok(None);
        }
        let want = bytes.next_power_of_two().max(SMALL_BYTES_MIN);
        if want >= self.refused {
            return Ok(None);
        }
        if self.buf.as_ref().is_none_or(|b| b.len() < bytes) {
            // The old buffer's last copy is done (above), so it may go.
            self.buf = None;
            // SAFETY: the memory is uninitialised until the write_bytes below, and nothing
            // reads it before.
            match unsafe { ctx.alloc_pinned_with_flags::<u8>(want, 0) } {
                Ok(mut b) => {
                    let ptr = b.as_mut_ptr().map_err(drv("cuEventSynchronize"))?;
                    // SAFETY: `ptr` points to `want` bytes of host memory owned by `b`.
                    unsafe { std::ptr::write_bytes(ptr, 0, want) };
                    self.buf = Some(b);
                }
                Err(_) => {
                    self.refused = want;
                    return Ok(None);
                }
            }
        }
        let Some(b) = self.buf.as_mut() else { return Ok(None) };
        Ok(Some((&mut b.as_mut_slice().map_err(drv("cuEventSynchronize"))?[..bytes], &self.done)))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A copy still queued must not touch freed host memory.
        let _ = self.done.synchronize();
    }
}

/// The small transfers' pinned buffers: one for downloads, two used in turn for uploads (the
/// host fills one while the copy from the other may still be queued behind the GPU's work).
struct Small {
    down: Pinned,
    up: [Pinned; 2],
    next_up: usize,
}

impl Small {
    fn new(ctx: &Arc<CudaContext>) -> Result<Small> {
        Ok(Small { down: Pinned::new(ctx)?, up: [Pinned::new(ctx)?, Pinned::new(ctx)?], next_up: 0 })
    }
}

/// One range for [`Gpu::download_ranges`]: `buf[at..at + len]` into `out`, which it resizes to
/// `len` (left empty when the range is out of the buffer: `download_ranges` refuses it).
pub struct Download<'a> {
    src: u64,
    /// `out`'s bytes.
    out: &'a mut [u8],
    check: Result<()>,
}

impl<'a> Download<'a> {
    pub fn new<T: Elem>(buf: &'a Buf<T>, at: usize, len: usize, out: &'a mut Vec<T>) -> Download<'a> {
        let check = range("download_ranges", buf.len, at, len);
        out.clear();
        let mut src = 0;
        if check.is_ok() {
            out.resize(len, T::default());
            src = buf.ptr() + (at * std::mem::size_of::<T>()) as u64;
        }
        // SAFETY: Elem types are plain numbers (no padding, every bit pattern valid), so their
        // bytes may be written as u8; the view borrows `out` mutably for 'a, so the vector is
        // neither read nor resized while it lives.
        let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out.as_slice())) };
        Download { src, out, check }
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
            profile: std::env::var_os("EMBER_CUDA_PROFILE").filter(|v| !v.is_empty() && v != "0").map(|_| Mutex::default()),
            graphs: AtomicBool::new(graph::graphs_from_env()),
            recording: AtomicBool::new(false),
            chunk: graph::chunk_from_env(),
            recorder: Mutex::new(recorder),
            pending: Arc::default(),
            flush_time: std::env::var_os("EMBER_CUDA_GRAPH_STATS").filter(|v| !v.is_empty() && v != "0").map(|_| Mutex::default()),
            gemv_q8: std::env::var_os("EMBER_GEMV_Q8").is_none_or(|v| v != "0"),
            attn_decode: std::env::var_os("EMBER_ATTN_DECODE").is_none_or(|v| v != "0"),
            attn_mma: std::env::var_os("EMBER_ATTN_MMA").is_none_or(|v| v != "0"),
            moe_shared: std::env::var_os("EMBER_MOE_SHARED").is_none_or(|v| v != "0"),
            q8: Mutex::default(),
            q8_gen: Default::default(),
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
        let on = self.graphs.load(Ordering::Relaxed) && self.profile.is_none();
        self.recording.store(on, Ordering::Relaxed);
        self.recorder.lock().unwrap_or_else(|e| e.into_inner()).restart_chunks();
    }

    /// Sends what was recorded and stops recording.
    pub fn end_record(&self) -> Result<()> {
        self.recording.store(false, Ordering::Relaxed);
        self.flush()
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

    /// A zeroed buffer.
    pub fn zeros<T: Elem>(&self, len: usize) -> Result<Buf<T>> {
        let mut b = self.alloc(len)?;
        self.stream.memset_zeros(&mut *b.slice).map_err(drv("cuMemsetD8Async"))?;
        Ok(b)
    }

    /// A new buffer holding `data`.
    pub fn upload<T: Elem>(&self, data: &[T]) -> Result<Buf<T>> {
        let mut b = self.alloc(data.len())?;
        self.write(&mut b, data)?;
        Ok(b)
    }

    /// Overwrites the start of `buf` with `data`.
    pub fn write<T: Elem>(&self, buf: &mut Buf<T>, data: &[T]) -> Result<()> {
        if data.len() > buf.len() {
            return Err(crate::error::shape("write", format!("{} values into a buffer of {}", data.len(), buf.len())));
        }
        self.flush()?;
        if std::mem::size_of_val(data) >= 2 * STAGE_BYTES && self.staged_write(buf.ptr(), data)? {
            return Ok(());
        }
        let mut view = buf.slice.slice_mut(0..data.len());
        self.stream.memcpy_htod(data, &mut view).map_err(drv("cuMemcpyHtoDAsync"))?;
        // A pageable source must stay alive until the copy is done; waiting makes that true.
        self.sync()
    }

    /// [`Gpu::write`] without the wait: `data` is copied into one of two pinned buffers of this
    /// GPU, used in turn, and the copy to the device goes on the stream (after the work queued
    /// before, before the work queued after). The host waits only to reuse a buffer whose copy
    /// is still queued, i.e. when two newer uploads are. Over 16 MiB (`SMALL_BYTES_MAX`), or when
    /// pinned memory cannot be had, it is [`Gpu::write`], which waits.
    pub fn write_async<T: Elem>(&self, buf: &mut Buf<T>, data: &[T]) -> Result<()> {
        if data.len() > buf.len() {
            return Err(crate::error::shape("write_async", format!("{} values into a buffer of {}", data.len(), buf.len())));
        }
        if data.is_empty() {
            return Ok(());
        }
        self.flush()?;
        // SAFETY: Elem types are plain numbers (no padding, every bit pattern valid), so their
        // bytes can be read as u8; the view lives no longer than `data`.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        {
            let mut small = self.small.lock().unwrap_or_else(|e| e.into_inner());
            let small = match &mut *small {
                Some(s) => s,
                none => none.insert(Small::new(&self.ctx)?),
            };
            let b = small.next_up;
            if let Some((host, done)) = small.up[b].take(&self.ctx, bytes.len())? {
                host.copy_from_slice(bytes);
                self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                // SAFETY: the destination `buf[..data.len()]` lies inside `buf` (checked above),
                // whose free is stream-ordered, after this copy; the source is pinned memory of
                // `small.up[b]`, which the host does not touch before `done`, recorded right
                // after this copy, has fired.
                unsafe { result::memcpy_htod_async(buf.ptr(), &*host, self.stream.cu_stream()) }.map_err(drv("cuMemcpyHtoDAsync"))?;
                done.record(&self.stream).map_err(drv("cuEventRecord"))?;
                small.next_up = 1 - b;
                return Ok(());
            }
        }
        self.write(buf, data)
    }

    /// Overwrites the start of each buffer with its data: the copies go back to back and the
    /// stream is waited on once (a step's small uploads, one wait instead of one each).
    pub fn write_each<T: Elem>(&self, items: &mut [(&mut Buf<T>, &[T])]) -> Result<()> {
        for (buf, data) in items.iter() {
            if data.len() > buf.len() {
                return Err(crate::error::shape("write", format!("{} values into a buffer of {}", data.len(), buf.len())));
            }
        }
        self.flush()?;
        for (buf, data) in items.iter_mut() {
            if std::mem::size_of_val(*data) >= 2 * STAGE_BYTES {
                self.write(buf, data)?;
            } else if !data.is_empty() {
                let mut view = buf.slice.slice_mut(0..data.len());
                self.stream.memcpy_htod(*data, &mut view).map_err(drv("cuMemcpyHtoDAsync"))?;
            }
        }
        // Pageable sources must stay alive until the copies are done; waiting makes that true.
        self.sync()
    }

    /// The buffer's contents (waits for the stream).
    pub fn download<T: Elem>(&self, buf: &Buf<T>) -> Result<Vec<T>> {
        self.flush()?;
        let mut v = self.stream.clone_dtoh(&*buf.slice).map_err(drv("cuMemcpyDtoHAsync"))?;
        self.sync()?;
        v.truncate(buf.len);
        Ok(v)
    }

    /// Overwrites `buf[at..at + data.len()]` with `data`.
    pub fn write_at<T: Elem>(&self, buf: &mut Buf<T>, at: usize, data: &[T]) -> Result<()> {
        range("write_at", buf.len, at, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.flush()?;
        let mut view = buf.slice.slice_mut(at..at + data.len());
        self.stream.memcpy_htod(data, &mut view).map_err(drv("cuMemcpyHtoDAsync"))?;
        // A pageable source must stay alive until the copy is done; waiting makes that true.
        self.sync()
    }

    /// `buf[at..at + len]` on the host (waits for the stream).
    pub fn download_range<T: Elem>(&self, buf: &Buf<T>, at: usize, len: usize) -> Result<Vec<T>> {
        range("download_range", buf.len, at, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        self.flush()?;
        let view = buf.slice.slice(at..at + len);
        let v = self.stream.clone_dtoh(&view).map_err(drv("cuMemcpyDtoHAsync"))?;
        self.sync()?;
        Ok(v)
    }

    /// Every part's range on the host, with one flush and one wait for the stream (instead of
    /// one each): the copies go back to back into a pinned buffer of this GPU, then to the
    /// parts' vectors. Pageable copies, straight into the vectors, when the parts' bytes are
    /// over 16 MiB (`SMALL_BYTES_MAX`) or pinned memory cannot be had. Nothing is copied when a
    /// range is out of its buffer.
    pub fn download_ranges(&self, parts: &mut [Download<'_>]) -> Result<()> {
        for p in parts.iter_mut() {
            std::mem::replace(&mut p.check, Ok(()))?;
        }
        let total: usize = parts.iter().map(|p| p.out.len()).sum();
        if total == 0 {
            return Ok(());
        }
        self.flush()?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let stream = self.stream.cu_stream();
        let mut small = self.small.lock().unwrap_or_else(|e| e.into_inner());
        let small = match &mut *small {
            Some(s) => s,
            none => none.insert(Small::new(&self.ctx)?),
        };
        let Some((host, done)) = small.down.take(&self.ctx, total)? else {
            for p in parts.iter_mut().filter(|p| !p.out.is_empty()) {
                // SAFETY: `p.src` is the range's start inside a live buffer (Download::new
                // checked the range; `p` borrows the buffer); `p.out` is borrowed for this whole
                // call, so it outlives the wait below.
                unsafe { result::memcpy_dtoh_async(&mut *p.out, p.src, stream) }.map_err(drv("cuMemcpyDtoHAsync"))?;
            }
            return self.sync();
        };
        let mut at = 0;
        let mut queued = Ok(());
        for p in parts.iter() {
            let n = p.out.len();
            // SAFETY: as above for the source; `host[at..at + n]` is pinned memory of
            // `small.down`, which the host does not touch before `done`, recorded right after
            // these copies (also when one fails), has fired, and reads only after the wait below.
            queued = unsafe { result::memcpy_dtoh_async(&mut host[at..at + n], p.src, stream) }.map_err(drv("cuMemcpyDtoHAsync"));
            if queued.is_err() {
                break;
            }
            at += n;
        }
        done.record(&self.stream).map_err(drv("cuEventRecord"))?;
        queued?;
        self.sync()?;
        let mut at = 0;
        for p in parts.iter_mut() {
            let n = p.out.len();
            p.out.copy_from_slice(&host[at..at + n]);
            at += n;
        }
        Ok(())
    }

    /// Zeroes `buf[at..at + len]` (stream-ordered).
    pub fn zero_range<T: Elem>(&self, buf: &mut Buf<T>, at: usize, len: usize) -> Result<()> {
        range("zero_range", buf.len, at, len)?;
        if len == 0 {
            return Ok(());
        }
        self.flush()?;
        let mut view = buf.slice.slice_mut(at..at + len);
        self.stream.memset_zeros(&mut view).map_err(drv("cuMemsetD8Async"))
    }

    /// Copies `src[src_at..src_at + len]` into `dst[dst_at..dst_at + len]` (stream-ordered).
    pub fn copy<T: Elem>(&self, src: &Buf<T>, src_at: usize, dst: &mut Buf<T>, dst_at: usize, len: usize) -> Result<()> {
        range("copy", src.len, src_at, len)?;
        range("copy", dst.len, dst_at, len)?;
        if len == 0 {
            return Ok(());
        }
        self.flush()?;
        let from = src.slice.slice(src_at..src_at + len);
        let mut to = dst.slice.slice_mut(dst_at..dst_at + len);
        self.stream.memcpy_dtod(&from, &mut to).map_err(drv("cuMemcpyDtoDAsync"))
    }

    /// Copies `buf[from..from + len]` to `buf[to..to + len]` (ranges must not overlap;
    /// stream-ordered).
    pub fn copy_within<T: Elem>(&self, buf: &mut Buf<T>, from: usize, to: usize, len: usize) -> Result<()> {
        range("copy_within", buf.len, from, len)?;
        range("copy_within", buf.len, to, len)?;
        if len == 0 || from == to {
            return Ok(());
        }
        if from < to && from + len > to || to < from && to + len > from {
            return Err(crate::error::shape("copy_within", format!("ranges {from}+{len} and {to}+{len} overlap")));
        }
        self.flush()?;
        if from < to {
            let (lo, mut hi) = buf.slice.split_at_mut(to);
            let src = lo.slice(from..from + len);
            let mut dst = hi.slice_mut(0..len);
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv("cuMemcpyDtoDAsync"))
        } else {
            let (mut lo, hi) = buf.slice.split_at_mut(from);
            let src = hi.slice(0..len);
            let mut dst = lo.slice_mut(to..to + len);
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv("cuMemcpyDtoDAsync"))
        }
    }

    /// Waits until all work on the stream is done.
    pub fn sync(&self) -> Result<()> {
        self.flush()?;
        self.stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Copies `data` to the device address `dst` through the pinned staging buffers: host
    /// threads copy a chunk into one buffer while the previous chunk's DMA runs from the other
    /// (a pageable copy goes through the driver's own small buffers one at a time). Returns
    /// false, having copied nothing, when pinned memory cannot be had. Waits for the copies.
    fn staged_write<T: Elem>(&self, dst: u64, data: &[T]) -> Result<bool> {
        // SAFETY: Elem types are plain numbers (no padding, every bit pattern valid), so their
        // bytes can be read as u8; the view lives no longer than `data`.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        self.staged_parts(dst, &[bytes])
    }

    /// [`Gpu::staged_write`] of the concatenation of `parts` (a gather: e.g. the experts a
    /// prompt batch needs, each from its own place in the file).
    fn staged_parts(&self, dst: u64, parts: &[&[u8]]) -> Result<bool> {
        self.flush()?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut guard = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(self.new_stage().ok());
        }
        let Some(Some(stage)) = guard.as_mut() else { return Ok(false) };
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(1, 8);
        let (mut part, mut off, mut done, mut i) = (0usize, 0usize, 0usize, 0usize);
        while done < total {
            let b = i % 2;
            let n = (total - done).min(STAGE_BYTES);
            // The pieces of the parts that fill this chunk: (source, offset in the chunk).
            let mut pieces: Vec<(&[u8], usize)> = Vec::new();
            let mut filled = 0;
            while filled < n {
                let p = parts[part];
                let take = (p.len() - off).min(n - filled);
                pieces.push((&p[off..off + take], filled));
                filled += take;
                off += take;
                if off == p.len() {
                    part += 1;
                    off = 0;
                }
            }
            // The copy that last read buffer b (chunk i - 2) has finished.
            stage.done[b].synchronize().map_err(drv("cuEventSynchronize"))?;
            let host = &mut stage.bufs[b].as_mut_slice().map_err(drv("cuEventSynchronize"))?[..n];
            let per = n.div_ceil(threads);
            let pieces = &pieces;
            std::thread::scope(|s| {
                for (t, h) in host.chunks_mut(per).enumerate() {
                    s.spawn(move || {
                        let (lo, hi) = (t * per, t * per + h.len());
                        for &(src, at) in pieces.iter().filter(|(src, at)| *at < hi && at + src.len() > lo) {
                            let (a, z) = (at.max(lo), (at + src.len()).min(hi));
                            h[a - lo..z - lo].copy_from_slice(&src[a - at..z - at]);
                        }
                    });
                }
            });
            let at = dst + done as u64;
            // SAFETY: `at..at + n` lies inside the destination buffer (the callers check the
            // range); the source is pinned memory owned by `self.stage`, not touched again
            // before `done[b]`, recorded right after this copy, has fired.
            unsafe { result::memcpy_htod_async(at, &*host, self.stream.cu_stream()) }.map_err(drv("cuMemcpyHtoDAsync"))?;
            stage.done[b].record(&self.stream).map_err(drv("cuEventRecord"))?;
            done += n;
            i += 1;
        }
        self.sync()?;
        Ok(true)
    }

    /// Writes the concatenation of `parts` at `buf[at..]` through the pinned staging buffers
    /// (pageable copies, one part at a time, when pinned memory cannot be had). Waits for the
    /// copies.
    pub fn write_parts(&self, buf: &mut Buf<u8>, at: usize, parts: &[&[u8]]) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        range("write_parts", buf.len, at, total)?;
        self.flush()?;
        if total == 0 || self.staged_parts(buf.ptr() + at as u64, parts)? {
            return Ok(());
        }
        let mut to = at;
        for p in parts {
            self.write_at(buf, to, p)?;
            to += p.len();
        }
        Ok(())
    }

    fn new_stage(&self) -> Result<Stage> {
        // SAFETY: the buffers are written before any copy reads them (staged_write).
        let buf = || unsafe { self.ctx.alloc_pinned_with_flags::<u8>(STAGE_BYTES, 0) }.map_err(drv("cuMemHostAlloc"));
        let ev = || self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(drv("cuEventCreate"));
        Ok(Stage { bufs: [buf()?, buf()?], done: [ev()?, ev()?] })
    }

    /// Gives the pinned staging buffers back (after the weights are up).
    pub fn release_staging(&self) {
        *self.stage.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
