//! The gather and scatter kernels on a real GPU: vLLM's paged layouts
//! (flash attention K/V-first in NHD and HND order, blocks-first, MLA),
//! one device tensor per layer as vLLM allocates them, gathered into
//! registered host memory in Lake's canonical payload order (checked byte
//! for byte against a CPU reference) and scattered back into another
//! layout's tensors (checked element for element, other blocks untouched);
//! segment CRCs computed on the GPU equal the CRCs of the payload; staged
//! loads (copy engines into HBM, then the scatter) land the same bytes and
//! report a corrupted segment.
//! Skips, saying why, where there is no CUDA driver, NVRTC or GPU (CI).

#![allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap, clippy::cast_sign_loss)] // test geometry

use lake_kernels::{KvCopier, Piece, RegisteredHost, probe};

const BLOCKS: usize = 12;
const LAYERS: usize = 3;
const TOKENS: usize = 16;
const HEADS: usize = 4;
const DIM: usize = 64;
const MLA_DIM: usize = 72;
const ELEMENT: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    FlashNhd,
    FlashHnd,
    BlocksFirst,
    Mla,
}

impl Kind {
    fn planes(self) -> usize {
        if self == Self::Mla { 1 } else { 2 }
    }
    fn heads(self) -> usize {
        if self == Self::Mla { 1 } else { HEADS }
    }
    fn dim(self) -> usize {
        if self == Self::Mla { MLA_DIM } else { DIM }
    }
    /// Elements of one layer's tensor.
    fn elements(self) -> usize {
        BLOCKS * self.planes() * TOKENS * self.heads() * self.dim()
    }
    /// Element offset of (plane, block, token, head, 0) in a layer's
    /// tensor, as each attention backend lays it out.
    fn offset(self, p: usize, b: usize, t: usize, h: usize) -> usize {
        let (bl, ts, hs, d) = (BLOCKS, TOKENS, self.heads(), self.dim());
        match self {
            Self::FlashNhd => (((p * bl + b) * ts + t) * hs + h) * d,
            Self::FlashHnd => (((p * bl + b) * hs + h) * ts + t) * d,
            Self::BlocksFirst => (((b * 2 + p) * ts + t) * hs + h) * d,
            Self::Mla => (b * ts + t) * d,
        }
    }
    fn pieces(self, bases: &[u64]) -> Vec<Piece> {
        let stride = |a: usize, b: usize| (b as i64 - a as i64) * ELEMENT as i64;
        let mut pieces = Vec::new();
        for &base in bases {
            for p in 0..self.planes() {
                let origin = self.offset(p, 0, 0, 0);
                pieces.push(Piece {
                    base: base + (origin * ELEMENT) as u64,
                    block_stride: stride(origin, self.offset(p, 1, 0, 0)),
                    token_stride: stride(origin, self.offset(p, 0, 1, 0)),
                    head_stride: if self.heads() > 1 { stride(origin, self.offset(p, 0, 0, 1)) } else { 0 },
                });
            }
        }
        pieces
    }
}

/// Lake's payload of engine block `b`: layer, plane, token, head.
fn canonical(kind: Kind, layers: &[Vec<u8>], b: usize) -> Vec<u8> {
    let head = kind.dim() * ELEMENT;
    let mut out = Vec::new();
    for layer in layers {
        for p in 0..kind.planes() {
            for t in 0..TOKENS {
                for h in 0..kind.heads() {
                    let at = kind.offset(p, b, t, h) * ELEMENT;
                    out.extend_from_slice(&layer[at..at + head]);
                }
            }
        }
    }
    out
}

struct Rng(u64);
impl Rng {
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 >> 24) as u8
            })
            .collect()
    }
}

/// Page-aligned host memory (registration wants whole pages).
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.next_multiple_of(4096), 4096).unwrap();
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Self { ptr, layout }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: allocated for layout.size() bytes, zeroed.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

