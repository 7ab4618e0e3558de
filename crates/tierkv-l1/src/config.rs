//! L1 configuration: plain data, validated once when the manager is built.

use std::time::Duration;

use tierkv_core::policy::PolicyKind;

use crate::device::DeviceKind;
use crate::error::L1Error;

/// How an L1 is built.
#[derive(Clone, Debug, PartialEq)]
pub struct L1Config {
    /// Bytes of device memory for slots. Rounded down to a whole number of slots.
    pub capacity_bytes: u64,
    /// Bytes per slot: the largest chunk L1 holds. One object takes one slot whatever its size.
    pub slot_bytes: u64,
    /// Where the arena lives.
    pub device: DeviceKind,
    /// Which policy picks eviction victims.
    pub policy: PolicyKind,
    /// Index shards (a power of two); 0 picks one from the slot count.
    pub shards: usize,
    /// How long a read lease lives before it is revoked.
    pub lease_ttl: Duration,
    /// Background eviction thresholds, as fractions of the slots in use.
    pub watermark: Watermark,
    /// Commit an emulated arena's memory when L1 is built, so the first write of a slot does not
    /// pay page faults (GPU memory is committed when allocated: no effect there).
    pub prefault: bool,
}

/// Background eviction: above `high` of the slots occupied, evict cached objects until at most
/// `low` are. On-demand eviction inside reservations works whatever these say.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Watermark {
    /// Occupancy that starts background eviction.
    pub high: f64,
    /// Occupancy background eviction brings it down to.
    pub low: f64,
}

impl Default for Watermark {
    fn default() -> Self {
        Watermark { high: 0.95, low: 0.90 }
    }
}

impl L1Config {
    /// An emulated-or-CUDA (`Auto`) L1 with the default (adaptive) eviction and default lease and watermark settings.
    pub fn new(capacity_bytes: u64, slot_bytes: u64) -> Self {
        L1Config {
            capacity_bytes,
            slot_bytes,
            device: DeviceKind::Auto,
            policy: PolicyKind::default(),
            shards: 0,
            lease_ttl: Duration::from_secs(30),
            watermark: Watermark::default(),
            prefault: false,
        }
    }

    /// The number of whole slots that fit the capacity.
    pub fn slot_count(&self) -> u64 {
        self.capacity_bytes.checked_div(self.slot_bytes).unwrap_or(0)
    }

    pub(crate) fn validate(&self) -> Result<(u32, usize), L1Error> {
        let bad = |why: String| Err(L1Error::Config(why));
        if self.slot_bytes == 0 {
            return bad("slot_bytes must be positive".into());
        }
        let slots = self.slot_count();
        if slots == 0 {
            return bad(format!(
                "capacity_bytes ({}) must hold at least one slot of {} bytes",
                self.capacity_bytes, self.slot_bytes
            ));
        }
        let Ok(slots) = u32::try_from(slots) else {
            return bad(format!("{slots} slots exceed the limit of {}", u32::MAX));
        };
        if self.lease_ttl.is_zero() {
            return bad("lease_ttl must be positive".into());
        }
        let Watermark { high, low } = self.watermark;
        if !(0.0 < low && low <= high && high <= 1.0) {
            return bad(format!(
                "watermarks need 0 < low <= high <= 1, got low {low} and high {high}"
            ));
        }
        let shards = match self.shards {
            0 => tierkv_core::policy::auto_shards(u64::from(slots)),
            n if n.is_power_of_two() && n <= 1024 => n,
            n => return bad(format!("shards must be a power of two up to 1024, got {n}")),
        };
        Ok((slots, shards))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let ok = L1Config::new(64 << 20, 8 << 20);
        assert_eq!(ok.validate().unwrap(), (8, 1));
        let err = |c: L1Config| c.validate().unwrap_err().to_string();
        assert!(err(L1Config::new(1 << 20, 0)).contains("slot_bytes"));
        assert!(err(L1Config::new(1 << 20, 2 << 20)).contains("at least one slot"));
        assert!(err(L1Config { shards: 3, ..ok.clone() }).contains("power of two"));
        assert!(err(L1Config { lease_ttl: Duration::ZERO, ..ok.clone() }).contains("lease_ttl"));
        let inverted = Watermark { high: 0.5, low: 0.9 };
        assert!(err(L1Config { watermark: inverted, ..ok.clone() }).contains("watermarks"));
        assert_eq!(L1Config::new(1 << 40, 1 << 20).validate().unwrap(), (1 << 20, 64));
        assert_eq!(L1Config { shards: 256, ..ok }.validate().unwrap().1, 256);
    }
}
