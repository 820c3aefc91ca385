//! Engine memory as the agent sees it: where each byte of a block's payload
//! lives in the engine's own paged KV cache.
//!
//! A payload is in Lake's canonical order (see `lake_dp::Layout`): layer
//! after layer, plane after plane (K then V, or the one MLA latent), then
//! `[tokens][heads][head bytes]`. An engine keeps the same bytes in its own
//! order — vLLM one tensor per layer, `(2, blocks, tokens, heads, dim)` or
//! `(blocks, 2, ...)`, NHD or HND; SGLang's host pool layer-first or
//! page-first. Registration describes that order as one *piece* per
//! (layer, plane): a base address and the byte strides of the block, token
//! and head dimensions. Copies then walk the canonical range asked for and
//! move each run that is contiguous on both sides with one `memcpy`: a
//! whole piece when its tokens and heads are dense, one head's bytes
//! otherwise.

/// Where one (layer, plane) of every engine block lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Address of block 0, token 0, head 0.
    pub base: usize,
    /// Byte distance between consecutive blocks, tokens and heads.
    pub block_stride: isize,
    pub token_stride: isize,
    pub head_stride: isize,
}

/// Why a memory description is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum MemoryError {
    /// A dimension is zero.
    Empty(&'static str),
    /// The piece count is not layers × planes.
    Pieces { expected: usize, actual: usize },
    /// Some address of piece `piece` does not fit the address space.
    Overflow { piece: usize },
}

impl core::fmt::Display for MemoryError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Empty(what) => write!(f, "{what} is zero"),
            Self::Pieces { expected, actual } => {
                write!(f, "{actual} pieces given, the layout has {expected} (layers × planes)")
            }
            Self::Overflow { piece } => write!(f, "piece {piece}: an address overflows"),
        }
    }
}

/// A registered engine memory: `blocks` engine blocks, each one payload.
#[derive(Clone, Debug)]
pub(crate) struct EngineMemory {
    pieces: Vec<Piece>,
    /// Whether a piece's tokens and heads are dense and in canonical order.
    dense: Vec<bool>,
    heads: usize,
    head_bytes: usize,
    piece_bytes: usize,
    blocks: u32,
}

impl EngineMemory {
    /// `blocks` contiguous blocks of `block_bytes` at `base`.
    pub(crate) fn contiguous(base: usize, block_bytes: usize, blocks: u32) -> Result<Self, MemoryError> {
        let stride = isize::try_from(block_bytes).map_err(|_| MemoryError::Overflow { piece: 0 })?;
        let piece = Piece { base, block_stride: stride, token_stride: stride, head_stride: stride };
        Self::new(vec![piece], 1, 1, 1, block_bytes, blocks)
    }

    /// `pieces` (layer-major, then plane) of `tokens × heads × head_bytes`
    /// each, for `blocks` engine blocks.
    pub(crate) fn new(
        pieces: Vec<Piece>,
        expected_pieces: usize,
        tokens: usize,
        heads: usize,
        head_bytes: usize,
        blocks: u32,
    ) -> Result<Self, MemoryError> {
        for (what, value) in
            [("tokens", tokens), ("heads", heads), ("head bytes", head_bytes), ("blocks", blocks as usize)]
        {
            if value == 0 {
                return Err(MemoryError::Empty(what));
            }
        }
        if pieces.len() != expected_pieces || pieces.is_empty() {
            return Err(MemoryError::Pieces { expected: expected_pieces, actual: pieces.len() });
        }
        let piece_bytes = tokens
            .checked_mul(heads)
            .and_then(|n| n.checked_mul(head_bytes))
            .ok_or(MemoryError::Overflow { piece: 0 })?;
        piece_bytes.checked_mul(pieces.len()).ok_or(MemoryError::Overflow { piece: 0 })?;
        let mut dense = Vec::with_capacity(pieces.len());
        for (index, piece) in pieces.iter().enumerate() {
            // Every corner of the piece's address box must be computable:
            // then every address inside it is.
            for block in [0, blocks as usize - 1] {
                for token in [0, tokens - 1] {
                    for head in [0, heads - 1] {
                        piece
                            .address(block, token, head)
                            .and_then(|a| a.checked_add(head_bytes))
                            .ok_or(MemoryError::Overflow { piece: index })?;
                    }
                }
            }
            let head_dense = heads == 1 || isize::try_from(head_bytes).is_ok_and(|b| piece.head_stride == b);
            let token_dense = tokens == 1 || isize::try_from(heads * head_bytes).is_ok_and(|b| piece.token_stride == b);
            dense.push(head_dense && token_dense);
        }
        Ok(Self { pieces, dense, heads, head_bytes, piece_bytes, blocks })
    }

