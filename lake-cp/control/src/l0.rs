//! L0: blocks engines hold in their own GPU memory, as they report them.
//!
//! Advisory only (DESIGN §3): the engine owns its HBM, so Lake never
//! leases, places or evicts these replicas; it remembers which engine (an
//! agent's connection) has which keys, so a request can be routed to the
//! engine that already holds its prefix (the D-direct route).
//! Entries go when the agent reports them gone or its connection closes.
//! Bounded per engine: a report past the bound is refused and counted,
//! never grown into.

use std::collections::{HashMap, HashSet};

use lake_dp::BlockKey;

/// Keys one engine may have resident at most.
pub const KEYS_PER_ENGINE_MAX: usize = 1 << 22;

/// The advisory L0 table of one node.
#[derive(Debug, Default)]
pub struct L0 {
    /// Engines holding each key.
    holders: HashMap<BlockKey, Vec<u64>>,
    /// Keys each engine holds.
    by_engine: HashMap<u64, HashSet<BlockKey>>,
    /// Reports applied.
    pub reports: u64,
    /// Keys refused (an engine over its bound).
    pub refused: u64,
}

impl L0 {
    /// Engine `peer` now holds `keys` (`resident`), or no longer does.
    pub fn report(&mut self, peer: u64, keys: impl IntoIterator<Item = BlockKey>, resident: bool) {
        self.reports += 1;
        let held = self.by_engine.entry(peer).or_default();
        for key in keys {
            if resident {
                if held.len() >= KEYS_PER_ENGINE_MAX && !held.contains(&key) {
                    self.refused += 1;
                    continue;
                }
                if held.insert(key) {
                    self.holders.entry(key).or_default().push(peer);
                }
            } else if held.remove(&key) {
                remove_holder(&mut self.holders, &key, peer);
            }
        }
        if held.is_empty() {
            self.by_engine.remove(&peer);
        }
    }

    /// Engine `peer` is gone: everything it held goes.
    pub fn engine_gone(&mut self, peer: u64) -> usize {
        let Some(held) = self.by_engine.remove(&peer) else { return 0 };
        for key in &held {
            remove_holder(&mut self.holders, key, peer);
        }
        held.len()
    }

    /// The engines holding `key`.
    pub fn holders(&self, key: &BlockKey) -> &[u64] {
        self.holders.get(key).map_or(&[], Vec::as_slice)
    }

    /// Distinct keys held by some engine.
    pub fn blocks(&self) -> usize {
        self.holders.len()
    }

    /// Engines holding anything.
    pub fn engines(&self) -> usize {
        self.by_engine.len()
    }
}

fn remove_holder(holders: &mut HashMap<BlockKey, Vec<u64>>, key: &BlockKey, peer: u64) {
    if let Some(list) = holders.get_mut(key) {
        list.retain(|&p| p != peer);
        if list.is_empty() {
            holders.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    #[test]
    fn engines_report_keys_and_lose_them_on_leaving() {
        let mut l0 = L0::default();
        l0.report(1, [key(1), key(2)], true);
        l0.report(2, [key(2), key(3)], true);
        assert_eq!(l0.holders(&key(2)), &[1, 2]);
        assert_eq!((l0.blocks(), l0.engines()), (3, 2));
        l0.report(1, [key(2)], true);
        assert_eq!(l0.holders(&key(2)), &[1, 2], "a repeated report counts once");
        l0.report(1, [key(1)], false);
        assert!(l0.holders(&key(1)).is_empty());
        assert_eq!(l0.engine_gone(2), 2);
        assert_eq!(l0.holders(&key(2)), &[1]);
        assert!(l0.holders(&key(3)).is_empty());
        assert_eq!((l0.blocks(), l0.engines()), (1, 1));
        l0.report(1, [key(2)], false);
        assert_eq!((l0.blocks(), l0.engines()), (0, 0), "nothing left behind");
        assert_eq!(l0.engine_gone(9), 0);
    }
}
