//! A step's small transfers, which wait for the GPU at most once each: several ranges brought
//! down in one wait ([`Gpu::download_ranges`], [`CudaOps::read_routing_with`]) and uploads that
//! do not wait ([`Gpu::write_async`], under [`CudaOps`]'s `upload`). Values must be equal
//! exactly (copies and f32 sums of values exact in f32: tolerance 0).
//!
//! * `download_ranges_equal_separate_downloads`: u32, f32 and u8 ranges (odd offsets, an empty
//!   one, whole buffers) against one `download_range` each; after recorded launches (which the
//!   call must send first); past the pinned buffer's size (pageable); a range out of its
//!   buffer is refused.
//! * `async_uploads_keep_their_data_until_copied`: uploads queued behind ~tens of ms of GPU
//!   work, more of them than the two pinned buffers, so the host reuses a buffer whose copy is
//!   still queued (it must wait for it); a buffer rewritten between kernels that read it; an
//!   upload after recorded launches that read its buffer; one past the pinned size.
//! * `write_each_lands_every_item_without_waiting`: a step's small uploads ([`Gpu::write_each`],
//!   under `begin_step`) queued behind GPU work, three rounds over two pinned buffers, items of
//!   odd lengths and an empty one, each round read back by a kernel queued after it; past the
//!   pinned size (pageable, waited for); too much data for a buffer is refused.
//! * `cuda_ops_reads_and_uploads`: `read_routing_with` equals `read_routing` and `read`; five
//!   queued uploads read back; an upload between two adds lands between them.
//!
//! With no NVIDIA driver each test prints why and passes (CI has no GPU).

use std::sync::{Arc, Mutex, MutexGuard};

use ember_cuda::{CudaOps, Download, Gpu};
use ember_ops::{Batch, Mat, Ops, WeightSet};
use ember_testkit::Rng;

