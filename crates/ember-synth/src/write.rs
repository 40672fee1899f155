//! Streaming the planned file to disk: chunks are generated and quantised in parallel (rayon),
//! in order, and written sequentially by the calling thread; memory stays at a few batches of
//! chunks whatever the file size.

use std::io::Write;
use std::sync::mpsc;

use rayon::prelude::*;

use crate::draw::{chunk_bytes, rows_per_chunk};
use crate::{Error, Plan};

/// Writes the whole GGUF to `out`. `progress(done, total)` gets tensor-data bytes.
/// Uses the current rayon pool (wrap the call in `pool.install` to choose the threads).
pub fn write<W: Write>(plan: &Plan, out: &mut W, progress: &mut dyn FnMut(u64, u64)) -> Result<(), Error> {
    let total = plan.data_bytes();
    let n_threads = rayon::current_num_threads();
    let batch = 2 * n_threads;
    // Up to two batches in flight: one being generated, one being written.
    let (tx, rx) = mpsc::sync_channel::<Result<Vec<u8>, Error>>(2 * batch);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            // The generator runs on its own thread, outside the caller's pool: give it a pool of
            // the same size.
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n_threads).build();
            let run = |tx: &mpsc::SyncSender<Result<Vec<u8>, Error>>| {
                for (idx, t) in plan.tensors.iter().enumerate() {
                    let per = rows_per_chunk(t);
                    let starts: Vec<usize> = (0..t.n_rows()).step_by(per).collect();
                    for group in starts.chunks(batch) {
                        let bufs: Vec<Result<Vec<u8>, Error>> =
                            group.par_iter().map(|&r0| chunk_bytes(plan, idx, r0, per.min(t.n_rows() - r0))).collect();
                        for b in bufs {
                            let failed = b.is_err();
                            if tx.send(b).is_err() || failed {
                                return; // the writer stopped (error), or we just sent ours
                            }
                        }
                    }
                }
            };
            match pool {
                Ok(p) => p.install(|| run(&tx)),
                Err(e) => {
                    let _ = tx.send(Err(Error::Io(std::io::Error::other(e.to_string()))));
                }
            }
        });
        let mut done = 0u64;
        let res = plan.writer.write(out, |i, w| {
            let want = plan.tensors[i].spec.n_bytes()?;
            let mut got = 0u64;
            while got < want {
                let buf = match rx.recv() {
                    Ok(Ok(b)) => b,
                    Ok(Err(e)) => return Err(ember_gguf::Error::Quant(e.to_string())),
                    Err(_) => return Err(ember_gguf::Error::Quant("the generator stopped early".into())),
                };
                w.write_all(&buf)?;
                got += buf.len() as u64;
                done += buf.len() as u64;
                progress(done, total);
            }
            Ok(())
        });
        drop(rx); // unblocks the generator if the writer failed
        res.map_err(Error::Gguf)
    })
}
