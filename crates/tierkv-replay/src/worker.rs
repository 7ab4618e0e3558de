//! A simulated TP worker: one process per rank, one daemon session each, with a shared-memory
//! KV buffer registered like an engine's. The replay drives it with one JSON line per step on
//! its stdin and reads one JSON line per step from its stdout.
//!
//! A trace chunk `k` is the daemon chunk `ChunkId(k)` in the worker's namespace, and its bytes
//! are [`payload::fill`]'s for that id and the worker's tag (its rank, or one shared tag under
//! MLA), so every retrieved byte can be checked. Retrieves land in the first half of the buffer,
//! stores are filled in the second half, so a retrieve that copies nothing cannot leave a stored
//! copy of the right bytes behind; the first and last word of each retrieve block are also
//! poisoned before the copy.
//!
//! Stores do not wait for the daemon's copy: a step sends its store and answers the replay at
//! once, and the worker collects the store's reply at the start of its next step (or on
//! [`Step::Drain`]), before it looks anything up or writes the store half of its buffer again.
//! The daemon answers a connection in order, so the next lookup sees every chunk stored before
//! it, exactly as with a blocking store; what the pipelining saves is the worker's wait for the
//! copy while it answers the replay and reads its next step. The store time a worker reports is
//! the time it spent blocked on stores: sending them and waiting for their replies.
//!
//! A rank's retrieve goes the same way within its step: sent, then the store half filled and
//! the store sent while the daemon copies the hit, then collected and checked. Its time is the
//! time blocked on it: sending it and waiting for its reply after the store is sent.

use std::io::{BufRead, BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tierkv_client::payload::{self, SHARED_TAG};
use tierkv_client::proto::{
    ChunkBlocks, ChunkId, Hello, NamespaceDecl, PROTOCOL_VERSION, ReplyBody, RequestBody, Role,
};
use tierkv_client::{Client, ClientError, Pending, SharedBuffer};

use crate::ReplayError;
use crate::process::{Reaped, die_with_parent};

/// How long a worker waits for a lookup's prefetch from the lower tiers.
const WAIT: Duration = Duration::from_secs(60);

/// How long a worker waits for the daemon to answer its hello.
pub const HELLO_WITHIN: Duration = Duration::from_secs(30);

/// How long the replay waits for a worker's answer to one step: a step makes at most four calls
/// that wait (a store's collection, a lookup and its wait, a release, a retrieve's collection),
/// each of which the worker gives up on after `WAIT` and a half minute, so a worker later than
/// all four and a minute more is stopped or stuck itself.
const ANSWER_WITHIN: Duration = Duration::from_secs(4 * (WAIT.as_secs() + 30) + 60);

/// How often the replay, waiting for a worker, looks whether it was interrupted.
const INTERRUPT_POLL: Duration = Duration::from_millis(100);

/// Who a worker is: the hello it sends and the buffer it registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The daemon's Unix socket.
    pub socket: PathBuf,
    /// The namespace's model name (a replay uses a fresh one, so runs never share chunks).
    pub model: String,
    /// This worker's rank.
    pub rank: u16,
    /// The TP group's size.
    pub tp: u16,
    /// Whether the ranks share one copy of the KV.
    pub mla: bool,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// Tokens per chunk (for the hello and the hit's tokens).
    pub chunk_tokens: u64,
    /// The most chunks one request names: the buffer holds twice that many blocks.
    pub max_chunks: u64,
}

impl WorkerSpec {
    /// The command-line arguments of `tierkv replay-worker` that recreate this spec.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--socket".into(),
            self.socket.display().to_string(),
            "--model".into(),
            self.model.clone(),
            "--rank".into(),
            self.rank.to_string(),
            "--tp".into(),
            self.tp.to_string(),
            "--chunk-bytes".into(),
            self.chunk_bytes.to_string(),
            "--chunk-tokens".into(),
            self.chunk_tokens.to_string(),
            "--max-chunks".into(),
            self.max_chunks.to_string(),
        ];
        if self.mla {
            args.push("--mla".into());
        }
        args
    }
}

