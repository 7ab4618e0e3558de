//! HostStore configuration: plain data, validated when the store opens.

use tierkv_core::policy::PolicyKind;

use crate::error::L2Error;

/// Which host memory backs the arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostMemory {
    /// Pinned when a CUDA device is usable (device copies then run at DMA speed), plain
    /// otherwise.
    #[default]
    Auto,
    /// Ordinary anonymous memory.
    Plain,
    /// Huge pages: explicit (hugetlbfs) when the kernel has them reserved, else transparent huge
    /// pages, else plain memory. [`crate::HostStore::memory`] tells which was obtained.
    HugePages,
    /// Page-locked memory registered with CUDA; an error where CUDA is unavailable.
    Pinned,
}

/// How a HostStore is built.
#[derive(Clone, Debug, PartialEq)]
pub struct HostStoreConfig {
    /// Bytes of host memory for chunks, rounded down to whole chunks.
    pub capacity_bytes: u64,
    /// Bytes per slot: the largest chunk stored; one chunk per slot.
    pub chunk_bytes: u64,
    /// Which policy picks eviction victims.
    pub policy: PolicyKind,
    /// Worker threads; each runs one task at a time.
    pub workers: usize,
    /// Which memory backs the arena.
    pub memory: HostMemory,
    /// Commits every page of the arena when it is allocated, so that no store pays page faults
    /// (pinned memory is committed anyway).
    pub prefault: bool,
}

impl HostStoreConfig {
    /// A store of `capacity_bytes` in slots of `chunk_bytes`, adaptive eviction, two workers, `Auto`
    /// memory, committed as it is first written.
    pub fn new(capacity_bytes: u64, chunk_bytes: u64) -> Self {
        HostStoreConfig {
            capacity_bytes,
            chunk_bytes,
            policy: PolicyKind::default(),
            workers: 2,
            memory: HostMemory::Auto,
            prefault: false,
        }
    }

    /// Validates the configuration; returns the number of slots.
    pub(crate) fn slots(&self) -> Result<u32, L2Error> {
        let bad = |why: String| Err(L2Error::Config(why));
        if self.chunk_bytes == 0 {
            return bad("chunk_bytes must be positive".into());
        }
        let slots = self.capacity_bytes / self.chunk_bytes;
        if slots == 0 {
            return bad(format!(
                "capacity_bytes ({}) must hold at least one chunk of {} bytes",
                self.capacity_bytes, self.chunk_bytes
            ));
        }
        if self.workers == 0 || self.workers > 256 {
            return bad(format!("workers must be within 1..=256, got {}", self.workers));
        }
        u32::try_from(slots)
            .or_else(|_| bad(format!("{slots} slots exceed the limit of {}", u32::MAX)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        assert_eq!(HostStoreConfig::new(1 << 20, 1 << 16).slots().unwrap(), 16);
        let err = |c: HostStoreConfig| c.slots().unwrap_err().to_string();
        assert!(err(HostStoreConfig::new(1 << 20, 0)).contains("chunk_bytes"));
        assert!(err(HostStoreConfig::new(1 << 10, 1 << 16)).contains("at least one chunk"));
        assert!(
            err(HostStoreConfig { workers: 0, ..HostStoreConfig::new(1 << 20, 1 << 16) })
                .contains("workers")
        );
    }
}