/// One test of this file at a time, with the GPU (None, having said why, without one).
fn gpu() -> Option<(MutexGuard<'static, ()>, Gpu)> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    match Gpu::new(0) {
        Ok(g) => Some((guard, g)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// Values exact in f32 whose sums of a few stay exact: multiples of 1/4 in [-64, 64).
fn quarters(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (rng.below(512) as f32 - 256.0) * 0.25).collect()
}

#[test]
fn download_ranges_equal_separate_downloads() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    let words: Vec<u32> = (0..1000).map(|_| rng.next_u64() as u32).collect();
    let floats = quarters(&mut rng, 777);
    let bytes: Vec<u8> = (0..4099).map(|_| rng.next_u64() as u8).collect();
    let (bw, bf, bb) = (g.upload(&words).unwrap(), g.upload(&floats).unwrap(), g.upload(&bytes).unwrap());
    for (w, f, b) in [((0, 1000), (0, 777), (0, 4099)), ((3, 17), (101, 1), (7, 4000)), ((999, 1), (5, 0), (4098, 1))] {
        let (mut ow, mut of, mut ob, mut ow2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        g.download_ranges(&mut [
            Download::new(&bw, w.0, w.1, &mut ow),
            Download::new(&bf, f.0, f.1, &mut of),
            Download::new(&bb, b.0, b.1, &mut ob),
            Download::new(&bw, 0, 2, &mut ow2),
        ])
        .unwrap();
        assert_eq!(ow, g.download_range(&bw, w.0, w.1).unwrap(), "u32 {w:?}");
        assert_eq!(of, g.download_range(&bf, f.0, f.1).unwrap(), "f32 {f:?}");
        assert_eq!(ob, g.download_range(&bb, b.0, b.1).unwrap(), "u8 {b:?}");
        assert_eq!(ow, words[w.0..w.0 + w.1], "u32 {w:?} against the host's");
        assert_eq!(ow2, words[..2]);
    }
    // Recorded launches go out first: the download sees their writes.
    let mut h = g.upload(&floats).unwrap();
    g.set_graphs(true).unwrap();
    g.begin_record();
    g.add(&mut h, &bf, floats.len()).unwrap();
    let (mut got, mut ids) = (Vec::new(), Vec::new());
    g.download_ranges(&mut [Download::new(&h, 0, floats.len(), &mut got), Download::new(&bw, 0, 4, &mut ids)]).unwrap();
    g.end_record().unwrap();
    assert_eq!(got, floats.iter().map(|v| v + v).collect::<Vec<_>>(), "the recorded add must come before the download");
    // More than the pinned buffer takes (16 MiB): pageable copies, the same values.
    let big = quarters(&mut rng, 5 << 20);
    let bg = g.upload(&big).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    g.download_ranges(&mut [Download::new(&bg, 1, (5 << 20) - 1, &mut a), Download::new(&bw, 10, 5, &mut b)]).unwrap();
    assert!(a == big[1..], "20 MiB range");
    assert_eq!(b, words[10..15]);
    // A range past its buffer's end is refused, naming the call.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let e = g.download_ranges(&mut [Download::new(&bw, 0, 4, &mut a), Download::new(&bf, 700, 78, &mut b)]).unwrap_err();
    assert!(e.to_string().contains("download_ranges"), "{e}");
    println!("refused: {e}");
}

#[test]
fn async_uploads_keep_their_data_until_copied() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    // A backlog: 200 adds over 32 Mi floats (~0.4 GB of traffic each), queued, not waited for.
    let n_big = 32 << 20;
    let mut acc = g.zeros::<f32>(n_big).unwrap();
    let one = g.upload(&vec![1.0f32; n_big]).unwrap();
    g.sync().unwrap();
    let t0 = std::time::Instant::now();
    for _ in 0..200 {
        g.add(&mut acc, &one, n_big).unwrap();
    }
    // Five uploads behind it, through two pinned buffers: the third reuses the first's while
    // its copy is still queued.
    let data: Vec<Vec<f32>> = (0..5).map(|i| quarters(&mut rng, 2048 + 517 * i)).collect();
    let mut bufs: Vec<_> = data.iter().map(|d| g.zeros::<f32>(d.len() + 3).unwrap()).collect();
    for (b, d) in bufs.iter_mut().zip(&data) {
        g.write_async(b, d).unwrap();
    }
    let queued_ms = t0.elapsed().as_secs_f64() * 1e3;
    for (i, (b, d)) in bufs.iter().zip(&data).enumerate() {
        let got = g.download(b).unwrap();
        assert_eq!(got[..d.len()], d[..], "upload {i}");
        assert_eq!(got[d.len()..], [0.0; 3], "upload {i}: past its data");
    }
    println!("200 adds and 5 uploads queued in {queued_ms:.1} ms, done after {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    assert_eq!(g.download_range(&acc, n_big - 1, 1).unwrap(), [200.0]);
    drop((acc, one));

    // One buffer rewritten between the kernels that read it: each add sees its own upload.
    let n = 4096;
    let mut h = g.zeros::<f32>(n).unwrap();
    let mut x = g.zeros::<f32>(n).unwrap();
    let mut want = vec![0.0f32; n];
    for _ in 0..6 {
        let v = quarters(&mut rng, n);
        g.write_async(&mut x, &v).unwrap();
        g.add(&mut h, &x, n).unwrap();
        want.iter_mut().zip(&v).for_each(|(w, v)| *w += v);
    }
    assert_eq!(g.download(&h).unwrap(), want, "uploads between adds");

    // After recorded launches that read the buffer: they go out before the copy.
    let (v1, v2) = (quarters(&mut rng, n), quarters(&mut rng, n));
    let mut h = g.upload(&vec![1.0f32; n]).unwrap();
    g.write(&mut x, &v1).unwrap();
    g.set_graphs(true).unwrap();
    g.begin_record();
    g.add(&mut h, &x, n).unwrap();
    g.write_async(&mut x, &v2).unwrap();
    g.add(&mut h, &x, n).unwrap();
    g.end_record().unwrap();
    let want: Vec<f32> = v1.iter().zip(&v2).map(|(a, b)| 1.0 + a + b).collect();
    assert_eq!(g.download(&h).unwrap(), want, "an upload after recorded adds");

    // More than the pinned buffers take: a waiting write, the same result.
    let big = quarters(&mut rng, 5 << 20);
    let mut bb = g.zeros::<f32>(big.len()).unwrap();
    g.write_async(&mut bb, &big).unwrap();
    assert!(g.download(&bb).unwrap() == big, "20 MiB upload");
    // Too much data for the buffer is refused.
    let e = g.write_async(&mut x, &vec![0.0; n + 1]).unwrap_err();
    assert!(e.to_string().contains("write_async"), "{e}");
}

#[test]
fn write_each_lands_every_item_without_waiting() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    let n_big = 32 << 20;
    let mut acc = g.zeros::<f32>(n_big).unwrap();
    let one = g.upload(&vec![1.0f32; n_big]).unwrap();
    let lens = [1usize, 7, 0, 1000, 33];
    let mut bufs: Vec<_> = lens.iter().map(|&n| g.zeros::<u32>(n + 5).unwrap()).collect();
    let mut copies: Vec<_> = lens.iter().map(|&n| g.zeros::<u32>(n + 5).unwrap()).collect();
    for _round in 0..3 {
        // GPU work queued ahead: the copies wait behind it, the host does not.
        for _ in 0..40 {
            g.add(&mut acc, &one, n_big).unwrap();
        }
        let data: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n).map(|_| rng.next_u64() as u32).collect()).collect();
        let mut items: Vec<(&mut ember_cuda::Buf<u32>, &[u32])> = bufs.iter_mut().zip(&data).map(|(b, d)| (b, &d[..])).collect();
        g.write_each(&mut items).unwrap();
        // A stream-ordered copy of each buffer now: it must see this round's data.
        for ((b, c), &n) in bufs.iter().zip(copies.iter_mut()).zip(&lens) {
            g.copy(b, 0, c, 0, n + 5).unwrap();
        }
        let round: Vec<Vec<u32>> = copies.iter().map(|c| g.download(c).unwrap()).collect();
        for (i, (got, d)) in round.iter().zip(&data).enumerate() {
            assert_eq!(got[..d.len()], d[..], "item {i}");
            assert_eq!(got[d.len()..], [0; 5], "item {i}: past its data");
        }
    }
    assert_eq!(g.download_range(&acc, 0, 1).unwrap(), [120.0]);
    // Past the pinned buffers (16 MiB): pageable copies, the same contract.
    let big: Vec<u32> = (0..(5 << 20)).map(|i| i as u32 ^ 0x5a5a).collect();
    let mut bb = g.zeros::<u32>(big.len()).unwrap();
    let small = [9u32, 8, 7];
    let mut items: Vec<(&mut ember_cuda::Buf<u32>, &[u32])> = vec![(&mut bb, &big[..]), (&mut bufs[0], &small[..])];
    g.write_each(&mut items).unwrap();
    assert!(g.download(&bb).unwrap() == big, "20 MiB item");
    assert_eq!(g.download_range(&bufs[0], 0, 3).unwrap(), small);
    // Too much data for its buffer: refused before anything is copied.
    let (too, fine) = (vec![1u32; 7], vec![2u32; 1]);
    let before = g.download(&bufs[1]).unwrap();
    let (b0, rest) = bufs.split_at_mut(1);
    let mut items: Vec<(&mut ember_cuda::Buf<u32>, &[u32])> = vec![(&mut rest[0], &fine[..]), (&mut b0[0], &too[..])];
    let e = g.write_each(&mut items).unwrap_err();
    assert!(e.to_string().contains("write"), "{e}");
    assert_eq!(g.download(&bufs[1]).unwrap(), before, "nothing copied");
}

