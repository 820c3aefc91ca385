//! Network namespaces for multi-host tests on one machine: two namespaces
//! joined by veth pairs (one per rail), a hub and several leaves (three
//! or more nodes), or several hosts on one switch (every one reaching
//! every other); rate limits (`tbf`), cuts (`ip link set … down`), the
//! test binary run again inside a namespace as a child playing a role,
//! and a thread of this process entered into one. Needs root; a test that
//! cannot make them says so and skips.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Two namespaces and veth pairs between them (one per rail), removed
/// when dropped.
#[derive(Debug)]
pub struct Link {
    /// The A namespace (senders).
    pub a: String,
    /// The B namespace (receivers).
    pub b: String,
    /// The A side's end of each pair, and each pair's /24.
    veths: Vec<String>,
    /// Each pair's /24 (A end `.1`, B end `.2`).
    pub subnets: Vec<String>,
    /// The test the children run (this binary, again).
    test: &'static str,
}

impl Link {
    /// Namespaces A and B and `rails` veth pairs; `tag` keeps tests of one
    /// process apart; the children run `test` of this binary.
    pub fn new(rails: usize, tag: u32, test: &'static str) -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let mut link = Self {
            a: format!("lake-a{tag}-{id}"),
            b: format!("lake-b{tag}-{id}"),
            veths: Vec::new(),
            subnets: Vec::new(),
            test,
        };
        ip(&["netns", "add", &link.a])?;
        ip(&["netns", "add", &link.b])?;
        for ns in [&link.a, &link.b] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        for rail in 0..rails {
            let (veth_a, veth_b) = (format!("lk{tag}{rail}a{id}"), format!("lk{tag}{rail}b{id}"));
            let subnet = format!("10.{}.{}", 90 + tag as usize * 4 + rail, id % 250);
            ip(&["link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b])?;
            ip(&["link", "set", &veth_a, "netns", &link.a])?;
            ip(&["link", "set", &veth_b, "netns", &link.b])?;
            ip(&["-n", &link.a, "addr", "add", &format!("{subnet}.1/24"), "dev", &veth_a])?;
            ip(&["-n", &link.b, "addr", "add", &format!("{subnet}.2/24"), "dev", &veth_b])?;
            ip(&["-n", &link.a, "link", "set", &veth_a, "up"])?;
            ip(&["-n", &link.b, "link", "set", &veth_b, "up"])?;
            link.veths.push(veth_a);
            link.subnets.push(subnet);
        }
        Ok(link)
    }

    /// Rail `rail`'s link up or down (its A end).
    pub fn up(&self, rail: usize, up: bool) -> Result<(), String> {
        ip(&["-n", &self.a, "link", "set", &self.veths[rail], if up { "up" } else { "down" }])
    }

    /// Rail `rail` limited to `rate` (`tbf` on its A end).
    pub fn rate(&self, rail: usize, rate: &str) -> Result<(), String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.a, "tc", "qdisc", "replace", "dev", &self.veths[rail], "root", "tbf"])
            .args(["rate", rate, "burst", "256kb", "latency", "100ms"])
            .output()
            .map_err(|e| format!("tc: {e}"))?;
        if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).into_owned()) }
    }

    /// Rails from A to the receiver's `port` in B: each pair's addresses.
    pub fn rails(&self, port: u16) -> String {
        self.subnets.iter().map(|s| format!("{s}.1>{s}.2:{port}")).collect::<Vec<_>>().join(",")
    }

    /// This test binary as `role` inside namespace `ns`, given `rails`.
    pub fn spawn(&self, ns: &str, role: &str, rails: &str) -> Child {
        spawn_in(self.test, ns, role, rails)
    }
}

/// A hub namespace joined to each of several leaf namespaces by a veth
/// pair of its own (three or more nodes: the hub's node reaches each leaf
/// over its own link, cut or limited apart), removed when dropped.
#[derive(Debug)]
pub struct Star {
    /// The hub namespace.
    pub hub: String,
    /// The leaf namespaces.
    pub leaves: Vec<String>,
    veths: Vec<String>,
    subnets: Vec<String>,
    test: &'static str,
}

impl Star {
    /// A hub and `leaves` leaves; `tag` keeps tests of one process apart.
    pub fn new(leaves: usize, tag: u32, test: &'static str) -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let mut star =
            Self { hub: format!("lake-h{tag}-{id}"), leaves: Vec::new(), veths: Vec::new(), subnets: Vec::new(), test };
        ip(&["netns", "add", &star.hub])?;
        ip(&["-n", &star.hub, "link", "set", "lo", "up"])?;
        for leaf in 0..leaves {
            let ns = format!("lake-l{tag}{leaf}-{id}");
            ip(&["netns", "add", &ns])?;
            star.leaves.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let (hub_end, leaf_end) = (format!("ls{tag}{leaf}h{id}"), format!("ls{tag}{leaf}l{id}"));
            let subnet = format!("10.{}.{}", 200 + tag as usize * 4 + leaf, id % 250);
            ip(&["link", "add", &hub_end, "type", "veth", "peer", "name", &leaf_end])?;
            ip(&["link", "set", &hub_end, "netns", &star.hub])?;
            ip(&["link", "set", &leaf_end, "netns", &ns])?;
            ip(&["-n", &star.hub, "addr", "add", &format!("{subnet}.1/24"), "dev", &hub_end])?;
            ip(&["-n", &ns, "addr", "add", &format!("{subnet}.2/24"), "dev", &leaf_end])?;
            ip(&["-n", &star.hub, "link", "set", &hub_end, "up"])?;
            ip(&["-n", &ns, "link", "set", &leaf_end, "up"])?;
            star.veths.push(hub_end);
            star.subnets.push(subnet);
        }
        Ok(star)
    }

