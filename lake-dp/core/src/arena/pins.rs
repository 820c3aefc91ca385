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

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::sync::Arc;

use super::{Arena, ArenaError, agent_lock_byte, io_error};
use crate::lock;
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
///
/// One u64 — slot, entry and agent record packed — written and read as one
/// word: a pin of separate fields, returned through memory, cost a
/// store-forwarding stall on every pin (`lake-bench pin`: 16.5 ns for a
/// pin and unpin before, 6.3 ns after). The generation lives in the pin
/// entry itself.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pin keeps its slot from reuse until unpinned"]
pub struct Pin(u64);

// Entry and agent indices fit 16 bits each.
const _: () = assert!(super::layout::PINS_PER_AGENT_MAX <= 1 << 16 && super::layout::AGENTS_MAX <= 1 << 16);

#[allow(clippy::cast_possible_truncation)] // fields of a packed u64
impl Pin {
    fn new(slot: u32, entry: u32, agent: u32) -> Self {
        debug_assert!(entry < 1 << 16 && agent < 1 << 16);
        Self(u64::from(slot) | u64::from(entry) << 32 | u64::from(agent) << 48)
    }

    /// The pinned slot.
    pub fn slot(&self) -> u32 {
        self.0 as u32
    }

    fn entry(&self) -> usize {
        usize::from((self.0 >> 32) as u16)
    }

    fn agent(&self) -> u32 {
        u32::from((self.0 >> 48) as u16)
    }
}

/// An agent's claimed record: the only writer of its pin entries.
pub struct PinArray {
    arena: Arena,
    region: Arc<SlotRegion>,
    /// This record's entries and the arena's generations, resolved once:
    /// they point into the mapping that `arena` keeps alive.
    entries: NonNull<[AtomicU64]>,
    generations: NonNull<[AtomicU32]>,
    agent: u32,
    owner: u64,
    /// Free entry indices, popped from the end (lowest first).
    free: Vec<u32>,
    held: u32,
    high_water: u32,
    /// This record's own open file of the arena, holding the record's lock
    /// (see [`super::lock`]): the kernel drops it when this process dies,
    /// which is how `lake-dp` tells a dead agent from a live one.
    lock_file: std::fs::File,
}

