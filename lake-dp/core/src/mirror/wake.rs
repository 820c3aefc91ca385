//! Waiting for the writer: a reader that waits for entries to appear (an
//! engine whose pulled blocks land) sleeps on the control's `writes` word
//! — a futex shared between processes — and the writer wakes it once a
//! batch is published, instead of the reader polling the table.

use core::sync::atomic::Ordering;
use std::time::Duration;

use super::{MirrorReader, MirrorWriter};
use crate::os::{futex_wait, futex_wake};

impl MirrorWriter {
    /// Wakes the readers waiting for writes ([`MirrorReader::wait_for_writes`]),
    /// if any entry was published since the last call. Called once a batch
    /// (a pass of the writer's loop): one atomic and one syscall, none
    /// where nothing was published.
    pub fn wake_readers(&mut self) {
        if !core::mem::take(&mut self.published) {
            return;
        }
        let writes = &self.shared.control().writes;
        // After the entries' own stores: a reader that sees the new count
        // sees them.
        writes.fetch_add(1, Ordering::SeqCst);
        futex_wake(writes);
    }
}

impl MirrorReader {
    /// The writer's count of published batches: take it before a lookup,
    /// and wait with it ([`MirrorReader::wait_for_writes`]) if the lookup
    /// did not find what it waits for.
    pub fn writes(&self) -> u32 {
        self.shared.control().writes.load(Ordering::SeqCst)
    }

    /// Sleeps until the writer publishes past `seen` (what
    /// [`MirrorReader::writes`] said before the lookup that missed), or
    /// `timeout` passes — at once if it already has. A writer that does
    /// not wake (a build before it) leaves the reader to its timeout.
    pub fn wait_for_writes(&self, seen: u32, timeout: Duration) {
        futex_wait(&self.shared.control().writes, seen, timeout);
    }
}
