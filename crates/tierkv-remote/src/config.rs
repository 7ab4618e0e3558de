//! RemoteStore configuration: plain data, validated when the store opens.

use std::time::Duration;

use crate::error::RemoteError;
use crate::format::HEADER_BYTES;

/// Which kind of deployment the URLs name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RemoteMode {
    /// A Redis (or Valkey) Cluster: the URLs are seed nodes; the client learns the slot map and
    /// follows failovers and resharding.
    #[default]
    Cluster,
    /// One server, the one URL.
    Standalone,
}

/// How a RemoteStore is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://host:port` (or `valkey://`) URLs: seed nodes of a cluster, or the one server.
    pub urls: Vec<String>,
    /// Cluster or one server.
    pub mode: RemoteMode,
    /// Every Redis key starts with `{prefix}:`, then the namespace hash.
    pub key_prefix: String,
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// The deadline of every call (one command, or one batch of them); past it the call is a
    /// miss or a failed store. A timeout degrades the tier only if the connection answered
    /// nothing while the call waited; otherwise the call queued behind others and fails alone
    /// (`busy`).
    pub op_timeout: Duration,
    /// Values in flight at once, over every task: this many stored and this many loaded, counted
    /// apart so that a load never queues behind a backlog of stores.
    pub max_in_flight: usize,
    /// Expiry of each stored value; `None`: values live until the server evicts them.
    pub ttl: Option<Duration>,
    /// The largest payload stored (the L1 slot size).
    pub max_chunk_bytes: u64,
    /// How long after a call failed for the link's sake (a refused or broken connection, or a
    /// timeout with the connection silent) calls fail at once, as misses, before the next
    /// attempt: a dead or hung cluster costs one deadline per interval, not one per call. Also
    /// the least time between two connections opened.
    pub reconnect_interval: Duration,
    /// Threads of the adapter's own tokio runtime.
    pub threads: usize,
}

/// The largest chunk the tier stores: a value (header and chunk) must fit Redis's default
/// `proto-max-bulk-len` of 512 MiB, or Redis drops the connection every call shares.
pub const MAX_CHUNK_BYTES: u64 = (512 << 20) - HEADER_BYTES as u64;

