//! NUMA placement: binding a thread's memory allocations to one node. One
//! `lake-dp` serves one NUMA node; its arena, its pools and its poll
//! thread's stack belong on that node.

use std::io;
use std::path::Path;

/// Most NUMA nodes a node mask here can name.
pub const NUMA_NODES_MAX: u32 = 1024;

/// Whether `node` exists on this machine.
pub fn node_exists(node: u32) -> bool {
    node < NUMA_NODES_MAX && Path::new(&format!("/sys/devices/system/node/node{node}")).exists()
}

/// The machine's NUMA nodes (none where sysfs does not say).
pub fn nodes() -> Vec<u32> {
    let mut nodes: Vec<u32> = std::fs::read_dir("/sys/devices/system/node")
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("node")?.parse().ok())
        .collect();
    nodes.sort_unstable();
    nodes
}

fn set_policy(mode: libc::c_int, node: Option<u32>) -> io::Result<()> {
    let mut mask = [0u64; NUMA_NODES_MAX as usize / 64];
    let (ptr, bits) = match node {
        Some(node) => {
            mask[(node / 64) as usize] = 1 << (node % 64);
            (mask.as_ptr(), u64::from(NUMA_NODES_MAX) + 1)
        }
        None => (core::ptr::null(), 0),
    };
    // SAFETY: set_mempolicy reads `bits` bits from `ptr` (the mask array,
    // or nothing for the default policy); it touches no other memory.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, bits) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Binds the calling thread's future allocations to `node` (MPOL_BIND).
pub fn bind_thread(node: u32) -> io::Result<()> {
    if !node_exists(node) {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("no NUMA node {node} on this machine")));
    }
    set_policy(libc::MPOL_BIND, Some(node))
}

/// Returns the calling thread to the default memory policy.
pub fn unbind_thread() -> io::Result<()> {
    set_policy(libc::MPOL_DEFAULT, None)
}
