//! CONFORMANCE C1-C8 against the DiskStore, with segments of two records so eviction is
//! exercised constantly.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::sync::Arc;

use tierkv_disk::{BLOCK, DiskStore, DiskStoreConfig, record_bytes};
use tierkv_testkit::contract::OpenTier;

const CHUNK: u64 = 64 << 10;

fn open(capacity: u64) -> OpenTier {
    let dir = tempfile::tempdir().unwrap();
    let segment_bytes = BLOCK + 2 * record_bytes(CHUNK);
    let segments = capacity.div_ceil(2).max(2);
    let config = DiskStoreConfig {
        segment_bytes,
        io_threads: 2,
        ..DiskStoreConfig::new(dir.path(), segments * segment_bytes, CHUNK)
    };
    OpenTier {
        tier: Arc::new(DiskStore::open(config).unwrap()),
        chunk_bytes: CHUNK,
        keep: Box::new(dir),
    }
}

tierkv_testkit::tier_contract_tests!(open);
