//! The daemon's own metrics (requests, sessions, bytes through the data plane) and the
//! Prometheus exporter that serves every tierkv metric.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge, describe_histogram,
    gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tierkv_proto::ErrorCode;

/// Request latency buckets, in seconds: 10 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

const OPS: &[&str] = &[
    "hello",
    "register_kv",
    "store",
    "lookup",
    "query",
    "wait",
    "retrieve",
    "release",
    "flush",
    "end_session",
    "status",
    "clear",
];

const CODES: &[(ErrorCode, &str)] = &[
    (ErrorCode::BadFrame, "bad_frame"),
    (ErrorCode::BadRequest, "bad_request"),
    (ErrorCode::VersionMismatch, "version_mismatch"),
    (ErrorCode::NoSession, "no_session"),
    (ErrorCode::Forbidden, "forbidden"),
    (ErrorCode::NamespaceNotDeclared, "namespace_not_declared"),
    (ErrorCode::BadBuffer, "bad_buffer"),
    (ErrorCode::BlockOutOfRange, "block_out_of_range"),
    (ErrorCode::UnknownLookup, "unknown_lookup"),
    (ErrorCode::Pending, "pending"),
    (ErrorCode::NotInHit, "not_in_hit"),
    (ErrorCode::ShareReturned, "share_returned"),
    (ErrorCode::Timeout, "timeout"),
    (ErrorCode::Full, "full"),
    (ErrorCode::Stopped, "stopped"),
    (ErrorCode::TooManyConnections, "too_many_connections"),
    (ErrorCode::LeaseLimit, "lease_limit"),
    (ErrorCode::Internal, "internal"),
];

/// The requests a client can give up on before the daemon carries them out.
const GIVEN_UP_OPS: &[&str] = &["lookup", "store", "retrieve"];

/// Handles to the server's metrics, registered once.
pub struct ServerMetrics {
    requests: HashMap<&'static str, (Counter, Histogram)>,
    errors: Vec<(ErrorCode, Counter)>,
    given_up: HashMap<&'static str, Counter>,
    workers: Gauge,
    store_bytes: Counter,
    retrieve_bytes: Counter,
}

impl ServerMetrics {
    /// Registers the metrics with whatever recorder is installed.
    pub fn register() -> Self {
        describe_counter!("tierkv_requests_total", Unit::Count, "Requests handled, by op.");
        describe_histogram!(
            "tierkv_request_seconds",
            Unit::Seconds,
            "Time to handle a request inside the daemon (copies included), by op."
        );
        describe_counter!(
            "tierkv_protocol_errors_total",
            Unit::Count,
            "Requests refused with an error reply, by reason."
        );
        describe_counter!(
            "tierkv_given_up_requests_total",
            Unit::Count,
            "Requests the client gave up on (its deadline passed) before the daemon carried them \
             out, which it then did not, by op."
        );
        describe_gauge!("tierkv_connected_workers", Unit::Count, "Worker sessions connected.");
        describe_counter!(
            "tierkv_data_bytes_total",
            Unit::Bytes,
            "Bytes copied between worker buffers and L1, by direction."
        );
        // Registered whatever the configuration, so the exposition (and README's table) is the
        // same with and without a remote tier: 0 where there is none.
        describe_gauge!(
            "tierkv_remote_degraded",
            Unit::Count,
            "1 while the remote tier cannot be reached: its lookups and loads are misses."
        );
        drop(gauge!("tierkv_remote_degraded"));
        ServerMetrics {
            requests: OPS
                .iter()
                .map(|op| {
                    (
                        *op,
                        (
                            counter!("tierkv_requests_total", "op" => *op),
                            histogram!("tierkv_request_seconds", "op" => *op),
                        ),
                    )
                })
                .collect(),
            errors: CODES
                .iter()
                .map(|(code, name)| {
                    (*code, counter!("tierkv_protocol_errors_total", "reason" => *name))
                })
                .collect(),
            given_up: GIVEN_UP_OPS
                .iter()
                .map(|op| (*op, counter!("tierkv_given_up_requests_total", "op" => *op)))
                .collect(),
            workers: gauge!("tierkv_connected_workers"),
            store_bytes: counter!("tierkv_data_bytes_total", "direction" => "store"),
            retrieve_bytes: counter!("tierkv_data_bytes_total", "direction" => "retrieve"),
        }
    }

