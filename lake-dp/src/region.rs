//! Slot regions: memory carved into fixed-size slots that I/O reads into and
//! writes from. An L1 slot holds a block exactly as it lies in an L2 slot —
//! 4 KiB stored-object header, then the payload padded to 4 KiB — so moving
//! a block between L1 and L2 is one O_DIRECT transfer with no copy.
//!
//! A region is shared: the poller's I/O, the engine's agent and (through
//! shared memory) other processes all touch its bytes, and who may touch a
//! slot when is decided by the slot protocol (allocation, pins, one
//! in-flight op per slot), not by Rust borrows. Access is therefore through
//! raw pointers, and the few accessors that hand out slices are `unsafe`
//! with that contract written down.

use core::ptr::NonNull;

use crate::constants::DIRECT_IO_ALIGN_BYTES;

/// Why a region could not be made.
#[derive(Debug)]
pub enum RegionError {
    /// Slot size zero or not a multiple of 4 KiB, or zero slots.
    Geometry {
        /// Bytes per slot.
        slot_bytes: u64,
        /// Slots.
        slots: u32,
    },
    /// The allocation or mapping failed.
    Memory(std::io::Error),
}

impl core::fmt::Display for RegionError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Geometry { slot_bytes, slots } => {
                write!(f, "region of {slots} slots of {slot_bytes} bytes: slots must be a positive multiple of 4096")
            }
            Self::Memory(e) => write!(f, "region memory: {e}"),
        }
    }
}

impl std::error::Error for RegionError {}

enum Backing {
    Heap(std::alloc::Layout),
    /// Memory owned elsewhere (a mapping kept alive by the owner).
    Borrowed,
}

/// Memory of `slots` slots of `slot_bytes` each, 4 KiB aligned.
pub struct SlotRegion {
    base: NonNull<u8>,
    slot_bytes: usize,
    slots: u32,
    backing: Backing,
}

impl core::fmt::Debug for SlotRegion {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotRegion").field("slot_bytes", &self.slot_bytes).field("slots", &self.slots).finish()
    }
}

// SAFETY: the region is plain memory addressed through raw pointers; every
// access goes through the slot protocol documented above, which is what
// makes concurrent use from several threads sound.
unsafe impl Send for SlotRegion {}
// SAFETY: as for Send: shared access is coordinated by the slot protocol.
unsafe impl Sync for SlotRegion {}

fn check_geometry(slot_bytes: u64, slots: u32) -> Result<usize, RegionError> {
    let bad = || RegionError::Geometry { slot_bytes, slots };
    if slots == 0 || slot_bytes == 0 || !slot_bytes.is_multiple_of(DIRECT_IO_ALIGN_BYTES as u64) {
        return Err(bad());
    }
    let slot = usize::try_from(slot_bytes).map_err(|_| bad())?;
    slot.checked_mul(slots as usize).ok_or_else(bad)?;
    Ok(slot)
}

impl SlotRegion {
    /// A zeroed region on the heap (tests, simulation, and engines that do
    /// not share their L1 with other processes).
    pub fn heap(slot_bytes: u64, slots: u32) -> Result<Self, RegionError> {
        let slot = check_geometry(slot_bytes, slots)?;
        let layout = std::alloc::Layout::from_size_align(slot * slots as usize, DIRECT_IO_ALIGN_BYTES)
            .map_err(|_| RegionError::Geometry { slot_bytes, slots })?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(ptr).ok_or_else(|| RegionError::Memory(std::io::ErrorKind::OutOfMemory.into()))?;
        Ok(Self { base, slot_bytes: slot, slots, backing: Backing::Heap(layout) })
    }

    /// A region over memory someone else owns (a shared-memory mapping).
    ///
    /// # Safety
    ///
    /// `base` must be 4 KiB aligned and valid for `slot_bytes * slots`
    /// bytes for as long as the returned region lives.
    pub unsafe fn from_raw(base: NonNull<u8>, slot_bytes: u64, slots: u32) -> Result<Self, RegionError> {
        let slot = check_geometry(slot_bytes, slots)?;
        if !(base.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN_BYTES) {
            return Err(RegionError::Geometry { slot_bytes, slots });
        }
        Ok(Self { base, slot_bytes: slot, slots, backing: Backing::Borrowed })
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.slot_bytes * self.slots as usize
    }

    /// Whether the region is empty (never: regions have at least one slot).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first byte (for registration with io_uring, CUDA, RDMA).
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Pointer to the first byte of `slot`, or `None` out of range.
    pub fn slot_ptr(&self, slot: u32) -> Option<*mut u8> {
        // In range, so the offset stays inside the allocation.
        (slot < self.slots).then(|| self.base.as_ptr().wrapping_add(slot as usize * self.slot_bytes))
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    ///
    /// Nobody may write the slot while the returned slice lives (the
    /// caller owns the slot, or holds a pin and no writer can own it).
    pub unsafe fn slot(&self, slot: u32) -> Option<&[u8]> {
        let ptr = self.slot_ptr(slot)?;
        // SAFETY: in range and valid for slot_bytes (constructor); no
        // concurrent writer (caller's contract).
        Some(unsafe { core::slice::from_raw_parts(ptr, self.slot_bytes) })
    }

    /// The bytes of `slot`, writable.
    ///
    /// # Safety
    ///
    /// The caller must own the slot exclusively while the slice lives: no
    /// other reader, writer or in-flight I/O.
    #[allow(clippy::mut_from_ref)] // shared memory: exclusivity is the slot protocol's
    pub unsafe fn slot_mut(&self, slot: u32) -> Option<&mut [u8]> {
        let ptr = self.slot_ptr(slot)?;
        // SAFETY: in range and valid (constructor); exclusive (caller).
        Some(unsafe { core::slice::from_raw_parts_mut(ptr, self.slot_bytes) })
    }
}

impl Drop for SlotRegion {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated in `heap` with this exact layout.
            unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_and_bounded() {
        let region = SlotRegion::heap(8192, 3).unwrap();
        assert_eq!(region.len(), 3 * 8192);
        for slot in 0..3 {
            assert_eq!(region.slot_ptr(slot).unwrap() as usize % 4096, 0);
        }
        assert!(region.slot_ptr(3).is_none());
        // SAFETY: the test owns the region and every slot.
        unsafe { region.slot_mut(1).unwrap()[0] = 7 };
        // SAFETY: as above; the mutable borrow has ended.
        assert_eq!(unsafe { region.slot(1) }.unwrap()[0], 7);
        // SAFETY: as above.
        assert!(unsafe { region.slot(3) }.is_none());
        assert!(matches!(SlotRegion::heap(1000, 3), Err(RegionError::Geometry { .. })));
        assert!(matches!(SlotRegion::heap(4096, 0), Err(RegionError::Geometry { .. })));
    }
}
