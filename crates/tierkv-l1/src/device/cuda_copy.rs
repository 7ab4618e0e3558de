//! The copy engine on a CUDA device: [`CopyStream`]s over the daemon's own CUDA streams.
//!
//! - `copy` enqueues one `cuMemcpyAsync` per piece (addresses are unified: device pointers and
//!   pinned host pointers alike); a piece the driver refuses at enqueue is the stream's failure,
//!   carried by the next recorded event.
//! - `record` records a CUDA event (blocking-sync, no timing) and hands it to the stream's event
//!   thread, which waits for it in `cuEventSynchronize` (the thread sleeps in the driver; nothing
//!   spins) and then fires the [`Event`] with the first failure since the previous record.
//! - `wait` on an event that has not fired enqueues a host function (`cuLaunchHostFunc`) that
//!   blocks the stream until it fires. If it fires with an error, the work after it still runs on
//!   the device (a stream cannot skip what is enqueued), but the next recorded event carries
//!   [`CopyError::Upstream`], so its result is discarded: a miss, never a visible chunk.
//!
//! The file is always compiled (cudarc loads the driver at run time); nothing here touches
//! cudarc before [`cuda_available`](super::cuda_available) found the driver library.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, result, sys};
use parking_lot::Mutex;

use super::copy::{CopyEngine, CopyError, CopyStream, Event, Piece};
use super::{DeviceError, cuda_available};

/// How long a host function blocked on an event waits before it looks whether its stream stops.
const STOP_CHECK: Duration = Duration::from_millis(20);

/// Streams on one CUDA device.
#[derive(Debug)]
pub struct CudaCopyEngine {
    context: Arc<CudaContext>,
}

impl CudaCopyEngine {
    /// The engine of device `ordinal`; [`DeviceError::CudaUnavailable`] without a driver or
    /// device.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        cuda_available()?;
        let context = CudaContext::new(ordinal)
            .map_err(|e| DeviceError::CudaUnavailable(format!("device {ordinal}: {e}")))?;
        Ok(CudaCopyEngine { context })
    }
}

impl CopyEngine for CudaCopyEngine {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn stream(&self) -> Result<Box<dyn CopyStream>, CopyError> {
        Ok(Box::new(CudaCopyStream::start(Arc::clone(&self.context))?))
    }
}

/// A recorded CUDA event on its way to the event thread.
struct Recorded {
    cuda: sys::CUevent,
    event: Event,
}

// SAFETY: a CUevent is a driver handle usable from any thread that binds its context.
unsafe impl Send for Recorded {}

/// What the stream and its host functions share.
struct Shared {
    /// The first failure since the last record.
    failed: Mutex<Option<CopyError>>,
    stopping: AtomicBool,
}

impl Shared {
    fn fail(&self, error: CopyError) {
        self.failed.lock().get_or_insert(error);
    }
}

/// One CUDA stream and its event thread.
pub struct CudaCopyStream {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    shared: Arc<Shared>,
    sender: Mutex<Option<mpsc::Sender<Recorded>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CudaCopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyStream").finish_non_exhaustive()
    }
}

fn failed(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CopyError + '_ {
    move |e| CopyError::Failed(format!("{what}: {e}"))
}

