"""Hosts on one switch, for tests of several nodes on one machine: a
bridge in a network namespace of its own, one namespace per host joined
to it by a veth pair, and this (the test's) namespace joined to it too,
so the test reaches every host and the services it runs (etcd, the
summary) are reached from every host. Every host is at ``address(i)`` on
one /24; nothing else is routed. Needs root (``ip netns``); what is made
is removed by ``close()``.

A process runs on a host under ``ip netns exec``, which execs it: its pid
is the one the test started, its signals and exit status its own. The
namespaces share this machine's filesystem, so a node's pool directory,
shared memory and Unix sockets are reached from anywhere; only the
network is the host's."""

from __future__ import annotations

import os
import subprocess


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Switch:
    def __init__(self, hosts: int):
        tag = os.getpid() % 100_000
        self.subnet = f"10.180.{tag % 250}"
        self.switch = f"lake-vsw-{tag}"
        self.hosts: list[str] = []
        self._made: list[str] = []
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in range(hosts):
                ns = f"lake-vh{host}-{tag}"
                self._add(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                end = self._port(f"lkv{host}s{tag}", f"lkv{host}h{tag}")
                _ip("link", "set", end, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", end)
                _ip("-n", ns, "link", "set", end, "up")
                self.hosts.append(ns)
            # This namespace's port: removed with the switch's namespace,
            # which holds its peer.
            end = self._port(f"lkvts{tag}", f"lkvt{tag}")
            _ip("addr", "add", f"{self.here}/24", "dev", end)
            _ip("link", "set", end, "up")
        except OSError:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _port(self, port: str, end: str) -> str:
        """A veth pair whose ``port`` end is on the bridge; returns the
        other end, still in this namespace."""
        _ip("link", "add", port, "type", "veth", "peer", "name", end)
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        return end

    def address(self, host: int) -> str:
        """Host ``host``'s address."""
        return f"{self.subnet}.{host + 1}"

    @property
    def here(self) -> str:
        """The test's own address on the switch."""
        return f"{self.subnet}.254"

    def on(self, host: int) -> list[str]:
        """The prefix that runs a command on host ``host``."""
        return ["ip", "netns", "exec", self.hosts[host]]

    def close(self) -> None:
        for ns in reversed(self._made):
            try:
                _ip("netns", "del", ns)
            except OSError:
                pass
        self._made.clear()
