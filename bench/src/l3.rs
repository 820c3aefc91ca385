//! `lake-bench l3`: blocks into and out of an S3-compatible store through
//! Lake's L3 client (worker threads off the poll core, bounded queue,
//! every object read checked against its key and CRCs) against a raw loop
//! of the same S3 client library on as many threads (no queue, no check),
//! same server, same objects, same run. Starts its own `moto_server`
//! (`LAKE_MOTO_SERVER`, or `~/.cache/lake-moto/bin/moto_server` as
//! `.ci/run` installs it) unless given `--endpoint`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_dp::l3::s3::{S3Config, S3Store};
use lake_dp::l3::{L3Client, L3Completion, L3Config, L3Request, ObjectStore, object_name};
use lake_dp::{BlockKey, NamespaceId};

use crate::report::Report;

struct Moto(Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_moto() -> Result<(Moto, String), String> {
    let binary = std::env::var_os("LAKE_MOTO_SERVER").map(std::path::PathBuf::from).or_else(|| {
        let home = std::env::var_os("HOME")?;
        Some(std::path::PathBuf::from(home).join(".cache/lake-moto/bin/moto_server"))
    });
    let binary = binary.filter(|b| b.exists()).ok_or(
        "no moto_server: python3 -m venv ~/.cache/lake-moto && ~/.cache/lake-moto/bin/pip install 'moto[server]', \
         or give --endpoint",
    )?;
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let child = Command::new(&binary)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", binary.display()))?;
    let moto = Moto(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("moto_server did not listen on {port} within 30 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((moto, format!("http://127.0.0.1:{port}")))
}

/// Submits every request, polling completions whenever the queue is full;
/// all must succeed. Returns the seconds it took.
fn drive(client: &mut L3Client, requests: Vec<L3Request>) -> Result<f64, String> {
    let started = Instant::now();
    let total = requests.len();
    let mut done: Vec<L3Completion> = Vec::with_capacity(total);
    let mut pending = requests.into_iter().enumerate().peekable();
    while done.len() < total {
        while let Some(&(id, request)) = pending.peek() {
            // SAFETY: every request's memory is the caller's, kept until
            // this function has collected every completion.
            match unsafe { client.submit(id as u64, request) } {
                Ok(()) => {
                    pending.next();
                }
                Err(_) => break,
            }
        }
        if client.poll(&mut done, 256) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    if let Some(failed) = done.iter().find(|c| c.result.is_err()) {
        return Err(format!("an L3 request failed: {failed:?}"));
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The raw loop: `workers` threads, each with its own client, putting
/// (or getting) its share of the objects under `prefix`.
fn raw(config: &S3Config, workers: usize, objects: &[Vec<u8>], prefix: &str, get: bool) -> Result<f64, String> {
    let started = Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || -> Result<(), String> {
                    let mut store = S3Store::open(config).map_err(|e| e.to_string())?;
                    for (i, bytes) in objects.iter().enumerate().skip(w).step_by(workers) {
                        let name = format!("{prefix}/{i}");
                        if get {
                            let back = store.get(&name).map_err(|e| e.to_string())?;
                            if back.as_ref().map(Vec::len) != Some(bytes.len()) {
                                return Err(format!("raw get {name}: {:?} bytes", back.map(|b| b.len())));
                            }
                        } else {
                            store.put(&name, bytes).map_err(|e| e.to_string())?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().map_err(|_| "a raw worker panicked".to_owned())?)
    })?;
    Ok(started.elapsed().as_secs_f64())
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct L3Args {
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) block_bytes: usize,
    /// Blocks.
    #[arg(long, default_value_t = 2048)]
    pub(crate) blocks: usize,
    /// L3 worker threads (store calls in flight).
    #[arg(long, default_value_t = 8)]
    pub(crate) workers: usize,
    /// An S3-compatible endpoint (default: a moto_server of its own).
    #[arg(long)]
    pub(crate) endpoint: Option<String>,
}

pub(crate) fn run(args: &L3Args) -> Result<Report, String> {
    let block_bytes: usize = args.block_bytes;
    let blocks: usize = args.blocks;
    let workers: usize = args.workers;
    if block_bytes <= lake_dp::constants::STORED_HEADER_BYTES || blocks == 0 || !(1..=64).contains(&workers) {
        return Err("--block-bytes above the 4 KiB header, --blocks ≥ 1, --workers 1–64".into());
    }
    let blocks_u32 = u32::try_from(blocks).map_err(|_| "--blocks: at most 2^32")?;
    let endpoint: String = args.endpoint.clone().unwrap_or_default();
    let (_moto, endpoint) = if endpoint.is_empty() {
        let (moto, endpoint) = start_moto()?;
        (Some(moto), endpoint)
    } else {
        (None, endpoint)
    };
    let config = S3Config {
        endpoint: endpoint.clone(),
        region: "eu-west-1".into(),
        bucket: "lake-bench-l3".into(),
        access_key: "lake".into(),
        secret_key: "lake-secret".into(),
    };
    S3Store::create_bucket(&config).map_err(|e| format!("bucket: {e}"))?;
    // Stored objects of `block_bytes` (header and payload), key i.
    let objects: Vec<Vec<u8>> =
        (0..blocks_u32).map(|i| crate::tcp::object(block_bytes, i)).collect::<Result<_, _>>()?;
    let keys: Vec<BlockKey> = (0..blocks_u32)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..4].copy_from_slice(&i.to_le_bytes());
            BlockKey(key)
        })
        .collect();
    let namespace = NamespaceId(1);
    let bytes = objects.iter().map(Vec::len).sum::<usize>() as f64;

    let store_config = config.clone();
    let l3 = L3Config { workers, ..L3Config::default() };
    let mut client =
        L3Client::start(l3, "bench", move || Ok(Box::new(S3Store::open(&store_config)?) as Box<dyn ObjectStore>))
            .map_err(|e| e.to_string())?;
    let puts = keys
        .iter()
        .zip(&objects)
        .map(|(key, o)| L3Request::Put { key: *key, namespace, source: o.as_ptr(), len: o.len() as u64 })
        .collect();
    let put_s = drive(&mut client, puts)?;
    let mut back: Vec<Vec<u8>> = objects.iter().map(|o| vec![0u8; o.len()]).collect();
    let gets = keys
        .iter()
        .zip(back.iter_mut())
        .map(|(key, b)| L3Request::Get { key: *key, namespace, target: b.as_mut_ptr(), capacity: b.len() as u64 })
        .collect();
    let get_s = drive(&mut client, gets)?;
    if back != objects {
        return Err("an object read back through L3 differs".into());
    }
    drop(client);
    let raw_put_s = raw(&config, workers, &objects, "raw", false)?;
    let raw_get_s = raw(&config, workers, &objects, "raw", true)?;

    let gbps = |s: f64| bytes / s / 1e9;
    let mut report = Report::new("l3");
    report.text("endpoint", &endpoint);
    report.text("first_object", &object_name("bench", namespace, &keys[0]));
    report.int("block_bytes", block_bytes as u64);
    report.int("blocks", blocks as u64);
    report.int("workers", workers as u64);
    report.float("put_gbps", gbps(put_s));
    report.float("get_gbps", gbps(get_s));
    report.float("raw_put_gbps", gbps(raw_put_s));
    report.float("raw_get_gbps", gbps(raw_get_s));
    report.float("put_ratio", raw_put_s / put_s);
    report.float("get_ratio", raw_get_s / get_s);
    Ok(report)
}
