//! L1 quotas held at admission: a quota is a byte ceiling over some
//! namespaces (one namespace's own, or a tenant's over all of its). Every
//! L1 slot holding a published block of a namespace under a quota is
//! charged to it — saves, loads brought up from below, copies received,
//! compaction's moves — and uncharged when its slot is retired. A save
//! whose slot would take a quota past its ceiling is refused at its commit
//! and never published: a tenant cannot crowd others out of L1 even for
//! a moment, whatever the control plane's next pass does.
//!
//! Blocks brought into L1 for a load are charged but never refused (a
//! load is an engine's critical path); the control plane keeps each quota
//! under its ceiling by demoting that quota's own coldest blocks, so its
//! saves find room again.
//!
//! Charging and the commit's check allocate nothing; each costs a lookup
//! of the namespace.

use std::collections::HashMap;

/// One quota, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L1Quota {
    /// Its name (a tenant's, or `namespace <id>`), for logs and metrics.
    pub name: String,
    /// The namespaces it counts together.
    pub namespaces: Vec<u64>,
    /// Bytes of L1 slots they may hold at most.
    pub bytes: u64,
}

/// What one L1 slot is charged for.
#[derive(Clone, Copy, Debug, Default)]
struct Charge {
    /// 1 + the index of its namespace's quota list; 0: not charged.
    entry: u32,
    /// The slot's generation when charged: a slot whose generation moved
    /// on was retired, and its charge goes.
    generation: u32,
    bytes: u64,
}

/// One quota's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaUsage {
    /// Bytes charged to it now.
    pub bytes: u64,
    /// Its ceiling.
    pub limit: u64,
    /// Saves refused for it since the start.
    pub refused: u64,
}

/// Every L1 quota of a data plane, with what each slot is charged for.
#[derive(Debug, Default)]
pub struct L1Quotas {
    /// Namespace → index into `quotas_of`.
    by_namespace: HashMap<u64, u32>,
    /// Per namespace under some quota: the quotas it counts toward.
    quotas_of: Vec<Vec<u16>>,
    names: Vec<String>,
    usage: Vec<QuotaUsage>,
    charges: Vec<Charge>,
}

impl L1Quotas {
    /// The quotas of a data plane whose L1 has `slots` slots; errors name
    /// what is wrong with a quota.
    pub fn new(quotas: &[L1Quota], slots: u32) -> Result<Self, String> {
        let mut out = Self::default();
        if quotas.is_empty() {
            return Ok(out);
        }
        if quotas.len() > usize::from(u16::MAX) {
            return Err(format!("{} quotas: at most {}", quotas.len(), u16::MAX));
        }
        for (index, quota) in quotas.iter().enumerate() {
            if quota.bytes == 0 {
                return Err(format!("quota {:?}: at least 1 byte", quota.name));
            }
            if quota.namespaces.is_empty() {
                return Err(format!("quota {:?}: names no namespace", quota.name));
            }
            let index = u16::try_from(index).unwrap_or(u16::MAX);
            for &namespace in &quota.namespaces {
                let next = u32::try_from(out.quotas_of.len()).unwrap_or(u32::MAX);
                let entry = *out.by_namespace.entry(namespace).or_insert(next);
                if entry == next {
                    out.quotas_of.push(Vec::new());
                }
                let list = &mut out.quotas_of[entry as usize];
                if !list.contains(&index) {
                    list.push(index);
                }
            }
            out.names.push(quota.name.clone());
            out.usage.push(QuotaUsage { bytes: 0, limit: quota.bytes, refused: 0 });
        }
        out.charges = vec![Charge::default(); slots as usize];
        Ok(out)
    }

    /// Whether there is no quota (then nothing is charged or refused).
    pub fn is_empty(&self) -> bool {
        self.usage.is_empty()
    }

    /// Whether `bytes` more of `namespace` fit under each of its quotas;
    /// the first quota it would pass if not (counted as a refusal).
    pub fn admits(&mut self, namespace: u64, bytes: u64) -> Result<(), usize> {
        let Some(&entry) = self.by_namespace.get(&namespace) else { return Ok(()) };
        for &quota in &self.quotas_of[entry as usize] {
            let usage = &mut self.usage[usize::from(quota)];
            if usage.bytes.saturating_add(bytes) > usage.limit {
                usage.refused += 1;
                return Err(usize::from(quota));
            }
        }
        Ok(())
    }

    /// Charges `slot` (at `generation`, `bytes` big) to `namespace`'s
    /// quotas; whatever it was charged for before goes.
    pub fn charge(&mut self, slot: u32, generation: u32, namespace: u64, bytes: u64) {
        self.uncharge(slot);
        let Some(&entry) = self.by_namespace.get(&namespace) else { return };
        let Some(charge) = self.charges.get_mut(slot as usize) else { return };
        *charge = Charge { entry: entry + 1, generation, bytes };
        for &quota in &self.quotas_of[entry as usize] {
            self.usage[usize::from(quota)].bytes += bytes;
        }
    }

