//! One connection: frames in (with any file descriptors riding on them), replies out.
//!
//! On the Unix socket every read is a `recvmsg`, so a descriptor sent with a frame is never
//! dropped by a plain `read`; descriptors wait in a small queue until a `register_kv` takes
//! them, and a client that floods descriptors is disconnected. Each descriptor is tagged with
//! where in the stream the read that brought it ended: the kernel ends a read right after the
//! message that carried descriptors, so the tag lies inside the frame they were sent with. A
//! frame takes only descriptors tagged up to its end, and those a frame left (it could not be
//! decoded, or carried more than it used) are closed once it is handled: never taken by a later
//! `register_kv`, which would map the wrong memory.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tierkv_proto::{FrameError, HEADER_BYTES, frame_len};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{TcpStream, UnixStream};

/// Descriptors a connection may have waiting at once.
const MAX_QUEUED_FDS: usize = crate::kv::MAX_MEMFD_REGIONS;
/// Bytes read per call at least.
const READ_CHUNK: usize = 64 << 10;
/// The largest frame of a connection that has not said hello yet (a hello is well under 1 KiB
/// but for its namespaces): before it, nobody knows who is sending, and a frame up to
/// `server.max_frame` would be that much of the daemon's memory per connection.
pub const HELLO_FRAME_BYTES: u32 = 64 << 10;

/// The transport under a connection.
pub enum Stream {
    /// The Unix socket.
    Unix(UnixStream),
    /// TCP.
    Tcp(TcpStream),
}

/// Frames and descriptors from one client.
pub struct Conn {
    stream: Stream,
    buf: Vec<u8>,
    start: usize,
    /// Where in the stream `buf[0]` is.
    origin: u64,
    /// Where in the stream the last frame returned ends.
    frame_end: u64,
    /// Descriptors waiting, each with where in the stream the read that brought it ended.
    /// Descriptors received, with the stream offset of the frame that brought them; `None` for
    /// one that is not a memfd (closed elsewhere at once: it could block its close).
    fds: VecDeque<(u64, Option<OwnedFd>)>,
    /// The largest frame accepted now: [`HELLO_FRAME_BYTES`] at most until the hello.
    limit: u32,
    /// The largest frame accepted once the client said hello.
    limit_after_hello: u32,
}

impl Conn {
    /// Wraps a stream; frames above `limit` bytes are refused, and above [`HELLO_FRAME_BYTES`]
    /// until [`Conn::hello_said`].
    pub fn new(stream: Stream, limit: u32) -> Self {
        Conn {
            stream,
            buf: Vec::with_capacity(READ_CHUNK),
            start: 0,
            origin: 0,
            frame_end: 0,
            fds: VecDeque::new(),
            limit: limit.min(HELLO_FRAME_BYTES),
            limit_after_hello: limit,
        }
    }

    /// The client said hello: frames up to the full limit are accepted from now on.
    pub fn hello_said(&mut self) {
        self.limit = self.limit_after_hello;
    }

