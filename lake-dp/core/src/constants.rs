//! Every fixed limit of the formats in one place, with the relations between
//! them asserted at compile time.

/// Size of a stored object's header, and the alignment of everything on an
/// O_DIRECT device.
pub const STORED_HEADER_BYTES: usize = 4096;

/// O_DIRECT alignment for offsets, lengths and buffers.
pub const DIRECT_IO_ALIGN_BYTES: usize = 4096;

/// Most segments (layers or layer groups) one stored object carries; each has
/// its own CRC32 in the 4 KiB header. The deepest models today have ~130
/// layers; this leaves room for per-layer segments of 900-layer stacks.
pub const SEGMENTS_MAX: usize = 960;

/// Largest payload of one stored object (a block or a state checkpoint).
pub const STORED_PAYLOAD_BYTES_MAX: u64 = 1 << 32;

/// Largest wire frame, header included. Bodies are bounded lists of fixed
/// records; nothing on the wire needs more.
pub const WIRE_FRAME_BYTES_MAX: usize = 1 << 20;

/// Most keys in one lookup request or reply.
pub const LOOKUP_KEYS_MAX: usize = 4096;

/// Most entries in one index delta.
pub const DELTA_ENTRIES_MAX: usize = 4096;

/// Tokens per block accepted by the key chain and the layout.
pub const BLOCK_TOKENS_MAX: u32 = 4096;

/// Largest engine page hash accepted as key material.
pub const ENGINE_HASH_BYTES_MAX: usize = 64;

const _: () = assert!(STORED_HEADER_BYTES.is_multiple_of(DIRECT_IO_ALIGN_BYTES));
const _: () = assert!(DIRECT_IO_ALIGN_BYTES.is_power_of_two());
// The fixed part of the stored header plus one CRC32 per segment fits.
const _: () = assert!(128 + SEGMENTS_MAX * 4 <= STORED_HEADER_BYTES - 4);
const _: () = assert!(WIRE_FRAME_BYTES_MAX.is_power_of_two());
const _: () = assert!(64 + LOOKUP_KEYS_MAX * 64 <= WIRE_FRAME_BYTES_MAX);
const _: () = assert!(64 + DELTA_ENTRIES_MAX * 128 <= WIRE_FRAME_BYTES_MAX);

/// Most slot size classes in one region (one per block layout a node
/// serves: a few models, K/V shards, recurrent-state checkpoints).
pub const SLOT_CLASSES_MAX: usize = 8;

/// Region records a mirror holds (region ids `0..MIRROR_REGIONS_MAX`).
pub const MIRROR_REGIONS_MAX: u32 = 1024;
