//! The contract suite against the fake, so the fake the pipeline tests rely on is itself a
//! faithful tier.

use std::sync::Arc;

use tierkv_testkit::FakeTier;
use tierkv_testkit::contract::OpenTier;

fn open(capacity: u64) -> OpenTier {
    OpenTier {
        tier: Arc::new(FakeTier::new("fake", capacity as usize, 4096)),
        chunk_bytes: 4096,
        keep: Box::new(()),
    }
}

tierkv_testkit::tier_contract_tests!(open);
