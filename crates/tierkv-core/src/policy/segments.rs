//! Eviction over the segments of a log (the disk tier): which whole segment to reuse next.
//!
//! A log-structured store appends chunks to an open segment, seals it when full and, when it
//! needs room, empties one sealed segment at a time. Its policy orders segments, but it is also
//! told which chunks go into each and which chunk a lookup found, because an order over segments
//! alone cannot adapt: a segment's life never comes back once evicted, its chunks do.
//!
//! [`PolicyKind::build_for_segments`] gives LRU and S3-FIFO over segments as they are (an
//! [`EvictionPolicy`] over segment keys: a seal is an insert, a hit a use of the segment). The
//! adaptive kind is [`SegmentArc`]:
//!
//! **ARC over segments, steered by chunk ghosts.** Sealed segments sit on ARC's `T1` (not used
//! since sealed) or `T2` (used while stored); each carries the tick of its last use and its chunk
//! count. When a segment is evicted its chunks become ghosts on `B1` or `B2`, after the list the
//! segment left. A chunk written into the log again while it is a ghost was evicted too early:
//! as in ARC, a `B1` ghost grows the target for `T1`, a `B2` ghost shrinks it, both counted in
//! chunks, and the segment it is written into goes to `T2` (at its seal, or at once if sealed).
//! In ARC's order the policy evicts from `T1` while `T1` holds more chunks than the target, else
//! from `T2`; in recency order it evicts the least recently used segment of either list, which
//! is LRU over segments.
//!
//! **Choosing the order.** Two shadow logs, one in recency order and one in ARC's, each given the
//! chunks of one segment in four (sampled by [`SampleKey::sample_bits`] of the segment) and room
//! for a quarter of the segments, count the lookups they would have served; the order changes
//! when the other shadow leads by the adaptive policy's margin, and below the adaptive policy's
//! minimum of 64 tracked segments it stays recency. The shadows sample segments, not chunks:
//! which chunks share a segment decides what an order is worth as much as the chunks do, and
//! shadows over sampled chunks chose ARC's order where it loses with large segments.
//!
//! Ghosts are kept up to three times the chunks of the tracked segments (chosen on Mooncake's
//! conversation trace, checked on the synthetic one; docs/performance.md). Every call is O(1)
//! per chunk it names (an eviction makes each of its victim's chunks a ghost).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::Hash;

use super::adaptive::{MIN_JUDGED, Mode, SAMPLE_SHIFT, SCORE_MEMORY, sampled};
use super::list::{KeyedLists, NodeId};
use super::{EvictionPolicy, JudgedOrder, Order, PolicyKind, SampleKey};

/// Sealed segments not used since they were sealed.
const T1: usize = 0;
/// Sealed segments used while stored, or holding a chunk that came back from a ghost.
const T2: usize = 1;
/// Ghosts of the chunks of segments evicted from `T1`.
const B1: usize = 0;
/// Ghosts of the chunks of segments evicted from `T2`.
const B2: usize = 1;

/// Ghosts are kept up to this many times the chunks of the tracked segments.
const GHOST_FACTOR: usize = 3;

/// Orders the sealed segments of a log for eviction, told the chunks written into them and hit.
///
/// `S` names one life of a segment: a segment emptied and written again is a new `S`. `K` is a
/// chunk's key. Implementations are single-threaded; the store calls them under its index lock.
pub trait SegmentPolicy<S, K>: Send {
    /// `key` was written into `segment`, open or already sealed.
    fn written(&mut self, segment: &S, key: &K);

    /// `segment` is closed for writes: from now on it may be evicted. A tracked one is left as
    /// it is.
    fn seal(&mut self, segment: S);

    /// A lookup did not find `key`.
    fn missed(&mut self, key: &K);

    /// A lookup found `key` in `segment`: a use of both.
    fn hit(&mut self, segment: &S, key: &K);

    /// The number of sealed segments tracked.
    fn len(&self) -> usize;

    /// Whether no segment is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the sealed `segment` is tracked.
    fn contains(&self, segment: &S) -> bool;

