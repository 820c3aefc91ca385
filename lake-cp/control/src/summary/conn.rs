//! One connection of the summary link, as bytes: frames in and out of a
//! non-blocking socket, through the link's authentication where a key is
//! set.

use std::io::{self, Read, Write};
use std::net::TcpStream;

use lake_dp::auth::{AuthError, RecordLink};

/// Writes what `stream` takes of `output` now; false when it closed.
fn write_some(stream: &mut TcpStream, output: &mut Vec<u8>) -> bool {
    while !output.is_empty() {
        match stream.write(output) {
            Ok(0) => return false,
            Ok(n) => {
                output.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// Reads what `stream` has into `input`; false when it closed.
fn read_some(stream: &mut TcpStream, input: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => input.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

/// One connection's bytes: plain frames in and out, through the link's
/// authentication where a key is set.
#[derive(Debug)]
pub(super) struct Wire {
    pub(super) stream: TcpStream,
    link: Option<RecordLink>,
    /// Frames to send.
    pub(super) output: Vec<u8>,
    /// Bytes for the socket: handshake and sealed records.
    sealed: Vec<u8>,
    /// Frames received (checked, where authenticated).
    pub(super) input: Vec<u8>,
}

impl Wire {
    pub(super) fn new(stream: TcpStream, link: Option<(RecordLink, Vec<u8>)>) -> Self {
        let (link, sealed) = match link {
            Some((link, first)) => (Some(link), first),
            None => (None, Vec::new()),
        };
        Self { stream, link, output: Vec::new(), sealed, input: Vec::new() }
    }

    /// Reads what the socket has into `input`: `Ok(false)` when it closed,
    /// an error when the peer failed its authentication.
    pub(super) fn read(&mut self) -> Result<bool, AuthError> {
        let Some(link) = &mut self.link else { return Ok(read_some(&mut self.stream, &mut self.input)) };
        let mut raw = Vec::new();
        let open = read_some(&mut self.stream, &mut raw);
        link.receive(&raw, &mut self.input, &mut self.sealed)?;
        Ok(open)
    }

    /// Writes what the socket takes; false when it closed.
    pub(super) fn write(&mut self) -> bool {
        let Some(link) = &mut self.link else { return write_some(&mut self.stream, &mut self.output) };
        if !self.output.is_empty() {
            link.send(&self.output, &mut self.sealed);
            self.output.clear();
        }
        write_some(&mut self.stream, &mut self.sealed)
    }

    /// Bytes not yet written.
    pub(super) fn unsent(&self) -> usize {
        self.output.len() + self.sealed.len()
    }
}
