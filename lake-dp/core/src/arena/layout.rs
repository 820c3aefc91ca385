//! The arena's bytes. Everything is little-endian and at fixed offsets:
//!
//! ```text
//! page 0      ArenaHeader (offset 0, immutable once ready, CRC'd)
//!             ArenaControl (offset 2048: state, owner pid, claim counter)
//! 4096        generations: one u32 per slot (written by lake-dp only)
//! agents_off  agent records, `agent_stride` apart: AgentControl (64 bytes:
//!             owner, high-water mark), then `pins_per_agent` u64 pins
//!             (each written by its agent only)
//! slots_off   the slots, size class after size class (version 1), or
//!             chunks every class may use (version 2, shared classes);
//!             page aligned, so the slot area alone is what CUDA and RDMA
//!             register
//! ```
//!
//! A partitioned arena (version 3) splits its slots into partitions, each
//! the same size classes over slots of its own, one after the other and
//! each starting on a page. Each partition is a file of its own, mapped at
//! its place in the slot area by the processes given it
//! ([`ArenaGeometry::partitions`]); the arena's own file ends where the
//! slot area starts, so it holds the records every process shares and no
//! block.
//!
//! [`decode_header`] is the one place that trusts nothing: every other
//! process's view of the arena goes through it.

use core::mem::{offset_of, size_of};
use core::sync::atomic::{AtomicU32, AtomicU64};

use bytemuck::{Pod, Zeroable};

use super::ArenaError;
use crate::constants::{DIRECT_IO_ALIGN_BYTES, SLOT_CLASSES_MAX};
use crate::region::{ClassSpan, SlotClass, check_spans, lay_out_classes, lay_out_shared_classes};

/// The first eight bytes of every L1 arena.
pub const ARENA_MAGIC: [u8; 8] = *b"LAKEL1A\0";

/// The layout version of an arena whose classes each own their slots:
/// what this build creates unless asked to share, and what every earlier
/// build reads.
pub const ARENA_VERSION: u32 = 1;

/// The layout version of an arena whose classes share chunks of memory
/// ([`crate::region::ClassSpan`]). A build that reads only version 1 says
/// so and does not attach.
pub const ARENA_VERSION_SHARED: u32 = 2;

/// The layout version of a partitioned arena: slots in partitions, each
/// partition past the first in a file of its own. A build that reads up to
/// version 2 says so and does not attach (it would map slots its process
/// was not given).
pub const ARENA_VERSION_PARTITIONED: u32 = 3;

/// Most partitions of one arena (each holds every size class).
pub const PARTITIONS_MAX: usize = SLOT_CLASSES_MAX;

/// Where [`ArenaControl`] lies in page 0.
pub const CONTROL_OFFSET: usize = 2048;

/// Where the generation array starts.
pub const GENERATIONS_OFFSET: u64 = 4096;

/// Bytes of an agent record before its pins.
pub const AGENT_CONTROL_BYTES: u64 = 64;

/// Most agents (engine processes) one arena serves.
pub const AGENTS_MAX: u32 = 1024;

/// Most pins one agent holds at once.
pub const PINS_PER_AGENT_MAX: u32 = 1 << 16;

/// Page sizes an arena may be backed by: base pages, 2 MiB and 1 GiB huge
/// pages.
pub const PAGE_BYTES_ALLOWED: [u64; 3] = [4096, 2 << 20, 1 << 30];

/// [`ArenaControl::state`] while the creator is still building the arena.
pub const STATE_BUILDING: u32 = 0;
/// [`ArenaControl::state`] once the arena may be attached to.
pub const STATE_READY: u32 = 0x5944_4552; // "REDY"
/// [`ArenaControl::state`] after its `lake-dp` retired it (shut down or
/// replaced it); attached agents should detach.
pub const STATE_RETIRED: u32 = 0x4552_5452; // "RTRE"

/// One size class as recorded in the header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ClassRecord {
    /// First slot number of the class.
    pub first_slot: u32,
    /// Slots in the class.
    pub slots: u32,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Offset of the class's first slot from the start of the slot area
    /// (0 for every class of a shared arena).
    pub offset: u64,
}

