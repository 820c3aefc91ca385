//! The slot table: `lake-dp`'s side of the arena. It alone allocates slots
//! and bumps generations; it frees a retired slot only once no agent pins
//! the generation it retired (see [`super::pins`] for the protocol).
//!
//! Every list is sized when the arena is created, so allocation, retiring
//! and reclaiming never allocate memory.

use core::sync::atomic::{Ordering, fence};

use super::pins::decode;
use super::{Arena, agent_lock_byte};
use crate::constants::SLOT_CLASSES_MAX;
use crate::lock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Handed out by `allocate`: its holder writes it, then publishes it.
    Held,
    /// Retired; waiting for pins of its old generation to go.
    Draining,
    /// Retired to be kept: once unpinned it becomes `Drained`, not free.
    DrainingKept,
    /// Retired, unpinned and kept: its holder reads or writes it freely
    /// (nobody can pin it: its generation moved on), then frees it.
    Drained,
}

/// A slot handed out by [`SlotTable::allocate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotGrant {
    /// The slot, numbered across the arena.
    pub slot: u32,
    /// Its generation while held: the one to publish.
    pub generation: u32,
    /// Its size class.
    pub class: usize,
    /// Bytes of the slot.
    pub slot_bytes: u64,
}

/// Why a slot operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotError {
    /// No such slot.
    OutOfRange,
    /// The slot is not held (double retire, or never allocated).
    NotHeld,
    /// No such agent record.
    NoAgent,
}

impl core::fmt::Display for SlotError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::OutOfRange => "slot table: no such slot",
            Self::NotHeld => "slot table: the slot is not held",
            Self::NoAgent => "slot table: no such agent record",
        })
    }
}

impl std::error::Error for SlotError {}

/// What a reclaim pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaim {
    /// Retired slots now free.
    pub freed: u32,
    /// Retired slots still pinned by some agent.
    pub pinned: u32,
}

/// Counts, per class and in all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotStats {
    /// Free slots per class.
    pub free: [u32; SLOT_CLASSES_MAX],
    /// Held slots.
    pub held: u32,
    /// Retired slots waiting for pins.
    pub draining: u32,
    /// Bytes of held and draining slots (what L1 holds).
    pub bytes_in_use: u64,
}

/// `lake-dp`'s allocator over one arena.
pub struct SlotTable {
    arena: Arena,
    state: Vec<SlotState>,
    /// Each slot's current generation. The arena's generation words are
    /// this table's published copy: it writes them and never reads them
    /// back, so an agent scribbling on shared memory cannot steer it.
    generation: Vec<u32>,
    /// The generation each draining slot retired.
    retired_generation: Vec<u32>,
    /// The reclaim pass that last saw each draining slot pinned.
    pinned_in_pass: Vec<u32>,
    /// Free slots per class, popped from the end (lowest first).
    free: [Vec<u32>; SLOT_CLASSES_MAX],
    draining: Vec<u32>,
    pass: u32,
    bytes_in_use: u64,
    held: u32,
    drained: u32,
}

impl core::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotTable").field("stats", &self.stats()).finish()
    }
}

fn next_generation(generation: u32) -> u32 {
    // 0 is never a live generation (an empty pin or mirror entry).
    generation.checked_add(1).unwrap_or(1)
}

impl SlotTable {
    pub(super) fn new(arena: Arena) -> Self {
        let slots = arena.header().slots as usize;
        let mut free: [Vec<u32>; SLOT_CLASSES_MAX] = Default::default();
        for (list, span) in free.iter_mut().zip(&arena.map().geometry.spans) {
            *list = (span.first_slot..span.first_slot + span.slots).rev().collect();
        }
        Self {
            arena,
            state: vec![SlotState::Free; slots],
            // Arena::create published 1 for every slot.
            generation: vec![1; slots],
            retired_generation: vec![0; slots],
            pinned_in_pass: vec![0; slots],
            free,
            draining: Vec::with_capacity(slots),
            pass: 0,
            bytes_in_use: 0,
            held: 0,
            drained: 0,
        }
    }

    /// The arena.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// The smallest class whose slots hold `object_bytes`, if any.
    pub fn class_for(&self, object_bytes: u64) -> Option<usize> {
        let spans = &self.arena.map().geometry.spans;
        (0..spans.len()).filter(|&c| spans[c].slot_bytes >= object_bytes).min_by_key(|&c| spans[c].slot_bytes)
    }