/// One step, from the replay to a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Step {
    /// A rank that owns its KV does a whole request: look up, wait, retrieve and check the hit,
    /// release, store the chunks after the hit.
    Request {
        /// The request's chunks, root first.
        chunks: Vec<u64>,
    },
    /// The looking-up rank of an MLA group: look up and wait; the lookup stays open.
    Lookup {
        /// The request's chunks, root first.
        chunks: Vec<u64>,
    },
    /// Any rank of an MLA group: retrieve and check the hit of an open lookup.
    Retrieve {
        /// The lookup.
        lookup: u64,
        /// The hit's chunks.
        chunks: Vec<u64>,
    },
    /// The looking-up rank of an MLA group: release the lookup if it hit nothing (otherwise the
    /// retrieves closed it) and store the chunks after the hit.
    Finish {
        /// The lookup.
        lookup: u64,
        /// The request's chunks, root first.
        chunks: Vec<u64>,
        /// Chunks of the hit.
        hit: u32,
    },
    /// Wait for every store still in flight and report what they did (the replay's last step).
    Drain,
}

/// What a worker did in one step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Done {
    /// The error, if the step failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The lookup made.
    pub lookup: u64,
    /// Chunks of the lookup's hit.
    pub hit: u32,
    /// The hit's chunks per tier, L1 first.
    pub per_tier: Vec<u32>,
    /// Lookup and wait, in microseconds.
    pub lookup_us: u64,
    /// Time blocked on the retrieve, in microseconds: sending it and waiting for its reply after
    /// the store is sent (0 when nothing was retrieved).
    pub retrieve_us: u64,
    /// Time blocked on stores, in microseconds: sending this step's store and waiting for the
    /// replies of earlier steps' stores collected in this step.
    pub store_us: u64,
    /// Chunks copied out and checked byte for byte.
    pub retrieved: u64,
    /// Chunks stored, by the stores whose replies this step collected (a store's reply is
    /// collected by the worker's next step, or by [`Step::Drain`]).
    pub stored: u64,
    /// Chunks the daemon already had when asked to store them.
    pub present: u64,
    /// Chunks the daemon refused to store (no room).
    pub refused: u64,
}

/// The worker's side: a session and its buffer.
struct Worker {
    client: Client,
    buffer: SharedBuffer,
    buffer_id: u32,
    tag: u64,
    max_chunks: u64,
    /// Stores sent whose replies have not been collected, oldest first. Their blocks (the
    /// buffer's second half) must not be written until they are.
    stores: Vec<Pending>,
}

