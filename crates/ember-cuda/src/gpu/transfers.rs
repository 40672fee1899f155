//! Transfers of a [`Gpu`]: buffers filled from and read back to the host (pageable, through
//! the pinned staging buffers for large uploads, through small pinned buffers for a step's
//! routing and activations: [`Gpu::download_ranges`], [`Gpu::write_async`]), device-side
//! copies and zeroing, and the stream wait. Every call flushes the recorded launches first, so
//! the stream sees work in the order it was asked for.

use super::*;

/// Bytes per staging buffer: large enough that a copy's fixed cost is noise, small enough that
/// two of them are no burden on the host.
const STAGE_BYTES: usize = 64 << 20;

/// Two pinned host buffers and, for each, an event recorded after the copy that last read it:
/// the host fills one while the copy engine drains the other.
pub(super) struct Stage {
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
pub(super) struct Pinned {
    buf: Option<PinnedHostSlice<u8>>,
    /// Buffers outgrown, freed with this one: `cuMemFreeHost` waits for the whole device (an
    /// H100 measured it blocking until a kernel queued ahead finished), and a step queued ahead
    /// waits in `feed_wait` for the host, which may be growing a buffer before it feeds the
    /// step (docs/backend.md "Running ahead"). Powers of two from SMALL_BYTES_MIN: together less
    /// than the buffer that replaced them.
    retired: Vec<PinnedHostSlice<u8>>,
    done: CudaEvent,
    /// The smallest allocation refused so far (not asked for again).
    refused: usize,
}

impl Pinned {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Pinned> {
        let done = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(drv("cuEventCreate"))?;
        Ok(Pinned { buf: None, retired: Vec::new(), done, refused: usize::MAX })
    }

