//! A worker's GPU memory, opened from a CUDA IPC handle, and the copies of a chunk's pieces
//! between it and an L1 slot.
//!
//! A [`CudaRegion`] is opened once per registration (`cuIpcOpenMemHandle`) and closed when it is
//! dropped (`cuIpcCloseMemHandle`), which is when the session that registered it ends. Copies run
//! on the region's own stream (never the legacy default stream, which `cuMemcpyBatchAsync`
//! refuses): a block's pieces across evenly spaced segments as one `cuMemcpy2DAsync`, the single
//! pieces of a request between device memory as one `cuMemcpyBatchAsync` when the loaded driver
//! has it, anything else one `cuMemcpyAsync` per piece. On an H100, 2D copies move a Llama-3-8B
//! chunk's 32 KiB pieces device to device about 25 times faster than a batch of the same pieces
//! (docs/performance.md, the GPU table). The stream is synchronized before the request returns:
//! a store is acknowledged, and a retrieve answered, only after its copies are done.
//!
//! Nothing here calls into cudarc before `cuda_available` has found the driver library (cudarc
//! panics when the library is missing), and symbols a driver may lack (`cuMemcpyBatchAsync`) are
//! resolved through `cuGetProcAddress`, never called through cudarc's lazy loader.

use std::ffi::{CString, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};

use cudarc::driver::{CudaContext, CudaStream, DriverError, sys};
use tierkv_l1::device::cuda_available;

/// The largest pitch a 2D copy is given: the driver's limit (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`)
/// on every current device. Segments further apart go piece by piece.
pub const MAX_PITCH: u64 = i32::MAX as u64;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Why a CUDA region could not be opened or a copy failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaIpcError {
    /// No CUDA driver or device in this daemon's process.
    #[error("{0}")]
    Unavailable(String),
    /// The handle is not 64 bytes, or the device id cannot be a C string.
    #[error("{0}")]
    Malformed(String),
    /// The driver refused (an open, a stream, a copy).
    #[error("{what}: {error}")]
    Driver {
        /// The call that failed.
        what: &'static str,
        /// The driver's error.
        error: DriverError,
    },
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaIpcError {
    move |error| CudaIpcError::Driver { what, error }
}

/// Where one end of a piece lies.
#[derive(Clone, Copy, Debug)]
pub enum Side {
    /// Device memory (an L1 slot on the GPU): its `CUdeviceptr`.
    Device(u64),
    /// Host memory (an emulated L1 slot, or a staging buffer).
    Host(*mut u8),
}

impl Side {
    /// The end `by` bytes further on.
    pub(crate) fn offset(self, by: u64) -> Side {
        match self {
            Side::Device(p) => Side::Device(p + by),
            // `wrapping_add`: the caller vouches that the end lies inside its buffer.
            Side::Host(p) => Side::Host(p.wrapping_add(by as usize)),
        }
    }

    /// The end's address in the unified address space.
    fn address(self) -> u64 {
        match self {
            Side::Device(p) => p,
            Side::Host(p) => p as u64,
        }
    }
}

/// One strided copy between a region and another buffer: `rows` rows of the copy's width, row
/// `r` at `offset + r * pitch` in the region and at `other + r * other_pitch` on the other end.
/// One row is one piece.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    /// The first row's offset in the region.
    pub offset: u64,
    /// Bytes from one row to the next in the region.
    pub pitch: u64,
    /// The first row on the other end.
    pub other: Side,
    /// Bytes from one row to the next on the other end.
    pub other_pitch: u64,
    /// How many rows.
    pub rows: usize,
}

/// A worker's CUDA event, opened from its IPC handle ([`CudaRegion::open_event`]); destroyed when
/// dropped (the worker's own event lives on).
pub struct CudaEvent {
    context: Arc<CudaContext>,
    event: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread that binds its context.
unsafe impl Send for CudaEvent {}
// SAFETY: as above; the driver serializes calls on one event.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaEvent({:p})", self.event)
    }
}

impl CudaEvent {
    /// Waits on the host until the event's latest record has completed.
    fn synchronize(&self) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        // SAFETY: a live event.
        unsafe { sys::cuEventSynchronize(self.event) }
            .result()
            .map_err(driver("the copies before the event failed"))
    }
}

