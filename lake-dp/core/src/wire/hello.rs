//! The hello exchange: each side sends a [`Hello`] with the range of wire
//! versions it speaks; the side that accepts answers with a [`HelloAck`]
//! naming the highest version in both ranges and the smaller frame limit.
//! Hello and HelloAck are always encoded as version 1 and never change shape,
//! so two builds of any age can tell each other what they lack.

use super::message::{Hello, HelloAck, Role, text_field};
use super::{Limits, WIRE_VERSION_MAX, WIRE_VERSION_MIN, WireError};
use crate::constants::WIRE_FRAME_BYTES_MAX;

/// [`WIRE_FRAME_BYTES_MAX`] as the hello's 32-bit field.
#[allow(clippy::cast_possible_truncation)] // checked by the assertion beside it
const FRAME_BYTES_MAX: u32 = WIRE_FRAME_BYTES_MAX as u32;
const _: () = assert!(WIRE_FRAME_BYTES_MAX <= u32::MAX as usize);

/// The version hello frames are encoded with, forever.
pub const HELLO_WIRE_VERSION: u16 = 1;

/// What a process says about itself when it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity<'a> {
    /// Which process.
    pub role: Role,
    /// Node.
    pub node: u32,
    /// Process id.
    pub pid: u32,
    /// Region epoch (`lake-dp`), else 0.
    pub region_epoch: u64,
    /// Feature bits offered.
    pub features: u64,
    /// A human name, at most 32 bytes.
    pub name: &'a str,
}

/// Builds this build's hello.
pub fn hello(identity: &Identity<'_>) -> Result<Hello, WireError> {
    Ok(Hello {
        role: identity.role as u8,
        reserved_a: [0; 3],
        version_min: WIRE_VERSION_MIN,
        version_max: WIRE_VERSION_MAX,
        node: identity.node,
        pid: identity.pid,
        region_epoch: identity.region_epoch,
        features: identity.features,
        frame_bytes_max: FRAME_BYTES_MAX,
        reserved_b: 0,
        name: text_field("hello.name", identity.name)?,
    })
}

/// Answers a peer's hello: picks the highest common version, the smaller
/// frame limit and the common features.
pub fn accept(local: &Hello, remote: &Hello, leader_term_seen: u64) -> Result<HelloAck, WireError> {
    let low = local.version_min.max(remote.version_min);
    let high = local.version_max.min(remote.version_max);
    if low > high {
        return Err(WireError::VersionMismatch {
            local: (local.version_min, local.version_max),
            remote: (remote.version_min, remote.version_max),
        });
    }
    Ok(HelloAck {
        version: high,
        role: local.role,
        reserved_a: 0,
        node: local.node,
        region_epoch: local.region_epoch,
        features: local.features & remote.features,
        leader_term_seen,
        frame_bytes_max: local.frame_bytes_max.min(remote.frame_bytes_max),
        reserved_b: 0,
    })
}

/// The decoder limits a connection uses once `ack` was exchanged. Refuses
/// an ack naming a version outside our own range (a peer that ignored ours).
pub fn limits_after(ack: &HelloAck) -> Result<Limits, WireError> {
    if !(WIRE_VERSION_MIN..=WIRE_VERSION_MAX).contains(&ack.version) {
        return Err(WireError::UnsupportedVersion(ack.version));
    }
    Ok(Limits {
        version_min: ack.version,
        version_max: ack.version,
        frame_bytes_max: (ack.frame_bytes_max as usize).min(WIRE_FRAME_BYTES_MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(role: Role) -> Identity<'static> {
        Identity { role, node: 1, pid: 42, region_epoch: 0, features: 0b1011, name: "test" }
    }

    #[test]
    fn same_build_agrees_on_its_newest_version() {
        let a = hello(&identity(Role::Agent)).unwrap();
        let b = hello(&identity(Role::DataPlane)).unwrap();
        let ack = accept(&b, &a, 7).unwrap();
        assert_eq!(ack.version, WIRE_VERSION_MAX);
        assert_eq!(ack.role, Role::DataPlane as u8);
        assert_eq!(ack.leader_term_seen, 7);
        let limits = limits_after(&ack).unwrap();
        assert_eq!(limits.version_min, WIRE_VERSION_MAX);
        assert_eq!(limits.frame_bytes_max, WIRE_FRAME_BYTES_MAX);
    }

    #[test]
    fn disjoint_ranges_fail_with_both_ranges() {
        let local = hello(&identity(Role::DataPlane)).unwrap();
        let mut future = hello(&identity(Role::Agent)).unwrap();
        future.version_min = WIRE_VERSION_MAX + 1;
        future.version_max = WIRE_VERSION_MAX + 3;
        assert_eq!(
            accept(&local, &future, 0),
            Err(WireError::VersionMismatch {
                local: (WIRE_VERSION_MIN, WIRE_VERSION_MAX),
                remote: (WIRE_VERSION_MAX + 1, WIRE_VERSION_MAX + 3),
            })
        );
    }

    #[test]
    fn overlap_picks_the_highest_common_version_and_smaller_frame() {
        let mut local = hello(&identity(Role::DataPlane)).unwrap();
        local.version_max = 5;
        local.features = 0b110;
        let mut remote = hello(&identity(Role::Agent)).unwrap();
        remote.version_min = 1;
        remote.version_max = 3;
        remote.frame_bytes_max = 65_536;
        remote.features = 0b011;
        let ack = accept(&local, &remote, 0).unwrap();
        assert_eq!(ack.version, 3);
        assert_eq!(ack.frame_bytes_max, 65_536);
        assert_eq!(ack.features, 0b010);
        assert_eq!(limits_after(&ack), Err(WireError::UnsupportedVersion(3)));
    }

    #[test]
    fn long_names_are_refused() {
        let mut id = identity(Role::Agent);
        id.name = "a name much longer than thirty-two bytes";
        assert!(matches!(hello(&id), Err(WireError::Field { field: "hello.name", .. })));
    }
}