/// The header at offset 0. Written once by the creator before the state
/// turns ready, never again; attachers copy it out and check it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ArenaHeader {
    /// [`ARENA_MAGIC`].
    pub magic: [u8; 8],
    /// [`ARENA_VERSION`] or [`ARENA_VERSION_SHARED`].
    pub version: u32,
    /// `size_of::<ArenaHeader>()`, so a later version can grow it.
    pub header_bytes: u32,
    /// Bytes of the whole arena (the file's size).
    pub total_bytes: u64,
    /// Page size backing the arena (4 KiB, or a huge page size).
    pub page_bytes: u64,
    /// The node this arena belongs to.
    pub node: u32,
    /// The region id of the arena.
    pub region: u16,
    /// Size classes in use in [`ArenaHeader::classes`].
    pub class_count: u16,
    /// The region epoch of the `lake-dp` incarnation that created it.
    pub epoch: u64,
    /// Slots, all classes together.
    pub slots: u32,
    /// Agent records.
    pub agents_max: u32,
    /// Pins per agent record.
    pub pins_per_agent: u32,
    /// Version 2: bytes of one shared chunk. Version 1: zero.
    pub chunk_bytes: u32,
    /// Offset of the generation array ([`GENERATIONS_OFFSET`]).
    pub generations_offset: u64,
    /// Offset of the first agent record.
    pub agents_offset: u64,
    /// Bytes from one agent record to the next.
    pub agent_stride: u64,
    /// Offset of the slot area.
    pub slots_offset: u64,
    /// Bytes of the slot area.
    pub slots_bytes: u64,
    /// The size classes; unused records are zero. In a partitioned arena,
    /// partition after partition: `class_count / partitions` records each.
    pub classes: [ClassRecord; SLOT_CLASSES_MAX],
    /// Version 3: partitions, at least 2. Other versions: zero.
    pub partitions: u32,
    /// CRC32 of every byte before this field.
    pub crc: u32,
}

const _: () = assert!(offset_of!(ArenaHeader, magic) == 0);
const _: () = assert!(offset_of!(ArenaHeader, total_bytes) == 16);
const _: () = assert!(offset_of!(ArenaHeader, epoch) == 40);
const _: () = assert!(offset_of!(ArenaHeader, generations_offset) == 64);
const _: () = assert!(offset_of!(ArenaHeader, slots_bytes) == 96);
const _: () = assert!(offset_of!(ArenaHeader, classes) == 104);
const _: () = assert!(size_of::<ClassRecord>() == 24);
const _: () = assert!(offset_of!(ArenaHeader, crc) == 104 + 24 * SLOT_CLASSES_MAX + 4);
const _: () = assert!(size_of::<ArenaHeader>() == offset_of!(ArenaHeader, crc) + 4);
const _: () = assert!(size_of::<ArenaHeader>() <= CONTROL_OFFSET);

#[allow(clippy::cast_possible_truncation)] // asserted below
const HEADER_BYTES: u32 = size_of::<ArenaHeader>() as u32;
const _: () = assert!(HEADER_BYTES as usize == size_of::<ArenaHeader>());

/// The mutable words of page 0, shared by every process that maps the
/// arena. Only atomics, so any bit pattern another process leaves is a
/// valid value.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct ArenaControl {
    /// [`STATE_BUILDING`], [`STATE_READY`] or [`STATE_RETIRED`]; written by
    /// the creator only.
    pub state: AtomicU32,
    /// The creating process.
    pub owner_pid: AtomicU32,
    /// Agent claims so far; makes every claim's owner word unique.
    pub claims: AtomicU32,
    /// Zero.
    pub reserved: AtomicU32,
}

const _: () = assert!(size_of::<ArenaControl>() == 64);
const _: () = assert!(CONTROL_OFFSET + size_of::<ArenaControl>() <= DIRECT_IO_ALIGN_BYTES);
const _: () = assert!(CONTROL_OFFSET.is_multiple_of(64));

