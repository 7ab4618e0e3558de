//! The processes a daemon replay runs: the daemon itself (unless one is given) and one worker
//! per TP rank. Each dies with the replay, even if the replay is killed.

use std::fmt::Write as _;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tierkv_core::policy::PolicyKind;
use tierkv_disk::{BLOCK, record_bytes};

use crate::ReplayError;
use crate::sim::LowerTiers;

/// Makes the child die with the thread that started it, so a replay (or a test) that is killed
/// or panics leaves no process behind.
pub fn die_with_parent(command: &mut Command) -> &mut Command {
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec here.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// A child process that is asked to stop (SIGTERM), then killed, when dropped.
pub struct Reaped(pub Child);

impl Reaped {
    /// Sends SIGTERM and waits up to `grace` for the child to exit, then kills it. A child
    /// already reaped is left alone: its pid may belong to another process by now.
    pub fn stop(&mut self, grace: Duration) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.0.id()) {
            // SAFETY: kill(2) on our own child's pid; a failure (already gone) is harmless.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        self.reap(grace);
    }

    /// Waits up to `grace` for the child to exit by itself, then kills it. Returns whether it
    /// exited successfully by itself.
    pub fn reap(&mut self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            match self.0.try_wait() {
                Ok(Some(status)) => return status.success(),
                Err(_) => return false,
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
        false
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// How many chunks each tier of a started daemon holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TierChunks {
    /// L1 (emulated GPU memory), at least one.
    pub l1: u64,
    /// L2 (host memory); 0 turns it off.
    pub l2: u64,
    /// Disk, in whole segments of `disk_segment` chunks, at least two; 0 turns it off.
    pub disk: u64,
    /// Chunks per disk segment: the disk frees a segment at a time.
    pub disk_segment: u64,
    /// The policy over the disk's segments; `None`: the run's own.
    #[serde(serialize_with = "policy_name")]
    pub disk_policy: Option<PolicyKind>,
    /// Whether the lower tiers hold what the tier above evicted (`store_policy = "cascade"`)
    /// rather than a copy of every store (write-through).
    pub cascade: bool,
    /// L1's index shards; 0 leaves the choice to the daemon (from L1's size).
    pub l1_shards: u32,
}

/// A policy by its configuration name, in replay.json.
fn policy_name<S: serde::Serializer>(
    policy: &Option<PolicyKind>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(&policy.map(PolicyKind::as_str), serializer)
}

/// A daemon the replay started, in a directory of its own that goes with it.
pub struct SpawnedDaemon {
    process: Reaped,
    socket: PathBuf,
    /// The daemon's `server.token`: the warm-up's `clear` needs it.
    token: String,
    // Dropped after the process: the daemon removes its socket and syncs the disk tier first.
    _dir: tempfile::TempDir,
}

impl SpawnedDaemon {
    /// Starts `program serve` on a configuration with `tiers` of `chunk_bytes` chunks evicted by
    /// `policy`, and waits until it accepts connections, or until `interrupt` is set
    /// ([`ReplayError::Interrupted`]: the daemon is stopped and its directory removed).
    pub fn start(
        program: &Path,
        chunk_bytes: u64,
        tiers: TierChunks,
        policy: PolicyKind,
        interrupt: Option<&AtomicBool>,
    ) -> Result<SpawnedDaemon, ReplayError> {
        let dir = tempfile::Builder::new()
            .prefix("tierkv-replay-")
            .tempdir()
            .map_err(|e| ReplayError::io("create the daemon's directory", e))?;
        let socket = dir.path().join("tierkv.sock");
        let config = dir.path().join("tierkv.toml");
        // Not a secret worth guarding (the socket is the daemon user's only): it lets this
        // replay's own admin session clear the daemon it started.
        let token = format!(
            "replay-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        std::fs::write(&config, daemon_config(dir.path(), chunk_bytes, tiers, policy, &token)?)
            .map_err(|e| ReplayError::io("write the daemon's configuration", e))?;
        let log_path = dir.path().join("daemon.log");
        let log = std::fs::File::create(&log_path)
            .map_err(|e| ReplayError::io("create the daemon's log", e))?;
        let log_err = log.try_clone().map_err(|e| ReplayError::io("open the daemon's log", e))?;
        let child = die_with_parent(
            Command::new(program)
                .arg("serve")
                .arg("--config")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err),
        )
        .spawn()
        .map_err(|e| ReplayError::io(format!("start {} serve", program.display()), e))?;
        let mut process = Reaped(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                break;
            }
            if interrupt.is_some_and(|flag| flag.load(Ordering::Relaxed)) {
                return Err(ReplayError::Interrupted);
            }
            let exited = process.0.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let why =
                    exited.map_or("did not open its socket in 60 s".into(), |s| s.to_string());
                return Err(ReplayError::Daemon(format!("the daemon {why}; its log:\n{log}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(SpawnedDaemon { process, socket, token, _dir: dir })
    }

    /// Its Unix socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its `server.token`, which admin sessions present to `clear`.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Stops it (SIGTERM, the daemon drains and syncs).
    pub fn stop(mut self) {
        self.process.stop(Duration::from_secs(15));
    }
}

/// The configuration of a replay's daemon: the tiers as asked, and nothing that would make it
/// count differently from the simulation. One index shard keeps L1's eviction order exact (with
/// several, each shard evicts by its own order); watermarks of 1.0 leave eviction to demand; the
/// lease outlives any request; the disk does not sync (a replay's chunks are disposable); L1's
/// and L2's memory is committed at start (`prefault`), so no timed copy pays its page faults and
/// nothing has to be stored through the policies before the trace to commit it.
fn daemon_config(
    dir: &Path,
    chunk_bytes: u64,
    tiers: TierChunks,
    policy: PolicyKind,
    token: &str,
) -> Result<String, ReplayError> {
    let policy = policy.as_str();
    let bytes = |chunks: u64, per_chunk: u64| {
        chunks.checked_mul(per_chunk).ok_or_else(|| {
            ReplayError::Invalid(format!("{chunks} chunks of {per_chunk} bytes overflow"))
        })
    };
    let mut text = format!(
        "[server]\nsocket = {socket}\ntoken = \"{token}\"\nmax_frame = \"64MiB\"\n\n[metrics]\nenabled = false\n\n\
         [l1]\ndevice = \"emulated\"\ncapacity = {l1}\nslot = {chunk_bytes}\npolicy = \"{policy}\"\n\
         lease_ttl = \"1h\"\nwatermark_high = 1.0\nwatermark_low = 1.0\nshards = {shards}\n\
         prefault = true\n\n",
        socket = toml_string(&dir.join("tierkv.sock"))?,
        l1 = bytes(tiers.l1.max(1), chunk_bytes)?,
        shards = tiers.l1_shards,
    );
    // Stated, whatever the daemon's default; a stop hands nothing down (the directory goes).
    let store_policy = if tiers.cascade { "cascade" } else { "write_through" };
    let _ = write!(
        text,
        "[storage]\nstore_policy = \"{store_policy}\"\nstop_drain_timeout = \"0s\"\n\n"
    );
    if tiers.l2 == 0 {
        text.push_str("[l2]\nenabled = false\n\n");
    } else {
        let _ = write!(
            text,
            "[l2]\ncapacity = {}\nmemory = \"plain\"\npolicy = \"{policy}\"\n\
             watermark_high = 1.0\nwatermark_low = 1.0\nprefault = true\n\n",
            bytes(tiers.l2, chunk_bytes)?
        );
    }
    if tiers.disk == 0 {
        text.push_str("[disk]\nenabled = false\n");
    } else {
        // The simulation's disk: whole segments of `disk_segment` records and a block of header
        // each, so the daemon's disk holds exactly the chunks the simulated one does.
        let chunks = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        let lower = LowerTiers {
            l2: chunks(tiers.l2),
            disk: chunks(tiers.disk),
            disk_segment: chunks(tiers.disk_segment),
            disk_policy: tiers.disk_policy,
        };
        let disk_policy = tiers.disk_policy.map_or(policy, PolicyKind::as_str);
        let segment = bytes(tiers.disk_segment.max(1), record_bytes(chunk_bytes))?
            .checked_add(BLOCK)
            .ok_or_else(|| ReplayError::Invalid("a disk segment's size overflows".into()))?;
        let _ = write!(
            text,
            "[disk]\ndir = {}\ncapacity = {}\nsegment = {segment}\nfsync = \"never\"\n\
             policy = \"{disk_policy}\"\n",
            toml_string(&dir.join("disk"))?,
            bytes(lower.disk_segments() as u64, segment)?
        );
    }
    Ok(text)
}

/// A path as a TOML string, quoted and escaped (a JSON string is a valid TOML basic string).
fn toml_string(path: &Path) -> Result<String, ReplayError> {
    let text = path.to_str().ok_or_else(|| {
        ReplayError::Invalid(format!("{} is not UTF-8; set TMPDIR elsewhere", path.display()))
    })?;
    serde_json::to_string(text).map_err(|e| ReplayError::Invalid(e.to_string()))
}
