//! An S3-compatible service as the object store (path-style requests, any
//! endpoint: AWS, MinIO, moto, s3rver). Blocking HTTP (`rust-s3`'s sync
//! client), so it runs on [`super::L3Client`]'s worker threads only.

use s3::error::S3Error;
use s3::{Bucket, BucketConfiguration, Region};

use super::{ObjectStore, StoreError};

/// Where the service is and who we are to it.
#[derive(Clone, Debug)]
pub struct S3Config {
    /// `http://host:port` or `https://host:port` (the server's certificate
    /// checked against the system's roots, or the CA file in
    /// `SSL_CERT_FILE`).
    pub endpoint: String,
    /// The region name the service expects (`us-east-1` for most).
    pub region: String,
    /// The bucket.
    pub bucket: String,
    /// Access key id.
    pub access_key: String,
    /// Secret key.
    pub secret_key: String,
}

/// One bucket of an S3-compatible service.
#[derive(Clone, Debug)]
pub struct S3Store {
    bucket: Box<Bucket>,
}

fn error(what: &str) -> impl Fn(S3Error) -> StoreError {
    let what = what.to_owned();
    move |e| match e {
        S3Error::HttpFailWithBody(code, body) if (400..500).contains(&code) && code != 408 && code != 429 => {
            StoreError::Permanent(format!("{what}: HTTP {code}: {}", body.chars().take(200).collect::<String>()))
        }
        // TLS refused (a certificate no trusted CA signed, for another
        // name, expired): the next try meets the same certificate.
        S3Error::Atto(e) if tls_refused(&e) => StoreError::Permanent(format!("{what}: TLS: {e}")),
        other => StoreError::Transient(format!("{what}: {other}")),
    }
}

/// Whether the HTTP client's error is TLS refusing the server (or TLS
/// missing from the build), not the network failing.
fn tls_refused(error: &attohttpc::Error) -> bool {
    match error.kind() {
        attohttpc::ErrorKind::Tls(_) | attohttpc::ErrorKind::InvalidDNSName(_) | attohttpc::ErrorKind::TlsDisabled => {
            true
        }
        // The handshake's own failures come through its stream as data
        // the TLS library refused.
        attohttpc::ErrorKind::Io(e) => e.kind() == std::io::ErrorKind::InvalidData,
        _ => false,
    }
}

impl S3Store {
    /// The bucket of `config` (not contacted yet).
    pub fn open(config: &S3Config) -> Result<Self, StoreError> {
        let region = Region::Custom { region: config.region.clone(), endpoint: config.endpoint.clone() };
        let credentials =
            s3::creds::Credentials::new(Some(&config.access_key), Some(&config.secret_key), None, None, None)
                .map_err(|e| StoreError::Permanent(format!("S3 credentials: {e}")))?;
        let bucket = Bucket::new(&config.bucket, region, credentials).map_err(error("opening the bucket"))?;
        Ok(Self { bucket: bucket.with_path_style() })
    }

    /// Creates the bucket of `config` (an error if the service refuses;
    /// one that exists already is fine). The region is sent as the
    /// location constraint, which S3 refuses for `us-east-1`: make a bucket
    /// there beforehand.
    pub fn create_bucket(config: &S3Config) -> Result<(), StoreError> {
        let region = Region::Custom { region: config.region.clone(), endpoint: config.endpoint.clone() };
        let credentials =
            s3::creds::Credentials::new(Some(&config.access_key), Some(&config.secret_key), None, None, None)
                .map_err(|e| StoreError::Permanent(format!("S3 credentials: {e}")))?;
        match Bucket::create_with_path_style(&config.bucket, region, credentials, BucketConfiguration::default()) {
            Ok(_) => Ok(()),
            Err(S3Error::HttpFailWithBody(409, _)) => Ok(()),
            Err(e) => Err(error("creating the bucket")(e)),
        }
    }
}

impl ObjectStore for S3Store {
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        self.bucket.put_object(name, bytes).map(|_| ()).map_err(error("put"))
    }

    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self.bucket.get_object(name) {
            Ok(response) => Ok(Some(response.to_vec())),
            Err(S3Error::HttpFailWithBody(404, _)) => Ok(None),
            Err(e) => Err(error("get")(e)),
        }
    }

    fn get_head(&mut self, name: &str, len: usize) -> Result<Option<Vec<u8>>, StoreError> {
        let last = (len as u64).saturating_sub(1);
        match self.bucket.get_object_range(name, 0, Some(last)) {
            Ok(response) => Ok(Some(response.to_vec())),
            Err(S3Error::HttpFailWithBody(404, _)) => Ok(None),
            Err(e) => Err(error("get (range)")(e)),
        }
    }

    fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        match self.bucket.delete_object(name) {
            Ok(_) | Err(S3Error::HttpFailWithBody(404, _)) => Ok(()),
            Err(e) => Err(error("delete")(e)),
        }
    }

    fn delete_many(&mut self, names: &[String]) -> Result<(), StoreError> {
        let objects: Vec<s3::serde_types::ObjectIdentifier> =
            names.iter().map(|n| s3::serde_types::ObjectIdentifier::new(n.as_str())).collect();
        let result = self.bucket.delete_objects(objects).map_err(error("delete (batch)"))?;
        // A key that is not there is not an error of S3's multi-delete.
        match result.errors.first() {
            None => Ok(()),
            Some(first) => Err(StoreError::Transient(format!(
                "delete (batch): {} of {} failed, the first {:?}: {:?}",
                result.errors.len(),
                names.len(),
                first.key,
                first.message
            ))),
        }
    }

    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let pages = self.bucket.list(prefix.to_owned(), None).map_err(error("list"))?;
        let mut names: Vec<String> = pages.into_iter().flat_map(|page| page.contents).map(|o| o.key).collect();
        names.sort_unstable();
        Ok(names)
    }
}
