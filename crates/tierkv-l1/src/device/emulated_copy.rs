//! The copy engine on host threads: the semantics of a GPU stream, emulated.
//!
//! Each stream is a thread fed by a channel, so a copy completes later and out of the caller's
//! thread, exactly as a DMA on a CUDA stream does, and every ordering rule of the GPU data path
//! runs in CI without a GPU. Copies are `memcpy`s between host addresses, a row at a time; the
//! emulated device's memory is host memory, so both kinds of [`At`](super::At) are addresses.
//! A fault hook fails the pieces it picks, for the tests of what a failed copy must never leave
//! behind.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::copy::{CopyEngine, CopyError, CopyStream, Event, Piece};

/// Picks the pieces that fail (tests only inject faults; the default fails none).
pub type FaultHook = Arc<dyn Fn(&Piece) -> bool + Send + Sync>;

/// How long a stream thread waits on an event before it looks whether it should stop.
const STOP_CHECK: Duration = Duration::from_millis(20);

/// Streams on host threads.
#[derive(Clone, Default)]
pub struct EmulatedCopyEngine {
    fault: Option<FaultHook>,
}

impl std::fmt::Debug for EmulatedCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedCopyEngine").field("faults", &self.fault.is_some()).finish()
    }
}

impl EmulatedCopyEngine {
    /// An engine whose copies all succeed.
    pub fn new() -> Self {
        Self::default()
    }

    /// An engine that fails every piece `fault` picks (the piece is not copied).
    pub fn with_faults(fault: FaultHook) -> Self {
        EmulatedCopyEngine { fault: Some(fault) }
    }
}

impl CopyEngine for EmulatedCopyEngine {
    fn backend(&self) -> &'static str {
        "emulated"
    }

    fn stream(&self) -> Result<Box<dyn CopyStream>, CopyError> {
        Ok(Box::new(EmulatedStream::start(self.fault.clone())?))
    }
}

enum Op {
    Copy(Vec<Piece>),
    Wait(Event),
    Record(Event),
}

/// One emulated stream: a thread running its ops in order.
pub struct EmulatedStream {
    sender: Mutex<Option<mpsc::Sender<Op>>>,
    stopping: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for EmulatedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedStream").finish_non_exhaustive()
    }
}

impl EmulatedStream {
    fn start(fault: Option<FaultHook>) -> Result<Self, CopyError> {
        let (sender, receiver) = mpsc::channel();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let thread = std::thread::Builder::new()
            .name("tierkv-copy".into())
            .spawn(move || run(&receiver, &stop, fault.as_ref()))
            .map_err(|e| CopyError::Failed(format!("cannot start a copy thread: {e}")))?;
        Ok(EmulatedStream {
            sender: Mutex::new(Some(sender)),
            stopping,
            thread: Mutex::new(Some(thread)),
        })
    }

    fn send(&self, op: Op) -> Result<(), CopyError> {
        match &*self.sender.lock() {
            Some(sender) => sender.send(op).map_err(|_| CopyError::Stopped),
            None => Err(CopyError::Stopped),
        }
    }
}

impl CopyStream for EmulatedStream {
    unsafe fn copy(&self, pieces: Vec<Piece>) -> Result<(), CopyError> {
        self.send(Op::Copy(pieces))
    }

    fn wait(&self, event: &Event) -> Result<(), CopyError> {
        self.send(Op::Wait(event.clone()))
    }

    fn record(&self) -> Result<Event, CopyError> {
        let event = Event::new();
        self.send(Op::Record(event.clone()))?;
        Ok(event)
    }
}

impl Drop for EmulatedStream {
    /// Stops the stream without hanging: work not yet started is skipped and its events fire
    /// with [`CopyError::Stopped`]; a wait on an event nobody fires is abandoned.
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        self.sender.lock().take();
        if let Some(thread) = self.thread.lock().take() {
            // Dropped by a callback on its own thread (it held the stream's last owner): that
            // thread skips what is left, firing it `Stopped`, and ends by itself; it cannot
            // join itself. As `CudaCopyStream` does.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// The stream's thread: ops in order; the first failure since the last record is what the next
/// recorded event carries.
fn run(receiver: &mpsc::Receiver<Op>, stopping: &AtomicBool, fault: Option<&FaultHook>) {
    let mut failed: Option<CopyError> = None;
    while let Ok(op) = receiver.recv() {
        let stop = stopping.load(Ordering::Acquire);
        match op {
            Op::Copy(_) if stop || failed.is_some() => {}
            Op::Copy(pieces) => {
                'pieces: for piece in pieces {
                    if fault.is_some_and(|f| f(&piece)) {
                        failed = Some(CopyError::Failed(format!("injected fault on {piece:?}")));
                        break;
                    }
                    for row in piece.row_pieces() {
                        let Ok(len) = usize::try_from(row.width) else {
                            failed = Some(CopyError::Failed(format!("{piece:?} is too long")));
                            break 'pieces;
                        };
                        // SAFETY: the caller of `copy` promised both ranges stay valid and
                        // untouched by anyone else until an event recorded after them fires,
                        // which happens only below, after this copy.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                row.src.address() as usize as *const u8,
                                row.dst.address() as usize as *mut u8,
                                len,
                            );
                        }
                    }
                }
            }
            Op::Wait(event) => {
                if let Err(e) = wait_unless_stopping(&event, stopping) {
                    failed.get_or_insert(e);
                }
            }
            Op::Record(event) => {
                let result = if stopping.load(Ordering::Acquire) {
                    Err(CopyError::Stopped)
                } else {
                    failed.take().map_or(Ok(()), Err)
                };
                event.fire(result);
            }
        }
    }
}

fn wait_unless_stopping(event: &Event, stopping: &AtomicBool) -> Result<(), CopyError> {
    loop {
        match event.wait(STOP_CHECK) {
            Ok(()) => return Ok(()),
            Err(CopyError::Timeout) if !stopping.load(Ordering::Acquire) => continue,
            Err(CopyError::Timeout) => return Err(CopyError::Stopped),
            Err(e) => return Err(CopyError::Upstream(e.to_string())),
        }
    }
}
