//! ARC over a log's segments against a naive model of the same rules, and its scenarios.

use proptest::prelude::*;

use super::adaptive::{JudgedOrder, Mode};
use super::segments::SegmentArc;
use super::{Order, PolicyKind, SegmentPolicy};

/// Ghosts are kept up to this many times the tracked chunks.
const GHOST_FACTOR: usize = 3;

/// Whether a segment goes through the shadows: the adaptive policy's sampling, one in four.
fn sampled(segment: u64) -> bool {
    segment.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 62 == 0
}

/// ARC over segments written as plainly as possible: vectors, linear searches, oldest first. It
/// shares no code with [`SegmentArc`].
#[derive(Clone, Default)]
struct ModelArc {
    /// Sealed segments, oldest use first: (segment, tick, chunks).
    t1: Vec<(u64, u64, usize)>,
    t2: Vec<(u64, u64, usize)>,
    /// Segments not sealed: (segment, chunks, hot).
    open: Vec<(u64, usize, bool)>,
    /// Chunk ghosts, oldest first.
    b1: Vec<u32>,
    b2: Vec<u32>,
    target: f64,
    clock: u64,
}

impl ModelArc {
    fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }

    fn chunks(&self) -> usize {
        self.t1.iter().chain(&self.t2).map(|s| s.2).sum()
    }

    fn t1_chunks(&self) -> usize {
        self.t1.iter().map(|s| s.2).sum()
    }

    fn tracked(&self, segment: u64) -> bool {
        self.t1.iter().chain(&self.t2).any(|s| s.0 == segment)
    }

    /// Takes `segment` off `T1` or `T2`.
    fn take(&mut self, segment: u64) -> Option<(u64, u64, usize)> {
        for list in [&mut self.t1, &mut self.t2] {
            if let Some(at) = list.iter().position(|s| s.0 == segment) {
                return Some(list.remove(at));
            }
        }
        None
    }

    fn promote(&mut self, segment: u64) {
        if let Some((_, _, chunks)) = self.take(segment) {
            self.clock += 1;
            self.t2.push((segment, self.clock, chunks));
        }
    }

    fn written(&mut self, segment: u64, key: u32) {
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        let chunks = self.chunks() as f64;
        let returning = if let Some(at) = self.b1.iter().position(|k| *k == key) {
            self.b1.remove(at);
            self.target = (self.target + (b2 / b1).max(1.0)).min(chunks.max(1.0));
            true
        } else if let Some(at) = self.b2.iter().position(|k| *k == key) {
            self.b2.remove(at);
            self.target = (self.target - (b1 / b2).max(1.0)).max(0.0);
            true
        } else {
            false
        };
        if let Some(s) = self.t1.iter_mut().chain(&mut self.t2).find(|s| s.0 == segment) {
            s.2 += 1;
            if returning {
                self.promote(segment);
            }
            return;
        }
        match self.open.iter_mut().find(|o| o.0 == segment) {
            Some(open) => {
                open.1 += 1;
                open.2 |= returning;
            }
            None => self.open.push((segment, 1, returning)),
        }
    }

    fn seal(&mut self, segment: u64) {
        if self.tracked(segment) {
            return;
        }
        let (chunks, hot) = match self.open.iter().position(|o| o.0 == segment) {
            Some(at) => {
                let (_, chunks, hot) = self.open.remove(at);
                (chunks, hot)
            }
            None => (0, false),
        };
        self.clock += 1;
        let list = if hot { &mut self.t2 } else { &mut self.t1 };
        list.push((segment, self.clock, chunks));
    }

    fn hit(&mut self, segment: u64) {
        if self.tracked(segment) {
            self.promote(segment);
        } else if let Some(open) = self.open.iter_mut().find(|o| o.0 == segment) {
            open.2 = true;
        }
    }

    fn evict(
        &mut self,
        arc_order: bool,
        eligible: &dyn Fn(u64) -> bool,
        chunks_of: &dyn Fn(u64) -> Vec<u32>,
    ) -> Option<u64> {
        let a = self.t1.iter().position(|s| eligible(s.0));
        let b = self.t2.iter().position(|s| eligible(s.0));
        let from_t1 = match (a, b) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(_), Some(_)) if arc_order => self.t1_chunks() as f64 > self.target,
            (Some(a), Some(b)) => self.t1[a].1 < self.t2[b].1,
        };
        let segment = if from_t1 { self.t1.remove(a?).0 } else { self.t2.remove(b?).0 };
        for key in chunks_of(segment) {
            self.b1.retain(|k| *k != key);
            self.b2.retain(|k| *k != key);
            if from_t1 { self.b1.push(key) } else { self.b2.push(key) }
        }
        let bound = GHOST_FACTOR * self.chunks();
        while self.t1_chunks() + self.b1.len() > bound && !self.b1.is_empty() {
            self.b1.remove(0);
        }
        while self.b1.len() + self.b2.len() > bound && !self.b2.is_empty() {
            self.b2.remove(0);
        }
        Some(segment)
    }
}

