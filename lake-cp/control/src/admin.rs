//! The operator's socket: what `lake inspect`, `lake top`, `lake
//! namespaces` and `lake purge` ask a running `lake-cp`.
//!
//! A Unix socket beside `lake-cp`'s own (`admin.sock`), mode 0600 and
//! open to this user and root only (checked on the peer's credentials, as
//! the cp socket is). One request a line, one JSON object, answered by one
//! line, one JSON object; a connection may ask many. A request that is not
//! JSON, names no known `op` or gives a bad field is answered
//! `{"error": "..."}` naming it, and the connection stays; a line longer
//! than [`LINE_BYTES_MAX`] closes the connection after its error.
//!
//! | request | answer |
//! |---|---|
//! | `{"op":"top"}` | the pool at a glance: tiers (bytes, capacity, blocks, pending), leases, sessions, counters, purges |
//! | `{"op":"inspect","key":"<32 hex>"}` | one block: its parent, kind, hits, every replica (tier, region, node, epoch, slot, generation, state), the leases holding it and its recent history |
//! | `{"op":"namespaces"}` | every namespace holding bytes, by tier, and whether it is being purged |
//! | `{"op":"purge","namespace":"<16 hex>"}` | starts dropping every replica of the namespace from every tier ([`crate::tier::Tiers::purge`]) |
//! | `{"op":"persist"}`, or with `"namespace":"<16 hex>"` | queues every L1 block (of the namespace) with no copy below for a write-back to L2, its L1 copy kept ([`crate::tier::Tiers::persist`]); answers how many were queued and how many are left (`l1_only`) |
//! | `{"op":"l1_only"}`, or with `"namespace"` | how many L1 blocks (of the namespace) have no copy below |
//! | `{"op":"regions"}` | every registered region: id, tier, node, name (an L2 file's path), bytes, blocks, capacity, draining |
//! | `{"op":"drain","region":N}` or `{"op":"drain","name":"<path>"}`, with `"undo":true` to end it | starts (or ends) draining an L2 file ([`crate::tier::Tiers::drain`]); answers the region's id and every drain and how far it is |
//! | `{"op":"drains"}` | every drain and how far it is |
//! | `{"op":"peers"}` | every connection past its hello: role, name, node, pid, wire version and the features both sides took (during a rolling upgrade, which daemons and agents are still an older build) |
//!
//! Pins are not here: an L1 pin is a count in the arena's shared memory,
//! taken and dropped by agents without a message; `lake inspect --arena`
//! reads it there.

use serde_json::{Value, json};

use crate::node::{BlockEventKind, Node};
use crate::server::{ServerCounters, Session};
use lake_dp::{BlockKey, Tier};

/// Longest request line.
pub const LINE_BYTES_MAX: usize = 4096;

/// A tier's name in answers: `l0` to `l3`.
pub fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::L0Hbm => "l0",
        Tier::L1Dram => "l1",
        Tier::L2Nvme => "l2",
        Tier::L3Object => "l3",
    }
}

fn tier_code_name(code: u8) -> &'static str {
    Tier::from_u8(code).map_or("unknown", tier_name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `N` bytes written as `2 * N` hex digits (a sign is not a digit).
pub(crate) fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let digits = text.as_bytes();
    if digits.len() != 2 * N {
        return None;
    }
    let nibble = |d: u8| (d as char).to_digit(16);
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        #[allow(clippy::cast_possible_truncation)] // two hex digits
        let value = (nibble(pair[0])? << 4 | nibble(pair[1])?) as u8;
        *byte = value;
    }
    Some(out)
}

/// A namespace id as `lake` prints and takes it: 16 hex digits, big-endian.
pub fn namespace_text(namespace: u64) -> String {
    format!("{namespace:016x}")
}

fn reason_name(code: u8) -> &'static str {
    use lake_dp::wire::message::EvictReason as R;
    match R::from_u8(code) {
        Some(R::Capacity) => "capacity",
        Some(R::Quota) => "quota",
        Some(R::Demoted) => "demoted",
        Some(R::Corrupt) => "corrupt",
        Some(R::Released) => "released",
        Some(R::Moved) => "moved",
        None => "unknown",
    }
}

fn error(why: impl Into<String>) -> Value {
    json!({ "error": why.into() })
}

