//! What an engine's agent and the data plane say to each other: the
//! requests and answers of a [`port`], and the ports in shared memory an
//! agent in another process uses ([`shm`]). The agent itself lives with
//! the engine surface; the data plane's side of the ports with the data
//! plane.

pub mod port;
pub mod shm;
