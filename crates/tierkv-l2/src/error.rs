//! Errors of opening a HostStore. Failures of tasks travel in completions as `TierError`.

/// Why a HostStore could not be opened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum L2Error {
    /// The configuration cannot describe a store.
    #[error("invalid L2 configuration: {0}")]
    Config(String),
    /// The host memory could not be obtained.
    #[error("cannot allocate {bytes} bytes of {kind} host memory: {reason}")]
    Memory {
        /// The kind of memory asked for.
        kind: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// What the OS or driver said.
        reason: String,
    },
    /// A worker thread could not be started.
    #[error("cannot start an L2 worker thread: {0}")]
    Thread(String),
}