/// The answer to one request line (without its newline).
pub fn respond(node: &mut Node, server: &ServerCounters, sessions: &[&Session], line: &[u8]) -> Value {
    let request: Value = match serde_json::from_slice(line) {
        Ok(value) => value,
        Err(e) => return error(format!("not a JSON request: {e}")),
    };
    match request.get("op").and_then(Value::as_str) {
        Some("top") => top(node, server, sessions.len()),
        Some("peers") => peers(sessions),
        Some("inspect") => match request.get("key").and_then(Value::as_str).and_then(unhex::<16>) {
            Some(key) => inspect(node, &BlockKey(key)),
            None => error("inspect: \"key\" must be the block key as 32 hex digits"),
        },
        Some("namespaces") => namespaces(node),
        Some("purge") => {
            let Some(namespace) =
                request.get("namespace").and_then(Value::as_str).and_then(|t| u64::from_str_radix(t, 16).ok())
            else {
                return error("purge: \"namespace\" must be the namespace id in hex");
            };
            node.tiers.purge(namespace);
            let purging: Vec<String> = node.tiers.purging().iter().map(|&n| namespace_text(n)).collect();
            json!({ "purging": purging })
        }
        Some(op @ ("persist" | "l1_only")) => {
            let namespace = match request.get("namespace") {
                None => None,
                Some(text) => match text.as_str().and_then(|t| u64::from_str_radix(t, 16).ok()) {
                    Some(namespace) => Some(namespace),
                    None => return error(format!("{op}: \"namespace\" must be the namespace id in hex")),
                },
            };
            let queued = if op == "persist" { node.tiers.persist(&node.locations, namespace) } else { 0 };
            json!({ "queued": queued, "l1_only": node.tiers.l1_only(&node.locations, namespace) })
        }
        Some("regions") => regions(node),
        Some("drains") => json!({ "drains": drains(node) }),
        Some("drain") => {
            let by_name = request.get("name").and_then(Value::as_str);
            let region = match (request.get("region").and_then(Value::as_u64), by_name) {
                (Some(id), None) => u16::try_from(id).map_err(|_| format!("drain: region {id} is out of range")),
                (None, Some(name)) => node
                    .tiers
                    .regions()
                    .iter()
                    .find(|r| r.name == name)
                    .map(|r| r.region)
                    .ok_or_else(|| format!("drain: no region is named {name:?} (lake regions lists them)")),
                _ => Err("drain: give \"region\" (its id) or \"name\" (its path), one of them".to_owned()),
            };
            let undo = request.get("undo").and_then(Value::as_bool).unwrap_or(false);
            let done = region.and_then(|r| if undo { node.tiers.undrain(r) } else { node.tiers.drain(r) }.map(|()| r));
            match done {
                Ok(region) => json!({ "region": region, "drains": drains(node) }),
                Err(why) => error(why),
            }
        }
        Some(other) => {
            error(format!("unknown op {other:?}: top, inspect, namespaces, purge, regions, drain, drains or peers"))
        }
        None => error("a request is {\"op\": ...}"),
    }
}

fn regions(node: &Node) -> Value {
    let regions: Vec<Value> = node
        .tiers
        .regions()
        .iter()
        .map(|r| {
            json!({
                "region": r.region,
                "tier": tier_name(r.tier),
                "node": r.node,
                "name": r.name,
                "bytes": r.bytes,
                "blocks": r.blocks,
                "capacity_bytes": r.capacity_bytes,
                "draining": r.draining,
            })
        })
        .collect();
    json!({ "regions": regions })
}

fn peers(sessions: &[&Session]) -> Value {
    let peers: Vec<Value> = sessions
        .iter()
        .filter_map(|session| {
            let role = match session.role()? {
                lake_dp::wire::message::Role::DataPlane => "data_plane",
                lake_dp::wire::message::Role::Agent => "agent",
                lake_dp::wire::message::Role::ControlPlane => "control_plane",
            };
            let (node, pid) = session.origin();
            let features: Vec<&str> = lake_dp::wire::FEATURE_NAMES
                .iter()
                .filter(|&&(bit, _)| session.takes(bit))
                .map(|&(_, name)| name)
                .collect();
            Some(json!({
                "role": role,
                "name": session.name(),
                "node": node,
                "pid": pid,
                "version": session.version(),
                "features": features,
            }))
        })
        .collect();
    json!({ "peers": peers })
}

fn drains(node: &Node) -> Vec<Value> {
    node.tiers
        .drains()
        .iter()
        .map(|d| {
            json!({
                "region": d.region,
                "node": d.node,
                "announced": d.announced,
                "refused": d.refused,
                "blocks_left": d.blocks_left,
                "moves_asked": d.moved,
                "drops_asked": d.dropped,
                "done": d.done,
            })
        })
        .collect()
}

