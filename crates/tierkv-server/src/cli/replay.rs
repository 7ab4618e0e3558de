//! `tierkv replay`: traces through the policies (`--simulate`) or through a daemon, and
//! `tierkv replay-worker`, the worker process a daemon replay starts per rank.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use clap::Args;
use tierkv_core::policy::PolicyKind;
use tierkv_replay::process::TierChunks;
use tierkv_replay::report::{daemon_table, simulation_table, write_json, write_plot};
use tierkv_replay::worker::{WorkerSpec, serve_worker};
use tierkv_replay::{
    DISK_SEGMENT_CHUNKS, DaemonPlan, LowerTiers, MAX_CHUNK_BYTES, Pace, Policy, RunResult, Target,
    Trace,
};

use crate::config::ByteSize;

/// The options of `tierkv replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Trace files: Mooncake JSONL (`hash_ids`) or generic JSONL (`chunks`); see docs/replay.md.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Run the eviction policies alone over the chunk stream: no daemon, no bytes.
    #[arg(long)]
    simulate: bool,
    /// Cache capacity: chunks (`5859`), bytes of --chunk-bytes chunks (`3GiB`), or `unbounded`
    /// (simulation only). A comma-separated list sweeps. With a daemon this is L1's capacity.
    /// Default: 10000.
    #[arg(long, value_delimiter = ',')]
    capacity: Option<Vec<String>>,
    /// Eviction policies: `lru`, `s3fifo`, `adaptive`, and, simulation only, `belady` (the
    /// offline optimum) and `lru-oracle-admission`, `s3fifo-oracle-admission`,
    /// `adaptive-oracle-admission` (the policy caching only chunks named again: the bound on
    /// admission rules over its order), and `popularity-oracle` (evicting the chunk the trace
    /// names fewest times). A comma-separated list compares them. Default: adaptive.
    #[arg(long, value_delimiter = ',')]
    policy: Option<Vec<String>>,
    /// Bytes of each chunk's payload (daemon replays).
    #[arg(long, default_value = "64KiB")]
    chunk_bytes: ByteSize,
    /// L2 (host memory) capacity in chunks or bytes; off unless given.
    #[arg(long)]
    l2: Option<String>,
    /// Disk capacity in chunks or bytes, in whole segments; off unless given.
    #[arg(long)]
    disk: Option<String>,
    /// Chunks per disk segment (the disk frees a segment at a time). The default, 1, is the
    /// disk tier's `segment = "auto"`: it frees one chunk at a time.
    #[arg(long, default_value_t = DISK_SEGMENT_CHUNKS as u64)]
    disk_segment: u64,
    /// The policy over the disk's segments (`lru`, `s3fifo`, `adaptive`); default: each run's
    /// --policy.
    #[arg(long)]
    disk_policy: Option<String>,
    /// How stores reach the lower tiers: `cascade` (the daemon's default: each tier holds what
    /// the one above evicted; with --simulate, --l2 and --disk, in chunks, model the tiers) or
    /// `write-through` (every tier a copy of every store; a simulation models one cache).
    /// Default: cascade.
    #[arg(long, value_enum)]
    store_policy: Option<StorePolicyArg>,
    /// L1's index shards: 1 (one policy over all of L1), a power of two up to 1,024, or 0 for
    /// the daemon's own choice from L1's size, as a daemon started from a configuration without
    /// `shards` makes it. The simulation models the same shards: chunk for chunk with LRU and
    /// S3-FIFO, within 0.0005 with the adaptive policy.
    #[arg(long, default_value_t = 1)]
    l1_shards: u32,
    /// Ranks of the TP group: one worker process and one session each.
    #[arg(long, default_value_t = 1)]
    tp: u16,
    /// The ranks share one copy of each chunk (MLA): rank 0 looks up and stores, every rank
    /// retrieves. Without it each rank stores and loads its own KV.
    #[arg(long)]
    mla: bool,
    /// Send requests at the trace's timestamps divided by this factor, instead of as fast as
    /// possible.
    #[arg(long)]
    speedup: Option<f64>,
    /// Replay only the first N requests of each trace.
    #[arg(long)]
    limit: Option<usize>,
    /// Tokens per chunk of generic and Azure traces (Mooncake's are 512).
    #[arg(long, default_value_t = 512)]
    chunk_tokens: u64,
    /// Replay through the daemon already listening on this Unix socket (in a namespace of its
    /// own) instead of starting one; its tiers and policy are its own.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// With --socket: the model name of the replay's namespace (default: a fresh one per
    /// replay), so replays through several daemons that share a remote tier share one
    /// namespace, as the nodes serving one model do.
    #[arg(long, requires = "socket")]
    model: Option<String>,
    /// The directory for replay.json and hit_ratio.svg.
    #[arg(long, default_value = "replay-results")]
    out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

