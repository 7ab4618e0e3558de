//! Sizes written the way people write them: "8GiB", "512MiB", "1.5GiB", "10GB".

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// A number of bytes, written in a configuration as "8GiB", "512MiB", "1.5GiB", "10GB", "4096B"
/// or a bare integer. KB, MB, GB and TB are powers of 1000; KiB, MiB, GiB and TiB powers of 1024
/// (units are case-insensitive). A fraction is accepted only where it is a whole number of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

/// The units a size may carry, and their value in bytes.
const UNITS: [(&str, u64); 10] = [
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
    ("", 1),
];

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let s = text.trim();
        if s.starts_with('-') {
            return Err(format!("{text:?}: a size cannot be negative"));
        }
        let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (number, unit) = s.split_at(end);
        let unit = unit.trim().to_ascii_lowercase();
        let Some(&(_, factor)) = UNITS.iter().find(|(name, _)| *name == unit) else {
            return Err(format!(
                "{text:?}: unknown size unit {unit:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)"
            ));
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(format!("{text:?} is not a size such as \"8GiB\""));
        }
        let too_large = || format!("{text:?} exceeds the largest size, {} bytes", u64::MAX);
        // Exact decimal arithmetic, so "1.1GB" is exactly 1_100_000_000 bytes.
        let whole: u128 =
            if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
        let fraction = fraction.trim_end_matches('0');
        let part = if fraction.is_empty() {
            0
        } else {
            let scale =
                u32::try_from(fraction.len()).ok().filter(|&n| n <= 18).map(|n| 10u128.pow(n));
            let bytes = scale.zip(fraction.parse::<u128>().ok()).and_then(|(scale, digits)| {
                let scaled = digits * u128::from(factor);
                scaled.is_multiple_of(scale).then(|| scaled / scale)
            });
            bytes.ok_or_else(|| format!("{text:?} is not a whole number of bytes"))?
        };
        whole
            .checked_mul(u128::from(factor))
            .and_then(|bytes| bytes.checked_add(part))
            .and_then(|bytes| u64::try_from(bytes).ok())
            .map(ByteSize)
            .ok_or_else(too_large)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;

        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"8GiB\" or an integer number of bytes")
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom("a size cannot be negative"))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn bytes(text: &str) -> u64 {
        text.parse::<ByteSize>().unwrap_or_else(|e| panic!("{text:?} refused: {e}")).0
    }

    fn refused(text: &str) -> String {
        match text.parse::<ByteSize>() {
            Ok(size) => panic!("{text:?} accepted as {size:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn binary_and_decimal_units_parse() {
        assert_eq!(bytes("8GiB"), 8 << 30);
        assert_eq!(bytes("512MiB"), 512 << 20);
        assert_eq!(bytes("64KiB"), 64 << 10);
        assert_eq!(bytes("2TiB"), 2 << 40);
        assert_eq!(bytes("1.5GiB"), 3 << 29);
        assert_eq!(bytes("10GB"), 10_000_000_000);
        assert_eq!(bytes("1.1GB"), 1_100_000_000, "exact, not a float rounding");
        assert_eq!(bytes("4KB"), 4000);
        assert_eq!(bytes("4096"), 4096);
        assert_eq!(bytes("4096B"), 4096);
        assert_eq!(bytes(" 64 kib "), 64 << 10);
        assert_eq!(bytes("0.5KiB"), 512);
        assert_eq!(bytes(".5KiB"), 512);
        assert_eq!(bytes("1.50MB"), 1_500_000);
        assert_eq!(bytes("0"), 0);
        assert_eq!(bytes("18446744073709551615"), u64::MAX);
    }

    #[test]
    fn malformed_sizes_say_why() {
        assert!(refused("-1GiB").contains("negative"));
        assert!(refused("").contains("not a size"));
        assert!(refused("GiB").contains("not a size"));
        assert!(refused(".").contains("not a size"));
        assert!(refused("1.2.3MiB").contains("not a size"));
        assert!(refused("8XB").contains("unit"));
        assert!(refused("8 parsecs").contains("unit"));
        assert!(refused("1e9").contains("unit"));
        assert!(refused("1.5B").contains("whole number of bytes"));
        assert!(refused("0.1KiB").contains("whole number of bytes"));
        assert!(refused("1.0000000000000000000001GiB").contains("whole number of bytes"));
        assert!(refused("16777216TiB").contains("exceeds"));
        assert!(refused("18446744073709551616").contains("exceeds"));
        assert!(refused("99999999999999999999999999999999999999999GB").contains("exceeds"));
    }
}
