//! `[[partitions]]`: tenants whose L1 blocks lie in partitions of the
//! arena of their own.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, RunnerConfig, hex_namespaces};
use crate::arena::{ArenaBacking, ArenaPartition};

/// One `[[partitions]]` entry: a tenant's own part of the L1 arena, in
/// memory of its own (a memfd at no path, named as `<l1.path>.<name>`,
/// sealed at its size) that the data plane passes only to the engines of
/// its users and groups. Its namespaces'
/// blocks lie there alone: saved, loaded, copied in, all checked to be
/// its own before they are published. An engine of any other user maps
/// partition 0, the rest of the arena, where the blocks of namespaces no
/// partition names lie.
///
/// ```toml
/// [[partitions]]
/// name = "acme"
/// namespaces = ["e6c40168c202f6d1"]
/// uids = [1001]
/// slots = 512
/// mirror = "/dev/shm/lake-mirror-acme"
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PartitionSection {
    /// Its name: letters, digits, `-` and `_`, at most 32 (it names the
    /// file).
    pub name: String,
    /// Its namespace ids, in hex.
    pub namespaces: Vec<String>,
    /// Users whose engines map it.
    #[serde(default)]
    pub uids: Vec<u32>,
    /// Groups whose engines map it (an engine's effective group).
    #[serde(default)]
    pub gids: Vec<u32>,
    /// Its slots in each size class.
    pub slots: u32,
    /// The mirror its engines are given in place of `[agents] mirror`: the
    /// one its control plane publishes its blocks in, alone (`lake cp
    /// --config` makes it, `<mirror>.<name>`). Needed: without it they
    /// would read the pool's, every other tenant's keys.
    pub mirror: Option<PathBuf>,
}

/// The partitions of a checked config as the data plane keeps them: for
/// each (from 1), its namespaces, users and groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Partitions {
    /// Per partition past 0: namespaces, uids, gids.
    pub each: Vec<(Vec<u64>, Vec<u32>, Vec<u32>)>,
    /// Per partition past 0: the mirror its engines are given.
    pub mirrors: Vec<PathBuf>,
}

impl Partitions {
    /// The partition of namespace `namespace`'s blocks.
    pub fn of_namespace(&self, namespace: u64) -> usize {
        self.each.iter().position(|(namespaces, _, _)| namespaces.contains(&namespace)).map_or(0, |i| i + 1)
    }

    /// The partition an engine of `uid` and `gid` maps (its user first).
    pub fn of_peer(&self, uid: u32, gid: u32) -> usize {
        let by_uid = self.each.iter().position(|(_, uids, _)| uids.contains(&uid));
        by_uid.or_else(|| self.each.iter().position(|(_, _, gids)| gids.contains(&gid))).map_or(0, |i| i + 1)
    }
}

impl RunnerConfig {
    /// The partitions, checked: names, namespaces and users each in one
    /// partition at most, and room for their size classes.
    pub fn partitions(&self) -> Result<Partitions, ConfigError> {
        let mut out = Partitions::default();
        if self.partitions.is_empty() {
            return Ok(out);
        }
        let bad = |index: usize, what: &str, why: String| ConfigError(format!("partitions[{index}].{what}: {why}"));
        if self.l1.chunk_bytes != 0 {
            return Err(ConfigError("partitions: not with l1.chunk_bytes (classes sharing chunks)".into()));
        }
        let classes = self.l1.classes.len() * (self.partitions.len() + 1);
        if classes > crate::constants::SLOT_CLASSES_MAX {
            return Err(ConfigError(format!(
                "partitions: {} partitions of {} size classes each, past the arena's {} classes",
                self.partitions.len() + 1,
                self.l1.classes.len(),
                crate::constants::SLOT_CLASSES_MAX
            )));
        }
        let mut names = std::collections::HashSet::new();
        for (index, partition) in self.partitions.iter().enumerate() {
            let name = &partition.name;
            let good_name = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if name.is_empty() || name.len() > 32 || !good_name {
                return Err(bad(index, "name", "1 to 32 letters, digits, '-' or '_'".into()));
            }
            if name == "shared" {
                return Err(bad(index, "name", "\"shared\" names the arena's own partition 0".into()));
            }
            if !names.insert(name) {
                return Err(bad(index, "name", format!("{name:?} names another partition already")));
            }
            if partition.namespaces.is_empty() {
                return Err(bad(index, "namespaces", "at least one".into()));
            }
            if partition.slots == 0 {
                return Err(bad(index, "slots", "at least 1".into()));
            }
            let Some(mirror) = &partition.mirror else {
                let why = "needed: its engines read a mirror of its own, or they would read every tenant's keys";
                return Err(bad(index, "mirror", why.into()));
            };
            let namespaces = hex_namespaces(&partition.namespaces, &format!("partitions[{index}].namespaces"))?;
            for &namespace in &namespaces {
                if out.of_namespace(namespace) != 0 {
                    return Err(bad(index, "namespaces", format!("{namespace:016x} is another partition's already")));
                }
            }
            for &uid in &partition.uids {
                if out.each.iter().any(|(_, uids, _)| uids.contains(&uid)) {
                    return Err(bad(index, "uids", format!("{uid} is another partition's already")));
                }
            }
            if out.mirrors.contains(mirror) || self.agents.mirror.as_ref() == Some(mirror) {
                let why =
                    format!("{} is another's already: each tenant's keys in a mirror of its own", mirror.display());
                return Err(bad(index, "mirror", why));
            }
            out.each.push((namespaces, partition.uids.clone(), partition.gids.clone()));
            out.mirrors.push(mirror.clone());
        }
        Ok(out)
    }

