//! Tags: the 64-bit identity of an in-flight operation, as carried in an
//! io_uring `user_data`, an RDMA `wr_id` or a CUDA event slot.
//!
//! ```text
//! 63        48 47                  24 23                   0
//! | epoch (16) | slot (24)           | generation (24)      |
//! ```
//!
//! A completion is trusted only if its tag's epoch is the poller's, its slot
//! is in range and its generation is the slot's current one: anything else
//! is a stale completion (from before a restart, or for a slot already
//! reused) and is counted and dropped.

/// Most operation slots a tag can address.
pub const TAG_SLOTS_MAX: u32 = 1 << 24;

const GENERATION_BITS: u32 = 24;
const SLOT_BITS: u32 = 24;
const MASK_24: u64 = (1 << 24) - 1;
const MASK_16: u64 = (1 << 16) - 1;

/// An operation's tag. Build with [`Tag::new`]; compare with `==`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Tag(u64);

impl Tag {
    /// Packs `epoch` (low 16 bits), `slot` (< [`TAG_SLOTS_MAX`]) and
    /// `generation` (low 24 bits).
    pub fn new(epoch: u64, slot: u32, generation: u32) -> Self {
        debug_assert!(slot < TAG_SLOTS_MAX);
        Self(
            ((epoch & MASK_16) << (SLOT_BITS + GENERATION_BITS))
                | ((u64::from(slot) & MASK_24) << GENERATION_BITS)
                | (u64::from(generation) & MASK_24),
        )
    }

    /// The tag as carried by the hardware.
    pub fn raw(self) -> u64 {
        self.0
    }

    /// A tag read back from the hardware.
    pub fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The low 16 bits of the epoch.
    pub fn epoch_bits(self) -> u64 {
        self.0 >> (SLOT_BITS + GENERATION_BITS)
    }

    /// The slot.
    pub fn slot(self) -> u32 {
        // 24 bits always fit.
        u32::try_from((self.0 >> GENERATION_BITS) & MASK_24).unwrap_or(u32::MAX)
    }

    /// The low 24 bits of the generation.
    pub fn generation_bits(self) -> u32 {
        u32::try_from(self.0 & MASK_24).unwrap_or(u32::MAX)
    }

    /// Whether this tag names `slot` at `generation` in `epoch`.
    pub fn matches(self, epoch: u64, slot: u32, generation: u32) -> bool {
        self == Self::new(epoch, slot, generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_wrap() {
        let tag = Tag::new(0x1_2345, 0xab_cdef, 0x1ff_ffff);
        assert_eq!(tag.epoch_bits(), 0x2345);
        assert_eq!(tag.slot(), 0xab_cdef);
        assert_eq!(tag.generation_bits(), 0xff_ffff);
        assert!(tag.matches(0x2345, 0xab_cdef, 0xff_ffff));
        assert!(!tag.matches(0x2346, 0xab_cdef, 0xff_ffff));
        assert!(!tag.matches(0x2345, 0xab_cdef, 0xff_fffe));
        assert_eq!(Tag::from_raw(tag.raw()), tag);
    }
}