// SAFETY: the two pointers are views into the mapping the `arena` field
// owns (Send and Sync); the record's entries are written only through
// `&mut self`, so moving the array to another thread moves the one writer.
unsafe impl Send for PinArray {}

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
        // On an open of its own, every claim of this process locks through
        // that one open file: claims (and releases) then take turns, and
        // a record this process owns is never locked again (the lock would
        // be its own, and the failed claim's unlock would drop it).
        let _turn = map.own_file.then(|| OWN_FILE_CLAIMS.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let lock_file = if map.own_file { map.file.try_clone() } else { lock::reopen(&map.file) }
            .map_err(io_error("reopening the arena", None))?;
        for agent in 0..header.agents_max {
            let record = map.agent(agent);
            if map.own_file && record.owner.load(Ordering::Acquire) >> 32 == u64::from(std::process::id()) {
                continue;
            }
            // Lock first, then own: whenever lake-dp sees an owner, the
            // lock is already held (or its holder is dead).
            let byte = agent_lock_byte(&header, agent);
            if !lock::try_lock(&lock_file, byte).map_err(io_error("locking an agent record", None))? {
                continue;
            }
            // Acquire: pairs with the Release that freed the record, so the
            // entries its last owner (or lake-dp) cleared read as cleared.
            if record.owner.compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed).is_err() {
                // Owned by a dead agent lake-dp has not released yet.
                lock::unlock(&lock_file, byte).map_err(io_error("unlocking an agent record", None))?;
                continue;
            }
            // The record is ours alone now; leftovers cannot name a live
            // pin of anyone, so clear them for a clean scan.
            let high = record.high_water.load(Ordering::Relaxed).min(header.pins_per_agent);
            let entries = map.pins(agent);
            for word in &entries[..high as usize] {
                word.store(0, Ordering::Release);
            }
            record.high_water.store(0, Ordering::Release);
            let (entries, generations) = (NonNull::from(entries), NonNull::from(map.generations()));
            let region = arena.region()?;
            let free = (0..header.pins_per_agent).rev().collect();
            return Ok(Self {
                arena,
                region,
                entries,
                generations,
                agent,
                owner,
                free,
                held: 0,
                high_water: 0,
                lock_file,
            });
        }
        Err(ArenaError::AgentsFull)
    }

    #[inline]
    fn entries(&self) -> &[AtomicU64] {
        // SAFETY: resolved from the mapping at claim; `self.arena` keeps
        // the mapping alive as long as `self`.
        unsafe { self.entries.as_ref() }
    }

    #[inline]
    fn generations(&self) -> &[AtomicU32] {
        // SAFETY: as for entries.
        unsafe { self.generations.as_ref() }
    }

    /// Drops the record's lock as the kernel would if this process died
    /// (tests of dead-agent release).
    #[cfg(test)]
    pub(super) fn simulate_death(&self) {
        let byte = agent_lock_byte(self.arena.header(), self.agent);
        lock::unlock(&self.lock_file, byte).expect("unlock");
    }

    /// This agent's record index.
    pub fn agent(&self) -> u32 {
        self.agent
    }

    /// Pins held.
    pub fn pinned(&self) -> u32 {
        self.held
    }

    /// Pins `slot` if it still holds `generation` (and this process maps
    /// it: in a partitioned arena, only its own partition's slots).
    #[inline]
    pub fn pin(&mut self, slot: u32, generation: u32) -> Result<Pin, PinError> {
        if slot as usize >= self.generations().len() || self.region.span_of(slot).is_none() {
            return Err(PinError::OutOfRange);
        }
        let entry = self.free.pop().ok_or(PinError::Full)?;
        if entry >= self.high_water {
            self.high_water = entry + 1;
            // Ordered before the fence below like the entry itself: a scan
            // that must see the entry also sees the mark that covers it.
            self.arena.map().agent(self.agent).high_water.store(self.high_water, Ordering::Relaxed);
        }
        let word = &self.entries()[entry as usize];
        let slot_generation = &self.generations()[slot as usize];
        word.store(encode(slot, generation), Ordering::Relaxed);
        // SeqCst: pairs with the fence in SlotTable::reclaim (store-buffer
        // pattern): either lake-dp's scan sees this entry, or the load below
        // sees its generation bump.
        fence(Ordering::SeqCst);
        let current = slot_generation.load(Ordering::Acquire);
        if current != generation {
            word.store(0, Ordering::Release);
            self.free.push(entry);
            return Err(PinError::Stale { current });
        }
        self.held += 1;
        Ok(Pin::new(slot, entry, self.agent))
    }

    /// The generation a pin holds.
    pub fn generation(&self, pin: &Pin) -> u32 {
        self.check(pin);
        // Relaxed: this agent wrote the entry.
        decode(self.entries()[pin.entry()].load(Ordering::Relaxed)).map_or(0, |(_, generation)| generation)
    }

    #[inline]
    fn check(&self, pin: &Pin) {
        assert_eq!(pin.agent(), self.agent, "a pin of another agent record");
    }

    /// The bytes of a pinned slot: stored header, then payload.
    pub fn bytes(&self, pin: &Pin) -> &[u8] {
        self.check(pin);
        // SAFETY: the slot is pinned at its current generation, so lake-dp
        // will not write it until this pin is cleared, which needs `&mut
        // self` and so ends this borrow first.
        unsafe { self.region.slot(pin.slot()) }.expect("pinned slots are in range")
    }

    /// Gives a pin back.
    #[inline]
    pub fn unpin(&mut self, pin: Pin) {
        self.check(&pin);
        let entry = pin.entry();
        let word = &self.entries()[entry];
        debug_assert_eq!(decode(word.load(Ordering::Relaxed)).map(|(slot, _)| slot), Some(pin.slot()));
        // Release: pairs with the Acquire load of lake-dp's scan, so every
        // read of the slot above happens before lake-dp reuses it.
        word.store(0, Ordering::Release);
        // An entry index below pins_per_agent (at most 2^16).
        #[allow(clippy::cast_possible_truncation)]
        self.free.push(entry as u32);
        self.held -= 1;
    }
}

/// Claims and releases of records through an arena open of this
/// process's own, one at a time ([`PinArray::claim`]).
static OWN_FILE_CLAIMS: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Drop for PinArray {
    fn drop(&mut self) {
        let map = self.arena.map();
        let _turn = map.own_file.then(|| OWN_FILE_CLAIMS.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let record = map.agent(self.agent);
        // Still ours? lake-dp may have released it, taking us for dead.
        if record.owner.load(Ordering::Relaxed) != self.owner {
            return;
        }
        for word in &self.entries()[..self.high_water as usize] {
            // Release: as in unpin.
            word.store(0, Ordering::Release);
        }
        record.high_water.store(0, Ordering::Release);
        // Release: pairs with the Acquire of the next claim.
        let _ = record.owner.compare_exchange(self.owner, 0, Ordering::Release, Ordering::Relaxed);
        // Unlock after giving up ownership (closing the file would too).
        let _ = lock::unlock(&self.lock_file, agent_lock_byte(self.arena.header(), self.agent));
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
