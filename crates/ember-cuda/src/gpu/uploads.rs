//! Uploads on a copy stream ([`Gpu::upload_async`]): the expert tier moves an expert into a
//! slot while the compute stream goes on. The bytes are copied into a pinned buffer of a small
//! ring, the copy stream waits for everything queued on the compute stream so far (an event),
//! then copies each part to its device address; the caller gets an [`UploadDone`] and must not
//! free or read the destination before it says done (the tier keeps the slot out of its slot
//! table meanwhile: its pairs run on the CPU).

use super::transfers::Pinned;
use super::*;

/// Pinned buffers in the ring: uploads in flight at once before the next one waits for the
/// oldest (the tier queues at most a few a step, each done within ~0.1 ms).
const LANE_BUFS: usize = 8;

/// The copy stream and its ring of pinned buffers.
pub(super) struct CopyLane {
    stream: Arc<CudaStream>,
    bufs: Vec<Pinned>,
    next: usize,
}

/// The end of an upload: an event recorded on the copy stream after its copies.
pub(crate) struct UploadDone {
    event: CudaEvent,
}

impl UploadDone {
    /// Whether the copies are done (an error the copy stream hit shows here).
    pub fn is_done(&self) -> Result<bool> {
        self.event.try_is_complete().map_err(drv("cuEventQuery"))
    }

    /// Waits for the copies.
    pub fn wait(&self) -> Result<()> {
        self.event.synchronize().map_err(drv("cuEventSynchronize"))
    }
}

impl Gpu {
    /// Queues `parts` (device address, bytes) on the copy stream, after everything queued on
    /// the compute stream so far, without waiting. When pinned memory cannot be had (or the
    /// parts are over 16 MiB in all) the copies are made synchronously, after the compute
    /// stream has finished, and the returned upload is already done.
    ///
    /// # Safety
    /// Every `dst..dst + bytes.len()` must lie inside one live device buffer of this GPU, which
    /// neither the host nor a kernel reads or frees before the returned [`UploadDone`] is done.
    pub(crate) unsafe fn upload_async(&self, parts: &[(u64, &[u8])]) -> Result<UploadDone> {
        self.flush()?;
        let total: usize = parts.iter().map(|p| p.1.len()).sum();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let event = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        let mut lane = self.lane.lock().unwrap_or_else(|e| e.into_inner());
        if lane.is_none() {
            let stream = self.ctx.new_stream().map_err(drv("cuStreamCreate"))?;
            *lane = Some(CopyLane { stream, bufs: Vec::new(), next: 0 });
        }
        let Some(lane) = lane.as_mut() else { unreachable!("made above") };
        // A buffer whose last copy is done; else a new one; else the next in turn (waits).
        let i = match lane.bufs.iter().position(Pinned::idle) {
            Some(i) => i,
            None if lane.bufs.len() < LANE_BUFS => {
                lane.bufs.push(Pinned::new(&self.ctx)?);
                lane.bufs.len() - 1
            }
            None => {
                lane.next = (lane.next + 1) % LANE_BUFS;
                lane.next
            }
        };
        let Some((host, done)) = lane.bufs[i].take(&self.ctx, total)? else {
            self.sync()?;
            for (dst, b) in parts {
                // SAFETY: the destination is live device memory nobody touches until the upload
                // is done (the caller's contract); the copy is synchronous from `b`.
                unsafe { result::memcpy_htod_sync(*dst, b) }.map_err(drv("cuMemcpyHtoD"))?;
            }
            event.record(&self.stream).map_err(drv("cuEventRecord"))?;
            return Ok(UploadDone { event });
        };
        let mut at = 0;
        for (_, b) in parts {
            host[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        let ready = self.ctx.new_event(flags).map_err(drv("cuEventCreate"))?;
        ready.record(&self.stream).map_err(drv("cuEventRecord"))?;
        lane.stream.wait(&ready).map_err(drv("cuStreamWaitEvent"))?;
        let mut at = 0;
        let mut copied = Ok(());
        for (dst, b) in parts {
            // SAFETY: the destination is live device memory nobody touches until the upload is
            // done (the caller's contract); the source is `host[at..]`, pinned memory of the
            // ring that is not written again before `done`, recorded after these copies.
            copied = unsafe { result::memcpy_htod_async(*dst, &host[at..at + b.len()], lane.stream.cu_stream()) }
                .map_err(drv("cuMemcpyHtoDAsync"));
            if copied.is_err() {
                break;
            }
            at += b.len();
        }
        // Recorded even after a failed copy: the buffer is not reused before the copies queued.
        let recorded = done.record(&lane.stream).map_err(drv("cuEventRecord"));
        if let Err(e) = copied.and(recorded) {
            // The caller gets no upload to wait for: the copies queued must end here.
            let _ = lane.stream.synchronize();
            return Err(e);
        }
        event.record(&lane.stream).map_err(drv("cuEventRecord"))?;
        Ok(UploadDone { event })
    }
}
