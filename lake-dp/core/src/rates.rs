//! Per-tenant bandwidth caps on this node's tiers (`[[tenants]]`): a token
//! bucket per tenant and path — L2 reads, L2 writes, L3 reads, L3 writes,
//! blocks sent to other nodes — over the tenant's namespaces. Work of a
//! tenant whose bucket is empty waits where it is (an agent's load in its
//! port, a demotion in the drain list, a copy to another node in the send
//! queue) and goes once the bucket has refilled: a cap slows its own
//! tenant and nobody else, and nothing is refused or lost.
//!
//! A bucket holds up to a tenth of a second of its rate and may go into
//! debt by one operation, so a block larger than the burst still goes;
//! the next waits until the debt is paid. Lookups and refills allocate
//! nothing.

use std::collections::HashMap;

/// What a cap applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RatePath {
    /// Blocks read from L2 (loads, promotions).
    L2Read = 0,
    /// Blocks written to L2 (demotions).
    L2Write = 1,
    /// Objects read from L3 (loads read through).
    L3Read = 2,
    /// Objects written to L3.
    L3Write = 3,
    /// Blocks this node sends to other nodes over its transport (the
    /// storage network: `lake-cp`'s copies — replication, a node's
    /// write-back elsewhere).
    NetSend = 4,
    /// Blocks other nodes and engines send into this node (copies, P→D
    /// and D→P pushes), held at the sender: its reservation is answered
    /// "later" (the transport's `AckStatus::Later`).
    NetReceive = 5,
}

/// How many [`RatePath`]s there are.
pub const RATE_PATHS: usize = 6;

// Every path's waits travel in a tenant's wait record.
const _: () = assert!(RATE_PATHS <= crate::wire::message::TENANT_WAIT_PATHS);

/// Each [`RatePath`]'s name, in code order (metrics, config).
pub const RATE_PATH_NAMES: [&str; RATE_PATHS] =
    ["l2_read", "l2_write", "l3_read", "l3_write", "net_send", "net_receive"];

/// A token bucket in bytes.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    bytes_per_s: u64,
    burst: i64,
    tokens: i64,
    /// Earned up to `last_ns` and `carry` / `bytes_per_s` of a nanosecond
    /// past it: the time the bytes earned so far took, kept exactly.
    last_ns: u64,
    carry: u64,
}

impl Bucket {
    fn new(bytes_per_s: u64) -> Self {
        let bytes_per_s = bytes_per_s.max(1);
        let burst = i64::try_from(bytes_per_s / 10).unwrap_or(i64::MAX).max(1);
        Self { bytes_per_s, burst, tokens: burst, last_ns: 0, carry: 0 }
    }

    fn refill(&mut self, now_ns: u64) {
        const NS: u128 = 1_000_000_000;
        let rate = u128::from(self.bytes_per_s);
        // In bytes of a billionth: the time since what was earned, at the rate.
        let credit = (u128::from(now_ns.saturating_sub(self.last_ns)) * rate).saturating_sub(u128::from(self.carry));
        let earned = credit / NS;
        if earned == 0 {
            // Less than a byte's worth: the time is kept for the next call
            // (a bucket asked every microsecond would otherwise never fill
            // at a low rate).
            return;
        }
        self.tokens = self.tokens.saturating_add(i64::try_from(earned).unwrap_or(i64::MAX)).min(self.burst);
        if self.tokens >= self.burst {
            (self.last_ns, self.carry) = (now_ns, 0);
        } else {
            // Only the time those bytes took is spent, to the fraction of a
            // nanosecond; the rest counts on.
            let spent = earned * NS + u128::from(self.carry);
            self.last_ns = self.last_ns.saturating_add(u64::try_from(spent / rate).unwrap_or(u64::MAX)).min(now_ns);
            self.carry = u64::try_from(spent % rate).unwrap_or(0);
        }
    }
}

/// One tenant's caps, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantRate {
    /// Its name (for logs).
    pub name: String,
    /// Its namespaces.
    pub namespaces: Vec<u64>,
    /// Bytes per second at most, by [`RatePath`] (`None`: no cap).
    pub bytes_per_s: [Option<u64>; RATE_PATHS],
}

