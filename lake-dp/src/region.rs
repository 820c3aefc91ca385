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
use std::sync::Arc;

use crate::constants::{DIRECT_IO_ALIGN_BYTES, SLOT_CLASSES_MAX};
use crate::usize_from;

/// Why a region could not be made.
#[derive(Debug)]
pub enum RegionError {
    /// A class with slot size zero or not a multiple of 4 KiB, or no
    /// slots; or classes that overlap, leave the memory, or are too many.
    Geometry(&'static str),
    /// The allocation or mapping failed.
    Memory(std::io::Error),
}

impl core::fmt::Display for RegionError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Geometry(what) => write!(f, "region geometry: {what}"),
            Self::Memory(e) => write!(f, "region memory: {e}"),
        }
    }
}

impl std::error::Error for RegionError {}

/// One size class asked for: `slots` slots of `slot_bytes` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotClass {
    /// Bytes per slot: the 4 KiB stored header plus the padded payload.
    pub slot_bytes: u64,
    /// Slots of this class.
    pub slots: u32,
}

/// Where a size class lies in a region. Slots are numbered across the
/// whole region: class `c` owns `first_slot .. first_slot + slots`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassSpan {
    /// The class's first slot number.
    pub first_slot: u32,
    /// Slots in the class.
    pub slots: u32,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Byte offset of the class's first slot from the region's base.
    pub offset: u64,
}

impl ClassSpan {
    /// Bytes the class covers.
    pub fn bytes(&self) -> u64 {
        self.slot_bytes * u64::from(self.slots)
    }

    /// Whether `slot` (a region-wide number) is in this class.
    pub fn contains(&self, slot: u32) -> bool {
        slot >= self.first_slot && slot - self.first_slot < self.slots
    }
}

/// Lays `classes` out back to back from offset 0, each 4 KiB aligned.
/// Returns the spans and the bytes they cover.
pub fn lay_out_classes(
    classes: &[SlotClass],
) -> Result<(heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>, u64), RegionError> {
    if classes.is_empty() || classes.len() > SLOT_CLASSES_MAX {
        return Err(RegionError::Geometry("between 1 and SLOT_CLASSES_MAX size classes"));
    }
    let mut spans = heapless::Vec::new();
    let mut offset = 0u64;
    let mut first_slot = 0u32;
    for class in classes {
        let span = ClassSpan { first_slot, slots: class.slots, slot_bytes: class.slot_bytes, offset };
        check_span(&span)?;
        offset = offset.checked_add(span.bytes()).ok_or(RegionError::Geometry("region size overflows"))?;
        first_slot = first_slot.checked_add(class.slots).ok_or(RegionError::Geometry("too many slots"))?;
        spans.push(span).map_err(|_| RegionError::Geometry("too many size classes"))?;
    }
    if first_slot == u32::MAX {
        return Err(RegionError::Geometry("too many slots"));
    }
    Ok((spans, offset))
}

fn check_span(span: &ClassSpan) -> Result<(), RegionError> {
    let align = DIRECT_IO_ALIGN_BYTES as u64;
    if span.slots == 0 {
        return Err(RegionError::Geometry("a size class has no slots"));
    }
    if span.slot_bytes == 0 || !span.slot_bytes.is_multiple_of(align) || span.slot_bytes > u64::from(u32::MAX) {
        return Err(RegionError::Geometry("slot size must be a positive multiple of 4096 below 4 GiB"));
    }
    if !span.offset.is_multiple_of(align) {
        return Err(RegionError::Geometry("a size class starts off a 4 KiB boundary"));
    }
    span.slot_bytes.checked_mul(u64::from(span.slots)).ok_or(RegionError::Geometry("size class overflows"))?;
    Ok(())
}

/// Checks that `spans` are valid, numbered contiguously from 0, do not
/// overlap and fit in `len` bytes. Returns the total slot count.
pub fn check_spans(spans: &[ClassSpan], len: u64) -> Result<u32, RegionError> {
    if spans.is_empty() || spans.len() > SLOT_CLASSES_MAX {
        return Err(RegionError::Geometry("between 1 and SLOT_CLASSES_MAX size classes"));
    }
    let mut next_slot = 0u32;
    let mut end_prev = 0u64;
    for span in spans {
        check_span(span)?;
        if span.first_slot != next_slot {
            return Err(RegionError::Geometry("size classes must number slots contiguously from 0"));
        }
        if span.offset < end_prev {
            return Err(RegionError::Geometry("size classes overlap or are out of order"));
        }
        end_prev = span.offset.checked_add(span.bytes()).ok_or(RegionError::Geometry("size class overflows"))?;
        if end_prev > len {
            return Err(RegionError::Geometry("a size class runs past the end of the memory"));
        }
        next_slot = next_slot.checked_add(span.slots).ok_or(RegionError::Geometry("too many slots"))?;
    }
    if next_slot == u32::MAX {
        return Err(RegionError::Geometry("too many slots"));
    }
    Ok(next_slot)
}