    /// Evicts in the order `order` names for a tier below L1 from now on instead of judging its
    /// own: see
    /// [`EvictionPolicy::follow`](super::EvictionPolicy::follow). Policies with one order ignore
    /// it.
    fn follow(&mut self, _order: JudgedOrder) {}

    /// The order evictions follow now: the adaptive policy's choice at its last eviction;
    /// always recency for LRU and S3-FIFO.
    fn order(&self) -> Order {
        Order::Recency
    }

    /// Chooses the next segment to empty among the tracked ones `eligible` accepts, stops
    /// tracking it and returns it; `None` when none is eligible. `chunks` names the chunks a
    /// segment holds: they leave the store with it. Ineligible segments stay tracked.
    fn evict<'c>(
        &mut self,
        eligible: &mut dyn FnMut(&S) -> bool,
        chunks: &dyn Fn(&S) -> &'c [K],
    ) -> Option<S>
    where
        K: 'c;
}

impl PolicyKind {
    /// A new, empty policy of this kind over the segments of a log.
    pub fn build_for_segments<S, K>(self) -> Box<dyn SegmentPolicy<S, K>>
    where
        S: Hash + Eq + Clone + Send + SampleKey + 'static,
        K: Hash + Eq + Clone + Send + SampleKey + 'static,
    {
        match self {
            PolicyKind::Lru | PolicyKind::S3Fifo => {
                Box::new(WholeSegments { policy: self.build::<S>() })
            }
            PolicyKind::Adaptive => Box::new(SegmentArc::<S, K>::new()),
        }
    }
}

/// A policy over segment keys alone: a seal is an insert, a hit a use; chunks are not looked at.
struct WholeSegments<S> {
    policy: Box<dyn EvictionPolicy<S>>,
}

impl<S: Send, K> SegmentPolicy<S, K> for WholeSegments<S> {
    fn written(&mut self, _segment: &S, _key: &K) {}

    fn seal(&mut self, segment: S) {
        self.policy.insert(segment);
    }

    fn missed(&mut self, _key: &K) {}

    fn hit(&mut self, segment: &S, _key: &K) {
        self.policy.touch(segment);
    }

    fn len(&self) -> usize {
        self.policy.len()
    }

    fn contains(&self, segment: &S) -> bool {
        self.policy.contains(segment)
    }

    fn order(&self) -> Order {
        self.policy.order()
    }

    fn evict<'c>(
        &mut self,
        eligible: &mut dyn FnMut(&S) -> bool,
        _chunks: &dyn Fn(&S) -> &'c [K],
    ) -> Option<S>
    where
        K: 'c,
    {
        self.policy.evict(1, eligible).pop()
    }
}

/// A sealed segment's place in the order.
#[derive(Clone, Copy, Debug)]
struct Sealed {
    /// The tick of its seal or its last use.
    tick: u64,
    /// Chunks written into it.
    chunks: usize,
}

/// A segment not sealed yet.
#[derive(Clone, Copy, Debug, Default)]
struct Open {
    chunks: usize,
    /// A chunk came back into it from a ghost, or a lookup hit it: it is sealed onto `T2`.
    hot: bool,
}

/// ARC over the segments of a log, steered by the ghosts of their chunks; see the module
/// documentation.
pub struct SegmentArc<S, K> {
    /// Sealed segments on `T1` and `T2`, each ordered by last use.
    segments: KeyedLists<S, Sealed, 2>,
    /// Segments written into and not sealed yet.
    open: HashMap<S, Open>,
    /// Ghosts of evicted chunks on `B1` and `B2`.
    ghosts: KeyedLists<K, (), 2>,
    /// Chunks of the segments on `T1`.
    t1_chunks: usize,
    /// Chunks of all tracked segments.
    chunks: usize,
    /// ARC's target for `T1`, in chunks.
    target: f64,
    /// Ticks once per seal or use.
    clock: u64,
    /// Chooses the order; `None` (a shadow's own policy) always follows ARC's.
    judge: Option<Box<SegmentJudge<S, K>>>,
    /// The judge whose order this policy follows instead, if any.
    followed: Option<JudgedOrder>,
}

