//! The L1 as a library: hash a prompt into chunk keys, store the chunks, and let two
//! tensor-parallel readers share one MLA copy. Run with
//! `cargo run -p tierkv-l1 --example quickstart`.

#![allow(clippy::print_stdout, reason = "an example prints what it shows")]

use tierkv_core::hash::ChunkHasher;
use tierkv_core::{ExtraCount, KvRank, Layout, Namespace, ObjectKey};
use tierkv_l1::{L1Config, L1Context, L1Manager, Lifetime, OwnerId, Readers, WriteMode};

const CHUNK_BYTES: u64 = 64 << 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let l1 = L1Manager::build(L1Config::new(64 * CHUNK_BYTES, CHUNK_BYTES), L1Context::default())?;
    println!("L1 on {}", l1.arena().describe());

    // 1,024 prompt tokens in chunks of 256: four chained hashes, one key each.
    let tokens: Vec<u32> = (0..1024).collect();
    let hasher = ChunkHasher::new(256).ok_or("zero-token chunks")?;
    let namespace = Namespace::new("example-model", "");
    let keys: Vec<ObjectKey> = hasher
        .prefix_hashes(&tokens)
        .into_iter()
        .map(|h| ObjectKey::new(namespace, h, KvRank::Shared))
        .collect();

    // Store: reserve (invisible), copy in, finish (visible).
    let worker = OwnerId(1);
    let layout = Layout::bytes(CHUNK_BYTES)?;
    for result in l1.reserve_write(worker, &keys, &layout, WriteMode::Create, Lifetime::Cached)? {
        result?;
    }
    for (i, key) in keys.iter().enumerate() {
        l1.write_access(worker, key)?.write_at(0, &vec![i as u8; CHUNK_BYTES as usize])?;
    }
    for result in l1.finish_write(worker, &keys) {
        result?;
    }

    // Load: one lease, two readers (extra_count = 1); each reads and returns its own share.
    let grant = l1.reserve_read(worker, &keys, ExtraCount::new(1)?);
    println!("prefix hit: {} of {} chunks", grant.leading_hits(), keys.len());
    let lease = grant.lease.ok_or("no chunk was granted")?;
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    for rank in 0..2u8 {
        for (i, key) in keys.iter().enumerate() {
            l1.read_access(lease, rank, key)?.read_at(0, &mut buffer)?;
            assert!(buffer.iter().all(|b| *b == i as u8));
        }
        l1.finish_read(lease, Readers::One(rank), None)?;
        if rank == 0 {
            // A second release by the same reader is refused, never taken from reader 1.
            let again = l1.finish_read(lease, Readers::One(0), None);
            println!(
                "second release by reader 0: {}",
                again.err().map(|e| e.to_string()).unwrap_or_default()
            );
        }
    }
    println!("usage: {:?}", l1.usage());
    l1.audit()?;
    Ok(())
}
