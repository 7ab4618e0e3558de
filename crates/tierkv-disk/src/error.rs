//! Errors of opening a DiskStore. Failures of tasks travel in completions as `TierError`.

use std::io;
use std::path::PathBuf;

/// Why a DiskStore could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The configuration cannot describe a store.
    #[error("invalid disk tier configuration: {0}")]
    Config(String),
    /// The operating system refused an operation on a path.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("creating directory", "reading segment", ...).
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// Another store (another daemon, or this process) holds the directory's lock.
    #[error(
        "the disk directory {} is in use by another tierkv daemon ({holder}); a directory \
         serves one daemon at a time: give this one another disk.dir, or stop the other",
        dir.display()
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// Who holds it, as its lock file says ("pid 1234").
        holder: String,
    },
    /// A worker thread could not be started.
    #[error("cannot start a disk I/O thread: {0}")]
    Thread(io::Error),
}

impl DiskError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> DiskError {
        let path = path.into();
        move |source| DiskError::Io { action, path, source }
    }
}
