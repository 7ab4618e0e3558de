//! Read counts for admission after reads: disk admission (`StorePolicy::DiskAdmission`) and
//! remote admission (`RemoteAdmission::AfterReads`) send a chunk down once it has been read
//! often enough, and never send one back to the remote tier that served it.

use foldhash::{HashMap, HashMapExt};
use tierkv_core::ObjectKey;

/// The bit of a chunk's read count that says the remote tier served it once: such a chunk is
/// never admitted back to the remote tier, whatever its reads.
const CAME_FROM_REMOTE: u32 = 1 << 31;

/// Where a chunk read just now goes, by the thresholds it reached with this read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Admit {
    /// Its reads reached disk admission's threshold.
    pub(crate) disk: bool,
    /// Its reads reached remote admission's threshold, and the remote tier never served it.
    pub(crate) remote: bool,
}

/// Reads counted per chunk, bounded: past `cap` chunks the counts start over.
pub(crate) struct ReadCounts {
    counts: HashMap<ObjectKey, u32>,
    cap: usize,
}

impl ReadCounts {
    /// Counts for at most about `cap` chunks.
    pub(crate) fn new(cap: usize) -> Self {
        ReadCounts { counts: HashMap::new(), cap }
    }

    /// Keeps the counts within their bound before a lookup's reads are counted.
    pub(crate) fn bound(&mut self) {
        if self.counts.len() > self.cap {
            self.counts.clear();
        }
    }

    /// Counts one read of `key` (served by the remote tier if `from_remote`) and says which
    /// thresholds (`disk`, `remote`: reads to admission, if admitted after reads) it reached now.
    pub(crate) fn read(
        &mut self,
        key: ObjectKey,
        from_remote: bool,
        disk: Option<u32>,
        remote: Option<u32>,
    ) -> Admit {
        let entry = self.counts.entry(key).or_insert(0);
        if from_remote {
            *entry |= CAME_FROM_REMOTE;
        }
        let count = (*entry & !CAME_FROM_REMOTE).saturating_add(1).min(!CAME_FROM_REMOTE);
        *entry = (*entry & CAME_FROM_REMOTE) | count;
        Admit {
            disk: Some(count) == disk,
            remote: Some(count) == remote && *entry & CAME_FROM_REMOTE == 0,
        }
    }
}
