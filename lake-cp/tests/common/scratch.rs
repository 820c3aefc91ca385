//! A test's directory and shared-memory files, removed when dropped.

use std::path::PathBuf;

pub(crate) struct Scratch(pub(crate) PathBuf, pub(crate) Vec<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        for file in &self.1 {
            let _ = std::fs::remove_file(file);
        }
    }
}
