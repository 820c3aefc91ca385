//! Leadership, membership and the checkpoint pointer, kept in etcd
//! (DESIGN §4). etcd holds only small things with leases:
//!
//! - `/lake/{cluster}/leader` — the leader `lake-cp`'s id, created under
//!   its lease only if absent. Its create revision is the leader's
//!   **term**: every new leadership creates the key again, so terms only
//!   grow, and a deposed leader's term is below its successor's. Every
//!   cp→dp command carries it; `lake-dp` refuses lower ones
//!   ([`lake_dp::fence`]).
//! - `/lake/{cluster}/nodes/{node}` — a node's address, under the node's
//!   own lease: a node that stops renewing leaves the membership when the
//!   lease runs out (its L1 replicas leave the summary; its L2 ones are
//!   unavailable until it returns). Once its data plane registered its
//!   L1, the value says where other nodes' copies go and how much its L1
//!   and L2 hold: `ADDRESS room=BYTES l1=REGION:EPOCH` ([`member_l1`],
//!   [`member_room`]).
//! - `/lake/{cluster}/drain/{node}` — an operator drains the node (`lake
//!   drain-node`); `/lake/{cluster}/drain-left/{node}` — the leader's
//!   count of the blocks only it still holds, written only while that
//!   mark stands.
//! - `/lake/{cluster}/checkpoint` — where the latest checkpoint of the
//!   cluster summary lives (on L2 or L3, never in etcd: etcd caps requests
//!   at 1.5 MiB) and the term that wrote it. Written only while the
//!   writer's leadership key still stands, so a deposed leader cannot move
//!   it.
//!
//! Nothing here is on a request path: the control plane calls it from its
//! housekeeping, at a fraction of the lease's time to live.

use std::time::{Duration, Instant};

use crate::etcd::{Etcd, EtcdError, Lease};

/// One Lake cluster's keys in etcd.
#[derive(Debug)]
pub struct Cluster {
    etcd: Etcd,
    name: String,
}

/// What a campaign found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// This candidate leads, in `term`.
    Leader {
        /// The leadership's term (the leader key's create revision).
        term: u64,
    },
    /// Another leads.
    Standby {
        /// The leader's id.
        leader: String,
        /// Its term.
        term: u64,
    },
}

/// Where the latest checkpoint of the summary is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointPointer {
    /// The term of the leader that wrote it.
    pub term: u64,
    /// Where it lives (an L2 path or an L3 object name).
    pub location: String,
}

fn term_of(revision: i64) -> Result<u64, EtcdError> {
    u64::try_from(revision).ok().filter(|&t| t > 0).ok_or_else(|| EtcdError::Malformed(format!("revision {revision}")))
}