enum Backing {
    Heap(std::alloc::Layout),
    /// Memory owned elsewhere, kept alive by this handle (a shared-memory
    /// mapping).
    Shared(#[allow(dead_code)] Arc<dyn Send + Sync>),
    /// Memory the caller keeps alive (`from_raw`).
    Borrowed,
}

/// Memory carved into fixed-size slots, in up to [`SLOT_CLASSES_MAX`] size
/// classes, every slot 4 KiB aligned.
pub struct SlotRegion {
    base: NonNull<u8>,
    len: usize,
    spans: heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>,
    slots: u32,
    backing: Backing,
}

impl core::fmt::Debug for SlotRegion {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SlotRegion").field("len", &self.len).field("spans", &self.spans).finish()
    }
}

// SAFETY: the region is plain memory addressed through raw pointers; every
// access goes through the slot protocol documented above, which is what
// makes concurrent use from several threads sound.
unsafe impl Send for SlotRegion {}
// SAFETY: as for Send: shared access is coordinated by the slot protocol.
unsafe impl Sync for SlotRegion {}

impl SlotRegion {
    /// A zeroed one-class region on the heap (tests, simulation, and
    /// engines that do not share their L1 with other processes).
    pub fn heap(slot_bytes: u64, slots: u32) -> Result<Self, RegionError> {
        Self::heap_classes(&[SlotClass { slot_bytes, slots }])
    }

    /// A zeroed region of several size classes on the heap.
    pub fn heap_classes(classes: &[SlotClass]) -> Result<Self, RegionError> {
        let (spans, bytes) = lay_out_classes(classes)?;
        // Checked before allocating: nothing to free on an error.
        let slots = check_spans(&spans, bytes)?;
        let len = usize::try_from(bytes).map_err(|_| RegionError::Geometry("region too large"))?;
        let layout = std::alloc::Layout::from_size_align(len, DIRECT_IO_ALIGN_BYTES)
            .map_err(|_| RegionError::Geometry("region too large"))?;
        // SAFETY: the layout has a non-zero size (every class has slots of
        // at least 4 KiB).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(ptr).ok_or_else(|| RegionError::Memory(std::io::ErrorKind::OutOfMemory.into()))?;
        Ok(Self { base, len, spans, slots, backing: Backing::Heap(layout) })
    }

    /// A one-class region over memory someone else owns.
    ///
    /// # Safety
    ///
    /// `base` must be valid for `slot_bytes * slots` bytes for as long as
    /// the returned region lives.
    pub unsafe fn from_raw(base: NonNull<u8>, slot_bytes: u64, slots: u32) -> Result<Self, RegionError> {
        let (spans, bytes) = lay_out_classes(&[SlotClass { slot_bytes, slots }])?;
        // SAFETY: valid for `bytes` (caller), which is what the spans cover.
        unsafe { Self::from_spans(base, bytes, &spans, None) }
    }

    /// A region over `len` bytes at `base` laid out as `spans`, kept alive
    /// by `keeper` when given.
    ///
    /// # Safety
    ///
    /// `base` must be valid for `len` bytes for as long as the returned
    /// region lives — guaranteed by `keeper` when it owns the memory,
    /// otherwise by the caller.
    pub unsafe fn from_spans(
        base: NonNull<u8>,
        len: u64,
        spans: &[ClassSpan],
        keeper: Option<Arc<dyn Send + Sync>>,
    ) -> Result<Self, RegionError> {
        if !(base.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN_BYTES) {
            return Err(RegionError::Geometry("region base is not 4 KiB aligned"));
        }
        let slots = check_spans(spans, len)?;
        let len = usize::try_from(len).map_err(|_| RegionError::Geometry("region too large"))?;
        let spans = heapless::Vec::from_slice(spans).map_err(|_| RegionError::Geometry("too many size classes"))?;
        let backing = keeper.map_or(Backing::Borrowed, Backing::Shared);
        Ok(Self { base, len, spans, slots, backing })
    }

