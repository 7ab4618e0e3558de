//! Running replays: simulation sweeps over threads, daemon replays over worker processes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tierkv_client::Client;
use tierkv_core::policy::{PolicyKind, auto_shards};

use crate::ReplayError;
use crate::process::{SpawnedDaemon, TierChunks};
use crate::report::{Mode, Movement, Percentiles, RunResult, TierHits};
use crate::sim::{LowerTiers, Policy, SimCounts, simulate, simulate_cascade};
use crate::trace::{Trace, TraceRequest};
use crate::worker::{Done, Step, WorkerProcess, WorkerSpec};

/// How long a replay waits for each answer of its admin session (the hello and a status).
const ADMIN_WITHIN: Duration = Duration::from_secs(10);

/// The largest chunk a daemon replay moves: far above any KV chunk, and low enough that the
/// memcpy limit and the workers' buffers stay allocatable.
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// Replays every trace with every policy at every capacity, spread over the machine's cores.
/// Results come back in that order: trace, then capacity, then policy.
///
/// With `lower` tiers, each online policy runs the cascade of L1 (the capacity) and those tiers
/// ([`simulate_cascade`]), and the optimum one cache of their combined size. L1's policy runs
/// over `l1_shards` joined index shards, as a daemon's L1 with that `shards` setting (0: the
/// daemon's automatic count for the capacity).
pub fn sweep_simulation(
    traces: &[Trace],
    policies: &[Policy],
    capacities: &[Option<u64>],
    (lower, l1_shards): (Option<LowerTiers>, u32),
    progress: bool,
) -> Vec<RunResult> {
    let runs: Vec<(usize, Option<u64>, Policy)> = traces
        .iter()
        .enumerate()
        .flat_map(|(t, _)| {
            capacities.iter().flat_map(move |c| policies.iter().map(move |p| (t, *c, *p)))
        })
        .collect();
    let bar = progress_bar(runs.len() as u64, progress, "runs");
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, usize::from).min(runs.len());
    let mut results: Vec<Option<RunResult>> = vec![None; runs.len()];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(t, capacity, policy)) = runs.get(i) else { break };
                        let trace = &traces[t];
                        let chunks = |c: u64| usize::try_from(c).unwrap_or(usize::MAX);
                        let limit = capacity.map(chunks);
                        let shards = match (l1_shards, capacity) {
                            (0, Some(slots)) => auto_shards(slots),
                            (0, None) => 1,
                            (n, _) => n as usize,
                        };
                        let counts = match (policy, limit, lower) {
                            (Policy::Online(kind), Some(l1), Some(lower)) => {
                                simulate_cascade(trace, kind, (l1, shards), lower)
                            }
                            (
                                Policy::Belady
                                | Policy::PopularityOracle
                                | Policy::OracleAdmission(_),
                                Some(l1),
                                _,
                            ) => {
                                let below = lower.map_or(0, |lower| lower.chunks());
                                simulate(trace, policy, Some(l1.saturating_add(below)), 1)
                            }
                            _ => simulate(trace, policy, limit, shards),
                        };
                        done.push((
                            i,
                            RunResult::new(
                                &trace.name,
                                Mode::Simulation,
                                policy.name(),
                                capacity,
                                &counts,
                            ),
                        ));
                        bar.inc(1);
                    }
                    done
                })
            })
            .collect();
        for handle in handles {
            // A simulation thread only panics on a bug; let it surface as one.
            let done = handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (i, result) in done {
                results[i] = Some(result);
            }
        }
    });
    bar.finish_and_clear();
    results.into_iter().flatten().collect()
}

/// Which daemon a replay talks to.
#[derive(Clone, Debug)]
pub enum Target {
    /// One started for the replay (`program serve`) and stopped after it.
    Spawn {
        /// Chunks per tier.
        tiers: TierChunks,
        /// The eviction policy of every tier.
        policy: PolicyKind,
    },
    /// One already running, at this Unix socket; the replay uses a fresh namespace in it.
    Socket(PathBuf),
}

/// How fast requests are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pace {
    /// Each request as soon as the previous one is done.
    AsFastAsPossible,
    /// At the trace's timestamps divided by this factor (a request never starts before the
    /// previous one is done).
    Speedup(f64),
}

impl Pace {
    /// When `request` is due, counted from the trace's first request at `first` ms.
    pub fn due(self, first: f64, request: &TraceRequest) -> Result<Duration, ReplayError> {
        match self {
            Pace::AsFastAsPossible => Ok(Duration::ZERO),
            Pace::Speedup(factor) => Duration::try_from_secs_f64(
                ((request.timestamp_ms - first) / factor / 1e3).max(0.0),
            )
            .map_err(|_| {
                ReplayError::Invalid(format!(
                    "a speed-up of {factor} puts request times beyond any clock"
                ))
            }),
        }
    }