impl<S, K> SegmentArc<S, K>
where
    S: Hash + Eq + Clone + Send + SampleKey + 'static,
    K: Hash + Eq + Clone + Send + SampleKey + 'static,
{
    /// An empty policy, evicting in recency order until its shadows say otherwise.
    pub fn new() -> Self {
        SegmentArc { judge: Some(Box::new(SegmentJudge::new())), ..Self::arc_only() }
    }
}

impl<S, K> SegmentArc<S, K>
where
    S: Hash + Eq + Clone + Send,
    K: Hash + Eq + Clone + Send + SampleKey,
{
    /// An empty policy that always evicts in ARC's order.
    pub(super) fn arc_only() -> Self {
        SegmentArc {
            segments: KeyedLists::new(),
            open: HashMap::new(),
            ghosts: KeyedLists::new(),
            t1_chunks: 0,
            chunks: 0,
            target: 0.0,
            clock: 0,
            judge: None,
            followed: None,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The order of the next eviction: the followed judge's (ARC's for the frequency order),
    /// else the own judge's, else ARC's.
    fn mode(&self) -> Mode {
        match (&self.followed, &self.judge) {
            (Some(followed), _) => followed.mode_below(),
            (None, Some(judge)) => judge.mode,
            (None, None) => Mode::Arc,
        }
    }

    /// Moves the tracked segment `id` to the front of `T2` as used now.
    fn promote(&mut self, id: NodeId) {
        if self.segments.list_of(id) == T1 {
            self.t1_chunks -= self.segments.value(id).chunks;
        }
        let tick = self.tick();
        self.segments.value_mut(id).tick = tick;
        self.segments.move_to_front(id, T2);
    }

    /// If `key` is a ghost, forgets it and adapts the target as ARC does for a ghost hit;
    /// returns whether it was one.
    fn ghost_returns(&mut self, key: &K) -> bool {
        let Some(id) = self.ghosts.find(key) else {
            return false;
        };
        let (b1, b2) = (self.ghosts.len(B1) as f64, self.ghosts.len(B2) as f64);
        if self.ghosts.list_of(id) == B1 {
            self.target = (self.target + (b2 / b1).max(1.0)).min((self.chunks as f64).max(1.0));
        } else {
            self.target = (self.target - (b1 / b2).max(1.0)).max(0.0);
        }
        self.ghosts.remove_node(id);
        true
    }

    /// The oldest segment of `list` that `eligible` accepts.
    fn first_eligible(&self, list: usize, eligible: &mut dyn FnMut(&S) -> bool) -> Option<NodeId> {
        let mut cursor = self.segments.back(list);
        while let Some(id) = cursor {
            if eligible(self.segments.key(id)) {
                return Some(id);
            }
            cursor = self.segments.newer(id);
        }
        None
    }

    /// Drops the oldest ghosts until `T1 + B1` and `B1 + B2` are within the bound, in chunks.
    fn trim_ghosts(&mut self) {
        let bound = GHOST_FACTOR * self.chunks;
        while self.t1_chunks + self.ghosts.len(B1) > bound && self.ghosts.pop_back(B1).is_some() {}
        while self.ghosts.len(B1) + self.ghosts.len(B2) > bound
            && self.ghosts.pop_back(B2).is_some()
        {}
    }
}

impl<S, K> Default for SegmentArc<S, K>
where
    S: Hash + Eq + Clone + Send + SampleKey + 'static,
    K: Hash + Eq + Clone + Send + SampleKey + 'static,
{
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Hash + Eq + Clone, K: Hash + Eq + Clone> fmt::Debug for SegmentArc<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SegmentArc")
            .field("mode", &self.judge.as_ref().map_or(Mode::Arc, |j| j.mode))
            .field("score", &self.judge.as_ref().map(|j| j.score))
            .field("t1", &self.segments.len(T1))
            .field("t2", &self.segments.len(T2))
            .field("open", &self.open.len())
            .field("t1_chunks", &self.t1_chunks)
            .field("chunks", &self.chunks)
            .field("b1", &self.ghosts.len(B1))
            .field("b2", &self.ghosts.len(B2))
            .field("target", &self.target)
            .finish()
    }
}

