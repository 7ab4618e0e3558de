//! Per-key result codes shared by every tier and by the wire protocol.

/// Why one key of a batch was refused.
///
/// Batched operations answer per key, so one bad key never fails its neighbours. The numeric
/// codes are stable: the wire protocol sends them, and a client written in another language
/// matches on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u8)]
pub enum KeyError {
    /// The key is not stored in this tier.
    #[error("key not found")]
    NotFound = 1,
    /// The key is being written and is not visible to readers yet.
    #[error("key is being written and not readable yet")]
    NotReadable = 2,
    /// The key exists but is not in the state this operation needs.
    #[error("key is in the wrong state for this operation")]
    WrongState = 3,
    /// A finished copy of the key exists; a second one is never made.
    #[error("key is already present")]
    AlreadyPresent = 4,
    /// Another writer reserved the key and has not finished.
    #[error("a write of this key is already in flight")]
    WriteInFlight = 5,
    /// No room, even after evicting every evictable object.
    #[error("out of memory")]
    OutOfMemory = 6,
    /// The key is leased or being written, and the operation was not forced.
    #[error("key is locked by a reader or a writer")]
    Locked = 7,
    /// The key appears more than once in one request; only its first occurrence counts.
    #[error("key appears more than once in the request")]
    Duplicate = 8,
    /// The object's size does not match the layout of the request.
    #[error("layout size does not match the object")]
    LayoutMismatch = 9,
    /// A copy into or out of the key's slot is under way.
    #[error("a copy into or out of this key's slot is under way")]
    Busy = 10,
}

impl KeyError {
    /// Every code, for exhaustive round-trip tests and documentation.
    pub const ALL: [KeyError; 10] = [
        KeyError::NotFound,
        KeyError::NotReadable,
        KeyError::WrongState,
        KeyError::AlreadyPresent,
        KeyError::WriteInFlight,
        KeyError::OutOfMemory,
        KeyError::Locked,
        KeyError::Duplicate,
        KeyError::LayoutMismatch,
        KeyError::Busy,
    ];

    /// The stable wire code.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The error a wire code stands for; `None` for a code this version does not know.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.code() == code)
    }

    /// A short snake_case name, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyError::NotFound => "not_found",
            KeyError::NotReadable => "not_readable",
            KeyError::WrongState => "wrong_state",
            KeyError::AlreadyPresent => "already_present",
            KeyError::WriteInFlight => "write_in_flight",
            KeyError::OutOfMemory => "out_of_memory",
            KeyError::Locked => "locked",
            KeyError::Duplicate => "duplicate",
            KeyError::LayoutMismatch => "layout_mismatch",
            KeyError::Busy => "busy",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_stable() {
        for e in KeyError::ALL {
            assert_eq!(KeyError::from_code(e.code()), Some(e));
        }
        assert_eq!(KeyError::NotFound.code(), 1);
        assert_eq!(KeyError::Busy.code(), 10);
        assert_eq!(KeyError::from_code(0), None);
        assert_eq!(KeyError::from_code(11), None);
    }
}