    /// The partitions past 0 of an arena of `classes` size classes, each
    /// in a file next to the arena's (`<l1.path>.<name>`).
    pub(super) fn arena_partitions(&self, classes: usize) -> Vec<ArenaPartition> {
        let at = |name: &str| {
            let mut path = self.l1.path.clone().into_os_string();
            path.push(format!(".{name}"));
            PathBuf::from(path)
        };
        let slots = |p: &PartitionSection| vec![p.slots; classes];
        self.partitions
            .iter()
            .map(|p| ArenaPartition { backing: self.l1_backing(at(&p.name)), slots: slots(p) })
            .collect()
    }

    /// The arena's memory, at `path` for the backings that have one.
    pub(super) fn l1_backing(&self, path: PathBuf) -> ArenaBacking {
        match self.l1.backing.as_str() {
            "hugetlbfs" => ArenaBacking::HugetlbFs(path),
            "hugetlb-memfd" => ArenaBacking::HugetlbMemfd,
            _ => ArenaBacking::Shm(path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::config::tests::GOOD;

    #[test]
    fn partitions_parse_and_bad_ones_are_named() {
        let with = |body: &str| format!("{GOOD}\n{body}\n");
        let two = "[[partitions]]\nname = \"acme\"\nnamespaces = [\"a1\"]\nuids = [1001]\nslots = 4\n\
                   mirror = \"/dev/shm/m.acme\"\n\
                   [[partitions]]\nname = \"bolt\"\nnamespaces = [\"b1\", \"b2\"]\ngids = [7]\nslots = 2\n\
                   mirror = \"/dev/shm/m.bolt\"";
        let config = RunnerConfig::parse(&with(two)).unwrap();
        let partitions = config.partitions().unwrap();
        assert_eq!(
            (partitions.of_namespace(0xa1), partitions.of_namespace(0xb2), partitions.of_namespace(9)),
            (1, 2, 0)
        );
        assert_eq!((partitions.of_peer(1001, 7), partitions.of_peer(5, 7), partitions.of_peer(5, 5)), (1, 2, 0));
        let arena = config.arena(1);
        assert_eq!(arena.partitions.len(), 2);
        assert_eq!(arena.partitions[0].backing, ArenaBacking::Shm("/dev/shm/x.acme".into()));
        assert_eq!(arena.partitions[1].slots, vec![2]);
        assert_eq!(partitions.mirrors[1], PathBuf::from("/dev/shm/m.bolt"));
        let check = |text: &str, expect: &str| {
            let err = RunnerConfig::parse(&with(text)).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: got {err}");
        };
        let one = |body: &str| format!("[[partitions]]\n{body}\nmirror = \"/dev/shm/m\"");
        check("[[partitions]]\nname = \"a\"\nnamespaces = [\"a1\"]\nslots = 1", "partitions[0].mirror: needed");
        check(&one("name = \"a/b\"\nnamespaces = [\"a1\"]\nslots = 1"), "partitions[0].name: 1 to 32");
        check(&one("name = \"a\"\nnamespaces = []\nslots = 1"), "partitions[0].namespaces: at least one");
        check(&one("name = \"a\"\nnamespaces = [\"a1\"]\nslots = 0"), "partitions[0].slots: at least 1");
        check(
            &format!(
                "{}\n{}",
                one("name = \"a\"\nnamespaces = [\"a1\"]\nslots = 1"),
                one("name = \"b\"\nnamespaces = [\"a1\"]\nslots = 1")
            ),
            "a1 is another partition's",
        );
        check(
            &format!(
                "{}\n{}",
                one("name = \"a\"\nnamespaces = [\"a1\"]\nuids = [5]\nslots = 1"),
                one("name = \"b\"\nnamespaces = [\"b1\"]\nuids = [5]\nslots = 1")
            ),
            "partitions[1].uids: 5",
        );
        let twice = "[[partitions]]\nname = \"a\"\nnamespaces = [\"a1\"]\nslots = 1\nmirror = \"/dev/shm/m\"\n\
                     [[partitions]]\nname = \"b\"\nnamespaces = [\"b1\"]\nslots = 1\nmirror = \"/dev/shm/m\"";
        check(twice, "partitions[1].mirror: /dev/shm/m is another's");
        let shared = GOOD.replace("[l1]\n", "[l1]\nchunk_bytes = 69632\n");
        let err = RunnerConfig::parse(&format!("{shared}\n{}", one("name = \"a\"\nnamespaces = [\"a1\"]\nslots = 1")));
        assert!(err.unwrap_err().to_string().contains("not with l1.chunk_bytes"));
    }
}
