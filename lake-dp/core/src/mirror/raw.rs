//! The raw operations beneath a probe, which the benchmarks measure a
//! lookup against.

use super::MirrorReader;

impl MirrorReader {
    /// The raw operation beneath a probe, for benchmarks: loads each named
    /// bucket's words (no sequence check, no key compare) and sums their
    /// first word.
    #[doc(hidden)]
    pub fn raw_bucket_sum(&self, positions: &[u64]) -> u64 {
        let buckets = self.shared.header.buckets;
        positions.iter().map(|&p| u64::from(self.shared.bucket(p % buckets).peek().meta)).fold(0, u64::wrapping_add)
    }

    /// The raw latency beneath one cold probe, for benchmarks: `count`
    /// bucket loads, each address depending on the word loaded before (a
    /// chase, so no two overlap).
    #[doc(hidden)]
    pub fn raw_bucket_chase(&self, mut position: u64, count: usize) -> u64 {
        let buckets = self.shared.header.buckets;
        for step in 0..count as u64 {
            let word = self.shared.bucket(position % buckets).peek().words[2];
            position = position.wrapping_add(word | 1).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(step) >> 11;
        }
        position
    }
}
