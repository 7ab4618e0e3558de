//! How a store larger than L1 is taken: in windows, each made visible before the next is
//! reserved, so L1 can hand the earlier ones down to the tiers below. The daemon's sessions and
//! the replay's simulation both size windows here, so the two stay in step.

/// The most chunks one store reserves in L1 at a time when tiers below L1 exist: an eighth of
/// L1's slots, at least one. An eighth, not all of L1, so that several writers (the ranks of a
/// tensor-parallel group storing one long prompt each) can each have a window reserved at once.
pub fn store_window(l1_slots: usize) -> usize {
    (l1_slots / 8).max(1)
}

#[cfg(test)]
mod tests {
    use super::store_window;

    #[test]
    fn a_window_is_an_eighth_of_l1_and_never_empty() {
        assert_eq!(store_window(1000), 125);
        assert_eq!(store_window(32), 4);
        assert_eq!(store_window(7), 1);
        assert_eq!(store_window(0), 1);
    }
}
