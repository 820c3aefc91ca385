//! The block service's invariants over its whole state, asserted by the
//! simulation after every pass (each is O(slots), too dear for the poll
//! loop; the ones that hold for one slot at a time are asserted where the
//! slot changes, in every build).

use super::{L1State, Pool};
use crate::arena::SlotTable;
use crate::l2::L2Slots;
use crate::op::L2Slot;

impl Pool {
    /// Panics, naming the slot, where the pool's view of L1 and L2
    /// disagrees with the slot table's, the L2 slot map's, or its own
    /// counts.
    pub(crate) fn assert_invariants(&self, table: &SlotTable, l2: &L2Slots) {
        let mut reserved = 0;
        for (slot, state) in (0u32..).zip(&self.l1) {
            match state {
                L1State::Reserved { .. } | L1State::Ready | L1State::Sending { .. } => {
                    reserved += u32::from(matches!(state, L1State::Reserved { .. }));
                    assert!(table.is_held(slot), "L1 slot {slot} is {state:?} in the pool, not held in the table");
                }
                L1State::Free => {
                    assert!(!table.is_held(slot), "L1 slot {slot} is free in the pool and held in the table");
                }
                L1State::Busy => {}
            }
        }
        assert_eq!(self.reserved, reserved, "reservations counted apart from the slots reserved");
        let per_file = self.geometry.slots_per_file as usize;
        for (index, meta) in self.l2_meta.iter().enumerate() {
            let slot = L2Slot {
                file: u16::try_from(index / per_file).unwrap_or(u16::MAX),
                slot: u32::try_from(index % per_file).unwrap_or(u32::MAX),
            };
            assert!(meta.is_none() || l2.in_use(slot), "L2 slot {slot:?} holds an object in the pool and is free");
        }
        let in_flight = self.ops.iter().filter(|op| op.is_some()).count();
        assert_eq!(in_flight + self.free_ops.len(), self.ops.len(), "operations lost or counted twice");
        for &index in &self.free_ops {
            assert!(self.ops[index as usize].is_none(), "operation {index} is free and in flight");
        }
    }
}