impl<S, K> SegmentPolicy<S, K> for SegmentArc<S, K>
where
    S: Hash + Eq + Clone + Send + SampleKey,
    K: Hash + Eq + Clone + Send + SampleKey,
{
    fn written(&mut self, segment: &S, key: &K) {
        let sealed = self.segments.find(segment);
        let tracked = self.len();
        if let Some(judge) = &mut self.judge {
            judge.written(segment, key, sealed.is_some(), tracked);
        }
        let returning = self.ghost_returns(key);
        match sealed {
            Some(id) => {
                // Sealed before this chunk's write was published.
                if self.segments.list_of(id) == T1 {
                    self.t1_chunks += 1;
                }
                self.segments.value_mut(id).chunks += 1;
                self.chunks += 1;
                if returning {
                    self.promote(id);
                }
            }
            None => {
                let open = self.open.entry(segment.clone()).or_default();
                open.chunks += 1;
                open.hot |= returning;
            }
        }
    }

    fn seal(&mut self, segment: S) {
        if self.segments.find(&segment).is_some() {
            return;
        }
        let Open { chunks, hot } = self.open.remove(&segment).unwrap_or_default();
        let list = if hot { T2 } else { T1 };
        let tick = self.tick();
        let tracked = self.len() + 1;
        if let Some(judge) = &mut self.judge {
            judge.seal(&segment, tracked);
        }
        self.segments.push_front_if_absent(list, segment, Sealed { tick, chunks });
        self.chunks += chunks;
        if list == T1 {
            self.t1_chunks += chunks;
        }
    }

    fn missed(&mut self, key: &K) {
        if let Some(judge) = &mut self.judge {
            judge.looked_up(key, self.chunks);
        }
    }

    fn hit(&mut self, segment: &S, key: &K) {
        if let Some(judge) = &mut self.judge {
            judge.looked_up(key, self.chunks);
        }
        match self.segments.find(segment) {
            Some(id) => self.promote(id),
            None => {
                if let Some(open) = self.open.get_mut(segment) {
                    open.hot = true;
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.segments.len(T1) + self.segments.len(T2)
    }

    fn contains(&self, segment: &S) -> bool {
        self.segments.find(segment).is_some()
    }

    fn order(&self) -> Order {
        self.mode().order()
    }

    fn follow(&mut self, order: JudgedOrder) {
        // Its own shadows are no longer read: they go, and with them their cost.
        self.judge = None;
        self.followed = Some(order);
    }

    fn evict<'c>(
        &mut self,
        eligible: &mut dyn FnMut(&S) -> bool,
        chunks: &dyn Fn(&S) -> &'c [K],
    ) -> Option<S>
    where
        K: 'c,
    {
        let tracked = self.len();
        if let Some(judge) = &mut self.judge {
            judge.choose(tracked);
        }
        let mode = self.mode();
        let t1 = self.first_eligible(T1, eligible);
        let t2 = self.first_eligible(T2, eligible);
        let from_t1 = match (t1, t2) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(a), Some(b)) => match mode {
                Mode::Arc => self.t1_chunks as f64 > self.target,
                // The segments' judge weighs recency against ARC only: it never chooses the
                // frequency order, which this policy does not keep.
                Mode::Recency | Mode::Frequency => {
                    self.segments.value(a).tick < self.segments.value(b).tick
                }
            },
        };
        let (id, ghost_list) = if from_t1 { (t1?, B1) } else { (t2?, B2) };
        let (segment, sealed) = self.segments.remove_node(id);
        self.chunks -= sealed.chunks;
        if from_t1 {
            self.t1_chunks -= sealed.chunks;
        }
        for key in chunks(&segment) {
            let (ghost, added) = self.ghosts.push_front_if_absent(ghost_list, key.clone(), ());
            if !added {
                self.ghosts.move_to_front(ghost, ghost_list);
            }
        }
        self.trim_ghosts();
        if let Some(judge) = &mut self.judge {
            judge.evicted(&segment);
        }
        Some(segment)
    }
}

