//! The link to Redis: one multiplexed connection (a cluster connection, or one to a single
//! server), opened lazily, dropped when it fails, reopened at most once per reconnect interval.
//! Every call has a deadline. The link's health is what `status` reports as degraded.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue};

use crate::config::{RemoteConfig, RemoteMode};
use crate::error::CallError;

#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

struct State {
    conn: Option<Conn>,
    last_attempt: Option<Instant>,
    /// Why the tier is degraded; `None` while calls succeed.
    degraded: Option<String>,
    /// When a call last failed for the link's sake.
    last_failure: Option<Instant>,
}

pub(crate) struct Link {
    config: RemoteConfig,
    state: Mutex<State>,
    /// Serialises connection attempts, so a burst of calls opens one connection.
    connecting: tokio::sync::Mutex<()>,
}

impl Link {
    pub(crate) fn new(config: RemoteConfig) -> Self {
        Link {
            config,
            state: Mutex::new(State {
                conn: None,
                last_attempt: None,
                degraded: Some("not connected yet".into()),
                last_failure: None,
            }),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// Why the tier is degraded, if it is.
    pub(crate) fn degraded(&self) -> Option<String> {
        self.state.lock().degraded.clone()
    }

    /// Runs `cmd` within the op deadline; a failure of the link drops the connection and marks
    /// the tier degraded, a success marks it healthy.
    ///
    /// While the tier is degraded, calls fail at once (as misses) until `reconnect_interval` has
    /// passed since the last failure; then calls try again (and [`Link::probe`] tries at any
    /// time). So a hung cluster costs the op deadline once per interval, not on every lookup:
    /// the prefetch pipeline waits for every tier's answer, and must not wait for this one.
    pub(crate) async fn call<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, CallError> {
        {
            let state = self.state.lock();
            if let (Some(why), Some(failed)) = (&state.degraded, state.last_failure)
                && failed.elapsed() < self.config.reconnect_interval
            {
                return Err(CallError::Unavailable(why.clone()));
            }
        }
        self.attempt(cmd).await
    }

    /// Checks the link now (`PING`), degraded or not; whether it answered.
    pub(crate) async fn probe(&self) -> bool {
        self.attempt::<String>(&redis::cmd("PING")).await.is_ok()
    }

    async fn attempt<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, CallError> {
        let deadline = self.config.op_timeout;
        let result = match tokio::time::timeout(deadline, self.call_inner(cmd)).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Timeout(deadline)),
        };
        match &result {
            Ok(_) => {
                let mut state = self.state.lock();
                if state.degraded.is_some() {
                    tracing::info!("the remote tier answers again");
                    state.degraded = None;
                }
            }
            Err(e) if e.is_connection() => {
                let mut state = self.state.lock();
                if state.degraded.is_none() {
                    tracing::warn!(error = %e, "the remote tier is degraded: its calls are misses");
                }
                state.degraded = Some(e.to_string());
                state.last_failure = Some(Instant::now());
                // A timeout may be one slow node; anything else says the connection is broken.
                if !matches!(e, CallError::Timeout(_)) {
                    state.conn = None;
                }
            }
            Err(_) => {}
        }
        result
    }

    async fn call_inner<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, CallError> {
        match self.connection().await? {
            Conn::Single(mut c) => Ok(cmd.query_async(&mut c).await?),
            Conn::Cluster(mut c) => Ok(cmd.query_async(&mut c).await?),
        }
    }

    async fn connection(&self) -> Result<Conn, CallError> {
        if let Some(conn) = self.state.lock().conn.clone() {
            return Ok(conn);
        }
        let _one = self.connecting.lock().await;
        {
            let mut state = self.state.lock();
            if let Some(conn) = state.conn.clone() {
                return Ok(conn);
            }
            if let Some(last) = state.last_attempt
                && last.elapsed() < self.config.reconnect_interval
            {
                let why = state.degraded.clone().unwrap_or_else(|| "reconnecting".into());
                return Err(CallError::Unavailable(why));
            }
            state.last_attempt = Some(Instant::now());
        }
        let conn = match tokio::time::timeout(self.config.connect_timeout, self.open()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(CallError::Connect(e.to_string())),
            Err(_) => return Err(CallError::Timeout(self.config.connect_timeout)),
        };
        self.state.lock().conn = Some(conn.clone());
        Ok(conn)
    }

    async fn open(&self) -> redis::RedisResult<Conn> {
        let c = &self.config;
        match c.mode {
            RemoteMode::Standalone => {
                let url = c.urls.first().map(String::as_str).unwrap_or_default();
                let client = redis::Client::open(url)?;
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(c.connect_timeout))
                    .set_response_timeout(Some(c.op_timeout));
                let conn = client.get_multiplexed_async_connection_with_config(&config).await?;
                Ok(Conn::Single(conn))
            }
            RemoteMode::Cluster => {
                let client = redis::cluster::ClusterClient::builder(c.urls.clone())
                    .connection_timeout(c.connect_timeout)
                    .response_timeout(c.op_timeout)
                    .retries(3)
                    .min_retry_wait(10)
                    .max_retry_wait(c.op_timeout.as_millis().min(500) as u64)
                    .build()?;
                Ok(Conn::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// How long a caller waits at most for one call.
    pub(crate) fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }
}
