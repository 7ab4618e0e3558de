//! RemoteStore configuration: plain data, validated when the store opens.

use std::time::Duration;

use crate::error::RemoteError;

/// Which kind of deployment the URLs name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RemoteMode {
    /// A Redis (or Valkey) Cluster: the URLs are seed nodes; the client learns the slot map and
    /// follows failovers and resharding.
    #[default]
    Cluster,
    /// One server: the first URL.
    Standalone,
}

/// How a RemoteStore is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://host:port` URLs: seed nodes of a cluster, or the one server.
    pub urls: Vec<String>,
    /// Cluster or one server.
    pub mode: RemoteMode,
    /// Every Redis key starts with `{prefix}:`, then the namespace hash.
    pub key_prefix: String,
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// The deadline of every call (one command, or one batch of them); past it the call is a
    /// miss or a failed store.
    pub op_timeout: Duration,
    /// Values (GET or SET) in flight at once, over every task.
    pub max_in_flight: usize,
    /// Expiry of each stored value; `None`: values live until the server evicts them.
    pub ttl: Option<Duration>,
    /// The largest payload stored (the L1 slot size).
    pub max_chunk_bytes: u64,
    /// How long after a call failed for the link's sake (a timeout, a refused or broken
    /// connection) calls fail at once, as misses, before the next attempt: a dead or hung cluster
    /// costs one deadline per interval, not one per call.
    pub reconnect_interval: Duration,
    /// Threads of the adapter's own tokio runtime.
    pub threads: usize,
}

impl RemoteConfig {
    /// A store over `urls` in `mode`, chunks up to `max_chunk_bytes`, with the defaults of the
    /// `[remote]` section.
    pub fn new(urls: Vec<String>, mode: RemoteMode, max_chunk_bytes: u64) -> Self {
        RemoteConfig {
            urls,
            mode,
            key_prefix: "tierkv".into(),
            connect_timeout: Duration::from_millis(500),
            op_timeout: Duration::from_secs(1),
            max_in_flight: 16,
            ttl: Some(Duration::from_secs(3600)),
            max_chunk_bytes,
            reconnect_interval: Duration::from_secs(1),
            threads: 2,
        }
    }

    /// Checks the configuration, naming the first problem.
    pub fn validate(&self) -> Result<(), RemoteError> {
        let bad = |why: String| Err(RemoteError::Config(why));
        if self.urls.is_empty() {
            return bad("urls must name at least one server".into());
        }
        if let Some(url) = self.urls.iter().find(|u| redis::parse_redis_url(u).is_none()) {
            return bad(format!("{url:?} is not a redis:// URL"));
        }
        if self.key_prefix.is_empty() || self.key_prefix.contains(char::is_whitespace) {
            return bad("key_prefix must be non-empty and without whitespace".into());
        }
        if self.connect_timeout.is_zero() || self.op_timeout.is_zero() {
            return bad("connect_timeout and op_timeout must be positive".into());
        }
        if !(1..=1024).contains(&self.max_in_flight) {
            return bad(format!(
                "max_in_flight must be within 1..=1024, got {}",
                self.max_in_flight
            ));
        }
        if self.ttl.is_some_and(|t| t < Duration::from_millis(1)) {
            return bad("ttl must be at least 1ms (or absent)".into());
        }
        if self.max_chunk_bytes == 0 || self.max_chunk_bytes > 512 << 20 {
            return bad(format!(
                "max_chunk_bytes must be within 1..=512MiB (a Redis value's limit), got {}",
                self.max_chunk_bytes
            ));
        }
        if !(1..=64).contains(&self.threads) {
            return bad(format!("threads must be within 1..=64, got {}", self.threads));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let good =
            RemoteConfig::new(vec!["redis://127.0.0.1:7000".into()], RemoteMode::Cluster, 1 << 20);
        good.validate().unwrap();
        let err = |c: RemoteConfig| c.validate().unwrap_err().to_string();
        assert!(err(RemoteConfig { urls: vec![], ..good.clone() }).contains("urls"));
        assert!(
            err(RemoteConfig { urls: vec!["http://x".into()], ..good.clone() })
                .contains("redis://")
        );
        assert!(err(RemoteConfig { max_in_flight: 0, ..good.clone() }).contains("max_in_flight"));
        assert!(
            err(RemoteConfig { op_timeout: Duration::ZERO, ..good.clone() }).contains("op_timeout")
        );
        assert!(
            err(RemoteConfig { key_prefix: String::new(), ..good.clone() }).contains("key_prefix")
        );
        assert!(err(RemoteConfig { max_chunk_bytes: 0, ..good }).contains("max_chunk_bytes"));
    }
}