impl CudaCopyStream {
    fn start(context: Arc<CudaContext>) -> Result<Self, CopyError> {
        context.bind_to_thread().map_err(failed("cannot bind the device"))?;
        let stream = context.new_stream().map_err(failed("cannot create a stream"))?;
        let shared =
            Arc::new(Shared { failed: Mutex::new(None), stopping: AtomicBool::new(false) });
        let (sender, receiver) = mpsc::channel::<Recorded>();
        let (ctx, state) = (Arc::clone(&context), Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("tierkv-cuda-events".into())
            .spawn(move || events(&ctx, &receiver, &state))
            .map_err(|e| CopyError::Failed(format!("cannot start the event thread: {e}")))?;
        Ok(CudaCopyStream {
            context,
            stream,
            shared,
            sender: Mutex::new(Some(sender)),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn bind(&self) -> Result<(), CopyError> {
        self.context.bind_to_thread().map_err(failed("cannot bind the device"))
    }
}

impl CopyStream for CudaCopyStream {
    unsafe fn copy(&self, pieces: Vec<Piece>) -> Result<(), CopyError> {
        self.bind()?;
        let stream = self.stream.cu_stream();
        for piece in pieces {
            let Ok(len) = usize::try_from(piece.len) else {
                self.shared.fail(CopyError::Failed(format!("{piece:?} is too long")));
                break;
            };
            // SAFETY: the caller promised both ranges stay valid and untouched until an event
            // recorded after this copy fires; the stream is ours.
            let rc = unsafe { sys::cuMemcpyAsync(piece.dst, piece.src, len, stream) };
            if let Err(e) = rc.result() {
                self.shared.fail(CopyError::Failed(format!("cuMemcpyAsync {piece:?}: {e}")));
                break;
            }
        }
        Ok(())
    }

    fn wait(&self, event: &Event) -> Result<(), CopyError> {
        match event.result() {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => {
                self.shared.fail(CopyError::Upstream(e.to_string()));
                return Ok(());
            }
            None => {}
        }
        self.bind()?;
        let arg = Box::into_raw(Box::new((event.clone(), Arc::clone(&self.shared))));
        // SAFETY: `arg` is a leaked box that `block_on_event` takes back exactly once; if the
        // launch fails, it is taken back here instead.
        let launched = unsafe {
            result::stream::launch_host_function(
                self.stream.cu_stream(),
                block_on_event,
                arg.cast::<c_void>(),
            )
        };
        if let Err(e) = launched {
            // SAFETY: the driver did not take the host function, so nobody else owns `arg`.
            drop(unsafe { Box::from_raw(arg) });
            return Err(CopyError::Failed(format!("cuLaunchHostFunc: {e}")));
        }
        Ok(())
    }

    fn record(&self) -> Result<Event, CopyError> {
        self.bind()?;
        let mut cuda: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: a valid out-pointer; the context is bound.
        unsafe { sys::cuEventCreate(&mut cuda, flags) }
            .result()
            .map_err(failed("cuEventCreate"))?;
        // SAFETY: the event was just created; the stream is ours.
        if let Err(e) = unsafe { result::event::record(cuda, self.stream.cu_stream()) } {
            // SAFETY: created above, never recorded, destroyed once.
            let _ = unsafe { result::event::destroy(cuda) };
            return Err(CopyError::Failed(format!("cuEventRecord: {e}")));
        }
        let event = Event::new();
        let sent = match &*self.sender.lock() {
            Some(sender) => sender.send(Recorded { cuda, event: event.clone() }).is_ok(),
            None => false,
        };
        if !sent {
            return Err(CopyError::Stopped);
        }
        Ok(event)
    }
}

impl Drop for CudaCopyStream {
    /// Stops without hanging: host functions blocked on events nobody fires give up (their
    /// streams' later events carry [`CopyError::Stopped`]); the event thread drains what was
    /// recorded and ends.
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.sender.lock().take();
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
        if self.bind().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

/// The event thread: waits for each recorded event in order, sleeping in the driver, and fires
/// it with the first failure since the previous one.
fn events(context: &CudaContext, receiver: &mpsc::Receiver<Recorded>, shared: &Shared) {
    let bound = context.bind_to_thread();
    while let Ok(Recorded { cuda, event }) = receiver.recv() {
        let synced = match &bound {
            // SAFETY: a recorded event of this context, destroyed once, below.
            Ok(()) => unsafe { result::event::synchronize(cuda) }
                .map_err(|e| CopyError::Failed(format!("the copies failed: {e}"))),
            Err(e) => Err(CopyError::Failed(format!("cannot bind the device: {e}"))),
        };
        if bound.is_ok() {
            // SAFETY: as above.
            let _ = unsafe { result::event::destroy(cuda) };
        }
        let earlier = shared.failed.lock().take();
        let outcome = match (synced, earlier) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) if shared.stopping.load(Ordering::Acquire) => Err(CopyError::Stopped),
            (Ok(()), None) => Ok(()),
        };
        event.fire(outcome);
    }
}

/// A host function that holds its stream until an [`Event`] fires (on a condition variable, in
/// steps, so a stopping stream is not held forever).
unsafe extern "C" fn block_on_event(arg: *mut c_void) {
    // SAFETY: `arg` is the box `wait` leaked for this one call.
    let boxed = unsafe { Box::from_raw(arg.cast::<(Event, Arc<Shared>)>()) };
    let (event, shared) = &*boxed;
    loop {
        match event.wait(STOP_CHECK) {
            Ok(()) => return,
            Err(CopyError::Timeout) if !shared.stopping.load(Ordering::Acquire) => {}
            Err(CopyError::Timeout) => {
                shared.fail(CopyError::Stopped);
                return;
            }
            Err(e) => {
                shared.fail(CopyError::Upstream(e.to_string()));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn engine() -> Option<CudaCopyEngine> {
        match CudaCopyEngine::new(0) {
            Ok(engine) => Some(engine),
            Err(why) => {
                eprintln!("SKIPPED: the CUDA copy engine needs a CUDA device ({why})");
                None
            }
        }
    }

    #[test]
    fn without_a_device_the_engine_says_why() {
        if cuda_available().is_ok() {
            eprintln!("SKIPPED: a CUDA device is present");
            return;
        }
        assert!(matches!(CudaCopyEngine::new(0), Err(DeviceError::CudaUnavailable(_))));
    }

    #[test]
    fn cuda_copies_wait_for_the_producer_and_fire_after_the_last_byte() {
        let Some(engine) = engine() else { return };
        let n = 8 << 20;
        engine.context.bind_to_thread().unwrap();
        // SAFETY: the context is bound; both allocations are freed at the end of the test.
        let (a, b) = unsafe { (result::malloc_sync(n).unwrap(), result::malloc_sync(n).unwrap()) };
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        // SAFETY: `a` has `n` bytes.
        unsafe { result::memcpy_htod_sync(a, &data) }.unwrap();
        let stream = engine.stream().unwrap();
        let producer = Event::new();
        stream.wait(&producer).unwrap();
        let pieces = (0..64u64)
            .map(|i| Piece {
                src: a + i * (n as u64 / 64),
                dst: b + i * (n as u64 / 64),
                len: n as u64 / 64,
            })
            .collect();
        // SAFETY: both ranges live until the end of the test; nobody else touches them.
        unsafe { stream.copy(pieces) }.unwrap();
        let done = stream.record().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(done.result().is_none(), "the copy ran before the producer's event");
        producer.fire(Ok(()));
        done.wait(Duration::from_secs(10)).unwrap();
        let mut back = vec![0u8; n];
        engine.context.bind_to_thread().unwrap();
        // SAFETY: `b` has `n` bytes and the copy into it is complete.
        unsafe { result::memcpy_dtoh_sync(&mut back, b) }.unwrap();
        assert!(back == data, "the bytes differ after the copy");

        // A failed producer makes the next event fail: a miss, not a visible chunk.
        let bad = Event::new();
        stream.wait(&bad).unwrap();
        bad.fire(Err(CopyError::Failed("the engine failed".into())));
        let after = stream.record().unwrap();
        assert!(matches!(after.wait(Duration::from_secs(10)), Err(CopyError::Upstream(_))));
        drop(stream);
        // SAFETY: allocated above, freed once.
        unsafe {
            result::free_sync(a).unwrap();
            result::free_sync(b).unwrap();
        }
    }
}
