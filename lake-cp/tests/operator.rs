//! The operator's commands against a real embedded pool (the
//! `lake inspect` / `lake top`, the purge after a tenant secret
//! is rotated): `lake top` shows the pool, `lake inspect` a block's
//! replicas, its history and — read from the arena while an engine
//! reads it — its L1 pin; `lake namespaces` lists what each namespace
//! holds; `lake peers` who is connected and what each took at hello;
//! `lake purge` drops every replica of one namespace from every
//! tier while the other is untouched; bad requests are named.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::{BlockKey, KeyChain};

#[path = "common/chain.rs"]
mod chain;
#[path = "common/engines.rs"]
mod engines;

use chain::lake;
use engines::{engine, namespace, save};

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn hex(key: &BlockKey) -> String {
    key.0.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn top_inspect_namespaces_and_purge_on_a_running_pool() {
    let dir = std::env::temp_dir().join(format!("lake-cp-operator-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut pool =
        EmbeddedPool::start(&EmbeddedConfig { local_agents: 2, ..EmbeddedConfig::new(dir.clone()) }).unwrap();
    let admin = pool.admin_socket.display().to_string();
    assert_eq!(std::fs::metadata(&pool.admin_socket).unwrap().permissions().mode() & 0o777, 0o600);
    let (old, new) = (namespace(1), namespace(2));
    let tokens: Vec<u32> = (0..16 * 6).map(|t| t * 5 + 1).collect();
    let (old_keys, new_keys) = (KeyChain::keys(&old, &tokens).unwrap(), KeyChain::keys(&new, &tokens).unwrap());
    let mut old_engine = engine(&mut pool, &old);
    let mut new_engine = engine(&mut pool, &new);
    save(&mut old_engine, &old_keys, 0x01);
    save(&mut new_engine, &new_keys, 0x02);

    let top = json(&lake(&["top", "--admin", &admin, "--once", "--json"]).unwrap());
    assert_eq!(top["blocks"], 12, "{top}");
    assert_eq!(top["tiers"][0]["tier"], "l1");
    assert_eq!(top["tiers"][0]["blocks"], 12);
    let text = lake(&["top", "--admin", &admin, "--once"]).unwrap();
    assert!(text.contains("blocks 12") && text.contains("l1"), "{text}");
    // The data plane's paths, timed (sent with its stats from its start).
    // The data plane's (the engines' own come after them, as they report).
    let paths: Vec<&str> = top["paths"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["path"].as_str())
        .filter(|p| !p.starts_with("agent_"))
        .collect();
    assert_eq!(paths, ["l2_read_critical", "l2_read_background", "l2_write", "transfer_storage"], "{top}");
    assert!(text.contains("l2_read_critical"), "{text}");

    // Who is connected, and what each took at hello: this build's data
    // plane offers every feature of this build's control-plane link; both
    // engines are there.
    let peers = json(&lake(&["peers", "--admin", &admin, "--json"]).unwrap());
    let list = peers["peers"].as_array().unwrap();
    let dp = list.iter().find(|p| p["role"] == "data_plane").unwrap_or_else(|| panic!("{peers}"));
    assert_eq!(dp["name"], "lake-dp", "{peers}");
    assert_eq!(dp["pid"], std::process::id(), "the embedded data plane is this process: {peers}");
    assert_eq!(dp["version"], lake_dp::wire::WIRE_VERSION_MAX, "{peers}");
    let features: Vec<&str> = dp["features"].as_array().unwrap().iter().filter_map(|f| f.as_str()).collect();
    let offered: Vec<&str> = lake_dp::wire::FEATURE_NAMES
        .iter()
        .filter(|&&(bit, _)| lake_dp::wire::FEATURES & bit != 0)
        .map(|&(_, name)| name)
        .collect();
    assert_eq!(features, offered, "{peers}");
    let engines: Vec<&serde_json::Value> = list.iter().filter(|p| p["role"] == "agent").collect();
    assert_eq!(engines.len(), 2, "{peers}");
    assert!(engines.iter().all(|p| p["name"] == "test-engine"), "{peers}");
    let text = lake(&["peers", "--admin", &admin]).unwrap();
    assert!(text.contains("data_plane") && text.contains("rail_stats,path_latency,drain,paths_l3"), "{text}");

    // A block's replicas and history; its L1 pin read from the arena while
    // the engine holds it.
    let key = hex(&new_keys[2]);
    let block = json(&lake(&["inspect", "--admin", &admin, "--json", &key]).unwrap());
    assert_eq!((block["known"].as_bool(), block["parent"].as_str()), (Some(true), Some(hex(&new_keys[1]).as_str())));
    assert_eq!(block["replicas"][0]["tier"], "l1");
    assert_eq!(block["replicas"][0]["state"], "ready");
    assert_eq!(block["history"][0]["what"], "committed", "{block}");
    let arena = pool.arena.display().to_string();
    let mut table = Vec::new();
    assert_eq!(new_engine.lookup(&new_keys[..3], &mut table), 3);
    let mut seen = None;
    new_engine.fetch(&new_keys[..3], &table, |i, _| {
        if i == 2 {
            seen = Some(json(&lake(&["inspect", "--admin", &admin, "--arena", &arena, "--json", &key]).unwrap()));
        }
    });
    let pinned = seen.expect("block 2 was read");
    let pins = pinned["pins"].as_array().unwrap();
    assert_eq!(pins.len(), 1, "{pinned}");
    assert_eq!(pins[0]["current"], true);
    let text = lake(&["inspect", "--admin", &admin, "--arena", &arena, &key]).unwrap();
    assert!(text.contains("L1 pins: none") && text.contains("committed"), "unpinned after the read: {text}");

    // What each namespace holds; then the old one is purged (its tenant
    // key was rotated), the new one untouched.
    let old_id = format!("{:016x}", old.id().0);
    let listed = json(&lake(&["namespaces", "--admin", &admin, "--json"]).unwrap());
    assert_eq!(listed["namespaces"].as_array().map(Vec::len), Some(2), "{listed}");
    let purged = lake(&["purge", "--admin", &admin, "--wait", "20", &old_id]).unwrap();
    assert!(purged.contains("\"purged\""), "{purged}");
    let listed = json(&lake(&["namespaces", "--admin", &admin, "--json"]).unwrap());
    let names: Vec<&str> =
        listed["namespaces"].as_array().unwrap().iter().filter_map(|n| n["namespace"].as_str()).collect();
    assert_eq!(names, [format!("{:016x}", new.id().0)]);
    assert_eq!(old_engine.lookup(&old_keys, &mut table), 0, "nothing of the purged namespace is found");
    assert_eq!(new_engine.lookup(&new_keys, &mut table), new_keys.len());
    let gone = json(&lake(&["inspect", "--admin", &admin, "--json", &hex(&old_keys[0])]).unwrap());
    assert_eq!(gone["known"], false);
    let whats: Vec<&str> = gone["history"].as_array().unwrap().iter().filter_map(|e| e["what"].as_str()).collect();
    assert_eq!(whats, ["committed", "drop asked", "evicted (released)"], "{gone}");

    // Bad requests are named; nothing changes.
    let bad = lake(&["inspect", "--admin", &admin, "not-a-key"]).unwrap_err();
    assert!(bad.contains("32 hex digits"), "{bad}");
    let bad = lake(&["purge", "--admin", &admin, "zz"]).unwrap_err();
    assert!(bad.contains("namespace id in hex"), "{bad}");
    let nobody = lake(&["top", "--admin", "/nonexistent/admin.sock", "--once"]).unwrap_err();
    assert!(nobody.contains("is lake serve running there?"), "{nobody}");
    drop((old_engine, new_engine));
    pool.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The socket answers many requests on one connection, names a request
/// that is not JSON, and closes a connection whose line is too long.
#[test]
fn the_admin_socket_names_bad_lines_and_closes_on_an_overlong_one() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = std::env::temp_dir().join(format!("lake-cp-admin-lines-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = EmbeddedPool::start(&EmbeddedConfig::new(dir.clone())).unwrap();
    let mut stream = std::os::unix::net::UnixStream::connect(&pool.admin_socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(b"{\"op\":\"top\"}\nnonsense\n{\"op\":\"namespaces\"}\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut lines = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        lines.push(json(&line));
    }
    assert_eq!(lines[0]["blocks"], 0);
    assert!(lines[1]["error"].as_str().unwrap().contains("not a JSON request"));
    assert!(lines[2]["namespaces"].is_array());
    stream.write_all(&vec![b'x'; 10_000]).unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(json(&line)["error"].as_str().unwrap().contains("longer than 4096"));
    let mut rest = Vec::new();
    assert_eq!(reader.read_to_end(&mut rest).unwrap(), 0, "closed after the error");
    pool.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
