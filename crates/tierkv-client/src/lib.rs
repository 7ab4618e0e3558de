//! tierkv-client: a blocking session with the tierkv daemon.
//!
//! A [`Client`] opens a session (the hello), registers [`SharedBuffer`]s (the memfd travels over
//! the Unix socket as `SCM_RIGHTS`), and then stores, looks up and retrieves chunks by naming
//! blocks of those buffers. The daemon answers a connection's requests in order, so a client may
//! keep several in flight ([`Client::submit`], [`Client::submit_store`]) and collect each reply
//! by its request id later: stores then go without waiting for the daemon's copy, and a worker
//! fills its next blocks while the daemon copies the last ones. At most
//! [`Client::MAX_IN_FLIGHT`] requests are in flight; a submit past that first reads the oldest
//! reply (and keeps it for its collector). Everything the session holds is returned by the
//! daemon when the client ends or disconnects.
//!
//! On the Unix socket the client checks who listens there (`SO_PEERCRED`) right after
//! connecting, before it sends anything: the daemon must run as the client's own effective user,
//! as root, or as a user named in [`UnixOptions::daemon_uids`]. Any local user may bind a socket
//! at a path in a world-writable directory such as `/tmp` (the default's) before the daemon does;
//! the hello, a token and the memfd of the KV memory must never reach such a listener, so
//! anything else is refused with [`ClientError::UntrustedDaemon`].

pub mod payload;
mod shm;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use shm::{SharedBuffer, memfd};
pub use tierkv_proto as proto;
use tierkv_proto::{
    ChunkBlocks, ChunkId, ErrorCode, FrameError, Hello, KvLayout, LookupOutcome, PROTOCOL_VERSION,
    RegionSource, Reply, ReplyBody, Request, RequestBody, Segment, StatusReport,
};

/// Replies larger than this are refused (a status with thousands of sessions still fits).
const REPLY_LIMIT: u32 = 64 << 20;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed.
    #[error("i/o error talking to the daemon: {0}")]
    Io(#[from] io::Error),
    /// A frame could not be read or written.
    #[error("protocol error: {0}")]
    Frame(#[from] FrameError),
    /// The daemon answered with an error.
    #[error("daemon refused the request ({code:?}): {message}")]
    Daemon {
        /// What kind of failure.
        code: ErrorCode,
        /// The daemon's words.
        message: String,
    },
    /// The daemon answered something that does not fit the request.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// The daemon closed the connection.
    #[error("the daemon closed the connection")]
    Closed,
    /// The socket took the connection but nothing answered the hello in time: a daemon that
    /// is stopped or stuck, or a listener that is not a daemon.
    #[error("no daemon answered on {} within {seconds} s", path.display())]
    NoAnswer {
        /// The socket.
        path: PathBuf,
        /// The timeout, in seconds.
        seconds: f64,
    },
    /// Nothing answered at `host:port` over TCP in time ([`Client::connect_tcp_within`]): the
    /// name lookup, the connect or the hello missed the timeout.
    #[error("no daemon answered at {addr} within {seconds} s")]
    NoTcpAnswer {
        /// The host and port, as given.
        addr: String,
        /// The timeout, in seconds.
        seconds: f64,
    },
    /// The process listening on the Unix socket runs as a user this client does not trust (not
    /// its own, not root, not one of [`UnixOptions::daemon_uids`]); nothing was sent to it.
    #[error(
        "the process listening on {} runs as uid {uid}, which this client does not trust (its \
         own uid is {own}; root is trusted too): nothing was sent. Another user may have bound \
         this path before the daemon. If the daemon runs as uid {uid} on purpose, trust it: \
         UnixOptions::daemon_uids",
        path.display()
    )]
    UntrustedDaemon {
        /// The socket.
        path: PathBuf,
        /// The listener's user.
        uid: u32,
        /// This process's effective user.
        own: u32,
    },
}

impl ClientError {
    /// The daemon's error code, if the daemon refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Daemon { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether a read or write ran past its timeout ([`Client::connect_unix_within`],
    /// [`Client::connect_tcp_within`], [`Client::set_timeout`]).
    pub fn is_timeout(&self) -> bool {
        match self {
            ClientError::NoAnswer { .. } | ClientError::NoTcpAnswer { .. } => true,
            ClientError::Io(e) => is_timeout(e),
            ClientError::Frame(FrameError::Io(e)) => is_timeout(e),
            _ => false,
        }
    }
}