/// An event of the daemon's own (blocking-sync, no timing) in `context`.
fn own_event(context: &Arc<CudaContext>) -> Result<CudaEvent, CudaIpcError> {
    context.bind_to_thread().map_err(driver("cannot bind the device"))?;
    let mut event: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: the context is bound; `event` is a valid out-pointer, destroyed once in `Drop`.
    unsafe { sys::cuEventCreate(&mut event, flags) }.result().map_err(driver("cuEventCreate"))?;
    Ok(CudaEvent { context: Arc::clone(context), event })
}

/// Something to drop once `event` has completed.
struct Waiting {
    event: CudaEvent,
    keep: Box<dyn Send>,
}

/// The completion thread's queue, started on first use; `None` if the thread cannot start.
fn completions() -> Option<&'static mpsc::Sender<Waiting>> {
    static THREAD: OnceLock<Option<mpsc::Sender<Waiting>>> = OnceLock::new();
    THREAD
        .get_or_init(|| {
            let (send, receive) = mpsc::channel::<Waiting>();
            let started =
                std::thread::Builder::new().name("tierkv-cuda-done".into()).spawn(move || {
                    for Waiting { event, keep } in receive {
                        if let Err(e) = event.synchronize() {
                            tracing::error!("copies of a retrieve failed after its reply: {e}");
                        }
                        drop(keep);
                    }
                });
            match started {
                Ok(_) => Some(send),
                Err(e) => {
                    tracing::warn!("no CUDA completion thread ({e}); retrieves wait inline");
                    None
                }
            }
        })
        .as_ref()
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: `event` came from `cuIpcOpenEventHandle` or `cuEventCreate` and is
            // destroyed only here.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) }.result();
        }
    }
}

/// A worker's device allocation, opened in this process.
pub struct CudaRegion {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The daemon's blocking-sync event, recorded on `stream` for a wait. Threads that wait at
    /// once may record it over each other: a wait then lasts until a later record, which also
    /// covers everything enqueued before the earlier one.
    done: CudaEvent,
    base: sys::CUdeviceptr,
    len: u64,
}

// SAFETY: the region owns its mapping; the raw stream and pointer are driver handles valid in
// every thread that binds the context (which every method does first).
unsafe impl Send for CudaRegion {}
// SAFETY: as above; concurrent copies on one stream are serialized by the driver.
unsafe impl Sync for CudaRegion {}

impl std::fmt::Debug for CudaRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaRegion({:#x}, {} bytes)", self.base, self.len)
    }
}

