//! A worker's GPU memory, opened from a CUDA IPC handle, and the copies of a chunk's pieces
//! between it and an L1 slot.
//!
//! A [`CudaRegion`] is opened once per registration (`cuIpcOpenMemHandle`) and closed when it is
//! dropped (`cuIpcCloseMemHandle`), which is when the session that registered it ends. Copies run
//! on the region's own stream, one `cuMemcpyAsync` per piece (or one `cuMemcpyBatchAsync` for a
//! device-to-device chunk when the loaded driver has it), and the stream is synchronized before
//! the call returns: a store is acknowledged, and a retrieve answered, only after its copies are
//! done.
//!
//! Nothing here calls into cudarc before `cuda_available` has found the driver library (cudarc
//! panics when the library is missing), and symbols a driver may lack (`cuMemcpyBatchAsync`) are
//! resolved through `cuGetProcAddress`, never called through cudarc's lazy loader.

use std::ffi::{CString, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaStream, DriverError, sys};
use tierkv_l1::device::cuda_available;

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

/// A worker's device allocation, opened in this process.
pub struct CudaRegion {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
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
        Ok(CudaRegion { context, stream, base, len: bytes })
    }

    /// Copies `pieces` of `size` bytes: from the region at each `(offset, other)` pair to
    /// `other` (`to_region` false), or from `other` into the region (`to_region` true), then
    /// waits for the stream if `then_sync` (else the caller calls [`CudaRegion::sync`] before it
    /// relies on the bytes or lets go of either end).
    ///
    /// # Safety
    /// Every offset + `size` lies inside the region (the caller checked the layout against
    /// `len`), and every `other` end is valid for `size` bytes and not used concurrently.
    pub unsafe fn copy(
        &self,
        pieces: &[(u64, Side)],
        size: usize,
        to_region: bool,
        then_sync: bool,
    ) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        let stream = self.stream.cu_stream();
        let all_device = pieces.iter().all(|(_, s)| matches!(s, Side::Device(_)));
        if all_device && pieces.len() > 1 {
            let (dsts, srcs): (Vec<u64>, Vec<u64>) = pieces
                .iter()
                .map(|&(at, side)| {
                    let other = match side {
                        Side::Device(p) => p,
                        Side::Host(p) => p as u64,
                    };
                    if to_region { (self.base + at, other) } else { (other, self.base + at) }
                })
                .unzip();
            // SAFETY: the ranges are valid (the caller's contract); the stream is ours.
            match unsafe { batch_copy(&dsts, &srcs, size, stream) } {
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
        for &(at, side) in pieces {
            let here = self.base + at;
            // SAFETY: the ranges are valid (the caller's contract); the stream is ours.
            let rc = unsafe {
                match (side, to_region) {
                    (Side::Device(p), true) => sys::cuMemcpyAsync(here, p, size, stream),
                    (Side::Device(p), false) => sys::cuMemcpyAsync(p, here, size, stream),
                    (Side::Host(p), true) => {
                        sys::cuMemcpyHtoDAsync_v2(here, p as *const c_void, size, stream)
                    }
                    (Side::Host(p), false) => {
                        sys::cuMemcpyDtoHAsync_v2(p as *mut c_void, here, size, stream)
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

    /// Waits until every copy enqueued on the region's stream is done; an error if one failed.
    pub fn sync(&self) -> Result<(), CudaIpcError> {
        self.context.bind_to_thread().map_err(driver("cannot bind the device"))?;
        self.stream.synchronize().map_err(driver("the copies failed"))
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
    // SAFETY: a plain C struct; all-zero is a valid value for each field's type's role here
    // (location hints "invalid", i.e. none), then the order is set.
    let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
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