/// A socket timeout reads as `WouldBlock` (or `TimedOut`).
fn is_timeout(error: &io::Error) -> bool {
    matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

enum Transport {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// A lookup the daemon started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// Its number, valid for every rank of the TP group.
    pub id: u64,
    /// Chunks L1 held at once.
    pub l1_hit_chunks: u32,
    /// The outcome, when L1 held the whole hit.
    pub outcome: Option<LookupOutcome>,
}

/// What a store did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// Chunks copied in.
    pub stored: u32,
    /// Chunks already there.
    pub present: u32,
    /// Chunks refused: position in the request, why (a code) and the daemon's words.
    pub refused: Vec<(u32, tierkv_proto::RefusalReason, String)>,
}

/// The session the daemon opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Session {
    /// Its number.
    pub id: u64,
    /// The largest chunk the daemon stores.
    pub max_chunk_bytes: u64,
    /// Readers of this session's lookups.
    pub readers: u32,
}

/// A blocking session with the daemon.
pub struct Client {
    transport: Transport,
    next_id: u64,
    session: Session,
    out: Vec<u8>,
    /// Requests sent whose replies have not been read, oldest first.
    in_flight: VecDeque<u64>,
    /// Replies read before their collector asked for them.
    arrived: HashMap<u64, ReplyBody>,
}

/// How [`Client::connect_unix_with`] connects to the Unix socket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnixOptions {
    /// A timeout on every read and write, set before the connect and the hello: a daemon that
    /// does not take the connection or answer the hello within it fails with
    /// [`ClientError::NoAnswer`]. It stays set for the session's calls. `None`: wait as long as
    /// the daemon takes.
    pub timeout: Option<Duration>,
    /// Users the daemon may run as besides this process's effective user and root (a daemon run
    /// as a service user of its own, its socket shared through `server.socket_group`). A
    /// listener of any other user is refused with [`ClientError::UntrustedDaemon`].
    pub daemon_uids: Vec<u32>,
}

/// A request sent and not yet collected: its id, and what kind of reply it expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use = "a submitted request's reply must be collected"]
pub struct Pending(pub u64);

impl Client {
    /// Connects over the Unix socket at `path` and opens a session, waiting as long as the
    /// daemon takes to answer. [`Client::connect_unix_within`] gives up instead: what a command
    /// that a person waits for should use. The daemon must run as this process's user or root
    /// ([`Client::connect_unix_with`] trusts others).
    pub fn connect_unix(path: impl AsRef<Path>, hello: Hello) -> Result<Self, ClientError> {
        Self::connect_unix_with(path, hello, &UnixOptions::default())
    }

    /// Connects over the Unix socket at `path` and opens a session, with `timeout` on every
    /// read and write, set before the hello: a socket that takes the connection and never
    /// answers (a stopped daemon, or a listener that is not one) fails with
    /// [`ClientError::NoAnswer`] instead of blocking for ever; so does a connect the daemon's
    /// full backlog holds up. The timeouts stay set for the session's calls;
    /// [`Client::set_timeout`] changes them.
    pub fn connect_unix_within(
        path: impl AsRef<Path>,
        hello: Hello,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_unix_with(
            path,
            hello,
            &UnixOptions { timeout: Some(timeout), ..Default::default() },
        )
    }

