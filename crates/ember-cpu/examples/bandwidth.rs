//! Memory bandwidth of this machine, STREAM-style, multi-threaded, on arrays far larger than
//! any cache: `read` (sum of one array: what a GEMV over weights does), `copy` (a = b) and
//! `triad` (a = b + s·c). Bytes are counted as STREAM does (no write-allocate traffic).
//!
//! `cargo run --release -p ember-cpu --example bandwidth [-- MiB_per_array threads]`

use std::time::Instant;

#[allow(clippy::type_complexity)]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(512);
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or_else(ember_cpu::physical_cores);
    let n = mib * 1024 * 1024 / 4;
    let mut a = vec![1f32; n];
    let b = vec![2f32; n];
    let c = vec![3f32; n];
    let chunk = n.div_ceil(threads);
    println!("{threads} threads, 3 arrays of {mib} MiB");
    let run = |name: &str, bytes_per_elem: usize, f: &(dyn Fn(&mut [f32], &[f32], &[f32]) -> f32 + Sync), a: &mut Vec<f32>| {
        let mut best = f64::MAX;
        let mut all = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            let s: f32 = std::thread::scope(|sc| {
                let hs: Vec<_> =
                    a.chunks_mut(chunk).zip(b.chunks(chunk)).zip(c.chunks(chunk)).map(|((a, b), c)| sc.spawn(move || f(a, b, c))).collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum()
            });
            std::hint::black_box(s);
            let dt = t.elapsed().as_secs_f64();
            best = best.min(dt);
            all.push(dt);
        }
        all.sort_by(f64::total_cmp);
        let gb = (n * bytes_per_elem) as f64 / 1e9;
        println!("{name:6} best {:6.2} GB/s  median {:6.2} GB/s", gb / best, gb / all[all.len() / 2]);
    };
    run(
        "read",
        4,
        &|_a, b, _c| {
            let mut acc = [0f32; 16];
            for x in b.chunks_exact(16) {
                for i in 0..16 {
                    acc[i] += x[i];
                }
            }
            acc.iter().sum()
        },
        &mut a,
    );
    run(
        "copy",
        8,
        &|a, b, _c| {
            a.copy_from_slice(b);
            0.0
        },
        &mut a,
    );
    run(
        "triad",
        12,
        &|a, b, c| {
            for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                *x = y + 3.0 * z;
            }
            0.0
        },
        &mut a,
    );
}