/// The head of one agent record.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct AgentControl {
    /// 0 when free; else `pid << 32 | claim number`, set by the claiming
    /// agent (compare-and-swap from 0) and cleared by it or, for a dead
    /// agent, by `lake-dp`.
    pub owner: AtomicU64,
    /// One past the highest pin entry the agent has used, so a scan stops
    /// there. Only grows while the record is owned.
    pub high_water: AtomicU32,
    /// Zero.
    pub reserved: AtomicU32,
}

const _: () = assert!(size_of::<AgentControl>() as u64 == AGENT_CONTROL_BYTES);

/// One partition of the slot area: slots numbered contiguously, bytes
/// one run, starting on a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionSpan {
    /// Its first slot.
    pub first_slot: u32,
    /// Its slots, all classes together.
    pub slots: u32,
    /// Offset of its first byte from the start of the slot area.
    pub offset: u64,
    /// Its bytes (a whole number of pages).
    pub bytes: u64,
    /// Its first size class (an index into the spans).
    pub first_class: usize,
}

impl PartitionSpan {
    /// Whether `slot` is in this partition.
    pub fn contains(&self, slot: u32) -> bool {
        slot >= self.first_slot && slot - self.first_slot < self.slots
    }
}

/// The arena's geometry, decoded and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaGeometry {
    /// The header, as checked.
    pub header: ArenaHeader,
    /// The size classes, offsets relative to the slot area.
    pub spans: heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>,
    /// The partitions: one covering every slot, unless the arena is
    /// partitioned (version 3).
    pub partitions: heapless::Vec<PartitionSpan, PARTITIONS_MAX>,
}

impl ArenaGeometry {
    /// Size classes per partition.
    pub fn classes_per_partition(&self) -> usize {
        self.spans.len() / self.partitions.len().max(1)
    }

    /// Whether the arena is partitioned (version 3).
    pub fn partitioned(&self) -> bool {
        self.header.version == ARENA_VERSION_PARTITIONED
    }

    /// Bytes of the arena's own file: everything, or in a partitioned
    /// arena its records (everything before the slot area).
    pub fn file_bytes(&self) -> u64 {
        if self.partitioned() { self.header.slots_offset } else { self.header.total_bytes }
    }

    /// The partition holding `slot`.
    pub fn partition_of(&self, slot: u32) -> Option<usize> {
        self.partitions.iter().position(|p| p.contains(slot))
    }
}

fn round_up(value: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

fn header_crc(header: &ArenaHeader) -> u32 {
    crc32fast::hash(&bytemuck::bytes_of(header)[..offset_of!(ArenaHeader, crc)])
}

/// What the creator asks for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan<'a> {
    pub classes: &'a [SlotClass],
    pub agents_max: u32,
    pub pins_per_agent: u32,
    pub page_bytes: u64,
    pub node: u32,
    pub region: u16,
    pub epoch: u64,
    /// Share chunks of this many bytes between the classes (0: each class
    /// owns its slots). The classes' slot counts then size the arena only.
    pub chunk_bytes: u64,
    /// Partitions (0 or 1: none): `classes` holds each partition's classes
    /// in turn, `classes.len() / partitions` of them each.
    pub partitions: u32,
}

