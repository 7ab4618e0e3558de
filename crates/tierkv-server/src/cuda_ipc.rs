//! A worker's GPU memory, opened from a CUDA IPC handle, and the copies of a chunk's pieces
//! between it and an L1 slot.
//!
//! A [`CudaRegion`] is opened once per registration (`cuIpcOpenMemHandle`) and closed when it is
//! dropped (`cuIpcCloseMemHandle`), which is when the session that registered it ends. Its copies
//! run on a stream of the copy engine (`tierkv_l1::device::CudaCopyStream`, the one CUDA copy
//! path of the daemon, L1's own moves included): a block's pieces across evenly spaced segments
//! as one strided piece (one `cuMemcpy2DAsync`), the single pieces of a request between device
//! memory as one batch where the driver has it. On an H100, 2D copies move a Llama-3-8B chunk's
//! 32 KiB pieces device to device about 25 times faster than a batch of the same pieces
//! (docs/performance.md, the GPU table). A store is acknowledged, and a retrieve without an event
//! answered, only after its copies are done.
//!
//! Nothing here calls into cudarc before `cuda_available` has found the driver library (cudarc
//! panics when the library is missing).

use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError, sys};
use tierkv_l1::device::{
    At, CopyError, CopyStream, CudaCopyEngine, CudaCopyStream, bind_context, cuda_available,
};

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
    /// The driver refused (an open, an event).
    #[error("{what}: {error}")]
    Driver {
        /// The call that failed.
        what: &'static str,
        /// The driver's error.
        error: DriverError,
    },
    /// The copy engine refused or failed a copy, or an event on its stream.
    #[error("{0}")]
    Copy(#[from] CopyError),
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaIpcError {
    move |error| CudaIpcError::Driver { what, error }
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
    pub other: At,
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
    /// Whether the event's latest record has completed (an event never recorded has); the host
    /// does not wait.
    pub fn is_complete(&self) -> Result<bool, CudaIpcError> {
        bind_context(&self.context).map_err(driver("cannot bind the device"))?;
        // SAFETY: the event is live while borrowed, and its context is bound to this thread.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            error => {
                Err(CudaIpcError::Driver { what: "cuEventQuery failed", error: DriverError(error) })
            }
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if bind_context(&self.context).is_ok() {
            // SAFETY: `event` came from `cuIpcOpenEventHandle` and is destroyed only here.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) }.result();
        }
    }
}

/// A worker's device allocation, opened in this process.
pub struct CudaRegion {
    /// Where the region's copies run, in the region's context; dropped (its copies waited for)
    /// after the mapping closes, which `Drop` precedes with a sync.
    stream: CudaCopyStream,
    base: sys::CUdeviceptr,
    len: u64,
}

// SAFETY: the region owns its mapping; the raw pointer is a driver handle valid in every thread
// that binds the context (which every method does first).
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
    /// `device`. `bytes` is what the worker says the allocation holds, and it bounds every copy:
    /// it is checked against the allocation the driver mapped, and a region larger than that is
    /// refused (its copies would run in the daemon's context, over other workers' regions or L1).
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
        let engine = CudaCopyEngine::new(ordinal)
            .map_err(|e| CudaIpcError::Unavailable(format!("cannot open the device: {e}")))?;
        let stream = engine.cuda_stream()?;
        bind_context(stream.context()).map_err(driver("cannot bind the device"))?;
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
        let (mut start, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: the context is bound; `base` was just mapped; valid out-pointers.
        let ranged = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) }.result();
        let end = start.saturating_add(size as u64);
        let refusal = match ranged {
            Err(e) => Some(format!("the driver cannot say how large the allocation is: {e}")),
            Ok(()) if base.saturating_add(bytes) > end => Some(format!(
                "the region says {bytes} bytes, the allocation the handle maps holds {}",
                end.saturating_sub(base)
            )),
            Ok(()) => None,
        };
        if let Some(why) = refusal {
            // SAFETY: mapped above, closed once, here; nothing was copied through it.
            let _ = unsafe { sys::cuIpcCloseMemHandle(base) }.result();
            return Err(CudaIpcError::Malformed(why));
        }
        Ok(CudaRegion { stream, base, len: bytes })
    }

    /// Copies `copies`, rows of `width` bytes each: from the region to each copy's `other` end
    /// (`to_region` false), or from `other` into the region (`to_region` true), then waits for
    /// the stream if `then_sync` (else the caller calls [`CudaRegion::sync`] before it relies on
    /// the bytes or lets go of either end). Each copy is one piece of the copy engine: several
    /// rows one `cuMemcpy2DAsync`, the single rows between device memory one batch.
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
        let pieces = copies
            .iter()
            .map(|rows| {
                let here = (At::Device(self.base + rows.offset), rows.pitch);
                let other = (rows.other, rows.other_pitch);
                let ((src, src_pitch), (dst, dst_pitch)) =
                    if to_region { (other, here) } else { (here, other) };
                let (width, rows) = (width as u64, rows.rows as u64);
                tierkv_l1::device::Piece { src, src_pitch, dst, dst_pitch, width, rows }
            })
            .collect();
        // SAFETY: the caller's contract, passed on.
        if let Err(e) = unsafe { self.stream.copy(pieces) } {
            // Wait for what was queued before reporting, so no copy outlives the call.
            let _ = self.sync();
            return Err(e.into());
        }
        if then_sync { self.sync() } else { Ok(()) }
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
        bind_context(self.stream.context()).map_err(driver("cannot bind the device"))?;
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
        Ok(CudaEvent { context: Arc::clone(self.stream.context()), event })
    }

    /// Records `event` on the region's stream: it completes once everything enqueued before it
    /// has (for a worker's event opened by IPC, the worker sees the record).
    pub fn record(&self, event: &CudaEvent) -> Result<(), CudaIpcError> {
        // SAFETY: `event` is live while borrowed, opened in a region's context of this device.
        Ok(unsafe { self.stream.record_cuda_event(event.event) }?)
    }

    /// Makes this region's stream wait, on the device, for everything enqueued so far on
    /// `other`'s: the one stream a worker's event is recorded on then follows both.
    pub fn join(&self, other: &CudaRegion) -> Result<(), CudaIpcError> {
        Ok(self.stream.follow(&other.stream)?)
    }

    /// Drops `keep` once everything enqueued on the region's stream so far has completed: the
    /// guards of the slots a retrieve copies from. The stream's event thread drops it when the
    /// event recorded now fires; if no event can be recorded, this waits here and drops it:
    /// `keep` never goes before the copies.
    pub fn drop_when_done(&self, keep: Box<dyn Send>) {
        match self.stream.record() {
            Ok(event) => event.on_complete(move |result| {
                if let Err(e) = result
                    && *e != CopyError::Stopped
                {
                    tracing::error!("copies of a retrieve failed after its reply: {e}");
                }
                drop(keep);
            }),
            Err(_) => {
                let _ = self.sync();
                drop(keep);
            }
        }
    }

    /// Waits until every copy enqueued on the region's stream is done; an error if one failed.
    /// The thread sleeps in the driver ([`CopyStream::sync`]).
    pub fn sync(&self) -> Result<(), CudaIpcError> {
        Ok(self.stream.sync()?)
    }
}

impl Drop for CudaRegion {
    fn drop(&mut self) {
        // Nobody to report a failure to in a destructor; the driver releases the mapping with
        // the process at the latest.
        let _ = self.stream.sync();
        if bind_context(self.stream.context()).is_ok() {
            // SAFETY: `base` came from `cuIpcOpenMemHandle` and is closed only here, after the
            // copies into and out of it.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