    /// The size class of `slot` and its slot size.
    fn class_of(&self, slot: u32) -> (usize, u64) {
        let spans = &self.arena.map().geometry.spans;
        spans.iter().position(|s| s.contains(slot)).map_or((0, 0), |c| (c, spans[c].slot_bytes))
    }

    /// Free slots of `class` (0 for a class the arena does not have).
    pub fn free_slots(&self, class: usize) -> usize {
        self.free.get(class).map_or(0, Vec::len)
    }

    /// Takes a free slot of `class`, or `None` when the class is full
    /// (evict, or wait for draining slots).
    pub fn allocate(&mut self, class: usize) -> Option<SlotGrant> {
        let slot = self.free.get_mut(class)?.pop()?;
        debug_assert_eq!(self.state[slot as usize], SlotState::Free);
        self.state[slot as usize] = SlotState::Held;
        let (_, slot_bytes) = self.class_of(slot);
        self.bytes_in_use += slot_bytes;
        self.held += 1;
        let generation = self.generation[slot as usize];
        Some(SlotGrant { slot, generation, class, slot_bytes })
    }

    /// Retires a held slot: its generation moves on, so no new pin of the
    /// old one succeeds; it is freed by a later [`SlotTable::reclaim`] once
    /// no agent pins the old generation.
    pub fn retire(&mut self, slot: u32) -> Result<(), SlotError> {
        let state = self.state.get_mut(slot as usize).ok_or(SlotError::OutOfRange)?;
        if *state != SlotState::Held {
            return Err(SlotError::NotHeld);
        }
        *state = SlotState::Draining;
        self.held -= 1;
        let old = self.generation[slot as usize];
        let new = next_generation(old);
        self.generation[slot as usize] = new;
        // Relaxed: ordered before the scan by the SeqCst fence in reclaim.
        self.arena.map().generation(slot).store(new, Ordering::Relaxed);
        self.retired_generation[slot as usize] = old;
        self.draining.push(slot);
        Ok(())
    }

    /// Retires a held slot like [`SlotTable::retire`], but keeps it: once
    /// no agent pins its old generation, [`SlotTable::reclaim`] leaves it
    /// `drained` (see [`SlotTable::is_drained`]) for the caller to use
    /// exclusively — rewriting its header for a demotion, say — and free
    /// with [`SlotTable::free_drained`].
    pub fn retire_kept(&mut self, slot: u32) -> Result<(), SlotError> {
        self.retire(slot)?;
        self.state[slot as usize] = SlotState::DrainingKept;
        Ok(())
    }

    /// Whether a slot retired with [`SlotTable::retire_kept`] is unpinned
    /// now (after a [`SlotTable::reclaim`]).
    pub fn is_drained(&self, slot: u32) -> bool {
        self.state.get(slot as usize) == Some(&SlotState::Drained)
    }

    /// Frees a drained slot.
    pub fn free_drained(&mut self, slot: u32) -> Result<(), SlotError> {
        let state = self.state.get_mut(slot as usize).ok_or(SlotError::OutOfRange)?;
        if *state != SlotState::Drained {
            return Err(SlotError::NotHeld);
        }
        *state = SlotState::Free;
        let (class, slot_bytes) = self.class_of(slot);
        self.bytes_in_use -= slot_bytes;
        self.drained -= 1;
        self.free[class].push(slot);
        Ok(())
    }

