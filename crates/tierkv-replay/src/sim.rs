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
use tierkv_core::store_window;

use crate::trace::Trace;

/// A policy the simulation can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// One of the daemon's online policies.
    Online(PolicyKind),
    /// The offline optimum: evict the chunk used furthest in the future.
    Belady,
    /// LRU that caches only chunks the trace names again: an offline bound on what any rule
    /// deciding *whether* to cache a chunk can add to LRU (it does not know *when* the chunk
    /// is named again, which only [`Policy::Belady`] uses).
    LruOracleAdmission,
}

impl Policy {
    /// The name on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Online(kind) => kind.as_str(),
            Policy::Belady => "belady",
            Policy::LruOracleAdmission => "lru-oracle-admission",
        }
    }

    /// Parses a name from [`Policy::name`].
    pub fn parse(name: &str) -> Option<Policy> {
        match name {
            "belady" | "optimal" | "opt" => Some(Policy::Belady),
            "lru-oracle-admission" => Some(Policy::LruOracleAdmission),
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
        Policy::Online(kind) => simulate_online(trace, kind.build(), capacity, |_| true),
        Policy::Belady => simulate_belady(trace, capacity),
        Policy::LruOracleAdmission => {
            let next = next_uses(trace);
            simulate_online(trace, PolicyKind::Lru.build(), capacity, |t| next[t] != NEVER)
        }
    }
}

/// `next_uses(trace)[t]` is the next position in the trace's flattened chunk stream that names
/// the chunk at position `t` again, or [`NEVER`].
fn next_uses(trace: &Trace) -> Vec<u64> {
    let total: usize = trace.requests.iter().map(|r| r.chunks.len()).sum();
    let mut next = vec![NEVER; total];
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
    next
}

/// A chunk the trace never names again.
const NEVER: u64 = u64::MAX;