impl ReplayArgs {
    /// Whether the lower tiers run the cascade (the default) rather than write-through.
    fn cascade(&self) -> bool {
        self.store_policy != Some(StorePolicyArg::WriteThrough)
    }
}

/// `tierkv replay --store-policy`: the store policies a replay's daemon can run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum StorePolicyArg {
    Cascade,
    WriteThrough,
}

/// The options of `tierkv replay-worker` (started by `tierkv replay`, not by people).
#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    model: String,
    #[arg(long)]
    rank: u16,
    #[arg(long)]
    tp: u16,
    #[arg(long)]
    mla: bool,
    #[arg(long)]
    chunk_bytes: u64,
    #[arg(long)]
    chunk_tokens: u64,
    #[arg(long)]
    max_chunks: u64,
}

/// Runs a worker until the replay closes its stdin.
pub fn worker(args: WorkerArgs) -> Result<(), String> {
    let spec = WorkerSpec {
        socket: args.socket,
        model: args.model,
        rank: args.rank,
        tp: args.tp,
        mla: args.mla,
        chunk_bytes: args.chunk_bytes,
        chunk_tokens: args.chunk_tokens,
        max_chunks: args.max_chunks,
    };
    serve_worker(&spec).map_err(|e| e.to_string())
}

/// A capacity in chunks; `None` is unbounded.
fn capacity(text: &str, chunk_bytes: u64) -> Result<Option<u64>, String> {
    let text = text.trim();
    if matches!(text, "unbounded" | "inf" | "infinite") {
        return Ok(None);
    }
    if let Ok(chunks) = text.replace('_', "").parse::<u64>() {
        return Ok(Some(chunks));
    }
    let bytes = ByteSize::from_str(text)
        .map_err(|e| format!("capacity {text:?}: neither a chunk count nor a size: {e}"))?;
    let chunks = bytes.0 / chunk_bytes.max(1);
    if chunks == 0 {
        // A size means a cache: one that holds no chunk is a slip, not a request for none.
        return Err(format!(
            "capacity {text:?} holds no chunk of {chunk_bytes} bytes (--chunk-bytes); give 0 to \
             mean none"
        ));
    }
    Ok(Some(chunks))
}

