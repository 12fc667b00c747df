"""CNI networks for tests: Debian's plugins (bridge + host-local + portmap + loopback) on a private
/24 that no host address or route touches, written into a temporary conf dir, and everything
they make on the host removed afterwards.

``cni_network(tmp_path)`` yields a ``CniNetwork``: a /24 picked at random in ``POD_POOL`` and
checked against every host address and route (``auraed.vms.network.host_networks``), a bridge
``aurae-cni<hex>``, a network name ``aurae-test-<hex>`` and host-local's dataDir under
``tmp_path``. On exit it deletes the bridge (the bridge plugin never does), any iptables rule
still carrying the network's name (a DEL that failed) and the chains they jump to, portmap's
shared CNI-HOSTPORT-* chains when this network's test created them and nothing else uses them,
and puts net.ipv4.ip_forward back (the bridge plugin turns it on for the whole host). Those two
are the host's, shared by every network: under parallel test workers another worker's network may
be using them (or its portmap making the chains) right then, so there the session puts them back
once every worker is done (``host_snapshot`` and ``restore_host``, from tests/conftest.py).

``pod_namespaces(directory)`` pins a pod's namespaces and removes them after;
``listener_in(netns, port)`` runs a TCP server in a network namespace that answers every
connection with "hello from <peer address>"; ``probe(host, port)`` reads that answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import random
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from auraed.cni.model import DEFAULT_BIN_DIRS, CniSettings
from auraed.system.pod_namespaces import (
    PodNamespaces,
    PodNamespaceSpec,
    create_pod_namespaces,
    remove_pod_namespaces,
)
from auraed.vms.network import conflicts, host_networks
from tests.support import workers
from tests.support.workers import worker_share

POD_POOL = ipaddress.IPv4Network("10.214.0.0/16")
"""Where test pod subnets come from (beside the VM pool's default, 10.213.0.0/16)."""
PLUGINS = ("bridge", "host-local", "portmap", "loopback")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
HOSTPORT_CHAINS = ("CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-SETMARK", "CNI-HOSTPORT-MASQ")
# Where portmap hooks its shared chains in (portmap 1.1's rules, as `iptables -S` prints them).
HOSTPORT_JUMPS = (
    "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT",
    "-A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT",
    '-A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ',
)
LISTENER = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen()
print("ready", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(("hello from " + peer[0]).encode())
    conn.close()
"""


def missing_plugins() -> list[str]:
    """The Debian plugins the tests need that are not installed (hack/setup installs them)."""
    return [p for p in PLUGINS if not any((d / p).is_file() for d in DEFAULT_BIN_DIRS)]


def pick_subnet() -> ipaddress.IPv4Network:
    """A /24 of this test worker's share of POD_POOL (``worker_share``: no other worker picks from
    it) that overlaps no address or route of the host, tried in random order."""
    host = host_networks()
    candidates = list(worker_share(POD_POOL).subnets(new_prefix=24))
    random.shuffle(candidates)
    for subnet in candidates:
        if not conflicts(subnet, host):
            return subnet
    raise RuntimeError(f"every /24 of {POD_POOL} overlaps the host's network")


def nat_rules() -> list[str]:
    out = subprocess.run(["iptables", "-w", "-t", "nat", "-S"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", "-t", "nat", *args], capture_output=True, check=False)


@dataclasses.dataclass
class CniNetwork:
    name: str
    bridge: str
    subnet: ipaddress.IPv4Network
    conf_dir: Path
    data_dir: Path

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def bridge_plugin(self, ip_masq: bool = True) -> dict[str, Any]:
        return {
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": True,
            "ipMasq": ip_masq,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": str(self.subnet)}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(self.data_dir),
            },
        }

    def conflist(
        self, version: str = "1.0.0", portmap: bool = True, ip_masq: bool = True, extra: tuple[Any, ...] = ()
    ) -> dict[str, Any]:
        plugins: list[Any] = [self.bridge_plugin(ip_masq), *extra]
        if portmap:
            plugins.append({"type": "portmap", "capabilities": {"portMappings": True}})
        plugins.append({"type": "loopback"})
        return {"cniVersion": version, "name": self.name, "plugins": plugins}

    def write(self, doc: Any, filename: str = "10-aurae-test.conflist") -> Path:
        path = self.conf_dir / filename
        path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
        return path

    def settings(self, **changes: Any) -> CniSettings:
        return dataclasses.replace(CniSettings(conf_dir=self.conf_dir), **changes)

    def allocations(self) -> dict[str, str]:
        """host-local's leases: address -> the container id holding it."""
        directory = self.data_dir / self.name
        if not directory.is_dir():
            return {}
        return {
            path.name: path.read_text().splitlines()[0]
            for path in directory.iterdir()
            if path.name != "lock" and not path.name.startswith("last_reserved_ip")
        }

    def rules(self) -> list[str]:
        """The nat rules carrying this network's name (bridge's masquerade, portmap's DNAT)."""
        marker = f'name: \\"{self.name}\\"'
        return [rule for rule in nat_rules() if marker in rule]

    def remove_leftovers(self) -> None:
        """Rules and per-pod chains a failed DEL left (see the module's docstring)."""
        chains = set()
        for rule in self.rules():
            words = shlex.split(rule)
            if "-j" in words:
                target = words[words.index("-j") + 1]
                if target.startswith("CNI-") and target not in HOSTPORT_CHAINS:
                    chains.add(target)
            _iptables("-D", *words[1:])
        for chain in chains:
            _iptables("-F", chain)
            _iptables("-X", chain)


def _hostport_chains_present() -> bool:
    return any(f"-N {chain}" in nat_rules() for chain in HOSTPORT_CHAINS)


def _remove_hostport_chains_if_unused() -> None:
    rules = nat_rules()
    if any(rule.startswith("-A CNI-HOSTPORT-DNAT") for rule in rules):
        return  # another network's hostPorts are in use
    for jump in HOSTPORT_JUMPS:
        if jump in rules:
            _iptables("-D", *shlex.split(jump)[1:])
    for chain in HOSTPORT_CHAINS:
        _iptables("-F", chain)
        _iptables("-X", chain)


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """The host-wide state CNI networks change: ip_forward, and whether portmap's chains exist."""

    forwarding: str
    hostport_chains: bool


def host_snapshot() -> HostSnapshot:
    return HostSnapshot(IP_FORWARD.read_text(), _hostport_chains_present())


def restore_host(before: HostSnapshot) -> None:
    if not before.hostport_chains:
        _remove_hostport_chains_if_unused()
    IP_FORWARD.write_text(before.forwarding)


def _host_state_is_the_sessions() -> bool:
    """Under parallel workers the shared host state is put back by the session, at its end."""
    return workers.worker_count() > 1


@contextlib.contextmanager
def cni_network(tmp_path: Path) -> Iterator[CniNetwork]:
    token = f"{random.getrandbits(24):06x}"
    conf_dir = tmp_path / "net.d"
    conf_dir.mkdir()
    network = CniNetwork(
        name=f"aurae-test-{token}",
        bridge=f"aurae-cni{token}",
        subnet=pick_subnet(),
        conf_dir=conf_dir,
        data_dir=tmp_path / "ipam",
    )
    before = host_snapshot()
    try:
        yield network
    finally:
        subprocess.run(["ip", "link", "del", network.bridge], capture_output=True, check=False)
        network.remove_leftovers()
        if not _host_state_is_the_sessions():
            restore_host(before)


@contextlib.contextmanager
def pod_namespaces(directory: Path, spec: PodNamespaceSpec | None = None) -> Iterator[PodNamespaces]:
    pinned = create_pod_namespaces(directory, spec or PodNamespaceSpec())
    try:
        yield pinned
    finally:
        remove_pod_namespaces(directory)


def in_netns(netns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--net={netns}", *argv], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def listener_in(netns: str, port: int) -> Iterator[None]:
    process = subprocess.Popen(
        ["nsenter", f"--net={netns}", sys.executable, "-S", "-c", LISTENER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        yield
    finally:
        process.kill()
        process.wait()


def probe(host: str, port: int, timeout: float = 5.0) -> str:
    with socket.create_connection((host, port), timeout=timeout) as conn:
        return conn.recv(200).decode()


def free_port() -> int:
    """A loopback port of this test worker's own (``tests.support.workers``), free a moment ago."""
    return workers.free_port()
