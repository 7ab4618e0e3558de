//! What a move through the emulated copy engine costs against copying on the caller's thread:
//! one stream, each copy enqueued and then waited for (`copy` + `sync`), as an L1 arena would do
//! for every move between host memory and its slots, against `memcpy` of the same size in the
//! same run. Chunks rotate over 128 MiB so neither side is served from cache; best of 5 rounds.
//! Run with `cargo bench -p tierkv-l1 --bench copy_engine`.

#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure aborts the run")]
#![allow(clippy::print_stdout, reason = "the table is the benchmark's output")]
#![allow(missing_docs, reason = "a benchmark binary")]

use std::hint::black_box;
use std::time::Instant;

use tierkv_l1::device::{At, CopyEngine, EmulatedCopyEngine, Piece};

const SPAN: usize = 128 << 20;
const ROUNDS: usize = 5;

/// Best rate in GB/s of `copy(i)` over enough copies to move 1 GiB.
fn best(size: usize, mut copy: impl FnMut(usize)) -> f64 {
    let count = (1usize << 30) / size;
    (0..ROUNDS)
        .map(|_| {
            let start = Instant::now();
            for i in 0..count {
                copy(i);
            }
            (count * size) as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    let src = vec![5u8; SPAN];
    let mut dst = vec![0u8; SPAN];
    let stream = EmulatedCopyEngine::new().stream().unwrap();
    println!("{:<12} {:>14} {:>16} {:>8}", "chunk", "memcpy GB/s", "engine GB/s", "ratio");
    for size in [16usize << 10, 64 << 10, 512 << 10, 2 << 20] {
        let slots = SPAN / size;
        let memcpy = best(size, |i| {
            let at = (i * 7 % slots) * size;
            black_box(&mut dst[at..at + size]).copy_from_slice(black_box(&src[at..at + size]));
        });
        let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        let engine = best(size, |i| {
            let at = ((i * 7 % slots) * size) as u64;
            let piece = Piece::contiguous(At::Host(s + at), At::Device(d + at), size as u64);
            // SAFETY: both buffers outlive the sync, and nothing else touches them meanwhile.
            unsafe { stream.copy(vec![piece]) }.unwrap();
            stream.sync().unwrap();
        });
        println!(
            "{:<12} {memcpy:>14.2} {engine:>16.2} {:>8.2}",
            format!("{} KiB", size >> 10),
            engine / memcpy
        );
    }
    println!("limit measured in this run: memcpy of the same size on the caller's thread");
}
