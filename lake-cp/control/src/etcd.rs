//! A small etcd v3 client over etcd's own JSON gateway (`/v3/...`, HTTP or
//! HTTPS, every call blocking with a timeout). Lake asks etcd for little —
//! leases, one create-if-absent, guarded puts, ranges — and never on a
//! request path: [`crate::ha`] calls it from the control plane's
//! housekeeping. The gateway is part of every etcd server, so this needs
//! no gRPC stack, HTTP library or async runtime in a process that has
//! none: one short HTTP/1.1 exchange a call.
//!
//! Keys and values are bytes (base64 on the wire); revisions and lease ids
//! are etcd's `int64`s, sent as strings. A zero value is left out of
//! etcd's answers: an absent number reads as 0.
//!
//! `https://` endpoints are spoken over TLS (rustls): the server's
//! certificate checked against a CA file where given ([`EtcdTls`]), else
//! the system's roots; with a certificate and key, this client proves
//! itself to a cluster that asks for client certificates
//! (`--client-cert-auth`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

/// Why an etcd call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdError {
    /// An endpoint is not `http://host:port` or `https://host:port`.
    BadEndpoint(String),
    /// The TLS settings cannot be used: a file unreadable, not PEM, a key
    /// that does not go with its certificate.
    Tls(String),
    /// No endpoint answered (refused, reset, timed out): etcd is down or
    /// unreachable from here; the caller tries again later.
    Unreachable(String),
    /// etcd answered with an error (its gRPC code and message).
    Server {
        /// gRPC status code (5: not found, e.g. an expired lease).
        code: i64,
        /// etcd's words.
        message: String,
    },
    /// An answer that is not what the API returns.
    Malformed(String),
}

impl core::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::BadEndpoint(e) => write!(f, "etcd endpoint {e:?}: expected http://host:port or https://host:port"),
            Self::Tls(why) => write!(f, "etcd TLS: {why}"),
            Self::Unreachable(why) => write!(f, "etcd unreachable: {why}"),
            Self::Server { code, message } => write!(f, "etcd: {message} (code {code})"),
            Self::Malformed(why) => write!(f, "etcd answered something unexpected: {why}"),
        }
    }
}

impl std::error::Error for EtcdError {}

/// A granted lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// etcd's id.
    pub id: i64,
    /// Seconds it lives without a keep-alive.
    pub ttl: i64,
}

/// One key's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// Its value.
    pub value: Vec<u8>,
    /// The store revision that created it (a key made again gets a new one).
    pub create_revision: i64,
    /// The revision of its last change.
    pub mod_revision: i64,
    /// The lease it lives under (0: none).
    pub lease: i64,
}

/// How to speak TLS to an etcd cluster: whose certificates to trust, and
/// this client's own (for a cluster that asks for client certificates).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA certificates (PEM) the servers' certificates are checked
    /// against; none: the system's roots.
    pub ca: Option<PathBuf>,
    /// This client's certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub key: Option<PathBuf>,
}

impl EtcdTls {
    /// The rustls client configuration these settings make.
    fn config(&self) -> Result<Arc<rustls::ClientConfig>, EtcdError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let unreadable = |path: &PathBuf| {
            let path = path.display().to_string();
            move |e: rustls::pki_types::pem::Error| EtcdError::Tls(format!("{path}: {e}"))
        };
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca {
            Some(ca) => {
                for cert in CertificateDer::pem_file_iter(ca).map_err(unreadable(ca))? {
                    roots
                        .add(cert.map_err(unreadable(ca))?)
                        .map_err(|e| EtcdError::Tls(format!("{}: {e}", ca.display())))?;
                }
                if roots.is_empty() {
                    return Err(EtcdError::Tls(format!("{}: no certificate in it", ca.display())));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
                if roots.is_empty() {
                    return Err(EtcdError::Tls("no CA given and no system root certificates found".into()));
                }
            }
        }
        let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .map_err(unreadable(cert))?
                    .collect::<Result<_, _>>()
                    .map_err(unreadable(cert))?;
                let private = PrivateKeyDer::from_pem_file(key).map_err(unreadable(key))?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| EtcdError::Tls(format!("{} and {}: {e}", cert.display(), key.display())))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err(EtcdError::Tls("a client certificate needs its key, and a key its certificate".into())),
        };
        Ok(Arc::new(config))
    }
}

/// A client of one etcd cluster (its endpoints tried in order).
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    timeout: Duration,
    /// For `https://` endpoints.
    tls: Option<Arc<rustls::ClientConfig>>,
}

