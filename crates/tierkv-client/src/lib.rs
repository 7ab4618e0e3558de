//! tierkv-client: a blocking session with the tierkv daemon.
//!
//! A [`Client`] opens a session (the hello), registers [`SharedBuffer`]s (the memfd travels over
//! the Unix socket as `SCM_RIGHTS`), and then stores, looks up and retrieves chunks by naming
//! blocks of those buffers. One request is in flight at a time; the daemon answers in order.
//! Everything the session holds is returned by the daemon when the client ends or disconnects.

pub mod payload;
mod shm;

use std::io::{self, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

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
}

impl ClientError {
    /// The daemon's error code, if the daemon refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Daemon { code, .. } => Some(*code),
            _ => None,
        }
    }
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
}

impl Client {
    /// Connects over the Unix socket at `path` and opens a session.
    pub fn connect_unix(path: impl AsRef<Path>, hello: Hello) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path)?;
        Self::open(Transport::Unix(stream), hello)
    }

    /// Connects over TCP and opens a session (the hello must carry the daemon's token).
    pub fn connect_tcp(addr: impl ToSocketAddrs, hello: Hello) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Self::open(Transport::Tcp(stream), hello)
    }

    fn open(transport: Transport, hello: Hello) -> Result<Self, ClientError> {
        let placeholder = Session { id: 0, max_chunk_bytes: 0, readers: 0 };
        let mut client = Client { transport, next_id: 1, session: placeholder, out: Vec::new() };
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

    /// Sets how long a call may wait for its reply before failing with a timeout.
    pub fn set_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.transport {
            Transport::Unix(s) => s.set_read_timeout(timeout),
            Transport::Tcp(s) => s.set_read_timeout(timeout),
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
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        tierkv_proto::encode(&Request { id, body }, &mut self.out)?;
        let frame = std::mem::take(&mut self.out);
        let sent = self.send_raw(&frame, fds);
        self.out = frame;
        sent?;
        let reply = self.read_reply()?;
        if reply.id != id && reply.id != 0 {
            return Err(ClientError::Unexpected(format!(
                "reply to request {} while waiting for {id}",
                reply.id
            )));
        }
        match reply.body {
            ReplyBody::Error { code, message } => Err(ClientError::Daemon { code, message }),
            body => Ok(body),
        }
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
        let bytes = buffer.block_bytes() * buffer.blocks();
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
        match self.call(RequestBody::Store { namespace, buffer, chunks })? {
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
        match self.call(RequestBody::Lookup { namespace, chunks })? {
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
        match self.call(RequestBody::Retrieve { lookup, buffer, chunks })? {
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
