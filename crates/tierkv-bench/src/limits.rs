//! The physical limits, measured.

use std::fs::{File, OpenOptions};
use std::hint::black_box;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use tierkv_core::AlignedBuf;

/// Total bytes spread over so neither side of a copy stays in cache (twice a 32 MiB L3 and more).
const SPREAD: usize = 128 << 20;

/// Single-core `memcpy` bandwidth in bytes per second for copies of `chunk` bytes, rotating over
/// 128 MiB of sources and destinations, for at least `time`.
pub fn memcpy_bandwidth(chunk: usize, time: Duration) -> f64 {
    let chunk = chunk.max(1);
    let count = (SPREAD / chunk).max(2);
    let sources: Vec<Vec<u8>> = (0..count).map(|i| vec![i as u8; chunk]).collect();
    let mut destinations: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; chunk]).collect();
    // One pass to fault every page in before timing.
    for (d, s) in destinations.iter_mut().zip(&sources) {
        d.copy_from_slice(s);
    }
    let start = Instant::now();
    let mut copied = 0usize;
    let mut i = 0usize;
    while start.elapsed() < time {
        let (s, d) = (i % count, (i * 7 + 3) % count);
        black_box(&mut destinations[d]).copy_from_slice(black_box(&sources[s]));
        copied += chunk;
        i += 1;
    }
    copied as f64 / start.elapsed().as_secs_f64()
}

/// Total `memcpy` bandwidth of `threads` threads at once (each as in [`memcpy_bandwidth`], over
/// its own 128 MiB), in bytes per second: what every core of the machine copies together.
pub fn memcpy_bandwidth_threads(chunk: usize, time: Duration, threads: usize) -> f64 {
    std::thread::scope(|s| {
        let workers: Vec<_> =
            (0..threads.max(1)).map(|_| s.spawn(move || memcpy_bandwidth(chunk, time))).collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0.0)).sum()
    })
}

/// Runs `work` between two measurements of a limit and returns its result and the limit's mean:
/// for limits that drift within a run (the virtio disk's bandwidth moves 2-4x), so a figure is set
/// against the limit as it stood while the figure was measured, not at start-up.
pub fn bracketed<T>(mut limit: impl FnMut() -> f64, work: impl FnOnce() -> T) -> (T, f64) {
    let before = limit();
    let result = work();
    let after = limit();
    (result, (before + after) / 2.0)
}

/// Sequential read bandwidth, in bytes per second, of a fresh `file_bytes` file in `dir` read with
/// `O_DIRECT` in blocks of `block` bytes: what the disk delivers when the page cache cannot help.
pub fn direct_read_bandwidth(dir: &Path, file_bytes: usize, block: usize) -> io::Result<f64> {
    direct_file_bandwidth(dir, file_bytes, block, 1).map(|(_, read)| read)
}

/// Sequential (write, read) bandwidth in bytes per second of a fresh `file_bytes` file in `dir`,
/// written with `O_DIRECT` and synced, then read back with `O_DIRECT` in blocks of `block` bytes
/// by `readers` threads at once (thread `t` reads blocks `t`, `t + readers`, ...: the file is still
/// read front to back, with `readers` requests in flight). The file is removed afterwards.
pub fn direct_file_bandwidth(
    dir: &Path,
    file_bytes: usize,
    block: usize,
    readers: usize,
) -> io::Result<(f64, f64)> {
    let mut buf = AlignedBuf::new(block)
        .ok_or_else(|| io::Error::other("cannot allocate an aligned buffer"))?;
    let block = buf.as_slice().len();
    let blocks = file_bytes.div_ceil(block).max(1);
    let path = dir.join(format!(".tierkv-bench-seq-{}", std::process::id()));
    let result = (|| {
        let mut file = direct(&path, true)?;
        buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let start = Instant::now();
        for _ in 0..blocks {
            file.write_all(buf.as_slice())?;
        }
        file.sync_all()?;
        let write = (blocks * block) as f64 / start.elapsed().as_secs_f64();
        drop(file);
        let read = parallel_read(&path, blocks, block, readers)?;
        Ok((write, read))
    })();
    let _ = std::fs::remove_file(&path);
    result
}

