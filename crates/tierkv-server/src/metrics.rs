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
    let mut builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full("tierkv_request_seconds".into()), LATENCY_BUCKETS)
        .map_err(|e| err(&e))?;
    if let Some(addr) = listen {
        builder = builder.with_http_listener(addr);
    }
    let (recorder, exporter) = if listen.is_some() {
        let (recorder, exporter) = builder.build().map_err(|e| err(&e))?;
        (recorder, Some(exporter))
    } else {
        (builder.build_recorder(), None)
    };
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| err(&e))?;
    if let Some(exporter) = exporter {
        tokio::spawn(async move {
            if let Err(e) = exporter.await {
                tracing::error!("the metrics endpoint stopped: {e:?}");
            }
        });
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
