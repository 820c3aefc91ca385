//! The CUDA C source of the kernels, compiled at run time with NVRTC.
//!
//! Thread blocks per (piece, block of the batch, chunk of the piece), so
//! a small batch still spreads over many SMs: a piece is one (layer,
//! plane) of the engine's paged KV, addressed by its base and the byte
//! strides of blocks, tokens and heads (the same description the host path
//! uses, `lake-ffi`'s `LakeKvPiece`). The pool side is Lake's canonical
//! payload order — piece after piece, each `[tokens][heads][head bytes]` —
//! at a device-accessible address per block (pinned host memory registered
//! with the driver, or device memory). 16-byte words when every address and
//! stride allows, bytes otherwise.

/// Names of the kernels in [`SOURCE`].
pub const GATHER: &str = "lake_gather";
/// See [`GATHER`].
pub const SCATTER: &str = "lake_scatter";
/// See [`GATHER`]: the CRC of every chunk of every block's payload.
pub const CRC_CHUNKS: &str = "lake_crc_chunks";
/// See [`GATHER`]: chunk CRCs folded into segment CRCs.
pub const CRC_FOLD: &str = "lake_crc_fold";

/// The kernels.
pub const SOURCE: &str = r#"
struct Piece {
    unsigned long long base;
    long long block_stride;
    long long token_stride;
    long long head_stride;
};

typedef unsigned long long u64;

// Copies one piece of one block between engine memory and the payload,
// `to_payload` choosing the direction.
__device__ __forceinline__ void copy_piece(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece, bool to_payload)
{
    const unsigned int p = first_piece + blockIdx.x;
    const unsigned int i = blockIdx.y;
    const Piece pc = pieces[p];
    const u64 piece_bytes = (u64)tokens * heads * head_bytes;
    unsigned char* payload = (unsigned char*)(payloads[i] + (u64)p * piece_bytes);
    unsigned char* engine = (unsigned char*)(pc.base + (long long)engine_blocks[i] * pc.block_stride);
    const unsigned int units = tokens * heads;
    const bool words = ((pc.base | (u64)pc.block_stride | (u64)pc.token_stride | (u64)pc.head_stride
                         | (u64)head_bytes | payloads[i] | piece_bytes) & 15) == 0;
    if (words) {
        const unsigned int per_unit = head_bytes / 16;
        const u64 total = (u64)units * per_unit;
        const u64 share = (total + gridDim.z - 1) / gridDim.z;
        const u64 end = min(total, share * (blockIdx.z + 1));
        for (u64 x = share * blockIdx.z + threadIdx.x; x < end; x += blockDim.x) {
            const unsigned int unit = (unsigned int)(x / per_unit);
            const unsigned int w = (unsigned int)(x % per_unit);
            const unsigned int t = unit / heads;
            const unsigned int h = unit % heads;
            uint4* e = (uint4*)(engine + t * pc.token_stride + h * pc.head_stride + (u64)w * 16);
            uint4* q = (uint4*)(payload + x * 16);
            if (to_payload) { *q = *e; } else { *e = *q; }
        }
    } else {
        const u64 total = (u64)units * head_bytes;
        const u64 share = (total + gridDim.z - 1) / gridDim.z;
        const u64 end = min(total, share * (blockIdx.z + 1));
        for (u64 x = share * blockIdx.z + threadIdx.x; x < end; x += blockDim.x) {
            const unsigned int unit = (unsigned int)(x / head_bytes);
            const unsigned int b = (unsigned int)(x % head_bytes);
            const unsigned int t = unit / heads;
            const unsigned int h = unit % heads;
            unsigned char* e = engine + t * pc.token_stride + h * pc.head_stride + b;
            if (to_payload) { payload[x] = *e; } else { *e = payload[x]; }
        }
    }
}

__device__ unsigned int crc_table_entry(unsigned int n)
{
    unsigned int c = n;
    for (int k = 0; k < 8; k++) {
        c = (c & 1) ? (0xedb88320u ^ (c >> 1)) : (c >> 1);
    }
    return c;
}

// CRC-32 (IEEE, reflected, as crc32fast) of chunk `c` of the payload of
// engine block `engine_blocks[blockIdx.y]`, read from the engine's own
// memory in Lake's payload order. One thread per chunk.
extern "C" __global__ void lake_crc_chunks(
    const Piece* pieces, const unsigned int* engine_blocks, unsigned int* chunk_crcs,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes,
    unsigned int chunk_bytes, unsigned int chunks_per_block)
{
    __shared__ unsigned int table[256];
    for (unsigned int n = threadIdx.x; n < 256; n += blockDim.x) {
        table[n] = crc_table_entry(n);
    }
    __syncthreads();
    const unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int i = blockIdx.y;
    if (c >= chunks_per_block) {
        return;
    }
    const u64 piece_bytes = (u64)tokens * heads * head_bytes;
    const u64 end = (u64)(c + 1) * chunk_bytes;
    u64 off = (u64)c * chunk_bytes;
    unsigned int crc = 0xffffffffu;
    while (off < end) {
        const unsigned int p = (unsigned int)(off / piece_bytes);
        const u64 within = off % piece_bytes;
        const unsigned int unit = (unsigned int)(within / head_bytes);
        const unsigned int in_unit = (unsigned int)(within % head_bytes);
        const unsigned int t = unit / heads;
        const unsigned int h = unit % heads;
        const Piece pc = pieces[p];
        const unsigned char* src = (const unsigned char*)(pc.base
            + (long long)engine_blocks[i] * pc.block_stride + t * pc.token_stride + h * pc.head_stride) + in_unit;
        const u64 run = min((u64)(head_bytes - in_unit), end - off);
        for (u64 k = 0; k < run; k++) {
            crc = table[(crc ^ src[k]) & 0xffu] ^ (crc >> 8);
        }
        off += run;
    }
    chunk_crcs[(u64)i * chunks_per_block + c] = crc ^ 0xffffffffu;
}

// Folds equal-sized chunk CRCs into segment CRCs: crc(A||B) = shift(crc(A))
// ^ crc(B), `shift` (32 columns) moving a CRC past one chunk. One thread per
// segment of a block.
extern "C" __global__ void lake_crc_fold(
    const unsigned int* chunk_crcs, unsigned int* segment_crcs, const unsigned int* shift,
    unsigned int chunks_per_block, unsigned int chunks_per_segment, unsigned int segments_per_block)
{
    const unsigned int s = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int i = blockIdx.y;
    if (s >= segments_per_block) {
        return;
    }
    const unsigned int* chunks = chunk_crcs + (u64)i * chunks_per_block;
    const unsigned int first = s * chunks_per_segment;
    const unsigned int last = min(first + chunks_per_segment, chunks_per_block);
    unsigned int crc = chunks[first];
    for (unsigned int k = first + 1; k < last; k++) {
        unsigned int moved = 0;
        for (int b = 0; b < 32; b++) {
            if ((crc >> b) & 1u) {
                moved ^= shift[b];
            }
        }
        crc = moved ^ chunks[k];
    }
    segment_crcs[(u64)i * segments_per_block + s] = crc;
}

extern "C" __global__ void lake_gather(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece)
{
    copy_piece(pieces, engine_blocks, payloads, tokens, heads, head_bytes, first_piece, true);
}

extern "C" __global__ void lake_scatter(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece)
{
    copy_piece(pieces, engine_blocks, payloads, tokens, heads, head_bytes, first_piece, false);
}
"#;