#[allow(clippy::cast_precision_loss)] // a ratio of block counts, shown to an operator
fn top(node: &Node, server: &ServerCounters, peers: usize) -> Value {
    let tiers: Vec<Value> = [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object]
        .into_iter()
        .map(|tier| {
            let u = node.tiers.usage(tier);
            json!({
                "tier": tier_name(tier),
                "bytes": u.bytes,
                "capacity_bytes": u.capacity_bytes,
                "blocks": u.blocks,
                "pending_bytes": u.pending_bytes,
            })
        })
        .collect();
    let c = node.counters;
    let t = node.tiers.counters;
    let hit_ratio =
        if c.requested_blocks == 0 { Value::Null } else { json!(c.hit_blocks as f64 / c.requested_blocks as f64) };
    json!({
        "node": node.node().0,
        "blocks": node.locations.index.len(),
        "tiers": tiers,
        "leases": node.leases.len(),
        "sessions": peers,
        "waiting_for_parent": node.waiting(),
        // Blocks that waited for their parent (re-adopted, pulled), and
        // those applied without it, as roots of their own.
        "blocks_waited": c.waited,
        "blocks_rooted": c.rooted,
        // Copies to other nodes refused for want of a send or a slot
        // there, and asked again.
        "copies_asked_again": node.copies_asked_again,
        "lookups": { "requested_blocks": c.requested_blocks, "hit_blocks": c.hit_blocks, "hit_ratio": hit_ratio },
        "blocks_committed": c.committed,
        // Blocks in L1 alone: lost with the host (a clean stop writes
        // them down; `lake persist` does now).
        "l1_only_blocks": node.tiers.l1_only(&node.locations, None),
        "persist_queued": node.tiers.persist_queued(),
        "blocks_evicted": c.evicted,
        "tier_commands": {
            "pending": node.tiers.pending(),
            "demotions": t.demotions,
            "to_l3": t.l3_moves,
            "l2_write_backs": t.l2_write_backs,
            "copies_to_l3": t.l3_copies,
            "failed": t.failed,
            "purged": t.purged,
            "tenant_quota_evictions": t.tenant_quota_evictions,
            "drain_moves": t.drain_moves,
            "drain_drops": t.drain_drops,
            "cleanings": t.cleanings,
            "write_backs_deferred": t.write_backs_deferred,
            // Why the failed ones failed.
            "refused": lake_dp::wire::message::ErrorCode::ALL
                .iter()
                .filter(|&&code| t.refused[code as usize] > 0)
                .map(|&code| (code.name().to_owned(), json!(t.refused[code as usize])))
                .collect::<serde_json::Map<String, Value>>(),
            "timed_out": t.timed_out,
            "link_lost": t.link_lost,
            "unrouted": t.unrouted,
        },
        // L1 victims chosen ahead of demand: marked in the data plane now,
        // and what became of the marks (a save or load that found no free
        // slot took one: its block dropped from L1, with a copy below or
        // without).
        "victims": {
            "marked_now": node.tiers.marked(),
            "marked_clean": t.marked_clean,
            "marked_drop": t.marked_drop,
            "unmarked": t.unmarked,
            "continued": t.victims_continued,
            "taken_clean": t.taken_clean,
            "taken_dropped": t.taken_dropped,
        },
        "purging": node.tiers.purging().iter().map(|&n| namespace_text(n)).collect::<Vec<_>>(),
        "drains": drains(node),
        // How long the data plane's operations took, by path (bucket
        // bounds: at most that long).
        "paths": node.all_paths().iter().filter_map(|p| {
            let count = p.count;
            Some(json!({
                "path": p.path()?.name(),
                "count": count,
                "mean_us": p.sum_us.checked_div(count),
                "p50_us": p.quantile_us(0.5),
                "p99_us": p.quantile_us(0.99),
            }))
        }).collect::<Vec<_>>(),
        // The data plane's saves as it last reported them: refused ones
        // are engines' lost hits, by reason where it says.
        "saves": node.data_plane.as_ref().map(|dp| json!({
            "saved": dp.saves,
            "refused": dp.saves_refused,
            "refused_by": node.save_refusals.as_ref().map(|r| json!({
                "no_space": r.no_space,
                "load_reserve": r.load_reserve,
                "stopping": r.stopping,
                "over_quota": r.over_quota,
            })),
            "corrupt": dp.commits_corrupt,
        })),
        "server": {
            "frames": server.frames,
            "bad_frames": server.bad_frames,
            "refused": server.refused,
            "strangers": server.strangers,
        },
    })
}