    /// The link to leaf `leaf` up or down (its hub end).
    pub fn up(&self, leaf: usize, up: bool) -> Result<(), String> {
        ip(&["-n", &self.hub, "link", "set", &self.veths[leaf], if up { "up" } else { "down" }])
    }

    /// The rail from the hub to leaf `leaf`'s `port`: `hub>leaf:port`.
    pub fn rail(&self, leaf: usize, port: u16) -> String {
        let s = &self.subnets[leaf];
        format!("{s}.1>{s}.2:{port}")
    }

    /// This test binary as `role` inside namespace `ns`, given `rails`.
    pub fn spawn(&self, ns: &str, role: &str, rails: &str) -> Child {
        spawn_in(self.test, ns, role, rails)
    }
}

impl Drop for Star {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.hub]);
        for leaf in &self.leaves {
            let _ = ip(&["netns", "del", leaf]);
        }
    }
}

/// Hosts on one switch: a namespace holding a bridge, and one namespace a
/// host joined to it by a veth pair, each host at `address(i)` on one
/// /24 — every host reaches every other. Removed when dropped.
#[derive(Debug)]
pub struct Switch {
    /// The switch's namespace (the bridge).
    pub switch: String,
    /// The hosts' namespaces.
    pub hosts: Vec<String>,
    subnet: String,
}

impl Switch {
    /// A switch and `hosts` hosts on it; `tag` keeps users of one process
    /// apart.
    pub fn new(hosts: usize, tag: u32) -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let subnet = format!("10.{}.{}", 240 + tag % 16, id % 250);
        let mut switch = Self { switch: format!("lake-sw{tag}-{id}"), hosts: Vec::new(), subnet };
        ip(&["netns", "add", &switch.switch])?;
        ip(&["-n", &switch.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch.switch, "link", "set", "br0", "up"])?;
        for host in 0..hosts {
            let ns = format!("lake-sh{tag}{host}-{id}");
            ip(&["netns", "add", &ns])?;
            switch.hosts.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let (port, end) = (format!("sp{tag}{host}s{id}"), format!("sp{tag}{host}h{id}"));
            ip(&["link", "add", &port, "type", "veth", "peer", "name", &end])?;
            ip(&["link", "set", &port, "netns", &switch.switch])?;
            ip(&["link", "set", &end, "netns", &ns])?;
            ip(&["-n", &switch.switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch.switch, "link", "set", &port, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", switch.address(host)), "dev", &end])?;
            ip(&["-n", &ns, "link", "set", &end, "up"])?;
        }
        Ok(switch)
    }

    /// Host `host`'s address.
    pub fn address(&self, host: usize) -> String {
        format!("{}.{}", self.subnet, host + 1)
    }

    /// `program` with `args`, to run in host `host`'s namespace.
    pub fn command(&self, host: usize, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.hosts[host]]).arg(program);
        command
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(std::iter::once(&self.switch)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Moves the calling thread into the network namespace `ns`: the sockets
/// it makes from then on are that namespace's (the rest of the process
/// stays where it was).
pub fn enter(ns: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(format!("/var/run/netns/{ns}")).map_err(|e| format!("{ns}: {e}"))?;
    // SAFETY: a descriptor of a network namespace, open for this call;
    // setns changes only the calling thread's namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 { Ok(()) } else { Err(format!("setns {ns}: {}", std::io::Error::last_os_error())) }
}

fn spawn_in(test: &str, ns: &str, role: &str, rails: &str) -> Child {
    let exe = std::env::current_exe().unwrap();
    Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(exe)
        .args(["--exact", test, "--nocapture"])
        .env("LAKE_NETNS_ROLE", role)
        .env("LAKE_NETNS_RAILS", rails)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// A child process killed when dropped (a failed assertion must not leave
/// a receiver running in a namespace).
#[derive(Debug)]
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

/// A child's stdout lines that start with one of `ours` (the test
/// harness's lines around them left out).
pub fn child_lines(child: &mut Child, ours: &'static [&'static str]) -> impl Iterator<Item = String> + use<> {
    let out = child.stdout.take().expect("the child's stdout is piped");
    BufReader::new(out).lines().map_while(Result::ok).filter(move |l| ours.iter().any(|m| l.starts_with(m)))
}
