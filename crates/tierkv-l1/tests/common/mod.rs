//! A small L1 on the emulated backend with a manual clock and an observer that remembers.

#![allow(dead_code, reason = "each test binary uses a different part of the fixture")]

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tierkv_core::policy::PolicyKind;
use tierkv_core::{ChunkHash, ExtraCount, KvRank, Layout, ManualClock, Namespace, ObjectKey};
use tierkv_l1::{
    Demoter, DeviceKind, EvictionReason, L1Config, L1Context, L1Manager, L1Observer, Lifetime,
    OwnerId, Presence, Readers, Usage, WriteMode,
};

/// Bytes per slot in the scenario tests: "8 MiB slots" scaled down, proportions kept.
pub const SLOT: u64 = 8 << 10;
pub const OWNER: OwnerId = OwnerId(1);
pub const LEASE_TTL: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct Recorder {
    pub finished: Mutex<Vec<ObjectKey>>,
    pub evicted: Mutex<Vec<(ObjectKey, EvictionReason)>>,
}

impl L1Observer for Recorder {
    fn writes_finished(&self, keys: &[ObjectKey]) {
        self.finished.lock().extend_from_slice(keys);
    }

    fn evicted(&self, keys: &[ObjectKey], reason: EvictionReason) {
        self.evicted.lock().extend(keys.iter().map(|k| (*k, reason)));
    }
}

pub struct Fixture {
    pub l1: L1Manager,
    pub clock: Arc<ManualClock>,
    pub recorder: Arc<Recorder>,
}

pub fn config(slots: u64) -> L1Config {
    L1Config {
        device: DeviceKind::Emulated,
        policy: PolicyKind::Lru,
        lease_ttl: LEASE_TTL,
        ..L1Config::new(slots * SLOT, SLOT)
    }
}

/// An L1 of `slots` slots of `SLOT` bytes.
pub fn l1(slots: u64) -> Fixture {
    with_config(config(slots))
}

pub fn with_config(config: L1Config) -> Fixture {
    with_demoter(config, None)
}

/// An L1 built with `config` whose eviction victims go to `demoter`.
pub fn with_demoter(config: L1Config, demoter: Option<Arc<dyn Demoter>>) -> Fixture {
    let clock = Arc::new(ManualClock::new());
    let recorder = Arc::new(Recorder::default());
    let context = L1Context { clock: clock.clone(), observer: recorder.clone(), demoter };
    Fixture { l1: L1Manager::build(config, context).unwrap(), clock, recorder }
}

pub fn key(i: u64) -> ObjectKey {
    ObjectKey::new(
        Namespace::new("test-model", ""),
        ChunkHash(u128::from(i) * 0x9e37_79b9_7f4a_7c15),
        KvRank::Shared,
    )
}

pub fn keys(range: std::ops::Range<u64>) -> Vec<ObjectKey> {
    range.map(key).collect()
}

pub fn layout() -> Layout {
    Layout::bytes(SLOT).unwrap()
}

pub fn extra(n: i64) -> ExtraCount {
    ExtraCount::new(n).unwrap()
}

/// The bytes written for `key` in the `version`-th write of it.
pub fn payload(key: &ObjectKey, version: u64) -> Vec<u8> {
    let seed = (key.chunk.0 as u64) ^ version.wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..SLOT).map(|i| (seed.wrapping_add(i).wrapping_mul(0x9e37_79b9) >> 13) as u8).collect()
}

impl Fixture {
    /// Reserves every key for a new cached object and returns the per-key answers.
    pub fn try_reserve(
        &self,
        keys: &[ObjectKey],
    ) -> Vec<Result<tierkv_l1::SlotHandle, tierkv_core::KeyError>> {
        self.l1.reserve_write(OWNER, keys, &layout(), WriteMode::Create, Lifetime::Cached).unwrap()
    }

    /// Reserves every key, asserting success; returns each key with its reservation's
    /// generation (how a promotion names it).
    pub fn reserve(&self, keys: &[ObjectKey]) -> Vec<(ObjectKey, u64)> {
        let results = self.try_reserve(keys);
        assert!(results.iter().all(|r| r.is_ok()), "reserve failed: {results:?}");
        keys.iter().zip(results).filter_map(|(k, r)| Some((*k, r.ok()?.generation))).collect()
    }

    /// Copies `payload(key, version)` into a reserved key.
    pub fn fill(&self, key: &ObjectKey, version: u64) {
        let mut guard = self.l1.write_access(OWNER, key).unwrap();
        guard.write_at(0, &payload(key, version)).unwrap();
    }

    /// Reserves, fills and finishes every key.
    pub fn write(&self, keys: &[ObjectKey]) {
        self.reserve(keys);
        for k in keys {
            self.fill(k, 0);
        }
        assert!(self.l1.finish_write(OWNER, keys).iter().all(|r| r.is_ok()));
    }

    /// Leases one key and returns the lease id.
    pub fn lease(&self, key: &ObjectKey, extra_count: i64) -> tierkv_l1::LeaseId {
        let grant = self.l1.reserve_read(OWNER, std::slice::from_ref(key), extra(extra_count));
        assert!(grant.results[0].is_ok(), "lease of {key:?} failed: {:?}", grant.results[0]);
        grant.lease.unwrap()
    }

    pub fn shares(&self, key: &ObjectKey) -> u64 {
        match self.l1.presence(key) {
            Presence::Ready { shares, .. } => shares,
            other => panic!("{key:?} is {other:?}, not ready"),
        }
    }

    pub fn release(&self, lease: tierkv_l1::LeaseId, reader: u8) {
        self.l1.finish_read(lease, Readers::One(reader), None).unwrap();
    }

    pub fn usage(&self) -> Usage {
        self.l1.usage()
    }

    /// Reads a leased key back through `reader`'s share.
    pub fn read(&self, lease: tierkv_l1::LeaseId, reader: u8, key: &ObjectKey) -> Vec<u8> {
        let guard = self.l1.read_access(lease, reader, key).unwrap();
        let mut bytes = vec![0; SLOT as usize];
        guard.read_at(0, &mut bytes).unwrap();
        bytes
    }

    pub fn assert_consistent(&self) {
        if let Err(why) = self.l1.audit() {
            panic!("L1 audit failed: {why}");
        }
        let u = self.usage();
        assert_eq!(u.used_bytes + u.cached_bytes + u.free_bytes, u.capacity_bytes, "{u:?}");
    }
}
