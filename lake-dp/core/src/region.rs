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
///
/// A class's slots lie in chunks of `chunk_slots` slots, `chunk_bytes`
/// apart. In a region of *fixed* classes each class is one chunk of its
/// own, back to back with the next. In a region of *shared* classes every
/// class spans the same chunks of the same memory — slot `i` of every
/// class's chunk `k` lies in chunk `k` — and which class uses a chunk is
/// the allocator's choice ([`crate::arena::SlotTable`]): that is how
/// memory moves between classes without renumbering a slot.
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
    /// Slots per chunk (all of them in a fixed class).
    pub chunk_slots: u32,
    /// Bytes from one chunk to the next.
    pub chunk_bytes: u64,
}

impl ClassSpan {
    /// A fixed class: one chunk of `slots` slots at `offset`.
    pub fn fixed(first_slot: u32, slots: u32, slot_bytes: u64, offset: u64) -> Self {
        Self {
            first_slot,
            slots,
            slot_bytes,
            offset,
            chunk_slots: slots,
            chunk_bytes: slot_bytes.saturating_mul(u64::from(slots)),
        }
    }

    /// Bytes from the class's first slot to the end of its last chunk.
    pub fn bytes(&self) -> u64 {
        self.chunk_bytes.saturating_mul(u64::from(self.chunks()))
    }

    /// Chunks the class spans.
    pub fn chunks(&self) -> u32 {
        self.slots.checked_div(self.chunk_slots).unwrap_or(0)
    }

    /// Whether `slot` (a region-wide number) is in this class.
    pub fn contains(&self, slot: u32) -> bool {
        slot >= self.first_slot && slot - self.first_slot < self.slots
    }

    /// Byte offset of `slot` (in this class) from the region's base.
    #[inline]
    pub fn offset_of(&self, slot: u32) -> u64 {
        let index = slot - self.first_slot;
        let (chunk, within) = (index / self.chunk_slots, index % self.chunk_slots);
        self.offset + u64::from(chunk) * self.chunk_bytes + u64::from(within) * self.slot_bytes
    }