/// Replays `trace` through `policy`; a missed chunk at stream position `t` is cached only if
/// `admit(t)`.
fn simulate_online(
    trace: &Trace,
    mut policy: Box<dyn EvictionPolicy<u64>>,
    capacity: usize,
    admit: impl Fn(usize) -> bool,
) -> SimCounts {
    let mut counts = SimCounts::default();
    let mut reserved = Vec::new();
    let mut t = 0usize;
    for request in &trace.requests {
        let chunks = &request.chunks;
        let start = t;
        t += chunks.len();
        for chunk in chunks.iter().rev() {
            policy.touch(chunk);
        }
        let hit = chunks.iter().take_while(|c| policy.contains(c)).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        reserved.clear();
        for (i, chunk) in chunks.iter().enumerate().skip(hit) {
            if policy.contains(chunk) || capacity == 0 || !admit(start + i) {
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

/// Replays `trace` through a cascade of tiers with `policy` in each, as the daemon runs them
/// under `store_policy = "cascade"`: `capacities[0]` is L1's, the rest are the lower tiers',
/// fastest first (a tier of 0 is absent). Stores go to L1; each tier's eviction victim goes to
/// the next tier down, the last tier's is dropped. A hit is the leading run of chunks held by
/// any tier, and a chunk is touched where it is. A hit's chunks below L1 are read through L1
/// slots of their own, taken for the request (L1 evicts, and so demotes, to make room for them,
/// never the request's own L1 hits, which its lookup leased) and freed after it.
///
/// A store larger than L1 goes in windows of an eighth of L1, so all of it reaches the tiers below;
/// a hit larger than L1's room is read from the tiers that hold it, the rest through L1.
///
/// Disk segments are not modelled: the daemon's disk evicts a segment of chunks at a time, so
/// a daemon replay comes close to this count rather than equal to it.
pub fn simulate_cascade(trace: &Trace, policy: PolicyKind, capacities: &[usize]) -> SimCounts {
    let mut tiers: Vec<(Box<dyn EvictionPolicy<u64>>, usize)> =
        capacities.iter().filter(|c| **c > 0).map(|c| (policy.build(), *c)).collect();
    let mut counts = SimCounts::default();
    if tiers.is_empty() {
        return simulate_online(trace, policy.build(), 0, |_| true);
    }
    let mut reserved = Vec::new();
    for request in &trace.requests {
        let chunks = &request.chunks;
        let holder = |tiers: &[(Box<dyn EvictionPolicy<u64>>, usize)], c: &u64| {
            tiers.iter().position(|(t, _)| t.contains(c))
        };
        for chunk in chunks.iter().rev() {
            if let Some(t) = holder(&tiers, chunk) {
                tiers[t].0.touch(chunk);
            }
        }
        let hit = chunks.iter().take_while(|c| holder(&tiers, c).is_some()).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        // The hit's chunks below L1 each take an L1 slot for the read.
        let leased: Vec<u64> =
            chunks[..hit].iter().filter(|c| tiers[0].0.contains(c)).copied().collect();
        let promoted = hit - leased.len();
        for taken in 0..promoted {
            if tiers[0].0.len() + taken >= tiers[0].1 {
                let victim = tiers[0].0.evict(1, &mut |k| !leased.contains(k)).pop();
                match victim {
                    Some(victim) => demote(&mut tiers, 1, victim),
                    None => break,
                }
            }
        }
        // Stored in windows (the daemon's, with tiers below), the last first, each visible before
        // the next is reserved: a store larger than L1 passes its first windows down, and the
        // chain enters every tier leaf first.
        let window = if tiers.len() > 1 { store_window(tiers[0].1) } else { usize::MAX };
        let parts: Vec<&[u64]> = chunks[hit..].chunks(window).collect();
        'store: for part in parts.into_iter().rev() {
            reserved.clear();
            for chunk in part {
                if tiers[0].0.contains(chunk) {
                    continue;
                }
                if tiers[0].0.len() + reserved.len() >= tiers[0].1 {
                    match tiers[0].0.evict(1, &mut |_| true).pop() {
                        Some(victim) => demote(&mut tiers, 1, victim),
                        None => {
                            finish(&mut tiers[0].0, &reserved, &mut counts);
                            break 'store;
                        }
                    }
                }
                reserved.push(*chunk);
            }
            finish(&mut tiers[0].0, &reserved, &mut counts);
        }
    }
    counts
}

/// Makes a store window's reserved chunks visible, leaf first (the daemon's `finish_write`).
fn finish(l1: &mut Box<dyn EvictionPolicy<u64>>, reserved: &[u64], counts: &mut SimCounts) {
    counts.inserted += reserved.len() as u64;
    for chunk in reserved.iter().rev() {
        l1.insert(*chunk);
    }
}

/// Puts `chunk`, evicted from the tier above, into tier `at`, demoting that tier's own victim
/// further down when it is full. Past the last tier a victim is dropped.
fn demote(tiers: &mut [(Box<dyn EvictionPolicy<u64>>, usize)], at: usize, chunk: u64) {
    let mut chunk = chunk;
    for (policy, capacity) in tiers.iter_mut().skip(at) {
        if policy.contains(&chunk) {
            return;
        }
        let victim =
            if policy.len() >= *capacity { policy.evict(1, &mut |_| true).pop() } else { None };
        policy.insert(chunk);
        match victim {
            Some(victim) => chunk = victim,
            None => return,
        }
    }
}

/// Belady's MIN with bypass over the same lookups and stores.
fn simulate_belady(trace: &Trace, capacity: usize) -> SimCounts {
    // Time is the position in the flattened chunk stream.
    let next = next_uses(trace);
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
            if i < hit || next_use == NEVER || capacity == 0 {
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
    fn oracle_admission_caches_only_what_is_named_again() {
        // Capacity 1. LRU lets every chunk push out the last and hits nothing. The oracle never
        // caches 2 (named once), so 1 hits; 3 (named again) then pushes 1 out in LRU order, and
        // 1's last use is not cached, so 3 hits too.
        let t = trace(&[&[1], &[2], &[1], &[3], &[1], &[3]]);
        let oracle = simulate(&t, Policy::LruOracleAdmission, Some(1));
        assert_eq!((oracle.hit_chunks, oracle.inserted), (2, 2));
        assert_eq!(simulate(&t, Policy::Online(PolicyKind::Lru), Some(1)).hit_chunks, 0);
        assert!(oracle.hit_chunks <= simulate(&t, Policy::Belady, Some(1)).hit_chunks);
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
    fn a_cascade_keeps_what_l1_evicted_in_the_tier_below() {
        let t = trace(&[&[1], &[2], &[3], &[4], &[1]]);
        // L1 of 2 over a tier of 2 holds the last four chunks, like one cache of 4.
        let cascade = simulate_cascade(&t, PolicyKind::Lru, &[2, 2]);
        assert_eq!(cascade.hit_chunks, 1);
        assert_eq!(cascade, simulate(&t, Policy::Online(PolicyKind::Lru), Some(4)));
        // L1 alone, or a lower tier too small, loses chunk 1.
        assert_eq!(simulate_cascade(&t, PolicyKind::Lru, &[2]).hit_chunks, 0);
        assert_eq!(simulate_cascade(&t, PolicyKind::Lru, &[2, 1]).hit_chunks, 0);
        // An absent tier (0) is skipped: [2, 0, 2] is [2, 2].
        assert_eq!(simulate_cascade(&t, PolicyKind::Lru, &[2, 0, 2]), cascade);
    }

    #[test]
    fn a_cascade_hit_below_l1_is_read_through_an_l1_slot() {
        // [1 2] sits in the lower tier after [3 4]; reading it takes L1's two slots, which
        // pushes 3 and 4 down; they are still hits.
        let t = trace(&[&[1, 2], &[3, 4], &[1, 2], &[3, 4]]);
        let counts = simulate_cascade(&t, PolicyKind::Lru, &[2, 2]);
        assert_eq!(counts.hit_chunks, 4);
        assert_eq!(counts.inserted, 4, "hits below L1 are not stored again");
    }

    #[test]
    fn a_cascade_takes_a_store_larger_than_l1_in_windows_and_serves_its_whole_hit() {
        let t = trace(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[1, 2, 3, 4, 5, 6, 7, 8]]);
        // L1 of 4 over a tier of 8: windows of 1 pass 1-4 down; the second request hits all
        // eight, four of them read from below with L1 full of its own leased hits.
        let counts = simulate_cascade(&t, PolicyKind::Lru, &[4, 8]);
        assert_eq!((counts.inserted, counts.hit_chunks), (8, 8));
        // L1 alone takes one reservation: what does not fit is refused.
        let alone = simulate_cascade(&t, PolicyKind::Lru, &[4]);
        assert_eq!((alone.inserted, alone.hit_chunks), (4 + 4, 4));
    }

    #[test]
    fn policy_names_round_trip() {
        for policy in [
            Policy::Belady,
            Policy::LruOracleAdmission,
            Policy::Online(PolicyKind::Lru),
            Policy::Online(PolicyKind::S3Fifo),
        ] {
            assert_eq!(Policy::parse(policy.name()), Some(policy));
        }
        assert_eq!(Policy::parse("fifo"), None);
    }
}