/// The other shadow must lead by this fraction (and one hit) before the segments' order changes.
const SWITCH_MARGIN: f64 = 0.05;

/// The order after `mode` given the decayed hits of a recency shadow and an ARC shadow: it
/// changes when the other shadow leads by the margin (and one hit).
fn judged(mode: Mode, [recency, arc]: [f64; 2]) -> Mode {
    match mode {
        Mode::Arc if recency > arc * (1.0 + SWITCH_MARGIN) + 1.0 => Mode::Recency,
        Mode::Arc => Mode::Arc,
        _ if arc > recency * (1.0 + SWITCH_MARGIN) + 1.0 => Mode::Arc,
        _ => Mode::Recency,
    }
}

/// Chooses [`SegmentArc`]'s order: two shadow logs, one evicting in recency order and one in
/// ARC's, each given the chunks of one segment in four and room for a quarter of the segments,
/// count the lookups they would have served (decayed over about eight times the tracked chunks
/// of lookups); the order changes when the other shadow leads by [`SWITCH_MARGIN`]. (The
/// adaptive policy over keys judges by a sign test instead, [`Mode::judged`]. Over the disk's
/// segments, which see only the lookups L1 and L2 missed, that test kept recency where ARC
/// served more, 0.0327 against 0.0386 on the first 1,500 synthetic requests, and over the whole
/// traces the daemon's cascades read the same with either rule.)
/// The shadows sample whole segments, not chunks: what they model is the segments' order, and
/// which chunks share a segment decides that as much as the chunks do.
struct SegmentJudge<S, K> {
    /// Recency, then ARC's order.
    shadows: [ShadowLog<S, K>; 2],
    score: [f64; 2],
    mode: Mode,
    /// [`MIN_JUDGED`], lowered by tests that need the mode switch on a handful of segments.
    min_judged: usize,
}

impl<S, K> SegmentJudge<S, K>
where
    S: Hash + Eq + Clone + Send + SampleKey + 'static,
    K: Hash + Eq + Clone + Send + SampleKey + 'static,
{
    fn new() -> Self {
        SegmentJudge {
            shadows: [
                ShadowLog::new(Box::new(WholeSegments { policy: PolicyKind::Lru.build() })),
                ShadowLog::new(Box::new(SegmentArc::<S, K>::arc_only())),
            ],
            score: [0.0; 2],
            mode: Mode::Recency,
            min_judged: MIN_JUDGED,
        }
    }
}

impl<S, K> SegmentJudge<S, K>
where
    S: Hash + Eq + Clone + SampleKey,
    K: Hash + Eq + Clone,
{
    /// `key` was written into `segment`, which is `sealed` already or not, the log tracking
    /// `tracked` segments.
    fn written(&mut self, segment: &S, key: &K, sealed: bool, tracked: usize) {
        if sampled(segment) {
            let capacity = Self::capacity(tracked);
            for shadow in &mut self.shadows {
                shadow.written(segment, key, sealed, capacity);
            }
        }
    }

    /// `segment` is sealed, the log then tracking `tracked` segments.
    fn seal(&mut self, segment: &S, tracked: usize) {
        if sampled(segment) {
            let capacity = Self::capacity(tracked);
            self.shadows.iter_mut().for_each(|shadow| shadow.seal(segment, capacity));
        }
    }

    /// The log evicted `segment`.
    fn evicted(&mut self, segment: &S) {
        if sampled(segment) {
            self.shadows.iter_mut().for_each(|shadow| shadow.evicted(segment));
        }
    }

    /// A shadow's room, in segments, for a log tracking `tracked`.
    fn capacity(tracked: usize) -> usize {
        (tracked >> SAMPLE_SHIFT).max(1)
    }

    /// A lookup of `key` reached the log, which tracks `chunks` chunks.
    fn looked_up(&mut self, key: &K, chunks: usize) {
        for (shadow, score) in self.shadows.iter_mut().zip(&mut self.score) {
            if shadow.looked_up(key) {
                *score += 1.0;
            }
        }
        let keep = 1.0 - 1.0 / (SCORE_MEMORY * chunks.max(1) as f64);
        self.score = self.score.map(|s| s * keep);
    }

    /// The order for an eviction from a log tracking `tracked` segments.
    fn choose(&mut self, tracked: usize) -> Mode {
        self.mode =
            if tracked < self.min_judged { Mode::Recency } else { judged(self.mode, self.score) };
        self.mode
    }
}

