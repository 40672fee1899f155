//! What comes back from a step: a matrix, a row's best entries, and the rows one part of a
//! layer split hands the next (device to device).

use std::sync::Arc;

use ember_ops::{Mat, OpError, OpResult, Tensor};

use super::{CudaOps, cuda};
use crate::{Buf, Download};

/// What a [`CudaOps`] puts in a [`ember_ops::QueueMark`] (and a `DeviceRows`' `ready`): an event
/// recorded on its stream, and the context its buffers belong to (a peer copy names both).
pub(super) struct CudaMark {
    pub(super) event: cudarc::driver::CudaEvent,
    pub(super) ctx: Arc<cudarc::driver::CudaContext>,
}

/// [`ember_ops::Ops::read_top`]'s buffers: the extra ids and their rows' offsets in, the selected entries
/// out.
pub(super) struct TopBufs {
    extra: Buf<u32>,
    extra_at: Buf<u32>,
    ids: Buf<u32>,
    vals: Buf<f32>,
    /// The split form's scratch ([`crate::ops::TopKScratch`]) for `split_rows` rows, allocated
    /// zeroed when first needed.
    split: Option<(Buf<u32>, Buf<u32>, Buf<u32>)>,
    split_rows: usize,
    /// What `extra` and `extra_at` were last written with (None: not known).
    sent: Option<(Vec<u32>, Vec<u32>)>,
}

/// What [`CudaOps::read_top_at`] gives.
enum Top {
    Rows(Vec<ember_ops::TopRow>),
    Queued(QueuedTop),
}

/// A read of rows' best entries whose copy is queued ([`ember_ops::TopRead::Queued`] holds it).
struct QueuedTop {
    download: crate::LaterDownload,
    rows: usize,
    cap: usize,
    k: usize,
    n_extra: Vec<usize>,
}

impl CudaOps {
    pub(super) fn read_rows(&mut self, x: Tensor) -> OpResult<Mat> {
        const OP: &str = "read";
        let b = self.arena.buf(OP, x)?;
        if let Some(t) = self.times.as_mut().filter(|t| t.timed()) {
            t.read_start(self.gpu.take_first_flush());
            self.gpu.sync().map_err(cuda(OP, self.dev))?;
            t.idle();
        }
        // Through the GPU's pinned staging buffer (a decode step's logits: 1 MB for the 35B;
        // `EMBER_READ_PINNED=0`: straight into the vector, which the driver stages itself).
        static PINNED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let data = if crate::ops::switch(&PINNED, "EMBER_READ_PINNED") {
            let mut data = Vec::new();
            self.gpu.download_ranges(&mut [Download::new(b, 0, x.n * x.d, &mut data)]).map_err(cuda(OP, self.dev))?;
            data
        } else {
            self.gpu.download_range(b, 0, x.n * x.d).map_err(cuda(OP, self.dev))?
        };
        if let Some(t) = &mut self.times {
            t.read_end();
        }
        Ok(Mat { n: x.n, d: x.d, data })
    }

