//! The daemon's life: open the tiers, listen, serve sessions, and on SIGTERM or SIGINT stop in
//! order: no new connections, every request in flight answered, every session's holdings
//! returned, the pipelines drained and the disk tier synced, the socket file removed.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tierkv_disk::DiskError;
use tierkv_l1::{DeviceError, L1Error};
use tierkv_l2::L2Error;
use tierkv_proto::{ErrorCode, Reply, ReplyBody, Request, RequestBody, RequestHeader};
use tierkv_storage::{LookupId, StorageError, StorageManager};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::DaemonConfig;
use crate::conn::{Conn, Stream};
use crate::session::{Daemon, Session, Transport};

/// How long shutdown waits for connections to finish their request in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// The slowest retry of a failing accept: the bound of the back-off.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// The first retry of a failing accept; each further failure doubles the wait.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Accept failures are logged at most once per this interval (with a count of the rest).
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// How long a connection refused past `max_connections` is read and dropped before it closes (so
/// the refusal is not overtaken by a reset); short, since it holds a descriptor meanwhile.
const REFUSAL_LINGER: Duration = Duration::from_millis(200);
/// Connections refused past `max_connections` lingering at once, at most: no connection slot
/// counts their descriptors (they are among the [`RESERVED_FDS`]), so a flood of connections
/// would otherwise hold one each for [`REFUSAL_LINGER`] and could take every descriptor the
/// daemon has. Past them a refusal closes as soon as it is sent.
const MAX_LINGERING_REFUSALS: usize = 16;
/// Descriptors the daemon keeps for itself beside its connections: the runtime, listeners,
/// the metrics endpoint, logs, descriptors riding on frames, a refused connection's own.
/// The disk tier's segment files are counted on top.
const RESERVED_FDS: u64 = 64;
/// A store or retrieve that moves at most this many bytes runs on the runtime thread that read
/// it: handing that thread's other tasks to another thread first (`block_in_place`, a thread
/// wake-up) costs about as long as copying this much (~50 µs), so below it the hand-off would
/// cost the request more than it spares the connections that share the thread. Measured in
/// the 64 KiB replay (issue 13): 0.48-0.72 of memcpy with it, 0.39-0.53 handing off every copy.
const INLINE_COPY_BYTES: u64 = 1 << 20;

/// The most chunks a lookup may name and still run on the runtime thread that read it (its
/// release too). A lookup costs a lease per L1 hit and a plan for the rest, under a microsecond
/// a chunk: this many is a few hundred microseconds, about the hand-off's cost several times
/// over. A frame may name a million chunks, seconds of work, which inline would hold up every
/// connection that shares the thread.
const INLINE_LOOKUP_CHUNKS: usize = 1024;