/// Sequential write bandwidth, in bytes per second, of a fresh `file_bytes` file in `dir`,
/// allocated first (as the disk tier allocates its segments) and written with `O_DIRECT` in blocks
/// of `block` bytes by `writers` threads at once (thread `t` writes blocks `t`, `t + writers`,
/// ...: front to back, with `writers` requests in flight), then synced. The file is removed.
pub fn direct_write_bandwidth(
    dir: &Path,
    file_bytes: usize,
    block: usize,
    writers: usize,
) -> io::Result<f64> {
    let writers = writers.max(1);
    let probe = AlignedBuf::new(block)
        .ok_or_else(|| io::Error::other("cannot allocate an aligned buffer"))?;
    let block = probe.as_slice().len();
    let blocks = file_bytes.div_ceil(block).max(1);
    let path = dir.join(format!(".tierkv-bench-write-{}", std::process::id()));
    let result = (|| {
        let file = direct(&path, true)?;
        let len = (blocks * block) as libc::off_t;
        // SAFETY: fallocate on a descriptor we own, with a valid length.
        if unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, len) } != 0 {
            file.set_len(len as u64)?; // filesystems without fallocate
        }
        let start = Instant::now();
        std::thread::scope(|s| -> io::Result<()> {
            let workers: Vec<_> = (0..writers)
                .map(|t| {
                    let file = &file;
                    s.spawn(move || -> io::Result<()> {
                        let mut buf = AlignedBuf::new(block)
                            .ok_or_else(|| io::Error::other("cannot allocate"))?;
                        buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
                        for b in (t..blocks).step_by(writers) {
                            file.write_all_at(buf.as_slice(), (b * block) as u64)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|w| {
                w.join().unwrap_or_else(|_| Err(io::Error::other("a writer panicked")))
            })
        })?;
        file.sync_all()?;
        Ok((blocks * block) as f64 / start.elapsed().as_secs_f64())
    })();
    let _ = std::fs::remove_file(&path);
    result
}

fn parallel_read(path: &Path, blocks: usize, block: usize, readers: usize) -> io::Result<f64> {
    let readers = readers.max(1);
    let start = Instant::now();
    let read: io::Result<Vec<usize>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..readers)
            .map(|t| {
                s.spawn(move || -> io::Result<usize> {
                    let file = direct(path, false)?;
                    let mut buf = AlignedBuf::new(block)
                        .ok_or_else(|| io::Error::other("cannot allocate"))?;
                    let mut read = 0;
                    for b in (t..blocks).step_by(readers) {
                        file.read_exact_at(buf.as_mut_slice(), (b * block) as u64)?;
                        read += block;
                    }
                    Ok(read)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Err(io::Error::other("a reader panicked"))))
            .collect()
    });
    Ok(read?.iter().sum::<usize>() as f64 / start.elapsed().as_secs_f64())
}

fn direct(path: &Path, write: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(!write)
        .write(write)
        .create(write)
        .truncate(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bracketed_limit_is_the_mean_of_before_and_after() {
        let mut measured = [4.0, 8.0].into_iter();
        let mut order = Vec::new();
        let (done, limit) = bracketed(
            || {
                order.push("limit");
                measured.next().unwrap()
            },
            || 7,
        );
        assert_eq!((done, limit), (7, 6.0));
        assert_eq!(order, ["limit", "limit"]);
    }

    #[test]
    fn limits_measure_something_plausible() {
        let copy = memcpy_bandwidth(1 << 20, Duration::from_millis(50));
        assert!(copy > 1e8, "memcpy below 100 MB/s: {copy}");
        let dir = tempfile::tempdir().unwrap();
        match direct_read_bandwidth(dir.path(), 8 << 20, 1 << 20) {
            Ok(read) => {
                assert!(read > 1e6, "direct reads below 1 MB/s: {read}");
                let write = direct_write_bandwidth(dir.path(), 8 << 20, 1 << 20, 2).unwrap();
                assert!(write > 1e6, "direct writes, two in flight, below 1 MB/s: {write}");
                assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "left a file");
            }
            // Some filesystems (tmpfs) refuse O_DIRECT; the benchmark then says so.
            Err(e) => eprintln!("skipped: O_DIRECT unsupported here: {e}"),
        }
    }
}
