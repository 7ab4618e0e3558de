//! The copy engine on a CUDA device: [`CopyStream`]s over the daemon's own CUDA streams. Every
//! move of the GPU data path runs here: L1's arena to and from host memory (`CudaArena`), and a
//! worker's KV, opened by CUDA IPC, to and from L1 (the server's `CudaRegion`).
//!
//! - `copy` enqueues, per call: each piece of several rows as one `cuMemcpy2DAsync` (the copy
//!   engine walks the pitches; a 2D copy the driver refuses, such as a pitch past its limit,
//!   goes row by row); the single rows between device memory as one `cuMemcpyBatchAsync` where
//!   the loaded driver has it (CUDA 12.8 and later; its signature differs between 12.x and 13.x
//!   and is resolved from the driver); every other row as one `cuMemcpyAsync` of its direction.
//!   A piece the driver refuses at enqueue is returned, and is the stream's failure, carried by
//!   the next recorded event or sync.
//! - `record` records a CUDA event (blocking-sync, no timing) and hands it to the stream's event
//!   thread, which waits for it in `cuEventSynchronize` (the thread sleeps in the driver; nothing
//!   spins) and then fires the [`Event`] with the first failure of the work enqueued between the
//!   previous record (or sync) and this one. Each failure is tagged with that interval when its
//!   work is enqueued, so which thread wakes first does not move it to another event.
//! - `sync` records the stream's own blocking-sync event and waits for it on the calling thread:
//!   no hand-over to the event thread for a caller that waits anyway.
//! - `wait` on an event that has not fired enqueues a host function (`cuLaunchHostFunc`) that
//!   blocks the stream until it fires. If it fires with an error, the work after it still runs on
//!   the device (a stream cannot skip what is enqueued), but the next recorded event carries
//!   [`CopyError::Upstream`], so its result is discarded: a miss, never a visible chunk. The
//!   host function must not wait for an event that only work queued behind host functions of
//!   other streams can fire: the driver may run host functions one at a time. The daemon waits
//!   for events of other streams on the device ([`CudaCopyStream::follow`]); `wait` serves
//!   events fired by host threads.
//! - A worker's own CUDA events (opened by IPC) are waited for and recorded on the device
//!   ([`CudaCopyStream::wait_cuda_event`], [`CudaCopyStream::record_cuda_event`]), and one
//!   stream can follow another's work ([`CudaCopyStream::follow`]): no host thread waits.
//!
//! The file is always compiled (cudarc loads the driver at run time); nothing here touches
//! cudarc before [`cuda_available`](super::cuda_available) found the driver library, and
//! symbols a driver may lack (`cuMemcpyBatchAsync`) are resolved through `cuGetProcAddress`,
//! never called through cudarc's lazy loader.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, result, sys};
use parking_lot::Mutex;

use super::copy::{At, CopyEngine, CopyError, CopyStream, Event, Piece};
use super::{DeviceError, cuda_available};

/// How long a host function blocked on an event waits before it looks whether its stream stops.
const STOP_CHECK: Duration = Duration::from_millis(20);

/// The largest pitch a 2D copy is given: the driver's limit (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`)
/// on every current device. Rows further apart go one by one.
pub const MAX_PITCH: u64 = i32::MAX as u64;

/// The environment variable that turns batched copies off (`1`), to compare the two.
pub const NO_BATCH_ENV: &str = "TIERKV_NO_BATCH_COPY";

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
        // SAFETY: the tracking orders cudarc's own `CudaSlice`s between streams; nothing here
        // makes one (memory is raw device addresses, ordered by this engine's events). With it
        // on, the first stream of each new context object synchronizes the whole device, so every
        // worker's registration would wait for every copy in flight.
        unsafe { context.disable_event_tracking() };
        Ok(CudaCopyEngine { context })
    }

    /// The device's primary context, which every stream of the engine runs in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// A new stream, as its concrete type: for callers that also wait for and record CUDA
    /// events of their own on it.
    pub fn cuda_stream(&self) -> Result<CudaCopyStream, CopyError> {
        CudaCopyStream::start(Arc::clone(&self.context))
    }
}

impl CopyEngine for CudaCopyEngine {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn stream(&self) -> Result<Box<dyn CopyStream>, CopyError> {
        Ok(Box::new(self.cuda_stream()?))
    }
}