    /// The chunk `slot` (in this class) lies in.
    #[inline]
    pub fn chunk_of(&self, slot: u32) -> u32 {
        (slot - self.first_slot) / self.chunk_slots
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
        let span = ClassSpan::fixed(first_slot, class.slots, class.slot_bytes, offset);
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

/// Lays `classes` out over `chunks` shared chunks of `chunk_bytes` each:
/// every class spans all of them (see [`ClassSpan`]), and only the slot
/// sizes of `classes` count (how many slots each class uses at a time is
/// the allocator's). Returns the spans and the bytes they cover.
pub fn lay_out_shared_classes(
    classes: &[SlotClass],
    chunk_bytes: u64,
    chunks: u32,
) -> Result<(heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>, u64), RegionError> {
    if classes.is_empty() || classes.len() > SLOT_CLASSES_MAX {
        return Err(RegionError::Geometry("between 1 and SLOT_CLASSES_MAX size classes"));
    }
    check_chunk(chunk_bytes, chunks)?;
    let mut spans = heapless::Vec::new();
    let mut first_slot = 0u32;
    for class in classes {
        if class.slot_bytes == 0 || class.slot_bytes > chunk_bytes {
            return Err(RegionError::Geometry("a shared chunk must hold at least one slot of every class"));
        }
        let chunk_slots =
            u32::try_from(chunk_bytes / class.slot_bytes).map_err(|_| RegionError::Geometry("too many slots"))?;
        let slots = chunk_slots.checked_mul(chunks).ok_or(RegionError::Geometry("too many slots"))?;
        let span = ClassSpan { first_slot, slots, slot_bytes: class.slot_bytes, offset: 0, chunk_slots, chunk_bytes };
        check_span(&span)?;
        first_slot = first_slot.checked_add(slots).ok_or(RegionError::Geometry("too many slots"))?;
        spans.push(span).map_err(|_| RegionError::Geometry("too many size classes"))?;
    }
    if first_slot == u32::MAX {
        return Err(RegionError::Geometry("too many slots"));
    }
    Ok((spans, chunk_bytes * u64::from(chunks)))
}

fn check_chunk(chunk_bytes: u64, chunks: u32) -> Result<(), RegionError> {
    if chunk_bytes == 0
        || !chunk_bytes.is_multiple_of(DIRECT_IO_ALIGN_BYTES as u64)
        || chunk_bytes > u64::from(u32::MAX)
    {
        return Err(RegionError::Geometry("chunk size must be a positive multiple of 4096 below 4 GiB"));
    }
    if chunks == 0 {
        return Err(RegionError::Geometry("shared classes need at least one chunk"));
    }
    chunk_bytes.checked_mul(u64::from(chunks)).ok_or(RegionError::Geometry("region size overflows"))?;
    Ok(())
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
    if span.chunk_slots == 0 || !span.slots.is_multiple_of(span.chunk_slots) {
        return Err(RegionError::Geometry("a size class is not a whole number of chunks"));
    }
    let chunk_used = span.slot_bytes.checked_mul(u64::from(span.chunk_slots));
    if chunk_used.is_none_or(|used| used > span.chunk_bytes) {
        return Err(RegionError::Geometry("a chunk's slots run past the chunk"));
    }
    span.chunk_bytes.checked_mul(u64::from(span.chunks())).ok_or(RegionError::Geometry("size class overflows"))?;
    Ok(())
}

/// Checks that `spans` are valid, numbered contiguously from 0, and fit
/// in `len` bytes; fixed classes (`chunk_bytes` 0) must not overlap, shared
/// ones (`chunk_bytes` the chunk size) must each span the same chunks from
/// offset 0. Returns the total slot count.
pub fn check_spans(spans: &[ClassSpan], len: u64, chunk_bytes: u64) -> Result<u32, RegionError> {
    if spans.is_empty() || spans.len() > SLOT_CLASSES_MAX {
        return Err(RegionError::Geometry("between 1 and SLOT_CLASSES_MAX size classes"));
    }
    if chunk_bytes != 0 {
        check_chunk(chunk_bytes, spans[0].chunks())?;
    }
    let mut next_slot = 0u32;
    let mut end_prev = 0u64;
    for span in spans {
        check_span(span)?;
        if span.first_slot != next_slot {
            return Err(RegionError::Geometry("size classes must number slots contiguously from 0"));
        }
        if chunk_bytes != 0 {
            if span.offset != 0
                || span.chunk_bytes != chunk_bytes
                || u64::from(span.chunk_slots) != chunk_bytes / span.slot_bytes
                || span.chunks() != spans[0].chunks()
            {
                return Err(RegionError::Geometry("shared size classes must each fill the same chunks"));
            }
        } else if span.chunk_slots != span.slots {
            return Err(RegionError::Geometry("a fixed size class is one chunk"));
        } else if span.offset < end_prev {
            return Err(RegionError::Geometry("size classes overlap or are out of order"));
        }
        let end = span.offset.checked_add(span.bytes()).ok_or(RegionError::Geometry("size class overflows"))?;
        if end > len {
            return Err(RegionError::Geometry("a size class runs past the end of the memory"));
        }
        // Fixed classes follow each other; shared ones all start at 0.
        end_prev = end;
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
    /// The chunk size of shared classes; 0 for fixed ones.
    chunk_bytes: u64,
    /// The slots this process may touch (all, unless the memory is mapped
    /// here only in part: [`SlotRegion::restrict`]), and the bytes they lie
    /// in, as an offset from `base` and a length.
    visible: core::ops::Range<u32>,
    visible_bytes: (usize, usize),
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
        let slots = check_spans(&spans, bytes, 0)?;
        let len = usize::try_from(bytes).map_err(|_| RegionError::Geometry("region too large"))?;
        let layout = std::alloc::Layout::from_size_align(len, DIRECT_IO_ALIGN_BYTES)
            .map_err(|_| RegionError::Geometry("region too large"))?;
        // SAFETY: the layout has a non-zero size (every class has slots of
        // at least 4 KiB).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(ptr).ok_or_else(|| RegionError::Memory(std::io::ErrorKind::OutOfMemory.into()))?;
        let (visible, visible_bytes) = (0..slots, (0, len));
        Ok(Self { base, len, spans, slots, chunk_bytes: 0, visible, visible_bytes, backing: Backing::Heap(layout) })
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
        unsafe { Self::from_spans(base, bytes, &spans, 0, None) }
    }

    /// A region over `len` bytes at `base` laid out as `spans` (classes
    /// sharing chunks of `chunk_bytes`, or fixed ones for 0), kept alive by
    /// `keeper` when given.
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
        chunk_bytes: u64,
        keeper: Option<Arc<dyn Send + Sync>>,
    ) -> Result<Self, RegionError> {
        if !(base.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN_BYTES) {
            return Err(RegionError::Geometry("region base is not 4 KiB aligned"));
        }
        let slots = check_spans(spans, len, chunk_bytes)?;
        let len = usize::try_from(len).map_err(|_| RegionError::Geometry("region too large"))?;
        let spans = heapless::Vec::from_slice(spans).map_err(|_| RegionError::Geometry("too many size classes"))?;
        let backing = keeper.map_or(Backing::Borrowed, Backing::Shared);
        let (visible, visible_bytes) = (0..slots, (0, len));
        Ok(Self { base, len, spans, slots, chunk_bytes, visible, visible_bytes, backing })
    }

    /// The same region with only `slots` to hand out, lying in `len` bytes
    /// at `offset` from the base: the rest of the memory is not mapped in
    /// this process, so every other slot reads as out of range.
    #[must_use]
    pub fn restrict(mut self, slots: core::ops::Range<u32>, offset: u64, len: u64) -> Self {
        self.visible = slots.start.min(self.slots)..slots.end.min(self.slots);
        let offset = usize_from(offset).min(self.len);
        self.visible_bytes = (offset, usize_from(len).min(self.len - offset));
        self
    }

    /// The part of the memory this process maps: its first byte and
    /// length (for registration with CUDA and RDMA).
    pub fn visible_area(&self) -> (*mut u8, usize) {
        (self.base.as_ptr().wrapping_add(self.visible_bytes.0), self.visible_bytes.1)
    }

    /// The chunk size when the classes share chunks, else 0.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
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
        if !self.visible.contains(&slot) {
            return None;
        }
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
        let offset = self.span_of(slot)?.offset_of(slot);
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
        let good = ClassSpan::fixed(0, 2, 4096, 0);
        assert_eq!(check_spans(&[good], 8192, 0).unwrap(), 2);
        assert!(check_spans(&[good], 8191, 0).is_err(), "past the end");
        assert!(check_spans(&[ClassSpan { first_slot: 1, ..good }], 1 << 20, 0).is_err(), "numbering gap");
        let second = ClassSpan::fixed(2, 1, 4096, 4096);
        assert!(check_spans(&[good, second], 1 << 20, 0).is_err(), "overlap");
        assert!(check_spans(&[ClassSpan { offset: 100, ..good }], 1 << 20, 0).is_err(), "unaligned");
        assert!(check_spans(&[ClassSpan { chunk_slots: 1, ..good }], 1 << 20, 0).is_err(), "fixed in two chunks");
        assert!(check_spans(&[], 1 << 20, 0).is_err(), "no class");
        assert!(check_spans(&[good; SLOT_CLASSES_MAX + 1], 1 << 30, 0).is_err(), "too many classes");
        let next = ClassSpan::fixed(2, 1, 4096, 8192);
        assert_eq!(check_spans(&[good, next], 12288, 0).unwrap(), 3);
        assert!(check_spans(&[good, next], 12288, 8192).is_err(), "fixed spans read as shared");
    }