fn number(value: &Value, name: &str) -> Result<i64, EtcdError> {
    match value.get(name) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::String(s)) => s.parse().map_err(|_| EtcdError::Malformed(format!("{name} {s:?}"))),
        Some(Value::Number(n)) => n.as_i64().ok_or_else(|| EtcdError::Malformed(format!("{name} {n}"))),
        Some(other) => Err(EtcdError::Malformed(format!("{name} {other}"))),
    }
}

fn bytes(value: &Value, name: &str) -> Result<Vec<u8>, EtcdError> {
    match value.get(name) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => B64.decode(s).map_err(|e| EtcdError::Malformed(format!("{name}: {e}"))),
        Some(other) => Err(EtcdError::Malformed(format!("{name} {other}"))),
    }
}

fn kv_of(value: &Value) -> Result<Kv, EtcdError> {
    Ok(Kv {
        key: bytes(value, "key")?,
        value: bytes(value, "value")?,
        create_revision: number(value, "create_revision")?,
        mod_revision: number(value, "mod_revision")?,
        lease: number(value, "lease")?,
    })
}

fn kvs_of(value: &Value) -> Result<Vec<Kv>, EtcdError> {
    match value.get("kvs") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(kv_of).collect(),
        Some(other) => Err(EtcdError::Malformed(format!("kvs {other}"))),
    }
}