    /// The next frame's body; `Ok(None)` when the client closed between frames.
    pub async fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        loop {
            let ready = &self.buf[self.start..];
            if ready.len() >= HEADER_BYTES {
                let mut header = [0u8; HEADER_BYTES];
                header.copy_from_slice(&ready[..HEADER_BYTES]);
                let len = frame_len(header, self.limit)?;
                if ready.len() >= HEADER_BYTES + len {
                    let body = ready[HEADER_BYTES..HEADER_BYTES + len].to_vec();
                    self.start += HEADER_BYTES + len;
                    self.frame_end = self.origin + self.start as u64;
                    return Ok(Some(body));
                }
            }
            if self.recv().await? == 0 {
                return if self.buf.len() == self.start {
                    Ok(None)
                } else {
                    Err(FrameError::Truncated)
                };
            }
        }
    }

    /// The client's end, to ask while a request is served whether the client gave up on it.
    /// Valid while this connection is: ask it only inside a request this connection carried.
    pub fn peer(&self) -> Peer {
        let fd = match &self.stream {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        };
        Peer { fd: Some(fd), inline: false }
    }

    /// A descriptor that arrived with the frame being handled, oldest first; `None` when it has
    /// no more (one of a later frame is not given).
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        match self.fds.front() {
            Some((at, _)) if *at <= self.frame_end => self.fds.pop_front().and_then(|(_, fd)| fd),
            _ => None,
        }
    }

    /// Closes the descriptors that came with the frames handled so far and were not taken:
    /// call it before reading the next frame.
    pub fn drop_used_fds(&mut self) {
        while self.fds.front().is_some_and(|(at, _)| *at <= self.frame_end) {
            self.fds.pop_front();
        }
    }

    /// Sends bytes (one or more encoded frames).
    pub async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        match &mut self.stream {
            Stream::Unix(s) => s.write_all(bytes).await,
            Stream::Tcp(s) => s.write_all(bytes).await,
        }
    }

    /// Closes after a final reply the daemon will not follow with more: the write side is shut
    /// (the client reads the reply, then end of stream), and what the client still sends is read
    /// and dropped for up to `linger`. Closing a socket with unread bytes in it makes the kernel
    /// reset the connection, and a reset can overtake the reply, so the client would see
    /// "connection reset" instead of the error it was sent.
    pub async fn close_after_reply(mut self, linger: std::time::Duration) {
        let shut = match &mut self.stream {
            Stream::Unix(s) => s.shutdown().await,
            Stream::Tcp(s) => s.shutdown().await,
        };
        if shut.is_err() {
            return;
        }
        let mut sink = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + linger;
        loop {
            let read = match &mut self.stream {
                Stream::Unix(s) => tokio::time::timeout_at(deadline, s.read(&mut sink)).await,
                Stream::Tcp(s) => tokio::time::timeout_at(deadline, s.read(&mut sink)).await,
            };
            match read {
                Ok(Ok(n)) if n > 0 => continue,
                _ => return,
            }
        }
    }

    async fn recv(&mut self) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.origin += self.start as u64;
            self.start = 0;
        }
        let filled = self.buf.len();
        let at = self.origin + filled as u64;
        self.buf.resize(filled + READ_CHUNK, 0);
        let Conn { stream, buf, fds, .. } = self;
        let result = match stream {
            Stream::Tcp(s) => s.read(&mut buf[filled..]).await,
            Stream::Unix(s) => {
                let raw = s.as_raw_fd();
                s.async_io(Interest::READABLE, || recv_with_fds(raw, &mut buf[filled..], at, fds))
                    .await
            }
        };
        let n = *result.as_ref().unwrap_or(&0);
        self.buf.truncate(filled + n);
        if self.fds.len() > MAX_QUEUED_FDS {
            self.fds.clear();
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than {MAX_QUEUED_FDS} file descriptors sent without a register_kv"),
            ));
        }
        result
    }
}

/// The client's end of a connection, as a request being served sees it.
///
/// A client gives up on a call at its deadline by shutting its writing side (or closing), and
/// only then lets the memory the call names go (for an engine: the KV blocks, which it may hand
/// to another request). So a copy that finished while [`Peer::gave_up`] was still `false` read or
/// wrote memory the client still held for this call, and one asked about afterwards may not have.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    fd: Option<RawFd>,
    /// The request runs on one of the runtime's threads, which must not wait (it serves other
    /// connections): what would wait refuses instead.
    inline: bool,
}

impl Peer {
    /// No client to give up: a session served without a connection (tests, tools).
    pub fn detached() -> Self {
        Peer { fd: None, inline: false }
    }

    /// The same client, for a request served on a runtime thread ([`Peer::may_wait`] false).
    pub fn inline(self) -> Self {
        Peer { inline: true, ..self }
    }

    /// Whether the request may wait (for the store pipeline to make room in L1, say): it runs
    /// off the runtime's threads.
    pub fn may_wait(&self) -> bool {
        !self.inline
    }