/// A recorded CUDA event on its way to the event thread.
struct Recorded {
    cuda: sys::CUevent,
    event: Event,
    /// The interval of the stream it closes.
    interval: u64,
}

// SAFETY: a CUevent is a driver handle usable from any thread that binds its context.
unsafe impl Send for Recorded {}

/// What the stream and its host functions share.
struct Shared {
    failures: Mutex<Failures>,
    stopping: AtomicBool,
}

impl Shared {
    /// A failure of work enqueued now.
    fn fail(&self, error: CopyError) {
        let mut failures = self.failures.lock();
        let interval = failures.open;
        failures.fail(interval, error);
    }
}

/// A stream's failures by the interval of the stream they belong to: the work enqueued between
/// two marks (a `record` or a `sync`). The mark that closes an interval reports its first
/// failure, once.
#[derive(Debug, Default)]
struct Failures {
    /// The interval open now: the number of marks made so far.
    open: u64,
    /// The first failure of each interval not yet reported.
    unreported: Vec<(u64, CopyError)>,
}

impl Failures {
    /// Notes `error` in `interval`, unless it has a failure already.
    fn fail(&mut self, interval: u64, error: CopyError) {
        if self.unreported.iter().all(|(i, _)| *i != interval) {
            self.unreported.push((interval, error));
        }
    }

    /// Closes the open interval; returns it.
    fn mark(&mut self) -> u64 {
        self.open += 1;
        self.open - 1
    }

    /// The first failure of `interval`, which is over.
    fn take(&mut self, interval: u64) -> Option<CopyError> {
        let at = self.unreported.iter().position(|(i, _)| *i == interval)?;
        Some(self.unreported.swap_remove(at).1)
    }
}

/// One CUDA stream and its event thread.
pub struct CudaCopyStream {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The stream's own blocking-sync event, recorded for a `sync` or a `follow`. Threads that do
    /// so at once may record it over each other: a wait then lasts until a later record, which
    /// also covers everything enqueued before the earlier one.
    marker: sys::CUevent,
    shared: Arc<Shared>,
    sender: Mutex<Option<mpsc::Sender<Recorded>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

// SAFETY: the stream owns its handles; a CUevent and a CUstream are driver handles usable from
// any thread that binds their context, which every method does first, and the driver serializes
// calls on one handle.
unsafe impl Send for CudaCopyStream {}
// SAFETY: as above.
unsafe impl Sync for CudaCopyStream {}

impl std::fmt::Debug for CudaCopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyStream").finish_non_exhaustive()
    }
}

fn failed(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CopyError + '_ {
    move |e| CopyError::Failed(format!("{what}: {e}"))
}

/// Makes `context` current on the calling thread. Not `CudaContext::bind_to_thread`, which first
/// returns (and clears) any error cudarc stored from an earlier drop: a caller that must wait for
/// copies, or free what they used, would then skip it.
pub fn bind_context(context: &CudaContext) -> Result<(), cudarc::driver::DriverError> {
    // SAFETY: the context is live while borrowed.
    unsafe { result::ctx::set_current(context.cu_ctx()) }
}

