//! The simulation: a trace's chunk stream through one eviction policy of a given capacity, with
//! no daemon, no bytes and no time. It follows the daemon's L1 step by step, so a daemon replay
//! with all its capacity in L1 (one index shard, no background eviction) counts the same hits.
//!
//! Per request, as the daemon does it:
//! 1. **Lookup.** Every chunk of the request that is cached is touched, leaf first (the daemon
//!    leases all L1 hits at once, last chunk first, so the roots end up most recent). The hit is
//!    the leading run of cached chunks: a later chunk whose prefix is missing cannot be used.
//! 2. **Store.** The chunks after the hit are stored, root first as workers send them. Each one
//!    that is not cached takes a free slot or evicts one victim; a cached one is left as it is
//!    (the daemon answers `present`); when nothing is left to evict, the rest of the batch is
//!    refused, so what is stored is a prefix. Once all are reserved the stored chunks become
//!    visible and enter the policy leaf first (the daemon's `finish_write` order), so a policy
//!    that evicts in insertion order loses a chain's tail before its root.
//!
//! The offline optimum ([`Policy::Belady`]) sees the whole stream: on a miss it keeps the
//! chunks needed soonest and may decline to cache a chunk needed later than all it holds. A
//! prefix's chunks are always needed before its extensions, so what it keeps stays usable.

use std::collections::{BTreeSet, HashMap};

use tierkv_core::policy::{EvictionPolicy, PolicyKind};

use crate::trace::Trace;

/// A policy the simulation can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// One of the daemon's online policies.
    Online(PolicyKind),
    /// The offline optimum: evict the chunk used furthest in the future.
    Belady,
}

impl Policy {
    /// The name on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Online(kind) => kind.as_str(),
            Policy::Belady => "belady",
        }
    }

    /// Parses a name from [`Policy::name`].
    pub fn parse(name: &str) -> Option<Policy> {
        match name {
            "belady" | "optimal" | "opt" => Some(Policy::Belady),
            other => PolicyKind::ALL.into_iter().find(|k| k.as_str() == other).map(Policy::Online),
        }
    }
}

/// What a simulation counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounts {
    /// Requests replayed.
    pub requests: u64,
    /// Chunks the requests named.
    pub chunks: u64,
    /// Chunks of prefix hits.
    pub hit_chunks: u64,
    /// Prompt tokens the requests named.
    pub tokens: u64,
    /// Tokens of prefix hits (a partial last chunk counts its tokens).
    pub hit_tokens: u64,
    /// Chunks written into the cache.
    pub inserted: u64,
}

impl SimCounts {
    /// Hit chunks over requested chunks.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hit_chunks, self.chunks)
    }

    /// Hit tokens over requested tokens.
    pub fn token_hit_ratio(&self) -> f64 {
        ratio(self.hit_tokens, self.tokens)
    }

    /// Counts one request: `hit` of its chunks, and what they come to in tokens.
    pub fn add_request(&mut self, chunks: usize, tokens: u64, hit: usize, chunk_tokens: u64) {
        self.requests += 1;
        self.chunks += chunks as u64;
        self.tokens += tokens;
        self.hit_chunks += hit as u64;
        self.hit_tokens += hit_tokens(hit, chunks, tokens, chunk_tokens);
    }
}

/// Tokens covered by the first `hit` of `chunks` chunks of a `tokens`-token prompt.
pub fn hit_tokens(hit: usize, chunks: usize, tokens: u64, chunk_tokens: u64) -> u64 {
    if hit == chunks { tokens } else { (hit as u64).saturating_mul(chunk_tokens) }
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { part as f64 / whole as f64 }
}

/// Replays `trace` through `policy` with room for `capacity` chunks (`None`: unbounded).
pub fn simulate(trace: &Trace, policy: Policy, capacity: Option<usize>) -> SimCounts {
    let capacity = capacity.unwrap_or(usize::MAX);
    match policy {
        Policy::Online(kind) => simulate_online(trace, kind.build(), capacity),
        Policy::Belady => simulate_belady(trace, capacity),
    }
}

fn simulate_online(
    trace: &Trace,
    mut policy: Box<dyn EvictionPolicy<u64>>,
    capacity: usize,
) -> SimCounts {
    let mut counts = SimCounts::default();
    let mut reserved = Vec::new();
    for request in &trace.requests {
        let chunks = &request.chunks;
        for chunk in chunks.iter().rev() {
            policy.touch(chunk);
        }
        let hit = chunks.iter().take_while(|c| policy.contains(c)).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        reserved.clear();
        for chunk in &chunks[hit..] {
            if policy.contains(chunk) || capacity == 0 {
                continue;
            }
            if policy.len() + reserved.len() >= capacity
                && policy.evict(1, &mut |_| true).is_empty()
            {
                // Every slot is reserved by this very request: the rest is refused.
                break;
            }
            reserved.push(*chunk);
        }
        counts.inserted += reserved.len() as u64;
        for chunk in reserved.iter().rev() {
            policy.insert(*chunk);
        }
    }
    counts
}

