//! What a replay reports: one [`RunResult`] per (trace, policy, capacity), printed as a table,
//! written as JSON, and plotted as hit ratio against capacity when a sweep has several.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::ReplayError;
use crate::sim::SimCounts;

/// How a run was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The policies alone over the chunk stream.
    Simulation,
    /// Through a daemon, with worker processes moving and checking bytes.
    Daemon,
}

/// The 50th and 99th percentile of a latency, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// The median.
    pub p50_us: u64,
    /// The 99th percentile.
    pub p99_us: u64,
}

impl Percentiles {
    /// The percentiles of `samples` (sorted in place).
    pub fn of(samples: &mut [u64]) -> Percentiles {
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).saturating_sub(1);
            samples.get(i).copied().unwrap_or(0)
        };
        Percentiles { count: samples.len() as u64, p50_us: at(0.50), p99_us: at(0.99) }
    }
}

/// Hits one tier served.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierHits {
    /// "l1", "l2", "disk".
    pub tier: String,
    /// Chunks of prefix hits it served.
    pub hit_chunks: u64,
    /// Those over all requested chunks.
    pub hit_ratio: f64,
    /// Tokens of those chunks, each counted full: the daemon does not say which tier served a
    /// request's partial last chunk, so the tiers' tokens may exceed the run's `hit_tokens` by
    /// less than one chunk per fully hit request.
    pub hit_tokens: u64,
}

/// The figures of a daemon replay that a simulation has no counterpart for.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Movement {
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// Ranks (worker processes).
    pub tp: u16,
    /// Whether the ranks shared one copy.
    pub mla: bool,
    /// Wall-clock seconds of the replay.
    pub seconds: f64,
    /// Chunks copied out of the daemon, every byte checked.
    pub chunks_retrieved: u64,
    /// Chunks copied into the daemon.
    pub chunks_stored: u64,
    /// Chunks the daemon refused to store for want of room.
    pub chunks_refused: u64,
    /// Bytes moved either way.
    pub bytes_moved: u64,
    /// Chunks moved per second.
    pub chunks_per_second: f64,
    /// Bytes moved per second of wall-clock time, in GB/s (10^9): the whole replay, including
    /// the workers writing each stored chunk's bytes and checking each retrieved one.
    pub gb_per_second: f64,
    /// Bytes moved per second a worker spent blocked on stores and retrieves, in GB/s: what the
    /// daemon's data plane (request, copy, reply) costs one worker. Stores go without waiting and
    /// a retrieve overlaps the worker's fill of its store, so this counts the sends and the waits
    /// for replies, not the time from request to reply.
    pub copy_gb_per_second: f64,
    /// The same for retrieve calls alone.
    pub retrieve_gb_per_second: f64,
    /// The same for store calls alone.
    pub store_gb_per_second: f64,
    /// Lookup (with its wait) latency as a worker saw it.
    pub lookup: Percentiles,
    /// Time a worker was blocked on each retrieve (sending it, and waiting for its reply once
    /// its store was sent).
    pub retrieve: Percentiles,
    /// Single-core memcpy bandwidth at this chunk size, measured before the replay, in GB/s.
    pub memcpy_gb_per_second: f64,
    /// `copy_gb_per_second` over `memcpy_gb_per_second`.
    pub ratio_to_memcpy: f64,
}

/// One replay of one trace with one policy and capacity.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunResult {
    /// The trace's name.
    pub trace: String,
    /// Simulation or daemon.
    pub mode: Mode,
    /// The eviction policy.
    pub policy: String,
    /// The cache's capacity in chunks (`None`: unbounded). With tiers below it, and for a
    /// daemon, L1's: a daemon's L1 in its slots, one chunk each (an unbounded capacity is a
    /// simulation's only).
    pub capacity_chunks: Option<u64>,
    /// Requests replayed.
    pub requests: u64,
    /// Chunks requested.
    pub chunks: u64,
    /// Chunks of prefix hits.
    pub hit_chunks: u64,
    /// `hit_chunks / chunks`.
    pub hit_ratio: f64,
    /// Prompt tokens requested.
    pub tokens: u64,
    /// Tokens of prefix hits.
    pub hit_tokens: u64,
    /// `hit_tokens / tokens`.
    pub token_hit_ratio: f64,
    /// Hits per tier (daemon replays).
    pub tiers: Vec<TierHits>,
    /// Bytes, speed and latency (daemon replays).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub movement: Option<Movement>,
}