    /// Frees every retired slot that no agent pins; a bounded scan of the
    /// agents' pin entries (up to each record's high-water mark).
    pub fn reclaim(&mut self) -> Reclaim {
        if self.draining.is_empty() {
            return Reclaim::default();
        }
        // SeqCst: pairs with the fence in PinArray::pin (store-buffer
        // pattern): the generation bumps above are ordered before the
        // loads below, so a pin this scan misses saw the bump and failed.
        fence(Ordering::SeqCst);
        self.pass = self.pass.wrapping_add(1).max(1);
        let map = self.arena.map();
        let header = *map.header();
        for agent in 0..header.agents_max {
            // Acquire: with the entries' Acquire below, pairs with the
            // agent's Release clears (its reads of a slot happen first).
            let high = map.agent(agent).high_water.load(Ordering::Acquire).min(header.pins_per_agent);
            for word in &map.pins(agent)[..high as usize] {
                let Some((slot, generation)) = decode(word.load(Ordering::Acquire)) else {
                    continue;
                };
                let index = slot as usize;
                if index < self.state.len()
                    && matches!(self.state[index], SlotState::Draining | SlotState::DrainingKept)
                    && self.retired_generation[index] == generation
                {
                    self.pinned_in_pass[index] = self.pass;
                }
            }
        }
        let mut result = Reclaim::default();
        let mut kept = 0;
        for i in 0..self.draining.len() {
            let slot = self.draining[i];
            if self.pinned_in_pass[slot as usize] == self.pass {
                self.draining[kept] = slot;
                kept += 1;
                result.pinned += 1;
                continue;
            }
            if self.state[slot as usize] == SlotState::DrainingKept {
                self.state[slot as usize] = SlotState::Drained;
                self.drained += 1;
                continue;
            }
            self.state[slot as usize] = SlotState::Free;
            let (class, slot_bytes) = self.class_of(slot);
            self.bytes_in_use -= slot_bytes;
            // Capacity is the class's slot count: never grows.
            self.free[class].push(slot);
            result.freed += 1;
        }
        self.draining.truncate(kept);
        result
    }

    /// Drops every pin of agent record `agent`, whose process is dead (its
    /// attach socket closed). Returns the pins dropped. Calling this for a
    /// live agent breaks its pins: only its liveness signal may trigger it.
    pub fn release_agent(&mut self, agent: u32) -> Result<u32, SlotError> {
        let map = self.arena.map();
        let header = *map.header();
        if agent >= header.agents_max {
            return Err(SlotError::NoAgent);
        }
        let record = map.agent(agent);
        let owner = record.owner.load(Ordering::Acquire);
        if owner == 0 {
            return Ok(0);
        }
        let mut dropped = 0;
        let high = record.high_water.load(Ordering::Acquire).min(header.pins_per_agent);
        for word in &map.pins(agent)[..high as usize] {
            // The owner is dead, so this table is the record's only writer.
            if word.swap(0, Ordering::AcqRel) != 0 {
                dropped += 1;
            }
        }
        record.high_water.store(0, Ordering::Release);
        // Release: pairs with the Acquire of the next claim.
        let _ = record.owner.compare_exchange(owner, 0, Ordering::Release, Ordering::Relaxed);
        Ok(dropped)
    }

    /// Releases the records of agents whose process has died: an owned
    /// record whose lock no process holds any more (the kernel dropped it
    /// with the process). Exact whatever the pid namespace, and immune to
    /// pid reuse; on any doubt the agent counts as alive. Returns the
    /// records released.
    pub fn release_dead_agents(&mut self) -> u32 {
        let header = *self.arena.header();
        let mut released = 0;
        for agent in 0..header.agents_max {
            // Acquire: pairs with the claim's CAS, which came after the lock.
            if self.arena.map().agent(agent).owner.load(Ordering::Acquire) == 0 {
                continue;
            }
            let byte = agent_lock_byte(&header, agent);
            let alive = lock::held_by_other(&self.arena.map().file, byte).unwrap_or(true);
            if !alive && self.release_agent(agent).is_ok() {
                released += 1;
            }
        }
        released
    }

    /// Pins the agents hold now (a scan of their pin arrays up to each
    /// one's high-water mark; for metrics, not the hot path).
    pub fn pins_held(&self) -> u32 {
        let map = self.arena.map();
        let header = *map.header();
        let mut held = 0u32;
        for agent in 0..header.agents_max {
            // Acquire: as in reclaim.
            let high = map.agent(agent).high_water.load(Ordering::Acquire).min(header.pins_per_agent);
            for word in &map.pins(agent)[..high as usize] {
                if decode(word.load(Ordering::Acquire)).is_some() {
                    held += 1;
                }
            }
        }
        held
    }

    /// Counts.
    pub fn stats(&self) -> SlotStats {
        let mut free = [0u32; SLOT_CLASSES_MAX];
        for (count, list) in free.iter_mut().zip(&self.free) {
            *count = u32::try_from(list.len()).unwrap_or(u32::MAX);
        }
        SlotStats {
            free,
            held: self.held,
            draining: u32::try_from(self.draining.len()).unwrap_or(u32::MAX),
            bytes_in_use: self.bytes_in_use,
        }
    }
}
