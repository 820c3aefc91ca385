//! One sample of `lake-cp`'s `/metrics`.

/// The value of the sample `name` (with its labels, as exposed) at
/// `address`, if it is there.
pub(crate) fn metric(address: std::net::SocketAddr, name: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: lake\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))?;
    line.rsplit(' ').next()?.parse().ok()
}
