//! S3-FIFO placeholder: behaves as FIFO-LRU until written.

use std::collections::VecDeque;

use super::EvictionPolicy;

/// S3-FIFO.
#[derive(Debug)]
pub struct S3Fifo<K> {
    order: VecDeque<K>,
}

impl<K> S3Fifo<K> {
    /// An empty policy.
    pub fn new() -> Self {
        S3Fifo { order: VecDeque::new() }
    }
}

impl<K> Default for S3Fifo<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: PartialEq + Clone + Send> EvictionPolicy<K> for S3Fifo<K> {
    fn insert(&mut self, key: K) {
        if !self.order.contains(&key) {
            self.order.push_back(key);
        }
    }

    fn touch(&mut self, key: &K) {
        if let Some(pos) = self.order.iter().position(|k| k == key)
            && let Some(k) = self.order.remove(pos)
        {
            self.order.push_back(k);
        }
    }

    fn remove(&mut self, key: &K) -> bool {
        match self.order.iter().position(|k| k == key) {
            Some(pos) => self.order.remove(pos).is_some(),
            None => false,
        }
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    fn contains(&self, key: &K) -> bool {
        self.order.contains(key)
    }

    fn evict(&mut self, n: usize, eligible: &mut dyn FnMut(&K) -> bool) -> Vec<K> {
        let mut victims = Vec::new();
        let mut i = 0;
        while victims.len() < n && i < self.order.len() {
            if eligible(&self.order[i]) {
                if let Some(k) = self.order.remove(i) {
                    victims.push(k);
                }
            } else {
                i += 1;
            }
        }
        victims
    }
}