/// Runs `tierkv replay`: prints the summary table, writes the files, and returns the lines that
/// say where they are.
pub fn replay(args: ReplayArgs) -> Result<String, String> {
    let chunk_bytes = args.chunk_bytes.0;
    if chunk_bytes == 0 || chunk_bytes > MAX_CHUNK_BYTES {
        return Err(format!("--chunk-bytes must be within 1..={MAX_CHUNK_BYTES} bytes"));
    }
    if args.chunk_tokens == 0 {
        return Err("--chunk-tokens must be positive".into());
    }
    if args.limit == Some(0) {
        return Err("--limit 0 leaves no requests to replay".into());
    }
    let mut traces: Vec<Trace> = Vec::new();
    for path in &args.traces {
        let mut trace = Trace::read(path, args.chunk_tokens).map_err(|e| e.to_string())?;
        if let Some(limit) = args.limit {
            trace.truncate(limit);
        }
        // Results are named, grouped and plotted by the trace's name: two of one name would
        // be counted as one.
        if let Some(i) = traces.iter().position(|t| t.name == trace.name) {
            return Err(format!(
                "{} and {} are both named {:?} (a trace is named by its file's stem): rename \
                 one, or replay them one at a time",
                args.traces[i].display(),
                path.display(),
                trace.name
            ));
        }
        traces.push(trace);
    }
    let capacity_given = args.capacity.is_some();
    let capacities = args
        .capacity
        .clone()
        .unwrap_or_else(|| vec!["10000".into()])
        .iter()
        .map(|c| capacity(c, chunk_bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let policy_given = args.policy.is_some();
    let policies = args
        .policy
        .clone()
        .unwrap_or_else(|| vec![PolicyKind::default().as_str().into()])
        .iter()
        .map(|p| {
            Policy::parse(p.trim()).ok_or_else(|| {
                format!(
                    "unknown policy {p:?}: lru, s3fifo, adaptive, belady, popularity-oracle, \
                     or one of the first three with -oracle-admission"
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if args.disk_segment == 0 {
        return Err("--disk-segment must be at least one chunk".into());
    }
    if args.l1_shards != 0 && !(args.l1_shards.is_power_of_two() && args.l1_shards <= 1024) {
        return Err(format!(
            "--l1-shards must be 0 (the daemon's choice) or a power of two up to 1024, got {}",
            args.l1_shards
        ));
    }

    if args.simulate {
        let daemon_only = [
            ("--l2", args.l2.is_some() && !args.cascade()),
            ("--disk", args.disk.is_some() && !args.cascade()),
            ("--disk-policy", args.disk_policy.is_some() && !args.cascade()),
            ("--socket", args.socket.is_some()),
            ("--tp", args.tp != 1),
            ("--mla", args.mla),
            ("--speedup", args.speedup.is_some()),
        ];
        let given: Vec<&str> =
            daemon_only.iter().filter(|(_, set)| *set).map(|(o, _)| *o).collect();
        if !given.is_empty() {
            return Err(format!(
                "{} only apply to a daemon replay; --simulate models L1 of --capacity and the \
                 --l2 and --disk tiers below it (under --store-policy write-through, one cache of \
                 --capacity chunks)",
                given.join(", ")
            ));
        }
    }
    let (targets, lower) = if args.simulate {
        let lower = lower_tiers(&args)?;
        if lower.is_some() && capacities.contains(&Some(0)) {
            // The online policies' cascade needs an L1 to evict from (a daemon refuses an L1 of
            // none too); the optimum would count the tiers below alone.
            return Err("--l2 and --disk need an L1 of at least one chunk (--capacity)".into());
        }
        (Vec::new(), lower)
    } else {
        for trace in &traces {
            pace(&args).check(trace).map_err(|e| e.to_string())?;
        }
        (daemon_targets(&args, &capacities, &policies, capacity_given || policy_given)?, None)
    };
    // Once every option is known good, and before any replay runs, so a directory that cannot
    // be written loses no results.
    writable(&args.out)?;
    let results: Vec<RunResult> = if args.simulate {
        tierkv_replay::sweep_simulation(
            &traces,
            &policies,
            &capacities,
            (lower, args.l1_shards),
            !args.quiet,
        )
    } else {
        daemon_runs(&args, &traces, &targets)?
    };

    // The table first: a failure writing the files below still shows the results.
    let table = if args.simulate { simulation_table(&results) } else { daemon_table(&results) };
    super::print(&table)?;
    let json = args.out.join("replay.json");
    let command: Vec<String> =
        std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
    write_json(&json, &command, &results).map_err(|e| e.to_string())?;
    let mut text = format!("\nresults: {}\n", json.display());
    let plot = args.out.join("hit_ratio.svg");
    if write_plot(&plot, &results).map_err(|e| e.to_string())? {
        text.push_str(&format!("plot: {}\n", plot.display()));
    }
    Ok(text)
}

/// Makes `dir` if need be and checks that a file can be written in it (created and removed),
/// so that an unwritable directory is found before the replay rather than after.
fn writable(dir: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let probe = dir.join(format!(".tierkv-replay-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("cannot write to {}: {e}", dir.display()))
}

/// The daemons to replay through, one per capacity and policy (or the one at `--socket`), all
/// checked before any runs.
fn daemon_targets(
    args: &ReplayArgs,
    capacities: &[Option<u64>],
    policies: &[Policy],
    sweep_given: bool,
) -> Result<Vec<Target>, String> {
    if args.tp == 0 {
        return Err("--tp must be at least 1".into());
    }
    if let Some(f) = args.speedup
        && !(f.is_finite() && f > 0.0)
    {
        return Err(format!("--speedup {f}: must be a positive factor"));
    }
    if let Some(socket) = &args.socket {
        let policy_given = args.store_policy.is_some() || args.disk_policy.is_some();
        let tiers_given = args.l2.is_some() || args.disk.is_some() || args.l1_shards != 1;
        if sweep_given || tiers_given || policy_given {
            return Err("with --socket the daemon's own tiers and policies apply: drop \
                        --capacity, --policy, --l2, --disk, --disk-policy, --store-policy and \
                        --l1-shards"
                .into());
        }
        return Ok(vec![Target::Socket(socket.clone())]);
    }
    let (l2, disk) = (tier_chunks(args, &args.l2)?, tier_chunks(args, &args.disk)?);
    let mut targets = Vec::new();
    for &capacity in capacities {
        let l1 = capacity.ok_or("an unbounded capacity needs --simulate")?;
        if l1 == 0 {
            return Err("L1 needs a capacity of at least one chunk".into());
        }
        for policy in policies {
            let Policy::Online(kind) = *policy else {
                return Err(format!("{} knows the future: it needs --simulate", policy.name()));
            };
            let tiers = TierChunks {
                l1,
                l2,
                disk,
                disk_segment: args.disk_segment,
                disk_policy: disk_policy(args)?,
                cascade: args.cascade(),
                l1_shards: args.l1_shards,
            };
            targets.push(Target::Spawn { tiers, policy: kind });
        }
    }
    Ok(targets)
}

/// A lower tier's capacity in chunks; 0 when it is not given.
fn tier_chunks(args: &ReplayArgs, given: &Option<String>) -> Result<u64, String> {
    match given {
        None => Ok(0),
        Some(text) => capacity(text, args.chunk_bytes.0)?
            .ok_or_else(|| "a lower tier cannot be unbounded".to_string()),
    }
}

/// The host and disk tiers a cascade simulation models; none under write-through, or when
/// neither --l2 nor --disk is given (then one cache of --capacity, as the daemon is).
fn lower_tiers(args: &ReplayArgs) -> Result<Option<LowerTiers>, String> {
    if !args.cascade() || (args.l2.is_none() && args.disk.is_none()) {
        return Ok(None);
    }
    let chunks = |n: u64| usize::try_from(n).map_err(|_| format!("{n} chunks do not fit here"));
    Ok(Some(LowerTiers {
        l2: chunks(tier_chunks(args, &args.l2)?)?,
        disk: chunks(tier_chunks(args, &args.disk)?)?,
        disk_segment: chunks(args.disk_segment)?,
        disk_policy: disk_policy(args)?,
    }))
}

/// How fast the daemon replay sends requests: `--speedup`, or as fast as possible.
fn pace(args: &ReplayArgs) -> Pace {
    args.speedup.map_or(Pace::AsFastAsPossible, Pace::Speedup)
}

/// `--disk-policy`, if given.
fn disk_policy(args: &ReplayArgs) -> Result<Option<PolicyKind>, String> {
    args.disk_policy
        .as_deref()
        .map(|name| match Policy::parse(name.trim()) {
            Some(Policy::Online(kind)) => Ok(kind),
            _ => Err(format!("unknown --disk-policy {name:?}: lru, s3fifo or adaptive")),
        })
        .transpose()
}

/// Replays every trace through every target, in order.
fn daemon_runs(
    args: &ReplayArgs,
    traces: &[Trace],
    targets: &[Target],
) -> Result<Vec<RunResult>, String> {
    let program =
        std::env::current_exe().map_err(|e| format!("cannot find the tierkv executable: {e}"))?;
    let pace = pace(args);
    // Ctrl-C and SIGTERM stop the replay (between requests, or within a wait's poll or
    // timeout), so the daemon it started, its workers and their directories are cleaned up
    // rather than left behind. A second signal exits at once with 1, as the daemon's own
    // second signal does, whatever the first is still waiting for: the conditional exit is
    // registered first, so it sees the flag the first signal set, not the one this signal sets.
    let interrupt = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&interrupt))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&interrupt)))
            .map_err(|e| format!("cannot handle signal {signal}: {e}"))?;
    }
    let mut results = Vec::new();
    for trace in traces {
        for target in targets {
            let plan = DaemonPlan {
                program: program.clone(),
                target: target.clone(),
                chunk_bytes: args.chunk_bytes.0,
                tp: args.tp,
                mla: args.mla,
                pace,
                progress: !args.quiet,
                model: args.model.clone(),
                interrupt: Some(Arc::clone(&interrupt)),
            };
            results.push(tierkv_replay::replay_daemon(trace, &plan).map_err(|e| e.to_string())?);
        }
    }
    Ok(results)
}