impl Worker {
    fn open(spec: &WorkerSpec) -> Result<Worker, ClientError> {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            role: Role::Worker,
            rank: spec.rank,
            tp_size: spec.tp,
            world_size: Some(spec.tp),
            mla: spec.mla,
            namespaces: vec![NamespaceDecl {
                model: spec.model.clone(),
                cache_salt: String::new(),
            }],
            chunk_bytes: spec.chunk_bytes,
            chunk_tokens: u32::try_from(spec.chunk_tokens).unwrap_or(u32::MAX),
            token: None,
        };
        let mut client = Client::connect_unix_within(&spec.socket, hello, HELLO_WITHIN)?;
        client.set_timeout(Some(WAIT + Duration::from_secs(30)))?;
        let max_chunks = spec.max_chunks.max(1);
        let mut buffer = SharedBuffer::new(spec.chunk_bytes, max_chunks.saturating_mul(2))?;
        // Committed now, so that no timed copy pays the first write's page faults.
        for block in 0..buffer.blocks() {
            if let Some(bytes) = buffer.block_mut(block) {
                bytes.fill(0);
            }
        }
        let buffer_id = client.register_buffer(&buffer)?;
        let tag = if spec.mla { SHARED_TAG } else { u64::from(spec.rank) };
        Ok(Worker { client, buffer, buffer_id, tag, max_chunks, stores: Vec::new() })
    }

    fn step(&mut self, step: &Step) -> Result<Done, String> {
        let mut done = Done::default();
        // Every step first settles the stores of the last one: a lookup must follow them, and
        // a store or warm-up writes the blocks they name.
        self.collect_stores(&mut done)?;
        match step {
            Step::Request { chunks } => {
                self.lookup(chunks, &mut done)?;
                let hit = chunks.get(..done.hit as usize).ok_or_else(|| {
                    format!("lookup {} hit {} of {} chunks", done.lookup, done.hit, chunks.len())
                })?;
                // The retrieve copies into the buffer's first half while the worker fills the
                // second half for its store; the hit's bytes are checked once both are sent.
                let retrieving = self.submit_retrieve(done.lookup, hit, &mut done)?;
                self.finish(done.lookup, chunks, done.hit, &mut done)?;
                self.collect_retrieve(retrieving, hit, &mut done)?;
            }
            Step::Lookup { chunks } => self.lookup(chunks, &mut done)?,
            Step::Retrieve { lookup, chunks } => {
                let retrieving = self.submit_retrieve(*lookup, chunks, &mut done)?;
                self.collect_retrieve(retrieving, chunks, &mut done)?;
            }
            Step::Finish { lookup, chunks, hit } => {
                self.finish(*lookup, chunks, *hit, &mut done)?
            }
            Step::Drain => {}
        }
        Ok(done)
    }

    /// Waits for every store in flight and adds what they did (and the wait) to `done`.
    fn collect_stores(&mut self, done: &mut Done) -> Result<(), String> {
        if self.stores.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        for pending in std::mem::take(&mut self.stores) {
            let stored = self.client.finish_store(pending).map_err(|e| format!("store: {e}"))?;
            done.stored += u64::from(stored.stored);
            done.present += u64::from(stored.present);
            done.refused += stored.refused.len() as u64;
        }
        done.store_us += micros(started);
        Ok(())
    }

    fn lookup(&mut self, chunks: &[u64], done: &mut Done) -> Result<(), String> {
        if chunks.len() as u64 > self.max_chunks {
            return Err(format!("{} chunks exceed the buffer's {}", chunks.len(), self.max_chunks));
        }
        let started = Instant::now();
        let ids = chunks.iter().map(|c| chunk_id(*c)).collect();
        let lookup = self.client.lookup(0, ids).map_err(|e| format!("lookup: {e}"))?;
        let outcome = match lookup.outcome {
            Some(outcome) => outcome,
            None => self.client.wait(lookup.id, WAIT).map_err(|e| format!("wait: {e}"))?,
        };
        done.lookup_us = micros(started);
        done.lookup = lookup.id;
        done.hit = outcome.hit_chunks;
        done.per_tier = outcome.per_tier;
        Ok(())
    }

    /// Sends a retrieve of `chunks` into the first blocks of the buffer (poisoned first) without
    /// waiting for it; `None` when there is nothing to retrieve.
    fn submit_retrieve(
        &mut self,
        lookup: u64,
        chunks: &[u64],
        done: &mut Done,
    ) -> Result<Option<Pending>, String> {
        if chunks.is_empty() {
            return Ok(None);
        }
        let refs: Vec<ChunkBlocks> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| ChunkBlocks::one(chunk_id(*c), i as u64))
            .collect();
        for r in &refs {
            let block = self.buffer.block_mut(r.blocks[0]).ok_or("block out of range")?;
            poison(block);
        }
        let started = Instant::now();
        let pending = self
            .client
            .submit(RequestBody::Retrieve {
                lookup,
                buffer: self.buffer_id,
                chunks: refs,
                done_event: None,
            })
            .map_err(|e| format!("retrieve: {e}"))?;
        done.retrieve_us += micros(started);
        Ok(Some(pending))
    }

    /// Waits for a retrieve sent by [`Worker::submit_retrieve`] and checks every byte it copied.
    /// The time blocked here is added to the retrieve's.
    fn collect_retrieve(
        &mut self,
        pending: Option<Pending>,
        chunks: &[u64],
        done: &mut Done,
    ) -> Result<(), String> {
        let Some(pending) = pending else { return Ok(()) };
        let started = Instant::now();
        let reply = self.client.collect(pending).map_err(|e| format!("retrieve: {e}"))?;
        done.retrieve_us += micros(started);
        let ReplyBody::Retrieved { bytes, .. } = reply else {
            return Err(format!("retrieve answered {reply:?}"));
        };
        let expected = chunks.len() as u64 * self.buffer.block_bytes();
        if bytes != expected {
            return Err(format!("retrieve copied {bytes} bytes, {expected} expected"));
        }
        for (i, c) in chunks.iter().enumerate() {
            let block = self.buffer.block(i as u64).ok_or("block out of range")?;
            if !payload::holds(block, chunk_id(*c), self.tag) {
                return Err(format!("retrieved chunk {c} has the wrong bytes"));
            }
        }
        done.retrieved = chunks.len() as u64;
        Ok(())
    }

    fn finish(
        &mut self,
        lookup: u64,
        chunks: &[u64],
        hit: u32,
        done: &mut Done,
    ) -> Result<(), String> {
        // A retrieve returns its reader's share; the last reader's closes the lookup. Only a
        // lookup nobody retrieved from is still open.
        if hit == 0 {
            self.client.release(lookup).map_err(|e| format!("release: {e}"))?;
        }
        let missing = chunks.get(hit as usize..).unwrap_or_default();
        if missing.is_empty() {
            return Ok(());
        }
        // Root first, as an engine sends a chain: a batch that runs out of room keeps a prefix,
        // and the daemon makes the chunks visible leaf first.
        let refs: Vec<ChunkBlocks> = missing
            .iter()
            .enumerate()
            .map(|(i, c)| ChunkBlocks::one(chunk_id(*c), self.max_chunks + i as u64))
            .collect();
        for r in &refs {
            let block = self.buffer.block_mut(r.blocks[0]).ok_or("block out of range")?;
            payload::fill(block, r.chunk, self.tag);
        }
        let started = Instant::now();
        let pending =
            self.client.submit_store(0, self.buffer_id, refs).map_err(|e| format!("store: {e}"))?;
        self.stores.push(pending);
        done.store_us += micros(started);
        Ok(())
    }
}