impl CudaRegion {
    /// Opens `handle` (from `cuIpcGetMemHandle` in the worker) on the device with PCI bus id
    /// `device`. `bytes` is what the worker says the allocation holds; the driver cannot check
    /// it, so the worker's word bounds every copy (a worker that lies reaches only its own
    /// allocation's neighbours in its own context, which the driver faults).
    pub fn open(handle: &[u8], device: &str, bytes: u64) -> Result<Self, CudaIpcError> {
        cuda_available().map_err(|e| CudaIpcError::Unavailable(e.to_string()))?;
        let raw: [u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaIpcError::Malformed(format!(
                "a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, not {}",
                handle.len()
            ))
        })?;
        let bus = CString::new(device).map_err(|_| {
            CudaIpcError::Malformed(format!("device {device:?} is not a PCI bus id"))
        })?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: the driver library is present (checked); `bus` is a C string, `dev` a valid
        // out-pointer.
        unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, bus.as_ptr()) }
            .result()
            .map_err(driver("no device with that PCI bus id"))?;
        let ordinal = usize::try_from(dev).map_err(|_| {
            CudaIpcError::Malformed(format!("the driver named device {dev} for {device}"))
        })?;
        let context = CudaContext::new(ordinal).map_err(driver("cannot open the device"))?;
        context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        let stream = context.new_stream().map_err(driver("cannot create a stream"))?;
        let done = own_event(&context)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        for (to, from) in handle.reserved.iter_mut().zip(raw) {
            *to = from as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: the context is bound to this thread; `base` is a valid out-pointer; the
        // mapping is closed once, in `Drop`.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(driver(
            "cuIpcOpenMemHandle failed (memory from VMM or PyTorch's expandable segments cannot be shared by IPC; the worker must allocate its KV with cudaMalloc)",
        ))?;
        Ok(CudaRegion { context, stream, done, base, len: bytes })
    }

    /// Copies `copies`, rows of `width` bytes each: from the region to each copy's `other` end
    /// (`to_region` false), or from `other` into the region (`to_region` true), then waits for
    /// the stream if `then_sync` (else the caller calls [`CudaRegion::sync`] before it relies on
    /// the bytes or lets go of either end).
    ///
    /// A copy of several rows is one `cuMemcpy2DAsync` (the copy engine walks the pitches: a
    /// chunk's block across evenly spaced layers moves as one copy, not one per layer). The
    /// one-row copies between device memory go as one `cuMemcpyBatchAsync` where the driver
    /// has it; every other row is one `cuMemcpyAsync`. A 2D copy the driver refuses (a pitch past
    /// its limit) goes row by row.
    ///
    /// # Safety
    /// Every row lies inside the region (the caller checked the layout against `len`), and every
    /// `other` end is valid for its rows and not used concurrently.
    pub unsafe fn copy(
        &self,
        copies: &[Rows],
        width: usize,
        to_region: bool,
        then_sync: bool,
    ) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        let stream = self.stream.cu_stream();
        let mut singles: Vec<(u64, Side)> = Vec::new();
        for rows in copies {
            if rows.rows > 1 {
                // SAFETY: the caller's contract; the stream is ours.
                match unsafe { self.copy_2d(rows, width, to_region, stream) } {
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
            singles.extend(
                (0..rows.rows as u64).map(|r| {
                    (rows.offset + r * rows.pitch, rows.other.offset(r * rows.other_pitch))
                }),
            );
        }
        let all_device = singles.iter().all(|(_, s)| matches!(s, Side::Device(_)));
        if all_device && singles.len() > 1 {
            let (dsts, srcs): (Vec<u64>, Vec<u64>) = singles
                .iter()
                .map(|&(at, side)| {
                    let other = side.address();
                    if to_region { (self.base + at, other) } else { (other, self.base + at) }
                })
                .unzip();
            // SAFETY: the ranges are valid (the caller's contract); the stream is ours, not
            // the legacy default stream, which the batch call refuses.
            match unsafe { batch_copy(&dsts, &srcs, width, stream) } {
                Some(Ok(())) => return if then_sync { self.sync() } else { Ok(()) },
                Some(Err(e)) => {
                    // Not tried again in this process: a driver that refuses one batch would
                    // refuse them all, and each refusal costs a call.
                    BATCH_REFUSED.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        "cuMemcpyBatchAsync failed ({e}); one cuMemcpyAsync per piece from now on"
                    );
                }
                None => {}
            }
        }
        for (at, side) in singles {
            let here = self.base + at;
            // SAFETY: the ranges are valid (the caller's contract); the stream is ours.
            let rc = unsafe {
                match (side, to_region) {
                    (Side::Device(p), true) => sys::cuMemcpyAsync(here, p, width, stream),
                    (Side::Device(p), false) => sys::cuMemcpyAsync(p, here, width, stream),
                    (Side::Host(p), true) => {
                        sys::cuMemcpyHtoDAsync_v2(here, p as *const c_void, width, stream)
                    }
                    (Side::Host(p), false) => {
                        sys::cuMemcpyDtoHAsync_v2(p as *mut c_void, here, width, stream)
                    }
                }
            };
            if let Err(error) = rc.result() {
                // Wait for what was queued before reporting, so no copy outlives the call.
                let _ = self.sync();
                return Err(CudaIpcError::Driver { what: "cuMemcpyAsync", error });
            }
        }
        if then_sync { self.sync() } else { Ok(()) }
    }

    /// Enqueues one copy of several rows as a `cuMemcpy2DAsync`.
    ///
    /// # Safety
    /// As [`CudaRegion::copy`].
    unsafe fn copy_2d(
        &self,
        rows: &Rows,
        width: usize,
        to_region: bool,
        stream: sys::CUstream,
    ) -> Result<(), DriverError> {
        let d = descriptor_2d(self.base + rows.offset, rows, width, to_region);
        // SAFETY: the rows are valid (the caller's contract); `d` outlives the call, which
        // reads it before returning.
        unsafe { sys::cuMemcpy2DAsync_v2(&d, stream) }.result()
    }

    /// Opens a worker's CUDA event from its IPC handle (`cuIpcGetEventHandle` of an event made
    /// with `CU_EVENT_INTERPROCESS`), in this region's context.
    pub fn open_event(&self, handle: &[u8]) -> Result<CudaEvent, CudaIpcError> {
        let raw: [u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaIpcError::Malformed(format!(
                "a CUDA IPC event handle has {IPC_HANDLE_BYTES} bytes, not {}",
                handle.len()
            ))
        })?;
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        let mut ipc = sys::CUipcEventHandle { reserved: [0; IPC_HANDLE_BYTES] };
        for (to, from) in ipc.reserved.iter_mut().zip(raw) {
            *to = from as std::ffi::c_char;
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is bound to this thread; `event` is a valid out-pointer, destroyed
        // once, in `CudaEvent`'s `Drop`.
        unsafe { sys::cuIpcOpenEventHandle(&mut event, ipc) }.result().map_err(driver(
            "cuIpcOpenEventHandle failed (the event must be made with CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING, e.g. torch.cuda.Event(interprocess=True))",
        ))?;
        Ok(CudaEvent { context: Arc::clone(&self.context), event })
    }

    /// Makes every copy enqueued on the region's stream from now on wait, on the device, until
    /// `event`'s latest record (as of this call) has completed. The host does not wait.
    pub fn wait_for(&self, event: &CudaEvent) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        // SAFETY: both handles are live for the call; the stream is ours.
        unsafe { sys::cuStreamWaitEvent(self.stream.cu_stream(), event.event, 0) }
            .result()
            .map_err(driver("cuStreamWaitEvent failed"))
    }

    /// Records `event` on the region's stream: it completes once everything enqueued before it
    /// has (for a worker's event opened by IPC, the worker sees the record).
    pub fn record(&self, event: &CudaEvent) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        // SAFETY: both handles are live for the call; the stream is ours.
        unsafe { sys::cuEventRecord(event.event, self.stream.cu_stream()) }
            .result()
            .map_err(driver("cuEventRecord failed"))
    }

    /// Makes this region's stream wait, on the device, for everything enqueued so far on
    /// `other`'s: the one stream a worker's event is recorded on then follows both.
    pub fn join(&self, other: &CudaRegion) -> Result<(), CudaIpcError> {
        other.record(&other.done)?;
        self.wait_for(&other.done)
    }

    /// Hands `keep` to the completion thread, which drops it once everything enqueued on the
    /// region's stream so far has completed: the guards of the slots a retrieve copies from.
    /// Without the thread, or if the daemon's event cannot be made, waits here and drops it:
    /// `keep` never goes before the copies.
    pub fn drop_when_done(&self, keep: Box<dyn Send>) {
        let recorded = own_event(&self.context).and_then(|done| self.record(&done).map(|()| done));
        match (recorded, completions()) {
            (Ok(event), Some(thread)) => {
                if let Err(mpsc::SendError(Waiting { event, keep })) =
                    thread.send(Waiting { event, keep })
                {
                    let _ = event.synchronize();
                    drop(keep);
                }
            }
            (Ok(event), None) => {
                let _ = event.synchronize();
                drop(keep);
            }
            (Err(_), _) => {
                let _ = self.sync();
                drop(keep);
            }
        }
    }

    /// Waits until every copy enqueued on the region's stream is done; an error if one failed.
    ///
    /// The thread sleeps in the driver on a blocking-sync event: `cuStreamSynchronize` would
    /// spin a core for as long as the copies take (the driver's default scheduling), which the
    /// engine's own threads need.
    ///
    /// It never returns before the copies are over: if the event cannot be recorded or waited
    /// on, it waits on the stream itself.
    pub fn sync(&self) -> Result<(), CudaIpcError> {
        self.record(&self.done).and_then(|()| self.done.synchronize()).or_else(|_| {
            self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
            self.stream.synchronize().map_err(driver("the copies failed"))
        })
    }
}

