//! Who may connect to a local socket: the peer's credentials, as the
//! kernel gives them (`SO_PEERCRED`, taken at `connect`), against an
//! allow-list of users and groups; and the modes local sockets are made
//! with.

use std::os::fd::AsRawFd;
use std::path::Path;

/// The process at the other end of a Unix socket, as the kernel saw it
/// connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// Its process id.
    pub pid: i32,
    /// Its effective user.
    pub uid: u32,
    /// Its effective group.
    pub gid: u32,
}

impl Credentials {
    /// The credentials of the peer of the connected Unix socket `socket`.
    pub fn of(socket: &impl AsRawFd) -> std::io::Result<Self> {
        let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
        let mut len = libc::socklen_t::try_from(size_of::<libc::ucred>()).unwrap_or(0);
        // SAFETY: a valid descriptor, and an out value of the size passed.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &raw mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { pid: cred.pid, uid: cred.uid, gid: cred.gid })
    }
}

/// The users and groups allowed to connect: always this process's own
/// user and root ([`PeerPolicy::own_user`]), and whoever else is listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerPolicy {
    /// Users allowed.
    pub uids: Vec<u32>,
    /// Groups allowed (a peer's effective group).
    pub gids: Vec<u32>,
}

impl PeerPolicy {
    /// This process's own user and root, nobody else.
    pub fn own_user() -> Self {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let mut uids = vec![me];
        if me != 0 {
            uids.push(0);
        }
        Self { uids, gids: Vec::new() }
    }

    /// [`PeerPolicy::own_user`] and the `uids` and `gids` configured: a
    /// list adds to who may connect, and never shuts out the pool's own
    /// processes (its data plane attaches to its control plane as this
    /// user).
    pub fn of(uids: &[u32], gids: &[u32]) -> Self {
        let mut policy = Self::own_user();
        for &uid in uids {
            if !policy.uids.contains(&uid) {
                policy.uids.push(uid);
            }
        }
        policy.gids = gids.to_vec();
        policy
    }

    /// Whether `peer` may connect.
    pub fn allows(&self, peer: &Credentials) -> bool {
        self.uids.contains(&peer.uid) || self.gids.contains(&peer.gid)
    }

    /// The peer of `socket` if it may connect; otherwise why not, for the
    /// log (who it was).
    pub fn check(&self, socket: &impl AsRawFd) -> Result<Credentials, String> {
        let peer = Credentials::of(socket).map_err(|e| format!("its credentials could not be read: {e}"))?;
        if self.allows(&peer) {
            Ok(peer)
        } else {
            Err(format!("pid {} uid {} gid {} is not on the allow-list", peer.pid, peer.uid, peer.gid))
        }
    }
}

/// Gives the socket file (or shared-memory file) `path` mode `mode` and,
/// if given, group `gid`.
pub fn restrict(path: &Path, mode: u32, gid: Option<u32>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Makes room for a socket at `path`: a socket file there (one a process
/// that died left, or a predecessor's it takes over) is removed; anything
/// else there — a file, a directory, a link — is not Lake's to replace,
/// and is refused (`AlreadyExists`, naming it) and left as it is.
pub fn clear_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} is there and is not a socket: not replaced", path.display()),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A group by name or number (`"lake"`, `"1001"`).
pub fn group_id(name: &str) -> Result<u32, String> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let c_name = std::ffi::CString::new(name).map_err(|_| format!("group {name:?}: not a name"))?;
    // SAFETY: a NUL-terminated name; the result is read at once, before
    // any other call could reuse its static storage.
    let entry = unsafe { libc::getgrnam(c_name.as_ptr()) };
    if entry.is_null() {
        return Err(format!("group {name:?}: no such group"));
    }
    // SAFETY: non-null, pointing at the C library's group record.
    Ok(unsafe { (*entry).gr_gid })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_names_the_peer_and_the_list_decides() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let me = Credentials::of(&a).unwrap();
        assert_eq!(me.pid, i32::try_from(std::process::id()).unwrap());
        assert!(PeerPolicy::of(&[], &[]).check(&a).is_ok());
        let stranger = PeerPolicy { uids: vec![me.uid.wrapping_add(1)], gids: vec![] };
        let refused = stranger.check(&a).unwrap_err();
        assert!(refused.contains(&format!("uid {}", me.uid)), "{refused}");
        assert!(PeerPolicy { uids: vec![], gids: vec![me.gid] }.check(&a).is_ok());
        // A configured list adds to the owner; it never shuts the owner out.
        assert!(PeerPolicy::of(&[me.uid.wrapping_add(1)], &[]).check(&a).is_ok());
        assert!(PeerPolicy::of(&[], &[me.gid.wrapping_add(1)]).check(&a).is_ok());
        assert_eq!(group_id("0").unwrap(), 0);
        assert!(group_id("no-such-group-here").is_err());
    }
}