    /// The size classes.
    pub fn spans(&self) -> &[ClassSpan] {
        &self.spans
    }

    /// The largest slot.
    pub fn slot_bytes_max(&self) -> usize {
        self.spans.iter().map(|s| usize_from(s.slot_bytes)).max().unwrap_or(0)
    }

    /// Slots, all classes together.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: regions have at least one slot).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first byte (for registration with io_uring, CUDA, RDMA).
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// The size class of `slot`, or `None` out of range.
    #[inline]
    pub fn span_of(&self, slot: u32) -> Option<&ClassSpan> {
        self.spans.iter().find(|span| span.contains(slot))
    }

    /// Bytes of `slot`, or `None` out of range.
    #[inline]
    pub fn slot_len(&self, slot: u32) -> Option<usize> {
        self.span_of(slot).map(|span| usize_from(span.slot_bytes))
    }

    /// Pointer to the first byte of `slot`, or `None` out of range.
    #[inline]
    pub fn slot_ptr(&self, slot: u32) -> Option<*mut u8> {
        let span = self.span_of(slot)?;
        let offset = span.offset + u64::from(slot - span.first_slot) * span.slot_bytes;
        // In range (check_spans), so the offset stays inside the memory.
        Some(self.base.as_ptr().wrapping_add(usize_from(offset)))
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    ///
    /// Nobody may write the slot while the returned slice lives (the
    /// caller owns the slot, or holds a pin and no writer can own it).
    pub unsafe fn slot(&self, slot: u32) -> Option<&[u8]> {
        let ptr = self.slot_ptr(slot)?;
        let len = self.slot_len(slot)?;
        // SAFETY: in range and valid for the slot's length (constructor);
        // no concurrent writer (caller's contract).
        Some(unsafe { core::slice::from_raw_parts(ptr, len) })
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
        let len = self.slot_len(slot)?;
        // SAFETY: in range and valid (constructor); exclusive (caller).
        Some(unsafe { core::slice::from_raw_parts_mut(ptr, len) })
    }
}

impl Drop for SlotRegion {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated in `heap_classes` with this exact layout.
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
        assert!(matches!(SlotRegion::heap(1000, 3), Err(RegionError::Geometry(_))));
        assert!(matches!(SlotRegion::heap(4096, 0), Err(RegionError::Geometry(_))));
    }

    #[test]
    fn classes_number_slots_across_the_region() {
        let classes = [SlotClass { slot_bytes: 8192, slots: 2 }, SlotClass { slot_bytes: 12288, slots: 3 }];
        let region = SlotRegion::heap_classes(&classes).unwrap();
        assert_eq!(region.slots(), 5);
        assert_eq!(region.len(), 2 * 8192 + 3 * 12288);
        assert_eq!(region.slot_len(1), Some(8192));
        assert_eq!(region.slot_len(2), Some(12288));
        assert_eq!(region.slot_ptr(2).unwrap() as usize - region.base() as usize, 2 * 8192);
        assert_eq!(region.slot_ptr(4).unwrap() as usize - region.base() as usize, 2 * 8192 + 2 * 12288);
        assert!(region.slot_len(5).is_none());
        assert_eq!(region.slot_bytes_max(), 12288);
    }

    #[test]
    fn bad_spans_are_refused() {
        let good = ClassSpan { first_slot: 0, slots: 2, slot_bytes: 4096, offset: 0 };
        assert_eq!(check_spans(&[good], 8192).unwrap(), 2);
        assert!(check_spans(&[good], 8191).is_err(), "past the end");
        assert!(check_spans(&[ClassSpan { first_slot: 1, ..good }], 1 << 20).is_err(), "numbering gap");
        let second = ClassSpan { first_slot: 2, slots: 1, slot_bytes: 4096, offset: 4096 };
        assert!(check_spans(&[good, second], 1 << 20).is_err(), "overlap");
        assert!(check_spans(&[ClassSpan { offset: 100, ..good }], 1 << 20).is_err(), "unaligned");
        assert!(check_spans(&[], 1 << 20).is_err(), "no class");
        assert!(check_spans(&[good; SLOT_CLASSES_MAX + 1], 1 << 30).is_err(), "too many classes");
    }
}