impl CudaCopyStream {
    fn start(context: Arc<CudaContext>) -> Result<Self, CopyError> {
        context.bind_to_thread().map_err(failed("cannot bind the device"))?;
        let stream = context.new_stream().map_err(failed("cannot create a stream"))?;
        let marker = blocking_event()?;
        let shared = Arc::new(Shared {
            failures: Mutex::new(Failures::default()),
            stopping: AtomicBool::new(false),
        });
        let (sender, receiver) = mpsc::channel::<Recorded>();
        let (ctx, state) = (Arc::clone(&context), Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("tierkv-cuda-events".into())
            .spawn(move || events(&ctx, &receiver, &state));
        let thread = match thread {
            Ok(thread) => thread,
            Err(e) => {
                // SAFETY: created above, never recorded, destroyed once.
                let _ = unsafe { result::event::destroy(marker) };
                return Err(CopyError::Failed(format!("cannot start the event thread: {e}")));
            }
        };
        Ok(CudaCopyStream {
            context,
            stream,
            marker,
            shared,
            sender: Mutex::new(Some(sender)),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn bind(&self) -> Result<(), CopyError> {
        bind_context(&self.context).map_err(failed("cannot bind the device"))
    }

    /// The context the stream runs in (its device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Makes every copy enqueued on this stream from now on wait, on the device, until `event`'s
    /// latest record (as of this call) has completed. The host does not wait.
    ///
    /// # Safety
    /// `event` is a live event of this stream's context (a worker's, opened by IPC).
    pub unsafe fn wait_cuda_event(&self, event: sys::CUevent) -> Result<(), CopyError> {
        self.bind()?;
        // SAFETY: both handles are live for the call (the caller's word for `event`).
        unsafe { sys::cuStreamWaitEvent(self.stream.cu_stream(), event, 0) }
            .result()
            .map_err(failed("cuStreamWaitEvent"))
    }

    /// Records `event` on this stream: it completes once everything enqueued before it has (for
    /// a worker's event opened by IPC, the worker sees the record).
    ///
    /// # Safety
    /// `event` is a live event of this stream's context.
    pub unsafe fn record_cuda_event(&self, event: sys::CUevent) -> Result<(), CopyError> {
        self.bind()?;
        // SAFETY: both handles are live for the call (the caller's word for `event`).
        unsafe { result::event::record(event, self.stream.cu_stream()) }
            .map_err(failed("cuEventRecord"))
    }

    /// Makes this stream wait, on the device, for everything enqueued so far on `other`: one
    /// stream then follows both (a worker's event recorded on it covers both streams' copies).
    pub fn follow(&self, other: &CudaCopyStream) -> Result<(), CopyError> {
        // SAFETY: `other.marker` lives as long as `other`, which outlives the call; both streams
        // run in the one primary context of their device.
        unsafe {
            other.record_cuda_event(other.marker)?;
            self.wait_cuda_event(other.marker)
        }
    }

    /// Enqueues one row: `cuMemcpyAsync` of its direction.
    ///
    /// # Safety
    /// As [`CopyStream::copy`].
    unsafe fn copy_row(&self, row: &Piece, stream: sys::CUstream) -> Result<(), CopyError> {
        let len = usize::try_from(row.width)
            .map_err(|_| CopyError::Failed(format!("{row:?} is too long")))?;
        // SAFETY: the caller's contract on the ranges; the stream is ours.
        let rc = unsafe {
            match (row.src, row.dst) {
                (At::Host(src), At::Device(dst)) => {
                    sys::cuMemcpyHtoDAsync_v2(dst, src as usize as *const c_void, len, stream)
                }
                (At::Device(src), At::Host(dst)) => {
                    sys::cuMemcpyDtoHAsync_v2(dst as usize as *mut c_void, src, len, stream)
                }
                // Device to device, or host to host under unified addressing.
                (src, dst) => sys::cuMemcpyAsync(dst.address(), src.address(), len, stream),
            }
        };
        rc.result().map_err(|e| CopyError::Failed(format!("cuMemcpyAsync {row:?}: {e}")))
    }

    /// Enqueues `pieces`, the first refusal returned.
    ///
    /// # Safety
    /// As [`CopyStream::copy`].
    unsafe fn enqueue(&self, pieces: Vec<Piece>) -> Result<(), CopyError> {
        self.bind()?;
        let stream = self.stream.cu_stream();
        let mut rows: Vec<Piece> = Vec::new();
        for piece in pieces {
            if piece.rows > 1 {
                // SAFETY: the caller's contract; the stream is ours.
                match unsafe { copy_2d(&piece, stream) } {
                    Ok(()) => continue,
                    Err(e) => {
                        if !TWO_D_WARNED.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                "cuMemcpy2DAsync failed ({e}); such copies go row by row"
                            );
                        }
                    }
                }
            }
            rows.extend(piece.row_pieces());
        }
        let between_devices = rows.iter().all(|r| r.src.on_device() && r.dst.on_device());
        if between_devices && rows.len() > 1 {
            // SAFETY: the caller's contract; the stream is ours, not the legacy default stream,
            // which the batch call refuses.
            match unsafe { batch_copy(&rows, stream) } {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) if batch_refused(&e) => {
                    // Not tried again in this process: a driver that refuses one batch's
                    // arguments would refuse them all, and each refusal costs a call.
                    BATCH_REFUSED.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        "cuMemcpyBatchAsync refused ({e}); one cuMemcpyAsync per piece from now on"
                    );
                }
                Some(Err(e)) => {
                    // Another failure (a context that failed before, say) is this call's: the
                    // rows go one by one, and report it if it stays.
                    tracing::warn!(
                        "cuMemcpyBatchAsync failed ({e}); this call goes piece by piece"
                    );
                }
                None => {}
            }
        }
        for row in &rows {
            // SAFETY: the caller's contract; the stream is ours.
            unsafe { self.copy_row(row, stream) }?;
        }
        Ok(())
    }
}