/// Belady's MIN with bypass over the same lookups and stores.
fn simulate_belady(trace: &Trace, capacity: usize) -> SimCounts {
    // Time is the position in the flattened chunk stream; `next[t]` is the next time the chunk at
    // `t` is named again (`u64::MAX`: never).
    let total: usize = trace.requests.iter().map(|r| r.chunks.len()).sum();
    let mut next = vec![u64::MAX; total];
    let mut seen: HashMap<u64, u64> = HashMap::with_capacity(total / 2);
    let mut t = total;
    for request in trace.requests.iter().rev() {
        for chunk in request.chunks.iter().rev() {
            t -= 1;
            if let Some(later) = seen.insert(*chunk, t as u64) {
                next[t] = later;
            }
        }
    }
    // The cache: each chunk with its next use, and the same pairs ordered by next use.
    let mut cached: HashMap<u64, u64> = HashMap::new();
    let mut by_next: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut counts = SimCounts::default();
    let mut t = 0usize;
    for request in &trace.requests {
        let chunks = &request.chunks;
        let hit = chunks.iter().take_while(|c| cached.contains_key(c)).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        for (i, chunk) in chunks.iter().enumerate() {
            let next_use = next[t + i];
            if let Some(old) = cached.get_mut(chunk) {
                by_next.remove(&(*old, *chunk));
                *old = next_use;
                by_next.insert((next_use, *chunk));
                continue;
            }
            if i < hit || next_use == u64::MAX || capacity == 0 {
                continue;
            }
            if cached.len() >= capacity {
                match by_next.last().copied() {
                    Some((furthest, victim)) if furthest > next_use => {
                        by_next.pop_last();
                        cached.remove(&victim);
                    }
                    _ => continue,
                }
            }
            cached.insert(*chunk, next_use);
            by_next.insert((next_use, *chunk));
            counts.inserted += 1;
        }
        t += chunks.len();
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRequest;

    fn trace(requests: &[&[u64]]) -> Trace {
        Trace {
            name: "t".into(),
            chunk_tokens: 10,
            requests: requests
                .iter()
                .map(|c| TraceRequest {
                    timestamp_ms: 0.0,
                    chunks: c.to_vec(),
                    tokens: c.len() as u64 * 10,
                })
                .collect(),
        }
    }

    #[test]
    fn hits_are_prefixes() {
        // After [1 2 3], a cache of 3 holds all three; [1 9 3] hits only 1.
        let t = trace(&[&[1, 2, 3], &[1, 9, 3]]);
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(3));
        assert_eq!((counts.hit_chunks, counts.chunks), (1, 6));
        assert_eq!(counts.hit_tokens, 10);
    }

    #[test]
    fn lru_keeps_the_roots_of_what_it_saw_last() {
        // Capacity 2: [1 2] then [3 4] evicts 1 and 2; [3] hits.
        let t = trace(&[&[1, 2], &[3, 4], &[3]]);
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(2));
        assert_eq!(counts.hit_chunks, 1);
    }

    #[test]
    fn belady_bypasses_what_is_never_used_again() {
        // Capacity 1: [1] is used again, [2] never; the optimum keeps 1 through [2].
        let t = trace(&[&[1], &[2], &[1]]);
        assert_eq!(simulate(&t, Policy::Belady, Some(1)).hit_chunks, 1);
        assert_eq!(simulate(&t, Policy::Online(PolicyKind::Lru), Some(1)).hit_chunks, 0);
    }

    #[test]
    fn unbounded_caches_agree() {
        let t = trace(&[&[1, 2, 3], &[1, 2, 4], &[5], &[1, 2, 3, 6], &[5, 7]]);
        let expected = simulate(&t, Policy::Belady, None);
        for kind in PolicyKind::ALL {
            assert_eq!(
                simulate(&t, Policy::Online(kind), None),
                SimCounts { inserted: 7, ..expected }
            );
        }
        assert_eq!(expected.hit_chunks, 2 + 3 + 1);
    }

    #[test]
    fn a_request_larger_than_the_cache_stores_what_fits() {
        let t = trace(&[&[1, 2, 3, 4], &[1, 2, 3, 4]]);
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(2));
        assert_eq!(counts.inserted, 2 + 2);
        // Stored root first: 1 and 2 are cached, then the second request stores 3 and 4 in
        // place of its own hits, which live on only as far as the hit they were.
        assert_eq!(counts.hit_chunks, 2);
    }

    #[test]
    fn policy_names_round_trip() {
        for policy in
            [Policy::Belady, Policy::Online(PolicyKind::Lru), Policy::Online(PolicyKind::S3Fifo)]
        {
            assert_eq!(Policy::parse(policy.name()), Some(policy));
        }
        assert_eq!(Policy::parse("fifo"), None);
    }
}
