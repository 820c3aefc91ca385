//! The operator's commands on a running pool, over its admin socket:
//! status, `top`, a block's story, persisting, reloading tenant keys.

use super::*;

/// SIGHUP: the tenant keys read again; a new or changed file sets its
/// key, a file gone forgets its tenant (purged from every tier). A
/// directory that cannot be read changes nothing (said so).
pub(super) fn reload_tenant_keys(
    dir: &std::path::Path,
    pool: &lake_cp::embedded::EmbeddedPool,
    known: &mut std::collections::HashMap<lake_dp::NamespaceId, u64>,
) {
    use lake_dp::auth::at_rest::KeyChange;
    let keys = match lake_cp::config::read_tenant_keys(dir) {
        Ok(keys) => keys,
        Err(e) => {
            say!("{}", serde_json::json!({"event": "tenant_keys_refused", "why": e}));
            return;
        }
    };
    let (mut set, mut forgotten) = (Vec::new(), Vec::new());
    let present: std::collections::HashSet<lake_dp::NamespaceId> = keys.iter().map(|(ns, _)| *ns).collect();
    for (namespace, key) in keys {
        if known.get(&namespace) != Some(&key.id()) {
            known.insert(namespace, key.id());
            set.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Set(namespace, key));
        }
    }
    known.retain(|namespace, _| {
        let keep = present.contains(namespace);
        if !keep {
            forgotten.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Forget(*namespace));
        }
        keep
    });
    say!("{{\"event\":\"tenant_keys\",\"set\":[{}],\"forgotten\":[{}]}}", set.join(","), forgotten.join(","));
}

/// One request to a running `lake-cp`'s operator socket, its answer.
pub(super) fn ask_admin(path: &std::path::Path, request: &serde_json::Value) -> Result<serde_json::Value, String> {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("{}: {e} (is lake serve running there?)", path.display()))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).map_err(|e| e.to_string())?;
    writeln!(stream, "{request}").map_err(|e| format!("{}: {e}", path.display()))?;
    let mut line = String::new();
    std::io::BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("{}: {e}", path.display()))?;
    let answer: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("{}: an answer that is not JSON: {e}", path.display()))?;
    match answer.get("error").and_then(serde_json::Value::as_str) {
        Some(why) => Err(why.to_owned()),
        None => Ok(answer),
    }
}

#[allow(clippy::cast_precision_loss)] // bytes shown in MiB to an operator
pub(super) fn mib(bytes: &serde_json::Value) -> String {
    format!("{:.1}", bytes.as_u64().unwrap_or(0) as f64 / f64::from(1 << 20))
}