/// Lays an arena out; the result passes [`decode_header`].
pub(super) fn plan(plan: &Plan<'_>) -> Result<ArenaGeometry, ArenaError> {
    let too_big = || ArenaError::Config("arena: sizes overflow");
    if !PAGE_BYTES_ALLOWED.contains(&plan.page_bytes) {
        return Err(ArenaError::Config("page size: 4 KiB, 2 MiB or 1 GiB"));
    }
    if plan.agents_max == 0 || plan.agents_max > AGENTS_MAX {
        return Err(ArenaError::Config("agents_max: between 1 and 1024"));
    }
    if plan.pins_per_agent == 0 || plan.pins_per_agent > PINS_PER_AGENT_MAX {
        return Err(ArenaError::Config("pins_per_agent: between 1 and 65536"));
    }
    let partitioned = plan.partitions > 1;
    let (spans, slots_bytes) = lay_out_slots(plan)?;
    let chunk_bytes = u32::try_from(plan.chunk_bytes).map_err(|_| ArenaError::Config("chunk_bytes: below 4 GiB"))?;
    let slots = spans.iter().map(|s| s.slots).sum::<u32>();
    let generations_bytes = round_up(u64::from(slots) * 4, 4096).ok_or_else(too_big)?;
    let agents_offset = GENERATIONS_OFFSET + generations_bytes;
    let agent_stride = round_up(AGENT_CONTROL_BYTES + 8 * u64::from(plan.pins_per_agent), 64).ok_or_else(too_big)?;
    let agents_bytes = round_up(agent_stride * u64::from(plan.agents_max), 4096).ok_or_else(too_big)?;
    let slots_offset = round_up(agents_offset + agents_bytes, plan.page_bytes).ok_or_else(too_big)?;
    let end = slots_offset.checked_add(slots_bytes).ok_or_else(too_big)?;
    let total_bytes = round_up(end, plan.page_bytes).ok_or_else(too_big)?;
    let mut classes = [ClassRecord::default(); SLOT_CLASSES_MAX];
    for (record, span) in classes.iter_mut().zip(&spans) {
        *record = ClassRecord {
            first_slot: span.first_slot,
            slots: span.slots,
            slot_bytes: span.slot_bytes,
            offset: span.offset,
        };
    }
    let mut header = ArenaHeader {
        magic: ARENA_MAGIC,
        version: match (partitioned, chunk_bytes) {
            (true, _) => ARENA_VERSION_PARTITIONED,
            (false, 0) => ARENA_VERSION,
            (false, _) => ARENA_VERSION_SHARED,
        },
        header_bytes: HEADER_BYTES,
        total_bytes,
        page_bytes: plan.page_bytes,
        node: plan.node,
        region: plan.region,
        class_count: u16::try_from(spans.len()).map_err(|_| ArenaError::Config("classes: too many"))?,
        epoch: plan.epoch,
        slots,
        agents_max: plan.agents_max,
        pins_per_agent: plan.pins_per_agent,
        chunk_bytes,
        generations_offset: GENERATIONS_OFFSET,
        agents_offset,
        agent_stride,
        slots_offset,
        slots_bytes,
        classes,
        partitions: if partitioned { plan.partitions } else { 0 },
        crc: 0,
    };
    header.crc = header_crc(&header);
    let geometry = decode_header(bytemuck::bytes_of(&header), u64::MAX)?;
    debug_assert!(geometry.header == header && geometry.spans == spans);
    Ok(geometry)
}

/// The size classes of `plan` laid out: each class its own slots, one
/// partition after another, or every class over shared chunks. Returns
/// the spans and the bytes they cover.
fn lay_out_slots(plan: &Plan<'_>) -> Result<(heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>, u64), ArenaError> {
    let too_big = || ArenaError::Config("arena: sizes overflow");
    if plan.partitions > 1 {
        if plan.chunk_bytes != 0 || !plan.classes.len().is_multiple_of(plan.partitions as usize) {
            return Err(ArenaError::Config("partitions: each holds the same fixed size classes (no shared chunks)"));
        }
        return lay_out_partitions(plan.classes, plan.partitions as usize, plan.page_bytes);
    }
    if plan.chunk_bytes == 0 {
        return lay_out_classes(plan.classes).map_err(ArenaError::Region);
    }
    let wanted = plan
        .classes
        .iter()
        .try_fold(0u64, |sum, c| sum.checked_add(c.slot_bytes.checked_mul(u64::from(c.slots))?))
        .ok_or_else(too_big)?;
    let chunks = u32::try_from(wanted.div_ceil(plan.chunk_bytes.max(1))).map_err(|_| too_big())?;
    lay_out_shared_classes(plan.classes, plan.chunk_bytes, chunks).map_err(ArenaError::Region)
}

