//! The simulation's optimum really is one: on small random traces of prefix chains, Belady's
//! prefix hits equal those of an exhaustive search over every choice of what to keep after
//! every request, and no online policy hits more.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;
use tierkv_core::policy::PolicyKind;
use tierkv_replay::{Policy, Trace, TraceRequest, simulate};

/// Requests that share prefixes the way chat turns do: each extends a prefix of an earlier
/// request (or starts afresh) by up to three new chunks. Ids are prefix hashes, so a new chunk
/// gets a new id.
fn traces() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec((any::<prop::sample::Index>(), 0usize..4, 0usize..4), 1..9).prop_map(
        |steps| {
            let mut requests: Vec<Vec<u64>> = Vec::new();
            let mut next_id = 0u64;
            for (pick, keep, extend) in steps {
                let mut chunks = if requests.is_empty() {
                    Vec::new()
                } else {
                    let base = &requests[pick.index(requests.len())];
                    base[..keep.min(base.len())].to_vec()
                };
                for _ in 0..extend.max(usize::from(chunks.is_empty())) {
                    chunks.push(next_id);
                    next_id += 1;
                }
                requests.push(chunks);
            }
            requests
        },
    )
}

fn trace(requests: &[Vec<u64>]) -> Trace {
    Trace {
        name: "random".into(),
        chunk_tokens: 1,
        requests: requests
            .iter()
            .map(|chunks| TraceRequest {
                timestamp_ms: 0.0,
                chunks: chunks.clone(),
                tokens: chunks.len() as u64,
            })
            .collect(),
    }
}

/// The most prefix hits any cache of `capacity` chunks can score: after each request it may keep
/// any set of at most `capacity` chunks among those it held and those the request named.
fn exhaustive_optimum(requests: &[Vec<u64>], capacity: usize) -> u64 {
    fn best(
        requests: &[Vec<u64>],
        at: usize,
        cache: BTreeSet<u64>,
        capacity: usize,
        memo: &mut HashMap<(usize, BTreeSet<u64>), u64>,
    ) -> u64 {
        let Some(request) = requests.get(at) else { return 0 };
        if let Some(known) = memo.get(&(at, cache.clone())) {
            return *known;
        }
        let hits = request.iter().take_while(|c| cache.contains(c)).count() as u64;
        let candidates: Vec<u64> =
            cache.iter().chain(request).copied().collect::<BTreeSet<_>>().into_iter().collect();
        let mut most = 0;
        // Every subset of the candidates that fits.
        for mask in 0u32..(1 << candidates.len()) {
            if mask.count_ones() as usize > capacity {
                continue;
            }
            let kept: BTreeSet<u64> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, c)| *c)
                .collect();
            most = most.max(best(requests, at + 1, kept, capacity, memo));
        }
        memo.insert((at, cache), hits + most);
        hits + most
    }
    best(requests, 0, BTreeSet::new(), capacity, &mut HashMap::new())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn belady_is_the_optimum_and_bounds_every_policy(requests in traces(), capacity in 1usize..4) {
        let t = trace(&requests);
        let optimum = simulate(&t, Policy::Belady, Some(capacity), 1).hit_chunks;
        prop_assert_eq!(optimum, exhaustive_optimum(&requests, capacity), "{:?}", requests);
        for kind in PolicyKind::ALL {
            let online = simulate(&t, Policy::Online(kind), Some(capacity), 1).hit_chunks;
            prop_assert!(online <= optimum, "{:?} {} > {}", kind, online, optimum);
        }
        let popularity = simulate(&t, Policy::PopularityOracle, Some(capacity), 1).hit_chunks;
        prop_assert!(popularity <= optimum, "popularity oracle {} > {}", popularity, optimum);
    }
}