    /// A request of `op` took `elapsed`.
    pub fn request(&self, op: &str, elapsed: Duration) {
        if let Some((count, latency)) = self.requests.get(op) {
            count.increment(1);
            latency.record(elapsed.as_secs_f64());
        }
    }

    /// A request was refused with `code`.
    pub fn error(&self, code: ErrorCode) {
        if let Some((_, c)) = self.errors.iter().find(|(c, _)| *c == code) {
            c.increment(1);
        }
    }

    /// The client gave up on a request of `op` before the daemon carried it out.
    pub fn given_up(&self, op: &str) {
        if let Some(c) = self.given_up.get(op) {
            c.increment(1);
        }
    }

    /// A worker session opened (`+1`) or closed (`-1`).
    pub fn worker_connected(&self, delta: f64) {
        self.workers.increment(delta);
    }

    /// Bytes copied through the data plane.
    pub fn data_bytes(&self, direction: &str, bytes: u64) {
        match direction {
            "store" => self.store_bytes.increment(bytes),
            _ => self.retrieve_bytes.increment(bytes),
        }
    }
}

/// Why the exporter could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the Prometheus exporter: {0}")]
pub struct ExporterError(String);

/// Installs the Prometheus recorder as the global one (so must run before anything registers a
/// metric) and, with `listen`, serves `/metrics` there from the current Tokio runtime.
pub fn install_exporter(listen: Option<SocketAddr>) -> Result<PrometheusHandle, ExporterError> {
    let err = |e: &dyn std::fmt::Display| ExporterError(e.to_string());
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full("tierkv_request_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| err(&e))?
        .build_recorder();
    let handle = recorder.handle();
    let listener = match listen {
        Some(addr) => Some(
            std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .and_then(tokio::net::TcpListener::from_std)
                .map_err(|e| {
                    ExporterError(format!("cannot listen on {addr} (metrics.listen): {e}"))
                })?,
        ),
        None => None,
    };
    metrics::set_global_recorder(recorder).map_err(|e| err(&e))?;
    if let Some(listener) = listener {
        tokio::spawn(serve_metrics(listener, handle.clone()));
    }
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Scrapes served at once, at most: each holds a descriptor (they are counted among the
/// daemon's reserved ones); a connection past them is closed at once.
const SCRAPES: usize = 8;
/// How long a scrape may take to send its request, and to take its answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read.
const SCRAPE_HEAD: usize = 8 << 10;

/// Serves `/metrics` on `listener`: one request a connection, within [`SCRAPE_TIMEOUT`] each
/// way, [`SCRAPES`] at once, and failed accepts (out of descriptors) backed off, so that the
/// endpoint, which may face a network, can neither stall the daemon nor use up its descriptors.
async fn serve_metrics(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(SCRAPES));
    let mut backoff = crate::daemon::AcceptBackoff::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff.succeeded();
                stream
            }
            Err(e) => {
                tokio::time::sleep(backoff.failed("the metrics endpoint", &e)).await;
                continue;
            }
        };
        let Ok(slot) = std::sync::Arc::clone(&slots).try_acquire_owned() else {
            continue; // dropped: closed at once
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tokio::time::timeout(SCRAPE_TIMEOUT, scrape(stream, &handle)).await;
        });
    }
}

/// Answers one HTTP request: `GET /metrics` gets the exposition, anything else a 404.
async fn scrape(
    mut stream: tokio::net::TcpStream,
    handle: &PrometheusHandle,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < SCRAPE_HEAD {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let mut words = line.split(|b| *b == b' ');
    let (method, target) = (words.next(), words.next());
    let path = target.map(|t| t.split(|b| *b == b'?').next().unwrap_or_default());
    let (status, kind, body) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => {
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", handle.render())
        }
        _ => ("404 Not Found", "text/plain; charset=utf-8", "only /metrics is here\n".into()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(reply.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