/// Lays `partitions` runs of the same size classes out one after the
/// other, each starting on a page of `page_bytes`.
fn lay_out_partitions(
    classes: &[SlotClass],
    partitions: usize,
    page_bytes: u64,
) -> Result<(heapless::Vec<ClassSpan, SLOT_CLASSES_MAX>, u64), ArenaError> {
    let too_big = || ArenaError::Config("arena: sizes overflow");
    let per = classes.len() / partitions;
    let (mut spans, _) = lay_out_classes(classes).map_err(ArenaError::Region)?;
    let mut shift = 0u64;
    let mut end = 0u64;
    for (index, span) in spans.iter_mut().enumerate() {
        if index % per == 0 {
            if classes[index..index + per].iter().zip(&classes[..per]).any(|(a, b)| a.slot_bytes != b.slot_bytes) {
                return Err(ArenaError::Config("partitions: each holds the same size classes"));
            }
            let start = span.offset.checked_add(shift).ok_or_else(too_big)?;
            shift += round_up(start, page_bytes).ok_or_else(too_big)? - start;
        }
        span.offset += shift;
        end = span.offset.checked_add(span.bytes()).ok_or_else(too_big)?;
    }
    Ok((spans, round_up(end, page_bytes).ok_or_else(too_big)?))
}

/// Reads and checks the header at the start of `page`, for an arena file of
/// `file_bytes` bytes (`u64::MAX`: not checked). Names the first field
/// that is wrong.
pub fn decode_header(page: &[u8], file_bytes: u64) -> Result<ArenaGeometry, ArenaError> {
    let bad = ArenaError::Header;
    let bytes = page.get(..size_of::<ArenaHeader>()).ok_or(bad("too short to hold an arena header"))?;
    let header: ArenaHeader = bytemuck::pod_read_unaligned(bytes);
    if header.magic != ARENA_MAGIC {
        return Err(bad("magic: not a Lake L1 arena"));
    }
    if !(ARENA_VERSION..=ARENA_VERSION_PARTITIONED).contains(&header.version) {
        return Err(ArenaError::Version { found: header.version, supported: ARENA_VERSION_PARTITIONED });
    }
    if header.header_bytes != HEADER_BYTES {
        return Err(bad("header_bytes"));
    }
    if header.crc != header_crc(&header) {
        return Err(bad("crc: the header is damaged"));
    }
    let partitioned = header.version == ARENA_VERSION_PARTITIONED;
    if !partitioned && header.partitions != 0 {
        return Err(bad("partitions: set in a partitioned arena (version 3) alone"));
    }
    if (header.version == ARENA_VERSION_SHARED) != (header.chunk_bytes != 0) {
        return Err(bad("chunk_bytes: set in a shared arena (version 2) alone"));
    }
    if !PAGE_BYTES_ALLOWED.contains(&header.page_bytes) {
        return Err(bad("page_bytes"));
    }
    if !partitioned && file_bytes != u64::MAX && header.total_bytes != file_bytes {
        return Err(bad("total_bytes differs from the file's size"));
    }
    if !header.total_bytes.is_multiple_of(header.page_bytes) {
        return Err(bad("total_bytes is not a whole number of pages"));
    }
    if header.slots == 0 {
        return Err(bad("slots"));
    }
    if header.agents_max == 0 || header.agents_max > AGENTS_MAX {
        return Err(bad("agents_max"));
    }
    if header.pins_per_agent == 0 || header.pins_per_agent > PINS_PER_AGENT_MAX {
        return Err(bad("pins_per_agent"));
    }
    if header.generations_offset != GENERATIONS_OFFSET {
        return Err(bad("generations_offset"));
    }
    let generations_end = GENERATIONS_OFFSET + u64::from(header.slots) * 4;
    if header.agents_offset < generations_end || !header.agents_offset.is_multiple_of(4096) {
        return Err(bad("agents_offset"));
    }
    let stride_min = AGENT_CONTROL_BYTES + 8 * u64::from(header.pins_per_agent);
    if header.agent_stride < stride_min || !header.agent_stride.is_multiple_of(64) {
        return Err(bad("agent_stride"));
    }
    let agents_end = header
        .agent_stride
        .checked_mul(u64::from(header.agents_max))
        .and_then(|bytes| bytes.checked_add(header.agents_offset))
        .ok_or(bad("agent_stride"))?;
    if header.slots_offset < agents_end || !header.slots_offset.is_multiple_of(header.page_bytes) {
        return Err(bad("slots_offset"));
    }
    let slots_end = header.slots_offset.checked_add(header.slots_bytes).ok_or(bad("slots_bytes"))?;
    if slots_end > header.total_bytes {
        return Err(bad("slots_bytes runs past the end of the arena"));
    }
    let count = usize::from(header.class_count);
    if count == 0 || count > SLOT_CLASSES_MAX {
        return Err(bad("class_count"));
    }
    if header.classes[count..].iter().any(|record| *record != ClassRecord::default()) {
        return Err(bad("classes: unused records are not zero"));
    }
    let chunk_bytes = u64::from(header.chunk_bytes);
    let mut spans = heapless::Vec::new();
    for record in &header.classes[..count] {
        let span = if chunk_bytes == 0 {
            ClassSpan::fixed(record.first_slot, record.slots, record.slot_bytes, record.offset)
        } else {
            let chunk_slots = chunk_bytes.checked_div(record.slot_bytes).ok_or(bad("classes"))?;
            ClassSpan {
                first_slot: record.first_slot,
                slots: record.slots,
                slot_bytes: record.slot_bytes,
                offset: record.offset,
                chunk_slots: u32::try_from(chunk_slots).map_err(|_| bad("classes"))?,
                chunk_bytes,
            }
        };
        spans.push(span).map_err(|_| bad("class_count"))?;
    }
    let slots = check_spans(&spans, header.slots_bytes, chunk_bytes).map_err(|_| bad("classes"))?;
    if slots != header.slots {
        return Err(bad("slots differs from the size classes"));
    }
    let partitions = if partitioned { decode_partitions(&header, &spans)? } else { whole(&header) };
    let geometry = ArenaGeometry { header, spans, partitions };
    if partitioned && file_bytes != u64::MAX && geometry.file_bytes() != file_bytes {
        return Err(bad("the arena's file does not end where the slot area starts"));
    }
    Ok(geometry)
}