/// `lake top`, `lake inspect`, `lake namespaces`, `lake purge`.
/// `lake persist`: every L1-only block written back to L2 (kept in L1);
/// with `--wait`, until none is left.
pub(super) fn persist(admin: &std::path::Path, namespace: Option<String>, wait_s: u64) -> Result<(), String> {
    use serde_json::json;
    let mut request = json!({ "op": "persist" });
    if let Some(namespace) = &namespace {
        request["namespace"] = json!(namespace);
    }
    let answer = ask_admin(admin, &request)?;
    say!("{}", json!({ "event": "persisting", "queued": answer["queued"], "l1_only": answer["l1_only"] }));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    let mut asked = std::time::Instant::now();
    loop {
        // The pool's count, of the namespace asked or of all; asked again
        // each second (blocks saved since, write-backs refused for want of
        // a free slot, are queued anew; the queue skips what is below).
        let again = asked.elapsed() >= std::time::Duration::from_secs(1);
        request["op"] = json!(if again { "persist" } else { "l1_only" });
        if again {
            asked = std::time::Instant::now();
        }
        let left = ask_admin(admin, &request)?["l1_only"].as_u64().unwrap_or(u64::MAX);
        if left == 0 {
            say!("{}", json!({ "event": "persisted", "l1_only": 0 }));
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            if wait_s == 0 {
                return Ok(());
            }
            return Err(format!(
                "{left} blocks still in L1 alone after {wait_s} s (L2 full, or no free L1 slot to stage them: `lake \
                 top` shows the tier commands refused)"
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// An operator command's arguments.
#[derive(Debug, Default)]
pub(super) struct Operator {
    pub(super) admin: PathBuf,
    pub(super) arena: Option<PathBuf>,
    pub(super) json_out: bool,
    pub(super) once: bool,
    pub(super) interval_ms: u64,
    pub(super) wait_s: u64,
    pub(super) undo: bool,
    pub(super) positional: Vec<String>,
}

/// `lake top`, `inspect`, `namespaces`, `purge`, `regions`, `peers`, `drain`.
pub(super) fn operator(op: &str, args: Operator) -> Result<(), String> {
    use serde_json::json;
    let Operator { admin, arena, json_out, once, interval_ms, wait_s, undo, positional } = args;
    let show = |value: &serde_json::Value, text: String| {
        if json_out { say!("{value}") } else { show!("{text}") }
    };
    match op {
        "top" => loop {
            let top = ask_admin(&admin, &json!({ "op": "top" }))?;
            if !once && !json_out {
                // Clear the terminal, as top does.
                show!("\x1b[H\x1b[2J");
            }
            show(&top, render_top(&top));
            if once {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(interval_ms));
        },
        "inspect" => {
            let [key] = positional.as_slice() else {
                return Err("inspect takes one KEY (32 hex digits)".to_string());
            };
            let mut block = ask_admin(&admin, &json!({ "op": "inspect", "key": key }))?;
            if let Some(path) = &arena {
                let attached =
                    lake_dp::arena::Arena::attach(path).map_err(|e| format!("--arena {}: {e}", path.display()))?;
                let region_of_l1 = block["replicas"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|r| r["tier"] == "l1")
                    .filter_map(|r| Some((r["slot"].as_u64()?, r["generation"].as_u64()?)))
                    .collect::<Vec<_>>();
                let mut pins = Vec::new();
                for (slot, generation) in region_of_l1 {
                    let slot = u32::try_from(slot).map_err(|e| e.to_string())?;
                    for (agent, pinned) in attached.pins_on(slot) {
                        pins.push(json!({ "slot": slot, "agent": agent, "generation": pinned, "current": u64::from(pinned) == generation }));
                    }
                }
                block["pins"] = json!(pins);
            }
            show(&block, render_block(&block));
            Ok(())
        }
        "namespaces" => {
            let list = ask_admin(&admin, &json!({ "op": "namespaces" }))?;
            let mut text = format!("{:<18} {:>10} {:>10} {:>10}  purging\n", "namespace", "L1 MiB", "L2 MiB", "L3 MiB");
            for n in list["namespaces"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:<18} {:>10} {:>10} {:>10}  {}\n",
                    n["namespace"].as_str().unwrap_or("?"),
                    mib(&n["l1_bytes"]),
                    mib(&n["l2_bytes"]),
                    mib(&n["l3_bytes"]),
                    if n["purging"] == true { "yes" } else { "" }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "purge" => {
            let [namespace] = positional.as_slice() else {
                return Err("purge takes one NAMESPACE (hex)".to_string());
            };
            let answer = ask_admin(&admin, &json!({ "op": "purge", "namespace": namespace }))?;
            let wanted =
                format!("{:016x}", u64::from_str_radix(namespace, 16).map_err(|e| format!("{namespace}: {e}"))?);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let top = ask_admin(&admin, &json!({ "op": "top" }))?;
                let still = top["purging"].as_array().is_some_and(|p| p.iter().any(|n| n == wanted.as_str()));
                if !still {
                    say!("{{\"event\":\"purged\",\"namespace\":\"{wanted}\"}}");
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        return Err(format!(
                            "{wanted} still holds blocks after {wait_s} s (leased ones wait for their leases)"
                        ));
                    }
                    say!("{{\"event\":\"purging\",\"purging\":{}}}", answer["purging"]);
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        "regions" => {
            let list = ask_admin(&admin, &json!({ "op": "regions" }))?;
            let mut text = format!(
                "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} name\n",
                "region", "tier", "node", "MiB", "capacity", "blocks", "draining"
            );
            for r in list["regions"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} {}\n",
                    r["region"].as_u64().unwrap_or(0),
                    r["tier"].as_str().unwrap_or("?"),
                    r["node"].as_u64().unwrap_or(0),
                    mib(&r["bytes"]),
                    mib(&r["capacity_bytes"]),
                    r["blocks"].as_u64().unwrap_or(0),
                    if r["draining"] == true { "yes" } else { "" },
                    r["name"].as_str().unwrap_or("")
                ));
            }
            show(&list, text);
            Ok(())
        }
        "peers" => {
            let list = ask_admin(&admin, &json!({ "op": "peers" }))?;
            let mut text =
                format!("{:<12} {:<24} {:>5} {:>8} {:>7}  features\n", "role", "name", "node", "pid", "version");
            for p in list["peers"].as_array().into_iter().flatten() {
                let features: Vec<&str> =
                    p["features"].as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect();
                text.push_str(&format!(
                    "{:<12} {:<24} {:>5} {:>8} {:>7}  {}\n",
                    p["role"].as_str().unwrap_or("?"),
                    p["name"].as_str().unwrap_or(""),
                    p["node"].as_u64().unwrap_or(0),
                    p["pid"].as_u64().unwrap_or(0),
                    p["version"].as_u64().map_or_else(|| "-".to_owned(), |v| v.to_string()),
                    if features.is_empty() { "-".to_owned() } else { features.join(",") }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "drain" => {
            let [which] = positional.as_slice() else {
                return Err("drain takes one REGION (its id) or FILE (its path)".to_string());
            };
            let mut request = match which.parse::<u64>() {
                Ok(region) => json!({ "op": "drain", "region": region }),
                Err(_) => json!({ "op": "drain", "name": which }),
            };
            request["undo"] = json!(undo);
            let answer = ask_admin(&admin, &request)?;
            // The region it named, by id (a file's path resolved there).
            let region = answer["region"].as_u64().ok_or_else(|| format!("unexpected answer: {answer}"))?;
            if undo {
                say!("{{\"event\":\"undrained\",\"region\":{region}}}");
                return Ok(());
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let drains = ask_admin(&admin, &json!({ "op": "drains" }))?["drains"].clone();
                let this = drains.as_array().into_iter().flatten().find(|d| d["region"] == region).cloned();
                let Some(this) = this else { return Err(format!("region {region} is no longer being drained")) };
                if this["done"] == true {
                    say!(
                        "{{\"event\":\"drained\",\"region\":{region},\"moves_asked\":{},\"drops_asked\":{}}}",
                        this["moves_asked"],
                        this["drops_asked"]
                    );
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        let why = this["refused"].as_str().map_or_else(String::new, |r| format!(" (refused: {r})"));
                        return Err(format!(
                            "region {region} still holds {} blocks after {wait_s} s{why}",
                            this["blocks_left"]
                        ));
                    }
                    say!("{{\"event\":\"draining\",\"drain\":{this}}}");
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        _ => Err(format!("unknown operator command {op}")),
    }
}

#[allow(clippy::cast_precision_loss)] // percentages shown to an operator
pub(super) fn render_top(top: &serde_json::Value) -> String {
    let mut text = format!(
        "lake-cp node {}  blocks {}  leases {}  sessions {}  waiting {}\n",
        top["node"], top["blocks"], top["leases"], top["sessions"], top["waiting_for_parent"]
    );
    let lookups = &top["lookups"];
    let ratio = lookups["hit_ratio"].as_f64().map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", r * 100.0));
    text.push_str(&format!(
        "lookups: {} blocks asked, {} hit ({ratio})   committed {}  evicted {}\n\n",
        lookups["requested_blocks"], lookups["hit_blocks"], top["blocks_committed"], top["blocks_evicted"]
    ));
    text.push_str(&format!(
        "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
        "tier", "MiB", "capacity", "used", "blocks", "leaving MiB"
    ));
    for tier in top["tiers"].as_array().into_iter().flatten() {
        let (bytes, capacity) = (tier["bytes"].as_u64().unwrap_or(0), tier["capacity_bytes"].as_u64().unwrap_or(0));
        let used =
            if capacity == 0 { "-".to_owned() } else { format!("{:.0}%", bytes as f64 * 100.0 / capacity as f64) };
        text.push_str(&format!(
            "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
            tier["tier"].as_str().unwrap_or("?"),
            mib(&tier["bytes"]),
            mib(&tier["capacity_bytes"]),
            used,
            tier["blocks"].as_u64().unwrap_or(0),
            mib(&tier["pending_bytes"])
        ));
    }
    let t = &top["tier_commands"];
    text.push_str(&format!(
        "\ntier commands: {} in flight, {} demotions, {} written below ahead, {} to L3, {} copies to L3, {} failed, {} \
         purged, {} over tenant quotas\n",
        t["pending"],
        t["demotions"],
        t["cleanings"],
        t["to_l3"],
        t["copies_to_l3"],
        t["failed"],
        t["purged"],
        t["tenant_quota_evictions"]
    ));
    let v = &top["victims"];
    if !v.is_null() {
        text.push_str(&format!(
            "L1 victims: {} marked now; taken by saves and loads: {} with a copy below, {} dropped\n",
            v["marked_now"], v["taken_clean"], v["taken_dropped"]
        ));
    }
    let saves = &top["saves"];
    if !saves.is_null() {
        let by = &saves["refused_by"];
        let why = if by.is_null() {
            "no L1 slot free".to_owned()
        } else {
            format!(
                "{} L1 full, {} only the load reserve free, {} stopping, {} over quota",
                by["no_space"], by["load_reserve"], by["stopping"], by["over_quota"]
            )
        };
        text.push_str(&format!(
            "saves: {} saved, {} refused ({why}), {} corrupt at commit\n",
            saves["saved"], saves["refused"], saves["corrupt"]
        ));
    }
    let refused = &t["refused"];
    if refused.as_object().is_some_and(|r| !r.is_empty()) {
        text.push_str(&format!("tier commands refused by the data plane: {refused}\n"));
    }
    if top["purging"].as_array().is_some_and(|p| !p.is_empty()) {
        text.push_str(&format!("purging: {}\n", top["purging"]));
    }
    for d in top["drains"].as_array().into_iter().flatten() {
        let state = if d["done"] == true {
            "done".to_owned()
        } else if let Some(why) = d["refused"].as_str() {
            format!("refused: {why}")
        } else if d["announced"] == true {
            "moving".to_owned()
        } else {
            "telling its lake-dp".to_owned()
        };
        text.push_str(&format!(
            "draining region {}: {} blocks left, {} moves and {} drops asked ({state})\n",
            d["region"], d["blocks_left"], d["moves_asked"], d["drops_asked"]
        ));
    }
    let paths = top["paths"].as_array().into_iter().flatten().collect::<Vec<_>>();
    if !paths.is_empty() {
        text.push_str(&format!(
            "\n{:<20} {:>10} {:>10} {:>10} {:>10}\n",
            "path", "count", "mean µs", "p50 ≤ µs", "p99 ≤ µs"
        ));
        let number = |v: &serde_json::Value| v.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
        for path in paths {
            text.push_str(&format!(
                "{:<20} {:>10} {:>10} {:>10} {:>10}\n",
                path["path"].as_str().unwrap_or("?"),
                number(&path["count"]),
                number(&path["mean_us"]),
                number(&path["p50_us"]),
                number(&path["p99_us"])
            ));
        }
    }
    text
}

#[allow(clippy::cast_precision_loss)] // seconds shown to an operator
pub(super) fn render_block(block: &serde_json::Value) -> String {
    let mut text = format!("block {}\n", block["key"].as_str().unwrap_or("?"));
    if block["known"] != true {
        text.push_str("  not in this node's index\n");
    } else {
        text.push_str(&format!(
            "  kind {}  namespace {}  parent {}  leaf {}\n",
            block["kind"].as_str().unwrap_or("?"),
            block["namespace"].as_str().unwrap_or("?"),
            block["parent"].as_str().unwrap_or("none (a root)"),
            block["leaf"]
        ));
        for t in block["tiers"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "  {}: {} hits counted by its policy\n",
                t["tier"].as_str().unwrap_or("?"),
                t["hits"]
            ));
        }
        text.push_str("  replicas:\n");
        for r in block["replicas"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    {} region {} node {} epoch {} slot {} generation {} {}\n",
                r["tier"].as_str().unwrap_or("?"),
                r["region"],
                r["node"],
                r["epoch"],
                r["slot"],
                r["generation"],
                r["state"].as_str().unwrap_or("?")
            ));
        }
        let leases = block["leases"].as_array().map_or(0, Vec::len);
        text.push_str(&format!("  leases: {}\n", if leases == 0 { "none".to_owned() } else { leases.to_string() }));
        for l in block["leases"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    lease {} on region {}, {} ms left\n",
                l["id"], l["region"], l["expires_in_ms"]
            ));
        }
    }
    match block["pins"].as_array() {
        Some(pins) if pins.is_empty() => text.push_str("  L1 pins: none\n"),
        Some(pins) => {
            for p in pins {
                text.push_str(&format!(
                    "  L1 pin: slot {} by agent {} (generation {}{})\n",
                    p["slot"],
                    p["agent"],
                    p["generation"],
                    if p["current"] == true { "" } else { ", an older one" }
                ));
            }
        }
        None => text.push_str("  L1 pins: give --arena PATH to read them\n"),
    }
    text.push_str("  history (oldest first):\n");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    for e in block["history"].as_array().into_iter().flatten() {
        let ago_ms = now.saturating_sub(e["unix_ns"].as_u64().unwrap_or(0)) / 1_000_000;
        text.push_str(&format!(
            "    {:>9.3} s ago  {} (region {} slot {})\n",
            ago_ms as f64 / 1000.0,
            e["what"].as_str().unwrap_or("?"),
            e["region"],
            e["slot"]
        ));
    }
    text
}