    /// Whether every request of `trace` has a time at this pace: its last (latest) one does.
    pub fn check(self, trace: &Trace) -> Result<(), ReplayError> {
        let first = trace.requests.first().map_or(0.0, |r| r.timestamp_ms);
        match trace.requests.last() {
            Some(last) => self.due(first, last).map(|_| ()),
            None => Ok(()),
        }
    }
}

/// A daemon replay.
#[derive(Clone, Debug)]
pub struct DaemonPlan {
    /// The `tierkv` executable: it serves the daemon and runs the workers (`replay-worker`).
    pub program: PathBuf,
    /// The daemon.
    pub target: Target,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// Ranks, one worker process each.
    pub tp: u16,
    /// Whether the ranks share one copy of each chunk (rank 0 looks up and stores, every rank
    /// retrieves).
    pub mla: bool,
    /// How fast.
    pub pace: Pace,
    /// Whether to draw a progress bar (on a terminal).
    pub progress: bool,
    /// The model name of the replay's namespace; `None`: a fresh one per replay. Replays
    /// through several daemons that share a remote tier name one, as the nodes of one model do.
    pub model: Option<String>,
    /// Set (by a signal handler) to stop the replay: between requests, or within a tenth of a
    /// second while it waits for a worker or for its daemon to start, or at the end of its
    /// admin session's timeout. Its processes and directories are then cleaned up as after a
    /// normal end.
    pub interrupt: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Replays `trace` through a daemon and returns what it counted, moved and measured.
pub fn replay_daemon(trace: &Trace, plan: &DaemonPlan) -> Result<RunResult, ReplayError> {
    if plan.tp == 0 || plan.chunk_bytes == 0 || plan.chunk_bytes > MAX_CHUNK_BYTES {
        return Err(ReplayError::Invalid(format!(
            "tp must be positive and the chunk size within 1..={MAX_CHUNK_BYTES} bytes"
        )));
    }
    let first = trace.requests.first().map_or(0.0, |r| r.timestamp_ms);
    // When each request is due; checked for the last (latest) one before anything starts.
    let due = |request: &TraceRequest| plan.pace.due(first, request);
    plan.pace.check(trace)?;
    let memcpy = tierkv_bench::memcpy_bandwidth(
        usize::try_from(plan.chunk_bytes).unwrap_or(usize::MAX),
        Duration::from_millis(300),
    );
    let interrupted = || plan.interrupt.as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed));
    // A failure while interrupted is the interrupt's doing (Ctrl-C reaches the workers too, a
    // wait gives up on it), not a fault.
    let or_interrupted = |e: ReplayError| if interrupted() { ReplayError::Interrupted } else { e };
    let (spawned, socket, policy) = match &plan.target {
        Target::Spawn { tiers, policy } => {
            let daemon = SpawnedDaemon::start(
                &plan.program,
                plan.chunk_bytes,
                *tiers,
                *policy,
                plan.interrupt.as_deref(),
            )?;
            let socket = daemon.socket().to_path_buf();
            (Some(daemon), socket, policy.as_str().to_string())
        }
        Target::Socket(path) => (None, path.clone(), "daemon's".into()),
    };
    let mut admin = Client::connect_unix_within(&socket, Client::admin_hello(), ADMIN_WITHIN)
        .map_err(|e| {
            or_interrupted(ReplayError::Daemon(format!("cannot reach {}: {e}", socket.display())))
        })?;
    let status =
        admin.status().map_err(|e| or_interrupted(ReplayError::Daemon(format!("status: {e}"))))?;
    // L1's capacity in chunks: as asked of a daemon the replay started; of one already running,
    // its bytes over its slot's (each chunk takes a slot), which the daemon's welcome names as
    // the largest chunk it stores.
    let capacity = match &plan.target {
        Target::Spawn { tiers, .. } => Some(tiers.l1),
        Target::Socket(_) => {
            let slot = admin.session().max_chunk_bytes.max(1);
            status.tiers.iter().find(|t| t.name == "l1").map(|l1| l1.capacity_bytes / slot)
        }
    };
    let tier_names: Vec<String> = status.tiers.into_iter().map(|t| t.name).collect();
    let _ = admin.end();

    let max_chunks = trace.requests.iter().map(|r| r.chunks.len() as u64).max().unwrap_or(1);
    let model = plan.model.clone().unwrap_or_else(|| {
        format!(
            "replay/{}/{}/{}",
            trace.name,
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        )
    });
    let mut workers = (0..plan.tp)
        .map(|rank| {
            let spec = WorkerSpec {
                socket: socket.clone(),
                model: model.clone(),
                rank,
                tp: plan.tp,
                mla: plan.mla,
                chunk_bytes: plan.chunk_bytes,
                chunk_tokens: trace.chunk_tokens,
                max_chunks,
            };
            WorkerProcess::start(&plan.program, &spec, plan.interrupt.clone())
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(or_interrupted)?;

    let bar = progress_bar(trace.requests.len() as u64, plan.progress, "requests");
    let mut tally = Tally::default();
    let started = Instant::now();
    for request in &trace.requests {
        // In short naps, so an interrupt is noticed while waiting for a late request.
        let due = due(request)?;
        while let Some(wait) = due.checked_sub(started.elapsed()) {
            if interrupted() {
                break;
            }
            std::thread::sleep(wait.min(Duration::from_millis(100)));
        }
        if interrupted() {
            return Err(ReplayError::Interrupted);
        }
        replay_request(&mut workers, request, trace.chunk_tokens, plan.mla, &mut tally)
            .map_err(or_interrupted)?;
        bar.inc(1);
        if bar.position().is_multiple_of(64) {
            bar.set_message(format!("hit {:.3}", tally.counts.hit_ratio()));
        }
    }
    // Stores go without waiting; the last ones are counted (and timed) when the workers drain.
    workers.iter_mut().try_for_each(|w| w.send(&Step::Drain)).map_err(or_interrupted)?;
    for worker in workers.iter_mut() {
        tally.stored(&worker.receive().map_err(or_interrupted)?);
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    for worker in workers {
        worker.close().map_err(or_interrupted)?;
    }
    if let Some(daemon) = spawned {
        daemon.stop();
    }

    let mut result = RunResult::new(&trace.name, Mode::Daemon, &policy, capacity, &tally.counts);
    // `per_tier` has one count per tier of the protocol, in its order; the report names the
    // tiers this daemon has.
    const PROTOCOL_TIERS: [&str; 4] = ["l1", "l2", "disk", "remote"];
    result.tiers = tally
        .per_tier
        .iter()
        .enumerate()
        .filter_map(|(i, hits)| {
            let name = PROTOCOL_TIERS.get(i).map_or_else(|| format!("tier{i}"), |n| n.to_string());
            (tier_names.contains(&name) || *hits > 0).then_some((name, hits))
        })
        .map(|(tier, hits)| TierHits {
            tier,
            hit_chunks: *hits,
            hit_tokens: hits.saturating_mul(trace.chunk_tokens),
            hit_ratio: if tally.counts.chunks == 0 {
                0.0
            } else {
                *hits as f64 / tally.counts.chunks as f64
            },
        })
        .collect();
    let moved_chunks = tally.chunks_retrieved + tally.chunks_stored;
    let bytes_moved = moved_chunks * plan.chunk_bytes;
    let gb_per_second = bytes_moved as f64 / seconds / 1e9;
    let speed =
        |chunks: u64, us: u64| (chunks * plan.chunk_bytes) as f64 / (us.max(1) as f64 * 1e3);
    let copy_gb_per_second = speed(moved_chunks, tally.retrieve_call_us + tally.store_call_us);
    result.movement = Some(Movement {
        chunk_bytes: plan.chunk_bytes,
        tp: plan.tp,
        mla: plan.mla,
        seconds,
        chunks_retrieved: tally.chunks_retrieved,
        chunks_stored: tally.chunks_stored,
        chunks_refused: tally.chunks_refused,
        bytes_moved,
        chunks_per_second: moved_chunks as f64 / seconds,
        gb_per_second,
        copy_gb_per_second,
        retrieve_gb_per_second: speed(tally.chunks_retrieved, tally.retrieve_call_us),
        store_gb_per_second: speed(tally.chunks_stored, tally.store_call_us),
        lookup: Percentiles::of(&mut tally.lookup_us),
        retrieve: Percentiles::of(&mut tally.retrieve_us),
        memcpy_gb_per_second: memcpy / 1e9,
        ratio_to_memcpy: copy_gb_per_second / (memcpy / 1e9),
    });
    Ok(result)
}

/// One request through the workers: per-rank cycles, or the MLA group's lookup, retrieves and
/// store.
fn replay_request(
    workers: &mut [WorkerProcess],
    request: &TraceRequest,
    chunk_tokens: u64,
    mla: bool,
    tally: &mut Tally,
) -> Result<(), ReplayError> {
    let chunks = &request.chunks;
    let no_workers = || ReplayError::Invalid("a replay needs at least one worker".into());
    if mla {
        let owner = workers.first_mut().ok_or_else(no_workers)?;
        owner.send(&Step::Lookup { chunks: chunks.clone() })?;
        let looked = owner.receive()?;
        // Every answer may carry the stores its step collected (the previous `Finish`'s).
        tally.stored(&looked);
        tally.lookup(&looked, chunks.len())?;
        tally.count(&looked, request.tokens, chunks.len(), chunk_tokens);
        let hit = looked.hit as usize;
        if hit > 0 {
            let step = Step::Retrieve { lookup: looked.lookup, chunks: chunks[..hit].to_vec() };
            workers.iter_mut().try_for_each(|w| w.send(&step))?;
            for worker in workers.iter_mut() {
                let got = worker.receive()?;
                tally.stored(&got);
                tally.retrieved(&got, hit)?;
            }
        }
        let owner = workers.first_mut().ok_or_else(no_workers)?;
        owner.send(&Step::Finish {
            lookup: looked.lookup,
            chunks: chunks.clone(),
            hit: looked.hit,
        })?;
        tally.stored(&owner.receive()?);
    } else {
        let step = Step::Request { chunks: chunks.clone() };
        workers.iter_mut().try_for_each(|w| w.send(&step))?;
        // The request counts once, as in a run of one rank. Its hit is the group's: the fewest
        // chunks any rank hit, since the group recomputes what one rank lacks; its tiers are
        // that rank's. Every rank's retrieve, store and latency count.
        let mut group: Option<Done> = None;
        for worker in workers.iter_mut() {
            let done = worker.receive()?;
            tally.lookup(&done, chunks.len())?;
            tally.retrieved(&done, done.hit as usize)?;
            tally.stored(&done);
            if group.as_ref().is_none_or(|g| done.hit < g.hit) {
                group = Some(done);
            }
        }
        let group = group.ok_or_else(no_workers)?;
        tally.count(&group, request.tokens, chunks.len(), chunk_tokens);
    }
    Ok(())
}

/// What the workers answered, added up.
#[derive(Default)]
struct Tally {
    counts: SimCounts,
    per_tier: Vec<u64>,
    chunks_retrieved: u64,
    chunks_stored: u64,
    chunks_refused: u64,
    lookup_us: Vec<u64>,
    retrieve_us: Vec<u64>,
    /// Time blocked on retrieves, summed over workers.
    retrieve_call_us: u64,
    /// Time blocked on stores, summed over workers.
    store_call_us: u64,
}

impl Tally {
    /// A lookup's answer, from any rank: its tiers must account for its whole hit. Its latency
    /// is kept.
    fn lookup(&mut self, done: &Done, chunks: usize) -> Result<(), ReplayError> {
        let per_tier: u32 = done.per_tier.iter().sum();
        if per_tier != done.hit || done.hit as usize > chunks {
            return Err(ReplayError::Inconsistent(format!(
                "lookup {} hit {} of {chunks} chunks, its tiers served {per_tier}",
                done.lookup, done.hit
            )));
        }
        self.lookup_us.push(done.lookup_us);
        Ok(())
    }

    /// Counts a request, once whatever the ranks: `done` is the lookup that stands for the
    /// group's hit, and its tiers are counted.
    fn count(&mut self, done: &Done, tokens: u64, chunks: usize, chunk_tokens: u64) {
        self.counts.add_request(chunks, tokens, done.hit as usize, chunk_tokens);
        if self.per_tier.len() < done.per_tier.len() {
            self.per_tier.resize(done.per_tier.len(), 0);
        }
        for (total, n) in self.per_tier.iter_mut().zip(&done.per_tier) {
            *total += u64::from(*n);
        }
    }

    /// A retrieve's answer: every chunk of the hit, checked.
    fn retrieved(&mut self, done: &Done, hit: usize) -> Result<(), ReplayError> {
        if done.retrieved != hit as u64 {
            return Err(ReplayError::Inconsistent(format!(
                "retrieved {} chunks of a {hit}-chunk hit",
                done.retrieved
            )));
        }
        if hit > 0 {
            self.chunks_retrieved += done.retrieved;
            self.retrieve_us.push(done.retrieve_us);
            self.retrieve_call_us += done.retrieve_us;
        }
        Ok(())
    }

    fn stored(&mut self, done: &Done) {
        self.chunks_stored += done.stored;
        self.chunks_refused += done.refused;
        self.store_call_us += done.store_us;
    }
}

fn progress_bar(len: u64, visible: bool, unit: &str) -> ProgressBar {
    let target =
        if visible { ProgressDrawTarget::stderr_with_hz(4) } else { ProgressDrawTarget::hidden() };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    let template =
        format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit} {{per_sec}} {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