/// The one partition of an arena that is not partitioned.
fn whole(header: &ArenaHeader) -> heapless::Vec<PartitionSpan, PARTITIONS_MAX> {
    let all =
        PartitionSpan { first_slot: 0, slots: header.slots, offset: 0, bytes: header.slots_bytes, first_class: 0 };
    heapless::Vec::from_slice(&[all]).unwrap_or_default()
}

/// The partitions of a partitioned arena's checked spans: each the same
/// classes, each starting on a page and holding whole pages.
fn decode_partitions(
    header: &ArenaHeader,
    spans: &[ClassSpan],
) -> Result<heapless::Vec<PartitionSpan, PARTITIONS_MAX>, ArenaError> {
    let bad = ArenaError::Header;
    let count = header.partitions as usize;
    if !(2..=PARTITIONS_MAX).contains(&count) || !spans.len().is_multiple_of(count) {
        return Err(bad("partitions"));
    }
    let per = spans.len() / count;
    let mut partitions = heapless::Vec::new();
    for (index, run) in spans.chunks(per).enumerate() {
        if run.iter().zip(&spans[..per]).any(|(a, b)| a.slot_bytes != b.slot_bytes) {
            return Err(bad("partitions: not every partition holds the same size classes"));
        }
        let last = run[per - 1];
        let end = last.offset + last.bytes();
        let next = spans.get((index + 1) * per).map_or(header.slots_bytes, |s| s.offset);
        let partition = PartitionSpan {
            first_slot: run[0].first_slot,
            slots: run.iter().map(|s| s.slots).sum(),
            offset: run[0].offset,
            bytes: next - run[0].offset,
            first_class: index * per,
        };
        if !partition.offset.is_multiple_of(header.page_bytes)
            || !partition.bytes.is_multiple_of(header.page_bytes)
            || end > next
        {
            return Err(bad("partitions: a partition does not hold whole pages"));
        }
        partitions.push(partition).map_err(|_| bad("partitions"))?;
    }
    Ok(partitions)
}

