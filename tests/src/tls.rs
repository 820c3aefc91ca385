//! Certificates for tests that speak TLS to real servers (etcd, moto's S3):
//! a CA of the test's own, a server certificate for 127.0.0.1 signed by it,
//! and a client certificate, made with the `openssl` command line tool.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The files one [`make`] wrote.
#[derive(Clone, Debug)]
pub struct Certs {
    /// The CA's certificate (PEM): what a client trusts.
    pub ca: PathBuf,
    /// The server's certificate (PEM), for `127.0.0.1` and `localhost`.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate (PEM), signed by the same CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A CA of its own that signed none of these: trusting it is trusting
    /// the wrong one.
    pub other_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("openssl").args(args).current_dir(dir).output().map_err(|e| format!("openssl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)))
    }
}

/// A self-signed CA named `name` in `dir`: `name.pem`, `name.key`.
fn ca(dir: &Path, name: &str) -> Result<(), String> {
    let (cert, key, subject) = (format!("{name}.pem"), format!("{name}.key"), format!("/CN={name}"));
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", &subject, "-keyout", &key, "-out",
            &cert,
        ],
    )
}

/// A certificate `name` signed by `ca`, for `extensions` (an OpenSSL
/// extensions section's lines).
fn signed(dir: &Path, name: &str, ca: &str, extensions: &str) -> Result<(), String> {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), extensions).map_err(|e| e.to_string())?;
    let (key, csr, cert) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
    openssl(
        dir,
        &["req", "-newkey", "rsa:2048", "-nodes", "-subj", &format!("/CN={name}"), "-keyout", &key, "-out", &csr],
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &cert,
        ],
    )
}

/// Makes a CA, a server certificate and a client certificate in `dir`
/// (created); an error where `openssl` is missing or fails.
pub fn make(dir: &Path) -> Result<Certs, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    ca(dir, "ca")?;
    ca(dir, "other-ca")?;
    signed(
        dir,
        "server",
        "ca",
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n\
         subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )?;
    signed(
        dir,
        "client",
        "ca",
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
    )?;
    Ok(Certs {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
        other_ca: dir.join("other-ca.pem"),
    })
}