impl Cluster {
    /// The cluster `name` (letters, digits, `-`, `_`) in `etcd`.
    pub fn new(etcd: Etcd, name: &str) -> Result<Self, EtcdError> {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(EtcdError::Malformed(format!("cluster name {name:?}: letters, digits, - and _ only")));
        }
        Ok(Self { etcd, name: name.to_owned() })
    }

    /// The client.
    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("/lake/{}/{rest}", self.name).into_bytes()
    }

    /// The leader's id and term, if any leads.
    pub fn leader(&self) -> Result<Option<(String, u64)>, EtcdError> {
        match self.etcd.get(&self.key("leader"))? {
            None => Ok(None),
            Some(kv) => Ok(Some((String::from_utf8_lossy(&kv.value).into_owned(), term_of(kv.create_revision)?))),
        }
    }

    /// A candidate for leadership named `id`, with a lease of `ttl`
    /// seconds (a leader that stops renewing is replaced within it).
    pub fn candidate(&self, id: &str, ttl: i64) -> Result<Candidate<'_>, EtcdError> {
        if id.is_empty() {
            return Err(EtcdError::Malformed("a candidate needs an id".into()));
        }
        let lease = self.etcd.grant(ttl)?;
        Ok(Candidate { cluster: self, id: id.to_owned(), lease, term: None })
    }

    /// Node `node` joins at `address` under a lease of `ttl` seconds.
    pub fn join(&self, node: u32, address: &str, ttl: i64) -> Result<Member<'_>, EtcdError> {
        let lease = self.etcd.grant(ttl)?;
        self.etcd.put(&self.key(&format!("nodes/{node:010}")), address.as_bytes(), Some(lease))?;
        Ok(Member { cluster: self, lease })
    }

    /// The nodes whose leases stand: `(node, address)`, by node.
    pub fn members(&self) -> Result<Vec<(u32, String)>, EtcdError> {
        let prefix = self.key("nodes/");
        let mut out = Vec::new();
        for kv in self.etcd.list(&prefix)? {
            let tail = &kv.key[prefix.len()..];
            let node = std::str::from_utf8(tail).ok().and_then(|t| t.parse().ok());
            let node =
                node.ok_or_else(|| EtcdError::Malformed(format!("member key {:?}", String::from_utf8_lossy(&kv.key))))?;
            out.push((node, String::from_utf8_lossy(&kv.value).into_owned()));
        }
        Ok(out)
    }

    /// Marks node `node` draining (an operator takes it out: `lake
    /// drain-node`): the leader copies what only it holds to other members
    /// and copies nothing to it; the node answers not ready. Its progress
    /// written by a leader before is dropped first.
    pub fn drain(&self, node: u32) -> Result<(), EtcdError> {
        self.etcd.delete(&self.key(&format!("drain-left/{node:010}")))?;
        self.etcd.put(&self.key(&format!("drain/{node:010}")), b"draining", None)?;
        Ok(())
    }

    /// Takes node `node` back (`lake drain-node --undo`).
    pub fn undrain(&self, node: u32) -> Result<(), EtcdError> {
        self.etcd.delete(&self.key(&format!("drain/{node:010}")))?;
        self.etcd.delete(&self.key(&format!("drain-left/{node:010}")))
    }

    /// The nodes being drained: `(node, the create revision of its mark)`,
    /// by node.
    pub fn draining(&self) -> Result<Vec<(u32, i64)>, EtcdError> {
        let prefix = self.key("drain/");
        let mut out = Vec::new();
        for kv in self.etcd.list(&prefix)? {
            let node = std::str::from_utf8(&kv.key[prefix.len()..]).ok().and_then(|t| t.parse().ok());
            let node =
                node.ok_or_else(|| EtcdError::Malformed(format!("drain key {:?}", String::from_utf8_lossy(&kv.key))))?;
            out.push((node, kv.create_revision));
        }
        Ok(out)
    }

    /// The leader's count of the blocks only draining node `node` holds,
    /// written only while the mark it read (`mark`: its create revision)
    /// stands — a mark taken back is not brought back. Whether it was
    /// written.
    pub fn drain_progress(&self, node: u32, mark: i64, left: u64) -> Result<bool, EtcdError> {
        let value = format!("{left} {}", unix_ms());
        let guard = self.key(&format!("drain/{node:010}"));
        self.etcd.put_if(&guard, mark, None, &self.key(&format!("drain-left/{node:010}")), value.as_bytes())
    }

    /// What the leader last wrote of draining node `node`: the blocks only
    /// it holds, and when (Unix ms); none before its first count.
    pub fn drain_left(&self, node: u32) -> Result<Option<(u64, u64)>, EtcdError> {
        let Some(kv) = self.etcd.get(&self.key(&format!("drain-left/{node:010}")))? else { return Ok(None) };
        let text = String::from_utf8_lossy(&kv.value);
        let parsed = text.split_once(' ').and_then(|(left, at)| Some((left.parse().ok()?, at.parse().ok()?)));
        parsed.map(Some).ok_or_else(|| EtcdError::Malformed(format!("drain progress {text:?}")))
    }

    /// The latest checkpoint pointer, if one was written.
    pub fn checkpoint(&self) -> Result<Option<CheckpointPointer>, EtcdError> {
        let Some(kv) = self.etcd.get(&self.key("checkpoint"))? else { return Ok(None) };
        let text = String::from_utf8_lossy(&kv.value);
        let (term, location) =
            text.split_once(' ').ok_or_else(|| EtcdError::Malformed(format!("checkpoint pointer {text:?}")))?;
        let term = term.parse().map_err(|_| EtcdError::Malformed(format!("checkpoint pointer {text:?}")))?;
        Ok(Some(CheckpointPointer { term, location: location.to_owned() }))
    }
}

