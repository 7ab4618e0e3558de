//! Routes each tier's completions to the component that submitted the task.
//!
//! A tier adapter has one completion channel with one consumer, yet two pipelines submit to it:
//! the store pipeline and the prefetch pipeline. One router thread per tier takes every
//! completion and sends it, tagged with the tier's index, to the channel its submitter named.
//! Registration happens under the route table's lock, together with the submit itself, so a
//! completion can never arrive before its route exists.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use tierkv_core::{Completion, TaskId, TierAdapter};

/// A completion and the tier (by its index, fastest first) it came from.
pub struct TierEvent {
    /// Index of the tier in the router.
    pub tier: usize,
    /// The completion.
    pub completion: Completion,
}

type Routes = Arc<Mutex<HashMap<TaskId, Sender<TierEvent>>>>;

struct Routed {
    adapter: Arc<dyn TierAdapter>,
    routes: Routes,
}

/// The lower tiers, fastest first, with their completions routed to whoever submitted.
pub struct TierRouter {
    tiers: Vec<Routed>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl TierRouter {
    /// Starts one routing thread per tier. `tiers` are ordered fastest first.
    pub fn start(tiers: Vec<Arc<dyn TierAdapter>>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut routed = Vec::with_capacity(tiers.len());
        let mut threads = Vec::with_capacity(tiers.len());
        for (index, adapter) in tiers.into_iter().enumerate() {
            let routes: Routes = Arc::default();
            let completions = adapter.completions();
            let (table, halt) = (Arc::clone(&routes), Arc::clone(&stop));
            let thread = std::thread::Builder::new().name(format!("tierkv-route-{}", adapter.name())).spawn(move || {
                while !halt.load(Ordering::Acquire) {
                    let Ok(completion) = completions.recv_timeout(Duration::from_millis(20)) else { continue };
                    match table.lock().remove(&completion.task()) {
                        Some(reply) => {
                            let _ = reply.send(TierEvent { tier: index, completion });
                        }
                        // Submitted around the router: nobody is waiting for it.
                        None => tracing::warn!(tier = index, task = ?completion.task(), "unrouted completion dropped"),
                    }
                }
            });
            match thread {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    stop.store(true, Ordering::Release);
                    threads.into_iter().for_each(|t: JoinHandle<()>| drop(t.join()));
                    return Err(e);
                }
            }
            routed.push(Routed { adapter, routes });
        }
        Ok(TierRouter { tiers: routed, stop, threads: Mutex::new(threads) })
    }

    /// The number of tiers.
    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    /// Whether there is no tier.
    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// Tier `index`, for the calls that complete at once (unlock, delete, usage).
    pub fn tier(&self, index: usize) -> Option<&Arc<dyn TierAdapter>> {
        self.tiers.get(index).map(|t| &t.adapter)
    }

    /// Every tier, fastest first.
    pub fn tiers(&self) -> impl Iterator<Item = &Arc<dyn TierAdapter>> {
        self.tiers.iter().map(|t| &t.adapter)
    }

    /// Submits to tier `index` with `submit`; its completion will arrive on `reply`. `None` for a
    /// tier that does not exist.
    pub fn submit(
        &self,
        index: usize,
        reply: &Sender<TierEvent>,
        submit: impl FnOnce(&dyn TierAdapter) -> TaskId,
    ) -> Option<TaskId> {
        let tier = self.tiers.get(index)?;
        let mut routes = tier.routes.lock();
        let task = submit(tier.adapter.as_ref());
        routes.insert(task, reply.clone());
        Some(task)
    }

    /// Stops routing. Tasks still in flight complete unrouted.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        for thread in std::mem::take(&mut *self.threads.lock()) {
            let _ = thread.join();
        }
    }
}

impl Drop for TierRouter {
    fn drop(&mut self) {
        self.stop();
    }
}