/// LRU over segments, oldest use first.
#[derive(Default)]
struct ModelLru(Vec<u64>);

/// The order a shadow log keeps.
enum ShadowOrder {
    Recency(ModelLru),
    Arc(ModelArc),
}

/// A shadow log: the sampled segments it holds, and their chunks.
struct ModelShadow {
    order: ShadowOrder,
    /// (sampled segment, its chunks) of each segment the shadow holds.
    held: Vec<(u64, Vec<u32>)>,
    /// Sampled segments sealed before any chunk reached the shadow.
    sealed_empty: Vec<u64>,
}

impl ModelShadow {
    fn new(order: ShadowOrder) -> Self {
        ModelShadow { order, held: Vec::new(), sealed_empty: Vec::new() }
    }

    fn holder(&self, key: u32) -> Option<u64> {
        self.held.iter().find(|h| h.1.contains(&key)).map(|h| h.0)
    }

    fn written(&mut self, segment: u64, key: u32, sealed: bool, capacity: usize) {
        if self.holder(key).is_some() {
            return;
        }
        let mut seal = false;
        match self.held.iter_mut().find(|h| h.0 == segment) {
            Some(held) => held.1.push(key),
            None if sealed && !self.sealed_empty.contains(&segment) => return,
            None => {
                seal = sealed;
                self.sealed_empty.retain(|s| *s != segment);
                self.held.push((segment, vec![key]));
            }
        }
        if let ShadowOrder::Arc(arc) = &mut self.order {
            arc.written(segment, key);
        }
        if seal {
            self.seal_held(segment, capacity);
        }
    }

    fn seal(&mut self, segment: u64, capacity: usize) {
        if self.held.iter().any(|h| h.0 == segment) {
            self.seal_held(segment, capacity);
        } else {
            self.sealed_empty.push(segment);
        }
    }

    fn seal_held(&mut self, segment: u64, capacity: usize) {
        match &mut self.order {
            ShadowOrder::Recency(lru) => {
                if !lru.0.contains(&segment) {
                    lru.0.push(segment);
                }
            }
            ShadowOrder::Arc(arc) => arc.seal(segment),
        }
        loop {
            let len = match &self.order {
                ShadowOrder::Recency(lru) => lru.0.len(),
                ShadowOrder::Arc(arc) => arc.len(),
            };
            if len <= capacity {
                return;
            }
            let held = self.held.clone();
            let chunks_of = |segment: u64| {
                held.iter().find(|h| h.0 == segment).map(|h| h.1.clone()).unwrap_or_default()
            };
            let victim = match &mut self.order {
                ShadowOrder::Recency(lru) => Some(lru.0.remove(0)),
                ShadowOrder::Arc(arc) => arc.evict(true, &|_| true, &chunks_of),
            };
            self.held.retain(|h| Some(h.0) != victim);
        }
    }

    fn looked_up(&mut self, key: u32) -> bool {
        let Some(segment) = self.holder(key) else {
            return false;
        };
        match &mut self.order {
            ShadowOrder::Recency(lru) => {
                if let Some(at) = lru.0.iter().position(|s| *s == segment) {
                    lru.0.remove(at);
                    lru.0.push(segment);
                }
            }
            ShadowOrder::Arc(arc) => arc.hit(segment),
        }
        true
    }
}

/// The judged policy: the model ARC and, unless it always follows ARC, a judge of two shadows.
struct Model {
    arc: ModelArc,
    /// The recency shadow, the ARC shadow.
    shadows: Option<[ModelShadow; 2]>,
    score: [f64; 2],
    arc_order: bool,
    min_judged: usize,
}

impl Model {
    fn new(judged: bool, min_judged: usize) -> Self {
        let shadows = judged.then(|| {
            [
                ModelShadow::new(ShadowOrder::Recency(ModelLru::default())),
                ModelShadow::new(ShadowOrder::Arc(ModelArc::default())),
            ]
        });
        Model { arc: ModelArc::default(), shadows, score: [0.0; 2], arc_order: !judged, min_judged }
    }

