//! The L1 arena in GPU memory, through cudarc's dynamically loaded driver API.
//!
//! Copies between the arena and host memory (L1 to and from L2) run on the copy engine
//! ([`CudaCopyStream`]s of the arena's own, never the legacy default stream): a synchronous copy
//! there holds up the copy engine that a worker's device-to-device gathers use. Measured on an
//! H100, a store's gather of four 16 MiB chunks waited 4.7 ms behind a 256 MiB copy to the host
//! on the default stream, and 0.3 ms (as long as alone) when that copy ran on a stream of its
//! own. A copy is waited for on a blocking-sync event ([`CopyStream::sync`]), so the thread
//! sleeps in the driver; `cuStreamSynchronize` would spin a core for as long as the copy takes.
//!
//! The crate builds and its tests run on machines without CUDA: nothing here calls into cudarc
//! before [`cuda_available`] has found the driver library, because cudarc panics when asked to
//! load a library that is not there.

use std::ptr::NonNull;

use cudarc::driver::{CudaContext, result, sys};
use parking_lot::Mutex;

use super::copy::{At, CopyStream, Piece};
use super::cuda_copy::{CudaCopyEngine, CudaCopyStream, bind_context};
use super::{DeviceArena, DeviceError, check_range};

/// Whether the CUDA driver library is present and reports at least one device.
pub fn cuda_available() -> Result<(), DeviceError> {
    // SAFETY: this only tries to open the driver's shared library by its known names; it runs
    // no CUDA code.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::CudaUnavailable(
            "the CUDA driver library (libcuda) is not installed".into(),
        ));
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(DeviceError::CudaUnavailable("the driver reports no device".into())),
        Err(e) => {
            Err(DeviceError::CudaUnavailable(format!("the driver failed to initialise: {e}")))
        }
    }
}

/// One device allocation holding every L1 slot.
#[derive(Debug)]
pub struct CudaArena {
    engine: CudaCopyEngine,
    base: sys::CUdeviceptr,
    len: u64,
    name: String,
    /// Idle copy streams: a copy takes one (or makes one), and gives it back when it is done, so
    /// threads copying at once never wait for each other's copies.
    streams: Mutex<Vec<CudaCopyStream>>,
}

impl CudaArena {
    /// Allocates `bytes` on device `ordinal`.
    pub fn new(ordinal: usize, bytes: u64) -> Result<Self, DeviceError> {
        let alloc_error = |reason: String| DeviceError::Alloc { backend: "cuda", bytes, reason };
        let len = usize::try_from(bytes)
            .map_err(|_| alloc_error("larger than the address space".into()))?;
        if len == 0 {
            return Err(alloc_error("an arena needs at least one byte".into()));
        }
        let engine = CudaCopyEngine::new(ordinal)?;
        let context = engine.context();
        let name = context.name().unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        bind_context(context).map_err(|e| alloc_error(e.to_string()))?;
        // SAFETY: the context is bound to this thread; the returned pointer is owned by the arena
        // and freed once, in `Drop`.
        let base = unsafe { result::malloc_sync(len) }.map_err(|e| alloc_error(e.to_string()))?;
        Ok(CudaArena { engine, base, len: bytes, name, streams: Mutex::new(Vec::new()) })
    }

    fn context(&self) -> &CudaContext {
        self.engine.context()
    }

    /// Copies `piece` on an idle copy stream of the arena and waits for it.
    ///
    /// # Safety
    /// As [`CopyStream::copy`], up to the return of this call.
    unsafe fn copy_and_wait(&self, piece: Piece) -> Result<(), DeviceError> {
        let idle = self.streams.lock().pop();
        let stream = match idle {
            Some(stream) => stream,
            None => self.engine.cuda_stream().map_err(|e| DeviceError::Copy(e.to_string()))?,
        };
        // SAFETY: the caller's contract. Whatever the enqueue says, the sync waits for what was
        // enqueued before this returns: `src` or `dst` is the caller's to free the moment it
        // does. The sync also clears a refused enqueue's failure off the stream.
        let enqueued = unsafe { stream.copy(vec![piece]) };
        let copied = enqueued.and(stream.sync());
        // Back to the pool either way: the sync left it with no failure pending, and a copy
        // that failed on the device fails the context, which every later call reports.
        self.streams.lock().push(stream);
        copied.map_err(|e| DeviceError::Copy(e.to_string()))
    }
}

impl DeviceArena for CudaArena {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        format!("cuda ({}), {} bytes", self.name, self.len)
    }

    fn len(&self) -> u64 {
        self.len
    }

    unsafe fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        check_range(offset, src.len() as u64, self.len)?;
        let piece = Piece::contiguous(
            At::Host(src.as_ptr() as u64),
            At::Device(self.base + offset),
            src.len() as u64,
        );
        // SAFETY: the destination range lies inside our allocation (checked above) and the
        // caller guarantees no concurrent access to it; `src` outlives the copy, which is waited
        // for before this returns.
        unsafe { self.copy_and_wait(piece) }
    }

    unsafe fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, dst.len() as u64, self.len)?;
        let piece = Piece::contiguous(
            At::Device(self.base + offset),
            At::Host(dst.as_mut_ptr() as u64),
            dst.len() as u64,
        );
        // SAFETY: as in `copy_in`, with no concurrent writer; `dst` is exclusively borrowed
        // past the wait.
        unsafe { self.copy_and_wait(piece) }
    }

    fn host_base(&self) -> Option<NonNull<u8>> {
        None
    }

    fn device_base(&self) -> Option<u64> {
        Some(self.base)
    }
}

impl Drop for CudaArena {
    fn drop(&mut self) {
        // The streams first: each waits for its copies as it goes.
        self.streams.lock().clear();
        // A failure here leaves device memory to the driver's context teardown; there is nobody
        // to report it to in a destructor.
        if bind_context(self.context()).is_ok() {
            // SAFETY: `base` came from `malloc_sync` in `new` and is freed only here.
            let _ = unsafe { result::free_sync(self.base) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_arena_round_trip_or_skip() {
        if let Err(why) = cuda_available() {
            eprintln!("skipped: no usable CUDA device ({why})");
            return;
        }
        let arena = CudaArena::new(0, 1 << 20).unwrap();
        let data: Vec<u8> = (0..=255).cycle().take(4096).collect();
        let mut back = vec![0; data.len()];
        // SAFETY: single-threaded test, no concurrent access.
        unsafe {
            arena.copy_in(8192, &data).unwrap();
            arena.copy_out(8192, &mut back).unwrap();
        }
        assert_eq!(back, data);
        assert!(arena.device_base().is_some());
    }

    #[test]
    fn explicit_cuda_request_fails_cleanly_without_a_device() {
        match cuda_available() {
            Ok(()) => eprintln!("skipped: a CUDA device is present"),
            Err(_) => {
                assert!(matches!(CudaArena::new(0, 4096), Err(DeviceError::CudaUnavailable(_))))
            }
        }
    }
}