/// The end of the range of every key starting with `prefix` (etcd's
/// convention: the prefix with its last byte below 0xff incremented).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl Etcd {
    /// A client of the cluster at `endpoints` (`http://host:port` or
    /// `https://host:port`, at least one; https with the system's roots and
    /// no client certificate); every call gives up after `timeout` per
    /// endpoint.
    pub fn new(endpoints: &[&str], timeout: Duration) -> Result<Self, EtcdError> {
        Self::with_tls(endpoints, timeout, &EtcdTls::default())
    }

    /// As [`Etcd::new`], `https://` endpoints spoken with `tls`.
    pub fn with_tls(endpoints: &[&str], timeout: Duration, tls: &EtcdTls) -> Result<Self, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::BadEndpoint(String::new()));
        }
        let mut out = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            let (scheme, rest) = match endpoint.split_once("://") {
                Some((scheme @ ("http" | "https"), rest)) => (scheme, rest),
                _ => return Err(EtcdError::BadEndpoint((*endpoint).into())),
            };
            let rest = rest.trim_end_matches('/');
            let port = rest.rsplit_once(':').map(|(host, port)| (host, port.parse::<u16>()));
            if !matches!(port, Some((host, Ok(_))) if !host.is_empty() && !host.contains('/')) {
                return Err(EtcdError::BadEndpoint((*endpoint).into()));
            }
            out.push(format!("{scheme}://{rest}"));
        }
        let secure = out.iter().any(|e| e.starts_with("https://"));
        if !secure && *tls != EtcdTls::default() {
            return Err(EtcdError::Tls("a CA or client certificate is given, but no endpoint is https://".into()));
        }
        let tls = if secure { Some(tls.config()?) } else { None };
        Ok(Self { endpoints: out, timeout, tls })
    }

    /// One gateway call: the first endpoint that answers.
    fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let mut last = String::new();
        for endpoint in &self.endpoints {
            let (status, text) = match http(endpoint, self.tls.as_ref(), "POST", path, &body.to_string(), self.timeout)
            {
                Ok(answer) => answer,
                Err(e) => {
                    last = format!("{endpoint}: {e}");
                    continue;
                }
            };
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| EtcdError::Malformed(format!("{path}: HTTP {status}: {e}: {text:.200}")))?;
            if let Some(message) = value.get("error").or_else(|| value.get("message")).and_then(Value::as_str) {
                return Err(EtcdError::Server { code: number(&value, "code")?, message: message.to_owned() });
            }
            if !(200..300).contains(&status) {
                return Err(EtcdError::Malformed(format!("{path}: HTTP {status}: {text:.200}")));
            }
            return Ok(value);
        }
        Err(EtcdError::Unreachable(last))
    }

    /// Grants a lease of `ttl` seconds.
    pub fn grant(&self, ttl: i64) -> Result<Lease, EtcdError> {
        let answer = self.call("/v3/lease/grant", &json!({ "TTL": ttl }))?;
        Ok(Lease { id: number(&answer, "ID")?, ttl: number(&answer, "TTL")? })
    }

    /// Refreshes `lease`; its seconds left, 0 when it has expired (or was
    /// revoked): everything under it is gone.
    pub fn keep_alive(&self, lease: Lease) -> Result<i64, EtcdError> {
        let answer = self.call("/v3/lease/keepalive", &json!({ "ID": lease.id.to_string() }))?;
        let result = answer.get("result").ok_or_else(|| EtcdError::Malformed("keepalive: no result".into()))?;
        number(result, "TTL")
    }

    /// Ends `lease` now, and every key under it (absent already is fine).
    pub fn revoke(&self, lease: Lease) -> Result<(), EtcdError> {
        match self.call("/v3/lease/revoke", &json!({ "ID": lease.id.to_string() })) {
            Ok(_) | Err(EtcdError::Server { code: 5, .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Sets `key` to `value` (under `lease`, if any); the store revision.
    pub fn put(&self, key: &[u8], value: &[u8], lease: Option<Lease>) -> Result<i64, EtcdError> {
        let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if let Some(lease) = lease {
            body["lease"] = Value::String(lease.id.to_string());
        }
        let answer = self.call("/v3/kv/put", &body)?;
        number(answer.get("header").unwrap_or(&Value::Null), "revision")
    }

    /// The entry of `key`, if there is one.
    pub fn get(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        let answer = self.call("/v3/kv/range", &json!({ "key": B64.encode(key) }))?;
        Ok(kvs_of(&answer)?.into_iter().next())
    }

    /// Every entry whose key starts with `prefix`, in key order.
    pub fn list(&self, prefix: &[u8]) -> Result<Vec<Kv>, EtcdError> {
        let body = json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) });
        kvs_of(&self.call("/v3/kv/range", &body)?)
    }

    /// Removes `key` (absent already is fine).
    pub fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.call("/v3/kv/deleterange", &json!({ "key": B64.encode(key) })).map(|_| ())
    }

    /// Creates `key` with `value` under `lease` only if no such key exists:
    /// `Ok(Ok(revision))` when this call made it (its create revision),
    /// `Ok(Err(existing))` when another did.
    pub fn create(&self, key: &[u8], value: &[u8], lease: Lease) -> Result<Result<i64, Kv>, EtcdError> {
        let key64 = B64.encode(key);
        let body = json!({
            "compare": [{ "key": key64, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
            "success": [{ "request_put": { "key": key64, "value": B64.encode(value), "lease": lease.id.to_string() } }],
            "failure": [{ "request_range": { "key": key64 } }],
        });
        let answer = self.call("/v3/kv/txn", &body)?;
        let first = answer.get("responses").and_then(|r| r.get(0));
        if answer.get("succeeded").and_then(Value::as_bool) == Some(true) {
            let header = first.and_then(|r| r.get("response_put")).and_then(|p| p.get("header"));
            return Ok(Ok(number(header.unwrap_or(&Value::Null), "revision")?));
        }
        let range = first.and_then(|r| r.get("response_range")).unwrap_or(&Value::Null);
        match kvs_of(range)?.into_iter().next() {
            Some(existing) => Ok(Err(existing)),
            // Gone between the compare and the read: nobody holds it.
            None => Err(EtcdError::Server { code: 10, message: "the key vanished mid-transaction; try again".into() }),
        }
    }

    /// Sets `key` to `value` only while `guard` exists with create revision
    /// `guard_revision` (and, if `guard_value` is given, that value): a
    /// write fenced by a leadership. Whether it was written.
    pub fn put_if(
        &self,
        guard: &[u8],
        guard_revision: i64,
        guard_value: Option<&[u8]>,
        key: &[u8],
        value: &[u8],
    ) -> Result<bool, EtcdError> {
        let guard64 = B64.encode(guard);
        let mut compare = vec![
            json!({ "key": guard64, "target": "CREATE", "result": "EQUAL", "create_revision": guard_revision.to_string() }),
        ];
        if let Some(expected) = guard_value {
            compare
                .push(json!({ "key": guard64, "target": "VALUE", "result": "EQUAL", "value": B64.encode(expected) }));
        }
        let body = json!({
            "compare": compare,
            "success": [{ "request_put": { "key": B64.encode(key), "value": B64.encode(value) } }],
        });
        let answer = self.call("/v3/kv/txn", &body)?;
        Ok(answer.get("succeeded").and_then(Value::as_bool) == Some(true))
    }

    /// Whether some endpoint answers `/health` as healthy.
    pub fn healthy(&self) -> bool {
        self.endpoints.iter().any(|endpoint| {
            http(endpoint, self.tls.as_ref(), "GET", "/health", "", self.timeout)
                .is_ok_and(|(status, text)| status == 200 && text.contains("\"true\""))
        })
    }
}

/// One HTTP/1.1 exchange on a connection of its own (`Connection: close`):
/// the status and the body, de-chunked. The gateway ends its error answers
/// with gRPC trailers after a chunked body, which are read past here.
fn http(
    endpoint: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    use std::io::{Error, ErrorKind};
    use std::net::ToSocketAddrs;

    let (secure, authority) = match endpoint.split_once("://") {
        Some((scheme, authority)) => (scheme == "https", authority),
        None => (false, endpoint),
    };
    let address = authority
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("{authority}: no address")))?;
    let stream = std::net::TcpStream::connect_timeout(&address, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let raw = if secure {
        let config = tls.ok_or_else(|| Error::new(ErrorKind::InvalidInput, "https without TLS settings"))?;
        let host = authority.rsplit_once(':').map_or(authority, |(host, _)| host);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| Error::new(ErrorKind::InvalidInput, format!("{host}: {e}")))?;
        let session = rustls::ClientConnection::new(Arc::clone(config), name).map_err(Error::other)?;
        exchange(&mut rustls::StreamOwned::new(session, stream), &request)?
    } else {
        exchange(&mut { stream }, &request)?
    };
    parse_answer(&raw)
}