/// Why the daemon could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another daemon answers on the socket.
    #[error(
        "another tierkv daemon is serving on {0}; stop it first, or give this one another server.socket"
    )]
    SocketInUse(PathBuf),
    /// The socket path holds something that is not a socket.
    #[error(
        "{} is {what}, not a socket; refusing to replace it (remove it, or choose another \
         server.socket)",
        path.display()
    )]
    NotASocket {
        /// The path.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// The descriptor limit leaves no room for connections.
    #[error(
        "the limit on open files (RLIMIT_NOFILE, {limit}) leaves no room for connections: the \
         daemon keeps {reserved} for itself, {disk_files} of them the disk tier's segment files \
         (one per 4 GiB of disk.capacity); raise it (ulimit -n, LimitNOFILE= in systemd), or \
         lower disk.capacity"
    )]
    FdLimit {
        /// The limit.
        limit: u64,
        /// What the daemon needs beside connections.
        reserved: u64,
        /// The disk tier's segment files among `reserved`.
        disk_files: u64,
    },
    /// A listener could not be set up.
    #[error("cannot listen on {what}: {source}")]
    Listen {
        /// The socket or address.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// The tiers could not be opened.
    #[error("cannot open the storage tiers{}: {source}", keys.map(|k| format!(" (check {k})")).unwrap_or_default())]
    Storage {
        /// The configuration keys behind the failure, where the error tells them.
        keys: Option<&'static str>,
        /// Why.
        source: StorageError,
    },
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
    mut config: DaemonConfig,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    // Before anything binds: a second daemon on the same socket would otherwise fail on the
    // metrics port, with a message about the port.
    check_socket(&config.server.socket)?;
    config.server.max_connections = fit_connections(&config)?;
    let _exporter = crate::metrics::install_exporter(config.metrics.listen)?;
    // Bound before the tiers open (seconds, a disk scan): a port another process holds fails the
    // start at once, and before the Unix socket is bound, which would otherwise be left behind.
    // It listens only once they are open: a client that connected meanwhile would wait unheard
    // in the backlog, where it is now refused at once.
    let tcp_listen_error = |addr: SocketAddr| {
        move |source| ServeError::Listen { what: format!("{addr} (server.tcp)"), source }
    };
    let tcp = match config.server.tcp {
        Some(addr) => Some((addr, bind_tcp(addr).map_err(tcp_listen_error(addr))?)),
        None => None,
    };
    let storage_config = config.storage.clone();
    let storage = tokio::task::spawn_blocking(move || StorageManager::start(storage_config))
        .await
        .map_err(|e| std::io::Error::other(format!("the storage start-up thread failed: {e}")))?
        .map_err(|source| ServeError::Storage { keys: keys_behind(&source), source })?;
    let daemon = Arc::new(Daemon::new(
        storage,
        config.server.token.clone(),
        config.server.max_leased_per_session,
    ));
    let tcp = match tcp {
        Some((addr, socket)) => Some(socket.listen(1024).map_err(tcp_listen_error(addr))?),
        None => None,
    };
    let unix = bind_unix(&config.server.socket, config.server.socket_group)?;
    let bound = file_id(&config.server.socket);
    let endpoints = Endpoints {
        socket: config.server.socket.clone(),
        tcp: tcp.as_ref().and_then(|l| l.local_addr().ok()),
        metrics: config.metrics.listen,
    };
    tracing::info!(?endpoints, "tierkv is serving");

    let (shutdown_tx, shutdown) = watch::channel(false);
    let mut connections = JoinSet::new();
    let (open, open_tcp) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let lingering = Arc::new(AtomicUsize::new(0));
    let limits = Limits {
        frame: config.server.max_frame_bytes,
        connections: config.server.max_connections,
        tcp: tcp_connections(config.server.max_connections),
        hello: config.server.hello_timeout,
    };
    let mut backoff = AcceptBackoff::default();
    tokio::pin!(stop);
    loop {
        let failed = tokio::select! {
            _ = &mut stop => break,
            accepted = unix.accept() => match accepted {
                Ok((s, _)) => Ok((Stream::Unix(s), Transport::Unix)),
                Err(e) => Err(("the Unix socket", e)),
            },
            accepted = accept_tcp(tcp.as_ref()) => match accepted {
                Ok(s) => Ok((Stream::Tcp(s), Transport::Tcp)),
                Err(e) => Err(("TCP", e)),
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, transport) = match failed {
            Ok(accepted) => {
                backoff.succeeded();
                accepted
            }
            Err((listener, e)) => {
                // Out of descriptors, an accept fails at once, every time: retrying without a
                // pause would spin a core and flood the log. Wait, still answering a stop.
                let pause = backoff.failed(listener, &e);
                tokio::select! {
                    _ = &mut stop => break,
                    _ = tokio::time::sleep(pause) => continue,
                }
            }
        };
        let conn = Conn::new(stream, limits.frame);
        let slot = match transport {
            Transport::Unix => Slot::take(&[(&open, limits.connections)]),
            Transport::Tcp => Slot::take(&[(&open, limits.connections), (&open_tcp, limits.tcp)]),
        };
        if slot.0.is_none() {
            connections.spawn(refuse(daemon.clone(), conn, lingering.clone(), REFUSAL_LINGER));
            continue;
        }
        connections.spawn(serve_connection(
            daemon.clone(),
            conn,
            (transport, limits.hello),
            shutdown.clone(),
            slot,
        ));
    }

    tracing::info!("stopping: no new connections; finishing requests in flight");
    drop(unix);
    // At once, not after the stop (up to a minute): a daemon started meanwhile on the same
    // path finds this socket refusing, replaces it as stale, and would lose its own here.
    remove_if_same(&config.server.socket, bound);
    drop(tcp);
    let _ = shutdown_tx.send(true);
    let drained =
        tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!("connections still busy after {DRAIN:?}; closing them");
        connections.abort_all();
        // A request blocked inside a tier cannot be aborted: it is not waited for past a
        // moment, and the storage's stop below ends what it waits on.
        let aborted = tokio::time::timeout(Duration::from_secs(1), async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if aborted.is_err() {
            tracing::warn!("requests still blocked in the tiers; stopping without them");
        }
    }
    let stopping = daemon.clone();
    tokio::task::spawn_blocking(move || stopping.storage().stop())
        .await
        .map_err(|e| std::io::Error::other(format!("the storage stop thread failed: {e}")))?;
    tracing::info!("stopped");
    Ok(())
}

struct Limits {
    frame: u32,
    connections: usize,
    /// Of `connections`, how many TCP may hold ([`tcp_connections`]).
    tcp: usize,
    /// How long a connection may take to say hello.
    hello: Duration,
}

/// The pause after failed accepts: doubling from [`ACCEPT_BACKOFF_MIN`] to
/// [`ACCEPT_BACKOFF_MAX`], and a log line at most every [`ACCEPT_LOG_INTERVAL`].
#[derive(Default)]
pub(crate) struct AcceptBackoff {
    pause: Duration,
    /// Failures since the last log line.
    unlogged: u64,
    /// Failures since the last success.
    failures: u64,
    logged: Option<Instant>,
}

impl AcceptBackoff {
    /// Counts a failure; returns how long to wait before accepting again.
    pub(crate) fn failed(&mut self, listener: &str, e: &std::io::Error) -> Duration {
        self.failures += 1;
        self.unlogged += 1;
        self.pause = (self.pause * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
        if self.logged.is_none_or(|at| at.elapsed() >= ACCEPT_LOG_INTERVAL) {
            let hint = match e.raw_os_error() {
                Some(libc::EMFILE | libc::ENFILE) => {
                    " (out of file descriptors: lower server.max_connections or raise the limit)"
                }
                _ => "",
            };
            tracing::warn!(
                "accept on {listener} failed {} time(s) since the last report: {e}{hint}; \
                 retrying every {:?} at most",
                self.unlogged,
                ACCEPT_BACKOFF_MAX
            );
            self.unlogged = 0;
            self.logged = Some(Instant::now());
        }
        self.pause
    }

    /// An accept worked: back to full speed.
    pub(crate) fn succeeded(&mut self) {
        if self.failures > 0 {
            tracing::info!("accepting connections again after {} failed accept(s)", self.failures);
            *self = AcceptBackoff::default();
        }
    }
}

/// The configuration keys to look at when the tiers fail to open with `error`: those the error
/// itself does not name (a disk path or a remote URL it does).
fn keys_behind(error: &StorageError) -> Option<&'static str> {
    match error {
        StorageError::L1(L1Error::Device(DeviceError::CudaUnavailable(_))) => {
            Some("l1.device and l1.cuda_device")
        }
        StorageError::L1(L1Error::Device(DeviceError::Alloc { .. })) => {
            Some("l1.capacity and l1.device")
        }
        StorageError::L2(L2Error::Memory { .. }) => Some("l2.memory and l2.capacity"),
        StorageError::Disk(DiskError::Io { .. }) => Some("disk.dir"),
        _ => None,
    }
}

/// What the configuration asks of the descriptor limit: `server.max_connections`, lowered
/// (with a warning) to what `RLIMIT_NOFILE` leaves after the daemon's own descriptors. The soft
/// limit is raised to the hard one first.
fn fit_connections(config: &DaemonConfig) -> Result<usize, ServeError> {
    let wanted = config.server.max_connections;
    let disk_files = config.storage.disk.as_ref().map_or(0, tierkv_disk::DiskStoreConfig::files);
    let reserved = RESERVED_FDS + disk_files;
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(
            "cannot read the limit on open files: {}; assuming it fits",
            std::io::Error::last_os_error()
        );
        return Ok(wanted);
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    let available = limit.rlim_cur.saturating_sub(reserved);
    if available == 0 {
        return Err(ServeError::FdLimit { limit: limit.rlim_cur, reserved, disk_files });
    }
    let fits = usize::try_from(available).unwrap_or(usize::MAX);
    if fits < wanted {
        tracing::warn!(
            "server.max_connections lowered from {wanted} to {fits}: the limit on open files \
             (RLIMIT_NOFILE) is {}, and the daemon keeps {reserved} for itself; raise the limit \
             (ulimit -n, LimitNOFILE= in systemd) to serve {wanted}",
            limit.rlim_cur
        );
        return Ok(fits);
    }
    Ok(wanted)
}

/// The TCP connections served at once, out of `max_connections`: a quarter (at least one).
/// Anyone who can reach the port may open connections before it shows the token, each holding
/// its place for `hello_timeout`; with a share of its own TCP can never fill the places the
/// node's own workers connect to over the Unix socket.
fn tcp_connections(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}

/// A place among the open connections, and among those of its transport's share: counted in
/// each of its counts; `None` when any of them was full.
struct Slot(Option<Vec<Arc<AtomicUsize>>>);

impl Slot {
    /// Takes a place in every `(count, limit)`, or in none.
    fn take(counts: &[(&Arc<AtomicUsize>, usize)]) -> Self {
        let mut taken: Vec<Arc<AtomicUsize>> = Vec::with_capacity(counts.len());
        for &(open, limit) in counts {
            if open.fetch_add(1, Ordering::AcqRel) >= limit {
                open.fetch_sub(1, Ordering::AcqRel);
                for count in taken {
                    count.fetch_sub(1, Ordering::AcqRel);
                }
                return Slot(None);
            }
            taken.push(Arc::clone(open));
        }
        Slot(Some(taken))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        for open in self.0.iter().flatten() {
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

/// Refuses a socket path that a live daemon answers on, or that holds anything but a socket.
/// A socket nobody answers on is stale: [`bind_unix`] replaces it.
fn check_socket(path: &Path) -> Result<(), ServeError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServeError::Listen { what: path.display().to_string(), source });
        }
    };
    let kind = meta.file_type();
    if !kind.is_socket() {
        let what = if kind.is_file() {
            "a regular file"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_symlink() {
            "a symbolic link"
        } else if kind.is_fifo() {
            "a FIFO"
        } else {
            "a device or other special file"
        };
        return Err(ServeError::NotASocket { path: path.to_path_buf(), what });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(ServeError::SocketInUse(path.to_path_buf())),
        // Nobody listens there: a stale socket, left by a daemon that did not stop cleanly.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        // Anything else (a socket this user may not connect to, say) may be a live daemon's:
        // it is not removed.
        Err(source) => Err(ServeError::Listen {
            what: format!("{} (an existing socket, which may be in use)", path.display()),
            source,
        }),
    }
}

/// Binds the Unix socket, replacing a stale socket file but nothing else. The socket is `0600`,
/// or `0660` and owned by `group`: only they may connect (and `clear` needs the token besides).
/// The file at `path` (not following a symlink): device, inode, and change time, since a file
/// made after another is removed may get its inode number.
type FileId = (u64, u64, i64, i64);

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Removes the file at `path` if it is still the one `bound` names: another daemon's socket
/// bound there since is left alone. (One whose mode or owner an admin changed since counts as
/// another: left behind, it is a stale socket, which the next daemon replaces.)
fn remove_if_same(path: &Path, bound: Option<FileId>) {
    if bound.is_some() && file_id(path) == bound {
        let _ = std::fs::remove_file(path);
    }
}

/// A TCP socket bound to `addr`, not yet listening (`SO_REUSEADDR`, as a listener binds).
fn bind_tcp(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

fn bind_unix(path: &Path, group: Option<u32>) -> Result<UnixListener, ServeError> {
    check_socket(path)?;
    if std::fs::symlink_metadata(path).is_ok() {
        std::fs::remove_file(path).map_err(|source| ServeError::Listen {
            what: format!("{} (removing a stale socket file)", path.display()),
            source,
        })?;
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|source| ServeError::Listen { what: parent.display().to_string(), source })?;
    }
    let listen = |source| ServeError::Listen { what: path.display().to_string(), source };
    // The socket is created with the umask's mode; make that owner-only, so nobody else can
    // connect in the moment before its mode is set.
    // SAFETY: umask only swaps the process's file creation mask.
    let umask = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(umask) };
    let listener = bound.map_err(listen)?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let owned = match group {
        Some(gid) => std::os::unix::fs::lchown(path, None, Some(gid)),
        None => Ok(()),
    };
    if let Err(source) = owned.and_then(|()| chmod_no_follow(path, mode)) {
        // The daemon does not start: the socket file it bound a moment ago is not left behind
        // (unlinked, so a symlink put in its place is removed, never what it points to).
        drop(listener);
        let _ = std::fs::remove_file(path);
        return Err(listen(source));
    }
    Ok(listener)
}