/// `url` with any user and password masked, for messages.
pub(crate) fn without_secrets(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("\"{}***{}\"", &url[..scheme + 3], &url[at..])
        }
        _ => format!("{url:?}"),
    }
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
        let bad = |key: &'static str, why: String| Err(RemoteError::Config { key, why });
        if self.urls.is_empty() {
            return bad("urls", "urls must name at least one server".into());
        }
        for url in &self.urls {
            match redis::parse_redis_url(url) {
                Some(parsed) if matches!(parsed.scheme(), "redis" | "valkey") => {}
                // The redis crate is built without TLS: such a URL would fail every connection.
                Some(parsed) if matches!(parsed.scheme(), "rediss" | "valkeys") => {
                    return bad(
                        "urls",
                        format!(
                            "{} asks for TLS, which this daemon is built without: use redis:// \
                             on a network only the tierkv nodes reach",
                            without_secrets(url)
                        ),
                    );
                }
                _ => return bad("urls", format!("{} is not a redis:// URL", without_secrets(url))),
            }
            // What a connection is opened with (no network): a database that is not a number,
            // or no host, would fail every connection.
            if let Err(e) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
                return bad("urls", format!("{}: {e}", without_secrets(url)));
            }
        }
        match self.mode {
            // Only one would be used: more are likely a cluster's nodes in the wrong mode.
            RemoteMode::Standalone if self.urls.len() > 1 => {
                return bad(
                    "urls",
                    format!(
                        "mode \"standalone\" talks to one server, and urls lists {}: list \
                         that one, or set mode = \"cluster\" for the nodes of a Redis Cluster",
                        self.urls.len()
                    ),
                );
            }
            RemoteMode::Standalone => {}
            // The cluster client's own checks (no network): seeds with different passwords,
            // users or databases would fail every connection.
            RemoteMode::Cluster => {
                if let Err(e) = redis::cluster::ClusterClient::new(self.urls.clone()) {
                    return bad("urls", format!("the cluster's seed nodes do not agree: {e}"));
                }
            }
        }
        if self.key_prefix.is_empty() || self.key_prefix.contains(char::is_whitespace) {
            return bad("key_prefix", "key_prefix must be non-empty and without whitespace".into());
        }
        if self.key_prefix.contains('{') || self.key_prefix.contains('}') {
            // A hash tag in the prefix would put every key on one cluster slot, one master.
            return bad(
                "key_prefix",
                "key_prefix must not contain '{' or '}' (a Redis Cluster hash tag)".into(),
            );
        }
        let day = Duration::from_secs(24 * 3600);
        for (key, wait) in [
            ("connect_timeout", self.connect_timeout),
            ("op_timeout", self.op_timeout),
            ("reconnect_interval", self.reconnect_interval),
        ] {
            if wait.is_zero() {
                return bad(key, format!("{key} must be positive"));
            }
            // A remote call waits at most this: past a day it is a mistake, and sums of such
            // durations would overflow.
            if wait > day {
                return bad(key, format!("{key} must be at most a day, got {wait:?}"));
            }
        }
        if !(1..=1024).contains(&self.max_in_flight) {
            return bad(
                "max_in_flight",
                format!("max_in_flight must be within 1..=1024, got {}", self.max_in_flight),
            );
        }
        if self.ttl.is_some_and(|t| t < Duration::from_millis(1)) {
            return bad("ttl", "ttl must be at least 1ms (or absent)".into());
        }
        // Redis takes a PX of at most i64 milliseconds; ten years is far beyond any cache's use.
        if self.ttl.is_some_and(|t| t > Duration::from_secs(10 * 365 * 24 * 3600)) {
            return bad("ttl", "ttl must be at most ten years (or absent: no expiry)".into());
        }
        if self.max_chunk_bytes == 0 || self.max_chunk_bytes > MAX_CHUNK_BYTES {
            return bad(
                "max_chunk_bytes",
                format!(
                    "max_chunk_bytes must be within 1..={MAX_CHUNK_BYTES} (a Redis value's limit, \
                     512MiB, less the value's {HEADER_BYTES}-byte header), got {}",
                    self.max_chunk_bytes
                ),
            );
        }
        if !(1..=64).contains(&self.threads) {
            return bad("threads", format!("threads must be within 1..=64, got {}", self.threads));
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
            err(RemoteConfig { key_prefix: "tierkv{a}".into(), ..good.clone() })
                .contains("hash tag")
        );
        let forever = Duration::from_secs(u64::MAX / 2 + 1);
        assert!(
            err(RemoteConfig { connect_timeout: forever, ..good.clone() })
                .contains("at most a day")
        );
        assert!(
            err(RemoteConfig { op_timeout: forever, ..good.clone() }).contains("at most a day")
        );
        assert!(err(RemoteConfig { ttl: Some(forever), ..good.clone() }).contains("ten years"));
        assert!(
            err(RemoteConfig { op_timeout: Duration::ZERO, ..good.clone() }).contains("op_timeout")
        );
        assert!(
            err(RemoteConfig { key_prefix: String::new(), ..good.clone() }).contains("key_prefix")
        );
        assert!(
            err(RemoteConfig { max_chunk_bytes: 0, ..good.clone() }).contains("max_chunk_bytes")
        );
        // A full 512 MiB chunk plus its header is past Redis's value limit.
        assert!(
            err(RemoteConfig { max_chunk_bytes: 512 << 20, ..good.clone() })
                .contains("max_chunk_bytes")
        );
        RemoteConfig { max_chunk_bytes: MAX_CHUNK_BYTES, ..good.clone() }.validate().unwrap();
        assert!(
            err(RemoteConfig { reconnect_interval: Duration::ZERO, ..good.clone() })
                .contains("reconnect_interval")
        );
        // TLS is not built in: refused at start, not failing every connection later. A password
        // in a refused URL is not repeated.
        let tls =
            err(RemoteConfig { urls: vec!["rediss://u:hunter2@h:6380".into()], ..good.clone() });
        assert!(tls.contains("TLS") && !tls.contains("hunter2"), "{tls}");
        // URLs that parse but could never connect are refused at start, secrets masked.
        let db =
            err(RemoteConfig { urls: vec!["redis://u:hunter2@h:6379/x".into()], ..good.clone() });
        assert!(db.contains("database") && !db.contains("hunter2"), "{db}");
        let seeds = vec!["redis://:a@h1:7000".to_string(), "redis://:b@h2:7000".to_string()];
        let differ = err(RemoteConfig { urls: seeds, ..good.clone() });
        assert!(differ.contains("do not agree") && differ.contains("password"), "{differ}");
        let nodes = vec!["redis://h1:7000".to_string(), "redis://h2:7000".to_string()];
        RemoteConfig { urls: nodes.clone(), ..good.clone() }.validate().unwrap();
        let one = err(RemoteConfig { urls: nodes, mode: RemoteMode::Standalone, ..good.clone() });
        assert!(one.contains("standalone") && one.contains("cluster"), "{one}");
        RemoteConfig { urls: vec!["valkey://h:6379".into()], ..good }.validate().unwrap();
    }
}