    /// The buffer's first `bytes`, once the copy that last used it is done (grown first if
    /// needed), and the event to record after the next; None when `bytes` is over
    /// [`SMALL_BYTES_MAX`] or pinned memory cannot be had.
    pub(super) fn take(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<Option<(&mut [u8], &CudaEvent)>> {
        self.done.synchronize().map_err(drv("cuEventSynchronize"))?;
        if bytes > SMALL_BYTES_MAX {
            return Ok(None);
        }
        let want = bytes.next_power_of_two().max(SMALL_BYTES_MIN);
        if want >= self.refused {
            return Ok(None);
        }
        if self.buf.as_ref().is_none_or(|b| b.len() < bytes) {
            // The old buffer's last copy is done (above); it is freed with this one, not now
            // (see `retired`).
            self.retired.extend(self.buf.take());
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

impl Pinned {
    /// The buffer's first `bytes` once the copy that last used it is done.
    fn filled(&self, bytes: usize) -> Result<&[u8]> {
        self.done.synchronize().map_err(drv("cuEventSynchronize"))?;
        match self.buf.as_ref() {
            Some(b) if b.len() >= bytes => Ok(&b.as_slice().map_err(drv("cuEventSynchronize"))?[..bytes]),
            _ => Err(crate::error::shape("download_wait", format!("{bytes} bytes from a smaller buffer"))),
        }
    }

    /// Whether the copy that last used the buffer is done (an error counts as not).
    pub(super) fn idle(&self) -> bool {
        self.done.try_is_complete().unwrap_or(false)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A copy still queued must not touch freed host memory.
        let _ = self.done.synchronize();
    }
}

/// Pinned buffers for uploads, used in turn: the host waits for a buffer's last copy only when
/// `UP` newer uploads are queued. Four: a step queued ahead (docs/backend.md) makes its batch's
/// and its page table's uploads, and at times a top-k table's, while the step before runs, and
/// none of them may wait for a copy queued behind its own wait for tokens.
const UP: usize = 4;

/// The small transfers' pinned buffers: one for downloads, `UP` used in turn for uploads (the
/// host fills one while the copies from the others may still be queued behind the GPU's work).
pub(super) struct Small {
    down: Pinned,
    up: [Pinned; UP],
    next_up: usize,
    /// [`Gpu::download_later`]'s, used in turn.
    later: [Pinned; 2],
    next_later: usize,
    /// How many [`Gpu::download_later`]s there were, and which one each buffer holds.
    n_later: u64,
    later_of: [u64; 2],
}

impl Small {
    fn new(ctx: &Arc<CudaContext>) -> Result<Small> {
        Ok(Small {
            down: Pinned::new(ctx)?,
            up: [Pinned::new(ctx)?, Pinned::new(ctx)?, Pinned::new(ctx)?, Pinned::new(ctx)?],
            next_up: 0,
            later: [Pinned::new(ctx)?, Pinned::new(ctx)?],
            next_later: 0,
            n_later: 0,
            later_of: [0; 2],
        })
    }
}

/// A range of a device buffer for [`Gpu::download_later`].
#[derive(Debug, Clone, Copy)]
pub struct DevRange {
    src: u64,
    bytes: usize,
}

impl DevRange {
    /// `buf[at..at + len]`; an error when the range is out of the buffer.
    pub fn new<T: Elem>(buf: &Buf<T>, at: usize, len: usize) -> Result<DevRange> {
        range("download_later", buf.len, at, len)?;
        Ok(DevRange { src: buf.ptr() + (at * std::mem::size_of::<T>()) as u64, bytes: len * std::mem::size_of::<T>() })
    }
}

/// A download queued by [`Gpu::download_later`]; [`Gpu::download_wait`] waits for it.
#[derive(Debug)]
pub struct LaterDownload {
    slot: usize,
    bytes: usize,
    nth: u64,
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

    /// [`Gpu::write`] without the wait: `data` is copied into one of `UP` pinned buffers of this
    /// GPU, used in turn, and the copy to the device goes on the stream (after the work queued
    /// before, before the work queued after). The host waits only to reuse a buffer whose copy
    /// is still queued, i.e. when `UP` newer uploads are. Over 16 MiB (`SMALL_BYTES_MAX`), or when
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
                small.next_up = (b + 1) % UP;
                return Ok(());
            }
        }
        self.write(buf, data)
    }

    /// Overwrites the start of each buffer with its data, without waiting (a step's small
    /// uploads): every item is copied into one of the small pinned upload buffers (each item at a
    /// 16-byte boundary), and the copies to the device go on the stream back to back, as in
    /// [`Gpu::write_async`]. Over 16 MiB in all, or when pinned memory cannot be had, the copies
    /// go pageable and the stream is waited on once.
    pub fn write_each<T: Elem>(&self, items: &mut [(&mut Buf<T>, &[T])]) -> Result<()> {
        for (buf, data) in items.iter() {
            if data.len() > buf.len() {
                return Err(crate::error::shape("write", format!("{} values into a buffer of {}", data.len(), buf.len())));
            }
        }
        self.flush()?;
        let at = |i: usize| items[..i].iter().map(|(_, d)| std::mem::size_of_val(*d).next_multiple_of(16)).sum::<usize>();
        let total = at(items.len());
        if total == 0 {
            return Ok(());
        }
        {
            let mut small = self.small.lock().unwrap_or_else(|e| e.into_inner());
            let small = match &mut *small {
                Some(s) => s,
                none => none.insert(Small::new(&self.ctx)?),
            };
            let b = small.next_up;
            if let Some((host, done)) = small.up[b].take(&self.ctx, total)? {
                self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
                let mut queued = Ok(());
                for (i, (buf, data)) in items.iter().enumerate().filter(|(_, (_, d))| !d.is_empty()) {
                    // SAFETY: Elem types are plain numbers (no padding, every bit pattern valid),
                    // so their bytes can be read as u8; the view lives no longer than `data`.
                    let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(*data)) };
                    let part = &mut host[at(i)..at(i) + bytes.len()];
                    part.copy_from_slice(bytes);
                    // SAFETY: the destination `buf[..data.len()]` lies inside `buf` (checked
                    // above), whose free is stream-ordered, after this copy; the source is pinned
                    // memory of `small.up[b]`, which the host does not touch before `done`,
                    // recorded right after these copies (also when one fails), has fired.
                    queued =
                        unsafe { result::memcpy_htod_async(buf.ptr(), &*part, self.stream.cu_stream()) }.map_err(drv("cuMemcpyHtoDAsync"));
                    if queued.is_err() {
                        break;
                    }
                }
                done.record(&self.stream).map_err(drv("cuEventRecord"))?;
                small.next_up = (b + 1) % UP;
                return queued;
            }
        }
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

