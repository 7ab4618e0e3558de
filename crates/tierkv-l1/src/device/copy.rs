//! The asynchronous copy engine: ordered streams of copies, events that fire when the copies
//! before them have landed, and completion callbacks.
//!
//! This is the one shape every move of the GPU data path takes (issue 14): a store's gather from
//! an engine's KV into an L1 slot, a retrieve's scatter back, L1 to and from pinned L2. A
//! [`CopyStream`] runs what is enqueued on it in order; [`CopyStream::wait`] makes later work
//! wait for an [`Event`] (the engine's, for a store: its kernels have written the blocks);
//! [`CopyStream::record`] returns an event that fires once everything enqueued before it has
//! completed, with the first failure if any did not. Nothing blocks the caller: completion is an
//! event, a callback ([`Event::on_complete`]), or a blocking [`Event::wait`] on a condition
//! variable, never a poll.
//!
//! Addresses are plain integers in the process's address space, each tagged with where it lies
//! ([`At`]): host pointers, and device pointers (`CUdeviceptr`s). A piece is one copy of one or
//! more evenly spaced rows, so a chunk's block across evenly spaced layers is one piece. The CUDA
//! backend turns a piece of several rows into one `cuMemcpy2DAsync`, a call's single-row pieces
//! between device memory into one `cuMemcpyBatchAsync` where the driver has it, and anything else
//! into one `cuMemcpyAsync` per row. The engine checks nothing about the addresses: the L1 slot
//! protocol and the registered regions' bounds checks decide what may be copied.
//!
//! How callers keep the rules (tested in this module on the emulated engine):
//! - a store reads an engine's block only after the engine's event: `wait(producer)` first;
//! - the guard of every slot a copy touches ([`crate::WriteAccess`] into a slot,
//!   [`crate::ReadAccess`] out of one) lives until that copy's event fires, dropped in its
//!   callback (or after `sync`), never when the copy is enqueued: the pin is what keeps a forced
//!   delete, an abort or a disconnect from freeing the slot, and another object from taking it,
//!   while the copy still moves bytes in or out of it. A store drops its write guard in the
//!   callback before `finish_write`, which refuses (`Busy`) a slot a writer pins;
//! - a chunk becomes visible only when its copy's event fired `Ok`: `finish_write` in the
//!   callback, `abort_write` on an error, so a failed copy is a miss, never a half chunk;
//! - a retrieve hands the engine an event that fires only after the last byte.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// Where an end of a piece lies: an address in host memory, or a device address
/// (`CUdeviceptr`). The emulated engine's device memory is host memory, so it copies both alike;
/// the CUDA engine picks the driver call (and a 2D copy's memory types) by them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// Host memory (pinned, or pageable).
    Host(u64),
    /// Device memory.
    Device(u64),
}

impl At {
    /// The address.
    pub fn address(self) -> u64 {
        match self {
            At::Host(a) | At::Device(a) => a,
        }
    }

    /// The end `by` bytes further on.
    pub fn offset(self, by: u64) -> At {
        match self {
            At::Host(a) => At::Host(a.wrapping_add(by)),
            At::Device(a) => At::Device(a.wrapping_add(by)),
        }
    }

    /// Whether the end is device memory.
    pub fn on_device(self) -> bool {
        matches!(self, At::Device(_))
    }
}

/// One copy: `rows` rows of `width` bytes, row `r` from `src + r * src_pitch` to
/// `dst + r * dst_pitch`. A contiguous copy is one row. Rows of one piece never overlap each
/// other or another piece of the same [`CopyStream::copy`] call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The first row's source.
    pub src: At,
    /// Bytes from one source row to the next.
    pub src_pitch: u64,
    /// The first row's destination.
    pub dst: At,
    /// Bytes from one destination row to the next.
    pub dst_pitch: u64,
    /// Bytes of each row.
    pub width: u64,
    /// How many rows.
    pub rows: u64,
}

impl Piece {
    /// One contiguous copy of `len` bytes.
    pub fn contiguous(src: At, dst: At, len: u64) -> Piece {
        Piece { src, src_pitch: len, dst, dst_pitch: len, width: len, rows: 1 }
    }

    /// Bytes the piece moves.
    pub fn bytes(&self) -> u64 {
        self.width.saturating_mul(self.rows)
    }

    /// Its rows as contiguous pieces, in order.
    pub fn row_pieces(&self) -> impl Iterator<Item = Piece> + '_ {
        (0..self.rows).map(move |r| {
            Piece::contiguous(
                self.src.offset(r.wrapping_mul(self.src_pitch)),
                self.dst.offset(r.wrapping_mul(self.dst_pitch)),
                self.width,
            )
        })
    }
}

/// Why a copy, or the stream it ran on, failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// The device or the emulation refused a copy.
    #[error("copy failed: {0}")]
    Failed(String),
    /// An event this stream waited on fired with an error, so the work after it did not run.
    #[error("an awaited event failed: {0}")]
    Upstream(String),
    /// The stream was shut down before the work ran.
    #[error("the copy stream stopped")]
    Stopped,
    /// The event did not fire within the time asked.
    #[error("the event did not fire in time")]
    Timeout,
}