    /// The selection runs on the GPU (`Gpu::top_k_rows`: one block a row, or split over
    /// blocks from `TOPK_SPLIT_MIN` entries) and only the selected entries come down: for a 248k vocabulary and the default sampler chain ~42 entries a
    /// row instead of 1 MB.
    pub(super) fn read_top_entries(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<ember_ops::TopRow>> {
        self.read_top_at(x, k, extra, false).map(|r| match r {
            Top::Rows(rows) => rows,
            Top::Queued(_) => unreachable!("read_top_at queues only when asked to"),
        })
    }

    /// [`CudaOps::read_top_entries`] with the entries' copy queued, not waited for
    /// ([`Gpu::download_later`]): [`CudaOps::read_top_wait`] returns the rows.
    pub(super) fn read_top_queue(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<ember_ops::TopRead> {
        Ok(match self.read_top_at(x, k, extra, true)? {
            Top::Rows(rows) => ember_ops::TopRead::Ready(rows),
            Top::Queued(q) => ember_ops::TopRead::Queued(Box::new(q)),
        })
    }

    /// The rows of a [`CudaOps::read_top_queue`].
    pub(super) fn read_top_wait(&mut self, r: ember_ops::TopRead) -> OpResult<Vec<ember_ops::TopRow>> {
        const OP: &str = "read_top_end";
        let q = match r {
            ember_ops::TopRead::Ready(rows) => return Ok(rows),
            ember_ops::TopRead::Queued(q) => q,
        };
        let Ok(q) = q.downcast::<QueuedTop>() else {
            return Err(OpError::new(OP, self.dev, "", "a read another backend began"));
        };
        let bytes = self.gpu.download_wait(q.download).map_err(cuda(OP, self.dev))?;
        // A step whose tokens never came (its feed wait gave up) ran on token 0: not its rows.
        self.check_feed_timeouts(OP)?;
        let n = q.rows * q.cap;
        if bytes.len() != 8 * n {
            return Err(OpError::new(OP, self.dev, "", format!("{} bytes for {n} entries", bytes.len())));
        }
        let word = |i: usize| u32::from_ne_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
        Ok((0..q.rows)
            .map(|r| {
                let span = r * q.cap..r * q.cap + q.k + q.n_extra[r];
                ember_ops::TopRow::from_pairs(span.map(|j| (word(j), f32::from_bits(word(n + j)))).collect())
            })
            .collect())
    }

    fn read_top_at(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>], later: bool) -> OpResult<Top> {
        const OP: &str = "read_top";
        let dev = self.dev;
        if !extra.is_empty() && extra.len() != x.n {
            return Err(OpError::new(OP, dev, format!("{}x{}", x.n, x.d), format!("{} rows of extra ids", extra.len())));
        }
        let (rows, n) = (x.n, x.d);
        let k = k.min(n);
        // Ids past the row are no entries of it (top_of_row skips them too).
        let ex: Vec<Vec<u32>> =
            (0..rows).map(|r| extra.get(r).map_or_else(Vec::new, |e| e.iter().copied().filter(|&i| (i as usize) < n).collect())).collect();
        let cap = k + ex.iter().map(Vec::len).max().unwrap_or(0);
        if rows == 0 || cap == 0 {
            self.arena.check(OP, x)?;
            return Ok(Top::Rows(vec![ember_ops::TopRow::default(); rows]));
        }
        let flat: Vec<u32> = ex.concat();
        let mut at = Vec::with_capacity(rows + 1);
        at.push(0u32);
        for e in &ex {
            at.push(at[at.len() - 1] + e.len() as u32);
        }
        let g = &self.gpu;
        let grow_u32 = |b: Option<Buf<u32>>, len: usize| -> crate::Result<(Buf<u32>, bool)> {
            match b {
                Some(b) if b.len() >= len => Ok((b, false)),
                _ => Ok((g.alloc(len.max(1).next_power_of_two())?, true)),
            }
        };
        let old = self.top.take();
        let (oe, oa, oi, ov, mut split, mut split_rows, mut sent) = match old {
            Some(t) => (Some(t.extra), Some(t.extra_at), Some(t.ids), Some(t.vals), t.split, t.split_rows, t.sent),
            None => (None, None, None, None, None, 0, None),
        };
        // Long rows over many blocks (EMBER_TOPK_SPLIT=0: one block a row, for A/B runs).
        static SPLIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let use_split = k > 0 && n >= crate::ops::TOPK_SPLIT_MIN && crate::ops::switch(&SPLIT, "EMBER_TOPK_SPLIT");
        if use_split && (split.is_none() || split_rows < rows) {
            let r = rows.next_power_of_two();
            let zeros = |len: usize| g.zeros::<u32>(len);
            split = Some((
                zeros(r * crate::ops::TOPK_BINS).map_err(cuda(OP, dev))?,
                zeros(r * 2).map_err(cuda(OP, dev))?,
                g.alloc::<u32>(r * crate::ops::TOPK_CAND).map_err(cuda(OP, dev))?,
            ));
            split_rows = r;
        }
        let vals = match ov {
            Some(v) if v.len() >= rows * cap => v,
            _ => g.alloc((rows * cap).next_power_of_two()).map_err(cuda(OP, dev))?,
        };
        let (extra_buf, new_e) = grow_u32(oe, flat.len()).map_err(cuda(OP, dev))?;
        let (extra_at, new_a) = grow_u32(oa, rows + 1).map_err(cuda(OP, dev))?;
        if new_e || new_a {
            sent = None;
        }
        let mut t = TopBufs {
            extra: extra_buf,
            extra_at,
            ids: grow_u32(oi, rows * cap).map_err(cuda(OP, dev))?.0,
            vals,
            split,
            split_rows,
            sent: None,
        };
        let b = self.arena.buf(OP, x)?;
        let times = &mut self.times;
        // The extra ids' tables go up only when they differ from what the buffers hold (a decode
        // step of the same sequences asks for the same ones): an upload that may wait for its
        // pinned buffer's previous copy is one a step queued ahead must not make.
        let same = sent.as_ref().is_some_and(|(f, a)| *f == flat && *a == at);
        let run = (|| -> crate::Result<Top> {
            if !same {
                g.write_async(&mut t.extra, &flat)?;
                g.write_async(&mut t.extra_at, &at)?;
            }
            let scratch = t.split.as_ref().filter(|_| use_split).map(|(hist, counts, cand)| crate::ops::TopKScratch { hist, counts, cand });
            g.top_k_rows(b, rows, n, k, &t.extra, &t.extra_at, cap, &mut t.ids, &mut t.vals, scratch)?;
            if later {
                let parts = [crate::DevRange::new(&t.ids, 0, rows * cap)?, crate::DevRange::new(&t.vals, 0, rows * cap)?];
                let download = g.download_later(&parts)?;
                return Ok(Top::Queued(QueuedTop { download, rows, cap, k, n_extra: ex.iter().map(Vec::len).collect() }));
            }
            if let Some(st) = times.as_mut().filter(|st| st.timed()) {
                st.read_start(g.take_first_flush());
                g.sync()?;
                st.idle();
            }
            let (mut ids, mut vals) = (Vec::new(), Vec::new());
            g.download_ranges(&mut [Download::new(&t.ids, 0, rows * cap, &mut ids), Download::new(&t.vals, 0, rows * cap, &mut vals)])?;
            if let Some(st) = times.as_mut() {
                st.read_end();
            }
            Ok(Top::Rows(
                (0..rows)
                    .map(|r| ember_ops::TopRow::from_pairs((r * cap..r * cap + k + ex[r].len()).map(|j| (ids[j], vals[j])).collect()))
                    .collect(),
            ))
        })();
        // A failed call may have stopped between the split form's kernels: its scratch is not
        // known to be zero any more, so the next call makes a fresh one (and sends the extra ids
        // again).
        if run.is_err() {
            t.split = None;
            t.split_rows = 0;
        } else {
            t.sent = Some((flat, at));
        }
        self.top = Some(t);
        run.map_err(cuda(OP, dev))
    }

    /// The rows stay in the step arena; ready at an event after the work queued so far
    /// (`EMBER_SPLIT_DEVICE_COPY=0`: none offered, the split reads and uploads).
    pub(super) fn export_rows_at(&mut self, x: Tensor) -> OpResult<Option<ember_ops::DeviceRows>> {
        const OP: &str = "export_rows";
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !crate::ops::switch(&ON, "EMBER_SPLIT_DEVICE_COPY") {
            return Ok(None);
        }
        let ptr = self.arena.buf(OP, x)?.ptr();
        let event = self.gpu.mark().map_err(cuda(OP, self.dev))?;
        let ready: ember_ops::QueueMark = Arc::new(CudaMark { event, ctx: self.gpu.context().clone() });
        Ok(Some(ember_ops::DeviceRows { device: self.dev, ptr, n: x.n, d: x.d, ready }))
    }

    /// Rows another `CudaOps` exported (this GPU or another: a peer copy), copied on this
    /// stream after their event; the mark is an event after the copy.
    pub(super) fn import_rows_from(&mut self, rows: &ember_ops::DeviceRows) -> OpResult<Option<(Tensor, ember_ops::QueueMark)>> {
        const OP: &str = "import_rows";
        let Some(m) = rows.ready.downcast_ref::<CudaMark>() else { return Ok(None) };
        let t = self.arena.alloc(&self.gpu, OP, rows.n, rows.d)?;
        let (_, mut outs) = self.arena.split(t.id);
        let dev = self.dev;
        self.gpu.wait_event(&m.event).map_err(cuda(OP, dev))?;
        // SAFETY: `rows` came from CudaOps::export_rows of a live step: `ptr` addresses its
        // n·d f32 in `m.ctx`, written before `m.event`, which the copy waits for; the exporter
        // orders its later work (frees and reuse of that buffer included) after the mark
        // returned here (the Ops::export_rows contract, which Split keeps).
        unsafe { self.gpu.copy_in(outs[0], &m.ctx, rows.ptr, rows.n * rows.d) }.map_err(cuda(OP, dev))?;
        let event = match self.gpu.mark() {
            Ok(event) => event,
            Err(e) => {
                // No mark for the exporter to wait on: the copy must be done before its buffer
                // can be reused, so wait for it here (the step has failed anyway).
                let _ = self.gpu.sync();
                return Err(cuda(OP, dev)(e));
            }
        };
        Ok(Some((t, Arc::new(CudaMark { event, ctx: self.gpu.context().clone() }))))
    }
}
