//! Rebalancing an L1 arena whose size classes share chunks (the seed's
//! defragmentation). The slot table hands a class short of slots any chunk
//! nobody holds a block in; this is for when none is empty — another
//! class's blocks lie scattered over every chunk it owns, each partly
//! free. Then the pool empties one of that class's chunks by moving its
//! blocks into the class's free slots elsewhere, and the chunk goes to the
//! class that ran short.
//!
//! - **When**: a save, a load or a landing found its class with no slot
//!   (or only the load reserve) left ([`Pool::allocate_l1`]). The next pass picks the chunk of another class
//!   with the fewest blocks whose class can take them in and still keep
//!   its own reserve ([`SlotTable::chunk_to_evacuate`]); one chunk at a
//!   time, [`MOVES_PER_PASS`] blocks a pass.
//! - **A move**: a published (`Ready`) block is copied within L1 into a
//!   free slot of its class, its header rewritten to name the new slot and
//!   every CRC checked again there; `lake-cp` is told the old replica went
//!   (`EvictReason::Moved`) and then that the new one is ready; the old
//!   slot is retired like any eviction, so a reader holding a pin keeps
//!   its bytes until it lets go. A block being read from or written to L2,
//!   sent to a peer, or still being saved waits for a later pass.
//! - **Who may**: only a data plane whose control plane offered
//!   [`crate::wire::FEATURE_L1_MOVES`] moves blocks (an older one would
//!   refuse the reason); without it a class still takes chunks another
//!   emptied by eviction.

use super::{L1State, Pool};
use crate::arena::{SlotGrant, SlotTable};
use crate::constants::STORED_HEADER_BYTES;
use crate::io::IoBackend;
use crate::model::replica::RegionId;
use crate::runner::Parts;
use crate::stored::decode_header;
use crate::wire::message::{BlockEvicted, EvictReason};

/// Blocks one pass moves at most: each is a copy of up to a slot within
/// DRAM and a CRC pass over it, background work next to the agents' own.
pub(super) const MOVES_PER_PASS: u32 = 4;

/// Why a block was not moved.
enum MoveError {
    /// No free slot of its class outside the chunk.
    NoRoom,
    /// It failed its checks (and was evicted).
    Corrupt,
}

impl Pool {
    /// A free L1 slot of size class `class`, leaving the class `keep` free
    /// slots (the load reserve, for a save). A class found short is
    /// remembered for the next [`Pool::rebalance`]. `None`: no slot may be
    /// taken.
    pub(super) fn allocate_l1(&mut self, table: &mut SlotTable, class: usize, keep: usize) -> Option<SlotGrant> {
        let grant = if keep > 0 && table.free_slots(class) <= keep { None } else { table.allocate(class) };
        if grant.is_none() {
            self.short_class = Some(class);
            self.stats.l1_class_short += 1;
        }
        grant
    }

    /// Empties a chunk for a class that ran short, a few blocks a pass.
    /// Returns the blocks moved.
    pub(super) fn rebalance<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>) -> u32 {
        if !parts.table.shared() || parts.link.as_ref().is_some_and(|l| !l.takes(crate::wire::FEATURE_L1_MOVES)) {
            self.short_class = None;
            return 0;
        }
        if parts.table.evacuating().is_none() {
            let Some(class) = self.short_class.take() else { return 0 };
            let reserve = self.load_reserve_slots as usize;
            if parts.table.free_slots(class) > reserve {
                // Another class gave up a chunk meanwhile.
                return 0;
            }
            let Some(chunk) = parts.table.chunk_to_evacuate(class, reserve) else {
                self.stats.l1_rebalance_impossible += 1;
                return 0;
            };
            parts.table.evacuate(chunk);
            self.stats.l1_chunks_emptied += 1;
        }
        let Some(chunk) = parts.table.evacuating() else { return 0 };
        let Some((first, count)) = parts.table.chunk_slot_range(chunk) else { return 0 };
        let mut moved = 0;
        for slot in first..first + count {
            if moved == MOVES_PER_PASS {
                break;
            }
            if self.l1.get(slot as usize) != Some(&L1State::Ready) {
                continue;
            }
            match self.move_l1(slot, parts) {
                Ok(()) => moved += 1,
                // No free slot of its class left (saves took them): the
                // chunk empties as its blocks are evicted instead.
                Err(MoveError::NoRoom) => break,
                Err(MoveError::Corrupt) => {}
            }
        }
        moved
    }

    /// Moves the published block in `source` to a free slot of its class.
    fn move_l1<B: IoBackend>(&mut self, source: u32, parts: &mut Parts<'_, B>) -> Result<(), MoveError> {
        let table = &mut *parts.table;
        let class = table.class_of_slot(source).ok_or(MoveError::NoRoom)?;
        let generation = table.arena().generation(source).ok_or(MoveError::NoRoom)?;
        if table.own_free_slots(class) == 0 {
            return Err(MoveError::NoRoom);
        }
        let target = table.allocate(class).ok_or(MoveError::NoRoom)?;
        // SAFETY: `source` is published and unchanged while published
        // (nobody writes a Ready slot; readers only pin it).
        let from = unsafe { parts.region.slot(source) };
        // SAFETY: `target` was just allocated to this thread and is not
        // published, so nobody else touches it; it is another slot than
        // `source`, so the two slices do not overlap.
        let to = unsafe { parts.region.slot_mut(target.slot) };
        let decoded = from.and_then(|from| decode_header(from).ok());
        let key = decoded.as_ref().map(|decoded| decoded.meta().key);
        let copied = from.zip(to).zip(decoded).and_then(|((from, to), decoded)| {
            let len =
                usize::try_from(decoded.meta().object_bytes()).ok().filter(|&len| len <= from.len().min(to.len()))?;
            to[..len].copy_from_slice(&from[..len]);
            let header: &mut [u8; STORED_HEADER_BYTES] = (&mut to[..STORED_HEADER_BYTES]).try_into().ok()?;
            decoded.encode_moved(RegionId(self.l1_region), self.epoch, target.slot, target.generation, header).ok()?;
            // Every CRC again, over the copy: it is what readers get.
            super::check_object(to, true).ok()
        });
        let Some(meta) = copied else {
            // The block fails its checks where it lies: evicted as corrupt
            // (a reader would have refused it too), not moved.
            let _ = table.retire(target.slot);
            self.stats.l1_moves_failed += 1;
            self.evict_corrupt(source, generation, key, parts);
            return Err(MoveError::Corrupt);
        };
        self.l1[target.slot as usize] = L1State::Ready;
        self.charge(target.slot, target.generation, meta.namespace.0, target.slot_bytes);
        if let Some(cp) = parts.link.as_mut() {
            let replica = self.l1_replica(source, generation);
            cp.evicted(&BlockEvicted { replica, key: meta.key, reason: EvictReason::Moved as u8, reserved: [0; 7] });
            cp.committed(&self.l1_record(target.slot, target.generation, &meta));
        }
        self.release_l1(source, table);
        self.stats.l1_moves += 1;
        Ok(())
    }
}
