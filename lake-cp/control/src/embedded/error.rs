//! Why a pool could not start or serve.

use std::path::PathBuf;

use lake_dp::runner::RunnerError;

/// Why a pool could not start or serve. `lake serve` exits 2 where
/// [`ServeError::is_settings`] (as for a bad command line: starting again
/// unchanged fails again), 1 otherwise.
#[derive(Debug)]
pub enum ServeError {
    /// Its settings cannot run here (the configuration's checks).
    Settings(String),
    /// Another pool serves its directory (`pid` as that pool's lock file
    /// names it).
    Taken {
        /// The directory.
        dir: PathBuf,
        /// The other pool's process, where its record says.
        pid: Option<u32>,
    },
    /// A file, socket, thread or other resource of the pool failed.
    Io {
        /// What was being done, and on what.
        what: String,
        /// The kernel's answer.
        error: std::io::Error,
    },
    /// Its mirror could not be made.
    Mirror(lake_dp::mirror::MirrorError),
    /// The cluster it was to join (etcd) could not be used.
    Cluster {
        /// What was being done.
        what: String,
        /// etcd's answer.
        error: crate::etcd::EtcdError,
    },
    /// The data plane refused to start, or stopped with an error.
    DataPlane(RunnerError),
    /// The control plane's thread stopped with an error.
    ControlPlane(std::io::Error),
    /// A plane's thread ended while the pool served, or never started.
    Stopped(Plane),
    /// A plane's thread panicked.
    Panicked(Plane),
    /// The control plane did not take or answer a request in time.
    NoAnswer,
    /// The control plane refused a request (a copy to another node).
    Refused(crate::node::NodeError),
}

/// One of a pool's two planes, each on its own thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plane {
    /// The control plane (`lake-cp`).
    Control,
    /// The data plane (`lake-dp`).
    Data,
}

impl ServeError {
    /// Whether starting again unchanged fails again: the pool's settings,
    /// or a data plane refusing them (a core or NUMA node this machine
    /// lacks).
    pub fn is_settings(&self) -> bool {
        matches!(self, Self::Settings(_) | Self::DataPlane(RunnerError::Config(_)))
    }

    pub(super) fn io(what: impl core::fmt::Display) -> impl FnOnce(std::io::Error) -> Self {
        move |error| Self::Io { what: what.to_string(), error }
    }
}

impl core::fmt::Display for Plane {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::Control => "the control plane",
            Self::Data => "the data plane",
        })
    }
}

impl core::fmt::Display for ServeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Settings(why) => f.write_str(why),
            Self::Taken { dir, pid } => {
                let pid = pid.map_or_else(|| "unknown".to_owned(), |p| p.to_string());
                write!(
                    f,
                    "{}: another pool serves this directory (pid {pid}); stop it or give another directory",
                    dir.display()
                )
            }
            Self::Io { what, error } => write!(f, "{what}: {error}"),
            Self::Mirror(error) => write!(f, "mirror: {error}"),
            Self::Cluster { what, error } => write!(f, "{what}: {error}"),
            Self::DataPlane(RunnerError::Config(why)) => f.write_str(why),
            Self::DataPlane(error) => write!(f, "the data plane: {error}"),
            Self::ControlPlane(error) => write!(f, "the control plane: {error}"),
            Self::Stopped(plane) => write!(f, "{plane} stopped"),
            Self::Panicked(plane) => write!(f, "{plane} panicked"),
            Self::NoAnswer => f.write_str("the control plane did not answer"),
            Self::Refused(error) => write!(f, "refused: {error}"),
        }
    }
}

impl std::error::Error for ServeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { error, .. } | Self::ControlPlane(error) => Some(error),
            Self::DataPlane(error) => Some(error),
            _ => None,
        }
    }
}

impl From<ServeError> for String {
    fn from(error: ServeError) -> Self {
        error.to_string()
    }
}
