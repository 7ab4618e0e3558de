//! The daemon's life: open the tiers, listen, serve sessions, and on SIGTERM or SIGINT stop in
//! order: no new connections, every request in flight answered, every session's holdings
//! returned, the pipelines drained and the disk tier synced, the socket file removed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tierkv_proto::{ErrorCode, Reply, ReplyBody, Request, RequestBody, RequestHeader};
use tierkv_storage::StorageManager;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::DaemonConfig;
use crate::conn::{Conn, Stream};
use crate::session::{Daemon, Session, Transport};

/// How long shutdown waits for connections to finish their request in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// Why the daemon could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another daemon answers on the socket.
    #[error("another daemon is already serving on {0}")]
    SocketInUse(PathBuf),
    /// A listener could not be set up.
    #[error("cannot listen on {what}: {source}")]
    Listen {
        /// The socket or address.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The tiers could not be opened.
    #[error("cannot open the storage tiers: {0}")]
    Storage(#[from] tierkv_storage::StorageError),
    /// The metrics endpoint could not start.
    #[error(transparent)]
    Exporter(#[from] crate::metrics::ExporterError),
    /// Something else of the OS failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Where a running daemon can be reached; printed once it listens.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// The Unix socket.
    pub socket: PathBuf,
    /// The TCP address, if enabled.
    pub tcp: Option<SocketAddr>,
    /// The metrics address, if enabled.
    pub metrics: Option<SocketAddr>,
}

/// Runs the daemon until `stop` resolves (the CLI passes the signals).
pub async fn serve(
    config: DaemonConfig,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let _exporter = crate::metrics::install_exporter(config.metrics.listen)?;
    let storage_config = config.storage.clone();
    let storage = tokio::task::spawn_blocking(move || StorageManager::start(storage_config))
        .await
        .map_err(|e| std::io::Error::other(format!("the storage start-up thread failed: {e}")))??;
    let daemon = Arc::new(Daemon::new(
        storage,
        config.server.token.clone(),
        config.server.max_leased_per_session,
    ));
    let unix = bind_unix(&config.server.socket)?;
    let tcp = match config.server.tcp {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Listen { what: addr.to_string(), source })?,
        ),
        None => None,
    };
    let endpoints = Endpoints {
        socket: config.server.socket.clone(),
        tcp: tcp.as_ref().and_then(|l| l.local_addr().ok()),
        metrics: config.metrics.listen,
    };
    tracing::info!(?endpoints, "tierkv is serving");

    let (shutdown_tx, shutdown) = watch::channel(false);
    let mut connections = JoinSet::new();
    let open = Arc::new(AtomicUsize::new(0));
    let limits =
        Limits { frame: config.server.max_frame_bytes, connections: config.server.max_connections };
    tokio::pin!(stop);
    loop {
        let (stream, transport) = tokio::select! {
            _ = &mut stop => break,
            accepted = unix.accept() => match accepted {
                Ok((s, _)) => (Stream::Unix(s), Transport::Unix),
                Err(e) => { tracing::warn!("accept on the Unix socket failed: {e}"); continue }
            },
            accepted = accept_tcp(tcp.as_ref()) => match accepted {
                Ok(s) => (Stream::Tcp(s), Transport::Tcp),
                Err(e) => { tracing::warn!("accept on TCP failed: {e}"); continue }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let conn = Conn::new(stream, limits.frame);
        let slot = Slot::take(&open, limits.connections);
        connections.spawn(serve_connection(
            daemon.clone(),
            conn,
            transport,
            shutdown.clone(),
            slot,
        ));
    }

    tracing::info!("stopping: no new connections; finishing requests in flight");
    drop(unix);
    drop(tcp);
    let _ = shutdown_tx.send(true);
    let drained =
        tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!("connections still busy after {DRAIN:?}; closing them");
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    let stopping = daemon.clone();
    tokio::task::spawn_blocking(move || stopping.storage().stop())
        .await
        .map_err(|e| std::io::Error::other(format!("the storage stop thread failed: {e}")))?;
    let _ = std::fs::remove_file(&config.server.socket);
    tracing::info!("stopped");
    Ok(())
}

struct Limits {
    frame: u32,
    connections: usize,
}

/// A place among the open connections; `None` when the daemon is full.
struct Slot(Option<Arc<AtomicUsize>>);

impl Slot {
    fn take(open: &Arc<AtomicUsize>, limit: usize) -> Self {
        if open.fetch_add(1, Ordering::AcqRel) < limit {
            Slot(Some(open.clone()))
        } else {
            open.fetch_sub(1, Ordering::AcqRel);
            Slot(None)
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(open) = &self.0 {
            open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

async fn accept_tcp(listener: Option<&TcpListener>) -> std::io::Result<tokio::net::TcpStream> {
    match listener {
        Some(l) => {
            let (stream, _) = l.accept().await?;
            stream.set_nodelay(true)?;
            Ok(stream)
        }
        None => std::future::pending().await,
    }
}

/// Binds the Unix socket, replacing a stale socket file but never a live daemon's.
fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::SocketInUse(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(|source| ServeError::Listen {
            what: format!("{} (removing a stale socket file)", path.display()),
            source,
        })?;
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|source| ServeError::Listen { what: parent.display().to_string(), source })?;
    }
    UnixListener::bind(path)
        .map_err(|source| ServeError::Listen { what: path.display().to_string(), source })
}

async fn serve_connection(
    daemon: Arc<Daemon>,
    mut conn: Conn,
    transport: Transport,
    mut shutdown: watch::Receiver<bool>,
    slot: Slot,
) {
    let mut out = Vec::new();
    if slot.0.is_none() {
        let refusal = ReplyBody::Error {
            code: ErrorCode::TooManyConnections,
            message: "the daemon serves server.max_connections connections already".into(),
        };
        let _ = send(&mut conn, &mut out, 0, refusal).await;
        return;
    }
    let mut session = Session::new(daemon.clone(), transport);
    loop {
        let frame = tokio::select! {
            frame = conn.next_frame() => frame,
            _ = shutdown.changed() => break,
        };
        let body = match frame {
            Ok(Some(body)) => body,
            Ok(None) => break,
            Err(e) => {
                daemon.metrics().error(ErrorCode::BadFrame);
                let reply = ReplyBody::Error { code: ErrorCode::BadFrame, message: e.to_string() };
                let _ = send(&mut conn, &mut out, 0, reply).await;
                break;
            }
        };
        let (id, request) = match tierkv_proto::decode::<Request>(&body) {
            Ok(request) => (request.id, request.body),
            Err(e) => {
                // Well-formed with an id: a request this daemon does not understand. Say so and
                // carry on. Anything else is garbage, and the stream cannot be trusted after it.
                let header = tierkv_proto::decode::<RequestHeader>(&body);
                let code = if header.is_ok() { ErrorCode::BadRequest } else { ErrorCode::BadFrame };
                daemon.metrics().error(code);
                let id = header.map(|h| h.id).unwrap_or(0);
                let reply = ReplyBody::Error { code, message: e.to_string() };
                if send(&mut conn, &mut out, id, reply).await.is_err()
                    || code == ErrorCode::BadFrame
                {
                    break;
                }
                continue;
            }
        };
        let copies = matches!(
            request,
            RequestBody::Store { .. }
                | RequestBody::Retrieve { .. }
                | RequestBody::Wait { .. }
                | RequestBody::Flush { .. }
        );
        let answer = if copies {
            // Copies and waits block; let the runtime move its other tasks off this thread.
            tokio::task::block_in_place(|| session.handle(request, &mut || conn.take_fd()))
        } else {
            session.handle(request, &mut || conn.take_fd())
        };
        if send(&mut conn, &mut out, id, answer.reply).await.is_err() || answer.close {
            break;
        }
    }
    tokio::task::block_in_place(|| session.close());
}

async fn send(conn: &mut Conn, out: &mut Vec<u8>, id: u64, body: ReplyBody) -> std::io::Result<()> {
    out.clear();
    if let Err(e) = tierkv_proto::encode(&Reply { id, body }, out) {
        tracing::error!("cannot encode a reply: {e}");
        out.clear();
        let fallback = ReplyBody::Error { code: ErrorCode::Internal, message: e.to_string() };
        tierkv_proto::encode(&Reply { id, body: fallback }, out)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    conn.send(out).await
}