    /// The ranges' bytes, one after the other, copied to the host behind the work queued so far,
    /// without waiting: into one of two pinned buffers kept for these reads, used in turn, so
    /// that the host may queue more work (a next step) before it waits ([`Gpu::download_wait`]).
    /// With two such reads not yet waited for, a third waits for the older one's copy first.
    /// At most 16 MiB (`SMALL_BYTES_MAX`); an error when pinned memory cannot be had.
    pub fn download_later(&self, parts: &[DevRange]) -> Result<LaterDownload> {
        let total: usize = parts.iter().map(|p| p.bytes).sum();
        self.flush()?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let stream = self.stream.cu_stream();
        let mut small = self.small.lock().unwrap_or_else(|e| e.into_inner());
        let small = match &mut *small {
            Some(s) => s,
            none => none.insert(Small::new(&self.ctx)?),
        };
        let slot = small.next_later;
        let Some((host, done)) = small.later[slot].take(&self.ctx, total.max(1))? else {
            return Err(crate::error::shape("download_later", format!("{total} bytes: no pinned buffer for them")));
        };
        let mut at = 0;
        let mut queued = Ok(());
        for p in parts.iter().filter(|p| p.bytes > 0) {
            // SAFETY: `p.src` is the start of a range inside a live buffer (DevRange::new checked
            // it; the caller keeps the buffer until the stream is past this copy, as for any
            // stream-ordered use); `host[at..at + bytes]` is pinned memory of `small.later[slot]`,
            // which the host does not touch before `done`, recorded right after these copies (also
            // when one fails), has fired.
            queued = unsafe { result::memcpy_dtoh_async(&mut host[at..at + p.bytes], p.src, stream) }.map_err(drv("cuMemcpyDtoHAsync"));
            if queued.is_err() {
                break;
            }
            at += p.bytes;
        }
        done.record(&self.stream).map_err(drv("cuEventRecord"))?;
        queued?;
        small.next_later = 1 - slot;
        small.n_later += 1;
        small.later_of[slot] = small.n_later;
        Ok(LaterDownload { slot, bytes: total, nth: small.n_later })
    }

    /// The bytes of a [`Gpu::download_later`], once its copies are done.
    pub fn download_wait(&self, d: LaterDownload) -> Result<Vec<u8>> {
        let small = self.small.lock().unwrap_or_else(|e| e.into_inner());
        let Some(small) = small.as_ref() else { return Err(crate::error::shape("download_wait", "no download was queued")) };
        if small.later_of[d.slot] != d.nth {
            return Err(crate::error::shape("download_wait", "two newer reads reused its buffer (at most two may wait)"));
        }
        Ok(small.later[d.slot].filled(d.bytes)?.to_vec())
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

    /// An event recorded on the stream after the work queued so far (recorded launches sent
    /// first): what another stream, maybe another GPU's, orders its work after.
    pub fn mark(&self) -> Result<CudaEvent> {
        self.flush()?;
        let ev = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(drv("cuEventCreate"))?;
        ev.record(&self.stream).map_err(drv("cuEventRecord"))?;
        Ok(ev)
    }

    /// Orders the stream's later work after `ev` (another stream's event, maybe another GPU's).
    pub fn wait_event(&self, ev: &CudaEvent) -> Result<()> {
        self.flush()?;
        self.stream.wait(ev).map_err(drv("cuStreamWaitEvent"))
    }

    /// The context this GPU's buffers belong to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Copies `len` values at device address `src` of context `src_ctx` (this GPU's or
    /// another's: a peer copy) to the start of `dst`, on the stream.
    ///
    /// # Safety
    /// `src` must address `len` f32 of a live allocation of `src_ctx` that stays live and
    /// unwritten until the copy is done: the caller orders that (the copy after an event of the
    /// writer's stream, the source's later work after an event recorded after the copy).
    pub unsafe fn copy_in(&self, dst: &mut Buf<f32>, src_ctx: &Arc<CudaContext>, src: u64, len: usize) -> Result<()> {
        range("copy_in", dst.len, 0, len)?;
        if len == 0 {
            return Ok(());
        }
        self.flush()?;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let (bytes, stream) = (len * std::mem::size_of::<f32>(), self.stream.cu_stream());
        if src_ctx.cu_ctx() == self.ctx.cu_ctx() {
            // SAFETY: dst's first len values are inside dst (checked above), whose free is
            // stream-ordered after this copy; the source is the caller's contract.
            unsafe { result::memcpy_dtod_async(dst.ptr(), src, bytes, stream) }.map_err(drv("cuMemcpyDtoDAsync"))
        } else {
            // SAFETY: as above, the source in its own context.
            unsafe { result::memcpy_peer_async(self.ctx.cu_ctx(), dst.ptr(), src_ctx.cu_ctx(), src, bytes, stream) }
                .map_err(drv("cuMemcpyPeerAsync"))
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
}