/// A blocking-sync event without timing, in the bound context.
fn blocking_event() -> Result<sys::CUevent, CopyError> {
    let mut cuda: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: a valid out-pointer; the caller bound the context.
    unsafe { sys::cuEventCreate(&mut cuda, flags) }.result().map_err(failed("cuEventCreate"))?;
    Ok(cuda)
}

impl CopyStream for CudaCopyStream {
    unsafe fn copy(&self, pieces: Vec<Piece>) -> Result<(), CopyError> {
        // SAFETY: the caller's contract, passed on.
        let enqueued = unsafe { self.enqueue(pieces) };
        if let Err(e) = &enqueued {
            self.shared.fail(e.clone());
        }
        enqueued
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
        let interval = self.shared.failures.lock().open;
        let arg = Box::into_raw(Box::new((event.clone(), Arc::clone(&self.shared), interval)));
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
        let cuda = blocking_event()?;
        // The record and the mark at once, so that work enqueued by another thread falls on
        // the same side of both.
        let interval = {
            let mut failures = self.shared.failures.lock();
            // SAFETY: the event was just created; the stream is ours.
            if let Err(e) = unsafe { result::event::record(cuda, self.stream.cu_stream()) } {
                // SAFETY: created above, never recorded, destroyed once.
                let _ = unsafe { result::event::destroy(cuda) };
                return Err(CopyError::Failed(format!("cuEventRecord: {e}")));
            }
            failures.mark()
        };
        let event = Event::new();
        let refused = match &*self.sender.lock() {
            Some(sender) => sender.send(Recorded { cuda, event: event.clone(), interval }).err(),
            None => Some(mpsc::SendError(Recorded { cuda, event: event.clone(), interval })),
        };
        if let Some(mpsc::SendError(refused)) = refused {
            // SAFETY: recorded above and handed to nobody; the driver releases a recorded event
            // once it completes.
            let _ = unsafe { result::event::destroy(refused.cuda) };
            self.shared.failures.lock().take(interval);
            return Err(CopyError::Stopped);
        }
        Ok(event)
    }

    /// Waits on this thread, on the stream's own blocking-sync event. It never returns before
    /// the copies are over: if the event cannot be recorded or waited on, it waits on the stream
    /// itself (`cuStreamSynchronize`, which may spin).
    fn sync(&self) -> Result<(), CopyError> {
        let (recorded, interval) = {
            let mut failures = self.shared.failures.lock();
            // SAFETY: the marker lives as long as the stream; the stream is ours.
            (unsafe { self.record_cuda_event(self.marker) }, failures.mark())
        };
        let synced = recorded
            .and_then(|()| {
                // SAFETY: as above.
                unsafe { result::event::synchronize(self.marker) }.map_err(failed("the copies"))
            })
            .or_else(|_| {
                // SAFETY: the stream is ours and live; waiting needs no bound context.
                unsafe { result::stream::synchronize(self.stream.cu_stream()) }
                    .map_err(failed("the copies"))
            });
        let earlier = self.shared.failures.lock().take(interval);
        match (synced, earlier) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        }
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
            // Dropped by a callback on its own event thread (an event's last owner): that thread
            // ends by itself once its queue is empty, and cannot join itself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
        if self.bind().is_ok() {
            // SAFETY: the stream is ours and live.
            let _ = unsafe { result::stream::synchronize(self.stream.cu_stream()) };
            // SAFETY: created in `start`, destroyed only here, after the last wait on it.
            let _ = unsafe { result::event::destroy(self.marker) };
        }
    }
}

