//! CONFORMANCE C1-C8 against the HostStore.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::sync::Arc;

use tierkv_l2::{HostMemory, HostStore, HostStoreConfig};
use tierkv_testkit::contract::OpenTier;

const CHUNK: u64 = 64 << 10;

fn open(capacity: u64) -> OpenTier {
    let config = HostStoreConfig {
        memory: HostMemory::Plain,
        ..HostStoreConfig::new(capacity * CHUNK, CHUNK)
    };
    OpenTier {
        tier: Arc::new(HostStore::open(config).unwrap()),
        chunk_bytes: CHUNK,
        keep: Box::new(()),
    }
}

tierkv_testkit::tier_contract_tests!(open);