    /// Payload bytes of one block.
    pub(crate) fn block_bytes(&self) -> usize {
        self.piece_bytes * self.pieces.len()
    }

    /// Engine blocks registered.
    pub(crate) fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Calls `f(engine address, offset in the range, length)` for each
    /// run of payload bytes `offset .. offset + len` of `block` that is
    /// contiguous in engine memory. `false` if the range or block is out
    /// of bounds (nothing is called then).
    fn walk(&self, block: u32, offset: usize, len: usize, mut f: impl FnMut(usize, usize, usize)) -> bool {
        if block >= self.blocks || offset.checked_add(len).is_none_or(|end| end > self.block_bytes()) {
            return false;
        }
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let (index, within) = (at / self.piece_bytes, at % self.piece_bytes);
            let piece = &self.pieces[index];
            let (address, run) = if self.dense[index] {
                (piece.address(block as usize, 0, 0).unwrap_or(0) + within, self.piece_bytes - within)
            } else {
                let unit = within / self.head_bytes;
                let (token, head) = (unit / self.heads, unit % self.heads);
                let into = within % self.head_bytes;
                (piece.address(block as usize, token, head).unwrap_or(0) + into, self.head_bytes - into)
            };
            let n = run.min(len - done);
            f(address, done, n);
            done += n;
        }
        true
    }

    /// Copies `source`, payload bytes `offset ..` of a block, into engine
    /// block `block`. `false` (nothing copied) if it does not fit.
    pub(crate) fn scatter(&self, block: u32, offset: usize, source: &[u8]) -> bool {
        self.walk(block, offset, source.len(), |address, at, n| {
            // SAFETY: the engine registered this memory (every address of
            // every piece was checked computable at registration) and keeps
            // it valid while attached; `walk` stays inside the block's
            // pieces; `at + n <= source.len()`.
            unsafe { lake_dp::copy::copy_streaming(address as *mut u8, source.as_ptr().wrapping_add(at), n) };
        })
    }

    /// Copies the payload of engine block `block` into `out` (whose length
    /// is the payload's) and writes the CRC of each `segment_bytes`
    /// segment of it into `crcs`, computed from engine memory as it is
    /// copied: each run is read once (into cache, by its checksum) and
    /// streamed into `out` with stores that do not read `out`'s lines
    /// first. `false` if it does not fit.
    pub(crate) fn gather_with_crcs(&self, block: u32, out: &mut [u8], segment_bytes: u64, crcs: &mut [u32]) -> bool {
        let segment = usize::try_from(segment_bytes).unwrap_or(usize::MAX).max(1);
        if out.len().div_ceil(segment) != crcs.len() {
            return false;
        }
        let target = out.as_mut_ptr();
        let mut hasher = crc32fast::Hasher::new();
        self.walk(block, 0, out.len(), |address, at, n| {
            let mut done = 0;
            while done < n {
                // A run is cut where a segment ends.
                let offset = at + done;
                let take = (n - done).min(segment - offset % segment);
                // SAFETY: as in `scatter`, reading engine memory; the
                // `take` bytes at `offset` are inside `out`.
                let from = unsafe { core::slice::from_raw_parts((address + done) as *const u8, take) };
                hasher.update(from);
                // SAFETY: `from` as above; `offset + take <= out.len()`.
                unsafe { lake_dp::copy::copy_streaming(target.wrapping_add(offset), from.as_ptr(), take) };
                done += take;
                if (offset + take).is_multiple_of(segment) || offset + take == out.len() {
                    crcs[offset / segment] = core::mem::take(&mut hasher).finalize();
                }
            }
        })
    }
}