/// The event thread: waits for each recorded event in order, sleeping in the driver, and fires
/// it with the first failure since the previous one.
fn events(context: &CudaContext, receiver: &mpsc::Receiver<Recorded>, shared: &Shared) {
    let bound = bind_context(context);
    while let Ok(Recorded { cuda, event, interval }) = receiver.recv() {
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
        let earlier = shared.failures.lock().take(interval);
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
    let boxed = unsafe { Box::from_raw(arg.cast::<(Event, Arc<Shared>, u64)>()) };
    let (event, shared, interval) = &*boxed;
    loop {
        let error = match event.wait(STOP_CHECK) {
            Ok(()) => return,
            Err(CopyError::Timeout) if !shared.stopping.load(Ordering::Acquire) => continue,
            Err(CopyError::Timeout) => CopyError::Stopped,
            Err(e) => CopyError::Upstream(e.to_string()),
        };
        shared.failures.lock().fail(*interval, error);
        return;
    }
}

/// Set once the log has said that the driver refused a 2D copy.
static TWO_D_WARNED: AtomicBool = AtomicBool::new(false);

/// Set when the driver refused a batch: per-piece copies from then on.
static BATCH_REFUSED: AtomicBool = AtomicBool::new(false);

/// Enqueues `piece`, of several rows, as one `cuMemcpy2DAsync`.
///
/// # Safety
/// As [`CopyStream::copy`].
unsafe fn copy_2d(piece: &Piece, stream: sys::CUstream) -> Result<(), CopyError> {
    let d = descriptor_2d(piece)
        .ok_or_else(|| CopyError::Failed(format!("{piece:?} does not fit a 2D copy")))?;
    // SAFETY: the rows are valid (the caller's contract); `d` outlives the call, which reads it
    // before returning.
    unsafe { sys::cuMemcpy2DAsync_v2(&d, stream) }.result().map_err(failed("cuMemcpy2DAsync"))
}

/// The `cuMemcpy2DAsync` descriptor of `piece`: each end by its memory type, a host end by its
/// pointer and a device end by its address. `None` when a pitch is past [`MAX_PITCH`] or a
/// size does not fit the address space.
fn descriptor_2d(piece: &Piece) -> Option<sys::CUDA_MEMCPY2D> {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    if piece.src_pitch > MAX_PITCH || piece.dst_pitch > MAX_PITCH {
        return None;
    }
    let end = |at: At| match at {
        At::Device(a) => (CU_MEMORYTYPE_DEVICE, std::ptr::null_mut::<c_void>(), a),
        At::Host(a) => (CU_MEMORYTYPE_HOST, a as usize as *mut c_void, 0),
    };
    let ((src_type, src_host, src_device), (dst_type, dst_host, dst_device)) =
        (end(piece.src), end(piece.dst));
    Some(sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src_type,
        srcHost: src_host.cast_const(),
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        srcPitch: usize::try_from(piece.src_pitch).ok()?,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: usize::try_from(piece.dst_pitch).ok()?,
        WidthInBytes: usize::try_from(piece.width).ok()?,
        Height: usize::try_from(piece.rows).ok()?,
    })
}

type Batch12 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;
type Batch13 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum BatchFn {
    /// CUDA 12.8 and 12.9: with a `failIdx` out-parameter.
    V12(Batch12),
    /// CUDA 13: without it.
    V13(Batch13),
}

/// `cuMemcpyBatchAsync` of the loaded driver, resolved once: `None` when the driver predates
/// it (CUDA < 12.8), does not export it, refused it once, or `TIERKV_NO_BATCH_COPY=1`.
fn batch_fn() -> Option<BatchFn> {
    static BATCH: OnceLock<Option<BatchFn>> = OnceLock::new();
    if BATCH_REFUSED.load(Ordering::Relaxed) {
        return None;
    }
    *BATCH.get_or_init(|| {
        if std::env::var(NO_BATCH_ENV).is_ok_and(|v| v == "1") {
            tracing::info!("{NO_BATCH_ENV}=1: one cuMemcpyAsync per piece");
            return None;
        }
        let mut version: c_int = 0;
        // SAFETY: only called after `cuda_available` found the library; a valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result().ok()?;
        let want = if version >= 13000 {
            13000
        } else if version >= 12080 {
            12080
        } else {
            return None;
        };
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: valid C string and out-pointers.
        unsafe {
            sys::cuGetProcAddress_v2(c"cuMemcpyBatchAsync".as_ptr(), &mut pfn, want, 0, &mut status)
        }
        .result()
        .ok()?;
        if pfn.is_null() {
            return None;
        }
        tracing::info!("cuMemcpyBatchAsync resolved for driver {version} (ABI {want})");
        // SAFETY: the driver returned this symbol for ABI `want`, whose signature is the one
        // each variant declares (CUDA 13 dropped `failIdx`).
        Some(unsafe {
            if want >= 13000 {
                BatchFn::V13(std::mem::transmute::<*mut c_void, Batch13>(pfn))
            } else {
                BatchFn::V12(std::mem::transmute::<*mut c_void, Batch12>(pfn))
            }
        })
    })
}

