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
//! Addresses are plain integers in the process's address space: host pointers for the emulated
//! engine, and under CUDA's unified addressing device pointers too, so one copy call serves
//! every direction (the CUDA backend resolves them with `cuMemcpyAsync`, or batches them with
//! `cuMemcpyBatchAsync`). The engine checks nothing about them: the L1 slot protocol and the
//! registered regions' bounds checks decide what may be copied, as for the synchronous copies.
//!
//! How callers keep the rules (tested in this module on the emulated engine):
//! - a store reads an engine's block only after the engine's event: `wait(producer)` first;
//! - a chunk becomes visible only when its copy's event fired `Ok`: `finish_write` in the
//!   callback, `abort_write` on an error, so a failed copy is a miss, never a half chunk;
//! - a retrieve hands the engine an event that fires only after the last byte.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// One contiguous copy of `len` bytes from `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
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
    /// callbacks run on this thread, after the lock is dropped.
    pub fn fire(&self, result: Result<(), CopyError>) {
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
        let deadline = std::time::Instant::now() + timeout;
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
    /// Enqueues `pieces`; they run after everything enqueued before on this stream. Returns at
    /// once.
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
}

/// A source of copy streams: one backend's engine.
pub trait CopyEngine: Send + Sync + Debug {
    /// "emulated" or "cuda".
    fn backend(&self) -> &'static str;

    /// A new stream.
    fn stream(&self) -> Result<Box<dyn CopyStream>, CopyError>;
}