impl RunResult {
    /// A result from counts.
    pub fn new(
        trace: &str,
        mode: Mode,
        policy: &str,
        capacity_chunks: Option<u64>,
        counts: &SimCounts,
    ) -> RunResult {
        RunResult {
            trace: trace.to_string(),
            mode,
            policy: policy.to_string(),
            capacity_chunks,
            requests: counts.requests,
            chunks: counts.chunks,
            hit_chunks: counts.hit_chunks,
            hit_ratio: counts.hit_ratio(),
            tokens: counts.tokens,
            hit_tokens: counts.hit_tokens,
            token_hit_ratio: counts.token_hit_ratio(),
            tiers: Vec::new(),
            movement: None,
        }
    }
}

fn capacity_label(capacity: Option<u64>) -> String {
    capacity.map_or_else(|| "unbounded".into(), |c| c.to_string())
}

/// The summary table of a simulation sweep: one row per trace and capacity, one column per
/// policy, then each online policy's distance below the optimum when it was run.
pub fn simulation_table(results: &[RunResult]) -> String {
    let policies = distinct(results.iter().map(|r| r.policy.clone()));
    let mut out = format!("{:<24} {:>10} {:>9}", "trace", "capacity", "requests");
    for p in &policies {
        let _ = write!(out, " {p:>9}");
    }
    let optimum = policies.iter().any(|p| p == "belady");
    if optimum {
        for p in policies.iter().filter(|p| *p != "belady") {
            let _ = write!(out, " {:>12}", format!("{p}/opt"));
        }
    }
    out.push('\n');
    for trace in distinct(results.iter().map(|r| r.trace.clone())) {
        for capacity in
            distinct(results.iter().filter(|r| r.trace == trace).map(|r| r.capacity_chunks))
        {
            let row: Vec<&RunResult> = results
                .iter()
                .filter(|r| r.trace == trace && r.capacity_chunks == capacity)
                .collect();
            let requests = row.first().map_or(0, |r| r.requests);
            let _ = write!(out, "{trace:<24} {:>10} {requests:>9}", capacity_label(capacity));
            let ratio = |p: &str| row.iter().find(|r| r.policy == p).map(|r| r.hit_ratio);
            for p in &policies {
                let _ = write!(out, " {:>9}", ratio(p).map_or("-".into(), |v| format!("{v:.4}")));
            }
            if let Some(opt) = ratio("belady").filter(|_| optimum) {
                for p in policies.iter().filter(|p| *p != "belady") {
                    let share = ratio(p).filter(|_| opt > 0.0).map(|v| v / opt);
                    let _ = write!(out, " {:>12}", share.map_or("-".into(), |s| format!("{s:.3}")));
                }
            }
            out.push('\n');
        }
    }
    out
}

/// The summary table of daemon replays: one block per run.
pub fn daemon_table(results: &[RunResult]) -> String {
    let mut out = String::new();
    for r in results {
        let _ = writeln!(
            out,
            "{} | policy {} | capacity {} chunks",
            r.trace,
            r.policy,
            capacity_label(r.capacity_chunks)
        );
        let _ = writeln!(
            out,
            "  requests {:>9}   chunks {:>10}   hit chunks {:>10}   hit ratio {:.4}   token hit ratio {:.4}",
            r.requests, r.chunks, r.hit_chunks, r.hit_ratio, r.token_hit_ratio
        );
        let tiers: Vec<String> = r
            .tiers
            .iter()
            .map(|t| {
                format!(
                    "{} {:.4} ({} chunks, {} tokens)",
                    t.tier, t.hit_ratio, t.hit_chunks, t.hit_tokens
                )
            })
            .collect();
        let _ = writeln!(out, "  hit ratio per tier: {}", tiers.join(", "));
        if let Some(m) = &r.movement {
            let _ = writeln!(
                out,
                "  moved {:.2} GB in {:.2} s: {:.0} chunks/s, {:.2} GB/s end to end; blocked on store and retrieve {:.2} GB/s = {:.2}x memcpy ({:.2} GB/s, {} B chunks)",
                m.bytes_moved as f64 / 1e9,
                m.seconds,
                m.chunks_per_second,
                m.gb_per_second,
                m.copy_gb_per_second,
                m.ratio_to_memcpy,
                m.memcpy_gb_per_second,
                m.chunk_bytes
            );
            let _ = writeln!(
                out,
                "  retrieved {} chunks (every byte checked) at {:.2} GB/s, stored {} at {:.2} GB/s, refused {}",
                m.chunks_retrieved,
                m.retrieve_gb_per_second,
                m.chunks_stored,
                m.store_gb_per_second,
                m.chunks_refused
            );
            let _ = writeln!(
                out,
                "  lookup p50 {} us p99 {} us   retrieve p50 {} us p99 {} us   ({} ranks{})",
                m.lookup.p50_us,
                m.lookup.p99_us,
                m.retrieve.p50_us,
                m.retrieve.p99_us,
                m.tp,
                if m.mla { ", MLA" } else { "" }
            );
        }
    }
    out
}