/// Sets `path`'s mode without following a symlink, as `lchown` does: a path swapped for a
/// symlink since the bind (in a directory others may write) is refused, not the file it points
/// to chmodded.
fn chmod_no_follow(path: &Path, mode: libc::mode_t) -> std::io::Result<()> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a NUL-terminated path and plain flags; fchmodat only reads them.
    let changed =
        unsafe { libc::fchmodat(libc::AT_FDCWD, c_path.as_ptr(), mode, libc::AT_SYMLINK_NOFOLLOW) };
    if changed == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Answers a connection past `server.max_connections` with `too_many_connections` and closes
/// it: lingering for `linger` ([`Conn::close_after_reply`]) while it holds a place among the
/// [`MAX_LINGERING_REFUSALS`] counted in `lingering`, at once without one.
async fn refuse(
    daemon: Arc<Daemon>,
    mut conn: Conn,
    lingering: Arc<AtomicUsize>,
    linger: Duration,
) {
    daemon.metrics().error(ErrorCode::TooManyConnections);
    let refusal = ReplyBody::Error {
        code: ErrorCode::TooManyConnections,
        message: "the daemon serves server.max_connections connections already".into(),
    };
    let _ = send(&mut conn, &mut Vec::new(), 0, refusal).await;
    let place = Slot::take(&[(&lingering, MAX_LINGERING_REFUSALS)]);
    if place.0.is_some() {
        conn.close_after_reply(linger).await;
    }
}