impl Drop for CudaRegion {
    fn drop(&mut self) {
        // Nobody to report a failure to in a destructor; the driver releases the mapping with
        // the process at the latest.
        if self.context.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
            // SAFETY: `base` came from `cuIpcOpenMemHandle` and is closed only here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result();
        }
    }
}

/// The `cuMemcpy2DAsync` descriptor of `rows` whose first row lies at device address `here`:
/// from there to the other end, or from the other end there when `to_region`.
fn descriptor_2d(here: u64, rows: &Rows, width: usize, to_region: bool) -> sys::CUDA_MEMCPY2D {
    use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
    let pitch = |p: u64| usize::try_from(p).unwrap_or(usize::MAX);
    let (here_pitch, other_pitch) = (pitch(rows.pitch), pitch(rows.other_pitch));
    // Device memory: (type, host pointer, device address). Host memory: the host pointer.
    let (other_type, other_host, other_device) = match rows.other {
        Side::Device(p) => (CU_MEMORYTYPE_DEVICE, std::ptr::null_mut(), p),
        Side::Host(p) => (CU_MEMORYTYPE_HOST, p.cast::<c_void>(), 0),
    };
    let here_end = (CU_MEMORYTYPE_DEVICE, std::ptr::null_mut(), here, here_pitch);
    let other_end = (other_type, other_host, other_device, other_pitch);
    let ((src_type, src_host, src_device, src_pitch), (dst_type, dst_host, dst_device, dst_pitch)) =
        if to_region { (other_end, here_end) } else { (here_end, other_end) };
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src_type,
        srcHost: src_host.cast_const(),
        srcDevice: src_device,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: rows.rows,
    }
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

