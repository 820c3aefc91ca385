//! The slot table: `lake-dp`'s side of the arena. It alone allocates slots
//! and bumps generations; it frees a retired slot only once no agent pins
//! the generation it retired (see [`super::pins`] for the protocol).
//!
//! Every list is sized when the arena is created, so allocation, retiring
//! and reclaiming never allocate memory.
//!
//! In an arena of shared classes (layout version 2) the slot area is a set
//! of chunks, each used by one class at a time: a chunk starts unowned, a
//! class whose own slots are all taken takes an unowned chunk, or else a
//! chunk another class owns and holds nothing in (every one of its slots
//! free) — so memory follows the classes' demand instead of a split fixed
//! at start. A chunk still holding a block never changes class.

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
    /// Slots each class can allocate now (in a shared arena: its own free
    /// ones, and those of the chunks it may take).
    pub free: [u32; SLOT_CLASSES_MAX],
    /// Shared arenas: the chunks each class owns.
    pub chunks_owned: [u32; SLOT_CLASSES_MAX],
    /// Shared arenas: chunks no class owns.
    pub chunks_unowned: u32,
    /// Shared arenas: chunks a class took from another (that held nothing
    /// in it), since the table was made.
    pub chunks_moved: u64,
    /// Shared arenas: chunks emptied by moving their blocks out
    /// ([`SlotTable::evacuate`]) and given up by their class.
    pub chunks_evacuated: u64,
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
    /// Shared classes: which class owns each chunk ([`UNOWNED`] for none).
    /// Empty for fixed classes.
    owner: Vec<u8>,
    /// Shared classes: per chunk, its owner's slots that are not free.
    live: Vec<u32>,
    /// Shared classes: chunks no class owns, taken from the end.
    unowned: Vec<u32>,
    /// Shared classes: per class, the chunks it owns with nothing live.
    empty_owned: [u32; SLOT_CLASSES_MAX],
    chunks_owned: [u32; SLOT_CLASSES_MAX],
    chunks_moved: u64,
    /// Shared classes: the chunk being emptied, if any: its free slots are
    /// off its class's list, and it leaves the class once nothing is live.
    evacuating: Option<u32>,
    chunks_evacuated: u64,
    /// Slots retired since [`SlotTable::take_retired`] last ran, for a
    /// caller that asked to follow them ([`SlotTable::follow_retired`]);
    /// bounded by its capacity, past which `retired_lost` says some went
    /// unrecorded.
    retired: Vec<u32>,
    retired_lost: bool,
}