    /// Connects over the Unix socket at `path` as `options` say and opens a session. Before
    /// anything is sent, the process listening there must run as this process's effective user,
    /// as root, or as one of `options.daemon_uids`: [`ClientError::UntrustedDaemon`] otherwise.
    pub fn connect_unix_with(
        path: impl AsRef<Path>,
        hello: Hello,
        options: &UnixOptions,
    ) -> Result<Self, ClientError> {
        let path = path.as_ref();
        let Some(timeout) = options.timeout else {
            let stream = UnixStream::connect(path)?;
            check_peer(&stream, path, &options.daemon_uids)?;
            return Self::open(Transport::Unix(stream), hello);
        };
        // A zero timeout is refused by the socket; the least one waits a microsecond.
        let timeout = timeout.max(Duration::from_micros(1));
        let no_answer =
            || ClientError::NoAnswer { path: path.to_path_buf(), seconds: timeout.as_secs_f64() };
        let stream = connect_unix_bounded(path, timeout).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => no_answer(),
            _ => e.into(),
        })?;
        check_peer(&stream, path, &options.daemon_uids)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Self::open(Transport::Unix(stream), hello)
            .map_err(|e| if e.is_timeout() { no_answer() } else { e })
    }

    /// Connects over TCP and opens a session (the hello must carry the daemon's token), waiting
    /// as long as the name lookup, the connect and the daemon take.
    /// [`Client::connect_tcp_within`] gives up instead.
    pub fn connect_tcp(addr: impl ToSocketAddrs, hello: Hello) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Self::open(Transport::Tcp(stream), hello)
    }

    /// Connects over TCP to `host` (a name or an IP address) and opens a session, within
    /// `timeout`: looking `host` up and connecting to its addresses take `timeout` at most
    /// together, and every read and write of the hello, and of the session's calls, has it too
    /// ([`Client::set_timeout`] changes that). A resolver, a host or a daemon that does not
    /// answer in time fails with [`ClientError::NoTcpAnswer`] instead of blocking for minutes.
    pub fn connect_tcp_within(
        host: &str,
        port: u16,
        hello: Hello,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_tcp_resolved(host, port, hello, timeout, |host, port| {
            (host, port).to_socket_addrs().map(Iterator::collect)
        })
    }

    /// [`Client::connect_tcp_within`], with the name lookup `resolve` (a test's stands in for
    /// the system's).
    fn connect_tcp_resolved(
        host: &str,
        port: u16,
        hello: Hello,
        timeout: Duration,
        resolve: fn(&str, u16) -> io::Result<Vec<SocketAddr>>,
    ) -> Result<Self, ClientError> {
        // A zero timeout is refused by the socket; the least one waits a microsecond.
        let timeout = timeout.max(Duration::from_micros(1));
        let deadline = Instant::now() + timeout;
        let no_answer = || ClientError::NoTcpAnswer {
            addr: format!("{host}:{port}"),
            seconds: timeout.as_secs_f64(),
        };
        let addrs = resolve_within(host, port, timeout, resolve).ok_or_else(no_answer)??;
        let mut failure = io::Error::new(io::ErrorKind::NotFound, format!("no address for {host}"));
        for addr in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(no_answer());
            }
            match TcpStream::connect_timeout(&addr, left) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    stream.set_read_timeout(Some(timeout))?;
                    stream.set_write_timeout(Some(timeout))?;
                    return Self::open(Transport::Tcp(stream), hello)
                        .map_err(|e| if e.is_timeout() { no_answer() } else { e });
                }
                Err(e) => failure = e,
            }
        }
        Err(if is_timeout(&failure) { no_answer() } else { failure.into() })
    }

    fn open(transport: Transport, hello: Hello) -> Result<Self, ClientError> {
        let placeholder = Session { id: 0, max_chunk_bytes: 0, readers: 0 };
        let mut client = Client {
            transport,
            next_id: 1,
            session: placeholder,
            out: Vec::new(),
            in_flight: VecDeque::new(),
            arrived: HashMap::new(),
        };
        match client.call(RequestBody::Hello(hello))? {
            ReplyBody::Welcome { session, max_chunk_bytes, readers, .. } => {
                client.session = Session { id: session, max_chunk_bytes, readers };
                Ok(client)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// A worker hello with the current protocol version.
    pub fn worker_hello(model: &str, chunk_bytes: u64) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            role: tierkv_proto::Role::Worker,
            rank: 0,
            tp_size: 1,
            world_size: None,
            mla: false,
            namespaces: vec![tierkv_proto::NamespaceDecl {
                model: model.to_string(),
                cache_salt: String::new(),
            }],
            chunk_bytes,
            chunk_tokens: 1,
            token: None,
        }
    }

    /// An admin hello (status and clear).
    pub fn admin_hello() -> Hello {
        Hello {
            role: tierkv_proto::Role::Admin,
            namespaces: Vec::new(),
            ..Self::worker_hello("", 0)
        }
    }

    /// The session the daemon opened.
    pub fn session(&self) -> Session {
        self.session
    }

    /// Sets how long a call may wait for its reply, and its request to be sent, before failing
    /// with a timeout (`None`: for ever).
    pub fn set_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.transport {
            Transport::Unix(s) => s.set_read_timeout(timeout).and(s.set_write_timeout(timeout)),
            Transport::Tcp(s) => s.set_read_timeout(timeout).and(s.set_write_timeout(timeout)),
        }
    }

    /// Sends one request and reads its reply; a daemon error becomes [`ClientError::Daemon`].
    pub fn call(&mut self, body: RequestBody) -> Result<ReplyBody, ClientError> {
        self.call_with_descriptors(body, &[])
    }

    /// Like [`Client::call`], with file descriptors attached to the frame (Unix socket only).
    pub fn call_with_descriptors(
        &mut self,
        body: RequestBody,
        fds: &[BorrowedFd<'_>],
    ) -> Result<ReplyBody, ClientError> {
        let pending = self.submit_with_descriptors(body, fds)?;
        self.collect(pending)
    }

    /// The most requests one client keeps in flight. Requests and replies wait in the socket's
    /// buffers meanwhile, so this also bounds what they hold (a daemon that cannot write a reply
    /// stops reading requests).
    pub const MAX_IN_FLIGHT: usize = 16;

    /// Sends a request without waiting for its reply; [`Client::collect`] returns the reply.
    pub fn submit(&mut self, body: RequestBody) -> Result<Pending, ClientError> {
        self.submit_with_descriptors(body, &[])
    }

    /// Like [`Client::submit`], with file descriptors attached to the frame.
    pub fn submit_with_descriptors(
        &mut self,
        body: RequestBody,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Pending, ClientError> {
        while self.in_flight.len() >= Self::MAX_IN_FLIGHT {
            self.read_one()?;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        tierkv_proto::encode(&Request { id, body }, &mut self.out)?;
        let frame = std::mem::take(&mut self.out);
        let sent = self.send_raw(&frame, fds);
        self.out = frame;
        sent?;
        self.in_flight.push_back(id);
        Ok(Pending(id))
    }

    /// Requests submitted whose replies have not been collected.
    pub fn pending(&self) -> usize {
        self.in_flight.len() + self.arrived.len()
    }

    /// The reply to a submitted request, reading (and keeping) the replies to earlier ones
    /// first; a daemon error becomes [`ClientError::Daemon`]. Each request is collected once.
    pub fn collect(&mut self, pending: Pending) -> Result<ReplyBody, ClientError> {
        let Pending(id) = pending;
        loop {
            if let Some(body) = self.arrived.remove(&id) {
                return match body {
                    ReplyBody::Error { code, message } => {
                        Err(ClientError::Daemon { code, message })
                    }
                    body => Ok(body),
                };
            }
            if !self.in_flight.contains(&id) {
                return Err(ClientError::Unexpected(format!(
                    "request {id} is not in flight (never submitted, or collected already)"
                )));
            }
            self.read_one()?;
        }
    }

    /// Reads the next reply and files it under its request: the oldest in flight, since the
    /// daemon answers in order. A reply with id 0 answers no request (the daemon could not read
    /// one): it fails the connection's oldest request.
    fn read_one(&mut self) -> Result<(), ClientError> {
        let reply = self.read_reply()?;
        let Some(oldest) = self.in_flight.pop_front() else {
            return Err(ClientError::Unexpected(format!(
                "reply to request {} with no request in flight",
                reply.id
            )));
        };
        if reply.id != oldest && reply.id != 0 {
            return Err(ClientError::Unexpected(format!(
                "reply to request {} while {oldest} was the oldest in flight",
                reply.id
            )));
        }
        self.arrived.insert(oldest, reply.body);
        Ok(())
    }

    /// Writes bytes as they are, with descriptors attached if given: for tests that send
    /// broken frames.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        match (&mut self.transport, fds.is_empty()) {
            (Transport::Unix(stream), false) => {
                let sent = send_with_fds(stream, bytes, fds)?;
                stream.write_all(&bytes[sent..])
            }
            (Transport::Unix(stream), true) => stream.write_all(bytes),
            (Transport::Tcp(_), false) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "file descriptors travel only over the Unix socket",
            )),
            (Transport::Tcp(stream), true) => stream.write_all(bytes),
        }
    }

    /// Reads the next reply frame.
    pub fn read_reply(&mut self) -> Result<Reply, ClientError> {
        let frame = match &mut self.transport {
            Transport::Unix(s) => tierkv_proto::read_frame(s, REPLY_LIMIT)?,
            Transport::Tcp(s) => tierkv_proto::read_frame(s, REPLY_LIMIT)?,
        };
        let frame = frame.ok_or(ClientError::Closed)?;
        Ok(tierkv_proto::decode(&frame)?)
    }

    /// Registers `buffer`, whose every block is one chunk, with the daemon, which maps it;
    /// returns its number.
    pub fn register_buffer(&mut self, buffer: &SharedBuffer) -> Result<u32, ClientError> {
        let layout = KvLayout {
            blocks: buffer.blocks(),
            block_bytes: buffer.block_bytes(),
            block_stride: buffer.block_bytes(),
            blocks_per_chunk: 1,
            segments: vec![Segment { region: 0, offset: 0 }],
        };
        // The buffer checked that its blocks fit its file.
        let bytes = buffer.block_bytes().saturating_mul(buffer.blocks());
        self.register_kv(&[(RegionSource::Memfd { bytes }, Some(buffer.fd()))], layout)
    }

    /// Registers KV memory: regions (each memfd region with its descriptor) and their layout;
    /// returns the buffer's number.
    pub fn register_kv(
        &mut self,
        regions: &[(RegionSource, Option<BorrowedFd<'_>>)],
        layout: KvLayout,
    ) -> Result<u32, ClientError> {
        let fds: Vec<BorrowedFd<'_>> = regions.iter().filter_map(|(_, fd)| *fd).collect();
        let regions = regions.iter().map(|(r, _)| r.clone()).collect();
        match self.call_with_descriptors(RequestBody::RegisterKv { regions, layout }, &fds)? {
            ReplyBody::BufferRegistered { buffer } => Ok(buffer),
            other => Err(unexpected(&other)),
        }
    }

    /// Stores chunks from blocks of a registered buffer.
    pub fn store(
        &mut self,
        namespace: u32,
        buffer: u32,
        chunks: Vec<ChunkBlocks>,
    ) -> Result<Stored, ClientError> {
        let pending = self.submit_store(namespace, buffer, chunks)?;
        self.finish_store(pending)
    }

    /// Sends a store without waiting for the daemon's copy. The blocks it names must not be
    /// written again until [`Client::finish_store`] returns for it: the daemon copies them when
    /// it reaches the request.
    pub fn submit_store(
        &mut self,
        namespace: u32,
        buffer: u32,
        chunks: Vec<ChunkBlocks>,
    ) -> Result<Pending, ClientError> {
        self.submit(RequestBody::Store { namespace, buffer, chunks, ready_event: None })
    }

    /// What a store sent with [`Client::submit_store`] did (waits for it if need be).
    pub fn finish_store(&mut self, pending: Pending) -> Result<Stored, ClientError> {
        match self.collect(pending)? {
            ReplyBody::Stored { stored, present, refused } => Ok(Stored {
                stored,
                present,
                refused: refused.into_iter().map(|r| (r.index, r.reason, r.message)).collect(),
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a prefix lookup.
    pub fn lookup(&mut self, namespace: u32, chunks: Vec<ChunkId>) -> Result<Lookup, ClientError> {
        self.lookup_with(namespace, chunks, false)
    }

    /// Starts a prefix lookup whose prefetch waits for its first `query` or `wait`
    /// (`defer_prefetch`): see docs/protocol.md.
    pub fn lookup_deferred(
        &mut self,
        namespace: u32,
        chunks: Vec<ChunkId>,
    ) -> Result<Lookup, ClientError> {
        self.lookup_with(namespace, chunks, true)
    }

    fn lookup_with(
        &mut self,
        namespace: u32,
        chunks: Vec<ChunkId>,
        defer_prefetch: bool,
    ) -> Result<Lookup, ClientError> {
        match self.call(RequestBody::Lookup { namespace, chunks, defer_prefetch })? {
            ReplyBody::LookupStarted { lookup, l1_hit_chunks, outcome } => {
                Ok(Lookup { id: lookup, l1_hit_chunks, outcome })
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The lookup's outcome if it is complete.
    pub fn query(&mut self, lookup: u64) -> Result<Option<LookupOutcome>, ClientError> {
        match self.call(RequestBody::Query { lookup })? {
            ReplyBody::Pending => Ok(None),
            ReplyBody::Done(outcome) => Ok(Some(outcome)),
            other => Err(unexpected(&other)),
        }
    }

    /// Waits for the lookup to complete.
    pub fn wait(&mut self, lookup: u64, timeout: Duration) -> Result<LookupOutcome, ClientError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.call(RequestBody::Wait { lookup, timeout_ms })? {
            ReplyBody::Done(outcome) => Ok(outcome),
            other => Err(unexpected(&other)),
        }
    }

    /// Copies chunks of a lookup's hit into blocks and returns this reader's share. Returns the
    /// bytes copied.
    pub fn retrieve(
        &mut self,
        lookup: u64,
        buffer: u32,
        chunks: Vec<ChunkBlocks>,
    ) -> Result<u64, ClientError> {
        match self.call(RequestBody::Retrieve { lookup, buffer, chunks, done_event: None })? {
            ReplyBody::Retrieved { bytes, .. } => Ok(bytes),
            other => Err(unexpected(&other)),
        }
    }

    /// Returns every share the lookup still holds.
    pub fn release(&mut self, lookup: u64) -> Result<(), ClientError> {
        match self.call(RequestBody::Release { lookup })? {
            ReplyBody::Released => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Waits (at most `timeout`) until every chunk this session stored since its last flush
    /// has been through the store pipeline; returns how many are on the disk tier and how many
    /// are not (`durable`, `not_durable`).
    pub fn flush(&mut self, timeout: Duration) -> Result<(u32, u32), ClientError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match self.call(RequestBody::Flush { timeout_ms })? {
            ReplyBody::Flushed { durable, not_durable } => Ok((durable, not_durable)),
            other => Err(unexpected(&other)),
        }
    }

    /// The daemon's status.
    pub fn status(&mut self) -> Result<StatusReport, ClientError> {
        match self.call(RequestBody::Status)? {
            ReplyBody::Status(report) => Ok(report),
            other => Err(unexpected(&other)),
        }
    }

    /// Empties every tier of what nobody holds (admin sessions); chunks removed per tier.
    pub fn clear(&mut self) -> Result<Vec<u64>, ClientError> {
        match self.call(RequestBody::Clear)? {
            ReplyBody::Cleared { removed } => Ok(removed),
            other => Err(unexpected(&other)),
        }
    }

    /// Ends the session; the daemon returns everything it holds.
    pub fn end(mut self) -> Result<(), ClientError> {
        match self.call(RequestBody::EndSession)? {
            ReplyBody::Bye => Ok(()),
            other => Err(unexpected(&other)),
        }
    }
}

fn unexpected(body: &ReplyBody) -> ClientError {
    ClientError::Unexpected(format!("{body:?}"))
}

/// Refuses the connected Unix socket `stream` unless the process listening at its other end (the
/// kernel keeps its credentials from its `listen`) runs as this process's effective user, root,
/// or one of `trusted`.
fn check_peer(stream: &UnixStream, path: &Path, trusted: &[u32]) -> Result<(), ClientError> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a ucred of the size passed, alive for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("cannot tell who listens on {} (SO_PEERCRED): {e}", path.display()),
        )
        .into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let own = unsafe { libc::geteuid() };
    if cred.uid == own || cred.uid == 0 || trusted.contains(&cred.uid) {
        Ok(())
    } else {
        Err(ClientError::UntrustedDaemon { path: path.to_path_buf(), uid: cred.uid, own })
    }
}

/// Sends `bytes` with `fds` attached as `SCM_RIGHTS`; returns how many bytes went.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let ints = fds.len() * std::mem::size_of::<libc::c_int>();
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(ints as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov =
        libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg of `fds.len()` ints, as CMSG_SPACE sized it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(ints as u32) as _;
        let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
    }
    loop {
        // SAFETY: msg points at live buffers for the duration of the call.
        let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent >= 0 {
            return Ok(sent as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The addresses `resolve` gives for `host:port`, or `None` if it has not answered within
/// `timeout`. `getaddrinfo` takes no timeout, and a resolver that does not answer holds its caller
/// for as long as it retries (seconds to minutes): a name is looked up on a thread of its own,
/// left to finish by itself past the timeout (its answer then goes unused). An IP address needs
/// no lookup.
fn resolve_within(
    host: &str,
    port: u16,
    timeout: Duration,
    resolve: fn(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> Option<io::Result<Vec<SocketAddr>>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(Ok(vec![SocketAddr::new(ip, port)]));
    }
    let (answer, answered) = mpsc::channel();
    let name = host.to_owned();
    let spawned = std::thread::Builder::new().name("tierkv-resolve".into()).spawn(move || {
        // The caller may have given up: the answer then goes unused.
        let _ = answer.send(resolve(&name, port));
    });
    if let Err(e) = spawned {
        return Some(Err(e));
    }
    answered.recv_timeout(timeout).ok()
}

/// Connects to the Unix socket at `path`, waiting at most `timeout` for the connection to be
/// taken: a daemon that accepts nothing fills its listen backlog, and a plain `connect` then
/// waits for ever. The socket's send timeout, set before the connect, bounds it (on Linux a
/// Unix-socket connect waits that long at most, then fails with `EAGAIN`); it stays set for the
/// session's writes.
fn connect_unix_bounded(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;

    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data, for which all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} cannot name a Unix socket", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: a plain call; a descriptor it returns is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let wait = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    // SAFETY: `wait` is a timeval of the size passed, alive for the call.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&raw const wait).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    loop {
        // SAFETY: `addr` holds a NUL-terminated path of `len` bytes with its family.
        let rc = unsafe {
            libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len as libc::socklen_t)
        };
        if rc == 0 {
            return Ok(UnixStream::from(fd));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use super::*;
    use proptest::prelude::*;

    /// A client on one end of a socket pair, and a stand-in daemon on the other that answers
    /// every request in order: a store with `stored` = its request id, or, for ids divisible by
    /// 5, a daemon error naming the id. Requests are read as they come, like the daemon does.
    fn client_and_echo() -> (Client, std::thread::JoinHandle<u64>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut stream = theirs;
            let mut answered = 0;
            while let Ok(Some(frame)) = tierkv_proto::read_frame(&mut stream, REPLY_LIMIT) {
                let request: Request = tierkv_proto::decode(&frame).unwrap();
                let body = if request.id.is_multiple_of(5) {
                    ReplyBody::Error {
                        code: ErrorCode::BadRequest,
                        message: request.id.to_string(),
                    }
                } else {
                    ReplyBody::Stored { stored: request.id as u32, present: 0, refused: Vec::new() }
                };
                let mut out = Vec::new();
                tierkv_proto::encode(&Reply { id: request.id, body }, &mut out).unwrap();
                stream.write_all(&out).unwrap();
                answered += 1;
            }
            answered
        });
        let client = Client {
            transport: Transport::Unix(ours),
            next_id: 1,
            session: Session { id: 1, max_chunk_bytes: 0, readers: 1 },
            out: Vec::new(),
            in_flight: VecDeque::new(),
            arrived: HashMap::new(),
        };
        (client, server)
    }

    fn store_body() -> RequestBody {
        RequestBody::Store { namespace: 0, buffer: 0, chunks: Vec::new(), ready_event: None }
    }

    /// What the stand-in daemon answers request `id`.
    fn check(id: u64, got: Result<Stored, ClientError>) -> Result<(), TestCaseError> {
        match got {
            Ok(stored) => prop_assert_eq!(u64::from(stored.stored), id),
            Err(ClientError::Daemon { message, .. }) => {
                prop_assert!(id.is_multiple_of(5));
                prop_assert_eq!(message, id.to_string());
            }
            Err(other) => prop_assert!(false, "request {id}: {other}"),
        }
        Ok(())
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Submit a store.
        Submit,
        /// Collect one outstanding store (by position among those outstanding).
        Collect(usize),
        /// A blocking call in between.
        Call,
    }

    proptest! {
        /// Against a reference model (the set of requests submitted and not collected), every
        /// reply reaches exactly the request it answers, whatever the order of submits, collects
        /// and blocking calls, and however far past `MAX_IN_FLIGHT` the submits run ahead.
        #[test]
        fn every_reply_reaches_its_own_request(
            ops in proptest::collection::vec(
                prop_oneof![
                    4 => Just(Op::Submit),
                    3 => (0usize..64).prop_map(Op::Collect),
                    1 => Just(Op::Call),
                ],
                1..120,
            )
        ) {
            let (mut client, server) = client_and_echo();
            let mut outstanding: Vec<Pending> = Vec::new();
            for op in ops {
                match op {
                    Op::Submit => outstanding.push(client.submit_store(0, 0, Vec::new()).unwrap()),
                    Op::Collect(_) if outstanding.is_empty() => {}
                    Op::Collect(i) => {
                        let pending = outstanding.remove(i % outstanding.len());
                        let got = client.finish_store(pending);
                        check(pending.0, got)?;
                        // Collected once only.
                        prop_assert!(client.collect(pending).is_err());
                    }
                    Op::Call => {
                        let id = client.next_id;
                        let got = client.store(0, 0, Vec::new());
                        check(id, got)?;
                    }
                }
                prop_assert_eq!(client.pending(), outstanding.len());
                prop_assert!(client.in_flight.len() <= Client::MAX_IN_FLIGHT);
            }
            for pending in outstanding.drain(..).rev() {
                let got = client.finish_store(pending);
                check(pending.0, got)?;
            }
            prop_assert_eq!(client.pending(), 0);
            let sent = client.next_id - 1;
            drop(client);
            prop_assert_eq!(server.join().unwrap(), sent);
        }
    }

    #[test]
    fn a_socket_that_never_answers_the_hello_fails_within_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        // Connections wait in the backlog and are never answered.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let timeout = Duration::from_millis(200);
        let started = std::time::Instant::now();
        let err = Client::connect_unix_within(&path, Client::admin_hello(), timeout).err().unwrap();
        assert!(started.elapsed() >= timeout);
        assert!(err.is_timeout(), "{err}");
        assert_eq!(
            err.to_string(),
            format!("no daemon answered on {} within 0.2 s", path.display())
        );
    }

    /// A daemon that accepts nothing fills its listen backlog; a connect then waits in the
    /// kernel, before any hello, and must give up at the deadline too.
    #[test]
    fn a_socket_whose_backlog_is_full_fails_within_the_timeout() {
        use std::os::fd::{FromRawFd, OwnedFd};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("full.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // SAFETY: a plain call on the listener's own descriptor.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0, "a backlog of none");
        // Fill it: non-blocking connects until the kernel refuses one for want of room.
        let mut queued = Vec::new();
        loop {
            // SAFETY: a plain call; the descriptor is owned at once.
            let fd =
                unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
            assert!(fd >= 0);
            // SAFETY: just opened, owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let stream = UnixStream::from(fd);
            let addr = std::os::unix::net::SocketAddr::from_pathname(&path).unwrap();
            match connect_nonblocking(&stream, &addr) {
                Ok(()) => queued.push(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
            assert!(queued.len() < 64, "the backlog never filled");
        }
        let timeout = Duration::from_millis(300);
        let (done, finished) = std::sync::mpsc::channel();
        let waiting = path.clone();
        std::thread::spawn(move || {
            let result = Client::connect_unix_within(&waiting, Client::admin_hello(), timeout);
            let _ = done.send(result.err().map(|e| (e.is_timeout(), e.to_string())));
        });
        // A bound on a hang, not a speed: ten times the timeout.
        let outcome = finished.recv_timeout(10 * timeout).expect("the connect never gave up");
        let (timed_out, message) = outcome.expect("connected to a full backlog");
        assert!(timed_out, "{message}");
        assert!(message.starts_with("no daemon answered on"), "{message}");
        drop(queued);
    }

    /// A name lookup that never answers, as from a resolver that is down.
    fn never_resolved(_host: &str, _port: u16) -> io::Result<Vec<SocketAddr>> {
        loop {
            std::thread::park();
        }
    }

    /// A TCP connect whose name lookup never ends gives up at the timeout, naming the host.
    #[test]
    fn a_tcp_connect_whose_name_lookup_hangs_fails_within_the_timeout() {
        let timeout = Duration::from_millis(200);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let hello = Client::admin_hello();
            let result = Client::connect_tcp_resolved(
                "tierkv.invalid",
                7070,
                hello,
                timeout,
                never_resolved,
            );
            let _ = done.send(result.err().map(|e| (e.is_timeout(), e.to_string())));
        });
        // A bound on a hang, not a speed: fifty times the timeout.
        let outcome =
            finished.recv_timeout(50 * timeout).expect("the connect waited for the lookup");
        let (timed_out, message) = outcome.expect("connected without an address");
        assert!(timed_out, "{message}");
        assert_eq!(message, "no daemon answered at tierkv.invalid:7070 within 0.2 s");
    }

    /// A name looked up connects to its address, and a listener there that never answers the
    /// hello fails at the timeout too.
    #[test]
    fn a_tcp_listener_that_never_answers_the_hello_fails_within_the_timeout() {
        fn here(_host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
            Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))])
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let timeout = Duration::from_millis(200);
        let err =
            Client::connect_tcp_resolved("daemon.test", port, Client::admin_hello(), timeout, here)
                .err()
                .unwrap();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(
            err.to_string(),
            format!("no daemon answered at daemon.test:{port} within 0.2 s")
        );
        // An IP address is not looked up.
        let err = Client::connect_tcp_within("127.0.0.1", port, Client::admin_hello(), timeout)
            .err()
            .unwrap();
        assert!(err.is_timeout(), "{err}");
    }

    /// `connect(2)` of a non-blocking Unix socket: `WouldBlock` when the backlog is full.
    fn connect_nonblocking(
        stream: &UnixStream,
        addr: &std::os::unix::net::SocketAddr,
    ) -> io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let path = addr.as_pathname().unwrap().as_os_str().as_bytes();
        // SAFETY: plain data, all zeroes valid.
        let mut raw: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        raw.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (dst, src) in raw.sun_path.iter_mut().zip(path) {
            *dst = *src as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + path.len() + 1;
        // SAFETY: `raw` holds a NUL-terminated path of `len` bytes.
        let rc = unsafe {
            libc::connect(stream.as_raw_fd(), (&raw const raw).cast(), len as libc::socklen_t)
        };
        if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
    }

    #[test]
    fn a_request_never_submitted_is_refused_without_touching_the_connection() {
        let (mut client, _server) = client_and_echo();
        let first = client.submit(store_body()).unwrap();
        assert!(matches!(client.collect(Pending(99)), Err(ClientError::Unexpected(_))));
        assert!(client.collect(first).is_ok());
    }
}
