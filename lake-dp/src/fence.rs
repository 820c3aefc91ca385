//! Fencing by leader term: every command a `lake-cp` sends carries its
//! leader term; a `lake-dp` keeps the highest term it has seen in a small
//! file beside its L2 tier (durable before a command of a newer term
//! runs) and refuses commands of a lower one — a deposed leader's late or
//! replayed commands never act (DESIGN §3).
//!
//! The file is 20 bytes: the magic `LAKETERM`, the term (u64 LE), and the
//! CRC-32 of the first 16 bytes. It is replaced atomically (written beside
//! it, synced, renamed over it, the directory synced).

use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"LAKETERM";
/// The file a fence is kept in, in the directory it is given (beside L2).
pub const FILE_NAME: &str = "lake-dp.term";
const FILE_BYTES: usize = 20;

/// The highest leader term this data plane has seen, and where it is kept.
#[derive(Debug)]
pub struct TermFence {
    path: PathBuf,
    floor: u64,
}

/// Why the term file could not be read or written.
#[derive(Debug)]
pub struct FenceError(pub String);

impl core::fmt::Display for FenceError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FenceError {}

impl TermFence {
    /// The fence kept in `dir` (`lake-dp.term`): the term it holds, or 0
    /// when there is no file yet. A file that is not a term file (wrong
    /// size, magic or CRC) is an error naming it: nothing is guessed.
    pub fn open(dir: &Path) -> Result<Self, FenceError> {
        let path = dir.join(FILE_NAME);
        let floor = match std::fs::read(&path) {
            Ok(bytes) => decode(&bytes).map_err(|why| FenceError(format!("{}: {why}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(FenceError(format!("reading {}: {e}", path.display()))),
        };
        Ok(Self { path, floor })
    }

    /// The highest term seen.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// Whether a command of `term` may run: refused below the floor; a
    /// newer term is made durable first (an error if it cannot be, and the
    /// command must not run).
    pub fn admit(&mut self, term: u64) -> Result<bool, FenceError> {
        if term < self.floor {
            return Ok(false);
        }
        if term > self.floor {
            self.store(term)?;
            self.floor = term;
        }
        Ok(true)
    }

    fn store(&self, term: u64) -> Result<(), FenceError> {
        let io = |what: &str, e: std::io::Error| FenceError(format!("{what} {}: {e}", self.path.display()));
        let mut bytes = [0u8; FILE_BYTES];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8..16].copy_from_slice(&term.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..16]);
        bytes[16..].copy_from_slice(&crc.to_le_bytes());
        let building = self.path.with_extension("term.new");
        let mut file = std::fs::File::create(&building).map_err(|e| io("creating", e))?;
        file.write_all(&bytes).map_err(|e| io("writing", e))?;
        file.sync_all().map_err(|e| io("syncing", e))?;
        std::fs::rename(&building, &self.path).map_err(|e| io("renaming into", e))?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing the directory of", e))?;
        }
        Ok(())
    }
}

fn decode(bytes: &[u8]) -> Result<u64, String> {
    if bytes.len() != FILE_BYTES {
        return Err(format!("{} bytes, a term file has {FILE_BYTES}", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("not a term file (magic)".into());
    }
    let stored = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
    if crc32fast::hash(&bytes[..16]) != stored {
        return Err("its CRC does not match".into());
    }
    let mut term = [0u8; 8];
    term.copy_from_slice(&bytes[8..16]);
    Ok(u64::from_le_bytes(term))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lake-fence-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_highest_term_survives_a_restart_and_lower_ones_are_refused() {
        let dir = dir("restart");
        let mut fence = TermFence::open(&dir).unwrap();
        assert_eq!(fence.floor(), 0, "no file: nothing seen");
        assert!(fence.admit(3).unwrap());
        assert!(fence.admit(3).unwrap(), "the same term again");
        assert!(!fence.admit(2).unwrap(), "a deposed leader's command");
        assert!(fence.admit(7).unwrap());
        drop(fence);
        let mut again = TermFence::open(&dir).unwrap();
        assert_eq!(again.floor(), 7, "kept across a restart");
        assert!(!again.admit(6).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_term_file_is_an_error_that_names_it() {
        let dir = dir("damaged");
        TermFence::open(&dir).unwrap().admit(9).unwrap();
        let path = dir.join(FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[9] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = TermFence::open(&dir).unwrap_err().to_string();
        assert!(e.contains("lake-dp.term") && e.contains("CRC"), "{e}");
        std::fs::write(&path, b"short").unwrap();
        assert!(TermFence::open(&dir).unwrap_err().to_string().contains("5 bytes"));
        std::fs::write(&path, [0u8; FILE_BYTES]).unwrap();
        assert!(TermFence::open(&dir).unwrap_err().to_string().contains("magic"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
