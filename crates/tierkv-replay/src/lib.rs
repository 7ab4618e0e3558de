//! tierkv-replay: public request traces through tierkv, and what they show.
//!
//! Two ways to replay a trace, counting hits the same way:
//! - [`simulate`]: the eviction policies alone over the trace's chunk stream, fast enough to
//!   sweep capacities, with the offline optimum (Belady) as the upper bound;
//! - [`replay_daemon`]: through a real daemon, started for the run or already running, with one
//!   worker process per TP rank storing chunks whose bytes derive from their ids and checking
//!   every byte it retrieves.
//!
//! `tierkv replay` is the command line of both; [`report`] prints, writes and plots the results.

pub mod process;
pub mod report;
mod run;
pub mod sim;
pub mod trace;
pub mod worker;

pub use report::{Mode, RunResult};
pub use run::{DaemonPlan, MAX_CHUNK_BYTES, Pace, Target, replay_daemon, sweep_simulation};
pub use sim::{DISK_SEGMENT_CHUNKS, LowerTiers, Policy, SimCounts, simulate, simulate_cascade};
pub use trace::{Trace, TraceError, TraceRequest};

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The operating system refused something.
    #[error("cannot {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The daemon did not start, or went away.
    #[error("{0}")]
    Daemon(String),
    /// A worker process failed a step.
    #[error("worker of rank {rank}: {message}")]
    Worker {
        /// Its rank.
        rank: u16,
        /// What went wrong.
        message: String,
    },
    /// The daemon's answers do not add up (a lost chunk, a wrong byte count).
    #[error("inconsistent replay: {0}")]
    Inconsistent(String),
    /// The options do not make a replay.
    #[error("{0}")]
    Invalid(String),
    /// The replay was interrupted (Ctrl-C or SIGTERM).
    #[error("interrupted")]
    Interrupted,
    /// The plot could not be drawn.
    #[error("cannot draw the plot: {0}")]
    Plot(String),
}

impl ReplayError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> ReplayError {
        ReplayError::Io { what: what.into(), source }
    }
}
