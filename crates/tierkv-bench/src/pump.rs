//! Keeping a tier busy: the loop every tier bandwidth benchmark times.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tierkv_core::{Completion, TaskId, TierAdapter};

/// How a tier benchmark feeds its tier: chunks per task, tasks kept submitted at once.
#[derive(Clone, Copy, Debug)]
pub struct Pump {
    /// Chunks each `submit` call puts in one task.
    pub per_task: usize,
    /// Tasks submitted and not yet completed, at most.
    pub in_flight: usize,
}

impl Pump {
    /// Runs `total` chunks of `chunk` bytes through `submit` (called with the first chunk of each
    /// task) and returns bytes per second. Completions, and the buffers they hand back, are kept
    /// until the clock stops, so freeing them is not measured. A task that does not complete in
    /// a minute, a failed store or a chunk not moved is an error.
    pub fn run(
        self,
        tier: &dyn TierAdapter,
        total: usize,
        chunk: u64,
        mut submit: impl FnMut(usize) -> TaskId,
    ) -> Result<f64, String> {
        let completions = tier.completions();
        let mut finished = Vec::with_capacity(total);
        let mut waiting = VecDeque::new();
        let (mut next, mut moved) = (0, 0u64);
        let start = Instant::now();
        while next < total || !waiting.is_empty() {
            while next < total && waiting.len() < self.in_flight.max(1) {
                waiting.push_back(submit(next));
                next += self.per_task.max(1);
            }
            let done = completions
                .recv_timeout(Duration::from_secs(60))
                .map_err(|_| format!("{}: a task did not complete in a minute", tier.name()))?;
            waiting.retain(|t| *t != done.task());
            moved += match &done {
                Completion::Stored { result, sources, .. } => {
                    result.as_ref().map_err(|e| format!("{}: a store failed: {e}", tier.name()))?;
                    sources.len() as u64 * chunk
                }
                Completion::Loaded { loaded, .. } => loaded.count_ones() as u64 * chunk,
                Completion::LookedUp { .. } => 0,
            };
            finished.push(done);
        }
        let rate = moved as f64 / start.elapsed().as_secs_f64();
        if moved != total as u64 * chunk {
            return Err(format!(
                "{}: {moved} of {} bytes moved",
                tier.name(),
                total as u64 * chunk
            ));
        }
        Ok(rate)
    }
}