    fn written(&mut self, segment: u64, key: u32) {
        if let Some(shadows) = &mut self.shadows
            && sampled(segment)
        {
            let sealed = self.arc.tracked(segment);
            let capacity = (self.arc.len() >> 2).max(1);
            shadows.iter_mut().for_each(|s| s.written(segment, key, sealed, capacity));
        }
        self.arc.written(segment, key);
    }

    fn seal(&mut self, segment: u64) {
        if self.arc.tracked(segment) {
            return;
        }
        let capacity = ((self.arc.len() + 1) >> 2).max(1);
        if let Some(shadows) = &mut self.shadows
            && sampled(segment)
        {
            shadows.iter_mut().for_each(|s| s.seal(segment, capacity));
        }
        self.arc.seal(segment);
    }

    fn looked_up(&mut self, key: u32) {
        let Some(shadows) = &mut self.shadows else {
            return;
        };
        for (shadow, score) in shadows.iter_mut().zip(&mut self.score) {
            if shadow.looked_up(key) {
                *score += 1.0;
            }
        }
        let keep = 1.0 - 1.0 / (8.0 * self.arc.chunks().max(1) as f64);
        self.score = self.score.map(|s| s * keep);
    }

    fn evict(
        &mut self,
        eligible: &dyn Fn(u64) -> bool,
        chunks_of: &dyn Fn(u64) -> Vec<u32>,
    ) -> Option<u64> {
        let victim = self.choose_and_evict(eligible, chunks_of);
        if let (Some(shadows), Some(victim)) = (&mut self.shadows, victim) {
            shadows.iter_mut().for_each(|s| s.sealed_empty.retain(|e| *e != victim));
        }
        victim
    }

    fn choose_and_evict(
        &mut self,
        eligible: &dyn Fn(u64) -> bool,
        chunks_of: &dyn Fn(u64) -> Vec<u32>,
    ) -> Option<u64> {
        if self.shadows.is_some() {
            let [recency, arc] = self.score;
            self.arc_order = if self.arc.len() < self.min_judged {
                false
            } else if self.arc_order {
                recency <= arc * (1.0 + 0.05) + 1.0
            } else {
                arc > recency * (1.0 + 0.05) + 1.0
            };
        }
        self.arc.evict(self.arc_order, eligible, chunks_of)
    }
}

/// What the log does, as the disk store calls its policy.
#[derive(Clone, Debug)]
enum Op {
    /// Writes the chunk into the open segment (opening one if none is).
    Write(u32),
    /// Writes the chunk into the segment sealed last, if it is still stored: a record published
    /// after its segment was sealed.
    WriteLate(u32),
    /// Seals the open segment, or an empty new one.
    Seal,
    /// Looks the chunk up: a hit on its segment, or a miss.
    Lookup(u32),
    /// Evicts one segment among those whose number's low three bits are set in the mask.
    Evict(u8),
}

fn op(keys: u32, late: bool) -> impl Strategy<Value = Op> {
    let late_weight = if late { 1 } else { 0 };
    prop_oneof![
        6 => (0..keys).prop_map(Op::Write),
        late_weight => (0..keys).prop_map(Op::WriteLate),
        2 => Just(Op::Seal),
        5 => (0..keys).prop_map(Op::Lookup),
        2 => any::<u8>().prop_map(|m| Op::Evict(m | 1)),
    ]
}

/// The log's contents, driving a policy and returning what each eviction chose.
#[derive(Default)]
struct Log {
    /// (segment, its chunks) of every segment stored, open or sealed.
    segments: Vec<(u64, Vec<u32>)>,
    open: Option<u64>,
    sealed_last: Option<u64>,
    numbered: u64,
}

impl Log {
    fn holder(&self, key: u32) -> Option<u64> {
        self.segments.iter().find(|s| s.1.contains(&key)).map(|s| s.0)
    }

    fn chunks_of(&self, segment: u64) -> Vec<u32> {
        self.segments.iter().find(|s| s.0 == segment).map(|s| s.1.clone()).unwrap_or_default()
    }

