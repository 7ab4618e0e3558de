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

use std::collections::{BTreeSet, HashMap, HashSet};

use tierkv_core::policy::{EvictionPolicy, Judge, PolicyKind, SegmentPolicy};
use tierkv_core::store_window;

use crate::trace::Trace;

/// A policy the simulation can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// One of the daemon's online policies.
    Online(PolicyKind),
    /// The offline optimum: evict the chunk used furthest in the future.
    Belady,
    /// An online policy that caches only chunks the trace names again: an offline bound on
    /// what any rule deciding *whether* to cache a chunk can add to that policy's order (it
    /// does not know *when* the chunk is named again, which only [`Policy::Belady`] uses).
    OracleAdmission(PolicyKind),
    /// Evicts the cached chunk the whole trace names fewest times (the least recently used of
    /// those), and declines a chunk named fewer times than that one: an offline reference for orders by frequency, which knows every chunk's lifetime
    /// popularity, past and future, but not *when* it returns.
    PopularityOracle,
}

impl Policy {
    /// The name on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Online(kind) => kind.as_str(),
            Policy::Belady => "belady",
            Policy::OracleAdmission(PolicyKind::Lru) => "lru-oracle-admission",
            Policy::OracleAdmission(PolicyKind::S3Fifo) => "s3fifo-oracle-admission",
            Policy::OracleAdmission(PolicyKind::Adaptive) => "adaptive-oracle-admission",
            Policy::PopularityOracle => "popularity-oracle",
        }
    }

    /// Parses a name from [`Policy::name`].
    pub fn parse(name: &str) -> Option<Policy> {
        match name {
            "belady" | "optimal" | "opt" => Some(Policy::Belady),
            "popularity-oracle" => Some(Policy::PopularityOracle),
            other => PolicyKind::ALL.into_iter().find_map(|kind| {
                [Policy::Online(kind), Policy::OracleAdmission(kind)]
                    .into_iter()
                    .find(|policy| policy.name() == other)
            }),
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

/// Replays `trace` through `policy` with room for `capacity` chunks (`None`: unbounded). An
/// online policy runs over `shards` joined shards, as a daemon's L1 index of that many shards
/// holds its keys (1: one policy); the optimum ignores shards.
pub fn simulate(
    trace: &Trace,
    policy: Policy,
    capacity: Option<usize>,
    shards: usize,
) -> SimCounts {
    let capacity = capacity.unwrap_or(usize::MAX);
    match policy {
        Policy::Online(kind) => {
            simulate_online(trace, kind.build_sharded(shards), capacity, |_| true)
        }
        Policy::Belady => simulate_belady(trace, capacity),
        Policy::PopularityOracle => simulate_popularity_oracle(trace, capacity),
        Policy::OracleAdmission(kind) => {
            let next = next_uses(trace);
            simulate_online(trace, kind.build(), capacity, |t| next[t] != NEVER)
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

/// A request's hit below L1 takes at most one in this many of L1's slots to be read through: the
/// daemon's `server.max_leased_per_session` is a quarter of L1 by default, and a lookup loads no
/// more of its hit into L1 than what is left of it (a replay's session holds no other lookup).
pub const PROMOTED_PER_REQUEST: usize = 4;

/// The tiers below L1 of a simulated cascade, in chunks; a tier of 0 is absent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerTiers {
    /// The host tier's capacity.
    pub l2: usize,
    /// The disk tier's capacity: whole segments of `disk_segment` chunks, at least two.
    pub disk: usize,
    /// Chunks per disk segment: the disk frees a segment at a time.
    pub disk_segment: usize,
    /// The policy over the disk's segments; `None`: the cascade's own.
    pub disk_policy: Option<PolicyKind>,
}

/// Chunks per disk segment in a replay, unless asked otherwise: one, as the disk tier's
/// `segment = "auto"` makes them, so the disk frees one chunk at a time.
pub const DISK_SEGMENT_CHUNKS: usize = 1;

impl LowerTiers {
    /// The disk tier's segments: as many as `disk` chunks fill, at least two (none without a
    /// disk tier).
    pub fn disk_segments(&self) -> usize {
        if self.disk == 0 { 0 } else { self.disk.div_ceil(self.disk_segment.max(1)).max(2) }
    }

    /// The chunks the tiers hold together: the disk's whole segments, and the host tier.
    pub fn chunks(&self) -> usize {
        self.disk_segments().saturating_mul(self.disk_segment.max(1)).saturating_add(self.l2)
    }
}

/// Replays `trace` through a cascade of tiers with `policy` in each, as the daemon runs them
/// under `store_policy = "cascade"`; L1 holds `l1` chunks in `shards` joined index shards.
/// Stores go to L1; each tier's eviction victim goes to the next tier down, the last tier's is
/// dropped. A hit is the leading run of chunks held by any
/// tier, and a chunk is touched where it is. A hit's chunks below L1 are read through L1 slots of
/// their own, taken for the request (L1 evicts, and so demotes, to make room for them, never the
/// request's own L1 hits, which its lookup leased, and the tiers below make room for what L1
/// demotes around the hit's chunks they hold, which it locked) and freed after it: at most one in
/// [`PROMOTED_PER_REQUEST`] of L1's slots (the daemon's default allowance of a session), and
/// the rest are read from their tier.
///
/// A store larger than L1 goes in windows of an eighth of L1, so all of it reaches the tiers below;
/// a hit larger than L1's room is read from the tiers that hold it, the rest through L1.
///
/// The disk tier is a log of segments, as the daemon's: chunks are appended to the active segment,
/// the disk's policy ([`tierkv_core::policy::SegmentPolicy`]) orders the sealed segments, told
/// each chunk written, hit or missed, and room is made by dropping a whole segment, which then
/// takes the next chunks.
///
/// With the adaptive policy below L1, L2 and the disk follow one [`Judge`] of the tiers'
/// combined size, told every request's chunks before the tiers are, as the daemon's
/// StorageManager tells it every lookup's.
pub fn simulate_cascade(
    trace: &Trace,
    policy: PolicyKind,
    (l1, shards): (usize, usize),
    lower: LowerTiers,
) -> SimCounts {
    if l1 == 0 {
        return simulate_online(trace, policy.build(), 0, |_| true);
    }
    let mut l1_policy = (policy.build_sharded(shards), l1);
    // What L1 evicts goes down: its policy ages uses over the tiers' turnover, as the daemon's.
    l1_policy.0.keep_below(lower.chunks());
    let l2 = (lower.l2 > 0).then(|| (policy.build(), lower.l2));
    let mut cascade = Cascade {
        tiers: std::iter::once(l1_policy).chain(l2).collect(),
        disk: (lower.disk > 0).then(|| {
            let disk_policy = lower.disk_policy.unwrap_or(policy);
            SegmentLog::new(disk_policy, lower.disk_segments(), lower.disk_segment.max(1))
        }),
    };
    // The tiers below L1 follow one judge of their combined size, as the daemon's do.
    let adaptive_below = policy == PolicyKind::Adaptive
        || lower.disk_policy.is_some_and(|p| p == PolicyKind::Adaptive);
    let mut judge = (adaptive_below && (cascade.tiers.len() > 1 || cascade.disk.is_some()))
        .then(|| Judge::<u64>::new(l1 + lower.l2 + lower.disk));
    if let Some(judge) = &judge {
        for (tier, _) in cascade.tiers.iter_mut().skip(1) {
            tier.follow(judge.order());
        }
        if let Some(disk) = &mut cascade.disk {
            disk.policy.follow(judge.order());
        }
    }
    let window = if cascade.tiers.len() > 1 || cascade.disk.is_some() {
        store_window(l1)
    } else {
        usize::MAX
    };
    let mut counts = SimCounts::default();
    let mut reserved = Vec::new();
    for request in &trace.requests {
        let chunks = &request.chunks;
        if let Some(judge) = &mut judge {
            chunks.iter().rev().for_each(|chunk| judge.looked_up(chunk));
        }
        for chunk in chunks.iter().rev() {
            cascade.touch(chunk);
        }
        let hit = chunks.iter().take_while(|c| cascade.holds(c)).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        // The hit's chunks below L1 each take an L1 slot for the read, up to the allowance.
        let leased: Vec<u64> =
            chunks[..hit].iter().filter(|c| cascade.l1().contains(c)).copied().collect();
        let promoted = (hit - leased.len()).min(l1 / PROMOTED_PER_REQUEST);
        // The lookup holds the hit's chunks below L1 locked in their tiers while it reads them,
        // so the demotions its L1 slots cause evict around them there, as the daemon's tiers do.
        let held: HashSet<u64> =
            chunks[..hit].iter().filter(|c| !cascade.l1().contains(c)).copied().collect();
        for taken in 0..promoted {
            if cascade.l1().len() + taken >= l1
                && !cascade.evict_from_l1(&mut |k| !leased.contains(k), &held)
            {
                break;
            }
        }
        // Stored in windows (the daemon's, with tiers below), the last first, each visible before
        // the next is reserved: a store larger than L1 passes its first windows down, and the
        // chain enters every tier leaf first.
        let parts: Vec<&[u64]> = chunks[hit..].chunks(window).collect();
        'store: for part in parts.into_iter().rev() {
            reserved.clear();
            for chunk in part {
                if cascade.l1().contains(chunk) {
                    continue;
                }
                if cascade.l1().len() + reserved.len() >= l1
                    && !cascade.evict_from_l1(&mut |_| true, &HashSet::new())
                {
                    finish(cascade.l1_mut(), &reserved, &mut counts);
                    break 'store;
                }
                reserved.push(*chunk);
            }
            finish(cascade.l1_mut(), &reserved, &mut counts);
        }
    }
    counts
}

/// A simulated cascade: L1 and the host tier, each a policy over chunks, and the disk tier.
struct Cascade {
    /// L1, then the host tier if there is one: each a policy over chunks and its capacity.
    tiers: Vec<(Box<dyn EvictionPolicy<u64>>, usize)>,
    disk: Option<SegmentLog>,
}

impl Cascade {
    fn l1(&self) -> &dyn EvictionPolicy<u64> {
        self.tiers[0].0.as_ref()
    }

    fn l1_mut(&mut self) -> &mut Box<dyn EvictionPolicy<u64>> {
        &mut self.tiers[0].0
    }

    fn holds(&self, chunk: &u64) -> bool {
        self.tiers.iter().any(|(t, _)| t.contains(chunk))
            || self.disk.as_ref().is_some_and(|d| d.contains(chunk))
    }

    /// A lookup of `chunk`: a use in L1 if L1 holds it; otherwise, as in the daemon, which asks
    /// the lower tiers one after the other, fastest first, each for the chunks no tier before
    /// it found, a use in the first tier holding it, and the tiers before it hear of a miss
    /// (the disk hears of one only when no tier above it holds the chunk).
    fn touch(&mut self, chunk: &u64) {
        if self.tiers[0].0.contains(chunk) {
            self.tiers[0].0.touch(chunk);
            return;
        }
        for (tier, _) in self.tiers.iter_mut().skip(1) {
            let held = tier.contains(chunk);
            tier.touch(chunk);
            if held {
                return;
            }
        }
        if let Some(disk) = &mut self.disk {
            disk.touch(chunk);
        }
    }

    /// Evicts one eligible L1 chunk and hands it down, past the chunks `held` below L1; false
    /// when none is eligible.
    fn evict_from_l1(
        &mut self,
        eligible: &mut dyn FnMut(&u64) -> bool,
        held: &HashSet<u64>,
    ) -> bool {
        match self.tiers[0].0.evict(1, eligible).pop() {
            Some(victim) => {
                self.demote(victim, held);
                true
            }
            None => false,
        }
    }

    /// Puts `chunk`, evicted from L1, into the tiers below, each full tier's own victim going
    /// further down; past the last tier a victim is dropped. No tier evicts a chunk in `held`
    /// (a lookup's lock): a full tier holding nothing else drops the chunk instead, as the
    /// daemon's host store refuses a store it cannot make room for.
    fn demote(&mut self, chunk: u64, held: &HashSet<u64>) {
        let mut chunk = chunk;
        for (policy, capacity) in self.tiers.iter_mut().skip(1) {
            if policy.contains(&chunk) {
                return;
            }
            let victim = if policy.len() >= *capacity {
                let Some(victim) = policy.evict(1, &mut |k| !held.contains(k)).pop() else {
                    return;
                };
                Some(victim)
            } else {
                None
            };
            policy.insert(chunk);
            match victim {
                Some(victim) => chunk = victim,
                None => return,
            }
        }
        if let Some(disk) = &mut self.disk {
            disk.append(chunk, held);
        }
    }
}

/// The disk tier as the daemon's log of segments: a chunk is appended to the active segment; a
/// full one is sealed and enters the policy; the next is the first segment never written, or
/// else the policy's victim, whose chunks are dropped. The policy tracks each segment's current
/// life, as the daemon's does: a reused segment is new to it, and lives are numbered in the
/// order they are opened, the serial the daemon's policy samples by.
struct SegmentLog {
    /// Orders the sealed segments' lives, told the chunks written into each and hit.
    policy: Box<dyn SegmentPolicy<u64, u64>>,
    /// The chunks written into each segment in its current life.
    segments: Vec<Vec<u64>>,
    /// Each segment's current life; lives are numbered from 1 and never reused.
    life: Vec<u64>,
    lives: u64,
    /// The segment of each life the policy tracks.
    segment_of: HashMap<u64, u32>,
    /// The segment being appended to.
    active: Option<u32>,
    /// Segments opened so far; the rest have never been written.
    opened: usize,
    per_segment: usize,
    /// The segment holding each chunk.
    at: HashMap<u64, u32>,
}

impl SegmentLog {
    fn new(policy: PolicyKind, segments: usize, per_segment: usize) -> Self {
        SegmentLog {
            policy: policy.build_for_segments(),
            segments: vec![Vec::new(); segments],
            life: vec![0; segments],
            lives: 0,
            segment_of: HashMap::new(),
            active: None,
            opened: 0,
            per_segment,
            at: HashMap::new(),
        }
    }

    fn contains(&self, chunk: &u64) -> bool {
        self.at.contains_key(chunk)
    }

    /// A lookup of `chunk`: a use of the segment holding it, or a miss.
    fn touch(&mut self, chunk: &u64) {
        match self.at.get(chunk) {
            Some(segment) => self.policy.hit(&self.life[*segment as usize], chunk),
            None => self.policy.missed(chunk),
        }
    }

    fn append(&mut self, chunk: u64, held: &HashSet<u64>) {
        if self.contains(&chunk) {
            return;
        }
        let active = match self.active {
            Some(id) if self.segments[id as usize].len() < self.per_segment => id,
            full => {
                if let Some(id) = full {
                    let life = self.life[id as usize];
                    self.segment_of.insert(life, id);
                    self.policy.seal(life);
                }
                let Some(id) = self.open(held) else { return };
                self.lives += 1;
                self.life[id as usize] = self.lives;
                id
            }
        };
        self.segments[active as usize].push(chunk);
        self.at.insert(chunk, active);
        self.active = Some(active);
        self.policy.written(&self.life[active as usize], &chunk);
    }

    /// The first segment never written, or else the policy's victim, emptied.
    fn open(&mut self, held: &HashSet<u64>) -> Option<u32> {
        if self.opened < self.segments.len() {
            self.opened += 1;
            return u32::try_from(self.opened - 1).ok();
        }
        let SegmentLog { policy, segments, segment_of, .. } = self;
        let no_chunks: &[u64] = &[];
        let chunks_of = |life: &u64| match segment_of.get(life) {
            Some(id) => segments[*id as usize].as_slice(),
            None => no_chunks,
        };
        // A segment holding a chunk a lookup holds stays, as the daemon's locked records do.
        let mut unheld = |life: &u64| {
            segment_of
                .get(life)
                .is_none_or(|id| !segments[*id as usize].iter().any(|c| held.contains(c)))
        };
        let victim = policy.evict(&mut unheld, &chunks_of)?;
        let victim = self.segment_of.remove(&victim)?;
        for chunk in std::mem::take(&mut self.segments[victim as usize]) {
            self.at.remove(&chunk);
        }
        Some(victim)
    }
}

/// Makes a store window's reserved chunks visible, leaf first (the daemon's `finish_write`).
fn finish(l1: &mut Box<dyn EvictionPolicy<u64>>, reserved: &[u64], counts: &mut SimCounts) {
    counts.inserted += reserved.len() as u64;
    for chunk in reserved.iter().rev() {
        l1.insert(*chunk);
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

/// The popularity oracle over the daemon's lookups and stores, in [`simulate_online`]'s order:
/// hits touched leaf first, the missed chunks reserved root first (each evicting the chunk the
/// trace names fewest times, the least recent of them, or declined if it is named fewer times
/// still), and entered leaf first.
fn simulate_popularity_oracle(trace: &Trace, capacity: usize) -> SimCounts {
    let mut uses: HashMap<u64, u64> = HashMap::new();
    for chunk in trace.requests.iter().flat_map(|r| &r.chunks) {
        *uses.entry(*chunk).or_default() += 1;
    }
    let mut cache = PopularityCache { uses, ..PopularityCache::default() };
    let mut counts = SimCounts::default();
    let mut reserved = Vec::new();
    for request in &trace.requests {
        let chunks = &request.chunks;
        for chunk in chunks.iter().rev() {
            if cache.last_use.contains_key(chunk) {
                cache.use_chunk(*chunk);
            }
        }
        let hit = chunks.iter().take_while(|c| cache.last_use.contains_key(c)).count();
        counts.add_request(chunks.len(), request.tokens, hit, trace.chunk_tokens);
        reserved.clear();
        for chunk in chunks.iter().skip(hit) {
            if cache.last_use.contains_key(chunk) || capacity == 0 {
                continue;
            }
            if cache.last_use.len() + reserved.len() >= capacity {
                // Declines a chunk named fewer times than every chunk it holds.
                match cache.order.first().copied() {
                    Some((fewest, _, victim)) if fewest <= cache.uses_of(*chunk) => {
                        cache.order.pop_first();
                        cache.last_use.remove(&victim);
                    }
                    Some(_) => continue,
                    None => break,
                }
            }
            reserved.push(*chunk);
        }
        counts.inserted += reserved.len() as u64;
        for chunk in reserved.iter().rev() {
            cache.use_chunk(*chunk);
        }
    }
    counts
}

/// The popularity oracle's cache: each chunk's uses in the whole trace, each cached chunk's last
/// use, and the cached chunks ordered by (uses, last use).
#[derive(Default)]
struct PopularityCache {
    uses: HashMap<u64, u64>,
    last_use: HashMap<u64, u64>,
    order: BTreeSet<(u64, u64, u64)>,
    tick: u64,
}

impl PopularityCache {
    fn uses_of(&self, chunk: u64) -> u64 {
        self.uses.get(&chunk).copied().unwrap_or(0)
    }

    /// Caches `chunk` if it is not, and makes it the most recent of its count.
    fn use_chunk(&mut self, chunk: u64) {
        self.tick += 1;
        let uses = self.uses_of(chunk);
        if let Some(last) = self.last_use.insert(chunk, self.tick) {
            self.order.remove(&(uses, last, chunk));
        }
        self.order.insert((uses, self.tick, chunk));
    }
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
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(3), 1);
        assert_eq!((counts.hit_chunks, counts.chunks), (1, 6));
        assert_eq!(counts.hit_tokens, 10);
    }

    #[test]
    fn lru_keeps_the_roots_of_what_it_saw_last() {
        // Capacity 2: [1 2] then [3 4] evicts 1 and 2; [3] hits.
        let t = trace(&[&[1, 2], &[3, 4], &[3]]);
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(2), 1);
        assert_eq!(counts.hit_chunks, 1);
    }

    #[test]
    fn belady_bypasses_what_is_never_used_again() {
        // Capacity 1: [1] is used again, [2] never; the optimum keeps 1 through [2].
        let t = trace(&[&[1], &[2], &[1]]);
        assert_eq!(simulate(&t, Policy::Belady, Some(1), 1).hit_chunks, 1);
        assert_eq!(simulate(&t, Policy::Online(PolicyKind::Lru), Some(1), 1).hit_chunks, 0);
    }

    #[test]
    fn oracle_admission_caches_only_what_is_named_again() {
        // Capacity 1. LRU lets every chunk push out the last and hits nothing. The oracle never
        // caches 2 (named once), so 1 hits; 3 (named again) then pushes 1 out in LRU order, and
        // 1's last use is not cached, so 3 hits too.
        let t = trace(&[&[1], &[2], &[1], &[3], &[1], &[3]]);
        let oracle = simulate(&t, Policy::OracleAdmission(PolicyKind::Lru), Some(1), 1);
        assert_eq!((oracle.hit_chunks, oracle.inserted), (2, 2));
        assert_eq!(simulate(&t, Policy::Online(PolicyKind::Lru), Some(1), 1).hit_chunks, 0);
        assert!(oracle.hit_chunks <= simulate(&t, Policy::Belady, Some(1), 1).hit_chunks);
    }

    #[test]
    fn oracle_admission_runs_under_every_online_order() {
        // Capacity 2: [9] is named once, so with the oracle no policy caches it, and [1] and
        // [2] stay through it. Without the oracle, [9] pushes one of them out under every order.
        let t = trace(&[&[1], &[2], &[1], &[2], &[9], &[1], &[2]]);
        for kind in PolicyKind::ALL {
            let oracle = simulate(&t, Policy::OracleAdmission(kind), Some(2), 1);
            assert_eq!((oracle.hit_chunks, oracle.inserted), (4, 2), "{kind:?}");
            let plain = simulate(&t, Policy::Online(kind), Some(2), 1);
            assert!(plain.hit_chunks < 4 && plain.inserted > 2, "{kind:?}: {plain:?}");
        }
    }

    #[test]
    fn the_popularity_oracle_keeps_the_most_named_chunk() {
        // Capacity 1. [1] is named three times, [2] and [3] once: the oracle keeps 1 through
        // them (evicting it only for a chunk named as often), where LRU loses it to each.
        let t = trace(&[&[1], &[2], &[1], &[3], &[1]]);
        let oracle = simulate(&t, Policy::PopularityOracle, Some(1), 1);
        assert_eq!((oracle.hit_chunks, oracle.inserted), (2, 1));
        assert_eq!(simulate(&t, Policy::Online(PolicyKind::Lru), Some(1), 1).hit_chunks, 0);
        // Equal counts fall back to recency: 4 and 5 each named twice, alternating.
        let t = trace(&[&[4], &[5], &[4], &[5]]);
        let oracle = simulate(&t, Policy::PopularityOracle, Some(1), 1);
        assert_eq!(oracle, simulate(&t, Policy::Online(PolicyKind::Lru), Some(1), 1));
    }

    #[test]
    fn unbounded_caches_agree() {
        let t = trace(&[&[1, 2, 3], &[1, 2, 4], &[5], &[1, 2, 3, 6], &[5, 7]]);
        let expected = simulate(&t, Policy::Belady, None, 1);
        assert_eq!(
            simulate(&t, Policy::PopularityOracle, None, 1),
            SimCounts { inserted: 7, ..expected }
        );
        for kind in PolicyKind::ALL {
            assert_eq!(
                simulate(&t, Policy::Online(kind), None, 1),
                SimCounts { inserted: 7, ..expected }
            );
        }
        assert_eq!(expected.hit_chunks, 2 + 3 + 1);
    }

    #[test]
    fn a_request_larger_than_the_cache_stores_what_fits() {
        let t = trace(&[&[1, 2, 3, 4], &[1, 2, 3, 4]]);
        let counts = simulate(&t, Policy::Online(PolicyKind::Lru), Some(2), 1);
        assert_eq!(counts.inserted, 2 + 2);
        // Stored root first: 1 and 2 are cached, then the second request stores 3 and 4 in
        // place of its own hits, which live on only as far as the hit they were.
        assert_eq!(counts.hit_chunks, 2);
    }

    fn cascade(t: &Trace, l1: usize, l2: usize, disk: (usize, usize)) -> SimCounts {
        let (disk, disk_segment) = disk;
        let lower = LowerTiers { l2, disk, disk_segment, disk_policy: None };
        simulate_cascade(t, PolicyKind::Lru, (l1, 1), lower)
    }

    #[test]
    fn a_cascade_keeps_what_l1_evicted_in_the_tier_below() {
        let t = trace(&[&[1], &[2], &[3], &[4], &[1]]);
        // L1 of 2 over a tier of 2 holds the last four chunks, like one cache of 4.
        let tiered = cascade(&t, 2, 2, (0, 1));
        assert_eq!(tiered.hit_chunks, 1);
        assert_eq!(tiered, simulate(&t, Policy::Online(PolicyKind::Lru), Some(4), 1));
        // L1 alone, or a lower tier too small, loses chunk 1.
        assert_eq!(cascade(&t, 2, 0, (0, 1)).hit_chunks, 0);
        assert_eq!(cascade(&t, 2, 1, (0, 1)).hit_chunks, 0);
    }

    #[test]
    fn a_disk_of_one_chunk_segments_is_a_tier_of_chunks() {
        // Segments of one chunk: LRU over segments is LRU over chunks.
        let mut x = 7u64;
        let requests: Vec<Vec<u64>> = (0..200)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let root = (x >> 33) % 14;
                vec![root, root + 100]
            })
            .collect();
        let requests: Vec<&[u64]> = requests.iter().map(Vec::as_slice).collect();
        let t = trace(&requests);
        let on_disk = cascade(&t, 2, 0, (16, 1));
        let in_l2 = cascade(&t, 2, 16, (0, 1));
        assert!(on_disk.hit_chunks > cascade(&t, 2, 0, (0, 1)).hit_chunks + 100);
        // But for the segment still open, whose hits LRU over segments hears of only once it is
        // sealed (the daemon's disk seals a segment when the next record does not fit, too):
        // 248 hits against 250 here. (While every hit below L1 was read through L1 slots, which
        // L1 freed by handing chunks down, the next append sealed it at once, and the two were
        // equal.)
        assert!(on_disk.hit_chunks.abs_diff(in_l2.hit_chunks) <= 4, "{on_disk:?} {in_l2:?}");
    }

    #[test]
    fn the_disk_drops_a_whole_segment_and_the_policy_picks_which() {
        // L1 of one chunk passes every earlier chunk down to a disk of 16 segments of 2 chunks,
        // full once 1-32 are down; 33 going down then drops the least recent segment whole.
        let stored: Vec<Vec<u64>> = (1..=34u64).map(|c| vec![c]).collect();
        let mut requests: Vec<&[u64]> = stored.iter().map(Vec::as_slice).collect();
        let probes: [&[u64]; 2] = [&[3], &[1]];
        requests.extend(probes);
        // Untouched, [1 2] went: the probe of 3 hits, the probe of 1 misses.
        let counts = cascade(&trace(&requests), 1, 0, (32, 2));
        assert_eq!(counts.hit_chunks, 1);
        // A hit on 2 while the disk fills makes [3 4] the least recent segment instead: that
        // early probe hits, then 3 misses and 1 hits.
        requests.insert(20, &[2]);
        let counts = cascade(&trace(&requests), 1, 0, (32, 2));
        assert_eq!(counts.hit_chunks, 2);
    }

    #[test]
    fn a_cascade_hit_below_l1_is_read_through_an_l1_slot() {
        // [1 2] sits in the lower tier after [3 4]; reading it takes L1's two slots, which
        // pushes 3 and 4 down; they are still hits.
        let t = trace(&[&[1, 2], &[3, 4], &[1, 2], &[3, 4]]);
        let counts = cascade(&t, 2, 2, (0, 1));
        assert_eq!(counts.hit_chunks, 4);
        assert_eq!(counts.inserted, 4, "hits below L1 are not stored again");
    }

    #[test]
    fn a_lookup_keeps_its_hit_below_l1_while_its_l1_slots_push_chunks_down() {
        // [1 2] goes down to an L2 of two under [3 4 5 6]. Read again, it takes one L1 slot (a
        // quarter of four), whose victim 3 finds L2 full of the lookup's own hit, locked by it:
        // 3 is dropped, not 2, and [1 2] hits whole the next time too.
        let t = trace(&[&[1, 2], &[3, 4, 5, 6], &[1, 2], &[1, 2]]);
        let counts = cascade(&t, 4, 2, (0, 1));
        assert_eq!(counts.hit_chunks, 4);
        assert_eq!(counts.inserted, 6);
    }

    #[test]
    fn a_cascade_takes_a_store_larger_than_l1_in_windows_and_serves_its_whole_hit() {
        let t = trace(&[&[1, 2, 3, 4, 5, 6, 7, 8], &[1, 2, 3, 4, 5, 6, 7, 8]]);
        // L1 of 4 over a tier of 8: windows of 1 pass 1-4 down; the second request hits all
        // eight, four of them read from below with L1 full of its own leased hits.
        let counts = cascade(&t, 4, 8, (0, 1));
        assert_eq!((counts.inserted, counts.hit_chunks), (8, 8));
        // L1 alone takes one reservation: what does not fit is refused.
        let alone = cascade(&t, 4, 0, (0, 1));
        assert_eq!((alone.inserted, alone.hit_chunks), (4 + 4, 4));
    }

    #[test]
    fn policy_names_round_trip() {
        for policy in [
            Policy::Belady,
            Policy::PopularityOracle,
            Policy::OracleAdmission(PolicyKind::Lru),
            Policy::OracleAdmission(PolicyKind::S3Fifo),
            Policy::OracleAdmission(PolicyKind::Adaptive),
            Policy::Online(PolicyKind::Lru),
            Policy::Online(PolicyKind::S3Fifo),
            Policy::Online(PolicyKind::Adaptive),
        ] {
            assert_eq!(Policy::parse(policy.name()), Some(policy));
        }
        assert_eq!(Policy::parse("fifo"), None);
    }
}