fn inspect(node: &Node, key: &BlockKey) -> Value {
    let locations = &node.locations;
    let history: Vec<Value> = node
        .history_of(key)
        .iter()
        .map(|e| {
            let what = match e.what {
                BlockEventKind::Committed => "committed".to_owned(),
                BlockEventKind::Readopted => "readopted".to_owned(),
                BlockEventKind::Evicted(reason) => format!("evicted ({})", reason_name(reason)),
                BlockEventKind::MoveAsked(to) => format!("move to {} asked", tier_code_name(to)),
                BlockEventKind::CopyAsked(to) => format!("copy to {} asked", tier_code_name(to)),
                BlockEventKind::DropAsked => "drop asked".to_owned(),
                BlockEventKind::SecondCopyDropAsked => "drop of a second copy asked".to_owned(),
            };
            json!({ "unix_ns": e.unix_ns, "what": what, "region": e.region, "slot": e.slot })
        })
        .collect();
    let Some(block) = locations.index.get(key) else {
        return json!({ "key": hex(&key.0), "known": false, "history": history });
    };
    let index = &locations.index;
    let replicas: Vec<Value> = index
        .replicas(block)
        .map(|loc| {
            let region = locations.region(loc.region);
            let state = match loc.state {
                crate::index::LocState::Writing => "writing",
                crate::index::LocState::Ready => "ready",
                crate::index::LocState::Evicting => "evicting",
            };
            json!({
                "region": loc.region,
                "tier": region.map_or("unknown", |r| tier_name(r.tier)),
                "node": region.map(|r| r.node.0),
                "epoch": region.map(|r| r.epoch),
                "slot": loc.slot,
                "generation": loc.generation,
                "state": state,
            })
        })
        .collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let leases: Vec<Value> = node
        .leases
        .holding(key)
        .into_iter()
        .map(|(id, region, deadline_ns)| {
            json!({ "id": id, "region": region, "expires_in_ms": deadline_ns.saturating_sub(now) / 1_000_000 })
        })
        .collect();
    let kind = match index.kind(block) {
        lake_dp::ObjectKind::KvBlock => "kv_block",
        lake_dp::ObjectKind::RecurrentState => "recurrent_state",
    };
    let tracked = node.tiers.tracked(key);
    let namespace = tracked.first().map(|&(_, n, _)| namespace_text(n));
    let tracked: Vec<Value> = tracked
        .into_iter()
        .map(|(tier, namespace, hits)| {
            json!({ "tier": tier_name(tier), "namespace": namespace_text(namespace), "hits": hits })
        })
        .collect();
    json!({
        "key": hex(&key.0),
        "known": true,
        "kind": kind,
        "parent": index.parent(block).map(|p| hex(&index.key(p).0)),
        "leaf": index.is_leaf(block),
        "namespace": namespace,
        "tiers": tracked,
        "replicas": replicas,
        "leases": leases,
        "history": history,
    })
}

fn namespaces(node: &Node) -> Value {
    let purging = node.tiers.purging();
    let list: Vec<Value> = node
        .tiers
        .namespaces()
        .into_iter()
        .map(|(namespace, bytes)| {
            json!({
                "namespace": namespace_text(namespace),
                "l1_bytes": bytes[Tier::L1Dram as usize],
                "l2_bytes": bytes[Tier::L2Nvme as usize],
                "l3_bytes": bytes[Tier::L3Object as usize],
                "purging": purging.contains(&namespace),
            })
        })
        .collect();
    json!({ "namespaces": list })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(node: &mut Node, line: &str) -> Value {
        respond(node, &ServerCounters::default(), &[], line.as_bytes())
    }

    #[test]
    fn bad_requests_are_named_and_change_nothing() {
        let mut node = Node::new(lake_dp::NodeId(0), 1, None);
        for (line, said) in [
            ("not json", "not a JSON request"),
            ("{}", "{\"op\""),
            ("{\"op\":\"reboot\"}", "unknown op \"reboot\""),
            ("{\"op\":\"inspect\",\"key\":\"12\"}", "32 hex digits"),
            ("{\"op\":\"inspect\",\"key\":\"zz000000000000000000000000000000\"}", "32 hex digits"),
            ("{\"op\":\"purge\"}", "namespace id in hex"),
            ("{\"op\":\"purge\",\"namespace\":\"not hex\"}", "namespace id in hex"),
        ] {
            let answer = ask(&mut node, line);
            let why = answer["error"].as_str().unwrap_or_default();
            assert!(why.contains(said), "{line}: {answer}");
        }
        assert!(node.tiers.purging().is_empty());
        assert_eq!(ask(&mut node, "{\"op\":\"purge\",\"namespace\":\"7e\"}")["purging"], json!(["000000000000007e"]));
        let unknown = ask(&mut node, "{\"op\":\"inspect\",\"key\":\"00112233445566778899aabbccddeeff\"}");
        assert_eq!((unknown["known"].as_bool(), unknown["history"].as_array().map(Vec::len)), (Some(false), Some(0)));
        assert_eq!(ask(&mut node, "{\"op\":\"top\"}")["blocks"], json!(0));
    }
}