    /// Applies `op` to the policy and the model alike; returns the victims of an eviction.
    fn apply(
        &mut self,
        op: &Op,
        policy: &mut dyn SegmentPolicy<u64, u32>,
        model: &mut Model,
    ) -> Option<(Option<u64>, Option<u64>)> {
        match *op {
            Op::Write(key) if self.holder(key).is_none() => {
                let segment = *self.open.get_or_insert_with(|| {
                    self.numbered += 1;
                    self.numbered
                });
                match self.segments.iter_mut().find(|s| s.0 == segment) {
                    Some(s) => s.1.push(key),
                    None => self.segments.push((segment, vec![key])),
                }
                policy.written(&segment, &key);
                model.written(segment, key);
            }
            Op::WriteLate(key) if self.holder(key).is_none() => {
                let stored = self.sealed_last.and_then(|last| {
                    self.segments.iter_mut().find(|s| s.0 == last).map(|s| (last, &mut s.1))
                });
                if let Some((segment, chunks)) = stored {
                    chunks.push(key);
                    policy.written(&segment, &key);
                    model.written(segment, key);
                }
            }
            Op::Seal => {
                // With no segment open, a new one is sealed empty: its records publish later.
                let segment = self.open.take().unwrap_or_else(|| {
                    self.numbered += 1;
                    self.segments.push((self.numbered, Vec::new()));
                    self.numbered
                });
                policy.seal(segment);
                model.seal(segment);
                self.sealed_last = Some(segment);
            }
            Op::Lookup(key) => match self.holder(key) {
                Some(segment) => {
                    policy.hit(&segment, &key);
                    model.looked_up(key);
                    model.arc.hit(segment);
                }
                None => {
                    policy.missed(&key);
                    model.looked_up(key);
                }
            },
            Op::Evict(mask) => {
                let eligible = |s: u64| mask & (1 << (s % 8)) != 0;
                let contents = self.segments.clone();
                let chunks: Vec<(u64, Vec<u32>)> = contents;
                let chunks_ref =
                    |s: &u64| chunks.iter().find(|c| c.0 == *s).map_or(&[][..], |c| c.1.as_slice());
                let got = policy.evict(&mut |s| eligible(*s), &chunks_ref);
                let want = model.evict(&eligible, &|s| self.chunks_of(s));
                if let Some(victim) = got {
                    self.segments.retain(|s| s.0 != victim);
                }
                return Some((got, want));
            }
            Op::Write(_) | Op::WriteLate(_) => {}
        }
        None
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Always in ARC's order: every victim as the model's, the ghosts within their bound.
    #[test]
    fn arc_over_segments_follows_the_model(ops in proptest::collection::vec(op(40, true), 1..300)) {
        let mut policy = SegmentArc::<u64, u32>::arc_only();
        let mut model = Model::new(false, 0);
        let mut log = Log::default();
        for op in &ops {
            if let Some((got, want)) = log.apply(op, &mut policy, &mut model) {
                prop_assert_eq!(got, want, "after {:?}", op);
            }
            prop_assert_eq!(policy.len(), model.arc.len(), "after {:?}", op);
            prop_assert!(
                policy.ghosts() <= GHOST_FACTOR * model.arc.chunks(),
                "after {:?}: {} ghosts",
                op,
                policy.ghosts()
            );
        }
    }

    /// Judged by shadow logs from two segments on: every victim and every choice of order as
    /// the model's.
    #[test]
    fn judged_arc_over_segments_follows_the_model(
        ops in proptest::collection::vec(op(64, true), 1..400),
    ) {
        let mut policy = SegmentArc::<u64, u32>::new().judging_from(2);
        let mut model = Model::new(true, 2);
        let mut log = Log::default();
        for op in &ops {
            if let Some((got, want)) = log.apply(op, &mut policy, &mut model) {
                prop_assert_eq!(got, want, "after {:?}", op);
                prop_assert_eq!(
                    policy.order() == Order::Arc,
                    model.arc_order,
                    "after {:?}: {:?} against {:?}",
                    op,
                    policy,
                    model.score
                );
            }
        }
    }

    /// Below the segments it takes to judge, the adaptive kind is LRU over segments (records
    /// published after their segment's seal aside: a ghost among them is a use here).
    #[test]
    fn few_segments_are_evicted_in_lru_order(ops in proptest::collection::vec(op(40, false), 1..200)) {
        let mut adaptive = PolicyKind::Adaptive.build_for_segments::<u64, u32>();
        let mut lru = PolicyKind::Lru.build_for_segments::<u64, u32>();
        let (mut log_a, mut log_l) = (Log::default(), Log::default());
        let (mut model_a, mut model_l) = (Model::new(true, 64), Model::new(true, 64));
        for op in &ops {
            let a = log_a.apply(op, adaptive.as_mut(), &mut model_a).map(|v| v.0);
            let l = log_l.apply(op, lru.as_mut(), &mut model_l).map(|v| v.0);
            prop_assert_eq!(a, l, "after {:?}", op);
        }
    }
}

/// Evicts every segment of `policy`, each eligible, in its order.
fn drain(policy: &mut SegmentArc<u64, u32>, log: &[(u64, Vec<u32>)]) -> Vec<u64> {
    let chunks = |s: &u64| log.iter().find(|c| c.0 == *s).map_or(&[][..], |c| c.1.as_slice());
    std::iter::from_fn(|| policy.evict(&mut |_| true, &chunks)).collect()
}

/// Seals `segment` holding `keys`.
fn store(policy: &mut SegmentArc<u64, u32>, segment: u64, keys: &[u32]) {
    for key in keys {
        policy.written(&segment, key);
    }
    policy.seal(segment);
}

#[test]
fn a_chunk_back_from_a_ghost_seals_its_segment_onto_t2_where_it_outlives_newer_segments() {
    // Segments 1 {a} and 2 {b}; 1 goes, `a` becomes a ghost. Segment 3 then takes `a` back
    // (or, for comparison, a chunk never seen) and 4 and 5 follow.
    let (a, b, c, d, fresh) = (1, 2, 3, 4, 99);
    let order_with = |third: u32| {
        let mut policy = SegmentArc::<u64, u32>::arc_only();
        let log = vec![(1, vec![a]), (2, vec![b]), (3, vec![third]), (4, vec![c]), (5, vec![d])];
        store(&mut policy, 1, &[a]);
        store(&mut policy, 2, &[b]);
        assert_eq!(drain_one(&mut policy, &log), Some(1));
        store(&mut policy, 3, &[third]);
        store(&mut policy, 4, &[c]);
        store(&mut policy, 5, &[d]);
        drain(&mut policy, &log)
    };
    // The ghost's return put 3 on T2 and let T1 keep one chunk: 3 outlives 4.
    assert_eq!(order_with(a), vec![2, 4, 3, 5]);
    // A chunk never seen leaves 3 on T1, evicted in its turn.
    assert_eq!(order_with(fresh), vec![2, 3, 4, 5]);
}

/// Evicts one segment of `policy`, any being eligible.
fn drain_one(policy: &mut SegmentArc<u64, u32>, log: &[(u64, Vec<u32>)]) -> Option<u64> {
    let chunks = |s: &u64| log.iter().find(|c| c.0 == *s).map_or(&[][..], |c| c.1.as_slice());
    policy.evict(&mut |_| true, &chunks)
}

#[test]
fn ineligible_segments_are_skipped_and_stay_tracked() {
    let mut policy = SegmentArc::<u64, u32>::arc_only();
    let log = [(1, vec![1]), (2, vec![2])];
    store(&mut policy, 1, &[1]);
    store(&mut policy, 2, &[2]);
    let chunks = |s: &u64| log.iter().find(|c| c.0 == *s).map_or(&[][..], |c| c.1.as_slice());
    assert_eq!(policy.evict(&mut |s| *s != 1, &chunks), Some(2));
    assert!(policy.contains(&1));
    assert_eq!(policy.evict(&mut |_| false, &chunks), None);
    assert_eq!(policy.len(), 1);
}

#[test]
fn segment_arc_follows_a_judged_order_over_its_own() {
    // Segments 1 and 2 sealed, 1 hit (onto T2), then 3 sealed: recency drops 2, 1, 3; ARC
    // (T1 over its target of nothing) drops 2, 3, 1.
    let victims = |order: Option<Mode>| {
        let mut policy = SegmentArc::<u64, u32>::new();
        let judged = order.map(JudgedOrder::fixed);
        if let Some(judged) = &judged {
            policy.follow(judged.clone());
        }
        for segment in [1u64, 2] {
            policy.written(&segment, &(segment as u32));
            policy.seal(segment);
        }
        policy.hit(&1, &1);
        policy.written(&3, &3);
        policy.seal(3);
        let order = policy.order();
        let chunks = |s: &u64| -> &'static [u32] {
            match s {
                1 => &[1],
                2 => &[2],
                _ => &[3],
            }
        };
        let dropped: Vec<u64> =
            std::iter::from_fn(|| policy.evict(&mut |_| true, &chunks)).collect();
        (order, dropped)
    };
    assert_eq!(victims(Some(Mode::Recency)), (Order::Recency, vec![2, 1, 3]));
    assert_eq!(victims(Some(Mode::Arc)), (Order::Arc, vec![2, 3, 1]));
    // The frequency order is not kept over segments: ARC's stands in for it.
    assert_eq!(victims(Some(Mode::Frequency)), (Order::Arc, vec![2, 3, 1]));
    // Its own judge, with three segments to judge by, says recency.
    assert_eq!(victims(None), (Order::Recency, vec![2, 1, 3]));
}