    #[test]
    fn shared_classes_lay_their_slots_over_the_same_chunks() {
        let classes = [SlotClass { slot_bytes: 8192, slots: 1 }, SlotClass { slot_bytes: 12288, slots: 1 }];
        let (spans, bytes) = lay_out_shared_classes(&classes, 32768, 3).unwrap();
        assert_eq!(bytes, 3 * 32768);
        assert_eq!((spans[0].chunk_slots, spans[0].slots), (4, 12));
        assert_eq!((spans[1].first_slot, spans[1].chunk_slots, spans[1].slots), (12, 2, 6));
        assert_eq!(check_spans(&spans, bytes, 32768).unwrap(), 18);
        let memory = SlotRegion::heap(32768, 3).unwrap();
        // SAFETY: `memory` covers the 3 chunks and outlives `region`.
        let region =
            unsafe { SlotRegion::from_spans(NonNull::new(memory.base()).unwrap(), bytes, &spans, 32768, None) }
                .unwrap();
        let at = |slot| region.slot_ptr(slot).unwrap() as usize - region.base() as usize;
        assert_eq!((at(0), at(3), at(4), at(11)), (0, 3 * 8192, 32768, 2 * 32768 + 3 * 8192));
        assert_eq!((at(12), at(13), at(14), at(17)), (0, 12288, 32768, 2 * 32768 + 12288));
        assert_eq!((spans[0].chunk_of(5), spans[1].chunk_of(15)), (1, 1));
        assert_eq!(region.slot_len(13), Some(12288));
        assert!(region.slot_ptr(18).is_none());
        assert_eq!(region.chunk_bytes(), 32768);
        assert!(check_spans(&spans, bytes - 4096, 32768).is_err(), "past the end");
        assert!(check_spans(&spans, bytes, 0).is_err(), "shared spans read as fixed");
        let mut moved = spans.clone();
        moved[1].offset = 4096;
        assert!(check_spans(&moved, 1 << 20, 32768).is_err(), "a shared class off the chunks");
        let mut short = spans.clone();
        short[1].slots -= 2;
        assert!(check_spans(&short, 1 << 20, 32768).is_err(), "a shared class over fewer chunks");
        let big = [SlotClass { slot_bytes: 65536, slots: 1 }];
        assert!(lay_out_shared_classes(&big, 32768, 3).is_err(), "a slot larger than a chunk");
        assert!(lay_out_shared_classes(&classes, 32768 + 100, 3).is_err(), "an unaligned chunk");
        assert!(lay_out_shared_classes(&classes, 32768, 0).is_err(), "no chunk");
    }
}
