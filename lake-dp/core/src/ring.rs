//! A bounded single-producer single-consumer ring: how work crosses threads
//! into and out of a poller without locks or allocation.
//!
//! Capacity is a power of two. Head and tail are free-running `u64`
//! counters on separate cache lines; the producer owns `tail`, the consumer
//! owns `head`. A full ring hands the item back.

use core::cell::UnsafeCell;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::usize_from;

#[repr(align(128))]
struct Padded(AtomicU64);

struct Shared<T> {
    /// Next index the consumer reads. Written by the consumer only.
    head: Padded,
    /// Next index the producer writes. Written by the producer only.
    tail: Padded,
    mask: u64,
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
}

// SAFETY: a slot is written only by the producer before it publishes it
// (Release on tail) and read only by the consumer after it observes it
// (Acquire on tail), and reused only after the consumer released it
// (Release on head, Acquire by the producer). T: Send moves across.
unsafe impl<T: Send> Sync for Shared<T> {}
// SAFETY: as above; the ring owns Ts and hands them to the other thread.
unsafe impl<T: Send> Send for Shared<T> {}

/// The producing end.
pub struct Producer<T> {
    shared: Arc<Shared<T>>,
    /// Cached copy of the consumer's head, refreshed only when the ring
    /// looks full (saves a cache-line transfer per push).
    head_cache: u64,
    tail: u64,
}

/// The consuming end.
pub struct Consumer<T> {
    shared: Arc<Shared<T>>,
    tail_cache: u64,
    head: u64,
}

impl<T> core::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Producer").field("capacity", &self.shared.slots.len()).finish()
    }
}

impl<T> core::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Consumer").field("capacity", &self.shared.slots.len()).finish()
    }
}

/// Makes a ring of `capacity` (rounded up to a power of two, at least 2).
pub fn ring<T: Send>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let capacity = capacity.max(2).next_power_of_two();
    let slots = (0..capacity).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect();
    let shared = Arc::new(Shared {
        head: Padded(AtomicU64::new(0)),
        tail: Padded(AtomicU64::new(0)),
        mask: capacity as u64 - 1,
        slots,
    });
    (Producer { shared: shared.clone(), head_cache: 0, tail: 0 }, Consumer { shared, tail_cache: 0, head: 0 })
}

impl<T: Send> Producer<T> {
    /// Appends `item`; a full ring hands it back.
    pub fn push(&mut self, item: T) -> Result<(), T> {
        let capacity = self.shared.mask + 1;
        if self.tail - self.head_cache == capacity {
            // Acquire: pairs with the consumer's Release store of head, so
            // its read of the slot we are about to reuse is finished.
            self.head_cache = self.shared.head.0.load(Ordering::Acquire);
            if self.tail - self.head_cache == capacity {
                return Err(item);
            }
        }
        let slot = &self.shared.slots[usize_from(self.tail & self.mask())];
        // SAFETY: the slot at tail is not visible to the consumer (tail not
        // yet published) and was released by it (head check above).
        unsafe { (*slot.get()).write(item) };
        self.tail += 1;
        // Release: publishes the slot write to the consumer's Acquire load.
        self.shared.tail.0.store(self.tail, Ordering::Release);
        Ok(())
    }

    /// Free places right now (a lower bound).
    pub fn free(&mut self) -> usize {
        // Acquire: as in push.
        self.head_cache = self.shared.head.0.load(Ordering::Acquire);
        usize::try_from(self.shared.mask + 1 - (self.tail - self.head_cache)).unwrap_or(0)
    }

    fn mask(&self) -> u64 {
        self.shared.mask
    }
}

impl<T: Send> Consumer<T> {
    /// Removes the oldest item, if any.
    pub fn pop(&mut self) -> Option<T> {
        let item = self.peek_copy_ptr()?;
        // SAFETY: the pointer is to a live slot of the ring's own storage.
        let slot = unsafe { &*item };
        // SAFETY: the slot at head was published by the producer (checked in
        // peek_copy_ptr) and is read exactly once, here.
        let value = unsafe { slot.assume_init_read() };
        self.head += 1;
        // Release: pairs with the producer's Acquire load of head: our read
        // of the slot happens before it may overwrite it.
        self.shared.head.0.store(self.head, Ordering::Release);
        Some(value)
    }

    /// The oldest item without removing it.
    pub fn peek(&mut self) -> Option<&T> {
        let item = self.peek_copy_ptr()?;
        // SAFETY: the pointer is to a live slot of the ring's own storage.
        let slot = unsafe { &*item };
        // SAFETY: published by the producer, not yet released by us, so the
        // producer will not touch it while this borrow of self lives.
        Some(unsafe { slot.assume_init_ref() })
    }

    /// Items waiting right now (a lower bound).
    pub fn len(&mut self) -> usize {
        // Acquire: pairs with the producer's Release store of tail.
        self.tail_cache = self.shared.tail.0.load(Ordering::Acquire);
        usize::try_from(self.tail_cache - self.head).unwrap_or(0)
    }

    /// Whether nothing is waiting right now.
    pub fn is_empty(&mut self) -> bool {
        self.len() == 0
    }

    fn peek_copy_ptr(&mut self) -> Option<*mut MaybeUninit<T>> {
        if self.head == self.tail_cache {
            // Acquire: pairs with the producer's Release store of tail, so
            // the slot's contents are visible.
            self.tail_cache = self.shared.tail.0.load(Ordering::Acquire);
            if self.head == self.tail_cache {
                return None;
            }
        }
        Some(self.shared.slots[usize_from(self.head & self.shared.mask)].get())
    }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        let head = *self.head.0.get_mut();
        let tail = *self.tail.0.get_mut();
        for index in head..tail {
            let slot = self.slots[usize_from(index & self.mask)].get_mut();
            // SAFETY: items between head and tail were written and never
            // read; we are the last owner.
            unsafe { slot.assume_init_drop() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_ring_hands_items_back_and_order_holds() {
        let (mut tx, mut rx) = ring::<u32>(3);
        for i in 0..4 {
            tx.push(i).unwrap();
        }
        assert_eq!(tx.push(9), Err(9));
        assert_eq!(rx.peek(), Some(&0));
        assert_eq!(rx.pop(), Some(0));
        tx.push(4).unwrap();
        let drained: Vec<u32> = std::iter::from_fn(|| rx.pop()).collect();
        assert_eq!(drained, [1, 2, 3, 4]);
        assert!(rx.is_empty());
    }

    #[test]
    fn threads_pass_a_million_items_in_order() {
        let (mut tx, mut rx) = ring::<u64>(64);
        let producer = std::thread::spawn(move || {
            for i in 0..1_000_000u64 {
                let mut item = i;
                while let Err(back) = tx.push(item) {
                    item = back;
                    std::hint::spin_loop();
                }
            }
        });
        let mut expected = 0u64;
        while expected < 1_000_000 {
            if let Some(v) = rx.pop() {
                assert_eq!(v, expected);
                expected += 1;
            }
        }
        producer.join().unwrap();
    }

    #[test]
    fn unread_items_are_dropped_with_the_ring() {
        let (mut tx, rx) = ring::<Arc<()>>(4);
        let item = Arc::new(());
        tx.push(item.clone()).unwrap();
        drop(tx);
        drop(rx);
        assert_eq!(Arc::strong_count(&item), 1);
    }
}
