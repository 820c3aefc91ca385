//! The cluster's link key: 32 secret bytes every process of one cluster
//! holds, read from a file only its owner may read.

use std::path::Path;

use zeroize::Zeroize;

/// Derivation context of a key's public id.
const CONTEXT_KEY_ID: &str = "lake 2026-12 link key id";

/// A link key. Never printed; wiped from memory when dropped.
#[derive(Clone)]
pub struct LinkKey {
    bytes: [u8; 32],
    id: u64,
}

impl core::fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "LinkKey(id {:016x})", self.id)
    }
}

impl Drop for LinkKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

/// Why a key could not be had.
#[derive(Debug)]
pub enum KeyError {
    /// The file could not be read.
    Io(std::path::PathBuf, std::io::Error),
    /// Others than its owner may read it.
    Exposed(std::path::PathBuf, u32),
    /// It holds neither 64 hex digits nor 32 raw bytes.
    Format(std::path::PathBuf),
}

impl core::fmt::Display for KeyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Io(path, e) => write!(f, "link key {}: {e}", path.display()),
            Self::Exposed(path, mode) => write!(
                f,
                "link key {}: mode {mode:04o} lets others than its owner read it (chmod 600 {})",
                path.display(),
                path.display()
            ),
            Self::Format(path) => {
                write!(f, "link key {}: not 64 hex digits or 32 raw bytes", path.display())
            }
        }
    }
}

impl std::error::Error for KeyError {}

impl LinkKey {
    /// A key of these bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self { id: super::key_id(CONTEXT_KEY_ID, &bytes), bytes }
    }

    /// A fresh random key.
    pub fn generate() -> std::io::Result<Self> {
        let mut bytes = [0u8; 32];
        super::random_bytes(&mut bytes)?;
        Ok(Self::from_bytes(bytes))
    }

    /// Reads a key file: 64 hex digits (surrounding white space allowed)
    /// or exactly 32 raw bytes. The file must not be readable or writable
    /// by group or others.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        use std::os::unix::fs::PermissionsExt;
        let owned = || path.to_path_buf();
        let meta = std::fs::metadata(path).map_err(|e| KeyError::Io(owned(), e))?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyError::Exposed(owned(), mode));
        }
        let mut text = std::fs::read(path).map_err(|e| KeyError::Io(owned(), e))?;
        let parsed = Self::parse(&text).ok_or_else(|| KeyError::Format(owned()));
        text.zeroize();
        parsed
    }

    /// Parses 64 hex digits (white space around them allowed) or 32 raw
    /// bytes.
    pub fn parse(text: &[u8]) -> Option<Self> {
        if text.len() == 32 && !text.iter().all(|b| b.is_ascii_hexdigit() || b.is_ascii_whitespace()) {
            let mut bytes = [0u8; 32];
            bytes.copy_from_slice(text);
            return Some(Self::from_bytes(bytes));
        }
        let trimmed = text.trim_ascii();
        if trimmed.len() != 64 {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (out, pair) in bytes.iter_mut().zip(trimmed.chunks_exact(2)) {
            let digit = |c: u8| (c as char).to_digit(16);
            let (high, low) = (digit(pair[0])?, digit(pair[1])?);
            *out = u8::try_from(high * 16 + low).ok()?;
        }
        Some(Self::from_bytes(bytes))
    }

    /// Writes this key as hex to a new file `path`, readable by its owner
    /// only (`lake keygen`). An existing file is not overwritten.
    pub fn write_new(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        let mut hex = String::with_capacity(65);
        for b in self.bytes {
            hex.push_str(&format!("{b:02x}"));
        }
        hex.push('\n');
        let written = file.write_all(hex.as_bytes()).and_then(|()| file.sync_all());
        let mut hex = hex.into_bytes();
        hex.zeroize();
        written
    }

    /// The key's public id: names it in logs and in a handshake (so a
    /// peer holding another key is told so), reveals nothing of it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The secret bytes (for deriving session keys).
    pub(crate) fn secret(&self) -> &[u8; 32] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_parses_from_hex_or_raw_bytes_and_nothing_else() {
        let hex = b"  000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n";
        let key = LinkKey::parse(hex).unwrap();
        let raw: Vec<u8> = (0u8..32).collect();
        assert_eq!(LinkKey::parse(&raw).unwrap().id(), key.id());
        assert!(LinkKey::parse(b"00").is_none());
        assert!(LinkKey::parse(&[b'g'; 64]).is_none());
        assert_ne!(LinkKey::from_bytes([1; 32]).id(), key.id());
        assert!(!format!("{key:?}").contains("0001"));
    }

    #[test]
    fn a_key_file_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("lake-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cluster.key");
        let key = LinkKey::generate().unwrap();
        key.write_new(&path).unwrap();
        assert!(key.write_new(&path).is_err(), "an existing key is not overwritten");
        assert_eq!(LinkKey::load(&path).unwrap().id(), key.id());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let refused = LinkKey::load(&path).unwrap_err();
        assert!(matches!(refused, KeyError::Exposed(_, 0o644)), "{refused}");
        assert!(refused.to_string().contains("chmod 600"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"not a key").unwrap();
        assert!(matches!(LinkKey::load(&path), Err(KeyError::Format(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
