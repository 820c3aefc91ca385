//! The CUDA C source of the kernels, compiled at run time with NVRTC.
//!
//! Work items of (piece, block of the batch, part of the piece), so a
//! small batch still spreads over many SMs: a piece is one (layer,
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
/// See [`GATHER`]: the CRC of every chunk of payload runs laid out one
/// after another (a staging unit in HBM).
pub const CRC_RUNS: &str = "lake_crc_runs";

/// The kernels.
pub const SOURCE: &str = r#"
struct Piece {
    unsigned long long base;
    long long block_stride;
    long long token_stride;
    long long head_stride;
};

typedef unsigned long long u64;

// Copies part `part` of `parts` of piece `p` of block `i` of the batch
// between engine memory and the payload, `to_payload` choosing the
// direction.
__device__ __forceinline__ void copy_piece(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int p, unsigned int i,
    unsigned int part, unsigned int parts, bool to_payload)
{
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
        const u64 share = (total + parts - 1) / parts;
        const u64 end = min(total, share * (part + 1));
        for (u64 x = share * part + threadIdx.x; x < end; x += blockDim.x) {
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
        const u64 share = (total + parts - 1) / parts;
        const u64 end = min(total, share * (part + 1));
        for (u64 x = share * part + threadIdx.x; x < end; x += blockDim.x) {
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

// The four slice-by-4 tables in shared memory: table k, entry n = the CRC
// register after byte n and k zero bytes. Every thread of the block calls
// it (it synchronizes them).
__device__ void crc_tables(unsigned int* t)
{
    for (unsigned int n = threadIdx.x; n < 256; n += blockDim.x) {
        unsigned int c = crc_table_entry(n);
        t[n] = c;
        for (int k = 1; k < 4; k++) {
            c = (c >> 8) ^ crc_table_entry(c & 0xffu);
            t[k * 256 + n] = c;
        }
    }
    __syncthreads();
}

// Four bytes (little-endian in `w`) into the CRC register.
__device__ __forceinline__ unsigned int crc_word(const unsigned int* t, unsigned int crc, unsigned int w)
{
    crc ^= w;
    return t[768 + (crc & 0xffu)] ^ t[512 + ((crc >> 8) & 0xffu)] ^ t[256 + ((crc >> 16) & 0xffu)] ^ t[crc >> 24];
}

// `len` bytes at `src` into the CRC register: 16-byte loads where the
// address and length allow, words, else bytes.
__device__ __forceinline__ unsigned int crc_run(const unsigned int* t, unsigned int crc, const unsigned char* src, u64 len)
{
    if ((((u64)src | len) & 15) == 0) {
        const uint4* words = (const uint4*)src;
        for (u64 w = 0; w < len / 16; w++) {
            const uint4 v = words[w];
            crc = crc_word(t, crc, v.x);
            crc = crc_word(t, crc, v.y);
            crc = crc_word(t, crc, v.z);
            crc = crc_word(t, crc, v.w);
        }
    } else if ((((u64)src | len) & 3) == 0) {
        const unsigned int* words = (const unsigned int*)src;
        for (u64 w = 0; w < len / 4; w++) {
            crc = crc_word(t, crc, words[w]);
        }
    } else {
        for (u64 k = 0; k < len; k++) {
            crc = t[(crc ^ src[k]) & 0xffu] ^ (crc >> 8);
        }
    }
    return crc;
}

// CRC-32 (IEEE, reflected, as crc32fast) of chunk `c` of the payload of
// engine block `engine_blocks[blockIdx.y]`, read from the engine's own
// memory in Lake's payload order. One thread per chunk.
extern "C" __global__ void lake_crc_chunks(
    const Piece* pieces, const unsigned int* engine_blocks, unsigned int* chunk_crcs,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes,
    unsigned int chunk_bytes, unsigned int chunks_per_block)
{
    __shared__ unsigned int table[1024];
    crc_tables(table);
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
        crc = crc_run(table, crc, src, run);
        off += run;
    }
    chunk_crcs[(u64)i * chunks_per_block + c] = crc ^ 0xffffffffu;
}

// CRC-32 of chunk `c` of run `blockIdx.y` of a staging unit — runs of
// payload bytes `run_stride` apart from `base`, run y belonging to block
// `first_block + y` and starting at its chunk `first_chunk` — into that
// block's row of `chunk_crcs` (`chunks_per_block` a row). One thread per
// chunk.
extern "C" __global__ void lake_crc_runs(
    u64 base, u64 run_stride, unsigned int* chunk_crcs, unsigned int chunk_bytes, unsigned int chunks,
    unsigned int chunks_per_block, unsigned int first_chunk, unsigned int first_block)
{
    __shared__ unsigned int table[1024];
    crc_tables(table);
    const unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= chunks) {
        return;
    }
    const unsigned char* start = (const unsigned char*)(base + (u64)blockIdx.y * run_stride + (u64)c * chunk_bytes);
    const unsigned int crc = crc_run(table, 0xffffffffu, start, chunk_bytes);
    chunk_crcs[(u64)(first_block + blockIdx.y) * chunks_per_block + first_chunk + c] = crc ^ 0xffffffffu;
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

// Every (piece, block, part) of the batch, part fastest: the grid strides
// over them, so a launch of a few thread blocks moves the whole batch at
// a lower rate (see `KvCopier::launch`).
__device__ __forceinline__ void copy_pieces(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece,
    unsigned int piece_count, unsigned int block_count, unsigned int parts, bool to_payload)
{
    const u64 work = (u64)piece_count * block_count * parts;
    for (u64 k = blockIdx.x; k < work; k += gridDim.x) {
        const unsigned int part = (unsigned int)(k % parts);
        const u64 item = k / parts;
        copy_piece(pieces, engine_blocks, payloads, tokens, heads, head_bytes,
                   first_piece + (unsigned int)(item % piece_count), (unsigned int)(item / piece_count),
                   part, parts, to_payload);
    }
}

extern "C" __global__ void lake_gather(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece,
    unsigned int piece_count, unsigned int block_count, unsigned int parts)
{
    copy_pieces(pieces, engine_blocks, payloads, tokens, heads, head_bytes, first_piece, piece_count, block_count,
                parts, true);
}

extern "C" __global__ void lake_scatter(
    const Piece* pieces, const unsigned int* engine_blocks, const u64* payloads,
    unsigned int tokens, unsigned int heads, unsigned int head_bytes, unsigned int first_piece,
    unsigned int piece_count, unsigned int block_count, unsigned int parts)
{
    copy_pieces(pieces, engine_blocks, payloads, tokens, heads, head_bytes, first_piece, piece_count, block_count,
                parts, false);
}
"#;