/// Every tenant's buckets on this node.
#[derive(Debug, Default)]
pub struct TenantRates {
    by_namespace: HashMap<u64, usize>,
    buckets: Vec<[Option<Bucket>; RATE_PATHS]>,
    names: Vec<String>,
    /// Times work waited for a bucket, by tenant and [`RatePath`].
    waits: Vec<[u64; RATE_PATHS]>,
}

impl TenantRates {
    /// The buckets of `tenants` (a namespace in two tenants counts for the
    /// first).
    pub fn new(tenants: &[TenantRate]) -> Self {
        let mut rates = Self::default();
        for (index, tenant) in tenants.iter().enumerate() {
            for &namespace in &tenant.namespaces {
                rates.by_namespace.entry(namespace).or_insert(index);
            }
            rates.buckets.push(tenant.bytes_per_s.map(|r| r.map(Bucket::new)));
            rates.names.push(tenant.name.clone());
            rates.waits.push([0; RATE_PATHS]);
        }
        rates
    }

    /// Whether any tenant has a cap.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Whether `bytes` of `namespace` may go on `path` now; if so they
    /// are taken from its bucket. A namespace without a capped tenant
    /// always may.
    pub fn admit(&mut self, namespace: u64, path: RatePath, bytes: u64, now_ns: u64) -> bool {
        self.admit_or_wait(namespace, path, bytes, now_ns).is_ok()
    }

    /// [`TenantRates::admit`], saying when refused how long, µs, until
    /// `namespace`'s bucket on `path` has refilled enough to admit anything.
    pub fn admit_or_wait(&mut self, namespace: u64, path: RatePath, bytes: u64, now_ns: u64) -> Result<(), u64> {
        if self.buckets.is_empty() {
            // No tenant is capped: not even a lookup on the data path.
            return Ok(());
        }
        let Some(&tenant) = self.by_namespace.get(&namespace) else { return Ok(()) };
        let Some(bucket) = self.buckets.get_mut(tenant).and_then(|b| b[path as usize].as_mut()) else {
            return Ok(());
        };
        bucket.refill(now_ns);
        if bucket.tokens <= 0 {
            if let Some(waits) = self.waits.get_mut(tenant) {
                waits[path as usize] += 1;
            }
            // At or below zero: it admits once above.
            let owed = u128::from(bucket.tokens.unsigned_abs()) + 1;
            return Err(u64::try_from(owed * 1_000_000 / u128::from(bucket.bytes_per_s.max(1))).unwrap_or(u64::MAX));
        }
        bucket.tokens = bucket.tokens.saturating_sub(i64::try_from(bytes).unwrap_or(i64::MAX));
        Ok(())
    }

