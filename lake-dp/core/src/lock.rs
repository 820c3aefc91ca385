//! Liveness through the kernel: open-file-description byte-range locks. A
//! lock lives exactly as long as the open file that took it — the kernel
//! drops it when the process dies, however it dies — and unlike a pid it
//! cannot be reused by an unrelated process or mean something else in
//! another pid namespace (engines run in containers).
//!
//! In the L1 arena, `lake-dp` holds byte 0 while it serves the arena and
//! each agent holds the first byte of its agent record while it owns the
//! record; `lake-dp` holds byte 0 of every L2 file it drives. Locks are
//! advisory: they guard nothing by themselves, they only answer "is the
//! holder alive?".

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

fn flock(kind: libc::c_int, byte: u64) -> io::Result<libc::flock> {
    // SAFETY: flock is plain data; all zeroes is a valid value.
    let mut lock: libc::flock = unsafe { core::mem::zeroed() };
    lock.l_type = i16::try_from(kind).map_err(|_| io::ErrorKind::InvalidInput)?;
    lock.l_whence = i16::try_from(libc::SEEK_SET).map_err(|_| io::ErrorKind::InvalidInput)?;
    lock.l_start = i64::try_from(byte).map_err(|_| io::ErrorKind::InvalidInput)?;
    lock.l_len = 1;
    // OFD locks require l_pid 0 (zeroed above).
    Ok(lock)
}

fn fcntl(file: &File, command: libc::c_int, lock: &mut libc::flock) -> io::Result<()> {
    // SAFETY: a valid descriptor and a valid flock for the lock commands.
    if unsafe { libc::fcntl(file.as_raw_fd(), command, lock as *mut libc::flock) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Takes the write lock on `byte` for `file`'s open file description.
/// `Ok(false)`: another open file holds it.
pub fn try_lock(file: &File, byte: u64) -> io::Result<bool> {
    let mut lock = flock(libc::F_WRLCK, byte)?;
    match fcntl(file, libc::F_OFD_SETLK, &mut lock) {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Drops `file`'s lock on `byte` (closing the file drops it too).
pub fn unlock(file: &File, byte: u64) -> io::Result<()> {
    let mut lock = flock(libc::F_UNLCK, byte)?;
    fcntl(file, libc::F_OFD_SETLK, &mut lock)
}

/// Whether an open file other than `file`'s holds a lock on `byte`.
pub fn held_by_other(file: &File, byte: u64) -> io::Result<bool> {
    let mut lock = flock(libc::F_WRLCK, byte)?;
    fcntl(file, libc::F_OFD_GETLK, &mut lock)?;
    Ok(i32::from(lock.l_type) != libc::F_UNLCK)
}

/// A second open file description of `file` (through /proc, which works
/// for memfds too), so that a lock taken on it is independent of every
/// other handle in this process.
pub fn reopen(file: &File) -> io::Result<File> {
    reopen_fd(file.as_raw_fd())
}

/// [`reopen`] for a descriptor of this process.
pub fn reopen_fd(fd: std::os::fd::RawFd) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(format!("/proc/self/fd/{fd}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_are_per_open_file_and_die_with_it() {
        let path = format!("/dev/shm/lake-lock-test-{}", std::process::id());
        let first = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let second = File::options().read(true).write(true).open(&path).unwrap();
        assert!(!held_by_other(&second, 5).unwrap());
        assert!(try_lock(&first, 5).unwrap());
        assert!(held_by_other(&second, 5).unwrap());
        assert!(!held_by_other(&first, 5).unwrap(), "a file's own lock does not count");
        assert!(!try_lock(&second, 5).unwrap());
        assert!(try_lock(&second, 6).unwrap(), "bytes are independent");
        let third = reopen(&first).unwrap();
        assert!(held_by_other(&third, 5).unwrap(), "a reopened file is another open file");
        drop(first);
        assert!(!held_by_other(&second, 5).unwrap(), "closing the file drops its lock");
        unlock(&second, 6).unwrap();
        assert!(!held_by_other(&third, 6).unwrap());
        std::fs::remove_file(path).unwrap();
    }
}
