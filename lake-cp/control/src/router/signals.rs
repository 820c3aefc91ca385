//! Each node's load signals, read over HTTP by a thread per node: whether
//! its pool is ready (`lake serve`'s `/readyz`), what a block pulled there
//! costs as its pool measures it (its `/metrics`), and how long its
//! engine's queue is (vLLM's `/metrics`). What the router keeps of them is soft
//! state: the last reading, lost with the process and read again by the
//! next.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::NodeConfig;

/// What was last read of one node.
#[derive(Clone, Debug, Default)]
pub struct Signal {
    /// Why the node may not be routed to now; none: it may.
    pub down: Option<String>,
    /// Requests waiting in its engine's queue.
    pub waiting: u64,
    /// Its engine's mean prefill (ns; 0: not measured).
    pub prefill_ns: u64,
    /// What a block pulled into its pool costs, as the pool measured it
    /// (ns; 0: not measured).
    pub pull_ns: u64,
    /// When (none: not read yet).
    pub at: Option<Instant>,
}

impl Signal {
    /// The time before a new request's prefill would start there.
    pub fn queue_ns(&self) -> u64 {
        self.waiting.saturating_mul(self.prefill_ns)
    }
}

/// The readers' threads and what they last read, one slot per node in
/// the configuration's order.
#[derive(Debug)]
pub struct Signals {
    slots: Arc<Vec<Mutex<Signal>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    every: Duration,
}

impl Signals {
    /// Starts reading `nodes` every `every`.
    pub fn start(nodes: &[NodeConfig], every: Duration) -> Self {
        let slots: Arc<Vec<Mutex<Signal>>> = Arc::new(nodes.iter().map(|_| Mutex::default()).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let (node, slots, stop) = (node.clone(), Arc::clone(&slots), Arc::clone(&stop));
                std::thread::Builder::new()
                    .name(format!("route-signals-{}", node.id))
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let started = Instant::now();
                            let signal = read(&node, every);
                            *slots[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner) = signal;
                            let rest = every.saturating_sub(started.elapsed());
                            let wake = Instant::now() + rest;
                            while !stop.load(Ordering::Relaxed) && Instant::now() < wake {
                                std::thread::sleep(rest.min(Duration::from_millis(50)));
                            }
                        }
                    })
                    .expect("a thread for a node's signals")
            })
            .collect();
        Self { slots, stop, threads, every }
    }

    /// Node `i`'s last reading; a node not read within three rounds is
    /// down (its reader is stuck on it).
    pub fn get(&self, i: usize) -> Signal {
        let signal = self.slots[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        match signal.at {
            None => Signal { down: Some("not read yet".into()), ..signal },
            Some(at) if at.elapsed() > self.every * 3 + Duration::from_secs(1) => {
                Signal { down: Some(format!("last read {:?} ago", at.elapsed())), ..signal }
            }
            Some(_) => signal,
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One reading of `node`, each request given at most `every` (and a
/// second at least).
fn read(node: &NodeConfig, every: Duration) -> Signal {
    let timeout = every.max(Duration::from_secs(1));
    let mut signal = Signal::default();
    if let Some(address) = &node.lake_metrics {
        match get(address, "/readyz", timeout) {
            Ok((200, _)) => {}
            Ok((status, body)) => signal.down = Some(format!("pool at {address}: {status} {}", body.trim())),
            Err(why) => signal.down = Some(format!("pool at {address}: {why}")),
        }
        if signal.down.is_none()
            && let Ok((200, body)) = get(address, "/metrics", timeout)
        {
            signal.pull_ns = whole(sum(&body, "lake_cluster_pull_ns_per_block"));
        }
    }
    if let Some(address) = &node.engine_metrics
        && signal.down.is_none()
    {
        match get(address, "/metrics", timeout) {
            Ok((200, body)) => {
                signal.waiting = whole(sum(&body, "vllm:num_requests_waiting"));
                let (total, count) = (
                    sum(&body, "vllm:request_prefill_time_seconds_sum"),
                    sum(&body, "vllm:request_prefill_time_seconds_count"),
                );
                if count > 0.0 {
                    signal.prefill_ns = whole(total / count * 1e9);
                }
            }
            Ok((status, _)) => signal.down = Some(format!("engine at {address}: {status}")),
            Err(why) => signal.down = Some(format!("engine at {address}: {why}")),
        }
    }
    signal.at = Some(Instant::now());
    signal
}

/// A gauge's value as a count: negative (or not a number) is 0, past
/// `u64::MAX` is `u64::MAX` (the cast saturates).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn whole(value: f64) -> u64 {
    if value.is_nan() || value <= 0.0 { 0 } else { value as u64 }
}

fn get(address: &str, path: &str, timeout: Duration) -> Result<(u16, String), String> {
    let url = format!("http://{address}{path}");
    let response = attohttpc::get(&url)
        .timeout(timeout)
        .connect_timeout(timeout)
        .read_timeout(timeout)
        .send()
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    Ok((status, response.text().map_err(|e| e.to_string())?))
}

/// The sum of a metric's samples in a Prometheus exposition (every label
/// set); 0 where it is absent.
pub fn sum(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.chars().next()? {
                '{' => &rest[rest.find('}')? + 1..],
                ' ' => rest,
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .filter(|v| v.is_finite())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_summed_over_its_label_sets_and_others_are_not_taken_for_it() {
        let text = "# HELP vllm:num_requests_waiting x\n\
                    vllm:num_requests_waiting{model_name=\"a\",engine=\"0\"} 3.0\n\
                    vllm:num_requests_waiting{model_name=\"a\",engine=\"1\"} 2\n\
                    vllm:num_requests_waiting_by_reason{reason=\"x\"} 100\n\
                    vllm:request_prefill_time_seconds_sum 1.5\n\
                    vllm:request_prefill_time_seconds_count 3 1700000000\n\
                    other NaN\n";
        assert_eq!(sum(text, "vllm:num_requests_waiting"), 5.0);
        assert_eq!(sum(text, "vllm:request_prefill_time_seconds_sum"), 1.5);
        assert_eq!(sum(text, "vllm:request_prefill_time_seconds_count"), 3.0);
        assert_eq!(sum(text, "other"), 0.0);
        assert_eq!(sum(text, "absent"), 0.0);
    }
}
