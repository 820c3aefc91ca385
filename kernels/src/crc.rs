//! CRC-32 (the IEEE polynomial, reflected, as `crc32fast` computes it)
//! arithmetic for combining the CRCs of pieces into the CRC of their
//! concatenation — how the GPU turns CRCs of chunks it checked in parallel
//! into a stored object's segment CRCs.
//!
//! A CRC is a polynomial remainder, so `crc(A‖B) = crc(A)·x^(8|B|) ⊕
//! crc(B)` in GF(2)[x] mod P, on the finished values (the initial and
//! final inversions cancel). Multiplying by `x^(8|B|)` is linear in the 32
//! bits of `crc(A)`: [`Shift`] holds it as 32 columns, one per input bit,
//! so a kernel applies it with 32 conditional XORs.

/// The reflected IEEE polynomial.
const POLY: u32 = 0xedb8_8320;

/// `a · b mod P`, both reflected (bit 31 is x^0).
fn multiply(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut product = 0u32;
    loop {
        if a & m != 0 {
            product ^= b;
            if a & (m - 1) == 0 {
                return product;
            }
        }
        m >>= 1;
        if m == 0 {
            return product;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
}

/// `x^e mod P`, reflected.
fn x_power(mut e: u64) -> u32 {
    let mut result = 1u32 << 31; // x^0
    let mut base = 1u32 << 30; // x^1
    while e > 0 {
        if e & 1 != 0 {
            result = multiply(result, base);
        }
        base = multiply(base, base);
        e >>= 1;
    }
    result
}

/// Multiplication by `x^(8·len)`: what a CRC becomes when `len` more bytes
/// follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shift {
    /// The image of each input bit (column `k` = the shift of `1 << k`).
    pub columns: [u32; 32],
}

impl Shift {
    /// The shift past `len` bytes.
    pub fn new(len: u64) -> Self {
        let factor = x_power(8 * len);
        let mut columns = [0u32; 32];
        for (k, column) in columns.iter_mut().enumerate() {
            *column = multiply(factor, 1 << k);
        }
        Self { columns }
    }

    /// Applies it to a CRC.
    pub fn apply(&self, crc: u32) -> u32 {
        self.columns.iter().enumerate().filter(|(k, _)| crc & (1 << k) != 0).fold(0, |acc, (_, c)| acc ^ c)
    }
}

/// The CRC of `A‖B` from `crc(A)`, `crc(B)` and `|B|`.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    Shift::new(len_b).apply(crc_a) ^ crc_b
}

/// The largest power of two, at most `max`, that divides `len` (the chunk
/// size a segment of `len` bytes is checked in).
pub fn chunk_bytes(len: usize, max: usize) -> usize {
    if len == 0 {
        return 1;
    }
    let mut chunk = 1usize << len.trailing_zeros().min(usize::BITS - 1);
    while chunk > max {
        chunk >>= 1;
    }
    chunk.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s.to_le_bytes()[2]
            })
            .collect()
    }

    #[test]
    fn combining_pieces_gives_the_crc_of_the_whole() {
        for (n, split) in [(1, 0), (1, 1), (2, 1), (100, 37), (4096, 4096), (8192, 4096), (70_001, 12_345), (0, 0)] {
            let data = bytes(n, n as u64 + 7);
            let (a, b) = data.split_at(split);
            let combined = combine(crc32fast::hash(a), crc32fast::hash(b), b.len() as u64);
            assert_eq!(combined, crc32fast::hash(&data), "n {n} split {split}");
        }
    }

    #[test]
    fn a_segment_folds_from_equal_chunks() {
        let data = bytes(16 * 4096, 3);
        let shift = Shift::new(4096);
        let folded = data.chunks(4096).map(crc32fast::hash).reduce(|acc, c| shift.apply(acc) ^ c).unwrap();
        assert_eq!(folded, crc32fast::hash(&data));
        // A wrong length shifts wrongly: the check can fail.
        let wrong = Shift::new(4095);
        let bad = data.chunks(4096).map(crc32fast::hash).reduce(|acc, c| wrong.apply(acc) ^ c).unwrap();
        assert_ne!(bad, crc32fast::hash(&data));
    }

    #[test]
    fn chunk_sizes_divide_their_segments() {
        assert_eq!(chunk_bytes(16384, 4096), 4096);
        assert_eq!(chunk_bytes(2304, 4096), 256);
        assert_eq!(chunk_bytes(65536 * 3, 4096), 4096);
        assert_eq!(chunk_bytes(7, 4096), 1);
        assert_eq!(chunk_bytes(0, 4096), 1);
    }
}