    /// Whether the client has shut its writing side or closed the connection (an error on the
    /// socket counts too). One `poll` with no wait: about 0.2 µs on the CI machine.
    pub fn gave_up(&self) -> bool {
        let Some(fd) = self.fd else { return false };
        let mut probe = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd, no wait. The descriptor is the connection's, which outlives
        // every request it carries (`Conn::peer`).
        let ready = unsafe { libc::poll(&mut probe, 1, 0) };
        ready > 0 && probe.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// `recvmsg` into `buf` (whose first byte is at `at` of the stream), keeping every descriptor
/// that came along (close-on-exec), tagged with where in the stream the read ended.
fn recv_with_fds(
    socket: RawFd,
    buf: &mut [u8],
    at: u64,
    fds: &mut VecDeque<(u64, Option<OwnedFd>)>,
) -> io::Result<usize> {
    const MAX_FDS: usize = 8;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: every pointer in `msg` points at a live buffer of the stated length.
    let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: walking the control messages the kernel just wrote, within `msg_controllen`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..payload / size_of::<libc::c_int>() {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    let kept = if is_memfd(&fd) {
                        Some(fd)
                    } else {
                        close_elsewhere(fd);
                        None
                    };
                    fds.push_back((at + n as u64, kept));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many file descriptors in one message",
        ));
    }
    Ok(n as usize)
}

/// Whether `fd` is a memfd (it has seals to tell), the only descriptor a request takes.
fn is_memfd(fd: &OwnedFd) -> bool {
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) >= 0 }
}

/// Closes a descriptor a client sent that is not a memfd on a thread of its own: the close of a
/// client's socket with unsent bytes and a long `SO_LINGER`, or of a file on a filesystem the
/// client serves, may block for as long as the client likes, and must not block the runtime.
fn close_elsewhere(fd: OwnedFd) {
    static CLOSER: std::sync::OnceLock<Option<std::sync::Mutex<std::sync::mpsc::Sender<OwnedFd>>>> =
        std::sync::OnceLock::new();
    let closer = CLOSER.get_or_init(|| {
        let (send, receive) = std::sync::mpsc::channel::<OwnedFd>();
        std::thread::Builder::new()
            .name("tierkv-fd-close".into())
            .spawn(move || receive.into_iter().for_each(drop))
            .ok()
            .map(|_| std::sync::Mutex::new(send))
    });
    let refused = match closer.as_ref().map(|send| send.lock()) {
        Some(Ok(send)) => send.send(fd).err().map(|e| e.0),
        _ => Some(fd),
    };
    // No closing thread could be started: closed here, as before.
    drop(refused);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// What the daemon sees of a client that gives up: its writing side shut, or the connection
    /// closed. Unread bytes (a request still queued) do not hide it.
    #[tokio::test]
    async fn a_peer_has_given_up_once_it_shut_its_writing_side_or_closed() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let conn = Conn::new(Stream::Unix(UnixStream::from_std(ours).unwrap()), 1 << 20);
        let peer = conn.peer();
        assert!(!peer.gave_up(), "a client still waiting");
        std::io::Write::write_all(&mut &theirs, b"a request frame the daemon has not read")
            .unwrap();
        assert!(!peer.gave_up(), "a client that sent more has not given up");
        theirs.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(peer.gave_up(), "writing side shut, unread bytes or not");
        drop(theirs);
        assert!(peer.gave_up(), "closed");
        assert!(!Peer::detached().gave_up());

        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        accepted.set_nonblocking(true).unwrap();
        let conn = Conn::new(Stream::Tcp(TcpStream::from_std(accepted).unwrap()), 1 << 20);
        let peer = conn.peer();
        assert!(!peer.gave_up());
        client.shutdown(std::net::Shutdown::Write).unwrap();
        // The FIN crosses loopback asynchronously.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !peer.gave_up() {
            assert!(Instant::now() < deadline, "a TCP client's FIN was never seen");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
