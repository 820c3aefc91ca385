//! A candidate's own health checks and metrics (`lake cp` and `lake
//! summary` with `--metrics`), answered on a thread of their own: a slow
//! or hostile client delays no campaign and no leader's loop. One
//! request per connection, as the pool's metrics port takes them.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the thread answers: `/metrics`' body, and `/readyz` (why not
/// ready, if not). `/healthz` is ok while the process lives.
pub(super) struct Answers {
    pub(super) metrics: String,
    pub(super) ready: Result<(), String>,
}

pub(super) struct HealthServer {
    answers: Arc<Mutex<Answers>>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<TcpListener>,
}

impl HealthServer {
    /// How long a client may take to send a piece of its request, or to
    /// take the answer.
    const CLIENT_WAIT: Duration = Duration::from_millis(200);
    /// How long a client may take over its whole request: one that
    /// trickles it holds the thread no longer.
    const CLIENT_TOTAL: Duration = Duration::from_secs(1);

    /// Answers `answers` on `listener` until stopped.
    pub(super) fn start(listener: TcpListener, answers: Answers) -> Result<Self, String> {
        listener.set_nonblocking(true).map_err(|e| format!("metrics: {e}"))?;
        let answers = Arc::new(Mutex::new(answers));
        let stop = Arc::new(AtomicBool::new(false));
        let (read, stopped) = (Arc::clone(&answers), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("lake-health".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((stream, _)) => Self::answer(stream, &read),
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
                listener
            })
            .map_err(|e| format!("metrics thread: {e}"))?;
        Ok(Self { answers, stop, thread })
    }

    /// Answers from now on.
    pub(super) fn set(&self, answers: Answers) {
        *self.answers.lock().unwrap_or_else(PoisonError::into_inner) = answers;
    }

    fn answer(mut stream: TcpStream, answers: &Mutex<Answers>) {
        use std::io::{Read, Write};
        let began = Instant::now();
        let waits = stream.set_nonblocking(false).and_then(|()| {
            stream.set_read_timeout(Some(Self::CLIENT_WAIT))?;
            stream.set_write_timeout(Some(Self::CLIENT_WAIT))
        });
        if waits.is_err() {
            return;
        }
        let mut request = Vec::new();
        let mut buffer = [0u8; 1024];
        while request.len() < lake_cp::metrics::REQUEST_BYTES_MAX && began.elapsed() < Self::CLIENT_TOTAL {
            match stream.read(&mut buffer) {
                Ok(n) if n > 0 => request.extend_from_slice(&buffer[..n]),
                _ => return,
            }
            let response = {
                let answers = answers.lock().unwrap_or_else(PoisonError::into_inner);
                lake_cp::metrics::respond(&request, || answers.metrics.clone(), || answers.ready.clone())
            };
            if let Some(response) = response {
                let _ = stream.write_all(&response);
                return;
            }
        }
    }

    /// Stops answering; the listener, for a server of the leader's.
    pub(super) fn stop(self) -> Result<TcpListener, String> {
        self.stop.store(true, Ordering::Release);
        self.thread.join().map_err(|_| "the metrics thread panicked".to_owned())
    }
}