/// Sends `request` and reads everything the server sends until it closes
/// (4 MiB at most). A TLS server that closes without saying so ends the
/// answer too: an answer cut short fails its parse (a chunk's size, the
/// JSON).
fn exchange(stream: &mut (impl std::io::Read + std::io::Write), request: &str) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    stream.write_all(request.as_bytes())?;
    stream.flush()?;
    // Answers are small (etcd caps requests at 1.5 MiB; Lake's are bytes).
    let mut raw = Vec::new();
    match stream.take(4 << 20).read_to_end(&mut raw) {
        Ok(_) => Ok(raw),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => Ok(raw),
        Err(e) => Err(e),
    }
}

/// The status and the body of an HTTP/1.1 answer, de-chunked.
fn parse_answer(raw: &[u8]) -> std::io::Result<(u16, String)> {
    use std::io::{Error, ErrorKind};

    let bad = |why: &str| Error::new(ErrorKind::InvalidData, why.to_owned());
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| bad("headers not UTF-8"))?;
    let status = head.split(' ').nth(1).and_then(|code| code.parse::<u16>().ok()).ok_or_else(|| bad("no status"))?;
    let chunked = head.lines().any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    let mut rest = &raw[split + 4..];
    let body = if chunked {
        let mut out = Vec::new();
        loop {
            let end = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("a chunk without its size"))?;
            let size = std::str::from_utf8(&rest[..end]).ok().map(|s| s.split(';').next().unwrap_or("").trim());
            let size = size.and_then(|s| usize::from_str_radix(s, 16).ok()).ok_or_else(|| bad("a bad chunk size"))?;
            rest = &rest[end + 2..];
            if size == 0 {
                break; // trailers, if any, follow: not needed
            }
            out.extend_from_slice(rest.get(..size).ok_or_else(|| bad("a short chunk"))?);
            rest = rest.get(size + 2..).ok_or_else(|| bad("a short chunk"))?;
        }
        out
    } else {
        rest.to_vec()
    };
    Ok((status, String::from_utf8(body).map_err(|_| bad("body not UTF-8"))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_and_answers_read_with_etcds_omissions() {
        let timeout = Duration::from_secs(1);
        assert!(Etcd::new(&["http://127.0.0.1:2379"], timeout).is_ok());
        for bad in ["127.0.0.1:2379", "ftp://x:1", "http://:2379", "http://x", "http://x:port", "http://x:99999"] {
            assert_eq!(Etcd::new(&[bad], timeout).unwrap_err(), EtcdError::BadEndpoint(bad.into()), "{bad}");
        }
        assert!(Etcd::new(&[], timeout).is_err());
        let kv = kv_of(&json!({"key": "YQ==", "value": "djE=", "create_revision": "2", "mod_revision": "7"})).unwrap();
        assert_eq!(
            (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease),
            (b"a".to_vec(), b"v1".to_vec(), 2, 7, 0)
        );
        assert!(kv_of(&json!({"key": "not base64!"})).is_err());
        assert!(number(&json!({"TTL": "x"}), "TTL").is_err());
        assert_eq!(number(&json!({}), "TTL").unwrap(), 0, "etcd leaves zeros out");
        assert_eq!(prefix_end(b"/lake/a/"), b"/lake/a0".to_vec());
        assert_eq!(prefix_end(&[1, 0xff]), vec![2]);
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }

    #[test]
    fn nothing_listening_is_unreachable_not_a_panic() {
        // A port nothing listens on: bind one, learn it, let it go.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let etcd = Etcd::new(&[&format!("http://127.0.0.1:{port}")], Duration::from_millis(500)).unwrap();
        assert!(matches!(etcd.grant(5), Err(EtcdError::Unreachable(_))));
        assert!(!etcd.healthy());
    }
}