#[test]
fn cuda_ops_reads_and_uploads() {
    let Some((_lock, g)) = gpu() else { return };
    drop(g);
    let mut rng = Rng::new();
    let mut o = CudaOps::new(0).unwrap();
    o.register(Arc::new(WeightSet::new())).unwrap();
    // An empty batch: the step records its launches (CUDA graphs), as decode does.
    o.begin_step(&Batch::default()).unwrap();
    for n in [1, 3, 70] {
        let logits = o.upload(&Mat::from_vec(n, 6, rng.vec(n * 6, -3.0, 3.0))).unwrap();
        let rt = o.route(logits, 2).unwrap();
        let xm = Mat::from_vec(n, 256, quarters(&mut rng, n * 256));
        let x = o.upload(&xm).unwrap();
        let (table, xh) = o.read_routing_with(rt, x).unwrap();
        assert_eq!(table, o.read_routing(rt).unwrap(), "{n} tokens: the routing");
        assert_eq!(xh, xm, "{n} tokens: x");
        assert_eq!(table.ids.len(), n * 2);
    }
    // Uploads queued back to back, then read.
    let mats: Vec<Mat> = (0..5).map(|i| Mat::from_vec(1 + i, 64, quarters(&mut rng, (1 + i) * 64))).collect();
    let ts: Vec<_> = mats.iter().map(|m| o.upload(m).unwrap()).collect();
    for (t, m) in ts.into_iter().zip(&mats) {
        assert_eq!(o.read(t).unwrap(), *m);
    }
    // h = a, then + b, then + c, each upload between the adds.
    let [a, b, c] = [(); 3].map(|_| Mat::from_vec(2, 64, quarters(&mut rng, 128)));
    let h = o.upload(&a).unwrap();
    let bt = o.upload(&b).unwrap();
    o.add(h, bt).unwrap();
    let ct = o.upload(&c).unwrap();
    o.add(h, ct).unwrap();
    let want: Vec<f32> = a.data.iter().zip(&b.data).zip(&c.data).map(|((a, b), c)| a + b + c).collect();
    assert_eq!(o.read(h).unwrap().data, want);
    o.end_step().unwrap();
}
