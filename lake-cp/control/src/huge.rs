//! Transparent huge pages for the index's big arrays: at tens of millions
//! of blocks every probe of a random bucket would otherwise also miss the
//! TLB. Advice only — where THP is off nothing changes.

const HUGE: usize = 2 << 20;

/// Advises huge pages over the whole capacity of `v` (the 2 MiB-aligned
/// part of it), if it is large enough to matter.
pub(crate) fn advise<T>(v: &Vec<T>) {
    let bytes = v.capacity() * size_of::<T>();
    if bytes < 2 * HUGE {
        return;
    }
    let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (v.as_ptr() as usize + bytes) / HUGE * HUGE;
    if end <= start {
        return;
    }
    // SAFETY: [start, end) lies inside the vector's own allocation, which
    // stays mapped while `v` is borrowed; MADV_HUGEPAGE changes neither
    // the contents nor the validity of the range. Failure (THP off) is
    // harmless and ignored.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
    }
}
