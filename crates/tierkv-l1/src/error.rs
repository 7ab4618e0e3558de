//! Request-level errors of the L1 manager. Per-key refusals use [`tierkv_core::KeyError`].

use tierkv_core::{KeyError, ObjectKey};

use crate::device::DeviceError;
use crate::lease::LeaseId;

/// Why a whole L1 request was refused. A refused request changed nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum L1Error {
    /// The configuration cannot describe an L1.
    #[error("invalid L1 configuration: {0}")]
    Config(String),
    /// The device backend failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A layout whose chunks do not fit one slot.
    #[error("a chunk of {layout_bytes} bytes does not fit the {slot_bytes}-byte L1 slots")]
    LayoutTooLarge {
        /// Size of one chunk of the requested layout.
        layout_bytes: u64,
        /// Size of an L1 slot.
        slot_bytes: u64,
    },
    /// No lease with this id was ever handed out (or it was forgotten long ago).
    #[error("unknown lease {0}")]
    UnknownLease(LeaseId),
    /// The lease passed its deadline and was revoked; its shares were returned then.
    #[error("lease {0} expired and was revoked; its shares were already returned")]
    LeaseExpired(LeaseId),
    /// Every share of the lease was returned already.
    #[error("lease {0} was released already")]
    LeaseReleased(LeaseId),
    /// A reader number beyond the lease's `1 + extra_count` readers.
    #[error("lease {lease} has readers 0..{readers}, there is no reader {reader}")]
    NoSuchReader {
        /// The lease.
        lease: LeaseId,
        /// The reader asked for.
        reader: u8,
        /// Readers of the lease.
        readers: u32,
    },
    /// The reader returned its share of this key before: a second release is refused, so it can
    /// never return another reader's share.
    #[error("reader {reader} of lease {lease} already returned its share of {key:?}")]
    AlreadyReleased {
        /// The lease.
        lease: LeaseId,
        /// The reader.
        reader: u8,
        /// The key.
        key: ObjectKey,
    },
    /// A release naming an empty list of keys: it would change nothing, which the rules forbid
    /// (a release that returns no share is a mistake, not a no-op).
    #[error("a release of lease {0} names no key")]
    EmptyRelease(LeaseId),
    /// A key the lease does not cover, with the reason found in L1.
    #[error("lease {lease} does not cover {key:?}: {error}")]
    NotLeased {
        /// The lease.
        lease: LeaseId,
        /// The key.
        key: ObjectKey,
        /// `NotFound` when the key is not in L1, `WrongState` otherwise, `Duplicate` when the
        /// request named it twice.
        error: KeyError,
    },
    /// A key-level refusal of a single-key request (e.g. [`crate::L1Manager::write_access`]).
    #[error("{key:?}: {error}")]
    Key {
        /// The key.
        key: ObjectKey,
        /// Why.
        error: KeyError,
    },
    /// A copy range outside the object.
    #[error("range {offset}+{len} lies outside the {object}-byte object")]
    OutOfRange {
        /// Start of the range within the object.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the object.
        object: u64,
    },
}

impl L1Error {
    /// A short snake_case name, used as a metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            L1Error::Config(_) => "config",
            L1Error::Device(_) => "device",
            L1Error::LayoutTooLarge { .. } => "layout_too_large",
            L1Error::UnknownLease(_) => "unknown_lease",
            L1Error::LeaseExpired(_) => "lease_expired",
            L1Error::LeaseReleased(_) => "lease_released",
            L1Error::NoSuchReader { .. } => "no_such_reader",
            L1Error::AlreadyReleased { .. } => "already_released",
            L1Error::EmptyRelease(_) => "empty_release",
            L1Error::NotLeased { .. } => "not_leased",
            L1Error::Key { error, .. } => error.as_str(),
            L1Error::OutOfRange { .. } => "out_of_range",
        }
    }
}