/// [`SlotTable::owner`] of a chunk no class owns.
const UNOWNED: u8 = u8::MAX;
const _: () = assert!(SLOT_CLASSES_MAX < UNOWNED as usize);

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
        let shared = arena.header().chunk_bytes != 0;
        let spans = &arena.map().geometry.spans;
        let mut free: [Vec<u32>; SLOT_CLASSES_MAX] = Default::default();
        for (list, span) in free.iter_mut().zip(spans) {
            *list = if shared {
                // Sized for every chunk: taking chunks never allocates.
                Vec::with_capacity(span.slots as usize)
            } else {
                (span.first_slot..span.first_slot + span.slots).rev().collect()
            };
        }
        let chunks = if shared { spans[0].chunks() } else { 0 };
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
            owner: vec![UNOWNED; chunks as usize],
            live: vec![0; chunks as usize],
            // Lowest chunk first.
            unowned: (0..chunks).rev().collect(),
            empty_owned: [0; SLOT_CLASSES_MAX],
            chunks_owned: [0; SLOT_CLASSES_MAX],
            chunks_moved: 0,
            evacuating: None,
            chunks_evacuated: 0,
            retired: Vec::new(),
            retired_lost: false,
        }
    }

    /// Whether the arena's classes share chunks (layout version 2).
    pub fn shared(&self) -> bool {
        !self.owner.is_empty()
    }

    /// The chunk being emptied ([`SlotTable::evacuate`]), if any.
    pub fn evacuating(&self) -> Option<u32> {
        self.evacuating
    }

    /// The slots of `chunk` in the class that owns it: (first slot, count),
    /// or `None` for an unowned chunk or a fixed arena.
    pub fn chunk_slot_range(&self, chunk: u32) -> Option<(u32, u32)> {
        let class = usize::from(*self.owner.get(chunk as usize)?);
        let span = self.arena.map().geometry.spans.get(class)?;
        Some((span.first_slot + chunk * span.chunk_slots, span.chunk_slots))
    }

    /// The size class of `slot`, or `None` out of range.
    pub fn class_of_slot(&self, slot: u32) -> Option<usize> {
        self.arena.map().geometry.spans.iter().position(|s| s.contains(slot))
    }

    /// Free slots `class` holds itself (not counting chunks it could take).
    pub fn own_free_slots(&self, class: usize) -> usize {
        self.free.get(class).map_or(0, Vec::len)
    }

    /// The chunk to empty so that `class` gets memory: owned by another
    /// class, holding the fewest blocks, whose class keeps `reserve` free
    /// slots of its own after taking them in elsewhere. `None` when no
    /// chunk qualifies (or one is being emptied already).
    pub fn chunk_to_evacuate(&self, class: usize, reserve: usize) -> Option<u32> {
        if !self.shared() || self.evacuating.is_some() {
            return None;
        }
        let spans = &self.arena.map().geometry.spans;
        (0..self.owner.len())
            .filter(|&k| {
                let owner = usize::from(self.owner[k]);
                let Some(span) = spans.get(owner).filter(|_| owner != class) else { return false };
                let live = self.live[k] as usize;
                let free_here = span.chunk_slots as usize - live;
                let free_elsewhere = self.free[owner].len().saturating_sub(free_here);
                live > 0 && free_elsewhere >= live + reserve
            })
            .min_by_key(|&k| self.live[k])
            .and_then(|k| u32::try_from(k).ok())
    }

    /// Starts emptying `chunk`: its free slots leave its class's list, so
    /// nothing new is placed there; the holder moves its blocks out and
    /// frees them, and once none is live the chunk is nobody's (for a
    /// class short of slots). False for an unowned chunk, a fixed arena or
    /// while another chunk is being emptied.
    pub fn evacuate(&mut self, chunk: u32) -> bool {
        if self.evacuating.is_some() {
            return false;
        }
        let Some(&owner) = self.owner.get(chunk as usize) else { return false };
        let class = usize::from(owner);
        if class >= self.free.len() {
            return false;
        }
        self.unlist_chunk(class, chunk);
        if self.live[chunk as usize] == 0 {
            self.empty_owned[class] -= 1;
            self.give_up_chunk(class, chunk);
        } else {
            self.evacuating = Some(chunk);
        }
        true
    }

    /// Takes `chunk`'s free slots off `class`'s free list.
    fn unlist_chunk(&mut self, class: usize, chunk: u32) {
        let span = self.arena.map().geometry.spans[class];
        self.free[class].retain(|&slot| span.chunk_of(slot) != chunk);
    }

    /// `chunk`, empty and off its class's free list, leaves `class`.
    fn give_up_chunk(&mut self, class: usize, chunk: u32) {
        debug_assert_eq!(self.live[chunk as usize], 0);
        self.owner[chunk as usize] = UNOWNED;
        self.chunks_owned[class] -= 1;
        self.chunks_evacuated += 1;
        // Capacity: every chunk.
        self.unowned.push(chunk);
    }

    /// Slots of `class` per chunk (shared arenas).
    fn chunk_slots(&self, class: usize) -> u32 {
        self.arena.map().geometry.spans.get(class).map_or(0, |s| s.chunk_slots)
    }

    /// Chunks `class` could take now: unowned ones and other classes'
    /// empty ones.
    fn chunks_takeable(&self, class: usize) -> u32 {
        let others: u32 = self.empty_owned.iter().enumerate().filter(|&(c, _)| c != class).map(|(_, n)| n).sum();
        u32::try_from(self.unowned.len()).unwrap_or(u32::MAX) + others
    }

    /// Gives `class` a chunk: an unowned one, else an empty one of the
    /// class that has the most. `None` when there is none.
    fn take_chunk(&mut self, class: usize) -> Option<()> {
        let chunk = match self.unowned.pop() {
            Some(chunk) => chunk,
            None => {
                let donor = (0..SLOT_CLASSES_MAX)
                    .filter(|&c| c != class && self.empty_owned[c] > 0)
                    .max_by_key(|&c| self.empty_owned[c])?;
                // The highest such chunk: allocation fills low ones first.
                let chunk =
                    (0..self.owner.len()).rev().find(|&k| usize::from(self.owner[k]) == donor && self.live[k] == 0)?;
                let chunk = u32::try_from(chunk).ok()?;
                self.unlist_chunk(donor, chunk);
                self.empty_owned[donor] -= 1;
                self.chunks_owned[donor] -= 1;
                self.chunks_moved += 1;
                chunk
            }
        };
        debug_assert_eq!(self.live[chunk as usize], 0);
        self.owner[chunk as usize] = u8::try_from(class).ok()?;
        self.empty_owned[class] += 1;
        self.chunks_owned[class] += 1;
        let span = self.arena.map().geometry.spans[class];
        let first = span.first_slot + chunk * span.chunk_slots;
        // Pushed highest first: the lowest slot is allocated first.
        self.free[class].extend((first..first + span.chunk_slots).rev());
        Some(())
    }

    /// Accounts `slot` (of `class`) leaving the free list.
    fn chunk_taken_slot(&mut self, class: usize, slot: u32) {
        if !self.shared() {
            return;
        }
        let chunk = self.arena.map().geometry.spans[class].chunk_of(slot) as usize;
        debug_assert_eq!(usize::from(self.owner[chunk]), class, "a slot allocated off its class's chunks");
        if self.live[chunk] == 0 {
            self.empty_owned[class] -= 1;
        }
        self.live[chunk] += 1;
    }

    /// Puts `slot` (of `class`) back on its class's free list (not one of
    /// a chunk being emptied).
    fn release_slot(&mut self, class: usize, slot: u32) {
        if !self.shared() {
            // Capacity is the class's slot count: never grows.
            self.free[class].push(slot);
            return;
        }
        let chunk = self.arena.map().geometry.spans[class].chunk_of(slot);
        let index = chunk as usize;
        debug_assert!(self.live[index] > 0);
        self.live[index] -= 1;
        if self.evacuating == Some(chunk) {
            if self.live[index] == 0 {
                self.evacuating = None;
                self.give_up_chunk(class, chunk);
            }
            return;
        }
        self.free[class].push(slot);
        if self.live[index] == 0 {
            self.empty_owned[class] += 1;
        }
    }

    /// The arena.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// The smallest class of partition 0 (of the whole arena, unless it is
    /// partitioned) whose slots hold `object_bytes`, if any.
    pub fn class_for(&self, object_bytes: u64) -> Option<usize> {
        self.class_in(0, object_bytes)
    }

    /// The smallest class of partition `partition` whose slots hold
    /// `object_bytes`, if any.
    pub fn class_in(&self, partition: usize, object_bytes: u64) -> Option<usize> {
        let geometry = &self.arena.map().geometry;
        let first = geometry.partitions.get(partition)?.first_class;
        let spans = &geometry.spans;
        (first..first + geometry.classes_per_partition())
            .filter(|&c| spans[c].slot_bytes >= object_bytes)
            .min_by_key(|&c| spans[c].slot_bytes)
    }

    /// The slot size of partition `partition`'s largest class, if it has
    /// one: room for any object it can hold.
    pub fn slot_bytes_max(&self, partition: usize) -> Option<u64> {
        let geometry = &self.arena.map().geometry;
        let first = geometry.partitions.get(partition)?.first_class;
        geometry.spans.get(first..first + geometry.classes_per_partition())?.iter().map(|s| s.slot_bytes).max()
    }

    /// The partition of `slot`, or `None` out of range.
    pub fn partition_of(&self, slot: u32) -> Option<usize> {
        self.arena.map().geometry.partition_of(slot)
    }

    /// The size class of `slot` and its slot size.
    fn class_of(&self, slot: u32) -> (usize, u64) {
        self.class_of_slot(slot).map_or((0, 0), |c| (c, self.arena.map().geometry.spans[c].slot_bytes))
    }

    /// Slots `class` can allocate now (0 for a class the arena does not
    /// have): its free ones, and in a shared arena those of the chunks it
    /// may take.
    pub fn free_slots(&self, class: usize) -> usize {
        let own = self.free.get(class).map_or(0, Vec::len);
        if !self.shared() || class >= self.free.len() {
            return own;
        }
        own + self.chunks_takeable(class) as usize * self.chunk_slots(class) as usize
    }

    /// Takes a free slot of `class`, or `None` when the class is full
    /// (evict, or wait for draining slots). In a shared arena a class with
    /// no free slot of its own first takes a chunk.
    pub fn allocate(&mut self, class: usize) -> Option<SlotGrant> {
        if self.free.get(class)?.is_empty() && self.shared() {
            self.take_chunk(class)?;
        }
        let slot = self.free.get_mut(class)?.pop()?;
        self.chunk_taken_slot(class, slot);
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
        if self.retired.capacity() > 0 {
            if self.retired.len() < self.retired.capacity() {
                self.retired.push(slot);
            } else {
                self.retired_lost = true;
            }
        }
        Ok(())
    }

    /// From now on, records each slot retired (up to twice the arena's
    /// slots between two [`SlotTable::take_retired`]), for a caller that
    /// keeps something per published slot and must know when it goes.
    pub fn follow_retired(&mut self) {
        let slots = self.state.len().max(1);
        self.retired = Vec::with_capacity(2 * slots);
    }

    /// Whether [`SlotTable::follow_retired`] was called.
    pub fn follows_retired(&self) -> bool {
        self.retired.capacity() > 0
    }

    /// Hands each slot retired since the last call to `each`, with its
    /// generation now (a slot may come twice); `false` when more were
    /// retired than could be recorded, so the caller must look at every
    /// slot instead ([`SlotTable::generation_of`]).
    pub fn take_retired(&mut self, mut each: impl FnMut(u32, u32)) -> bool {
        for &slot in &self.retired {
            each(slot, self.generation[slot as usize]);
        }
        self.retired.clear();
        !std::mem::take(&mut self.retired_lost)
    }

    /// `slot`'s generation now, as this table keeps it (not as read back
    /// from shared memory, where an agent could have written it).
    pub fn generation_of(&self, slot: u32) -> Option<u32> {
        self.generation.get(slot as usize).copied()
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

    /// Whether `slot` is held: allocated, and neither retired nor free.
    pub fn is_held(&self, slot: u32) -> bool {
        self.state.get(slot as usize) == Some(&SlotState::Held)
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
        self.release_slot(class, slot);
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
            self.release_slot(class, slot);
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
        for (class, count) in free.iter_mut().enumerate() {
            *count = u32::try_from(self.free_slots(class)).unwrap_or(u32::MAX);
        }
        SlotStats {
            free,
            chunks_owned: self.chunks_owned,
            chunks_unowned: u32::try_from(self.unowned.len()).unwrap_or(u32::MAX),
            chunks_moved: self.chunks_moved,
            chunks_evacuated: self.chunks_evacuated,
            held: self.held,
            draining: u32::try_from(self.draining.len()).unwrap_or(u32::MAX),
            bytes_in_use: self.bytes_in_use,
        }
    }
}