/// Serves one connection, holding its place among the open connections (`_slot`) until it is
/// closed.
async fn serve_connection(
    daemon: Arc<Daemon>,
    mut conn: Conn,
    (transport, hello_timeout): (Transport, Duration),
    mut shutdown: watch::Receiver<bool>,
    _slot: Slot,
) {
    let mut out = Vec::new();
    let mut session = Session::new(daemon.clone(), transport);
    let peer = conn.peer();
    // No chunk is larger than a slot, so this many chunks copy at most INLINE_COPY_BYTES.
    let inline_chunks = INLINE_COPY_BYTES / daemon.storage().l1().usage().slot_bytes.max(1);
    // Until it says hello, a connection is anyone's: it holds a connection slot, so it must say
    // it soon, and its frames are kept small (`Conn::hello_said`).
    let hello_by = tokio::time::Instant::now() + hello_timeout;
    // Whether the connection closes after a final reply (a refusal, `bye`): then it lingers, so
    // what the client sent meanwhile does not make the kernel reset the reply away.
    let linger = loop {
        // Descriptors the last frame brought and did not use are closed, not left for the next.
        conn.drop_used_fds();
        let frame = tokio::select! {
            frame = conn.next_frame() => frame,
            _ = shutdown.changed() => break false,
            _ = tokio::time::sleep_until(hello_by), if !session.said_hello() => {
                daemon.metrics().error(ErrorCode::Timeout);
                let refusal = ReplyBody::Error {
                    code: ErrorCode::Timeout,
                    message: format!(
                        "no hello within {hello_timeout:?} of connecting \
                         (server.hello_timeout); the connection is closed"
                    ),
                };
                let _ = send(&mut conn, &mut out, 0, refusal).await;
                tokio::task::block_in_place(|| session.close());
                conn.close_after_reply(REFUSAL_LINGER).await;
                return;
            }
        };
        // Before the hello, a reply must be taken by the hello's deadline too: a client that
        // sends requests and never reads the answers would otherwise hold its slot for good.
        let send_by = (!session.said_hello()).then_some(hello_by);
        let body = match frame {
            Ok(Some(body)) => body,
            Ok(None) => break false,
            Err(e) => {
                daemon.metrics().error(ErrorCode::BadFrame);
                let reply = ReplyBody::Error { code: ErrorCode::BadFrame, message: e.to_string() };
                break send_before(&mut conn, &mut out, 0, reply, send_by).await.is_ok();
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
                let sent = send_before(&mut conn, &mut out, id, reply, send_by).await.is_ok();
                if !sent || code == ErrorCode::BadFrame {
                    break sent;
                }
                continue;
            }
        };
        // A small copy runs inline, unless it may wait: a store while the store pipeline has
        // copies that hold L1 shares (backpressure) or behind the engine's CUDA event (its kernels may
        // still be writing the blocks), a retrieve of a lookup with chunks held below L1 (loaded
        // from their tier). A registration maps the worker's memory, populating the page tables
        // of a buffer of any size: it may take seconds. So may a lookup of a million chunks.
        let storage = daemon.storage();
        let blocks = match &request {
            RequestBody::Store { chunks, ready_event, .. } => {
                chunks.len() as u64 > inline_chunks
                    || ready_event.is_some()
                    || storage.store_may_wait()
            }
            RequestBody::RegisterKv { .. } => true,
            RequestBody::Lookup { chunks, .. } => chunks.len() > INLINE_LOOKUP_CHUNKS,
            // Returns a share of each chunk of the hit: as long as the lookup, nearly.
            RequestBody::Release { lookup } => daemon.lookup_chunks(*lookup) > INLINE_LOOKUP_CHUNKS,
            RequestBody::Retrieve { lookup, chunks, .. } => {
                // Not `holds_below`: the lookup may complete (with chunks below L1) between
                // this answer and the retrieve's own, which would then read a tier here.
                chunks.len() as u64 > inline_chunks || storage.may_read_below(LookupId(*lookup))
            }
            // A clear marks every record on disk deleted: a write per record, a sync per file.
            RequestBody::Wait { .. } | RequestBody::Flush { .. } | RequestBody::Clear => true,
            // Returns every lease and reservation, unmaps the buffers (the worker's whole KV)
            // and closes its CUDA regions after their copies: as long as a disconnect's close.
            RequestBody::EndSession => true,
            _ => false,
        };
        let answer = if blocks {
            // Long copies and waits block; let the runtime move its other tasks off this thread.
            tokio::task::block_in_place(|| session.handle(request, &mut || conn.take_fd(), peer))
        } else {
            // Decided on what the request looked like a moment ago: should it find it must wait
            // after all (the store pipeline turned busy meanwhile), it refuses instead.
            session.handle(request, &mut || conn.take_fd(), peer.inline())
        };
        if session.said_hello() {
            conn.hello_said();
        }
        let sent = send_before(&mut conn, &mut out, id, answer.reply, send_by).await.is_ok();
        if !sent || answer.close {
            break sent;
        }
    };
    tokio::task::block_in_place(|| session.close());
    if linger {
        // Holding its connection slot meanwhile: `server.max_connections` bounds these.
        conn.close_after_reply(REFUSAL_LINGER).await;
    }
}