#[test]
fn every_vllm_layout_gathers_in_lake_order_and_scatters_into_any_other_bit_exact() {
    if let Err(why) = probe() {
        println!("SKIPPED: {why}");
        return;
    }
    let copier = KvCopier::new(0).unwrap();
    let stream = copier.stream().clone();
    let mut rng = Rng(0x5eed_1a4e);
    for (saver, loader) in [
        (Kind::FlashNhd, Kind::FlashNhd),
        (Kind::FlashHnd, Kind::FlashNhd),
        (Kind::BlocksFirst, Kind::FlashHnd),
        (Kind::Mla, Kind::Mla),
    ] {
        // The saving engine's tensors, random bytes, one per layer.
        let host: Vec<Vec<u8>> = (0..LAYERS).map(|_| rng.bytes(saver.elements() * ELEMENT)).collect();
        let tensors: Vec<_> = host.iter().map(|h| stream.clone_htod(h).unwrap()).collect();
        let bases: Vec<u64> = tensors.iter().map(|t| copier.address(t)).collect();
        let heads = saver.heads() as u32;
        let head_bytes = (saver.dim() * ELEMENT) as u32;
        let kv = copier.describe(&saver.pieces(&bases), TOKENS as u32, heads, head_bytes).unwrap();
        let block_bytes = kv.block_bytes();
        assert_eq!(block_bytes, LAYERS * saver.planes() * TOKENS * saver.heads() * saver.dim() * ELEMENT);

        // Gather three blocks into registered host memory.
        let from = [5u32, 2, 9];
        let payload = Aligned::new(from.len() * block_bytes);
        // SAFETY: page-aligned memory that outlives the registration.
        let registered = unsafe { RegisteredHost::register(&copier, payload.ptr, payload.layout.size()) }.unwrap();
        let addresses: Vec<u64> =
            (0..from.len()).map(|i| registered.device_address(i * block_bytes).unwrap()).collect();
        // SAFETY: block ids below BLOCKS; payloads registered, block-sized.
        unsafe { copier.gather(&kv, &from, &addresses) }.unwrap();
        copier.synchronize().unwrap();
        for (i, &b) in from.iter().enumerate() {
            let got = &payload.bytes()[i * block_bytes..(i + 1) * block_bytes];
            assert!(got == canonical(saver, &host, b as usize), "{saver:?}: block {b} is not in Lake's order");
        }
        // Segment CRCs computed on the GPU from the engine's memory equal
        // the CRCs of the gathered payload: a layer a segment, and two
        // layers a segment (the last one shorter).
        let layer_bytes = block_bytes / LAYERS;
        for segment_bytes in [layer_bytes, 2 * layer_bytes] {
            // SAFETY: block ids below BLOCKS.
            let crcs = unsafe { copier.segment_crcs(&kv, &from, segment_bytes) }.unwrap();
            let expected: Vec<u32> = (0..from.len())
                .flat_map(|i| payload.bytes()[i * block_bytes..(i + 1) * block_bytes].chunks(segment_bytes))
                .map(crc32fast::hash)
                .collect();
            assert_eq!(crcs, expected, "{saver:?}: segment CRCs of {segment_bytes} bytes");
        }

        // Scatter them into another engine's zeroed tensors, other blocks.
        let zeros: Vec<_> =
            (0..LAYERS).map(|_| stream.alloc_zeros::<u8>(loader.elements() * ELEMENT).unwrap()).collect();
        let bases: Vec<u64> = zeros.iter().map(|t| copier.address(t)).collect();
        let target = copier.describe(&loader.pieces(&bases), TOKENS as u32, heads, head_bytes).unwrap();
        assert_eq!(target.block_bytes(), block_bytes, "one model, one payload size");
        let into = [1u32, 7, 3];
        // SAFETY: as above.
        unsafe { copier.scatter(&target, &into, &addresses) }.unwrap();
        copier.synchronize().unwrap();
        let loaded: Vec<Vec<u8>> = zeros.iter().map(|t| stream.clone_dtoh(t).unwrap()).collect();
        for (i, &b) in into.iter().enumerate() {
            assert!(
                canonical(loader, &loaded, b as usize) == canonical(saver, &host, from[i] as usize),
                "{saver:?} -> {loader:?}: block {b}"
            );
        }
        for b in (0..BLOCKS).filter(|b| !into.contains(&(*b as u32))) {
            assert!(canonical(loader, &loaded, b).iter().all(|&x| x == 0), "{loader:?}: block {b} was written");
        }

        // The staged path: the copy engines into the HBM staging region,
        // a layer a group, the scatter and the CRCs of what crossed the
        // bus behind them.
        let zeros: Vec<_> =
            (0..LAYERS).map(|_| stream.alloc_zeros::<u8>(loader.elements() * ELEMENT).unwrap()).collect();
        let bases: Vec<u64> = zeros.iter().map(|t| copier.address(t)).collect();
        let target = copier.describe(&loader.pieces(&bases), TOKENS as u32, heads, head_bytes).unwrap();
        let sources: Vec<*const u8> =
            (0..from.len()).map(|i| payload.ptr.wrapping_add(i * block_bytes).cast_const()).collect();
        let planes = loader.planes();
        let groups: Vec<_> = (0..LAYERS).map(|l| l * planes..(l + 1) * planes).collect();
        let expected: Vec<u32> =
            payload.bytes()[..from.len() * block_bytes].chunks(layer_bytes).map(crc32fast::hash).collect();
        let mut queued = Vec::new();
        let all = |n: usize, s: &mut Vec<*const u8>| s.extend_from_slice(&sources[s.len()..n]);
        // SAFETY: block ids below BLOCKS; every source is a block's payload
        // in registered memory, unchanged until the synchronize.
        let (landed, crcs) = unsafe {
            copier.load_staged(&target, &into, layer_bytes, &groups, all, |g| {
                queued.push(g);
                Ok(())
            })
        }
        .unwrap();
        let mut crcs = crcs.unwrap();
        copier.synchronize().unwrap();
        assert_eq!(landed, into.len());
        assert_eq!(queued, (0..LAYERS).collect::<Vec<_>>(), "a callback per layer group, in order");
        assert_eq!(crcs.take_ready().unwrap(), Some(expected.clone()), "{saver:?} -> {loader:?}: staged CRCs");
        let loaded: Vec<Vec<u8>> = zeros.iter().map(|t| stream.clone_dtoh(t).unwrap()).collect();
        for (i, &b) in into.iter().enumerate() {
            assert!(
                canonical(loader, &loaded, b as usize) == canonical(saver, &host, from[i] as usize),
                "staged {saver:?} -> {loader:?}: block {b}"
            );
        }
        for b in (0..BLOCKS).filter(|b| !into.contains(&(*b as u32))) {
            assert!(canonical(loader, &loaded, b).iter().all(|&x| x == 0), "staged {loader:?}: block {b} was written");
        }
        // A byte of the second block's first layer flipped in host memory:
        // that segment's CRC, and only that one, differs from the stored.
        let byte = payload.ptr.wrapping_add(block_bytes + 7);
        // SAFETY: inside the payload allocation; no copy in flight.
        unsafe { *byte ^= 0x40 };
        // SAFETY: as above.
        let (_, crcs) = unsafe { copier.load_staged(&target, &into, layer_bytes, &groups, all, |_| Ok(())) }.unwrap();
        copier.synchronize().unwrap();
        let got = crcs.unwrap().take_ready().unwrap().unwrap();
        let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i] != expected[i]).collect();
        assert_eq!(differ, vec![LAYERS], "{saver:?}: the corrupted segment is the one reported");
        // A source that cannot be read (the caller's check failed) ends the
        // load there: two of three blocks, their CRCs only.
        let two = |n: usize, s: &mut Vec<*const u8>| s.extend_from_slice(&sources[s.len()..n.min(2)]);
        // SAFETY: as above.
        let (landed, crcs) =
            unsafe { copier.load_staged(&target, &into, layer_bytes, &groups, two, |_| Ok(())) }.unwrap();
        copier.synchronize().unwrap();
        assert_eq!(landed, 2, "the load ends at the block with no source");
        assert_eq!(crcs.unwrap().take_ready().unwrap().unwrap().len(), 2 * LAYERS);
        // SAFETY: as above.
        let none = unsafe { copier.load_staged(&target, &into, layer_bytes, &groups, |_, _| {}, |_| Ok(())) }.unwrap();
        assert!(none.0 == 0 && none.1.is_none(), "no source at all: nothing queued");
        // Layer groups that do not cover the block are refused before
        // anything is queued.
        // SAFETY: as above.
        let refused = unsafe { copier.load_staged(&target, &into, layer_bytes, &groups[1..], all, |_| Ok(())) };
        assert!(refused.is_err(), "groups missing layer 0 refused");
        drop(registered);
    }
}
