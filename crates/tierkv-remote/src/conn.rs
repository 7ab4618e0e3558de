//! The link to Redis: one multiplexed connection (a cluster connection, or one to a single
//! server), opened lazily, dropped when it fails, reopened at most once per reconnect interval.
//! Every call has a deadline. The link's health is what `status` reports as degraded.

use std::sync::Arc;
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
    /// A connection is being opened (by a task of its own).
    connecting: bool,
    /// Why the last attempt to open a connection failed.
    connect_error: Option<String>,
    /// Why the tier is degraded; `None` while calls succeed.
    degraded: Option<String>,
    /// When a call last failed for the link's sake.
    last_failure: Option<Instant>,
}

pub(crate) struct Link {
    config: RemoteConfig,
    state: Arc<Mutex<State>>,
    /// Bumped each time an attempt to open a connection ends, for the calls waiting on it.
    opened: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Link {
    pub(crate) fn new(config: RemoteConfig) -> Self {
        Link {
            config,
            state: Arc::new(Mutex::new(State {
                conn: None,
                last_attempt: None,
                connecting: false,
                connect_error: None,
                degraded: Some("not connected yet".into()),
                last_failure: None,
            })),
            opened: Arc::new(tokio::sync::watch::channel(0).0),
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
            // A call refused while the link reconnects says nothing new: the reason stays the
            // failure that degraded it.
            Err(CallError::Unavailable(_)) => {}
            Err(e) if e.is_connection() => {
                let mut state = self.state.lock();
                if state.degraded.is_none() {
                    tracing::warn!(error = %e, "the remote tier is degraded: its calls are misses");
                }
                state.degraded = Some(e.to_string());
                state.last_failure = Some(Instant::now());
                // The connection goes, a timeout's too: a hung master never answers the cluster
                // client, which then keeps routing its slots to it after its replica took over.
                // The next connection learns the slot map afresh.
                state.conn = None;
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

    /// The connection, opening one if there is none. The opening runs as a task of its own, so
    /// a caller's deadline cannot cut it short (a cluster connection connects to every seed node
    /// at once, and a hung seed takes its whole connect timeout): callers wait for it within
    /// their own deadline, and at most one attempt starts per reconnect interval.
    async fn connection(&self) -> Result<Conn, CallError> {
        if let Some(conn) = self.state.lock().conn.clone() {
            return Ok(conn);
        }
        // Subscribed before the state is read again, so an attempt that ends in between is seen.
        let mut opened = self.opened.subscribe();
        {
            let mut state = self.state.lock();
            if let Some(conn) = state.conn.clone() {
                return Ok(conn);
            }
            if !state.connecting {
                if let Some(last) = state.last_attempt
                    && last.elapsed() < self.config.reconnect_interval
                {
                    let why = state.connect_error.clone().unwrap_or_else(|| "reconnecting".into());
                    return Err(CallError::Unavailable(why));
                }
                state.connecting = true;
                state.last_attempt = Some(Instant::now());
                self.start_opening();
            }
        }
        // Wait for the attempt under way (the caller's deadline bounds the wait).
        let _ = opened.changed().await;
        let state = self.state.lock();
        match (&state.conn, &state.connect_error) {
            (Some(conn), _) => Ok(conn.clone()),
            (None, Some(why)) => Err(CallError::Connect(why.clone())),
            (None, None) => Err(CallError::Unavailable("reconnecting".into())),
        }
    }

    fn start_opening(&self) {
        let (config, state, opened) =
            (self.config.clone(), Arc::clone(&self.state), Arc::clone(&self.opened));
        tokio::spawn(async move {
            // Every seed within the connect timeout, then the slot map (a call).
            let limit = config.connect_timeout * 2 + config.op_timeout;
            let result = match tokio::time::timeout(limit, open(&config)).await {
                Ok(Ok(conn)) => Ok(conn),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no connection within {limit:?}")),
            };
            {
                let mut state = state.lock();
                state.connecting = false;
                match result {
                    Ok(conn) => {
                        state.conn = Some(conn);
                        state.connect_error = None;
                    }
                    Err(why) => state.connect_error = Some(why),
                }
            }
            opened.send_modify(|n| *n += 1);
        });
    }
}

/// Opens a connection as `c` says.
async fn open(c: &RemoteConfig) -> redis::RedisResult<Conn> {
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

impl Link {
    /// How long a caller waits at most for one call.
    pub(crate) fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }
}
