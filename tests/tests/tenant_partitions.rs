//! Tenants kept apart within one pool: each tenant's L1 blocks lie in a
//! partition of the arena of its own — memory at no path, sealed at its
//! size — and its blocks are published in a mirror of its own (a file
//! only the pool's user may open), passed by the data plane to its users'
//! engines alone. Two tenants' engines — the real agent library, run by
//! this test as two users (`nobody` and 65533) — attach to one pool at
//! once: each saves and loads its own blocks exact; the other can neither
//! open the tenant's partition (at no path; nor through the pool's
//! descriptors in `/proc`), nor map it, nor find its keys, nor load its
//! blocks, nor publish blocks of its own bytes under the tenant's
//! namespace; the tenant's blocks stay its own bytes. An engine that
//! shrinks or grows every descriptor of the pool's memory it was given
//! changes none, and the pool serves on. The same pool without partitions
//! lets the other tenant's engine find and load them: what the partitions
//! stop. Needs root to run processes as other users: skipped, with the
//! reason printed, otherwise.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool, LocalAccess, TenantPartition};
use lake_cp::tier::TenantQuota;

const ACME_UID: u32 = 65_534;
const BOLT_UID: u32 = 65_533;
const ACME: u64 = 0xa1;
const BOLT: u64 = 0xb1;

fn probe(pool: &EmbeddedPool, uid: u32, namespace: u64, action: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_lake-partition-probe"))
        .arg(&pool.dp_socket)
        .arg(&pool.mirror)
        .arg(format!("{namespace:x}"))
        .args(action)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("the probe runs");
    assert!(out.status.success(), "probe: {}", String::from_utf8_lossy(&out.stderr));
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("uid {uid}, namespace {namespace:x}, {action:?}:\n{seen}");
    seen
}

fn start(dir: &Path, partitioned: bool) -> EmbeddedPool {
    let access =
        LocalAccess { allow_uids: vec![ACME_UID, BOLT_UID], socket_mode: Some(0o666), ..LocalAccess::default() };
    let mut config = EmbeddedConfig { l1_slots: 16, l2_slots_per_file: 16, access, ..EmbeddedConfig::new(dir.into()) };
    let slot = lake_dp::stored::object_bytes(config.block_bytes);
    for (tenant, namespace, uid) in [("acme", ACME, ACME_UID), ("bolt", BOLT, BOLT_UID)] {
        config.tiers.tenant_quotas.push(TenantQuota {
            tenant: tenant.into(),
            namespaces: vec![namespace],
            tier: lake_dp::Tier::L1Dram,
            bytes: 8 * slot,
        });
        if partitioned {
            config.partitions.push(TenantPartition { tenant: tenant.into(), uids: vec![uid], gids: Vec::new() });
        }
    }
    let pool = EmbeddedPool::start(&config).expect("the pool starts");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    pool
}

fn beside(path: &Path, name: &str) -> PathBuf {
    let mut path = path.as_os_str().to_owned();
    path.push(format!(".{name}"));
    PathBuf::from(path)
}

#[test]
fn another_tenants_engine_cannot_map_load_or_forge_a_tenants_blocks() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: running processes as other users needs root");
        return;
    }
    let root = std::env::temp_dir().join(format!("lake-partitions-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let pid = std::process::id().to_string();

    let pool = start(&root.join("apart"), true);
    let shared_mirror = pool.mirror.clone();
    // No part of the arena is at a path: not its records, not a partition.
    let arena_files = ["", "shared", "acme", "bolt"]
        .map(|name| if name.is_empty() { pool.arena.clone() } else { beside(&pool.arena, name) });
    assert!(!arena_files.iter().any(|f| f.exists()), "{arena_files:?}");
    // Acme's mirror is a file only the pool's user may open.
    let meta = std::fs::metadata(beside(&shared_mirror, "acme")).expect("acme's mirror");
    assert_eq!((meta.mode() & 0o777, meta.uid()), (0o600, 0), "the pool's user's alone");

    // Acme's engine saves and loads its own, through the partition it is
    // given: mapped in its process, bolt's not.
    let seen = probe(&pool, ACME_UID, ACME, &["save"]);
    assert!(seen.contains("saved 4") && seen.contains("loaded 4 exact"), "{seen}");
    assert!(seen.contains(".acme") && !seen.contains(".bolt") && !seen.contains(".shared"), "{seen}");
    // Bolt's engine, attached beside it, reaches none of acme's blocks.
    let seen = probe(&pool, BOLT_UID, ACME, &["reach", &pid]);
    assert!(seen.contains("pool fds open: 0"), "{seen}");
    assert!(seen.contains("hits 0") && seen.contains("loaded 0") && seen.contains("forged saved 0"), "{seen}");
    assert!(!seen.contains(".acme") && !seen.contains(".shared"), "none of it mapped: {seen}");
    // Bolt's own blocks are its own to save and load, after it tried to
    // shrink (and grow) every descriptor of the pool's memory it holds:
    // its partition, the arena's records, its port, its mirror — all
    // sealed or read-only, none changed, and the pool serves on.
    let seen = probe(&pool, BOLT_UID, BOLT, &["resize"]);
    let given = seen.lines().find(|l| l.starts_with("given ")).unwrap_or_default();
    assert!(given.contains(".bolt") && given.contains("agent-ports") && given.ends_with("resized 0"), "{seen}");
    assert!(seen.contains("saved 4") && seen.contains("loaded 4 exact"), "{seen}");
    // Acme's blocks are still acme's bytes, all of them.
    let seen = probe(&pool, ACME_UID, ACME, &["check"]);
    assert!(seen.contains("hits 4") && seen.contains("loaded 4 exact"), "{seen}");
    // The pool's own user maps partition 0: the namespaces of no partition
    // are saved there, and acme's cannot be.
    let seen = probe(&pool, 0, 0xc1, &["save"]);
    assert!(seen.contains("saved 4") && seen.contains("loaded 4 exact"), "{seen}");
    assert!(seen.contains(".shared") && !seen.contains(".acme") && !seen.contains(".bolt"), "{seen}");
    let seen = probe(&pool, 0, ACME, &["reach", &pid]);
    assert!(seen.contains("hits 0") && seen.contains("forged saved 0"), "{seen}");
    let seen = probe(&pool, ACME_UID, ACME, &["check"]);
    assert!(seen.contains("loaded 4 exact"), "{seen}");
    drop(pool);
    assert!(!beside(&shared_mirror, "acme").exists(), "acme's mirror goes with its pool");

    // Without partitions, bolt's engine loads acme's blocks.
    let shared = start(&root.join("shared"), false);
    let seen = probe(&shared, ACME_UID, ACME, &["save"]);
    assert!(seen.contains("loaded 4 exact"), "{seen}");
    let seen = probe(&shared, BOLT_UID, ACME, &["reach", &pid]);
    assert!(seen.contains("hits 4") && seen.contains("loaded 4"), "{seen}");
    drop(shared);
    let _ = std::fs::remove_dir_all(&root);
}