/// A `lake-cp` standing for leadership.
#[derive(Debug)]
pub struct Candidate<'a> {
    cluster: &'a Cluster,
    id: String,
    lease: Lease,
    term: Option<u64>,
}

impl Candidate<'_> {
    /// Tries to lead: creates the leader key under this candidate's lease
    /// if no one holds it. A leader campaigning again keeps its term.
    pub fn campaign(&mut self) -> Result<Role, EtcdError> {
        let key = self.cluster.key("leader");
        if self.term.is_none() {
            // A standby's lease is renewed while it waits: elected, it
            // must hold a whole lease, not what is left of the one it was
            // granted when it started waiting (it would be deposed at its
            // first renewal).
            if self.cluster.etcd.keep_alive(self.lease)? <= 0 {
                self.lease = self.cluster.etcd.grant(self.lease.ttl.max(1))?;
            }
        }
        let created = match self.cluster.etcd.create(&key, self.id.as_bytes(), self.lease) {
            // A standby's lease ran out while it waited: a new one.
            Err(EtcdError::Server { code: 5, .. }) => {
                self.lease = self.cluster.etcd.grant(self.lease.ttl.max(1))?;
                self.cluster.etcd.create(&key, self.id.as_bytes(), self.lease)
            }
            other => other,
        };
        match created? {
            Ok(revision) => {
                let term = term_of(revision)?;
                self.term = Some(term);
                Ok(Role::Leader { term })
            }
            Err(existing) => {
                let term = term_of(existing.create_revision)?;
                if existing.lease == self.lease.id && existing.value == self.id.as_bytes() {
                    self.term = Some(term);
                    return Ok(Role::Leader { term });
                }
                self.term = None;
                Ok(Role::Standby { leader: String::from_utf8_lossy(&existing.value).into_owned(), term })
            }
        }
    }

    /// Campaigns every `every` until it leads or `deadline` passes; the
    /// term, or `None` at the deadline. etcd unreachable counts as not
    /// leading (and is tried again).
    pub fn campaign_until(&mut self, every: Duration, deadline: Instant) -> Option<u64> {
        loop {
            if let Ok(Role::Leader { term }) = self.campaign() {
                return Some(term);
            }
            if Instant::now() + every > deadline {
                return None;
            }
            std::thread::sleep(every);
        }
    }

    /// Renews the lease. `Ok(false)`: it had expired — leadership (if
    /// held) is lost, and a new lease is taken for the next campaign.
    pub fn keep_alive(&mut self) -> Result<bool, EtcdError> {
        if self.cluster.etcd.keep_alive(self.lease)? > 0 {
            return Ok(true);
        }
        self.term = None;
        self.lease = self.cluster.etcd.grant(self.lease.ttl.max(1))?;
        Ok(false)
    }

    /// The term this candidate leads in, as it last knew.
    pub fn term(&self) -> Option<u64> {
        self.term
    }

    /// Points the cluster at a checkpoint written in this leadership. Does
    /// nothing and says `false` unless this candidate still holds the
    /// leader key of its term.
    pub fn publish_checkpoint(&self, location: &str) -> Result<bool, EtcdError> {
        let Some(term) = self.term else { return Ok(false) };
        let revision = i64::try_from(term).map_err(|_| EtcdError::Malformed(format!("term {term}")))?;
        let value = format!("{term} {location}");
        let guard = self.cluster.key("leader");
        let key = self.cluster.key("checkpoint");
        self.cluster.etcd.put_if(&guard, revision, Some(self.id.as_bytes()), &key, value.as_bytes())
    }

    /// Gives leadership up now (the standby need not wait out the lease).
    pub fn resign(mut self) -> Result<(), EtcdError> {
        self.term = None;
        self.cluster.etcd.revoke(self.lease)
    }
}

/// A node's membership.
#[derive(Debug)]
pub struct Member<'a> {
    cluster: &'a Cluster,
    lease: Lease,
}