/// The atomics' types must match the header's word sizes.
const _: () = assert!(size_of::<AtomicU32>() == 4 && size_of::<AtomicU64>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    const CLASSES: [SlotClass; 2] =
        [SlotClass { slot_bytes: 8192, slots: 10 }, SlotClass { slot_bytes: 20480, slots: 3 }];

    /// Two classes (13 slots), 4 agents of 100 pins, classes of their own
    /// (`chunk_bytes` 0) or sharing chunks.
    fn sample_plan(chunk_bytes: u64) -> Plan<'static> {
        Plan {
            classes: &CLASSES,
            agents_max: 4,
            pins_per_agent: 100,
            page_bytes: 4096,
            node: 7,
            region: 3,
            epoch: 9,
            chunk_bytes,
            partitions: 0,
        }
    }

    fn sample() -> ArenaGeometry {
        plan(&sample_plan(0)).unwrap()
    }

    #[test]
    fn a_plan_decodes_to_itself() {
        let geometry = sample();
        let header = &geometry.header;
        assert_eq!(header.slots, 13);
        assert_eq!(header.agent_stride, 896, "64 + 800 rounded up to a cache line");
        assert!(header.slots_offset >= header.agents_offset + 4 * 896);
        assert_eq!(header.total_bytes, header.slots_offset + 10 * 8192 + 3 * 20480);
        let decoded = decode_header(bytemuck::bytes_of(header), header.total_bytes).unwrap();
        assert_eq!(decoded, geometry);
    }

    #[test]
    fn a_shared_plan_lays_every_class_over_the_same_chunks() {
        let shared = sample_plan(40960);
        let geometry = plan(&shared).unwrap();
        let header = &geometry.header;
        // 10 * 8 KiB + 3 * 20 KiB = 140 KiB: four 40 KiB chunks.
        assert_eq!((header.version, header.slots_bytes), (ARENA_VERSION_SHARED, 4 * 40960));
        assert_eq!((geometry.spans[0].slots, geometry.spans[1].slots, header.slots), (20, 8, 28));
        assert_eq!(decode_header(bytemuck::bytes_of(header), header.total_bytes).unwrap(), geometry);
        let mut damaged = *header;
        damaged.classes[1].offset = 4096;
        damaged.crc = header_crc(&damaged);
        let err = decode_header(bytemuck::bytes_of(&damaged), header.total_bytes).unwrap_err().to_string();
        assert!(err.contains("classes"), "{err}");
        assert!(plan(&Plan { chunk_bytes: 16384, ..shared }).is_err(), "a chunk smaller than a slot");
    }

    #[test]
    fn huge_pages_align_the_slot_area() {
        let classes = [SlotClass { slot_bytes: 4096, slots: 1 }];
        let geometry = plan(&Plan {
            classes: &classes,
            agents_max: 1,
            pins_per_agent: 1,
            page_bytes: 2 << 20,
            node: 0,
            region: 0,
            epoch: 1,
            chunk_bytes: 0,
            partitions: 0,
        })
        .unwrap();
        assert_eq!(geometry.header.slots_offset, 2 << 20);
        assert_eq!(geometry.header.total_bytes, 4 << 20);
    }

    #[test]
    fn every_damaged_field_is_named() {
        let good = sample().header;
        let len = good.total_bytes;
        let check = |edit: &dyn Fn(&mut ArenaHeader), reseal: bool, expect: &str| {
            let mut header = good;
            edit(&mut header);
            if reseal {
                header.crc = header_crc(&header);
            }
            let err = decode_header(bytemuck::bytes_of(&header), len).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: got {err}");
        };
        check(&|h| h.magic[0] = b'X', false, "magic");
        check(&|h| h.version = 4, false, "version 4");
        check(&|h| h.version = 2, true, "chunk_bytes");
        check(&|h| h.chunk_bytes = 40960, true, "chunk_bytes");
        check(&|h| h.slots += 1, false, "crc");
        check(&|h| h.total_bytes += 4096, true, "total_bytes");
        check(&|h| h.page_bytes = 8192, true, "page_bytes");
        check(&|h| h.agents_max = 0, true, "agents_max");
        check(&|h| h.pins_per_agent = PINS_PER_AGENT_MAX + 1, true, "pins_per_agent");
        check(&|h| h.agents_offset = 4096, true, "agents_offset");
        check(&|h| h.agent_stride = 64, true, "agent_stride");
        check(&|h| h.slots_offset -= 4096, true, "slots_offset");
        check(&|h| h.slots_bytes += 4096, true, "slots_bytes");
        check(&|h| h.class_count = 9, true, "class_count");
        check(&|h| h.classes[5].slots = 1, true, "unused records");
        check(&|h| h.classes[1].first_slot = 11, true, "classes");
        check(&|h| h.slots = 12, true, "slots");
        check(&|h| h.partitions = 2, true, "partitions");
        assert!(decode_header(&bytemuck::bytes_of(&good)[..100], len).is_err());
    }

    #[test]
    fn partitions_each_start_on_a_page_and_the_arenas_file_holds_no_slot() {
        // Two classes in each of three partitions: 3 + 1 slots of 8 KiB and
        // 20 KiB each (44 KiB).
        let classes = [
            SlotClass { slot_bytes: 8192, slots: 3 },
            SlotClass { slot_bytes: 20480, slots: 1 },
            SlotClass { slot_bytes: 8192, slots: 3 },
            SlotClass { slot_bytes: 20480, slots: 1 },
            SlotClass { slot_bytes: 8192, slots: 3 },
            SlotClass { slot_bytes: 20480, slots: 1 },
        ];
        let geometry = plan(&Plan { classes: &classes, partitions: 3, ..sample_plan(0) }).unwrap();
        let header = &geometry.header;
        assert_eq!((header.version, header.partitions, header.slots), (ARENA_VERSION_PARTITIONED, 3, 12));
        let spans: Vec<_> = geometry.partitions.iter().map(|p| (p.first_slot, p.slots, p.offset, p.bytes)).collect();
        assert_eq!(spans, [(0, 4, 0, 45056), (4, 4, 45056, 45056), (8, 4, 90112, 45056)]);
        assert_eq!(geometry.classes_per_partition(), 2);
        assert_eq!((geometry.partition_of(5), geometry.partition_of(12)), (Some(1), None));
        assert_eq!(geometry.file_bytes(), header.slots_offset);
        assert_eq!(header.total_bytes, header.slots_offset + 3 * 45056);
        assert_eq!(decode_header(bytemuck::bytes_of(header), geometry.file_bytes()).unwrap(), geometry);
        let err = decode_header(bytemuck::bytes_of(header), header.total_bytes).unwrap_err().to_string();
        assert!(err.contains("slot area starts"), "{err}");
        // A partition that would not start on a page is refused by name.
        let mut damaged = *header;
        damaged.classes[2].offset -= 4096;
        damaged.crc = header_crc(&damaged);
        assert!(decode_header(bytemuck::bytes_of(&damaged), u64::MAX).is_err());
        let mut mixed = classes;
        mixed[4].slot_bytes = 12288;
        assert!(plan(&Plan { classes: &mixed, partitions: 3, ..sample_plan(0) }).is_err());
        assert!(plan(&Plan { classes: &classes, partitions: 3, ..sample_plan(40960) }).is_err());
        assert!(plan(&Plan { classes: &classes, partitions: 4, ..sample_plan(0) }).is_err());
        // On huge pages each partition starts on one.
        let huge = plan(&Plan { classes: &classes, partitions: 3, page_bytes: 2 << 20, ..sample_plan(0) }).unwrap();
        let offsets: Vec<_> = huge.partitions.iter().map(|p| (p.offset, p.bytes)).collect();
        assert_eq!(offsets, [(0, 2 << 20), (2 << 20, 2 << 20), (4 << 20, 2 << 20)]);
        assert_eq!(huge.header.total_bytes, huge.header.slots_offset + (6 << 20));
    }
}