type Callback = Box<dyn FnOnce(&Result<(), CopyError>) + Send>;

#[derive(Default)]
struct EventState {
    result: Option<Result<(), CopyError>>,
    callbacks: Vec<Callback>,
}

/// Fires once, with the result of the work it marks; callbacks and waiters learn it then.
#[derive(Clone)]
pub struct Event {
    inner: Arc<(Mutex<EventState>, Condvar)>,
}

impl Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("result", &self.inner.0.lock().result).finish()
    }
}

impl Default for Event {
    fn default() -> Self {
        Self::new()
    }
}

impl Event {
    /// An event nobody has fired yet: what a stream records, or what stands in for another
    /// party's (an engine's IPC event) in tests.
    pub fn new() -> Self {
        Event { inner: Arc::new((Mutex::new(EventState::default()), Condvar::new())) }
    }

    /// Fires the event. The first call decides the result; later calls change nothing. The
    /// callbacks run on this thread, after the lock is dropped. [`CopyError::Timeout`] is what
    /// a wait answers while the event has not fired, so an event fired with it carries
    /// [`CopyError::Upstream`] instead: a waiter never takes a fired event for one still to come.
    pub fn fire(&self, result: Result<(), CopyError>) {
        let result = match result {
            Err(CopyError::Timeout) => Err(CopyError::Upstream(CopyError::Timeout.to_string())),
            other => other,
        };
        let callbacks = {
            let mut state = self.inner.0.lock();
            if state.result.is_some() {
                return;
            }
            state.result = Some(result.clone());
            std::mem::take(&mut state.callbacks)
        };
        self.inner.1.notify_all();
        for callback in callbacks {
            callback(&result);
        }
    }

    /// The result, once fired.
    pub fn result(&self) -> Option<Result<(), CopyError>> {
        self.inner.0.lock().result.clone()
    }

    /// Runs `callback` with the result when the event fires (at once, on this thread, if it
    /// has). Otherwise it runs on the thread that fires the event: the stream's, not the caller's.
    pub fn on_complete(&self, callback: impl FnOnce(&Result<(), CopyError>) + Send + 'static) {
        let mut state = self.inner.0.lock();
        match state.result.clone() {
            Some(result) => {
                drop(state);
                callback(&result);
            }
            None => state.callbacks.push(Box::new(callback)),
        }
    }

    /// Blocks (on a condition variable) until the event fires or `timeout` passes.
    pub fn wait(&self, timeout: Duration) -> Result<(), CopyError> {
        let mut state = self.inner.0.lock();
        let deadline = tierkv_core::deadline_after(std::time::Instant::now(), timeout);
        while state.result.is_none() {
            if self.inner.1.wait_until(&mut state, deadline).timed_out() && state.result.is_none() {
                return Err(CopyError::Timeout);
            }
        }
        state.result.clone().unwrap_or(Err(CopyError::Stopped))
    }
}

/// A queue of copies that run in the order they were enqueued.
pub trait CopyStream: Send + Sync + Debug {
    /// Enqueues `pieces`; they run after everything enqueued before on this stream, in any order
    /// among themselves. Returns at once. An error says the backend refused a piece at once
    /// (some of the others may have been enqueued): the next recorded event, or
    /// [`CopyStream::sync`], carries it too, so a caller that only looks at events misses
    /// nothing; after an error the caller syncs before it lets go of any piece's memory.
    ///
    /// # Safety
    /// Every piece must name memory that stays valid, and that nobody else writes (nor, for the
    /// destination, reads), until an event recorded after it has fired.
    unsafe fn copy(&self, pieces: Vec<Piece>) -> Result<(), CopyError>;

    /// Work enqueued after this call waits until `event` has fired; if it fired with an error,
    /// that work is skipped and the next recorded event carries [`CopyError::Upstream`].
    fn wait(&self, event: &Event) -> Result<(), CopyError>;

    /// An event that fires once everything enqueued before it has completed: `Ok`, or the first
    /// error since the previous record.
    fn record(&self) -> Result<Event, CopyError>;

    /// Blocks (sleeping, never spinning) until everything enqueued so far has completed: what
    /// the event of a [`record`](CopyStream::record) now would say. A backend may wait on the
    /// calling thread instead of handing the wait to another.
    fn sync(&self) -> Result<(), CopyError> {
        let event = self.record()?;
        loop {
            match event.wait(Duration::from_secs(3600)) {
                Err(CopyError::Timeout) => {}
                done => return done,
            }
        }
    }
}

/// A source of copy streams: one backend's engine.
pub trait CopyEngine: Send + Sync + Debug {
    /// "emulated" or "cuda".
    fn backend(&self) -> &'static str;

    /// A new stream.
    fn stream(&self) -> Result<Box<dyn CopyStream>, CopyError>;
}