impl Piece {
    fn address(&self, block: usize, token: usize, head: usize) -> Option<usize> {
        let (block, token, head) =
            (isize::try_from(block).ok()?, isize::try_from(token).ok()?, isize::try_from(head).ok()?);
        let offset = block
            .checked_mul(self.block_stride)?
            .checked_add(token.checked_mul(self.token_stride)?)?
            .checked_add(head.checked_mul(self.head_stride)?)?;
        self.base.checked_add_signed(offset)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap, clippy::cast_sign_loss)] // small test geometry
mod tests {
    use super::*;

    /// A tiny deterministic generator (no dependency for one test).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A geometry and its pieces over `buffer`, in one of the engine
    /// orders seen in the wild: returns the pieces and the byte offset of
    /// (block, layer, plane, token, head) in the buffer, for the naive
    /// reference.
    struct Geometry {
        blocks: usize,
        layers: usize,
        planes: usize,
        tokens: usize,
        heads: usize,
        head_bytes: usize,
        order: usize,
    }

    impl Geometry {
        fn elements(&self) -> usize {
            self.blocks * self.layers * self.planes * self.tokens * self.heads
        }

        /// Offset in units of `head_bytes` of one head's bytes.
        fn unit(&self, b: usize, l: usize, p: usize, t: usize, h: usize) -> usize {
            let (bl, ly, pl, tk, hd) = (self.blocks, self.layers, self.planes, self.tokens, self.heads);
            match self.order {
                // vLLM flash attention NHD, a tensor per layer:
                // [layer][plane][block][token][head]
                0 => (((l * pl + p) * bl + b) * tk + t) * hd + h,
                // vLLM HND: [layer][plane][block][head][token]
                1 => (((l * pl + p) * bl + b) * hd + h) * tk + t,
                // blocks first: [layer][block][plane][token][head]
                2 => (((l * bl + b) * pl + p) * tk + t) * hd + h,
                // SGLang page_first: [plane][block][token][layer][head]
                3 => (((p * bl + b) * tk + t) * ly + l) * hd + h,
                // SGLang page_first_direct: [plane][block][layer][token][head]
                _ => (((p * bl + b) * ly + l) * tk + t) * hd + h,
            }
        }

        fn pieces(&self, base: usize) -> Vec<Piece> {
            let hb = self.head_bytes as isize;
            let mut pieces = Vec::new();
            for l in 0..self.layers {
                for p in 0..self.planes {
                    let at = |b, t, h| self.unit(b, l, p, t, h) as isize * hb;
                    let origin = at(0, 0, 0);
                    pieces.push(Piece {
                        base: base + origin as usize,
                        block_stride: if self.blocks > 1 { at(1, 0, 0) - origin } else { 0 },
                        token_stride: if self.tokens > 1 { at(0, 1, 0) - origin } else { 0 },
                        head_stride: if self.heads > 1 { at(0, 0, 1) - origin } else { 0 },
                    });
                }
            }
            pieces
        }

        /// The canonical payload of block `b`, read one byte at a time.
        fn reference(&self, buffer: &[u8], b: usize) -> Vec<u8> {
            let mut out = Vec::new();
            for l in 0..self.layers {
                for p in 0..self.planes {
                    for t in 0..self.tokens {
                        for h in 0..self.heads {
                            let at = self.unit(b, l, p, t, h) * self.head_bytes;
                            out.extend_from_slice(&buffer[at..at + self.head_bytes]);
                        }
                    }
                }
            }
            out
        }
    }