/// A model of the log under one order, given the chunks of sampled segments only.
struct ShadowLog<S, K> {
    policy: Box<dyn SegmentPolicy<S, K>>,
    /// The chunks of each sampled segment the shadow holds, open or sealed.
    held: HashMap<S, Vec<K>>,
    /// The segment holding each chunk in the shadow.
    at: HashMap<K, S>,
    /// Sampled segments sealed before any of their chunks reached the shadow (the disk
    /// publishes records after their write, which may end after the seal): each enters the
    /// shadow sealed with its first chunk, or is forgotten when the log evicts it.
    sealed_empty: HashSet<S>,
}

impl<S, K> ShadowLog<S, K>
where
    S: Hash + Eq + Clone,
    K: Hash + Eq + Clone,
{
    fn new(policy: Box<dyn SegmentPolicy<S, K>>) -> Self {
        ShadowLog { policy, held: HashMap::new(), at: HashMap::new(), sealed_empty: HashSet::new() }
    }

    /// `key` was written into `segment`, which is `sealed` already or not: into its shadow,
    /// unless the shadow has evicted it. `capacity` is the shadow's room, in segments.
    fn written(&mut self, segment: &S, key: &K, sealed: bool, capacity: usize) {
        if self.at.contains_key(key) {
            return;
        }
        let seal = match self.held.get_mut(segment) {
            Some(chunks) => {
                chunks.push(key.clone());
                false
            }
            None if !sealed => {
                self.held.insert(segment.clone(), vec![key.clone()]);
                false
            }
            None if self.sealed_empty.remove(segment) => {
                self.held.insert(segment.clone(), vec![key.clone()]);
                true
            }
            None => return,
        };
        self.at.insert(key.clone(), segment.clone());
        self.policy.written(segment, key);
        if seal {
            self.seal_held(segment.clone(), capacity);
        }
    }

    /// Seals the shadow of `segment`, or, if none of its chunks reached the shadow yet, waits
    /// for the first.
    fn seal(&mut self, segment: &S, capacity: usize) {
        if self.held.contains_key(segment) {
            self.seal_held(segment.clone(), capacity);
        } else {
            self.sealed_empty.insert(segment.clone());
        }
    }

    /// The log evicted `segment`.
    fn evicted(&mut self, segment: &S) {
        self.sealed_empty.remove(segment);
    }

    /// Seals `segment`, which the shadow holds, then evicts down to `capacity` segments.
    fn seal_held(&mut self, segment: S, capacity: usize) {
        self.policy.seal(segment);
        while self.policy.len() > capacity {
            let held = &self.held;
            let chunks_of = |s: &S| held.get(s).map_or(&[][..], Vec::as_slice);
            let Some(victim) = self.policy.evict(&mut |_| true, &chunks_of) else {
                break;
            };
            for chunk in self.held.remove(&victim).unwrap_or_default() {
                self.at.remove(&chunk);
            }
        }
    }

    /// Whether the shadow holds `key`; if so, the lookup is a use of its segment.
    fn looked_up(&mut self, key: &K) -> bool {
        match self.at.get(key) {
            Some(segment) => {
                self.policy.hit(segment, key);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
impl<S: Hash + Eq + Clone, K: Hash + Eq + Clone> SegmentArc<S, K> {
    /// The number of ghosts.
    pub(super) fn ghosts(&self) -> usize {
        self.ghosts.len(B1) + self.ghosts.len(B2)
    }

    /// Lets the shadows choose the order from `segments` tracked segments on.
    pub(super) fn judging_from(mut self, segments: usize) -> Self {
        if let Some(judge) = &mut self.judge {
            judge.min_judged = segments;
        }
        self
    }
}
