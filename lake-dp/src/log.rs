//! Logging: events go through `tracing` and are written as one JSON object
//! a line (`{"timestamp":…,"level":"WARN","event":"attach_refused",…}`),
//! or as text for a terminal. A process sets its global subscriber
//! ([`init_global`]); an embedded pool's data plane thread sets one of its
//! own ([`subscriber`], through `tracing::subscriber::with_default`), so
//! each pool's events reach that pool's log.
//!
//! Every event names what happened in an `event` field; the other fields
//! are its facts. The lines a supervisor reads on stdout (`serving`,
//! `stopped`) are not events: they are written whole by their owners.

use std::io::Write;
use std::sync::{Arc, Mutex};

pub use tracing::level_filters::LevelFilter;

/// How lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object a line.
    #[default]
    Json,
    /// Text, for a person at a terminal.
    Text,
}

/// Which events are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Level {
    /// Failures only.
    Error,
    /// And what is refused or degraded.
    Warn,
    /// And what the pool does.
    #[default]
    Info,
    /// And detail for debugging.
    Debug,
}

impl Level {
    /// As the subscriber takes it.
    pub fn filter(self) -> LevelFilter {
        match self {
            Self::Error => LevelFilter::ERROR,
            Self::Warn => LevelFilter::WARN,
            Self::Info => LevelFilter::INFO,
            Self::Debug => LevelFilter::DEBUG,
        }
    }
}

/// A writer several threads share, a whole line at a time: the formatter
/// hands each event over in one `write`, under the lock.
#[derive(Clone)]
pub struct Sink(Arc<Mutex<Box<dyn Write + Send>>>);

impl core::fmt::Debug for Sink {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Sink")
    }
}

impl Sink {
    /// Lines to `writer`.
    pub fn new(writer: Box<dyn Write + Send>) -> Self {
        Self(Arc::new(Mutex::new(writer)))
    }
}

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let mut writer = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        writer.write_all(bytes)?;
        writer.flush()?;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).flush()
    }
}

/// A subscriber writing events at `level` or above to `sink`.
pub fn subscriber(sink: Sink, level: LevelFilter, format: Format) -> Box<dyn tracing::Subscriber + Send + Sync> {
    let writer = move || sink.clone();
    let builder = tracing_subscriber::fmt().with_writer(writer).with_max_level(level).with_ansi(false);
    match format {
        Format::Json => {
            Box::new(builder.json().flatten_event(true).with_current_span(false).with_span_list(false).finish())
        }
        Format::Text => Box::new(builder.finish()),
    }
}

/// This process's subscriber, for events of threads without one of their
/// own: to `sink`. Set once; a second call changes nothing.
pub fn init_global(sink: Sink, level: LevelFilter, format: Format) {
    let _ = tracing::subscriber::set_global_default(subscriber(sink, level, format));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a sink wrote, for a test to read.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn events_are_json_lines_with_a_level_whatever_their_text_holds() {
        let captured = Captured::default();
        let sink = Sink::new(Box::new(captured.clone()));
        let hostile = "a\u{1b}[31m \"quoted\" \\ path\n";
        tracing::subscriber::with_default(subscriber(sink, LevelFilter::INFO, Format::Json), || {
            tracing::warn!(event = "attach_refused", why = hostile, slots = 3u64);
            tracing::debug!(event = "not_shown");
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["event"], "attach_refused");
        assert_eq!(line["why"], hostile);
        assert_eq!(line["slots"], 3);
    }
}