/// The daemon chunk of trace chunk `k`.
pub fn chunk_id(k: u64) -> ChunkId {
    ChunkId(u128::from(k))
}

/// Marks a block as not yet copied into, at both ends.
fn poison(block: &mut [u8]) {
    let len = block.len();
    let n = len.min(8);
    block[..n].fill(0xa5);
    block[len - n..].fill(0x5a);
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Whether `pipe` has something to read (or was closed) within `timeout`; a signal ends the
/// wait early, with `false`.
fn readable(pipe: &impl AsRawFd, timeout: Duration) -> std::io::Result<bool> {
    ready(pipe, libc::POLLIN, timeout)
}

/// Whether `pipe` has room to write into (or its reader is gone) within `timeout`; a signal
/// ends the wait early, with `false`.
fn writable(pipe: &impl AsRawFd, timeout: Duration) -> std::io::Result<bool> {
    ready(pipe, libc::POLLOUT, timeout)
}

fn ready(pipe: &impl AsRawFd, events: libc::c_short, timeout: Duration) -> std::io::Result<bool> {
    let mut fd = libc::pollfd { fd: pipe.as_raw_fd(), events, revents: 0 };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one pollfd, alive for the call.
    match unsafe { libc::poll(&mut fd, 1, ms) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted { Ok(false) } else { Err(err) }
        }
    }
}

/// Runs a worker on stdin and stdout until stdin closes: the body of `tierkv replay-worker`.
pub fn serve_worker(spec: &WorkerSpec) -> Result<(), ReplayError> {
    let mut worker = Worker::open(spec)
        .map_err(|e| ReplayError::Worker { rank: spec.rank, message: format!("connect: {e}") })?;
    let stdin = std::io::stdin().lock();
    let mut stdout = BufWriter::new(std::io::stdout().lock());
    let io = |e| ReplayError::io("answer the replay", e);
    writeln!(stdout, "{{\"ready\":true}}").and_then(|()| stdout.flush()).map_err(io)?;
    for line in stdin.lines() {
        let line = line.map_err(|e| ReplayError::io("read a step", e))?;
        let done = match serde_json::from_str::<Step>(&line) {
            Ok(step) => {
                worker.step(&step).unwrap_or_else(|e| Done { error: Some(e), ..Done::default() })
            }
            Err(e) => Done { error: Some(format!("not a step: {e}")), ..Done::default() },
        };
        let text = serde_json::to_string(&done)
            .map_err(|e| ReplayError::Worker { rank: spec.rank, message: e.to_string() })?;
        writeln!(stdout, "{text}").and_then(|()| stdout.flush()).map_err(io)?;
    }
    // The replay drains before it ends; a worker whose stdin closed early still settles its
    // stores, so a failed one is reported rather than dropped with the session.
    worker
        .collect_stores(&mut Done::default())
        .map_err(|message| ReplayError::Worker { rank: spec.rank, message })?;
    worker
        .client
        .end()
        .map_err(|e| ReplayError::Worker { rank: spec.rank, message: format!("end: {e}") })
}

