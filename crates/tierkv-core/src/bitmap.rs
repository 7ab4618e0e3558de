//! A fixed-length bitmap: per-key answers of batched tier operations.

use std::fmt;

/// A fixed-length set of bits, bit `i` answering for key `i` of a batch.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Bitmap {
    words: Vec<u64>,
    len: usize,
}

impl Bitmap {
    /// `len` bits, all clear.
    pub fn new(len: usize) -> Self {
        Bitmap { words: vec![0; len.div_ceil(64)], len }
    }

    /// `len` bits, all set.
    pub fn full(len: usize) -> Self {
        let mut bitmap = Self::new(len);
        for i in 0..len {
            bitmap.set(i, true);
        }
        bitmap
    }

    /// Builds a bitmap from one bool per bit.
    pub fn from_bools(bits: impl IntoIterator<Item = bool>) -> Self {
        let mut bitmap = Bitmap::default();
        for bit in bits {
            bitmap.push(bit);
        }
        bitmap
    }

    /// The number of bits.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bitmap has no bits at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bit `i`; bits past the end read as clear.
    pub fn get(&self, i: usize) -> bool {
        i < self.len && self.words[i / 64] & (1 << (i % 64)) != 0
    }

    /// Sets bit `i` to `value`; a bit past the end is ignored and reported with `false`.
    pub fn set(&mut self, i: usize, value: bool) -> bool {
        if i >= self.len {
            return false;
        }
        let mask = 1 << (i % 64);
        if value {
            self.words[i / 64] |= mask;
        } else {
            self.words[i / 64] &= !mask;
        }
        true
    }

    /// Appends one bit.
    pub fn push(&mut self, value: bool) {
        if self.len.is_multiple_of(64) {
            self.words.push(0);
        }
        self.len += 1;
        self.set(self.len - 1, value);
    }

    /// The number of set bits.
    pub fn count_ones(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The length of the run of set bits that starts at bit 0: the prefix hit of a lookup.
    pub fn leading_ones(&self) -> usize {
        let mut run = 0;
        for word in &self.words {
            let ones = word.trailing_ones() as usize;
            run += ones;
            if ones < 64 {
                break;
            }
        }
        run.min(self.len)
    }

    /// Indices of the set bits, ascending.
    pub fn iter_ones(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len).filter(|i| self.get(*i))
    }

    /// Bitwise or with another bitmap of the same length; `false` (and no change) otherwise.
    pub fn union_with(&mut self, other: &Bitmap) -> bool {
        if self.len != other.len {
            return false;
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
        true
    }
}

impl fmt::Debug for Bitmap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits: String = (0..self.len).map(|i| if self.get(i) { '1' } else { '0' }).collect();
        write!(f, "Bitmap({bits})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_count_and_prefix_run() {
        let mut b = Bitmap::new(130);
        assert_eq!(b.count_ones(), 0);
        assert_eq!(b.leading_ones(), 0);
        for i in 0..70 {
            b.set(i, true);
        }
        b.set(100, true);
        assert_eq!(b.leading_ones(), 70);
        assert_eq!(b.count_ones(), 71);
        assert!(b.get(100) && !b.get(99) && !b.get(500));
        assert!(!b.set(130, true));
        assert_eq!(Bitmap::full(130).leading_ones(), 130);
        assert_eq!(Bitmap::full(64).leading_ones(), 64);
        assert_eq!(b.iter_ones().last(), Some(100));
    }

    #[test]
    fn push_union_and_debug() {
        let mut a = Bitmap::from_bools([true, false, true]);
        let b = Bitmap::from_bools([false, true, false]);
        assert!(a.union_with(&b));
        assert_eq!(a, Bitmap::full(3));
        assert!(!a.union_with(&Bitmap::new(4)));
        assert_eq!(format!("{b:?}"), "Bitmap(010)");
    }
}
