//! What the StorageManager test files share: 16 KiB chunks, one owner, and an emulated L1 of a
//! given number of slots.

#![allow(dead_code, reason = "each test binary uses a different part of the fixture")]

use std::time::Duration;

use tierkv_core::Layout;
use tierkv_l1::{DeviceKind, L1Config, OwnerId};

pub const CHUNK: u64 = 16 << 10;
pub const OWNER: OwnerId = OwnerId(3);
pub const WAIT: Duration = Duration::from_secs(20);

pub fn layout() -> Layout {
    Layout::bytes(CHUNK).unwrap()
}

/// An emulated L1 of `slots` chunks.
pub fn l1_config(slots: u64) -> L1Config {
    L1Config { device: DeviceKind::Emulated, ..L1Config::new(slots * CHUNK, CHUNK) }
}

pub use tierkv_testkit::metrics::{Seen, counter};

/// `tierkv_errors_total{tier="l1",reason="out_of_memory"}` in `seen`: the keys L1 refused for
/// want of room.
pub fn l1_out_of_memory(seen: &Seen) -> u64 {
    counter(seen, "tierkv_errors_total", &[("tier", "l1"), ("reason", "out_of_memory")])
}