/// The replay's handle on a worker process.
pub struct WorkerProcess {
    rank: u16,
    /// Non-blocking: a step is written in polls, as answers are read.
    stdin: ChildStdin,
    stdout: ChildStdout,
    /// What the worker wrote past the last answer read.
    unread: Vec<u8>,
    line: String,
    process: Reaped,
    /// Set (by a signal handler) to stop waiting for the worker's answers.
    interrupt: Option<Arc<AtomicBool>>,
}

impl WorkerProcess {
    /// Starts `program replay-worker` for `spec` and waits until its session is open. Every
    /// wait for its answers ends within seven minutes (four of its own calls' deadlines and a
    /// minute), or as soon as `interrupt` is set ([`ReplayError::Interrupted`]), even if the
    /// worker (or the daemon it waits for) is stopped.
    pub fn start(
        program: &Path,
        spec: &WorkerSpec,
        interrupt: Option<Arc<AtomicBool>>,
    ) -> Result<WorkerProcess, ReplayError> {
        let mut child = die_with_parent(
            Command::new(program)
                .arg("replay-worker")
                .args(spec.to_args())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .map_err(|e| ReplayError::io(format!("start {} replay-worker", program.display()), e))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(ReplayError::Worker { rank: spec.rank, message: "no pipes".into() });
        };
        set_nonblocking(&stdin)
            .map_err(|e| ReplayError::io("make the pipe to replay-worker non-blocking", e))?;
        let mut worker = WorkerProcess {
            rank: spec.rank,
            stdin,
            stdout,
            unread: Vec::new(),
            line: String::new(),
            process: Reaped(child),
            interrupt,
        };
        worker.read_line()?;
        if !worker.line.contains("\"ready\":true") {
            return Err(worker.fail(format!("did not start: {}", worker.line.trim())));
        }
        Ok(worker)
    }

    /// Sends a step without waiting for its answer (so ranks work at once). A step longer than
    /// the pipe holds is written as the worker reads it, within the wait for an answer, and an
    /// interrupt ends the write as it ends that wait: a stopped worker never holds the replay
    /// in a blocked write.
    pub fn send(&mut self, step: &Step) -> Result<(), ReplayError> {
        let mut text = serde_json::to_vec(step).map_err(|e| self.fail(e.to_string()))?;
        text.push(b'\n');
        let deadline = Instant::now() + ANSWER_WITHIN;
        let mut rest = text.as_slice();
        while !rest.is_empty() {
            self.check_interrupt()?;
            match self.stdin.write(rest) {
                Ok(0) => return Err(self.fail("send a step: the pipe took nothing".into())),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = self.left(deadline, "did not read its step")?;
                    writable(&self.stdin, left.min(INTERRUPT_POLL))
                        .map_err(|e| self.fail(format!("wait to send a step: {e}")))?;
                }
                Err(e) => return Err(self.fail(format!("send a step: {e}"))),
            }
        }
        Ok(())
    }

    /// Reads the answer to the oldest step sent; a failed step is an error.
    pub fn receive(&mut self) -> Result<Done, ReplayError> {
        self.read_line()?;
        let done: Done = serde_json::from_str(&self.line)
            .map_err(|e| self.fail(format!("unreadable answer {:?}: {e}", self.line.trim())))?;
        match done.error {
            Some(error) => Err(self.fail(error)),
            None => Ok(done),
        }
    }

    /// Ends the worker: it closes its session (the daemon returns whatever it held) and exits.
    pub fn close(self) -> Result<(), ReplayError> {
        let WorkerProcess { rank, stdin, mut process, .. } = self;
        drop(stdin);
        if process.reap(Duration::from_secs(30)) {
            Ok(())
        } else {
            Err(ReplayError::Worker { rank, message: "did not end its session cleanly".into() })
        }
    }

    /// Reads the worker's next line into `line`. It waits in short polls, not in a blocking
    /// read: a read of a pipe is restarted after a signal, so a replay blocked in one would not
    /// see its interrupt while the worker (or the daemon it waits for) does not answer.
    fn read_line(&mut self) -> Result<(), ReplayError> {
        let deadline = Instant::now() + ANSWER_WITHIN;
        loop {
            if let Some(end) = self.unread.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.unread.drain(..=end).collect();
                self.line = String::from_utf8_lossy(&line).into_owned();
                return Ok(());
            }
            self.check_interrupt()?;
            let left = self.left(deadline, "did not answer")?;
            match readable(&self.stdout, left.min(INTERRUPT_POLL)) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => return Err(self.fail(format!("wait for its answer: {e}"))),
            }
            let mut chunk = [0u8; 4096];
            match self.stdout.read(&mut chunk) {
                Ok(0) => return Err(self.fail("exited".into())),
                Ok(n) => self.unread.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.fail(format!("read its answer: {e}"))),
            }
        }
    }

    fn check_interrupt(&self) -> Result<(), ReplayError> {
        match &self.interrupt {
            Some(flag) if flag.load(Ordering::Relaxed) => Err(ReplayError::Interrupted),
            _ => Ok(()),
        }
    }

    /// The time left before `deadline`; past it, the worker `did` what the error says.
    fn left(&self, deadline: Instant, did: &str) -> Result<Duration, ReplayError> {
        deadline.checked_duration_since(Instant::now()).ok_or_else(|| {
            self.fail(format!("{did} within {} s (stopped, or stuck)", ANSWER_WITHIN.as_secs()))
        })
    }

    fn fail(&self, message: String) -> ReplayError {
        ReplayError::Worker { rank: self.rank, message }
    }
}