/// [`send`], given up (an error) if it has not gone by `deadline`, where there is one.
async fn send_before(
    conn: &mut Conn,
    out: &mut Vec<u8>,
    id: u64,
    body: ReplyBody,
    deadline: Option<tokio::time::Instant>,
) -> std::io::Result<()> {
    match deadline {
        None => send(conn, out, id, body).await,
        Some(deadline) => tokio::time::timeout_at(deadline, send(conn, out, id, body))
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    /// A frame over the limit, sent over TCP whole (as a client sends it) before its reply is
    /// read: the daemon reads the rest and drops it before it closes, so the client's write
    /// completes and it reads `bad_frame`, where a close with the frame unread would reset the
    /// connection under it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oversized_frame_over_tcp_gets_its_bad_frame_reply_and_no_reset() {
        use std::io::Write;
        // Past what loopback holds between the two ends (the client's send buffer, pinned small
        // here, the daemon's 128 KiB receive buffer while it reads nothing, and its one read),
        // so the daemon closes before it is all sent; and little enough to drain in a moment.
        const SENT: usize = 2 << 20;
        let daemon = Daemon::small(64 << 10);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(64 << 10).unwrap();
        let client = socket.connect(listener.local_addr().unwrap()).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let mut client = client.into_std().unwrap();
        client.set_nonblocking(false).unwrap();
        let client = tokio::task::spawn_blocking(move || {
            client.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            client.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut frame = ((SENT - 4) as u32).to_le_bytes().to_vec();
            frame.resize(SENT, 0);
            let written = client.write_all(&frame);
            (written, tierkv_proto::read_frame(&mut client, 1 << 20))
        });
        let conn = Conn::new(Stream::Tcp(stream), 1 << 20);
        let (_stop, shutdown) = watch::channel(false);
        let open = Arc::new(AtomicUsize::new(0));
        let slot = Slot::take(&[(&open, 1)]);
        let hello = Duration::from_secs(10);
        serve_connection(daemon, conn, (Transport::Tcp, hello), shutdown, slot).await;
        let (written, reply) = client.await.unwrap();
        written.expect("the frame was sent whole");
        let reply: Reply = tierkv_proto::decode(&reply.unwrap().unwrap()).unwrap();
        assert!(
            matches!(reply.body, ReplyBody::Error { code: ErrorCode::BadFrame, .. }),
            "{reply:?}"
        );
    }

    /// A flood of connections past `server.max_connections`: each gets its refusal, but no more
    /// than [`MAX_LINGERING_REFUSALS`] linger at once (each holds a descriptor no connection
    /// slot counts); the rest are closed as soon as their refusal is sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refusals_past_max_connections_linger_a_few_at_a_time() {
        const FLOOD: usize = MAX_LINGERING_REFUSALS + 8;
        let daemon = Daemon::small(64 << 10);
        let lingering = Arc::new(AtomicUsize::new(0));
        let (mut clients, mut refusals) = (Vec::new(), JoinSet::new());
        for _ in 0..FLOOD {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            ours.set_nonblocking(true).unwrap();
            theirs.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let conn =
                Conn::new(Stream::Unix(tokio::net::UnixStream::from_std(ours).unwrap()), 1024);
            // Lingering far longer than the test: a refusal still lingering is seen so.
            let linger = Duration::from_secs(600);
            refusals.spawn(refuse(daemon.clone(), conn, lingering.clone(), linger));
            clients.push(theirs);
        }
        for client in &mut clients {
            let reply: Reply =
                tierkv_proto::decode(&tierkv_proto::read_frame(client, 1024).unwrap().unwrap())
                    .unwrap();
            assert!(matches!(
                reply.body,
                ReplyBody::Error { code: ErrorCode::TooManyConnections, .. }
            ));
        }
        // Closed by the daemon: both directions down (`POLLHUP`), where a lingering refusal has
        // shut only its writing side.
        let closed = |clients: &[std::os::unix::net::UnixStream]| {
            clients
                .iter()
                .filter(|c| {
                    use std::os::fd::AsRawFd;
                    let mut probe = libc::pollfd { fd: c.as_raw_fd(), events: 0, revents: 0 };
                    // SAFETY: one valid pollfd, no wait.
                    unsafe {
                        libc::poll(&mut probe, 1, 0) == 1 && probe.revents & libc::POLLHUP != 0
                    }
                })
                .count()
        };
        tierkv_testkit::eventually("the refusals past the lingering ones are closed", || {
            closed(&clients) >= FLOOD - MAX_LINGERING_REFUSALS
        });
        assert_eq!(closed(&clients), FLOOD - MAX_LINGERING_REFUSALS, "too few linger");
        // The clients leave: the lingering ones end, and give their places back.
        drop(clients);
        while refusals.join_next().await.is_some() {}
        assert_eq!(lingering.load(Ordering::Acquire), 0);
    }

    #[test]
    fn the_sockets_mode_is_set_on_the_path_itself_never_through_a_symlink() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("someone-elses");
        std::fs::write(&target, b"").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        let link = dir.path().join("tierkv.sock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(chmod_no_follow(&link, 0o600).is_err(), "a symlink is refused");
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "the file it points to is untouched");
        chmod_no_follow(&target, 0o600).unwrap();
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_stopping_daemon_removes_its_own_socket_and_not_one_bound_since() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tierkv.sock");
        let ours = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let bound = file_id(&path);
        // Another daemon found it refusing, removed it as stale and bound its own.
        drop(ours);
        std::fs::remove_file(&path).unwrap();
        let theirs = std::os::unix::net::UnixListener::bind(&path).unwrap();
        remove_if_same(&path, bound);
        assert!(path.exists(), "the other daemon's socket was removed");
        remove_if_same(&path, file_id(&path));
        assert!(!path.exists());
        drop(theirs);
    }
}