    /// Each tenant's name and how often its work waited, by [`RatePath`].
    pub fn waits(&self) -> impl Iterator<Item = (&str, [u64; RATE_PATHS])> {
        self.names.iter().map(String::as_str).zip(self.waits.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_tenant_gets_its_rate_and_others_are_untouched() {
        let tenant = TenantRate {
            name: "a".into(),
            namespaces: vec![7, 8],
            bytes_per_s: [Some(1000), None, None, None, None, None],
        };
        let mut rates = TenantRates::new(&[tenant]);
        // A burst of a tenth of a second (100 bytes), then debt by one op.
        assert!(rates.admit(7, RatePath::L2Read, 300, 1));
        assert!(!rates.admit(8, RatePath::L2Read, 10, 1), "its other namespace shares the bucket");
        // 200 bytes of debt: paid after 0.2 s, not before.
        assert!(!rates.admit(7, RatePath::L2Read, 10, 150_000_000));
        assert!(rates.admit(7, RatePath::L2Read, 10, 202_000_001));
        // Over 10 s it gets 1000 bytes a second (plus the burst), no more.
        let (mut now, mut got) = (202_000_001, 0u64);
        while now < 10_202_000_001 {
            if rates.admit(7, RatePath::L2Read, 50, now) {
                got += 50;
            }
            now += 1_000_000;
        }
        assert!((9_900..=10_200).contains(&got), "{got} bytes in 10 s at 1000 B/s");
        // Other paths, namespaces and tenants are not capped.
        assert!((0..100).all(|_| rates.admit(7, RatePath::L2Write, 1 << 20, now)));
        assert!((0..100).all(|_| rates.admit(7, RatePath::NetSend, 1 << 20, now)));
        assert!((0..100).all(|_| rates.admit(9, RatePath::L2Read, 1 << 20, now)));
        let waits: Vec<(&str, [u64; RATE_PATHS])> = rates.waits().collect();
        assert_eq!(waits.len(), 1);
        assert!(waits[0].1[0] > 0 && waits[0].1[1] == 0, "{waits:?}");
    }

    /// Rates where namespace 7's tenant sends over the network at
    /// `bytes_per_s` at most.
    fn sending_capped_at(bytes_per_s: u64) -> TenantRates {
        let mut capped = [None; RATE_PATHS];
        capped[RatePath::NetSend as usize] = Some(bytes_per_s);
        TenantRates::new(&[TenantRate { name: "a".into(), namespaces: vec![7], bytes_per_s: capped }])
    }

    #[test]
    fn a_bucket_asked_every_few_microseconds_at_a_low_rate_still_fills() {
        // 1000 B/s asked every 10 µs: a hundredth of a byte earned a call.
        // Dropping the fraction each call would never refill it.
        let mut rates = sending_capped_at(1000);
        let (mut now, mut got) = (1u64, 0u64);
        while now < 2_000_000_000 {
            if rates.admit(7, RatePath::NetSend, 100, now) {
                got += 100;
            }
            now += 10_000;
        }
        assert!((1_900..=2_200).contains(&got), "{got} bytes in 2 s at 1000 B/s");
    }

    #[test]
    fn a_bucket_asked_every_few_nanoseconds_never_passes_its_rate() {
        // 400 MB/s: a byte every 2.5 ns, asked for two bytes every 3 ns.
        // The time a refill's bytes took is 2.5 ns a byte: rounding it down
        // each call would give the half-nanoseconds back again and again.
        let mut rates = sending_capped_at(400_000_000);
        // The burst (40 MB) spent at once.
        assert!(rates.admit(7, RatePath::NetSend, 40_000_000, 1));
        let (mut now, mut got) = (1u64, 0u64);
        while now < 3_000_001 {
            now += 3;
            if rates.admit(7, RatePath::NetSend, 2, now) {
                got += 2;
            }
        }
        // 3 ms at 400 MB/s, and the bytes of debt.
        assert!(got <= 1_200_002, "{got} bytes in 3 ms at 400 MB/s");
        assert!(got >= 1_199_000, "{got} bytes in 3 ms at 400 MB/s");
    }

    #[test]
    fn a_refused_block_is_told_how_long_until_its_bucket_admits() {
        let tenant = TenantRate {
            name: "a".into(),
            namespaces: vec![7],
            bytes_per_s: [None, None, None, None, None, Some(1000)],
        };
        let mut rates = TenantRates::new(&[tenant]);
        // The burst (100 bytes) and 400 of debt.
        assert_eq!(rates.admit_or_wait(7, RatePath::NetReceive, 500, 1), Ok(()));
        // 401 bytes to earn at 1000 B/s: 401 ms.
        assert_eq!(rates.admit_or_wait(7, RatePath::NetReceive, 500, 1), Err(401_000));
        assert_eq!(rates.admit_or_wait(7, RatePath::NetReceive, 500, 201_000_001), Err(200_000));
        assert_eq!(rates.admit_or_wait(7, RatePath::NetReceive, 500, 402_000_001), Ok(()));
        // Another tenant's, and an uncapped path, never wait.
        assert_eq!(rates.admit_or_wait(8, RatePath::NetReceive, 1 << 30, 402_000_001), Ok(()));
        assert_eq!(rates.admit_or_wait(7, RatePath::NetSend, 1 << 30, 402_000_001), Ok(()));
        assert_eq!(rates.waits().next().map(|(_, w)| w[RatePath::NetReceive as usize]), Some(2));
    }
}
