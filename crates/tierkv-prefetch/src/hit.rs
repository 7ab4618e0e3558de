//! The hit of a lookup across KV-cache groups (ARCHITECTURE §5, hybrid models).
//!
//! A lookup may carry keys for several groups. A full-attention group needs every chunk before
//! the hit; a sliding-window group of `w` tokens needs only the chunks covering the `w` tokens
//! before it. The hit is the largest chunk boundary `n` at which every group has what it needs.
//! With one full-attention group this is the leading run of present chunks.

/// How a KV-cache group attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Every earlier token: every chunk before the hit is needed.
    FullAttention,
    /// The last `window_tokens` tokens: only the chunks covering them are needed.
    SlidingWindow {
        /// The window, in tokens.
        window_tokens: u64,
    },
}

impl GroupKind {
    /// The chunk indices a group of this kind needs for a hit of `n` chunks of `chunk_tokens`.
    pub fn needed(self, n: usize, chunk_tokens: u64) -> std::ops::Range<usize> {
        match self {
            GroupKind::FullAttention => 0..n,
            GroupKind::SlidingWindow { window_tokens } => {
                let end_token = n as u64 * chunk_tokens;
                let first_token = end_token.saturating_sub(window_tokens);
                let first = (first_token / chunk_tokens.max(1)) as usize;
                first.min(n)..n
            }
        }
    }
}

/// The largest `n` (in chunks) such that every group has every chunk it needs before `n`.
/// `present[g][i]` says whether chunk `i` of group `g` is available; `n` never exceeds the
/// shortest group.
///
/// Linear in the chunks: every range a group needs ends at `n`, so it is whole when the run of
/// present chunks ending at `n - 1` is at least as long (a lookup names up to a million chunks,
/// and this runs under the lookups' lock).
pub fn hit_chunks(groups: &[(GroupKind, &[bool])], chunk_tokens: u64) -> usize {
    let longest = groups.iter().map(|(_, p)| p.len()).min().unwrap_or(0);
    // For each group, the length of the run of present chunks ending at each index.
    let runs: Vec<Vec<usize>> = groups
        .iter()
        .map(|(_, present)| {
            let mut run = 0;
            present
                .iter()
                .map(|&here| {
                    run = if here { run + 1 } else { 0 };
                    run
                })
                .collect()
        })
        .collect();
    (1..=longest)
        .rev()
        .find(|&n| {
            groups.iter().zip(&runs).all(|((kind, _), run)| {
                let needed = kind.needed(n, chunk_tokens);
                needed.is_empty() || run.get(needed.end - 1).is_some_and(|&r| r >= needed.len())
            })
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: GroupKind = GroupKind::FullAttention;

    fn window(tokens: u64) -> GroupKind {
        GroupKind::SlidingWindow { window_tokens: tokens }
    }

    #[test]
    fn one_full_attention_group_is_the_leading_run() {
        assert_eq!(hit_chunks(&[(FULL, &[true, true, false, true])], 256), 2);
        assert_eq!(hit_chunks(&[(FULL, &[false, true])], 256), 0);
        assert_eq!(hit_chunks(&[(FULL, &[true; 5])], 256), 5);
        assert_eq!(hit_chunks(&[(FULL, &[])], 256), 0);
        assert_eq!(hit_chunks(&[], 256), 0);
    }

    #[test]
    fn a_sliding_window_needs_only_the_chunks_in_its_window() {
        // Window of 2 chunks: for a hit of 5 only chunks 3 and 4 matter.
        let w = window(512);
        assert_eq!(w.needed(5, 256), 3..5);
        assert_eq!(w.needed(1, 256), 0..1);
        assert_eq!(w.needed(0, 256), 0..0);
        assert_eq!(hit_chunks(&[(w, &[false, false, false, true, true])], 256), 5);
        // A window that is not a whole number of chunks still needs the partly covered chunk.
        assert_eq!(window(300).needed(4, 256), 2..4);
    }

    #[test]
    fn groups_agree_on_one_hit() {
        let full = [true, true, true, true, false];
        let sliding = [false, false, true, true, true];
        // Full attention allows up to 4; the window of 2 chunks at 4 needs chunks 2 and 3: present.
        assert_eq!(hit_chunks(&[(FULL, &full), (window(512), &sliding)], 256), 4);
        // Without chunk 3 in the sliding group, 4 fails (needs 2,3), 3 fails (needs 1,2), 2 fails
        // (needs 0,1), 1 fails (needs 0): no hit.
        let sliding = [false, false, true, false, true];
        assert_eq!(hit_chunks(&[(FULL, &full), (window(512), &sliding)], 256), 0);
    }

    /// The definition, chunk by chunk: quadratic, kept to check the linear one against.
    fn by_definition(groups: &[(GroupKind, &[bool])], chunk_tokens: u64) -> usize {
        let longest = groups.iter().map(|(_, p)| p.len()).min().unwrap_or(0);
        (1..=longest)
            .rev()
            .find(|n| groups.iter().all(|(kind, p)| kind.needed(*n, chunk_tokens).all(|i| p[i])))
            .unwrap_or(0)
    }

    proptest::proptest! {
        #[test]
        fn the_hit_is_the_definitions_for_any_groups(
            full in proptest::collection::vec(proptest::bool::weighted(0.8), 0..40),
            sliding in proptest::collection::vec(proptest::bool::weighted(0.7), 0..40),
            window_tokens in 1u64..2000,
            chunk_tokens in 1u64..300,
        ) {
            let w = window(window_tokens);
            for groups in [
                vec![(FULL, full.as_slice())],
                vec![(w, sliding.as_slice())],
                vec![(FULL, full.as_slice()), (w, sliding.as_slice())],
            ] {
                proptest::prop_assert_eq!(
                    hit_chunks(&groups, chunk_tokens),
                    by_definition(&groups, chunk_tokens)
                );
            }
        }
    }
}