/// Set once the log has said that the driver refused a 2D copy.
static TWO_D_WARNED: AtomicBool = AtomicBool::new(false);

/// Set when the driver refused a batch: per-piece copies from then on.
static BATCH_REFUSED: AtomicBool = AtomicBool::new(false);

/// The environment variable that turns batched copies off (`1`), to compare the two.
pub const NO_BATCH_ENV: &str = "TIERKV_NO_BATCH_COPY";

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

/// One `cuMemcpyBatchAsync` of equal pieces; `None` when the driver has none.
///
/// # Safety
/// Every `dsts[i]` and `srcs[i]` is valid device memory for `size` bytes.
unsafe fn batch_copy(
    dsts: &[u64],
    srcs: &[u64],
    size: usize,
    stream: sys::CUstream,
) -> Option<Result<(), DriverError>> {
    let f = batch_fn()?;
    let mut dsts = dsts.to_vec();
    let mut srcs = srcs.to_vec();
    let mut sizes = vec![size; dsts.len()];
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
    use super::*;

    #[test]
    fn a_2d_descriptor_names_each_end_with_its_memory_and_pitch() {
        use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
        // A block of 4 layers, 4 KiB rows 1 MiB apart in the region, gathered into an L1 slot
        // on the device where the rows are 16 KiB apart.
        let rows = Rows {
            offset: 0,
            pitch: 1 << 20,
            other: Side::Device(0x9000_0000),
            other_pitch: 16 << 10,
            rows: 4,
        };
        let d = descriptor_2d(0x1000_0000, &rows, 4096, false);
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
        let mut host = vec![0u8; 64 << 10];
        let rows = Rows { other: Side::Host(host.as_mut_ptr()), ..rows };
        let d = descriptor_2d(0x1000_0000, &rows, 4096, true);
        assert_eq!((d.srcMemoryType, d.srcPitch), (CU_MEMORYTYPE_HOST, 16 << 10));
        assert_eq!(d.srcHost, host.as_ptr().cast::<c_void>());
        assert_eq!(
            (d.dstMemoryType, d.dstDevice, d.dstPitch),
            (CU_MEMORYTYPE_DEVICE, 0x1000_0000, 1 << 20)
        );
    }

    #[test]
    fn without_a_driver_an_open_says_why() {
        if cuda_available().is_ok() {
            eprintln!("SKIPPED: a CUDA device is present (the GPU check covers the open)");
            return;
        }
        let err = CudaRegion::open(&[0; 64], "0000:00:00.0", 4096).err();
        let Some(CudaIpcError::Unavailable(why)) = err else {
            panic!("expected Unavailable, got {err:?}");
        };
        assert!(why.contains("CUDA is unavailable"), "{why}");
    }
}
