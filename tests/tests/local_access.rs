//! Who may use a pool's local sockets: the kernel's record of
//! the connecting process (`SO_PEERCRED`) is checked against the pool's
//! allow-list. A process of another user — here `nobody`, run by this
//! test as root — is refused by `lake-dp`'s attach socket (told why) and
//! by `lake-cp`'s (closed unanswered), even with the socket files' modes
//! opened wide; on the allow-list it is let in; the pool's own user is
//! never affected. Needs root to run a process as another user: skipped,
//! with the reason printed, otherwise.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool, LocalAccess};

const NOBODY: u32 = 65_534;

fn probe(pool: &EmbeddedPool, uid: u32) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_lake-attach-probe"))
        .args([&pool.dp_socket, &pool.cp_socket, &pool.mirror, &pool.arena])
        .uid(uid)
        .gid(uid)
        .output()
        .expect("the probe runs");
    assert!(out.status.success(), "probe: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pool(dir: &Path, access: LocalAccess) -> EmbeddedPool {
    let config =
        EmbeddedConfig { l1_slots: 16, l2_slots_per_file: 16, access, ..EmbeddedConfig::new(dir.to_path_buf()) };
    let pool = EmbeddedPool::start(&config).expect("the pool starts");
    // The directory open to all, so only the credentials check stands in
    // the way.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    pool
}

#[test]
fn another_user_is_refused_unless_allowed_and_the_owner_is_unaffected() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: running a process as another user needs root");
        return;
    }
    let root = std::env::temp_dir().join(format!("lake-access-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();

    // The default: this user and root only. The sockets' modes are opened
    // to everyone here, so the kernel's file check lets nobody through and
    // the credentials check is what refuses.
    let wide = LocalAccess { socket_mode: Some(0o666), ..LocalAccess::default() };
    let closed = pool(&root.join("default"), wide.clone());
    let mode = std::fs::metadata(&closed.dp_socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666, "the configured socket mode");
    let seen = probe(&closed, NOBODY);
    assert!(seen.contains("dp refused") && seen.contains("Unauthorized"), "{seen}");
    assert!(seen.contains("cp closed"), "{seen}");
    // Nor can it open the pool's shared memory by its paths.
    assert!(seen.contains("arena open: denied") && seen.contains("mirror open: denied"), "{seen}");
    // The owner (root) still attaches.
    let seen = probe(&closed, 0);
    assert!(!seen.contains("Unauthorized"), "{seen}");
    assert!(seen.contains("cp answered"), "{seen}");
    drop(closed);

    // Allowed by uid: let in, and given the arena and the mirror over the
    // socket — files it still cannot open by their paths — it saves and
    // loads exact bytes. The list adds to the owner: root, not listed, is
    // still let in.
    let allowed = pool(&root.join("allowed"), LocalAccess { allow_uids: vec![NOBODY], ..wide });
    let seen = probe(&allowed, NOBODY);
    assert!(seen.contains("dp attached") && seen.contains("round trip: exact"), "{seen}");
    assert!(seen.contains("arena open: denied") && seen.contains("mirror open: denied"), "{seen}");
    assert!(seen.contains("cp answered"), "{seen}");
    let seen = probe(&allowed, 0);
    assert!(!seen.contains("Unauthorized"), "{seen}");
    drop(allowed);

    // By default the sockets are the owner's alone.
    let private = pool(&root.join("private"), LocalAccess::default());
    let mode = std::fs::metadata(&private.cp_socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    drop(private);
    let _ = std::fs::remove_dir_all(&root);
}
