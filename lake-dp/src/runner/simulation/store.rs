//! The simulated node's object store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::l3::{ObjectStore, StoreError};
use crate::rng::SimRng;

/// A simulated node's object store: objects in memory, kept across the
/// node's restarts (the store outlives the process; clones share it), and
/// failing as the seed says — a call failing this time (tried again) or
/// for good, an object gone or damaged in the store, found by the next
/// read.
#[derive(Clone, Debug)]
pub(super) struct SimStore {
    objects: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
    rng: SimRng,
    faults: StoreFaults,
}

/// How often a [`SimStore`] fails, per million calls (reads, for `lost`
/// and `damaged`).
#[derive(Clone, Copy, Debug)]
pub(super) struct StoreFaults {
    pub(super) transient_ppm: u32,
    pub(super) permanent_ppm: u32,
    pub(super) lost_ppm: u32,
    pub(super) damaged_ppm: u32,
}

impl SimStore {
    /// An empty store; faulty unless `seed` is a multiple of four (as the
    /// disk).
    pub(super) fn new(seed: u64) -> Self {
        let faults = if seed.is_multiple_of(4) {
            StoreFaults { transient_ppm: 0, permanent_ppm: 0, lost_ppm: 0, damaged_ppm: 0 }
        } else {
            StoreFaults { transient_ppm: 150_000, permanent_ppm: 10_000, lost_ppm: 10_000, damaged_ppm: 10_000 }
        };
        Self { objects: Arc::default(), rng: SimRng::new(seed ^ 0x5130), faults }
    }

    /// This store, its PRNG reseeded with `seed` (one per client, per
    /// incarnation).
    pub(super) fn handle(&self, seed: u64) -> Self {
        Self { objects: Arc::clone(&self.objects), rng: SimRng::new(seed), faults: self.faults }
    }

    /// Whether the store never fails.
    pub(super) fn faultless(&self) -> bool {
        self.faults.transient_ppm + self.faults.permanent_ppm + self.faults.lost_ppm + self.faults.damaged_ppm == 0
    }

    pub(super) fn objects(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.objects.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// This call's failure, if the seed gives it one.
    pub(super) fn fails(&mut self) -> Result<(), StoreError> {
        if self.rng.chance(self.faults.transient_ppm) {
            return Err(StoreError::Transient("simulated: try again".into()));
        }
        if self.rng.chance(self.faults.permanent_ppm) {
            return Err(StoreError::Permanent("simulated: refused".into()));
        }
        Ok(())
    }
}

impl ObjectStore for SimStore {
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        self.fails()?;
        self.objects().insert(name.to_owned(), bytes.to_vec());
        Ok(())
    }

    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.fails()?;
        let (lost, damaged) = (self.rng.chance(self.faults.lost_ppm), self.rng.chance(self.faults.damaged_ppm));
        let at = self.rng.next_u64();
        let mut objects = self.objects();
        if lost {
            objects.remove(name);
        }
        let Some(object) = objects.get_mut(name) else { return Ok(None) };
        if damaged && !object.is_empty() {
            let at = usize::try_from(at % object.len() as u64).unwrap_or(0);
            object[at] ^= 0x10;
        }
        Ok(Some(object.clone()))
    }

    fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        self.fails()?;
        self.objects().remove(name);
        Ok(())
    }

    fn delete_many(&mut self, names: &[String]) -> Result<(), StoreError> {
        self.fails()?;
        let mut objects = self.objects();
        for name in names {
            objects.remove(name);
        }
        Ok(())
    }

    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.fails()?;
        Ok(self.objects().keys().filter(|name| name.starts_with(prefix)).cloned().collect())
    }
}