impl Member<'_> {
    /// Renews it; `Ok(false)` when it had expired (the node has left: it
    /// must join again, and its replicas are re-adopted).
    pub fn keep_alive(&self) -> Result<bool, EtcdError> {
        Ok(self.cluster.etcd.keep_alive(self.lease)? > 0)
    }

    /// Leaves now.
    pub fn leave(self) -> Result<(), EtcdError> {
        self.cluster.etcd.revoke(self.lease)
    }

    /// Says, under its lease, where node `node` takes copies from other
    /// nodes — its L1 `(region, epoch)`, after its `address` — and the
    /// bytes its L1 and L2 hold (its weight in placement).
    pub fn announce(&self, node: u32, address: &str, room: u64, (region, epoch): (u16, u64)) -> Result<(), EtcdError> {
        let value = format!("{address} room={room} l1={region}:{epoch}");
        self.cluster.etcd.put(&self.cluster.key(&format!("nodes/{node:010}")), value.as_bytes(), Some(self.lease))?;
        Ok(())
    }
}

/// A serving node's membership, held for as long as it serves (`lake
/// serve`, a leading `lake cp`): its key under a lease renewed every
/// third of it and taken again where it lapsed, naming where its L1 takes
/// copies once that is known, and the operator's drain mark read back.
#[derive(Debug)]
pub struct Membership {
    cluster: Cluster,
    node: u32,
    address: String,
    room: u64,
    ttl: i64,
    lease: Lease,
    /// The L1 `(region, epoch)` the value names now.
    announced: Option<(u16, u64)>,
    renewed: Instant,
}

impl Membership {
    /// Node `node` joins `cluster` at `address` (where other nodes send
    /// it blocks), `room` bytes in its L1 and L2, under a lease of `ttl`
    /// seconds.
    pub fn join(cluster: Cluster, node: u32, address: String, room: u64, ttl: i64) -> Result<Self, EtcdError> {
        let lease = cluster.join(node, &address, ttl)?.lease;
        Ok(Self { cluster, node, address, room, ttl, lease, announced: None, renewed: Instant::now() })
    }

    /// Every third of the lease, else nothing: renews it (joins again
    /// where it lapsed: the summary gets the node's replicas back from its
    /// next snapshot), names `l1` — the node's L1 `(region, epoch)`, once
    /// its data plane registered it — where it changed, and returns
    /// whether the operator marks the node draining (`None`: not read).
    pub fn tend(&mut self, l1: Option<(u16, u64)>) -> Option<bool> {
        let every = Duration::from_millis(u64::try_from(self.ttl).unwrap_or(1) * 1000 / 3);
        if self.renewed.elapsed() < every {
            return None;
        }
        self.renewed = Instant::now();
        let member = Member { cluster: &self.cluster, lease: self.lease };
        match member.keep_alive() {
            Ok(true) => {}
            Ok(false) => match self.cluster.join(self.node, &self.address, self.ttl) {
                Ok(member) => (self.lease, self.announced) = (member.lease, None),
                Err(e) => tracing::warn!(event = "membership_renewal_failed", error = %e),
            },
            Err(e) => tracing::warn!(event = "membership_renewal_failed", error = %e),
        }
        if let Some(space) = l1
            && self.announced != Some(space)
        {
            let member = Member { cluster: &self.cluster, lease: self.lease };
            match member.announce(self.node, &self.address, self.room, space) {
                Ok(()) => self.announced = Some(space),
                Err(e) => tracing::warn!(event = "l1_announce_failed", error = %e),
            }
        }
        match self.cluster.draining() {
            Ok(marks) => Some(marks.iter().any(|&(node, _)| node == self.node)),
            Err(e) => {
                tracing::warn!(event = "drain_marks_unread", error = %e);
                None
            }
        }
    }

    /// Leaves now: the node's blocks leave the leader's view at once, not
    /// when the lease runs out.
    pub fn leave(self) -> Result<(), EtcdError> {
        self.cluster.etcd.revoke(self.lease)
    }
}

/// A member's L1 `(region, epoch)`, from its membership value, if it
/// announced one ([`Member::announce`]).
pub fn member_l1(value: &str) -> Option<(u16, u64)> {
    let (_, space) = value.rsplit_once(" l1=")?;
    let (region, epoch) = space.split_once(':')?;
    Some((region.parse().ok()?, epoch.parse().ok()?))
}

/// A member's room in bytes, from its membership value, if it announced
/// it ([`Member::announce`]).
pub fn member_room(value: &str) -> Option<u64> {
    let (_, rest) = value.split_once(" room=")?;
    rest.split(' ').next()?.parse().ok()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
