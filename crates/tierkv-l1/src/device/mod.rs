//! Device backends: where L1 bytes live.
//!
//! One trait, one file per backend. The L1 manager decides who may touch which slot; a backend
//! only moves bytes between host memory and a byte range of its arena, and checks that the range
//! lies inside the arena. The asynchronous copy engine (`copy.rs`, emulated on host threads in
//! `emulated_copy.rs`, on CUDA streams in `cuda_copy.rs`) is the shape the GPU data path's moves
//! take: ordered streams, events, completion callbacks. On a GPU every move runs on it: the
//! arena's own copies to and from host memory, and the server's copies between a worker's KV and
//! L1 slots. The emulated arena copies on the caller's thread (its memory is host memory).

mod copy;
mod cuda;
mod cuda_copy;
mod emulated;
mod emulated_copy;

use std::fmt::Debug;
use std::ptr::NonNull;

pub use copy::{At, CopyEngine, CopyError, CopyStream, Event, Piece};
pub use cuda::{CudaArena, cuda_available};
pub use cuda_copy::{CudaCopyEngine, CudaCopyStream, MAX_PITCH, NO_BATCH_ENV, bind_context};
pub use emulated::EmulatedArena;
pub use emulated_copy::{EmulatedCopyEngine, EmulatedStream, FaultHook};

/// Which backend an L1 should use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    /// CUDA when the driver library is present and a device answers, emulated otherwise.
    #[default]
    Auto,
    /// Host memory standing in for a GPU.
    Emulated,
    /// The CUDA device with this ordinal; an error if none can be opened.
    Cuda {
        /// Device ordinal, as `CUDA_VISIBLE_DEVICES` numbers them.
        ordinal: usize,
    },
}

/// A backend could not be opened or a copy failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The arena could not be allocated.
    #[error("cannot allocate a {bytes}-byte {backend} arena: {reason}")]
    Alloc {
        /// "emulated" or "cuda".
        backend: &'static str,
        /// Requested size.
        bytes: u64,
        /// What the OS or driver said.
        reason: String,
    },
    /// CUDA was asked for explicitly and cannot be used.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// A byte range outside the arena.
    #[error("range {offset}+{len} lies outside the {arena}-byte arena")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Arena size.
        arena: u64,
    },
    /// The driver refused a copy.
    #[error("device copy failed: {0}")]
    Copy(String),
}

/// A contiguous region of device (or stand-in) memory that L1 slots are carved from.
pub trait DeviceArena: Send + Sync + Debug {
    /// "emulated" or "cuda", for logs, status and metric labels.
    fn backend(&self) -> &'static str;

    /// A human description: device name and size.
    fn describe(&self) -> String;

    /// Arena size in bytes.
    fn len(&self) -> u64;

    /// Whether the arena has no bytes (never, for an arena that was opened successfully).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the arena at `offset`.
    ///
    /// # Safety
    /// No other copy may read or write the range `offset..offset + src.len()` concurrently. The
    /// L1 slot protocol guarantees this: one writer per `Writing` slot, readers only on `Ready`.
    unsafe fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), DeviceError>;

    /// Copies the range at `offset` into `dst`.
    ///
    /// # Safety
    /// No copy may write the range concurrently.
    unsafe fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// The arena's base address when it lives in host memory (emulated), for in-place access.
    fn host_base(&self) -> Option<NonNull<u8>>;

    /// The arena's device address (a `CUdeviceptr`) when it lives on a GPU.
    fn device_base(&self) -> Option<u64>;
}

/// Checks that `offset..offset+len` lies inside an arena of `arena` bytes.
pub(crate) fn check_range(offset: u64, len: u64, arena: u64) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= arena => Ok(()),
        _ => Err(DeviceError::OutOfBounds { offset, len, arena }),
    }
}

/// Opens the arena `kind` asks for. `Auto` probes for the CUDA driver library before touching
/// cudarc (a call into cudarc without the library panics), and falls back to host memory when
/// no device answers.
///
/// `prefault` commits an emulated arena's pages up front; device memory is committed when it is
/// allocated, so it changes nothing there.
pub fn open_arena(
    kind: DeviceKind,
    bytes: u64,
    prefault: bool,
) -> Result<Box<dyn DeviceArena>, DeviceError> {
    let emulated = || -> Result<Box<dyn DeviceArena>, DeviceError> {
        Ok(Box::new(EmulatedArena::with_prefault(bytes, prefault)?))
    };
    match kind {
        DeviceKind::Emulated => emulated(),
        DeviceKind::Cuda { ordinal } => Ok(Box::new(CudaArena::new(ordinal, bytes)?)),
        DeviceKind::Auto => match cuda_available() {
            Ok(()) => match CudaArena::new(0, bytes) {
                Ok(arena) => Ok(Box::new(arena)),
                Err(DeviceError::CudaUnavailable(_)) => emulated(),
                Err(other) => Err(other),
            },
            Err(_) => emulated(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_checks_catch_overflow_and_overrun() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(check_range(1, 10, 10).is_err());
        assert!(check_range(u64::MAX, 2, 10).is_err());
    }

    #[test]
    fn auto_opens_some_backend_and_emulated_when_asked() {
        let arena = open_arena(DeviceKind::Auto, 1 << 20, false).unwrap();
        assert_eq!(arena.len(), 1 << 20);
        let emulated = open_arena(DeviceKind::Emulated, 4096, false).unwrap();
        assert_eq!(emulated.backend(), "emulated");
        assert!(emulated.host_base().is_some() && emulated.device_base().is_none());
    }
}