    #[test]
    fn gather_and_scatter_follow_every_engine_order_byte_for_byte_with_segment_crcs() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..200 {
            let g = Geometry {
                blocks: 1 + rng.below(4),
                layers: 1 + rng.below(3),
                planes: 1 + rng.below(2),
                tokens: 1 + rng.below(4),
                heads: 1 + rng.below(3),
                head_bytes: 1 + rng.below(9),
                order: round % 5,
            };
            let size = g.elements() * g.head_bytes;
            let mut buffer: Vec<u8> = (0..size).map(|_| rng.next() as u8).collect();
            let base = buffer.as_mut_ptr() as usize;
            let memory = EngineMemory::new(
                g.pieces(base),
                g.layers * g.planes,
                g.tokens,
                g.heads,
                g.head_bytes,
                g.blocks as u32,
            )
            .unwrap();
            assert_eq!(memory.block_bytes(), g.layers * g.planes * g.tokens * g.heads * g.head_bytes);
            let segment = 1 + rng.below(memory.block_bytes());
            for b in 0..g.blocks {
                let mut out = vec![0u8; memory.block_bytes()];
                let mut crcs = vec![0u32; out.len().div_ceil(segment)];
                assert!(memory.gather_with_crcs(b as u32, &mut out, segment as u64, &mut crcs));
                let reference = g.reference(&buffer, b);
                assert_eq!(out, reference, "round {round} block {b} order {}", g.order);
                let expected: Vec<u32> = reference.chunks(segment).map(crc32fast::hash).collect();
                assert_eq!(crcs, expected, "round {round} block {b}: segments of {segment}");
            }
            // Scatter a fresh payload into one block in random pieces (as
            // segments arrive), then read it back; the other blocks keep
            // their bytes.
            let target = rng.below(g.blocks) as u32;
            let others: Vec<Vec<u8>> =
                (0..g.blocks).filter(|&b| b as u32 != target).map(|b| g.reference(&buffer, b)).collect();
            let payload: Vec<u8> = (0..memory.block_bytes()).map(|_| rng.next() as u8).collect();
            let mut at = 0;
            while at < payload.len() {
                let n = 1 + rng.below(payload.len() - at);
                assert!(memory.scatter(target, at, &payload[at..at + n]));
                at += n;
            }
            assert_eq!(g.reference(&buffer, target as usize), payload, "round {round}");
            let after: Vec<Vec<u8>> =
                (0..g.blocks).filter(|&b| b as u32 != target).map(|b| g.reference(&buffer, b)).collect();
            assert_eq!(after, others, "round {round}: a copy strayed outside its block");
        }
    }

    #[test]
    fn out_of_bounds_copies_touch_nothing() {
        let mut buffer = vec![7u8; 64];
        let memory = EngineMemory::contiguous(buffer.as_mut_ptr() as usize, 16, 4).unwrap();
        assert!(!memory.scatter(4, 0, &[1; 16]), "block past the end");
        assert!(!memory.scatter(3, 8, &[1; 9]), "range past the block");
        assert!(!memory.scatter(0, usize::MAX, &[1]), "offset overflow");
        let mut out = [0u8; 17];
        assert!(!memory.gather_with_crcs(0, &mut out, 17, &mut [0]));
        assert!(!memory.gather_with_crcs(0, &mut out[..16], 8, &mut [0]), "CRCs short of the segments");
        assert!(buffer.iter().all(|&b| b == 7));
        assert!(memory.scatter(3, 8, &[1; 8]));
        assert_eq!(&buffer[56..], &[1; 8]);
    }

    #[test]
    fn bad_descriptions_are_refused_by_name() {
        let piece = Piece { base: 4096, block_stride: 64, token_stride: 16, head_stride: 8 };
        assert_eq!(
            EngineMemory::new(vec![piece], 2, 4, 2, 8, 8).unwrap_err(),
            MemoryError::Pieces { expected: 2, actual: 1 }
        );
        assert_eq!(EngineMemory::new(vec![piece], 1, 0, 2, 8, 8).unwrap_err(), MemoryError::Empty("tokens"));
        let wild = Piece { base: usize::MAX - 100, block_stride: 64, token_stride: 16, head_stride: 8 };
        assert_eq!(EngineMemory::new(vec![wild], 1, 4, 2, 8, 8).unwrap_err(), MemoryError::Overflow { piece: 0 });
        let backwards = Piece { base: 10, block_stride: -64, token_stride: 16, head_stride: 8 };
        assert!(EngineMemory::new(vec![backwards], 1, 4, 2, 8, 8).is_err());
    }
}
