//! Pins: how an agent keeps a slot from being reused while it reads it,
//! without a round trip to `lake-dp` (DESIGN §3).
//!
//! Each agent owns one record of pin entries in the arena and is its only
//! writer. To read slot `s` that the mirror says holds generation `g`:
//!
//! 1. write `(s, g)` into a free entry of its own record;
//! 2. a SeqCst fence;
//! 3. re-read the slot's generation: equal to `g` → pinned, read away;
//!    different → the slot was retired, clear the entry (a miss).
//!
//! `lake-dp` frees a slot the mirror image way ([`super::SlotTable`]): bump
//! the generation, a SeqCst fence, then scan every record. The two fences
//! make this Dekker's store-buffer pattern: whatever the timing, either the
//! scan sees the pin or the agent sees the new generation, never neither.
//! Clearing an entry is a Release store that the scan reads with Acquire,
//! so every read the agent made of the slot happens before `lake-dp`
//! writes it again.

use core::sync::atomic::{Ordering, fence};
use std::sync::Arc;

use super::{Arena, ArenaError};
use crate::region::SlotRegion;

/// The entry value naming `(slot, generation)`; 0 is an empty entry.
#[inline]
pub(super) fn encode(slot: u32, generation: u32) -> u64 {
    debug_assert!(slot < u32::MAX);
    (u64::from(slot) + 1) << 32 | u64::from(generation)
}

/// The `(slot, generation)` an entry names, or `None` for an empty one.
#[inline]
#[allow(clippy::cast_possible_truncation)] // the two halves of a u64
pub(super) fn decode(entry: u64) -> Option<(u32, u32)> {
    let slot_plus_one = (entry >> 32) as u32;
    let generation = entry as u32;
    slot_plus_one.checked_sub(1).map(|slot| (slot, generation))
}

/// Why a pin was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinError {
    /// The slot no longer holds that generation: the block was evicted (or
    /// the mirror entry was stale). Treat as a miss.
    Stale {
        /// The slot's generation now.
        current: u32,
    },
    /// Every entry of this agent's record is in use.
    Full,
    /// No such slot.
    OutOfRange,
}

impl core::fmt::Display for PinError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Stale { current } => write!(f, "pin: the slot moved on to generation {current}"),
            Self::Full => write!(f, "pin: every pin entry of this agent is in use"),
            Self::OutOfRange => write!(f, "pin: no such slot"),
        }
    }
}

impl std::error::Error for PinError {}

/// A held pin: the slot cannot be reused until it is given back to
/// [`PinArray::unpin`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pin keeps its slot from reuse until unpinned"]
pub struct Pin {
    slot: u32,
    generation: u32,
    entry: u32,
    agent: u32,
}

impl Pin {
    /// The pinned slot.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Its generation.
    pub fn generation(&self) -> u32 {
        self.generation
    }
}

/// An agent's claimed record: the only writer of its pin entries.
pub struct PinArray {
    arena: Arena,
    region: Arc<SlotRegion>,
    agent: u32,
    owner: u64,
    /// Free entry indices, popped from the end (lowest first).
    free: Vec<u32>,
    held: u32,
    high_water: u32,
}

impl core::fmt::Debug for PinArray {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PinArray").field("agent", &self.agent).field("pinned", &self.pinned()).finish()
    }
}

