//! tierkv-server: the node daemon and the `tierkv` command line.
//!
//! The daemon serves sessions over a Unix socket (and, when configured, TCP with a token), maps
//! each worker's KV memory (regions and a layout), and gathers and scatters chunks between it and L1 on behalf of the
//! StorageManager, which does everything else. It owns configuration (TOML), the Prometheus
//! exporter and the orderly shutdown. It holds no cache logic of its own: a session turns
//! requests into StorageManager calls and remembers what it holds, so a disconnect returns it.

pub mod cli;
pub mod config;
mod conn;
mod cuda_ipc;
pub mod daemon;
mod kv;
pub mod metrics;
pub mod session;

pub use conn::Peer;
pub use cuda_ipc::CudaIpcError;
pub use kv::{HostMaps, KvError, MAX_MEMFD_REGIONS, MAX_REGIONS, RegisteredKv};