/// Sets `O_NONBLOCK` on `pipe`.
fn set_nonblocking(pipe: &impl AsRawFd) -> std::io::Result<()> {
    let fd = pipe.as_raw_fd();
    // SAFETY: fcntl on a descriptor the caller owns, with no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::mpsc;

    use super::*;

    /// A `replay-worker` that says it is ready and then reads nothing: stopped, as far as the
    /// replay can tell.
    fn deaf_worker(dir: &Path) -> PathBuf {
        let program = dir.join("deaf-worker");
        std::fs::write(&program, "#!/bin/sh\necho '{\"ready\":true}'\nexec sleep 600\n")
            .expect("write the script");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))
            .expect("make it executable");
        program
    }

    fn spec() -> WorkerSpec {
        WorkerSpec {
            socket: PathBuf::from("/nonexistent"),
            model: "deaf".into(),
            rank: 0,
            tp: 1,
            mla: false,
            chunk_bytes: 4096,
            chunk_tokens: 16,
            max_chunks: 1 << 20,
        }
    }

    /// A step longer than the pipe holds, sent to a worker that never reads it: the send waits
    /// as an answer would, and the interrupt ends it. A blocking write would hold the replay
    /// (and its Ctrl-C) until the worker read.
    #[test]
    fn an_interrupt_ends_a_send_to_a_worker_that_reads_nothing() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let interrupt = Arc::new(AtomicBool::new(false));
        let mut worker =
            WorkerProcess::start(&deaf_worker(dir.path()), &spec(), Some(interrupt.clone()))
                .expect("the worker starts");
        // 200,000 chunk ids: over 2 MB of JSON, far past a pipe's 64 KiB.
        let step = Step::Request { chunks: (u64::MAX - 200_000..u64::MAX).collect() };
        let (sent, outcome) = mpsc::channel();
        let sender = std::thread::spawn(move || {
            let _ = sent.send(worker.send(&step));
        });
        // The write is stuck on a full pipe: no outcome yet.
        assert!(outcome.recv_timeout(Duration::from_millis(300)).is_err(), "the send returned");
        interrupt.store(true, Ordering::Relaxed);
        let result = outcome.recv_timeout(Duration::from_secs(30)).expect("the send stays blocked");
        assert!(matches!(result, Err(ReplayError::Interrupted)), "{result:?}");
        sender.join().expect("the sending thread");
    }
}