    /// Drops `slot`'s charge if its generation is no longer `now` (it was
    /// retired; `None`: the slot is gone).
    pub fn retired(&mut self, slot: u32, now: Option<u32>) {
        if self.charges.get(slot as usize).is_some_and(|c| c.entry != 0 && Some(c.generation) != now) {
            self.uncharge(slot);
        }
    }

    /// Checks every charged slot against `generation` (each slot's now),
    /// for when the slots retired were not all recorded.
    pub fn sweep(&mut self, generation: impl Fn(u32) -> Option<u32>) {
        for slot in 0..self.charges.len() {
            let slot = u32::try_from(slot).unwrap_or(u32::MAX);
            self.retired(slot, generation(slot));
        }
    }

    fn uncharge(&mut self, slot: u32) {
        let Some(charge) = self.charges.get_mut(slot as usize) else { return };
        let old = std::mem::take(charge);
        if old.entry == 0 {
            return;
        }
        for &quota in &self.quotas_of[old.entry as usize - 1] {
            let usage = &mut self.usage[usize::from(quota)];
            usage.bytes = usage.bytes.saturating_sub(old.bytes);
        }
    }

    /// Each quota's name and figures.
    pub fn usage(&self) -> impl Iterator<Item = (&str, QuotaUsage)> {
        self.names.iter().map(String::as_str).zip(self.usage.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas() -> L1Quotas {
        L1Quotas::new(
            &[
                L1Quota { name: "acme".into(), namespaces: vec![1, 2], bytes: 300 },
                L1Quota { name: "namespace 2".into(), namespaces: vec![2], bytes: 100 },
            ],
            8,
        )
        .unwrap()
    }

    #[test]
    fn a_save_past_a_tenant_or_a_namespace_quota_is_refused_and_others_are_not() {
        let mut q = quotas();
        assert_eq!(q.admits(1, 100), Ok(()));
        q.charge(0, 1, 1, 100);
        assert_eq!(q.admits(2, 100), Ok(()));
        q.charge(1, 1, 2, 100);
        // Namespace 2 is at its own ceiling; namespace 1 still fits the tenant's.
        assert_eq!(q.admits(2, 1), Err(1));
        assert_eq!(q.admits(1, 100), Ok(()));
        q.charge(2, 1, 1, 100);
        assert_eq!(q.admits(1, 1), Err(0), "the tenant is at 300 across both namespaces");
        // A namespace under no quota is never refused.
        assert_eq!(q.admits(9, 1 << 40), Ok(()));
        q.charge(3, 1, 9, 1 << 40);
        let usage: Vec<(&str, QuotaUsage)> = q.usage().collect();
        assert_eq!(usage[0], ("acme", QuotaUsage { bytes: 300, limit: 300, refused: 1 }));
        assert_eq!(usage[1], ("namespace 2", QuotaUsage { bytes: 100, limit: 100, refused: 1 }));
    }

    #[test]
    fn a_retired_slot_gives_its_bytes_back_and_a_live_one_does_not() {
        let mut q = quotas();
        q.charge(0, 5, 1, 200);
        q.charge(1, 5, 2, 100);
        q.retired(0, Some(5));
        assert_eq!(q.admits(1, 1), Err(0), "a slot at its charged generation still holds");
        q.retired(0, Some(6));
        q.retired(0, Some(7));
        assert_eq!(q.usage().next().unwrap().1.bytes, 100, "given back once");
        // Charging a slot again replaces its old charge.
        q.charge(1, 9, 1, 50);
        let usage: Vec<QuotaUsage> = q.usage().map(|(_, u)| u).collect();
        assert_eq!((usage[0].bytes, usage[1].bytes), (50, 0));
        // A sweep finds what was retired unrecorded.
        q.sweep(|slot| if slot == 1 { Some(10) } else { None });
        assert_eq!(q.usage().next().unwrap().1.bytes, 0);
    }

    #[test]
    fn quotas_that_cannot_hold_are_refused_at_start() {
        let zero = L1Quota { name: "z".into(), namespaces: vec![1], bytes: 0 };
        assert!(L1Quotas::new(&[zero], 4).unwrap_err().contains("at least 1 byte"));
        let none = L1Quota { name: "n".into(), namespaces: vec![], bytes: 1 };
        assert!(L1Quotas::new(&[none], 4).unwrap_err().contains("names no namespace"));
        assert!(L1Quotas::new(&[], 4).unwrap().is_empty());
    }
}
