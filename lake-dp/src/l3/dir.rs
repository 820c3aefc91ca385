//! A directory as the object store: the embedded default (a single-node
//! pool needs no service). An object is a file under the root, written to
//! a temporary name, flushed and renamed into place, so a crash leaves the
//! old object or the new one, never half of one.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{ObjectStore, StoreError};

/// A directory of objects.
#[derive(Clone, Debug)]
pub struct DirStore {
    root: PathBuf,
}

impl DirStore {
    /// The store at `root` (created if missing).
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(root)
            .map_err(|e| StoreError::Permanent(format!("{}: creating the store: {e}", root.display())))?;
        Ok(Self { root: root.to_owned() })
    }

    fn path(&self, name: &str) -> Result<PathBuf, StoreError> {
        // Names are Lake's own, but a store must not be walked out of.
        if name.is_empty() || name.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
            return Err(StoreError::Permanent(format!("object name {name:?}: not a plain path")));
        }
        Ok(self.root.join(name))
    }
}

fn io(what: &str, path: &Path) -> impl Fn(std::io::Error) -> StoreError {
    let context = format!("{}: {what}", path.display());
    move |e| StoreError::Transient(format!("{context}: {e}"))
}

impl ObjectStore for DirStore {
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let path = self.path(name)?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io("creating its directory", parent))?;
        }
        let temporary = path.with_extension(format!("part-{}", std::process::id()));
        let mut file = std::fs::File::create(&temporary).map_err(io("creating", &temporary))?;
        file.write_all(bytes).map_err(io("writing", &temporary))?;
        file.sync_data().map_err(io("flushing", &temporary))?;
        std::fs::rename(&temporary, &path).map_err(io("renaming into place", &path))
    }

    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path(name)?;
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    fn get_head(&mut self, name: &str, len: usize) -> Result<Option<Vec<u8>>, StoreError> {
        use std::io::Read;
        let path = self.path(name)?;
        let file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("opening", &path)(e)),
        };
        let mut head = Vec::with_capacity(len);
        file.take(len as u64).read_to_end(&mut head).map_err(io("reading", &path))?;
        Ok(Some(head))
    }

    fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        let path = self.path(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        let mut pending = vec![self.root.clone()];
        while let Some(dir) = pending.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io("listing", &dir)(e)),
            };
            for entry in entries {
                let entry = entry.map_err(io("listing", &dir))?;
                let path = entry.path();
                if path.is_dir() {
                    pending.push(path);
                } else if let Ok(relative) = path.strip_prefix(&self.root) {
                    let name = relative.to_string_lossy().into_owned();
                    if name.starts_with(prefix) && !name.contains(".part-") {
                        names.push(name);
                    }
                }
            }
        }
        names.sort_unstable();
        Ok(names)
    }
}