/// Writes the results as JSON, with what produced them.
pub fn write_json(
    path: &Path,
    command: &[String],
    results: &[RunResult],
) -> Result<(), ReplayError> {
    #[derive(Serialize)]
    struct File<'a> {
        tool: &'static str,
        version: &'static str,
        command: &'a [String],
        runs: &'a [RunResult],
    }
    let file =
        File { tool: "tierkv replay", version: env!("CARGO_PKG_VERSION"), command, runs: results };
    let text =
        serde_json::to_string_pretty(&file).map_err(|e| ReplayError::Invalid(e.to_string()))?;
    std::fs::write(path, text + "\n")
        .map_err(|e| ReplayError::io(format!("write {}", path.display()), e))
}

/// Plots hit ratio against capacity, one line per policy and one panel per trace, into an SVG.
/// Unbounded capacities are drawn as a dashed ceiling. Returns false (and writes nothing) when no
/// trace has two bounded capacities.
pub fn write_plot(path: &Path, results: &[RunResult]) -> Result<bool, ReplayError> {
    let traces = distinct(results.iter().map(|r| r.trace.clone()));
    let swept = traces.iter().any(|t| {
        distinct(results.iter().filter(|r| &r.trace == t).filter_map(|r| r.capacity_chunks)).len()
            >= 2
    });
    if !swept {
        return Ok(false);
    }
    let plot_error = |e: &dyn std::fmt::Display| ReplayError::Plot(e.to_string());
    let height = 420 * traces.len() as u32;
    let root = SVGBackend::new(path, (760, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    let panels = root.split_evenly((traces.len(), 1));
    let policies = distinct(results.iter().map(|r| r.policy.clone()));
    for (panel, trace) in panels.iter().zip(&traces) {
        let runs: Vec<&RunResult> = results.iter().filter(|r| &r.trace == trace).collect();
        let bounded: Vec<u64> = distinct(runs.iter().filter_map(|r| r.capacity_chunks));
        let (Some(&low), Some(&high)) = (bounded.iter().min(), bounded.iter().max()) else {
            continue;
        };
        let top = runs.iter().map(|r| r.hit_ratio).fold(0.0f64, f64::max).max(0.05) * 1.1;
        let x = (low.max(1) as f64 * 0.8)..(high as f64 * 1.25);
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{trace}: prefix hit ratio"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(x.clone().log_scale(), 0.0..top.min(1.0))
            .map_err(|e| plot_error(&e))?;
        chart
            .configure_mesh()
            .x_desc("capacity (chunks, log scale)")
            .y_desc("hit ratio")
            .x_labels(30)
            .x_label_formatter(&|v| round_label(*v))
            .light_line_style(TRANSPARENT)
            .draw()
            .map_err(|e| plot_error(&e))?;
        for (i, policy) in policies.iter().enumerate() {
            let color = LINE_COLORS[i % LINE_COLORS.len()];
            let mut points: Vec<(f64, f64)> = runs
                .iter()
                .filter(|r| &r.policy == policy)
                .filter_map(|r| r.capacity_chunks.map(|c| (c as f64, r.hit_ratio)))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| plot_error(&e))?
                .label(policy.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(|e| plot_error(&e))?;
            if let Some(ceiling) =
                runs.iter().find(|r| &r.policy == policy && r.capacity_chunks.is_none())
            {
                let dashes = DashedLineSeries::new(
                    [(x.start, ceiling.hit_ratio), (x.end, ceiling.hit_ratio)],
                    6,
                    4,
                    color.stroke_width(1),
                );
                chart.draw_series(dashes).map_err(|e| plot_error(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_error(&e))?;
    }
    root.present().map_err(|e| plot_error(&e))?;
    Ok(true)
}

/// One colour per policy line, told apart in print and by most colour-blind readers.
const LINE_COLORS: [RGBColor; 5] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0x2c, 0x2c),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

/// A log axis label at 1, 2 and 5 times a power of ten (`2k`, `50k`), and none elsewhere, so
/// the labels never crowd.
fn round_label(v: f64) -> String {
    let power = 10f64.powf(v.log10().floor());
    let mantissa = (v / power).round();
    if ![1.0, 2.0, 5.0].contains(&mantissa) || (v / power - mantissa).abs() > 0.01 {
        return String::new();
    }
    if v >= 1000.0 { format!("{:.0}k", v / 1000.0) } else { format!("{v:.0}") }
}

/// The distinct values of `items`, in first-seen order.
fn distinct<T: PartialEq>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}
