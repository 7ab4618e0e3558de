//! `extra_count`: how many readers beyond the first share one read lease.

use std::fmt;

/// The number of extra reader shares of a read lease, validated to `0..=127`.
///
/// A lease is read by `1 + extra_count` readers (one per tensor-parallel rank that reads a shared
/// MLA object). The bound is checked once, where the value enters (the wire or an API), so no
/// background thread ever sees an out-of-range count; nothing is clamped.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExtraCount(u8);

/// A requested `extra_count` outside `0..=127`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("extra_count must be within 0..={max}, got {value}", max = ExtraCount::MAX)]
pub struct ExtraCountOutOfRange {
    /// The value that was asked for.
    pub value: i64,
}

impl ExtraCount {
    /// The largest extra count: 128 readers in all, one bit each in a `u128` reader set.
    pub const MAX: u8 = 127;
    /// No extra readers: one release returns the lease.
    pub const ZERO: ExtraCount = ExtraCount(0);

    /// Validates a count from any integer source.
    pub fn new(value: i64) -> Result<Self, ExtraCountOutOfRange> {
        u8::try_from(value)
            .ok()
            .filter(|v| *v <= Self::MAX)
            .map(ExtraCount)
            .ok_or(ExtraCountOutOfRange { value })
    }

    /// The extra count itself.
    pub fn get(self) -> u8 {
        self.0
    }

    /// Readers of a lease with this extra count: `1 + extra_count`.
    pub fn readers(self) -> u32 {
        1 + u32::from(self.0)
    }
}

impl TryFrom<i64> for ExtraCount {
    type Error = ExtraCountOutOfRange;

    fn try_from(value: i64) -> Result<Self, Self::Error> {
        ExtraCount::new(value)
    }
}

impl fmt::Debug for ExtraCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "extra_count={}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_exact() {
        assert_eq!(ExtraCount::new(0).unwrap().readers(), 1);
        assert_eq!(ExtraCount::new(127).unwrap().readers(), 128);
        for bad in [128, 255, 256, -1, i64::MIN, i64::MAX] {
            let err = ExtraCount::new(bad).unwrap_err();
            assert_eq!(err.value, bad);
            assert!(err.to_string().contains("0..=127"), "{err}");
        }
    }
}