impl PinArray {
    pub(super) fn claim(arena: Arena) -> Result<Self, ArenaError> {
        let map = arena.map();
        let header = *map.header();
        let sequence = map.control().claims.fetch_add(1, Ordering::Relaxed);
        let owner = u64::from(std::process::id()) << 32 | u64::from(sequence);
        debug_assert_ne!(owner, 0);
        for agent in 0..header.agents_max {
            let record = map.agent(agent);
            // Acquire: pairs with the Release that freed the record, so the
            // entries its last owner (or lake-dp) cleared read as cleared.
            if record.owner.compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed).is_err() {
                continue;
            }
            // The record is ours alone now; leftovers cannot name a live
            // pin of anyone, so clear them for a clean scan.
            let high = record.high_water.load(Ordering::Relaxed).min(header.pins_per_agent);
            for entry in 0..high {
                map.pin(agent, entry).store(0, Ordering::Release);
            }
            record.high_water.store(0, Ordering::Release);
            let region = arena.region()?;
            let free = (0..header.pins_per_agent).rev().collect();
            return Ok(Self { arena, region, agent, owner, free, held: 0, high_water: 0 });
        }
        Err(ArenaError::AgentsFull)
    }

    /// This agent's record index.
    pub fn agent(&self) -> u32 {
        self.agent
    }

    /// Pins held.
    pub fn pinned(&self) -> u32 {
        self.held
    }

    /// Pins `slot` if it still holds `generation`.
    pub fn pin(&mut self, slot: u32, generation: u32) -> Result<Pin, PinError> {
        if slot >= self.arena.header().slots {
            return Err(PinError::OutOfRange);
        }
        let entry = self.free.pop().ok_or(PinError::Full)?;
        let map = self.arena.map();
        if entry >= self.high_water {
            self.high_water = entry + 1;
            // Ordered before the fence below like the entry itself: a scan
            // that must see the entry also sees the mark that covers it.
            map.agent(self.agent).high_water.store(self.high_water, Ordering::Relaxed);
        }
        let word = map.pin(self.agent, entry);
        word.store(encode(slot, generation), Ordering::Relaxed);
        // SeqCst: pairs with the fence in SlotTable::reclaim (store-buffer
        // pattern): either lake-dp's scan sees this entry, or the load below
        // sees its generation bump.
        fence(Ordering::SeqCst);
        let current = map.generation(slot).load(Ordering::Acquire);
        if current != generation {
            word.store(0, Ordering::Release);
            self.free.push(entry);
            return Err(PinError::Stale { current });
        }
        self.held += 1;
        Ok(Pin { slot, generation, entry, agent: self.agent })
    }

    /// The bytes of a pinned slot: stored header, then payload.
    pub fn bytes(&self, pin: &Pin) -> &[u8] {
        assert_eq!(pin.agent, self.agent, "a pin of another agent record");
        // SAFETY: the slot is pinned at its current generation, so lake-dp
        // will not write it until this pin is cleared, which needs `&mut
        // self` and so ends this borrow first.
        unsafe { self.region.slot(pin.slot) }.expect("pinned slots are in range")
    }

    /// Gives a pin back.
    pub fn unpin(&mut self, pin: Pin) {
        assert_eq!(pin.agent, self.agent, "a pin of another agent record");
        let word = self.arena.map().pin(self.agent, pin.entry);
        debug_assert_eq!(word.load(Ordering::Relaxed), encode(pin.slot, pin.generation));
        // Release: pairs with the Acquire load of lake-dp's scan, so every
        // read of the slot above happens before lake-dp reuses it.
        word.store(0, Ordering::Release);
        self.free.push(pin.entry);
        self.held -= 1;
    }
}

impl Drop for PinArray {
    fn drop(&mut self) {
        let map = self.arena.map();
        let record = map.agent(self.agent);
        // Still ours? lake-dp may have released it, taking us for dead.
        if record.owner.load(Ordering::Relaxed) != self.owner {
            return;
        }
        for entry in 0..self.high_water {
            // Release: as in unpin.
            map.pin(self.agent, entry).store(0, Ordering::Release);
        }
        record.high_water.store(0, Ordering::Release);
        // Release: pairs with the Acquire of the next claim.
        let _ = record.owner.compare_exchange(self.owner, 0, Ordering::Release, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_zero_is_empty() {
        assert_eq!(decode(0), None);
        for (slot, generation) in [(0, 0), (0, 1), (7, u32::MAX), (u32::MAX - 1, 5)] {
            let entry = encode(slot, generation);
            assert_ne!(entry, 0);
            assert_eq!(decode(entry), Some((slot, generation)));
        }
    }
}