/// Whether a failed batch was refused for what it asked (the driver would refuse every batch),
/// rather than failing for the state it found.
fn batch_refused(error: &cudarc::driver::DriverError) -> bool {
    use sys::CUresult::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED};
    matches!(error.0, CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_SUPPORTED)
}

/// One `cuMemcpyBatchAsync` of `rows` (single rows between device memory); `None` when the
/// driver has none.
///
/// # Safety
/// Every row's ends are valid device memory for its width.
unsafe fn batch_copy(
    rows: &[Piece],
    stream: sys::CUstream,
) -> Option<Result<(), cudarc::driver::DriverError>> {
    let f = batch_fn()?;
    let mut dsts: Vec<u64> = rows.iter().map(|r| r.dst.address()).collect();
    let mut srcs: Vec<u64> = rows.iter().map(|r| r.src.address()).collect();
    // A row longer than the address space: not a batch (the rows one by one say why).
    let mut sizes: Vec<usize> =
        rows.iter().map(|r| usize::try_from(r.width).ok()).collect::<Option<_>>()?;
    // Stream order; no location hints (they matter for managed memory only).
    let no_hint =
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: no_hint,
        dstLocHint: no_hint,
        flags: 0,
    };
    let mut attr_idx = [0usize];
    let mut fail_idx = 0usize;
    let n = dsts.len();
    // SAFETY: arrays of `n` entries, one attribute applying from index 0; the caller vouches
    // for the ranges.
    let rc = unsafe {
        match f {
            BatchFn::V12(f) => f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                n,
                &mut attrs,
                attr_idx.as_mut_ptr(),
                1,
                &mut fail_idx,
                stream,
            ),
            BatchFn::V13(f) => f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                n,
                &mut attrs,
                attr_idx.as_mut_ptr(),
                1,
                stream,
            ),
        }
    };
    Some(rc.result())
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
    fn a_failure_is_reported_by_the_mark_after_its_work_and_by_no_other() {
        // The bookkeeping of every CUDA stream's failures, which runs without a device.
        let failed = |why: &str| CopyError::Failed(why.into());
        let mut failures = Failures::default();
        // A record, its event still in flight; then work that is refused, twice.
        let first = failures.mark();
        failures.fail(failures.open, failed("refused"));
        failures.fail(failures.open, failed("refused again"));
        let second = failures.mark();
        // The first record's event thread wakes only now: the refusal is not its.
        assert_eq!(failures.take(first), None);
        assert_eq!(failures.take(second), Some(failed("refused")), "the first failure");
        assert_eq!(failures.take(second), None, "reported once");
        // A host function of the third interval fails after the third mark was made (its
        // event is not complete until the host function returns): still the third's.
        let interval = failures.open;
        let third = failures.mark();
        failures.fail(interval, CopyError::Upstream("the producer failed".into()));
        let fourth = failures.mark();
        assert_eq!(failures.take(fourth), None);
        assert_eq!(failures.take(third), Some(CopyError::Upstream("the producer failed".into())));
        assert!(failures.unreported.is_empty());
    }

    #[test]
    fn only_a_refused_batch_turns_batches_off() {
        use cudarc::driver::DriverError;
        use sys::CUresult::{
            CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED,
        };
        assert!(batch_refused(&DriverError(CUDA_ERROR_INVALID_VALUE)));
        assert!(batch_refused(&DriverError(CUDA_ERROR_NOT_SUPPORTED)));
        // A context that failed before fails every call, batched or not: not the batch's fault.
        assert!(!batch_refused(&DriverError(CUDA_ERROR_ILLEGAL_ADDRESS)));
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
        // A pageable upload may return before its bytes land, and the engine's non-blocking
        // streams do not wait for the legacy stream it ran on.
        result::ctx::synchronize().unwrap();
        let stream = engine.stream().unwrap();
        let producer = Event::new();
        stream.wait(&producer).unwrap();
        let pieces = (0..64u64)
            .map(|i| {
                let at = i * (n as u64 / 64);
                Piece::contiguous(At::Device(a + at), At::Device(b + at), n as u64 / 64)
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

        // A failure noted while an earlier record is still in flight is the next record's
        // only: the earlier one fires clean, whichever thread wakes first.
        let gate = Event::new();
        stream.wait(&gate).unwrap();
        let before = stream.record().unwrap();
        stream.wait(&bad).unwrap();
        let later = stream.record().unwrap();
        gate.fire(Ok(()));
        before.wait(Duration::from_secs(10)).unwrap();
        assert!(matches!(later.wait(Duration::from_secs(10)), Err(CopyError::Upstream(_))));
        drop(stream);
        // SAFETY: allocated above, freed once.
        unsafe {
            result::free_sync(a).unwrap();
            result::free_sync(b).unwrap();
        }
    }

    #[test]
    fn a_2d_descriptor_names_each_end_with_its_memory_and_pitch() {
        use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
        // A block of 4 layers, 4 KiB rows 1 MiB apart in a worker's KV, gathered into an L1 slot
        // on the device where the rows are 16 KiB apart.
        let gather = Piece {
            src: At::Device(0x1000_0000),
            src_pitch: 1 << 20,
            dst: At::Device(0x9000_0000),
            dst_pitch: 16 << 10,
            width: 4096,
            rows: 4,
        };
        let d = descriptor_2d(&gather).unwrap();
        assert_eq!(
            (d.srcMemoryType, d.srcDevice, d.srcPitch),
            (CU_MEMORYTYPE_DEVICE, 0x1000_0000, 1 << 20)
        );
        assert_eq!(
            (d.dstMemoryType, d.dstDevice, d.dstPitch),
            (CU_MEMORYTYPE_DEVICE, 0x9000_0000, 16 << 10)
        );
        assert_eq!((d.WidthInBytes, d.Height), (4096, 4));
        assert!(d.srcHost.is_null() && d.dstHost.is_null());
        // Scattered back from a host buffer: the host end is the source, by its pointer.
        let host = vec![0u8; 64 << 10];
        let scatter = Piece {
            src: At::Host(host.as_ptr() as u64),
            src_pitch: 16 << 10,
            dst: At::Device(0x1000_0000),
            dst_pitch: 1 << 20,
            ..gather
        };
        let d = descriptor_2d(&scatter).unwrap();
        assert_eq!((d.srcMemoryType, d.srcPitch), (CU_MEMORYTYPE_HOST, 16 << 10));
        assert_eq!(d.srcHost, host.as_ptr().cast::<c_void>());
        assert_eq!(
            (d.dstMemoryType, d.dstDevice, d.dstPitch),
            (CU_MEMORYTYPE_DEVICE, 0x1000_0000, 1 << 20)
        );
        // A pitch the driver cannot take: no descriptor, so the rows go one by one.
        assert!(descriptor_2d(&Piece { src_pitch: MAX_PITCH + 1, ..gather }).is_none());
    }

    /// Every kind of piece the data path sends, on one stream, checked byte for byte: strided
    /// rows device to device (2D), to and from host memory (2D), single rows between device
    /// memory (a batch), a row from the host and one to it, and a stream that follows another.
    #[test]
    fn every_kind_of_piece_lands_where_it_should() {
        let Some(engine) = engine() else { return };
        let (rows, width, pitch) = (8u64, 4096u64, 16384u64);
        let n = (rows * pitch) as usize;
        engine.context.bind_to_thread().unwrap();
        // SAFETY: the context is bound; freed at the end of the test.
        let (a, b, c) = unsafe {
            (
                result::malloc_sync(n).unwrap(),
                result::malloc_sync(n).unwrap(),
                result::malloc_sync(n).unwrap(),
            )
        };
        let data: Vec<u8> = (0..n).map(|i| (i % 253) as u8).collect();
        // SAFETY: `a` has `n` bytes.
        unsafe { result::memcpy_htod_sync(a, &data) }.unwrap();
        // As in the test above: the upload is complete before the streams read `a`.
        result::ctx::synchronize().unwrap();
        let stream = engine.cuda_stream().unwrap();
        let packed = (rows * width) as usize;
        // Strided rows of `a` packed into `b` (a gather), then unpacked into `c` (a scatter).
        let gather = Piece {
            src: At::Device(a),
            src_pitch: pitch,
            dst: At::Device(b),
            dst_pitch: width,
            width,
            rows,
        };
        let scatter = Piece {
            src: At::Device(b),
            src_pitch: width,
            dst: At::Device(c),
            dst_pitch: pitch,
            ..gather
        };
        // SAFETY: every range lies inside its allocation and outlives the syncs below.
        unsafe { stream.copy(vec![gather]) }.unwrap();
        // SAFETY: as above.
        unsafe { stream.copy(vec![scatter]) }.unwrap();
        stream.sync().unwrap();
        let expected: Vec<u8> = (0..rows as usize)
            .flat_map(|r| data[r * pitch as usize..][..width as usize].to_vec())
            .collect();
        let mut host = vec![0u8; packed];
        // To pinned-or-not host memory, strided: back out of `c`.
        let out = Piece { src: At::Device(c), dst: At::Host(host.as_mut_ptr() as u64), ..gather };
        // SAFETY: `host` has `packed` bytes and lives past the sync.
        unsafe { stream.copy(vec![out]) }.unwrap();
        stream.sync().unwrap();
        assert!(host == expected, "2D device to device, then 2D to the host, moved other bytes");
        // Single rows between device memory, several in one call: one batch where the driver
        // has it. `b` row by row into `c`'s first rows.
        let singles = (0..rows)
            .map(|r| Piece::contiguous(At::Device(b + r * width), At::Device(c + r * width), width))
            .collect();
        // SAFETY: inside the allocations; synced below.
        unsafe { stream.copy(singles) }.unwrap();
        let mut back = vec![0u8; packed];
        let out =
            Piece::contiguous(At::Device(c), At::Host(back.as_mut_ptr() as u64), packed as u64);
        // SAFETY: as above.
        unsafe { stream.copy(vec![out]) }.unwrap();
        stream.sync().unwrap();
        assert!(back == expected, "a batch of single rows moved other bytes");
        // From the host, on a second stream held back by a gate; the first stream follows it
        // before reading back, so its read-out must wait for the gate too. Both host buffers
        // are pinned: a copy between the device and pageable memory may hold the calling thread
        // until it is done, which here would be until the gate opens, after the copy call.
        // SAFETY: the context is bound; both buffers are freed at the end of the test, after
        // the streams that use them are dropped.
        let (fill, pinned_back) = unsafe {
            (
                result::malloc_host(packed, 0).unwrap().cast::<u8>(),
                result::malloc_host(packed, 0).unwrap().cast::<u8>(),
            )
        };
        // SAFETY: `fill` has `packed` bytes, written here only.
        unsafe { std::ptr::write_bytes(fill, 0x5a, packed) };
        let other = engine.cuda_stream().unwrap();
        let gate = Event::new();
        other.wait(&gate).unwrap();
        let put = Piece::contiguous(At::Host(fill as u64), At::Device(b), packed as u64);
        // SAFETY: `fill` lives past the sync of the stream that follows.
        unsafe { other.copy(vec![put]) }.unwrap();
        stream.follow(&other).unwrap();
        let out = Piece::contiguous(At::Device(b), At::Host(pinned_back as u64), packed as u64);
        // SAFETY: as above.
        unsafe { stream.copy(vec![out]) }.unwrap();
        let read = stream.record().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(read.result().is_none(), "the following stream ran before the one it follows");
        gate.fire(Ok(()));
        read.wait(Duration::from_secs(10)).unwrap();
        // SAFETY: the copy into it is complete (its event fired); nothing writes it any more.
        let got = unsafe { std::slice::from_raw_parts(pinned_back, packed) };
        assert!(got.iter().all(|&x| x == 0x5a), "a stream that follows another read too early");
        drop((stream, other));
        engine.context.bind_to_thread().unwrap();
        // SAFETY: allocated above, freed once, after every copy that used them.
        unsafe {
            result::free_host(fill.cast()).unwrap();
            result::free_host(pinned_back.cast()).unwrap();
            result::free_sync(a).unwrap();
            result::free_sync(b).unwrap();
            result::free_sync(c).unwrap();
        }
    }
}
