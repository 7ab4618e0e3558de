//! Errors of opening a RemoteStore, and of one call to Redis. Failures of tasks travel in
//! completions as `TierError` (stores) or as misses (lookups and loads).

/// Why a RemoteStore could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The configuration cannot describe a store: `key` (a field of `RemoteConfig`) is wrong.
    #[error("invalid remote configuration: {why}")]
    Config {
        /// The field at fault.
        key: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The adapter's runtime could not be started.
    #[error("cannot start the remote tier's runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// Why one call to Redis failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// No connection, and the last attempt is too recent to try again.
    #[error("not connected: {0}")]
    Unavailable(String),
    /// A connection could not be opened (refused, unreachable, or the server is not what the
    /// configuration says: a cluster node that is not in cluster mode, a wrong password).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// A probe found a master the cluster's slots map to that does not answer.
    #[error("a master does not answer: {0}")]
    Unreachable(String),
    /// The deadline passed.
    #[error("no answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The deadline passed while the connection answered other calls: it is busy (the call
    /// queued behind others on the one connection), not broken.
    #[error("no answer within {0:?}, the connection busy with other calls")]
    Busy(std::time::Duration),
    /// Redis answered with an error, or the connection failed.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// The adapter is closing.
    #[error("closed")]
    Closed,
}

impl CallError {
    /// The `reason` label of the error counter.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            CallError::Unavailable(_) => "unavailable",
            CallError::Connect(_) | CallError::Unreachable(_) => "connection",
            CallError::Timeout(_) => "timeout",
            CallError::Busy(_) => "busy",
            CallError::Redis(e) if e.code() == Some("OOM") => "oom",
            CallError::Redis(e) if e.is_timeout() => "timeout",
            CallError::Redis(e) if is_link(e) => "connection",
            CallError::Redis(_) => "server",
            CallError::Closed => "closed",
        }
    }

    /// Whether the failure says the connection (or the cluster) is unhealthy, rather than that
    /// one command was refused (a full server refusing a SET is not a broken link).
    pub(crate) fn is_connection(&self) -> bool {
        match self {
            CallError::Unavailable(_)
            | CallError::Connect(_)
            | CallError::Unreachable(_)
            | CallError::Timeout(_) => true,
            CallError::Redis(e) => is_link(e),
            CallError::Busy(_) | CallError::Closed => false,
        }
    }

    /// Whether the call ran past its deadline (ours, or the client's response timeout).
    pub(crate) fn is_timeout(&self) -> bool {
        match self {
            CallError::Timeout(_) => true,
            CallError::Redis(e) => e.is_timeout(),
            _ => false,
        }
    }
}

/// Whether a Redis error says the link or the cluster is unhealthy.
pub(crate) fn is_link(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_cluster_error()
        || e.is_unrecoverable_error()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
}
