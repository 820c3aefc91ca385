//! Copies of block payloads into memory the copying thread does not read
//! next (an L1 block landing in an engine's memory): large ones with
//! non-temporal stores, which write the destination without first reading
//! each of its cache lines in (a normal store does, for a line it owns
//! only in part), so a copy from memory to memory moves its bytes twice,
//! not three times, and does not push the caller's working set out of
//! cache.

/// Bytes from which a copy streams; below, a normal copy (the lines a
/// small copy reads in cost less than the fence a streamed one ends with).
pub const STREAM_MIN: usize = 4096;

/// Copies `len` bytes from `src` to `dst`, streaming where the CPU can
/// and the copy is large; every byte is written, in the order of later
/// stores of this thread, when it returns (a streamed copy ends with a
/// store fence).
///
/// # Safety
///
/// As [`core::ptr::copy_nonoverlapping`]: `src` valid for `len` bytes of
/// reads, `dst` for `len` bytes of writes, the two not overlapping.
pub unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked); the ranges as the contract
        // says.
        unsafe { stream_avx2(dst, src, len) };
        return;
    }
    // SAFETY: the contract.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use core::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    // Streaming stores need 32-byte aligned destinations: the bytes up to
    // the first such address go by a normal copy, as do the last few.
    let head = dst.align_offset(32).min(len);
    // SAFETY: inside both ranges (head <= len).
    unsafe { core::ptr::copy_nonoverlapping(src, dst, head) };
    let mut at = head;
    while at + 32 <= len {
        // SAFETY: `at + 32 <= len`: a 32-byte unaligned load inside `src`'s
        // range (the CPU has AVX2: this function's contract).
        let chunk = unsafe { _mm256_loadu_si256(src.wrapping_add(at).cast::<__m256i>()) };
        // SAFETY: a 32-byte store inside `dst`'s range, at a 32-byte
        // aligned address (`dst + head` is aligned and `at - head` a
        // multiple of 32).
        unsafe { _mm256_stream_si256(dst.wrapping_add(at).cast::<__m256i>(), chunk) };
        at += 32;
    }
    // SAFETY: the tail, inside both ranges.
    unsafe { core::ptr::copy_nonoverlapping(src.wrapping_add(at), dst.wrapping_add(at), len - at) };
    // Streaming stores are weakly ordered: fenced, so a completion this
    // thread publishes next is seen after the bytes.
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_and_alignment_copies_exactly() {
        let source: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 31, 32, 33, 127, 128, 4095, 4096, 4097, 65_536, 65_537] {
            for (from, to) in [(0, 0), (1, 0), (0, 1), (3, 17), (31, 5)] {
                let mut target = vec![0xA5u8; len + to + 64];
                // SAFETY: `from + len <= source.len()`, `to + len <=
                // target.len()`; distinct vectors.
                unsafe {
                    copy_streaming(target.as_mut_ptr().wrapping_add(to), source.as_ptr().wrapping_add(from), len)
                };
                assert_eq!(&target[to..to + len], &source[from..from + len], "len {len} from {from} to {to}");
                assert!(target[..to].iter().all(|&b| b == 0xA5), "before: len {len} to {to}");
                assert!(target[to + len..].iter().all(|&b| b == 0xA5), "after: len {len} to {to}");
            }
        }
    }
}
