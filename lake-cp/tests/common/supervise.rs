//! Stopping a `lake` process a test started, as a supervisor would.

/// Stops `child` as a supervisor does — SIGTERM, then SIGKILL if it is
/// still there after 10 s — so a pool removes its shared memory itself (a
/// killed one leaves it in /dev/shm until the next start on its
/// directory, which a test never makes).
pub(crate) fn stop(child: &mut std::process::Child) {
    if child.try_wait().ok().flatten().is_some() {
        return;
    }
    // SAFETY: a plain syscall on the child's pid.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap_or(0), libc::SIGTERM) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Removes the shared memory a `lake serve` on `dir` that was SIGKILLed
/// left (its L1 arena, mirror and cluster view, which the next start on `dir` would
/// reclaim), for a test that starts none there again.
#[allow(dead_code)] // not every test kills a pool
pub(crate) fn reclaim_killed(dir: &std::path::Path) {
    let (arena, mirror) = lake_cp::embedded::EmbeddedConfig::new(dir.to_path_buf()).shared_memory();
    // The cluster view beside the mirror, where the pool kept one.
    let mut view = mirror.clone().into_os_string();
    view.push(".cluster");
    for file in [arena, mirror, view.into()] {
        let _ = std::fs::remove_file(file);
    }
}
