//! What a pool makes in its directory and in shared memory, and takes
//! away when it goes: the directory's lock (one pool at a time), the
//! record a killed pool leaves for the next, and the files it does not
//! keep.

use std::path::{Path, PathBuf};

use super::{LOCK_FILE, ServeError};

/// What a pool created and removes when it goes, whether it started or
/// not: files (sockets, shared memory, its L2 files where they do not
/// outlive it), then its lock, then its directory if it made it and it is
/// empty. Nothing else: a user's file in the directory stays.
#[derive(Debug)]
pub(super) struct Created {
    pub(super) dir: PathBuf,
    pub(super) made_dir: bool,
    pub(super) lock: Option<std::fs::File>,
    pub(super) files: Vec<PathBuf>,
}

impl Created {
    /// Takes `dir` (making it if missing) and its lock, `DIR/lake.lock`
    /// (an advisory write lock on the open file, released when this
    /// process ends however it ends); a pool already there is named.
    pub(super) fn take(dir: &Path) -> Result<Self, ServeError> {
        use std::io::Read;
        use std::os::fd::AsRawFd;

        use std::os::unix::fs::MetadataExt;

        let made_dir = !dir.exists();
        std::fs::create_dir_all(dir).map_err(ServeError::io(dir.display()))?;
        let mut created = Self { dir: dir.to_owned(), made_dir, lock: None, files: Vec::new() };
        let path = dir.join(LOCK_FILE);
        let mut lock = loop {
            let mut lock = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(ServeError::io(path.display()))?;
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let error = std::io::Error::last_os_error();
                if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    let mut holder = String::new();
                    let _ = lock.read_to_string(&mut holder);
                    let pid = holder.lines().next().and_then(|line| line.trim().parse().ok());
                    return Err(ServeError::Taken { dir: dir.to_owned(), pid });
                }
                return Err(ServeError::Io { what: format!("{}: locking", path.display()), error });
            }
            // A pool that stopped meanwhile unlinked the file it held: a
            // lock on that one guards nothing. Again, on the file there now.
            let held = lock.metadata().map_err(ServeError::io(path.display()))?;
            if std::fs::metadata(&path).is_ok_and(|now| (now.dev(), now.ino()) == (held.dev(), held.ino())) {
                break lock;
            }
        };
        // A pool of this directory that was killed left its record: its
        // shared memory, named there, is removed (nothing else is).
        let mut previous = String::new();
        let _ = lock.read_to_string(&mut previous);
        for line in previous.lines().skip(1) {
            let stale = Path::new(line);
            if stale.parent() == Some(Path::new("/dev/shm"))
                && stale.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("lake-"))
            {
                let _ = std::fs::remove_file(stale);
            }
        }
        created.lock = Some(lock);
        Ok(created)
    }

    /// Writes the lock file's record: this process's pid, then the shared
    /// memory it makes (for the next pool of the directory to remove, if
    /// this one is killed).
    pub(super) fn record(&mut self, shared_memory: &[&Path]) -> Result<(), ServeError> {
        use std::io::{Seek, Write};

        let path = self.dir.join(LOCK_FILE);
        let Some(lock) = self.lock.as_mut() else { return Ok(()) };
        let mut text = format!("{}\n", std::process::id());
        for file in shared_memory {
            text += &format!("{}\n", file.display());
        }
        lock.set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| lock.write_all(text.as_bytes()))
            .map_err(ServeError::io(path.display()))
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
        if let Some(lock) = self.lock.take() {
            // Unlinked while still held: no other pool takes this file's
            // lock meanwhile and then finds it gone.
            let _ = std::fs::remove_file(self.dir.join(LOCK_FILE));
            drop(lock);
        }
        if self.made_dir {
            // Only if empty: whatever else is there stays.
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}
